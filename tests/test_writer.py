"""The writer task: group commit with per-request outcomes, and cancellation that never
decides what is saved."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import sys
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from asyncplane import (
    ControlStore,
    FenceRejected,
    InvalidInput,
    StorageError,
    StoreClosed,
    _loops,
    _postgres_writer,
    _writer,
    verify_ledger,
)

DRIVER_ERRORS = (sqlite3.Error, asyncpg.PostgresError)


async def writer_of(store: ControlStore) -> Any:
    """The store's writer: the SQLite one, or the PostgreSQL one (the same contract)."""
    backend: Any = await store._engine.ready()
    writer = backend.writer
    assert isinstance(writer, (_writer.Writer, _postgres_writer.Writer))
    return writer


async def submitted(writer: Any, op: Any) -> Any:
    """``op``'s outcome, submitted when gather starts this (in turn with the store's calls
    beside it: ``writer.submit`` itself queues at once, as a rule)."""
    return await writer.submit(op)


def operation(store: ControlStore, *statements: str, then: BaseException | None = None) -> Any:
    """A raw write operation for the store's writer: run ``statements``, then raise."""
    if store.backend == "sqlite":

        def op(db: sqlite3.Connection, now: float) -> None:
            for statement in statements:
                db.execute(statement)
            if then is not None:
                raise then

        return op

    async def pg_op(conn: Any, now: float) -> None:
        for statement in statements:
            await conn.execute(statement)
        if then is not None:
            raise then

    return pg_op


@contextlib.contextmanager
def update_fault(raw: Any, item_id: int) -> Iterator[None]:
    """A database fault for one item only, while inside: a trigger raising 'disk trouble'
    in any UPDATE of its row."""
    if raw.backend == "sqlite":
        raw.execute(
            f"CREATE TRIGGER fault BEFORE UPDATE ON items WHEN OLD.item_id = {item_id} "
            "BEGIN SELECT RAISE(ABORT, 'disk trouble'); END"
        )
    else:
        raw.execute(
            "CREATE OR REPLACE FUNCTION fault() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'disk trouble'; END $$"
        )
        raw.execute(
            f"CREATE TRIGGER fault BEFORE UPDATE ON items FOR EACH ROW "
            f"WHEN (OLD.item_id = {item_id}) EXECUTE FUNCTION fault()"
        )
    try:
        yield
    finally:
        raw.execute("DROP TRIGGER fault" + (" ON items" if raw.backend == "postgresql" else ""))


async def test_concurrent_requests_share_commits(store: ControlStore) -> None:
    writer = await writer_of(store)
    rounds, requests = writer.rounds, writer.requests
    await asyncio.gather(*(store.enqueue("alpha", {"n": n}) for n in range(64)))
    assert writer.requests - requests == 64
    assert writer.rounds - rounds < 64 // 4  # most requests rode in a shared transaction
    assert await verify_ledger(store) == []


async def test_one_refusal_does_not_spoil_its_round(store: ControlStore) -> None:
    for n in range(3):
        await store.enqueue("alpha", {"n": n})
    claims = [await store.claim(owner="w") for _ in range(3)]
    assert all(claims)
    writer = await writer_of(store)
    rounds = writer.rounds
    results = await asyncio.gather(
        store.finish(claims[0].item_id, fence=claims[0].fence),  # type: ignore[union-attr]
        store.finish(claims[1].item_id, fence=claims[1].fence + 1),  # type: ignore[union-attr]
        store.finish(claims[2].item_id, fence=claims[2].fence),  # type: ignore[union-attr]
        return_exceptions=True,
    )
    assert writer.rounds == rounds + 1  # all three in one transaction
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], FenceRejected)
    states = [(await store.item(c.item_id))["state"] for c in claims]  # type: ignore[union-attr]
    assert states == ["done", "claimed", "done"]


async def test_a_database_error_mid_round_undoes_only_its_request(store: ControlStore) -> None:
    writer = await writer_of(store)

    broken = operation(
        store,
        "INSERT INTO projects VALUES ('half-written', 'H', 'open', 0)",
        "INSERT INTO no_such_table VALUES (1)",
    )

    rounds = writer.rounds
    results = await asyncio.gather(
        store.enqueue("alpha", {"n": 1}),
        submitted(writer, broken),
        store.enqueue("alpha", {"n": 2}),
        return_exceptions=True,
    )
    assert isinstance(results[0], int) and isinstance(results[2], int)
    assert isinstance(results[1], StorageError)
    assert isinstance(results[1].__cause__, DRIVER_ERRORS)
    assert writer.rounds == rounds + 1
    assert [p["project_id"] for p in await store.projects()] == ["alpha"]  # rolled back
    assert (await store.item(results[0]))["payload"] == {"n": 1}
    assert (await store.item(results[2]))["payload"] == {"n": 2}
    assert await verify_ledger(store) == []


async def test_a_bug_in_one_operation_reaches_only_its_caller(store: ControlStore) -> None:
    # Not a refusal, not a database error: a plain exception (a bug) in one operation. Its
    # caller gets that exception; what it wrote is undone; the others of its round, and
    # one alone in its round, fare as without it.
    writer = await writer_of(store)

    def buggy() -> Any:
        return operation(
            store,
            "INSERT INTO projects VALUES ('half-written', 'H', 'open', 0)",
            then=ZeroDivisionError("a bug"),
        )

    rounds = writer.rounds
    results = await asyncio.gather(
        store.enqueue("alpha", {"n": 1}),
        submitted(writer, buggy()),
        store.enqueue("alpha", {"n": 2}),
        return_exceptions=True,
    )
    assert writer.rounds == rounds + 1
    assert isinstance(results[0], int) and isinstance(results[2], int)
    assert isinstance(results[1], ZeroDivisionError)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        await writer.submit(buggy())  # alone in its round
    assert [p["project_id"] for p in await store.projects()] == ["alpha"]  # rolled back
    assert (await store.item(results[2]))["payload"] == {"n": 2}
    assert await verify_ledger(store) == []


