"""OpenTelemetry: the counters, histograms, gauges and spans asyncplane records, on both
backends, with the SDK's in-memory reader and exporter; the trace context carried from
the producer to a worker in another OS process; and nothing at all without the API.

The SDK's providers are global and set once per process: this module sets them on first
use, with a span processor that keeps spans only while a test of this module asks, so
the rest of the suite is not traced into memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.test_claims import (
    cancelled_as_answered,
    cancelled_in_its_round,
    claim_cancelled_in_its_round,
)

from asyncplane import (
    ClaimedItem,
    ControlStore,
    Done,
    Failed,
    FenceRejected,
    Retry,
    _telemetry,
    drain,
    work,
)
from asyncplane._store import engine_of
from asyncplane._telemetry import SECONDS_BUCKETS
from asyncplane.testing import ManualClock

HERE = pathlib.Path(__file__).parent


class _Gate(SpanProcessor):
    """Passes ended spans to the exporter only while ``open``."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner
        self.open = False
        #: Whether it raises instead, at each span's start and end (a broken processor).
        self.broken = False

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.broken:
            raise RuntimeError(f"the processor broke on {span.name}'s start")

    def on_end(self, span: ReadableSpan) -> None:
        if self.broken:
            raise RuntimeError(f"the processor broke on {span.name}")
        if self.open:
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


_INSTALLED: dict[str, Any] = {}


def _install() -> tuple[InMemoryMetricReader, InMemorySpanExporter, _Gate]:
    if not _INSTALLED:
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        exporter = InMemorySpanExporter()
        gate = _Gate(SimpleSpanProcessor(exporter))
        provider = TracerProvider()
        provider.add_span_processor(gate)
        trace.set_tracer_provider(provider)
        _INSTALLED.update(reader=reader, exporter=exporter, gate=gate)
    return _INSTALLED["reader"], _INSTALLED["exporter"], _INSTALLED["gate"]


class Otel:
    """The test's view of what was recorded."""

    def __init__(self) -> None:
        self.reader, self.exporter, self.gate = _install()

    def points(self, name: str) -> list[Any]:
        found = []
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def total(self, name: str, **attributes: Any) -> float:
        """A counter's sum (a histogram's count) over the points with these attributes."""
        found = 0.0
        for point in self.points(name):
            labels = {k.removeprefix("asyncplane."): v for k, v in point.attributes.items()}
            if all(labels.get(k) == v for k, v in attributes.items()):
                found += getattr(point, "value", None) or getattr(point, "count", 0)
        return found

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def otel() -> Iterator[Otel]:
    found = Otel()
    found.exporter.clear()
    found.gate.open = True
    try:
        yield found
    finally:
        found.gate.open = False
        found.gate.broken = False
        found.exporter.clear()


def test_the_api_is_installed_for_the_suite() -> None:
    assert _telemetry.ENABLED  # the test extra brings opentelemetry-api


async def test_counters_follow_enqueue_claim_settle_and_refusals(
    store: ControlStore, otel: Otel
) -> None:
    before = {
        name: otel.total(name)
        for name in (
            "asyncplane.items.enqueued", "asyncplane.items.claimed", "asyncplane.claim.duration",
            "asyncplane.fence.refusals",
        )
    }  # fmt: skip
    outcomes = ("done", "failed", "retried", "parked", "released", "cancelled")
    settled = {o: otel.total("asyncplane.items.settled", outcome=o) for o in outcomes}
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(6)])
    batch = await store.claim_batch("w", 5)
    await store.finish(batch[0].item_id, fence=batch[0].fence, result={"ok": True})
    await store.finish(batch[1].item_id, fence=batch[1].fence, status="failed", error="no")
    await store.retry(batch[2].item_id, fence=batch[2].fence, delay=60)
    await store.park(batch[3].item_id, fence=batch[3].fence, delay=60)
    await store.release(batch[4].item_id, fence=batch[4].fence)
    await store.cancel(ids[5])
    await store.cancel(ids[5])  # settled already: left as it is, not counted again
    with pytest.raises(FenceRejected):
        await store.finish(batch[0].item_id, fence=batch[0].fence)
    assert otel.total("asyncplane.items.enqueued") - before["asyncplane.items.enqueued"] == 6
    assert otel.total("asyncplane.items.claimed") - before["asyncplane.items.claimed"] == 5
    assert otel.total("asyncplane.claim.duration") - before["asyncplane.claim.duration"] == 1
    assert otel.total("asyncplane.fence.refusals") - before["asyncplane.fence.refusals"] == 1
    for outcome in settled:
        assert otel.total("asyncplane.items.settled", outcome=outcome) - settled[outcome] == 1
    assert otel.total("asyncplane.items.claimed", project="alpha") >= 5


