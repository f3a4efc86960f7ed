"""A purging process that stops dead between writing the archive and deleting.

Usage: python purge_worker.py DB_PATH_OR_URL ARCHIVE

Purges every settled item, three per chunk. After the first chunk is archived and
fsynced, and before its delete commits, it prints "archived" and waits to be killed.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys

from asyncplane import ControlStore, _retention


async def main(path: str, archive: str) -> None:
    async with ControlStore(path) as store:

        async def stand_still() -> None:
            print("archived", flush=True)
            await asyncio.Event().wait()  # the test kills the process here

        await _retention.purge(
            await store._engine.ready(),
            store.clock,
            0.0,
            chunk=3,
            archive_path=pathlib.Path(archive),
            archive_max_bytes=64 * 1024 * 1024,
            _after_archive=stand_still,
        )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
