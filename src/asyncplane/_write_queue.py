"""The part every backend's writer shares: a queue of write requests served in rounds.

Callers `submit` an operation and wait for its own outcome. The writer takes every
request waiting when it is free (up to ``max_batch``) and serves them together in one
round: one transaction, group-committed. On PostgreSQL one task per store, the writer
task, runs the rounds one after another (`WriterBase._serve_queue`); on SQLite callbacks
start them and the task only waits for the end (`asyncplane._writer`). How a round
begins, runs and commits is the backend's (`asyncplane._writer` for SQLite,
`asyncplane._postgres_writer` for PostgreSQL); so is closing its connection. What a round
is made of is shared:

* **Units.** Consecutive requests of the same `Grouped` kind (claims with the same
  filters, finishes) run as one unit, one call that answers for each member (`units`);
  every other request is a unit by itself.
* **Finishes first.** Within a stretch of grouped requests (claims and finishes, up to
  the next request of another kind), those marked ``ahead`` (finishes) run first, then
  the rest. Every request of a round is concurrent with every other (none of their
  callers has an answer yet), so any order is one its callers could have seen; this one
  keeps the only order a caller can ask for across two requests of one round, its
  settle before its next claim (`ControlStore.finish_and_claim`, work()), so a settle
  makes room, under ``max_running``, for the claim that rides with it. It also keeps
  interleaved finishes and claims to two units (two statements), not one each. A round
  that combines other processes' posts (`combined_order`, SQLite) keeps it too.
* **On condition.** A request may ride on another of its round (``Grouped.after``: the
  claim `ControlStore.finish_and_claim` sends with its settle): if that one is refused,
  it is not run, and answers `asyncplane._errors.NotRun` with nothing written
  (`riders`, `runnable`). The SQLite writer, where a settle and its claim share a round,
  keeps the condition, across processes too (`asyncplane._combine`); a request whose
  condition is not in its round runs as any other.
* **Outcomes.** A unit's answer for a member is a value, or a refusal that wrote nothing,
  carried as `Raised` so the others of the round still commit (`outcomes`); `deliver`
  hands each caller its own outcome.

Stopping is never a cancellation of a round. `stop` lets the writer serve what is queued
and leave; if the writer task is cancelled instead (the event loop shutting down), the
round in progress still ends, requests not yet started are refused with StoreClosed, and
the connection closes last. A writer that fails refuses every later request, the
failure as its cause, and logs it once: with StorageError where its connection was lost
(nobody closed the store, and its next call opens it afresh), else with StoreClosed.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
from collections.abc import Awaitable, Callable, Container, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeGuard, TypeVar

from asyncplane import _clock, _errors, _tasks

__all__ = (
    "Apart",
    "Grouped",
    "Named",
    "Pending",
    "Raised",
    "Request",
    "WriterBase",
    "call_unit",
    "caused",
    "combined_order",
    "deliver",
    "outcomes",
    "riders",
    "round_failed",
    "runnable",
    "units",
)

T = TypeVar("T")

_log = logging.getLogger("asyncplane.writer")

#: What the caller of a write awaits: the request's future, queued already, or a
#: coroutine that queues it once awaited (`asyncplane._writer.Writer.submit` while the
#: write lock is moving). Nothing else: a caller that drops a request it never awaits
#: (`asyncplane._store`'s cancelled claims) tells the two apart.
Pending = asyncio.Future[T] | Coroutine[Any, Any, T]

#: An operation and the future its caller waits on.
Request = tuple[Any, "asyncio.Future[Any]"]


class Raised:
    """Marks an operation's error among the outcomes of a round."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Grouped(Generic[T]):
    """A write request the writer may run together with its like.

    Requests with the same ``group_key`` that meet in one round run as one call,
    ``many([op, ...], conn, now)``, which answers for each of them in order: a value, or
    an AsyncplaneError instance for a refusal that wrote nothing. ``many`` is a plain
    function on SQLite (it runs on the connection's thread) and a coroutine function on
    PostgreSQL; `run` returns what it returns.
    """

    __slots__ = ("after", "ahead", "group_key", "many", "op")

    def __init__(
        self,
        group_key: tuple[Any, ...],
        op: Any,
        many: Callable[..., Any],
        ahead: bool = False,
        after: Grouped[Any] | None = None,
    ) -> None:
        self.group_key = group_key
        self.op = op
        self.many = many
        #: Runs ahead of the grouped requests queued before it in its round (see `units`).
        self.ahead = ahead
        #: Runs only if this request, in its round and ahead of it, was not refused (see
        #: `runnable`).
        self.after = after

    def run(self, members: Sequence[Any], conn: Any, now: float) -> Any:
        """``many`` for ``members`` (this request first among them)."""
        return self.many([member.op for member in members], conn, now)


