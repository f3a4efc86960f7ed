"""Power-loss cuts: does a store come back as exactly a prefix of its acknowledged commits?

A power loss leaves a WAL-mode SQLite file as its main database file plus a ``-wal`` file
cut somewhere: at a frame boundary, inside a frame's 24-byte header, inside its page
data, inside the WAL's own 32-byte header, or with a damaged byte. SQLite's recovery keeps
the longest run of valid frames and, of those, everything up to the last *commit frame*
(a frame whose header has a non-zero "database size after commit"). So whatever the cut,
a store must come back as the state after some acknowledged call, and it must be the one
predicted from the cut: every call acknowledged up to the last commit frame wholly before
the cut, and nothing after it.

`generate` runs a workload (enqueue, enqueue_many, claim_batch, renew, finish, retry,
park, offload, lease takeovers, refused stale reports) against a live store while a raw
connection holds a read transaction begun on the bare database file, so no checkpoint can
copy a frame into the database or restart the WAL: the database file stays the
pre-workload base and the WAL holds every commit since. After each acknowledged call it
records how many commit frames the WAL holds and a digest of the committed state. Then,
with the store still open (a close would checkpoint), it copies the database and its WAL.

`check_copy` writes the base plus one damaged WAL beside it, opens it with a fresh
`ControlStore`, and checks: it opens, ``verify_ledger`` finds nothing, the state is the
acknowledged prefix the damage predicts, and the store still takes work (enqueue, claim,
finish, then the ledger again).

tests/test_faults_power.py samples about fifty cuts of a small workload; run this script
for every frame boundary and as many random cuts as you like::

    python scripts/power_cuts.py --cuts 500 --seed 7 --items 200

It exits 0 only if no acknowledged commit before a cut was lost, nothing after one
appeared, every copy opened and took work, and the ledger found no problem.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import pathlib
import random
import shutil
import sqlite3
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from asyncplane import ControlStore, FenceRejected, Job, verify_ledger
from asyncplane.testing import ManualClock

#: The WAL file starts with a header of this many bytes ...
WAL_HEADER = 32
#: ... then frames: a header of this many bytes, then one page.
FRAME_HEADER = 24
#: The first four bytes of a WAL file (the low bit gives the checksum byte order).
WAL_MAGIC = (0x377F0682, 0x377F0683)

#: Every kind of acknowledged call the workload makes.
CALLS = (
    "enqueue",
    "enqueue_many",
    "claim_batch",
    "renew",
    "finish_done",
    "finish_failed",
    "finish_offloaded",
    "retry",
    "park",
    "offload",
    "takeover",
)

LEASE_SECONDS = 1000.0
PROJECT = "p"

# --- the WAL format ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a WAL file: where it lies, and whether it ends a transaction."""

    index: int
    offset: int  # where its 24-byte header starts
    end: int  # one past its last page byte
    page: int
    db_size: int  # "database size after commit": non-zero on a commit frame only
    salt: bytes

    @property
    def commit(self) -> bool:
        return self.db_size != 0


@dataclasses.dataclass(frozen=True)
class WalHeader:
    magic: int
    page_size: int
    salt: bytes


def wal_header(data: bytes) -> WalHeader:
    """The WAL header of ``data`` (a whole, undamaged WAL file)."""
    if len(data) < WAL_HEADER:
        raise ValueError(f"a WAL file of {len(data)} bytes has no header")
    magic, _version, page_size = struct.unpack(">III", data[:12])
    if magic not in WAL_MAGIC:
        raise ValueError(f"not a WAL file: magic {magic:#x}")
    return WalHeader(magic, page_size, data[16:24])


def frames_of(data: bytes, page_size: int, *, start: int = 0) -> list[Frame]:
    """The complete frames of ``data``, numbered from ``start`` (frames after a cut are
    incomplete and left out)."""
    size = FRAME_HEADER + page_size
    found = []
    index = start
    offset = WAL_HEADER + start * size
    while offset + size <= len(data):
        page, db_size = struct.unpack(">II", data[offset : offset + 8])
        salt = data[offset + 8 : offset + 16]
        found.append(Frame(index, offset, offset + size, page, db_size, salt))
        index += 1
        offset += size
    return found


