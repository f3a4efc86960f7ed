"""The qualification probe: does SQLite hold up on *this* disk, with separate processes?

    python -m asyncplane.probe --store PATH --scenario concurrent-queue --workers 16 --items 10000
    python -m asyncplane.probe --store PATH --scenario kill-and-reclaim
    python -m asyncplane.probe --store PATH --scenario chaos --workers 16 --items 10000
    python -m asyncplane.probe --store PATH --scenario stall

Threads or coroutines in one interpreter share a connection pool and a GIL, and pass where
the deployed shape fails; so every worker here is a separate interpreter
(`asyncplane._probe_worker`), started fresh (never forked from a running event loop), with
its own ControlStore on the file. The probe exits 0 only when every count is exactly what
it must be (no duplicate claim, no lost item, no "database is locked", a clean ledger) and
1 otherwise, naming each count that is wrong. If it fails on the disk you deploy on, the
answer is a server database, not a retry loop that hides an unsuitable substrate.

Scenarios:

``concurrent-queue``
    Enqueue the items, start the workers, each with ``--concurrency`` claiming coroutines,
    and drain the queue. Duplicates are counted from the workers' own records and from the
    ledger; lost items from the rows.
``kill-and-reclaim``
    A worker claims an item and is killed (SIGKILL) mid-work. Once the lease lapses another
    worker reclaims it with a higher fence and finishes it; a stand-in for the dead worker
    then reports with the old fence and must be refused; exactly one terminal event.
``chaos``
    ``concurrent-queue`` with short leases while a random worker is killed and respawned
    every 200 ms: nothing lost, nothing settled twice, a clean ledger.
``stall``
    A worker holding an item is stopped (SIGSTOP) for longer than its lease, then resumed
    (SIGCONT); by then the item was taken over and finished, so its report must be fenced
    out; exactly one terminal event.

On PostgreSQL (``--store postgresql://...``, a fresh schema) the same scenarios run, and
``concurrent-queue`` and ``chaos`` can span hosts: ``--role coordinator`` seeds the items,
waits for the queue to drain and checks every count from the database; ``--role worker``,
started on as many hosts as you like, runs ``--workers`` local worker processes against
the seeded store until it is drained and checks what they reported. Without ``--role``,
one command does both on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from asyncplane import (
    _clock,
    _engine,
    _errors,
    _ledger,
    _probe_protocol,
    _probe_support,
    _store,
    _validate,
)

__all__ = (
    "NETWORK_FILESYSTEMS",
    "SCENARIOS",
    "ProbeReport",
    "filesystem_in_mountinfo",
    "filesystem_of",
    "main",
    "network_filesystem_warning",
    "run_probe",
)

SCENARIOS = ("concurrent-queue", "kill-and-reclaim", "chaos", "stall")
ROLES = ("all", "coordinator", "worker")
#: Scenarios whose workers may run on other hosts (``--role``).
SPREADABLE = ("concurrent-queue", "chaos")

#: File systems on which SQLite's WAL mode is not safe (its shared-memory index needs one
#: host's memory), or whose locking is not to be trusted.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "9p", "afs", "ceph",
        "glusterfs", "fuse.glusterfs", "lustre", "gpfs", "ocfs2", "gfs2", "fuse.sshfs",
        "sshfs", "davfs", "fuse.davfs2", "fuse.s3fs", "fuse.rclone", "fuse.gcsfuse",
        "fuse.juicefs", "beegfs", "orangefs", "pvfs2",
    }
)  # fmt: skip

_KILL_EVERY_SECONDS = 0.2
_PROJECT = "probe"


@dataclasses.dataclass
class ProbeReport:
    """What a probe run counted; ``passed`` only when every count is what it must be."""

    scenario: str
    workers: int
    items: int
    concurrency: int
    synchronous: str
    lease_seconds: float
    seconds: float = 0.0
    items_per_s: float = 0.0
    duplicates: int = 0
    lost: int = 0
    locked_errors: int = 0
    fence_rejections: int = 0
    expected_fence_rejections: int = 0
    ledger_problems: int = 0
    per_worker_min: int = 0
    per_worker_max: int = 0
    max_lock_wait_s: float = 0.0
    role: str = "all"
    kills: int = 0
    re_executions: int = 0
    worker_crashes: int = 0
    filesystem: str = ""
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no count is wrong."""
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON values (``passed`` included)."""
        return {**dataclasses.asdict(self), "passed": self.passed}

    def expect(self, name: str, value: int, must_be: int) -> None:
        """Record a failure unless ``value`` is exactly ``must_be``."""
        if value != must_be:
            self.failures.append(f"{name} is {value}, must be {must_be}")


# --- the filesystem check ------------------------------------------------------------------


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding ``path`` (Linux: from /proc/self/mountinfo).

    Returns "" where it cannot be told, and "postgresql" for a database URL.
    """
    if _engine.is_postgres_url(path):
        return "postgresql"
    target = os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            return filesystem_in_mountinfo(mounts.read(), target)
    except OSError:
        return ""


