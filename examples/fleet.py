"""A small agent fleet sharing one embedded SQLite store.

Four agent coroutines work through two projects' queues. Each agent is an actor
assigned to some projects, so the store itself decides what it may claim. One agent
stalls past its lease on its first item: another agent takes the item over with a
higher fence, and the stalled agent's late report is refused with FenceRejected, so the
work is recorded exactly once. At the end the demo prints a summary and the result of
verify_ledger.

    python examples/fleet.py [DATABASE | URL]  # default: a fresh file in a temp directory
"""

from __future__ import annotations

import asyncio
import collections
import pathlib
import random
import sys
import tempfile

from asyncplane import ClaimedItem, ControlStore, FenceRejected, ProjectExists, verify_ledger

LEASE_SECONDS = 0.3  # short, so the stalled agent's lease lapses during the demo
AGENTS = {
    "researcher": ["research"],
    "writer": ["writing"],
    "generalist": ["research", "writing"],
    "sleepy": ["research", "writing"],  # stalls on its first item
}


async def agent(store: ControlStore, name: str, tally: collections.Counter[str]) -> None:
    rng = random.Random(name)
    stalled = False
    idle_rounds = 0
    claim: ClaimedItem | None = None
    while idle_rounds < 6:  # give up after about two leases of silence
        if claim is None:
            claim = await store.claim(owner=name, actor_id=name)
        if claim is None:
            idle_rounds += 1
            await asyncio.sleep(LEASE_SECONDS / 2)  # the stalled item comes back after its lease
            continue
        idle_rounds = 0
        if claim.attempts > 1:
            tally["takeovers"] += 1
        if name == "sleepy" and not stalled:
            stalled = True
            await asyncio.sleep(LEASE_SECONDS * 3)  # a long pause: the lease lapses
        else:
            await asyncio.sleep(rng.uniform(0.001, 0.01))  # "call the model"
        status = "failed" if claim.payload["step"] % 11 == 10 else "done"
        try:
            # Settle this item and claim the next in one call (one write round on SQLite).
            following = await store.finish_and_claim(
                claim.item_id, fence=claim.fence, owner=name, status=status, actor_id=name
            )
        except FenceRejected:
            tally["fence_rejected"] += 1  # someone else owns it now: discard this result
            claim = None  # (and nothing was claimed with the refused report)
            continue
        tally[f"{name}:{status}"] += 1
        tally[status] += 1
        claim = following


async def main(path: str | pathlib.Path) -> int:
    async with ControlStore(path, lease_seconds=LEASE_SECONDS) as store:
        await store.create_project("research", "Background research")
        await store.create_project("writing", "Drafting and editing")
        for name, projects in AGENTS.items():
            for project in projects:
                await store.assign(project, name)
        for step in range(24):
            project = "research" if step % 2 else "writing"
            await store.enqueue(project, {"step": step, "task": f"{project} task {step}"})

        tally: collections.Counter[str] = collections.Counter()
        await asyncio.gather(*(agent(store, name, tally) for name in AGENTS))

        problems = await verify_ledger(store)
        print(
            f"store: {path}" + ("" if len(sys.argv) > 1 else " (temporary: give a path to keep it)")
        )
        print(f"items settled: {tally['done']} done, {tally['failed']} failed")
        for name in AGENTS:
            print(
                f"  {name:<11} done {tally[f'{name}:done']:>2}  failed {tally[f'{name}:failed']:>2}"
            )
        takeovers, refused = tally["takeovers"], tally["fence_rejected"]
        print(f"lease takeovers: {takeovers}, late reports refused: {refused}")
        print(f"verify_ledger: {problems if problems else 'clean (rows agree with their history)'}")
        return 0 if not problems and tally["done"] + tally["failed"] == 24 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:  # a file, or a postgresql:// URL: the same code runs on either
        try:
            sys.exit(asyncio.run(main(sys.argv[1])))
        except ProjectExists:
            print(f"{sys.argv[1]} holds this demo's projects already: give a new file (or schema)")
            sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="asyncplane-fleet-") as scratch:  # removed after
        sys.exit(asyncio.run(main(pathlib.Path(scratch) / "fleet.db")))
