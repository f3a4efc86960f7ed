"""``asyncplane worker``: run `work()` from a shell until a signal says stop.

    asyncplane worker DB|URL package.module:handle [--concurrency N] [--project P ...]
                      [--timeout S] [--grace S] [--owner NAME] [--exclusive]
                      [--log-level info] [--log-format text|json]

The handler is imported as ``module:attribute`` (the working directory is on the import
path, as for ``python -m``); it must be an ``async def`` taking one ClaimedItem. The
first SIGTERM, SIGINT or SIGHUP stops the worker gracefully (no more claims; running items get
``--grace`` seconds, then are given back unrun); a second one stops it at once, still
losing nothing (the claims are given back, or lapse). It logs, and on a terminal a
status line shows what it does beside the log: one INFO line at start and stop, the
handler's failures as WARNING with their traceback (``--log-format json`` writes one
JSON object a line, with the item's id, project, attempt and fence). It sets up the
root logger, so the handler's own logs come in the same form, with the item's fields.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable
from typing import Any

from asyncplane import _errors, _loops, _store, _validate, _work
from asyncplane._outcomes import DrainSummary

__all__ = ("add_arguments", "load_handler", "run")

_log = logging.getLogger("asyncplane.worker")

#: The fields a log record may carry beyond the standard ones (`_store.log_fields`, and
#: drain's batch of ``item_ids``).
_EXTRA_FIELDS = ("item_id", "project_id", "attempt", "fence", "owner", "item_ids")


class Usage(Exception):
    """Something the user has to fix: exit status 2."""


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The worker verb's own options (after the store, ``db``)."""
    sub.add_argument("handler", metavar="MODULE:HANDLER", help="e.g. myfleet.agents:handle")
    sub.add_argument(
        "--concurrency", type=int, default=16, help="items running at once (default 16)"
    )
    sub.add_argument(
        "--project", action="append", default=None, metavar="P",
        help="work only this project; repeatable (each gets an equal part of the slots)",
    )  # fmt: skip
    sub.add_argument(
        "--timeout", type=float, default=None, help="seconds an item may run (default: no limit)"
    )
    sub.add_argument(
        "--grace", type=float, default=30.0, help="seconds to finish at a stop (default 30)"
    )
    sub.add_argument("--owner", default=None, help="the name claims are made under")
    sub.add_argument("--exclusive", action="store_true", help="run alone (single-drainer)")
    sub.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sub.add_argument("--log-format", default="text", choices=("text", "json"))


