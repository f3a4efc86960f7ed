"""What an executor returns for an item, and how each outcome is settled in the store.

Shared by the two runtimes: `drain()` (a bulk executor over batches) and `work()` (a
per-item handler, continuously). An outcome is one of `Done`, `Failed`, `Retry`, `Park`
and `Offload`; `Settler.settle` turns it into the store's fenced call, counting it in a
`DrainSummary`. An outcome the store refuses as bad input (a result it cannot keep)
fails the item with the reason instead, so no outcome can strand its neighbours; a fault
on this side while settling retries the item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Sequence
from typing import Any, Final, TypeAlias, TypeVar

from asyncplane import _clock, _errors, _validate
from asyncplane._models import ClaimedItem
from asyncplane._store import MAX_LIST_LIMIT, ControlStore, log_fields

__all__ = (
    "KINDS",
    "LOST",
    "UNKNOWN_CLAIM_MARGIN",
    "Done",
    "DrainSummary",
    "Failed",
    "Offload",
    "Outcome",
    "Park",
    "Retry",
    "Settler",
    "count_lost",
    "exit_asked",
    "give_back",
    "given",
    "left_unsettled",
    "returned_or_raised",
    "saved_as",
    "short_error",
    "text_of",
)

_T = TypeVar("_T")


async def returned_or_raised(call: Awaitable[_T]) -> _T | BaseException:
    """What the user's code (a handler, an executor) returned, or what it raised, as a
    value: its items' failure, retried as their attempts allow. Anything but a cancellation
    (which is the runtime's own, or the caller's): a ``sys.exit()`` or a stray
    ``GeneratorExit`` in one item's code must not end the runtime with every item it holds
    left claimed to its lease. (One that asks the program to exit, `exit_asked`, then
    stops the runtime, which raises it once it has wound up.)"""
    try:
        return await call
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the rule above
        return exc


def exit_asked(
    result: object, exiting: BaseException | None, stop: asyncio.Event
) -> BaseException | None:
    """The exit a runtime raises once wound up: ``exiting``, or ``result`` when what a
    handler or executor raised asks the program to exit (``sys.exit()``, Ctrl-C as Python
    3.10 delivers it). Its items are retried as any failure's; the runtime stops as if its
    ``stop`` were set (this sets it)."""
    if isinstance(result, (SystemExit, KeyboardInterrupt)):
        stop.set()
        return exiting or result
    return exiting


#: Where a runtime's refused outcome is logged: the runtime's own logger.
_LOGS = {
    "handler": logging.getLogger("asyncplane.worker"),
    "executor": logging.getLogger("asyncplane.drain"),
}

#: Errors longer than this are cut before they are recorded (the store keeps 16 KiB).
_ERROR_CHARS = 4000


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """The work succeeded; ``result`` (any JSON value) is kept with the item."""

    result: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """A deterministic failure: the item fails now, whatever attempts remain."""

    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """A transient failure: try again after ``delay`` seconds (None: the store's backoff)."""

    error: str
    delay: float | None = None

    def __post_init__(self) -> None:
        if self.delay is not None:
            _validate.delay(self.delay, "Retry.delay")


@dataclasses.dataclass(frozen=True, slots=True)
class Park:
    """No capacity now: set the item aside for ``delay`` seconds without spending an attempt."""

    delay: float

    def __post_init__(self) -> None:
        _validate.delay(self.delay, "Park.delay")


@dataclasses.dataclass(frozen=True, slots=True)
class Offload:
    """Handed to an external batch ``handle``; settle it later (see `ControlStore.offloaded`)."""

    handle: str

    def __post_init__(self) -> None:
        _validate.text_id(self.handle, "Offload.handle")


Outcome: TypeAlias = Done | Failed | Retry | Park | Offload

#: Each outcome's kind in the words the settle counter uses (`given`).
_WORDS: tuple[tuple[type, str], ...] = (
    (Done, "done"),
    (Failed, "failed"),
    (Retry, "retried"),
    (Park, "parked"),
    (Offload, "offloaded"),
)
#: The outcomes' classes: what a handler or executor may give (anything else retries).
KINDS: tuple[type, ...] = tuple(kind for kind, _ in _WORDS)


def given(outcome: object) -> str:
    """What a handler or executor gave, as an execution span's ``asyncplane.outcome``
    says it: the settle counter's word for its kind (a subclass's too; a Retry the store
    fails for want of attempts still says "retried": the span tells what the code gave),
    or "invalid" for anything that is no outcome, which the runtimes retry."""
    return next((word for kind, word in _WORDS if isinstance(outcome, kind)), "invalid")


@dataclasses.dataclass
class DrainSummary:
    """What one drain() or work() did.

    Attributes:
        skipped: Another drainer held the lock; nothing was touched.
        rounds: Rounds run (each: preflight, claim, execute, settle); for work(), claims
            made.
        claimed: Items claimed.
        done: Items settled done by an outcome.
        failed: Items that failed (a Failed outcome, a Retry with no attempt left, or an
            outcome the store refused, a Done whose result it cannot keep, say).
        retried: Items deferred for another attempt.
        parked: Items set aside by a Park outcome.
        offloaded: Items handed to an external batch.
        deduplicated: Pending items settled by preflight dedup, without running.
        purged: Settled items archived and deleted by the store's retention (see
            ``ControlStore(retention=...)``), at most every ``purge_min_interval_s``.
        scheduled: Items the schedules enqueued in this drain (`ControlStore.run_schedules`).
        cancelled: Items cancelled while this drain held them (`ControlStore.cancel`): their
            executor was stopped, or their outcome refused.
        fence_rejected: Settlements the store refused because the claim was no longer
            current (the item was taken over while it ran, or settled by another, a
            cancel say, and purged since: `UnknownItem`); for work(), also items whose
            lease renewal was refused so: their task was cancelled, the outcome dropped.
        scope_lost: With an ``actor_id``: items whose project left the actor's scope while
            they ran (`ControlStore.unassign`): their renewal or settlement was refused,
            their outcome dropped, and the item is left to its lease, to be taken over.
            (To an actor an item purged meanwhile is refused as one out of its scope is,
            so it is counted here.)
        timed_out: work() only: items whose handler ran past ``timeout`` (retried).
        released: work() only: claims given back unrun at a stop (``grace`` ran out, or
            the stop came before they started), and the items a claim whose answer was
            lost (`CommitOutcomeUnknown`) had taken, given back once the store answered.
        unsaved: work() only: items whose outcome (or give-back) the store failed under,
            tried again for a few seconds: left claimed, taken over once their leases
            lapse (and run again), or whose lease could not be renewed before it ran out
            (their handlers cancelled).
        remaining: Items not yet settled when the drain ended (ready, deferred, claimed
            or offloaded; of ``project_id``, and of ``actor_id``'s projects, where given),
            or None when they were not
            counted: the run was skipped, the store was closed under it, or the count
            failed (logged). Never 0 for "unknown": 0 says all the work was done.
        elapsed_s: Seconds the drain took.
    """

    skipped: bool = False
    rounds: int = 0
    claimed: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    parked: int = 0
    offloaded: int = 0
    cancelled: int = 0
    timed_out: int = 0
    released: int = 0
    deduplicated: int = 0
    purged: int = 0
    scheduled: int = 0
    fence_rejected: int = 0
    scope_lost: int = 0
    unsaved: int = 0
    remaining: int | None = None
    elapsed_s: float = 0.0


#: The refusals that say a claim is no longer the worker's: taken over or cancelled
#: (`FenceRejected`, `ItemCancelled` among them), its project gone from the actor's
#: scope (`ScopeDenied`), or the item gone from the store (`UnknownItem`: a claimed item
#: is never purged, so it was settled by another, a cancel say, and purged since). A
#: runtime drops such an item; any other error is the store's.
LOST: tuple[type[_errors.AsyncplaneError], ...] = (
    _errors.FenceRejected,
    _errors.ScopeDenied,
    _errors.UnknownItem,
)


#: Seconds between the tries of a give-back the store failed under (about 4 s in all).
_GIVE_BACK_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0)
#: The store's failures a give-back is not tried again for: none passes in seconds (a
#: lock held past busy_timeout, each try waiting that long again; a store not there).
_LASTING: tuple[type[_errors.StorageError], ...] = (
    _errors.DatabaseLocked,
    _errors.NotAnAsyncplaneDatabase,
    _errors.SchemaVersionError,
    _errors.ArchiveError,
)