async def test_a_refusal_after_writing_is_rolled_back(store: ControlStore) -> None:
    writer = await writer_of(store)

    refuses_late = operation(
        store,
        "INSERT INTO projects VALUES ('sneaky', 'S', 'open', 0)",
        then=InvalidInput("changed my mind"),
    )

    results = await asyncio.gather(
        submitted(writer, refuses_late), store.enqueue("alpha", {}), return_exceptions=True
    )
    assert isinstance(results[0], InvalidInput)
    assert isinstance(results[1], int)
    assert [p["project_id"] for p in await store.projects()] == ["alpha"]


async def test_close_serves_every_queued_write_first(store: ControlStore) -> None:
    pending = [asyncio.ensure_future(store.enqueue("alpha", {"n": n})) for n in range(50)]
    await asyncio.sleep(0)
    await store.close()
    ids = [await p for p in pending]
    assert len(set(ids)) == 50
    await store.open()
    assert len(await verify_ledger(store)) == 0
    assert (await store.item(ids[-1]))["payload"] == {"n": 49}


async def test_a_broken_connection_stops_the_writer_loudly(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    writer = await writer_of(store)
    await writer._conn.close()  # pull the connection out from under the writer
    with pytest.raises(StorageError, match="write connection failed"):
        await store.enqueue("alpha", {})
    assert writer._task is not None
    await asyncio.wait([writer._task])
    assert "asyncplane writer" in caplog.text
    if store.backend == "postgresql":
        # A server connection is lost in the ordinary course of things (a restart, a
        # failover): the store opens afresh on next use.
        assert isinstance(await store.enqueue("alpha", {}), int)
        return
    with pytest.raises(StoreClosed, match="writer stopped") as caught:
        await store.enqueue("alpha", {})
    assert caught.value.__cause__ is not None


async def test_claims_meeting_in_one_round_are_decided_together(store: ControlStore) -> None:
    # Five claims that queue up behind one round run as one combined claim: distinct
    # items, each with its own owner and fence, one item per fingerprint, in claim order.
    for n in range(3):
        await store.enqueue("alpha", {"n": n}, fingerprint="twin", dedup=False)
    others = [await store.enqueue("alpha", {"n": n}) for n in range(3, 6)]
    writer = await writer_of(store)
    rounds = writer.rounds
    got = await asyncio.gather(*(store.claim(owner=f"w{n}") for n in range(5)))
    assert writer.rounds == rounds + 1
    claimed = [c for c in got if c is not None]
    assert [c.item_id for c in claimed] == [1, *others]  # one twin only, then the rest
    assert [c.owner for c in claimed] == ["w0", "w1", "w2", "w3"]
    assert got[4] is None
    for claim in claimed:
        events = await store.events(claim.item_id)
        assert (events[-1]["event_type"], events[-1]["owner"]) == ("claimed", claim.owner)
    assert await verify_ledger(store) == []


async def test_one_failing_member_of_grouped_finishes_fails_alone(
    store: ControlStore, raw: Any
) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(3)]
    claims = [await store.claim(owner="w") for _ in ids]
    writer = await writer_of(store)
    rounds = writer.rounds
    with update_fault(raw, ids[1]):
        results = await asyncio.gather(
            *(store.finish(c.item_id, fence=c.fence) for c in claims if c),
            return_exceptions=True,
        )
    assert writer.rounds == rounds + 1  # one round, run again inside it member by member
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], StorageError) and "disk trouble" in str(results[1])
    assert [(await store.item(i))["state"] for i in ids] == ["done", "claimed", "done"]
    assert await verify_ledger(store) == []


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
async def test_the_write_path_runs_on_the_loop_it_is_given(request: pytest.FixtureRequest) -> None:
    """This module runs on asyncio's loop and on uvloop (tests/conftest.py, BOTH_LOOPS)."""
    assert f"[{_loops.running()}" in request.node.name


def test_the_lock_is_held_to_its_release_not_to_when_the_thread_runs_again(
    tmp_path: Any,
) -> None:
    # On a busy machine the connection's thread may not run again for a while after it
    # lets go: the time held (the probe's "held N% of the drain") must end at the release.
    from asyncplane import _write_lock, _writer

    released_at: list[float] = []

    class Descheduled(_write_lock.WriteLock):
        def release(self) -> None:
            super().release()
            released_at.append(time.perf_counter())
            time.sleep(0.05)  # the thread, descheduled right after the unlock

    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    lock = Descheduled(fd)
    db = sqlite3.connect(tmp_path / "db")
    try:
        assert lock.acquire()
        with _writer._holding(lock, db, None) as held:
            pass
        assert held.released <= released_at[0] < time.perf_counter() - 0.05
    finally:
        db.close()
        lock.close()


def test_a_round_failing_for_the_stores_own_reason_keeps_its_class_and_words() -> None:
    # Outside any operation a StorageError was wrapped ("the write round failed: ..."), and
    # then (a first fix) made a plain StorageError: `except DatabaseLocked` missed it.
    from asyncplane import DatabaseLocked, StorageError, _write_queue

    locked = DatabaseLocked("the write lock could not be had")
    heard = _write_queue.round_failed(locked)
    assert type(heard) is DatabaseLocked and str(heard) == str(locked)
    assert heard is not locked and heard.__cause__ is locked  # one per caller, told why
    other = _write_queue.round_failed(OSError("disk"))
    assert type(other) is StorageError and str(other) == "the write round failed: OSError('disk')"
