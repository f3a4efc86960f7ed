"""Schedules: periodic work enqueued once per tick, whoever runs the schedules and however
many at once; on both backends, with the test's manual clock."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests.test_claims import cancelled_as_answered, cancelled_in_its_round

from _fleet import FileClock, run_fleet
from _signals import until, waiting_on
from asyncplane import (
    ControlStore,
    Done,
    InvalidInput,
    InvalidType,
    MissingExtra,
    SystemClock,
    UnknownProject,
    UnknownSchedule,
    _backend,
    _clock,
    _engine,
    _schedule,
    drain,
    verify_ledger,
    work,
)
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock

UTC = dt.timezone.utc


def at(*fields: int, tz: dt.tzinfo = UTC) -> float:
    return dt.datetime(*fields, tzinfo=tz).timestamp()  # type: ignore[misc]


async def tick_items(store: ControlStore, name: str) -> list[dict[str, Any]]:
    """The "queued" detail of each item a schedule's ticks enqueued, oldest first."""
    found = []
    after = None
    while rows := await store.items(project_id="alpha", order="oldest", limit=1000, after=after):
        for row in rows:
            queued = (await store.events(row["item_id"]))[0]
            if queued["detail"] and queued["detail"].get("schedule") == name:
                found.append(queued["detail"])
        after = rows[-1]["item_id"]
    return found


async def test_each_tick_is_enqueued_once_with_its_schedule_and_tick_in_the_ledger(
    store: ControlStore, clock: ManualClock
) -> None:
    clock.set(at(2026, 12, 1, 12, 0, 0))
    made = await store.set_schedule(
        "heartbeat", project_id="alpha", payload={"task": "beat"}, every=dt.timedelta(seconds=10)
    )
    assert made["next_at"] == dt.datetime(2026, 12, 1, 12, 0, 10, tzinfo=UTC)
    assert made["every"] == dt.timedelta(seconds=10) and made["cron"] is None
    assert await store.run_schedules() == 0  # nothing due yet
    clock.advance(10)
    assert await store.run_schedules() == 1
    assert await store.run_schedules() == 0  # that tick is taken
    clock.advance(5)
    assert await store.run_schedules() == 0
    clock.advance(5)
    assert await store.run_schedules() == 1
    assert await tick_items(store, "heartbeat") == [
        {"schedule": "heartbeat", "tick": "2026-12-01T12:00:10+00:00"},
        {"schedule": "heartbeat", "tick": "2026-12-01T12:00:20+00:00"},
    ]
    (listed,) = await store.schedules()
    assert listed["last_at"] == dt.datetime(2026, 12, 1, 12, 0, 20, tzinfo=UTC)
    assert listed["next_at"] == dt.datetime(2026, 12, 1, 12, 0, 30, tzinfo=UTC)
    ticks = await store.schedule_ticks("heartbeat")
    assert [t["tick"].second for t in ticks] == [20, 10]  # newest first
    claim = await store.claim("w")
    assert claim is not None and claim.payload == {"task": "beat"}
    assert await verify_ledger(store) == []


async def test_a_cron_schedule_ticks_in_its_timezone(
    store: ControlStore, clock: ManualClock
) -> None:
    paris = dt.timezone(dt.timedelta(hours=1))  # Paris in winter
    clock.set(at(2026, 12, 1, 12, 0, 0, tz=paris))
    made = await store.set_schedule(
        "nightly-sweep", project_id="alpha", payload={"task": "sweep"},
        cron="0 3 * * *", timezone="Europe/Paris",
    )  # fmt: skip
    assert made["next_at"] == dt.datetime(2026, 12, 2, 3, 0, tzinfo=paris)
    clock.set(at(2026, 12, 2, 3, 0, 30, tz=paris))
    assert await store.run_schedules() == 1
    assert await tick_items(store, "nightly-sweep") == [
        {"schedule": "nightly-sweep", "tick": "2026-12-02T03:00:00+01:00"}
    ]


async def test_cron_across_daylight_saving_changes_follows_debian_cron(
    store: ControlStore, clock: ManualClock
) -> None:
    # Paris springs forward at 02:00 on 29 March 2026 (to 03:00) and falls back at 03:00
    # on 25 October (to 02:00): 02:30 does not exist on the first day and comes twice on
    # the second. The skipped run comes at the first minute after the gap; the repeated
    # hour runs once.
    clock.set(at(2026, 3, 28, 12, 0))
    await store.set_schedule(
        "half-past-two", project_id="alpha", payload={}, cron="30 2 * * *",
        timezone="Europe/Paris", catch_up="all",
    )  # fmt: skip
    clock.set(at(2026, 3, 30, 12, 0))
    assert await store.run_schedules() == 2
    clock.set(at(2026, 10, 24, 12, 0))
    await store.set_schedule(
        "half-past-two",
        project_id="alpha",
        payload={},
        cron="30 2 * * *",
        timezone="Europe/Paris",
        catch_up="latest",
    )  # fmt: skip  (same timetable: its place is kept, and "latest" takes one of the many)
    clock.set(at(2026, 10, 24, 12, 0))
    await store.pause_schedule("half-past-two")
    await store.resume_schedule("half-past-two")  # from now: no catching up on the summer
    await store.set_schedule(
        "half-past-two", project_id="alpha", payload={}, cron="30 2 * * *",
        timezone="Europe/Paris", catch_up="all",
    )  # fmt: skip
    clock.set(at(2026, 10, 26, 12, 0))
    assert await store.run_schedules() == 2  # the 25th once, the 26th
    ticks = [detail["tick"] for detail in await tick_items(store, "half-past-two")]
    assert ticks == [
        "2026-03-29T03:00:00+02:00",  # the gap: the first minute after it
        "2026-03-30T02:30:00+02:00",
        "2026-10-25T02:30:00+02:00",  # the first of the two 02:30s only
        "2026-10-26T02:30:00+01:00",
    ]


