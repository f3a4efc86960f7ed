"""What callers waiting for results cost a worker in the same process: `wait()` at scale.

    python benchmarks/waiters.py [--items N] [--waiters W] [--repeats R]
                                 [--postgres | --url postgresql://...] [--json]

One process, one store (a fresh SQLite file; with ``--postgres`` a schema on a throwaway
cluster, with ``--url`` on that server): W/10, then W, coroutines each wait
(`ControlStore.wait`) for an item of a paused project, one that never settles, while 8
coroutines claim and finish ``--items`` other items as fast as they can. For each count
(0 first, the baseline), in turns and repeated, it prints the worker's pairs per second
(the median), its ratio to the rate with nobody waiting, how many times the waiting
callers read their items while it ran (each reads its item twice before it waits; the
rest is what the worker's writes made them read), and how many reads the store's watch
of them made meanwhile (one statement each, for every item waited for).

A store keeps one watch of the items its callers wait for (`asyncplane._settles`): a
write of the process wakes that watch, which reads every item waited for in one
statement and wakes only the callers whose item settled. Before it, every write woke
every caller to read its own item. On 2026-12-05 (SQLite, the defaults: 3,000 items,
median of 3), 100 callers cut the worker to 0.31x of its rate alone and 1,000 to 0.28x
before; 0.89x and 0.67x after (docs/items.md, "Waiting for a result").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore

WORKERS = 8


async def _run(location: str, waiters: int, items: int) -> tuple[float, int, int]:
    """The worker's pairs per second beside ``waiters`` callers, their extra reads, and
    the reads the store's watch of them made meanwhile."""
    async with ControlStore(location) as store:
        await store.create_project("work", "Work")
        await store.create_project("held", "Held", status="paused")
        held = await store.enqueue_many("held", [{"n": n} for n in range(waiters)])
        await store.enqueue_many("work", [{"n": n} for n in range(items)])
        backend: Any = await store._engine.ready()  # counting its item reads, called through
        reads = [0]
        real = backend.get_item
        waiting = asyncio.Event()  # every caller has looked twice: it waits

        async def get_item(item_id: int, actor_id: str | None) -> Any:
            reads[0] += 1
            if reads[0] >= 2 * waiters:
                waiting.set()
            return await real(item_id, actor_id)

        backend.get_item = get_item
        watched = [0]
        ended_among = backend.ended_among

        async def counted(item_ids: list[int], states: tuple[str, ...]) -> list[int]:
            watched[0] += 1
            return await ended_among(item_ids, states)

        backend.ended_among = counted
        calls = [asyncio.create_task(store.wait(item_id, poll_interval=3600)) for item_id in held]
        if waiters:
            await waiting.wait()  # every caller waits before the clock starts
        first, watched_first = reads[0], watched[0]

        async def worker(n: int) -> None:
            claim = await store.claim(f"w{n}", project_id="work")
            while claim is not None:
                await store.finish(claim.item_id, fence=claim.fence)
                claim = await store.claim(f"w{n}", project_id="work")

        started = time.perf_counter()
        await asyncio.gather(*(worker(n) for n in range(WORKERS)))
        elapsed = time.perf_counter() - started
        extra, watch_reads = reads[0] - first, watched[0] - watched_first
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    return items / elapsed, extra, watch_reads


async def measure(args: argparse.Namespace, url: str | None) -> dict[str, Any]:
    counts = [0, args.waiters // 10, args.waiters]
    rates: dict[int, list[float]] = {w: [] for w in counts}
    reads: dict[int, list[int]] = {w: [] for w in counts}
    watch: dict[int, list[int]] = {w: [] for w in counts}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for waiters in counts:  # in turns: the machine's noise weighs on all alike
                location = await pg.fresh_store(url, folder, f"waiters-{repeat}-{waiters}")
                rate, extra, watch_reads = await _run(location, waiters, args.items)
                rates[waiters].append(rate)
                reads[waiters].append(extra)
                watch[waiters].append(watch_reads)
    alone = statistics.median(rates[0])
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "figures": {
            str(w): {
                "pairs_per_second": statistics.median(rates[w]),
                "ratio_to_alone": statistics.median(rates[w]) / alone,
                "reads_while_working": statistics.median(reads[w]),
                "watch_reads": statistics.median(watch[w]),
            }
            for w in counts
        },
    }


def main() -> None:
    ran = pg.run_benchmark(__doc__, measure, items=3000, waiters=1000, repeats=3)
    if ran is None:
        return
    args, report = ran
    print(
        f"a worker of {WORKERS} coroutines, {args.items:,} items, beside callers waiting, "
        f"{report['backend']}, median of {args.repeats}:"
    )
    for w, f in report["figures"].items():
        print(
            f"  {int(w):>5} waiting  {f['pairs_per_second']:>9,.0f} pairs/s  "
            f"{f['ratio_to_alone']:.2f}x alone  the callers' reads {f['reads_while_working']:,}, "
            f"the watch's {f['watch_reads']:,}"
        )


if __name__ == "__main__":
    main()
