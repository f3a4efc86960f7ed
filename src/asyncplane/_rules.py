"""The lane rules, decided once for every backend.

Pure code: no I/O, no SQL, no clock. A backend reads rows, hands them here, and writes
back what this module decides, in its own transaction and its own dialect. So each rule
has one home, whichever database holds the store:

* **Refusals and their words** (`unknown_project`, `project_denied`, `invisible_item`,
  `fence_refusal`, ...). "Absent" and "not yours" read the same to an actor, so a denial
  never reveals whether its target exists.
* **Enqueue dedup within one call** (`EnqueuePlan`): an item whose fingerprint matches an
  earlier one, in the store or earlier in the same call, takes that one's id.
* **Which items a claim takes** (`ClaimMerge`, `deal`): the candidates of every arm (ready,
  fallen due, lapsed), each read in claim order, merged into one claim order; one item per
  fingerprint; each row once, even if a later page shows it again; then dealt out to the
  requests of a group commit in request order.
* **Which projects a claim visits** (`first_page`, `first_pages`): only those in its reach
  (open; the one asked for; the actor's), each read from its own part of the claim
  index, its first page its share of the batch, the pages put in claim order and merged.
* **Twins in line**: of the ready items of one content, only the first in claim order is
  claimable, and none while a twin runs; the others are held out of the claim index.
  That rule is the one written in SQL, as each dialect's triggers (SQLite migration 5,
  PostgreSQL migration 3), because every write that moves an item must keep it.
* **Per-project limits** (`Limits`, `Quota`, `quota`, `LimitedReach`, `spend`,
  `token_due`, `merged_limits`): how many items of a limited project a claim may take (a slot under
  ``max_running``, a token of the ``per_minute``/``burst`` bucket), decided in the
  claim's own transaction from the project's limit row and its count of claimed items,
  which the backend reads under the row's lock. A limited project with nothing to give
  leaves the claim's reach; one with some gives a first page no bigger than that.
* **Lapses and retries** (`exhausted_lease_error`, `retry_plan`, `backoff`): when a
  claim's last attempt is spent, and when a retried item falls due.
* **Events** (`Event`, `arrival_events`, ...): what the ledger records for each
  transition, and the settlement fan-out of a done item to its pending twins.
* **Operating single items** (`cancel_plan`, `requeue_event`, `listing_arms`,
  `cancel_states`, `requeue_states`): what a cancel does to each state (a live item is
  settled and its fence raised, so its holder is refused; a settled one is left as it
  is), which items a requeue takes back, and which index arms a listing walks.

The order a write round runs its requests in (finishes ahead of the claims beside them,
so a settle frees its ``max_running`` slot for the claim sent with it) orders requests,
not rows: it lives with the rounds, in `asyncplane._write_queue` (`units`,
`combined_order`), shared by both backends' writers.

The claim order itself is ``priority DESC, service_class (realtime first), sla NULLS
LAST, item_id``: `claim_key` here, and the ``ORDER BY`` of each dialect's claim index.
"""

from __future__ import annotations

import collections
import datetime
import heapq
import json
import math
import struct
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from asyncplane import _backend, _errors, _models, _schedule, _validate
from asyncplane._record import Record

__all__ = (
    "CANCELLABLE",
    "COPIED_SETTINGS",
    "MAX_ITEM_ID",
    "MAX_PAGE",
    "REQUEUEABLE",
    "CancelPlan",
    "Candidate",
    "ClaimMerge",
    "EnqueuePlan",
    "Event",
    "LimitedReach",
    "Limits",
    "NewRow",
    "Quota",
    "RetryPlan",
    "SettingsPlan",
    "arrival_events",
    "backoff",
    "bucket",
    "cancel_plan",
    "cancel_states",
    "claim_key",
    "claim_row",
    "copied_here",
    "copied_setting",
    "copy_id_taken",
    "copy_settings_plan",
    "deal",
    "declared_schedule",
    "dedup_fingerprints",
    "event",
    "exhausted_bound",
    "exhausted_lease_events",
    "fence_refusal",
    "finish_event",
    "first_page",
    "first_pages",
    "history",
    "invisible_item",
    "keyset_start",
    "limited_due",
    "limits_row",
    "listing_arms",
    "merged_limits",
    "new_row",
    "next_chunk",
    "offload_event",
    "one_project",
    "park_due",
    "park_event",
    "project_denied",
    "project_exists",
    "project_status_after",
    "quota",
    "refuse_newer_schema",
    "refuse_unreadable_schema",
    "release_event",
    "requeue_event",
    "requeue_states",
    "retry_event",
    "retry_plan",
    "settlement_event",
    "spend",
    "takeover_event",
    "target",
    "tick_item",
    "token_due",
    "twin_event",
    "twin_events",
    "unknown_project",
    "unknown_schedule",
)

# --- refusals ------------------------------------------------------------------------------


def unknown_project(project_id: str) -> _errors.UnknownProject:
    """The control plane named a project that does not exist."""
    return _errors.UnknownProject(f"no project {project_id!r}")


def project_denied(project_id: str, actor_id: str) -> _errors.ScopeDenied:
    """An actor named a project it may not see: the same words whether it is absent or
    assigned to someone else."""
    return _errors.ScopeDenied(f"project {project_id!r} is not visible to actor {actor_id!r}")


def project_exists(project_id: str) -> _errors.ProjectExists:
    """create_project() was given a taken id."""
    return _errors.ProjectExists(f"project {project_id!r} exists already")


def invisible_item(item_id: int, actor_id: str | None) -> _errors.AsyncplaneError:
    """An item that is absent (control plane), or absent or foreign (an actor: the same
    words either way)."""
    if actor_id is None:
        return _errors.UnknownItem(f"no item {item_id}")
    return _errors.ScopeDenied(f"item {item_id} is not visible to actor {actor_id!r}")


def fence_refusal(
    item_id: int, fence: int, actor_id: str | None, found: Any
) -> _errors.AsyncplaneError:
    """Why a fenced write matched no row, from the item's ``(state, fence, visible,
    error)`` as read in the same transaction (None: no such item). A cancelled item says
    so, with the cancel's reason: its holder was stopped, not overtaken."""
    if found is None or (actor_id is not None and not found[2]):
        return invisible_item(item_id, actor_id)
    if found[0] == "cancelled":
        return _errors.ItemCancelled(item_id, fence, current_fence=found[1], reason=found[3])
    return _errors.FenceRejected(item_id, fence, current_fence=found[1], state=found[0])


def target(item_id: int, actor_id: str | None, found: Any) -> tuple[str, int]:
    """The ``(state, fence)`` of an item an operator names (cancel, requeue), from the
    same ``(state, fence, visible, ...)`` read as `fence_refusal`; absent or not the
    actor's, the same refusal as anywhere else."""
    if found is None or (actor_id is not None and not found[2]):
        raise invisible_item(item_id, actor_id)
    return found[0], found[1]


def one_project(rows: Sequence[Any], project_id: str) -> _backend.ProjectRow:
    """The project a read found, or the refusal for one that does not exist."""
    if not rows:
        raise unknown_project(project_id)
    return _backend.ProjectRow(*rows[0])


