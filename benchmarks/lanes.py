"""Lane-queue speed: bulk enqueue against raw executemany, and claim cost against depth.

    python benchmarks/lanes.py [--items 100000] [--deep 1000000] [--repeats 3]

1. enqueue_many of --items payloads (each with a priority and a fingerprint, no dedup
   hits) beside a raw sqlite3 baseline in the same run: one transaction, executemany of
   the same item rows and of their "queued" event rows, on the same schema. Target:
   asyncplane >= 0.5x raw.
2. The cost of a claim with 1,000 ready items and with --deep ready items (priorities,
   service classes and SLAs mixed, so the full claim order applies). Measured twice: the
   whole `await store.claim()`, and the claim transaction alone on the connection's
   thread (what the index decides, without the thread hand-off around it). Target: the
   deep claim at most 1.5x the shallow one.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import pathlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time

from asyncplane import ControlStore, Job, _backend, _clock, _connection, _sqlite, _writer
from asyncplane import _sqlite_sql as sql


def jobs(count: int) -> list[Job]:
    rng = random.Random(7)
    return [
        Job(
            {"task": f"summarise document {n}", "n": n},
            priority=rng.randint(0, 3),
            service_class=rng.choice(("standard", "realtime")),
            sla=None if n % 3 else 1.9e9 + n,
            fingerprint=f"fp-{n}",
        )
        for n in range(count)
    ]


async def new_store(path: pathlib.Path) -> ControlStore:
    store = ControlStore(path)
    await store.create_project("bench", "Benchmark")
    return store


async def time_enqueue_many(path: pathlib.Path, batch: list[Job]) -> float:
    store = await new_store(path)
    try:
        started = time.perf_counter()
        ids = await store.enqueue_many("bench", batch)
        elapsed = time.perf_counter() - started
    finally:
        await store.close()
    assert len(set(ids)) == len(batch)
    return elapsed


def time_raw_executemany(path: pathlib.Path, batch: list[Job]) -> float:
    asyncio.run(_create(path))
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = NORMAL")
    started = time.perf_counter()
    now = time.time()
    conn.execute("BEGIN IMMEDIATE")
    base = conn.execute(sql.LAST_ITEM_ID).fetchone()[0]
    conn.executemany(
        sql.INSERT_ITEM,
        [
            ("bench", "ready", json.dumps(job.payload), job.priority, job.service_class,
             job.sla, job.fingerprint, 1, None, None, now, now, None)
            for job in batch
        ],
    )  # fmt: skip
    conn.executemany(
        sql.INSERT_EVENT,
        [(base + 1 + n, "queued", 0, None, None, now, None) for n in range(len(batch))],
    )
    conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


async def _create(path: pathlib.Path) -> None:
    store = await new_store(path)
    await store.close()


def fill(path: pathlib.Path, ready: int) -> None:
    """A store with ``ready`` ready items in mixed lanes, written in bulk."""
    asyncio.run(_create(path))
    rng = random.Random(3)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    chunk = 50_000
    for start in range(0, ready, chunk):
        rows = [
            ("bench", "ready", "{}", rng.randint(0, 3), rng.choice(("standard", "realtime")),
             rng.choice((None, rng.uniform(1.8e9, 1.9e9))), None, 1, None, None, 0.0, 0.0, None)
            for _ in range(start, min(ready, start + chunk))
        ]  # fmt: skip
        conn.executemany(sql.INSERT_ITEM, rows)
    conn.execute("COMMIT")
    conn.close()


async def time_store_claims(path: pathlib.Path, claims: int) -> float:
    async with ControlStore(path) as store:
        await store.counts()
        started = time.perf_counter()
        for _ in range(claims):
            assert await store.claim("w") is not None
        return (time.perf_counter() - started) / claims


def time_claim_transactions(path: pathlib.Path, claims: int) -> float:
    """The claim operation alone, run as the writer runs it, on one plain connection."""
    conn = sqlite3.connect(path, isolation_level=None)
    # As the store's writer has it:
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(f"PRAGMA cache_size = -{_connection.WRITER_CACHE_KIB}")
    clock = _clock.SystemClock()
    claim = _backend.ClaimOp("w", 1, 900.0, None, None)
    op = functools.partial(_sqlite._claim_many, [claim])
    started = time.perf_counter()
    for _ in range(claims):
        outcomes, _, _ = _writer._transact([op], conn, clock, None, None)
        assert outcomes[0][0]
    elapsed = (time.perf_counter() - started) / claims
    conn.close()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--deep", type=int, default=1_000_000)
    parser.add_argument("--shallow", type=int, default=1_000)
    parser.add_argument("--claims", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    batch = jobs(args.items)
    ours, raw = [], []
    claim_cost: dict[str, list[float]] = {
        f"{kind} {depth}": [] for kind in ("store", "transaction") for depth in ("shallow", "deep")
    }
    with tempfile.TemporaryDirectory(prefix="asyncplane-lanes-") as tmp:
        root = pathlib.Path(tmp)
        for repeat in range(args.repeats):
            raw.append(time_raw_executemany(root / f"raw{repeat}.db", batch))
            ours.append(asyncio.run(time_enqueue_many(root / f"ours{repeat}.db", batch)))
        depths = (("shallow", args.shallow), ("deep", args.deep))
        for label, depth in depths:
            fill(root / f"{label}-store.db", depth + args.claims * args.repeats)
            fill(root / f"{label}-tx.db", depth + args.claims * args.repeats)
        # Shallow and deep take turns, so a noisy neighbour weighs on both alike.
        for _ in range(args.repeats):
            for label, _depth in depths:
                claim_cost[f"store {label}"].append(
                    asyncio.run(time_store_claims(root / f"{label}-store.db", args.claims))
                )
                claim_cost[f"transaction {label}"].append(
                    time_claim_transactions(root / f"{label}-tx.db", args.claims)
                )
    enqueue = {
        "asyncplane items/s": args.items / statistics.median(ours),
        "raw executemany items/s": args.items / statistics.median(raw),
    }
    enqueue_ratio = statistics.median(raw) / statistics.median(ours)
    costs = {label: statistics.median(values) * 1e6 for label, values in claim_cost.items()}
    depth_ratios = {
        "store": costs["store deep"] / costs["store shallow"],
        "transaction": costs["transaction deep"] / costs["transaction shallow"],
    }
    if args.json:
        print(json.dumps({"enqueue": enqueue, "enqueue_ratio": enqueue_ratio,
                          "claim_us": costs, "depth_ratios": depth_ratios}))  # fmt: skip
        return 0
    print(f"enqueue_many of {args.items:,} items, median of {args.repeats}:")
    for label, rate in enqueue.items():
        print(f"  {label:<24} {rate:>10,.0f}")
    verdict = "meets" if enqueue_ratio >= 0.5 else "MISSES"
    print(f"  asyncplane / raw          {enqueue_ratio:5.2f}x  ({verdict} target 0.5x)")
    print(f"claim cost at {args.shallow:,} and {args.deep:,} ready items (µs per claim):")
    for label, cost in costs.items():
        print(f"  {label:<24} {cost:>8.1f}")
    for label, ratio in depth_ratios.items():
        verdict = "meets" if ratio <= 1.5 else "MISSES"
        print(f"  deep / shallow, {label:<12} {ratio:5.2f}x  ({verdict} target <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
