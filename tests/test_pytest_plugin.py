"""asyncplane's pytest plugin, exercised the way a user's suite would use it."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from typing import Any

import pytest

from asyncplane.testing import ManualClock

pytest_plugins = ["pytester"]

USER_TESTS = """
import pytest
from asyncplane import ControlStore, FenceRejected, verify_ledger
from asyncplane.testing import ManualClock


@pytest.mark.asyncio
async def test_store_is_open_on_tmp_path(asyncplane_store, tmp_path):
    assert isinstance(asyncplane_store, ControlStore)
    assert asyncplane_store.path == tmp_path / "asyncplane.db"
    await asyncplane_store.create_project("p", "P")
    assert [p["project_id"] for p in await asyncplane_store.projects()] == ["p"]


@pytest.mark.asyncio
async def test_manual_clock_lapses_a_lease(asyncplane_store, asyncplane_clock):
    assert isinstance(asyncplane_clock, ManualClock)
    assert asyncplane_store.clock is asyncplane_clock
    await asyncplane_store.create_project("p", "P")
    item_id = await asyncplane_store.enqueue("p", {})
    first = await asyncplane_store.claim(owner="a")
    asyncplane_clock.advance(asyncplane_store.lease_seconds + 1)
    second = await asyncplane_store.claim(owner="b")
    assert second.fence > first.fence
    with pytest.raises(FenceRejected):
        await asyncplane_store.finish(item_id, fence=first.fence)
    assert await verify_ledger(asyncplane_store) == []


@pytest.mark.asyncio
async def test_factory_opens_a_second_store_on_the_same_file(asyncplane_store_factory):
    one = await asyncplane_store_factory(lease_seconds=5)
    two = await asyncplane_store_factory()
    await one.create_project("p", "P")
    await one.enqueue("p", {})
    assert one.lease_seconds == 5
    assert (await two.claim(owner="x")).item_id == 1
    assert await one.claim(owner="y") is None


@pytest.mark.asyncio
async def test_each_test_gets_a_fresh_store(asyncplane_store):
    assert await asyncplane_store.projects() == []
"""


def test_plugin_fixtures_work_in_a_users_suite(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nfilterwarnings = error\n"
    )
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=4)


def test_plugin_is_registered_through_the_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_registered="""
def test_registered(request):
    assert request.config.pluginmanager.has_plugin("asyncplane")
"""
    )
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=1)


def test_with_autoloading_off_the_plugin_loads_by_its_entry_points_name(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As docs/testing.md says for CI setups with PYTEST_DISABLE_PLUGIN_AUTOLOAD.
    # Warnings are errors, as in many a project: the order the docs first gave (asyncplane
    # first) warned that pytest-asyncio was imported before it could rewrite its asserts.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_user=USER_TESTS)
    pytester.runpytest_subprocess("-q").assert_outcomes(errors=4)  # no fixtures: not loaded
    loaded = pytester.runpytest_subprocess("-q", "-W", "error", "-p", "asyncio", "-p", "asyncplane")
    loaded.assert_outcomes(passed=4)
    pytester.makeconftest(
        'pytest_plugins = ["pytest_asyncio.plugin", "asyncplane.pytest_plugin"]\n'
    )
    pytester.runpytest_subprocess("-q", "-W", "error").assert_outcomes(passed=4)


def test_stores_are_closed_after_each_test(pytester: pytest.Pytester) -> None:
    # A store left open would leak its connection threads; the fixture closes it, so a
    # later test can even delete the file.
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(
        test_closing="""
import pytest

stores = []

@pytest.mark.asyncio
async def test_use(asyncplane_store):
    stores.append(asyncplane_store)
    await asyncplane_store.projects()

def test_closed_after():
    (store,) = stores
    assert "closed" in repr(store)
"""
    )
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=2)


def test_a_failed_test_s_running_worker_leaves_no_store_open(pytester: pytest.Pytester) -> None:
    # The test failed with work() running: the fixture closed its store, then
    # pytest-asyncio cancelled the worker, whose give-back opened the store again, its
    # connection's thread and files kept for the rest of the session.
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(
        test_leaving="""
