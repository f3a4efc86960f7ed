"""The writer task: group commit with per-request outcomes, and cancellation that never
decides what is saved."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from _signals import until
from asyncplane import (
    ControlStore,
    DatabaseLocked,
    FenceRejected,
    InvalidInput,
    StorageError,
    StoreClosed,
    _postgres_writer,
    _writer,
    verify_ledger,
)
from asyncplane.testing import ManualClock

DRIVER_ERRORS = (sqlite3.Error, asyncpg.PostgresError)


async def writer_of(store: ControlStore) -> Any:
    """The store's writer: the SQLite one, or the PostgreSQL one (the same contract)."""
    backend: Any = await store._engine.ready()
    writer = backend.writer
    assert isinstance(writer, (_writer.Writer, _postgres_writer.Writer))
    return writer


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


@pytest.fixture
def lock_holder(store: ControlStore) -> Iterator[sqlite3.Connection]:
    """A second connection that can hold the database's write lock, as another process would."""
    conn = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
    yield conn
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    conn.close()


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
        writer.submit(broken),
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


async def test_a_refusal_after_writing_is_rolled_back(store: ControlStore) -> None:
    writer = await writer_of(store)

    refuses_late = operation(
        store,
        "INSERT INTO projects VALUES ('sneaky', 'S', 'open', 0)",
        then=InvalidInput("changed my mind"),
    )

    results = await asyncio.gather(
        writer.submit(refuses_late), store.enqueue("alpha", {}), return_exceptions=True
    )
    assert isinstance(results[0], InvalidInput)
    assert isinstance(results[1], int)
    assert [p["project_id"] for p in await store.projects()] == ["alpha"]


@pytest.mark.sqlite_only  # SQLite's one write lock and busy timeout
async def test_lock_timeout_is_a_typed_error_and_writes_nothing(
    asyncplane_store_factory: Any,
) -> None:
    store = await asyncplane_store_factory(busy_timeout=0.2)
    await store.create_project("p", "P")
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(DatabaseLocked) as caught:
            await store.enqueue("p", {})
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert await store.enqueue("p", {}) == 1  # nothing half-written by the failed call


@pytest.mark.sqlite_only  # pauses a round by holding SQLite's write lock
async def test_claim_cancelled_before_its_round_takes_nothing(
    store: ControlStore, lock_holder: sqlite3.Connection
) -> None:
    await store.enqueue("alpha", {})
    await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    blocker = asyncio.ensure_future(store.enqueue("alpha", {}))  # occupies the writer
    await until(lambda: writer.in_flight == 1)
    doomed = asyncio.ensure_future(store.claim(owner="doomed"))
    await until(lambda: len(writer._pending) == 1)
    doomed.cancel()
    lock_holder.execute("COMMIT")
    await blocker
    with pytest.raises(asyncio.CancelledError):
        await doomed
    claim = await store.claim(owner="next")
    assert claim is not None and claim.fence == 1 and claim.item_id == 1
    assert all(e["owner"] != "doomed" for e in await store.events(1))
    assert await verify_ledger(store) == []


@pytest.mark.sqlite_only  # pauses a round by holding SQLite's write lock
async def test_claim_cancelled_during_its_round_leaves_an_item_its_lease_returns(
    store: ControlStore, lock_holder: sqlite3.Connection, clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    doomed = asyncio.ensure_future(store.claim(owner="doomed"))
    await until(lambda: writer.in_flight == 1)  # on the thread, waiting for the lock
    doomed.cancel()
    lock_holder.execute("COMMIT")
    with pytest.raises(asyncio.CancelledError):
        await doomed  # returns at once; the round goes on without its caller
    await writer.submit(operation(store))  # a barrier: every earlier round has ended
    # The round committed the claim; nobody holds its fence, so the lease returns it.
    assert (await store.item(item_id))["owner"] == "doomed"
    assert await verify_ledger(store) == []
    assert await store.claim(owner="next") is None
    clock.advance(store.lease_seconds + 1)
    taken = await store.claim(owner="next")
    assert taken is not None and taken.item_id == item_id and taken.fence == 2
    assert await verify_ledger(store) == []


@pytest.mark.sqlite_only  # pauses a round by holding SQLite's write lock
async def test_cancelled_writer_finishes_its_round_and_reports_it(
    store: ControlStore, lock_holder: sqlite3.Connection
) -> None:
    await store.enqueue("alpha", {})
    writer = await writer_of(store)
    lock_holder.execute("BEGIN IMMEDIATE")
    claim = asyncio.ensure_future(store.claim(owner="w"))
    await until(lambda: writer.in_flight == 1)
    later = asyncio.ensure_future(store.enqueue("alpha", {"late": True}))
    await until(lambda: len(writer._pending) == 1)
    assert writer._task is not None
    writer._task.cancel()  # as an event loop shutting down would
    lock_holder.execute("COMMIT")
    got = await claim  # the round ran to its end and its caller learned the result
    assert got is not None and got.fence == 1
    with pytest.raises(StoreClosed):
        await later  # never started: refused, not lost silently
    with pytest.raises(asyncio.CancelledError):
        await writer._task
    await store.close()
    await store.open()
    assert (await store.item(got.item_id))["state"] == "claimed"
    assert len(await store.events(got.item_id)) == 2
    assert await verify_ledger(store) == []


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
    # A database fault for the second item only, as a trigger raising inside its UPDATE.
    if raw.backend == "sqlite":
        raw.execute(
            f"CREATE TRIGGER fault BEFORE UPDATE ON items WHEN OLD.item_id = {ids[1]} "
            "BEGIN SELECT RAISE(ABORT, 'disk trouble'); END"
        )
    else:
        raw.execute(
            "CREATE FUNCTION fault() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'disk trouble'; END $$"
        )
        raw.execute(
            f"CREATE TRIGGER fault BEFORE UPDATE ON items FOR EACH ROW "
            f"WHEN (OLD.item_id = {ids[1]}) EXECUTE FUNCTION fault()"
        )
    writer = await writer_of(store)
    rounds = writer.rounds
    results = await asyncio.gather(
        *(store.finish(c.item_id, fence=c.fence) for c in claims if c), return_exceptions=True
    )
    assert writer.rounds == rounds + 1  # one round, run again inside it member by member
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], StorageError) and "disk trouble" in str(results[1])
    assert [(await store.item(i))["state"] for i in ids] == ["done", "claimed", "done"]
    raw.execute("DROP TRIGGER fault" + (" ON items" if raw.backend == "postgresql" else ""))
    assert await verify_ledger(store) == []
