"""The PostgreSQL writer task: this process's writes, group-committed on one connection.

The same contract as the SQLite writer (`asyncplane._writer`): callers hand it an
*operation*, here a coroutine function ``op(conn, now)``, and get back that operation's
own result or error; requests that wait while a transaction runs go together into the
next one (group commit), so under load many claims and finishes share one COMMIT.

Isolation inside a round. With more than one unit in a round each unit runs under a
savepoint: a refusal (an AsyncplaneError) or a database error rolls back to it, so what
the failed request wrote is undone and the others commit; so does a plain exception (a
bug in an operation), which its caller gets as it was raised. A round of one unit needs no
savepoint: the transaction is the unit.

A round of one unit whose operation is a `FirstAlone` (a round of finishes, or of claims
with one reach) runs first as that operation's one statement, outside any transaction:
PostgreSQL commits a lone statement by itself, so the round saves the BEGIN and COMMIT
round trips, and the state changes and their events still commit together. Its answers
are handed out at once; what the statement left (a refused finish, a claim of a reach
that is not plain) runs next in a transaction, as any round. A connection lost
with that statement on its way leaves the round's outcome unknown, as one lost during
COMMIT.

Locks a round will need (enqueue dedup's content locks) are taken at its start, for all
its requests at once and in sorted order, so two rounds never take them in opposite
orders. Deadlocks and serialisation failures that happen anyway (two hosts' rounds
waiting on each other's rows, which PostgreSQL breaks by failing one) are not any
request's fault: the round is rolled back and its requests run again, each in a
transaction of its own so the same interleaving cannot recur, a few times before a
caller sees the error.

"Now" is taken once per round, after BEGIN: from the database server's clock, so every
host agrees on when a lease lapses, or from an injected clock in tests. The server's
clock is read at most every couple of seconds; in between the store's `ServerClock`
carries the reading forward on this host's clock (a round trip saved per transaction, an
error of well under a millisecond).

Plans made again as the store grows. The write connection plans each statement once
(`plan_cache_mode = force_generic_plan`) and keeps the plan until something invalidates it
(an ANALYZE of the table, which autovacuum runs only after enough rows changed, and at
most once a minute or so). A plan made while `items` held a handful of rows chooses as
for a handful: a hash join over the whole table for a round's ids, a walk of every
claimed item for one renewal. So the writer looks at the table's size every
`plan_check_seconds` (one cheap statement before a round) and, once it has doubled since
the plans were made, drops its plans (`DISCARD PLANS`): each statement is planned again,
against the table's size now, when next run. Growing from 64 KiB to a terabyte, that is
some twenty-four times in all. The store's read connections, which plan as PostgreSQL
chooses (and keep a generic plan chosen on a tiny table just the same), are replaced
then too (``replanned``). A look that fails (a statement timeout, say) is skipped until
the next; a lost connection fails the round, as any statement's would.

Cancellation never decides what is saved: a round runs as a task of its own, shielded from
the writer task, and hands each caller its outcome itself; a caller cancelled during its
round gets nothing back, but the round commits or rolls back as a whole.

A connection lost while COMMIT is on its way leaves no answer: the round may have been
saved. Its callers get `CommitOutcomeUnknown`, as on SQLite when a failed commit cannot
be sealed; an error the server answers COMMIT with means nothing was saved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from asyncplane import _clock, _errors, _telemetry, _write_queue
from asyncplane import _postgres_sql as sql

__all__ = ("Locking", "Operation", "Write", "Writer", "translate")

T = TypeVar("T")

#: A write operation: runs inside the writer's transaction (a `Locking` one names the
#: content locks the round takes before it runs).
Operation = Callable[[asyncpg.Connection, float], Awaitable[T]]
#: What a backend submits: an operation, or a request the round may group with its like.
Write = Operation[T] | _write_queue.Grouped[T]

_Request = tuple[Write[Any], "asyncio.Future[Any]"]

#: An answer of `FirstAlone.alone`: this request is left to the round's transaction.
LEFT: Any = object()

#: The table's size, in bytes, below which its plans are never made again (a few pages).
_PLANNED_AT_LEAST = 64 * 1024

#: SQLSTATEs that mean "run it again": serialization_failure, deadlock_detected.
RETRYABLE = frozenset({"40001", "40P01"})
_ROUND_ATTEMPTS = 5


def translate(exc: BaseException) -> _errors.StorageError:
    """Map a driver error to asyncplane's family; the caller raises it ``from exc``."""
    if isinstance(exc, asyncio.TimeoutError):
        return _errors.StorageError(f"the database did not answer in time: {exc!r}")
    if isinstance(exc, asyncpg.exceptions.LockNotAvailableError):
        return _errors.DatabaseLocked(f"a lock could not be had: {exc}")
    if isinstance(exc, asyncpg.PostgresError):
        return _errors.StorageError(f"{type(exc).__name__} ({exc.sqlstate}): {exc}")
    return _errors.StorageError(f"{type(exc).__name__}: {exc}")


