"""Public value types and the vocabulary of states and events."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Mapping
from typing import Any, Final

from asyncplane import _errors

__all__ = (
    "BACK_TO_READY",
    "EVENT_TYPES",
    "FINISH_STATUSES",
    "ITEM_STATES",
    "LIVE_STATES",
    "PENDING_STATES",
    "PROJECT_STATUSES",
    "RUNNING_STATES",
    "SERVICE_CLASSES",
    "SETTLED_STATES",
    "SETTLING_EVENTS",
    "TAKEN_AFTER_LAST_CLAIM",
    "TAKEN_FROM",
    "ClaimedItem",
    "Job",
    "LedgerProblem",
    "any_since_last",
    "edited",
    "from_timestamp",
    "left_to_other_checks",
    "loads",
    "one_item_checks",
    "ready_after_claim_check",
    "replay_case",
    "settling_checks",
    "sql_list",
    "waited",
)

#: Every state an item row can be in. ``ready`` is the first state, and the state a
#: ``requeue`` puts a failed or cancelled item back in; nothing else moves an item back
#: to ``ready``. A lapsed lease leaves it ``claimed`` until someone takes it over; a
#: retry or a park makes it ``deferred`` until it falls due; ``offloaded`` items wait for
#: an external batch to settle them. ``done``, ``failed`` and ``cancelled`` are settled.
ITEM_STATES: Final = (
    "ready", "deferred", "claimed", "offloaded", "done", "failed", "cancelled",
)  # fmt: skip
#: The states an item settles in: nothing runs it any more (a requeue aside).
SETTLED_STATES: Final = ("done", "failed", "cancelled")
#: The states of an item waiting to be claimed (a done twin settles those with dedup).
PENDING_STATES: Final = ("ready", "deferred")
#: The states of an item a worker holds (a claim, or an offload waiting to settle).
RUNNING_STATES: Final = ("claimed", "offloaded")
#: The states of an item not settled.
LIVE_STATES: Final = PENDING_STATES + RUNNING_STATES
FINISH_STATUSES: Final = ("done", "failed")
PROJECT_STATUSES: Final = ("open", "paused", "closed")
SERVICE_CLASSES: Final = ("standard", "realtime")

#: Every event type the ledger records, with the item state it leaves behind: replaying
#: an item's events through this table gives its row's state.
EVENT_TYPES: Final = {
    "queued": "ready",
    "deferred": "deferred",  # enqueued with a not_before still to come
    "claimed": "claimed",
    "lease_expired": "claimed",  # a takeover follows, or "failed" when no attempt is left
    "retried": "deferred",
    "parked": "deferred",
    "offloaded": "offloaded",
    "done": "done",
    "failed": "failed",
    "cancelled": "cancelled",  # its fence raised: the holder's next report is refused
    "requeued": "ready",  # a failed or cancelled item, back for a fresh attempt budget
    "released": "ready",  # a claim given back unrun (a worker stopping), its attempt too
}

#: The events after which a claimed item is ready again, by the store's own hand.
BACK_TO_READY: Final = ("requeued", "released")

#: The events that settle an item: at most one of them since its last "requeued".
SETTLING_EVENTS: Final = ("done", "failed", "cancelled")


#: The ledger checks that look at other items than the one they report (a held twin's
#: line: does any twin of its content run, or wait unheld?): a check of one item cannot
#: read that item's rows alone for them.
CHECKS_OF_OTHER_ITEMS: Final = ("twin_stranded",)


def one_item_checks(
    checks: tuple[tuple[str, str], ...], scoped: str, filtered: str
) -> tuple[tuple[str, str], ...]:
    """Each ledger check of one item, as a backend writes them: its statement ``scoped``
    to the item's rows alone, or, for a check that looks at other items too
    (`CHECKS_OF_OTHER_ITEMS`), the whole check ``filtered`` after (each a template with
    ``{check}``)."""
    return tuple(
        (kind, (filtered if kind in CHECKS_OF_OTHER_ITEMS else scoped).format(check=statement))
        for kind, statement in checks
    )


#: Per claimant, how many of its claims were taken over (the probe's check of a chaos
#: run): the same statement in both dialects.
TAKEN_FROM: Final = """
SELECT owner, count(*) FROM events WHERE event_type = 'lease_expired'
GROUP BY owner ORDER BY owner
"""
#: Per claimant, how many of its claims were taken over after its last claim: those it
#: still held when it stopped claiming (at most one a claimant that claims one at a time,
#: as a probe worker's coroutine does; one taken over earlier, while it went on, it was
#: told of as a fence refusal).
TAKEN_AFTER_LAST_CLAIM: Final = """
WITH last_claim AS (SELECT owner, max(event_id) AS last FROM events
                    WHERE event_type = 'claimed' GROUP BY owner)
