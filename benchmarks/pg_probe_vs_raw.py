"""The probe's drain rate on PostgreSQL beside a raw SKIP LOCKED baseline, in the same run.

    python benchmarks/pg_probe_vs_raw.py [--workers 16] [--items 10000] [--repeats 3]
                                         [--url postgresql://...]

Without --url the script starts a throwaway PostgreSQL cluster (asyncplane.testing.
PostgresCluster, fsync on: the durability a deployment has) and removes it afterwards.

The raw baseline: W worker processes (this script, in --raw-worker mode), each with one
asyncpg connection, draining asyncplane's own schema with one transaction per claim
(SELECT ... FOR UPDATE SKIP LOCKED in claim order, UPDATE, event row) and one per finish
(fenced UPDATE, event row): the fastest honest way to do by hand what the store does. Its
clock runs from the moment every worker is ready until the last one says its drain is
over (not until it exits), as the probe's own rate does. Then the probe's
concurrent-queue with the same workers and items, at --concurrency 1 and 8. pgqueuer, if
it is installed, drains the same number of jobs with the same workers, for a third figure
(it keeps no ledger: a lighter job). The raw and pgqueuer workers run on the event loop
the probe's workers run on (`asyncplane._loops`: uvloop when installed, or as
ASYNCPLANE_LOOP says), so that no side gains by its loop alone.

Target (issue 7): probe C=8 >= 1x raw. Each rate is the median of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import pathlib
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import _raw

from asyncplane import ControlStore, _loops, testing

T = TypeVar("T")

CLAIM = """
SELECT item_id, fence FROM items WHERE state = 'ready'
ORDER BY priority DESC, service_class, sla NULLS LAST, item_id
LIMIT 1 FOR UPDATE SKIP LOCKED
"""
TAKE = """
UPDATE items SET state = 'claimed', fence = fence + 1, attempts = attempts + 1,
                 owner = $1, lease_expires_at = $2, updated_at = $3
WHERE item_id = $4 RETURNING fence
"""
FINISH = """
UPDATE items SET state = 'done', lease_expires_at = NULL, updated_at = $1
WHERE item_id = $2 AND state = 'claimed' AND fence = $3
"""
EVENT = (
    "INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail) "
    "VALUES ($1, $2, $3, $4, NULL, $5, NULL)"
)


async def raw_drain(url: str, owner: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    cpu = _raw.cpu_seconds()
    done = 0
    claims: list[float] = []
    while True:
        asked = time.perf_counter()
        async with conn.transaction():
            row = await conn.fetchrow(CLAIM)
            if row is None:
                break
            now = time.time()
            fence = await conn.fetchval(TAKE, owner, now + 900, now, row[0])
            await conn.execute(EVENT, row[0], "claimed", fence, owner, now)
        claims.append(time.perf_counter() - asked)
        async with conn.transaction():
            now = time.time()
            await conn.execute(FINISH, now, row[0], fence)
            await conn.execute(EVENT, row[0], "done", fence, owner, now)
        done += 1
    cpu = _raw.cpu_seconds() - cpu
    # Said before the connection closes: closing is not the drain (`_raw.go_and_wait`).
    print(json.dumps({"done": done, "cpu": cpu, "claim_p99": p99(claims)}), flush=True)
    await asyncio.to_thread(_raw.hold_until_told)
    await conn.close()


def p99(values: list[float]) -> float:
    """The 99th percentile of ``values`` (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)  # nearest rank: of 100, the 99th
    return ordered[max(0, math.ceil(len(ordered) * 0.99) - 1)]


#: This run's mark, put on every schema it makes (`marked`): two runs sharing a server
#: never empty or drop each other's schemas.
RUN = f"{os.getpid()}_{secrets.token_hex(3)}"

#: The schemas this run has made, each with its server's URL, to drop when it ends
#: (`drop_made_schemas`).
_made: dict[str, str] = {}


def marked(name: str) -> str:
    """``name`` with this run's mark: the schema `fresh_schema` makes for it."""
    return f"{name}_{RUN}"


async def fresh_schema(url: str, name: str) -> str:
    """The URL of schema ``name`` (with this run's mark) on the server at ``url``, made
    empty; `drop_made_schemas` drops it again."""
    schema = marked(name)
    _made[schema] = url
    fresh = f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    await testing.execute_sql(url, fresh)
    return testing.with_schema(url, schema)