async def test_missed_ticks_are_caught_up_as_the_schedule_says(
    store: ControlStore, clock: ManualClock
) -> None:
    start = at(2026, 12, 1, 0, 0)
    clock.set(start)
    for catch_up in ("latest", "all", "none"):
        await store.set_schedule(
            catch_up, project_id="alpha", payload={"c": catch_up}, every=3600, catch_up=catch_up
        )
    await store.set_schedule("many", project_id="alpha", payload={}, every=60, catch_up="all")
    clock.set(start + 3600 * 5 + 30)  # five hours down; the last tick 30 s ago
    assert await store.run_schedules() == 1 + 5 + 1 + 300

    async def hours(name: str) -> list[int]:
        return [int(d["tick"][11:13]) for d in await tick_items(store, name)]

    assert await hours("latest") == [5]
    assert await hours("all") == [1, 2, 3, 4, 5]
    assert await hours("none") == [5]  # half a minute late: still on time
    clock.set(start + 3600 * 24 + 61)  # down again, till a minute past the 24th hour's tick
    assert await store.run_schedules() == 1 + 19 + 0 + 1000
    assert await hours("latest") == [5, 0]
    assert len(await hours("all")) == 5 + 19
    assert await hours("none") == [5]  # a minute and a second late: missed, not run
    many = [dt.datetime.fromisoformat(d["tick"]) for d in await tick_items(store, "many")]
    assert len(many) == 300 + 1000  # of the 1141 missed, the newest thousand
    assert many[-1] == dt.datetime.fromtimestamp(start + 3600 * 24 + 60, UTC)
    assert many[-1000] == dt.datetime.fromtimestamp(start + 3600 * 24 + 60 - 999 * 60, UTC)


async def test_a_cron_schedule_down_for_a_year_catches_up_its_newest_ticks(
    store: ControlStore, clock: ManualClock
) -> None:
    # Every minute from January to May, down from the first January to December: the
    # newest ticks are May's last minutes. (A walk from a window's start through the
    # 200,000 minutes before stopped at its bound, mid-May, and took 1.6 s.)
    start = at(2026, 1, 1, 0, 0)
    clock.set(start)
    for catch_up in ("latest", "all"):
        await store.set_schedule(
            catch_up, project_id="alpha", payload={}, cron="* * * 1-5 *", catch_up=catch_up
        )
    clock.set(at(2026, 12, 6, 9, 0))
    assert await store.run_schedules() == 1 + 1000
    last_minute = dt.datetime(2026, 5, 31, 23, 59, tzinfo=UTC)
    latest = [dt.datetime.fromisoformat(d["tick"]) for d in await tick_items(store, "latest")]
    assert latest == [last_minute]
    every = [dt.datetime.fromisoformat(d["tick"]) for d in await tick_items(store, "all")]
    assert every == [last_minute - dt.timedelta(minutes=n) for n in range(999, -1, -1)]


async def test_a_schedule_declared_again_keeps_its_place_and_a_new_timetable_starts_afresh(
    store: ControlStore, clock: ManualClock
) -> None:
    start = at(2026, 12, 1, 0, 0)
    clock.set(start)
    await store.set_schedule("s", project_id="alpha", payload={"v": 1}, every=60)
    clock.set(start + 150)  # two ticks missed while "the process was down"
    again = await store.set_schedule("s", project_id="alpha", payload={"v": 2}, every=60)
    assert again["next_at"] == dt.datetime.fromtimestamp(start + 60, UTC)  # kept
    assert again["payload"] == {"v": 2}  # the job is the new one
    # An every= schedule's timezone decides none of its ticks: changing it alone keeps
    # the place too (it started afresh, and the missed tick was skipped).
    zoned = await store.set_schedule("s", project_id="alpha", payload={"v": 2}, every=60,
                                     timezone="Europe/Berlin")  # fmt: skip
    assert zoned["next_at"] == dt.datetime.fromtimestamp(start + 60, UTC)
    assert await store.run_schedules() == 1  # the newest missed tick (catch_up="latest")
    claim = await store.claim("w")
    assert claim is not None and claim.payload == {"v": 2}
    changed = await store.set_schedule("s", project_id="alpha", payload={"v": 2}, every=30)
    assert changed["next_at"] == dt.datetime.fromtimestamp(start + 180, UTC)  # from now


