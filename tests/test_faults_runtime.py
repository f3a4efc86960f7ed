"""Faults at run time: clock jumps, cancellation storms, a PostgreSQL server restarted
mid-drain.

1. Clock jumps of an hour either way against leases (a manual clock that may also go
   back is injected; the stores are on both backends). Forward: the lease lapses, another
   worker takes the item over with a higher fence, the first worker's late reports are
   refused and the item is settled once. Backward: nothing lapses early, deferred work
   does not fall due early, and once the clock is back everything proceeds. A drain,
   with a rival worker beside it, settles every item exactly once while the clock jumps
   back and forth.
2. Cancellation storms on every public coroutine of ControlStore and on drain(): each
   call is cancelled after a varying number of event-loop steps (or a tiny real sleep),
   many times over; the call must have happened completely or not at all, no lock may
   be left held, the ledger must verify and the store must go on working.
3. A PostgreSQL server stopped with ``pg_ctl -m immediate`` while a drain's batch is
   executing (or while the drain is idle, or while its renewer must renew), then started
   again on the same data directory: the store reconnects by itself, nothing
   acknowledged is lost, nothing is settled twice, the ledger is clean.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import gc
import json
import pathlib
import random
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from asyncplane import (
    ClaimedItem,
    ControlStore,
    Done,
    DrainError,
    Failed,
    FenceRejected,
    Outcome,
    Park,
    Retry,
    StorageError,
    StoreClosed,
    UnknownItem,
    UnknownProject,
    _tasks,
    drain,
    testing,
    verify_ledger,
)
from asyncplane.testing import ManualClock

T = TypeVar("T")

HOUR = 3600.0
TERMINAL = ("done", "failed")


class JumpingClock(ManualClock):
    """A ManualClock that may also be set back, as an NTP step or an operator can."""

    def jump(self, seconds: float) -> float:
        """Move the clock by ``seconds``, either way; return the new time."""
        with self._lock:
            self._now += seconds
            now = self._now
        self._wake()  # waiters whose moment has come (after a forward jump) wake
        return now


@pytest.fixture
def asyncplane_clock() -> JumpingClock:
    """Every store of a test here shares a clock that can jump both ways."""
    return JumpingClock()


async def terminal_events(store: ControlStore, item_id: int) -> list[str]:
    return [e["event_type"] for e in await store.events(item_id) if e["event_type"] in TERMINAL]


async def settled_once(store: ControlStore, item_ids: list[int]) -> dict[int, list[str]]:
    """The items that are not settled exactly once (terminal row, one terminal event)."""
    wrong: dict[int, list[str]] = {}
    for item_id in item_ids:
        types = [e["event_type"] for e in await store.events(item_id)]
        row = await store.item(item_id)
        if row["state"] not in TERMINAL or sum(t in TERMINAL for t in types) != 1:
            wrong[item_id] = [row["state"], *types]
    return wrong


async def lock_is_free(store: ControlStore) -> bool:
    async with store._engine.drain_guard() as acquired:
        return acquired


# --- 1. clock jumps ------------------------------------------------------------------------


async def test_a_forward_jump_lapses_the_lease_and_fences_the_first_worker_out(
    store: ControlStore, clock: JumpingClock
) -> None:
    item_id = await store.enqueue("alpha", {"task": "t"})
    long_id = await store.enqueue("alpha", {"task": "long"})
    first = await store.claim("worker-a")
    long = await store.claim("worker-a", lease_seconds=2 * HOUR)
    assert first is not None and first.item_id == item_id
    assert long is not None and long.item_id == long_id
    assert await store.claim("worker-b") is None

    clock.jump(HOUR)
    assert (await store.stats())["expired_leases"] == 1
    second = await store.claim("worker-b")
    assert second is not None and second.item_id == item_id
    assert second.fence > first.fence and second.owner == "worker-b"
    assert await store.claim("worker-c") is None  # a two-hour lease outlives the jump

    stale: list[Callable[[], Awaitable[object]]] = [
        lambda: store.finish(item_id, fence=first.fence, result="late"),
        lambda: store.finish(item_id, fence=first.fence, status="failed", error="late"),
        lambda: store.renew(item_id, fence=first.fence),
        lambda: store.retry(item_id, fence=first.fence, error="late"),
        lambda: store.park(item_id, fence=first.fence, delay=0),
        lambda: store.offload(item_id, fence=first.fence, handle="late-batch"),
    ]
    for late in stale:
        with pytest.raises(FenceRejected):
            await late()
    row = await store.item(item_id)
    assert (row["state"], row["owner"], row["fence"]) == ("claimed", "worker-b", second.fence)

    await store.renew(item_id, fence=second.fence)
    await store.finish(item_id, fence=second.fence, result="b's")
    await store.finish(long_id, fence=long.fence, result="a's, in time")
    for late in stale:  # still refused once the item is settled
        with pytest.raises(FenceRejected):
            await late()
    types = [e["event_type"] for e in await store.events(item_id)]
    assert types == ["queued", "claimed", "lease_expired", "claimed", "done"]
    assert (await store.item(item_id))["result"] == "b's"
    assert await settled_once(store, [item_id, long_id]) == {}
    assert await verify_ledger(store) == []


async def test_a_backward_jump_lapses_nothing_and_releases_no_deferred_work_early(
    store: ControlStore, clock: JumpingClock
) -> None:
    t0 = clock.now()
    held_id = await store.enqueue("alpha", {"task": "held"})
    held = await store.claim("worker-a")  # leased until t0 + 900
    assert held is not None and held.item_id == held_id
    retried_id = await store.enqueue("alpha", {"task": "retried"})
    parked_id = await store.enqueue("alpha", {"task": "parked"})
    for item_id, settle in ((retried_id, "retry"), (parked_id, "park")):
        claim = await store.claim("worker-a")
        assert claim is not None and claim.item_id == item_id
        if settle == "retry":
            assert await store.retry(item_id, fence=claim.fence, error="e", delay=600) == (
                "deferred"
            )
        else:
            await store.park(item_id, fence=claim.fence, delay=600)
    later_id = await store.enqueue("alpha", {"task": "later"}, not_before=t0 + 600)
    deferred = [retried_id, parked_id, later_id]

    clock.jump(-HOUR)
    assert await store.claim_batch("worker-b", 10) == []  # nothing lapsed, nothing due
    assert (await store.stats())["expired_leases"] == 0
    due = await store.next_due()
    assert due is not None and due.timestamp() == t0 + 600
    # Work still flows in the hour before: enqueued, claimed and settled at that time.
    meanwhile = await store.enqueue("alpha", {"task": "meanwhile"})
    claim = await store.claim("worker-b")
    assert claim is not None and claim.item_id == meanwhile
    await store.finish(meanwhile, fence=claim.fence, result="early")

    clock.jump(HOUR - 1)  # t0 - 1: the clock is back, a second short of where it was
    assert await store.claim_batch("worker-b", 10) == []
    clock.jump(600)  # t0 + 599
    assert await store.claim_batch("worker-b", 10) == []
    clock.jump(1)  # t0 + 600: the deferred work falls due, the lease holds
    taken = await store.claim_batch("worker-b", 10)
    assert sorted(c.item_id for c in taken) == sorted(deferred)
    assert {c.attempts for c in taken} == {1, 2}  # a park gave its attempt back
    await store.finish(held_id, fence=held.fence, result="a's")  # never taken over
    for claim in taken:
        await store.finish(claim.item_id, fence=claim.fence, result="b's")
    assert await settled_once(store, [held_id, meanwhile, *deferred]) == {}
    held_types = [e["event_type"] for e in await store.events(held_id)]
    assert held_types == ["queued", "claimed", "done"]
    assert await verify_ledger(store) == []


async def test_a_lease_holds_through_a_backward_jump_and_lapses_on_its_own_time(
    store: ControlStore, clock: JumpingClock
) -> None:
    t0 = clock.now()
    item_id = await store.enqueue("alpha", {})
    first = await store.claim("worker-a")
    assert first is not None
    clock.jump(-HOUR)
    assert await store.claim("worker-b") is None
    clock.jump(HOUR + store.lease_seconds - 1)  # t0 + 899
    assert await store.claim("worker-b") is None
    clock.jump(1)  # t0 + 900: lapsed by its own measure, not earlier
    second = await store.claim("worker-b")
    assert second is not None and second.fence > first.fence
    with pytest.raises(FenceRejected):
        await store.finish(item_id, fence=first.fence)
    await store.finish(item_id, fence=second.fence)
    assert clock.now() == t0 + store.lease_seconds
    assert await settled_once(store, [item_id]) == {}
    assert await verify_ledger(store) == []


async def test_a_drain_settles_every_item_once_while_the_clock_jumps_back_and_forth(
    asyncplane_store_factory: Any, clock: JumpingClock
) -> None:
    store: ControlStore = await asyncplane_store_factory("jumps.db", retry_backoff=20)
    rival: ControlStore = await asyncplane_store_factory("jumps.db")  # another worker
    await store.create_project("p", "P")
    count = 60
    ids = await store.enqueue_many("p", [{"n": n} for n in range(count)])
    rng = random.Random(20260101)

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        for _ in range(rng.randrange(6)):  # the rival and the jumps get in between
            await asyncio.sleep(0)
        outcomes: list[Outcome] = []
        for claim in batch:
            n = claim.payload["n"]
            if claim.attempts == 1 and n % 4 == 1:
                outcomes.append(Retry("flaky"))
            elif claim.attempts == 1 and n % 4 == 2:
                outcomes.append(Park(30))
            elif n % 9 == 0:
                outcomes.append(Failed("deterministic"))
            else:
                outcomes.append(Done({"n": n}))
        return outcomes

    stop = asyncio.Event()
    drainer = asyncio.create_task(
        drain(store, execute, mode="daemon", stop=stop, batch_size=5, poll_interval=0.01)
    )
    abandoned: list[ClaimedItem] = []  # rival claims left to lapse
    rival_done = jumps = 0
    deadline = time.monotonic() + 30
    while True:
        counts = await store.counts(project_id="p")
        if counts["done"] + counts["failed"] == count:
            break
        assert time.monotonic() < deadline, f"the drain did not settle everything: {counts}"
        jumps += 1
        if jumps % 2:
            clock.jump(HOUR)  # every lease lapses: the rival may take a running item over
            claim = await rival.claim("rival", project_id="p")
            if claim is not None:
                if rng.random() < 0.5:
                    with contextlib.suppress(FenceRejected):
                        await rival.finish(claim.item_id, fence=claim.fence, result="rival")
                        rival_done += 1
                else:
                    abandoned.append(claim)
        else:
            clock.jump(-HOUR + 40)  # back again, a little later than before
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
    stop.set()
    summary = await drainer
    for claim in abandoned:  # the rival's late reports are refused
        with pytest.raises(FenceRejected):
            await rival.finish(claim.item_id, fence=claim.fence, result="too late")
    assert await settled_once(store, ids) == {}
    assert await verify_ledger(store) == []
    assert await lock_is_free(store)
    assert summary.done + summary.failed + rival_done == count
    # The jumps did what they are for: takeovers happened, and were refused as stale.
    takeovers = 0
    for item_id in ids:
        takeovers += sum(e["event_type"] == "lease_expired" for e in await store.events(item_id))
    assert takeovers > 0
    print(
        f"clock jumps: {jumps}, takeovers {takeovers}, drain fence_rejected "
        f"{summary.fence_rejected}, rival settled {rival_done}, abandoned {len(abandoned)}"
    )


# --- 2. cancellation storms ----------------------------------------------------------------


@dataclasses.dataclass
class Storm:
    """What a storm's case works on: the store under test and its surroundings."""

    store: ControlStore
    location: str
    clock: JumpingClock
    tmp_path: pathlib.Path
    others: list[ControlStore] = dataclasses.field(default_factory=list)

    def another(self, **options: Any) -> ControlStore:
        """A second store on the same database (closed with the storm)."""
        other = ControlStore(self.location, clock=self.clock, **options)
        self.others.append(other)
        return other


