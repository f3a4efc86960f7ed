"""Combining write rounds across processes: one holder of the write lock serves the claims
and finishes every other process has posted, in its own transaction.

Sixteen worker processes on one SQLite file each run rounds of a few requests, one at a
time, each paying BEGIN, a cold page cache and COMMIT (under synchronous=FULL, an fsync).
Flat combining gathers them: a writer whose round is all claims and finishes tries the
writers' queue (`asyncplane._write_lock`) without waiting. If the lock is free it is the
*holder* and runs its round; if not, it *posts* the round, as data, in its own slot of a
shared board beside the database, ``<database>-combine``, tries once more, and sleeps
until its slot's signal moves. A holder *takes* every posted slot of its queue into its
round, runs them with its own requests in one transaction and writes each taker's
answers into its slot. Once it has let the lock go and its own callers have their
outcomes, it marks the slots answered and wakes their owners, then wakes one writer whose
post arrived too late to be taken, which tries the lock in turn.

**Where a waiter sleeps.** A post is made, and waited for, on the poster's event loop
(`asyncplane._writer`), which never blocks for it: trying the lock and posting do not
wait, and the loop sleeps on its slot's *wake pipe* (a FIFO beside the board,
``<database>-combine-wake-N``, opened by the slot's owner and read by its loop), which a
holder writes a byte to whenever it moves the slot's signal. A round served that way
never reaches the poster's connection thread: no hand-off to it and back, which on two
CPUs cost a served item about a third of its CPU (docs/architecture.md). A post that
waits long goes to the connection's thread, which queues for the lock and sleeps on the
signal word itself (a futex), woken by the same signal.

What is saved stays knowable, whoever dies when:

* **Answers before COMMIT, and a token in the transaction.** A holder writes the answers
  into the slots and the round's random token into each taken slot's row of
  ``combined_rounds`` before COMMIT; after a COMMIT it marks the slots answered once it
  has let the lock go, and only a slot still taken by its round. (A round whose COMMIT
  failed answers its takers with the failure before it lets the lock go.) A waiter whose slot
  is still marked taken once it holds the lock itself finds that round decided (the
  holder died, or has yet to mark it) and looks the token up: found, the round committed
  and the answers stand; absent, it rolled back and the waiter runs its requests itself.
* **A waiter that dies** is not served: a slot is owned through an OFD lock on one byte
  of the board, which the kernel lets go when the owner ends, and a holder skips posts
  whose owner is gone. (A post its owner died with can still be taken in the instant a
  new process takes the slot over and before it clears it; its claims then lapse, as a
  killed worker's do, and its finishes stand, as its owner asked.) A process that takes
  over a slot clears it first, so that no holder of its predecessor's post can still
  write into it (`Board._settle_in`).
* **busy_timeout** takes back a post nobody has taken (`Board.retract`), under a per-slot
  lock that a holder also takes to mark a slot taken, so a request is either given up
  with nothing written or served, never both; if a holder is at the slot's lock that
  instant, it asks again a moment later. A taken request cannot be given up.
* **One queue, one board's takers.** A post names the writers' queue file its owner waits
  in, and a holder takes only posts of its own queue, whose lock it holds: if the queue's
  file is replaced while stores have it open, the two queues' processes never serve each
  other's rounds.
* **State words are stored whole** (ctypes), never through struct's pack_into, which
  zeroes the span it is about to write: a state that reads as empty for that instant
  tells its waiting owner that its round was given up.
* **A holder that stalls** (SIGSTOP) stalls its takers as it would the lock; a waiter
  looks at the lock every ``RECHECK`` seconds, so a dead holder's takers go on soon.

The board needs Linux: OFD locks, and futexes on the shared mapping for sleeping and
waking (through ctypes). Elsewhere, or if the board cannot be opened, every writer waits
in the queue for its own round as before. Requests and answers cross as marshal data
(plain tuples; errors as a name in `asyncplane._errors` with its arguments), never
pickles: the board is only as trusted as the database beside it, which holds no code.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import mmap
import os
import pathlib
import platform
import sqlite3
import stat
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from asyncplane import _errors, _write_lock, _write_queue
from asyncplane._record import Record

if TYPE_CHECKING:
    from asyncplane._write_lock import WriteLock

if sys.platform == "linux":
    import ctypes
    import fcntl

__all__ = ("DISABLE", "RECHECK", "SUFFIX", "WAKE_SUFFIX", "Board", "Taken", "open_board")

_log = logging.getLogger("asyncplane.writer")

#: The board's name is the database's with this added.
SUFFIX = "-combine"
#: Slots on a board: processes beyond this many wait for their own rounds.
SLOTS = 64
#: ``ASYNCPLANE_NO_COMBINE=1`` in a process's environment: its stores never combine (for
#: measuring what combining is worth, in the same run).
DISABLE = "ASYNCPLANE_NO_COMBINE"
#: Seconds a waiter sleeps before it looks at the lock itself (a holder may have died).
RECHECK = 0.05

# The file: a page of slot headers, mapped (the futex words live there), allocated when
# the board is made so that writing through the mapping never meets a full disk (SIGBUS);
# then each slot's request and answer, written and read with pwrite and pread, so a full
# disk is an error to handle. Only what is written takes room.
_HEADER = 64  # state, seq, request length, answer length, token
_HEADERS = SLOTS * _HEADER
_REQUEST_ROOM = 64 * 1024  # a bigger round is not posted: it waits for its own turn
_ANSWER_ROOM = 1024 * 1024  # a bigger answer goes in a file of its own (see _spill)
_BODY = _REQUEST_ROOM + _ANSWER_ROOM
_HEAD = struct.Struct("=IIII16s")
# The header after its state word. A state word is only ever stored whole, through ctypes:
# struct's pack_into zeroes its span before it writes the fields, and a state that reads
# as EMPTY for that instant tells a waiting owner its round was given up.
_REST = struct.Struct("=III16s")
_SIGNAL = 40  # a slot's signal word: bumped at every change its owner must look at
_VERSION_AT = 44  # the layout of a post: a holder skips posts of another version
# 2: a holder runs a round's finishes ahead of its claims (`_write_queue.combined_order`),
# which a finish posted with its caller's next claim counts on. 3: a request names the
# one it rides on (`_Wire`). 4: a round's token is kept under the board's own row for the
# slot (`Board.row`), so two boards of one database (one made anew after the first was
# deleted) never read each other's tokens.
_VERSION = 4
_QUEUE_AT = 48  # which writers' queue file the poster waits in (see `Board.queue`)
_WAKE_AT = 56  # the inode of the slot's wake pipe (0: none), as its owner opened it
#: A slot's wake pipe is the board's name with this and the slot's number added.
WAKE_SUFFIX = "-wake-"
_SPILLED = 0xFFFFFFFF  # answer length meaning "in the slot's spill file"

EMPTY, POSTED, TAKEN, ANSWERED = 0, 1, 2, 3
#: Every slot's state word in one read: a glance at the board, only ever a hint. A holder
#: reads a slot's state again under the slot's lock before it takes the slot; a nudge may
#: wake an owner whose post was taken meanwhile, which then only looks again. The states
#: are small numbers, so only a word's low byte ever changes, and a read that tears cannot
#: make one of them up.
_STATES = struct.Struct("=" + f"I{_HEADER - 4}x" * SLOTS)
#: Whether this machine's stores are seen by other CPUs in the order they were made (x86's
#: total store order): a post's header, then its state, needs no fence between them.
_STORES_IN_ORDER = platform.machine() in ("x86_64", "AMD64", "i686")

#: A request on the board: the name of its kind, its group key, its operation's fields,
#: and the place in the post of the request it rides on (`_write_queue.Grouped.after`;
#: -1: none).
_Wire = tuple[str, tuple[Any, ...], tuple[Any, ...], int]


class Taken(Record):
    """Another process's posted round, taken into this holder's round."""

    slot: int
    ops: list[_write_queue.Grouped[Any]]


class _Futex:
    """Sleeping on, and waking, a 32-bit word of a shared mapping (Linux futex(2))."""

    #: futex's syscall number on each machine Python may name.
    _NUMBERS: ClassVar[dict[str, int]] = {
        "x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238,
    }  # fmt: skip

    def __init__(self) -> None:
        number = self._NUMBERS.get(platform.machine())
        if number is None:
            raise OSError(f"no futex syscall number known for {platform.machine()}")
        self._number = number
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall

    def wait(self, address: int, expected: int, timeout: float) -> None:
        """Sleep while the word at ``address`` is ``expected``, at most ``timeout`` s."""
        spec = (ctypes.c_long * 2)(int(timeout), int((timeout % 1) * 1e9))
        self._syscall(self._number, ctypes.c_void_p(address), 0, expected, spec, None, 0)

    def wake(self, address: int) -> None:
        """Wake one sleeper on the word at ``address``."""
        self._syscall(self._number, ctypes.c_void_p(address), 1, 1, None, None, 0)


def _range_lock(kind: int, start: int) -> bytes:
    # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
    return struct.pack("hhqqixxxx", kind, os.SEEK_SET, start, 1, 0)


class Board:
    """One process's slot on a database's board, and its view of everyone else's.

    Runs on the write connection's thread, except what the event loop calls for a post
    it waits for (`post`, `state`, `collect` without waiting, `retract` for busy_timeout,
    `withdraw_unserved` for a hand-off that failed). ``kinds`` names the group
    operations that may be posted.
    """

    def __init__(
        self, path: pathlib.Path, fd: int, slot: int, kinds: Mapping[str, Callable[..., Any]]
    ) -> None:
        self._path = path
        self._fd = fd
        self.slot = slot
        self._kinds = kinds
        self._names = {many: name for name, many in kinds.items()}
        #: Which board this is, as a number (its file's inode): two boards of one
        #: database number their slots alike, and keep their tokens apart by it (`row`).
        self.identity = os.fstat(fd).st_ino % (1 << 50)
        self._mem = mmap.mmap(fd, _HEADERS)
        self._words = [ctypes.c_uint32.from_buffer(self._mem, s * _HEADER) for s in range(SLOTS)]
        self._signals = [
            ctypes.c_uint32.from_buffer(self._mem, s * _HEADER + _SIGNAL) for s in range(SLOTS)
        ]
        self._futex = _Futex()
        #: This slot's wake pipe, read by its owner's event loop (-1: none; see `open_wake`).
        self.wake_fd = -1
        self._wakes: dict[int, tuple[int, int]] = {}  # a slot's pipe, opened: (inode, fd)
        self._seq = 0
        #: The writers' queue file this process waits in, as a number: a holder serves only
        #: posts of its own queue's waiters, whose lock it holds (`_read_post`).
        self.queue = 0
        self._committed: list[tuple[int, bytes]] = []
        self._let_go = False
        #: Rounds of others this process's rounds took in, and its own served elsewhere.
        self.served_for_others = 0
        self.served_by_others = 0

    def row(self, slot: int) -> int:
        """The ``combined_rounds`` row of a slot of this board (its token's key)."""
        return self.identity * SLOTS + slot

    # --- the owner's side ---------------------------------------------------------------

    def postable(self, ops: Sequence[Any]) -> bool:
        """Whether ``ops`` may be posted: all of them claims or finishes."""
        names = self._names
        return all(type(op) is _write_queue.Grouped and op.many in names for op in ops)

    def post(self, ops: Sequence[Any]) -> bool:
        """Put ``ops`` in this slot for a holder to take; False if they do not fit (or
        the disk is full)."""
        riding = _write_queue.riders(ops)
        wire = [
            (self._names[op.many], op.group_key, tuple(op.op), riding.get(index, -1))
            for index, op in enumerate(ops)
        ]
        body = marshal.dumps(wire)
        if len(body) > _REQUEST_ROOM:
            return False
        try:
            os.pwrite(self._fd, body, _HEADERS + self.slot * _BODY)
        except OSError:
            return False
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        base = self.slot * _HEADER
        _REST.pack_into(self._mem, base + 4, self._seq, len(body), 0, bytes(16))
        struct.pack_into("=I", self._mem, base + _VERSION_AT, _VERSION)
        struct.pack_into("=Q", self._mem, base + _QUEUE_AT, self.queue)
        if _STORES_IN_ORDER:
            self._words[self.slot].value = POSTED  # last: a holder reads the rest after it
        else:  # the slot's lock orders the header's stores before the state's, for takers
            self._slot_lock_wait(self.slot)
            try:
                self._words[self.slot].value = POSTED
            finally:
                self._slot_unlock(self.slot)
        return True

    def state(self) -> int:
        """This slot's state."""
        return int(self._words[self.slot].value)

    def signal(self) -> int:
        """This slot's signal word, to `wait` on: read it before looking at the state."""
        return int(self._signals[self.slot].value)

    def wait(self, signal: int, timeout: float) -> int:
        """Sleep until this slot's signal moves from ``signal`` (an answer, a nudge, a post
        taken back), or ``timeout``; the slot's state."""
        self._futex.wait(ctypes.addressof(self._signals[self.slot]), signal, timeout)
        return self.state()

    def _signal(self, slot: int) -> None:
        """Move ``slot``'s signal and wake its sleeper, on its thread (the futex) or on its
        event loop (the wake pipe): a wake that comes before the owner sleeps is not lost,
        as the word it would sleep on has moved, and the pipe keeps the byte."""
        word = self._signals[slot]
        word.value = (word.value + 1) & 0xFFFFFFFF
        self._futex.wake(ctypes.addressof(word))
        self._wake_loop(slot)

    def _wake_loop(self, slot: int) -> None:
        """A byte to ``slot``'s wake pipe, opened once and kept while its inode is the one
        the slot's owner named (a pipe made anew by a later owner is opened anew)."""
        (inode,) = struct.unpack_from("=Q", self._mem, slot * _HEADER + _WAKE_AT)
        if inode == 0:
            return  # its owner sleeps on its thread only
        known = self._wakes.get(slot)
        if known is None or known[0] != inode:
            if known is not None:
                os.close(known[1])
                del self._wakes[slot]
            try:  # no reader (its owner gone): ENXIO; no pipe: ENOENT
                fd = os.open(
                    wake_path(self._path, slot), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
                )
            except OSError:
                return
            if os.fstat(fd).st_ino != inode:
                os.close(fd)
                return
            self._wakes[slot] = known = (inode, fd)
        try:
            os.write(known[1], b"\0")
        except BlockingIOError:  # full: its owner has bytes to read already
            pass
        except OSError:  # its reader gone (EPIPE): open the slot's pipe anew next time
            os.close(known[1])
            del self._wakes[slot]

    def open_wake(self) -> bool:
        """Open this slot's wake pipe for its event loop to read (`wake_fd`), and name it
        in the slot's header for holders to write to; whether there is one (a filesystem
        without FIFOs: the slot's owner waits on its thread, as before there were pipes)."""
        if not _STORES_IN_ORDER:  # posting waits for the slot's lock: not on a loop
            return False
        path = wake_path(self._path, self.slot)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(path, os.fstat(self._fd).st_mode & 0o666)
            # Read and write: a FIFO opened so never reads an end of file, and never blocks.
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            _log.debug("no wake pipe for slot %d of %s (%s)", self.slot, self._path, exc)
            return False
        facts = os.fstat(fd)
        if not stat.S_ISFIFO(facts.st_mode):  # something else by that name
            os.close(fd)
            return False
        with contextlib.suppress(OSError):
            os.fchmod(fd, os.fstat(self._fd).st_mode & 0o666)  # the board's, not the umask's
        self.wake_fd = fd
        struct.pack_into("=Q", self._mem, self.slot * _HEADER + _WAKE_AT, facts.st_ino)
        return True

    def woken(self) -> None:
        """On the event loop, its wake pipe readable: read what holders wrote to it."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(self.wake_fd, 512):
                pass

    def spilled(self) -> bool:
        """Whether this slot's answer was too big for it and waits in a file beside the
        board (read on the connection's thread, not on the event loop)."""
        return bool(self._head(self.slot)[3] == _SPILLED)

    def retract(self) -> bool | None:
        """Take back this slot's post unless a holder has taken it: whether it is back
        (or was never posted); None if a holder is at the slot's lock this instant (ask
        again). Never blocks."""
        if not self._slot_lock(self.slot):
            return None
        try:
            if self.state() in (TAKEN, ANSWERED):
                return False
            self._words[self.slot].value = EMPTY
        finally:
            self._slot_unlock(self.slot)
        self._signal(self.slot)  # its thread: look again
        return True

    def withdraw_unserved(self) -> bool:
        """With the writers' lock held, when the slot's own lock is out of reach (a holder
        at it, or ENOLCK): take back this slot's post if no holder has taken it; whether
        it was posted and is back. No slot lock is needed for that: only a holder of the
        writers' lock takes a post, and a slot still posted has no holder's answer to
        come. An empty slot is False: it may have been emptied by a collect whose own
        unlock then failed, its round served."""
        if self.state() != POSTED:
            return False
        self._words[self.slot].value = EMPTY
        return True

    def collect(
        self, ops: Sequence[Any], committed: Callable[[bytes], bool], *, wait: bool = True
    ) -> list[Any] | None:
        """With the writers' lock held (or the slot answered): this slot's outcomes, if a
        holder served it and its round committed; else None (the post withdrawn, the
        requests to run here). ``committed`` looks a round's token up in the database.
        ``wait=False`` (the event loop): BlockingIOError if a holder is at the slot's lock
        this instant, nothing done (ask again)."""
        # Under the slot's lock: a holder marks a slot answered after letting the writers'
        # lock go (`mark_answered`), and only if it still finds the slot taken by its round.
        failed: Exception | None = None
        if not wait:
            if not self._slot_lock(self.slot):
                raise BlockingIOError("the slot's lock is held by a holder this instant")
        else:
            self._slot_lock_wait(self.slot)
        try:
            state, _, _, answer_len, token = self._head(self.slot)
            served = state == ANSWERED
            if state == TAKEN:
                try:
                    served = committed(token)
                except Exception as exc:  # the lookup failed: it may have committed
                    served, failed = True, exc
            self._words[self.slot].value = EMPTY
        finally:
            self._slot_unlock(self.slot)
        if not served:
            return None
        self.served_by_others += 1
        if failed is None:
            try:
                return self._decode_answers(ops, self._answer_bytes(self.slot, answer_len))
            except (OSError, ValueError, EOFError, TypeError, KeyError) as exc:
                failed = exc
        unknown = _errors.CommitOutcomeUnknown(
            f"another process's round took these requests and may have committed them, "
            f"but its outcome could not be read: {failed!r}"
        )
        return [_write_queue.Raised(_write_queue.caused(unknown, failed))] * len(ops)

    # --- the holder's side --------------------------------------------------------------

    def posted(self) -> bool:
        """At a glance: whether any slot but this process's looks posted."""
        return _others_posted(_STATES.unpack_from(self._mem), self.slot)

    def take(self, token: bytes, room: int) -> list[Taken]:
        """With the writers' lock held: every posted round of a live owner (up to about
        ``room`` requests), marked taken by ``token``."""
        taken: list[Taken] = []
        count = 0
        states = _STATES.unpack_from(self._mem)
        for step in range(1, SLOTS):
            if count >= room:
                break
            slot = (self.slot + step) % SLOTS
            if states[slot] != POSTED or not self._owned(slot):
                continue  # (a posted slot's state is read again under its lock)
            if not self._slot_lock(slot):
                continue  # its owner is taking it back right now
            try:
                state, seq, request_len, _, _ = self._head(slot)
                if state != POSTED:
                    continue
                ops = self._read_post(slot, request_len)
                if ops is None:
                    continue  # not a post this holder can read: its owner runs it
                _REST.pack_into(self._mem, slot * _HEADER + 4, seq, request_len, 0, token)
                self._words[slot].value = TAKEN
            finally:
                self._slot_unlock(slot)
            taken.append(Taken(slot, ops))
            count += len(ops)
        self.served_for_others += len(taken)
        return taken

    def _read_post(self, slot: int, length: int) -> list[_write_queue.Grouped[Any]] | None:
        """A slot's posted requests, or None if they are of another layout (another
        version of asyncplane) or cannot be read."""
        (version,) = struct.unpack_from("=I", self._mem, slot * _HEADER + _VERSION_AT)
        (queue,) = struct.unpack_from("=Q", self._mem, slot * _HEADER + _QUEUE_AT)
        if version != _VERSION or queue != self.queue:
            return None  # another layout, or a poster in another queue (the file replaced)
        try:
            wire: list[_Wire] = marshal.loads(os.pread(self._fd, length, _HEADERS + slot * _BODY))
            requests = [
                _request_of(kind, key, fields, self._kinds[kind]) for kind, key, fields, _ in wire
            ]
            for request, (_, _, _, after) in zip(requests, wire, strict=True):
                if after >= 0:
                    request.after = requests[after]
            return requests
        except (OSError, ValueError, EOFError, TypeError, LookupError):
            return None

    def answer(self, taken: Taken, outcomes: Sequence[Any]) -> None:
        """Write a taken round's outcomes into its slot (before COMMIT: provisional).
        OSError if they cannot be written (a full disk): the round must not commit."""
        body = marshal.dumps([_encode_outcome(outcome) for outcome in outcomes])
        if len(body) <= _ANSWER_ROOM:
            os.pwrite(self._fd, body, _HEADERS + taken.slot * _BODY + _REQUEST_ROOM)
            length = len(body)
        else:
            spill = os.open(
                self._spill(taken.slot), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                os.fstat(self._fd).st_mode & 0o666,
            )  # fmt: skip
            try:
                os.fchmod(spill, os.fstat(self._fd).st_mode & 0o666)  # not the umask's
                os.write(spill, body)
            finally:
                os.close(spill)
            length = _SPILLED
        struct.pack_into("=I", self._mem, taken.slot * _HEADER + 12, length)

    def wake(self, taken: Taken) -> None:
        """Wake a taken round's owner without answering it: the round did not commit, so
        once it has the lock it finds no token and runs its requests itself."""
        self._signal(taken.slot)

    def committed(self, taken: Taken, token: bytes) -> None:
        """Note a taken round whose transaction committed, its answers written before: to
        be marked answered once the writers' lock is let go (`mark_answered`)."""
        self._committed.append((taken.slot, token))

    def let_go(self) -> None:
        """Note that this process let the writers' lock go (see `after_round`)."""
        self._let_go = True

    def after_round(self) -> None:
        """On the connection's thread, after a round's own callers have their outcomes:
        mark the rounds noted `committed` answered and wake their owners, then, if this
        process let the lock go, nudge a post that came too late to be taken. Waking a
        process can hand it this one's CPU, so it comes after the lock has passed on and
        this round's callers are served."""
        self.mark_answered()
        if self._let_go:
            self._let_go = False
            self.nudge()

    def mark_answered(self) -> None:
        """Mark the rounds noted `committed` answered, then wake their owners. A slot no
        longer taken by the noting round (its owner, finding it taken with the writers'
        lock free, took the answers already) is left as it is."""
        busy: list[tuple[int, bytes]] = []
        for slot, token in self._committed:
            if not self._slot_lock(slot):  # its owner is at it: the next round marks it
                busy.append((slot, token))
                continue
            try:
                state, _, _, _, now = self._head(slot)
                if state == TAKEN and now == token:
                    self._words[slot].value = ANSWERED
            finally:
                self._slot_unlock(slot)
            self._signal(slot)
        self._committed[:] = busy

    def answered(self, taken: Taken) -> None:
        """Mark a taken round answered (after COMMIT, or its failure) and wake its owner."""
        if _STORES_IN_ORDER:
            self._words[taken.slot].value = ANSWERED
        else:  # the answer's length stored before the state, as its owner will read them
            self._slot_lock_wait(taken.slot)
            try:
                self._words[taken.slot].value = ANSWERED
            finally:
                self._slot_unlock(taken.slot)
        self._signal(taken.slot)

    def nudge(self) -> None:
        """After letting the writers' lock go: wake one writer whose post no holder took,
        to try the lock itself (a post that came after this holder's `take`)."""
        states = _STATES.unpack_from(self._mem)
        if not _others_posted(states, self.slot):
            return
        for step in range(1, SLOTS):
            slot = (self.slot + step) % SLOTS
            if states[slot] == POSTED and self._owned(slot):
                self._signal(slot)
                return

    def close(self) -> None:
        """Let go of the slot and the mapping, and of the wake pipes."""
        if self.slot >= 0:  # holders no longer wake a pipe nobody reads
            struct.pack_into("=Q", self._mem, self.slot * _HEADER + _WAKE_AT, 0)
        for _, fd in self._wakes.values():
            os.close(fd)
        self._wakes.clear()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1
        del self._words, self._signals
        self._mem.close()
        os.close(self._fd)

    # --- inside ------------------------------------------------------------------------

    def _settle_in(self, lock: WriteLock) -> bool:
        """Own a free slot and clear what a dead predecessor left in it; whether one was
        had. Never waits: a slot that cannot be cleared now is left for another time.

        A slot's state says what may still touch it. Empty or answered: nothing. Posted: a
        holder may be about to take it (the slot looks owned again, by this process), so
        it is cleared under the slot's lock, which a holder takes to mark it taken. Taken:
        a holder may still write its answer, so it is cleared only with the writers' lock
        held (tried, not waited for), which that holder keeps until its round has
        committed or rolled back with the answers written, and under the slot's lock,
        which a holder marking it answered after letting the writers' lock go takes."""
        for slot in range(SLOTS):
            try:
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _range_lock(fcntl.F_WRLCK, slot))
            except (BlockingIOError, PermissionError):
                continue
            if self._clear(slot, lock):
                self.slot = slot
                return True
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _range_lock(fcntl.F_UNLCK, slot))
        return False

    def _clear(self, slot: int, lock: WriteLock) -> bool:
        word = self._words[slot]
        if word.value == POSTED and self._slot_lock(slot):
            try:
                if word.value == POSTED:
                    word.value = EMPTY
            finally:
                self._slot_unlock(slot)
        if word.value in (EMPTY, ANSWERED):
            word.value = EMPTY
            return True
        if word.value == TAKEN and lock.try_acquire():
            try:  # and the slot's lock: a holder past the writers' lock may be marking it
                if not self._slot_lock(slot):
                    return False
                try:
                    word.value = EMPTY
                finally:
                    self._slot_unlock(slot)
            finally:
                lock.release()
            return True
        return False

    def _head(self, slot: int) -> tuple[int, int, int, int, bytes]:
        state, seq, request_len, answer_len, token = _HEAD.unpack_from(self._mem, slot * _HEADER)
        return state, seq, request_len, answer_len, token

    def _answer_bytes(self, slot: int, length: int) -> bytes:
        if length == _SPILLED:
            return self._spill(slot).read_bytes()
        return os.pread(self._fd, length, _HEADERS + slot * _BODY + _REQUEST_ROOM)

    def _decode_answers(self, ops: Sequence[Any], body: bytes) -> list[Any]:
        answers = marshal.loads(body)
        return [
            _decode_outcome(self._names[op.many], answer)
            for op, answer in zip(ops, answers, strict=True)
        ]

    def _spill(self, slot: int) -> pathlib.Path:
        return self._path.with_name(f"{self._path.name}-{slot}")

    def _owned(self, slot: int) -> bool:
        """Whether a live process owns ``slot`` (holds the OFD lock on its byte)."""
        probe = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, _range_lock(fcntl.F_WRLCK, slot))
        kind: int = struct.unpack("hhqqixxxx", probe)[0]
        return kind != fcntl.F_UNLCK

    def _slot_lock(self, slot: int) -> bool:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _range_lock(fcntl.F_WRLCK, SLOTS + slot))
        except OSError:
            return False
        return True

    def _slot_lock_wait(self, slot: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _range_lock(fcntl.F_WRLCK, SLOTS + slot))

    def _slot_unlock(self, slot: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _range_lock(fcntl.F_UNLCK, SLOTS + slot))


