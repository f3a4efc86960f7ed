"""Running a probe and reporting on it: `run_probe`, the command line, `main`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from typing import TextIO

from asyncplane import (
    _engine,
    _errors,
    _loops,
    _probe_protocol,
    _probe_support,
    _sqlite,
    _store,
    _validate,
)
from asyncplane.probe import _workers
from asyncplane.probe._filesystem import filesystem_of, network_filesystem_warning
from asyncplane.probe._report import _PROJECT, ROLES, SCENARIOS, SPREADABLE, ProbeReport
from asyncplane.probe._scenarios import _RUNNERS

_log = logging.getLogger("asyncplane.probe")

#: What the probe cannot run on as asked: a usage error (status 2), as the verbs say it.
_UNPROBEABLE = (
    _errors.InvalidInput,
    _errors.NotAnAsyncplaneDatabase,
    _errors.SchemaVersionError,
    _errors.MissingExtra,
)

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
        # One wait in all, for the store and then for the seeding to end (`_seeded_ids`).
        args.wait_deadline = time.monotonic() + args.wait_seconds
        await _wait_for_store(args.store, args.wait_seconds, args.wait_deadline)
    where = _engine.redact(args.store) if _engine.is_postgres_url(args.store) else args.store
    _log.info("probe %s starting on %s (%s)", args.scenario, where, report.filesystem)
    run = _workers.track_workers()
    try:
        async with _store.ControlStore(
            args.store, lease_seconds=args.lease_seconds, synchronous=args.synchronous
        ) as store:
            await _RUNNERS[args.scenario](args, store, report, progress)
    finally:
        await _workers.stop_all(run)  # however the run ends, none of its workers outlives it
    _log.info("probe %s finished: %s", args.scenario, "passed" if report.passed else "FAILED")
    return report


async def _wait_for_store(url: str, wait_seconds: float, deadline: float) -> None:
    """A worker host opens nothing before the coordinator has made the store and is
    seeding it (its opening would make the schema look used, and the coordinator insists
    on a fresh one); a store an earlier run left, drained, is not the coordinator's."""
    while not await _probe_support.probe_items_coming(url, _PROJECT):
        if time.monotonic() > deadline:
            raise _errors.InvalidInput(
                f"no probe items appeared within {wait_seconds:g} s: start the coordinator "
                "(--role coordinator) on the same store (or this run had drained already)"
            )
        await asyncio.sleep(0.2)


def _default_lease(scenario: str) -> float:
    # Long enough that no lease lapses in a clean drain; short where lapses are the point.
    return {"concurrent-queue": 900.0, "chaos": 1.0}.get(scenario, 1.0)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Qualify a disk for an asyncplane store: separate worker processes, "
        "exact counts. Exits 0 when every count is exactly right, 1 when one is not, 2 for "
        "a usage error, 3 when the store failed under it.",
    )
    parser.add_argument(
        "--store", default=os.environ.get(_probe_protocol.STORE_VARIABLE),
        help="the database file, or a postgresql:// URL (default: "
        f"${_probe_protocol.STORE_VARIABLE}, which keeps a URL's password off the process list)",
    )  # fmt: skip
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
        "--overwrite",
        action="store_true",
        help="delete an existing store at --store first (nothing that is not one)",
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
        _engine.checked_url(args.store)  # one whose password cannot be told apart: refused
        _engine.postgres_driver()  # whatever the role: MissingExtra names the extra
        if args.role != "worker":
            _loops.run(_prepare_schema(args, parser))
        return
    if not args.store.strip():
        parser.error("--store names no file")
    # Where a link leads, as the store itself opens it: the disk to qualify (--overwrite
    # deleted the link, and probed a new file in the link's directory instead).
    args.store = os.path.realpath(args.store)
    store = pathlib.Path(args.store)
    paths = [store, *(store.with_name(store.name + s) for s in ("-wal", "-shm"))]
    if store.is_dir():
        parser.error(f"{store} is a directory: name the store's file in it")
    if not store.parent.is_dir():
        parser.error(f"no directory {store.parent} to make the store in")
    if store.exists():
        if not args.overwrite:
            parser.error(f"{store} exists; the probe needs a fresh file (or --overwrite)")
        if not store.is_file():  # a FIFO would hold the probe in open() for ever
            parser.error(f"{store} is not a regular file: --overwrite deletes a store only")
        try:  # --overwrite deletes a store, never another file given by mistake
            _sqlite.vet_store_file(store)
        except (_errors.StorageError, OSError) as exc:
            parser.error(
                f"{store} is not an asyncplane store ({exc}): --overwrite deletes a store only"
            )
        for path in paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # a read-only disk, say: the disk failing the probe
                raise _errors.StorageError(f"cannot delete the old store: {exc}") from exc


