"""What a fingerprint costs a claim and a finish: fingerprinted items against plain ones.

    python benchmarks/fingerprinted.py [--items N] [--repeats R] [--json]
    python benchmarks/fingerprinted.py --postgres        (the same on a throwaway cluster)
    python benchmarks/fingerprinted.py --url postgresql://...   (or on this server)

Two kinds of fresh store (SQLite files or PostgreSQL schemas) of one project get ``--items``
items, enqueued at once, then claimed and finished done one at a time by one coroutine:

* plain: items without a fingerprint;
* fingerprinted: each item with a content of its own, so each claim and finish moves it
  through its content's twin line (no twin waits), and a done finish looks for twins to
  settle (none).

It prints the median microseconds of a claim and of a finish, each the median of
``--repeats`` (the kinds in turns), and the ratio fingerprinted / plain. Target: at most
1.25x each. (The twin line's triggers of SQLite's migration 10 built a temporary list of
rows to hold back on every claim and finish of a fingerprinted item: 1.8x for the pair;
migration 12 finds the one row by a seek. On PostgreSQL each took five round trips,
most of them a transaction's: 2.3x and 1.9x; its migration 12 makes each one statement.)

The figures in docs/architecture.md ("What a fingerprint costs a claim") come from here.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore, Job

KINDS = ("plain", "fingerprinted")
OPERATIONS = ("claim", "finish")
TARGET = 1.25


async def fill(store: ControlStore, kind: str, items: int) -> None:
    """Project "p" of a fresh store, with ``items`` items of ``kind`` (one of `KINDS`):
    without a fingerprint, or each with a content of its own."""
    await store.create_project("p", "P")
    jobs = [
        Job({"n": n}, fingerprint=f"c{n}" if kind == "fingerprinted" else None)
        for n in range(items)
    ]
    await store.enqueue_many("p", jobs)


async def _costs(location: str, kind: str, items: int) -> dict[str, float]:
    """Median µs of each operation over ``items`` claims and finishes, on a fresh store."""
    seen: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    async with ControlStore(location) as store:
        await fill(store, kind, items)
        for _ in range(items):
            started = time.perf_counter()
            claim = await store.claim("worker")
            claimed = time.perf_counter()
            assert claim is not None
            await store.finish(claim.item_id, fence=claim.fence)
            seen["claim"].append(claimed - started)
            seen["finish"].append(time.perf_counter() - claimed)
    return {op: statistics.median(times) * 1e6 for op, times in seen.items()}


async def measure(items: int, repeats: int, url: str | None) -> dict[str, Any]:
    seen: dict[str, dict[str, list[float]]] = {k: {op: [] for op in OPERATIONS} for k in KINDS}
    with tempfile.TemporaryDirectory() as folder:
        for n in range(repeats):
            for kind in KINDS:
                location = await pg.fresh_store(url, folder, f"fingerprinted_{kind}_{n}")
                for op, us in (await _costs(location, kind, items)).items():
                    seen[kind][op].append(us)
    us = {k: {op: statistics.median(v) for op, v in seen[k].items()} for k in KINDS}
    ratio = {op: us["fingerprinted"][op] / us["plain"][op] for op in OPERATIONS}
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "items": items,
        "us": us,
        "fingerprinted / plain": ratio,
        "met": {op: r <= TARGET for op, r in ratio.items()},
    }


def main() -> None:
    ran = pg.run_benchmark(
        __doc__, lambda args, url: measure(args.items, args.repeats, url), items=3_000, repeats=3
    )
    if ran is None:
        return
    args, report = ran
    print(f"{args.items:,} items, {report['backend']}, median µs (median of {args.repeats}):")
    print(f"  {'':<8} {'plain':>8} {'fingerprinted':>14} {'ratio':>7}")
    for op in OPERATIONS:
        plain, fingerprinted = (report["us"][k][op] for k in KINDS)
        verdict = "met" if report["met"][op] else "MISSED"
        ratio = report["fingerprinted / plain"][op]
        print(f"  {op:<8} {plain:8.1f} {fingerprinted:14.1f} {ratio:6.2f}x  {verdict}")
    print(f"  target: fingerprinted / plain <= {TARGET}x")


if __name__ == "__main__":
    main()