#: The first rounds of a storm run uncancelled, to measure how long the call takes.
CALIBRATION = 4


class Case:
    """One public coroutine under a cancellation storm.

    ``call`` is started as a task and cancelled after some event-loop steps; ``check``
    then gets whether it finished (and its result) and must find that it happened
    completely or not at all.
    """

    rounds = 40
    writes = True  # check the writer has served the call, verify the ledger

    async def prepare(self, s: Storm) -> None:
        """Once, before the rounds."""

    async def setup(self, s: Storm, r: int) -> Any:
        """Before each round: what the call works on, and what check compares with."""
        return r

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        raise NotImplementedError

    async def quiesce(self, s: Storm) -> None:
        """After each round, before check: wait until what the call sent has landed."""
        await barrier(s.store)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        """After each round."""

    async def final(self, s: Storm) -> None:
        """Once, after the rounds: settle what the storm left behind and check it."""


async def total(store: ControlStore, **scope: Any) -> int:
    return sum((await store.counts(**scope)).values())


async def event_types(store: ControlStore, item_id: int) -> list[str]:
    return [e["event_type"] for e in await store.events(item_id)]


class Enqueue(Case):
    async def setup(self, s: Storm, r: int) -> Any:
        return r, await total(s.store)

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.enqueue("alpha", {"r": ctx[0]})

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        added = await total(s.store) - ctx[1]
        assert added in (0, 1)
        if finished:
            assert added == 1
            assert (await s.store.item(result))["payload"] == {"r": ctx[0]}
            assert await event_types(s.store, result) == ["queued"]


