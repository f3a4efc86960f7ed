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

import functools
import json
import pathlib
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from asyncplane import _backend, _clock, _connection, _errors, _models, _writer
from asyncplane import _sqlite_sql as sql

__all__ = ("SQLiteBackend",)

T = TypeVar("T")


class SQLiteBackend:
    """Implements `asyncplane._backend.Backend` on one SQLite file in WAL mode."""

    def __init__(
        self,
        path: pathlib.Path,
        *,
        clock: _clock.Clock,
        synchronous: _connection.Synchronous,
        busy_timeout: float,
        max_batch: int,
        read_connections: int,
    ) -> None:
        self._path = path
        self._clock = clock
        self._synchronous: _connection.Synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._max_batch = max_batch
        self._writer: _writer.Writer | None = None
        self._reader_count = read_connections
        self._readers: _connection.ReaderPool | None = None

    @property
    def writer(self) -> _writer.Writer | None:
        """The writer task's handle (for tests and benchmarks)."""
        return self._writer

    # --- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Open the write connection, create or migrate the schema, start the writer."""
        conn = await _connection.open_writer(
            self._path,
            synchronous=self._synchronous,
            busy_timeout=self._busy_timeout,
            vet=_check_header,
        )
        try:
            await _connection.run(conn, _migrate)
        except BaseException:
            await conn.close()
            raise
        readers = _connection.ReaderPool(
            self._path, size=self._reader_count, busy_timeout=self._busy_timeout
        )

        async def close_readers() -> None:
            # Runs when the writer stops, by close() or by the event loop shutting down.
            await readers.close(wait=False)

        self._readers = readers
        self._writer = _writer.Writer(
            conn, self._clock, name=self._path.name, max_batch=self._max_batch,
            on_exit=close_readers,
        )  # fmt: skip
        self._writer.start()

    async def close(self) -> None:
        """Serve queued writes, then close the writer and every reader."""
        writer, readers = self._writer, self._readers
        if writer is not None:
            await writer.stop()  # its on_exit closes the idle readers
        if readers is not None:
            await readers.close(wait=True)  # and the busy ones close as they finish

    def forget(self) -> None:
        """Stop every connection thread left behind by an event loop that has ended."""
        if self._writer is not None:
            self._writer.abandon()
        if self._readers is not None:
            self._readers.abandon()
        self._writer = self._readers = None

    async def _write(self, op: _writer.Operation[T]) -> T:
        if self._writer is None:
            raise _errors.StoreClosed("the store is closed")
        return await self._writer.submit(op)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(db, *args)`` on a read-only connection."""
        if self._readers is None:
            raise _errors.StoreClosed("the store is closed")
        return await self._readers.run(_guarded_read, fn, *args)

    # --- projects and scope --------------------------------------------------------------

    async def create_project(self, op: _backend.NewProject) -> None:
        await self._write(functools.partial(_create_project, op))

    async def set_project_status(self, project_id: str, status: str) -> None:
        await self._write(functools.partial(_set_project_status, project_id, status))

    async def get_project(self, project_id: str) -> _backend.ProjectRow:
        rows = await self._read(_fetch, sql.GET_PROJECT, (project_id,))
        if not rows:
            raise _unknown_project(project_id)
        return _backend.ProjectRow(*rows[0])

    async def list_projects(self) -> list[_backend.ProjectRow]:
        rows = await self._read(_fetch, sql.LIST_PROJECTS, ())
        return [_backend.ProjectRow(*row) for row in rows]

    async def assign(self, project_id: str, actor_id: str) -> None:
        await self._write(functools.partial(_assign, project_id, actor_id))

    async def unassign(self, project_id: str, actor_id: str) -> None:
        await self._write(functools.partial(_unassign, project_id, actor_id))

    async def visible_projects(self, actor_id: str) -> list[str]:
        rows = await self._read(_fetch, sql.VISIBLE_PROJECTS, (actor_id,))
        return [row[0] for row in rows]

    # --- items ---------------------------------------------------------------------------

    async def enqueue(self, op: _backend.EnqueueOp) -> int:
        return await self._write(functools.partial(_enqueue, op))

    async def claim(self, op: _backend.ClaimOp) -> list[_backend.ClaimRow]:
        return await self._write(functools.partial(_claim, op))

    async def renew(self, op: _backend.RenewOp) -> float:
        return await self._write(functools.partial(_renew, op))

    async def finish(self, op: _backend.FinishOp) -> None:
        await self._write(functools.partial(_finish, op))

    async def get_item(self, item_id: int, actor_id: str | None) -> _backend.ItemRow:
        if actor_id is None:
            rows = await self._read(_fetch, sql.GET_ITEM, (item_id,))
        else:
            rows = await self._read(_fetch, sql.GET_ITEM_SCOPED, (item_id, actor_id))
        if not rows:
            raise _invisible_item(item_id, actor_id)
        return _backend.ItemRow(*rows[0])

    async def get_events(self, item_id: int, actor_id: str | None) -> list[_backend.EventRow]:
        if actor_id is None:
            rows = await self._read(_fetch, sql.GET_EVENTS, (item_id,))
        else:
            rows = await self._read(_fetch, sql.GET_EVENTS_SCOPED, (item_id, actor_id))
        if not rows:
            raise _invisible_item(item_id, actor_id)
        return [_backend.EventRow(*row) for row in rows if row[0] is not None]

    async def count_states(self) -> dict[str, int]:
        rows = await self._read(_fetch, sql.COUNT_STATES, ())
        return dict(rows)

    async def tally(self) -> _backend.LedgerTally:
        return await self._read(_tally)

    async def item_ids(self, state: str) -> list[int]:
        return [row[0] for row in await self._read(_fetch, sql.ITEM_IDS_IN_STATE, (state,))]

    async def verify_ledger(self, limit: int | None) -> list[_models.LedgerProblem]:
        return await self._read(_verify_ledger, limit)


# --- refusals ------------------------------------------------------------------------------


def _unknown_project(project_id: str) -> _errors.UnknownProject:
    return _errors.UnknownProject(f"no project {project_id!r}")


def _project_denied(project_id: str, actor_id: str) -> _errors.ScopeDenied:
    # The same words whether the project is absent or assigned to someone else.
    return _errors.ScopeDenied(f"project {project_id!r} is not visible to actor {actor_id!r}")


def _invisible_item(item_id: int, actor_id: str | None) -> _errors.AsyncplaneError:
    if actor_id is None:
        return _errors.UnknownItem(f"no item {item_id}")
    # The same words whether the item is absent or in another actor's project.
    return _errors.ScopeDenied(f"item {item_id} is not visible to actor {actor_id!r}")


def _refuse_fenced(db: sqlite3.Connection, item_id: int, fence: int, actor_id: str | None) -> None:
    """Explain why a fenced update matched no row, by raising the right error."""
    row = db.execute(sql.DIAGNOSE_ITEM, (actor_id, item_id)).fetchone()
    if row is None or (actor_id is not None and not row[2]):
        raise _invisible_item(item_id, actor_id)
    state, current_fence, _ = row
    raise _errors.FenceRejected(item_id, fence, current_fence=current_fence, state=state)


# --- write operations (run on the writer's thread, inside its transaction) ---------------


def _create_project(op: _backend.NewProject, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is not None:
        raise _errors.ProjectExists(f"project {op.project_id!r} exists already")
    db.execute(sql.INSERT_PROJECT, (op.project_id, op.name, op.status, now))


def _set_project_status(project_id: str, status: str, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.SET_PROJECT_STATUS, (status, project_id)).rowcount == 0:
        raise _unknown_project(project_id)


def _assign(project_id: str, actor_id: str, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.PROJECT_EXISTS, (project_id,)).fetchone() is None:
        raise _unknown_project(project_id)
    db.execute(sql.ASSIGN, (actor_id, project_id, now))


def _unassign(project_id: str, actor_id: str, db: sqlite3.Connection, now: float) -> None:
    if db.execute(sql.PROJECT_EXISTS, (project_id,)).fetchone() is None:
        raise _unknown_project(project_id)
    db.execute(sql.UNASSIGN, (actor_id, project_id))


def _enqueue(op: _backend.EnqueueOp, db: sqlite3.Connection, now: float) -> int:
    if op.actor_id is None:
        if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is None:
            raise _unknown_project(op.project_id)
    elif db.execute(sql.IS_ASSIGNED, (op.actor_id, op.project_id)).fetchone() is None:
        raise _project_denied(op.project_id, op.actor_id)
    item_id: int = db.execute(
        sql.INSERT_ITEM, (op.project_id, op.payload_json, now, now)
    ).fetchall()[0][0]
    db.execute(sql.INSERT_EVENT, (item_id, "queued", 0, None, op.actor_id, now, None))
    return item_id


def _claim(op: _backend.ClaimOp, db: sqlite3.Connection, now: float) -> list[_backend.ClaimRow]:
    if op.actor_id is None:
        params: dict[str, Any] = {"limit": op.limit, "now": now}
        candidates = db.execute(sql.CLAIM_CANDIDATES, params).fetchall()
    else:
        params = {"limit": op.limit, "now": now, "actor_id": op.actor_id}
        candidates = db.execute(sql.CLAIM_CANDIDATES_SCOPED, params).fetchall()
    expires = now + op.lease_seconds
    claimed: list[_backend.ClaimRow] = []
    events: list[tuple[Any, ...]] = []
    for item_id, state, old_fence, old_owner in candidates:
        if state == "claimed":
            # A takeover: the previous holder's lease lapsed. Record that, at its fence,
            # before the new claim, so the history shows who lost the item and why.
            detail = json.dumps({"taken_over_by": op.owner})
            events.append(
                (item_id, "lease_expired", old_fence, old_owner, op.actor_id, now, detail)
            )
        (row,) = db.execute(sql.CLAIM_ITEM, (op.owner, expires, now, item_id)).fetchall()
        claimed.append(_backend.ClaimRow(row[0], row[1], row[2], row[3], row[4], op.owner, expires))
        events.append((item_id, "claimed", row[3], op.owner, op.actor_id, now, None))
    if len(events) == 1:
        db.execute(sql.INSERT_EVENT, events[0])
    elif events:
        db.executemany(sql.INSERT_EVENT, events)
    return claimed


def _renew(op: _backend.RenewOp, db: sqlite3.Connection, now: float) -> float:
    expires = now + op.lease_seconds
    if op.actor_id is None:
        rows = db.execute(sql.RENEW, (expires, now, op.item_id, op.fence)).fetchall()
    else:
        rows = db.execute(
            sql.RENEW_SCOPED, (expires, now, op.item_id, op.fence, op.actor_id)
        ).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    return expires


def _finish(op: _backend.FinishOp, db: sqlite3.Connection, now: float) -> None:
    if op.actor_id is None:
        rows = db.execute(sql.FINISH, (op.status, now, op.item_id, op.fence)).fetchall()
    else:
        rows = db.execute(
            sql.FINISH_SCOPED, (op.status, now, op.item_id, op.fence, op.actor_id)
        ).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    owner = rows[0][0]
    db.execute(sql.INSERT_EVENT, (op.item_id, op.status, op.fence, owner, op.actor_id, now, None))


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
    if version > sql.SCHEMA_VERSION:
        raise _errors.SchemaVersionError(
            f"the store has schema version {version}; this asyncplane knows versions up "
            f"to {sql.SCHEMA_VERSION}: upgrade asyncplane to open it"
        )
    return application_id, version


def _migrate(db: sqlite3.Connection) -> None:
    """Create or upgrade the schema, all in one write transaction."""
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            application_id, version = _check_header(db)
            for script in sql.MIGRATIONS[version:]:
                for statement in _statements(script):
                    db.execute(statement)
            if version != sql.SCHEMA_VERSION or application_id != sql.APPLICATION_ID:
                # PRAGMA takes no parameters; both values are integer constants.
                db.execute(f"PRAGMA application_id = {int(sql.APPLICATION_ID)}")
                db.execute(f"PRAGMA user_version = {int(sql.SCHEMA_VERSION)}")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        raise _errors.translate_sqlite(exc) from exc


# --- reads (run on a reader's thread) ------------------------------------------------------


def _guarded_read(db: sqlite3.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run a read, translating driver errors and never leaving a transaction open."""
    try:
        return fn(db, *args)
    except sqlite3.Error as exc:
        raise _errors.translate_sqlite(exc) from exc
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def _fetch(db: sqlite3.Connection, statement: str, params: tuple[Any, ...]) -> list[Any]:
    return db.execute(statement, params).fetchall()


