"""A worker process for the multi-process tests: claims and finishes until the queue is empty.

Usage: python claim_worker.py DB_PATH OWNER COROUTINES

It opens its own ControlStore on the file (as a separate deployment would), prints
"ready", waits for a line on stdin (so every worker starts at once), then runs
COROUTINES claiming coroutines. It prints one JSON line per finished item, then a
summary line. Every asyncplane error is counted by type, never swallowed silently.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys

from asyncplane import ControlStore, DatabaseLocked, FenceRejected


async def work(store: ControlStore, owner: str, errors: collections.Counter[str]) -> list[dict]:
    finished = []
    while True:
        try:
            claim = await store.claim(owner=owner)
        except DatabaseLocked:
            errors["locked"] += 1
            continue
        if claim is None:
            return finished
        try:
            await store.finish(claim.item_id, fence=claim.fence, status="done")
        except FenceRejected:
            errors["fence_rejected"] += 1
            continue
        except DatabaseLocked:
            errors["locked"] += 1
            continue
        finished.append({"item_id": claim.item_id, "fence": claim.fence, "owner": owner})


async def main(path: str, owner: str, coroutines: int) -> None:
    errors: collections.Counter[str] = collections.Counter()
    async with ControlStore(path, lease_seconds=600) as store:
        await store.projects()  # open (and migrate, if first) before saying ready
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        results = await asyncio.gather(
            *(work(store, f"{owner}/{n}", errors) for n in range(coroutines))
        )
    for finished in results:
        for record in finished:
            print(json.dumps(record))
    print(json.dumps({"summary": owner, "errors": dict(errors)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