class WalWatcher:
    """Counts the commit frames of a live WAL file, reading only what was appended."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = path
        self._buffer = b""
        self.page_size = 0
        self.frames: list[Frame] = []

    def commits(self) -> int:
        """How many commit frames the WAL holds now (the file only grows: see `generate`)."""
        try:
            with open(self._path, "rb") as wal:
                wal.seek(len(self._buffer))
                self._buffer += wal.read()
        except FileNotFoundError:
            return 0
        if not self.page_size and len(self._buffer) >= WAL_HEADER:
            self.page_size = wal_header(self._buffer).page_size
        if self.page_size:
            self.frames += frames_of(self._buffer, self.page_size, start=len(self.frames))
        return sum(frame.commit for frame in self.frames)


def commits_before(frames: Sequence[Frame], position: int) -> int:
    """The commits a WAL cut after ``position`` bytes, or damaged at byte ``position``,
    keeps: the commit frames wholly before that byte.

    SQLite's recovery reads frames while they are whole and valid. The WAL header is
    checksummed, and each frame's checksum runs on from the one before, so a cut or
    damaged frame loses itself and every frame after it, and a cut or damaged WAL header
    loses them all. Of the frames it keeps, only those up to the last commit frame count.
    """
    if position < WAL_HEADER:
        return 0
    return sum(frame.commit for frame in frames if frame.end <= position)


def cut(wal: bytes, length: int) -> bytes:
    """The first ``length`` bytes of the WAL: power went at that byte."""
    return wal[:length]


def flip(wal: bytes, position: int) -> bytes:
    """The WAL with every bit of one byte inverted."""
    damaged = bytearray(wal)
    damaged[position] ^= 0xFF
    return bytes(damaged)


# --- committed state ------------------------------------------------------------------

#: What "the state" of a store is here: every item's row and the ledger's length.
ITEMS_SQL = (
    "SELECT item_id, project_id, state, fence, attempts, owner, lease_expires_at, due_at,"
    " offload_handle, result, error, updated_at FROM items ORDER BY item_id"
)
EVENTS_SQL = "SELECT count(*), coalesce(max(event_id), 0) FROM events"


@dataclasses.dataclass(frozen=True)
class State:
    """The committed state, as a digest plus a summary for messages."""

    digest: str
    items: int
    by_state: tuple[tuple[str, int], ...]
    events: int
    rows: dict[int, tuple[str, int]]  # item_id -> (state, fence)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, State) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def describe(self) -> str:
        states = ", ".join(f"{name} {count}" for name, count in self.by_state)
        return f"{self.items} items ({states}), {self.events} events"


def read_state(conn: sqlite3.Connection) -> State:
    """The state ``conn`` sees, read in one transaction."""
    in_transaction = conn.in_transaction
    if not in_transaction:
        conn.execute("BEGIN")
    try:
        rows = conn.execute(ITEMS_SQL).fetchall()
        events = conn.execute(EVENTS_SQL).fetchone()
    finally:
        if not in_transaction:
            conn.execute("COMMIT")
    digest = hashlib.blake2b(repr((rows, events)).encode(), digest_size=16).hexdigest()
    by_state = collections.Counter(row[2] for row in rows)
    return State(
        digest,
        len(rows),
        tuple(sorted(by_state.items())),
        int(events[0]),
        {int(row[0]): (str(row[2]), int(row[3])) for row in rows},
    )


def read_state_of(path: pathlib.Path) -> State:
    """The committed state of the database at ``path``, read on a read-only connection."""
    conn = sqlite3.connect(path.as_uri() + "?mode=ro", uri=True, isolation_level=None)
    try:
        return read_state(conn)
    finally:
        conn.close()


# --- the workload ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ack:
    """An acknowledged call: what it was, the items it touched (their state and fence as
    it acknowledged them), the WAL's commit frames once it returned, and the state then."""

    number: int
    call: str
    touched: dict[int, tuple[str, int]]
    commits: int
    state: State


@dataclasses.dataclass(frozen=True)
class LiveCopy:
    """A copy of the database and its WAL read while the workload went on writing.

    ``first`` calls were acknowledged when the copy began, ``last`` by the time it was
    seen to have finished: it must come back as one of the states in between.
    """

    db: bytes
    wal: bytes
    first: int
    last: int