def _tally(db: sqlite3.Connection) -> _backend.LedgerTally:
    db.execute("BEGIN")  # one snapshot for the totals and the lists
    items, claims, takeovers, terminal = db.execute(sql.LEDGER_TALLY).fetchone()
    settled_twice = [row[0] for row in db.execute(sql.SETTLED_TWICE)]
    unexplained = [row[0] for row in db.execute(sql.UNEXPLAINED_CLAIMS)]
    db.execute("COMMIT")
    return _backend.LedgerTally(items, claims, takeovers, terminal, settled_twice, unexplained)


def _verify_ledger(db: sqlite3.Connection, limit: int | None) -> list[_models.LedgerProblem]:
    problems: list[_models.LedgerProblem] = []
    db.execute("BEGIN")  # one snapshot for every check
    for kind, statement in sql.LEDGER_CHECKS:
        cursor = db.execute(statement)
        while limit is None or len(problems) < limit:
            batch = cursor.fetchmany(500 if limit is None else limit - len(problems))
            if not batch:
                break
            problems.extend(
                _models.LedgerProblem(kind, item_id, detail) for item_id, detail in batch
            )
        cursor.close()
    db.execute("COMMIT")
    problems.sort(key=lambda p: (p.item_id, _KIND_ORDER[p.kind]))
    return problems


_KIND_ORDER = {kind: position for position, (kind, _) in enumerate(sql.LEDGER_CHECKS)}