async def test_takeovers_queue_wait_and_dedup_settlements_are_counted(
    asyncplane_store_factory: Callable[..., Any], clock: ManualClock, otel: Otel
) -> None:
    old: ControlStore = await asyncplane_store_factory("shared.db", lease_seconds=10)
    await old.create_project("p", "P")
    twins = [await old.enqueue("p", {"task": "same"}) for _ in range(3)]
    new: ControlStore = await asyncplane_store_factory(
        "shared.db", identity=("task",), lease_seconds=10
    )
    takeovers = otel.total("asyncplane.leases.takeovers")
    waits = otel.total("asyncplane.queue.wait")
    dedup = otel.total("asyncplane.items.dedup_settled", layer="settlement")
    await new.dedup_pending_against_done()  # fingerprints the old items
    clock.advance(5.0)
    first = await new.claim("w1")
    assert first is not None and first.item_id == twins[0]
    clock.advance(20.0)  # its lease lapses
    again = await new.claim("w2")
    assert again is not None and again.item_id == twins[0] and again.fence > first.fence
    await new.finish(again.item_id, fence=again.fence, result={"shared": True})
    assert otel.total("asyncplane.leases.takeovers") - takeovers == 1
    assert otel.total("asyncplane.queue.wait") - waits == 1  # the first claim only
    assert otel.total("asyncplane.items.dedup_settled", layer="settlement") - dedup == 2
    wait_points = [p for p in otel.points("asyncplane.queue.wait") if p.count]
    assert max(p.max for p in wait_points) >= 5.0


async def test_claims_no_caller_saw_are_counted_claimed_as_they_are_released(
    store: ControlStore, raw: Any, otel: Otel
) -> None:
    # The ledger has a claim and a release for each; the counters say the same.
    claimed = otel.total("asyncplane.items.claimed")
    released = otel.total("asyncplane.items.settled", outcome="released")
    # Cancelled while its round ran: the writer gives the item back (`Writes.orphaned`).
    orphan = await claim_cancelled_in_its_round(store, raw)
    raw.execute("COMMIT")
    await store.assign("alpha", "barrier")  # a write behind the give-back
    # Cancelled as the answer came (the answer found in the future).
    await cancelled_as_answered(store, "claim", store.claim_batch("gone", 1))
    await store.assign("alpha", "barrier")
    assert [e["event_type"] for e in await store.events(orphan)] == [
        "queued", "claimed", "released", "claimed", "released",
    ]  # fmt: skip
    assert otel.total("asyncplane.items.claimed") - claimed == 2
    assert otel.total("asyncplane.items.settled", outcome="released") - released == 2


async def test_an_enqueue_saved_for_a_caller_gone_is_counted(
    store: ControlStore, raw: Any, otel: Otel
) -> None:
    # Cancelled while its round ran, and cancelled as its answer came: either way the
    # items stand, and are counted as enqueued, as if their callers had seen them.
    enqueued = otel.total("asyncplane.items.enqueued", project="alpha")
    await cancelled_in_its_round(store, raw, store.enqueue_many("alpha", [{"n": 1}, {"n": 2}]))
    raw.execute("COMMIT")
    await store.assign("alpha", "barrier")  # a write behind the enqueue's round
    await cancelled_as_answered(store, "enqueue", store.enqueue("alpha", {"n": 3}))
    assert len(await store.items(state="ready")) == 3
    counted = otel.total("asyncplane.items.enqueued", project="alpha")
    assert counted - enqueued == 3


#: Each settle, made for the item ``claim`` holds, by the outcome it is counted under:
#: the backend's method it goes through, and the item's state after it.
_SETTLES: dict[str, tuple[str, str, Callable[[ControlStore, ClaimedItem], Awaitable[Any]]]] = {
    "done": ("finish", "done", lambda s, c: s.finish(c.item_id, fence=c.fence, result=1)),
    "failed": (
        "finish", "failed",
        lambda s, c: s.finish(c.item_id, fence=c.fence, status="failed", error="boom"),
    ),
    "retried": ("retry", "deferred", lambda s, c: s.retry(c.item_id, fence=c.fence)),
    "parked": ("park", "deferred", lambda s, c: s.park(c.item_id, fence=c.fence, delay=60)),
    "released": ("release", "ready", lambda s, c: s.release(c.item_id, fence=c.fence)),
    "offloaded": (
        "offload", "offloaded", lambda s, c: s.offload(c.item_id, fence=c.fence, handle="b1"),
    ),
    "cancelled": ("cancel", "cancelled", lambda s, c: s.cancel(c.item_id, reason="stop")),
}  # fmt: skip


