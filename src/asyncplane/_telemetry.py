"""Metrics and spans, through OpenTelemetry when the application has it.

asyncplane records through the OpenTelemetry API (the ``otel`` extra installs
``opentelemetry-api``); what it records goes wherever the application's meter and tracer
providers send it. The rules:

* **Nothing without the API.** If ``opentelemetry`` cannot be imported, every hook here is
  a constant no-op (`ENABLED` is False): no instrument, no span, no trace context saved.
* **The API's no-ops without a provider.** With the API and no provider configured, the
  API's proxy instruments take the calls and drop them; a provider set later (even after
  a store opened) starts receiving them, as the API's proxies forward.
* **No span made for nobody.** While no tracer provider is set (the API's proxy is the
  global one), asyncplane makes no span at all: the proxy would drop it, and making one,
  with its attributes, links and current context, costs more per item than the rest of
  this module together (an execution's telemetry took 11 µs with it, 4 without). Each
  span looks again, so a provider
  set later gets the next one. Metrics keep going through the proxy: a record is cheap.
* **One set of instruments per process**, made on first use under the meter
  ``asyncplane``: every store of the process records into them, told apart by their
  attributes where it matters (``asyncplane.backend``, ``asyncplane.project``).
* **Gauges are read lazily.** The observable gauges (items by state and project, the
  oldest ready item's age) give the last snapshot each open store took, and ask that
  store's event loop for a fresh one (``call_soon_threadsafe``: a metric reader collects
  on a thread of its own). So a value is at most one collection interval old, and a
  store that nobody collects from reads nothing for them.
* **Trace context travels with the item.** `enqueue_span` saves the producer's context
  (W3C ``traceparent``/``tracestate`` as compact JSON) in the item's row; the worker's
  execution span links to it (a link, not a parent: the item may run hours later, on
  another host, many times).

Names and units are listed in docs/observability.md; a test checks the two agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from asyncplane import _models, _tasks

_T = TypeVar("_T")

if TYPE_CHECKING:
    from asyncplane._backend import ClaimRow, StoreStats
    from asyncplane._models import ClaimedItem

__all__ = (
    "COUNTERS",
    "ENABLED",
    "GAUGES",
    "HISTOGRAMS",
    "SPANS",
    "Gauges",
    "claimed",
    "dedup_settled",
    "enqueue_span",
    "enqueued",
    "execution_span",
    "executions",
    "lock_wait",
    "refused",
    "round_span",
    "settled",
    "write_round",
)

_log = logging.getLogger("asyncplane.store")


def _api_installed() -> bool:
    """Whether the OpenTelemetry API is here: its ``metrics`` and ``trace`` packages in the
    ``opentelemetry`` namespace (one that holds only another distribution's modules, the
    protocol buffers, say, does not count). Looked up on disk, importing nothing: a look
    for ``opentelemetry.metrics`` would import ``opentelemetry`` with asyncplane. Where a
    place is no directory (a zipped install: a PEX, a zipapp), the import system is asked
    after all, at that cost."""
    spec = importlib.util.find_spec("opentelemetry")
    places = [] if spec is None else list(spec.submodule_search_locations or ())
    packages = ("metrics", "trace")
    if all(os.path.isdir(place) for place in places):
        return all(
            any(os.path.isdir(os.path.join(place, package)) for place in places)
            for package in packages
        )
    try:
        return all(importlib.util.find_spec(f"opentelemetry.{package}") for package in packages)
    except (ImportError, ValueError):  # a namespace that cannot be read: no telemetry
        return False


#: Whether the OpenTelemetry API is importable here (the ``otel`` extra). It is imported
#: when the first store opens, not with asyncplane: a program that never opens a store
#: (a command's ``--help``, say) does not pay for it.
ENABLED: Final = _api_installed()

#: Counters: name -> (unit, description).
COUNTERS: Final = {
    "asyncplane.items.enqueued": ("{item}", "Jobs accepted by enqueue (a deduplicated one too)"),
    "asyncplane.items.claimed": ("{item}", "Items handed out by claims"),
    "asyncplane.items.settled": (
        "{item}",
        "Settlements, by asyncplane.outcome: done, failed, retried, parked, offloaded, "
        "cancelled, released",
    ),
    "asyncplane.fence.refusals": (
        "{refusal}",
        "Reports refused because their fence was not current (asyncplane.reason: "
        "fence or cancelled)",
    ),
    "asyncplane.items.dedup_settled": (
        "{item}",
        "Pending twins settled done without running (asyncplane.layer: settlement or preflight)",
    ),
    "asyncplane.leases.takeovers": ("{item}", "Claims that took an item over from a lapsed lease"),
}
#: Bucket boundaries for durations in seconds: from half a millisecond (a claim in one
#: process) to an hour (a wait in the queue, a long run), about three to a decade. The
#: SDK's default boundaries (0 to 10,000) were made for milliseconds: every claim and
#: settle fell into the first bucket.
SECONDS_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
)  # fmt: skip
#: Bucket boundaries for the requests one write round carries.
REQUEST_BUCKETS: Final = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
#: Histograms: name -> (unit, description).
HISTOGRAMS: Final = {
    "asyncplane.queue.wait": ("s", "From enqueue to the first claim"),
    "asyncplane.execution.duration": ("s", "An item's run in drain() or work()"),
    "asyncplane.claim.duration": ("s", "A claim call, from request to the claimed rows"),
    "asyncplane.settle.duration": ("s", "A settle call (finish, retry, park, ...)"),
    "asyncplane.write.round.size": ("{request}", "Requests one group commit carried"),
    "asyncplane.write.round.duration": ("s", "One write round, BEGIN to COMMIT"),
    "asyncplane.write.lock_wait": (
        "s",
        "Time a write round waited for SQLite's write lock (the writers' queue and BEGIN)",
    ),
}
#: Observable gauges: name -> (unit, description).
GAUGES: Final = {
    "asyncplane.items": ("{item}", "Items by asyncplane.state and asyncplane.project"),
    "asyncplane.queue.oldest_ready_age": ("s", "How long the oldest ready item has waited"),
}
#: Spans: name -> what one covers.
SPANS: Final = {
    "asyncplane.enqueue": "An enqueue call (PRODUCER); its context is saved with the items",
    "asyncplane.drain.round": "One round of drain(): the executor's run of a batch",
    "asyncplane.execute": (
        "One item's execution (CONSUMER), linked to the span that enqueued it; attributes "
        "asyncplane.item_id, asyncplane.project, asyncplane.attempt, asyncplane.fence"
    ),
}


class _Instruments:
    """The process's instruments, made once under the meter ``asyncplane``."""

    def __init__(self) -> None:
        from opentelemetry import metrics, propagate, trace

        from asyncplane import __version__

        self.metrics = metrics
        self.propagate = propagate
        self.trace = trace
        meter = metrics.get_meter("asyncplane", __version__)
        counters = {name: meter.create_counter(name, u, d) for name, (u, d) in COUNTERS.items()}
        histograms = {
            name: meter.create_histogram(
                name, u, d,
                explicit_bucket_boundaries_advisory=list(
                    SECONDS_BUCKETS if u == "s" else REQUEST_BUCKETS
                ),
            )
            for name, (u, d) in HISTOGRAMS.items()
        }  # fmt: skip
        self.enqueued = counters["asyncplane.items.enqueued"]
        self.claimed = counters["asyncplane.items.claimed"]
        self.settled = counters["asyncplane.items.settled"]
        self.refused = counters["asyncplane.fence.refusals"]
        self.dedup = counters["asyncplane.items.dedup_settled"]
        self.takeovers = counters["asyncplane.leases.takeovers"]
        self.queue_wait = histograms["asyncplane.queue.wait"]
        self.execution = histograms["asyncplane.execution.duration"]
        self.claim = histograms["asyncplane.claim.duration"]
        self.settle = histograms["asyncplane.settle.duration"]
        self.round_size = histograms["asyncplane.write.round.size"]
        self.round_duration = histograms["asyncplane.write.round.duration"]
        self.lock_wait = histograms["asyncplane.write.lock_wait"]
        unit, about = GAUGES["asyncplane.items"]
        meter.create_observable_gauge("asyncplane.items", [_observe_items], unit, about)
        unit, about = GAUGES["asyncplane.queue.oldest_ready_age"]
        meter.create_observable_gauge(
            "asyncplane.queue.oldest_ready_age", [_observe_oldest], unit, about
        )
        self.tracer = trace.get_tracer("asyncplane", __version__)