async def test_a_zone_only_this_systems_database_names_is_refused(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # As Debian's posix/Europe/Berlin: a worker in a slim container, with the cron extra's
    # tzdata and no system database, could not read it, and its drain would stop.
    import zoneinfo
    from importlib import resources

    office = tmp_path / "Office"
    office.mkdir()
    (office / "Berlin").write_bytes(
        resources.files("tzdata").joinpath("zoneinfo", "Europe", "Berlin").read_bytes()
    )
    zoneinfo.reset_tzpath(to=[str(tmp_path), *zoneinfo.TZPATH])
    try:
        with pytest.raises(InvalidInput, match="this system's database alone"):
            await store.set_schedule("s", project_id="alpha", payload={}, cron="0 3 * * *",
                                     timezone="Office/Berlin")  # fmt: skip
    finally:
        zoneinfo.reset_tzpath()
        zoneinfo.ZoneInfo.clear_cache(only_keys=["Office/Berlin"])
    assert await store.schedules() == []


def test_a_zone_this_host_lacks_is_a_typed_error_naming_the_extra() -> None:
    # A schedule an earlier release took by a system-only name, run where it is unknown.
    table = _schedule.Timetable("0 3 * * *", None, "Office/Nowhere", 0.0)
    with pytest.raises(MissingExtra, match="has no 'Office/Nowhere'"):
        table.after(1_780_000_000.0)
    # An every= schedule's tick is the same moment in any zone: a process without the
    # extra (which runs those) records it in UTC rather than stopping on it.
    every = _schedule.Timetable(None, 60.0, "Office/Nowhere", 0.0)
    assert every.iso(every.after(0.0)) == "1970-01-01T00:01:00+00:00"


@contextlib.contextmanager
def zone_unknown_here(zone: str, empty: pathlib.Path) -> Iterator[None]:
    """This process, meanwhile, as a host whose timezone database lacks ``zone``: no
    tzdata package (its modules already imported hidden too) and an empty system
    database at ``empty``."""
    import zoneinfo

    with pytest.MonkeyPatch.context() as hidden:
        for name in [m for m in sys.modules if m.split(".")[0] == "tzdata"] + ["tzdata"]:
            hidden.setitem(sys.modules, name, None)
        zoneinfo.reset_tzpath(to=[str(empty)])
        zoneinfo.ZoneInfo.clear_cache(only_keys=[zone])
        try:
            yield
        finally:
            zoneinfo.reset_tzpath()
            zoneinfo.ZoneInfo.clear_cache(only_keys=[zone])


async def test_without_tzdata_the_systems_own_names_are_refused(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # A host without the tzdata package has its system's database alone to ask, which
    # knows posix/Europe/Berlin and localtime (this host's own zone, whatever it is):
    # names no other host need have, or have alike. They were taken.
    import zoneinfo
    from importlib import resources

    berlin = resources.files("tzdata").joinpath("zoneinfo", "Europe", "Berlin").read_bytes()
    for name in ("posix/Europe/Berlin", "right/Europe/Berlin", "localtime", "Europe/Berlin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(berlin)
    system_only = ("posix/Europe/Berlin", "right/Europe/Berlin", "localtime")
    with zone_unknown_here("Europe/Berlin", tmp_path):  # (the database here: tmp_path's)
        try:
            for name in system_only:
                zoneinfo.ZoneInfo(name)  # this host knows it
                with pytest.raises(InvalidInput, match="this system's database alone"):
                    await store.set_schedule("s", project_id="alpha", payload={},
                                             cron="0 3 * * *", timezone=name)  # fmt: skip
            await store.set_schedule("s", project_id="alpha", payload={}, cron="0 3 * * *",
                                     timezone="Europe/Berlin")  # fmt: skip
        finally:
            zoneinfo.ZoneInfo.clear_cache(only_keys=system_only)
    assert [s["timezone"] for s in await store.schedules()] == ["Europe/Berlin"]


async def test_a_schedule_this_host_cannot_read_is_passed_over_not_fatal(
    store: ControlStore,
    clock: ManualClock,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Declared where the tzdata knew its zone, run where an older one does not: the run
    # raised, rolled back, and, that row due first every time, no schedule ran again on
    # this host, and every work() and drain() here ended on its first look.
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule("beat", project_id="alpha", payload={"n": "beat"}, every=60)
    await store.set_schedule("far", project_id="alpha", payload={"n": "far"},
                             cron="0 * * * *", timezone="America/Coyhaique")  # fmt: skip
    before = (await store.schedule("far"))["next_at"]
    with zone_unknown_here("America/Coyhaique", tmp_path):
        clock.advance(3600)
        with caplog.at_level("WARNING", logger="asyncplane.schedules"):
            assert await store.run_schedules() == 1  # beat's tick (the newest one)
            clock.advance(60)
            assert await store.run_schedules() == 1  # and again: said once, below
    assert [item["payload"]["n"] for item in await store.items()] == ["beat", "beat"]
    assert (await store.schedule("far"))["next_at"] == before  # untouched, still due
    said = [r.getMessage() for r in caplog.records if "'far'" in r.getMessage()]
    assert len(said) == 1 and "left to a host that can read it" in said[0], said
    assert await store.run_schedules() == 1  # a host that reads it runs it
    assert sorted(item["payload"]["n"] for item in await store.items()) == ["beat"] * 2 + ["far"]


async def test_schedules_this_host_cannot_read_starve_none_after_them(
    store: ControlStore, clock: ManualClock, tmp_path: pathlib.Path
) -> None:
    # Passed over, they stay due first: a transaction's 50 were all of them, it ran none,
    # and the run ended there, every time; a schedule due after them never ran.
    clock.set(at(2026, 12, 1, 0, 0))
    for n in range(55):
        await store.set_schedule(f"far{n:02}", project_id="alpha", payload={"n": n},
                                 cron="0 * * * *", timezone="America/Coyhaique")  # fmt: skip
    clock.advance(61 * 60)  # past their first tick (01:00), which they wait for still
    await store.set_schedule("good", project_id="alpha", payload={"n": "good"}, every=60)
    with zone_unknown_here("America/Coyhaique", tmp_path):
        clock.advance(3600)
        assert await store.run_schedules() == 1
    assert [item["payload"]["n"] for item in await store.items()] == ["good"]


def test_a_cron_this_hosts_cronsim_cannot_read_is_said_not_raised() -> None:
    # Declared where another cronsim ran: cronsim's own error, not an asyncplane one,
    # escaped the run.
    table = _schedule.Timetable("0 0 1W * *", None, "UTC", 0.0)
    why = _schedule.unreadable(table)
    assert why is not None and "cannot read '0 0 1W * *'" in why
    assert _schedule.unreadable(_schedule.Timetable("0 3 * * *", None, "UTC", 0.0)) is None
    assert _schedule.unreadable(_schedule.Timetable(None, 60.0, "Office/Nowhere", 0.0)) is None


async def test_a_schedule_whose_next_tick_falls_past_9999_is_refused_unwritten(
    store: ControlStore, clock: ManualClock
) -> None:
    clock.set(dt.datetime(9997, 6, 1, tzinfo=UTC))
    for timetable in ({"every": dt.timedelta(days=36_000)}, {"cron": "0 0 29 2 *"}):
        with pytest.raises(InvalidInput, match="past the year 9999"):
            await store.set_schedule("s", project_id="alpha", payload={}, **timetable)
    assert await store.schedules() == []  # nothing written: the list still reads


async def test_pause_resume_and_delete(store: ControlStore, clock: ManualClock) -> None:
    start = at(2026, 12, 1, 0, 0)
    clock.set(start)
    await store.set_schedule("s", project_id="alpha", payload={}, every=10)
    await store.pause_schedule("s")
    assert (await store.schedule("s"))["paused"] is True
    clock.advance(100)
    assert await store.run_schedules() == 0
    await store.set_schedule("s", project_id="alpha", payload={}, every=10)
    assert (await store.schedule("s"))["paused"] is True  # declaring does not resume it
    await store.resume_schedule("s")
    assert (await store.schedule("s"))["next_at"] == dt.datetime.fromtimestamp(
        start + 110, UTC
    )  # from now: what fell while paused is not caught up
    clock.advance(10)
    assert await store.run_schedules() == 1
    await store.delete_schedule("s")
    assert await store.schedules() == []
    assert await store.schedule_ticks("s") == []
    assert (await store.counts())["ready"] == 1  # its item stays
    for call in (store.pause_schedule, store.resume_schedule, store.delete_schedule,
                 store.schedule):  # fmt: skip
        with pytest.raises(UnknownSchedule, match="no schedule 's'"):
            await call("s")


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"cron": "61 * * * *"}, InvalidInput, "bad cron expression"),
        ({"cron": "* * *"}, InvalidInput, "bad cron expression"),
        # cronsim reads a sixth field, of seconds: the schedules take five.
        ({"cron": "*/7 * * * * *"}, InvalidInput, "needs five fields .* not 6"),
        ({"cron": "0 0 30 2 *"}, InvalidInput, "day-of-month"),  # a date that never comes
        ({"cron": 5}, InvalidType, "cron must be a str"),
        ({"cron": "@daily", "timezone": "Mars/Olympus"}, InvalidInput, "unknown timezone"),
        ({"every": 60, "timezone": 1}, InvalidType, "timezone must be a str"),
        ({"cron": "@daily", "every": 60}, InvalidInput, "exactly one of cron= and every="),
        ({}, InvalidInput, "exactly one of cron= and every="),
        ({"every": 0.5}, InvalidInput, "at least 1 second"),
        ({"every": 1e12}, InvalidInput, "at most a century"),  # its next tick: no datetime
        ({"every": dt.timedelta(days=999_999_999)}, InvalidInput, "at most a century"),
        ({"every": 1e300}, InvalidInput, "at most a century"),
        ({"every": 10**400}, InvalidInput, "at most a century"),  # no float holds it
        ({"every": -(10**400)}, InvalidInput, "at least 1 second"),
        ({"every": 60, "timezone": "America"}, InvalidInput, "unknown timezone"),  # a folder
        ({"every": 60, "timezone": "x" * 300}, InvalidInput, "unknown timezone"),
        ({"every": "60"}, InvalidType, "timedelta or seconds"),
        ({"every": 60, "catch_up": "some"}, InvalidInput, "unknown catch_up"),
        ({"every": 60, "priority": 2**40}, InvalidInput, "priority"),
        ({"every": 60, "service_class": "vip"}, InvalidInput, "service class"),
        ({"every": 60, "max_attempts": 0}, InvalidInput, "max_attempts"),
        ({"every": 60, "payload": {"x": float("nan")}}, InvalidInput, "NaN"),
    ],
)
async def test_a_bad_schedule_is_refused_before_anything_is_written(
    store: ControlStore, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    fields: dict[str, Any] = {"project_id": "alpha", "payload": {"task": "x"}, **kwargs}
    with pytest.raises(error, match=words):
        await store.set_schedule("bad", **fields)
    assert await store.schedules() == []


async def test_a_process_without_the_cron_extra_leaves_cron_schedules_to_one_with_it(
    store: ControlStore,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cron schedule declared from elsewhere must not stop this process's workers, nor
    # the every= schedules it can run.
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule("cron", project_id="alpha", payload={"k": "cron"}, cron="* * * * *")
    # (due before the cron one: the warning is about the cron one all the same)
    await store.set_schedule("every", project_id="alpha", payload={"k": "every"}, every=45)
    clock.advance(120)
    untouched = await store.schedule("cron")
    monkeypatch.setitem(sys.modules, "cronsim", None)  # an import of it fails, as uninstalled
    _schedule.crons_here.cache_clear()
    try:
        assert await store.run_schedules() == 1
        assert "leaves them to one that has the cron extra" in caplog.text  # at once
        assert await store.run_schedules() == 0  # said once a process
        said = [
            r for r in caplog.records if "leaves them to one that has the cron extra" in r.message
        ]
        assert len(said) == 1 and said[0].levelname == "WARNING"

        async def handle(claim: Any) -> Done:
            return Done(claim.payload)

        clock.advance(60)
        summary = await work(store, handle, until_empty=True)  # it schedules, and goes on
        assert summary.done == 2
        assert await store.schedule("cron") == untouched
    finally:
        monkeypatch.undo()
        _schedule.crons_here.cache_clear()
    assert await store.run_schedules() == 1  # a process with the extra: the cron's latest
    kinds = [item["payload"]["k"] for item in await store.items(order="oldest")]
    assert kinds == ["every", "every", "cron"]


async def test_a_schedule_for_a_missing_project_is_refused(store: ControlStore) -> None:
    with pytest.raises(UnknownProject):
        await store.set_schedule("s", project_id="nowhere", payload={}, every=60)
    assert await store.schedules() == []


async def test_a_ticks_item_takes_the_job_options_and_dedups_against_a_pending_one(
    store: ControlStore, clock: ManualClock
) -> None:
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule(
        "report", project_id="alpha", payload={"task": "report"}, every=60, priority=7,
        service_class="realtime", fingerprint="the-report", max_attempts=2,
    )  # fmt: skip
    clock.advance(60)
    assert await store.run_schedules() == 1
    clock.advance(60)
    assert await store.run_schedules() == 0  # its tick is taken, by the pending twin's id
    (item,) = await store.items(project_id="alpha")
    assert (item["priority"], item["service_class"], item["max_attempts"]) == (7, "realtime", 2)
    assert item["fingerprint"] == "the-report"
    ticks = await store.schedule_ticks("report")
    assert [t["item_id"] for t in ticks] == [item["item_id"]] * 2


async def test_a_fingerprinted_schedule_runs_again_once_its_last_item_runs_or_is_done(
    store: ControlStore, clock: ManualClock
) -> None:
    # A fingerprint keeps ticks from piling up while one waits, never later ticks from
    # running: a done item does not answer the next tick, nor does a running one (the
    # tick's item waits in line behind it, then runs).
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule(
        "report", project_id="alpha", payload={"task": "report"}, every=60,
        fingerprint="the-report",
    )  # fmt: skip
    clock.advance(60)
    assert await store.run_schedules() == 1
    first = await store.claim("w")
    assert first is not None
    clock.advance(60)
    assert await store.run_schedules() == 1  # the first runs: a second waits behind it
    assert await store.claim("w2") is None  # in line while its twin runs
    await store.finish(first.item_id, fence=first.fence, result={"n": 1})
    await store.dedup_pending_against_done()  # a drain's preflight: it settles nothing
    second = await store.claim("w")
    assert second is not None and second.item_id != first.item_id
    await store.finish(second.item_id, fence=second.fence, result={"n": 2})
    clock.advance(60)
    assert await store.run_schedules() == 1  # both done: the next tick runs again
    ticks = await store.schedule_ticks("report")
    assert len({t["item_id"] for t in ticks}) == 3
    assert (await store.counts())["ready"] == 1
    assert await verify_ledger(store) == []


async def test_a_tick_never_takes_a_pending_twin_a_done_one_may_settle_unrun(
    store: ControlStore, clock: ManualClock
) -> None:
    # A failed item of the same content, requeued: pending, with dedup on. A tick that
    # took its id would be answered by the done tick before it (the preflight, or that
    # tick's finish), its work never run.
    clock.set(at(2026, 12, 1, 0, 0))
    failed = await store.enqueue("alpha", {"task": "report"}, fingerprint="fp")
    claim = await store.claim("w")
    assert claim is not None
    await store.finish(claim.item_id, fence=claim.fence, status="failed", error="x")
    await store.set_schedule(
        "report", project_id="alpha", payload={"task": "report"}, every=60, fingerprint="fp"
    )
    clock.advance(60)
    assert await store.run_schedules() == 1
    first = await store.claim("w")
    assert first is not None
    await store.finish(first.item_id, fence=first.fence, result={"n": 1})
    await store.requeue(failed)
    clock.advance(60)
    assert await store.run_schedules() == 1  # beside the requeued twin, not its id
    await store.dedup_pending_against_done()  # settles the requeued one, not the tick's
    (tick, _) = await store.schedule_ticks("report")
    assert tick["item_id"] not in (failed, first.item_id)
    second = await store.claim("w")
    assert second is not None and second.item_id == tick["item_id"]


@pytest.mark.postgresql_only
async def test_ticks_of_two_schedules_of_one_content_on_two_hosts_add_one_item(
    store: ControlStore, clock: ManualClock
) -> None:
    # Two schedules of the same content, run by two hosts at once (each passes the row the
    # other holds). The second finds the content's lock taken: it leaves its schedule due,
    # never waiting (its transaction holds schedule rows, which a round holding that lock
    # may wait for: a deadlock), and at its next look takes the first's pending item's id.
    import asyncpg

    from asyncplane import _postgres

    clock.set(at(2026, 12, 1, 0, 0))
    for name in ("a-report", "b-report"):
        await store.set_schedule(
            name, project_id="alpha", payload={"task": "report"}, every=60, fingerprint="fp"
        )
    clock.advance(60)
    other = await asyncpg.connect(store.location)
    try:
        async with other.transaction():
            # The other host's run of its first due schedule, a-report, uncommitted.
            op = _backend.RunSchedulesOp(1, False)
            assert await _postgres._run_schedules(op, other, clock.now()) == (1, 1, ())
            assert await store.run_schedules() == 0  # b-report left due, not waited for
            assert await store.schedule_ticks("b-report") == []
            assert (await store.schedule("b-report"))["next_at"].timestamp() <= clock.now()
    finally:
        await other.close()
    assert await store.run_schedules() == 0  # b-report's tick: a-report's pending item
    (a_tick,) = await store.schedule_ticks("a-report")
    (b_tick,) = await store.schedule_ticks("b-report")
    assert a_tick["item_id"] == b_tick["item_id"]
    assert (await store.counts())["ready"] == 1


async def test_a_schedule_runs_each_tick_in_a_store_with_an_identity(
    asyncplane_store_factory: Any, clock: ManualClock
) -> None:
    # The identity gives every tick's item the same fingerprint: the sweep ran once in
    # the store's lifetime, each later tick answered with the first's id.
    store = await asyncplane_store_factory(identity=("task",))
    await store.create_project("alpha", "A")
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule("sweep", project_id="alpha", payload={"task": "sweep"}, every=60)
    ran = []
    for _ in range(3):
        clock.advance(60)
        assert await store.run_schedules() == 1
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)
        ran.append(claim.item_id)
    assert len(set(ran)) == 3


async def test_runs_at_once_enqueue_each_tick_once(
    store: ControlStore, clock: ManualClock, asyncplane_store_factory: Any
) -> None:
    other = await asyncplane_store_factory()  # the same store, as another host opens it
    clock.set(at(2026, 12, 1, 0, 0))
    for n in range(5):
        await store.set_schedule(f"s{n}", project_id="alpha", payload={"n": n}, every=1,
                                 catch_up="all")  # fmt: skip
    for _ in range(20):
        clock.advance(1)
        runs = await asyncio.gather(*(s.run_schedules() for s in (store, other) * 4))
        assert sum(runs) == 5
    assert (await store.counts())["ready"] == 100


async def test_a_daemon_drain_enqueues_and_runs_a_tick_when_it_falls(
    store: ControlStore, clock: ManualClock
) -> None:
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule("s", project_id="alpha", payload={"task": "t"}, every=3600)
    ran: list[dict[str, Any]] = []

    async def execute(batch: list[Any]) -> list[Any]:
        ran.extend(claim.payload for claim in batch)
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop))
    await until(waiting_on("due"), what="the daemon sleeps until the tick")
    assert ran == []
    clock.advance(3600)  # the tick falls: the daemon wakes for it, not for a poll
    await until(lambda: ran == [{"task": "t"}], what="the tick's item ran")
    stop.set()
    summary = await daemon
    assert summary.scheduled == 1


