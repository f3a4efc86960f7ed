"""Copying a store to another backend: everything arrives once, with its history."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sqlite3
import subprocess
import sys
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from asyncplane import (
    ControlStore,
    InvalidInput,
    StorageError,
    _copy,
    _store,
    copy_store,
    testing,
    verify_ledger,
)
from asyncplane.testing import ManualClock


@pytest.fixture
async def other_store(
    request: pytest.FixtureRequest,
    asyncplane_backend: str,
    tmp_path: pathlib.Path,
    asyncplane_clock: ManualClock,
) -> AsyncIterator[Callable[..., Any]]:
    """Stores on the *other* backend than the test's: where a copy goes."""
    opened: list[ControlStore] = []
    schemas: list[str] = []

    async def make(name: str = "copy", **options: Any) -> ControlStore:
        options.setdefault("clock", asyncplane_clock)
        if asyncplane_backend == "postgresql":
            location: str = str(tmp_path / f"{name}.db")
        else:
            server = request.getfixturevalue("asyncplane_postgres_url")
            schema = f"copy_{len(schemas)}_{abs(hash(request.node.nodeid)) % 10**8}"
            await testing.execute_sql(server, f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            await testing.execute_sql(server, f"CREATE SCHEMA {schema}")
            schemas.append(schema)
            location = testing.with_schema(server, schema)
        store = ControlStore(location, **options)
        await store.open()
        opened.append(store)
        return store

    try:
        yield make
    finally:
        for store in opened:
            await store.close()
        for schema in schemas:
            server = request.getfixturevalue("asyncplane_postgres_url")
            await testing.execute_sql(server, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def busy_store(store: ControlStore, clock: ManualClock) -> dict[str, int]:
    """A store with an item in every state, a result, a retry, a takeover, scope."""
    await store.create_project("p", "P")
    await store.create_project("q", "Q", status="paused")
    await store.assign("p", "alice")
    ids = await store.enqueue_many(
        "p",
        [{"n": n} for n in range(6)] + [{"n": 6, "task": "t"}],
    )
    done = await store.claim("w")
    assert done is not None
    await store.finish(done.item_id, fence=done.fence, result={"answer": 42})
    failed = await store.claim("w")
    assert failed is not None
    await store.finish(failed.item_id, fence=failed.fence, status="failed", error="no")
    retried = await store.claim("w")
    assert retried is not None
    await store.retry(retried.item_id, fence=retried.fence, error="later", delay=3600)
    lapsed = await store.claim("w", lease_seconds=10)
    assert lapsed is not None
    clock.advance(11)
    taken = await store.claim("w2", lease_seconds=600)  # a takeover: fence 2
    assert taken is not None and taken.item_id == lapsed.item_id and taken.fence == 2
    offloaded = await store.claim("w")
    assert offloaded is not None
    await store.offload(offloaded.item_id, fence=offloaded.fence, handle="batch-1")
    await store.enqueue("q", {"waiting": True})
    return {"first": ids[0], "taken": taken.item_id, "last": max(ids)}


async def snapshot(store: ControlStore) -> list[tuple[dict[str, Any], list[Any]]]:
    rows = []
    counts = await store.counts()
    assert sum(counts.values()) > 0
    for item_id in range(1, 100):
        try:
            item = await store.item(item_id)
        except LookupError:
            continue
        events = [
            (e["event_type"], e["fence"], e["owner"], e["actor_id"], e["at"], e["detail"])
            for e in await store.events(item_id)
        ]
        rows.append((item, events))
    return rows


async def test_a_copy_carries_every_item_with_its_history(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    source = asyncplane_store
    marks = await busy_store(source, asyncplane_clock)
    destination: ControlStore = await other_store()
    summary = await copy_store(source, destination, chunk=3)
    assert (summary.projects, summary.copied, summary.skipped) == (2, 8, 0)
    assert summary.chunks == 3
    assert await snapshot(destination) == await snapshot(source)
    assert await destination.projects() == await source.projects()
    assert await destination.visible_projects("alice") == ["p"]
    assert await verify_ledger(destination) == []
    # The copied claim keeps its fence; once its lease lapses here, a takeover goes higher.
    asyncplane_clock.advance(601)
    again = await destination.claim("w3")
    assert again is not None and again.item_id == marks["taken"] and again.fence == 3
    # New work gets new ids, above every copied one.
    assert await destination.enqueue("p", {"new": True}) > marks["last"] + 1


@pytest.mark.sqlite_only  # (a PostgreSQL store never held such a key)
async def test_a_store_holding_an_import_key_no_store_takes_now_is_refused_before_copying(
    asyncplane_store: ControlStore, other_store: Any, tmp_path: pathlib.Path
) -> None:
    # An earlier release's SQLite import remembered any key: its copy to PostgreSQL
    # failed on the records after every item had gone across, and so did every rerun.
    source = asyncplane_store
    await source.create_project("p", "P")
    await source.enqueue("p", {"n": 1})
    engine = await _store.engine_of(source).ready()
    await engine.copy_imports((("old.sqlite3::q", "k" * 3000, 1, 0.0, None),))
    destination: ControlStore = await other_store()  # PostgreSQL
    with pytest.raises(InvalidInput, match="nothing was copied: the source's import record"):
        await copy_store(source, destination)
    assert await destination.projects() == []
    assert sum((await destination.counts()).values()) == 0
    # A SQLite destination keeps any record, as the source did: copied as before.
    async with ControlStore(tmp_path / "sqlite-copy.db") as another:
        assert (await copy_store(source, another)).copied == 1


async def test_a_second_copy_copies_nothing_twice(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    await busy_store(asyncplane_store, asyncplane_clock)
    destination: ControlStore = await other_store()
    first = await copy_store(asyncplane_store, destination)
    again = await copy_store(asyncplane_store, destination)
    assert (again.copied, again.skipped, again.projects) == (0, first.copied, 0)
    later = await asyncplane_store.enqueue("p", {"after": True})  # the source went on
    third = await copy_store(asyncplane_store, destination)
    assert (third.copied, third.skipped) == (1, first.copied)
    assert (await destination.item(later))["payload"] == {"after": True}
    assert await verify_ledger(destination) == []


async def test_a_copy_cut_short_finishes_on_the_next_run(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    await busy_store(asyncplane_store, asyncplane_clock)
    destination: ControlStore = await other_store()

    def crash(count: int) -> None:
        raise RuntimeError("the process died")

    with pytest.raises(RuntimeError):
        await copy_store(asyncplane_store, destination, chunk=2, progress=crash)
    assert sum((await destination.counts()).values()) == 2  # the first chunk committed
    done = await copy_store(asyncplane_store, destination, chunk=2)
    assert (done.copied, done.skipped) == (6, 2)
    assert await verify_ledger(destination) == []


async def test_pending_only_leaves_settled_items_behind(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    await busy_store(asyncplane_store, asyncplane_clock)
    destination: ControlStore = await other_store()
    summary = await copy_store(asyncplane_store, destination, pending_only=True)
    assert summary.copied == 6
    counts = await destination.counts()
    assert (counts["done"], counts["failed"]) == (0, 0)
    assert await verify_ledger(destination) == []


async def test_a_destination_with_items_of_its_own_is_refused(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    await busy_store(asyncplane_store, asyncplane_clock)
    destination: ControlStore = await other_store()
    await destination.create_project("mine", "Mine")
    await destination.enqueue("mine", {"mine": True})  # item 1: not the source's item 1
    with pytest.raises(InvalidInput, match="item 1 of its own"):
        await copy_store(asyncplane_store, destination)
    assert (await destination.counts())["ready"] == 1  # nothing of the source arrived
    assert [p["project_id"] for p in await destination.projects()] == ["mine"]  # not even these
    assert await verify_ledger(destination) == []


async def own_item_at(
    store: ControlStore, item_id: int, tmp_path: pathlib.Path, clock: ManualClock
) -> None:
    """Give ``store`` (empty) one item of its own, under ``item_id`` (those below it are
    enqueued, cancelled and purged)."""
    await store.create_project("mine", "Mine")
    own = await store.enqueue_many("mine", [{"n": n} for n in range(item_id)])
    for earlier in own[:-1]:
        await store.cancel(earlier)
    clock.advance(1)
    await store.purge(0, archive_path=tmp_path / "archive.jsonl")
    assert [item["item_id"] for item in await store.items()] == [item_id]


@pytest.mark.parametrize(
    "own_id",
    [
        5,  # one a later chunk would meet: refused before the first, not at the third
        None,  # above every id of the source: its next ids would be the source's too
    ],
)
async def test_a_destination_with_an_item_of_its_own_is_refused_before_any_chunk(
    asyncplane_store: ControlStore,
    other_store: Any,
    asyncplane_clock: ManualClock,
    tmp_path: pathlib.Path,
    own_id: int | None,
) -> None:
    await busy_store(asyncplane_store, asyncplane_clock)
    top = max(item["item_id"] for item in await asyncplane_store.items())
    own = top + 1 if own_id is None else own_id
    destination: ControlStore = await other_store()
    await own_item_at(destination, own, tmp_path, asyncplane_clock)
    with pytest.raises(InvalidInput, match=f"item {own} of its own"):
        await copy_store(asyncplane_store, destination, chunk=2)
    assert sum((await destination.counts()).values()) == 1
    assert [p["project_id"] for p in await destination.projects()] == ["mine"]


async def test_a_destination_whose_own_items_were_all_purged_is_refused(
    asyncplane_store: ControlStore,
    other_store: Any,
    asyncplane_clock: ManualClock,
    tmp_path: pathlib.Path,
) -> None:
    # No item of its own left to see, so it passed for empty: the copy wrote the source's
    # items under ids the destination had handed out, and its archive names them too.
    await busy_store(asyncplane_store, asyncplane_clock)
    destination: ControlStore = await other_store()
    await destination.create_project("mine", "Mine")
    for n in range(3):
        await destination.cancel(await destination.enqueue("mine", {"mine": n}))
    asyncplane_clock.advance(1)
    assert (await destination.purge(0, archive_path=tmp_path / "archive.jsonl")).purged == 3
    with pytest.raises(InvalidInput, match=r"handed out item ids of its own \(up to 3"):
        await copy_store(asyncplane_store, destination)
    assert sum((await destination.counts()).values()) == 0  # nothing of the source arrived
    assert [p["project_id"] for p in await destination.projects()] == ["mine"]


async def test_a_copy_into_its_own_source_is_refused(tmp_path: pathlib.Path) -> None:
    # Named another way (a link), a store with no item yet passed for an empty
    # destination, and the copy wrote records of copying itself into itself.
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    async with (
        ControlStore(tmp_path / "dir" / "s.db") as source,
        ControlStore(tmp_path / "link" / "s.db") as same,
    ):
        await source.create_project("p", "P")
        for destination in (source, same):
            with pytest.raises(InvalidInput, match="are one store"):
                await copy_store(source, destination)
    written = sqlite3.connect(tmp_path / "dir" / "s.db")
    assert written.execute("SELECT count(*) FROM imports").fetchone() == (0,)  # no record
    written.close()


async def test_a_destination_an_earlier_release_copied_into_takes_the_next_copy(
    tmp_path: pathlib.Path,
) -> None:
    # Its copy kept the source's ids clear without recording it: the ids above the last
    # item it brought (left behind by pending_only) were taken for its own, and refused.
    async with (
        ControlStore(tmp_path / "a.db") as source,
        ControlStore(tmp_path / "b.db") as destination,
    ):
        await source.create_project("p", "P")
        ids = await source.enqueue_many("p", [{"n": n} for n in range(3)])
        await source.cancel(ids[-1])
        assert (await copy_store(source, destination, pending_only=True)).copied == 2
        written = sqlite3.connect(tmp_path / "b.db")
        with written:  # as that release left it: no record of the ids kept clear
            assert written.execute("DELETE FROM imports WHERE source LIKE '%#ids'").rowcount
        written.close()
        again = await copy_store(source, destination)
        assert (again.copied, again.skipped) == (1, 2)


async def test_a_destination_copied_into_then_purged_takes_the_next_copy(
    asyncplane_store: ControlStore,
    other_store: Any,
    asyncplane_clock: ManualClock,
    tmp_path: pathlib.Path,
) -> None:
    # The ids a copy brought, or kept clear, are the source's, not the destination's own:
    # a destination that purged them, or never held them (pending_only), is copied into again.
    source = asyncplane_store
    await busy_store(source, asyncplane_clock)
    destination: ControlStore = await other_store()
    await copy_store(source, destination, pending_only=True)
    asyncplane_clock.advance(7200)
    await destination.purge(0, archive_path=tmp_path / "archive.jsonl")
    await source.enqueue("p", {"later": True})
    again = await copy_store(source, destination)
    assert again.copied > 0
    assert await verify_ledger(destination) == []


@pytest.mark.postgresql_only  # one run covers both directions
def test_the_copy_verb_moves_a_file_to_postgresql_and_back(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    source = tmp_path / "old.db"
    server_side = location_of("moved")
    back = tmp_path / "back.db"

    async def seed() -> None:
        async with ControlStore(source) as store:
            await store.create_project("p", "P")
            await store.enqueue_many("p", [{"n": n} for n in range(25)])

    asyncio.run(seed())

    def cli(*args: str) -> tuple[int, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "asyncplane.cli", *args, "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return done.returncode, json.loads(done.stdout) if done.stdout.strip() else done.stderr

    code, out = cli("copy", str(source), server_side)
    assert code == 0, out
    assert (out["copied"], out["ledger_problems"]) == (25, 0)
    code, out = cli("copy", str(source), server_side)
    assert code == 0 and (out["copied"], out["copied_before"]) == (0, 25)
    code, out = cli("copy", server_side, str(back))
    assert code == 0 and out["copied"] == 25
    code, out = cli("stats", server_side)
    assert code == 0 and out["states"]["ready"] == 25
    code, out = cli("verify", str(back))
    assert code == 0 and out["clean"] is True
    (tmp_path / "junk.db").write_bytes(b"not a store")
    code, out = cli("copy", str(source), str(tmp_path / "junk.db"))
    assert code == 2
    # A copy killed as it made its destination leaves an empty file, or an SQLite file
    # with nothing in it (switched to WAL): a rerun finishes the job.
    import sqlite3

    (tmp_path / "cut0.db").write_bytes(b"")
    begun = sqlite3.connect(tmp_path / "cut1.db")
    begun.execute("PRAGMA journal_mode=wal")
    begun.close()
    for cut in ("cut0.db", "cut1.db"):
        code, out = cli("copy", str(source), str(tmp_path / cut))
        assert code == 0 and out["copied"] == 25, out
    foreign = sqlite3.connect(tmp_path / "other.db")
    foreign.execute("CREATE TABLE t (x)")  # another application's: still refused
    foreign.close()
    code, out = cli("copy", str(source), str(tmp_path / "other.db"))
    assert code == 2 and "not an asyncplane store" in out
    table = subprocess.run(
        [sys.executable, "-m", "asyncplane.cli", "copy", str(source), str(tmp_path / "t.db")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "and 1 new project from" in table.stdout, table.stderr  # one, not "1 new projects"


async def test_a_copied_running_twin_holds_its_copied_twins_back(
    asyncplane_store: ControlStore, other_store: Any, raw_of: Any
) -> None:
    # The running twin has the higher id, so the copy writes its waiting twin first.
    source = asyncplane_store
    await source.create_project("p", "P")
    waiting = await source.enqueue("p", {"n": 1}, fingerprint="x")
    running = await source.enqueue("p", {"n": 2}, fingerprint="x", dedup=False, priority=5)
    claim = await source.claim("w")
    assert claim is not None and claim.item_id == running
    destination: ControlStore = await other_store()
    await copy_store(source, destination)
    held = raw_of(destination).execute("SELECT item_id FROM items WHERE held = ?", (True,))
    assert [row[0] for row in held] == [waiting]
    assert await destination.claim("w2") is None
    await destination.finish(running, fence=claim.fence)
    assert await verify_ledger(destination) == []


async def test_a_running_twin_of_one_running_in_the_destination_is_refused_typed(
    asyncplane_store: ControlStore, other_store: Any
) -> None:
    # A second copy after the source's workers went on: on PostgreSQL, where one content
    # runs at a time (a unique index), the copy failed with the index's own error, exit 3.
    source = asyncplane_store
    await source.create_project("p", "P")
    first = await source.enqueue("p", {"n": 1}, fingerprint="x")
    claim = await source.claim("w")
    assert claim is not None and claim.item_id == first
    destination: ControlStore = await other_store()
    await copy_store(source, destination)  # the first, claimed, comes across claimed
    await source.finish(first, fence=claim.fence)
    second = await source.enqueue("p", {"n": 2}, fingerprint="x", dedup=False)
    assert (await source.claim("w")) is not None
    if destination.backend == "postgresql":
        with pytest.raises(InvalidInput, match=f"item {second} runs .* item {first}, its"):
            await copy_store(source, destination)
        assert (await destination.item(first))["state"] == "claimed"  # left as it was
    else:  # SQLite keeps no such index: it holds running twins (claimed before a
        await copy_store(source, destination)  # fingerprint was known) and serves them
        assert (await destination.item(second))["state"] == "claimed"


async def test_a_copy_carries_limits_and_schedules_which_keep_their_place(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    source = asyncplane_store
    await source.create_project("p", "P")
    await source.set_limits("p", max_running=2, per_minute=60, burst=3)
    await source.set_schedule("beat", project_id="p", payload={"b": 1}, every=60)
    await source.set_schedule(
        "sweep", project_id="p", payload={"s": 1}, cron="0 3 * * *", timezone="Europe/Paris",
        catch_up="all", priority=4,
    )  # fmt: skip
    await source.pause_schedule("sweep")
    asyncplane_clock.advance(60)
    assert await source.run_schedules() == 1
    destination: ControlStore = await other_store()
    await copy_store(source, destination)
    assert await destination.schedules() == await source.schedules()
    assert await destination.project_limits() == await source.project_limits()
    assert await destination.run_schedules() == 0  # the tick taken there is not taken again
    # What was changed there stands through a second copy.
    await destination.set_limits("p", max_running=7)
    await destination.pause_schedule("beat")
    await copy_store(source, destination)
    assert (await destination.limits("p"))["max_running"] == 7
    assert (await destination.schedule("beat"))["paused"] is True
    # Once it has taken work of its own (a tick's item), a copy into it is refused.
    await destination.resume_schedule("beat")
    asyncplane_clock.advance(60)
    assert await destination.run_schedules() == 1
    with pytest.raises(InvalidInput, match="of its own"):
        await copy_store(source, destination)


async def test_a_second_copy_adds_back_nothing_the_destination_took_away(
    asyncplane_store: ControlStore, other_store: Any
) -> None:
    # A revoked assignment came back with the next copy (access granted again), a deleted
    # schedule began enqueuing again, cleared limits were set again.
    source = asyncplane_store
    await source.create_project("p", "P")
    await source.assign("p", "alice")
    await source.set_limits("p", max_running=1)
    await source.set_schedule("beat", project_id="p", payload={}, every=60)
    destination: ControlStore = await other_store()
    await copy_store(source, destination)
    assert await destination.visible_projects("alice") == ["p"]
    await destination.unassign("p", "alice")
    await destination.set_limits("p", max_running=None)
    await destination.delete_schedule("beat")
    await copy_store(source, destination)
    assert await destination.visible_projects("alice") == []
    assert (await destination.limits("p"))["max_running"] is None
    assert await destination.schedules() == []
    # What the source gained since still comes.
    await source.create_project("q", "Q")
    await source.assign("q", "bob")
    await source.set_schedule("sweep", project_id="q", payload={}, every=3600)
    await copy_store(source, destination)
    assert await destination.visible_projects("bob") == ["q"]
    assert [s["name"] for s in await destination.schedules()] == ["sweep"]
    assert await verify_ledger(destination) == []


async def test_a_destination_copied_into_before_settings_were_recorded_gets_none_back(
    asyncplane_store: ControlStore, other_store: Any, raw_of: Any
) -> None:
    # An earlier release recorded the items a copy brought, not its settings: what the
    # destination lacks now may have been taken away there, so nothing but projects comes.
    source = asyncplane_store
    await source.create_project("p", "P")
    await source.assign("p", "alice")
    await source.set_schedule("beat", project_id="p", payload={}, every=60)
    await source.enqueue("p", {})
    destination: ControlStore = await other_store()
    await copy_store(source, destination)
    raw = raw_of(destination)
    raw.execute("DELETE FROM imports WHERE source LIKE ?", ("%#settings",))  # as then
    if raw.backend == "sqlite":
        raw.commit()
    await destination.unassign("p", "alice")
    await destination.delete_schedule("beat")
    await source.create_project("q", "Q")  # new since: it comes whole, settings and all
    await source.assign("q", "bob")
    await source.set_limits("q", max_running=1)
    await copy_store(source, destination)
    assert await destination.visible_projects("alice") == []
    assert await destination.schedules() == []
    assert [p["project_id"] for p in await destination.projects()] == ["p", "q"]
    assert await destination.visible_projects("bob") == ["q"]
    assert (await destination.limits("q"))["max_running"] == 1


async def test_a_second_copy_moves_a_copied_schedule_on_to_its_sources_place(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    # Ticks the source ran after the first copy ran again in the destination.
    source = asyncplane_store
    await source.create_project("p", "P")
    await source.set_schedule("beat", project_id="p", payload={}, every=60, catch_up="all")
    await source.set_schedule("own", project_id="p", payload={}, every=60, catch_up="all")
    destination: ControlStore = await other_store()
    await copy_store(source, destination)
    await destination.set_schedule("own", project_id="p", payload={}, every=90)  # its own now
    own_place = (await destination.schedule("own"))["next_at"]
    asyncplane_clock.advance(180)
    assert await source.run_schedules() == 6  # three ticks of each
    await copy_store(source, destination)
    beat = await destination.schedule("beat")
    assert beat["next_at"] == (await source.schedule("beat"))["next_at"]
    assert beat["last_at"] == (await source.schedule("beat"))["last_at"]
    assert (await destination.schedule("own"))["next_at"] == own_place  # not the source's
    ticks = await destination.run_schedules()
    assert ticks == 1  # "own"'s latest, on its own timetable; none of "beat"'s again


async def test_a_copied_item_keeps_the_trace_context_its_producer_saved(
    asyncplane_store: ControlStore, other_store: Any
) -> None:
    from opentelemetry import context, propagate

    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    source = asyncplane_store
    await source.create_project("p", "P")
    token = context.attach(propagate.extract({"traceparent": incoming}))
    try:
        await source.enqueue("p", {"traced": True})
    finally:
        context.detach(token)
    await source.enqueue("p", {"traced": False})
    destination: ControlStore = await other_store()
    await copy_store(source, destination)
    # The worker on the destination links its span to the producer's, as on the source.
    first, second = await destination.claim_batch("w", 2)
    assert first.trace_context == {"traceparent": incoming}
    assert second.trace_context is None


async def test_a_destination_never_hands_out_an_id_the_source_did(
    asyncplane_store: ControlStore, other_store: Any, asyncplane_clock: ManualClock
) -> None:
    # Left behind (pending_only) or purged in the source, an item's id may be named in an
    # archive: the destination's next item must not take it.
    source = asyncplane_store
    await busy_store(source, asyncplane_clock)
    await source.create_project("r", "R")
    highest = await source.enqueue("r", {"last": True})
    claim = await source.claim("w", project_id="r")
    assert claim is not None and claim.item_id == highest
    await source.finish(highest, fence=claim.fence)
    asyncplane_clock.advance(7200)
    await source.purge(0)
    assert max(i["item_id"] for i in await source.items(limit=100)) < highest
    for pending_only in (True, False):
        destination: ControlStore = await other_store(f"ids{pending_only}")
        await copy_store(source, destination, pending_only=pending_only)
        assert await destination.enqueue("p", {"new": True}) > highest
    assert await source.enqueue("p", {"new": True}) > highest


@pytest.mark.postgresql_only
async def test_a_source_read_by_a_role_with_only_select_on_its_tables_copies_whole(
    url: str, other_store: Any, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    # The usual read-only grant reads no sequence: the last id handed out is then the
    # highest the source still names (one purged above it is not known: the copy says so).
    async with ControlStore(url) as owner:
        await owner.create_project("p", "P")
        await owner.enqueue_many("p", [{"n": n} for n in range(3)])
        await owner.cancel(3)
    server = request.getfixturevalue("asyncplane_postgres_url")
    role = f"reader_{abs(hash(request.node.nodeid)) % 10**8}"
    schema = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["search_path"]
    await testing.execute_sql(
        server,
        f"DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN PASSWORD 'r'; "
        f"GRANT USAGE ON SCHEMA {schema} TO {role}; "
        f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}",
    )
    parts = urllib.parse.urlsplit(url)
    as_reader = parts._replace(netloc=f"{role}:r@{parts.netloc.rpartition('@')[2]}").geturl()
    try:
        async with ControlStore(as_reader, read_only=True) as source:
            destination: ControlStore = await other_store()
            summary = await copy_store(source, destination)
            assert (summary.projects, summary.copied) == (1, 3)
            assert await verify_ledger(destination) == []
            assert await destination.enqueue("p", {"new": True}) == 4
    finally:
        await testing.execute_sql(server, f"DROP OWNED BY {role}; DROP ROLE {role}")
    assert "may not read the items' id sequence" in caplog.text


async def test_a_source_that_cannot_say_its_last_id_fails_the_copy_before_any_write(
    asyncplane_store: ControlStore,
    other_store: Any,
    asyncplane_clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await busy_store(asyncplane_store, asyncplane_clock)
    backend = await asyncplane_store._engine.ready()

    async def refused() -> int:
        raise StorageError("permission denied for sequence items_item_id_seq")

    monkeypatch.setattr(backend, "last_item_id", refused)
    destination: ControlStore = await other_store()
    with pytest.raises(StorageError, match="permission denied"):
        await copy_store(asyncplane_store, destination)
    assert await destination.projects() == []
    assert sum((await destination.counts()).values()) == 0


async def test_an_sqlite_source_is_known_by_its_file_not_by_its_name(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "link.db").symlink_to(tmp_path / "store.db")
    labels = []
    for name in ("store.db", "link.db"):
        async with ControlStore(tmp_path / name) as store:
            labels.append(await _copy.source_label(store))
    assert labels[0] == labels[1] == f"copy:sqlite:{tmp_path / 'store.db'}"


@pytest.mark.postgresql_only
async def test_a_postgresql_source_is_known_by_what_the_server_resolves(url: str) -> None:
    # The server names the store: its database and the schema its search_path resolved
    # to. Two users whose "$user" schemas differ are two sources under one URL's spelling;
    # one store written two ways is one.
    role = f"copier_{os.getpid()}"
    await testing.execute_sql(
        url,
        f"CREATE ROLE {role} LOGIN; CREATE SCHEMA {role} AUTHORIZATION {role}; "
        f"CREATE SCHEMA {role}_b",
    )
    try:
        parts = urllib.parse.urlsplit(url)
        as_role = parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}")
        query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "search_path"]
        spelled = {
            "own": as_role._replace(
                query=urllib.parse.urlencode([*query, ("search_path", "$user")])
            ),
            "named": as_role._replace(
                query=urllib.parse.urlencode([("search_path", role), *reversed(query)])
            ),
        }
        labels = {}
        for name, spelling in spelled.items():
            async with ControlStore(spelling.geturl()) as store:
                labels[name] = await _copy.source_label(store)
        async with ControlStore(testing.with_schema(url, f"{role}_b")) as other:
            labels["other"] = await _copy.source_label(other)
        assert labels["own"] == labels["named"] and labels["own"].endswith(f"/{role}")
        assert labels["other"] != labels["own"] and labels["other"].endswith(f"/{role}_b")
        # A role that may not read the cluster's identifier: the location as written
        # (a resume spelled otherwise is refused, never taken for another's).
        revoke = "REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC"
        await testing.execute_sql(url, revoke)
        try:
            async with ControlStore(spelled["own"].geturl()) as store:
                assert await _copy.source_label(store) == f"copy:{store.location}"
        finally:
            await testing.execute_sql(
                url, "GRANT EXECUTE ON FUNCTION pg_control_system() TO PUBLIC"
            )
    finally:
        await testing.execute_sql(
            url, f"DROP SCHEMA {role} CASCADE; DROP SCHEMA {role}_b CASCADE; DROP ROLE {role}"
        )


@pytest.mark.postgresql_only
async def test_a_copy_resumes_from_its_source_written_another_way(
    url: str, other_store: Any
) -> None:
    async with ControlStore(url) as source:
        await source.create_project("p", "P")
        await source.enqueue_many("p", [{"n": n} for n in range(3)])
    destination: ControlStore = await other_store()
    async with ControlStore(url) as source:
        assert (await copy_store(source, destination)).copied == 3
    parts = urllib.parse.urlsplit(url)
    query = "&".join(reversed(parts.query.split("&"))) + "&application_name=elsewhere"
    spellings = (parts._replace(query=query).geturl(), url.replace("postgresql:", "postgres:"))
    for before, written in enumerate(spellings, start=3):
        async with ControlStore(written) as source:
            await source.enqueue("p", {"written": written})
            later = await copy_store(source, destination)
            assert (later.copied, later.skipped) == (1, before), written
    assert await verify_ledger(destination) == []


async def test_a_copy_begun_when_the_source_was_known_by_its_location_goes_on(
    asyncplane_store: ControlStore, other_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copies began keyed by the location as written; such a copy goes on under that key.
    await asyncplane_store.create_project("p", "P")
    await asyncplane_store.enqueue_many("p", [{"n": n} for n in range(3)])
    destination: ControlStore = await other_store()
    with monkeypatch.context() as before:

        async def as_written(store: ControlStore) -> str:
            return f"copy:{store.location}"

        before.setattr(_copy, "source_label", as_written)
        assert (await copy_store(asyncplane_store, destination)).copied == 3
    await asyncplane_store.enqueue("p", {"n": 3})
    again = await copy_store(asyncplane_store, destination)
    assert (again.copied, again.skipped) == (1, 3)
    assert await verify_ledger(destination) == []


async def test_a_copy_begun_through_a_link_to_its_source_goes_on_through_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keyed by the location as written before, a source named through a link was keyed
    # by the link's name: the copy goes on under it, not under the file it leads to.
    (tmp_path / "link.db").symlink_to(tmp_path / "real.db")
    async with (
        ControlStore(tmp_path / "link.db") as source,
        ControlStore(tmp_path / "copy.db") as destination,
    ):
        assert source.location == str(tmp_path / "link.db") != str(source.path)
        await source.create_project("p", "P")
        await source.enqueue_many("p", [{"n": n} for n in range(3)])

        async def as_written(store: ControlStore) -> str:
            return f"copy:{store.location}"

        with monkeypatch.context() as before:
            before.setattr(_copy, "source_label", as_written)
            assert (await copy_store(source, destination)).copied == 3
        await source.enqueue("p", {"n": 3})
        again = await copy_store(source, destination)
        assert (again.copied, again.skipped) == (1, 3)


async def test_a_second_store_known_by_the_same_key_is_refused_not_skipped(
    asyncplane_store: ControlStore,
    asyncplane_store_factory: Any,
    asyncplane_clock: ManualClock,
    other_store: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two stores a key cannot tell apart (a clone restored from one base backup, two
    # servers behind one tunnel's address): the second's items under the first's ids
    # are not "copied before". Refused, never skipped unsaid.
    sources: list[ControlStore] = []  # (the destination is known as itself)

    async def one_key(store: ControlStore) -> str:
        return "copy:the-same" if store in sources else f"copy:{store.location}"

    monkeypatch.setattr(_copy, "source_label", one_key)
    await asyncplane_store.create_project("p", "P")
    await asyncplane_store.enqueue_many("p", [{"n": n} for n in range(3)])
    clone: ControlStore = await asyncplane_store_factory("clone.db")
    await clone.create_project("p", "P")
    asyncplane_clock.advance(60)  # made apart: not the same items
    await clone.enqueue_many("p", [{"clone": n} for n in range(3)])
    sources.extend((asyncplane_store, clone))
    destination: ControlStore = await other_store()
    assert (await copy_store(asyncplane_store, destination)).copied == 3
    with pytest.raises(InvalidInput, match="came from another store than this source"):
        await copy_store(clone, destination)
    assert [(await destination.item(i))["payload"] for i in (1, 2, 3)] == [
        {"n": 0}, {"n": 1}, {"n": 2},
    ]  # fmt: skip


async def test_a_copy_carries_what_the_source_imported(
    asyncplane_store: ControlStore, other_store: Any, tmp_path: pathlib.Path
) -> None:
    # An import run again on the destination skips the rows the source took in, as it
    # would on a backup of the source restored.
    import sqlite3

    table = tmp_path / "queue.sqlite3"
    conn = sqlite3.connect(table)
    conn.execute("CREATE TABLE q (id TEXT PRIMARY KEY, body TEXT)")
    conn.executemany("INSERT INTO q VALUES (?, ?)", [(f"k{n}", '{"n": 1}') for n in range(7)])
    conn.commit()
    conn.close()
    await asyncplane_store.create_project("p", "P")
    columns = {"key": "id", "payload": "body"}
    first = await asyncplane_store.import_pending(table, table="q", columns=columns, project_id="p")
    assert first.imported == 7
    destination: ControlStore = await other_store()
    await copy_store(asyncplane_store, destination, chunk=3)  # the records, a page at a time
    again = await destination.import_pending(table, table="q", columns=columns, project_id="p")
    assert (again.imported, again.already_imported) == (0, 7)
    assert (await destination.counts())["ready"] == 7
    # With what each row held: a row rewritten since is told from the one copied; and
    # once the source has imported it again, its record, rewritten, is copied too (a
    # copy kept the destination's older one, and the row was imported there once more).
    conn = sqlite3.connect(table)
    conn.execute("UPDATE q SET body = '{\"n\": 2}' WHERE id = 'k0'")
    conn.commit()
    conn.close()
    again_there = await asyncplane_store.import_pending(
        table, table="q", columns=columns, project_id="p"
    )
    assert (again_there.imported, again_there.changed) == (1, 1)
    await copy_store(asyncplane_store, destination, chunk=3)
    rerun = await destination.import_pending(table, table="q", columns=columns, project_id="p")
    assert (rerun.imported, rerun.already_imported) == (0, 7)
    assert (await destination.counts())["ready"] == 8


async def test_a_store_that_never_held_an_item_copies(
    asyncplane_store: ControlStore, other_store: Any
) -> None:
    await asyncplane_store.create_project("p", "P")
    destination: ControlStore = await other_store()
    summary = await copy_store(asyncplane_store, destination)
    assert (summary.projects, summary.copied) == (1, 0)
    assert await destination.enqueue("p", {}) == 1
