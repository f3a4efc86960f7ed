"""A Hypothesis state machine: the real store, on a real SQLite file and on a real
PostgreSQL schema, against a plain model (its items and views: tests/_state_model.py).

Every example gets a fresh temporary directory, a fresh database file, a ManualClock and
an event loop of its own. Each rule makes its store calls (``loop.run_until_complete``)
and the same change to a plain-Python model; after every step the invariant reads every
item row and its ledger back from the store, compares them (every column, every event
with its detail), the projects, the assignments, counts() and next_due() with the model,
and runs verify_ledger.

What the model knows (see _sqlite.py and _sqlite_sql.py for the store's side):

* Enqueue (one call per job, or one enqueue_many for several) takes a priority, a service
  class, an SLA, an explicit fingerprint or one derived from the ``identity`` payload
  key (when the store has one), dedup, max_attempts and not_before. With dedup, a job
  whose fingerprint matches a non-failed item of the project reuses its id (a done one
  first, else the oldest); twins within one call share an id. A not_before in the future
  makes the item ``deferred`` (events queued, deferred) until it falls due.
* A claim (claim, or claim_batch with a limit and an optional project) takes items in
  claim order: priority DESC, realtime before standard, earliest SLA (none last), item
  id. Claimable are ``ready`` items, ``deferred`` items whose due_at has come, and
  ``claimed`` items whose lease has lapsed, in open projects (and the actor's, and the
  project asked for), never an item with a fingerprint while a twin (same project, same
  fingerprint) is running (claimed, or offloaded), and at most one item per (project,
  fingerprint) per batch; between two claimed twins only a live lease holds back. A
  lapsed claim with no attempt left fails (lease_expired, failed) instead of moving on;
  a takeover records lease_expired at the old fence and owner. A claim raises fence and
  attempts by one.
* renew needs a claimed item at its fence; finish and retry a claimed or offloaded one;
  park and offload a claimed one. Otherwise ScopeDenied (actor not assigned, or no such
  item for an actor), UnknownItem (no such item, control plane) or FenceRejected, in
  that order. The lease is advisory until someone takes the item over.
* finish done keeps the result and settles every pending (ready or deferred) dedup twin
  of the project with a copy ("done" with {"deduplicated_from": id}); failed keeps the
  error (a result with failed, or an error with done, is refused as InvalidInput). retry
  defers (explicit delay, or backoff: base * 2**(attempts-1) * (0.5 + jitter), capped,
  the jitter mirrored from a seeded rng) or fails when attempts are spent; park defers
  and gives the attempt back; offload sets the item aside under a handle, until finish
  or retry settles it (which forgets the handle).
* dedup_pending_against_done backfills missing fingerprints (with an identity; items
  enqueued by an older store without one, or before an upgrade) and settles pending
  dedup items whose twin is done, from the oldest done twin, in chunk-sized steps.
* next_due() is the earliest due_at of a deferred item or lease end of a claimed one
  among those a claim could take then (open project, no running twin; the project or
  actor asked for); counts() counts states, of the whole store or a project or actor.
* Scope is assignment only: project status limits claims, never reads or settlements.
* set_schedule (every= in UTC) ticks at anchor + k * every, the anchor when its
  timetable was set (a schedule declared again with the same one keeps its place);
  run_schedules enqueues, per due schedule in the order of their next ticks, the newest
  due tick ("latest"), each due one ("all"), or the newest if at most a minute late
  ("none"), each an item of the schedule's job with {"schedule", "tick"} in "queued"; a
  resumed schedule goes on from now.
* set_limits keeps the limits it is not given and clears those given as None; with
  max_running a claim takes no new run of a project with that many claimed items (a
  takeover of a lapsed one takes no slot); with per_minute every claim takes a token of
  a bucket that holds ``burst`` (one without), refilled at per_minute / 60 a second and
  full when the rate is first set. next_due() of a limited project is when a claim could
  take from it: its ready items now, its deferred ones when due (both only while a slot
  is free), its lapsed claims when they lapse, each no sooner than a token is back.

"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import itertools
import math
import os
import pathlib
import random
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from _state_model import (
    JobSpec,
    ModelItem,
    as_datetime,
    by_claim_order,
    claimed_view,
    event_view,
    model_claimed_view,
    model_row_view,
    optional_datetime,
    pick_batch,
    row_view,
)
from asyncplane import (
    AsyncplaneError,
    ClaimedItem,
    ControlStore,
    FenceRejected,
    InvalidInput,
    ItemCancelled,
    Job,
    NotRequeueable,
    ProjectExists,
    ScopeDenied,
    UnknownItem,
    UnknownProject,
    UnknownSchedule,
    WaitTimeout,
    fingerprint,
    testing,
    verify_ledger,
)
from asyncplane._models import ITEM_STATES, SETTLED_STATES
from asyncplane.testing import DEFAULT_START, ManualClock

T = TypeVar("T")

LEASE = 30
# Small backoff numbers, so the cap (RETRY_BACKOFF_MAX) is reached within a few attempts.
RETRY_BACKOFF = 4.0
RETRY_BACKOFF_MAX = 20.0
JITTER_SEED = 4
IDENTITY = ("task",)
T0 = DEFAULT_START.timestamp()


PROJECTS = ("p1", "p2", "p3")
ACTORS = ("a1", "a2")
OWNERS = ("w1", "w2", "w3")
HANDLES = ("h1", "h2")

project_ids = st.sampled_from(PROJECTS)
# Enqueues go mostly to the project every example starts with, so claims find work.
enqueue_projects = st.sampled_from(("p1", "p1", "p1", "p2", "p3"))
maybe_project = st.sampled_from((None, None, "p1", "p2"))
statuses = st.sampled_from(("open", "open", "paused", "closed"))
actors = st.sampled_from(ACTORS)
# The control plane (None) half the time, an actor the other half.
maybe_actor = st.sampled_from((None, None, "a1", "a2"))
# Settlements mostly by the control plane: an actor's are refused unless it is assigned.
settling_actor = st.sampled_from((None, None, None, "a1", "a2"))
owners = st.sampled_from(OWNERS)
# None means the store's default lease (LEASE seconds).
leases = st.sampled_from((None, None, 5, 60))
# Steps around the lease, the backoff delays and not_before: short of them, exactly at
# them (expiry and due times are inclusive), past them.
advances = st.sampled_from((0.5, 1, 4, 5, 10, 29, 30, 31, 45, 60, 300))
# How far a presented fence is from the current one (clamped to at least 1).
fence_offsets = st.sampled_from((0, 0, 0, -1, -2, 1))
finish_statuses = st.sampled_from(("done", "failed"))
results = st.sampled_from((None, "ok", 7, {"v": [1, 2.5, None]}))
errors = st.sampled_from((None, "boom", "timeout"))
# None: the store's backoff with jitter.
retry_delays = st.sampled_from((None, None, 0, 5, 40))
park_delays = st.sampled_from((0, 5, 40))
handles = st.sampled_from(HANDLES)
limits = st.integers(min_value=1, max_value=4)
outcomes = st.sampled_from(("renew", "done", "failed", "retry", "park", "offload"))
work_outcomes = st.sampled_from(
    ("done", "done", "failed", "retry", "park", "offload", "keep", "keep")
)
# How long a worker waits before it claims, renews or settles (past LEASE, its own lease
# has lapsed and earlier claims can be taken over).
waits = st.sampled_from((0, 0, 0, 10, 30, 45))
# A limit left as it is (...), cleared (None), or set; a token every ten seconds, or one.
max_running_values = st.sampled_from((..., ..., None, 1, 2))
per_minute_values = st.sampled_from((..., ..., None, 6.0, 60.0))
burst_values = st.sampled_from((..., None, 1, 3))
schedule_names = st.sampled_from(("s1", "s2"))


job_specs = st.builds(
    JobSpec,
    priority=st.integers(min_value=-1, max_value=2),
    service_class=st.sampled_from(("standard", "standard", "realtime")),
    sla=st.sampled_from((None, None, 100.0, 200.0)),
    fingerprint=st.sampled_from((None, "fa", "fa", "fb")),
    task=st.sampled_from((None, "t1", "t1", "t2")),
    max_attempts=st.sampled_from((None, 1, 1, 2, 3)),
    not_before=st.sampled_from((None, None, None, -5.0, 0.0, 10.0, 45.0)),
    dedup=st.booleans(),
)
job_lists = st.lists(job_specs, min_size=1, max_size=3)


class StoreMachine(RuleBasedStateMachine):
    items = Bundle("items")
    tickets = Bundle("tickets")  # (item_id, fence): what a claim handed to its worker

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="asyncplane-sm-")
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.location: str | pathlib.Path = self.make_location()
        # The store's jitter source and the model's mirror of it draw in step: the store
        # draws once per retry() call that passes validation, refused or not.
        self.store_rng = random.Random(JITTER_SEED)
        self.jitter = random.Random(JITTER_SEED)
        self.identity = False
        self.store = self.new_store()
        self.legacy: ControlStore | None = None  # an older enqueuer (see legacy_enqueue)
        self.projects: dict[str, str] = {}
        self.assignments: set[tuple[str, str]] = set()
        self.model_items: dict[int, ModelItem] = {}
        self.model_limits: dict[str, dict[str, Any]] = {}
        self.model_schedules: dict[str, dict[str, Any]] = {}
        self.serial = 0  # makes every payload distinct

    def make_location(self) -> str | pathlib.Path:
        """Where this run's store lives: a file here; a fresh schema on PostgreSQL."""
        return pathlib.Path(self.tmp.name) / "store.db"

    def drop_location(self) -> None:
        """Remove what make_location() made outside the temporary directory."""

    def new_store(self) -> ControlStore:
        return ControlStore(
            self.location,
            lease_seconds=LEASE,
            clock=self.clock,
            identity=IDENTITY if self.identity else None,
            retry_backoff=RETRY_BACKOFF,
            retry_backoff_max=RETRY_BACKOFF_MAX,
            rng=self.store_rng,
        )

    def teardown(self) -> None:
        try:
            self.loop.run_until_complete(self.store.close())
            if self.legacy is not None:
                self.loop.run_until_complete(self.legacy.close())
        finally:
            try:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                try:
                    self.drop_location()
                finally:
                    self.loop.close()
                    self.tmp.cleanup()

    # --- helpers -----------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def attempt(self, coro: Coroutine[Any, Any, T]) -> tuple[T | None, AsyncplaneError | None]:
        """Run a store call; return (result, None) or (None, the AsyncplaneError it raised)."""
        try:
            return self.run(coro), None
        except AsyncplaneError as exc:
            return None, exc

    @staticmethod
    def check_error(
        error: AsyncplaneError | None, expected: type[AsyncplaneError] | None, what: str
    ) -> None:
        if expected is None:
            assert error is None, f"{what}: the model expected success, the store raised {error!r}"
        else:
            assert type(error) is expected, (
                f"{what}: the model expected {expected.__name__}, the store gave {error!r}"
            )

    def visible(self, actor: str, project_id: str) -> bool:
        return (actor, project_id) in self.assignments

    def fenced_refusal(
        self, item_id: int, fence: int, actor: str | None, states: tuple[str, ...]
    ) -> type[AsyncplaneError] | None:
        """What a fenced call must raise, or None if it must succeed.

        ``states`` are the states the call settles: ("claimed",) for renew, park and
        offload; ("claimed", "offloaded") for finish and retry.
        """
        item = self.model_items.get(item_id)
        if item is None:
            return UnknownItem if actor is None else ScopeDenied
        if actor is not None and not self.visible(actor, item.project_id):
            return ScopeDenied
        if item.state == "cancelled":
            return ItemCancelled  # whatever the fence: the holder was stopped
        if item.state not in states or item.fence != fence:
            return FenceRejected
        return None

    def check_fence_details(self, error: AsyncplaneError | None, item_id: int) -> None:
        if isinstance(error, FenceRejected):
            item = self.model_items[item_id]
            assert (error.current_fence, error.state) == (item.fence, item.state)

    def derived_fingerprint(self, payload: dict[str, Any], identity: bool) -> str | None:
        if not identity or "task" not in payload:
            return None
        return fingerprint(payload["task"])

    def twin_free(self, item: ModelItem) -> bool:
        """No twin of the item (same project, same fingerprint; never the item itself)
        holds it back. Any running twin (claimed, even under a lapsed lease, or offloaded)
        holds back a ready or deferred item; a claimed item is held back only by an
        offloaded twin or one claimed under a live lease."""
        if item.fingerprint is None:
            return True
        now = self.clock.now()
        for other in self.model_items.values():
            if (
                other is item
                or other.project_id != item.project_id
                or other.fingerprint != item.fingerprint
            ):
                continue
            if other.state == "offloaded":
                return False
            if other.state == "claimed":
                assert other.lease_expires_at is not None
                if item.state != "claimed" or other.lease_expires_at > now:
                    return False
        return True

    def free_at(self, item: ModelItem) -> float | None:
        """When a claimed item's lease and those of its claimed twins have all lapsed (None
        while an offloaded twin holds it back)."""
        assert item.lease_expires_at is not None
        at = item.lease_expires_at
        for other in self.model_items.values():
            if (
                other is item
                or item.fingerprint is None
                or other.project_id != item.project_id
                or other.fingerprint != item.fingerprint
            ):
                continue
            if other.state == "offloaded":
                return None
            if other.state == "claimed":
                assert other.lease_expires_at is not None
                at = max(at, other.lease_expires_at)
        return at

    def arm(
        self, state: str, actor: str | None, project_id: str | None, now: float
    ) -> list[ModelItem]:
        """The claimable items of one state, in claim order."""
        found = []
        for item in self.model_items.values():
            if item.state != state:
                continue
            if state == "deferred":
                assert item.due_at is not None
                if item.due_at > now:
                    continue
            if state == "claimed":
                assert item.lease_expires_at is not None
                if item.lease_expires_at > now:
                    continue
            if self.projects[item.project_id] != "open":
                continue
            if project_id is not None and item.project_id != project_id:
                continue
            if actor is not None and not self.visible(actor, item.project_id):
                continue
            if self.twin_free(item):
                found.append(item)
        return by_claim_order(found)

    # --- limits (see asyncplane._rules: a bucket's float sums as the store makes them) ----

    def running(self, project_id: str) -> int:
        return sum(
            i.state == "claimed" and i.project_id == project_id for i in self.model_items.values()
        )

    def bucket(self, limits: dict[str, Any], now: float) -> float | None:
        if limits["per_minute"] is None:
            return None
        capacity = float(limits["burst"] if limits["burst"] is not None else 1)
        if limits["tokens"] is None or limits["refilled_at"] is None:
            return capacity
        refill = max(0.0, now - limits["refilled_at"]) * limits["per_minute"] / 60.0
        return min(capacity, limits["tokens"] + refill)

    def quota(self, project_id: str, now: float) -> list[int | None]:
        limits = self.model_limits[project_id]
        slots = limits["max_running"]
        tokens = self.bucket(limits, now)
        return [
            None if slots is None else max(0, slots - self.running(project_id)),
            None if tokens is None else int(tokens + 1e-9),
        ]

    def spend(self, project_id: str, taken: int, now: float) -> None:
        limits = self.model_limits[project_id]
        tokens = self.bucket(limits, now)
        if not taken or tokens is None:
            return
        limits["tokens"] = max(0.0, tokens - taken)
        refilled = limits["refilled_at"]
        limits["refilled_at"] = now if refilled is None else max(now, refilled)

    def limited_due(self, project_id: str, actor: str | None, now: float) -> float | None:
        """When a claim with these filters could next take something of a limited project."""
        mine = [i for i in self.model_items.values() if i.project_id == project_id]
        limits = self.model_limits[project_id]
        times: list[float] = []
        slots = limits["max_running"]
        if slots is None or slots > self.running(project_id):
            if any(i.state == "ready" and self.twin_free(i) for i in mine):
                times.append(now)
            times += [i.due_at for i in mine if i.state == "deferred" and self.twin_free(i)
                      and i.due_at is not None]  # fmt: skip
        times += [at for i in mine if i.state == "claimed" and (at := self.free_at(i)) is not None]
        if not times:
            return None
        tokens = self.bucket(limits, now)
        if tokens is None or tokens + 1e-9 >= 1:
            return min(times)
        due = now + (1.0 - tokens) * 60.0 / limits["per_minute"]
        while (self.bucket(limits, due) or 0.0) + 1e-9 < 1:  # the first time it is there
            due = math.nextafter(due, math.inf)
        return max(min(times), due)

    @rule(
        project=project_ids, max_running=max_running_values, per_minute=per_minute_values,
        burst=burst_values,
    )  # fmt: skip
    def set_limits(self, project: str, max_running: Any, per_minute: Any, burst: Any) -> None:
        given = (("max_running", max_running), ("per_minute", per_minute), ("burst", burst))
        changes = {name: value for name, value in given if value is not ...}
        if not changes:
            return
        _, error = self.attempt(self.store.set_limits(project, **changes))
        if project not in self.projects:
            self.check_error(error, UnknownProject, "set_limits")
            return
        now = self.clock.now()
        old = self.model_limits.get(project)
        limits = {"max_running": None, "per_minute": None, "burst": None}
        if old is not None:
            limits.update({name: old[name] for name in limits})
        limits.update(changes)
        if limits["per_minute"] is None and changes.get("burst") is not None:
            self.check_error(error, InvalidInput, "set_limits: a burst with no rate")
            return
        self.check_error(error, None, "set_limits")
        if limits["per_minute"] is None:
            limits["burst"] = None
        if all(value is None for value in limits.values()):
            self.model_limits.pop(project, None)
            return
        limits["tokens"] = limits["refilled_at"] = None
        if limits["per_minute"] is not None:
            capacity = float(limits["burst"] if limits["burst"] is not None else 1)
            held = None if old is None else self.bucket(old, now)
            limits["tokens"] = capacity if held is None else min(capacity, held)
            limits["refilled_at"] = now
        self.model_limits[project] = limits

    # --- schedules (every= ones, in UTC; asyncplane._schedule for the rules) -------------

    @rule(
        name=schedule_names, project=enqueue_projects, every=st.sampled_from((10.0, 30.0, 300.0)),
        catch_up=st.sampled_from(("latest", "all", "none")), task=st.sampled_from((None, "t1")),
    )  # fmt: skip
    def set_schedule(
        self, name: str, project: str, every: float, catch_up: str, task: str | None
    ) -> None:
        self.serial += 1
        payload: dict[str, Any] = {"n": self.serial, "via": "schedule"}
        if task is not None:
            payload["task"] = task
        _, error = self.attempt(
            self.store.set_schedule(
                name, project_id=project, payload=payload, every=every, catch_up=catch_up
            )
        )
        if project not in self.projects:
            self.check_error(error, UnknownProject, "set_schedule")
            return
        self.check_error(error, None, "set_schedule")
        now = self.clock.now()
        old = self.model_schedules.get(name)
        if old is not None and old["every"] == every:
            anchor, next_at = old["anchor"], old["next_at"]  # the same timetable: its place
        else:
            anchor, next_at = now, now + every
        self.model_schedules[name] = {
            "project_id": project, "payload": payload, "every": every, "catch_up": catch_up,
            "anchor": anchor, "next_at": next_at,
            "fingerprint": self.derived_fingerprint(payload, self.identity),
            "paused": False if old is None else old["paused"],
            "last_at": None if old is None else old["last_at"],
        }  # fmt: skip

    def after(self, schedule: dict[str, Any], moment: float) -> float:
        anchor, every = schedule["anchor"], schedule["every"]
        return float(anchor + (math.floor((moment - anchor) / every) + 1) * every)

    @rule(name=schedule_names, paused=st.booleans())
    def pause_schedule(self, name: str, paused: bool) -> None:
        call = self.store.pause_schedule if paused else self.store.resume_schedule
        _, error = self.attempt(call(name))
        schedule = self.model_schedules.get(name)
        if schedule is None:
            self.check_error(error, UnknownSchedule, "pause/resume")
            return
        self.check_error(error, None, "pause/resume")
        if schedule["paused"] and not paused:
            schedule["next_at"] = self.after(schedule, self.clock.now())
        schedule["paused"] = paused

    @rule(name=schedule_names)
    def delete_schedule(self, name: str) -> None:
        _, error = self.attempt(self.store.delete_schedule(name))
        expected = None if name in self.model_schedules else UnknownSchedule
        self.check_error(error, expected, "delete_schedule")
        self.model_schedules.pop(name, None)

    @rule(target=items, wait=st.sampled_from((0, 10, 30, 75, 300, 370)))
    def run_schedules(self, wait: float) -> Any:
        """Run the schedules (after a while): each due tick of each schedule, in the order
        of their next ticks, enqueued once with its schedule and tick in "queued"."""
        self.clock.advance(wait)
        now = self.clock.now()
        got, error = self.attempt(self.store.run_schedules())
        self.check_error(error, None, "run_schedules")
        due = sorted(
            (s["next_at"], name)
            for name, s in self.model_schedules.items()
            if not s["paused"] and s["next_at"] <= now
        )
        enqueued = 0
        created: list[int] = []
        for _, name in due:
            schedule = self.model_schedules[name]
            anchor, every = schedule["anchor"], schedule["every"]
            last = math.floor((now - anchor) / every)
            ticks = []
            while len(ticks) < (1000 if schedule["catch_up"] == "all" else 1):
                tick = anchor + last * every
                if tick < schedule["next_at"] or last < 0:
                    break
                ticks.append(tick)
                last -= 1
            ticks.reverse()
            if schedule["catch_up"] == "none" and ticks and now - ticks[-1] > 60.0:
                ticks = []
            for tick in ticks:
                # A tick takes the oldest pending twin stored with dedup off, else adds an
                # item with dedup off (one no done twin answers: it runs each tick).
                fp = schedule["fingerprint"]
                pending = [
                    item
                    for item in self.model_items.values()
                    if fp is not None
                    and item.project_id == schedule["project_id"]
                    and item.fingerprint == fp
                    and item.state in ("ready", "deferred")
                    and not item.dedup
                ]
                if not pending:
                    job = Job(schedule["payload"], fingerprint=fp)
                    detail = {"schedule": name, "tick": as_datetime(tick).isoformat()}
                    _, new = self.model_enqueue(
                        schedule["project_id"], None, [job], False, False, queued=detail
                    )
                    created += new
                    enqueued += len(new)
                schedule["last_at"] = tick
            schedule["next_at"] = self.after(schedule, now)
        assert got == enqueued, f"run_schedules: {got} ticks, the model expected {enqueued}"
        return multiple(*created)

    def done_twins(self, item: ModelItem) -> list[ModelItem]:
        return [
            other
            for other in self.model_items.values()
            if other.state == "done"
            and other.project_id == item.project_id
            and other.fingerprint == item.fingerprint
        ]

    # --- projects and scope ------------------------------------------------------------

    @initialize(
        target=items,
        assign_to=st.sampled_from(("a1", "a2", None)),
        identity=st.booleans(),
        jobs=st.lists(job_specs, max_size=4),
        many=st.booleans(),
    )
    def first_project(
        self, assign_to: str | None, identity: bool, jobs: list[JobSpec], many: bool
    ) -> Any:
        """Start with an open project "p1" holding a few items, so most examples have work.

        (Hypothesis switches random subsets of rules off per example; work that is there
        from the start keeps claims and settlements busy even when enqueue is off.) The
        store may derive fingerprints from the payload's "task" (an identity) or not.
        """
        self.identity = identity
        self.store = self.new_store()  # constructing a store does no I/O
        self.run(self.store.create_project("p1", "Project p1"))
        self.projects["p1"] = "open"
        if assign_to is not None:
            self.run(self.store.assign("p1", assign_to))
            self.assignments.add((assign_to, "p1"))
        return self.do_enqueue("p1", None, jobs, dedup=True, many=many)

    @precondition(lambda self: len(self.projects) < len(PROJECTS))
    @rule(project=project_ids, status=statuses)
    def create_project(self, project: str, status: str) -> None:
        _, error = self.attempt(
            self.store.create_project(project, f"Project {project}", status=status)
        )
        if project in self.projects:
            self.check_error(error, ProjectExists, "create_project")
        else:
            self.check_error(error, None, "create_project")
            self.projects[project] = status

    @rule(project=project_ids, status=statuses)
    def set_project_status(self, project: str, status: str) -> None:
        _, error = self.attempt(self.store.set_project_status(project, status))
        if project in self.projects:
            self.check_error(error, None, "set_project_status")
            self.projects[project] = status
        else:
            self.check_error(error, UnknownProject, "set_project_status")

    @rule(project=project_ids, actor=actors, assigned=st.booleans())
    def set_assignment(self, project: str, actor: str, assigned: bool) -> None:
        """assign() or unassign(); both are idempotent and refuse an unknown project."""
        call = self.store.assign if assigned else self.store.unassign
        _, error = self.attempt(call(project, actor))
        if project not in self.projects:
            self.check_error(error, UnknownProject, "assign" if assigned else "unassign")
        elif assigned:
            self.check_error(error, None, "assign")
            self.assignments.add((actor, project))
        else:
            self.check_error(error, None, "unassign")
            self.assignments.discard((actor, project))

    # --- enqueue -----------------------------------------------------------------------

    # The control plane and the actors get rules of their own: Hypothesis switches random
    # subsets of rules off per example (swarm testing), and two rules for one call make
    # it likelier that each example can enqueue and claim at all.

    @rule(
        target=items,
        project=enqueue_projects,
        jobs=job_lists,
        dedup=st.booleans(),
        many=st.booleans(),
    )
    def enqueue(self, project: str, jobs: list[JobSpec], dedup: bool, many: bool) -> Any:
        return self.do_enqueue(project, None, jobs, dedup, many)

    @rule(
        target=items,
        project=project_ids,
        actor=actors,
        jobs=job_lists,
        dedup=st.booleans(),
        many=st.booleans(),
    )
    def enqueue_as_actor(
        self, project: str, actor: str, jobs: list[JobSpec], dedup: bool, many: bool
    ) -> Any:
        return self.do_enqueue(project, actor, jobs, dedup, many)

    def rerunnable(self) -> list[ModelItem]:
        return [
            item
            for item in self.model_items.values()
            if item.state in ("ready", "deferred") and item.dedup and item.fingerprint
        ]

    @precondition(lambda self: self.rerunnable())
    @rule(
        target=items,
        newest=st.booleans(),
        realtime=st.booleans(),
        not_before=st.sampled_from((None, None, 10.0)),
        run_now=st.booleans(),
        result=results,
    )
    def rerun(
        self, newest: bool, realtime: bool, not_before: float | None, run_now: bool, result: Any
    ) -> Any:
        """Enqueue the work of a pending item again, urgently and independently (dedup
        False, same fingerprint, one priority up): it runs ahead of its twin, and when it
        is done its result settles the twin (which was enqueued with dedup). With
        ``run_now`` a worker claims from that project at once and finishes it done."""
        pending = self.rerunnable()
        item = pending[-1] if newest else pending[0]
        spec = JobSpec(
            priority=item.priority + 1,
            service_class="realtime" if realtime else "standard",
            fingerprint=item.fingerprint,
            not_before=not_before,
            dedup=False,
        )
        new = self.do_enqueue(item.project_id, None, [spec], dedup=False, many=False)
        if run_now:
            for ticket in self.do_claim("w1", None, None, 0, item.project_id, None).values:
                self.do_finish(*ticket, "done", None, result, None)
        return new

    @rule(
        target=items,
        project=enqueue_projects,
        jobs=job_lists,
        many=st.booleans(),
        repeat_done=st.sampled_from((True, True, False)),
        preflight=st.booleans(),
    )
    def legacy_enqueue(
        self, project: str, jobs: list[JobSpec], many: bool, repeat_done: bool, preflight: bool
    ) -> Any:
        """An older enqueuer (a second store on the file, without the identity) adds items:
        those with a "task" and no explicit fingerprint get none, until the preflight of
        the machine's store backfills it and settles them if a twin is done (at once,
        with ``preflight``). With ``repeat_done`` the jobs repeat the task of a done item
        of the project, if there is one. (The machine's store is upgraded to one with the
        identity first, if it has none.)"""
        self.upgrade()
        if self.legacy is None:
            self.legacy = ControlStore(self.location, lease_seconds=LEASE, clock=self.clock)
        done_tasks = [
            item.payload["task"]
            for item in self.model_items.values()
            if item.state == "done" and item.project_id == project and "task" in item.payload
        ]
        if repeat_done and done_tasks:
            jobs = [dataclasses.replace(job, task=done_tasks[0], fingerprint=None) for job in jobs]
        new = self.do_enqueue(project, None, jobs, True, many, store=self.legacy)
        if preflight:
            self.dedup_pending_against_done(500)
        return new

    def do_enqueue(
        self,
        project: str,
        actor: str | None,
        specs: list[JobSpec],
        dedup: bool,
        many: bool,
        store: ControlStore | None = None,
    ) -> Any:
        """enqueue() once per job (each with its own dedup), or one enqueue_many() of them
        all (with ``dedup``); on the machine's store, or on ``store`` (without identity)."""
        identity = self.identity if store is None else False
        store = self.store if store is None else store
        refusal: type[AsyncplaneError] | None
        if actor is None:
            refusal = None if project in self.projects else UnknownProject
        else:
            refusal = None if self.visible(actor, project) else ScopeDenied
        now = self.clock.now()
        jobs = []
        for spec in specs:
            self.serial += 1
            payload: dict[str, Any] = {"n": self.serial, "via": actor}
            if spec.task is not None:
                payload["task"] = spec.task
            jobs.append(
                Job(
                    payload,
                    priority=spec.priority,
                    service_class=spec.service_class,
                    # One of the SLAs as an aware datetime, the others as epoch seconds.
                    sla=None
                    if spec.sla is None
                    else as_datetime(T0 + spec.sla)
                    if spec.sla == 200.0
                    else T0 + spec.sla,
                    fingerprint=spec.fingerprint,
                    max_attempts=spec.max_attempts,
                    not_before=None if spec.not_before is None else now + spec.not_before,
                )
            )
        calls = (
            [(jobs, dedup)] if many else [([j], s.dedup) for j, s in zip(jobs, specs, strict=True)]
        )
        new_ids: list[int] = []
        for call, dedup in calls:
            what = f"enqueue{'_many' if many else ''}({project!r}, actor={actor}, dedup={dedup})"
            if many:
                got, error = self.attempt(
                    store.enqueue_many(
                        project,
                        [job if job != Job(job.payload) else job.payload for job in call],
                        dedup=dedup,
                        actor_id=actor,
                    )
                )
            else:
                (job,) = call
                one, error = self.attempt(
                    store.enqueue(
                        project,
                        job.payload,
                        priority=job.priority,
                        service_class=job.service_class,
                        sla=job.sla,
                        fingerprint=job.fingerprint,
                        dedup=dedup,
                        max_attempts=job.max_attempts,
                        not_before=job.not_before,
                        actor_id=actor,
                    )
                )
                got = None if one is None else [one]
            self.check_error(error, refusal, what)
            if refusal is not None:
                return multiple()
            expected, created = self.model_enqueue(project, actor, call, dedup, identity)
            assert got == expected, f"{what}: expected ids {expected}, the store gave {got}"
            new_ids.extend(created)
        return multiple(*new_ids)

    def model_enqueue(
        self,
        project: str,
        actor: str | None,
        jobs: list[Job],
        dedup: bool,
        identity: bool,
        queued: dict[str, Any] | None = None,
    ) -> tuple[list[int], list[int]]:
        """One enqueue transaction in the model: (the ids it returns, the ids it created)."""
        now = self.clock.now()
        at = as_datetime(now)
        ids: list[int] = []
        created: list[int] = []
        first_of: dict[str, int] = {}  # fingerprint -> the id its first job got in this call
        for job in jobs:
            fp = job.fingerprint
            if fp is None:
                fp = self.derived_fingerprint(job.payload, identity)
            if dedup and fp is not None:
                if fp in first_of:
                    ids.append(first_of[fp])
                    continue
                twins = [
                    item
                    for item in self.model_items.values()
                    if item.project_id == project
                    and item.fingerprint == fp
                    and item.state not in ("failed", "cancelled")
                    # Only rows there before this call: new rows are written after the
                    # call has resolved its twins (first_of covers those).
                    and item.item_id not in created
                ]
                if twins:
                    reused = min(twins, key=lambda t: (t.state != "done", t.item_id))
                    ids.append(reused.item_id)
                    first_of[fp] = reused.item_id
                    continue
            new_id = len(self.model_items) + 1  # AUTOINCREMENT on a fresh file: 1, 2, ...
            sla = job.sla.timestamp() if isinstance(job.sla, dt.datetime) else job.sla
            assert not isinstance(job.not_before, dt.datetime)
            deferred = job.not_before is not None and job.not_before > now
            item = ModelItem(
                new_id,
                project,
                job.payload,
                created_at=now,
                updated_at=now,
                priority=job.priority,
                service_class=job.service_class,
                sla=sla,
                fingerprint=fp,
                dedup=dedup,
                max_attempts=job.max_attempts,
                due_at=job.not_before if deferred else None,
                state="deferred" if deferred else "ready",
            )
            item.events.append(("queued", 0, None, actor, queued, at))
            if deferred:
                item.events.append(("deferred", 0, None, actor, {"due_at": item.due_at}, at))
            self.model_items[new_id] = item
            if dedup and fp is not None:
                first_of[fp] = new_id
            ids.append(new_id)
            created.append(new_id)
        return ids, created

    # --- claims ------------------------------------------------------------------------

    @rule(target=tickets, owner=owners, lease=leases, wait=waits, project=maybe_project)
    def claim(self, owner: str, lease: float | None, wait: float, project: str | None) -> Any:
        return self.do_claim(owner, None, lease, wait, project, None)

    @rule(target=tickets, owner=owners, actor=actors, lease=leases, wait=waits)
    def claim_as_actor(self, owner: str, actor: str, lease: float | None, wait: float) -> Any:
        return self.do_claim(owner, actor, lease, wait, None, None)

    @rule(
        target=tickets,
        owner=owners,
        limit=limits,
        actor=maybe_actor,
        project=maybe_project,
        lease=leases,
        wait=waits,
    )
    def claim_batch(
        self,
        owner: str,
        limit: int,
        actor: str | None,
        project: str | None,
        lease: float | None,
        wait: float,
    ) -> Any:
        return self.do_claim(owner, actor, lease, wait, project, limit)

    def do_claim(
        self,
        owner: str,
        actor: str | None,
        lease: float | None,
        wait: float,
        project: str | None,
        batch: int | None,
    ) -> Any:
        """A worker claims (claim(), or claim_batch() of ``batch`` items), after waiting a
        while (which may let earlier leases lapse and deferred items fall due)."""
        self.clock.advance(wait)
        now = self.clock.now()
        at = as_datetime(now)
        limit = 1 if batch is None else batch
        got: list[ClaimedItem] | None
        if batch is None:
            one, error = self.attempt(
                self.store.claim(owner, actor_id=actor, project_id=project, lease_seconds=lease)
            )
            got = [] if one is None else [one]
        else:
            got, error = self.attempt(
                self.store.claim_batch(
                    owner, limit, actor_id=actor, project_id=project, lease_seconds=lease
                )
            )
        self.check_error(error, None, "claim")
        assert got is not None
        # First the lapsed items with no attempt left fail, up to max(limit, 16) of them.
        lapsed = self.arm("claimed", actor, project, now)
        exhausted = [item for item in lapsed if item.exhausted()][: max(limit, 16)]
        for item in exhausted:
            assert item.max_attempts is not None
            message = (
                f"attempts exhausted: the lease of attempt {item.attempts} of "
                f"{item.max_attempts} lapsed"
            )
            item.events.append(("lease_expired", item.fence, item.owner, actor, None, at))
            item.events.append(("failed", item.fence, item.owner, actor, {"error": message}, at))
            item.state = "failed"
            item.lease_expires_at = None
            item.error = message
            item.updated_at = now
        # Then every claimable item, in claim order, one per (project, fingerprint).
        candidates = [
            item for item in self.arm("claimed", actor, project, now) if not item.exhausted()
        ]
        candidates += self.arm("deferred", actor, project, now)
        candidates += self.arm("ready", actor, project, now)
        quotas = {p: self.quota(p, now) for p in self.model_limits}
        chosen = pick_batch(by_claim_order(candidates), limit, quotas)
        for project_id in self.model_limits:
            self.spend(project_id, sum(i.project_id == project_id for i in chosen), now)
        expected_ids = [item.item_id for item in chosen]
        got_ids = [claim.item_id for claim in got]
        assert got_ids == expected_ids, (
            f"claim(limit={limit}, actor={actor}, project={project}): expected items "
            f"{expected_ids}, the store handed out {got_ids}"
        )
        tickets = []
        for item, claim in zip(chosen, got, strict=True):
            if item.state == "claimed":  # a takeover of a lapsed lease
                detail = {"taken_over_by": owner}
                item.events.append(("lease_expired", item.fence, item.owner, actor, detail, at))
            item.state = "claimed"
            item.fence += 1
            item.attempts += 1
            item.owner = owner
            item.lease_expires_at = now + (LEASE if lease is None else lease)
            item.due_at = None
            item.updated_at = item.claimed_at = now
            item.events.append(("claimed", item.fence, owner, actor, None, at))
            assert claimed_view(claim) == model_claimed_view(item), f"claim of item {item.item_id}"
            tickets.append((item.item_id, item.fence))
        return multiple(*tickets)

    @rule(
        target=tickets,
        owner=owners,
        limit=limits,
        project=maybe_project,
        plan=st.lists(work_outcomes, min_size=4, max_size=4),
        result=results,
        error=errors,
        wait=waits,
    )
    def claim_and_work(
        self,
        owner: str,
        limit: int,
        project: str | None,
        plan: list[str],
        result: Any,
        error: str | None,
        wait: float,
    ) -> Any:
        """A worker claims a batch and settles each item at once, as ``plan`` says (keep:
        not yet; the ticket stays for later). Reaches deep histories in few steps."""
        kept = []
        for (item_id, fence), outcome in zip(
            self.do_claim(owner, None, None, wait, project, limit).values, plan, strict=False
        ):
            if outcome == "done":
                self.do_finish(item_id, fence, "done", None, result, None)
            elif outcome == "failed":
                self.do_finish(item_id, fence, "failed", None, None, error)
            elif outcome == "retry":
                self.do_retry(item_id, fence, None, error, None)
            elif outcome == "park":
                self.do_park(item_id, fence, None, 5)
            elif outcome == "offload":
                self.do_offload(item_id, fence, None, HANDLES[0])
            kept.extend(self.live((item_id, fence)).values)
        return multiple(*kept)

    @rule(owner=owners, limit=limits, project=maybe_project)
    def worker_crash(self, owner: str, limit: int, project: str | None) -> None:
        """A worker claims a batch and dies with it: its leases lapse (the next claims
        take the items over, or fail those with no attempt left)."""
        self.do_claim(owner, None, None, 0, project, limit)
        self.clock.advance(LEASE)

    # --- settlements -------------------------------------------------------------------

    def do_renew(self, item_id: int, fence: int, actor: str | None, lease: float | None) -> None:
        refusal = self.fenced_refusal(item_id, fence, actor, ("claimed",))
        now = self.clock.now()
        expires, error = self.attempt(
            self.store.renew(item_id, fence=fence, actor_id=actor, lease_seconds=lease)
        )
        self.check_error(error, refusal, f"renew({item_id}, fence={fence}, actor={actor})")
        self.check_fence_details(error, item_id)
        if refusal is None:
            item = self.model_items[item_id]
            item.lease_expires_at = now + (LEASE if lease is None else lease)
            item.updated_at = now
            assert expires == as_datetime(item.lease_expires_at)

    def do_finish(
        self,
        item_id: int,
        fence: int,
        status: str,
        actor: str | None,
        result: Any = None,
        error_text: str | None = None,
    ) -> None:
        refusal = self.fenced_refusal(item_id, fence, actor, ("claimed", "offloaded"))
        if (status == "done" and error_text is not None) or (
            status == "failed" and result is not None
        ):
            refusal = InvalidInput  # checked before anything else, nothing written
        now = self.clock.now()
        at = as_datetime(now)
        _, error = self.attempt(
            self.store.finish(
                item_id,
                fence=fence,
                status=status,
                result=result,
                error=error_text,
                actor_id=actor,
            )
        )
        what = f"finish({item_id}, fence={fence}, status={status}, actor={actor})"
        self.check_error(error, refusal, what)
        self.check_fence_details(error, item_id)
        if refusal is not None:
            return
        item = self.model_items[item_id]
        item.state = status
        item.lease_expires_at = None
        item.due_at = None
        item.offload_handle = None
        item.updated_at = now
        detail = None if error_text is None else {"error": error_text}
        item.events.append((status, fence, item.owner, actor, detail, at))
        if status == "failed":
            item.error = error_text
            return
        item.result = result
        item.error = None
        if item.fingerprint is None:
            return
        # Settlement dedup: pending dedup twins of the project are done with it.
        settled_by = {"deduplicated_from": item_id}
        for twin in self.model_items.values():
            if (
                twin is not item
                and twin.project_id == item.project_id
                and twin.fingerprint == item.fingerprint
                and twin.dedup
                and twin.state in ("ready", "deferred")
            ):
                twin.state = "done"
                twin.result = result
                twin.error = None
                twin.due_at = None
                twin.updated_at = now
                twin.events.append(("done", twin.fence, None, actor, settled_by, at))

    def do_retry(
        self,
        item_id: int,
        fence: int,
        actor: str | None,
        error_text: str | None,
        delay: float | None,
    ) -> None:
        jitter = self.jitter.random()  # the store draws one for every retry() call
        refusal = self.fenced_refusal(item_id, fence, actor, ("claimed", "offloaded"))
        now = self.clock.now()
        at = as_datetime(now)
        state, error = self.attempt(
            self.store.retry(item_id, fence=fence, error=error_text, delay=delay, actor_id=actor)
        )
        self.check_error(error, refusal, f"retry({item_id}, fence={fence}, actor={actor})")
        self.check_fence_details(error, item_id)
        if refusal is not None:
            return
        item = self.model_items[item_id]
        item.lease_expires_at = None
        item.offload_handle = None
        item.updated_at = now
        if item.exhausted():
            assert state == "failed", f"retry of item {item_id}: expected failed, got {state}"
            message = (
                f"attempts exhausted ({item.attempts} of {item.max_attempts}): "
                f"{error_text or 'no reason given'}"
            )
            item.state = "failed"
            item.error = message
            item.due_at = None
            item.events.append(("failed", fence, item.owner, actor, {"error": message}, at))
            return
        assert state == "deferred", f"retry of item {item_id}: expected deferred, got {state}"
        if delay is None:
            raw = RETRY_BACKOFF * 2 ** max(item.attempts - 1, 0)
            delay = min(RETRY_BACKOFF_MAX, raw * (0.5 + jitter))
            assert min(0.5 * raw, RETRY_BACKOFF_MAX) <= delay <= min(1.5 * raw, RETRY_BACKOFF_MAX)
        item.state = "deferred"
        item.due_at = now + delay
        item.error = error_text
        detail = {"error": error_text, "due_at": item.due_at}
        item.events.append(("retried", fence, item.owner, actor, detail, at))

    def do_park(self, item_id: int, fence: int, actor: str | None, delay: float) -> None:
        refusal = self.fenced_refusal(item_id, fence, actor, ("claimed",))
        now = self.clock.now()
        _, error = self.attempt(self.store.park(item_id, fence=fence, delay=delay, actor_id=actor))
        self.check_error(error, refusal, f"park({item_id}, fence={fence}, actor={actor})")
        self.check_fence_details(error, item_id)
        if refusal is None:
            item = self.model_items[item_id]
            item.state = "deferred"
            item.due_at = now + delay
            item.attempts -= 1  # capacity, not a failure: the attempt is given back
            item.error = None
            item.lease_expires_at = None
            item.updated_at = now
            detail = {"due_at": item.due_at}
            item.events.append(("parked", fence, item.owner, actor, detail, as_datetime(now)))

    def do_offload(self, item_id: int, fence: int, actor: str | None, handle: str) -> None:
        refusal = self.fenced_refusal(item_id, fence, actor, ("claimed",))
        now = self.clock.now()
        _, error = self.attempt(
            self.store.offload(item_id, fence=fence, handle=handle, actor_id=actor)
        )
        self.check_error(error, refusal, f"offload({item_id}, fence={fence}, actor={actor})")
        self.check_fence_details(error, item_id)
        if refusal is None:
            item = self.model_items[item_id]
            item.state = "offloaded"
            item.offload_handle = handle
            item.lease_expires_at = None
            item.updated_at = now
            detail = {"handle": handle}
            item.events.append(("offloaded", fence, item.owner, actor, detail, as_datetime(now)))

    @rule(ticket=tickets, actor=settling_actor, lease=leases, wait=waits)
    def renew(
        self, ticket: tuple[int, int], actor: str | None, lease: float | None, wait: float
    ) -> None:
        """A worker renews, after a while, with the fence its claim gave it."""
        self.clock.advance(wait)
        self.do_renew(*ticket, actor, lease)

    # A settlement uses its ticket up; the ticket goes back to the bundle while it is still
    # good for another call (the call was refused, or the item was offloaded), so stale
    # tickets are tried once and live ones are not wasted.

    def live(self, ticket: tuple[int, int]) -> Any:
        item = self.model_items[ticket[0]]
        if item.state in ("claimed", "offloaded") and item.fence == ticket[1]:
            return multiple(ticket)
        return multiple()

    @rule(
        target=tickets,
        ticket=consumes(tickets),
        status=finish_statuses,
        result=results,
        error=errors,
        mismatch=st.sampled_from((False, False, False, True)),
        actor=settling_actor,
        wait=waits,
    )
    def finish(
        self,
        ticket: tuple[int, int],
        status: str,
        result: Any,
        error: str | None,
        mismatch: bool,
        actor: str | None,
        wait: float,
    ) -> Any:
        """A worker reports, after a while, with the fence its claim gave it: done with a
        result, failed with an error (with ``mismatch``, also the other one: refused)."""
        self.clock.advance(wait)
        if status == "done":
            self.do_finish(*ticket, status, actor, result, "wrong" if mismatch else None)
        else:
            self.do_finish(*ticket, status, actor, "wrong" if mismatch else None, error)
        return self.live(ticket)

    @rule(
        target=tickets,
        ticket=consumes(tickets),
        error=errors,
        delay=retry_delays,
        actor=settling_actor,
        wait=waits,
    )
    def retry(
        self,
        ticket: tuple[int, int],
        error: str | None,
        delay: float | None,
        actor: str | None,
        wait: float,
    ) -> Any:
        """A worker reports a transient failure, after a while."""
        self.clock.advance(wait)
        self.do_retry(*ticket, actor, error, delay)
        return self.live(ticket)

    @rule(
        target=tickets,
        ticket=consumes(tickets),
        delay=park_delays,
        actor=settling_actor,
        wait=waits,
    )
    def park(self, ticket: tuple[int, int], delay: float, actor: str | None, wait: float) -> Any:
        """A worker had no capacity for its item: it sets it aside."""
        self.clock.advance(wait)
        self.do_park(*ticket, actor, delay)
        return self.live(ticket)

    @rule(
        target=tickets,
        ticket=consumes(tickets),
        handle=handles,
        actor=settling_actor,
        wait=waits,
    )
    def offload(self, ticket: tuple[int, int], handle: str, actor: str | None, wait: float) -> Any:
        """A worker hands its item to an external batch, to settle later with the ticket."""
        self.clock.advance(wait)
        self.do_offload(*ticket, actor, handle)
        return self.live(ticket)

    @rule(item_id=items, offset=fence_offsets, outcome=outcomes, actor=maybe_actor)
    def report_any_fence(self, item_id: int, offset: int, outcome: str, actor: str | None) -> None:
        """renew or settle any item, at a fence near its current one.

        Reaches what tickets do not: items never claimed, and fences from the future.
        """
        fence = max(1, self.model_items[item_id].fence + offset)
        if outcome == "renew":
            self.do_renew(item_id, fence, actor, None)
        elif outcome == "done":
            self.do_finish(item_id, fence, outcome, actor, {"any": item_id}, None)
        elif outcome == "failed":
            self.do_finish(item_id, fence, outcome, actor, None, "any")
        elif outcome == "retry":
            self.do_retry(item_id, fence, actor, "any", None)
        elif outcome == "park":
            self.do_park(item_id, fence, actor, 5)
        else:
            self.do_offload(item_id, fence, actor, HANDLES[0])

    @rule(chunk=st.sampled_from((1, 2, 500)), upgrade=st.booleans())
    def preflight(self, chunk: int, upgrade: bool) -> None:
        """The preflight, on the machine's store, or (``upgrade``) first on a new one that
        knows the identity, as after an upgrade: it backfills the fingerprints of items
        enqueued without one, then settles their pending twins from the done ones."""
        if upgrade:
            self.upgrade()
        self.dedup_pending_against_done(chunk)

    def upgrade(self) -> None:
        """Replace a store without the identity by one with it, on the same file."""
        if not self.identity:
            self.run(self.store.close())
            self.identity = True
            self.store = self.new_store()

    def dedup_pending_against_done(self, chunk: int) -> None:
        """The preflight: backfill fingerprints (with an identity), settle pending twins."""
        now = self.clock.now()
        at = as_datetime(now)
        count, error = self.attempt(self.store.dedup_pending_against_done(chunk=chunk))
        self.check_error(error, None, "dedup_pending_against_done")
        ordered = [self.model_items[i] for i in sorted(self.model_items)]
        settled = 0
        after = 0  # how far the backfill has looked
        while True:
            # One step: with an identity, look at the next ``chunk`` items without a
            # fingerprint (any state but a running one: claimed or offloaded) and give
            # them one if their payload has the key;
            # then settle up to ``chunk`` pending twins, each from the oldest done twin
            # (the done twins as they were when the step began).
            seen = 0
            if self.identity:
                missing = [
                    i
                    for i in ordered
                    if i.fingerprint is None
                    and i.item_id > after
                    and i.state not in ("claimed", "offloaded")
                ]
                for item in missing[:chunk]:
                    item.fingerprint = self.derived_fingerprint(item.payload, True)
                    after = item.item_id
                    seen += 1
            batch = [
                (item, self.done_twins(item))
                for item in ordered
                if item.state in ("ready", "deferred") and item.dedup and item.fingerprint
            ]
            batch = [(item, twins) for item, twins in batch if twins][:chunk]
            for item, twins in batch:
                source = min(twins, key=lambda twin: twin.item_id)  # the oldest done twin
                item.state = "done"
                item.result = source.result
                item.error = None
                item.due_at = None
                item.updated_at = now
                settled_by = {"deduplicated_from": source.item_id}
                item.events.append(("done", item.fence, None, None, settled_by, at))
            settled += len(batch)
            if seen < chunk and len(batch) < chunk:
                break
        assert count == settled, f"preflight settled {count}, the model expected {settled}"

    # --- operating single items -----------------------------------------------------------

    def scope_refusal(self, item: ModelItem, actor: str | None) -> type[AsyncplaneError] | None:
        return (
            ScopeDenied if actor is not None and not self.visible(actor, item.project_id) else None
        )

    def model_cancel(self, item: ModelItem, reason: str | None, actor: str | None) -> None:
        now = self.clock.now()
        detail: dict[str, Any] = {"from": item.state}
        if reason is not None:
            detail["reason"] = reason
        item.fence += 1  # as a takeover: the holder's next report is refused
        item.state = "cancelled"
        item.error = reason
        item.lease_expires_at = None
        item.due_at = None
        item.updated_at = now
        item.events.append(("cancelled", item.fence, None, actor, detail, as_datetime(now)))

    def model_requeue(self, item: ModelItem, actor: str | None) -> None:
        now = self.clock.now()
        item.events.append(
            ("requeued", item.fence, None, actor, {"from": item.state}, as_datetime(now))
        )
        item.state = "ready"
        item.attempts = 0
        item.error = item.result = item.owner = None
        item.lease_expires_at = item.due_at = None
        item.offload_handle = None
        item.updated_at = now

    @rule(item_id=items, actor=maybe_actor, reason=st.sampled_from((None, "stop")), wait=waits)
    def cancel(self, item_id: int, actor: str | None, reason: str | None, wait: float) -> None:
        """An operator cancels an item, whatever it is doing (running ones too)."""
        self.clock.advance(wait)
        item = self.model_items[item_id]
        refusal = self.scope_refusal(item, actor)
        state, error = self.attempt(self.store.cancel(item_id, reason=reason, actor_id=actor))
        self.check_error(error, refusal, f"cancel({item_id}, actor={actor})")
        if refusal is not None:
            return
        if item.state in SETTLED_STATES:
            assert state == item.state, f"cancel of settled item {item_id} said {state}"
            return
        self.model_cancel(item, reason, actor)
        assert state == "cancelled"

    @rule(item_id=items, actor=maybe_actor)
    def requeue(self, item_id: int, actor: str | None) -> None:
        item = self.model_items[item_id]
        refusal = self.scope_refusal(item, actor)
        if refusal is None and item.state not in ("failed", "cancelled"):
            refusal = NotRequeueable
        _, error = self.attempt(self.store.requeue(item_id, actor_id=actor))
        self.check_error(error, refusal, f"requeue({item_id}, actor={actor})")
        if refusal is None:
            self.model_requeue(item, actor)

    def filtered(
        self, project: str | None, states: tuple[str, ...], actor: str | None
    ) -> list[ModelItem]:
        """The model's items a filter takes, by id."""
        return [
            self.model_items[i]
            for i in sorted(self.model_items)
            if self.in_scope(self.model_items[i], project, actor)
            and (not states or self.model_items[i].state in states)
        ]

    @rule(
        project=maybe_project,
        states=st.sampled_from(((), ("ready", "deferred"), ("claimed",), ("failed", "done"))),
        actor=maybe_actor,
        chunk=st.integers(min_value=1, max_value=3),
    )
    def cancel_where(
        self, project: str | None, states: tuple[str, ...], actor: str | None, chunk: int
    ) -> None:
        live = tuple(s for s in (states or ITEM_STATES) if s not in SETTLED_STATES)
        targets = self.filtered(project, live, actor) if live else []
        count, error = self.attempt(
            self.store.cancel_where(
                project_id=project, state=states or None, reason="bulk", chunk=chunk,
                actor_id=actor,
            )
        )  # fmt: skip
        self.check_error(error, None, "cancel_where")
        assert count == len(targets), f"cancel_where cancelled {count}, expected {len(targets)}"
        for item in targets:
            self.model_cancel(item, "bulk", actor)

    @rule(project=maybe_project, actor=maybe_actor, chunk=st.integers(min_value=1, max_value=3))
    def requeue_where(self, project: str | None, actor: str | None, chunk: int) -> None:
        targets = self.filtered(project, ("failed", "cancelled"), actor)
        count, error = self.attempt(
            self.store.requeue_where(project_id=project, chunk=chunk, actor_id=actor)
        )
        self.check_error(error, None, "requeue_where")
        assert count == len(targets), f"requeue_where requeued {count}, expected {len(targets)}"
        for item in targets:
            self.model_requeue(item, actor)

    @rule(item_id=items, actor=maybe_actor)
    def wait(self, item_id: int, actor: str | None) -> None:
        """wait() returns a settled item at once; an unsettled one times out."""
        item = self.model_items[item_id]
        refusal = self.scope_refusal(item, actor)
        settled = item.state in SETTLED_STATES
        if refusal is None and not settled:
            refusal = WaitTimeout
        row, error = self.attempt(
            self.store.wait(item_id, timeout=30 if settled else 0.01, actor_id=actor)
        )
        self.check_error(error, refusal, f"wait({item_id}, actor={actor})")
        if refusal is None:
            assert row is not None and row_view(row) == model_row_view(item)

    @rule(
        project=maybe_project,
        states=st.sampled_from(((), ("ready",), ("failed", "cancelled"), ("claimed", "done"))),
        newest=st.booleans(),
        limit=st.integers(min_value=1, max_value=4),
        actor=maybe_actor,
    )
    def list_items(
        self, project: str | None, states: tuple[str, ...], newest: bool, limit: int,
        actor: str | None,
    ) -> None:  # fmt: skip
        """items(): the filter's items, newest (or oldest) first, two pages by keyset."""
        expected = self.filtered(project, states, actor)
        if newest:
            expected.reverse()
        order = "newest" if newest else "oldest"
        first = self.run(
            self.store.items(
                project_id=project, state=states or None, order=order, limit=limit,
                actor_id=actor,
            )
        )  # fmt: skip
        assert [row_view(r) for r in first] == [model_row_view(i) for i in expected[:limit]]
        if len(first) == limit:
            second = self.run(
                self.store.items(
                    project_id=project, state=states or None, order=order, limit=limit,
                    after=first[-1]["item_id"], actor_id=actor,
                )
            )  # fmt: skip
            assert [r["item_id"] for r in second] == [
                i.item_id for i in expected[limit : 2 * limit]
            ]

    @rule(seconds=advances)
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # --- reads -------------------------------------------------------------------------

    @rule(item_id=items, actor=actors)
    def scoped_reads(self, item_id: int, actor: str) -> None:
        item = self.model_items[item_id]
        row, row_error = self.attempt(self.store.item(item_id, actor_id=actor))
        events, events_error = self.attempt(self.store.events(item_id, actor_id=actor))
        if self.visible(actor, item.project_id):
            self.check_error(row_error, None, "scoped item()")
            self.check_error(events_error, None, "scoped events()")
            assert row is not None and events is not None
            assert row_view(row) == model_row_view(item)
            assert [event_view(e) for e in events] == item.events
            assert all(e["item_id"] == item_id for e in events)
        else:
            self.check_error(row_error, ScopeDenied, "scoped item()")
            self.check_error(events_error, ScopeDenied, "scoped events()")

    def in_scope(self, item: ModelItem, project: str | None, actor: str | None) -> bool:
        return (project is None or item.project_id == project) and (
            actor is None or self.visible(actor, item.project_id)
        )

    def expected_counts(self, project: str | None, actor: str | None) -> dict[str, int]:
        states = [i.state for i in self.model_items.values() if self.in_scope(i, project, actor)]
        return {state: states.count(state) for state in ITEM_STATES}

    def expected_next_due(self, project: str | None, actor: str | None) -> dt.datetime | None:
        """The earliest due_at of a deferred item, or lease end of a claimed one, among
        the items a claim with these filters could take once that time comes."""
        alarms = [
            item.due_at if item.state == "deferred" else self.free_at(item)
            for item in self.model_items.values()
            if item.state in ("deferred", "claimed")
            and item.project_id not in self.model_limits
            and self.projects[item.project_id] == "open"
            and self.in_scope(item, project, actor)
            and (item.state == "claimed" or self.twin_free(item))
        ]
        now = self.clock.now()
        for limited in self.model_limits:
            if (
                self.projects[limited] == "open"
                and (project is None or limited == project)
                and (actor is None or self.visible(actor, limited))
            ):
                alarms.append(self.limited_due(limited, actor, now))
        found = [a for a in alarms if a is not None]
        return optional_datetime(min(found) if found else None)

    @rule(project=maybe_project, actor=maybe_actor)
    def scoped_summaries(self, project: str | None, actor: str | None) -> None:
        """counts() and next_due() of one project, or of an actor's projects."""
        counts = self.run(self.store.counts(project_id=project, actor_id=actor))
        assert counts == self.expected_counts(project, actor), f"counts({project}, {actor})"
        due = self.run(self.store.next_due(project_id=project, actor_id=actor))
        assert due == self.expected_next_due(project, actor), f"next_due({project}, {actor})"

    @rule(handle=handles, actor=maybe_actor)
    def offloaded(self, handle: str, actor: str | None) -> None:
        """offloaded(handle) lists that batch's items (the actor's only), by id."""
        rows, error = self.attempt(self.store.offloaded(handle, actor_id=actor))
        self.check_error(error, None, "offloaded")
        assert rows is not None
        expected = [
            model_row_view(self.model_items[i])
            for i in sorted(self.model_items)
            if self.model_items[i].state == "offloaded"
            and self.model_items[i].offload_handle == handle
            and (actor is None or self.visible(actor, self.model_items[i].project_id))
        ]
        assert [row_view(row) for row in rows] == expected

    @rule(beyond=st.integers(min_value=1, max_value=3), actor=maybe_actor)
    def absent_item(self, beyond: int, actor: str | None) -> None:
        item_id = len(self.model_items) + beyond
        expected = UnknownItem if actor is None else ScopeDenied
        store = self.store
        calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
            "item": lambda: store.item(item_id, actor_id=actor),
            "events": lambda: store.events(item_id, actor_id=actor),
            "renew": lambda: store.renew(item_id, fence=1, actor_id=actor),
            "finish": lambda: store.finish(item_id, fence=1, actor_id=actor),
            "park": lambda: store.park(item_id, fence=1, delay=1, actor_id=actor),
            "offload": lambda: store.offload(item_id, fence=1, handle="h", actor_id=actor),
        }
        for what, call in calls.items():
            _, error = self.attempt(call())
            self.check_error(error, expected, f"{what}() of absent item {item_id}")
        self.jitter.random()  # retry() draws its jitter before it looks for the item
        _, error = self.attempt(store.retry(item_id, fence=1, actor_id=actor))
        self.check_error(error, expected, f"retry() of absent item {item_id}")

    @precondition(lambda self: self.model_items)
    @rule(new_instance=st.booleans(), identity=st.booleans())
    def reopen(self, new_instance: bool, identity: bool) -> None:
        """Close the store; the next call reopens it, or a new one on the same file (a
        process restart), with or without an identity. Nothing the model knows may be
        lost either way."""
        self.run(self.store.close())
        if new_instance:
            self.identity = identity
            self.store = self.new_store()

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def store_agrees_with_model(self) -> None:
        async def read_everything() -> Any:
            ids = list(self.model_items)
            # Concurrent reads: the store serves them from its pool of read connections.
            found = await asyncio.gather(
                *(self.store.item(i) for i in ids), *(self.store.events(i) for i in ids)
            )
            rows = dict(zip(ids, found[: len(ids)], strict=True))
            events = dict(zip(ids, found[len(ids) :], strict=True))
            projects = await self.store.projects()
            visible = {a: await self.store.visible_projects(a) for a in ACTORS}
            counts = await self.store.counts()
            next_due = await self.store.next_due()
            problems = await verify_ledger(self.store)
            limits = await self.store.project_limits()
            schedules = await self.store.schedules()
            return rows, events, projects, visible, counts, next_due, problems, limits, schedules

        rows, events, projects, visible, counts, next_due, problems, limits, schedules = self.run(
            read_everything()
        )
        assert [
            (row["name"], row["project_id"], row["payload"], row["every"].total_seconds(),
             row["catch_up"], row["next_at"], row["last_at"], row["paused"], row["fingerprint"])
            for row in schedules
        ] == [
            (name, m["project_id"], m["payload"], m["every"], m["catch_up"],
             as_datetime(m["next_at"]), optional_datetime(m["last_at"]), m["paused"],
             m["fingerprint"])
            for name, m in sorted(self.model_schedules.items())
        ]  # fmt: skip
        now = self.clock.now()
        assert [
            (row["project_id"], row["max_running"], row["per_minute"], row["burst"],
             row["running"], row["tokens"])
            for row in limits
        ] == [
            (p, m["max_running"], m["per_minute"], m["burst"], self.running(p), self.bucket(m, now))
            for p, m in sorted(self.model_limits.items())
        ]  # fmt: skip
        assert problems == []
        for item_id, item in self.model_items.items():
            assert row_view(rows[item_id]) == model_row_view(item), f"item {item_id}"
            got_events = [event_view(e) for e in events[item_id]]
            assert got_events == item.events, f"events of item {item_id}"
        assert {p["project_id"]: p["status"] for p in projects} == self.projects
        for actor in ACTORS:
            expected = sorted(p for a, p in self.assignments if a == actor)
            assert visible[actor] == expected, f"visible_projects({actor!r})"
        assert counts == self.expected_counts(None, None)
        assert next_due == self.expected_next_due(None, None)


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
)


def test_the_store_behaves_like_its_model(
    asyncplane_backend: str, request: pytest.FixtureRequest
) -> None:
    """The same machine on both backends: on PostgreSQL every run gets a fresh schema."""
    if asyncplane_backend == "sqlite":
        run_state_machine_as_test(StoreMachine, settings=SETTINGS)
        return
    server: str = request.getfixturevalue("asyncplane_postgres_url")
    runs = itertools.count()

    class PostgresMachine(StoreMachine):
        def make_location(self) -> str:
            self.schema = f"sm_{os.getpid()}_{next(runs)}"
            self.run(testing.execute_sql(server, f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))
            self.run(testing.execute_sql(server, f"CREATE SCHEMA {self.schema}"))
            return testing.with_schema(server, self.schema)

        def drop_location(self) -> None:
            self.run(testing.execute_sql(server, f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))

    # Fewer runs: each one migrates a fresh schema and opens three server connections.
    run_state_machine_as_test(PostgresMachine, settings=settings(SETTINGS, max_examples=50))
