"""The backend seam: the operations a storage engine must provide, with typed parameters.

Parameters and rows are NamedTuples (`asyncplane._record.Record`, made cheaply at import):
immutable, typed, and cheap to build on the hot path (a claim builds one of each).

`ControlStore` validates arguments, then calls exactly one operation here per public call.
A backend owns its SQL, its connections, its migrations and its notion of "now" (the
SQLite backend reads the injected clock inside the write transaction; a server backend
may use the server's clock). No SQL crosses this seam, only the NamedTuples below.

Rules every backend keeps, because the store's guarantees rest on them:

* Each write operation is atomic: the state change and its ledger event commit together
  or not at all.
* An operation that refuses (FenceRejected, ScopeDenied, UnknownItem, ...) writes nothing.
* A claim is decided inside the write transaction that records it; fences only rise.
* With an actor, scope is checked in the same statement or transaction as the access, and
  "absent" and "not yours" produce the same ScopeDenied message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, Protocol

from asyncplane import _clock, _errors, _lock, _models, _schedule, _telemetry, _write_queue
from asyncplane._record import Record

__all__ = (
    "FREEING",
    "PURGE_START",
    "SETTLES",
    "Archived",
    "AssignOp",
    "AssignmentRow",
    "Backend",
    "Backfill",
    "CancelOp",
    "CancelWhereOp",
    "ChangeHook",
    "ClaimOp",
    "ClaimRow",
    "CopyOp",
    "CopyProjectsOp",
    "EnqueueOp",
    "EventRow",
    "ExportOp",
    "FinishOp",
    "GivenBack",
    "GroupOp",
    "Histories",
    "ImportOp",
    "ImportOutcome",
    "ItemFilter",
    "ItemRow",
    "LedgerTally",
    "LimitsOp",
    "LimitsRow",
    "ListOp",
    "NewItem",
    "NewProject",
    "OffloadOp",
    "ParkOp",
    "PauseScheduleOp",
    "PreflightOp",
    "ProjectRow",
    "ProjectStatusOp",
    "ReleaseOp",
    "RenewOp",
    "RequeueOp",
    "RetryOp",
    "RunSchedulesOp",
    "SavedUnseen",
    "ScheduleOp",
    "ScheduleRow",
    "SchedulesRun",
    "Sizing",
    "StoreStats",
    "TickRow",
    "WhereOp",
    "Writes",
    "finish_request",
)


#: Called when another host wrote something that may be claimable (PostgreSQL's NOTIFY).
ChangeHook = Callable[[], None]


class NewProject(Record):
    """Parameters of create_project."""

    project_id: str
    name: str
    status: str


class NewItem(Record):
    """One item to enqueue, its payload already validated compact JSON."""

    payload_json: str
    priority: int
    service_class: str
    sla: float | None
    fingerprint: str | None
    dedup: bool
    max_attempts: int | None
    not_before: float | None
    #: The producer's trace context (W3C headers as compact JSON), or None.
    trace_context: str | None = None


class EnqueueOp(Record):
    """Parameters of enqueue and enqueue_many: all items in one transaction."""

    project_id: str
    items: tuple[NewItem, ...]
    actor_id: str | None


class ClaimOp(Record):
    """Parameters of claim and claim_batch: up to ``limit`` items for ``owner``."""

    owner: str
    limit: int
    lease_seconds: float
    actor_id: str | None
    project_id: str | None


class RenewOp(Record):
    """Parameters of renew."""

    item_id: int
    fence: int
    lease_seconds: float
    actor_id: str | None


class FinishOp(Record):
    """Parameters of finish: done with a result, or failed with an error."""

    item_id: int
    fence: int
    status: str
    actor_id: str | None
    result_json: str | None
    error: str | None


class RetryOp(Record):
    """Parameters of retry. Without ``delay``, the backoff is
    ``min(backoff_max, backoff_base * 2 ** (attempts - 1) * (0.5 + jitter))``."""

    item_id: int
    fence: int
    actor_id: str | None
    error: str | None
    delay: float | None
    backoff_base: float
    backoff_max: float
    jitter: float


class ParkOp(Record):
    """Parameters of park: deferred for ``delay`` seconds, the attempt given back."""

    item_id: int
    fence: int
    actor_id: str | None
    delay: float


class ReleaseOp(Record):
    """Parameters of release: a current claim given back, ready again, its attempt too."""

    item_id: int
    fence: int
    actor_id: str | None


class OffloadOp(Record):
    """Parameters of offload: handed to the external batch ``handle``."""

    item_id: int
    fence: int
    actor_id: str | None
    handle: str


class PreflightOp(Record):
    """Parameters of a preflight dedup step: how much, and within which scope."""

    chunk: int
    project_id: str | None
    actor_id: str | None


class Backfill(Record):
    """What the fingerprint backfill's look found: the fingerprints to write, as
    ``(fingerprint, item_id)``, where its next look starts, and how many items it saw."""

    writes: list[tuple[str, int]]
    after: int
    seen: int


class ItemFilter(Record):
    """Which items a listing, or a filter-wide cancel or requeue, takes (None: any)."""

    project_id: str | None
    states: tuple[str, ...]  # () for any state
    owner: str | None
    fingerprint: str | None
    created_after: float | None
    created_before: float | None
    updated_after: float | None
    updated_before: float | None
    error_contains: str | None  # lower-cased: the match ignores case
    actor_id: str | None


class ListOp(Record):
    """A page of items: newest (or oldest) first, after a keyset bound."""

    where: ItemFilter
    newest: bool
    after: int | None
    limit: int
    include_payload: bool


class CancelOp(Record):
    """Cancel one item (see `asyncplane._rules.cancel_plan`), if it is in one of
    ``expected`` (empty: whatever its state) and at ``expected_fence`` (None: any)."""

    item_id: int
    reason: str | None
    actor_id: str | None
    expected: tuple[str, ...] = ()
    expected_fence: int | None = None


class RequeueOp(Record):
    """Take one failed or cancelled item back to ready, if it is in one of ``expected``
    (empty: either) and at ``expected_fence`` (None: any)."""

    item_id: int
    actor_id: str | None
    expected: tuple[str, ...] = ()
    expected_fence: int | None = None


class ProjectStatusOp(Record):
    """Change a project's status (``"open"``, ``"paused"``, ``"closed"``), if it stands
    in one of the ``expected`` statuses (none: whatever it is)."""

    project_id: str
    status: str
    expected: tuple[str, ...] = ()


class AssignOp(Record):
    """Give an actor a project (idempotent)."""

    project_id: str
    actor_id: str


class PauseScheduleOp(Record):
    """Pause a schedule, or resume it (``paused`` False)."""

    name: str
    paused: bool


class WhereOp(Record):
    """One chunk of a filter-wide cancel or requeue: the items of ``where`` after
    ``after`` in id order, at most ``chunk`` of them, in one transaction."""

    where: ItemFilter
    after: int
    chunk: int
    reason: str | None  # a cancel's


class CancelWhereOp(WhereOp):
    """One chunk of a filter-wide cancel: a `WhereOp` whose write settles its items (so
    one saved for a caller gone is counted, `SETTLES`)."""

    __slots__ = ()


#: The operations that settle items, each counted as it is saved, answered or not
#: (`Writes.orphaned`; `asyncplane._store`'s ``_outcome`` names each one's outcome).
SETTLES = (FinishOp, RetryOp, ParkOp, ReleaseOp, OffloadOp, CancelOp, CancelWhereOp)


class LimitsOp(Record):
    """Parameters of set_limits: the limits to change (None clears one), the rest kept."""

    project_id: str
    changes: tuple[tuple[str, int | float | None], ...]


class LimitsRow(Record):
    """A project's limits as stored, with how many of its items are claimed now."""

    project_id: str
    max_running: int | None
    per_minute: float | None
    burst: int | None
    tokens: float | None
    refilled_at: float | None
    running: int = 0