_MADE: list[_Instruments] = []
#: Guards the instruments' making and the set of live stores: stores may live on several
#: threads' loops, and a metric reader collects on a thread of its own.
_GUARD = threading.Lock()


def _instruments() -> _Instruments:
    if _MADE:
        return _MADE[0]
    with _GUARD:
        if not _MADE:
            _MADE.append(_Instruments())
    return _MADE[0]


def _tracing() -> _Instruments | None:
    """The instruments, to make a span with; None without the API, or while no tracer
    provider is set (the span would go to the proxy's no-op)."""
    if not ENABLED:
        return None
    otel = _instruments()
    if isinstance(otel.trace.get_tracer_provider(), otel.trace.ProxyTracerProvider):
        return None
    return otel


# --- counters and histograms ---------------------------------------------------------------


def enqueued(project_id: str, count: int) -> None:
    """``count`` jobs accepted by an enqueue into ``project_id``."""
    if ENABLED:
        _instruments().enqueued.add(count, {"asyncplane.project": project_id})


def claimed(rows: Sequence[ClaimRow], now: float, seconds: float, backend: str) -> None:
    """A claim call that took ``seconds`` and handed out ``rows`` at ``now``."""
    if not ENABLED:
        return
    _instruments().claim.record(seconds, {"asyncplane.backend": backend})
    taken(rows, now)


