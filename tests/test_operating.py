"""Operating a store: retention with an archive, importing pending work, stats, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from _signals import until
from asyncplane import (
    ArchiveError,
    ClaimedItem,
    ControlStore,
    Done,
    ImportSummary,
    InvalidInput,
    InvalidPayload,
    InvalidType,
    Outcome,
    ReadOnlyStore,
    UnknownProject,
    _retention,
    _sqlite,
    drain,
    verify_ledger,
)
from asyncplane import _sqlite_sql as sql
from asyncplane.testing import ManualClock

PURGER = pathlib.Path(__file__).parent / "workers" / "purge_worker.py"


async def settle(store: ControlStore, project: str, count: int, status: str = "done") -> list[int]:
    ids = [await store.enqueue(project, {"n": n}) for n in range(count)]
    for _ in ids:
        claim = await store.claim("w", project_id=project)
        assert claim is not None
        if status == "done":
            await store.finish(claim.item_id, fence=claim.fence, result={"n": claim.payload["n"]})
        else:
            await store.finish(claim.item_id, fence=claim.fence, status="failed", error="bad")
    return ids


def archived_ids(path: pathlib.Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["item"]["item_id"] for line in path.read_text().splitlines()]


# --- retention -----------------------------------------------------------------------------


async def test_purge_archives_then_deletes_old_settled_items_only(
    store: ControlStore, clock: ManualClock
) -> None:
    old_done = await settle(store, "alpha", 3)
    old_failed = await settle(store, "alpha", 2, status="failed")
    clock.advance(8 * 86400)
    recent = await settle(store, "alpha", 1)
    ready = await store.enqueue("alpha", {"waiting": True})
    deferred = await store.enqueue("alpha", {}, not_before=clock.now() + 10**6)
    claim_ids = [await store.enqueue("alpha", {"k": k}) for k in range(2)]
    claimed = await store.claim("w")
    offload = await store.claim("w")
    assert claimed and offload and {claimed.item_id, offload.item_id} <= set(claim_ids) | {ready}
    await store.offload(offload.item_id, fence=offload.fence, handle="batch")
    clock.advance(30 * 86400)  # everything is old now; only settled items may go

    summary = await store.purge(dt.timedelta(days=7))
    assert summary.purged == 6  # five old settled, and the one settled a week later
    archive = summary.archive_path
    assert archive == store.archive_path
    if store.backend == "sqlite":  # by default, beside the database
        assert archive == store.path.with_name(store.path.name + ".archive.jsonl")
    assert sorted(archived_ids(archive)) == sorted(old_done + old_failed + recent)
    line = json.loads(archive.read_text().splitlines()[0])
    assert [e["event_type"] for e in line["events"]] == ["queued", "claimed", "done"]
    assert line["item"]["result"] == {"n": 0}
    counts = await store.counts()
    assert (counts["done"], counts["failed"]) == (0, 0)
    assert (counts["ready"], counts["deferred"], counts["claimed"], counts["offloaded"]) == (
        1, 1, 1, 1,
    )  # fmt: skip
    for item_id in (ready, deferred, claimed.item_id, offload.item_id):
        await store.item(item_id)  # still there
    assert await verify_ledger(store) == []  # no orphan events left behind


async def test_every_purge_says_what_it_purged_in_the_retention_log(
    store: ControlStore, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    # As docs/observability.md lists: a call's (a cron job's), not the drain loop's alone.
    await settle(store, "alpha", 3)
    clock.advance(10)
    with caplog.at_level(logging.INFO, logger="asyncplane.retention"):
        assert (await store.purge(0)).purged == 3
        assert (await store.purge(0)).purged == 0  # nothing purged: nothing said
    said = [r.getMessage() for r in caplog.records if r.name == "asyncplane.retention"]
    assert said == ["purged 3 settled item(s) into the archive"]


async def test_purge_keeps_items_younger_than_the_retention(
    store: ControlStore, clock: ManualClock
) -> None:
    ids = await settle(store, "alpha", 2)
    clock.advance(3600)
    assert (await store.purge(7200)).purged == 0
    clock.advance(3601)
    assert (await store.purge(7200)).purged == 2
    with pytest.raises(InvalidInput):
        await store.purge()  # no retention given, none configured
    assert ids


async def test_an_item_settled_again_while_its_chunk_is_archived_is_not_purged(
    store: ControlStore, clock: ManualClock
) -> None:
    # Archived as failed, then requeued and done before the delete: deleted, its result
    # and newer history would be in neither the store nor the archive.
    failed = await settle(store, "alpha", 2, status="failed")
    clock.advance(10)
    engine = await store._engine.ready()
    assert store.archive_path is not None

    async def settled_again() -> None:
        await store.requeue(failed[0])
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == failed[0]
        await store.finish(claim.item_id, fence=claim.fence, result={"second": True})

    summary = await _retention.purge(
        engine, store.clock, 0.0, chunk=10, archive_path=store.archive_path,
        archive_max_bytes=1 << 20, _after_archive=settled_again,
    )  # fmt: skip
    assert summary.purged == 1  # the other one, unchanged since archived
    item = await store.item(failed[0])
    assert (item["state"], item["result"]) == ("done", {"second": True})
    assert [e["event_type"] for e in await store.events(failed[0])][-2:] == ["claimed", "done"]
    with pytest.raises(LookupError):
        await store.item(failed[1])
    assert await verify_ledger(store) == []
    clock.advance(10)
    assert (await store.purge(0)).purged == 1  # archived as it stands now, then deleted
    last = json.loads(store.archive_path.read_text().splitlines()[-1])
    assert (last["item"]["state"], last["item"]["result"]) == ("done", {"second": True})


async def test_a_read_only_store_refuses_a_purge_before_it_touches_the_archive(
    asyncplane_store_factory: Any, clock: ManualClock, tmp_path: pathlib.Path
) -> None:
    store: ControlStore = await asyncplane_store_factory("ro.db")
    await store.create_project("alpha", "Alpha")
    await settle(store, "alpha", 3)
    clock.advance(10)
    reader: ControlStore = await asyncplane_store_factory("ro.db", read_only=True)
    archive = tmp_path / "refused.jsonl"
    for _ in range(2):
        with pytest.raises(ReadOnlyStore):
            await reader.purge(0, archive_path=archive)
    assert not archive.exists() and not archive.with_name(archive.name + ".lock").exists()
    assert (await reader.counts())["done"] == 3


async def test_purge_works_in_bounded_chunks(store: ControlStore, clock: ManualClock) -> None:
    await settle(store, "alpha", 5)
    clock.advance(10)
    backend: Any = await store._engine.ready()
    rounds = backend.writer.rounds
    seen: list[int] = []
    summary = await store.purge(0, chunk=2, progress=seen.append)
    assert (summary.purged, summary.chunks) == (5, 3)
    assert seen == [2, 4, 5]
    assert backend.writer.rounds - rounds == 3  # one short transaction per chunk


async def test_the_archive_rotates_to_one_older_generation(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    store: ControlStore = await asyncplane_store_factory(archive_max_mb=0.001)  # ~1 KiB
    await store.create_project("p", "P")
    for _ in range(4):
        await settle(store, "p", 3)
        clock.advance(10)
        await store.purge(0)
    archive = store.archive_path
    assert archive is not None
    older = archive.with_name(archive.name + ".1")
    assert archive.exists() and older.exists()
    assert not archive.with_name(archive.name + ".2").exists()
    assert older.stat().st_size >= 1024
    everything = archived_ids(older) + archived_ids(archive)
    assert len(everything) == len(set(everything))  # rotation loses and repeats nothing
    assert len(everything) >= 6


async def test_one_purge_never_replaces_the_older_generation_it_made(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    # A backlog purged at once (`asyncplane purge` after months): each chunk past the
    # limit rotated, and each rotation replaced the .1 the last one had made a moment
    # before, histories and all (of 200,000 items purged, 56,500 were left in the
    # archive). One purge rotates once: then it stops, says so, and leaves the rest.
    store: ControlStore = await asyncplane_store_factory(archive_max_mb=0.001)  # ~1 KiB
    await store.create_project("p", "P")
    ids = await settle(store, "p", 40)
    clock.advance(10)
    archive = store.archive_path
    assert archive is not None
    first = await store.purge(0, chunk=4)
    assert first.archive_full and 0 < first.purged < 40
    older = archive.with_name(archive.name + ".1")
    kept = archived_ids(older) + archived_ids(archive)
    assert sorted(kept) == sorted(ids[: first.purged])  # every item purged is archived
    aside = archive.with_name("moved-aside.jsonl")
    older.rename(aside)  # as the warning asks
    second = await store.purge(0, chunk=4)
    assert second.purged > 0
    everything = archived_ids(aside) + archived_ids(older) + archived_ids(archive)
    assert sorted(everything) == sorted(ids[: first.purged + second.purged])
    assert (await store.counts())["done"] == 40 - first.purged - second.purged


async def test_a_purge_never_replaces_the_older_generation_another_made_beside_it(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    # The command from cron beside a drain's own purge: the other rotates while this one
    # runs; this one must not rotate again over the .1 the other just made.
    store: ControlStore = await asyncplane_store_factory(archive_max_mb=0.001)  # ~1 KiB
    await store.create_project("p", "P")
    ids = await settle(store, "p", 40)
    clock.advance(10)
    archive = store.archive_path
    assert archive is not None
    engine = await store._engine.ready()
    beside: list[Any] = []

    async def the_other_purge() -> None:
        if not beside:  # once, after this purge's first chunk
            beside.append(await store.purge(0, chunk=4))

    this = await _retention.purge(
        engine, store.clock, 0.0, chunk=4, archive_path=archive,
        archive_max_bytes=1024, _after_archive=the_other_purge,
    )  # fmt: skip
    (other,) = beside
    assert other.purged > 0 and this.archive_full
    older = archive.with_name(archive.name + ".1")
    kept = archived_ids(older) + archived_ids(archive)
    gone = set(ids) - {item["item_id"] for item in await store.items(limit=100)}
    assert gone <= set(kept), sorted(gone - set(kept))  # every item deleted is archived


class _OtherPurgeFirst:
    """A store's backend whose first read of candidates waits while another purge runs
    to its end (rotating the archive), as a purge does that waits for the lock."""

    def __init__(self, backend: Any, other: Callable[[], Awaitable[Any]]) -> None:
        self._backend, self._other, self.ran = backend, other, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def purge_candidates(self, *args: Any) -> Any:
        found = await self._backend.purge_candidates(*args)
        if not self.ran:
            self.ran = True
            await self._other()
        return found


async def test_a_purge_never_replaces_a_generation_made_while_it_read_its_first_chunk(
    asyncplane_store_factory: Any, clock: ManualClock, tmp_path: pathlib.Path
) -> None:
    # A purge took the moment it began only in its first locked section: one called
    # before another purge rotated, reading and waiting meanwhile, took that .1 for one
    # made before it began, and rotated over it (the generation before both, lost).
    store: ControlStore = await asyncplane_store_factory(archive_max_mb=0.001)  # ~1 KiB
    await store.create_project("p", "P")
    await settle(store, "p", 40)
    clock.advance(10)
    archive = store.archive_path
    assert archive is not None
    original = '{"archived_at": "ORIGINAL' + "x" * 2000 + '"}\n'
    archive.write_text(original)  # due to rotate
    older = archive.with_name(archive.name + ".1")
    scratch = tmp_path / "tick"

    async def the_other_purge() -> None:
        assert (await store.purge(0, chunk=4)).purged > 0
        assert older.read_text() == original  # it rotated: the generation before, now .1

        def file_clock_moved_on() -> bool:  # past the .1's stamp (coarse: a few ms)
            scratch.touch()
            return scratch.stat().st_mtime > older.stat().st_mtime

        await until(file_clock_moved_on, what="the file system's clock past the rotation")

    engine = await store._engine.ready()
    this = await _retention.purge(
        _OtherPurgeFirst(engine, the_other_purge), store.clock, 0.0, chunk=4,
        archive_path=archive, archive_max_bytes=1024,
    )  # fmt: skip
    assert this.archive_full
    assert older.read_text() == original  # kept: made since this purge began


async def two_due_and_the_archive_lock_held(
    store: ControlStore, clock: ManualClock
) -> tuple[pathlib.Path, pathlib.Path, int]:
    """Two settled items due for a purge, and the archive's lock taken by this test (as
    an operator's flock takes it): the archive, its lock file, the descriptor holding it
    (close it to let go)."""
    import fcntl

    await settle(store, "alpha", 2)
    clock.advance(10)
    archive = store.archive_path
    assert archive is not None
    lock = archive.with_name(archive.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return archive, lock, fd


async def test_a_purge_cancelled_while_it_waits_for_the_archive_lock_stops_waiting(
    store: ControlStore, clock: ManualClock
) -> None:
    # The wait for the lock was inside the section that runs to its end: an operator's
    # flock (moving the .1 aside), or a child that inherited one, held a purge, and the
    # drain() round around it, past every cancel until it let go.
    archive, _, fd = await two_due_and_the_archive_lock_held(store, clock)
    try:
        purging = asyncio.create_task(store.purge(0))

        def in_the_section() -> bool:
            return any(t.get_name() == "asyncplane-purge-archive" for t in asyncio.all_tasks())

        await until(in_the_section, what="the purge waiting for the archive's lock")
        purging.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(purging), 30)
    finally:
        os.close(fd)  # (the purge of the code before waited for this)
        with contextlib.suppress(asyncio.CancelledError):
            await purging
    assert not archive.exists() or archived_ids(archive) == []  # gave up having written nothing
    assert (await store.counts())["done"] == 2
    assert (await store.purge(0)).purged == 2  # and the lock is free again


async def test_a_purge_that_archives_nothing_leaves_no_file(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # Stamping when it began made the archive's lock file, with the purging user's owner:
    # a root cron purge on day one (nothing due yet) left one the fleet's user could not
    # open, and its purges failed once there was something to purge.
    archive = tmp_path / "archives" / "a.jsonl"
    archive.parent.mkdir()
    await settle(store, "alpha", 1)  # settled, but younger than the retention
    assert (await store.purge(3600, archive_path=archive)).purged == 0
    assert list(archive.parent.iterdir()) == []


@pytest.mark.skipif(not pathlib.Path("/proc/locks").exists(), reason="Linux shows its locks")
async def test_a_purge_waits_for_the_archive_lock_in_the_kernel(
    store: ControlStore, clock: ManualClock
) -> None:
    # It tried the lock every 20 ms instead, and lost it again and again to a purge that
    # took it back at once between its chunks (up to 2 s, against 40 ms waiting).
    _, lock, fd = await two_due_and_the_archive_lock_held(store, clock)
    try:
        purging = asyncio.create_task(store.purge(0))
        device, inode = os.stat(lock).st_dev, os.stat(lock).st_ino
        where = f"{os.major(device):02x}:{os.minor(device):02x}:{inode} "

        def waiting_in_the_kernel() -> bool:  # a blocked request: "-> FLOCK ..."
            return any(
                "->" in line and where in line
                for line in pathlib.Path("/proc/locks").read_text().splitlines()
            )

        await until(waiting_in_the_kernel, what="the purge blocked on the lock")
    finally:
        os.close(fd)
    assert (await purging).purged == 2


def test_a_lock_waiter_hands_the_lock_over_or_lets_it_go_never_keeps_it(
    tmp_path: pathlib.Path,
) -> None:
    # It said it was done after letting go of its mutex: an abandon() in between took
    # the wait for given up, and the waiter kept the lock on a descriptor nobody had (every
    # later purge waited for the process to end). Done is now said under the mutex.
    import fcntl

    lock = tmp_path / "a.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    waiter = _retention._LockWaiter(lock)
    said_under_the_mutex: list[bool] = []

    class Done(threading.Event):
        def set(self) -> None:
            said_under_the_mutex.append(waiter._mutex.locked())
            super().set()

    waiter.done = Done()
    waiter.start()
    os.close(fd)  # let go: the waiter has it
    waiter.join(30)
    assert said_under_the_mutex == [True]
    assert not waiter.abandon()  # done first: its descriptor is the caller's
    os.close(waiter.taken())


async def test_purge_checks_its_arguments_before_the_store_is_made(tmp_path: pathlib.Path) -> None:
    # The store was opened (made, or migrated) first, then a bad chunk refused.
    where = tmp_path / "new"
    where.mkdir()
    store = ControlStore(where / "w.db")
    for bad in ({"chunk": 0}, {"chunk": True}, {"progress": "x"}):
        with pytest.raises((InvalidInput, InvalidType)):
            await store.purge(1, **bad)
    assert list(where.iterdir()) == []
    await store.close()


async def test_a_purge_that_rotated_never_rotates_again_whatever_the_clocks_say(
    store: ControlStore, clock: ManualClock, tmp_path: pathlib.Path
) -> None:
    # Its own rotation a purge remembers; only another's is told by the stamps, which a
    # clock stepped back, or a file system keeping times to 2 s, could make look older.
    await settle(store, "alpha", 2)
    clock.advance(10)
    engine = await store._engine.ready()
    found = list(await engine.purge_candidates(clock.now(), 10))
    archive = tmp_path / "a.jsonl"
    archive.write_text('{"archived_at": "' + "x" * 100 + '"}\n')
    later = time.time() + 3600  # the purge "began" an hour after the .1's stamp
    rotation = _retention._Rotation(began=later)
    _retention._archive(archive, found, 10, rotation)  # due, and nothing made since: rotates
    assert rotation.rotated and "x" * 100 in archive.with_name("a.jsonl.1").read_text()
    with pytest.raises(_retention._ArchiveFull):
        _retention._archive(archive, found, 10, rotation)  # its own .1: never again
    assert "x" * 100 in archive.with_name("a.jsonl.1").read_text()


def test_cli_purge_says_where_it_stopped_for_the_archive(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "backlog.db"

    async def seed() -> None:  # settled long ago, by a clock of 2000's
        async with ControlStore(path, clock=ManualClock()) as store:
            await store.create_project("p", "P")
            await settle(store, "p", 40)

    asyncio.run(seed())
    done = cli("purge", str(path), "--retention", "1d", "--chunk", "4",
               "--archive-max-mb", "0.001", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["archive_full"] is True and 0 < said["purged"] < 40
    assert f"move {path}.archive.jsonl.1 aside" in done.stderr
    bad = cli("purge", str(path), "--retention", "1d", "--archive-max-mb", "0")
    assert bad.returncode == 2 and "--archive-max-mb must be a positive" in bad.stderr


async def test_drain_purges_on_a_throttle(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    store: ControlStore = await asyncplane_store_factory(
        retention=0, purge_min_interval_s=3600, purge_chunk=3
    )
    await store.create_project("p", "P")
    for n in range(5):
        await store.enqueue("p", {"n": n})

    async def done(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    first = await drain(store, done, batch_size=5, empty_rounds=2)
    # Round one purged nothing settled yet, and purging is not due again within the hour.
    assert (first.done, first.purged) == (5, 0)
    assert (await store.counts())["done"] == 5
    store._engine._last_purge = None  # as if the interval had passed
    clock.advance(1)  # and the settled items are older than the retention (0 s)
    second = await drain(store, done, empty_rounds=1)
    assert second.purged == 5
    assert (await store.counts())["done"] == 0


def test_a_purge_killed_between_archive_and_delete_loses_nothing(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    path = location_of("crash.db")
    archive = tmp_path / "crash.archive.jsonl"

    async def seed() -> list[int]:
        async with ControlStore(path) as store:
            await store.create_project("p", "P")
            return await settle(store, "p", 7)

    ids = asyncio.run(seed())
    purger = subprocess.Popen(
        [sys.executable, str(PURGER), path, str(archive)], stdout=subprocess.PIPE, text=True
    )
    assert purger.stdout is not None
    assert purger.stdout.readline().strip() == "archived"  # the first chunk is on disk ...
    os.kill(purger.pid, signal.SIGKILL)  # ... and the process dies before deleting it
    purger.wait()
    purger.stdout.close()

    async def check() -> None:
        async with ControlStore(path, archive_path=archive) as store:
            for item_id in ids:
                in_store = True
                try:
                    await store.item(item_id)
                except LookupError:
                    in_store = False
                assert in_store or item_id in archived_ids(archive), item_id
            assert await verify_ledger(store) == []
            again = await store.purge(0)  # finishing the job archives the chunk again
            assert again.purged == 7
        everything = archived_ids(archive)
        assert set(everything) == set(ids)
        assert len(everything) > len(ids)  # duplicates, never losses

    asyncio.run(check())


# --- import --------------------------------------------------------------------------------


def litequeue_like(path: pathlib.Path) -> None:
    """A litequeue-shaped table: status 0 ready, 1 locked, 2 done, 3 failed."""
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE Queue (message_id TEXT PRIMARY KEY, data TEXT, status INTEGER, "
        "in_time INTEGER)"
    )
    rows = [
        ("m1", '{"task": "one"}', 0, 1),
        ("m2", '{"task": "two"}', 1, 2),
        ("m3", '{"task": "old"}', 2, 3),
        ("m4", "plain text message", 0, 4),
        ("m5", '{"task": "lost cause"}', 3, 5),
    ]
    conn.executemany("INSERT INTO Queue VALUES (?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()


def keyed_source(path: pathlib.Path, rows: list[tuple[str, str]]) -> pathlib.Path:
    """A source table ``q`` of (key, body) rows at ``path``: import with
    ``columns={"payload": "body", "key": "k"}``."""
    return source_table(path, KEYED_TABLE, "INSERT INTO q VALUES (?, ?)", rows)


KEYED_TABLE = "CREATE TABLE q (k TEXT PRIMARY KEY, body TEXT)"


def source_table(path: pathlib.Path, create: str, insert: str, rows: list[Any]) -> pathlib.Path:
    """A SQLite file at ``path`` with one table, made by ``create`` and filled with ``rows``
    by ``insert``: an import's source."""
    conn = sqlite3.connect(path)
    conn.execute(create)
    conn.executemany(insert, rows)
    conn.commit()
    conn.close()
    return path


