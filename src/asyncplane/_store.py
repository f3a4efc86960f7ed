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
import inspect
import json
import logging
import os
import time
import types
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from asyncplane import (
    _backend,
    _clock,
    _engine,
    _errors,
    _models,
    _retention,
    _rules,
    _schedule,
    _tasks,
    _telemetry,
    _validate,
    _wakeups,
    _write_queue,
)
from asyncplane._clock import Clock
from asyncplane._models import ClaimedItem, Job
from asyncplane._retention import PurgeSummary

if TYPE_CHECKING:
    import pathlib
    import random

    from asyncplane._import import ImportSummary

__all__ = ("ControlStore", "engine_of", "log_fields")

_T = TypeVar("_T")

_log = logging.getLogger("asyncplane.store")

#: The most rows one page of `ControlStore.items` returns.
MAX_LIST_LIMIT = 10_000


class ControlStore:
    """A durable work store on one SQLite file (or one PostgreSQL schema), shared by
    coroutines and processes.

    Args:
        path: The database file; created, with its schema, on first use. A
            ``postgresql://`` URL instead selects the PostgreSQL backend (the ``postgres``
            extra): the store lives in the URL's ``search_path`` schema, which must exist.
        lease_seconds: How long a claim stays exclusively its owner's before another
            worker may take it over (int or float seconds, at most 366 days).
        clock: Where "now" comes from; `asyncplane.testing.ManualClock` in tests. By
            default the wall clock, or on PostgreSQL the database server's clock.
        synchronous: ``"NORMAL"`` (the default: durable against process crashes, a power
            loss may undo the last commits) or ``"FULL"`` (also durable against power loss).
            SQLite only; a PostgreSQL server has its own settings.
        busy_timeout: Seconds a write waits for the database's write lock, held by another
            connection (another process, or another store on the same file), before it
            fails with DatabaseLocked (at most a day). On PostgreSQL: how long to wait
            for a connection.
        max_payload_bytes: The largest payload accepted, in bytes of compact JSON.
        max_result_bytes: The largest result finish() accepts, in bytes of compact JSON.
        identity: Payload keys whose values identify an item's content: an item enqueued
            without a fingerprint gets one derived from them (see `asyncplane.fingerprint`).
            Leave out fields that only choose the executor (a model, a lane).
        max_attempts: How many claims an item may have in all unless it says otherwise
            (None: no limit). A retry or a lapsed lease past the last attempt fails it.
        retry_backoff: The first retry's delay in seconds, before jitter; each later one
            doubles, and each is jittered (x0.5 to x1.5) ...
        retry_backoff_max: ... and capped at this many seconds.
        rng: The random source of the jitter (seeded in tests).
        retention: How long settled (done, failed, cancelled) items stay before `purge` archives
            and deletes them (a timedelta or seconds; None: drain() and work() never purge).
        archive_path: Where purged items are appended (default: beside the database,
            ``<database>.archive.jsonl``; a PostgreSQL store has no default).
        archive_max_mb: The archive rotates to a single ``.1`` generation past this size.
        purge_chunk: Items archived and deleted per transaction.
        purge_min_interval_s: drain() and work() purge at most this often (seconds).
        max_batch: The most requests one group commit may carry.
        read_connections: How many read-only connections reads may use at once.
        read_only: Open for reading only: no write connection, no migration, nothing
            written to the file; every write call raises ReadOnlyStore. The file must be
            a store of this release's schema.

    Constructing a store does no I/O; it opens on first use or on ``await store.open()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lease_seconds: float = 900,
        clock: Clock | None = None,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout: float = 30.0,
        max_payload_bytes: int = 1 << 20,
        max_result_bytes: int = 64 * 1024,
        identity: Sequence[str] | None = None,
        max_attempts: int | None = None,
        retry_backoff: float = 1.0,
        retry_backoff_max: float = 300.0,
        rng: random.Random | None = None,
        retention: timedelta | float | None = None,
        archive_path: str | os.PathLike[str] | None = None,
        archive_max_mb: float = 64.0,
        purge_chunk: int = 500,
        purge_min_interval_s: float = 3600.0,
        max_batch: int = 256,
        read_connections: int = 2,
        read_only: bool = False,
    ) -> None:
        location = _validate.path_text(path, "path")
        if location == ":memory:":
            raise _errors.InvalidInput(
                "an asyncplane store is a file shared by connections; ':memory:' cannot be shared"
            )
        if not isinstance(synchronous, str) or synchronous not in ("NORMAL", "FULL"):
            raise _errors.InvalidInput(
                f"synchronous must be 'NORMAL' or 'FULL', got {_validate.shown(synchronous)}"
            )
        if clock is not None and not isinstance(clock, _clock.Clock):
            raise _errors.InvalidType("clock must have a now() method returning epoch seconds")
        is_url = _engine.is_postgres_url(location)
        if is_url:
            _engine.checked_url(str(location))
        # Absolute from the start, so a later chdir cannot move the store; the file itself
        # by its links resolved (`path`), named as given (`location`).
        self._path = None if is_url else _validate.resolved_path(location, "path")
        self._given = None if is_url else str(_validate.absolute_path(location, "path"))
        self._lease_seconds = _validate.lease_seconds(lease_seconds)
        self._synchronous: Literal["NORMAL", "FULL"] = synchronous
        self._busy_timeout = _validate.seconds(
            busy_timeout, "busy_timeout", _validate.MAX_BUSY_TIMEOUT
        )
        self._max_payload_bytes = _validate.positive_int(max_payload_bytes, "max_payload_bytes")
        self._max_result_bytes = _validate.positive_int(max_result_bytes, "max_result_bytes")
        self._identity = _validate.identity(identity)
        self._max_attempts = _validate.optional_positive_int(max_attempts, "max_attempts")
        self._retry_backoff = _validate.delay(retry_backoff, "retry_backoff")
        self._retry_backoff_max = _validate.delay(retry_backoff_max, "retry_backoff_max")
        if self._retry_backoff_max < self._retry_backoff:
            raise _errors.InvalidInput("retry_backoff_max must not be below retry_backoff")
        if rng is not None and not callable(getattr(rng, "random", None)):
            raise _errors.InvalidType("rng must have a random() method, like random.Random")
        if rng is None:
            import random  # the jitter's source, made with the first store

            rng = random.Random()
        self._rng = rng
        self._retention = None if retention is None else _validate.duration(retention, "retention")
        if archive_path is not None:
            self._archive_path: pathlib.Path | None = _validate.resolved_path(
                archive_path, "archive_path"
            )
        elif self._path is not None:
            self._archive_path = _retention.default_archive_path(self._path)
        elif self._retention is not None:
            raise _errors.InvalidInput(
                "a PostgreSQL store has no file to put its archive beside: "
                "retention needs archive_path"
            )
        else:
            self._archive_path = None
        self._archive_max_bytes = _validate.megabytes(archive_max_mb, "archive_max_mb")
        self._purge_chunk = _validate.positive_int(purge_chunk, "purge_chunk")
        self._purge_min_interval = _validate.delay(purge_min_interval_s, "purge_min_interval_s")
        self._engine = _engine.Engine(
            location if self._path is None else str(self._path),
            _engine.Options(
                clock=clock,
                synchronous=synchronous,
                busy_timeout=self._busy_timeout,
                max_batch=_validate.positive_int(max_batch, "max_batch"),
                read_connections=_validate.read_connections(read_connections),
                read_only=_validate.boolean(read_only, "read_only"),
                identity=self._identity,
                max_payload_bytes=self._max_payload_bytes,
                max_attempts=self._max_attempts,
                retention=self._retention,
                archive_path=self._archive_path,
                archive_max_bytes=self._archive_max_bytes,
                purge_chunk=self._purge_chunk,
                purge_min_interval=self._purge_min_interval,
            ),
        )
        self._engine.backend.on_orphaned(self._given_back, self._tally)

    def __repr__(self) -> str:
        state = "open" if self._engine.is_open else "closed"
        return f"<ControlStore {self.location!r} {state}>"

    # --- configuration -------------------------------------------------------------------

    @property
    def path(self) -> pathlib.Path:
        """The database file, its links resolved (InvalidInput on a PostgreSQL store,
        which has none)."""
        if self._path is None:
            raise _errors.InvalidInput("a PostgreSQL store has no file: see location")
        return self._path

    @property
    def location(self) -> str:
        """The database file's absolute path as given (`path` is the file it leads to,
        its links resolved), or the PostgreSQL URL without its password."""
        return self._engine.location if self._given is None else self._given

    @property
    def archive_path(self) -> pathlib.Path | None:
        """Where purge() appends archived items by default (None: a PostgreSQL store
        configured without one, which must pass archive_path to purge)."""
        return self._archive_path

    @property
    def backend(self) -> Literal["sqlite", "postgresql"]:
        """Which database holds the store."""
        return "sqlite" if self._path is not None else "postgresql"

    @property
    def read_only(self) -> bool:
        """Whether the store was opened for reading only (every write raises ReadOnlyStore)."""
        return self._engine.options.read_only

    @property
    def lease_seconds(self) -> float:
        """The default lease length, in seconds."""
        return self._lease_seconds

    @property
    def clock(self) -> Clock:
        """The clock leases and events are measured by (the one given, if any)."""
        given = self._engine.options.clock
        return given if given is not None else self._engine.clock

    @property
    def identity(self) -> tuple[str, ...]:
        """The payload keys fingerprints are derived from (empty: none)."""
        return self._identity

    @property
    def max_attempts(self) -> int | None:
        """The default attempt budget of new items (None: no limit)."""
        return self._max_attempts

    @property
    def synchronous(self) -> Literal["NORMAL", "FULL"]:
        """The SQLite synchronous level of the write connection."""
        return self._synchronous

    # --- lifecycle -----------------------------------------------------------------------

    async def open(self) -> ControlStore:
        """Open the database (creating or migrating its schema); idempotent."""
        await self._engine.ready()
        return self

    async def close(self) -> None:
        """Finish every queued write, then release all connections; idempotent.

        Writes queued before the close are served; reads still waiting for a read
        connection when it begins are refused with StoreClosed. Calls made once the close
        has begun wait for it to finish, then open the store again. A closed store may be
        opened again, on any event loop. On PostgreSQL, once the queued writes are served,
        it sends the wake-ups this store owes other processes for twins it added while
        another store settled their twin, waiting up to a few seconds for that settle
        (docs/architecture.md, "What a fingerprint costs the fleet").
        """
        await self._engine.close()

    async def __aenter__(self) -> ControlStore:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.close()

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
        await (await self._engine.ready()).create_project(op)

    async def set_project_status(
        self, project_id: str, status: str, *, if_status: str | Collection[str] | None = None
    ) -> str:
        """Change a project's status; return its status afterwards.

        With ``if_status`` (a status, or several) a project in none of them is left as it
        is, and its status returned: an operator acting on what a page showed a while ago
        does not resume a project closed since (the read and the change are one write).

        Raises:
            UnknownProject: No such project.
        """
        op = _backend.ProjectStatusOp(
            _validate.text_id(project_id, "project_id"),
            _validate.project_status(status),
            _validate.project_statuses(if_status, "if_status"),
        )
        return await self._freeing(op, (await self._engine.ready()).set_project_status(op))

    async def project(self, project_id: str) -> dict[str, Any]:
        """A project as a dict: project_id, name, status, created_at."""
        project_id = _validate.text_id(project_id, "project_id")
        row = await (await self._engine.ready()).get_project(project_id)
        return _project_dict(row)

    async def projects(self) -> list[dict[str, Any]]:
        """Every project, ordered by id."""
        return [_project_dict(row) for row in await (await self._engine.ready()).list_projects()]

    async def assign(self, project_id: str, actor_id: str) -> None:
        """Let an actor see and work on a project (idempotent)."""
        op = _backend.AssignOp(
            _validate.text_id(project_id, "project_id"), _validate.text_id(actor_id, "actor_id")
        )
        # A claim waiting for that actor may have work now.
        await self._freeing(op, (await self._engine.ready()).assign(op))

    async def unassign(self, project_id: str, actor_id: str) -> None:
        """Take a project away from an actor (idempotent)."""
        project_id = _validate.text_id(project_id, "project_id")
        actor_id = _validate.text_id(actor_id, "actor_id")
        await (await self._engine.ready()).unassign(project_id, actor_id)

    async def visible_projects(self, actor_id: str) -> list[str]:
        """The ids of the projects an actor is assigned to, in order."""
        actor_id = _validate.text_id(actor_id, "actor_id")
        return await (await self._engine.ready()).visible_projects(actor_id)

    # --- items ---------------------------------------------------------------------------

    async def enqueue(
        self,
        project_id: str,
        payload: Mapping[str, Any],
        *,
        priority: int = 0,
        service_class: str = "standard",
        sla: datetime | float | None = None,
        fingerprint: str | None = None,
        dedup: bool = True,
        max_attempts: int | None = None,
        not_before: datetime | float | None = None,
        actor_id: str | None = None,
    ) -> int:
        """Add an item to a project's queue and return its id.

        With ``dedup`` and a fingerprint (given, or derived from the store's ``identity``),
        an item whose twin (same project, same fingerprint, not failed) exists already is
        not added: its twin's id comes back instead, a done twin's first.

        Args:
            project_id: The project; without ``actor_id`` any existing project.
            payload: A JSON object (a dict, or any mapping, of plain JSON values), at most
                ``max_payload_bytes`` of compact JSON.
            priority: Higher is claimed first (a 32-bit int).
            service_class: "realtime" is claimed before "standard" at equal priority.
            sla: A deadline (aware datetime or epoch seconds); earliest first, none last.
            fingerprint: The item's content identity (see `asyncplane.fingerprint`).
            dedup: Reuse a twin's id (True), or add an independent row that still keeps
                its fingerprint (False).
            max_attempts: How many claims it may have in all (None: the store's default).
            not_before: Not claimable before this time (the item waits as "deferred").
            actor_id: Act as this actor: the project must be assigned to it.

        Raises:
            UnknownProject: No such project (control plane only).
            ScopeDenied: The actor may not see the project (or it does not exist).
            InvalidPayload: The payload is not plain JSON, or too large.
            InvalidInput: A value out of range: an unknown service class, a priority
                beyond 32 bits, a naive datetime or an impossible time, an empty
                fingerprint, a max_attempts below 1.
            InvalidType: An argument of the wrong type.

        A reused twin keeps its own lane settings: this call's priority, SLA, attempt
        budget and not_before apply only to a new row.
        """
        job = _models.Job(
            payload, priority, service_class, sla, fingerprint, max_attempts, not_before
        )
        project = _validate.text_id(project_id, "project_id")
        item = self._engine.new_item(job, _validate.boolean(dedup, "dedup"))
        actor = _validate.optional_actor(actor_id)
        ids = await self._enqueue(project, (item,), actor)
        return ids[0]

    async def enqueue_many(
        self,
        project_id: str,
        jobs: Iterable[Mapping[str, Any] | Job],
        *,
        dedup: bool = True,
        actor_id: str | None = None,
    ) -> list[int]:
        """Add many items in one transaction; return their ids in input order.

        Each job is a payload (a dict, or any mapping) or a `Job` with its own lane
        settings. Every job is
        checked before anything is written: one bad job refuses the whole call. With
        ``dedup``, jobs with the same fingerprint share one id, and a job whose twin is
        in the store already gets the twin's id (as for `enqueue`).
        """
        project = _validate.text_id(project_id, "project_id")
        same = _validate.boolean(dedup, "dedup")
        if isinstance(jobs, (str, bytes, Mapping)) or not isinstance(jobs, Iterable):
            raise _errors.InvalidType("jobs must be an iterable of payload dicts or Jobs")
        items = []
        for position, job in enumerate(jobs):
            if isinstance(job, _models.Job):
                spec = job
            elif isinstance(job, Mapping):
                spec = _models.Job(job)
            else:
                raise _errors.InvalidType(
                    f"jobs[{position}] must be a payload dict or a Job, not {type(job).__name__}"
                )
            try:
                items.append(self._engine.new_item(spec, same))
            except _errors.AsyncplaneError as exc:
                raise type(exc)(f"jobs[{position}]: {exc}") from None
        return await self._enqueue(project, tuple(items), _validate.optional_actor(actor_id))

    async def _enqueue(
        self, project: str, items: tuple[_backend.NewItem, ...], actor: str | None
    ) -> list[int]:
        """Write checked items, inside the enqueue span whose context they keep."""
        backend = await self._engine.ready()
        with _telemetry.enqueue_span(project, len(items)) as trace_context:
            if trace_context is not None:
                items = tuple(item._replace(trace_context=trace_context) for item in items)
            op = _backend.EnqueueOp(project, items, actor)
            enqueuing = backend.enqueue(op)
            try:
                ids = await enqueuing
            except asyncio.CancelledError:
                # Cancelled while the round ran, the writer tells (`Writes.orphaned`); once
                # the answer was in, its future holds it. Either way the items stand.
                if _write_queue.has_answer(enqueuing):
                    _write_queue.tell(self._tally, op, enqueuing.result())
                raise
        self._engine.notify()
        _telemetry.enqueued(project, len(items))
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("enqueued %d item(s) into %s: %s", len(ids), project, ids[:20])
        return ids

    async def claim(
        self,
        owner: str,
        *,
        actor_id: str | None = None,
        project_id: str | None = None,
        lease_seconds: float | None = None,
        wait: float | None = None,
        poll_interval: float = 0.1,
    ) -> ClaimedItem | None:
        """Claim the next available item for ``owner``, or return None if there is none.

        With ``wait``, a claim that finds nothing waits up to that many seconds for
        claimable work (an enqueue here or in another process, a retry falling due, a
        lease lapsing, a release) before it returns None; it sleeps on the store's own
        wake-ups (`asyncplane._wakeups`), never polling the queue.

        Available means: ready; or deferred (retried, parked, enqueued with not_before)
        and fallen due; or claimed by someone whose lease has lapsed (a takeover, recorded
        as a ``lease_expired`` event). Only in a project whose status is ``"open"`` and,
        with ``actor_id``, assigned to that actor; never an item whose content twin is
        claimed right now. The next one is the one with the highest priority, then
        realtime before standard, then the earliest SLA (none last), then the oldest.
        A project with limits (`set_limits`) gives no more than they leave: a claim that
        meets them takes what other projects have, or returns None; ``wait`` then sleeps
        until a slot frees or a token is back.

        The claim is decided and recorded in one write transaction, so an item goes to
        exactly one caller; its fence is above every earlier fence of the item. A call
        cancelled after its transaction took an item (a timeout, say) gives the item
        back at once (as `release` does), rather than leaving it to its lease.

        Args:
            owner: Who is claiming (a worker name); recorded on the item and its events.
            actor_id: Act as this actor: claim only from its assigned projects.
            project_id: Claim only from this project.
            lease_seconds: This claim's lease length instead of the store's default.
            wait: Seconds to wait for work when there is none now (None: do not wait).
            poll_interval: Seconds between looks for other processes' commits while
                waiting, on SQLite.
        """
        limit = None if wait is None else _validate.seconds(wait, "wait", 10.0**7)
        poll = _validate.seconds(poll_interval, "poll_interval", 3600.0)  # used or not
        if limit is None:
            claims = await self.claim_batch(
                owner, 1, actor_id=actor_id, project_id=project_id, lease_seconds=lease_seconds
            )
            return claims[0] if claims else None
        deadline = asyncio.get_running_loop().time() + limit
        await self._engine.ready()
        closes = self._engine.closes
        past = _wakeups.PastDue()
        while True:
            claims, closed = await self._claim_or_wait(
                owner, 1, actor_id, project_id, lease_seconds, poll,
                deadline - asyncio.get_running_loop().time(), None, closes, past,
            )  # fmt: skip
            if claims:
                return claims[0]
            if closed or asyncio.get_running_loop().time() >= deadline:
                return None  # out of time, or the store was closed meanwhile

    async def claims(
        self,
        owner: str,
        *,
        actor_id: str | None = None,
        project_id: str | None = None,
        lease_seconds: float | None = None,
        stop: asyncio.Event | None = None,
        poll_interval: float = 0.1,
    ) -> AsyncIterator[ClaimedItem]:
        """Claim item after item, waiting for work in between; for ``async for``.

        Each claim is the one `claim` would make; when there is none the iterator waits
        on the store's wake-ups (no polling of the queue) and claims again. It ends when
        the store is closed, or ``stop`` is set. Settle each claim before asking for the
        next one, or it stays claimed until its lease lapses.
        """
        poll = _validate.seconds(poll_interval, "poll_interval", 3600.0)
        if stop is not None and not isinstance(stop, asyncio.Event):
            raise _errors.InvalidType(f"stop must be an asyncio.Event, not {type(stop).__name__}")
        await self._engine.ready()
        closes = self._engine.closes
        past = _wakeups.PastDue()
        while (stop is None or not stop.is_set()) and self._engine.closes == closes:
            found, closed = await self._claim_or_wait(
                owner, 1, actor_id, project_id, lease_seconds, poll, None, stop, closes, past
            )
            if closed:
                return
            for claim in found:
                yield claim

    async def _claim_or_wait(
        self,
        owner: str,
        limit: int,
        actor_id: str | None,
        project_id: str | None,
        lease_seconds: float | None,
        poll: float,
        timeout: float | None,
        stop: asyncio.Event | None = None,
        closes: int | None = None,
        past: _wakeups.PastDue | None = None,
    ) -> tuple[list[ClaimedItem], bool]:
        """One claim of up to ``limit`` items; if it found none, one sleep until work may
        be claimable (or ``timeout``, or ``stop``; ``past``: the waiting loop's memory of
        a past due time, see `asyncplane._wakeups.PastDue`). Returns the claims, and
        whether the store was closed since ``closes`` (the waiter should end)."""
        engine = self._engine
        local = engine.watch()
        try:
            version = await engine.data_version()  # before the claim: nothing slips by
            if closes is not None and engine.closes != closes:
                return [], True  # closed during the read: a claim now would open it again
            # Cancelled, claim_batch gives back what its round took, not leaving it to
            # its lease.
            found = await self.claim_batch(
                owner, limit, actor_id=actor_id, project_id=project_id,
                lease_seconds=lease_seconds,
            )  # fmt: skip
            if found or (timeout is not None and timeout <= 0):
                return found, False
            await _wakeups.until_work(
                engine, local, version, poll_interval=poll, project_id=project_id,
                actor_id=actor_id, stop=stop, timeout=timeout, past=past,
            )  # fmt: skip
        except _errors.StoreClosed:
            # Closed under any of its reads, its claim or its wait (`closes` rises before
            # the connections go): the waiter ends, as it would have on waking. (A claim
            # the close refused took nothing: its round never ran.)
            if closes is None or engine.closes == closes:
                raise
        finally:
            engine.unwatch(local)
        return [], closes is not None and engine.closes != closes

    async def claim_batch(
        self,
        owner: str,
        limit: int,
        *,
        actor_id: str | None = None,
        project_id: str | None = None,
        lease_seconds: float | None = None,
    ) -> list[ClaimedItem]:
        """Claim up to ``limit`` items at once, each with its own fence, in claim order.

        As `claim`, in one transaction; a batch takes at most one item per fingerprint.
        """
        op = self._claim_op(owner, limit, actor_id, project_id, lease_seconds)
        backend = await self._engine.ready()
        started = time.perf_counter()
        claiming = backend.claim(op)
        try:
            rows = await claiming
        except asyncio.CancelledError:
            # Cancelled with the answer already in (its round done, this call not yet
            # resumed): nobody will run what it took. A cancel while the round ran is
            # seen by the writer instead (`Writes.orphaned`).
            _give_back_now(backend, _answer_of(claiming) or [], op.actor_id, unseen=True)
            raise
        return await self._claimed(backend, op, rows, started)

    def _claim_op(
        self,
        owner: str,
        limit: int,
        actor_id: str | None,
        project_id: str | None,
        lease_seconds: float | None,
    ) -> _backend.ClaimOp:
        """A claim's arguments, checked (InvalidInput before anything is written)."""
        return _backend.ClaimOp(
            _validate.text_id(owner, "owner"),
            _validate.positive_int(limit, "limit"),
            self._lease_seconds
            if lease_seconds is None
            else _validate.lease_seconds(lease_seconds),
            _validate.optional_actor(actor_id),
            None if project_id is None else _validate.text_id(project_id, "project_id"),
        )

    async def _claimed(
        self,
        backend: _backend.Backend,
        op: _backend.ClaimOp,
        rows: list[_backend.ClaimRow],
        started: float,
    ) -> list[ClaimedItem]:
        """The items a claim asked for at ``started`` took, counted, as callers get them."""
        claims: list[ClaimedItem] = []
        if _telemetry.ENABLED:
            seconds = time.perf_counter() - started
            _telemetry.claimed(rows, backend.clock.now(), seconds, self.backend)
        for index, row in enumerate(rows):
            try:
                payload = _models.loads(row.payload_json)
            except (ValueError, RecursionError) as exc:
                # Committed, but its payload cannot be decoded here (written before today's
                # limits, or by a tamperer): settle it with the reason instead of handing
                # the caller an exception that would strand the rest of the batch. The
                # retry reaches its end even if this call is cancelled meanwhile; then the
                # rest of the batch, which the caller will never see, goes back.
                kept = {claim.item_id for claim in claims}
                rest = [r for r in rows[:index] if r.item_id in kept] + rows[index + 1 :]
                try:
                    _, cut = await _tasks.to_the_end(
                        self._set_aside(backend, row, op.actor_id, exc), "asyncplane-set-aside"
                    )
                except asyncio.CancelledError:  # and the set-aside failed, or was cut too
                    _give_back_now(backend, rest, op.actor_id)
                    raise
                if cut:
                    _give_back_now(backend, rest, op.actor_id)
                    raise asyncio.CancelledError from exc
                continue
            claims.append(_claimed_item(row, payload))
        return claims

    async def _set_aside(
        self, backend: _backend.Backend, row: _backend.ClaimRow, actor: str | None, exc: Exception
    ) -> None:
        """Retry (within its budget) a claimed item whose payload this process cannot decode."""
        reason = f"its payload cannot be decoded: {type(exc).__name__}: {str(exc)[:200]}"
        op = _backend.RetryOp(
            row.item_id, row.fence, actor, reason, None,
            self._retry_backoff, self._retry_backoff_max, self._rng.random(),
        )  # fmt: skip
        try:
            state = await backend.retry(op)
        except _errors.AsyncplaneError as failure:  # its lease lapses; a later claim tries again
            _log.warning(
                "asyncplane: item %d could not be set aside: %s", row.item_id, failure,
                extra=log_fields(row),
            )  # fmt: skip
        else:
            _log.warning(
                "asyncplane: item %d retried: %s", row.item_id, reason, extra=log_fields(row)
            )
            self._tally(op, state)  # counted as any retry, no caller waiting

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
        expires = await self._settle(op, (await self._engine.ready()).renew(op))
        return _models.from_timestamp(expires)

    async def finish(
        self,
        item_id: int,
        *,
        fence: int,
        status: str = "done",
        result: Any = None,
        error: str | None = None,
        actor_id: str | None = None,
    ) -> None:
        """Settle a current claim (or an offloaded item) as ``"done"`` or ``"failed"``.

        A done item keeps ``result`` (any JSON value, at most ``max_result_bytes``), and
        its pending twins (same project and fingerprint, enqueued with dedup) become done
        with it, each with a copy of the result. A failed item keeps ``error``: a
        deterministic failure fails fast, whatever attempts remain (use `retry` for a
        transient one).

        Raises:
            FenceRejected: The fence is not current: the item was taken over after the
                lease lapsed, was settled already, or was never claimed.
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item (or it does not exist).
            InvalidInput: ``status`` is neither "done" nor "failed", or the result is too
                large or not JSON; nothing was written and the claim stays valid.
        """
        op = self._finish_op(item_id, fence, status, result, error, actor_id)
        twins = await self._settle(op, (await self._engine.ready()).finish(op))
        _telemetry.dedup_settled(twins, "settlement")
        self._engine.notify()  # a settled item frees its waiting twins

    async def finish_and_claim(
        self,
        item_id: int,
        *,
        fence: int,
        owner: str,
        status: str = "done",
        result: Any = None,
        error: str | None = None,
        actor_id: str | None = None,
        project_id: str | None = None,
        lease_seconds: float | None = None,
    ) -> ClaimedItem | None:
        """Settle a current claim as `finish` does, then claim the next item for ``owner``
        as `claim` does (without ``wait``): the next item, or None if there is none.

        On SQLite the two go to the writer together and run in one write round, the
        settle first (so a project's ``max_running`` sees the settled item gone): a worker
        that loops claim, run, settle pays one write transaction per item instead of two.
        On PostgreSQL, where a settle or a claim alone is one statement that commits by
        itself, the claim follows the settle in a round of its own. ``actor_id`` is both
        calls' actor; ``project_id`` and ``lease_seconds`` are the claim's.

        An error raised means what it means for `finish` (the settle was refused or not
        written, or for CommitOutcomeUnknown may be saved), and the call holds nothing: a
        claim in the settle's round runs only if the settle is not refused (the two commit
        together). Should the two have gone in different rounds (a round cut at its size
        limit), an item the claim took is given back first (`release`: ready again, its
        attempt refunded); that claim's own effects then stand (a ``per_minute`` token it
        spent, a lapsed lease it took over). After
        CommitOutcomeUnknown the claim's outcome is as unknown as the settle's: a claim it
        saved is left to its lease. Cancelled, the call gives back
        whatever its claim took, too (a claim still queued is dropped, never written).
        One error is different: ClaimAfterSettleFailed says
        the settle was saved and the claim then failed (its cause says why).

        Raises:
            FenceRejected: The settle's fence is not current (as for `finish`).
            ClaimAfterSettleFailed: The settle was saved; the claim made with it failed.
            InvalidInput: Either call's arguments, before anything is written.
        """
        settle = self._finish_op(item_id, fence, status, result, error, actor_id)
        claim = self._claim_op(owner, 1, actor_id, project_id, lease_seconds)
        backend = await self._engine.ready()
        started = time.perf_counter()
        # Where rounds are dear the claim rides in the settle's round, run only if the
        # settle is not refused; elsewhere it is asked once the settle is done.
        finishing, claiming = backend.finish_then_claim(settle, claim)
        try:
            twins = await self._settle(settle, finishing)
        except Exception as exc:
            # Refused: a claim in the settle's round was not run (NotRun); one cut into the
            # next round is given back.
            if claiming is not None:
                _, cancelled = await _tasks.to_the_end(
                    self._give_back(backend, claiming, claim.actor_id), "asyncplane-give-back"
                )
                if cancelled:
                    raise asyncio.CancelledError from exc  # the refusal is moot now
            raise
        except BaseException:  # cancelled: nobody will wait for the claim
            if claiming is not None:
                _drop_claim(backend, claiming, claim.actor_id)
            raise
        _telemetry.dedup_settled(twins, "settlement")
        self._engine.notify()  # a settled item frees its waiting twins
        if claiming is None:
            started = time.perf_counter()  # the claim's latency is its own round's
            try:
                claiming = backend.claim(claim)
            except Exception as exc:
                raise _claim_failed(settle.item_id, exc) from exc
        try:
            rows = await claiming
        except asyncio.CancelledError:
            # As in claim_batch: a cancel while the round ran is seen by the writer
            # (`Writes.orphaned`), one after it by the answer found here; either way what
            # the claim took goes back.
            _give_back_now(backend, _answer_of(claiming) or [], claim.actor_id, unseen=True)
            raise
        except Exception as exc:
            raise _claim_failed(settle.item_id, exc) from exc
        claims = await self._claimed(backend, claim, rows, started)
        return claims[0] if claims else None

    def _finish_op(
        self,
        item_id: int,
        fence: int,
        status: str,
        result: Any,
        error: str | None,
        actor_id: str | None,
    ) -> _backend.FinishOp:
        """A finish's arguments, checked (InvalidInput before anything is written)."""
        status = _validate.finish_status(status)
        if status == "done" and error is not None:
            raise _errors.InvalidInput("error goes with status='failed'; a done item has none")
        if status == "failed" and result is not None:
            raise _errors.InvalidInput("result goes with status='done'; a failed item has none")
        return _backend.FinishOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            status,
            _validate.optional_actor(actor_id),
            None if result is None else _validate.encode_result(result, self._max_result_bytes),
            _validate.error_text(error),
        )

    async def _give_back(
        self,
        backend: _backend.Backend,
        claiming: _write_queue.Pending[list[_backend.ClaimRow]],
        actor_id: str | None,
    ) -> None:
        """The claim asked for with a settle that did not go through: whatever it took is
        given back (`release`); one that never reached the writer is dropped."""
        if inspect.iscoroutine(claiming):  # not queued yet (see Writer.submit): nothing to undo
            claiming.close()
            return
        try:
            rows = await claiming
        except Exception:  # it took nothing (or, CommitOutcomeUnknown, nothing known)
            return
        await self._release_rows(backend, rows, actor_id)

    def _given_back(self, row: _backend.ClaimRow, error: BaseException | None) -> None:
        """A give-back of an item claimed for a caller that went away (a `claim` in
        ``asyncio.wait_for`` that timed out, say: `Writes.orphaned`) landed, or failed:
        that item then waits out its lease, as before."""
        if error is None:  # counted as any release, and claimable again, here and now
            self._tally(_backend.ReleaseOp(row.item_id, row.fence, None), None)
        elif isinstance(error, _errors.FenceRejected):  # taken over meanwhile: not ours
            _telemetry.refused(isinstance(error, _errors.ItemCancelled))
        else:
            _log.warning(
                "asyncplane: item %d, claimed for a call that was cancelled, could not be "
                "given back: %s", row.item_id, error, extra=log_fields(row),
            )  # fmt: skip

    async def _release_rows(
        self,
        backend: _backend.Backend,
        rows: Sequence[_backend.ClaimRow],
        actor_id: str | None,
    ) -> None:
        """Give back claims nobody will run, through the backend that made them (never
        opening a store closed meanwhile); one that cannot be is left to its lease."""
        for row in rows:
            try:
                op = _backend.ReleaseOp(row.item_id, row.fence, actor_id)
                await self._settle(op, backend.release(op))
                self._engine.notify()  # claimable again, here and now
            except _errors.AsyncplaneError as exc:  # its lease lapses; a later claim takes it
                _log.warning(
                    "asyncplane: item %d, claimed for a call that did not take it, could "
                    "not be given back: %s", row.item_id, exc, extra=log_fields(row),
                )  # fmt: skip
        _telemetry.taken_unseen(rows, backend.clock.now)  # claimed, though no caller saw them

    async def retry(
        self,
        item_id: int,
        *,
        fence: int,
        error: str | None = None,
        delay: float | None = None,
        actor_id: str | None = None,
    ) -> str:
        """Settle a transient failure: defer the item for another attempt, if any is left.

        While attempts remain the item becomes "deferred" until ``delay`` seconds from now
        (default: exponential backoff from ``retry_backoff`` seconds, doubling with each
        attempt up to ``retry_backoff_max``, with jitter); otherwise it fails, with the
        reason recorded. Returns the item's new state, "deferred" or "failed".

        Raises:
            FenceRejected: The fence is not current (as for `finish`).
        """
        op = _backend.RetryOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            _validate.optional_actor(actor_id),
            _validate.error_text(error),
            None if delay is None else _validate.delay(delay, "delay"),
            self._retry_backoff,
            self._retry_backoff_max,
            self._rng.random(),
        )
        state = await self._settle(op, (await self._engine.ready()).retry(op))
        self._engine.notify()  # it may be due at once, or settle a twin's wait
        return state

    async def park(
        self, item_id: int, *, fence: int, delay: float, actor_id: str | None = None
    ) -> None:
        """Set a claimed item aside for ``delay`` seconds without spending an attempt.

        For capacity saturation: the work did not fail, there was no room to run it. The
        item becomes "deferred" and its claim's attempt is given back.

        Raises:
            FenceRejected: The fence is not current, or the item is not claimed.
        """
        op = _backend.ParkOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            _validate.optional_actor(actor_id),
            _validate.delay(delay, "delay"),
        )
        await self._settle(op, (await self._engine.ready()).park(op))
        self._engine.notify()

    async def release(self, item_id: int, *, fence: int, actor_id: str | None = None) -> None:
        """Give a current claim back unrun: the item is ready again at once, and the
        claim's attempt is given back (a "released" event).

        For a worker stopping before it could run (or finish) the item: another worker
        takes it now instead of after the lease lapses; its next claim raises the fence,
        so a late report at this fence is refused.

        Raises:
            FenceRejected: The fence is not current, or the item is not claimed.
        """
        op = _backend.ReleaseOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            _validate.optional_actor(actor_id),
        )
        await self._settle(op, (await self._engine.ready()).release(op))
        self._engine.notify()  # claimable again, here and now

    async def offload(
        self, item_id: int, *, fence: int, handle: str, actor_id: str | None = None
    ) -> None:
        """Hand a claimed item to an external batch identified by ``handle``.

        An offloaded item is never claimable and never reclaimed by a lapsed lease, so it
        cannot also run here and be paid for twice. Settle it later with `finish` or
        `retry` at the same fence; `offloaded` lists a batch's items.

        Raises:
            FenceRejected: The fence is not current, or the item is not claimed.
        """
        op = _backend.OffloadOp(
            _validate.item_id(item_id),
            _validate.positive_int(fence, "fence"),
            _validate.optional_actor(actor_id),
            _validate.text_id(handle, "handle"),
        )
        await self._settle(op, (await self._engine.ready()).offload(op))
        self._engine.notify()  # it frees its project's max_running slot for a waiter

    async def _settle(self, op: Any, call: Awaitable[_T], *, timed: bool = True) -> _T:
        """Await one settle, renew, bulk-chunk or `_freeing` call, counted under the outcome
        its answer names (`_outcome`; none for a renew or a write of `_backend.FREEING`)
        and, if ``timed``, timed; a refused fence is counted as such.
        Cancelled once the answer was in, the settle stands, and is counted all the same
        (`_tally`)."""
        started = time.perf_counter()
        try:
            result = await call
        except _errors.FenceRejected as exc:
            _telemetry.refused(isinstance(exc, _errors.ItemCancelled))
            raise
        except asyncio.CancelledError:
            # Cancelled while the round ran, the writer tells (`Writes.orphaned`); once
            # the answer was in, its future holds it.
            if _write_queue.has_answer(call):  # told, never raised: keep the cancellation
                _write_queue.tell(self._tally, op, call.result())
            raise
        named = _outcome(op, result)
        if named is not None:
            took = time.perf_counter() - started if timed else None
            _telemetry.settled(named, took, self.backend, count=_count(op, result))
        return result

    async def _freeing(self, op: Any, call: Awaitable[_T]) -> _T:
        """Await a write that can free work (`_backend.FREEING`), then wake this process's
        waiting claims. Cancelled once the answer was in, it stands, and wakes them all
        the same, as a settle does (`_settle`, which counts nothing for these)."""
        result = await self._settle(op, call, timed=False)
        self._engine.notify()
        return result

    def _tally(self, op: Any, answer: Any) -> None:
        """A settle, an enqueue or another write that can free work (`_backend.FREEING`)
        saved with no caller's latency to record (its caller went away while it ran,
        `Writes.on_orphaned`, or the store made it itself): counted (a settle under its
        outcome, a finish's dedup twins too, an enqueue's jobs), and this process's waiters
        woken, as that caller would have done."""
        if isinstance(op, _backend.EnqueueOp):
            _telemetry.enqueued(op.project_id, len(op.items))
            self._engine.notify()
            return
        named = _outcome(op, answer)
        if named is not None:
            _telemetry.settled(named, None, self.backend, count=_count(op, answer))
        if isinstance(op, _backend.FinishOp):
            _telemetry.dedup_settled(answer, "settlement")
        self._engine.notify()

    async def offloaded(self, handle: str, *, actor_id: str | None = None) -> list[dict[str, Any]]:
        """The items offloaded to ``handle``, each as `item` returns it (fence included)."""
        rows = await (await self._engine.ready()).offloaded(
            _validate.text_id(handle, "handle"), _validate.optional_actor(actor_id)
        )
        return [_item_dict(row) for row in rows]

    async def dedup_pending_against_done(self, chunk: int = 500) -> int:
        """Preflight dedup: settle pending items whose twin is already done, unrun.

        First, with an ``identity``, fingerprints are filled in for items that have none
        (older enqueuers), ``chunk`` items per transaction. Then every pending (ready or
        deferred) item enqueued with dedup whose twin in the same project is done becomes
        done with a copy of the twin's result, ``chunk`` items per transaction, each with
        a "done" event naming the twin. Returns how many items it settled.

        This is the full pass: it walks the store for twin pairs however they formed.
        The steps drain() and work() take look only at the pairs the store noted as they
        formed (see docs/concepts/lanes.md, "Preflight").
        """
        chunk = _validate.positive_int(chunk, "chunk")
        await self._engine.restart_preflight(chunk)  # a full pass: every item again
        settled = 0
        while True:
            count, more = await self._engine.preflight_step(chunk)
            settled += count
            if not more:
                return settled

    # --- operating --------------------------------------------------------------------------

    async def purge(
        self,
        retention: timedelta | float | None = None,
        *,
        chunk: int | None = None,
        archive_path: str | os.PathLike[str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> PurgeSummary:
        """Archive, then delete, settled items last changed before ``retention``.

        Each chunk of items, with all their events, is appended to the JSONL archive and
        fsynced before the transaction that deletes them commits, so a crash can
        duplicate archive lines but never deletes an item that is not archived. Ready,
        deferred, claimed and offloaded items are never purged.

        Args:
            retention: Keep settled items this long (a timedelta or seconds); default:
                the store's ``retention``.
            chunk: Items per transaction (default: the store's ``purge_chunk``).
            archive_path: The archive (default: the store's ``archive_path``).
            progress: Called with the running total after each chunk.
        """
        if retention is None and self._retention is None:
            raise _errors.InvalidInput("purge needs a retention: pass one, or configure the store")
        seconds = (
            self._retention if retention is None else _validate.duration(retention, "retention")
        )
        assert seconds is not None
        target = (
            self._archive_path
            if archive_path is None
            else _validate.resolved_path(archive_path, "archive_path")
        )
        if target is None:
            raise _errors.InvalidInput(
                "a PostgreSQL store has no file to put its archive beside: pass archive_path"
            )
        size = self._purge_chunk if chunk is None else _validate.positive_int(chunk, "chunk")
        told = _validate.callback(progress, "progress")
        return await _retention.purge(
            await self._engine.ready(),  # once every argument is checked: it may create
            self._engine.clock,
            seconds,
            chunk=size,
            archive_path=target,
            archive_max_bytes=self._archive_max_bytes,
            progress=told,
        )

    async def import_pending(
        self,
        source_path: str | os.PathLike[str],
        *,
        table: str,
        columns: Mapping[str, str],
        project_id: str | None = None,
        pending: Collection[Any] | None = None,
        drop_source: bool = False,
        chunk: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> ImportSummary:
        """Copy the pending rows of a table in another SQLite database into this store, once.

        Only rows that are not terminal are copied (with ``columns["state"]``, those whose
        state is in ``pending``; without, every row), each as a new item with a fresh id
        and a "queued" event naming the source. Every copied row is recorded in the same
        transaction, so running it again, or after a crash half-way, copies nothing twice;
        a recorded key whose row holds another payload now, or recorded before an import
        dropped the table (a table made again gives its keys out anew), is copied again,
        counted in `ImportSummary.changed`.

        Args:
            source_path: The other SQLite database (opened read-only).
            table: Its table holding the queue.
            columns: Store fields to source columns: "payload" (required: JSON text, or
                other text, kept as ``{"data": ...}``), and optionally "key" (orders and
                identifies rows; default rowid), "state", "project_id", "priority",
                "service_class", "sla", "fingerprint", "max_attempts", "not_before".
            project_id: The project every row goes to (unless a column gives one).
            pending: The values of the state column that mean "still to be done".
            drop_source: Drop the source table once everything is copied.
            chunk: Source rows per transaction.
            progress: Called with the number of source rows seen so far.
        """
        from asyncplane import _import  # sqlite3 reading another database: on first use

        return await _import.import_pending(
            self._engine, self._freeing, source_path, table=table, columns=columns,
            project_id=project_id,
            pending=pending, drop_source=_validate.boolean(drop_source, "drop_source"),
            chunk=chunk, progress=progress,
        )  # fmt: skip

    async def stats(self) -> dict[str, Any]:
        """A store's state at a glance.

        Keys: ``states`` (items per state), ``projects`` (items per state, per project),
        ``items``, ``oldest_ready_age_s`` (seconds the oldest ready item has waited, or
        None), ``expired_leases`` (claims whose lease lapsed, waiting to be taken over),
        ``offloaded``, ``database_bytes``, ``wal_bytes``, ``schema_version``, ``path``.
        """
        raw = await (await self._engine.ready()).stats()
        states = dict.fromkeys(_models.ITEM_STATES, 0)
        projects: dict[str, dict[str, int]] = {}
        for project, state, count in raw.states_by_project:
            states[state] = states.get(state, 0) + count
            projects.setdefault(project, dict.fromkeys(_models.ITEM_STATES, 0))[state] = count
        sizes = await (await self._engine.ready()).sizes()
        now = self._engine.clock.now()
        return {
            "path": self.location if self._path is None else str(self._path),
            "schema_version": raw.schema_version,
            "items": sum(states.values()),
            "states": states,
            "projects": projects,
            "oldest_ready_age_s": None
            if raw.oldest_ready_at is None
            else _models.waited(now, raw.oldest_ready_at),
            "expired_leases": raw.expired_leases,
            "offloaded": states["offloaded"],
            "database_bytes": sizes[0],
            "wal_bytes": sizes[1],
        }

    async def settled_per_minute(
        self, *, since: datetime | float | None = None, actor_id: str | None = None
    ) -> list[dict[str, Any]]:
        """How many items settled in each minute since ``since`` (default: the last hour),
        per project and state (done, failed, cancelled), oldest minute first.

        Each row: ``minute`` (the minute's start, an aware UTC datetime), ``project_id``,
        ``state``, ``count``. Read from the settled items' index, so it costs what the
        minutes hold, never the store's size; an item requeued since no longer counts.
        """
        start = _validate.instant(since, "since")
        backend = await self._engine.ready()
        if start is None:
            start = backend.clock.now() - 3600.0
        rows = await backend.settled_per_minute(start, _validate.optional_actor(actor_id))
        return [
            {"minute": _models.from_timestamp(m), "project_id": p, "state": s, "count": n}
            for m, p, s, n in rows
        ]

    async def next_due(
        self, *, project_id: str | None = None, actor_id: str | None = None
    ) -> datetime | None:
        """When a claim next finds new work: the earliest deferred item to fall due, or
        lease to lapse, among items a claim with the same filters could take; or None.

        A time already past means a claim would find work now.
        """
        project = None if project_id is None else _validate.text_id(project_id, "project_id")
        actor = _validate.optional_actor(actor_id)
        due = await (await self._engine.ready()).next_due(project, actor)
        return _optional_time(due)

    async def counts(
        self, *, project_id: str | None = None, actor_id: str | None = None
    ) -> dict[str, int]:
        """How many items are in each state, every state a key: of one project, or of the
        projects assigned to ``actor_id``, or of the whole store."""
        project = None if project_id is None else _validate.text_id(project_id, "project_id")
        actor = _validate.optional_actor(actor_id)
        found = await (await self._engine.ready()).count_states(project, actor)
        return {state: found.get(state, 0) for state in _models.ITEM_STATES}

    async def item(self, item_id: int, *, actor_id: str | None = None) -> dict[str, Any]:
        """The item's current row as a dict.

        Keys: item_id, project_id, state, payload, fence, attempts, owner,
        lease_expires_at, claimed_at, created_at, updated_at, priority, service_class, sla,
        fingerprint, max_attempts, due_at (when a deferred item falls due), result,
        error and offload_handle (times as aware UTC datetimes).

        Raises:
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item; never an empty answer.
        """
        item_id = _validate.item_id(item_id)
        actor = _validate.optional_actor(actor_id)
        row = await (await self._engine.ready()).get_item(item_id, actor)
        return _item_dict(row)

    # --- operating single items ----------------------------------------------------------

    async def items(
        self,
        *,
        project_id: str | None = None,
        state: str | Collection[str] | None = None,
        owner: str | None = None,
        fingerprint: str | None = None,
        created_after: datetime | float | None = None,
        created_before: datetime | float | None = None,
        updated_after: datetime | float | None = None,
        updated_before: datetime | float | None = None,
        error_contains: str | None = None,
        order: str = "newest",
        after: int | None = None,
        limit: int = 100,
        include_payload: bool = True,
        actor_id: str | None = None,
    ) -> list[dict[str, Any]]:
        """A page of items, each as `item` returns it, newest first (or oldest).

        Every filter is optional, and they combine: ``state`` is one state or several;
        ``error_contains`` matches a piece of the error, ignoring the case of ASCII
        letters (other letters match as written, on every backend); the times are
        aware datetimes or epoch seconds, and exclusive. For the next page pass the last
        row's ``item_id`` as ``after`` (keyset paging: rows never repeat between pages, and
        on SQLite never go missing; on PostgreSQL, whose ids are handed out before their
        transactions commit, an oldest-first walk can pass an id whose item commits a
        moment later, and never come back for it). Each state asked for is read newest
        first from an index of its own (per project, with ``project_id``), so a page costs
        the same at a thousand items or a million; the other filters are checked on the
        rows walked. Without ``include_payload`` the rows have no payload and no result.

        Raises:
            InvalidInput: An unknown state or order, or a limit outside 1 to 10,000.
        """
        where = self._item_filter(
            project_id, state, owner, fingerprint, created_after, created_before,
            updated_after, updated_before, error_contains, actor_id,
        )  # fmt: skip
        size = _validate.positive_int(limit, "limit")
        if size > MAX_LIST_LIMIT:
            raise _errors.InvalidInput(f"limit is {size}: at most {MAX_LIST_LIMIT} rows a page")
        op = _backend.ListOp(
            where,
            _validate.listing_order(order),
            None if after is None else _validate.positive_int(after, "after"),
            size,
            _validate.boolean(include_payload, "include_payload"),
        )
        rows = await (await self._engine.ready()).list_items(op)
        if op.include_payload:
            return [_item_dict(row) for row in rows]
        return [_item_dict(row, payload=False) for row in rows]

    async def cancel(
        self,
        item_id: int,
        *,
        reason: str | None = None,
        actor_id: str | None = None,
        if_state: str | Collection[str] | None = None,
        if_fence: int | None = None,
    ) -> str:
        """Cancel an item; return its state afterwards.

        A ready, deferred, claimed or offloaded item becomes "cancelled" at once, with a
        "cancelled" event, and its fence rises as on a takeover: whoever holds it is
        refused with `ItemCancelled` at their next renew, finish, retry, park or offload
        (`drain` stops the executor on that refusal). Its twins are not settled: they stop
        being held back. An item settled already (done, failed, cancelled) is left as it
        is, and its state returned: not an error. With ``if_state`` (a state, or several)
        an item in none of them is left as it is too, and its state returned: an operator
        acting on what a page showed a while ago cancels nothing that has moved on since
        (a retrying item a worker has claimed meanwhile, say). With ``if_fence`` an item
        at another fence is left as it is too: a claim, a takeover or a cancel raises the
        fence, so "claimed at fence 3" names one run, and a later run of the same item
        (taken over once the lease shown lapsed, say), still ``claimed``, is not it.

        Raises:
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item (or it does not exist).
        """
        op = _backend.CancelOp(
            _validate.item_id(item_id),
            _validate.error_text(reason, "reason"),
            _validate.optional_actor(actor_id),
            _validate.states(if_state, "if_state"),
            _validate.optional_fence(if_fence, "if_fence"),
        )
        state, _ = await self._settle(op, (await self._engine.ready()).cancel(op))
        self._engine.notify()  # its twins may be claimable, a waiter may be waiting
        return state

    async def requeue(
        self,
        item_id: int,
        *,
        actor_id: str | None = None,
        if_state: str | Collection[str] | None = None,
        if_fence: int | None = None,
    ) -> None:
        """Put a failed or cancelled item back in the ready queue with a fresh attempt
        budget.

        It keeps its id, payload and fingerprint; a "requeued" event records who, when and
        from which state; its attempts count starts again (the ledger keeps every earlier
        attempt), and its next claim's fence is above every earlier one. With
        ``if_state`` ("failed", say) an item in another state is refused as any other
        would be: one cancelled on purpose since a page showed it failed stays cancelled.
        With ``if_fence`` an item at another fence is refused too: one requeued since, run
        and failed again, is failed at a higher fence.

        Raises:
            NotRequeueable: The item is neither failed nor cancelled (nor in ``if_state``,
                nor at ``if_fence``, given); nothing changed.
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item (or it does not exist).
        """
        op = _backend.RequeueOp(
            _validate.item_id(item_id),
            _validate.optional_actor(actor_id),
            _validate.states(if_state, "if_state"),
            _validate.optional_fence(if_fence, "if_fence"),
        )
        await self._freeing(op, (await self._engine.ready()).requeue(op))

    async def cancel_where(
        self,
        *,
        project_id: str | None = None,
        state: str | Collection[str] | None = None,
        owner: str | None = None,
        fingerprint: str | None = None,
        created_after: datetime | float | None = None,
        created_before: datetime | float | None = None,
        updated_after: datetime | float | None = None,
        updated_before: datetime | float | None = None,
        error_contains: str | None = None,
        reason: str | None = None,
        chunk: int = 500,
        actor_id: str | None = None,
    ) -> int:
        """Cancel every live item the filters take (as `items` reads them); return how
        many were cancelled.

        It works through them oldest first, ``chunk`` items per short transaction, so
        other writers get their turn between chunks and a crash leaves each item either
        cancelled, with its event, or untouched; running it again goes on. Settled items
        are never touched, whatever ``state`` says.
        """
        where = self._item_filter(
            project_id, state, owner, fingerprint, created_after, created_before,
            updated_after, updated_before, error_contains, actor_id,
        )  # fmt: skip
        why = _validate.error_text(reason, "reason")
        size = _validate.positive_int(chunk, "chunk")
        backend = await self._engine.ready()
        return await self._in_chunks(backend.cancel_where, where, size, why, _backend.CancelWhereOp)

    async def requeue_where(
        self,
        *,
        project_id: str | None = None,
        state: str | Collection[str] | None = None,
        owner: str | None = None,
        fingerprint: str | None = None,
        created_after: datetime | float | None = None,
        created_before: datetime | float | None = None,
        updated_after: datetime | float | None = None,
        updated_before: datetime | float | None = None,
        error_contains: str | None = None,
        chunk: int = 500,
        actor_id: str | None = None,
    ) -> int:
        """Requeue every failed or cancelled item the filters take; return how many.

        In chunks of short transactions, oldest first, as `cancel_where` works; an item in
        any other state is never touched, whatever ``state`` says.
        """
        where = self._item_filter(
            project_id, state, owner, fingerprint, created_after, created_before,
            updated_after, updated_before, error_contains, actor_id,
        )  # fmt: skip
        size = _validate.positive_int(chunk, "chunk")
        backend = await self._engine.ready()
        return await self._in_chunks(backend.requeue_where, where, size, None, _backend.WhereOp)

    async def _in_chunks(
        self,
        step: Callable[[Any], Awaitable[tuple[int, int | None]]],
        where: _backend.ItemFilter,
        chunk: int,
        reason: str | None,
        kind: type[_backend.WhereOp],
    ) -> int:
        """``step`` chunk after chunk to the end, each chunk a ``kind`` op; how many items
        it changed, a cancel's chunks counted settled as each commits (`_settle`)."""
        changed, after = 0, 0
        while True:
            op = kind(where, after, chunk, reason)
            count, last = await self._settle(op, step(op), timed=False)
            changed += count
            if count:
                self._engine.notify()
            if last is None:
                return changed
            after = last

    async def wait(
        self,
        item_id: int,
        *,
        timeout: float | None = None,
        poll_interval: float = 0.1,
        actor_id: str | None = None,
    ) -> dict[str, Any]:
        """The item, as `item` returns it, once it is done, failed or cancelled.

        No busy polling: a settle in this process wakes the waiter at once; one in
        another process is noticed by the store's own wake-ups (on SQLite a cheap
        ``PRAGMA data_version`` look every ``poll_interval`` seconds, on PostgreSQL a
        NOTIFY at once).

        Raises:
            WaitTimeout: Not settled within ``timeout`` seconds (a `TimeoutError` too).
            UnknownItem: No such item (at once, control plane only).
            ItemPurged: It settled, and retention purged it before this wait read its
                outcome (an `UnknownItem`; its outcome is in the purge's archive).
            ScopeDenied: The actor may not see the item (or it does not exist).
            StoreClosed: The store was closed while the call waited (a wait never opens
                it again).
            StorageError: The store could not be read meanwhile (a server unreachable):
                every call waiting hears it.
        """
        target = _validate.item_id(item_id)
        actor = _validate.optional_actor(actor_id)
        limit = None if timeout is None else _validate.seconds(timeout, "timeout", 10.0**7)
        poll = _validate.seconds(poll_interval, "poll_interval", 3600.0)
        engine = self._engine
        try:
            # The first look comes before the timeout runs: a refusal (absent, not the
            # actor's) is given as such, however short the timeout.
            backend = await engine.ready()
            closes = engine.closes  # before the first look: a close during it is seen
            row = await backend.get_item(target, actor)
            if row.state in _models.SETTLED_STATES:
                return _item_dict(row)
            settled = self._settled(target, actor, poll, backend, closes)
            return await _tasks.within(settled, limit, f"asyncplane-wait-settled[{target}]")
        except asyncio.TimeoutError:
            raise _errors.WaitTimeout(
                f"item {target} had not settled after {limit} seconds"
            ) from None

    async def _settled(
        self, item_id: int, actor: str | None, poll: float, backend: _backend.Backend,
        closes: int,
    ) -> dict[str, Any]:  # fmt: skip
        # Other processes' settles of it wake this store from the mark on; it may have
        # settled since the first look, so the loop looks before it waits. Between looks
        # it waits on the store's one watch of items waited for (`asyncplane._settles`),
        # which reads again (at once) after the look: nothing slips between the two.
        engine = self._engine
        await backend.mark_awaited(item_id)
        while True:
            if engine.closes != closes:  # a look now would open it again
                raise _errors.StoreClosed(f"the store was closed while waiting for item {item_id}")
            backend = await engine.ready()
            try:
                row = await backend.get_item(item_id, actor)
            except _errors.UnknownItem:  # seen live before: settled, then purged
                raise _rules.purged_while_awaited(item_id) from None
            except _errors.ScopeDenied:
                # To an actor a purged item is refused as one out of its scope is: which
                # one, the control plane's look says (the actor has seen it: no leak).
                try:
                    await backend.get_item(item_id, None)
                except _errors.UnknownItem:
                    raise _rules.purged_while_awaited(item_id) from None
                raise
            if row.state in _models.SETTLED_STATES:
                return _item_dict(row)
            await engine.settles.until_may_have_settled(item_id, poll, closes)

    def _item_filter(
        self,
        project_id: object,
        state: object,
        owner: object,
        fingerprint: object,
        created_after: object,
        created_before: object,
        updated_after: object,
        updated_before: object,
        error_contains: object,
        actor_id: object,
    ) -> _backend.ItemFilter:
        return _backend.ItemFilter(
            None if project_id is None else _validate.text_id(project_id, "project_id"),
            _validate.states(state),
            None if owner is None else _validate.text_id(owner, "owner"),
            _validate.fingerprint(fingerprint),
            _rules.beyond_its_microsecond(
                _validate.instant(created_after, "created_after"), created_after, later=True
            ),
            _rules.beyond_its_microsecond(
                _validate.instant(created_before, "created_before"), created_before, later=False
            ),
            _rules.beyond_its_microsecond(
                _validate.instant(updated_after, "updated_after"), updated_after, later=True
            ),
            _rules.beyond_its_microsecond(
                _validate.instant(updated_before, "updated_before"), updated_before, later=False
            ),
            _validate.search_text(error_contains, "error_contains"),
            _validate.optional_actor(actor_id),
        )

    # --- schedules -----------------------------------------------------------------------

    async def set_schedule(
        self,
        name: str,
        *,
        project_id: str,
        payload: Mapping[str, Any],
        cron: str | None = None,
        every: timedelta | float | None = None,
        timezone: str = "UTC",
        catch_up: str = "latest",
        priority: int = 0,
        service_class: str = "standard",
        fingerprint: str | None = None,
        dedup: bool = True,
        max_attempts: int | None = None,
    ) -> dict[str, Any]:
        """Add a schedule, or change the one of that name; return it (as `schedules` does).

        Each tick enqueues one item of ``payload`` in ``project_id``, with the job options
        given (as `enqueue` takes them; the fingerprint also from the store's
        ``identity``), its "queued" event recording ``{"schedule": name, "tick": ...}``.
        Ticks fall by ``cron`` (five fields, or a nickname such as ``@daily``, read in
        ``timezone``; the ``cron`` extra) or ``every`` (a timedelta or seconds, from one to
        a century, counted from now). Declared again with the same timetable, a schedule keeps
        its place, so a process may declare its schedules each time it starts.

        ``catch_up`` says what a run does with ticks missed while nothing ran: "latest"
        enqueues the newest, "all" each of them (at most 1000), "none" only a tick at
        most a minute late.

        Raises:
            UnknownProject: No such project.
            InvalidInput: A bad cron expression, an unknown timezone, both or neither of
                cron and every, a bad job option; nothing was written.
            MissingExtra: A cron schedule without the ``cron`` extra installed.
        """
        op = _backend.ScheduleOp(
            _validate.text_id(name, "name"),
            _validate.text_id(project_id, "project_id"),
            self._engine.new_item(
                _models.Job(payload, priority, service_class, None, fingerprint, max_attempts),
                _validate.boolean(dedup, "dedup"),
            ),
            _schedule.timetable(cron, every, timezone, 0.0),
            _validate.catch_up(catch_up),
        )
        # A daemon sleeping until the next tick looks again.
        row = await self._freeing(op, (await self._engine.ready()).set_schedule(op))
        return _schedule_dict(row)

    async def schedules(self) -> list[dict[str, Any]]:
        """Every schedule, by name: name, project_id, payload, cron or every, timezone,
        catch_up, next_at (its next tick), last_at (its last tick enqueued), paused, and
        its job options."""
        rows = await (await self._engine.ready()).list_schedules(None)
        return [_schedule_dict(row) for row in rows]

    async def schedule(self, name: str) -> dict[str, Any]:
        """One schedule (as `schedules` lists it); UnknownSchedule if absent."""
        rows = await (await self._engine.ready()).list_schedules(_validate.text_id(name, "name"))
        return _schedule_dict(rows[0])

    async def pause_schedule(self, name: str) -> None:
        """Stop a schedule's ticks (its items already enqueued stay); UnknownSchedule if
        absent."""
        backend = await self._engine.ready()
        await backend.pause_schedule(
            _backend.PauseScheduleOp(_validate.text_id(name, "name"), True)
        )

    async def resume_schedule(self, name: str) -> None:
        """Start a paused schedule's ticks again from now: the ticks that fell while it was
        paused are not enqueued. UnknownSchedule if absent."""
        backend = await self._engine.ready()
        op = _backend.PauseScheduleOp(_validate.text_id(name, "name"), False)
        await self._freeing(op, backend.pause_schedule(op))  # a daemon's sleep, a claim's

    async def delete_schedule(self, name: str) -> None:
        """Delete a schedule (the items its ticks enqueued stay); UnknownSchedule if absent."""
        await (await self._engine.ready()).delete_schedule(_validate.text_id(name, "name"))

    async def run_schedules(self) -> int:
        """Enqueue every tick now due, once, and return how many items were enqueued (a
        tick whose item is the twin of one still pending, by fingerprint and dedup, takes
        that one's id and adds none).

        Safe to call from any number of processes and hosts at once: the key of each tick
        is written in the transaction that enqueues its item, so a tick is enqueued by one
        caller only. drain() and work() call this themselves (at most once a second, and
        at each tick), so a fleet that runs either needs no scheduler of its own.
        """
        return await self._engine.run_schedules()

    async def schedule_ticks(self, name: str, *, limit: int = 100) -> list[dict[str, Any]]:
        """A schedule's ticks enqueued (their keys are kept a week), newest first: tick
        (when it fell), item_id, enqueued_at."""
        backend = await self._engine.ready()
        rows = await backend.schedule_ticks(
            _validate.text_id(name, "name"), _validate.positive_int(limit, "limit")
        )
        return [
            {
                "tick": _models.from_timestamp(row.tick_at),
                "item_id": row.item_id,
                "enqueued_at": _models.from_timestamp(row.at),
            }
            for row in rows
        ]

    # --- limits --------------------------------------------------------------------------

    async def set_limits(
        self,
        project_id: str,
        *,
        max_running: int | types.EllipsisType | None = ...,
        per_minute: float | types.EllipsisType | None = ...,
        burst: int | types.EllipsisType | None = ...,
    ) -> dict[str, Any]:
        """Limit a project's claims, across every process and host; return its limits (as
        `limits` does).

        ``max_running``: at most this many of its items claimed at any instant.
        ``per_minute`` and ``burst``: claims (takeovers too) drawn from a bucket that
        holds ``burst`` (one, if not given) and refills at ``per_minute``; so in any
        window of W seconds at most ``per_minute * W / 60 + burst`` claims. Keywords left
        out stay as they are; None clears one. Enforced in each claim's own transaction;
        a limit lowered below what runs now lets those runs finish.

        Raises:
            UnknownProject: No such project.
            InvalidInput: A limit that is not positive, or no keyword at all.
        """
        project = _validate.text_id(project_id, "project_id")
        op = _backend.LimitsOp(project, _validate.limit_changes(max_running, per_minute, burst))
        backend = await self._engine.ready()
        await self._freeing(op, backend.set_limits(op))  # a raised limit may free claims now
        return await self.limits(project)

    async def limits(self, project_id: str) -> dict[str, Any]:
        """A project's limits and what is in use now: project_id, max_running, per_minute,
        burst (None: no such limit), running (its items claimed now), tokens (in its rate
        bucket now) and next_token_at (when a whole token is back, if none is there)."""
        project = _validate.text_id(project_id, "project_id")
        backend = await self._engine.ready()
        (row,) = await backend.get_limits(project)
        return _limits_dict(row, backend.clock.now())

    async def project_limits(self) -> list[dict[str, Any]]:
        """The limits of every project that has any (as `limits` gives them), by id."""
        backend = await self._engine.ready()
        now = backend.clock.now()
        return [_limits_dict(row, now) for row in await backend.get_limits(None)]

    async def events(
        self, item_id: int, *, actor_id: str | None = None, last: int | None = None
    ) -> list[dict[str, Any]]:
        """The item's ledger, oldest first.

        Each event is a dict with event_id, item_id, event_type, fence, owner, actor_id,
        at (an aware UTC datetime) and detail (a dict or None).

        Args:
            item_id: The item.
            actor_id: Read as this actor: only an item of its projects.
            last: Only the newest this many events (still oldest first), read without
                the older ones: an item retried or released thousands of times has a
                history of thousands (None: all of them).

        Raises:
            UnknownItem: No such item (control plane only).
            ScopeDenied: The actor may not see the item; never an empty list.
        """
        item_id = _validate.item_id(item_id)
        actor = _validate.optional_actor(actor_id)
        newest = None if last is None else _validate.positive_int(last, "last")
        rows = await (await self._engine.ready()).get_events(item_id, actor, newest)
        return [
            {
                "event_id": row.event_id,
                "item_id": row.item_id,
                "event_type": row.event_type,
                "fence": row.fence,
                "owner": row.owner,
                "actor_id": row.actor_id,
                "at": _models.from_timestamp(row.at),
                "detail": None
                if row.detail_json is None
                else _decoded(row.detail_json, row.item_id, "event detail"),
            }
            for row in rows
        ]


def _limits_dict(row: _backend.LimitsRow, now: float) -> dict[str, Any]:
    tokens = _rules.bucket(row, now)
    return {
        "project_id": row.project_id,
        "max_running": row.max_running,
        "per_minute": row.per_minute,
        "burst": row.burst,
        "running": row.running,
        "tokens": tokens,
        "next_token_at": _optional_time(_rules.token_due(row, now)),
    }


def _schedule_dict(row: _backend.ScheduleRow) -> dict[str, Any]:
    return {
        "name": row.name,
        "project_id": row.project_id,
        "payload": _decoded(row.payload_json, 0, "schedule payload"),
        "cron": row.cron,
        "every": None if row.every is None else timedelta(seconds=row.every),
        "timezone": row.timezone,
        "catch_up": row.catch_up,
        "next_at": _models.from_timestamp(row.next_at),
        "last_at": _optional_time(row.last_at),
        "paused": bool(row.paused),
        "priority": row.priority,
        "service_class": row.service_class,
        "fingerprint": row.fingerprint,
        "dedup": bool(row.dedup),
        "max_attempts": row.max_attempts,
        "created_at": _models.from_timestamp(row.created_at),
        "updated_at": _models.from_timestamp(row.updated_at),
    }


def _outcome(op: Any, answer: Any) -> str | None:
    """The outcome a settle counts under (`_telemetry.settled`), from its op and its
    answer; None for a call that settles nothing (a renew, a cancel of a settled item)."""
    if isinstance(op, _backend.FinishOp):
        return op.status
    if isinstance(op, _backend.RetryOp):  # its answer: deferred, or failed (out of attempts)
        return "retried" if answer == "deferred" else "failed"
    if isinstance(op, _backend.CancelOp):  # its answer: (state, whether this call cancelled)
        return "cancelled" if answer[1] else None
    return _OUTCOMES.get(type(op))


#: The outcome of each settle whose answer does not change it.
_OUTCOMES: dict[type, str] = {
    _backend.ParkOp: "parked",
    _backend.ReleaseOp: "released",
    _backend.OffloadOp: "offloaded",
    _backend.CancelWhereOp: "cancelled",
}


def _count(op: Any, answer: Any) -> int:
    """How many items a settle settled: a cancel's chunk says (its answer: how many, the
    last id looked at); any other settle, one."""
    return int(answer[0]) if isinstance(op, _backend.CancelWhereOp) else 1


def log_fields(row: _backend.ClaimRow | ClaimedItem) -> dict[str, Any]:
    """The ``extra`` fields of a log record about one claimed item (``asyncplane worker
    --log-format json`` writes them)."""
    return {"item_id": row.item_id, "project_id": row.project_id, "attempt": row.attempts,
            "fence": row.fence, "owner": row.owner}  # fmt: skip


def engine_of(store: ControlStore) -> _engine.Engine:
    """The engine beneath a store: what drain, retention, import, copy, the ledger check
    and the probe work through."""
    if not isinstance(store, ControlStore):
        raise _errors.InvalidType(f"expected a ControlStore, not {type(store).__name__}")
    return store._engine


def _optional_time(value: float | None) -> datetime | None:
    return None if value is None else _models.from_timestamp(value)


def _project_dict(row: _backend.ProjectRow) -> dict[str, Any]:
    return {
        "project_id": row.project_id,
        "name": row.name,
        "status": row.status,
        "created_at": _models.from_timestamp(row.created_at),
    }


def _decoded(text: str, item_id: int, what: str) -> Any:
    """Stored JSON, decoded; a StorageError if this process cannot (see `_validate`'s limits,
    which no value written today exceeds)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _errors.StorageError(
            f"item {item_id}'s {what} cannot be decoded: {type(exc).__name__}: {str(exc)[:200]}"
        ) from exc


def _claimed_item(row: _backend.ClaimRow, payload: dict[str, Any]) -> ClaimedItem:
    # Positional, in the order of ClaimedItem's fields: keywords cost a quarter more on
    # the claim's path (tests/test_claims.py holds each field to its value). The None
    # checks inline, for the same reason: most items have no SLA and no trace context.
    return ClaimedItem(
        row.item_id,
        row.project_id,
        payload,
        row.fence,
        row.attempts,
        _models.from_timestamp(row.lease_expires_at),
        row.owner,
        row.priority,
        row.service_class,
        None if row.sla is None else _models.from_timestamp(row.sla),
        row.fingerprint,
        row.max_attempts,
        _models.from_timestamp(row.created_at),
        None if row.trace_context is None else _telemetry.saved_context(row.trace_context),
    )


def _claim_failed(item_id: int, exc: Exception) -> _errors.ClaimAfterSettleFailed:
    """finish_and_claim's claim failed after its settle was saved: say so."""
    return _errors.ClaimAfterSettleFailed(
        f"item {item_id} was settled, but the claim made with it failed: "
        f"{type(exc).__name__}: {exc}"
    )


def _give_back_now(backend: _backend.Backend, rows: Sequence[_backend.ClaimRow],
                   actor_id: str | None, *, unseen: bool = False) -> None:  # fmt: skip
    """Queue the give-back of claims whose caller is gone (`Writes.give_back`; ``unseen``:
    no caller saw them, so they are counted claimed too), on the way out of a
    cancellation that must not be lost to a failure here."""
    if not rows:
        return
    try:
        backend.give_back(rows, actor_id, unseen=unseen)
    except Exception:
        _log.exception("asyncplane: claims whose caller was cancelled were not given back")


def _drop_claim(
    backend: _backend.Backend,
    claiming: _write_queue.Pending[list[_backend.ClaimRow]],
    actor_id: str | None,
) -> None:
    """A claim nobody will wait for now, its caller cancelled: dropped if its request is
    still queued (or was never queued), given back by the writer if its round is running
    (`Writes.orphaned`), or here if its answer is in."""
    if inspect.iscoroutine(claiming):  # not queued yet (see Writer.submit)
        claiming.close()
    elif isinstance(claiming, asyncio.Future) and not claiming.done():
        claiming.cancel()
    else:
        _give_back_now(backend, _answer_of(claiming) or [], actor_id, unseen=True)


def _answer_of(call: Awaitable[_T]) -> _T | None:
    """The value ``call`` holds, if it is a future that has one (not a refusal, not
    cancelled); else None."""
    return call.result() if _write_queue.has_answer(call) else None


def _item_dict(row: _backend.ItemRow, *, payload: bool = True) -> dict[str, Any]:
    found = {
        "item_id": row.item_id,
        "project_id": row.project_id,
        "state": row.state,
        "payload": _decoded(row.payload_json, row.item_id, "payload") if payload else None,
        "fence": row.fence,
        "attempts": row.attempts,
        "owner": row.owner,
        "lease_expires_at": _optional_time(row.lease_expires_at),
        "created_at": _models.from_timestamp(row.created_at),
        "updated_at": _models.from_timestamp(row.updated_at),
        "priority": row.priority,
        "service_class": row.service_class,
        "sla": _optional_time(row.sla),
        "fingerprint": row.fingerprint,
        "max_attempts": row.max_attempts,
        "due_at": _optional_time(row.due_at),
        "result": None
        if row.result_json is None
        else _decoded(row.result_json, row.item_id, "result"),
        "error": row.error,
        "offload_handle": row.offload_handle,
        "claimed_at": _optional_time(row.claimed_at),
    }
    if not payload:
        del found["payload"], found["result"]
    return found