def lasting(exc: BaseException) -> bool:
    """Whether a store failure is one that does not pass in seconds (`_LASTING`)."""
    return isinstance(exc, _LASTING)


async def give_back(
    give: Callable[[], Awaitable[object]],
    saved: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """``give()``, a release or a park handing a runtime's item back (or work()'s settle),
    tried again for a few seconds while the store fails under it (a connection lost: a
    server restarting, which is also what ends a guard's session), so that such a hiccup
    strands no item until its lease lapses. A refusal (`LOST`: not the runtime's any more)
    and a lasting failure are raised at once.

    A refusal that follows a try whose outcome was unknown (`CommitOutcomeUnknown`) may be
    the fence refusing a second time what the first try saved: then ``saved()`` is asked
    (`Settler.saved_before`), and if it says so the write stands and nothing is raised."""
    unknown = False
    for pause in (*_GIVE_BACK_PAUSES, None):
        try:
            await give()
            return
        except _errors.StorageError as exc:
            if pause is None or isinstance(exc, _LASTING):
                raise
            unknown = unknown or isinstance(exc, _errors.CommitOutcomeUnknown)
        except LOST:
            if unknown and saved is not None and await saved():
                return
            raise
        await asyncio.sleep(pause)


#: The events a runtime's settle or give-back writes at the claim's fence, each counted
#: in the summary's count of the same name.
_COUNTED_AS: Final = frozenset(("done", "failed", "retried", "parked", "offloaded", "released"))


async def saved_as(store: ControlStore, claim: ClaimedItem, actor_id: str | None) -> str | None:
    """The summary count of the runtime's own write that followed ``claim`` in the
    item's ledger at its fence (a settle or a release), or None if something else came
    next (a takeover's ``lease_expired``, a ``cancelled``) or the ledger cannot be read.

    Asked only when a try whose outcome was unknown is followed by a refusal: the fence
    refuses a second try of a write the first one saved, and the ledger tells that apart
    from a claim lost to another (a settle writes its event at the claim's fence, and
    nothing but the claim's holder settles at it; a takeover or a cancel raises it)."""
    try:
        events = await store.events(claim.item_id, actor_id=actor_id)
    except _errors.AsyncplaneError:
        return None  # (purged, out of scope, the store failing: as refused)
    following = None
    for event, after in zip(events, [*events[1:], None], strict=True):
        if event["event_type"] == "claimed" and event["fence"] == claim.fence:
            following = after
    if following is None or following["fence"] != claim.fence:
        return None
    kind: str = following["event_type"]
    return kind if kind in _COUNTED_AS else None


def count_lost(refusal: BaseException, summary: DrainSummary) -> bool:
    """Whether ``refusal`` says a claim is no longer the worker's (`LOST`), counted in
    ``summary`` if so: cancelled (`ItemCancelled`), taken over (`FenceRejected`) or
    settled by another and purged since (`UnknownItem`), or its project gone from the
    actor's scope (`ScopeDenied`). Any other error is the store failing."""
    if isinstance(refusal, _errors.ItemCancelled):
        summary.cancelled += 1
    elif isinstance(refusal, (_errors.FenceRejected, _errors.UnknownItem)):
        summary.fence_rejected += 1
    elif isinstance(refusal, _errors.ScopeDenied):
        summary.scope_lost += 1
    else:
        return False
    return True


#: The states of an item a drain or worker leaves for later (`DrainSummary.remaining`).
UNSETTLED: Final = ("ready", "deferred", "claimed", "offloaded")


async def left_unsettled(
    store: ControlStore, project_id: str | None, actor_id: str | None, runner: str,
    log: logging.Logger,
) -> int | None:  # fmt: skip
    """How many items a run leaves unsettled (`UNSETTLED`), or None, logged, when the
    store cannot count them: the run itself ended as asked (a stop during an outage,
    say), and what it did is its summary's all the same."""
    try:
        counts = await store.counts(project_id=project_id, actor_id=actor_id)
    except _errors.StorageError as exc:
        log.warning("%s: the items left could not be counted: %s", runner, short_error(exc))
        return None
    return sum(counts[state] for state in UNSETTLED)


#: Seconds before a claim whose outcome was unknown was asked for from which the claims
#: under a runtime's name that it never received are taken for that claim's
#: (`give_back_lost_claim`): the store's clock on PostgreSQL is the server's, read with
#: the round trip's uncertainty.
UNKNOWN_CLAIM_MARGIN: Final = 1.0


async def give_back_lost_claim(
    store: ControlStore, owner: str, asked: float, received: Container[tuple[int, int]],
    project_id: str | None, actor_id: str | None, summary: DrainSummary, runner: str,
    log: logging.Logger,
) -> int:  # fmt: skip
    """Give back what a claim whose outcome was unknown (`CommitOutcomeUnknown`) took:
    the items claimed under ``owner`` since it was asked for (``asked``, by the store's
    clock, less `UNKNOWN_CLAIM_MARGIN`) whose claims, ``(item_id, fence)``, the runtime
    never ``received``. Saved with its answer lost (a connection lost during the commit),
    such a claim's items ran nowhere and were given back by no stop: claimed until their
    leases lapsed, and failed unrun where that was their last attempt. Released
    (`give_back`: tried again while the store fails for a moment), their attempts are
    refunded and they are claimable at once (counted in ``released``). How many; a
    failure of the store is raised. An owner names one running runtime (the default
    does): a claim another process made under the same name in that moment would be
    given back too."""
    since = asked - UNKNOWN_CLAIM_MARGIN
    given = 0
    async for item in _claimed_under(store, owner, project_id, actor_id):
        key = (item["item_id"], item["fence"])
        if key in received or item["claimed_at"] is None:
            continue
        if item["claimed_at"].timestamp() < since:
            continue
        try:
            await give_back(
                functools.partial(store.release, key[0], fence=key[1], actor_id=actor_id)
            )
        except LOST:
            continue  # taken over or cancelled meanwhile: not ours to give back
        given += 1
        summary.released += 1
        log.warning(
            "%s: item %d was taken by a claim whose answer was lost (its outcome "
            "unknown): given back, to be claimed again", runner, key[0],
        )  # fmt: skip
    return given


async def _claimed_under(
    store: ControlStore, owner: str, project_id: str | None, actor_id: str | None
) -> AsyncIterator[dict[str, Any]]:
    """Every item claimed under ``owner``, a page at a time (a batch may be larger than
    a page: one page gave back the first 10,000 of a lost claim of 10,005)."""
    after: int | None = None
    while True:
        page = await store.items(
            state="claimed", owner=owner, project_id=project_id, actor_id=actor_id,
            order="oldest", after=after, limit=MAX_LIST_LIMIT, include_payload=False,
        )  # fmt: skip
        for item in page:
            yield item
        if len(page) < MAX_LIST_LIMIT:
            return
        after = page[-1]["item_id"]


def short_error(error: object) -> str:
    """An error description the store always accepts, whatever the executor produced: an
    exception (even one whose ``str()`` raises) or any text, with NUL and lone surrogates
    (``surrogateescape`` output) made visible rather than fatal, and cut to a length."""
    if isinstance(error, str):
        text = error
    elif isinstance(error, BaseException):
        text = f"{type(error).__name__}: {text_of(error)}"
    else:
        text = text_of(error)
    text = text.replace("\x00", "\ufffd").encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 1] + "…"


