"""asyncplane's pytest plugin: a store on ``tmp_path`` and a clock you move by hand.

Installed with asyncplane and loaded by pytest through the `pytest11` entry point.
Fixtures (the async ones need pytest-asyncio):

- `asyncplane_clock`: a `asyncplane.testing.ManualClock` shared by every store the test
  opens.
- `asyncplane_store`: an open `asyncplane.ControlStore` on `tmp_path / "asyncplane.db"`
  using that clock, closed after the test.
- `asyncplane_store_factory`: `await asyncplane_store_factory(name="asyncplane.db",
  **options)` opens further stores (another file, or a second store on the same file, as
  a second process would have); every one is closed after the test.
- `asyncplane_backend`: which database the stores above use, ``"sqlite"`` unless a test
  (or a ``pytest_generate_tests`` hook, parametrising it indirectly) says
  ``"postgresql"``. On PostgreSQL each ``name`` is a schema of its own, made for the test
  and dropped after it.
- `asyncplane_postgres_url` (session): the server the PostgreSQL stores live on: the URL
  in ``ASYNCPLANE_TEST_POSTGRES_URL`` if set, else a throwaway cluster
  (`asyncplane.testing.PostgresCluster`) started for the session. If it cannot start,
  the tests that need it fail; they are never skipped.

A test lapses a lease without sleeping (with pytest-asyncio; in its strict mode, the
default, mark it ``@pytest.mark.asyncio``):

    @pytest.mark.asyncio
    async def test_takeover(asyncplane_store, asyncplane_clock):
        await asyncplane_store.create_project("p", "P")
        await asyncplane_store.enqueue("p", {})
        first = await asyncplane_store.claim(owner="a")
        asyncplane_clock.advance(asyncplane_store.lease_seconds + 1)
        second = await asyncplane_store.claim(owner="b")
        assert second.fence > first.fence
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from asyncplane import _store, testing

__all__ = (
    "asyncplane_backend",
    "asyncplane_clock",
    "asyncplane_postgres_url",
    "asyncplane_store",
    "asyncplane_store_factory",
)

#: A server to use instead of starting a throwaway cluster.
POSTGRES_URL_VARIABLE = "ASYNCPLANE_TEST_POSTGRES_URL"

StoreFactory = Callable[..., Awaitable[_store.ControlStore]]


@pytest.fixture
def asyncplane_clock() -> testing.ManualClock:
    """A manual clock, starting at `asyncplane.testing.DEFAULT_START`."""
    return testing.ManualClock()


try:
    from pytest_asyncio import fixture as _async_fixture
except ImportError:  # pragma: no cover - without pytest-asyncio, pytest itself says what is missing
    _async_fixture = pytest.fixture  # type: ignore[assignment]


@pytest.fixture
def asyncplane_backend(request: pytest.FixtureRequest) -> str:
    """``"sqlite"`` or ``"postgresql"``: the database the store fixtures use."""
    backend: str = getattr(request, "param", "sqlite")
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"asyncplane_backend must be 'sqlite' or 'postgresql', not {backend!r}")
    return backend


@pytest.fixture(scope="session")
def asyncplane_postgres_url() -> Iterator[str]:
    """The PostgreSQL server for this session: ``$ASYNCPLANE_TEST_POSTGRES_URL``, or a
    throwaway cluster started now and removed at the end."""
    given = os.environ.get(POSTGRES_URL_VARIABLE)
    if given:
        yield given
        return
    with testing.PostgresCluster() as cluster:
        yield cluster.url()


@_async_fixture
async def asyncplane_store_factory(
    request: pytest.FixtureRequest,
    tmp_path: pathlib.Path,
    asyncplane_clock: testing.ManualClock,
    asyncplane_backend: str,
) -> AsyncIterator[StoreFactory]:
    """Open stores under ``tmp_path`` (or in fresh PostgreSQL schemas) with the test's
    manual clock; close them after."""
    opened: list[_store.ControlStore] = []
    schemas: dict[str, str] = {}
    #: Each schema's making, awaited by every store of that name (several opened at once,
    #: as several processes would, all wait for the one schema).
    made: dict[str, asyncio.Task[None]] = {}
    server = (
        request.getfixturevalue("asyncplane_postgres_url")
        if asyncplane_backend == "postgresql"
        else None
    )

    async def location(name: str) -> str | pathlib.Path:
        if server is None:
            return tmp_path / name
        if name not in schemas:
            digest = hashlib.sha1(f"{request.node.nodeid}/{name}".encode()).hexdigest()[:16]
            # A random part too: runs in containers that share a server have one pid,
            # and each run's schema was the other's (its DROP then took the other's
            # tables). Letters, digits and underscores: nothing to quote.
            schemas[name] = f"t_{digest}_{os.getpid()}_{secrets.token_hex(4)}"
            schema = schemas[name]
            made[name] = asyncio.ensure_future(
                testing.execute_sql(server, f"CREATE SCHEMA {schema}")
            )
        await asyncio.shield(made[name])
        return testing.with_schema(server, schemas[name])

    async def open_store(name: str = "asyncplane.db", **options: Any) -> _store.ControlStore:
        options.setdefault("clock", asyncplane_clock)
        if server is not None:  # no file to put the archive beside: tmp_path, by name
            options.setdefault("archive_path", tmp_path / f"{name}.archive.jsonl")
        store = _store.ControlStore(await location(name), **options)
        await store.open()
        opened.append(store)
        return store

    open_store.location = location  # type: ignore[attr-defined]
    before = asyncio.all_tasks()
    try:
        yield open_store
    finally:
        await _end_left_tasks(before)
        for store in reversed(opened):
            await store.close()
        if server is not None:
            for schema in schemas.values():
                await testing.execute_sql(server, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@_async_fixture
async def asyncplane_store(asyncplane_store_factory: StoreFactory) -> _store.ControlStore:
    """An open store on ``tmp_path / "asyncplane.db"`` with the manual clock."""
    return await asyncplane_store_factory()


async def _end_left_tasks(before: set[asyncio.Task[Any]]) -> None:
    """Cancel, and wait for, the tasks the test started and left running (a failed assert
    before its worker's stop), before its stores close: pytest-asyncio cancels them only
    after this teardown, and their clean-up (a worker giving its items back) opened the
    closed stores again, each with its connection's thread, for the rest of the session.
    The stores' own tasks (``asyncplane-...``) end with the close."""
    mine = asyncio.current_task()
    left = [
        task for task in asyncio.all_tasks() - before
        if task is not mine and not task.get_name().startswith("asyncplane-")
    ]  # fmt: skip
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