SELECT e.owner, count(*) FROM events AS e LEFT JOIN last_claim AS l ON l.owner = e.owner
WHERE e.event_type = 'lease_expired' AND e.event_id > coalesce(l.last, 0)
GROUP BY e.owner ORDER BY e.owner
"""


def _last(item: str, events: tuple[str, ...], where: str = "") -> str:
    """SQL for the id of item ``item``'s last event of ``events`` (and ``where``), 0 if none."""
    return (
        f"coalesce((SELECT max(t.event_id) FROM events AS t WHERE t.item_id = {item}.item_id "
        f"AND t.event_type IN {sql_list(events)}{where}), 0)"
    )


def any_since_last(
    item: str, events: tuple[str, ...], since: tuple[str, ...], where: str = ""
) -> str:
    """SQL true when item ``item`` has an event of ``events`` (and ``where``, on ``t``)
    after its last event of ``since`` (any at all, if it has none): the ledger checks'
    "a settling event since it was last requeued" and the like, asked once an item. As an
    EXISTS of such an event, each candidate event looking up the item's last ``since``
    event again, an item claimed and released 25,000 times took minutes to check: every
    claim read every release."""
    return f"{_last(item, events, where)} > {_last(item, since)}"


def settling_checks() -> tuple[tuple[str, str], ...]:
    """The ledger checks of an item's settling events since its last requeue, the same
    statements in both dialects, each asked once an item (`any_since_last`): a row
    settled with no such event (done or failed; cancelled), one whose such event
    disagrees with it, and a live row with one. Joined to every settling event, each
    looking up the item's last requeue again, an item failed and requeued 2,000 times
    took a second to check, four times as long for twice the history."""
    settling, requeued = SETTLING_EVENTS, ("requeued",)
    since = f" AND t.event_id > {_last('i', requeued)}"

    def said(where: str = "") -> str:  # the settling event named (the first by name)
        return (
            "(SELECT min(t.event_type) FROM events AS t WHERE t.item_id = i.item_id "
            f"AND t.event_type IN {sql_list(settling)}{since}{where})"
        )

    disagrees = " AND t.event_type <> i.state"
    return (
        (
            "terminal_without_event",
            f"""
        SELECT i.item_id, 'row is ' || i.state || ' but no terminal event was recorded'
        FROM items AS i
        WHERE i.state IN {sql_list(FINISH_STATUSES)}
          AND NOT ({any_since_last("i", settling, requeued)})
        """,
        ),
        (
            "cancelled_without_event",
            f"""
        SELECT i.item_id, 'row is cancelled but no "cancelled" event was recorded'
        FROM items AS i
        WHERE i.state = 'cancelled' AND NOT ({any_since_last("i", settling, requeued)})
        """,
        ),
        (
            "terminal_events_disagree",
            f"""
        SELECT i.item_id, 'row is ' || i.state || ' but an event says ' || {said(disagrees)}
        FROM items AS i
        WHERE i.state IN {sql_list(SETTLED_STATES)}
          AND {any_since_last("i", settling, requeued, disagrees)}
        """,
        ),
        (
            "event_without_terminal",
            f"""
        SELECT i.item_id, 'a ' || {said()} || ' event exists but the row is ' || i.state
        FROM items AS i
        WHERE i.state NOT IN {sql_list(SETTLED_STATES)}
          AND {any_since_last("i", settling, requeued)}
        """,
        ),
    )


def ready_after_claim_check() -> str:
    """The ledger check "a ready row whose last claim came after it was last made ready
    again", the same statement in both dialects, asked once a ready item."""
    return f"""
        SELECT i.item_id, 'row is ready but the item was claimed at fence '
               || (SELECT max(t.fence) FROM events AS t
                   WHERE t.item_id = i.item_id AND t.event_type = 'claimed'
                     AND t.event_id > {_last("i", BACK_TO_READY)})
        FROM items AS i
        WHERE i.state = 'ready' AND {any_since_last("i", ("claimed",), BACK_TO_READY)}
        """