def history(rows: Sequence[Any], item_id: int, actor_id: str | None) -> list[_backend.EventRow]:
    """An item's events as its history read found them: no row at all means the item is
    not there for this caller (absent, or not the actor's); an item with no events yet
    reads as one row of nulls."""
    if not rows:
        raise invisible_item(item_id, actor_id)
    return [_backend.EventRow(*row) for row in rows if row[0] is not None]


def copied_here(item: Any, stored: Sequence[Any] | None) -> None:
    """Refuse to take an item as copied before (its source recorded it) when the item the
    destination holds under its id is not it: not the same project and moment of making.
    Two stores can share a source's key (a clone restored from one backup, two servers
    behind one tunnel's address); skipping the second's items would lose them unsaid.
    ``stored`` is the destination's (project_id, created_at) of the id, None if purged."""
    if stored is not None and (stored[0], stored[1]) != (item.project_id, item.created_at):
        raise _errors.InvalidInput(
            f"the destination's item {item.item_id} came from another store than this "
            "source (a clone of it, or another server behind the same address): a copy "
            "keeps item ids, so copy this source into a store of its own"
        )


class SettingsPlan:
    """What a copy does with a source's settings (`copy_settings_plan`). (A plain class:
    a NamedTuple costs `import asyncplane` a tenth of a millisecond to make.)"""

    __slots__ = ("add", "moved", "records")

    def __init__(
        self, add: _backend.CopyProjectsOp, records: tuple[str, ...],
        moved: tuple[tuple[str, float, float | None], ...],
    ) -> None:  # fmt: skip
        #: To add where the destination has none under the same id.
        self.add = add
        #: The keys to record them under, as copied from this source (`copied_setting`).
        self.records = records
        #: Schedules copied before that move on to the source's place: (name, next, last).
        self.moved = moved


#: A copy records the settings it added under its source's label with this appended.
COPIED_SETTINGS = "#settings"


def copied_setting(kind: str, *ids: str) -> str:
    """The key a copied setting is recorded under (one text, whatever its ids hold)."""
    return json.dumps([kind, *ids], ensure_ascii=False)


def copy_settings_plan(
    op: _backend.CopyProjectsOp, recorded: Container[str], here: Sequence[_backend.ScheduleRow],
    projects_here: Container[str], *, unrecorded_before: bool = False,
) -> SettingsPlan:  # fmt: skip
    """Which of a source's projects, assignments, limits and schedules a copy adds: each
    that no copy from this source added before (``recorded``). One it added stays as the
    destination has it since: a project's status, limits cleared, an assignment revoked,
    a schedule deleted are never undone by a second copy. A schedule it added that the
    destination still has (``here``) moves on to the source's next tick when that is later
    and its timetable is still the source's (one changed here keeps its own place), so no
    tick the source ran runs again here.

    ``unrecorded_before``: this source's items were copied here by a release that kept no
    record of the settings: a setting of a project the destination has (``projects_here``,
    before this copy) is taken as copied then (recorded, not added), since what is missing
    now may have been taken away on purpose; a project it lacks comes whole."""

    def fresh(key: str, project_id: str) -> bool:
        if key in recorded:
            return False
        return not unrecorded_before or project_id not in projects_here

    projects = [
        p
        for p in op.projects
        if fresh(copied_setting("project", p.project_id), p.project_id) or unrecorded_before
    ]  # fmt: skip  (a project is never taken away: one absent here is added)
    assignments = [
        a for a in op.assignments
        if fresh(copied_setting("assignment", a.project_id, a.actor_id), a.project_id)
    ]  # fmt: skip
    limits = [
        row for row in op.limits
        if fresh(copied_setting("limits", row.project_id), row.project_id)
    ]  # fmt: skip
    schedules = [s for s in op.schedules if fresh(copied_setting("schedule", s.name), s.project_id)]
    records = [
        key
        for key in (
            [copied_setting("project", p.project_id) for p in op.projects]
            + [copied_setting("assignment", a.project_id, a.actor_id) for a in op.assignments]
            + [copied_setting("limits", row.project_id) for row in op.limits]
            + [copied_setting("schedule", s.name) for s in op.schedules]
        )
        if key not in recorded
    ]
    by_name = {s.name: s for s in here}
    moved = [
        (s.name, s.next_at, s.last_at)
        for s in op.schedules
        if not fresh(copied_setting("schedule", s.name), s.project_id)
        and (mine := by_name.get(s.name)) is not None
        and mine.timetable() == s.timetable()
        and mine.next_at < s.next_at
    ]
    add = _backend.CopyProjectsOp(
        op.source, tuple(projects), tuple(assignments), tuple(limits), tuple(schedules)
    )
    return SettingsPlan(add, tuple(records), tuple(moved))


def imported_before(
    recorded: tuple[str | None, int] | None, digest: str, dropped_up_to: int | None
) -> _backend.ImportOutcome:
    """What an import does with a source row whose payload's digest is ``digest``, given
    the record under its key, ``(digest, item_id)`` or None, and the last item an import
    of the source had made when an import dropped the source table (`SOURCE_DROPPED`'s
    record; None: never dropped). A record from before that drop is of the table dropped:
    the row under its key now is of a table made since, whatever it holds. Other content
    under a recorded key is another row too (a table dropped and made again by hand, a
    taken row's rowid given to the next) or the row rewritten since. Either is copied, at
    least once rather than never, and the record then names the new item."""
    if recorded is None:
        return "new"
    if dropped_up_to is not None and recorded[1] <= dropped_up_to:
        return "changed"
    if recorded[0] is None:
        return "unverified"
    return "again" if recorded[0] == digest else "changed"


def dropped_meanwhile(
    source: str, seen: int | None, now: int | None
) -> _errors.InvalidInput | None:
    """An import whose source table another import dropped (and recorded) since it began
    (``seen``, the drop record then; ``now``, in the chunk's transaction): the rows it
    read before the drop would be taken for a table made since, and imported twice."""
    if seen == now:
        return None
    return _errors.InvalidInput(
        f"another import dropped {source}'s table while this one ran: nothing of this "
        "chunk was imported (its rows were imported by that one)"
    )


#: The key of an import's record of its drop of a source table (`dropped_source`).
SOURCE_DROPPED = "up_to"


def dropped_source(source: str) -> str:
    """The name an import records its drop of ``source``'s table under, beside the
    records of its rows: no import's source begins with "#" (each is a path)."""
    return "#dropped:" + source


#: The outcomes of `imported_before` that copy the row.
IMPORT_COPIES: frozenset[_backend.ImportOutcome] = frozenset({"new", "changed"})

#: The longest source name (its path and table) and the longest row key an import
#: records, each in bytes of UTF-8: PostgreSQL indexes the records by both, and an index
#: entry holds at most about 2.7 KB.
MAX_IMPORT_RECORD_BYTES = 1024


