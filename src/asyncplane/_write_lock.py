"""The queue in front of SQLite's write lock, shared by every process that opens a store.

SQLite makes a writer that finds the write lock taken wait in its busy handler, which
sleeps on a back-off schedule (1, 2, 5, 10, ... 100 ms) and keeps no queue. A writer
asleep for 100 ms misses every release during its sleep, so with sixteen processes
contending the file sat free much of the time while one claim waited seconds for it
(measured: the longest single wait 0.8-2.5 s, raw sqlite3 and asyncplane alike).

So asyncplane's writers queue first, on an advisory lock of their own: ``flock`` on a
small file beside the database, ``<database>-writers``, taken on the write connection's
thread just before ``BEGIN IMMEDIATE`` and let go after the round's ``COMMIT`` or
``ROLLBACK``. A waiter sleeps in the kernel and wakes when the holder lets go, so the
write lock passes from round to round without idle gaps; ``BEGIN IMMEDIATE`` then finds
it free unless a writer that is not asyncplane's holds it (the ``sqlite3`` shell, say),
and for those SQLite's busy handler waits as before. Nothing here is needed for
correctness: SQLite's own lock still decides who writes. The queue only removes the
sleeping, and with it the unfairness.

* **Crashes.** The kernel lets go of a process's flock when the process ends, however it
  ends, so a SIGKILL never leaves the queue stuck.
* **A bound on what callers wait.** A blocking flock cannot time out, and waiting for it
  on a helper thread instead costs a second thread wake-up on every contended round
  (measured: 0.77x the throughput of waiting on the connection's thread). So the
  connection's thread blocks in flock itself and the event loop keeps the time: a round
  whose `Turn` has not come within the store's ``busy_timeout`` is given up
  (`Turn.give_up`), its callers and every write queued behind it hear DatabaseLocked, as
  SQLite's own wait would have told them, and when the lock does come the thread lets it
  go again without writing. The thread itself waits until the holder lets go or ends:
  behind a holder that is frozen (SIGSTOP, a debugger) rather than dead, closing the
  store, and the process's exit, wait for it too.
* **Where it cannot be had** (no ``fcntl``: Windows; a directory the process may not
  create the file in; a filesystem that refuses flock, tried once at open, or later),
  there is no queue and SQLite's busy handler does all the waiting.

The file is never removed: removing a lock file that others may hold open would let two
writers hold "the" lock at once. It stays empty.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys
import threading
from collections.abc import Callable

__all__ = ("SUFFIX", "Turn", "WriteLock", "open_companion", "open_write_lock")

if sys.platform != "win32":  # Windows has no flock: no queue, SQLite's busy handler alone
    import fcntl

_log = logging.getLogger("asyncplane.writer")

#: The lock file's name is the database's with this added.
SUFFIX = "-writers"


class WriteLock:
    """One process's place in the queue for a database's write lock (one per writer).

    `acquire` and `release` run on the write connection's thread; `close` may come from
    the event loop while that thread still waits, and then the thread closes the file.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._mutex = threading.Lock()
        self._busy = False  # the connection's thread waits for the lock or holds it
        self._closed = False
        #: True while the connection's thread sleeps in flock (read by tests).
        self.waiting = False
        #: Set when flock failed (a filesystem that refuses it after all): no queue since.
        self.broken = False

    def acquire(self) -> bool:
        """Take the lock: at once if it is free, else after the holders before us.
        False when there is no queue to take (closed, or flock failed): the round goes
        on with SQLite's own lock alone."""
        with self._mutex:
            if self._closed or self.broken:
                return False
            self._busy = True
            self.waiting = True  # from here until flock returns
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # sleeps in the kernel while it is taken
        except OSError as exc:
            self._broke(exc)
            self._let_go()
            return False
        finally:
            self.waiting = False
        return True

    def try_acquire(self) -> bool | None:
        """Take the lock only if it is free now: whether it was taken; None when there
        is no queue to take (closed, or flock failed)."""
        with self._mutex:
            if self._closed or self.broken:
                return None
            self._busy = True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._let_go()
            return False
        except OSError as exc:
            self._broke(exc)
            self._let_go()
            return None
        return True

    def release(self) -> None:
        """Let go of the lock (the round has committed or rolled back, or was given up).
        Never raises: what the round saved stands whatever the unlock does."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError as exc:  # the filesystem lost its locks: no queue from now on
            self._broke(exc)
        finally:
            self._let_go()

    def _broke(self, exc: OSError) -> None:
        """flock failed (a filesystem that refuses it after all): no queue from now on."""
        _log.warning("the write-lock queue failed (%s): SQLite's busy handler waits", exc)
        with self._mutex:
            self.broken = True

    def _let_go(self) -> None:
        with self._mutex:
            self._busy = False
            if self._closed:  # closed while this thread waited or held it
                os.close(self._fd)

    @property
    def identity(self) -> tuple[int, int]:
        """Which file this queue is (device, inode): two processes share a queue only if
        they opened the same file, not merely the same name."""
        facts = os.fstat(self._fd)
        return facts.st_dev, facts.st_ino

    def close(self) -> None:
        """Close the file (the thread does it, if it is waiting for the lock or holds it)."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            if self._busy:
                return
        os.close(self._fd)


