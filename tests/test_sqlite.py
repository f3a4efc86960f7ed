"""What is SQLite's own: the mechanisms that differ from PostgreSQL's.

The behaviour both backends share is proved by the rest of the suite, which runs every
store test on both. Here: the connections' pragmas and read-only readers, the file's
header, schema version and migrations, SQLite's one write lock (and what waits on it),
several processes creating one fresh file, and read-only stores on copied files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiosqlite
import pytest

from _signals import until
from asyncplane import (
    ControlStore,
    DatabaseLocked,
    FenceRejected,
    Job,
    NotAnAsyncplaneDatabase,
    ReadOnlyStore,
    SchemaVersionError,
    StorageError,
    StoreClosed,
    _connection,
    _models,
    _rules,
    _sqlite,
    _writer,
    verify_ledger,
)
from asyncplane import _sqlite_sql as sql

# Every test here is about SQLite's own files, locks and connections.
pytestmark = pytest.mark.sqlite_only


async def writer_of(store: ControlStore) -> _writer.Writer:
    """The store's SQLite writer."""
    writer = (await store._engine.ready()).writer
    assert isinstance(writer, _writer.Writer)
    return writer


def barrier(db: sqlite3.Connection, now: float) -> None:
    """A write operation that writes nothing: once it is served, every earlier round has ended."""


@pytest.fixture
def lock_holder(store: ControlStore) -> Iterator[sqlite3.Connection]:
    """A second connection that can hold the database's write lock, as another process would."""
    conn = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
    yield conn
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    conn.close()


# --- connections ----------------------------------------------------------------------


async def pragmas(conn: aiosqlite.Connection) -> dict[str, object]:
    def read(db: sqlite3.Connection) -> dict[str, object]:
        names = [
            "journal_mode",
            "synchronous",
            "busy_timeout",
            "foreign_keys",
            "journal_size_limit",
            "query_only",
            "cache_size",
        ]
        return {name: db.execute(f"PRAGMA {name}").fetchone()[0] for name in names}

    return await _connection.run(conn, read)


async def test_aiosqlite_still_offers_the_hook_asyncplane_uses() -> None:
    # asyncplane runs a whole transaction on a connection's thread through
    # aiosqlite.Connection._execute; if a release removes it, this fails first.
    async with aiosqlite.connect(":memory:") as conn:
        assert (
            await _connection.run(conn, lambda db, x: db.execute("SELECT ?", (x,)).fetchone()[0], 7)
            == 7
        )


async def test_aiosqlite_still_takes_a_call_posted_on_its_queue() -> None:
    # The writer's rounds go on the queue behind aiosqlite.Connection._execute with a
    # stand-in for the future (asyncplane._connection.post); if a release changes what
    # that queue takes, or what its thread does with a call's future, this fails first.
    loop = asyncio.get_running_loop()
    ran: asyncio.Future[tuple[int, int]] = loop.create_future()

    def call(db: sqlite3.Connection, x: int) -> None:
        value = db.execute("SELECT ?", (x,)).fetchone()[0]
        loop.call_soon_threadsafe(ran.set_result, (value, threading.get_ident()))

    conn = await aiosqlite.connect(":memory:")
    try:
        _connection.post(conn, call, 7)
        # Bounded: a release that mishandled the stand-in would kill the thread, and
        # then nothing on it would ever answer.
        its_thread = await asyncio.wait_for(
            _connection.run(conn, lambda db: threading.get_ident()), 10
        )
        assert await asyncio.wait_for(ran, 10) == (7, its_thread)
        assert its_thread != threading.get_ident()
    finally:  # bounded without waiting on a close that a dead thread would never answer
        closing = asyncio.ensure_future(conn.close())
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert closing in done, "the connection's thread no longer answers"
    with pytest.raises(ValueError, match="closed"):
        _connection.post(conn, call, 9)


async def test_back_to_back_rounds_never_wake_the_writer_task(tmp_path: pathlib.Path) -> None:
    # A round's delivery starts the next round, and a request made while the thread is
    # free starts one by a callback: the writer task sleeps until the store stops.
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "p")
        await store.enqueue_many("p", [{"n": n} for n in range(20)])
        writer = (await store._engine.ready()).writer
        code = writer._task.get_coro().cr_code
        resumed = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal resumed
            if event == "call" and frame.f_code is code:
                resumed += 1

        before = sys.getprofile()
        sys.setprofile(profile)
        try:
            for _ in range(20):
                claim = await store.claim("w")
                assert claim is not None
                await store.finish(claim.item_id, fence=claim.fence)
            rounds = writer.rounds
        finally:
            sys.setprofile(before)
        assert rounds >= 40 and resumed == 0
        assert (await store.counts())["done"] == 20


async def test_callers_just_answered_join_the_round_queued_behind_theirs(
    tmp_path: pathlib.Path,
) -> None:
    # A round's delivery schedules the next round rather than starting it: the callers it
    # answered run first, and what they ask at once joins what queued up meanwhile.
    release = threading.Event()

    def slow(db: sqlite3.Connection, now: float) -> str:
        release.wait(30)  # holds the connection's thread (never the loop) until released
        return "slow"

    def quick(db: sqlite3.Connection, now: float) -> str:
        return "quick"

    async with ControlStore(tmp_path / "s.db") as store:
        writer = (await store._engine.ready()).writer
        first = writer.submit(slow)

        async def answered_then_asks_again() -> Any:
            assert await first == "slow"
            return await writer.submit(quick)

        again = asyncio.ensure_future(answered_then_asks_again())
        await until(lambda: writer.in_flight == 1, what="the slow round on the thread")
        behind = writer.submit(quick)  # queued while the slow round runs
        rounds = writer.rounds
        release.set()
        assert await behind == "quick" and await again == "quick"
        assert writer.rounds == rounds + 1  # the two in one round


