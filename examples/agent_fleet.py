"""An agent application: producers enqueue work while work() runs it, item by item.

The handler is shaped like a call to a language model: it takes one claimed item,
"thinks" for a few milliseconds, and answers with one outcome:

- most items are Done, with a result;
- some hit a transient error (a timeout): Retry, with the store's backoff;
- some find the model saturated: Park, without spending an attempt;
- the first three are handed to an external batch API: Offload, collected later.

Two producer coroutines enqueue research questions (some of them twice: the store's
fingerprint dedup answers the repeat without running it again). work() runs as a task
with 8 slots, each item settled as soon as its call returns and its slot filled by the
next claim at once. The application waits for every question's answer with
`ControlStore.wait` (no polling) and collects the offloaded batch once the store has it
(work()'s progress hook says when). Then it stops the worker with its stop event and
prints the summary and verify_ledger.

    python examples/agent_fleet.py [DATABASE | URL]  # default: a fresh file in a temp dir
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import sys
import tempfile

from asyncplane import (
    ClaimedItem,
    ControlStore,
    Done,
    DrainSummary,
    Offload,
    Outcome,
    Park,
    ProjectExists,
    Retry,
    verify_ledger,
    work,
)

QUESTIONS = [
    "What changed in {}?",
    "Summarise the incident timeline of {}.",
    "Which customers asked about {}?",
    "Draft a reply about {}.",
    "List the open risks of {}.",
]
TOPICS = ["the quarterly report", "pricing", "the migration", "the launch", "hiring", "support"]


class Model:
    """A stand-in for a language model client: latency, timeouts, saturation, a batch API."""

    def __init__(self) -> None:
        self.rng = random.Random(42)
        self.calls = 0
        self.external_batch: dict[int, str] = {}
        self.batch_sent = asyncio.Event()  # the store has recorded the whole batch offloaded

    async def handle(self, claim: ClaimedItem) -> Outcome:
        if len(self.external_batch) < 3:
            # Cheaper but slower: send this one to the provider's batch API.
            self.external_batch[claim.item_id] = f"batched answer to {claim.payload['task']}"
            return Offload("provider-batch-1")
        self.calls += 1
        await asyncio.sleep(self.rng.uniform(0.001, 0.005))  # "thinking"
        roll = self.rng.random()
        if roll < 0.15 and claim.attempts < 3:
            return Retry("model timed out")
        if roll < 0.25:
            return Park(0.05)  # saturated: try again shortly, no attempt spent
        return Done({"answer": f"answer to {claim.payload['task']}"})


async def produce(store: ControlStore, name: str, rounds: int) -> list[int]:
    rng = random.Random(name)
    ids = []
    for n in range(rounds):
        # Repeats happen (the two producers overlap): dedup answers each question once.
        question = rng.choice(QUESTIONS).format(rng.choice(TOPICS))
        ids.append(
            await store.enqueue(
                "research",
                {"task": question, "asked_by": name, "n": n},
                priority=1 if "incident" in question else 0,
            )
        )
        await asyncio.sleep(0.002)
    return ids


async def collect(store: ControlStore, model: Model) -> int:
    """The external batch comes back later: settle its items at their fences."""
    await model.batch_sent.wait()
    collected = 0
    for row in await store.offloaded("provider-batch-1"):
        answer = model.external_batch[row["item_id"]]
        await store.finish(row["item_id"], fence=row["fence"], result={"answer": answer})
        collected += 1
    return collected


async def main(path: str | pathlib.Path) -> int:
    async with ControlStore(
        path, identity=("task",), lease_seconds=30, retry_backoff=0.01, retry_backoff_max=0.05
    ) as store:
        await store.create_project("research", "Research questions")
        model = Model()
        stop = asyncio.Event()

        def progress(summary: DrainSummary) -> None:  # after each settled item
            if summary.offloaded == 3:
                model.batch_sent.set()

        worker = asyncio.create_task(
            work(store, model.handle, concurrency=8, stop=stop, progress=progress),
            name="worker",
        )
        collecting = asyncio.create_task(collect(store, model), name="collector")
        asked = await asyncio.gather(produce(store, "alice", 25), produce(store, "bob", 25))
        ids = sorted({item_id for batch in asked for item_id in batch})
        # Every question's answer, as it settles (the offloaded ones once collected).
        answers = await asyncio.gather(*(store.wait(item_id, timeout=60) for item_id in ids))
        collected = await collecting
        stop.set()
        summary = await worker

        counts = await store.counts()
        problems = await verify_ledger(store)
        print(f"store: {path}")
        print(
            f"work: {summary.claimed} claimed, {summary.done} done, "
            f"{summary.retried} retried, {summary.parked} parked, "
            f"{summary.offloaded} offloaded, {summary.fence_rejected} fenced out"
        )
        print(f"model calls: {model.calls}; offloaded items collected later: {collected}")
        done = sum(answer["state"] == "done" for answer in answers)
        print(
            f"{sum(len(batch) for batch in asked)} questions asked, {len(ids)} distinct "
            f"items: {done} done, {counts['failed']} failed"
        )
        print(f"verify_ledger: {problems if problems else 'clean'}")
        unsettled = counts["ready"] + counts["deferred"] + counts["claimed"] + counts["offloaded"]
        return 0 if not problems and unsettled == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:  # a file, or a postgresql:// URL: the same code runs on either
        try:
            sys.exit(asyncio.run(main(sys.argv[1])))
        except ProjectExists:
            print(f"{sys.argv[1]} holds this demo's projects already: give a new file (or schema)")
            sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="asyncplane-agents-") as scratch:  # removed after
        sys.exit(asyncio.run(main(pathlib.Path(scratch) / "agents.db")))
