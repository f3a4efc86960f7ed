"""Waiting on signals, not timers: the helpers the concurrency tests share."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


def waiting_on(what: str) -> Callable[[], Awaitable[bool]]:
    """A condition: a waiter for work (a daemon drainer, work(), claim(wait=)) has a wait
    task for ``what`` (it is idle, waiting)."""

    async def check() -> bool:
        name = f"asyncplane-wait-work-{what}"
        return any(task.get_name() == name for task in asyncio.all_tasks())

    return check


async def until(
    condition: Callable[[], bool | Awaitable[bool]], *, what: str = "the condition"
) -> None:
    """Yield to the loop until ``condition()`` holds (sync or async; a signal, not a timer)."""
    for _ in range(200_000):
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")
