"""Twins in line under contention: many connections moving the same few contents at once.

    python benchmarks/twin_contention.py --url postgresql://... [--processes 6]
        [--coroutines 4] [--seconds 20] [--contents 2] [--seed 0] [--json]

Each of ``--processes`` processes runs ``--coroutines`` coroutines, each with a store of its
own, doing random operations for ``--seconds``: enqueues and bulk enqueues of twins of
``--contents`` contents (``dedup=False``; 0 means no fingerprints at all) in two projects,
claims of small batches, finishes (done or failed), releases, offloads, cancels and
requeues by id, and cancel_where / requeue_where of one content. It prints the operations
done, the store errors met (refusals such as a stale fence are part of the game and not
counted), and then checks the line on the server: no ready twin held with nothing to free
it (``verify_ledger``'s ``twin_stranded``, and the rest of the ledger), and how many
contents ended with more than one claimable twin. Run it with another release's
``PYTHONPATH`` to compare: the same seed gives each side the same sequence of choices.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import pg_probe_vs_raw as pg

from asyncplane import AsyncplaneError, ControlStore, Job, verify_ledger

#: Refusals that random operations on other coroutines' items meet by design.
EXPECTED = ("FenceRejected", "ItemCancelled", "UnknownItem", "NotRequeueable", "InvalidInput")
OPS = ("enqueue", "enqueue", "enqueue_many", "claim", "claim", "finish", "release", "cancel",
       "requeue", "where", "offload")  # fmt: skip


async def _coroutine(where: str, seed: int, seconds: float, contents: int) -> tuple[int, int]:
    rng = random.Random(seed)

    def content() -> str | None:
        return f"c{rng.randrange(contents)}" if contents else None

    done = errors = 0
    async with ControlStore(where, lease_seconds=30) as store:
        held: list[Any] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            op = rng.choice(OPS)
            project = rng.choice(("p", "q"))
            try:
                if op == "enqueue":
                    await store.enqueue(project, {"s": seed}, fingerprint=content(), dedup=False,
                                        priority=rng.randint(0, 3))  # fmt: skip
                elif op == "enqueue_many":
                    jobs = [Job({"s": seed}, fingerprint=content(), priority=rng.randint(0, 3))
                            for _ in range(3)]  # fmt: skip
                    await store.enqueue_many(project, jobs, dedup=False)
                elif op == "claim":
                    held.extend(await store.claim_batch(f"w{seed}", rng.randint(1, 3)))
                elif op in ("finish", "release", "offload") and held:
                    claim = held.pop(rng.randrange(len(held)))
                    if op == "finish":
                        status = rng.choice(("done", "failed"))
                        error = "boom" if status == "failed" else None
                        await store.finish(claim.item_id, fence=claim.fence, status=status,
                                           error=error)  # fmt: skip
                    elif op == "release":
                        await store.release(claim.item_id, fence=claim.fence)
                    else:
                        await store.offload(claim.item_id, fence=claim.fence, handle="h")
                        await store.finish(claim.item_id, fence=claim.fence)
                elif op == "cancel":
                    await store.cancel(rng.randint(1, 400))
                elif op == "requeue":
                    await store.requeue(rng.randint(1, 400))
                elif op == "where" and contents:
                    if rng.random() < 0.3:
                        await store.cancel_where(project_id=project, fingerprint=content(),
                                                 state="ready")  # fmt: skip
                    else:
                        await store.requeue_where(project_id=project, fingerprint=content(),
                                                  state="cancelled")  # fmt: skip
            except AsyncplaneError as exc:
                if type(exc).__name__ not in EXPECTED:
                    errors += 1
                    print(f"error in {op}: {type(exc).__name__}: {exc}", file=sys.stderr)
            done += 1
        for claim in held:
            try:
                await store.finish(claim.item_id, fence=claim.fence)
            except AsyncplaneError:
                pass
    return done, errors


async def _worker(args: argparse.Namespace) -> None:
    results = await asyncio.gather(*(
        _coroutine(args.where, args.seed * 1000 + args.first + n, args.seconds, args.contents)
        for n in range(args.coroutines)
    ))  # fmt: skip
    print(json.dumps([sum(r[0] for r in results), sum(r[1] for r in results)]))


LINE_CHECK = """
SELECT count(*) FROM (
    SELECT project_id, fingerprint FROM items
    WHERE state = 'ready' AND fingerprint IS NOT NULL AND NOT held
    GROUP BY project_id, fingerprint HAVING count(*) > 1) AS doubled
"""


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    where = await pg.fresh_schema(args.url, f"bench_twins_{args.seed}")
    schema = pg.marked(f"bench_twins_{args.seed}")
    async with ControlStore(where) as store:
        for project in ("p", "q"):
            await store.create_project(project, project)
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", where, "--first", str(n * args.coroutines),
            "--coroutines", str(args.coroutines), "--seconds", str(args.seconds),
            "--contents", str(args.contents), "--seed", str(args.seed),
            stdout=asyncio.subprocess.PIPE,
        )
        for n in range(args.processes)
    ]  # fmt: skip
    ops = errors = 0
    for child in children:
        out, _ = await child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"a worker process failed ({child.returncode})")
        done, failed = json.loads(out.decode().strip().splitlines()[-1])
        ops, errors = ops + done, errors + failed
    async with ControlStore(where) as store:
        problems = await verify_ledger(store)
    import asyncpg

    conn = await asyncpg.connect(where)
    try:
        lined = await conn.fetchval(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 "
            "AND table_name = 'items' AND column_name = 'held'",
            schema,
        )
        doubled = await conn.fetchval(LINE_CHECK) if lined else None  # (a release before)
    finally:
        await conn.close()
    return {"operations": ops, "per_second": ops / args.seconds, "errors": errors,
            "ledger_problems": sorted({p.kind for p in problems}),
            "contents_with_two_claimable": doubled}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--coroutines", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--contents", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", dest="where", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.where:
        asyncio.run(_worker(args))
        return 0
    if not args.url:
        parser.error("--url postgresql://... is required (this measures a server's contention)")
    report = asyncio.run(pg.dropping_made_schemas(_main(args)))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.processes} processes x {args.coroutines} coroutines, {args.seconds:g} s, "
          f"{args.contents} contents")  # fmt: skip
    print(f"  operations       {report['operations']:,} ({report['per_second']:,.0f}/s)")
    print(f"  store errors     {report['errors']}")
    print(f"  ledger problems  {report['ledger_problems'] or 'none'}")
    print(f"  contents left with two claimable twins: {report['contents_with_two_claimable']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