def load_handler(spec: str) -> _work.Handler:
    """Import ``module:attribute`` and check it is a per-item coroutine function."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise Usage(f"the handler is MODULE:ATTRIBUTE, such as myfleet.agents:handle, not {spec!r}")
    if module_name.startswith("."):
        raise Usage(f"the handler's module is named whole, not relative: {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        # A module that fails as it is imported (a syntax error, a missing setting) is a
        # deployment to mend (2), not a stop (1): its traceback goes to the log, in the
        # chosen format, so the failing line is still shown.
        if not isinstance(exc, ImportError):
            _log.error("cannot import %r", module_name, exc_info=True)
        raise Usage(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise Usage(f"{module_name!r} has no {attribute!r}") from exc
        except Exception as exc:  # a module's __getattr__, a property, that fails: as above
            _log.error("cannot read %r of %r", attribute, module_name, exc_info=True)
            raise Usage(
                f"cannot read {attribute!r} of {module_name!r}: {type(exc).__name__}: {exc}"
            ) from exc
    problem = _validate.callable_problem(target, "the claim")
    if problem is not None:
        raise Usage(f"{spec} is not a handler (`async def handle(claim) -> Outcome`): {problem}")
    handler: _work.Handler = target
    return handler


def run(args: argparse.Namespace) -> int:
    """Run the verb; return its exit status."""
    # Logging first: a handler's module that sets logging up as it is imported (a
    # basicConfig, say) then finds it set, and does nothing twice.
    _configure_logging(args.log_level, args.log_format)
    # Heard from here on: a handler's module can take long to import (a model loaded, a
    # client made), and a signal then stops the command as before the store opens (it
    # gave a traceback, or killed the process outright).
    early = _EarlySignals()
    try:
        try:
            early.raising = True  # (inside the try: the raise is always caught here)
            handler = load_handler(args.handler)
        except (_StoppedEarly, KeyboardInterrupt):
            early.heard = True
        finally:
            early.raising = False  # from here on a signal is noted, and heard at the start
        if early.heard:  # (also when the module caught what the signal raised)
            return _stopped_before_start()
        return _run_with(args, handler, early)
    finally:
        early.restore()


def _run_with(args: argparse.Namespace, handler: _work.Handler, early: _EarlySignals) -> int:
    """`run`, once the handler is imported."""
    try:  # as work() would say, before the store is opened
        for project in args.project or [None]:
            _work.settings(args.owner, args.concurrency, args.timeout, project, args.grace)
    except (_errors.InvalidInput, _errors.InvalidType) as exc:
        raise Usage(str(exc)) from exc
    if args.exclusive and args.project and len(args.project) > 1:
        raise Usage("--exclusive runs one worker alone: give it one --project at most")
    if args.project and len(set(args.project)) < len(args.project):
        # Two runs of one project under one name: each would take the other's claims
        # for a lost claim's (work()'s give-back after CommitOutcomeUnknown).
        twice = next(p for p in args.project if args.project.count(p) > 1)
        raise Usage(f"--project {twice} is given more than once")
    try:
        return _loops.run(_main(args, handler, early))
    except (_errors.AsyncplaneError, OSError) as exc:
        if isinstance(
            exc,
            (_errors.NotAnAsyncplaneDatabase, _errors.SchemaVersionError, _errors.MissingExtra),
        ):
            raise Usage(str(exc)) from exc
        # In the log's own form (one JSON object a line with --log-format json); exit 3.
        _log.error("failed: %s", exc)
        return 3


async def _main(args: argparse.Namespace, handler: _work.Handler, early: _EarlySignals) -> int:
    store = _store.ControlStore(args.db)
    stop = asyncio.Event()
    # Heard from the start: a signal while the store opens (a server slow to answer)
    # stops the command cleanly, having claimed nothing; one heard before, as well.
    signals = _Signals(stop, [], early)
    if early.heard:
        signals.remove()
        return _stopped_before_start()
    opening = asyncio.create_task(store.open(), name="asyncplane-worker-open")
    signals.opening = opening
    try:
        await opening
    except BaseException as exc:
        # (The signals still heard while the opening winds up: a second one ends the
        # process at once, there being nothing to finish.)
        try:
            await store.close()
        finally:
            signals.remove()
        if isinstance(exc, asyncio.CancelledError) and signals.count and opening.cancelled():
            return _stopped_before_start()
        raise
    signals.opening = None
    projects = args.project or [None]
    shares = _shares(args.concurrency, len(projects))
    status = _Status(sum(shares)) if sys.stderr.isatty() else None
    workers = [
        asyncio.create_task(
            _exit_as_value(_work.work(
                store, handler, concurrency=share, timeout=args.timeout, project_id=project,
                owner=args.owner, exclusive=args.exclusive, stop=stop, grace=args.grace,
                progress=None if status is None else status.update,
            )),
            name=f"asyncplane-worker[{project or '*'}]",
        )
        for project, share in zip(projects, shares, strict=True)
    ]  # fmt: skip
    signals.workers = workers
    try:
        # One project's worker failing stops the others too (gracefully).
        _, pending = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            stop.set()
        results = await asyncio.gather(*workers, return_exceptions=True)
    finally:
        try:
            # Left early (cancelled: asyncio.run winding down after a SystemExit raised
            # in a task a handler started, say), the workers wind up before the store
            # closes (their writes refused: the store's writer is cancelled too, and the
            # items are left to their leases): closed first, their give-backs opened it
            # again, and its connection's thread kept the process alive for ever.
            for worker in workers:
                worker.cancel()  # (a worker that has ended: nothing)
            await asyncio.gather(*workers, return_exceptions=True)
            if status is not None:
                status.end()
            await store.close()
        finally:
            signals.remove()  # after the close: a second signal during it still counts
    for result in results:
        if isinstance(result, _Exit):  # a handler's sys.exit(): the command exits so
            _log.warning("stopped: a handler asked to exit (%r)", result.asked)
            return result.status()
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result
    if signals.count > 1:
        _log.warning("stopped at once; unfinished items were given back")
        return 1
    return 0


def _shares(concurrency: int, projects: int) -> list[int]:
    """Each project's worker's slots: ``concurrency`` shared out, the rest one more each
    to the first (5 over 2: 3 and 2), and at least one each."""
    share, rest = divmod(concurrency, projects)
    return [max(1, share + (index < rest)) for index in range(projects)]


@dataclasses.dataclass(frozen=True)
class _Exit:
    """A worker's end by a handler's SystemExit or KeyboardInterrupt (work() wound up
    first), carried as a value: raised out of a task, it would stop the event loop before
    the store is closed."""

    asked: SystemExit | KeyboardInterrupt

    def status(self) -> int:
        """The exit status it asks for (as Python gives it: 130 for an interrupt)."""
        if isinstance(self.asked, KeyboardInterrupt):
            return 130
        code = self.asked.code
        return code if isinstance(code, int) else (0 if code is None else 1)


async def _exit_as_value(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except (SystemExit, KeyboardInterrupt) as asked:
        return _Exit(asked)


#: Seconds the workers have to wind up after a second signal before the process exits.
HARD_STOP_SECONDS = 10.0
#: The signals that stop the command (SIGHUP: its terminal, or the ssh session it ran
#: in, closed).
_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)


class _StoppedEarly(BaseException):
    """A stopping signal heard while the handler's module was imported."""


