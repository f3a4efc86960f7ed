"""The probe's worker processes (`asyncplane._probe_worker`), and the steps every
scenario shares: seeding, counting, checking."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from asyncplane import (
    _errors,
    _ledger,
    _probe_protocol,
    _store,
)
from asyncplane.probe._report import _PROJECT, ProbeReport

# --- worker processes ----------------------------------------------------------------------


class WorkerDied(_errors.AsyncplaneError):
    """A probe worker ended before it could take part (killed by the system, say, or
    crashed starting up): the run fails, saying which and how, with status 1."""


class _Worker:
    """One worker process and what it has said."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        #: When it was started (`time.monotonic`): its start-up runs from here.
        self.spawned_at = time.monotonic()
        self.ready = asyncio.Event()
        #: The event loop the worker said it runs on (`Ready.event_loop`); "" until ready.
        self.event_loop = ""
        self.claimed: _probe_protocol.Claimed | None = None
        self.claimed_event = asyncio.Event()
        self.report: _probe_protocol.Reported | None = None
        self.summary: _probe_protocol.Summary | None = None
        #: When the summary line was read (`time.monotonic`): the worker's drain is over.
        self.summary_at: float | None = None
        self.summarised = asyncio.Event()
        self.finished: list[tuple[int, int]] = []
        self.stderr = b""
        self.killed = False
        self._run = _RUNNING.get(None)  # a worker made outside a run is nobody's to stop
        if self._run is not None:
            self._run.add(self)
        self._readers = [
            asyncio.create_task(self._read_stdout(), name=f"probe-stdout[{name}]"),
            asyncio.create_task(self._read_stderr(), name=f"probe-stderr[{name}]"),
        ]

    async def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            message = _probe_protocol.decode(raw)  # None: a line cut short by a kill
            if isinstance(message, _probe_protocol.FinishedMany):
                self.finished.extend((item, fence) for item, fence in message.items)
            elif isinstance(message, _probe_protocol.Finished):
                self.finished.append((message.item, message.fence))
            elif isinstance(message, _probe_protocol.Summary):
                self.summary = message
                self.summary_at = time.monotonic()
                self.summarised.set()
            elif isinstance(message, _probe_protocol.Ready):
                self.event_loop = message.event_loop
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

    async def until_over(self) -> None:
        """Wait until it has said its summary, or exited without one."""
        await self._said_or_exited(self.summarised)

    def let_go(self) -> None:
        """End its stdin: a ``--report-at-end`` worker held after its summary exits. Say
        nothing to it after this (`say` would fail)."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):  # it has exited already (a broken pipe)
            self.process.stdin.close()

    def kill(self) -> None:
        """SIGKILL (TerminateProcess on Windows): no cleanup, as in a crash."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def wait(self) -> int:
        """Wait for the process and for everything it wrote."""
        code = await self.process.wait()
        await asyncio.gather(*self._readers)
        if self._run is not None:
            self._run.discard(self)
        return code

    async def until_ready(self) -> None:
        """Wait for its ready line (`until`)."""
        await self.until(self.ready, "was ready")

    async def until(self, said: asyncio.Event, what: str) -> None:
        """Wait for ``said`` (its ready line, its claim). One that exits first fails the
        run: `StorageError` if its store failed under it (`_raise_on_store_failure`),
        else `WorkerDied`."""
        if await self._said_or_exited(said):
            return
        code = await self.wait()
        _raise_on_store_failure([self])
        raise WorkerDied(f"worker {self.name} exited {code} before it {what}: {self.tail()}")

    async def _said_or_exited(self, said: asyncio.Event) -> bool:
        """Wait for ``said`` or the process's exit, whichever comes first: whether it was
        said."""
        heard = asyncio.create_task(said.wait(), name=f"probe-heard[{self.name}]")
        ended = asyncio.create_task(self.process.wait(), name=f"probe-exit[{self.name}]")
        try:
            await asyncio.wait({heard, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            heard.cancel()
            ended.cancel()
        return said.is_set()

    def tail(self) -> str:
        """The last line it wrote on stderr (complete once `wait` has returned)."""
        lines = self.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""

    def store_failed(self) -> bool:
        """Whether it ended because its store failed under it (`STORE_FAILED`)."""
        return not self.killed and self.process.returncode == _probe_protocol.STORE_FAILED


#: The workers a run (`run_probe`) started and has not waited for yet: `stop_all` stops
#: them. One set a run (a context variable): runs side by side in one process keep apart.
_RUNNING: contextvars.ContextVar[set[_Worker]] = contextvars.ContextVar("probe_workers")


def track_workers() -> contextvars.Token[set[_Worker]]:
    """Begin a run's set of workers (in the run's own context, before any is started)."""
    return _RUNNING.set(set())


async def stop_all(token: contextvars.Token[set[_Worker]]) -> None:
    """Kill every worker of the run that ``token`` began still running (one stopped by
    the stall scenario is let go on first, so that it dies at once): however a run ends,
    a cancellation, a signal, an error, none outlives it."""
    running = _RUNNING.get()
    _RUNNING.reset(token)
    for worker in list(running):
        if worker.process.returncode is None:
            if hasattr(signal, "SIGCONT"):
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGCONT)
            worker.kill()
        await worker.wait()


def _raise_on_store_failure(workers: Sequence[_Worker]) -> None:
    """`StorageError` if a worker's store failed under it (a full disk, a server gone):
    the probe then says the store failed (status 3); its unfinished items are not lost."""
    for worker in workers:
        if worker.store_failed():
            raise _errors.StorageError(f"worker {worker.name}: {worker.tail()}")


async def _spawn(
    args: argparse.Namespace, name: str, *extra: str, lease_seconds: float | None = None
) -> _Worker:
    command = [
        sys.executable, "-m", "asyncplane._probe_worker", "--name", name,
        "--concurrency", str(args.concurrency),
        "--lease-seconds", str(lease_seconds or args.lease_seconds),
        "--synchronous", args.synchronous,
        *extra,
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command,
        env={
            **os.environ,
            _probe_protocol.STORE_VARIABLE: str(args.store),
            _probe_protocol.PARENT_VARIABLE: str(os.getpid()),
        },
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    return _Worker(name, process)


# --- shared steps --------------------------------------------------------------------------


async def _seed(store: _store.ControlStore, items: int) -> list[int]:
    """Enqueue the probe's items into a project that opens only once all of them are in.

    Workers on other hosts start when the project opens; had they seen it while the
    enqueues were still committing, a worker that drains "until empty" could stop early.
    """
    await store.create_project(_PROJECT, "asyncplane probe", status="paused")
    ids: list[int] = []
    for start in range(0, items, 512):  # a transaction per 512 items, one statement each
        chunk = range(start, min(items, start + 512))
        ids.extend(await store.enqueue_many(_PROJECT, [{"n": n} for n in chunk]))
    await store.set_project_status(_PROJECT, "open")
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
    _tally_workers(report, workers)
    report.locked_errors += sum(w.stderr.count(b"database is locked") for w in workers)
    report.expect("duplicates", report.duplicates, 0)
    report.expect("lost", report.lost, 0)
    report.expect("locked_errors", report.locked_errors, 0)
    report.expect("ledger_problems", report.ledger_problems, 0)
    report.expect("worker_crashes", report.worker_crashes, 0)


async def _expect_named(
    report: ProbeReport, store: _store.ControlStore, ids: list[int], workers: Sequence[_Worker]
) -> None:
    """Where nothing kills a worker, every item done was finished by one of them, as it
    said: an item settled by no worker of the run (by something else that writes to the
    store, or the store itself) is work the fleet never did."""
    if report.worker_crashes:
        return  # a crashed worker never said what it finished: worker_crashes fails it
    named = {item_id for worker in workers for item_id, _ in worker.finished}
    backend = await _store.engine_of(store).ready()
    done = set(await backend.item_ids("done"))
    report.expect("done_by_no_worker", sum(1 for i in ids if i in done and i not in named), 0)


def _expect_heard(report: ProbeReport, workers: Sequence[_Worker]) -> None:
    """Every finish a worker counted reached the probe: a worker that ended on its own
    says in its summary how many items it finished, and its lines must name each one
    (concurrent-queue's workers say them all at the end, in lines of up to a thousand)."""
    unheard = sum(
        w.summary.finished - len(w.finished)
        for w in workers
        if w.summary is not None and not w.killed
    )
    report.expect("finishes_unheard", unheard, 0)


def _tally_workers(report: ProbeReport, workers: Sequence[_Worker]) -> None:
    """What the workers said of themselves: locked errors, fence refusals, their waits,
    CPU and claim latency, how evenly the work spread, which of them crashed (a killed
    one did not crash), and the event loops they ran on (a worker host's report has
    these too)."""
    report.event_loop = ",".join(sorted({w.event_loop for w in workers if w.event_loop}))
    summaries = [w.summary for w in workers if w.summary is not None]
    report.locked_errors = sum(s.locked for s in summaries)
    report.fence_rejections += sum(s.fence_rejected for s in summaries)
    report.max_lock_wait_s = max((s.max_lock_wait for s in summaries), default=0.0)
    report.worker_cpu_s = sum(s.cpu_s for s in summaries)
    report.claim_p99_s = max((s.claim_p99 for s in summaries), default=0.0)
    report.lock_held_s = sum(s.lock_held for s in summaries)
    report.summarised_items = sum(len(w.finished) for w in workers if w.summary is not None)
    counts = [len(w.finished) for w in workers if not w.killed]
    report.per_worker_min = min(counts, default=0)
    report.per_worker_max = max(counts, default=0)
    report.worker_crashes = sum(
        1 for w in workers if not w.killed and w.process.returncode not in (0, None)
    )
    for worker in workers:
        if not worker.killed and worker.process.returncode not in (0, None):
            report.notes.append(
                f"worker {worker.name} exited {worker.process.returncode}: {worker.tail()!r}"
            )


async def _go(workers: Sequence[_Worker], report: ProbeReport | None = None) -> float:
    """Wait until every worker is warm (its store open, its first thread hand-off made),
    then start them all at once; the wait is the run's start-up, outside its timing."""
    waiting = min((w.spawned_at for w in workers), default=time.monotonic())
    await asyncio.gather(*(w.until_ready() for w in workers))
    started = time.monotonic()
    if report is not None:
        report.startup_s += started - waiting
    await asyncio.gather(*(w.say("go") for w in workers))
    return started


async def _until_drained(workers: Sequence[_Worker], started: float, report: ProbeReport) -> None:
    """Wait for every worker (``--report-at-end``) to say its summary or exit, then let
    them all go (`_Worker.let_go`) and wait for their exits. The timed window
    (``report.seconds``) ends when the last one said its summary, right after its drain;
    the rest (closing its store, its interpreter's teardown) is the shut-down
    (``report.shutdown_s``), not timed, as the start-up is not. Held until the last
    summary, no worker's shut-down takes the CPU from one still draining. If any worker
    never said its summary (it died), the window runs to the last exit."""
    await asyncio.gather(*(w.until_over() for w in workers))
    for worker in workers:
        worker.let_go()
    await asyncio.gather(*(w.wait() for w in workers))
    _raise_on_store_failure(workers)
    exited = time.monotonic()
    said = [w.summary_at for w in workers]
    drained = exited if None in said else max(t for t in said if t is not None)
    report.seconds = drained - started
    report.shutdown_s = exited - drained


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
