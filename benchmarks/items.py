"""Listing items: what a page of `ControlStore.items()` costs at 1,000 items and at 1,000,000.

    python benchmarks/items.py [--large N] [--small N] [--repeats R] [--json]
    python benchmarks/items.py --url postgresql://... [--large N]   (the same on a schema)

Two stores with the same mix (ten projects; 90% done, 5% ready, 3% failed, 1% deferred,
1% cancelled, the failed and cancelled ones all in the older half: failures nobody has
looked at yet; the rows written straight into asyncplane's own schema, so building a
million takes seconds), then the same listings on each, each timed as the median of
``--repeats`` calls:

* the 50 newest failed items of one project (the question `stats` raises);
* the same, oldest first; the next page by keyset;
* failed or cancelled items of the whole store; every state of one project;
* a filter checked on the rows the arms walk (an error text).

Each figure is printed beside the one at the small size: the ratio large / small is the
target (a page from an index costs about the same at any size; "a few milliseconds" is
the issue's bound, but the ratio is what a noisy machine cannot blur). The last column
is the same page read with the indexes out of reach (SQLite's ``NOT INDEXED``, a scan of
the table), as the baseline the indexes are there to beat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore

PROJECTS = [f"p{n}" for n in range(10)]
#: The mix of states, as cumulative shares.
MIX = (("done", 0.90), ("ready", 0.95), ("failed", 0.98), ("deferred", 0.99), ("cancelled", 1.0))
PAGE = 50

#: The listings: a name and the keywords of items().
LISTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("failed of one project, newest", {"project_id": "p3", "state": "failed"}),
    ("failed of one project, oldest", {"project_id": "p3", "state": "failed", "order": "oldest"}),
    ("failed or cancelled, whole store", {"state": ("failed", "cancelled")}),
    ("every state of one project", {"project_id": "p3"}),
    ("failed with an error text", {"state": "failed", "error_contains": "rate limit"}),
)


def _state(rng: random.Random) -> str:
    draw = rng.random()
    return next(state for state, upto in MIX if draw < upto)


def _rows(count: int, seed: int = 7) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    rows = []
    for n in range(count):
        state = _state(rng)
        if n >= count // 2 and state in ("failed", "cancelled"):
            state = "done"  # the newer half went well: the failures are old ones
        error = None
        if state == "failed":
            error = "rate limit reached" if rng.random() < 0.1 else "the model refused"
        rows.append((PROJECTS[n % len(PROJECTS)], state, f'{{"n": {n}}}', error, n, n))
    return rows


INSERT = (
    "INSERT INTO items (project_id, state, payload, error, created_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)


async def _sqlite_store(directory: pathlib.Path, count: int) -> ControlStore:
    path = directory / f"items-{count}.db"
    store = ControlStore(path)
    for project in PROJECTS:
        await store.create_project(project, project)
    await store.close()  # the schema is there; the rows go in straight
    conn = sqlite3.connect(path)
    conn.executemany(INSERT, _rows(count))
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()
    return ControlStore(path, read_only=True)


async def _postgres_store(url: str, count: int) -> ControlStore:
    import asyncpg

    where = await pg.fresh_schema(url, f"bench_items_{count}")
    store = ControlStore(where)
    for project in PROJECTS:
        await store.create_project(project, project)
    await store.close()
    conn = await asyncpg.connect(where)
    try:
        await conn.copy_records_to_table(
            "items",
            records=[(*row[:4], float(row[4]), float(row[5])) for row in _rows(count)],
            columns=["project_id", "state", "payload", "error", "created_at", "updated_at"],
        )
        await conn.execute("ANALYZE items")
    finally:
        await conn.close()
    return ControlStore(where, read_only=True)


async def _median_ms(call: Callable[[], Awaitable[Any]], repeats: int) -> float:
    await call()  # warm: statements prepared, pages cached
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _scan_ms(path: pathlib.Path, repeats: int) -> float:
    """The first listing with no index to use: a scan of the table (the baseline)."""
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    statement = (
        "SELECT * FROM items NOT INDEXED WHERE project_id = 'p3' AND state = 'failed' "
        "ORDER BY item_id DESC LIMIT 50"
    )
    conn.execute(statement).fetchall()
    times = []
    for _ in range(max(1, repeats // 10)):
        started = time.perf_counter()
        conn.execute(statement).fetchall()
        times.append(time.perf_counter() - started)
    conn.close()
    return statistics.median(times) * 1000


async def _measure(store: ControlStore, repeats: int) -> tuple[dict[str, float], dict[str, int]]:
    figures: dict[str, float] = {}
    rows: dict[str, int] = {}
    for name, filters in LISTINGS:

        async def page(filters: dict[str, Any] = filters) -> Any:
            return await store.items(**filters, limit=PAGE, include_payload=False)

        figures[name] = await _median_ms(page, repeats)
        rows[name] = len(await page())
    first = await store.items(project_id="p3", state="failed", limit=PAGE)
    after = first[-1]["item_id"] if first else None

    async def next_page() -> Any:
        return await store.items(project_id="p3", state="failed", limit=PAGE, after=after)

    figures["the next page (keyset)"] = await _median_ms(next_page, repeats)
    rows["the next page (keyset)"] = len(await next_page())
    return figures, rows


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--url", default=os.environ.get("ASYNCPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"sizes": [args.small, args.large], "backend": "sqlite"}
    with tempfile.TemporaryDirectory(prefix="asyncplane-bench-items-") as tmp:
        stores = []
        for count in (args.small, args.large):
            if args.url:
                stores.append(await _postgres_store(args.url, count))
                results["backend"] = "postgresql"
            else:
                stores.append(await _sqlite_store(pathlib.Path(tmp), count))
        figures, counts = [], []
        for store in stores:
            async with store:
                timed, returned = await _measure(store, args.repeats)
            figures.append(timed)
            counts.append(returned)
        scan = None if args.url else _scan_ms(stores[1].path, args.repeats)
    small, large = figures
    results["ms"] = {name: {"small": small[name], "large": large[name]} for name in small}
    results["rows"] = {name: [counts[0][name], counts[1][name]] for name in small}
    results["ratios"] = {name: large[name] / small[name] for name in small}
    results["scan_ms_large"] = scan
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{results['backend']}: a page of {PAGE} at {args.small:,} and {args.large:,} items")
    print(f"{'listing':<36} {'small ms':>9} {'large ms':>9} {'large/small':>12}  rows")
    for name in small:
        rows = "/".join(str(n) for n in results["rows"][name])
        print(
            f"{name:<36} {small[name]:>9.2f} {large[name]:>9.2f} "
            f"{results['ratios'][name]:>12.2f}  {rows}"
        )
    if scan is not None:
        print(f"the first listing as a table scan at {args.large:,} items: {scan:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(pg.dropping_made_schemas(main(sys.argv[1:]))))