def filesystem_in_mountinfo(mountinfo: str, target: str) -> str:
    """The filesystem type of the deepest mount holding ``target``, per a mountinfo text."""
    best, best_type = "", ""
    for line in mountinfo.splitlines():
        # id parent major:minor root mount-point options ... - fstype source super-options
        before, _, after = line.partition(" - ")
        fields = before.split()
        if len(fields) < 5 or not after:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, after.split()[0]
    return best_type


def network_filesystem_warning(path: str | os.PathLike[str], filesystem: str) -> str | None:
    """The warning to print before a run on a network filesystem, or None."""
    if filesystem not in NETWORK_FILESYSTEMS:
        return None
    return (
        f"WARNING: {os.fspath(path)} is on a {filesystem} network filesystem. SQLite's WAL "
        "mode needs every process on one host sharing memory, so on a network filesystem "
        "it is not safe, whatever this probe reports. Use a local disk, or a server database."
    )


# --- worker processes ----------------------------------------------------------------------


class _Worker:
    """One worker process and what it has said."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        self.ready = asyncio.Event()
        self.claimed: _probe_protocol.Claimed | None = None
        self.claimed_event = asyncio.Event()
        self.report: _probe_protocol.Reported | None = None
        self.summary: _probe_protocol.Summary | None = None
        self.finished: list[tuple[int, int]] = []
        self.stderr = b""
        self.killed = False
        self._readers = [
            asyncio.create_task(self._read_stdout(), name=f"probe-stdout[{name}]"),
            asyncio.create_task(self._read_stderr(), name=f"probe-stderr[{name}]"),
        ]

    async def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            message = _probe_protocol.decode(raw)  # None: a line cut short by a kill
            if isinstance(message, _probe_protocol.Finished):
                self.finished.append((message.item, message.fence))
            elif isinstance(message, _probe_protocol.Summary):
                self.summary = message
            elif isinstance(message, _probe_protocol.Ready):
                self.ready.set()
            elif isinstance(message, _probe_protocol.Claimed):
                self.claimed = message
                self.claimed_event.set()
            elif isinstance(message, _probe_protocol.Reported):
                self.report = message

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self.stderr = await self.process.stderr.read()

    async def say(self, line: str = "go") -> None:
        """Send one line to the worker's stdin."""
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()

    def kill(self) -> None:
        """SIGKILL (TerminateProcess on Windows): no cleanup, as in a crash."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def wait(self) -> int:
        """Wait for the process and for everything it wrote."""
        code = await self.process.wait()
        await asyncio.gather(*self._readers)
        return code


async def _spawn(
    args: argparse.Namespace, name: str, *extra: str, lease_seconds: float | None = None
) -> _Worker:
    command = [
        sys.executable, "-m", "asyncplane._probe_worker",
        "--store", str(args.store), "--name", name,
        "--concurrency", str(args.concurrency),
        "--lease-seconds", str(lease_seconds or args.lease_seconds),
        "--synchronous", args.synchronous,
        *extra,
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    return _Worker(name, process)


# --- shared steps --------------------------------------------------------------------------


async def _seed(store: _store.ControlStore, items: int) -> list[int]:
    await store.create_project(_PROJECT, "asyncplane probe")
    ids: list[int] = []
    for start in range(0, items, 512):  # concurrent enqueues share group commits
        chunk = range(start, min(items, start + 512))
        ids.extend(await asyncio.gather(*(store.enqueue(_PROJECT, {"n": n}) for n in chunk)))
    return ids


async def _progress(
    store: _store.ControlStore, total: int, started: float, out: TextIO, label: str
) -> None:
    """Keep one line on a terminal up to date: items done of total, and the rate."""
    while True:
        done = (await store.counts())["done"]
        rate = done / max(time.monotonic() - started, 1e-9)
        out.write(f"\r{label}: {done}/{total} items done, {rate:,.0f}/s  ")
        out.flush()
        await asyncio.sleep(0.25)


async def _check(
    report: ProbeReport,
    store: _store.ControlStore,
    ids: list[int],
    workers: Sequence[_Worker],
) -> None:
    """Count duplicates, lost items, locked errors and ledger problems after a run."""
    backend = await _store.engine_of(store).ready()
    tally = await backend.tally()
    finished_by: dict[int, list[tuple[str, int]]] = collections.defaultdict(list)
    for worker in workers:
        for item_id, fence in worker.finished:
            finished_by[item_id].append((worker.name, fence))
    reported_twice = {item_id for item_id, who in finished_by.items() if len(who) > 1}
    duplicated = reported_twice | set(tally.settled_twice) | set(tally.unexplained_claims)
    report.duplicates = len(duplicated)
    done = set(await backend.item_ids("done"))
    report.lost = sum(1 for item_id in ids if item_id not in done)
    report.re_executions = tally.takeovers
    report.ledger_problems = len(await _ledger.verify_ledger(store))
    summaries = [w.summary for w in workers if w.summary is not None]
    report.locked_errors = sum(s.locked for s in summaries) + sum(
        w.stderr.count(b"database is locked") for w in workers
    )
    report.fence_rejections += sum(s.fence_rejected for s in summaries)
    report.max_lock_wait_s = max((s.max_lock_wait for s in summaries), default=0.0)
    counts = [len(w.finished) for w in workers if not w.killed]
    report.per_worker_min = min(counts, default=0)
    report.per_worker_max = max(counts, default=0)
    report.worker_crashes = sum(
        1 for w in workers if not w.killed and w.process.returncode not in (0, None)
    )
    report.expect("duplicates", report.duplicates, 0)
    report.expect("lost", report.lost, 0)
    report.expect("locked_errors", report.locked_errors, 0)
    report.expect("ledger_problems", report.ledger_problems, 0)
    report.expect("worker_crashes", report.worker_crashes, 0)
    for worker in workers:
        if not worker.killed and worker.process.returncode not in (0, None):
            tail = worker.stderr.decode(errors="replace").strip().splitlines()[-1:]
            report.notes.append(f"worker {worker.name} exited {worker.process.returncode}: {tail}")


async def _go(workers: Sequence[_Worker]) -> float:
    """Wait until every worker has its store open, then start them all at once."""
    await asyncio.gather(*(w.ready.wait() for w in workers))
    started = time.monotonic()
    await asyncio.gather(*(w.say("go") for w in workers))
    return started


# --- several hosts (--role) ------------------------------------------------------------------


async def _seeded_ids(store: _store.ControlStore, wait_seconds: float) -> list[int]:
    """A worker host's wait for the coordinator's items: the probe project must exist."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            await store.project(_PROJECT)
            return []
        except _errors.UnknownProject:
            if time.monotonic() > deadline:
                raise _errors.InvalidInput(
                    f"no probe items appeared within {wait_seconds:g} s: start the "
                    "coordinator (--role coordinator) on the same store"
                ) from None
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
            if counts["ready"] == 0 and counts["claimed"] == 0 and counts["deferred"] == 0:
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
    report.items_per_s = args.items / report.seconds if report.seconds else 0.0
    await _check(report, store, ids, [])
    report.notes.append("counts from the database; each worker host checks its own records")