def unrecordable_import(
    source: str, key: str, recorded: object = None
) -> _errors.InvalidInput | None:
    """Why an import cannot record a row of ``source`` under ``key`` (too long to go to
    every backend), or None. Asked only of a row about to be recorded, on every backend:
    a row recorded before (by an earlier release's SQLite import: ``recorded``, its
    record) is passed over as ever, or its record moved on to its new item, and a
    store's new records can be copied anywhere."""
    if recorded is not None:
        return None
    for what, text in (("its key", key), ("the source's name (its path and table)", source)):
        if len(text.encode("utf-8")) > MAX_IMPORT_RECORD_BYTES:
            return _errors.InvalidInput(
                f"source row {_validate.shown(key)}: {what} is longer than "
                f"{MAX_IMPORT_RECORD_BYTES} bytes of UTF-8, more than an import records"
            )
    return None


def copy_unrecordable(source: str, key: str) -> _errors.InvalidInput | None:
    """Why a copy's destination that bounds its import records cannot take this one of
    the source's (an earlier release's SQLite import recorded it), or None."""
    for text in (key, source):
        if len(text.encode("utf-8")) > MAX_IMPORT_RECORD_BYTES:
            return _errors.InvalidInput(
                "nothing was copied: the source's import record of "
                f"{_validate.shown(source)} keyed {_validate.shown(key)} is longer than "
                f"{MAX_IMPORT_RECORD_BYTES} bytes of UTF-8, "
                "more than this destination keeps (a SQLite destination keeps it)"
            )
    return None


def imported_detail(
    source: str, key: str, recorded: tuple[str | None, int] | None
) -> dict[str, Any]:
    """The "queued" event's detail of an imported row: its source and key, and for a
    row copied again under a recorded key, the item that key brought before."""
    detail: dict[str, Any] = {"imported_from": source, "source_key": key}
    if recorded is not None:
        detail["replaces_import_of"] = recorded[1]
    return detail


def copy_id_taken(item_id: int) -> _errors.InvalidInput:
    """A copy found an item of the destination's own: before it wrote, or under a source
    item's id."""
    return _errors.InvalidInput(
        f"the destination holds an item {item_id} of its own: a copy keeps item ids, so "
        "it goes into an empty store (or one it copied into before)"
    )


def purged_while_awaited(item_id: int) -> _errors.ItemPurged:
    """A wait found its item gone after it had seen it live: only retention deletes an
    item, and only a settled one, so it settled, and was purged before the wait looked."""
    return _errors.ItemPurged(
        f"item {item_id} settled and was purged by retention before this wait read its "
        "outcome: its outcome and history are in that purge's archive"
    )


def copy_into_itself() -> _errors.InvalidInput:
    """A copy whose source and destination are one store (by any name)."""
    return _errors.InvalidInput("the source and the destination are one store")


def copy_ids_handed_out(
    handed_out: int, copied: int, kept_clear: int | None, source_last: int
) -> _errors.InvalidInput | None:
    """A destination that handed out item ids past what copies from this source brought
    (``copied``) or kept clear (``kept_clear``) made items of its own, purged since (one
    still there is `copy_id_taken`'s): a copy, which keeps ids, would give the source's
    items ids the destination's archive and ledger already name. None when it handed out
    none. Where copies from the source brought items but no end of one was recorded (a
    release before 2026-12-06 kept ids clear unrecorded), ids up to the source's last
    are taken for kept clear."""
    if kept_clear is None and copied:
        kept_clear = source_last
    if handed_out <= max(copied, kept_clear or 0):
        return None
    return _errors.InvalidInput(
        f"the destination has handed out item ids of its own (up to {handed_out}; their "
        "items were purged since): a copy keeps item ids, and ids are never reused, so it "
        "goes into a new store (or one it copied into before, with no item of its own)"
    )


def copy_running_twin(item_id: int, twin_id: int) -> _errors.InvalidInput:
    """A copy met a running item whose content twin already runs in the destination (on
    PostgreSQL, where one content runs at once across hosts: a unique index)."""
    return _errors.InvalidInput(
        f"item {item_id} runs (claimed or offloaded) and so does item {twin_id}, its content "
        "twin, in the destination, where one content runs at a time: the source's workers "
        "went on between two copies, or the source holds running twins from before their "
        "fingerprint was known. Stop the source's workers, let the running items settle, "
        "and copy again (what was copied is kept)"
    )


def declared_schedule(
    op: _backend.ScheduleOp, old: _backend.ScheduleRow | None, now: float
) -> _backend.ScheduleRow:
    """The row a schedule is stored as once declared (`_schedule.placed` says where it stands; a
    schedule declared again keeps whether it is paused, its last tick and its birth)."""
    anchor, next_at = _schedule.placed(
        op.timetable, None if old is None else old.timetable(),
        None if old is None else old.next_at, now,
    )  # fmt: skip
    item = op.item
    return _backend.ScheduleRow(
        op.name, op.project_id, item.payload_json, op.timetable.cron, op.timetable.every,
        op.timetable.timezone, op.catch_up, item.priority, item.service_class,
        item.fingerprint, item.dedup, item.max_attempts,
        False if old is None else bool(old.paused), anchor, next_at,
        None if old is None else old.last_at, now if old is None else old.created_at, now,
    )  # fmt: skip


def unknown_schedule(name: str) -> _errors.UnknownSchedule:
    """A schedule named that does not exist."""
    return _errors.UnknownSchedule(f"no schedule {name!r}")


def refuse_newer_schema(version: int, known: int) -> None:
    """A store written by a newer asyncplane is refused, whatever the backend."""
    if version > known:
        raise _errors.SchemaVersionError(
            f"the store has schema version {version}; this asyncplane knows versions up "
            f"to {known}: upgrade asyncplane to open it"
        )


def refuse_unreadable_schema(version: int, known: int, where: str) -> None:
    """A read-only opening needs a store of exactly this schema: not an empty ``where``
    (a file, a schema) and not one that needs migrating (which would write)."""
    if version == 0:
        raise _errors.NotAnAsyncplaneDatabase(f"the {where} is empty: not an asyncplane store yet")
    refuse_newer_schema(version, known)
    if version < known:
        raise _errors.SchemaVersionError(
            f"the store has schema version {version} and needs migrating to "
            f"{known}: open it once without read_only"
        )


# --- events --------------------------------------------------------------------------------


class Event(Record):
    """One ledger event to write, in the column order of both dialects' events table."""

    item_id: int
    event_type: str
    fence: int
    owner: str | None
    actor_id: str | None
    at: float
    detail_json: str | None


def event(
    item_id: int,
    event_type: str,
    fence: int,
    owner: str | None,
    actor_id: str | None,
    at: float,
    detail: Mapping[str, Any] | None = None,
) -> Event:
    """An event, its detail (if any) as JSON."""
    return Event(
        item_id,
        event_type,
        fence,
        owner,
        actor_id,
        at,
        None if detail is None else json.dumps(detail),
    )


# --- enqueue -------------------------------------------------------------------------------


class NewRow(Record):
    """A new item's row, in the column order of both dialects' INSERT."""

    project_id: str
    state: str
    payload_json: str
    priority: int
    service_class: str
    sla: float | None
    fingerprint: str | None
    dedup: bool
    max_attempts: int | None
    due_at: float | None
    created_at: float
    updated_at: float
    trace_context: str | None


