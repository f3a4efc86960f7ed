"""The defects the fault campaign found, each pinned by a test that failed before its fix.

1. A cancelled drain lock take (a lock file, or PostgreSQL's advisory lock) never leaves
   the lock held.
2-3. Text that cannot be encoded (a lone surrogate) is a typed error before anything is
   written, and an executor that produces it cannot wedge drain().
4. Numbers past a float's range, and ints past any reader's digit limit, are typed errors.
5. Payloads have a documented nesting limit; a stored payload this process cannot decode
   is retried with the reason and never strands its batch.
6. A path that is not a regular file (a FIFO) is refused, read-only or not, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from _signals import cancelled_cause, until
from asyncplane import (
    ArchiveError,
    ClaimedItem,
    ControlStore,
    Done,
    DrainLock,
    Failed,
    InvalidInput,
    InvalidPayload,
    NotAnAsyncplaneDatabase,
    Outcome,
    Park,
    Retry,
    StorageError,
    drain,
    fingerprint,
    verify_ledger,
)
from asyncplane._store import engine_of
from asyncplane._validate import MAX_INT_DIGITS, MAX_JSON_DEPTH
from asyncplane.testing import ManualClock

#: What ``surrogateescape`` decoding of an undecodable byte gives.
LONE = b"r-\xff".decode("utf-8", "surrogateescape")


def nested(depth: int) -> dict[str, Any]:
    """A payload nested ``depth`` levels deep (the payload itself is level 1)."""
    payload: dict[str, Any] = {}
    for _ in range(depth - 1):
        payload = {"x": payload}
    return payload


async def nothing_written(store: ControlStore, call: Callable[[], Awaitable[Any]]) -> Exception:
    """Run a call that must be refused; return its error after checking nothing changed."""
    before = await store.counts()
    with pytest.raises(InvalidInput) as refused:
        await call()
    assert await store.counts() == before
    return refused.value


# --- 1. the drain lock under cancellation ------------------------------------------------


async def test_a_cancelled_lock_file_take_never_keeps_the_lock(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "drain.lock"

    async def take() -> None:
        async with DrainLock(path):
            pass

    for i in range(4000):
        task = asyncio.create_task(take())
        # Cancel at every point of the take: before its thread starts, while it runs, after.
        if i % 2:
            await asyncio.sleep(0.00005 * (i % 8))
        else:
            for _ in range(i % 6):
                await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with DrainLock(path) as probe:
            assert probe.acquired, f"the lock leaked at round {i}"


@pytest.mark.postgresql_only
async def test_a_cancelled_advisory_lock_take_never_keeps_the_lock(store: ControlStore) -> None:
    async def take() -> None:
        async with store._engine.drain_guard():
            pass

    for i in range(120):
        task = asyncio.create_task(take())
        for _ in range(i % 12):
            await asyncio.sleep(0)
        if i % 4 == 0:
            await asyncio.sleep(0.0005 * (i % 5))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with store._engine.drain_guard() as acquired:
            assert acquired, f"the advisory lock leaked at round {i}"


# --- 2-3. text that cannot be encoded ------------------------------------------------------


async def test_lone_surrogates_are_refused_everywhere_before_anything_is_written(
    store: ControlStore,
) -> None:
    await nothing_written(store, lambda: store.enqueue("alpha", {"text": LONE}))
    await nothing_written(store, lambda: store.enqueue("alpha", {LONE: 1}))
    await nothing_written(store, lambda: store.enqueue("alpha", {"deep": [{"x": [LONE]}]}))
    await nothing_written(store, lambda: store.enqueue_many("alpha", [{}, {"t": LONE}]))
    await nothing_written(store, lambda: store.create_project("beta", "Beta " + LONE))
    await nothing_written(store, lambda: store.enqueue("alpha", {}, fingerprint=LONE))
    with pytest.raises(InvalidInput):
        fingerprint("a", LONE)
    await store.enqueue("alpha", {"n": 1})
    claim = await store.claim("w")
    assert claim is not None
    for call in (
        lambda: store.finish(claim.item_id, fence=claim.fence, result={"r": LONE}),
        lambda: store.finish(claim.item_id, fence=claim.fence, result=LONE),
        lambda: store.finish(claim.item_id, fence=claim.fence, status="failed", error=LONE),
        lambda: store.retry(claim.item_id, fence=claim.fence, error="x" + LONE),
        lambda: store.offload(claim.item_id, fence=claim.fence, handle=LONE),
    ):
        error = await nothing_written(store, call)
        assert "surrogate" in str(error)
    # The claim is still valid: nothing above touched it.
    await store.finish(claim.item_id, fence=claim.fence, result="ok")
    assert await verify_ledger(store) == []


async def test_an_executor_raising_undecodable_text_cannot_wedge_drain(
    store: ControlStore,
) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(4)]

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        raise RuntimeError("cannot open " + LONE)

    summary = await drain(store, execute, max_iters=1)
    assert (summary.claimed, summary.retried) == (4, 4)
    for item_id in ids:
        item = await store.item(item_id)
        assert item["state"] == "deferred"
        assert "cannot open r-\\udcff" in item["error"]  # shown, not lost
    assert await verify_ledger(store) == []


async def test_outcomes_carrying_undecodable_text_settle_with_their_neighbours(
    store: ControlStore,
) -> None:
    for n in range(5):
        await store.enqueue("alpha", {"n": n})

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        by_n: dict[int, Outcome] = {
            0: Failed("bad " + LONE),
            1: Retry("flaky " + LONE),
            2: Done({"answer": LONE}),
            3: Done({"deep": nested(MAX_JSON_DEPTH + 5)}),
        }
        return [by_n.get(claim.payload["n"], Done("fine")) for claim in batch]

    summary = await drain(store, execute, max_iters=1)
    assert (summary.done, summary.failed, summary.retried) == (1, 3, 1)
    states = {item["payload"]["n"]: item for item in await all_items(store)}
    assert states[0]["state"] == "failed" and "bad r-\\udcff" in states[0]["error"]
    assert states[1]["state"] == "deferred" and "flaky r-\\udcff" in states[1]["error"]
    assert states[2]["state"] == "failed" and "surrogate" in states[2]["error"]
    assert states[3]["state"] == "failed" and "nested" in states[3]["error"]
    assert states[4]["state"] == "done"
    assert await verify_ledger(store) == []


async def test_an_exception_whose_str_raises_still_settles(store: ControlStore) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    await store.enqueue("alpha", {})

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        raise Unprintable

    summary = await drain(store, execute, max_iters=1)
    assert summary.retried == 1
    [item] = await all_items(store)
    assert "Unprintable" in item["error"]


async def all_items(store: ControlStore) -> list[dict[str, Any]]:
    counts = await store.counts()
    return [await store.item(i) for i in range(1, sum(counts.values()) + 1)]


# --- 4. numbers out of range -------------------------------------------------------------

HUGE = 10**400


async def test_ints_past_a_floats_range_are_out_of_range_not_overflow(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    for call in (
        lambda: store.enqueue("alpha", {}, sla=HUGE),
        lambda: store.enqueue("alpha", {}, not_before=HUGE),
        lambda: store.enqueue("alpha", {}, priority=HUGE),
        lambda: store.enqueue("alpha", {}, max_attempts=HUGE),
        lambda: store.claim("w", lease_seconds=HUGE),
        lambda: store.claim_batch("w", HUGE),
        lambda: store.purge(HUGE, archive_path=tmp_path / "a.jsonl"),
        lambda: store.dedup_pending_against_done(HUGE),
        lambda: store.item(HUGE),
    ):
        await nothing_written(store, call)
    await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    for call in (
        lambda: store.renew(claim.item_id, fence=claim.fence, lease_seconds=HUGE),
        lambda: store.retry(claim.item_id, fence=claim.fence, delay=HUGE),
        lambda: store.park(claim.item_id, fence=claim.fence, delay=HUGE),
        lambda: store.renew(claim.item_id, fence=HUGE),
    ):
        await nothing_written(store, call)
    for make in (lambda: Retry("x", delay=HUGE), lambda: Park(HUGE)):
        with pytest.raises(InvalidInput):
            make()
    for option in (
        "lease_seconds", "busy_timeout", "retry_backoff", "retry_backoff_max", "retention",
        "archive_max_mb", "purge_min_interval_s", "max_payload_bytes", "max_batch",
        "purge_chunk", "read_connections", "max_attempts",
    ):  # fmt: skip
        with pytest.raises(InvalidInput):
            ControlStore(tmp_path / "x.db", **{option: HUGE})
    for option in ("max_iters", "batch_size", "poll_interval"):
        with pytest.raises(InvalidInput):
            await drain(store, lambda batch: asyncio.sleep(0, []), **{option: HUGE})


async def test_ints_every_reader_can_decode_are_the_limit(store: ControlStore) -> None:
    longest = int("9" * MAX_INT_DIGITS)
    item_id = await store.enqueue("alpha", {"n": longest, "m": -longest})
    assert (await store.item(item_id))["payload"]["n"] == longest
    error = await nothing_written(store, lambda: store.enqueue("alpha", {"n": longest + 1}))
    assert isinstance(error, InvalidPayload) and f"{MAX_INT_DIGITS} digits" in str(error)
    await nothing_written(store, lambda: store.enqueue("alpha", {"n": 10**5000}))


#: A payload no Python decodes at its default int-to-str limit (4,300 digits).
POISON = '{"n":' + "7" * 5000 + "}"


async def test_a_claim_cancelled_while_it_sets_a_payload_aside_gives_the_rest_back(
    store: ControlStore, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set-aside (a retry with the reason) runs to its end, the cancellation is not
    swallowed, and the items the caller will now never see are given back at once."""
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    raw.execute("UPDATE items SET payload = ? WHERE item_id = ?", (POISON, ids[1]))
    backend = await engine_of(store).ready()
    retry = backend.retry
    tasks: list[asyncio.Task[Any]] = []

    def retry_then_cancel(op: Any) -> Any:
        tasks[0].cancel()  # the caller is cancelled while the set-aside is on its way
        return retry(op)

    monkeypatch.setattr(backend, "retry", retry_then_cancel)
    tasks.append(asyncio.create_task(store.claim_batch("gone", 10)))
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    monkeypatch.undo()
    await store.assign("alpha", "barrier")  # a write behind the give-back
    poisoned = [e["event_type"] for e in await store.events(ids[1])]
    assert poisoned == ["queued", "claimed", "retried"]
    for item_id in (ids[0], ids[2]):
        types = [e["event_type"] for e in await store.events(item_id)]
        assert types == ["queued", "claimed", "released"], item_id
    assert (await store.counts())["claimed"] == 0
    assert await verify_ledger(store) == []