def taken_unseen(rows: Sequence[ClaimRow], now: Callable[[], float]) -> None:
    """`taken` for claims no caller saw, given back at once (``now``: the backend's
    clock): on the way out of a refusal or a cancellation, so a failure here is logged,
    never raised."""
    if not ENABLED:
        return
    try:
        taken(rows, now())
    except Exception:
        _log.exception("asyncplane: claims given back could not be counted")


def taken(rows: Sequence[ClaimRow], now: float) -> None:
    """``rows`` claimed at ``now`` (by a call that returned them, or by one cancelled
    meanwhile, whose items are given back at once: the ledger has their claims too)."""
    if not ENABLED:
        return
    found = _instruments()
    for row in rows:
        project = {"asyncplane.project": row.project_id}
        found.claimed.add(1, project)
        if row.taken_over:
            found.takeovers.add(1, project)
        elif row.fence == 1:  # its first claim ever: the wait from enqueue is a queue wait
            found.queue_wait.record(_models.waited(now, row.created_at), project)


def settled(outcome: str, seconds: float | None, backend: str, *, count: int = 1) -> None:
    """``count`` items settled as ``outcome`` by a settle call that took ``seconds``
    (None: not one call's latency, a bulk cancel say)."""
    if ENABLED and count:
        found = _instruments()
        found.settled.add(count, {"asyncplane.outcome": outcome})
        if seconds is not None:
            labels = {"asyncplane.backend": backend, "asyncplane.outcome": outcome}
            found.settle.record(seconds, labels)


def refused(cancelled: bool) -> None:
    """A report refused for its fence (``cancelled``: because the item was cancelled)."""
    if ENABLED:
        reason = "cancelled" if cancelled else "fence"
        _instruments().refused.add(1, {"asyncplane.reason": reason})


def dedup_settled(count: int, layer: str) -> None:
    """``count`` pending twins settled done without running, by ``layer``."""
    if ENABLED and count:
        _instruments().dedup.add(count, {"asyncplane.layer": layer})


def write_round(backend: str, size: int, seconds: float) -> None:
    """One write round of ``size`` requests that took ``seconds``."""
    if ENABLED:
        found = _instruments()
        labels = {"asyncplane.backend": backend}
        found.round_size.record(size, labels)
        found.round_duration.record(seconds, labels)