def _ignored(sig: int) -> bool:
    """SIGHUP ignored when the command started (``nohup``): it stays so."""
    return sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) == signal.SIG_IGN


class _EarlySignals:
    """The stopping signals, heard before the event loop's own handlers are in: the
    first ends the handler's import (``raising``), and any is noted (``heard``) for the
    command to stop as soon as it looks. SIGHUP is left ignored under ``nohup``, and to a
    handler's module that takes it for itself (to reopen its logs, say)."""

    def __init__(self) -> None:
        self.heard = False
        self.raising = False
        self._late = "a second signal: nothing was claimed"  # why a late signal ends it
        self._handler = self._heard  # one bound method: compared at `restore`
        self._before = {
            sig: signal.signal(sig, self._handler) for sig in _SIGNALS if not _ignored(sig)
        }

    def _heard(self, signum: int, frame: object) -> None:
        if self.heard:  # a second signal (the module went on past the first): at once
            _log.error("stopped without winding up (%s)", self._late)
            logging.shutdown()
            os._exit(1)
        self.heard = True
        if self.raising:
            raise _StoppedEarly

    def take_back(self, taken: tuple[int, ...]) -> None:
        """The loop's handlers are gone: ``taken`` come here again, and any one of them
        ends the process at once (`restore` puts back what was there before)."""
        self.heard, self.raising = True, False
        self._late = "a signal as the command ended: nothing is held"
        for sig in taken:  # (each in `_before`: `taken` gives no other)
            with contextlib.suppress(ValueError, OSError):  # (not the main thread: a test's)
                signal.signal(sig, self._handler)

    def taken(self) -> tuple[int, ...]:
        """The signals the command's loop takes: each, unless a handler's module set
        one of its own for SIGHUP as it was imported."""
        hangup = getattr(signal, "SIGHUP", None)
        return tuple(
            sig for sig in _SIGNALS
            if sig != hangup or (sig in self._before and signal.getsignal(sig) is self._handler)
        )  # fmt: skip

    def restore(self) -> None:
        """Put back what was there before, where the handler is still this one's."""
        for sig, was in self._before.items():
            if signal.getsignal(sig) is self._handler:
                signal.signal(sig, was)


def _stopped_before_start() -> int:
    """Stopped by a signal before the store was open: nothing was claimed. A thread the
    handler's module started as it was imported would hold the interpreter's exit up
    (it joins every thread that is not a daemon): the process then ends at once."""
    _log.info("stopped before it started")
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):  # fmt: skip
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0


