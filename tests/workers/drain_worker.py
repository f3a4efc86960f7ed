"""A drainer process for the drain tests.

Usage: python drain_worker.py DB_PATH MODE

MODE "hold": drain with an executor that says "executing" and then waits for a line on
stdin before it reports Done; the drain holds its lock all that time.
MODE "once": one foreground drain that reports Done for everything; prints its summary.
MODE "enqueue": open the store, enqueue one item into project "p", print its id and the
wall-clock time its commit returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time

import anyio.to_thread

from asyncplane import ClaimedItem, ControlStore, Done, drain


async def main(path: str, mode: str) -> None:
    async with ControlStore(path) as store:
        if mode == "enqueue":
            item_id = await store.enqueue("p", {"from": "another process"})
            print(json.dumps({"item_id": item_id, "committed_at": time.time()}), flush=True)
            return

        async def hold(batch: list[ClaimedItem]) -> list[Done]:
            print("executing", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            return [Done() for _ in batch]

        async def at_once(batch: list[ClaimedItem]) -> list[Done]:
            return [Done() for _ in batch]

        summary = await drain(store, hold if mode == "hold" else at_once, empty_rounds=1)
        print(json.dumps(dataclasses.asdict(summary)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
