"""The schedule rules: when a schedule's ticks fall, and which of them a run enqueues.

Pure code, as `asyncplane._rules` is: a backend reads a schedule's row in its write
transaction, asks here, and writes what this module decides, so both backends keep one
set of rules:

* **A timetable** (`Timetable`) is a cron expression read in an IANA timezone, or a fixed
  period counted from the schedule's anchor (when its timetable was set). Cron
  expressions are parsed and walked by cronsim (the ``cron`` extra), which follows
  Debian cron across a DST change: a time that falls in the hour a spring change skips
  runs at the first minute after it; a fixed time in the hour an autumn change repeats
  runs once (the first), while ``*`` in the minute or hour field runs in both.
* **A tick** is one moment of the timetable. ``next_at`` is the first tick not yet
  enqueued; a run at ``now`` finds the ticks due (``next_at <= tick <= now``), and
  `plan` says which it enqueues (`CATCH_UP`): ``"latest"`` the newest; ``"all"`` every
  one, at most `MAX_CATCH_UP` (the newest of them); ``"none"`` the newest only if it fell
  due at most `ON_TIME` seconds ago, so that a sweep due at three is not run at noon
  after a night's downtime. On time, the three agree: one tick, enqueued.
* **Exactly once**: the key of every tick enqueued, (name, tick), is written in the
  transaction that enqueues its item, and a tick whose key is there is never enqueued
  again, whoever runs the schedules, and however many at once.
* **Redeclaring** a schedule (`placed`) with the same timetable keeps its place: a
  process that declares its schedules each time it starts never skips, nor repeats, a
  tick. A new timetable starts afresh from now.
* **A process without the cron extra** (`crons_here`) runs the ``every=`` schedules and
  leaves the cron ones, untouched, to a process that has it: one cron schedule declared
  from elsewhere must not stop a fleet's workers, nor the other schedules.
"""

from __future__ import annotations

import collections
import datetime as dt
import functools
import math
from typing import TYPE_CHECKING, Any

from asyncplane import _errors, _validate
from asyncplane._record import Record

if TYPE_CHECKING:
    import cronsim

__all__ = (
    "CATCH_UP",
    "MAX_CATCH_UP",
    "ON_TIME",
    "TICKS_KEPT",
    "TickPlan",
    "Timetable",
    "crons_here",
    "paused_next_at",
    "placed",
    "plan",
    "tick_detail",
    "timetable",
    "unreadable",
)

#: What a run does with ticks missed while nothing ran the schedules.
CATCH_UP = ("latest", "all", "none")
#: The most ticks one run enqueues for one schedule with ``catch_up="all"``.
MAX_CATCH_UP = 1000
#: How late a tick may be enqueued with ``catch_up="none"``, in seconds.
ON_TIME = 60.0
#: How long the key of a tick enqueued is kept, in seconds (a week; the ledger keeps each
#: tick's "queued" event for as long as its item).
TICKS_KEPT = 7 * 24 * 3600.0
#: The most cron ticks one look walks through (a bound on any expression's walk).
_MAX_WALK = 200_000
#: The shortest period of an ``every=`` schedule, in seconds.
MIN_EVERY = 1.0

# cron nicknames, as Vixie cron reads them (cronsim takes five fields).
_NICKNAMES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


@functools.cache
def crons_here() -> bool:
    """Whether this process can walk cron schedules (the cron extra is installed; looked
    up once: a failed import is not cheap, and schedules are looked at every second)."""
    try:
        _cronsim()
    except _errors.MissingExtra:
        return False
    return True


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        raise _errors.MissingExtra(
            "cron schedules need the cron extra: pip install 'asyncplane[cron]' "
            "(or give every= instead of cron=)"
        ) from None
    return cronsim