class Locking:
    """A write operation that needs content locks (pairs of project id and fingerprint),
    which the writer takes for its whole round at once, sorted."""

    __slots__ = ("lock_keys", "op")

    def __init__(self, lock_keys: tuple[tuple[str, str], ...], op: Operation[Any]) -> None:
        self.lock_keys = lock_keys
        self.op = op

    async def __call__(self, conn: asyncpg.Connection, now: float) -> Any:
        return await self.op(conn, now)


class FirstAlone:
    """A group's operation (``many``) with a form that runs without a transaction around
    it, for a round that is this one unit: ``statement(ops, now)`` gives one statement
    and its arguments (or None: none this time), which PostgreSQL commits by itself (two
    round trips fewer than BEGIN and COMMIT); ``answers(ops, now, rows)`` reads its rows
    into each op's answer, or `LEFT` for one it did not do; those run in a transaction
    next, through ``many``, as any round. The writer runs the statement itself, so it
    knows whether a failure came before it was sent, from the server, or after."""

    __slots__ = ("answers", "many", "statement")

    def __init__(
        self,
        many: Callable[[list[Any], asyncpg.Connection, float], Awaitable[list[Any]]],
        statement: Callable[[list[Any], float], tuple[str, tuple[Any, ...]] | None],
        answers: Callable[[list[Any], float, list[Any]], list[Any]],
    ) -> None:
        self.many = many
        self.statement = statement
        self.answers = answers

    async def __call__(self, ops: list[Any], conn: asyncpg.Connection, now: float) -> list[Any]:
        return await self.many(ops, conn, now)


class _Retry(Exception):
    """The round hit a deadlock or serialisation failure: run it again."""