async def drop_made_schemas() -> None:
    """Drop every schema this run made (a server the user named keeps nothing of a run)."""
    while _made:
        schema, url = _made.popitem()
        await testing.execute_sql(url, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def dropping_made_schemas(main: Awaitable[T]) -> T:
    """``main`` run to its end, then every schema this run made dropped."""
    try:
        return await main
    finally:
        await drop_made_schemas()


async def fresh_store(url: str | None, folder: str, name: str) -> str:
    """A fresh store's location: a file ``name``.db in ``folder`` (url None, SQLite), or a
    schema bench_``name`` on the server at ``url``, made empty."""
    if url is None:
        return str(pathlib.Path(folder) / f"{name}.db")
    return await fresh_schema(url, "bench_" + name.replace("-", "_"))


async def seed(url: str, items: int) -> None:
    async with ControlStore(url) as store:
        await store.create_project("probe", "Probe")
        for start in range(0, items, 1000):
            await store.enqueue_many(
                "probe", [{"n": n} for n in range(start, min(items, start + 1000))]
            )


def start_workers(
    command: list[list[str]], env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for c in command
    ]


def run_raw(url: str, workers: int, items: int) -> dict[str, float]:
    schema = asyncio.run(fresh_schema(url, "raw"))
    asyncio.run(seed(schema, items))
    procs = start_workers(
        [[sys.executable, __file__, "--raw-worker", schema, f"raw{n}"] for n in range(workers)]
    )
    return _raw.drain_figures(procs, items, "raw", worst=("claim_p99", "claim_p99_s"))


def run_probe(url: str, workers: int, items: int, concurrency: int) -> dict[str, float]:
    schema = asyncio.run(fresh_schema(url, "probe"))
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", schema, "--json",
         "--scenario", "concurrent-queue", "--workers", str(workers), "--items", str(items),
         "--concurrency", str(concurrency)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if not done.stdout.strip():
        raise SystemExit(f"the probe failed to run: {done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    if not report["passed"]:
        raise SystemExit(f"the probe failed: {report['failures']}")
    if report["event_loop"] != _loops.chosen():  # the raw and pgqueuer workers' loop too
        raise SystemExit(f"the probe's workers ran on {report['event_loop']!r}")
    got = {k: report[k] for k in ("items_per_s", "per_worker_min")}
    return {**got, "cpu_s": report["worker_cpu_s"], "claim_p99_s": report["claim_p99_s"]}


def pgqueuer_available() -> bool:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


async def pgqueuer_enqueue(url: str, items: int) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(url)
    queries = Queries(AsyncpgDriver(conn))
    for start in range(0, items, 1000):
        count = min(items, start + 1000) - start
        await queries.enqueue(["job"] * count, [b"{}"] * count, [0] * count)
    await conn.close()


async def pgqueuer_drain(url: str, owner: str) -> None:
    """Drain pgqueuer jobs of one entrypoint until none is left; print the count."""
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(url)
    pgq = PgQueuer(AsyncpgDriver(conn))
    done = 0

    @pgq.entrypoint("job")
    async def job(_: Any) -> None:
        nonlocal done
        done += 1

    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    cpu = _raw.cpu_seconds()

    async def stop_when_empty() -> None:
        watch = await asyncpg.connect(url)  # PgQueuer's own connection is busy dequeuing
        try:
            while await watch.fetchval("SELECT count(*) FROM pgqueuer"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        finally:
            await watch.close()
        pgq.shutdown.set()

    watcher = asyncio.create_task(stop_when_empty())
    await pgq.run(dequeue_timeout=datetime.timedelta(seconds=0.05))
    await watcher
    cpu = _raw.cpu_seconds() - cpu
    print(json.dumps({"done": done, "cpu": cpu}), flush=True)  # before closing, as raw's
    await asyncio.to_thread(_raw.hold_until_told)
    await conn.close()


def run_pgqueuer(url: str, workers: int, items: int) -> dict[str, float] | None:
    schema_name = marked("pgq")
    schema = asyncio.run(fresh_schema(url, "pgq"))
    env = {**os.environ, "PGQUEUER_SCHEMA": schema_name}
    installed = subprocess.run(
        [sys.executable, "-m", "pgqueuer", "--pg-dsn", url, "--schema", schema_name, "install"],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    if installed.returncode != 0:
        print(f"pgqueuer: could not install its schema: {installed.stderr[-500:]}", file=sys.stderr)
        return None

    # Enqueued by a process of its own: pgqueuer reads its schema setting once, at import.
    subprocess.run(
        [sys.executable, __file__, "--pgqueuer-enqueue", schema, str(items)],
        check=True, env=env,
    )  # fmt: skip
    procs = start_workers(
        [[sys.executable, __file__, "--pgqueuer-worker", schema, f"q{n}"] for n in range(workers)],
        env=env,
    )
    results, seconds = _raw.go_and_wait(procs, missing='{"done": 0}')
    done = sum(r["done"] for r in results)
    if done < items:
        print(f"pgqueuer: {done} of {items} jobs ran", file=sys.stderr)
        return None
    return {
        "items_per_s": items / seconds,
        "per_worker_min": min(r["done"] for r in results),
        "cpu_s": sum(r.get("cpu", 0.0) for r in results),
    }


def add_postgres_arguments(parser: argparse.ArgumentParser) -> None:
    """A benchmark's choice of PostgreSQL: ``--url`` (this server) or ``--postgres`` (a
    throwaway cluster of the machine's server programs); neither, SQLite."""
    parser.add_argument("--url", help="measure on PostgreSQL, on this server")
    parser.add_argument(
        "--postgres", action="store_true", help="measure on PostgreSQL, on a throwaway cluster"
    )


def postgres_wanted(args: argparse.Namespace) -> bool:
    """Whether `add_postgres_arguments`' choice asks for PostgreSQL."""
    return bool(args.postgres or args.url is not None)


def measured_on(args: argparse.Namespace, measure: Callable[[str | None], Awaitable[T]]) -> T:
    """``measure(url)`` run to its end, with the server `add_postgres_arguments`' choice
    asks for (a throwaway cluster stopped after), or ``None`` for SQLite."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(server(args.url)) if postgres_wanted(args) else None
        return asyncio.run(measure(url))


def run_benchmark(
    doc: str | None,
    measure: Callable[[argparse.Namespace, str | None], Awaitable[dict[str, Any]]],
    **sizes: int,
) -> tuple[argparse.Namespace, dict[str, Any]] | None:
    """A benchmark's command line, run: each of ``sizes`` an integer option (``--name``,
    its default), then ``--json`` and `add_postgres_arguments`' choice; ``measure(args,
    url)`` run on that choice (`measured_on`). With ``--json`` the report is printed as
    JSON and None comes back; otherwise (args, report), for the benchmark to print."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", action="store_true")
    add_postgres_arguments(parser)
    args = parser.parse_args()
    report = measured_on(args, lambda url: measure(args, url))
    if args.json:
        print(json.dumps(report))
        return None
    return args, report


@contextlib.contextmanager
def server(url: str | None) -> Iterator[str]:
    if url:
        try:
            yield url
        finally:
            asyncio.run(drop_made_schemas())
        return
    with testing.PostgresCluster(fsync=True) as cluster:
        yield cluster.url()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url", help="a server to use instead of a throwaway cluster")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--raw-worker", nargs=2, metavar=("URL", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--pgqueuer-worker", nargs=2, metavar=("URL", "NAME"), help=argparse.SUPPRESS
    )
    parser.add_argument("--pgqueuer-enqueue", nargs=2, metavar=("URL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_worker:
        _loops.run(raw_drain(*args.raw_worker))  # on the loop the probe's workers run on
        return 0
    if args.pgqueuer_worker:
        _loops.run(pgqueuer_drain(*args.pgqueuer_worker))
        return 0
    if args.pgqueuer_enqueue:
        asyncio.run(pgqueuer_enqueue(args.pgqueuer_enqueue[0], int(args.pgqueuer_enqueue[1])))
        return 0
    runs: dict[str, list[dict[str, float]]] = {"raw": [], "probe C=1": [], "probe C=8": []}
    with server(args.url) as url:
        for _ in range(args.repeats):  # the sides take turns: noise weighs on all alike
            runs["raw"].append(run_raw(url, args.workers, args.items))
            runs["probe C=1"].append(run_probe(url, args.workers, args.items, 1))
            runs["probe C=8"].append(run_probe(url, args.workers, args.items, 8))
            if pgqueuer_available():
                got = run_pgqueuer(url, args.workers, args.items)
                if got is not None:
                    runs.setdefault("pgqueuer", []).append(got)

    def median(label: str, key: str = "items_per_s") -> float:
        return statistics.median(r[key] for r in runs[label])

    raw = median("raw")
    report: dict[str, Any] = {
        "workers": args.workers,
        "items": args.items,
        "repeats": args.repeats,
        "rates": {label: median(label) for label in runs},
        "per_worker_min": {
            label: statistics.median(r["per_worker_min"] for r in runs[label]) for label in runs
        },
        "ratios": {f"{label} / raw": median(label) / raw for label in runs if label != "raw"},
        "pgqueuer": "pgqueuer" in runs,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"PostgreSQL drain, {args.workers} worker processes, {args.items:,} items, "
        f"median of {args.repeats}:"
    )
    for label, rate in report["rates"].items():
        print(f"  {label:<12} {rate:>9,.0f} items/s  (least busy worker "
              f"{report['per_worker_min'][label]:,})")  # fmt: skip
    for label, ratio in report["ratios"].items():
        target = "  (target 1.0x: " + ("meets" if ratio >= 1 else "MISSES") + ")"
        print(f"  {label:<18} {ratio:.2f}x" + (target if label.startswith("probe C=8") else ""))
    if not report["pgqueuer"]:
        print("  pgqueuer: not installed here (pip install pgqueuer for a third figure)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
