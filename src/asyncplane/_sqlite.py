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
import collections
import contextlib
import functools
import itertools
import json
import pathlib
import sqlite3
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio.to_thread

from asyncplane import (
    _backend,
    _clock,
    _connection,
    _errors,
    _fingerprint,
    _lock,
    _models,
    _writer,
)
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
        read_only: bool = False,
    ) -> None:
        self._path = path
        self._clock = clock
        self._synchronous: _connection.Synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._max_batch = max_batch
        self._writer: _writer.Writer | None = None
        self._reader_count = read_connections
        self._readers: _connection.ReaderPool | None = None
        self._read_only = read_only
        self._keeper: asyncio.Task[None] | None = None

    @property
    def writer(self) -> _writer.Writer | None:
        """The writer task's handle (for tests and benchmarks)."""
        return self._writer

    # --- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Open the write connection, create or migrate the schema, start the writer.

        Read-only: open readers only, after checking the file is a store of this schema.
        """
        await _connection.check_path(self._path)
        if self._read_only:
            await self._open_read_only()
            return
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

        async def close_readers(graceful: bool) -> None:
            # Runs when the writer stops: by close() (graceful: reads in flight finish
            # first), or by the event loop shutting down (no waiting).
            await readers.close(wait=graceful)

        self._readers = readers
        self._writer = _writer.Writer(
            conn, self._clock, name=self._path.name, max_batch=self._max_batch,
            on_exit=close_readers,
        )  # fmt: skip
        self._writer.start()

    async def _open_read_only(self) -> None:
        readers = _connection.ReaderPool(
            self._path, size=self._reader_count, busy_timeout=self._busy_timeout
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
        self._keeper = asyncio.get_running_loop().create_task(
            keep(), name=f"asyncplane-readers[{self._path.name}]"
        )

    async def close(self) -> None:
        """Serve queued writes, then close the writer and every reader."""
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

    async def _write(self, op: _writer.Operation[T]) -> T:
        if self._read_only:
            raise _errors.ReadOnlyStore("this store was opened with read_only=True: no writes")
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

    async def enqueue(self, op: _backend.EnqueueOp) -> list[int]:
        return await self._write(functools.partial(_enqueue, op))

    async def claim(self, op: _backend.ClaimOp) -> list[_backend.ClaimRow]:
        key = ("claim", op.lease_seconds, op.actor_id, op.project_id)
        return await self._write(_Grouped(key, op, _claim_many))

    async def renew(self, op: _backend.RenewOp) -> float:
        return await self._write(functools.partial(_renew, op))

    async def finish(self, op: _backend.FinishOp) -> int:
        return await self._write(_Grouped(("finish",), op, _finish_many))

    async def retry(self, op: _backend.RetryOp) -> str:
        return await self._write(functools.partial(_retry, op))

    async def park(self, op: _backend.ParkOp) -> None:
        await self._write(functools.partial(_park, op))

    async def offload(self, op: _backend.OffloadOp) -> None:
        await self._write(functools.partial(_offload, op))

    async def offloaded(self, handle: str, actor_id: str | None) -> list[_backend.ItemRow]:
        rows = await self._read(
            _fetch_named, sql.OFFLOADED, {"handle": handle, "actor_id": actor_id}
        )
        return [_item(row) for row in rows]

    async def backfill_fingerprints(
        self, op: _backend.PreflightOp, after_item_id: int, identity: tuple[str, ...]
    ) -> tuple[int, int]:
        return await self._write(
            functools.partial(_backfill_fingerprints, op, after_item_id, identity)
        )

    async def settle_pending_twins(self, op: _backend.PreflightOp) -> int:
        return await self._write(functools.partial(_settle_pending_twins, op))

    async def purge_candidates(
        self, cutoff: float, chunk: int
    ) -> list[tuple[_backend.ItemRow, list[_backend.EventRow]]]:
        return await self._read(_purge_candidates, cutoff, chunk)

    async def purge_items(self, item_ids: tuple[int, ...]) -> int:
        return await self._write(functools.partial(_purge_items, item_ids))

    async def import_rows(self, op: _backend.ImportOp) -> tuple[int, int]:
        return await self._write(functools.partial(_import_rows, op))

    async def stats(self) -> _backend.StoreStats:
        return await self._read(_stats, self._clock.now())

    async def sizes(self) -> tuple[int, int]:
        return await anyio.to_thread.run_sync(_file_sizes, self._path)

    async def list_assignments(self) -> list[_backend.AssignmentRow]:
        rows = await self._read(_fetch, sql.LIST_ASSIGNMENTS, ())
        return [_backend.AssignmentRow(*row) for row in rows]

    async def export_items(
        self, after_item_id: int, chunk: int, pending_only: bool
    ) -> list[tuple[_backend.ItemRow, list[_backend.EventRow]]]:
        return await self._read(_export_items, after_item_id, chunk, pending_only)

    async def copy_projects(
        self,
        projects: tuple[_backend.ProjectRow, ...],
        assignments: tuple[_backend.AssignmentRow, ...],
    ) -> int:
        return await self._write(functools.partial(_copy_projects, projects, assignments))

    async def copy_items(self, op: _backend.CopyOp) -> tuple[int, int]:
        return await self._write(functools.partial(_copy_items, op))

    @contextlib.asynccontextmanager
    async def drain_guard(self) -> AsyncIterator[bool]:
        """A `DrainLock` on ``<database>.drain.lock``, beside the database."""
        async with _lock.DrainLock(self._path.with_name(self._path.name + ".drain.lock")) as lock:
            yield lock.acquired

    async def next_due(self, project_id: str | None, actor_id: str | None) -> float | None:
        params = {"project_id": project_id, "actor_id": actor_id, "now": self._clock.now()}
        rows = await self._read(_fetch_named, sql.NEXT_DUE, params)
        value: float | None = rows[0][0]
        return value

    async def get_item(self, item_id: int, actor_id: str | None) -> _backend.ItemRow:
        if actor_id is None:
            rows = await self._read(_fetch, sql.GET_ITEM, (item_id,))
        else:
            rows = await self._read(_fetch, sql.GET_ITEM_SCOPED, (item_id, actor_id))
        if not rows:
            raise _invisible_item(item_id, actor_id)
        return _item(rows[0])

    async def get_events(self, item_id: int, actor_id: str | None) -> list[_backend.EventRow]:
        if actor_id is None:
            rows = await self._read(_fetch, sql.GET_EVENTS, (item_id,))
        else:
            rows = await self._read(_fetch, sql.GET_EVENTS_SCOPED, (item_id, actor_id))
        if not rows:
            raise _invisible_item(item_id, actor_id)
        return [_backend.EventRow(*row) for row in rows if row[0] is not None]

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

    async def verify_ledger(self, limit: int | None) -> list[_models.LedgerProblem]:
        return await self._read(_verify_ledger, limit)


def _file_sizes(path: pathlib.Path) -> tuple[int, int]:
    def size(file: pathlib.Path) -> int:
        try:
            return file.stat().st_size
        except FileNotFoundError:
            return 0

    return size(path), size(path.with_name(path.name + "-wal"))


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


def _enqueue(op: _backend.EnqueueOp, db: sqlite3.Connection, now: float) -> list[int]:
    if op.actor_id is None:
        if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is None:
            raise _unknown_project(op.project_id)
    elif db.execute(sql.IS_ASSIGNED, (op.actor_id, op.project_id)).fetchone() is None:
        raise _project_denied(op.project_id, op.actor_id)
    # First resolve dedup: an item whose fingerprint matches an earlier one (in the store,
    # or earlier in this same call) takes that one's id and adds no row.
    ids: list[int | None] = [None] * len(op.items)
    first_of: dict[str, int] = {}  # fingerprint -> position of its first new item
    twin_of: dict[int, int] = {}  # position -> position whose id it shares
    new: list[int] = []
    for position, item in enumerate(op.items):
        fp = item.fingerprint
        if item.dedup and fp is not None:
            if fp in first_of:
                twin_of[position] = first_of[fp]
                continue
            found = db.execute(sql.FIND_TWIN, (op.project_id, fp)).fetchone()
            if found is not None:
                ids[position] = found[0]
                first_of[fp] = position
                continue
            first_of[fp] = position
        new.append(position)
    rows = [_item_row(op.project_id, op.items[p], now) for p in new]
    if len(rows) == 1:
        ids[new[0]] = db.execute(sql.INSERT_ITEM_RETURNING, rows[0]).fetchall()[0][0]
    elif rows:
        # Under the write lock AUTOINCREMENT hands out consecutive ids, so a bulk insert's
        # ids follow the sequence; checked, not assumed.
        base = db.execute(sql.LAST_ITEM_ID).fetchone()[0]
        db.executemany(sql.INSERT_ITEM, rows)
        if db.execute(sql.LAST_ITEM_ID).fetchone()[0] != base + len(rows):
            raise _errors.StorageError("item ids were not handed out consecutively")
        for offset, position in enumerate(new):
            ids[position] = base + 1 + offset
    events: list[tuple[Any, ...]] = []
    for position, row in zip(new, rows, strict=True):
        item_id = ids[position]
        events.append((item_id, "queued", 0, None, op.actor_id, now, None))
        if row[1] == "deferred":
            detail = json.dumps({"due_at": row[9]})
            events.append((item_id, "deferred", 0, None, op.actor_id, now, detail))
    db.executemany(sql.INSERT_EVENT, events)
    for position, first in twin_of.items():
        ids[position] = ids[first]
    resolved = [item_id for item_id in ids if item_id is not None]
    if len(resolved) != len(ids):  # every position has an id by now; never shorten the list
        raise _errors.StorageError("an enqueued item was left without an id")
    return resolved


def _item_row(project_id: str, item: _backend.NewItem, now: float) -> tuple[Any, ...]:
    deferred = item.not_before is not None and item.not_before > now
    return (
        project_id,
        "deferred" if deferred else "ready",
        item.payload_json,
        item.priority,
        item.service_class,
        item.sla,
        item.fingerprint,
        1 if item.dedup else 0,
        item.max_attempts,
        item.not_before if deferred else None,
        now,
        now,
    )


def _claim_key(row: Any) -> tuple[Any, ...]:
    # The claim order (CLAIM_ORDER) for rows merged from the three arms:
    # (item_id, state, fence, owner, attempts, max_attempts, project_id, fingerprint,
    #  priority, service_class, sla)
    return (-row[8], row[9], row[10] is None, row[10] or 0.0, row[0])


def _claim(op: _backend.ClaimOp, db: sqlite3.Connection, now: float) -> list[_backend.ClaimRow]:
    return _claim_many([op], db, now)[0]


def _claim_many(
    ops: list[_backend.ClaimOp], db: sqlite3.Connection, now: float
) -> list[list[_backend.ClaimRow]]:
    """Claims that share their filters and lease (a group commit's worth), decided at once.

    The candidates for all of them are chosen in one pass, in claim order (one item per
    fingerprint across the whole group), and dealt out in request order: the first request
    gets the first ``limit`` items, and so on. Each item is claimed for its own request's
    owner, with its own fence and events, exactly as if the claims had run one by one.
    """
    first = ops[0]
    params: dict[str, Any] = {
        "now": now,
        "project_id": first.project_id,
        "actor_id": first.actor_id,
    }
    total = sum(op.limit for op in ops)
    events: list[tuple[Any, ...]] = []
    lapsed, due = db.execute(sql.ANY_LAPSED_OR_DUE, params).fetchone()
    exhausted = (
        db.execute(sql.LAPSED_EXHAUSTED, {**params, "limit": max(total, 16)}).fetchall()
        if lapsed
        else []
    )
    for item_id, fence, owner, attempts, max_attempts in exhausted:
        # A lapsed lease spent the last attempt: the item fails instead of moving on.
        error = f"attempts exhausted: the lease of attempt {attempts} of {max_attempts} lapsed"
        db.execute(sql.EXHAUST_ITEM, (error, now, item_id, fence))
        events.append((item_id, "lease_expired", fence, owner, first.actor_id, now, None))
        detail = json.dumps({"error": error})
        events.append((item_id, "failed", fence, owner, first.actor_id, now, detail))
    if due or lapsed:
        arms = [sql.CLAIM_READY]
        if due:
            arms.append(sql.CLAIM_DUE)
        if lapsed:
            arms.append(sql.CLAIM_LAPSED)
        chosen = _choose(db, arms, params, total)
    elif total == 1:  # the common claim: the head of the ready queue, nothing to merge
        chosen = db.execute(sql.CLAIM_READY, {**params, "limit": 1, "offset": 0}).fetchall()
    else:
        chosen = _choose(db, [sql.CLAIM_READY], params, total)
    results: list[list[_backend.ClaimRow]] = []
    rows = iter(chosen)
    for op in ops:
        expires = now + op.lease_seconds
        claimed: list[_backend.ClaimRow] = []
        for row in itertools.islice(rows, op.limit):
            item_id, state, old_fence, old_owner = row[:4]
            if state == "claimed":
                # A takeover: the previous holder's lease lapsed. Record that, at its
                # fence, before the new claim, so the history shows who lost it and why.
                detail = json.dumps({"taken_over_by": op.owner})
                events.append(
                    (item_id, "lease_expired", old_fence, old_owner, op.actor_id, now, detail)
                )
            (got,) = db.execute(sql.CLAIM_ITEM, (op.owner, expires, now, item_id)).fetchall()
            new_id, project_id, payload, fence, attempts = got
            # priority, service_class, sla, fingerprint and max_attempts: from the candidate.
            extra = (row[8], row[9], row[10], row[7], row[5])
            claimed.append(
                _backend.ClaimRow(
                    new_id, project_id, payload, fence, attempts, op.owner, expires, *extra
                )
            )
            events.append((item_id, "claimed", fence, op.owner, op.actor_id, now, None))
        results.append(claimed)
    if len(events) == 1:
        db.execute(sql.INSERT_EVENT, events[0])
    elif events:
        db.executemany(sql.INSERT_EVENT, events)
    return results


def _finish_many(
    ops: list[_backend.FinishOp], db: sqlite3.Connection, now: float
) -> list[int | _errors.AsyncplaneError]:
    """Finishes that came together: each on its own, a refusal answered, not raised."""
    results: list[int | _errors.AsyncplaneError] = []
    events: list[tuple[Any, ...]] = []
    for op in ops:
        before = db.total_changes
        try:
            results.append(_settle_finish(op, db, now, events))
        except _errors.AsyncplaneError as exc:
            if db.total_changes != before:  # refused after writing: the writer must undo it
                raise
            results.append(exc)  # the guarded UPDATE matched nothing: nothing was written
    db.executemany(sql.INSERT_EVENT, events)
    return results


class _Grouped:
    """A write operation that the writer may run together with its like.

    Requests with the same ``group_key`` that meet in one group commit run as one call of
    ``run_group`` (see `asyncplane._writer`), which answers for each of them.
    """

    __slots__ = ("group_key", "many", "op")

    def __init__(self, group_key: tuple[Any, ...], op: Any, many: Callable[..., list[Any]]):
        self.group_key = group_key
        self.op = op
        self.many = many

    def __call__(self, db: sqlite3.Connection, now: float) -> Any:
        result = self.many([self.op], db, now)[0]
        if isinstance(result, _errors.AsyncplaneError):
            raise result
        return result

    def run_group(self, members: list[_Grouped], db: sqlite3.Connection, now: float) -> list[Any]:
        return self.many([member.op for member in members], db, now)


class _Arm:
    """One source of claimable items (ready, due, lapsed), read page by page in claim order."""

    def __init__(
        self, db: sqlite3.Connection, statement: str, params: dict[str, Any], page: int
    ) -> None:
        self._db, self._statement, self._params, self._page = db, statement, params, page
        self._offset = 0
        self._rows: collections.deque[Any] = collections.deque()
        self._more = True

    def head(self) -> Any | None:
        """The arm's next row in claim order, fetching another page when needed."""
        if not self._rows and self._more:
            params = {**self._params, "limit": self._page, "offset": self._offset}
            rows = self._db.execute(self._statement, params).fetchall()
            self._offset += len(rows)
            self._more = len(rows) == self._page
            self._rows.extend(rows)
            self._page = min(self._page * 2, 1024)  # twins ahead: read further, faster
        return self._rows[0] if self._rows else None

    def pop(self) -> Any:
        return self._rows.popleft()


def _choose(
    db: sqlite3.Connection, statements: list[str], params: dict[str, Any], limit: int
) -> list[Any]:
    """Merge the three arms in claim order, one item per fingerprint, up to ``limit``.

    Each arm is already in claim order, so the merge takes the smallest head each time;
    an arm reads further pages only when the items it offered were skipped as twins, so
    a skipped item never pushes a later one out of the batch.
    """
    arms = [_Arm(db, statement, params, limit) for statement in statements]
    chosen: list[Any] = []
    fingerprints: set[tuple[str, str]] = set()
    while len(chosen) < limit:
        heads = [(arm, arm.head()) for arm in arms]
        offered = [(_claim_key(row), index) for index, (_, row) in enumerate(heads) if row]
        if not offered:
            break
        _, index = min(offered)
        row = arms[index].pop()
        if row[7] is not None:
            twin = (row[6], row[7])
            if twin in fingerprints:
                continue  # a twin waits until the one claimed now settles
            fingerprints.add(twin)
        chosen.append(row)
    return chosen


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


def _finish(op: _backend.FinishOp, db: sqlite3.Connection, now: float) -> int:
    events: list[tuple[Any, ...]] = []
    settled = _settle_finish(op, db, now, events)
    db.executemany(sql.INSERT_EVENT, events)
    return settled


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
    detail = None if op.error is None else json.dumps({"error": op.error})
    events.append((op.item_id, op.status, op.fence, owner, op.actor_id, now, detail))
    if op.status != "done" or fp is None:
        return 0
    # Settlement dedup: every pending twin in the project is done too, with this result.
    twins = db.execute(
        sql.SETTLE_TWINS,
        {"result": op.result_json, "now": now, "project_id": project_id,
         "fingerprint": fp, "item_id": op.item_id},
    ).fetchall()  # fmt: skip
    settled_by = json.dumps({"deduplicated_from": op.item_id})
    events.extend(
        (twin, "done", fence, None, op.actor_id, now, settled_by) for twin, fence in twins
    )
    return len(twins)


def _retry(op: _backend.RetryOp, db: sqlite3.Connection, now: float) -> str:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    budget = db.execute(sql.READ_BUDGET, params).fetchone()
    if budget is None:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    attempts, max_attempts, owner = budget
    if max_attempts is not None and attempts >= max_attempts:
        error = (
            f"attempts exhausted ({attempts} of {max_attempts}): {op.error or 'no reason given'}"
        )
        db.execute(sql.SETTLE_FAILED, {**params, "error": error}).fetchall()
        detail = json.dumps({"error": error})
        db.execute(
            sql.INSERT_EVENT, (op.item_id, "failed", op.fence, owner, op.actor_id, now, detail)
        )
        return "failed"
    if op.delay is not None:
        delay = op.delay
    else:  # exponential backoff with jitter: spread retries of a burst of failures
        doublings = min(max(attempts - 1, 0), 60)  # past the cap long before; no overflow
        delay = min(op.backoff_max, op.backoff_base * 2**doublings * (0.5 + op.jitter))
    due = now + delay
    deferred = {**params, "due_at": due, "error": op.error, "refund": 0, "from_claimed_only": 0}
    db.execute(sql.SETTLE_DEFERRED, deferred).fetchall()
    detail = json.dumps({"error": op.error, "due_at": due})
    db.execute(sql.INSERT_EVENT, (op.item_id, "retried", op.fence, owner, op.actor_id, now, detail))
    return "deferred"


def _park(op: _backend.ParkOp, db: sqlite3.Connection, now: float) -> None:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    due = now + op.delay
    rows = db.execute(
        sql.SETTLE_DEFERRED,
        {**params, "due_at": due, "error": None, "refund": 1, "from_claimed_only": 1},
    ).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    detail = json.dumps({"due_at": due})
    db.execute(
        sql.INSERT_EVENT, (op.item_id, "parked", op.fence, rows[0][0], op.actor_id, now, detail)
    )


def _offload(op: _backend.OffloadOp, db: sqlite3.Connection, now: float) -> None:
    params = _settle_params(op.item_id, op.fence, op.actor_id, now)
    rows = db.execute(sql.SETTLE_OFFLOADED, {**params, "handle": op.handle}).fetchall()
    if not rows:
        _refuse_fenced(db, op.item_id, op.fence, op.actor_id)
    detail = json.dumps({"handle": op.handle})
    db.execute(
        sql.INSERT_EVENT, (op.item_id, "offloaded", op.fence, rows[0][0], op.actor_id, now, detail)
    )


def _backfill_fingerprints(
    op: _backend.PreflightOp,
    after: int,
    identity: tuple[str, ...],
    db: sqlite3.Connection,
    now: float,
) -> tuple[int, int]:
    params = {"after": after, "chunk": op.chunk, "project_id": op.project_id,
              "actor_id": op.actor_id}  # fmt: skip
    rows = db.execute(sql.MISSING_FINGERPRINTS, params).fetchall()
    if not rows:
        return after, 0
    db.executemany(
        sql.SET_FINGERPRINT,
        [(_fingerprint.from_stored(payload, identity), item_id)
         for item_id, payload in rows],
    )  # fmt: skip
    return rows[-1][0], len(rows)


def _settle_pending_twins(op: _backend.PreflightOp, db: sqlite3.Connection, now: float) -> int:
    params = {"chunk": op.chunk, "project_id": op.project_id, "actor_id": op.actor_id}
    rows = db.execute(sql.PENDING_WITH_DONE_TWIN, params).fetchall()
    events = []
    for item_id, fence, done_id, result in rows:
        db.execute(sql.SETTLE_ONE_TWIN, (result, now, item_id))
        detail = json.dumps({"deduplicated_from": done_id})
        events.append((item_id, "done", fence, None, op.actor_id, now, detail))
    db.executemany(sql.INSERT_EVENT, events)
    return len(rows)


def _purge_items(item_ids: tuple[int, ...], db: sqlite3.Connection, now: float) -> int:
    purged = 0
    for item_id in item_ids:
        if db.execute(sql.PURGE_ITEM, (item_id,)).rowcount:
            db.execute(sql.PURGE_EVENTS, (item_id,))  # its history goes with it, never before
            purged += 1
    return purged


def _import_rows(op: _backend.ImportOp, db: sqlite3.Connection, now: float) -> tuple[int, int]:
    if db.execute(sql.PROJECT_EXISTS, (op.project_id,)).fetchone() is None:
        raise _unknown_project(op.project_id)
    imported = skipped = 0
    detail_base = {"imported_from": op.source}
    for key, item in op.rows:
        if db.execute(sql.ALREADY_IMPORTED, (op.source, key)).fetchone() is not None:
            skipped += 1
            continue
        row = _item_row(op.project_id, item, now)
        (item_id,) = db.execute(sql.INSERT_ITEM_RETURNING, row).fetchall()[0]
        detail = json.dumps({**detail_base, "source_key": key})
        db.execute(sql.INSERT_EVENT, (item_id, "queued", 0, None, None, now, detail))
        if row[1] == "deferred":
            deferred = json.dumps({"due_at": row[9]})
            db.execute(sql.INSERT_EVENT, (item_id, "deferred", 0, None, None, now, deferred))
        db.execute(sql.RECORD_IMPORT, (op.source, key, item_id, now))
        imported += 1
    return imported, skipped


def _copy_projects(
    projects: tuple[_backend.ProjectRow, ...],
    assignments: tuple[_backend.AssignmentRow, ...],
    db: sqlite3.Connection,
    now: float,
) -> int:
    added = 0
    for project in projects:
        added += db.execute(sql.COPY_PROJECT, tuple(project)).rowcount
    db.executemany(sql.COPY_ASSIGNMENT, [tuple(a) for a in assignments])
    return added


def _copy_items(op: _backend.CopyOp, db: sqlite3.Connection, now: float) -> tuple[int, int]:
    copied = skipped = 0
    for item, events in op.items:
        key = str(item.item_id)
        if db.execute(sql.ALREADY_IMPORTED, (op.source, key)).fetchone() is not None:
            skipped += 1
            continue
        if db.execute(sql.ITEM_EXISTS, (item.item_id,)).fetchone() is not None:
            raise _errors.InvalidInput(
                f"the destination holds an item {item.item_id} of its own: a copy keeps "
                "item ids, so it goes into an empty store (or one it copied into before)"
            )
        db.execute(sql.COPY_ITEM, (*item[:-1], 1 if item.dedup else 0))
        db.executemany(
            sql.INSERT_EVENT,
            [(item.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail_json)
             for e in events],
        )  # fmt: skip
        db.execute(sql.RECORD_IMPORT, (op.source, key, item.item_id, now))
        copied += 1
    return copied, skipped


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


def _check_current_schema(db: sqlite3.Connection) -> None:
    """For a read-only opening: the file must be a store of exactly this schema."""
    _, version = _check_header(db)
    if version == 0:
        raise _errors.NotAnAsyncplaneDatabase("the file is empty: not an asyncplane store yet")
    if version < sql.SCHEMA_VERSION:
        raise _errors.SchemaVersionError(
            f"the store has schema version {version} and needs migrating to "
            f"{sql.SCHEMA_VERSION}: open it once without read_only"
        )


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


def _fetch_named(db: sqlite3.Connection, statement: str, params: dict[str, Any]) -> list[Any]:
    return db.execute(statement, params).fetchall()


def _tally(db: sqlite3.Connection) -> _backend.LedgerTally:
    db.execute("BEGIN")  # one snapshot for the totals and the lists
    items, claims, takeovers, terminal = db.execute(sql.LEDGER_TALLY).fetchone()
    settled_twice = [row[0] for row in db.execute(sql.SETTLED_TWICE)]
    unexplained = [row[0] for row in db.execute(sql.UNEXPLAINED_CLAIMS)]
    db.execute("COMMIT")
    return _backend.LedgerTally(items, claims, takeovers, terminal, settled_twice, unexplained)


def _purge_candidates(
    db: sqlite3.Connection, cutoff: float, chunk: int
) -> list[tuple[_backend.ItemRow, list[_backend.EventRow]]]:
    db.execute("BEGIN")  # the items and their histories from one snapshot
    rows = db.execute(sql.PURGE_CANDIDATES, {"cutoff": cutoff, "chunk": chunk}).fetchall()
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
    return _backend.ItemRow._make((*row[:-1], bool(row[-1])))  # dedup is stored as 0 or 1


def _export_items(
    db: sqlite3.Connection, after: int, chunk: int, pending_only: bool
) -> list[tuple[_backend.ItemRow, list[_backend.EventRow]]]:
    db.execute("BEGIN")  # the items and their histories from one snapshot
    params = {"after": after, "chunk": chunk, "pending_only": 1 if pending_only else 0}
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