@pytest.mark.parametrize("outcome", list(_SETTLES))
async def test_a_settle_saved_for_a_caller_cancelled_while_its_round_ran_is_counted(
    store: ControlStore, raw: Any, otel: Otel, outcome: str
) -> None:
    # The round commits the settle for nobody: the item's state has changed, so the
    # counter says so too.
    _, state, settle = _SETTLES[outcome]
    item_id = await store.enqueue("alpha", {"n": 1})
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == item_id
    settled = otel.total("asyncplane.items.settled", outcome=outcome)
    await cancelled_in_its_round(store, raw, settle(store, claim))
    raw.execute("COMMIT")
    await store.assign("alpha", "barrier")  # a write behind the settle's round
    assert (await store.item(item_id))["state"] == state
    assert otel.total("asyncplane.items.settled", outcome=outcome) - settled == 1


@pytest.mark.parametrize("outcome", list(_SETTLES))
async def test_a_settle_whose_caller_is_cancelled_as_its_answer_came_is_counted(
    store: ControlStore, otel: Otel, outcome: str
) -> None:
    # The answer is in the settle's future, and the caller is cancelled before it runs
    # again: the settle stands, and is counted as if its caller had seen it.
    method, state, settle = _SETTLES[outcome]
    item_id = await store.enqueue("alpha", {"n": 1})
    claim = await store.claim("w")
    assert claim is not None
    settled = otel.total("asyncplane.items.settled", outcome=outcome)
    await cancelled_as_answered(store, method, settle(store, claim))
    assert (await store.item(item_id))["state"] == state
    assert otel.total("asyncplane.items.settled", outcome=outcome) - settled == 1


async def test_a_finish_saved_unseen_counts_the_twins_it_settled(
    asyncplane_store_factory: Callable[..., Any], otel: Otel
) -> None:
    # Twins enqueued before the store knew its identity, fingerprinted afterwards: the
    # finish of one settles the others, counted though its caller never saw it.
    old: ControlStore = await asyncplane_store_factory("twins.db")
    await old.create_project("p", "P")
    twins = [await old.enqueue("p", {"task": "same"}) for _ in range(3)]
    new: ControlStore = await asyncplane_store_factory("twins.db", identity=("task",))
    await new.dedup_pending_against_done()  # fingerprints the old items
    claim = await new.claim("w")
    assert claim is not None and claim.item_id == twins[0]
    dedup = otel.total("asyncplane.items.dedup_settled", layer="settlement")
    await cancelled_as_answered(new, "finish", new.finish(claim.item_id, fence=claim.fence))
    assert [(await new.item(i))["state"] for i in twins] == ["done"] * 3
    assert otel.total("asyncplane.items.dedup_settled", layer="settlement") - dedup == 2


