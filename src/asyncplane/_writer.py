"""The writer: every write of a store goes through it, one transaction at a time.

A store has exactly one write connection and one writer that owns it (its request queue
is `asyncplane._write_queue`, shared with the PostgreSQL writer). Callers hand the writer
an *operation*: a plain function ``op(db, now)`` that runs on the connection's thread
inside a transaction the writer opened with ``BEGIN IMMEDIATE``.

Rounds follow each other without waking a task. The first request queued while the
connection's thread is free schedules the round (``call_soon``: after the callbacks
already due, so requests made in the same turn of the loop share it); the round goes to
the thread on aiosqlite's own queue (`asyncplane._connection.post`); and its delivery, on
the loop, schedules the next round if requests queued up meanwhile (after the callers it
answered, so that what they ask at once joins it). So a round wakes the loop once, to
deliver, and the writer task not at all: the task only waits for the store to stop, lets
what is queued be served, and closes the connection last.

The writers' queue. Before ``BEGIN IMMEDIATE`` a round takes its place in the queue every
process's writers share (`asyncplane._write_lock`), and it lets go after its COMMIT or
ROLLBACK, so writers take turns instead of sleeping in SQLite's busy handler. The event
loop keeps busy_timeout: a round whose turn has not come in time is given up (`Turn`),
its callers and the writes queued behind it told DatabaseLocked, nothing written.

Combining across processes (`asyncplane._combine`, Linux). A round of claims and finishes
that finds the lock taken is posted on the board beside the database instead, and the
holder of the lock serves it in its own transaction; every round this writer runs takes
in what other processes posted, and answers them before its COMMIT (`_transact_held`).
The event loop tries the lock and posts (`Writer._post_on_loop`, neither waits) and
sleeps on the slot's wake pipe until a holder answers, so a round served elsewhere never
goes to the connection's thread; a round the loop finds the lock free for goes there
with the lock held, and one unserved for long goes there to queue for the lock
(`_transact_posted`, from where the loop left it: `Posting`).

Group commit. While one transaction is on the connection's thread, new requests queue up;
the next round takes all of them (up to ``max_batch``) into one transaction, so under load
many claims and finishes share one BEGIN/COMMIT. Each request still succeeds or fails on
its own:

* An operation that refuses (raises an AsyncplaneError such as FenceRejected) must have
  written nothing; the writer checks ``total_changes`` to be sure, and the others commit.
* An operation that fails inside the database (sqlite3.Error), or refuses after writing,
  rolls the whole transaction back; that request gets its error and the rest are run
  again in a fresh transaction without it.
* A failure to begin or to commit fails every request of that round with the same
  translated error: none of them was saved. A failed COMMIT is sealed at once (see
  `_seal`), so a crash cannot bring it back from the WAL; if even that fails, the
  requests get `CommitOutcomeUnknown`: the round may yet turn out saved.

``now`` is read from the clock after ``BEGIN IMMEDIATE`` has the write lock, so a lease is
measured from when it was granted, not from when it was asked for.

Outcomes travel straight from the connection's thread to the callers: the round ends by
scheduling its own delivery on the event loop (``call_soon_threadsafe``), so a caller
wakes as soon as its transaction has committed, and learns what was saved even if the
writer task is cancelled while the round runs.

Cancellation never decides what is saved. A caller cancelled before its round starts is
dropped without writing; a caller cancelled during its round gets nothing back, but the
round commits or rolls back as a whole (what a claim took that way is given back at
once: `asyncplane._write_queue.deliver`'s ``orphaned``). A round
once handed to the thread cannot be interrupted: if the writer task is cancelled (event
loop shutdown), the round still runs to its end and delivers, the requests still queued
are refused with StoreClosed, and the connection closes after the round, never during it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import aiosqlite

from asyncplane import (
    _clock,
    _combine,
    _connection,
    _errors,
    _tasks,
    _telemetry,
    _write_lock,
    _write_queue,
)
from asyncplane import _sqlite_sql as sql
from asyncplane._clock import Clock
from asyncplane._record import Record

__all__ = ("Operation", "Write", "Writer")

T = TypeVar("T")

#: A write operation: runs on the connection's thread inside the writer's transaction.
Operation = Callable[[sqlite3.Connection, float], T]
#: What a backend submits: an operation, or a request the round may group with its like.
Write = Operation[T] | _write_queue.Grouped[T]

_Request = tuple[Write[Any], "asyncio.Future[Any]"]


class Writer(_write_queue.WriterBase):
    """SQLite's rounds: ``BEGIN IMMEDIATE`` on the write connection's thread, each
    request isolated by ``total_changes``, one COMMIT, outcomes handed over from there."""

    _conn: aiosqlite.Connection
    _clock: _clock.Clock
    #: Requests in the round now on the thread; read by tests and benchmarks.
    in_flight = 0
    #: Seconds spent waiting for the database's write lock (BEGIN IMMEDIATE): the longest
    #: single wait, and the sum over rounds; the probe reports the longest.
    max_lock_wait = 0.0
    total_lock_wait = 0.0
    #: Seconds this writer held the write lock (from having it to letting go), summed.
    total_lock_held = 0.0

    def __init__(
        self,
        conn: aiosqlite.Connection,
        clock: Clock,
        *,
        write_lock: _write_lock.WriteLock | None,
        lock_timeout: float,
        board: _combine.Board | None = None,
        **options: Any,
    ) -> None:
        super().__init__(conn, clock, **options)
        #: The queue in front of the write lock (None: SQLite's busy handler alone).
        self.write_lock = write_lock
        #: This process's slot for combining rounds across processes (None: no combining).
        self.board = board
        self.lock_timeout = lock_timeout
        #: Set while the write lock moves; clear while a round waits for its turn past
        #: busy_timeout (given up, its thread still waiting).
        self._moving = asyncio.Event()
        self._moving.set()
        #: `_give_up` asked again (its post was at a holder's hands); cancelled with the round.
        self._again: asyncio.TimerHandle | None = None
        #: The round on the connection's thread now, or posted and waited for on the
        #: loop (None: neither), its busy_timeout timer (None: no lock to wait for, or
        #: the lock taken at once), and whether a `_dispatch` is scheduled.
        self._on_thread: list[_Request] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._dispatch_due = False
        #: The round posted on the board and waited for on the loop (`_post_on_loop`),
        #: and when it looks at the lock again unwoken.
        self._posted: _OnLoop | None = None
        self._look_again: asyncio.TimerHandle | None = None
        self._reading: asyncio.AbstractEventLoop | None = None  # the loop reading the pipe
        #: A broken post being taken back (`_posted_broke`): its next try, and the same try
        #: made at once, as the writer closes.
        self._taking_back: tuple[asyncio.TimerHandle, Callable[[], None]] | None = None

    def submit(self, op: Any) -> _write_queue.Pending[Any]:
        """Queue one operation: what to await for its result (its future, queued now).
        While a round given up for the lock still waits for it, a write first waits for
        the lock to move, at most busy_timeout, and is then refused with DatabaseLocked,
        nothing written: that is a coroutine, which queues the write when awaited."""
        if not self._moving.is_set() and self.running:
            return self._submit_once_moving(op)
        return super().submit(op)

    async def _submit_once_moving(self, op: Any) -> Any:
        """`submit` once the write lock has moved (DatabaseLocked if not in busy_timeout)."""
        try:
            await _tasks.within(self._moving.wait(), self.lock_timeout, "asyncplane-lock-moves")
        except asyncio.TimeoutError:
            if not self.running:  # closed meanwhile: that is the news
                raise self._closed_error() from None
            raise _errors.DatabaseLocked(self._stuck_message()) from None
        future = self._queue(op)
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled with the answer already in: as a cancel during the round would.
            if _write_queue.has_answer(future):
                _write_queue.tell(self.orphaned, op, future.result())
            raise

    def _stuck_message(self) -> str:
        return (
            f"database is locked: the store's write lock has not come free in busy_timeout "
            f"({self.lock_timeout:g} s)"
        )

    def _give_up(self, turn: _write_lock.Turn, batch: list[_Request]) -> None:
        """busy_timeout has passed and the round's turn has not come: its callers, and
        every write queued behind it, hear DatabaseLocked; nothing of theirs is written
        (the thread lets the lock go unused when it comes)."""
        stopped = turn.give_up()
        if stopped is None:  # its post was at a holder's hands this instant: look again
            loop = asyncio.get_running_loop()
            self._again = loop.call_later(_combine.RECHECK, self._give_up, turn, batch)
            return
        if not stopped:
            return  # the round has begun meanwhile: it runs to its end
        waiting = [future for _, future in batch]
        ended = self._posted is not None and self._posted.batch is batch
        if ended:
            self._round_over()  # taken back from the board: nothing of it waits any more
        else:
            self._moving.clear()  # the thread still waits for the lock, to let it go unused
        for future in waiting:
            if not future.done():
                future.set_exception(_errors.DatabaseLocked(self._stuck_message()))
        self.refuse_queued()
        if ended:
            self._next(asyncio.get_running_loop())  # a stop waiting for the queue hears it

    def refuse_queued(self) -> None:
        """Refuse, with DatabaseLocked, every write queued behind a round given up (its
        turn in the writers' queue never came): each would wait as long again, for a
        queue that has shown it does not move."""
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(_errors.DatabaseLocked(self._stuck_message()))

    def _drop(self) -> None:
        self._conn.stop()  # the connection's thread ends; no loop is left to close it
        if self.write_lock is not None:
            self.write_lock.close()
        # The board stays open: the thread may still be serving a round through it.

    async def _close(self) -> None:
        posting = self._posted
        if posting is not None:  # the writer stops with a post out: the thread sees it
            self._stop_looking()  # to its end (served, or run here), before it closes,
            looks = max(posting.looks, _LOOKS_BEFORE_QUEUEING)  # queueing for the lock at once
            start = Posting(posting.asked, posted=True, locked=False, looks=looks)
            self._to_thread(asyncio.get_running_loop(), posting.batch, posting.turn, start)
        try:
            await self._conn.close()
        finally:
            if self._taking_back is not None:  # a broken post still being taken back (its
                handle, now = self._taking_back  # hand-off above failing, say): its tries
                handle.cancel()  # made at once, while the board is open to make them
                now()
            if self.write_lock is not None:
                self.write_lock.close()
            if self.board is not None:
                if self._reading is not None and not self._reading.is_closed():
                    self._reading.remove_reader(self.board.wake_fd)
                self.board.close()

    # --- rounds, driven by callbacks -----------------------------------------------------
    #
    # No task wakes up per round: the first request queued while the thread is free
    # schedules `_dispatch` (call_soon: after the callbacks already due, so that requests
    # made in the same turn of the loop share the round), and a round's delivery, on the
    # loop, schedules the next round the same way if requests queued up meanwhile. The
    # writer task only waits for the end (`_serve_queue`) and then closes.

    def _queued(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._on_thread is None:
            self._schedule_dispatch(loop)

    def _schedule_dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """`_dispatch` after the callbacks already due, once however often it is asked."""
        if not self._dispatch_due:
            self._dispatch_due = True
            loop.call_soon(self._dispatch)

    async def _serve_queue(self) -> None:
        while True:
            if self._failure is not None:  # a round broke: the task ends with it
                raise self._failure
            if self._stopping and self._on_thread is None and not self._pending:
                return
            self._wakeup.clear()
            await self._wakeup.wait()

    def _dispatch(self) -> None:
        """Start a round for the requests queued, unless one is on the thread already."""
        self._dispatch_due = False
        if self._on_thread is not None or self._failure is not None:
            return
        batch = self._take_batch()
        if not batch:  # every caller gave up meanwhile
            if self._stopping:
                self._wakeup.set()  # the stop waits for the queue to empty
            return
        loop = asyncio.get_running_loop()
        self._on_thread = batch
        self.in_flight = len(batch)
        self.rounds += 1
        self.requests += len(batch)
        turn = None
        if self.write_lock is not None:
            if self.board is not None and self.board.wake_fd >= 0:
                ops = [op for op, _ in batch]
                if self.board.postable(ops) and self._post_on_loop(loop, batch, ops):
                    return
            turn = self._waits_for_lock(loop, batch)
        self._to_thread(loop, batch, turn, None)

    def _waits_for_lock(
        self, loop: asyncio.AbstractEventLoop, batch: list[_Request]
    ) -> _write_lock.Turn:
        """The round's wait for the lock, given up once busy_timeout has passed."""
        turn = _write_lock.Turn()
        self._timer = loop.call_later(self.lock_timeout, self._give_up, turn, batch)
        return turn

    def _to_thread(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Request],
        turn: _write_lock.Turn | None,
        posting: Posting | None,
    ) -> None:
        """Hand the round to the connection's thread (``posting``: as far as the loop got
        with it on the board)."""
        try:
            # The round hands its outcomes to the callers itself (call_soon_threadsafe):
            # they arrive even if the writer task is cancelled while the round runs.
            _connection.post(
                self._conn, _execute_round, batch, self._clock, loop, self, turn, posting
            )
        except BaseException as exc:  # the connection is closed: the round never began
            try:
                if posting is not None and posting.posted:
                    assert turn is not None
                    # Taken back before the lock goes (without the slot's lock, if the
                    # loop holds the writers' lock: no holder can take the post).
                    self._posted_broke(batch, turn, exc, held=posting.locked)
                else:
                    self._round_broke(batch, exc)
            finally:
                if posting is not None and posting.locked:
                    assert self.write_lock is not None
                    self.write_lock.release()

    # --- a round posted from the loop ----------------------------------------------------
    #
    # What `_transact_posted` does on the thread for a round of claims and finishes, the
    # loop does first, without waiting: try the lock, post, try again (a holder that let
    # go before the post never saw it), then sleep on the slot's wake pipe, or until
    # RECHECK, and look again. Served, the answers are collected here and delivered; the
    # lock found free, the thread runs the round with it held (collecting the answers if
    # a holder served the post and died); unserved for _LOOKS_BEFORE_QUEUEING looks, or
    # with the queue gone, the thread takes over where the loop left off.

    def _post_on_loop(
        self, loop: asyncio.AbstractEventLoop, batch: list[_Request], ops: list[Any]
    ) -> bool:
        """Start ``batch`` on the board (or on the thread, the lock had or the post
        refused); False, the queue gone, to hand it to the thread as any round."""
        lock, board = self.write_lock, self.board
        assert lock is not None and board is not None
        asked = time.perf_counter()
        got = lock.try_acquire()
        if got is None:  # no queue any more: the thread's round, as any other
            return False
        if got:  # the lock is this round's: it begins at once, nothing to give up
            self._to_thread(loop, batch, None, Posting(asked, posted=False, locked=True))
            return True
        turn = self._waits_for_lock(loop, batch)
        try:
            posted = turn.post(lambda: board.post(ops), board.retract)
            if not posted:  # too big for a slot, or a full disk: it waits for its own turn
                self._to_thread(loop, batch, turn, None)
                return True
            got = lock.try_acquire()
            if got is not False:
                start = Posting(asked, posted=True, locked=bool(got))
                self._to_thread(loop, batch, turn, start)
                return True
            if self._reading is None:
                loop.add_reader(board.wake_fd, self._woken)
                self._reading = loop
        except Exception as exc:  # a bug: its callers hear it, the post taken back first
            self._posted_broke(batch, turn, exc)
            return True
        self._posted = _OnLoop(batch, ops, turn, asked)
        self._look_again = loop.call_later(_combine.RECHECK, self._look)
        return True

    def _woken(self) -> None:
        """The wake pipe is readable: a holder moved this slot's signal."""
        assert self.board is not None
        self.board.woken()
        self._look()

    def _look(self) -> None:
        """Look at the posted round: answered, collect it; else try the lock again. If
        looking breaks (a bug), the round's callers hear it, as from a broken round."""
        posting = self._posted
        if posting is None:
            return  # a wake meant for the thread's wait, or one already seen to
        try:
            self._look_at(posting)
        except Exception as exc:
            if self._posted is posting:  # still waited for here: no one else will answer
                self._stop_looking()
                self._posted_broke(posting.batch, posting.turn, exc)

    def _look_at(self, posting: _OnLoop) -> None:
        lock, board = self.write_lock, self.board
        assert lock is not None and board is not None
        loop = asyncio.get_running_loop()
        self._cancel_look_again()
        state = board.state()
        if state == _combine.ANSWERED:
            posting.turn.begin()  # served: busy_timeout can no longer give it up
            answers = None
            if not board.spilled():  # megabytes in a file are read on the thread, not here
                try:
                    answers = board.collect(posting.ops, _never, wait=False)
                except BlockingIOError:
                    posting.busy += 1
                    if posting.busy <= _LOOKS_BEFORE_QUEUEING:
                        self._look_again = loop.call_later(_BUSY_SLOT, self._look)
                        return  # a holder is at the slot's lock this instant: look again
            if answers is None:
                # Spilled, or the slot's lock busy this long (held, or failing as a lock
                # that cannot be had would): the thread waits for it, or hears why not.
                self._posted = None
                start = Posting(posting.asked, posted=True, locked=False, looks=posting.looks)
                self._to_thread(loop, posting.batch, posting.turn, start)
                return
            self._posted = None
            took = time.perf_counter() - posting.asked
            _deliver(loop, self, posting.batch, answers, took, 0.0, took)
            return
        posting.looks += 1
        # Not posted any more, which only this process does (giving it up ended the round
        # already): the thread's wait goes on from an empty slot, as before posting.
        posted = state != _combine.EMPTY
        got = lock.try_acquire() if posted and posting.looks <= _LOOKS_BEFORE_QUEUEING else None
        if got is False:
            self._look_again = loop.call_later(_combine.RECHECK, self._look)
            return
        # The lock is free (a holder gone, or one that let go unseen), or it has been
        # unserved too long, or the queue is gone: the thread goes on from here.
        self._posted = None
        start = Posting(posting.asked, posted=posted, locked=bool(got), looks=posting.looks)
        self._to_thread(loop, posting.batch, posting.turn, start)

    def _stop_looking(self) -> None:
        """No round is waited for on the loop any more."""
        self._posted = None
        self._cancel_look_again()

    def _cancel_look_again(self) -> None:
        if self._look_again is not None:
            self._look_again.cancel()
            self._look_again = None

    def _round_over(self) -> None:
        """The connection's thread is back from the round, or the board's answers are in
        (on the event loop)."""
        self._on_thread = None
        self._stop_looking()
        self.in_flight = 0
        self._cancel_timers()
        self._moving.set()  # the thread is back: the lock moves again

    def _cancel_timers(self) -> None:
        """The round's busy_timeout timer, and its give-up asked again, cancelled."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._again is not None:
            self._again.cancel()
            self._again = None

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a round: the next one for what queued up meanwhile, or tell a stop
        waiting for the queue to empty. The next round is scheduled, not started here,
        so that the callers just answered, whose callbacks come first, can join it."""
        if self._pending and self._failure is None:
            self._schedule_dispatch(loop)
        elif self._stopping:
            self._wakeup.set()

    def _round_broke(
        self, batch: list[_Request], exc: BaseException, unknown: str | None = None
    ) -> None:
        """On the event loop: the round itself broke (the connection closed, a bug): its
        callers still waiting hear it, and the writer stops, failed, and says so.
        ``unknown``: why the round may have been saved (they hear CommitOutcomeUnknown)."""
        if self._on_thread is batch:  # not already ended by its delivery
            self._round_over()
        if unknown is None:
            self._broke(batch, exc)
        else:  # it may have been saved, for this reason
            self._broke(batch, exc, unknown=True, why=unknown)
        self._wakeup.set()  # the task ends with it (or says it, if it was stopping)

    def _posted_broke(
        self,
        batch: list[_Request],
        turn: _write_lock.Turn,
        exc: BaseException,
        tries: int = 1,
        *,
        wait: bool = True,
        held: bool = False,
    ) -> None:
        """A round on the board that this process can no longer see to its end (looking at
        it broke, or the thread could not take it over): the post is taken back, so that
        nothing of it is written and its callers hear ``exc``; unless a holder elsewhere
        has taken it (or the slot could not be looked at), when they hear that the round
        may have been saved (`CommitOutcomeUnknown`). A holder at the slot's lock this
        instant (a process descheduled there, say) is given time: the loop asks again a
        moment later (`_BUSY_SLOT`), `_GIVE_UP_TRIES` times in all, the round still on;
        not ``wait``ing (the writer closing), it asks again at once. Where the loop
        ``held`` the writers' lock for the round (to let go right after), no holder can
        take the post meanwhile: still unserved, it is taken back without the slot's lock
        (`Board.withdraw_unserved`), and one taken is a holder's to answer."""
        self._taking_back = None
        try:
            stopped = turn.give_up()  # None: a holder at the slot's lock this instant
            if stopped is None and held:
                assert self.board is not None  # a post was out
                # True or False, never None: no later try (none would hold the lock).
                stopped = turn.give_up(self.board.withdraw_unserved)
            while stopped is None and not wait and tries < _GIVE_UP_TRIES:
                tries += 1
                stopped = turn.give_up()
        except Exception:  # the slot itself cannot be read: what happened is not known
            stopped, tries = None, _GIVE_UP_TRIES
        if stopped is None and tries < _GIVE_UP_TRIES:
            if self._on_thread is batch:  # its end is decided here: busy_timeout is moot
                self._cancel_timers()
            again = functools.partial(self._posted_broke, batch, turn, exc, tries + 1)
            handle = asyncio.get_running_loop().call_later(_BUSY_SLOT, again)
            self._taking_back = (handle, functools.partial(again, wait=False))
            return
        if stopped:
            self._round_broke(batch, exc)
        elif stopped is None:
            self._round_broke(batch, exc, "the round's post on the board could not be taken back")
        else:
            why = "another process's holder had taken or answered the round posted for it"
            self._round_broke(batch, exc, why)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    writer: Writer,
    batch: list[_Request],
    outcomes: list[Any],
    lock_wait: float,
    held: float,
    took: float,
) -> None:
    """On the event loop: hand each caller its own outcome (the round measured before any
    caller runs, so a caller's next look sees its round), then see to the next round
    whatever happens."""
    writer._round_over()
    writer.total_lock_wait += lock_wait
    writer.total_lock_held += held
    writer.max_lock_wait = max(writer.max_lock_wait, lock_wait)
    try:
        _write_queue.deliver(batch, outcomes, writer.orphaned)  # schedules the callers...
        _telemetry.write_round("sqlite", len(batch), took)  # ...none runs before it is counted
        _telemetry.lock_wait(lock_wait)
    except BaseException as exc:  # a bug: no caller of the round may be left waiting
        error = _errors.StorageError(f"the round's outcomes could not be handed over: {exc!r}")
        for _, future in batch:
            if not future.done():
                future.set_exception(_write_queue.caused(error, exc))
        raise
    finally:
        writer._next(loop)


