"""A fleet under a provider's quota, with a sweep on a timetable.

An LLM provider allows the fleet 600 requests a minute (10 a second, with a burst of 20)
and 8 at once, whatever the number of workers and hosts. The store enforces both in each
claim's own transaction, so three workers started side by side (three processes, or
three hosts, in a real fleet) together never go past either; nothing in the workers
counts anything. A schedule enqueues a "sweep" every two seconds, once per tick, although
every worker runs the schedules.

    python examples/quota.py [DATABASE | URL]  # default: a fresh file in a temp directory
"""

from __future__ import annotations

import asyncio
import datetime as dt
import pathlib
import sys
import tempfile

from asyncplane import ClaimedItem, ControlStore, Done, Outcome, verify_ledger, work

PROMPTS = 60


async def worker(location: str, name: str, stop: asyncio.Event) -> int:
    """One worker of the fleet: its own store (its own connections), work() at 16 at once."""

    async def call_the_model(claim: ClaimedItem) -> Outcome:
        await asyncio.sleep(0.05)  # the provider answering
        return Done({"answer": f"re: {claim.payload.get('prompt', 'sweep')}"})

    async with ControlStore(location) as store:
        summary = await work(store, call_the_model, concurrency=16, owner=name, stop=stop)
    return summary.done


async def main(location: str) -> None:
    async with ControlStore(location) as store:
        await store.create_project("llm", "Calls to the provider")
        await store.set_limits("llm", max_running=8, per_minute=600, burst=20)
        await store.set_schedule(
            "sweep", project_id="llm", payload={"task": "sweep"}, every=dt.timedelta(seconds=2)
        )
        ids = await store.enqueue_many("llm", [{"prompt": f"q{n}"} for n in range(PROMPTS)])
        print(f"limits: {await store.limits('llm')}")

        stop = asyncio.Event()
        started = asyncio.get_running_loop().time()
        workers = [
            asyncio.create_task(worker(location, f"worker-{n}", stop), name=f"worker-{n}")
            for n in range(3)
        ]
        for item_id in ids:  # the producer's side: each answer, as it settles
            await store.wait(item_id, timeout=120)
        stop.set()
        done = sum(await asyncio.gather(*workers))
        elapsed = asyncio.get_running_loop().time() - started

        events = []  # the ledger says what the fleet did, whichever worker did it
        for row in await store.items(project_id="llm", state="done", limit=1000):
            events += await store.events(row["item_id"])
        claims = [e["at"].timestamp() for e in events if e["event_type"] == "claimed"]
        running = most_at_once = 0
        for event in sorted(events, key=lambda e: e["event_id"]):
            running += {"claimed": 1, "done": -1}.get(event["event_type"], 0)
            most_at_once = max(most_at_once, running)
        most_in_a_second = max(
            sum(1 for t in claims if start <= t < start + 1.0) for start in claims
        )
        sweeps = [t["tick"] for t in await store.schedule_ticks("sweep")]
        print(f"{done} calls answered by 3 workers in {elapsed:.1f} s")
        print(f"at most {most_at_once} calls at once (the quota allows 8)")
        print(f"at most {most_in_a_second} claims in any second (the quota allows 10 + 20)")
        print(f"sweeps enqueued: {len(sweeps)}, one per tick: {len(set(sweeps)) == len(sweeps)}")
        problems = await verify_ledger(store)
        print("verify_ledger:", problems if problems else "clean")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(str(pathlib.Path(tmp) / "quota.db")))
