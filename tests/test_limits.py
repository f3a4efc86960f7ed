"""Per-project limits, enforced in the claim's own transaction; on both backends.

``max_running``: never more of a project's items claimed at once; ``per_minute`` and
``burst``: a token bucket every claim draws from. Every settlement frees its slot in its
own transaction; a claim that meets a limit takes what other projects have, and a waiting
claimer sleeps until a slot frees or a token is back.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys
from typing import Any

import pytest

from _fleet import run_fleet
from _signals import until, waiting_on
from asyncplane import (
    ControlStore,
    InvalidInput,
    InvalidType,
    UnknownProject,
    _validate,
    testing,
    verify_ledger,
)
from asyncplane import _postgres_sql as pg_sql
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock


async def fill(store: ControlStore, project: str, n: int) -> list[int]:
    return await store.enqueue_many(project, [{"n": i} for i in range(n)])


async def test_max_running_caps_the_claimed_items_of_a_project(store: ControlStore) -> None:
    await store.create_project("beta", "Beta")
    await fill(store, "alpha", 10)
    await fill(store, "beta", 4)
    limits = await store.set_limits("alpha", max_running=3)
    assert limits["max_running"] == 3 and limits["running"] == 0
    batch = await store.claim_batch("w", 10)
    # Alpha gives its three; beta, unlimited, all it has: the limit takes nothing from it.
    assert sorted(c.project_id for c in batch) == ["alpha"] * 3 + ["beta"] * 4
    assert await store.claim_batch("w", 10) == []
    assert await store.claim("w", project_id="alpha") is None
    assert (await store.limits("alpha"))["running"] == 3
    assert (await store.counts(project_id="alpha"))["ready"] == 7


async def test_every_settlement_frees_its_slot_at_once(
    store: ControlStore, clock: ManualClock
) -> None:
    await fill(store, "alpha", 12)
    await store.set_limits("alpha", max_running=1)

    async def the_one() -> Any:
        (claim,) = await store.claim_batch("w", 5, project_id="alpha")
        assert await store.claim("w", project_id="alpha") is None  # full
        return claim

    claim = await the_one()
    await store.finish(claim.item_id, fence=claim.fence)
    claim = await the_one()
    await store.finish(claim.item_id, fence=claim.fence, status="failed", error="no")
    claim = await the_one()
    await store.retry(claim.item_id, fence=claim.fence, delay=3600)
    claim = await the_one()
    await store.park(claim.item_id, fence=claim.fence, delay=3600)
    claim = await the_one()
    await store.release(claim.item_id, fence=claim.fence)
    claim = await the_one()
    await store.cancel(claim.item_id)
    claim = await the_one()
    await store.offload(claim.item_id, fence=claim.fence, handle="batch-1")  # not running here
    await the_one()
    assert await verify_ledger(store) == []


async def test_a_lapsed_claim_of_a_full_project_is_taken_over_without_a_new_slot(
    store: ControlStore, clock: ManualClock
) -> None:
    await fill(store, "alpha", 3)
    await store.set_limits("alpha", max_running=1)
    first = await store.claim("w1", project_id="alpha", lease_seconds=10)
    assert first is not None
    clock.advance(11)
    taken = await store.claim("w2", project_id="alpha")
    assert taken is not None and taken.item_id == first.item_id  # the same run, handed on
    assert taken.fence == first.fence + 1
    assert await store.claim("w2", project_id="alpha") is None  # still one running
    assert (await store.limits("alpha"))["running"] == 1


async def test_a_rate_gives_the_burst_at_once_then_per_minute(
    store: ControlStore, clock: ManualClock
) -> None:
    await fill(store, "alpha", 30)
    limits = await store.set_limits("alpha", per_minute=60, burst=5)
    assert limits["tokens"] == 5
    assert len(await store.claim_batch("w", 20)) == 5
    assert await store.claim_batch("w", 20) == []
    limits = await store.limits("alpha")
    assert limits["tokens"] == 0
    assert limits["next_token_at"] == dt.datetime.fromtimestamp(clock.now() + 1, dt.timezone.utc)
    assert await store.next_due() == limits["next_token_at"]  # the drain loop's alarm
    clock.advance(2.5)  # one a second: two whole tokens, and half a third
    assert len(await store.claim_batch("w", 20)) == 2
    clock.advance(0.5)
    assert len(await store.claim_batch("w", 20)) == 1
    clock.advance(3600)  # rested: the bucket holds its burst, no more
    assert len(await store.claim_batch("w", 20)) == 5


async def test_a_takeover_draws_a_token_too(store: ControlStore, clock: ManualClock) -> None:
    await fill(store, "alpha", 2)
    await store.set_limits("alpha", per_minute=1, burst=1)
    first = await store.claim("w1", lease_seconds=5)
    assert first is not None
    clock.advance(6)  # lapsed, but the bucket has only a sixth of a token back
    assert await store.claim("w2") is None
    clock.advance(54)
    taken = await store.claim("w2")
    assert taken is not None and taken.item_id == first.item_id


async def test_limits_apply_to_scoped_claims_and_a_paused_project_still_gives_nothing(
    store: ControlStore,
) -> None:
    await store.assign("alpha", "agent")
    await fill(store, "alpha", 5)
    await store.set_limits("alpha", max_running=2)
    assert len(await store.claim_batch("w", 5, actor_id="agent")) == 2
    await store.set_limits("alpha", max_running=4)
    await store.set_project_status("alpha", "paused")
    assert await store.claim_batch("w", 5, actor_id="agent") == []  # room, but paused
    await store.set_project_status("alpha", "open")
    assert len(await store.claim_batch("w", 5, actor_id="agent")) == 2


async def test_a_lowered_limit_lets_what_runs_finish_and_then_holds(store: ControlStore) -> None:
    await fill(store, "alpha", 10)
    batch = await store.claim_batch("w", 5)
    await store.set_limits("alpha", max_running=2)
    assert (await store.limits("alpha"))["running"] == 5
    assert await store.claim("w") is None
    for claim in batch[:3]:
        await store.finish(claim.item_id, fence=claim.fence)
        assert await store.claim("w") is None  # 4, then 3, then 2 running: still full
    await store.finish(batch[3].item_id, fence=batch[3].fence)
    assert await store.claim("w") is not None


async def test_set_limits_keeps_what_it_is_not_given_and_none_clears(store: ControlStore) -> None:
    await store.set_limits("alpha", max_running=8, per_minute=600, burst=20)
    limits = await store.set_limits("alpha", burst=10)
    assert (limits["max_running"], limits["per_minute"], limits["burst"]) == (8, 600.0, 10)
    assert limits["tokens"] == 10  # a smaller bucket holds no more than it can
    limits = await store.set_limits("alpha", per_minute=None)  # its burst goes with it
    assert (limits["max_running"], limits["per_minute"], limits["burst"]) == (8, None, None)
    assert limits["tokens"] is None
    assert [row["project_id"] for row in await store.project_limits()] == ["alpha"]
    with pytest.raises(InvalidInput, match="burst is the size of the per_minute bucket"):
        await store.set_limits("alpha", burst=5)  # a bucket with no rate limits nothing
    await store.set_limits("alpha", max_running=None)
    assert await store.project_limits() == []  # nothing left: no limits at all
    limits = await store.limits("alpha")
    assert (limits["max_running"], limits["per_minute"], limits["burst"]) == (None, None, None)


async def test_the_largest_burst_gives_claims_on_both_backends(
    store: ControlStore,
) -> None:
    # A burst near 2**63 came back from the rules core's float tokens as 2**63, past a
    # PostgreSQL bigint: every claim that could reach the project failed.
    await store.set_limits("alpha", per_minute=600, burst=2**53)
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    for _ in range(3):
        assert await store.claim("w") is not None
    assert (await store.limits("alpha"))["burst"] == 2**53


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_running": 0}, InvalidInput),
        ({"max_running": -1}, InvalidInput),
        ({"max_running": 2.5}, InvalidType),
        ({"max_running": True}, InvalidType),
        ({"per_minute": 0}, InvalidInput),
        ({"per_minute": float("nan")}, InvalidInput),
        ({"per_minute": float("inf")}, InvalidInput),
        ({"per_minute": 1e-300}, InvalidInput),  # its next token: no datetime
        ({"per_minute": 60e6 * 2}, InvalidInput),
        ({"per_minute": "600"}, InvalidType),
        ({"burst": 0}, InvalidInput),
        ({"per_minute": 600, "burst": 2**53 + 1}, InvalidInput),  # past a float's exact ints
        ({"per_minute": 600, "burst": 2**63 - 1}, InvalidInput),
        ({}, InvalidInput),
    ],
)
async def test_bad_limits_are_refused_before_anything_is_written(
    store: ControlStore, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    await store.set_limits("alpha", max_running=3)
    with pytest.raises(error):
        await store.set_limits("alpha", **kwargs)
    assert (await store.limits("alpha"))["max_running"] == 3


async def test_the_slowest_rate_still_tells_when_its_next_token_comes(
    store: ControlStore, asyncplane_clock: testing.ManualClock
) -> None:
    await store.set_limits("alpha", per_minute=_validate.MIN_PER_MINUTE, burst=1)
    await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    assert await store.claim("w", project_id="alpha") is not None  # the one token
    assert await store.claim("w", project_id="alpha") is None
    limits = await store.limits("alpha")
    years = (limits["next_token_at"].timestamp() - asyncplane_clock.now()) / (366 * 24 * 3600)
    assert 99 < years <= 100.01  # a century, by the store's clock
    assert (await store.project_limits())[0]["next_token_at"] == limits["next_token_at"]
    assert await store.next_due() is not None


async def test_limits_of_a_missing_project_are_refused(store: ControlStore) -> None:
    with pytest.raises(UnknownProject):
        await store.set_limits("nowhere", max_running=1)
    with pytest.raises(UnknownProject):
        await store.limits("nowhere")


async def test_a_waiting_claim_sleeps_until_a_token_is_back(
    store: ControlStore, clock: ManualClock
) -> None:
    await fill(store, "alpha", 3)
    await store.set_limits("alpha", per_minute=6, burst=1)  # a token every ten seconds
    assert await store.claim("w") is not None
    waiter = asyncio.create_task(store.claim("w", wait=3600))
    await until(waiting_on("due"), what="the claim waits on the token's time")
    clock.advance(9)
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.advance(1)
    got = await asyncio.wait_for(waiter, 5)
    assert got is not None


async def test_an_offload_wakes_a_claim_waiting_for_the_slot_it_frees(
    store: ControlStore,
) -> None:
    # An offloaded item runs elsewhere (an external batch): its max_running slot is free,
    # and a claim waiting in this process for it is woken then, not at its next look
    # for other processes' commits (an hour here).
    await fill(store, "alpha", 2)
    await store.set_limits("alpha", max_running=1)
    first = await store.claim("w")
    assert first is not None
    waiter = asyncio.create_task(
        store.claim("w2", project_id="alpha", wait=3600, poll_interval=3600)
    )
    await until(waiting_on("local"), what="the claim waits for a slot")
    await store.offload(first.item_id, fence=first.fence, handle="batch-1")
    got = await asyncio.wait_for(waiter, 30)
    assert got is not None and got.item_id != first.item_id


async def test_set_limits_from_a_clock_behind_the_buckets_last_refill_gives_no_token(
    store: ControlStore, clock: ManualClock, asyncplane_store_factory: Any
) -> None:
    # The bucket was last refilled at t0 (a claim spent its one token). A change made by
    # a host whose clock is ten minutes behind must not count those ten minutes again
    # once the clock reads t0.
    await fill(store, "alpha", 4)
    await store.set_limits("alpha", per_minute=1, burst=1)
    assert await store.claim("w") is not None
    lagging = await asyncplane_store_factory(clock=ManualClock(clock.now() - 600))
    await lagging.set_limits("alpha", max_running=100)
    assert (await store.limits("alpha"))["tokens"] == 0
    assert await store.claim("w") is None
    clock.advance(60)
    assert await store.claim("w") is not None  # the next minute's token, as ever


async def test_a_waiting_claim_wakes_when_a_slot_frees_on_another_host(
    store: ControlStore, asyncplane_store_factory: Any
) -> None:
    # Another store on the same database, as another host would have: its finish frees
    # the slot, and the waiter here wakes on the store's own signal (on PostgreSQL, the
    # NOTIFY a freed slot sends), not on a long poll.
    other = await asyncplane_store_factory()
    await fill(store, "alpha", 2)
    await store.set_limits("alpha", max_running=1)
    running = await other.claim("w2")
    assert running is not None
    waiter = asyncio.create_task(store.claim("w", wait=3600, poll_interval=0.05))
    await until(waiting_on("commit"), what="the claim waits")
    engine = engine_of(store)
    version = await engine.data_version()
    await other.finish(running.item_id, fence=running.fence)

    async def told() -> bool:
        await asyncio.sleep(0.001)  # a notification comes in from the server's socket
        return await engine.data_version() != version

    await until(told, what="the waiting store hears of the freed slot")
    got = await asyncio.wait_for(waiter, 30)
    assert got is not None and got.item_id != running.item_id


@pytest.mark.postgresql_only
async def test_a_lapsed_claim_a_quota_refuses_tells_no_one(url: str) -> None:
    # A worker died holding an item of a rate-limited project whose bucket is empty: each
    # claim locked the lapsed claim, was refused it by the quota, and told every host of
    # a row passed over; every idle worker of the fleet woke to be refused it and told
    # again (41,267 transactions in 10 s from three workers, against 149).
    import asyncpg

    clock = ManualClock()
    async with ControlStore(url, clock=clock) as store:
        await store.create_project("alpha", "alpha")
        await fill(store, "alpha", 3)
        await store.set_limits("alpha", per_minute=1, burst=1)
        assert await store.claim("gone", lease_seconds=5) is not None  # the only token
        clock.advance(6)  # lapsed; a tenth of a token back
        listener = await asyncpg.connect(url)
        heard: asyncio.Queue[str] = asyncio.Queue()
        try:
            await listener.add_listener("asyncplane", lambda *args: heard.put_nowait(args[-1]))
            for _ in range(3):
                assert await store.claim("idle") is None
            await listener.fetchval("SELECT 1")  # anything sent has come by now
            assert heard.empty()
        finally:
            await listener.close()


@pytest.mark.postgresql_only
async def test_a_freed_slot_notifies_every_host_and_a_plain_finish_elsewhere_does_not(
    url: str,
) -> None:
    import asyncpg

    async with ControlStore(url) as store:
        for project in ("alpha", "beta"):
            await store.create_project(project, project)
            await fill(store, project, 2)
        await store.set_limits("alpha", max_running=1)
        limited = await store.claim("w", project_id="alpha")
        free = await store.claim("w", project_id="beta")
        assert limited is not None and free is not None
        listener = await asyncpg.connect(url)
        heard: asyncio.Queue[str] = asyncio.Queue()
        try:
            await listener.add_listener("asyncplane", lambda *args: heard.put_nowait(args[-1]))
            await store.finish(free.item_id, fence=free.fence)  # no limit: nobody is told
            await store.finish(limited.item_id, fence=limited.fence)  # a slot: every host is
            schema = await listener.fetchval("SELECT current_schema()")
            assert await asyncio.wait_for(heard.get(), 30) == schema
            await listener.fetchval("SELECT 1")  # anything queued behind it has come by now
            assert heard.empty()  # one notification: the freed slot's, not the plain finish's
        finally:
            await listener.close()


@pytest.mark.postgresql_only
async def test_a_claim_waits_only_for_its_own_limited_projects_lock(url: str) -> None:
    # A host in the middle of claiming alpha (here: a raw transaction holding alpha's limit
    # lock, as a claim does) makes another host's claim of alpha wait, and only that: a
    # claim of beta, and a claim of the whole store (which leaves alpha to the claimer
    # that holds it), go on at once.
    import asyncpg

    async with ControlStore(url) as store, ControlStore(url) as other:
        for project in ("alpha", "beta"):
            await store.create_project(project, project)
            await fill(store, project, 4)
        await store.set_limits("alpha", max_running=3)
        assert await store.claim("w", project_id="alpha") is not None  # alpha is limited
        raw = await asyncpg.connect(url)
        try:
            lock = raw.transaction()
            await lock.start()
            await raw.execute(pg_sql.LOCK_LIMITS, "alpha")  # alpha's lock, as a claim has it
            waiting = asyncio.create_task(store.claim("w", project_id="alpha"))

            await _until_a_lock_wait(url, "the claim of alpha waits for alpha's limits")
            beta = await asyncio.wait_for(other.claim("w2", project_id="beta"), 30)
            assert beta is not None and beta.project_id == "beta"
            whole = await asyncio.wait_for(other.claim_batch("w2", 10), 30)
            assert [c.project_id for c in whole] == ["beta"] * 3
            assert not waiting.done()
            await lock.commit()
            got = await asyncio.wait_for(waiting, 30)
            assert got is not None and got.project_id == "alpha"
        finally:
            await raw.close()


# --- a fleet of processes -------------------------------------------------------------------

#: What a settlement ends: the item is no longer running.
_ENDS_A_RUN = ("done", "failed", "retried", "parked", "released", "cancelled", "offloaded")


def _replay(events: list[dict[str, Any]]) -> tuple[int, list[float]]:
    """From a project's ledger, in commit order: the most items it ever had claimed at
    once, and the time of every claim (takeovers too)."""
    running: set[int] = set()
    most = 0
    claims = []
    for event in sorted(events, key=lambda e: e["event_id"]):
        if event["event_type"] == "claimed":
            running.add(event["item_id"])
            claims.append(event["at"].timestamp())
            most = max(most, len(running))
        elif event["event_type"] in _ENDS_A_RUN:
            running.discard(event["item_id"])
    return most, sorted(claims)


@pytest.mark.slow
def test_eight_processes_never_run_more_than_the_limit_nor_claim_past_the_rate(
    location_of: Any,
) -> None:
    location = location_of("fleet.db")
    max_running, per_minute, burst = 3, 1200.0, 4  # 20 claims a second

    async def seed() -> None:
        async with ControlStore(location) as store:
            await store.create_project("alpha", "Limited")
            await store.create_project("beta", "Unlimited")
            await fill(store, "alpha", 60)
            await fill(store, "beta", 120)
            await store.set_limits("alpha", max_running=max_running, per_minute=per_minute,
                                   burst=burst)  # fmt: skip

    asyncio.run(seed())
    summaries = run_fleet(
        "limit_worker.py", [[location, f"proc-{n}", "3", str(n)] for n in range(8)]
    )
    assert sum(s["done"] for s in summaries) == 180  # every item done, none twice

    async def ledger() -> dict[str, list[dict[str, Any]]]:
        async with ControlStore(location) as store:
            assert await verify_ledger(store) == []
            found: dict[str, list[dict[str, Any]]] = {"alpha": [], "beta": []}
            for project in found:
                for row in await store.items(project_id=project, limit=1000):
                    found[project].extend(await store.events(row["item_id"]))
            return found

    found = asyncio.run(ledger())
    most, claims = _replay(found["alpha"])
    # Never passed (PostgreSQL numbers events as they are written, not as they commit: the
    # replay may show a slot free a moment early, never one taken that was not free).
    assert 2 <= most <= max_running
    # In any window of W seconds, at most per_minute * W / 60 + burst claims (the bucket
    # may be a whisker behind the ledger's clock readings: 1 ms at this rate).
    for first in range(len(claims)):
        for last in range(first, len(claims)):
            window = claims[last] - claims[first]
            assert last - first + 1 <= per_minute * window / 60 + burst + 0.02, (first, last)
    beta_most, _ = _replay(found["beta"])
    assert beta_most > max_running  # the limit is alpha's alone


def test_cli_shows_and_changes_limits(location_of: Any) -> None:
    where = location_of("cli.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("alpha", "Alpha")
            await fill(store, "alpha", 3)
            await store.claim("w")

    asyncio.run(seed())

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "asyncplane.cli", "limits", where, *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    assert cli().stdout.strip() == "no project has limits"
    set_ = cli("alpha", "--max-running", "8", "--per-minute", "600", "--burst", "20", "--json")
    assert set_.returncode == 0, set_.stderr
    (row,) = json.loads(set_.stdout)["limits"]
    assert (row["max_running"], row["per_minute"], row["burst"], row["running"]) == (8, 600, 20, 1)
    shown = cli("alpha")
    assert "max_running 8 (running 1), per_minute 600, burst 20" in shown.stdout
    assert cli("alpha", "--burst", "none").returncode == 0
    assert "burst -" in cli().stdout
    assert cli("alpha", "--max-running", "1234567", "--per-minute", "2500000.5").returncode == 0
    assert "max_running 1234567 (running 1), per_minute 2500000.5" in cli("alpha").stdout
    # Sixteen digits and more as given too (they read 1.23456789012346e+18 and 1e+15).
    huge = ("--max-running", "1234567890123456789", "--burst", "1000000000000001")
    assert cli("alpha", *huge, "--per-minute", "0.1234567890123456").returncode == 0
    assert (
        "max_running 1234567890123456789 (running 1), per_minute 0.1234567890123456, "
        "burst 1000000000000001"
    ) in cli("alpha").stdout
    for args, words in ((["alpha", "--max-running", "0"], "--max-running must be positive"),
                        (["zeta"], "no project 'zeta'"),
                        (["--burst", "3"], "name the project")):  # fmt: skip
        refused = cli(*args)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr


@pytest.mark.parametrize("per_minute", [600.0, 7.0])
async def test_at_the_moment_next_due_names_the_token_is_there(
    store: ControlStore, clock: ManualClock, per_minute: float
) -> None:
    # The moment is a float time: the bucket must hold the token at that very reading,
    # or a waiting claimer is told the same moment again, and spins (found by review).
    await fill(store, "alpha", 2)
    await store.set_limits("alpha", per_minute=per_minute, burst=1)
    assert await store.claim("w") is not None
    backend = await engine_of(store).ready()
    due = await backend.next_due(None, None)
    assert due is not None
    waiter = asyncio.create_task(store.claim("w", wait=30))
    await until(waiting_on("due"), what="the claim waits on the token's time")
    clock.set(due)
    got = await asyncio.wait_for(waiter, 60)
    assert got is not None


# --- limits against claims on other hosts, step by step (found by review) ---------------


async def _until_a_lock_wait(url: str, what: str) -> None:
    """Until some session of the server waits for a lock (another connection looks)."""
    import asyncpg

    watcher = await asyncpg.connect(url)

    async def waiting() -> bool:
        await asyncio.sleep(0.001)
        query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        return bool(await watcher.fetchval(query))

    try:
        await until(waiting, what=what)
    finally:
        await watcher.close()


@pytest.mark.postgresql_only
async def test_a_host_new_to_a_limit_held_elsewhere_takes_nothing_of_it(
    store: ControlStore, clock: ManualClock, asyncplane_store_factory: Any
) -> None:
    # A lapsed claim of a rate-limited project is not taken over without a token by a host
    # that meets the limit for the first time while another host holds it.
    import asyncpg

    await fill(store, "alpha", 2)
    await store.set_limits("alpha", per_minute=1, burst=1)
    first = await store.claim("w1", lease_seconds=5)  # the only token
    assert first is not None
    clock.advance(6)  # lapsed; a tenth of a token back
    other = await asyncplane_store_factory()  # a fresh host: it has not seen alpha limited
    raw = await asyncpg.connect(store.location)
    try:
        held = raw.transaction()
        await held.start()
        await raw.execute(pg_sql.LOCK_LIMITS, "alpha")  # alpha's lock, as a claim has it
        assert await asyncio.wait_for(other.claim("w2"), 30) is None
        await held.rollback()
    finally:
        await raw.close()
    assert await other.claim("w2") is None  # its limits its own now: still no token
    clock.advance(54)
    taken = await other.claim("w2")
    assert taken is not None and taken.item_id == first.item_id


@pytest.mark.postgresql_only
async def test_set_limits_beside_a_claim_keeps_what_the_claim_spent(store: ControlStore) -> None:
    import asyncpg

    from asyncplane import _backend, _postgres

    await fill(store, "alpha", 20)
    await store.set_limits("alpha", per_minute=1, burst=5)
    now = engine_of(store).clock.now()  # the manual clock stands still: a window of 0 s
    raw = await asyncpg.connect(store.location)
    try:
        claiming = raw.transaction()
        await claiming.start()
        # another host's claim, half-way: it holds alpha's limits and spent the 5 tokens
        op = _backend.ClaimOp("h1", 10, 60.0, None, None)
        (got,) = await _postgres._claim_many({(None, None)}, [op], raw, now)
        assert len(got) == 5
        setting = asyncio.create_task(store.set_limits("alpha", max_running=100))
        await _until_a_lock_wait(store.location, "set_limits waits for the claim")
        await claiming.commit()
        await asyncio.wait_for(setting, 30)
    finally:
        await raw.close()
    assert await store.claim_batch("h2", 10) == []  # at most burst = 5 claims at one instant


@pytest.mark.postgresql_only
async def test_limits_set_while_a_claim_is_in_flight_hold_from_then_on(
    store: ControlStore,
) -> None:
    import asyncpg

    from asyncplane import _backend, _postgres

    await fill(store, "alpha", 10)
    now = engine_of(store).clock.now()
    raw = await asyncpg.connect(store.location)
    try:
        claiming = raw.transaction()
        await claiming.start()
        # host 1: a claim of 2, begun before alpha had limits, not committed yet
        op = _backend.ClaimOp("h1", 2, 60.0, None, None)
        (got,) = await _postgres._claim_many(set(), [op], raw, now)
        assert len(got) == 2
        setting = asyncio.create_task(store.set_limits("alpha", max_running=2))
        await _until_a_lock_wait(store.location, "set_limits waits for the claim")
        assert not setting.done()
        await claiming.commit()
        await asyncio.wait_for(setting, 30)
    finally:
        await raw.close()
    assert await store.claim_batch("h2", 5) == []  # host 1's two count
    assert (await store.limits("alpha"))["running"] == 2


@pytest.mark.postgresql_only
async def test_a_takeover_refused_for_limits_set_meanwhile_leaves_no_trace(
    store: ControlStore, clock: ManualClock, asyncplane_store_factory: Any
) -> None:
    # A claim that waited for set_limits (its candidates read before the limits) takes
    # nothing of the project then limited: not even a lapsed claim, and its ledger does
    # not say it was taken over (found by review).
    import asyncpg

    await fill(store, "alpha", 1)
    first = await store.claim("w1", lease_seconds=5)
    assert first is not None
    clock.advance(6)  # lapsed
    other = await asyncplane_store_factory()  # a host that never saw alpha limited
    await other.counts()
    raw = await asyncpg.connect(store.location)
    try:
        limiting = raw.transaction()
        await limiting.start()
        await raw.execute(pg_sql.LIMITS_CHANGE)  # set_limits, half-way
        await raw.execute(pg_sql.PUT_LIMITS, "alpha", 5, None, None, None, None)
        claiming = asyncio.create_task(other.claim("w2"))
        await _until_a_lock_wait(store.location, "the claim waits for set_limits")
        await limiting.commit()
        assert await asyncio.wait_for(claiming, 30) is None
    finally:
        await raw.close()
    assert [e["event_type"] for e in await store.events(first.item_id)] == ["queued", "claimed"]
    await store.finish(first.item_id, fence=first.fence)  # its holder goes on
    assert await verify_ledger(store) == []
    taken = await other.claim("w2")  # with the limits taken now, the claim is ordinary
    assert taken is None  # (the item is done)
