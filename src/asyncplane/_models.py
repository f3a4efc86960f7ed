"""Public value types and the vocabulary of states and events."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, Final

__all__ = (
    "EVENT_TYPES",
    "FINISH_STATUSES",
    "ITEM_STATES",
    "PROJECT_STATUSES",
    "ClaimedItem",
    "LedgerProblem",
    "from_timestamp",
)

#: Every state an item row can be in. ``ready`` is only ever the first state: once an item
#: has been claimed nothing moves it back to ``ready`` (a lapsed lease leaves it ``claimed``
#: until someone else takes it over with a higher fence).
ITEM_STATES: Final = ("ready", "claimed", "done", "failed")
FINISH_STATUSES: Final = ("done", "failed")
PROJECT_STATUSES: Final = ("open", "paused", "closed")

#: Every event type the ledger records, with the item state it leaves behind.
EVENT_TYPES: Final = {
    "queued": "ready",
    "claimed": "claimed",
    "lease_expired": "claimed",
    "done": "done",
    "failed": "failed",
}


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimedItem:
    """An item handed to one worker, with the fence that proves the claim is current.

    Pass ``fence`` back to renew() and finish(); once the lease lapses and someone else
    claims the item, that fence is refused with FenceRejected.

    Attributes:
        item_id: The item's id.
        project_id: The project the item belongs to.
        payload: The payload given to enqueue().
        fence: This claim's token: above every earlier claim of the item.
        attempts: How many times the item has been claimed, this claim included.
        lease_expires_at: When the lease lapses unless renewed (aware, UTC).
        owner: Who claimed it.
    """

    item_id: int
    project_id: str
    payload: dict[str, Any]
    fence: int
    attempts: int
    lease_expires_at: dt.datetime
    owner: str


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


def from_timestamp(value: float) -> dt.datetime:
    """Turn stored epoch seconds into an aware UTC datetime."""
    return dt.datetime.fromtimestamp(value, tz=dt.timezone.utc)
