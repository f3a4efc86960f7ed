"""Lane-queue semantics: ordering, batch claims, dedup in four layers, settle outcomes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import random
import sqlite3
from types import MappingProxyType
from typing import Any

import pytest

from _signals import until
from asyncplane import (
    ClaimedItem,
    ControlStore,
    Done,
    FenceRejected,
    InvalidInput,
    InvalidPayload,
    InvalidType,
    Job,
    Outcome,
    ScopeDenied,
    _backend,
    copy_store,
    drain,
    fingerprint,
    verify_ledger,
)
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock

IDENTITY = ("intent", "task", "system", "reasoning")


@pytest.fixture
async def lanes(asyncplane_store_factory: Any) -> ControlStore:
    store: ControlStore = await asyncplane_store_factory(
        "lanes.db", identity=IDENTITY, lease_seconds=60, rng=random.Random(1)
    )
    await store.create_project("alpha", "Alpha")
    await store.create_project("beta", "Beta")
    return store


def task(text: str, **extra: Any) -> dict[str, Any]:
    return {"intent": "answer", "task": text, "system": "s", "reasoning": "low", **extra}


async def types(store: ControlStore, item_id: int) -> list[str]:
    return [e["event_type"] for e in await store.events(item_id)]


# --- ordering and batch claims ---------------------------------------------------------


async def test_claim_order_priority_class_sla_then_age(
    lanes: ControlStore, clock: ManualClock
) -> None:
    t0 = clock.now()
    order = {}
    order["low"] = await lanes.enqueue("alpha", {"n": 1}, priority=-1)
    order["plain-old"] = await lanes.enqueue("alpha", {"n": 2})
    order["plain-new"] = await lanes.enqueue("alpha", {"n": 3})
    order["sla-late"] = await lanes.enqueue("alpha", {"n": 4}, sla=t0 + 500)
    order["sla-soon"] = await lanes.enqueue(
        "alpha", {"n": 5}, sla=dt.datetime.fromtimestamp(t0 + 100, dt.timezone.utc)
    )
    order["realtime"] = await lanes.enqueue("alpha", {"n": 6}, service_class="realtime")
    order["urgent"] = await lanes.enqueue("alpha", {"n": 7}, priority=5)
    claims = await lanes.claim_batch("w", 10)
    expected = ["urgent", "realtime", "sla-soon", "sla-late", "plain-old", "plain-new", "low"]
    assert [c.item_id for c in claims] == [order[name] for name in expected]
    assert len({c.fence for c in claims}) == 1 and claims[0].fence == 1  # each its own claim
    assert claims[0].priority == 5 and claims[1].service_class == "realtime"
    assert claims[2].sla == dt.datetime.fromtimestamp(t0 + 100, dt.timezone.utc)
    assert await verify_ledger(lanes) == []


async def test_claim_batch_respects_limit_project_and_scope(lanes: ControlStore) -> None:
    a = [await lanes.enqueue("alpha", {"n": n}) for n in range(3)]
    b = [await lanes.enqueue("beta", {"n": n}) for n in range(3)]
    first = await lanes.claim_batch("w", 2, project_id="beta")
    assert [c.item_id for c in first] == b[:2]
    await lanes.assign("alpha", "agent")
    mine = await lanes.claim_batch("agent", 10, actor_id="agent")
    assert [c.item_id for c in mine] == a
    with pytest.raises(InvalidInput):
        await lanes.claim_batch("w", 0)
    rest = await lanes.claim_batch("w", 10)
    assert [c.item_id for c in rest] == b[2:]


async def test_not_before_defers_until_due(lanes: ControlStore, clock: ManualClock) -> None:
    later = await lanes.enqueue("alpha", {"n": 1}, not_before=clock.now() + 30)
    assert (await lanes.item(later))["state"] == "deferred"
    assert await types(lanes, later) == ["queued", "deferred"]
    assert await lanes.claim("w") is None
    assert await lanes.next_due() == clock.datetime() + dt.timedelta(seconds=30)
    clock.advance(30)
    claim = await lanes.claim("w")
    assert claim is not None and claim.item_id == later
    past = await lanes.enqueue("alpha", {"n": 2}, not_before=clock.now() - 5)
    assert (await lanes.item(past))["state"] == "ready"
    assert await verify_ledger(lanes) == []


# --- enqueue and enqueue_many ------------------------------------------------------------


def test_fingerprint_is_length_prefixed_sha256() -> None:
    assert len(fingerprint("a")) == 64
    assert fingerprint("a|b", "c") != fingerprint("a", "b|c")
    assert fingerprint("ab", "") != fingerprint("a", "b")
    assert fingerprint(None) != fingerprint("")
    assert fingerprint("x", "y") == fingerprint("x", "y")
    with pytest.raises(TypeError):
        fingerprint(1)  # type: ignore[arg-type]


async def test_enqueue_many_keeps_input_order_and_shares_twin_ids(lanes: ControlStore) -> None:
    ids = await lanes.enqueue_many(
        "alpha",
        [
            task("one"),
            Job(task("two"), priority=3),
            task("one", model="other-model"),  # the model is not part of the identity
            Job({"free": "form"}),
        ],
    )
    assert ids[0] == ids[2] != ids[1]
    assert len(set(ids)) == 3
    assert (await lanes.item(ids[1]))["priority"] == 3
    assert await lanes.enqueue_many("alpha", []) == []
    assert await verify_ledger(lanes) == []


async def test_enqueue_many_refuses_every_job_if_one_is_bad(
    lanes: ControlStore, clock: ManualClock
) -> None:
    before = await lanes.counts()
    with pytest.raises(InvalidPayload, match=r"jobs\[2\]"):
        await lanes.enqueue_many("alpha", [task("a"), task("b"), {"x": float("nan")}])
    with pytest.raises(InvalidType, match=r"jobs\[1\]"):
        await lanes.enqueue_many("alpha", [task("a"), ["not", "a", "dict"]])  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="aware datetime"):
        await lanes.enqueue_many("alpha", [Job({}, sla=dt.datetime(2030, 1, 1))])
    with pytest.raises(InvalidInput, match="service class"):
        await lanes.enqueue("alpha", {}, service_class="urgent")
    with pytest.raises(InvalidType, match="priority"):
        await lanes.enqueue("alpha", {}, priority=1.5)  # type: ignore[arg-type]
    assert await lanes.counts() == before


async def test_enqueue_many_is_one_transaction(lanes: ControlStore) -> None:
    backend: Any = await lanes._engine.ready()
    rounds = backend.writer.rounds
    ids = await lanes.enqueue_many("alpha", [{"n": n} for n in range(500)])
    assert backend.writer.rounds == rounds + 1
    assert ids == list(range(ids[0], ids[0] + 500))
    assert (await lanes.item(ids[-1]))["payload"] == {"n": 499}


@pytest.mark.parametrize("size", [9, 41, 45, 300])
async def test_a_bulk_enqueue_of_any_size_keeps_its_order_and_its_twin_lines(
    lanes: ControlStore, size: int
) -> None:
    # Rows go several to a statement (256, 32, then 8, then one at a time on SQLite): each
    # keeps its place, its id and its event, and each content's twins line up as the
    # rows arrive, whatever statement carried them. Every third row is a twin of one of
    # five contents, the later ones of higher priority (first in line when they come).
    jobs = [
        Job({"n": n}, priority=n, fingerprint=f"c{n % 5}") if n % 3 == 0 else Job({"n": n})
        for n in range(size)
    ]
    ids = await lanes.enqueue_many("alpha", jobs, dedup=False)
    assert ids == list(range(ids[0], ids[0] + size))
    for item_id, job in zip(ids, jobs, strict=True):
        item = await lanes.item(item_id)
        assert (item["payload"], item["fingerprint"]) == (job.payload, job.fingerprint)
    firsts: dict[str, int] = {}
    for item_id, job in zip(ids, jobs, strict=True):
        if job.fingerprint is not None:
            firsts[job.fingerprint] = item_id  # the last one has the highest priority
    claimed = []
    while (claim := await lanes.claim("w", project_id="alpha")) is not None:
        claimed.append(claim.item_id)
    twins = [i for i, job in zip(ids, jobs, strict=True) if job.fingerprint is not None]
    assert sorted(set(claimed) & set(twins)) == sorted(firsts.values())
    assert len(claimed) == size - len(twins) + len(firsts)
    assert await verify_ledger(lanes) == []


async def test_actor_scope_applies_to_enqueue_many(lanes: ControlStore) -> None:
    with pytest.raises(ScopeDenied):
        await lanes.enqueue_many("alpha", [{}], actor_id="stranger")


# --- dedup, layer 1: enqueue -------------------------------------------------------------


async def test_enqueue_reuses_a_twin_preferring_a_done_one(lanes: ControlStore) -> None:
    first = await lanes.enqueue("alpha", task("q"))
    assert await lanes.enqueue("alpha", task("q")) == first  # in flight: reused
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.finish(first, fence=claim.fence, result={"answer": 42})
    independent = await lanes.enqueue("alpha", task("q"), dedup=False)
    assert independent != first
    assert (await lanes.item(independent))["fingerprint"] == (await lanes.item(first))[
        "fingerprint"
    ]
    assert await lanes.enqueue("alpha", task("q")) == first  # the done one, not the newer
    assert await lanes.enqueue("beta", task("q")) not in (first, independent)  # per project


async def test_failed_items_are_never_reused(lanes: ControlStore) -> None:
    first = await lanes.enqueue("alpha", task("q"))
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.finish(first, fence=claim.fence, status="failed", error="model refused")
    again = await lanes.enqueue("alpha", task("q"))
    assert again != first
    assert (await lanes.item(first))["error"] == "model refused"


async def test_null_fingerprints_are_never_equal(asyncplane_store_factory: Any) -> None:
    plain: ControlStore = await asyncplane_store_factory("plain.db")  # no identity
    await plain.create_project("p", "P")
    a = await plain.enqueue("p", {"same": True})
    b = await plain.enqueue("p", {"same": True})
    assert a != b
    assert (await plain.item(a))["fingerprint"] is None
    both = await plain.claim_batch("w", 5)  # no fingerprint: no twin rule either
    assert [c.item_id for c in both] == [a, b]


async def test_explicit_fingerprint_wins_over_identity(lanes: ControlStore) -> None:
    a = await lanes.enqueue("alpha", task("one"), fingerprint="custom")
    b = await lanes.enqueue("alpha", task("two"), fingerprint="custom")
    assert a == b
    assert (await lanes.item(a))["fingerprint"] == "custom"


# --- dedup, layers 2 to 4: preflight, lease, settlement ------------------------------------


async def test_preflight_backfills_fingerprints_and_settles_pending_twins(
    asyncplane_store_factory: Any,
) -> None:
    # An older enqueuer wrote items without fingerprints ...
    old: ControlStore = await asyncplane_store_factory("shared.db")
    await old.create_project("p", "P")
    done_id = await old.enqueue("p", task("q"))
    pending = [await old.enqueue("p", task("q")) for _ in range(4)]
    other = await old.enqueue("p", task("different"))
    claim = await old.claim("w")
    assert claim is not None and claim.item_id == done_id
    await old.finish(done_id, fence=claim.fence, result={"answer": 1})
    assert (await old.item(pending[0]))["state"] == "ready"  # no fingerprint: no settlement
    # ... and a store that knows the identity runs the preflight, two items at a time.
    new: ControlStore = await asyncplane_store_factory("shared.db", identity=IDENTITY)
    backend: Any = await new._engine.ready()
    rounds = backend.writer.rounds
    assert await new.dedup_pending_against_done(chunk=2) == 4
    assert backend.writer.rounds - rounds >= 3 + 2  # bounded: several short transactions
    for item_id in pending:
        row = await new.item(item_id)
        assert (row["state"], row["result"]) == ("done", {"answer": 1})
        events = await new.events(item_id)
        assert events[-1]["event_type"] == "done"
        assert events[-1]["detail"] == {"deduplicated_from": done_id}
        assert all(e["event_type"] != "claimed" for e in events)  # settled without running
    assert (await new.item(other))["state"] == "ready"
    assert (await new.item(other))["fingerprint"] is not None
    assert await new.dedup_pending_against_done() == 0
    assert await verify_ledger(new) == []


async def test_notes_of_pairs_that_cannot_settle_do_not_use_a_step_up(
    store: ControlStore, tmp_path: Any
) -> None:
    # On PostgreSQL a step read `chunk` notes and settled what they held: notes of pairs
    # whose pending twin runs now (nothing to settle) used it up, a pair noted after them
    # was left, and the same round's claim ran its pending item again. A step settles up
    # to `chunk` pairs among every note, as on SQLite.

    async def pair(fingerprint: str) -> int:
        """A failed, B done, A requeued: a pending item beside a done twin."""
        first = await store.enqueue("alpha", {"fp": fingerprint, "n": "A"}, fingerprint=fingerprint)
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == first
        await store.finish(first, fence=claim.fence, status="failed", error="x")
        second = await store.enqueue(
            "alpha", {"fp": fingerprint, "n": "B"}, fingerprint=fingerprint
        )
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == second
        await store.finish(second, fence=claim.fence, result=f"answer {fingerprint}")
        await store.requeue(first)
        return first

    for n in range(3):  # their pending twins run now
        pending = await pair(f"f{n}")
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == pending
    free = await pair("h")
    ran: list[int] = []

    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        ran.extend(claim.item_id for claim in batch)
        return [Done("computed again") for _ in batch]

    summary = await drain(
        store, execute, lock_path=tmp_path / "drain.lock", max_iters=1, preflight_chunk=1
    )
    assert summary.deduplicated == 1 and ran == []
    assert (await store.item(free))["result"] == "answer h"
    assert await verify_ledger(store) == []


async def test_a_twin_the_preflight_settles_wakes_its_waiter_at_once(
    lanes: ControlStore,
) -> None:
    # On SQLite the preflight's settles woke no wait() of the process: it saw them at
    # its next look, poll_interval away, as a settle elsewhere.
    pending = await lanes.enqueue("alpha", task("q"))
    await lanes.cancel(pending)
    await lanes.enqueue("alpha", task("q"))
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.finish(claim.item_id, fence=claim.fence, result={"answer": 1})
    await lanes.requeue(pending)  # a pending twin of a done one, for the preflight
    waiting = asyncio.ensure_future(lanes.wait(pending, poll_interval=3600))
    await until(lambda: _waits_on(lanes), what="the wait")
    assert await lanes.dedup_pending_against_done() == 1
    settled = await asyncio.wait_for(waiting, 30)  # not an hour: at once
    assert (settled["state"], settled["result"]) == ("done", {"answer": 1})


def _waits_on(store: ControlStore) -> bool:
    """Whether a wait() of ``store`` has looked once and sleeps."""
    return any(t.get_name().startswith("asyncplane-settles") for t in asyncio.all_tasks())


async def test_a_preflight_step_with_no_twin_to_settle_writes_nothing(
    asyncplane_store_factory: Any,
) -> None:
    # work() takes a preflight step every second and drain() one a round, busy or idle.
    # With no twin to settle (the usual case) the step only reads: no write round, so no
    # write lock held over a look through the pending items.
    store: ControlStore = await asyncplane_store_factory("twins.db")
    await store.create_project("p", "P")
    await store.enqueue_many("p", [task(f"q{n}") for n in range(5)])
    writer = (await engine_of(store).ready()).writer
    rounds = writer.rounds
    assert await store.dedup_pending_against_done() == 0
    assert writer.rounds == rounds


async def test_the_preflight_look_answers_for_the_rows_its_write_would_settle(
    asyncplane_store_factory: Any,
) -> None:
    # A pending twin of a done item in project q: the look sees it in q's scope and in the
    # whole store's, not in p's nor in the scope of an actor assigned only to p.
    old: ControlStore = await asyncplane_store_factory("scoped.db")
    for project in ("p", "q"):
        await old.create_project(project, project.upper())
    await old.enqueue("p", task("other"))
    first = await old.enqueue("q", task("same"))
    twin = await old.enqueue("q", task("same"))
    claim = await old.claim("w", project_id="q")
    assert claim is not None and claim.item_id == first
    await old.finish(first, fence=claim.fence, result="answer")
    new: ControlStore = await asyncplane_store_factory("scoped.db", identity=IDENTITY)
    await new.assign("p", "alice")
    backend: Any = await engine_of(new).ready()
    look = await backend.missing_fingerprints(_backend.PreflightOp(500, None, None), 0, IDENTITY)
    await backend.set_fingerprints(look.writes)
    scopes = {"alice": (None, "alice"), "p": ("p", None), "q": ("q", None), "all": (None, None)}
    for name, (project_id, actor_id) in scopes.items():
        op = _backend.PreflightOp(500, project_id, actor_id)
        found = await backend.any_twin_noted(op)
        assert found == (name in ("q", "all")), name
        if not found:
            assert await backend.settle_pending_twins(op) == (0, False), name
    assert await backend.settle_pending_twins(_backend.PreflightOp(500, "q", None)) == (1, False)
    assert (await new.item(twin))["result"] == "answer"
    assert await verify_ledger(new) == []


async def settled_by_the_next_step(
    store: ControlStore, item_id: int, done_id: int, result: Any
) -> None:
    """A preflight step settles ``item_id`` with its done twin's result, then forgets the
    pair: the next look finds nothing noted, and the next step writes nothing."""
    engine = engine_of(store)
    backend: Any = await engine.ready()
    op = _backend.PreflightOp(500, None, None)
    assert await backend.any_twin_noted(op)
    assert (await engine.preflight_step(500))[0] == 1
    row = await store.item(item_id)
    assert (row["state"], row["result"]) == ("done", result)
    assert (await store.events(item_id))[-1]["detail"] == {"deduplicated_from": done_id}
    assert not await backend.any_twin_noted(op)
    rounds = backend.writer.rounds
    assert (await engine.preflight_step(500))[0] == 0
    assert backend.writer.rounds == rounds
    assert await verify_ledger(store) == []


async def failed_then_a_twin(
    store: ControlStore, project_id: str, text: str = "q", **twin: Any
) -> tuple[int, int]:
    """An item failed, then a twin of it enqueued (``twin``: its settings), which a failed
    item does not answer. Returns (the failed item, its twin)."""
    first = await store.enqueue(project_id, task(text))
    claim = await store.claim("w", project_id=project_id)
    assert claim is not None and claim.item_id == first
    await store.finish(first, fence=claim.fence, status="failed", error="boom")
    assert (await store.item(first))["state"] == "failed"
    return first, await store.enqueue(project_id, task(text), **twin)


async def requeued_beside_a_done_twin(
    store: ControlStore, project_id: str, text: str = "q"
) -> tuple[int, int]:
    """A twin pair, formed by a requeue: an item failed, its twin done with the result
    ``{"answer": 2}``, then the first requeued. Returns (the pending item, the done one)."""
    first, second = await failed_then_a_twin(store, project_id, text)
    claim = await store.claim("w", project_id=project_id)
    assert claim is not None and claim.item_id == second
    await store.finish(second, fence=claim.fence, result={"answer": 2})
    await store.requeue(first)
    return first, second


async def test_a_requeued_item_whose_twin_is_done_is_settled_by_the_next_step(
    lanes: ControlStore,
) -> None:
    # A step looks only at the twin pairs noted as they formed; a requeue forms one.
    first, second = await requeued_beside_a_done_twin(lanes, "alpha")
    await settled_by_the_next_step(lanes, first, second, {"answer": 2})


async def test_an_imported_item_whose_twin_is_done_is_settled_by_the_next_step(
    lanes: ControlStore, tmp_path: Any
) -> None:
    # An import adds rows without looking for twins (unlike enqueue): a pair can form.
    done = await lanes.enqueue("alpha", task("q"))
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.finish(done, fence=claim.fence, result={"answer": 1})
    source = sqlite3.connect(tmp_path / "source.db")
    source.execute("CREATE TABLE jobs (body TEXT NOT NULL)")
    source.execute("INSERT INTO jobs VALUES (?)", (json.dumps(task("q")),))
    source.commit()
    source.close()
    summary = await lanes.import_pending(
        tmp_path / "source.db", table="jobs", columns={"payload": "body"}, project_id="alpha"
    )
    assert summary.imported == 1
    (imported,) = await lanes.items(project_id="alpha", state="ready")
    await settled_by_the_next_step(lanes, imported["item_id"], done, {"answer": 1})


async def test_a_pair_copied_in_is_noted_in_the_destination(
    asyncplane_store_factory: Any, tmp_path: Any
) -> None:
    # A copy brings rows as they stand, the pending item before its done twin (a lower
    # id): the done row's arrival forms the pair in the destination, which notes it.
    async with ControlStore(tmp_path / "source.db", identity=IDENTITY) as source:
        await source.create_project("p", "P")
        first, second = await requeued_beside_a_done_twin(source, "p")
        destination: ControlStore = await asyncplane_store_factory("copy.db", identity=IDENTITY)
        await copy_store(source, destination, chunk=1)
    await settled_by_the_next_step(destination, first, second, {"answer": 2})


async def test_a_done_item_given_its_fingerprint_after_its_twin_is_noted(
    asyncplane_store_factory: Any,
) -> None:
    # Written without fingerprints: the pending item first, the done one after it. The
    # backfill, one item a step, gives the pending one its fingerprint first (no done
    # twin has one yet), then the done one: that write is the one that forms the pair.
    old: ControlStore = await asyncplane_store_factory("backfill.db")
    await old.create_project("p", "P")
    pending = await old.enqueue("p", task("q"))
    done = await old.enqueue("p", task("q"), priority=1)
    claim = await old.claim("w")
    assert claim is not None and claim.item_id == done
    await old.finish(done, fence=claim.fence, result={"answer": 3})
    new: ControlStore = await asyncplane_store_factory("backfill.db", identity=IDENTITY)
    engine = engine_of(new)
    assert await engine.preflight_step(1) == (0, True)
    assert (await new.item(pending))["fingerprint"] is not None
    assert (await new.item(done))["fingerprint"] is None
    backend: Any = await engine.ready()
    assert not await backend.any_twin_noted(_backend.PreflightOp(1, None, None))
    assert await engine.preflight_step(1) == (1, True)
    row = await new.item(pending)
    assert (row["state"], row["result"]) == ("done", {"answer": 3})
    assert await verify_ledger(new) == []


async def test_a_pair_no_note_names_is_settled_by_a_full_pass(
    asyncplane_store_factory: Any, raw_of: Any
) -> None:
    # A step trusts the notes; a full pass walks the store for pairs however they formed
    # (here: a note lost behind the store's back).
    store: ControlStore = await asyncplane_store_factory("lost.db", identity=IDENTITY)
    await store.create_project("p", "P")
    first, _ = await requeued_beside_a_done_twin(store, "p")
    raw_of(store).execute("DELETE FROM twin_checks")
    assert (await engine_of(store).preflight_step(500))[0] == 0
    assert (await store.item(first))["state"] == "ready"
    assert await store.dedup_pending_against_done() == 1
    assert (await store.item(first))["result"] == {"answer": 2}
    assert await verify_ledger(store) == []


async def test_a_store_of_the_schema_before_notes_its_twin_pairs_as_it_migrates(
    asyncplane_store_factory: Any, raw_of: Any
) -> None:
    # A store as the release before the notes left it, with a twin pair in it: the
    # migration notes the pair, so the first step settles it.
    store: ControlStore = await asyncplane_store_factory("before.db", identity=IDENTITY)
    await store.create_project("p", "P")
    first, second = await requeued_beside_a_done_twin(store, "p")
    await store.close()
    raw = raw_of(store)
    if raw.backend == "sqlite":
        undo = ["DROP TRIGGER items_twin_pair_arrives", "DROP TRIGGER items_twin_pair_forms",
                "DROP INDEX items_dedup_twins", "DROP INDEX items_fingerprint",
                "CREATE INDEX items_fingerprint ON items (project_id, fingerprint)"
                " WHERE fingerprint IS NOT NULL",
                "PRAGMA user_version = 8"]  # fmt: skip
    else:
        undo = ["DROP TRIGGER items_twin_pair_arrives ON items",
                "DROP TRIGGER items_twin_pair_forms ON items",
                "DROP FUNCTION asyncplane_twin_pair()", "DROP INDEX items_unfingerprinted",
                "DROP INDEX items_live_twins", "DROP INDEX items_settled_twins",
                "DROP INDEX items_dedup_twins",
                "DROP FUNCTION asyncplane_twin_may_start(text, text, bigint)",
                "DROP FUNCTION asyncplane_settle_twins(text, text, bigint, text, float8, text,"
                " text, text, text)",
                "DROP TRIGGER items_deferred_twin_arrives ON items",
                "DROP TRIGGER items_deferred_twin_moves ON items",
                "DROP FUNCTION asyncplane_twin_deferred()",
                "DROP FUNCTION asyncplane_twins_waited(text[], text[])",
                "CREATE INDEX items_fingerprint ON items (project_id, fingerprint)"
                " WHERE fingerprint IS NOT NULL",
                "UPDATE asyncplane_meta SET value = '6' WHERE key = 'schema_version'"]  # fmt: skip
    for statement in ["DROP TABLE twin_checks", *undo]:
        raw.execute(statement)
    reopened: ControlStore = await asyncplane_store_factory("before.db", identity=IDENTITY)
    await settled_by_the_next_step(reopened, first, second, {"answer": 2})


async def test_a_full_pass_goes_on_past_notes_whose_pair_went_otherwise(
    lanes: ControlStore,
) -> None:
    # Two pairs whose pending item was claimed before any step looked (their notes now
    # name no pair), then a pair to settle: a full pass two items at a time must not end
    # on the first step, which settles nothing.
    for text in ("gone-1", "gone-2"):
        first, _ = await requeued_beside_a_done_twin(lanes, "alpha", text)
        claim = await lanes.claim("w", project_id="alpha")
        assert claim is not None and claim.item_id == first
    first, _ = await requeued_beside_a_done_twin(lanes, "alpha", "kept")
    assert await lanes.dedup_pending_against_done(chunk=2) == 1
    assert (await lanes.item(first))["result"] == {"answer": 2}
    backend: Any = await engine_of(lanes).ready()
    assert not await backend.any_twin_noted(_backend.PreflightOp(2, None, None))


@pytest.mark.postgresql_only
async def test_a_twin_locked_elsewhere_keeps_its_note_for_the_next_step(
    asyncplane_store_factory: Any,
) -> None:
    # Writers run side by side on PostgreSQL: a step skips a pending twin another
    # transaction holds, and forgets only the notes with no pair left.
    import asyncpg

    store: ControlStore = await asyncplane_store_factory("locked.db", identity=IDENTITY)
    await store.create_project("p", "P")
    first, second = await requeued_beside_a_done_twin(store, "p")
    engine = engine_of(store)
    backend: Any = await engine.ready()
    op = _backend.PreflightOp(500, None, None)
    conn = await asyncpg.connect(store.location)
    try:
        async with conn.transaction():
            await conn.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", first)
            assert (await engine.preflight_step(500))[0] == 0
            assert await backend.any_twin_noted(op)
    finally:
        await conn.close()
    await settled_by_the_next_step(store, first, second, {"answer": 2})


async def test_an_item_running_as_the_backfill_passed_is_left_to_a_full_pass(
    asyncplane_store_factory: Any,
) -> None:
    # The backfill never writes under a running claim, and its mark does not wait behind
    # one (it may run for hours, and the items after it would be walked every step): a
    # full pass fingerprints the item once it is back. Items whose payloads have none of
    # the identity's fields, after it, never hold a pass up either.
    old: ControlStore = await asyncplane_store_factory("running.db")
    await old.create_project("p", "P")
    running = await old.enqueue("p", task("a"), priority=1)
    after = await old.enqueue("p", task("b"))
    await old.enqueue_many("p", [{"n": n} for n in range(4)])
    claim = await old.claim("w")
    assert claim is not None and claim.item_id == running
    new: ControlStore = await asyncplane_store_factory("running.db", identity=IDENTITY)
    engine = engine_of(new)
    assert await engine.preflight_step(500) == (0, False)
    assert (await new.item(after))["fingerprint"] is not None
    await old.release(running, fence=claim.fence)
    assert await engine.preflight_step(500) == (0, False)
    assert (await new.item(running))["fingerprint"] is None
    later = await old.enqueue("p", task("c"))  # written since, without one too
    assert await engine.preflight_step(500) == (0, False)
    assert (await new.item(later))["fingerprint"] is not None
    claim = await old.claim("w")
    assert claim is not None
    assert await new.dedup_pending_against_done(chunk=2) == 0  # ends, the item running
    await old.release(claim.item_id, fence=claim.fence)
    assert await new.dedup_pending_against_done(chunk=2) == 0
    assert (await new.item(running))["fingerprint"] is not None


async def test_a_backfill_step_that_fingerprints_nothing_writes_nothing(
    asyncplane_store_factory: Any,
) -> None:
    # Items whose payloads have none of the identity's fields get no fingerprint: the
    # backfill looks at them once (its mark moves past them) and takes no write lock.
    store: ControlStore = await asyncplane_store_factory("plain.db", identity=IDENTITY)
    await store.create_project("p", "P")
    await store.enqueue_many("p", [{"n": n} for n in range(5)])
    engine = engine_of(store)
    writer = (await engine.ready()).writer
    rounds = writer.rounds
    assert await engine.preflight_step(3) == (0, True)
    assert await engine.preflight_step(3) == (0, False)
    assert await engine.preflight_step(3) == (0, False)
    assert writer.rounds == rounds


async def test_a_batch_takes_one_item_per_fingerprint_and_twins_wait(lanes: ControlStore) -> None:
    a = await lanes.enqueue("alpha", task("q"), dedup=False)
    b = await lanes.enqueue("alpha", task("q"), dedup=False)
    c = await lanes.enqueue("alpha", task("other"))
    batch = await lanes.claim_batch("w", 10)
    assert [x.item_id for x in batch] == [a, c]
    assert await lanes.claim("w2") is None  # b waits while its twin a is claimed
    await lanes.finish(a, fence=batch[0].fence, status="failed", error="boom")
    twin = await lanes.claim("w2")  # a failed: its twin may run now
    assert twin is not None and twin.item_id == b


async def test_finishing_done_settles_pending_twins_with_the_result(
    asyncplane_store_factory: Any, raw_of: Any
) -> None:
    # Twins that all stayed pending: written by an older enqueuer without fingerprints,
    # fingerprinted later by the preflight (nothing was done yet, so it settles nothing).
    old: ControlStore = await asyncplane_store_factory("shared.db")
    await old.create_project("p", "P")
    await old.create_project("q", "Q")
    twins = [await old.enqueue("p", task("same")) for _ in range(3)]
    elsewhere = await old.enqueue("q", task("same"))
    independent = await old.enqueue("p", task("same"))
    new: ControlStore = await asyncplane_store_factory("shared.db", identity=IDENTITY)
    assert await new.dedup_pending_against_done() == 0
    raw_of(new).execute("UPDATE items SET dedup = false WHERE item_id = ?", (independent,))
    batch = await new.claim_batch("w", 10, project_id="p")
    assert [c.item_id for c in batch] == [twins[0]]  # one per fingerprint; the rest wait
    await new.finish(twins[0], fence=batch[0].fence, result={"answer": "shared"})
    for item_id in twins[1:]:
        row = await new.item(item_id)
        assert (row["state"], row["result"]) == ("done", {"answer": "shared"})
        assert (await new.events(item_id))[-1]["detail"] == {"deduplicated_from": twins[0]}
    assert (await new.item(elsewhere))["state"] == "ready"  # a result never crosses projects
    assert (await new.item(independent))["state"] == "ready"  # dedup=False runs on its own
    assert await verify_ledger(new) == []


# --- settle outcomes -----------------------------------------------------------------------


async def test_finish_keeps_a_bounded_json_result(asyncplane_store_factory: Any) -> None:
    store: ControlStore = await asyncplane_store_factory(max_result_bytes=100)
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    claim = await store.claim("w")
    assert claim is not None
    with pytest.raises(InvalidPayload, match="more than the limit of 100"):
        await store.finish(item_id, fence=claim.fence, result="x" * 200)
    with pytest.raises(InvalidPayload):
        await store.finish(item_id, fence=claim.fence, result={"t": {1, 2}})
    assert (await store.item(item_id))["state"] == "claimed"  # the claim stays valid
    await store.finish(item_id, fence=claim.fence, result={"ok": [1, 2.5, None]})
    assert (await store.item(item_id))["result"] == {"ok": [1, 2.5, None]}


async def test_default_result_limit_is_64_kib(lanes: ControlStore) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    with pytest.raises(InvalidPayload):
        await lanes.finish(item_id, fence=claim.fence, result="x" * (64 * 1024))
    await lanes.finish(item_id, fence=claim.fence, result="x" * (64 * 1024 - 10))


async def test_failed_fails_fast_whatever_attempts_remain(lanes: ControlStore) -> None:
    item_id = await lanes.enqueue("alpha", {}, max_attempts=10)
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.finish(item_id, fence=claim.fence, status="failed", error="bad input")
    row = await lanes.item(item_id)
    assert (row["state"], row["error"], row["attempts"]) == ("failed", "bad input", 1)
    events = await lanes.events(item_id)
    assert events[-1]["detail"] == {"error": "bad input"}


async def test_retry_backs_off_with_jitter_then_fails_when_attempts_run_out(
    lanes: ControlStore, clock: ManualClock
) -> None:
    item_id = await lanes.enqueue("alpha", {}, max_attempts=3)
    seen = []
    for attempt in (1, 2):
        claim = await lanes.claim("w")
        assert claim is not None and claim.attempts == attempt
        state = await lanes.retry(item_id, fence=claim.fence, error=f"timeout {attempt}")
        assert state == "deferred"
        row = await lanes.item(item_id)
        assert row["state"] == "deferred" and row["error"] == f"timeout {attempt}"
        wait = (row["due_at"] - clock.datetime()).total_seconds()
        base = 1.0 * 2 ** (attempt - 1)
        assert 0.5 * base <= wait <= 1.5 * base  # exponential, jittered
        seen.append(wait)
        assert await lanes.claim("w") is None  # not before it falls due
        clock.advance(wait + 0.001)  # (the datetime above is rounded to microseconds)
    claim = await lanes.claim("w")
    assert claim is not None and claim.attempts == 3
    assert await lanes.retry(item_id, fence=claim.fence, error="timeout 3") == "failed"
    row = await lanes.item(item_id)
    assert row["state"] == "failed"
    assert row["error"] == "attempts exhausted (3 of 3): timeout 3"
    assert await types(lanes, item_id) == [
        "queued",
        "claimed",
        "retried",
        "claimed",
        "retried",
        "claimed",
        "failed",
    ]
    assert await verify_ledger(lanes) == []


async def test_retry_with_an_explicit_delay(lanes: ControlStore, clock: ManualClock) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.retry(item_id, fence=claim.fence, error="later", delay=120)
    assert (await lanes.item(item_id))["due_at"] == clock.datetime() + dt.timedelta(seconds=120)


async def test_park_defers_without_spending_an_attempt(
    lanes: ControlStore, clock: ManualClock
) -> None:
    item_id = await lanes.enqueue("alpha", {}, max_attempts=1)
    claim = await lanes.claim("w")
    assert claim is not None and claim.attempts == 1
    await lanes.park(item_id, fence=claim.fence, delay=10)
    row = await lanes.item(item_id)
    assert (row["state"], row["attempts"]) == ("deferred", 0)
    clock.advance(10)
    again = await lanes.claim("w")
    assert again is not None and again.attempts == 1  # still its first real attempt
    await lanes.finish(item_id, fence=again.fence)
    assert await types(lanes, item_id) == ["queued", "claimed", "parked", "claimed", "done"]
    assert await verify_ledger(lanes) == []


async def test_offloaded_items_are_never_claimed_or_reclaimed(
    lanes: ControlStore, clock: ManualClock
) -> None:
    a = await lanes.enqueue("alpha", {"n": 1})
    b = await lanes.enqueue("alpha", {"n": 2})
    claims = await lanes.claim_batch("w", 2)
    for claim in claims:
        await lanes.offload(claim.item_id, fence=claim.fence, handle="batch-7")
    clock.advance(10_000)  # far past any lease
    assert await lanes.claim("w2") is None
    listed = await lanes.offloaded("batch-7")
    assert [(x["item_id"], x["fence"], x["state"]) for x in listed] == [
        (a, 1, "offloaded"),
        (b, 1, "offloaded"),
    ]
    assert await lanes.offloaded("batch-8") == []
    with pytest.raises(FenceRejected):
        await lanes.renew(a, fence=1)  # nothing to renew: it is not claimed here
    await lanes.finish(a, fence=1, result="from the batch")
    assert await lanes.retry(b, fence=1, error="batch expired", delay=0) == "deferred"
    assert [x["item_id"] for x in await lanes.offloaded("batch-7")] == []
    assert (await lanes.item(a))["result"] == "from the batch"
    again = await lanes.claim("w2")
    assert again is not None and again.item_id == b and again.fence == 2
    assert await verify_ledger(lanes) == []


async def test_a_lapsed_lease_consumes_an_attempt(lanes: ControlStore, clock: ManualClock) -> None:
    item_id = await lanes.enqueue("alpha", {}, max_attempts=2)
    first = await lanes.claim("w1")
    assert first is not None
    clock.advance(61)
    second = await lanes.claim("w2")  # attempt 2 of 2: taken over
    assert second is not None and second.attempts == 2
    clock.advance(61)
    assert await lanes.claim("w3") is None  # no attempt left: failed instead
    row = await lanes.item(item_id)
    assert row["state"] == "failed" and "attempts exhausted" in row["error"]
    assert await types(lanes, item_id) == [
        "queued",
        "claimed",
        "lease_expired",
        "claimed",
        "lease_expired",
        "failed",
    ]
    with pytest.raises(FenceRejected):
        await lanes.finish(item_id, fence=second.fence)
    assert await verify_ledger(lanes) == []


async def test_a_lapsed_item_with_a_fingerprint_is_taken_over(
    lanes: ControlStore, clock: ManualClock
) -> None:
    item_id = await lanes.enqueue("alpha", task("q"))
    twin = await lanes.enqueue("alpha", task("q"), dedup=False)
    first = await lanes.claim("w1")
    assert first is not None and first.item_id == item_id
    clock.advance(61)
    taken = await lanes.claim("w2")  # the lapsed one itself, not blocked by its own claim
    assert taken is not None and taken.item_id == item_id and taken.fence == 2
    assert await lanes.claim("w3") is None  # its twin still waits
    await lanes.finish(item_id, fence=taken.fence)
    assert (await lanes.claim("w3")) is not None  # dedup=False twin runs after it settles
    assert twin


async def test_store_wide_attempt_budget(asyncplane_store_factory: Any) -> None:
    store: ControlStore = await asyncplane_store_factory(max_attempts=1)
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    assert (await store.item(item_id))["max_attempts"] == 1
    claim = await store.claim("w")
    assert claim is not None and claim.max_attempts == 1
    assert await store.retry(item_id, fence=claim.fence, error="x") == "failed"


@pytest.mark.parametrize("outcome", ["finish", "failed", "retry", "park", "offload"])
async def test_settling_an_item_in_any_other_state_is_fenced(
    lanes: ControlStore, outcome: str
) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.park(item_id, fence=claim.fence, delay=100)  # now deferred

    async def settle() -> object:
        if outcome == "finish":
            return await lanes.finish(item_id, fence=claim.fence)
        if outcome == "failed":
            return await lanes.finish(item_id, fence=claim.fence, status="failed")
        if outcome == "retry":
            return await lanes.retry(item_id, fence=claim.fence)
        if outcome == "park":
            return await lanes.park(item_id, fence=claim.fence, delay=1)
        return await lanes.offload(item_id, fence=claim.fence, handle="h")

    with pytest.raises(FenceRejected, match="deferred, not claimed"):
        await settle()
    assert (await lanes.item(item_id))["state"] == "deferred"
    assert await verify_ledger(lanes) == []


async def test_park_and_offload_need_a_claim_not_an_offload(lanes: ControlStore) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.offload(item_id, fence=claim.fence, handle="h")
    with pytest.raises(FenceRejected):
        await lanes.park(item_id, fence=claim.fence, delay=1)
    with pytest.raises(FenceRejected):
        await lanes.offload(item_id, fence=claim.fence, handle="h2")


# --- the ledger, for the new states ------------------------------------------------------


async def test_state_disagrees_for_a_tampered_deferred_item(
    lanes: ControlStore, raw_of: Any
) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    raw_of(lanes).execute(
        "UPDATE items SET state = 'deferred', due_at = 0 WHERE item_id = ?", (item_id,)
    )
    problems = await verify_ledger(lanes)
    assert [(p.kind, p.item_id) for p in problems] == [("state_disagrees", item_id)]
    assert problems[0].detail == "row is 'deferred' but its events lead to claimed"


async def test_state_disagrees_for_a_tampered_offloaded_item(
    lanes: ControlStore, raw_of: Any
) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.offload(item_id, fence=claim.fence, handle="h")
    raw_of(lanes).execute("UPDATE items SET state = 'claimed' WHERE item_id = ?", (item_id,))
    problems = await verify_ledger(lanes)
    assert [(p.kind, p.detail) for p in problems] == [
        ("state_disagrees", "row is 'claimed' but its events lead to offloaded")
    ]


async def test_an_offloaded_item_holds_back_its_twins(lanes: ControlStore) -> None:
    first = await lanes.enqueue("alpha", task("q"))
    twin = await lanes.enqueue("alpha", task("q"), dedup=False)
    claim = await lanes.claim("w")
    assert claim is not None and claim.item_id == first
    await lanes.offload(first, fence=claim.fence, handle="batch")
    assert await lanes.claim("w2") is None  # the twin must not also run here
    await lanes.finish(first, fence=claim.fence, result="batch result")
    after = await lanes.claim("w2")
    assert after is not None and after.item_id == twin


async def test_finish_refuses_mixed_outcome_arguments(lanes: ControlStore) -> None:
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    with pytest.raises(InvalidInput, match="error goes with status='failed'"):
        await lanes.finish(item_id, fence=claim.fence, error="oops")
    with pytest.raises(InvalidInput, match="result goes with status='done'"):
        await lanes.finish(item_id, fence=claim.fence, status="failed", result={"x": 1})
    assert (await lanes.item(item_id))["state"] == "claimed"


async def test_retry_backoff_is_capped(asyncplane_store_factory: Any, clock: ManualClock) -> None:
    store: ControlStore = await asyncplane_store_factory(
        retry_backoff=10, retry_backoff_max=15, rng=random.Random(5)
    )
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    for _ in range(4):
        claim = await store.claim("w")
        assert claim is not None
        await store.retry(item_id, fence=claim.fence)
        wait = ((await store.item(item_id))["due_at"] - clock.datetime()).total_seconds()
        assert wait <= 15.0 + 1e-6
        clock.advance(wait + 0.001)
    with pytest.raises(InvalidInput):
        await asyncplane_store_factory("other.db", retry_backoff=10, retry_backoff_max=5)


async def test_next_due_looks_only_at_open_projects(
    lanes: ControlStore, clock: ManualClock
) -> None:
    await lanes.create_project("paused", "Paused", status="paused")
    await lanes.enqueue("paused", {}, not_before=clock.now() + 5)
    assert await lanes.next_due() is None
    await lanes.enqueue("alpha", {}, not_before=clock.now() + 50)
    assert await lanes.next_due() == clock.datetime() + dt.timedelta(seconds=50)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(math.nan, InvalidInput), (-1, InvalidInput), ("soon", InvalidType)],
)
async def test_a_claims_poll_interval_is_checked_even_without_a_wait(
    lanes: ControlStore, bad: Any, error: type[Exception]
) -> None:
    await lanes.enqueue("alpha", {})
    with pytest.raises(error, match="poll_interval"):
        await lanes.claim("w", poll_interval=bad)
    assert (await lanes.counts())["ready"] == 1  # nothing was claimed


async def test_empty_enqueue_many_still_checks_scope(lanes: ControlStore) -> None:
    with pytest.raises(ScopeDenied):
        await lanes.enqueue_many("alpha", [], actor_id="stranger")
    with pytest.raises(InvalidType):
        await lanes.enqueue_many("alpha", 42)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="representable"):
        await lanes.enqueue("alpha", {}, sla=dt.datetime(1960, 1, 1, tzinfo=dt.timezone.utc))


async def test_the_last_instant_of_9999_is_a_time_and_the_first_of_10000_is_not(
    lanes: ControlStore,
) -> None:
    last = dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.timezone.utc)
    item_id = await lanes.enqueue("alpha", {}, sla=last, not_before=last)
    item = await lanes.item(item_id)
    # A float of epoch seconds keeps about 30 µs there.
    assert abs(item["sla"] - last) < dt.timedelta(milliseconds=1)
    assert item["due_at"] == item["sla"]
    await lanes.enqueue("alpha", {}, sla=253402300799)  # its last whole second, as seconds
    with pytest.raises(InvalidInput, match="representable"):
        await lanes.enqueue("alpha", {}, sla=253402300800)
    behind = dt.timezone(-dt.timedelta(hours=1))  # 23:00 here is 10000-01-01 in UTC
    with pytest.raises(InvalidInput, match="representable"):
        await lanes.enqueue("alpha", {}, sla=dt.datetime(9999, 12, 31, 23, 0, tzinfo=behind))
    assert (await lanes.counts())["ready"] == 1


class _NoOffset(dt.tzinfo):
    """A tzinfo that knows no offset: Python counts its datetimes as naive."""

    def utcoffset(self, when: dt.datetime | None) -> dt.timedelta | None:
        return None


class _BrokenOffset(dt.tzinfo):
    """A tzinfo whose offset cannot be had."""

    def utcoffset(self, when: dt.datetime | None) -> dt.timedelta | None:
        raise RuntimeError("no offset here")


@pytest.mark.parametrize(
    ("tz", "words"), [(_NoOffset(), "naive one is ambiguous"), (_BrokenOffset(), "no offset here")]
)
async def test_a_time_whose_tzinfo_gives_no_offset_is_refused_before_writing(
    lanes: ControlStore, tz: dt.tzinfo, words: str
) -> None:
    when = dt.datetime(2026, 12, 5, 9, 0, tzinfo=tz)
    for keywords in ({"sla": when}, {"not_before": when}):
        with pytest.raises(InvalidInput, match=words):
            await lanes.enqueue("alpha", {}, **keywords)
    with pytest.raises(InvalidInput, match=words):
        await lanes.items(updated_after=when)
    assert sum((await lanes.counts()).values()) == 0


async def test_claims_after_retry_and_park_are_not_counted_as_duplicates(
    lanes: ControlStore,
) -> None:
    # The probe's duplicate check: a second claim needs a recorded way back (a takeover,
    # a retry, a park); these are legitimate ones.
    item_id = await lanes.enqueue("alpha", {})
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.retry(item_id, fence=claim.fence, delay=0)
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.park(item_id, fence=claim.fence, delay=0)
    claim = await lanes.claim("w")
    assert claim is not None
    await lanes.finish(item_id, fence=claim.fence)
    backend: Any = await lanes._engine.ready()
    tally = await backend.tally()
    assert (tally.claims, tally.unexplained_claims, tally.settled_twice) == (3, [], [])


async def test_next_due_and_counts_follow_the_claim_filters(
    lanes: ControlStore, clock: ManualClock
) -> None:
    await lanes.assign("alpha", "agent")
    await lanes.enqueue("beta", {}, not_before=clock.now() + 10)
    await lanes.enqueue("alpha", {}, not_before=clock.now() + 50)
    assert await lanes.next_due() == clock.datetime() + dt.timedelta(seconds=10)
    assert await lanes.next_due(actor_id="agent") == clock.datetime() + dt.timedelta(seconds=50)
    assert await lanes.next_due(project_id="beta") == clock.datetime() + dt.timedelta(seconds=10)
    assert (await lanes.counts(actor_id="agent"))["deferred"] == 1
    assert (await lanes.counts())["deferred"] == 2
    # A due twin held back by its running twin is not work a claim could take.
    first = await lanes.enqueue("alpha", task("q"))
    claim = await lanes.claim("w", project_id="alpha")
    assert claim is not None and claim.item_id == first
    await lanes.enqueue("alpha", task("q"), dedup=False, not_before=clock.now() + 1)
    clock.advance(5)
    assert await lanes.next_due(project_id="alpha") == clock.datetime() + dt.timedelta(seconds=45)


async def test_skipped_twins_do_not_push_later_items_out_of_a_batch(
    lanes: ControlStore, clock: ManualClock
) -> None:
    # Twins in the due arm: the second is skipped, and the arm's next item still comes.
    d1 = await lanes.enqueue("alpha", {}, priority=1, fingerprint="x", dedup=False,
                             not_before=clock.now() + 10)  # fmt: skip
    await lanes.enqueue("alpha", {}, priority=1, fingerprint="x", dedup=False,
                        not_before=clock.now() + 10)  # fmt: skip
    d3 = await lanes.enqueue("alpha", {}, priority=1, not_before=clock.now() + 10)
    await lanes.enqueue("alpha", {}, priority=0)
    clock.advance(10)
    assert [c.item_id for c in await lanes.claim_batch("w", 2)] == [d1, d3]


async def test_ready_twins_do_not_push_later_items_out_of_a_batch(
    lanes: ControlStore, clock: ManualClock
) -> None:
    r1 = await lanes.enqueue("alpha", {}, priority=1, fingerprint="x", dedup=False)
    await lanes.enqueue("alpha", {}, priority=1, fingerprint="x", dedup=False)
    r3 = await lanes.enqueue("alpha", {}, priority=1)
    await lanes.enqueue("alpha", {}, priority=0, not_before=clock.now() + 1)
    clock.advance(1)
    assert [c.item_id for c in await lanes.claim_batch("w", 2)] == [r1, r3]


async def test_failing_an_exhausted_lapse_does_not_hide_the_next_takeover(
    lanes: ControlStore, clock: ManualClock
) -> None:
    x = await lanes.enqueue("alpha", {}, priority=2, max_attempts=1)
    y = await lanes.enqueue("alpha", {}, priority=1)
    assert [c.item_id for c in await lanes.claim_batch("w", 2)] == [x, y]
    await lanes.enqueue("alpha", {}, priority=0)
    clock.advance(61)
    taken = await lanes.claim("w2")  # x fails (no attempt left); y is the next in order
    assert taken is not None and taken.item_id == y
    assert (await lanes.item(x))["state"] == "failed"


async def test_backfill_never_fingerprints_running_claims(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    # Two identical items claimed before fingerprints existed must not become twins that
    # hold each other back forever once their leases lapse.
    old: ControlStore = await asyncplane_store_factory("bf.db", lease_seconds=10)
    await old.create_project("p", "P")
    a = await old.enqueue("p", task("same"))
    b = await old.enqueue("p", task("same"))
    assert await old.claim("w1") and await old.claim("w2")
    new: ControlStore = await asyncplane_store_factory("bf.db", identity=IDENTITY, lease_seconds=10)
    await new.dedup_pending_against_done()
    assert (await new.item(a))["fingerprint"] is None
    clock.advance(3600)
    taken = await new.claim_batch("w3", 5)
    assert sorted(c.item_id for c in taken) == [a, b]  # both taken over, as before


async def test_a_lapsed_twin_is_taken_over_never_run_beside(
    lanes: ControlStore, clock: ManualClock
) -> None:
    # Its lapsed holder may still be working: a twin run now would run beside it. The
    # lapsed item itself is taken over instead, with a higher fence that stops the old
    # holder's renewal.
    first = await lanes.enqueue("alpha", task("q"))
    claim = await lanes.claim("w1")
    assert claim is not None and claim.item_id == first
    twin = await lanes.enqueue("alpha", task("q"), dedup=False, priority=5)  # ahead in order
    assert await lanes.next_due() == claim.lease_expires_at  # the lapse is the next event
    clock.advance(61)
    batch = await lanes.claim_batch("w2", 5)
    assert [c.item_id for c in batch] == [first]
    with pytest.raises(FenceRejected):
        await lanes.renew(first, fence=claim.fence)
    assert (await lanes.item(twin))["state"] == "ready"
    await lanes.finish(first, fence=batch[0].fence, result={"answer": 1})
    again = await lanes.claim("w3")  # dedup=False: it runs, but only after its twin
    assert again is not None and again.item_id == twin


@pytest.mark.sqlite_only  # on PostgreSQL a unique index keeps running twins from existing
async def test_claimed_twins_from_an_older_store_wake_a_daemon_and_run_one_at_a_time(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    # Two claimed items that became twins while running (a store of an earlier release
    # fingerprinted running claims): each holds the other back while its lease is live.
    # next_due() still reports when both have lapsed, and a claim then takes one of them.
    store: ControlStore = await asyncplane_store_factory(
        "legacy.db", identity=IDENTITY, lease_seconds=60
    )
    await store.create_project("p", "P")
    a = await store.enqueue("p", {"n": 1})
    b = await store.enqueue("p", {"n": 2})
    first = await store.claim("w1")
    clock.advance(30)
    second = await store.claim("w2", lease_seconds=120)
    assert first is not None and second is not None
    with sqlite3.connect(store.path) as raw:
        raw.execute("UPDATE items SET fingerprint = 'same' WHERE item_id IN (?, ?)", (a, b))
    raw.close()
    assert await store.next_due() == second.lease_expires_at  # the later of the two
    clock.advance(60)  # a's lease lapsed; b's is live and holds a back
    assert await store.claim_batch("w3", 5) == []
    clock.advance(3600)
    batch = await store.claim_batch("w3", 5)
    assert len(batch) == 1 and batch[0].item_id in (a, b)
    assert await store.next_due() == batch[0].lease_expires_at
    assert await verify_ledger(store) == []


async def test_a_batch_larger_than_a_page_is_filled_past_skipped_twins(store: ControlStore) -> None:
    jobs = [Job({"n": n}, fingerprint="same" if n < 10 else None) for n in range(1_200)]
    await store.enqueue_many("alpha", jobs, dedup=False)
    batch = await store.claim_batch("w", 1_100)
    assert len(batch) == 1_100  # one of the ten twins, and 1,099 others
    assert len({claim.item_id for claim in batch}) == 1_100


def _content_lock(fingerprint: str) -> str:
    """The SQL that takes a content's hand-off lock in project p (as a finish does)."""
    return (
        "SELECT pg_advisory_xact_lock(hashtextextended("
        f"current_schema() || chr(1) || 'p' || chr(1) || '{fingerprint}', 2))"
    )