def _translated(exc: sqlite3.Error) -> _errors.StorageError:
    return _write_queue.caused(_connection.translate(exc), exc)


def _rollback(db: sqlite3.Connection) -> None:
    # A failed ROLLBACK leaves nothing better to do: SQLite rolls back a transaction whose
    # connection errors out, and the next BEGIN reports any lasting problem.
    if db.in_transaction:
        try:
            db.execute("ROLLBACK")
        except sqlite3.Error:
            pass


class Posting(Record):
    """How far the event loop got with a round on the board before the thread took it:
    when the round asked for the lock, whether it is posted, whether the loop holds the
    lock for it, and how often the post was looked at unserved."""

    asked: float
    posted: bool
    locked: bool
    looks: int = 0


class _OnLoop:
    """A round posted on the board, waited for on the event loop (`Writer._look`)."""

    __slots__ = ("asked", "batch", "busy", "looks", "ops", "turn")

    def __init__(
        self, batch: list[_Request], ops: list[Any], turn: _write_lock.Turn, asked: float
    ) -> None:
        self.batch = batch
        self.ops = ops
        self.turn = turn
        self.asked = asked
        self.looks = 1  # looked at once, as it was posted
        self.busy = 0  # looks at its answered slot that found the slot's lock held


#: Seconds before looking again at a slot whose lock a holder has this instant (uvloop's
#: timers count whole milliseconds: less would be no wait at all there).
_BUSY_SLOT = 0.001
#: Tries at taking back a post whose slot a holder has this instant, `_BUSY_SLOT` apart,
#: before a round that broke is called of unknown outcome (a holder's hold is brief).
_GIVE_UP_TRIES = 100


