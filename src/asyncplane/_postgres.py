"""The PostgreSQL backend: the same claims, fences and ledger, for fleets on many hosts.

Writes are operations run by this process's writer (`asyncplane._postgres_writer`) inside
its transaction; each one does its checks before its first write, so a refusal writes
nothing, and writes its state change and its ledger event together. Reads run on a small
connection pool; a read of several statements runs in one REPEATABLE READ, READ ONLY
transaction (one snapshot).

Who is authoritative for a lease: the row, as on SQLite. What differs is how writers
meet. SQLite lets one writer in at a time; here many transactions run at once, so every
decision is made under a row lock: claims select their candidates ``FOR UPDATE SKIP
LOCKED`` (another claimer's rows are skipped, not waited for), and every settlement is an
UPDATE whose WHERE clause carries the fence and the state, which PostgreSQL re-checks
after waiting for a concurrent writer of that row. A fence therefore still only rises,
and a stale holder's report still matches nothing. One running item per content
(fingerprint) is kept by a partial unique index; enqueue dedup by an advisory lock per
fingerprint (see `asyncplane._postgres_sql`).

Driver errors become asyncplane errors here and in the writer, once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

import asyncpg

from asyncplane import (
    _backend,
    _clock,
    _errors,
    _fingerprint,
    _lock,
    _models,
    _rules,
    _schedule,
    _tasks,
    _write_queue,
)
from asyncplane import _postgres_sql as sql
from asyncplane import _postgres_writer as _writer
from asyncplane._engine import redact

__all__ = (
    "PostgresBackend",
    "ServerClock",
    "TwinWakes",
    "read_version",
    "redact",
)

T = TypeVar("T")

_log = logging.getLogger("asyncplane.store")


#: However quiet the notifications, a sleeping drainer looks for work this often.
_SAFETY_POLL_SECONDS = 5.0


#: The parameters of a URL's query that hold a secret (libpq's names, in any case and
#: however percent-encoded), shown as ***.
class ServerClock:
    """The database server's clock, as this process sees it: the local wall clock plus
    the offset measured at every write round (and at opening).

    A PostgreSQL store without an injected clock measures leases by the server's clock
    (read in the transaction that grants them); this clock lets the rest of the process
    (the drain loop's alarms, a purge's cutoff, ages in stats) agree with it, however far
    this host's clock is off. Safe to read from any thread.
    """

    __slots__ = ("_offset", "_read_at")

    #: Seconds a reading is trusted for: the writer reads the server's clock again after.
    FRESH_FOR = 2.0
    #: It moves with real time (`asyncplane._clock.real_time`).
    REAL_TIME = True

    def __init__(self) -> None:
        self._offset = 0.0
        self._read_at: float | None = None

    def now(self) -> float:
        """The server's time now, estimated from the last reading."""
        return time.time() + self._offset

    def observe(self, server_now: float) -> None:
        """Take a fresh reading of the server's clock."""
        self._offset = server_now - time.time()
        self._read_at = time.monotonic()

    @property
    def fresh(self) -> bool:
        """Whether the last reading is recent enough to measure a lease by."""
        return self._read_at is not None and time.monotonic() - self._read_at < self.FRESH_FOR

    async def wait_until(self, when: float) -> None:
        """Sleep until the server's clock reads ``when`` (as far as this host can tell,
        stepped clocks included: `_clock.sleep_until`)."""
        await _clock.sleep_until(self.now, when)

    def __repr__(self) -> str:
        return f"ServerClock(offset={self._offset:+.3f}s)"


class TwinWakes:
    """The wake-ups this process owes the fleet for twins it wrote unheld beside a live
    twin, which a settle under way may have missed (see the SQL's migration 13).

    Such a twin's trigger tells this process on a channel of the write connection's own
    (`asyncplane._postgres_sql.twin_channel`), heard once the twin has committed. Each
    pass takes every content heard of (in statements of `_WAKES_A_STATEMENT`) to a pooled
    connection, which holds nothing and waits for nothing: it tries each content's
    hand-off lock shared, and then sends one NOTIFY for all those it had with no twin
    running.
    Those whose hand-off is under way (a settle has the lock) are looked at again a
    little later, the connection back in the pool meanwhile, or at once when more is
    heard. A task of its own, so the writer never waits for another host's settle. A
    pass that fails (a lost connection), or a content that stays busy for longer than
    the drainers' safety poll, is let go: that poll finds the twin.
    """

    def __init__(self, pool: asyncpg.Pool, name: str) -> None:
        self._pool = pool
        # When each content was last told of, and that tell's number: a look made before
        # a later tell of its content committed does not answer for that one.
        self._contents: dict[tuple[str, str], tuple[float, int]] = {}
        self._tells = itertools.count()
        self._heard = asyncio.Event()
        self._stopping = False
        self._task = _tasks.detached(self._run(), f"asyncplane-twin-wakes[{name}]")
        self._task.add_done_callback(_log_failure)
        #: Tells heard, contents found busy, NOTIFYs sent, and contents let go with none
        #: needed (a twin ran): read by tests.
        self.told = 0
        self.busy = 0
        self.sent = 0
        self.left_to_settles = 0

    def heard(self, conn: Any, pid: int, channel: str, payload: object) -> None:
        """A twin of this process's committed unheld beside a live twin."""
        try:
            project, content = json.loads(str(payload))
        except (ValueError, TypeError):
            return  # not a trigger's: nothing to pass on
        if self._task.done():
            return  # (it failed, and said so: nobody would pass it on)
        self._contents[(str(project), str(content))] = (time.monotonic(), next(self._tells))
        self.told += 1
        self._heard.set()

    async def _run(self) -> None:
        delay = _WAKE_RETRY_FIRST
        while True:
            if not self._contents:
                if self._stopping:
                    return
                await self._heard.wait()
                delay = _WAKE_RETRY_FIRST
            self._heard.clear()
            keys = list(self._contents)
            woken = 0
            for start in range(0, len(keys), _WAKES_A_STATEMENT):
                woken += await self._pass_on(keys[start : start + _WAKES_A_STATEMENT])
            if woken:
                try:
                    await self._pool.execute(sql.WAKE_DRAINERS)
                except _DRIVER_ERRORS as exc:  # a lost connection, the pool closing: let go
                    _log.warning("asyncplane: twins' wake-ups were not sent: %r", exc)
                else:
                    self.sent += 1
            if self._contents:  # a settle of some content is under way: soon again
                with contextlib.suppress(asyncio.TimeoutError):
                    # (Not asyncio.wait_for: before Python 3.12 it swallows a stop's
                    # cancellation that comes as the event is set, which stop() does.)
                    await _tasks.within(self._heard.wait(), delay, "asyncplane-twin-wakes-wait")
                delay = min(2 * delay, _WAKE_RETRY_MOST)

    async def _pass_on(self, keys: list[tuple[str, str]]) -> int:
        """One statement's worth: what it looked at, or let go, leaves the set; how many
        of them to wake the drainers for."""
        told = [self._contents[key][1] for key in keys]
        try:
            row = await self._pool.fetchrow(
                sql.TWINS_WAITED, [key[0] for key in keys], [key[1] for key in keys]
            )
        except _DRIVER_ERRORS as exc:  # a lost connection, the pool closing: let go
            _log.warning("asyncplane: twins' wake-ups were not sent: %r", exc)
            busy: set[int] = set()
            woken = 0
        else:
            assert row is not None
            busy = {index - 1 for index in row["busy"]}
            woken = row["woken"]
            self.busy += len(busy)
            self.left_to_settles += row["running"]
        now = time.monotonic()
        for index, key in enumerate(keys):
            heard_at, tell = self._contents[key]
            if tell != told[index]:
                continue  # told of again meanwhile: looked at again
            if index not in busy:
                del self._contents[key]
            elif now - heard_at >= _SAFETY_POLL_SECONDS:
                del self._contents[key]
                _log.warning("asyncplane: a twin's wake-up was let go: its content stayed busy")
        return int(woken)

    async def stop(self, graceful: bool) -> None:
        """End: gracefully, once what was heard is passed on (for at most a few
        seconds); otherwise at once."""
        self._stopping = True
        self._heard.set()
        if graceful:
            await asyncio.wait([self._task], timeout=_WAKES_STOP_SECONDS)
        if not self._task.done():
            self._task.cancel()  # the drainers' safety poll covers what is left
            await asyncio.wait([self._task], timeout=_WAKES_STOP_SECONDS)

    def forget(self) -> None:
        """Let the task go with an event loop that has ended."""
        self._stopping = True


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("asyncplane: %s failed", task.get_name(), exc_info=task.exception())


class _Opening:
    """One opening of a PostgreSQL store, as its reads see it."""

    __slots__ = ("lost",)

    def __init__(self) -> None:
        #: Closed because it broke (the engine opens the store afresh), not by the program.
        self.lost = False


