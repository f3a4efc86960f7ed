"""Opening, closing, schema versions and the files a store will not touch."""

from __future__ import annotations

import asyncio
import pathlib
import sqlite3
import subprocess
import sys

import pytest

from asyncplane import (
    ControlStore,
    NotAnAsyncplaneDatabase,
    SchemaVersionError,
    StorageError,
    StoreClosed,
)
from asyncplane import _sqlite_sql as sql


async def test_opens_on_first_use_and_closes(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db")
    assert not (tmp_path / "s.db").exists()
    await store.create_project("p", "P")
    assert (tmp_path / "s.db").exists()
    await store.close()
    await store.close()  # idempotent


async def test_async_with_and_explicit_open(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "P")
    store = ControlStore(tmp_path / "s.db")
    assert await store.open() is store
    assert await store.open() is store  # idempotent
    assert [p["project_id"] for p in await store.projects()] == ["p"]
    await store.close()


async def test_a_closed_store_opens_again(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db")
    await store.create_project("p", "P")
    await store.close()
    await store.enqueue("p", {})
    assert (await store.item(1))["state"] == "ready"
    await store.close()


async def test_data_survives_reopening(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {"keep": True})
    async with ControlStore(tmp_path / "s.db") as store:
        assert (await store.item(item_id))["payload"] == {"keep": True}


async def test_concurrent_first_uses_open_once(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db")
    await asyncio.gather(*(store.projects() for _ in range(20)))
    await store.close()


def test_store_is_reusable_across_event_loops_once_the_first_has_ended(
    tmp_path: pathlib.Path,
) -> None:
    store = ControlStore(tmp_path / "s.db")

    async def first() -> None:
        await store.create_project("p", "P")  # never closed: the loop's end closes it

    async def second() -> int:
        count = len(await store.projects())
        await store.close()
        return count

    asyncio.run(first())
    assert asyncio.run(second()) == 1


def test_script_that_never_closes_its_store_still_exits(tmp_path: pathlib.Path) -> None:
    script = (
        "import asyncio\n"
        "from asyncplane import ControlStore\n"
        f"store = ControlStore({str(tmp_path / 's.db')!r})\n"
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


async def test_store_used_from_another_running_loop_is_refused(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db")
    await store.open()

    def elsewhere() -> None:
        async def use() -> None:
            await store.projects()

        asyncio.run(use())

    with pytest.raises(StoreClosed, match="another event loop"):
        await asyncio.to_thread(elsewhere)
    await store.close()


async def test_schema_version_and_application_id_are_written(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.projects()
    conn = sqlite3.connect(tmp_path / "s.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
    assert conn.execute("PRAGMA application_id").fetchone()[0] == sql.APPLICATION_ID
    conn.close()


async def test_newer_schema_is_refused(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.projects()
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute(f"PRAGMA user_version = {sql.SCHEMA_VERSION + 1}")
    conn.close()
    store = ControlStore(tmp_path / "s.db")
    with pytest.raises(SchemaVersionError, match="upgrade asyncplane"):
        await store.open()


async def test_another_applications_database_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    conn.commit()
    conn.close()
    with pytest.raises(NotAnAsyncplaneDatabase):
        await ControlStore(path).open()
    conn = sqlite3.connect(path)  # and it was left exactly as it was
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("invoices",)]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    conn.close()


async def test_a_file_that_is_not_sqlite_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are not the pages you are looking for" * 100)
    with pytest.raises(NotAnAsyncplaneDatabase) as caught:
        await ControlStore(path).open()
    assert isinstance(caught.value, StorageError)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)


async def test_migrations_run_forward_from_an_older_version(tmp_path: pathlib.Path) -> None:
    # A store created by the first release has user_version 1; opening it with this
    # release applies whatever migrations came after, and never reapplies the first.
    path = tmp_path / "old.db"
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {"old": True})
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    async with ControlStore(path) as store:
        assert (await store.item(item_id))["payload"] == {"old": True}
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == sql.SCHEMA_VERSION
    conn.close()


async def test_calls_after_close_on_a_running_writer_fail_cleanly(tmp_path: pathlib.Path) -> None:
    store = ControlStore(tmp_path / "s.db")
    await store.create_project("p", "P")
    backend = await store._ready()
    await store.close()
    with pytest.raises(StoreClosed):
        await backend.create_project(type("Op", (), {})())  # type: ignore[arg-type]