async def _work_here(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    """Run this host's workers on a store a coordinator seeded; check their records."""
    await _seeded_ids(store, args.wait_seconds)
    workers = [await _spawn(args, f"{_host()}-w{n}", "--until-drained")
               for n in range(args.workers)]  # fmt: skip
    started = await _go(workers)
    await asyncio.gather(*(w.wait() for w in workers))
    report.seconds = time.monotonic() - started
    done = sum(len(w.finished) for w in workers)
    report.items = done
    report.items_per_s = done / report.seconds if report.seconds else 0.0
    _check_workers(report, workers)
    report.expect("fence_rejections", report.fence_rejections, 0)


def _check_workers(report: ProbeReport, workers: Sequence[_Worker]) -> None:
    """The counts one host can check alone: its workers' own records and exits."""
    seen: collections.Counter[int] = collections.Counter(
        item_id for worker in workers for item_id, _ in worker.finished
    )
    report.duplicates = sum(1 for count in seen.values() if count > 1)
    summaries = [w.summary for w in workers if w.summary is not None]
    report.locked_errors = sum(s.locked for s in summaries)
    report.fence_rejections += sum(s.fence_rejected for s in summaries)
    counts = [len(w.finished) for w in workers if not w.killed]
    report.per_worker_min = min(counts, default=0)
    report.per_worker_max = max(counts, default=0)
    report.worker_crashes = sum(
        1 for w in workers if not w.killed and w.process.returncode not in (0, None)
    )
    report.expect("duplicates", report.duplicates, 0)
    report.expect("locked_errors", report.locked_errors, 0)
    report.expect("worker_crashes", report.worker_crashes, 0)


def _host() -> str:
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"


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
    workers = [await _spawn(args, f"w{n}", *(extra if n == 0 else ())) for n in range(args.workers)]
    started = await _go(workers)
    progress = _start_progress(store, args.items, started, out, report.scenario)
    try:
        await asyncio.gather(*(w.wait() for w in workers))
        report.seconds = time.monotonic() - started
    finally:
        await _stop(progress, out)
    report.items_per_s = args.items / report.seconds if report.seconds else 0.0
    await _check(report, store, ids, workers)
    report.expect("fence_rejections", report.fence_rejections, 0)


async def _chaos(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    if args.role == "coordinator":
        await _coordinate(args, store, report, out)
        return
    ids = (
        await _seeded_ids(store, args.wait_seconds)
        if args.role == "worker"
        else await _seed(store, args.items)
    )
    live = [await _spawn(args, f"w{n}", "--until-drained") for n in range(args.workers)]
    everyone = list(live)
    started = await _go(live)
    progress = _start_progress(store, args.items, started, out, report.scenario)
    rng = random.Random(args.seed)
    try:
        while True:
            counts = await store.counts()
            if counts["ready"] == 0 and counts["claimed"] == 0:
                break
            await asyncio.sleep(_KILL_EVERY_SECONDS)
            victim = rng.choice(live)
            victim.kill()
            await victim.wait()
            report.kills += 1
            spawned = await _spawn(args, f"w{len(everyone)}", "--until-drained", "--no-wait")
            live[live.index(victim)] = spawned
            everyone.append(spawned)
        await asyncio.gather(*(w.wait() for w in live))
        report.seconds = time.monotonic() - started
    finally:
        await _stop(progress, out)
        for worker in live:
            if worker.process.returncode is None:
                worker.kill()
                await worker.wait()
    report.items_per_s = args.items / report.seconds if report.seconds else 0.0
    if args.role == "worker":
        _check_workers(report, everyone)
    else:
        await _check(report, store, ids, everyone)
    report.notes.append(
        f"{report.kills} workers killed and replaced; {report.re_executions} items taken "
        f"over after a lapsed lease; {report.fence_rejections} late reports fenced out"
    )


async def _kill_and_reclaim(
    args: argparse.Namespace, store: _store.ControlStore, report: ProbeReport, out: TextIO
) -> None:
    ids = await _seed(store, 1)
    holder = await _spawn(args, "doomed", "--mode", "hold")
    started = await _go([holder])
    await holder.claimed_event.wait()
    assert holder.claimed is not None
    holder.kill()  # mid-work, with no chance to clean up
    await holder.wait()
    await _sleep_until(store, holder.claimed.lease_expires_at)
    rescuer = await _spawn(args, "rescuer")
    await _go([rescuer])
    await rescuer.wait()
    report.seconds = time.monotonic() - started
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
    started = await _go([sleeper])
    await sleeper.claimed_event.wait()
    assert sleeper.claimed is not None
    sleeper.process.send_signal(signal.SIGSTOP)
    try:
        await _sleep_until(store, sleeper.claimed.lease_expires_at)
        rescuer = await _spawn(args, "rescuer")
        await _go([rescuer])
        await rescuer.wait()
    finally:
        sleeper.process.send_signal(signal.SIGCONT)
    await sleeper.say("report")  # the stalled worker wakes and reports with its old fence
    await sleeper.wait()
    report.seconds = time.monotonic() - started
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


def _start_progress(
    store: _store.ControlStore, total: int, started: float, out: TextIO, label: str
) -> asyncio.Task[None] | None:
    if not out.isatty():
        return None
    return asyncio.create_task(_progress(store, total, started, out, label), name="probe-progress")


async def _stop(task: asyncio.Task[None] | None, out: TextIO) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    out.write("\r\033[K")
    out.flush()


_RUNNERS = {
    "concurrent-queue": _concurrent_queue,
    "kill-and-reclaim": _kill_and_reclaim,
    "chaos": _chaos,
    "stall": _stall,
}


# --- running and reporting -----------------------------------------------------------------


async def run_probe(args: argparse.Namespace, *, progress: TextIO = sys.stderr) -> ProbeReport:
    """Run one scenario on the store at ``args.store`` and return what it counted.

    ``args`` carries the command line's options (see `main`); the file should not exist
    yet (``main`` refuses an existing file unless told to overwrite it).
    """
    single = args.scenario in ("kill-and-reclaim", "stall")
    report = ProbeReport(
        scenario=args.scenario,
        workers=2 if single else args.workers,
        items=1 if single else args.items,
        concurrency=args.concurrency,
        synchronous=args.synchronous,
        lease_seconds=args.lease_seconds,
        filesystem=filesystem_of(args.store),
        role=args.role,
    )
    if args.role == "coordinator":
        report.workers = 0  # they run elsewhere, with --role worker
    if args.role == "worker":
        await _wait_for_store(args.store, args.wait_seconds)
    async with _store.ControlStore(
        args.store, lease_seconds=args.lease_seconds, synchronous=args.synchronous
    ) as store:
        await _RUNNERS[args.scenario](args, store, report, progress)
    return report


async def _wait_for_store(url: str, wait_seconds: float) -> None:
    """A worker host opens nothing before the coordinator has made the store (its opening
    would make the schema look used, and the coordinator insists on a fresh one)."""
    deadline = time.monotonic() + wait_seconds
    while await _probe_support.schema_is_empty(url):
        if time.monotonic() > deadline:
            raise _errors.InvalidInput(
                f"no store appeared within {wait_seconds:g} s: start the coordinator "
                "(--role coordinator) on the same store"
            )
        await asyncio.sleep(0.2)


def _default_lease(scenario: str) -> float:
    # Long enough that no lease lapses in a clean drain; short where lapses are the point.
    return {"concurrent-queue": 900.0, "chaos": 1.0}.get(scenario, 1.0)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Qualify a disk for an asyncplane store: separate worker processes, "
        "exact counts. Exits 0 when every count is exactly right, 1 otherwise.",
    )
    parser.add_argument("--store", required=True, help="the database file, or a postgresql:// URL")
    parser.add_argument("--scenario", required=True, choices=SCENARIOS)
    parser.add_argument("--workers", type=int, default=16, help="worker processes")
    parser.add_argument("--items", type=int, default=10_000, help="items to drain")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="claiming coroutines per worker process"
    )
    parser.add_argument("--lease-seconds", type=float, help="the lease (default per scenario)")
    parser.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an existing file at --store first"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for the chaos victims")
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="all",
        help="across hosts (concurrent-queue, chaos): 'coordinator' seeds and checks, "
        "'worker' runs this host's workers; 'all' (default) does both here",
    )
    parser.add_argument(
        "--wait-seconds",
        type=float,
        default=3600.0,
        help="how long a coordinator waits for the drain, and a worker for the items",
    )
    parser.add_argument("--fault", choices=_probe_support.FAULTS, help=argparse.SUPPRESS)
    return parser