class ScheduleOp(Record):
    """Parameters of set_schedule: what each tick enqueues, and when ticks fall."""

    name: str
    project_id: str
    item: NewItem
    timetable: _schedule.Timetable
    catch_up: str


class RunSchedulesOp(Record):
    """Parameters of one transaction of run_schedules: how many due schedules it takes,
    whether cron ones among them (`asyncplane._schedule.crons_here`), and the names it
    leaves out (those the run's earlier transactions passed over: `SchedulesRun`), so
    that the ones after them are reached."""

    limit: int
    crons: bool
    passed: tuple[str, ...] = ()


class SchedulesRun(Record):
    """What one transaction of run_schedules did: items ``enqueued`` (a tick whose item
    is a pending twin's adds none), schedules ``run``, and the schedules ``passed`` over,
    untouched, as this host cannot read them, each ``(name, why)``
    (`asyncplane._schedule.unreadable`)."""

    enqueued: int
    run: int
    passed: tuple[tuple[str, str], ...]


class ScheduleRow(Record):
    """A schedule as stored (``next_at``: its first tick not enqueued yet)."""

    name: str
    project_id: str
    payload_json: str
    cron: str | None
    every: float | None
    timezone: str
    catch_up: str
    priority: int
    service_class: str
    fingerprint: str | None
    dedup: bool
    max_attempts: int | None
    paused: bool
    anchor: float
    next_at: float
    last_at: float | None
    created_at: float
    updated_at: float

    def timetable(self) -> _schedule.Timetable:
        """When its ticks fall."""
        return _schedule.Timetable(self.cron, self.every, self.timezone, self.anchor)

    def item(self) -> NewItem:
        """The item each tick enqueues."""
        return NewItem(
            self.payload_json, self.priority, self.service_class, None, self.fingerprint,
            bool(self.dedup), self.max_attempts, None,
        )  # fmt: skip


class TickRow(Record):
    """One tick enqueued: when it fell, its item, when it was enqueued."""

    name: str
    tick_at: float
    item_id: int | None
    at: float


class ImportOp(Record):
    """Parameters of one chunk of an import: items keyed by their source row, each as
    (key, digest of the row's payload, item), and the source's drop record as the run
    found it at its start (`source_dropped_up_to`)."""

    source: str
    project_id: str
    rows: tuple[tuple[str, str, NewItem], ...]
    dropped_up_to: int | None


#: What an import did with a source row, by what the store recorded under its key
#: (`_rules.imported_before`): "new", none recorded (copied); "again", the same content
#: (passed over); "unverified", a record from before contents were recorded (passed
#: over, the key being all there is to go by); "changed", other content (copied).
ImportOutcome = Literal["new", "again", "unverified", "changed"]


