"""work(): the continuous runtime for agent fleets, one handler call per item.

    summary = await work(store, handle, concurrency=32, timeout=120, stop=stop, grace=30)

``handle(claim)`` is a coroutine function that gets one `ClaimedItem` and returns one
outcome (`Done`, `Failed`, `Retry`, `Park`, `Offload`). work() keeps ``concurrency``
handlers running: each item is settled the moment its handler returns, and a freed slot is
filled by the next claim at once (several free slots by one ``claim_batch``), so a slow
item never holds back the others, as it does in drain()'s lockstep batches.

A slot is free once its handler has returned, not once its settle has committed. Where
the backend shares a settle's round with a claim (`Backend.settle_with_claim`: SQLite),
the slot's next claim is asked for right behind the settle, so the two go to the writer
in the same round, one transaction, the settle first (a per-project ``max_running`` sees
the settled item gone), and at ``concurrency=1`` an item costs one write round, not two.
On PostgreSQL, where a settle or a claim alone is one statement that commits by itself,
the claim is asked for once the settle is done. Either way the claim commits with the
settle or after it (unless the settle fails inside the round: the rest commit without
it, and the settle is tried again).

The rules it keeps:

* **Claims wait, never poll.** With nothing to claim, it sleeps on the store's wake-ups
  (`asyncplane._wakeups`): an enqueue, retry or release here or in another process, a
  deferred item falling due, a lease lapsing, a running item finishing, or ``stop``.
* **Leases are renewed** every third of a lease while an item runs, by one renewer task
  for the whole run (`_keep_leases`): the leases due within the next sixth of a lease
  are renewed together, in one write round. A renewal refused because the item was
  taken over or cancelled (`ItemCancelled`) cancels that item's handler; its late
  outcome is never reported, only counted. A renewal the store fails under is tried again
  while the lease has time; an item whose lease is about to end unrenewed has its handler
  cancelled and is left to the lease (``unsaved``). A renewer cancelled by someone else
  stops the worker.
* **A store that fails for a moment** (a server restarting) is ridden out: the claim loop
  looks again after growing pauses for up to `OUTAGE_SECONDS`, then raises the failure;
  a settle or a give-back is tried again for a few seconds, then its item is left to its
  lease (logged, counted ``unsaved``) and the worker goes on.
* **Time limits.** Past ``timeout`` seconds an item's task is cancelled and the item is
  retried with ``timed out after N s`` (it spends an attempt; a spent budget fails it).
* **A handler's exception** retries the item with the exception's type and message as
  its error, and is logged with its traceback (logger ``asyncplane.worker``, with the
  item id, project, attempt and fence as ``extra`` fields). A handler's task cancelled
  by anyone but the worker (the handler itself, a library it calls) is retried the same
  way, logged as a warning (no traceback), with ``the handler was cancelled, not by the
  worker``: the item is settled, never left to its lease.
* **Stopping.** Once ``stop`` is set, or the store is closed, no more claims (even with
  every slot busy); running items get ``grace`` seconds to finish, then their tasks are
  cancelled and their claims given back at once (`ControlStore.release`: ready again,
  the attempt refunded), so another worker takes them now rather than after the lease.
  A cancelled work() does the same without the grace, then re-raises. Nothing claimed
  is left to its lease by a stop, unless the store fails under its give-back.
* **Many workers.** By default (``exclusive=False``) any number of workers run side by
  side, in any number of processes and hosts: claims are atomic. ``exclusive=True``
  takes the single-drainer guard, as drain() does, and returns at once (``skipped``) if
  another holds it.
* **Housekeeping** as drain() does it, on a throttle: a bounded preflight dedup step and
  the store's retention purge, a step at most once a second (the purge itself throttled
  to the store's ``purge_min_interval_s``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from asyncplane import (
    _clock,
    _engine,
    _errors,
    _lock,
    _loops,
    _store,
    _tasks,
    _telemetry,
    _validate,
    _wakeups,
)
from asyncplane._drain import DrainError
from asyncplane._models import ClaimedItem
from asyncplane._outcomes import (
    KINDS,
    LOST,
    UNKNOWN_CLAIM_MARGIN,
    DrainSummary,
    Outcome,
    Retry,
    Settler,
    count_lost,
    exit_asked,
    give_back,
    give_back_lost_claim,
    lasting,
    left_unsettled,
    returned_or_raised,
    short_error,
)
from asyncplane._record import Record
from asyncplane._store import ControlStore, log_fields

__all__ = ("Handler", "Settings", "handling", "settings", "work")

#: ``async def handle(claim: ClaimedItem) -> Outcome``: runs one item.
Handler: TypeAlias = Callable[[ClaimedItem], Awaitable[Outcome]]

_log = logging.getLogger("asyncplane.worker")
#: Seconds between housekeeping steps (preflight dedup, purge) while claiming.
_HOUSEKEEPING_EVERY = 1.0
#: How long the claim loop rides out a store that fails every try (a server restarting,
#: a failover), looking again after each pause, before the worker stops with the failure.
OUTAGE_SECONDS = 60.0
_OUTAGE_PAUSES = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


class Settings(Record):
    """work()'s settings that a command line gives too, checked (`settings`)."""

    owner: str
    concurrency: int
    timeout: float | None
    project_id: str | None
    grace: float