class SteppedClock(SystemClock):
    """The wall clock, as NTP may step it: ``offset`` seconds ahead of ``time.time()``."""

    __slots__ = ("offset",)

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.time() + self.offset


async def test_a_daemon_wakes_for_a_tick_the_wall_clock_stepped_to(
    asyncplane_store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sleep runs on the monotonic clock: it must read the wall clock again (every
    # WALL_SLICE seconds; shortened here), or a step forward is slept through, the
    # tick enqueued an hour late (and a renewal made after its lease lapsed).
    monkeypatch.setattr(_clock, "WALL_SLICE", 0.05)
    clock = SteppedClock()
    store = await asyncplane_store_factory(clock=clock)
    await store.create_project("alpha", "Alpha")
    await store.set_schedule("s", project_id="alpha", payload={}, every=3600, catch_up="none")
    ran = asyncio.Event()

    async def execute(batch: list[Any]) -> list[Any]:
        ran.set()
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop,
                                       poll_interval=3600))  # fmt: skip
    await until(waiting_on("due"), what="the daemon sleeps until the tick")
    clock.offset = 3600.5  # an hour on, at once
    await asyncio.wait_for(ran.wait(), 30)
    stop.set()
    assert (await daemon).scheduled == 1


async def test_a_busy_worker_on_the_wall_clock_enqueues_a_tick_it_was_stepped_to(
    asyncplane_store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a clock that moves with real time the busy worker's alarm is a timer of the
    # event loop, re-armed within WALL_SLICE (shortened here), so a step counts too.
    monkeypatch.setattr(_clock, "WALL_SLICE", 0.05)
    clock = SteppedClock()
    # A lease that outlasts the step: no renewal falls due to wake the worker instead.
    store = await asyncplane_store_factory(clock=clock, lease_seconds=10**6)
    await store.create_project("alpha", "Alpha")
    await store.enqueue("alpha", {"task": "long"})
    await store.set_schedule("s", project_id="alpha", payload={}, every=3600, catch_up="none")
    release = asyncio.Event()

    async def handle(claim: Any) -> Any:
        await release.wait()
        return Done()

    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, handle, concurrency=1, stop=stop))
    await until(lambda: counted_claims(store), what="the long item runs")
    clock.offset = 3600.5  # an hour on, at once, while the only slot is taken
    await until(lambda: counted(store, 1), what="the tick enqueued while busy")
    release.set()
    stop.set()
    assert (await asyncio.wait_for(worker, 30)).scheduled == 1


