"""A client process of the SIGKILL campaign (tests/test_faults_kill.py, scripts/fault_campaign.py).

Usage: python kill_worker.py LOCATION ACKLOG SEED [--coroutines N] [--archive PATH]
                             [--final SECONDS]

Opens a ControlStore on LOCATION (an SQLite file or a postgresql:// URL) with short
leases (0.5 s, so a killed client's claims are soon taken over), prints "ready", then
runs N clients (coroutines, 2 by default) that each loop forever through a seeded random
mix of operations in project "kill": enqueue, enqueue_many, claim_batch, renew, finish
(done and failed), retry, park, offload, the later finish of offloaded items (its own,
or another client's found through ``offloaded()``), purge (a retention of about a
second, into the archive, by default ``archive.jsonl`` beside ACKLOG), replays of
settlements it already made (which the store must refuse), naps longer than a lease
(so its claims lapse), and short drain() runs whose executor returns every outcome.

Every call is recorded in ACKLOG (see tests/workers/kill_check.py for the format): an
"invoke" line before it, an "ok", "fail" (refused: nothing written) or "info" (unknown
effect) line after; a drain's executor writes an "exec" line for every item it is handed.
Each line is fsynced before the call it announces, or the next, goes ahead. After each
completed call the process prints "op" on stdout, so the campaign can kill it after a
number of operations rather than after a fixed time.

With ``--final SECONDS`` it is the campaign's last client instead: it settles
everything left (drains with Done, finishes every offloaded item of every handle) until
nothing is pending, then prints "clear" and exits 0; or prints "stuck" with the counts
and exits 1 after SECONDS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kill_check import PROJECT, AckLog

from asyncplane import (
    AsyncplaneError,
    ClaimedItem,
    ControlStore,
    Done,
    DrainError,
    Failed,
    FenceRejected,
    Job,
    Offload,
    Outcome,
    Park,
    Retry,
    StorageError,
    StoreClosed,
    UnknownItem,
    drain,
)

LEASE_SECONDS = 0.5
RETENTION_SECONDS = 1.0
#: Offload handles, shared by every client: any of them may settle another's batch.
HANDLES = ("h0", "h1", "h2")
#: Errors that leave a call's effect unknown; anything else from asyncplane is a bug here.
INDETERMINATE = (StorageError, StoreClosed, DrainError)

#: The operations and how often each is chosen.
WEIGHTS = {
    "enqueue": 14,
    "enqueue_many": 6,
    "claim": 16,
    "renew": 6,
    "finish_done": 14,
    "finish_failed": 3,
    "retry": 6,
    "park": 5,
    "offload": 4,
    "finish_offloaded": 5,
    "adopt_offloaded": 2,
    "replay": 3,
    "purge": 3,
    "drain": 8,
    "nap": 1,
}


@dataclasses.dataclass
class Claim:
    item_id: int
    fence: int
    token: str | None


class Client:
    """One sequential client: one call at a time, each recorded before and after."""

    def __init__(
        self,
        store: ControlStore,
        log: AckLog,
        name: str,
        rng: random.Random,
        archive: pathlib.Path,
    ) -> None:
        self.store, self.log, self.name, self.rng, self.archive = store, log, name, rng, archive
        self.n = 0
        self.tokens = 0
        self.held: list[Claim] = []  # claims this client believes it may still hold
        self.offloaded: list[Claim] = []  # items offloaded at these fences, to settle later
        self.settled: list[tuple[Claim, str]] = []  # settlements made: replays must fail

    # --- recording ------------------------------------------------------------------------

    async def call(
        self,
        op: str,
        args: dict[str, Any],
        make: Callable[[int], Awaitable[Any]],
        describe: Callable[[Any], dict[str, Any]] = lambda _: {},
    ) -> tuple[str, Any]:
        """Run one call between its invoke line and its completion line."""
        self.n += 1
        n = self.n
        self.log.write({"w": self.name, "n": n, "t": "invoke", "f": op, **args})
        head = {"w": self.name, "n": n, "f": op}
        try:
            result = await make(n)
        except FenceRejected as exc:
            self.log.write(
                {
                    **head,
                    "t": "fail",
                    "error": "FenceRejected",
                    "current_fence": exc.current_fence,
                    "state": exc.state,
                }
            )
            outcome: tuple[str, Any] = ("fail", exc)
        except UnknownItem as exc:
            self.log.write({**head, "t": "fail", "error": "UnknownItem"})
            outcome = ("fail", exc)
        except INDETERMINATE as exc:
            self.log.write({**head, "t": "info", "error": f"{type(exc).__name__}: {exc}"})
            outcome = ("info", exc)
        else:
            self.log.write({**head, "t": "ok", **describe(result)})
            outcome = ("ok", result)
        print("op", flush=True)
        return outcome

    def token(self) -> str:
        self.tokens += 1
        return f"{self.name}-{self.tokens}"

    # --- the operations ---------------------------------------------------------------------

    def job(self, token: str) -> Job:
        rng = self.rng
        return Job(
            {"token": token},
            priority=rng.randint(-2, 2),
            service_class=rng.choice(("standard", "standard", "realtime")),
            max_attempts=rng.choice((None, None, None, 2, 3, 4)),
            not_before=self.store.clock.now() + rng.uniform(0.05, 0.3)
            if rng.random() < 0.15
            else None,
        )

    async def enqueue(self) -> None:
        token = self.token()
        job = self.job(token)
        await self.call(
            "enqueue",
            {"token": token},
            lambda _: self.store.enqueue(
                PROJECT,
                job.payload,
                priority=job.priority,
                service_class=job.service_class,
                max_attempts=job.max_attempts,
                not_before=job.not_before,
            ),
            lambda item_id: {"token": token, "item_id": item_id},
        )

    async def enqueue_many(self) -> None:
        tokens = [self.token() for _ in range(self.rng.randint(2, 5))]
        jobs = [self.job(token) for token in tokens]
        await self.call(
            "enqueue_many",
            {"tokens": tokens},
            lambda _: self.store.enqueue_many(PROJECT, jobs),
            lambda ids: {"tokens": tokens, "item_ids": ids},
        )

    async def claim(self) -> None:
        limit = self.rng.randint(1, 4)
        status, claims = await self.call(
            "claim",
            {"owner": self.name, "limit": limit},
            lambda _: self.store.claim_batch(self.name, limit),
            lambda got: {"claims": [[c.item_id, c.fence, c.payload.get("token")] for c in got]},
        )
        if status == "ok":
            self.held.extend(Claim(c.item_id, c.fence, c.payload.get("token")) for c in claims)
            del self.held[:-8]  # the oldest are abandoned: their leases lapse

    def pick(self) -> Claim | None:
        if not self.held:
            return None
        return self.held.pop(self.rng.randrange(len(self.held)))

    async def settle(self, op: str, claim: Claim) -> str:
        """One fenced call on a claim: renew, finish (done/failed), retry, park, offload."""
        store, rng, item_id, fence = self.store, self.rng, claim.item_id, claim.fence
        args: dict[str, Any] = {"item_id": item_id, "fence": fence}
        delay = round(rng.uniform(0, 0.3), 3)
        handle = rng.choice(HANDLES)

        async def make(_: int) -> Any:
            if op == "renew":
                return await store.renew(item_id, fence=fence)
            if op == "done":
                return await store.finish(
                    item_id, fence=fence, result={"by": self.name, "fence": fence}
                )
            if op == "failed":
                return await store.finish(item_id, fence=fence, status="failed", error="on purpose")
            if op == "retry":
                return await store.retry(item_id, fence=fence, error="try again", delay=delay)
            if op == "park":
                return await store.park(item_id, fence=fence, delay=delay)
            return await store.offload(item_id, fence=fence, handle=handle)

        if op in ("done", "failed"):
            args["status"] = op
        elif op in ("retry", "park"):
            args["delay"] = delay
        elif op == "offload":
            args["handle"] = handle
        name = "finish" if op in ("done", "failed") else op
        describe = (lambda state: {"state": state}) if op == "retry" else (lambda _: {})
        status, _ = await self.call(name, args, make, describe)
        if status == "ok":
            if op == "renew":
                self.held.append(claim)
            elif op == "offload":
                self.offloaded.append(claim)
            else:
                self.settled.append((claim, op))
                del self.settled[:-16]
        return status

    async def adopt_offloaded(self) -> None:
        """Take on items another client (perhaps a dead one) offloaded."""
        try:
            found = await self.store.offloaded(self.rng.choice(HANDLES))
        except INDETERMINATE:
            return
        for item in self.rng.sample(found, min(len(found), 3)):
            self.offloaded.append(
                Claim(item["item_id"], item["fence"], item["payload"].get("token"))
            )
        del self.offloaded[:-12]

    async def finish_offloaded(self) -> None:
        if not self.offloaded:
            await self.adopt_offloaded()
            return
        claim = self.offloaded.pop(self.rng.randrange(len(self.offloaded)))
        await self.settle(self.rng.choice(("done", "done", "done", "failed", "retry")), claim)

    async def replay(self) -> None:
        """A settlement made already, sent again: the store must refuse it."""
        if not self.settled:
            return
        claim, op = self.settled[self.rng.randrange(len(self.settled))]
        await self.settle(op, claim)

    async def purge(self) -> None:
        retention = round(self.rng.uniform(0.5, 2.0), 3)
        chunk = self.rng.randint(1, 5)
        await self.call(
            "purge",
            {"retention": retention},
            lambda _: self.store.purge(retention, chunk=chunk, archive_path=self.archive),
            lambda summary: {"purged": summary.purged},
        )

    async def drain(self, *, final: bool = False) -> tuple[str, Any]:
        rng = self.rng
        owner = f"{self.name}-d{self.n + 1}"
        max_iters = None if final else rng.randint(1, 3)
        batch_size = 16 if final else rng.randint(1, 4)

        def run(n: int) -> Awaitable[Any]:
            async def execute(batch: list[ClaimedItem]) -> list[Outcome]:
                if not final and rng.random() < 0.25:
                    await asyncio.sleep(rng.uniform(0, 0.4))  # its leases are renewed meanwhile
                outcomes: list[Outcome] = []
                for claim in batch:
                    kind = (
                        "done"
                        if final
                        else rng.choices(
                            ("done", "failed", "retry", "park", "offload"), (10, 1, 3, 2, 2)
                        )[0]
                    )
                    outcome: Outcome
                    extra: dict[str, Any] = {}
                    if kind == "done":
                        outcome = Done({"by": owner, "fence": claim.fence})
                    elif kind == "failed":
                        outcome = Failed("failed on purpose")
                    elif kind == "retry":
                        outcome = Retry("try again", delay=round(rng.uniform(0, 0.3), 3))
                    elif kind == "park":
                        outcome = Park(round(rng.uniform(0, 0.3), 3))
                    else:
                        extra["handle"] = rng.choice(HANDLES)
                        outcome = Offload(extra["handle"])
                    self.log.write(
                        {
                            "w": self.name,
                            "n": n,
                            "t": "exec",
                            "item_id": claim.item_id,
                            "fence": claim.fence,
                            "token": claim.payload.get("token"),
                            "outcome": kind,
                            **extra,
                        }
                    )
                    outcomes.append(outcome)
                return outcomes

            return drain(
                self.store,
                execute,
                owner=owner,
                batch_size=batch_size,
                max_iters=max_iters,
                empty_rounds=1 if final else 3,
                lock_path=None,
            )

        return await self.call(
            "drain",
            {"owner": owner, "max_iters": max_iters},
            run,
            lambda summary: {"summary": dataclasses.asdict(summary)},
        )

    async def nap(self) -> None:
        await asyncio.sleep(LEASE_SECONDS * 1.2)  # what it holds lapses meanwhile

    async def step(self) -> None:
        op = self.rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        if op in ("renew", "finish_done", "finish_failed", "retry", "park", "offload"):
            claim = self.pick()
            if claim is None:
                await self.claim()
                return
            await self.settle(op.removeprefix("finish_"), claim)
            return
        await getattr(self, op)()

    async def run(self) -> None:
        while True:
            await self.step()

    # --- the final client --------------------------------------------------------------------

    async def settle_everything(self, seconds: float) -> bool:
        """Drain and finish until nothing is pending; False if time runs out first."""
        deadline = time.monotonic() + seconds
        while True:
            for handle in HANDLES:
                try:
                    found = await self.store.offloaded(handle)
                except INDETERMINATE:
                    found = []
                for item in found:
                    claim = Claim(item["item_id"], item["fence"], item["payload"].get("token"))
                    await self.settle("done", claim)
            await self.drain(final=True)
            counts = await self.store.counts()
            pending = {s: counts[s] for s in ("ready", "deferred", "claimed", "offloaded")}
            if not any(pending.values()):
                print("clear", flush=True)
                return True
            if time.monotonic() > deadline:
                print("stuck", pending, flush=True)
                return False
            await asyncio.sleep(0.1)  # deferred items fall due, lapsed leases lapse


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("location")
    parser.add_argument("acklog", type=pathlib.Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("--coroutines", type=int, default=2)
    parser.add_argument("--archive", type=pathlib.Path, default=None)
    parser.add_argument("--final", type=float, default=None, metavar="SECONDS")
    args = parser.parse_args(argv)
    archive = (args.archive or args.acklog.with_name("archive.jsonl")).absolute()
    rng = random.Random(args.seed)
    base = f"s{args.seed}p{os.getpid()}"
    log = AckLog(args.acklog)
    store = ControlStore(
        args.location,
        lease_seconds=LEASE_SECONDS,
        retention=RETENTION_SECONDS,
        archive_path=archive,  # explicit: a PostgreSQL store has no file to put it beside
        purge_min_interval_s=0.5,
        purge_chunk=4,
        rng=random.Random(rng.random()),
    )
    try:
        async with store:
            await store.projects()  # open before saying ready
            print("ready", flush=True)
            clients = [
                Client(store, log, f"{base}c{c}", random.Random(rng.random()), archive)
                for c in range(1 if args.final is not None else args.coroutines)
            ]
            if args.final is not None:
                return 0 if await clients[0].settle_everything(args.final) else 1
            await asyncio.gather(*(client.run() for client in clients))
    except AsyncplaneError as exc:  # a bug in this client, or in the store: say it loudly
        print(f"kill_worker: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
