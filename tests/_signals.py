"""Waiting on signals, not timers: the helpers the concurrency tests share."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


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