async def counted_claims(store: ControlStore) -> bool:
    """Whether an item is claimed."""
    return (await store.counts())["claimed"] == 1


@pytest.mark.sqlite_only  # on PostgreSQL the server's NOTIFY wakes it whatever this process does
@pytest.mark.parametrize("how", ["in its round", "as answered"])
async def test_a_schedule_set_for_a_caller_gone_wakes_a_sleeping_daemon(
    store: ControlStore, raw: Any, clock: ManualClock, how: str
) -> None:
    # The daemon sleeps with no tick to wait for (and polls hourly); set_schedule's caller
    # is cancelled while its round runs, or as its answer comes in. The schedule is saved
    # all the same, and the daemon hears of it from this process at once: it then sleeps
    # until the tick.
    clock.set(at(2026, 12, 1, 0, 0))

    async def execute(batch: list[Any]) -> list[Any]:
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(
        drain(store, execute, mode="daemon", stop=stop, poll_interval=3600)
    )
    await until(waiting_on("local"), what="the daemon sleeps")
    assert not await waiting_on("due")()
    call = store.set_schedule("s", project_id="alpha", payload={"task": "t"}, every=3600)
    if how == "in its round":
        await cancelled_in_its_round(store, raw, call)
        raw.execute("COMMIT")
    else:
        await cancelled_as_answered(store, "set_schedule", call)
    await asyncio.wait_for(until(waiting_on("due"), what="the daemon waits for the tick"), 30)
    stop.set()
    await daemon