class EnqueueMany(Case):
    async def setup(self, s: Storm, r: int) -> Any:
        return r, await total(s.store)

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.enqueue_many("alpha", [{"r": ctx[0], "k": k} for k in range(4)])

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        added = await total(s.store) - ctx[1]
        assert added in (0, 4)  # one transaction: all of them or none
        if finished:
            assert added == 4 and len(set(result)) == 4
            for item_id in result:
                assert await event_types(s.store, item_id) == ["queued"]


class Claim(Case):
    limit = 1

    async def setup(self, s: Storm, r: int) -> Any:
        await s.store.enqueue_many("alpha", [{"r": r, "k": k} for k in range(self.limit)])
        return (await s.store.counts())["claimed"]

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        if self.limit == 1:
            return s.store.claim("storm")
        return s.store.claim_batch("storm", self.limit)

    async def quiesce(self, s: Storm) -> None:
        # The claim's round answered, and a give-back queued then: a write behind both.
        await barrier(s.store)
        await barrier(s.store)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        # A claim cancelled while its round ran took its items for nobody: they are given
        # back at once (released: ready again), never left to their leases.
        added = (await s.store.counts())["claimed"] - ctx
        assert added == (self.limit if finished else 0)
        if finished:
            claims = [result] if self.limit == 1 else result
            assert added == self.limit and len(claims) == self.limit
            for claim in claims:
                row = await s.store.item(claim.item_id)
                assert (row["state"], row["fence"]) == ("claimed", claim.fence)

    async def final(self, s: Storm) -> None:
        s.clock.advance(s.store.lease_seconds + 1)  # every stranded claim lapses ...
        everything = await total(s.store)
        swept = await s.store.claim_batch("sweeper", everything + 1)
        assert len(swept) == everything  # ... and is taken over, with the ready ones
        for claim in swept:
            await s.store.finish(claim.item_id, fence=claim.fence)
        assert (await s.store.counts())["done"] == everything


class ClaimBatch(Claim):
    limit = 3


class Renew(Case):
    async def prepare(self, s: Storm) -> None:
        await s.store.enqueue("alpha", {})
        claim = await s.store.claim("storm")
        assert claim is not None
        self.claim = claim

    async def setup(self, s: Storm, r: int) -> Any:
        s.clock.advance(1)  # so that a renewal shows
        return (await s.store.item(self.claim.item_id))["lease_expires_at"]

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.renew(self.claim.item_id, fence=self.claim.fence)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        lease = (await s.store.item(self.claim.item_id))["lease_expires_at"]
        renewed = s.clock.now() + s.store.lease_seconds
        assert lease == ctx or lease.timestamp() == renewed
        if finished:
            assert lease == result and result.timestamp() == renewed

    async def final(self, s: Storm) -> None:
        await s.store.finish(self.claim.item_id, fence=self.claim.fence)
        assert await event_types(s.store, self.claim.item_id) == ["queued", "claimed", "done"]


class Settle(Case):
    """finish / retry / park / offload of a fresh claim each round."""

    kind = ""
    becomes = ""
    event = ""

    async def setup(self, s: Storm, r: int) -> Any:
        await s.store.enqueue("alpha", {"r": r})
        claim = await s.store.claim("storm")
        assert claim is not None and claim.payload == {"r": r}
        return r, claim

    def settle(self, s: Storm, r: int, claim: ClaimedItem) -> Coroutine[Any, Any, Any]:
        store, item_id, fence = s.store, claim.item_id, claim.fence
        if self.kind == "finish":
            return store.finish(item_id, fence=fence, result={"r": r})
        if self.kind == "retry":
            return store.retry(item_id, fence=fence, error=f"r{r}", delay=HOUR)
        if self.kind == "park":
            return store.park(item_id, fence=fence, delay=HOUR)
        return store.offload(item_id, fence=fence, handle=f"batch-{r}")

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return self.settle(s, *ctx)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        r, claim = ctx
        row = await s.store.item(claim.item_id)
        assert row["state"] in (self.becomes, "claimed")
        if finished:
            assert row["state"] == self.becomes
        if row["state"] == "claimed":  # not saved at all: the claim is still good
            assert row["fence"] == claim.fence
            await self.settle(s, r, claim)
            row = await s.store.item(claim.item_id)
        types = await event_types(s.store, claim.item_id)
        assert types == ["queued", "claimed", self.event]
        if self.kind == "finish":
            assert row["result"] == {"r": r}
        elif self.kind == "park":
            assert row["attempts"] == 0  # given back
        elif self.kind == "offload":
            await s.store.finish(claim.item_id, fence=claim.fence, result="from the batch")
        if self.kind in ("retry", "park"):
            assert row["due_at"].timestamp() == s.clock.now() + HOUR


class Finish(Settle):
    kind, becomes, event = "finish", "done", "done"


class FinishAndClaim(Case):
    """finish_and_claim: the settle stands or not; the next item is the caller's (the
    call finished) or ready again (cancelled: given back), never held by nobody."""

    async def setup(self, s: Storm, r: int) -> Any:
        ids = await s.store.enqueue_many("alpha", [{"r": r, "k": k} for k in range(2)])
        claim = await s.store.claim("storm")
        assert claim is not None and claim.item_id == ids[0]
        return r, claim, ids[1]

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        r, claim, _ = ctx
        return s.store.finish_and_claim(
            claim.item_id, fence=claim.fence, owner="storm", result={"r": r}
        )

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        r, claim, next_id = ctx
        row = await s.store.item(claim.item_id)
        assert row["state"] in ("done", "claimed")
        if row["state"] == "claimed":  # not saved at all: the claim is still good
            assert not finished and row["fence"] == claim.fence
            await s.store.finish(claim.item_id, fence=claim.fence, result={"r": r})
        assert await event_types(s.store, claim.item_id) == ["queued", "claimed", "done"]
        following = await s.store.item(next_id)
        if finished:
            assert result is not None and result.item_id == next_id
            assert (following["state"], following["fence"]) == ("claimed", result.fence)
        else:
            assert following["state"] == "ready", "a cancelled call left its claim held"
            result = await s.store.claim("storm")
            assert result is not None and result.item_id == next_id
        await s.store.finish(next_id, fence=result.fence)


