"""The ledger: every transition is an event, and verify_ledger finds every disagreement.

Each tamper test changes the database behind the store's back with a plain sqlite3
connection and checks that exactly the expected kind of problem, and no other, is found.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sqlite3
from typing import Any

import pytest

from asyncplane import (
    LEDGER_PROBLEM_KINDS,
    ClaimedItem,
    ControlStore,
    InvalidInput,
    Job,
    LedgerProblem,
    StorageError,
    verify_ledger,
)
from asyncplane import _postgres_sql as pg_sql
from asyncplane import _sqlite_sql as sql
from asyncplane.testing import ManualClock

# The state each event type leaves an item in: replaying a history gives the row's state.
REPLAY = {
    "queued": "ready",
    "claimed": "claimed",
    "lease_expired": "claimed",
    "done": "done",
    "failed": "failed",
}


async def claimed_item(store: ControlStore) -> ClaimedItem:
    await store.enqueue("alpha", {})
    claim = await store.claim(owner="w1")
    assert claim is not None
    return claim


async def kinds(store: ControlStore) -> set[str]:
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    return {p.kind for p in problems}


async def found_item_by_item(store: ControlStore, problems: list[LedgerProblem]) -> None:
    """Each item's own check (its page in the dashboard, which reads that item's rows
    alone) finds exactly the problems the whole store's names for it."""
    # (Events stored under no integer, on SQLite, are named 0: no one item's check has them.)
    named = {p.item_id for p in problems if "not an item id" not in p.detail}
    for item_id in named:
        mine = [p for p in problems if p.item_id == item_id]
        assert await verify_ledger(store, item_id=item_id) == mine, item_id


def test_every_kind_is_checked_and_documented() -> None:
    assert [kind for kind, _ in sql.LEDGER_CHECKS] == list(LEDGER_PROBLEM_KINDS)
    assert set(LEDGER_PROBLEM_KINDS) == {
        "no_creation_event",
        "two_terminal_events",
        "terminal_without_event",
        "cancelled_without_event",
        "terminal_events_disagree",
        "event_without_terminal",
        "fence_not_monotonic",
        "fence_disagrees",
        "ready_after_claim",
        "state_disagrees",
        "owner_disagrees",
        "never_moves_on",
        "twin_stranded",
        "orphan_events",
    }


async def test_every_transition_appends_an_event(store: ControlStore, clock: ManualClock) -> None:
    item_id = await store.enqueue("alpha", {})
    first = await store.claim(owner="w1")
    assert first is not None
    clock.advance(store.lease_seconds + 1)
    second = await store.claim(owner="w2")
    assert second is not None
    await store.finish(item_id, fence=second.fence, status="done")
    events = await store.events(item_id)
    assert [e["event_type"] for e in events] == [
        "queued",
        "claimed",
        "lease_expired",
        "claimed",
        "done",
    ]
    assert all(e["at"] is not None for e in events)
    assert [e["event_id"] for e in events] == sorted(e["event_id"] for e in events)


@pytest.mark.parametrize("count", [41, 43])
async def test_a_rounds_many_events_are_each_written_in_order(
    store: ControlStore, count: int
) -> None:
    # One round each for the arrivals, the claims and the finishes: on SQLite their
    # events go several rows to a statement (32, then 8, then one by one), and 41 and 43
    # leave one and three over.
    ids = await store.enqueue_many("alpha", [Job({"n": n}) for n in range(count)])
    claims = await store.claim_batch("w", count)
    assert [c.item_id for c in claims] == ids
    await asyncio.gather(*(store.finish(c.item_id, fence=c.fence) for c in claims))
    histories = [await store.events(item_id) for item_id in ids]
    for item_id, events in zip(ids, histories, strict=True):
        assert [(e["item_id"], e["event_type"], e["fence"]) for e in events] == [
            (item_id, "queued", 0),
            (item_id, "claimed", 1),
            (item_id, "done", 1),
        ]
        assert events[1]["owner"] == "w"
    for step in range(2):  # the arrivals' and the claims' ids rise with the items'
        stepped = [events[step]["event_id"] for events in histories]
        assert stepped == list(range(stepped[0], stepped[0] + count))
    assert await verify_ledger(store) == []


async def test_row_state_is_derivable_from_events(store: ControlStore, clock: ManualClock) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(6)]
    a = await store.claim(owner="w")
    b = await store.claim(owner="w")
    c = await store.claim(owner="w")
    assert a and b and c
    await store.finish(a.item_id, fence=a.fence, status="done")
    await store.finish(b.item_id, fence=b.fence, status="failed")
    clock.advance(store.lease_seconds + 1)
    await store.claim(owner="x")  # takes over c
    for item_id in ids:
        state = None
        for event in await store.events(item_id):
            state = REPLAY[event["event_type"]]
        assert state == (await store.item(item_id))["state"]