class PostgresBackend(_backend.Writes):
    """Implements `asyncplane._backend.Backend` on one schema of a PostgreSQL database."""

    #: A settle alone, or a claim alone, is one statement that commits by itself
    #: (`asyncplane._postgres_writer.FirstAlone`); together they take a transaction with
    #: a savepoint each, four times the round trips, which measured slower (see
    #: docs/architecture.md, "A settle and the next claim in one round").
    settle_with_claim = False
    import_records_bounded = True
    versions_looked_within: float | None = _SAFETY_POLL_SECONDS

    def __init__(
        self,
        url: str,
        sizing: _backend.Sizing,
        *,
        clock: _clock.Clock | None,
        on_change: _backend.ChangeHook | None = None,
        on_settled: _backend.ChangeHook | None = None,
        connect_timeout: float,
    ) -> None:
        # The reaches this process has seen limited projects in: a claim of one takes the
        # limits first, before any item lock (see _claim_many).
        limited: set[tuple[str | None, str | None]] = set()
        self._limited = limited
        # How many more claims of a reach go the general way before they try the one
        # statement again (see _claim_alone).
        detours: dict[tuple[str | None, str | None], int] = {}
        super().__init__(
            sizing,
            claim_many=_writer.FirstAlone(
                functools.partial(_claim_many, limited),
                functools.partial(_claim_alone, limited, detours),
                functools.partial(_claimed_alone, detours),
            ),
            finish_many=_writer.FirstAlone(_finish_many, _finish_alone, _finished_alone),
        )
        self._url = url
        self._clock = clock
        # Without an injected clock, leases follow the server's: the writer reads it, and
        # this clock carries the readings to the rest of the process.
        self._server_clock = ServerClock() if clock is None else None
        self._on_change = on_change
        self._on_settled = on_settled
        self._connect_timeout = connect_timeout
        self._pool: asyncpg.Pool | None = None
        self._listener: asyncpg.Connection | None = None
        self._wakes: TwinWakes | None = None
        self._schema = ""
        self._version = 0
        self._deaf = False  # the listener is gone: every poll must look again
        #: The server ended the listener's session (not a read-only opening's going
        #: without one): the store opens afresh on its next call, listener and all.
        self._listener_lost = False
        #: This opening's: closed because it broke (a reopen, not the program's close),
        #: reads its pool fails then are a lost connection's StorageError, not StoreClosed.
        self._opening = _Opening()
        self._settled = 0  # settles heard of (NOTIFY asyncplane_settled)

    @property
    def clock(self) -> _clock.Clock:
        """The injected clock, or the server's as this process sees it."""
        clock = self._clock if self._clock is not None else self._server_clock
        assert clock is not None  # one of the two, always
        return clock

    @property
    def location(self) -> str:
        """The URL, without its password."""
        return redact(self._url)

    # --- lifecycle ---------------------------------------------------------------------

    async def _connect(self, **settings: str) -> asyncpg.Connection:
        """A session of the store's own, exempt from idle_session_timeout.

        The drain guard's session holds its lock while it idles, and the listener's waits
        for notifications and sends nothing: a server that ended them for idling would
        take the guard from a drain that is running, and leave the store deaf. (None sits
        idle in a transaction: the guard's lock is a session's, taken by a statement that
        commits at once, so idle_in_transaction_session_timeout never meets them.)
        """
        try:
            conn: asyncpg.Connection = await asyncpg.connect(
                self._url, timeout=self._connect_timeout, server_settings=settings or None
            )
        except _DRIVER_ERRORS as exc:
            raise _errors.StorageError(
                f"cannot connect to {redact(self._url)}: {type(exc).__name__}: {exc}"
            ) from exc
        except ValueError:  # the driver could not read the URL (its text may hold the password)
            raise _errors.StorageError(
                f"cannot connect to {redact(self._url)}: the driver cannot read this URL"
            ) from None
        try:
            await _never_idle_out(conn)
        except BaseException as exc:
            conn.terminate()
            if isinstance(exc, _DRIVER_ERRORS):
                raise _writer.translate(exc) from exc
            raise
        return conn

    async def open(self) -> None:
        """Connect, create or migrate the schema, start the writer, the pool and the listener.

        Whatever fails on the way, every connection made so far is closed again.
        """
        async with contextlib.AsyncExitStack() as undo:
            # The write connection plans each statement once. PostgreSQL would plan a
            # statement anew for each call's parameters, which costs more than running
            # it: 1.4 ms to plan the claim's candidates against 0.3 ms to run them. The
            # claim's and finish's statements are written so that their one plan is led
            # by an index (a lateral read per project, ids named with = ANY); a chunk of
            # cancel_where or requeue_where walks the ids in order under any plan, its
            # optional filters applied on the way (reads keep their custom plans).
            # Read committed whatever the server's default: the triggers' looks after a
            # lock (twins in line, twin pairs) rely on each statement's own snapshot.
            conn = await self._connect(
                plan_cache_mode="force_generic_plan",
                default_transaction_isolation="read committed",
            )
            undo.push_async_callback(_close_quietly, conn)
            try:
                await _refuse_encoding(conn)
                if self._sizing.read_only:
                    await _check_current_schema(conn)
                else:
                    await _migrate(conn)
                self._schema = await conn.fetchval(sql.CURRENT_SCHEMA)
                if self._server_clock is not None:
                    self._server_clock.observe(await conn.fetchval(sql.SERVER_NOW))
                # (Read committed too: a statement of several looks, TwinWakes', relies on
                # each look's own snapshot; reads of several statements ask for more.)
                settings = {"default_transaction_isolation": "read committed"}
                if conn.get_server_version().major >= 14:
                    # A startup setting, not a SET: the pool's RESET ALL at each release
                    # goes back to it (a SET made once would be undone by the first).
                    settings["idle_session_timeout"] = "0"
                pool = await asyncpg.create_pool(
                    self._url, min_size=1, max_size=self._sizing.read_connections,
                    timeout=self._connect_timeout, server_settings=settings,
                )  # fmt: skip
            except _DRIVER_ERRORS as exc:
                raise _writer.translate(exc) from exc
            undo.push_async_callback(_terminate_pool, pool)
            listener: asyncpg.Connection | None = await self._connect()
            assert listener is not None
            undo.push_async_callback(_close_quietly, listener)
            try:
                await listener.add_listener(sql.CHANNEL, self._heard)
                await listener.add_listener(sql.SETTLED_CHANNEL, self._heard_settled)
            except _DRIVER_ERRORS as exc:
                # A hot standby refuses LISTEN (it is in recovery) and serves reads as the
                # primary does: a read-only opening goes without notifications there (deaf:
                # every poll looks again). One to write is refused as its writes would be.
                in_recovery = isinstance(exc, asyncpg.ReadOnlySQLTransactionError)
                if not (self._sizing.read_only and in_recovery):
                    raise _writer.translate(exc) from exc
                await _close_quietly(listener)
                listener = None
            else:
                listener.add_termination_listener(self._went_deaf)
            wakes = None
            if not self._sizing.read_only:
                wakes = TwinWakes(pool, self._schema)
                undo.push_async_callback(wakes.stop, False)
                try:
                    # (the server's own number: a pooler may hand the driver another)
                    session: int = await conn.fetchval(sql.BACKEND_PID)
                    assert listener is not None  # (only a read-only opening goes without)
                    await listener.add_listener(sql.twin_channel(session), wakes.heard)
                except _DRIVER_ERRORS as exc:
                    raise _writer.translate(exc) from exc
            undo.pop_all()  # all made: from here on close() owns them
        self._pool, self._listener, self._wakes = pool, listener, wakes
        self._opening = _Opening()
        self._deaf = listener is None
        self._listener_lost = False

        async def close_readers(graceful: bool) -> None:
            # This opening's own pool and listener: a store reopened meanwhile (a close
            # that was cancelled, a lost connection) has new ones, which stay.
            await self._close_side_connections(graceful, pool, listener, wakes)

        if self._sizing.read_only:
            await _close_quietly(conn)
            return
        self._writer = _writer.Writer(
            conn, self._clock, name=self._schema, max_batch=self._sizing.max_batch,
            on_exit=close_readers, orphaned=self.orphaned,
            server_clock=self._server_clock, replanned=pool.expire_connections,
            claim_reaches=functools.partial(_lock_claim_reaches, self._limited),
        )  # fmt: skip
        self._writer.start()

    @property
    def twin_wakes(self) -> TwinWakes | None:
        """The wake-ups this opening owes the fleet for its twins (None: not open to write)."""
        return self._wakes

    @property
    def broken(self) -> bool:
        """True when the write connection, or the listener's, was lost: the store opens
        afresh on next use (without a listener every idle drainer would poll for ever,
        and the twins' wake-ups, heard on it, would be lost)."""
        writer = self._writer
        return writer is not None and (writer.failed or self._listener_lost)

    def _heard(self, conn: Any, pid: int, channel: str, payload: object) -> None:
        # Called on the event loop by the listener's connection: a commit (here or on
        # another host) may have made work claimable. Waiting drainers wake at once.
        if payload == self._schema:
            self._version += 1
            if self._on_change is not None:
                self._on_change()

    def _heard_settled(self, conn: Any, pid: int, channel: str, payload: object) -> None:
        # An item settled (here or on another host): wait() looks again.
        if payload == self._schema:
            self._settled += 1
            if self._on_settled is not None:
                self._on_settled()

    def _went_deaf(self, conn: Any) -> None:
        self._deaf = True
        if conn is self._listener:  # its session ended, not closed by this store
            self._listener_lost = True
            # What was sent meanwhile is lost: this process's waiters look now (and the
            # store opens afresh), not at their poll interval.
            if self._on_change is not None:
                self._on_change()

    async def _close_side_connections(
        self,
        graceful: bool,
        pool: asyncpg.Pool | None,
        listener: asyncpg.Connection | None,
        wakes: TwinWakes | None,
    ) -> None:
        """Close one opening's pool and listener (never a later opening's), once its
        wake-ups are sent."""
        if self._pool is pool:
            self._pool = None
        if self._listener is listener:
            self._listener = None
        if self._wakes is wakes:
            self._wakes = None
        if wakes is not None:
            if graceful and listener is not None:
                # The tells of this store's last commits, on their way to the listener,
                # come before the answer to a round trip made after them.
                with contextlib.suppress(Exception):
                    await listener.fetchval(sql.BACKEND_PID, timeout=_WAKES_STOP_SECONDS)
            await wakes.stop(graceful)
        if listener is not None:
            with contextlib.suppress(Exception):
                await listener.close(timeout=5)
        if pool is not None:
            try:
                if graceful:
                    # A cancellation that comes as the close ends (a close of a pool
                    # already closed ends at once) is raised, never swallowed.
                    with contextlib.suppress(Exception):
                        await _tasks.within(pool.close(), 30, "asyncplane-pool-close")
            finally:
                pool.terminate()

    async def close(self, *, lost: bool = False) -> None:
        """Serve queued writes, then close the writer, the pool and the listener."""
        writer, pool, listener, wakes = self._writer, self._pool, self._listener, self._wakes
        if lost:
            self._opening.lost = True
        if writer is not None:
            await writer.stop()  # its on_exit closes the pool and the listener
            if self._writer is writer:
                self._writer = None
        await self._close_side_connections(True, pool, listener, wakes)

    def forget(self) -> None:
        """Drop every connection left behind by an event loop that has ended.

        Their transports belonged to that loop and cannot be closed through it any more;
        the sockets go with the objects, and the server ends each session when its socket
        closes. Nothing is lost: whatever those connections had not committed never was.
        """
        for drop in (
            self._wakes.forget if self._wakes is not None else None,
            self._writer.abandon if self._writer is not None else None,
            self._pool.terminate if self._pool is not None else None,
            self._listener.terminate if self._listener is not None else None,
        ):
            if drop is not None:
                with contextlib.suppress(Exception):  # the loop is closed: nothing to wait for
                    drop()
        self._writer = self._pool = self._listener = self._wakes = None

    async def _write(self, op: _writer.Write[T]) -> T:
        return cast(T, await self._submit(op))

    async def _read(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(conn, *args)`` on a pooled connection."""
        if self._pool is None:
            raise _errors.StoreClosed("the store is closed")
        pool, writer, opening = self._pool, self._writer, self._opening
        try:
            async with pool.acquire() as conn:
                return await fn(conn, *args)
        except _DRIVER_ERRORS as exc:
            if self._pool is pool:
                raise _writer.translate(exc) from exc
            if not (opening.lost or (writer is not None and writer.failed)):
                # closed under this read on purpose (a lost connection is a StorageError)
                raise _errors.StoreClosed("the store was closed during this read") from exc
            raise _errors.StorageError(
                "a connection of the store was lost, and the pool this read waited for "
                "was closed before it was served (nothing was read; the store opens "
                f"afresh on its next call): {exc!r}"
            ) from exc

    async def _fetch(self, statement: str, *args: Any) -> list[Any]:
        return await self._read(_fetch, statement, *args)

    # --- projects and scope --------------------------------------------------------------

    async def create_project(self, op: _backend.NewProject) -> None:
        await self._write(_bind(_create_project, op))

    async def get_project(self, project_id: str) -> _backend.ProjectRow:
        rows = await self._fetch(sql.GET_PROJECT, project_id)
        return _rules.one_project(rows, project_id)

    async def list_projects(self) -> list[_backend.ProjectRow]:
        return [_backend.ProjectRow(*row) for row in await self._fetch(sql.LIST_PROJECTS)]

    async def unassign(self, project_id: str, actor_id: str) -> None:
        # A round of its own: its DELETE waits for other hosts' actor writes holding the
        # assignment row, which may be waiting on rows this process's round holds.
        await self._write(_write_queue.Apart(_bind(_unassign, project_id, actor_id)))

    async def visible_projects(self, actor_id: str) -> list[str]:
        return [row[0] for row in await self._fetch(sql.VISIBLE_PROJECTS, actor_id)]

    # --- items ---------------------------------------------------------------------------

    def _enqueue_write(self, op: _backend.EnqueueOp) -> _writer.Locking:
        keys = tuple((op.project_id, fp) for fp in _rules.dedup_fingerprints(op.items))
        return _writer.Locking(keys, _bind(_enqueue, op))

    async def renew(self, op: _backend.RenewOp) -> float:
        return await self._write(_bind(_renew, op))

    def _named_write(self, op: Any) -> _writer.Operation[Any]:
        return _bind(_NAMED_WRITES[type(op)], op)

    async def offloaded(self, handle: str, actor_id: str | None) -> list[_backend.ItemRow]:
        rows = await self._fetch(sql.OFFLOADED, handle, actor_id)
        return [_backend.ItemRow(*row) for row in rows]

    async def list_items(self, op: _backend.ListOp) -> list[_backend.ItemRow]:
        states = _rules.listing_arms(op.where.states, op.where.project_id is not None)
        statement = sql.list_items(
            states, op.where.project_id is not None, op.newest, op.include_payload
        )
        params = _list_params(op.where, states, op.newest, op.after, op.limit)
        return [_backend.ItemRow(*row) for row in await self._fetch(statement, *params)]

    async def settled_version(self) -> int:
        """A number that changes when an item settles (NOTIFY asyncplane_settled)."""
        if self._pool is None:
            raise _errors.StoreClosed("the store is closed")
        if self._deaf:
            self._settled += 1
        return self._settled + int(time.monotonic() // _SAFETY_POLL_SECONDS)

    async def mark_awaited(self, item_id: int) -> None:
        """From its commit on, the item's settle notifies asyncplane_settled (migration 6).
        A read-only store writes no mark: it hears other settles at its safety look."""
        if not self._sizing.read_only:
            await self._write(_bind(_mark_awaited, item_id))
            # Its mark committed: a settle under way, which looked for marks before it,
            # has committed once this row lock is had (held a moment, by one statement).
            await self._fetch(sql.SETTLES_UNDER_WAY, item_id)

    async def missing_fingerprints(
        self, op: _backend.PreflightOp, after_item_id: int, identity: tuple[str, ...]
    ) -> _backend.Backfill:
        rows = await self._fetch(
            sql.MISSING_FINGERPRINTS, after_item_id, op.chunk, op.project_id, op.actor_id
        )
        # (No end: commits here come in no order of ids, so a look cannot tell that no
        # item below the table's last id is still to come; the index serves it instead.)
        return _backend.Backfill(*_fingerprint.backfill(rows, after_item_id, op.chunk, identity))

    async def set_fingerprints(self, writes: list[tuple[str, int]]) -> None:
        await self._write(_bind(_set_fingerprints, writes))

    async def any_twin_noted(self, op: _backend.PreflightOp) -> bool:
        return bool((await self._fetch(sql.ANY_TWIN_NOTED, op.project_id, op.actor_id))[0][0])

    async def settle_pending_twins(self, op: _backend.PreflightOp) -> tuple[int, bool]:
        # The notes a page at a time, each page a transaction of its own (its contents'
        # locks are held to its commit: one transaction over every note could run the
        # server's lock table out), until the step has settled its chunk or read every
        # note: as on SQLite, which reads them all at once, notes of pairs that cannot
        # settle (the pending twin claimed since) do not use the step up.
        settled, after = 0, 0
        while True:
            count, full, after = await self._write(
                _bind(_settle_pending_twins, op, op.chunk - settled, after)
            )
            settled += count
            if settled >= op.chunk or not full:
                return settled, settled >= op.chunk

    async def twin_pairs(self, op: _backend.PreflightOp) -> list[tuple[str, str]]:
        rows = await self._fetch(sql.ALL_TWIN_PAIRS, op.project_id, op.actor_id)
        return [(row[0], row[1]) for row in rows]

    async def note_twin_pairs(self, contents: list[tuple[str, str]]) -> None:
        await self._write(_bind(_note_twin_pairs, contents))

    async def purge_candidates(
        self, cutoff: float, chunk: int, after: tuple[float, int] = _backend.PURGE_START
    ) -> _backend.Histories:
        return await self._read(_purge_candidates, cutoff, chunk, after)

    async def standing_as_archived(self, archived: tuple[_backend.Archived, ...]) -> set[int]:
        return await self._read(_standing_as_archived, archived)

    async def purge_items(self, archived: tuple[_backend.Archived, ...]) -> int:
        return await self._write(_bind(_purge_items, archived))

    async def stats(self) -> _backend.StoreStats:
        now = None if self._clock is None else self._clock.now()
        return await self._read(_stats, now)

    async def get_limits(self, project_id: str | None) -> list[_backend.LimitsRow]:
        if project_id is None:
            rows = await self._fetch(sql.ALL_LIMITS)
        else:
            rows = await self._fetch(sql.GET_LIMITS, project_id)
            if not rows:
                raise _rules.unknown_project(project_id)
        return [_rules.limits_row(tuple(row)) for row in rows]

    async def list_schedules(self, name: str | None) -> list[_backend.ScheduleRow]:
        if name is None:
            rows = await self._fetch(sql.LIST_SCHEDULES)
        else:
            rows = await self._fetch(sql.GET_SCHEDULE, name)
            if not rows:
                raise _rules.unknown_schedule(name)
        return [_backend.ScheduleRow._make(row) for row in rows]

    async def delete_schedule(self, name: str) -> None:
        await self._write(_bind(_delete_schedule, name))

    async def next_tick(self, crons: bool) -> float | None:
        rows = await self._fetch(sql.NEXT_TICK, crons)
        value: float | None = rows[0][0]
        return value

    async def next_cron_tick(self) -> float | None:
        rows = await self._fetch(sql.NEXT_CRON_TICK)
        value: float | None = rows[0][0]
        return value

    async def schedule_ticks(self, name: str, limit: int) -> list[_backend.TickRow]:
        rows = await self._fetch(sql.SCHEDULE_TICKS, name, limit)
        return [_backend.TickRow._make(row) for row in rows]

    async def list_assignments(self) -> list[_backend.AssignmentRow]:
        return [_backend.AssignmentRow(*row) for row in await self._fetch(sql.LIST_ASSIGNMENTS)]

    async def export_items(self, op: _backend.ExportOp) -> _backend.Histories:
        return await self._read(_export_items, op)

    async def copy_projects(self, op: _backend.CopyProjectsOp) -> int:
        return await self._write(_bind(_copy_projects, op))

    async def copy_items(self, op: _backend.CopyOp) -> tuple[int, int]:
        return await self._write(_bind(_copy_items, op))

    async def first_foreign_item(self, source: str) -> int | None:
        rows = await self._fetch(sql.FIRST_FOREIGN_ITEM, source)
        return None if not rows else int(rows[0][0])

    async def export_imports(
        self, after: tuple[str, str] | None, limit: int
    ) -> list[_backend.ImportRecord]:
        rows = await self._fetch(sql.EXPORT_IMPORTS, *(after or ("", "")), limit)
        return [_backend.ImportRecord._make(tuple(row)) for row in rows]

    async def copy_imports(self, records: tuple[_backend.ImportRecord, ...]) -> None:
        await self._write(_bind(_copy_imports, records))

    async def store_identity(self) -> str | None:
        return await self._read(_store_identity)

    async def last_item_id(self) -> int:
        ((last, exact),) = await self._fetch(sql.LAST_ITEM_ID)
        if not exact:
            _log.warning(
                "asyncplane: this role may not read the items' id sequence: the highest "
                "id the store still names (%d) stands for the last one handed out, which "
                "misses any item purged above it (GRANT SELECT on the sequence reads it)",
                last,
            )
        return int(last)

    async def advance_item_ids(self, last: int, source: str) -> None:
        await self._write(_bind(_advance_item_ids, last, source))

    async def source_dropped_up_to(self, source: str) -> int | None:
        key = (_rules.dropped_source(source), _rules.SOURCE_DROPPED)
        rows = await self._fetch(sql.DROPPED_UP_TO, *key)
        return None if not rows else int(rows[0][0])

    async def record_source_dropped(self, source: str) -> None:
        await self._write(_bind(_record_dropped, source))

    async def copied_up_to(self, source: str) -> tuple[int, int | None]:
        rows = await self._fetch(sql.COPIED_UP_TO, source)
        return int(rows[0][0]), rows[0][1]

    async def sizes(self) -> tuple[int, int]:
        rows = await self._fetch(sql.SCHEMA_BYTES)
        return int(rows[0][0]), 0

    async def next_due(self, project_id: str | None, actor_id: str | None) -> float | None:
        rows = await self._fetch(sql.NEXT_DUE, project_id, actor_id)
        times: list[float] = [] if rows[0][0] is None else [rows[0][0]]
        now = self.clock.now()
        for row in await self._fetch(sql.NEXT_DUE_LIMITED, project_id, actor_id):
            limited = _rules.limited_due(
                _rules.limits_row(tuple(row[:7])), now,
                ready=row[7], due_at=row[8], takeover_at=row[9],
            )  # fmt: skip
            if limited is not None:
                times.append(limited)
        return min(times, default=None)

    async def get_item(self, item_id: int, actor_id: str | None) -> _backend.ItemRow:
        if actor_id is None:
            rows = await self._fetch(sql.GET_ITEM, item_id)
        else:
            rows = await self._fetch(sql.GET_ITEM_SCOPED, item_id, actor_id)
        if not rows:
            raise _rules.invisible_item(item_id, actor_id)
        return _backend.ItemRow(*rows[0])

    async def ended_among(self, item_ids: list[int], states: tuple[str, ...]) -> list[int]:
        return [row[0] for row in await self._fetch(sql.ENDED_AMONG, item_ids, list(states))]

    async def get_events(
        self, item_id: int, actor_id: str | None, last: int | None = None
    ) -> list[_backend.EventRow]:
        if last is not None:
            rows = await self._fetch(sql.GET_LAST_EVENTS, item_id, actor_id, last)
        elif actor_id is None:
            rows = await self._fetch(sql.GET_EVENTS, item_id)
        else:
            rows = await self._fetch(sql.GET_EVENTS_SCOPED, item_id, actor_id)
        return _rules.history(rows, item_id, actor_id)

    async def count_states(self, project_id: str | None, actor_id: str | None) -> dict[str, int]:
        return {row[0]: row[1] for row in await self._fetch(sql.COUNT_STATES, project_id, actor_id)}

    async def data_version(self) -> int:
        """A number that changes when a commit may have made work claimable (NOTIFY)."""
        if self._pool is None:
            raise _errors.StoreClosed("the store is closed")
        if self._deaf:  # no notifications any more: make every poll look
            self._version += 1
        # And every few seconds in any case: a notification may have been missed (one
        # sent while the listener reconnected, say), and a drainer must not sleep forever.
        return self._version + int(time.monotonic() // _SAFETY_POLL_SECONDS)

    async def tally(self) -> _backend.LedgerTally:
        return await self._read(_tally)

    async def item_ids(self, state: str) -> list[int]:
        return [row[0] for row in await self._fetch(sql.ITEM_IDS_IN_STATE, state)]

    async def verify_ledger(
        self, limit: int | None, item_id: int | None = None
    ) -> list[_models.LedgerProblem]:
        return await self._read(_verify_ledger, limit, item_id)

    async def settled_per_minute(
        self, since: float, actor_id: str | None
    ) -> list[tuple[float, str, str, int]]:
        rows = await self._fetch(sql.SETTLED_PER_MINUTE, since, actor_id)
        return [(float(m), p, s, int(n)) for m, p, s, n in rows]

    # --- the single-drainer guard --------------------------------------------------------

    @contextlib.asynccontextmanager
    async def drain_guard(self) -> AsyncIterator[_lock.Guard]:
        """A session advisory lock for this schema: one drainer across every host.

        Yields whether it was had. Held on a connection of its own for as long as the
        drain runs; closing that connection (or the process dying) releases it. A session
        the server ends (a restart, a failover, pg_terminate_backend) releases it too: the
        guard then says it is lost, and the drain stops rather than run unguarded.
        """
        conn = await self._connect()  # cancelling this holds nothing yet
        try:
            # Once asked, the server's answer is awaited even under cancellation, and the
            # connection closed before the cancellation goes on: the lock is then free
            # for the next drainer at once, not when a background close gets round to it.
            try:
                answer, cancelled = await _tasks.to_the_end(
                    conn.fetchval(sql.DRAIN_TRY_LOCK), "asyncplane-drain-guard"
                )
            except _DRIVER_ERRORS as exc:
                raise _writer.translate(exc) from exc
            if cancelled:
                raise asyncio.CancelledError
            if answer is None:  # the lock's key is the schema's name: there is none
                raise _errors.NotAnAsyncplaneDatabase(
                    "no schema to drain: the search_path names none that exists (a typo in "
                    "the URL, or a schema dropped)"
                )
            guard = _lock.Guard(bool(answer))

            def ended(_: object) -> None:
                guard.lose("the server ended the session that held the drain lock")

            conn.add_termination_listener(ended)
            if conn.is_closed():  # ended before the listener was there to hear it
                ended(conn)
            try:
                yield guard
            finally:
                conn.remove_termination_listener(ended)
        finally:
            _, late = await _tasks.to_the_end(_close_quietly(conn), "asyncplane-drain-guard-close")
        if late:
            raise asyncio.CancelledError


async def _never_idle_out(conn: asyncpg.Connection) -> None:
    await conn.execute(sql.NEVER_IDLE_OUT)


async def _close_quietly(conn: asyncpg.Connection) -> None:
    try:
        await conn.close(timeout=5)
    except Exception:
        conn.terminate()


#: How long a closing store waits to send the twins' wake-ups it owes (`TwinWakes`),
#: and how soon, then how often at most, a wake-up looks again while a settle of its
#: content is under way.
_WAKES_STOP_SECONDS = 5.0
_WAKE_RETRY_FIRST = 0.002
_WAKE_RETRY_MOST = 0.1
#: Contents a statement of `TwinWakes` looks at, at most (each a lock held to its end).
_WAKES_A_STATEMENT = 100

#: What the driver may raise: every one becomes an asyncplane error, here or in the writer.
_DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    asyncio.TimeoutError,
)


async def _terminate_pool(pool: asyncpg.Pool) -> None:
    pool.terminate()


def _bind(fn: Callable[..., Awaitable[T]], *args: Any) -> _writer.Operation[T]:
    async def op(conn: asyncpg.Connection, now: float) -> T:
        return await fn(*args, conn, now)

    return op


# --- refusals ------------------------------------------------------------------------------


async def _refuse_fenced(
    conn: asyncpg.Connection, item_id: int, fence: int, actor_id: str | None
) -> NoReturn:
    """Explain why a fenced update matched no row, by raising the right error."""
    found = await conn.fetchrow(sql.DIAGNOSE_ITEM, actor_id, item_id)
    raise _rules.fence_refusal(item_id, fence, actor_id, found)


# --- write operations (run by the writer, inside its transaction) -------------------------


async def _insert_events(conn: asyncpg.Connection, events: Sequence[_rules.Event]) -> None:
    if len(events) == 1:
        await conn.execute(sql.INSERT_EVENT, *events[0])
    elif events:
        await conn.execute(sql.INSERT_EVENTS, *(list(c) for c in zip(*events, strict=True)))


async def _create_project(op: _backend.NewProject, conn: asyncpg.Connection, now: float) -> None:
    if await conn.fetchval(sql.INSERT_PROJECT, op.project_id, op.name, op.status, now) is None:
        raise _rules.project_exists(op.project_id)


async def _set_limits(
    op: _backend.LimitsOp, conn: asyncpg.Connection, now: float
) -> _backend.LimitsRow | None:
    if await conn.fetchval(sql.LOCK_PROJECT, op.project_id) is None:
        raise _rules.unknown_project(op.project_id)
    # Every claim begun before waits to its commit, and none begins meanwhile (see
    # LIMITS_CHANGE); then the limits' row, which a claim may hold still.
    await conn.execute(sql.LIMITS_CHANGE)
    await conn.execute(sql.LOCK_LIMITS, op.project_id)
    found = _rules.limits_row(tuple((await conn.fetch(sql.GET_LIMITS, op.project_id))[0]))
    new = _rules.merged_limits(found, op.project_id, dict(op.changes), now)
    if new is None:
        await conn.execute(sql.DELETE_LIMITS, op.project_id)
        return None
    await conn.execute(sql.PUT_LIMITS, *new[:6])
    return new._replace(running=found.running)


async def _set_schedule(
    op: _backend.ScheduleOp, conn: asyncpg.Connection, now: float
) -> _backend.ScheduleRow:
    if await conn.fetchval(sql.PROJECT_LOCKED, op.project_id) is None:
        raise _rules.unknown_project(op.project_id)
    found = await conn.fetchrow(sql.LOCK_SCHEDULE, op.name)
    old = None if found is None else _backend.ScheduleRow._make(found)
    row = _rules.declared_schedule(op, old, now)
    await conn.execute(sql.PUT_SCHEDULE, *row)
    return row


async def _pause_schedule(
    op: _backend.PauseScheduleOp, conn: asyncpg.Connection, now: float
) -> None:
    name, paused = op
    found = await conn.fetchrow(sql.LOCK_SCHEDULE, name)
    if found is None:
        raise _rules.unknown_schedule(name)
    row = _backend.ScheduleRow._make(found)
    next_at = _schedule.paused_next_at(row.timetable(), row.paused, paused, row.next_at, now)
    await conn.execute(sql.PAUSE_SCHEDULE, paused, next_at, now, name)


async def _delete_schedule(name: str, conn: asyncpg.Connection, now: float) -> None:
    if await conn.execute(sql.DELETE_SCHEDULE, name) == "DELETE 0":
        raise _rules.unknown_schedule(name)
    await conn.execute(sql.DELETE_TICKS, name)


async def _run_schedules(
    op: _backend.RunSchedulesOp, conn: asyncpg.Connection, now: float
) -> _backend.SchedulesRun:
    """As SQLite's: the due schedules (those another host runs now skipped), each due
    tick's key reserved, then its item enqueued; a key another transaction reserved is
    waited for, and if it commits, this one enqueues nothing for that tick. A schedule
    whose content's lock another transaction holds is left due, for the next look."""
    due = await conn.fetch(sql.DUE_SCHEDULES, now, op.limit, op.crons, list(op.passed))
    rows = [_backend.ScheduleRow._make(r) for r in due]
    enqueued = 0
    looked = 0
    passed: list[tuple[str, str]] = []
    for row in rows:
        item, fingerprint = _rules.tick_item(row)
        table = row.timetable()
        reason = _schedule.unreadable(table)
        if reason is not None:  # left, untouched, to a host that can read it
            passed.append((row.name, reason))
            continue
        if fingerprint is not None and not await conn.fetchval(
            sql.TRY_LOCK_CONTENT, row.project_id, fingerprint
        ):
            # Its content is being written elsewhere (an enqueue, another host's tick) and
            # its pending twin may be about to commit: the schedule stays due, for the
            # next look, in a second. Never waited for: this transaction holds schedule
            # rows, which a round holding that content's lock may wait for.
            continue
        looked += 1
        plan = _schedule.plan(table, row.catch_up, row.next_at, now)
        last = None
        for tick in plan.ticks:
            if await conn.fetchval(sql.RESERVE_TICK, row.name, tick, now) is None:
                continue  # enqueued before: never again
            twin = None
            if fingerprint is not None:
                twin = await conn.fetchval(sql.PENDING_TWIN, row.project_id, fingerprint)
            if twin is None:
                queued = _schedule.tick_detail(row.name, table, tick)
                adding = _backend.EnqueueOp(row.project_id, (item,), None)
                (twin,) = await _enqueue(adding, conn, now, queued)
                enqueued += 1
            await conn.execute(sql.FILL_TICK, twin, row.name, tick)
            last = tick
        await conn.execute(sql.MOVE_SCHEDULE, plan.next_at, last, now, row.name)
        await conn.execute(sql.FORGET_TICKS, row.name, now - _schedule.TICKS_KEPT)
    return _backend.SchedulesRun(enqueued, looked, tuple(passed))


async def _set_project_status(
    op: _backend.ProjectStatusOp, conn: asyncpg.Connection, now: float
) -> str:
    found = await conn.fetchval(sql.PROJECT_STATUS_LOCKED, op.project_id)
    if found is None:
        raise _rules.unknown_project(op.project_id)
    status: str = _rules.project_status_after(found, op.status, op.expected)
    if status != found:
        await conn.execute(sql.SET_PROJECT_STATUS, status, op.project_id)
    return status


async def _assign(op: _backend.AssignOp, conn: asyncpg.Connection, now: float) -> None:
    project_id, actor_id = op
    if await conn.fetchval(sql.PROJECT_LOCKED, project_id) is None:
        raise _rules.unknown_project(project_id)
    await conn.execute(sql.ASSIGN, actor_id, project_id, now)


async def _unassign(project_id: str, actor_id: str, conn: asyncpg.Connection, now: float) -> None:
    if await conn.fetchval(sql.PROJECT_EXISTS, project_id) is None:
        raise _rules.unknown_project(project_id)
    await conn.execute(sql.UNASSIGN, actor_id, project_id)


async def _insert_items(
    conn: asyncpg.Connection, rows: Sequence[_rules.NewRow], actor_id: str | None, now: float,
    queued: dict[str, Any] | None = None,
) -> list[int]:  # fmt: skip
    """Insert rows (in order) with their "queued" (and "deferred") events; their ids."""
    ids = [r[0] for r in await conn.fetch(sql.NEXT_ITEM_IDS, len(rows))]
    columns = list(zip(*rows, strict=True))
    await conn.execute(sql.INSERT_ITEMS, ids, *(list(column) for column in columns))
    events: list[_rules.Event] = []
    for item_id, row in zip(ids, rows, strict=True):
        events.extend(_rules.arrival_events(item_id, row, actor_id, now, queued))
    await _insert_events(conn, events)
    return ids


async def _enqueue(
    op: _backend.EnqueueOp,
    conn: asyncpg.Connection,
    now: float,
    queued: dict[str, Any] | None = None,
) -> list[int]:
    if op.actor_id is None:
        if await conn.fetchval(sql.PROJECT_EXISTS, op.project_id) is None:
            raise _rules.unknown_project(op.project_id)
    elif await conn.fetchval(sql.IS_ASSIGNED, op.actor_id, op.project_id) is None:
        raise _rules.project_denied(op.project_id, op.actor_id)
    wanted = _rules.dedup_fingerprints(op.items)
    found: dict[str, int] = {}
    if wanted:
        # One enqueue of a given content at a time: its caller holds the content's lock
        # (the writer's round took every lock its enqueues need at its start, in order,
        # by contents or, past CONTENTS_LOCKED_ONE_BY_ONE, by shards; a tick tried it),
        # then one look for earlier twins of them all.
        found = {r[0]: r[1] for r in await conn.fetch(sql.FIND_TWINS, op.project_id, wanted)}
    plan = _rules.EnqueuePlan(op.items, found)
    inserted: list[int] = []
    if plan.new:
        rows = [_rules.new_row(op.project_id, op.items[p], now) for p in plan.new]
        inserted = await _insert_items(conn, rows, op.actor_id, now, queued)
    return plan.ids(inserted)


async def _next_page(
    conn: asyncpg.Connection, arm: tuple[str, str | None], reach: tuple[Any, ...],
    limit: int, offset: int, now: float,
) -> list[Any]:  # fmt: skip
    """One more page of an arm's candidates (its first came with every other arm's)."""
    tag, project = arm
    if tag == "r":
        return list(await conn.fetch(sql.CLAIM_READY, project, limit, offset))
    if tag == "d":
        return list(await conn.fetch(sql.CLAIM_DUE, project, limit, offset, now))
    return list(await conn.fetch(sql.CLAIM_LAPSED, *reach, limit, offset, now))


async def _lock_claim_reaches(
    limited_reaches: set[tuple[str | None, str | None]],
    reaches: set[tuple[str | None, str | None]],
    conn: asyncpg.Connection,
) -> None:
    """A round's claims of several reaches, one of them known to be limited here: every
    limited project's lock of them all, as the first of them runs, in one order
    (`LOCK_REACHES_LIMITS`), for each claim's `TAKE_LIMITS` to find held. Where none is
    known limited, every claim tries its limit locks without waiting (`_claim_many`), and
    no round waits on them."""
    if limited_reaches.isdisjoint(reaches):
        return
    await conn.execute(sql.CLAIMS_SHARED)
    await conn.execute(
        sql.LOCK_REACHES_LIMITS, [reach[0] for reach in reaches], [reach[1] for reach in reaches]
    )


async def _claim_many(
    limited_reaches: set[tuple[str | None, str | None]],
    ops: list[_backend.ClaimOp],
    conn: asyncpg.Connection,
    now: float,
) -> list[list[_backend.ClaimRow]]:
    """Claims that share their filters and lease, decided together (see the SQLite one).

    One statement reads every arm's first page (and the lapsed claims with no attempts
    left, which fail here instead of moving on); one tries the content locks of the
    fingerprinted candidates; one claims them all. Further pages are read only when
    candidates were skipped as twins.

    A reach with limited projects takes their locks first (TAKE_LIMITS: an advisory lock
    per project, waited for in project order, before this claim locks any item), which
    serialises the claims of those projects alone. A project limited since this process
    last looked is found by the candidates statement; its limits are then taken without
    waiting (one another claimer holds is left to it this time, and it takes nothing of
    it), and the reach is remembered, so the next claim takes them first. A round that
    claims for several reaches took every reach's locks as its first claim began, all in
    one order (`_lock_claim_reaches`). (A round can still meet another in a deadlock: one that
    holds a row or content lock from an earlier request before its claim waits for a
    limit lock, or set_limits waiting for the claims in flight; PostgreSQL breaks it, and
    the writer runs the requests again, each on its own.)
    """
    first = ops[0]
    reach = (first.project_id, first.actor_id)
    total = sum(op.limit for op in ops)
    events: list[_rules.Event] = []
    limited = _rules.LimitedReach()
    if reach in limited_reaches:
        rows = await conn.fetch(sql.TAKE_LIMITS, *reach, None)
        if not rows:
            limited_reaches.discard(reach)
        limited.take(list(rows), now)
    exhausted_rows, pages, unlocked = await _candidates(conn, reach, total, now, limited)
    exhausted = [_rules.Candidate._make(row) for row in exhausted_rows]
    for candidate in exhausted:
        error, failed = _rules.exhausted_lease_events(candidate, first.actor_id, now)
        await conn.execute(sql.EXHAUST_ITEM, error, now, candidate.item_id, candidate.fence)
        events.extend(failed)
    # The limits were counted with those still running: count them as they stand now.
    limited.stopped(collections.Counter(c.project_id for c in exhausted), now)
    if any(c.fingerprint is not None or c.project_id in limited.limits for c in exhausted):
        # The candidates were read in the snapshot that still showed those claims running,
        # which held back their waiting twins (and filled their projects' slots); they
        # stopped running just now, so read again (SQLite fails them before it reads, to
        # the same effect).
        _, pages, _ = await _candidates(conn, reach, total, now, limited)
    if unlocked:
        limited_reaches.add(reach)
        page = _rules.first_page(total, len(pages) + len(unlocked))
        taken = list(await conn.fetch(sql.TAKE_LIMITS, *reach, unlocked))
        # A project whose limits another claimer holds now is left to it: this claim takes
        # nothing of it (not even a lapsed claim, which would draw from its bucket).
        limited.block(set(unlocked) - {row[0] for row in taken})
        for project in limited.take(taken, now):
            size = limited.room(project, page)
            for tag in ("r", "d"):
                rows = await _next_page(conn, (tag, project), reach, size, 0, now)
                pages[(tag, project)] = (size, [_rules.Candidate._make(row) for row in rows])
    # One arm per kind and project (ready and due, each project in reach), and the lapsed
    # claims of them all; an arm the first statement found nothing in has nothing more.
    keys = list(pages)
    merge = _rules.ClaimMerge(
        len(keys),
        total,
        quotas=limited.quotas,
        arm_projects=[key[1] for key in keys],
        blocked=limited.blocked,
    )
    for position, key in enumerate(keys):
        size, candidates = pages[key]
        merge.ask(position, size)
        merge.feed(position, candidates)
    while (arm := merge.hungry()) is not None:
        limit, offset = merge.next_page(arm)
        merge.feed(arm, await _next_page(conn, keys[arm], reach, limit, offset, now))
    dealt = _rules.deal(merge.chosen, ops)
    guarded = [c.fingerprint is not None and c.state != "claimed" for c, _ in dealt]
    if any(guarded):
        wanted = [(position, c) for position, ((c, _), g) in
                  enumerate(zip(dealt, guarded, strict=True)) if g]  # fmt: skip
        tried = await conn.fetch(
            sql.TRY_LOCK_CONTENTS, [c.project_id for _, c in wanted],
            [c.fingerprint for _, c in wanted],
        )  # fmt: skip
        # A twin being claimed by another transaction right now: this one waits.
        skip = {wanted[n - 1][0] for n, got in tried if not got}
        dealt = [d for position, d in enumerate(dealt) if position not in skip]
        guarded = [g for position, g in enumerate(guarded) if position not in skip]
    # A takeover's "lease_expired" comes before its new "claimed" in the history, both
    # written by the claim statement, and only for an item it claims (one of a project
    # limited meanwhile is not).
    await _insert_events(conn, events)
    before = [
        _rules.takeover_event(c, op, now) if c.state == "claimed" else None for c, op in dealt
    ]
    claimed_rows: dict[int, Any] = {}
    if dealt:
        # The claims, their "claimed" events and what they took of rate buckets, in one
        # statement.
        spent = limited.spent(collections.Counter(c.project_id for c, _ in dealt), now)
        for claimed_row in await conn.fetch(
            sql.CLAIM_ITEMS_SPENDING if spent else sql.CLAIM_ITEMS, now,
            [c.item_id for c, _ in dealt], [op.owner for _, op in dealt],
            [now + op.lease_seconds for _, op in dealt], guarded, first.actor_id,
            [c.project_id in limited.limits for c, _ in dealt],
            [None if e is None else e.event_type for e in before],
            [None if e is None else e.fence for e in before],
            [None if e is None else e.owner for e in before],
            [None if e is None else e.detail_json for e in before],
            *(list(column) for column in zip(*spent, strict=True)),
        ):  # fmt: skip
            claimed_rows[claimed_row[0]] = claimed_row
    if merge.others_to_tell(len(claimed_rows)):
        # Rows locked here and not taken were skipped by any claimer that came meanwhile;
        # their state does not change, so nothing else would tell a drainer that slept.
        await conn.execute(sql.NOTIFY)
    results: dict[int, list[_backend.ClaimRow]] = {id(op): [] for op in ops}
    for c, op in dealt:
        got = claimed_rows.get(c.item_id)
        if got is None:
            continue  # a twin started running meanwhile: this one waits (its token spent)
        results[id(op)].append(_rules.claim_row(c, op, now, got))
    return [results[id(op)] for op in ops]


#: After a claim found its reach not plain, how many claims of that reach skip the one
#: statement (a reach with limits, or with twins at the head of its line, would pay a
#: round trip for nothing).
_DETOUR = 64


def _claim_alone(
    limited: set[tuple[str | None, str | None]],
    detours: dict[tuple[str | None, str | None], int],
    ops: list[_backend.ClaimOp],
    now: float,
) -> tuple[str, tuple[Any, ...]] | None:
    """The common claim as one statement that commits by itself (CLAIM_ALONE): the same
    items, dealt the same way, as `_claim_many` would claim, when the reach is plain (one
    unlimited project, nothing lapsed or due, no two twins among the items taken). None
    for a reach known not to be (it goes to `_claim_many`), and for a while after the
    statement found one that was not (`_claimed_alone`)."""
    first = ops[0]
    reach = (first.project_id, first.actor_id)
    if reach in limited:
        return None
    if detours.get(reach, 0) > 0:
        detours[reach] -= 1
        return None
    total = sum(op.limit for op in ops)
    if total > _rules.MAX_PAGE:  # a batch that large goes the general way, page by page
        return None
    slots = _rules.slots(ops, total)
    owners = [op.owner for op in slots]
    return sql.CLAIM_ALONE, (*reach, now, total, owners, [now + op.lease_seconds for op in slots])


def _claimed_alone(
    detours: dict[tuple[str | None, str | None], int],
    ops: list[_backend.ClaimOp],
    now: float,
    rows: list[Any],
) -> list[Any]:
    """Each claim's items from CLAIM_ALONE's rows, or every claim `LEFT` if it bailed out."""
    first = ops[0]
    reach = (first.project_id, first.actor_id)
    if rows and rows[-1][0] is None:
        detours[reach] = _DETOUR
        return [_writer.LEFT] * len(ops)
    detours.pop(reach, None)
    slots = _rules.slots(ops, sum(op.limit for op in ops))
    results: dict[int, list[_backend.ClaimRow]] = {id(op): [] for op in ops}
    for row in sorted(rows, key=lambda row: int(row[0])):
        op = slots[row[0] - 1]
        candidate = _rules.Candidate._make(row[1:12])
        results[id(op)].append(_rules.claim_row(candidate, op, now, row[12:]))
    return [results[id(op)] for op in ops]


async def _candidates(
    conn: asyncpg.Connection,
    reach: tuple[Any, ...],
    total: int,
    now: float,
    limited: _rules.LimitedReach,
) -> tuple[list[Any], dict[tuple[str, str | None], tuple[int, list[_rules.Candidate]]], list[str]]:
    """Every arm's first page of candidates, in one statement: the lapsed claims with no
    attempt left, and per arm (ready "r" and fallen due "d" of each project, lapsed "l")
    the page's size and its rows, in claim order; and the limited projects in reach whose
    limits this claim has not taken."""
    exhausted: list[Any] = []
    tagged: list[Any] = []
    unlocked: list[str] = []
    sizes: dict[tuple[str, str | None], int] = {}
    roomy = [p for p, quota in limited.quotas.items() if quota.room != 0]
    rooms = [limited.quotas[p].room for p in roomy]
    for row in await conn.fetch(
        sql.CLAIM_CANDIDATES, *reach, total, now, _rules.exhausted_bound(total),
        roomy, rooms, list(limited.quotas),
    ):  # fmt: skip
        tag, size = row[0], row[1]
        if tag == "x":
            exhausted.append(row[2:])
            continue
        if tag == "q":
            unlocked.append(row[8])
            continue
        sizes[(tag, None if tag == "l" else row[8])] = size
        tagged.append((tag, *row[2:]))
    pages = _rules.first_pages(tagged)
    return exhausted, {key: (sizes[key], page) for key, page in pages.items()}, unlocked


async def _finish_many(
    ops: list[_backend.FinishOp], conn: asyncpg.Connection, now: float
) -> list[int | _errors.AsyncplaneError]:
    """Finishes that came together: each on its own, a refusal answered, not raised.

    Several finishes of distinct items settle in one statement (one round trip), twins
    and all; a finish it did not match wrote nothing, and is then explained
    (FenceRejected, ...).
    """
    results: list[int | _errors.AsyncplaneError] = []
    if _rules.settle_as_one(ops):
        rows = await conn.fetch(sql.FINISH_MANY, *_finishes(ops, now))
        settled = {row[0]: row[3] for row in rows}
        for op in ops:
            twins = settled.get(op.item_id)
            if twins is None:
                try:
                    await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
                except _errors.AsyncplaneError as exc:
                    results.append(exc)
                continue
            results.append(int(twins))
        return results
    for op in ops:
        try:
            results.append(await _settle_finish(op, conn, now))
        except _errors.AsyncplaneError as exc:
            results.append(exc)  # the guarded UPDATE matched nothing: nothing was written
    return results


def _finish_alone(ops: list[_backend.FinishOp], now: float) -> tuple[str, tuple[Any, ...]] | None:
    """A round of finishes of distinct items as the one statement that settles them, twins
    and all, with their events (FINISH_MANY), which commits by itself; any it did not
    match (refused) is left to a transaction (`_finish_many`), which says why."""
    if not _rules.distinct_items(ops):
        return None
    return sql.FINISH_MANY, _finishes(ops, now)


def _finished_alone(ops: list[_backend.FinishOp], now: float, rows: list[Any]) -> list[Any]:
    """FINISH_MANY's answers: how many twins each it matched settled, `LEFT` otherwise."""
    settled = {row[0]: int(row[3]) for row in rows}
    return [settled.get(op.item_id, _writer.LEFT) for op in ops]


def _finishes(ops: list[_backend.FinishOp], now: float) -> tuple[Any, ...]:
    """FINISH_MANY's parameters: now, then a column per field; then the twin events' type
    and owner (the same for every finish: `_rules.twin_event`) and each finish's twin
    event detail."""
    twins = [_rules.twin_event(op.item_id, op.actor_id, now) for op in ops]
    return (
        now, [op.item_id for op in ops], [op.fence for op in ops],
        [op.actor_id for op in ops], [op.status for op in ops],
        [op.result_json for op in ops], [op.error for op in ops],
        [_rules.finish_event(op, None, now).detail_json for op in ops],
        twins[0].event_type, twins[0].owner, [twin.detail_json for twin in twins],
    )  # fmt: skip


async def _settle_finish(op: _backend.FinishOp, conn: asyncpg.Connection, now: float) -> int:
    """One finish, as its own statements; settlement dedup: a done item's pending twins
    are done too, with its result, each with its event (SETTLE_TWINS)."""
    detail = _rules.finish_event(op, None, now).detail_json
    base = (op.item_id, op.fence, op.actor_id, now)
    if op.status == "done":
        row = await conn.fetchrow(sql.FINISH_DONE, *base, op.result_json, detail)
    else:
        row = await conn.fetchrow(sql.FINISH_FAILED, *base, op.error, detail)
    if row is None:
        await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
    project_id, fp = row[1], row[2]
    if op.status != "done" or fp is None:
        return 0
    twin = _rules.twin_event(op.item_id, op.actor_id, now)
    settled: int = await conn.fetchval(
        sql.SETTLE_TWINS, project_id, fp, op.item_id, op.result_json, now, op.actor_id,
        twin.event_type, twin.owner, twin.detail_json,
    )  # fmt: skip
    return settled


def _list_params(
    where: _backend.ItemFilter, states: tuple[str, ...], newest: bool, after: int | None,
    limit: int,
) -> tuple[Any, ...]:  # fmt: skip
    """The listing's parameters, $1 to $12 (see `_postgres_sql.list_items`)."""
    return (
        where.project_id, where.owner, where.fingerprint, where.created_after,
        where.created_before, where.updated_after, where.updated_before,
        where.error_contains, where.actor_id,
        _rules.keyset_start(newest, after), limit, list(states),
    )  # fmt: skip


async def _cancel_one(
    conn: asyncpg.Connection, item_id: int, state: str, fence: int, reason: str | None,
    actor_id: str | None, now: float, expected: tuple[str, ...] = (),
    expected_fence: int | None = None,
) -> str:  # fmt: skip
    plan = _rules.cancel_plan(
        item_id, state, fence, reason, actor_id, now, expected, expected_fence
    )
    if plan is None:
        return state
    await conn.execute(sql.CANCEL_ITEM, plan.fence, reason, now, item_id)
    await _insert_events(conn, [plan.event])
    return "cancelled"


async def _cancel(op: _backend.CancelOp, conn: asyncpg.Connection, now: float) -> tuple[str, bool]:
    found = await conn.fetchrow(sql.TARGET_ITEM, op.actor_id, op.item_id)
    state, fence = _rules.target(op.item_id, op.actor_id, found)
    after = await _cancel_one(
        conn, op.item_id, state, fence, op.reason, op.actor_id, now, op.expected,
        op.expected_fence,
    )  # fmt: skip
    return after, after != state


async def _requeue_one(
    conn: asyncpg.Connection, item_id: int, state: str, fence: int, actor_id: str | None,
    now: float, expected: tuple[str, ...] = (), expected_fence: int | None = None,
) -> None:  # fmt: skip
    requeued = _rules.requeue_event(item_id, state, fence, actor_id, now, expected, expected_fence)
    await _insert_events(conn, [requeued])
    await conn.execute(sql.REQUEUE_ITEM, now, item_id)


async def _requeue(op: _backend.RequeueOp, conn: asyncpg.Connection, now: float) -> None:
    found = await conn.fetchrow(sql.TARGET_ITEM, op.actor_id, op.item_id)
    state, fence = _rules.target(op.item_id, op.actor_id, found)
    await _requeue_one(
        conn, op.item_id, state, fence, op.actor_id, now, op.expected, op.expected_fence
    )


async def _chunk_of(
    conn: asyncpg.Connection, op: _backend.WhereOp, states: tuple[str, ...]
) -> tuple[list[Any], int | None]:
    """The chunk's rows, locked and still taken by the filter, and where the next chunk
    starts (None: this is the last)."""
    if not states:
        return [], None
    params = _list_params(op.where, states, False, op.after, op.chunk)
    statement = sql.list_items(states, op.where.project_id is not None, False, False)
    ids = [row[0] for row in await conn.fetch(statement, *params)]
    if not ids:
        return [], None
    rows = list(await conn.fetch(sql.LOCK_CHUNK, *params, ids))
    return rows, _rules.next_chunk(ids, op.chunk)


async def _cancel_where(
    op: _backend.WhereOp, conn: asyncpg.Connection, now: float
) -> tuple[int, int | None]:
    rows, last = await _chunk_of(conn, op, _rules.cancel_states(op.where.states))
    for item_id, state, fence in rows:
        await _cancel_one(conn, item_id, state, fence, op.reason, op.where.actor_id, now)
    return len(rows), last


async def _requeue_where(
    op: _backend.WhereOp, conn: asyncpg.Connection, now: float
) -> tuple[int, int | None]:
    rows, last = await _chunk_of(conn, op, _rules.requeue_states(op.where.states))
    for item_id, state, fence in rows:
        await _requeue_one(conn, item_id, state, fence, op.where.actor_id, now)
    return len(rows), last


async def _renew(op: _backend.RenewOp, conn: asyncpg.Connection, now: float) -> float:
    expires = now + op.lease_seconds
    row = await conn.fetchrow(sql.RENEW, expires, now, op.item_id, op.fence, op.actor_id)
    if row is None:
        await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
    return expires


async def _retry(op: _backend.RetryOp, conn: asyncpg.Connection, now: float) -> str:
    budget = await conn.fetchrow(sql.READ_BUDGET, op.item_id, op.fence, op.actor_id)
    if budget is None:
        await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
    attempts, max_attempts, owner = budget
    base = (op.item_id, op.fence, op.actor_id, now)
    plan = _rules.retry_plan(op, attempts, max_attempts, now)
    if plan.state == "failed":
        await conn.fetchrow(sql.SETTLE_FAILED, *base, plan.error)
    else:
        await conn.fetchrow(sql.SETTLE_DEFERRED, *base, plan.due_at, plan.error, 0, False)
    await _insert_events(conn, [_rules.retry_event(op, plan, owner, now)])
    return plan.state


async def _park(op: _backend.ParkOp, conn: asyncpg.Connection, now: float) -> None:
    due = _rules.park_due(now, op.delay)
    row = await conn.fetchrow(
        sql.SETTLE_DEFERRED, op.item_id, op.fence, op.actor_id, now, due, None, 1, True
    )
    if row is None:
        await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
    await _insert_events(conn, [_rules.park_event(op, row[0], due, now)])


async def _release(op: _backend.ReleaseOp, conn: asyncpg.Connection, now: float) -> None:
    row = await conn.fetchrow(sql.RELEASE, op.item_id, op.fence, op.actor_id, now)
    if row is None:
        await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
    await _insert_events(conn, [_rules.release_event(op, row[0], now)])


async def _offload(op: _backend.OffloadOp, conn: asyncpg.Connection, now: float) -> None:
    row = await conn.fetchrow(
        sql.SETTLE_OFFLOADED, op.item_id, op.fence, op.actor_id, now, op.handle
    )
    if row is None:
        await _refuse_fenced(conn, op.item_id, op.fence, op.actor_id)
    await _insert_events(conn, [_rules.offload_event(op, row[0], now)])


async def _set_fingerprints(
    writes: list[tuple[str, int]], conn: asyncpg.Connection, now: float
) -> None:
    locked = {row[0] for row in await conn.fetch(
        sql.LOCK_UNFINGERPRINTED, [item_id for _, item_id in writes])}  # fmt: skip
    await conn.executemany(sql.SET_FINGERPRINT, [w for w in writes if w[1] in locked])


async def _settle_pending_twins(
    op: _backend.PreflightOp, limit: int, after: int, conn: asyncpg.Connection, now: float
) -> tuple[int, bool, int]:
    """A page of ``op.chunk`` notes after note ``after``: up to ``limit`` pairs settled,
    the notes with no pair left forgotten. (Settled, whether the page was full, the last
    note read.)"""
    notes = await conn.fetch(sql.TWIN_NOTES, op.chunk, op.project_id, op.actor_id, after)
    if not notes:
        return 0, False, after
    contents = dict.fromkeys((note[1], note[2]) for note in notes)  # a content noted twice
    projects = [project_id for project_id, _ in contents]
    fingerprints = [fingerprint for _, fingerprint in contents]
    rows = await conn.fetch(sql.NOTED_TWIN_PAIRS, limit, projects, fingerprints)
    events: list[_rules.Event] = []
    for item_id, fence, done_id, result in rows:
        await conn.execute(sql.SETTLE_ONE_TWIN, result, now, item_id)
        events.extend(_rules.twin_events(done_id, [(item_id, fence)], op.actor_id, now))
    await _insert_events(conn, events)
    # Forgotten only under the content's lock: a note made because another transaction
    # held it (a finish, say) stays until that one has committed, and a look after the
    # lock sees what it wrote.
    had = await conn.fetch(
        sql.LOCK_NOTED_CONTENTS,
        [note[0] for note in notes],
        [note[1] for note in notes],
        [note[2] for note in notes],
    )
    await conn.execute(sql.FORGET_TWIN_NOTES, [row[0] for row in had])
    return len(rows), len(notes) == op.chunk, notes[-1][0]


async def _note_twin_pairs(
    contents: list[tuple[str, str]], conn: asyncpg.Connection, now: float
) -> None:
    await conn.executemany(sql.NOTE_TWIN_CHECK, contents)


def _archived_arrays(archived: tuple[_backend.Archived, ...]) -> tuple[list[Any], ...]:
    """The ids, fences and last changes of ``archived``, as the statements' arrays."""
    ids, fences, changes = zip(*archived, strict=True) if archived else ((), (), ())
    return list(ids), list(fences), list(changes)


async def _standing_as_archived(
    conn: asyncpg.Connection, archived: tuple[_backend.Archived, ...]
) -> set[int]:
    return {
        row[0] for row in await conn.fetch(sql.STANDING_AS_ARCHIVED, *_archived_arrays(archived))
    }


async def _purge_items(
    archived: tuple[_backend.Archived, ...], conn: asyncpg.Connection, now: float
) -> int:
    gone = [row[0] for row in await conn.fetch(sql.PURGE_ITEMS, *_archived_arrays(archived))]
    if gone:
        await conn.execute(sql.PURGE_EVENTS, gone)  # its history goes with it, never before
        await conn.execute(sql.PURGE_AWAITED, gone)
    return len(gone)


async def _mark_awaited(item_id: int, conn: asyncpg.Connection, now: float) -> None:
    await conn.execute(sql.MARK_AWAITED, item_id)


async def _import_rows(
    op: _backend.ImportOp, conn: asyncpg.Connection, now: float
) -> tuple[_backend.ImportOutcome, ...]:
    if await conn.fetchval(sql.PROJECT_EXISTS, op.project_id) is None:
        raise _rules.unknown_project(op.project_id)
    await conn.execute(sql.LOCK_SOURCE, op.source)
    outcomes: list[_backend.ImportOutcome] = []
    dropped_up_to = await conn.fetchval(
        sql.DROPPED_UP_TO, _rules.dropped_source(op.source), _rules.SOURCE_DROPPED
    )
    meanwhile = _rules.dropped_meanwhile(op.source, op.dropped_up_to, dropped_up_to)
    if meanwhile is not None:
        raise meanwhile
    for key, digest, item in op.rows:
        found = await conn.fetchrow(sql.IMPORTED_AS, op.source, key)
        recorded = None if found is None else (found[0], found[1])
        outcome = _rules.imported_before(recorded, digest, op.dropped_up_to)
        outcomes.append(outcome)
        if outcome not in _rules.IMPORT_COPIES:
            continue
        if (refused := _rules.unrecordable_import(op.source, key, recorded)) is not None:
            raise refused
        row = _rules.new_row(op.project_id, item, now)
        (item_id,) = await _insert_items(
            conn, [row], None, now, _rules.imported_detail(op.source, key, recorded)
        )
        await conn.execute(sql.RECORD_IMPORTED_ROW, op.source, key, item_id, now, digest)
    return tuple(outcomes)


async def _copy_projects(op: _backend.CopyProjectsOp, conn: asyncpg.Connection, now: float) -> int:
    source = op.source + _rules.COPIED_SETTINGS
    await conn.execute(sql.LOCK_SOURCE, source)  # two copies from one source: one at a time
    recorded = {row[0] for row in await conn.fetch(sql.RECORDED_SETTINGS, source)}
    here = [_backend.ScheduleRow(*row) for row in await conn.fetch(sql.LIST_SCHEDULES)]
    unrecorded = not recorded and await conn.fetchval(sql.ANY_RECORD, op.source) is not None
    projects_here = {row[0] for row in await conn.fetch(sql.LIST_PROJECTS)}
    plan = _rules.copy_settings_plan(
        op, recorded, here, projects_here, unrecorded_before=unrecorded
    )
    added = 0
    for project in plan.add.projects:
        if await conn.fetchval(sql.COPY_PROJECT, *project) is not None:
            added += 1
    if plan.add.assignments:
        await conn.executemany(sql.COPY_ASSIGNMENT, [tuple(a) for a in plan.add.assignments])
    if plan.add.limits:
        await conn.executemany(sql.COPY_LIMITS, [row[:6] for row in plan.add.limits])
    if plan.add.schedules:
        rows = [
            row._replace(dedup=bool(row.dedup), paused=bool(row.paused))
            for row in plan.add.schedules
        ]
        await conn.executemany(sql.COPY_SCHEDULE, [tuple(row) for row in rows])
    if plan.records:
        await conn.executemany(sql.RECORD_SETTING, [(source, key, now) for key in plan.records])
    if plan.moved:
        await conn.executemany(sql.MOVE_COPIED_SCHEDULE, [(*m, now) for m in plan.moved])
    return added


async def _copy_items(op: _backend.CopyOp, conn: asyncpg.Connection, now: float) -> tuple[int, int]:
    await conn.execute(sql.LOCK_SOURCE, op.source)
    copied = skipped = 0
    for item, events in op.items:
        key = str(item.item_id)
        if await conn.fetchval(sql.ALREADY_IMPORTED, op.source, key) is not None:
            stored = await conn.fetchrow(sql.COPIED_ITEM, item.item_id)
            _rules.copied_here(item, None if stored is None else tuple(stored))
            skipped += 1
            continue
        if await conn.fetchval(sql.ITEM_EXISTS, item.item_id) is not None:
            raise _rules.copy_id_taken(item.item_id)
        if item.state in _models.RUNNING_STATES and item.fingerprint is not None:
            twin = await conn.fetchval(sql.RUNNING_TWIN, item.project_id, item.fingerprint)
            if twin is not None:  # the unique index would refuse it, untold
                raise _rules.copy_running_twin(item.item_id, twin)
        await conn.execute(sql.COPY_ITEM, *item._replace(dedup=bool(item.dedup)))
        await _insert_events(
            conn,
            [_rules.Event(item.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at,
                          e.detail_json) for e in events],
        )  # fmt: skip
        await conn.execute(sql.RECORD_IMPORT, op.source, key, item.item_id, now)
        copied += 1
    if op.items:
        await conn.execute(sql.ADVANCE_ITEM_IDS, max(item.item_id for item, _ in op.items))
    return copied, skipped


async def _copy_imports(
    records: tuple[_backend.ImportRecord, ...], conn: asyncpg.Connection, now: float
) -> None:
    columns = list(zip(*records, strict=True)) if records else [(), (), (), (), ()]
    await conn.execute(sql.COPY_IMPORTS, *(list(column) for column in columns))


async def _record_dropped(source: str, conn: asyncpg.Connection, now: float) -> None:
    await conn.execute(sql.LOCK_SOURCE, source)  # after a chunk of the source in flight
    await conn.execute(
        sql.RECORD_DROPPED, _rules.dropped_source(source), _rules.SOURCE_DROPPED, source, now
    )


async def _advance_item_ids(last: int, source: str, conn: asyncpg.Connection, now: float) -> None:
    await conn.execute(sql.ADVANCE_ITEM_IDS, last)
    await conn.execute(sql.RECORD_ITEM_IDS, source, last, now)


# --- schema --------------------------------------------------------------------------------


async def read_version(conn: asyncpg.Connection) -> int:
    """The schema version found, refusing a schema of another application or a newer one."""
    if await conn.fetchval(sql.CURRENT_SCHEMA) is None:
        raise _errors.NotAnAsyncplaneDatabase(
            "no schema to create the store in: the search_path names none that exists "
            "(create it first: CREATE SCHEMA <name>)"
        )
    if not await conn.fetchval(sql.META_EXISTS):
        if await conn.fetchval(sql.COUNT_TABLES):
            raise _errors.NotAnAsyncplaneDatabase(
                "the schema holds tables of another application, not an asyncplane store"
            )
        return 0
    meta = {row[0]: row[1] for row in await conn.fetch(sql.READ_META)}
    if meta.get("application") != sql.APPLICATION:
        raise _errors.NotAnAsyncplaneDatabase(
            "the schema holds another application's tables, not an asyncplane store"
        )
    version = int(meta.get("schema_version", "0"))
    _rules.refuse_newer_schema(version, sql.SCHEMA_VERSION)
    return version


async def _migrate(conn: asyncpg.Connection) -> None:
    """Create or upgrade the schema, in one transaction, one process at a time."""
    async with conn.transaction():
        await conn.execute(sql.MIGRATION_LOCK)
        version = await read_version(conn)
        for script in sql.MIGRATIONS[version:]:
            await conn.execute(script)
        if version != sql.SCHEMA_VERSION:
            await conn.execute(sql.WRITE_META, "application", sql.APPLICATION)
            await conn.execute(sql.WRITE_META, "schema_version", str(sql.SCHEMA_VERSION))


#: The databases' encodings a store can live in: every text the store keeps (a project's
#: name, an error, a payload's JSON) is any Unicode, which UTF8 holds whole and SQL_ASCII
#: takes as the client's bytes (the driver's UTF-8). In any other, a text the encoding
#: cannot hold would be refused only when written, an item's settle failing on every retry.
_ENCODINGS = ("UTF8", "SQL_ASCII")


async def _refuse_encoding(conn: asyncpg.Connection) -> None:
    """Refuse a database whose encoding cannot hold every text, before anything is written."""
    encoding = await conn.fetchval(sql.SERVER_ENCODING)
    if encoding not in _ENCODINGS:
        raise _errors.NotAnAsyncplaneDatabase(
            f"the database's encoding is {encoding}: an asyncplane store needs a UTF8 "
            "database (CREATE DATABASE ... ENCODING 'UTF8')"
        )


async def _check_current_schema(conn: asyncpg.Connection) -> None:
    """For a read-only opening: the schema must be a store of exactly this version."""
    _rules.refuse_unreadable_schema(await read_version(conn), sql.SCHEMA_VERSION, "schema")


# --- reads ---------------------------------------------------------------------------------


def _snapshot(conn: asyncpg.Connection) -> Any:
    return conn.transaction(isolation="repeatable_read", readonly=True)


async def _store_identity(conn: asyncpg.Connection) -> str | None:
    """The cluster's system identifier (made by initdb, the same however it is reached:
    through a socket, an address, a tunnel, a pooler), the database and the schema its
    search_path resolved to ("$user" included); None where the role may not read the
    identifier (then a copy keys its source by its location as written)."""
    try:
        ((cluster, database, schema),) = await conn.fetch(sql.STORE_IDENTITY)
    except (
        asyncpg.InsufficientPrivilegeError,  # EXECUTE revoked from the role
        asyncpg.UndefinedFunctionError,  # a server of PostgreSQL's kind without it
        asyncpg.FeatureNotSupportedError,
    ):
        return None
    return f"postgresql://{cluster}/{database}/{schema}"


async def _fetch(conn: asyncpg.Connection, statement: str, *args: Any) -> list[Any]:
    return list(await conn.fetch(statement, *args))


async def _tally(conn: asyncpg.Connection) -> _backend.LedgerTally:
    async with _snapshot(conn):
        totals = await conn.fetchrow(sql.LEDGER_TALLY)
        assert totals is not None  # an aggregate always returns its row
        items, claims, takeovers, terminal = totals
        settled_twice = [row[0] for row in await conn.fetch(sql.SETTLED_TWICE)]
        unexplained = [row[0] for row in await conn.fetch(sql.UNEXPLAINED_CLAIMS)]
        taken_from = {row[0]: row[1] for row in await conn.fetch(sql.TAKEN_FROM)}
        at_the_end = {row[0]: row[1] for row in await conn.fetch(sql.TAKEN_AFTER_LAST_CLAIM)}
    return _backend.LedgerTally(
        items, claims, takeovers, terminal, settled_twice, unexplained, taken_from, at_the_end
    )


async def _purge_candidates(
    conn: asyncpg.Connection, cutoff: float, chunk: int, after: tuple[float, int]
) -> _backend.Histories:
    async with _snapshot(conn):
        rows = await conn.fetch(sql.PURGE_CANDIDATES, cutoff, chunk, *after)
        events = await conn.fetch(sql.EVENTS_OF_ITEMS, [row[0] for row in rows])
    history: dict[int, list[_backend.EventRow]] = {}
    for event in events:
        history.setdefault(event[1], []).append(_backend.EventRow(*event))
    return [(_backend.ItemRow(*row), history.get(row[0], [])) for row in rows]


async def _export_items(conn: asyncpg.Connection, op: _backend.ExportOp) -> _backend.Histories:
    async with _snapshot(conn):
        rows = await conn.fetch(sql.EXPORT_ITEMS, *op)
        events = await conn.fetch(sql.EVENTS_OF_ITEMS, [row[0] for row in rows])
    history: dict[int, list[_backend.EventRow]] = {}
    for event in events:
        history.setdefault(event[1], []).append(_backend.EventRow(*event))
    return [(_backend.ItemRow(*row), history.get(row[0], [])) for row in rows]


async def _stats(conn: asyncpg.Connection, now: float | None) -> _backend.StoreStats:
    async with _snapshot(conn):
        by_project = tuple(tuple(row) for row in await conn.fetch(sql.STATES_BY_PROJECT))
        oldest = await conn.fetchval(sql.OLDEST_READY)
        expired = await conn.fetchval(sql.EXPIRED_LEASES, now)
        # The version as it stands, not read_version's refusals (those are the opening's):
        # a process of the release before goes on during a rolling upgrade, and its
        # stats() says the newer version, as SQLite's user_version does.
        meta = {row[0]: row[1] for row in await conn.fetch(sql.READ_META)}
    version = int(meta.get("schema_version", "0"))
    return _backend.StoreStats(by_project, oldest, expired, version)


async def _verify_ledger(
    conn: asyncpg.Connection, limit: int | None, item_id: int | None
) -> list[_models.LedgerProblem]:
    problems: list[_models.LedgerProblem] = []
    async with _snapshot(conn):
        checks = sql.LEDGER_CHECKS if item_id is None else sql.ONE_ITEM_CHECKS
        params = () if item_id is None else (item_id,)
        for kind, statement in checks:
            if limit is not None and len(problems) >= limit:
                break
            async for found, detail in conn.cursor(statement, *params, prefetch=500):
                problems.append(_models.LedgerProblem(kind, found, detail))
                if limit is not None and len(problems) >= limit:
                    break
    return problems  # verify_ledger puts them in order


#: The writes sent named by their op (each settle other than a finish, and each write of
#: `asyncplane._backend.FREEING`), by its op's type (`asyncplane._backend.Writes._send_named`).
_NAMED_WRITES: dict[type, Callable[..., Any]] = {
    _backend.RetryOp: _retry,
    _backend.ParkOp: _park,
    _backend.ReleaseOp: _release,
    _backend.OffloadOp: _offload,
    _backend.CancelOp: _cancel,
    _backend.CancelWhereOp: _cancel_where,
    _backend.RequeueOp: _requeue,
    _backend.ProjectStatusOp: _set_project_status,
    _backend.AssignOp: _assign,
    _backend.LimitsOp: _set_limits,
    _backend.PauseScheduleOp: _pause_schedule,
    _backend.WhereOp: _requeue_where,
    _backend.ImportOp: _import_rows,
    _backend.ScheduleOp: _set_schedule,
    _backend.RunSchedulesOp: _run_schedules,
}