#: The writes besides settles that can make work claimable, or a tick due, here and now
#: (an item ready again, a chunk of them requeued, rows imported, a project opened or
#: given to an actor, a limit raised, a schedule set or resumed, ticks enqueued): each wakes this
#: process's waiting claims and sleeping drainers once saved, even for a caller gone.
#: (`WhereOp` is a requeue's chunk; a cancel's, `CancelWhereOp`, is a settle.)
FREEING = (
    RequeueOp, WhereOp, ImportOp, ProjectStatusOp, AssignOp, LimitsOp, ScheduleOp,
    PauseScheduleOp, RunSchedulesOp,
)  # fmt: skip
#: What a round saved for a caller gone is told of (`Writes.orphaned`): every settle, an
#: enqueue (counted), and a write of `FREEING`, each waking this process's waiting
#: claims, as its caller would have.
_TOLD = (*SETTLES, EnqueueOp, *FREEING)


class StoreStats(Record):
    """What the database says about itself (the store adds file sizes)."""

    states_by_project: tuple[tuple[str, str, int], ...]
    oldest_ready_at: float | None
    expired_leases: int
    schema_version: int


class ProjectRow(Record):
    """A project as stored."""

    project_id: str
    name: str
    status: str
    created_at: float


class ClaimRow(Record):
    """One item handed out by a claim, as the backend recorded it."""

    item_id: int
    project_id: str
    payload_json: str
    fence: int
    attempts: int
    owner: str
    lease_expires_at: float
    priority: int
    service_class: str
    sla: float | None
    fingerprint: str | None
    max_attempts: int | None
    #: When the item was enqueued.
    created_at: float = 0.0
    #: The producer's trace context saved at enqueue (compact JSON), or None.
    trace_context: str | None = None
    #: Whether this claim took the item over from a lapsed lease.
    taken_over: bool = False


class ItemRow(Record):
    """An item's current row."""

    item_id: int
    project_id: str
    state: str
    payload_json: str
    fence: int
    attempts: int
    owner: str | None
    lease_expires_at: float | None
    created_at: float
    updated_at: float
    priority: int
    service_class: str
    sla: float | None
    fingerprint: str | None
    max_attempts: int | None
    due_at: float | None
    result_json: str | None
    error: str | None
    offload_handle: str | None
    #: Whether the item takes part in enqueue and settlement dedup.
    dedup: bool = True
    #: When its current (or last) claim began; renewals leave it be.
    claimed_at: float | None = None
    #: The producer's trace context saved at enqueue (compact JSON), for the worker's
    #: span to link to; a copy carries it over.
    trace_context: str | None = None


class AssignmentRow(Record):
    """One actor's assignment to one project."""

    actor_id: str
    project_id: str
    assigned_at: float


class EventRow(Record):
    """One ledger event."""

    event_id: int
    item_id: int
    event_type: str
    fence: int
    owner: str | None
    actor_id: str | None
    at: float
    detail_json: str | None


class CopyOp(Record):
    """One chunk of a copy from another store: items with their whole histories, keyed by
    their id in the source (which they keep)."""

    source: str
    items: tuple[tuple[ItemRow, tuple[EventRow, ...]], ...]


class ImportRecord(Record):
    """One row an import brought in, as the store remembers it (so that an import run
    again skips it): a copy carries these over with the items."""

    source: str
    source_key: str
    item_id: int
    imported_at: float
    digest: str | None


class CopyProjectsOp(Record):
    """The projects, assignments, limits and schedules of another store, to add where not
    here yet (a schedule keeps its place: its next tick, its last), each once from one
    source (`asyncplane._rules.copy_settings_plan`)."""

    source: str  # the copy's label (`asyncplane._copy.source_label`)
    projects: tuple[ProjectRow, ...]
    assignments: tuple[AssignmentRow, ...]
    limits: tuple[LimitsRow, ...] = ()
    schedules: tuple[ScheduleRow, ...] = ()


#: Where a purge's first chunk starts: before every (last change, id).
PURGE_START: Final = (float("-inf"), 0)


class Archived(Record):
    """A settled item as a purge archived it: deleted only if it still stands so (a
    requeue and a new settle since move its fence and its last change)."""

    item_id: int
    fence: int
    updated_at: float


class ExportOp(Record):
    """One page of an export: items after an id, in id order."""

    after_item_id: int
    chunk: int
    pending_only: bool


#: Items each with their whole history, oldest event first (purge, export, copy).
Histories = list[tuple[ItemRow, list[EventRow]]]


class LedgerTally(Record):
    """Whole-store totals of the ledger, for checking a run's counts (the probe)."""

    items: int
    claims: int
    takeovers: int
    terminal_events: int
    #: Items with more than one terminal event.
    settled_twice: list[int]
    #: Items claimed again without a recorded takeover (a duplicate claim).
    unexplained_claims: list[int]
    #: Per claimant (``owner``), how many of its claims were taken over once their lease
    #: lapsed (the ``lease_expired`` events that name it).
    taken_from: dict[str, int]
    #: Of those, how many were taken over after the claimant's last claim.
    taken_at_the_end: dict[str, int]


class Sizing(Record):
    """What every backend is sized by: requests per write round, read connections, and
    whether it may write at all."""

    max_batch: int
    read_connections: int
    read_only: bool