def lock_wait(seconds: float) -> None:
    """How long one round waited for SQLite's write lock (its queue, then BEGIN)."""
    if ENABLED:
        _instruments().lock_wait.record(seconds, {"asyncplane.backend": "sqlite"})


# --- spans ---------------------------------------------------------------------------------


@contextlib.contextmanager
def enqueue_span(project_id: str, count: int) -> Iterator[str | None]:
    """The span of one enqueue call; yields the trace context to save with its items
    (None when there is no valid span to link to)."""
    otel = _tracing()
    if otel is None:
        # No span of ours, but a context the caller is in (one that came with its
        # request, say) is still saved, for a worker that traces.
        yield _current_context()
        return
    attributes: dict[str, str | int] = {"asyncplane.project": project_id, "asyncplane.count": count}
    with _current_span(
        otel, "asyncplane.enqueue", kind=otel.trace.SpanKind.PRODUCER, attributes=attributes
    ):
        yield _current_context()


@contextlib.contextmanager
def _current_span(otel: _Instruments, name: str, **options: Any) -> Iterator[None]:
    """``start_as_current_span``, but the span's own start and end never raise into the
    work it wraps (a span processor that raises, say: the work was done, or saved)."""
    span = _guarded(lambda: otel.tracer.start_span(name, **options), name)
    if span is None:
        yield
        return
    try:
        with otel.trace.use_span(span, end_on_exit=False):  # records an exception, as ever
            yield
    finally:
        _guarded(span.end, name)


_SPAN_FAILURES = [0]  # the first is logged with its traceback, the rest at DEBUG


def _guarded(call: Callable[[], _T], name: str) -> _T | None:
    """``call()`` of the tracing API on asyncplane's own span; None if it raised (the
    application's span processor, say): telemetry never breaks the work it watches."""
    try:
        return call()
    except Exception:
        _SPAN_FAILURES[0] += 1
        level = logging.WARNING if _SPAN_FAILURES[0] == 1 else logging.DEBUG
        _log.log(level, "asyncplane: the tracing of %s failed", name, exc_info=True)
        return None


def _current_context() -> str | None:
    """The current trace context as compact JSON (None without the API, or without a
    valid current span)."""
    if not ENABLED:
        return None
    otel = _instruments()
    if not otel.trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    otel.propagate.inject(carrier)
    # The span's place only (traceparent and tracestate, or a B3 or Jaeger propagator's
    # own): baggage, which a program may fill with user or tenant data, is not written
    # into every item.
    fields = otel.propagate.get_global_textmap().fields  # the propagators' own headers
    saved = {key: value for key, value in carrier.items() if key in fields and _kept(key)}
    text = json.dumps(saved, separators=(",", ":"), sort_keys=True) if saved else None
    if text is not None and len(text) > _MOST_CONTEXT_CHARS:
        # A tracestate the caller's headers filled (it may be kilobytes): without it,
        # rather than a context no claim would read (`saved_context`), saved in every item.
        saved = {key: value for key, value in saved.items() if key != "tracestate"}
        text = json.dumps(saved, separators=(",", ":"), sort_keys=True) if saved else None
        if text is not None and len(text) > _MOST_CONTEXT_CHARS:
            return None
    return text


def _kept(header: str) -> bool:
    """Whether a propagator's header is saved with an item: not baggage (W3C's
    ``baggage``, Jaeger's ``uberctx-<key>``, OT Trace's ``ot-baggage-<key>``). At enqueue
    only the headers a propagator names as its own (its ``fields``) are saved too, which
    leaves out any baggage spelt per key."""
    name = header.lower()
    return name != "baggage" and not name.startswith(("uberctx-", "ot-baggage-"))


@contextlib.contextmanager
def round_span(owner: str, size: int) -> Iterator[None]:
    """The span of one drain round running a batch of ``size`` items."""
    otel = _tracing()
    if otel is None:
        yield
        return
    attributes: dict[str, str | int] = {"asyncplane.owner": owner, "asyncplane.count": size}
    with _current_span(otel, "asyncplane.drain.round", attributes=attributes):
        yield


