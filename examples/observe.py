"""Seeing a fleet: OpenTelemetry metrics and traces, and the dashboard beside the workers.

A web request enqueues work inside its own span; a worker runs it. The worker's execution
span links back to the request's trace, the counters say what was claimed and how it
settled, and the dashboard (served on the same event loop) gives the fleet's counts as
JSON and Prometheus text. Needs the extras and the SDK:

    pip install 'asyncplane[otel,dashboard]' opentelemetry-sdk
    python examples/observe.py [DATABASE | URL]  # default: a fresh file in a temp directory
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import tempfile

import aiohttp
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asyncplane import ClaimedItem, ControlStore, Done, Failed, Outcome, work
from asyncplane.dashboard import Dashboard

# The application configures OpenTelemetry once, before its stores open; asyncplane only
# records through the API. A real fleet exports to a collector instead (see
# docs/observability.md).
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
spans = InMemorySpanExporter()
tracing = TracerProvider()
tracing.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(tracing)


async def main(location: str) -> None:
    async with ControlStore(location) as store:
        await store.create_project("docs", "Documents to summarise")
        with trace.get_tracer("web").start_as_current_span("POST /summaries") as request:
            await store.enqueue_many("docs", [{"doc": n} for n in range(12)])

        async def summarise(claim: ClaimedItem) -> Outcome:
            if claim.payload["doc"] == 7:
                return Failed("the document is empty")
            return Done({"summary": f"doc {claim.payload['doc']}, in brief"})

        summary = await work(store, summarise, concurrency=4, until_empty=True)
        print(f"worked: {summary.done} done, {summary.failed} failed")

        trace_id = request.get_span_context().trace_id
        runs = [s for s in spans.get_finished_spans() if s.name == "asyncplane.execute"]
        linked = [r for r in runs if any(link.context.trace_id == trace_id for link in r.links)]
        print(f"execution spans linked to the request's trace: {len(linked)} of {len(runs)}")

        settled: dict[str, int] = {}
        data = reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == "asyncplane.items.settled":
                        for point in metric.data.data_points:
                            outcome = str(point.attributes["asyncplane.outcome"])
                            settled[outcome] = settled.get(outcome, 0) + int(point.value)
        print(f"asyncplane.items.settled: {dict(sorted(settled.items()))}")

        dashboard = Dashboard(store)
        url = await dashboard.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/api/stats") as response:
                    stats = await response.json()
                async with session.get(url + "/metrics") as response:
                    scraped = await response.text()
        finally:
            await dashboard.stop()
        print(f"dashboard /api/stats: {stats['states']['done']} done, "
              f"{stats['states']['failed']} failed")  # fmt: skip
        line = next(x for x in scraped.splitlines() if 'state="done"' in x and "items{" in x)
        print(f"dashboard /metrics: {line}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(str(pathlib.Path(tmp) / "observe.db")))