class Timetable(Record):
    """When a schedule's ticks fall: ``cron`` in ``timezone``, or every ``every`` seconds
    from ``anchor`` (epoch seconds)."""

    cron: str | None
    every: float | None
    timezone: str
    anchor: float

    def _zone(self) -> dt.tzinfo:
        import zoneinfo  # on first use: most programs run no cron schedule

        try:
            return zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
            # Declared where the system's database had it (a store of an earlier release
            # took any name the declaring host knew), and this host has neither that
            # name nor the tzdata package, which the cron extra brings. An every= tick is
            # the same moment in any zone: it is said in UTC here (a process without the
            # extra runs those, and must not stop on one).
            if self.every is not None:
                return dt.timezone.utc
            from importlib import metadata

            try:
                have = f"its tzdata is {metadata.version('tzdata')}: a zone newer than that?"
            except metadata.PackageNotFoundError:
                have = "pip install 'asyncplane[cron]' (it brings tzdata)"
            raise _errors.MissingExtra(
                f"this host's timezone database has no {self.timezone!r}, which a cron "
                f"schedule names ({have})"
            ) from None

    def _walk(self, start: float) -> cronsim.CronSim:
        """cronsim's forward walk: the cron's ticks strictly after ``start``."""
        assert self.cron is not None
        walk: cronsim.CronSim = _cronsim().CronSim(
            _NICKNAMES.get(self.cron, self.cron), dt.datetime.fromtimestamp(start, self._zone())
        )
        return walk

    def _tick(self, index: int) -> float:
        assert self.every is not None
        return self.anchor + index * self.every

    def _index(self, moment: float) -> int:
        """The number of the last ``every=`` tick at or before ``moment``: the division
        guesses, the ticks themselves (as `_tick` computes them, always the same float)
        decide, so a tick is never both past and still to come."""
        assert self.every is not None
        index = math.floor((moment - self.anchor) / self.every)
        while self._tick(index + 1) <= moment:
            index += 1
        while self._tick(index) > moment:
            index -= 1
        return index

    def after(self, moment: float) -> float:
        """The first tick after ``moment``; InvalidInput if it falls past the year 9999,
        where no time can be stored or shown."""
        if self.every is not None:
            tick = self._tick(self._index(moment) + 1)
        else:
            walk = self._walk(moment)
            try:
                while (tick := next(walk).timestamp()) <= moment:
                    pass  # cronsim works in whole minutes; never hand back ``moment`` itself
            except (OverflowError, ValueError):  # cronsim's walk out of datetime's range
                tick = math.inf
        if not tick < _validate.MAX_EPOCH_SECONDS:
            raise _errors.InvalidInput("the schedule's next tick falls past the year 9999")
        return tick

    def newest(self, since: float, now: float, most: int) -> list[float]:
        """The ticks from ``since`` up to ``now`` (both included), the newest ``most`` of
        them, oldest first."""
        if self.every is not None:
            last = self._index(now)
            first = self._index(since)
            if self._tick(first) < since:
                first += 1
            first = max(first, last - most + 1)
            return [self._tick(index) for index in range(first, last + 1)]
        # Cron: walked forward only (cronsim's walks back and forth do not always agree
        # around a DST change, and walking back can fail to end). The last tick is found
        # by halving, each look a walk's first step; then a window that ends there
        # doubles until it holds ``most`` ticks or reaches ``since``. (A window ending at
        # ``now`` walked a dense stretch long past, after a long downtime, from its start:
        # a year of ``* * * 1-5 *`` hit the walk's bound mid-May, and took 1.6 s.)
        final = self._last(since, now)
        if final is None:
            return []
        window = 3600.0
        while True:
            start = max(since, final - window)
            ticks = self._forward(start, final, most)
            if len(ticks) >= most or start <= since:
                return ticks
            window *= 2

    def _last(self, since: float, now: float) -> float | None:
        """The last cron tick from ``since`` up to ``now``, or None: halving the span
        while a tick at or after its lower end comes by ``now``, down to a minute (cron's
        step), then walking the rest."""
        if self._first_from(since) > now:
            return None
        low, high = since, now + 1.0  # a tick from low on comes by now; none from high on
        while high - low > 60.0:
            middle = (low + high) / 2
            if self._first_from(middle) <= now:
                low = middle
            else:
                high = middle
        ticks = self._forward(low, now, 1)
        return ticks[-1] if ticks else None

    def _first_from(self, moment: float) -> float:
        """The first cron tick at or after ``moment`` (inf past datetime's range)."""
        walk = self._walk(moment - 1.0)  # cronsim looks strictly after
        try:
            while (tick := float(next(walk).timestamp())) < moment:
                pass  # a whole minute within the second before ``moment``
        except (OverflowError, ValueError):  # cronsim's walk out of datetime's range
            return math.inf
        return tick

    def _forward(self, start: float, now: float, most: int) -> list[float]:
        """The newest ``most`` cron ticks from ``start`` up to ``now``, oldest first."""
        ticks: collections.deque[float] = collections.deque(maxlen=most)
        walk = self._walk(start - 1.0)  # cronsim looks strictly after
        for _ in range(_MAX_WALK):
            tick = next(walk).timestamp()
            if tick > now:
                break
            if tick >= start:
                ticks.append(tick)
        return list(ticks)

    def iso(self, tick: float) -> str:
        """A tick as an ISO 8601 time in the schedule's timezone, with its UTC offset."""
        return dt.datetime.fromtimestamp(tick, self._zone()).isoformat()


