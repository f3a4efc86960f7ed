"""What the worker runtime costs per item: work() beside a hand-written claim loop.

    python benchmarks/work_vs_loop.py [--items 3000] [--repeats 5] [--json]
    python benchmarks/work_vs_loop.py --url postgresql://...   (the same on PostgreSQL)
    python benchmarks/work_vs_loop.py --postgres               (on a throwaway cluster)

One process, one SQLite file per measurement (on PostgreSQL: one schema, on the server at
``--url`` or, with ``--postgres``, on a throwaway cluster of the machine's PostgreSQL
server programs), items whose
handler returns ``Done()`` at once, so what is measured is the runtime itself and the
store beneath it:

* **loop, C**: C coroutines that each ``claim()`` and ``finish()`` until nothing is left
  (the probe's concurrent-queue worker);
* **work(), C**: ``work(store, handle, concurrency=C, until_empty=True)``, which also
  renews each item's lease, enforces its time limit, settles its outcome and claims for
  freed slots in batches.

At C = 1 and C = 16, in turns and repeated (medians); it prints the rates, the CPU per
item and work()'s ratio to the loop at each C. The loop is the floor of what the store
costs; the ratio is the price of the runtime's guarantees per item. Items that take real
time (an agent's calls) hide it: see ``benchmarks/agent_workload.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pathlib
import statistics
import tempfile
import time

import pg_probe_vs_raw as pg

from asyncplane import ClaimedItem, ControlStore, Done, _loops, work

CONCURRENCIES = (1, 16)


async def _measure(path: str, items: int, concurrency: int, runtime: str) -> dict[str, float]:
    async with ControlStore(path) as store:
        await store.create_project("p", "P")
        await store.enqueue_many("p", [{"n": n} for n in range(items)])
        await store.counts()  # the readers open before the clock starts
        started, cpu = time.perf_counter(), time.process_time()
        if runtime == "work()":

            async def handle(claim: ClaimedItem) -> Done:
                return Done()

            summary = await work(store, handle, concurrency=concurrency, until_empty=True)
            done = summary.done
        else:

            async def one(name: str) -> int:
                finished = 0
                while (claim := await store.claim(name)) is not None:
                    await store.finish(claim.item_id, fence=claim.fence)
                    finished += 1
                return finished

            done = sum(await asyncio.gather(*(one(f"w{n}") for n in range(concurrency))))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if done != items:
        raise SystemExit(f"{runtime} at C={concurrency} settled {done} of {items} items")
    return {"items_per_s": items / seconds, "cpu_per_item_us": cpu / items * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    pg.add_postgres_arguments(parser)
    args = parser.parse_args()
    postgres = pg.postgres_wanted(args)

    sides = [(runtime, c) for c in CONCURRENCIES for runtime in ("loop", "work()")]
    runs: dict[str, list[dict[str, float]]] = {f"{r}, C={c}": [] for r, c in sides}
    with contextlib.ExitStack() as stack:
        if postgres:
            url = stack.enter_context(pg.server(args.url))
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncplane-work-"))
        for repeat in range(args.repeats):
            for runtime, c in sides:  # in turns, so the machine's noise hits every side alike
                name = f"{runtime[:4]}_{c}_{repeat}"
                if postgres:
                    path = _loops.run(pg.fresh_schema(url, f"bench_work_{name}"))
                else:
                    path = str(pathlib.Path(tmp) / f"{name}.db")
                runs[f"{runtime}, C={c}"].append(_loops.run(_measure(path, args.items, c, runtime)))
    table = {
        side: {key: statistics.median(run[key] for run in got) for key in got[0]}
        for side, got in runs.items()
    }
    ratios = {
        f"work() / loop, C={c}": table[f"work(), C={c}"]["items_per_s"]
        / table[f"loop, C={c}"]["items_per_s"]
        for c in CONCURRENCIES
    }
    where = "postgresql" if postgres else "sqlite"
    if args.json:
        fields = {"items": args.items, "repeats": args.repeats, "backend": where}
        print(json.dumps({**fields, "table": table, "ratios": ratios}))
        return 0
    print(f"{args.items} items a run, {where}, medians of {args.repeats}")
    for side, row in table.items():
        print(
            f"  {side:<14} {row['items_per_s']:>8,.0f} items/s  "
            f"CPU per item {row['cpu_per_item_us']:>6,.0f} µs"
        )
    for name, figure in ratios.items():
        print(f"  {name:<20} {figure:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
