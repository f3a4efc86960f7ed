"""A Hypothesis state machine: the real store, on a real SQLite file, against a plain model.

Every example gets a fresh temporary directory, a fresh database file, a ManualClock and
an event loop of its own. Each rule makes its store calls (``loop.run_until_complete``)
and the same change to a plain-Python model; after every step the invariant reads every
item row and its ledger back from the store, compares them, the projects and the
assignments with the model, and runs verify_ledger.

What the model knows (see _sqlite.py and _sqlite_sql.py for the store's side):

* A claim serves the lowest item id among items that are ``ready``, or ``claimed`` with a
  lease that has lapsed (``lease_expires_at <= now``), in projects whose status is
  ``"open"`` and, with an actor, assigned to that actor. A claim raises fence and attempts
  by one; a takeover first records ``lease_expired`` at the old fence and owner.
* renew/finish succeed only for a claimed item at its current fence, whatever the clock
  says; otherwise ScopeDenied (actor not assigned, or no such item for an actor),
  UnknownItem (no such item, control plane) or FenceRejected, in that order.
* Scope is assignment only: project status limits claims, never reads, renew or finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import pathlib
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from asyncplane import (
    AsyncplaneError,
    ClaimedItem,
    ControlStore,
    FenceRejected,
    ProjectExists,
    ScopeDenied,
    UnknownItem,
    UnknownProject,
    verify_ledger,
)
from asyncplane.testing import ManualClock

T = TypeVar("T")

LEASE = 30
PROJECTS = ("p1", "p2", "p3")
ACTORS = ("a1", "a2")
OWNERS = ("w1", "w2", "w3")

project_ids = st.sampled_from(PROJECTS)
statuses = st.sampled_from(("open", "open", "paused", "closed"))
actors = st.sampled_from(ACTORS)
# The control plane (None) half the time, an actor the other half.
maybe_actor = st.sampled_from((None, None, "a1", "a2"))
owners = st.sampled_from(OWNERS)
# None means the store's default lease (LEASE seconds).
leases = st.sampled_from((None, None, 5, 60))
# Steps around the lease: short of it, exactly at it (expiry is inclusive), past it.
advances = st.sampled_from((0.5, 1, 4, 5, 10, 29, 30, 31, 60, 300))
# How far a presented fence is from the current one (clamped to at least 1).
fence_offsets = st.sampled_from((0, 0, 0, -1, -2, 1))
finish_statuses = st.sampled_from(("done", "failed"))
counts = st.integers(min_value=1, max_value=3)
report_statuses = st.sampled_from((None, "done", "failed"))  # None: renew instead
# How long a worker waits before it claims, renews or finishes (past LEASE, its own lease
# has lapsed and earlier claims can be taken over).
waits = st.sampled_from((0, 0, 0, 10, 30, 45))

# (event_type, fence, owner, actor_id, detail, at)
Event = tuple[str, int, "str | None", "str | None", "dict[str, Any] | None", dt.datetime]


@dataclasses.dataclass
class ModelItem:
    item_id: int
    project_id: str
    payload: dict[str, Any]
    created_at: float
    updated_at: float
    state: str = "ready"
    fence: int = 0
    attempts: int = 0
    owner: str | None = None
    lease_expires_at: float | None = None
    events: list[Event] = dataclasses.field(default_factory=list)


class StoreMachine(RuleBasedStateMachine):
    items = Bundle("items")
    tickets = Bundle("tickets")  # (item_id, fence): what a claim handed to its worker

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="asyncplane-sm-")
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.path = pathlib.Path(self.tmp.name) / "store.db"
        self.store = ControlStore(self.path, lease_seconds=LEASE, clock=self.clock)
        self.projects: dict[str, str] = {}
        self.assignments: set[tuple[str, str]] = set()
        self.model_items: dict[int, ModelItem] = {}

    def teardown(self) -> None:
        try:
            self.loop.run_until_complete(self.store.close())
        finally:
            try:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
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
        self, item_id: int, fence: int, actor: str | None
    ) -> type[AsyncplaneError] | None:
        """What renew/finish must raise for this call, or None if it must succeed."""
        item = self.model_items.get(item_id)
        if item is None:
            return UnknownItem if actor is None else ScopeDenied
        if actor is not None and not self.visible(actor, item.project_id):
            return ScopeDenied
        if item.state != "claimed" or item.fence != fence:
            return FenceRejected
        return None

    def check_fence_details(self, error: AsyncplaneError | None, item_id: int) -> None:
        if isinstance(error, FenceRejected):
            item = self.model_items[item_id]
            assert (error.current_fence, error.state) == (item.fence, item.state)

    def expected_claim(self, actor: str | None) -> ModelItem | None:
        now = self.clock.now()
        for item_id in sorted(self.model_items):
            item = self.model_items[item_id]
            if self.projects[item.project_id] != "open":
                continue
            if actor is not None and not self.visible(actor, item.project_id):
                continue
            if item.state == "ready":
                return item
            if item.state == "claimed":
                assert item.lease_expires_at is not None
                if item.lease_expires_at <= now:
                    return item
        return None

    # --- projects and scope ------------------------------------------------------------

    @initialize(
        target=items, assign_to=st.sampled_from(("a1", "a2", None)), count=st.integers(0, 4)
    )
    def first_project(self, assign_to: str | None, count: int) -> Any:
        """Start with an open project "p1" holding a few items, so most examples have work.

        (Hypothesis switches random subsets of rules off per example; work that is there
        from the start keeps claim, renew and finish busy even when enqueue is off.)
        """
        self.run(self.store.create_project("p1", "Project p1"))
        self.projects["p1"] = "open"
        if assign_to is not None:
            self.run(self.store.assign("p1", assign_to))
            self.assignments.add((assign_to, "p1"))
        return self.do_enqueue("p1", None, count)

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

    # --- items -------------------------------------------------------------------------

    # The control plane and the actors get rules of their own: Hypothesis switches random
    # subsets of rules off per example (swarm testing), and two rules for one call make
    # it likelier that each example can enqueue and claim at all.

    @rule(target=items, project=project_ids, count=counts)
    def enqueue(self, project: str, count: int) -> Any:
        return self.do_enqueue(project, None, count)

    @rule(target=items, project=project_ids, actor=actors, count=counts)
    def enqueue_as_actor(self, project: str, actor: str, count: int) -> Any:
        return self.do_enqueue(project, actor, count)

    @rule(target=tickets, owner=owners, lease=leases, wait=waits)
    def claim(self, owner: str, lease: float | None, wait: float) -> Any:
        return self.do_claim(owner, None, lease, wait)

    @rule(target=tickets, owner=owners, actor=actors, lease=leases, wait=waits)
    def claim_as_actor(self, owner: str, actor: str, lease: float | None, wait: float) -> Any:
        return self.do_claim(owner, actor, lease, wait)

    def do_enqueue(self, project: str, actor: str | None, count: int) -> Any:
        refusal: type[AsyncplaneError] | None
        if actor is None:
            refusal = None if project in self.projects else UnknownProject
        else:
            refusal = None if self.visible(actor, project) else ScopeDenied
        new_ids = []
        for _ in range(count):
            new_id = len(self.model_items) + 1  # AUTOINCREMENT on a fresh file: 1, 2, ...
            payload = {"n": new_id, "via": actor}
            item_id, error = self.attempt(self.store.enqueue(project, payload, actor_id=actor))
            self.check_error(error, refusal, f"enqueue({project!r}, actor={actor})")
            if refusal is not None:
                return multiple()
            assert item_id == new_id, f"expected item id {new_id}, the store gave {item_id}"
            now = self.clock.now()
            item = ModelItem(new_id, project, payload, created_at=now, updated_at=now)
            item.events.append(("queued", 0, None, actor, None, as_datetime(now)))
            self.model_items[new_id] = item
            new_ids.append(new_id)
        return multiple(*new_ids)

    def do_claim(self, owner: str, actor: str | None, lease: float | None, wait: float) -> Any:
        """A worker claims, after waiting a while (which may let earlier leases lapse)."""
        self.clock.advance(wait)
        expected = self.expected_claim(actor)
        now = self.clock.now()
        got, error = self.attempt(self.store.claim(owner, actor_id=actor, lease_seconds=lease))
        self.check_error(error, None, "claim")
        if expected is None:
            assert got is None, f"the model expected no claim, the store handed out {got!r}"
            return multiple()
        assert isinstance(got, ClaimedItem), f"expected item {expected.item_id}, got None"
        assert got.item_id == expected.item_id, (
            f"expected item {expected.item_id}, the store handed out item {got.item_id}"
        )
        item = expected
        if item.state == "claimed":  # a takeover of a lapsed lease
            detail = {"taken_over_by": owner}
            item.events.append(
                ("lease_expired", item.fence, item.owner, actor, detail, as_datetime(now))
            )
        item.state = "claimed"
        item.fence += 1
        item.attempts += 1
        item.owner = owner
        item.lease_expires_at = now + (LEASE if lease is None else lease)
        item.updated_at = now
        item.events.append(("claimed", item.fence, owner, actor, None, as_datetime(now)))
        assert (got.project_id, got.payload, got.fence, got.attempts, got.owner) == (
            item.project_id,
            item.payload,
            item.fence,
            item.attempts,
            item.owner,
        )
        assert got.lease_expires_at == as_datetime(item.lease_expires_at)
        return (item.item_id, item.fence)

    def do_renew(self, item_id: int, fence: int, actor: str | None, lease: float | None) -> None:
        refusal = self.fenced_refusal(item_id, fence, actor)
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

    def do_finish(self, item_id: int, fence: int, status: str, actor: str | None) -> None:
        refusal = self.fenced_refusal(item_id, fence, actor)
        now = self.clock.now()
        _, error = self.attempt(
            self.store.finish(item_id, fence=fence, status=status, actor_id=actor)
        )
        self.check_error(error, refusal, f"finish({item_id}, fence={fence}, actor={actor})")
        self.check_fence_details(error, item_id)
        if refusal is None:
            item = self.model_items[item_id]
            item.state = status
            item.lease_expires_at = None
            item.updated_at = now
            item.events.append((status, fence, item.owner, actor, None, as_datetime(now)))

    @rule(ticket=tickets, actor=maybe_actor, lease=leases, wait=waits)
    def renew(
        self, ticket: tuple[int, int], actor: str | None, lease: float | None, wait: float
    ) -> None:
        """A worker renews, after a while, with the fence its claim gave it."""
        self.clock.advance(wait)
        self.do_renew(*ticket, actor, lease)

    @rule(ticket=tickets, status=finish_statuses, actor=maybe_actor, wait=waits)
    def finish(self, ticket: tuple[int, int], status: str, actor: str | None, wait: float) -> None:
        """A worker reports, after a while, with the fence its claim gave it."""
        self.clock.advance(wait)
        self.do_finish(*ticket, status, actor)

    @rule(item_id=items, offset=fence_offsets, status=report_statuses, actor=maybe_actor)
    def report_any_fence(
        self, item_id: int, offset: int, status: str | None, actor: str | None
    ) -> None:
        """renew (status None) or finish any item, at a fence near its current one.

        Reaches what tickets do not: items never claimed, and fences from the future.
        """
        fence = max(1, self.model_items[item_id].fence + offset)
        if status is None:
            self.do_renew(item_id, fence, actor, None)
        else:
            self.do_finish(item_id, fence, status, actor)

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

    @rule(beyond=st.integers(min_value=1, max_value=3), actor=maybe_actor)
    def absent_item(self, beyond: int, actor: str | None) -> None:
        item_id = len(self.model_items) + beyond
        expected = UnknownItem if actor is None else ScopeDenied
        calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
            "item": lambda: self.store.item(item_id, actor_id=actor),
            "events": lambda: self.store.events(item_id, actor_id=actor),
            "renew": lambda: self.store.renew(item_id, fence=1, actor_id=actor),
            "finish": lambda: self.store.finish(item_id, fence=1, actor_id=actor),
        }
        for what, call in calls.items():
            _, error = self.attempt(call())
            self.check_error(error, expected, f"{what}() of absent item {item_id}")

    @precondition(lambda self: self.model_items)
    @rule(new_instance=st.booleans())
    def reopen(self, new_instance: bool) -> None:
        """Close the store; the next call reopens it, or a new one on the same file (a
        process restart). Nothing the model knows may be lost either way."""
        self.run(self.store.close())
        if new_instance:
            self.store = ControlStore(self.path, lease_seconds=LEASE, clock=self.clock)

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def store_agrees_with_model(self) -> None:
        async def read_everything() -> Any:
            rows = {i: await self.store.item(i) for i in self.model_items}
            events = {i: await self.store.events(i) for i in self.model_items}
            projects = await self.store.projects()
            visible = {a: await self.store.visible_projects(a) for a in ACTORS}
            problems = await verify_ledger(self.store)
            return rows, events, projects, visible, problems

        rows, events, projects, visible, problems = self.run(read_everything())
        assert problems == []
        for item_id, item in self.model_items.items():
            assert row_view(rows[item_id]) == model_row_view(item), f"item {item_id}"
            got_events = [event_view(e) for e in events[item_id]]
            assert got_events == item.events, f"events of item {item_id}"
        assert {p["project_id"]: p["status"] for p in projects} == self.projects
        for actor in ACTORS:
            expected = sorted(p for a, p in self.assignments if a == actor)
            assert visible[actor] == expected, f"visible_projects({actor!r})"


def as_datetime(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.timezone.utc)


def row_view(row: dict[str, Any]) -> tuple[Any, ...]:
    return (
        row["item_id"],
        row["project_id"],
        row["state"],
        row["payload"],
        row["fence"],
        row["attempts"],
        row["owner"],
        row["lease_expires_at"],
        row["created_at"],
        row["updated_at"],
    )


def model_row_view(item: ModelItem) -> tuple[Any, ...]:
    expires = None if item.lease_expires_at is None else as_datetime(item.lease_expires_at)
    return (
        item.item_id,
        item.project_id,
        item.state,
        item.payload,
        item.fence,
        item.attempts,
        item.owner,
        expires,
        as_datetime(item.created_at),
        as_datetime(item.updated_at),
    )


def event_view(event: dict[str, Any]) -> Event:
    return (
        event["event_type"],
        event["fence"],
        event["owner"],
        event["actor_id"],
        event["detail"],
        event["at"],
    )


TestStore = StoreMachine.TestCase
TestStore.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
)
