"""verify_ledger: do the rows agree with their own history?

The kinds are the nine of asyncplane's origin, plus ``cancelled_without_event``,
``twin_stranded`` (a row check: a twin held out of the claim index with nothing left to
free it would never be claimed) and ``state_disagrees``: replaying an item's events in
order (each event type leaves one state, `asyncplane._models.EVENT_TYPES`) must give the
row's state, in every case the other kinds do not already name.

Every transition of an item appends an event in the same transaction as the row change,
so an item's state can be replayed from its events (``queued`` leaves it ready,
``claimed`` and ``lease_expired`` claimed, ``done``, ``failed`` and ``cancelled``
settled, ``requeued`` and ``released`` ready again). A requeue starts a new life: the
checks of a settled row look at the events since the item's last ``requeued`` one, and
those of a ready row at the events since it was last requeued or released. The
verifier looks for rows and histories that disagree: a write that changed state without
recording it, or a record that was removed or added behind the store's back.

The checks run inside the database, one query per kind over an index, in one read
snapshot, so a store with a million items is verified without loading them into Python.
An empty list means rows and history agree; it cannot say that the right work was done,
only that nothing wrote state without recording it.
"""

from __future__ import annotations

from typing import Final

from asyncplane import _store, _validate
from asyncplane._models import LedgerProblem
from asyncplane._store import ControlStore

__all__ = ("LEDGER_PROBLEM_KINDS", "verify_ledger")

LEDGER_PROBLEM_KINDS: Final = {
    "no_creation_event": "the item exists but nothing recorded its arrival",
    "two_terminal_events": (
        "it settled (done/failed/cancelled) more than once with no requeue between"
    ),
    "terminal_without_event": "the row is done or failed but no event says how it got there",
    "cancelled_without_event": "the row is cancelled but no event says it was cancelled",
    "terminal_events_disagree": "row and events are both terminal, but for different outcomes",
    "event_without_terminal": "an event says it finished but the row still says otherwise",
    "fence_not_monotonic": "claim (and cancel) fences repeated or fell instead of rising",
    "fence_disagrees": "the row's fence differs from the last claim or cancel recorded",
    "ready_after_claim": (
        "the row says ready but the history shows it was claimed since it was last queued, "
        "requeued or released"
    ),
    "state_disagrees": "the row's state is not the one its events lead to, replayed in order",
    "owner_disagrees": "a running row names another owner than its last claim's",
    "never_moves_on": (
        "claimed with no lease end, or deferred with no due time: no claim would ever take it"
    ),
    "twin_stranded": (
        "a ready twin is held in line, but no twin of it runs or is claimable to free it"
    ),
    "orphan_events": "events reference an item that no longer exists",
}
"""Every kind of problem verify_ledger reports, mapped to what it means."""

#: Problems of one item are listed in this order (each dialect checks in it too).
_KIND_ORDER: Final = {kind: position for position, kind in enumerate(LEDGER_PROBLEM_KINDS)}


async def verify_ledger(
    store: ControlStore, *, limit: int | None = None, item_id: int | None = None
) -> list[LedgerProblem]:
    """List every disagreement between item rows and their events; [] when they agree.

    Args:
        store: The store to check (opened on first use, like every other call).
        limit: Stop after this many problems (all of them when None).
        item_id: Check only this item (the same checks, on that item's rows alone, so it
            costs what the item holds, not the store; an item that does not exist has no
            problems, unless events of it remain).

    Returns:
        The problems ordered by item id, each with its kind, item id and a detail.
    """
    if limit is not None:
        limit = _validate.positive_int(limit, "limit")
    # Any id events may be stored under (a tamperer's 0 or -3 too), as the whole check
    # reports them.
    one = None if item_id is None else _validate.stored_int(item_id, "item_id")
    backend = await _store.engine_of(store).ready()
    problems = await backend.verify_ledger(limit, one)
    problems.sort(key=lambda p: (p.item_id, _KIND_ORDER[p.kind]))
    return problems