class Execution:
    """One item's execution: its duration, recorded by `finish`, and its span (None
    without a tracer provider), which `finish` ends."""

    __slots__ = ("_claim", "_span", "_started")

    def __init__(self, claim: ClaimedItem) -> None:
        self._claim = claim
        self._started = time.perf_counter()
        self._span: Any = None
        otel = _tracing()
        if otel is not None:
            self._span = _guarded(
                lambda: otel.tracer.start_span(
                    "asyncplane.execute",
                    kind=otel.trace.SpanKind.CONSUMER,
                    attributes={
                        "asyncplane.item_id": claim.item_id,
                        "asyncplane.project": claim.project_id,
                        "asyncplane.attempt": claim.attempts,
                        "asyncplane.fence": claim.fence,
                        "asyncplane.owner": claim.owner,
                    },
                    links=_links(claim.trace_context),
                ),
                "asyncplane.execute",
            )

    def finish(self, outcome: object) -> None:
        """End the span with the outcome (an exception marks it failed)."""
        if not ENABLED:
            return
        seconds = time.perf_counter() - self._started
        otel = _instruments()
        otel.execution.record(seconds, {"asyncplane.project": self._claim.project_id})
        span, self._span = self._span, None  # ended once, whatever happens below
        if span is None:
            return
        if isinstance(outcome, BaseException):
            try:
                span.record_exception(outcome)
            except Exception:  # its str() raised, say: the span never breaks the work
                span.add_event("exception", {"exception.type": type(outcome).__qualname__})
            status = otel.trace.Status(otel.trace.StatusCode.ERROR, type(outcome).__name__)
            span.set_status(status)
        else:
            from asyncplane import _outcomes  # (it imports the store, which imports this)

            span.set_attribute("asyncplane.outcome", _outcomes.given(outcome))
        _guarded(span.end, "asyncplane.execute")


@contextlib.contextmanager
def execution_span(claim: ClaimedItem) -> Iterator[Execution]:
    """One item's execution span, current while the block runs (the handler's own spans
    nest in it); the block calls `Execution.finish` with the outcome, or an exception
    leaving the block ends it as failed."""
    run = Execution(claim)
    span = run._span
    if span is None:
        try:
            yield run
        except BaseException as exc:
            run.finish(exc)
            raise
        return
    with _instruments().trace.use_span(span, end_on_exit=False, record_exception=False):
        try:
            yield run
        except BaseException as exc:
            run.finish(exc)
            raise


def executions(batch: Iterable[ClaimedItem]) -> list[Execution]:
    """One execution span per item of a drain batch (run by one executor call)."""
    if not ENABLED:
        return []
    return [Execution(claim) for claim in batch]


def _links(trace_context: dict[str, str] | None) -> list[Any]:
    if not trace_context:
        return []
    otel = _instruments()
    extracted = otel.propagate.extract(trace_context)
    context = otel.trace.get_current_span(extracted).get_span_context()
    return [otel.trace.Link(context)] if context.is_valid else []


def saved_context(text: str | None) -> dict[str, str] | None:
    """A trace context as saved with an item, decoded (None if absent or unreadable,
    however it is unreadable: a claim must never fail on its item's trace context)."""
    if text is None or len(text) > _MOST_CONTEXT_CHARS:
        return None
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict):
        return None
    return {str(k): str(v) for k, v in found.items() if _kept(str(k))}


#: Longer than this, a saved trace context is not read (the W3C headers are short).
_MOST_CONTEXT_CHARS: Final = 8192


# --- gauges --------------------------------------------------------------------------------