class _Bug(Exception):
    """An operation raised ``error``, neither a refusal nor a database error: that
    operation's caller hears it, as on SQLite; the round's others go on."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _CommitLost(Exception):
    """The connection went (``error`` says how) while COMMIT was on its way."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class Writer(_write_queue.WriterBase):
    """PostgreSQL's rounds: one transaction per round on the write connection, each
    unit under a savepoint when it is not alone, deadlocks run again."""

    _conn: asyncpg.Connection

    def __init__(
        self, conn: asyncpg.Connection, clock: _clock.Clock | None, *, server_clock: Any = None,
        replanned: Callable[[], Awaitable[None]] | None = None,
        claim_reaches: ReachesHook | None = None, **queue: Any,
    ) -> None:  # fmt: skip
        super().__init__(conn, clock, **queue)
        self._server_clock = server_clock
        self._replanned = replanned
        self._claim_reaches = claim_reaches
        self._round_task: asyncio.Task[None] | None = None
        #: Rounds that met a deadlock or serialisation failure and ran again.
        self.retried_rounds = 0
        #: Rounds whose one statement committed by itself and answered some of their
        #: requests (`FirstAlone`).
        self.alone_rounds = 0
        #: How often, in seconds, the writer looks whether `items` has grown enough to
        #: plan its statements again (see the module's docstring).
        self.plan_check_seconds = 2.0
        #: Times the writer dropped its plans because the table had grown.
        self.replans = 0
        self._planned_size: int | None = None  # the table's size when the plans were made
        self._plans_checked = -float("inf")  # on time.monotonic()

    def start(self) -> None:
        """Start the writer task, watching its connection: a session the server ends (a
        restart, say) fails the writer at once, so the store opens afresh on its next
        call instead of failing that call on a dead connection."""
        self._conn.add_termination_listener(self._lost)
        super().start()

    def _lost(self, conn: object) -> None:
        if self._stopping:
            return  # closed by this writer itself
        self._failure = ConnectionError("the server ended the write connection's session")
        self._connection_lost = True  # what a request refused from here on hears
        # No round's failure (a round that met it says so to its callers): an idle session
        # ended, by a restart or idle_session_timeout, is the reopening's to say.
        self._failed_idle = self._round_task is None
        self._stopping = True
        self._wakeup.set()

    def _drop(self) -> None:
        self._conn.terminate()

    async def _serve(self, batch: list[_Request]) -> None:
        # The round is a task of its own: cancelling the writer (the loop shutting down)
        # never stops a transaction half-way.
        self._round_task = asyncio.get_running_loop().create_task(
            self._round(batch), name=f"asyncplane-write-round[{self._name}]"
        )
        await asyncio.shield(self._round_task)
        self._round_task = None

    async def _wind_up(self) -> None:
        if self._round_task is not None:
            # Cancelled while a round ran: it ends (and delivers) before the connection
            # closes, never half-way through.
            await asyncio.wait([self._round_task])
            if not self._round_task.cancelled():
                self._round_task.exception()  # seen here; its callers have it

    async def _close(self) -> None:
        await _close(self._conn)

    async def _round(self, batch: list[_Request]) -> None:
        """Run one transaction for ``batch`` and hand each caller its outcome; a round of
        one `FirstAlone` unit runs its statement alone first, and only what that left
        runs in the transaction."""
        self.rounds += 1
        self.requests += len(batch)
        started = time.perf_counter()
        size = len(batch)
        group = _alone_group(batch)
        ops = [op for op, _ in batch]
        try:
            try:
                if time.monotonic() - self._plans_checked >= self.plan_check_seconds:
                    await self._check_plans()
                if group is not None:
                    # What the statement answered is handed out here; the rest goes on.
                    batch = await self._first_alone(batch, group)
                    ops = [op for op, _ in batch]
                outcomes = await self._transact(ops) if ops else []
            except _Retry:
                # A deadlock or serialisation failure: each request again, on its own, in
                # the order the round ran them (finishes ahead of their claims), each
                # answered once committed: a connection lost later fails only the rest.
                self.retried_rounds += 1
                await self._each_alone(batch, ops)
                _telemetry.write_round("postgresql", size, time.perf_counter() - started)
                return
        except asyncio.CancelledError:
            raise
        except _CommitLost as lost:
            self._connection_lost = self._conn.is_closed()
            self._broke(batch, lost.error, unknown=True)
            raise lost.error from None
        except Exception as exc:
            if self._conn.is_closed():  # the connection broke: the writer stops
                self._connection_lost = True
                self._broke(batch, exc)
                raise
            # Outside any operation (the clock, say): this round fails, the writer goes
            # on. The transaction was rolled back on the way out.
            outcomes = [_write_queue.Raised(_write_queue.round_failed(exc))] * len(ops)
        except BaseException as exc:
            self._broke(batch, exc)
            raise
        # Measured before the callers wake, so a caller's next look sees its round.
        _telemetry.write_round("postgresql", size, time.perf_counter() - started)
        _write_queue.deliver(batch, outcomes, self.orphaned)

    async def _each_alone(self, batch: list[_Request], ops: list[Write[Any]]) -> None:
        """Run each request of a round that deadlocked in a transaction of its own, and
        hand its caller the outcome as soon as it has committed. A COMMIT lost on the
        way makes that one request's outcome unknown; those not run yet were not saved."""
        for unit in _write_queue.units(ops, range(len(ops))):
            for index in unit:
                try:
                    (outcome,) = await self._alone(ops[index])
                except _CommitLost as lost:
                    self._connection_lost = self._conn.is_closed()
                    self._broke([batch[index]], lost.error, unknown=True)
                    raise lost.error from None
                _write_queue.deliver([batch[index]], [outcome], self.orphaned)

    async def _check_plans(self) -> None:
        """Drop the connection's plans once `items` has doubled since they were made (and
        have the read connections replaced)."""
        self._plans_checked = time.monotonic()
        try:
            size: int = await self._conn.fetchval(sql.ITEMS_SIZE)
            if self._planned_size is None:
                self._planned_size = size  # the first plans are being made about now
                return
            if size < max(2 * self._planned_size, _PLANNED_AT_LEAST):
                return
            await self._conn.execute(sql.DISCARD_PLANS)
        except asyncpg.PostgresConnectionError:
            raise
        except asyncpg.PostgresError:
            return  # the round goes on with the plans it has; the next look is soon
        self._planned_size = size
        self.replans += 1
        if self._replanned is not None:
            await self._replanned()

    async def _alone(self, op: Write[Any]) -> list[Any]:
        """Run one request in transactions of its own until it stops deadlocking."""
        for attempt in range(_ROUND_ATTEMPTS):
            try:
                return await self._transact([op])
            except _Retry as retry:
                if attempt == _ROUND_ATTEMPTS - 1:
                    cause = retry.__cause__ or retry
                    return [_write_queue.Raised(_translated(cause))]
                await asyncio.sleep(0.001 * 2**attempt)  # let the other side commit
        raise AssertionError("unreachable")  # pragma: no cover

    async def _now(self) -> float:
        if self._clock is not None:
            return self._clock.now()
        server = self._server_clock
        if server is not None and server.fresh:
            now: float = server.now()  # read within the last two seconds: no round trip
            return now
        value: float = await self._conn.fetchval(sql.SERVER_NOW)
        if server is not None:
            server.observe(value)
        return value

    async def _transact(self, ops: list[Write[Any]]) -> list[Any]:
        """One transaction for all ops, each unit isolated by a savepoint when not alone."""
        conn = self._conn
        units = _write_queue.units(ops, range(len(ops)))
        alone = len(units) == 1 and len(units[0]) == 1
        transaction = conn.transaction()
        await transaction.start()
        try:
            now = await self._now()
            keys = sorted({key for op in ops for key in _lock_keys(op)})
            if keys:
                await conn.execute(
                    sql.LOCK_CONTENTS, [key[0] for key in keys], [key[1] for key in keys],
                    len(keys) > sql.CONTENTS_LOCKED_ONE_BY_ONE,
                )  # fmt: skip
            # A round claiming for several reaches takes their limit locks all at once,
            # as its first claim runs (`Writer(claim_reaches=)`): not before the units
            # ahead of it (a finish takes row and content locks first, as it does in a
            # round of one reach, whose claim takes its limits after them).
            reaches = {_reach(op) for op in ops if _is_claim(op)}
            lock_reaches = len(reaches) > 1 and self._claim_reaches is not None
            if alone:  # the transaction is the unit: its failure is the round's
                outcomes = await _run_unit(ops, units[0], conn, now)
            else:
                outcomes = [None] * len(ops)
                for unit in units:
                    if lock_reaches and _is_claim(ops[unit[0]]):
                        lock_reaches = False
                        assert self._claim_reaches is not None
                        await self._claim_reaches(reaches, conn)
                    results = await _isolated(ops, unit, conn, now)
                    for index, outcome in zip(unit, results, strict=True):
                        outcomes[index] = outcome
        # A connection lost under the round: what lost it is raised (the writer stops).
        except _errors.AsyncplaneError as exc:
            if not await _roll_back(transaction, conn):
                raise
            return [_write_queue.Raised(exc)] * len(ops)
        except asyncpg.PostgresError as exc:
            if not await _roll_back(transaction, conn):
                raise
            if exc.sqlstate in RETRYABLE:
                raise _Retry() from exc
            return [_write_queue.Raised(_translated(exc))] * len(ops)
        except _Bug as bug:  # in the one operation of the round: its caller hears it
            if not await _roll_back(transaction, conn):
                raise
            return [_write_queue.Raised(bug.error)]
        except BaseException:
            await _roll_back(transaction, conn)
            raise
        try:
            await transaction.commit()
        except asyncpg.PostgresError as exc:
            if exc.sqlstate in RETRYABLE:
                raise _Retry() from exc
            if isinstance(exc, asyncpg.PostgresConnectionError):
                # No answer came back: COMMIT may have reached the server and been applied.
                raise _CommitLost(exc) from exc
            error = _translated(exc)
            return [_write_queue.Raised(error)] * len(ops)
        return outcomes

    async def _first_alone(self, batch: list[_Request], group: FirstAlone) -> list[_Request]:
        """Run the round's one statement alone and hand out what it answered, before the
        rest runs (so no later failure of the rest can reach a request already saved);
        return the requests it left.

        A server's error answer means nothing was saved: every request goes on to the
        transaction, which runs them again if need be and finds the one a fault belongs to
        (under savepoints). No answer at all (the connection lost) may mean the statement
        was applied: the round's outcome is unknown."""
        now = await self._now()
        members = [op.op for op, _ in batch if isinstance(op, _write_queue.Grouped)]
        try:
            planned = group.statement(members, now)
        except Exception:
            return batch  # nothing sent: the transaction finds whose error it is
        if planned is None:
            return batch
        statement, args = planned
        try:
            rows = list(await self._conn.fetch(statement, *args))
        except asyncpg.PostgresError as exc:
            if isinstance(exc, asyncpg.PostgresConnectionError) or self._conn.is_closed():
                raise _CommitLost(exc) from exc
            return batch  # nothing saved: the transaction finds whose error it is
        except Exception as exc:  # on its way, or its answer unread: it may be saved
            raise _CommitLost(exc) from exc
        try:
            answers = group.answers(members, now, rows)
        except Exception as exc:  # saved, but what it saved cannot be told
            raise _CommitLost(exc) from exc
        done = [(request, answer) for request, answer in zip(batch, answers, strict=True)
                if answer is not LEFT]  # fmt: skip
        if done:
            self.alone_rounds += 1
            _write_queue.deliver(
                [request for request, _ in done],
                _write_queue.outcomes([answer for _, answer in done], True),
                self.orphaned,
            )
        return [request for request, answer in zip(batch, answers, strict=True) if answer is LEFT]