def wake_path(board: pathlib.Path, slot: int) -> pathlib.Path:
    """Where ``slot``'s wake pipe is, beside ``board``."""
    return board.with_name(f"{board.name}{WAKE_SUFFIX}{slot}")


def _others_posted(states: tuple[int, ...], own: int) -> bool:
    """Whether ``states`` (a glance at the board) has a posted slot other than ``own``."""
    return bool(states.count(POSTED) > (states[own] == POSTED))


def _request_of(
    kind: str, key: tuple[Any, ...], fields: tuple[Any, ...], many: Callable[..., Any]
) -> _write_queue.Grouped[Any]:
    """A posted claim or finish, as the poster's own `asyncplane._backend.Writes` made it."""
    from asyncplane import _backend

    if kind == "claim":
        return _write_queue.Grouped(key, _backend.ClaimOp(*fields), many)
    return _backend.finish_request(_backend.FinishOp(*fields), many)


def _encode_outcome(outcome: Any) -> tuple[Any, ...]:
    if isinstance(outcome, _write_queue.Raised):
        error = outcome.error
        if isinstance(error, _errors.AsyncplaneError):
            reduced: tuple[Any, ...] = error.__reduce__()  # type: ignore[assignment]
            rebuild, args = reduced[0], reduced[1]
            try:
                marshal.dumps(args)
            except ValueError:  # arguments marshal cannot carry: the message alone
                return ("e", "StorageError", (str(error),), _encode_cause(error))
            return ("e", rebuild.__name__, tuple(args), _encode_cause(error))
        return ("e", "StorageError", (f"the round failed in the process that ran it: {error!r}",))
    if isinstance(outcome, list):  # a claim's rows
        return ("v", [tuple(row) for row in outcome])
    return ("v", outcome)


