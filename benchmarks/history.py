"""What a content's history costs: a content run again and again against one run once.

    python benchmarks/history.py [--cycles N] [--repeats R] [--json]
    python benchmarks/history.py --postgres        (the same on a throwaway cluster)
    python benchmarks/history.py --url postgresql://...   (or on this server)

Two fresh stores (SQLite files or PostgreSQL schemas) of one project go through the same
``--cycles`` cycles, each an item enqueued with a fingerprint and dedup off, claimed and
finished done, then the same content enqueued with dedup on (which finds the done twin
and adds nothing). They differ in the content only:

* fresh: each cycle its own content, so every look at a content's twins finds one;
* recurring: one content every cycle (a schedule's, or a task an agent runs again with
  dedup off), so by the end it has ``--cycles`` done twins.

Both stores grow alike; the recurring content's history is the one difference. For the
finish (which settles the content's pending twins) and the dedup enqueue (which looks for
its oldest done twin), the cost in microseconds of the last tenth of the cycles, median of
``--repeats`` (the kinds in turns), and the ratio recurring / fresh. Target: at most 1.25x
for each, a content's history never read (both once read every twin the content ever had,
and grew with it: 3.3x and 5.3x over 5,000 cycles on SQLite).

The figures in docs/architecture.md ("A content's history") come from here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore

KINDS = ("fresh", "recurring")
OPERATIONS = ("finish", "dedup enqueue")
TARGET = 1.25


async def _costs(location: str, kind: str, cycles: int) -> dict[str, float]:
    """µs of each operation in the last tenth of the cycles, on a fresh store."""
    seen: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    async with ControlStore(location) as store:
        await store.create_project("p", "P")
        for n in range(cycles):
            content = "again" if kind == "recurring" else f"content-{n}"
            await store.enqueue("p", {"n": n}, fingerprint=content, dedup=False)
            claim = await store.claim("worker")
            assert claim is not None
            started = time.perf_counter()
            await store.finish(claim.item_id, fence=claim.fence)
            seen["finish"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await store.enqueue("p", {"n": n}, fingerprint=content)
            seen["dedup enqueue"].append(time.perf_counter() - started)
    tenth = max(1, cycles // 10)
    return {op: statistics.median(times[-tenth:]) * 1e6 for op, times in seen.items()}


async def measure(cycles: int, repeats: int, url: str | None) -> dict[str, Any]:
    seen: dict[str, dict[str, list[float]]] = {k: {op: [] for op in OPERATIONS} for k in KINDS}
    with tempfile.TemporaryDirectory() as folder:
        for n in range(repeats):
            for kind in KINDS:
                name = f"{kind}_{n}"
                location = await pg.fresh_store(url, folder, f"history_{name}")
                for op, us in (await _costs(location, kind, cycles)).items():
                    seen[kind][op].append(us)
    us = {k: {op: statistics.median(v) for op, v in seen[k].items()} for k in KINDS}
    ratio = {op: us["recurring"][op] / us["fresh"][op] for op in OPERATIONS}
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "cycles": cycles,
        "us_last_tenth": us,
        "recurring / fresh": ratio,
        "met": {op: r <= TARGET for op, r in ratio.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    pg.add_postgres_arguments(parser)
    args = parser.parse_args()
    report = pg.measured_on(args, lambda url: measure(args.cycles, args.repeats, url))
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{args.cycles:,} cycles, {report['backend']}, µs in the last tenth "
        f"(median of {args.repeats}):"
    )
    print(f"  {'':<14} {'fresh':>8} {'recurring':>10} {'ratio':>7}")
    for op in OPERATIONS:
        fresh, recurring = (report["us_last_tenth"][k][op] for k in KINDS)
        ratio = report["recurring / fresh"][op]
        verdict = "met" if report["met"][op] else "MISSED"
        print(f"  {op:<14} {fresh:8.1f} {recurring:10.1f} {ratio:6.2f}x  {verdict}")
    print(f"  target: recurring / fresh <= {TARGET}x")


if __name__ == "__main__":
    main()