async def _roll_back(transaction: Any, conn: asyncpg.Connection) -> bool:
    """Roll a round's transaction back; False if the connection is lost. Then there is
    nothing to roll back (the server has): the error that lost it is the one to tell,
    not the rollback's own ("the underlying connection is closed")."""
    if conn.is_closed():
        return False
    try:
        await transaction.rollback()
    except (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, OSError):
        if not conn.is_closed():
            raise
        return False
    return True


def _alone_group(batch: list[_Request]) -> FirstAlone | None:
    """The `FirstAlone` of a round that is one unit of it, if it is."""
    first = batch[0][0]
    if not isinstance(first, _write_queue.Grouped) or not isinstance(first.many, FirstAlone):
        return None
    ops = [op for op, _ in batch]
    if len(_write_queue.units(ops, range(len(ops)))) != 1:
        return None
    return first.many


async def _isolated(
    ops: list[Write[Any]], unit: list[int], conn: asyncpg.Connection, now: float
) -> list[Any]:
    """Run a unit under a savepoint; if it breaks, its members one by one, so a failure
    belongs to the one request that caused it. Deadlocks go up: the round runs again."""
    try:
        savepoint = conn.transaction()
        await savepoint.start()
        try:
            outcomes = await _run_unit(ops, unit, conn, now)
        except BaseException:
            await _roll_back(savepoint, conn)  # none on a lost connection: see below
            raise
        await savepoint.commit()
        return outcomes
    except (_errors.AsyncplaneError, asyncpg.PostgresError, _Bug) as exc:
        if conn.is_closed():  # the connection was lost: what lost it goes up, the round's
            raise
        if isinstance(exc, asyncpg.PostgresError) and exc.sqlstate in RETRYABLE:
            raise _Retry() from exc
        if len(unit) == 1:
            if isinstance(exc, _Bug):
                return [_write_queue.Raised(exc.error)]
            return [
                _write_queue.Raised(
                    exc if isinstance(exc, _errors.AsyncplaneError) else _translated(exc)
                )
            ]
    results: list[Any] = []
    for index in unit:
        results.extend(await _isolated(ops, [index], conn, now))
    return results


