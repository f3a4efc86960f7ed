"""No claim pays for work it cannot take: the per-project claim index and twins in line.

A claim visits only the projects in its reach (open, the one asked for, the actor's),
each through its part of the claim index; of one content's ready twins only the first in
claim order is in that index, and none while a twin runs (the others are *held*). These
tests pin the line on both backends through every move that changes it, and read the
query plans of every claim shape, so a later change cannot fall back to a scan unseen.
(`benchmarks/claim_cliff.py` measures what this buys.)
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

import asyncpg
import pytest

from asyncplane import ControlStore, _sqlite, verify_ledger
from asyncplane import _postgres_sql as pg_sql
from asyncplane import _sqlite_sql as sql
from asyncplane.testing import ManualClock


def held(raw: Any) -> set[int]:
    """The ready items held in line, out of the claim index."""
    return {
        row[0]
        for row in raw.execute(
            "SELECT item_id FROM items WHERE state = 'ready' AND held = ?", (True,)
        )
    }


async def claimed(store: ControlStore, expected: int | None, **shape: Any) -> Any:
    claim = await store.claim("w", **shape)
    assert (None if claim is None else claim.item_id) == expected
    assert await verify_ledger(store) == []
    return claim


async def test_of_ready_twins_only_the_first_in_claim_order_is_claimable(
    store: ControlStore, raw: Any
) -> None:
    a = await store.enqueue("alpha", {"n": "a"}, fingerprint="x")
    b = await store.enqueue("alpha", {"n": "b"}, fingerprint="x", dedup=False, priority=5)
    c = await store.enqueue("alpha", {"n": "c"}, fingerprint="x", dedup=False)
    plain = await store.enqueue("alpha", {"n": "plain"})
    # b arrived later but goes first: it took a's place at the head of the line.
    assert held(raw) == {a, c}
    first = await claimed(store, b)
    assert held(raw) == {a, c}  # while b runs, no twin of it is claimable
    await claimed(store, plain)
    await claimed(store, None)
    # Given back unrun, b is first in line again.
    await store.release(b, fence=first.fence)
    assert held(raw) == {a, c}
    again = await claimed(store, b)
    # Retried, b waits for its time; the first held twin takes the head of the line.
    await store.retry(b, fence=again.fence, delay=60)
    assert held(raw) == {c}
    # Cancelled while first in line, a hands its place on.
    await store.cancel(a, reason="not needed")
    assert held(raw) == set()
    third = await claimed(store, c)
    await store.finish(c, fence=third.fence, status="failed", error="boom")
    # Requeued at a higher priority than anything waiting, c goes to the head again.
    await store.requeue(c)
    assert held(raw) == set()
    assert await verify_ledger(store) == []


async def test_a_twin_arriving_while_its_twin_runs_is_held_until_that_one_settles(
    store: ControlStore, raw: Any
) -> None:
    a = await store.enqueue("alpha", {"n": "a"}, fingerprint="x")
    claim = await claimed(store, a)
    twins = [await store.enqueue("alpha", {"n": n}, fingerprint="x", dedup=False) for n in range(3)]
    assert held(raw) == set(twins)
    await claimed(store, None)
    await store.finish(a, fence=claim.fence, status="failed", error="boom")
    assert held(raw) == set(twins[1:])
    for twin in twins:  # one at a time, oldest first
        got = await claimed(store, twin)
        await claimed(store, None)
        await store.finish(twin, fence=got.fence)
    assert held(raw) == set()


async def test_a_fallen_due_twin_and_the_head_of_the_line_run_one_at_a_time(
    store: ControlStore, raw: Any, clock: ManualClock
) -> None:
    a = await store.enqueue("alpha", {"n": "a"}, fingerprint="x")
    claim = await claimed(store, a)
    b = await store.enqueue("alpha", {"n": "b"}, fingerprint="x", dedup=False)
    await store.retry(a, fence=claim.fence, delay=30)
    assert held(raw) == set()  # b heads the line while a waits
    clock.advance(31)
    # Both are claimable now; a is older. One runs; the other is held behind it.
    second = await claimed(store, a)
    assert held(raw) == {b}
    await claimed(store, None)
    await store.finish(a, fence=second.fence, status="failed", error="boom")
    await claimed(store, b)


async def test_a_fingerprint_given_later_puts_a_ready_item_in_line(
    asyncplane_store_factory: Any,
) -> None:
    # With an identity, dedup_pending_against_done gives old items their fingerprint.
    store = await asyncplane_store_factory()
    await store.create_project("alpha", "A")
    first = await store.enqueue("alpha", {"doc": 1})
    second = await store.enqueue("alpha", {"doc": 1})
    identified = await asyncplane_store_factory(identity=("doc",))
    await identified.dedup_pending_against_done()
    claim = await claimed(identified, first)
    await claimed(identified, None)  # second is a twin of the running first now
    await identified.finish(first, fence=claim.fence, status="failed", error="boom")
    await claimed(identified, second)


async def test_a_stranded_twin_is_a_ledger_problem(store: ControlStore, raw: Any) -> None:
    a = await store.enqueue("alpha", {"n": "a"}, fingerprint="x")
    b = await store.enqueue("alpha", {"n": "b"}, fingerprint="x", dedup=False)
    assert await verify_ledger(store) == []
    raw.execute("UPDATE items SET held = ? WHERE item_id = ?", (True, a))
    problems = await verify_ledger(store)
    assert [(p.kind, p.item_id) for p in problems] == [("twin_stranded", a), ("twin_stranded", b)]


# --- the plans -----------------------------------------------------------------------------


def _sqlite_plan(conn: sqlite3.Connection, statement: str, params: dict[str, Any]) -> str:
    return " | ".join(row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + statement, params))


def _no_table_scan(plan: str) -> None:
    # "SCAN items" alone is a walk over the whole table; a scan of an index says so.
    assert not re.search(r"SCAN (items|twin)( |$)(?!USING)", plan + " "), plan


SHAPES = (
    {"project_id": "small", "actor_id": None},
    {"project_id": None, "actor_id": None},
    {"project_id": None, "actor_id": "agent"},
)


def _rows() -> list[tuple[Any, ...]]:
    """A big open project and a small one, with twins and retries waiting: statistics as a
    real store would have them, so the planner chooses as it would there."""
    return [
        ("big" if n % 10 else "small", "deferred" if n % 4 == 0 else "ready", "{}", 5,
         f"f{n % 7}" if n % 3 else None, float(n) if n % 4 == 0 else None, 0.0, 0.0)
        for n in range(4000)
    ]  # fmt: skip


_FILL = (
    "INSERT INTO items (project_id, state, payload, priority, fingerprint, due_at, "
    "created_at, updated_at) VALUES ({})"
)


DUE_INDEX = "items_project_due (project_id=? AND due_at<?)"


@pytest.mark.sqlite_only
async def test_every_sqlite_claim_shape_walks_one_project_index(tmp_path: Any) -> None:
    path = tmp_path / "plans.db"
    async with ControlStore(path) as store:
        for project in ("big", "small", "paused"):
            await store.create_project(
                project, project, status="paused" if project == "paused" else "open"
            )
        await store.assign("small", "agent")
    conn = sqlite3.connect(path)
    conn.executemany(_FILL.format(", ".join("?" * 8)), _rows())
    conn.commit()
    conn.execute("ANALYZE")
    for shape in SHAPES:
        params = {**shape, "now": 1000.0, "project": "small", "limit": 8, "offset": 0, "page": 8}
        ready_index, due_index = "items_claim (project_id=?)", DUE_INDEX
        for statement, index in ((sql.CLAIM_FIRST_PAGES, ready_index),
                                 (sql.CLAIM_READY, ready_index),
                                 (sql.CLAIM_FIRST_DUE, due_index),
                                 (sql.CLAIM_DUE, due_index)):  # fmt: skip
            plan = _sqlite_plan(conn, statement, params)
            assert f"USING INDEX {index}" in plan, plan  # one project's part of the index
            assert "USING INDEX items_running_fingerprint" in plan, plan  # the running twin
            _no_table_scan(plan)
        ready = _sqlite_plan(conn, sql.CLAIM_READY, params)
        assert "TEMP B-TREE" not in ready, ready  # the index gives the claim order
        first = _sqlite_plan(conn, sql.CLAIM_FIRST_PAGES, params)
        assert "SCAN projects" in first or "SEARCH projects" in first, first  # reach first
    # The line-up triggers' statements, as they run: every lookup through a line index.
    for statement in sql._LINE_UP_TWINS_5.split(";"):
        if not statement.strip():
            continue
        text = statement.replace("NEW.project_id", ":p").replace("NEW.fingerprint", ":f")
        plan = _sqlite_plan(conn, text, {"p": "big", "f": "f1"})
        assert "items_held" in plan and "items_next_twin" in plan, plan
        assert "items_running_fingerprint" in plan, plan
        _no_table_scan(plan)
    conn.close()


@pytest.mark.postgresql_only
async def test_every_postgresql_claim_shape_walks_one_project_index(url: str) -> None:
    async with ControlStore(url) as store:
        for project in ("big", "small", "paused"):
            await store.create_project(
                project, project, status="paused" if project == "paused" else "open"
            )
        await store.assign("small", "agent")
    conn = await asyncpg.connect(url)
    try:
        await conn.executemany(_FILL.format(", ".join(f"${n}" for n in range(1, 9))), _rows())
        await conn.execute("ANALYZE")
        await conn.execute(
            "PREPARE candidates(text, text, bigint, float8, bigint, text[], bigint[], text[]) AS "
            + pg_sql.CLAIM_CANDIDATES
        )
        await conn.execute("PREPARE ready(text, bigint, bigint) AS " + pg_sql.CLAIM_READY)
        for shape in SHAPES:
            project, actor = (
                "NULL" if value is None else f"'{value}'"
                for value in (shape["project_id"], shape["actor_id"])
            )
            for limited in ("'{}'::text[], '{}'::bigint[], '{}'::text[]",
                            "'{small}', '{3}', '{small}'"):  # fmt: skip
                rows = await conn.fetch(
                    f"EXPLAIN EXECUTE candidates({project}, {actor}, 8, 1000, 1, {limited})"
                )
                plan = " | ".join(row[0] for row in rows)
                assert "Index Scan using items_claim on items" in plan, plan  # ready, per project
                assert "items_project_due" in plan, plan  # fallen due, per project
                assert "Seq Scan on items" not in plan, plan
        plan = " | ".join(
            row[0] for row in await conn.fetch("EXPLAIN EXECUTE ready('small', 8, 0)")
        )
        assert "items_claim" in plan and "Sort" not in plan, plan  # the index gives the order
    finally:
        await conn.close()


# --- stores of the schema before ----------------------------------------------------------

# Rows as the release before wrote them: content x with three ready twins (the second
# first in claim order), content y with a running twin and a ready one.
_OLD_ROWS = ((1, "x", 0, "ready"), (2, "x", 5, "ready"), (3, "x", 0, "ready"),
             (4, "y", 0, "claimed"), (5, "y", 0, "ready"))  # fmt: skip


def _old_row(item_id: int, fingerprint: str, priority: int, state: str) -> tuple[Any, ...]:
    running = state == "claimed"
    return (item_id, state, fingerprint, priority, int(running), "w" if running else None,
            4.0e9 if running else None)  # fmt: skip


_OLD_ITEM = (
    "INSERT INTO items ({override}item_id, project_id, state, payload, fingerprint, dedup, "
    "priority, fence, owner, lease_expires_at, created_at, updated_at) {values}"
)
_OLD_EVENTS = [(n, "queued", 0, None) for n, _, _, _ in _OLD_ROWS] + [(4, "claimed", 1, "w")]


@pytest.mark.sqlite_only
async def test_an_sqlite_store_of_the_previous_schema_lines_its_twins_up(tmp_path: Any) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for script in sql.MIGRATIONS[:4]:
        for statement in _sqlite._statements(script):
            conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {sql.APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 4")
    conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
    conn.executemany(
        _OLD_ITEM.format(override="", values="VALUES (?, 'p', ?, '{}', ?, 0, ?, ?, ?, ?, 0, 0)"),
        [_old_row(*row) for row in _OLD_ROWS],
    )
    conn.executemany(
        "INSERT INTO events (item_id, event_type, fence, owner, at) VALUES (?, ?, ?, ?, 0)",
        _OLD_EVENTS,
    )
    conn.execute("COMMIT")
    conn.close()
    await _lined_up(ControlStore(path))


@pytest.mark.postgresql_only
async def test_a_postgresql_schema_of_the_previous_release_lines_its_twins_up(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            for script in pg_sql.MIGRATIONS[:2]:
                await conn.execute(script)
            await conn.execute(pg_sql.WRITE_META, "application", pg_sql.APPLICATION)
            await conn.execute(pg_sql.WRITE_META, "schema_version", "2")
            await conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
            await conn.executemany(
                _OLD_ITEM.format(
                    override="", values="OVERRIDING SYSTEM VALUE "
                    "VALUES ($1, 'p', $2, '{}', $3, false, $4, $5, $6, $7, 0, 0)",
                ),
                [_old_row(*row) for row in _OLD_ROWS],
            )  # fmt: skip
            await conn.executemany(
                "INSERT INTO events (item_id, event_type, fence, owner, at) "
                "VALUES ($1, $2, $3, $4, 0)",
                _OLD_EVENTS,
            )
    finally:
        await conn.close()
    await _lined_up(ControlStore(url))


async def _lined_up(store: ControlStore) -> None:
    async with store:
        assert await verify_ledger(store) == []
        first = await store.claim("w")
        assert first is not None and first.item_id == 2  # x's first; y's twin runs
        assert await store.claim("w") is None
        await store.finish(2, fence=first.fence)
        assert await verify_ledger(store) == []


@pytest.mark.postgresql_only
async def test_the_postgresql_claim_statements_are_planned_once_not_per_claim(url: str) -> None:
    # A statement the server plans afresh for every call (a custom plan, chosen when the
    # generic one looks dearer, say for arrays of unknown size) costs a claim more than
    # its whole execution: the claim's statements must settle on one generic plan, with
    # limits and without.
    from asyncplane._store import engine_of

    async with ControlStore(url, lease_seconds=600) as store:
        for project in ("free", "capped"):
            await store.create_project(project, project)
            await store.enqueue_many(project, [{"n": n} for n in range(40)])
        await store.set_limits("capped", max_running=10**6, per_minute=6e6, burst=10**6)
        for _ in range(20):
            for project in ("free", "capped"):
                claim = await store.claim("w", project_id=project)
                assert claim is not None
                await store.finish(claim.item_id, fence=claim.fence)
        backend = engine_of(store).backend

        async def plans(conn: Any, now: float) -> list[Any]:
            return list(await conn.fetch(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            ))  # fmt: skip

        found = await backend._write(plans)  # type: ignore[attr-defined]
    claim_statements = {
        "candidates": pg_sql.CLAIM_CANDIDATES, "claim, spending": pg_sql.CLAIM_ITEMS_SPENDING,
        "the plain reach's one statement": pg_sql.CLAIM_ALONE,
    }  # fmt: skip
    for name, text in claim_statements.items():
        (row,) = [row for row in found if row[0] == text]
        assert row[2] <= 5 and row[1] >= 10, f"{name}: {row[1]} generic, {row[2]} custom plans"
