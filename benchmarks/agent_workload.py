"""An agent fleet's workload: items whose calls take from milliseconds to seconds.

    python benchmarks/agent_workload.py [--items N] [--concurrency C] [--json]

``--items`` items (2,000 by default) whose handler sleeps a latency drawn, seeded, from
a lognormal distribution with a median of 50 ms and a 99th percentile of about 1 s, the
long tail of an LLM provider. The same latencies run, in the same run, through:

* the ideal: an in-memory ``asyncio.Queue`` with C consumer tasks (no durability at all;
  nothing could be faster with C slots);
* ``work()`` in one process with C slots, on an SQLite file;
* ``work()`` in 4 processes with C / 4 slots each, on the same file (timed from the
  moment all four are up, so process start-up is not counted);
* the batch ``drain()`` at ``batch_size=C``, whose executor runs a batch's items
  together: each batch waits for its slowest item.

It prints each throughput (items per second) and its ratio to the ideal. Targets: work()
in one process at least 0.95 of the ideal, in 4 processes at least 0.90.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import _raw

from asyncplane import ClaimedItem, ControlStore, Done, Outcome, drain, work

MEDIAN = 0.05
P99 = 1.0
#: sigma so that exp(mu + 2.326 * sigma) is the 99th percentile.
SIGMA = math.log(P99 / MEDIAN) / 2.326


def latencies(count: int, seed: int = 11) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(math.log(MEDIAN), SIGMA) for _ in range(count)]


async def _seeded(path: pathlib.Path, delays: list[float]) -> None:
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue_many("p", [{"latency": d} for d in delays])


async def handle(claim: ClaimedItem) -> Done:
    await asyncio.sleep(claim.payload["latency"])
    return Done()


async def ideal(delays: list[float], concurrency: int) -> float:
    queue: asyncio.Queue[float] = asyncio.Queue()
    for delay in delays:
        queue.put_nowait(delay)

    async def consumer() -> None:
        while not queue.empty():  # noqa: ASYNC110 - the sleep is the work itself
            await asyncio.sleep(queue.get_nowait())

    started = time.perf_counter()
    await asyncio.gather(*(consumer() for _ in range(concurrency)))
    return time.perf_counter() - started


async def one_process(path: pathlib.Path, delays: list[float], concurrency: int) -> float:
    await _seeded(path, delays)
    async with ControlStore(path) as store:
        started = time.perf_counter()
        summary = await work(store, handle, concurrency=concurrency, until_empty=True)
        elapsed = time.perf_counter() - started
    assert summary.done == len(delays), summary
    return elapsed


async def batch_drain(path: pathlib.Path, delays: list[float], concurrency: int) -> float:
    await _seeded(path, delays)

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        return list(await asyncio.gather(*(handle(claim) for claim in batch)))

    async with ControlStore(path) as store:
        started = time.perf_counter()
        summary = await drain(store, execute, batch_size=concurrency, empty_rounds=1)
        elapsed = time.perf_counter() - started
    assert summary.done == len(delays), summary
    return elapsed


_WORKER = """
import asyncio, sys
from asyncplane import ControlStore, Done, work
async def handle(claim):
    await asyncio.sleep(claim.payload["latency"])
    return Done()
async def main():
    async with ControlStore(sys.argv[1]) as store:
        await store.stats()  # opened and warm
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        summary = await work(store, handle, concurrency=int(sys.argv[2]), until_empty=True,
                             poll_interval=0.01)
        print(summary.done, flush=True)
asyncio.run(main())
"""


async def four_processes(path: pathlib.Path, delays: list[float], concurrency: int) -> float:
    await _seeded(path, delays)
    share = max(1, concurrency // 4)
    command = [sys.executable, "-c", _WORKER, str(path), str(share)]
    pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    # Started before the clock runs; their start-up is not measured.
    children = [subprocess.Popen(command, **pipes) for _ in range(4)]  # noqa: ASYNC220
    started = _raw.start_together(children)
    done = 0
    for child in children:
        assert child.stdout is not None
        done += int(await asyncio.to_thread(child.stdout.readline))
    elapsed = time.perf_counter() - started
    for child in children:
        child.communicate(timeout=60)
    assert done == len(delays), done
    return elapsed


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--skip-drain", action="store_true", help="leave the batch drain out")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    delays = latencies(args.items)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="asyncplane-bench-agents-") as tmp:
        here = pathlib.Path(tmp)
        results["ideal (asyncio.Queue)"] = await ideal(delays, args.concurrency)
        results["work(), 1 process"] = await one_process(here / "one.db", delays, args.concurrency)
        results["work(), 4 processes"] = await four_processes(
            here / "four.db", delays, args.concurrency
        )
        if not args.skip_drain:
            results["drain(), batches"] = await batch_drain(
                here / "drain.db", delays, args.concurrency
            )
    base = results["ideal (asyncio.Queue)"]
    report: dict[str, Any] = {
        "items": args.items,
        "concurrency": args.concurrency,
        "throughput": {name: args.items / seconds for name, seconds in results.items()},
        "ratio_to_ideal": {name: base / seconds for name, seconds in results.items()},
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.items:,} items, lognormal latency (median {MEDIAN * 1000:.0f} ms, p99 "
          f"{P99:g} s), {args.concurrency} slots")  # fmt: skip
    for name in results:
        print(f"  {name:<24} {report['throughput'][name]:>8.1f} items/s  "
              f"{report['ratio_to_ideal'][name]:>5.2f} of the ideal")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