def settings(
    owner: object, concurrency: object, timeout: object, project_id: object, grace: object
) -> Settings:
    """work()'s ``owner`` (None: a name made for this process), ``concurrency``,
    ``timeout``, ``project_id`` and ``grace``, checked: the worker command checks them
    before it opens the store, so that a bad one is a usage error."""
    return Settings(
        _validate.text_id(owner if owner is not None else _engine.worker_name("work"), "owner"),
        _validate.positive_int(concurrency, "concurrency"),
        None if timeout is None else _validate.seconds(timeout, "timeout", 10.0**7),
        None if project_id is None else _validate.text_id(project_id, "project_id"),
        _validate.delay(grace, "grace"),
    )


async def work(
    store: ControlStore,
    handle: Handler,
    *,
    concurrency: int = 16,
    timeout: float | None = None,
    project_id: str | None = None,
    actor_id: str | None = None,
    owner: str | None = None,
    exclusive: bool = False,
    lock_path: str | pathlib.Path | None = None,
    stop: asyncio.Event | None = None,
    grace: float = 30.0,
    until_empty: bool = False,
    poll_interval: float = 0.1,
    preflight_chunk: int = 500,
    progress: Callable[[DrainSummary], None] | None = None,
) -> DrainSummary:
    """Run the store's work through ``handle``, one item per call, ``concurrency`` at once.

    Args:
        store: The store to work on.
        handle: ``async def handle(claim: ClaimedItem) -> Outcome``.
        concurrency: Items running at once.
        timeout: Seconds an item may run before it is cancelled and retried (None: no
            limit).
        project_id: Work only this project.
        actor_id: Work as this actor: only its projects.
        owner: The name claims are made under (default: host, process and an id).
        exclusive: Run alone, behind the single-drainer guard (as drain() does).
        lock_path: With ``exclusive``, the lock file to use instead of the store's own.
        stop: Set it to stop gracefully (see ``grace``).
        grace: Seconds running items get to finish once ``stop`` is set or the store
            is closed; the rest are cancelled and their claims given back unrun.
        until_empty: Return once nothing is claimable and nothing runs, instead of
            waiting for work until ``stop``.
        poll_interval: Seconds between looks for other processes' commits, on SQLite.
        preflight_chunk: Items a preflight dedup step may touch.
        progress: Called with the running summary after each item is settled (a status
            line, metrics); it must not block.

    Returns:
        A `DrainSummary` (``rounds`` counts the claims made); ``skipped=True`` if
        ``exclusive`` and another runner held the guard.

    Raises:
        StorageError: The store failed every try of the claim loop for `OUTAGE_SECONDS`
            (a server gone for good); the running items were given back first where the
            store allowed.
        DrainError: The single-runner guard was lost, or the lease renewer was cancelled
            by someone else (the error is the cause); the running items were given back
            first where the store allowed.
    """
    _engine.require_asyncio()
    started = time.monotonic()
    problem = _validate.callable_problem(handle, "the claim")
    if problem is not None:
        raise _errors.InvalidType(
            f"handle must be an async function taking one ClaimedItem: {problem}"
        )
    given = settings(owner, concurrency, timeout, project_id, grace)
    run = _Worker(
        store,
        handle,
        owner=given.owner,
        concurrency=given.concurrency,
        timeout=given.timeout,
        project_id=given.project_id,
        actor_id=_validate.optional_actor(actor_id),
        stop=_validate.event(stop, "stop"),
        grace=given.grace,
        until_empty=_validate.boolean(until_empty, "until_empty"),
        poll_interval=_validate.seconds(poll_interval, "poll_interval", 3600.0),
        preflight_chunk=_validate.positive_int(preflight_chunk, "preflight_chunk"),
        progress=_validate.callback(progress, "progress"),
    )
    lock = None if lock_path is None else _validate.resolved_path(lock_path, "lock_path")
    _log.info(
        "asyncplane worker %s starting (concurrency %d%s, on %s)", run.owner, run.concurrency,
        "" if run.project_id is None else f", project {run.project_id}", _loops.running(),
    )  # fmt: skip
    if run.project_id is not None:
        await _look_for(store, run.project_id, run.owner)
    try:
        if _validate.boolean(exclusive, "exclusive"):
            async with _store.engine_of(store).single_runner(lock) as guard:
                if not guard:
                    _log.warning(
                        "asyncplane worker %s: another runner holds the single-runner "
                        "guard (exclusive=True): it runs nothing", run.owner,
                    )  # fmt: skip
                    run.summary.skipped = True
                    return run.summary
                run.guard = guard
                await run.loop()
        else:
            await run.loop()
        if not run.store_closed():  # counting would reopen a closed store
            run.summary.remaining = await left_unsettled(
                store, run.project_id, run.actor_id, f"asyncplane worker {run.owner}", _log
            )
    finally:
        run.summary.elapsed_s = time.monotonic() - started
        _log.info("asyncplane worker %s stopped: %s", run.owner, run.summary)
    return run.summary