class Named(Generic[T]):
    """A write request that runs by itself, as a plain operation does, and names the
    operation it writes (``op``: a `asyncplane._backend.RetryOp`, say), so that what a
    round saved for a caller that went away can still be told (`deliver`'s
    ``orphaned``). ``write(conn, now)`` is the backend's operation."""

    __slots__ = ("op", "write")

    def __init__(self, write: Callable[[Any, float], T], op: Any) -> None:
        self.write = write
        self.op = op

    def __call__(self, conn: Any, now: float) -> T:
        return self.write(conn, now)


class Apart(Generic[T]):
    """A PostgreSQL write request that has a round of its own (`WriterBase._take_batch`;
    SQLite's rounds hold the database's one write lock, and may take in other processes'
    posted rounds, so no request there is ever apart, nor needs to be): one that
    waits for other hosts' writes to commit (an unassign on PostgreSQL waits for every
    actor write holding the assignment row it deletes) must not meanwhile hold the row
    locks of the requests beside it, which those writes may be waiting for: the two
    would wait on each other until the server broke the deadlock. ``write(conn, now)``
    is the backend's operation."""

    __slots__ = ("write",)

    def __init__(self, write: Callable[[Any, float], T]) -> None:
        self.write = write

    def __call__(self, conn: Any, now: float) -> T:
        return self.write(conn, now)


def units(ops: Sequence[Any], todo: Iterable[int], alone: Container[int] = ()) -> list[list[int]]:
    """Split ``todo`` into units, in the order they run: consecutive `Grouped` requests
    that share a ``group_key`` form one; every other request, and every one in ``alone``
    (a member of a unit that broke, going again on its own), is a unit by itself. In a
    stretch of grouped requests (up to the next request that is not grouped) those marked
    ``ahead`` come first, in their order, then the others: see the module's docstring."""
    result: list[list[int]] = []
    stretch: list[int] = []
    for index in todo:
        if isinstance(ops[index], Grouped):
            stretch.append(index)
            continue
        _stretch_units(ops, stretch, alone, result)
        stretch = []
        result.append([index])
    _stretch_units(ops, stretch, alone, result)
    return result


def _stretch_units(
    ops: Sequence[Any], stretch: list[int], alone: Container[int], result: list[list[int]]
) -> None:
    """Add the units of one stretch of grouped requests to ``result``: those ``ahead``
    first, then the rest; like keys side by side form one unit, but for ``alone``."""
    if not stretch:
        return
    first = [index for index in stretch if ops[index].ahead]
    if first and len(first) < len(stretch):
        stretch = first + [index for index in stretch if not ops[index].ahead]
    last_key: tuple[Any, ...] | None = None
    for index in stretch:
        key = None if index in alone else ops[index].group_key
        if key is not None and key == last_key:
            result[-1].append(index)
        else:
            result.append([index])
        last_key = key


def riders(ops: Sequence[Any]) -> dict[int, int]:
    """Which requests of a round ride on another of it (`Grouped.after`): each one's index,
    to the index of the one it rides on. A request whose condition is not in the round
    rides on nothing here: it runs as any other."""
    if not any(type(op) is Grouped and op.after is not None for op in ops):
        return {}
    place = {id(op): index for index, op in enumerate(ops)}
    riding: dict[int, int] = {}
    for index, op in enumerate(ops):
        if type(op) is Grouped and op.after is not None:
            at = place.get(id(op.after))
            if at is not None:
                riding[index] = at
    return riding


def runnable(unit: list[int], riding: Mapping[int, int], outcomes: list[Any]) -> list[int]:
    """The members of ``unit`` to run now: each riding on a request (``riding``, from
    `riders`) that was refused is answered `asyncplane._errors.NotRun` in ``outcomes``
    instead, with nothing written. The one ridden on has run by then: a request rides
    only on one marked ``ahead`` (a finish), queued right before it."""
    kept: list[int] = []
    for index in unit:
        at = riding.get(index)
        if at is not None and isinstance(outcomes[at], Raised):
            outcomes[index] = Raised(_errors.NotRun("the request it rode on was refused"))
        else:
            kept.append(index)
    return kept