def new_row(project_id: str, item: _backend.NewItem, now: float) -> NewRow:
    """The row an enqueued item starts as: ready, or deferred until a ``not_before``
    still to come."""
    deferred = item.not_before is not None and item.not_before > now
    return NewRow(
        project_id,
        "deferred" if deferred else "ready",
        item.payload_json,
        item.priority,
        item.service_class,
        item.sla,
        item.fingerprint,
        item.dedup,
        item.max_attempts,
        item.not_before if deferred else None,
        now,
        now,
        item.trace_context,
    )


def arrival_events(
    item_id: int,
    row: NewRow,
    actor_id: str | None,
    now: float,
    queued: Mapping[str, Any] | None = None,
) -> list[Event]:
    """A new item's first events: "queued" (with ``queued`` as its detail), then
    "deferred" if it waits for a ``not_before``."""
    events = [event(item_id, "queued", 0, None, actor_id, now, queued)]
    if row.state == "deferred":
        events.append(event(item_id, "deferred", 0, None, actor_id, now, {"due_at": row.due_at}))
    return events


def dedup_fingerprints(items: Iterable[_backend.NewItem]) -> list[str]:
    """The distinct fingerprints of a call's items that take part in dedup, sorted (so
    two calls lock the same contents in the same order)."""
    return sorted({item.fingerprint for item in items if item.dedup and item.fingerprint})


class EnqueuePlan:
    """Which of a call's items become new rows, and which take an existing id.

    ``found`` maps fingerprints to the id of an earlier twin in the store (the backend
    looked up `dedup_fingerprints`). An item with such a twin takes its id; an item whose
    fingerprint came earlier in the same call takes that item's id; every other item is
    new (`new` lists their positions, in input order).
    """

    def __init__(self, items: Sequence[_backend.NewItem], found: Mapping[str, int]) -> None:
        self._ids: list[int | None] = [None] * len(items)
        self._twin_of: dict[int, int] = {}  # position -> position whose id it shares
        first_of: dict[str, int] = {}  # fingerprint -> position of its first item
        self.new: list[int] = []
        for position, item in enumerate(items):
            fp = item.fingerprint
            if item.dedup and fp is not None:
                if fp in first_of:
                    self._twin_of[position] = first_of[fp]
                    continue
                first_of[fp] = position
                if fp in found:
                    self._ids[position] = found[fp]
                    continue
            self.new.append(position)

    def ids(self, inserted: Sequence[int]) -> list[int]:
        """Every item's id, in input order, given the ids the new rows got (in order)."""
        if len(inserted) != len(self.new):
            raise _errors.StorageError("the new rows of an enqueue were not all inserted")
        ids = list(self._ids)
        for position, item_id in zip(self.new, inserted, strict=True):
            ids[position] = item_id
        for position, first in self._twin_of.items():
            ids[position] = ids[first]
        resolved = [item_id for item_id in ids if item_id is not None]
        if len(resolved) != len(ids):  # every position has an id by now; never shorten
            raise _errors.StorageError("an enqueued item was left without an id")
        return resolved


# --- claims --------------------------------------------------------------------------------

#: The largest page a claim reads from one arm at a time.
MAX_PAGE = 1024


class Candidate(Record):
    """An item a claim may take, as both dialects' claim statements select it."""

    item_id: int
    state: str
    fence: int
    owner: str | None
    attempts: int
    max_attempts: int | None
    project_id: str
    fingerprint: str | None
    priority: int
    service_class: str
    sla: float | None


def claim_key(c: Candidate) -> tuple[Any, ...]:
    """The claim order: highest priority, realtime before standard, earliest SLA (none
    last), oldest."""
    return (-c.priority, c.service_class, c.sla is None, c.sla or 0.0, c.item_id)


class ClaimMerge:
    """Chooses a claim's items from its arms, each read page by page in claim order.

    Sans I/O, so the SQLite path (on the writer's thread) and the asyncio PostgreSQL path
    drive the same decision::

        merge = ClaimMerge(arms=len(statements), limit=total)
        while (arm := merge.hungry()) is not None:
            limit, offset = merge.next_page(arm)
            merge.feed(arm, run(statements[arm], limit, offset))
        chosen = merge.chosen

    An arm is one kind of claimable item (ready, fallen due) of one project in the claim's
    reach, or the lapsed claims of them all (`first_page` says how big each arm's first
    page is). The merge takes the smallest head of all arms each time (a heap: a pick
    costs log(arms), however many projects there are). An arm is read further only when
    the merge needs its head, so a later page is read only after items it offered were
    skipped as twins: a skipped item never pushes a later one out of the batch. One item
    per fingerprint (per project) is taken; a twin waits until the one taken now settles.
    Each item is taken once, even if a later page (a newer snapshot, where commits
    shifted the offsets) shows it again.

    With one arm, no quota and no two twins among the rows, the merge chooses the arm's
    first ``limit`` rows, in claim order: PostgreSQL's one-statement claim of a plain
    reach (`_postgres_sql.CLAIM_ALONE`) takes exactly those, dealt by `slots`, and bails
    out to this merge otherwise (`tests/test_rules.py` holds the merge to it).
    """

    def __init__(
        self,
        arms: int,
        limit: int,
        *,
        first_page: int | None = None,
        quotas: Mapping[str, Quota] | None = None,
        arm_projects: Sequence[str | None] = (),
        blocked: Container[str] = (),
    ) -> None:
        self._limit = limit
        # Projects whose quota refuses this claim alone (another claimer holds their
        # limits): their rows are not refused every claimer alike (`others_to_tell`).
        self._blocked = blocked
        # Limited projects: what each may still give, and (to stop reading a project that
        # has given all it may) which arms hold its ready and fallen-due items.
        self._quotas = quotas or {}
        self._arms_of: dict[str, list[int]] = {}
        for arm, project in enumerate(arm_projects):
            if project is not None and project in self._quotas:
                self._arms_of.setdefault(project, []).append(arm)
        # By default the first page is the whole batch (PostgreSQL reads it with every
        # other arm's); MAX_PAGE caps only the further pages read past skipped twins.
        page = first_page if first_page is not None else limit
        self._rows: list[collections.deque[Candidate]] = [collections.deque() for _ in range(arms)]
        self._page = [max(page, 1)] * arms
        self._offset = [0] * arms
        self._more = [True] * arms
        # The arms whose buffer is empty while more rows may come, which must be read
        # before the next pick: a flag per arm, and a stack of them (stale entries, of
        # arms fed since, are dropped as they surface), so a feed costs O(1).
        self._starving = [True] * arms
        self._starved = list(range(arms - 1, -1, -1))
        self._heads: list[tuple[tuple[Any, ...], int]] = []
        self._twins: set[tuple[str, str]] = set()
        self._seen: set[int] = set()
        self._refused = 0  # rows a project's quota refused
        #: The items chosen so far, in claim order.
        self.chosen: list[Candidate] = []

    def next_page(self, arm: int) -> tuple[int, int]:
        """The (limit, offset) of the page to read next from ``arm``."""
        return self._page[arm], self._offset[arm]

    def ask(self, arm: int, size: int) -> None:
        """Say that ``arm``'s next page was read with a limit of ``size`` (PostgreSQL
        sizes every first page in its one statement, as `first_page` would)."""
        self._page[arm] = max(size, 1)

    def feed(self, arm: int, rows: Iterable[Sequence[Any]]) -> None:
        """Give ``arm``'s next page, as asked for by `next_page`."""
        page = [row if isinstance(row, Candidate) else Candidate._make(row) for row in rows]
        asked = self._page[arm]
        self._offset[arm] += len(page)
        self._more[arm] = len(page) == asked
        buffered = self._rows[arm]
        if page and not buffered:
            heapq.heappush(self._heads, (claim_key(page[0]), arm))
        buffered.extend(page)
        self._page[arm] = min(asked * 2, MAX_PAGE)  # twins ahead: read further, faster
        self._starving[arm] = False

    @property
    def fetched(self) -> int:
        """How many rows all arms have read so far (on PostgreSQL: locked)."""
        return sum(self._offset)

    def others_to_tell(self, claimed: int) -> bool:
        """Whether rows read (on PostgreSQL: locked, so any claimer that came meanwhile
        passed over them) are left that another claimer may want: more than the
        ``claimed`` taken, leaving out those a project's quota refused, which it refuses
        every claimer alike. (Telling of those woke every claimer of the fleet to be
        refused them again, and tell again: a storm, while a rate-limited project's
        bucket was empty under a lapsed claim.)"""
        return self.fetched - self._refused > claimed

    def hungry(self) -> int | None:
        """Merge as far as the rows at hand allow; return the arm whose next page the
        merge needs, or None once it is done (`chosen` holds the answer)."""
        rows, heads = self._rows, self._heads
        starved, starving = self._starved, self._starving
        while len(self.chosen) < self._limit:
            while starved and not starving[starved[-1]]:
                starved.pop()
            if starved:
                return starved[-1]
            if not heads:
                return None
            _, arm = heapq.heappop(heads)
            buffered = rows[arm]
            if not buffered:
                continue  # the arm of a limited project that has given all it may
            candidate = buffered.popleft()
            if buffered:
                heapq.heappush(heads, (claim_key(buffered[0]), arm))
            elif self._more[arm]:
                starving[arm] = True
                starved.append(arm)
            if candidate.item_id in self._seen:
                continue
            twin = None
            if candidate.fingerprint is not None:
                twin = (candidate.project_id, candidate.fingerprint)
                if twin in self._twins:
                    self._seen.add(candidate.item_id)
                    continue
            quota = self._quotas.get(candidate.project_id)
            if quota is not None and not self._allowed(quota, candidate):
                self._refused += candidate.project_id not in self._blocked
                continue
            self._seen.add(candidate.item_id)
            if twin is not None:
                self._twins.add(twin)
            self.chosen.append(candidate)
        return None

    def _allowed(self, quota: Quota, candidate: Candidate) -> bool:
        """Whether a limited project may give this candidate, taking it from the quota if
        so; a project that can give no new run stops being read."""
        takeover = candidate.state == "claimed"
        allowed = quota.allows(takeover=takeover)
        if allowed:
            quota.take(takeover=takeover)
        if quota.room == 0:
            for arm in self._arms_of.pop(candidate.project_id, ()):
                if candidate.project_id not in self._blocked:  # read, refused by the quota
                    self._refused += len(self._rows[arm])
                self._rows[arm].clear()
                self._more[arm] = False
                self._starving[arm] = False
        return allowed


