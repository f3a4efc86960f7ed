"""Atomic claims, fences and leases."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from collections.abc import Awaitable, Iterator
from typing import Any

import pytest

from asyncplane import (
    ControlStore,
    FenceRejected,
    InvalidInput,
    InvalidType,
    UnknownProject,
    _telemetry,
    verify_ledger,
)
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock


async def test_claim_hands_an_item_to_exactly_one_caller(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {"n": 1})
    first = await store.claim(owner="w1")
    assert first is not None
    assert first.item_id == item_id
    assert first.project_id == "alpha"
    assert first.payload == {"n": 1}
    assert first.fence == 1
    assert first.attempts == 1
    assert first.owner == "w1"
    assert await store.claim(owner="w2") is None


@contextlib.contextmanager
def _saved_trace(project_id: str, count: int) -> Iterator[str]:
    """An enqueue's span, as `_telemetry.enqueue_span` gives it, with a set context."""
    yield json.dumps({"traceparent": _TRACEPARENT})


_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_a_claimed_item_carries_each_of_its_items_settings(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every field set, and to a value no other field has: ClaimedItem is built
    # positionally on the claim's path, so a field out of place shows here. (Two items
    # ahead make the id 3; a claim given back makes the fence 2 with one attempt.) The
    # trace context is set, so no tracing another test left on decides it.
    monkeypatch.setattr(_telemetry, "enqueue_span", _saved_trace)
    await store.create_project("beta", "Beta")
    await store.enqueue_many("beta", [{"n": 0}, {"n": 1}])
    enqueued_at = clock.datetime()
    sla = enqueued_at + dt.timedelta(hours=2)
    item_id = await store.enqueue(
        "alpha",
        {"n": 1},
        priority=7,
        service_class="realtime",
        sla=sla,
        fingerprint="fp-a",
        max_attempts=5,
    )
    first = await store.claim(owner="w0", project_id="alpha")
    assert first is not None
    await store.release(first.item_id, fence=first.fence)
    clock.advance(3)
    claim = await store.claim(owner="w1", project_id="alpha", lease_seconds=40)
    assert claim is not None
    assert (
        claim.item_id,
        claim.project_id,
        claim.payload,
        claim.fence,
        claim.attempts,
        claim.lease_expires_at,
        claim.owner,
        claim.priority,
        claim.service_class,
        claim.sla,
        claim.fingerprint,
        claim.max_attempts,
        claim.enqueued_at,
        claim.trace_context,
    ) == (
        3,
        "alpha",
        {"n": 1},
        2,
        1,
        enqueued_at + dt.timedelta(seconds=43),
        "w1",
        7,
        "realtime",
        sla,
        "fp-a",
        5,
        enqueued_at,
        {"traceparent": _TRACEPARENT},
    )
    assert item_id == 3


async def test_claim_returns_none_on_an_empty_queue(store: ControlStore) -> None:
    assert await store.claim(owner="w1") is None


async def test_claims_come_oldest_first(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(5)]
    claimed = [(await store.claim(owner="w")) for _ in ids]
    assert [c.item_id for c in claimed if c] == ids


async def test_lease_is_measured_by_the_store_clock(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1", lease_seconds=30)
    assert claim is not None
    assert claim.lease_expires_at == clock.datetime() + dt.timedelta(seconds=30)
    row = await store.item(claim.item_id)
    assert row["lease_expires_at"] == claim.lease_expires_at
    assert row["state"] == "claimed"
    assert row["owner"] == "w1"


async def test_a_live_lease_is_not_taken_over(store: ControlStore, clock: ManualClock) -> None:
    await store.enqueue("alpha", {})
    await store.claim(owner="w1")
    clock.advance(store.lease_seconds - 1)
    assert await store.claim(owner="w2") is None


async def test_lapsed_lease_is_taken_over_with_a_higher_fence(
    store: ControlStore, clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {})
    first = await store.claim(owner="w1")
    assert first is not None
    clock.advance(store.lease_seconds)  # expiry is inclusive: at the instant, it has lapsed
    second = await store.claim(owner="w2")
    assert second is not None
    assert second.item_id == item_id
    assert second.fence > first.fence
    assert second.attempts == first.attempts + 1
    row = await store.item(item_id)
    assert (row["state"], row["owner"], row["fence"]) == ("claimed", "w2", second.fence)


async def test_old_holder_is_fenced_out_after_a_takeover(
    store: ControlStore, clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {})
    first = await store.claim(owner="w1")
    assert first is not None
    clock.advance(store.lease_seconds + 1)
    second = await store.claim(owner="w2")
    assert second is not None

    with pytest.raises(FenceRejected) as renew_refused:
        await store.renew(item_id, fence=first.fence)
    assert renew_refused.value.current_fence == second.fence
    with pytest.raises(FenceRejected) as finish_refused:
        await store.finish(item_id, fence=first.fence, status="done")
    assert "claimed at fence 2" in str(finish_refused.value)

    await store.finish(item_id, fence=second.fence, status="done")
    assert (await store.item(item_id))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_takeover_is_visible_in_the_events(store: ControlStore, clock: ManualClock) -> None:
    item_id = await store.enqueue("alpha", {})
    await store.claim(owner="w1")
    clock.advance(store.lease_seconds + 1)
    await store.claim(owner="w2")
    events = await store.events(item_id)
    assert [(e["event_type"], e["fence"], e["owner"]) for e in events] == [
        ("queued", 0, None),
        ("claimed", 1, "w1"),
        ("lease_expired", 1, "w1"),
        ("claimed", 2, "w2"),
    ]
    assert events[2]["detail"] == {"taken_over_by": "w2"}


async def test_fences_rise_across_many_takeovers(store: ControlStore, clock: ManualClock) -> None:
    item_id = await store.enqueue("alpha", {})
    fences = []
    for n in range(6):
        claim = await store.claim(owner=f"w{n}")
        assert claim is not None
        fences.append(claim.fence)
        clock.advance(store.lease_seconds + 1)
    assert fences == sorted(set(fences))
    claim_events = [e for e in await store.events(item_id) if e["event_type"] == "claimed"]
    assert [e["fence"] for e in claim_events] == fences


async def test_finish_refuses_an_item_that_was_never_claimed(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    with pytest.raises(FenceRejected, match="is ready, not claimed"):
        await store.finish(item_id, fence=1, status="done")
    assert (await store.item(item_id))["state"] == "ready"
    assert [e["event_type"] for e in await store.events(item_id)] == ["queued"]


async def test_finish_refuses_a_second_report(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1")
    assert claim is not None
    await store.finish(item_id, fence=claim.fence, status="failed")
    with pytest.raises(FenceRejected, match="is failed, not claimed"):
        await store.finish(item_id, fence=claim.fence, status="done")
    assert (await store.item(item_id))["state"] == "failed"
    assert [e["event_type"] for e in await store.events(item_id)] == [
        "queued",
        "claimed",
        "failed",
    ]


async def test_finish_with_a_fence_from_the_future_is_refused(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1")
    assert claim is not None
    with pytest.raises(FenceRejected):
        await store.finish(item_id, fence=claim.fence + 1)


async def test_renew_extends_the_lease_from_now(store: ControlStore, clock: ManualClock) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1", lease_seconds=60)
    assert claim is not None
    clock.advance(50)
    expires = await store.renew(item_id, fence=claim.fence, lease_seconds=60)
    assert expires == clock.datetime() + dt.timedelta(seconds=60)
    clock.advance(50)  # past the first lease, inside the renewed one
    assert await store.claim(owner="w2") is None
    await store.finish(item_id, fence=claim.fence)
    assert await verify_ledger(store) == []


async def test_renew_of_an_unclaimed_item_is_refused(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    with pytest.raises(FenceRejected):
        await store.renew(item_id, fence=1)


async def test_a_lapsed_holder_may_still_finish_if_nobody_took_over(
    store: ControlStore, clock: ManualClock
) -> None:
    # The fence, not the clock, decides: until someone else claims the item, the
    # holder's fence is the current one, and its report is the only report.
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1")
    assert claim is not None
    clock.advance(store.lease_seconds * 2)
    await store.renew(item_id, fence=claim.fence)
    await store.finish(item_id, fence=claim.fence)
    assert await store.claim(owner="w2") is None
    assert await verify_ledger(store) == []


async def test_nothing_moves_a_claimed_item_back_to_ready(
    store: ControlStore, clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {})
    await store.claim(owner="w1")
    clock.advance(store.lease_seconds * 10)
    # Lapsed and unclaimed for a long time: still "claimed" (with a lapsed lease).
    assert (await store.item(item_id))["state"] == "claimed"
    taken = await store.claim(owner="w2")
    assert taken is not None
    assert (await store.item(item_id))["state"] == "claimed"


async def test_ready_items_and_lapsed_claims_are_served_in_id_order(
    store: ControlStore, clock: ManualClock
) -> None:
    older = await store.enqueue("alpha", {"n": 1})
    await store.claim(owner="w1")
    newer = await store.enqueue("alpha", {"n": 2})
    clock.advance(store.lease_seconds + 1)
    first = await store.claim(owner="w2")
    second = await store.claim(owner="w3")
    assert first is not None and second is not None
    assert (first.item_id, second.item_id) == (older, newer)


async def test_paused_and_closed_projects_hand_out_no_claims(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.create_project("paused", "Paused", status="paused")
    await store.enqueue("paused", {})
    assert await store.claim(owner="w") is None

    item_id = await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1")
    assert claim is not None
    await store.set_project_status("alpha", "closed")
    clock.advance(store.lease_seconds + 1)
    assert await store.claim(owner="w2") is None  # not even a takeover
    await store.set_project_status("alpha", "open")
    taken = await store.claim(owner="w2")
    assert taken is not None and taken.item_id == item_id

    await store.set_project_status("paused", "open")
    assert await store.claim(owner="w3") is not None


async def test_a_status_change_if_status_leaves_a_project_found_in_another(
    store: ControlStore,
) -> None:
    assert await store.set_project_status("alpha", "paused") == "paused"
    assert await store.set_project_status("alpha", "open", if_status="paused") == "open"
    assert await store.set_project_status("alpha", "closed", if_status=["open"]) == "closed"
    # Found closed, not as expected: left closed, and its status said.
    assert await store.set_project_status("alpha", "open", if_status=("open", "paused")) == (
        "closed"
    )
    assert (await store.project("alpha"))["status"] == "closed"
    assert await store.claim(owner="w") is None
    with pytest.raises(InvalidInput, match="unknown if_status 'opened'"):
        await store.set_project_status("alpha", "open", if_status="opened")
    with pytest.raises(InvalidInput, match="if_status names no status"):
        await store.set_project_status("alpha", "open", if_status=())
    with pytest.raises(InvalidType, match="if_status must be a str or a tuple"):
        await store.set_project_status("alpha", "open", if_status=1)  # type: ignore[arg-type]
    assert (await store.project("alpha"))["status"] == "closed"
    with pytest.raises(UnknownProject):
        await store.set_project_status("nowhere", "open", if_status="paused")


async def test_concurrent_claims_in_one_store_never_share_an_item(store: ControlStore) -> None:
    for n in range(50):
        await store.enqueue("alpha", {"n": n})
    results = await asyncio.gather(*(store.claim(owner=f"w{n}") for n in range(80)))
    got = [r.item_id for r in results if r is not None]
    assert len(got) == 50
    assert len(set(got)) == 50
    assert sum(r is None for r in results) == 30


async def test_counts_by_state(store: ControlStore, clock: ManualClock) -> None:
    zero = {
        "ready": 0,
        "deferred": 0,
        "claimed": 0,
        "offloaded": 0,
        "done": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert await store.counts() == zero
    for n in range(4):
        await store.enqueue("alpha", {"n": n})
    a = await store.claim(owner="w")
    b = await store.claim(owner="w")
    await store.claim(owner="w")
    assert a and b
    await store.finish(a.item_id, fence=a.fence, status="done")
    await store.finish(b.item_id, fence=b.fence, status="failed")
    assert await store.counts() == {**zero, "ready": 1, "claimed": 1, "done": 1, "failed": 1}


async def _until_in_a_round(store: ControlStore, served: int) -> None:
    """Until the writer has taken a request into a round beyond the ``served`` it had
    (no event marks it: looked at every millisecond, for at most ten seconds; the round
    waits for a lock held by the test meanwhile, so it cannot end first)."""
    writer = (await engine_of(store).ready()).writer
    assert writer is not None
    for _ in range(10_000):
        if writer.requests > served and writer.requests_waiting == 0:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the claim never left the writer's queue")


async def claim_cancelled_in_its_round(
    store: ControlStore, raw: Any, wait: float | None = None
) -> int:
    """Enqueue an item and claim it with a call cancelled while its round waits for the
    write lock, held behind the store's back (``raw``, which the caller then lets go):
    the item's id."""
    item_id = await store.enqueue("alpha", {"n": 1})
    await cancelled_in_its_round(store, raw, store.claim(owner="gone", wait=wait))
    return item_id


async def cancelled_in_its_round(store: ControlStore, raw: Any, call: Awaitable[Any]) -> None:
    """Run ``call`` (one write), cancelled while its round waits for the write lock,
    held behind the store's back (``raw``, which the caller then lets go)."""
    await store.counts()  # the readers open before the lock is taken
    raw.execute("BEGIN IMMEDIATE" if raw.backend == "sqlite" else "BEGIN")
    if raw.backend == "postgresql":
        raw.execute("LOCK TABLE items IN EXCLUSIVE MODE")
    writer = (await engine_of(store).ready()).writer
    assert writer is not None
    served = writer.requests
    calling = asyncio.ensure_future(call)
    await _until_in_a_round(store, served)
    calling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await calling


async def cancelled_as_answered(store: ControlStore, method: str, call: Awaitable[Any]) -> None:
    """Run ``call``, its caller cancelled as the answer of the store backend's ``method``
    comes in: the answer is in the request's future, the caller not yet resumed."""
    backend = await engine_of(store).ready()
    original = getattr(backend, method)
    tasks: list[asyncio.Future[Any]] = []

    def then_cancel(op: Any) -> Any:
        future = original(op)
        assert isinstance(future, asyncio.Future)
        # Added before the caller awaits it, so it runs first once the answer is in.
        future.add_done_callback(lambda _: tasks[0].cancel())
        return future

    setattr(backend, method, then_cancel)
    try:
        tasks.append(asyncio.ensure_future(call))
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
    finally:
        delattr(backend, method)  # the backend's own method again


@pytest.mark.parametrize("wait", [None, 5.0])
async def test_a_claim_cancelled_while_its_round_ran_gives_back_what_it_took(
    store: ControlStore, raw: Any, wait: float | None
) -> None:
    # The write lock is held behind the store's back, so the claim's round waits in the
    # middle; its caller is cancelled there (a claim() in asyncio.wait_for that timed
    # out). The round then commits the claim for nobody: the item goes back at once,
    # rather than waiting out its lease.
    item_id = await claim_cancelled_in_its_round(store, raw, wait)
    raw.execute("COMMIT")
    # A write queued behind the claim's round: the give-back, queued as that round was
    # answered, has landed with it or before it.
    await store.assign("alpha", "barrier")
    row = await store.item(item_id)
    assert (row["state"], row["attempts"]) == ("ready", 0)
    assert [e["event_type"] for e in await store.events(item_id)] == [
        "queued", "claimed", "released",
    ]  # fmt: skip
    again = await store.claim(owner="w")
    assert again is not None and again.item_id == item_id and again.fence == 2
    assert await verify_ledger(store) == []


@pytest.mark.parametrize("limit", [1, 3])
async def test_a_claim_cancelled_as_its_answer_came_gives_back_what_it_took(
    store: ControlStore, limit: int
) -> None:
    # The round answered, and the caller is cancelled before it runs again: the answer
    # is in the claim's future but reaches nobody. What it took goes back at once.
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(limit)])
    await cancelled_as_answered(store, "claim", store.claim_batch("gone", limit))
    await store.assign("alpha", "barrier")  # queued after the give-back
    for item_id in ids:
        row = await store.item(item_id)
        assert (row["state"], row["attempts"]) == ("ready", 0)
        assert [e["event_type"] for e in await store.events(item_id)][-2:] == [
            "claimed", "released",
        ]  # fmt: skip
    assert len(await store.claim_batch("w", limit)) == limit
    assert await verify_ledger(store) == []


async def test_a_store_closed_after_a_cancelled_claim_gives_its_item_back_first(
    store: ControlStore, raw: Any
) -> None:
    # The usual shutdown: a worker's claim cancelled in its round, then the store closed.
    # The round is answered during the close, and the give-back is served before the
    # writer ends.
    item_id = await claim_cancelled_in_its_round(store, raw)
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0)
    raw.execute("COMMIT")
    await closing
    row = await store.item(item_id)  # opens the store again
    assert (row["state"], row["attempts"]) == ("ready", 0)
    assert [e["event_type"] for e in await store.events(item_id)] == [
        "queued", "claimed", "released",
    ]  # fmt: skip


async def test_a_due_time_past_when_told_wakes_each_waiter_at_once(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two waiters on two projects, each with an item due at the same moment, which falls
    # as they look for when: each is told the same past time, and each goes at once (a
    # memory of past due times shared by the store held the second back a second).
    await store.create_project("beta", "Beta")
    due = clock.now() + 10
    for project in ("alpha", "beta"):
        await store.enqueue(project, {"p": project}, not_before=due)
    backend = await engine_of(store).ready()
    look = backend.next_due

    async def falling(project_id: str | None, actor_id: str | None) -> float | None:
        answer = await look(project_id, actor_id)
        if clock.now() < due + 0.5:
            clock.set(due + 0.5)  # the moment falls while the waiters look
        return answer

    monkeypatch.setattr(backend, "next_due", falling)
    waiting = [
        asyncio.create_task(store.claim("w", project_id=project, wait=3600, poll_interval=3600))
        for project in ("alpha", "beta")
    ]
    alpha, beta = await asyncio.wait_for(asyncio.gather(*waiting), 30)
    assert alpha is not None and beta is not None