def combined_order(every: Sequence[Any], own: int) -> list[int]:
    """The order a combined round runs in (indexes into ``every``: the holder's ``own``
    requests first, then those it took from other processes, all `Grouped`). The holder's
    own keep their order, as in any round (a claim after an enqueue may take its item);
    the taken ones, which no order binds to them but each poster's own, go like with
    like, so each kind runs as one unit: those of a group key right after the holder's
    last request of that key, or at the end, in the order they came. A taken kind marked
    ``ahead`` (finishes) goes no later than any other taken kind, so that `units` runs a
    poster's settle before the claim it sent with it, as in the poster's own round."""
    taken: dict[Any, list[int]] = {}
    for index in range(own, len(every)):
        taken.setdefault(every[index].group_key, []).append(index)
    at = dict.fromkeys(taken, own - 1)  # after which of the holder's own requests
    for index in range(own):
        op = every[index]
        if isinstance(op, Grouped) and op.group_key in taken:
            at[op.group_key] = index
    first = [key for key, indexes in taken.items() if every[indexes[0]].ahead]
    rest = [key for key in taken if key not in first]
    if first and rest:
        earliest = min(at[key] for key in rest)
        for key in first:
            at[key] = min(at[key], earliest)
    placed: dict[int, list[int]] = {}
    for key in first + rest:
        placed.setdefault(at[key], []).extend(taken[key])
    order: list[int] = list(placed.get(-1, ()))  # a round of taken requests only
    for index in range(own):
        order.append(index)
        order.extend(placed.get(index, ()))
    return order


def call_unit(ops: Sequence[Any], unit: Sequence[int], conn: Any, now: float) -> tuple[Any, bool]:
    """Start one unit on ``conn``: what its call returned (on PostgreSQL, an awaitable),
    and whether that answers for a group (see `outcomes`)."""
    first = ops[unit[0]]
    if isinstance(first, Grouped):
        return first.run([ops[index] for index in unit], conn, now), True
    return first(conn, now), False


def outcomes(result: Any, grouped: bool) -> list[Any]:
    """A unit's outcomes: a single request's result, or a group's answers with each
    refusal it returned (having written nothing for it) as `Raised`."""
    if not grouped:
        return [result]
    return [Raised(r) if isinstance(r, _errors.AsyncplaneError) else r for r in result]


def round_failed(exc: BaseException) -> _errors.StorageError:
    """What every caller of a round hears when the round failed outside any operation
    (the clock raised, say): nothing of it was saved; the writer goes on. A failure the
    store named itself keeps its words (as when an operation meets it: the same failure
    reads the same in either place, on either backend)."""
    if isinstance(exc, _errors.StorageError):  # its own class too (DatabaseLocked, ...)
        return caused(copy.copy(exc), exc)
    return caused(_errors.StorageError(f"the write round failed: {exc!r}"), exc)


E = TypeVar("E", bound=BaseException)


def caused(error: E, cause: BaseException) -> E:
    """``error`` with ``cause`` as its ``__cause__`` (as ``raise error from cause`` would
    set it), for errors handed to callers rather than raised here."""
    error.__cause__ = cause
    return error


#: Told of a request whose caller was cancelled while its round ran, and of the value
#: the round answered it with (`WriterBase.orphaned`).
Orphaned = Callable[[Any, Any], None]


def deliver(
    batch: Sequence[Request], outcomes: Sequence[Any], orphaned: Orphaned | None = None
) -> None:
    """On the event loop: hand each caller its own outcome. One cancelled while its round
    ran gets nothing (the round stands); if the round answered it with a value, not a
    refusal, ``orphaned`` hears of it (a claim nobody will run is given back, a settle or
    an enqueue saved is counted and wakes waiters)."""
    gone: list[tuple[Any, Any]] = []
    for (op, future), outcome in zip(batch, outcomes, strict=True):
        if future.done():
            if orphaned is not None and future.cancelled() and not isinstance(outcome, Raised):
                gone.append((op, outcome))
            continue
        if isinstance(outcome, Raised):
            error = outcome.error
            if isinstance(error, StopIteration):  # a future would refuse it, or rewrap it
                error = caused(_errors.StorageError(f"the operation raised {error!r}"), error)
            future.set_exception(error)
        else:
            future.set_result(outcome)
    # After every caller has its outcome: what `orphaned` queues comes after their wake-ups.
    for op, outcome in gone:
        tell(orphaned, op, outcome)