async def test_work_runs_schedules_too(store: ControlStore, clock: ManualClock) -> None:
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule("s", project_id="alpha", payload={"task": "w"}, every=60)
    ran: list[Any] = []
    stop = asyncio.Event()

    async def handle(claim: Any) -> Any:
        ran.append(claim.payload)
        return Done()

    worker = asyncio.create_task(work(store, handle, stop=stop))
    await until(waiting_on("due"), what="work() sleeps until the tick")
    clock.advance(60)
    await until(lambda: ran == [{"task": "w"}], what="the tick's item ran")
    stop.set()
    assert (await worker).scheduled == 1


def busy_schedules() -> Any:
    """A condition: a worker whose every slot is taken (or a daemon whose batch runs)
    waits for its schedules' next tick."""

    async def check() -> bool:
        return any(task.get_name() == _engine.BUSY_SCHEDULES for task in asyncio.all_tasks())

    return check


async def a_long_item_and_a_tick_a_minute(store: ControlStore, clock: ManualClock) -> None:
    """An item that runs long (the test holds it), and a schedule "s" ticking every
    minute from midnight, its late ticks skipped (``catch_up="none"``)."""
    clock.set(at(2026, 12, 1, 0, 0))
    await store.enqueue("alpha", {"task": "long"})
    await store.set_schedule(
        "s", project_id="alpha", payload={"task": "tick"}, every=60, catch_up="none"
    )


async def test_a_worker_whose_every_slot_is_taken_enqueues_each_tick_as_it_falls(
    store: ControlStore, clock: ManualClock
) -> None:
    # One slot, and the item in it runs for hours (an agent's long call): a tick that
    # falls meanwhile is enqueued then, not once the slot frees (a catch_up="none" tick
    # more than a minute late would be skipped, and "latest" would merge them).
    await a_long_item_and_a_tick_a_minute(store, clock)
    release = asyncio.Event()
    ran: list[Any] = []

    async def handle(claim: Any) -> Any:
        ran.append(claim.payload)
        if claim.payload == {"task": "long"}:
            await release.wait()
        return Done()

    stop = asyncio.Event()
    worker = asyncio.create_task(work(store, handle, concurrency=1, stop=stop))
    await until(busy_schedules(), what="the busy worker waits for the next tick")
    for minute in (1, 2, 3):
        clock.advance(60)
        await until(
            lambda minute=minute: counted(store, minute),
            what=f"tick {minute} enqueued while the slot is taken",
        )
    assert ran == [{"task": "long"}]
    release.set()
    await until(lambda: len(ran) == 4, what="the three ticks ran once the slot freed")
    stop.set()
    assert (await worker).scheduled == 3


async def counted(store: ControlStore, ticks: int) -> bool:
    """Whether the schedule "s" has enqueued ``ticks`` items."""
    return len(await tick_items(store, "s")) == ticks


async def test_a_daemon_enqueues_each_tick_as_it_falls_while_its_batch_runs(
    store: ControlStore, clock: ManualClock
) -> None:
    await a_long_item_and_a_tick_a_minute(store, clock)
    release = asyncio.Event()
    ran: list[Any] = []

    async def execute(batch: list[Any]) -> list[Any]:
        ran.extend(claim.payload for claim in batch)
        if {"task": "long"} in [claim.payload for claim in batch]:
            await release.wait()
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop))
    await until(busy_schedules(), what="the daemon's batch runs, its schedules wait")
    for minute in (1, 2):
        clock.advance(60)
        await until(lambda minute=minute: counted(store, minute), what=f"tick {minute}")
    assert ran == [{"task": "long"}]
    release.set()
    await until(lambda: len(ran) == 3, what="the ticks ran after the batch")
    stop.set()
    assert (await daemon).scheduled == 2


def no_busy_schedules() -> Any:
    """A condition: no busy worker's or daemon's schedules wait for a tick any more."""
    ticking = busy_schedules()

    async def check() -> bool:
        return not await ticking()

    return check


async def test_a_stopped_daemon_runs_no_schedules_while_its_last_batch_finishes(
    store: ControlStore, clock: ManualClock
) -> None:
    clock.set(at(2026, 12, 1, 0, 0))
    await store.enqueue("alpha", {"task": "long"})
    await store.set_schedule("s", project_id="alpha", payload={"task": "tick"}, every=60)
    release = asyncio.Event()

    async def execute(batch: list[Any]) -> list[Any]:
        await release.wait()
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop))
    await until(busy_schedules(), what="the batch runs, its schedules wait")
    stop.set()
    await until(no_busy_schedules(), what="the stop ends the schedules, not the batch")
    clock.advance(180)  # three ticks fall: nothing of the stopped daemon's runs them
    release.set()
    summary = await asyncio.wait_for(daemon, 30)
    assert (summary.done, summary.scheduled) == (1, 0)
    assert await tick_items(store, "s") == []


