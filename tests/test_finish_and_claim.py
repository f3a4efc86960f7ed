"""finish_and_claim: a settle and the next claim in one write round, the settle first."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from tests.test_writer import update_fault

from _signals import cancelled_cause
from asyncplane import (
    ClaimAfterSettleFailed,
    ClaimedItem,
    ControlStore,
    FenceRejected,
    InvalidInput,
    StorageError,
    _tasks,
    verify_ledger,
)
from asyncplane._backend import ClaimOp, FinishOp
from asyncplane._combine import _request_of as request_of
from asyncplane._errors import NotRun
from asyncplane._store import engine_of
from asyncplane._write_queue import Grouped, Raised, WriterBase, riders, runnable, units
from asyncplane.testing import ManualClock


async def _rounds(store: ControlStore) -> Callable[[], int]:
    """How many write rounds the store's writer has run so far, to read again later."""
    writer = (await engine_of(store).ready()).writer
    assert writer is not None
    return lambda: writer.rounds


async def test_it_settles_the_claim_and_claims_the_next(store: ControlStore) -> None:
    first_id, second_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    first = await store.claim(owner="w1")
    assert first is not None and first.item_id == first_id
    second = await store.finish_and_claim(
        first.item_id, fence=first.fence, owner="w2", result={"ok": 1}
    )
    assert second is not None
    assert (second.item_id, second.owner, second.fence, second.payload) == (
        second_id, "w2", 1, {"n": 2},
    )  # fmt: skip
    done = await store.item(first_id)
    assert (done["state"], done["result"]) == ("done", {"ok": 1})
    assert (await store.item(second_id))["state"] == "claimed"
    assert [e["event_type"] for e in await store.events(second_id)][-1] == "claimed"
    # The last item: settled, and nothing left to claim.
    assert await store.finish_and_claim(second.item_id, fence=second.fence, owner="w2") is None
    assert (await store.item(second_id))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_a_failed_settle_and_the_claim_options(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.create_project("beta", "Project Beta")
    await store.enqueue("alpha", {"n": 1})
    wanted = await store.enqueue("beta", {"n": 2})
    await store.enqueue("alpha", {"n": 3})
    first = await store.claim(owner="w", project_id="alpha")
    assert first is not None
    claim = await store.finish_and_claim(
        first.item_id, fence=first.fence, owner="w", status="failed", error="boom",
        project_id="beta", lease_seconds=7,
    )  # fmt: skip
    assert claim is not None and claim.item_id == wanted
    assert claim.lease_expires_at == clock.datetime() + dt.timedelta(seconds=7)
    failed = await store.item(first.item_id)
    assert (failed["state"], failed["error"]) == ("failed", "boom")


async def test_the_settle_and_the_claim_share_a_round_where_rounds_are_dear(
    store: ControlStore,
) -> None:
    # On PostgreSQL each goes alone, one statement that commits by itself.
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    rounds = await _rounds(store)
    claim = await store.claim(owner="w")
    assert claim is not None
    before = rounds()
    while claim is not None:
        claim = await store.finish_and_claim(claim.item_id, fence=claim.fence, owner="w")
    # Three settles, two claims that took an item and one that found none.
    assert rounds() - before == (3 if store.backend == "sqlite" else 6)
    assert (await store.counts())["done"] == 3


async def test_the_settle_runs_before_the_claim(store: ControlStore) -> None:
    # Under max_running=1 the next item is claimable only once the last is settled: the
    # claim that goes with the settle takes it, so the settle ran first.
    await store.set_limits("alpha", max_running=1)
    await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    claim = await store.claim(owner="w")
    taken = 0
    while claim is not None:
        taken += 1
        claim = await store.finish_and_claim(claim.item_id, fence=claim.fence, owner="w")
    assert taken == 4
    assert (await store.counts())["done"] == 4


async def test_a_finish_queued_after_a_claim_in_one_round_runs_first(store: ControlStore) -> None:
    # Two callers in the same turn: a claim, then a finish. Under max_running=1 the claim
    # finds room only because the finish, queued after it, runs ahead of it.
    await store.set_limits("alpha", max_running=1)
    held_id, next_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w1")
    assert held is not None and held.item_id == held_id
    rounds = await _rounds(store)
    before = rounds()
    claim, _ = await asyncio.gather(
        store.claim(owner="w2"), store.finish(held_id, fence=held.fence)
    )
    assert rounds() - before == 1  # both in one round
    assert claim is not None and claim.item_id == next_id


async def test_a_claim_that_fails_after_the_settle_says_the_settle_stands(
    store: ControlStore, raw: Any
) -> None:
    # The projects table gone (a tamperer's doing): every claim reads it, the settle not.
    item_id = await store.enqueue("alpha", {"n": 1})
    held = await store.claim(owner="w")
    assert held is not None
    raw.execute("ALTER TABLE projects RENAME TO projects_gone")
    with pytest.raises(ClaimAfterSettleFailed) as caught:
        await store.finish_and_claim(item_id, fence=held.fence, owner="w")
    assert isinstance(caught.value.__cause__, StorageError)
    raw.execute("ALTER TABLE projects_gone RENAME TO projects")
    assert (await store.item(item_id))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_a_refused_settle_is_raised_and_no_claim_made(store: ControlStore) -> None:
    held_id, other_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w1")
    assert held is not None and held.item_id == held_id
    with pytest.raises(FenceRejected):
        await store.finish_and_claim(held.item_id, fence=held.fence + 1, owner="w2")
    assert (await store.item(held_id))["state"] == "claimed"  # untouched: fence was wrong
    other = await store.item(other_id)
    assert (other["state"], other["attempts"]) == ("ready", 0)
    # On SQLite the claim rode in the settle's round and was not run; on PostgreSQL it
    # was never asked. Either way no claim was made to be given back.
    assert [e["event_type"] for e in await store.events(other_id)] == ["queued"]
    assert await verify_ledger(store) == []


async def test_a_settle_failing_as_its_round_runs_again_takes_no_claim(
    store: ControlStore, raw: Any
) -> None:
    # Three calls in one round; the second's settle meets a database fault, which spoils
    # the round's finishes as a whole. The writer runs them again one by one (SQLite,
    # `_writer._run_held`), then the round without the culprit: the claims riding on the
    # two settles that stand run, the one riding on the failed settle does not.
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(6)])
    held = await store.claim_batch("w", 3)
    assert [c.item_id for c in held] == ids[:3]
    rounds = await _rounds(store)
    before = rounds()
    with update_fault(raw, ids[1]):
        results = await asyncio.gather(
            *(store.finish_and_claim(c.item_id, fence=c.fence, owner="w") for c in held),
            return_exceptions=True,
        )
    if store.backend == "sqlite":
        assert rounds() == before + 1  # the settles and their claims, in one round
    assert isinstance(results[0], ClaimedItem) and isinstance(results[2], ClaimedItem)
    assert isinstance(results[1], StorageError) and "disk trouble" in str(results[1])
    assert {results[0].item_id, results[2].item_id} == set(ids[3:5])
    states = [(await store.item(item_id))["state"] for item_id in ids]
    assert states == ["done", "claimed", "done", "claimed", "claimed", "ready"]
    for item_id in ids:  # no claim made and given back
        assert "released" not in [e["event_type"] for e in await store.events(item_id)]
    assert await verify_ledger(store) == []


