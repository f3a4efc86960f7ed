"""What the probe needs of a store beyond its public API, kept out of the production paths.

The probe's self-test breaks a run on purpose, behind the store's back, the way a buggy
writer would (`inject_fault`), to show that its checks catch a double report or a lost
item; the probe also clears a PostgreSQL schema it ran in (`drop_store`), looks for a fresh
one (`schema_is_empty`) and waits for a coordinator's items (`probe_items_coming`). None
of this is part of a store's operations, so none of it lives in the backends.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal

import anyio.to_thread

from asyncplane import _connection, _engine, _errors, _models

__all__ = (
    "FAULTS", "drained", "drop_store", "inject_fault", "probe_items_coming", "schema_is_empty",
)  # fmt: skip

Fault = Literal["duplicate-finish", "delete-item", "ghost-finish"]
#: The faults the probe's self-test can inject (``ghost-finish``, an item done by no worker
#: of the run, through the store's own API: see `_probe_worker`).
FAULTS: Final = ("duplicate-finish", "delete-item", "ghost-finish")

# A second terminal event for the first done item: what a double report would leave. The
# time is a parameter on SQLite and the server's clock on PostgreSQL.
_DUPLICATE_FINISH = """
INSERT INTO events (item_id, event_type, fence, owner, at)
SELECT item_id, 'done', fence, 'fault', {now} FROM items
WHERE state = 'done' ORDER BY item_id LIMIT 1
"""
# A queued item deleted behind the store's back: lost work.
_DELETE_ITEM = """
DELETE FROM items WHERE item_id = (SELECT max(item_id) FROM items WHERE state = 'ready')
"""


async def inject_fault(location: str, fault: Fault) -> None:
    """Break a probe run behind the store's back (the probe's self-test only)."""
    if _engine.is_postgres_url(location):
        if fault == "duplicate-finish":
            statement = _DUPLICATE_FINISH.format(now="extract(epoch FROM clock_timestamp())")
        else:
            statement = _DELETE_ITEM
        await _on_server(location, lambda conn: conn.execute(statement))
    else:
        await anyio.to_thread.run_sync(_inject_sqlite, location, fault)


def _inject_sqlite(path: str, fault: Fault) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        if fault == "duplicate-finish":
            conn.execute(_DUPLICATE_FINISH.format(now="?"), (time.time(),))
        else:
            conn.execute(_DELETE_ITEM)
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        conn.close()


def drained(counts: Mapping[str, int]) -> bool:
    """Whether a store's counts (`ControlStore.counts`) leave nothing to drain: no item in
    a live state (a claimed one's lapsed lease is taken over in time)."""
    return not any(counts[state] for state in _models.LIVE_STATES)


async def schema_is_empty(url: str) -> bool:
    """Whether the URL's schema holds none of a store's tables."""
    from asyncplane import _postgres_sql as sql

    async def count(conn: Any) -> int:
        return int(await conn.fetchval(sql.COUNT_STORE_TABLES, list(sql.STORE_TABLES)))

    return bool(await _on_server(url, count) == 0)


async def probe_items_coming(url: str, project: str) -> bool:
    """Whether the URL's schema holds a store whose ``project`` is being seeded (paused)
    or has items to drain: a worker host's sign to start."""
    from asyncplane import _postgres
    from asyncplane import _postgres_sql as sql

    async def look(conn: Any) -> bool:
        if not await _postgres.read_version(conn):  # no store yet (or no such schema: refused)
            return False
        return bool(await conn.fetchval(sql.PROBE_ITEMS_COMING, project))

    return bool(await _on_server(url, look))


async def drop_store(url: str) -> None:
    """Drop the store in the URL's schema, every table and function of it; refused
    (`NotAnAsyncplaneDatabase`) when the schema holds another application's tables, which
    share names with a store's (items, projects, events) and would go with it."""
    from asyncplane import _postgres
    from asyncplane import _postgres_sql as sql

    async def drop(conn: Any) -> None:
        async with conn.transaction():
            await _postgres.read_version(conn)  # an asyncplane store, or refused
            if await conn.fetchval(sql.OTHER_RELATIONS, list(sql.STORE_RELATIONS)):
                raise _errors.NotAnAsyncplaneDatabase(
                    "the schema holds another application's tables beside the store, which "
                    "a drop could take along: nothing was dropped"
                )
            await conn.execute(sql.DROP_STORE)

    await _on_server(url, drop)


async def _on_server(url: str, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """``fn(conn)`` on a connection of its own to the PostgreSQL server, closed after."""
    _engine.postgres_driver()
    import asyncpg

    from asyncplane import _postgres_writer

    try:
        conn = await asyncpg.connect(url)
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError) as exc:
        raise _errors.StorageError(f"cannot connect to {_engine.redact(url)}: {exc}") from exc
    except (asyncpg.InterfaceError, ValueError) as exc:  # a parameter the driver cannot use
        raise _errors.InvalidInput(
            f"the driver cannot use {_engine.redact(url)}: {_engine.redact_urls(str(exc))}"
        ) from exc
    try:
        return await fn(conn)
    except asyncpg.PostgresError as exc:
        raise _postgres_writer.translate(exc) from exc
    finally:
        await conn.close()
