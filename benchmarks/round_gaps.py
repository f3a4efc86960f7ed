"""Where a group-committed round's wall time goes: the loop, the thread, the hand-offs.

    python benchmarks/round_gaps.py [--coroutines C] [--items N] [--repeats R] [--json]

A diagnostic, not a comparison with a peer. It runs `claim_finish.py`'s loop (C
coroutines claiming and finishing on one store, separate calls) in child processes, in
turns: one free to use every CPU, one pinned to a single CPU (``sched_setaffinity``, as
``taskset -c 0`` would). In each it stamps four moments of every round:

* ``post``: the loop hands the round to the connection's thread (`_connection.post`);
* ``start`` and ``end``: the thread begins the round and is done with it, its outcomes
  handed to the loop (`_writer._execute_round`);
* ``deliver``: the loop hands the callers their outcomes (`_writer._deliver`).

and prints the medians of the gaps: post to start and end to deliver are hand-offs
between the two threads, start to end the round on the thread, deliver to the next post
the callers' own work on the loop. With every caller in every round (the convoy 64
coroutines make) the two threads take turns, so a pair's wall time is the sum of the
four; pinned, both threads share one CPU and a hand-off wakes no idle one. What the two
kinds of child differ by in the hand-offs is what waking another CPU costs here.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import claim_finish

from asyncplane import _connection, _loops, _writer

GAPS = ("post->start", "start->end", "end->deliver", "deliver->post")


def child(path: str, coroutines: int, pin: bool) -> None:
    """One measurement in this process: the gaps' medians and the pairs' rate, as JSON."""
    if pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    stamps: list[tuple[str, float]] = []
    execute_round, deliver, post = _writer._execute_round, _writer._deliver, _connection.post

    def stamped_round(db: Any, *args: Any) -> None:
        stamps.append(("start", time.perf_counter()))
        try:
            execute_round(db, *args)
        finally:
            stamps.append(("end", time.perf_counter()))

    def stamped_deliver(*args: Any) -> None:
        stamps.append(("deliver", time.perf_counter()))
        deliver(*args)

    def stamped_post(*args: Any) -> None:
        stamps.append(("post", time.perf_counter()))
        post(*args)

    _writer._execute_round = stamped_round
    _writer._deliver = stamped_deliver
    _connection.post = stamped_post
    done, elapsed, _ = _loops.run(claim_finish.run_store(pathlib.Path(path), coroutines, "NORMAL"))
    kept = stamps[20:-20]  # the start and the end of the run are not its steady state
    gaps: dict[str, list[float]] = {gap: [] for gap in GAPS}
    for (was, at), (now, then) in itertools.pairwise(kept):
        if f"{was}->{now}" in gaps:
            gaps[f"{was}->{now}"].append((then - at) * 1e6)
    print(
        json.dumps(
            {
                "pairs_per_s": done / elapsed,
                "gaps_us": {gap: statistics.median(values) for gap, values in gaps.items()},
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coroutines", type=int, default=64)
    parser.add_argument("--items", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "COROUTINES", "PIN"))
    args = parser.parse_args()
    if args.child:
        path, coroutines, pin = args.child
        child(path, int(coroutines), pin == "pinned")
        return 0
    results: dict[str, list[dict[str, Any]]] = {"free": [], "pinned": []}
    with tempfile.TemporaryDirectory(prefix="asyncplane-bench-") as tmp:
        for repeat in range(args.repeats):
            for kind in results:
                path = pathlib.Path(tmp) / f"{repeat}-{kind}.db"
                asyncio.run(claim_finish.prepare(path, args.items, "NORMAL"))
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(path), str(args.coroutines), kind],
                    check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                results[kind].append(json.loads(out))
    summary = {
        kind: {
            "pairs_per_s": statistics.median(r["pairs_per_s"] for r in runs),
            "gaps_us": {g: statistics.median(r["gaps_us"][g] for r in runs) for g in GAPS},
        }
        for kind, runs in results.items()
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    cpus = len(os.sched_getaffinity(0))
    print(
        f"{args.coroutines} coroutines, {args.items} items, medians of {args.repeats}, "
        f"{cpus} CPUs: a round's moments, in µs"
    )
    print(f"  {'':<14}" + "".join(f"{kind:>12}" for kind in summary))
    for gap in GAPS:
        print(f"  {gap:<14}" + "".join(f"{s['gaps_us'][gap]:>12.0f}" for s in summary.values()))
    print(f"  {'pairs/s':<14}" + "".join(f"{s['pairs_per_s']:>12,.0f}" for s in summary.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