async def test_a_refused_settle_whose_claim_went_in_the_next_round_gives_it_back(
    asyncplane_store_factory: Callable[..., Any],
) -> None:
    # Rounds of one request each: the claim cannot ride in the settle's round, so it runs
    # in the next whatever the settle met; what it took is given back before the refusal
    # is raised, so the call still holds nothing.
    store: ControlStore = await asyncplane_store_factory(max_batch=1)
    await store.create_project("alpha", "Alpha")
    held_id, other_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w1")
    assert held is not None and held.item_id == held_id
    with pytest.raises(FenceRejected):
        await store.finish_and_claim(held.item_id, fence=held.fence + 1, owner="w2")
    other = await store.item(other_id)
    assert (other["state"], other["attempts"]) == ("ready", 0)
    # On SQLite the claim ran and gave its item back; on PostgreSQL it was never asked.
    made = ["queued", "claimed", "released"] if store.backend == "sqlite" else ["queued"]
    assert [e["event_type"] for e in await store.events(other_id)] == made
    assert await verify_ledger(store) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"status": "finished"},
        {"status": "done", "error": "no"},
        {"owner": ""},
        {"lease_seconds": -1},
        {"project_id": ""},
        {"fence": 0},
    ],
)
async def test_bad_arguments_write_nothing(store: ControlStore, bad: dict[str, Any]) -> None:
    await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w")
    assert held is not None
    rounds = await _rounds(store)
    before = rounds()
    kwargs: dict[str, Any] = {"fence": held.fence, "owner": "w", **bad}
    with pytest.raises(InvalidInput):
        await store.finish_and_claim(held.item_id, **kwargs)
    assert rounds() == before
    assert (await store.counts())["claimed"] == 1