class _Copier(threading.Thread):
    """Reads the database file, then its WAL, a little at a time, while writes go on."""

    CHUNK = 1024

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(name="power-cuts-copier", daemon=True)
        self._path = path
        self.db = b""
        self.wal = b""

    def run(self) -> None:
        self.db = self._read(self._path)
        self.wal = self._read(self._path.with_name(self._path.name + "-wal"))

    def _read(self, path: pathlib.Path) -> bytes:
        parts = []
        with open(path, "rb") as source:
            while chunk := source.read(self.CHUNK):
                parts.append(chunk)
        return b"".join(parts)


@dataclasses.dataclass
class Workload:
    """A base database file, the WAL of a live store on it, and what it acknowledged."""

    db: bytes
    wal: bytes
    page_size: int
    frames: list[Frame]
    acks: list[Ack]  # acks[0] is the base: the state before the workload's first call
    refused: int  # calls refused as they should be (stale fences), which wrote nothing
    empty_claims: int  # claims that found nothing, which wrote nothing
    clock_end: float
    base_untouched: bool  # the database file was byte for byte the base when copied
    live: LiveCopy | None = None  # a copy taken while calls went on, if asked for

    @property
    def frame_size(self) -> int:
        return FRAME_HEADER + self.page_size

    @property
    def commit_frames(self) -> list[Frame]:
        return [frame for frame in self.frames if frame.commit]

    def calls(self) -> collections.Counter[str]:
        return collections.Counter(ack.call for ack in self.acks[1:])

    def ack_at(self, commits: int) -> int:
        """The index of the last ack whose commits are all among the first ``commits``."""
        index = 0
        for position, ack in enumerate(self.acks):
            if ack.commits <= commits:
                index = position
        return index