async def _prepare_schema(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        fresh = await _probe_support.schema_is_empty(args.store)
        if not fresh:
            if not args.overwrite:
                parser.error(
                    "the schema is not empty; the probe needs a fresh one (another "
                    "search_path, or --overwrite to drop the asyncplane store there)"
                )
            await _probe_support.drop_store(args.store)
    except _UNPROBEABLE as exc:  # a server that fails is the store failing: main says so
        parser.error(str(exc))


def _human(report: ProbeReport) -> str:
    where = report.filesystem or "unknown filesystem"
    role = "" if report.role == "all" else f", {report.role}"
    lines = [
        f"asyncplane probe: {report.scenario} ({where}{role})",
        f"  {report.workers} worker processes x {report.concurrency} coroutines, "
        f"{report.items} items, lease {report.lease_seconds:g} s, "
        f"synchronous={report.synchronous}"
        + (f", on {report.event_loop}" if report.event_loop else ""),
    ]
    if report.scenario in ("concurrent-queue", "chaos") and report.role == "coordinator":
        # It starts no workers: their figures are the worker hosts' reports.
        lines.append(
            f"  drained in {report.seconds:.2f} s: {report.items_per_s:,.0f} items/s "
            "(by the worker hosts: their reports give their workers' figures)"
        )
    elif report.scenario in ("concurrent-queue", "chaos"):
        lines.append(
            f"  drained in {report.seconds:.2f} s: {report.items_per_s:,.0f} items/s "
            f"(per worker {report.per_worker_min} to {report.per_worker_max} items; "
            f"longest wait for the write lock {report.max_lock_wait_s * 1000:.0f} ms)"
            if report.filesystem != "postgresql"
            else f"  drained in {report.seconds:.2f} s: {report.items_per_s:,.0f} items/s "
            f"(per worker {report.per_worker_min} to {report.per_worker_max} items)"
        )
        lines.append(f"  start-up (every worker warm, not timed) {report.startup_s:.2f} s")
        if report.shutdown_s:
            lines.append(
                f"  shut-down (every worker's drain over to its exit, not timed) "
                f"{report.shutdown_s:.2f} s"
            )
        # Per the items of the workers that said what they spent: in chaos, not the
        # killed ones' (their CPU and lock time went unsaid), so no share of the drain.
        some = report.summarised_items
        whose = "" if report.kills == 0 else f", the {some:,} items of the workers not killed"
        if some:
            lines.append(
                f"  workers' CPU while draining {report.worker_cpu_s:.2f} s "
                f"({report.worker_cpu_s / some * 1000:.2f} s per 1,000 items{whose})"
            )
        if report.lock_held_s and report.seconds and some:
            held = (
                f"{report.lock_held_s / report.seconds:.0%} of the drain, "
                if report.kills == 0
                else ""
            )
            lines.append(
                f"  the write lock was held {held}"
                f"{report.lock_held_s / some * 1e6:.0f} us per item{whose}"
            )
    # A worker host counts only what its own workers said: the store's lost items and
    # its ledger are the coordinator's to check.
    here = report.role == "worker"
    lines.append(
        f"  duplicates {report.duplicates}, "
        + ("" if here else f"lost {report.lost}, ")
        + f"locked errors {report.locked_errors}, fence rejections {report.fence_rejections}"
        + (
            f" (expected {report.expected_fence_rejections})"
            if report.expected_fence_rejections
            else ""
        )
        + (
            " (lost items and the ledger: the coordinator checks them)"
            if here
            else f", ledger problems {report.ledger_problems}"
        )
    )
    lines.extend(f"  {note}" for note in report.notes)
    if report.passed:
        lines.append("PASSED")
    else:
        lines.extend(f"FAILED: {failure}" for failure in report.failures)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m asyncplane.probe") -> int:
    """Run the probe from the command line; return the exit status: 0 passed, 1 a count
    was wrong, 3 the store (the disk, the server) failed under it. Usage errors exit with
    status 2 through argparse's SystemExit, as any command does."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.store is None:
        parser.error(f"--store (or ${_probe_protocol.STORE_VARIABLE}) names the store to probe")
    if args.workers < 1 or args.items < 1 or args.concurrency < 1:
        parser.error("--workers, --items and --concurrency must be at least 1")
    if args.lease_seconds is None:
        args.lease_seconds = _default_lease(args.scenario)
    try:
        _loops.chosen()  # the probe's and its workers' event loop (ASYNCPLANE_LOOP)
    except _errors.AsyncplaneError as exc:
        parser.error(str(exc))
    if not 0 < args.lease_seconds <= _validate.MAX_LEASE_SECONDS:
        parser.error("--lease-seconds must be positive, and at most 366 days")
    if not 0 < args.wait_seconds <= _validate.MAX_DURATION_SECONDS:
        parser.error("--wait-seconds must be positive, and at most a century")
    if args.role != "all" and args.scenario not in SPREADABLE:
        parser.error(f"--role {args.role} is for {' and '.join(SPREADABLE)} only")
    if args.role != "all" and not _engine.is_postgres_url(args.store):
        parser.error("--role is for a PostgreSQL store: an SQLite file lives on one host")
    try:
        _prepare_path(args, parser)
        warning = network_filesystem_warning(args.store, filesystem_of(args.store))
        if warning:
            print(warning, file=sys.stderr)
        report = _loops.run(_until_signalled(run_probe(args)))
    except _UNPROBEABLE as exc:
        parser.error(str(exc))  # status 2: what was asked cannot be probed
    except _errors.StorageError as exc:  # the disk or the server failed under the probe
        print(f"{parser.prog}: the store failed: {exc}", file=sys.stderr)
        return 3
    except _workers.WorkerDied as exc:  # (killed by the system, a crash at start-up)
        print(f"{parser.prog}: FAILED: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"passed": False, "failures": [str(exc)]}))
        return 1
    if isinstance(report, int):
        print(f"{parser.prog}: stopped by a signal; its workers were stopped", file=sys.stderr)
        return report
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(_human(report))
    return 0 if report.passed else 1


async def _until_signalled(run: Awaitable[ProbeReport]) -> ProbeReport | int:
    """The run's report; or, when SIGTERM or SIGINT stops it (its workers are stopped as
    it unwinds, see `run_probe`), the exit status a signal gives: 128 and its number."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    heard: list[int] = []

    def stop(signum: int) -> None:
        heard.append(signum)
        task.cancel()

    stops = (signal.SIGTERM, signal.SIGINT)
    for signum in stops:
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await run
    except asyncio.CancelledError:
        if not heard:
            raise
        return 128 + heard[0]
    finally:
        for signum in stops:
            loop.remove_signal_handler(signum)