async def test_a_cancelled_call_leaves_nothing_claimed_by_it(store: ControlStore) -> None:
    held_id, other_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w")
    assert held is not None
    call = asyncio.create_task(store.finish_and_claim(held_id, fence=held.fence, owner="w"))
    await asyncio.sleep(0)  # one turn: the settle and the claim are queued
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await store.assign("alpha", "barrier")  # a write behind any give-back
    # The settle may have run or not (its round may have begun); the claim that came with
    # it holds nothing either way.
    assert (await store.item(held_id))["state"] in ("claimed", "done")
    assert (await store.item(other_id))["state"] == "ready"
    assert await verify_ledger(store) == []


@pytest.mark.parametrize("answered", ["settle", "claim"])
async def test_a_call_cancelled_as_an_answer_came_holds_nothing(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, answered: str
) -> None:
    # The caller is cancelled in the instant its settle's (or its claim's) answer comes:
    # the settle stands, and whatever the claim took goes back at once. The claim alone
    # answering first is staged on SQLite by letting the claim follow the settle in a
    # round of its own, as on PostgreSQL.
    held_id, other_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w")
    assert held is not None and held.item_id == held_id
    backend = await engine_of(store).ready()
    tasks: list[asyncio.Task[Any]] = []

    def then_cancel(future: Any) -> Any:
        # Added before the caller awaits it, so it runs first once the answer is in.
        future.add_done_callback(lambda _: tasks[0].cancel())
        return future

    if answered == "settle":
        both = backend.finish_then_claim

        def settle_then_cancel(settle: Any, claim: Any) -> Any:
            finishing, claiming = both(settle, claim)
            return then_cancel(finishing), claiming

        monkeypatch.setattr(backend, "finish_then_claim", settle_then_cancel)
    else:
        monkeypatch.setattr(backend, "settle_with_claim", False)
        claim = backend.claim
        monkeypatch.setattr(backend, "claim", lambda op: then_cancel(claim(op)))
    tasks.append(asyncio.create_task(store.finish_and_claim(held_id, fence=held.fence, owner="w")))
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    monkeypatch.undo()
    await store.assign("alpha", "barrier")  # a write behind any give-back
    assert (await store.item(held_id))["state"] == "done"
    other = await store.item(other_id)
    assert (other["state"], other["attempts"]) == ("ready", 0)
    made = [e["event_type"] for e in await store.events(other_id)]
    assert made in (["queued"], ["queued", "claimed", "released"])
    if answered == "claim" or store.backend == "sqlite":  # the claim was made
        assert made == ["queued", "claimed", "released"]
    assert await verify_ledger(store) == []


async def test_a_call_cancelled_while_queued_writes_nothing(store: ControlStore, raw: Any) -> None:
    # The writer is busy with a round held up behind the store's back; the call's settle
    # (and, on SQLite, its claim) wait in the queue behind it when the caller is
    # cancelled: neither is written, and no claim is made to be given back.
    held, other_id, writer = await _held_with_the_lock_taken(store, raw)
    held_id = held.item_id
    served = writer.requests
    blocker = asyncio.create_task(store.enqueue("alpha", {"n": 3}))
    await _until(lambda: writer.requests > served and writer.requests_waiting == 0)
    call = asyncio.create_task(store.finish_and_claim(held_id, fence=held.fence, owner="w"))
    await _until(lambda: writer.requests_waiting > 0)  # queued behind the blocker's round
    assert writer.requests_waiting == (2 if store.backend == "sqlite" else 1)
    call.cancel()
    done, _ = await asyncio.wait({call}, timeout=10)  # with the lock still held
    assert done and call.cancelled()
    raw.execute("COMMIT")
    await blocker
    await store.assign("alpha", "barrier")
    assert (await store.item(held_id))["state"] == "claimed"  # the settle never ran
    assert [e["event_type"] for e in await store.events(other_id)] == ["queued"]
    assert await verify_ledger(store) == []


