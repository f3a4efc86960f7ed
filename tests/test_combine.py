"""Combining rounds across processes (`asyncplane._combine`), with real OS processes: a
holder serves what others posted, and whoever dies when, every outcome stays knowable.

The scenes are staged with the writers' lock: a process holding it (`Holder`) keeps every
store's claim posted and waiting; the waiters' recheck is made long, so nothing moves
until the test wakes a slot (`Board file` below), the way a holder's nudge would.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import json
import marshal
import mmap
import os
import pathlib
import signal
import sqlite3
import struct
import sys
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import pytest
from tests.test_write_lock import Holder, until, writer_of

from asyncplane import (
    ControlStore,
    DatabaseLocked,
    FenceRejected,
    ItemCancelled,
    _backend,
    _combine,
    _errors,
    _write_lock,
    _write_queue,
    _writer,
    verify_ledger,
)

T = TypeVar("T")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the board needs Linux")

# A store in another process: it opens, says its slot, claims when told (a line on stdin),
# and prints what it got. DIE_AT makes it die as a holder: after running what it took but
# before COMMIT ("answer"), after COMMIT with the lock held ("committed"), or after letting
# the lock go, before marking the slots answered ("mark_answered").
PEER = """
import asyncio, json, os, sys
from asyncplane import ControlStore, _combine

path, owner, die_at = sys.argv[1:4]
_combine.RECHECK = 600.0
if die_at == "answer":
    _combine.Board.answer = lambda self, taken, outcomes: os._exit(9)
elif die_at == "committed":
    _combine.Board.committed = lambda self, taken, token: os._exit(9)
elif die_at == "mark_answered":
    _combine.Board.mark_answered = lambda self: os._exit(9)
elif die_at == "stall":
    answer = _combine.Board.answer
    def stalled(self, taken, outcomes):
        print("stalled", flush=True)
        sys.stdin.readline()
        answer(self, taken, outcomes)
    _combine.Board.answer = stalled

