"""What a claim pays for work it cannot take: claim+finish beside a big unclaimable backlog.

    python benchmarks/claim_cliff.py [--backlog 300000] [--small 2000] [--claims 200]
    python benchmarks/claim_cliff.py --url postgresql://...   (the same on a schema)

A project ``small`` holds ``--small`` ready items. The base store holds nothing else; each
other store adds ``--backlog`` ready items that sit ahead of small's in claim order (a
higher priority) and that the claim may not take:

* (a) another open project, while the claim filters by project (``project_id="small"``);
* (b) a paused project, with an unfiltered claim;
* (c) a project the claiming actor is not assigned to (``actor_id=``);
* (d) one content: a twin of it runs (claimed under a long lease) and the backlog is its
  waiting twins (enqueued with ``dedup=False``), with an unfiltered claim.

Each case times ``--claims`` rounds of ``claim()`` + ``finish()`` of small's items, and
prints the cost per round beside the same claim shape on the base store, measured in the
same run: the ratio is the figure (the target is at most 1.5x), since a noisy machine
blurs milliseconds but not a ratio. The backlogs are written straight into asyncplane's
own tables, so building them takes seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sqlite3
import statistics
import sys
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore

CASES: tuple[tuple[str, str], ...] = (
    ("a", "another open project, claim filtered by project"),
    ("b", "a paused project, unfiltered claim"),
    ("c", "a project the actor is not assigned to"),
    ("d", "a held twin with its waiting twins, unfiltered claim"),
)
#: The claim shape of each case: the keywords of claim().
SHAPES: dict[str, dict[str, Any]] = {
    "a": {"project_id": "small"},
    "b": {},
    "c": {"actor_id": "agent"},
    "d": {},
}
COLUMNS = ("project_id", "state", "payload", "priority", "fingerprint", "dedup", "created_at",
           "updated_at", "owner", "lease_expires_at", "fence", "attempts")  # fmt: skip
FAR = 4.0e9  # a lease that never lapses during the run


def _small_rows(count: int) -> list[tuple[Any, ...]]:
    return [("small", "ready", f'{{"n": {n}}}', 0, None, 1, 1.0, 1.0, None, None, 0, 0)
            for n in range(count)]  # fmt: skip


def _backlog_rows(case: str, count: int) -> list[tuple[Any, ...]]:
    if case != "d":
        return [("big", "ready", f'{{"n": {n}}}', 10, None, 1, 1.0, 1.0, None, None, 0, 0)
                for n in range(count)]  # fmt: skip
    running = ("big", "claimed", '{"n": -1}', 10, "same", 0, 1.0, 1.0, "holder", FAR, 1, 1)
    return [running] + [
        ("big", "ready", f'{{"n": {n}}}', 10, "same", 0, 1.0, 1.0, None, None, 0, 0)
        for n in range(count)
    ]


async def _projects(store: ControlStore, case: str | None) -> None:
    await store.create_project("small", "small")
    await store.assign("small", "agent")
    if case is not None:
        await store.create_project("big", "big", status="paused" if case == "b" else "open")


def _insert_sqlite(path: pathlib.Path, rows: list[tuple[Any, ...]]) -> None:
    conn = sqlite3.connect(path)
    marks = ", ".join("?" * len(COLUMNS))
    conn.executemany(f"INSERT INTO items ({', '.join(COLUMNS)}) VALUES ({marks})", rows)
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()


async def _insert_postgres(where: str, rows: list[tuple[Any, ...]]) -> None:
    import asyncpg

    conn = await asyncpg.connect(where)
    try:
        records = [(*r[:3], r[3], r[4], bool(r[5]), *r[6:8], r[8], r[9], r[10], r[11])
                   for r in rows]  # fmt: skip
        await conn.copy_records_to_table("items", records=records, columns=list(COLUMNS))
        await conn.execute("ANALYZE items")
    finally:
        await conn.close()


async def _store(case: str, base: bool, small: int, backlog: int, tmp: pathlib.Path,
                 url: str | None) -> str:  # fmt: skip
    """Build one case's store (or its base store); return where it is."""
    rows = _small_rows(small) + ([] if base else _backlog_rows(case, backlog))
    name = f"{case}_base" if base else case
    if url is None:
        where = str(tmp / f"cliff-{name}.db")
        async with ControlStore(where) as store:
            await _projects(store, None if base else case)
        _insert_sqlite(pathlib.Path(where), rows)
        return where
    where = await pg.fresh_schema(url, f"bench_cliff_{name}")
    async with ControlStore(where) as store:
        await _projects(store, None if base else case)
    await _insert_postgres(where, rows)
    return where


async def _per_round_ms(where: str, shape: dict[str, Any], claims: int, repeats: int) -> float:
    """The median, over ``repeats`` runs of ``claims`` rounds, of one claim+finish."""
    async with ControlStore(where) as store:
        runs = []
        for _ in range(repeats + 1):  # the first run warms the caches and is left out
            started = time.perf_counter()
            for _ in range(claims):
                item = await store.claim("bench", **shape)
                assert item is not None and item.project_id == "small", item
                await store.finish(item.item_id, fence=item.fence, actor_id=shape.get("actor_id"))
            runs.append((time.perf_counter() - started) / claims * 1000)
        return statistics.median(runs[1:])


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=300_000)
    parser.add_argument("--small", type=int, default=2_000)
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url", default=os.environ.get("ASYNCPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.small < args.claims * (args.repeats + 1) * 2:
        parser.error("--small must hold enough items for every round of every shape")
    backend = "postgresql" if args.url else "sqlite"
    report: dict[str, Any] = {"backend": backend, "backlog": args.backlog, "ms": {},
                              "base_ms": {}, "ratios": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="asyncplane-bench-cliff-") as tmp:
        for case, _ in CASES:
            # Each case beside a fresh base store, measured right after it: the ratio
            # compares two figures taken seconds apart on the same machine.
            where = await _store(case, False, args.small, args.backlog, pathlib.Path(tmp), args.url)
            base = await _store(case, True, args.small, args.backlog, pathlib.Path(tmp), args.url)
            shape = SHAPES[case]
            cost = await _per_round_ms(where, shape, args.claims, args.repeats)
            base_cost = await _per_round_ms(base, shape, args.claims, args.repeats)
            report["ms"][case] = cost
            report["base_ms"][case] = base_cost
            report["ratios"][case] = cost / base_cost
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['backend']}: claim+finish with {args.backlog:,} unclaimable items ahead")
    print(f"{'case':<58} {'ms':>7} {'base ms':>8} {'ratio':>6}")
    for case, words in CASES:
        print(f"({case}) {words:<54} {report['ms'][case]:>7.2f} "
              f"{report['base_ms'][case]:>8.2f} {report['ratios'][case]:>6.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(pg.dropping_made_schemas(main(sys.argv[1:]))))