async def test_a_set_aside_that_fails_after_a_cancel_still_gives_the_rest_back(
    store: ControlStore, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller is cancelled while a payload is set aside, and the set-aside then fails
    (a bug in it, say): the call ends cancelled, the failure as the cause, and the items
    the caller will never see still go back at once."""
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    raw.execute("UPDATE items SET payload = ? WHERE item_id = ?", (POISON, ids[1]))
    backend = await engine_of(store).ready()
    tasks: list[asyncio.Task[Any]] = []

    async def cancel_then_fail(op: Any) -> Any:
        tasks[0].cancel()
        await asyncio.sleep(0)  # the cancellation arrives while the set-aside is on its way
        raise RuntimeError("the set-aside broke")

    monkeypatch.setattr(backend, "retry", cancel_then_fail)
    tasks.append(asyncio.create_task(store.claim_batch("gone", 10)))
    with pytest.raises(asyncio.CancelledError) as caught:
        await tasks[0]
    monkeypatch.undo()
    assert isinstance(cancelled_cause(caught.value), RuntimeError)
    await store.assign("alpha", "barrier")  # a write behind the give-back
    for item_id in (ids[0], ids[2]):
        types = [e["event_type"] for e in await store.events(item_id)]
        assert types == ["queued", "claimed", "released"], item_id
    # The one whose set-aside broke waits out its lease, as before.
    assert (await store.counts())["claimed"] == 1
    assert [e["event_type"] for e in await store.events(ids[1])] == ["queued", "claimed"]
    assert await verify_ledger(store) == []


# --- 5. nesting ------------------------------------------------------------------------------


async def test_payloads_have_a_nesting_limit(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", nested(MAX_JSON_DEPTH))
    assert (await store.item(item_id))["payload"] == nested(MAX_JSON_DEPTH)
    for depth in (MAX_JSON_DEPTH + 1, 990, 5000):
        error = await nothing_written(store, lambda d=depth: store.enqueue("alpha", nested(d)))
        assert isinstance(error, InvalidPayload) and "nested" in str(error)
    deep_list: list[Any] = []
    for _ in range(MAX_JSON_DEPTH):
        deep_list = [deep_list]
    await nothing_written(store, lambda: store.enqueue("alpha", {"x": deep_list}))


async def test_a_payload_this_process_cannot_decode_never_strands_its_batch(
    store: ControlStore, raw: Any, clock: ManualClock
) -> None:
    """A stored payload written before today's limits (or by hand) with an int longer than
    this interpreter will decode: the claim retries that item, with the reason, and hands
    out the rest of the batch."""
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(3)]
    poison = ids[1]
    raw.execute("UPDATE items SET payload = ? WHERE item_id = ?", (POISON, poison))
    batch = await store.claim_batch("w", 10)
    assert [claim.item_id for claim in batch] == [ids[0], ids[2]]
    history = await store.events(poison)
    assert [event["event_type"] for event in history] == ["queued", "claimed", "retried"]
    assert "cannot be decoded" in history[-1]["detail"]["error"]
    with pytest.raises(StorageError, match="cannot be decoded"):
        await store.item(poison)  # reading it says why, as a StorageError
    # A drain takes its neighbours through; the poison item ends failed within its budget.
    for claim in batch:
        await store.finish(claim.item_id, fence=claim.fence)
    assert await verify_ledger(store) == []


async def test_drain_settles_the_neighbours_of_an_undecodable_payload(
    asyncplane_store_factory: Any, raw_of: Any, clock: ManualClock
) -> None:
    store = await asyncplane_store_factory(max_attempts=2, retry_backoff=0)
    await store.create_project("alpha", "Alpha")
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(4)]
    raw = raw_of(store)
    raw.execute("UPDATE items SET payload = ? WHERE item_id = ?", (POISON, ids[0]))

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done(claim.payload["n"]) for claim in batch]

    summary = await drain(store, execute, empty_rounds=1)
    assert summary.done == 3
    counts = await store.counts()
    assert (counts["done"], counts["failed"], counts["claimed"]) == (3, 1, 0)
    assert await verify_ledger(store) == []


# --- 6. paths that are not regular files -----------------------------------------------------


@pytest.mark.parametrize("read_only", [True, False])
async def test_a_fifo_is_refused_at_once(tmp_path: pathlib.Path, read_only: bool) -> None:
    fifo = tmp_path / "not-a-store"
    os.mkfifo(fifo)
    with pytest.raises(NotAnAsyncplaneDatabase, match="FIFO"):
        await asyncio.wait_for(ControlStore(fifo, read_only=read_only).open(), 30)


async def test_a_directory_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(NotAnAsyncplaneDatabase, match="directory"):
        await ControlStore(tmp_path).open()


# --- a full archive is an asyncplane error ---------------------------------------------------


async def test_an_archive_that_cannot_be_written_is_an_archive_error(
    store: ControlStore, clock: ManualClock, tmp_path: pathlib.Path
) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    await store.finish(item_id, fence=claim.fence)
    clock.advance(10)
    with pytest.raises(ArchiveError) as refused:
        await store.purge(1, archive_path=tmp_path / "missing" / "archive.jsonl")
    assert isinstance(refused.value.__cause__, OSError)
    assert (await store.item(item_id))["state"] == "done"  # nothing deleted


async def test_paths_with_nul_are_typed_errors(store: ControlStore, tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidInput, match="NUL"):
        ControlStore(str(tmp_path / "a\x00b.db"))
    with pytest.raises(InvalidInput, match="NUL"):
        await drain(store, lambda batch: asyncio.sleep(0, []), lock_path="drain\x00.lock")
    with pytest.raises(InvalidInput, match="NUL"):
        await store.purge(1, archive_path="archive\x00.jsonl")


# --- a claim that fails an exhausted lapsed claim frees its twins at once ------------------


async def test_failing_an_exhausted_twin_frees_its_waiting_twin_in_the_same_claim(
    store: ControlStore, clock: ManualClock
) -> None:
    """Found by the state machine on PostgreSQL: a claim reads its candidates, fails the
    lapsed claims with no attempt left, then claims. A ready twin of such a claim was held
    back by a snapshot that still showed its twin running; SQLite, which fails first and
    reads after, handed it out. Both must: the twin stopped running in this transaction."""
    running = await store.enqueue("alpha", {"n": 1}, fingerprint="x", max_attempts=1)
    first = await store.claim("w1")
    assert first is not None and first.item_id == running
    twin = await store.enqueue("alpha", {"n": 2}, fingerprint="x", dedup=False, priority=5)
    assert await store.claim("w2") is None  # its twin runs
    clock.advance(store.lease_seconds + 1)  # the lease lapses, with no attempt left
    claimed = await store.claim("w2")
    assert claimed is not None and claimed.item_id == twin
    assert (await store.item(running))["state"] == "failed"
    assert await verify_ledger(store) == []


# --- a lost PostgreSQL connection ------------------------------------------------------------


@pytest.mark.postgresql_only
async def test_a_write_connection_the_server_ended_is_replaced_before_the_next_call(
    store: ControlStore, raw: Any
) -> None:
    """The writer watches its session: one the server ends while the store is idle fails
    the writer at once, so the next calls reconnect; none of them meets the dead
    connection (StorageError) or a writer still stopping (StoreClosed)."""
    backend: Any = await store._engine.ready()
    pid = backend.writer._conn.get_server_pid()
    raw.execute("SELECT pg_terminate_backend(?)", (pid,))
    await until(lambda: backend.writer.failed, what="the writer noticed its session ended")
    first = await store.enqueue("alpha", {"n": 1})
    second = await store.enqueue("alpha", {"n": 2})
    assert second == first + 1
    assert (await store.counts())["ready"] == 2
