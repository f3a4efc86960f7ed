"""A worker process for the tracing test: runs work() over a store with the OpenTelemetry
SDK configured, exporting its spans as JSON lines to a file, until the store is empty.

Usage: python trace_worker.py LOCATION SPANS_FILE
"""

from __future__ import annotations

import asyncio
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from asyncplane import ClaimedItem, ControlStore, Done, work


async def main(location: str, spans_file: str) -> None:
    with open(spans_file, "w") as out:  # noqa: ASYNC230 - once, before any work
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(
                ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
            )
        )
        trace.set_tracer_provider(provider)

        async def handle(claim: ClaimedItem) -> Done:
            with trace.get_tracer("agent").start_as_current_span("agent.step"):
                return Done({"ran": claim.item_id})

        async with ControlStore(location) as store:
            await work(store, handle, concurrency=2, until_empty=True)
        provider.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
