"""The worker runtime: work(), claim(wait=), claims(), release(); on both backends."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import logging
import os
import pathlib
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from _fleet import COMMAND_LOOP
from _signals import renewals_heard_late, renewed_a_third_after_each_grant, until
from asyncplane import (
    ClaimedItem,
    ControlStore,
    Done,
    DrainError,
    FenceRejected,
    InvalidType,
    Park,
    Retry,
    StorageError,
    _outcomes,
    _work,
    _worker_command,
    verify_ledger,
    work,
)
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock


async def states_of(store: ControlStore) -> dict[str, int]:
    return {state: n for state, n in (await store.counts()).items() if n}


async def hang(claim: ClaimedItem) -> Done:
    """A handler that never returns of itself: only a cancellation ends it."""
    await asyncio.Event().wait()
    return Done()


async def done(claim: ClaimedItem) -> Done:
    return Done()


def running_tasks(prefix: str = "asyncplane-work-handle") -> int:
    return sum(t.get_name().startswith(prefix) for t in asyncio.all_tasks())


# --- claim(wait=), claims(), release() -------------------------------------------------------


async def test_claim_waits_for_work_enqueued_meanwhile(store: ControlStore) -> None:
    waiting = asyncio.create_task(store.claim("w", wait=30))
    await until(lambda: running_tasks("asyncplane-wait-work-local") > 0, what="the claim waits")
    assert not waiting.done()
    item_id = await store.enqueue("alpha", {"late": True})
    claim = await waiting
    assert claim is not None and claim.item_id == item_id


async def test_claim_wait_gives_up_with_none(store: ControlStore) -> None:
    started = time.monotonic()
    assert await store.claim("w", wait=0.05) is None
    # The wait is timed by the loop's clock, which may read a little behind this one.
    assert time.monotonic() - started >= 0.05 - 0.002


async def test_claim_waits_for_a_retry_to_fall_due(store: ControlStore, clock: ManualClock) -> None:
    item_id = await store.enqueue("alpha", {})
    first = await store.claim("w")
    assert first is not None
    await store.retry(item_id, fence=first.fence, error="later", delay=60)
    waiting = asyncio.create_task(store.claim("w", wait=3600))
    await until(lambda: running_tasks("asyncplane-wait-work-due") > 0, what="an alarm is set")
    clock.advance(61)
    again = await waiting
    assert again is not None and again.item_id == item_id


async def test_a_claim_in_another_process_wakes_on_an_enqueue_here(
    store: ControlStore, location_of: Any
) -> None:
    del store
    where = location_of("wake.db")
    async with ControlStore(where) as here:
        await here.create_project("p", "P")
        script = textwrap.dedent(
            """
            import asyncio, sys
            from asyncplane import ControlStore
            async def main():
                async with ControlStore(sys.argv[1]) as store:
                    print("waiting", flush=True)
                    claim = await store.claim("other", wait=60, poll_interval=0.01)
                    print(claim.item_id if claim else "none", flush=True)
            asyncio.run(main())
            """
        )
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, where, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert child.stdout is not None
        assert (await child.stdout.readline()).strip() == b"waiting"
        item_id = await here.enqueue("p", {})
        out, err = await asyncio.wait_for(child.communicate(), 60)
        assert child.returncode == 0, err
        assert out.strip() == str(item_id).encode()


async def test_claims_iterates_and_ends_when_the_store_closes(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(3)]
    seen: list[int] = []

    async def consume() -> None:
        async for claim in store.claims("w"):
            seen.append(claim.item_id)
            await store.finish(claim.item_id, fence=claim.fence)

    consumer = asyncio.create_task(consume())
    await until(lambda: len(seen) == 3, what="three claims")
    later = await store.enqueue("alpha", {"later": True})
    await until(lambda: len(seen) == 4, what="a claim after waiting")
    await store.close()
    await asyncio.wait_for(consumer, 10)
    assert seen == [*ids, later]


async def test_claims_ends_on_stop(store: ControlStore) -> None:
    stop = asyncio.Event()

    async def consume() -> list[int]:
        return [claim.item_id async for claim in store.claims("w", stop=stop)]

    consumer = asyncio.create_task(consume())
    await until(lambda: running_tasks("asyncplane-wait-work-stop") > 0, what="it waits")
    stop.set()
    assert await asyncio.wait_for(consumer, 10) == []


async def test_release_gives_a_claim_back_without_spending_an_attempt(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {}, max_attempts=1)
    claim = await store.claim("w")
    assert claim is not None
    await store.release(item_id, fence=claim.fence)
    row = await store.item(item_id)
    assert (row["state"], row["attempts"], row["lease_expires_at"]) == ("ready", 0, None)
    assert (await store.events(item_id))[-1]["event_type"] == "released"
    with pytest.raises(FenceRejected):
        await store.release(item_id, fence=claim.fence)  # not claimed any more
    again = await store.claim("v")
    assert again is not None and again.fence == claim.fence + 1 and again.attempts == 1
    with pytest.raises(FenceRejected):
        await store.finish(item_id, fence=claim.fence)  # the old holder's late report
    await store.finish(item_id, fence=again.fence)
    assert await verify_ledger(store) == []


async def test_the_ledger_tells_a_runtime_whether_its_own_write_at_a_fence_stood(
    store: ControlStore, clock: ManualClock
) -> None:
    # What a worker asks when a try whose outcome was unknown is followed by a refusal
    # (the tests of a lost answer are PostgreSQL's: tests/test_postgres.py).
    done, lapsed, cancelled, released = await store.enqueue_many("alpha", [{}, {}, {}, {}])
    claims = {claim.item_id: claim for claim in await store.claim_batch("w", 4)}
    await store.finish(done, fence=claims[done].fence)
    await store.release(released, fence=claims[released].fence)
    await store.cancel(cancelled)
    clock.advance(store.lease_seconds + 1)
    taken = await store.claim("v")  # takes the lapsed one over
    assert taken is not None and taken.item_id == lapsed
    assert await _outcomes.saved_as(store, claims[done], None) == "done"
    assert await _outcomes.saved_as(store, claims[released], None) == "released"
    assert await _outcomes.saved_as(store, claims[cancelled], None) is None
    assert await _outcomes.saved_as(store, claims[lapsed], None) is None
    assert await _outcomes.saved_as(store, taken, None) is None  # nothing after it yet
    await store.finish(lapsed, fence=taken.fence, status="failed", error="boom")
    assert await _outcomes.saved_as(store, taken, None) == "failed"
    assert await _outcomes.saved_as(store, claims[lapsed], None) is None
    await store.create_project("beta", "Beta")
    await store.assign("beta", "a")
    assert await _outcomes.saved_as(store, claims[done], "a") is None  # out of its scope


async def test_a_lost_claims_give_back_spares_every_claim_the_worker_received(
    store: ControlStore,
) -> None:
    # After a claim whose answer was lost, the worker gives back what that claim took:
    # the items claimed under its name since, that it never received. One it received
    # and no longer runs (its settle left unsaved, say: still claimed) is not such an
    # item; giving it back ran it again past its attempts. (The lost claim itself, on a
    # real connection, is tests/test_postgres.py's.)
    worker = _work._Worker(
        store=store, handle=lambda claim: _done(), owner="w", concurrency=2, timeout=None,
        project_id=None, actor_id=None, stop=asyncio.Event(), grace=0.0, until_empty=False,
        poll_interval=0.1, preflight_chunk=500,
    )  # fmt: skip
    received_id = await store.enqueue("alpha", {"n": 1}, max_attempts=1)
    lost_id = await store.enqueue("alpha", {"n": 2}, max_attempts=1)
    asked = store.clock.now()
    received = await store.claim_batch("w", 1)
    assert [claim.item_id for claim in received] == [received_id]
    worker._received(asked, received)  # received, run, and no longer running
    worker.unknown_claim_at = store.clock.now()
    assert await store.claim_batch("w", 1)  # as if its answer had been lost
    assert await worker._give_back_unknown() == 1
    assert worker.unknown_claim_at is None and worker.summary.released == 1
    assert (await store.item(received_id))["state"] == "claimed"
    lost = await store.item(lost_id)
    assert (lost["state"], lost["attempts"]) == ("ready", 0)
    assert await verify_ledger(store) == []


# --- work() ---------------------------------------------------------------------------------


async def test_work_fills_a_freed_slot_while_every_other_slot_still_runs(
    store: ControlStore,
) -> None:
    # Each handler waits on its own gate, so the test decides when an item ends. A slot
    # freed by one item's end must take the next item while the other fifteen still run:
    # it never waits for another item, as a batch waits for its slowest. Counted in items
    # started, each awaited as a signal, not measured in seconds.
    await store.enqueue_many("alpha", [{"n": n} for n in range(40)])
    gates: dict[int, asyncio.Event] = {}
    started: list[int] = []
    a_start = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        n = claim.payload["n"]
        gates[n] = asyncio.Event()
        started.append(n)
        a_start.set()
        await gates[n].wait()
        return Done()

    runner = asyncio.create_task(work(store, handle, concurrency=16, until_empty=True))
    while len(started) < 16:
        a_start.clear()
        await asyncio.wait_for(a_start.wait(), 30)
    rng = random.Random(3)
    for _ in range(40 - 16):
        running = [n for n in started if not gates[n].is_set()]
        assert len(running) == 16, running
        before = len(started)
        a_start.clear()
        gates[rng.choice(running)].set()
        await asyncio.wait_for(a_start.wait(), 30)  # the freed slot takes the next item
        assert len(started) == before + 1  # the other fifteen are still held
    for gate in gates.values():
        gate.set()
    summary = await asyncio.wait_for(runner, 30)
    assert (summary.done, summary.claimed) == (40, 40)
    assert sorted(started) == list(range(40))
    assert await states_of(store) == {"done": 40}
    assert await verify_ledger(store) == []


async def test_work_reads_the_data_version_only_when_a_claim_may_find_nothing(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The version a wait watches must be read before the claim that finds nothing; a
    # claim straight after one that took something skips that read (one trip to a reader
    # thread per claim, which at concurrency 1 is one per item).
    await store.enqueue_many("alpha", [{"n": n} for n in range(30)])
    engine = engine_of(store)
    calls: list[str] = []
    read, claim_batch = engine.data_version, store.claim_batch

    async def logged_read() -> int:
        calls.append("read")
        return await read()

    async def logged_claim(*args: Any, **kwargs: Any) -> list[ClaimedItem]:
        got = await claim_batch(*args, **kwargs)
        calls.append(f"claim {len(got)}")
        return got

    monkeypatch.setattr(engine, "data_version", logged_read)
    monkeypatch.setattr(store, "claim_batch", logged_claim)

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    summary = await work(store, handle, concurrency=1, until_empty=True)
    assert (summary.done, summary.claimed) == (30, 30)
    # Read, then the first claim; thirty claims of one item without a read; the unread
    # claim that finds nothing; and, before the worker could sleep, a read, then a claim.
    assert calls == ["read", *["claim 1"] * 30, "claim 0", "read", "claim 0"], calls
    assert await states_of(store) == {"done": 30}


async def test_a_failure_while_an_unread_claim_is_out_still_stops_the_worker(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An item fails the worker (its progress callback raises) while a claim made without
    # a version read is out and finds nothing: the worker still stops, with DrainError,
    # rather than going on to sleep beside the other item, which never ends.
    await store.enqueue("alpha", {"hang": False})
    hung = await store.enqueue("alpha", {"hang": True})
    ended = asyncio.Event()
    claim_batch = store.claim_batch
    claims = 0

    async def held_claim(*args: Any, **kwargs: Any) -> list[ClaimedItem]:
        nonlocal claims
        claims += 1
        if claims == 2:  # the claim straight after the first, which took both items
            await ended.wait()  # out while the quick item fails the worker
        return await claim_batch(*args, **kwargs)

    monkeypatch.setattr(store, "claim_batch", held_claim)

    def progress(summary: Any) -> None:
        ended.set()
        raise RuntimeError("the progress callback broke")

    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["hang"]:
            await asyncio.Event().wait()
        return Done()

    worker = asyncio.create_task(work(store, handle, concurrency=3, progress=progress))
    with pytest.raises(DrainError, match="the progress callback broke"):
        await asyncio.wait_for(worker, 30)
    row = await store.item(hung)
    assert (row["state"], row["attempts"]) == ("ready", 0)  # given back, unspent


async def test_a_store_closed_while_an_unread_claim_is_out_stops_the_worker_unopened(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.enqueue("alpha", {})
    claim_batch = store.claim_batch
    claims = 0

    async def closing_claim(*args: Any, **kwargs: Any) -> list[ClaimedItem]:
        nonlocal claims
        claims += 1
        got = await claim_batch(*args, **kwargs)
        if claims == 2:  # the claim straight after the one that took the item
            await store.close()
        return got

    monkeypatch.setattr(store, "claim_batch", closing_claim)

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    summary = await asyncio.wait_for(work(store, handle, concurrency=1), 30)
    assert (summary.claimed, summary.done, claims) == (1, 1, 2)
    assert not engine_of(store).is_open  # nothing reopened it


async def test_a_store_closed_during_housekeeping_stops_the_worker_unopened(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.enqueue("alpha", {})
    engine = engine_of(store)

    async def closing_schedules(closes: int | None = None) -> int:
        await store.close()  # closed before the worker's first read or claim
        return 0

    monkeypatch.setattr(engine, "maybe_run_schedules", closing_schedules)

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    summary = await asyncio.wait_for(work(store, handle, concurrency=1), 30)
    assert summary.claimed == 0
    assert not engine.is_open  # neither the version read nor a claim reopened it


async def test_a_store_closed_during_the_version_read_stops_the_worker_unopened(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.enqueue("alpha", {})
    engine = engine_of(store)
    read = engine.data_version

    async def closing_read() -> int:
        version = await read()
        await store.close()  # closed between the read and the claim it comes before
        return version

    monkeypatch.setattr(engine, "data_version", closing_read)

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    summary = await asyncio.wait_for(work(store, handle, concurrency=1), 30)
    assert summary.claimed == 0
    assert not engine.is_open  # the claim did not reopen it


@pytest.mark.parametrize("during", ["version read", "housekeeping"])
async def test_a_stop_while_the_loop_reads_before_its_claim_makes_no_claim(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, during: str
) -> None:
    # A SIGTERM's handler runs while the claim loop awaits one of its reads: no claim
    # follows it ("once stop is set, no new claims are made").
    await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    engine = engine_of(store)
    stop = asyncio.Event()
    name = "data_version" if during == "version read" else "maybe_run_schedules"
    real = getattr(engine, name)

    async def stopping(*args: Any) -> Any:
        answer = await real(*args)
        stop.set()  # as the signal's handler would, while the read is out
        return answer

    monkeypatch.setattr(engine, name, stopping)

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    summary = await asyncio.wait_for(work(store, handle, concurrency=4, stop=stop), 30)
    assert summary.claimed == 0
    assert (await store.counts())["ready"] == 4


async def test_an_item_cancelled_before_its_renewal_and_given_back_at_a_stop_is_counted(
    store: ControlStore,
) -> None:
    # An operator cancels a running item; the worker stops before its next renewal told
    # it: the give-back is refused (ItemCancelled), and the summary says cancelled.
    item_id = await store.enqueue("alpha", {})
    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, hang, stop=stop, grace=0))
    await until(lambda: running_tasks() == 1, what="the item runs")
    assert await store.cancel(item_id, reason="not needed") == "cancelled"
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    assert (summary.claimed, summary.cancelled, summary.released) == (1, 1, 0)


async def test_an_item_cancelled_and_purged_while_it_runs_is_counted_and_the_worker_goes_on(
    store: ControlStore, clock: ManualClock
) -> None:
    # The cancel is told at the next renewal, a third of a lease away; the store's
    # retention (the worker's own housekeeping, or a purge beside it) may purge the item
    # before. Its handler's outcome is then refused with UnknownItem: a claim lost, not
    # the store failing, and the worker goes on with the next item.
    first = await store.enqueue("alpha", {"n": 1})
    started, go, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen: list[int] = []

    async def handle(claim: ClaimedItem) -> Done:
        seen.append(claim.item_id)
        if claim.item_id == first:
            started.set()
            await go.wait()
        else:
            stop.set()
        return Done()

    worker = asyncio.create_task(work(store, handle, stop=stop, grace=5))
    await started.wait()
    await store.cancel(first, reason="not needed")
    clock.advance(1)
    assert (await store.purge(0)).purged == 1
    go.set()
    await until(lambda: len(seen) == 1 and not running_tasks(), what="the outcome refused")
    second = await store.enqueue("alpha", {"n": 2})
    summary = await asyncio.wait_for(worker, 30)
    assert (summary.claimed, summary.done, summary.fence_rejected) == (2, 1, 1)
    assert seen == [first, second]
    assert await verify_ledger(store) == []


async def test_a_renewer_cancelled_by_someone_else_stops_the_worker_and_gives_back(
    store: ControlStore,
) -> None:
    # The run's one renewer keeps every lease: cancelled from outside, no lease would be
    # kept any more, so the worker stops with DrainError and gives its items back at once.
    item_id = await store.enqueue("alpha", {})

    handle = hang

    worker = asyncio.create_task(work(store, handle, concurrency=1, owner="w"))
    await until(lambda: running_tasks() == 1, what="the item runs")
    (renewer,) = [t for t in asyncio.all_tasks() if t.get_name() == "asyncplane-work-renew[w]"]
    renewer.cancel()
    with pytest.raises(DrainError, match="renewer was cancelled") as raised:
        await asyncio.wait_for(worker, 30)
    assert raised.value.summary.released == 1
    row = await store.item(item_id)
    assert (row["state"], row["attempts"]) == ("ready", 0)  # back at once, unspent


async def test_leases_due_close_together_are_renewed_together(
    store: ControlStore, clock: ManualClock
) -> None:
    # One renewer for the run: at the first lease's turn it also renews every lease due
    # within the next sixth of a lease, in the same round, rather than waking again.
    first = await store.enqueue("alpha", {"n": 1})
    gate = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        await gate.wait()
        return Done()

    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, handle, concurrency=2, stop=stop))
    await until(lambda: running_tasks() == 1, what="the first item runs")
    third = store.lease_seconds / 3
    clock.advance(third / 5)
    second = await store.enqueue("alpha", {"n": 2})
    await until(lambda: running_tasks() == 2, what="the second item runs, a little later")
    leases = {i: (await store.item(i))["lease_expires_at"] for i in (first, second)}
    writer = (await engine_of(store).ready()).writer
    rounds = writer.rounds
    clock.advance(third - third / 5 + 0.01)  # the first lease's turn; the second's is near

    async def both_renewed() -> bool:
        rows = [await store.item(i) for i in (first, second)]
        return all(row["lease_expires_at"] > leases[row["item_id"]] for row in rows)

    await until(both_renewed, what="both leases renewed")
    assert writer.rounds - rounds == 1  # one round for the two
    gate.set()
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    assert summary.done == 2
    assert await verify_ledger(store) == []


async def test_a_stop_while_every_slot_is_busy_gives_the_running_item_back(
    store: ControlStore,
) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(2)]
    stop = asyncio.Event()

    handle = hang

    worker = asyncio.create_task(work(store, handle, concurrency=1, stop=stop, grace=0))
    await until(lambda: running_tasks() == 1, what="the only slot runs an item")
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    assert (summary.claimed, summary.released) == (1, 1)
    for item_id in ids:
        row = await store.item(item_id)
        assert (row["state"], row["attempts"]) == ("ready", 0)


async def test_a_store_closed_while_every_slot_is_busy_stops_the_worker_at_once(
    store: ControlStore,
) -> None:
    # The loop waits for a slot, not for work: the close has to reach that wait too,
    # not only the next item's end (which here never comes).
    item_id = await store.enqueue("alpha", {})

    handle = hang

    worker = asyncio.create_task(work(store, handle, concurrency=1, grace=0))
    try:
        await until(lambda: running_tasks() == 1, what="the only slot runs an item")
        await store.close()
        done, _ = await asyncio.wait({worker}, timeout=20)
        assert done, "the worker waits for its slot to free, past the store's close"
    finally:
        worker.cancel()  # a failing run leaves no task behind it
        await asyncio.gather(worker, return_exceptions=True)
    summary = worker.result()
    assert (summary.claimed, summary.released) == (1, 1)
    row = await store.item(item_id)
    assert (row["state"], row["attempts"]) == ("ready", 0)


async def test_a_worker_cut_short_logs_that_it_did_not_count_what_remains(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Its summary's remaining=0 would say the queue was empty: one item is still there.
    await store.create_project("p", "P")
    await store.enqueue("p", {})
    started = asyncio.Event()

    async def hangs(claim: ClaimedItem) -> Done:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("never")

    with caplog.at_level(logging.INFO, logger="asyncplane.worker"):
        running = asyncio.create_task(work(store, hangs, project_id="p"))
        await started.wait()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        summary = await work(store, lambda claim: _done(), project_id="p", until_empty=True)
    stopped = [r.getMessage() for r in caplog.records if " stopped: " in r.getMessage()]
    assert "remaining=None" in stopped[0], stopped
    assert summary.remaining == 0 and "remaining=0" in stopped[1], stopped


async def test_a_worker_whose_store_closed_under_it_leaves_remaining_unknown(
    store: ControlStore,
) -> None:
    # Counting would open the closed store again: not counted, so None, never 0.
    await store.create_project("p", "P")
    await store.enqueue("p", {})
    await store.enqueue("p", {})
    started = asyncio.Event()

    async def closes(claim: ClaimedItem) -> Done:
        started.set()
        return Done()

    running = asyncio.create_task(work(store, closes, project_id="p", concurrency=1))
    await started.wait()
    await store.close()
    summary = await asyncio.wait_for(running, 30)
    assert summary.remaining is None


async def _done() -> Done:
    return Done()


async def test_a_handler_cancelled_by_someone_else_retries_its_item(
    store: ControlStore, caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    # Not a stop, a timeout or a refused renewal: the item is settled (an attempt spent),
    # neither dropped to its lease nor taken for the worker's own stop.
    item_id = await store.enqueue("alpha", {})
    seen: list[int] = []

    async def handle(claim: ClaimedItem) -> Done:
        seen.append(claim.attempts)
        if len(seen) == 1:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)
        return Done({"attempt": claim.attempts})

    with caplog.at_level(logging.WARNING, logger="asyncplane.worker"):
        summary = await asyncio.wait_for(work(store, handle, concurrency=1, until_empty=True), 30)
    assert (summary.retried, summary.done, summary.released) == (1, 0, 0)
    row = await store.item(item_id)
    assert (row["state"], row["attempts"]) == ("deferred", 1)
    assert row["error"] == "the handler was cancelled, not by the worker"
    assert any("cancelled, not by the worker" in r.getMessage() for r in caplog.records)
    clock.advance(3600)  # past the retry's back-off
    summary = await asyncio.wait_for(work(store, handle, concurrency=1, until_empty=True), 30)
    assert summary.done == 1 and seen == [1, 2]
    assert (await store.item(item_id))["result"] == {"attempt": 2}
    assert await verify_ledger(store) == []


async def test_a_refused_renewal_is_asked_and_counted_once(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The item is cancelled by an operator; its handler cleans up before it lets the
    # cancellation through. Meanwhile its lease is not renewed again (nor the refusal
    # counted again, nor the cleanup cancelled again).
    item_id = await store.enqueue("alpha", {})
    renewals: list[int] = []
    renew = store.renew

    async def counted(item: int, **kwargs: Any) -> datetime.datetime:
        renewals.append(item)
        return await renew(item, **kwargs)

    monkeypatch.setattr(store, "renew", counted)
    cancelled, cleaned = asyncio.Event(), asyncio.Event()
    cancels = 0

    async def handle(claim: ClaimedItem) -> Done:
        nonlocal cancels
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancels += 1
            cancelled.set()
            try:
                await cleaned.wait()  # cleaning up
            except asyncio.CancelledError:
                cancels += 1
            raise
        return Done()

    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, handle, concurrency=1, stop=stop, grace=0))
    await until(lambda: running_tasks() == 1, what="the item runs")
    await store.cancel(item_id, reason="operator")
    clock.advance(store.lease_seconds / 3 + 0.1)  # the renewal: refused
    await asyncio.wait_for(cancelled.wait(), 30)
    for _ in range(3):
        await store.counts()  # turns of the loop, and threads', for a renewer to go on
    cleaned.set()
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    assert (renewals, summary.cancelled, cancels) == ([item_id], 1, 1)


async def test_an_item_this_worker_takes_again_keeps_each_claim_apart(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A renewal is stuck (a paused machine, say) until the lease lapses, and this same
    # worker claims the item again, at a higher fence. The stuck renewal's refusal then
    # stops the first run; the second run's lease is kept and its outcome settled.
    item_id = await store.enqueue("alpha", {})
    renew = store.renew
    stuck, asked = asyncio.Event(), asyncio.Event()

    async def stalled_once(item: int, **kwargs: Any) -> datetime.datetime:
        if not asked.is_set():
            asked.set()
            await stuck.wait()
        return await renew(item, **kwargs)

    monkeypatch.setattr(store, "renew", stalled_once)
    gates = [asyncio.Event(), asyncio.Event()]
    fences: list[int] = []
    stopped: list[int] = []

    async def handle(claim: ClaimedItem) -> Done:
        fences.append(claim.fence)
        try:
            await gates[len(fences) - 1].wait()
        except asyncio.CancelledError:
            stopped.append(claim.fence)
            raise
        return Done()

    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, handle, concurrency=2, stop=stop))
    await until(lambda: len(fences) == 1, what="the first run")
    clock.advance(store.lease_seconds / 3 + 0.1)
    await asyncio.wait_for(asked.wait(), 30)  # the renewal is stuck
    clock.advance(store.lease_seconds)  # the lease lapses
    await until(lambda: len(fences) == 2, what="the same worker takes the item again")
    stuck.set()  # the stuck renewal goes on: refused, for the first claim only
    await until(lambda: stopped == [fences[0]], what="the first run is stopped")
    lease = (await store.item(item_id))["lease_expires_at"]
    clock.advance(store.lease_seconds / 3 + 0.1)

    async def renewed() -> bool:
        return bool((await store.item(item_id))["lease_expires_at"] > lease)

    await until(renewed, what="the second claim's lease renewed")
    gates[1].set()
    await until(lambda: running_tasks() == 0, what="the second run ends")
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    assert (summary.done, summary.fence_rejected) == (1, 1)
    row = await store.item(item_id)
    assert (row["state"], row["fence"]) == ("done", fences[1])
    assert await verify_ledger(store) == []


async def test_a_store_closed_under_running_items_keeps_their_leases(
    store: ControlStore, clock: ManualClock
) -> None:
    # A close stops the worker's claims, not the leases of what runs: until its handler
    # returns, the item stays this worker's, however far the clock goes.
    item_id = await store.enqueue("alpha", {})
    gate = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        await gate.wait()
        return Done()

    worker = asyncio.create_task(work(store, handle, concurrency=1))
    await until(lambda: running_tasks() == 1, what="the item runs")
    await store.close()
    for _ in range(4):  # four renewals' turns: more than a whole lease
        lease = (await store.item(item_id))["lease_expires_at"]
        clock.advance(store.lease_seconds / 3 + 0.1)

        async def renewed(before: Any = lease) -> bool:
            return bool((await store.item(item_id))["lease_expires_at"] > before)

        await until(renewed, what="the lease renewed")
    assert await store.claim("rival") is None
    gate.set()
    summary = await asyncio.wait_for(worker, 30)
    assert summary.done == 1
    assert (await store.item(item_id))["state"] == "done"


@pytest.mark.parametrize("ends", ["timeout", "stop"])
async def test_a_handler_that_ignores_its_cancellation_keeps_its_lease_until_it_returns(
    store: ControlStore, clock: ManualClock, ends: str
) -> None:
    # Past its timeout, or at a stop with no grace left, the handler is cancelled and
    # waited for; one that ignores it runs on. Its lease was let go at once: the item
    # lapsed and another worker ran it beside the first. It is renewed until the handler
    # returns; then it is retried (timed out), or its outcome stands (stopped: what it
    # returned is the item's, as for any handler that ends as the stop comes).
    item_id = await store.enqueue("alpha", {})
    cancelled, release, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def stubborn(claim: ClaimedItem) -> Done:
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.set()
            await release.wait()  # and runs on
        return Done()

    timeout = 0.05 if ends == "timeout" else None
    worker = asyncio.create_task(
        work(store, stubborn, concurrency=1, stop=stop, timeout=timeout, grace=0)
    )
    await until(lambda: running_tasks() == 1, what="the item runs")
    if ends == "stop":
        stop.set()
    await cancelled.wait()
    for _ in range(6):  # two leases' time, a third at a time
        was = (await store.item(item_id))["lease_expires_at"]
        clock.advance(store.lease_seconds / 3)

        async def renewed(was: Any = was) -> bool:
            return bool((await store.item(item_id))["lease_expires_at"] > was)

        await until(renewed, what="the lease is renewed")
        assert await store.claim("another") is None  # not taken over
    release.set()

    async def settled() -> bool:
        return bool((await store.item(item_id))["state"] != "claimed")

    await until(settled, what="the item is settled or given back")
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    item = await store.item(item_id)
    if ends == "timeout":
        assert summary.timed_out == 1 and summary.fence_rejected == 0
        assert item["state"] in ("ready", "deferred") and "timed out" in item["error"]
    else:
        assert summary.done == 1 and item["state"] == "done"
    assert summary.fence_rejected == 0 and await verify_ledger(store) == []


async def test_a_lease_is_renewed_a_third_of_a_lease_after_the_store_granted_it(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The renewer's turn comes back late after each renewal (a busy loop, a slow
    # hand-off): the next renewal is still due a third of a lease after the store granted
    # the last one, not a third after that turn, which would lose a sixth of a lease a time.
    item_id = await store.enqueue("alpha", {})
    renewals_heard_late(store, clock, monkeypatch)
    gate, stop = asyncio.Event(), asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        await gate.wait()
        return Done()

    worker = asyncio.create_task(work(store, handle, concurrency=1, stop=stop))
    await until(lambda: running_tasks() == 1, what="the item runs")
    await renewed_a_third_after_each_grant(store, clock, item_id)
    gate.set()
    stop.set()
    summary = await asyncio.wait_for(worker, 30)
    assert summary.done == 1


async def test_a_lease_the_store_cannot_renew_is_given_up_before_it_lapses(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A renewal the store fails under is tried again while the lease has time (a server
    # restarting comes back in seconds); once the lease is about to end, its handler is
    # cancelled (another worker may take the item over then) and the worker goes on. A
    # failed renewal used to stop the worker and cancel every running handler.
    item_id = await store.enqueue("alpha", {})
    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, hang, concurrency=1, stop=stop, grace=3600))
    await until(lambda: running_tasks() == 1, what="the item runs")
    tries: list[float] = []

    async def failing(item: int, **kwargs: Any) -> datetime.datetime:
        tries.append(clock.now())
        raise StorageError("the server restarts")

    monkeypatch.setattr(store, "renew", failing)
    clock.advance(store.lease_seconds / 3 + 0.1)
    await until(lambda: len(tries) == 1, what="the renewal fails")
    assert running_tasks() == 1  # the lease still has time: the handler runs on
    await until(lambda: any(w > tries[0] for w in clock.waits()), what="a retry is set")
    clock.advance(min(w for w in clock.waits() if w > tries[0]) - clock.now())  # (1 s later)
    await until(lambda: len(tries) == 2, what="the renewal is tried again")
    assert tries[1] - tries[0] <= 1.0 + 1e-6
    clock.advance(store.lease_seconds / 2)  # the lease is about to end
    await until(lambda: running_tasks() == 0, what="the handler is given up")
    stop.set()
    summary = await worker
    assert (summary.unsaved, summary.released) == (1, 0)
    assert (await store.item(item_id))["state"] == "claimed"  # left to its lease


async def test_a_renewal_that_comes_late_is_still_tried(
    store: ControlStore, clock: ManualClock
) -> None:
    # A loop held up (a handler's synchronous call) reaches the renewal with less than its
    # margin left: it was given no time at all (a timeout of 0), and the item given up.
    item_id = await store.enqueue("alpha", {})
    release = asyncio.Event()

    async def waits(claim: ClaimedItem) -> Done:
        await release.wait()
        return Done()

    worker = asyncio.create_task(work(store, waits, concurrency=1, until_empty=True))
    await until(lambda: running_tasks() == 1, what="the item runs")
    granted = (await store.item(item_id))["lease_expires_at"].timestamp()
    clock.advance(granted - clock.now() - 0.5)  # the renewal's turn, half a second left

    async def renewed() -> bool:
        return bool((await store.item(item_id))["lease_expires_at"].timestamp() > granted)

    await until(renewed, what="the late renewal lands")
    assert running_tasks() == 1  # not given up
    release.set()
    summary = await worker
    assert (summary.done, summary.unsaved) == (1, 0)


async def test_an_outage_met_while_every_slot_is_busy_ends_when_the_store_answers(
    store: ControlStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It ended only at the next claim: a handler longer than the window, then any blip,
    # and the worker stopped at once.
    await store.enqueue("alpha", {})
    release = asyncio.Event()
    engine = engine_of(store)
    schedules = engine.maybe_run_schedules
    failed: list[int] = []

    async def fails_once(*args: Any, **kwargs: Any) -> int:
        if not failed and running_tasks() == 1:
            failed.append(1)
            raise StorageError("cannot connect: the server restarts")
        return await schedules(*args, **kwargs)

    monkeypatch.setattr(engine, "maybe_run_schedules", fails_once)

    async def waits(claim: ClaimedItem) -> Done:
        await release.wait()
        return Done()

    with caplog.at_level(logging.WARNING, logger="asyncplane.worker"):
        worker = asyncio.create_task(work(store, waits, concurrency=1, until_empty=True))
        await until(lambda: store_counts_done(caplog) == 1, what="the outage ends")
        assert running_tasks() == 1  # while the handler still holds the slot
        release.set()
        assert (await worker).done == 1


@pytest.mark.parametrize("looked", [True, False])
async def test_only_a_look_the_store_answered_ends_an_outage_while_every_slot_is_busy(
    store: ControlStore, looked: bool
) -> None:
    # The schedules' look is made at most once a second: a call that made none (0, the
    # store untouched) said "the store answers again" every 10 s of a server down for
    # good, and the worker never gave up after its 60 s.
    worker = _work._Worker(
        store=store, handle=lambda claim: _done(), owner="w", concurrency=1, timeout=None,
        project_id=None, actor_id=None, stop=asyncio.Event(), grace=0.0, until_empty=False,
        poll_interval=0.1, preflight_chunk=500,
    )  # fmt: skip
    busy: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    worker.running[busy] = None  # type: ignore[index]  # every slot taken
    await store.projects()  # (open)
    engine = engine_of(store)
    engine._last_schedules = None if looked else time.monotonic()
    worker.outage = _work._Outage("w", StorageError("cannot connect"))
    waiting = asyncio.create_task(worker._until_a_slot_frees())
    await until(lambda: worker.waiting_for_slot or waiting.done(), what="a wait for a slot")
    worker.wake.set()
    await waiting
    assert (worker.outage is None) == looked
    busy.cancel()


@pytest.mark.parametrize("failures", [2, "always"])
async def test_a_worker_rides_out_a_store_that_fails_for_a_moment(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    failures: int | str,
) -> None:  # fmt: skip
    # A PostgreSQL restart ended every worker with exit 3 (and their running handlers).
    from asyncplane import _work

    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    claim_batch = store.claim_batch
    left = [failures]

    async def flaky(*args: Any, **kwargs: Any) -> Any:
        if left[0] == "always" or left[0]:
            if left[0] != "always":
                left[0] -= 1
            raise StorageError("cannot connect: the server restarts")
        return await claim_batch(*args, **kwargs)

    monkeypatch.setattr(store, "claim_batch", flaky)
    if failures == "always":
        monkeypatch.setattr(_work, "OUTAGE_SECONDS", 0.3)  # (60 s by default)
        with pytest.raises(StorageError, match="the server restarts"):
            await work(store, done, until_empty=True)
        return
    stop = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="asyncplane.worker"):
        worker = asyncio.create_task(work(store, done, stop=stop))
        await until(lambda: store_counts_done(caplog) >= 1, what="the first outage ends")
        left[0] = 2  # a second outage, later: ridden out as the first (its own window)
        await store.enqueue("alpha", {"n": 3})
        await until(lambda: store_counts_done(caplog) >= 2, what="the second outage ends")
        await until(_all_done(store, 4), what="every item ran")
        stop.set()
        summary = await worker
    assert summary.done == 4
    said = [r.getMessage() for r in caplog.records]
    # (each outage its own window: one a settle saw the store answer in ends there)
    assert sum("the store failed" in line for line in said) >= 2, said


def store_counts_done(caplog: pytest.LogCaptureFixture) -> int:
    """How many times a worker said the store answers again."""
    return sum("answers again" in r.getMessage() for r in caplog.records)


def _all_done(store: ControlStore, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await store.counts())["done"] == count

    return check


async def test_a_store_closed_during_an_outage_stops_the_worker_and_stays_closed(
    store: ControlStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ride-out reopened the closed store, or kept the worker going for its whole window.
    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise StorageError("cannot connect: the server restarts")

    monkeypatch.setattr(store, "claim_batch", failing)
    with caplog.at_level(logging.WARNING, logger="asyncplane.worker"):
        worker = asyncio.create_task(work(store, done))
        await until(
            lambda: any("the store failed" in r.getMessage() for r in caplog.records),
            what="the outage begins",
        )
        await store.close()
        summary = await asyncio.wait_for(worker, 30)
    assert summary.claimed == 0
    assert not engine_of(store).is_open  # not opened again by the worker


async def test_a_settle_the_store_fails_under_once_is_tried_again(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One failed settle stopped the worker and left its item claimed for a whole lease.
    item_id = await store.enqueue("alpha", {})
    finish = store.finish
    calls: list[int] = []

    async def once_failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise StorageError("the connection was lost")
        return await finish(*args, **kwargs)

    monkeypatch.setattr(store, "finish", once_failing)
    summary = await work(store, done, until_empty=True)
    assert (summary.done, summary.unsaved, len(calls)) == (1, 0, 2)
    assert (await store.item(item_id))["state"] == "done"


async def test_a_settle_the_store_keeps_failing_under_leaves_the_item_and_goes_on(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncplane import _outcomes

    monkeypatch.setattr(_outcomes, "_GIVE_BACK_PAUSES", (0.01, 0.01))
    first, second = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    finish = store.finish

    async def failing_for_the_first(item: int, *args: Any, **kwargs: Any) -> Any:
        if item == first:
            raise StorageError("the disk went away")
        return await finish(item, *args, **kwargs)

    monkeypatch.setattr(store, "finish", failing_for_the_first)
    with caplog.at_level(logging.ERROR, logger="asyncplane.worker"):
        summary = await work(store, done, until_empty=True, concurrency=1)
    assert (summary.unsaved, summary.done) == (1, 1)
    assert (await store.item(first))["state"] == "claimed"  # left to its lease
    assert (await store.item(second))["state"] == "done"  # the worker went on
    assert any("stays claimed until its lease lapses" in r.getMessage() for r in caplog.records)


async def test_work_runs_an_item_with_its_handler_task_alone(store: ControlStore) -> None:
    # Leases are kept by one renewer for the whole run, so an item running costs two
    # tasks (its own and its handler's), not a renewer and a timer of its own besides.
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    seen: list[str] = []
    renewers: list[asyncio.Task[Any]] = []  # held, so that no two can share an id

    async def handle(claim: ClaimedItem) -> Done:
        mine = f"[{claim.item_id}]"
        seen.extend(t.get_name() for t in asyncio.all_tasks() if t.get_name().endswith(mine))
        renewers.extend(
            t for t in asyncio.all_tasks() if t.get_name().startswith("asyncplane-work-renew")
        )
        return Done()

    summary = await work(store, handle, concurrency=1, until_empty=True, owner="w")
    assert summary.done == 3
    assert sorted(name.split("[")[0] for name in seen) == sorted(
        ["asyncplane-work-handle", "asyncplane-work-item"] * 3
    )
    assert len(renewers) == 3 and len(set(renewers)) == 1
    assert renewers[0].get_name() == "asyncplane-work-renew[w]"
    assert running_tasks("asyncplane-work-renew") == 0  # and it ends with the run


async def test_work_settles_each_outcome_and_retries_a_raising_handler(
    store: ControlStore, caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(5)]

    async def handle(claim: ClaimedItem) -> Any:
        n = claim.payload["n"]
        if n == 1:
            raise KeyError("prompt")
        if n == 2:
            return Park(delay=3600)
        if n == 3:
            return "not an outcome"
        if n == 4:
            return Done({"at": clock.datetime()})  # no JSON value: the item fails, said so
        return Done({"ok": n})

    with caplog.at_level(logging.WARNING, logger="asyncplane"):
        summary = await work(store, handle, concurrency=4, until_empty=True)
    assert (summary.done, summary.retried, summary.parked, summary.failed) == (1, 2, 1, 1)
    refused = await store.item(ids[4])
    assert refused["state"] == "failed"
    assert refused["error"].startswith("the handler's result was refused: result['at'] is a")
    (said,) = [r for r in caplog.records if refused["error"] in r.getMessage()]
    assert said.name == "asyncplane.worker" and said.item_id == ids[4]  # type: ignore[attr-defined]
    assert (await store.item(ids[0]))["result"] == {"ok": 0}
    raised = await store.item(ids[1])
    assert raised["state"] == "deferred"
    assert raised["error"] == "the handler raised KeyError: 'prompt'"
    assert (await store.events(ids[1]))[-1]["detail"]["error"] == raised["error"]
    record = next(r for r in caplog.records if "KeyError" in r.getMessage())
    assert record.exc_info is not None and record.exc_info[0] is KeyError  # a traceback
    assert (record.item_id, record.project_id, record.attempt) == (ids[1], "alpha", 1)  # type: ignore[attr-defined]
    assert "not an outcome" in (await store.item(ids[3]))["error"]
    assert await verify_ledger(store) == []


async def test_an_item_past_its_time_limit_is_cancelled_and_retried(
    asyncplane_store_factory: Any,
) -> None:
    store: ControlStore = await asyncplane_store_factory(max_attempts=2)
    await store.create_project("alpha", "Alpha")
    hung = await store.enqueue("alpha", {"hang": True})
    quick = await store.enqueue("alpha", {"hang": False})
    cancelled: list[int] = []

    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["hang"]:
            try:
                await asyncio.Event().wait()  # a provider call that never returns
            except asyncio.CancelledError:
                cancelled.append(claim.item_id)
                raise
        return Done()

    summary = await work(store, handle, concurrency=2, timeout=0.2, until_empty=True)
    assert cancelled == [hung]
    assert (summary.timed_out, summary.done, summary.retried) == (1, 1, 1)
    row = await store.item(hung)
    assert (row["state"], row["attempts"]) == ("deferred", 1)  # retried: an attempt spent
    assert row["error"] == "timed out after 0.2 s"
    assert (await store.item(quick))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_a_timed_out_item_with_its_budget_spent_fails(
    asyncplane_store_factory: Any,
) -> None:
    store: ControlStore = await asyncplane_store_factory(max_attempts=1)
    await store.create_project("alpha", "Alpha")
    hung = await store.enqueue("alpha", {})

    handle = hang

    summary = await work(store, handle, timeout=0.1, until_empty=True)
    assert (summary.timed_out, summary.failed) == (1, 1)
    row = await store.item(hung)
    assert row["state"] == "failed" and "timed out after 0.1 s" in row["error"]


async def test_a_handler_that_exits_as_its_time_runs_out_stops_the_worker(
    store: ControlStore,
) -> None:
    # Cancelled for its time limit, it asked the program to exit: the item was retried
    # as timed out, and the exit dropped; the worker ran on.
    item_id = await store.enqueue("alpha", {})

    async def exits_when_cut(claim: ClaimedItem) -> Done:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            sys.exit(5)
        return Done()

    with pytest.raises(SystemExit) as exited:
        await work(store, exits_when_cut, timeout=0.05, until_empty=True)
    assert exited.value.code == 5
    row = await store.item(item_id)
    assert row["state"] == "deferred" and "timed out after 0.05 s" in row["error"]
    assert (await store.counts())["claimed"] == 0


async def test_a_graceful_stop_lets_items_finish_then_gives_the_rest_back(
    store: ControlStore,
) -> None:
    quick = await store.enqueue("alpha", {"hang": False})
    hung = await store.enqueue("alpha", {"hang": True})
    stop = asyncio.Event()
    release_quick = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["hang"]:
            await asyncio.Event().wait()
        await release_quick.wait()
        return Done()

    worker = asyncio.create_task(work(store, handle, concurrency=4, stop=stop, grace=1))
    await until(lambda: running_tasks() == 2, what="both items run")
    stop.set()
    stopped = asyncio.get_running_loop().time()
    release_quick.set()  # the quick one finishes within the grace ...
    await until(lambda: running_tasks() == 1, what="the quick one is done")
    # ... the hung one still has its grace (unless this machine stalled for all of it).
    assert not worker.done() or asyncio.get_running_loop().time() - stopped >= 1
    # The grace runs out for the hung one: it is given back.
    summary = await asyncio.wait_for(worker, 10)
    assert (summary.done, summary.released) == (1, 1)
    row = await store.item(hung)
    assert (row["state"], row["attempts"]) == ("ready", 0)  # back at once, no attempt spent
    assert (await store.item(quick))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_a_cancelled_worker_gives_every_claim_back(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(3)]

    handle = hang

    worker = asyncio.create_task(work(store, handle, concurrency=8))
    await until(lambda: running_tasks() == 3, what="three items run")
    worker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await worker
    for item_id in ids:
        row = await store.item(item_id)
        assert (row["state"], row["attempts"]) == ("ready", 0)
    assert await verify_ledger(store) == []


async def test_work_waits_for_a_free_slot_without_a_task_per_wait(store: ControlStore) -> None:
    # With every slot busy the loop sleeps until an item ends or a stop; one task for the
    # whole run watches for the stop, not a new one each time the slots fill up.
    await store.enqueue_many("alpha", [{"n": n} for n in range(10)])
    watchers: list[asyncio.Task[Any]] = []  # held, so that no two can share an id

    async def handle(claim: ClaimedItem) -> Done:
        watchers.extend(
            t for t in asyncio.all_tasks() if t.get_name() == "asyncplane-work-stop-wait"
        )
        return Done()

    summary = await work(store, handle, concurrency=1, until_empty=True)
    assert summary.done == 10
    assert len(watchers) == 10 and len(set(watchers)) == 1
    assert running_tasks("asyncplane-work-stop-wait") == 0  # and it ends with the run


async def test_a_settle_and_the_next_claim_share_a_write_round_where_rounds_are_dear(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slot frees when its handler returns. On SQLite its next claim is queued right
    # behind the settle and the writer takes both into one round, so an item costs one
    # write round at concurrency 1, not two. On PostgreSQL, where a settle or a claim
    # alone is one statement that commits by itself (`Backend.settle_with_claim`), the
    # claim follows the settle in a round of its own. Either way the claim commits with
    # the settle or after it: the worker is never seen holding two items.
    items = 20
    # Housekeeping once, at the start: a later pass (a second on, on a slow machine) would
    # come between a settle and the next claim, and cost a round of its own.
    monkeypatch.setattr(_work, "_HOUSEKEEPING_EVERY", 3600.0)
    await store.enqueue_many("alpha", [{"n": n} for n in range(items)])
    writer = (await engine_of(store).ready()).writer
    rounds = writer.rounds
    held: list[int] = []

    async def handle(claim: ClaimedItem) -> Done:
        held.append((await store.counts())["claimed"])
        return Done()

    summary = await work(store, handle, concurrency=1, until_empty=True)
    assert summary.done == items and held == [1] * items
    if store.backend == "sqlite":
        # One round per item, besides the first claim and the last ones that find nothing.
        assert writer.rounds - rounds <= items + 3
    else:
        assert writer.rounds - rounds >= 2 * items  # each settle, then each claim
    assert await verify_ledger(store) == []


async def test_a_settle_comes_before_the_next_claim(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a project's max_running of 1 the next item can be claimed only once the last
    # is settled: in a shared round the settle runs first (on PostgreSQL the claim waits
    # for the settle's round), so every claim takes one.
    items = 20
    monkeypatch.setattr(_work, "_HOUSEKEEPING_EVERY", 3600.0)  # as above: at the start only
    await store.set_limits("alpha", max_running=1)
    await store.enqueue_many("alpha", [{"n": n} for n in range(items)])
    writer = (await engine_of(store).ready()).writer
    rounds = writer.rounds

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    summary = await work(store, handle, concurrency=1, until_empty=True)
    assert summary.done == items
    if store.backend == "sqlite":
        assert writer.rounds - rounds <= items + 3  # in the settle's round
    assert summary.rounds <= items + 2  # no claim came back empty for the limit


async def test_a_worker_cancelled_while_an_item_settles_keeps_its_outcome(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The item's handler has returned and its finish is on its way when work() is
    # cancelled: the settle goes to its end (done, not given back), the other item,
    # still running, goes back unspent.
    settled = await store.enqueue("alpha", {"hang": False})
    hung = await store.enqueue("alpha", {"hang": True})
    settling, go_on = asyncio.Event(), asyncio.Event()
    finish = store.finish

    async def held_finish(item_id: int, **kwargs: Any) -> None:
        settling.set()
        await go_on.wait()  # a stop's cancel would land here, were the settle cancelled
        await finish(item_id, **kwargs)

    monkeypatch.setattr(store, "finish", held_finish)

    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["hang"]:
            await asyncio.Event().wait()
        return Done()

    worker = asyncio.create_task(work(store, handle, concurrency=2))
    await settling.wait()
    await until(lambda: running_tasks() == 1, what="the other item runs")
    worker.cancel()
    await until(lambda: running_tasks() == 0, what="the running item is cancelled")
    assert not worker.done()  # it waits for the settle
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await worker
    assert (await store.item(settled))["state"] == "done"
    row = await store.item(hung)
    assert (row["state"], row["attempts"]) == ("ready", 0)
    assert await verify_ledger(store) == []


async def test_a_renewal_refused_cancels_the_item_and_drops_its_outcome(
    store: ControlStore, clock: ManualClock
) -> None:
    taken = await store.enqueue("alpha", {"n": 1})
    cancelled = await store.enqueue("alpha", {"n": 2})
    stopped: list[int] = []
    stop = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.append(claim.item_id)
            raise
        return Done()

    worker = asyncio.create_task(work(store, handle, concurrency=2, stop=stop, grace=0))
    await until(lambda: running_tasks() == 2, what="both run")
    await store.cancel(cancelled, reason="operator")
    # The other one is taken over: its claim given back behind the worker's back and
    # claimed by a rival, with a higher fence.
    row = await store.item(taken)
    await store.release(taken, fence=row["fence"])
    rival = await store.claim("rival")
    assert rival is not None and rival.item_id == taken
    clock.advance(store.lease_seconds / 3 + 0.1)  # the renewers' turn: both refused
    await until(lambda: sorted(stopped) == sorted([taken, cancelled]), what="both stopped")
    stop.set()
    summary = await asyncio.wait_for(worker, 10)
    assert (summary.cancelled, summary.fence_rejected, summary.done) == (1, 1, 0)
    assert (await store.item(taken))["owner"] == "rival"  # nothing reported over it
    await store.finish(taken, fence=rival.fence)
    assert (await store.item(cancelled))["state"] == "cancelled"
    assert await verify_ledger(store) == []


@pytest.mark.parametrize("refused", ["renewal", "settle", "give back"])
async def test_a_project_unassigned_under_an_actors_worker_loses_only_its_items(
    store: ControlStore, clock: ManualClock, refused: str
) -> None:
    # Its item's renewal, settle or give-back is refused (ScopeDenied): the item is dropped
    # like a lost claim and left to its lease; the worker goes on with the projects it
    # still has, and stops as asked.
    await store.create_project("beta", "Beta")
    for project in ("alpha", "beta"):
        await store.assign(project, "agent")
    gone = await store.enqueue("alpha", {"n": 1})
    kept = await store.enqueue("beta", {"n": 2})
    release = {gone: asyncio.Event(), kept: asyncio.Event()}
    stopped: list[int] = []
    stop = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        try:
            await release[claim.item_id].wait()
        except asyncio.CancelledError:
            stopped.append(claim.item_id)
            raise
        return Done({"by": "agent"})

    worker = asyncio.create_task(
        work(store, handle, concurrency=2, stop=stop, grace=0, actor_id="agent")
    )
    await until(lambda: running_tasks() == 2, what="both run")
    await store.unassign("alpha", "agent")
    if refused == "renewal":
        clock.advance(store.lease_seconds / 3 + 0.1)  # the renewer's turn: alpha's refused
        await until(lambda: stopped == [gone], what="alpha's handler stopped")
    elif refused == "settle":
        release[gone].set()  # its Done is refused
    if refused != "give back":
        release[kept].set()

        async def kept_done() -> bool:
            return (await store.item(kept))["state"] == "done"

        await until(kept_done, what="beta's item done")
        assert not worker.done()
    stop.set()  # grace 0: a handler still running is stopped, its claim given back
    summary = await asyncio.wait_for(worker, 10)
    assert summary.scope_lost == 1  # a give-back refused for it too: counted as what it is
    assert (summary.done, summary.released) == ((0, 1) if refused == "give back" else (1, 0))
    assert (await store.item(gone))["state"] == "claimed"  # left to its lease
    clock.advance(store.lease_seconds)
    taken = await store.claim("rival")
    assert taken is not None and taken.item_id == gone and taken.fence == 2
    assert await verify_ledger(store) == []


async def test_an_exclusive_worker_runs_alone(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    stop = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    first = asyncio.create_task(work(store, handle, exclusive=True, stop=stop))
    await until(lambda: running_tasks("asyncplane-wait-work-stop") > 0, what="it waits")
    with caplog.at_level(logging.WARNING, logger="asyncplane.worker"):
        second = await work(store, handle, exclusive=True, until_empty=True)
    assert second.skipped
    assert any("holds the single-runner guard" in r.getMessage() for r in caplog.records)
    shared = await work(store, handle, until_empty=True)  # not exclusive: runs beside it
    assert not shared.skipped
    stop.set()
    assert not (await first).skipped


async def test_work_refuses_what_is_not_a_handler_before_running_anything(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {})
    ran: list[str] = []

    def sync(claim: ClaimedItem) -> Done:
        ran.append("sync")  # its work would be done, then refused, on every attempt
        return Done()

    async def two(claim: ClaimedItem, extra: int) -> Done:
        return Done()

    async def none() -> Done:
        return Done()

    async def keyword_only(*, claim: ClaimedItem) -> Done:
        return Done()

    class Handler:
        async def __call__(self, claim: ClaimedItem) -> Done:
            ran.append("instance")
            return Done()

    class Plain:
        def __call__(self, claim: ClaimedItem) -> Done:
            ran.append("plain instance")
            return Done()

    bad_ones = ("module:handle", sync, two, none, keyword_only, Handler, Plain(),
                functools.partial(sync))  # fmt: skip
    for bad in bad_ones:
        with pytest.raises(InvalidType, match="handle must be an async function"):
            await work(store, bad, until_empty=True)  # type: ignore[arg-type]
    assert ran == [] and (await store.item(item_id))["state"] == "ready"

    async def with_default(claim: ClaimedItem, extra: int = 1) -> Done:
        ran.append("default")
        return Done()

    def logged(handler: Any) -> Any:
        @functools.wraps(handler)
        def wrapper(claim: ClaimedItem) -> Any:
            ran.append("logged")
            return handler(claim)  # a coroutine: the wrapper is a handler as much

        return wrapper

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    def in_a_thread(plain: Any) -> Any:
        @functools.wraps(plain)
        async def wrapper(claim: ClaimedItem) -> Any:
            return await asyncio.to_thread(plain, claim)  # async, around a plain def

        return wrapper

    shapes = (Handler(), with_default, logged(handle), lambda claim: handle(claim),
              functools.partial(with_default, extra=2), in_a_thread(lambda claim: Done()),
              functools.partial(Handler()))  # fmt: skip
    for n, shape in enumerate(shapes):
        if n:  # (the first runs the item enqueued above)
            await store.enqueue("alpha", {})
        assert (await work(store, shape, until_empty=True)).done == 1, shape
    assert ran == ["instance", "default", "logged", "default", "instance"]


async def test_a_handler_call_that_gives_no_awaitable_retries_its_item(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {})
    summary = await work(store, lambda claim: Done(), until_empty=True)  # (no coroutine)
    assert summary.retried == 1
    row = await store.item(item_id)
    assert row["state"] == "deferred" and "not an awaitable" in row["error"]


async def test_a_handler_raising_generator_exit_has_its_item_retried_and_work_goes_on(
    store: ControlStore,
) -> None:
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])

    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["n"] == 0:
            raise GeneratorExit  # a stray one, from a generator's cleanup
        return Done()

    summary = await work(store, handle, concurrency=2, until_empty=True)
    assert (summary.done, summary.retried) == (3, 1)
    failed = await store.item(ids[0])
    assert failed["state"] == "deferred" and "GeneratorExit" in failed["error"]
    assert await verify_ledger(store) == []


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()])
async def test_a_handler_asking_to_exit_has_its_item_retried_then_work_stops_and_says_so(
    store: ControlStore, raised: BaseException
) -> None:
    # sys.exit() in one item's code (or Ctrl-C as Python 3.10 raises it in the code that
    # runs): that item is retried, the worker stops as if stop were set, the others finish
    # or go back, and the exception reaches work()'s caller, nothing left claimed.
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(6)])
    stop = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["n"] == 0:
            raise raised
        return Done()

    with pytest.raises(type(raised)):
        await work(store, handle, concurrency=1, stop=stop)
    assert stop.is_set()
    failed = await store.item(ids[0])
    assert failed["state"] == "deferred" and type(raised).__name__ in failed["error"]
    assert (await store.counts())["claimed"] == 0
    assert await verify_ledger(store) == []


async def test_an_exit_asked_by_the_handler_of_a_lost_item_still_stops_work(
    store: ControlStore, clock: ManualClock
) -> None:
    # The item is cancelled by an operator; its handler, cancelled for that, asks the
    # program to exit as it goes: nothing of the item is reported, but the exit stands.
    item_id = await store.enqueue("alpha", {})
    stop = asyncio.Event()

    async def handle(claim: ClaimedItem) -> Done:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            sys.exit(4)
        return Done()

    async def operator() -> None:
        await until(lambda: running_tasks() == 1, what="it runs")
        await store.cancel(item_id, reason="operator")
        clock.advance(store.lease_seconds / 3 + 0.1)  # the renewal is refused: lost
        await until(lambda: running_tasks() == 0, what="its handler stopped")
        stop.set()  # (a worker that let the exit go would stop here, raising nothing)

    # work() is awaited here, not in a task of its own: asyncio lets a task's SystemExit
    # out of the event loop (see docs/workers.md).
    side = asyncio.create_task(operator())
    with pytest.raises(SystemExit) as ended:
        await work(store, handle, stop=stop)
    await side
    assert ended.value.code == 4 and stop.is_set()
    assert (await store.item(item_id))["state"] == "cancelled"


# --- processes --------------------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from asyncplane import ControlStore, Done, work
    async def handle(claim):
        await asyncio.sleep(0.001 * (claim.item_id % 7))
        return Done({"by": sys.argv[2]})
    async def main():
        async with ControlStore(sys.argv[1], lease_seconds=float(sys.argv[3])) as store:
            summary = await work(store, handle, concurrency=16, until_empty=True,
                                 owner=sys.argv[2], poll_interval=0.01)
            print(summary.done, flush=True)
    asyncio.run(main())
    """
)