async def test_events_are_append_only(store: ControlStore, raw: Any) -> None:
    item_id = await store.enqueue("alpha", {})
    with pytest.raises(raw.Refused, match="append-only"):
        raw.execute("UPDATE events SET event_type = 'done'")
    with pytest.raises(raw.Refused, match="append-only"):
        raw.execute("DELETE FROM events WHERE item_id = ?", (item_id,))
    if raw.backend == "postgresql":  # TRUNCATE fires no row's trigger: a statement's
        with pytest.raises(raw.Refused, match="append-only"):
            raw.execute("TRUNCATE events")
    # Once the item itself is gone (as retention will do), its history may go too.
    raw.execute("BEGIN")
    raw.execute("DELETE FROM items WHERE item_id = ?", (item_id,))
    raw.execute("DELETE FROM events WHERE item_id = ?", (item_id,))
    raw.execute("COMMIT")
    assert await verify_ledger(store) == []


def unprotect(raw: Any) -> None:
    """Drop the ledger's delete guard, as a determined tamperer could."""
    raw.execute("DROP TRIGGER events_kept" + (" ON events" if raw.backend == "postgresql" else ""))


async def test_clean_store_verifies_clean(store: ControlStore) -> None:
    assert await verify_ledger(store) == []
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence)
    assert await verify_ledger(store) == []


async def test_no_creation_event(store: ControlStore, raw: sqlite3.Connection) -> None:
    item_id = await store.enqueue("alpha", {})
    unprotect(raw)
    raw.execute("DELETE FROM events WHERE item_id = ? AND event_type = 'queued'", (item_id,))
    problems = await verify_ledger(store)
    assert problems == [LedgerProblem("no_creation_event", item_id, problems[0].detail)]
    await found_item_by_item(store, problems)
    assert "queued" in problems[0].detail


async def test_two_terminal_events(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence, status="done")
    raw.execute(
        "INSERT INTO events (item_id, event_type, fence, owner, at) VALUES (?, 'done', ?, 'w9', 0)",
        (claim.item_id, claim.fence),
    )
    assert await kinds(store) == {"two_terminal_events"}


