"""Retention: settled items leave the store only after they are safely in the archive.

`purge` takes settled (done, failed, cancelled) items whose last change is older than the
retention, a bounded chunk at a time. For each chunk it first appends the items, with their whole
history, to a JSONL archive and fsyncs it; only then does it delete them (each item
before its events, in one short transaction). A crash between the two can leave an item
both in the store and in the archive (the next purge archives it again: the archive may
hold duplicates), but never deletes an item that is not in the archive. Ready, deferred,
claimed and offloaded items are never purged.

The archive rotates: once it has grown past ``archive_max_bytes`` it is renamed with a
``.1`` suffix (replacing an older ``.1``) and a new one is started, so at most two
generations exist. A purge never replaces a ``.1`` made since it began (by itself, or by
another purge running beside it), which no one could have moved aside yet: where its
next chunk would, it stops there and says so (``archive_full``); the items left stay in
the store for the next purge. Its own rotation it remembers; another's it tells by the
``.1``'s modification time, which a rotation stamps, against the moment the purge began
as the same file system stamped it (on the archive's lock file, before its first read:
a purge that stamped only once it had the lock took a ``.1`` another made while it read
and waited for one made before it began), so neither clock steps here nor a file
server's clock matter.

Appends and rotation happen under an exclusive lock on ``<archive>.lock``, on a worker
thread, so two purgers never interleave lines and the event loop never waits for the
disk. A purge cancelled while it waits for the lock (another purge's, or an operator's
``flock`` while moving the ``.1`` aside) stops waiting, having written nothing; once it
has the lock, its append runs to its end.

Each archive line is one JSON object: ``{"archived_at": ..., "item": {...},
"events": [...]}``, with the item and its events much as `ControlStore.item` and
`ControlStore.events` give them: times as ISO 8601 strings, and without the fields that
are always empty on a settled item (lease_expires_at, due_at) or that the line already
says (each event's item_id). (offload_handle is there: an item cancelled while offloaded
keeps its handle, which names an external batch an operator may still have to stop.)
A purge killed while writing can leave a torn last line; the next append, under the
lock, cuts it off first (its chunk was never deleted: its items are archived again), so
every line but a torn last one parses.

Two purges may read the same items. Under the archive's lock, before it appends, a purge
looks again at the items it read and leaves out those that no longer stand as it read them
(another purge archived and deleted them, or they were requeued): an older record never
follows a newer one of the same item, so "the last line of an item wins" holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import errno
import json
import logging
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from asyncplane import _backend, _clock, _errors, _models, _tasks

if TYPE_CHECKING:
    import pathlib

__all__ = ("PurgeSummary", "default_archive_path", "purge")

_log = logging.getLogger("asyncplane.retention")


@dataclasses.dataclass(frozen=True)
class PurgeSummary:
    """What one purge did.

    Attributes:
        purged: Items archived and deleted.
        chunks: Transactions it took (each at most ``chunk`` items).
        archive_path: The archive the items were appended to.
        archive_full: It stopped where its next chunk would have rotated the archive
            over a ``.1`` made since it began (by itself, or a purge beside it): move
            that aside (or give a larger ``archive_max_mb``) and purge again for the rest.
    """

    purged: int
    chunks: int
    archive_path: pathlib.Path
    archive_full: bool = False


class _ArchiveFull(Exception):
    """The archive is due to rotate over a ``.1`` made since the purge began (nothing
    was written)."""


class _Rotation:
    """One purge's record of the archive's rotations, kept by its locked sections. (A
    plain class: a dataclass compiles its methods as `import asyncplane` makes it.)"""

    __slots__ = ("began", "rotated")

    def __init__(self, began: float | None = None, rotated: bool = False) -> None:
        #: When the purge began, as the archive's file system stamps times (None: not yet).
        self.began = began
        #: Whether this purge has rotated the archive.
        self.rotated = rotated


def default_archive_path(database: pathlib.Path) -> pathlib.Path:
    """The archive beside the database: ``<database>.archive.jsonl``."""
    return database.with_name(database.name + ".archive.jsonl")


async def purge(
    backend: _backend.Backend,
    clock: _clock.Clock,
    retention_seconds: float,
    *,
    chunk: int,
    archive_path: pathlib.Path,
    archive_max_bytes: int,
    max_chunks: int | None = None,
    progress: Callable[[int], None] | None = None,
    _after_archive: Callable[[], Awaitable[None]] | None = None,
) -> PurgeSummary:
    """Archive, then delete, settled items older than ``retention_seconds``."""
    backend.writable()  # a store that cannot delete must not append to the archive either
    cutoff = clock.now() - retention_seconds
    rotation = _Rotation(began=await _began(archive_path))
    purged = chunks = 0
    after = _backend.PURGE_START
    full = False
    while max_chunks is None or chunks < max_chunks:
        found = await backend.purge_candidates(cutoff, chunk, after)
        if not found:
            break
        try:
            archived = await _archived(
                backend, archive_path, found, archive_max_bytes, rotation=rotation
            )
        except _ArchiveFull:
            full = True
            _log.warning(
                "asyncplane: the archive %s is due to rotate again, and its %s.1 was made "
                "since this purge began: stopped there (%d items purged), so as not to "
                "replace it; move it aside, or give a larger archive_max_mb, and purge again",
                archive_path, archive_path.name, purged,
            )  # fmt: skip
            break
        except OSError as exc:
            raise _errors.ArchiveError(
                f"cannot append to the archive {archive_path}: {exc}; nothing of this chunk "
                f"was deleted ({purged} items of chunks before were)"
            ) from exc
        if _after_archive is not None:  # a test stands here to kill the process
            await _after_archive()
        # Only as archived: an item requeued and settled again meanwhile stays, its newer
        # history not in the archive yet.
        deleted = await backend.purge_items(archived) if archived else 0
        purged += deleted
        chunks += 1
        if progress is not None:
            progress(purged)
        if len(found) < chunk:
            break
        # The next chunk starts past this one: items it archived but could not delete
        # (held by another transaction, which PostgreSQL's delete passes over) are left to
        # the next purge, not read and archived again and again by this one.
        last = found[-1][0]
        after = (last.updated_at, last.item_id)
    if purged:  # every purge's, the drain loop's and a call's (a cron job's) alike
        _log.info("purged %d settled item(s) into the archive", purged)
    return PurgeSummary(purged, chunks, archive_path, full)


async def _archived(
    backend: _backend.Backend,
    path: pathlib.Path,
    found: _backend.Histories,
    max_bytes: int,
    while_locked: Callable[[], Coroutine[Any, Any, None]] | None = None,
    *,
    rotation: _Rotation | None = None,
) -> tuple[_backend.Archived, ...]:
    """Append the items of ``found`` that still stand as read to the archive, under its
    lock; return them as archived (what the purge may delete). `_ArchiveFull`, having
    written nothing, where the archive is due to rotate over a ``.1`` made since the
    purge of ``rotation`` began.

    The locked section runs to its end whatever cancellation comes (`to_the_end`), and
    only then is the lock let go (`_locked_section`): its worker thread cannot be
    stopped, and a lock let go under a thread still appending would let another purge
    write, or cut a "torn" end, beside it. (``while_locked``: a test's stop inside the
    section.)"""
    given_up = threading.Event()  # set by a cancel: a wait for the lock stops
    archived, cancelled = await _tasks.to_the_end(
        _locked_section(backend, path, found, max_bytes, while_locked, rotation, given_up),
        "asyncplane-purge-archive",
        on_cancel=given_up.set,
    )
    if cancelled:
        raise asyncio.CancelledError  # archived (or not, if it gave up), never deleted
    return archived


async def _began(path: pathlib.Path) -> float | None:
    """The moment a purge begins, as the archive's file system stamps it: on the lock
    file, or where there is none yet on a file made and removed at once (a purge that
    archives nothing leaves nothing behind, not a lock file of its user's that the
    fleet's user may not open). None where neither can be had: the first locked section
    stamps it then, or says why not."""
    import anyio.to_thread

    def stamp() -> float | None:
        with contextlib.suppress(OSError):
            fd = os.open(_lock_path(path), os.O_RDWR)
            try:
                return _stamped_now(fd)
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):
            fd, name = tempfile.mkstemp(prefix=".asyncplane-began-", dir=path.parent)
            try:
                return os.fstat(fd).st_mtime  # made just now: stamped now
            finally:
                os.close(fd)
                os.unlink(name)
        return None

    return await anyio.to_thread.run_sync(stamp)


def _lock_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".lock")


async def _locked_section(
    backend: _backend.Backend,
    path: pathlib.Path,
    found: _backend.Histories,
    max_bytes: int,
    while_locked: Callable[[], Coroutine[Any, Any, None]] | None,
    rotation: _Rotation | None,
    given_up: threading.Event,
) -> tuple[_backend.Archived, ...]:
    """The lock, the look again and the append, all held by one worker thread, which
    alone closes the lock's descriptor once it has it (`_locked`): however the awaiting
    task ends (a cancellation, the event loop's own shutdown), the lock goes only once
    that thread is done with the archive. The look is the store's, called back on the
    event loop. Nothing, once ``given_up`` is set before the lock was had."""
    import anyio.from_thread  # on first use, as a store's connections do
    import anyio.to_thread

    read = tuple(_backend.Archived(item.item_id, item.fence, item.updated_at) for item, _ in found)

    def section() -> tuple[_backend.Archived, ...]:
        fd = _locked(_lock_path(path), given_up)
        if fd is None:
            return ()
        try:
            if rotation is not None and rotation.began is None:
                rotation.began = _stamped_now(fd)
            standing = anyio.from_thread.run(backend.standing_as_archived, read)
            if while_locked is not None:
                anyio.from_thread.run(while_locked)
            kept = [history for history in found if history[0].item_id in standing]
            if kept:  # the lines (JSON of whole histories) are built here too, off the loop
                _archive(path, kept, max_bytes, rotation)
            return tuple(item for item in read if item.item_id in standing)
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    return await anyio.to_thread.run_sync(section)


def _iso(value: float | None) -> str | float | None:
    """A time as ISO 8601; as stored if no datetime can hold it (the archive takes every
    settled item, whatever it holds, as `_json` does)."""
    if value is None:
        return None
    try:
        return _models.from_timestamp(value).isoformat()
    except _errors.StorageError:
        return value


def _json(text: str) -> Any:
    """Stored JSON, decoded; kept as its text if this process cannot decode it (written
    before today's limits): the archive must take every settled item, whatever it holds."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _undecoded(text)


def _undecoded(text: str) -> Any:
    """Stored JSON kept as its text (`_json`'s fallback)."""
    return {"undecoded_json": text}


def _archive_line(item: _backend.ItemRow, events: list[_backend.EventRow]) -> bytes:
    try:
        return _archive_line_of(item, events, _json)
    except RecursionError:
        # Nested nearly as deep as this process can decode (written by another program:
        # the store refuses past MAX_JSON_DEPTH): decoded, it is too deep to encode
        # again under the line's own levels. Kept as its text, as undecodable JSON is.
        return _archive_line_of(item, events, _undecoded)


def _archive_line_of(
    item: _backend.ItemRow, events: list[_backend.EventRow], decode: Callable[[str], Any]
) -> bytes:
    record: dict[str, Any] = {
        "archived_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "item": {
            "item_id": item.item_id,
            "project_id": item.project_id,
            "state": item.state,
            "payload": decode(item.payload_json),
            "fence": item.fence,
            "attempts": item.attempts,
            "owner": item.owner,
            "created_at": _iso(item.created_at),
            "updated_at": _iso(item.updated_at),
            "priority": item.priority,
            "service_class": item.service_class,
            "sla": _iso(item.sla),
            "fingerprint": item.fingerprint,
            "max_attempts": item.max_attempts,
            "result": None if item.result_json is None else decode(item.result_json),
            "error": item.error,
            "offload_handle": item.offload_handle,
        },
        "events": [
            {
                "event_id": event.event_id,
                "event_type": event.event_type,
                "fence": event.fence,
                "owner": event.owner,
                "actor_id": event.actor_id,
                "at": _iso(event.at),
                "detail": None if event.detail_json is None else decode(event.detail_json),
            }
            for event in events
        ],
    }
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        return line.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate, stored escaped (``"\\ud800"``: valid JSON, not UTF-8 once
        # decoded; written by another program or an older release). Escaped again, as
        # the store held it, so that one such item stops no purge.
        return (json.dumps(record, separators=(",", ":")) + "\n").encode("ascii")


def _archive(
    path: pathlib.Path,
    found: list[tuple[_backend.ItemRow, list[_backend.EventRow]]],
    max_bytes: int,
    rotation: _Rotation | None = None,
) -> None:
    """On a worker thread, under the archive's lock: rotate if due (`_ArchiveFull`
    instead, if the ``.1`` it would replace was made since the purge of ``rotation``
    began), cut off a torn last line, append the lines of ``found`` and fsync."""
    lines = [_archive_line(item, events) for item, events in found]
    created = False
    with contextlib.suppress(FileNotFoundError):
        _check_is_archive(path)
        _cut_torn_end(path)
        if path.stat().st_size >= max_bytes:
            older = path.with_name(path.name + ".1")
            if rotation is not None and (rotation.rotated or _made_since(older, rotation)):
                raise _ArchiveFull(path)
            os.replace(path, older)
            os.utime(older)  # stamped with its rotation (`_made_since`)
            if rotation is not None:
                rotation.rotated = True
            created = True
    created = created or not path.exists()
    data = memoryview(b"".join(lines))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError:
            # A disk filled (or failed) mid-append: take back what went in, as the chunk
            # is not deleted and its next purge writes it again; else those lines would
            # be there twice. (Cutting needs no room; a crash here leaves a torn line,
            # which the next purge cuts off.)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
    if created:
        _fsync_directory(path.parent)  # the new name must survive a crash too


def _stamped_now(fd: int) -> float:
    """The time now as the file system stamps it: the lock file's, touched (a file
    server's clock may not be this host's, and this host's may step)."""
    try:
        os.utime(fd)
        return os.fstat(fd).st_mtime
    except (OSError, NotImplementedError):  # no times on descriptors here: this clock
        return time.time()


def _made_since(older: pathlib.Path, rotation: _Rotation) -> bool:
    """Whether the ``.1`` there was made (rotated to, and so stamped) since the purge
    began; one stamped in the same tick of the file system's coarse clock counts."""
    try:
        return rotation.began is not None and older.stat().st_mtime >= rotation.began
    except FileNotFoundError:
        return False  # none, or moved aside: nothing to lose


class _NotAnArchive(OSError):
    """The archive's path names a file that is not an archive (the store itself, say)."""


#: How every archive line begins (`_archive_line`): a file that does not is no archive.
_LINE_START = b'{"archived_at"'


def _check_is_archive(path: pathlib.Path) -> None:
    """`_NotAnArchive` unless the file there is empty or begins as an archive does (or
    as its first line torn short would): the purge cuts a file's tail, and rotates it
    away, and neither may happen to a file that is not its own (the store's database,
    given by mistake, would be damaged). Only a regular file: opened, a FIFO (a
    store's ``-combine-wake-N`` beside it, say) would block the purge, its lock held,
    until something wrote to it."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise _NotAnArchive(f"{path} is not a regular file: an archive is one; name another file")
    with open(path, "rb") as archive:
        head = archive.read(len(_LINE_START))
    if head != _LINE_START[: len(head)]:
        raise _NotAnArchive(
            f"{path} is not an asyncplane archive (it does not begin with an archived "
            "item): nothing is cut from it, appended to it or rotated; name another file"
        )


def _cut_torn_end(path: pathlib.Path) -> None:
    """Cut the archive back to its last newline: what follows it is the torn line of a
    purge killed while writing (the lock is held: no purge writes now), whose chunk was
    never deleted. Cut, it can neither end inside a character nor join the next line."""
    with open(path, "r+b") as archive:
        end = archive.seek(0, os.SEEK_END)
        at = end
        while at > 0:
            step = min(at, _TAIL_STEP)
            archive.seek(at - step)
            block = archive.read(step)
            newline = block.rfind(b"\n")
            if newline != -1:
                at = at - step + newline + 1
                break
            at -= step
        if at == end:
            return
        archive.truncate(at)
        archive.flush()
        os.fsync(archive.fileno())


#: How much of the archive's end `_cut_torn_end` reads at a time, looking for a newline.
_TAIL_STEP = 1 << 16


#: How often a purge waiting for the archive's lock looks whether it was given up.
_GIVEN_UP_LOOK_SECONDS = 0.05


def _locked(path: pathlib.Path, given_up: threading.Event) -> int | None:
    """A descriptor of the lock file at ``path`` holding its lock (the caller closes it,
    which lets the lock go); None, without it, once ``given_up`` is set first.

    The lock is tried at once; when another holds it, a daemon thread of its own waits
    for it in the kernel (woken as it is let go, as a purge waiting its turn must be:
    tries now and then lost to one taking it again at once), while this one looks
    whether the wait was given up. A wait given up leaves that thread to let the lock go
    as soon as it has it; it holds up nothing, not even the interpreter's exit."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if _take_lock(fd, wait=False):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    waiter = _LockWaiter(path)
    waiter.start()
    while not waiter.done.wait(_GIVEN_UP_LOOK_SECONDS):
        if given_up.is_set() and waiter.abandon():
            return None
    return waiter.taken()


class _LockWaiter(threading.Thread):
    """Waits in the kernel for the archive's lock, on a descriptor of its own, and hands
    it over; or, abandoned first, lets it go as soon as it has it."""

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(name="asyncplane-archive-lock", daemon=True)
        self._path = path
        self._mutex = threading.Lock()
        self._fd: int | None = None
        self._error: OSError | None = None
        self._abandoned = False
        self.done = threading.Event()

    def run(self) -> None:
        fd: int | None = None
        error: OSError | None = None
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            _take_lock(fd, wait=True)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
            fd, error = None, exc
        # What it has, handed over or let go under the mutex, as abandon() decides under
        # it: never a lock kept by a descriptor nobody has (done set outside the mutex,
        # an abandon between the two took the wait for given up, and the lock was kept).
        with self._mutex:
            if self._abandoned:
                if fd is not None:
                    os.close(fd)
                return
            self._fd, self._error = fd, error
            self.done.set()

    def abandon(self) -> bool:
        """Give the wait up, unless the lock (or an error) came first; whether it did."""
        with self._mutex:
            if self.done.is_set():
                return False
            self._abandoned = True
            return True

    def taken(self) -> int:
        """The descriptor holding the lock (once ``done``), or the error its wait met."""
        if self._error is not None:
            raise self._error
        assert self._fd is not None
        return self._fd


def _take_lock(fd: int, *, wait: bool) -> bool:
    """Take the archive's lock on ``fd``: waiting for it, or not (False: another has it)."""
    if sys.platform == "win32":  # pragma: no cover - Windows only
        import msvcrt

        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK if wait else msvcrt.LK_NBLCK, 1)
            except OSError as exc:  # held by another (LK_LOCK gives up after 10 s)
                if exc.errno not in (errno.EACCES, errno.EDEADLOCK):
                    raise
                if not wait:
                    return False
                continue
            return True
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _fsync_directory(directory: pathlib.Path) -> None:
    if sys.platform == "win32":  # pragma: no cover - directories cannot be fsynced there
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
