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

A test lapses a lease without sleeping:

    async def test_takeover(asyncplane_store, asyncplane_clock):
        await asyncplane_store.create_project("p", "P")
        await asyncplane_store.enqueue("p", {})
        first = await asyncplane_store.claim(owner="a")
        asyncplane_clock.advance(asyncplane_store.lease_seconds + 1)
        second = await asyncplane_store.claim(owner="b")
        assert second.fence > first.fence
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from asyncplane import _store, testing

__all__ = ("asyncplane_clock", "asyncplane_store", "asyncplane_store_factory")

StoreFactory = Callable[..., Awaitable[_store.ControlStore]]


@pytest.fixture
def asyncplane_clock() -> testing.ManualClock:
    """A manual clock, starting at `asyncplane.testing.DEFAULT_START`."""
    return testing.ManualClock()


try:
    from pytest_asyncio import fixture as _async_fixture
except ImportError:  # pragma: no cover - without pytest-asyncio, pytest itself says what is missing
    _async_fixture = pytest.fixture  # type: ignore[assignment]


@_async_fixture
async def asyncplane_store_factory(
    tmp_path: pathlib.Path, asyncplane_clock: testing.ManualClock
) -> AsyncIterator[StoreFactory]:
    """Open stores under ``tmp_path`` with the test's manual clock; close them after."""
    opened: list[_store.ControlStore] = []

    async def open_store(name: str = "asyncplane.db", **options: Any) -> _store.ControlStore:
        options.setdefault("clock", asyncplane_clock)
        store = _store.ControlStore(tmp_path / name, **options)
        await store.open()
        opened.append(store)
        return store

    try:
        yield open_store
    finally:
        for store in reversed(opened):
            await store.close()


@_async_fixture
async def asyncplane_store(asyncplane_store_factory: StoreFactory) -> _store.ControlStore:
    """An open store on ``tmp_path / "asyncplane.db"`` with the manual clock."""
    return await asyncplane_store_factory()
