"""Claim+finish round trips per second: asyncplane beside raw sqlite3, in the same run.

    python benchmarks/claim_finish.py [--items N] [--repeats R] [--synchronous NORMAL|FULL]

Three measurements on fresh files with the same schema (asyncplane's own, so indexes
and the ledger trigger are identical), each repeated and interleaved so that a noisy
neighbour hits all of them alike:

* raw: one plain sqlite3 connection, one BEGIN IMMEDIATE transaction per claim and one
  per finish, each writing its event row: the fastest honest way to do this by hand;
* asyncplane with 1 coroutine claiming and finishing in a loop;
* asyncplane with 64 coroutines doing the same on one store (group commit);
* both again with each finish carrying the next claim (``finish_and_claim``: one write
  round an item instead of two), labelled "finish_and_claim".

It prints each rate (the median of the repeats) and the ratios to raw. Targets:
64 coroutines >= 3.0x raw, 1 coroutine >= 0.4x raw (issue 17), shown for both ways.

asyncplane's sides run on the event loop asyncplane's own commands choose
(`asyncplane._loops`): uvloop when it is installed (the ``speed`` extra), else asyncio's;
``ASYNCPLANE_LOOP=asyncio`` keeps asyncio's. The report names it.

It also measures the floor under any thread-per-connection design on this machine: the
round trip of a no-op call to an aiosqlite connection's thread. One claim and one finish
cost two such round trips whatever asyncplane does, so a single coroutine can at best
reach raw_pair / (raw_pair + 2 * floor) of the raw rate; the report prints that bound.
On virtual machines, where waking a thread on an idle virtual CPU is slow, the bound can
sit below the 1-coroutine target; run under ``taskset -c 0`` to see the same code with
cheap wake-ups.

``--what-if-on-loop`` measures a design asyncplane does not ship: every SQLite call made
directly on the event-loop thread (no thread round trips at all), by patching the store's
two connection hooks (`run`, `post`) for this process. It shows what the thread
hand-offs cost, as evidence for the design decision; it is not a mode to run a store in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

import _raw
import aiosqlite

from asyncplane import ControlStore, _connection, _loops

T = TypeVar("T")


async def prepare(path: pathlib.Path, items: int, synchronous: str) -> None:
    """Create the schema through asyncplane, and the items in one transaction."""
    async with ControlStore(path, synchronous=synchronous) as store:  # type: ignore[arg-type]
        await store.create_project("bench", "Benchmark")
    _raw.seed(str(path), "bench", items)


def run_raw(path: pathlib.Path, synchronous: str) -> tuple[int, float]:
    conn = _raw.connect(str(path), synchronous)
    started = time.perf_counter()
    done, _ = _raw.drain(conn, "raw")
    elapsed = time.perf_counter() - started
    conn.close()
    return done, elapsed


async def run_store(
    path: pathlib.Path, coroutines: int, synchronous: str, fused: bool = False
) -> tuple[int, float, str]:
    """Claim and finish every item with ``coroutines`` coroutines (``fused``: each finish
    with the next claim, `ControlStore.finish_and_claim`): how many, how long, and on
    which event loop (`asyncplane._loops.running`)."""
    async with ControlStore(path, synchronous=synchronous) as store:  # type: ignore[arg-type]
        await store.projects()  # opened before the clock starts
        counts = [0] * coroutines

        async def worker(index: int) -> None:
            owner = f"w{index}"
            claim = await store.claim(owner=owner)
            while claim is not None:
                if fused:
                    following = await store.finish_and_claim(
                        claim.item_id, fence=claim.fence, owner=owner
                    )
                else:
                    await store.finish(claim.item_id, fence=claim.fence)
                    following = await store.claim(owner=owner)
                counts[index] += 1
                claim = following

        started = time.perf_counter()
        await asyncio.gather(*(worker(n) for n in range(coroutines)))
        elapsed = time.perf_counter() - started
    return sum(counts), elapsed, _loops.running()


async def thread_round_trip_us(calls: int = 5000) -> float:
    """The median cost of one no-op call to an aiosqlite connection's thread, in µs."""
    async with aiosqlite.connect(":memory:") as conn:
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls // 5):
                await conn._execute(int)  # the same hook asyncplane uses for a round
            samples.append((time.perf_counter() - started) / (calls // 5) * 1e6)
    return statistics.median(samples)


ON_LOOP_CALLS = [0]  # store calls made on the event-loop thread (what-if only)


def run_on_loop() -> None:
    """What-if only: make every store call run on the event-loop thread, in this process."""
    connect = aiosqlite.connect

    def connect_any_thread(*args: Any, **kwargs: Any) -> aiosqlite.Connection:
        return connect(*args, **kwargs, check_same_thread=False)

    async def run_here(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
        ON_LOOP_CALLS[0] += 1
        return fn(conn._conn, *args)

    def post_here(conn: aiosqlite.Connection, fn: Callable[..., None], *args: Any) -> None:
        ON_LOOP_CALLS[0] += 1
        fn(conn._conn, *args)  # a round: it hands its outcomes to the loop itself

    aiosqlite.connect = connect_any_thread  # type: ignore[assignment]
    _connection.run = run_here
    _connection.post = post_here


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--what-if-on-loop",
        action="store_true",
        help="measure an unsupported design: SQLite calls on the event-loop thread",
    )
    args = parser.parse_args()
    if args.what_if_on_loop:
        run_on_loop()

    rates: dict[str, list[float]] = {
        "raw": [],
        "1 coroutine": [],
        "64 coroutines": [],
        "1 coroutine, finish_and_claim": [],
        "64 coroutines, finish_and_claim": [],
    }
    loops: set[str] = set()  # the event loops asyncplane's sides ran on
    with tempfile.TemporaryDirectory(prefix="asyncplane-bench-") as tmp:
        for repeat in range(args.repeats):
            for label in rates:
                path = pathlib.Path(tmp) / f"{repeat}-{label.replace(' ', '-').replace(',', '')}.db"
                asyncio.run(prepare(path, args.items, args.synchronous))
                if label == "raw":
                    done, elapsed = run_raw(path, args.synchronous)
                else:
                    coroutines, fused = int(label.split()[0]), label.endswith("finish_and_claim")
                    done, elapsed, loop = _loops.run(
                        run_store(path, coroutines, args.synchronous, fused)
                    )
                    loops.add(loop)
                if done != args.items:
                    print(f"{label}: finished {done} of {args.items} items", file=sys.stderr)
                    return 1
                rates[label].append(done / elapsed)

    floor_us = _loops.run(thread_round_trip_us())
    median = {label: statistics.median(values) for label, values in rates.items()}
    ratios = {f"{label} / raw": median[label] / median["raw"] for label in median if label != "raw"}
    targets = {label: 0.4 if label.startswith("1 ") else 3.0 for label in ratios}
    raw_pair_us = 1e6 / median["raw"]
    bound = raw_pair_us / (raw_pair_us + 2 * floor_us)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.json:
        print(
            json.dumps(
                {
                    "rates": median,
                    "ratios": ratios,
                    "targets": targets,
                    "thread_round_trip_us": floor_us,
                    "one_coroutine_bound": bound,
                    "cpus": cpus,
                    "event_loop": ",".join(sorted(loops)),
                    "what_if_on_loop": args.what_if_on_loop,
                    "calls_on_loop": ON_LOOP_CALLS[0],
                }
            )
        )
    else:
        print(
            f"claim+finish round trips per second, {args.items} items, "
            f"synchronous={args.synchronous}, median of {args.repeats}, {cpus} CPUs, "
            f"on {','.join(sorted(loops))}"
        )
        if args.what_if_on_loop:
            print("  WHAT-IF: SQLite called on the event-loop thread (not a supported mode)")
        for label, rate in median.items():
            print(f"  {label:<31} {rate:>9,.0f}/s")
        for label, ratio in ratios.items():
            verdict = "meets" if ratio >= targets[label] else "MISSES"
            print(f"  {label:<37} {ratio:5.2f}x  ({verdict} target {targets[label]}x)")
        print(
            f"  thread round trip (aiosqlite no-op): {floor_us:.0f} us; "
            f"a single coroutine can reach at most {bound:.2f}x raw here"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