def sole_arm_choice(page: Sequence[Candidate], asked: int, limit: int) -> list[Candidate] | None:
    """What `ClaimMerge` chooses for a claim of ``limit`` items with one arm and no
    quota, from that arm's first page (``asked`` rows were asked for, in claim order),
    where the page settles it: no two of its first ``limit`` rows twins, and either the
    arm has nothing more (a short page) or the page holds the whole batch. None where the
    merge must read on (`tests/test_rules.py` holds the two to the same choice)."""
    if len(page) < limit and len(page) >= asked:
        return None  # a full page short of the batch: the arm may have more
    chosen = list(page[:limit])
    if len(chosen) > 1:
        prints = [(c.project_id, c.fingerprint) for c in chosen if c.fingerprint is not None]
        if len(set(prints)) != len(prints):
            return None  # twins: the merge skips them and reads on
    return chosen


def first_pages(
    rows: Iterable[Sequence[Any]],
) -> dict[tuple[str, str | None], list[Candidate]]:
    """Every arm's first page, from one statement's rows ``(arm tag, *candidate)``: the
    ready ("r") and fallen-due ("d") items of each project, and the lapsed claims ("l"),
    each page in claim order."""
    pages: dict[tuple[str, str | None], list[Candidate]] = {}
    for row in rows:
        candidate = Candidate._make(row[1:])
        key = (row[0], None if row[0] == "l" else candidate.project_id)
        pages.setdefault(key, []).append(candidate)
    for page in pages.values():
        page.sort(key=claim_key)
    return pages


