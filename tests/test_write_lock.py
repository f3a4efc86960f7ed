"""The queue in front of SQLite's write lock (`asyncplane._write_lock`), with real OS
processes holding their place in it: writes wait their turn, give up after busy_timeout
with nothing written, and a holder's death lets the next one go."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest

from asyncplane import ControlStore, DatabaseLocked, _write_lock, _writer

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

# Holds the queue's lock until told (a line on stdin), or until it is killed.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


class Holder:
    """Another process that holds the store's place at the head of the write queue."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, database: pathlib.Path) -> Holder:
        lock_file = database.with_name(database.name + _write_lock.SUFFIX)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLDER, str(lock_file),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        assert (await process.stdout.readline()).strip() == b"held"
        return cls(process)

    async def let_go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        await self.process.stdin.drain()
        assert await self.process.wait() == 0

    async def kill(self) -> None:
        self.process.kill()
        await self.process.wait()


async def writer_of(store: ControlStore) -> _writer.Writer:
    writer = (await store._engine.ready()).writer
    assert isinstance(writer, _writer.Writer)
    return writer


async def until(condition: Callable[[], bool]) -> None:
    """Wait for a state of the writer's thread (which no event marks), a millisecond at a
    time, for at most ten seconds."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never came")


async def test_the_queue_file_sits_beside_the_store(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store.db"
    async with ControlStore(path) as store:
        await store.create_project("alpha", "Alpha")
        assert (tmp_path / f"store.db{_write_lock.SUFFIX}").is_file()


async def test_a_write_held_up_past_busy_timeout_is_refused_with_nothing_written(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "store.db"
    async with ControlStore(path, busy_timeout=0.3) as store:
        await store.create_project("alpha", "Alpha")
        holder = await Holder.start(path)
        try:
            # SQLite's own lock is free all along: only the queue holds the write back.
            with pytest.raises(DatabaseLocked, match="busy_timeout"):
                await store.enqueue("alpha", {"n": 1})
        finally:
            await holder.let_go()
        assert (await store.counts())["ready"] == 0  # the refused write left nothing
        await store.enqueue("alpha", {"n": 2})  # the queue moves again: writes go
        assert (await store.counts())["ready"] == 1


async def test_writes_queued_behind_a_refused_round_are_refused_too(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "store.db"
    # Long enough for the second write to be queued before the first round is given up,
    # however loaded the machine.
    async with ControlStore(path, busy_timeout=1.5) as store:
        await store.create_project("alpha", "Alpha")
        writer = await writer_of(store)
        holder = await Holder.start(path)
        try:
            first = asyncio.create_task(store.enqueue("alpha", {"n": 1}))
            await until(lambda: writer.in_flight == 1)  # its round is on the thread
            queued = asyncio.create_task(store.enqueue("alpha", {"n": 2}))
            await until(lambda: writer.requests_waiting == 1)  # behind that round
            for refused in (first, queued):  # both refused when the round is given up
                with pytest.raises(DatabaseLocked, match="not come free"):
                    await refused
            # The round still waits for the lock on its thread: a write now waits for
            # the lock to move, at most busy_timeout, rather than behind it unbounded.
            later = asyncio.get_running_loop().time()
            with pytest.raises(DatabaseLocked, match="not come free"):
                await store.enqueue("alpha", {"n": 3})
            assert asyncio.get_running_loop().time() - later >= 1.5
        finally:
            await holder.let_go()
        await store.enqueue("alpha", {"n": 4})  # waits for the round to come back, then goes
        assert (await store.counts())["ready"] == 1


async def test_a_killed_holder_lets_the_waiting_write_go(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store.db"
    async with ControlStore(path, busy_timeout=60) as store:
        await store.create_project("alpha", "Alpha")
        writer = await writer_of(store)
        holder = await Holder.start(path)
        write = asyncio.create_task(store.enqueue("alpha", {"n": 1}))
        lock = writer.write_lock
        assert lock is not None
        await until(lambda: lock.waiting)  # the write's thread sleeps in flock
        await holder.kill()  # SIGKILL: no clean-up; the kernel lets go of its flock
        item_id = await write  # within the busy_timeout, never DatabaseLocked
        assert (await store.item(item_id))["state"] == "ready"


async def test_without_a_queue_file_the_store_still_writes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store.db"
    (tmp_path / f"store.db{_write_lock.SUFFIX}").mkdir()  # the queue cannot be made here
    async with ControlStore(path) as store:
        await store.create_project("alpha", "Alpha")
        await store.enqueue("alpha", {"n": 1})
        assert (await store.counts())["ready"] == 1


async def test_two_stores_in_one_process_take_turns(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "store.db"
    async with ControlStore(path) as first, ControlStore(path) as second:
        await first.create_project("alpha", "Alpha")
        await asyncio.gather(
            *(store.enqueue("alpha", {"n": n}) for n in range(50) for store in (first, second))
        )
        assert (await first.counts())["ready"] == 100


async def test_a_claim_cancelled_as_its_answer_came_after_the_lock_moved_gives_it_back(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A round was given up for busy_timeout, so the next claim first waits for the lock to
    # move (`Writer.submit`). It is then queued and answered, and its caller is cancelled
    # before it runs again: what it took goes back at once, not to its lease.
    path = tmp_path / "store.db"
    async with ControlStore(path, busy_timeout=0.3) as store:
        await store.create_project("alpha", "Alpha")
        item_id = await store.enqueue("alpha", {"n": 1})
        writer = await writer_of(store)
        holder = await Holder.start(path)
        tasks: list[asyncio.Task[object]] = []
        try:
            with pytest.raises(DatabaseLocked):
                await store.enqueue("alpha", {"n": 2})  # its round waits on, given up
            # The claim's wait for the lock to move must outlast the holder's exit,
            # however loaded the machine.
            writer.lock_timeout = 60.0
            queue = writer._queue
            queued: list[object] = []

            def queue_then_cancel(op: object, **kwargs: bool) -> asyncio.Future[object]:
                monkeypatch.undo()  # the claim's request only
                queued.append(op)
                future = queue(op, **kwargs)
                # Added before the caller awaits it: it runs first once the answer is in.
                future.add_done_callback(lambda _: tasks[0].cancel())
                return future

            monkeypatch.setattr(writer, "_queue", queue_then_cancel)
            tasks.append(asyncio.create_task(store.claim(owner="gone")))
            await until(lambda: any(
                task.get_name() == "asyncplane-lock-moves" for task in asyncio.all_tasks()
            ))  # fmt: skip
            assert not queued  # it waits for the lock to move, not yet queued
        finally:
            await holder.let_go()
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        await store.assign("alpha", "barrier")  # a write behind the give-back
        row = await store.item(item_id)
        assert (row["state"], row["attempts"]) == ("ready", 0)
        assert [e["event_type"] for e in await store.events(item_id)] == [
            "queued", "claimed", "released",
        ]  # fmt: skip
        assert queued  # it went through the wait for the lock to move
        assert (await store.counts())["ready"] == 1  # the write given up wrote nothing


def test_companions_made_under_a_strict_umask_take_the_databases_mode(
    tmp_path: pathlib.Path,
) -> None:
    # Made 0600 by a process whose umask is 077, the queue and the board would shut out
    # another user's processes that may write the database: they would run without them.
    script = (
        "import asyncio, os, sys\n"
        "from asyncplane import ControlStore\n"
        "async def main():\n"
        "    async with ControlStore(sys.argv[1]) as store:\n"
        "        await store.create_project('p', 'P')\n"
        "asyncio.run(main())\n"
        "os.chmod(sys.argv[1], 0o666)\n"
        "for suffix in ('-writers', '-combine'):\n"
        "    os.unlink(sys.argv[1] + suffix)\n"
        "os.umask(0o077)\n"
        "async def again():\n"
        "    async with ControlStore(sys.argv[1]) as store:\n"
        "        await store.projects()\n"
        "asyncio.run(again())\n"
    )
    store = tmp_path / "s.db"
    done = subprocess.run(
        [sys.executable, "-c", script, str(store)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for suffix in ("-writers", "-combine"):
        mode = (tmp_path / f"s.db{suffix}").stat().st_mode & 0o777
        assert mode == 0o666, (suffix, oct(mode))


async def test_a_companion_that_is_a_link_to_nothing_is_made_where_it_leads(
    tmp_path: pathlib.Path,
) -> None:
    # The queue and the board linked into a tmpfs, emptied by a reboot: the links lead
    # nowhere. Opening makes the files there (it once looked for them for ever).
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "P")
    (tmp_path / "shm").mkdir()
    for suffix in ("-writers", "-combine"):
        (tmp_path / f"s.db{suffix}").unlink()
        (tmp_path / f"s.db{suffix}").symlink_to(tmp_path / "shm" / f"s{suffix}")
    async with ControlStore(tmp_path / "s.db") as store:
        assert await store.enqueue("p", {}) == 1
    assert sorted(os.listdir(tmp_path / "shm")) == ["s-combine", "s-writers"]
