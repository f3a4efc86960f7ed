"""Waiting for items to settle: one watcher a store, however many `wait()` calls.

`ControlStore.wait` looks at its item itself, in its caller's scope (so that a refusal
comes at once, and the answer is the caller's to see); until the item has settled it then
waits here. The watcher keeps the items waited for, and whenever one of them may have
settled it asks, in one statement for all of them, which are settled
(`_models.SETTLED_STATES`) or gone (`Backend.ended_among`), and wakes their callers alone;
each then looks again itself. One of them may have settled when:

* this process wrote (the engine's settle watchers: a finish, a cancel, any write that
  may settle an item, a NOTIFY of a settle on PostgreSQL, the store closing);
* the store's settle mark moved (`Engine.settled_mark`, looked at every poll interval,
  the shortest any caller asked for: on SQLite another connection's commit; on
  PostgreSQL the settle of a marked item, its safety look every few seconds, every look
  while its listener is lost, or the backend opened again);
* an item was added to the watch (it may have settled between its caller's look and
  now).

So a thousand callers waiting cost one read a wake-up, not a thousand, and a process that
writes fast wakes one task a write, not every caller: before, each wait slept on its own
and every write of the process woke them all, each to read its item (a hundred waiters
halved the rate of a worker in the same process), and on SQLite each looked at the
store's data version every poll interval on its own. A read that fails fails every wait
with its error (the store cannot be read: docs/items.md says a wait then fails); the
watcher ends when nobody waits, or the store closes, and the next wait starts another.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from asyncplane import _models, _tasks

if TYPE_CHECKING:
    from asyncplane import _backend, _engine

__all__ = ("SettleWatch",)


class SettleWatch:
    """The items a store's `wait()` callers wait for, and the one task that watches them
    (see the module)."""

    def __init__(self, engine: _engine.Engine) -> None:
        self._engine = engine
        #: Per item waited for, each caller's future and the poll interval it asked for.
        self._waiting: dict[int, list[tuple[asyncio.Future[None], float]]] = {}
        self._task: asyncio.Task[None] | None = None
        #: Set by the engine at every write of this process, settle heard and close.
        self._changed: asyncio.Event | None = None

    @property
    def waited(self) -> int:
        """How many items are waited for now (read by tests)."""
        return len(self._waiting)

    async def until_may_have_settled(self, item_id: int, poll: float, closes: int) -> None:
        """Return once ``item_id`` may have settled: it read as settled or gone, or the
        store closed (since ``closes``, the caller's count: at once if it has already).
        Raises what the watcher's read raised (a `StorageError`, `StoreClosed`)."""
        if self._engine.closes != closes:
            return  # closed since the caller's look: the caller says so itself
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (future, poll)
        self._waiting.setdefault(item_id, []).append(entry)
        self._start()
        try:
            await future
        finally:
            entries = self._waiting.get(item_id)
            if entries is not None and entry in entries:
                entries.remove(entry)
                if not entries:
                    del self._waiting[item_id]
            if not future.done():
                future.cancel()
            if not self._waiting and self._changed is not None:
                self._changed.set()  # the last caller gone: the watcher ends now

    def _start(self) -> None:
        """The watcher, started if none runs, told to read at once (a new item)."""
        if self._task is None or self._task.done():
            self._changed = self._engine.watch(settles=True)
            # The store's close count now, not at its first step: a close in between is
            # seen. In a context of its own, not its first caller's (a handler's span).
            watching = self._watch(self._changed, self._engine.closes)
            self._task = _tasks.detached(watching, "asyncplane-settles")
        assert self._changed is not None
        self._changed.set()

    async def _watch(self, changed: asyncio.Event, closes: int) -> None:
        engine = self._engine
        try:
            while self._waiting:
                if engine.closes != closes:
                    self._wake(list(self._waiting), None)  # each sees the close itself
                    return
                changed.clear()
                backend, mark = await engine.settled_mark()
                ids = list(self._waiting)
                self._wake(await backend.ended_among(ids, _models.SETTLED_STATES), None)
                if self._waiting:
                    await self._until_changed(changed, mark, closes, backend)
        except Exception as exc:  # a failed read: every caller hears it
            self._wake(list(self._waiting), exc)
        finally:
            engine.unwatch(changed)

    async def _until_changed(
        self, changed: asyncio.Event, mark: tuple[int, int], closes: int,
        backend: _backend.Backend,
    ) -> None:  # fmt: skip
        """Until this process writes, the settle mark moves past ``mark`` (looked at every
        shortest poll interval, never sooner, and at least as often as the backend's mark
        asks: a read-only PostgreSQL store's waits heard settles elsewhere only at their
        poll interval, not at the 5 s safety look), the store closes, or nobody waits."""
        engine = self._engine
        within = backend.versions_looked_within
        while self._waiting:
            poll = min(p for entries in self._waiting.values() for _, p in entries)
            poll = poll if within is None else min(poll, within)
            try:
                await _tasks.within(changed.wait(), poll, "asyncplane-settles-local")
                return
            except asyncio.TimeoutError:
                pass
            if engine.closes != closes or (await engine.settled_mark())[1] != mark:
                return

    def _wake(self, item_ids: list[int], failure: Exception | None) -> None:
        for item_id in item_ids:
            for future, _ in self._waiting.pop(item_id, []):
                if future.done():
                    continue
                if failure is None:
                    future.set_result(None)
                else:
                    future.set_exception(failure)
