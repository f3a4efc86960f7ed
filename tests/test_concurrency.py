"""An item goes to exactly one worker: across coroutines, and across OS processes.

The multi-process test starts real interpreters (not threads, not forks of a running
event loop), each with its own ControlStore on the same file, as a deployment would.
"""

from __future__ import annotations

import asyncio
import collections
import json
import pathlib
import subprocess
import sys
from typing import Any

from asyncplane import ControlStore, DatabaseLocked, verify_ledger

WORKER = pathlib.Path(__file__).parent / "workers" / "claim_worker.py"


async def test_64_coroutines_drain_one_store_without_duplicates(store: ControlStore) -> None:
    ids = [await store.enqueue("alpha", {"n": n}) for n in range(2000)]
    finished: list[tuple[int, int]] = []
    locked = 0

    async def agent(name: str) -> None:
        nonlocal locked
        while True:
            try:
                claim = await store.claim(owner=name)
                if claim is None:
                    return
                await store.finish(claim.item_id, fence=claim.fence)
            except DatabaseLocked:
                locked += 1
                continue
            finished.append((claim.item_id, claim.fence))

    await asyncio.gather(*(agent(f"agent-{n}") for n in range(64)))
    done_ids = [item_id for item_id, _ in finished]
    assert locked == 0
    assert len(done_ids) == len(set(done_ids)), "an item was finished twice"
    assert sorted(done_ids) == ids, "an item was lost"
    assert {fence for _, fence in finished} == {1}
    assert await verify_ledger(store) == []


def test_8_processes_drain_one_store_without_duplicates(location_of: Any) -> None:
    path = location_of("shared.db")
    items = 2400

    async def seed() -> list[int]:
        async with ControlStore(path) as store:
            await store.create_project("alpha", "Alpha")
            return [await store.enqueue("alpha", {"n": n}) for n in range(items)]

    ids = asyncio.run(seed())
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), path, f"proc-{n}", "4"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(8)
    ]
    try:
        for worker in workers:  # wait until every interpreter has opened the store
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
        for worker in workers:  # then let them all go at once
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        outputs = [worker.communicate(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    records: list[dict[str, Any]] = []
    errors: collections.Counter[str] = collections.Counter()
    per_worker = {}
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
        lines = [json.loads(line) for line in out.splitlines() if line.strip()]
        summary = lines.pop()
        errors.update(summary["errors"])
        per_worker[summary["summary"]] = len(lines)
        records.extend(lines)

    finished = [r["item_id"] for r in records]
    assert errors["locked"] == 0, "a worker saw 'database is locked'"
    assert errors["fence_rejected"] == 0
    assert len(finished) == len(set(finished)), "an item was finished by two workers"
    assert sorted(finished) == ids, "an item was lost"
    assert len(per_worker) == 8

    async def check() -> None:
        async with ControlStore(path) as store:
            assert await verify_ledger(store) == []
            for item_id in (ids[0], ids[len(ids) // 2], ids[-1]):
                events = await store.events(item_id)
                assert [e["event_type"] for e in events] == ["queued", "claimed", "done"]

    asyncio.run(check())
