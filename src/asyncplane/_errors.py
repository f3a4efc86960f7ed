"""The error hierarchy: one root for every error asyncplane raises on purpose.

Every exception asyncplane raises on purpose derives from `AsyncplaneError`. Errors from
a database driver never escape as themselves: each backend translates its driver's errors
once, at its boundary (`asyncplane._connection.translate` for sqlite3,
`asyncplane._postgres_writer.translate` for asyncpg), and raises the result `from` the
original, so the cause stays attached for debugging while callers catch one family.

Input errors are raised before anything is written and derive from `ValueError` or
`TypeError` as well, so code that already guards against those keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "ArchiveError",
    "AsyncplaneError",
    "ClaimAfterSettleFailed",
    "CommitOutcomeUnknown",
    "DatabaseLocked",
    "FenceRejected",
    "InvalidInput",
    "InvalidPayload",
    "InvalidType",
    "ItemCancelled",
    "MissingExtra",
    "NotAnAsyncplaneDatabase",
    "NotOnAsyncio",
    "NotRequeueable",
    "ProjectExists",
    "ReadOnlyStore",
    "SchemaVersionError",
    "ScopeDenied",
    "StorageError",
    "StoreClosed",
    "UnknownItem",
    "UnknownProject",
    "UnknownSchedule",
    "WaitTimeout",
)


class AsyncplaneError(Exception):
    """The root of every error asyncplane raises on purpose."""


class FenceRejected(AsyncplaneError):
    """The fence presented is not the item's current claim.

    Raised by renew(), finish(), retry(), park() and offload() when the item was taken
    over after its lease lapsed (a higher fence exists), or when it is not in a state that
    call can settle: finished already, never claimed, deferred, or (for renew, park and
    offload) offloaded. The caller's work must be discarded; someone else owns the item.

    Attributes:
        item_id: The item the call named.
        fence: The fence the caller presented.
        current_fence: The item's fence now (its latest claim's).
        state: The item's state now ("claimed" by someone else, "done", "ready", ...).
    """

    def __init__(
        self,
        item_id: int,
        fence: int,
        *,
        current_fence: int,
        state: str,
    ) -> None:
        self.item_id = item_id
        self.fence = fence
        self.current_fence = current_fence
        self.state = state
        if state == "claimed":
            why = f"the item is claimed at fence {current_fence}"
        else:
            why = f"the item is {state}, not claimed"
        super().__init__(f"item {item_id}: fence {fence} is not current ({why})")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild through a helper so the error pickles (and so
        # crosses process boundaries) intact.
        return (_rebuild_fence_rejected, (self.item_id, self.fence, self.current_fence, self.state))


class ItemCancelled(FenceRejected):
    """The item was cancelled (by an operator, or `ControlStore.cancel`) while this fence
    held it: the cancel raised its fence, so the holder's next renew(), finish(), retry(),
    park() or offload() is refused with this. Stop the work and discard it.

    Attributes:
        reason: The reason the cancel gave, or None.
    """

    def __init__(self, item_id: int, fence: int, *, current_fence: int, reason: str | None) -> None:
        super().__init__(item_id, fence, current_fence=current_fence, state="cancelled")
        self.reason = reason
        why = "" if reason is None else f": {reason}"
        self.args = (f"item {item_id} was cancelled{why} (fence {fence} is no longer current)",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_item_cancelled,
            (self.item_id, self.fence, self.current_fence, self.reason),
        )


class NotRequeueable(AsyncplaneError):
    """requeue() was asked of an item that is neither failed nor cancelled, or in none of
    the states its ``if_state`` named, or at another fence than its ``if_fence``; nothing
    changed.

    Attributes:
        item_id: The item named.
        state: Its state now.
        expected: The states ``if_state`` named (empty: none were).
        fence: Its fence now (None where not read).
        expected_fence: The fence ``if_fence`` named (None: none was).
    """

    def __init__(
        self,
        item_id: int,
        state: str,
        expected: tuple[str, ...] = (),
        fence: int | None = None,
        expected_fence: int | None = None,
    ) -> None:
        if expected and state in ("failed", "cancelled") and state not in expected:
            said = (
                f"item {item_id} is {state}, not {' or '.join(expected)} as expected: left as it is"
            )
        elif state in ("failed", "cancelled") and expected_fence not in (None, fence):
            said = (
                f"item {item_id} is {state} at fence {fence}, not at fence {expected_fence} as "
                "expected (a claim or a cancel raised it since): left as it is"
            )
        elif state in ("failed", "cancelled"):  # refused for no reason it was given
            said = f"item {item_id} is {state}: left as it is"
        else:
            said = f"item {item_id} is {state}: only a failed or cancelled item can be requeued"
        super().__init__(said)
        self.item_id = item_id
        self.state = state
        self.expected = expected
        self.fence = fence
        self.expected_fence = expected_fence

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            NotRequeueable,
            (self.item_id, self.state, self.expected, self.fence, self.expected_fence),
        )


class WaitTimeout(AsyncplaneError, TimeoutError):
    """wait() gave up: the item had not settled within the timeout (it may yet)."""


class ScopeDenied(AsyncplaneError):
    """The actor may not see or touch this project or item.

    The message is the same whether the target does not exist or belongs to a project
    the actor is not assigned to: a denial must not reveal which of the two it was.
    """


class UnknownProject(AsyncplaneError, LookupError):
    """No project has this id (raised to the control plane, which may know that)."""


class UnknownItem(AsyncplaneError, LookupError):
    """No item has this id (raised to the control plane, which may know that)."""


class ItemPurged(UnknownItem):
    """The item a `wait()` waited for settled, and retention purged it before the wait
    read its outcome (another store's purge, on SQLite between two looks): its outcome
    and history are in that purge's archive."""


class ProjectExists(AsyncplaneError, ValueError):
    """create_project() was given an id that is already taken."""


class InvalidInput(AsyncplaneError, ValueError):
    """An argument has the right type but a value asyncplane refuses; nothing was written."""


class InvalidPayload(InvalidInput):
    """A payload or result is not plain JSON, holds NaN or infinity, or is too big."""


class InvalidType(AsyncplaneError, TypeError):
    """An argument has the wrong type (an id that is not a str/int, say); nothing was written."""


class UnknownSchedule(AsyncplaneError, LookupError):
    """No schedule has this name."""


class MissingExtra(AsyncplaneError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the
    extra to install (``pip install 'asyncplane[cron]'``, say)."""


class StoreClosed(AsyncplaneError):
    """The store cannot serve this call where it is.

    Raised when a call waited on something that stopped before serving it: a read waiting
    for a read connection when the store was closed (writes queued at a close are served
    first), or a writer stopped by the event loop's shutdown; or when the store is used
    from a second event loop while the loop that opened it is still running. A store
    that was closed normally simply opens again on its next call.
    """


class NotOnAsyncio(AsyncplaneError, RuntimeError):
    """A store was used where no asyncio event loop runs (under trio, say).

    asyncplane runs on asyncio, anyio's asyncio backend included: its writer is an asyncio
    task, its connections asyncio's.
    """


class ReadOnlyStore(AsyncplaneError):
    """A write was asked of a store opened with ``read_only=True``; nothing was written."""


class ClaimAfterSettleFailed(AsyncplaneError):
    """`ControlStore.finish_and_claim` saved the settle, but the claim made with it
    failed; the claim's error is the ``__cause__`` (DatabaseLocked, say). The item is
    settled: do not settle it again; claim again (or stop) as that error says."""


class StorageError(AsyncplaneError):
    """The database failed underneath asyncplane; the driver's error is the ``__cause__``."""


class ArchiveError(StorageError):
    """The purge archive could not be written (a full disk, a missing directory, no
    permission); nothing of the chunk it was writing was deleted (chunks before it were,
    each once archived). The `OSError` is the ``__cause__``."""


class CommitOutcomeUnknown(StorageError):
    """The database failed at the commit itself, and whether the write was saved cannot
    be known yet: a crash now may or may not bring it back. Check before you write again
    (look the item up, or enqueue with a fingerprint, which dedup makes safe to repeat)."""


class DatabaseLocked(StorageError):
    """The write lock could not be had within the busy timeout."""


class NotAnAsyncplaneDatabase(StorageError):
    """The location is not an asyncplane store: another application's database or schema,
    not a database at all, not a regular file, a PostgreSQL schema that does not exist, or
    a PostgreSQL database whose encoding cannot hold every text (neither UTF8 nor
    SQL_ASCII)."""


class NotRun(StorageError):
    """Internal, never raised to a caller: a write sent on condition that another of its
    round be saved (a claim riding on its settle) was not run, that one refused; nothing
    of it was written (see `asyncplane._write_queue.runnable`)."""


class SchemaVersionError(StorageError):
    """The store was written by a newer asyncplane whose schema this version does not
    know (or, opened read-only, needs migrating first)."""


def _rebuild_fence_rejected(
    item_id: int, fence: int, current_fence: int, state: str
) -> FenceRejected:
    return FenceRejected(item_id, fence, current_fence=current_fence, state=state)


def _rebuild_item_cancelled(
    item_id: int, fence: int, current_fence: int, reason: str | None
) -> ItemCancelled:
    return ItemCancelled(item_id, fence, current_fence=current_fence, reason=reason)