class _Signals:
    """The first SIGTERM, SIGINT or SIGHUP sets ``stop``; the second cancels the workers; a third,
    or `HARD_STOP_SECONDS` after the second without the workers done (a handler that
    ignores its cancellation, a store that does not answer), ends the process at once,
    leaving what it still holds to the leases, as a supervisor's SIGKILL would."""

    def __init__(
        self, stop: asyncio.Event, workers: list[asyncio.Task[Any]], early: _EarlySignals
    ) -> None:
        self.stop, self.workers, self.count, self.early = stop, workers, 0, early
        self.taken = early.taken()
        #: The store's opening, while it runs: a signal then cancels it (nothing to finish).
        self.opening: asyncio.Task[Any] | None = None
        self.loop = asyncio.get_running_loop()
        for sig in self.taken:
            self.loop.add_signal_handler(sig, self.heard)

    @property
    def before_start(self) -> bool:
        """The store is still opening, or its opening was cancelled and winds up: nothing
        was claimed. (An opening done but not yet heard of is not: its workers start, and
        see a stop at once.)"""
        opening = self.opening
        return opening is not None and (not opening.done() or opening.cancelled())

    def heard(self) -> None:
        self.count += 1
        if self.before_start:  # nothing to finish (once open, below)
            if self.count == 1:
                _log.info("stopping: the store was still opening")
                assert self.opening is not None
                self.opening.cancel()
            else:
                self.hard_stop()
            return
        if self.count == 1:
            _log.info("stopping: finishing running items")
            self.stop.set()
        elif self.count == 2:
            for worker in self.workers:
                worker.cancel()
            self.loop.call_later(HARD_STOP_SECONDS, self.hard_stop)
        else:
            self.hard_stop()

    def hard_stop(self) -> None:
        """End the process now: what is still held is left to its lease (taken over once
        it lapses, as after a crash); nothing committed is lost."""
        if self.before_start:
            why = "a second signal while the store was still opening: nothing was claimed"
        elif self.count > 2:
            why = "a third signal"
        else:
            why = (
                f"not wound up, the store closed included, {HARD_STOP_SECONDS:g} s after "
                "the second signal"
            )
        _log.error(
            "stopped without winding up (%s): items still held are left to their leases", why
        )
        logging.shutdown()  # the line above reaches its handler first
        os._exit(1)

    def remove(self) -> None:
        """Take the loop's handlers away (the store closed, or never opened): a signal from
        here to the process's end ends it at once, with 1, as a second one would have."""
        for sig in self.taken:
            with contextlib.suppress(Exception):
                self.loop.remove_signal_handler(sig)
        self.early.take_back(self.taken)


class _Status:
    """A status line on stderr: settled items and the rates since the start. A log
    record written meanwhile (`_StatusAware`) clears it first, and draws it again after:
    the record went on the status line's end."""

    #: The status line shown now, if any: the log handler's to clear and draw again.
    shown: _Status | None = None

    def __init__(self, slots: int) -> None:
        self.slots, self.started, self.last = slots, time.monotonic(), 0.0
        self.totals: dict[int, DrainSummary] = {}
        self.line = ""
        _Status.shown = self

    def update(self, summary: DrainSummary) -> None:
        self.totals[id(summary)] = summary
        now = time.monotonic()
        if now - self.last < 0.2:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        done = sum(s.done for s in self.totals.values())
        failed = sum(s.failed for s in self.totals.values())
        retried = sum(s.retried for s in self.totals.values())
        self.line = (
            f"{self.slots} slots: done {done:,} ({done / elapsed:,.1f}/s), failed "
            f"{failed:,}, retried {retried:,}"
        )
        self.draw()

    def draw(self) -> None:
        sys.stderr.write(f"\r{self.line}\033[K")
        sys.stderr.flush()

    def end(self) -> None:
        _Status.shown = None
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


class _StatusAware(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr's log handler: a record goes on a line of its own, under the status line."""

    def emit(self, record: logging.LogRecord) -> None:
        status = _Status.shown
        if status is None or not status.line:
            super().emit(record)
            return
        self.stream.write("\r\033[K")
        super().emit(record)
        status.draw()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "at": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in _EXTRA_FIELDS:
            if hasattr(record, field):
                data[field] = getattr(record, field)
        if record.exc_info:
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data)


class _ItemFields(logging.Filter):
    """Gives a record logged while a handler runs (by any logger: the handler's own, a
    library's) the fields of the item it handles, unless the record has them already."""

    def filter(self, record: logging.LogRecord) -> bool:
        claim = _work.handling()
        if claim is not None:
            for field, value in _store.log_fields(claim).items():
                if not hasattr(record, field):
                    setattr(record, field, value)
        return True


def _configure_logging(level: str, form: str) -> None:
    """The command owns its process, so it sets up the root logger: the handler's own
    loggers and its libraries' log in the same form, at the same level, as asyncplane's."""
    handler = _StatusAware(sys.stderr)
    if form == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ItemFields())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiosqlite says every call on its connections at DEBUG: dozens of lines a second
    # from an idle worker, which would drown the handler's own at --log-level debug.
    logging.getLogger("aiosqlite").setLevel(max(root.level, logging.INFO))