def test_four_worker_processes_drain_two_thousand_items_once(location_of: Any) -> None:
    where = location_of("fleet.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("p", "P")
            await store.enqueue_many("p", [{"n": n} for n in range(2000)])

    asyncio.run(seed())
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, where, f"w{n}", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(4)
    ]
    results = [w.communicate(timeout=300) for w in workers]
    assert [w.returncode for w in workers] == [0] * 4, [err for _, err in results]
    done = [int(out.split()[-1]) for out, _ in results]
    assert sum(done) == 2000  # each item settled by exactly one worker

    async def check() -> None:
        async with ControlStore(where) as store:
            assert await states_of(store) == {"done": 2000}
            assert await verify_ledger(store) == []
            rows = await store.items(limit=10_000)
            assert len({row["result"]["by"] for row in rows}) > 1  # they shared the work

    asyncio.run(check())


def test_a_killed_worker_process_leaves_nothing_another_cannot_finish(location_of: Any) -> None:
    where = location_of("kill.db")
    hanging = textwrap.dedent(
        """
        import asyncio, sys
        from asyncplane import ControlStore, work
        async def handle(claim):
            print(claim.item_id, flush=True)
            await asyncio.Event().wait()
        async def main():
            async with ControlStore(sys.argv[1], lease_seconds=0.5) as store:
                await work(store, handle, concurrency=3)
        asyncio.run(main())
        """
    )

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("p", "P")
            await store.enqueue_many("p", [{"n": n} for n in range(3)])

    asyncio.run(seed())
    child = subprocess.Popen(
        [sys.executable, "-c", hanging, where], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    claimed = {int(child.stdout.readline()) for _ in range(3)}
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    child.stdout.close()

    async def finish() -> None:
        # Its own leases are long: a stall of this process must not hand its claims on
        # to itself. The dead child's half-second leases were stored with its claims.
        async with ControlStore(where, lease_seconds=60) as store:
            stop = asyncio.Event()
            finished: set[int] = set()

            async def handle(claim: ClaimedItem) -> Done:
                finished.add(claim.item_id)
                if len(finished) == 3:
                    stop.set()
                return Done()

            # The leases lapse; the claims wait for that (an alarm, not a poll) and take over.
            summary = await asyncio.wait_for(work(store, handle, stop=stop), 60)
            assert summary.done == 3
            rows = await store.items()
            assert {row["item_id"] for row in rows} == claimed
            assert all(row["state"] == "done" for row in rows)
            assert await verify_ledger(store) == []

    asyncio.run(finish())


async def test_retry_outcome_from_a_handler(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})

    async def handle(claim: ClaimedItem) -> Retry:
        return Retry("busy", delay=3600)

    summary = await work(store, handle, until_empty=True)
    assert summary.retried == 1
    assert (await store.item(item_id))["state"] == "deferred"


