"""A child process for the full-disk tests (tests/test_faults_disk.py).

Usage: python disk_worker.py DIR SCENARIO ELSEWHERE

DIR is a small tmpfs of this process's own: the test starts it as
``unshare --mount sh -c 'mount -t tmpfs -o size=NNk tmpfs DIR && exec python ...'``, so
the mount lives in a private mount namespace, disappears with the process, and really
fills. The test also points SQLite's temporary files there (``SQLITE_TMPDIR``), as a
full disk usually takes /tmp with it. ELSEWHERE is a directory on another filesystem
(the test's tmp_path): copies "as a crash would leave them" go there, and the sources
and archives that must not share the full disk.

Each scenario opens an SQLite ControlStore on DIR/store.db, fills the disk with a filler
file (to the last byte, or all but a few KiB) and drives one write path until the store
refuses it, keeping a model of what every acknowledged (returned) call did. At the
refusal it copies the database and its -wal to ELSEWHERE, as a crash at that moment
would leave them. Then it deletes the filler, retries the refused call on the same store
object, and holds against the model: the same object, a second one opened beside it, a
third opened after both closed, and the crash copy (against the model as it was at the
refusal). Nothing acknowledged may be missing, nothing refused may be there, the ledger
must be clean and the file sound, and each store must take a new write.

It reports JSON lines on stdout, one per fact; the test asserts on them:

* ``{"kind": "refused", "call": ..., "error": ..., "asyncplane": ..., "storage": ...}``:
  a call the full disk made fail, and how (``storage``: a StorageError is the error or in
  its cause chain); ``acknowledged`` calls of the same kind returned before it.
* ``{"kind": "never_refused", ...}``: the disk never made the call fail.
* ``{"kind": "answered", "call": ...}``: a call of a group commit that was acknowledged.
* ``{"kind": "retried", "call": ..., "ok": ...}``: the refused call once space returned.
* ``{"kind": "read_while_full", "ok": ...}``: reads on the full disk.
* ``{"kind": "check", "phase": ..., "lost": [...], "wrong": [...], "phantoms": ...,
  "ledger": [...], "write_ok": ...}``: a store held against the model.
* ``{"kind": "closed", ...}``, ``{"kind": "file", ...}``: closing, and the file after.
* ``{"kind": "fact", "what": ...}``: something a scenario measured (a drain's summary).
* ``{"kind": "end"}`` last, or ``{"kind": "crash", "traceback": ...}`` (exit status 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sqlite3
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncplane import (
    ArchiveError,
    AsyncplaneError,
    ClaimedItem,
    ControlStore,
    Done,
    DrainError,
    Outcome,
    StorageError,
    UnknownItem,
    drain,
    verify_ledger,
)
from asyncplane.testing import ManualClock

KIB = 1024
LEASE = 60.0
#: How many times a call is tried on the (nearly) full disk before giving up on a refusal.
ATTEMPTS = 400
#: What every record of a purge archive begins with (docs/operating.md).
ARCHIVE_START = '{"archived_at":'
#: The bytes of one WAL frame: a 24-byte header and a 4096-byte page.
FRAME = 24 + 4096
#: Frames the first 32 KiB region of the WAL index (the -shm) covers; the next frame
#: needs a second region, which SQLite allocates by writing to the -shm.
FIRST_SHM_REGION_FRAMES = 4062

Call = Callable[[], Awaitable[object]]


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, **fields}, default=str), flush=True)


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def blob(size: int, tag: object) -> dict[str, Any]:
    """A JSON object of about ``size`` bytes, distinct per ``tag``."""
    return {"tag": str(tag), "blob": "x" * size}


def describe(exc: BaseException) -> dict[str, Any]:
    """What a refusal was: its type, whether it is asyncplane's, and its cause chain."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ if seen.__cause__ is not None else seen.__context__
    return {
        "error": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "asyncplane": isinstance(exc, AsyncplaneError),
        "storage": any(isinstance(link, StorageError) for link in chain),
        "archive": isinstance(exc, ArchiveError),
        "drain_error": isinstance(exc, DrainError),
        "chain": [f"{type(link).__module__}.{type(link).__qualname__}" for link in chain],
        "sqlite": [
            getattr(link, "sqlite_errorname", "?")
            for link in chain
            if isinstance(link, sqlite3.Error)
        ],
        "raised_in": [innermost(link) for link in chain],
        "message": str(exc)[:400],
    }


def innermost(exc: BaseException) -> str:
    """The function an exception was raised in (a statement's op, or the writer's COMMIT)."""
    tb = exc.__traceback__
    if tb is None:
        return "?"
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name


class Disk:
    """The tmpfs: filled by a filler file, freed by deleting it."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.filler = root / "filler"

    def fill(self, leave: int = 0) -> None:
        """Fill the disk to the last byte, then give back ``leave`` bytes (whole pages)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            block = b"\0" * (256 * KIB)
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            if leave:
                os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
        finally:
            os.close(fd)

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def available(self) -> int:
        stat = os.statvfs(self.root)
        return stat.f_bavail * stat.f_frsize