def first_page(total: int, projects: int) -> int:
    """How many items a claim of ``total`` reads first from each project's arm: its share
    of the batch (the whole batch when it visits one project), so a claim over many
    projects reads about ``total + projects`` rows, not ``total * projects``; an arm that
    holds more of the batch is read further in doubling pages."""
    return max(1, -(-total // max(projects, 1)))


# --- limits --------------------------------------------------------------------------------

#: A bucket this close below a whole token holds it (float sums of refills are inexact,
#: and a claim woken when `token_due` said must find the token there).
_TOKEN_SLACK = 1e-9
#: How many floats past the division's answer `token_due` looks for the token (a few
#: roundings' worth), and how far past its answer it says, should it still not be there.
_TOKEN_STEPS = 64
_TOKEN_NUDGE = 1e-3


#: A project's limits as stored, with how many of its items are claimed now.
Limits = _backend.LimitsRow


def limits_row(row: Sequence[Any]) -> Limits:
    """A `Limits` from a backend's row, in its column order."""
    return Limits._make(row)


class Quota:
    """What a limited project may still give one claim: ``slots`` new runs (under
    ``max_running``; None: no such limit) and ``tokens`` claims of any kind (of the rate
    bucket; None: no rate). A takeover of a lapsed claim takes a token, not a slot: the
    item was running already."""

    __slots__ = ("slots", "taken", "tokens")

    def __init__(self, slots: int | None, tokens: int | None) -> None:
        self.slots = slots
        self.tokens = tokens
        #: How many claims took from it.
        self.taken = 0

    def allows(self, *, takeover: bool) -> bool:
        """Whether one more claim (a new run, or a takeover) is allowed."""
        if self.tokens is not None and self.tokens < 1:
            return False
        return takeover or self.slots is None or self.slots >= 1

    def take(self, *, takeover: bool) -> None:
        """Count one claim against the quota."""
        self.taken += 1
        if self.tokens is not None:
            self.tokens -= 1
        if not takeover and self.slots is not None:
            self.slots -= 1

    @property
    def room(self) -> int | None:
        """How many new runs it may still give (None: any number)."""
        if self.slots is None:
            return self.tokens
        return self.slots if self.tokens is None else min(self.slots, self.tokens)


def _capacity(limits: Limits) -> float:
    """The bucket's size: ``burst`` claims at once (one, without a burst)."""
    return float(limits.burst if limits.burst is not None else 1)


def bucket(limits: Limits, now: float) -> float | None:
    """The tokens in the project's rate bucket at ``now`` (None: no rate limit): what was
    left, refilled at ``per_minute / 60`` a second since, up to its size. A clock that went
    back refills nothing."""
    if limits.per_minute is None:
        return None
    capacity = _capacity(limits)
    if limits.tokens is None or limits.refilled_at is None:
        return capacity
    refill = max(0.0, now - limits.refilled_at) * limits.per_minute / 60.0
    return min(capacity, limits.tokens + refill)


def quota(limits: Limits, now: float) -> Quota:
    """What a limited project may give a claim at ``now``: the slots ``max_running``
    leaves beside the claimed items, the whole tokens in its bucket."""
    slots = None if limits.max_running is None else max(0, limits.max_running - limits.running)
    tokens = bucket(limits, now)
    return Quota(slots, None if tokens is None else int(tokens + _TOKEN_SLACK))


def spend(limits: Limits, now: float, taken: int) -> tuple[float, float] | None:
    """The bucket a claim leaves, ``(tokens, refilled_at)``, having taken ``taken``
    tokens at ``now``; None for a project with no rate limit (nothing to write)."""
    tokens = bucket(limits, now)
    if tokens is None:
        return None
    refilled = now if limits.refilled_at is None else max(now, limits.refilled_at)
    return max(0.0, tokens - taken), refilled


def token_due(limits: Limits, now: float) -> float | None:
    """When the rate bucket holds a whole token again, if it holds none now (the alarm of a
    claimer that found the project's ready items out of tokens); None otherwise.

    The moment is the first float time at which `bucket` itself says a token is there: the
    division's answer, rounded to a time, can fall a hair short of it, and a claimer woken
    then would find no token and be told the same moment again. The refill counts from
    the bucket's last refill when the clock reads earlier (a clock stepped back, or a
    process whose clock is behind another's): counted from ``now``, the answer fell
    short by the whole step, and walking up to it a float at a time took seconds a second
    of the step, on the event loop."""
    tokens = bucket(limits, now)
    if tokens is None or tokens + _TOKEN_SLACK >= 1 or limits.per_minute is None:
        return None
    start = now if limits.refilled_at is None else max(now, limits.refilled_at)
    due = start + (1.0 - tokens) * 60.0 / limits.per_minute
    for _ in range(_TOKEN_STEPS):
        if (bucket(limits, due) or 0.0) + _TOKEN_SLACK >= 1:
            return due
        due = math.nextafter(due, math.inf)
    return due + _TOKEN_NUDGE  # rounding beyond a few floats' worth: past it, surely


def limited_due(
    limits: Limits,
    now: float,
    *,
    ready: bool,
    due_at: float | None,
    takeover_at: float | None,
) -> float | None:
    """When a claim could next take something of a limited project: its ready items now,
    its first deferred item when it falls due, only while a slot is free (a settle frees
    one, and wakes the claimer); its first lapsed claim when it can be taken over; each no
    sooner than the rate bucket holds a token. None: nothing until an item settles."""
    room = quota(limits, now)
    times: list[float] = []
    if room.slots is None or room.slots >= 1:
        if ready:
            times.append(now)
        if due_at is not None:
            times.append(due_at)
    if takeover_at is not None:
        times.append(takeover_at)
    if not times:
        return None
    token = token_due(limits, now)
    return min(times) if token is None else max(min(times), token)


class LimitedReach:
    """The limited projects of one claim's reach: their limits, read under the claim's
    lock, and what each may give the claim (`quota`), whichever backend reads them."""

    def __init__(self) -> None:
        self.limits: dict[str, Limits] = {}
        self.quotas: dict[str, Quota] = {}
        #: Projects whose limits another claimer holds: refused to this claim alone.
        self.blocked: set[str] = set()

    def take(self, rows: Iterable[Iterable[Any]], now: float) -> list[str]:
        """Add the limits read (with their claimed counts); return the projects with room."""
        roomy = []
        for row in rows:
            found = limits_row(tuple(row))
            self.limits[found.project_id] = found
            given = self.quotas[found.project_id] = quota(found, now)
            if given.room != 0:
                roomy.append(found.project_id)
        return roomy

    def block(self, projects: set[str]) -> None:
        """Projects this claim may take nothing of (their limits are not its)."""
        for project in projects:
            self.quotas[project] = Quota(slots=0, tokens=0)
        self.blocked |= projects

    def stopped(self, runs: Mapping[str, int], now: float) -> None:
        """Count out runs this claim ended (exhausted lapsed claims) since the limits were
        read."""
        for project, ended in runs.items():
            if project in self.limits:
                found = self.limits[project]
                found = self.limits[project] = found._replace(running=found.running - ended)
                self.quotas[project] = quota(found, now)

    def spent(self, dealt: Mapping[str, int], now: float) -> list[tuple[str, float, float]]:
        """What the claims take of rate buckets, by project: (project, tokens left,
        refilled at), for each one with a rate."""
        return [
            (project, *left)
            for project, count in dealt.items()
            if project in self.limits
            and (left := spend(self.limits[project], now, count)) is not None
        ]

    def room(self, project: str, page: int) -> int:
        """How big a first page of the project a claim reads: its share, at most its room."""
        room = self.quotas[project].room
        return page if room is None else min(page, room)


def merged_limits(
    old: Limits | None,
    project_id: str,
    changes: Mapping[str, int | float | None],
    now: float,
) -> Limits | None:
    """A project's limits after `set_limits`: the ``changes`` given (None clears one), the
    rest as they were; None when no limit is left (the row goes). A rate bucket starts
    full, and one whose rate or burst changes keeps what it holds, up to its new size; a
    burst needs a rate (clearing the rate clears it)."""
    current: dict[str, Any] = (
        {"max_running": None, "per_minute": None, "burst": None}
        if old is None
        else {"max_running": old.max_running, "per_minute": old.per_minute, "burst": old.burst}
    )
    current.update(changes)
    if current["per_minute"] is None:
        if changes.get("burst") is not None:
            raise _errors.InvalidInput(
                "burst is the size of the per_minute bucket: give per_minute too"
            )
        current["burst"] = None  # no rate, no bucket
    if all(value is None for value in current.values()):
        return None
    new = Limits(project_id, current["max_running"], current["per_minute"], current["burst"],
                 None, None)  # fmt: skip
    if new.per_minute is None:
        return new
    held = None if old is None else bucket(old, now)
    tokens = _capacity(new) if held is None else min(_capacity(new), held)
    # Counted from now, or from the bucket's last refill if that is later (a clock behind
    # the process that last spent, or stepped back): the time between was refilled once
    # already, and a change of max_running alone must not refill it again.
    since = now if old is None or old.refilled_at is None else max(now, old.refilled_at)
    return new._replace(tokens=tokens, refilled_at=since)


def deal(
    chosen: Sequence[Candidate], ops: Sequence[_backend.ClaimOp]
) -> list[tuple[Candidate, _backend.ClaimOp]]:
    """Deal chosen items out to a group commit's claims in request order: the first
    request gets the first ``limit`` items, and so on."""
    return list(zip(chosen, slots(ops, len(chosen)), strict=True))


def slots(ops: Sequence[_backend.ClaimOp], count: int) -> list[_backend.ClaimOp]:
    """The request each of a round's first ``count`` chosen items goes to, in claim
    order (at most as many as the requests asked for in all)."""
    given: list[_backend.ClaimOp] = []
    for op in ops:
        given.extend([op] * min(op.limit, count - len(given)))
        if len(given) == count:
            break
    return given


def exhausted_bound(total: int) -> int:
    """How many lapsed claims with no attempt left one claim fails before it looks for
    work (bounded, so one claim never pays for a whole backlog of them)."""
    return max(total, 16)


def park_due(now: float, delay: float) -> float:
    """When a parked item falls due again."""
    return now + delay


def exhausted_lease_events(
    c: Candidate, actor_id: str | None, now: float
) -> tuple[str, list[Event]]:
    """A lapsed claim whose last attempt is spent fails instead of moving on: the error
    it fails with, and its events ("lease_expired", then "failed")."""
    error = f"attempts exhausted: the lease of attempt {c.attempts} of {c.max_attempts} lapsed"
    return error, [
        event(c.item_id, "lease_expired", c.fence, c.owner, actor_id, now),
        event(c.item_id, "failed", c.fence, c.owner, actor_id, now, {"error": error}),
    ]


def takeover_event(c: Candidate, op: _backend.ClaimOp, now: float) -> Event:
    """The "lease_expired" a takeover records first, at the previous holder's fence, so
    the history shows who lost the item and why."""
    return event(
        c.item_id, "lease_expired", c.fence, c.owner, op.actor_id, now, {"taken_over_by": op.owner}
    )


def claim_row(
    c: Candidate, op: _backend.ClaimOp, now: float, claimed: Sequence[Any]
) -> _backend.ClaimRow:
    """What a claim hands out: from the claimed row (as both dialects' claim statements
    return it: item_id, project_id, payload, fence, attempts, created_at, trace_context),
    the new fence and attempts and what the row keeps; the rest from the candidate."""
    _, project_id, payload_json, fence, attempts, created_at, trace_context = claimed[:7]
    return _backend.ClaimRow(
        c.item_id, project_id, payload_json, fence, attempts, op.owner, now + op.lease_seconds,
        c.priority, c.service_class, c.sla, c.fingerprint, c.max_attempts, created_at,
        trace_context, c.state == "claimed",
    )  # fmt: skip


# --- settlements ---------------------------------------------------------------------------


class RetryPlan(Record):
    """What a retry does: defer the item until ``due_at`` or fail it, with ``error``."""

    state: str
    due_at: float | None
    error: str | None

    @property
    def event_type(self) -> str:
        """The event it records: "retried", or "failed" when no attempt was left."""
        return "failed" if self.state == "failed" else "retried"


def backoff(attempts: int, base: float, cap: float, jitter: float) -> float:
    """The delay before retry number ``attempts``: ``base`` doubled per earlier attempt,
    jittered by x0.5 to x1.5 (``jitter`` in [0, 1)) to spread a burst, at most ``cap``."""
    doublings = min(max(attempts - 1, 0), 60)  # past any cap long before; no overflow
    return min(cap, base * (1 << doublings) * (0.5 + jitter))


def retry_plan(
    op: _backend.RetryOp, attempts: int, max_attempts: int | None, now: float
) -> RetryPlan:
    """Defer for another attempt while one is left (after ``op.delay``, or the backoff);
    otherwise fail, saying so."""
    if max_attempts is not None and attempts >= max_attempts:
        reason = op.error or "no reason given"
        return RetryPlan(
            "failed", None, f"attempts exhausted ({attempts} of {max_attempts}): {reason}"
        )
    delay = (
        op.delay
        if op.delay is not None
        else backoff(attempts, op.backoff_base, op.backoff_max, op.jitter)
    )
    return RetryPlan("deferred", now + delay, op.error)


def settlement_event(
    item_id: int,
    event_type: str,
    fence: int,
    owner: str | None,
    actor_id: str | None,
    now: float,
    *,
    error: str | None = None,
    due_at: float | None = None,
    handle: str | None = None,
) -> Event:
    """The event of a settlement (done, failed, retried, parked, offloaded) with the
    detail each records: the error, when it falls due, the external batch."""
    detail: dict[str, Any] = {}
    if error is not None or event_type == "retried":
        detail["error"] = error
    if due_at is not None:
        detail["due_at"] = due_at
    if handle is not None:
        detail["handle"] = handle
    return event(item_id, event_type, fence, owner, actor_id, now, detail or None)


def retry_event(op: _backend.RetryOp, plan: RetryPlan, owner: str | None, now: float) -> Event:
    """The event a retry records: "retried" with its error and due time, or "failed"."""
    return settlement_event(
        op.item_id, plan.event_type, op.fence, owner, op.actor_id, now,
        error=plan.error, due_at=plan.due_at,
    )  # fmt: skip


def park_event(op: _backend.ParkOp, owner: str | None, due: float, now: float) -> Event:
    """The event a park records, with when the item falls due again."""
    return settlement_event(op.item_id, "parked", op.fence, owner, op.actor_id, now, due_at=due)


def release_event(op: _backend.ReleaseOp, owner: str | None, now: float) -> Event:
    """The event a release records: the claim given back unrun, the item ready again."""
    return settlement_event(op.item_id, "released", op.fence, owner, op.actor_id, now)


def offload_event(op: _backend.OffloadOp, owner: str | None, now: float) -> Event:
    """The event an offload records, with the external batch's handle."""
    return settlement_event(
        op.item_id, "offloaded", op.fence, owner, op.actor_id, now, handle=op.handle
    )


def settle_as_one(ops: Sequence[_backend.FinishOp]) -> bool:
    """Whether a round's finishes may settle in one statement: several, of distinct items."""
    return len(ops) > 1 and distinct_items(ops)


def distinct_items(ops: Sequence[_backend.FinishOp]) -> bool:
    """Whether finishes name distinct items. The same item twice goes one by one, so that
    the second is refused by the first (one statement would match the item once and could
    not say which of the two it was)."""
    return len({op.item_id for op in ops}) == len(ops)


def finish_event(op: _backend.FinishOp, owner: str | None, now: float) -> Event:
    """The event a finish records: "done", or "failed" with its error."""
    return settlement_event(
        op.item_id, op.status, op.fence, owner, op.actor_id, now, error=op.error
    )


def twin_events(
    done_id: int, twins: Iterable[Any], actor_id: str | None, now: float
) -> list[Event]:
    """Settlement dedup: each pending twin ``(item_id, fence)`` of a done item is done
    too, with its result; the event names the item it was settled from."""
    template = twin_event(done_id, actor_id, now)
    return [template._replace(item_id=twin_id, fence=fence) for twin_id, fence in twins]


def twin_event(done_id: int, actor_id: str | None, now: float) -> Event:
    """The event of each pending twin a done item settles, but for the twin's id and fence
    (0 here): PostgreSQL's one-statement finish fills them in for the twins it settles."""
    return event(0, "done", 0, None, actor_id, now, {"deduplicated_from": done_id})


# --- operating single items ----------------------------------------------------------------

#: The states a requeue takes back to ready.
REQUEUEABLE: tuple[str, ...] = ("failed", "cancelled")
#: The states a cancel settles: every live one.
CANCELLABLE: tuple[str, ...] = _models.LIVE_STATES


class CancelPlan(Record):
    """A cancel's write: the fence it raises the item to, and its event."""

    fence: int
    event: Event


def cancel_plan(
    item_id: int,
    state: str,
    fence: int,
    reason: str | None,
    actor_id: str | None,
    now: float,
    expected: tuple[str, ...] = (),
    expected_fence: int | None = None,
) -> CancelPlan | None:
    """What cancelling an item in ``state`` at ``fence`` writes; None for one settled
    already (done, failed or cancelled), or in none of the states its caller ``expected``
    it in, or at another fence than ``expected_fence`` (a page shown a while ago: a claim,
    a takeover or a cancel since raised it), which stays as it is.

    The fence rises as on a takeover, whatever the state: a claimed or offloaded item's
    holder is refused (`ItemCancelled`) at its next renew or settle, and should the item
    be requeued, its next claim's fence is above every earlier one. Twins are not
    settled: a cancel only stops holding them back.
    """
    if state in _models.SETTLED_STATES or not _as_expected(state, fence, expected, expected_fence):
        return None
    raised = fence + 1
    detail: dict[str, Any] = {"from": state}
    if reason is not None:
        detail["reason"] = reason
    return CancelPlan(raised, event(item_id, "cancelled", raised, None, actor_id, now, detail))


def requeue_event(
    item_id: int, state: str, fence: int, actor_id: str | None, now: float,
    expected: tuple[str, ...] = (), expected_fence: int | None = None,
) -> Event:  # fmt: skip
    """The "requeued" event that takes a failed or cancelled item back to ready (who,
    when, from which state); any other state, or one its caller did not expect it in, or
    another fence (``expected``, ``expected_fence``: a page shown a while ago, since which
    the item was requeued and ran again, say), is refused, naming it."""
    if state not in REQUEUEABLE or not _as_expected(state, fence, expected, expected_fence):
        raise _errors.NotRequeueable(item_id, state, expected, fence, expected_fence)
    return event(item_id, "requeued", fence, None, actor_id, now, {"from": state})


def tick_item(row: _backend.ScheduleRow) -> tuple[_backend.NewItem, str | None]:
    """What a schedule's tick enqueues: its item, and the fingerprint of a pending twin
    (ready or deferred, `_models.PENDING_STATES`) stored with dedup off whose id the tick
    takes instead, adding none (None: it always adds one).

    A schedule's work runs each tick: its fingerprint (given, or the store's identity's)
    and ``dedup`` keep ticks from piling up while one waits, not later ticks from running.
    So a tick never takes a running or a done twin's id, and its item is stored with dedup
    off: no done twin settles it before it runs (the preflight, a twin's finish), while
    the twins-in-line rule still holds it back until a running twin has finished. Nor does
    it take a pending twin with dedup on (one requeued, say): that one may be so settled."""
    item = row.item()
    pending_twin = item.fingerprint if item.dedup else None
    return item._replace(dedup=False), pending_twin


def project_status_after(current: str, status: str, expected: tuple[str, ...]) -> str:
    """A project's status once asked to become ``status``: as asked, unless its caller
    ``expected`` it in other statuses than ``current`` (a page shown a while ago: a
    project closed since stays closed)."""
    return status if not expected or current in expected else current


def _as_expected(
    state: str, fence: int, expected: tuple[str, ...], expected_fence: int | None
) -> bool:
    """Whether an item stands as an operator's action expects it to (``if_state``,
    ``if_fence``: none given, however it stands)."""
    if expected and state not in expected:
        return False
    return expected_fence is None or fence == expected_fence


def beyond_its_microsecond(bound: float | None, given: object, *, later: bool) -> float | None:
    """An exclusive time bound of a listing (``created_after=`` and the like), as its
    filter compares stored times with it: where the caller gave a datetime (one a listing
    handed out, say: a row's own ``created_at``), every stored time shown as that datetime
    (times are kept to the float's precision, finer than its microsecond) is excluded too,
    and none shown as another: the bound is the last float shown as it, ``later`` for an
    "after", the first for a "before". Epoch seconds are taken as they are."""
    if bound is None or not isinstance(given, datetime.datetime):
        return bound
    try:
        shown = _models.from_timestamp(bound)
    except _errors.StorageError:  # the float rounded past the last datetime (its own max)
        return bound

    def shown_so(key: int) -> bool:
        try:
            return _models.from_timestamp(_float_of(key)) == shown
        except _errors.StorageError:  # past the last time a datetime holds: another
            return False

    # Bisected between the floats as integers in order (`_key_of`): about sixty looks
    # whatever the bound. Stepping float by float took as many steps as there are floats
    # in a microsecond there: a few near today, billions near the epoch (1970 itself: the
    # event loop stopped for good).
    sign = 1 if later else -1
    same, other = _key_of(bound), _key_of(bound + sign * 2e-6) + sign  # shown as another
    while abs(other - same) > 1:
        middle = (same + other) // 2
        if shown_so(middle):
            same = middle
        else:
            other = middle
    return _float_of(same)


def _key_of(value: float) -> int:
    """A finite float as an integer, in the floats' order: neighbours one apart."""
    bits = int.from_bytes(struct.pack("<d", value), "little", signed=True)
    return bits if bits >= 0 else -(bits & 0x7FFF_FFFF_FFFF_FFFF)


def _float_of(key: int) -> float:
    """`_key_of` undone."""
    bits = key if key >= 0 else -key | -0x8000_0000_0000_0000
    return float(struct.unpack("<d", bits.to_bytes(8, "little", signed=True))[0])


def listing_arms(states: tuple[str, ...], project: bool) -> tuple[str, ...]:
    """The states a listing walks one index arm each for: those asked for; for one
    project with none asked, every state (the project's index is by state); none at all
    (the primary key) for the whole store with no state asked."""
    if states:
        return states
    return _models.ITEM_STATES if project else ()


#: Above every item id (both backends' ids are 64-bit signed).
MAX_ITEM_ID = 2**63 - 1


def keyset_start(newest: bool, after: int | None) -> int:
    """Where a listing starts: after ``after``, or from the newest (or oldest) end.

    Newest first, the bound is the highest id the page may hold (``item_id <=``), not one
    past it: one past the largest id a store hands out, 2**63 - 1, is not a 64-bit number.
    Oldest first, it is the id the page starts after (``item_id >``), 0 from the start.
    """
    if newest:
        return MAX_ITEM_ID if after is None else after - 1
    return 0 if after is None else after


def next_chunk(ids: Sequence[int], chunk: int) -> int | None:
    """Where a filter-wide cancel or requeue goes on: after the last id of a full chunk;
    None when the chunk was not full (nothing is left)."""
    return ids[-1] if len(ids) == chunk else None


def cancel_states(states: tuple[str, ...]) -> tuple[str, ...]:
    """The states a filter-wide cancel walks: those asked for that a cancel changes."""
    return tuple(state for state in (states or CANCELLABLE) if state in CANCELLABLE)


def requeue_states(states: tuple[str, ...]) -> tuple[str, ...]:
    """The states a filter-wide requeue walks: those asked for that a requeue takes."""
    return tuple(state for state in (states or REQUEUEABLE) if state in REQUEUEABLE)