# --- the worker command -----------------------------------------------------------------------

HANDLERS = textwrap.dedent(
    """
    import asyncio
    import logging
    import sys
    from asyncplane import Done

    background = []

    async def exits(status):
        sys.exit(status)

    async def handle(claim):
        if claim.payload.get("exit"):
            sys.exit(claim.payload["exit"])
        if claim.payload.get("exit_in_background"):
            # A task of the handler's own asks the program to exit, another item running.
            background.append(asyncio.create_task(exits(claim.payload["exit_in_background"])))
        if claim.payload.get("log"):
            logging.getLogger("fleet.agents").info("working on %s", claim.payload["log"])
        if claim.payload.get("hang"):
            await asyncio.Event().wait()
        if claim.payload.get("raise"):
            raise KeyError("prompt")
        return Done({"n": claim.payload["n"]})

    def not_async(claim):
        return None

    async def yields(claim):
        yield Done()

    async def stubborn(claim):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    async def two_arguments(claim, extra):
        return Done()

    class AClass:
        async def __call__(self, claim):
            return Done()

    def __getattr__(name):
        if name == "unreadable":
            raise RuntimeError("its settings are missing")
        raise AttributeError(name)
    """
)


def worker(where: str, cwd: Any, *args: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "asyncplane.cli", "worker", where, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _COMMANDS.append(child)
    return child


#: The worker commands a test started (`worker`, `_nohup_worker`): one a failed test left
#: running is killed after it (`_no_command_left`), not left idle for the rest of the run.
_COMMANDS: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_command_left() -> Iterator[None]:
    yield
    while _COMMANDS:
        child = _COMMANDS.pop()
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=60)