async def test_terminal_without_event(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    raw.execute("UPDATE items SET state = 'done' WHERE item_id = ?", (claim.item_id,))
    assert await kinds(store) == {"terminal_without_event"}


async def test_terminal_events_disagree(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence, status="done")
    raw.execute("UPDATE items SET state = 'failed' WHERE item_id = ?", (claim.item_id,))
    assert await kinds(store) == {"terminal_events_disagree"}


async def test_event_without_terminal(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence, status="done")
    raw.execute("UPDATE items SET state = 'claimed' WHERE item_id = ?", (claim.item_id,))
    assert await kinds(store) == {"event_without_terminal"}


async def test_fence_not_monotonic(
    store: ControlStore, raw: sqlite3.Connection, clock: ManualClock
) -> None:
    claim = await claimed_item(store)
    clock.advance(store.lease_seconds + 1)
    second = await store.claim(owner="w2")
    assert second is not None
    # A repeated claim at the current fence: the last claim still matches the row.
    raw.execute(
        "INSERT INTO events (item_id, event_type, fence, owner, at) "
        "VALUES (?, 'claimed', ?, 'w3', 0)",
        (claim.item_id, second.fence),
    )
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert {p.kind for p in problems} == {"fence_not_monotonic"}
    assert problems[0].item_id == claim.item_id


async def test_fence_disagrees(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    raw.execute("UPDATE items SET fence = fence + 5 WHERE item_id = ?", (claim.item_id,))
    assert await kinds(store) == {"fence_disagrees"}


async def test_fence_disagrees_for_a_fence_with_no_claim(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    item_id = await store.enqueue("alpha", {})
    raw.execute("UPDATE items SET fence = 3 WHERE item_id = ?", (item_id,))
    assert await kinds(store) == {"fence_disagrees"}


async def test_ready_after_claim(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    raw.execute(
        "UPDATE items SET state = 'ready', owner = NULL, lease_expires_at = NULL WHERE item_id = ?",
        (claim.item_id,),
    )
    assert await kinds(store) == {"ready_after_claim"}


async def test_state_disagrees_for_a_claim_never_recorded(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    item_id = await store.enqueue("alpha", {})
    raw.execute("UPDATE items SET state = 'claimed', owner = 'ghost' WHERE item_id = ?", (item_id,))
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("state_disagrees", item_id)]
    assert problems[0].detail == "row is 'claimed' but its events lead to ready"


async def test_state_disagrees_for_an_unknown_state(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    item_id = await store.enqueue("alpha", {})
    raw.execute("UPDATE items SET state = 'bogus' WHERE item_id = ?", (item_id,))
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("state_disagrees", item_id)]
    assert problems[0].detail == "row is 'bogus' but its events lead to ready"


async def test_owner_disagrees(store: ControlStore, raw: sqlite3.Connection) -> None:
    # A running row's owner edited: the worker that holds it is not the one it names
    # (a lost claim's give-back, which goes by owner, would miss it or take another's).
    claim = await claimed_item(store)
    raw.execute("UPDATE items SET owner = 'intruder' WHERE item_id = ?", (claim.item_id,))
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("owner_disagrees", claim.item_id)]
    assert problems[0].detail == (
        f"the row names intruder but its claim at fence {claim.fence} was by {claim.owner}"
    )
    raw.execute("UPDATE items SET owner = ? WHERE item_id = ?", (claim.owner, claim.item_id))
    await store.offload(claim.item_id, fence=claim.fence, handle="batch-1")
    assert await verify_ledger(store) == []  # an offload keeps its claimer
    raw.execute("UPDATE items SET owner = NULL WHERE item_id = ?", (claim.item_id,))
    assert await kinds(store) == {"owner_disagrees"}


async def test_never_moves_on(
    store: ControlStore, raw: sqlite3.Connection, clock: ManualClock
) -> None:
    # A claimed row with no lease end is never taken over; a deferred one with no due
    # time never falls due: each sat there for good, and the ledger said nothing.
    claim = await claimed_item(store)
    raw.execute("UPDATE items SET lease_expires_at = NULL WHERE item_id = ?", (claim.item_id,))
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("never_moves_on", claim.item_id)]
    assert "no lease end" in problems[0].detail
    clock.advance(3600)
    assert await store.claim("w2") is None  # indeed: never taken over
    raw.execute("UPDATE items SET lease_expires_at = ? WHERE item_id = ?", (0, claim.item_id))
    retried = await store.claim("w2")
    assert retried is not None
    await store.retry(retried.item_id, fence=retried.fence, error="later", delay=60)
    assert await verify_ledger(store) == []
    raw.execute("UPDATE items SET due_at = NULL WHERE item_id = ?", (claim.item_id,))
    problems = await verify_ledger(store)
    assert [(p.kind, p.item_id) for p in problems] == [("never_moves_on", claim.item_id)]
    assert "no due time" in problems[0].detail


async def test_orphan_events(store: ControlStore, raw: sqlite3.Connection) -> None:
    claim = await claimed_item(store)
    raw.execute("DELETE FROM items WHERE item_id = ?", (claim.item_id,))
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("orphan_events", claim.item_id)]


async def test_orphan_events_under_an_id_no_item_has_are_checked_item_by_item_too(
    store: ControlStore, raw: Any
) -> None:
    # Reported by the whole check under 0 or -3, they could not be asked for one item at a
    # time: "item_id must be positive".
    for stored in (0, -3):
        raw.execute(
            "INSERT INTO events (item_id, event_type, fence, at) VALUES (?, 'queued', 0, 0)",
            (stored,),
        )
    problems = await verify_ledger(store)
    assert [(p.kind, p.item_id) for p in problems] == [("orphan_events", -3), ("orphan_events", 0)]
    await found_item_by_item(store, problems)
    with pytest.raises(InvalidInput, match="64 bits"):
        await verify_ledger(store, item_id=2**63)


@pytest.mark.sqlite_only  # a PostgreSQL column holds only integers
async def test_orphan_events_under_an_id_that_is_no_integer_are_named(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    raw.execute(
        "INSERT INTO events (item_id, event_type, fence, at) VALUES ('abc', 'queued', 0, 0)"
    )
    raw.execute("INSERT INTO events (item_id, event_type, fence, at) VALUES (999, 'queued', 0, 0)")
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("orphan_events", 0), ("orphan_events", 999)]
    assert problems[0].detail == (
        "1 event(s) for an item that does not exist (stored under 'abc', not an item id)"
    )


async def test_an_item_whose_time_no_datetime_holds_is_a_storage_error_to_read(
    store: ControlStore, raw: Any
) -> None:
    item_id = await store.enqueue("alpha", {})
    unprotect(raw)
    raw.execute("UPDATE items SET updated_at = 'Infinity' WHERE item_id = ?", (item_id,))
    with pytest.raises(StorageError, match="a stored time no datetime can hold"):
        await store.item(item_id)
    with pytest.raises(StorageError, match="no datetime can hold"):
        await store.items(project_id="alpha")
    raw.execute("UPDATE items SET updated_at = 0, created_at = 1e300 WHERE item_id = ?", (item_id,))
    with pytest.raises(StorageError, match="no datetime can hold"):
        await store.claim("w")  # (its claim is saved: the lease lapses as any other)


async def test_a_purge_archives_a_time_no_datetime_holds_as_it_is_stored(
    store: ControlStore, raw: Any, tmp_path: pathlib.Path, asyncplane_clock: ManualClock
) -> None:
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    await store.finish(item_id, fence=claim.fence)
    unprotect(raw)
    raw.execute("UPDATE items SET created_at = -1e300 WHERE item_id = ?", (item_id,))
    archive = tmp_path / "archive.jsonl"
    asyncplane_clock.advance(1)
    assert (await store.purge(0, archive_path=archive)).purged == 1
    line = json.loads(archive.read_text().splitlines()[0])
    assert line["item"]["created_at"] == -1e300


async def test_problems_name_the_item_and_respect_the_limit(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    ids = [await store.enqueue("alpha", {}) for _ in range(5)]
    unprotect(raw)
    raw.execute("DELETE FROM events WHERE event_type = 'queued'")
    problems = await verify_ledger(store)
    assert [p.item_id for p in problems] == ids
    assert len(await verify_ledger(store, limit=2)) == 2


async def test_verify_runs_in_sql_over_many_items(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    # 20,000 items written straight into the file, one tampered: the checks run in the
    # database and still name exactly that one.
    raw.execute("BEGIN")
    raw.executemany(
        "INSERT INTO items (item_id, project_id, state, payload, created_at, updated_at) "
        "VALUES (?, 'alpha', 'ready', '{}', 0, 0)",
        [(n,) for n in range(1, 20_001)],
    )
    raw.executemany(
        "INSERT INTO events (item_id, event_type, fence, at) VALUES (?, 'queued', 0, 0)",
        [(n,) for n in range(1, 20_001)],
    )
    raw.execute("UPDATE items SET state = 'done' WHERE item_id = 777")
    raw.execute("COMMIT")
    problems = await verify_ledger(store)
    await found_item_by_item(store, problems)
    assert [(p.kind, p.item_id) for p in problems] == [("terminal_without_event", 777)]


# --- cancels and requeues ------------------------------------------------------------------


async def test_a_requeued_history_verifies_clean(store: ControlStore) -> None:
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence, status="failed", error="x")
    await store.requeue(claim.item_id)
    again = await store.claim(owner="w2")
    assert again is not None
    await store.cancel(claim.item_id)  # claimed -> cancelled, fence raised
    await store.requeue(claim.item_id)
    third = await store.claim(owner="w3")
    assert third is not None
    await store.finish(claim.item_id, fence=third.fence, status="done")
    kinds_seen = [e["event_type"] for e in await store.events(claim.item_id)]
    assert kinds_seen == [
        "queued", "claimed", "failed", "requeued", "claimed", "cancelled", "requeued",
        "claimed", "done",
    ]  # fmt: skip
    assert await verify_ledger(store) == []


async def test_cancelled_without_event(store: ControlStore, raw: sqlite3.Connection) -> None:
    item_id = await store.enqueue("alpha", {})
    raw.execute("UPDATE items SET state = 'cancelled' WHERE item_id = ?", (item_id,))
    assert await kinds(store) == {"cancelled_without_event"}


async def test_two_terminal_events_need_a_requeue_between(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence, status="failed", error="x")
    await store.requeue(claim.item_id)
    again = await store.claim(owner="w2")
    assert again is not None
    await store.finish(claim.item_id, fence=again.fence, status="done")
    assert await verify_ledger(store) == []  # failed, requeued, ..., done: fine
    raw.execute(
        "INSERT INTO events (item_id, event_type, fence, owner, at) "
        "VALUES (?, 'cancelled', ?, NULL, 0)",
        (claim.item_id, again.fence + 1),
    )  # a second settlement since the requeue, behind the store's back
    assert "two_terminal_events" in await kinds(store)


async def test_ready_after_claim_still_catches_a_reset_behind_a_requeue(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    claim = await claimed_item(store)
    await store.finish(claim.item_id, fence=claim.fence, status="failed", error="x")
    await store.requeue(claim.item_id)  # ready with its event: fine
    assert await verify_ledger(store) == []
    again = await store.claim(owner="w2")
    assert again is not None
    raw.execute(
        "UPDATE items SET state = 'ready', owner = NULL, lease_expires_at = NULL WHERE item_id = ?",
        (claim.item_id,),
    )  # claimed since the requeue, reset to ready with no event
    assert await kinds(store) == {"ready_after_claim"}


async def test_ready_after_claim_names_the_claim_since_it_was_ready_again(
    store: ControlStore, raw: Any
) -> None:
    # Fences written out of order behind the store's back: the detail names the claim
    # since the item was last made ready again, not the highest fence of its history.
    item = await store.enqueue("alpha", {})
    for event, fence in (("claimed", 5), ("released", 5), ("claimed", 3)):
        raw.execute(
            "INSERT INTO events (item_id, event_type, fence, at) VALUES (?, ?, ?, 0)",
            (item, event, fence),
        )
    raw.execute("UPDATE items SET fence = 3 WHERE item_id = ?", (item,))
    found = {p.kind: p.detail for p in await verify_ledger(store)}
    assert found["ready_after_claim"] == "row is ready but the item was claimed at fence 3"
    assert {p.kind: p.detail for p in await verify_ledger(store, item_id=item)} == found


async def test_a_cancel_fence_counts_with_the_claims(
    store: ControlStore, raw: sqlite3.Connection
) -> None:
    claim = await claimed_item(store)
    await store.cancel(claim.item_id)
    assert (await store.item(claim.item_id))["fence"] == claim.fence + 1
    assert await verify_ledger(store) == []
    raw.execute("UPDATE items SET fence = ? WHERE item_id = ?", (claim.fence, claim.item_id))
    assert await kinds(store) == {"fence_disagrees"}  # the cancel's fence is the last


@pytest.mark.parametrize("cycle", [("claimed", "released"), ("claimed", "failed", "requeued")])
async def test_a_long_history_costs_its_check_in_proportion(
    store: ControlStore, raw: Any, cycle: tuple[str, ...]
) -> None:
    # An item claimed and released N times: each claim looked up the item's last release
    # again, reading every release, so checking it cost N squared (two minutes at 25,000
    # cycles, each time its dashboard page was shown); failed and requeued N times, each
    # settling event looked up the last requeue. Counted, not timed: SQLite's steps,
    # PostgreSQL's rows through every node of each plan. Four times the history must cost
    # about four times as much, not sixteen.
    await store.create_project("p", "P")

    def cost(cycles: int) -> int:
        raw.execute("BEGIN")
        raw.execute(
            "INSERT INTO items (project_id, state, payload, fence, attempts, created_at,"
            " updated_at) VALUES ('p', 'ready', '{}', ?, 0, 0, 0)",
            (cycles,),
        )
        (item,) = raw.execute("SELECT max(item_id) FROM items").fetchone()
        events = [(item, "queued", 0)]
        for fence in range(1, cycles + 1):
            events += [(item, event, fence) for event in cycle]
        raw.executemany(
            "INSERT INTO events (item_id, event_type, fence, at) VALUES (?, ?, ?, 0)", events
        )
        raw.execute("COMMIT")
        if store.backend == "sqlite":
            return _steps(raw, sql.ONE_ITEM_CHECKS, {"item_id": item})
        return sum(
            _rows_through(json.loads(raw.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {check}",
                                                 (item,)).fetchone()[0])[0]["Plan"])
            for _, check in pg_sql.ONE_ITEM_CHECKS
        )  # fmt: skip

    small, large = cost(1000), cost(4000)
    assert large < 6 * small, (small, large)
    assert await verify_ledger(store) == []


def _steps(db: Any, statements: Any, params: dict[str, Any]) -> int:
    """SQLite's virtual-machine steps (in hundreds) to run ``statements``, each finding
    nothing."""
    counted = [0]

    def step() -> int:
        counted[0] += 1
        return 0

    db.set_progress_handler(step, 100)
    try:
        for _, statement in statements:
            assert db.execute(statement, params).fetchall() == []
    finally:
        db.set_progress_handler(None, 0)
    return counted[0]


def _rows_through(plan: dict[str, Any]) -> int:
    """Rows through a PostgreSQL plan node and those under it, over all its loops."""
    here = int(plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0))
    here *= int(plan.get("Actual Loops", 1))
    return here + sum(_rows_through(child) for child in plan.get("Plans", ()))
