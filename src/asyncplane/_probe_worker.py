"""One worker process of the qualification probe (see `asyncplane.probe`).

Started by the probe as a separate interpreter (``python -m asyncplane._probe_worker``),
never forked from a running event loop. It opens its own ControlStore on the file (or
PostgreSQL URL), as a deployed worker would, and talks to the probe through one line of
JSON per message:

* on stdout: ``{"ready": ...}`` once it is warm (the store open, its connections made,
  the first hand-off to a thread done, so that nothing of its start-up falls in the
  probe's timed window), a ``finishedmany`` line (``[item_id, fence]`` pairs) for the items it
  finished in one turn of its event loop (flushed at the turn's end, so a killed worker
  loses at most one turn's), ``{"claimed": ...}`` in hold mode, and a final
  ``{"summary": ...}``. With ``--report-at-end`` (concurrent-queue, whose workers nothing
  kills) the finished items are said once the drain is over (or fails), before the
  summary, in lines of at most `LINE_ITEMS`: a line per turn cost a one-coroutine fleet
  about a tenth of its workers' CPU, the probe's own messages and not the store's work;
  such a worker then closes its store and exits only when its stdin ends;
* on stdin: one line to start (so every worker starts at once), in hold mode one line
  telling it to report its held item, and with ``--report-at-end`` its end, which the
  probe gives once every worker has said its summary: a worker's shut-down (its store
  closed, its interpreter torn down) never takes the CPU from one still draining.

Modes:

``drain``
    ``--concurrency`` coroutines claim and finish until the queue is empty. With
    ``--until-drained`` (chaos), a worker that finds nothing to claim waits while any item
    is still claimed, since a killed worker's lease will lapse and hand it on.
``hold``
    Claim one item, say so, and hold it without renewing until told to report; then
    try to finish it and say whether the store accepted or fenced out the report.

``--fault`` makes one worker misbehave, so that a test can show the probe failing with
the right count named: ``duplicate-finish`` settles an item a second time and
``delete-item`` deletes a queued item (both through raw SQL), ``ghost-finish`` claims and
finishes an item under another name before the run starts (an item no worker did).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time

import anyio.to_thread

from asyncplane import _errors, _loops, _models, _probe_protocol, _probe_support, _store

#: How long a --until-drained worker waits before looking again for lapsed leases.
_IDLE_POLL_SECONDS = 0.05


def _nothing() -> None:
    """A hand-off to a thread that does nothing (the warm-up before ready)."""


def _cpu_seconds() -> float:
    """CPU time this process has used so far, every thread, user and system."""
    return time.process_time()  # every thread's, at the clock's own resolution


def _say(message: _probe_protocol.Message) -> None:
    sys.stdout.write(_probe_protocol.encode(message) + "\n")
    sys.stdout.flush()


#: At most this many finished items in one line (the probe reads a line of at most 64 KiB).
LINE_ITEMS = 1000


class _Finishes:
    """The items finished in one turn of the event loop, said in one line at its end: a
    round's finishes cost the worker one write and the probe one line, not one each.
    ``at_end``: kept until `flush` is called at the end of the drain instead."""

    def __init__(self, *, at_end: bool = False) -> None:
        self._items: list[list[int]] = []
        self._at_end = at_end

    def add(self, item_id: int, fence: int) -> None:
        if not self._items and not self._at_end:
            asyncio.get_running_loop().call_soon(self.flush)
        self._items.append([item_id, fence])

    def flush(self) -> None:
        for start in range(0, len(self._items), LINE_ITEMS):
            _say(_probe_protocol.FinishedMany(self._items[start : start + LINE_ITEMS]))
        self._items = []


class _Tally:
    def __init__(self, *, report_at_end: bool = False) -> None:
        self.claimed = 0
        self.finished = 0
        self.locked = 0
        self.fence_rejected = 0
        self.errors: list[str] = []
        self.claim_seconds: list[float] = []
        self.finishes = _Finishes(at_end=report_at_end)

    def claim_p99(self) -> float:
        """The 99th percentile of this worker's claim latencies, in seconds."""
        if not self.claim_seconds:
            return 0.0
        ordered = sorted(self.claim_seconds)  # nearest rank: of 100, the 99th
        return ordered[max(0, math.ceil(len(ordered) * 0.99) - 1)]


async def _drain_one(
    store: _store.ControlStore, owner: str, tally: _Tally, until_drained: bool
) -> None:
    """Claim and finish until there is nothing to claim. Each finish carries the next
    claim with it (`ControlStore.finish_and_claim`): one write round an item, as a
    worker running `asyncplane.work` pays."""
    done: _models.ClaimedItem | None = None  # claimed and run: settle it with the next claim
    while True:
        asked = time.perf_counter()
        try:
            if done is None:
                claim = await store.claim(owner=owner)
            else:
                claim = await store.finish_and_claim(done.item_id, fence=done.fence, owner=owner)
                tally.finished += 1
                tally.finishes.add(done.item_id, done.fence)
        except _errors.ClaimAfterSettleFailed as exc:  # settled; its claim was not
            assert done is not None  # only finish_and_claim raises it
            tally.finished += 1
            tally.finishes.add(done.item_id, done.fence)
            if not isinstance(exc.__cause__, _errors.DatabaseLocked):
                raise
            tally.locked += 1
            done = None
            continue
        except _errors.FenceRejected:  # the settle refused: nothing was claimed with it
            tally.fence_rejected += 1
            done = None
            continue
        except _errors.DatabaseLocked:  # nothing written
            tally.locked += 1
            done = None
            continue
        tally.claim_seconds.append(time.perf_counter() - asked)
        done = claim
        if claim is None:
            if not until_drained:
                return
            counts = await store.counts()
            if _probe_support.drained(counts):
                return
            await asyncio.sleep(_IDLE_POLL_SECONDS)  # a lapsed lease is a matter of time
            continue
        tally.claimed += 1


