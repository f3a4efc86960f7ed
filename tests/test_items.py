"""Operating single items: find them, cancel them (enforced by the fence), requeue them,
wait for their results; on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import json
import os
import pathlib
import pickle
import sqlite3
import subprocess
import sys
from typing import Any

import pytest
from tests.test_claims import cancelled_as_answered, cancelled_in_its_round

from _signals import until
from asyncplane import (
    ControlStore,
    Done,
    FenceRejected,
    InvalidInput,
    InvalidType,
    ItemCancelled,
    ItemPurged,
    NotRequeueable,
    ScopeDenied,
    StoreClosed,
    UnknownItem,
    WaitTimeout,
    copy_store,
    drain,
    testing,
    verify_ledger,
)
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock


async def failed_item(store: ControlStore, payload: dict[str, Any], error: str) -> int:
    item_id = await store.enqueue("alpha", payload)
    claim = await store.claim("w", project_id="alpha")
    assert claim is not None and claim.item_id == item_id
    await store.finish(item_id, fence=claim.fence, status="failed", error=error)
    return item_id


# --- items() ---------------------------------------------------------------------------------


async def test_items_lists_newest_first_and_pages_by_keyset(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(7)]
    first = await store.items(limit=3)
    assert [row["item_id"] for row in first] == ids[::-1][:3]
    assert first[0]["payload"] == {"n": 6}  # each row as item() gives it
    assert first[0] == await store.item(ids[-1])
    second = await store.items(limit=3, after=first[-1]["item_id"])
    third = await store.items(limit=3, after=second[-1]["item_id"])
    assert [row["item_id"] for row in first + second + third] == ids[::-1]
    oldest = await store.items(order="oldest", limit=4)
    assert [row["item_id"] for row in oldest] == ids[:4]
    assert [r["item_id"] for r in await store.items(order="oldest", after=ids[4])] == ids[5:]


async def test_the_largest_id_a_store_hands_out_is_listed_newest_first(
    store: ControlStore, raw: Any
) -> None:
    # 2**63 - 1 is the last id either backend gives; one past it is not a 64-bit number.
    low = await store.enqueue("alpha", {"n": 0})
    high = await store.enqueue("alpha", {"n": 1})
    largest = 2**63 - 1
    raw.execute("UPDATE items SET item_id = ? WHERE item_id = ?", (largest, high))
    listed = [row["item_id"] for row in await store.items()]
    assert listed == [largest, low]
    assert [row["item_id"] for row in await store.items(after=largest)] == [low]
    assert [row["item_id"] for row in await store.items(order="oldest")] == [low, largest]
    assert await store.items(order="oldest", after=largest) == []
    for state in ("ready", None):  # a state's arm and the project's
        chosen = await store.items(project_id="alpha", state=state, limit=1)
        assert [row["item_id"] for row in chosen] == [largest]


async def test_an_error_search_folds_the_case_of_ascii_letters_only(
    store: ControlStore,
) -> None:
    # On every backend and whatever the server's locale: other letters match as written.
    item_id = await failed_item(store, {"n": 1}, "Ärger: TIMEOUT")
    found = await store.items(error_contains="Ärger: timeout")
    assert [row["item_id"] for row in found] == [item_id]
    assert await store.items(error_contains="ärger") == []


async def test_items_filters_combine(store: ControlStore, clock: ManualClock) -> None:
    await store.create_project("beta", "Beta")
    a = await failed_item(store, {"n": 1}, "Rate limit reached")
    clock.advance(10)
    b = await failed_item(store, {"n": 2}, "bad brief")
    ready = await store.enqueue("alpha", {"n": 3}, fingerprint="fp-3")
    other = await store.enqueue("beta", {"n": 4})

    async def ids(**filters: Any) -> list[int]:
        return [row["item_id"] for row in await store.items(**filters)]

    assert await ids(project_id="alpha", state="failed") == [b, a]
    assert await ids(state=("ready", "failed")) == [other, ready, b, a]
    assert await ids(project_id="alpha", state=["ready", "failed"]) == [ready, b, a]
    assert await ids(project_id="beta") == [other]
    assert await ids(error_contains="RATE LIMIT") == [a]  # ignoring case
    assert await ids(fingerprint="fp-3") == [ready]
    assert await ids(owner="w") == [b, a]
    cut = (await store.item(b))["created_at"]
    assert await ids(created_before=cut) == [a]
    assert await ids(created_after=cut.timestamp() - 1, state="failed") == [b]
    bare = await store.items(state="failed", include_payload=False)
    assert "payload" not in bare[0] and "result" not in bare[0]
    assert bare[0]["error"] == "bad brief"


async def test_items_refuses_bad_filters_before_reading(store: ControlStore) -> None:
    with pytest.raises(InvalidInput, match="unknown state"):
        await store.items(state="lost")
    with pytest.raises(InvalidInput, match="order"):
        await store.items(order="random")
    with pytest.raises(InvalidInput, match="at most 10000"):
        await store.items(limit=10_001)
    with pytest.raises(InvalidInput):
        await store.items(limit=0)


async def test_items_are_scoped_to_an_actor(store: ControlStore) -> None:
    await store.create_project("beta", "Beta")
    await store.assign("beta", "ann")
    await store.enqueue("alpha", {})
    mine = await store.enqueue("beta", {})
    assert [row["item_id"] for row in await store.items(actor_id="ann")] == [mine]
    assert await store.items(actor_id="ann", project_id="alpha") == []


# --- cancel ----------------------------------------------------------------------------------


async def test_cancelling_waiting_items_settles_them_at_once(
    store: ControlStore, clock: ManualClock
) -> None:
    ready = await store.enqueue("alpha", {"n": 1})
    later = await store.enqueue("alpha", {"n": 2}, not_before=clock.now() + 3600)
    assert await store.cancel(ready, reason="wrong brief") == "cancelled"
    assert await store.cancel(later) == "cancelled"
    row = await store.item(ready)
    assert (row["state"], row["error"]) == ("cancelled", "wrong brief")
    events = await store.events(ready)
    assert events[-1]["event_type"] == "cancelled"
    assert events[-1]["detail"] == {"from": "ready", "reason": "wrong brief"}
    assert await store.claim("w") is None  # neither is claimable any more
    assert (await store.counts())["cancelled"] == 2
    assert await verify_ledger(store) == []


async def test_cancelling_a_running_item_refuses_its_holder(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    assert await store.cancel(item_id, reason="stop") == "cancelled"
    for call in (
        store.renew(item_id, fence=claim.fence),
        store.finish(item_id, fence=claim.fence),
        store.retry(item_id, fence=claim.fence, error="x"),
        store.park(item_id, fence=claim.fence, delay=1),
        store.offload(item_id, fence=claim.fence, handle="h"),
    ):
        with pytest.raises(ItemCancelled, match="cancelled: stop") as caught:
            await call
        assert isinstance(caught.value, FenceRejected)
        assert caught.value.reason == "stop"
        assert caught.value.current_fence == claim.fence + 1
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (copy.item_id, copy.reason, str(copy)) == (item_id, "stop", str(caught.value))
    assert (await store.item(item_id))["fence"] == claim.fence + 1
    assert await verify_ledger(store) == []


async def test_an_offloaded_item_cancelled_refuses_its_late_result(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    await store.offload(item_id, fence=claim.fence, handle="batch-1")
    assert await store.cancel(item_id) == "cancelled"
    assert await store.offloaded("batch-1") == []
    with pytest.raises(ItemCancelled):
        await store.finish(item_id, fence=claim.fence, result={"late": True})
    assert await verify_ledger(store) == []


async def test_cancelling_a_settled_item_changes_nothing(store: ControlStore) -> None:
    done = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    await store.finish(done, fence=claim.fence, result=1)
    failed = await failed_item(store, {"n": 2}, "bad")
    before = await store.events(done)
    assert await store.cancel(done) == "done"
    assert await store.cancel(failed) == "failed"
    cancelled = await store.enqueue("alpha", {"n": 3})
    await store.cancel(cancelled)
    assert await store.cancel(cancelled) == "cancelled"
    assert await store.events(done) == before
    assert len([e for e in await store.events(cancelled) if e["event_type"] == "cancelled"]) == 1
    assert await verify_ledger(store) == []


async def test_a_cancelled_twin_stops_holding_its_twins_back(store: ControlStore) -> None:
    first = await store.enqueue("alpha", {"n": 1}, fingerprint="same")
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == first
    assert await store.enqueue("alpha", {"n": 1}, fingerprint="same") == first  # dedup
    twin = await store.enqueue("alpha", {"n": 1}, fingerprint="same", dedup=False)
    assert await store.claim("w") is None  # held back while its twin runs
    assert await store.cancel(first) == "cancelled"
    taken = await store.claim("w")
    assert taken is not None and taken.item_id == twin  # no longer held back
    # A cancelled item is no dedup target: the same content again finds the twin in flight.
    assert await store.enqueue("alpha", {"n": 1}, fingerprint="same") == twin
    assert (await store.item(first))["state"] == "cancelled"
    assert [e["event_type"] for e in await store.events(twin)] == ["queued", "claimed"]
    assert await verify_ledger(store) == []


async def test_cancel_and_requeue_if_state_act_only_on_an_item_still_as_expected(
    store: ControlStore,
) -> None:
    # An operator's page shows an item retrying, or failed; meanwhile a worker claims it,
    # or someone cancels it on purpose: the action taken from the old page must not land.
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    assert await store.cancel(item_id, if_state="deferred") == "claimed"  # left claimed
    assert (await store.item(item_id))["fence"] == claim.fence  # untouched
    await store.finish(item_id, fence=claim.fence, status="failed", error="no")
    assert await store.cancel(item_id, if_state=("ready", "deferred")) == "failed"
    other = await store.enqueue("alpha", {})
    assert await store.cancel(other, if_state="ready") == "cancelled"
    with pytest.raises(NotRequeueable, match="is cancelled, not failed as expected") as raised:
        await store.requeue(other, if_state="failed")  # cancelled on purpose: stays
    assert raised.value.expected == ("failed",)
    assert pickle.loads(pickle.dumps(raised.value)).expected == ("failed",)
    assert (await store.item(other))["state"] == "cancelled"
    await store.requeue(item_id, if_state="failed")
    assert (await store.item(item_id))["state"] == "ready"
    with pytest.raises(InvalidInput, match="unknown if_state 'nonsense'"):
        await store.cancel(item_id, if_state="nonsense")
    assert await verify_ledger(store) == []


async def test_cancel_and_requeue_if_fence_act_only_on_the_run_a_page_showed(
    store: ControlStore, clock: ManualClock
) -> None:
    # A page shows an item claimed at fence 1; its lease lapses and another worker takes
    # it over: still claimed, at fence 2. The cancel made from the old page leaves it.
    item_id = await store.enqueue("alpha", {})
    first = await store.claim("w1", lease_seconds=10)
    assert first is not None and first.fence == 1
    clock.advance(11)
    second = await store.claim("w2")
    assert second is not None and (second.item_id, second.fence) == (item_id, 2)
    assert await store.cancel(item_id, if_state="claimed", if_fence=1) == "claimed"
    assert (await store.item(item_id))["fence"] == 2  # untouched
    # A page shows it failed at fence 2; it is requeued, runs and fails again, at 3.
    await store.finish(item_id, fence=2, status="failed", error="no")
    await store.requeue(item_id, if_state="failed", if_fence=2)
    third = await store.claim("w3")
    assert third is not None and third.fence == 3
    await store.finish(item_id, fence=3, status="failed", error="no again")
    with pytest.raises(NotRequeueable, match="is failed at fence 3, not at fence 2") as raised:
        await store.requeue(item_id, if_fence=2)
    assert (raised.value.fence, raised.value.expected_fence) == (3, 2)
    again = pickle.loads(pickle.dumps(raised.value))
    assert (again.fence, again.expected_fence, str(again)) == (3, 2, str(raised.value))
    assert (await store.item(item_id))["state"] == "failed"
    # The fence the page showed: the action is taken.
    await store.requeue(item_id, if_fence=3)
    assert await store.cancel(item_id, if_state="ready", if_fence=3) == "cancelled"
    # Fence 0 is a never-claimed item's: a cancel at it takes one.
    untouched = await store.enqueue("alpha", {})
    assert await store.cancel(untouched, if_fence=0) == "cancelled"
    with pytest.raises(InvalidInput, match="if_fence must be from 0"):
        await store.cancel(item_id, if_fence=-1)
    with pytest.raises(InvalidType, match="if_fence must be an int or None, not bool"):
        await store.requeue(item_id, if_fence=True)
    assert await verify_ledger(store) == []


async def test_cancel_and_requeue_are_scoped(store: ControlStore) -> None:
    await store.create_project("beta", "Beta")
    await store.assign("beta", "ann")
    foreign = await store.enqueue("alpha", {})
    with pytest.raises(ScopeDenied) as absent:
        await store.cancel(10_000, actor_id="ann")
    with pytest.raises(ScopeDenied) as hidden:
        await store.cancel(foreign, actor_id="ann")
    assert str(absent.value).replace("10000", "N") == str(hidden.value).replace(str(foreign), "N")
    with pytest.raises(ScopeDenied):
        await store.requeue(foreign, actor_id="ann")
    with pytest.raises(UnknownItem):
        await store.cancel(10_000)
    assert (await store.item(foreign))["state"] == "ready"
    mine = await store.enqueue("beta", {})
    assert await store.cancel(mine, actor_id="ann") == "cancelled"
    await store.requeue(mine, actor_id="ann")
    assert (await store.events(mine))[-1]["actor_id"] == "ann"


# --- requeue ---------------------------------------------------------------------------------


async def test_requeue_gives_a_fresh_budget_and_a_higher_fence(
    asyncplane_store_factory: Any,
) -> None:
    store: ControlStore = await asyncplane_store_factory(max_attempts=1)
    await store.create_project("alpha", "Alpha")
    item_id = await store.enqueue("alpha", {"brief": "x"}, fingerprint="fp")
    claim = await store.claim("w")
    assert claim is not None
    assert await store.retry(item_id, fence=claim.fence, error="boom") == "failed"  # spent
    await store.requeue(item_id)
    row = await store.item(item_id)
    assert (row["state"], row["attempts"], row["error"]) == ("ready", 0, None)
    assert (row["payload"], row["fingerprint"]) == ({"brief": "x"}, "fp")
    event = (await store.events(item_id))[-1]
    assert (event["event_type"], event["detail"]) == ("requeued", {"from": "failed"})
    again = await store.claim("w")
    assert again is not None and again.item_id == item_id
    assert again.fence > claim.fence and again.attempts == 1
    await store.finish(item_id, fence=again.fence, result="ok")
    # Done again: a dedup target once more.
    assert await store.enqueue("alpha", {"brief": "x"}, fingerprint="fp") == item_id
    kinds = [e["event_type"] for e in await store.events(item_id)]
    assert kinds == ["queued", "claimed", "failed", "requeued", "claimed", "done"]
    assert await verify_ledger(store) == []


async def test_requeue_refuses_an_item_that_is_not_failed_or_cancelled(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {})
    with pytest.raises(NotRequeueable, match="is ready") as caught:
        await store.requeue(item_id)
    assert caught.value.state == "ready"
    claim = await store.claim("w")
    assert claim is not None
    with pytest.raises(NotRequeueable, match="is claimed"):
        await store.requeue(item_id)
    assert [e["event_type"] for e in await store.events(item_id)] == ["queued", "claimed"]


async def test_a_cancelled_claim_requeued_then_reclaimed(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    first = await store.claim("w")
    assert first is not None
    await store.cancel(item_id)
    await store.requeue(item_id)
    second = await store.claim("v")
    assert second is not None and second.fence == first.fence + 2  # the cancel, the claim
    with pytest.raises(FenceRejected):
        await store.finish(item_id, fence=first.fence)  # the old holder, still refused
    await store.finish(item_id, fence=second.fence)
    assert await verify_ledger(store) == []


# --- cancel_where / requeue_where --------------------------------------------------------------


async def test_where_calls_touch_only_their_filter_in_chunks(store: ControlStore) -> None:
    await store.create_project("beta", "Beta")
    settled = await failed_item(store, {"settled": True}, "bad")
    waiting = [await store.enqueue("alpha", {"n": n}) for n in range(7)]
    elsewhere = await store.enqueue("beta", {})
    claim = await store.claim("w", project_id="alpha")
    assert claim is not None and claim.item_id == waiting[0]
    backend = await store._engine.ready()
    assert backend.writer is not None
    rounds = backend.writer.rounds
    n = await store.cancel_where(
        project_id="alpha", state=("ready", "failed"), reason="project closed", chunk=2
    )
    assert n == 6  # the six ready ones: the failed one is settled, never touched
    assert backend.writer.rounds - rounds == 3 + 1  # short transactions, not one long one
    states = {r["item_id"]: r["state"] for r in await store.items(limit=100)}
    assert states[elsewhere] == "ready" and states[waiting[0]] == "claimed"
    assert all(states[i] == "cancelled" for i in waiting[1:])
    assert states[settled] == "failed"
    assert await store.requeue_where(project_id="alpha", state="cancelled", chunk=4) == 6
    assert (await store.counts(project_id="alpha"))["ready"] == 6
    assert (await store.item(settled))["state"] == "failed"
    assert await verify_ledger(store) == []


async def test_requeue_where_matches_the_error(store: ControlStore) -> None:
    limited = [await failed_item(store, {"n": n}, f"rate limit #{n}") for n in range(3)]
    other = await failed_item(store, {"n": 9}, "bad brief")
    assert await store.requeue_where(state="failed", error_contains="Rate Limit") == 3
    assert {r["item_id"] for r in await store.items(state="ready")} == set(limited)
    assert (await store.item(other))["state"] == "failed"
    assert await store.requeue_where(state="ready") == 0  # never anything but failed/cancelled


# --- wait -------------------------------------------------------------------------------------


def parked() -> bool:
    """A wait() has read its item, found it unsettled, and waits for a wake-up: the
    store's watch of items waited for has read them since, and sleeps."""
    return any(t.get_name() == "asyncplane-settles-local" for t in asyncio.all_tasks())