async def test_a_bulk_cancel_stopped_between_chunks_counts_the_chunks_it_saved(
    store: ControlStore, otel: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each chunk commits by itself, and is counted as it does: a call cancelled after
    # the first of three chunks leaves two items cancelled, and says so.
    await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
    cancelled = otel.total("asyncplane.items.settled", outcome="cancelled")
    backend = await engine_of(store).ready()
    step = backend.cancel_where
    tasks: list[asyncio.Task[Any]] = []

    async def then_cancel(op: Any) -> Any:
        answer = await step(op)
        tasks[0].cancel()  # seen at the call's next await
        return answer

    monkeypatch.setattr(backend, "cancel_where", then_cancel)
    tasks.append(asyncio.create_task(store.cancel_where(project_id="alpha", chunk=2)))
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    monkeypatch.undo()
    assert (await store.counts(project_id="alpha"))["cancelled"] == 2
    assert otel.total("asyncplane.items.settled", outcome="cancelled") - cancelled == 2


async def test_a_bulk_cancel_cancelled_while_a_chunk_ran_counts_that_chunk(
    store: ControlStore, raw: Any, otel: Otel
) -> None:
    # The chunk's round commits for nobody: its three items are cancelled, and counted.
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    cancelled = otel.total("asyncplane.items.settled", outcome="cancelled")
    await cancelled_in_its_round(store, raw, store.cancel_where(project_id="alpha", chunk=5))
    raw.execute("COMMIT")
    await store.assign("alpha", "barrier")  # a write behind the chunk's round
    assert (await store.counts(project_id="alpha"))["cancelled"] == 3
    assert otel.total("asyncplane.items.settled", outcome="cancelled") - cancelled == 3


async def test_a_bulk_cancel_cancelled_as_a_chunk_answered_counts_that_chunk(
    store: ControlStore, otel: Otel
) -> None:
    await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
    cancelled = otel.total("asyncplane.items.settled", outcome="cancelled")
    await cancelled_as_answered(
        store, "cancel_where", store.cancel_where(project_id="alpha", chunk=2)
    )
    assert (await store.counts(project_id="alpha"))["cancelled"] == 2
    assert otel.total("asyncplane.items.settled", outcome="cancelled") - cancelled == 2


async def test_write_rounds_are_measured(store: ControlStore, otel: Otel) -> None:
    rounds = otel.total("asyncplane.write.round.duration", backend=store.backend)
    sizes = otel.total("asyncplane.write.round.size", backend=store.backend)
    lock_waits = otel.total("asyncplane.write.lock_wait")
    await store.enqueue("alpha", {"n": 1})
    assert otel.total("asyncplane.write.round.duration", backend=store.backend) > rounds
    assert otel.total("asyncplane.write.round.size", backend=store.backend) > sizes
    if store.backend == "sqlite":
        assert otel.total("asyncplane.write.lock_wait") > lock_waits


async def test_gauges_give_items_by_state_and_project_once_read(
    store: ControlStore, clock: ManualClock, otel: Otel
) -> None:
    await store.create_project("beta", "Beta")
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    await store.enqueue("beta", {"n": 9})
    claim = await store.claim("w", project_id="alpha")
    assert claim is not None
    clock.advance(30.0)
    gauges = engine_of(store).gauges
    assert gauges is not None
    gauges.refreshed.clear()
    otel.points("asyncplane.items")  # a collection asks the store for a snapshot
    await gauges.refreshed.wait()

    def mine(name: str) -> dict[tuple[str, ...], float]:
        return {
            tuple(str(v) for k, v in sorted(p.attributes.items()) if k != "asyncplane.store"): (
                p.value
            )
            for p in otel.points(name)
            if p.attributes.get("asyncplane.store") == store.location
        }

    items = mine("asyncplane.items")
    assert items[("alpha", "ready")] == 2
    assert items[("alpha", "claimed")] == 1
    assert items[("beta", "ready")] == 1
    (age,) = mine("asyncplane.queue.oldest_ready_age").values()
    assert age == pytest.approx(30.0, abs=1.0)
    # No item ready any more: the age is 0, not gone (a backend keeping last values
    # would show 30 s for ever).
    await store.cancel_where(state="ready")
    gauges.refreshed.clear()
    otel.points("asyncplane.items")
    await gauges.refreshed.wait()
    assert list(mine("asyncplane.queue.oldest_ready_age").values()) == [0.0]
    await store.close()  # a closed store gives no more values
    assert not mine("asyncplane.items")


async def test_work_links_each_execution_to_the_span_that_enqueued_it(
    store: ControlStore, otel: Otel
) -> None:
    tracer = trace.get_tracer("producer")
    with tracer.start_as_current_span("request") as parent:
        item_id = await store.enqueue("alpha", {"n": 1})
    plain = await store.enqueue("alpha", {"n": 2})  # no span around it: its own trace
    seen: dict[int, Any] = {}

    async def handle(claim: ClaimedItem) -> Done:
        seen[claim.item_id] = trace.get_current_span().get_span_context()
        if claim.item_id == plain:
            raise RuntimeError("a failure the span records")
        return Done()

    await work(store, handle, until_empty=True, timeout=30)
    trace_id = parent.get_span_context().trace_id
    (enqueue,) = [s for s in otel.spans("asyncplane.enqueue") if s.context.trace_id == trace_id]
    assert enqueue.kind == trace.SpanKind.PRODUCER
    executions = {s.attributes["asyncplane.item_id"]: s for s in otel.spans("asyncplane.execute")}
    linked = executions[item_id]
    assert linked.kind == trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in linked.links] == [enqueue.context.span_id]
    assert linked.attributes["asyncplane.project"] == "alpha"
    assert linked.attributes["asyncplane.attempt"] == 1
    assert linked.attributes["asyncplane.fence"] == 1
    assert linked.attributes["asyncplane.outcome"] == "done"  # the settle counter's word
    assert seen[item_id].span_id == linked.context.span_id  # the handler ran inside it
    failed = executions[plain]
    (link,) = failed.links  # to its enqueue span, the root of a trace of its own
    assert link.context.trace_id != parent.get_span_context().trace_id
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert otel.total("asyncplane.execution.duration", project="alpha") >= 2


