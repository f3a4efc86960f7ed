"""Helpers for testing code that uses asyncplane: a clock you move by hand.

    clock = ManualClock()
    async with ControlStore(tmp_path / "t.db", lease_seconds=30, clock=clock) as store:
        claim = await store.claim(owner="a")
        clock.advance(31)                      # the lease lapses, no sleeping
        taken = await store.claim(owner="b")   # a takeover with a higher fence

The pytest plugin (`asyncplane.pytest_plugin`, loaded automatically once asyncplane is
installed) offers the same as fixtures: ``asyncplane_clock``, ``asyncplane_store`` and
``asyncplane_store_factory``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import threading

__all__ = ("DEFAULT_START", "ManualClock")

DEFAULT_START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
"""Where a ManualClock starts unless told otherwise: 2026-01-01T00:00:00Z."""


class ManualClock:
    """A wall clock that only moves when told to; safe to read from any thread."""

    def __init__(self, start: float | dt.datetime = DEFAULT_START) -> None:
        self._lock = threading.Lock()
        self._now = _seconds(start)
        self._waiters: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        """The current manual time, in seconds since the Unix epoch."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backward); return the new time."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError("seconds must be an int or float")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError("a ManualClock only moves forward, by a finite amount")
        with self._lock:
            self._now += seconds
            now = self._now
        self._wake()
        return now

    def set(self, when: float | dt.datetime) -> None:
        """Jump to ``when``, which may not be earlier than now."""
        target = _seconds(when)
        with self._lock:
            if target < self._now:
                raise ValueError("a ManualClock only moves forward")
            self._now = target
        self._wake()

    async def wait_until(self, when: float) -> None:
        """Wait until the clock is moved to ``when`` or later (no real time passes)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._now >= when:
                return
            self._waiters.append((when, future))
        try:
            await future
        finally:
            with self._lock:
                self._waiters = [(w, f) for w, f in self._waiters if f is not future]

    def _wake(self) -> None:
        with self._lock:
            due = [f for w, f in self._waiters if w <= self._now]
        for future in due:
            # advance() may run on any thread; the waiter's loop sets its future.
            with contextlib.suppress(RuntimeError):  # that loop has closed meanwhile
                future.get_loop().call_soon_threadsafe(_resolve, future)

    def datetime(self) -> dt.datetime:
        """The current manual time as an aware UTC datetime."""
        return dt.datetime.fromtimestamp(self.now(), tz=dt.timezone.utc)

    def __repr__(self) -> str:
        return f"ManualClock({self.datetime().isoformat()})"


def _seconds(value: float | dt.datetime) -> float:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError("use an aware datetime (with tzinfo) for a ManualClock")
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError("a ManualClock time is epoch seconds or an aware datetime")
    return float(value)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
