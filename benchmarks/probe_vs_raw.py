"""The probe's drain rate beside raw SQLite's ceiling, measured in the same run.

    python benchmarks/probe_vs_raw.py [--workers 16] [--items 10000] [--repeats 3]

The raw ceiling: W plain sqlite3 worker processes (this script, in --raw-worker mode)
draining the same schema, one BEGIN IMMEDIATE transaction per claim and one per finish,
each writing its event row; the clock runs from the moment every worker is ready until
the last one says its drain is over (not until it exits), as the probe's own rate does.
Then the probe's concurrent-queue with the same workers and items, at --concurrency 1
and 8, with synchronous NORMAL and FULL.

Targets (issue 3): probe C=1 >= 0.8x raw NORMAL; probe C=8 >= 2x raw NORMAL; probe C=8
FULL >= 2x raw FULL. Each rate is the median of the repeats; the ratios compare medians.
The report also shows the least busy worker and the longest single wait for the write
lock, so starvation is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import _raw

from asyncplane import ControlStore, _loops


def raw_worker(path: str, synchronous: str, name: str) -> None:
    """Drain the queue with plain sqlite3; print the count and the longest lock wait."""
    conn = _raw.connect(path, synchronous)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu = _raw.cpu_seconds()
    done, longest = _raw.drain(conn, name)
    cpu = _raw.cpu_seconds() - cpu
    print(json.dumps({"done": done, "longest": longest, "cpu": cpu}), flush=True)
    _raw.hold_until_told()


async def seed(path: pathlib.Path, items: int, synchronous: str) -> None:
    async with ControlStore(path, synchronous=synchronous) as store:  # type: ignore[arg-type]
        await store.create_project("probe", "Probe")
    _raw.seed(str(path), "probe", items)


def run_raw(tmp: pathlib.Path, workers: int, items: int, synchronous: str) -> dict[str, float]:
    path = tmp / f"raw-{synchronous}-{time.monotonic_ns()}.db"
    asyncio.run(seed(path, items, synchronous))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--raw-worker", str(path), synchronous, f"raw{n}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(workers)
    ]
    return _raw.drain_figures(procs, items, "raw")


def run_probe(
    tmp: pathlib.Path, workers: int, items: int, concurrency: int, synchronous: str
) -> dict[str, float]:
    path = tmp / f"probe-{synchronous}-{concurrency}-{time.monotonic_ns()}.db"
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", str(path), "--json",
         "--scenario", "concurrent-queue", "--workers", str(workers), "--items", str(items),
         "--concurrency", str(concurrency), "--synchronous", synchronous],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if not done.stdout.strip():
        raise SystemExit(f"the probe failed to run: {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    if not report["passed"]:
        raise SystemExit(f"the probe failed: {report['failures']}")
    if report["event_loop"] != _loops.chosen():  # the loop the report will name
        raise SystemExit(f"the probe's workers ran on {report['event_loop']!r}")
    got = {k: report[k] for k in ("items_per_s", "per_worker_min", "max_lock_wait_s")}
    return {**got, "cpu_s": report["worker_cpu_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--full-items", type=int, default=4_000, help="items for the FULL runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    runs: dict[str, list[dict[str, float]]] = {}
    plan = [
        ("raw NORMAL", lambda t: run_raw(t, args.workers, args.items, "NORMAL")),
        ("probe C=1 NORMAL", lambda t: run_probe(t, args.workers, args.items, 1, "NORMAL")),
        ("probe C=8 NORMAL", lambda t: run_probe(t, args.workers, args.items, 8, "NORMAL")),
        ("raw FULL", lambda t: run_raw(t, args.workers, args.full_items, "FULL")),
        ("probe C=8 FULL", lambda t: run_probe(t, args.workers, args.full_items, 8, "FULL")),
    ]
    with tempfile.TemporaryDirectory(prefix="asyncplane-probe-bench-") as tmp:
        for _ in range(args.repeats):
            for label, measure in plan:  # interleaved, so noise hits every line alike
                runs.setdefault(label, []).append(measure(pathlib.Path(tmp)))

    def median(label: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[label])

    rates = {label: median(label, "items_per_s") for label in runs}
    ratios = {
        "probe C=1 / raw NORMAL": (rates["probe C=1 NORMAL"] / rates["raw NORMAL"], 0.8),
        "probe C=8 / raw NORMAL": (rates["probe C=8 NORMAL"] / rates["raw NORMAL"], 2.0),
        "probe C=8 FULL / raw FULL": (rates["probe C=8 FULL"] / rates["raw FULL"], 2.0),
    }
    if args.json:
        print(json.dumps({"runs": runs, "rates": rates, "ratios": ratios}))
        return 0
    print(
        f"{args.workers} worker processes; {args.items} items (FULL: {args.full_items}); "
        f"median of {args.repeats}"
    )
    for label in runs:
        print(
            f"  {label:<18} {rates[label]:>9,.0f} items/s   least busy worker "
            f"{median(label, 'per_worker_min'):>5.0f} items, longest lock wait "
            f"{median(label, 'max_lock_wait_s') * 1000:>6.1f} ms"
        )
    for label, (ratio, target) in ratios.items():
        verdict = "meets" if ratio >= target else "MISSES"
        print(f"  {label:<26} {ratio:5.2f}x  ({verdict} target {target}x)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-worker":
        raw_worker(*sys.argv[2:5])
        sys.exit(0)
    sys.exit(main())