async def test_an_exception_the_span_cannot_render_still_settles(
    store: ControlStore, otel: Otel
) -> None:
    # The span records a handler's exception; one whose str() raises is recorded by its
    # type alone, and the item is still settled (retried), never stranded by the span.
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    item_id = await store.enqueue("alpha", {})

    async def handle(claim: ClaimedItem) -> Done:
        raise Unprintable

    summary = await work(store, handle, until_empty=True, timeout=30)
    assert summary.retried == 1
    assert (await store.item(item_id))["state"] == "deferred"
    (failed,) = otel.spans("asyncplane.execute")
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in failed.events] == [Unprintable.__qualname__]


async def test_a_drain_round_holds_one_execution_span_per_item(
    store: ControlStore, otel: Otel
) -> None:
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])

    async def execute(batch: list[ClaimedItem]) -> list[Any]:
        given = [Failed("zero"), Done(), Retry("later", delay=60)]
        return [given[c.payload["n"]] for c in batch]

    await drain(store, execute, batch_size=3)
    (round_span,) = [
        s for s in otel.spans("asyncplane.drain.round") if s.attributes["asyncplane.count"] == 3
    ]
    children = [s for s in otel.spans("asyncplane.execute") if s.parent is not None
                and s.parent.span_id == round_span.context.span_id]  # fmt: skip
    assert sorted(s.attributes["asyncplane.outcome"] for s in children) == [
        "done",
        "failed",
        "retried",
    ]