#: ``owner_disagrees``, the same in both dialects: a claimed or offloaded row whose owner
#: made none of the claims at its fence (only a claim sets a running row's owner; a
#: takeover is a claim, an offload keeps it). Rows with no claim at their fence are left
#: to ``fence_disagrees``; two claims at one fence are ``fence_not_monotonic``'s.
_CLAIM_AT_FENCE = """SELECT {what} FROM events AS e
                  WHERE e.item_id = i.item_id AND e.event_type = 'claimed'
                    AND e.fence = i.fence"""
OWNER_DISAGREES: Final = f"""
        SELECT i.item_id, 'the row names ' || coalesce(i.owner, 'no owner') || ' but its claim at '
               || 'fence ' || i.fence || ' was by '
               || ({_CLAIM_AT_FENCE.format(what="min(e.owner)")})
        FROM items AS i
        WHERE i.state IN ('claimed', 'offloaded')
          AND EXISTS ({_CLAIM_AT_FENCE.format(what="1")})
          AND NOT EXISTS ({_CLAIM_AT_FENCE.format(what="1")} AND e.owner = i.owner)
        """


def never_moves_on() -> str:
    """``never_moves_on``, the same in both dialects: a row no claim would ever take (a
    claim takes a claimed row over once its lease ends, a deferred one once it falls
    due). Only a row whose last event leaves it in its state: others are the replay
    check's (``state_disagrees``) or a settling check's."""
    checks = []
    for state, missing, why in (
        (
            "claimed",
            "lease_expires_at",
            "claimed with no lease end: no claim would ever take it over",
        ),
        ("deferred", "due_at", "deferred with no due time: it would never fall due"),
    ):
        leading = sql_list(tuple(e for e, left in EVENT_TYPES.items() if left == state))
        checks.append(f"""
        SELECT i.item_id, '{why}'
        FROM items AS i WHERE i.state = '{state}' AND i.{missing} IS NULL
          AND (SELECT e.event_type FROM events AS e WHERE e.item_id = i.item_id
               ORDER BY e.event_id DESC LIMIT 1) IN {leading}""")
    return "\n        UNION ALL".join(checks) + "\n        "


def left_to_other_checks(item: str) -> str:
    """The rows the replay check (``state_disagrees``) leaves to the checks that say more,
    as SQL conditions to AND: a settled row whose settling events since its last requeue
    are missing or disagree, a live row with a settling event since then, and a ready row
    claimed since it was last made ready again. The same in both dialects."""
    settled = sql_list(SETTLED_STATES)
    settling = any_since_last(item, SETTLING_EVENTS, ("requeued",))
    disagreeing = any_since_last(
        item, SETTLING_EVENTS, ("requeued",), f" AND t.event_type <> {item}.state"
    )
    claimed = any_since_last(item, ("claimed",), BACK_TO_READY)
    return f"""
          AND NOT ({item}.state IN {settled} AND (NOT ({settling}) OR {disagreeing}))
          AND NOT ({item}.state NOT IN {settled} AND {settling})
          AND NOT ({item}.state = 'ready' AND {claimed})"""


def edited(text: str, old: str, new: str, times: int = 1) -> str:
    """``text`` with ``old``, found there exactly ``times`` times, made ``new``: a later
    migration's object made again from an earlier migration's text, written as the
    difference (the earlier text is never edited)."""
    if text.count(old) != times:  # (checked at import, under -O too)
        raise ValueError(f"expected {times} of {old!r} in the text to edit")
    return text.replace(old, new)


def sql_list(values: tuple[str, ...]) -> str:
    """``('a', 'b')`` for an SQL ``IN``, from names of this module (never user input)."""
    return "(" + ", ".join(f"'{value}'" for value in values) + ")"


