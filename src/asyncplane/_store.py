"""ControlStore: the public, async face of an asyncplane store.

The store checks every argument (`asyncplane._validate`), turns it into one typed
operation of the backend seam (`asyncplane._backend`), and turns what comes back into
public values. It holds no state of its own beyond configuration and the backend: the
database is the only authority for items, claims, fences and scope.

A store is bound to the event loop that opened it (its writer task lives there). It
opens itself on first use; ``async with`` or ``await store.close()`` releases it.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import types
from datetime import datetime
from typing import Any, Literal

from asyncplane import _backend, _clock, _errors, _models, _sqlite, _validate
from asyncplane._models import ClaimedItem

__all__ = ("ControlStore",)


class ControlStore:
    """A durable work store on one SQLite file, shared by coroutines and processes.

    Args:
        path: The database file; created, with its schema, on first use.
        lease_seconds: How long a claim stays exclusively its owner's before another
            worker may take it over (int or float seconds, at most 366 days).
        clock: Where "now" comes from; `asyncplane.testing.ManualClock` in tests.
        synchronous: ``"NORMAL"`` (the default: durable against process crashes, a power
            loss may undo the last commits) or ``"FULL"`` (also durable against power loss).
        busy_timeout: Seconds a write waits for the database's write lock, held by another
            connection (another process, or another store on the same file), before it
            fails with DatabaseLocked (at most a day).
        max_payload_bytes: The largest payload accepted, in bytes of compact JSON.
        max_batch: The most requests one group commit may carry.
        read_connections: How many read-only connections reads may use at once.

    Constructing a store does no I/O; it opens on first use or on ``await store.open()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lease_seconds: float = 900,
        clock: _clock.Clock | None = None,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout: float = 30.0,
        max_payload_bytes: int = 1 << 20,
        max_batch: int = 256,
        read_connections: int = 2,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise _errors.InvalidType(f"path must be a str or PathLike, not {type(path).__name__}")
        if not os.fspath(path):
            raise _errors.InvalidInput("path must not be empty")
        if os.fspath(path) == ":memory:":
            raise _errors.InvalidInput(
                "an asyncplane store is a file shared by connections; ':memory:' cannot be shared"
            )
        if synchronous not in ("NORMAL", "FULL"):
            raise _errors.InvalidInput(
                f"synchronous must be 'NORMAL' or 'FULL', got {synchronous!r}"
            )
        if clock is not None and not isinstance(clock, _clock.Clock):
            raise _errors.InvalidType("clock must have a now() method returning epoch seconds")
        # Absolute from the start, so a later chdir cannot move the store.
        self._path = pathlib.Path(os.path.abspath(os.fspath(path)))
        self._lease_seconds = _validate.lease_seconds(lease_seconds)
        self._clock: _clock.Clock = clock if clock is not None else _clock.SystemClock()
        self._synchronous: Literal["NORMAL", "FULL"] = synchronous
        self._busy_timeout = _validate.seconds(
            busy_timeout, "busy_timeout", _validate.MAX_BUSY_TIMEOUT
        )
        self._max_payload_bytes = _validate.positive_int(max_payload_bytes, "max_payload_bytes")
        self._backend: _backend.Backend = _sqlite.SQLiteBackend(
            self._path,
            clock=self._clock,
            synchronous=synchronous,
            busy_timeout=self._busy_timeout,
            max_batch=_validate.positive_int(max_batch, "max_batch"),
            read_connections=_validate.positive_int(read_connections, "read_connections"),
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open_lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._is_open = False

    def __repr__(self) -> str:
        state = "open" if self._is_open else "closed"
        return f"<ControlStore {str(self._path)!r} {state}>"

    # --- configuration -------------------------------------------------------------------

    @property
    def path(self) -> pathlib.Path:
        """The database file."""
        return self._path

    @property
    def lease_seconds(self) -> float:
        """The default lease length, in seconds."""
        return self._lease_seconds

    @property
    def clock(self) -> _clock.Clock:
        """The clock leases and events are measured by."""
        return self._clock

    @property
    def synchronous(self) -> Literal["NORMAL", "FULL"]:
        """The SQLite synchronous level of the write connection."""
        return self._synchronous

    # --- lifecycle -----------------------------------------------------------------------

    async def open(self) -> ControlStore:
        """Open the database (creating or migrating its schema); idempotent."""
        await self._ready()
        return self

    async def close(self) -> None:
        """Finish every queued write, then release all connections; idempotent.

        Writes queued before the close are served; reads still waiting for a read
        connection when it begins are refused with StoreClosed. Calls made once the close
        has begun wait for it to finish, then open the store again. A closed store may be
        opened again, on any event loop.
        """
        self._check_loop()
        if self._loop is None:  # never opened, or closed already
            return
        async with self._lock():
            if not self._is_open:
                return
            self._is_open = False
            try:
                await self._backend.close()
            finally:
                self._loop = None

    async def __aenter__(self) -> ControlStore:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.close()

    def _lock(self) -> asyncio.Lock:
        """The lock that serialises opening and closing, made for the running loop."""
        loop = asyncio.get_running_loop()
        if self._open_lock is None or self._lock_loop is not loop:
            self._open_lock, self._lock_loop = asyncio.Lock(), loop
        return self._open_lock

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            if self._loop.is_closed():
                # The loop it was opened on has ended. asyncio.run cancelled the writer,
                # which closed its connections; a loop closed without that leaves threads
                # behind, which forget() stops. Either way: start afresh on this loop.
                self._backend.forget()
                self._is_open = False
                self._loop = None
                return
            raise _errors.StoreClosed(
                "this ControlStore was opened on another event loop; "
                "close it there, or open one store per event loop"
            )

    async def _ready(self) -> _backend.Backend:
        """The backend, opened on first use."""
        if self._is_open and self._loop is asyncio.get_running_loop():
            return self._backend  # the hot path: open, on its own loop
        self._check_loop()
        async with self._lock():
            if not self._is_open:
                self._loop = asyncio.get_running_loop()
                try:
                    await self._backend.open()
                except BaseException:
                    self._loop = None
                    raise
                self._is_open = True
        return self._backend

    # --- projects and scope --------------------------------------------------------------

    async def create_project(self, project_id: str, name: str, *, status: str = "open") -> None:
        """Create a project; ProjectExists if the id is taken.

        Only projects whose status is ``"open"`` hand out claims; ``"paused"`` and
        ``"closed"`` keep their items but hand out none.
        """
        op = _backend.NewProject(
            _validate.text_id(project_id, "project_id"),
            _validate.name(name),
            _validate.project_status(status),
        )
        await (await self._ready()).create_project(op)

    async def set_project_status(self, project_id: str, status: str) -> None:
        """Change a project's status; UnknownProject if it does not exist."""
        project_id = _validate.text_id(project_id, "project_id")
        status = _validate.project_status(status)
        await (await self._ready()).set_project_status(project_id, status)

    async def project(self, project_id: str) -> dict[str, Any]:
        """A project as a dict: project_id, name, status, created_at."""
        project_id = _validate.text_id(project_id, "project_id")
        row = await (await self._ready()).get_project(project_id)
        return _project_dict(row)

    async def projects(self) -> list[dict[str, Any]]:
        """Every project, ordered by id."""
        return [_project_dict(row) for row in await (await self._ready()).list_projects()]

    async def assign(self, project_id: str, actor_id: str) -> None:
        """Let an actor see and work on a project (idempotent)."""
        project_id = _validate.text_id(project_id, "project_id")
        actor_id = _validate.text_id(actor_id, "actor_id")
        await (await self._ready()).assign(project_id, actor_id)

    async def unassign(self, project_id: str, actor_id: str) -> None:
        """Take a project away from an actor (idempotent)."""
        project_id = _validate.text_id(project_id, "project_id")
        actor_id = _validate.text_id(actor_id, "actor_id")
        await (await self._ready()).unassign(project_id, actor_id)

    async def visible_projects(self, actor_id: str) -> list[str]:
        """The ids of the projects an actor is assigned to, in order."""
        actor_id = _validate.text_id(actor_id, "actor_id")
        return await (await self._ready()).visible_projects(actor_id)

    # --- items ---------------------------------------------------------------------------

    async def enqueue(
        self, project_id: str, payload: dict[str, Any], *, actor_id: str | None = None
    ) -> int:
        """Add an item to a project's queue and return its id.

        Args:
            project_id: The project; without ``actor_id`` any existing project.
            payload: A JSON object (dict of plain JSON values), at most
                ``max_payload_bytes`` of compact JSON.
            actor_id: Act as this actor: the project must be assigned to it.

        Raises:
            UnknownProject: No such project (control plane only).
            ScopeDenied: The actor may not see the project (or it does not exist).
            InvalidPayload: The payload is not plain JSON, or too large.
        """
        op = _backend.EnqueueOp(
            _validate.text_id(project_id, "project_id"),
            _validate.encode_payload(payload, self._max_payload_bytes),
            _validate.optional_actor(actor_id),
        )
        return await (await self._ready()).enqueue(op)

    async def claim(
        self,
        owner: str,
        *,
        actor_id: str | None = None,
        lease_seconds: float | None = None,
    ) -> ClaimedItem | None:
        """Claim the oldest available item for ``owner``, or return None if there is none.

        Available means ready, or claimed by someone whose lease has lapsed (a takeover,
        recorded as a ``lease_expired`` event), in a project whose status is ``"open"``
        and, with ``actor_id``, assigned to that actor. The claim is decided and recorded
        in one write transaction, so an item goes to exactly one caller; its fence is
        above every earlier fence of the item.

        Args:
            owner: Who is claiming (a worker name); recorded on the item and its events.
            actor_id: Act as this actor: claim only from its assigned projects.
            lease_seconds: This claim's lease length instead of the store's default.
        """
        owner = _validate.text_id(owner, "owner")
        actor = _validate.optional_actor(actor_id)
        seconds = (
            self._lease_seconds if lease_seconds is None else _validate.lease_seconds(lease_seconds)
        )
        rows = await (await self._ready()).claim(_backend.ClaimOp(owner, 1, seconds, actor))
        return _claimed_item(rows[0]) if rows else None

    async def renew(
        self,
        item_id: int,
        *,
        fence: int,
        actor_id: str | None = None,
        lease_seconds: float | None = None,
    ) -> datetime:
        """Set a current claim's lease to end ``lease_seconds`` from now; return the new end.

        The new end replaces the old one (a shorter ``lease_seconds`` shortens the lease).

        Raises:
            FenceRejected: The fence is not current (taken over, finished, never claimed).
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item (or it does not exist).
        """
        op = _backend.RenewOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            self._lease_seconds
            if lease_seconds is None
            else _validate.lease_seconds(lease_seconds),
            _validate.optional_actor(actor_id),
        )
        expires = await (await self._ready()).renew(op)
        return _models.from_timestamp(expires)

    async def finish(
        self,
        item_id: int,
        *,
        fence: int,
        status: str = "done",
        actor_id: str | None = None,
    ) -> None:
        """Settle a current claim as ``"done"`` or ``"failed"``.

        Raises:
            FenceRejected: The fence is not current: the item was taken over after the
                lease lapsed, was finished already, or was never claimed.
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item (or it does not exist).
            InvalidInput: ``status`` is neither "done" nor "failed"; nothing was written.
        """
        op = _backend.FinishOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            _validate.finish_status(status),
            _validate.optional_actor(actor_id),
        )
        await (await self._ready()).finish(op)

    async def counts(self) -> dict[str, int]:
        """How many items are in each state: a dict with every state as a key."""
        found = await (await self._ready()).count_states()
        return {state: found.get(state, 0) for state in _models.ITEM_STATES}

    async def item(self, item_id: int, *, actor_id: str | None = None) -> dict[str, Any]:
        """The item's current row as a dict.

        Keys: item_id, project_id, state, payload, fence, attempts, owner,
        lease_expires_at, created_at, updated_at (times as aware UTC datetimes).

        Raises:
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item; never an empty answer.
        """
        item_id = _validate.item_id(item_id)
        actor = _validate.optional_actor(actor_id)
        row = await (await self._ready()).get_item(item_id, actor)
        return {
            "item_id": row.item_id,
            "project_id": row.project_id,
            "state": row.state,
            "payload": json.loads(row.payload_json),
            "fence": row.fence,
            "attempts": row.attempts,
            "owner": row.owner,
            "lease_expires_at": _optional_time(row.lease_expires_at),
            "created_at": _models.from_timestamp(row.created_at),
            "updated_at": _models.from_timestamp(row.updated_at),
        }

    async def events(self, item_id: int, *, actor_id: str | None = None) -> list[dict[str, Any]]:
        """The item's ledger, oldest first.

        Each event is a dict with event_id, item_id, event_type, fence, owner, actor_id,
        at (an aware UTC datetime) and detail (a dict or None).

        Raises:
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item; never an empty list.
        """
        item_id = _validate.item_id(item_id)
        actor = _validate.optional_actor(actor_id)
        rows = await (await self._ready()).get_events(item_id, actor)
        return [
            {
                "event_id": row.event_id,
                "item_id": row.item_id,
                "event_type": row.event_type,
                "fence": row.fence,
                "owner": row.owner,
                "actor_id": row.actor_id,
                "at": _models.from_timestamp(row.at),
                "detail": None if row.detail_json is None else json.loads(row.detail_json),
            }
            for row in rows
        ]


def _optional_time(value: float | None) -> datetime | None:
    return None if value is None else _models.from_timestamp(value)


def _project_dict(row: _backend.ProjectRow) -> dict[str, Any]:
    return {
        "project_id": row.project_id,
        "name": row.name,
        "status": row.status,
        "created_at": _models.from_timestamp(row.created_at),
    }


def _claimed_item(row: _backend.ClaimRow) -> ClaimedItem:
    return ClaimedItem(
        item_id=row.item_id,
        project_id=row.project_id,
        payload=json.loads(row.payload_json),
        fence=row.fence,
        attempts=row.attempts,
        lease_expires_at=_models.from_timestamp(row.lease_expires_at),
        owner=row.owner,
    )
