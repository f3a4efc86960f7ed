"""What OpenTelemetry costs the claim+finish loop: three kinds of process, one run.

    python benchmarks/telemetry.py [--items N] [--repeats R] [--json]

Each measurement is `claim_finish.py`'s own loop (``run_store``: coroutines that claim
and finish until the queue is empty, on a fresh SQLite file), in a process of its own of
one of three kinds, interleaved repeat by repeat so that a noisy neighbour hits them
alike:

* ``none``: the OpenTelemetry API cannot be imported (as without the ``otel`` extra);
* ``api``: the API installed, no provider configured (the API's no-op instruments);
* ``sdk``: the SDK with an in-memory metric reader and an in-memory span exporter.

It prints each rate (the median of the repeats) for 1 and 64 coroutines, and the ratios
to ``none``. Target: ``api`` within 5% of ``none`` (a ratio of at least 0.95); ``sdk``
is reported, as the cost of recording everything.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).parent
KINDS = ("none", "api", "sdk")


def child(kind: str, path: str, coroutines: int, items: int) -> None:
    """Run one measurement in this process and print its rate as JSON."""
    if kind == "none":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]
    if kind == "sdk":
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)
    import asyncio

    import claim_finish

    from asyncplane import _loops, _telemetry

    assert _telemetry.ENABLED is (kind != "none"), kind
    database = pathlib.Path(path)
    asyncio.run(claim_finish.prepare(database, items, "NORMAL"))
    done, elapsed, _ = _loops.run(claim_finish.run_store(database, coroutines, "NORMAL"))
    assert done == items, (done, items)
    print(json.dumps({"rate": done / elapsed}))


def measure(kind: str, root: pathlib.Path, n: int, coroutines: int, items: int) -> float:
    path = root / f"{kind}-{coroutines}-{n}.db"
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(path), str(coroutines), str(items)],
        capture_output=True, text=True, check=True, cwd=HERE,
    )  # fmt: skip
    return float(json.loads(done.stdout.strip().splitlines()[-1])["rate"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "PATH", "COROUTINES", "ITEMS"))
    args = parser.parse_args()
    if args.child:
        kind, path, coroutines, items = args.child
        child(kind, path, int(coroutines), int(items))
        return 0
    rates: dict[str, dict[int, list[float]]] = {k: {1: [], 64: []} for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for n in range(args.repeats):
            for coroutines in (1, 64):
                order = KINDS if n % 2 == 0 else tuple(reversed(KINDS))
                for kind in order:
                    rate = measure(kind, root, n, coroutines, args.items)
                    rates[kind][coroutines].append(rate)
    median = {k: {c: statistics.median(v) for c, v in by.items()} for k, by in rates.items()}
    report = {
        "items": args.items,
        "repeats": args.repeats,
        "rates": median,
        "api_vs_none": {c: median["api"][c] / median["none"][c] for c in (1, 64)},
        "sdk_vs_none": {c: median["sdk"][c] / median["none"][c] for c in (1, 64)},
    }
    if args.json:
        print(json.dumps(report))
    else:
        for coroutines in (1, 64):
            print(f"{coroutines:>2} coroutine(s): " + ", ".join(
                f"{k} {median[k][coroutines]:,.0f}/s" for k in KINDS
            ))  # fmt: skip
            print(
                f"   api/none {report['api_vs_none'][coroutines]:.3f} (target >= 0.95), "
                f"sdk/none {report['sdk_vs_none'][coroutines]:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