async def main():
    async with ControlStore(path) as store:
        board = (await store._engine.ready()).writer.board
        print("ready", board.slot, flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        got = await store.claim(owner, lease_seconds=600)
        print(json.dumps(None if got is None else got.item_id), flush=True)

asyncio.run(main())
"""


class BoardFile:
    """The board as the test sees it: each slot's state, and a nudge for a slot."""

    def __init__(self, database: pathlib.Path) -> None:
        self._path = database.with_name(database.name + _combine.SUFFIX)
        self._fd = os.open(self._path, os.O_RDWR)
        self._mem = mmap.mmap(self._fd, _combine._HEADERS)
        self._futex = _combine._Futex()

    def state(self, slot: int) -> int:
        value: int = struct.unpack_from("=I", self._mem, slot * _combine._HEADER)[0]
        return value

    def wake(self, slot: int) -> None:
        """As a holder's nudge: the slot's signal moved, its sleeper woken, on its thread
        (the futex) or on its event loop (a byte in the slot's wake pipe)."""
        word = ctypes.c_uint32.from_buffer(self._mem, slot * _combine._HEADER + _combine._SIGNAL)
        word.value += 1
        self._futex.wake(ctypes.addressof(word))
        del word
        try:  # as the holder does: no reader on the pipe now (ENXIO), the futex woke it
            pipe = os.open(_combine.wake_path(self._path, slot), os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            return
        try:
            os.write(pipe, b"\0")
        finally:
            os.close(pipe)

    def hold_slot(self, slot: int, held: bool = True) -> None:
        """Take a slot's own lock (or let it go), as a holder does to mark a post taken."""
        kind = fcntl.F_WRLCK if held else fcntl.F_UNLCK
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _combine._range_lock(kind, _combine.SLOTS + slot))

    def close(self) -> None:
        self._mem.close()
        os.close(self._fd)


class Peer:
    """A store in another process, whose claim is staged by the test."""

    def __init__(self, process: asyncio.subprocess.Process, slot: int) -> None:
        self.process = process
        self.slot = slot

    @classmethod
    async def start(cls, database: pathlib.Path, owner: str, die_at: str = "") -> Peer:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PEER, str(database), owner, die_at or "-",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        line = await cls._line(process)
        word, slot = line.split()
        assert word == "ready"
        return cls(process, int(slot))

    @staticmethod
    async def _line(process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        return (await process.stdout.readline()).decode().strip()

    async def tell(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        await self.process.stdin.drain()

    async def claims_posted(self, board: BoardFile) -> None:
        """Tell it to claim, and wait until the claim is posted (the lock held elsewhere)."""
        await self.tell()
        await until(lambda: board.state(self.slot) == _combine.POSTED)

    async def line(self) -> str:
        return await self._line(self.process)

    async def ended(self) -> int:
        return await self.process.wait()


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's waiters look at the lock only when woken (the test does it)."""
    monkeypatch.setattr(_combine, "RECHECK", 600.0)


async def served_by(
    peer: Peer, request: Coroutine[Any, Any, T], path: pathlib.Path, board: BoardFile, slot: Any
) -> asyncio.Task[T]:
    """The peer's claim and ``request`` both posted behind a held writers' lock; then the
    lock let go and the peer woken, as a nudge would: it takes the lock, and serves both."""
    holder = await Holder.start(path)
    await peer.claims_posted(board)
    task = asyncio.create_task(request)
    await until(lambda: board.state(slot.slot) == _combine.POSTED)
    await holder.let_go()
    board.wake(peer.slot)
    return task


async def seeded(path: pathlib.Path, items: int) -> ControlStore:
    store = ControlStore(path)
    await store.create_project("alpha", "Alpha")
    await store.enqueue_many("alpha", [{"n": n} for n in range(items)])
    return store


@contextlib.asynccontextmanager
async def scene(
    path: pathlib.Path, store: ControlStore | None = None
) -> AsyncIterator[tuple[ControlStore, BoardFile, _combine.Board]]:
    """A store on ``path`` (three items, unless one is given), the board as the test sees
    it, and the store's own slot; the board and the store closed after."""
    store = store or await seeded(path, 3)
    board = BoardFile(path)
    try:
        mine = (await writer_of(store)).board
        assert mine is not None
        yield store, board, mine
    finally:
        board.close()
        await store.close()


async def posted_claim(
    path: pathlib.Path, store: ControlStore, board: BoardFile, slot: int
) -> tuple[Holder, asyncio.Task[Any]]:
    """A claim of ``store`` posted on the board behind the writers' lock, which another
    process holds (the holder returned: the test lets it go)."""
    holder = await Holder.start(path)
    claim = asyncio.create_task(store.claim("here", lease_seconds=600))
    await until(lambda: board.state(slot) == _combine.POSTED)
    return holder, claim


async def nothing_written(path: pathlib.Path) -> None:
    """The store on ``path``, opened again, holds no claim and a clean ledger."""
    async with ControlStore(path) as after:
        assert await claimed_by(after) == {}
        assert await verify_ledger(after) == []


async def claimed_by(store: ControlStore) -> dict[int, str]:
    rows = await store.items(state="claimed")
    return {row["item_id"]: row["owner"] for row in rows}


@pytest.mark.parametrize("in_order", [True, False], ids=["x86", "weakly ordered"])
async def test_a_holder_serves_the_claims_another_process_posted(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch, in_order: bool
) -> None:
    # A weakly ordered machine (ARM) posts and collects under the slot's lock.
    monkeypatch.setattr(_combine, "_STORES_IN_ORDER", in_order)
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        peer = await Peer.start(path, "peer")
        claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
        got = await claim
        assert got is not None
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0
        assert mine.served_by_others == 1  # answered by the peer, not run here
        assert sorted((await claimed_by(store)).values()) == ["here", "peer"]
        assert await verify_ledger(store) == []


async def test_a_round_served_elsewhere_never_goes_to_the_connection_thread(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The event loop posts the round and sleeps on the slot's wake pipe; the holder's
    # answers are collected there, with no hand-off to this store's thread and back.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        rounds = _counted_rounds(monkeypatch)
        peer = await Peer.start(path, "peer")
        claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
        assert await claim is not None
        assert mine.served_by_others == 1
        assert rounds == []  # posted, waited for and collected on the event loop
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0


@pytest.mark.parametrize("lock", ["busy", "never had"])
async def test_an_answered_slot_whose_lock_stays_busy_is_collected_on_the_thread(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch, lock: str
) -> None:
    # The loop tries the slot's lock without waiting; if it never comes (a lock that
    # cannot be had, ENOLCK, looks so too), the loop stops trying after a few looks and
    # the thread waits for it, instead of the loop trying every half millisecond forever.
    # If the thread cannot have it either, the claim a holder answered may have been
    # saved (here it was): its caller hears CommitOutcomeUnknown, not a failure.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        rounds = _counted_rounds(monkeypatch)
        peer = await Peer.start(path, "peer")
        with monkeypatch.context() as busy:
            busy.setattr(mine, "_slot_lock", lambda slot: False)
            if lock == "never had":
                busy.setattr(mine, "_slot_lock_wait", _raises(OSError(errno.ENOLCK, "no locks")))
            claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
            await until(lambda: len(rounds) == 1)  # collected on the thread
            if lock == "never had":
                with pytest.raises(_errors.CommitOutcomeUnknown, match="could not be read"):
                    await claim
        if lock == "busy":
            assert await claim is not None
            assert mine.served_by_others == 1
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0
        assert sorted((await claimed_by(store)).values()) == ["here", "peer"]
        assert await verify_ledger(store) == []


async def test_an_unserved_post_whose_slot_lock_cannot_be_had_runs_here_under_the_lock(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The post is still unserved when this process has the writers' lock for it, and the
    # slot's own lock cannot be had (ENOLCK): nobody can take a post while that lock is
    # held, so it is taken back and run here, rather than called of unknown outcome and
    # left posted for a later holder to commit.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        holder, claim = await posted_claim(path, store, board, mine.slot)
        try:
            no_locks = _raises(OSError(errno.ENOLCK, "no locks"))
            monkeypatch.setattr(mine, "_slot_lock_wait", no_locks)
        finally:
            await holder.let_go()
        board.wake(mine.slot)  # the loop looks, finds the lock free: the thread runs it
        got = await asyncio.wait_for(claim, 30)
        assert got is not None
        assert board.state(mine.slot) == _combine.EMPTY
        assert mine.served_by_others == 0
    monkeypatch.undo()
    async with ControlStore(path) as after:
        assert await claimed_by(after) == {got.item_id: "here"}
        assert await verify_ledger(after) == []


async def test_a_post_that_breaks_on_the_loop_fails_its_round_and_leaves_no_post(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Posting raises (a bug): the round's callers hear it at once, the writer stops
    # failed, and no post is left for a holder to run.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        holder = await Holder.start(path)
        try:
            monkeypatch.setattr(mine, "post", _raises(ValueError("a bug")))
            with pytest.raises(_errors.StorageError, match="a bug") as raised:
                await asyncio.wait_for(store.claim("here", lease_seconds=600), 30)
            assert not isinstance(raised.value, _errors.CommitOutcomeUnknown)
            assert board.state(mine.slot) == _combine.EMPTY
        finally:
            await holder.let_go()
    monkeypatch.undo()
    await nothing_written(path)


def _counted_rounds(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The rounds this process's connection threads run from now on."""
    rounds: list[object] = []
    execute_round = _writer._execute_round

    def counted(*args: Any) -> None:
        rounds.append(args[1])
        execute_round(*args)

    monkeypatch.setattr(_writer, "_execute_round", counted)
    return rounds


async def test_a_holder_wakes_a_slot_whose_wake_pipe_was_made_anew(
    tmp_path: pathlib.Path, patient: None
) -> None:
    # A holder keeps each slot's wake pipe open; when a later owner of the slot makes the
    # pipe anew (another inode, named in the slot's header), the holder opens that one.
    path = tmp_path / "store.db"
    async with scene(path, await seeded(path, 4)) as (store, board, mine):
        slots = []
        for n in range(2):
            peer = await Peer.start(path, f"peer{n}")  # waits on its loop, for the pipe only
            holder = await Holder.start(path)
            await peer.claims_posted(board)
            await holder.let_go()
            assert await store.claim("here", lease_seconds=600) is not None  # serves it
            assert json.loads(await asyncio.wait_for(peer.line(), 30)) is not None
            assert await peer.ended() == 0
            slots.append(peer.slot)
            board_path = path.with_name(path.name + _combine.SUFFIX)
            _combine.wake_path(board_path, peer.slot).unlink()  # the next owner makes one
        assert slots[0] == slots[1]
        assert mine.served_for_others == 2
        assert sorted((await claimed_by(store)).values()) == ["here", "here", "peer0", "peer1"]


async def test_a_post_unserved_for_long_queues_for_the_lock_on_the_connection_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The holders may be writers that do not combine: after a few looks the loop hands
    # the posted round to the thread, which waits in the queue for a turn of its own.
    monkeypatch.setattr(_combine, "RECHECK", 0.01)
    monkeypatch.setattr(_writer, "_LOOKS_BEFORE_QUEUEING", 3)
    path = tmp_path / "store.db"
    async with scene(path) as (store, _, mine):
        writer = await writer_of(store)
        assert writer.write_lock is not None
        holder = await Holder.start(path)
        claim = asyncio.create_task(store.claim("here", lease_seconds=600))
        await until(lambda: writer.write_lock is not None and writer.write_lock.waiting)
        assert mine.state() == _combine.POSTED  # still posted while it queues
        await holder.let_go()
        assert await claim is not None
        assert mine.served_by_others == 0  # its own turn ran it
        assert mine.state() == _combine.EMPTY
        assert await verify_ledger(store) == []


async def test_a_writer_cancelled_with_a_post_out_sees_the_round_to_its_end(
    tmp_path: pathlib.Path, patient: None
) -> None:
    # The writer task is cancelled (the loop shutting down) while its round waits on the
    # board: the connection's thread takes the round over before the connection closes,
    # so it still runs to its end, once the lock comes, and the caller hears what it got.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        writer = await writer_of(store)
        slot = mine.slot
        holder, claim = await posted_claim(path, store, board, slot)
        assert writer._task is not None
        writer._task.cancel()
        await until(lambda: writer.write_lock is not None and writer.write_lock.waiting)
        await holder.let_go()
        got = await claim
        assert got is not None
        await asyncio.wait([writer._task])
        assert board.state(slot) == _combine.EMPTY
    async with ControlStore(path) as after:
        assert [row["owner"] for row in await after.items(state="claimed")] == ["here"]
        assert await verify_ledger(after) == []


@pytest.mark.parametrize("where", ["look", "hand-off", "hand-off, a holder at the slot"])
async def test_a_post_the_loop_can_no_longer_see_through_is_taken_back_unwritten(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # Looking at the posted round breaks (a bug), or the connection's thread cannot take
    # it over once the lock is free: the post is taken back before the caller hears of it,
    # so that no holder commits a round whose caller was told it failed. With the loop
    # holding the writers' lock, that holds even while a holder that let go is at the
    # slot's own lock: no one can take the post meanwhile, so it is taken back without it.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        writer = await writer_of(store)
        holder, claim = await posted_claim(path, store, board, mine.slot)
        if where == "look":
            monkeypatch.setattr(writer, "_look_at", _raises(RuntimeError("a bug")))
        else:
            monkeypatch.setattr(_writer._connection, "post", _raises(ValueError("closed")))
            await holder.let_go()
            if where.endswith("slot"):
                board.hold_slot(mine.slot)
        board.wake(mine.slot)
        with pytest.raises(_errors.StorageError, match=r"a bug|closed") as raised:
            await claim
        assert not isinstance(raised.value, _errors.CommitOutcomeUnknown)
        if where.endswith("slot"):
            board.hold_slot(mine.slot, held=False)
        assert board.state(mine.slot) == _combine.EMPTY
        if where == "look":
            await holder.let_go()
        lock = _write_lock.open_write_lock(path)
        assert lock is not None
        assert lock.try_acquire()  # the writers' lock was let go
        lock.release()
        lock.close()
    monkeypatch.undo()
    await nothing_written(path)


@pytest.mark.parametrize("then", ["asked again", "writer cancelled"])
async def test_a_broken_post_whose_slot_a_holder_is_at_is_taken_back_once_it_lets_go(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    # Looking at the posted round breaks while a holder is at the slot's own lock (a
    # process descheduled there, say): the loop does not call the round's outcome unknown
    # after an instant of tries, it asks again a moment later, the round still on (its
    # busy_timeout moot meanwhile), and takes the post back once the slot's lock is free;
    # or, the writer cancelled meanwhile (the loop shutting down), at once as it closes,
    # while the board is still open.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        writer = await writer_of(store)
        asked = [0]
        retract = mine.retract

        def counted() -> bool | None:
            asked[0] += 1
            return retract()

        monkeypatch.setattr(mine, "retract", counted)
        if then == "writer cancelled":  # no look of its own comes round before it closes
            monkeypatch.setattr(_writer, "_BUSY_SLOT", 600.0)
        holder, claim = await posted_claim(path, store, board, mine.slot)  # counted retract
        try:
            board.hold_slot(mine.slot)
            monkeypatch.setattr(writer, "_look_at", _raises(RuntimeError("a bug")))
            board.wake(mine.slot)
            await until(lambda: asked[0] >= (3 if then == "asked again" else 1))
            assert not claim.done()
            assert writer._timer is None  # no busy_timeout to hear instead of the bug
            board.hold_slot(mine.slot, held=False)
            if then == "writer cancelled":  # before its next look comes round
                task = writer._task
                assert task is not None
                task.cancel()
            with pytest.raises(_errors.StorageError, match="a bug") as raised:
                await asyncio.wait_for(claim, 30)
            assert not isinstance(raised.value, _errors.CommitOutcomeUnknown)
            assert board.state(mine.slot) == _combine.EMPTY
        finally:
            await holder.let_go()
    monkeypatch.undo()
    await nothing_written(path)


async def test_a_post_a_holder_has_taken_when_looking_breaks_may_have_been_saved(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The holder elsewhere has the round and will commit it: the caller cannot be told it
    # failed, only that it may have been saved (and here it was).
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        writer = await writer_of(store)
        peer = await Peer.start(path, "peer", "stall")
        claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
        assert await peer.line() == "stalled"  # holding the lock, this claim taken
        monkeypatch.setattr(writer, "_look_at", _raises(RuntimeError("a bug")))
        board.wake(mine.slot)
        with pytest.raises(_errors.CommitOutcomeUnknown, match="holder had taken"):
            await claim
        await peer.tell()  # the holder goes on, and commits it
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0
    monkeypatch.undo()
    async with ControlStore(path) as after:
        assert sorted((await claimed_by(after)).values()) == ["here", "peer"]
        assert await verify_ledger(after) == []


def _raises(error: Exception) -> Any:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise error

    return broken


async def test_a_holder_runs_no_claim_that_rode_on_a_settle_it_refused(
    tmp_path: pathlib.Path, patient: None
) -> None:
    # finish_and_claim's claim rides on its settle (`Grouped.after`) across the board
    # too: the peer serving the post refuses the settle, so it never runs the claim.
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        held = await store.claim("here", lease_seconds=600)
        assert held is not None
        peer = await Peer.start(path, "peer")
        call = await served_by(
            peer,
            store.finish_and_claim(held.item_id, fence=held.fence + 1, owner="here"),
            path, board, mine,
        )  # fmt: skip
        with pytest.raises(FenceRejected):
            await call
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0
        assert mine.served_by_others == 1  # answered by the peer, not run here
        assert sorted((await claimed_by(store)).values()) == ["here", "peer"]
        for item_id in (1, 2, 3):
            types = [e["event_type"] for e in await store.events(item_id)]
            assert "released" not in types, (item_id, types)  # no claim made to give back
        assert await verify_ledger(store) == []


@pytest.mark.parametrize(
    ("die_at", "saved"),
    [
        ("answer", False),  # the holder died before COMMIT: the waiter runs its claim
        ("committed", True),  # after COMMIT: the waiter takes the answers it left
        ("mark_answered", True),  # the lock let go, the slots not yet marked: the same
    ],
)
async def test_a_holder_that_dies_leaves_its_takers_an_outcome_they_can_know(
    tmp_path: pathlib.Path, patient: None, die_at: str, saved: bool
) -> None:
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        peer = await Peer.start(path, "peer", die_at)
        claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
        assert await peer.ended() == 9  # died holding the lock, this claim taken
        assert board.state(mine.slot) == _combine.TAKEN
        board.wake(mine.slot)  # as the recheck would: the lock is free, the slot taken
        got = await claim
        assert got is not None
        owners = await claimed_by(store)
        assert owners[got.item_id] == "here"
        # The peer's own claim stands exactly when its round committed.
        assert sorted(owners.values()) == (["here", "peer"] if saved else ["here"])
        assert mine.served_by_others == (1 if saved else 0)
        assert await verify_ledger(store) == []


async def test_a_holder_letting_go_wakes_a_post_that_came_after_its_look(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store.db"
    store = await seeded(path, 3)
    took = threading.Event()
    proceed = threading.Event()
    posted = _combine.Board.posted

    def held_after_look(board: _combine.Board) -> bool:
        seen = posted(board)
        took.set()
        proceed.wait(60)  # on the connection's thread, the lock held
        return seen

    board = BoardFile(path)
    try:
        peer = await Peer.start(path, "peer")  # looks at the lock only when woken
        monkeypatch.setattr(_combine.Board, "posted", held_after_look)
        mine = asyncio.create_task(store.claim("here", lease_seconds=600))
        await asyncio.to_thread(took.wait, 60)  # this store holds the lock, its look done
        await peer.claims_posted(board)  # too late to take
        proceed.set()
        assert await mine is not None
        # Only the nudge of this store letting go can wake the peer: its claim goes on.
        assert json.loads(await asyncio.wait_for(peer.line(), 60)) is not None
        assert await peer.ended() == 0
        assert sorted((await claimed_by(store)).values()) == ["here", "peer"]
    finally:
        proceed.set()
        board.close()
        await store.close()


async def test_a_holder_serves_no_post_of_a_process_in_another_writers_queue(
    tmp_path: pathlib.Path, patient: None
) -> None:
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, mine):
        # The queue's file replaced while this store has the old one open: a process that
        # opens now waits in another queue, whose lock this store never holds.
        path.with_name(path.name + _write_lock.SUFFIX).unlink()
        peer = await Peer.start(path, "peer")
        holder = await Holder.start(path)  # the new file's lock
        await peer.claims_posted(board)
        assert await store.claim("here", lease_seconds=600) is not None  # the old file's
        assert mine.served_for_others == 0  # the peer's post was left to its own queue
        assert board.state(peer.slot) == _combine.POSTED
        await holder.let_go()
        board.wake(peer.slot)
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0
        assert sorted((await claimed_by(store)).values()) == ["here", "peer"]


async def test_a_post_whose_owner_died_is_not_served_and_its_slot_is_cleared(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "store.db"
    async with scene(path) as (store, board, _):
        peer = await Peer.start(path, "peer")
        holder = await Holder.start(path)
        await peer.claims_posted(board)
        peer.process.kill()
        assert await peer.ended() == -signal.SIGKILL
        await holder.let_go()
        got = await store.claim("here", lease_seconds=600)
        assert got is not None
        assert list((await claimed_by(store)).values()) == ["here"]  # nothing for the dead
        assert board.state(peer.slot) == _combine.POSTED  # left as it was, owner gone
        async with ControlStore(path) as later:  # takes the dead owner's slot: cleared
            slot = (await writer_of(later)).board
            assert slot is not None and slot.slot == peer.slot
            assert board.state(peer.slot) == _combine.EMPTY
            assert await later.claim("later", lease_seconds=600) is not None
        assert await verify_ledger(store) == []


@pytest.mark.parametrize("post", ["taken back", "refused"])
async def test_a_posted_claim_given_up_after_busy_timeout_is_taken_back_unwritten(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, post: str
) -> None:
    # "refused": a round too big for a slot (here: any round) waits for its own turn on
    # the thread, and busy_timeout still gives it up, nothing written.
    if post == "refused":
        monkeypatch.setattr(_combine, "_REQUEST_ROOM", 0)
    path = tmp_path / "store.db"
    async with ControlStore(path, busy_timeout=0.3) as store:
        await store.create_project("alpha", "Alpha")
        await store.enqueue("alpha", {"n": 1})
        mine = (await writer_of(store)).board
        assert mine is not None
        holder = await Holder.start(path)
        try:
            with pytest.raises(DatabaseLocked, match="busy_timeout"):
                await asyncio.wait_for(store.claim("here", lease_seconds=600), 30)
            assert mine.state() == _combine.EMPTY  # the post was taken back, or never made
        finally:
            await holder.let_go()
        assert (await store.counts())["ready"] == 1  # nothing was written
        assert await store.claim("here", lease_seconds=600) is not None


async def test_a_claim_a_holder_has_taken_is_not_given_up_but_served(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store.db"
    store = ControlStore(path, busy_timeout=0.3)
    await store.create_project("alpha", "Alpha")
    await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    refused: list[bool] = []
    give_up = _write_lock.Turn.give_up

    def recorded(turn: _write_lock.Turn) -> bool | None:
        result = give_up(turn)
        refused.append(result is False)
        return result

    monkeypatch.setattr(_write_lock.Turn, "give_up", recorded)
    async with scene(path, store) as (store, board, mine):
        peer = await Peer.start(path, "peer", "stall")
        claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
        assert await peer.line() == "stalled"  # holding the lock, this claim taken
        await until(lambda: refused == [True])  # busy_timeout passed: not given up
        await peer.tell()  # the holder goes on, and answers
        got = await claim
        assert got is not None
        assert (await claimed_by(store))[got.item_id] == "here"
        assert await peer.ended() == 0
        assert await verify_ledger(store) == []


async def test_busy_timeout_passing_as_a_served_claim_is_collected_gives_nothing_up(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # busy_timeout can pass in the instant the thread collects its answered claim (the slot
    # already emptied, its outcome not yet handed out): the round has begun by then, so
    # giving it up fails, and the caller hears its claim, never DatabaseLocked for it.
    path = tmp_path / "store.db"
    store = await seeded(path, 3)
    turns: list[_write_lock.Turn] = []
    stopped: list[bool | None] = []
    init = _write_lock.Turn.__init__
    collect = _combine.Board.collect

    def recorded(turn: _write_lock.Turn) -> None:
        init(turn)
        turns.append(turn)

    def collected_as_time_runs_out(
        board: _combine.Board, ops: Any, committed: Any, **how: Any
    ) -> list[Any] | None:
        answers = collect(board, ops, committed, **how)
        stopped.append(turns[-1].give_up())  # as the loop's timer would, this instant
        return answers

    monkeypatch.setattr(_write_lock.Turn, "__init__", recorded)
    monkeypatch.setattr(_combine.Board, "collect", collected_as_time_runs_out)
    async with scene(path, store) as (store, board, mine):
        peer = await Peer.start(path, "peer")
        claim = await served_by(peer, store.claim("here", lease_seconds=600), path, board, mine)
        got = await claim
        assert got is not None
        assert stopped == [False]  # not given up: the post stays collected
        assert mine.state() == _combine.EMPTY
        assert mine.served_by_others == 1
        assert (await claimed_by(store))[got.item_id] == "here"
        assert json.loads(await peer.line()) is not None
        assert await peer.ended() == 0
        assert await verify_ledger(store) == []


@pytest.mark.parametrize(
    "error",
    [
        FenceRejected(7, 2, current_fence=3, state="claimed"),
        ItemCancelled(7, 2, current_fence=3, reason="operator"),
        _errors.UnknownItem("item 7 does not exist"),
        _errors.ScopeDenied("not yours"),
    ],
)
def test_a_refusal_crosses_the_board_as_the_same_typed_error(error: Exception) -> None:
    encoded = _combine._encode_outcome(_write_queue.Raised(error))
    back = _combine._decode_outcome("finish", encoded)
    assert isinstance(back, _write_queue.Raised)
    assert type(back.error) is type(error)
    assert str(back.error) == str(error)
    assert vars(back.error) == vars(error)


def test_a_storage_error_crosses_the_board_with_the_drivers_error_as_its_cause(
    tmp_path: pathlib.Path,
) -> None:
    with contextlib.closing(sqlite3.connect(tmp_path / "x.db")) as conn:
        try:
            conn.execute("SELECT * FROM nowhere")
        except sqlite3.OperationalError as exc:
            driver = exc
    error = _errors.StorageError(f"OperationalError: {driver}")
    error.__cause__ = driver
    encoded = marshal.loads(marshal.dumps(_combine._encode_outcome(_write_queue.Raised(error))))
    back = _combine._decode_outcome("finish", encoded)
    assert isinstance(back, _write_queue.Raised) and type(back.error) is _errors.StorageError
    cause = back.error.__cause__
    assert type(cause) is sqlite3.OperationalError and str(cause) == "no such table: nowhere"
    if sys.version_info >= (3, 11):  # the driver says the code from 3.11 on
        assert (cause.sqlite_errorcode, cause.sqlite_errorname) == (1, "SQLITE_ERROR")


def test_an_error_the_board_does_not_know_comes_back_as_a_storage_error() -> None:
    back = _combine._decode_outcome("finish", ("e", "os.system", ("true",)))
    assert isinstance(back, _write_queue.Raised)
    assert type(back.error) is _errors.StorageError


async def test_claims_whose_answers_outgrow_the_slot_come_back_whole(
    tmp_path: pathlib.Path, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The answer waits in a file beside the board: the connection's thread reads it,
    # never the event loop.
    path = tmp_path / "store.db"
    store = ControlStore(path)
    await store.create_project("alpha", "Alpha")
    big = "x" * (300 * 1024)
    await store.enqueue_many("alpha", [{"n": n, "blob": big} for n in range(6)])
    rounds = _counted_rounds(monkeypatch)
    async with scene(path, store) as (store, board, mine):
        peer = await Peer.start(path, "peer")
        request = store.claim_batch("here", 5, lease_seconds=600)
        batch = await served_by(peer, request, path, board, mine)
        got = await batch
        assert mine.served_by_others == 1
        assert sorted(item.payload["n"] for item in got) == sorted(
            row["payload"]["n"]
            for row in await store.items(state="claimed")
            if row["owner"] == "here"
        )
        assert all(item.payload["blob"] == big for item in got) and len(got) == 5
        assert len(rounds) == 1  # collected on the thread
        assert await peer.ended() == 0


def test_a_combined_round_keeps_its_own_order_and_puts_like_with_like() -> None:
    def plain(db: object, now: float) -> None:
        """An enqueue, say: not a group's."""

    def grouped(key: str) -> _write_queue.Grouped[None]:
        return _write_queue.Grouped((key,), None, list, key == "finish")

    own = [grouped("claim"), plain, grouped("claim"), grouped("finish")]
    taken = [grouped("finish"), grouped("claim"), grouped("other"), grouped("claim")]
    every = [*own, *taken]
    order = _write_queue.combined_order(every, len(own))
    # Its own four in their order; the taken claims after its last claim, and the taken
    # finish no later than them (a poster's settle before its claim), a kind of its own
    # at the end.
    assert order == [0, 1, 2, 4, 5, 7, 3, 6]
    ordered = [every[i] for i in order]
    assert _write_queue.units(ordered, range(8)) == [[0], [1], [3, 6], [2, 4, 5], [7]]
    # A poster's [finish, claim] behind a holder whose last claim comes before an
    # enqueue: the finish still runs first, even if the claims' unit breaks.
    own = [grouped("claim"), plain]
    every = [*own, grouped("finish"), grouped("claim")]
    order = _write_queue.combined_order(every, len(own))
    assert order == [0, 2, 3, 1]
    ordered = [every[i] for i in order]
    assert _write_queue.units(ordered, range(4)) == [[1], [0, 2], [3]]
    assert _write_queue.units(ordered, range(4), alone={0, 2}) == [[1], [0], [2], [3]]


async def test_a_post_naming_a_request_out_of_its_range_is_read_as_another_layout(
    tmp_path: pathlib.Path,
) -> None:
    # A post's requests name the one each rides on by its place in the post. A holder
    # reads a post whose place is out of range (only a corrupt or forged board has one)
    # as it reads another version's: not served, rather than raised on the holder.
    async with scene(tmp_path / "store.db") as (_, _, mine):
        finish = _backend.finish_request(
            _backend.FinishOp(1, 1, "done", None, None, None), mine._kinds["finish"]
        )
        claim = _write_queue.Grouped(
            ("claim",), _backend.ClaimOp("here", 1, 30.0, None, None), mine._kinds["claim"]
        )
        claim.after = finish
        assert mine.post([finish, claim])
        request_len = mine._head(mine.slot)[2]
        read = mine._read_post(mine.slot, request_len)
        assert read is not None and read[1].after is read[0]  # the place, read back
        wire = marshal.loads(
            os.pread(mine._fd, request_len, _combine._HEADERS + mine.slot * _combine._BODY)
        )
        assert [after for *_, after in wire] == [-1, 0]
        for place in (2, 7):
            body = marshal.dumps([*wire[:1], (*wire[1][:3], place)])
            os.pwrite(mine._fd, body, _combine._HEADERS + mine.slot * _combine._BODY)
            assert mine._read_post(mine.slot, len(body)) is None
        assert mine.retract()


async def test_a_file_of_another_kind_named_like_the_board_is_left_alone(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A store named "jobs-combine" beside the store "jobs": the board's name. Taken for a
    # board, it would be written over, slot words and posts on its pages.
    async with ControlStore(tmp_path / "jobs-combine") as other:
        await other.create_project("p", "P")
        await other.enqueue_many("p", [{"n": n} for n in range(5)])
    before = (tmp_path / "jobs-combine").read_bytes()
    async with ControlStore(tmp_path / "jobs") as store:
        assert (await writer_of(store)).board is None
        await store.create_project("q", "Q")
        await store.enqueue("q", {})
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)
    assert (tmp_path / "jobs-combine").read_bytes() == before
    assert "is not a combining board" in caplog.text
    async with ControlStore(tmp_path / "jobs-combine") as other:
        assert (await other.counts())["ready"] == 5


async def test_two_boards_of_one_database_keep_their_rounds_tokens_apart(
    tmp_path: pathlib.Path,
) -> None:
    # The board deleted while processes use it, and made anew by the next: both number
    # their slots from 0. A waiter on one must never take a round served on the other's
    # slot of its number for its own (its requests would be run twice, or refused).
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "P")
        first = (await writer_of(store)).board
        assert first is not None
        (tmp_path / f"s.db{_combine.SUFFIX}").unlink()
        lock = _write_lock.open_write_lock(tmp_path / "s.db")
        assert lock is not None
        second = _combine.open_board(tmp_path / "s.db", {}, lock)
        assert second is not None and second.slot == first.slot
        try:
            db = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
            token = os.urandom(16)
            db.execute(
                "INSERT OR REPLACE INTO combined_rounds (slot, token) VALUES (?, ?)",
                (second.row(second.slot), token),
            )  # served on the second board's slot
            assert _writer._committed(db, second, token)
            assert not _writer._committed(db, first, token)
            db.close()
        finally:
            second.close()
            lock.close()
