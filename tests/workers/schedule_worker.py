"""A worker process for the schedules test: runs the store's schedules in a loop, by the
fleet's shared clock, until told to stop.

Usage: python schedule_worker.py LOCATION CLOCK_FILE STOP_FILE

It prints "ready", waits for a line on stdin (so every worker starts at once), then calls
run_schedules() over and over until STOP_FILE exists, and prints how many ticks it
enqueued.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

from _fleet import FileClock
from asyncplane import ControlStore


async def main(location: str, clock_file: str, stop_file: str) -> None:
    stop = pathlib.Path(stop_file)
    enqueued = 0
    async with ControlStore(location, clock=FileClock(pathlib.Path(clock_file))) as store:
        await store.projects()  # open before saying ready
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        while not await asyncio.to_thread(stop.exists):
            enqueued += await store.run_schedules()
    print(json.dumps({"enqueued": enqueued}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