async def test_a_round_that_breaks_as_the_writer_stops_is_still_said(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The board's after_round runs on the thread after the round's callers were answered.
    # Here it breaks once the stopping writer's task has already left its wait and is
    # closing the connection (which waits behind the round on the thread): the task ends
    # without raising, and the failure is logged all the same, never dropped.
    class Escape(BaseException):
        pass

    release = threading.Event()

    def broken_after_round() -> None:
        release.wait(30)
        raise Escape

    store = ControlStore(tmp_path / "s.db")
    await store.open()
    writer = (await store._engine.ready()).writer
    assert writer.board is not None  # combining is on (Linux): its slot is ours to break
    writer.board.after_round = broken_after_round
    closing_started = asyncio.Event()
    close = writer._close

    async def marked_close() -> None:
        closing_started.set()
        await close()

    writer._close = marked_close
    answered = writer.submit(lambda db, now: "answered")
    closed = asyncio.ensure_future(store.close())
    assert await answered == "answered"
    await closing_started.wait()  # the task has left its wait: it is closing
    release.set()
    await closed
    assert "a round broke as it stopped" in caplog.text and "Escape" in caplog.text


async def test_an_operation_raising_stop_iteration_fails_alone(tmp_path: pathlib.Path) -> None:
    # A future cannot take StopIteration (it would end the coroutine awaiting it): the
    # caller gets a StorageError with it as the cause, and the writer goes on.
    def stops(db: sqlite3.Connection, now: float) -> None:
        raise StopIteration

    async with ControlStore(tmp_path / "s.db") as store:
        writer = (await store._engine.ready()).writer
        with pytest.raises(StorageError, match="StopIteration") as caught:
            await asyncio.wait_for(writer.submit(stops), 30)  # unanswered, it would hang
        assert isinstance(caught.value.__cause__, StopIteration)
        await store.create_project("p", "p")
        assert [p["project_id"] for p in await store.projects()] == ["p"]


async def test_a_round_that_breaks_on_its_thread_stops_the_writer_loudly(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Escape(BaseException):  # not an Exception: nothing in the round catches it
        pass

    def escape(db: sqlite3.Connection, now: float) -> None:
        db.execute("INSERT INTO projects VALUES ('x', 'x', 'open', ?)", (now,))
        raise Escape

    async with ControlStore(tmp_path / "s.db") as store:
        writer = (await store._engine.ready()).writer
        with pytest.raises(StorageError, match="write connection failed") as caught:
            await writer.submit(escape)
        assert isinstance(caught.value.__cause__, Escape)
        await asyncio.wait([writer._task])
        assert "asyncplane writer" in caplog.text
        with pytest.raises(StoreClosed, match="writer stopped"):
            await store.create_project("y", "y")
    async with ControlStore(tmp_path / "s.db") as store:
        assert [p["project_id"] for p in await store.projects()] == []  # nothing saved


@pytest.mark.parametrize(("level", "code"), [("NORMAL", 1), ("FULL", 2)])
async def test_writer_pragmas(tmp_path: pathlib.Path, level: str, code: int) -> None:
    conn = await _connection.open_writer(
        tmp_path / "w.db",
        synchronous=level,
        busy_timeout=30.0,  # type: ignore[arg-type]
    )
    try:
        got = await pragmas(conn)
    finally:
        await conn.close()
    assert got == {
        "journal_mode": "wal",
        "synchronous": code,
        "busy_timeout": 30_000,
        "foreign_keys": 1,
        "journal_size_limit": _connection.JOURNAL_SIZE_LIMIT,
        "query_only": 0,
        "cache_size": -_connection.WRITER_CACHE_KIB,
    }


async def test_readers_are_read_only(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "P")
        reader = await _connection.open_reader(tmp_path / "s.db", busy_timeout=5.0)
        try:
            got = await pragmas(reader)
            assert got["query_only"] == 1
            assert got["cache_size"] == -_connection.READER_CACHE_KIB
            with pytest.raises(sqlite3.OperationalError, match=r"readonly|read-only|query_only"):
                await _connection.run(reader, lambda db: db.execute("DELETE FROM projects"))
        finally:
            await reader.close()


async def test_store_synchronous_full_reaches_the_connection(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db", synchronous="FULL") as store:
        await store.projects()
        backend = await store._engine.ready()
        writer = backend.writer  # type: ignore[attr-defined]
        assert (await pragmas(writer._conn))["synchronous"] == 2


def test_old_sqlite_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    with pytest.raises(StorageError, match=r"needs SQLite 3\.35\.0"):
        _connection._check_sqlite_version()


# --- the file: header, schema version, migrations -------------------------------------


async def test_schema_version_and_application_id_are_written(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.projects()
    conn = sqlite3.connect(tmp_path / "s.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
    assert conn.execute("PRAGMA application_id").fetchone()[0] == sql.APPLICATION_ID
    conn.close()


def _derived(path: pathlib.Path) -> set[tuple[str, str, str]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return set(conn.execute(sql.SCHEMA_DERIVED).fetchall())


async def test_a_store_whose_indexes_and_triggers_drifted_is_mended_at_opening(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A store made by a development build whose migrations were written otherwise before
    # they were released: an index missing (every finish of a fingerprinted item failed
    # on it), one of other columns, the ledger's delete guard missing, a trigger left
    # behind; then a schema version behind the objects it has (a later migration's
    # CREATE finds its object there).
    fresh, drifted = tmp_path / "fresh.db", tmp_path / "drifted.db"
    for path in (fresh, drifted):
        async with ControlStore(path) as store:
            await store.create_project("p", "P")
            await store.enqueue("p", {}, fingerprint="same")
    made = _derived(fresh)
    with contextlib.closing(sqlite3.connect(drifted, isolation_level=None)) as conn:
        conn.executescript(
            """
            DROP INDEX items_dedup_twins;
            DROP TRIGGER events_kept;
            DROP INDEX items_by_project;
            CREATE INDEX items_by_project ON items (project_id);
            CREATE TABLE audit (item_id INTEGER);
            CREATE TRIGGER my_audit AFTER INSERT ON items
            BEGIN INSERT INTO audit VALUES (NEW.item_id); END;
            """
        )
    with caplog.at_level(logging.WARNING, logger="asyncplane.store"):
        async with ControlStore(drifted) as store:
            claim = await store.claim("w")
            assert claim is not None and claim.fingerprint == "same"
            await store.finish(claim.item_id, fence=claim.fence)
            assert await verify_ledger(store) == []
    said = " ".join(record.getMessage() for record in caplog.records)
    for name in ("items_dedup_twins", "events_kept", "items_by_project"):
        assert name in said, said
    assert "my_audit" not in said  # an application's own trigger is its business: kept
    mine = {row for row in _derived(drifted) if row[1] == "my_audit"}
    assert len(mine) == 1 and _derived(drifted) == made | mine
    with contextlib.closing(sqlite3.connect(drifted)) as conn:
        conn.execute("PRAGMA user_version = 10")
    async with ControlStore(drifted) as store:
        await store.projects()
    assert _derived(drifted) == made | mine
    with contextlib.closing(sqlite3.connect(drifted)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM events")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncplane.store"):
        async with ControlStore(fresh) as store:  # a store as made: nothing to say
            await store.projects()
    assert caplog.records == [] and _derived(fresh) == made


async def test_a_store_of_an_older_version_holding_a_later_index_migrates(
    tmp_path: pathlib.Path,
) -> None:
    # A development build's version-3 store that had migration 4's index already (under
    # a comment in the migration's text, as most statements are): passed over, then set
    # right, not refused.
    path = tmp_path / "three.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for script in sql.MIGRATIONS[:3]:
            for statement in _sqlite._statements(script):
                conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {sql.APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 3")
        conn.execute("CREATE INDEX items_by_state ON items (state)")
    assert any(
        statement.lstrip().startswith("--") and "CREATE INDEX items_by_state" in statement
        for statement in _sqlite._statements(sql.MIGRATIONS[3])
    )
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
    fresh = tmp_path / "fresh.db"
    async with ControlStore(fresh) as store:
        await store.projects()
    assert _derived(path) == _derived(fresh)


async def test_a_store_lacking_a_column_is_refused_untouched(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "s.db"
    async with ControlStore(path) as store:
        await store.projects()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("ALTER TABLE imports DROP COLUMN imported_at")
        conn.execute("DROP INDEX items_due")
    with pytest.raises(SchemaVersionError, match="'imports' lacks imported_at"):
        await ControlStore(path).open()
    assert "items_due" not in {name for _, name, _ in _derived(path)}  # nothing written


async def test_newer_schema_is_refused(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.projects()
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute(f"PRAGMA user_version = {sql.SCHEMA_VERSION + 1}")
    conn.close()
    store = ControlStore(tmp_path / "s.db")
    with pytest.raises(SchemaVersionError, match="upgrade asyncplane"):
        await store.open()


async def test_another_applications_database_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    with pytest.raises(NotAnAsyncplaneDatabase):
        await ControlStore(path).open()
    conn = sqlite3.connect(path)  # and it was left exactly as it was
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("invoices",)]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    conn.close()


async def test_a_file_that_is_not_sqlite_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are not the pages you are looking for" * 100)
    with pytest.raises(NotAnAsyncplaneDatabase) as caught:
        await ControlStore(path).open()
    assert isinstance(caught.value, StorageError)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)


async def test_migrations_run_forward_from_the_first_release(tmp_path: pathlib.Path) -> None:
    # A store written by the first release (schema version 1), with work in it.
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for statement in _sqlite._statements(sql.MIGRATIONS[0]):
        conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {sql.APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
    conn.execute(
        "INSERT INTO items (project_id, state, payload, created_at, updated_at) "
        "VALUES ('p', 'ready', '{\"old\": true}', 0, 0)"
    )
    conn.execute("INSERT INTO events (item_id, event_type, fence, at) VALUES (1, 'queued', 0, 0)")
    conn.execute("COMMIT")
    conn.close()
    async with ControlStore(path) as store:
        row = await store.item(1)
        assert row["payload"] == {"old": True}
        assert (row["priority"], row["service_class"], row["sla"]) == (0, "standard", None)
        claim = await store.claim(owner="w")
        assert claim is not None and claim.item_id == 1
        await store.finish(1, fence=claim.fence, result={"new": "columns"})
        assert (await store.item(1))["result"] == {"new": "columns"}
        assert await verify_ledger(store) == []
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
    conn.close()


async def test_a_store_of_the_previous_schema_migrates_to_cancel_and_requeue(
    tmp_path: pathlib.Path,
) -> None:
    # A file as the release before operating single items left it (schema 3), with a
    # ready item and a failed one in it.
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for script in sql.MIGRATIONS[:3]:
        for statement in _sqlite._statements(script):
            conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {sql.APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 3")
    conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
    conn.execute(
        "INSERT INTO items (project_id, state, payload, fence, attempts, owner, error, "
        "created_at, updated_at) VALUES ('p', 'ready', '{}', 0, 0, NULL, NULL, 0, 0), "
        "('p', 'failed', '{}', 1, 1, 'w', 'boom', 0, 1)"
    )
    conn.execute(
        "INSERT INTO events (item_id, event_type, fence, owner, at) VALUES "
        "(1, 'queued', 0, NULL, 0), (2, 'queued', 0, NULL, 0), (2, 'claimed', 1, 'w', 1), "
        "(2, 'failed', 1, 'w', 1)"
    )
    conn.execute("COMMIT")
    conn.close()
    async with ControlStore(path) as store:
        assert await verify_ledger(store) == []
        assert [row["item_id"] for row in await store.items(state="failed")] == [2]
        assert await store.cancel(1, reason="old") == "cancelled"
        await store.requeue(2)
        claim = await store.claim("w")
        assert claim is not None and (claim.item_id, claim.fence) == (2, 2)
        assert await verify_ledger(store) == []
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert {"items_by_state", "items_by_project"} <= names
    conn.close()


# --- SQLite's one write lock ----------------------------------------------------------


async def test_reads_never_wait_behind_a_writer(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db", busy_timeout=30)
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    other.execute("INSERT INTO projects VALUES ('q', 'Q', 'open', 0)")
    try:
        row = await asyncio.wait_for(store.item(item_id), timeout=5)
        assert row["state"] == "ready"
        assert [p["project_id"] for p in await store.projects()] == ["p"]  # not uncommitted q
    finally:
        other.execute("ROLLBACK")
        other.close()
        await store.close()


async def test_opening_waits_for_a_write_lock_held_on_a_fresh_file(
    tmp_path: pathlib.Path,
) -> None:
    # Switching a file to WAL while another connection writes to it fails at once in
    # SQLite, busy timeout or not (several processes creating a fresh store at once hit
    # this): the store waits for the lock instead of failing to open.
    path = tmp_path / "fresh.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # a write lock on a file still in rollback mode
    store = ControlStore(path, busy_timeout=30)
    opening = asyncio.create_task(store.open())
    await asyncio.sleep(0.3)  # the lock is held for a while: the store must not give up
    assert not opening.done()
    other.execute("COMMIT")
    other.close()
    await asyncio.wait_for(opening, timeout=30)
    try:
        await store.create_project("p", "P")
        assert (await store.stats())["schema_version"] >= 1
    finally:
        await store.close()


def _a_thread_runs(function: str) -> bool:
    """Some thread of this process has ``function`` on its stack (waiting in it, say)."""
    for frame in sys._current_frames().values():
        looked: Any = frame
        while looked is not None:
            if looked.f_code.co_name == function:
                return True
            looked = looked.f_back
    return False


@pytest.mark.parametrize("fresh", [False, True], ids=["store", "fresh-file"])
async def test_an_opening_cancelled_while_another_holds_the_lock_ends_at_once(
    tmp_path: pathlib.Path, fresh: bool
) -> None:
    # The worker command stops on a signal while its store opens: it cancels the opening.
    # The connection's thread went on waiting in SQLite's busy handler (or its own pauses,
    # on a fresh file) for the whole busy timeout, and the close, and the process's exit,
    # waited for it: 30 s for a stop that has nothing to finish.
    path = tmp_path / "s.db"
    if not fresh:
        async with ControlStore(path):
            pass
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    # Another program's lock, not in the writers' queue (on a file still in rollback
    # mode, IMMEDIATE: EXCLUSIVE would keep the opening from reading the header).
    holder.execute("BEGIN IMMEDIATE" if fresh else "BEGIN EXCLUSIVE")
    try:
        store = ControlStore(path, busy_timeout=30)
        opening = asyncio.create_task(store.open())
        waits_in = "_switch_to_wal" if fresh else "_migrate"
        await until(lambda: _a_thread_runs(waits_in), what=f"the opening waits in {waits_in}")
        started = asyncio.get_running_loop().time()
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        await store.close()
        assert asyncio.get_running_loop().time() - started < 10  # not the 30 s
        assert not _a_thread_runs(waits_in)  # the connection's thread is done with it
    finally:
        holder.rollback()
        holder.close()
    async with ControlStore(path) as again:  # and the file opens as ever afterwards
        await again.create_project("p", "P")


def test_an_opening_under_another_programs_lock_keeps_a_short_busy_timeout(
    tmp_path: pathlib.Path,
) -> None:
    # The opening's wait for the lock goes in slices (to look whether it was given up):
    # a busy timeout shorter than a slice is still the time it gives up after.
    path = tmp_path / "s.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("BEGIN EXCLUSIVE")
    opening = sqlite3.connect(path, isolation_level=None)
    try:
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            _connection.begin_opening(opening, 0.01, threading.Event())
        assert time.monotonic() - started < 0.06  # not a whole slice (0.1 s)
        assert opening.execute("PRAGMA busy_timeout").fetchone() == (10,)  # as it was
    finally:
        opening.close()
        holder.rollback()
        holder.close()


def test_many_processes_create_a_fresh_store_at_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "fresh.db"
    script = (
        "import asyncio, sys\n"
        "from asyncplane import ControlStore\n"
        "async def main():\n"
        f"    async with ControlStore({str(path)!r}) as store:\n"
        "        await store.create_project(sys.argv[1], 'P')\n"
        "asyncio.run(main())\n"
    )
    workers = [
        subprocess.Popen([sys.executable, "-c", script, f"p{n}"], stderr=subprocess.PIPE)
        for n in range(8)
    ]
    errors = [w.communicate(timeout=120)[1] for w in workers]
    failed = [
        (n, w.returncode, error.decode()[-2000:])
        for n, (w, error) in enumerate(zip(workers, errors, strict=True))
        if w.returncode != 0
    ]
    assert not failed, failed  # each failing worker with what it said

    async def projects() -> list[str]:
        async with ControlStore(path) as store:
            return [p["project_id"] for p in await store.projects()]

    assert asyncio.run(projects()) == sorted(f"p{n}" for n in range(8))


async def test_lock_timeout_is_a_typed_error_and_writes_nothing(
    asyncplane_store_factory: Any,
) -> None:
    store = await asyncplane_store_factory(busy_timeout=0.2)
    await store.create_project("p", "P")
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(DatabaseLocked) as caught:
            await store.enqueue("p", {})
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert await store.enqueue("p", {}) == 1  # nothing half-written by the failed call


async def test_claim_cancelled_before_its_round_takes_nothing(
    store: ControlStore, lock_holder: sqlite3.Connection
) -> None:
    await store.enqueue("alpha", {})
    await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    blocker = asyncio.ensure_future(store.enqueue("alpha", {}))  # occupies the writer
    await until(lambda: writer.in_flight == 1)
    doomed = asyncio.ensure_future(store.claim(owner="doomed"))
    await until(lambda: len(writer._pending) == 1)
    doomed.cancel()
    lock_holder.execute("COMMIT")
    await blocker
    with pytest.raises(asyncio.CancelledError):
        await doomed
    claim = await store.claim(owner="next")
    assert claim is not None and claim.fence == 1 and claim.item_id == 1
    assert all(e["owner"] != "doomed" for e in await store.events(1))
    assert await verify_ledger(store) == []


async def test_claim_cancelled_during_its_round_gives_its_item_back(
    store: ControlStore, lock_holder: sqlite3.Connection
) -> None:
    item_id = await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    doomed = asyncio.ensure_future(store.claim(owner="doomed"))
    await until(lambda: writer.in_flight == 1)  # on the thread, waiting for the lock
    doomed.cancel()
    lock_holder.execute("COMMIT")
    with pytest.raises(asyncio.CancelledError):
        await doomed  # returns at once; the round goes on without its caller
    await writer.submit(barrier)  # a barrier: every earlier round has ended
    await writer.submit(barrier)  # and the give-back queued as it was answered
    # The round committed the claim for nobody: it was given back at once.
    row = await store.item(item_id)
    assert (row["state"], row["attempts"]) == ("ready", 0)
    assert [e["event_type"] for e in await store.events(item_id)] == [
        "queued", "claimed", "released",
    ]  # fmt: skip
    taken = await store.claim(owner="next")
    assert taken is not None and taken.item_id == item_id and taken.fence == 2
    assert await verify_ledger(store) == []


async def test_cancelled_writer_finishes_its_round_and_reports_it(
    store: ControlStore, lock_holder: sqlite3.Connection
) -> None:
    await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    claim = asyncio.ensure_future(store.claim(owner="w"))
    await until(lambda: writer.in_flight == 1)
    later = asyncio.ensure_future(store.enqueue("alpha", {"late": True}))
    await until(lambda: len(writer._pending) == 1)
    assert writer._task is not None
    writer._task.cancel()  # as an event loop shutting down would
    lock_holder.execute("COMMIT")
    got = await claim  # the round ran to its end and its caller learned the result
    assert got is not None and got.fence == 1
    with pytest.raises(StoreClosed):
        await later  # never started: refused, not lost silently
    with pytest.raises(asyncio.CancelledError):
        await writer._task
    await store.close()
    await store.open()
    assert (await store.item(got.item_id))["state"] == "claimed"
    assert len(await store.events(got.item_id)) == 2
    assert await verify_ledger(store) == []


async def test_a_cancelled_writer_refuses_the_give_back_of_its_last_round(
    store: ControlStore, lock_holder: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    # The event loop shuts down (the writer task cancelled) while a round runs whose claim
    # lost its caller: the writer winds up and serves nothing more, so the give-back is
    # refused and said, never left queued for no one; the item waits out its lease.
    item_id = await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    doomed = asyncio.ensure_future(store.claim(owner="doomed"))
    await until(lambda: writer.in_flight == 1)
    doomed.cancel()
    assert writer._task is not None
    writer._task.cancel()  # as an event loop shutting down would
    lock_holder.execute("COMMIT")
    with pytest.raises(asyncio.CancelledError):
        await writer._task
    assert writer.requests_waiting == 0 and not writer.failed  # no round was broken for it
    assert "could not be given back: the store is closed" in caplog.text
    await store.close()
    await store.open()
    assert (await store.item(item_id))["owner"] == "doomed"  # left to its lease
    assert await verify_ledger(store) == []


# --- read-only stores -----------------------------------------------------------------


async def test_a_read_only_store_reads_and_writes_nothing(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ro.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)
    copy = tmp_path / "copy.db"
    conn = sqlite3.connect(path)
    conn.execute("VACUUM INTO ?", (str(copy),))  # a rollback-journal copy, as backups are
    conn.close()
    async with ControlStore(copy, read_only=True) as store:
        assert (await store.counts())["done"] == 1
        assert await verify_ledger(store) == []
        with pytest.raises(ReadOnlyStore):
            await store.enqueue("p", {})
    conn = sqlite3.connect(copy)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # left as it was
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaVersionError, match="needs migrating"):
        await ControlStore(copy, read_only=True).open()


@pytest.mark.parametrize(
    ("events", "rows"), [(50, [32, 8, 8, 1, 1]), (41, [32, 8, 1]), (7, [1] * 7)]
)
async def test_a_rounds_events_go_several_rows_to_a_statement(
    tmp_path: pathlib.Path, events: int, rows: list[int]
) -> None:
    # `_sqlite._insert_events`: an INSERT into the AUTOINCREMENT ledger pays its
    # sqlite_sequence bookkeeping once a statement, so a round's events go 32 rows to a
    # statement, then 8, then one by one (each enqueued item has one event here).
    async with ControlStore(tmp_path / "store.db") as store:
        await store.create_project("alpha", "Alpha")
        writer = await writer_of(store)
        statements: list[str] = []

        def traced(text: str) -> None:
            if text.startswith("INSERT INTO events"):
                statements.append(text)

        await _connection.run(writer._conn, lambda db: db.set_trace_callback(traced))
        ids = await store.enqueue_many("alpha", [{"n": n} for n in range(events)])
        await _connection.run(writer._conn, lambda db: db.set_trace_callback(None))
        assert [text.count("'queued'") for text in statements] == rows
        assert [(await store.events(i))[0]["event_type"] for i in ids] == ["queued"] * events
        assert await verify_ledger(store) == []


@pytest.mark.parametrize(
    ("items", "rows"),
    [(300, [256, 32, 8, 1, 1, 1, 1]), (41, [32, 8, 1]), (7, [1] * 7), (1, [1])],
)
async def test_a_bulk_enqueues_items_go_several_rows_to_a_statement(
    tmp_path: pathlib.Path, items: int, rows: list[int]
) -> None:
    # `_sqlite._insert_rows`: a statement that fires triggers journals the pages it changes
    # that its transaction changed before it, so a bulk enqueue's items go 256 rows to a
    # statement, then 32, then 8, then one by one (fingerprinted here: the twin triggers
    # fire for each).
    async with ControlStore(tmp_path / "store.db") as store:
        await store.create_project("alpha", "Alpha")
        writer = await writer_of(store)
        statements: list[str] = []

        def traced(text: str) -> None:
            # Each trigger a statement fires reports the statement again: counted once.
            if text.lstrip().startswith("INSERT INTO items") and statements[-1:] != [text]:
                statements.append(text)

        await _connection.run(writer._conn, lambda db: db.set_trace_callback(traced))
        jobs = [Job({"n": n}, fingerprint=f"f{n}") for n in range(items)]
        ids = await store.enqueue_many("alpha", jobs)
        await _connection.run(writer._conn, lambda db: db.set_trace_callback(None))
        assert [text.count("'ready'") for text in statements] == rows
        assert [(await store.item(i))["fingerprint"] for i in ids] == [j.fingerprint for j in jobs]
        assert await verify_ledger(store) == []


def test_no_statement_numbers_its_parameters() -> None:
    # Python 3.12.0 to 3.12.3 (Ubuntu 24.04's, say) warned on every binding of a numbered
    # parameter (`?1`), a CPython bug fixed in 3.12.4: a store failed to open under
    # `-W error`, and each bound row went through warnings.warn.
    texts = [value for value in vars(sql).values() if isinstance(value, str)]
    texts += [text for pairs in (sql.LEDGER_CHECKS, sql.ONE_ITEM_CHECKS) for _, text in pairs]
    numbered = [text for text in texts if re.search(r"\?\d", text)]
    assert numbered == []


def _chunk(statement: str) -> tuple[str, int, int]:
    """A traced chunk statement's form ("rows": bound rows, or "json"), how many rows it
    holds, and how many of them are padding."""
    if "(VALUES " in statement:
        rows = statement.split("VALUES ", 1)[1].split(")\nUPDATE", 1)[0]
        return "rows", rows.count("\n") + 1, rows.count("(NULL, NULL, NULL")
    array = statement.split("json_each('", 1)[1].split("')", 1)[0]
    return "json", array.count("[") - 1, 0


@pytest.mark.parametrize(
    ("items", "chunks"),
    [
        (2, [("json", 2, 0)]),
        (47, [("json", 47, 0)]),
        (48, [("rows", 64, 16)]),
        (64, [("rows", 64, 0)]),
        (65, [("rows", 64, 0), ("json", 1, 0)]),
        (130, [("rows", 64, 0), ("rows", 64, 0), ("json", 2, 0)]),
    ],
)
async def test_a_rounds_claims_and_finishes_go_in_chunks(
    tmp_path: pathlib.Path, items: int, chunks: list[tuple[str, int, int]]
) -> None:
    # `_sqlite._returned`: a round's claims, and its finishes as done, go 64 bound rows to
    # a statement while 48 or more are left (padded with rows of NULLs), the rest in one
    # JSON array. Padding matches nothing; every real row gets its own item, owner and
    # fence, and a stale fence among them is refused alone.
    # A round must hold all of them: max_batch (256 by default) says so here.
    async with ControlStore(tmp_path / "store.db", max_batch=256) as store:
        await store.create_project("alpha", "Alpha")
        ids = await store.enqueue_many("alpha", [{"n": n} for n in range(items)])
        writer = await writer_of(store)
        claimed: list[str] = []
        finished: list[str] = []

        def traced(text: str) -> None:
            # A statement is traced again at the start of each trigger it fires.
            for starts, seen in (
                ("UPDATE items\nSET state = 'claimed'", claimed),
                ("UPDATE items SET state = 'done'", finished),
            ):
                chunk = text.startswith("\nWITH t (now) AS (SELECT ") and starts in text
                if chunk and (not seen or seen[-1] != text):
                    seen.append(text)

        await _connection.run(writer._conn, lambda db: db.set_trace_callback(traced))
        claims = await asyncio.gather(*(store.claim(f"w{k}") for k in range(items)))
        assert [_chunk(text) for text in claimed] == chunks
        assert sorted(c.item_id for c in claims if c is not None) == ids
        for k, claim in enumerate(claims):
            assert claim is not None and claim.owner == f"w{k}" and claim.fence == 1
        stale, *rest = claims
        assert stale is not None
        outcomes = await asyncio.gather(
            store.finish(stale.item_id, fence=stale.fence + 1),
            *(store.finish(c.item_id, fence=c.fence, result={"id": c.item_id}) for c in rest if c),
            return_exceptions=True,
        )
        await _connection.run(writer._conn, lambda db: db.set_trace_callback(None))
        assert [_chunk(text) for text in finished] == chunks
        assert isinstance(outcomes[0], FenceRejected) and outcomes[1:] == [None] * (items - 1)
        assert (await store.item(stale.item_id))["state"] == "claimed"
        for claim in rest:
            assert claim is not None
            item = await store.item(claim.item_id)
            assert (item["state"], item["result"]) == ("done", {"id": claim.item_id})
        assert await verify_ledger(store) == []


async def test_the_chunk_statements_in_bound_rows_are_compiled_as_the_store_opens(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `_sqlite._compile_chunks`: compiled at a round's first need, each would cost 0.2 to
    # 0.5 ms inside a round. The store's opening transaction, on the writer's connection,
    # runs both once with rows of NULLs, so that connection has them cached; they write
    # nothing.
    ran: list[tuple[str, int]] = []
    connections: list[sqlite3.Connection] = []
    migrate = _sqlite._migrate

    def traced(db: sqlite3.Connection, *args: Any) -> None:
        connections.append(db)
        before = db.total_changes
        db.set_trace_callback(lambda text: ran.append((text, db.total_changes - before)))
        try:
            migrate(db, *args)
        finally:
            db.set_trace_callback(None)

    monkeypatch.setattr(_sqlite, "_migrate", traced)
    async with ControlStore(tmp_path / "store.db") as store:
        await store.create_project("alpha", "Alpha")
        assert connections == [(await writer_of(store))._conn._conn]
    # The opening transaction ends: both bound-row statements, all 64 rows NULL, then
    # COMMIT, with no change made in between.
    tail = ran[-3:]
    assert [text.split(" AS (VALUES", 1)[0][-23:] for text, _ in tail[:2]] == [
        "c (item_id, owner, lease_expires_at)"[-23:],
        "f (item_id, fence, result, actor_id)"[-23:],
    ]
    assert tail[2][0] == "COMMIT"
    assert [text.count("(NULL, NULL, NULL") for text, _ in tail[:2]] == [sql.VALUES_ROWS] * 2
    assert len({changes for _, changes in tail}) == 1


async def test_a_claim_that_one_arms_first_page_settles_builds_no_merge(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The common claim (one project in reach, nothing lapsed or due, no limits) takes
    # what the page holds without a ClaimMerge (`_rules.sole_arm_choice`); a claim over
    # two projects' rows, or a limited project, still goes through one.
    merges: list[int] = []
    merge = _rules.ClaimMerge

    def counted(*args: Any, **kwargs: Any) -> _rules.ClaimMerge:
        merges.append(1)
        return merge(*args, **kwargs)

    monkeypatch.setattr(_rules, "ClaimMerge", counted)
    first, second = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    claims = await store.claim_batch("w", 2)
    assert [c.item_id for c in claims] == [first, second] and merges == []
    await store.create_project("beta", "Beta")
    in_beta = await store.enqueue("beta", {"n": 3})
    in_alpha = await store.enqueue("alpha", {"n": 4})
    claims = await store.claim_batch("w", 2)
    assert [c.item_id for c in claims] == [in_beta, in_alpha] and merges == [1]
    await store.set_limits("alpha", max_running=10)
    last = await store.enqueue("alpha", {"n": 5})
    claim = await store.claim("w", project_id="alpha")
    assert claim is not None and claim.item_id == last and merges == [1, 1]


async def test_a_preflight_step_reaches_the_items_through_indexes_only(
    tmp_path: pathlib.Path,
) -> None:
    # A step's cost follows what changed, not the store's size: its statements lead by
    # the twin pairs noted (a small table) or the items after the backfill's mark, and
    # reach the rest of the items through indexes, never by walking them (a walk of
    # 100,000 pending items took about 190 ms a step).
    path = tmp_path / "plans.db"
    async with ControlStore(path, identity=("task",)) as store:
        await store.create_project("p", "P")
        await store.enqueue_many("p", [{"task": f"t{n}"} for n in range(50)])
    conn = sqlite3.connect(path)
    try:
        params = {"after": 0, "chunk": 500, "project_id": "p", "actor_id": "a"}
        small = {"SCAN c"}  # the notes
        for name in (
            "ANY_TWIN_NOTED",
            "NOTED_TWIN_PAIRS",
            "FORGET_TWIN_CHECKS",
            "MISSING_FINGERPRINTS",
            "BACKFILL_END",
        ):
            plan = [
                row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + getattr(sql, name), params)
            ]
            walks = [step for step in plan if step.startswith("SCAN") and step not in small]
            assert walks in ([], ["SCAN CONSTANT ROW"]), (name, plan)
            assert any(step.startswith("SEARCH") for step in plan), (name, plan)
    finally:
        conn.close()


def vm_steps(conn: sqlite3.Connection, statement: str, params: Any) -> int:
    """How much work SQLite does to answer ``statement``: its virtual machine's steps,
    counted in hundreds (a measure that no machine's speed blurs)."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    conn.set_progress_handler(count, 100)
    try:
        conn.execute(statement, params).fetchall()
    finally:
        conn.set_progress_handler(None, 100)
    return steps


def steps_before_and_after(
    conn: sqlite3.Connection, statements: tuple[str, ...], grow: str, rows: int
) -> tuple[list[int], list[int]]:
    """Each statement's `vm_steps` (each run after the ones before it, then all rolled
    back), before and after ``grow`` is run ``rows`` times (committed)."""

    def steps() -> list[int]:
        try:
            return [vm_steps(conn, statement, ()) for statement in statements]
        finally:
            conn.rollback()

    before = steps()
    with conn:
        conn.executemany(grow, [()] * rows)
    return before, steps()


async def test_one_items_ledger_check_and_the_stats_cost_what_they_read(
    tmp_path: pathlib.Path,
) -> None:
    # The dashboard's item page checks that item's ledger: it reads the item's rows, so
    # 3,000 other items with their events cost it nothing (filtered after the whole
    # store's checks, a page took 4 s at a million items). stats() (every dashboard page,
    # every sample) counts through the indexes, never the rows and their payloads.
    path = tmp_path / "ledger.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(item_id, fence=claim.fence)
    conn = sqlite3.connect(path)
    try:
        one = tuple(statement for kind, statement in sql.ONE_ITEM_CHECKS
                    if kind not in _models.CHECKS_OF_OTHER_ITEMS)  # fmt: skip
        before = [vm_steps(conn, statement, {"item_id": item_id}) for statement in one]
        with conn:
            conn.executemany(
                "INSERT INTO items (project_id, state, payload, created_at, updated_at)"
                " VALUES ('p', 'done', '{}', 0, 0)",
                [()] * 3000,
            )
            conn.execute(
                "INSERT INTO events (item_id, event_type, fence, at)"
                " SELECT item_id, 'queued', 0, 0 FROM items WHERE item_id > ?",
                (item_id,),
            )
        after = [vm_steps(conn, statement, {"item_id": item_id}) for statement in one]
        for statement, steps, was in zip(one, after, before, strict=True):
            assert steps <= was + 2, (statement, was, steps)
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql.STATES_BY_PROJECT)]
        scans = [step for step in plan if step.startswith("SCAN")]
        assert scans and all("INDEX" in step for step in scans), plan
    finally:
        conn.close()


async def test_counts_and_the_next_due_time_of_a_project_cost_what_it_holds(
    tmp_path: pathlib.Path,
) -> None:
    # counts() of one project (a dashboard's row each) and the next due time of a reach
    # (each time a claimer goes to sleep) read that project's part of the indexes: 5,000
    # deferred items of another project cost them nothing. (A count walked the whole
    # table; the next due time walked every deferred item due before the reach's own.)
    path = tmp_path / "due.db"
    async with ControlStore(path) as store:
        for project in ("big", "small"):
            await store.create_project(project, project)
        await store.enqueue("small", {}, not_before=3e9)
        await store.enqueue("small", {})
        assert await store.claim("w", project_id="small") is not None
    conn = sqlite3.connect(path)
    try:
        params = {"project_id": "small", "actor_id": None, "now": 0.0}
        before = {
            name: vm_steps(conn, getattr(sql, name), params)
            for name in ("COUNT_STATES", "NEXT_DUE")
        }
        with conn:
            conn.executemany(
                "INSERT INTO items (project_id, state, payload, created_at, updated_at, due_at)"
                " VALUES ('big', 'deferred', '{}', 0, 0, ?)",
                [(2e9 + n,) for n in range(5000)],
            )
        after = {name: vm_steps(conn, getattr(sql, name), params) for name in before}
        for name, steps in after.items():
            assert steps <= before[name] + 2, (name, before[name], steps)
    finally:
        conn.close()


#: What a content gathers: its history (runs done, or failed), or its backlog (twins
#: pending, enqueued with dedup off: a content enqueued faster than it runs).
GATHERED = {
    "history": [("failed", "failing"), ("done", "again"), ("done", "paired")],
    "backlog": [("ready", "failing"), ("deferred", "again"), ("ready", "paired")],
}


@pytest.mark.parametrize("gathered", sorted(GATHERED))
async def test_a_look_at_a_contents_twins_costs_the_same_whatever_it_gathered(
    tmp_path: pathlib.Path, gathered: str
) -> None:
    # A content run again and again (dedup off, or a schedule's) gathers done twins, and
    # one that keeps failing gathers failed ones; one enqueued with dedup off faster than
    # it runs gathers a backlog of pending twins. Each look at a content's twins seeks
    # the states it names (the pending twins a done finish settles, the oldest done or
    # else live twin an enqueue takes, a noted pair's two sides, the pair triggers' looks
    # as a twin arrives): 5,000 twins of each content cost them nothing. (Looked up
    # through items_fingerprint by content alone, each read every twin there had been;
    # by content and state, the settle and the pending side of a pair read every pending
    # twin, dedup or not.)
    path = tmp_path / "history.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        for content in ("again", "paired"):
            await store.enqueue("p", {}, fingerprint=content, dedup=False)
            claim = await store.claim("w")
            assert claim is not None
            await store.finish(claim.item_id, fence=claim.fence)
        await store.enqueue("p", {}, fingerprint="failing", dedup=False)
    columns = "(project_id, state, payload, created_at, updated_at, fingerprint, dedup)"
    arrives = f"INSERT INTO items {columns} VALUES ('p', ?, '{{}}', 0, 0, ?, 1)"
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute(arrives, ("ready", "paired"))  # a pair, noted
        named = {"project_id": "p", "actor_id": None, "fingerprint": "again", "item_id": 0,
                 "result": None, "now": 0.0, "chunk": 500}  # fmt: skip
        looks = {
            **{
                f"find {c}": (sql.FIND_TWIN, {"project_id": "p", "fingerprint": c})
                for c in ("again", "failing", "paired")
            },
            "settle": (sql.SETTLE_TWINS, named),
            "pairs": (sql.NOTED_TWIN_PAIRS, named),
            "forget": (sql.FORGET_TWIN_CHECKS, named),
            "arrives pending": (arrives, ("ready", "failing")),  # a done twin?
            "arrives done": (arrives, ("done", "again")),  # a pending twin?
        }

        def steps() -> dict[str, int]:
            try:
                return {name: vm_steps(conn, *look) for name, look in looks.items()}
            finally:
                conn.rollback()

        before = steps()
        with conn:
            conn.executemany(
                f"INSERT INTO items {columns} VALUES ('p', ?, '{{}}', 0, 0, ?, 0)",
                GATHERED[gathered] * 5000,
            )
        for analysed in (False, True):  # (statistics may turn a seek into a walk)
            if analysed:
                conn.execute("ANALYZE")
            after = steps()
            for name, counted in after.items():
                assert counted <= before[name] + 2, (analysed, name, before[name], counted)
        assert conn.execute("SELECT count(*) FROM twin_checks").fetchone() == (1,)
    finally:
        conn.close()


async def test_a_twin_costs_the_same_to_line_up_however_long_its_line(
    tmp_path: pathlib.Path,
) -> None:
    # The triggers that keep a content's line touch its claimable twin(s) and its first
    # held one through their own indexes: a twin arriving ready, or a held one cancelled,
    # costs the same beside 2,000 held twins as beside two. (With the state in
    # items_fingerprint's key, the UPDATE holding the others back took that index, three
    # equalities to two, and read every ready twin of the content, held ones too.)
    path = tmp_path / "line.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue_many("p", [Job({}, fingerprint="c") for _ in range(3)], dedup=False)
    arrives = (
        "INSERT INTO items (project_id, state, payload, created_at, updated_at, fingerprint)"
        " VALUES ('p', 'ready', '{}', 0, 0, 'c')"
    )
    leaves = "UPDATE items SET state = 'cancelled' WHERE item_id = 2"
    conn = sqlite3.connect(path)
    try:
        before, after = steps_before_and_after(conn, (arrives, leaves), arrives, 2000)
        assert all(n <= was + 2 for n, was in zip(after, before, strict=True)), (before, after)
        assert conn.execute("SELECT count(*) FROM items WHERE held = 0").fetchone() == (1,)
    finally:
        conn.close()


async def test_a_contents_deferred_twins_cost_nothing_to_its_line(
    tmp_path: pathlib.Path,
) -> None:
    # A content's deferred twins (due later, enqueued with dedup off) are not in its line:
    # a twin arriving ready, claimed, going back to ready, cancelled, costs the same
    # beside 2,000 of them as beside three (as on PostgreSQL, where it once did not).
    path = tmp_path / "deferred.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue_many(
            "p", [Job({}, fingerprint="c", not_before=4e9) for _ in range(3)], dedup=False
        )
    columns = "(project_id, state, payload, created_at, updated_at, fingerprint, dedup)"
    newest = "(SELECT max(item_id) FROM items)"
    statements = (
        f"INSERT INTO items {columns} VALUES ('p', 'ready', '{{}}', 0, 0, 'c', 0)",
        f"UPDATE items SET state = 'claimed' WHERE item_id = {newest}",
        f"UPDATE items SET state = 'ready' WHERE item_id = {newest}",
        f"UPDATE items SET state = 'cancelled' WHERE item_id = {newest}",
    )
    deferred = f"INSERT INTO items {columns} VALUES ('p', 'deferred', '{{}}', 0, 0, 'c', 0)"
    conn = sqlite3.connect(path)
    try:
        before, after = steps_before_and_after(conn, statements, deferred, 2000)
        assert all(n <= was + 2 for n, was in zip(after, before, strict=True)), (before, after)
    finally:
        conn.close()


async def test_every_name_of_one_file_opens_one_store_with_one_set_of_companions(
    tmp_path: pathlib.Path,
) -> None:
    # SQLite names the -wal and -shm after the name it opens, asyncplane its write queue,
    # board and drain lock: through a symbolic link, or a link's "..", the same names.
    (tmp_path / "data" / "stores").mkdir(parents=True)
    (tmp_path / "stores").symlink_to(tmp_path / "data" / "stores")
    (tmp_path / "link.db").symlink_to(tmp_path / "data" / "work.db")
    real = ControlStore(tmp_path / "data" / "work.db")
    # The kernel reads stores/../work.db as data/work.db (the link's target's parent).
    for name in (tmp_path / "link.db", tmp_path / "stores" / ".." / "work.db"):
        assert ControlStore(name).path == real.path
    async with ControlStore(tmp_path / "link.db") as through_link:
        await through_link.create_project("p", "P")
        await through_link.enqueue("p", {})
        # Named as given; the file (stats, the gauges' store) by its links resolved.
        assert through_link.location == str(tmp_path / "link.db")
        assert (await through_link.stats())["path"] == str(real.path)
    async with ControlStore(tmp_path / "stores" / ".." / "work.db") as through_dots:
        assert (await through_dots.counts())["ready"] == 1
    companions = [name for name in os.listdir(tmp_path / "data") if name != "stores"]
    assert [name for name in os.listdir(tmp_path) if name.startswith("link")] == ["link.db"]
    assert all(name.startswith("work.db") for name in companions), companions


async def test_a_store_with_a_second_hard_link_is_refused(tmp_path: pathlib.Path) -> None:
    # Two names, two WALs: writers through each would never see the other's, and the file
    # would be corrupted. Refused before anything is read or written.
    async with ControlStore(tmp_path / "a.db") as store:
        await store.create_project("p", "P")
    os.link(tmp_path / "a.db", tmp_path / "b.db")
    before = ((tmp_path / "a.db").read_bytes(), sorted(os.listdir(tmp_path)))
    for name in ("a.db", "b.db"):
        with pytest.raises(StorageError, match="has 2 names \\(hard links\\)"):
            await ControlStore(tmp_path / name).open()
    assert ((tmp_path / "a.db").read_bytes(), sorted(os.listdir(tmp_path))) == before
    # Nor a look that writes nothing: through the other name it would miss the commits
    # in the first's WAL (a hard-linked snapshot is to be copied to be looked at).
    with pytest.raises(StorageError, match="copy a snapshot"):
        await ControlStore(tmp_path / "b.db", read_only=True).open()
    said = await asyncio.create_subprocess_exec(  # the command line: a usage error, 2
        sys.executable, "-m", "asyncplane.cli", "stats", str(tmp_path / "b.db"),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await said.communicate()
    assert said.returncode == 2 and b"has 2 names (hard links)" in err, err