@dataclasses.dataclass
class Model:
    """What the acknowledged calls did: each item's expected fields, the projects, their
    statuses and who is assigned to them."""

    items: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    projects: set[str] = dataclasses.field(default_factory=set)
    statuses: dict[str, str] = dataclasses.field(default_factory=dict)
    assigned: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def expect(self, item_id: int, **fields: Any) -> None:
        self.items[item_id] = fields

    def claimed(self, claim: ClaimedItem) -> None:
        self.expect(
            claim.item_id,
            state="claimed",
            fence=claim.fence,
            owner=claim.owner,
            lease_expires_at=claim.lease_expires_at.isoformat(),
        )


@dataclasses.dataclass
class CrashCopy:
    """The database and its -wal copied at a refusal, and the model at that moment."""

    path: pathlib.Path
    call: str
    model: Model


class Run:
    """One scenario: its disk, its clock, its store, its model and its crash copies."""

    def __init__(self, root: pathlib.Path, elsewhere: pathlib.Path) -> None:
        self.root = root
        self.elsewhere = elsewhere
        self.disk = Disk(root)
        self.clock = ManualClock()
        self.path = root / "store.db"
        self.model = Model()
        self.store = self.open_store()
        self.copies: list[CrashCopy] = []
        self._copied = 0
        self._probes = 0

    def open_store(self, path: pathlib.Path | None = None, **options: Any) -> ControlStore:
        return ControlStore(
            path or self.path,
            clock=self.clock,
            lease_seconds=LEASE,
            max_result_bytes=256 * KIB,
            max_payload_bytes=1 << 20,
            busy_timeout=10,
            **options,
        )

    async def setup(self) -> None:
        for project in ("p", "probe"):  # "probe" is the checks' own
            await self.store.create_project(project, project.upper())
            self.model.projects.add(project)

    # --- the refusal and the retry ----------------------------------------------------

    async def until_refused(self, call: str, once: Call, attempts: int = ATTEMPTS) -> bool:
        """Call ``once`` on the full disk until it fails; report how. True if it failed."""
        for acknowledged in range(attempts):
            try:
                await once()
            except Exception as exc:
                self.refused(call, exc, acknowledged=acknowledged)
                return True
        emit("never_refused", call=call, attempts=attempts)
        return False

    def refused(self, call: str, exc: BaseException, *, acknowledged: int = 0, **more: Any) -> None:
        emit("refused", call=call, acknowledged=acknowledged, **more, **describe(exc))
        self.crash_copy(call)

    def crash_copy(self, call: str) -> None:
        """The files as a crash now would leave them (the -shm is rebuilt from the -wal)."""
        if not self.path.exists():
            return
        self._copied += 1
        where = self.elsewhere / f"crash-{self._copied}"
        where.mkdir()
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(f"{self.path}{suffix}", where / f"{self.path.name}{suffix}")
        self.copies.append(CrashCopy(where / self.path.name, call, copy.deepcopy(self.model)))

    async def retry(self, call: str, once: Call) -> None:
        """The refused call again, once space has returned: it must succeed."""
        try:
            await once()
        except Exception as exc:
            emit("retried", call=call, ok=False, **describe(exc))
        else:
            emit("retried", call=call, ok=True)

    async def read_while_full(self) -> None:
        """Reads need no space: on the full disk they still answer."""
        try:
            await self.store.counts()
            await self.store.stats()
            for item_id in list(self.model.items)[:3]:
                await self.store.item(item_id)
            problems = await verify_ledger(self.store)
        except Exception as exc:
            emit("read_while_full", ok=False, **describe(exc))
        else:
            emit("read_while_full", ok=True, ledger=[str(p) for p in problems])

    # --- the checks -------------------------------------------------------------------

    async def verify(self) -> None:
        """The same store object, one opened beside it, one opened after both closed, and
        every crash copy."""
        await self.check(self.store, self.model, "same")
        beside = self.open_store()
        try:
            await self.check(beside, self.model, "fresh")
        finally:
            await close(beside, "fresh")
        await close(self.store, "same")
        again = self.open_store()
        try:
            await self.check(again, self.model, "reopened")
        finally:
            await close(again, "reopened")
        self.file_facts(self.path, "store")
        for crashed in self.copies:
            store = self.open_store(crashed.path)
            try:
                await self.check(store, crashed.model, "crash_copy", call=crashed.call)
            finally:
                await close(store, "crash_copy")
            self.file_facts(crashed.path, "crash_copy")
        self.copies.clear()

    async def check(self, store: ControlStore, model: Model, phase: str, **more: Any) -> None:
        """Hold ``store`` against ``model``, then show it takes a write round."""
        try:
            found = await compare(store, model)
            write = await self.probe_write(store, model)
            after = await compare(store, model)  # the probe changed nothing else
        except Exception:
            emit("check", phase=phase, **more, crashed=traceback.format_exc())
            return
        emit(
            "check",
            phase=phase,
            **more,
            **found,
            write_ok=write is None,
            write_error=write,
            lost_after_write=after["lost"],
            wrong_after_write=after["wrong"],
        )

    async def probe_write(self, store: ControlStore, model: Model) -> dict[str, Any] | None:
        """Enqueue, claim and finish one item of its own: the store writes again."""
        self._probes += 1
        try:
            if "probe" not in model.projects:  # a copy taken before it was made
                await store.create_project("probe", "Probe")
                model.projects.add("probe")
            item_id = await store.enqueue("probe", {"probe": self._probes})
            model.expect(item_id, state="ready")
            claim = await store.claim("prober", project_id="probe")
            if claim is None or claim.item_id != item_id:
                return {"error": "the probe item could not be claimed", "claim": str(claim)}
            model.claimed(claim)
            result = {"probe": self._probes}
            await store.finish(item_id, fence=claim.fence, result=result)
            model.expect(item_id, state="done", result=digest(result))
        except Exception as exc:
            return describe(exc)
        return None

    def file_facts(self, path: pathlib.Path, which: str) -> None:
        """With every store on it closed: the file's integrity, and whether a -wal was left."""
        wal_left = pathlib.Path(f"{path}-wal").exists()
        sizes = {entry.name: entry.stat().st_size for entry in path.parent.iterdir()}
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            integrity = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        finally:
            conn.close()
        emit("file", which=which, integrity=integrity, wal_left=wal_left, sizes=sizes)