def _decode_outcome(kind: str, answer: tuple[Any, ...]) -> Any:
    if answer[0] == "e":
        name = answer[1]
        rebuild = getattr(_errors, name, None)
        known = name.startswith("_rebuild_") or (
            isinstance(rebuild, type) and issubclass(rebuild, _errors.AsyncplaneError)
        )
        if rebuild is None or not known:
            return _write_queue.Raised(_errors.StorageError(f"an unknown error came back: {name}"))
        error = rebuild(*answer[2])
        error.__cause__ = _decode_cause(answer[3] if len(answer) > 3 else None)
        return _write_queue.Raised(error)
    if kind == "claim":
        from asyncplane import _backend

        return [_backend.ClaimRow(*row) for row in answer[1]]
    return answer[1]


def _encode_cause(error: BaseException) -> tuple[str, str, int | None, str | None] | None:
    """The driver's error under ``error`` (its `__cause__`), to cross to the process that
    asked: its sqlite3 class's name, its message, its SQLite code and code's name."""
    cause = error.__cause__
    if cause is None or type(cause).__module__ != "sqlite3":
        return None
    code = getattr(cause, "sqlite_errorcode", None)
    code_name = getattr(cause, "sqlite_errorname", None)
    return (
        type(cause).__name__,
        str(cause),
        code if isinstance(code, int) else None,
        code_name if isinstance(code_name, str) else None,
    )