import asyncio
import threading

import pytest

from asyncplane import Done, work

stores = []

@pytest.mark.asyncio
async def test_fails_while_working(asyncplane_store):
    stores.append(asyncplane_store)
    await asyncplane_store.create_project("p", "P")
    item = await asyncplane_store.enqueue("p", {})
    running = asyncio.Event()

    async def slow(claim):
        running.set()
        await asyncio.sleep(3600)
        return Done()

    asyncio.create_task(work(asyncplane_store, slow, concurrency=1))
    await running.wait()
    assert False, "the test fails with the worker running"

def test_nothing_left_open():
    (store,) = stores
    assert "closed" in repr(store)
    assert [t.name for t in threading.enumerate() if t is not threading.main_thread()] == []
"""
    )
    # (Before, the session never ended: the store's connection thread kept it alive.)
    result = pytester.runpytest_subprocess("-q", "-p", "no:randomly", timeout=120)
    result.assert_outcomes(passed=1, failed=1)


class _NoOffset(dt.tzinfo):
    """A tzinfo without an offset: Python counts its datetimes as naive."""

    def utcoffset(self, when: dt.datetime | None) -> dt.timedelta | None:
        return None


def test_manual_clock_refuses_a_naive_datetime_however_it_is_made() -> None:
    for naive in (dt.datetime(2026, 12, 5), dt.datetime(2026, 12, 5, tzinfo=_NoOffset())):
        with pytest.raises(ValueError, match="aware datetime"):
            ManualClock(naive)
        with pytest.raises(ValueError, match="aware datetime"):
            ManualClock().set(naive)


async def test_manual_clock_wait_until_refuses_a_moment_no_move_can_reach() -> None:
    clock = ManualClock()
    for bad in (math.nan, math.inf, "soon"):
        with pytest.raises(TypeError, match="epoch seconds"):
            await clock.wait_until(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aware datetime"):
        await clock.wait_until(dt.datetime(2026, 12, 5))


async def test_manual_clock_wait_until_takes_an_aware_datetime() -> None:
    clock = ManualClock()
    later = clock.datetime() + dt.timedelta(seconds=5)
    waiter = asyncio.create_task(clock.wait_until(later), name="wait-for-later")
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.advance(5)
    await asyncio.wait_for(waiter, timeout=5)


async def test_stores_of_one_name_opened_at_once_share_it(asyncplane_store_factory: Any) -> None:
    # As several processes would open one store: on PostgreSQL each must wait for the
    # one schema the name is given, not open before it is made.
    stores = await asyncio.gather(*(asyncplane_store_factory("shared.db") for _ in range(4)))
    await stores[0].create_project("p", "P")
    item_id = await stores[1].enqueue("p", {})
    for store in stores:
        assert (await store.item(item_id))["state"] == "ready"


@pytest.mark.postgresql_only
async def test_a_schema_another_run_made_under_the_same_name_is_left_alone(
    asyncplane_store_factory: Any, asyncplane_postgres_url: str, request: pytest.FixtureRequest
) -> None:
    # Runs in containers sharing a server have the same pid: the schema named after the
    # test and the pid was the other run's too, and the factory's DROP took its tables.
    import hashlib
    import os

    from asyncplane import testing

    digest = hashlib.sha1(f"{request.node.nodeid}/theirs.db".encode()).hexdigest()[:16]
    theirs = f"t_{digest}_{os.getpid()}"
    await testing.execute_sql(
        asyncplane_postgres_url, f"CREATE SCHEMA {theirs}; CREATE TABLE {theirs}.kept (n int)"
    )
    try:
        store = await asyncplane_store_factory("theirs.db")
        await store.create_project("p", "P")
        # (execute_sql fails if the table is gone)
        await testing.execute_sql(asyncplane_postgres_url, f"SELECT * FROM {theirs}.kept")
    finally:
        await testing.execute_sql(asyncplane_postgres_url, f"DROP SCHEMA {theirs} CASCADE")
