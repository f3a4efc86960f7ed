"""Connection setup, and the one way asyncplane runs work on a connection's thread.

aiosqlite gives every connection a thread of its own and forwards each call to it: one
statement costs one round trip between the event loop and that thread, about as long as
the statement itself on a small machine. A claim is four statements, so asyncplane runs a
whole transaction, or a whole group commit, as one function on the connection's thread
(`run`), which is one round trip. aiosqlite's public calls cannot do that; `run` uses its
``Connection._execute`` hook, and the writer's rounds go on the queue behind it (`post`);
these private names are kept here alone so that an aiosqlite change shows up in one place
(tests/test_sqlite.py guards them).

Connections run in autocommit mode (``isolation_level=None``): the sqlite3 module never
opens a transaction behind our back, and asyncplane issues ``BEGIN IMMEDIATE`` and
``COMMIT`` itself where a reader can see them.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pathlib
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import aiosqlite
import anyio.to_thread

from asyncplane import _errors, _tasks

__all__ = (
    "ReaderPool",
    "Synchronous",
    "check_path",
    "open_reader",
    "open_writer",
    "post",
    "refusal",
    "run",
    "translate",
)

T = TypeVar("T")

Synchronous = Literal["NORMAL", "FULL"]

#: WAL files are truncated back to this size after a checkpoint.
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024
#: Page cache of the write connection, in KiB (SQLite's default is 2 MiB). A deep queue's
#: claims land on rows all over the table; a larger cache keeps their pages at hand.
WRITER_CACHE_KIB = 32 * 1024
#: Page cache of each read connection, in KiB.
READER_CACHE_KIB = 8 * 1024

# SQLite 3.35 brought RETURNING, which every write statement here relies on.
MIN_SQLITE_VERSION = (3, 35, 0)

#: Seconds SQLite's busy handler waits at a time in an opening's wait for the write lock,
#: between the looks at whether the opening was given up (`begin_opening`).
OPENING_LOCK_SLICE = 0.1


def _check_sqlite_version() -> None:
    if sqlite3.sqlite_version_info < MIN_SQLITE_VERSION:
        found = sqlite3.sqlite_version
        need = ".".join(map(str, MIN_SQLITE_VERSION))
        raise _errors.StorageError(f"asyncplane needs SQLite {need} or newer; Python has {found}")
    _check_json_functions()


@functools.cache
def _check_json_functions() -> None:
    """A round's claims and finishes go several to a statement, a small round's over
    ``json_each`` (`asyncplane._sqlite._returned`): refuse an SQLite built without its
    JSON functions (optional before 3.38), on a connection of its own in memory, so that
    no store file is touched (once per process)."""
    probe = sqlite3.connect(":memory:")
    try:
        probe.execute("SELECT count(*) FROM json_each('[1]')").fetchone()
    except sqlite3.Error as exc:
        raise _errors.StorageError(
            f"asyncplane needs SQLite's JSON functions (built in since SQLite 3.38); this "
            f"SQLite ({sqlite3.sqlite_version}) was built without them: {exc}"
        ) from exc
    finally:
        probe.close()


async def run(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(sqlite3_connection, *args)`` on the connection's own thread, in one round trip."""
    raw = conn._conn  # the sqlite3.Connection, to be used only on that thread
    result: T = await conn._execute(fn, raw, *args)  # type: ignore[no-untyped-call]
    return result


def post(conn: aiosqlite.Connection, fn: Callable[..., None], *args: Any) -> None:
    """Queue ``fn(sqlite3_connection, *args)`` for the connection's own thread and return
    at once. ``fn`` hands its outcome to the event loop itself and must not raise: the
    thread wakes the loop once, for that, rather than once more for a future nobody
    awaits. Raises ValueError, as aiosqlite's own calls do, once the connection is closed.

    It puts the call on the queue `run`'s ``_execute`` puts it on, with a stand-in for the
    future there (`_NO_FUTURE`): aiosqlite's thread hands a call's result to its future's
    loop, and the stand-in's loop drops it.
    """
    if not conn._running or conn._connection is None:
        raise ValueError("Connection closed")
    conn._tx.put_nowait((_NO_FUTURE, functools.partial(fn, conn._conn, *args)))