def text_of(value: object) -> str:
    try:
        return str(value)
    except Exception:  # a broken __str__ must not strand the batch
        return f"<{type(value).__name__} that cannot be shown>"


@dataclasses.dataclass
class Settler:
    """Renews and settles the claims of one runtime, counting what happens in ``summary``;
    ``source`` names what gives its outcomes (``"executor"``, ``"handler"``) in errors."""

    store: ControlStore
    actor_id: str | None
    summary: DrainSummary
    source: str

    async def keep_leases(self, claims: Sequence[ClaimedItem], lost: set[int]) -> None:
        """Renew the claims' leases every third of a lease (`renewal_due`) until none is
        left, each dropped when its renewal is refused (taken over: ``fence_rejected``;
        cancelled: ``cancelled``; out of the actor's scope: ``scope_lost``; `count_lost`)
        and added to ``lost``. Returns once all are lost (nothing the executor returns
        could be settled: drain() then stops it); runs until then, or until its task is
        cancelled.

        A turn asks for every live claim's renewal at once, so the writer takes them into
        as few rounds as its batch allows, not one round trip after another (a batch of a
        hundred would otherwise wait out a hundred rounds each turn)."""
        clock = self.store.clock
        live = {claim.item_id: claim.fence for claim in claims}
        due = {claim.item_id: self.renewal_due(claim.lease_expires_at) for claim in claims}
        while live:
            await _clock.wait_until(clock, min(due[item_id] for item_id in live))
            turn = list(live.items())
            answers = await asyncio.gather(
                *(self.store.renew(i, fence=fence, actor_id=self.actor_id) for i, fence in turn),
                return_exceptions=True,
            )
            for (item_id, _), answer in zip(turn, answers, strict=True):
                if not isinstance(answer, BaseException):
                    due[item_id] = self.renewal_due(answer)
                    continue
                if not count_lost(answer, self.summary):
                    raise answer
                del live[item_id]
                lost.add(item_id)

    def renewal_due(self, expires: datetime.datetime) -> float:
        """When a lease ending at ``expires`` is next renewed: a third of a lease after the
        store granted it, by the store's own reading inside the transaction. Not a third
        after the renewer's turn came back, which a busy loop or a slow hand-off delays:
        each late turn would push the next renewal later by as much.

        The runtimes claim and renew with the store's ``lease_seconds``, so the grant is
        the end less that. A microsecond early: ``expires`` is kept to the microsecond, so
        a clock moved exactly a third of a lease past the grant still reaches it. A due
        time already past (a renewal that took longer than a third of a lease to come
        back) renews at once: one write round after another, never a spin, and what keeps
        the lease on a store that slow. Not a floor from now: that would bring back the
        slide this avoids."""
        return expires.timestamp() - self.store.lease_seconds * 2 / 3 - 1e-6

    async def saved_before(self, claim: ClaimedItem) -> bool:
        """Whether the runtime's own settle or release of ``claim`` stands in the ledger
        (`saved_as`), counted as that write if so: asked when a try whose outcome was
        unknown was followed by a refusal (`give_back`)."""
        kind = await saved_as(self.store, claim, self.actor_id)
        if kind is None:
            return False
        setattr(self.summary, kind, getattr(self.summary, kind) + 1)
        _LOGS[self.source].info(
            "item %d: a try whose outcome was unknown had been saved (%s)", claim.item_id,
            kind, extra=log_fields(claim),
        )  # fmt: skip
        return True

    async def settle(self, claim: ClaimedItem, outcome: Outcome) -> None:
        """Settle one outcome; one the store refuses as bad input (a result it cannot keep)
        fails the item with the reason, so no outcome can strand its neighbours."""
        try:
            await self._apply(claim, outcome)
        except (_errors.InvalidInput, _errors.InvalidType) as exc:
            what = "result" if isinstance(outcome, Done) else type(outcome).__name__
            error = short_error(f"the {self.source}'s {what} was refused: {exc}")
            _LOGS[self.source].warning(
                "item %d failed: %s", claim.item_id, error, extra=log_fields(claim)
            )
            await self.store.finish(
                claim.item_id, fence=claim.fence, status="failed", error=error,
                actor_id=self.actor_id,
            )  # fmt: skip
            self.summary.failed += 1
        except _errors.AsyncplaneError:
            raise
        except Exception as exc:  # a fault on this side, not the store's: retry the item
            error = short_error(f"settling its {type(outcome).__name__} raised {short_error(exc)}")
            await self.retry(claim, Retry(error))

    async def _apply(self, claim: ClaimedItem, outcome: Outcome) -> None:
        store, item_id, fence, actor = self.store, claim.item_id, claim.fence, self.actor_id
        if isinstance(outcome, Done):
            await store.finish(item_id, fence=fence, result=outcome.result, actor_id=actor)
            self.summary.done += 1
        elif isinstance(outcome, Failed):
            error = short_error(outcome.error)
            await store.finish(item_id, fence=fence, status="failed", error=error, actor_id=actor)
            self.summary.failed += 1
        elif isinstance(outcome, Retry):
            await self.retry(claim, outcome)
        elif isinstance(outcome, Park):
            await store.park(item_id, fence=fence, delay=outcome.delay, actor_id=actor)
            self.summary.parked += 1
        else:
            await store.offload(item_id, fence=fence, handle=outcome.handle, actor_id=actor)
            self.summary.offloaded += 1

    async def retry(self, claim: ClaimedItem, outcome: Retry) -> None:
        state = await self.store.retry(
            claim.item_id, fence=claim.fence, error=short_error(outcome.error), delay=outcome.delay,
            actor_id=self.actor_id,
        )  # fmt: skip
        if state == "failed":
            self.summary.failed += 1
        else:
            self.summary.retried += 1