class RetryCall(Settle):
    kind, becomes, event = "retry", "deferred", "retried"


class ParkCall(Settle):
    kind, becomes, event = "park", "deferred", "parked"


class OffloadCall(Settle):
    kind, becomes, event = "offload", "offloaded", "offloaded"


class Read(Case):
    """A read: it returns what it read or nothing; the store must go on reading."""

    rounds = 30
    writes = False
    what = ""

    async def prepare(self, s: Storm) -> None:
        self.ids = await s.store.enqueue_many("alpha", [{"k": k} for k in range(3)])
        claims = await s.store.claim_batch("storm", 2)
        for claim in claims:
            await s.store.offload(claim.item_id, fence=claim.fence, handle="h")
        self.due = s.clock.now() + 600
        await s.store.enqueue("alpha", {"later": True}, not_before=self.due)
        await s.store.assign("alpha", "reader")

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        store = s.store
        calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
            "offloaded": lambda: store.offloaded("h"),
            "item": lambda: store.item(self.ids[2]),
            "events": lambda: store.events(self.ids[0]),
            "counts": lambda: store.counts(),
            "stats": lambda: store.stats(),
            "next_due": lambda: store.next_due(),
            "projects": lambda: store.projects(),
            "project": lambda: store.project("alpha"),
            "visible_projects": lambda: store.visible_projects("reader"),
        }
        return calls[self.what]()

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        if not finished:
            return
        if self.what == "offloaded":
            assert sorted(row["item_id"] for row in result) == self.ids[:2]
        elif self.what == "item":
            assert (result["item_id"], result["state"]) == (self.ids[2], "ready")
        elif self.what == "events":
            assert [e["event_type"] for e in result] == ["queued", "claimed", "offloaded"]
        elif self.what == "counts":
            assert (result["ready"], result["offloaded"], result["deferred"]) == (1, 2, 1)
        elif self.what == "stats":
            assert result["items"] == 4
        elif self.what == "next_due":
            assert result is not None and result.timestamp() == self.due
        elif self.what == "projects":
            assert [p["project_id"] for p in result] == ["alpha"]
        elif self.what == "project":
            assert result["project_id"] == "alpha"
        else:
            assert result == ["alpha"]


def read_case(what: str) -> type[Read]:
    return type(f"Read_{what}", (Read,), {"what": what})


class CreateProject(Case):
    async def setup(self, s: Storm, r: int) -> Any:
        return r, len(await s.store.projects())

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.create_project(f"p{ctx[0]}", f"Project {ctx[0]}")

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        r, before = ctx
        try:
            project = await s.store.project(f"p{r}")
        except UnknownProject:
            assert not finished
            assert len(await s.store.projects()) == before
        else:
            assert project["name"] == f"Project {r}"
            assert len(await s.store.projects()) == before + 1


class SetProjectStatus(Case):
    async def setup(self, s: Storm, r: int) -> Any:
        old = (await s.store.project("alpha"))["status"]
        return old, "paused" if old == "open" else "open"

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.set_project_status("alpha", ctx[1])

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        status = (await s.store.project("alpha"))["status"]
        assert status in ctx
        if finished:
            assert status == ctx[1]


class Assign(Case):
    undo = False

    async def setup(self, s: Storm, r: int) -> Any:
        actor = f"actor-{r}"
        if self.undo:
            await s.store.assign("alpha", actor)
        return actor

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        if self.undo:
            return s.store.unassign("alpha", ctx)
        return s.store.assign("alpha", ctx)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        visible = await s.store.visible_projects(ctx)
        assert visible in ([], ["alpha"])
        if finished:
            assert visible == ([] if self.undo else ["alpha"])


class Unassign(Assign):
    undo = True


class Dedup(Case):
    rounds = 25

    async def prepare(self, s: Storm) -> None:
        # Items enqueued without fingerprints (by a store without an identity) whose twin
        # is done: a store with an identity fills the fingerprints in, then settles them.
        self.ident = s.another(identity=("task",))
        self.twins: dict[int, int] = {}  # pending twin -> the round whose item is done

    async def setup(self, s: Storm, r: int) -> Any:
        await self.ident.dedup_pending_against_done()  # the same work for every round
        await s.store.create_project(f"d{r}", f"D{r}")
        first, *twins = await s.store.enqueue_many(f"d{r}", [{"task": f"t{r}"}] * 3)
        claim = await s.store.claim("storm", project_id=f"d{r}")
        assert claim is not None and claim.item_id == first
        await s.store.finish(first, fence=claim.fence, result={"r": r})
        self.twins.update(dict.fromkeys(twins, r))
        return twins

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return self.ident.dedup_pending_against_done(chunk=1)

    async def quiesce(self, s: Storm) -> None:
        await barrier(self.ident)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        for twin in ctx:
            row = await s.store.item(twin)
            assert row["state"] in ("ready", "done")
            if finished:
                assert row["state"] == "done"
        await self.twins_agree(s, ctx)

    async def twins_agree(self, s: Storm, twins: list[int], *, all_done: bool = False) -> None:
        for twin in twins:
            r = self.twins[twin]
            row = await s.store.item(twin)
            if row["state"] == "done":
                assert row["result"] == {"r": r}
                assert await event_types(s.store, twin) == ["queued", "done"]
            else:
                assert not all_done and row["state"] == "ready"

    async def final(self, s: Storm) -> None:
        await self.ident.dedup_pending_against_done()
        await self.twins_agree(s, list(self.twins), all_done=True)


