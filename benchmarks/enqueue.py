"""What an enqueue costs as the store grows, with a fingerprint and without.

    python benchmarks/enqueue.py [--items N] [--batch B] [--repeats R] [--json]
    python benchmarks/enqueue.py --postgres        (the same on a throwaway cluster)
    python benchmarks/enqueue.py --url postgresql://...   (or on this server)

Two kinds of item, each enqueued into a fresh store (SQLite file or PostgreSQL schema) of
one project, ``--items`` of them in `enqueue_many` calls of ``--batch``, the kinds in turns
and each repeated (median):

* plain: no fingerprint, so no dedup look and no twin line (the baseline);
* fingerprinted: each item its own content, dedup on (what a store with an ``identity``
  enqueues): a look for a twin of every item, and the twin triggers on every row.

For each, the cost in microseconds an item of the first tenth of the calls (the store
nearly empty) and of the last tenth (the store holding ``--items``). Targets, ratios
within the run:

* growth, last tenth / first tenth, at most 1.5x for each kind: an enqueue costs the
  same however many items the project holds (a custom plan of the PostgreSQL dedup look
  once walked the project's part of the index, and grew with it);
* fingerprinted / plain, in the last tenth, at most 2x: content identity is an index
  probe a row, not a tax on the store (SQLite's statement journal once spilled to a
  temporary file on every fingerprinted row: 2.3x before, and growing).

The figures in docs/architecture.md ("What an enqueue costs") come from here.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore, Job

KINDS = ("plain", "fingerprinted")
GROWTH_TARGET = 1.5
FINGERPRINT_TARGET = 2.0


async def _costs(location: str, kind: str, items: int, batch: int) -> tuple[float, float]:
    """µs an item of the first and of the last tenth of the calls, on a fresh store."""
    per_call: list[float] = []
    async with ControlStore(location) as store:
        await store.create_project("p", "P")
        for start in range(0, items, batch):
            jobs = [
                Job({"n": n}, fingerprint=f"content-{n}" if kind == "fingerprinted" else None)
                for n in range(start, min(items, start + batch))
            ]
            started = time.perf_counter()
            await store.enqueue_many("p", jobs)
            per_call.append((time.perf_counter() - started) / len(jobs) * 1e6)
    tenth = max(1, len(per_call) // 10)
    return statistics.median(per_call[:tenth]), statistics.median(per_call[-tenth:])


async def measure(items: int, batch: int, repeats: int, url: str | None) -> dict[str, Any]:
    seen: dict[str, dict[str, list[float]]] = {k: {"first": [], "last": []} for k in KINDS}
    with tempfile.TemporaryDirectory() as folder:
        for n in range(repeats):
            for kind in KINDS:
                name = f"{kind}_{n}"
                location = await pg.fresh_store(url, folder, f"enqueue_{name}")
                first, last = await _costs(location, kind, items, batch)
                seen[kind]["first"].append(first)
                seen[kind]["last"].append(last)
    us = {k: {when: statistics.median(v) for when, v in seen[k].items()} for k in KINDS}
    growth = {k: us[k]["last"] / us[k]["first"] for k in KINDS}
    ratio = us["fingerprinted"]["last"] / us["plain"]["last"]
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "items": items,
        "batch": batch,
        "us_per_item": us,
        "growth": growth,
        "fingerprinted / plain": ratio,
        "met": {
            "growth": all(g <= GROWTH_TARGET for g in growth.values()),
            "fingerprinted / plain": ratio <= FINGERPRINT_TARGET,
        },
    }


def main() -> None:
    ran = pg.run_benchmark(
        __doc__,
        lambda args, url: measure(args.items, args.batch, args.repeats, url),
        items=50_000,
        batch=500,
        repeats=3,
    )
    if ran is None:
        return
    args, report = ran
    print(
        f"enqueue_many of {args.items:,} items in calls of {args.batch}, {report['backend']}, "
        f"µs an item (median of {args.repeats}):"
    )
    print(f"  {'':<14} {'first tenth':>12} {'last tenth':>11} {'growth':>8}")
    for kind in KINDS:
        us = report["us_per_item"][kind]
        print(f"  {kind:<14} {us['first']:12.1f} {us['last']:11.1f} {report['growth'][kind]:7.2f}x")
    met = report["met"]
    print(
        f"  growth target <= {GROWTH_TARGET}x: {'met' if met['growth'] else 'MISSED'}; "
        f"fingerprinted / plain {report['fingerprinted / plain']:.2f}x "
        f"(target <= {FINGERPRINT_TARGET}x): "
        f"{'met' if met['fingerprinted / plain'] else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
