"""What a content's history and backlog cost: a content run again and again, or with a
backlog, against one run once.

    python benchmarks/history.py [--cycles N] [--repeats R] [--json]
    python benchmarks/history.py --postgres        (the same on a throwaway cluster)
    python benchmarks/history.py --url postgresql://...   (or on this server)

Three fresh stores (SQLite files or PostgreSQL schemas) of one project go through the same
``--cycles`` cycles, each an item enqueued with a fingerprint and dedup off, claimed and
finished done, then the same content enqueued with dedup on (which finds the done twin
and adds nothing). They differ in the content only:

* fresh: each cycle its own content, so every look at a content's twins finds one;
* recurring: one content every cycle (a schedule's, or a task an agent runs again with
  dedup off), so by the end it has ``--cycles`` done twins;
* backlog: one content every cycle, which has besides ``--cycles`` twins enqueued with
  dedup off and due later (deferred), there from the start: a content enqueued faster
  than it runs.

The stores grow alike; the recurring content's history and the backlog are the
differences. For the enqueue with dedup off (which takes the item's place in its
content's line), the finish (which settles the content's pending twins enqueued with
dedup) and the dedup enqueue (which looks for its oldest done twin), the cost in
microseconds of the last tenth of the cycles, median of ``--repeats`` (the kinds in
turns), and the ratio to fresh. Target: at most 1.25x for each, a content's history and
backlog never read. (The history once was, and grew with the content: 3.3x and 5.3x over
5,000 cycles on SQLite; the backlog was read by each finish on both backends, and by each
enqueue on PostgreSQL, in the twin line's trigger.)

The figures in docs/architecture.md ("A content's history") come from here.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore, Job

KINDS = ("fresh", "recurring", "backlog")
COMPARED = KINDS[1:]  # each against fresh
OPERATIONS = ("enqueue", "finish", "dedup enqueue")
TARGET = 1.25


async def _costs(location: str, kind: str, cycles: int) -> dict[str, float]:
    """µs of each operation in the last tenth of the cycles, on a fresh store."""
    seen: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    async with ControlStore(location) as store:
        await store.create_project("p", "P")
        if kind == "backlog":
            later = [Job({"n": n}, fingerprint="again", not_before=4e9) for n in range(cycles)]
            await store.enqueue_many("p", later, dedup=False)
        for n in range(cycles):
            content = f"content-{n}" if kind == "fresh" else "again"
            started = time.perf_counter()
            await store.enqueue("p", {"n": n}, fingerprint=content, dedup=False)
            seen["enqueue"].append(time.perf_counter() - started)
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
    ratio = {k: {op: us[k][op] / us["fresh"][op] for op in OPERATIONS} for k in COMPARED}
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "cycles": cycles,
        "us_last_tenth": us,
        "to fresh": ratio,
        "met": {k: {op: r <= TARGET for op, r in ratio[k].items()} for k in COMPARED},
    }


def main() -> None:
    ran = pg.run_benchmark(
        __doc__, lambda args, url: measure(args.cycles, args.repeats, url), cycles=5_000, repeats=3
    )
    if ran is None:
        return
    args, report = ran
    print(
        f"{args.cycles:,} cycles, {report['backend']}, µs in the last tenth "
        f"(median of {args.repeats}):"
    )
    print(f"  {'':<14} {'fresh':>8} " + " ".join(f"{k:>10} {'ratio':>7}" for k in COMPARED))
    for op in OPERATIONS:
        line = f"  {op:<14} {report['us_last_tenth']['fresh'][op]:8.1f} "
        for kind in COMPARED:
            verdict = "" if report["met"][kind][op] else " MISSED"
            line += f"{report['us_last_tenth'][kind][op]:10.1f} "
            line += f"{report['to fresh'][kind][op]:6.2f}x{verdict} "
        print(line.rstrip())
    print(f"  target: each at most {TARGET}x fresh")


if __name__ == "__main__":
    main()