#: ``many(ops, conn, now)``: decides a whole group of claims, or of finishes, at once.
GroupOp = Callable[[list[Any], Any, float], Any]
#: Hears, on the event loop, that a give-back of an item claimed for a caller that went
#: away landed (``error`` None) or failed: ``given_back(row, error)`` (see
#: `Writes.on_orphaned`).
GivenBack = Callable[["ClaimRow", BaseException | None], None]
#: Hears, on the event loop, that a round saved a write of `_TOLD` (a settle, an enqueue,
#: a write of `FREEING`) for a caller that went away while it ran, with the answer its
#: caller would have had: ``saved(op, answer)`` (see `Writes.on_orphaned`).
SavedUnseen = Callable[[Any, Any], None]


class Writes:
    """What every backend shares around its writer.

    The refusals of a write to a store that cannot take one (read-only, closed), and
    which writes a round may run together: claims with the same filters and lease, and
    finishes, each kind through the ``claim_many`` / ``finish_many`` the backend names,
    which decide a whole group in one go (see `asyncplane._write_queue.Grouped`).
    """

    #: See `Backend.settle_with_claim`; each backend says.
    settle_with_claim: bool

    def __init__(self, sizing: Sizing, *, claim_many: GroupOp, finish_many: GroupOp) -> None:
        self._sizing = sizing
        self._claim_many = claim_many
        self._finish_many = finish_many
        self._writer: _write_queue.WriterBase | None = None
        self._given_back: GivenBack | None = None
        self._saved: SavedUnseen | None = None

    @property
    def clock(self) -> _clock.Clock:
        """The backend's clock (see `Backend.clock`)."""
        raise NotImplementedError

    def on_orphaned(self, given_back: GivenBack, saved: SavedUnseen) -> None:
        """For requests whose callers were cancelled while their rounds ran (`orphaned`):
        have a claim's items given back, and hear ``given_back(row, error)`` as each
        give-back lands (``error`` None) or fails; hear ``saved(op, answer)`` of a write
        of `_TOLD` saved."""
        self._given_back = given_back
        self._saved = saved

    def orphaned(self, request: Any, outcome: Any) -> None:
        """The writer's `asyncplane._write_queue.Orphaned`: a claim's items are released
        at once, each queued now, ahead of the writer's end if it is stopping (nobody
        knows their fences, so they would wait out their leases); a settle, an enqueue or
        a write of `FREEING` stands, and is told (`on_orphaned`), so it is counted and
        wakes this process's waiters as an answered one does; any other request's outcome
        stands as it is."""
        if not isinstance(request, _write_queue.Grouped | _write_queue.Named):
            return
        if isinstance(request.op, ClaimOp):
            self.give_back(outcome, request.op.actor_id, unseen=True)
        elif self._saved is not None and isinstance(request.op, _TOLD):
            self._saved(request.op, outcome)

    def give_back(
        self, rows: Sequence[ClaimRow], actor_id: str | None, *, unseen: bool = False
    ) -> None:
        """Release ``rows``, claimed for a caller that is gone, queued now (see `orphaned`);
        ``unseen``: no caller saw them, so they are counted claimed (`_telemetry.taken`)
        once their releases are queued."""
        self._give_back(rows, actor_id)
        if unseen:  # once the releases are queued: a failure here is the count's alone
            _telemetry.taken_unseen(rows, self.clock.now)

    def _give_back(self, rows: Sequence[ClaimRow], actor_id: str | None) -> None:
        for row in rows:
            release = self._named_write(ReleaseOp(row.item_id, row.fence, actor_id))
            try:
                if self._writer is None:
                    raise _errors.StoreClosed("the store is closed")
                landed = self._writer.queue_now(release)
            except _errors.AsyncplaneError as exc:
                self._tell(row, exc)
                continue
            landed.add_done_callback(functools.partial(self._landed, row))

    def _landed(self, row: ClaimRow, landed: asyncio.Future[Any]) -> None:
        self._tell(row, asyncio.CancelledError() if landed.cancelled() else landed.exception())

    def _tell(self, row: ClaimRow, error: BaseException | None) -> None:
        if self._given_back is not None:
            self._given_back(row, error)

    def _enqueue_write(self, op: EnqueueOp) -> Any:
        """An enqueue as this backend's writer runs it: the operation, called ``(conn,
        now)`` inside the round's transaction."""
        raise NotImplementedError

    def _named_write(self, op: Any) -> Any:
        """A settle of `SETTLES` other than a finish, or a write of `FREEING` (its op), as
        this backend's writer runs it: the operation, called ``(conn, now)`` inside the
        round's transaction."""
        raise NotImplementedError

    @property
    def writer(self) -> _write_queue.WriterBase | None:
        """The writer task's handle (for tests, benchmarks and the probe)."""
        return self._writer

    def writable(self) -> None:
        """Refuse a write at once on a read-only or closed store (a purge asks before it
        appends to its archive)."""
        if self._sizing.read_only:
            raise _errors.ReadOnlyStore("this store was opened with read_only=True: no writes")
        if self._writer is None:
            raise _errors.StoreClosed("the store is closed")

    def _submit(self, op: Any) -> _write_queue.Pending[Any]:
        """Hand ``op`` to the writer: what to await for its outcome (refused at once on a
        read-only or closed store)."""
        self.writable()
        assert self._writer is not None
        return self._writer.submit(op)

    def enqueue(self, op: EnqueueOp) -> _write_queue.Pending[list[int]]:
        """Add the items (or find their twins): their ids in input order. Named, so that
        one saved for a caller gone is still told (`orphaned`)."""
        return self._submit(_write_queue.Named(self._enqueue_write(op), op))

    def claim(self, op: ClaimOp) -> _write_queue.Pending[list[ClaimRow]]:
        """Claim up to ``op.limit`` items (grouped with claims of the same filters)."""
        # Grouped is not subscripted here: a generic alias's call costs microseconds.
        return self._submit(_write_queue.Grouped(_claim_key(op), op, self._claim_many))

    def finish(self, op: FinishOp) -> _write_queue.Pending[int]:
        """Settle a current claim (grouped with the round's other finishes, which run
        ahead of the claims queued with them: see `asyncplane._write_queue.units`)."""
        return self._submit(finish_request(op, self._finish_many))

    def retry(self, op: RetryOp) -> _write_queue.Pending[str]:
        """Defer a current claim for a retry, or fail it if no attempt is left: the
        item's state afterwards."""
        return self._send_named(op)

    def park(self, op: ParkOp) -> _write_queue.Pending[None]:
        """Defer a current claim without spending an attempt."""
        return self._send_named(op)

    def release(self, op: ReleaseOp) -> _write_queue.Pending[None]:
        """Give a current claim back: the item is ready again, its attempt given back."""
        return self._send_named(op)

    def offload(self, op: OffloadOp) -> _write_queue.Pending[None]:
        """Hand a current claim to an external batch."""
        return self._send_named(op)

    def cancel(self, op: CancelOp) -> _write_queue.Pending[tuple[str, bool]]:
        """Cancel an item: its state afterwards (a settled one is left as it was), and
        whether this call cancelled it."""
        return self._send_named(op)

    def cancel_where(self, op: CancelWhereOp) -> _write_queue.Pending[tuple[int, int | None]]:
        """Cancel a chunk: (how many were changed, the last id looked at, None at the end)."""
        return self._send_named(op)

    def requeue(self, op: RequeueOp) -> _write_queue.Pending[None]:
        """Take a failed or cancelled item back to ready, or refuse, naming its state."""
        return self._send_named(op)

    def set_project_status(self, op: ProjectStatusOp) -> _write_queue.Pending[str]:
        """Change a project's status (`_rules.project_status_after`); its status
        afterwards; UnknownProject if absent."""
        return self._send_named(op)

    def assign(self, op: AssignOp) -> _write_queue.Pending[None]:
        """Give an actor a project (idempotent); UnknownProject if absent."""
        return self._send_named(op)

    def set_limits(self, op: LimitsOp) -> _write_queue.Pending[LimitsRow | None]:
        """Change a project's limits (`asyncplane._rules.merged_limits`); return them (None:
        none left). UnknownProject if absent."""
        return self._send_named(op)

    def pause_schedule(self, op: PauseScheduleOp) -> _write_queue.Pending[None]:
        """Pause or resume a schedule (resumed, its next tick is the first after now);
        UnknownSchedule if absent."""
        return self._send_named(op)

    def requeue_where(self, op: WhereOp) -> _write_queue.Pending[tuple[int, int | None]]:
        """Requeue a chunk, as `cancel_where` cancels one."""
        return self._send_named(op)

    def import_rows(self, op: ImportOp) -> _write_queue.Pending[tuple[ImportOutcome, ...]]:
        """Add the rows not imported before, each with a "queued" event naming its source,
        and remember them with their content's digest; return each row's outcome."""
        return self._send_named(op)

    def set_schedule(self, op: ScheduleOp) -> _write_queue.Pending[ScheduleRow]:
        """Add or change a schedule (`asyncplane._schedule.placed`); UnknownProject if its
        project is absent."""
        return self._send_named(op)

    def run_schedules(self, op: RunSchedulesOp) -> _write_queue.Pending[SchedulesRun]:
        """Enqueue the due ticks of up to ``op.limit`` schedules, each tick's key with its
        item (`asyncplane._schedule.plan`); say what it did (`SchedulesRun`)."""
        return self._send_named(op)

    def _send_named(self, op: Any) -> _write_queue.Pending[Any]:
        """One of those writes to the writer, naming its op (so that one saved for a
        caller gone is still told: `orphaned`)."""
        return self._submit(_write_queue.Named(self._named_write(op), op))

    def finish_then_claim(
        self, settle: FinishOp, claim: ClaimOp
    ) -> tuple[_write_queue.Pending[int], _write_queue.Pending[list[ClaimRow]] | None]:
        """`finish`, and, where a settle and a claim share a round (`settle_with_claim`),
        the claim queued right behind it, to run only if the settle is not refused (the
        two commit together; refused, the claim answers `asyncplane._errors.NotRun`,
        nothing written). Elsewhere None: the caller claims once the settle is done."""
        settling = finish_request(settle, self._finish_many)
        finishing = self._submit(settling)
        if not self.settle_with_claim:
            return finishing, None
        riding: _write_queue.Grouped[list[ClaimRow]] = _write_queue.Grouped(
            _claim_key(claim), claim, self._claim_many, after=settling
        )
        return finishing, self._submit(riding)


