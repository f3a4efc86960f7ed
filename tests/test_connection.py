"""Connection setup: WAL, synchronous, busy timeout, foreign keys, read-only readers."""

from __future__ import annotations

import pathlib
import sqlite3

import aiosqlite
import pytest

from asyncplane import ControlStore, StorageError, _connection


async def pragmas(conn: aiosqlite.Connection) -> dict[str, object]:
    def read(db: sqlite3.Connection) -> dict[str, object]:
        names = [
            "journal_mode",
            "synchronous",
            "busy_timeout",
            "foreign_keys",
            "journal_size_limit",
            "query_only",
            "cache_size",
        ]
        return {name: db.execute(f"PRAGMA {name}").fetchone()[0] for name in names}

    return await _connection.run(conn, read)


async def test_aiosqlite_still_offers_the_hook_asyncplane_uses() -> None:
    # asyncplane runs a whole transaction on a connection's thread through
    # aiosqlite.Connection._execute; if a release removes it, this fails first.
    async with aiosqlite.connect(":memory:") as conn:
        assert (
            await _connection.run(conn, lambda db, x: db.execute("SELECT ?", (x,)).fetchone()[0], 7)
            == 7
        )


@pytest.mark.parametrize(("level", "code"), [("NORMAL", 1), ("FULL", 2)])
async def test_writer_pragmas(tmp_path: pathlib.Path, level: str, code: int) -> None:
    conn = await _connection.open_writer(
        tmp_path / "w.db",
        synchronous=level,
        busy_timeout=30.0,  # type: ignore[arg-type]
    )
    try:
        got = await pragmas(conn)
    finally:
        await conn.close()
    assert got == {
        "journal_mode": "wal",
        "synchronous": code,
        "busy_timeout": 30_000,
        "foreign_keys": 1,
        "journal_size_limit": _connection.JOURNAL_SIZE_LIMIT,
        "query_only": 0,
        "cache_size": -_connection.WRITER_CACHE_KIB,
    }


async def test_readers_are_read_only(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db") as store:
        await store.create_project("p", "P")
        reader = await _connection.open_reader(tmp_path / "s.db", busy_timeout=5.0)
        try:
            got = await pragmas(reader)
            assert got["query_only"] == 1
            assert got["cache_size"] == -_connection.READER_CACHE_KIB
            with pytest.raises(sqlite3.OperationalError, match=r"readonly|read-only|query_only"):
                await _connection.run(reader, lambda db: db.execute("DELETE FROM projects"))
        finally:
            await reader.close()


async def test_store_synchronous_full_reaches_the_connection(tmp_path: pathlib.Path) -> None:
    async with ControlStore(tmp_path / "s.db", synchronous="FULL") as store:
        await store.projects()
        backend = await store._engine.ready()
        writer = backend.writer  # type: ignore[attr-defined]
        assert (await pragmas(writer._conn))["synchronous"] == 2


def test_old_sqlite_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    with pytest.raises(StorageError, match=r"needs SQLite 3\.35\.0"):
        _connection._check_sqlite_version()