class _Run:
    """The live side of `generate`: the store, the clock, the WAL and the records."""

    def __init__(
        self,
        store: ControlStore,
        clock: ManualClock,
        watch: sqlite3.Connection,
        wal: WalWatcher,
        base: State,
    ) -> None:
        self.store = store
        self.clock = clock
        self._watch = watch
        self._wal = wal
        self.acks = [Ack(0, "base", {}, 0, base)]
        self.refused = 0
        self.empty_claims = 0
        self.claims: dict[int, int] = {}  # item_id -> fence, lease current
        self.offloaded: dict[int, int] = {}  # item_id -> fence
        self.lapsed: dict[int, int] = {}  # item_id -> fence, lease lapsed, not yet taken
        self.stale: list[tuple[int, int]] = []  # fences superseded by a takeover
        self.enqueued = 0
        self._commits = wal.commits()

    def ack(self, call: str, touched: dict[int, tuple[str, int]]) -> None:
        """Record an acknowledged call: it must have added exactly one commit, a state
        unlike the one before, and its items as it said."""
        commits = self._wal.commits()
        state = read_state(self._watch)
        number = len(self.acks)
        if commits != self._commits + 1:
            raise AssertionError(
                f"call {number} ({call}) added {commits - self._commits} commit frames, not 1"
            )
        if state == self.acks[-1].state:
            raise AssertionError(f"call {number} ({call}) left the state as it was")
        for item_id, expected in touched.items():
            if state.rows.get(item_id) != expected:
                raise AssertionError(
                    f"call {number} ({call}) acknowledged item {item_id} as {expected}, "
                    f"the database has {state.rows.get(item_id)}"
                )
        self._commits = commits
        self.acks.append(Ack(number, call, touched, commits, state))

    def nothing_written(self, call: str) -> None:
        """A call that must have written nothing (a refusal, an empty claim)."""
        if self._wal.commits() != self._commits:
            raise AssertionError(f"{call} wrote a commit")
        if read_state(self._watch) != self.acks[-1].state:
            raise AssertionError(f"{call} changed the state")

    # --- the calls -------------------------------------------------------------------

    async def enqueue(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        item_id = await self.store.enqueue(
            PROJECT,
            {"n": self.enqueued},
            priority=rng.randint(0, 3),
            service_class=rng.choice(("standard", "realtime")),
        )
        self.enqueued += 1
        self.ack("enqueue", {item_id: ("ready", 0)})

    async def enqueue_many(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        count = rng.randint(2, 4)
        jobs = [Job({"n": self.enqueued + k}, priority=rng.randint(0, 3)) for k in range(count)]
        ids = await self.store.enqueue_many(PROJECT, jobs)
        self.enqueued += count
        self.ack("enqueue_many", dict.fromkeys(ids, ("ready", 0)))

    async def claim_batch(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        claims = await self.store.claim_batch(f"w{rng.randint(1, 3)}", rng.randint(1, 3))
        if not claims:
            self.empty_claims += 1
            self.nothing_written("an empty claim")
            return
        took_over = False
        for claim in claims:
            old = self.lapsed.pop(claim.item_id, None)
            if old is not None:
                took_over = True
                self.stale.append((claim.item_id, old))
            self.claims[claim.item_id] = claim.fence
        self.ack(
            "takeover" if took_over else "claim_batch",
            {claim.item_id: ("claimed", claim.fence) for claim in claims},
        )

    async def renew(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        item_id, fence = rng.choice(sorted(self.claims.items()))
        await self.store.renew(item_id, fence=fence, lease_seconds=LEASE_SECONDS)
        self.ack("renew", {item_id: ("claimed", fence)})

    async def finish(
        self, rng: random.Random, *, item_id: int | None = None, status: str | None = None
    ) -> None:
        self.clock.advance(1)
        held = dict(sorted(self.claims.items()) + sorted(self.offloaded.items()))
        if item_id is None:
            item_id = rng.choice(sorted(held))
        fence = held[item_id]
        offloaded = self.offloaded.pop(item_id, None) is not None
        self.claims.pop(item_id, None)
        if status is None:
            status = "failed" if rng.random() < 0.25 else "done"
        if status == "done":
            await self.store.finish(item_id, fence=fence, result={"ok": item_id})
        else:
            await self.store.finish(item_id, fence=fence, status="failed", error="boom")
        call = "finish_offloaded" if offloaded else f"finish_{status}"
        self.ack(call, {item_id: (status, fence)})

    async def retry(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        item_id, fence = rng.choice(sorted(self.claims.items()))
        del self.claims[item_id]
        state = await self.store.retry(item_id, fence=fence, error="again", delay=rng.randint(1, 8))
        self.ack("retry", {item_id: (state, fence)})

    async def park(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        item_id, fence = rng.choice(sorted(self.claims.items()))
        del self.claims[item_id]
        await self.store.park(item_id, fence=fence, delay=rng.randint(1, 8))
        self.ack("park", {item_id: ("deferred", fence)})

    async def offload(self, rng: random.Random) -> None:
        self.clock.advance(1)  # every write gets its own updated_at
        item_id, fence = rng.choice(sorted(self.claims.items()))
        del self.claims[item_id]
        await self.store.offload(item_id, fence=fence, handle=f"batch-{rng.randint(1, 2)}")
        self.offloaded[item_id] = fence
        self.ack("offload", {item_id: ("offloaded", fence)})

    def lapse(self) -> None:
        """Let every current lease lapse (no call: the next claims take the items over)."""
        self.clock.advance(LEASE_SECONDS + 1)
        self.lapsed.update(self.claims)
        self.claims.clear()

    async def report_stale(self) -> None:
        """A late report with a superseded fence: refused, nothing written."""
        item_id, fence = self.stale.pop(0)
        try:
            await self.store.finish(item_id, fence=fence, result={"late": True})
        except FenceRejected:
            self.refused += 1
        else:
            raise AssertionError(f"a stale fence {fence} of item {item_id} was accepted")
        self.nothing_written("a refused stale report")

    async def step(self, rng: random.Random, items: int) -> None:
        """One call, chosen from those that can be made now."""
        options: list[tuple[str, int]] = []
        if self.enqueued < items:
            options += [("enqueue", 3), ("enqueue_many", 2)]
        options.append(("claim_batch", 4))
        if self.claims:
            options += [("renew", 2), ("finish", 4), ("retry", 2), ("park", 1), ("offload", 1)]
        if self.offloaded:
            options.append(("finish", 2))
        if self.stale:
            options.append(("report_stale", 1))
        if self.claims and not self.lapsed and rng.random() < 0.05:
            options.append(("lapse", 10))
        names = [name for name, _ in options]
        weights = [weight for _, weight in options]
        choice = rng.choices(names, weights)[0]
        if choice == "lapse":
            self.lapse()
        elif choice == "report_stale":
            await self.report_stale()
        else:
            await getattr(self, choice)(rng)


async def _opening(run: _Run, rng: random.Random) -> None:
    """A fixed start that makes every kind of call at least once."""
    await run.enqueue(rng)
    for _ in range(3):
        await run.enqueue_many(rng)  # 7 items at least
    while len(run.claims) < 6:
        await run.claim_batch(rng)
    await run.renew(rng)
    await run.offload(rng)
    await run.finish(rng, item_id=min(run.offloaded))
    await run.finish(rng, item_id=min(run.claims), status="failed")
    await run.finish(rng, item_id=min(run.claims), status="done")
    await run.retry(rng)
    await run.park(rng)
    run.lapse()  # at least one claim is still held: the takeover below takes it
    while run.lapsed:
        run.clock.advance(1)
        await run.claim_batch(rng)  # ends in a takeover
    while run.stale:
        await run.report_stale()
    while run.claims or run.offloaded:
        await run.finish(rng)


async def generate(
    directory: pathlib.Path,
    *,
    seed: int,
    items: int,
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    live_copy_at: int | None = None,
) -> Workload:
    """Run the workload on a fresh store in ``directory``; return its base, WAL and acks.

    About three calls per item; ``items`` of at least 10 make every kind of call. With
    ``live_copy_at``, a thread also copies the files while the workload goes on, from
    that step of its random part (`LiveCopy`).
    """
    rng = random.Random(seed)
    clock = ManualClock()
    path = directory / "live.db"

    def open_store() -> ControlStore:
        return ControlStore(
            path,
            clock=clock,
            lease_seconds=LEASE_SECONDS,
            synchronous=synchronous,
            rng=random.Random(seed),
        )

    # The schema and the project go into the base database: closing the last connection
    # checkpoints them into the file and removes the WAL.
    async with open_store() as store:
        await store.create_project(PROJECT, "Power")
    # Held from here to the copy: a read transaction on the bare file (the WAL is empty,
    # so it reads the database file alone), which no checkpoint may pass. No frame is
    # copied into the database file, and the WAL is never restarted.
    holder = sqlite3.connect(path, isolation_level=None)
    watch = sqlite3.connect(path.as_uri() + "?mode=ro", uri=True, isolation_level=None)
    store = open_store()
    try:
        holder.execute("BEGIN")
        base = read_state(holder)
        base_db = path.read_bytes()
        await store.open()
        run = _Run(store, clock, watch, WalWatcher(path.with_name(path.name + "-wal")), base)
        await _opening(run, rng)
        copier: _Copier | None = None
        live: LiveCopy | None = None
        first = 0
        for number in range(max(0, 3 * items - len(run.acks))):
            if number == live_copy_at:
                copier, first = _Copier(path), len(run.acks) - 1
                copier.start()
            await run.step(rng, items)
            if copier is not None and live is None and not copier.is_alive():
                live = LiveCopy(copier.db, copier.wal, first, len(run.acks) - 1)
        if copier is not None and live is None:
            copier.join()
            live = LiveCopy(copier.db, copier.wal, first, len(run.acks) - 1)
        # Power goes here: the store is open, its writer live. The database file is
        # copied first; nothing may have reached it, which the comparison checks.
        db, wal = _copy_files(path, directory / "at-power-loss.db")
        if read_state(holder) != base:
            raise AssertionError("the held read transaction moved")
    finally:
        watch.close()
        holder.close()
        await store.close()
    header = wal_header(wal)
    frames = frames_of(wal, header.page_size)
    if len(wal) != WAL_HEADER + len(frames) * (FRAME_HEADER + header.page_size):
        raise AssertionError("the WAL ends inside a frame")
    if any(frame.salt != header.salt for frame in frames):
        raise AssertionError("the WAL was restarted during the workload")
    if sum(frame.commit for frame in frames) != run.acks[-1].commits:
        raise AssertionError("the WAL holds commits the workload did not acknowledge")
    return Workload(
        db=db,
        wal=wal,
        page_size=header.page_size,
        frames=frames,
        acks=run.acks,
        refused=run.refused,
        empty_claims=run.empty_claims,
        clock_end=clock.now(),
        base_untouched=db == base_db,
        live=live,
    )


def _copy_files(path: pathlib.Path, to: pathlib.Path) -> tuple[bytes, bytes]:
    """Copy a live database and its WAL (``shutil.copyfile``); return their bytes."""
    wal, to_wal = path.with_name(path.name + "-wal"), to.with_name(to.name + "-wal")
    shutil.copyfile(path, to)
    shutil.copyfile(wal, to_wal)
    return to.read_bytes(), to_wal.read_bytes()


# --- checking a damaged copy -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Damage:
    """How a WAL was damaged: cut after ``position`` bytes, or one byte flipped there."""

    kind: str  # "wal-header", "boundary", "frame-header", "page-data", "full", "flip"
    position: int

    def apply(self, wal: bytes) -> bytes:
        return flip(wal, self.position) if self.kind == "flip" else cut(wal, self.position)

    def commits(self, frames: Sequence[Frame]) -> int:
        return commits_before(frames, self.position)

    def __str__(self) -> str:
        verb = "byte flipped at" if self.kind == "flip" else "cut at"
        return f"{self.kind} {verb} {self.position}"


def cut_kind(position: int, wal_size: int, frame_size: int) -> str:
    """Which part of the WAL a cut after ``position`` bytes falls in."""
    if position >= wal_size:
        return "full"
    if position < WAL_HEADER:
        return "wal-header"
    within = (position - WAL_HEADER) % frame_size
    if within == 0:
        return "boundary"
    return "frame-header" if within < FRAME_HEADER else "page-data"


@dataclasses.dataclass
class Outcome:
    """What one damaged copy came back as."""

    damage: Damage
    commits: int  # the commits its WAL should keep
    expected: int  # the index of the ack those commits end with
    matched: int | None = None  # the index of the ack whose state it came back with
    opened: bool = False
    writable: bool = False
    problems: list[Any] = dataclasses.field(default_factory=list)
    error: str | None = None
    state: State | None = None

    @property
    def lost(self) -> int:
        """Acknowledged calls before the cut that the copy lost (or all of them, if it
        did not come back as any acknowledged state)."""
        if self.matched is None:
            return self.expected
        return max(0, self.expected - self.matched)

    @property
    def phantom(self) -> int:
        """Calls after the cut that the copy nevertheless holds."""
        return 0 if self.matched is None else max(0, self.matched - self.expected)

    @property
    def ok(self) -> bool:
        return (
            self.opened
            and self.writable
            and not self.problems
            and self.error is None
            and self.matched == self.expected
        )

    def describe(self, workload: Workload) -> str:
        want = workload.acks[self.expected]
        text = (
            f"{self.damage}: expected {self.commits} commits, state after call "
            f"{self.expected} ({want.call}: {want.state.describe()})"
        )
        if self.error is not None:
            return f"{text}; failed: {self.error}"
        got = "no acknowledged state" if self.matched is None else f"call {self.matched}"
        seen = self.state.describe() if self.state is not None else "?"
        return (
            f"{text}; came back as {got} ({seen}), opened={self.opened}, "
            f"writable={self.writable}, ledger problems={self.problems}"
        )


async def check_copy(
    workload: Workload,
    damage: Damage,
    directory: pathlib.Path,
    *,
    expect_commits: int | None = None,
) -> Outcome:
    """Open the base plus a damaged WAL as a fresh store in ``directory`` and check it.

    ``expect_commits`` overrides the commits the damage predicts (to show the check can
    fail).
    """
    commits = damage.commits(workload.frames) if expect_commits is None else expect_commits
    outcome = Outcome(damage, commits, workload.ack_at(commits))
    path = _write_copy(directory, workload.db, damage.apply(workload.wal))
    states = {ack.state.digest: ack.number for ack in workload.acks}
    store = ControlStore(path, clock=ManualClock(workload.clock_end + 1))
    try:
        await store.open()
        outcome.opened = True
        outcome.problems = list(await verify_ledger(store))
        outcome.state = read_state_of(path)
        outcome.matched = states.get(outcome.state.digest)
        # Still a working store: a new project's item goes through claim and finish.
        await store.create_project("after", "After the power came back")
        item_id = await store.enqueue("after", {"after": True})
        claim = await store.claim(owner="survivor", project_id="after")
        if claim is not None and claim.item_id == item_id:
            await store.finish(item_id, fence=claim.fence, result="ok")
            outcome.writable = (await store.item(item_id))["state"] == "done"
        outcome.problems += list(await verify_ledger(store))
    except Exception as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        await store.close()
    return outcome


def _write_copy(directory: pathlib.Path, db: bytes, wal: bytes) -> pathlib.Path:
    """Write a database file and its WAL, as the power left them, into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "copy.db"
    path.write_bytes(db)
    path.with_name(path.name + "-wal").write_bytes(wal)
    return path


def sample_cuts(workload: Workload, count: int, rng: random.Random) -> list[Damage]:
    """About ``count`` cuts: the whole WAL; three inside the WAL header; the start of each
    of the first and last three frames, with a cut inside its header and one inside its
    page; each end of the last three commit frames and the byte either side; then random
    cuts (at a boundary, inside a frame header or inside a page, a third each)."""
    size = len(workload.wal)
    step = workload.frame_size
    chosen: set[int] = {size, 0, rng.randint(1, WAL_HEADER - 1), WAL_HEADER - 1}
    edge = workload.frames[:3] + workload.frames[-3:]
    for frame in edge:
        chosen |= {
            frame.offset,
            frame.offset + rng.randint(1, FRAME_HEADER - 1),
            frame.offset + FRAME_HEADER + rng.randint(0, workload.page_size - 1),
        }
    for frame in workload.commit_frames[-3:]:
        chosen |= {frame.end - 1, frame.end, min(size, frame.end + 1)}
    while len(chosen) < count:  # as many boundaries as cuts in headers and in pages
        frame = rng.choice(workload.frames)
        inside_header = rng.randint(1, FRAME_HEADER - 1)
        inside_page = FRAME_HEADER + rng.randint(0, workload.page_size - 1)
        chosen.add(frame.offset + rng.choice((0, inside_header, inside_page)))
    return [Damage(cut_kind(p, size, step), p) for p in sorted(chosen)]


def header_cuts() -> list[Damage]:
    """Cuts inside the WAL's 32-byte header: before it, in its fields, in its checksum."""
    return [Damage("wal-header", position) for position in (0, 1, 8, 16, 24, 31)]


def every_boundary(workload: Workload) -> list[Damage]:
    """A cut at every frame boundary, and the whole WAL."""
    size = len(workload.wal)
    return [Damage("boundary", frame.offset) for frame in workload.frames] + [Damage("full", size)]


def random_cuts(workload: Workload, count: int, rng: random.Random) -> list[Damage]:
    """``count`` cuts: a third anywhere in the WAL (its header included), a third inside a
    random frame's header, a third inside a random frame's page."""
    size = len(workload.wal)
    positions = []
    for number in range(count):
        frame = rng.choice(workload.frames)
        if number % 3 == 0:
            positions.append(rng.randint(0, size))
        elif number % 3 == 1:
            positions.append(frame.offset + rng.randint(1, FRAME_HEADER - 1))
        else:
            positions.append(frame.offset + FRAME_HEADER + rng.randint(0, workload.page_size - 1))
    return [Damage(cut_kind(p, size, workload.frame_size), p) for p in positions]


def live_cut(workload: Workload) -> Damage:
    """The live copy as a cut of the final WAL: the WAL only grew, so what the copier
    read is a prefix of it (and the database file is the base)."""
    live = workload.live
    if live is None:
        raise ValueError("the workload took no live copy")
    if live.db != workload.db or not workload.wal.startswith(live.wal):
        raise AssertionError("the live copy is not the base plus a prefix of the final WAL")
    size = len(live.wal)
    return Damage(cut_kind(size, len(workload.wal), workload.frame_size), size)


def flips(workload: Workload) -> list[Damage]:
    """A flipped byte in the WAL header, in the first commit frame, in the last frame's
    header (its checksum) and in the last frame's page."""
    first = workload.commit_frames[0]
    last = workload.frames[-1]
    return [
        Damage("flip", 12),  # the checkpoint sequence number, covered by the header checksum
        Damage("flip", first.offset + FRAME_HEADER + workload.page_size // 2),
        Damage("flip", last.offset + 16),
        Damage("flip", last.offset + FRAME_HEADER + workload.page_size // 2),
    ]


# --- the command ---------------------------------------------------------------------


@dataclasses.dataclass
class Totals:
    tried: int = 0
    opened: int = 0
    writable: int = 0
    lost: int = 0
    phantom: int = 0
    unmatched: int = 0
    problems: int = 0
    errors: int = 0
    by_kind: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)

    def add(self, outcome: Outcome, workload: Workload) -> None:
        self.tried += 1
        self.by_kind[outcome.damage.kind] += 1
        self.opened += outcome.opened
        self.writable += outcome.writable
        self.lost += outcome.lost
        self.phantom += outcome.phantom
        self.unmatched += outcome.opened and outcome.matched is None
        self.problems += len(outcome.problems)
        self.errors += outcome.error is not None
        if not outcome.ok:
            self.failures.append(outcome.describe(workload))


async def _main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="power-cuts-") as scratch:
        root = pathlib.Path(scratch)
        workload = await generate(root, seed=args.seed, items=args.items, live_copy_at=args.items)
        rng = random.Random(args.seed)
        damages = header_cuts() + every_boundary(workload)
        damages += random_cuts(workload, args.cuts, rng)
        damages += flips(workload)
        totals = Totals()
        for number, damage in enumerate(damages):
            where = root / f"copy-{number}"
            totals.add(await check_copy(workload, damage, where), workload)
            shutil.rmtree(where)
        assert workload.live is not None
        live = await check_copy(workload, live_cut(workload), root / "live-copy")
        live_ok = live.ok and workload.live.first <= (live.matched or 0) <= workload.live.last
    elapsed = time.monotonic() - started
    calls = ", ".join(f"{name} {count}" for name, count in sorted(workload.calls().items()))
    kinds = ", ".join(f"{name} {count}" for name, count in sorted(totals.by_kind.items()))
    print(
        f"workload: seed {args.seed}, {len(workload.acks) - 1} acknowledged calls ({calls}), "
        f"{workload.refused} refused stale reports, {workload.empty_claims} empty claims"
    )
    print(
        f"WAL: {len(workload.wal)} bytes, page size {workload.page_size}, "
        f"{len(workload.frames)} frames, {len(workload.commit_frames)} commit frames; "
        f"base database untouched: {workload.base_untouched}"
    )
    print(f"cut points tried:                 {totals.tried} ({kinds})")
    print(f"copies opened:                    {totals.opened}")
    print(f"copies that took new work:        {totals.writable}")
    print(f"acknowledged commits:             {workload.acks[-1].commits}")
    print(f"lost acknowledged-before-cut:     {totals.lost}")
    print(f"reflected after-cut (phantom):    {totals.phantom}")
    print(f"states matching no acknowledged:  {totals.unmatched}")
    print(f"ledger problems:                  {totals.problems}")
    print(f"errors:                           {totals.errors}")
    print(
        f"copy taken while writing:         {len(workload.live.wal)} WAL bytes "
        f"({live.damage.kind}), {workload.live.first} calls acknowledged when it began, "
        f"{workload.live.last} when it was seen done; came back as call {live.matched}, "
        f"as its WAL predicts: {live.ok}"
    )
    print(f"elapsed:                          {elapsed:.1f} s")
    for failure in totals.failures[:20]:
        print(f"FAILED {failure}")
    if not live_ok:
        print(f"FAILED the live copy: {live.describe(workload)}")
    bad = totals.failures or not workload.base_untouched or not live_ok
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuts", type=int, default=200, help="random cuts besides every boundary")
    parser.add_argument("--seed", type=int, default=7, help="seeds the workload and the cuts")
    parser.add_argument("--items", type=int, default=200, help="items the workload enqueues")
    args = parser.parse_args(argv)
    if args.cuts < 0 or args.items < 10:
        parser.error("--cuts must be >= 0 and --items >= 10")
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
