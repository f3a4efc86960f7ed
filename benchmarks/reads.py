"""What a small project's reads cost beside a big project: counts() and the next due time.

    python benchmarks/reads.py [--big N] [--repeats R] [--json]
    python benchmarks/reads.py --postgres        (the same on a throwaway cluster)
    python benchmarks/reads.py --url postgresql://...   (or on this server)

Two stores (SQLite files, or PostgreSQL schemas), each with a project ``small`` holding a
deferred item and a claimed one; the second also holds a project ``big`` of ``--big``
items, half of them deferred (due before small's deferred item). On each, interleaved and repeated
(median of ``--repeats`` rounds of 30 calls), the statements behind:

* ``counts(project_id="small")``: a dashboard's row, once a refresh;
* ``next_due(project_id="small")`` and ``next_due()``: what a claimer that finds nothing
  asks before it sleeps (`claim(wait=)`, `work()`, `drain()`).

Each is run on a plain connection of its own (sqlite3, or asyncpg with the statement
prepared), as the store's readers run it: the store's own call adds a thread hand-off or
a pool's, a tenth of a millisecond here that comes in two modes (the other CPU awake or
not), which blurred every ratio. The store's calls are printed beside, for the record.

Target, the ratio with the big project to without it: at most 1.5x for each statement
(they look at small's part of the indexes, and a probe a project). Before, counts() of
small scanned the whole table and the next due time walked big's deferred items: the
statements took 6.9 and 14.8 ms on SQLite, 11.7 and 1.1 ms on PostgreSQL (and
``next_due()`` 13.0 ms there), beside 100,000 items, against 0.01 to 0.2 ms alone.
"""

from __future__ import annotations

import contextlib
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore, Job
from asyncplane import _postgres_sql as pg_sql
from asyncplane import _sqlite_sql as sqlite_sql

TARGET = 1.5
CALLS = 30


async def _fill(store: ControlStore, big: int) -> None:
    await store.create_project("small", "Small")
    await store.enqueue("small", {"n": 0}, not_before=4e9)
    await store.enqueue("small", {"n": 1})
    assert await store.claim("bench", project_id="small", lease_seconds=3600) is not None
    if big:
        await store.create_project("big", "Big")
    for start in range(0, big, 5000):
        jobs = [
            Job({"n": n}, not_before=(3e9 + n) if n % 2 else None)
            for n in range(start, min(big, start + 5000))
        ]
        await store.enqueue_many("big", jobs)


def _reads(store: ControlStore) -> dict[str, Callable[[], Awaitable[Any]]]:
    return {
        "counts(small)": lambda: store.counts(project_id="small"),
        "next_due(small)": lambda: store.next_due(project_id="small"),
        "next_due()": lambda: store.next_due(),
    }


#: The statements behind each read, with their (project_id, actor_id).
STATEMENTS = {
    "counts(small)": ("COUNT_STATES", "small"),
    "next_due(small)": ("NEXT_DUE", "small"),
    "next_due()": ("NEXT_DUE", None),
}


async def _statements(location: str, url: str | None) -> dict[str, Callable[[], Awaitable[Any]]]:
    """The statements on a plain connection: each a coroutine function that runs one."""
    if url is None:
        conn = sqlite3.connect(f"file:{location}?mode=ro", uri=True)

        def run(name: str, project: str | None) -> Callable[[], Awaitable[Any]]:
            params = {"project_id": project, "actor_id": None, "now": 0.0}
            statement = getattr(sqlite_sql, name)

            async def once() -> Any:
                return conn.execute(statement, params).fetchall()

            return once

        return {read: run(*spec) for read, spec in STATEMENTS.items()}
    import asyncpg

    pgconn = await asyncpg.connect(location)
    prepared = {
        name: await pgconn.prepare(getattr(pg_sql, name)) for name, _ in STATEMENTS.values()
    }

    def run_pg(name: str, project: str | None) -> Callable[[], Awaitable[Any]]:
        async def once() -> Any:
            return await prepared[name].fetch(project, None)

        return once

    return {read: run_pg(*spec) for read, spec in STATEMENTS.items()}


async def _timed(call: Callable[[], Awaitable[Any]]) -> float:
    """ms a call, over CALLS calls (after one that plans and warms the caches)."""
    await call()
    started = time.perf_counter()
    for _ in range(CALLS):
        await call()
    return (time.perf_counter() - started) / CALLS * 1000


async def measure(big: int, repeats: int, url: str | None) -> dict[str, Any]:
    ms: dict[str, dict[str, list[float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        stores, where = {}, {}
        for side, items in (("alone", 0), ("beside big", big)):
            name = side.replace(" ", "_")
            location = await pg.fresh_store(url, folder, f"reads_{name}")
            async with ControlStore(location) as filling:
                await _fill(filling, items)
            # Opened afresh, as a process finds the store (its WAL checkpointed at close):
            # what the reads cost, not what the bulk load left behind.
            stores[side] = await stack.enter_async_context(ControlStore(location))
            where[side] = location
        plain = {side: await _statements(where[side], url) for side in stores}
        for _ in range(repeats):
            for side, store in stores.items():
                for read, call in _reads(store).items():
                    seen = await _timed(call)
                    ms.setdefault(f"store {read}", {}).setdefault(side, []).append(seen)
                for read, call in plain[side].items():
                    seen = await _timed(call)
                    ms.setdefault(read, {}).setdefault(side, []).append(seen)
    medians = {
        read: {side: statistics.median(values) for side, values in sides.items()}
        for read, sides in ms.items()
    }
    ratios = {read: sides["beside big"] / sides["alone"] for read, sides in medians.items()}
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "big": big,
        "ms": medians,
        "ratios": ratios,
        "met": all(ratios[read] <= TARGET for read in STATEMENTS),
    }


def main() -> None:
    ran = pg.run_benchmark(
        __doc__, lambda args, url: measure(args.big, args.repeats, url), big=100_000, repeats=5
    )
    if ran is None:
        return
    args, report = ran
    print(
        f"reads of a small project, alone and beside {args.big:,} items, "
        f"{report['backend']}, ms a call (median of {args.repeats}):"
    )
    print(f"  {'':<22} {'alone':>8} {'beside big':>10}")
    for read, sides in report["ms"].items():
        print(
            f"  {read:<22} {sides['alone']:8.3f} {sides['beside big']:10.3f}"
            f"   {report['ratios'][read]:6.2f}x"
        )
    print(f"  target <= {TARGET}x for each statement: {'met' if report['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