def _claim_key(op: ClaimOp) -> tuple[Any, ...]:
    """What a claim groups by: claims of the same filters and lease run as one unit."""
    return ("claim", op.lease_seconds, op.actor_id, op.project_id)


#: Every finish groups with every other finish of its round.
_FINISH_KEY = ("finish",)


def finish_request(op: FinishOp, finish_many: GroupOp) -> _write_queue.Grouped[int]:
    """A finish as its round's writer gets it (from this process, or posted by another
    for combining): grouped with the round's other finishes, and ahead of the claims
    queued with them, so a finish and the next claim its caller asked for with it run
    in that order (see `asyncplane._write_queue.units`)."""
    return _write_queue.Grouped(_FINISH_KEY, op, finish_many, True)


class Backend(Protocol):
    """One method per operation. Implementations: `asyncplane._sqlite.SQLiteBackend` and
    `asyncplane._postgres.PostgresBackend`, both on `Writes`."""

    @property
    def clock(self) -> _clock.Clock:
        """The clock leases and events are measured by (the server's, on PostgreSQL,
        unless one was injected)."""
        ...

    @property
    def location(self) -> str:
        """Where the store lives, for messages: a file's path, a URL without password."""
        ...

    @property
    def writer(self) -> _write_queue.WriterBase | None:
        """The writer task's handle, or None before opening (tests, benchmarks, probe)."""
        ...

    def writable(self) -> None:
        """Raise ReadOnlyStore (or StoreClosed) if a write would be refused."""
        ...

    #: Whether a settle and the claim asked for with it (`ControlStore.finish_and_claim`,
    #: a freed slot's claim in `work()`) go to the writer together, to share a write
    #: round, or the claim after the settle.
    settle_with_claim: bool
    #: Whether the store keeps an import record's source and key only up to
    #: `asyncplane._rules.MAX_IMPORT_RECORD_BYTES` each (PostgreSQL, which indexes them),
    #: or at any length (SQLite: an earlier release's imports recorded longer ones).
    import_records_bounded: bool
    #: How often, at the longest, `data_version` and `settled_version` must be looked at
    #: to see what they say (None: whenever a waiter's poll interval says; PostgreSQL's
    #: move on a safety look's clock too, for a store that hears nothing: read-only, or
    #: its listener lost).
    versions_looked_within: float | None

    async def open(self) -> None:
        """Connect, create or migrate the schema; idempotent."""
        ...

    async def close(self, *, lost: bool = False) -> None:
        """Finish queued writes, then release every connection. ``lost``: closed because
        the backend broke (the engine opens it afresh next), not by the program."""
        ...

    @property
    def broken(self) -> bool:
        """True when the backend lost what it needs to write and must be opened afresh."""
        ...

    def forget(self) -> None:
        """Drop handles left behind by an event loop that has ended."""
        ...

    def on_orphaned(self, given_back: GivenBack, saved: SavedUnseen) -> None:
        """Hear of each give-back of a claim, and each settle or enqueue saved, whose
        caller went away while its round ran (see `Writes.on_orphaned`)."""
        ...

    def give_back(
        self, rows: Sequence[ClaimRow], actor_id: str | None, *, unseen: bool = False
    ) -> None:
        """Release claims nobody will run, queued now (see `Writes.give_back`)."""
        ...

    async def create_project(self, op: NewProject) -> None:
        """Create a project; ProjectExists if the id is taken."""
        ...

    def set_project_status(self, op: ProjectStatusOp) -> _write_queue.Pending[str]:
        """Change a project's status (`_rules.project_status_after`); its status
        afterwards; UnknownProject if absent."""
        ...

    async def get_project(self, project_id: str) -> ProjectRow:
        """Read one project; UnknownProject if absent."""
        ...

    async def list_projects(self) -> list[ProjectRow]:
        """Every project, ordered by id."""
        ...

    def assign(self, op: AssignOp) -> _write_queue.Pending[None]:
        """Give an actor a project (idempotent); UnknownProject if absent."""
        ...

    async def unassign(self, project_id: str, actor_id: str) -> None:
        """Take a project from an actor (idempotent); UnknownProject if absent."""
        ...

    async def visible_projects(self, actor_id: str) -> list[str]:
        """The ids of the projects assigned to an actor, ordered."""
        ...

    def enqueue(self, op: EnqueueOp) -> _write_queue.Pending[list[int]]:
        """Add the items (or find their twins), with their events; ids in input order.

        The request's future, queued by the call, not by the first await (or, while the
        write lock has yet to move, a coroutine that queues it); ReadOnlyStore and
        StoreClosed are raised by the call."""
        ...

    def claim(self, op: ClaimOp) -> _write_queue.Pending[list[ClaimRow]]:
        """Claim up to ``op.limit`` items, each with a fence above any it had before.

        The hot path: the request's future itself (so a caller resumes no coroutines in
        between), queued by the call, not by the first await; or, while the write lock
        is moving, a coroutine that queues it once awaited (`_write_queue.Pending`).
        Await what it returns at once, or the claim is made for no one and its items wait
        for their leases to lapse."""
        ...

    async def renew(self, op: RenewOp) -> float:
        """Extend a current claim's lease; return the new expiry (epoch seconds)."""
        ...

    def finish(self, op: FinishOp) -> _write_queue.Pending[int]:
        """Settle a current claim as done or failed; return how many twins it settled
        (an awaitable queued by the call, as `claim`'s)."""
        ...

    def finish_then_claim(
        self, settle: FinishOp, claim: ClaimOp
    ) -> tuple[_write_queue.Pending[int], _write_queue.Pending[list[ClaimRow]] | None]:
        """`finish`, and the claim riding on it where they share a round (see
        `Writes.finish_then_claim`); None for the claim elsewhere."""
        ...

    def retry(self, op: RetryOp) -> _write_queue.Pending[str]:
        """Defer a current claim for a retry, or fail it if no attempt is left."""
        ...

    def park(self, op: ParkOp) -> _write_queue.Pending[None]:
        """Defer a current claim without spending an attempt."""
        ...

    def release(self, op: ReleaseOp) -> _write_queue.Pending[None]:
        """Give a current claim back: the item is ready again, its attempt given back."""
        ...

    def offload(self, op: OffloadOp) -> _write_queue.Pending[None]:
        """Hand a current claim to an external batch."""
        ...

    async def offloaded(self, handle: str, actor_id: str | None) -> list[ItemRow]:
        """The items offloaded to ``handle``."""
        ...

    async def missing_fingerprints(
        self, op: PreflightOp, after_item_id: int, identity: tuple[str, ...]
    ) -> Backfill:
        """Up to ``op.chunk`` items after ``after_item_id`` that lack a fingerprint, and the
        fingerprints of those that get one (a read; `_fingerprint.backfill`)."""
        ...

    async def set_fingerprints(self, writes: list[tuple[str, int]]) -> None:
        """Write fingerprints the backfill found, to items still without one and not
        running."""
        ...

    async def any_twin_noted(self, op: PreflightOp) -> bool:
        """Whether a twin pair's content is noted in scope: whether `settle_pending_twins`
        has anything to look at (a read)."""
        ...

    async def settle_pending_twins(self, op: PreflightOp) -> tuple[int, bool]:
        """Settle up to ``op.chunk`` pending items of the noted contents whose twin is done,
        then forget the notes with no pair left; return (how many were settled, whether
        more may be left)."""
        ...

    async def twin_pairs(self, op: PreflightOp) -> list[tuple[str, str]]:
        """The content of every twin pair in scope, found by a walk of the store (a read,
        for a full preflight pass)."""
        ...

    async def note_twin_pairs(self, contents: list[tuple[str, str]]) -> None:
        """Note these contents (project id, fingerprint) as twin pairs to look at."""
        ...

    async def next_due(self, project_id: str | None, actor_id: str | None) -> float | None:
        """When the earliest claimable deferred item falls due or lease lapses, if any."""
        ...

    async def purge_candidates(
        self, cutoff: float, chunk: int, after: tuple[float, int] = PURGE_START
    ) -> Histories:
        """Up to ``chunk`` settled items last changed before ``cutoff``, with their events,
        in (last change, id) order after ``after`` (the last one of the chunk before)."""
        ...

    async def standing_as_archived(self, archived: tuple[Archived, ...]) -> set[int]:
        """The ids of the items that still stand settled as read (a read: what a purge
        may append to its archive; `purge_items` deletes by the same test)."""
        ...

    async def purge_items(self, archived: tuple[Archived, ...]) -> int:
        """Delete the items still settled as archived, then their events; return how many
        items went."""
        ...

    def import_rows(self, op: ImportOp) -> _write_queue.Pending[tuple[ImportOutcome, ...]]:
        """Add the rows not imported before, each with a "queued" event naming its source,
        and remember them with their content's digest; return each row's outcome."""
        ...

    async def stats(self) -> StoreStats:
        """Counts and ages, read in one snapshot."""
        ...

    def set_limits(self, op: LimitsOp) -> _write_queue.Pending[LimitsRow | None]:
        """Change a project's limits (`asyncplane._rules.merged_limits`); return them (None:
        none left). UnknownProject if absent."""
        ...

    async def get_limits(self, project_id: str | None) -> list[LimitsRow]:
        """One project's limits with its claimed count (UnknownProject if absent; a project
        without limits reads as all None), or every limited project's, ordered by id."""
        ...

    def set_schedule(self, op: ScheduleOp) -> _write_queue.Pending[ScheduleRow]:
        """Add or change a schedule (`asyncplane._schedule.placed`); UnknownProject if its
        project is absent."""
        ...

    async def list_schedules(self, name: str | None) -> list[ScheduleRow]:
        """Every schedule by name, or the one named (UnknownSchedule if absent)."""
        ...

    def pause_schedule(self, op: PauseScheduleOp) -> _write_queue.Pending[None]:
        """Pause or resume a schedule (resumed, its next tick is the first after now);
        UnknownSchedule if absent."""
        ...

    async def delete_schedule(self, name: str) -> None:
        """Delete a schedule and its ticks' keys (its items stay); UnknownSchedule if
        absent."""
        ...

    def run_schedules(self, op: RunSchedulesOp) -> _write_queue.Pending[SchedulesRun]:
        """Enqueue the due ticks of up to ``op.limit`` schedules, each tick's key with its
        item (`asyncplane._schedule.plan`); say what it did (`SchedulesRun`)."""
        ...

    async def next_tick(self, crons: bool) -> float | None:
        """When the earliest unpaused schedule's next tick falls, if any (a cron one
        only with ``crons``)."""
        ...

    async def next_cron_tick(self) -> float | None:
        """When the earliest unpaused cron schedule's next tick falls, if any."""
        ...

    async def schedule_ticks(self, name: str, limit: int) -> list[TickRow]:
        """The newest ``limit`` ticks of a schedule whose keys are kept, newest first."""
        ...

    async def list_assignments(self) -> list[AssignmentRow]:
        """Every assignment of every project."""
        ...

    async def list_items(self, op: ListOp) -> list[ItemRow]:
        """A page of the items ``op.where`` takes, in one snapshot, from an index."""
        ...

    def cancel(self, op: CancelOp) -> _write_queue.Pending[tuple[str, bool]]:
        """Cancel an item: its state afterwards (a settled one is left as it was), and
        whether this call cancelled it."""
        ...

    def requeue(self, op: RequeueOp) -> _write_queue.Pending[None]:
        """Take a failed or cancelled item back to ready, or refuse, naming its state."""
        ...

    def cancel_where(self, op: CancelWhereOp) -> _write_queue.Pending[tuple[int, int | None]]:
        """Cancel a chunk: (how many were changed, the last id looked at, None at the end)."""
        ...

    def requeue_where(self, op: WhereOp) -> _write_queue.Pending[tuple[int, int | None]]:
        """Requeue a chunk, as `cancel_where` cancels one."""
        ...

    async def settled_version(self) -> int:
        """A number that changes when an item may have settled, here or elsewhere."""
        ...

    async def mark_awaited(self, item_id: int) -> None:
        """Make the item's settle wake waiters in other processes from now on (wait()
        calls it before it looks again); a backend whose settled_version moves on any
        commit needs nothing."""
        ...

    async def export_items(self, op: ExportOp) -> Histories:
        """Items after an id, in id order, each with its whole history, in one snapshot."""
        ...

    async def copy_projects(self, op: CopyProjectsOp) -> int:
        """Add the projects and assignments not here yet; return how many projects."""
        ...

    async def copy_items(self, op: CopyOp) -> tuple[int, int]:
        """Add items (keeping their ids) with their histories, each once per source;
        return (copied, copied before). An id taken by an item from elsewhere refuses."""
        ...

    async def export_imports(self, after: tuple[str, str] | None, limit: int) -> list[ImportRecord]:
        """The store's import records after ``(source, source_key)``, in that order."""
        ...

    async def copy_imports(self, records: tuple[ImportRecord, ...]) -> None:
        """Remember these import records too (those already here stay as they are)."""
        ...

    async def store_identity(self) -> str | None:
        """What names this store wherever it is reached from, however its location is
        written: an SQLite file's resolved path; for a PostgreSQL schema, its cluster's
        system identifier, the database and the schema (None where the role may not
        read the identifier)."""
        ...

    async def last_item_id(self) -> int:
        """The highest item id ever handed out here (purged items' ids included)."""
        ...

    async def advance_item_ids(self, last: int, source: str) -> None:
        """Hand out no item id up to ``last`` from now on (never moves back), and record,
        in the same transaction, that a copy from ``source`` kept them clear
        (`copied_up_to`)."""
        ...

    async def source_dropped_up_to(self, source: str) -> int | None:
        """The last item an import of ``source`` had made when an import last dropped
        its table (`record_source_dropped`), or None: never dropped."""
        ...

    async def record_source_dropped(self, source: str) -> None:
        """Record that an import dropped ``source``'s table: its rows' records up to now
        are of that table (`_rules.imported_before`)."""
        ...

    async def copied_up_to(self, source: str) -> tuple[int, int | None]:
        """The highest item id copies from ``source`` brought here (0: none), and the
        highest their ends kept clear (`advance_item_ids`; None: none recorded, as by a
        release before 2026-12-06, or no copy from it ended yet)."""
        ...

    async def first_foreign_item(self, source: str) -> int | None:
        """The lowest id of an item here that no copy from ``source`` brought (None: every
        item came from it): what a copy into this store looks for before it writes."""
        ...

    async def sizes(self) -> tuple[int, int]:
        """Bytes the store takes on disk: (database, write-ahead log not yet folded in)."""
        ...

    def drain_guard(self) -> contextlib.AbstractAsyncContextManager[_lock.Guard]:
        """The default single-drainer guard; entering yields whether it was had."""
        ...

    async def get_item(self, item_id: int, actor_id: str | None) -> ItemRow:
        """Read an item's row."""
        ...

    async def ended_among(self, item_ids: list[int], states: tuple[str, ...]) -> list[int]:
        """Those of these items that are in one of ``states`` or no longer exist, in one
        read, unscoped: for the store's own watch of items waited for
        (`asyncplane._settles`), never a caller's."""
        ...

    async def get_events(
        self, item_id: int, actor_id: str | None, last: int | None = None
    ) -> list[EventRow]:
        """Read an item's events, oldest first (``last``: only the newest so many, read
        without the older ones: an item's history may hold thousands)."""
        ...

    async def count_states(self, project_id: str | None, actor_id: str | None) -> dict[str, int]:
        """How many items are in each state (of one project, or an actor's, or all)."""
        ...

    async def data_version(self) -> int:
        """A number that changes when another connection commits (SQLite: PRAGMA
        data_version; PostgreSQL: a count of NOTIFYs heard)."""
        ...

    async def tally(self) -> LedgerTally:
        """Whole-store ledger totals."""
        ...

    async def item_ids(self, state: str) -> list[int]:
        """The ids of every item in ``state``, ascending."""
        ...

    async def verify_ledger(
        self, limit: int | None, item_id: int | None = None
    ) -> list[_models.LedgerProblem]:
        """Compare every row (or one item's) with its history, in the database, and list
        disagreements."""
        ...

    async def settled_per_minute(
        self, since: float, actor_id: str | None
    ) -> list[tuple[float, str, str, int]]:
        """Items settled (done, failed, cancelled) since ``since``, counted per minute
        (the minute's start), project and state; only the actor's projects with one."""
        ...