def _translated(exc: BaseException) -> _errors.StorageError:
    return _write_queue.caused(translate(exc), exc)


#: ``hook(reaches, conn)``: what a round whose claims have several reaches, ``(project_id,
#: actor_id)`` each, does first (the backend's: `asyncplane._postgres._lock_claim_reaches`).
ReachesHook = Callable[[set[tuple[str | None, str | None]], asyncpg.Connection], Awaitable[None]]


def _is_claim(op: Write[Any]) -> bool:
    return isinstance(op, _write_queue.Grouped) and op.group_key[0] == "claim"


def _reach(op: Write[Any]) -> tuple[str | None, str | None]:
    claim = op.op  # type: ignore[union-attr]  # (a claim: `_is_claim`)
    return claim.project_id, claim.actor_id


def _lock_keys(op: Write[Any]) -> tuple[tuple[str, str], ...]:
    """The content locks a round's request needs: a `Locking` operation's, also when a
    `asyncplane._write_queue.Named` names what it writes (an enqueue)."""
    write = op.write if isinstance(op, _write_queue.Named) else op
    return write.lock_keys if isinstance(write, Locking) else ()


async def _run_unit(
    ops: list[Write[Any]], unit: list[int], conn: asyncpg.Connection, now: float
) -> list[Any]:
    """The outcomes of one unit: each a value, or a Raised refusal that wrote nothing."""
    try:
        result, grouped = _write_queue.call_unit(ops, unit, conn, now)
        return _write_queue.outcomes(await result, grouped)
    except (_errors.AsyncplaneError, asyncpg.PostgresError):
        raise
    except Exception as exc:
        if conn.is_closed():  # the connection broke under it: the round's, not a bug
            raise
        raise _Bug(exc) from exc


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await conn.close(timeout=10)
    except Exception:  # a broken connection: drop it
        conn.terminate()
