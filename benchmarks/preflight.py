"""What a preflight step costs on a store with a large backlog, and what the look saves.

    python benchmarks/preflight.py [--items N] [--repeats R] [--json]

One SQLite file with ``--items`` pending items, each with its own fingerprint (a store
with an ``identity``), none with a done twin: the usual case, in which a preflight step
(once a second in work(), once a round in drain()) finds nothing to settle. It times,
interleaved and repeated (median):

* the look: the read `Engine.preflight_step` makes first (`Backend.any_pending_twin`);
* the write it saves: the twin settlement's own transaction (`settle_pending_twins`),
  which holds the write lock of every process on the file while it looks;
* a whole `preflight_step` (the backfill's step, then the look).

It prints each in milliseconds and the look's share of the write (the figures in
docs/architecture.md come from here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asyncplane import ControlStore, _backend
from asyncplane._store import engine_of


async def measure(items: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "preflight.db"
        async with ControlStore(str(path), identity=("task",)) as store:
            await store.create_project("p", "P")
            for start in range(0, items, 5000):
                payloads = [{"task": f"t{n}"} for n in range(start, min(items, start + 5000))]
                await store.enqueue_many("p", payloads)
            engine = engine_of(store)
            backend = await engine.ready()
            op = _backend.PreflightOp(500, None, None)
            sides: dict[str, Callable[[], Awaitable[Any]]] = {
                "look (read)": lambda: backend.any_pending_twin(op),
                "settle write": lambda: backend.settle_pending_twins(op),
                "preflight_step": lambda: engine.preflight_step(500),
            }
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(repeats):
                for name, call in sides.items():
                    started = time.perf_counter()
                    await call()
                    times[name].append(time.perf_counter() - started)
    ms = {name: statistics.median(seen) * 1000 for name, seen in times.items()}
    return {
        "items": items,
        "ms": ms,
        "look / write": ms["look (read)"] / ms["settle write"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(measure(args.items, args.repeats))
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.items} pending fingerprinted items, no twin done (median of {args.repeats}):")
    for name, value in report["ms"].items():
        print(f"  {name:<15} {value:8.1f} ms")
    print(f"  look / write    {report['look / write']:8.2f}x")


if __name__ == "__main__":
    main()
