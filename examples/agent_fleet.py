"""An agent application: producers enqueue work while drain() runs as an asyncio task.

The executor is shaped like a call to a language model: it takes a batch of claimed
items, "thinks" for a few milliseconds each, and answers with one outcome per item:

- most items are Done, with a result;
- some hit a transient error (a timeout): Retry, with the store's backoff;
- some find the model saturated: Park, without spending an attempt;
- one batch is handed to an external batch API: Offload, collected later below.

Two producer coroutines enqueue research questions (some of them twice: the store's
fingerprint dedup answers the repeat without running it again). The drain runs as a
daemon task; once the producers are done and the queue is empty, the application stops
it with its stop event, collects the offloaded batch, and prints the summary and the
verify_ledger result.

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
    Offload,
    Outcome,
    Park,
    Retry,
    drain,
    verify_ledger,
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
        self.batch_sent = False
        self.external_batch: dict[int, str] = {}

    async def execute(self, batch: list[ClaimedItem]) -> list[Outcome]:
        if not self.batch_sent and len(batch) >= 3:
            # Cheaper but slower: send this whole batch to the provider's batch API.
            self.batch_sent = True
            for claim in batch:
                self.external_batch[claim.item_id] = f"batched answer to {claim.payload['task']}"
            return [Offload("provider-batch-1") for _ in batch]
        outcomes: list[Outcome] = []
        for claim in batch:
            self.calls += 1
            await asyncio.sleep(self.rng.uniform(0.001, 0.005))  # "thinking"
            roll = self.rng.random()
            if roll < 0.15 and claim.attempts < 3:
                outcomes.append(Retry("model timed out"))
            elif roll < 0.25:
                outcomes.append(Park(0.05))  # saturated: try again shortly, no attempt spent
            else:
                outcomes.append(Done({"answer": f"answer to {claim.payload['task']}"}))
        return outcomes


async def produce(store: ControlStore, name: str, rounds: int) -> int:
    rng = random.Random(name)
    for n in range(rounds):
        # Repeats happen (the two producers overlap): dedup answers each question once.
        question = rng.choice(QUESTIONS).format(rng.choice(TOPICS))
        await store.enqueue(
            "research",
            {"task": question, "asked_by": name, "n": n},
            priority=1 if "incident" in question else 0,
        )
        await asyncio.sleep(0.002)
    return rounds


async def main(path: str | pathlib.Path) -> int:
    async with ControlStore(
        path, identity=("task",), lease_seconds=30, retry_backoff=0.01, retry_backoff_max=0.05
    ) as store:
        await store.create_project("research", "Research questions")
        model = Model()
        stop = asyncio.Event()
        drainer = asyncio.create_task(
            drain(store, model.execute, mode="daemon", batch_size=4, stop=stop, poll_interval=0.02),
            name="drainer",
        )
        asked = sum(await asyncio.gather(produce(store, "alice", 25), produce(store, "bob", 25)))
        # Wait until nothing is claimable or waiting: only the offloaded batch is left.
        while True:
            counts = await store.counts()
            if counts["ready"] == counts["deferred"] == counts["claimed"] == 0:
                break
            await asyncio.sleep(0.02)
        stop.set()
        summary = await drainer

        # The external batch comes back later: settle its items at their fences.
        collected = 0
        for row in await store.offloaded("provider-batch-1"):
            answer = model.external_batch[row["item_id"]]
            await store.finish(row["item_id"], fence=row["fence"], result={"answer": answer})
            collected += 1

        counts = await store.counts()
        problems = await verify_ledger(store)
        print(f"store: {path}")
        print(
            f"drain: {summary.rounds} rounds, {summary.claimed} claimed, {summary.done} done, "
            f"{summary.retried} retried, {summary.parked} parked, "
            f"{summary.offloaded} offloaded, {summary.fence_rejected} fenced out"
        )
        print(f"model calls: {model.calls}; offloaded items collected later: {collected}")
        print(
            f"{asked} questions asked, {counts['done'] + counts['failed']} distinct items: "
            f"{counts['done']} done, {counts['failed']} failed"
        )
        print(f"verify_ledger: {problems if problems else 'clean'}")
        unsettled = counts["ready"] + counts["deferred"] + counts["claimed"] + counts["offloaded"]
        return 0 if not problems and unsettled == 0 else 1


if __name__ == "__main__":
    target = (
        sys.argv[1]  # a file, or a postgresql:// URL: the same code runs on either
        if len(sys.argv) > 1
        else pathlib.Path(tempfile.mkdtemp(prefix="asyncplane-agents-")) / "agents.db"
    )
    sys.exit(asyncio.run(main(target)))