class Turn:
    """One round's wait for its turn at the lock, which the event loop may give up.

    The thread calls `begin` once it holds the lock: True if the round is still wanted.
    The loop calls `give_up` when the wait has lasted ``busy_timeout``: True if the
    round had not begun, so that it never will and its callers may be told so. A round
    posted for another process's holder to take (`asyncplane._combine`) is posted through
    `post`, so that giving it up takes the post back, or fails if a holder has it.
    """

    __slots__ = ("_mutex", "_retract", "_state")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._state = "waiting"
        self._retract: Callable[[], bool | None] | None = None

    def post(self, post: Callable[[], bool], retract: Callable[[], bool | None]) -> bool | None:
        """On the thread: ``post()`` the round unless it was given up (None); what
        ``post`` said. From then on, giving up the round first ``retract()``s it."""
        with self._mutex:
            if self._state == "given up":
                return None
            posted = post()
            if posted:
                self._retract = retract
            return posted

    @property
    def given_up(self) -> bool:
        """Whether the loop gave the round up."""
        return self._state == "given up"

    def begin(self) -> bool:
        """On the thread, the lock held: whether the round goes ahead."""
        with self._mutex:
            if self._state == "given up":
                return False
            self._state = "begun"
            return True

    def give_up(self, retract: Callable[[], bool | None] | None = None) -> bool | None:
        """On the loop: stop waiting, unless the round has begun; whether it stopped
        (None: its post could not be looked at this instant; ask again). ``retract``
        takes a post back in place of the one given to `post` (with the writers' lock
        held, say, when no slot lock is needed)."""
        with self._mutex:
            if self._state != "waiting":
                return False
            if self._retract is not None:
                retracted = (retract or self._retract)()
                if not retracted:
                    return retracted  # False: a holder elsewhere took it, it runs there
            self._state = "given up"
            return True


def open_companion(path: pathlib.Path, database: pathlib.Path) -> int:
    """Open, read and write, a file every process of ``database`` shares (the write
    queue, the combining board), making it if need be. One this process makes gets the
    database's own mode, as SQLite gives its -wal and -shm, whatever this process's umask:
    made 0600 under a umask of 077, it would shut out other users' processes that may
    write the database (they would run without the queue or the board, unsaid)."""
    try:
        mode = os.stat(database).st_mode & 0o666
    except OSError:
        mode = 0o644
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    for _ in range(3):
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            try:
                return os.open(path, flags)
            except FileNotFoundError:
                if os.path.islink(path):  # a link to nothing (its tmpfs emptied): make it
                    return os.open(path, flags | os.O_CREAT, mode)
                continue  # removed meanwhile: make it, then
        try:
            os.fchmod(fd, mode)  # the umask took bits the database has
        except OSError:
            pass  # a file system without modes: what it gives
        return fd
    raise OSError(f"{path} came and went while it was opened")


def open_write_lock(database: pathlib.Path) -> WriteLock | None:
    """The queue for ``database``'s write lock, or None where there can be none."""
    if sys.platform == "win32":
        return None
    path = database.with_name(database.name + SUFFIX)
    try:
        fd = open_companion(path, database)
    except OSError as exc:
        _log.debug("no write-lock queue for %s (%s): SQLite's busy handler waits", path, exc)
        return None
    try:  # a filesystem may open the file and still refuse flock (NFS without lockd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        pass  # another writer holds it right now: flock works
    except OSError as exc:
        os.close(fd)
        _log.debug("no write-lock queue for %s (%s): SQLite's busy handler waits", path, exc)
        return None
    return WriteLock(fd)
