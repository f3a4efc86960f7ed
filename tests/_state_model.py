"""The plain model the state machine (tests/test_state_machine.py) holds the store to.

A model item is what an item's row and history should be, kept in plain Python; the
machine's rules change it as they call the store, and its invariant compares the store
with it through the views below (a row as ``item()`` gives it, a claim, an event).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

from asyncplane import ClaimedItem


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job as a rule draws it (times relative: sla to T0, not_before to now)."""

    priority: int = 0
    service_class: str = "standard"
    sla: float | None = None
    fingerprint: str | None = None
    task: str | None = None  # the identity payload key: a derived fingerprint
    max_attempts: int | None = None
    not_before: float | None = None
    dedup: bool = True  # for enqueue() one job at a time (enqueue_many has one for all)


# (event_type, fence, owner, actor_id, detail, at)
Event = tuple[str, int, "str | None", "str | None", "dict[str, Any] | None", dt.datetime]


@dataclasses.dataclass(eq=False)
class ModelItem:
    item_id: int
    project_id: str
    payload: dict[str, Any]
    created_at: float
    updated_at: float
    priority: int = 0
    service_class: str = "standard"
    sla: float | None = None
    fingerprint: str | None = None
    dedup: bool = True
    max_attempts: int | None = None
    due_at: float | None = None
    state: str = "ready"
    fence: int = 0
    attempts: int = 0
    owner: str | None = None
    lease_expires_at: float | None = None
    result: Any = None
    error: str | None = None
    offload_handle: str | None = None
    claimed_at: float | None = None
    events: list[Event] = dataclasses.field(default_factory=list)

    def claim_key(self) -> tuple[Any, ...]:
        # 'realtime' < 'standard': the two classes sort the way the claim order wants.
        return (-self.priority, self.service_class, self.sla is None, self.sla or 0.0, self.item_id)

    def exhausted(self) -> bool:
        return self.max_attempts is not None and self.attempts >= self.max_attempts


def pick_batch(
    ordered: Sequence[ModelItem], limit: int, quotas: dict[str, list[int | None]] | None = None
) -> list[ModelItem]:
    """The first ``limit`` items, at most one per (project, fingerprint), and of a limited
    project no more than its quota ``[slots, tokens]`` allows (a takeover of a lapsed
    claim takes a token but no slot); the quotas are spent as items are picked."""
    chosen: list[ModelItem] = []
    seen: set[tuple[str, str]] = set()
    for item in ordered:
        twin = None if item.fingerprint is None else (item.project_id, item.fingerprint)
        if twin is not None and twin in seen:
            continue
        quota = (quotas or {}).get(item.project_id)
        if quota is not None:
            slots, tokens = quota
            takeover = item.state == "claimed"
            if (tokens is not None and tokens < 1) or (
                not takeover and slots is not None and slots < 1
            ):
                continue
            quota[0] = slots if takeover or slots is None else slots - 1
            quota[1] = None if tokens is None else tokens - 1
        if twin is not None:
            seen.add(twin)
        chosen.append(item)
        if len(chosen) == limit:
            break
    return chosen


def by_claim_order(items: list[ModelItem]) -> list[ModelItem]:
    return sorted(items, key=ModelItem.claim_key)


def as_datetime(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)


def optional_datetime(seconds: float | None) -> dt.datetime | None:
    return None if seconds is None else as_datetime(seconds)


ROW_KEYS = (
    "item_id",
    "project_id",
    "state",
    "payload",
    "fence",
    "attempts",
    "owner",
    "lease_expires_at",
    "created_at",
    "updated_at",
    "priority",
    "service_class",
    "sla",
    "fingerprint",
    "max_attempts",
    "due_at",
    "result",
    "error",
    "offload_handle",
    "claimed_at",
)


def row_view(row: dict[str, Any]) -> dict[str, Any]:
    assert set(row) == set(ROW_KEYS)
    return row


def model_row_view(item: ModelItem) -> dict[str, Any]:
    return {
        "item_id": item.item_id,
        "project_id": item.project_id,
        "state": item.state,
        "payload": item.payload,
        "fence": item.fence,
        "attempts": item.attempts,
        "owner": item.owner,
        "lease_expires_at": optional_datetime(item.lease_expires_at),
        "created_at": as_datetime(item.created_at),
        "updated_at": as_datetime(item.updated_at),
        "priority": item.priority,
        "service_class": item.service_class,
        "sla": optional_datetime(item.sla),
        "fingerprint": item.fingerprint,
        "max_attempts": item.max_attempts,
        "due_at": optional_datetime(item.due_at),
        "result": item.result,
        "error": item.error,
        "offload_handle": item.offload_handle,
        "claimed_at": optional_datetime(item.claimed_at),
    }


def claimed_view(claim: ClaimedItem) -> dict[str, Any]:
    # The model has no tracing: a trace context saved by a span of another test is not its.
    return dataclasses.asdict(dataclasses.replace(claim, trace_context=None))


def model_claimed_view(item: ModelItem) -> dict[str, Any]:
    assert item.owner is not None and item.lease_expires_at is not None
    return dataclasses.asdict(
        ClaimedItem(
            item_id=item.item_id,
            project_id=item.project_id,
            payload=item.payload,
            fence=item.fence,
            attempts=item.attempts,
            lease_expires_at=as_datetime(item.lease_expires_at),
            owner=item.owner,
            priority=item.priority,
            service_class=item.service_class,
            sla=optional_datetime(item.sla),
            fingerprint=item.fingerprint,
            max_attempts=item.max_attempts,
            enqueued_at=as_datetime(item.created_at),
        )
    )


def event_view(event: dict[str, Any]) -> Event:
    return (
        event["event_type"],
        event["fence"],
        event["owner"],
        event["actor_id"],
        event["detail"],
        event["at"],
    )