def test_the_trace_context_crosses_to_a_worker_in_another_process(
    location_of: Callable[[str], str], tmp_path: pathlib.Path, otel: Otel
) -> None:
    import asyncio

    location = location_of("traced.db")

    async def produce() -> tuple[int, Any]:
        async with ControlStore(location) as store:
            await store.create_project("alpha", "Alpha")
            with trace.get_tracer("producer").start_as_current_span("request"):
                item_id = await store.enqueue("alpha", {"n": 1})
            (span,) = [
                s for s in otel.spans("asyncplane.enqueue") if s.attributes["asyncplane.count"] == 1
            ]
            return item_id, span.context

    item_id, producer = asyncio.run(produce())
    spans_file = tmp_path / "spans.jsonl"
    subprocess.run(
        [sys.executable, str(HERE / "workers" / "trace_worker.py"), location, str(spans_file)],
        check=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    spans = [json.loads(line) for line in spans_file.read_text().splitlines() if line.strip()]
    (execute,) = [s for s in spans if s["name"] == "asyncplane.execute"]
    assert execute["attributes"]["asyncplane.item_id"] == item_id
    assert [link["context"]["trace_id"] for link in execute["links"]] == [
        f"0x{producer.trace_id:032x}"
    ]
    assert [link["context"]["span_id"] for link in execute["links"]] == [
        f"0x{producer.span_id:016x}"
    ]
    (step,) = [s for s in spans if s["name"] == "agent.step"]
    assert step["parent_id"] == execute["context"]["span_id"]  # the handler's span nests


def assert_script_passes(script: str, database: pathlib.Path) -> None:
    """Run ``script`` in a fresh interpreter (its own OpenTelemetry globals), the
    database's path its argument; it must print ``ok``."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(database)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_without_the_api_nothing_is_recorded_and_everything_works(tmp_path: pathlib.Path) -> None:
    script = """
import asyncio, sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
from asyncplane import ControlStore, Done, work, _telemetry
assert not _telemetry.ENABLED
async def main():
    async with ControlStore(sys.argv[1]) as store:
        await store.create_project("alpha", "Alpha")
        await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
        seen = []
        async def handle(claim):
            seen.append(claim.trace_context)
            return Done()
        summary = await work(store, handle, until_empty=True)
        assert summary.claimed == 5 and seen == [None] * 5, (summary, seen)
        assert (await store.counts())["done"] == 5
asyncio.run(main())
print("ok")
"""
    assert_script_passes(script, tmp_path / "plain.db")


def test_no_span_is_made_until_a_tracer_provider_is_set(tmp_path: pathlib.Path) -> None:
    # With the API installed and no provider set, a span would go to the proxy's no-op:
    # none is made (it costs more per item than the rest). A provider set later, with the
    # store open and the worker between runs, gets the next spans, linked as always.
    script = """
import asyncio, sys
from opentelemetry import context, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from asyncplane import ControlStore, Done, drain, work
made = []
for name in ("start_span", "start_as_current_span"):
    real = getattr(trace.ProxyTracer, name)
    def counting(self, span_name, *args, _real=real, **kwargs):
        made.append(span_name)
        return _real(self, span_name, *args, **kwargs)
    setattr(trace.ProxyTracer, name, counting)
async def handle(claim):
    return Done()
async def execute(batch):
    return [Done() for _ in batch]
incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
async def main():
    async with ControlStore(sys.argv[1]) as store:
        await store.create_project("alpha", "Alpha")
        await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
        assert (await work(store, handle, until_empty=True)).done == 5
        # A context the producer is in (its request's) is saved all the same.
        token = context.attach(propagate.extract({"traceparent": incoming}))
        try:
            await store.enqueue("alpha", {"n": 5})
        finally:
            context.detach(token)
        claim = await store.claim("w")
        assert claim.trace_context == {"traceparent": incoming}, claim.trace_context
        await store.release(claim.item_id, fence=claim.fence)
        assert (await drain(store, execute)).done == 1
        assert made == [], made
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
        assert (await work(store, handle, until_empty=True)).done == 3
        names = sorted(span.name for span in exporter.get_finished_spans())
        assert names == ["asyncplane.enqueue"] + ["asyncplane.execute"] * 3, names
asyncio.run(main())
print("ok")
"""
    assert_script_passes(script, tmp_path / "untraced.db")


def test_the_documented_names_are_the_recorded_ones() -> None:
    page = (HERE.parent / "docs" / "observability.md").read_text()
    for name in (
        *_telemetry.COUNTERS,
        *_telemetry.HISTOGRAMS,
        *_telemetry.GAUGES,
        *_telemetry.SPANS,
    ):
        assert f"`{name}`" in page, name


async def test_bulk_cancels_and_refused_renewals_are_counted(
    store: ControlStore, otel: Otel
) -> None:
    cancelled = otel.total("asyncplane.items.settled", outcome="cancelled")
    refusals = otel.total("asyncplane.fence.refusals", reason="cancelled")
    timed = otel.total("asyncplane.settle.duration", outcome="cancelled")
    await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    claim = await store.claim("w")
    assert claim is not None
    assert await store.cancel_where(project_id="alpha") == 4
    with pytest.raises(FenceRejected):
        await store.renew(claim.item_id, fence=claim.fence)
    assert otel.total("asyncplane.items.settled", outcome="cancelled") - cancelled == 4
    # A chunk is not one settle call's latency: it stays out of the histogram.
    assert otel.total("asyncplane.settle.duration", outcome="cancelled") == timed
    assert otel.total("asyncplane.fence.refusals", reason="cancelled") - refusals == 1


async def test_an_unreadable_trace_context_never_fails_a_claim(
    store: ControlStore, raw: Any
) -> None:
    # A trace context is a hint for tracing: one that cannot be read (tampered, or from a
    # buggy writer) is dropped, and the claim, and its neighbours in the batch, go on.
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    for item_id, text in zip(
        ids, ("[" * 100_000, '{"traceparent": "' + "x" * 20_000 + '"}', "[1, 2]"), strict=False
    ):
        raw.execute("UPDATE items SET trace_context = ? WHERE item_id = ?", (text, item_id))
    raw.execute(
        "UPDATE items SET trace_context = ? WHERE item_id = ?",
        ('{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",'
         ' "baggage": "user=alice", "uberctx-user": "alice", "ot-baggage-user": "alice",'
         ' "b3": "80f198ee56343ba8-e457b5a2e4d86bd1-1"}',
         ids[3]),
    )  # fmt: skip
    batch = await store.claim_batch("w", 4)
    assert [c.item_id for c in batch] == ids
    assert [c.trace_context for c in batch[:3]] == [None, None, None]
    assert batch[3].trace_context == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "b3": "80f198ee56343ba8-e457b5a2e4d86bd1-1",
    }  # the span's place, in any propagator's words; never baggage


async def test_an_enqueue_saves_the_span_not_the_baggage(store: ControlStore, otel: Otel) -> None:
    from opentelemetry import baggage, context

    token = context.attach(baggage.set_baggage("user.email", "alice@example.com"))
    try:
        with trace.get_tracer("test").start_as_current_span("request"):
            item_id = await store.enqueue("alpha", {})
    finally:
        context.detach(token)
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == item_id
    assert claim.trace_context is not None and set(claim.trace_context) == {"traceparent"}


async def test_an_enqueue_under_a_huge_tracestate_saves_the_span_without_it(
    store: ControlStore, otel: Otel
) -> None:
    # A caller's headers fill tracestate (kilobytes, past what a claim reads back): it
    # was saved in every item, and the claim then read no context at all.
    from opentelemetry import context, propagate

    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    state = ",".join(f"v{n}=" + "x" * 250 for n in range(32))  # W3C's most: 32, 256 chars
    token = context.attach(propagate.extract({"traceparent": incoming, "tracestate": state}))
    try:
        item_id = await store.enqueue("alpha", {})
    finally:
        context.detach(token)
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == item_id
    assert claim.trace_context is not None and set(claim.trace_context) == {"traceparent"}
    assert claim.trace_context["traceparent"].split("-")[1] == incoming.split("-")[1]


async def test_the_items_gauge_says_zero_and_stops_with_its_loop(
    store: ControlStore, otel: Otel
) -> None:
    await store.enqueue_many("alpha", [{"n": n} for n in range(2)])
    gauges = engine_of(store).gauges
    assert gauges is not None

    async def seen() -> dict[str, float]:
        gauges.refreshed.clear()
        otel.points("asyncplane.items")
        await gauges.refreshed.wait()
        return {
            p.attributes["asyncplane.state"]: p.value
            for p in otel.points("asyncplane.items")
            if p.attributes.get("asyncplane.store") == store.location
        }

    assert (await seen())["ready"] == 2
    for claim in await store.claim_batch("w", 2):
        await store.finish(claim.item_id, fence=claim.fence)
    counts = await seen()
    assert (counts["ready"], counts["done"], counts["claimed"]) == (0, 2, 0)  # 0, not gone


async def test_durations_fall_in_buckets_made_for_seconds(store: ControlStore, otel: Otel) -> None:
    await store.enqueue("alpha", {})
    assert await store.claim("w") is not None
    bounds = {tuple(p.explicit_bounds) for p in otel.points("asyncplane.claim.duration")}
    assert bounds == {SECONDS_BUCKETS}  # 0.5 ms up: not the SDK's, made for milliseconds
    assert SECONDS_BUCKETS[0] == 0.0005 and SECONDS_BUCKETS[-1] == 3600.0


def test_the_gauges_of_a_store_whose_loop_ended_say_nothing(
    tmp_path: pathlib.Path, otel: Otel
) -> None:
    store = ControlStore(tmp_path / "ended.db")

    async def main() -> None:
        await store.create_project("alpha", "Alpha")
        await store.enqueue("alpha", {})
        gauges = engine_of(store).gauges
        assert gauges is not None
        gauges.refreshed.clear()
        otel.points("asyncplane.items")
        await gauges.refreshed.wait()

    asyncio.run(main())  # ended without a close: nothing can refresh its gauges now

    def mine(name: str) -> list[Any]:
        return [
            p for p in otel.points(name) if p.attributes.get("asyncplane.store") == store.location
        ]

    assert not mine("asyncplane.items") and not mine("asyncplane.queue.oldest_ready_age")


def test_an_opentelemetry_namespace_without_the_api_is_no_api(tmp_path: pathlib.Path) -> None:
    # Another distribution's modules in the namespace (the protocol buffers, say) do not
    # make the API: asyncplane must not count on opentelemetry.metrics being there.
    (tmp_path / "opentelemetry" / "proto").mkdir(parents=True)
    (tmp_path / "opentelemetry" / "proto" / "__init__.py").write_text("")
    source = pathlib.Path(_telemetry.__file__).parent.parent
    script = (
        "import sys\n"
        f"sys.path = [{str(tmp_path)!r}, {str(source)!r}]"
        " + [p for p in sys.path if 'site-packages' not in p]\n"
        "from asyncplane import _telemetry\n"
        "assert not _telemetry.ENABLED and 'opentelemetry' not in sys.modules\n"
        "print('ok')\n"
    )
    assert_script_passes(script, tmp_path / "unused.db")


def test_the_api_is_found_in_a_zipped_install(tmp_path: pathlib.Path) -> None:
    # A PEX or a zipapp imports from a zip file, where no directory can be looked at:
    # the API found only there still turns telemetry on (and its absence keeps it off).
    import zipfile

    import asyncplane

    source = pathlib.Path(asyncplane.__file__).parent.parent
    for name, packages in (("app.zip", ("metrics", "trace")), ("proto.zip", ("proto",))):
        with zipfile.ZipFile(tmp_path / name, "w") as bundle:  # as zipapp makes them
            bundle.writestr("opentelemetry/", "")
            for package in packages:
                bundle.writestr(f"opentelemetry/{package}/", "")
                bundle.writestr(f"opentelemetry/{package}/__init__.py", "")
    for bundle_name, enabled in (("app.zip", "True"), ("proto.zip", "False")):
        script = (
            "import sys\n"
            f"sys.path[:0] = [{str(source)!r}, {str(tmp_path / bundle_name)!r}]\n"
            "from asyncplane import _telemetry\n"
            "print(_telemetry.ENABLED)\n"
        )
        # -S: no site-packages, so the API installed for the suite is not seen.
        done = subprocess.run(
            [sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=60
        )
        assert (done.stdout.strip(), done.stderr) == (enabled, ""), bundle_name


async def test_a_span_says_an_outcome_by_its_kind_not_its_class_name(
    store: ControlStore, otel: Otel
) -> None:
    class Finished(Done):
        """A handler's own outcome: a Done all the same."""

    class Imposter:
        """Named Done, but no outcome: the worker retries its item."""

    Imposter.__name__ = "Done"
    ids = await store.enqueue_many("alpha", [{"n": 0}, {"n": 1}])

    async def handle(claim: ClaimedItem) -> Any:
        return Finished() if claim.payload["n"] == 0 else Imposter()

    await work(store, handle, until_empty=True)
    said = {s.attributes["asyncplane.item_id"]: s.attributes["asyncplane.outcome"]
            for s in otel.spans("asyncplane.execute")}  # fmt: skip
    assert said == {ids[0]: "done", ids[1]: "invalid"}


@pytest.mark.postgresql_only
async def test_a_store_whose_reopen_failed_gives_no_gauge_values(
    location_of: Callable[[str], str], otel: Otel
) -> None:
    # Its connection lost and its reopen failed, the store was open no more: close() had
    # nothing to close, and its gauges gave their last values for ever (beside those of
    # the next store of the same name).
    import asyncpg

    from _signals import until
    from asyncplane import AsyncplaneError

    url = location_of("reopened")
    store = ControlStore(url)
    await store.create_project("p", "P")
    await store.enqueue("p", {})
    gauges = engine_of(store).gauges
    assert gauges is not None
    gauges.refreshed.clear()
    otel.points("asyncplane.items")  # a collection asks the store for a snapshot
    await gauges.refreshed.wait()

    def mine() -> list[Any]:
        points = otel.points("asyncplane.items")
        return [p for p in points if p.attributes.get("asyncplane.store") == store.location]

    assert mine()
    backend: Any = await engine_of(store).ready()
    writer = backend.writer
    conn = await asyncpg.connect(url)
    try:  # the write session ended, the store now a newer release's: its reopen fails
        await conn.execute("UPDATE asyncplane_meta SET value = '999' WHERE key = 'schema_version'")
        await conn.execute("SELECT pg_terminate_backend($1)", writer._conn.get_server_pid())
    finally:
        await conn.close()
    await until(lambda: not writer.running, what="the writer ends")
    with pytest.raises(AsyncplaneError):
        await store.enqueue("p", {})
    await store.close()
    assert not mine()


@pytest.mark.parametrize("where", ["start", "end"])
async def test_a_span_processor_that_raises_never_breaks_the_work(
    store: ControlStore, otel: Otel, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    # It raised out of asyncplane's spans into the caller: an enqueue committed yet
    # raising (a retry made a duplicate), work() and drain() stopped with their items
    # left claimed.
    from asyncplane import Done, drain, work

    caplog.set_level(logging.DEBUG, logger="asyncplane.store")
    otel.gate.broken = True
    if where == "end":  # (the start passes: broken from its end on)
        otel.gate.on_start = lambda span, parent_context=None: None  # type: ignore[method-assign]
    first = await store.enqueue("alpha", {"n": 1})  # an enqueue span
    second = await store.enqueue("alpha", {"n": 2})

    async def executor(batch: list[Any]) -> list[Any]:
        return [Done() for _ in batch]

    summary = await drain(store, executor, max_iters=1, batch_size=1)  # round, execute
    assert summary.done == 1

    async def handler(claim: Any) -> Done:
        return Done()

    assert (await work(store, handler, until_empty=True, timeout=30)).done == 1  # execute
    assert {(await store.item(i))["state"] for i in (first, second)} == {"done"}
    # Said (the first of a process at WARNING, with its traceback; the rest at DEBUG).
    assert any("the tracing of asyncplane." in r.getMessage() for r in caplog.records)


async def test_closed_gauges_start_no_refresh_for_a_collection_under_way(
    store: ControlStore, otel: Otel
) -> None:
    # A collection that took the live gauges before the store closed asked the closed
    # ones for a refresh: a task nobody tracked read the closing store's stats.
    gauges = engine_of(store).gauges
    assert gauges is not None
    under_way = _telemetry._live()  # the collection's copy
    assert gauges in under_way
    await store.close()
    assert gauges.request() is False
    gauges._start()  # (as a request queued before the close would)
    assert gauges._refreshing is None or gauges._refreshing.done()