def _prepare_path(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if _engine.is_postgres_url(args.store):
        if args.role != "worker":
            asyncio.run(_prepare_schema(args, parser))
        return
    store = pathlib.Path(args.store)
    paths = [store, *(store.with_name(store.name + s) for s in ("-wal", "-shm"))]
    if store.exists():
        if not args.overwrite:
            parser.error(f"{store} exists; the probe needs a fresh file (or --overwrite)")
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


async def _prepare_schema(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        fresh = await _probe_support.schema_is_empty(args.store)
        if not fresh:
            if not args.overwrite:
                parser.error(
                    "the schema holds a store already; the probe needs a fresh one "
                    "(another search_path, or --overwrite to drop this store's tables)"
                )
            await _probe_support.drop_store(args.store)
    except _errors.AsyncplaneError as exc:
        parser.error(str(exc))


def _human(report: ProbeReport) -> str:
    where = report.filesystem or "unknown filesystem"
    role = "" if report.role == "all" else f", {report.role}"
    lines = [
        f"asyncplane probe: {report.scenario} ({where}{role})",
        f"  {report.workers} worker processes x {report.concurrency} coroutines, "
        f"{report.items} items, lease {report.lease_seconds:g} s, "
        f"synchronous={report.synchronous}",
    ]
    if report.scenario in ("concurrent-queue", "chaos"):
        lines.append(
            f"  drained in {report.seconds:.2f} s: {report.items_per_s:,.0f} items/s "
            f"(per worker {report.per_worker_min} to {report.per_worker_max} items; "
            f"longest wait for the write lock {report.max_lock_wait_s * 1000:.0f} ms)"
            if report.filesystem != "postgresql"
            else f"  drained in {report.seconds:.2f} s: {report.items_per_s:,.0f} items/s "
            f"(per worker {report.per_worker_min} to {report.per_worker_max} items)"
        )
    lines.append(
        f"  duplicates {report.duplicates}, lost {report.lost}, "
        f"locked errors {report.locked_errors}, fence rejections {report.fence_rejections}"
        + (
            f" (expected {report.expected_fence_rejections})"
            if report.expected_fence_rejections
            else ""
        )
        + f", ledger problems {report.ledger_problems}"
    )
    lines.extend(f"  {note}" for note in report.notes)
    if report.passed:
        lines.append("PASSED")
    else:
        lines.extend(f"FAILED: {failure}" for failure in report.failures)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m asyncplane.probe") -> int:
    """Run the probe from the command line; return the exit status (0 passed, 1 failed).

    Usage errors exit with status 2 through argparse's SystemExit, as any command does.
    """
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.items < 1 or args.concurrency < 1:
        parser.error("--workers, --items and --concurrency must be at least 1")
    if args.lease_seconds is None:
        args.lease_seconds = _default_lease(args.scenario)
    if not 0 < args.lease_seconds <= _validate.MAX_LEASE_SECONDS:
        parser.error("--lease-seconds must be positive, and at most 366 days")
    if args.role != "all" and args.scenario not in SPREADABLE:
        parser.error(f"--role {args.role} is for {' and '.join(SPREADABLE)} only")
    if args.role != "all" and not _engine.is_postgres_url(args.store):
        parser.error("--role is for a PostgreSQL store: an SQLite file lives on one host")
    _prepare_path(args, parser)
    warning = network_filesystem_warning(args.store, filesystem_of(args.store))
    if warning:
        print(warning, file=sys.stderr)
    report = asyncio.run(run_probe(args))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(_human(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