class Purge(Case):
    rounds = 25

    async def prepare(self, s: Storm) -> None:
        self.archive = s.tmp_path / "storm-archive.jsonl"
        self.made: list[int] = []

    def archived(self) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        if self.archive.exists():
            for line in self.archive.read_text().splitlines():
                record = json.loads(line)
                found[record["item"]["item_id"]] = [e["event_type"] for e in record["events"]]
        return found

    async def setup(self, s: Storm, r: int) -> Any:
        await s.store.purge(60, archive_path=self.archive)  # the same work for every round
        ids = await s.store.enqueue_many("alpha", [{"r": r, "k": k} for k in range(3)])
        for claim in await s.store.claim_batch("storm", 3):
            await s.store.finish(claim.item_id, fence=claim.fence)
        s.clock.advance(120)  # older than the retention now
        self.made.extend(ids)
        return ids

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.purge(60, chunk=1, archive_path=self.archive)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        await self.kept_or_archived(s, ctx, purged=finished)

    async def kept_or_archived(self, s: Storm, ids: list[int], *, purged: bool) -> None:
        archived = self.archived()
        for item_id in ids:
            try:
                row = await s.store.item(item_id)
            except UnknownItem:  # deleted: never before it was archived, whole
                assert archived.get(item_id) == ["queued", "claimed", "done"]
            else:
                assert not purged and row["state"] == "done"
                assert await event_types(s.store, item_id) == ["queued", "claimed", "done"]

    async def final(self, s: Storm) -> None:
        await s.store.purge(60, archive_path=self.archive)
        await self.kept_or_archived(s, self.made, purged=True)
        assert await total(s.store) == 0


_OPENER: contextvars.ContextVar[str] = contextvars.ContextVar("opener", default="nobody's")