async def _look_for(store: ControlStore, project_id: str, owner: str) -> None:
    """Warn when a worker is started on a project that does not exist (a typo, often):
    it waits for the project's work all the same, as a project can be made later."""
    try:
        await store.project(project_id)
    except _errors.UnknownProject:
        _log.warning(
            "asyncplane worker %s: there is no project %r (yet); it waits for one",
            owner, project_id,
        )  # fmt: skip


@dataclasses.dataclass
class _Worker:
    store: ControlStore
    handle: Handler
    owner: str
    concurrency: int
    timeout: float | None
    project_id: str | None
    actor_id: str | None
    stop: asyncio.Event
    grace: float
    until_empty: bool
    poll_interval: float
    preflight_chunk: int
    progress: Callable[[DrainSummary], None] | None = None
    summary: DrainSummary = dataclasses.field(default_factory=DrainSummary)
    guard: _lock.Guard = dataclasses.field(default_factory=lambda: _lock.Guard(True))

    def __post_init__(self) -> None:
        self.engine = _store.engine_of(self.store)
        #: Items whose handler runs, by item id and fence (a lapsed lease may hand this
        #: worker the same item again, at a higher fence): the leases `_keep_leases` renews.
        self.held: dict[tuple[int, int], _Held] = {}
        self.held_again = asyncio.Event()  # set when ``held`` is no longer empty
        self.third = self.store.lease_seconds / 3
        self.renewer_stopping = False  # the renewer's end is the worker's own doing
        self.settler = Settler(self.store, self.actor_id, self.summary, "handler")
        self.running: dict[asyncio.Task[None], ClaimedItem] = {}
        #: Running items that are settling: a stop leaves them to finish (`_settle_to_end`).
        self.settling: set[asyncio.Task[Any]] = set()
        self.failure: BaseException | None = None
        #: A handler's SystemExit or KeyboardInterrupt: raised once the worker has wound up.
        self.exiting: BaseException | None = None
        self.wake = asyncio.Event()  # set whenever a running item ends
        #: The loop waits for a free slot (`_until_a_slot_frees`): a settle wakes it (on
        #: PostgreSQL the item's end, once the settle is done).
        self.waiting_for_slot = False
        self.next_housekeeping = 0.0
        self.closes = self.engine.closes  # the store closed since: stop
        self.past_due = _wakeups.PastDue()  # this worker's, as it waits for work
        #: The store has failed every try of the claim loop since (None: it answers).
        self.outage: _Outage | None = None
        #: When a claim whose outcome is unknown was asked for (`CommitOutcomeUnknown`),
        #: by the store's clock: it may have been saved, its items claimed under this
        #: worker's name with nobody to run them (`_give_back_unknown`). None: none is.
        self.unknown_claim_at: float | None = None
        #: The claims this worker received lately (the store's time each was asked for,
        #: and its item and fence), oldest first: none of them is a lost claim's, whatever
        #: became of it since (run and settled, or left unsaved). Kept back to twice
        #: `UNKNOWN_CLAIM_MARGIN` before the oldest claim that could yet prove unknown.
        self.received: collections.deque[tuple[float, tuple[int, int]]] = collections.deque()

    def interrupted(self) -> bool:
        """Whether the claim loop must make no new claim: a stop, a failure (the
        renewer's, say), or a close of the store (a claim would open it again)."""
        return self.stop.is_set() or self.failure is not None or self.store_closed()

    def store_closed(self) -> bool:
        """Whether the store was closed since the worker began: it stops, and no read or
        claim of its may open the store again."""
        return self.engine.closes != self.closes

    # --- the loop ----------------------------------------------------------------------

    async def loop(self) -> None:
        renewer = asyncio.create_task(
            self._keep_leases(), name=f"asyncplane-work-renew[{self.owner}]"
        )
        renewer.add_done_callback(self._renewer_ended)
        forget = self.guard.when_lost(self._guard_lost)
        try:
            await self._run()
        finally:
            forget()
            self.renewer_stopping = True  # every item has ended: nothing is left to renew
            cut = await _tasks.stop(renewer)
        if cut:
            raise asyncio.CancelledError

    async def _run(self) -> None:
        try:
            await self._claim_while_open()
        except BaseException:
            await _tasks.to_the_end(self._shut_down(0.0), f"asyncplane-work-stop[{self.owner}]")
            await self._give_back_at_stop()  # (a cancel as a claim's answer was lost, say)
            raise
        cancelled = False
        if self.running and self.grace > 0 and self.failure is None:
            try:  # the grace may be cut short: a second stop, a cancel
                await self._grace()
            except asyncio.CancelledError:
                cancelled = True
        _, again = await _tasks.to_the_end(
            self._shut_down(0.0), f"asyncplane-work-stop[{self.owner}]"
        )
        cancelled = cancelled or again
        cancelled = await self._give_back_at_stop() or cancelled
        if self.failure is not None:
            raise DrainError(
                f"work() stopped under its running items: {self.failure!r}", self.summary
            ) from self.failure
        if cancelled:
            raise asyncio.CancelledError
        if self.exiting is not None:
            raise self.exiting

    async def _give_back_at_stop(self) -> bool:
        """At the stop, what a claim whose outcome was unknown may have taken, with no
        claim since to give it back after: a stop leaves nothing claimed that it can give
        back (a store that fails leaves it to the leases, said). Whether a cancel came."""
        if self.unknown_claim_at is None or self.store_closed():
            return False
        try:
            _, cancelled = await _tasks.to_the_end(
                self._give_back_unknown(), f"asyncplane-work-give-back[{self.owner}]"
            )
        except _errors.StorageError as exc:
            _log.error(
                "asyncplane worker %s: what a claim whose answer was lost may have "
                "taken could not be given back (%s): left to its leases",
                self.owner, short_error(exc),
            )  # fmt: skip
            return False
        return cancelled

    async def _grace(self) -> None:
        """After a stop: until every running item has ended, ``grace`` runs out, or a
        failure (the renewer's, say: no lease is kept any more) ends it at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        while self.running and self.failure is None:
            left = deadline - loop.time()
            if left <= 0:
                return
            self.wake.clear()  # set by an item's end (`_ended`) and by a failure
            try:
                await _tasks.within(self.wake.wait(), left, "asyncplane-work-grace")
            except asyncio.TimeoutError:
                return

    async def _shut_down(self, grace: float) -> None:
        """No more claims: let running items finish for up to ``grace`` seconds, then
        cancel the rest, which give their claims back (see `_run_item`)."""
        if self.running and grace > 0:
            await asyncio.wait(set(self.running), timeout=grace)
        tasks = list(self.running)
        for task in tasks:
            if task not in self.settling:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _claim_while_open(self) -> None:
        # One task for the whole run wakes the loop at a stop, rather than one per wait
        # for a slot (`_until_a_slot_frees`); a close of the store sets ``wake`` itself.
        watcher = asyncio.create_task(self._wake_at_stop(), name="asyncplane-work-stop-wait")
        self.engine.watch_closes(self.wake)
        try:
            await self._claims()
        finally:
            self.engine.unwatch(self.wake)
            cut = await _tasks.stop(watcher)
        if cut:
            raise asyncio.CancelledError

    async def _wake_at_stop(self) -> None:
        await self.stop.wait()
        self.wake.set()

    async def _claims(self) -> None:
        try:
            await self._claiming()
        except _errors.StoreClosed:
            if not self.store_closed():
                raise
            # Closed under one of the loop's reads, its claim or its wait (a claim the
            # close refused took nothing): the worker stops, as at a stop.

    async def _claiming(self) -> None:
        while not self.interrupted():
            try:
                await self._claiming_until_a_failure()
                return
            except _errors.StorageError as exc:
                if lasting(exc) and not isinstance(exc, _errors.DatabaseLocked):
                    raise  # (not a store of asyncplane's, or of another version)
                self.outage = self.outage or _Outage(self.owner, exc)
                if self.outage.over():
                    raise
                await self.outage.pause(self.wake, self.interrupted)

    def _answered(self) -> None:
        """A claim, or a wait for work, went through: an outage, if one ran, is over."""
        if self.outage is not None:
            self.outage = None
            _log.warning("asyncplane worker %s: the store answers again", self.owner)

    async def _claiming_until_a_failure(self) -> None:
        busy = False  # the last claim took something: more is likely waiting
        while not self.stop.is_set() and self.failure is None:
            if self.store_closed():
                return  # the store was closed under the worker: it stops, as at a stop
            if self.guard.lost is not None:
                # Another runner may hold the guard now: stop claiming at once.
                self.failure = _errors.StorageError(
                    f"the single-drainer guard was lost ({self.guard.lost})"
                )
                return
            free = self.concurrency - self.handling()
            if free <= 0:
                await self._until_a_slot_frees()
                continue
            await self._housekeeping()
            if self.interrupted():
                continue  # a stop, a failure or a close meanwhile: the loop's top ends it
            if busy:
                # Straight after a claim that took something, claim without first reading
                # the store's data version (a read on another thread): only a claim that
                # finds nothing needs one before it, to wait on. Either way the loop goes
                # round again, through the checks above: a stop, a failure or a close of
                # the store may have come while this claim was out.
                busy = await self._claim(free)
                self._answered()
                continue
            local = self.engine.watch()
            try:
                version = await self.engine.data_version()  # before the claim
                if self.interrupted():
                    continue  # a stop (a signal's), a failure or a close during the read
                self.wake.clear()
                busy = await self._claim(free)
                self._answered()
                if busy:
                    continue
                if self.until_empty and not self.running:
                    return
                if self.failure is not None or self.store_closed():
                    continue  # it came after the clear above, and ends the loop at its top
                waiting = asyncio.create_task(self.wake.wait(), name="asyncplane-work-wake")
                try:
                    await _wakeups.until_work(
                        self.engine, local, version, poll_interval=self.poll_interval,
                        project_id=self.project_id, actor_id=self.actor_id, stop=self.stop,
                        also=waiting, schedules=True, past=self.past_due,
                    )  # fmt: skip
                finally:
                    waiting.cancel()
                    await asyncio.gather(waiting, return_exceptions=True)
            finally:
                self.engine.unwatch(local)

    def handling(self) -> int:
        """The slots taken: items running whose handler has yet to return."""
        return len(self.running) - len(self.settling)

    async def _until_a_slot_frees(self) -> None:
        """Until a handler returns (`_settle_to_end`, where the backend shares a settle's
        round with a claim), a running item ends (`_ended`), a stop (`_wake_at_stop`) or
        a close of the store (`Engine.watch_closes`): each sets ``wake``. Meanwhile the
        schedules keep their pace (`Engine.schedules_until`): a tick that falls while
        every slot is taken is enqueued when it falls, for another worker, or this one
        once a slot is free."""
        self.wake.clear()
        if self.handling() < self.concurrency or self.stop.is_set() or self.store_closed():
            return
        looks = self.engine.schedule_looks
        self.summary.scheduled += await self.engine.maybe_run_schedules(self.closes)
        if self.engine.schedule_looks != looks:
            # (Only a look the store answered: one not made, at most once a second, says
            # nothing of an outage, and said it was over every 10 s, which it never was.)
            self._answered()
        if self.wake.is_set():
            return  # a slot freed, or a stop came, while the schedules ran
        self.waiting_for_slot = True
        # The alarm wakes this loop for the schedules' next run, which comes round here.
        cancel_alarm = self.engine.busy_alarm(self.wake.set)
        try:
            await self.wake.wait()
        finally:
            self.waiting_for_slot = False
            # Not waited for: the claim that follows a settle must be queued at once, to
            # share its round (`_settle_to_end`); a cancelled alarm's task ends by itself.
            cancel_alarm()

    async def _housekeeping(self) -> None:
        # Schedules keep their own pace: at most once a second, and at each tick. Each
        # step first looks whether the store was closed meanwhile: a step would open it.
        self.summary.scheduled += await self.engine.maybe_run_schedules(self.closes)
        now = time.monotonic()
        if now < self.next_housekeeping or self.store_closed():
            return
        self.next_housekeeping = now + _HOUSEKEEPING_EVERY
        settled, _ = await self.engine.preflight_step(
            self.preflight_chunk, project_id=self.project_id, actor_id=self.actor_id
        )
        self.summary.deduplicated += settled
        if not self.store_closed():
            self.summary.purged += await self.engine.maybe_purge()

    async def _claim(self, free: int) -> bool:
        """Claim up to ``free`` items and start each; a claim that lands while this task is
        being cancelled still starts its items, which the shutdown then gives back.
        Whether it took something, or gave back what an unknown claim took (either way
        more is likely waiting: claim again at once)."""
        claiming = self.store.claim_batch(
            self.owner, free, actor_id=self.actor_id, project_id=self.project_id
        )
        asked = self.store.clock.now()
        try:
            batch, cancelled = await _tasks.to_the_end(
                claiming, f"asyncplane-work-claim[{self.owner}]"
            )
        except (_errors.CommitOutcomeUnknown, asyncio.CancelledError) as failed:
            # (Cancelled as the answer was lost: `to_the_end` raises the cancel, the loss
            # its cause.) The shutdown gives back what the claim may have taken.
            lost = failed if isinstance(failed, _errors.CommitOutcomeUnknown) else failed.__cause__
            if isinstance(lost, _errors.CommitOutcomeUnknown) and self.unknown_claim_at is None:
                self.unknown_claim_at = asked
            raise
        self._received(asked, batch)
        self.summary.rounds += 1
        self.summary.claimed += len(batch)
        for claim in batch:
            _log.debug(
                "claimed item %d at fence %d", claim.item_id, claim.fence, extra=log_fields(claim)
            )
            task = asyncio.create_task(
                self._run_item(claim), name=f"asyncplane-work-item[{claim.item_id}]"
            )
            self.running[task] = claim
            task.add_done_callback(self._ended)
        if cancelled:
            raise asyncio.CancelledError
        given_back = 0 if self.unknown_claim_at is None else await self._give_back_unknown()
        return bool(batch) or given_back > 0

    def _received(self, asked: float, batch: list[ClaimedItem]) -> None:
        """Note the claims of ``batch``, asked for at ``asked`` (the store's time), and
        forget those too old to be taken for a lost claim's."""
        self.received.extend((asked, (claim.item_id, claim.fence)) for claim in batch)
        oldest = asked if self.unknown_claim_at is None else min(asked, self.unknown_claim_at)
        while self.received and self.received[0][0] < oldest - 2 * UNKNOWN_CLAIM_MARGIN:
            self.received.popleft()

    async def _give_back_unknown(self) -> int:
        """Give back what a claim whose outcome was unknown took, once the store answers
        again (`give_back_lost_claim`), but for the claims this worker received since. A
        failure of the store is raised, the claim still to look at again (the claim loop
        rides the failure out, and this runs again after its next claim, or at the stop)."""
        assert self.unknown_claim_at is not None
        received = {key for _, key in self.received}
        received.update((claim.item_id, claim.fence) for claim in self.running.values())
        given = await give_back_lost_claim(
            self.store, self.owner, self.unknown_claim_at, received, self.project_id,
            self.actor_id, self.summary, f"asyncplane worker {self.owner}", _log,
        )  # fmt: skip
        self.unknown_claim_at = None  # all of them given back: none is to look at again
        return given

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.running.pop(task, None)
        self.wake.set()
        if not task.cancelled() and task.exception() is not None:
            self.failure = self.failure or task.exception()

    # --- one item --------------------------------------------------------------------------

    async def _run_item(self, claim: ClaimedItem) -> None:
        """Run and settle one item, its lease kept by `_keep_leases` while its handler
        runs; cancelled (a stop), give its claim back."""
        renew_at = self.settler.renewal_due(claim.lease_expires_at)
        handler = asyncio.create_task(
            _call(self.handle, claim), name=f"asyncplane-work-handle[{claim.item_id}]"
        )
        held = _Held(claim, handler, renew_at)
        if not self.held:
            self.held_again.set()
        self.held[held.key] = held
        try:
            done, _ = await asyncio.wait((handler,), timeout=self.timeout)
        except asyncio.CancelledError:
            await _tasks.to_the_end(self._give_back(held), "asyncplane-work-give-back")
            raise
        if handler not in done and not held.lost:
            # Past its time: cancelled, and waited for. Its lease is renewed until it has
            # really ended: a handler that ignores the cancellation still runs, and the
            # item must not be taken over and run beside it meanwhile.
            stopped = await _tasks.stop(handler)
            self.held.pop(held.key, None)  # no renewal is made for it from here
            if stopped:
                # A stop came meanwhile: the item goes back unspent, not retried (unless
                # it was lost meanwhile, which the give-back sees).
                await _tasks.to_the_end(self._give_back(held), "asyncplane-work-give-back")
                raise asyncio.CancelledError
        self.held.pop(held.key, None)  # no renewal is made for it from here
        if held.lost:
            # Taken over or cancelled: counted by the renewer, which cancelled the handler;
            # nothing is reported (but an exit its handler asked for meanwhile stands).
            await _tasks.stop(handler)
            self._exit_of_lost(handler)
            return
        if handler not in done:
            self.summary.timed_out += 1
            outcome: Any = Retry(f"timed out after {self.timeout:g} s")
            # (A handler that asked the program to exit as it was cancelled: the item is
            # retried, and the runtime stops and raises the exit all the same.)
            self._exit_of_lost(handler)
        else:
            outcome = self._outcome_of(claim, handler)
        await self._settle_to_end(claim, outcome)

    async def _settle_to_end(self, claim: ClaimedItem, outcome: Any) -> None:
        """Settle in the item's own task, which a stop no longer cancels once it is here.

        Only `_shut_down` cancels an item's task, and it leaves the tasks in
        ``settling`` alone; a cancel asked for before is delivered at the await the task
        was at, before this point. So the outcome is settled to its end without another
        task to shield it (one task fewer per item than `asyncplane._tasks.to_the_end`)."""
        task = asyncio.current_task()
        assert task is not None
        self.settling.add(task)  # its slot is free from here
        try:
            if self.waiting_for_slot and self.engine.backend.settle_with_claim:
                # The loop claims for the freed slot. One turn of the event loop lets it
                # start that claim before this settle is queued; the claim's request then
                # comes right behind the settle's, in the same turn, and the writer takes
                # both into one round: one transaction, the settle first. Where the
                # backend would rather run them apart (PostgreSQL), the loop is woken
                # once the settle is done (`_ended`), and its claim gets a round of its own.
                self.wake.set()
                await asyncio.sleep(0)
            await self._settle(claim, outcome)
        finally:
            self.settling.discard(task)

    async def _give_back(self, held: _Held) -> None:
        claim, handler = held.claim, held.handler
        await _tasks.stop(handler)  # its lease renewed until its handler has ended
        self.held.pop(held.key, None)  # no renewal is made for it from here
        if held.lost:
            self._exit_of_lost(handler)
            return  # taken over or cancelled: not ours to settle or give back
        if handler.done() and not handler.cancelled():
            # It finished just before the stop: its outcome stands.
            await self._settle(claim, self._outcome_of(claim, handler))
            return

        async def release() -> None:
            await self.store.release(claim.item_id, fence=claim.fence, actor_id=self.actor_id)
            self.summary.released += 1

        try:
            # A try refused after one whose outcome was unknown: the ledger says whether
            # that one was saved (and counts it), as for a settle.
            await give_back(release, functools.partial(self.settler.saved_before, claim))
        except LOST as refusal:
            # Taken over, cancelled or out of scope meanwhile (before a renewal told):
            # not ours to give back, and counted as what happened to it.
            count_lost(refusal, self.summary)
            return
        except _errors.StorageError as exc:
            self._unsaved(claim, "give-back", exc)

    def _unsaved(self, claim: ClaimedItem, what: str, failure: BaseException) -> None:
        """The store failed under an item's settle or give-back, tried again for seconds:
        the item stays claimed until its lease lapses, then is taken over and runs again.
        Said loudly, counted, and the worker goes on (the claim loop rides out an outage
        itself, and stops if it lasts)."""
        self.summary.unsaved += 1
        _log.error(
            "asyncplane worker %s: item %d's %s did not reach the store (%s): it stays "
            "claimed until its lease lapses, then runs again", self.owner, claim.item_id,
            what, short_error(failure), extra=log_fields(claim),
        )  # fmt: skip

    def _exit_of_lost(self, handler: asyncio.Task[Any]) -> None:
        """A lost item's handler that ended asking the program to exit (``sys.exit()``
        in the same turn, or as it was cancelled): the runtime stops and raises it all
        the same, as `_outcome_of` does for an item still held."""
        if handler.done() and not handler.cancelled():
            self.exiting = exit_asked(handler.result(), self.exiting, self.stop)

    def _outcome_of(self, claim: ClaimedItem, handler: asyncio.Task[Any]) -> Any:
        """The outcome of a handler that has ended; an exception it raised, something that
        is not an outcome, or a cancellation the worker did not ask for (the handler's
        own, a library's) retries the item, logged (an exception with its traceback)."""
        if handler.cancelled():
            # Not a stop, a timeout or a refused renewal: those are the worker's own and
            # never come here. Spending an attempt keeps a handler that always cancels
            # itself from running for ever.
            return _retry(claim, "the handler was cancelled, not by the worker")
        result = handler.result()
        self.exiting = exit_asked(result, self.exiting, self.stop)  # the others finish
        if isinstance(result, BaseException):
            _log.warning(
                "the handler raised on item %d: %s", claim.item_id, short_error(result),
                exc_info=result, extra=log_fields(claim),
            )  # fmt: skip
            return Retry(short_error(f"the handler raised {short_error(result)}"))
        if not isinstance(result, KINDS):
            return _retry(claim, f"the handler returned {type(result).__name__}, not an outcome")
        return result

    async def _settle(self, claim: ClaimedItem, outcome: Any) -> None:
        try:
            # Tried again while the store fails (a server restarting): a settle is fenced,
            # so a try after one whose answer was lost but which was saved is refused,
            # never saved twice; the ledger then says the first stands (`saved_before`),
            # and it is counted as what it was, not as taken over.
            await give_back(
                functools.partial(self.settler.settle, claim, outcome),
                functools.partial(self.settler.saved_before, claim),
            )
        except _errors.AsyncplaneError as exc:
            if not count_lost(exc, self.summary):
                if not isinstance(exc, _errors.StorageError):
                    raise
                self._unsaved(claim, f"outcome ({type(outcome).__name__})", exc)
        else:
            self._answered()  # (the store answers: an outage of the claim loop is over)
            _log.debug(
                "settled item %d: %s", claim.item_id, type(outcome).__name__,
                extra=log_fields(claim),
            )  # fmt: skip
        if self.progress is not None:
            self.progress(self.summary)

    # --- leases -----------------------------------------------------------------------------

    async def _keep_leases(self) -> None:
        """Renew each running item's lease a third of a lease after its claim or its last
        renewal, with every other lease due within the next sixth of a lease, all asked
        for in the same turn (so in one write round, up to the writer's batch size): one
        timer for the run, and one wake a turn, not a task and a timer an item.
        It ends with the worker: a store closed under the worker stops the worker's
        claims, not the leases of the items still running (their settles and give-backs
        reach the store too). A store's failure ends it early, and the worker with it
        (`_renewer_ended`)."""
        clock = self.store.clock
        while True:
            if not self.held:
                self.held_again.clear()
                await self.held_again.wait()
                continue
            # An item that starts later is due later: no wait need be cut short for it.
            due = min(held.renew_at for held in self.held.values())
            if clock.now() < due:
                await _clock.wait_until(clock, due)
                continue
            horizon = clock.now() + self.third / 2
            batch = [held for held in self.held.values() if held.renew_at <= horizon]
            failures = [
                failure
                for failure in await asyncio.gather(
                    *(self._renew(held) for held in batch), return_exceptions=True
                )
                if failure is not None
            ]
            if failures:
                raise failures[0]

    async def _renew(self, held: _Held) -> None:
        """Renew one lease; a refusal marks the item lost and cancels its handler. A
        renewal the store fails under (or that has no answer within a sixth of a lease) is
        tried again a moment later, until the lease is about to end: then the item is
        given up here, its handler cancelled, since another worker may take it over."""
        claim = held.claim
        margin = self.third / 4  # given up this long before the lease ends, at least
        left = held.expires - self.store.clock.now()
        try:
            # Bounded so that a try that hangs ends before the lease does, but always a
            # real try (a loop held up may come late: the store may renew all the same).
            expires = await _tasks.within(
                self.store.renew(claim.item_id, fence=claim.fence, actor_id=self.actor_id),
                min(self.third / 2, max(left - margin, left / 2, 0.05)),
                "asyncplane-work-renew-one",
            )  # fmt: skip
        except LOST as refusal:
            if self.held.get(held.key) is not held:
                return  # its handler has returned meanwhile: its settle hears the news
            del self.held[held.key]  # never renewed again, nor counted twice
            count_lost(refusal, self.summary)
            held.lost = True
            held.handler.cancel()
        except (_errors.StorageError, asyncio.TimeoutError) as exc:
            if self.held.get(held.key) is not held:
                return
            now, again = self.store.clock.now(), min(1.0, self.third / 4)
            # (A handler that has returned is left to its settle, which is tried and tells.)
            if held.handler.done() or now + again + self.third / 2 + margin < held.expires:
                held.renew_at = now + again  # the lease still has time: again soon
                return
            del self.held[held.key]
            self._unsaved(claim, "lease renewal", exc)
            held.lost = True
            held.handler.cancel()
        else:
            held.expires = expires.timestamp()
            held.renew_at = self.settler.renewal_due(expires)

    def _guard_lost(self) -> None:
        """The single-runner guard was lost (its PostgreSQL session ended): another runner
        may run now, so the worker stops at once and gives its running items back, as
        when its renewer fails, rather than let them run beside the other's."""
        self.failure = self.failure or _errors.StorageError(
            f"the single-drainer guard was lost ({self.guard.lost}): another runner may run now"
        )
        self.wake.set()

    def _renewer_ended(self, task: asyncio.Task[None]) -> None:
        """The renewer ended before the worker did: no lease is kept any more, so the
        worker stops (its failure says why) and gives its running items back."""
        if self.renewer_stopping:
            return
        if task.cancelled():
            failure: BaseException | None = _errors.AsyncplaneError(
                "work()'s lease renewer was cancelled by someone else"
            )
        else:
            failure = task.exception()
        if failure is not None:
            self.failure = self.failure or failure
            self.wake.set()


class _Held:
    """An item whose handler runs: its claim, its handler's task, when its lease is next
    to be renewed (by the store's clock) and whether a renewal was refused."""

    __slots__ = ("claim", "expires", "handler", "key", "lost", "renew_at")

    def __init__(self, claim: ClaimedItem, handler: asyncio.Task[Any], renew_at: float) -> None:
        self.key = (claim.item_id, claim.fence)
        self.claim = claim
        self.handler = handler
        self.renew_at = renew_at
        self.expires = claim.lease_expires_at.timestamp()  # the last lease granted
        self.lost = False


class _Outage:
    """A run of store failures under the claim loop, ridden out for `OUTAGE_SECONDS`."""

    def __init__(self, owner: str, first: BaseException) -> None:
        self.owner = owner
        self.began = time.monotonic()
        self.tries = 0
        _log.warning(
            "asyncplane worker %s: the store failed (%s); it looks again every few seconds "
            "for up to %g s", owner, short_error(first), OUTAGE_SECONDS,
        )  # fmt: skip

    def over(self) -> bool:
        """Whether the store has failed for longer than the worker waits."""
        return time.monotonic() - self.began > OUTAGE_SECONDS

    async def pause(self, wake: asyncio.Event, interrupted: Callable[[], bool]) -> None:
        """The next pause, cut short by ``wake`` (a stop, a close); none when one came
        while the failing call was out (``interrupted``)."""
        pause = _OUTAGE_PAUSES[min(self.tries, len(_OUTAGE_PAUSES) - 1)]
        self.tries += 1
        wake.clear()
        if interrupted():
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await _tasks.within(wake.wait(), pause, "asyncplane-work-outage")


#: The item whose handler the current task runs: set in the handler's own task (and so
#: seen by whatever it starts), never outside it.
_handling: contextvars.ContextVar[ClaimedItem | None] = contextvars.ContextVar(
    "asyncplane_handling", default=None
)


def handling() -> ClaimedItem | None:
    """The item whose handler is running in the calling task, or None (what the worker
    command's logs add to every record a handler logs)."""
    return _handling.get()


async def _call(handle: Handler, claim: ClaimedItem) -> Any:
    """The handler's outcome, or the exception it raised, as a value; run in the item's
    execution span (ended by a cancellation too: a timeout, a stop)."""
    _handling.set(claim)  # this task's own context: nothing outside it sees the value
    with _telemetry.execution_span(claim) as run:
        result = await returned_or_raised(_handled(handle, claim))
        run.finish(result)
        return result


async def _handled(handle: Handler, claim: ClaimedItem) -> Any:
    """The handler called and awaited: what it raises, calling or running, is its item's
    (`returned_or_raised`), and a call that gives no awaitable too."""
    running = handle(claim)
    if not inspect.isawaitable(running):
        raise _errors.InvalidType(
            f"the handler returned {type(running).__name__}, not an awaitable: a handler is "
            "an async function"
        )
    return await running


def _retry(claim: ClaimedItem, error: str) -> Retry:
    """Retry ``claim`` with ``error``, logged as a warning with the item's fields."""
    _log.warning("%s (item %d)", error, claim.item_id, extra=log_fields(claim))
    return Retry(error)
