"""What a preflight step costs on a store with a large backlog, and what drain() pays for it.

    python benchmarks/preflight.py [--items N] [--repeats R] [--json]
    python benchmarks/preflight.py --postgres        (the same on a throwaway cluster)
    python benchmarks/preflight.py --url postgresql://...   (or on this server)

One SQLite file (or PostgreSQL schema) with ``--items`` pending items, each with its own
fingerprint (a store with an ``identity``), none with a done twin: the usual case, in
which a preflight step (once a second in work(), once a round in drain()) finds nothing
to settle. It times,
interleaved and repeated (median):

* the full walk: every pending item joined against its done twins, which each step made
  until a step looked only at the twin pairs noted as they formed
  (`Backend.twin_pairs`, now read by a full pass only);
* the step's look at the noted pairs (`Backend.any_twin_noted`);
* a whole `Engine.preflight_step`: the backfill's look for items without a fingerprint
  after its mark, then the look at the noted pairs;
* a step that settles one pair, formed just before it (an item failed, its twin done, the
  first requeued), in a project of its own.

Then what drain() pays for it, in the same run: 1,600 items (100 rounds of 16) drained
from the backlog of ``--items``, and from a backlog of 2,000 on a store of its own, each
repeated; the ratio of the two rates is near 1 when a round's cost does not grow with the
backlog (before the noted pairs, 137 against 1,908 items/s at 100,000 and 2,000).

It prints each in milliseconds (the figures in docs/architecture.md come from here).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ClaimedItem, ControlStore, Done, Outcome, _backend, drain
from asyncplane._store import engine_of

IDENTITY = ("task",)
SMALL_BACKLOG = 2_000
DRAINED = 1_600  # 100 rounds of drain()'s default batch of 16


async def _fill(store: ControlStore, items: int) -> None:
    await store.create_project("p", "P")
    for start in range(0, items, 5000):
        payloads = [{"task": f"t{n}"} for n in range(start, min(items, start + 5000))]
        await store.enqueue_many("p", payloads)


async def _step_costs(location: str, items: int, repeats: int) -> dict[str, float]:
    async with ControlStore(location, identity=IDENTITY) as store:
        await _fill(store, items)
        engine = engine_of(store)
        backend = await engine.ready()
        op = _backend.PreflightOp(500, None, None)
        await engine.preflight_step(500)  # the backfill's mark past the items written
        sides: dict[str, Callable[[], Awaitable[Any]]] = {
            "full walk": lambda: backend.twin_pairs(op),
            "noted look": lambda: backend.any_twin_noted(op),
            "preflight_step": lambda: engine.preflight_step(500),
        }
        times: dict[str, list[float]] = {name: [] for name in (*sides, "step settling a pair")}
        await store.create_project("q", "Q")
        for n in range(repeats):
            for name, call in sides.items():
                started = time.perf_counter()
                await call()
                times[name].append(time.perf_counter() - started)
            await _form_a_pair(store, f"pair-{n}")
            started = time.perf_counter()
            settled, _ = await engine.preflight_step(500)
            times["step settling a pair"].append(time.perf_counter() - started)
            assert settled == 1
    return {name: statistics.median(seen) * 1000 for name, seen in times.items()}


async def _form_a_pair(store: ControlStore, task: str) -> None:
    """A twin pair in project q: an item failed, its twin done, the first requeued."""
    for status in ("failed", "done"):
        item_id = await store.enqueue("q", {"task": task})
        claim = await store.claim("bench", project_id="q")
        assert claim is not None and claim.item_id == item_id
        if status == "failed":
            await store.finish(item_id, fence=claim.fence, status="failed", error="once")
            first = item_id
        else:
            await store.finish(item_id, fence=claim.fence, result="once")
    await store.requeue(first)


async def _drain_rate(location: str, backlog: int) -> float:
    async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
        return [Done() for _ in batch]

    async with ControlStore(location, identity=IDENTITY) as store:
        await _fill(store, backlog)
        await store.counts()  # the readers open before the clock starts
        started = time.perf_counter()
        summary = await drain(store, execute, max_iters=DRAINED // 16)
        return summary.done / (time.perf_counter() - started)


async def measure(items: int, repeats: int, url: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:

        async def fresh(name: str) -> str:
            return await pg.fresh_store(url, folder, f"preflight_{name}")

        ms = await _step_costs(await fresh("steps"), items, repeats)
        rates: dict[str, list[float]] = {"large": [], "small": []}
        for n in range(repeats):
            for name, backlog in (("large", items), ("small", SMALL_BACKLOG)):
                rates[name].append(await _drain_rate(await fresh(f"drain-{name}-{n}"), backlog))
    large, small = (statistics.median(rates[name]) for name in ("large", "small"))
    return {
        "items": items,
        "backend": "sqlite" if url is None else "postgresql",
        "ms": ms,
        "full walk / step": ms["full walk"] / ms["preflight_step"],
        "drain items/s": {"backlog": large, f"backlog of {SMALL_BACKLOG}": small},
        "drain backlog / small": large / small,
    }


def main() -> None:
    ran = pg.run_benchmark(
        __doc__, lambda args, url: measure(args.items, args.repeats, url), items=50_000, repeats=5
    )
    if ran is None:
        return
    args, report = ran
    print(
        f"{args.items} pending fingerprinted items, no twin done, {report['backend']} "
        f"(median of {args.repeats}):"
    )
    for name, value in report["ms"].items():
        print(f"  {name:<21} {value:9.2f} ms")
    print(f"  full walk / step      {report['full walk / step']:9.0f}x")
    print(f"drain(), {DRAINED} items in rounds of 16:")
    for name, value in report["drain items/s"].items():
        print(f"  {name:<20} {value:8,.0f} items/s")
    print(f"  backlog / small      {report['drain backlog / small']:8.2f}x")


if __name__ == "__main__":
    main()