async def test_the_stores_own_tasks_run_in_no_callers_context(location_of: Any) -> None:
    # Whichever call opens a store starts its writer, its readers' keeper, its gauges:
    # made in that caller's context, they kept its variables as long as they ran (a
    # work() handler's item, which the worker command's log lines then named for ever).
    _OPENER.set("a handler's")

    async def seen() -> str:
        return _OPENER.get()

    assert await _tasks.detached(seen(), "asyncplane-test-context") == "nobody's"
    async with ControlStore(location_of("ctx.db")) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
        own = [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncplane-writer")]
        assert own
        if sys.version_info >= (3, 12):  # a task's context can be read from 3.12 on
            for task in own:
                assert task.get_context().get(_OPENER, "nobody's") == "nobody's", task


def writer_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncplane-writer[")]


class Open(Case):
    rounds = 25

    async def setup(self, s: Storm, r: int) -> Any:
        await s.store.close()
        return r

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.open()

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        if finished:
            assert result is s.store
        await s.store.enqueue("alpha", {"r": ctx})  # opens it if the open was cut short
        assert len(writer_tasks()) == 1


class Close(Case):
    rounds = 25

    async def setup(self, s: Storm, r: int) -> Any:
        before = await total(s.store)  # open
        queued = [asyncio.create_task(s.store.enqueue("alpha", {"r": r})) for _ in range(4)]
        await asyncio.sleep(0)  # they are queued for the writer before the close begins
        return before, queued

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return s.store.close()

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        before, queued = ctx
        await asyncio.gather(*queued)  # writes queued before a close are served
        assert await total(s.store) == before + 4  # and the store opens again
        deadline = time.monotonic() + 10
        while len(writer_tasks()) > 1:  # a close cut short still ends its old writer
            assert time.monotonic() < deadline, "an old writer never ended"
            await asyncio.sleep(0.001)


class Drain(Case):
    rounds = 30

    async def prepare(self, s: Storm) -> None:
        self.ids: list[int] = []
        self.rng = random.Random(7)

    async def execute(self, batch: list[ClaimedItem]) -> list[Outcome]:
        for _ in range(self.rng.randrange(4)):
            await asyncio.sleep(0)
        return [Done({"r": claim.payload["r"]}) for claim in batch]

    async def setup(self, s: Storm, r: int) -> Any:
        # What a cancelled round left is drained first, so that every round's call drains
        # three items, as the calibration rounds did. A growing backlog made each call
        # longer than the storm's cancel points reach, until none finished at all.
        await drain(s.store, self.execute)
        ids = await s.store.enqueue_many("alpha", [{"r": r, "k": k} for k in range(3)])
        self.ids.extend(ids)
        daemon = r >= CALIBRATION and r % 4 == 3  # a daemon ends only by cancellation
        return ("daemon" if daemon else "foreground"), ids

    def call(self, s: Storm, ctx: Any) -> Coroutine[Any, Any, Any]:
        return drain(s.store, self.execute, batch_size=2, mode=ctx[0], empty_rounds=1)

    async def check(self, s: Storm, ctx: Any, finished: bool, result: Any) -> None:
        counts = await s.store.counts()
        assert counts["claimed"] == 0, "a cancelled drain left its batch claimed"
        assert await lock_is_free(s.store), "a cancelled drain left its lock held"
        for item_id in ctx[1]:  # (two settlements of any item: verify_ledger says)
            row = await s.store.item(item_id)
            assert len(await terminal_events(s.store, item_id)) == (row["state"] == "done")
            assert row["state"] in ("ready", "deferred", "done")
        if finished:
            assert result.remaining == 0 and counts["done"] == len(self.ids)

    async def final(self, s: Storm) -> None:
        summary = await drain(s.store, self.execute)
        assert summary.remaining == 0
        assert await settled_once(s.store, self.ids) == {}


READS = (
    "offloaded", "item", "events", "counts", "stats", "next_due", "projects", "project",
    "visible_projects",
)  # fmt: skip

CASES: dict[str, type[Case]] = {
    "enqueue": Enqueue,
    "enqueue_many": EnqueueMany,
    "claim": Claim,
    "claim_batch": ClaimBatch,
    "renew": Renew,
    "finish": Finish,
    "finish_and_claim": FinishAndClaim,
    "retry": RetryCall,
    "park": ParkCall,
    "offload": OffloadCall,
    **{what: read_case(what) for what in READS},
    "create_project": CreateProject,
    "set_project_status": SetProjectStatus,
    "assign": Assign,
    "unassign": Unassign,
    "dedup_pending_against_done": Dedup,
    "purge": Purge,
    "open": Open,
    "close": Close,
    "drain": Drain,
}


def tagged(location: str, tag: str) -> str:
    """A PostgreSQL URL whose sessions carry ``application_name=tag`` (to count them)."""
    parts = urllib.parse.urlsplit(location)
    query = [*urllib.parse.parse_qsl(parts.query), ("application_name", tag)]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


async def sessions(server: str, tag: str) -> int:
    """The server's sessions of the store tagged ``tag``."""
    import asyncpg

    conn = await asyncpg.connect(server)
    try:
        found: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", tag
        )
        return found
    finally:
        await conn.close()


def open_connections(tag: str) -> list[Any]:
    """This process's asyncpg pools and connections of the store tagged ``tag`` still
    open (one nobody holds any more is found too, until it is garbage-collected)."""
    import asyncpg

    gc.collect()
    found: list[Any] = []
    for thing in gc.get_objects():
        if isinstance(thing, asyncpg.Pool) and not getattr(thing, "_closed", True):
            if any(tag in str(arg) for arg in getattr(thing, "_connect_args", ())):
                found.append(thing)
        elif isinstance(thing, asyncpg.Connection) and not thing.is_closed():
            settings = getattr(thing, "_params").server_settings or {}  # noqa: B009
            found += [thing] if settings.get("application_name") == tag else []
    return found


async def terminate(leaked: list[Any], tag: str) -> None:
    """Terminate leaked pools (first: a pool replaces a connection it loses) and
    connections, until none is left."""
    import asyncpg

    for _ in range(5):
        if not leaked:
            return
        for thing in sorted(leaked, key=lambda thing: not isinstance(thing, asyncpg.Pool)):
            thing.terminate()
        await asyncio.sleep(0.01)  # the transports close on the loop's next rounds
        leaked = open_connections(tag)


def connection_threads() -> set[threading.Thread]:
    return {
        t for t in threading.enumerate() if "_connection_worker_thread" in t.name and t.is_alive()
    }


async def cancelled_after(
    work: Coroutine[Any, Any, Any], steps: int, sleep: float | None
) -> tuple[bool, Any]:
    """Run ``work`` as a task and cancel it after ``steps`` loop steps (or a real sleep):
    whether it finished first, and its result."""
    task = asyncio.create_task(work)
    if sleep is not None:
        await asyncio.sleep(sleep)
    else:
        for _ in range(steps):
            await asyncio.sleep(0)
    requested = task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        return False, None
    assert not requested, "a cancelled call swallowed its cancellation"
    return True, result


async def measured(work: Coroutine[Any, Any, Any]) -> tuple[int, float, Any]:
    """Run ``work`` to its end as a task: the loop steps and seconds it took, its result."""
    task = asyncio.create_task(work)
    started, steps = time.perf_counter(), 0
    while not task.done():
        await asyncio.sleep(0)
        steps += 1
    return steps, time.perf_counter() - started, task.result()


async def barrier(store: ControlStore) -> None:
    """Wait until every write sent so far has been served: a write cancelled while its
    round ran still commits after its caller has gone, and the writer serves in order."""
    await store.assign("alpha", "barrier")


@pytest.mark.parametrize("name", list(CASES))
async def test_a_cancellation_storm_leaves_every_call_whole_or_undone(
    name: str,
    asyncplane_backend: str,
    asyncplane_store_factory: Any,
    clock: JumpingClock,
    tmp_path: pathlib.Path,
    request: pytest.FixtureRequest,
) -> None:
    case = CASES[name]()
    location = str(await asyncplane_store_factory.location("storm.db"))
    tag = f"storm-{name}-{time.monotonic_ns()}"
    server = None
    if asyncplane_backend == "postgresql":
        server = request.getfixturevalue("asyncplane_postgres_url")
        location = tagged(location, tag)
    threads_before = connection_threads()
    s = Storm(ControlStore(location, clock=clock), location, clock, tmp_path)
    rng = random.Random(f"{name}-{asyncplane_backend}")
    outcomes: collections.Counter[bool] = collections.Counter()
    try:
        await s.store.create_project("alpha", "Project Alpha")
        await case.prepare(s)
        # Rounds 0 to 3 run uncancelled and, but for the first (which opens connections),
        # measure how long the call takes; the others cancel it after 0 to twice as many
        # loop steps (uniformly, or more often few than many), or one in five after a
        # real sleep of up to three times as long.
        took: list[tuple[int, float]] = []
        for r in range(CALIBRATION):
            ctx = await case.setup(s, r)
            steps, seconds, result = await measured(case.call(s, ctx))
            await case.check(s, ctx, True, result)
            took.append((steps, seconds))
        most = max(steps for steps, _ in took[1:]) * 2 + 1
        longest = max(seconds for _, seconds in took[1:]) * 3

        async def storm_round(r: int, steps: int, sleep: float | None) -> None:
            ctx = await case.setup(s, r)
            finished, result = await cancelled_after(case.call(s, ctx), steps, sleep)
            if steps or sleep is not None:  # (cancelled before its first step: never ran)
                outcomes[finished] += 1
            if case.writes:
                await case.quiesce(s)
            await case.check(s, ctx, finished, result)
            if case.writes and r % 4 == 0:
                assert await verify_ledger(s.store) == [], f"round {r}"

        for r in range(CALIBRATION, case.rounds):
            sleep = rng.uniform(0, longest) if r % 5 == 0 else None
            steps = (r - CALIBRATION) ** 2 * most // case.rounds**2
            if r % 2:
                steps = rng.randrange(most + 1)
            await storm_round(r, steps, sleep)
        # A loaded machine can stretch every call past the budgets the calibration gave:
        # then more rounds, each with twice the budget, until one ends (or with one step,
        # until one is cut short once it has begun).
        for r in range(case.rounds, case.rounds + 16):
            if outcomes[False] and outcomes[True]:
                break
            await storm_round(r, 1 if outcomes[True] else most << (r - case.rounds + 1), None)
        await case.final(s)
        assert await verify_ledger(s.store) == []
        assert await lock_is_free(s.store)
        # The store still works: readers all free, a claim, a settlement.
        await asyncio.wait_for(asyncio.gather(*(s.store.counts() for _ in range(6))), 30)
        item_id = await s.store.enqueue("alpha", {"after": "the storm"}, priority=99)
        await s.store.set_project_status("alpha", "open")
        claim = await s.store.claim("after-the-storm")
        assert claim is not None and claim.item_id == item_id
        await s.store.finish(item_id, fence=claim.fence)
        assert await verify_ledger(s.store) == []
    finally:
        for store in (s.store, *s.others):
            await store.close()
        leaked = open_connections(tag) if server is not None else []
        await terminate(leaked, tag)  # so that they do not warn in some later test
    # Both outcomes were seen: the storm hit the call before and after its end.
    assert outcomes[False] > 0 and outcomes[True] > 0, dict(outcomes)
    # No connection outlives the store.
    deadline = time.monotonic() + 10
    if server is not None:
        assert leaked == [], f"the closed store left open: {leaked}"
        while (left := await sessions(server, tag)) != 0:
            assert time.monotonic() < deadline, f"{left} PostgreSQL sessions left open"
            await asyncio.sleep(0.01)
    else:
        for thread in connection_threads() - threads_before:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        assert connection_threads() - threads_before == set(), "connection threads left"


# --- 3. PostgreSQL stopped and started again mid-drain ----------------------------------


class RestartableCluster(testing.PostgresCluster):
    """A PostgresCluster that can crash (``pg_ctl -m immediate``, as its ``stop()`` does,
    but keeping the data directory) and start again on the same data directory.

    testing.PostgresCluster has no ``crash()`` / ``restart()``; these repeat the pg_ctl
    commands of its ``start()`` and ``stop()`` (and read its private attributes).
    """

    def _pg_ctl(self, *args: str) -> list[str]:
        pg_ctl = testing._postgres_bindir() / "pg_ctl"
        return [str(pg_ctl), "-D", str(self.socket_dir / "data"), *args]

    def crash(self) -> None:
        """Stop the server at once, as a power cut would (WAL replay on the next start)."""
        self._run(self._pg_ctl("-m", "immediate", "-w", "stop"), "pg_ctl stop -m immediate")

    def restart(self) -> None:
        """Start the server again on the same data directory, socket and settings."""
        root = self.socket_dir
        options = [f"-k {root}", "-c listen_addresses=''", "-c max_connections=200"]
        if not self._fsync:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        options += [f"-c {key}={value}" for key, value in self._settings.items()]
        self._run(
            self._pg_ctl("-l", str(root / "server.log"), "-o", " ".join(options), "-w", "-t",
                         "60", "start"),
            "pg_ctl start",
        )  # fmt: skip

    def running(self) -> bool:
        status = subprocess.run(
            [*self._as, *self._pg_ctl("status")], capture_output=True, check=False, timeout=60
        )
        return status.returncode == 0


@pytest.fixture(scope="module")
def crash_cluster() -> Iterator[RestartableCluster]:
    """One throwaway cluster, fsync on, for the restart tests (a schema each)."""
    cluster = RestartableCluster(fsync=True)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.asynccontextmanager
async def store_on(
    cluster: RestartableCluster, schema: str, clock: JumpingClock
) -> AsyncIterator[ControlStore]:
    import asyncpg

    if not await asyncio.to_thread(cluster.running):  # an earlier test failed mid-way
        await asyncio.to_thread(cluster.restart)
    admin = await asyncpg.connect(cluster.url())
    try:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}")
    finally:
        await admin.close()
    store = ControlStore(cluster.url(schema=schema), clock=clock)
    try:
        await store.create_project("p", "P")
        yield store
    finally:
        if not await asyncio.to_thread(cluster.running):
            await asyncio.to_thread(cluster.restart)
        await store.close()


