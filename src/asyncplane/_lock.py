"""DrainLock: one drainer at a time, per lock file, across processes and tasks.

The lock is an exclusive, non-blocking lock on a small file, with flock semantics on
POSIX: it belongs to the open file description asyncplane made for it, so it does not
vanish when some other part of the process opens and closes the same file (POSIX record
locks, fcntl/lockf, would: closing any descriptor of a file drops all of a process's
record locks on it). Two DrainLocks on one file conflict even inside one process, so a
second drain task is refused just as a second process is. The operating system drops the
lock when its holder dies, so a killed drainer never leaves a stale lock behind.

On Windows the same guarantees come from msvcrt.locking on the file's first byte, which
is also tied to the handle.

Taking the lock never waits: it is tried once (LOCK_NB), and `acquired` says how it went.
The try runs on a worker thread, so even opening the file never blocks the event loop.
That thread may outlive the task that started it (a cancellation does not stop a thread):
the try and the task meet under a mutex, and whichever comes second, the thread with a
descriptor or the cancelled task giving up, closes the descriptor. So a lock taken for a
task that was cancelled meanwhile is given straight back, never left on a descriptor
nothing will close. Releasing is two non-blocking system calls and happens synchronously,
so no cancellation can skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncplane import _errors, _tasks, _validate

if TYPE_CHECKING:
    import pathlib

__all__ = ("DrainLock", "Guard")


class Guard:
    """What a single-drainer guard says: whether this drainer has it (the guard is truthy
    then), and, while the drain runs, whether it still holds (`lost` says why not: a
    PostgreSQL session ended by a server restart, say). A drain whose guard is lost stops,
    since another drainer may now have it."""

    __slots__ = ("_listeners", "acquired", "lost")

    def __init__(self, acquired: bool) -> None:
        self.acquired = acquired
        self.lost: str | None = None
        self._listeners: list[Callable[[], object]] = []

    def __bool__(self) -> bool:
        return self.acquired

    def lose(self, why: str) -> None:
        """The guard no longer holds (``why``): say so to whoever listens, once."""
        if self.lost is None:
            self.lost = why
            for listener in list(self._listeners):
                listener()

    def when_lost(self, listener: Callable[[], object]) -> Callable[[], None]:
        """Call ``listener()`` when the guard is lost (a runtime stops its running items
        then, not only its next claim), at once if it is lost already; return what stops
        that."""
        if self.lost is not None:
            listener()
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def __repr__(self) -> str:
        return f"Guard(acquired={self.acquired}, lost={self.lost!r})"


class DrainLock:
    """An exclusive, non-blocking lock on ``path``, for use with ``async with``.

    ``async with DrainLock(path) as lock:`` never waits for the lock: ``lock.acquired``
    is True if this holder has it, False if someone else does. It is released when the
    block exits, however it exits.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = _validate.resolved_path(path, "path")
        self._fd: int | None = None

    @property
    def path(self) -> pathlib.Path:
        """The lock file."""
        return self._path

    @property
    def acquired(self) -> bool:
        """True while this holder has the lock."""
        return self._fd is not None

    async def __aenter__(self) -> DrainLock:
        if self._fd is not None:
            raise RuntimeError("this DrainLock is held already; release it before re-entering")
        import anyio.to_thread  # on first use, as a store's connections do

        attempt = _Attempt(self._path)
        try:
            # Wait for the thread even when cancelled (a moment: two non-blocking calls),
            # so a lock it took for this task is released before the cancellation goes on.
            _, cancelled = await _tasks.to_the_end(
                anyio.to_thread.run_sync(attempt.run), "asyncplane-drain-lock"
            )
        except BaseException:
            attempt.abandon()  # whenever the thread ends, the lock goes back
            raise
        self._fd = attempt.take()
        if cancelled:
            self.release()
            raise asyncio.CancelledError
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        """Release the lock if held (non-blocking; safe to call twice)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            _give_back(fd)


class _Attempt:
    """One try for the lock, shared by the worker thread that makes it and the task that
    waits for it; whichever of the two comes second gives a lock nobody wants back."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = path
        self._mutex = threading.Lock()
        self._fd: int | None = None
        self._abandoned = False

    def run(self) -> None:
        """On the worker thread: open the file and try the lock once."""
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _errors.StorageError(f"cannot open the lock file {self._path}: {exc}") from exc
        try:
            if not _lock(fd):
                os.close(fd)
                return
            _check_is_lock_file(fd, self._path)
            # Who holds it, for a person looking at the file; never read back.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        except BaseException:
            _give_back(fd)
            raise
        with self._mutex:
            if not self._abandoned:
                self._fd = fd
                return
        _give_back(fd)  # the task that asked gave up while this thread took it

    def take(self) -> int | None:
        """The descriptor holding the lock (None: someone else has it); now the caller's."""
        with self._mutex:
            fd, self._fd = self._fd, None
            self._abandoned = True
        return fd

    def abandon(self) -> None:
        """Give up: release what the thread took, now or when it ends."""
        fd = self.take()
        if fd is not None:
            _give_back(fd)


#: What a lock file holds: nothing yet, or its last holder's line (`_Attempt.run`).
_HOLDER_LINE = re.compile(rb"[^\n]{0,300} pid \d{1,10}\n")


def _check_is_lock_file(fd: int, path: pathlib.Path) -> None:
    """InvalidInput unless the file is empty or holds a holder's line: the line is
    written over the file, and a lock_path naming another file (a database, say) wiped
    it."""
    os.lseek(fd, 0, os.SEEK_SET)
    head = os.read(fd, 512)
    os.lseek(fd, 0, os.SEEK_SET)  # the holder's line is written from the start
    if head and not _HOLDER_LINE.fullmatch(head):
        raise _errors.InvalidInput(
            f"the lock file {path} holds something else ({_validate.shown(head[:40])}), "
            "which taking the lock would write over: name a file of the lock's own"
        )


def _give_back(fd: int) -> None:
    try:
        _unlock(fd)
    finally:
        os.close(fd)


if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _lock(fd: int) -> bool:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

    def _unlock(fd: int) -> None:
        with contextlib.suppress(OSError):
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:  # ENOLCK on a network filesystem, say
            raise _errors.StorageError(f"cannot lock the drain lock file: {exc}") from exc
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
