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
The try runs on a worker thread, so even opening the file never blocks the event loop;
releasing is two non-blocking system calls and happens synchronously, so no cancellation
can skip it.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import sys
import types

import anyio.to_thread

from asyncplane import _errors

__all__ = ("DrainLock",)


class DrainLock:
    """An exclusive, non-blocking lock on ``path``, for use with ``async with``.

    ``async with DrainLock(path) as lock:`` never waits for the lock: ``lock.acquired``
    is True if this holder has it, False if someone else does. It is released when the
    block exits, however it exits.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = pathlib.Path(os.fspath(path))
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
        try:
            await anyio.to_thread.run_sync(self._try_lock)
        except BaseException:
            self.release()  # cancelled while the thread took it: give it straight back
            raise
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
        if fd is None:
            return
        try:
            _unlock(fd)
        finally:
            os.close(fd)

    def _try_lock(self) -> None:
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _errors.StorageError(f"cannot open the lock file {self._path}: {exc}") from exc
        try:
            if not _lock(fd):
                os.close(fd)
                return
            self._fd = fd
            # Who holds it, for a person looking at the file; never read back.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        except BaseException:
            if self._fd is None:
                os.close(fd)
            raise


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
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