async def compare(store: ControlStore, model: Model) -> dict[str, Any]:
    """Every modelled item with its modelled fields; nothing else; the projects; the ledger."""
    lost: list[int] = []
    wrong: list[dict[str, Any]] = []
    for item_id, want in sorted(model.items.items()):
        try:
            item = await store.item(item_id)
        except UnknownItem:
            lost.append(item_id)
            continue
        for key, value in want.items():
            got = item[key]
            if key == "result":
                got = digest(got)
            elif key == "lease_expires_at" and got is not None:
                got = got.isoformat()
            if got != value:
                wrong.append({"item_id": item_id, "field": key, "want": value, "got": got})
    listed = await store.projects()
    projects = {project["project_id"] for project in listed}
    status = {project["project_id"]: project["status"] for project in listed}
    for project_id, want_status in model.statuses.items():
        if status.get(project_id) != want_status:
            wrong.append(
                {"project": project_id, "want": want_status, "got": status.get(project_id)}
            )
    for actor, want_projects in model.assigned.items():
        got_projects = await store.visible_projects(actor)
        if got_projects != want_projects:
            wrong.append({"actor": actor, "want": want_projects, "got": got_projects})
    stored = sum((await store.counts()).values())
    phantoms: list[dict[str, Any]] = []
    if stored != len(model.items) - len(lost):  # say which items nobody acknowledged
        newest = max(model.items, default=0) + 64
        for item_id in range(1, newest + 1):
            if item_id in model.items:
                continue
            with contextlib.suppress(UnknownItem):
                item = await store.item(item_id)
                tag = item["payload"].get("tag")
                phantoms.append({"item_id": item_id, "state": item["state"], "tag": tag})
    return {
        "lost": lost,
        "wrong": wrong[:12],
        "items": len(model.items),
        "stored": stored,
        "phantoms": stored - (len(model.items) - len(lost)),
        "phantom_items": phantoms[:12],
        "projects_lost": sorted(model.projects - projects),
        "projects_phantom": sorted(projects - model.projects),
        "ledger": [str(problem) for problem in await verify_ledger(store)],
    }


async def close(store: ControlStore, phase: str) -> None:
    try:
        await store.close()
    except Exception as exc:
        emit("closed", phase=phase, ok=False, **describe(exc))
    else:
        emit("closed", phase=phase, ok=True)


async def refuse_then_recover(run: Run, call: str, once: Call, attempts: int = ATTEMPTS) -> None:
    """The common shape: refused on the full disk, read, space back, retried, verified."""
    await run.until_refused(call, once, attempts)
    await run.read_while_full()
    run.disk.free()
    await run.retry(call, once)
    await run.verify()


# --- items in every state, made while there is room ----------------------------------------


async def ready_items(run: Run, count: int, size: int = 64) -> list[int]:
    ids = await run.store.enqueue_many("p", [blob(size, n) for n in range(count)])
    for item_id in ids:
        run.model.expect(item_id, state="ready")
    return ids


async def claimed_items(run: Run, count: int) -> list[ClaimedItem]:
    await ready_items(run, count)
    claims = await run.store.claim_batch("worker", count, project_id="p")
    for claim in claims:
        run.model.claimed(claim)
    return claims


async def settled_items(run: Run, count: int) -> list[int]:
    """Items done with 8 KiB results, then aged past a retention of 10 s."""
    claims = await claimed_items(run, count)
    for claim in claims:
        result = blob(8 * KIB, claim.item_id)
        await run.store.finish(claim.item_id, fence=claim.fence, result=result)
        run.model.expect(claim.item_id, state="done", result=digest(result))
    run.clock.advance(100)
    return [claim.item_id for claim in claims]


def twin_source(run: Run, name: str, rows: int, fingerprint: str) -> pathlib.Path:
    """A queue in another SQLite file (on the other disk) whose rows share a fingerprint;
    imported, they become pending twins (an import never merges twins)."""
    source = run.elsewhere / f"{name}.db"
    conn = sqlite3.connect(source)
    try:
        with conn:
            conn.execute("CREATE TABLE queue (id INTEGER PRIMARY KEY, data TEXT, fp TEXT)")
            conn.executemany(
                "INSERT INTO queue (data, fp) VALUES (?, ?)",
                [(json.dumps(blob(1500, f"{name}-{n}")), fingerprint) for n in range(rows)],
            )
    finally:
        conn.close()
    return source


async def import_twins(run: Run, name: str, rows: int, fingerprint: str) -> list[int]:
    """Import ``rows`` pending twins into "p"; return their ids."""
    before = await newest_item_id(run)
    summary = await run.store.import_pending(
        twin_source(run, name, rows, fingerprint),
        table="queue",
        columns={"payload": "data", "fingerprint": "fp"},
        project_id="p",
    )
    ids = list(range(before + 1, before + 1 + summary.imported))
    for item_id in ids:
        run.model.expect(item_id, state="ready")
    return ids


