"""Structured-concurrency helpers: work that must reach its end whatever is cancelled.

`within` bounds a wait in time without ever swallowing a cancellation, which
``asyncio.wait_for`` does before Python 3.12 when the cancellation comes just as the
awaited work ends (it returns the result, and the cancelled caller goes on).

A write that has been sent (a claim work() made, a put-back, a lock taken on a worker
thread) must be received and dealt with even if the task that sent it is cancelled
meanwhile; otherwise its effect is stranded (a batch claimed by nobody, a lock held by a
descriptor nobody closes). `to_the_end` awaits such work to its end and tells the caller
whether a cancellation arrived, so the caller can undo or keep what was done and re-raise.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ("detached", "stop", "to_the_end", "within")

T = TypeVar("T")


def detached(
    work: Coroutine[Any, Any, T], name: str, loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Task[T]:
    """A long-lived task of the store's (its writer, its readers' keeper, a watch), run in
    a context of its own rather than its creator's. Whichever call first opens a store
    starts them, a `work()` handler's say: a task copies its creator's context variables
    and keeps them as long as it runs, so every log line and span of the store's would
    name that handler's item for ever after."""
    loop = loop or asyncio.get_running_loop()
    return contextvars.Context().run(loop.create_task, work, name=name)


async def to_the_end(
    work: Awaitable[T], name: str, *, on_cancel: Callable[[], object] | None = None
) -> tuple[T, bool]:
    """Await ``work`` to its end whatever cancellations arrive meanwhile.

    Returns its result, and whether a cancellation arrived (the caller re-raises it once
    the work is saved). Work that fails after a cancellation arrived raises
    CancelledError, its error as the cause: the cancellation is never lost to it.
    asyncio.shield alone is not enough: a cancel scope (anyio) cancels again at every
    await, and the shielded work would be left running unattended. ``on_cancel`` is
    called as each cancellation arrives (to tell work that may still give up, having
    written nothing, that it should).
    """
    task = asyncio.ensure_future(work)
    if isinstance(task, asyncio.Task):
        task.set_name(name)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            if task.done():
                failed = task.exception()
                if failed is not None:
                    raise asyncio.CancelledError from failed
                return task.result(), True
            cancelled = True
            if on_cancel is not None:
                on_cancel()
        except BaseException as failed:  # the work's own error
            if cancelled:
                raise asyncio.CancelledError from failed
            raise


async def stop(task: asyncio.Future[Any]) -> bool:
    """Cancel a side task (or any future) and wait for it to end, whatever else is
    cancelled meanwhile; return whether a cancellation arrived for the caller."""
    task.cancel()
    name = task.get_name() if isinstance(task, asyncio.Task) else "future"
    _, cancelled = await to_the_end(asyncio.gather(task, return_exceptions=True), f"{name}-stop")
    return cancelled


async def within(work: Awaitable[T], timeout: float | None, name: str) -> T:
    """Await ``work`` for at most ``timeout`` seconds (None: no limit).

    asyncio.TimeoutError when the time runs out first. A cancellation of the caller
    is raised, even when ``work`` ended in the same instant: unlike ``asyncio.wait_for``
    before Python 3.12, never is a cancellation swallowed for a result. Either way
    ``work`` is cancelled and waited for to its end, however often the caller is
    cancelled meanwhile. Its result is then dropped: this is for waits whose result can
    be thrown away (a look, an event); work whose effect must be kept, a give-back say, goes
    through `to_the_end`.
    """
    task = asyncio.ensure_future(work)
    if isinstance(task, asyncio.Task):
        task.set_name(name)
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except asyncio.CancelledError:
        await stop(task)
        raise
    if not done and await stop(task):
        raise asyncio.CancelledError
    if task.cancelled():
        raise asyncio.TimeoutError(f"not done within {timeout:g} s")
    return task.result()  # it may have ended as the time ran out: that outcome stands