def has_answer(call: Awaitable[T]) -> TypeGuard[asyncio.Future[T]]:
    """Whether ``call`` is a future holding a value (not a refusal, not cancelled): a
    caller cancelled as it was answered finds its answer there."""
    return (
        isinstance(call, asyncio.Future)
        and call.done()
        and not call.cancelled()
        and call.exception() is None
    )


def tell(orphaned: Orphaned | None, op: Any, outcome: Any) -> None:
    """``orphaned(op, outcome)``, a failure of it logged, never raised: it runs where a
    caller's outcome or cancellation must not be lost to it."""
    if orphaned is None:
        return
    try:
        orphaned(op, outcome)
    except Exception:
        _log.exception(
            "asyncplane: a request saved for a cancelled caller could not be followed up "
            "(a claim given back, a settle or an enqueue counted)"
        )


class WriterBase:
    """A store's request queue, served in rounds on ``conn`` (the one write connection),
    with "now" from ``clock`` (None: the backend's own), and the task that owns it: the
    task serves the rounds (`_serve_queue`) unless the backend starts them otherwise."""

    def __init__(
        self,
        conn: Any,
        clock: _clock.Clock | None,
        *,
        name: str,
        max_batch: int = 256,
        on_exit: Callable[[bool], Awaitable[None]] | None = None,
        orphaned: Orphaned | None = None,
    ) -> None:
        self._conn = conn
        self._clock = clock
        self._name = name
        self._max_batch = max_batch
        self._on_exit = on_exit
        #: Hears of a request answered with a value after its caller was cancelled.
        self.orphaned = orphaned
        #: False once the task has stopped serving its queue (it is winding up).
        self._serving = True
        self._pending: collections.deque[Request] = collections.deque()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        #: True when ``_failure`` is no round's: the connection was lost while idle (the
        #: store opens afresh on its next call, and says so then).
        self._failed_idle = False
        #: True when a round stopped the writer because its connection was lost (a
        #: server restarted, a backend terminated): an event the store recovers from, by
        #: opening afresh on its next call, not a fault of the writer's own.
        self._connection_lost = False
        self._task: asyncio.Task[None] | None = None
        #: Rounds run and requests served; read by tests and benchmarks.
        self.rounds = 0
        self.requests = 0

    # --- what a backend's writer provides ----------------------------------------------

    async def _serve(self, batch: list[Request]) -> None:
        """Run one round for ``batch``; every caller in it gets its outcome."""
        raise NotImplementedError

    async def _wind_up(self) -> None:
        """After the loop: let a round still in progress end (nothing by default)."""

    async def _close(self) -> None:
        """Close the write connection (the last thing the writer does)."""
        raise NotImplementedError

    def _drop(self) -> None:
        """Let go of the connection at once, without the event loop (see `abandon`)."""
        raise NotImplementedError

    # --- the shared part -----------------------------------------------------------------

    def start(self) -> None:
        """Start the writer task on the running loop."""
        self._task = _tasks.detached(self._run(), f"asyncplane-writer[{self._name}]")
        self._task.add_done_callback(self._supervise)

    def _supervise(self, task: asyncio.Task[None]) -> None:
        # The writer's failure reaches every caller (`_closed_error`, with the failure as its
        # cause); here it is logged once, and marked as seen so asyncio does not complain.
        if task.cancelled() or (failure := task.exception()) is None:
            return
        if self._connection_lost:  # each caller in the round has its StorageError
            _log.warning(
                "asyncplane writer %s stopped: its connection was lost (%s: %s); the "
                "store opens afresh on its next call",
                self._name, type(failure).__name__, failure,
            )  # fmt: skip
        else:
            _log.error("asyncplane writer %s stopped", self._name, exc_info=failure)

    def _broke(
        self,
        batch: Sequence[Request],
        exc: BaseException,
        *,
        unknown: bool = False,
        why: str = "the write connection was lost during COMMIT",
    ) -> None:
        """The write connection broke under a round: the writer is failed (so the store
        reopens on its next call, not after) before each caller still waiting hears of it,
        with a StorageError: `CommitOutcomeUnknown` when ``unknown`` (it broke while
        COMMIT was on its way, or ``why``, so the round may have been saved)."""
        self._failure = exc
        self._stopping = True
        error: _errors.StorageError = (
            _errors.CommitOutcomeUnknown(f"{why}, so the round may have been saved: {exc!r}")
            if unknown
            else _errors.StorageError(f"the store's write connection failed: {exc!r}")
        )
        error = caused(error, exc)
        for _, future in batch:
            if not future.done():
                future.set_exception(error)

    def abandon(self) -> None:
        """Drop the connection without the event loop, which has already ended."""
        self._stopping = True
        self._drop()

    @property
    def requests_waiting(self) -> int:
        """Requests queued for a later round (read by tests and benchmarks)."""
        return len(self._pending)

    @property
    def running(self) -> bool:
        """True while the writer accepts requests."""
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def failed(self) -> bool:
        """True when the writer stopped because it failed (not by stop())."""
        return self._failure is not None

    def submit(self, op: Any) -> Pending[Any]:
        """Queue one operation now: the future to await for its own result or error.

        The future itself, not a coroutine around it: every caller awaits through this,
        and each layer of coroutines is one more frame to resume per request."""
        return self._queue(op)

    def _queue(self, op: Any, *, stopping: bool = False) -> asyncio.Future[Any]:
        """`submit`, typed as the future it is (``stopping``: as `queue_now`)."""
        alive = self._task is not None and not self._task.done() and self._serving
        if not (self.running or (stopping and alive and self._failure is None)):
            raise self._closed_error()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((op, future))
        self._queued(loop)
        return future

    def queue_now(self, op: Any) -> asyncio.Future[Any]:
        """Queue ``op`` at once, even while the writer stops (it is served before the
        writer ends): for a write decided at a delivery, a give-back of claims whose
        caller went away. StoreClosed once the writer has ended."""
        return self._queue(op, stopping=True)

    def _queued(self, loop: asyncio.AbstractEventLoop) -> None:
        """A request was queued: wake the writer task (which takes it in its next round)."""
        self._wakeup.set()

    def _take_batch(self) -> list[Request]:
        """The next round's requests: those queued first, up to ``max_batch``, leaving out
        any whose caller gave up before it was written; an `Apart` one alone."""
        batch: list[Request] = []
        pending = self._pending
        while pending and len(batch) < self._max_batch:
            apart = isinstance(pending[0][0], Apart)
            if apart and batch and not pending[0][1].cancelled():
                break  # the next round's
            request = pending.popleft()
            if not request[1].cancelled():
                batch.append(request)
                if apart:
                    break
        return batch

    async def stop(self) -> None:
        """Serve every queued request, run ``on_exit``, close the connection; idempotent."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None and not self._task.done():
            # Wait for the writer without cancelling it: it finishes its queue and exits.
            # (asyncio.wait neither cancels the task nor raises what ended it.)
            await asyncio.wait([self._task])

    def _closed_error(self) -> _errors.AsyncplaneError:
        """Why a request is refused unserved: the writer's connection was lost (a
        StorageError, as its round's callers heard: nobody closed the store, and its next
        call opens it afresh), it stopped for another failure, or the store was closed
        (StoreClosed)."""
        if self._failure is not None and self._connection_lost:
            return caused(
                _errors.StorageError(
                    "the store's write connection was lost before this write was made "
                    f"(nothing of it was saved; the store opens afresh on its next call): "
                    f"{self._failure!r}"
                ),
                self._failure,
            )
        if self._failure is not None:
            err = _errors.StoreClosed(f"the store's writer stopped: {self._failure!r}")
            err.__cause__ = self._failure
            return err
        return _errors.StoreClosed("the store is closed")

    async def _serve_queue(self) -> None:
        """Serve rounds until stopped with nothing queued (the task's loop): each round
        takes what waits when the last one is done."""
        while True:
            if not self._pending:
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            if batch:
                await self._serve(batch)

    async def _run(self) -> None:
        graceful = False
        try:
            await self._serve_queue()
            graceful = True
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._serving = False  # from here nothing queued would be served: refuse it
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
            if graceful and self._failure is not None and not self._failed_idle:
                # A round broke after its callers had their answers, while the writer
                # was stopping (the connection's thread tells the loop before it closes,
                # so it is known by now): the task ends quietly, so it is said here.
                _log.error(
                    "asyncplane writer %s: a round broke as it stopped", self._name,
                    exc_info=self._failure,
                )  # fmt: skip
