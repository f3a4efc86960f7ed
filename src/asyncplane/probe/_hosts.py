"""A run spread over several hosts (``--role coordinator`` / ``--role worker``), on PostgreSQL."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Sequence
from typing import TextIO

from asyncplane import (
    _errors,
    _probe_support,
    _store,
)
from asyncplane.probe._report import _PROJECT, ProbeReport
from asyncplane.probe._workers import (
    _check,
    _expect_heard,
    _go,
    _seed,
    _spawn,
    _start_progress,
    _stop,
    _tally_workers,
    _until_drained,
    _Worker,
)

# --- several hosts (--role) ------------------------------------------------------------------


async def _seeded_ids(
    store: _store.ControlStore, wait_seconds: float, deadline: float | None = None
) -> list[int]:
    """A worker host's wait for the coordinator's items: the probe project must be open,
    which the coordinator makes it once every item is enqueued. ``deadline`` (monotonic)
    ends a wait begun earlier; without it the wait is ``wait_seconds`` from now."""
    if deadline is None:
        deadline = time.monotonic() + wait_seconds
    status = None
    while True:
        with contextlib.suppress(_errors.UnknownProject):
            status = (await store.project(_PROJECT))["status"]
            if status == "open":
                return []
        if time.monotonic() > deadline:
            raise _errors.InvalidInput(
                f"the probe's items were still being seeded after {wait_seconds:g} s "
                "(its project is paused): the coordinator is slow, or stopped before it "
                "had enqueued them all"
                if status is not None
                else f"no probe items appeared within {wait_seconds:g} s: start the "
                "coordinator (--role coordinator) on the same store"
            )
        await asyncio.sleep(0.2)


async def _coordinate(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    """Seed the items, wait for workers elsewhere to drain them, count from the database."""
    ids = await _seed(store, args.items)
    started = time.monotonic()
    print(
        f"asyncplane probe: {args.items} items seeded; start workers with --role worker "
        f"--store <this store> --scenario {args.scenario}",
        file=out,
        flush=True,
    )
    progress = _start_progress(store, args.items, started, out, report.scenario)
    deadline = started + args.wait_seconds
    try:
        while True:
            counts = await store.counts()
            if _probe_support.drained(counts):
                break
            if time.monotonic() > deadline:
                report.failures.append(
                    f"the queue was not drained within {args.wait_seconds:g} s "
                    f"({counts['done']} of {args.items} done)"
                )
                break
            await asyncio.sleep(0.1)
        report.seconds = time.monotonic() - started
    finally:
        await _stop(progress, out)
    await _check(report, store, ids, [])
    drained = args.items - report.lost  # a drain cut short by the wait: its rate so far
    report.items_per_s = drained / report.seconds if report.seconds else 0.0
    report.notes.append("counts from the database; each worker host checks its own records")
    if report.scenario == "chaos" and report.re_executions == 0:
        # The worker hosts' kills are theirs to count: the coordinator sees only their
        # traces, and without a takeover no kill hit a worker at work.
        report.notes.append(
            "no claim was taken over after a lapsed lease: no worker host's kill hit a "
            "worker at work, and this run proved no crash safe (give chaos more --items)"
        )


async def _work_here(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    """Run this host's workers on a store a coordinator seeded; check their records."""
    await _seeded_ids(store, args.wait_seconds, args.wait_deadline)
    workers = [await _spawn(args, f"{_host()}-w{n}", "--until-drained", "--report-at-end")
               for n in range(args.workers)]  # fmt: skip
    started = await _go(workers, report)
    await _until_drained(workers, started, report)
    done = sum(len(w.finished) for w in workers)
    report.items = done
    report.items_per_s = done / report.seconds if report.seconds else 0.0
    _check_workers(report, workers)
    _expect_heard(report, workers)
    report.expect("fence_rejections", report.fence_rejections, 0)


def _check_workers(report: ProbeReport, workers: Sequence[_Worker]) -> None:
    """The counts one host can check alone: its workers' own records and exits."""
    seen: collections.Counter[int] = collections.Counter(
        item_id for worker in workers for item_id, _ in worker.finished
    )
    report.duplicates = sum(1 for count in seen.values() if count > 1)
    _tally_workers(report, workers)
    report.expect("duplicates", report.duplicates, 0)
    report.expect("locked_errors", report.locked_errors, 0)
    report.expect("worker_crashes", report.worker_crashes, 0)


def _host() -> str:
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"
