"""drain(): the loop that runs a store's work through an executor, one drainer at a time.

    summary = await drain(store, execute)                       # until the queue is empty
    task = asyncio.create_task(drain(store, execute, mode="daemon"))  # until cancelled

Before its loop, drain() takes a `DrainLock` (by default a file beside the database); if
another drainer holds it, in this process or another, drain() returns at once with
``skipped=True`` and touches nothing. Each round then:

1. takes one bounded step of preflight dedup (`ControlStore.dedup_pending_against_done`),
   so pending twins of done items settle without running; and, if the store has a
   ``retention``, purges old settled items, at most every ``purge_min_interval_s`` and a
   bounded number of chunks at a time;
2. claims a batch (`ControlStore.claim_batch`, up to ``batch_size`` items);
3. runs the executor on the batch while a side task renews the batch's leases every
   third of a lease, so an executor slower than the lease keeps its claims;
4. settles every outcome through the store's fenced calls: `Done`, `Failed`, `Retry`,
   `Park`, `Offload`. A fence refusal is counted, never raised.

The executor gets the claimed items and returns one outcome per item, in order. If it
raises, every item of the batch is retried (a transient failure); if it returns the wrong
number of outcomes, or something that is not an outcome, the batch is retried too: never
a silent loss. Outcomes check their own fields when built (a negative delay, an empty
handle), so a bad one raises inside the executor, which retries the batch.

Stopping. In ``"foreground"`` mode the loop stops after ``empty_rounds`` rounds in a row
found nothing to claim; in ``"daemon"`` mode it waits for work instead, without busy
polling: it wakes at once when this process enqueues, notices other processes' commits
(on SQLite through a cheap ``PRAGMA data_version`` check every ``poll_interval`` seconds;
on PostgreSQL at once, through NOTIFY, and every five seconds regardless), and wakes
when the earliest deferred item falls due (by the store's clock). ``max_iters`` stops it
after that many rounds, every row durable, with ``remaining`` counting the work left.
Setting ``stop`` (an asyncio.Event) ends it after the current round.

Cancellation never decides what is saved. Claims in flight when the task is cancelled are
still received; every item of the batch that has not been settled goes back at once with
`ControlStore.park` (no attempt spent), outcomes already computed are settled, and the
lock is released. These clean-up writes are shielded from the cancellation, which is
re-raised once they are done.

Structure: the executor and the lease renewer run as named tasks; if the renewer fails
(anything but a fence refusal), the executor is cancelled, the batch goes back, and drain()
raises `DrainError` with the cause. So it does if the store fails under a settlement.
Clean-up work is awaited to its end even under a cancel scope that cancels again at every
await (anyio's), so a task group's cancellation cannot strand a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeAlias

from asyncplane import (
    _engine,
    _errors,
    _lock,
    _models,
    _store,
    _tasks,
    _telemetry,
    _validate,
    _wakeups,
)  # fmt: skip
from asyncplane._models import ClaimedItem
from asyncplane._outcomes import (
    KINDS,
    LOST,
    DrainSummary,
    Outcome,
    Retry,
    Settler,
    count_lost,
    exit_asked,
    give_back,
    give_back_lost_claim,
    left_unsettled,
    returned_or_raised,
    short_error,
)
from asyncplane._store import ControlStore

__all__ = ("DrainError", "Executor", "drain")

_log = logging.getLogger("asyncplane.drain")


Executor: TypeAlias = Callable[[list[ClaimedItem]], Awaitable[Sequence[Outcome]]]


class DrainError(_errors.AsyncplaneError):
    """drain() could not go on: a side task failed, or the store failed under a settlement.

    The drain put back the unsettled items it could (a store that cannot write at all,
    a full disk say, leaves them claimed until their leases lapse, when any claim takes
    them over) and released its lock. The failure is the ``__cause__``; ``summary`` says
    what the drain did until then.
    """

    def __init__(self, message: str, summary: DrainSummary) -> None:
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.summary))


async def drain(
    store: ControlStore,
    execute: Executor,
    *,
    owner: str | None = None,
    lock_path: str | os.PathLike[str] | None = None,
    batch_size: int = 16,
    mode: Literal["foreground", "daemon"] = "foreground",
    empty_rounds: int = 3,
    max_iters: int | None = None,
    project_id: str | None = None,
    actor_id: str | None = None,
    stop: asyncio.Event | None = None,
    poll_interval: float = 0.1,
    preflight_chunk: int = 500,
) -> DrainSummary:
    """Run the store's work through ``execute`` until it is done (or forever, as a daemon).

    Args:
        store: The store to drain.
        execute: ``async def execute(batch: list[ClaimedItem]) -> list[Outcome]``, one
            outcome per item, in the batch's order.
        owner: The name claims are made under (default: host, process and an id).
        lock_path: The single-drainer lock file (default: beside the database, with
            ``.drain.lock`` appended to its name).
        batch_size: Items claimed per round.
        mode: ``"foreground"`` stops after ``empty_rounds`` empty rounds in a row;
            ``"daemon"`` waits for new work instead.
        empty_rounds: See ``mode``.
        max_iters: Stop after this many rounds (None: no limit).
        project_id: Drain only this project.
        actor_id: Drain as this actor: only its projects.
        stop: Set it to end the drain after the current round.
        poll_interval: Seconds between a daemon's checks for other processes' commits.
        preflight_chunk: Items the preflight dedup step may touch per round.

    Returns:
        A `DrainSummary`; ``skipped=True`` if another drainer held the lock.

    Raises:
        DrainError: A side task failed (its error is the cause).
    """
    _engine.require_asyncio()  # before the lock, whose take is asyncio's
    started = time.monotonic()
    problem = _validate.callable_problem(execute, "the batch")
    if problem is not None:
        raise _errors.InvalidType(
            f"execute must be an async function taking one batch (a list of ClaimedItem): {problem}"
        )
    run = _Drain(
        store,
        execute,
        owner=owner if owner is not None else _engine.worker_name("drain"),
        batch_size=_validate.positive_int(batch_size, "batch_size"),
        mode=_mode(mode),
        empty_rounds=_validate.positive_int(empty_rounds, "empty_rounds"),
        max_iters=_validate.optional_positive_int(max_iters, "max_iters"),
        project_id=None if project_id is None else _validate.text_id(project_id, "project_id"),
        actor_id=_validate.optional_actor(actor_id),
        stop=_validate.event(stop, "stop"),
        poll_interval=_validate.seconds(poll_interval, "poll_interval", 3600.0),
        preflight_chunk=_validate.positive_int(preflight_chunk, "preflight_chunk"),
    )
    _validate.text_id(run.owner, "owner")
    lock = None if lock_path is None else _validate.resolved_path(lock_path, "lock_path")
    async with _store.engine_of(store).single_runner(lock) as guard:
        if not guard:
            _log.info("drain %s skipped: another drainer holds the guard", run.owner)
            return DrainSummary(skipped=True, elapsed_s=time.monotonic() - started)
        run.guard = guard
        _log.info("drain %s starting (%s)", run.owner, run.mode)
        try:
            await run.loop()
        finally:
            run.summary.elapsed_s = time.monotonic() - started
        if not run.store_closed():  # counting would open a closed store again
            run.summary.remaining = await left_unsettled(
                store, run.project_id, run.actor_id, f"drain {run.owner}", _log
            )
        run.summary.elapsed_s = time.monotonic() - started
        _log.info("drain %s stopped: %s", run.owner, run.summary)
        if run.exiting is not None:
            raise run.exiting
        return run.summary


def _mode(value: object) -> Literal["foreground", "daemon"]:
    if not isinstance(value, str):
        raise _errors.InvalidType(f"mode must be a str, not {type(value).__name__}")
    if value == "foreground":
        return "foreground"
    if value == "daemon":
        return "daemon"
    raise _errors.InvalidInput(
        f"mode must be 'foreground' or 'daemon', got {_validate.shown(value)}"
    )


@dataclasses.dataclass
class _Drain:
    store: _store.ControlStore
    execute: Executor
    owner: str
    batch_size: int
    mode: Literal["foreground", "daemon"]
    empty_rounds: int
    max_iters: int | None
    project_id: str | None
    actor_id: str | None
    stop: asyncio.Event
    poll_interval: float
    preflight_chunk: int
    summary: DrainSummary = dataclasses.field(default_factory=DrainSummary)
    guard: _lock.Guard = dataclasses.field(default_factory=lambda: _lock.Guard(True))
    #: An executor's SystemExit or KeyboardInterrupt: raised once the drain has wound up.
    exiting: BaseException | None = None

    def __post_init__(self) -> None:
        self.settler = Settler(self.store, self.actor_id, self.summary, "executor")
        #: Items of the running batch a renewal found lost (taken over, cancelled).
        self.lost: set[int] = set()
        self.closes = self.engine.closes  # the store closed since: stop
        self.past_due = _wakeups.PastDue()  # this drain's, as it waits for work

    def store_closed(self) -> bool:
        """Whether the store was closed since the drain began: it stops, as at a stop,
        and no read or claim of its may open the store again (the batch running at the
        close still settles, as `work()`'s running items do)."""
        return self.engine.closes != self.closes

    @property
    def engine(self) -> _engine.Engine:
        return _store.engine_of(self.store)

    async def loop(self) -> None:
        try:
            await self._rounds()
        except _errors.StoreClosed:
            if not self.store_closed():
                raise
            # Closed under one of the round's reads or its claim (a claim the close
            # refused took nothing): the drain stops, as at a stop.

    async def _rounds(self) -> None:
        empty = 0
        while not self.stop.is_set() and not self.store_closed():
            if self.max_iters is not None and self.summary.rounds >= self.max_iters:
                return
            if self.guard.lost is not None:
                # Another drainer may have the guard now: stop before claiming again.
                raise DrainError(
                    f"the single-drainer guard was lost ({self.guard.lost}); this drain "
                    "stopped so that no two drain at once",
                    self.summary,
                )
            self.summary.rounds += 1
            # A daemon starts watching before it claims, so work that arrives between an
            # empty claim and the wait still wakes it (an enqueue here sets the event; a
            # commit elsewhere moves data_version past the value read now).
            local = self.engine.watch() if self.mode == "daemon" else None
            try:
                # Each step looks first whether the store was closed meanwhile (a close
                # wakes a waiting daemon): a step would open it again.
                version = await self.engine.data_version() if local is not None else 0
                if self.store_closed():
                    return
                settled, _ = await self.engine.preflight_step(
                    self.preflight_chunk, project_id=self.project_id, actor_id=self.actor_id
                )
                self.summary.deduplicated += settled
                if self.store_closed():
                    return
                self.summary.purged += await self.engine.maybe_purge()
                if self.store_closed():
                    return
                self.summary.scheduled += await self.engine.maybe_run_schedules(self.closes)
                if self.store_closed() or self.stop.is_set():
                    return  # a stop or a close while the round's steps ran: no claim
                batch = await self._claim()
                if batch:
                    empty = 0
                    await (self._run_scheduling(batch) if local is not None else self._run(batch))
                    continue
                empty += 1
                if local is None:
                    if empty >= self.empty_rounds:
                        return
                else:
                    await self._wait_for_work(local, version)
            finally:
                if local is not None:
                    self.engine.unwatch(local)

    async def _claim(self) -> list[_models.ClaimedItem]:
        """Claim a batch; if cancelled meanwhile, still receive it and put it back. A
        claim whose outcome is unknown may have been saved, its items claimed under this
        drain's name with nobody to run them: they are given back before it is raised
        (the drain holds no other claim then)."""
        claiming = self.store.claim_batch(
            self.owner, self.batch_size, actor_id=self.actor_id, project_id=self.project_id
        )
        asked = self.store.clock.now()
        try:
            batch, cancelled = await _tasks.to_the_end(
                claiming, f"asyncplane-drain-claim[{self.owner}]"
            )
        except _errors.CommitOutcomeUnknown:
            await self._give_back_lost(asked)
            raise
        except asyncio.CancelledError as cut:
            # Cancelled as the claim's answer was lost (`to_the_end` raises the cancel,
            # the loss its cause): given back all the same, then the cancel goes on.
            if isinstance(cut.__cause__, _errors.CommitOutcomeUnknown):
                await self._give_back_lost(asked)
            raise
        if cancelled:  # the claim stands: hand its items back unrun, then stop
            await _tasks.to_the_end(self._put_back(batch, {}), "asyncplane-drain-put-back")
            raise asyncio.CancelledError
        self.summary.claimed += len(batch)
        return batch

    async def _give_back_lost(self, asked: float) -> None:
        """`give_back_lost_claim` for a claim asked for at ``asked``; a store that fails
        on leaves them to their leases, said."""
        runner = f"asyncplane drain {self.owner}"
        try:
            _, cancelled = await _tasks.to_the_end(
                give_back_lost_claim(
                    self.store, self.owner, asked, (), self.project_id, self.actor_id,
                    self.summary, runner, _log,
                ),
                f"asyncplane-drain-give-back[{self.owner}]",
            )  # fmt: skip
        except _errors.StorageError as exc:
            _log.error(
                "%s: what a claim whose answer was lost may have taken could not be given "
                "back (%s): left to its leases", runner, short_error(exc),
            )  # fmt: skip
            return
        if cancelled:
            raise asyncio.CancelledError

    async def _run_scheduling(self, batch: list[_models.ClaimedItem]) -> None:
        """A daemon's `_run`: the schedules keep their pace while the batch runs
        (`Engine.schedules_until`), so that a tick falling meanwhile is enqueued when it
        falls, not once the batch is over (a ``catch_up="none"`` tick a minute late would
        be skipped). A schedule run that fails is raised once the batch is settled, as
        the loop's own would be."""
        over = asyncio.Event()
        self.engine.watch_closes(over)  # a close ends them: a run would open the store again
        ticking = asyncio.create_task(
            self._schedules_until(over), name=f"asyncplane-drain-schedules[{self.owner}]"
        )
        try:
            await self._run(batch)
        except BaseException:
            over.set()
            await _tasks.stop(ticking)
            raise
        finally:
            self.engine.unwatch(over)
        over.set()
        scheduled, cut = await _tasks.to_the_end(
            ticking, f"asyncplane-drain-schedules[{self.owner}]"
        )
        self.summary.scheduled += scheduled
        if cut:
            raise asyncio.CancelledError

    async def _schedules_until(self, over: asyncio.Event) -> int:
        """`Engine.schedules_until`; a close under one of its runs ends it quietly."""
        try:
            return await self.engine.schedules_until(over, self.stop, self.closes)
        except _errors.StoreClosed:
            if not self.store_closed():
                raise
            return 0

    async def _run(self, batch: list[_models.ClaimedItem]) -> None:
        """Execute one batch under lease renewal, then settle every outcome."""
        self.lost = set()
        settled: dict[int, bool] = {}
        renewer = asyncio.create_task(
            self._renew(batch), name=f"asyncplane-drain-renew[{self.owner}]"
        )
        executor = asyncio.create_task(
            _call(self.execute, list(batch), self.owner),
            name=f"asyncplane-drain-execute[{self.owner}]",
        )
        failure: BaseException | None = None
        why = "the lease renewer failed"
        # The guard lost mid-batch (its session ended): another drainer may run now, so
        # this batch stops at once, as at a renewer's failure, not when it is done.
        lost: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def losing() -> None:
            if not lost.done():
                lost.set_result(None)

        forget = self.guard.when_lost(losing)
        watched: set[asyncio.Future[Any]] = {renewer, executor, lost}
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if lost in done and executor not in done:
                why = "the single-drainer guard was lost under a running batch"
                failure = _errors.StorageError(
                    f"the single-drainer guard was lost ({self.guard.lost}): another "
                    "drainer may run now"
                )
            elif renewer in done and renewer.cancelled() and executor not in done:
                # Cancelled, not by the drain (a stray CancelledError in a store call):
                # no lease is kept any more, so the batch stops as at a renewer's failure
                # (waited for unrenewed, its items ran twice once their leases lapsed).
                # Cancelled as the executor ended, the outcomes were had under held
                # leases: they are settled as any (below).
                failure = asyncio.CancelledError("the lease renewer was cancelled")
            elif renewer in done and not renewer.cancelled() and renewer.exception() is not None:
                failure = renewer.exception()
            elif renewer in done and not renewer.cancelled():
                # No item of the batch is this drain's any more (cancelled, taken over, out
                # of its scope): nothing the executor returns could be settled, and its
                # items may run elsewhere already. Stop it, settle nothing (see _renew).
                executor.cancel()
                _, cut_short = await _tasks.to_the_end(
                    asyncio.gather(executor, return_exceptions=True),
                    "asyncplane-drain-stop-executor",
                )
                if cut_short:
                    raise asyncio.CancelledError
                return
            else:
                # Cancelled itself (a library's stray CancelledError), not by the drain:
                # its batch retried, an attempt spent, as work() retries such a handler
                # (raised here, it ended the drain as if cancelled, and parked the batch
                # without an attempt, to be run and cancelled for ever).
                result = (
                    asyncio.CancelledError("the executor was cancelled, not by the drain")
                    if executor.cancelled()
                    else executor.result()
                )
                self.exiting = exit_asked(result, self.exiting, self.stop)  # batch retried
                outcomes = _checked(batch, result)
        except BaseException as exc:
            await _tasks.stop(renewer)
            if not all(settled.get(claim.item_id) for claim in batch):
                if isinstance(exc, asyncio.CancelledError):
                    # The cancellation is what the caller hears, even if the store fails
                    # under the put-back (what is left goes back as its leases lapse).
                    with contextlib.suppress(_errors.AsyncplaneError):
                        await self._interrupted(batch, settled, executor)
                else:
                    await self._interrupted(batch, settled, executor)
            raise
        finally:
            forget()
        if failure is not None:
            # Put back what can be put back, once; a store that cannot take even that (the
            # server down, say) leaves the rest claimed until the leases lapse. Either way
            # the failure is what the caller hears, as DrainError; unless the drain itself
            # was cancelled meanwhile, which its caller hears instead.
            cut = await _tasks.stop(renewer)
            try:
                cut = await self._interrupted(batch, settled, executor) or cut
            except asyncio.CancelledError:  # a cancel arrived, and the put-back failed
                cut = True
            except _errors.AsyncplaneError:
                pass
            error = DrainError(f"{why}: {failure!r}", self.summary)
            if cut:
                raise asyncio.CancelledError from error
            raise error from failure
        # From here on the work is done: stopping the renewer and settling run to their end
        # even if the task is cancelled meanwhile, and the cancellation goes on after.
        cancelled = await _tasks.stop(renewer)
        try:
            _, cut_short = await _tasks.to_the_end(
                self._settle(batch, outcomes, settled), f"asyncplane-drain-settle[{self.owner}]"
            )
        except _errors.AsyncplaneError as exc:  # (DrainError: what failed is put back)
            if cancelled:  # a cancellation arrived first: that is what the caller hears
                raise asyncio.CancelledError from exc
            raise
        if cancelled or cut_short:
            raise asyncio.CancelledError

    async def _interrupted(
        self,
        batch: list[_models.ClaimedItem],
        settled: dict[int, bool],
        executor: asyncio.Task[list[Any] | BaseException],
    ) -> bool:
        """Clean up a batch whose round was cut short; never itself cut short. Returns
        whether a cancellation arrived meanwhile."""
        cut = False
        if executor.done() and not executor.cancelled():
            # The work was done before the interruption: keep its outcomes.
            finished = _checked(batch, executor.result())
            try:
                _, cut = await _tasks.to_the_end(
                    self._settle(batch, finished, settled), "asyncplane-drain-settle"
                )
            except asyncio.CancelledError:  # a cancel arrived, and the settle failed
                cut = True
            except Exception:  # what it left unsettled is put back below
                pass
        else:
            executor.cancel()
            _, cut = await _tasks.to_the_end(
                asyncio.gather(executor, return_exceptions=True), "asyncplane-drain-stop-executor"
            )
        try:
            _, put_cut = await _tasks.to_the_end(
                self._put_back(batch, settled), "asyncplane-drain-put-back"
            )
        except _errors.AsyncplaneError as exc:  # the store failed under it
            if cut:  # and a cancellation arrived first: that is what the caller hears
                raise asyncio.CancelledError from exc
            raise
        return cut or put_cut

    async def _renew(self, batch: list[_models.ClaimedItem]) -> None:
        """Keep the batch's leases; return once no item of it is the drain's any more
        (the executor should stop: nothing it returns could be settled)."""
        await self.settler.keep_leases(batch, self.lost)

    async def _settle(
        self,
        batch: list[_models.ClaimedItem],
        outcomes: list[Outcome],
        settled: dict[int, bool],
    ) -> None:
        failure: _errors.AsyncplaneError | None = None
        for claim, outcome in zip(batch, outcomes, strict=True):
            if claim.item_id in self.lost:  # refused at its renewal: counted there
                settled[claim.item_id] = True
                continue
            try:
                await self.settler.settle(claim, outcome)
            except _errors.AsyncplaneError as exc:
                if not count_lost(exc, self.summary):  # the store failed under this item
                    failure = failure or exc
                    continue  # left unsettled: put back below
            settled[claim.item_id] = True
        if failure is not None:
            with contextlib.suppress(_errors.AsyncplaneError):
                await self._put_back(batch, settled)
            raise DrainError(f"settling an outcome failed: {failure!r}", self.summary) from failure

    async def _put_back(self, batch: list[_models.ClaimedItem], settled: dict[int, bool]) -> None:
        """Return every unsettled item of an interrupted batch, without spending an attempt
        (`give_back`: a store failing under it is tried again for a few seconds)."""
        for claim in batch:
            if settled.get(claim.item_id):
                continue
            with contextlib.suppress(*LOST):  # not ours any more
                await give_back(
                    functools.partial(
                        self.store.park, claim.item_id, fence=claim.fence, delay=0,
                        actor_id=self.actor_id,
                    )
                )  # fmt: skip
            settled[claim.item_id] = True

    async def _wait_for_work(self, local: asyncio.Event, version: int) -> None:
        """Sleep until new work may be claimable (see `asyncplane._wakeups`)."""
        await _wakeups.until_work(
            self.engine, local, version, poll_interval=self.poll_interval,
            project_id=self.project_id, actor_id=self.actor_id, stop=self.stop,
            schedules=True, past=self.past_due,
        )  # fmt: skip


async def _call(
    execute: Executor, batch: list[_models.ClaimedItem], owner: str
) -> list[Any] | BaseException:
    """Run the executor in the round's span, each item in an execution span of its own; an
    exception it raises comes back as a value (a transient failure)."""
    result: list[Any] | BaseException = asyncio.CancelledError()
    with _telemetry.round_span(owner, len(batch)):
        runs = _telemetry.executions(batch)
        try:
            result = await returned_or_raised(_listed(execute, batch))
        finally:
            for position, run in enumerate(runs):
                if isinstance(result, BaseException):
                    run.finish(result)
                else:  # a short list of outcomes is retried whole; its span says None
                    run.finish(result[position] if position < len(result) else None)
    return result


async def _listed(execute: Executor, batch: list[_models.ClaimedItem]) -> list[Any]:
    """The executor called and awaited, its answer as a list: what it raises, calling or
    running, or an answer that is no list of anything, is the batch's failure."""
    return list(await execute(batch))


def _checked(batch: list[_models.ClaimedItem], result: list[Any] | BaseException) -> list[Outcome]:
    """One valid outcome per item, or a Retry for every item saying what went wrong."""
    if isinstance(result, BaseException):
        _log.warning(
            "the executor raised on a batch of %d items (%s): %s", len(batch),
            ", ".join(str(claim.item_id) for claim in batch), short_error(result),
            exc_info=result, extra={"item_ids": [claim.item_id for claim in batch]},
        )  # fmt: skip
        return [Retry(short_error(f"the executor raised {short_error(result)}"))] * len(batch)
    if len(result) != len(batch):
        error = f"the executor returned {len(result)} outcomes for {len(batch)} items"
        return [Retry(error)] * len(batch)
    for outcome in result:
        if not isinstance(outcome, KINDS):
            error = f"the executor returned {type(outcome).__name__}, not an outcome"
            return [Retry(short_error(error))] * len(batch)
    return result
