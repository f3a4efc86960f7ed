"""Opening, closing, schema versions and the files a store will not touch."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import threading
from typing import Any

import pytest

from asyncplane import (
    ControlStore,
    InvalidInput,
    NotOnAsyncio,
    StorageError,
    StoreClosed,
    drain,
)


async def test_opens_on_first_use_and_closes(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db")
    assert not (tmp_path / "s.db").exists()
    await store.create_project("p", "P")
    assert (tmp_path / "s.db").exists()
    await store.close()
    await store.close()  # idempotent


async def test_async_with_and_explicit_open(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    async with ControlStore(where) as store:
        await store.create_project("p", "P")
    store = ControlStore(where)
    assert await store.open() is store
    assert await store.open() is store  # idempotent
    assert [p["project_id"] for p in await store.projects()] == ["p"]
    await store.close()


async def test_a_closed_store_opens_again(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where)
    await store.create_project("p", "P")
    await store.close()
    await store.enqueue("p", {})
    assert (await store.item(1))["state"] == "ready"
    await store.close()


async def test_data_survives_reopening(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    async with ControlStore(where) as store:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {"keep": True})
    async with ControlStore(where) as store:
        assert (await store.item(item_id))["payload"] == {"keep": True}


def writer_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("asyncplane-writer[")]


def connection_threads() -> list[threading.Thread]:
    """aiosqlite's connection threads still running, once closing ones have finished."""
    threads = [t for t in threading.enumerate() if "_connection_worker_thread" in t.name]
    for thread in threads:
        thread.join(timeout=5)  # a closed connection's thread ends just after close()
    return [t for t in threads if t.is_alive()]


async def test_concurrent_first_uses_open_once(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where)
    results = await asyncio.gather(*(store.projects() for _ in range(20)))
    assert results == [[]] * 20
    assert len(writer_tasks()) == 1
    await store.close()
    assert writer_tasks() == []


def test_store_is_reusable_across_event_loops_once_the_first_has_ended(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where)

    async def first() -> None:
        await store.create_project("p", "P")  # never closed: the loop's end closes it

    async def second() -> int:
        count = len(await store.projects())
        await store.close()
        return count

    asyncio.run(first())
    assert asyncio.run(second()) == 1