@pytest.mark.parametrize("runtime", ["work", "drain"])
async def test_a_close_while_a_busy_runtimes_look_at_the_schedules_is_out_leaves_it_closed(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    # The look's answer comes in after the close (a graceful close lets reads in flight
    # end): the tick it finds due is not run, which would open the store again.
    clock.set(at(2026, 12, 1, 0, 0))
    await store.enqueue("alpha", {"task": "long"})
    await store.set_schedule("s", project_id="alpha", payload={"task": "tick"}, every=60)
    engine = engine_of(store)
    backend = await engine.ready()
    look = backend.next_tick
    armed, looking, answered, gate = [False], asyncio.Event(), [False], asyncio.Event()

    async def held_look(crons: bool) -> Any:
        answer = await look(crons)
        if armed[0]:
            armed[0] = False
            looking.set()
            await gate.wait()
            answered[0] = True
        return answer

    monkeypatch.setattr(backend, "next_tick", held_look)
    runs = []
    run = engine.run_schedules

    async def counted_run() -> int:
        runs.append(engine.is_open)
        return await run()

    monkeypatch.setattr(engine, "run_schedules", counted_run)
    release = asyncio.Event()

    async def handle(claim: Any) -> Any:
        await release.wait()
        return Done()

    async def execute(batch: list[Any]) -> list[Any]:
        await release.wait()
        return [Done() for _ in batch]

    task = asyncio.create_task(
        work(store, handle, concurrency=1, grace=60)
        if runtime == "work"
        else drain(store, execute, mode="daemon")
    )
    await until(busy_schedules(), what="every slot is taken, the schedules wait")
    armed[0] = True
    clock.advance(60)  # the tick falls: the busy runtime looks at the schedules
    await asyncio.wait_for(looking.wait(), 30)
    await store.close()
    gate.set()
    await until(lambda: answered[0], what="the look's answer came in")
    assert runs == [] and not engine.is_open
    release.set()
    await asyncio.wait_for(task, 30)


async def test_a_tick_that_falls_during_a_run_is_run_at_once_not_a_second_later(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock.set(at(2026, 12, 1, 0, 0))
    await store.set_schedule("s", project_id="alpha", payload={}, every=60)
    clock.advance(60)
    engine = engine_of(store)
    backend = await engine.ready()
    look = backend.next_tick

    async def late_look(crons: bool) -> Any:
        clock.advance(60)  # the next tick falls while the run reads when it falls
        return await look(crons)

    monkeypatch.setattr(backend, "next_tick", late_look)
    assert await store.run_schedules() == 1
    assert engine.next_tick == at(2026, 12, 1, 0, 2)  # due now: the next look runs it


@pytest.mark.postgresql_only
async def test_a_run_that_leaves_a_tick_due_looks_again_in_a_second_not_at_once(
    url: str,
) -> None:
    # Another host's run holds the due schedule's row (SKIP LOCKED passes it by): the tick
    # is still due here, and a waiter woken for it at once would run the schedules again
    # and again, a write transaction each, until that host let go.
    import asyncpg

    clock = ManualClock(at(2026, 12, 1, 0, 0))
    async with ControlStore(url, clock=clock) as store:
        await store.create_project("alpha", "Alpha")
        await store.set_schedule("s", project_id="alpha", payload={}, every=60)
        clock.advance(61)
        other = await asyncpg.connect(url)
        try:
            async with other.transaction():
                await other.execute("SELECT 1 FROM schedules WHERE name = 's' FOR UPDATE")
                assert await store.run_schedules() == 0
                tick = engine_of(store).next_tick
                assert tick is not None and tick > clock.now()
        finally:
            await other.close()
        assert await store.run_schedules() == 1  # let go: the tick is enqueued here


# --- a fleet of processes -------------------------------------------------------------------


@pytest.mark.slow
def test_four_processes_running_schedules_enqueue_each_of_sixty_ticks_once(
    location_of: Any, tmp_path: pathlib.Path
) -> None:
    # The fleet shares a clock (a file each worker reads) that the test moves a second at a
    # time, sixty times; every worker runs the schedules in a loop all along.
    location = location_of("ticks.db")
    clock_file = tmp_path / "clock"
    start = at(2026, 12, 1, 0, 0)
    FileClock(clock_file).set(start)

    async def seed() -> None:
        async with ControlStore(location, clock=FileClock(clock_file)) as store:
            await store.create_project("alpha", "Alpha")
            await store.set_schedule("every-second", project_id="alpha", payload={}, every=1)

    asyncio.run(seed())
    stop_file = tmp_path / "stop"

    async def advance() -> None:
        async with ControlStore(location, clock=FileClock(clock_file)) as store:
            for tick in range(1, 61):
                FileClock(clock_file).set(start + tick + 0.5)

                async def enqueued(tick: int = tick) -> bool:
                    await asyncio.sleep(0.002)
                    return (await store.counts())["ready"] >= tick

                await until(enqueued, what=f"tick {tick} enqueued")
        stop_file.write_text("stop")

    import threading

    mover = threading.Thread(target=asyncio.run, args=(advance(),), name="clock-mover")
    mover.start()
    try:
        summaries = run_fleet(
            "schedule_worker.py",
            [[location, str(clock_file), str(stop_file)] for _ in range(4)],
        )
    finally:
        stop_file.write_text("stop")
        mover.join(timeout=120)
    assert sum(s["enqueued"] for s in summaries) == 60

    async def check() -> None:
        async with ControlStore(location, clock=FileClock(clock_file)) as store:
            details = await tick_items(store, "every-second")
            ticks = [d["tick"] for d in details]
            assert len(ticks) == len(set(ticks)) == 60
            assert ticks[0] == "2026-12-01T00:00:01+00:00"
            assert ticks[-1] == "2026-12-01T00:01:00+00:00"
            assert await verify_ledger(store) == []

    asyncio.run(check())


# --- the command -------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncplane.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_adds_lists_pauses_and_deletes_schedules(location_of: Any) -> None:
    where = location_of("cli.db")

    async def seed() -> None:
        async with ControlStore(where) as store:
            await store.create_project("alpha", "Alpha")

    asyncio.run(seed())
    sweep = ["--cron", "0 3 * * *", "--timezone", "Europe/Paris", "--payload", '{"task": "sweep"}']
    added = cli("schedule", where, "nightly-sweep", "--project", "alpha", *sweep, "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["cron"] == "0 3 * * *"
    every = cli("schedule", where, "beat", "--project", "alpha", "--every", "5m", "--payload", "{}")
    assert every.returncode == 0 and "every 0:05:00" in every.stdout, every.stderr
    listed = json.loads(cli("schedules", where, "--json").stdout)["schedules"]
    expected = [("beat", 300.0), ("nightly-sweep", None)]
    assert [(row["name"], row["every"]) for row in listed] == expected
    mixed = cli("schedule", where, "beat", "--every", "1h", "--payload", '{"v": 2}', "--pause")
    assert mixed.returncode == 2 and "give --payload, --every without it" in mixed.stderr
    assert "(paused)" not in cli("schedules", where).stdout  # neither changed nor paused
    assert cli("schedule", where, "beat", "--pause").returncode == 0
    assert "(paused)" in cli("schedules", where).stdout
    assert cli("schedule", where, "beat", "--delete").returncode == 0
    gone = cli("schedule", where, "beat", "--resume")
    assert gone.returncode == 2 and "no schedule 'beat'" in gone.stderr
    bad = cli("schedule", where, "x", "--project", "alpha", "--cron", "61 * * * *", "--payload",
              "{}")  # fmt: skip
    assert bad.returncode == 2 and "bad cron expression" in bad.stderr
    missing = cli("schedule", where, "x", "--project", "alpha", "--payload", "{}")
    assert missing.returncode == 2 and "--cron or --every" in missing.stderr
    nowhere = cli("schedule", where, "x", "--project", "alpha", "--every", "5m",
                  "--timezone", "", "--payload", "{}")  # fmt: skip
    assert nowhere.returncode == 2 and "unknown timezone ''" in nowhere.stderr  # not UTC
    assert [row["name"] for row in json.loads(cli("schedules", where, "--json").stdout)[
        "schedules"]] == ["nightly-sweep"]  # fmt: skip


@pytest.mark.postgresql_only
async def test_a_schedule_set_elsewhere_wakes_every_host_and_a_run_does_not(url: str) -> None:
    import asyncpg

    async with ControlStore(url) as store:
        await store.create_project("alpha", "Alpha")
        listener = await asyncpg.connect(url)
        heard: asyncio.Queue[str] = asyncio.Queue()
        try:
            await listener.add_listener("asyncplane", lambda *args: heard.put_nowait(args[-1]))
            await store.set_schedule("s", project_id="alpha", payload={}, every=3600)
            assert await asyncio.wait_for(heard.get(), 30)  # a new schedule: look again
            await store.run_schedules()  # nothing due: nothing said
            await store.set_limits("alpha", per_minute=60, burst=5)
            assert await asyncio.wait_for(heard.get(), 30)  # new limits: look again
            await store.enqueue("alpha", {})
            assert await asyncio.wait_for(heard.get(), 30)  # (an enqueue, as ever)
            assert await store.claim("w") is not None  # draws a token: nothing said
            await listener.fetchval("SELECT 1")
            assert heard.empty()
        finally:
            await listener.close()


async def test_a_tick_falls_at_its_own_time_whatever_the_period(
    store: ControlStore, clock: ManualClock
) -> None:
    # Float periods: the tick a run finds due at its own time is the tick the schedule
    # names as next, never skipped, never left due (found by review: a period of 1.1 s).
    backend = await engine_of(store).ready()

    async def next_at(name: str) -> float:
        (row,) = await backend.list_schedules(name)  # the stored float, not a datetime
        return row.next_at

    for n, every in enumerate((1.1, 0.1 * 3 + 1, 7.3, 60.0)):
        await store.set_schedule(f"s{n}", project_id="alpha", payload={}, every=every)
        for _ in range(25):
            clock.set(await next_at(f"s{n}"))
            assert await store.run_schedules() == 1
            assert await next_at(f"s{n}") > clock.now()
        await store.delete_schedule(f"s{n}")


async def test_a_daemon_does_not_spin_on_a_tick_at_now(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.set_schedule("s", project_id="alpha", payload={}, every=1.1)
    engine = engine_of(store)
    runs = 0
    real = engine.run_schedules

    async def counting() -> int:
        nonlocal runs
        runs += 1
        return await real()

    engine.run_schedules = counting  # type: ignore[method-assign]

    async def execute(batch: list[Any]) -> list[Any]:
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop))
    await until(waiting_on("due"), what="the daemon sleeps until the tick")
    clock.set(engine.next_tick)  # type: ignore[arg-type]
    await until(lambda: runs >= 1, what="the tick's run")
    for _ in range(2000):  # a spinning daemon would run the schedules again and again
        await asyncio.sleep(0)
    stop.set()
    await daemon
    assert runs == 1


@pytest.mark.parametrize(
    ("zone", "cron", "start", "end"),
    [
        # Chatham's autumn change (03:45 back to 02:45, +13:45 to +12:45): cronsim's walk
        # back never ended here (found by review).
        ("Pacific/Chatham", "0 */2 * * *", (2026, 4, 4, 12, 0), (2026, 4, 5, 6, 0)),
        ("Australia/Lord_Howe", "0 */2 * * *", (2026, 4, 4, 12, 0), (2026, 4, 5, 6, 0)),
        ("Europe/Paris", "*/30 * * * *", (2026, 10, 24, 22, 0), (2026, 10, 25, 5, 0)),
        ("Europe/Paris", "30 2 * * *", (2027, 3, 26, 12, 0), (2027, 3, 29, 12, 0)),
    ],
)
async def test_catching_up_across_a_dst_change_gives_the_ticks_on_time_runs_give(
    store: ControlStore,
    clock: ManualClock,
    asyncplane_store_factory: Any,
    zone: str,
    cron: str,
    start: tuple[int, ...],
    end: tuple[int, ...],
) -> None:
    import zoneinfo

    tz = zoneinfo.ZoneInfo(zone)
    later = await asyncplane_store_factory(name="later.db")
    await later.create_project("alpha", "Alpha")
    clock.set(dt.datetime(*start, tzinfo=tz))  # type: ignore[misc]
    for each in (store, later):
        await each.set_schedule("s", project_id="alpha", payload={}, cron=cron, timezone=zone,
                                catch_up="all")  # fmt: skip
    final = dt.datetime(*end, tzinfo=tz).timestamp()  # type: ignore[misc]
    while clock.now() < final:
        clock.advance(600)
        await store.run_schedules()  # every ten minutes: on time
    await asyncio.wait_for(later.run_schedules(), 30)  # once, at the end: caught up
    on_time = [d["tick"] for d in await tick_items(store, "s")]
    caught_up = [d["tick"] for d in await tick_items(later, "s")]
    assert on_time and on_time == caught_up
    assert len(set(on_time)) == len(on_time)


@pytest.mark.parametrize("where", ["here", "elsewhere"])
async def test_a_daemon_hears_of_a_schedule_set_just_after_it_looked(
    store: ControlStore, clock: ManualClock, asyncplane_store_factory: Any, where: str
) -> None:
    # A schedule set within a second of the daemon's last look at the schedules (here,
    # or by another process or host) is looked at when it wakes the daemon: it then
    # sleeps until that tick, and runs it (found by review).
    setter = store if where == "here" else await asyncplane_store_factory()
    ran: list[Any] = []

    async def execute(batch: list[Any]) -> list[Any]:
        ran.extend(claim.payload for claim in batch)
        return [Done() for _ in batch]

    stop = asyncio.Event()
    daemon = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop,
                                       poll_interval=0.01))  # fmt: skip
    await until(waiting_on("commit"), what="the daemon started, and sleeps")
    await setter.set_schedule("s", project_id="alpha", payload={"tick": 1}, every=60)

    async def sleeps_until_the_tick() -> bool:
        await asyncio.sleep(0.001)  # another process's commit is heard by a poll
        return await waiting_on("due")()

    await until(sleeps_until_the_tick, what="the daemon sleeps until the new tick")
    clock.advance(60)
    await until(lambda: ran == [{"tick": 1}], what="the tick's item ran")
    stop.set()
    await daemon