#: The worker command's own loop is the child's; the test's need not run on both.
_COMMAND_TEST = pytest.mark.asyncio(loop_factories=["asyncio"])


@contextlib.asynccontextmanager
async def a_command_store(
    location_of: Any, tmp_path: Any, name: str
) -> AsyncIterator[tuple[str, ControlStore]]:
    """A store with project ``p`` for the worker command, and its handlers' module."""
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    where = location_of(name)
    async with ControlStore(where) as store:
        await store.create_project("p", "P")
        yield where, store


@_COMMAND_TEST
async def test_the_worker_command_works_until_sigterm(
    store: ControlStore, location_of: Any, tmp_path: Any
) -> None:
    del store
    async with a_command_store(location_of, tmp_path, "cmd.db") as (where, store):
        await store.enqueue_many("p", [{"n": n} for n in range(20)])
        await store.enqueue("p", {"n": 99, "raise": True})
        logs = await store.enqueue("p", {"n": 98, "log": "a prompt"})
        child = worker(where, tmp_path, "fleet_handlers:handle", "--concurrency", "4",
                       "--log-format", "json")  # fmt: skip

        async def all_done() -> bool:
            return (await store.counts())["done"] == 21

        deadline = time.monotonic() + 60
        while not await all_done():
            assert time.monotonic() < deadline and child.poll() is None, child.stderr
            await asyncio.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        assert child.returncode == 0, err
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        raised = [line for line in lines if "KeyError" in line["message"]]
        assert raised and "Traceback" in raised[0]["traceback"]
        assert raised[0]["item_id"] == 21 and raised[0]["project_id"] == "p"
        # The handler's own logger is in the same form, with the item it handled.
        (own,) = [line for line in lines if line["logger"] == "fleet.agents"]
        assert own["message"] == "working on a prompt" and own["level"] == "info"
        assert own["item_id"] == logs and own["attempt"] == 1 and own["fence"] == 1
        assert not any("item_id" in line for line in lines if "stopped" in line["message"])
        # The command runs on uvloop, installed with the suite (asyncplane._loops).
        started = f"starting (concurrency 4, on {COMMAND_LOOP})"
        assert any(started in line["message"] for line in lines)
        assert any("stopped" in line["message"] for line in lines)
        assert await verify_ledger(store) == []