class Gate:
    """An executor whose batches settle Done at once, except batch number ``hold``, which
    waits for ``release`` (``started`` says it is running)."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.calls = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.ran: collections.Counter[int] = collections.Counter()  # item -> executions
        self.held: list[ClaimedItem] = []

    async def __call__(self, batch: list[ClaimedItem]) -> list[Outcome]:
        self.calls += 1
        self.ran.update(claim.item_id for claim in batch)
        if self.calls == self.hold:
            self.held = list(batch)
            self.started.set()
            await self.release.wait()
        return [Done({"n": claim.payload["n"]}) for claim in batch]


async def recovering(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, again while the store reconnects after a restart. The calls in flight
    then fail: the first write with StorageError, and (see the report) the next write and
    the reads in flight while the store reopens with StoreClosed."""
    for attempt in range(10):
        try:
            return await call()
        except (StorageError, StoreClosed):
            if attempt == 9:
                raise
    raise AssertionError("unreachable")


async def ended(task: asyncio.Task[Any], within: float) -> BaseException | None:
    """Wait (at most ``within`` seconds) for a drain task to end; what it raised."""
    await asyncio.wait([task], timeout=within)
    assert task.done(), f"the drain did not end within {within} s"
    return task.exception()


async def all_settled_once(store: ControlStore, ids: list[int]) -> None:
    assert await settled_once(store, ids) == {}
    for item_id in ids:
        assert (await store.item(item_id))["result"] == {"n": ids.index(item_id)}
    assert await verify_ledger(store) == []
    assert await lock_is_free(store)


async def test_postgres_restarted_while_a_batch_executes(
    crash_cluster: RestartableCluster, clock: JumpingClock
) -> None:
    async with store_on(crash_cluster, "mid_batch", clock) as store:
        ids = await store.enqueue_many("p", [{"n": n} for n in range(30)])  # acknowledged
        gate = Gate(hold=2)
        stop = asyncio.Event()
        drainer = asyncio.create_task(
            drain(store, gate, mode="daemon", stop=stop, batch_size=10, poll_interval=0.02)
        )
        await gate.started.wait()  # batch 1 is settled (acknowledged), batch 2 runs
        acknowledged = [i for i in ids if (await store.item(i))["state"] == "done"]
        assert len(acknowledged) == 10

        await asyncio.to_thread(crash_cluster.crash)
        await asyncio.to_thread(crash_cluster.restart)
        gate.release.set()  # its outcomes now meet a store whose connections are gone
        deadline = time.monotonic() + 30
        while not drainer.done():
            counts = await recovering(store.counts)  # the store reconnects by itself
            if counts["done"] == 30:
                stop.set()
                break
            assert time.monotonic() < deadline, counts
            await asyncio.wait([drainer], timeout=0.01)
        failure = await ended(drainer, 30)
        # The first settlement after the restart meets the dead write connection: the
        # drain settles what it can, puts the rest back and stops with DrainError.
        assert failure is None or isinstance(failure, DrainError), repr(failure)
        counts = await store.counts()
        assert counts["claimed"] == 0, counts  # nothing stranded: the put-back worked
        again = await drain(store, gate)  # a new drain settles the rest
        assert again.remaining == 0
        await all_settled_once(store, ids)
        for item_id in acknowledged:  # settled before the crash, kept through it
            assert await event_types(store, item_id) == ["queued", "claimed", "done"]
        print(
            f"restart mid-batch: the drain ended with {failure!r}; "
            f"{counts['deferred']} put back, {again.done} settled by a new drain; "
            f"executed twice: {sorted(i for i, n in gate.ran.items() if n > 1)}"
        )