async def test_wait_returns_the_settled_item(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    waiting = asyncio.create_task(store.wait(item_id, timeout=30))
    await until(parked, what="the waiter has read the item and waits")
    claim = await store.claim("w")
    assert claim is not None
    assert not waiting.done()
    await store.finish(item_id, fence=claim.fence, result={"answer": 42})
    row = await waiting
    assert (row["state"], row["result"]) == ("done", {"answer": 42})
    cancelled = await store.enqueue("alpha", {})
    other = asyncio.create_task(store.wait(cancelled))
    await store.cancel(cancelled)
    assert (await other)["state"] == "cancelled"


async def test_a_wait_ends_when_its_store_closes_and_leaves_it_closed(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {})
    for poll in (0.01, 3600.0):  # its look for other processes' settles comes, or not
        waiting = asyncio.create_task(store.wait(item_id, timeout=60, poll_interval=poll))
        await until(parked, what="the waiter has read the item and waits")
        await store.close()
        with pytest.raises(StoreClosed, match=f"closed while waiting for item {item_id}"):
            await waiting
        assert not store._engine.is_open  # the wait did not open it again
        assert (await store.item(item_id))["state"] == "ready"  # the next call does


async def test_a_wait_cancelled_as_its_item_settles_is_cancelled(store: ControlStore) -> None:
    # asyncio.wait_for before Python 3.12 returns the result when the cancellation comes
    # just as the awaited work ends: the cancelled caller would go on as if not cancelled.
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    waiting = asyncio.create_task(store.wait(item_id, timeout=30))
    await until(parked, what="the waiter has read the item and waits")
    (looking,) = [
        t for t in asyncio.all_tasks() if t.get_name() == f"asyncplane-wait-settled[{item_id}]"
    ]
    looking.add_done_callback(lambda _: waiting.cancel())  # in the very step it ends
    await store.finish(item_id, fence=claim.fence)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert looking.done() and not looking.cancelled()  # it had found the item settled


async def test_wait_times_out_and_refuses_unknown_items_at_once(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    with pytest.raises(WaitTimeout) as caught:
        await store.wait(item_id, timeout=0.05)
    assert isinstance(caught.value, TimeoutError)
    with pytest.raises(UnknownItem):
        await store.wait(10_000, timeout=30)


@pytest.mark.parametrize("actor", [None, "ann"])
async def test_a_wait_whose_item_settles_and_is_purged_elsewhere_says_so(
    tmp_path: pathlib.Path, actor: str | None
) -> None:
    # Settled and purged by another store (another process) between two of the wait's
    # looks: it said UnknownItem, "no item has this id", of an item it had seen.
    path = tmp_path / "s.db"
    async with ControlStore(path) as waiter, ControlStore(path) as other:
        await waiter.create_project("alpha", "Alpha")
        item_id = await waiter.enqueue("alpha", {})
        await waiter.assign("alpha", "ann")  # (to an actor, a purged item was ScopeDenied)
        waiting = asyncio.create_task(waiter.wait(item_id, poll_interval=3600, actor_id=actor))
        engine = engine_of(waiter)
        await until(
            lambda: (
                engine.settles.waited == 1
                and any(t.get_name() == "asyncplane-settles-local" for t in asyncio.all_tasks())
            ),
            what="the wait's watcher has looked, and sleeps",
        )
        claim = await other.claim("w")
        assert claim is not None and claim.item_id == item_id
        await other.finish(item_id, fence=claim.fence, result={"answer": 42})
        archive = tmp_path / "archive.jsonl"
        assert (await other.purge(0, archive_path=archive)).purged == 1
        # A settle here: the wait looks again (another store's it hears only at its poll).
        await waiter.cancel(await waiter.enqueue("alpha", {}))
        with pytest.raises(ItemPurged, match=f"item {item_id} settled and was purged"):
            await asyncio.wait_for(waiting, 30)
    assert '"answer":42' in archive.read_text()  # where it says the outcome is


async def test_wait_refuses_out_of_scope_however_short_the_timeout(store: ControlStore) -> None:
    # The first look comes before the timeout runs: a refusal is a refusal, not a timeout.
    item = await store.enqueue("alpha", {})
    with pytest.raises(ScopeDenied):
        await store.wait(item, timeout=1e-9, actor_id="stranger")
    with pytest.raises(UnknownItem):
        await store.wait(item + 100, timeout=1e-9)
    with pytest.raises(WaitTimeout):
        await store.wait(item, timeout=1e-9)


async def test_a_settle_in_another_process_wakes_the_waiter(
    store: ControlStore, location_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    del store
    where = location_of("w.db")
    async with ControlStore(where) as store:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None
        if store.backend == "postgresql":
            # Only NOTIFY may wake it in time: no safety look during this test.
            from asyncplane import _postgres

            monkeypatch.setattr(_postgres, "_SAFETY_POLL_SECONDS", 3600.0)
        # On SQLite another process's commit is seen by a data_version look; on
        # PostgreSQL only its NOTIFY may wake the waiter in time.
        poll = 0.01 if store.backend == "sqlite" else 3600
        waiting = asyncio.create_task(store.wait(item_id, timeout=20, poll_interval=poll))
        script = (
            "import asyncio, sys\n"
            "from asyncplane import ControlStore\n"
            "async def main():\n"
            "    async with ControlStore(sys.argv[1]) as s:\n"
            "        await s.finish(int(sys.argv[2]), fence=int(sys.argv[3]), result='there')\n"
            "asyncio.run(main())\n"
        )
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, where, str(item_id), str(claim.fence),
            stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await child.communicate()
        assert child.returncode == 0, err
        assert (await waiting)["result"] == "there"


def counted_looks(backend: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every read of one item (the backend's own `get_item`, called through)."""
    looks = [0]
    real = backend.get_item

    async def get_item(item_id: int, actor_id: str | None) -> Any:
        looks[0] += 1
        return await real(item_id, actor_id)

    monkeypatch.setattr(backend, "get_item", get_item)
    return looks


async def waiting_on_many(store: ControlStore, count: int, looks: list[int]) -> tuple[
    list[int], list[asyncio.Task[dict[str, Any]]]
]:  # fmt: skip
    """``count`` callers waiting, each for an item of a paused project (nobody claims it),
    once each has looked at its item twice (before and after its mark) and the store's
    watch of them sleeps."""
    await store.create_project("held", "Held", status="paused")
    items = await store.enqueue_many("held", [{"n": n} for n in range(count)])
    waiters = [
        asyncio.create_task(store.wait(item_id, timeout=60, poll_interval=3600))
        for item_id in items
    ]
    await until(lambda: looks[0] == 2 * count and parked(), what="every caller waits")
    return items, waiters


async def test_writes_of_this_process_make_no_waiting_caller_look_again(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forty callers waiting beside a worker: every write of the process used to wake every
    # caller, each to read its item again (a hundred halved the worker's rate). One watch
    # reads them all in one statement now, and wakes only the caller whose item settled.
    looks = counted_looks(await store._engine.ready(), monkeypatch)
    items, waiters = await waiting_on_many(store, 40, looks)
    for n in range(20):  # a worker's writes: enqueues, claims and finishes of other items
        await store.enqueue("alpha", {"k": n})
        claim = await store.claim("w", project_id="alpha")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)
    await until(parked, what="the watch sleeps again")
    assert looks[0] == 80  # nobody looked again
    await store.cancel(items[0])
    assert (await waiters[0])["state"] == "cancelled"
    await until(parked, what="the watch sleeps again")
    assert looks[0] == 81  # the one caller whose item settled, alone
    assert not any(waiter.done() for waiter in waiters[1:])
    for waiter in waiters[1:]:
        waiter.cancel()
    await asyncio.gather(*waiters[1:], return_exceptions=True)


async def test_a_settle_elsewhere_makes_only_its_own_caller_look_again(
    store: ControlStore, location_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another connection's commits (on SQLite, seen by one data_version look every poll
    # interval; on PostgreSQL a settle's NOTIFY) used to wake every caller to read its item.
    del store
    where = location_of("many.db")
    async with ControlStore(where) as store, ControlStore(where) as elsewhere:
        looks = counted_looks(await store._engine.ready(), monkeypatch)
        items, waiters = await waiting_on_many(store, 30, looks)
        poll_quickly = asyncio.create_task(store.wait(items[1], timeout=60, poll_interval=0.01))
        await until(lambda: looks[0] == 62 and parked(), what="a quick poller waits too")
        await elsewhere.enqueue("held", {"unrelated": True})  # a commit that settles none
        await elsewhere.cancel(items[0])
        assert (await waiters[0])["state"] == "cancelled"
        assert looks[0] == 63  # its caller's look, and no other
        for waiter in (*waiters[1:], poll_quickly):
            waiter.cancel()
        await asyncio.gather(*waiters[1:], poll_quickly, return_exceptions=True)


async def test_a_wait_whose_store_closes_as_it_begins_to_wait_ends_and_leaves_it_closed(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's one watch of items waited for took the store's close count at its first
    # step: a close between a caller's look and that step went unseen, the watch opened
    # the closed store again, and the wait never ended.
    await store.create_project("held", "Held", status="paused")
    item_id = await store.enqueue("held", {})
    waiting = asyncio.create_task(store.wait(item_id))
    await until(lambda: store._engine.settles.waited == 1, what="the caller is watched")
    await store.close()
    with pytest.raises(StoreClosed):
        await asyncio.wait_for(waiting, 60)
    assert not store._engine.is_open
    # And a close during the caller's look after its mark, before it joins the watch.
    await closed_during_a_look(store, monkeypatch, item_id, look=2)


async def closed_during_a_look(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, item_id: int, look: int
) -> None:
    """Close the store while a `wait()` for ``item_id`` has its ``look``-th read of the
    item out (a graceful close lets it end): the wait ends with StoreClosed, the store
    left closed."""
    backend = await store._engine.ready()
    real, looks = backend.get_item, [0]
    looking, go_on = asyncio.Event(), asyncio.Event()

    async def get_item(item_id: int, actor_id: str | None) -> Any:
        looks[0] += 1
        row = await real(item_id, actor_id)
        if looks[0] == look:
            looking.set()
            await go_on.wait()
        return row

    monkeypatch.setattr(backend, "get_item", get_item)
    waiting = asyncio.create_task(store.wait(item_id))
    await looking.wait()
    closing = asyncio.create_task(store.close())
    await until(lambda: not store._engine.is_open, what="the store closes")
    go_on.set()
    await closing
    with pytest.raises(StoreClosed):
        await asyncio.wait_for(waiting, 60)
    assert not store._engine.is_open


async def test_a_wait_whose_store_closes_during_its_first_look_ends_and_leaves_it_closed(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The close count was taken after the first look: a close that came while the look
    # was out (a graceful close lets reads in flight end) went unseen, and the wait
    # opened the store again and waited on.
    item_id = await store.enqueue("alpha", {})
    await closed_during_a_look(store, monkeypatch, item_id, look=1)


async def test_the_watch_of_items_waited_for_runs_in_no_callers_context(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Started by the first caller, it ran in that caller's context for as long as it ran
    # (a work() handler's span, its item): every read of the watch was that handler's.
    backend = await store._engine.ready()
    real, seen = backend.ended_among, []

    async def ended_among(item_ids: list[int], states: tuple[str, ...]) -> list[int]:
        seen.append(_CALLER.get())
        return await real(item_ids, states)

    monkeypatch.setattr(backend, "ended_among", ended_among)
    item_id = await store.enqueue("alpha", {})

    async def caller() -> dict[str, Any]:
        _CALLER.set("a handler's")
        return await store.wait(item_id, timeout=60)

    waiting = asyncio.create_task(caller())
    await until(lambda: bool(seen), what="the watch reads")
    await store.cancel(item_id)
    await waiting
    assert set(seen) == {"nobody's"}


_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="nobody's")


# --- drain ------------------------------------------------------------------------------------


def _agent_running_forever() -> tuple[asyncio.Event, asyncio.Event, Any]:
    """An executor that runs until it is cancelled: (started, stopped, the executor)."""
    started, stopped = asyncio.Event(), asyncio.Event()

    async def execute(batch: list[Any]) -> list[Any]:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.set()
            raise
        return [Done()]

    return started, stopped, execute


async def test_drain_stops_an_executor_whose_item_is_cancelled(
    store: ControlStore, clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {})
    started, stopped, execute = _agent_running_forever()
    running = asyncio.create_task(drain(store, execute, batch_size=1, max_iters=1))
    await started.wait()
    assert await store.cancel(item_id, reason="operator") == "cancelled"
    clock.advance(store.lease_seconds / 3 + 1)  # the renewer's next turn
    summary = await running
    assert stopped.is_set()
    assert summary.cancelled == 1
    assert (await store.item(item_id))["state"] == "cancelled"
    assert await verify_ledger(store) == []


@pytest.mark.parametrize("then", ["requeued", "taken over"])
async def test_drain_stops_an_executor_whose_batch_is_no_longer_its_own(
    store: ControlStore, clock: ManualClock, then: str
) -> None:
    # Cancelled and requeued before the renewer's turn (the renewal then refused as an
    # item ready again, not cancelled), or taken over: the executor ran on to its end
    # beside the item's new run, its outcome only to be refused.
    item_id = await store.enqueue("alpha", {})
    started, stopped, execute = _agent_running_forever()
    running = asyncio.create_task(drain(store, execute, batch_size=1, max_iters=1))
    await started.wait()
    if then == "requeued":
        assert await store.cancel(item_id, reason="restart it") == "cancelled"
        await store.requeue(item_id)
        clock.advance(store.lease_seconds / 3 + 1)  # the renewer's next turn
    else:
        clock.advance(store.lease_seconds + 1)  # lapsed: the renewer's turn, late
    again = await store.claim("other")  # before the renewer runs: its renewal is refused
    assert again is not None and again.item_id == item_id
    summary = await running
    assert stopped.is_set()
    assert (summary.fence_rejected, summary.cancelled, summary.done) == (1, 0, 0)
    await store.finish(item_id, fence=again.fence)
    assert await verify_ledger(store) == []


async def test_events_last_reads_only_the_newest_of_a_long_history(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {})
    for attempt in range(5):
        claim = await store.claim("w")
        assert claim is not None
        await store.retry(item_id, fence=claim.fence, error=f"try {attempt}", delay=0)
    whole = await store.events(item_id)
    assert len(whole) == 11
    assert await store.events(item_id, last=3) == whole[-3:]  # oldest first
    assert await store.events(item_id, last=100) == whole
    assert await store.events(item_id, last=1) == whole[-1:]
    fresh = await store.enqueue("alpha", {})
    assert [e["event_type"] for e in await store.events(fresh, last=5)] == ["queued"]
    await store.create_project("beta", "Beta")
    await store.assign("beta", "a")
    with pytest.raises(ScopeDenied):
        await store.events(item_id, actor_id="a", last=3)
    with pytest.raises(UnknownItem):
        await store.events(10**6, last=3)
    for bad in (0, -1):
        with pytest.raises(InvalidInput, match="last must be positive"):
            await store.events(item_id, last=bad)
    with pytest.raises(InvalidType):
        await store.events(item_id, last="3")  # type: ignore[arg-type]
    await store.close()
    shown = cli("events", store.location, str(item_id), "--last", "2", "--json")
    assert shown.returncode == 0, shown.stderr
    assert [e["event_id"] for e in json.loads(shown.stdout)["events"]] == [
        e["event_id"] for e in whole[-2:]
    ]
    bad = cli("events", store.location, str(item_id), "--last", "0")
    assert bad.returncode == 2 and "--last must be positive" in bad.stderr


# --- the command line -------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncplane.cli", *args], capture_output=True, text=True, timeout=120
    )


def seeded(location: str) -> dict[str, int]:
    """A store with a failed item (rate limited), a failed one (bad brief), three ready."""

    async def seed() -> dict[str, int]:
        async with ControlStore(location) as store:
            await store.create_project("alpha", "Alpha")
            ids = {
                "limited": await failed_item(store, {"n": 1}, "Rate limit reached"),
                "bad": await failed_item(store, {"n": 2}, "bad brief"),
            }
            for n in range(3):
                ids[f"ready{n}"] = await store.enqueue("alpha", {"n": 10 + n})
            return ids

    return asyncio.run(seed())


def test_cli_items_finds_and_pages(location_of: Any) -> None:
    where = location_of("cli.db")
    ids = seeded(where)
    found = cli("items", where, "--state", "failed", "--json")
    assert found.returncode == 0, found.stderr
    rows = json.loads(found.stdout)["items"]
    assert [r["item_id"] for r in rows] == [ids["bad"], ids["limited"]]
    assert rows[0]["payload"] == {"n": 2}
    table = cli("items", where, "--project", "alpha", "--error", "rate LIMIT")
    assert table.returncode == 0, table.stderr
    assert "Rate limit reached" in table.stdout and "bad brief" not in table.stdout
    page = cli("items", where, "--limit", "2")
    assert f"(more: --after {ids['ready1']})" in page.stdout
    rest = json.loads(cli("items", where, "--after", str(ids["ready1"]), "--json").stdout)
    assert [r["item_id"] for r in rest["items"]] == [ids["ready0"], ids["bad"], ids["limited"]]
    assert rest["next_after"] is None  # a page that was not full: none comes after it
    full = json.loads(cli("items", where, "--limit", "2", "--json").stdout)
    assert full["next_after"] == ids["ready1"]


def test_cli_items_shows_an_errors_control_characters_escaped(tmp_path: pathlib.Path) -> None:
    # A worker's error (a model's output, a library's) may hold a carriage return, which
    # would overwrite the table's line, or an escape sequence, which the terminal obeys.
    where = str(tmp_path / "shown.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("alpha", "Alpha")
            await store.enqueue("alpha", {})
            claim = await store.claim("w")
            assert claim is not None
            error = "boom\r  9 a done\x1b[2J\x1b]0;title\x07 and\nmore"
            await store.finish(claim.item_id, fence=claim.fence, status="failed", error=error)

    asyncio.run(seed())
    table = cli("items", where)
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and "\r" not in table.stdout and "\x07" not in table.stdout
    assert "boom\\r  9 a done\\x1b[2J\\x1b]0;title\\x07 and more" in table.stdout


async def test_a_rows_own_time_given_back_as_a_bound_excludes_it(
    store: ControlStore, clock: ManualClock
) -> None:
    # Stored times are finer than the microsecond a datetime holds: a row listed with
    # created_at rounded down was still "created after" its own created_at. A datetime
    # bound names its whole microsecond; epoch seconds are taken as they are.
    for step in range(10):
        clock.advance(1 + (step + 1) * 0.9e-7)  # the same fraction of a microsecond, never
        await store.enqueue("alpha", {"n": step})
    rows = await store.items(limit=100)
    assert len(rows) == 10
    micro = dt.timedelta(microseconds=1)
    for row in rows:
        after = {r["item_id"] for r in await store.items(created_after=row["created_at"])}
        before = {r["item_id"] for r in await store.items(created_before=row["created_at"])}
        assert row["item_id"] not in after | before
        assert len(after) + len(before) == 9
        # A microsecond away, the row is inside the bound again.
        earlier = await store.items(created_after=row["created_at"] - micro, limit=100)
        later = await store.items(created_before=row["created_at"] + micro, limit=100)
        assert row["item_id"] in {r["item_id"] for r in earlier + later}
        assert row["item_id"] in {r["item_id"] for r in earlier}
        assert row["item_id"] in {r["item_id"] for r in later}
    newest = rows[0]
    assert await store.items(updated_after=newest["updated_at"]) == []


async def test_a_bound_at_the_epoch_or_the_last_datetime_is_answered_at_once(
    store: ControlStore,
) -> None:
    # A datetime bound's microsecond edge was found float by float: billions of steps
    # near 1970 (the event loop stopped for good on `created_after=` the epoch), and the
    # last datetime stepped past what a datetime holds (StorageError for valid input).
    ids = await store.enqueue_many("alpha", [{}, {}])
    epoch = dt.datetime.fromtimestamp(0, dt.timezone.utc)
    last = dt.datetime.max.replace(tzinfo=dt.timezone.utc)
    listed = [r["item_id"] for r in await store.items(created_after=epoch, limit=10)]
    assert sorted(listed) == ids
    assert await store.items(updated_before=epoch) == []
    assert await store.items(created_after=last) == []
    assert len(await store.items(created_before=last, limit=10)) == 2
    assert await store.cancel_where(created_after=last, state="ready") == 0
    assert await store.cancel_where(created_after=epoch, state="ready") == 2


async def test_a_bad_after_or_reason_is_named_as_such(store: ControlStore) -> None:
    with pytest.raises(InvalidInput, match="after must be positive"):
        await store.items(after=0)
    with pytest.raises(InvalidInput, match="reason is 17000 characters"):
        await store.cancel(1, reason="x" * 17_000)
    with pytest.raises(InvalidType, match="reason must be a str, not int"):
        await store.cancel_where(state="ready", reason=7)  # type: ignore[arg-type]


def test_cli_cancel_and_requeue_by_id_and_by_filter(location_of: Any) -> None:
    where = location_of("cli.db")
    ids = seeded(where)
    one = cli("cancel", where, str(ids["ready0"]), "--reason", "wrong brief")
    assert one.returncode == 0 and f"item {ids['ready0']}: cancelled" in one.stdout
    unknown = cli("cancel", where, "999")
    assert unknown.returncode == 2 and "no item 999" in unknown.stdout
    asked = cli("cancel", where, "--project", "alpha", "--state", "ready")
    assert asked.returncode == 0 and "2 items would be cancelled; add --yes" in asked.stdout
    assert len(json.loads(cli("items", where, "--state", "ready", "--json").stdout)["items"]) == 2
    done = cli("cancel", where, "--project", "alpha", "--state", "ready", "--yes", "--json")
    assert json.loads(done.stdout) == {"changed": 2}
    not_failed = cli("requeue", where, str(ids["ready1"]), str(ids["bad"]))
    assert f"item {ids['bad']}: ready" in not_failed.stdout
    assert not_failed.returncode == 0  # a cancelled item requeues too
    refused = cli("requeue", where, str(ids["bad"]))
    assert refused.returncode == 2 and "is ready" in refused.stdout
    limited = cli("requeue", where, "--state", "failed", "--error", "rate limit", "--yes")
    assert limited.returncode == 0 and "requeued 1 item" in limited.stdout
    states = {
        r["item_id"]: r["state"] for r in json.loads(cli("items", where, "--json").stdout)["items"]
    }
    assert states == {
        ids["limited"]: "ready", ids["bad"]: "ready", ids["ready0"]: "cancelled",
        ids["ready1"]: "ready", ids["ready2"]: "cancelled",
    }  # fmt: skip

    def history() -> list[Any]:
        return json.loads(cli("events", where, str(ids["limited"]), "--json").stdout)["events"]

    before = history()
    for bad in ("0", "-3", str(2**63)):  # no item has it: refused before any is touched
        for verb in ("cancel", "requeue"):
            mixed = cli(verb, where, str(ids["limited"]), bad)
            assert mixed.returncode == 2 and "an item id must" in mixed.stderr, mixed
            assert mixed.stdout == ""
    assert history() == before  # neither cancelled nor requeued
    both = cli("cancel", where, "1", "--state", "ready")
    assert both.returncode == 2 and "not both" in both.stderr
    nothing = cli("cancel", where)
    assert nothing.returncode == 2 and "--project" in nothing.stderr


def test_cli_output_cut_short_by_its_reader_is_no_failure(tmp_path: pathlib.Path) -> None:
    # `asyncplane items work.db | head -1`: the pipe closes under the command.
    where = str(tmp_path / "many.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("alpha", "Alpha")
            await store.enqueue_many("alpha", [{"n": n} for n in range(3000)])

    asyncio.run(seed())
    child = subprocess.Popen(
        [sys.executable, "-m", "asyncplane.cli", "items", where, "--limit", "3000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    with child.stdout, child.stderr:
        assert b"ID" in child.stdout.readline()
        child.stdout.close()  # as head does, having its line
        err = child.stderr.read()
    assert child.wait(timeout=60) == 0 and err == b"", err


def test_a_verbs_status_survives_its_reader_going(tmp_path: pathlib.Path) -> None:
    # `asyncplane verify db | head` under `set -o pipefail`: a damaged ledger is still 1,
    # and ids refused are still 2, when the reader went before the output ended.
    where = str(tmp_path / "damaged.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("alpha", "Alpha")
            await store.enqueue_many("alpha", [{"n": n} for n in range(3000)])

    asyncio.run(seed())
    with contextlib.closing(sqlite3.connect(where)) as conn, conn:
        conn.execute("UPDATE items SET state = 'failed', error = 'x'")  # unlike their history
    ids = [str(n) for n in range(10_001, 14_001)]  # none of them there
    for args, status in ((["verify", where], 1), (["verify", where, "--json"], 1),
                         (["cancel", where, *ids], 2)):  # fmt: skip
        child = subprocess.Popen(
            [sys.executable, "-m", "asyncplane.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert child.stdout is not None and child.stderr is not None
        with child.stdout, child.stderr:
            assert child.stdout.read(1)
            child.stdout.close()  # as head does, having its line
            err = child.stderr.read()
        assert child.wait(timeout=60) == status, (args, err)
        assert b"Traceback" not in err, err


def test_the_command_line_under_an_ascii_locale(tmp_path: pathlib.Path) -> None:
    # A `C` locale with Python's UTF-8 mode and coercion off: stdout is ASCII, and the
    # argument `café` comes as its UTF-8 bytes escaped. A path so named stays the file's.
    where = str(tmp_path / "café.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("café", "Café")
            item_id = await store.enqueue("café", {})
            claim = await store.claim("w")
            assert claim is not None
            await store.finish(item_id, fence=claim.fence, status="failed", error="modèle refusé")

    asyncio.run(seed())
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    for args in (["stats", where], ["items", where], ["project", where, "café"],
                 ["enqueue", where, "café", "--payload", '{"city": "Zürich"}']):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "asyncplane.cli", *args],
            capture_output=True, env=env, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (args, done.stderr)
    listed = subprocess.run(
        [sys.executable, "-m", "asyncplane.cli", "items", where],
        capture_output=True, env=env, timeout=120,
    )  # fmt: skip
    assert b"caf\\xe9" in listed.stdout and b"mod\\xe8le" in listed.stdout, listed.stdout

    async def projects() -> list[str]:
        async with ControlStore(where) as store:
            assert (await store.item(2))["payload"] == {"city": "Zürich"}
            return [project["project_id"] for project in await store.projects()]

    assert asyncio.run(projects()) == ["café"]  # the same project, not a second one


def test_cli_usage_errors_never_show_a_password(tmp_path: pathlib.Path) -> None:
    url = "postgresql://app:s3cret@db.example/work?sslpassword=k3y"
    slashed = "postgresql://app:s3cret/x@db.example/work"  # a '/' unencoded in the password
    for args in (("stats", url, url), ("events", "13", url), (url, "stats"), ("cancel", "5", url),
                 ("stats", slashed), ("items", slashed, "--json")):  # fmt: skip
        done = cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert "s3cret" not in done.stderr and "k3y" not in done.stderr, done.stderr
        assert any(words in done.stderr for words in ("app:***@", "usage", "cannot be read"))


def test_cli_frictions_a_new_user_met(tmp_path: pathlib.Path) -> None:
    folder = cli("stats", str(tmp_path))
    assert folder.returncode == 2 and "is a directory" in folder.stderr
    os.mkfifo(tmp_path / "pipe.db")
    pipe = cli("stats", str(tmp_path / "pipe.db"))
    assert pipe.returncode == 2 and "is not a regular file" in pipe.stderr, pipe.stderr
    where = str(tmp_path / "s.db")
    seeded(where)
    typo = cli("items", where, "--stae", "failed")
    assert typo.returncode == 2 and "usage: asyncplane items" in typo.stderr
    for good in ("1h30m", "90s", "2w", "0.5d", "45"):
        done = cli("purge", where, "--retention", good, "--json")
        assert done.returncode == 0, (good, done.stderr)
    negative = cli("purge", where, "--retention", "-1d")
    assert negative.returncode == 2 and "cannot be negative" in negative.stderr
    mixed = cli("purge", where, "--retention", "1h30")
    assert mixed.returncode == 2 and "not a duration" in mixed.stderr
    into_folder = cli("purge", where, "--retention", "0", "--archive", str(tmp_path))
    assert into_folder.returncode == 2 and "is a directory" in into_folder.stderr
    nowhere = cli("purge", where, "--retention", "0", "--archive", str(tmp_path / "no" / "a"))
    assert nowhere.returncode == 2 and "--archive: no directory" in nowhere.stderr
    source = tmp_path / "src.sqlite3"
    conn = sqlite3.connect(source)
    conn.execute("CREATE TABLE q (data TEXT)")
    conn.commit()
    conn.close()
    no_project = cli("import", where, "--from", str(source), "--table", "q",
                     "--column", "payload=data")  # fmt: skip
    assert no_project.returncode == 2
    said = "give --project, or map a project column with --column project_id=COLUMN, exactly"
    assert said in no_project.stderr  # each word put in flags once (no "--projectCOLUMN")
    events = cli("events", where, "1").stdout.splitlines()
    assert len({len(line.split()[0]) for line in events}) == 1  # one time format
    assert all(line.split()[0].endswith("+00:00") for line in events)


def test_cli_names_a_missing_postgresql_schema_as_a_usage_error(
    asyncplane_postgres_url: str,
) -> None:
    missing = testing.with_schema(asyncplane_postgres_url, "no_such_schema_here")
    done = cli("stats", missing)
    assert done.returncode == 2, done.stderr
    assert "CREATE SCHEMA" in done.stderr


# --- retention and copying ---------------------------------------------------------------------


async def test_purge_archives_cancelled_items_like_other_settled_ones(
    store: ControlStore, clock: ManualClock
) -> None:
    cancelled = await store.enqueue("alpha", {"n": 1})
    await store.cancel(cancelled, reason="not needed")
    requeued = await failed_item(store, {"n": 2}, "boom")
    await store.requeue(requeued)  # ready again: never purged, whatever its history
    clock.advance(10)
    summary = await store.purge(5)
    assert summary.purged == 1
    archive = summary.archive_path
    line = json.loads(archive.read_text().splitlines()[0])
    assert line["item"]["item_id"] == cancelled and line["item"]["state"] == "cancelled"
    assert [e["event_type"] for e in line["events"]] == ["queued", "cancelled"]
    assert (await store.counts())["cancelled"] == 0
    assert (await store.item(requeued))["state"] == "ready"
    assert await verify_ledger(store) == []


async def test_an_item_cancelled_while_offloaded_is_archived_with_its_handle(
    store: ControlStore, clock: ManualClock
) -> None:
    # The cancel keeps the handle of the external batch that may still be running it; the
    # archive left the handle out, so purging lost the one pointer to that batch.
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    await store.offload(item_id, fence=claim.fence, handle="batch-7")
    await store.cancel(item_id, reason="not needed")
    assert (await store.item(item_id))["offload_handle"] == "batch-7"
    done = await store.enqueue("alpha", {})
    again = await store.claim("w")
    assert again is not None and again.item_id == done
    await store.finish(done, fence=again.fence)
    clock.advance(10)
    summary = await store.purge(5)
    assert summary.purged == 2
    lines = [json.loads(line)["item"] for line in summary.archive_path.read_text().splitlines()]
    handles = {line["item_id"]: line["offload_handle"] for line in lines}
    assert handles == {item_id: "batch-7", done: None}
    assert await verify_ledger(store) == []


async def test_copy_store_carries_cancelled_and_requeued_histories(
    store: ControlStore, asyncplane_store_factory: Any
) -> None:
    cancelled = await store.enqueue("alpha", {"n": 1})
    await store.cancel(cancelled, reason="stop")
    requeued = await failed_item(store, {"n": 2}, "boom")
    await store.requeue(requeued)
    everything: ControlStore = await asyncplane_store_factory(name="all")
    summary = await copy_store(store, everything)
    assert summary.copied == 2
    for item_id in (cancelled, requeued):
        assert await everything.item(item_id) == await store.item(item_id)
        assert await everything.events(item_id) == await store.events(item_id)
    assert await verify_ledger(everything) == []
    pending: ControlStore = await asyncplane_store_factory(name="pending")
    await copy_store(store, pending, pending_only=True)
    assert [row["item_id"] for row in await pending.items()] == [requeued]  # not the cancelled


def test_cli_takes_ids_after_flags_and_speaks_in_flags(location_of: Any) -> None:
    where = location_of("cli.db")
    ids = seeded(where)
    after = cli("cancel", where, "--reason", "late", str(ids["ready0"]), "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["items"] == [{"item_id": ids["ready0"], "state": "cancelled"}]
    empty = cli("items", where, "--error", "")
    assert empty.returncode == 2 and "--error must be" in empty.stderr
    assert "error_contains" not in empty.stderr
    big = cli("items", where, "--limit", "20000")
    assert big.returncode == 2 and "--limit is 20000" in big.stderr
    for verb, extra in (("cancel", ["--yes"]), ("requeue", ["--yes"]), ("items", [])):
        unknown = cli(verb, where, "--project", "nope", "--state", "failed", *extra)
        assert unknown.returncode == 2 and "no project 'nope'" in unknown.stderr, verb


async def test_items_filters_by_when_an_item_last_changed(
    store: ControlStore, clock: ManualClock
) -> None:
    early = await store.enqueue("alpha", {"n": 1})
    late = await store.enqueue("alpha", {"n": 2})
    clock.advance(100)
    await store.cancel(late)
    cut = clock.now() - 50
    assert [r["item_id"] for r in await store.items(updated_after=cut)] == [late]
    assert [r["item_id"] for r in await store.items(updated_before=cut)] == [early]


async def test_a_cancel_in_this_process_wakes_a_waiter_at_once(store: ControlStore) -> None:
    # A poll interval of an hour: only the store's own wake-up can end this wait in time.
    item_id = await store.enqueue("alpha", {})
    waiting = asyncio.create_task(store.wait(item_id, timeout=30, poll_interval=3600))
    await until(parked, what="the waiter waits")
    await store.cancel(item_id)
    assert (await waiting)["state"] == "cancelled"


async def test_a_requeue_in_this_process_wakes_a_waiting_claim(store: ControlStore) -> None:
    item_id = await failed_item(store, {"n": 1}, "boom")
    waiting = asyncio.create_task(store.claim("w", wait=30, poll_interval=3600))
    await until(
        lambda: any(t.get_name() == "asyncplane-wait-work-local" for t in asyncio.all_tasks()),
        what="the claim waits",
    )
    await store.requeue(item_id)
    claim = await waiting
    assert claim is not None and claim.item_id == item_id


@pytest.mark.sqlite_only  # on PostgreSQL the server's NOTIFY wakes it whatever this process does
@pytest.mark.parametrize(
    "settle", ["finish", "finish_and_claim", "retry", "cancel", "cancel_where"]
)
async def test_a_settle_saved_for_a_caller_gone_wakes_a_waiter_at_once(
    store: ControlStore, raw: Any, settle: str
) -> None:
    # The settle's caller is cancelled while its round runs; the round commits it for
    # nobody. This process's waiter hears of it from the writer, not an hour later.
    item_id = await store.enqueue("alpha", {}, max_attempts=1)  # a retry fails it
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == item_id
    waiting = asyncio.create_task(store.wait(item_id, timeout=30, poll_interval=3600))
    await until(parked, what="the waiter waits")
    calls = {
        "finish": lambda: store.finish(item_id, fence=claim.fence, result=1),
        "finish_and_claim": lambda: store.finish_and_claim(item_id, fence=claim.fence, owner="w"),
        "retry": lambda: store.retry(item_id, fence=claim.fence, error="boom"),
        "cancel": lambda: store.cancel(item_id),
        "cancel_where": lambda: store.cancel_where(project_id="alpha"),
    }
    await cancelled_in_its_round(store, raw, calls[settle]())
    raw.execute("COMMIT")
    found = await waiting
    states = {"retry": "failed", "cancel": "cancelled", "cancel_where": "cancelled"}
    assert found["state"] == states.get(settle, "done")


@pytest.mark.sqlite_only  # on PostgreSQL the server's NOTIFY wakes it whatever this process does
async def test_an_enqueue_saved_for_a_caller_gone_wakes_a_waiting_claim_at_once(
    store: ControlStore, raw: Any
) -> None:
    # The enqueue's caller is cancelled while its round runs; the round commits the item
    # for nobody. This process's waiting claim hears of it from the writer, not an hour
    # later.
    waiting = asyncio.create_task(store.claim("w", wait=30, poll_interval=3600))
    await until(
        lambda: any(t.get_name() == "asyncplane-wait-work-local" for t in asyncio.all_tasks()),
        what="the claim waits",
    )
    await cancelled_in_its_round(store, raw, store.enqueue("alpha", {"n": 1}))
    raw.execute("COMMIT")
    claim = await waiting
    assert claim is not None and claim.payload == {"n": 1}


@pytest.mark.sqlite_only  # on PostgreSQL the server's NOTIFY wakes it whatever this process does
@pytest.mark.parametrize("how", ["in its round", "as answered"])
@pytest.mark.parametrize(
    "write",
    [
        "requeue", "requeue_where", "import_pending", "set_project_status", "assign",
        "set_limits", "run_schedules",
    ],
)  # fmt: skip
async def test_a_write_that_frees_work_saved_for_a_caller_gone_wakes_a_waiting_claim(
    store: ControlStore,
    raw: Any,
    clock: ManualClock,
    write: str,
    how: str,
    tmp_path: pathlib.Path,
) -> None:
    # As above, for the writes that are not settles but make work claimable: an item
    # requeued (alone or in a filter's chunk), rows imported, its project opened or given
    # to the waiting claim's actor, its project's limit raised, a schedule's due tick
    # enqueued; its caller cancelled while its round ran, or as its answer came in.
    source = tmp_path / "source.sqlite3"
    if write == "import_pending":
        with contextlib.closing(sqlite3.connect(source)) as conn, conn:
            conn.execute("CREATE TABLE queue (data TEXT)")
            conn.execute("""INSERT INTO queue VALUES ('{"n": 1}')""")
        first = None
    elif write == "run_schedules":
        await store.set_schedule("s", project_id="alpha", payload={"n": 1}, every=3600)
        clock.advance(3600)  # its first tick is due, and nothing has enqueued it
        first = None
    else:
        first = await store.enqueue("alpha", {"n": 1})
    if write in ("requeue", "requeue_where"):
        await store.cancel(first)
    elif write == "set_project_status":
        await store.set_project_status("alpha", "paused")
    elif write == "set_limits":
        await store.set_limits("alpha", max_running=1)
        assert await store.claim("w") is not None  # the one it may run
        first = await store.enqueue("alpha", {"n": 2})
    actor = "a2" if write == "assign" else None  # alpha is not yet a2's
    waiting = asyncio.create_task(store.claim("w2", actor_id=actor, wait=10, poll_interval=3600))
    await until(
        lambda: any(t.get_name() == "asyncplane-wait-work-local" for t in asyncio.all_tasks()),
        what="the claim waits",
    )
    calls = {
        "requeue": lambda: store.requeue(first),
        "requeue_where": lambda: store.requeue_where(project_id="alpha"),
        "import_pending": lambda: store.import_pending(
            source, table="queue", columns={"payload": "data"}, project_id="alpha"
        ),
        "set_project_status": lambda: store.set_project_status("alpha", "open"),
        "assign": lambda: store.assign("alpha", "a2"),
        "set_limits": lambda: store.set_limits("alpha", max_running=2),
        "run_schedules": store.run_schedules,
    }
    if how == "in its round":
        await cancelled_in_its_round(store, raw, calls[write]())
        raw.execute("COMMIT")
    else:
        method = {"import_pending": "import_rows"}.get(write, write)
        await cancelled_as_answered(store, method, calls[write]())
    claim = await waiting
    assert claim is not None and claim.owner == "w2"
    assert claim.item_id == first if first is not None else claim.payload == {"n": 1}


@pytest.mark.sqlite_only  # on PostgreSQL the server's NOTIFY wakes it whatever this process does
@pytest.mark.parametrize("settle", ["release", "park"])
async def test_a_settle_saved_for_a_caller_gone_wakes_a_waiting_claim_at_once(
    store: ControlStore, raw: Any, clock: ManualClock, settle: str
) -> None:
    # As above, for a claim waiting for work: a release makes the item ready again, a
    # park of no delay makes it due at once.
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == item_id
    waiting = asyncio.create_task(store.claim("w2", wait=30, poll_interval=3600))
    await until(
        lambda: any(t.get_name() == "asyncplane-wait-work-local" for t in asyncio.all_tasks()),
        what="the claim waits",
    )
    call = (
        store.release(item_id, fence=claim.fence) if settle == "release"
        else store.park(item_id, fence=claim.fence, delay=0)
    )  # fmt: skip
    await cancelled_in_its_round(store, raw, call)
    raw.execute("COMMIT")
    again = await waiting
    assert again is not None and again.item_id == item_id and again.owner == "w2"


def test_init_makes_a_file_only_where_there_is_none(tmp_path: pathlib.Path) -> None:
    nowhere = tmp_path / "no" / "such" / "dir.db"
    refused = cli("init", str(nowhere))
    assert refused.returncode == 2 and "no such directory" in refused.stderr
    assert not nowhere.parent.exists()
    for odd in ("", ":memory:", f"{tmp_path}/newdir/"):
        refused = cli("init", odd)
        assert refused.returncode == 2 and "name one" in refused.stderr, odd
    assert not (tmp_path / "newdir").exists()
    other = tmp_path / "notes.db"
    other.write_text("not a store")
    refused = cli("init", str(other))
    assert refused.returncode == 2 and "not an asyncplane store" in refused.stderr
    assert other.read_text() == "not a store"
    foreign = tmp_path / "foreign.db"
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        conn.execute("CREATE TABLE t (x)")
    refused = cli("init", str(foreign))
    assert refused.returncode == 2 and "another application" in refused.stderr
    empty = tmp_path / "empty.db"
    empty.touch()  # a store whose making was cut short: made now
    assert cli("init", str(empty)).stdout == f"store ready: {empty}\n"
    assert cli("stats", str(empty)).returncode == 0


def test_cli_makes_a_project_and_queues_items(location_of: Any) -> None:
    # What a deployment's script does before its workers start, and a smoke test after.
    where = location_of("made.db")
    if "://" not in where:  # a file, which no verb but init makes
        missing = cli("project", where, "alpha")
        assert missing.returncode == 2 and "no such file" in missing.stderr
    for _ in range(2):  # made, then found: the script runs it each time
        ready = cli("init", where, "--json")
        assert ready.returncode == 0, ready.stderr
        assert json.loads(ready.stdout)["location"] == where
    assert cli("stats", where).returncode == 0  # a store of this release's schema
    made = cli("project", where, "alpha", "--name", "Alpha", "--json")
    assert made.returncode == 0, made.stderr
    row = json.loads(made.stdout)
    assert (row["project_id"], row["name"], row["status"], row["created"]) == (
        "alpha", "Alpha", "open", True,
    )  # fmt: skip
    again = cli("project", where, "alpha")  # idempotent: the script runs it each time
    assert (again.returncode, again.stdout) == (0, "alpha: open (unchanged)\n")
    paused = cli("project", where, "alpha", "--status", "paused")
    assert (paused.returncode, paused.stdout) == (0, "alpha: paused (was open)\n")
    renamed = cli("project", where, "alpha", "--name", "Other")
    assert renamed.returncode == 2 and "named 'Alpha': a name stays" in renamed.stderr
    first = cli("enqueue", where, "alpha", "--payload", '{"n": 1}', "--priority", "5")
    assert first.returncode == 0, first.stderr
    later = cli("enqueue", where, "alpha", "--payload", '{"n": 2}', "--after", "1h", "--json")
    assert later.returncode == 0, later.stderr
    twin = cli("enqueue", where, "alpha", "--payload", '{"n": 1}', "--fingerprint", "f")
    same = cli("enqueue", where, "alpha", "--payload", '{"n": 1}', "--fingerprint", "f")
    assert twin.stdout == same.stdout  # the twin's id
    apart = cli("enqueue", where, "alpha", "--payload", "{}", "--fingerprint", "f", "--no-dedup")
    assert apart.stdout != twin.stdout
    unknown = cli("enqueue", where, "nope", "--payload", "{}")
    assert unknown.returncode == 2 and "no project 'nope'" in unknown.stderr
    bad = cli("enqueue", where, "alpha", "--payload", "[1]")
    assert bad.returncode == 2 and "a payload is a JSON object" in bad.stderr
    for flags, said in (
        (["--after", "-5m"], "a duration cannot be negative"),
        (["--max-attempts", "0"], "--max-attempts must be positive"),
        (["--after", "100000000d"], "--after reaches past the year 9999"),
    ):
        refused = cli("enqueue", where, "alpha", "--payload", "{}", *flags)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr

    async def look() -> None:
        async with ControlStore(where) as store:
            item = await store.item(int(first.stdout))
            assert (item["payload"], item["priority"], item["state"]) == ({"n": 1}, 5, "ready")
            deferred = await store.item(json.loads(later.stdout)["item_id"])
            assert deferred["state"] == "deferred"
            assert (await store.project("alpha"))["status"] == "paused"
            assert (await store.counts())["ready"] + (await store.counts())["deferred"] == 4
            assert await verify_ledger(store) == []

    asyncio.run(look())