async def newest_item_id(run: Run) -> int:
    """The highest item id in the store (ids are never reused)."""
    newest = max(run.model.items, default=0)
    while True:
        try:
            await run.store.item(newest + 1)
        except UnknownItem:
            return newest
        newest += 1


def size_of(path: pathlib.Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def wal_frames(path: pathlib.Path) -> int:
    return max(0, size_of(pathlib.Path(f"{path}-wal")) - 32) // FRAME


# --- the write paths -----------------------------------------------------------------------


async def enqueue(run: Run) -> None:
    await run.setup()
    run.disk.fill(leave=160 * KIB)  # a few enqueues fit, then the disk is full
    payload = blob(40 * KIB, "enqueue")

    async def once() -> None:
        item_id = await run.store.enqueue("p", payload)
        run.model.expect(item_id, state="ready", payload=payload)

    await refuse_then_recover(run, "enqueue", once)


async def enqueue_many(run: Run) -> None:
    await run.setup()
    run.disk.fill(leave=160 * KIB)
    jobs = [blob(6 * KIB, n) for n in range(8)]

    async def once() -> None:
        ids = await run.store.enqueue_many("p", jobs)
        for item_id, job in zip(ids, jobs, strict=True):
            run.model.expect(item_id, state="ready", payload=job)

    await refuse_then_recover(run, "enqueue_many", once)


async def claim(run: Run) -> None:
    await run.setup()
    await ready_items(run, 300)
    run.disk.fill(leave=64 * KIB)

    async def once() -> None:
        taken = await run.store.claim("worker", project_id="p")
        if taken is None:
            raise AssertionError("nothing to claim: the scenario ran out of items")
        run.model.claimed(taken)

    await refuse_then_recover(run, "claim", once, attempts=250)


async def claim_batch(run: Run) -> None:
    await run.setup()
    await ready_items(run, 600)
    run.disk.fill(leave=128 * KIB)

    async def once() -> None:
        batch = await run.store.claim_batch("worker", 10, project_id="p")
        if len(batch) != 10:
            raise AssertionError(f"a batch of {len(batch)}: the scenario ran out of items")
        for taken in batch:
            run.model.claimed(taken)

    await refuse_then_recover(run, "claim_batch", once, attempts=55)


async def renew(run: Run) -> None:
    await run.setup()
    [held] = await claimed_items(run, 1)
    run.disk.fill(leave=64 * KIB)

    async def once() -> None:
        run.clock.advance(1)  # every renewal moves the lease: a real change to write
        expires = await run.store.renew(held.item_id, fence=held.fence)
        run.model.expect(
            held.item_id, state="claimed", fence=held.fence, lease_expires_at=expires.isoformat()
        )

    await refuse_then_recover(run, "renew", once)


async def settle_each(
    run: Run,
    call: str,
    claims: Sequence[ClaimedItem],
    settle: Callable[[ClaimedItem], Awaitable[dict[str, Any]]],
) -> None:
    """Settle the claims one by one on the full disk until one is refused; retry that one."""
    pending = list(claims)

    async def once() -> None:
        if not pending:
            raise AssertionError("every claim settled: the disk never filled")
        fields = await settle(pending[0])
        run.model.expect(pending.pop(0).item_id, **fields)

    await refuse_then_recover(run, call, once, attempts=len(claims))


async def finish_done(run: Run) -> None:
    await run.setup()
    claims = await claimed_items(run, 40)
    run.disk.fill(leave=200 * KIB)

    async def settle(claim: ClaimedItem) -> dict[str, Any]:
        result = blob(48 * KIB, claim.item_id)  # a large result
        await run.store.finish(claim.item_id, fence=claim.fence, result=result)
        return {"state": "done", "fence": claim.fence, "result": digest(result)}

    await settle_each(run, "finish_done", claims, settle)


async def finish_failed(run: Run) -> None:
    await run.setup()
    claims = await claimed_items(run, 60)
    run.disk.fill(leave=160 * KIB)

    async def settle(claim: ClaimedItem) -> dict[str, Any]:
        error = f"failure {claim.item_id}: " + "e" * (12 * KIB)
        await run.store.finish(claim.item_id, fence=claim.fence, status="failed", error=error)
        return {"state": "failed", "fence": claim.fence, "error": error}

    await settle_each(run, "finish_failed", claims, settle)


async def retry(run: Run) -> None:
    await run.setup()
    claims = await claimed_items(run, 60)
    run.disk.fill(leave=128 * KIB)

    async def settle(claim: ClaimedItem) -> dict[str, Any]:
        error = f"transient {claim.item_id}: " + "t" * (4 * KIB)
        state = await run.store.retry(claim.item_id, fence=claim.fence, error=error, delay=30)
        return {"state": state, "fence": claim.fence, "error": error}

    await settle_each(run, "retry", claims, settle)


async def park(run: Run) -> None:
    await run.setup()
    claims = await claimed_items(run, 120)
    run.disk.fill(leave=128 * KIB)

    async def settle(claim: ClaimedItem) -> dict[str, Any]:
        await run.store.park(claim.item_id, fence=claim.fence, delay=30)
        return {"state": "deferred", "fence": claim.fence, "attempts": claim.attempts - 1}

    await settle_each(run, "park", claims, settle)


async def offload(run: Run) -> None:
    await run.setup()
    claims = await claimed_items(run, 120)
    run.disk.fill(leave=128 * KIB)

    async def settle(claim: ClaimedItem) -> dict[str, Any]:
        handle = f"batch-{claim.item_id}"
        await run.store.offload(claim.item_id, fence=claim.fence, handle=handle)
        return {"state": "offloaded", "fence": claim.fence, "offload_handle": handle}

    await settle_each(run, "offload", claims, settle)


async def create_project(run: Run) -> None:
    await run.setup()
    run.disk.fill(leave=48 * KIB)
    made = 0

    async def once() -> None:
        project_id = f"project-{made}"
        await run.store.create_project(project_id, f"Project {made} " + "n" * (6 * KIB))
        run.model.projects.add(project_id)

    async def each() -> None:
        nonlocal made
        await once()
        made += 1

    await run.until_refused("create_project", each)
    await run.read_while_full()
    run.disk.free()
    await run.retry("create_project", once)  # the same id: refused before, so still free
    await run.verify()


async def twins(run: Run) -> None:
    """A finish that settles 120 pending twins: its one UPDATE rewrites many rows, and its
    statement journal (a temporary file, on the same full disk) cannot grow, so the
    statement itself fails, inside the writer's transaction, not its COMMIT."""
    await run.setup()
    ids = await import_twins(run, "twins", 120, "same")
    head = await run.store.claim("worker", project_id="p")
    assert head is not None and head.item_id == ids[0]
    run.model.claimed(head)
    run.disk.fill(leave=64 * KIB)
    result = blob(4 * KIB, "twins")

    async def once() -> None:
        await run.store.finish(head.item_id, fence=head.fence, result=result)
        for item_id in ids:
            run.model.expect(item_id, state="done", result=digest(result))

    await refuse_then_recover(run, "finish_twins", once, attempts=1)


async def group_commit(run: Run) -> None:
    """Requests that meet in one group commit on a nearly full disk are answered each on
    its own: the twins' finish fails inside its statement, and the others are run again
    without it and commit, or are refused, each by itself."""
    await run.setup()
    ids = await import_twins(run, "twins", 120, "same")
    head = await run.store.claim("worker", project_id="p")
    assert head is not None and head.item_id == ids[0]
    run.model.claimed(head)
    held = await claimed_items(run, 3)
    await ready_items(run, 5)
    twin_result = blob(4 * KIB, "twins")
    small = {"small": True}

    async def finish_twins() -> None:
        await run.store.finish(head.item_id, fence=head.fence, result=twin_result)
        for item_id in ids:
            run.model.expect(item_id, state="done", result=digest(twin_result))

    async def enqueue() -> None:
        item_id = await run.store.enqueue("p", small)
        run.model.expect(item_id, state="ready", payload=small)

    async def enqueue_many() -> None:
        for item_id in await run.store.enqueue_many("p", [small] * 3):
            run.model.expect(item_id, state="ready", payload=small)

    async def claim() -> None:
        taken = await run.store.claim("worker-2", project_id="p")
        assert taken is not None and taken.item_id not in ids, taken
        run.model.claimed(taken)

    async def renew() -> None:
        expires = await run.store.renew(held[0].item_id, fence=held[0].fence, lease_seconds=90)
        run.model.expect(held[0].item_id, state="claimed", lease_expires_at=expires.isoformat())

    async def park() -> None:
        await run.store.park(held[1].item_id, fence=held[1].fence, delay=30)
        run.model.expect(held[1].item_id, state="deferred")

    async def finish_small() -> None:
        await run.store.finish(held[2].item_id, fence=held[2].fence, result=small)
        run.model.expect(held[2].item_id, state="done", result=digest(small))

    calls: dict[str, Call] = {
        "finish_twins": finish_twins,
        "enqueue": enqueue,
        "enqueue_many": enqueue_many,
        "claim": claim,
        "renew": renew,
        "park": park,
        "finish_small": finish_small,
    }
    writer = run.store._engine.backend.writer
    rounds = writer.rounds
    run.disk.fill(leave=64 * KIB)
    outcomes = await asyncio.gather(*(call() for call in calls.values()), return_exceptions=True)
    emit("fact", what="rounds", rounds=writer.rounds - rounds)
    refused = []
    for name, outcome in zip(calls, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            emit("refused", call=name, acknowledged=0, **describe(outcome))
            refused.append(name)
        else:
            emit("answered", call=name)
    run.crash_copy("group_commit")
    await run.read_while_full()
    run.disk.free()
    for name in refused:
        await run.retry(name, calls[name])
    await run.verify()


async def other_writes(run: Run) -> None:
    """The remaining writes: project status, assignments, an import, preflight dedup."""
    await run.setup()
    fingerprint = "dedup-me"
    first = await run.store.enqueue("p", {"first": True}, fingerprint=fingerprint)
    done = await run.store.claim("worker", project_id="p")
    assert done is not None and done.item_id == first
    result = blob(4 * KIB, "done")
    await run.store.finish(done.item_id, fence=done.fence, result=result)
    run.model.expect(done.item_id, state="done", result=digest(result))
    await run.store.create_project("q", "Q")
    run.model.projects.add("q")
    await run.store.assign("q", "keeper")  # someone for unassign to take away
    run.model.assigned["keeper"] = ["q"]
    statuses = iter(["paused", "open"] * ATTEMPTS)
    imports = iter(range(ATTEMPTS))

    async def set_status() -> None:
        status = next(statuses)
        await run.store.set_project_status("q", status)
        run.model.statuses["q"] = status

    async def assign() -> None:
        actor = f"actor-{len(run.model.assigned)}"
        await run.store.assign("q", actor)
        run.model.assigned[actor] = ["q"]

    async def unassign() -> None:
        actor = next(actor for actor, projects in run.model.assigned.items() if projects)
        await run.store.unassign("q", actor)
        run.model.assigned[actor] = []

    async def import_rows() -> None:
        await import_twins(run, f"import-{next(imports)}", 4, "import")

    for name, once in (
        ("set_project_status", set_status),
        ("assign", assign),
        ("unassign", unassign),
        ("import_pending", import_rows),
    ):
        run.disk.fill()
        await run.until_refused(name, once)
        run.disk.free()
        await run.retry(name, once)
    # Preflight dedup: 40 pending twins of the done item, each to get a copy of its result.
    pending = await import_twins(run, "pending-twins", 40, fingerprint)

    async def dedup() -> None:
        settled = await run.store.dedup_pending_against_done()
        emit("fact", what="dedup", settled=settled)
        for item_id in pending:
            run.model.expect(item_id, state="done", result=digest(result))

    run.disk.fill()
    await refuse_then_recover(run, "dedup_pending_against_done", dedup, attempts=1)


# --- retention -------------------------------------------------------------------------------


def archived_ids(path: pathlib.Path) -> list[int]:
    """The item ids in an archive, read as docs/operating.md says (torn lines included)."""
    ids: list[int] = []
    if not path.exists():
        return ids
    with open(path, encoding="utf-8") as archive:
        for line in archive:
            at = 0
            while at != -1:
                try:
                    record = json.loads(line[at:])
                except ValueError:
                    at = line.find(ARCHIVE_START, at + 1)
                    continue
                ids.append(record["item"]["item_id"])
                break
    return ids


async def purge_and_archive(run: Run, call: str, archive: pathlib.Path, leave: int) -> None:
    """Purge on the full disk (refused), then with space: every purged item archived."""
    done = await settled_items(run, 30)
    run.disk.fill(leave=leave)

    async def once() -> None:
        summary = await run.store.purge(10, chunk=10, archive_path=archive)
        emit("fact", what="purged", purged=summary.purged, chunks=summary.chunks)
        for item_id in done:  # only now are they gone: purged from the model too
            run.model.items.pop(item_id, None)

    await run.until_refused(call, once, attempts=1)
    found = await compare(run.store, run.model)  # refused before its delete: all still here
    emit(
        "fact",
        what="after_refused_purge",
        lost=found["lost"],
        wrong=found["wrong"],
        archive_bytes=size_of(archive),
    )
    await run.read_while_full()
    run.disk.free()
    await run.retry(call, once)
    archived = archived_ids(archive)
    emit(
        "fact",
        what="archive",
        missing=sorted(set(done) - set(archived)),
        archived=len(archived),
        distinct=len(set(archived)),
    )
    await run.verify()


async def purge(run: Run) -> None:
    """The archive beside the database, on the full disk: ArchiveError, nothing deleted;
    the 12 KiB left take part of the first line (a torn line the next purge ends)."""
    await run.setup()
    archive = run.path.with_name(run.path.name + ".archive.jsonl")
    await purge_and_archive(run, "purge", archive, leave=12 * KIB)


async def purge_delete(run: Run) -> None:
    """The archive on another disk: it is written, and the delete after it is refused."""
    await run.setup()
    await purge_and_archive(run, "purge_delete", run.elsewhere / "archive.jsonl", leave=0)


# --- drain -------------------------------------------------------------------------------------


async def big_results(batch: list[ClaimedItem]) -> list[Outcome]:
    return [Done(blob(48 * KIB, claim.item_id)) for claim in batch]


async def small_results(batch: list[ClaimedItem]) -> list[Outcome]:
    return [Done({"ok": claim.item_id}) for claim in batch]


async def refused_drain(
    run: Run, execute: Callable[[list[ClaimedItem]], Awaitable[Any]], batch_size: int
) -> Any:
    """A drain on the (nearly, or soon) full disk; the summary a DrainError carries."""
    try:
        summary = await drain(run.store, execute, empty_rounds=1, batch_size=batch_size)
    except Exception as exc:
        emit("refused", call="drain", acknowledged=0, **describe(exc))
        return exc.summary if isinstance(exc, DrainError) else None
    emit("never_refused", call="drain", attempts=summary.rounds)
    return summary


async def drain_recovers(run: Run, ids: list[int], refused_summary: Any) -> None:
    """After a drain failed on the full disk: with space back and every lease the failed
    drain left lapsed, a new drain takes everything over and settles it."""
    states: dict[str, int] = {}
    for item_id in ids:
        state = (await run.store.item(item_id))["state"]
        states[state] = states.get(state, 0) + 1
    emit(
        "fact",
        what="after_refused_drain",
        states=states,
        done_by_summary=None if refused_summary is None else refused_summary.done,
    )
    run.clock.advance(LEASE + 1)
    try:
        summary = await drain(run.store, small_results, empty_rounds=1, batch_size=16)
    except Exception as exc:
        emit("fact", what="recovery_drain", ok=False, **describe(exc))
        return
    emit(
        "fact",
        what="recovery_drain",
        ok=True,
        claimed=summary.claimed,
        done=summary.done,
        remaining=summary.remaining,
        counts=await run.store.counts(project_id="p"),
        unsettled_before=len(ids) - states.get("done", 0),
    )
    for item_id in ids:
        run.model.expect(item_id, state="done")


async def drain_settle(run: Run) -> None:
    """Rounds with big results on a nearly full disk, until a settlement is refused."""
    await run.setup()
    ids = await ready_items(run, 40)
    run.disk.fill(leave=320 * KIB)
    refused = await refused_drain(run, big_results, batch_size=4)
    await run.read_while_full()
    run.disk.free()
    await drain_recovers(run, ids, refused)
    await run.verify()


async def drain_executor_fills(run: Run) -> None:
    """The disk fills while the executor runs: the whole batch's settlement is refused,
    and so is putting the batch back."""
    await run.setup()
    ids = await ready_items(run, 12)

    async def fill_then_answer(batch: list[ClaimedItem]) -> list[Outcome]:
        run.disk.fill()
        return await big_results(batch)

    refused = await refused_drain(run, fill_then_answer, batch_size=12)
    await run.read_while_full()
    run.disk.free()
    await drain_recovers(run, ids, refused)
    await run.verify()


async def drain_full(run: Run) -> None:
    """The disk is full before the drain starts: its first claim is refused."""
    await run.setup()
    ids = await ready_items(run, 12)
    run.disk.fill()
    await refused_drain(run, big_results, batch_size=12)
    await run.read_while_full()
    run.disk.free()
    await drain_recovers(run, ids, None)
    await run.verify()


async def drain_retention(run: Run) -> None:
    """A store with a retention: drain()'s own purge meets the full disk first, logs its
    ArchiveError and goes on; the claim after it is refused."""
    run.store = run.open_store(retention=10, purge_min_interval_s=0)
    await run.setup()
    old = await settled_items(run, 20)
    ids = await ready_items(run, 6)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage()[:300])

    handler = Keep(logging.WARNING)
    logging.getLogger("asyncplane").addHandler(handler)
    run.disk.fill()
    try:
        await refused_drain(run, small_results, batch_size=6)
    finally:
        logging.getLogger("asyncplane").removeHandler(handler)
    emit("fact", what="purge_warnings", warnings=warnings)
    await run.read_while_full()
    run.disk.free()
    summary = await drain(run.store, small_results, empty_rounds=1, batch_size=6)
    archived = archived_ids(run.path.with_name(run.path.name + ".archive.jsonl"))
    emit(
        "fact",
        what="recovery_drain",
        ok=True,
        purged=summary.purged,
        done=summary.done,
        missing=sorted(set(old) - set(archived)),
    )
    for item_id in old:
        run.model.items.pop(item_id)
    for item_id in ids:
        run.model.expect(item_id, state="done")
    await run.verify()


# --- opening, and checkpoints ------------------------------------------------------------------


async def open_new(run: Run) -> None:
    """Schema creation on a full disk, with every amount of room from none to enough."""
    run.path = run.root / "sweep.db"
    for leave in range(0, 201 * KIB, 4 * KIB):
        for leftover in run.root.glob("sweep.db*"):
            leftover.unlink()
        run.model = Model()
        run.disk.fill(leave=leave)
        run.store = run.open_store()
        stage = "open"

        async def ensure() -> None:
            nonlocal stage
            await run.store.open()
            for project in ("p", "probe"):
                if project not in run.model.projects:
                    stage = f"create_project {project}"
                    await run.store.create_project(project, project.upper())
                    run.model.projects.add(project)

        try:
            await ensure()
        except Exception as exc:
            run.refused("open", exc, leave=leave, stage=stage)
        else:
            emit("fact", what="opened", leave=leave)
        run.disk.free()
        await run.retry("open", ensure)
        await run.verify()


async def open_existing(run: Run) -> None:
    """A store closed cleanly (no -wal, no -shm left) opened again on a full disk."""
    await run.setup()
    await claimed_items(run, 5)
    await close(run.store, "before")
    run.disk.fill()
    run.store = run.open_store()

    async def once() -> None:
        await run.store.open()
        item_id = await run.store.enqueue("p", {"after": "opening"})
        run.model.expect(item_id, state="ready")

    await run.until_refused("open_existing", once, attempts=1)
    run.disk.free()
    await run.retry("open_existing", once)
    await run.verify()


async def checkpoint_on_close(run: Run) -> None:
    """The last connection's checkpoint, on close, finds no room to grow the database."""
    await run.setup()
    payload = blob(40 * KIB, "wal")
    for _ in range(30):  # some 500 WAL frames, all still only in the -wal
        item_id = await run.store.enqueue("p", payload)
        run.model.expect(item_id, state="ready", payload=payload)
    frames = wal_frames(run.path)
    run.disk.fill()
    await close(run.store, "full")
    emit(
        "fact",
        what="closed_full",
        frames_before=frames,
        frames_after=wal_frames(run.path),
        db_bytes=size_of(run.path),
    )
    run.store = run.open_store()  # on the still full disk: its -wal and -shm are there
    try:
        found = await compare(run.store, run.model)
    except Exception as exc:
        emit("fact", what="reopened_full", ok=False, **describe(exc))
    else:
        emit("fact", what="reopened_full", ok=True, **found)
    run.crash_copy("checkpoint_on_close")
    run.disk.free()
    await run.verify()


async def autocheckpoint(run: Run) -> None:
    """The checkpoint a commit starts past 1000 WAL pages runs out of room part-way."""
    await run.setup()
    payload = blob(40 * KIB, "wal")
    while wal_frames(run.path) < 900:
        item_id = await run.store.enqueue("p", payload)
        run.model.expect(item_id, state="ready", payload=payload)
    db_before = size_of(run.path)
    run.disk.fill(leave=600 * KIB)

    async def once() -> None:
        item_id = await run.store.enqueue("p", payload)
        run.model.expect(item_id, state="ready", payload=payload)

    await run.until_refused("enqueue_at_checkpoint", once)
    emit(
        "fact",
        what="autocheckpoint",
        frames=wal_frames(run.path),
        db_before=db_before,
        db_after=size_of(run.path),
    )
    await run.read_while_full()
    run.disk.free()
    await run.retry("enqueue_at_checkpoint", once)
    await run.verify()


async def outside_checkpoint(run: Run) -> None:
    """Another program (the sqlite3 shell, a backup tool) checkpoints on the full disk."""
    await run.setup()
    payload = blob(40 * KIB, "wal")
    for _ in range(30):
        item_id = await run.store.enqueue("p", payload)
        run.model.expect(item_id, state="ready", payload=payload)
    run.disk.fill()
    conn = sqlite3.connect(run.path, isolation_level=None)
    try:
        row = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        emit("fact", what="outside_checkpoint", ok=True, row=list(row))
    except sqlite3.Error as exc:
        emit("fact", what="outside_checkpoint", ok=False, error=repr(exc))
    finally:
        conn.close()

    async def once() -> None:
        item_id = await run.store.enqueue("p", payload)
        run.model.expect(item_id, state="ready", payload=payload)

    await refuse_then_recover(run, "enqueue_after_checkpoint", once)


async def wal_index_growth(run: Run) -> None:
    """The commit whose frames take the WAL past what the first 32 KiB of its index (the
    -shm) covers, with room for the frames but not for the index's next region.

    A long read (a backup, here a held read transaction) keeps checkpoints from restarting
    the WAL, so it grows past 4,062 frames, 16 MiB: each 1 MB enqueue is some 250 frames.
    SQLite writes a commit's frames, then indexes them; the index cannot grow, and the
    call fails (SQLITE_IOERR_SHMSIZE) with its commit frame already in the -wal. The crash
    copy shows whether that refused call is there after a crash all the same.
    """
    await run.setup()
    pin = sqlite3.connect(f"{run.path.as_uri()}?mode=ro", uri=True, isolation_level=None)
    try:
        pin.execute("BEGIN")
        pin.execute("SELECT count(*) FROM items").fetchone()  # a snapshot, held
        payload = blob(1_000_000, "big")
        before = wal_frames(run.path)

        async def once() -> None:
            item_id = await run.store.enqueue("p", payload)
            run.model.expect(item_id, state="ready", payload=payload)

        await once()
        per_call = wal_frames(run.path) - before
        while wal_frames(run.path) + per_call < FIRST_SHM_REGION_FRAMES:
            start = wal_frames(run.path)
            await once()
            per_call = wal_frames(run.path) - start  # a steady call's frames, not the first's
        # A call's frames vary by one or two (index pages): should the crossing call land
        # within a couple of frames of the region's end, a small enqueue moves it along.
        pads = 0
        while wal_frames(run.path) + per_call <= FIRST_SHM_REGION_FRAMES + 2:
            pad = {"pad": pads}
            run.model.expect(await run.store.enqueue("p", pad), state="ready", payload=pad)
            pads += 1
        frames = wal_frames(run.path)
        # Room for the frames and one 4 KiB page more: not for the index's next 32 KiB.
        run.disk.fill(leave=(per_call + 1) * FRAME + 12 * KIB)
        await run.until_refused("enqueue_past_wal_index", once, attempts=1)
        emit(
            "fact",
            what="wal_index",
            frames_before=frames,
            per_call=per_call,
            frames_after=wal_frames(run.path),
        )
        await run.read_while_full()
    finally:
        pin.close()
    run.disk.free()
    await run.retry("enqueue_past_wal_index", once)
    await run.verify()


SCENARIOS: dict[str, Callable[[Run], Awaitable[None]]] = {
    scenario.__name__: scenario
    for scenario in (
        enqueue, enqueue_many, claim, claim_batch, renew, finish_done, finish_failed, retry,
        park, offload, create_project, twins, group_commit, other_writes, purge,
        purge_delete, drain_settle, drain_executor_fills, drain_full, drain_retention,
        open_new, open_existing, checkpoint_on_close, autocheckpoint, outside_checkpoint,
        wal_index_growth,
    )
}  # fmt: skip


async def main(root: pathlib.Path, scenario: str, elsewhere: pathlib.Path) -> None:
    run = Run(root, elsewhere)
    emit("start", scenario=scenario, available=run.disk.available())
    try:
        await SCENARIOS[scenario](run)
    finally:
        run.disk.free()
        await run.store.close()
    emit("end", scenario=scenario)


if __name__ == "__main__":
    try:
        asyncio.run(main(pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])))
    except BaseException:
        emit("crash", traceback=traceback.format_exc())
        sys.exit(1)
