"""The SQLite backend: where a claim is decided, a fence rises, and an event is recorded.

Writes are operations run by the store's writer (`asyncplane._writer`) inside its
``BEGIN IMMEDIATE`` transaction; each one does its checks before its first write, so a
refusal writes nothing, and writes its state change and its ledger event together.
Reads run on a small pool of read-only connections, so they never queue behind writes;
a read that needs several statements runs them in one read transaction (one snapshot).

Who is authoritative for a lease: the row. ``fence`` on the item row is the only current
claim; ``lease_expires_at`` is advisory until someone else claims the item. A holder whose
lease has lapsed may still renew or finish as long as nobody has taken the item over,
because its fence is still the current one; after a takeover its fence is refused.
A fence only rises: the claim statement is the only writer of ``fence`` and it adds one,
so every claim of an item carries a fence above every earlier claim of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import pathlib
import re
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar, cast

import anyio.to_thread

from asyncplane import (
    _backend,
    _clock,
    _combine,
    _connection,
    _errors,
    _fingerprint,
    _lock,
    _models,
    _rules,
    _schedule,
    _tasks,
    _write_lock,
    _writer,
)
from asyncplane import _sqlite_sql as sql

__all__ = ("SQLiteBackend", "vet_store_file")

T = TypeVar("T")

_log = logging.getLogger("asyncplane.store")


class SQLiteBackend(_backend.Writes):
    """Implements `asyncplane._backend.Backend` on one SQLite file in WAL mode."""

    #: A round costs a turn of the write lock, BEGIN, COMMIT and the WAL's frames (under
    #: FULL, an fsync): a settle and the next claim are cheaper in one (see
    #: docs/architecture.md, "A settle and the next claim in one round").
    settle_with_claim = True
    import_records_bounded = False
    versions_looked_within: float | None = None

    def __init__(
        self,
        path: pathlib.Path,
        sizing: _backend.Sizing,
        *,
        clock: _clock.Clock,
        synchronous: _connection.Synchronous,
        busy_timeout: float,
    ) -> None:
        super().__init__(sizing, claim_many=_claim_many, finish_many=_finish_many)
        self._path = path
        self._clock = clock
        self._synchronous: _connection.Synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._readers: _connection.ReaderPool | None = None
        self._keeper: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def clock(self) -> _clock.Clock:
        """The clock given (the wall clock, or a test's)."""
        return self._clock

    @property
    def location(self) -> str:
        """The database file's absolute path."""
        return str(self._path)

    @property
    def path(self) -> pathlib.Path:
        """The database file."""
        return self._path

    async def open(self) -> None:
        """Open the write connection, create or migrate the schema, start the writer.

        Read-only: open readers only, after checking the file is a store of this schema.
        """
        await _connection.check_path(self._path)
        if self._sizing.read_only:
            await self._open_read_only()
            return
        # Set when this opening is cancelled: the connection's thread then stops waiting
        # for a lock another connection holds (a stop asked while the store opens).
        given_up = threading.Event()
        conn = await _connection.open_writer(
            self._path,
            synchronous=self._synchronous,
            busy_timeout=self._busy_timeout,
            given_up=given_up,
            vet=_check_header,
        )
        locks: list[_write_lock.WriteLock | None] = []
        boards: list[_combine.Board | None] = []
        try:
            await _connection.run(conn, _migrate, self._busy_timeout, given_up)
            # Opened on the connection's thread, into lists of this frame's: if this call
            # is cancelled meanwhile, the close below runs after it there, and finds them.
            await _connection.run(conn, _open_write_lock, self._path, locks, boards)
        except BaseException:
            given_up.set()
            await conn.close()
            for lock in locks:
                if lock is not None:
                    lock.close()
            for board in boards:
                if board is not None:
                    board.close()
            raise
        readers = _connection.ReaderPool(
            self._path, size=self._sizing.read_connections, busy_timeout=self._busy_timeout
        )

        async def close_readers(graceful: bool) -> None:
            # Runs when the writer stops: by close() (graceful: reads in flight finish
            # first), or by the event loop shutting down (no waiting).
            await readers.close(wait=graceful)

        self._readers = readers
        self._writer = _writer.Writer(
            conn, self._clock, name=self._path.name, max_batch=self._sizing.max_batch,
            on_exit=close_readers, lock_timeout=self._busy_timeout, write_lock=locks[0],
            board=boards[0], orphaned=self.orphaned,
        )  # fmt: skip
        self._writer.start()

    async def _open_read_only(self) -> None:
        readers = _connection.ReaderPool(
            self._path, size=self._sizing.read_connections, busy_timeout=self._busy_timeout
        )
        try:
            await readers.run(_guarded_read, _check_current_schema)
        except BaseException:
            await readers.close(wait=True)
            raise

        async def keep() -> None:
            # No writer task to close the readers when the loop shuts down: this one does.
            try:
                await asyncio.Event().wait()
            finally:
                await asyncio.shield(readers.close(wait=False))

        self._readers = readers
        self._keeper = _tasks.detached(keep(), f"asyncplane-readers[{self._path.name}]")

    async def close(self, *, lost: bool = False) -> None:
        """Serve queued writes, then close the writer and every reader (SQLite's
        backend never breaks: ``lost`` changes nothing)."""
        writer, readers, keeper = self._writer, self._readers, self._keeper
        if writer is not None:
            await writer.stop()  # its on_exit closes the readers before its connection
        if readers is not None:
            await readers.close(wait=True)  # and the busy ones close as they finish
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            self._keeper = None

    @property
    def broken(self) -> bool:
        """Never: a failed writer stays failed (StoreClosed says why) until close()."""
        return False

    def forget(self) -> None:
        """Stop every connection thread left behind by an event loop that has ended."""
        if self._writer is not None:
            self._writer.abandon()
        if self._readers is not None:
            self._readers.abandon()
        self._writer = self._readers = None
        self._keeper = None

    async def _write(self, op: _writer.Write[T]) -> T:
        return cast(T, await self._submit(op))

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(db, *args)`` on a read-only connection."""
        if self._readers is None:
            raise _errors.StoreClosed("the store is closed")
        return await self._readers.run(_guarded_read, fn, *args)

    # --- projects and scope --------------------------------------------------------------

    async def create_project(self, op: _backend.NewProject) -> None:
        await self._write(functools.partial(_create_project, op))

    async def get_project(self, project_id: str) -> _backend.ProjectRow:
        rows = await self._read(_fetch, sql.GET_PROJECT, (project_id,))
        return _rules.one_project(rows, project_id)

    async def list_projects(self) -> list[_backend.ProjectRow]:
        rows = await self._read(_fetch, sql.LIST_PROJECTS, ())
        return [_backend.ProjectRow(*row) for row in rows]

    async def unassign(self, project_id: str, actor_id: str) -> None:
        await self._write(functools.partial(_unassign, project_id, actor_id))

    async def visible_projects(self, actor_id: str) -> list[str]:
        rows = await self._read(_fetch, sql.VISIBLE_PROJECTS, (actor_id,))
        return [row[0] for row in rows]

    # --- items ---------------------------------------------------------------------------

    def _enqueue_write(self, op: _backend.EnqueueOp) -> _writer.Operation[list[int]]:
        return functools.partial(_enqueue, op)

    async def renew(self, op: _backend.RenewOp) -> float:
        return await self._write(functools.partial(_renew, op))

    def _named_write(self, op: Any) -> _writer.Operation[Any]:
        return functools.partial(_NAMED_WRITES[type(op)], op)

    async def offloaded(self, handle: str, actor_id: str | None) -> list[_backend.ItemRow]:
        rows = await self._read(
            _fetch_named, sql.OFFLOADED, {"handle": handle, "actor_id": actor_id}
        )
        return [_item(row) for row in rows]

    async def list_items(self, op: _backend.ListOp) -> list[_backend.ItemRow]:
        return await self._read(_list_items, op)

    async def settled_version(self) -> int:
        # Any commit of another connection may have settled an item (a cheap look).
        return await self.data_version()

    async def mark_awaited(self, item_id: int) -> None:
        return None  # data_version moves on every commit: every settle is seen

    async def missing_fingerprints(
        self, op: _backend.PreflightOp, after_item_id: int, identity: tuple[str, ...]
    ) -> _backend.Backfill:
        params = {"after": after_item_id, "chunk": op.chunk, "project_id": op.project_id,
                  "actor_id": op.actor_id}  # fmt: skip
        return await self._read(_missing_fingerprints, params, identity)

    async def set_fingerprints(self, writes: list[tuple[str, int]]) -> None:
        await self._write(functools.partial(_set_fingerprints, writes))

    async def any_twin_noted(self, op: _backend.PreflightOp) -> bool:
        params = {"project_id": op.project_id, "actor_id": op.actor_id}
        return bool((await self._read(_fetch_named, sql.ANY_TWIN_NOTED, params))[0][0])

    async def settle_pending_twins(self, op: _backend.PreflightOp) -> tuple[int, bool]:
        return await self._write(functools.partial(_settle_pending_twins, op))

    async def twin_pairs(self, op: _backend.PreflightOp) -> list[tuple[str, str]]:
        params = {"project_id": op.project_id, "actor_id": op.actor_id}
        return await self._read(_fetch_named, sql.ALL_TWIN_PAIRS, params)

    async def note_twin_pairs(self, contents: list[tuple[str, str]]) -> None:
        await self._write(functools.partial(_note_twin_pairs, contents))

    async def purge_candidates(
        self, cutoff: float, chunk: int, after: tuple[float, int] = _backend.PURGE_START
    ) -> _backend.Histories:
        return await self._read(_purge_candidates, cutoff, chunk, after)

    async def standing_as_archived(self, archived: tuple[_backend.Archived, ...]) -> set[int]:
        return await self._read(_standing_as_archived, archived)

    async def purge_items(self, archived: tuple[_backend.Archived, ...]) -> int:
        return await self._write(functools.partial(_purge_items, archived))

    async def stats(self) -> _backend.StoreStats:
        return await self._read(_stats, self._clock.now())

    async def sizes(self) -> tuple[int, int]:
        return await anyio.to_thread.run_sync(_file_sizes, self._path)

    async def get_limits(self, project_id: str | None) -> list[_backend.LimitsRow]:
        if project_id is None:
            rows = await self._read(_fetch, sql.ALL_LIMITS, ())
        else:
            rows = await self._read(_fetch, sql.GET_LIMITS, (project_id,))
            if not rows:
                raise _rules.unknown_project(project_id)
        return [_rules.limits_row(row) for row in rows]

    async def list_schedules(self, name: str | None) -> list[_backend.ScheduleRow]:
        if name is None:
            rows = await self._read(_fetch, sql.LIST_SCHEDULES, ())
        else:
            rows = await self._read(_fetch, sql.GET_SCHEDULE, (name,))
            if not rows:
                raise _rules.unknown_schedule(name)
        return [_backend.ScheduleRow._make(row) for row in rows]

    async def delete_schedule(self, name: str) -> None:
        await self._write(functools.partial(_delete_schedule, name))

    async def next_tick(self, crons: bool) -> float | None:
        rows = await self._read(_fetch, sql.NEXT_TICK, (crons,))
        value: float | None = rows[0][0]
        return value

    async def next_cron_tick(self) -> float | None:
        rows = await self._read(_fetch, sql.NEXT_CRON_TICK, ())
        value: float | None = rows[0][0]
        return value

    async def schedule_ticks(self, name: str, limit: int) -> list[_backend.TickRow]:
        rows = await self._read(_fetch, sql.SCHEDULE_TICKS, (name, limit))
        return [_backend.TickRow._make(row) for row in rows]

    async def list_assignments(self) -> list[_backend.AssignmentRow]:
        rows = await self._read(_fetch, sql.LIST_ASSIGNMENTS, ())
        return [_backend.AssignmentRow(*row) for row in rows]

    async def export_items(self, op: _backend.ExportOp) -> _backend.Histories:
        return await self._read(_export_items, op)

    async def copy_projects(self, op: _backend.CopyProjectsOp) -> int:
        return await self._write(functools.partial(_copy_projects, op))

    async def copy_items(self, op: _backend.CopyOp) -> tuple[int, int]:
        return await self._write(functools.partial(_copy_items, op))

    async def first_foreign_item(self, source: str) -> int | None:
        rows = await self._read(_fetch, sql.FIRST_FOREIGN_ITEM, (source,))
        return None if not rows else int(rows[0][0])

    async def export_imports(
        self, after: tuple[str, str] | None, limit: int
    ) -> list[_backend.ImportRecord]:
        rows = await self._read(_fetch, sql.EXPORT_IMPORTS, (*(after or ("", "")), limit))
        return [_backend.ImportRecord._make(row) for row in rows]

    async def copy_imports(self, records: tuple[_backend.ImportRecord, ...]) -> None:
        await self._write(functools.partial(_copy_imports, records))

    async def store_identity(self) -> str | None:
        return f"sqlite:{self._path}"  # resolved as the kernel resolves it, when given

    async def last_item_id(self) -> int:
        rows = await self._read(_fetch, sql.LAST_ITEM_ID, ())
        return int(rows[0][0])

    async def advance_item_ids(self, last: int, source: str) -> None:
        await self._write(functools.partial(_advance_item_ids, last, source))

    async def source_dropped_up_to(self, source: str) -> int | None:
        key = (_rules.dropped_source(source), _rules.SOURCE_DROPPED)
        rows = await self._read(_fetch, sql.DROPPED_UP_TO, key)
        return None if not rows else int(rows[0][0])

    async def record_source_dropped(self, source: str) -> None:
        await self._write(functools.partial(_record_dropped, source))

    async def copied_up_to(self, source: str) -> tuple[int, int | None]:
        rows = await self._read(_fetch, sql.COPIED_UP_TO, (source, source))
        return int(rows[0][0]), rows[0][1]

    @contextlib.asynccontextmanager
    async def drain_guard(self) -> AsyncIterator[_lock.Guard]:
        """A `DrainLock` on ``<database>.drain.lock``, beside the database."""
        async with _lock.DrainLock(self._path.with_name(self._path.name + ".drain.lock")) as lock:
            yield _lock.Guard(lock.acquired)  # a lock on an open descriptor holds

    async def next_due(self, project_id: str | None, actor_id: str | None) -> float | None:
        params = {"project_id": project_id, "actor_id": actor_id, "now": self._clock.now()}
        return await self._read(_next_due, params)

    async def get_item(self, item_id: int, actor_id: str | None) -> _backend.ItemRow:
        if actor_id is None:
            rows = await self._read(_fetch, sql.GET_ITEM, (item_id,))
        else:
            rows = await self._read(_fetch, sql.GET_ITEM_SCOPED, (item_id, actor_id))
        if not rows:
            raise _rules.invisible_item(item_id, actor_id)
        return _item(rows[0])

    async def ended_among(self, item_ids: list[int], states: tuple[str, ...]) -> list[int]:
        params = (json.dumps(item_ids), json.dumps(states))
        return [row[0] for row in await self._read(_fetch, sql.ENDED_AMONG, params)]

    async def get_events(
        self, item_id: int, actor_id: str | None, last: int | None = None
    ) -> list[_backend.EventRow]:
        if last is not None:
            params = {"item_id": item_id, "actor_id": actor_id, "last": last}
            rows = await self._read(_fetch_named, sql.GET_LAST_EVENTS, params)
        elif actor_id is None:
            rows = await self._read(_fetch, sql.GET_EVENTS, (item_id,))
        else:
            rows = await self._read(_fetch, sql.GET_EVENTS_SCOPED, (item_id, actor_id))
        return _rules.history(rows, item_id, actor_id)

    async def count_states(self, project_id: str | None, actor_id: str | None) -> dict[str, int]:
        params = {"project_id": project_id, "actor_id": actor_id}
        return dict(await self._read(_fetch_named, sql.COUNT_STATES, params))

    async def data_version(self) -> int:
        if self._readers is None:
            raise _errors.StoreClosed("the store is closed")
        return await self._readers.data_version()

    async def tally(self) -> _backend.LedgerTally:
        return await self._read(_tally)

    async def item_ids(self, state: str) -> list[int]:
        return [row[0] for row in await self._read(_fetch, sql.ITEM_IDS_IN_STATE, (state,))]

    async def verify_ledger(
        self, limit: int | None, item_id: int | None = None
    ) -> list[_models.LedgerProblem]:
        return await self._read(_verify_ledger, limit, item_id)

    async def settled_per_minute(
        self, since: float, actor_id: str | None
    ) -> list[tuple[float, str, str, int]]:
        params = {"since": since, "actor_id": actor_id}
        return [tuple(row) for row in await self._read(_fetch, sql.SETTLED_PER_MINUTE, params)]


def _file_sizes(path: pathlib.Path) -> tuple[int, int]:
    def size(file: pathlib.Path) -> int:
        try:
            return file.stat().st_size
        except FileNotFoundError:
            return 0

    return size(path), size(path.with_name(path.name + "-wal"))


# --- refusals ------------------------------------------------------------------------------


def _refuse_fenced(
    db: sqlite3.Connection, item_id: int, fence: int, actor_id: str | None
) -> NoReturn:
    """Explain why a fenced update matched no row, by raising the right error."""
    found = db.execute(sql.DIAGNOSE_ITEM, (actor_id, item_id)).fetchone()
    raise _rules.fence_refusal(item_id, fence, actor_id, found)


# --- write operations (run on the writer's thread, inside its transaction) ---------------


def _create_project(op: _backend.NewProject, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is not None:
        raise _rules.project_exists(op.project_id)
    db.execute(sql.INSERT_PROJECT, (op.project_id, op.name, op.status, now))


def _set_project_status(op: _backend.ProjectStatusOp, db: sqlite3.Connection, now: float) -> str:
    found = db.execute(sql.PROJECT_STATUS, (op.project_id,)).fetchone()
    if found is None:
        raise _rules.unknown_project(op.project_id)
    status: str = _rules.project_status_after(found[0], op.status, op.expected)
    if status != found[0]:
        db.execute(sql.SET_PROJECT_STATUS, (status, op.project_id))
    return status


def _assign(op: _backend.AssignOp, db: sqlite3.Connection, now: float) -> None:
    project_id, actor_id = op
    if db.execute(sql.PROJECT_EXISTS, (project_id,)).fetchone() is None:
        raise _rules.unknown_project(project_id)
    db.execute(sql.ASSIGN, (actor_id, project_id, now))


def _unassign(project_id: str, actor_id: str, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.PROJECT_EXISTS, (project_id,)).fetchone() is None:
        raise _rules.unknown_project(project_id)
    db.execute(sql.UNASSIGN, (actor_id, project_id))


def _set_limits(
    op: _backend.LimitsOp, db: sqlite3.Connection, now: float
) -> _backend.LimitsRow | None:
    found = db.execute(sql.GET_LIMITS, (op.project_id,)).fetchone()
    if found is None:
        raise _rules.unknown_project(op.project_id)
    new = _rules.merged_limits(_rules.limits_row(found), op.project_id, dict(op.changes), now)
    if new is None:
        db.execute(sql.DELETE_LIMITS, (op.project_id,))
        return None
    db.execute(sql.PUT_LIMITS, new[:6])
    return new._replace(running=found[6])


def _set_schedule(
    op: _backend.ScheduleOp, db: sqlite3.Connection, now: float
) -> _backend.ScheduleRow:
    if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is None:
        raise _rules.unknown_project(op.project_id)
    found = db.execute(sql.GET_SCHEDULE, (op.name,)).fetchone()
    old = None if found is None else _backend.ScheduleRow._make(found)
    row = _rules.declared_schedule(op, old, now)
    db.execute(sql.PUT_SCHEDULE, row)
    return row


def _pause_schedule(op: _backend.PauseScheduleOp, db: sqlite3.Connection, now: float) -> None:
    name, paused = op
    found = db.execute(sql.GET_SCHEDULE, (name,)).fetchone()
    if found is None:
        raise _rules.unknown_schedule(name)
    row = _backend.ScheduleRow._make(found)
    next_at = _schedule.paused_next_at(row.timetable(), bool(row.paused), paused, row.next_at, now)
    db.execute(sql.PAUSE_SCHEDULE, (paused, next_at, now, name))


def _delete_schedule(name: str, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.DELETE_SCHEDULE, (name,)).rowcount == 0:
        raise _rules.unknown_schedule(name)
    db.execute(sql.DELETE_TICKS, (name,))


def _run_schedules(
    op: _backend.RunSchedulesOp, db: sqlite3.Connection, now: float
) -> _backend.SchedulesRun:
    due = db.execute(sql.DUE_SCHEDULES, (now, op.crons, json.dumps(op.passed), op.limit))
    rows = [_backend.ScheduleRow._make(r) for r in due]
    enqueued = 0
    passed: list[tuple[str, str]] = []
    for row in rows:
        item, fingerprint = _rules.tick_item(row)
        table = row.timetable()
        reason = _schedule.unreadable(table)
        if reason is not None:  # left, untouched, to a host that can read it
            passed.append((row.name, reason))
            continue
        plan = _schedule.plan(table, row.catch_up, row.next_at, now)
        last = None
        for tick in plan.ticks:
            if db.execute(sql.RESERVE_TICK, (row.name, tick, now)).rowcount == 0:
                continue  # enqueued before: never again
            twin = None
            if fingerprint is not None:
                [twin] = db.execute(sql.PENDING_TWIN, (row.project_id, fingerprint)).fetchone()
            if twin is None:
                queued = _schedule.tick_detail(row.name, table, tick)
                adding = _backend.EnqueueOp(row.project_id, (item,), None)
                (twin,) = _enqueue(adding, db, now, queued)
                enqueued += 1
            db.execute(sql.FILL_TICK, (twin, row.name, tick))
            last = tick
        db.execute(sql.MOVE_SCHEDULE, (plan.next_at, last, now, row.name))
        db.execute(sql.FORGET_TICKS, (row.name, now - _schedule.TICKS_KEPT))
    return _backend.SchedulesRun(enqueued, len(rows) - len(passed), tuple(passed))


def _enqueue(
    op: _backend.EnqueueOp,
    db: sqlite3.Connection,
    now: float,
    queued: dict[str, Any] | None = None,
) -> list[int]:
    if op.actor_id is None:
        if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is None:
            raise _rules.unknown_project(op.project_id)
    elif db.execute(sql.IS_ASSIGNED, (op.actor_id, op.project_id)).fetchone() is None:
        raise _rules.project_denied(op.project_id, op.actor_id)
    # First resolve dedup: an item whose fingerprint matches an earlier one (in the store,
    # or earlier in this same call) takes that one's id and adds no row.
    found: dict[str, int] = {}
    for fp in _rules.dedup_fingerprints(op.items):
        [twin] = db.execute(
            sql.FIND_TWIN, {"project_id": op.project_id, "fingerprint": fp}
        ).fetchone()
        if twin is not None:
            found[fp] = twin
    plan = _rules.EnqueuePlan(op.items, found)
    rows = [_rules.new_row(op.project_id, op.items[p], now) for p in plan.new]
    inserted: list[int] = []
    if len(rows) == 1:
        inserted = [db.execute(sql.INSERT_ITEM_RETURNING, rows[0]).fetchall()[0][0]]
    elif rows:
        # Under the write lock AUTOINCREMENT hands out consecutive ids, so a bulk insert's
        # ids follow the sequence; checked, not assumed.
        base = db.execute(sql.LAST_ITEM_ID).fetchone()[0]
        _insert_rows(db, sql.INSERT_ITEM, sql.INSERT_ITEM_ROWS, rows)
        if db.execute(sql.LAST_ITEM_ID).fetchone()[0] != base + len(rows):
            raise _errors.StorageError("item ids were not handed out consecutively")
        inserted = list(range(base + 1, base + 1 + len(rows)))
    events: list[_rules.Event] = []
    for item_id, row in zip(inserted, rows, strict=True):
        events.extend(_rules.arrival_events(item_id, row, op.actor_id, now, queued))
    _insert_events(db, events)
    return plan.ids(inserted)


def _open_write_lock(
    db: sqlite3.Connection,
    path: pathlib.Path,
    out: list[_write_lock.WriteLock | None],
    boards: list[_combine.Board | None],
) -> None:
    """The queue for the store's write lock, put in ``out``, and with it a slot on the
    board for combining rounds across processes, in ``boards`` (see SQLiteBackend.open)."""
    lock = _write_lock.open_write_lock(path)
    out.append(lock)
    if lock is None:  # combining needs the queue: a holder serves while it holds it
        boards.append(None)
        return
    kinds: dict[str, Callable[..., Any]] = {"claim": _claim_many, "finish": _finish_many}
    boards.append(_combine.open_board(path, kinds, lock))


def _claim_many(
    ops: list[_backend.ClaimOp], db: sqlite3.Connection, now: float
) -> list[list[_backend.ClaimRow]]:
    """Claims that share their filters and lease (a group commit's worth), decided at once.

    The candidates for all of them are chosen together (`asyncplane._rules.ClaimMerge`:
    claim order, one item per fingerprint across the whole group) and dealt out in request
    order. Each item is claimed for its own request's owner, with its own fence and
    events, exactly as if the claims had run one by one.
    """
    first = ops[0]
    params: dict[str, Any] = {
        "now": now,
        "project_id": first.project_id,
        "actor_id": first.actor_id,
    }
    total = sum(op.limit for op in ops)
    events: list[_rules.Event] = []
    lapsed, due, limited, projects = db.execute(sql.ANY_LAPSED_OR_DUE, params).fetchone()
    if lapsed:
        bounded = {**params, "limit": _rules.exhausted_bound(total)}
        for row in db.execute(sql.LAPSED_EXHAUSTED, bounded).fetchall():
            candidate = _rules.Candidate._make(row)
            error, failed = _rules.exhausted_lease_events(candidate, first.actor_id, now)
            db.execute(sql.EXHAUST_ITEM, (error, now, candidate.item_id, candidate.fence))
            events.extend(failed)
    # Limited projects in reach, read under the write lock with their claimed items: what
    # each may give this claim (none: it is not visited).
    reach = _rules.LimitedReach()
    roomy = reach.take(db.execute(sql.LIMITS_IN_REACH, params), now) if limited else []
    # The arms: each project in reach's ready items, their first pages read in one
    # statement (a limited one's apart, no bigger than its room); only if the probes
    # above found any, each project's deferred items fallen due (one statement more) and
    # the lapsed claims of them all. An arm whose first page was short has nothing more.
    if first.project_id is not None and first.project_id in reach.limits:
        projects = 0  # the one project asked for is limited: nothing else is in reach
    page = _rules.first_page(total, projects + len(roomy))
    paged = {**params, "page": page}
    pages: dict[tuple[str, str | None], list[_rules.Candidate]] = {}
    if projects:
        pages = _rules.first_pages(db.execute(sql.CLAIM_FIRST_PAGES, paged))
        if due:
            pages.update(_rules.first_pages(db.execute(sql.CLAIM_FIRST_DUE, paged)))
    sizes: dict[tuple[str, str | None], int] = {}
    for project in roomy:
        size = reach.room(project, page)
        for tag, statement in (("r", sql.CLAIM_READY), ("d", sql.CLAIM_DUE)):
            if tag == "d" and not due:
                continue
            first_rows = db.execute(
                statement, {**params, "project": project, "limit": size, "offset": 0}
            )
            pages[(tag, project)] = [_rules.Candidate._make(row) for row in first_rows]
            sizes[(tag, project)] = size
    if lapsed:
        lapsed_page = db.execute(sql.CLAIM_LAPSED, {**params, "limit": page, "offset": 0})
        pages[("l", None)] = [_rules.Candidate._make(row) for row in lapsed_page]
    chosen = None
    if len(pages) == 1 and not reach.quotas:  # most claims: the page settles it
        (sole,) = pages.values()
        chosen = _rules.sole_arm_choice(sole, page, total)
    if chosen is None:
        chosen = _merged(db, params, pages, sizes, page, total, reach)
    results: dict[int, list[_backend.ClaimRow]] = {id(op): [] for op in ops}
    dealt = _rules.deal(chosen, ops)
    for (candidate, op), got in zip(dealt, _claim_items(db, dealt, now), strict=True):
        if candidate.state == "claimed":
            events.append(_rules.takeover_event(candidate, op, now))
        claimed = _rules.claim_row(candidate, op, now, got)
        results[id(op)].append(claimed)
        events.append(
            _rules.event(candidate.item_id, "claimed", claimed.fence, op.owner, op.actor_id, now)
        )
    taken = {project: quota.taken for project, quota in reach.quotas.items() if quota.taken}
    for project, tokens, refilled_at in reach.spent(taken, now):
        db.execute(sql.SPEND_TOKENS, (tokens, refilled_at, project))
    _insert_events(db, events)
    return [results[id(op)] for op in ops]


def _merged(
    db: sqlite3.Connection,
    params: dict[str, Any],
    pages: dict[tuple[str, str | None], list[_rules.Candidate]],
    sizes: dict[tuple[str, str | None], int],
    page: int,
    total: int,
    reach: _rules.LimitedReach,
) -> list[_rules.Candidate]:
    """A claim's items chosen by `asyncplane._rules.ClaimMerge` from every arm's first
    page, each arm read further as the merge asks."""
    keys = list(pages)
    merge = _rules.ClaimMerge(
        len(keys),
        total,
        first_page=page,
        quotas=reach.quotas,
        arm_projects=[key[1] for key in keys],
    )
    for position, key in enumerate(keys):
        if key in sizes:
            merge.ask(position, sizes[key])
        merge.feed(position, pages[key])
    while (arm := merge.hungry()) is not None:
        limit, offset = merge.next_page(arm)
        tag, arm_project = keys[arm]
        statement = {"r": sql.CLAIM_READY, "d": sql.CLAIM_DUE, "l": sql.CLAIM_LAPSED}[tag]
        further = {**params, "project": arm_project, "limit": limit, "offset": offset}
        merge.feed(arm, db.execute(statement, further))
    return merge.chosen


def _insert_events(db: sqlite3.Connection, events: Sequence[Sequence[Any]]) -> None:
    """Append a round's ledger events, in their order (so their ids rise in it), several
    to a statement (`sql.INSERT_EVENT_ROWS`)."""
    _insert_rows(db, sql.INSERT_EVENT, sql.INSERT_EVENT_ROWS, events)


def _insert_rows(
    db: sqlite3.Connection,
    one: str,
    several: tuple[tuple[int, str], ...],
    rows: Sequence[Sequence[Any]],
) -> None:
    """Insert rows in their order, several to a statement where ``several`` has a size
    for them (largest first), the rest one a statement."""
    start, count = 0, len(rows)
    for size, statement in several:
        while count - start >= size:
            db.execute(statement, [value for row in rows[start : start + size] for value in row])
            start += size
    if count - start == 1:
        db.execute(one, rows[start])
    elif count > start:
        db.executemany(one, rows[start:])


def _claim_items(
    db: sqlite3.Connection, dealt: list[tuple[_rules.Candidate, _backend.ClaimOp]], now: float
) -> list[Any]:
    """Claim the dealt candidates (distinct items), each for its own request's owner and
    lease: the claimed rows, in the order dealt. Several go to a statement (`_returned`)."""
    if len(dealt) == 1:
        candidate, op = dealt[0]
        expires = now + op.lease_seconds
        row = {"owner": op.owner, "lease_expires_at": expires, "now": now,
               "item_id": candidate.item_id}  # fmt: skip
        return db.execute(sql.CLAIM_ITEM, row).fetchall()
    claims = [(c.item_id, op.owner, now + op.lease_seconds) for c, op in dealt]
    claiming = (sql.CLAIM_ITEMS, sql.CLAIM_ITEM_ROWS)
    got = {row[0]: row for row in _returned(db, claiming, claims, now)}
    if len(got) != len(dealt):  # each was read in this very transaction: cannot happen
        raise _errors.StorageError("a claimed candidate was not found to claim")
    return [got[c.item_id] for c, _ in dealt]


def _returned(
    db: sqlite3.Connection,
    statements: tuple[str, str],
    rows: Sequence[tuple[Any, ...]],
    now: float,
) -> Iterator[Any]:
    """What a round's chunk statements (in JSON, in bound rows: `sql.CLAIM_ITEMS` and
    `sql.CLAIM_ITEM_ROWS`, say) return for ``rows``: chunks of `sql.VALUES_ROWS` bound
    rows while at least `sql.VALUES_FROM` are left (the last padded with rows of NULLs,
    which match nothing), then the rest as one JSON array. ``now`` is every one's first
    parameter."""
    in_json, in_rows = statements
    start, size = 0, sql.VALUES_ROWS
    while len(rows) - start >= sql.VALUES_FROM:
        chunk = rows[start : start + size]
        params: list[Any] = [now]
        for row in chunk:
            params.extend(row)
        params.extend([None] * (len(chunk[0]) * (size - len(chunk))))
        yield from db.execute(in_rows, params)
        start += len(chunk)
    if start < len(rows):
        yield from db.execute(in_json, (now, json.dumps(rows[start:])))


def _finish_many(
    ops: list[_backend.FinishOp], db: sqlite3.Connection, now: float
) -> list[int | _errors.AsyncplaneError]:
    """Finishes that came together: each on its own, a refusal answered, not raised.

    Several finishes as done of distinct items settle several to a statement (`_returned`);
    a finish a statement did not match wrote nothing, and is then explained
    (FenceRejected, ...).
    """
    results: list[int | _errors.AsyncplaneError] = []
    events: list[tuple[Any, ...]] = []
    if _rules.settle_as_one(ops) and all(op.status == "done" for op in ops):  # its SQL's
        finishes = [(op.item_id, op.fence, op.result_json, op.actor_id) for op in ops]
        settling = (sql.SETTLE_DONE_MANY, sql.SETTLE_DONE_ROWS)
        settled = {row[0]: row[1:] for row in _returned(db, settling, finishes, now)}
        for op in ops:
            row = settled.get(op.item_id)
            if row is None:
                try:
                    _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
                except _errors.AsyncplaneError as exc:
                    results.append(exc)  # matched nothing: nothing was written for it
                continue
            owner, project_id, fp = row
            events.append(_rules.finish_event(op, owner, now))
            results.append(_settle_twins(op, db, now, project_id, fp, events))
        _insert_events(db, events)
        return results
    for op in ops:
        before = db.total_changes
        try:
            results.append(_settle_finish(op, db, now, events))
        except _errors.AsyncplaneError as exc:
            if db.total_changes != before:  # refused after writing: the writer must undo it
                raise
            results.append(exc)  # the guarded UPDATE matched nothing: nothing was written
    _insert_events(db, events)
    return results


def _renew(op: _backend.RenewOp, db: sqlite3.Connection, now: float) -> float:
    expires = now + op.lease_seconds
    rows = db.execute(
        sql.RENEW, (expires, now, op.item_id, op.fence, op.actor_id, op.actor_id)
    ).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    return expires


def _settle_params(item_id: int, fence: int, actor_id: str | None, now: float) -> dict[str, Any]:
    return {"item_id": item_id, "fence": fence, "actor_id": actor_id, "now": now}


def _settle_finish(
    op: _backend.FinishOp, db: sqlite3.Connection, now: float, events: list[tuple[Any, ...]]
) -> int:
    """Settle one finish; its events are added to ``events`` for the caller to write."""
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    if op.status == "done":
        rows = db.execute(sql.SETTLE_DONE, {**params, "result": op.result_json}).fetchall()
    else:
        rows = db.execute(sql.SETTLE_FAILED, {**params, "error": op.error}).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    owner, project_id, fp = rows[0][:3]
    events.append(_rules.finish_event(op, owner, now))
    return _settle_twins(op, db, now, project_id, fp, events)


def _settle_twins(
    op: _backend.FinishOp,
    db: sqlite3.Connection,
    now: float,
    project_id: str,
    fp: str | None,
    events: list[tuple[Any, ...]],
) -> int:
    """Settlement dedup: a done item's pending twins are done too, with its result."""
    if op.status != "done" or fp is None:
        return 0
    # Settlement dedup: every pending twin in the project is done too, with this result.
    twins = db.execute(
        sql.SETTLE_TWINS,
        {"result": op.result_json, "now": now, "project_id": project_id,
         "fingerprint": fp, "item_id": op.item_id},
    ).fetchall()  # fmt: skip
    events.extend(_rules.twin_events(op.item_id, twins, op.actor_id, now))
    return len(twins)


def _retry(op: _backend.RetryOp, db: sqlite3.Connection, now: float) -> str:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    budget = db.execute(sql.READ_BUDGET, params).fetchone()
    if budget is None:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    attempts, max_attempts, owner = budget
    plan = _rules.retry_plan(op, attempts, max_attempts, now)
    if plan.state == "failed":
        db.execute(sql.SETTLE_FAILED, {**params, "error": plan.error}).fetchall()
    else:
        deferred = {**params, "due_at": plan.due_at, "error": plan.error, "refund": 0,
                    "from_claimed_only": 0}  # fmt: skip
        db.execute(sql.SETTLE_DEFERRED, deferred).fetchall()
    db.execute(
        sql.INSERT_EVENT,
        _rules.retry_event(op, plan, owner, now),
    )
    return plan.state


def _park(op: _backend.ParkOp, db: sqlite3.Connection, now: float) -> None:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    due = _rules.park_due(now, op.delay)
    rows = db.execute(
        sql.SETTLE_DEFERRED,
        {**params, "due_at": due, "error": None, "refund": 1, "from_claimed_only": 1},
    ).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    db.execute(
        sql.INSERT_EVENT,
        _rules.park_event(op, rows[0][0], due, now),
    )


def _release(op: _backend.ReleaseOp, db: sqlite3.Connection, now: float) -> None:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    rows = db.execute(sql.RELEASE, params).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    db.execute(sql.INSERT_EVENT, _rules.release_event(op, rows[0][0], now))


def _offload(op: _backend.OffloadOp, db: sqlite3.Connection, now: float) -> None:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    rows = db.execute(sql.SETTLE_OFFLOADED, {**params, "handle": op.handle}).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    db.execute(
        sql.INSERT_EVENT,
        _rules.offload_event(op, rows[0][0], now),
    )


def _list_params(
    where: _backend.ItemFilter, newest: bool, after: int | None, limit: int
) -> dict[str, Any]:
    params: dict[str, Any] = {
        **where._asdict(),
        "after": _rules.keyset_start(newest, after),
        "limit": limit,
    }
    del params["states"]  # written into the statement (see _sqlite_sql.list_items)
    return params


def _listing(
    db: sqlite3.Connection, where: _backend.ItemFilter, states: tuple[str, ...], newest: bool,
    after: int | None, limit: int, payload: bool,
) -> list[Any]:  # fmt: skip
    statement = sql.list_items(states, where.project_id is not None, newest, payload)
    return db.execute(statement, _list_params(where, newest, after, limit)).fetchall()


def _list_items(db: sqlite3.Connection, op: _backend.ListOp) -> list[_backend.ItemRow]:
    states = _rules.listing_arms(op.where.states, op.where.project_id is not None)
    rows = _listing(db, op.where, states, op.newest, op.after, op.limit, op.include_payload)
    return [_item(row) for row in rows]


def _cancel_one(
    db: sqlite3.Connection, item_id: int, state: str, fence: int, reason: str | None,
    actor_id: str | None, now: float, expected: tuple[str, ...] = (),
    expected_fence: int | None = None,
) -> str:  # fmt: skip
    plan = _rules.cancel_plan(
        item_id, state, fence, reason, actor_id, now, expected, expected_fence
    )
    if plan is None:
        return state
    db.execute(sql.CANCEL_ITEM, (plan.fence, reason, now, item_id))
    db.execute(sql.INSERT_EVENT, plan.event)
    return "cancelled"


def _cancel(op: _backend.CancelOp, db: sqlite3.Connection, now: float) -> tuple[str, bool]:
    found = db.execute(sql.DIAGNOSE_ITEM, (op.actor_id, op.item_id)).fetchone()
    state, fence = _rules.target(op.item_id, op.actor_id, found)
    after = _cancel_one(
        db, op.item_id, state, fence, op.reason, op.actor_id, now, op.expected,
        op.expected_fence,
    )  # fmt: skip
    return after, after != state


def _requeue_one(
    db: sqlite3.Connection, item_id: int, state: str, fence: int, actor_id: str | None,
    now: float, expected: tuple[str, ...] = (), expected_fence: int | None = None,
) -> None:  # fmt: skip
    requeued = _rules.requeue_event(item_id, state, fence, actor_id, now, expected, expected_fence)
    db.execute(sql.INSERT_EVENT, requeued)
    db.execute(sql.REQUEUE_ITEM, (now, item_id))


def _requeue(op: _backend.RequeueOp, db: sqlite3.Connection, now: float) -> None:
    found = db.execute(sql.DIAGNOSE_ITEM, (op.actor_id, op.item_id)).fetchone()
    state, fence = _rules.target(op.item_id, op.actor_id, found)
    _requeue_one(db, op.item_id, state, fence, op.actor_id, now, op.expected, op.expected_fence)


def _chunk_of(db: sqlite3.Connection, op: _backend.WhereOp, states: tuple[str, ...]) -> list[Any]:
    """The chunk's items, oldest first after ``op.after``: read under the write lock, so
    they are still what the filter says when they are changed."""
    if not states:
        return []
    return _listing(db, op.where, states, False, op.after, op.chunk, False)


def _cancel_where(
    op: _backend.WhereOp, db: sqlite3.Connection, now: float
) -> tuple[int, int | None]:
    rows = _chunk_of(db, op, _rules.cancel_states(op.where.states))
    for row in rows:
        _cancel_one(db, row[0], row[2], row[4], op.reason, op.where.actor_id, now)
    return len(rows), _rules.next_chunk([row[0] for row in rows], op.chunk)


def _requeue_where(
    op: _backend.WhereOp, db: sqlite3.Connection, now: float
) -> tuple[int, int | None]:
    rows = _chunk_of(db, op, _rules.requeue_states(op.where.states))
    for row in rows:
        _requeue_one(db, row[0], row[2], row[4], op.where.actor_id, now)
    return len(rows), _rules.next_chunk([row[0] for row in rows], op.chunk)


def _missing_fingerprints(
    db: sqlite3.Connection, params: dict[str, Any], identity: tuple[str, ...]
) -> _backend.Backfill:
    """The backfill's look (in one read transaction: the end it saw is the end of the
    rows it read), the payloads decoded here on the reader's thread."""
    db.execute("BEGIN")
    rows = db.execute(sql.MISSING_FINGERPRINTS, params).fetchall()
    (end,) = db.execute(sql.BACKFILL_END).fetchone()
    db.execute("COMMIT")
    return _backend.Backfill(
        *_fingerprint.backfill(rows, params["after"], params["chunk"], identity, end)
    )


def _set_fingerprints(writes: list[tuple[str, int]], db: sqlite3.Connection, now: float) -> None:
    db.executemany(sql.SET_FINGERPRINT, writes)


def _settle_pending_twins(
    op: _backend.PreflightOp, db: sqlite3.Connection, now: float
) -> tuple[int, bool]:
    # Every note in scope is read (the write lock is held: no note can be missed or
    # locked elsewhere), so only a full chunk of settles may leave more.
    params = {"chunk": op.chunk, "project_id": op.project_id, "actor_id": op.actor_id}
    rows = db.execute(sql.NOTED_TWIN_PAIRS, params).fetchall()
    events: list[_rules.Event] = []
    for item_id, fence, done_id, result in rows:
        db.execute(sql.SETTLE_ONE_TWIN, (result, now, item_id))
        events.extend(_rules.twin_events(done_id, [(item_id, fence)], op.actor_id, now))
    _insert_events(db, events)
    db.execute(sql.FORGET_TWIN_CHECKS, {"project_id": op.project_id, "actor_id": op.actor_id})
    return len(rows), len(rows) == op.chunk


def _note_twin_pairs(contents: list[tuple[str, str]], db: sqlite3.Connection, now: float) -> None:
    db.executemany(sql.NOTE_TWIN_CHECK, contents)


def _standing_as_archived(
    db: sqlite3.Connection, archived: tuple[_backend.Archived, ...]
) -> set[int]:
    return {item.item_id for item in archived
            if db.execute(sql.STANDING_AS_ARCHIVED, item).fetchone() is not None}  # fmt: skip


def _purge_items(
    archived: tuple[_backend.Archived, ...], db: sqlite3.Connection, now: float
) -> int:
    purged = 0
    for item in archived:
        if db.execute(sql.PURGE_ITEM, item).rowcount:
            db.execute(sql.PURGE_EVENTS, (item.item_id,))  # its history goes with it, never before
            purged += 1
    return purged


def _import_rows(
    op: _backend.ImportOp, db: sqlite3.Connection, now: float
) -> tuple[_backend.ImportOutcome, ...]:
    if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is None:
        raise _rules.unknown_project(op.project_id)
    outcomes: list[_backend.ImportOutcome] = []
    dropped = db.execute(
        sql.DROPPED_UP_TO, (_rules.dropped_source(op.source), _rules.SOURCE_DROPPED)
    ).fetchone()
    meanwhile = _rules.dropped_meanwhile(
        op.source, op.dropped_up_to, None if dropped is None else dropped[0]
    )
    if meanwhile is not None:
        raise meanwhile
    for key, digest, item in op.rows:
        recorded = db.execute(sql.IMPORTED_AS, (op.source, key)).fetchone()
        outcome = _rules.imported_before(recorded, digest, op.dropped_up_to)
        outcomes.append(outcome)
        if outcome not in _rules.IMPORT_COPIES:
            continue
        if (refused := _rules.unrecordable_import(op.source, key, recorded)) is not None:
            raise refused
        row = _rules.new_row(op.project_id, item, now)
        (item_id,) = db.execute(sql.INSERT_ITEM_RETURNING, row).fetchall()[0]
        queued = _rules.imported_detail(op.source, key, recorded)
        db.executemany(sql.INSERT_EVENT, _rules.arrival_events(item_id, row, None, now, queued))
        db.execute(sql.RECORD_IMPORTED_ROW, (op.source, key, item_id, now, digest))
    return tuple(outcomes)


def _record_dropped(source: str, db: sqlite3.Connection, now: float) -> None:
    db.execute(
        sql.RECORD_DROPPED,
        (_rules.dropped_source(source), _rules.SOURCE_DROPPED, source, now),
    )


def _copy_projects(op: _backend.CopyProjectsOp, db: sqlite3.Connection, now: float) -> int:
    source = op.source + _rules.COPIED_SETTINGS
    recorded = {row[0] for row in db.execute(sql.RECORDED_SETTINGS, (source,))}
    here = [_backend.ScheduleRow(*row) for row in db.execute(sql.LIST_SCHEDULES)]
    unrecorded = not recorded and db.execute(sql.ANY_RECORD, (op.source,)).fetchone() is not None
    projects_here = {row[0] for row in db.execute(sql.LIST_PROJECTS)}
    plan = _rules.copy_settings_plan(
        op, recorded, here, projects_here, unrecorded_before=unrecorded
    )
    added = 0
    for project in plan.add.projects:
        added += db.execute(sql.COPY_PROJECT, tuple(project)).rowcount
    db.executemany(sql.COPY_ASSIGNMENT, [tuple(a) for a in plan.add.assignments])
    db.executemany(sql.COPY_LIMITS, [row[:6] for row in plan.add.limits])
    db.executemany(sql.COPY_SCHEDULE, [tuple(row) for row in plan.add.schedules])
    db.executemany(sql.RECORD_SETTING, [(source, key, now) for key in plan.records])
    db.executemany(
        sql.MOVE_COPIED_SCHEDULE,
        [(next_at, last_at, now, name) for name, next_at, last_at in plan.moved],
    )
    return added


def _copy_items(op: _backend.CopyOp, db: sqlite3.Connection, now: float) -> tuple[int, int]:
    copied = skipped = 0
    for item, events in op.items:
        key = str(item.item_id)
        if db.execute(sql.ALREADY_IMPORTED, (op.source, key)).fetchone() is not None:
            _rules.copied_here(item, db.execute(sql.COPIED_ITEM, (item.item_id,)).fetchone())
            skipped += 1
            continue
        if db.execute(sql.ITEM_EXISTS, (item.item_id,)).fetchone() is not None:
            raise _rules.copy_id_taken(item.item_id)
        db.execute(sql.COPY_ITEM, item)  # sqlite3 stores a bool dedup as 0 or 1
        db.executemany(
            sql.INSERT_EVENT,
            [(item.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail_json)
             for e in events],
        )  # fmt: skip
        db.execute(sql.RECORD_IMPORT, (op.source, key, item.item_id, now))
        copied += 1
    return copied, skipped


def _copy_imports(
    records: tuple[_backend.ImportRecord, ...], db: sqlite3.Connection, now: float
) -> None:
    db.executemany(sql.COPY_IMPORT, records)


def _advance_item_ids(last: int, source: str, db: sqlite3.Connection, now: float) -> None:
    db.execute(sql.ADVANCE_ITEM_IDS, (last,))
    db.execute(sql.START_ITEM_IDS, (last,))
    db.execute(sql.RECORD_ITEM_IDS, (source, last, now))


# --- schema --------------------------------------------------------------------------------


def _statements(script: str) -> list[str]:
    """Split a migration script into statements (trigger bodies contain semicolons)."""
    statements: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        statements.append(buffer.strip())
    return statements


def _check_header(db: sqlite3.Connection) -> tuple[int, int]:
    """Refuse a file that is not an asyncplane store, or is newer than this release.

    Runs before anything writes to the file, and again inside the migration transaction.
    Returns (application_id, user_version).
    """
    application_id, version = db.execute(sql.READ_HEADER).fetchone()
    if application_id != sql.APPLICATION_ID and (
        application_id != 0 or version != 0 or db.execute(sql.COUNT_OBJECTS).fetchone()[0]
    ):
        raise _errors.NotAnAsyncplaneDatabase(
            "the file is an SQLite database of another application, not an asyncplane store"
        )
    _rules.refuse_newer_schema(version, sql.SCHEMA_VERSION)
    return application_id, version


def vet_store_file(path: pathlib.Path, *, unfinished: bool = False) -> None:
    """Refuse, without writing anything, a file that is not an asyncplane store: not
    SQLite, another application's database, or an empty file (a store would create its
    schema in it). The header on disk may be stale (a store that is open, or was not
    closed cleanly, can hold its first pages in the WAL), so when it does not say, SQLite
    is asked, reading through the WAL. Blocking: for the command line, or a thread.

    With ``unfinished``, a store whose making was cut short (an empty file, or an SQLite
    database with nothing in it yet: a copy killed as it created its destination) passes
    too: opening it makes the schema, as it would have."""
    with path.open("rb") as file:
        header = file.read(72)
    if unfinished and not header:
        return
    if len(header) < 72 or not header.startswith(b"SQLite format 3\x00"):
        raise _errors.NotAnAsyncplaneDatabase("not an SQLite database")
    if int.from_bytes(header[68:72], "big") == sql.APPLICATION_ID:
        return
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            (application_id,) = conn.execute("PRAGMA application_id").fetchone()
            objects = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    if unfinished and application_id == 0 and objects == 0:
        return
    if application_id != sql.APPLICATION_ID:
        raise _errors.NotAnAsyncplaneDatabase("another application's database")


def _check_current_schema(db: sqlite3.Connection) -> None:
    """For a read-only opening: the file must be a store of exactly this schema."""
    _, version = _check_header(db)
    _rules.refuse_unreadable_schema(version, sql.SCHEMA_VERSION, "file")


def _migrate(db: sqlite3.Connection, busy_timeout: float, given_up: threading.Event) -> None:
    """Create or upgrade the schema, all in one write transaction, in which the round's
    chunk statements are compiled too (`_compile_chunks`); its wait for the write lock
    ends early once the opening is given up (`_connection.begin_opening`)."""
    try:
        _connection.begin_opening(db, busy_timeout, given_up)
        try:
            application_id, version = _check_header(db)
            for script in sql.MIGRATIONS[version:]:
                for statement in _statements(script):
                    _migration_step(db, statement)
            if version != sql.SCHEMA_VERSION or application_id != sql.APPLICATION_ID:
                # PRAGMA takes no parameters; both values are integer constants.
                db.execute(f"PRAGMA application_id = {int(sql.APPLICATION_ID)}")
                db.execute(f"PRAGMA user_version = {int(sql.SCHEMA_VERSION)}")
            _reconcile(db)
            _compile_chunks(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc


#: A migration's statement that makes or drops an index or a trigger: objects made from
#: the tables alone, which `_reconcile` makes again as this release has them.
_DERIVED = re.compile(
    r"(\s*--[^\n]*\n)*\s*(CREATE|DROP)\s+(UNIQUE\s+)?(INDEX|TRIGGER)\b", re.IGNORECASE
)


#: A migration's statement that adds a column to a table.
_ADDS_COLUMN = re.compile(r"(\s*--[^\n]*\n)*\s*ALTER\s+TABLE\s+\S+\s+ADD\b", re.IGNORECASE)


def _migration_step(db: sqlite3.Connection, statement: str) -> None:
    """Run one statement of a migration. A store made by a development build of an
    earlier schema (whose migrations were written otherwise before they were released)
    may hold an index or trigger a later migration makes, or lack one it drops: that
    step is passed over, and `_reconcile` sets every such object right after. So is a
    column it adds that is there already (the opening then checks every table has this
    release's columns)."""
    try:
        db.execute(statement)
    except sqlite3.OperationalError as exc:
        message = str(exc)
        derived = _DERIVED.match(statement) and (
            "already exists" in message or message.startswith("no such")
        )
        added = _ADDS_COLUMN.match(statement) and message.startswith("duplicate column name")
        if not (derived or added):
            raise


@functools.cache
def _this_schema() -> tuple[dict[str, frozenset[str]], dict[tuple[str, str], str]]:
    """This release's schema, as its migrations make it in an empty database: each
    table's columns, and each index's and trigger's text (made once a process, ~5 ms)."""
    db = sqlite3.connect(":memory:")
    try:
        for script in sql.MIGRATIONS:
            for statement in _statements(script):
                db.execute(statement)
        tables = {
            name: frozenset(row[1] for row in db.execute(f'PRAGMA table_info("{name}")'))
            for (name,) in db.execute(sql.SCHEMA_TABLES)
        }
        return tables, {(kind, name): text for kind, name, text in db.execute(sql.SCHEMA_DERIVED)}
    finally:
        db.close()


def _reconcile(db: sqlite3.Connection) -> None:
    """Make the store's indexes and triggers this release's, in the opening's transaction.

    They hold no data of their own, so one missing or written otherwise is made again,
    with a warning naming them; nothing is done on a store that matches, which every
    store made and migrated by released migrations does. Indexes and triggers of other
    names are left as they are: an application's own (an audit trigger, an index for its
    queries) are its business. A table that lacks a column this release reads cannot be
    mended so: the store is refused, whole."""
    tables, derived = _this_schema()
    for name, columns in tables.items():
        have = {row[1] for row in db.execute(f'PRAGMA table_info("{name}")')}
        if columns - have:
            raise _errors.SchemaVersionError(
                f"the store's table {name!r} lacks {', '.join(sorted(columns - have))}, "
                "which this release's schema has: it was made by a build of asyncplane "
                "whose schema this release cannot mend"
            )
    found = {(kind, name): text for kind, name, text in db.execute(sql.SCHEMA_DERIVED)}
    remade: list[str] = []
    for (kind, name), text in derived.items():
        if found.get((kind, name)) != text:
            db.execute(f'DROP {kind.upper()} IF EXISTS "{name}"')
            db.execute(text)
            remade.append(f"{kind} {name}")
    if remade:
        _log.warning(
            "asyncplane: the store's schema differed from this release's (a store made by "
            "an earlier development build): made again: %s",
            ", ".join(remade),
        )


def _compile_chunks(db: sqlite3.Connection) -> None:
    """Have the connection compile and cache a round's chunk statements in bound rows
    (`sql.CLAIM_ITEM_ROWS`, `sql.SETTLE_DONE_ROWS`), each run once with rows of NULLs,
    which match nothing and write nothing.

    Compiling one costs 0.2 to 0.5 ms (an UPDATE compiles the items table's triggers with
    it), against 10 to 70 µs to run it once compiled. At a round's first need that would
    be paid inside the writers' queue and the board's round, which other processes' posts
    wait on. It needs a write transaction (an UPDATE takes the write lock when it runs), so
    it runs in the one that opens the store, which holds the lock anyway: about 1 ms more
    there, once a process, paid by every process, even one whose rounds never reach
    `sql.VALUES_FROM` rows."""
    for statement, width in (
        (sql.CLAIM_ITEM_ROWS, sql.CLAIM_ROW_WIDTH),
        (sql.SETTLE_DONE_ROWS, sql.SETTLE_ROW_WIDTH),
    ):
        db.execute(statement, [0.0] + [None] * (width * sql.VALUES_ROWS)).fetchall()


# --- reads (run on a reader's thread) ------------------------------------------------------


def _guarded_read(db: sqlite3.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run a read, translating driver errors and never leaving a transaction open."""
    try:
        return fn(db, *args)
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def _fetch(db: sqlite3.Connection, statement: str, params: tuple[Any, ...]) -> list[Any]:
    return db.execute(statement, params).fetchall()


def _fetch_named(db: sqlite3.Connection, statement: str, params: dict[str, Any]) -> list[Any]:
    return db.execute(statement, params).fetchall()


def _next_due(db: sqlite3.Connection, params: dict[str, Any]) -> float | None:
    """The drain loop's alarm (NEXT_DUE), and each limited project's (`_rules.limited_due`),
    in one snapshot."""
    times: list[float] = []
    (unlimited,) = db.execute(sql.NEXT_DUE, params).fetchone()
    if unlimited is not None:
        times.append(unlimited)
    for row in db.execute(sql.NEXT_DUE_LIMITED, params):
        limited = _rules.limited_due(
            _rules.limits_row(row[:7]), params["now"],
            ready=bool(row[7]), due_at=row[8], takeover_at=row[9],
        )  # fmt: skip
        if limited is not None:
            times.append(limited)
    return min(times, default=None)


def _tally(db: sqlite3.Connection) -> _backend.LedgerTally:
    db.execute("BEGIN")  # one snapshot for the totals and the lists
    items, claims, takeovers, terminal = db.execute(sql.LEDGER_TALLY).fetchone()
    settled_twice = [row[0] for row in db.execute(sql.SETTLED_TWICE)]
    unexplained = [row[0] for row in db.execute(sql.UNEXPLAINED_CLAIMS)]
    taken_from: dict[str, int] = dict(db.execute(sql.TAKEN_FROM))
    at_the_end: dict[str, int] = dict(db.execute(sql.TAKEN_AFTER_LAST_CLAIM))
    db.execute("COMMIT")
    return _backend.LedgerTally(
        items, claims, takeovers, terminal, settled_twice, unexplained, taken_from, at_the_end
    )


def _purge_candidates(
    db: sqlite3.Connection, cutoff: float, chunk: int, after: tuple[float, int]
) -> _backend.Histories:
    db.execute("BEGIN")  # the items and their histories from one snapshot
    given = {"cutoff": cutoff, "chunk": chunk, "after_at": after[0], "after_id": after[1]}
    rows = db.execute(sql.PURGE_CANDIDATES, given).fetchall()
    found = [
        (
            _item(row),
            [_backend.EventRow(*e) for e in db.execute(sql.EVENTS_OF_ITEM, (row[0],))],
        )
        for row in rows
    ]
    db.execute("COMMIT")
    return found


def _item(row: Any) -> _backend.ItemRow:
    found = _backend.ItemRow._make(row)
    return found._replace(dedup=bool(found.dedup))  # dedup is stored as 0 or 1


def _export_items(db: sqlite3.Connection, op: _backend.ExportOp) -> _backend.Histories:
    db.execute("BEGIN")  # the items and their histories from one snapshot
    params = {"after": op.after_item_id, "chunk": op.chunk, "pending_only": int(op.pending_only)}
    rows = db.execute(sql.EXPORT_ITEMS, params).fetchall()
    found = [
        (
            _item(row),
            [_backend.EventRow(*e) for e in db.execute(sql.EVENTS_OF_ITEM, (row[0],))],
        )
        for row in rows
    ]
    db.execute("COMMIT")
    return found


def _stats(db: sqlite3.Connection, now: float) -> _backend.StoreStats:
    db.execute("BEGIN")
    by_project = tuple(tuple(row) for row in db.execute(sql.STATES_BY_PROJECT))
    oldest = db.execute(sql.OLDEST_READY).fetchone()[0]
    expired = db.execute(sql.EXPIRED_LEASES, (now,)).fetchone()[0]
    version = db.execute(sql.READ_SCHEMA_VERSION).fetchone()[0]
    db.execute("COMMIT")
    return _backend.StoreStats(by_project, oldest, expired, version)


def _verify_ledger(
    db: sqlite3.Connection, limit: int | None, item_id: int | None
) -> list[_models.LedgerProblem]:
    problems: list[_models.LedgerProblem] = []
    db.execute("BEGIN")  # one snapshot for every check
    checks = sql.LEDGER_CHECKS if item_id is None else sql.ONE_ITEM_CHECKS
    for kind, statement in checks:
        cursor = db.execute(statement, {} if item_id is None else {"item_id": item_id})
        while limit is None or len(problems) < limit:
            batch = cursor.fetchmany(500 if limit is None else min(500, limit - len(problems)))
            if not batch:
                break
            problems.extend(
                _models.LedgerProblem(kind, item_id, detail) for item_id, detail in batch
            )
        cursor.close()
    db.execute("COMMIT")
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
