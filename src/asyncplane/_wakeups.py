"""Waiting for claimable work, without busy polling: the one place a claimer sleeps.

`drain()`, `work()`, ``claim(wait=)`` and ``claims()`` all sleep here between claims that
found nothing. A waiter is woken by the first of:

* a write of this process that may have made work claimable (the engine's watchers: an
  enqueue, a retry, a park, a release, a cancel freeing twins, the store closing);
* a commit of another process or host: ``data_version`` moving past the value read
  before the empty claim (on SQLite a cheap ``PRAGMA data_version`` look every
  ``poll_interval`` seconds; on PostgreSQL a NOTIFY at once, and a safety look every few
  seconds);
* the earliest deferred item falling due, or lease lapsing, that such a claim could take
  (the engine's ``next_due``, by the store's clock; for a limited project, no sooner than
  its rate bucket holds a token);
* with ``schedules`` (a drain loop, work()), the next tick of a schedule, as the engine
  last found it;
* ``stop`` being set, ``also`` ending (the caller's own signal: work()'s running item
  finishing), or ``timeout`` seconds passing.

The caller watches (``engine.watch()``) and reads ``data_version`` *before* it claims, so
work arriving between the empty claim and the sleep still wakes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from asyncplane import _clock, _engine

__all__ = ("PastDue", "until_work")

#: Seconds a waiter sleeps when the due time it is told was past at its last look too:
#: work it cannot claim now (a row held by another session), looked at again this often.
STUCK_LOOK = 1.0


class PastDue:
    """One waiting loop's memory (a drain's, a worker's, a ``claim(wait=)``'s) of the
    last due time it was told that was past already: told it again after a claim that
    took nothing, it is work this waiter cannot claim now, looked at again `STUCK_LOOK`
    seconds later, not at once. Each loop has its own: another waiter, whose claim may
    well take that work, is not held back by it."""

    __slots__ = ("due",)

    def __init__(self) -> None:
        self.due: float | None = None

    def wake_at(self, due: float, now: float) -> float:
        """When to wake for ``due``, told at ``now``."""
        if due > now:
            return due
        if self.due == due:
            return now + STUCK_LOOK
        self.due = due
        return due


async def until_work(
    engine: _engine.Engine,
    local: asyncio.Event,
    version: int,
    *,
    poll_interval: float,
    project_id: str | None = None,
    actor_id: str | None = None,
    stop: asyncio.Event | None = None,
    timeout: float | None = None,
    also: asyncio.Future[Any] | None = None,
    schedules: bool = False,
    past: PastDue | None = None,
) -> None:
    """Sleep until work may be claimable (see the module); a failed watcher raises."""
    due = await (await engine.ready()).next_due(project_id, actor_id)
    if schedules and engine.next_tick is not None:
        due = engine.next_tick if due is None else min(due, engine.next_tick)
    sleeps: list[Coroutine[Any, Any, Any]] = [
        local.wait(),
        _commit_after(engine, version, poll_interval),
    ]
    names = ["local", "commit"]
    if stop is not None:
        sleeps.append(stop.wait())
        names.append("stop")
    if due is not None:
        # next_due only counts work a claim with these filters could take, so a time
        # already past means work fell due since the empty claim: go again at once. The
        # same past time again, after a claim that found nothing, means the claim cannot
        # take it (on PostgreSQL, a lapsed item whose row another session holds, a host
        # frozen in a transaction, say: SKIP LOCKED passes it by): look again a while
        # later, not at once, or every waiter claims in a loop as long as it is held.
        if past is not None:
            due = past.wake_at(due, engine.clock.now())
        sleeps.append(_clock.wait_until(engine.clock, due))
        names.append("due")
    waits: list[asyncio.Future[Any]] = [
        asyncio.create_task(sleep, name=f"asyncplane-wait-work-{name}")
        for sleep, name in zip(sleeps, names, strict=True)
    ]
    watched = [*waits, also] if also is not None else waits
    try:
        done, _ = await asyncio.wait(watched, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a failed watcher says so, loudly
        if schedules:
            engine.recheck_schedules()  # what woke it may be a schedule set, or resumed
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def _commit_after(engine: _engine.Engine, version: int, poll_interval: float) -> None:
    # Another process's commit sends no signal here; data_version is the cheap check,
    # made every poll_interval and never sooner (a version that moves on every look, a
    # PostgreSQL listener gone deaf, must not turn the wait into a busy loop), and at
    # least as often as the backend's safety look (a deaf PostgreSQL listener's waits
    # heard other hosts' work only at their poll interval, up to an hour).
    within = engine.backend.versions_looked_within
    pause = poll_interval if within is None else min(poll_interval, within)
    while True:
        await asyncio.sleep(pause)
        if await engine.data_version() != version:
            return
