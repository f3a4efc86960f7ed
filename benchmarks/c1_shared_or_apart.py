"""Where the fleet's C=1 rate is bounded: sharing one file, or each process's own cost.

    python benchmarks/c1_shared_or_apart.py [--workers 16] [--items 10000] [--repeats 3]

W worker processes, each claiming and finishing one item at a time until none is left,
in five shapes, in turns and repeated (the median of the repeats; ratios in the same
run):

* **raw, one file**: plain sqlite3, one BEGIN IMMEDIATE transaction per claim and one per
  finish, each writing its event row (`benchmarks/probe_vs_raw.py`'s raw ceiling);
* **raw, a file each**: the same workers, each draining a file of its own (items / W);
* **asyncplane, one file**: one coroutine per process, ``store.claim()`` then
  ``store.finish()``, as the probe's concurrent-queue at C=1 does;
* **asyncplane, a file each**: the same, each process on a store of its own, so no write
  lock is ever contended and no round is combined;
* **asyncplane, one file, next claim with the finish**: one coroutine per process still,
  but it asks for its next item in the same turn of the event loop as it reports the last
  one (``asyncio.gather(store.finish(...), store.claim(...))``), so both go in one round:
  one hand-off to the connection's thread and back per item instead of two. It is not a
  shape raw sqlite3 is measured in here (raw could put both in one transaction too); it
  shows what the hand-offs cost each process.

All five use asyncplane's schema (the same indexes and ledger trigger). The ratios say
what each thing costs: asyncplane apart / raw apart is what one process's claim and
finish cost beside raw's when nothing is shared; one file / a file each, for either
side, is what sharing the file costs it. If asyncplane's two shapes drain alike, the
write lock and the combining of rounds are not what bounds C=1: each process's own work
per item is. The CPU column (the workers' user and system time over the drain, start-up
left out) says the same per item.
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
from collections.abc import Callable

import _raw
import probe_vs_raw

from asyncplane import ControlStore, _loops

SHAPES = (
    "raw, one file",
    "raw, a file each",
    "asyncplane, one file",
    "asyncplane, a file each",
    "asyncplane, one file, next claim with the finish",
)


async def _store_drain(path: str, name: str, together: str = "") -> None:
    async with ControlStore(path) as store:
        await store.counts()  # the store open and its threads started before "ready"
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        cpu = _raw.cpu_seconds()
        done, longest = 0, 0.0
        asked = time.perf_counter()
        claim = await store.claim(name)
        while claim is not None:
            longest = max(longest, time.perf_counter() - asked)
            finishing = store.finish(claim.item_id, fence=claim.fence, status="done")
            if together:  # the finish and the next claim in one round
                asked = time.perf_counter()
                _, claim = await asyncio.gather(finishing, store.claim(name))
            else:
                await finishing
                asked = time.perf_counter()
                claim = await store.claim(name)
            done += 1
        cpu = _raw.cpu_seconds() - cpu
        # Said before the store closes: closing is not the drain (`_raw.go_and_wait`).
        print(json.dumps({"done": done, "longest": longest, "cpu": cpu}), flush=True)
        await asyncio.to_thread(_raw.hold_until_told)


def _seeded(tmp: pathlib.Path, label: str, files: int, items: int) -> list[pathlib.Path]:
    """``files`` fresh stores sharing ``items`` ready items between them."""
    stamp = time.monotonic_ns()
    paths = [tmp / f"{label}-{stamp}-{n}.db" for n in range(files)]
    for n, path in enumerate(paths):
        share = items // files + (1 if n < items % files else 0)
        asyncio.run(probe_vs_raw.seed(path, share, "NORMAL"))
    return paths


def _run(tmp: pathlib.Path, shape: str, workers: int, items: int) -> dict[str, float]:
    store_side = shape.startswith("asyncplane")
    apart = shape.endswith("a file each")
    together = shape.endswith("with the finish")
    paths = _seeded(tmp, "store" if store_side else "raw", workers if apart else 1, items)
    procs = []
    for n in range(workers):
        path = str(paths[n] if apart else paths[0])
        if store_side:
            argv = [sys.executable, __file__, "--store-worker", path, f"w{n}"]
            argv += ["together"] if together else []
        else:
            argv = [sys.executable, probe_vs_raw.__file__, "--raw-worker", path, "NORMAL"]
            argv.append(f"raw{n}")
        pipe = subprocess.PIPE
        procs.append(subprocess.Popen(argv, stdin=pipe, stdout=pipe, text=True))
    got = _raw.drain_figures(procs, items, shape)
    return {**got, "cpu_per_1000_s": got["cpu_s"] / items * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.items < args.workers:
        parser.error("--items must be at least --workers: every file gets an item")

    runs: dict[str, list[dict[str, float]]] = {shape: [] for shape in SHAPES}
    with tempfile.TemporaryDirectory(prefix="asyncplane-c1-") as tmp:
        for _ in range(args.repeats):
            for shape in SHAPES:  # in turns, so the machine's noise hits every shape alike
                runs[shape].append(_run(pathlib.Path(tmp), shape, args.workers, args.items))

    def median(shape: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[shape])

    def ratio(top: str, bottom: str, key: str = "items_per_s") -> float:
        return median(top, key) / median(bottom, key)

    table = {shape: {key: median(shape, key) for key in runs[shape][0]} for shape in SHAPES}
    ratios: dict[str, Callable[[], float]] = {
        "asyncplane one file / raw one file": lambda: ratio(SHAPES[2], SHAPES[0]),
        "asyncplane a file each / raw a file each": lambda: ratio(SHAPES[3], SHAPES[1]),
        "asyncplane one file / asyncplane a file each": lambda: ratio(SHAPES[2], SHAPES[3]),
        "raw one file / raw a file each": lambda: ratio(SHAPES[0], SHAPES[1]),
        "asyncplane CPU per item / raw's, a file each":
            lambda: ratio(SHAPES[3], SHAPES[1], "cpu_per_1000_s"),
        "next claim with the finish / asyncplane one file": lambda: ratio(SHAPES[4], SHAPES[2]),
    }  # fmt: skip
    report = {
        "workers": args.workers,
        "items": args.items,
        "repeats": args.repeats,
        "table": table,
        "ratios": {name: figure() for name, figure in ratios.items()},
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.workers} workers, {args.items} items, one at a time, medians of {args.repeats}")
    for shape, row in table.items():
        print(
            f"  {shape:<48} {row['items_per_s']:>8,.0f} items/s  "
            f"least busy worker {row['per_worker_min']:>6,.0f}  "
            f"longest wait {row['max_lock_wait_s'] * 1000:>6,.0f} ms  "
            f"CPU per 1,000 items {row['cpu_per_1000_s']:.2f} s"
        )
    for name, figure in report["ratios"].items():
        print(f"  {name:<50} {figure:.2f}x")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--store-worker":
        _loops.run(_store_drain(*sys.argv[2:5]))
        sys.exit(0)
    sys.exit(main())
