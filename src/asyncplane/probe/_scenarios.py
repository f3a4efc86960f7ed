"""The scenarios: concurrent-queue, chaos, kill-and-reclaim, stall."""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import time
from typing import TextIO

from asyncplane import (
    _clock,
    _errors,
    _probe_protocol,
    _probe_support,
    _store,
)
from asyncplane.probe._hosts import _check_workers, _coordinate, _seeded_ids, _work_here
from asyncplane.probe._report import _KILL_EVERY_SECONDS, ProbeReport
from asyncplane.probe._workers import (
    _check,
    _expect_heard,
    _expect_named,
    _go,
    _raise_on_store_failure,
    _seed,
    _spawn,
    _start_progress,
    _stop,
    _until_drained,
    _Worker,
)

# --- scenarios -----------------------------------------------------------------------------


async def _concurrent_queue(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    if args.role == "coordinator":
        await _coordinate(args, store, report, out)
        return
    if args.role == "worker":
        await _work_here(args, store, report, out)
        return
    ids = await _seed(store, args.items)
    extra = ("--fault", args.fault) if args.fault else ()
    # Nothing kills these workers: they say what they finished once their drain is over,
    # in a few lines, not a line per turn of their event loop while it runs.
    workers = [
        await _spawn(args, f"w{n}", "--report-at-end", *(extra if n == 0 else ()))
        for n in range(args.workers)
    ]
    started = await _go(workers, report)
    progress = _start_progress(store, args.items, started, out, report.scenario)
    try:
        await _until_drained(workers, started, report)
    finally:
        await _stop(progress, out)
    await _check(report, store, ids, workers)
    await _expect_named(report, store, ids, workers)
    done = args.items - report.lost
    report.items_per_s = done / report.seconds if report.seconds else 0.0
    _expect_heard(report, workers)
    report.expect("fence_rejections", report.fence_rejections, 0)


async def _chaos(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    if args.role == "coordinator":
        await _coordinate(args, store, report, out)
        return
    ids = (
        await _seeded_ids(store, args.wait_seconds, args.wait_deadline)
        if args.role == "worker"
        else await _seed(store, args.items)
    )
    live = [await _spawn(args, f"w{n}", "--until-drained") for n in range(args.workers)]
    everyone = list(live)
    started = await _go(live, report)
    progress = _start_progress(store, args.items, started, out, report.scenario)
    rng = random.Random(args.seed)
    try:
        while not _probe_support.drained(await store.counts()):
            await asyncio.sleep(_KILL_EVERY_SECONDS)
            if any(w.process.returncode not in (0, None) for w in live):
                break  # one ended of itself, not drained: its store failed, or it crashed
            # Only a worker that is at work: one killed before it is warm did nothing (a
            # lone worker would be killed for ever), nor one after the queue drained.
            warm = [w for w in live if w.ready.is_set()]
            if not warm or _probe_support.drained(await store.counts()):
                continue
            victim = rng.choice(warm)
            victim.kill()
            await victim.wait()
            report.kills += 1
            spawned = await _spawn(args, f"w{len(everyone)}", "--until-drained", "--no-wait")
            live[live.index(victim)] = spawned
            everyone.append(spawned)
        await asyncio.gather(*(w.wait() for w in live))
        report.seconds = time.monotonic() - started
        _raise_on_store_failure(everyone)
    finally:
        await _stop(progress, out)
        for worker in live:
            if worker.process.returncode is None:
                worker.kill()
                await worker.wait()
    if args.role == "worker":  # this host's share: what its workers finished
        report.items = sum(len(w.finished) for w in everyone)
        _check_workers(report, everyone)
        done = report.items
    else:
        await _check(report, store, ids, everyone)
        await _check_takeovers(report, store, everyone)
        done = report.items - report.lost
    report.items_per_s = done / report.seconds if report.seconds else 0.0
    if report.kills == 0 and args.role == "all":  # a drain before any kill proved nothing
        report.failures.append(
            "no worker was killed before the queue drained: give chaos more --items"
        )
    report.notes.append(
        f"{report.kills} workers killed and replaced; {report.re_executions} items taken "
        f"over after a lapsed lease; {report.fence_rejections} late reports fenced out"
    )


async def _check_takeovers(
    report: ProbeReport, store: _store.ControlStore, workers: list[_Worker]
) -> None:
    """Each takeover against what happened to the worker it was taken from (its claims
    are named ``<worker>/<coroutine>``, each coroutine holding one claim at a time):
    a killed worker's coroutine held at most one claim when it died, so at most one of
    its claims is taken over after its last claim (one taken over before, while it went
    on, it was told of and cannot be counted: a killed worker says no summary); a
    worker never killed hears of each of its claims taken over when it reports it (a
    fence refusal), and of none that was not, unless a locked write made it drop a
    claim unsaid. Checked worker by worker."""
    tally = await (await _store.engine_of(store).ready()).tally()
    names = {worker.name for worker in workers}

    def of(owner: str) -> str | None:
        name = owner.rpartition("/")[0]
        return name if name in names else None

    taken = dict.fromkeys(names, 0)
    for owner, count in tally.taken_from.items():
        if (name := of(owner)) is not None:
            taken[name] += count
    killed = {w.name for w in workers if w.killed}
    beyond = sum(
        count - 1
        for owner, count in tally.taken_at_the_end.items()
        if of(owner) in killed and count > 1
    )
    report.expect("takeovers_beyond_what_killed_workers_held", beyond, 0)
    live = [w for w in workers if not w.killed]
    if any(w.summary is None for w in live):
        return  # a worker that crashed: worker_crashes says so
    unheard = refused_untaken = 0
    for worker in live:
        assert worker.summary is not None
        refused, dropped = worker.summary.fence_rejected, worker.summary.locked
        refused_untaken += max(0, refused - taken[worker.name])
        unheard += max(0, taken[worker.name] - refused - dropped)
    report.expect("fence_refusals_without_a_takeover", refused_untaken, 0)
    report.expect("takeovers_never_heard_of", unheard, 0)
    report.notes.append(
        f"takeovers: {sum(taken[name] for name in killed)} of killed workers' claims, "
        f"{sum(taken[w.name] for w in live)} of live workers' (their leases lapsed while "
        "they ran)"
    )


async def _kill_and_reclaim(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    ids = await _seed(store, 1)
    holder = await _spawn(args, "doomed", "--mode", "hold")
    started = await _go([holder], report)
    warming = report.startup_s  # the rescuer's start-up is counted apart too, not timed
    await holder.until(holder.claimed_event, "claimed")
    assert holder.claimed is not None
    holder.kill()  # mid-work, with no chance to clean up
    await holder.wait()
    report.kills += 1
    await _sleep_until(store, holder.claimed.lease_expires_at)
    rescuer = await _spawn(args, "rescuer")
    await _go([rescuer], report)
    await rescuer.wait()
    report.seconds = time.monotonic() - started - (report.startup_s - warming)
    await _stand_in_reports_late(report, store, holder.claimed)
    await _check(report, store, ids, [holder, rescuer])
    _expect_takeover(report, holder.claimed, rescuer)


async def _stall(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    if not hasattr(signal, "SIGSTOP"):
        raise _errors.InvalidInput("the stall scenario needs SIGSTOP/SIGCONT (POSIX)")
    ids = await _seed(store, 1)
    sleeper = await _spawn(args, "stalled", "--mode", "hold")
    started = await _go([sleeper], report)
    warming = report.startup_s  # the rescuer's start-up is counted apart too, not timed
    await sleeper.until(sleeper.claimed_event, "claimed")
    assert sleeper.claimed is not None
    sleeper.process.send_signal(signal.SIGSTOP)
    try:
        await _sleep_until(store, sleeper.claimed.lease_expires_at)
        rescuer = await _spawn(args, "rescuer")
        await _go([rescuer], report)
        await rescuer.wait()
    finally:
        sleeper.process.send_signal(signal.SIGCONT)
    await sleeper.say("report")  # the stalled worker wakes and reports with its old fence
    await sleeper.wait()
    report.seconds = time.monotonic() - started - (report.startup_s - warming)
    report.expected_fence_rejections = 1
    outcome = sleeper.report.outcome if sleeper.report else "no report"
    if outcome != "fence_rejected":
        report.failures.append(f"the stalled worker's late report was {outcome!r}, not fenced out")
    await _check(report, store, ids, [sleeper, rescuer])
    report.expect("fence_rejections", report.fence_rejections, 1)
    _expect_takeover(report, sleeper.claimed, rescuer)


async def _stand_in_reports_late(
    report: ProbeReport, store: _store.ControlStore, claimed: _probe_protocol.Claimed
) -> None:
    """Report for the dead worker with its old fence: the store must refuse it."""
    report.expected_fence_rejections = 1
    try:
        await store.finish(claimed.item, fence=claimed.fence, status="done")
    except _errors.FenceRejected:
        report.fence_rejections += 1
    else:
        report.failures.append("the dead worker's late report with its old fence was accepted")
    report.expect("fence_rejections", report.fence_rejections, 1)


def _expect_takeover(
    report: ProbeReport, claimed: _probe_protocol.Claimed, rescuer: _Worker
) -> None:
    if len(rescuer.finished) != 1:
        report.failures.append(f"the rescuer finished {len(rescuer.finished)} items, not 1")
        return
    item_id, fence = rescuer.finished[0]
    if item_id != claimed.item or fence <= claimed.fence:
        report.failures.append(
            f"the rescuer finished item {item_id} at fence {fence}; expected item "
            f"{claimed.item} above fence {claimed.fence}"
        )
    report.expect("re_executions", report.re_executions, 1)


async def _sleep_until(store: _store.ControlStore, when: float) -> None:
    """Wait until a lease has lapsed by the clock the store measures leases with (the
    database server's, on PostgreSQL)."""
    await _clock.wait_until(store.clock, when + 0.05)


_RUNNERS = {
    "concurrent-queue": _concurrent_queue,
    "kill-and-reclaim": _kill_and_reclaim,
    "chaos": _chaos,
    "stall": _stall,
}