async def test_import_copies_pending_rows_once(store: ControlStore, tmp_path: pathlib.Path) -> None:
    source = tmp_path / "litequeue.sqlite3"
    litequeue_like(source)
    columns = {"payload": "data", "key": "message_id", "state": "status"}
    done = await store.import_pending(
        source, table="Queue", columns=columns, project_id="alpha", pending=[0, 1]
    )
    assert (done.imported, done.already_imported, done.not_pending) == (3, 0, 2)
    payloads = sorted(json.dumps(row["payload"]) for row in await _items(store))
    assert payloads == sorted(
        json.dumps(p) for p in ({"task": "one"}, {"task": "two"}, {"data": "plain text message"})
    )
    first_events = await store.events(1)
    assert first_events[0]["event_type"] == "queued"
    assert first_events[0]["detail"] == {"imported_from": f"{source}::Queue", "source_key": "m1"}
    again = await store.import_pending(
        source, table="Queue", columns=columns, project_id="alpha", pending=[0, 1]
    )
    assert (again.imported, again.already_imported) == (0, 3)
    assert await verify_ledger(store) == []


async def test_an_import_is_keyed_by_its_source_as_named_not_where_a_link_leads(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # The source named through a link to its directory, whose target moves (a disk
    # replaced, the link made again): the same name, the same source, nothing twice.
    (tmp_path / "disk1").mkdir()
    litequeue_like(tmp_path / "disk1" / "q.sqlite3")
    (tmp_path / "data").symlink_to(tmp_path / "disk1")
    source = tmp_path / "data" / "q.sqlite3"
    columns = {"payload": "data", "key": "message_id", "state": "status"}
    first = await store.import_pending(
        source, table="Queue", columns=columns, project_id="alpha", pending=[0, 1]
    )
    (tmp_path / "disk1").rename(tmp_path / "disk2")
    (tmp_path / "data").unlink()
    (tmp_path / "data").symlink_to(tmp_path / "disk2")
    again = await store.import_pending(
        source, table="Queue", columns=columns, project_id="alpha", pending=[0, 1]
    )
    assert (first.imported, again.imported, again.already_imported) == (3, 0, 3)


async def test_an_import_cut_short_resumes_without_duplicates(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = source_table(
        tmp_path / "big.sqlite3", "CREATE TABLE jobs (payload TEXT)",
        "INSERT INTO jobs VALUES (?)", [(json.dumps({"n": n}),) for n in range(10)],
    )  # fmt: skip

    def crash_after_the_first_chunk(seen: int) -> None:
        raise KeyboardInterrupt("the importing process dies")

    with pytest.raises(KeyboardInterrupt):
        await store.import_pending(
            source, table="jobs", columns={"payload": "payload"}, project_id="alpha",
            chunk=4, progress=crash_after_the_first_chunk,
        )  # fmt: skip
    assert (await store.counts())["ready"] == 4  # one chunk committed
    rest = await store.import_pending(
        source, table="jobs", columns={"payload": "payload"}, project_id="alpha", chunk=4
    )
    assert (rest.imported, rest.already_imported) == (6, 4)
    assert sorted(row["payload"]["n"] for row in await _items(store)) == list(range(10))


async def test_import_can_drop_the_source_table(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = tmp_path / "drop.sqlite3"
    litequeue_like(source)
    done = await store.import_pending(
        source, table="Queue", columns={"payload": "data", "state": "status"},
        project_id="alpha", pending=[0], drop_source=True,
    )  # fmt: skip
    assert done.dropped and done.imported == 2
    conn = sqlite3.connect(source)
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []
    conn.close()


async def test_a_pending_number_matches_a_state_column_of_text(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # The command reads `--pending 0` as the number 0; a state column of text holds "0":
    # no row matched, nothing was imported, and --drop-source then dropped every row.
    source = source_table(
        tmp_path / "texts.sqlite3", "CREATE TABLE q (data TEXT, status TEXT)",
        "INSERT INTO q VALUES (?, ?)", [("{}", "0"), ("{}", "1"), ("{}", "2")],
    )  # fmt: skip
    done = await store.import_pending(
        source, table="q", columns={"payload": "data", "state": "status"},
        project_id="alpha", pending=[0, 1], drop_source=True,
    )  # fmt: skip
    assert (done.imported, done.not_pending, done.dropped) == (2, 1, True)


async def test_a_pending_value_no_row_holds_keeps_an_import_from_dropping_anything(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # A state given as the wrong kind (text for an integer column) or misspelt matched no
    # row: nothing was imported, every row counted not pending, and the drop took them all.
    source = tmp_path / "slip.sqlite3"
    litequeue_like(source)
    for pending in (["READY"], [0, "ready"]):  # text, where every state is a number
        with pytest.raises(InvalidInput, match=r"'status' \(the states found: 0, 1, 2, 3"):
            await store.import_pending(
                source, table="Queue", columns={"payload": "data", "state": "status"},
                project_id="alpha", pending=pending, drop_source=True,
            )  # fmt: skip
    conn = sqlite3.connect(source)
    assert conn.execute("SELECT count(*) FROM Queue").fetchone() == (5,)  # all still there
    conn.close()
    assert sum((await store.counts()).values()) == 0  # and nothing imported
    # Without the drop, nothing is at stake: the same values import what they match.
    kept = await store.import_pending(
        source, table="Queue", columns={"payload": "data", "state": "status"},
        project_id="alpha", pending=[0, "ready"],
    )  # fmt: skip
    assert (kept.imported, kept.not_pending, kept.dropped) == (2, 3, False)
    # A state of the right kind that no row holds now (locked, once the workers are
    # stopped) is no slip: the documented [0, 1] imports and drops.
    idle = source_table(
        tmp_path / "idle.sqlite3", "CREATE TABLE Queue (data TEXT, status INTEGER)",
        "INSERT INTO Queue VALUES (?, ?)", [("{}", 0), ("{}", 2)],
    )  # fmt: skip
    dropped = await store.import_pending(
        idle, table="Queue", columns={"payload": "data", "state": "status"},
        project_id="alpha", pending=[0, 1], drop_source=True,
    )  # fmt: skip
    assert (dropped.imported, dropped.not_pending, dropped.dropped) == (1, 1, True)


async def test_an_import_from_the_store_itself_is_refused(tmp_path: pathlib.Path) -> None:
    # Each chunk read the rows the chunk before it had written: it never ended, and
    # filled the disk with copies. (A SQLite store's: the source is a SQLite file.)
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    async with ControlStore(tmp_path / "dir" / "s.db") as store:
        await store.create_project("alpha", "Alpha")
        await store.enqueue("alpha", {"n": 1})
        for name in (tmp_path / "dir" / "s.db", tmp_path / "link" / "s.db"):
            with pytest.raises(InvalidInput, match="this store's own file"):
                await store.import_pending(
                    name, table="items", columns={"payload": "payload"},
                    project_id="alpha", chunk=1,
                )  # fmt: skip
        assert (await store.counts())["ready"] == 1


async def test_an_import_reads_the_rows_there_at_its_start_and_ends(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # A source another program writes to while the import runs: each chunk may find new
    # rows beyond it, so a run ends where the table ended when it began.
    source = source_table(
        tmp_path / "growing.sqlite3", "CREATE TABLE jobs (payload TEXT)",
        "INSERT INTO jobs VALUES (?)", [(json.dumps({"n": n}),) for n in range(4)],
    )  # fmt: skip
    writer = sqlite3.connect(source, isolation_level=None)

    def another_row_each_chunk(seen: int) -> None:
        writer.execute("INSERT INTO jobs VALUES (?)", (json.dumps({"n": 100 + seen}),))

    try:
        first = await store.import_pending(
            source, table="jobs", columns={"payload": "payload"}, project_id="alpha",
            chunk=1, progress=another_row_each_chunk,
        )  # fmt: skip
    finally:
        writer.close()
    assert (first.imported, first.already_imported) == (4, 0)
    then = await store.import_pending(
        source, table="jobs", columns={"payload": "payload"}, project_id="alpha", chunk=10
    )
    assert (then.imported, then.already_imported) == (4, 4)  # the rows added meanwhile


async def test_a_source_written_to_while_it_is_imported_is_not_dropped(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # A row written after the import's last read went with the table, never imported.
    # (Keys never given again: a second run may drop it, see the test after.)
    source = source_table(
        tmp_path / "busy.sqlite3",
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, payload TEXT)",
        "INSERT INTO jobs (payload) VALUES (?)", [(json.dumps({"n": n}),) for n in range(5)],
    )  # fmt: skip
    columns = {"payload": "payload", "key": "id"}

    def a_producer_writes(seen: int) -> None:
        conn = sqlite3.connect(source)
        conn.execute("INSERT INTO jobs (payload) VALUES ('{\"n\": 99}')")
        conn.commit()
        conn.close()

    with pytest.raises(InvalidInput, match="was not dropped"):
        await store.import_pending(
            source, table="jobs", columns=columns, project_id="alpha",
            drop_source=True, progress=a_producer_writes,
        )  # fmt: skip
    conn = sqlite3.connect(source)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (6,)  # nothing lost
    conn.close()
    again = await store.import_pending(
        source, table="jobs", columns=columns, project_id="alpha", drop_source=True
    )
    assert (again.imported, again.already_imported, again.dropped) == (1, 5, True)


@pytest.mark.parametrize("taken", [1, 4])
async def test_a_row_swapped_in_while_it_is_imported_keeps_the_source_table(
    store: ControlStore, tmp_path: pathlib.Path, taken: int
) -> None:
    # The old queue's consumer takes a row while its producer adds one: the count is as it
    # was (a drop that counted rows dropped the new one, never imported), and when the row
    # taken was the last, SQLite gives the new one its rowid (a drop that looked for keys
    # not imported found none).
    source = source_table(
        tmp_path / "swap.sqlite3", "CREATE TABLE jobs (payload TEXT)",
        "INSERT INTO jobs VALUES (?)", [(json.dumps({"n": n}),) for n in range(4)],
    )  # fmt: skip

    def consumer_and_producer(seen: int) -> None:
        conn = sqlite3.connect(source)
        conn.execute("DELETE FROM jobs WHERE rowid = ?", (taken,))
        conn.execute('INSERT INTO jobs VALUES (\'{"n": "new"}\')')
        conn.commit()
        conn.close()

    with pytest.raises(InvalidInput, match="changed while the import ran"):
        await store.import_pending(
            source, table="jobs", columns={"payload": "payload"}, project_id="alpha",
            drop_source=True, progress=consumer_and_producer,
        )  # fmt: skip
    conn = sqlite3.connect(source)
    assert ('{"n": "new"}',) in conn.execute("SELECT payload FROM jobs").fetchall()
    conn.close()
    # The next run passes over the rows it took before by their rowids, which SQLite may
    # have given to new rows (here, when the last was taken): it never drops the table.
    with pytest.raises(InvalidInput, match="passed over as imported before"):
        await store.import_pending(
            source, table="jobs", columns={"payload": "payload"}, project_id="alpha",
            drop_source=True,
        )  # fmt: skip
    conn = sqlite3.connect(source)
    assert ('{"n": "new"}',) in conn.execute("SELECT payload FROM jobs").fetchall()
    conn.close()


async def test_a_rerun_says_when_a_row_it_passes_over_may_be_another(
    store: ControlStore, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A taken row's rowid given to a new row: with other content, the new row is
    # imported (it was passed over as imported before); with the same content, it cannot
    # be told from the taken one, and the run says so.
    source = source_table(
        tmp_path / "again.sqlite3", "CREATE TABLE jobs (payload TEXT)",
        "INSERT INTO jobs VALUES (?)", [(json.dumps({"n": n}),) for n in range(3)],
    )  # fmt: skip
    columns = {"payload": "payload"}
    await store.import_pending(source, table="jobs", columns=columns, project_id="alpha")
    conn = sqlite3.connect(source)
    conn.execute("DELETE FROM jobs WHERE rowid = 3")
    conn.execute('INSERT INTO jobs VALUES (\'{"n": "new"}\')')  # rowid 3 again
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="asyncplane.import"):
        again = await store.import_pending(
            source, table="jobs", columns=columns, project_id="alpha"
        )
    assert (again.imported, again.already_imported, again.changed) == (1, 2, 1)
    assert (await store.item(4))["payload"] == {"n": "new"}
    assert any("with another payload" in r.getMessage() for r in caplog.records)
    conn = sqlite3.connect(source)
    conn.execute("DELETE FROM jobs WHERE rowid = 3")
    conn.execute('INSERT INTO jobs VALUES (\'{"n": "new"}\')')  # its twin, rowid 3 again
    conn.commit()
    conn.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncplane.import"):
        third = await store.import_pending(
            source, table="jobs", columns=columns, project_id="alpha"
        )
    assert (third.imported, third.already_imported, third.changed) == (0, 3, 0)
    assert any("with the same payload, may be among them" in r.getMessage() for r in caplog.records)


async def test_a_source_table_made_again_is_imported_again(
    store: ControlStore, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The import dropped the old queue's table; the old queue, started once more, made it
    # again, and its AUTOINCREMENT ids began at 1 again. Those rows were passed over as
    # imported before, and a drop lost them.
    create = "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, body TEXT)"
    insert = "INSERT INTO jobs (body) VALUES (?)"
    source = source_table(
        tmp_path / "old.sqlite3", create, insert, [(json.dumps({"old": n}),) for n in range(3)]
    )
    columns = {"payload": "body", "key": "id"}
    first = await store.import_pending(
        source, table="jobs", columns=columns, project_id="alpha", drop_source=True
    )
    assert (first.imported, first.dropped) == (3, True)
    conn = sqlite3.connect(source)
    conn.execute(create)
    conn.executemany(insert, [(json.dumps({"new": n}),) for n in range(4)])
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="asyncplane.import"):
        second = await store.import_pending(
            source, table="jobs", columns=columns, project_id="alpha", drop_source=True
        )
    assert (second.imported, second.already_imported, second.changed, second.dropped) == (
        4, 0, 3, True,
    )  # fmt: skip
    assert [row["payload"] for row in await _items(store)] == [
        {"old": 0}, {"old": 1}, {"old": 2}, {"new": 0}, {"new": 1}, {"new": 2}, {"new": 3},
    ]  # fmt: skip
    queued = (await store.events(4))[0]["detail"]
    assert queued == {
        "imported_from": f"{source}::jobs",
        "source_key": "1",
        "replaces_import_of": 1,
    }
    assert (await store.events(7))[0]["detail"] == {
        "imported_from": f"{source}::jobs",
        "source_key": "4",
    }
    said = [r.getMessage() for r in caplog.records]
    assert any("3 row(s)" in m and "before an import dropped" in m for m in said), said
    # Made again once more after that drop: every row is a new one, the same payloads
    # too; and a rerun with no drop between passes over what the records now name.
    conn = sqlite3.connect(source)
    conn.execute(create)
    conn.executemany(insert, [(json.dumps({"new": n}),) for n in range(4)])
    conn.commit()
    conn.close()
    third = await store.import_pending(source, table="jobs", columns=columns, project_id="alpha")
    assert (third.imported, third.already_imported, third.changed) == (4, 0, 4)
    fourth = await store.import_pending(source, table="jobs", columns=columns, project_id="alpha")
    assert (fourth.imported, fourth.already_imported) == (0, 4)
    assert await verify_ledger(store) == []


async def test_a_row_of_a_table_made_again_after_a_drop_is_imported_whatever_it_holds(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # A periodic job's row, the same payload under the same key in the table made again
    # after the import dropped it: passed over as imported before, and dropped, unrun.
    create = KEYED_TABLE
    insert = "INSERT INTO q VALUES (?, ?)"
    source = source_table(tmp_path / "daily.sqlite3", create, insert, [("1", '{"job": 0}')])
    columns = {"payload": "body", "key": "k"}
    first = await store.import_pending(
        source, table="q", columns=columns, project_id="alpha", drop_source=True
    )
    assert (first.imported, first.dropped) == (1, True)
    source_table(source, create, insert, [("1", '{"job": 0}'), ("2", '{"job": 99}')])
    second = await store.import_pending(
        source, table="q", columns=columns, project_id="alpha", drop_source=True
    )
    assert (second.imported, second.already_imported, second.changed) == (2, 0, 1)
    assert [row["payload"] for row in await _items(store)] == [
        {"job": 0}, {"job": 0}, {"job": 99},
    ]  # fmt: skip
    # Once more, not dropped this time: the records since name the new items.
    source_table(source, create, insert, [("1", '{"job": 0}')])
    third = await store.import_pending(source, table="q", columns=columns, project_id="alpha")
    assert (third.imported, third.changed) == (1, 1)
    fourth = await store.import_pending(source, table="q", columns=columns, project_id="alpha")
    assert (fourth.imported, fourth.already_imported) == (0, 1)


async def test_an_import_whose_source_another_import_dropped_meanwhile_imports_nothing_twice(
    store: ControlStore, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # B read its chunk; A imported the same rows, dropped the table and recorded it; B's
    # chunk, written then, was taken for rows of a table made since: imported twice.
    import threading

    from asyncplane import _import

    source = keyed_source(
        tmp_path / "both.sqlite3", [(str(n), json.dumps({"n": n})) for n in range(3)]
    )
    columns = {"payload": "body", "key": "k"}
    read, go_on = threading.Event(), threading.Event()
    reads = _import._read_chunk

    def b_waits_after_its_read(*args: Any) -> Any:
        rows = reads(*args)
        if not read.is_set():  # B's (the first) read: it waits for A
            read.set()
            assert go_on.wait(60)
        return rows

    monkeypatch.setattr(_import, "_read_chunk", b_waits_after_its_read)
    b = asyncio.create_task(
        store.import_pending(source, table="q", columns=columns, project_id="alpha")
    )
    await asyncio.to_thread(read.wait, 60)
    a = await store.import_pending(
        source, table="q", columns=columns, project_id="alpha", drop_source=True
    )
    assert (a.imported, a.dropped) == (3, True)
    go_on.set()
    with pytest.raises(InvalidInput, match="another import dropped"):
        await b
    assert sum((await store.counts()).values()) == 3
    assert await verify_ledger(store) == []


async def test_a_drop_the_store_fails_to_record_says_the_table_is_gone(
    store: ControlStore, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store failed just after the drop: the caller heard the store's error alone, as
    # if nothing had happened, and a rerun said only "no table".
    from asyncplane import StorageError
    from asyncplane._store import engine_of

    source = keyed_source(tmp_path / "gone.sqlite3", [("1", "{}")])
    backend = await engine_of(store).ready()

    async def fails(source: str) -> None:
        raise StorageError("disk I/O error")

    monkeypatch.setattr(backend, "record_source_dropped", fails)
    with pytest.raises(StorageError, match="q was dropped, every row imported, but the store"):
        await store.import_pending(
            source, table="q", columns={"payload": "body", "key": "k"}, project_id="alpha",
            drop_source=True,
        )  # fmt: skip
    assert (await store.counts())["ready"] == 1


async def test_a_cancel_as_the_drop_runs_still_records_the_drop(
    store: ControlStore, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The drop runs to its end on its thread, and the cancel came at the record's write,
    # which was then never made: a table made again there was told apart by payload
    # alone, and its row with the same payload was passed over.
    import threading

    from asyncplane import _import
    from asyncplane._store import engine_of

    source = keyed_source(tmp_path / "cut.sqlite3", [("1", "{}")])
    dropping, go_on = threading.Event(), threading.Event()
    drops = _import._Watch.drop

    def held_drop(self: Any, table: str) -> None:
        dropping.set()
        assert go_on.wait(60)
        drops(self, table)

    monkeypatch.setattr(_import._Watch, "drop", held_drop)
    importing = asyncio.create_task(
        store.import_pending(source, table="q", columns={"payload": "body", "key": "k"},
                             project_id="alpha", drop_source=True)
    )  # fmt: skip
    await asyncio.to_thread(dropping.wait, 60)
    importing.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await importing
    backend = await engine_of(store).ready()
    assert await backend.source_dropped_up_to(f"{source}::q") == 1


async def test_a_rerun_that_maps_another_column_passes_over_what_it_imported(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # The digest of every mapped column: a priority mapped on the second run made every
    # row "other content", and each ran twice.
    source = source_table(
        tmp_path / "prio.sqlite3", "CREATE TABLE q (k TEXT PRIMARY KEY, body TEXT, p INT)",
        "INSERT INTO q VALUES (?, ?, ?)", [("a", '{"v": 1}', 5), ("b", '{"v": 2}', 7)],
    )  # fmt: skip
    columns = {"payload": "body", "key": "k"}
    await store.import_pending(source, table="q", columns=columns, project_id="alpha")
    again = await store.import_pending(
        source, table="q", columns={**columns, "priority": "p"}, project_id="alpha"
    )
    assert (again.imported, again.already_imported, again.changed) == (0, 2, 0)


async def test_an_import_recorded_before_contents_were_passes_over_by_key(
    store: ControlStore, tmp_path: pathlib.Path, raw: Any
) -> None:
    # A record from before a digest was kept (an earlier release's) says nothing of the
    # content: its key is passed over, as that release did, and the record stays as it is.
    source = keyed_source(tmp_path / "legacy.sqlite3", [("a", '{"v": 1}'), ("b", '{"v": 2}')])
    columns = {"payload": "body", "key": "k"}
    await store.import_pending(source, table="q", columns=columns, project_id="alpha")
    raw.execute("UPDATE imports SET digest = NULL WHERE source_key = ?", ("a",))
    conn = sqlite3.connect(source)
    conn.execute("UPDATE q SET body = '{\"v\": 10}'")
    conn.commit()
    conn.close()
    again = await store.import_pending(source, table="q", columns=columns, project_id="alpha")
    assert (again.imported, again.already_imported, again.changed) == (1, 1, 1)
    assert [row["payload"] for row in await _items(store)] == [{"v": 1}, {"v": 2}, {"v": 10}]
    assert (await store.events(3))[0]["detail"]["source_key"] == "b"


def test_a_store_of_the_previous_version_keeps_its_import_records(
    tmp_path: pathlib.Path,
) -> None:
    # Migration 13 adds the digest to a version-12 store's records, empty: their keys
    # are passed over as before.
    path = tmp_path / "v12.db"
    source = keyed_source(tmp_path / "q.sqlite3", [("a", '{"v": 1}')])
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for script in sql.MIGRATIONS[:12]:
            for statement in _sqlite._statements(script):
                conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {sql.APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 12")
        conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
        conn.execute("INSERT INTO imports VALUES (?, 'a', 1, 0)", (f"{source}::q",))

    async def run() -> ImportSummary:
        async with ControlStore(path) as store:
            return await store.import_pending(
                source, table="q", columns={"payload": "body", "key": "k"}, project_id="p"
            )

    done = asyncio.run(run())
    assert (done.imported, done.already_imported) == (0, 1)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
        assert conn.execute("SELECT source_key, digest FROM imports").fetchall() == [("a", None)]


async def test_a_column_of_numbers_matches_plain_decimals_only(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = source_table(
        tmp_path / "states.sqlite3", "CREATE TABLE q (d TEXT, s INTEGER)",
        "INSERT INTO q VALUES (?, ?)", [("{}", 10), ("{}", 1), ("{}", 1000)],
    )  # fmt: skip
    done = await store.import_pending(
        source, table="q", columns={"payload": "d", "state": "s"}, project_id="alpha",
        pending=["1_0", "+1", "1e3"],
    )  # fmt: skip
    assert (done.imported, done.not_pending) == (1, 2)  # "+1" only: 1_0 and 1e3 are not


async def test_a_second_run_drops_a_table_whose_keys_are_never_given_again(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = source_table(
        tmp_path / "auto.sqlite3",
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, payload TEXT)",
        "INSERT INTO jobs (payload) VALUES (?)", [(json.dumps({"n": n}),) for n in range(3)],
    )  # fmt: skip
    first = await store.import_pending(
        source, table="jobs", columns={"payload": "payload", "key": "id"}, project_id="alpha"
    )
    conn = sqlite3.connect(source)
    conn.execute("DELETE FROM jobs WHERE id = 3")
    conn.execute('INSERT INTO jobs (payload) VALUES (\'{"n": "new"}\')')  # id 4
    conn.commit()
    conn.close()
    again = await store.import_pending(
        source, table="jobs", columns={"payload": "payload", "key": "id"}, project_id="alpha",
        drop_source=True,
    )  # fmt: skip
    assert (first.imported, again.imported, again.already_imported, again.dropped) == (
        3, 1, 2, True,
    )  # fmt: skip
    payloads = sorted(str(row["payload"]["n"]) for row in await _items(store))
    assert payloads == ["0", "1", "2", "new"]


async def test_an_import_cut_short_before_its_drop_leaves_the_source_whole(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = source_table(
        tmp_path / "cut.sqlite3", "CREATE TABLE jobs (payload TEXT)",
        "INSERT INTO jobs VALUES (?)", [("{}",) for _ in range(3)],
    )  # fmt: skip

    def cut_short(seen: int) -> None:
        raise KeyboardInterrupt("the importing process is stopped")

    with pytest.raises(KeyboardInterrupt):
        await store.import_pending(
            source, table="jobs", columns={"payload": "payload"}, project_id="alpha",
            drop_source=True, progress=cut_short,
        )  # fmt: skip
    conn = sqlite3.connect(source, timeout=0)  # nothing holds the file
    conn.execute("INSERT INTO jobs VALUES ('{}')")
    conn.commit()
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (4,)
    conn.close()


async def test_import_refuses_what_it_cannot_copy_faithfully(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = tmp_path / "odd.sqlite3"
    conn = sqlite3.connect(source)
    conn.execute("CREATE TABLE pq (_id INTEGER PRIMARY KEY, data BLOB)")
    conn.execute("INSERT INTO pq (data) VALUES (?)", (b"\x80\x04pickled",))
    conn.commit()
    conn.close()
    with pytest.raises(InvalidPayload, match="binary payload"):
        await store.import_pending(
            source, table="pq", columns={"payload": "data"}, project_id="alpha"
        )
    with pytest.raises(InvalidInput, match="no column 'nope'"):
        await store.import_pending(
            source, table="pq", columns={"payload": "nope"}, project_id="alpha"
        )
    with pytest.raises(InvalidInput, match="no table"):
        await store.import_pending(
            source, table='pq"; DROP TABLE pq; --', columns={"payload": "data"}, project_id="alpha"
        )
    with pytest.raises(InvalidInput, match="go together"):
        await store.import_pending(
            source, table="pq", columns={"payload": "data", "state": "_id"}, project_id="alpha"
        )
    with pytest.raises(InvalidInput, match="no source database"):
        await store.import_pending(
            tmp_path / "missing.db", table="pq", columns={"payload": "data"}, project_id="alpha"
        )
    assert await store.counts() == dict.fromkeys(await store.counts(), 0)


async def test_import_keeps_as_text_what_json_reads_but_holds_no_number_for(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # Python's json reads NaN, Infinity and 1e999; a payload holds none of them.
    texts = ["hello", "NaN", "-Infinity", "1e999", '{"x": 1e999}', '{"x": 1.5}']
    source = source_table(
        tmp_path / "odd_numbers.sqlite3", "CREATE TABLE jobs (id INTEGER PRIMARY KEY, data TEXT)",
        "INSERT INTO jobs (data) VALUES (?)", [(t,) for t in texts],
    )  # fmt: skip
    done = await store.import_pending(
        source, table="jobs", columns={"payload": "data"}, project_id="alpha"
    )
    assert done.imported == len(texts)
    assert [row["payload"] for row in await _items(store)] == [
        *({"data": text} for text in texts[:-1]), {"x": 1.5},
    ]  # fmt: skip


async def test_an_import_row_for_a_missing_project_names_itself_and_writes_nothing_of_its_chunk(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = source_table(
        tmp_path / "projects.sqlite3",
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY, data TEXT, proj TEXT)",
        "INSERT INTO jobs (data, proj) VALUES (?, ?)", [("{}", "alpha"), ("{}", "nope")],
    )  # fmt: skip
    columns = {"payload": "data", "key": "id", "project_id": "proj"}
    with pytest.raises(UnknownProject, match="source row 2: no project 'nope'"):
        await store.import_pending(source, table="jobs", columns=columns)
    assert sum((await store.counts()).values()) == 0
    await store.create_project("nope", "Made since")  # looked for again: now it is there
    assert (await store.import_pending(source, table="jobs", columns=columns)).imported == 2


async def _items(store: ControlStore) -> list[dict[str, Any]]:
    total = sum((await store.counts()).values())
    return [await store.item(i) for i in range(1, total + 1)]


# --- stats ---------------------------------------------------------------------------------


async def test_stats_describe_the_store(store: ControlStore, clock: ManualClock) -> None:
    await store.create_project("beta", "Beta")
    await store.enqueue("alpha", {})
    clock.advance(120)
    await store.enqueue("beta", {})
    held = await store.claim("w", project_id="beta")
    assert held is not None
    await store.enqueue("beta", {})
    offloaded = await store.claim("w", project_id="beta")
    assert offloaded is not None
    await store.offload(offloaded.item_id, fence=offloaded.fence, handle="h")
    clock.advance(store.lease_seconds + 30)
    stats = await store.stats()
    assert stats["items"] == 3
    assert stats["states"]["ready"] == 1 and stats["states"]["claimed"] == 1
    assert stats["projects"]["alpha"]["ready"] == 1
    assert stats["projects"]["beta"]["claimed"] == 1
    assert stats["oldest_ready_age_s"] == pytest.approx(120 + store.lease_seconds + 30)
    assert stats["expired_leases"] == 1
    assert stats["offloaded"] == 1
    assert stats["database_bytes"] > 0 and stats["wal_bytes"] >= 0
    if store.backend == "postgresql":
        from asyncplane import _postgres_sql

        assert stats["schema_version"] == _postgres_sql.SCHEMA_VERSION
    else:
        assert stats["schema_version"] == sql.SCHEMA_VERSION


async def test_stats_of_a_process_whose_store_a_newer_release_migrated(
    store: ControlStore, raw: Any
) -> None:
    # A rolling upgrade: a process of the release before goes on working, and its
    # stats() (the dashboard's every look) says the newer version, on both backends.
    if store.backend == "postgresql":
        raw.execute("UPDATE asyncplane_meta SET value = '999' WHERE key = 'schema_version'")
    else:
        raw.execute("PRAGMA user_version = 999")
    assert (await store.stats())["schema_version"] == 999
    await store.enqueue("alpha", {})
    assert await store.claim("w") is not None


def test_the_docs_give_this_releases_schema_versions() -> None:
    # The docs say which schema version this release writes, on each backend, and show
    # it in the stats' sample output.
    from asyncplane import _postgres_sql

    docs = pathlib.Path(__file__).parent.parent / "docs"
    versions = (sql.SCHEMA_VERSION, _postgres_sql.SCHEMA_VERSION)
    operating, architecture = (
        " ".join((docs / page).read_text().split()) for page in ("operating.md", "architecture.md")
    )
    assert f"({versions[0]} in this release on SQLite, {versions[1]} on PostgreSQL;" in operating
    assert (
        f"({versions[0]} in this release; a PostgreSQL schema keeps its version, {versions[1]},"
        in architecture
    )
    for page in ("operating.md", "cli.md"):
        text = (docs / page).read_text()
        samples = re.findall(r'"schema_version": (\d+)', text) + re.findall(
            r"\(schema (\d+)\)", text
        )
        assert samples and all(int(n) == versions[0] for n in samples), (page, samples)
    # and the refusal of a store from a newer release, one version ahead
    newer = re.findall(
        r"schema version (\d+); this asyncplane knows versions up to (\d+)",
        (docs / "cli.md").read_text(),
    )
    assert newer == [(str(versions[0] + 1), str(versions[0]))], newer


# --- the command line ----------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncplane.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("verb", ["worker", "dashboard"])
def test_the_verbs_that_run_until_stopped_refuse_json(tmp_path: pathlib.Path, verb: str) -> None:
    # They print no result to shape, so --json is a usage error, not a flag ignored.
    args = ["mod:handle"] if verb == "worker" else []
    done = cli(verb, str(tmp_path / "none.db"), *args, "--json")
    assert done.returncode == 2
    assert "unrecognized arguments: --json" in done.stderr


@pytest.mark.parametrize("before", [["--json"], ["--bogus"]])
def test_an_option_before_the_verb_is_a_usage_error(
    tmp_path: pathlib.Path, before: list[str]
) -> None:
    # Read by no one there, so refused rather than dropped.
    path = tmp_path / "cli.db"

    async def made() -> None:
        async with ControlStore(path) as store:
            await store.create_project("p", "P")

    asyncio.run(made())
    done = cli(*before, "stats", str(path))
    assert done.returncode == 2
    assert f"options go after the verb: stats {before[0]}" in done.stderr
    assert done.stdout == ""


def test_cli_verbs_with_json(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "cli.db"

    async def seed() -> None:
        async with ControlStore(path) as store:
            await store.create_project("p", "P")
            await settle(store, "p", 2)
            await store.enqueue("p", {"left": True})

    asyncio.run(seed())
    stats = cli("stats", str(path), "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["states"]["done"] == 2
    assert "project p: ready 1, done 2" in cli("stats", str(path)).stdout
    verify = cli("verify", str(path), "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout) == {"problems": [], "clean": True}
    events = cli("events", str(path), "1", "--json")
    assert [e["event_type"] for e in json.loads(events.stdout)["events"]] == [
        "queued", "claimed", "done",
    ]  # fmt: skip
    assert "claimed" in cli("events", str(path), "1").stdout
    purge = cli("purge", str(path), "--retention", "0s", "--json")
    assert purge.returncode == 0, purge.stderr
    assert json.loads(purge.stdout)["purged"] == 2
    source = tmp_path / "src.sqlite3"
    litequeue_like(source)
    imported = cli(
        "import", str(path), "--from", str(source), "--table", "Queue", "--column", "payload=data",
        "--column", "state=status", "--pending", "0", "--project", "p", "--json",
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    # A source row of a type the store refuses (a text priority), or a source that is
    # not SQLite: the user's to fix (2), not a store that failed (3).
    typed = source_table(
        tmp_path / "typed.sqlite3", "CREATE TABLE t (k TEXT PRIMARY KEY, p TEXT, d TEXT)",
        "INSERT INTO t VALUES (?, ?, ?)", [("a", "high", '{"n": 1}')],
    )  # fmt: skip
    for source_args in (
        ["--from", str(typed), "--table", "t", "--column", "key=k", "--column", "priority=p",
         "--column", "payload=d"],
        ["--from", str(tmp_path / "not.sqlite3"), "--table", "t", "--column", "payload=d"],
    ):  # fmt: skip
        (tmp_path / "not.sqlite3").write_bytes(b"plain text, not a database" * 10)
        refused = cli("import", str(path), *source_args, "--project", "p")
        assert refused.returncode == 2, refused.stderr
    assert "--from" in refused.stderr
    assert json.loads(imported.stdout)["imported"] == 2
    with contextlib.closing(sqlite3.connect(source)) as conn:
        conn.execute('UPDATE Queue SET data = \'{"task": "rewritten"}\' WHERE status = 0')
        conn.commit()
    rewritten = cli(
        "import", str(path), "--from", str(source), "--table", "Queue", "--column", "payload=data",
        "--column", "state=status", "--pending", "0", "--project", "p",
    )  # fmt: skip
    assert rewritten.returncode == 0, rewritten.stderr
    assert "imported 2 pending rows from" in rewritten.stdout
    assert "2 of them changed since an earlier run" in rewritten.stdout
    # --pending as typed too: a state column of text holding "01" (the number 1 would
    # match none, and --drop-source then dropped the pending rows unimported).
    padded = source_table(
        tmp_path / "padded.sqlite3", "CREATE TABLE q (d TEXT, s TEXT)",
        "INSERT INTO q VALUES (?, ?)", [("{}", "01"), ("{}", "01"), ("{}", "09"), ("{}", "1")],
    )  # fmt: skip
    taken = cli(
        "import", str(path), "--from", str(padded), "--table", "q", "--column", "payload=d",
        "--column", "state=s", "--pending", "01", "--project", "p", "--drop-source", "--json",
    )  # fmt: skip
    assert taken.returncode == 0, taken.stderr
    # ("1" is another state: "01" is not read as the number 1)
    assert (json.loads(taken.stdout)["imported"], json.loads(taken.stdout)["not_pending"]) == (
        2, 2,
    )  # fmt: skip
    # A column of numbers matches the number a value reads as, however it is written.
    numbers = source_table(
        tmp_path / "numbers.sqlite3", "CREATE TABLE q (d TEXT, s INTEGER)",
        "INSERT INTO q VALUES (?, ?)", [("{}", 1), ("{}", 1), ("{}", 2)],
    )  # fmt: skip
    plus = cli(
        "import", str(path), "--from", str(numbers), "--table", "q", "--column", "payload=d",
        "--column", "state=s", "--pending", "+1", "--project", "p", "--json",
    )  # fmt: skip
    assert (json.loads(plus.stdout)["imported"], json.loads(plus.stdout)["not_pending"]) == (
        2, 1,
    )  # fmt: skip


def test_cli_verify_fails_on_a_tampered_ledger(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.db"

    async def seed() -> None:
        async with ControlStore(path) as store:
            await store.create_project("p", "P")
            await settle(store, "p", 1)

    asyncio.run(seed())
    conn = sqlite3.connect(path)
    conn.execute("UPDATE items SET state = 'failed'")
    conn.commit()
    conn.close()
    verify = cli("verify", str(path))
    assert verify.returncode == 1
    assert "terminal_events_disagree: item 1" in verify.stdout
    assert json.loads(cli("verify", str(path), "--json").stdout)["problems"][0]["item_id"] == 1


def test_cli_refuses_files_it_must_not_touch(tmp_path: pathlib.Path) -> None:
    missing = cli("stats", str(tmp_path / "missing.db"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert not (tmp_path / "missing.db").exists()  # not created by looking at it
    foreign = tmp_path / "other.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE invoices (id INTEGER)")
    conn.commit()
    conn.close()
    not_ours = cli("verify", str(foreign))
    assert not_ours.returncode == 2 and "not an asyncplane store" in not_ours.stderr
    newer = tmp_path / "newer.db"

    async def make() -> None:
        async with ControlStore(newer) as store:
            await store.projects()

    asyncio.run(make())
    conn = sqlite3.connect(newer)
    conn.execute(f"PRAGMA user_version = {sql.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    too_new = cli("stats", str(newer), "--json")
    assert too_new.returncode == 2 and "upgrade asyncplane" in too_new.stderr
    # The dashboard too: a version to upgrade to is the user's to fix (2), not a failing
    # disk or server (3).
    served = cli("dashboard", str(newer), "--port", "0")
    assert served.returncode == 2 and "upgrade asyncplane" in served.stderr, served.stderr
    older = tmp_path / "older.db"
    shutil.copyfile(newer, older)
    conn = sqlite3.connect(older)
    conn.execute(f"PRAGMA user_version = {sql.SCHEMA_VERSION - 1}")
    conn.commit()
    conn.close()
    for verb in (("stats",), ("items",), ("dashboard", "--port", "0")):
        looked = cli(verb[0], str(older), *verb[1:])
        assert looked.returncode == 2, (verb, looked.stderr)
        # in the command's words, not the library's (read_only is a keyword, not a flag)
        assert "needs migrating" in looked.stderr and "run a verb that writes" in looked.stderr
        assert "read_only" not in looked.stderr
    unknown = cli("events", str(newer.with_name("missing2.db")), "3")
    assert unknown.returncode == 2
    bad_usage = cli("purge", str(newer), "--retention", "soon")
    assert bad_usage.returncode == 2 and "not a duration" in bad_usage.stderr
    for endless in ("99999999999999w", "100000000000000000000"):  # past timedelta's range
        too_long = cli("purge", str(newer), "--retention", endless)
        assert too_long.returncode == 2 and "a duration too long" in too_long.stderr
    # Refused before the store is opened: nothing made, nothing migrated.
    fresh = tmp_path / "fresh.db"
    source = source_table(
        tmp_path / "source.db", "CREATE TABLE t (d TEXT, s INTEGER)",
        "INSERT INTO t VALUES (?, ?)", [("{}", 0)],
    )  # fmt: skip
    for verb in (
        ("copy", str(older), str(fresh), "--chunk", "0"),
        ("purge", str(older), "--retention", "1d", "--chunk", "0"),
        ("import", str(older), "--from", str(tmp_path / "gone.db"), "--table", "t",
         "--column", "payload=d", "--project", "p"),
        ("import", str(older), "--from", str(tmp_path / ("x" * 300)), "--table", "t",
         "--column", "payload=d", "--project", "p"),
        # The mapping and the source's table and columns too (they migrated the store).
        ("import", str(older), "--from", str(source), "--table", "t", "--column", "payload=d",
         "--column", "bogus=d", "--project", "p"),
        ("import", str(older), "--from", str(source), "--table", "t", "--column", "payload",
         "--project", "p"),
        ("import", str(older), "--from", str(source), "--table", "t",
         "--column", "payload=nosuch", "--project", "p"),
        ("import", str(older), "--from", str(source), "--table", "nosuch",
         "--column", "payload=d", "--project", "p"),
        ("import", str(older), "--from", str(source), "--table", "t", "--column", "payload=d",
         "--column", "state=s", "--project", "p"),
        # A schedule's payload of NaN, a name given with --pause/--resume/--delete, a
        # project a limits change names: refused only by the store, once opened (hunt).
        ("schedule", str(older), "s1", "--project", "p", "--every", "5m",
         "--payload", '{"a": NaN}'),
        ("schedule", str(older), "s1", "--project", "p", "--every", "5m",
         "--payload", '{"a": 1e999}'),
        ("enqueue", str(older), "p", "--payload", '{"a": Infinity}'),
        ("enqueue", str(older), "p", "--payload", '{"a": ' + "[" * 30_000 + "]" * 30_000 + "}"),
        ("schedule", str(older), "", "--pause"),
        ("schedule", str(older), "a\x01", "--delete"),
        ("limits", str(older), "", "--max-running", "3"),
        ("limits", str(older), "p\x07", "--max-running", "3"),
    ):  # fmt: skip
        refused = cli(*verb)
        assert refused.returncode == 2, (verb, refused.stderr)
        assert any(
            said in refused.stderr
            for said in ("--chunk must", "no such file", "--from", "unknown fields",
                         "FIELD=COLUMN", "has no column", "no table", "go together",
                         "not JSON", "not a finite number", "must not be empty", "too deep",
                         "control characters")
        ), refused.stderr  # fmt: skip
    assert not fresh.exists()
    assert cli("init", str(tmp_path / "ok.db")).returncode == 0
    nowhere = cli("copy", str(tmp_path / "ok.db"), str(tmp_path / "no" / "such" / "dir.db"))
    assert nowhere.returncode == 2, nowhere.stderr  # a path mistake, as init's (was 3)
    assert "no such directory for the destination" in nowhere.stderr
    conn = sqlite3.connect(older)
    assert conn.execute("PRAGMA user_version").fetchone() == (sql.SCHEMA_VERSION - 1,)
    conn.close()


# --- hardening -----------------------------------------------------------------------------


async def test_a_purge_cancelled_in_its_locked_section_lets_the_lock_go_only_after_it(
    store: ControlStore, clock: ManualClock
) -> None:
    # The section's worker thread cannot be stopped: a lock let go under it would let
    # another purge append (or cut a "torn" end) beside a write still going on.
    await settle(store, "alpha", 2)
    clock.advance(10)
    backend = await store._engine.ready()
    archive = store.archive_path
    assert archive is not None
    found = await backend.purge_candidates(clock.now(), 10)
    inside, go_on = asyncio.Event(), asyncio.Event()

    async def held_there() -> None:
        inside.set()
        await go_on.wait()

    archiving = asyncio.create_task(
        _retention._archived(backend, archive, found, 1 << 20, held_there)
    )
    await inside.wait()
    archiving.cancel()
    for _ in range(20):
        await asyncio.sleep(0)
    assert not archiving.done()  # the section goes on, the lock still its own
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await archiving
    assert archived_ids(archive) == [1, 2]  # archived to the end, not deleted
    assert (await store.purge(0)).purged == 2  # the lock is free again
    assert await verify_ledger(store) == []


async def test_a_torn_archive_end_is_cut_off_before_the_next_append(
    store: ControlStore, clock: ManualClock
) -> None:
    await settle(store, "alpha", 2)
    clock.advance(10)
    archive = store.archive_path
    assert archive is not None
    whole = '{"archived_at": "2026-01-01", "item": {"item_id": 98}}\n'
    torn = '{"archived_at": "2026-01-01", "item": {"error": "caf\u00e9'.encode()[:-1]
    archive.write_bytes(whole.encode() + torn)  # killed inside a character, no newline
    await store.purge(0)
    lines = archive.read_bytes().decode("utf-8").splitlines()  # every byte decodes
    assert lines[0] == whole.strip()  # what came before the tear stays
    assert [json.loads(line)["item"]["item_id"] for line in lines[1:]] == [1, 2]
    archive.write_bytes(torn)  # a file that is all tear
    clock.advance(10)
    await settle(store, "alpha", 1)
    clock.advance(10)
    await store.purge(0)
    assert archived_ids(archive) == [3]


@pytest.mark.sqlite_only
async def test_a_lone_surrogate_stored_escaped_is_archived_escaped(
    store: ControlStore, clock: ManualClock
) -> None:
    # '"\\ud800"' is valid JSON, but the str it decodes to has no UTF-8 form: written by
    # another program or an older release, it stopped every purge (oldest first) for good.
    ids = await settle(store, "alpha", 2)
    raw = sqlite3.connect(store.path)
    stored = '{"a":"\\ud800 caf\u00e9"}'
    raw.execute("UPDATE items SET payload = ? WHERE item_id = ?", (stored, ids[0]))
    raw.commit()
    raw.close()
    clock.advance(10)
    assert (await store.purge(0)).purged == 2
    archive = store.archive_path
    assert archive is not None
    lines = archive.read_bytes().decode("utf-8").splitlines()
    assert [json.loads(line)["item"]["payload"] for line in lines] == [
        {"a": "\ud800 caf\u00e9"},
        {"n": 1},
    ]
    assert await verify_ledger(store) == []


async def test_a_result_too_deep_to_encode_again_is_archived_as_its_text(
    store: ControlStore, clock: ManualClock, raw: Any
) -> None:
    # Nested nearly as deep as Python decodes (written behind the store's back: it refuses
    # past MAX_JSON_DEPTH), a result decoded but could not be encoded again under the
    # archive line's own levels: RecursionError out of every purge, and out of a drain or
    # worker with it. Which depths do that depends on the purge's call stack, so results
    # of every depth near the limit are stored, and all must be archived.
    limit = sys.getrecursionlimit()
    depths = range(limit - 60, limit + 1)
    ids = await settle(store, "alpha", len(depths))
    for item_id, depth in zip(ids, depths, strict=True):
        stored = "[" * depth + "]" * depth
        raw.execute("UPDATE items SET result = ? WHERE item_id = ?", (stored, item_id))
    clock.advance(10)
    assert (await store.purge(0)).purged == len(ids)
    archive = store.archive_path
    assert archive is not None
    # Read on a thread of its own, whose stack is as shallow as the purge's (this one's,
    # under pytest, is deeper: the deepest lines written would not decode here).
    lines = await asyncio.to_thread(
        lambda: [json.loads(line)["item"] for line in archive.read_bytes().splitlines()]
    )
    assert [item["item_id"] for item in lines] == ids
    for n, (item, depth) in enumerate(zip(lines, depths, strict=True)):
        if isinstance(item["result"], dict):  # too deep to decode, or to encode again
            assert item["result"] == {"undecoded_json": "[" * depth + "]" * depth}
        # Where only encoding it failed, the whole line's JSON is kept as its text.
        assert item["payload"] in (
            {"n": n},
            {"undecoded_json": json.dumps({"n": n}, separators=(",", ":"))},
        )
    assert isinstance(lines[-1]["result"], dict)  # the deepest at least
    assert await verify_ledger(store) == []


async def test_a_purge_refuses_an_archive_that_is_not_one(
    store: ControlStore, clock: ManualClock
) -> None:
    # `purge --archive` naming the store's own file (or an operator's notes): the purge
    # cut the file back to its last newline and appended to it, and would have rotated
    # it away: the database was damaged, and verify still said "clean".
    await settle(store, "alpha", 2)
    clock.advance(10)
    archive = store.archive_path
    assert archive is not None
    notes = archive.with_name("notes.txt")
    notes.write_bytes(b"a\nlast line")
    targets = [notes]
    if store.backend == "sqlite":
        targets.append(pathlib.Path(store.location))
    for target in targets:
        before = target.read_bytes()
        with pytest.raises(ArchiveError, match="not an asyncplane archive"):
            await store.purge(0, archive_path=target)
        assert target.read_bytes() == before, target
        assert not target.with_name(target.name + ".1").exists()
    assert (await store.counts())["done"] == 2  # nothing purged
    fifo = archive.with_name("wake")  # as a store's -combine-wake-N: opened, it blocked
    os.mkfifo(fifo)
    with pytest.raises(ArchiveError, match="not a regular file"):
        await asyncio.wait_for(store.purge(0, archive_path=fifo), 30)
    assert (await store.counts())["done"] == 2
    refused = cli("purge", str(pathlib.Path(store.location)) if store.backend == "sqlite"
                  else store.location, "--retention", "0", "--archive", str(fifo))  # fmt: skip
    assert refused.returncode == 2 and "not a regular file" in refused.stderr, refused.stderr
    torn = b'{"archi'  # a first line torn short: an archive all the same
    archive.write_bytes(torn)
    assert (await store.purge(0)).purged == 2
    assert archived_ids(archive) == [1, 2]


async def test_a_purge_leaves_out_what_another_purge_archived_since_it_read(
    store: ControlStore, clock: ManualClock
) -> None:
    # Two purges read the same item; it changes, and the second archives and deletes it.
    # The first's record, older, must not come after the newer one ("the last line of an
    # item wins"), nor claim the item as archived by it.
    (item_id,) = await settle(store, "alpha", 1, status="failed")
    clock.advance(10)
    backend = await store._engine.ready()
    archive = store.archive_path
    assert archive is not None
    first_read = await backend.purge_candidates(clock.now(), 10)  # it reads it failed
    await store.requeue(item_id)
    await store.cancel(item_id)
    clock.advance(10)
    assert (await store.purge(0)).purged == 1  # the other purge: archived cancelled, deleted
    assert await _retention._archived(backend, archive, first_read, 1 << 20) == ()
    records = [json.loads(line) for line in archive.read_text().splitlines()]
    assert [r["item"]["state"] for r in records] == ["cancelled"]
    assert [e["event_type"] for e in records[-1]["events"]][-2:] == ["requeued", "cancelled"]


async def test_an_unwritable_archive_does_not_stop_the_drain(
    asyncplane_store_factory: Any,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    clock: ManualClock,
) -> None:
    store: ControlStore = await asyncplane_store_factory(
        retention=0, archive_path=tmp_path / "no-such-dir" / "archive.jsonl"
    )
    await store.create_project("p", "P")
    await settle(store, "p", 2)
    await store.enqueue("p", {})
    clock.advance(1)  # the settled two are older than the retention

    async def done(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    summary = await drain(store, done, empty_rounds=1)
    assert (summary.done, summary.purged) == (1, 0)
    assert (await store.counts())["done"] == 3  # nothing deleted without its archive
    assert "purge cut short" in caplog.text


async def test_a_drain_counts_the_chunks_purged_before_the_archive_failed(
    asyncplane_store_factory: Any, tmp_path: pathlib.Path, clock: ManualClock
) -> None:
    archive = tmp_path / "archive.jsonl"
    (tmp_path / "archive.jsonl.1").mkdir()  # the second chunk's rotation cannot rename
    (tmp_path / "archive.jsonl.1" / "keep").write_text("x")
    store: ControlStore = await asyncplane_store_factory(
        retention=0, archive_path=archive, purge_chunk=2, archive_max_mb=1e-6
    )
    await store.create_project("p", "P")
    await settle(store, "p", 4)
    clock.advance(1)

    async def done(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    summary = await drain(store, done, empty_rounds=1)
    assert summary.purged == 2  # the first chunk: archived, then deleted
    assert archived_ids(archive) == [1, 2] and (await store.counts())["done"] == 2


def test_cli_usage_errors_write_nothing_not_even_a_migration(tmp_path: pathlib.Path) -> None:
    # Argument mistakes a writing verb finds on its own arguments are refused before the
    # store opens: an older store stays at its schema, and in its journal mode.
    path = tmp_path / "old.db"

    async def seed() -> None:
        async with ControlStore(path) as store:
            await store.create_project("p", "P")

    asyncio.run(seed())
    raw = sqlite3.connect(path)
    raw.execute("PRAGMA journal_mode=delete")
    raw.execute("PRAGMA user_version = 11")  # as if an older build had left it
    raw.close()
    mistakes = (
        ["cancel"], ["requeue"], ["cancel", "1", "--state", "ready"], ["cancel", "0"],
        ["schedule", "s", "--project", "p"], ["schedule", "s", "--every", "5m", "--pause"],
        ["limits", "--max-running", "3"],
        # Values the store would refuse, refused before it opens too, in the flags' words.
        ["cancel", "--state", "bogus"], ["requeue", "--state", "bogus", "--yes"],
        ["cancel", "--owner", ""], ["requeue", "--error", ""], ["cancel", "--project", ""],
        ["cancel", "1", "--reason", "x" * 17_000],
        ["limits", "p", "--max-running", "0"],
        ["schedule", "s", "--project", "p", "--payload", "{}", "--cron", "61 * * * *"],
        ["schedule", "s", "--project", "p", "--payload", "{}", "--every", "5m", "--priority",
         str(2**40)],
    )  # fmt: skip
    said = {
        "--owner": "--owner must not be empty",
        "--reason": "--reason is 17000 characters",
        "--priority": "--priority must",
    }
    for args in mistakes:
        refused = cli(args[0], str(path), *args[1:])
        assert refused.returncode == 2, (args, refused.stderr)
        for flag, words in said.items():
            if flag in args:
                assert words in refused.stderr, (args, refused.stderr)
        raw = sqlite3.connect(path)
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 11, args
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "delete", args
        raw.close()


def test_cli_looking_writes_nothing_and_failures_exit_3(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "look.db"

    async def seed() -> None:
        async with ControlStore(path) as store:
            await store.create_project("p", "P")
            await settle(store, "p", 1)

    asyncio.run(seed())
    copy = tmp_path / "copy.db"
    conn = sqlite3.connect(path)
    conn.execute("VACUUM INTO ?", (str(copy),))
    conn.close()
    before = copy.read_bytes()
    for verb in (("stats",), ("verify",), ("events",)):
        args = [*verb, str(copy)] + (["1"] if verb == ("events",) else [])
        done = cli(*args)
        assert done.returncode == 0, done.stderr
    assert copy.read_bytes() == before  # not switched to WAL, not touched at all
    events = json.loads(cli("events", str(copy), "1", "--json").stdout)["events"]
    assert "T" in events[0]["at"]  # ISO 8601 times in JSON
    # An archive the file system refuses (a name past NAME_MAX; a full or read-only disk
    # alike): the store failed under the command, 3. (A missing directory is a usage error.)
    refused = str(tmp_path / ("a" * 300))
    failed = cli("purge", str(path), "--retention", "0s", "--archive", refused)
    assert failed.returncode == 3 and "failed" in failed.stderr, failed.stderr


def test_cli_refuses_an_empty_file_and_leaves_it_empty(tmp_path: pathlib.Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    for verb in ("purge", "stats"):
        args = [verb, str(empty)] + (["--retention", "1d"] if verb == "purge" else [])
        done = cli(*args)
        assert done.returncode == 2 and "not an asyncplane store" in done.stderr
    assert empty.read_bytes() == b""


async def test_cli_reads_a_store_another_process_has_open(tmp_path: pathlib.Path) -> None:
    # While a store is open, its header can still sit in the WAL, not in the main file.
    path = tmp_path / "live.db"
    async with ControlStore(path) as live:
        await live.create_project("p", "P")
        await live.enqueue("p", {"n": 1})
        with path.open("rb") as file:
            assert file.read(72)[68:72] == b"\0\0\0\0"  # the case this test is about
        done = await asyncio.to_thread(cli, "stats", str(path), "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["states"]["ready"] == 1
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    done = cli("stats", str(foreign))
    assert done.returncode == 2 and "another application's database" in done.stderr


@pytest.mark.parametrize("key", ["k" * 1025, "é" * 513, "b\x00x"])
async def test_an_import_refuses_a_key_it_could_not_remember(
    store: ControlStore, tmp_path: pathlib.Path, key: str
) -> None:
    # A key past PostgreSQL's index entry (about 2.7 KB) or holding a NUL failed there
    # with the driver's error (exit 3), and SQLite took it: a store then never copied.
    source = keyed_source(tmp_path / "src.sqlite3", [("a", '{"n": 1}'), (key, '{"n": 2}')])
    with pytest.raises(InvalidInput, match="source row"):
        await store.import_pending(
            source, table="q", columns={"payload": "body", "key": "k"}, project_id="alpha"
        )
    assert sum((await store.counts()).values()) == 0  # nothing of its chunk written
    fits = keyed_source(tmp_path / "fits.sqlite3", [("k" * 1024, '{"n": 3}')])
    summary = await store.import_pending(
        fits, table="q", columns={"payload": "body", "key": "k"}, project_id="alpha"
    )
    assert summary.imported == 1


async def test_an_import_refuses_a_source_name_it_could_not_remember(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # Its records are keyed by the source's path and table too: a table named by a
    # thousand CJK characters failed on PostgreSQL with the driver's error (exit 3).
    table = "表" * 400  # 1,200 bytes of UTF-8
    source = source_table(
        tmp_path / "src.sqlite3", f'CREATE TABLE "{table}" (body TEXT)',
        f'INSERT INTO "{table}" VALUES (?)', [('{"n": 1}',)],
    )  # fmt: skip
    with pytest.raises(InvalidInput, match="the source's name"):
        await store.import_pending(
            source, table=table, columns={"payload": "body"}, project_id="alpha"
        )
    assert sum((await store.counts()).values()) == 0


LONG_KEY = "L" * 1500
KEYED = {"payload": "body", "key": "k"}


async def long_key_an_earlier_release_recorded(
    store: ControlStore, tmp_path: pathlib.Path, digest: str | None
) -> pathlib.Path:
    """A keyed source imported once (row "a"), then a row under `LONG_KEY` added, whose
    record (with ``digest``) an earlier release's SQLite import left: the source."""
    source = keyed_source(tmp_path / "src.sqlite3", [("a", '{"n": 1}')])
    await store.import_pending(source, table="q", columns=KEYED, project_id="alpha")
    (queued,) = [e for e in await store.events(1) if e["event_type"] == "queued"]
    engine = await store._engine.ready()
    name = queued["detail"]["imported_from"]
    await engine.copy_imports(((name, LONG_KEY, 1, 0.0, digest),))  # as that release left it
    conn = sqlite3.connect(source)
    conn.execute("INSERT INTO q VALUES (?, ?)", (LONG_KEY, '{"n": 2}'))
    conn.commit()
    conn.close()
    return source


@pytest.mark.sqlite_only
async def test_a_long_key_an_earlier_release_recorded_is_passed_over_as_ever(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # An earlier release's SQLite import recorded any key: refusing every long key up
    # front failed each later run of that import on a row it had imported already.
    source = await long_key_an_earlier_release_recorded(store, tmp_path, None)
    conn = sqlite3.connect(source)
    conn.execute("INSERT INTO q VALUES ('z', '{\"n\": 3}')")
    conn.commit()
    conn.close()
    summary = await store.import_pending(source, table="q", columns=KEYED, project_id="alpha")
    assert (summary.imported, summary.already_imported) == (1, 2)  # z; a and the long one


@pytest.mark.sqlite_only
async def test_a_changed_row_under_a_long_key_an_earlier_release_recorded_is_imported(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # Its payload changed since: refused as a new long record, the chunk failed on every
    # run and the rows after it never came. Its record moves on to the new item.
    source = await long_key_an_earlier_release_recorded(store, tmp_path, "an older digest")
    summary = await store.import_pending(source, table="q", columns=KEYED, project_id="alpha")
    assert (summary.imported, summary.changed) == (1, 1)


async def test_an_import_that_drops_its_table_refuses_a_name_its_drop_cannot_record(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # The drop's record is kept under the source's name: a long one was written anyway
    # (then no copy to PostgreSQL took the store), and the table dropped. Refused first.
    table = "表" * 400
    source = source_table(
        tmp_path / "src.sqlite3", f'CREATE TABLE "{table}" (body TEXT, s INTEGER)',
        f'INSERT INTO "{table}" VALUES (?, ?)', [('{"n": 1}', 1)],
    )  # fmt: skip
    with pytest.raises(InvalidInput, match="drops its table"):
        await store.import_pending(
            source, table=table, columns={"payload": "body", "state": "s"},
            project_id="alpha", pending=[0], drop_source=True,
        )  # fmt: skip
    conn = sqlite3.connect(source)
    assert conn.execute(f'SELECT count(*) FROM "{table}"').fetchone() == (1,)  # not dropped
    conn.close()


async def test_import_needs_a_unique_key_and_a_real_pending_collection(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    source = tmp_path / "keys.sqlite3"
    conn = sqlite3.connect(source)
    conn.execute("CREATE TABLE q (k TEXT, data TEXT, status INTEGER)")
    conn.executemany("INSERT INTO q VALUES (?, ?, 0)", [("a", "{}"), ("a", "{}"), (None, "{}")])
    conn.commit()
    conn.close()
    with pytest.raises(InvalidInput, match="has NULLs"):
        await store.import_pending(
            source, table="q", columns={"payload": "data", "key": "k"}, project_id="alpha"
        )
    conn = sqlite3.connect(source)
    conn.execute("DELETE FROM q WHERE k IS NULL")
    conn.commit()
    conn.close()
    with pytest.raises(InvalidInput, match="not unique"):
        await store.import_pending(
            source, table="q", columns={"payload": "data", "key": "k"}, project_id="alpha"
        )
    conn = sqlite3.connect(source)
    conn.execute("CREATE TABLE mixed (k, data TEXT)")  # no declared type: values keep theirs
    conn.executemany("INSERT INTO mixed VALUES (?, '{}')", [(1,), ("1",)])
    conn.commit()
    conn.close()
    with pytest.raises(InvalidInput, match="mixes value types"):
        await store.import_pending(
            source, table="mixed", columns={"payload": "data", "key": "k"}, project_id="alpha"
        )
    from asyncplane import InvalidType

    with pytest.raises(InvalidType, match="collection"):
        await store.import_pending(
            source, table="q", columns={"payload": "data", "state": "status"},
            project_id="alpha", pending="0",  # type: ignore[arg-type]
        )  # fmt: skip
    assert sum((await store.counts()).values()) == 0


async def test_a_drain_lock_in_a_missing_directory_is_a_typed_error(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    from asyncplane import StorageError

    async def done(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    with pytest.raises(StorageError, match="cannot open the lock file"):
        await drain(store, done, lock_path=tmp_path / "missing" / "x.lock")
