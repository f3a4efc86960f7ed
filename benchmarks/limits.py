"""What a limit costs a claim, and whether a limited project slows the others.

    python benchmarks/limits.py [--claims 400] [--running 0,64] [--repeats 3]
    python benchmarks/limits.py --url postgresql://...   (the same on a schema)

(a) **Claim cost with a limit set versus none** (target: at most 1.2x). One store holds
    two projects with the same backlog: ``free`` has no limits, ``capped`` has
    ``max_running`` and ``per_minute``/``burst`` set so high they never bind, so every one
    of its claims pays for the whole enforcement (its limits read under lock, its claimed
    items counted, its bucket written back) and takes the same item it would without.
    Rounds of ``claim(project_id=...)`` + ``finish()`` alternate between the two, beside
    ``--running`` items of each project held claimed (the count a limit reads grows with
    them), and the figure is the ratio of the per-claim times, measured in the same run.

(b) **An unrelated project is not slowed** (target: about 1x). Four stores (on PostgreSQL,
    four connections, as four hosts) claim and finish a project ``hot`` as fast as they
    can while a fifth claims and finishes ``other``; the figure is other's claim rate when
    hot has ``max_running=2`` over its rate when hot has no limits, in the same run: the
    limit's lock serialises hot's claimers, and only theirs.

A noisy machine blurs milliseconds but not a ratio; each ratio is the median of
``--repeats`` measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import ControlStore


async def _location(tmp: pathlib.Path, url: str | None, name: str) -> str:
    if url is None:
        return str(tmp / f"{name}.db")
    return await pg.fresh_schema(url, f"bench_limits_{name}")


async def _claim_cost(where: str, claims: int, running: int, repeats: int) -> dict[str, Any]:
    """(a): the per-claim time of capped over free, alternating rounds."""
    async with ControlStore(where, lease_seconds=3600) as store:
        for project in ("free", "capped"):
            await store.create_project(project, project)
            await store.enqueue_many(project, [{"n": n} for n in range(claims * repeats + running)])
            for _ in range(running):  # held claimed all along
                assert await store.claim("holder", project_id=project) is not None
        await store.set_limits("capped", max_running=10**9, per_minute=6e7, burst=10**9)
        times: dict[str, list[float]] = {"free": [], "capped": []}
        for _ in range(repeats):
            spent = {"free": 0.0, "capped": 0.0}
            for n in range(claims):
                for project in ("free", "capped") if n % 2 else ("capped", "free"):
                    start = time.perf_counter()
                    claim = await store.claim("w", project_id=project)
                    spent[project] += time.perf_counter() - start
                    assert claim is not None
                    await store.finish(claim.item_id, fence=claim.fence)
            for project, seconds in spent.items():
                times[project].append(seconds / claims * 1000)
        ratios = [c / f for c, f in zip(times["capped"], times["free"], strict=True)]
    return {
        "running": running,
        "free_ms": statistics.median(times["free"]),
        "capped_ms": statistics.median(times["capped"]),
        "ratio": statistics.median(ratios),
    }


async def _other_rate(where: str, seconds: float, limited: bool) -> float:
    """(b): claims a second of ``other`` while four stores hammer ``hot``."""
    async with ControlStore(where, lease_seconds=3600) as admin:
        if limited:
            await admin.set_limits("hot", max_running=2)
        else:
            await admin.set_limits("hot", max_running=None, per_minute=None, burst=None)
    stores = [ControlStore(where, lease_seconds=3600) for _ in range(5)]
    for store in stores:
        await store.open()
    stop = asyncio.Event()

    async def loop(store: ControlStore, project: str) -> int:
        done = 0
        while not stop.is_set():
            claim = await store.claim("w", project_id=project)
            if claim is not None:
                await store.finish(claim.item_id, fence=claim.fence)
                done += 1
        return done

    try:
        tasks = [asyncio.create_task(loop(s, "hot")) for s in stores[:4]]
        other = asyncio.create_task(loop(stores[4], "other"))
        await asyncio.sleep(seconds)
        stop.set()
        counts = await asyncio.gather(other, *tasks)
    finally:
        for store in stores:
            await store.close()
    return counts[0] / seconds


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=400, help="claims per project per repeat")
    parser.add_argument("--running", default="0,64", help="items held claimed, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="(b): each measurement")
    parser.add_argument("--backlog", type=int, default=20_000, help="(b): items per project")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url", default=os.environ.get("ASYNCPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    backend = "postgresql" if args.url else "sqlite"
    report: dict[str, Any] = {"backend": backend, "claim_cost": [], "other_rate": {}}
    with tempfile.TemporaryDirectory(prefix="asyncplane-limits-") as tmp:
        for running in (int(n) for n in args.running.split(",")):
            where = await _location(pathlib.Path(tmp), args.url, f"cost{running}")
            report["claim_cost"].append(
                await _claim_cost(where, args.claims, running, args.repeats)
            )
        where = await _location(pathlib.Path(tmp), args.url, "unrelated")
        async with ControlStore(where) as store:
            for project in ("hot", "other"):
                await store.create_project(project, project)
                await store.enqueue_many(project, [{"n": n} for n in range(args.backlog)])
        ratios, rates = [], {"limited": [], "unlimited": []}
        for _ in range(args.repeats):
            free = await _other_rate(where, args.seconds, limited=False)
            held = await _other_rate(where, args.seconds, limited=True)
            rates["unlimited"].append(free)
            rates["limited"].append(held)
            ratios.append(held / free)
        report["other_rate"] = {
            "unlimited_per_s": statistics.median(rates["unlimited"]),
            "limited_per_s": statistics.median(rates["limited"]),
            "ratio": statistics.median(ratios),
        }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"limits, {backend}")
    for row in report["claim_cost"]:
        print(
            f"  (a) claim with limits vs none, {row['running']} held claimed: "
            f"{row['capped_ms']:.3f} ms vs {row['free_ms']:.3f} ms = {row['ratio']:.2f}x "
            "(target <= 1.2x)"
        )
    other = report["other_rate"]
    print(
        f"  (b) another project's claims while a hot one is limited: "
        f"{other['limited_per_s']:.0f}/s vs {other['unlimited_per_s']:.0f}/s unlimited = "
        f"{other['ratio']:.2f}x (target ~1x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(pg.dropping_made_schemas(main(sys.argv[1:]))))