def _execute_round(
    db: sqlite3.Connection,
    batch: list[_Request],
    clock: _clock.Clock,
    loop: asyncio.AbstractEventLoop,
    writer: Writer,
    turn: _write_lock.Turn | None,
    posting: Posting | None,
) -> None:
    """Run on the connection's thread: one transaction for the batch, then deliver. It
    never raises (nothing waits on the thread for it): a round that breaks says so."""
    started = time.perf_counter()
    try:
        try:
            try:
                ops = [op for op, _ in batch]
                lock, board = writer.write_lock, writer.board
                served = None
                if posting is not None:  # begun on the loop: see Writer._post_on_loop
                    assert lock is not None and board is not None
                    served = _transact_posted(ops, db, clock, lock, turn, board, posting)
                    board = None  # None: the queue is gone, the post taken back; not again
                if served is None:
                    served = _transact(ops, db, clock, lock, turn, board)
                outcomes, lock_wait, held = served
            except Exception as exc:  # outside any operation (the clock, say): fail the round
                _rollback(db)
                outcomes = [_write_queue.Raised(_write_queue.round_failed(exc))] * len(batch)
                lock_wait = held = 0.0
            took = time.perf_counter() - started
            loop.call_soon_threadsafe(
                _deliver, loop, writer, batch, outcomes, lock_wait, held, took
            )
        finally:
            if writer.board is not None:  # this round's callers first, then other processes'
                writer.board.after_round()
    except BaseException as exc:  # the round itself broke (a bug, or the loop is gone)
        with contextlib.suppress(RuntimeError):  # a closed loop: no one is left to tell
            loop.call_soon_threadsafe(writer._round_broke, batch, exc)


