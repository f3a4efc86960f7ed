"""A worker process for the limits test: claims from the whole store, as a fleet's worker
does, runs each item for a random moment, settles it, until nothing is left.

Usage: python limit_worker.py LOCATION OWNER COROUTINES SEED

It prints "ready", waits for a line on stdin (so every worker starts at once), then runs
COROUTINES claimers. Most items are finished; some are released (claimable again at once)
or retried a moment later, so slots free by every kind of settlement. It prints a summary
line; the test reads what happened from the ledger.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from asyncplane import ControlStore


async def claimer(store: ControlStore, owner: str, rng: random.Random) -> int:
    settled = 0
    while True:
        claim = await store.claim(owner, wait=0.2)
        if claim is None:
            counts = await store.counts()
            if counts["ready"] + counts["deferred"] + counts["claimed"] == 0:
                return settled
            continue
        await asyncio.sleep(rng.uniform(0.0, 0.015))
        roll = rng.random()
        if roll < 0.1:
            await store.release(claim.item_id, fence=claim.fence)
        elif roll < 0.2:
            await store.retry(claim.item_id, fence=claim.fence, delay=0.01, error="again")
        else:
            await store.finish(claim.item_id, fence=claim.fence)
            settled += 1


async def main(location: str, owner: str, coroutines: int, seed: int) -> None:
    rng = random.Random(seed)
    async with ControlStore(location, lease_seconds=600) as store:
        await store.projects()  # open before saying ready
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        done = await asyncio.gather(
            *(
                claimer(store, f"{owner}/{n}", random.Random(rng.random()))
                for n in range(coroutines)
            )
        )
    print(json.dumps({"summary": owner, "done": sum(done)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