def _decode_cause(cause: Any) -> BaseException | None:
    """The driver's error `_encode_cause` sent, as the sqlite3 error it was (so that a
    refusal served by another process's round carries it as its own would)."""
    if cause is None:
        return None
    kind = getattr(sqlite3, cause[0], None)
    if not (isinstance(kind, type) and issubclass(kind, sqlite3.Error)):
        return None
    rebuilt = kind(cause[1])
    if cause[2] is not None and cause[3] is not None:  # Python 3.11 on: SQLite's code
        # (instance attributes, as sqlite3 sets them; typeshed's 3.10 has none)
        rebuilt.__dict__.update(sqlite_errorcode=cause[2], sqlite_errorname=cause[3])
    return rebuilt


def _a_board(head: bytes) -> bool:
    """Whether a file that begins with ``head`` (up to `_HEADERS` bytes) may be used as a
    board: a new one (empty), or one whose every slot's state word is a state. A file of
    another kind that happens to have a board's name (a store named ``X-combine`` beside
    the store ``X``) fails this at its first word, and is never written to."""
    if not head:
        return True
    if len(head) != _HEADERS:
        return False
    words = struct.unpack_from(f"={SLOTS * _HEADER // 4}I", head)
    return all(words[slot * _HEADER // 4] <= ANSWERED for slot in range(SLOTS))


def open_board(
    path: pathlib.Path,
    kinds: Mapping[str, Callable[..., Any]],
    lock: WriteLock,
) -> Board | None:
    """A slot on ``path``'s board, or None where combining cannot be had (no slot free
    either). ``lock`` is the writers' lock (`asyncplane._write_lock.WriteLock`), tried to
    clear a slot a dead predecessor left taken (see `Board._settle_in`)."""
    if sys.platform != "linux" or os.environ.get(DISABLE) == "1":
        return None
    board_path = path.with_name(path.name + SUFFIX)
    try:
        fd = _write_lock.open_companion(board_path, path)
    except OSError as exc:
        _log.debug("no combining board for %s (%s)", path, exc)
        return None
    try:
        if not _a_board(os.pread(fd, _HEADERS, 0)):
            _log.warning(
                "%s is not a combining board (another store's file?): left alone; this "
                "process's writers queue for their own rounds", board_path,
            )  # fmt: skip
            os.close(fd)
            return None
        os.posix_fallocate(fd, 0, _HEADERS)  # the mapped page: never a SIGBUS
        board = Board(board_path, fd, -1, kinds)
    except (OSError, AttributeError) as exc:  # no OFD locks, no futex, no mapping
        _log.debug("no combining board for %s (%s)", path, exc)
        os.close(fd)
        return None
    try:
        device, inode = lock.identity
    except OSError as exc:
        _log.debug("no combining board for %s (%s)", path, exc)
        board.close()
        return None
    board.queue = (device * 1_000_003 ^ inode) & 0xFFFFFFFFFFFFFFFF
    if board._settle_in(lock):
        board.open_wake()
        return board
    _log.debug("no combining board for %s: every slot is taken", path)
    board.close()
    return None
