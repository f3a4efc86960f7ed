"""An operator's day with one store: find what failed, cancel what must stop, requeue.

A producer enqueues briefs and waits for their answers; a drain works through them. Some
fail (a rate limit), one brief turns out wrong while its agent is running, and the
operator, in the same process as a plain coroutine, does what the `asyncplane items /
cancel / requeue` commands do from a shell:

* `items(state="failed")` finds the failures and why;
* `cancel()` stops the running agent: the drain's next lease renewal is refused with
  ItemCancelled and the drain cancels its executor;
* `requeue_where(error_contains="rate limit")` runs the rate-limited ones again with a
  fresh attempt budget, and the producer's `wait()` gets their answers.

    python examples/operating_items.py [DATABASE | URL]  # default: a fresh file in a temp directory
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import tempfile
from typing import Any

from asyncplane import ClaimedItem, ControlStore, Done, Failed, Outcome, drain, verify_ledger

LEASE_SECONDS = 0.6  # short, so the drain renews (and hears of the cancel) every 0.2 s


async def main(location: str) -> None:
    async with ControlStore(location, lease_seconds=LEASE_SECONDS) as store:
        await store.create_project("research", "Research")
        briefs = [f"brief {n}" for n in range(6)] + ["the wrong brief"]
        ids = {brief: await store.enqueue("research", {"brief": brief}) for brief in briefs}
        rate_limited = {ids["brief 1"], ids["brief 4"]}  # fail the first time they run
        limited_once: set[int] = set()
        running = asyncio.Event()
        stopped: list[int] = []

        async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
            (item,) = batch
            if item.payload["brief"] == "the wrong brief":
                running.set()
                try:
                    await asyncio.Event().wait()  # an agent that would run for hours
                except asyncio.CancelledError:
                    stopped.append(item.item_id)
                    raise
            if item.item_id in rate_limited and item.item_id not in limited_once:
                limited_once.add(item.item_id)
                return [Failed("rate limit reached, try later")]
            return [Done({"answer": f"notes on {item.payload['brief']}"})]

        drainer = asyncio.create_task(drain(store, execute, batch_size=1, mode="daemon"))
        await running.wait()
        state = await store.cancel(ids["the wrong brief"], reason="the brief was wrong")
        print(f"cancelled the running item {ids['the wrong brief']}: {state}")
        answers = await asyncio.gather(
            *(store.wait(ids[b], timeout=30) for b in briefs if b != "the wrong brief")
        )
        failed = await store.items(state="failed")
        for row in failed:
            print(f"failed: item {row['item_id']} ({row['payload']['brief']}): {row['error']}")
        again = await store.requeue_where(state="failed", error_contains="rate limit")
        print(f"requeued {again} rate-limited items")
        second: list[dict[str, Any]] = await asyncio.gather(
            *(store.wait(item_id, timeout=30) for item_id in sorted(rate_limited))
        )
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        done = sum(a["state"] == "done" for a in [*answers, *second])
        halted = stopped == [ids["the wrong brief"]]
        print(f"answers: {done} done; the running agent stopped: {halted}")
        print(f"counts: {await store.counts()}")
        problems = await verify_ledger(store)
        print(f"verify_ledger: {problems or 'clean'}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(str(pathlib.Path(tmp) / "operating.db")))