class _Dropped:
    """The stand-in for a posted call's future, and its own loop: what aiosqlite's thread
    would schedule on it (the call's result) is dropped."""

    __slots__ = ()

    def get_loop(self) -> _Dropped:
        return self

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> None:
        return None

    def done(self) -> bool:
        return True


_NO_FUTURE: Any = _Dropped()


def refusal(path: pathlib.Path) -> _errors.StorageError | None:
    """Why ``path`` cannot be opened as a store's file, or None (a regular file, or
    nothing yet: made on first use, or, read-only, refused by SQLite). A stat that opens
    nothing: SQLite would open a FIFO, a device or a socket and then block reading it (a
    read-only opening of a FIFO never returns). A file with a second hard link is refused
    too: through two names, two WALs (a writer's corrupt the store; a reader through the
    other name misses the commits in the first's WAL)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = _errors.StorageError(f"cannot look at {path}: {exc}")
        problem.__cause__ = exc
        return problem
    mode = found.st_mode
    if stat.S_ISREG(mode) and found.st_nlink > 1:
        return _errors.StorageError(
            f"{path} has {found.st_nlink} names (hard links): SQLite would keep a WAL for "
            "each and corrupt the store, or read one without the other's commits; keep one "
            "name (a symbolic link is fine), and copy a snapshot (cp) to look at it"
        )
    if not stat.S_ISREG(mode):
        kind = (
            "a directory" if stat.S_ISDIR(mode)
            else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )  # fmt: skip
        return _errors.NotAnAsyncplaneDatabase(f"{path} is {kind}, not an asyncplane store")
    return None


async def check_path(path: pathlib.Path) -> None:
    """Raise the `refusal` of ``path``, looked at on a worker thread, if it has one."""
    problem = await anyio.to_thread.run_sync(refusal, path)
    if problem is not None:
        raise problem


async def open_writer(
    path: pathlib.Path,
    *,
    synchronous: Synchronous,
    busy_timeout: float,
    given_up: threading.Event | None = None,
    vet: Callable[[sqlite3.Connection], object] | None = None,
) -> aiosqlite.Connection:
    """Open the store's only write connection: WAL, the chosen synchronous level, FKs on.

    ``vet(db)`` runs first, before any setting that writes to the file (WAL mode does),
    so a file that is not ours can be refused untouched. Cancelled, it sets ``given_up``
    (the caller's, to hand on to its own waits for the lock: `begin_opening`), which the
    thread's wait for a lock looks at.
    """
    given_up = threading.Event() if given_up is None else given_up
    _check_sqlite_version()
    try:
        conn = await _opened(
            aiosqlite.connect(
                str(path), isolation_level=None, timeout=busy_timeout, cached_statements=256
            )
        )
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    try:
        await run(conn, _configure_writer, synchronous, busy_timeout, given_up, vet)
    except BaseException:
        given_up.set()  # the thread stops waiting for the lock, and the close comes next
        await conn.close()
        raise
    return conn


async def _opened(connecting: aiosqlite.Connection) -> aiosqlite.Connection:
    """``connecting`` awaited to its end, even when a cancellation comes meanwhile: then
    closed, and the cancellation goes on. Cut short, aiosqlite would leave its thread to
    open the file anyway and post the connection to a loop that may have closed."""
    conn: aiosqlite.Connection
    conn, cancelled = await _tasks.to_the_end(connecting, "asyncplane-sqlite-connect")
    if cancelled:
        await _tasks.to_the_end(conn.close(), "asyncplane-sqlite-close")
        raise asyncio.CancelledError
    return conn


async def open_reader(path: pathlib.Path, *, busy_timeout: float) -> aiosqlite.Connection:
    """Open a read-only connection (``mode=ro``): reads never queue behind the writer."""
    uri = path.as_uri() + "?mode=ro"  # the store keeps its path absolute
    try:
        conn = await _opened(
            aiosqlite.connect(
                uri, uri=True, isolation_level=None, timeout=busy_timeout, cached_statements=64
            )
        )
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    try:
        await run(conn, _configure_reader, busy_timeout)
    except BaseException:
        await conn.close()
        raise
    return conn


def _configure_writer(
    db: sqlite3.Connection,
    synchronous: Synchronous,
    busy_timeout: float,
    given_up: threading.Event,
    vet: Callable[[sqlite3.Connection], object] | None,
) -> None:
    try:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        if vet is not None:
            vet(db)
        mode = _switch_to_wal(db, busy_timeout, given_up)
        if str(mode).lower() != "wal":
            raise _errors.StorageError(
                f"could not put the database in WAL mode (it stayed in {mode!r} mode); "
                "asyncplane needs WAL for concurrent readers and writers"
            )
        # synchronous is one of two literals checked by the store; never user text.
        db.execute(f"PRAGMA synchronous = {synchronous}")
        db.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        db.execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")
        db.execute("PRAGMA foreign_keys = ON")
    except sqlite3.Error as exc:
        raise translate(exc) from exc


def _switch_to_wal(db: sqlite3.Connection, busy_timeout: float, given_up: threading.Event) -> str:
    """``PRAGMA journal_mode = WAL``, retried while another connection holds a lock.

    The switch needs the file to itself, and SQLite does not call the busy handler for it
    when another connection holds a write lock (several processes opening a fresh file at
    once, each switching it): it reports "database is locked" at once. So asyncplane
    waits itself, up to the busy timeout, pausing on the connection's thread (never the
    event loop's) for at most 50 ms at a time, until the opening is given up.
    """
    deadline = time.monotonic() + busy_timeout
    pause = 0.001
    while True:
        try:
            return str(db.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            locked = isinstance(translate(exc), _errors.DatabaseLocked)
            if not locked or time.monotonic() + pause > deadline:
                raise
        if given_up.wait(pause):
            raise _given_up()
        pause = min(pause * 2, 0.05)


def begin_opening(db: sqlite3.Connection, busy_timeout: float, given_up: threading.Event) -> None:
    """``BEGIN IMMEDIATE`` for an opening's transaction (the schema's), waiting up to the
    busy timeout for a lock another connection holds, and no longer once ``given_up`` is
    set: a program stopped while its store opens (a signal to the worker command) must
    not wait out the busy timeout first. SQLite's busy handler waits in slices of
    `OPENING_LOCK_SLICE`, between which this looks; nothing else would stop its wait
    (``sqlite3_interrupt`` does not). A round's wait is the writers' queue's instead
    (`asyncplane._write_lock`), which the event loop gives up on its side.
    """
    deadline = time.monotonic() + busy_timeout
    try:
        while True:
            # (each slice within what is left of the busy timeout: a short one is kept)
            left = min(OPENING_LOCK_SLICE, max(deadline - time.monotonic(), 0.0))
            db.execute(f"PRAGMA busy_timeout = {int(left * 1000)}")
            try:
                db.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                locked = isinstance(translate(exc), _errors.DatabaseLocked)
                if not locked or time.monotonic() >= deadline:
                    raise
            if given_up.is_set():
                raise _given_up()
    finally:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")


def _given_up() -> _errors.StorageError:
    """What the connection's thread raises when an opening it waits for a lock for was
    given up: nobody hears it (the opening's caller was cancelled), the thread only stops."""
    return _errors.StorageError("the store's opening was given up while it waited for a lock")


def _configure_reader(db: sqlite3.Connection, busy_timeout: float) -> None:
    try:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        db.execute("PRAGMA query_only = ON")
        db.execute(f"PRAGMA cache_size = -{READER_CACHE_KIB}")
    except sqlite3.Error as exc:
        raise translate(exc) from exc


class ReaderPool:
    """The read-only connections of one opening of a store.

    Reads never queue behind the writer: each runs on a connection of its own (at most
    ``size`` at once), opened on first need and kept for the next read. A pool lives as
    long as one opening of its store; once closed it is never used again, and any
    connection still busy when it closes is closed by its reader as soon as it is done,
    so no connection thread outlives its store.
    """

    def __init__(self, path: pathlib.Path, *, size: int, busy_timeout: float) -> None:
        self._path = path
        self._busy_timeout = busy_timeout
        self._slots = asyncio.Semaphore(size)
        self._idle: list[aiosqlite.Connection] = []
        self._open: set[aiosqlite.Connection] = set()
        self._busy = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._closed = False
        self._watch: aiosqlite.Connection | None = None
        self._watch_lock = asyncio.Lock()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(db, *args)`` on a reader's thread."""
        async with self._slots:
            if self._closed:
                raise _errors.StoreClosed("the store is closed")
            self._busy += 1
            self._quiet.clear()
            conn: aiosqlite.Connection | None = None
            try:
                conn = self._idle.pop() if self._idle else None
                if conn is None:
                    conn = await open_reader(self._path, busy_timeout=self._busy_timeout)
                    self._open.add(conn)
                return await run(conn, fn, *args)
            finally:
                if conn is not None:
                    if self.closed:  # closed while this read ran: this reader goes too
                        self._open.discard(conn)
                        await asyncio.shield(conn.close())
                    else:
                        self._idle.append(conn)
                self._busy -= 1
                if self._busy == 0:
                    self._quiet.set()

    async def data_version(self) -> int:
        """PRAGMA data_version on a connection kept for it: changes on others' commits.

        data_version is per connection, so one connection of its own answers every call
        (it is opened on first use and closed with the pool).
        """
        async with self._watch_lock:  # one watch connection, however many ask at once
            if self._closed:
                raise _errors.StoreClosed("the store is closed")
            if self._watch is None:
                watch = await open_reader(self._path, busy_timeout=self._busy_timeout)
                if self.closed:  # closed while it opened: it must not outlive the pool
                    await asyncio.shield(watch.close())
                    raise _errors.StoreClosed("the store is closed")
                self._watch = watch
                self._open.add(watch)
            watch = self._watch
        version: int = await run(watch, _read_data_version)
        return version

    @property
    def closed(self) -> bool:
        """True once the pool refuses reads."""
        return self._closed

    async def close(self, *, wait: bool) -> None:
        """Refuse new reads and close idle readers; with ``wait``, also wait for busy ones."""
        self._closed = True
        idle, self._idle = self._idle, []
        if self._watch is not None:
            idle.append(self._watch)
            self._watch = None
        for conn in idle:
            self._open.discard(conn)
            await asyncio.shield(conn.close())
        if wait:
            await self._quiet.wait()

    def abandon(self) -> None:
        """Stop every reader thread without the event loop, which has already ended."""
        self._closed = True
        for conn in self._open:
            conn.stop()
        self._open.clear()
        self._idle.clear()


def _read_data_version(db: sqlite3.Connection) -> int:
    value: int = db.execute("PRAGMA data_version").fetchone()[0]
    return value


# Primary result codes (https://sqlite.org/rescode.html); sqlite3 names them only from 3.11.
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_NOTADB = 26


def translate(exc: sqlite3.Error) -> _errors.StorageError:
    """Map a driver error to asyncplane's family; the caller raises it ``from exc``."""
    message = str(exc)
    lowered = message.lower()
    # sqlite_errorcode is the extended code (Python 3.11+); its low byte is the primary code.
    code = getattr(exc, "sqlite_errorcode", -1) & 0xFF
    if code in (_SQLITE_BUSY, _SQLITE_LOCKED) or any(
        # Python 3.10 has no sqlite_errorcode: fall back on SQLite's own messages.
        words in lowered
        for words in ("database is locked", "database table is locked", "schema is locked")
    ):
        return _errors.DatabaseLocked(f"database is locked: {message}")
    if code == _SQLITE_NOTADB or "file is not a database" in lowered:
        return _errors.NotAnAsyncplaneDatabase(f"not an SQLite database: {message}")
    return _errors.StorageError(f"{type(exc).__name__}: {message}")
