"""Waiting on signals, not timers: the helpers the concurrency tests share."""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest


def waiting_on(what: str) -> Callable[[], Awaitable[bool]]:
    """A condition: a waiter for work (a daemon drainer, work(), claim(wait=)) has a wait
    task for ``what`` (it is idle, waiting)."""

    async def check() -> bool:
        name = f"asyncplane-wait-work-{what}"
        return any(task.get_name() == name for task in asyncio.all_tasks())

    return check


#: Turns of the loop `until` yields bare before it lets other threads run between looks.
_EAGER_TURNS = 1_000
#: Seconds `until` looks for at most: a safety net for a hang, never a pace.
_GIVE_UP_AFTER = 60.0


async def until(
    condition: Callable[[], bool | Awaitable[bool]], *, what: str = "the condition"
) -> None:
    """Yield to the loop until ``condition()`` holds (sync or async; a signal, not a timer).

    It looks at every turn of the loop at first. A condition that takes longer usually
    waits on a thread (a connection's), and a loop spinning bare holds the GIL from it: a
    thread waiting for the GIL gets it only at the interpreter's switch interval, 5 ms, so
    on a loaded machine a few statements could outlast any count of turns. After the first
    turns it therefore blocks a millisecond between looks, which lets the threads run.
    It gives up after a minute, by the clock, not by a count of turns.
    """
    deadline = time.monotonic() + _GIVE_UP_AFTER
    turns = 0
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        turns += 1
        await asyncio.sleep(0 if turns < _EAGER_TURNS else 0.001)


def renewals_heard_late(store: Any, clock: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each renewal of ``store`` comes back after its ``clock`` has moved on a sixth of a
    lease: the renewer's turn returns late (a busy loop, a slow hand-off)."""
    renew, late = store.renew, store.lease_seconds / 6

    async def heard_late(*args: Any, **kwargs: Any) -> Any:
        expires = await renew(*args, **kwargs)
        clock.advance(late)
        return expires

    monkeypatch.setattr(store, "renew", heard_late)


async def renewed_a_third_after_each_grant(
    store: Any, clock: Any, item_id: int, *, turns: int = 3
) -> None:
    """Set ``clock`` to a third of a lease after the grant of the item's lease (the store's
    reading), and wait for the renewal, ``turns`` times."""
    for _ in range(turns):
        lease = (await store.item(item_id))["lease_expires_at"]
        clock.set(lease.timestamp() - store.lease_seconds * 2 / 3)

        async def renewed(before: Any = lease) -> bool:
            return bool((await store.item(item_id))["lease_expires_at"] > before)

        await until(renewed, what="the lease renewed a third of a lease after its grant")


def cancelled_cause(error: BaseException) -> BaseException | None:
    """The failure a cancellation carries as its cause. Before Python 3.11, awaiting a
    task that ended cancelled gives a new CancelledError, the task's own (whose cause it
    is) as its context."""
    if error.__cause__ is None and sys.version_info < (3, 11) and error.__context__ is not None:
        return error.__context__.__cause__
    return error.__cause__