async def test_postgres_down_when_the_lease_renewer_must_renew(
    crash_cluster: RestartableCluster, clock: JumpingClock
) -> None:
    async with store_on(crash_cluster, "renewer_down", clock) as store:
        ids = await store.enqueue_many("p", [{"n": n} for n in range(30)])
        gate = Gate(hold=1)
        drainer = asyncio.create_task(drain(store, gate, batch_size=10))
        await gate.started.wait()
        await asyncio.to_thread(crash_cluster.crash)
        clock.advance(store.lease_seconds / 3 + 1)  # the renewer wakes: the server is down
        failure = await ended(drainer, 60)  # it does not wait for the server
        await asyncio.to_thread(crash_cluster.restart)

        # Its batch could not be put back while the server was down: it stays claimed
        # until the leases lapse; a new drain settles everything else meanwhile.
        held = [c.item_id for c in gate.held]
        assert {(await store.item(i))["state"] for i in held} == {"claimed"}
        second = await drain(store, gate)
        assert (second.done, second.remaining) == (20, 10)
        clock.advance(store.lease_seconds)  # the stranded leases lapse: taken over
        third = await drain(store, gate)
        assert (third.done, third.remaining) == (10, 0)
        await all_settled_once(store, ids)
        for item_id in held:
            types = await event_types(store, item_id)
            assert types == ["queued", "claimed", "lease_expired", "claimed", "done"]
        print(f"renewal while the server is down: the drain ended with {failure!r}")
        # As documented for a failing renewer: DrainError, the renewer's error its cause.
        assert isinstance(failure, DrainError), repr(failure)
        assert isinstance(failure.__cause__, StorageError), repr(failure.__cause__)


async def test_postgres_down_while_a_daemon_drain_is_idle(
    crash_cluster: RestartableCluster, clock: JumpingClock
) -> None:
    async with store_on(crash_cluster, "idle_down", clock) as store:
        ids = await store.enqueue_many("p", [{"n": n} for n in range(5)])
        gate = Gate(hold=0)
        stop = asyncio.Event()
        drainer = asyncio.create_task(
            drain(store, gate, mode="daemon", stop=stop, poll_interval=0.02)
        )
        deadline = time.monotonic() + 30
        while not any(t.get_name() == "asyncplane-wait-work-commit" for t in asyncio.all_tasks()):
            assert time.monotonic() < deadline and not drainer.done()
            await asyncio.wait([drainer], timeout=0.01)
        assert (await store.counts())["done"] == 5
        await asyncio.to_thread(crash_cluster.crash)
        # The listener's connection ends with the server: the daemon looks at once.
        failure = await ended(drainer, 30)
        await asyncio.to_thread(crash_cluster.restart)
        print(f"server down under an idle daemon: the drain ended with {failure!r}")
        # Whichever it meets first: the dead write connection, or the lost drain guard.
        assert isinstance(failure, (StorageError, DrainError)), repr(failure)
        more = await store.enqueue_many("p", [{"n": n} for n in range(5, 10)])
        summary = await drain(store, gate)  # the store reconnected by itself
        assert (summary.done, summary.remaining) == (5, 0)
        await all_settled_once(store, ids + more)


async def test_a_drain_never_runs_without_its_guard_after_a_restart(
    crash_cluster: RestartableCluster, clock: JumpingClock
) -> None:
    # A producer beside a daemon drain, on the same store object (the documented fleet
    # shape). The drain's session advisory lock dies with the server; once the producer
    # has the store reconnected, the drain carries on: it must not do so unguarded.
    async with store_on(crash_cluster, "guard_lost", clock) as store:
        ids = await store.enqueue_many("p", [{"n": n} for n in range(10)])
        gate = Gate(hold=1)
        stop = asyncio.Event()
        drainer = asyncio.create_task(
            drain(store, gate, mode="daemon", stop=stop, batch_size=5, poll_interval=0.02)
        )
        await gate.started.wait()
        await asyncio.to_thread(crash_cluster.crash)
        await asyncio.to_thread(crash_cluster.restart)
        produced = await recovering(lambda: store.enqueue_many("p", [{"n": 10}]))
        gate.release.set()
        deadline = time.monotonic() + 30
        while (await store.counts())["done"] < 5 and not drainer.done():
            assert time.monotonic() < deadline
            await asyncio.wait([drainer], timeout=0.01)
        async with store._engine.drain_guard() as second_drainer_may_run:
            first_still_runs = not drainer.done()
        stop.set()
        with contextlib.suppress(DrainError, StorageError):
            await drainer
        # The first drainer stopped its batch when its guard went, with the server down:
        # what it could not put back in its few seconds of tries is left to its leases,
        # and taken over once they lapse.
        clock.jump(store.lease_seconds + 1)
        await drain(store, gate)
        await all_settled_once(store, ids + produced)
        assert not (second_drainer_may_run and first_still_runs), (
            "after the restart a second drainer got the guard while the first still ran"
        )


# --- bounded waits ---------------------------------------------------------------------------


async def test_a_bounded_wait_never_swallows_a_cancellation_that_comes_as_it_ends() -> None:
    work: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(_tasks.within(work, 30, "bounded"))
    await asyncio.sleep(0)  # one step: it waits on the work
    work.set_result(1)
    waiting.cancel()  # in the same step as the work ends (asyncio.wait_for would return 1)
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_bounded_wait_gives_the_result_or_times_out_and_cancels_the_work() -> None:
    assert await _tasks.within(asyncio.sleep(0, "found"), 30, "quick") == "found"
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await _tasks.within(never, 0.01, "slow")
    assert never.cancelled()


async def test_a_bounded_wait_waits_for_its_work_however_often_it_is_cancelled() -> None:
    # As an anyio cancel scope does: cancelled again at every await. The work's clean-up
    # must still have ended when the cancellation reaches the caller.
    release, cleaned = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()  # a clean-up that takes its time
            cleaned.set()

    waiting = asyncio.create_task(_tasks.within(work(), 30, "stubborn"))
    for _ in range(3):
        await asyncio.sleep(0)
        waiting.cancel()
    await asyncio.sleep(0)
    assert not waiting.done()  # still waiting for the work to end
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cleaned.is_set()