async def _lock_waiters(conn: Any) -> int:
    """How many sessions wait for an advisory lock."""
    waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    return int(await conn.fetchval(waiting))


@pytest.mark.postgresql_only
async def test_a_twin_finished_while_a_pair_forms_elsewhere_waits_and_settles_it(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    # A transaction makes an item pending (a requeue, here by hand) while its twin, due
    # but deferred, is claimed and finished elsewhere. The finish must not settle in a
    # snapshot that misses the item: it waits for the content's lock, which the pending
    # item's trigger took, then its settle sees the item and settles it with itself.
    import asyncpg

    store: ControlStore = await asyncplane_store_factory("race.db", identity=IDENTITY)
    await store.create_project("p", "P")
    first, twin = await failed_then_a_twin(store, "p", not_before=clock.now() + 10)
    clock.advance(20)
    forming = await asyncpg.connect(store.location)
    watching = await asyncpg.connect(store.location)
    try:
        async with forming.transaction():
            fence = await forming.fetchval(
                "UPDATE items SET state = 'ready', attempts = 0, error = NULL"
                " WHERE item_id = $1 RETURNING fence",
                first,
            )
            await forming.execute(
                "INSERT INTO events (item_id, event_type, fence, at)"
                " VALUES ($1, 'requeued', $2, 0)",
                first,
                fence,
            )
            claim = await store.claim("w")
            assert claim is not None and claim.item_id == twin
            finishing = asyncio.create_task(
                store.finish(twin, fence=claim.fence, result={"answer": 5})
            )
            await until(lambda: _lock_waiters(watching), what="the finish waiting")
            assert not finishing.done()
        await finishing
    finally:
        await forming.close()
        await watching.close()
    row = await store.item(first)
    assert (row["state"], row["result"]) == ("done", {"answer": 5})
    assert await verify_ledger(store) == []


@pytest.mark.postgresql_only
async def test_a_pair_formed_while_a_twin_finishes_elsewhere_is_noted(
    asyncplane_store_factory: Any,
) -> None:
    # The other order: a twin's finish holds the content's lock, not committed yet, when
    # a requeue makes the item pending. The requeue's trigger cannot look after that
    # finish, so it notes the content, and the next step settles the pair.
    import asyncpg

    store: ControlStore = await asyncplane_store_factory("race2.db", identity=IDENTITY)
    await store.create_project("p", "P")
    first, twin = await failed_then_a_twin(store, "p")
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == twin
    fingerprint = (await store.item(twin))["fingerprint"]
    finisher = await asyncpg.connect(store.location)
    try:
        async with finisher.transaction():
            await finisher.execute(_content_lock(fingerprint))
            await finisher.execute(
                "UPDATE items SET state = 'done', result = '{\"answer\": 6}', "
                "lease_expires_at = NULL WHERE item_id = $1",
                twin,
            )
            await finisher.execute(
                "INSERT INTO events (item_id, event_type, fence, owner, at) "
                "VALUES ($1, 'done', $2, 'w', 0)",
                twin,
                claim.fence,
            )
            await store.requeue(first)
            # A step now sees no pair (the finish has not committed): it must keep the
            # note, whose content's lock the finish still holds.
            assert (await engine_of(store).preflight_step(500))[0] == 0
    finally:
        await finisher.close()
    await settled_by_the_next_step(store, first, twin, {"answer": 6})


async def _insert_pending_twin(conn: Any, fingerprint: str, *, deferred: bool = False) -> int:
    """A pending item of content ``fingerprint`` in project p (ready, or deferred to
    2100), with dedup and its events, written as an import or a copy writes one: by an
    INSERT of the row."""
    item_id = int(
        await conn.fetchval(
            "INSERT INTO items (project_id, state, payload, created_at, updated_at,"
            " fingerprint, dedup, due_at) VALUES ('p', $2, '{}', 0, 0, $1, true, $3)"
            " RETURNING item_id",
            fingerprint,
            "deferred" if deferred else "ready",
            4.1e9 if deferred else None,
        )
    )
    events = ["queued", "deferred"] if deferred else ["queued"]
    for event in events:
        await conn.execute(
            "INSERT INTO events (item_id, event_type, fence, at) VALUES ($1, $2, 0, 0)",
            item_id,
            event,
        )
    return item_id


@pytest.mark.postgresql_only
async def test_a_twin_inserted_while_a_twin_finishes_elsewhere_is_noted(
    asyncplane_store_factory: Any,
) -> None:
    # An inserted row's trigger, as an updated one's: a twin's finish holds the content's
    # lock, not committed yet, as a pending twin is inserted (an import, a copy); the
    # trigger cannot look after that finish, so it notes the content, and the next step
    # settles it.
    import asyncpg

    store: ControlStore = await asyncplane_store_factory("insert.db", identity=IDENTITY)
    await store.create_project("p", "P")
    twin = await store.enqueue("p", task("q"))
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == twin
    fingerprint = (await store.item(twin))["fingerprint"]
    finisher = await asyncpg.connect(store.location)
    inserter = await asyncpg.connect(store.location)
    try:
        async with finisher.transaction():
            await finisher.execute(_content_lock(fingerprint))
            await finisher.execute(
                "UPDATE items SET state = 'done', result = '{\"answer\": 7}', "
                "lease_expires_at = NULL WHERE item_id = $1",
                twin,
            )
            await finisher.execute(
                "INSERT INTO events (item_id, event_type, fence, owner, at) "
                "VALUES ($1, 'done', $2, 'w', 0)",
                twin,
                claim.fence,
            )
            async with inserter.transaction():
                pending = await _insert_pending_twin(inserter, fingerprint)
            assert (await engine_of(store).preflight_step(500))[0] == 0  # note kept
    finally:
        await finisher.close()
        await inserter.close()
    await settled_by_the_next_step(store, pending, twin, {"answer": 7})


@pytest.mark.postgresql_only
async def test_a_twin_finished_while_a_twin_is_inserted_elsewhere_waits_and_settles_it(
    asyncplane_store_factory: Any,
) -> None:
    # The other order: the INSERT's trigger took the content's lock (its transaction still
    # open) when a twin is finished elsewhere; the finish waits for that lock, then its
    # settle sees the inserted item and settles it with itself. (Deferred, the inserted
    # twin takes no place in the running twin's line, and no lock on its row.)
    import asyncpg

    store: ControlStore = await asyncplane_store_factory("insert2.db", identity=IDENTITY)
    await store.create_project("p", "P")
    twin = await store.enqueue("p", task("q"))
    fingerprint = (await store.item(twin))["fingerprint"]
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == twin
    inserter = await asyncpg.connect(store.location)
    watching = await asyncpg.connect(store.location)
    try:
        async with inserter.transaction():
            pending = await _insert_pending_twin(inserter, fingerprint, deferred=True)
            finishing = asyncio.create_task(
                store.finish(twin, fence=claim.fence, result={"answer": 8})
            )
            await until(lambda: _lock_waiters(watching), what="the finish waiting")
            assert not finishing.done()
        await finishing
    finally:
        await inserter.close()
        await watching.close()
    row = await store.item(pending)
    assert (row["state"], row["result"]) == ("done", {"answer": 8})
    assert await verify_ledger(store) == []


async def test_a_payload_may_be_any_mapping_at_its_top(
    asyncplane_store_factory: Any,
) -> None:
    # A TypedDict's value is a dict; a read-only view is a Mapping: both are JSON objects.
    store: ControlStore = await asyncplane_store_factory(identity=("url",))
    await store.create_project("alpha", "Alpha")
    view = MappingProxyType({"url": "https://a.example", "n": [1, {"k": 2}]})
    first = await store.enqueue("alpha", view)
    twin = await store.enqueue("alpha", {"url": "https://a.example", "n": 0})
    assert twin == first  # the same fingerprint, from the view's identity field
    second, third = await store.enqueue_many(
        "alpha", [Job(MappingProxyType({"url": "b"})), MappingProxyType({"url": "c"})]
    )
    assert (await store.item(third))["payload"] == {"url": "c"}
    with pytest.raises(InvalidType, match="jobs must be an iterable"):  # its keys: no jobs
        await store.enqueue_many("alpha", MappingProxyType({"url": "d"}))  # type: ignore[arg-type]
    assert (await store.item(first))["payload"] == {"url": "https://a.example", "n": [1, {"k": 2}]}
    assert (await store.item(second))["payload"] == {"url": "b"}
    with pytest.raises(InvalidPayload, match="JSON object"):
        await store.enqueue("alpha", [("url", "c")])  # type: ignore[arg-type]
    with pytest.raises(InvalidPayload, match="not a JSON value"):  # only its top
        await store.enqueue("alpha", {"inner": MappingProxyType({})})
