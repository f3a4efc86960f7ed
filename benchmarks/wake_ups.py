"""What one process's claims and finishes cost the fleet's other processes: wake-ups.

    python benchmarks/wake_ups.py --postgres [--items N] [--idle P] [--repeats R] [--json]
    python benchmarks/wake_ups.py --url postgresql://...
    python benchmarks/wake_ups.py               (SQLite: no notifications, for comparison)

``--idle`` processes open the store and do nothing else; one coroutine in this process
claims and finishes ``--items`` items, one at a time, on a fresh store (a PostgreSQL
schema or an SQLite file), in two kinds, in turns:

* plain: items without a fingerprint;
* fingerprinted: each item with a content of its own (no twin ever waits).

On PostgreSQL every store keeps a connection listening for the store's NOTIFYs, which say
"work may have become claimable", and every NOTIFY wakes every listening process. A plain
claim or finish notifies nobody. Until PostgreSQL's migration 13 the settle of a
fingerprinted item notified every time (a twin of it might have been waiting), whether or
not a twin existed; now only when it frees one, so neither kind here notifies.

It prints, for each kind, the pairs per second, the NOTIFYs heard per pair (a listener of
this process counts them), and the CPU the idle processes spent per pair, all of them
together (their rusage from when the pairs began to when they ended), each the median of
``--repeats`` (docs/architecture.md, "What a fingerprint costs the fleet").
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import fingerprinted
import pg_probe_vs_raw as pg

from asyncplane import ControlStore

KINDS = fingerprinted.KINDS


async def _idle(location: str) -> None:
    """One idle process: the store open, its CPU from "go" to "stop" printed."""
    async with ControlStore(location):
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # go
        before = resource.getrusage(resource.RUSAGE_SELF)
        await loop.run_in_executor(None, sys.stdin.readline)  # stop
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(f"{cpu:.6f}", flush=True)


#: How long an idle process may take to answer (start, or give its CPU figure): far above
#: what one takes, so that a stuck one ends the run with an error instead of hanging it.
ANSWER_SECONDS = 120.0


async def _answer(process: subprocess.Popen[str]) -> str:
    """The next line ``process`` prints, read off the event loop, within ANSWER_SECONDS."""
    assert process.stdout is not None
    read = asyncio.get_running_loop().run_in_executor(None, process.stdout.readline)
    try:
        return (await asyncio.wait_for(read, ANSWER_SECONDS)).strip()
    except asyncio.TimeoutError:  # not the builtin before Python 3.11
        raise RuntimeError(f"an idle process said nothing for {ANSWER_SECONDS:.0f} s") from None


def _tell(processes: list[subprocess.Popen[str]], line: str) -> None:
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(line + "\n")
        process.stdin.flush()


async def _run(
    location: str, url: str | None, kind: str, items: int, idle: int
) -> dict[str, float]:
    """One kind on a fresh store: pairs/s, NOTIFYs heard a pair, idle CPU µs a pair."""
    heard = 0
    async with ControlStore(location) as store:
        await fingerprinted.fill(store, kind, items)
        command = [sys.executable, __file__, "--idle", location]
        processes = pg.start_workers([command] * idle)
        listener: Any = None
        try:
            for process in processes:
                if await _answer(process) != "ready":
                    raise RuntimeError("an idle process did not start")
            if url is not None:
                import asyncpg

                listener = await asyncpg.connect(location)
                schema = await listener.fetchval("SELECT current_schema()")

                def count(conn: Any, pid: int, channel: str, payload: str) -> None:
                    nonlocal heard
                    heard += payload == schema  # this store's: not another's on the server

                await listener.add_listener("asyncplane", count)
            _tell(processes, "go")
            started = time.perf_counter()
            for _ in range(items):
                claim = await store.claim("worker")
                assert claim is not None
                await store.finish(claim.item_id, fence=claim.fence)
            elapsed = time.perf_counter() - started
            if listener is not None:
                await listener.execute("SELECT 1")  # what was sent before is heard by now
            _tell(processes, "stop")
            cpu = 0.0
            for process in processes:
                cpu += float(await _answer(process))
        finally:
            if listener is not None:
                await listener.close()
            for process in processes:
                if process.stdin is not None:
                    process.stdin.close()
                try:
                    process.wait(ANSWER_SECONDS)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    return {
        "pairs_per_second": items / elapsed,
        "notifies_per_pair": heard / items,
        "idle_cpu_us_per_pair": cpu / items * 1e6,
    }


async def measure(items: int, idle: int, repeats: int, url: str | None) -> dict[str, Any]:
    seen: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as folder:
        for n in range(repeats):
            for kind in KINDS:
                location = await pg.fresh_store(url, folder, f"wake_ups_{kind}_{n}")
                seen[kind].append(await _run(location, url, kind, items, idle))
    figures = {
        kind: {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        for kind, runs in seen.items()
    }
    return {
        "backend": "sqlite" if url is None else "postgresql",
        "items": items,
        "idle": idle,
        "figures": figures,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--idle":
        asyncio.run(_idle(sys.argv[2]))
        return
    ran = pg.run_benchmark(
        __doc__,
        lambda args, url: measure(args.items, args.idle, args.repeats, url),
        items=3_000,
        idle=8,
        repeats=3,
    )
    if ran is None:
        return
    args, report = ran
    print(
        f"{args.items:,} claims and finishes, {report['backend']}, {args.idle} idle processes"
        f" (median of {args.repeats}):"
    )
    print(f"  {'':<14} {'pairs/s':>8} {'NOTIFYs a pair':>15} {'idle CPU a pair':>16}")
    for kind in KINDS:
        figures = report["figures"][kind]
        print(
            f"  {kind:<14} {figures['pairs_per_second']:8,.0f}"
            f" {figures['notifies_per_pair']:15.2f} {figures['idle_cpu_us_per_pair']:13.0f} µs"
        )


if __name__ == "__main__":
    main()
