"""The rules core on its own: pure functions, no database.

These sit beside, never instead of, the behavioural suite that runs every rule on both
backends; they pin the decisions themselves, so a change to a rule shows up here first.
"""

from __future__ import annotations

import datetime
import json
import math
import random
from typing import Any

import pytest

from asyncplane import (
    FenceRejected,
    NotRequeueable,
    ScopeDenied,
    StorageError,
    UnknownItem,
    _backend,
    _fingerprint,
    _models,
    _rules,
)
from asyncplane._models import ITEM_STATES
from asyncplane._rules import Candidate, ClaimMerge


def candidate(item_id: int, priority: int = 0, **fields: Any) -> Candidate:
    base: dict[str, Any] = {
        "item_id": item_id, "state": "ready", "fence": 0, "owner": None, "attempts": 0,
        "max_attempts": None, "project_id": "p", "fingerprint": None, "priority": priority,
        "service_class": "standard", "sla": None,
    }  # fmt: skip
    base.update(fields)
    return Candidate(**base)


def run_merge(arms: list[list[Candidate]], limit: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Drive a merge over in-memory arms (each sorted in claim order); return the chosen ids
    and every (arm, offset) page read."""
    for arm in arms:
        assert arm == sorted(arm, key=_rules.claim_key)
    merge = ClaimMerge(len(arms), limit)
    reads: list[tuple[int, int]] = []
    while (arm := merge.hungry()) is not None:
        size, offset = merge.next_page(arm)
        reads.append((arm, offset))
        merge.feed(arm, arms[arm][offset : offset + size])
    return [c.item_id for c in merge.chosen], reads


def test_rows_a_quota_refuses_every_claimer_are_no_news_for_other_claimers() -> None:
    # A lapsed claim of a project whose bucket is empty: no claimer may take it, so a
    # claim that locked and refused it tells no one (telling set the fleet claiming and
    # telling in a loop). A project whose limits another claimer holds refuses this
    # claim alone: that one could take the row this claim held locked, so it is told.
    lapsed = candidate(1, state="claimed", fence=1, attempts=1, owner="gone")
    for blocked, told in (((), False), (("p",), True)):
        merge = ClaimMerge(1, 1, quotas={"p": _rules.Quota(slots=0, tokens=0)},
                           arm_projects=[None], blocked=blocked)  # fmt: skip
        pages = iter([[lapsed], []])
        while (arm := merge.hungry()) is not None:
            merge.feed(arm, next(pages))
        assert merge.chosen == [] and merge.fetched == 1
        assert merge.others_to_tell(0) is told
    unlimited = ClaimMerge(1, 1)
    unlimited.feed(0, [candidate(1), candidate(2)])
    assert unlimited.hungry() is None and unlimited.others_to_tell(1)  # one passed over


def test_claim_order_is_priority_then_realtime_then_sla_then_age() -> None:
    rows = [
        candidate(1),
        candidate(2, priority=5),
        candidate(3, service_class="realtime"),
        candidate(4, sla=100.0),
        candidate(5, sla=50.0),
        candidate(6, priority=5, service_class="realtime"),
    ]
    order = [c.item_id for c in sorted(rows, key=_rules.claim_key)]
    assert order == [6, 2, 3, 5, 4, 1]


def test_the_merge_takes_the_smallest_head_of_every_arm() -> None:
    ready = [candidate(1, priority=3), candidate(4, priority=1)]
    due = [candidate(2, priority=2, state="deferred")]
    lapsed = [candidate(3, priority=5, state="claimed", fence=1)]
    chosen, _ = run_merge([ready, due, lapsed], 3)
    assert chosen == [3, 1, 2]


def test_one_item_per_fingerprint_and_a_skipped_twin_never_pushes_a_later_item_out() -> None:
    ready = [
        candidate(1, priority=9, fingerprint="x"),
        candidate(2, priority=8, fingerprint="x"),
        candidate(3, priority=7, fingerprint="x"),
        candidate(4, priority=6),
    ]
    chosen, reads = run_merge([ready], 2)
    assert chosen == [1, 4]
    assert reads == [(0, 0), (0, 2)]  # a second page, only because twins were skipped
    # The same fingerprint in another project is another content.
    other = [candidate(1, fingerprint="x"), candidate(2, fingerprint="x", project_id="q")]
    assert run_merge([other], 2)[0] == [1, 2]


def test_a_row_seen_again_on_a_later_page_is_taken_once() -> None:
    merge = ClaimMerge(1, 3)
    merge.feed(0, [candidate(1, fingerprint="x"), candidate(2, fingerprint="x"), candidate(3)])
    assert merge.hungry() == 0  # 1 and 3 taken, 2 skipped: one more page wanted
    merge.feed(0, [candidate(3), candidate(4)])  # a newer snapshot shifted 3 onto it
    assert merge.hungry() is None
    assert [c.item_id for c in merge.chosen] == [1, 3, 4]


def test_pages_double_up_to_the_cap() -> None:
    merge = ClaimMerge(1, 1)
    sizes = []
    for _ in range(14):
        size, _ = merge.next_page(0)
        sizes.append(size)
        merge.feed(0, [candidate(n, fingerprint="x") for n in range(size)])
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == _rules.MAX_PAGE


def test_the_merge_agrees_with_a_sorted_reference_on_random_arms() -> None:
    rng = random.Random(7)
    for _ in range(200):
        pool = [
            candidate(
                n, priority=rng.randint(0, 3), service_class=rng.choice(["standard", "realtime"]),
                sla=rng.choice([None, 10.0, 20.0]), fingerprint=rng.choice([None, "a", "b", "c"]),
            )
            for n in range(1, rng.randint(1, 40))
        ]  # fmt: skip
        arms: list[list[Candidate]] = [[], [], []]
        for c in pool:
            arms[rng.randrange(3)].append(c)
        arms = [sorted(arm, key=_rules.claim_key) for arm in arms]
        limit = rng.randint(1, 12)
        expected, taken = [], set()
        for c in sorted(pool, key=_rules.claim_key):
            if len(expected) == limit:
                break
            if c.fingerprint is not None:
                if c.fingerprint in taken:
                    continue
                taken.add(c.fingerprint)
            expected.append(c.item_id)
        assert run_merge(arms, limit)[0] == expected


def test_deal_hands_out_in_request_order() -> None:
    ops = [_backend.ClaimOp(f"w{n}", limit, 60.0, None, None) for n, limit in enumerate((2, 1, 3))]
    chosen = [candidate(n) for n in range(1, 5)]
    dealt = [(c.item_id, op.owner) for c, op in _rules.deal(chosen, ops)]
    assert dealt == [(1, "w0"), (2, "w0"), (3, "w1"), (4, "w2")]


def new_item(fingerprint: str | None, dedup: bool = True) -> _backend.NewItem:
    return _backend.NewItem("{}", 0, "standard", None, fingerprint, dedup, None, None)


def test_enqueue_dedup_within_a_call_and_against_the_store() -> None:
    items = [new_item("a"), new_item(None), new_item("a"), new_item("b"), new_item("a", False)]
    plan = _rules.EnqueuePlan(items, {"b": 40})
    assert plan.new == [0, 1, 4]
    assert plan.ids([7, 8, 9]) == [7, 8, 7, 40, 9]
    assert _rules.dedup_fingerprints(items) == ["a", "b"]


def test_retry_plans_back_off_and_stop_at_the_budget() -> None:
    op = _backend.RetryOp(1, 1, None, "flaky", None, 2.0, 30.0, 0.5)
    assert _rules.retry_plan(op, 1, 3, 100.0) == _rules.RetryPlan("deferred", 102.0, "flaky")
    assert _rules.retry_plan(op, 2, 3, 100.0).due_at == 104.0
    assert _rules.retry_plan(op, 10, None, 0.0).due_at == 30.0  # capped
    failed = _rules.retry_plan(op, 3, 3, 100.0)
    assert failed.state == "failed" and failed.error == "attempts exhausted (3 of 3): flaky"
    fixed = op._replace(delay=5.0)
    assert _rules.retry_plan(fixed, 1, None, 100.0).due_at == 105.0
    assert _rules.backoff(10**6, 1.0, 300.0, 0.99) == 300.0  # no overflow, however many


def test_refusals_say_the_same_for_absent_and_foreign() -> None:
    absent = _rules.fence_refusal(5, 1, "a", None)
    foreign = _rules.fence_refusal(5, 1, "a", ("claimed", 2, False))
    assert isinstance(absent, ScopeDenied) and str(absent) == str(foreign)
    assert isinstance(_rules.fence_refusal(5, 1, None, None), UnknownItem)
    stale = _rules.fence_refusal(5, 1, None, ("claimed", 2, True))
    assert isinstance(stale, FenceRejected) and (stale.current_fence, stale.state) == (2, "claimed")
    assert str(_rules.project_denied("p", "a")) == str(_rules.project_denied("p", "a"))


def test_events_carry_the_details_the_ledger_has_always_recorded() -> None:
    def detail(event: _rules.Event) -> Any:
        return None if event.detail_json is None else json.loads(event.detail_json)

    retried = _rules.settlement_event(1, "retried", 1, "w", None, 0.0, error=None, due_at=5.0)
    assert detail(retried) == {"error": None, "due_at": 5.0}
    assert detail(_rules.settlement_event(1, "done", 1, "w", None, 0.0)) is None
    assert detail(_rules.settlement_event(1, "failed", 1, "w", None, 0.0, error="x")) == {
        "error": "x"
    }
    error, events = _rules.exhausted_lease_events(
        candidate(3, attempts=2, max_attempts=2), None, 1.0
    )
    assert [e.event_type for e in events] == ["lease_expired", "failed"]
    assert error == "attempts exhausted: the lease of attempt 2 of 2 lapsed"
    row = _rules.new_row("p", new_item(None)._replace(not_before=50.0), 10.0)
    assert (row.state, row.due_at) == ("deferred", 50.0)
    assert [e.event_type for e in _rules.arrival_events(9, row, None, 10.0)] == [
        "queued",
        "deferred",
    ]


@pytest.mark.parametrize("not_before", [None, 5.0, 10.0])
def test_an_item_whose_time_has_come_arrives_ready(not_before: float | None) -> None:
    row = _rules.new_row("p", new_item(None)._replace(not_before=not_before), 10.0)
    assert (row.state, row.due_at) == ("ready", None)


def test_a_first_page_past_the_page_cap_still_reads_on_past_skipped_twins() -> None:
    """A claim of more than MAX_PAGE items reads its whole batch as the first page (as
    PostgreSQL does, with every other arm's); twins skipped there must still make it read
    further, not take the arm for used up."""
    total = _rules.MAX_PAGE + 500
    rows = [candidate(n, fingerprint="x" if n < 10 else None) for n in range(total + 50)]
    merge = ClaimMerge(1, total)
    merge.feed(0, rows[:total])
    assert merge.hungry() == 0
    size, offset = merge.next_page(0)
    merge.feed(0, rows[offset : offset + size])
    assert merge.hungry() is None
    assert len(merge.chosen) == total


def test_one_arm_without_quotas_or_twins_gives_its_first_rows_dealt_in_order() -> None:
    # PostgreSQL's one-statement claim of a plain reach (CLAIM_ALONE) relies on this: one
    # arm, no quota, no two rows twins (each fingerprint, if any, a content of its own):
    # the merge chooses the arm's first rows in claim order, and `deal` hands them out
    # by `slots`.
    rng = random.Random(7)
    for _ in range(200):
        rows = sorted(
            (candidate(n, priority=rng.randrange(3), sla=rng.choice([None, 5.0, 9.0]),
                       fingerprint=rng.choice([None, f"content {n}"]))
             for n in range(rng.randrange(0, 30))),
            key=_rules.claim_key,
        )  # fmt: skip
        ops = [
            _backend.ClaimOp(f"w{n}", rng.randrange(1, 5), 60.0, None, None)
            for n in range(rng.randrange(1, 6))
        ]
        total = sum(op.limit for op in ops)
        chosen, _ = run_merge([rows], total)
        assert chosen == [c.item_id for c in rows[:total]]
        dealt = _rules.deal(rows[:total], ops)
        assert [op for _, op in dealt] == _rules.slots(ops, len(dealt))
        assert len(_rules.slots(ops, total + 5)) == total
        assert [sum(1 for _, o in dealt if o is op) for op in ops] == [
            min(op.limit, max(0, len(rows) - sum(o.limit for o in ops[:n])))
            for n, op in enumerate(ops)
        ]


def test_a_sole_arm_page_decides_the_claim_as_the_merge_would() -> None:
    # SQLite's claim skips the merge where one arm's first page settles it (most claims:
    # one project, nothing lapsed or due, no limits); where it says so, it chooses what
    # the merge chooses, and it says so for every page without twins that is short or
    # holds the whole batch.
    rng = random.Random(11)
    decided = 0
    for _ in range(500):
        rows = sorted(
            (candidate(n, priority=rng.randrange(3), project_id=rng.choice(["p", "q"]),
                       fingerprint=rng.choice([None, None, None, "a", "b"]))
             for n in range(1, rng.randrange(1, 30))),
            key=_rules.claim_key,
        )  # fmt: skip
        limit = rng.randint(1, 8)
        asked = rng.choice([limit, max(1, limit // 2), limit + 3])
        page = rows[:asked]
        merge = ClaimMerge(1, limit, first_page=asked)
        while (arm := merge.hungry()) is not None:
            size, offset = merge.next_page(arm)
            merge.feed(arm, rows[offset : offset + size])
        choice = _rules.sole_arm_choice(page, asked, limit)
        prints = [(c.project_id, c.fingerprint) for c in page[:limit] if c.fingerprint]
        settles = len(set(prints)) == len(prints) and (len(page) < asked or len(page) >= limit)
        assert (choice is not None) == settles
        if choice is not None:
            decided += 1
            assert [c.item_id for c in choice] == [c.item_id for c in merge.chosen]
    assert decided > 200


# --- operating single items -----------------------------------------------------------------


def test_a_cancel_raises_the_fence_of_a_live_item_and_leaves_a_settled_one() -> None:
    plan = _rules.cancel_plan(7, "claimed", 3, "stop", "ann", 10.0)
    assert plan is not None and plan.fence == 4
    assert plan.event.event_type == "cancelled" and plan.event.fence == 4
    assert json.loads(plan.event.detail_json or "{}") == {"from": "claimed", "reason": "stop"}
    for settled in ("done", "failed", "cancelled"):
        assert _rules.cancel_plan(7, settled, 3, None, None, 10.0) is None


def test_only_a_failed_or_cancelled_item_requeues() -> None:
    event = _rules.requeue_event(7, "failed", 3, None, 10.0)
    assert (event.event_type, event.fence) == ("requeued", 3)
    with pytest.raises(NotRequeueable, match="is claimed"):
        _rules.requeue_event(7, "claimed", 3, None, 10.0)


def test_a_tick_takes_only_a_pending_twin_and_adds_an_item_no_done_twin_answers() -> None:
    row = _backend.ScheduleRow(
        "s", "alpha", "{}", None, 60.0, "UTC", "latest", 0, "standard", "fp", True, None,
        False, 0.0, 60.0, None, 0.0, 0.0,
    )  # fmt: skip
    item, pending_twin = _rules.tick_item(row)
    assert (item.fingerprint, item.dedup, pending_twin) == ("fp", False, "fp")
    item, pending_twin = _rules.tick_item(row._replace(dedup=False))
    assert (item.fingerprint, item.dedup, pending_twin) == ("fp", False, None)
    item, pending_twin = _rules.tick_item(row._replace(fingerprint=None))
    assert (item.fingerprint, pending_twin) == (None, None)


def test_a_status_change_expecting_other_statuses_leaves_a_project_as_it_is() -> None:
    after = _rules.project_status_after
    assert after("paused", "open", ()) == "open"  # none expected: whatever it is
    assert after("closed", "open", ()) == "open"
    assert after("paused", "open", ("open", "paused")) == "open"
    assert after("closed", "open", ("open", "paused")) == "closed"
    assert after("closed", "paused", ("open",)) == "closed"


def test_an_action_expecting_a_state_or_a_fence_leaves_an_item_standing_otherwise() -> None:
    cancel = _rules.cancel_plan
    assert cancel(7, "claimed", 3, None, None, 10.0, ("claimed",), 3) is not None
    assert cancel(7, "claimed", 3, None, None, 10.0, ("claimed",), 2) is None  # a later run
    assert cancel(7, "claimed", 3, None, None, 10.0, ("deferred",), 3) is None
    assert cancel(7, "ready", 0, None, None, 10.0, (), 0) is not None  # never claimed
    assert _rules.requeue_event(7, "failed", 3, None, 10.0, (), 3).fence == 3
    with pytest.raises(NotRequeueable, match="is failed at fence 3, not at fence 2") as raised:
        _rules.requeue_event(7, "failed", 3, None, 10.0, ("failed",), 2)
    assert (raised.value.fence, raised.value.expected_fence) == (3, 2)
    # Of the three reasons, the first that holds is the one named.
    with pytest.raises(NotRequeueable, match="is claimed: only a failed"):
        _rules.requeue_event(7, "claimed", 3, None, 10.0, ("failed",), 2)
    with pytest.raises(NotRequeueable, match="is cancelled, not failed as expected"):
        _rules.requeue_event(7, "cancelled", 3, None, 10.0, ("failed",), 2)


def test_listing_arms_and_the_states_where_calls_take() -> None:
    assert _rules.listing_arms(("failed",), project=False) == ("failed",)
    assert _rules.listing_arms((), project=True) == ITEM_STATES  # the project index is by state
    assert _rules.listing_arms((), project=False) == ()  # the primary key
    assert _rules.cancel_states(("ready", "done")) == ("ready",)
    assert _rules.cancel_states(()) == ("ready", "deferred", "claimed", "offloaded")
    assert _rules.requeue_states(("failed", "ready")) == ("failed",)
    assert _rules.requeue_states(()) == ("failed", "cancelled")


def test_keyset_paging_and_chunks() -> None:
    assert _rules.keyset_start(True, None) == _rules.MAX_ITEM_ID
    assert _rules.keyset_start(False, None) == 0
    assert _rules.keyset_start(True, 42) == 41  # the page holds ids up to 41
    assert _rules.keyset_start(False, 42) == 42
    assert _rules.next_chunk([1, 2, 3], 3) == 3
    assert _rules.next_chunk([1, 2], 3) is None


# --- limits -------------------------------------------------------------------------------


def limits(**fields: Any) -> _rules.Limits:
    base: dict[str, Any] = dict.fromkeys(_rules.Limits._fields)
    base.update(project_id="p", running=0)
    base.update(fields)
    return _rules.Limits(**base)


def test_a_quota_leaves_the_slots_beside_the_running_and_the_whole_tokens() -> None:
    assert _rules.quota(limits(max_running=8, running=5), 0.0).room == 3
    assert _rules.quota(limits(max_running=2, running=5), 0.0).room == 0  # lowered below
    # 600 a minute is 10 a second: 0.25 tokens left a half second ago make 5.25, so 5.
    rated = limits(per_minute=600.0, burst=20, tokens=0.25, refilled_at=99.5)
    assert _rules.bucket(rated, 100.0) == pytest.approx(5.25)
    assert _rules.quota(rated, 100.0).room == 5
    # Never more than the burst, however long the bucket rested; a clock gone back
    # refills nothing.
    assert _rules.bucket(rated, 10_000.0) == 20
    assert _rules.bucket(rated, 50.0) == 0.25
    both = _rules.quota(limits(max_running=4, running=1, per_minute=60.0, burst=9,
                               tokens=2.0, refilled_at=0.0), 0.0)  # fmt: skip
    assert (both.slots, both.tokens, both.room) == (3, 2, 2)


def test_a_takeover_takes_a_token_and_no_slot() -> None:
    quota = _rules.Quota(slots=0, tokens=1)
    assert not quota.allows(takeover=False)
    assert quota.allows(takeover=True)
    quota.take(takeover=True)
    assert (quota.slots, quota.tokens, quota.taken) == (0, 0, 1)
    assert not quota.allows(takeover=True)


def test_a_spent_bucket_and_when_its_next_token_comes() -> None:
    rated = limits(per_minute=60.0, burst=3, tokens=3.0, refilled_at=10.0)
    assert _rules.spend(rated, 10.0, 3) == (0.0, 10.0)
    empty = rated._replace(tokens=0.0)
    assert _rules.token_due(empty, 10.0) == pytest.approx(11.0)  # one a second
    assert _rules.token_due(empty, 10.5) == pytest.approx(11.0)
    assert _rules.token_due(rated, 10.0) is None  # a token is there now
    # Float refills a hair short of a token count as one: a claimer woken when
    # token_due said finds the token there.
    assert _rules.quota(empty, 11.0 - 1e-12).tokens == 1
    assert _rules.spend(limits(max_running=3), 10.0, 2) is None  # no rate: nothing to write


def test_a_clock_behind_the_last_refill_counts_the_token_from_that_refill() -> None:
    # An NTP step back, or a process whose clock is behind the one that spent the bucket:
    # the next token is a refill's time after the last refill, said at once (walking up
    # to it a float at a time took seconds a second of the step, on the event loop).
    epoch = 1_780_000_000.0
    empty = limits(per_minute=600.0, burst=1, tokens=0.0, refilled_at=epoch)
    for behind in (5.0, 3600.0, 86_400.0 * 365):
        due = _rules.token_due(empty, epoch - behind)
        assert due == pytest.approx(epoch + 0.1)
        assert _rules.quota(empty, due).tokens == 1  # woken then, it finds the token
        assert due is not None and _rules.quota(empty, math.nextafter(due, 0)).tokens == 0


def test_limits_merge_keeps_what_is_not_named_and_starts_a_bucket_full() -> None:
    first = _rules.merged_limits(None, "p", {"max_running": 8}, 5.0)
    assert first == limits(max_running=8)
    rated = _rules.merged_limits(first, "p", {"per_minute": 600.0, "burst": 20}, 5.0)
    assert rated == limits(max_running=8, per_minute=600.0, burst=20, tokens=20.0,
                           refilled_at=5.0)  # fmt: skip
    # A smaller burst keeps what the bucket holds, up to its new size.
    drained = rated._replace(tokens=3.0)
    assert _rules.merged_limits(drained, "p", {"burst": 2}, 5.0).tokens == 2.0  # type: ignore[union-attr]
    assert _rules.merged_limits(drained, "p", {"burst": 10}, 5.0).tokens == 3.0  # type: ignore[union-attr]
    # Clearing every limit leaves none (the row goes).
    assert _rules.merged_limits(rated, "p", {"max_running": None, "per_minute": None,
                                             "burst": None}, 5.0) is None  # fmt: skip


def test_a_limited_project_is_due_when_a_slot_and_a_token_are_both_there() -> None:
    full = limits(max_running=2, running=2)
    assert _rules.limited_due(full, 10.0, ready=True, due_at=5.0, takeover_at=None) is None
    assert _rules.limited_due(full, 10.0, ready=True, due_at=None, takeover_at=30.0) == 30.0
    roomy = limits(max_running=3, running=2, per_minute=60.0, burst=1, tokens=0.0,
                   refilled_at=10.0)  # fmt: skip
    assert _rules.limited_due(roomy, 10.0, ready=True, due_at=None, takeover_at=None) == 11.0
    assert _rules.limited_due(roomy, 10.0, ready=False, due_at=20.0, takeover_at=None) == 20.0
    assert _rules.limited_due(roomy, 10.0, ready=False, due_at=None, takeover_at=None) is None


def test_the_merge_gives_a_limited_project_no_more_than_its_room_and_stops_reading_it() -> None:
    alpha = [candidate(n, project_id="alpha") for n in range(1, 40)]
    beta = [candidate(n, project_id="beta") for n in range(100, 110)]
    quotas = {"alpha": _rules.Quota(slots=3, tokens=None)}
    merge = ClaimMerge(2, 8, first_page=3, quotas=quotas, arm_projects=["alpha", "beta"])
    merge.feed(0, alpha[:3])
    merge.feed(1, beta[:3])
    reads = []
    while (arm := merge.hungry()) is not None:
        size, offset = merge.next_page(arm)
        reads.append(arm)
        merge.feed(arm, (alpha, beta)[arm][offset : offset + size])
    chosen = [c.item_id for c in merge.chosen]
    assert chosen == [1, 2, 3, 100, 101, 102, 103, 104]
    assert 0 not in reads  # alpha gave its room on its first page: never read again
    assert quotas["alpha"].taken == 3


def test_a_lapsed_claim_of_a_full_project_is_still_taken_over() -> None:
    lapsed = [candidate(5, project_id="alpha", state="claimed", fence=1)]
    ready = [candidate(1, project_id="alpha")]
    quotas = {"alpha": _rules.Quota(slots=0, tokens=None)}
    merge = ClaimMerge(2, 4, quotas=quotas, arm_projects=["alpha", None])
    merge.feed(0, ready)
    merge.feed(1, lapsed)
    assert merge.hungry() is None
    assert [c.item_id for c in merge.chosen] == [5]


def test_the_backfill_writes_only_what_gets_a_fingerprint_and_marks_where_it_stopped() -> None:
    identity = ("task",)
    rows = [(3, '{"task": "a"}'), (5, '{"other": 1}'), (8, "not json")]
    writes, mark, seen = _fingerprint.backfill(rows, 0, 10, identity)
    assert writes == [(_fingerprint.from_payload({"task": "a"}, identity), 3)]
    assert (mark, seen) == (8, 3)
    # A look that reached the end (fewer rows than a chunk) moves to the table's end ...
    assert _fingerprint.backfill(rows, 0, 10, identity, 40)[1] == 40
    assert _fingerprint.backfill([], 12, 10, identity, 40)[1] == 40
    # ... not after a full chunk, which more may follow, nor back before the mark.
    assert _fingerprint.backfill(rows, 0, 3, identity, 40)[1] == 8
    assert _fingerprint.backfill([], 12, 10, identity, 7)[1] == 12
    assert _fingerprint.backfill([], 12, 10, identity)[1] == 12


@pytest.mark.parametrize(
    "bound",
    [0.0, 5e-324, 1e-300, 1.0, -5.5, 1e4, 86400.0000004, 1_700_000_000.1234567,
     253402300799.99997, -62135596800.0],
)  # fmt: skip
@pytest.mark.parametrize("later", [True, False])
def test_a_datetime_bound_reaches_the_edge_of_its_microsecond(bound: float, later: bool) -> None:
    # The last float shown as the bound's microsecond (an "after"), or the first (a
    # "before"): bisected, so a bound at the epoch is as quick as one today.
    edge = _rules.beyond_its_microsecond(bound, datetime.datetime.now(), later=later)
    assert edge is not None
    shown = _models.from_timestamp(bound)
    assert _models.from_timestamp(edge) == shown
    beyond = math.nextafter(edge, math.inf if later else -math.inf)
    try:
        assert _models.from_timestamp(beyond) != shown
    except StorageError:
        assert abs(bound) > 6e10  # past the first or the last datetime
    assert (edge >= bound) if later else (edge <= bound)
    assert _rules.beyond_its_microsecond(bound, bound, later=later) == bound  # epoch seconds