@_COMMAND_TEST
async def test_a_second_signal_stops_the_worker_at_once_and_gives_claims_back(
    store: ControlStore, location_of: Any, tmp_path: Any
) -> None:
    del store
    async with a_command_store(location_of, tmp_path, "cmd2.db") as (where, store):
        ids = await store.enqueue_many("p", [{"n": n, "hang": True} for n in range(3)])
        child = worker(where, tmp_path, "fleet_handlers:handle", "--grace", "600",
                       "--log-format", "json")  # fmt: skip
        deadline = time.monotonic() + 60
        while (await store.counts())["claimed"] < 3:
            assert time.monotonic() < deadline and child.poll() is None
            await asyncio.sleep(0.05)
        child.send_signal(signal.SIGTERM)  # graceful: would wait 600 s for hung items
        await asyncio.sleep(0.2)
        assert child.poll() is None
        child.send_signal(signal.SIGINT)  # the second: at once
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        lines = [json.loads(line) for line in err.splitlines()]  # every one, this one too
        assert child.returncode == 1 and "stopped at once" in lines[-1]["message"]
        for item_id in ids:
            row = await store.item(item_id)
            assert (row["state"], row["attempts"]) == ("ready", 0)  # given back, unspent
        assert await verify_ledger(store) == []


@_COMMAND_TEST
async def test_a_third_signal_ends_a_worker_whose_handler_ignores_its_cancellation(
    store: ControlStore, location_of: Any, tmp_path: Any
) -> None:
    # A handler that swallows its cancellation (or a store that never answers) held the
    # worker after a second signal for as long as it liked: a third ends the process.
    del store
    async with a_command_store(location_of, tmp_path, "stubborn.db") as (where, store):
        (item_id,) = await store.enqueue_many("p", [{"n": 0}])
        child = worker(where, tmp_path, "fleet_handlers:stubborn", "--log-format", "json")
        assert child.stderr is not None

        def said(words: str) -> None:
            assert child.stderr is not None
            for line in child.stderr:
                if words in line:
                    return
            raise AssertionError(f"the worker ended before it said {words!r}")

        await asyncio.to_thread(said, "starting")
        deadline = time.monotonic() + 60
        while (await store.counts())["claimed"] < 1:
            assert time.monotonic() < deadline and child.poll() is None
            await asyncio.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        await asyncio.to_thread(said, "stopping")
        child.send_signal(signal.SIGINT)  # the second: the handler ignores its cancel
        child.send_signal(signal.SIGTERM)  # (may merge with the second: then the bound)
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        assert child.returncode == 1, err
        assert "stopped without winding up" in err
        row = await store.item(item_id)
        assert row["state"] == "claimed"  # left to its lease, as after a SIGKILL
        assert await verify_ledger(store) == []