async def test_a_call_cancelled_while_its_round_runs_holds_nothing(
    store: ControlStore, raw: Any
) -> None:
    # The caller is cancelled while the round with its settle (and, on SQLite, its claim)
    # waits for a lock held behind the store's back: the round then runs for nobody. The
    # settle stands; the claim, which nobody will ever see, goes back at once.
    held, other_id, writer = await _held_with_the_lock_taken(store, raw)
    held_id = held.item_id
    served = writer.requests
    call = asyncio.create_task(store.finish_and_claim(held_id, fence=held.fence, owner="w"))
    await _until(lambda: writer.requests > served and writer.requests_waiting == 0)
    call.cancel()
    done, _ = await asyncio.wait({call}, timeout=10)  # with the lock still held
    assert done and call.cancelled()
    raw.execute("COMMIT")
    await store.assign("alpha", "barrier")  # a write behind the round and any give-back
    assert (await store.item(held_id))["state"] == "done"
    other = await store.item(other_id)
    assert (other["state"], other["attempts"]) == ("ready", 0)
    # On SQLite the claim ran in the settle's round, for nobody; on PostgreSQL it would
    # have followed the settle, and was never asked.
    made = ["queued", "claimed", "released"] if store.backend == "sqlite" else ["queued"]
    assert [e["event_type"] for e in await store.events(other_id)] == made
    assert await verify_ledger(store) == []


async def _held_with_the_lock_taken(
    store: ControlStore, raw: Any
) -> tuple[ClaimedItem, int, WriterBase]:
    """Two items, the first claimed; then the write lock taken behind the store's back
    (``raw``, which the test lets go): the claim, the other item's id, the writer."""
    held_id, other_id = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w")
    assert held is not None and held.item_id == held_id
    await store.counts()  # the readers open before the lock is taken
    writer = (await engine_of(store).ready()).writer
    assert writer is not None
    raw.execute("BEGIN IMMEDIATE" if raw.backend == "sqlite" else "BEGIN")
    if raw.backend == "postgresql":
        raw.execute("LOCK TABLE items IN EXCLUSIVE MODE")
    return held, other_id, writer


async def _until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (a state of the writer no event marks: looked at every
    millisecond, for at most ten seconds; the rounds it waits on wait for a lock the test
    holds meanwhile, so they cannot end first)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the writer never got there")


async def test_many_callers_each_item_settled_once(store: ControlStore) -> None:
    items = 60
    await store.enqueue_many("alpha", [{"n": n} for n in range(items)])
    settled: list[int] = []

    async def worker(name: str) -> None:
        claim = await store.claim(owner=name)
        while claim is not None:
            settled.append(claim.item_id)
            claim = await store.finish_and_claim(claim.item_id, fence=claim.fence, owner=name)

    await asyncio.gather(*(worker(f"w{n}") for n in range(8)))
    assert sorted(settled) == sorted(set(settled)) and len(settled) == items
    assert (await store.counts())["done"] == items
    assert await verify_ledger(store) == []


def _claim(n: int, key: str = "c") -> Grouped[Any]:
    return Grouped((key,), n, len)


def _finish(n: int) -> Grouped[Any]:
    return Grouped(("finish",), n, len, True)


