"""Where asyncplane's time comes from.

Leases are stored as wall-clock instants (seconds since the Unix epoch, UTC) because
several processes compare them and only the wall clock is shared between processes;
a monotonic clock is per-process. The clock is injectable so that a test can lapse a
lease by moving time instead of sleeping (see `asyncplane.testing.ManualClock`).

The store reads the clock inside the write transaction, after it holds the write lock,
so a lease is measured from the moment it is granted, not from when it was requested.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ("Checked", "Clock", "SystemClock", "sleep_until", "wait_until")

#: The longest a wait for a wall-clock time sleeps before it reads the clock again: the
#: sleep itself runs on the monotonic clock, so a wall clock stepped forward (NTP, a
#: resumed virtual machine) is noticed this late at most, not when the old reading said
#: (a daemon slept through a schedule's tick, a renewer past its lease).
WALL_SLICE = 5.0

#: Readings at or past this are refused: the year 10000 (no time could be shown for it)
#: less room for the longest lease and the longest delay a store takes from a reading.
_LATEST = 253402300800.0 - 2 * 366 * 24 * 3600.0


@runtime_checkable
class Clock(Protocol):
    """A source of wall-clock time in seconds since the Unix epoch.

    ``now()`` may be called from the store's connection threads, so it must be safe to
    call from any thread.
    """

    def now(self) -> float:
        """Return the current time as seconds since the Unix epoch."""
        ...


class SystemClock:
    """The real wall clock, ``time.time()``."""

    __slots__ = ()
    #: It moves with real time: a wait on it can be a timer of the event loop (`real_time`).
    REAL_TIME = True

    def now(self) -> float:
        """Return ``time.time()``."""
        return time.time()

    async def wait_until(self, when: float) -> None:
        """Sleep until the wall clock reads ``when`` (`sleep_until`)."""
        await sleep_until(self.now, when)

    def __repr__(self) -> str:
        return "SystemClock()"


class Checked:
    """An injected clock, each reading checked before the store uses it.

    A lease, a due time and every event's time are written from these readings, so a
    clock that returns nonsense (NaN, infinity, a negative time, a year past 9999, not a
    number at all) or raises must fail the call that read it, with a StorageError,
    rather than store a time that no later read could turn back into a datetime.
    """

    __slots__ = ("inner",)

    def __init__(self, inner: Clock) -> None:
        self.inner = inner

    def now(self) -> float:
        """The inner clock's reading, if it is a time asyncplane can store."""
        from asyncplane import _errors  # _errors imports nothing of ours; no cycle

        try:
            value = self.inner.now()
        except Exception as exc:
            raise _errors.StorageError(f"the store's clock failed: {exc!r}") from exc
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _errors.StorageError(
                f"the store's clock read {type(value).__name__}, not seconds since the epoch"
            )
        try:
            reading = float(value)
        except OverflowError:
            reading = float("inf")
        if not 0.0 <= reading < _LATEST:  # NaN fails this too
            raise _errors.StorageError(f"the store's clock read an impossible time: {reading!r}")
        return reading

    async def wait_until(self, when: float) -> None:
        """Wait as the inner clock waits (see `wait_until`)."""
        await wait_until(self.inner, when)

    def __repr__(self) -> str:
        return f"Checked({self.inner!r})"


def real_time(clock: Clock) -> bool:
    """Whether ``clock`` moves with real time (the system's wall clock, or a server's
    seen through it), so that a wait on it can be a timer of the event loop, re-armed
    within `WALL_SLICE` so that a step of the clock counts; a test's manual clock does
    not (it moves when it is moved)."""
    inner = clock.inner if isinstance(clock, Checked) else clock
    return bool(getattr(inner, "REAL_TIME", False))


async def sleep_until(now: Callable[[], float], when: float) -> None:
    """Sleep until ``now()`` reads ``when`` or later, reading it again at least every
    `WALL_SLICE` seconds, so that a step of the clock forward or back counts."""
    while (left := when - now()) > 0:  # noqa: ASYNC110 (a clock, not an event, moves)
        await asyncio.sleep(min(left, WALL_SLICE))


async def wait_until(clock: Clock, when: float) -> None:
    """Wait until ``clock`` reads ``when`` or later.

    A clock may provide ``async wait_until(when)`` (both asyncplane clocks do: a manual
    clock wakes its waiters when it is moved); any other clock is polled with short real
    sleeps.
    """
    waiter = getattr(clock, "wait_until", None)
    if waiter is not None:
        await waiter(when)
        return
    # A clock that cannot be waited on can only be looked at again and again.
    while clock.now() < when:  # noqa: ASYNC110
        await asyncio.sleep(min(0.05, max(0.0, when - clock.now())))