def replay_case(column: str, quote: str) -> str:
    """The SQL ``CASE`` that replays an event type in ``column`` to the state it leaves,
    made from `EVENT_TYPES` so the ledger check of every dialect follows the table (an
    unknown type reads as such, quoted with the dialect's ``quote`` function)."""
    whens = " ".join(f"WHEN '{event}' THEN '{state}'" for event, state in EVENT_TYPES.items())
    return f"CASE {column} {whens} ELSE 'an unknown event ' || {quote}({column}) END"


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimedItem:
    """An item handed to one worker, with the fence that proves the claim is current.

    Pass ``fence`` back to renew() and to the call that settles it (finish(), retry(),
    park(), release(), offload()); once the lease lapses and someone else claims the
    item, that fence is refused with FenceRejected.

    Attributes:
        item_id: The item's id.
        project_id: The project the item belongs to.
        payload: The payload given to enqueue().
        fence: This claim's token: above every earlier claim of the item.
        attempts: How many claims have counted against the item's budget, this one
            included (a park or a release gives its claim's attempt back; a requeue
            starts the count again).
        lease_expires_at: When the lease lapses unless renewed (aware, UTC).
        owner: Who claimed it.
        priority: Its priority (higher is claimed first).
        service_class: "realtime" or "standard".
        sla: Its deadline (aware, UTC), or None.
        fingerprint: Its content fingerprint, or None.
        max_attempts: How many claims it may have in all, or None for no limit.
        enqueued_at: When it was enqueued (aware, UTC).
        trace_context: The producer's trace context saved at enqueue (W3C headers such as
            ``traceparent``), or None: what the execution span links to.
    """

    item_id: int
    project_id: str
    payload: dict[str, Any]
    fence: int
    attempts: int
    lease_expires_at: dt.datetime
    owner: str
    priority: int = 0
    service_class: str = "standard"
    sla: dt.datetime | None = None
    fingerprint: str | None = None
    max_attempts: int | None = None
    enqueued_at: dt.datetime | None = None
    trace_context: dict[str, str] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One item for enqueue_many(), with its own lane settings.

    Attributes:
        payload: A JSON object (a dict, or any mapping, of plain JSON values).
        priority: Higher is claimed first (a 32-bit int; default 0).
        service_class: "realtime" items are claimed before "standard" ones of the same
            priority.
        sla: A deadline (an aware datetime or epoch seconds): among equals, the earliest
            deadline is claimed first; items without one come last.
        fingerprint: Its content identity; None derives one from the store's
            ``identity`` fields, if it has any.
        max_attempts: How many claims it may have in all (None: the store's default).
        not_before: Not claimable before this time.
    """

    payload: Mapping[str, Any]
    priority: int = 0
    service_class: str = "standard"
    sla: dt.datetime | float | None = None
    fingerprint: str | None = None
    max_attempts: int | None = None
    not_before: dt.datetime | float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerProblem:
    """One disagreement between an item's row and its recorded history.

    Attributes:
        kind: One of the names in `asyncplane.LEDGER_PROBLEM_KINDS`.
        item_id: The item whose row and events disagree.
        detail: What was found, in words.
    """

    kind: str
    item_id: int
    detail: str


def waited(now: float, since: float) -> float:
    """Seconds from ``since`` to ``now``, never below 0: a writer whose clock ran ahead of
    this one's can have stamped a time "later" than now (an age, a wait in the queue)."""
    return max(0.0, now - since)


def from_timestamp(value: float) -> dt.datetime:
    """Turn stored epoch seconds into an aware UTC datetime; a StorageError for a value
    no datetime can hold (a row written by hand: the store writes none)."""
    try:
        return _fromtimestamp(value, _UTC)
    except (TypeError, ValueError, OverflowError, OSError) as exc:
        raise _errors.StorageError(
            f"a stored time no datetime can hold: {str(value)[:40]} ({type(exc).__name__})"
        ) from exc


def loads(text: Any) -> Any:
    """``json.loads(text)``, a third of its time for the compact JSON the store writes.

    The C scanner json.loads uses is called directly; for anything else (whitespace
    around the value, bytes, a malformed or trailing text) json.loads itself answers, so
    the values and the errors (ValueError, RecursionError) are json.loads's."""
    try:
        value, end = _scan(text, 0)
    except (StopIteration, TypeError):
        return json.loads(text)
    if end != len(text):
        return json.loads(text)
    return value


# The scanner json.loads calls (typeshed does not name the attribute).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
# Bound once: every claimed item converts two timestamps on the event loop's thread.
_fromtimestamp = dt.datetime.fromtimestamp
_UTC: Final = dt.timezone.utc