async def _main(args: argparse.Namespace) -> int:
    tally = _Tally(report_at_end=args.report_at_end)
    store = _store.ControlStore(
        args.store, lease_seconds=args.lease_seconds, synchronous=args.synchronous
    )
    async with store:
        await store.counts()  # opened before saying ready
        await anyio.to_thread.run_sync(_nothing)  # anyio's thread machinery, warm too
        if args.fault == "delete-item":  # before anyone starts: the item is surely pending
            await _probe_support.inject_fault(args.store, args.fault)
        if args.fault == "ghost-finish":  # done by something that is no worker of the run
            ghost = await store.claim(owner="ghost")
            if ghost is not None:
                await store.finish(ghost.item_id, fence=ghost.fence, status="done")
        _say(_probe_protocol.Ready(args.name, _loops.running()))
        if not args.no_wait and not await anyio.to_thread.run_sync(sys.stdin.readline):
            print("the probe that started this worker is gone", file=sys.stderr)
            return 1  # its stdin closed before "go": it will never say go
        cpu_at_go = _cpu_seconds()
        try:
            if args.mode == "hold":
                await _hold(store, args, tally)
            else:
                await asyncio.gather(
                    *(
                        _drain_one(store, f"{args.name}/{n}", tally, args.until_drained)
                        for n in range(args.concurrency)
                    )
                )
            cpu_s = _cpu_seconds() - cpu_at_go  # to the last item: the lines below are ours
        finally:
            tally.finishes.flush()  # a worker failing mid-drain still says what it finished
        if args.fault == "duplicate-finish":
            await _probe_support.inject_fault(args.store, args.fault)
        writer = (await _store.engine_of(store).ready()).writer
        _say(
            _probe_protocol.Summary(
                name=args.name,
                claimed=tally.claimed,
                finished=tally.finished,
                locked=tally.locked,
                fence_rejected=tally.fence_rejected,
                max_lock_wait=getattr(writer, "max_lock_wait", 0.0),
                cpu_s=cpu_s,
                claim_p99=tally.claim_p99(),
                lock_held=getattr(writer, "total_lock_held", 0.0),
            )
        )
        if args.report_at_end:
            # Its store stays open, and its interpreter up, until the probe lets it go
            # (its stdin closed once every worker has said its summary): a worker's
            # shut-down never falls in the drain of one still at work.
            await anyio.to_thread.run_sync(sys.stdin.readline)
    return 0


async def _hold(store: _store.ControlStore, args: argparse.Namespace, tally: _Tally) -> None:
    claim = None
    while claim is None:
        claim = await store.claim(owner=args.name)
        if claim is None:
            await asyncio.sleep(_IDLE_POLL_SECONDS)
    tally.claimed += 1
    _say(_probe_protocol.Claimed(claim.item_id, claim.fence, claim.lease_expires_at.timestamp()))
    await anyio.to_thread.run_sync(sys.stdin.readline)  # "report now": possibly much later
    try:
        await store.finish(claim.item_id, fence=claim.fence, status="done")
    except _errors.FenceRejected:
        tally.fence_rejected += 1
        _say(_probe_protocol.Reported("fence_rejected", claim.item_id, claim.fence))
    else:
        tally.finished += 1
        _say(_probe_protocol.Reported("finished", claim.item_id, claim.fence))


def _die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this worker when the probe that started it dies,
    however it dies (SIGKILL included): a worker left behind would go on draining, and
    compete with the next run for the store and the CPUs. (Elsewhere a worker whose
    probe is gone sees its stdin close, and stops before it starts.)"""
    parent = os.environ.get(_probe_protocol.PARENT_VARIABLE)
    if sys.platform != "linux" or parent is None:
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if str(os.getppid()) != parent:  # it died before the line above: too late to be told
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m asyncplane._probe_worker")
    parser.add_argument(
        "--store", default=os.environ.get(_probe_protocol.STORE_VARIABLE),
        help=f"the store (default: ${_probe_protocol.STORE_VARIABLE}, which keeps a URL's "
        "password off the process list)",
    )  # fmt: skip
    parser.add_argument("--name", required=True)
    parser.add_argument("--mode", choices=("drain", "hold"), default="drain")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--lease-seconds", type=float, default=900.0)
    parser.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL")
    parser.add_argument("--until-drained", action="store_true")
    parser.add_argument("--no-wait", action="store_true", help="start without a go line")
    parser.add_argument(
        "--report-at-end", action="store_true",
        help="say the finished items once the drain is over, not at every turn's end, "
        "and exit only once stdin ends",
    )  # fmt: skip
    parser.add_argument("--fault", choices=_probe_support.FAULTS)
    args = parser.parse_args(argv)
    if not args.store:
        parser.error(f"--store, or ${_probe_protocol.STORE_VARIABLE}, names the store")
    try:
        return _loops.run(_main(args))
    except _errors.DatabaseLocked:
        raise  # not the store failing: a lock wait ran out, a count the probe makes
    except _errors.StorageError as exc:  # its last line on stderr says how
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return _probe_protocol.STORE_FAILED


if __name__ == "__main__":
    sys.exit(main())
