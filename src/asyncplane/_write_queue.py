"""The part every backend's writer shares: a queue of write requests served in rounds.

Callers `submit` an operation and wait for its own outcome. One task per store, the
writer, takes every request waiting when it is free (up to ``max_batch``) and serves them
together in one round: one transaction, group-committed. How a round runs is the
backend's (`asyncplane._writer` for SQLite, `asyncplane._postgres_writer` for
PostgreSQL); so is closing its connection.

Stopping is never a cancellation of a round. `stop` lets the writer serve what is queued
and leave; if the writer task is cancelled instead (the event loop shutting down), the
round in progress still ends, requests not yet started are refused with StoreClosed, and
the connection closes last. A writer that fails (its connection broke) refuses every
later request with StoreClosed, the failure as its cause, and logs it once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asyncplane import _errors

__all__ = ("Request", "WriterBase")

T = TypeVar("T")

_log = logging.getLogger("asyncplane")

#: An operation and the future its caller waits on.
Request = tuple[Any, "asyncio.Future[Any]"]


class WriterBase:
    """A store's request queue and the task that serves it in rounds."""

    def __init__(
        self,
        *,
        name: str,
        max_batch: int,
        on_exit: Callable[[bool], Awaitable[None]] | None,
    ) -> None:
        self._name = name
        self._max_batch = max_batch
        self._on_exit = on_exit
        self._pending: collections.deque[Request] = collections.deque()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    # --- what a backend's writer provides ----------------------------------------------

    async def _serve(self, batch: list[Request]) -> None:
        """Run one round for ``batch``; every caller in it gets its outcome."""
        raise NotImplementedError

    async def _wind_up(self) -> None:
        """After the loop: let a round still in progress end (nothing by default)."""

    async def _close(self) -> None:
        """Close the write connection (the last thing the writer does)."""
        raise NotImplementedError

    # --- the shared part -----------------------------------------------------------------

    def start(self) -> None:
        """Start the writer task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"asyncplane-writer[{self._name}]"
        )
        self._task.add_done_callback(self._supervise)

    def _supervise(self, task: asyncio.Task[None]) -> None:
        # The writer's failure reaches every caller as StoreClosed (with the failure as its
        # cause); here it is logged once, and marked as seen so asyncio does not complain.
        if not task.cancelled() and task.exception() is not None:
            _log.error("asyncplane writer %s stopped", self._name, exc_info=task.exception())

    @property
    def running(self) -> bool:
        """True while the writer accepts requests."""
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def failed(self) -> bool:
        """True when the writer stopped because it failed (not by stop())."""
        return self._failure is not None

    async def submit(self, op: Any) -> Any:
        """Queue one operation and wait for its own result or error."""
        if not self.running:
            raise self._closed_error()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wakeup.set()
        return await future

    async def stop(self) -> None:
        """Serve every queued request, run ``on_exit``, close the connection; idempotent."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None and not self._task.done():
            # Wait for the writer without cancelling it: it finishes its queue and exits.
            # (asyncio.wait neither cancels the task nor raises what ended it.)
            await asyncio.wait([self._task])

    def _closed_error(self) -> _errors.StoreClosed:
        if self._failure is not None:
            err = _errors.StoreClosed(f"the store's writer stopped: {self._failure!r}")
            err.__cause__ = self._failure
            return err
        return _errors.StoreClosed("the store is closed")

    async def _run(self) -> None:
        graceful = False
        try:
            while True:
                if not self._pending:
                    if self._stopping:
                        graceful = True
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch: list[Request] = []
                while self._pending and len(batch) < self._max_batch:
                    request = self._pending.popleft()
                    if not request[1].cancelled():  # its caller gave up before it was written
                        batch.append(request)
                if batch:
                    await self._serve(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._stopping = True
            failure = self._closed_error()
            while self._pending:
                _, future = self._pending.popleft()
                if not future.done():
                    future.set_exception(failure)
            # The readers close first (after their reads, when the stop is graceful), so the
            # write connection is the last one: on SQLite, closing it checkpoints the WAL
            # and removes it, leaving a tidy database behind.
            try:
                await asyncio.shield(self._wind_up())
                if self._on_exit is not None:
                    await asyncio.shield(self._on_exit(graceful))
            finally:
                await asyncio.shield(self._close())