def timetable(cron: object, every: object, timezone: object, anchor: float) -> Timetable:
    """A checked timetable: exactly one of ``cron`` (a five-field expression or a nickname
    such as ``@daily``) and ``every`` (a timedelta or seconds, at least `MIN_EVERY`), in a
    timezone the IANA database knows (by a name the tzdata package has too, where it is
    installed: a name only this system's database has, such as Debian's
    ``posix/Europe/Berlin``, could not be read by a worker in a slim container)."""
    if not isinstance(timezone, str):
        raise _errors.InvalidType(f"timezone must be a str, not {type(timezone).__name__}")
    import zoneinfo  # on first use: most programs declare no schedule

    try:
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # "America": a folder
        raise _errors.InvalidInput(
            f"unknown timezone {timezone!r}: give an IANA name such as 'Europe/Paris' or 'UTC'"
        ) from None
    if not _portable_zone(timezone):
        raise _errors.InvalidInput(
            f"timezone {timezone!r} is a name of this system's database alone: give its "
            "IANA name, such as 'Europe/Paris' (every host with the cron extra knows those)"
        )
    if (cron is None) == (every is None):
        raise _errors.InvalidInput("a schedule takes exactly one of cron= and every=")
    if every is not None:
        if isinstance(every, dt.timedelta):
            every = every.total_seconds()
        if isinstance(every, bool) or not isinstance(every, (int, float)):
            raise _errors.InvalidType(
                f"every must be a timedelta or seconds, not {type(every).__name__}"
            )
        if isinstance(every, int) and not -_validate.MAX_INT <= every <= _validate.MAX_INT:
            every = math.inf  # no float holds it: refused below, as any other too long
        if not math.isfinite(every) or not MIN_EVERY <= every <= _validate.MAX_DURATION_SECONDS:
            raise _errors.InvalidInput(
                f"every must be at least {MIN_EVERY:g} second and at most a century, got {every!r}"
            )
        return Timetable(None, float(every), timezone, anchor)
    if not isinstance(cron, str):
        raise _errors.InvalidType(f"cron must be a str, not {type(cron).__name__}")
    expression = " ".join(cron.split())
    if expression not in _NICKNAMES and len(expression.split(" ")) != 5:
        # cronsim reads a sixth, leading field of seconds too; the schedules promise
        # five (and their DST rules were written for those).
        raise _errors.InvalidInput(
            f"bad cron expression {cron!r}: it needs five fields (minute, hour, day of "
            f"month, month, day of week) or a nickname ({', '.join(_NICKNAMES)}), "
            f"not {len(expression.split())}"
        )
    module = _cronsim()
    try:
        module.CronSim(_NICKNAMES.get(expression, expression), dt.datetime.now(dt.timezone.utc))
    except module.CronSimError as exc:
        raise _errors.InvalidInput(f"bad cron expression {cron!r}: {exc}") from None
    return Timetable(expression, None, timezone, anchor)