def _run_unit(
    ops: list[Write[Any]], unit: list[int], db: sqlite3.Connection, now: float
) -> list[Any]:
    """The outcomes of one unit: each a value, or a Raised refusal that wrote nothing."""
    return _write_queue.outcomes(*_write_queue.call_unit(ops, unit, db, now))


def _never_written(exc: sqlite3.Error) -> bool:
    """Whether a failed COMMIT certainly left no commit frame behind: SQLITE_FULL means
    the frames did not fit, and the commit frame is always the last one written."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return bool(code & 0xFF == _SQLITE_FULL)
    return "database or disk is full" in str(exc).lower()  # Python 3.10: no codes


#: SQLite's primary result code for a full disk (https://sqlite.org/rescode.html).
_SQLITE_FULL = 13


def _seal(db: sqlite3.Connection) -> bool:
    """After a failed COMMIT, make sure it stays failed; whether that could be made sure.

    A COMMIT can fail after its frames, commit frame included, are in the WAL: SQLite
    writes them before it grows the WAL index (the -shm), and a full disk can refuse that
    (SQLITE_IOERR_SHMSIZE). The live database rolls back, but recovery after a crash would
    replay those frames and bring the refused round back. The next commit writes its
    frames where the refused ones begin, which breaks their checksum chain for good, so a
    one-frame commit straight away (the header's user_version, set to itself) seals the
    refusal. It needs no new room: it reuses space the refused frames took.
    """
    try:
        db.execute("BEGIN IMMEDIATE")
        (version,) = db.execute("PRAGMA user_version").fetchone()
        db.execute(f"PRAGMA user_version = {int(version)}")  # an int read just now
        db.execute("COMMIT")
    except sqlite3.Error:
        _rollback(db)
        return False
    return True


def _transact(
    ops: list[Write[Any]],
    db: sqlite3.Connection,
    clock: _clock.Clock,
    lock: _write_lock.WriteLock | None,
    turn: _write_lock.Turn | None,
    board: _combine.Board | None = None,
) -> tuple[list[Any], float, float]:
    """One transaction for all ops, isolating each op's failure, with the place at the
    head of the write-lock queue (``lock``) held from before BEGIN to after the end.

    Consecutive ops with the same ``group_key`` run as one (their ``run_group`` answers
    for each, and reports a member's refusal as an error instance, having written nothing
    for it). If such a run breaks, the round is rolled back and its members go again one
    by one, so a failure still belongs to the one request that caused it.

    With a ``board``, a round of claims and finishes is posted for whichever process
    holds the lock to serve (`_transact_posted`), and every round this writer runs takes
    in what others posted (`_transact_held`).

    Returns the outcomes, the longest single wait for the write lock (the queue's and
    BEGIN IMMEDIATE's together; for a round another process served, the wait for its
    answers), and how long the lock was held, in seconds.
    """
    asked = time.perf_counter()
    if lock is None:  # no queue: SQLite's busy handler waits alone
        if turn is not None and not turn.begin():
            return _given_up(ops, asked)
        outcomes, waited = _transact_held(ops, db, clock, asked, None)
        return outcomes, waited, time.perf_counter() - asked - waited
    if board is not None and board.postable(ops):
        served = _transact_posted(ops, db, clock, lock, turn, board, Posting(asked, False, False))
        if served is not None:
            return served  # else not posted: this round waits for its own turn
    if not lock.acquire():  # the queue failed: SQLite's busy handler waits alone
        if turn is not None and not turn.begin():
            return _given_up(ops, asked)
        outcomes, waited = _transact_held(ops, db, clock, asked, None)
        return outcomes, waited, time.perf_counter() - asked - waited
    with _holding(lock, db, board) as held:
        if turn is not None and not turn.begin():  # given up by the loop: write nothing
            return _given_up(ops, asked)
        outcomes, waited = _transact_held(ops, db, clock, asked, board)
    return outcomes, waited, held.released - asked - waited


class _Held:
    """When `_holding` let the write lock go (`time.perf_counter`): the lock was held to
    there, not to when this thread next ran (on a busy machine, much later)."""

    released = 0.0


@contextlib.contextmanager
def _holding(
    lock: _write_lock.WriteLock, db: sqlite3.Connection, board: _combine.Board | None
) -> Iterator[_Held]:
    """The write lock, held: any open transaction (something raised) ends before the lock
    goes; then the board hears it went (`Board.after_round` answers and nudges)."""
    held = _Held()
    try:
        yield held
    finally:
        try:
            _rollback(db)
        finally:
            held.released = time.perf_counter()
            lock.release()
            if board is not None:
                board.let_go()


def _transact_posted(
    ops: list[Write[Any]],
    db: sqlite3.Connection,
    clock: _clock.Clock,
    lock: _write_lock.WriteLock,
    turn: _write_lock.Turn | None,
    board: _combine.Board,
    start: Posting,
) -> tuple[list[Any], float, float] | None:
    """`_transact` for a round of claims and finishes on a board: if the write lock is
    taken, posted, then served by whichever process holds it, this one included. None if
    it could not be posted (too big, a full disk) or the queue is gone: the caller runs
    it as any other round. A process alone never finds the lock taken, so never posts.
    ``start`` says how far the event loop got with it (`Writer._post_on_loop`): posted
    or not, the lock held or not, and how often the post was looked at."""
    asked = start.asked
    posted: bool | None = start.posted
    looks = start.looks  # times this post was looked at unserved
    locked = start.locked
    while True:
        looks += 1
        if locked:  # the loop took the lock for this round: go on from there
            got: bool | None = True
            locked = False
        elif posted and looks > _LOOKS_BEFORE_QUEUEING and board.state() != _combine.ANSWERED:
            # Unserved this long: the holders may be writers that do not combine (another
            # board, ASYNCPLANE_NO_COMBINE), or its holder died and others keep the lock
            # busy. Wait in the queue for a turn of its own; a holder may still serve the
            # post meanwhile, and then its answers are found.
            got = lock.acquire() or None
        else:
            got = lock.try_acquire()
        if got is None and (not posted or board.retract()):  # no queue any more
            return None
        if got:
            with _holding(lock, db, board) as held:
                if turn is not None and not turn.begin():  # given up (the post taken back)
                    return _given_up(ops, asked)
                if posted:
                    answers = _collected(
                        board, ops, lambda token: _committed(db, board, token), held=True
                    )
                    if answers is not None:  # a holder that died had served it: it stands
                        return answers, time.perf_counter() - asked, 0.0
                outcomes, waited = _transact_held(ops, db, clock, asked, board)
            return outcomes, waited, held.released - asked - waited
        if not posted:
            if turn is None:
                posted = board.post(ops)
            else:
                posted = turn.post(lambda: board.post(ops), board.retract)
                if posted is None:  # given up before it was posted
                    return _given_up(ops, asked)
            if not posted:
                return None
            continue  # the lock again: a holder that let go before the post never saw it
        signal = board.signal()
        state = board.state()
        if state in (_combine.POSTED, _combine.TAKEN):
            if got is None and looks > _LOOKS_WITHOUT_QUEUE:  # taken, and no lock to ask
                if turn is not None:
                    turn.begin()  # taken: busy_timeout can no longer give it up
                unknown = _errors.CommitOutcomeUnknown(
                    "the store's write queue went away while another process's round "
                    "held these requests: they may or may not have been saved"
                )
                return [_write_queue.Raised(unknown)] * len(ops), 0.0, 0.0
            # Until a holder answers or nudges, or RECHECK passes: then try the lock,
            # which a holder keeps while it serves, so a taken post whose holder let it
            # go unanswered was left by a holder that died.
            state = board.wait(signal, _combine.RECHECK)
        if state == _combine.ANSWERED:
            if turn is not None:
                turn.begin()  # served: busy_timeout can no longer give it up
            answers = _collected(board, ops, _never)
            assert answers is not None  # an answered slot always has its outcomes
            return answers, time.perf_counter() - asked, 0.0
        if state == _combine.EMPTY:  # the loop gave the round up and took the post back
            return _given_up(ops, asked)


#: Looks at an unserved post before waiting in the queue for a turn of its own.
_LOOKS_BEFORE_QUEUEING = 20
#: Looks at a taken post, with the queue gone, before its outcome is called unknown.
_LOOKS_WITHOUT_QUEUE = 200


def _collected(
    board: _combine.Board,
    ops: list[Write[Any]],
    committed: Callable[[bytes], bool],
    *,
    held: bool = False,
) -> list[Any] | None:
    """`Board.collect` on the thread; if the slot's lock cannot be had (ENOLCK, say),
    every request's outcome is unknown, as a holder may have committed it; unless the
    writers' lock is ``held`` and the post was never taken: then it is taken back, to run
    here (None), so that no later holder serves a round its callers were answered for."""
    try:
        return board.collect(ops, committed)
    except OSError as exc:
        if held and board.withdraw_unserved():
            return None
        unknown = _errors.CommitOutcomeUnknown(
            f"another process's round may have taken these requests, but their slot on "
            f"the board could not be read: {exc!r}"
        )
        return [_write_queue.Raised(_write_queue.caused(unknown, exc))] * len(ops)


def _never(token: bytes) -> bool:
    return False


def _committed(db: sqlite3.Connection, board: _combine.Board, token: bytes) -> bool:
    """Whether the round marked by ``token`` that served this slot committed."""
    return db.execute(sql.COMBINED_ROUND, (board.row(board.slot), token)).fetchone() is not None


def _given_up(ops: list[Write[Any]], asked: float) -> tuple[list[Any], float, float]:
    """The outcomes of a round the loop gave up waiting for (its callers know already)."""
    refused = _errors.DatabaseLocked("database is locked: the round was given up")
    return [_write_queue.Raised(refused)] * len(ops), time.perf_counter() - asked, 0.0


def _transact_held(
    ops: list[Write[Any]],
    db: sqlite3.Connection,
    clock: _clock.Clock,
    asked: float,
    board: _combine.Board | None,
) -> tuple[list[Any], float]:
    """`_transact` once its place in the queue is held (``asked``: when it was asked for),
    with every round other processes posted on ``board`` taken in and answered."""
    taken = (
        [] if board is None or not board.posted()
        else board.take(token := os.urandom(16), _TAKE_ROOM)
    )  # fmt: skip
    if not taken:
        return _run_held(ops, db, clock, asked, None)
    assert board is not None
    every: list[Any] = list(ops)
    spans: list[tuple[_combine.Taken, int, int]] = []
    for one in taken:
        spans.append((one, len(every), len(every) + len(one.ops)))
        every.extend(one.ops)
    order = _write_queue.combined_order(every, len(ops))
    written: list[Any] = []

    def in_place(ordered: list[Any]) -> list[Any]:
        outcomes: list[Any] = [None] * len(every)
        for position, index in enumerate(order):
            outcomes[index] = ordered[position]
        return outcomes

    def before_commit(ordered: list[Any]) -> None:
        # The answers first, then the token: both in the transaction's own window, so a
        # waiter that finds the token finds its answers (see asyncplane._combine).
        outcomes = in_place(ordered)
        for one, start, end in spans:
            board.answer(one, outcomes[start:end])
        db.executemany(sql.INSERT_COMBINED_ROUND, [(board.row(one.slot), token) for one in taken])
        written[:] = ordered

    try:
        ordered, waited = _run_held(
            [every[index] for index in order], db, clock, asked, before_commit
        )
    except BaseException as exc:  # outside any operation: every taker hears the failure
        failed = _write_queue.Raised(_write_queue.round_failed(exc))
        for one in taken:
            _answer_anew(board, one, [failed] * len(one.ops))
        raise
    outcomes = in_place(ordered)
    changed = len(written) != len(ordered) or any(
        a is not b for a, b in zip(written, ordered, strict=True)
    )
    for one, start, end in spans:
        if changed:  # the commit failed: the answers written before it are not the news
            _answer_anew(board, one, outcomes[start:end])
        else:
            board.committed(one, token)  # marked answered once the lock has gone
    return outcomes[: len(ops)], waited


def _answer_anew(board: _combine.Board, taken: _combine.Taken, outcomes: list[Any]) -> None:
    """Answer a taken round its round did not commit; if even that cannot be written, wake
    its owner unanswered: holding the lock, it finds no token, and runs it itself."""
    try:
        board.answer(taken, outcomes)
    except OSError:
        board.wake(taken)
    else:
        board.answered(taken)


#: At most about this many requests of other processes taken into one round.
_TAKE_ROOM = 1024


def _run_held(
    ops: list[Write[Any]],
    db: sqlite3.Connection,
    clock: _clock.Clock,
    asked: float,
    before_commit: Callable[[list[Any]], None] | None,
) -> tuple[list[Any], float]:
    """Run ``ops`` in one transaction, each failure isolated; ``before_commit`` (if any)
    runs in it with the outcomes, just before COMMIT."""
    outcomes: list[Any] = [None] * len(ops)
    todo = list(range(len(ops)))
    alone: set[int] = set()  # members of a broken run: they go again one by one
    riding = _write_queue.riders(ops)  # claims that run only if their settle is not refused
    lock_wait = 0.0
    while todo:
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            error = _translated(exc)
            for index in todo:
                outcomes[index] = _write_queue.Raised(error)
            return outcomes, max(lock_wait, time.perf_counter() - asked)
        lock_wait = max(lock_wait, time.perf_counter() - asked)
        now = clock.now()
        broken: list[int] | None = None  # the run that spoiled the transaction
        for unit in _write_queue.units(ops, todo, alone):
            if riding:
                unit = _write_queue.runnable(unit, riding, outcomes)
                if not unit:
                    continue
            before = db.total_changes
            try:
                for index, outcome in zip(unit, _run_unit(ops, unit, db, now), strict=True):
                    outcomes[index] = outcome
            except _errors.AsyncplaneError as exc:
                for index in unit:
                    outcomes[index] = _write_queue.Raised(exc)
                if db.total_changes != before:  # refused after writing: not isolated
                    broken = unit
                    break
            except sqlite3.Error as exc:
                for index in unit:
                    outcomes[index] = _write_queue.Raised(_translated(exc))
                broken = unit
                break
            except Exception as exc:  # a bug in an operation: report it to its caller
                for index in unit:
                    outcomes[index] = _write_queue.Raised(exc)
                broken = unit
                break
        if broken is None and before_commit is not None:
            try:
                before_commit(outcomes)
            except (sqlite3.Error, OSError) as exc:  # nothing of the round is saved
                _rollback(db)
                error = (
                    _translated(exc) if isinstance(exc, sqlite3.Error)
                    else _write_queue.caused(_errors.StorageError(
                        f"the answers of a combined round could not be written: {exc}"
                    ), exc)
                )  # fmt: skip
                return [_write_queue.Raised(error)] * len(ops), lock_wait
        if broken is None:
            try:
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                _rollback(db)
                refused: _errors.StorageError = _translated(exc)
                if not _never_written(exc) and not _seal(db):
                    refused = _errors.CommitOutcomeUnknown(
                        f"the commit failed and could not be sealed, so it may yet be "
                        f"saved: {refused}"
                    )
                    refused.__cause__ = exc
                for index in todo:
                    if not isinstance(outcomes[index], _write_queue.Raised):
                        outcomes[index] = _write_queue.Raised(refused)
                return outcomes, lock_wait
            return outcomes, lock_wait
        # Undo everything this round wrote and run the others again without the culprit.
        # A run of several broke as a whole: its members go again one by one, so only the
        # one that fails again is the culprit.
        _rollback(db)
        if len(broken) > 1:
            alone.update(broken)
        else:
            todo = [index for index in todo if index != broken[0]]
        for index in todo:
            outcomes[index] = None
        asked = time.perf_counter()  # the fresh transaction's BEGIN waits anew
    return outcomes, lock_wait
