"""drain(): the loop, its single-drainer lock, and what cancellation leaves behind."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest

from _signals import renewals_heard_late, renewed_a_third_after_each_grant, until, waiting_on
from asyncplane import (
    ClaimedItem,
    ControlStore,
    Done,
    DrainError,
    DrainLock,
    Failed,
    InvalidInput,
    InvalidType,
    Offload,
    Outcome,
    Park,
    Retry,
    drain,
    verify_ledger,
)
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock

WORKER = pathlib.Path(__file__).parent / "workers" / "drain_worker.py"


async def lock_is_free(store: ControlStore) -> bool:
    """Whether the store's own single-drainer guard is free (a lock file beside an SQLite
    store, a session advisory lock on PostgreSQL)."""
    async with store._engine.drain_guard() as acquired:
        return acquired


async def all_done(batch: list[ClaimedItem]) -> list[Outcome]:
    return [Done({"echo": claim.payload}) for claim in batch]


# --- the loop ------------------------------------------------------------------------------


async def test_foreground_drain_settles_everything(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(40)]
    summary = await drain(store, all_done, batch_size=7)
    assert not summary.skipped
    assert (summary.claimed, summary.done, summary.remaining) == (40, 40, 0)
    assert summary.rounds == 6 + 3  # six batches, then three empty rounds
    assert (await store.item(ids[-1]))["result"] == {"echo": {"n": 39}}
    assert await verify_ledger(store) == []
    assert await lock_is_free(store)


async def test_every_outcome_is_settled_through_the_store(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(6)]

    async def mixed(batch: list[ClaimedItem]) -> list[Outcome]:
        pick: dict[int, Outcome] = {
            0: Done("ok"), 1: Failed("bad input"), 2: Retry("timeout", delay=3600),
            3: Park(3600), 4: Offload("batch-1"), 5: Done("x" * 100_000),
        }  # fmt: skip
        return [pick[claim.payload["n"]] for claim in batch]

    summary = await drain(store, mixed, batch_size=10, empty_rounds=1)
    assert (summary.done, summary.failed, summary.retried) == (1, 2, 1)
    assert (summary.parked, summary.offloaded) == (1, 1)
    states = [(await store.item(item_id))["state"] for item_id in ids]
    assert states == ["done", "failed", "deferred", "deferred", "offloaded", "failed"]
    assert "result was refused" in (await store.item(ids[5]))["error"]
    assert summary.remaining == 3  # two deferred, one offloaded
    assert await verify_ledger(store) == []


async def test_max_iters_stops_and_reports_what_is_left(store: ControlStore) -> None:
    for n in range(10):
        await store.enqueue("alpha", {"n": n})
    summary = await drain(store, all_done, batch_size=3, max_iters=2)
    assert (summary.rounds, summary.done, summary.remaining) == (2, 6, 4)
    assert (await store.counts())["ready"] == 4


async def test_empty_rounds_decide_when_foreground_stops(store: ControlStore) -> None:
    summary = await drain(store, all_done, empty_rounds=5)
    assert (summary.rounds, summary.claimed) == (5, 0)


async def test_an_executor_that_raises_retries_its_batch(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(3)]

    async def broken(batch: list[ClaimedItem]) -> list[Outcome]:
        raise RuntimeError("model endpoint down")

    summary = await drain(store, broken, empty_rounds=1)
    assert (summary.retried, summary.done) == (3, 0)
    for item_id in ids:
        row = await store.item(item_id)
        assert row["state"] == "deferred"
        assert row["error"] == "the executor raised RuntimeError: model endpoint down"


async def test_an_executor_that_returns_no_list_or_is_no_coroutine_retries_its_batch(
    store: ControlStore,
) -> None:
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(2)])

    async def nothing(batch: list[ClaimedItem]) -> Any:
        return None

    # A lambda shows what it returns only when called (a plain def is refused up front:
    # test_an_executor_that_is_not_async_is_refused_before_any_claim).
    for executor in (nothing, lambda batch: None):
        summary = await drain(store, executor, empty_rounds=1)
        assert summary.retried == 2, executor
        assert {(await store.item(i))["state"] for i in ids} == {"deferred"}
        for item_id in ids:  # due again at once, for the next executor
            await store.cancel(item_id)
            await store.requeue(item_id)
    assert await verify_ledger(store) == []


async def test_an_executor_raising_generator_exit_retries_its_batch_too(
    store: ControlStore,
) -> None:
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(2)])

    async def exits(batch: list[ClaimedItem]) -> list[Outcome]:
        raise GeneratorExit

    summary = await drain(store, exits, empty_rounds=1)  # the drain itself goes on
    assert (summary.retried, summary.done) == (2, 0)
    assert {(await store.item(i))["state"] for i in ids} == {"deferred"}


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()])
async def test_an_executor_asking_to_exit_retries_its_batch_then_the_drain_stops(
    store: ControlStore, raised: BaseException
) -> None:
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])

    async def exits(batch: list[ClaimedItem]) -> list[Outcome]:
        raise raised

    with pytest.raises(type(raised)):
        await drain(store, exits, batch_size=2, empty_rounds=1)
    states = [(await store.item(i))["state"] for i in ids]
    assert states == ["deferred", "deferred", "ready", "ready"]  # one batch, then stopped
    assert await verify_ledger(store) == []


@pytest.mark.parametrize(
    "returned",
    [[], [Done()], [Done(), Done(), Done()], ["done", Done()]],
    ids=["none", "too-few", "too-many", "not-an-outcome"],
)
async def test_wrong_outcomes_retry_the_batch(store: ControlStore, returned: list[Any]) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(2)]

    async def sloppy(batch: list[ClaimedItem]) -> Sequence[Outcome]:
        return returned

    summary = await drain(store, sloppy, batch_size=2, empty_rounds=1)
    assert (summary.retried, summary.done) == (2, 0)
    assert {(await store.item(i))["state"] for i in ids} == {"deferred"}


async def test_preflight_dedup_is_counted(asyncplane_store_factory: Any) -> None:
    old: ControlStore = await asyncplane_store_factory("d.db")
    await old.create_project("p", "P")
    first = await old.enqueue("p", {"task": "q"})
    twins = [await old.enqueue("p", {"task": "q"}) for _ in range(3)]
    claim = await old.claim("w")
    assert claim is not None and claim.item_id == first
    await old.finish(first, fence=claim.fence, result="answer")
    new: ControlStore = await asyncplane_store_factory("d.db", identity=("task",))
    summary = await drain(new, all_done, empty_rounds=1)
    assert (summary.deduplicated, summary.claimed) == (3, 0)
    assert [(await new.item(t))["result"] for t in twins] == ["answer"] * 3


async def test_a_stop_request_ends_the_drain_after_its_round(store: ControlStore) -> None:
    for n in range(10):
        await store.enqueue("alpha", {"n": n})
    stop = asyncio.Event()

    async def stopping(batch: list[ClaimedItem]) -> list[Outcome]:
        stop.set()
        return [Done() for _ in batch]

    summary = await drain(store, stopping, batch_size=4, mode="daemon", stop=stop)
    assert (summary.rounds, summary.done, summary.remaining) == (1, 4, 6)


async def test_bad_arguments_are_refused(store: ControlStore) -> None:
    with pytest.raises(InvalidInput):
        await drain(store, all_done, mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        await drain(store, all_done, batch_size=0)
    assert await lock_is_free(store)


async def test_an_executor_that_is_not_async_is_refused_before_any_claim(
    store: ControlStore,
) -> None:
    # A plain def would run each batch, then fail to be awaited: every attempt spent.
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})

    def forgot_async(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    async def takes_two(batch: list[ClaimedItem], extra: int) -> list[Outcome]:
        return [Done() for _ in batch]

    for bad, said in (
        (forgot_async, "a plain def"),
        (None, "got NoneType"),
        (takes_two, "one argument, the batch"),
    ):
        with pytest.raises(InvalidType, match=f"execute must be an async function.*{said}"):
            await drain(store, bad)  # type: ignore[arg-type]
    item = await store.item(item_id)
    assert (item["state"], item["attempts"]) == ("ready", 0)  # never claimed
    assert await lock_is_free(store)


# --- leases during a slow executor -----------------------------------------------------


async def test_a_slow_executor_keeps_its_claims(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    store: ControlStore = await asyncplane_store_factory("slow.db", lease_seconds=30)
    rival: ControlStore = await asyncplane_store_factory("slow.db", lease_seconds=30)
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await release.wait()
        return [Done("late but mine") for _ in batch]

    task = asyncio.create_task(drain(store, slow, empty_rounds=1))
    await started.wait()
    for _ in range(12):  # four leases' worth of time passes while it works
        clock.advance(11)
        target = clock.now() + 29

        async def renewed(target: float = target) -> bool:
            expires = (await store.item(item_id))["lease_expires_at"]
            return bool(expires.timestamp() >= target)

        await until(renewed, what="the lease was renewed")
        assert await rival.claim("rival") is None  # never lapses, so never taken over
    release.set()
    summary = await task
    assert (summary.done, summary.fence_rejected) == (1, 0)
    assert (await store.item(item_id))["result"] == "late but mine"


async def test_a_batch_is_renewed_together_not_one_round_trip_after_another(
    store: ControlStore, clock: ManualClock
) -> None:
    # The renewer asks for every claim's renewal at once: the writer takes them into a
    # round or two (its batch), where one after another they would take a round each.
    await store.create_project("p", "P")
    ids = [await store.enqueue("p", {"n": n}) for n in range(20)]
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await release.wait()
        return [Done() for _ in batch]

    task = asyncio.create_task(drain(store, slow, batch_size=20, empty_rounds=1))
    await started.wait()
    leases = {i: (await store.item(i))["lease_expires_at"] for i in ids}
    writer = (await engine_of(store).ready()).writer
    rounds = writer.rounds
    clock.advance(store.lease_seconds / 3 + 0.01)

    async def all_renewed() -> bool:
        rows = [await store.item(i) for i in ids]
        return all(row["lease_expires_at"] > leases[row["item_id"]] for row in rows)

    await until(all_renewed, what="every lease of the batch renewed")
    assert writer.rounds - rounds <= 2
    release.set()
    assert (await task).done == 20
    assert await verify_ledger(store) == []


@pytest.mark.parametrize("refused", ["renewal", "settle"])
async def test_a_project_unassigned_under_an_actors_drain_loses_only_its_items(
    store: ControlStore, clock: ManualClock, refused: str
) -> None:
    # Its item's renewal or settle is refused (ScopeDenied): it is dropped like a lost
    # claim, its outcome not reported, and left to its lease; the drain goes on.
    for project in ("p", "q"):
        await store.create_project(project, project.upper())
        await store.assign(project, "agent")
    gone = await store.enqueue("p", {"n": 1})
    kept = await store.enqueue("q", {"n": 2})
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await release.wait()
        return [Done() for _ in batch]

    task = asyncio.create_task(drain(store, slow, batch_size=2, empty_rounds=1, actor_id="agent"))
    await started.wait()
    await store.unassign("p", "agent")
    if refused == "renewal":
        before = (await store.item(kept))["lease_expires_at"]
        clock.advance(store.lease_seconds / 3 + 0.01)  # the renewer's turn: p's refused

        async def renewed() -> bool:  # (asked in the same turn as p's)
            return (await store.item(kept))["lease_expires_at"] > before

        await until(renewed, what="the turn's renewals answered")
    release.set()
    summary = await asyncio.wait_for(task, 10)
    assert (summary.scope_lost, summary.done) == (1, 1)
    assert (await store.item(gone))["state"] == "claimed"  # left to its lease
    assert (await store.item(kept))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_a_batch_lease_is_renewed_a_third_of_a_lease_after_the_store_granted_it(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in work(): the drain's renewer hears of each renewal late, yet renews a third
    # of a lease after the store granted the last, not a third after its turn came back.
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    renewals_heard_late(store, clock, monkeypatch)
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await release.wait()
        return [Done() for _ in batch]

    task = asyncio.create_task(drain(store, slow, empty_rounds=1))
    await started.wait()
    await renewed_a_third_after_each_grant(store, clock, item_id)
    release.set()
    assert (await task).done == 1


async def test_a_failing_side_task_stops_the_drain_and_puts_the_batch_back(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    class BreakableClock:
        broken = False

        def now(self) -> float:
            if self.broken:
                self.broken = False  # fails once: the renewal in flight, not the clean-up
                raise OSError("clock lost")
            return clock.now()

        async def wait_until(self, when: float) -> None:
            await clock.wait_until(when)

    breakable = BreakableClock()
    store: ControlStore = await asyncplane_store_factory("side.db", clock=breakable)
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    started = asyncio.Event()

    async def forever(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    task = asyncio.create_task(drain(store, forever))
    await started.wait()
    breakable.broken = True
    clock.advance(store.lease_seconds)  # wakes the renewer, whose renewal now fails
    with pytest.raises(DrainError, match="renewer failed") as caught:
        await task
    assert caught.value.__cause__ is not None
    row = await store.item(item_id)
    assert (row["state"], row["attempts"]) == ("deferred", 0)  # back, no attempt spent
    assert await lock_is_free(store)
    assert await verify_ledger(store) == []


# --- cancellation --------------------------------------------------------------------------


async def test_cancelling_mid_batch_loses_nothing(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(8)]
    started = asyncio.Event()

    async def stuck(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    task = asyncio.create_task(drain(store, stuck, batch_size=5))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await lock_is_free(store)
    assert await verify_ledger(store) == []
    rows = [await store.item(i) for i in ids]
    assert [r["state"] for r in rows] == ["deferred"] * 5 + ["ready"] * 3
    assert {r["attempts"] for r in rows} == {0}  # handed back without spending an attempt
    summary = await drain(store, all_done)  # and the next drain takes them at once
    assert summary.done == 8
    assert await verify_ledger(store) == []


async def test_an_item_cancelled_and_purged_while_it_runs_is_counted_and_the_drain_goes_on(
    store: ControlStore, clock: ManualClock
) -> None:
    # A claimed item is never purged: one whose id the store no longer knows at its
    # settlement was settled by someone else (a cancel) and purged since. That is a claim
    # lost, as a takeover is, not the store failing: the rest of the batch is settled.
    cancelled, kept = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    started, go = asyncio.Event(), asyncio.Event()

    async def waits(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await go.wait()
        return [Done({"n": claim.payload["n"]}) for claim in batch]

    drainer = asyncio.create_task(drain(store, waits, empty_rounds=1))
    await started.wait()
    await store.cancel(cancelled, reason="wrong brief")
    clock.advance(1)
    assert (await store.purge(0)).purged == 1  # `asyncplane purge --retention 0s`
    go.set()
    summary = await asyncio.wait_for(drainer, 30)
    assert (summary.claimed, summary.done, summary.fence_rejected) == (2, 1, 1)
    assert (await store.item(kept))["state"] == "done"
    assert await verify_ledger(store) == []


async def test_cancelling_during_settlement_still_saves_the_outcomes(
    store: ControlStore,
) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(3)]
    task: asyncio.Task[Any] | None = None

    async def cancel_myself(batch: list[ClaimedItem]) -> list[Outcome]:
        assert task is not None
        task.cancel()  # arrives while the outcomes are being settled
        return [Done("kept") for _ in batch]

    task = asyncio.create_task(drain(store, cancel_myself))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(await store.item(i))["result"] for i in ids] == ["kept"] * 3
    assert await lock_is_free(store)
    assert await verify_ledger(store) == []


# --- the single-drainer lock ---------------------------------------------------------------


async def test_two_drains_in_one_process_run_one_at_a_time(store: ControlStore) -> None:
    await store.enqueue("alpha", {})
    started, release = asyncio.Event(), asyncio.Event()

    async def held(batch: list[ClaimedItem]) -> list[Outcome]:
        started.set()
        await release.wait()
        return [Done() for _ in batch]

    first = asyncio.create_task(drain(store, held))
    await started.wait()
    second = await drain(store, all_done)
    assert second.skipped and second.rounds == 0 and second.claimed == 0
    assert second.remaining is None  # not counted: 0 would say the queue is empty
    release.set()
    assert not (await first).skipped


def test_two_drain_processes_run_one_at_a_time(location_of: Any) -> None:
    path = location_of("two.db")
    asyncio.run(_seed(path))
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), path, "hold"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "executing"
        other = subprocess.run(
            [sys.executable, str(WORKER), path, "once"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert other.returncode == 0, other.stderr
        assert json.loads(other.stdout)["skipped"] is True
        out, _ = holder.communicate("go\n", timeout=120)
        assert json.loads(out)["done"] == 1
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_killed_drainer_leaves_no_lock_behind(location_of: Any) -> None:
    path = location_of("killed.db")
    asyncio.run(_seed(path))
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), path, "hold"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "executing"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    assert holder.stdin is not None
    holder.stdin.close()
    next_drain = subprocess.run(
        [sys.executable, str(WORKER), path, "once"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert next_drain.returncode == 0, next_drain.stderr
    assert json.loads(next_drain.stdout)["skipped"] is False


async def test_a_daemon_ends_when_its_store_is_closed_and_leaves_it_closed(
    store: ControlStore,
) -> None:
    # A program that closes its store to end its drainer: the daemon, woken by the close,
    # ends as at a stop, and no read of its opens the store again.
    async def execute(batch: list[Any]) -> list[Any]:
        return [Done() for _ in batch]

    daemon = asyncio.create_task(drain(store, execute, mode="daemon"))
    await store.enqueue("alpha", {"n": 1})
    await until(waiting_on("local"), what="the daemon ran the item and waits for more")
    await store.close()
    summary = await asyncio.wait_for(daemon, 30)
    assert summary.done == 1
    assert not engine_of(store).is_open


async def test_the_lock_survives_the_file_being_opened_and_closed_elsewhere(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "x.lock"
    async with DrainLock(path) as held:
        assert held.acquired
        path.read_bytes()  # somebody else opens, reads and closes the file (a log collector)
        # POSIX record locks would be gone now; this one is not, in this process ...
        async with DrainLock(path) as second:
            assert not second.acquired
        # ... nor for another process.
        probe = subprocess.run(  # noqa: ASYNC221 - a one-off check from another process
            [sys.executable, "-c",
             "import asyncio, sys\n"
             "from asyncplane import DrainLock\n"
             "async def main():\n"
             "    async with DrainLock(sys.argv[1]) as lock:\n"
             "        print(lock.acquired)\n"
             "asyncio.run(main())\n", str(path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert probe.stdout.strip() == "False", probe.stderr
    async with DrainLock(path) as again:
        assert again.acquired


async def test_a_drain_lock_is_released_on_every_exit(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "y.lock"
    lock = DrainLock(path)

    async def stopped_deliberately() -> None:
        async with lock:
            assert lock.acquired
            raise KeyError("deliberate stop")

    with pytest.raises(KeyError):
        await stopped_deliberately()
    assert not lock.acquired
    async with DrainLock(path) as again:
        assert again.acquired


async def _seed(path: str | pathlib.Path) -> None:
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})


# --- daemon mode -----------------------------------------------------------------------------


async def test_daemon_wakes_for_a_deferred_item_when_it_falls_due(
    store: ControlStore, clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {}, not_before=clock.now() + 600)
    seen: asyncio.Queue[int] = asyncio.Queue()

    async def record(batch: list[ClaimedItem]) -> list[Outcome]:
        for claim in batch:
            seen.put_nowait(claim.item_id)
        return [Done() for _ in batch]

    stop = asyncio.Event()
    task = asyncio.create_task(drain(store, record, mode="daemon", stop=stop))

    await until(waiting_on("due"), what="the daemon waits for the due item")
    assert seen.empty()
    clock.advance(600)  # no real time passes: the manual clock wakes the daemon
    assert await asyncio.wait_for(seen.get(), timeout=30) == item_id
    stop.set()
    summary = await task
    assert summary.done == 1


async def test_daemon_wakes_at_once_for_work_enqueued_in_this_process(
    store: ControlStore,
) -> None:
    seen: asyncio.Queue[int] = asyncio.Queue()

    async def record(batch: list[ClaimedItem]) -> list[Outcome]:
        for claim in batch:
            seen.put_nowait(claim.item_id)
        return [Done() for _ in batch]

    stop = asyncio.Event()
    task = asyncio.create_task(drain(store, record, mode="daemon", stop=stop, poll_interval=3600))

    await until(waiting_on("local"), what="the daemon went idle")
    item_id = await store.enqueue("alpha", {})
    assert await asyncio.wait_for(seen.get(), timeout=30) == item_id  # no hour-long poll
    stop.set()
    await task


async def test_daemon_notices_work_from_another_process(store: ControlStore) -> None:
    await store.create_project("p", "P")
    seen: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

    async def record(batch: list[ClaimedItem]) -> list[Outcome]:
        for claim in batch:
            seen.put_nowait((claim.item_id, time.time()))
        return [Done() for _ in batch]

    stop = asyncio.Event()
    task = asyncio.create_task(drain(store, record, mode="daemon", stop=stop, poll_interval=0.05))

    await until(waiting_on("commit"), what="the daemon went idle")
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(WORKER), store.location, "enqueue", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    enqueued = json.loads(out)
    got, at = await asyncio.wait_for(seen.get(), timeout=30)
    assert got == enqueued["item_id"]
    latency = at - enqueued["committed_at"]
    print(f"daemon pickup latency for another process's enqueue: {latency * 1000:.0f} ms")
    stop.set()
    await task


# --- hardening: anyio cancel scopes, bad outcomes, failing settlements, scope ----------------


async def test_an_anyio_task_group_cancel_leaves_nothing_stranded(store: ControlStore) -> None:
    import anyio

    for round_ in range(3):
        ids = [await store.enqueue("alpha", {"round": round_, "n": n}) for n in range(4)]
        started = asyncio.Event()

        async def stuck(
            batch: list[ClaimedItem], started: asyncio.Event = started
        ) -> list[Outcome]:
            started.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async with anyio.create_task_group() as tg:

            async def run_drain(stuck: Any = stuck) -> None:
                await drain(store, stuck, batch_size=4)

            tg.start_soon(run_drain)
            await started.wait()
            tg.cancel_scope.cancel()  # cancels again and again until the drain returns
        rows = [await store.item(i) for i in ids]
        assert [(r["state"], r["attempts"]) for r in rows] == [("deferred", 0)] * 4
        assert await lock_is_free(store)
        finished = await drain(store, all_done)  # clear them for the next round
        assert finished.done == 4
    assert await verify_ledger(store) == []


async def test_a_bad_outcome_raised_by_the_executor_retries_the_batch(
    store: ControlStore,
) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(2)]

    async def careless(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Park(-1) for _ in batch]  # refused as it is built

    summary = await drain(store, careless, batch_size=2, empty_rounds=1)
    assert summary.retried == 2
    assert "Park.delay must be between 0" in (await store.item(ids[0]))["error"]
    with pytest.raises(InvalidInput):
        Offload("")
    with pytest.raises(InvalidInput):
        Retry("x", delay=-5)


async def test_a_store_failure_while_settling_stops_the_drain_and_puts_back(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    class OnceBrokenClock:
        broken = False

        def now(self) -> float:
            if self.broken:
                self.broken = False
                raise OSError("clock lost")
            return clock.now()

    breakable = OnceBrokenClock()
    store: ControlStore = await asyncplane_store_factory("settle.db", clock=breakable)
    await store.create_project("p", "P")
    ids = [await store.enqueue("p", {"n": n}) for n in range(3)]

    async def breaks_then_answers(batch: list[ClaimedItem]) -> list[Outcome]:
        breakable.broken = True  # the first settlement's write round will fail
        return [Done(claim.payload["n"]) for claim in batch]

    with pytest.raises(DrainError, match="settling an outcome failed") as caught:
        await drain(store, breaks_then_answers, batch_size=3)
    assert caught.value.summary.claimed == 3
    states = [(await store.item(i))["state"] for i in ids]
    assert states == ["deferred", "done", "done"]  # the failed one went back, unrun again
    assert (await store.item(ids[0]))["attempts"] == 0
    assert await lock_is_free(store)
    assert await verify_ledger(store) == []


async def test_a_scoped_drain_stays_in_its_scope(
    asyncplane_store_factory: Any, raw_of: Any
) -> None:
    store: ControlStore = await asyncplane_store_factory("scope.db", identity=("task",))
    await store.create_project("mine", "Mine")
    await store.create_project("theirs", "Theirs")
    await store.assign("mine", "alice")
    done_id = await store.enqueue("theirs", {"task": "t"})
    claim = await store.claim("w", project_id="theirs")
    assert claim is not None
    await store.finish(done_id, fence=claim.fence, result="r")
    conn = raw_of(store)
    conn.execute(  # a pending twin in "theirs", as an older enqueuer would have left it
        "INSERT INTO items (project_id, state, payload, fingerprint, created_at, updated_at) "
        "SELECT 'theirs', 'ready', payload, fingerprint, 0, 0 FROM items WHERE item_id = ?",
        (done_id,),
    )
    twin = conn.execute("SELECT max(item_id) FROM items").fetchone()[0]
    conn.execute(
        "INSERT INTO events (item_id, event_type, fence, at) VALUES (?, 'queued', 0, 0)", (twin,)
    )
    await store.enqueue("theirs", {"task": "other"})
    mine = await store.enqueue("mine", {"task": "m"})
    summary = await drain(store, all_done, actor_id="alice", empty_rounds=1)
    assert (summary.claimed, summary.deduplicated, summary.remaining) == (1, 0, 0)
    assert (await store.item(mine))["state"] == "done"
    assert (await store.item(twin))["state"] == "ready"  # not alice's to settle
    everyone = await drain(store, all_done, empty_rounds=1)
    assert everyone.deduplicated == 1


async def test_an_idle_daemon_does_not_poll_with_writes(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A due item held back by its offloaded twin cannot be claimed: the daemon must wait
    # for a change, not run a write round every poll.
    first = await store.enqueue("alpha", {}, fingerprint="same")
    claim = await store.claim("w")
    assert claim is not None
    await store.offload(first, fence=claim.fence, handle="h")
    await store.enqueue("alpha", {}, fingerprint="same", dedup=False, not_before=clock.now() + 1)
    clock.advance(5)
    assert await store.next_due() is None  # held back: nothing a claim could take
    backend: Any = await store._engine.ready()
    if store.backend == "postgresql":
        # Its every-five-seconds look, which is not polling with writes, must not fall
        # inside the window below by chance.
        from asyncplane import _postgres

        monkeypatch.setattr(_postgres, "_SAFETY_POLL_SECONDS", 3600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(drain(store, all_done, mode="daemon", stop=stop, poll_interval=0.02))
    await until(waiting_on("commit"), what="the daemon went idle")
    rounds = backend.writer.rounds
    await asyncio.sleep(0.3)  # a window of fifteen polls, to see that nothing happens
    assert backend.writer.rounds == rounds
    await store.finish(first, fence=claim.fence, result="batch")  # frees the twin ...

    async def twin_done() -> bool:
        return (await store.counts())["done"] == 2

    await until(twin_done, what="the daemon woke and ran the twin")  # ... which then runs
    stop.set()
    summary = await task
    assert summary.done == 1


async def test_an_executor_that_raises_is_logged_with_its_traceback(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    item_id = await store.enqueue("alpha", {})

    async def broken(batch: list[ClaimedItem]) -> list[Outcome]:
        raise KeyError("prompt")

    with caplog.at_level(logging.WARNING, logger="asyncplane.drain"):
        await drain(store, broken, max_iters=1)
    record = next(r for r in caplog.records if "KeyError" in r.getMessage())
    assert record.exc_info is not None and record.exc_info[0] is KeyError
    assert record.item_ids == [item_id]  # type: ignore[attr-defined]
    assert (await store.item(item_id))["error"] == "the executor raised KeyError: 'prompt'"


@pytest.mark.sqlite_only
async def test_a_lock_path_naming_another_file_is_refused_and_the_file_kept(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # The lock's holder line was written over whatever the file held: lock_path given as
    # the database itself wiped the store (13 bytes were left: "host pid N").
    await store.enqueue("alpha", {"n": 1})

    async def done(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    assert store.path is not None
    before = store.path.read_bytes()[:16]
    for own in (store.path, store.path.with_name(store.path.name + "-wal")):
        with pytest.raises(InvalidInput, match="the store's own file"):
            await drain(store, done, lock_path=own)
    assert store.path.read_bytes()[:16] == before == b"SQLite format 3\x00"
    precious = tmp_path / "notes.txt"
    precious.write_text("a file of the user's\n")
    with pytest.raises(InvalidInput, match="holds something else"):
        await drain(store, done, lock_path=precious)
    assert precious.read_text() == "a file of the user's\n"
    dashed = store.path.with_name(store.path.name + "-drain.lock")  # not one of the store's
    assert (await drain(store, done, lock_path=dashed)).done == 1
    await store.enqueue("alpha", {"n": 2})
    assert store.archive_path is not None
    archive = store.archive_path
    for own in (
        archive.with_name(archive.name + ".lock"),  # its purge waited on it for ever
        archive.with_name(archive.name + ".1"),
        archive,
        store.path.with_name(store.path.name + "-combine-7"),  # a board file
    ):
        with pytest.raises(InvalidInput, match="the store's own file"):
            await drain(store, done, lock_path=own)
    # No regular file (a directory; a pipe, as the writers' wake pipes are): refused.
    fifo = tmp_path / "a.fifo"
    os.mkfifo(fifo)
    for odd in (tmp_path, fifo):
        with pytest.raises(InvalidInput, match="not a regular file"):
            await drain(store, done, lock_path=odd)
    # The same file under another name: a hard link to the archive's lock (a file system
    # that ignores case gives another spelling of a name the same way).
    archive_lock = archive.with_name(archive.name + ".lock")
    archive_lock.write_bytes(b"")
    linked = tmp_path / "linked.lock"
    os.link(archive_lock, linked)
    with pytest.raises(InvalidInput, match="the store's own file"):
        await drain(store, done, lock_path=linked)
    lock = tmp_path / "own.lock"
    assert (await drain(store, done, lock_path=lock)).done == 1
    assert (await drain(store, done, lock_path=lock)).done == 0  # its own line: taken again
    assert re.fullmatch(r"\S+ pid \d+\n", lock.read_text())  # one line, from the start
    assert (await store.counts())["done"] == 2


async def test_an_executor_that_cancels_itself_has_its_batch_retried_with_attempts(
    store: ControlStore,
) -> None:
    # A CancelledError of the executor's own (a library's timeout leaking one) ended
    # drain() as if it were cancelled, and parked the batch without spending an attempt:
    # a daemon's task ended quietly, and the item would run and cancel itself for ever.
    item = await store.enqueue("alpha", {"n": 1}, max_attempts=1)
    calls = 0

    async def cancels_itself(batch: list[ClaimedItem]) -> list[Outcome]:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    summary = await drain(store, cancels_itself, empty_rounds=1)
    assert calls == 1 and summary.failed == 1  # its one attempt spent
    row = await store.item(item)
    assert (row["state"], row["attempts"]) == ("failed", 1)
    assert "cancelled, not by the drain" in row["error"]


async def test_a_lost_claims_give_back_pages_through_every_item_it_took(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It listed one page: a lost claim of 10,005 items (batch_size 20,000) gave back the
    # first 10,000, the rest left to their leases (an attempt each). Pages of two here.
    from asyncplane import _outcomes

    monkeypatch.setattr(_outcomes, "MAX_LIST_LIMIT", 2)
    await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
    asked = store.clock.now()
    assert len(await store.claim_batch("lost", 5)) == 5  # its answer lost, say
    summary = _outcomes.DrainSummary()
    given = await _outcomes.give_back_lost_claim(
        store, "lost", asked, (), None, None, summary, "test", logging.getLogger("test")
    )
    assert given == 5 and summary.released == 5
    assert (await store.counts())["claimed"] == 0


async def test_a_renewer_that_ends_cancelled_stops_the_batch_as_a_failure(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The batch's outcome was read from an executor still running once the renewer ended
    # cancelled (a stray CancelledError in it): InvalidStateError, the item left deferred;
    # waited for instead, unrenewed, its items ran twice once their leases lapsed. It
    # stops as at a renewer's failure: DrainError, the batch put back.
    renewer_ends_cancelled(monkeypatch)
    item = await store.enqueue("alpha", {"n": 1})

    async def never_done(batch: list[ClaimedItem]) -> list[Outcome]:
        await asyncio.Event().wait()
        raise AssertionError("cancelled first")

    with pytest.raises(DrainError, match="the lease renewer was cancelled"):
        await asyncio.wait_for(drain(store, never_done, empty_rounds=1), 30)
    assert (await store.item(item))["state"] == "deferred"  # put back, not held


@pytest.mark.parametrize("renewer_fails", [True, False])
async def test_a_cancelled_drain_ends_cancelled_though_the_store_fails_its_put_back(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, renewer_fails: bool
) -> None:
    # The put-back's failure (the server down) took the cancellation's place: drain()
    # raised DrainError (after a renewer's failure) or the StorageError itself.
    from asyncplane import StorageError, _drain

    if renewer_fails:
        renewer_ends_cancelled(monkeypatch)

    async def put_back_fails(self: Any, batch: Any, settled: Any) -> None:
        raise StorageError("the server is down")

    monkeypatch.setattr(_drain._Drain, "_put_back", put_back_fails)
    await store.enqueue("alpha", {"n": 1})
    stopping, stopped = asyncio.Event(), asyncio.Event()

    async def slow_to_stop(batch: list[ClaimedItem]) -> list[Outcome]:
        stopping.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await stopped.wait()  # winds down
            raise
        raise AssertionError("cancelled first")

    draining = asyncio.ensure_future(drain(store, slow_to_stop, empty_rounds=1))
    await cancelled_as_it_winds_down(draining, stopping, stopped)


async def test_a_drain_cancelled_as_its_renewer_stops_ends_cancelled_though_settling_fails(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The batch done, a cancel that arrived while its renewer stopped was lost to the
    # settle's failure (the server down): DrainError instead of the cancellation.
    from asyncplane import StorageError, _drain, _outcomes

    stopping, stopped = asyncio.Event(), asyncio.Event()

    async def slow_to_stop(self: Any, batch: Any) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await stopped.wait()  # winds down
            raise

    async def settle_fails(self: Any, claim: Any, outcome: Any) -> None:
        raise StorageError("the server is down")

    monkeypatch.setattr(_drain._Drain, "_renew", slow_to_stop)
    monkeypatch.setattr(_outcomes.Settler, "settle", settle_fails)
    await store.enqueue("alpha", {"n": 1})

    async def done(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    draining = asyncio.ensure_future(drain(store, done, empty_rounds=1))
    await cancelled_as_it_winds_down(draining, stopping, stopped)  # while the renewer stops


async def test_a_renewer_cancelled_as_its_executor_ends_lets_the_batch_settle(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both ended in the same pass of the loop: the renewer's exception was read, and
    # raised the renewer's CancelledError out of drain(), which nobody had cancelled.
    # The outcome was had under held leases: it is settled as any.
    renewer_ends_cancelled(monkeypatch)  # at its first step, as the executor returns
    item = await store.enqueue("alpha", {"n": 1})

    async def at_once(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    summary = await drain(store, at_once, empty_rounds=1)
    assert summary.done == 1
    assert (await store.item(item))["state"] == "done"


async def test_a_drain_cancelled_as_its_renewers_failure_is_cleaned_up_ends_cancelled(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The clean-up after a renewer's failure (the executor stopped, the batch put back)
    # runs to its end whatever cancels arrive; one that arrived was dropped, and drain()
    # ended with DrainError: its caller's own cancel went unheard.
    renewer_ends_cancelled(monkeypatch)
    item = await store.enqueue("alpha", {"n": 1})
    stopping, stopped = asyncio.Event(), asyncio.Event()

    async def slow_to_stop(batch: list[ClaimedItem]) -> list[Outcome]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopping.set()
            await stopped.wait()  # winds down
            raise
        raise AssertionError("cancelled first")

    draining = asyncio.ensure_future(drain(store, slow_to_stop, empty_rounds=1))
    await cancelled_as_it_winds_down(draining, stopping, stopped)  # (the executor winding down)
    assert (await store.item(item))["state"] == "deferred"  # put back all the same


def renewer_ends_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """drain()'s lease renewer ends cancelled at its first step, not by the drain (a
    stray CancelledError in a store call)."""
    from asyncplane import _drain

    async def renewer_cancelled(self: Any, batch: Any) -> None:
        raise asyncio.CancelledError

    monkeypatch.setattr(_drain._Drain, "_renew", renewer_cancelled)


async def cancelled_as_it_winds_down(
    draining: asyncio.Future[Any], stopping: asyncio.Event, stopped: asyncio.Event
) -> None:
    """Cancel the drain once something of it winds down (``stopping``), then let that end
    (``stopped``): the drain must end cancelled."""
    await stopping.wait()
    draining.cancel()
    await asyncio.sleep(0)  # (the cancel reaches the drain's task first)
    stopped.set()
    with pytest.raises(asyncio.CancelledError):
        await draining