@_COMMAND_TEST
async def test_a_handlers_sys_exit_ends_the_command_with_its_status_nothing_left_claimed(
    store: ControlStore, location_of: Any, tmp_path: Any
) -> None:
    del store
    async with a_command_store(location_of, tmp_path, "exit.db") as (where, store):
        (asked,) = await store.enqueue_many("p", [{"n": 0, "exit": 5}])
        child = worker(where, tmp_path, "fleet_handlers:handle", "--log-format", "json")
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        assert child.returncode == 5, err
        assert "a handler asked to exit" in json.loads(err.splitlines()[-1])["message"]
        row = await store.item(asked)
        assert row["state"] == "deferred" and "SystemExit" in row["error"]
        assert (await store.counts())["claimed"] == 0
        assert await verify_ledger(store) == []


@_COMMAND_TEST
async def test_a_sys_exit_in_a_handlers_own_task_ends_the_command_with_its_status(
    store: ControlStore, location_of: Any, tmp_path: Any
) -> None:
    # Raised out of a task, the exit stops the event loop, whose wind-up cancels every
    # task: the store was closed while the workers gave their items back, which opened
    # it again, and its connection's thread kept the process alive for ever.
    del store
    async with a_command_store(location_of, tmp_path, "bg-exit.db") as (where, store):
        running = await store.enqueue("p", {"n": 0, "hang": True})
        child = worker(where, tmp_path, "fleet_handlers:handle", "--log-format", "json")

        async def claimed() -> bool:
            return (await store.item(running))["state"] == "claimed"

        await until(claimed, what="the first item claimed")
        await store.enqueue("p", {"n": 1, "exit_in_background": 9, "hang": True})
        try:
            _, err = await asyncio.to_thread(child.communicate, timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 9, err
        # Every task cancelled at once, the store's writer's too: the items are left to
        # their leases, as documented (a handler's own sys.exit() is caught and wound up).
        assert (await store.counts())["claimed"] == 2
        assert await verify_ledger(store) == []


SIGNALLED_AS_IT_CLOSES = textwrap.dedent(
    """
    import asyncio, os, signal
    from asyncplane import ControlStore, Done

    closes = ControlStore.close

    async def close(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the second signal, as the store closes
        for _ in range(3):
            await asyncio.sleep(0)
        await closes(self)

    ControlStore.close = close

    async def handle(claim):
        return Done()
    """
)


def test_a_second_signal_while_the_store_closes_still_counts(tmp_path: Any) -> None:
    # The signal handlers were removed before the store's close: a second signal during
    # it killed the process (143, nothing said), where the rule is 1, logged.
    (tmp_path / "closing_handlers.py").write_text(SIGNALLED_AS_IT_CLOSES)
    where = str(tmp_path / "closing.db")
    asyncio.run(_make_store_with_project(where))
    child = worker(where, tmp_path, "closing_handlers:handle", "--log-format", "json")
    assert child.stderr is not None
    while "starting" not in (line := child.stderr.readline()):
        assert line, child.communicate(timeout=60)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1, err
    assert "stopped at once" in err


def test_on_a_terminal_log_lines_go_above_the_status_line(tmp_path: Any) -> None:
    # A record was written on the status line's end ("retried 0\x1b[K2026-12-06 ...").
    import pty

    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    where = str(tmp_path / "tty.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("p", "P")
            await store.enqueue_many("p", [{"n": 0}, {"n": 1, "raise": True}])

    asyncio.run(seed())
    main, terminal = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "asyncplane.cli", "worker", where, "fleet_handlers:handle",
         "--concurrency", "1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=terminal,
    )  # fmt: skip
    os.close(terminal)
    shown = b""
    try:
        while b"raised" not in shown:
            shown += os.read(main, 65536)
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(OSError):  # (EIO once the child has closed its end)
            while chunk := os.read(main, 65536):
                shown += chunk
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
        os.close(main)
    text = shown.decode()
    assert "1 slots: done 1" in text, text
    for line in re.finditer(r"\d{4}-\d\d-\d\d \d\d:\d\d", text):
        before = text[: line.start()]
        assert before == "" or before.endswith(("\r\x1b[K", "\n")), repr(before[-60:])


def test_the_commands_slots_are_shared_out_whole_over_its_projects(tmp_path: Any) -> None:
    # --concurrency 5 over two projects ran 2 and 2: a slot lost; and the start lines did
    # not say which project each was.
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    where = str(tmp_path / "shares.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("a", "A")
            await store.create_project("b", "B")

    asyncio.run(seed())
    child = worker(where, tmp_path, "fleet_handlers:handle", "--concurrency", "5",
                   "--project", "a", "--project", "b", "--log-format", "json")  # fmt: skip
    assert child.stderr is not None
    started = []
    while len(started) < 2:
        line = child.stderr.readline()
        assert line, child.communicate(timeout=60)
        if "starting" in line:
            started.append(json.loads(line)["message"])
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert sorted(re.sub(r".*starting \((.*), on .*", r"\1", m) for m in started) == [
        "concurrency 2, project b", "concurrency 3, project a",
    ]  # fmt: skip


async def _make_store_with_project(where: str) -> None:
    async with ControlStore(where) as store:
        await store.create_project("p", "P")


@pytest.mark.parametrize("module", ["fleet_handlers", "threaded_handlers"])
def test_a_signal_while_the_store_opens_stops_the_command_cleanly(
    tmp_path: Any, module: str
) -> None:
    # (threaded_handlers: stopped before it started while the store opened, it logged so
    # and then waited for ever on the thread the handler's module had started, which the
    # interpreter joins.)
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    (tmp_path / "threaded_handlers.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(120,)).start()\n"
        "from fleet_handlers import handle\n"
    )
    with socket.socket() as server:  # a "server" that takes the connection, never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(60)
        url = f"postgresql://nobody@127.0.0.1:{server.getsockname()[1]}/none"
        child = worker(url, tmp_path, f"{module}:handle", "--log-format", "json")
        held, _ = server.accept()  # the store is opening
        with held:
            child.send_signal(signal.SIGTERM)
            _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "stopped before it started" in json.loads(err.splitlines()[-1])["message"]


_SLOW_IMPORTS = {
    "plain": "time.sleep(120)  # a model loading\n",
    # A module whose retry loop catches everything: the signal's raise was swallowed, and
    # the worker started and ran.
    "swallowing": "try:\n    time.sleep(120)\nexcept BaseException:\n    pass\n",
    # A client's thread started as it was imported (no daemon): it held the exit up.
    "threaded": "threading.Thread(target=time.sleep, args=(120,)).start()\ntime.sleep(120)\n",
}


def test_a_second_signal_while_the_module_swallows_the_first_ends_the_command(
    tmp_path: Any,
) -> None:
    # A second signal changed nothing: the import ran to its end, and the command said
    # it stopped before it started, with 0, long after.
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    (tmp_path / "stubborn_handlers.py").write_text(
        "import sys, time\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        print('importing', file=sys.stderr, flush=True)\n"
        "        time.sleep(120)\n"
        "    except BaseException:\n"
        "        pass\n"
        "from fleet_handlers import handle\n"
    )
    where = str(tmp_path / "stubborn.db")
    asyncio.run(_make_store_with_project(where))
    child = worker(where, tmp_path, "stubborn_handlers:handle", "--log-format", "json")
    assert child.stderr is not None
    for _ in range(2):
        while "importing" not in (line := child.stderr.readline()):
            assert line, child.communicate(timeout=60)
        child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1, err
    assert "a second signal" in json.loads(err.splitlines()[-1])["message"]


@pytest.mark.parametrize(
    ("signal_name", "module"),
    [("SIGINT", "plain"), ("SIGTERM", "plain"), ("SIGHUP", "plain"),
     ("SIGTERM", "swallowing"), ("SIGTERM", "threaded")],
)  # fmt: skip
def test_a_signal_while_the_handler_is_imported_stops_the_command_cleanly(
    tmp_path: Any, signal_name: str, module: str
) -> None:
    # A handler's module that loads a model as it is imported takes a while: a signal
    # then gave a KeyboardInterrupt's traceback (exit 130), or killed the command outright.
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    (tmp_path / "slow_handlers.py").write_text(
        "import sys, threading, time\n"
        "print('importing', file=sys.stderr, flush=True)\n"
        + _SLOW_IMPORTS[module]
        + "from fleet_handlers import handle\n"
    )
    where = str(tmp_path / "slow.db")
    asyncio.run(_make_store_with_project(where))
    child = worker(where, tmp_path, "slow_handlers:handle", "--log-format", "json")
    assert child.stderr is not None
    while "importing" not in (line := child.stderr.readline()):
        assert line, child.communicate(timeout=60)
    child.send_signal(getattr(signal, signal_name))
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert "Traceback" not in err
    assert "stopped before it started" in json.loads(err.splitlines()[-1])["message"]


@_COMMAND_TEST
async def test_sighup_stops_the_worker_gracefully(
    store: ControlStore, location_of: Any, tmp_path: Any
) -> None:
    # Its terminal (or ssh session) closed: SIGHUP ended the command at once (exit 129),
    # its running items left claimed until their leases lapsed.
    del store
    async with a_command_store(location_of, tmp_path, "hup.db") as (where, store):
        await store.enqueue_many("p", [{"n": n, "hang": True} for n in range(2)])
        child = worker(where, tmp_path, "fleet_handlers:handle", "--grace", "0.2",
                       "--log-format", "json")  # fmt: skip
        deadline = time.monotonic() + 60
        while (await store.counts())["claimed"] < 2:
            assert time.monotonic() < deadline and child.poll() is None
            await asyncio.sleep(0.05)
        child.send_signal(signal.SIGHUP)
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        assert child.returncode == 0, err
        counts = await store.counts()
        assert (counts["claimed"], counts["ready"]) == (0, 2)  # given back past the grace
        assert await verify_ledger(store) == []


@_COMMAND_TEST
@pytest.mark.parametrize("why", ["the module's own", "nohup"])
async def test_sighup_taken_elsewhere_leaves_the_worker_running(
    store: ControlStore, location_of: Any, tmp_path: Any, why: str
) -> None:
    # SIGHUP stops the command, unless it was ignored when it started (nohup), or the
    # handler's module took it as it was imported (to reopen its logs, say): the command
    # took it over, and stopped.
    del store
    async with a_command_store(location_of, tmp_path, "hup2.db") as (where, store):
        module = "fleet_handlers"
        if why == "the module's own":
            (tmp_path / "hup_handlers.py").write_text(
                "import signal\nsignal.signal(signal.SIGHUP, lambda *_: None)\n"
                "from fleet_handlers import handle\n"
            )
            module = "hup_handlers"
        child = _nohup_worker(where, tmp_path, f"{module}:handle", nohup=why == "nohup")
        first = await store.enqueue("p", {"n": 1})

        async def done(item_id: int) -> bool:
            assert child.poll() is None, child.communicate(timeout=60)
            return (await store.item(item_id))["state"] == "done"

        await until(lambda: done(first), what="the first item done")
        child.send_signal(signal.SIGHUP)
        second = await store.enqueue("p", {"n": 2})
        await until(lambda: done(second), what="an item done after the SIGHUP")
        child.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        assert child.returncode == 0, err


def _nohup_worker(where: str, cwd: Any, handler: str, *, nohup: bool) -> subprocess.Popen[str]:
    def ignoring() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    child = subprocess.Popen(
        [sys.executable, "-m", "asyncplane.cli", "worker", where, handler],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ignoring if nohup else None,
    )  # fmt: skip
    _COMMANDS.append(child)
    return child


def _has_open(pid: int, name: str) -> bool:
    """The process has a file named ``name`` open (Linux's /proc)."""
    fds = pathlib.Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        return any(os.readlink(fd).endswith(name) for fd in fds.iterdir())
    return False


def _sleeping(pid: int) -> bool:
    """A thread of the process sleeps in nanosleep (Linux's /proc wait channel)."""
    with contextlib.suppress(OSError):
        return any(
            "nanosleep" in (task / "wchan").read_text()
            for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
        )
    return False


async def test_a_second_signal_while_a_cancelled_opening_winds_up_ends_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first signal cancelled the opening; its wind-up (the store's close) still ran
    # when the second came, which took the workers' path: a hard stop 10 s later, where
    # nothing was claimed and the rule is "at once".
    async def opens() -> None:
        await asyncio.Event().wait()

    opening = asyncio.create_task(opens())
    early = _worker_command._EarlySignals()
    signals = _worker_command._Signals(asyncio.Event(), [], early)
    try:
        signals.opening = opening
        signals.heard()  # the first: the opening is cancelled
        with pytest.raises(asyncio.CancelledError):
            await opening
        ended: list[str] = []
        monkeypatch.setattr(signals, "hard_stop", lambda: ended.append("now"))
        signals.heard()  # the second, as the wind-up runs
        assert ended == ["now"]
    finally:
        signals.remove()
        early.restore()


async def test_a_signal_once_the_loops_handlers_are_gone_ends_the_command_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Once the store had closed (or its opening had been given up), the loop's handlers
    # were taken away and nothing came in their place: a late signal killed the process
    # (-15, or a KeyboardInterrupt's traceback) after it had said it stopped. It now ends
    # it at once, with 1 and an ERROR line, as a second signal does everywhere else.
    early = _worker_command._EarlySignals()
    signals = _worker_command._Signals(asyncio.Event(), [], early)
    exits: list[int] = []
    monkeypatch.setattr(_worker_command.os, "_exit", exits.append)
    monkeypatch.setattr(_worker_command.logging, "shutdown", lambda: None)
    try:
        signals.remove()
        os.kill(os.getpid(), signal.SIGTERM)  # its Python handler runs at the next step
        assert exits == [1]
        assert "a signal as the command ended" in caplog.text
    finally:
        early.restore()


@_COMMAND_TEST  # (the turns counted are asyncio's loop's)
async def test_a_signal_as_the_opening_ends_stops_the_command_all_the_same(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The signal heard after the opening ended, before the command went on: cancelling a
    # done opening did nothing, and the workers ran on as if no signal had come.
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    opened = ControlStore.open

    async def open_then_signalled(self: ControlStore) -> None:
        await opened(self)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(2):  # heard as the opening task ends, before the command goes on
            await asyncio.sleep(0)

    monkeypatch.setattr(ControlStore, "open", open_then_signalled)
    args = argparse.Namespace(
        db=str(tmp_path / "s.db"), project=None, concurrency=2, timeout=None, owner=None,
        exclusive=False, grace=1.0,
    )  # fmt: skip
    handler = _worker_command.load_handler("fleet_handlers:handle")
    early = _worker_command._EarlySignals()
    try:
        assert await asyncio.wait_for(_worker_command._main(args, handler, early), 30) == 0
    finally:
        early.restore()


@_COMMAND_TEST
async def test_a_signal_while_another_program_locks_the_file_stops_the_command_at_once(
    tmp_path: Any,
) -> None:
    # The opening waited for the write lock in SQLite's busy handler, which nothing
    # stops: the command, asked to stop, went on for the whole busy timeout (30 s), deaf
    # meanwhile to a second signal's rule (its handlers removed).
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    path = tmp_path / "locked.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # the sqlite3 shell's, say: not one of the writers
    try:
        child = worker(str(path), tmp_path, "fleet_handlers:handle", "--log-format", "json")
        # Its header read done (WAL's shared memory open), the opening waits for the lock:
        # a thread of it asleep in SQLite's busy handler (the kernel's wait channel).
        await until(
            lambda: _has_open(child.pid, "locked.db-shm") and _sleeping(child.pid),
            what="the opening waits for the lock",
        )
        asked = time.monotonic()
        child.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(child.communicate, timeout=60)
        took = time.monotonic() - asked
    finally:
        holder.rollback()
        holder.close()
    assert child.returncode == 0, err
    assert "stopped before it started" in json.loads(err.splitlines()[-1])["message"]
    assert took < 10, took  # not the busy timeout's 30 s


def test_the_worker_command_refuses_a_bad_handler(tmp_path: Any) -> None:
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    (tmp_path / "broken_handlers.py").write_text("async def handle(claim)\n")
    (tmp_path / "unset_handlers.py").write_text("import os\nKEY = os.environ['NO_SUCH_KEY']\n")
    where = str(tmp_path / "bad.db")

    async def make() -> None:
        async with ControlStore(where) as store:
            await store.projects()

    asyncio.run(make())
    for spec, words in (
        ("fleet_handlers:not_async", "a plain def, not an async def"),
        ("fleet_handlers:yields", "an async generator (it yields)"),
        ("fleet_handlers:two_arguments", "cannot be called with one argument"),
        ("fleet_handlers:AClass", "got type"),
        ("fleet_handlers:missing", "has no 'missing'"),
        ("fleet_handlers:unreadable", "cannot read 'unreadable' of 'fleet_handlers': Runtime"),
        ("no_such_module:handle", "cannot import 'no_such_module'"),
        ("fleet_handlers", "MODULE:ATTRIBUTE"),
        # A module failing as it is imported is a deployment to mend (2), its traceback
        # logged; not the 1 of a worker stopped at once.
        ("broken_handlers:handle", "SyntaxError: "),
        ("unset_handlers:handle", "KeyError: 'NO_SUCH_KEY'"),
        (".fleet_handlers:handle", "named whole, not relative"),
    ):
        child = worker(where, tmp_path, spec)
        _, err = child.communicate(timeout=60)
        assert child.returncode == 2 and words in err, (spec, err)
        if spec.startswith(("broken", "unset")):
            assert "Traceback" in err and "_handlers.py" in err, err
    for option, words in (
        (["--grace", "-1"], "grace must be"),
        (["--timeout", "0"], "timeout must be"),
        (["--timeout", "nan"], "timeout must be"),
        (["--timeout", "1e9"], "timeout must be"),
        (["--concurrency", "0"], "concurrency must be"),
        (["--project="], "project_id must"),
        (["--owner="], "owner must"),
        (["--owner", "o" * 300], "owner"),
        (["--project", "p", "--project", "q", "--project", "p"], "--project p is given more"),
    ):  # a usage error (2), not a store that failed (3)
        child = worker(where, tmp_path, "fleet_handlers:handle", *option)
        _, err = child.communicate(timeout=60)
        assert child.returncode == 2 and words in err, (option, err)


async def test_a_release_in_this_process_wakes_a_waiting_claim(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    first = await store.claim("w")
    assert first is not None
    waiting = asyncio.create_task(store.claim("v", wait=30, poll_interval=3600))
    await until(lambda: running_tasks("asyncplane-wait-work-local") > 0, what="it waits")
    await store.release(item_id, fence=first.fence)
    claim = await waiting
    assert claim is not None and claim.item_id == item_id


async def test_closing_the_store_ends_waiting_claims_and_workers(store: ControlStore) -> None:
    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    waiting = asyncio.create_task(store.claim("w", wait=600))
    worker = asyncio.create_task(work(store, handle))
    await until(lambda: running_tasks("asyncplane-wait-work-local") >= 2, what="both wait")
    await store.close()
    assert await asyncio.wait_for(waiting, 10) is None
    summary = await asyncio.wait_for(worker, 10)
    assert summary.claimed == 0
    assert not store._engine.is_open  # neither reopened it


@pytest.mark.parametrize("waiter", ["claim", "claims", "work"])
async def test_a_close_during_a_waiters_read_ends_it_as_a_close_does(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, waiter: str
) -> None:
    # The read a waiter makes before its claim (the data version it then waits on) is
    # out when the store closes: the waiter ends as the docs say (None, the iterator
    # ends, work() stops), not with StoreClosed, and nothing opens the store again.
    engine = engine_of(store)
    await engine.ready()
    reading = engine.data_version

    async def closed_meanwhile() -> int:
        read = asyncio.ensure_future(reading())
        await asyncio.sleep(0)  # the read under way (its engine open), then the close
        await store.close()
        return await read

    monkeypatch.setattr(engine, "data_version", closed_meanwhile)

    async def handle(claim: ClaimedItem) -> Done:
        return Done()

    if waiter == "claim":
        assert await asyncio.wait_for(store.claim("w", wait=600), 30) is None
    elif waiter == "claims":
        assert [claim async for claim in store.claims("w")] == []
    else:
        assert (await asyncio.wait_for(work(store, handle), 30)).claimed == 0
    assert not engine.is_open


def test_the_worker_command_refuses_a_store_that_is_not_there(tmp_path: Any) -> None:
    (tmp_path / "fleet_handlers.py").write_text(HANDLERS)
    child = worker(str(tmp_path / "typo.db"), tmp_path, "fleet_handlers:handle")
    _, err = child.communicate(timeout=60)
    assert child.returncode == 2 and "no such file" in err
    assert not (tmp_path / "typo.db").exists()


async def test_a_release_in_another_process_wakes_a_waiting_claim(
    store: ControlStore, location_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    del store
    where = location_of("release.db")
    if where.startswith("postgresql"):
        from asyncplane import _postgres

        monkeypatch.setattr(_postgres, "_SAFETY_POLL_SECONDS", 3600.0)  # NOTIFY alone
    async with ControlStore(where) as here:
        await here.create_project("p", "P")
        item_id = await here.enqueue("p", {})
        first = await here.claim("other")
        assert first is not None
        waiting = asyncio.create_task(here.claim("w", wait=20, poll_interval=0.01))
        await until(lambda: running_tasks("asyncplane-wait-work-local") > 0, what="it waits")
        script = (
            "import asyncio, sys\n"
            "from asyncplane import ControlStore\n"
            "async def main():\n"
            "    async with ControlStore(sys.argv[1]) as s:\n"
            "        await s.release(int(sys.argv[2]), fence=int(sys.argv[3]))\n"
            "asyncio.run(main())\n"
        )
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, where, str(item_id), str(first.fence),
            stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await child.communicate()
        assert child.returncode == 0, err
        claim = await waiting
        assert claim is not None and claim.item_id == item_id and claim.fence == first.fence + 1


async def test_a_worker_on_a_project_that_does_not_exist_says_so(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncplane.worker"):
        await work(store, done, project_id="alpah", until_empty=True, owner="w1")
        await work(store, done, project_id="alpha", until_empty=True, owner="w2")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == ["asyncplane worker w1: there is no project 'alpah' (yet); it waits for one"]
