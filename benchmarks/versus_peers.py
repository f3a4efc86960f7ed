"""asyncplane beside its peers on the fleet's real shape, every side measured in one run.

    python benchmarks/versus_peers.py [--workers 16] [--items 10000] [--repeats 3]
                                      [--sqlite-only | --postgres-only] [--url URL]

SQLite (one file, W worker processes, synchronous NORMAL unless FULL is said):

* **raw**: plain sqlite3 per item (`_raw.drain`): one BEGIN IMMEDIATE transaction per
  claim and one per finish, each with its event row, on asyncplane's own schema.
* **huey**: huey's `SqliteStorage`, W processes each doing what a huey consumer's worker
  does for every task (`dequeue`, then `execute`, which runs it and stores its result).
  huey keeps no lease, fence or ledger, so it does less per item. It is installed into
  the benchmark's environment only (``pip install huey``), never a dependency.
* **probe C=1 / C=8**: ``asyncplane.probe --scenario concurrent-queue`` with W workers of
  C coroutines each.

PostgreSQL (a throwaway cluster, fsync on, unless --url): raw SKIP LOCKED per item,
pgqueuer (``pip install pgqueuer``) draining as many jobs, and the probe at C=1 and C=8.

Every clock runs from the moment every worker is warm until the last one says its drain
is over (its result line; the probe's, its summary), not until it exits: start-up and
shut-down are not timed, on any side. The sides take turns, repeat, and each figure is
the median. For each side the script prints its rate, its ratio to raw (and to huey or
pgqueuer), the least busy worker, the longest single wait for SQLite's write lock (on
PostgreSQL the worst worker's claim latency p99), and the CPU seconds the workers spent
per 1,000 items (each worker's own user + system time from its go line to its last item:
start-up is not counted). huey's wait is the longest single dequeue or execute call,
which holds any lock wait it had.

The report starts with the machine: its CPUs, how long a pure-Python loop
(``sum(range(1000))``) took at the start and at the end of the run, and the event loop
asyncplane's processes ran on (uvloop when it is installed, the ``speed`` extra;
``ASYNCPLANE_LOOP=asyncio`` runs them on the standard loop, `asyncplane._loops`).
asyncplane's side of a ratio is mostly Python and raw's mostly SQLite's C, so between
sessions (a host that runs Python slower, a neighbour that takes the caches) the ratios
move with that figure even though each is measured in one run.

The targets of issue 17 are printed with a verdict each, on the medians, and beside it
the same figure in each repeat (the sides of a repeat ran one after another, so a repeat's
ratio compares neighbours in time; on a shared machine the spread between repeats is
part of the answer). The script exits 0 either way (it measures, it does not judge a
noisy machine's run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from typing import Any

import _raw
import pg_probe_vs_raw as pg
import probe_vs_raw as lite

from asyncplane import _loops

Run = dict[str, float]


# --- huey -----------------------------------------------------------------------------------


def _huey(path: str, synchronous: str) -> Any:
    """A SqliteHuey on ``path`` at the given synchronous level (huey itself offers OFF or
    FULL through ``fsync``; the comparison needs NORMAL too, so its connection is set)."""
    from huey import SqliteHuey
    from huey.storage import SqliteStorage

    class Storage(SqliteStorage):  # type: ignore[misc]
        def _create_connection(self) -> Any:
            conn = super()._create_connection()
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            return conn

    huey = SqliteHuey("bench", filename=path, storage_class=Storage)
    return huey


def _huey_task(huey: Any) -> Any:
    @huey.task()
    def job(n: int) -> int:
        return n

    return job


def huey_worker(path: str, synchronous: str) -> None:
    """One consumer process: dequeue and execute (which stores the result) until empty."""
    huey = _huey(path, synchronous)
    _huey_task(huey)
    huey.storage.queue_size()  # the connection made before ready
    print("ready", flush=True)
    sys.stdin.readline()
    cpu = _raw.cpu_seconds()
    done, longest = 0, 0.0
    while True:
        asked = time.perf_counter()
        task = huey.dequeue()
        took = time.perf_counter() - asked
        if task is None:
            break
        asked = time.perf_counter()
        huey.execute(task)
        longest = max(longest, took, time.perf_counter() - asked)
        done += 1
    cpu = _raw.cpu_seconds() - cpu
    print(json.dumps({"done": done, "longest": longest, "cpu": cpu}), flush=True)
    _raw.hold_until_told()


def huey_seed(path: str, items: int) -> None:
    """Enqueue ``items`` tasks, in one transaction (seeding is not what is measured)."""
    huey = _huey(path, "NORMAL")
    job = _huey_task(huey)
    storage = huey.storage
    with storage.db(commit=True) as cursor:
        for n in range(items):
            message = huey.serialize_task(job.s(n))
            cursor.execute(
                "INSERT INTO task (queue, data, priority) VALUES (?, ?, 0)",
                (storage.name, storage.to_blob(message)),
            )


def run_huey(tmp: pathlib.Path, workers: int, items: int, synchronous: str) -> Run:
    path = str(tmp / f"huey-{synchronous}-{time.monotonic_ns()}.db")
    huey_seed(path, items)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--huey-worker", path, synchronous],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(workers)
    ]
    return _raw.drain_figures(procs, items, "huey")


def huey_available() -> bool:
    try:
        import huey  # noqa: F401
    except ImportError:
        return False
    return True


# --- the runs ---------------------------------------------------------------------------------


def sqlite_plan(args: argparse.Namespace) -> list[tuple[str, int, Callable[[pathlib.Path], Run]]]:
    w, n, full = args.workers, args.items, args.full_items
    plan: list[tuple[str, int, Callable[[pathlib.Path], Run]]] = [
        ("raw", n, lambda t: lite.run_raw(t, w, n, "NORMAL")),
        ("probe C=1", n, lambda t: lite.run_probe(t, w, n, 1, "NORMAL")),
        ("probe C=8", n, lambda t: lite.run_probe(t, w, n, 8, "NORMAL")),
        ("raw FULL", full, lambda t: lite.run_raw(t, w, full, "FULL")),
        ("probe C=8 FULL", full, lambda t: lite.run_probe(t, w, full, 8, "FULL")),
    ]
    if huey_available():
        plan.insert(1, ("huey", n, lambda t: run_huey(t, w, n, "NORMAL")))
    else:
        print("huey is not installed here: pip install huey, for its figures", file=sys.stderr)
    return plan


def postgres_plan(args: argparse.Namespace, url: str) -> list[tuple[str, int, Callable[[], Run]]]:
    w, n = args.workers, args.items
    plan: list[tuple[str, int, Callable[[], Run]]] = [
        ("raw", n, lambda: pg.run_raw(url, w, n)),
        ("probe C=1", n, lambda: pg.run_probe(url, w, n, 1)),
        ("probe C=8", n, lambda: pg.run_probe(url, w, n, 8)),
    ]
    if pg.pgqueuer_available():
        plan.insert(1, ("pgqueuer", n, lambda: pg.run_pgqueuer(url, w, n) or {}))
    else:
        print("pgqueuer is not installed here: pip install pgqueuer", file=sys.stderr)
    return plan


def summarise(runs: dict[str, list[Run]], sizes: dict[str, int]) -> dict[str, dict[str, float]]:
    """The median of each figure over the repeats, and CPU seconds per 1,000 items."""
    table: dict[str, dict[str, float]] = {}
    for label, got in runs.items():
        got = [r for r in got if r]
        if not got:
            continue
        row = {key: statistics.median(r[key] for r in got if key in r) for key in got[0]}
        table[label] = _with_cpu_per_1000(row, sizes[label])
    return table


def repeats(runs: dict[str, list[Run]], sizes: dict[str, int]) -> list[dict[str, dict[str, float]]]:
    """Each repeat's own table: every side's figures as that repeat measured them."""
    count = max((len(got) for got in runs.values()), default=0)
    return [
        {
            label: _with_cpu_per_1000(dict(got[i]), sizes[label])
            for label, got in runs.items()
            if i < len(got) and got[i]
        }
        for i in range(count)
    ]


def _with_cpu_per_1000(row: dict[str, float], size: int) -> dict[str, float]:
    if "cpu_s" in row:
        row["cpu_per_1000_s"] = row["cpu_s"] / size * 1000
    return row


def with_each_repeat(
    targets: list[Any], each: list[list[Any]]
) -> list[tuple[str, float | None, str, float, list[float | None]]]:
    """The targets on the medians, each with its figure in every repeat (None in a repeat
    where a side it needs did not run)."""
    return [
        (name, value, op, target, [t[i][1] for t in each] if value is not None else [])
        for i, (name, value, op, target) in enumerate(targets)
    ]


def _ratio(
    table: dict[str, dict[str, float]], a: str, b: str, key: str = "items_per_s"
) -> float | None:
    """``a``'s figure over ``b``'s, or None where either side did not run."""
    if a not in table or b not in table or not table[b].get(key):
        return None
    return table[a][key] / table[b][key]


def _fair_share(table: dict[str, dict[str, float]], workers: int, items: int) -> float | None:
    if "probe C=8" not in table:
        return None
    return table["probe C=8"]["per_worker_min"] / (items / workers / 2)


def sqlite_targets(table: dict[str, dict[str, float]], workers: int, items: int) -> list[Any]:
    c8 = table.get("probe C=8")
    return [
        ("probe C=8 / huey", _ratio(table, "probe C=8", "huey"), ">=", 1.5),
        ("probe C=8 / raw", _ratio(table, "probe C=8", "raw"), ">=", 1.5),
        ("probe C=8 least busy worker / half fair share",
         _fair_share(table, workers, items), ">=", 1.0),
        ("probe C=8 longest lock wait (ms)",
         None if c8 is None else c8["max_lock_wait_s"] * 1000, "<=", 250),
        ("probe C=1 / raw", _ratio(table, "probe C=1", "raw"), ">=", 0.6),
        ("probe C=8 FULL / raw FULL", _ratio(table, "probe C=8 FULL", "raw FULL"), ">=", 2.0),
        ("probe C=8 CPU per item / raw's",
         _ratio(table, "probe C=8", "raw", "cpu_per_1000_s"), "<=", 2.0),
    ]  # fmt: skip


def postgres_targets(table: dict[str, dict[str, float]]) -> list[Any]:
    return [
        ("probe C=8 / pgqueuer", _ratio(table, "probe C=8", "pgqueuer"), ">=", 1.0),
        ("probe C=1 / raw", _ratio(table, "probe C=1", "raw"), ">=", 0.6),
    ]


def cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def python_loop_us() -> float:
    """How long this machine takes for ``sum(range(1000))`` just now, in µs (best of 5)."""
    return min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6


def show_machine(machine: dict[str, Any]) -> None:
    start, end = machine["python_loop_us"]
    print(
        f"Machine: {machine['cpus']} CPUs; sum(range(1000)) in Python took {start:.1f} µs at "
        f"the start, {end:.1f} µs at the end (the ratios below move with it between runs); "
        f"asyncplane's processes on {machine['event_loop']}"
    )


def show(title: str, table: dict[str, dict[str, float]], targets: list[Any], wait: str) -> None:
    print(title)
    print(
        f"  {'side':<16} {'items/s':>9} {'x raw':>6} {'least busy':>10} "
        f"{wait:>16} {'CPU s/1000':>10}"
    )
    for label, row in table.items():
        raw = "raw FULL" if label.endswith("FULL") else "raw"
        waited = row.get("max_lock_wait_s", row.get("claim_p99_s"))
        ratio = _ratio(table, label, raw)
        print(
            f"  {label:<16} {row['items_per_s']:>9,.0f} "
            + (f"{ratio:>5.2f}x " if ratio is not None else f"{'n/a':>6} ")
            + f"{row['per_worker_min']:>10,.0f} "
            + (f"{waited * 1000:>13.1f} ms" if waited is not None else f"{'n/a':>16}")
            + (f" {row['cpu_per_1000_s']:>10.3f}" if "cpu_per_1000_s" in row else "")
        )
    for name, value, op, target, each in targets:
        if value is None:
            print(f"  {name:<48} {'n/a':>8}  (a side did not run)")
            continue
        met = value >= target if op == ">=" else value <= target
        verdict = f"({'meets' if met else 'MISSES'} {op} {target})"
        figures = ", ".join("n/a" if v is None else f"{v:.2f}" for v in each)
        print(f"  {name:<48} {value:8.2f}  {verdict:<18} each repeat: {figures}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--full-items", type=int, default=4_000, help="items for FULL runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url", help="a PostgreSQL server instead of a throwaway cluster")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--sqlite-only", action="store_true")
    side.add_argument("--postgres-only", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--huey-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.huey_worker:
        huey_worker(*args.huey_worker)
        return 0
    report: dict[str, Any] = {"workers": args.workers, "items": args.items}
    loop_at_start = python_loop_us()
    if not args.postgres_only:
        runs: dict[str, list[Run]] = {}
        plan = sqlite_plan(args)
        with tempfile.TemporaryDirectory(prefix="asyncplane-peers-") as tmp:
            for _ in range(args.repeats):
                for label, _size, measure in plan:  # in turns: noise weighs on all alike
                    runs.setdefault(label, []).append(measure(pathlib.Path(tmp)))
        sizes = {label: size for label, size, _ in plan}
        report["sqlite"] = summarise(runs, sizes)
        report["sqlite_targets"] = with_each_repeat(
            sqlite_targets(report["sqlite"], args.workers, args.items),
            [sqlite_targets(t, args.workers, args.items) for t in repeats(runs, sizes)],
        )
    if not args.sqlite_only:
        pg_runs: dict[str, list[Run]] = {}
        with pg.server(args.url) as url:
            pg_plan = postgres_plan(args, url)
            for _ in range(args.repeats):
                for label, _size, pg_measure in pg_plan:
                    pg_runs.setdefault(label, []).append(pg_measure())
        pg_sizes = {label: size for label, size, _ in pg_plan}
        report["postgres"] = summarise(pg_runs, pg_sizes)
        report["postgres_targets"] = with_each_repeat(
            postgres_targets(report["postgres"]),
            [postgres_targets(t) for t in repeats(pg_runs, pg_sizes)],
        )
    report["machine"] = {
        "cpus": cpus(),
        "python_loop_us": [loop_at_start, python_loop_us()],
        "event_loop": _loops.chosen(),  # the probe's, and so its workers' (ASYNCPLANE_LOOP)
    }
    if args.json:
        print(json.dumps(report))
        return 0
    median = f"median of {args.repeats}"
    show_machine(report["machine"])
    if "sqlite" in report:
        show(
            f"SQLite, {args.workers} worker processes, {args.items:,} items "
            f"(FULL: {args.full_items:,}), {median}:",
            report["sqlite"], report["sqlite_targets"], "longest lock wait",
        )  # fmt: skip
    if "postgres" in report:
        show(
            f"PostgreSQL, {args.workers} worker processes, {args.items:,} items, {median}:",
            report["postgres"], report["postgres_targets"], "claim p99",
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