def test_finishes_run_ahead_of_the_claims_queued_with_them() -> None:
    # Interleaved finishes and claims (several callers' finish_and_claim) run as two
    # units, the finishes first; a request that is not grouped ends a stretch, and each
    # caller's finish still comes before its claim.
    ops: list[Any] = [_finish(0), _claim(1), _finish(2), _claim(3), object(), _claim(5), _finish(6)]
    assert units(ops, range(len(ops))) == [[0, 2], [1, 3], [4], [6], [5]]
    # Claims of different filters keep their order; an ``alone`` member (going again on
    # its own after its unit broke) stands by itself, still ahead.
    ops = [_claim(0, "a"), _finish(1), _claim(2, "b"), _claim(3, "b"), _finish(4)]
    assert units(ops, range(len(ops))) == [[1, 4], [0], [2, 3]]
    assert units(ops, range(len(ops)), alone={1}) == [[1], [4], [0], [2, 3]]
    # Without finishes nothing moves.
    ops = [_claim(0), _claim(1), object(), _claim(3)]
    assert units(ops, range(len(ops))) == [[0, 1], [2], [3]]


def test_a_claim_runs_only_if_the_settle_it_rides_on_was_not_refused() -> None:
    # Two callers' settle and claim, each claim riding on its own settle; a third claim
    # rides on a settle of an earlier round (not in this one): it rides on nothing here.
    earlier = _finish(9)
    ops: list[Any] = [_finish(0), _claim(1), _finish(2), _claim(3), _claim(4)]
    ops[1].after, ops[3].after, ops[4].after = ops[0], ops[2], earlier
    riding = riders(ops)
    assert riding == {1: 0, 3: 2}
    assert riders([_finish(0), _claim(1), object()]) == {}
    # The first settle refused, the second saved: only the second's claim runs.
    outcomes: list[Any] = [Raised(InvalidInput("refused")), None, 1, None, None]
    assert runnable([1, 3, 4], riding, outcomes) == [3, 4]
    assert isinstance(outcomes[1], Raised) and isinstance(outcomes[1].error, NotRun)
    assert outcomes[3] is None and outcomes[4] is None
    # A settle not run yet (no outcome) holds nothing back.
    assert runnable([1, 3], riding, [None] * 5) == [1, 3]


async def test_a_refusal_served_by_close_never_opens_the_store_again(
    store: ControlStore,
) -> None:
    # close() serves the queued settle (refused) and its claim; the item the claim took
    # is given back through the closing writer, or left to its lease: never by opening
    # the store again.
    held_id, _ = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    held = await store.claim(owner="w")
    assert held is not None
    call = asyncio.create_task(store.finish_and_claim(held_id, fence=held.fence + 1, owner="w"))
    await asyncio.sleep(0)  # one turn: the settle and the claim are queued
    await store.close()
    with pytest.raises(FenceRejected):
        await call
    assert not engine_of(store).is_open


async def test_a_cancellation_is_never_lost_to_work_that_fails_after_it() -> None:
    # to_the_end keeps a claim (or a give-back) going while its caller is cancelled; if
    # that work then fails, the caller still ends cancelled, the failure as the cause.
    loop = asyncio.get_running_loop()
    work: asyncio.Future[int] = loop.create_future()
    waiter = asyncio.create_task(_tasks.to_the_end(work, "work"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    assert not waiter.done()  # still waiting for the work
    work.set_exception(StorageError("the claim failed"))
    with pytest.raises(asyncio.CancelledError) as caught:
        await waiter
    assert isinstance(cancelled_cause(caught.value), StorageError)


def test_a_finish_posted_for_combining_keeps_its_place_ahead() -> None:
    finish = FinishOp(1, 1, "done", None, None, None)
    claim = ClaimOp("w", 1, 60.0, None, None)
    assert request_of("finish", ("finish",), tuple(finish), len).ahead
    assert not request_of("claim", ("claim",), tuple(claim), len).ahead


async def test_a_give_back_after_close_leaves_the_claim_to_its_lease(store: ControlStore) -> None:
    # What finish_and_claim gives back after a refused settle goes through the backend
    # that claimed it: once the store is closed, the claim is left to its lease (logged),
    # and the store is not opened again for it.
    item_id = await store.enqueue("alpha", {"n": 1})
    backend = await engine_of(store).ready()
    rows = await backend.claim(ClaimOp("w", 1, 60.0, None, None))
    assert [row.item_id for row in rows] == [item_id]
    await store.close()
    await store._release_rows(backend, rows, None)
    assert not engine_of(store).is_open
    assert (await store.item(item_id))["state"] == "claimed"
