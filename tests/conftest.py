"""Shared fixtures: every test works on a real database, never a fake.

The store fixtures come from asyncplane's own pytest plugin (``asyncplane_store``,
``asyncplane_clock``, ``asyncplane_store_factory``); the short names below are aliases.

The tests of the write path and the worker runtime (`BOTH_LOOPS`) run on both event loops
a program may give the store: asyncio's own and uvloop (which asyncplane's commands choose
when it is installed, and many programs run on).

Every test that uses those fixtures runs twice, the way River proves its drivers: on an
SQLite file under tmp_path, and on a fresh schema of a PostgreSQL server (a throwaway
cluster the session starts, or ``$ASYNCPLANE_TEST_POSTGRES_URL``). A test whose mechanism
is SQLite's own (the file, its locks, raw sqlite3 tampering) is marked ``sqlite_only``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import pathlib
import re
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from asyncplane import ControlStore, testing
from asyncplane.testing import ManualClock

T = TypeVar("T")


#: Test modules whose async tests run on asyncio's loop and on uvloop.
BOTH_LOOPS = frozenset({
    "test_claims.py", "test_combine.py", "test_sqlite.py", "test_work.py",
    "test_write_lock.py", "test_writer.py",
})  # fmt: skip


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """asyncio and uvloop for the modules in `BOTH_LOOPS`, asyncio's loop for the rest."""
    del config
    uvloop = _uvloop()
    if item.path.name not in BOTH_LOOPS or uvloop is None:
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _uvloop() -> Any:
    """uvloop, which the test extra installs (None where it has no build: Windows)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


@pytest.fixture(autouse=True, scope="session")
def _commands_left_to_choose_their_loop() -> Iterator[None]:
    """Every command the suite starts chooses its event loop itself (uvloop, installed
    with the suite), whatever ASYNCPLANE_LOOP the shell has; tests set it where they mean to."""
    saved = os.environ.pop("ASYNCPLANE_LOOP", None)
    yield
    if saved is not None:
        os.environ["ASYNCPLANE_LOOP"] = saved


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "asyncplane_backend" not in metafunc.fixturenames:
        return
    backends = ["sqlite", "postgresql"]
    if metafunc.definition.get_closest_marker("sqlite_only") is not None:
        backends = ["sqlite"]
    elif metafunc.definition.get_closest_marker("postgresql_only") is not None:
        backends = ["postgresql"]
    metafunc.parametrize("asyncplane_backend", backends, indirect=True)


@pytest.fixture
def location_of(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path, asyncplane_backend: str
) -> Iterator[Callable[[str], str]]:
    """For tests that open stores themselves (in other processes, say): ``location_of(name)``
    is a file under tmp_path, or the URL of a fresh PostgreSQL schema, dropped after."""
    made: list[str] = []
    server = (
        request.getfixturevalue("asyncplane_postgres_url")
        if asyncplane_backend == "postgresql"
        else None
    )

    def location(name: str) -> str:
        if server is None:
            return str(tmp_path / name)
        schema = f"p_{len(made)}_{os.getpid()}_{abs(hash(request.node.nodeid)) % 10**8}"
        _blocking(
            testing.execute_sql(
                server, f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            )
        )
        made.append(schema)
        return testing.with_schema(server, schema)

    try:
        yield location
    finally:
        for schema in made:
            _blocking(testing.execute_sql(server or "", f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


@pytest.fixture
def url(location_of: Callable[[str], str], asyncplane_backend: str) -> str:
    """The URL of a fresh PostgreSQL schema, for a ``postgresql_only`` test."""
    assert asyncplane_backend == "postgresql"
    return location_of("pg")


def _blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end from sync code, even inside a running loop (an async
    test's own): then on a loop of its own, in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work).result(timeout=60)


@pytest.fixture
def clock(asyncplane_clock: ManualClock) -> ManualClock:
    return asyncplane_clock


@pytest.fixture
async def store(asyncplane_store: ControlStore) -> ControlStore:
    await asyncplane_store.create_project("alpha", "Project Alpha")
    return asyncplane_store


class RawPostgres:
    """A plain connection to a PostgreSQL store's schema, with sqlite3's calling shape.

    Tests tamper through ``raw.execute(sql, params)`` with ``?`` placeholders on either
    backend. asyncpg runs on an event loop of its own, in a thread, so the calls can be
    synchronous like sqlite3's (they block the test's loop for a moment; nothing else
    runs then).
    """

    backend = "postgresql"

    def __init__(self, url: str) -> None:
        import asyncpg

        #: What a trigger's refusal raises.
        self.Refused: type[Exception] = asyncpg.exceptions.RaiseError

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="raw-postgres")
        self._thread.start()
        self._conn = self._call(asyncpg.connect(url))

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=60)

    def execute(self, statement: str, params: Sequence[Any] = ()) -> RawResult:
        statement = _numbered(statement)
        head = statement.lstrip().upper()
        if head.startswith(("SELECT", "WITH", "EXPLAIN", "SHOW")) or " RETURNING " in head:
            rows = self._call(self._conn.fetch(statement, *params))
            return RawResult([tuple(row) for row in rows], len(rows))
        status = self._call(self._conn.execute(statement, *params))
        return RawResult([], _rowcount(status))

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        self._call(self._conn.executemany(_numbered(statement), list(rows)))

    def close(self) -> None:
        try:
            self._call(self._conn.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class RawResult:
    """What `RawPostgres.execute` returns: the few cursor methods the tests use."""

    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.fetchall())


def _numbered(statement: str) -> str:
    """sqlite3's ``?`` placeholders as PostgreSQL's ``$1, $2, ...``."""
    counter = itertools.count(1)
    return re.sub(r"\?", lambda _: f"${next(counter)}", statement)


def _rowcount(status: str) -> int:
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else -1


def open_raw(store: ControlStore) -> Any:
    """A plain connection to a store's database, for tampering behind its back: sqlite3
    on an SQLite store, `RawPostgres` on a PostgreSQL one. ``.backend`` says which."""
    if store.backend == "sqlite":
        return _SQLite(sqlite3.connect(store.path, isolation_level=None))
    return RawPostgres(store.location)


@pytest.fixture
def raw(asyncplane_store: ControlStore) -> Iterator[Any]:
    """`open_raw` on the test's store, closed after the test."""
    conn = open_raw(asyncplane_store)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def raw_of() -> Iterator[Callable[[ControlStore], Any]]:
    """`open_raw` for any store of the test; every connection is closed after it."""
    opened: list[Any] = []

    def connect(store: ControlStore) -> Any:
        conn = open_raw(store)
        opened.append(conn)
        return conn

    try:
        yield connect
    finally:
        for conn in opened:
            conn.close()


class _SQLite:
    """sqlite3's connection, with a ``backend`` attribute like RawPostgres."""

    backend = "sqlite"
    Refused = sqlite3.IntegrityError

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


_sessions: list[pytest.Session] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _sessions.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave, saying so, if a connection's thread outlives the run.

    A test that fails with its worker still running can leave a store that a later
    give-back opened again; aiosqlite's threads are not daemons, so the interpreter would
    wait on them at exit for ever and turn one failure into a CI timeout. They get five
    seconds in all to end; then the run ends with its own status (1 if it had passed: a
    test left a store open, which is a fault too).
    """
    deadline = time.monotonic() + 5
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in left:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    left = [thread for thread in left if thread.is_alive()]
    if left:
        names = ", ".join(sorted(thread.name for thread in left))
        sys.stdout.flush()
        sys.stderr.write(f"\n{len(left)} thread(s) still running at exit, left by a test: ")
        sys.stderr.write(f"{names}\n")
        sys.stderr.flush()
        status = int(_sessions[-1].exitstatus) if _sessions else 1
        os._exit(status or 1)