def test_script_that_never_closes_its_store_still_exits(location_of: Any) -> None:
    location = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    script = (
        "import asyncio\n"
        "from asyncplane import ControlStore\n"
        f"store = ControlStore({location!r})\n"
        "async def main():\n"
        "    await store.create_project('p', 'P')\n"
        "    await store.enqueue('p', {})\n"
        "    print(len(await store.projects()))\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


async def test_store_used_from_another_running_loop_is_refused(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where)
    await store.open()

    def elsewhere() -> None:
        async def use() -> None:
            await store.projects()

        asyncio.run(use())

    with pytest.raises(StoreClosed, match="another event loop"):
        await asyncio.to_thread(elsewhere)
    await store.close()


async def test_calls_after_close_on_a_running_writer_fail_cleanly(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where)
    await store.create_project("p", "P")
    backend = await store._engine.ready()
    await store.close()
    with pytest.raises(StoreClosed):
        await backend.create_project(type("Op", (), {})())  # type: ignore[arg-type]


async def test_close_racing_other_calls_leaves_a_usable_store(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where)
    await store.create_project("p", "P")
    results = await asyncio.gather(store.close(), store.enqueue("p", {"late": True}))
    # The late call waited for the close to finish, then opened the store again.
    assert (await store.item(results[1]))["payload"] == {"late": True}
    assert len(writer_tasks()) == 1
    await store.close()
    assert writer_tasks() == []
    assert connection_threads() == []  # the writer's and readers' threads all ended


async def test_close_while_a_read_runs_then_reads_again(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db", read_connections=1)
    await store.create_project("p", "P")
    item_id = await store.enqueue("p", {})
    backend: Any = await store._engine.ready()
    release = threading.Event()

    def slow_read(db: Any) -> int:
        release.wait(10)
        return 1

    reading = asyncio.ensure_future(backend._readers.run(slow_read))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(store.close())
    for _ in range(1000):  # until the close is waiting on the read
        await asyncio.sleep(0)
        if not store._engine.is_open:
            break
    release.set()
    assert await reading == 1
    await closing
    assert connection_threads() == []  # the busy reader closed as soon as it was done
    assert (await store.item(item_id))["state"] == "ready"  # and the store reopens
    await store.close()
    assert connection_threads() == []


def test_closed_store_reopens_on_a_new_loop_after_busy_reads(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    store = ControlStore(where, read_connections=1)

    async def first() -> None:
        await store.create_project("p", "P")
        await asyncio.gather(*(store.projects() for _ in range(4)))
        await store.close()

    async def second() -> int:
        try:
            return len(await asyncio.gather(*(store.projects() for _ in range(4))))
        finally:
            await store.close()

    asyncio.run(first())
    assert asyncio.run(second()) == 4


def test_a_loop_closed_without_cleanup_leaves_no_threads(location_of: Any) -> None:
    location = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    # run_until_complete then loop.close() never cancels the writer; the store notices the
    # dead loop on its next use, stops the old connection threads, and the process exits.
    script = (
        "import asyncio\n"
        "from asyncplane import ControlStore\n"
        f"store = ControlStore({location!r})\n"
        "loop = asyncio.new_event_loop()\n"
        "loop.run_until_complete(store.create_project('p', 'P'))\n"
        "loop.run_until_complete(store.projects())\n"
        "loop.close()\n"
        "async def again():\n"
        "    print(len(await store.projects()))\n"
        "    await store.close()\n"
        "asyncio.run(again())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_waiters_of_a_loop_closed_without_cleanup_stand_in_no_later_write(
    location_of: Any,
) -> None:
    location = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    # A wait() left waiting when its loop was closed unfinished (the store's watch idle,
    # no round in flight): the store, used again on a new loop, forgets it. Its events
    # were still set by every write, each a call onto the dead loop: the write's caller
    # got "Event loop is closed".
    script = (
        "import asyncio\n"
        "from asyncplane import ControlStore\n"
        f"store = ControlStore({location!r})\n"
        "loop = asyncio.new_event_loop()\n"
        "async def first():\n"
        "    await store.create_project('p', 'P')\n"
        "    item = await store.enqueue('p', {})\n"
        "    asyncio.ensure_future(store.wait(item, poll_interval=3600))\n"
        "    while not any(t.get_name() == 'asyncplane-settles-local'\n"
        "                  for t in asyncio.all_tasks()):\n"
        "        await asyncio.sleep(0)\n"
        "    return item\n"
        "item = loop.run_until_complete(first())\n"
        "loop.close()\n"
        "async def again():\n"
        "    other = await store.enqueue('p', {'n': 2})\n"
        "    waiting = asyncio.create_task(store.wait(item, timeout=60))\n"
        "    await store.cancel(item)\n"
        "    print((await waiting)['state'], other)\n"
        "    await store.close()\n"
        "asyncio.run(again())\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cancelled 2"


async def test_a_failing_clock_fails_one_round_not_the_store(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema

    class FlakyClock:
        def __init__(self) -> None:
            self.fail = False

        def now(self) -> float:
            if self.fail:
                self.fail = False
                raise OSError("clock unavailable")
            return 1_800_000_000.0

    clock = FlakyClock()
    async with ControlStore(where, clock=clock) as store:
        await store.create_project("p", "P")
        clock.fail = True
        with pytest.raises(StorageError, match="clock unavailable"):
            await store.enqueue("p", {})
        assert await store.enqueue("p", {}) == 1  # the writer lives on; nothing half-written
        # The clock's failure in its own words, whichever path a write met it on, on either
        # backend (SQLite's writes read "the write round failed: StorageError(...)", and
        # PostgreSQL's claims and finishes too, but not its other writes).
        writes = {
            "enqueue": lambda: store.enqueue("p", {}),
            "claim": lambda: store.claim("w"),
            "assign": lambda: store.assign("p", "a1"),
        }
        for name, write in writes.items():
            clock.fail = True
            with pytest.raises(StorageError) as failed:
                await write()
            assert str(failed.value) == "the store's clock failed: OSError('clock unavailable')", (
                name
            )


async def test_absurd_leases_and_ids_are_refused_before_writing(location_of: Any) -> None:
    where = location_of("s.db")  # a file, or a fresh PostgreSQL schema
    with pytest.raises(InvalidInput, match="at most"):
        ControlStore(where, lease_seconds=1e12)
    async with ControlStore(where) as store:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {})
        with pytest.raises(InvalidInput, match="at most"):
            await store.claim(owner="w", lease_seconds=1e12)
        assert (await store.item(item_id))["state"] == "ready"
        claim = await store.claim(owner="w", lease_seconds=366 * 24 * 3600)
        assert claim is not None
        with pytest.raises(InvalidInput, match="at most"):
            await store.renew(item_id, fence=claim.fence, lease_seconds=1e12)
        for call in (store.item(2**63), store.events(2**64), store.finish(item_id, fence=2**63)):
            with pytest.raises(InvalidInput, match="at most"):
                await call
        assert (await store.item(item_id))["fence"] == claim.fence


def test_a_store_under_trio_says_asyncplane_runs_on_asyncio(tmp_path: pathlib.Path) -> None:
    import anyio

    async def main() -> None:
        await ControlStore(tmp_path / "t.db").open()

    async def drains() -> None:
        await drain(ControlStore(tmp_path / "d.db"), lambda batch: asyncio.sleep(0, []))

    for work in (main, drains):
        with pytest.raises(NotOnAsyncio, match="asyncio"):
            anyio.run(work, backend="trio")