def _portable_zone(name: str) -> bool:
    """Whether the tzdata package (the cron extra's) has the zone ``name``. Where it is
    not installed, the system's database, which said yes, is all there is to ask: only
    the names it keeps for itself are refused, as ``zoneinfo.available_timezones()``
    leaves them out (Debian's copies under ``posix/`` and ``right/``; ``localtime``, a
    link to whatever zone this host is set to; ``posixrules``)."""
    from importlib import resources, util

    if util.find_spec("tzdata") is None:
        return not (name.startswith(_SYSTEM_FOLDERS) or name in _SYSTEM_NAMES)
    return resources.files("tzdata").joinpath("zoneinfo", *name.split("/")).is_file()


_SYSTEM_FOLDERS = ("posix/", "right/")
_SYSTEM_NAMES = frozenset({"localtime", "posixrules"})


def _times(table: Timetable) -> Timetable:
    """What decides a timetable's ticks: an ``every=`` one's timezone decides nothing."""
    return table._replace(anchor=0.0, timezone="UTC" if table.every is not None else table.timezone)


def placed(
    new: Timetable, old: Timetable | None, old_next_at: float | None, now: float
) -> tuple[float, float]:
    """Where a declared schedule stands, ``(anchor, next_at)``: as it was, when its
    timetable is unchanged (its timezone changed alone, for an ``every=`` one); otherwise
    afresh, its first tick after now."""
    unchanged = old is not None and _times(old) == _times(new)
    if old is not None and old_next_at is not None and unchanged:
        return old.anchor, old_next_at
    fresh = new._replace(anchor=now)
    return now, fresh.after(now)


def paused_next_at(
    table: Timetable, was_paused: bool, paused: bool, next_at: float, now: float
) -> float:
    """A schedule's next tick once paused or resumed: a resumed one goes on from now (the
    ticks that fell while it was paused are not caught up); otherwise it stays."""
    if was_paused and not paused:
        return table.after(now)
    return next_at


class TickPlan(Record):
    """What one run does for one schedule: enqueue ``ticks`` (oldest first), then wait for
    ``next_at``, the first tick after now."""

    ticks: tuple[float, ...]
    next_at: float


def plan(table: Timetable, catch_up: str, next_at: float, now: float) -> TickPlan:
    """The ticks a run at ``now`` enqueues of a schedule whose first tick not enqueued yet
    is ``next_at`` (see the module's catch-up rules)."""
    if next_at > now:
        return TickPlan((), next_at)
    due = table.newest(next_at, now, MAX_CATCH_UP if catch_up == "all" else 1)
    if catch_up == "none" and due and now - due[-1] > ON_TIME:
        due = []
    return TickPlan(tuple(due), table.after(now))


def unreadable(table: Timetable) -> str | None:
    """Why this host cannot walk a cron timetable, or None where it can: its timezone is
    not in this host's database (a zone newer than the tzdata here), or its expression is
    not one the cronsim here reads (declared where another version ran). A run passes
    such a schedule over, untouched, for a host that can read it (and says so once:
    `asyncplane._engine.Engine.run_schedules`): raised, it would stop every other
    schedule, and every worker here, with it."""
    if table.cron is None:
        return None
    module = _cronsim()
    try:
        table._walk(0.0)
    except _errors.MissingExtra as exc:
        return str(exc)
    except module.CronSimError as exc:
        return f"the cron here cannot read {table.cron!r}: {exc}"
    return None


def tick_detail(name: str, table: Timetable, tick: float) -> dict[str, str]:
    """What a tick's item's "queued" event records of it."""
    return {"schedule": name, "tick": table.iso(tick)}