class Gauges:
    """What the observable gauges read of one open store: its last snapshot, refreshed
    on the store's loop when a reader asks (see the module)."""

    def __init__(
        self,
        name: str,
        read: Callable[[], Awaitable[StoreStats]],
        now: Callable[[], float],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.name = name
        self._read = read
        self._now = now
        self._loop = loop
        self._refreshing: asyncio.Task[None] | None = None
        self._closed = False  # no refresh starts once closed (a collection under way)
        #: Every project whose items were counted: a project emptied (purged) reports 0s.
        self._seen_projects: set[str] = set()
        #: The last snapshot: (states by project, oldest ready age), or None before one.
        self.snapshot: tuple[tuple[tuple[str, str, int], ...], float | None] | None = None
        #: Set each time a refresh lands (tests and the dashboard await it).
        self.refreshed = asyncio.Event()
        if ENABLED:
            _instruments()  # the gauges exist from the first store on
            with _GUARD:
                _LIVE.add(self)

    def request(self) -> bool:
        """From any thread: refresh soon, on the store's loop (one refresh at a time);
        False when its loop has closed: the store can say nothing more, and its gauges
        stop giving values (the last would stand for ever)."""
        if self._closed:
            return False
        try:
            self._loop.call_soon_threadsafe(self._start)
        except RuntimeError:  # the loop is closed
            self.forget()
            return False
        return True

    def _start(self) -> None:
        if self._closed:  # asked by a collection that began before the close
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = _tasks.detached(
                self._refresh(), f"asyncplane-gauges[{self.name}]", self._loop
            )

    async def _refresh(self) -> None:
        try:
            stats = await self._read()
        except Exception as exc:  # a closed or failing store: the last snapshot stays
            _log.debug("asyncplane: gauges of %s not refreshed: %s", self.name, exc)
            return
        now = self._now()
        age = None if stats.oldest_ready_at is None else _models.waited(now, stats.oldest_ready_at)
        # Every state of every project seen, a zero too: a series that stopped when its
        # count reached 0 would show its last count wherever the last value is kept.
        found = {(project, state): count for project, state, count in stats.states_by_project}
        self._seen_projects.update(project for project, _ in found)
        counts = tuple(
            (project, state, found.get((project, state), 0))
            for project in sorted(self._seen_projects)
            for state in _models.ITEM_STATES
        )
        self.snapshot = (counts, age)
        self.refreshed.set()

    def alive(self) -> bool:
        """Whether the store's loop still runs its refreshes."""
        return not self._loop.is_closed()

    def forget(self) -> None:
        """Stop giving values (the store's loop is gone)."""
        with _GUARD:
            _LIVE.discard(self)

    def drop(self) -> None:
        """Stop reading for the gauges at once, waiting for nothing (the store lost its
        connection: a refresh under way is cancelled, and ends on its own)."""
        self._closed = True
        self.forget()
        task = self._refreshing
        if task is not None and not task.done():
            task.cancel()
            _DROPPED.add(task)  # held until it ends (the loop keeps only a weak reference)
            task.add_done_callback(_DROPPED.discard)

    async def close(self) -> None:
        """Stop reading for the gauges (the store is closing)."""
        self._closed = True
        self.forget()
        task = self._refreshing
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


_LIVE: weakref.WeakSet[Gauges] = weakref.WeakSet()
#: Refreshes cancelled by `Gauges.drop`, until they end.
_DROPPED: set[asyncio.Task[None]] = set()


def _live() -> list[Gauges]:
    with _GUARD:
        return list(_LIVE)


def _observe_items(options: Any) -> list[Any]:
    found = []
    for gauges in _live():
        if gauges.request() and gauges.snapshot is not None:
            for project, state, count in gauges.snapshot[0]:
                labels = {
                    "asyncplane.store": gauges.name,
                    "asyncplane.project": project,
                    "asyncplane.state": state,
                }
                found.append(_instruments().metrics.Observation(count, labels))
    return found


def _observe_oldest(options: Any) -> list[Any]:
    found = []
    for gauges in _live():
        if gauges.snapshot is not None and gauges.alive():
            # No item ready: 0 (as the dashboard's /metrics says), not no value, which a
            # backend keeping last values would show as the last age for ever.
            age = 0.0 if gauges.snapshot[1] is None else gauges.snapshot[1]
            labels = {"asyncplane.store": gauges.name}
            found.append(_instruments().metrics.Observation(age, labels))
    return found
