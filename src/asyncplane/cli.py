"""The ``asyncplane`` command: look at, check and maintain a store without writing Python.

    asyncplane stats DB                       counts by state and project, ages, sizes
    asyncplane verify DB                      the ledger check; exit 1 if it finds problems
    asyncplane events DB ITEM                 one item's history
    asyncplane items DB [--project P] [--state S ...] [--error TEXT] ...   find items
    asyncplane cancel DB ID ... [--reason TEXT]     cancel items (running ones too)
    asyncplane cancel DB --project P --state ready [--reason TEXT] --yes
    asyncplane requeue DB ID ...                    failed or cancelled items back to ready
    asyncplane requeue DB --project P --state failed [--error TEXT] --yes
    asyncplane purge DB --retention 7d        archive, then delete, old settled items
    asyncplane import DB --from SRC --table T --column payload=data ...
    asyncplane copy SRC DST                   move a store to another (SQLite <-> PostgreSQL)
    asyncplane project DB PROJECT [--name N] [--status open|paused|closed]   make or set one
    asyncplane enqueue DB PROJECT --payload JSON [--priority N] [--after 5m] ...   queue one
    asyncplane schedules DB                   every schedule, its next and last tick
    asyncplane schedule DB NAME --project P --cron EXPR --payload JSON   add or change one
    asyncplane schedule DB NAME --pause | --resume | --delete
    asyncplane limits DB [PROJECT] [--max-running N] [--per-minute R] [--burst B]
    asyncplane worker DB module:handle [--concurrency N] ...   run work() until SIGTERM
    asyncplane dashboard DB [--host H] [--port N] [--allow-actions] [--actor ID] [--token T]
    asyncplane probe --store PATH --scenario ...   (see asyncplane.probe)

DB, SRC and DST are SQLite files or ``postgresql://`` URLs.

Every verb but worker and dashboard (which run until stopped) takes ``--json`` for one
JSON object on stdout. Long operations (purge, import,
copy) show their progress on stderr when it is a terminal. stats, verify, events and items
(and schedules, limits without a change, and dashboard without --allow-actions) open the
store read-only and write nothing; a filter-wide cancel or requeue without
``--yes`` only says how many items it would change. Exit status: 0 on success, 1 when
verify finds problems, 2 for a usage error, a missing file, a file that is not an
asyncplane store, a store of another schema version (the looking verbs need the current
one; the others migrate an older store), or an item id that is unknown or cannot be
requeued, 3 when the store or the disk fails under the command.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from asyncplane import (
    __version__,
    _connection,
    _copy,
    _engine,
    _errors,
    _import,
    _ledger,
    _loops,
    _rules,
    _sqlite,
    _store,
    _validate,
    _worker_command,
    probe,
)  # fmt: skip
from asyncplane._schedule import timetable as _timetable

__all__ = ("main", "parse_duration")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


def parse_duration(text: str) -> dt.timedelta:
    """'90s', '15m', '12h', '7d', '2w', compounds such as '1h30m', or plain seconds."""
    body = text.strip()
    if body.startswith("-"):
        raise argparse.ArgumentTypeError(f"a duration cannot be negative: {text!r}")
    parts = list(_PART.finditer(body))
    plain = len(parts) == 1 and not parts[0][2]
    if not body or "".join(p[0] for p in parts) != body or (len(parts) > 1 and not all(
        p[2] for p in parts
    )):  # fmt: skip
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use seconds, or numbers with s, m, h, d or w, "
            "such as 90s, 12h or 1h30m)"
        )
    seconds = float(parts[0][1]) if plain else sum(float(p[1]) * _UNITS[p[2]] for p in parts)
    try:
        return dt.timedelta(seconds=seconds)
    except OverflowError:  # past timedelta's own range (the store's checks come later)
        raise argparse.ArgumentTypeError(f"a duration too long: {text!r}") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = _validate.strict_json(_as_utf8(text))  # NaN, say: refused as any enqueue's
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a payload is a JSON object: {...}")
    return value


def _or_none(kind: type[int] | type[float]) -> Callable[[str], int | float | None]:
    def parse(text: str) -> int | float | None:
        if text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number, nor 'none': {text!r}") from None

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (which quote what was typed: a store's URL
    given in the wrong place, say) never show a password."""

    def error(self, message: str) -> NoReturn:
        super().error(_engine.redact_urls(message))


#: Every verb's first argument.
_DB_HELP = "the store: an SQLite file, or a postgresql:// URL"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="asyncplane", description="Look at, check and maintain asyncplane stores."
    )
    parser.add_argument("--version", action="version", version=f"asyncplane {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help_text: str, *, prints: bool = True) -> argparse.ArgumentParser:
        """A verb's parser; one that ``prints`` a result takes ``--json`` for it."""
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        if prints:
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        _VERB_PARSERS[name] = sub
        return sub

    def filters(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--project", help="one project")
        sub.add_argument(
            "--state", action="append", default=None, metavar="S",
            help="a state (ready, deferred, claimed, offloaded, done, failed, cancelled); "
            "repeatable",
        )  # fmt: skip
        sub.add_argument("--owner", help="the owner of the last claim")
        sub.add_argument("--error", help="a piece of the error text (ignoring case)")

    stats = verb("stats", "counts by state and project, oldest ready item, sizes")
    stats.add_argument("db", help=_DB_HELP)
    verify = verb("verify", "check every row against its history; exit 1 on problems")
    verify.add_argument("db", help=_DB_HELP)
    verify.add_argument("--limit", type=int, default=None, help="stop after this many")
    events = verb("events", "one item's history, oldest first")
    events.add_argument("db", help=_DB_HELP)
    events.add_argument("item", type=int)
    events.add_argument("--last", type=int, default=None, help="only the newest N events")
    purge = verb("purge", "archive, then delete, settled items older than the retention")
    purge.add_argument("db", help=_DB_HELP)
    purge.add_argument("--retention", type=parse_duration, required=True, help="e.g. 7d")
    purge.add_argument("--chunk", type=int, default=500, help="items per transaction")
    purge.add_argument("--archive", type=pathlib.Path, default=None, help="the JSONL archive")
    purge.add_argument(
        "--archive-max-mb", type=float, default=64.0, metavar="MB",
        help="the archive rotates to one older generation past this size (default 64)",
    )  # fmt: skip
    imported = verb("import", "copy another SQLite queue's pending rows in, once")
    imported.add_argument("db", help=_DB_HELP)
    imported.add_argument("--from", dest="source", type=pathlib.Path, required=True)
    imported.add_argument("--table", required=True)
    imported.add_argument(
        "--column", action="append", default=[], metavar="FIELD=COLUMN",
        help="map a store field to a source column (payload is required); repeatable",
    )  # fmt: skip
    imported.add_argument("--project", help="the project every row goes to")
    imported.add_argument(
        "--pending", action="append", default=None, metavar="VALUE",
        help="a value of the state column that means still to be done (as written; a "
        "column of numbers matches the number it reads as); repeatable",
    )  # fmt: skip
    imported.add_argument("--drop-source", action="store_true", help="drop the table after")
    imported.add_argument("--chunk", type=int, default=1000)
    items = verb("items", "find items: newest first, filtered, a page at a time")
    items.add_argument("db", help=_DB_HELP)
    filters(items)
    items.add_argument("--limit", type=int, default=50, help="rows (at most 10,000)")
    items.add_argument("--after", type=int, default=None, help="the last id of the page before")
    items.add_argument("--oldest", action="store_true", help="oldest first")
    for name, help_text, extra in (
        ("cancel", "cancel items by id, or every live item a filter takes", True),
        ("requeue", "put failed or cancelled items back in the queue, by id or by filter", False),
    ):
        sub = verb(name, help_text)
        sub.add_argument("db", help=_DB_HELP)
        sub.add_argument("ids", nargs="*", type=int, metavar="ID")
        filters(sub)
        if extra:
            sub.add_argument("--reason", help="why (kept with the item and in its event)")
        sub.add_argument(
            "--yes", action="store_true",
            help="with a filter: change the items (without it, only count them)",
        )  # fmt: skip
    copied = verb("copy", "copy a store, items and histories, into another; idempotent")
    copied.add_argument("db", metavar="SRC", help="the store to copy (only read)")
    copied.add_argument(
        "destination", metavar="DST", help="an empty store, a new file, or one copied into before"
    )
    copied.add_argument("--chunk", type=int, default=500, help="items per transaction")
    copied.add_argument(
        "--pending-only",
        action="store_true",
        help="leave settled (done, failed, cancelled) items behind",
    )
    verb("schedules", "every schedule: its timetable, next tick, last tick").add_argument(
        "db", help=_DB_HELP
    )
    verb(
        "init",
        "make the store if it is not there (an SQLite file, or its tables in a PostgreSQL "
        "schema that exists), or bring it to this release's schema",
    ).add_argument("db", help=_DB_HELP)
    project = verb("project", "make sure a project exists (made if not); or change its status")
    project.add_argument("db", help=_DB_HELP)
    project.add_argument("project_id", metavar="PROJECT")
    project.add_argument("--name", help="its display name, when it is made (default: its id)")
    project.add_argument("--status", choices=("open", "paused", "closed"), help="set it")
    queued = verb("enqueue", "add an item to a project's queue; print its id")
    queued.add_argument("db", help=_DB_HELP)
    queued.add_argument("project_id", metavar="PROJECT")
    queued.add_argument("--payload", type=_json_object, required=True, help="the item, as JSON")
    queued.add_argument("--priority", type=int, default=0, help="higher first (default 0)")
    queued.add_argument("--max-attempts", type=int, default=None, help="default: the store's")
    queued.add_argument("--after", type=parse_duration, default=None, help="not before, e.g. 5m")
    queued.add_argument("--fingerprint", default=None, help="its content identity (dedup)")
    queued.add_argument(
        "--no-dedup", dest="dedup", action="store_false", help="queue it even if a twin waits"
    )
    schedule = verb("schedule", "add or change a schedule; or pause, resume, delete one")
    schedule.add_argument("db", help=_DB_HELP)
    schedule.add_argument("name")
    schedule.add_argument("--project", help="the project its ticks enqueue in")
    timetable = schedule.add_mutually_exclusive_group()
    timetable.add_argument("--cron", help="a cron expression, e.g. '0 3 * * *' or @daily")
    timetable.add_argument("--every", type=parse_duration, help="a period, e.g. 5m")
    schedule.add_argument("--timezone", help="the cron's timezone (IANA; default UTC)")
    schedule.add_argument("--payload", type=_json_object, help="each tick's item, as JSON")
    schedule.add_argument("--catch-up", choices=("latest", "all", "none"), help="default latest")
    schedule.add_argument("--priority", type=int, help="default 0")
    schedule.add_argument("--max-attempts", type=int, default=None)
    change = schedule.add_mutually_exclusive_group()
    for flag in ("--pause", "--resume", "--delete"):
        change.add_argument(flag, action="store_true")
    limits = verb("limits", "a project's limits and what is in use; or change them")
    limits.add_argument("db", help=_DB_HELP)
    limits.add_argument("project", nargs="?", help="one project (without: every limited one)")
    for flag, kind in (("--max-running", int), ("--per-minute", float), ("--burst", int)):
        limits.add_argument(
            flag, type=_or_none(kind), default=..., metavar="N|none", help="none clears it"
        )
    worker = verb(
        "worker", "run a per-item handler over the store's work until SIGTERM", prints=False
    )
    worker.add_argument("db", help=_DB_HELP)
    _worker_command.add_arguments(worker)
    board = verb("dashboard", "serve the operator dashboard (the dashboard extra)", prints=False)
    board.add_argument("db", help=_DB_HELP)
    board.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    board.add_argument("--port", type=int, default=8080, help="0: a free port")
    board.add_argument("--allow-actions", action="store_true", help="requeue, cancel, pause")
    board.add_argument("--actor", default=None, help="show and act only as this actor")
    board.add_argument(
        "--token", default=None,
        help="required off loopback (else made); default: $ASYNCPLANE_DASHBOARD_TOKEN",
    )  # fmt: skip
    board.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    verbs.add_parser("probe", help="qualify a disk: separate processes, exact counts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncplane`` command; return its exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    _survive_the_locale()
    if args_list and args_list[0] == "probe":
        return probe.main(args_list[1:], prog="asyncplane probe")  # it owns its options
    parser = _parser()
    argv = _negative_durations(args_list)
    args, _ = parser.parse_known_args(argv)
    # The verb's own parser reads its arguments, options and ids in any order (a mistyped
    # flag prints that verb's usage, not the command's). Nothing may come before the verb:
    # an option there would be read by no one.
    at = argv.index(args.verb)
    if at:
        parser.error(f"options go after the verb: {args.verb} {' '.join(argv[:at])} ...")
    rest = argv[at + 1 :]
    args = _VERB_PARSERS[args.verb].parse_intermixed_args(rest, argparse.Namespace(verb=args.verb))
    _names_as_utf8(args)
    try:
        try:
            _loops.chosen()  # a wrong ASYNCPLANE_LOOP is the user's to fix, before anything
        except _errors.InvalidInput as exc:
            raise _Usage(str(exc)) from exc
        _check_args(args)  # what the arguments alone must satisfy: before anything opens
        if args.verb != "init" or _engine.is_postgres_url(args.db) or os.path.lexists(args.db):
            # (init makes a missing file; one that is there must be a store, or one whose
            # making was cut short, as a copy's destination)
            _check_is_a_store(args.db, unfinished=args.verb == "init")  # a quick file read
        elif not args.db or args.db == ":memory:" or args.db.endswith(("/", os.sep)):
            raise _Usage(f"init makes a store's file: name one, not {args.db!r}")
        elif not pathlib.Path(args.db).absolute().parent.is_dir():
            raise _Usage(f"no such directory for the store: {pathlib.Path(args.db).parent}")
        if args.verb == "worker":
            return _worker_command.run(args)
        if args.verb == "dashboard":
            from asyncplane.dashboard import _command  # the dashboard extra

            try:
                return _command.run(args)
            except (
                _errors.NotAnAsyncplaneDatabase,
                _errors.SchemaVersionError,
                _errors.InvalidInput,
            ) as exc:  # (InvalidInput: an address it cannot serve on)
                raise _Usage(_in_flags(str(exc))) from exc
        if args.verb == "copy" and (
            _engine.is_postgres_url(args.destination) or pathlib.Path(args.destination).exists()
        ):
            # An existing file must be a store too, or one a copy cut short began.
            _check_is_a_store(args.destination, unfinished=True)
        elif args.verb == "copy" and not pathlib.Path(args.destination).absolute().parent.is_dir():
            # (as init says it: a mistake to mend, not a store that failed)
            raise _Usage(
                f"no such directory for the destination: {pathlib.Path(args.destination).parent}"
            )
        return _loops.run(_run(args))
    except (_Usage, _worker_command.Usage, _errors.MissingExtra) as problem:
        _say(f"asyncplane {args.verb}: {problem}")
        return 2
    except BrokenPipeError:  # output piped into `head`, say, and cut short: not a failure
        _quiet_stdout()
        return 0
    except (_errors.AsyncplaneError, OSError) as problem:
        # The store or the file system failed under the command (a lock held too long, a
        # read-only disk): say so plainly; 1 is verify's "problems found", so use 3.
        _say(f"asyncplane {args.verb}: failed: {problem}")
        return 3


def _say(message: str) -> None:
    """A line on stderr, passwords redacted; a stderr that is gone (a closed pipe) is
    let be: the exit status still says it."""
    with contextlib.suppress(BrokenPipeError):
        print(_engine.redact_urls(message), file=sys.stderr, flush=True)


#: The arguments that name files (or a URL): kept as the system gave them, since a name
#: re-read as UTF-8 may no longer be the file's under an ASCII file system encoding.
_PATHS = ("db", "destination", "handler")


def _names_as_utf8(args: argparse.Namespace) -> None:
    """The text arguments (ids, names, payloads) as UTF-8: under a locale of another
    encoding (``C`` with Python's UTF-8 mode off, say) Python gives the bytes of ``café``
    as escapes, which the store would refuse; a store's names are UTF-8, so bytes that
    read as UTF-8 are taken as such. Paths are left as they came (`_PATHS`, and those
    parsed to `pathlib.Path`)."""
    for key, value in vars(args).items():
        if key in _PATHS:
            continue
        if isinstance(value, str):
            setattr(args, key, _as_utf8(value))
        elif isinstance(value, list) and all(isinstance(each, str) for each in value):
            setattr(args, key, [_as_utf8(each) for each in value])


def _as_utf8(arg: str) -> str:
    """``arg`` as UTF-8 text, if its escaped bytes read as UTF-8 (`_names_as_utf8`)."""
    if not any("\udc80" <= char <= "\udcff" for char in arg):
        return arg
    try:
        return os.fsencode(arg).decode("utf-8")
    except UnicodeDecodeError:
        return arg  # not UTF-8 either: the store says what it refuses


def _survive_the_locale() -> None:
    """Under a locale whose encoding cannot say every character (ASCII, under ``C``), a
    name or an error is printed with escapes rather than failing the command."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        if encoding != "utf8" and isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what the closed
    pipe did not take cannot fail once more on the way out."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _negative_durations(argv: list[str]) -> list[str]:
    """``--retention -1d`` as ``--retention=-1d`` (and ``--every``): argparse would take
    ``-1d`` for a flag and say only that a value is missing; this way the duration says
    what is wrong."""
    merged: list[str] = []
    for arg in argv:
        if merged and merged[-1] in _DURATION_FLAGS and re.match(r"-\d", arg):
            merged[-1] = f"{merged[-1]}={arg}"
        else:
            merged.append(arg)
    return merged


#: The options that take a duration (a negative one is read as a value, not a flag).
_DURATION_FLAGS = ("--retention", "--every", "--after")


class _Usage(Exception):
    """Something the user has to fix: exit status 2."""


def _check_values(args: argparse.Namespace) -> None:
    """The values of a cancel's, a requeue's or a schedule's flags, checked as the store
    will check them, before it is opened (InvalidInput, InvalidType, MissingExtra)."""
    if args.verb == "schedule":
        _validate.text_id(args.name, "name")
        _validate.text_id(args.project, "project_id")
        timezone = "UTC" if args.timezone is None else args.timezone
        _timetable(args.cron, args.every, timezone, 0.0)
        if args.catch_up is not None:
            _validate.catch_up(args.catch_up)
        if args.priority is not None:
            _validate.priority(args.priority)
        _validate.optional_positive_int(args.max_attempts, "max_attempts")
        return
    if args.state is not None:
        _validate.states(args.state)
    if args.owner is not None:
        _validate.text_id(args.owner, "owner")
    if args.project is not None:
        _validate.text_id(args.project, "project_id")
    _validate.search_text(args.error, "error_contains")
    if args.verb == "cancel":
        _validate.error_text(args.reason, "reason")


def _check_args(args: argparse.Namespace) -> None:
    """The rules a verb's arguments must keep among themselves, checked before the store
    is opened: a usage error writes nothing (not even the migration a writing verb's
    opening makes)."""
    if args.verb in ("cancel", "requeue"):
        if args.ids and _where(args):
            raise _Usage("name items by id or by filter, not both")
        if not args.ids and not _where(args):
            raise _Usage(
                "name items by id, or say which with --project, --state, --owner or --error"
            )
        try:  # an id no item could have (0, past the id range): before any is touched
            for item_id in args.ids:
                _validate.item_id(item_id)
            _check_values(args)
        except (_errors.InvalidInput, _errors.InvalidType) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
    elif args.verb == "schedule":
        act = next(
            (f"--{flag}" for flag in ("pause", "resume", "delete") if getattr(args, flag)), None
        )
        given = [
            flag for flag, value in (
                ("--project", args.project), ("--payload", args.payload), ("--cron", args.cron),
                ("--every", args.every), ("--timezone", args.timezone),
                ("--catch-up", args.catch_up), ("--priority", args.priority),
                ("--max-attempts", args.max_attempts),
            ) if value is not None
        ]  # fmt: skip
        if act is not None and given:
            raise _Usage(f"{act} changes nothing else: give {', '.join(given)} without it")
        if act is None and (
            args.project is None
            or args.payload is None
            or (args.cron is None) == (args.every is None)
        ):
            raise _Usage("a schedule needs --project, --payload, and --cron or --every")
        try:
            if act is None:
                _check_values(args)
            else:  # the name alone: it was refused only once the store was open (migrated)
                _validate.text_id(args.name, "name")
        except (_errors.InvalidInput, _errors.InvalidType, _errors.MissingExtra) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
    elif args.verb == "limits" and _limit_changes(args) and args.project is None:
        raise _Usage("name the project whose limits change")
    elif args.verb == "limits" and _limit_changes(args):
        try:
            _validate.text_id(args.project, "project_id")
            changes = _limit_changes(args)
            _validate.limit_changes(
                changes.get("max_running", ...),
                changes.get("per_minute", ...),
                changes.get("burst", ...),
            )
        except (_errors.InvalidInput, _errors.InvalidType) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
    elif args.verb == "purge":
        try:
            _validate.megabytes(args.archive_max_mb, "archive_max_mb")
        except _errors.InvalidInput as exc:
            raise _Usage(_in_flags(str(exc))) from exc
        if args.archive is not None and args.archive.is_dir():
            raise _Usage(f"--archive {args.archive} is a directory: name a file in it")
        if args.archive is not None and args.archive.exists() and not args.archive.is_file():
            raise _Usage(f"--archive {args.archive} is not a regular file: name a file")
        if args.archive is not None and not args.archive.absolute().parent.is_dir():
            raise _Usage(f"--archive: no directory {args.archive.absolute().parent}")
    elif args.verb == "dashboard":
        from asyncplane.dashboard import _command  # the dashboard extra

        try:
            _command.check(args)
        except (_errors.InvalidInput, _errors.InvalidType) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
    if args.verb in ("purge", "import", "copy"):
        try:
            _validate.positive_int(args.chunk, "chunk")
        except (_errors.InvalidInput, _errors.InvalidType) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
    if args.verb == "import":
        try:
            if args.source.is_dir():
                raise _Usage(f"--from {args.source} is a directory: name the source's file")
            if not args.source.is_file():
                raise _Usage(f"no such file: {args.source}")
        except OSError as exc:  # a name too long, say
            raise _Usage(f"--from {args.source}: {exc.strerror or exc}") from exc
        try:  # the mapping, the table and its columns: read-only, the store not opened
            _import.check_request(
                args.source.absolute(), args.table, _columns(args), args.project, args.pending
            )
        except _errors.NotAnAsyncplaneDatabase as exc:  # the source's, not the store's
            raise _Usage(f"--from {args.source}: {exc}") from exc
        except (_errors.InvalidInput, _errors.InvalidType) as exc:
            raise _Usage(_in_flags(str(exc))) from exc


def _check_is_a_store(location: str, *, unfinished: bool = False) -> None:
    """Refuse, before opening anything, a file that is not an asyncplane store (an empty
    file included: the store would create its schema in it; with ``unfinished``, a store
    whose making was cut short passes, see `vet_store_file`). A PostgreSQL schema is
    checked by the store itself, when it opens it read-only."""
    if _engine.is_postgres_url(location):
        try:
            _engine.checked_url(location)
        except _errors.InvalidInput as exc:
            raise _Usage(str(exc)) from exc
        return
    path = pathlib.Path(location)
    if path.is_dir():
        raise _Usage(f"{path} is a directory: name the store's file in it")
    if not path.exists():
        raise _Usage(f"no such file: {path}")
    if not path.is_file():  # a FIFO, a device, a socket: never a store
        raise _Usage(f"{path} is not a regular file, not an asyncplane store")
    problem = _connection.refusal(path)  # a second hard link, say
    if problem is not None:
        raise _Usage(str(problem))
    try:
        _sqlite.vet_store_file(path, unfinished=unfinished)
    except _errors.StorageError as exc:
        raise _Usage(f"{path} is not an asyncplane store ({exc})") from exc


async def _run(args: argparse.Namespace) -> int:
    # Looking (`_LOOKING`, and limits without a change) opens the file read-only: no
    # migration, no write lock, nothing written. The other verbs write.
    if args.verb == "copy":
        return await _copy_verb(args)
    looking = args.verb in _LOOKING or (args.verb == "limits" and not _limit_changes(args))
    sized = {"archive_max_mb": args.archive_max_mb} if args.verb == "purge" else {}
    store = _store.ControlStore(args.db, read_only=looking, **sized)
    try:
        try:
            await store.open()
        except (_errors.NotAnAsyncplaneDatabase, _errors.SchemaVersionError) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
        return int(await _VERBS[args.verb](store, args))
    except (_errors.InvalidInput, _errors.InvalidType) as exc:
        raise _Usage(_in_flags(str(exc))) from exc
    finally:
        await store.close()


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print a verb's output. A reader that has gone (``| head``) takes no more of it,
    and the verb goes on to its own exit status: verify's problems are still 1."""
    try:
        print(json.dumps(data, default=_jsonable) if args.json else text)
    except BrokenPipeError:
        _quiet_stdout()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return _when(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)


def _progress(label: str) -> Callable[[int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(count: int) -> None:
        sys.stderr.write(f"\r{label}: {count:,}")
        sys.stderr.flush()

    return show


def _end_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


async def _stats(store: _store.ControlStore, args: argparse.Namespace) -> int:
    stats = await store.stats()
    lines = [
        f"{stats['path']} (schema {stats['schema_version']}): {stats['items']:,} items",
        "  " + ", ".join(f"{state} {count:,}" for state, count in stats["states"].items()),
    ]
    for project, states in stats["projects"].items():
        busy = ", ".join(f"{s} {n:,}" for s, n in states.items() if n)
        lines.append(f"  project {project}: {busy}")
    age = stats["oldest_ready_age_s"]
    lines.append(
        f"  oldest ready item waiting {'-' if age is None else f'{age:,.0f} s'}; "
        f"expired leases waiting to be taken over {stats['expired_leases']:,}; "
        f"offloaded {stats['offloaded']:,}"
    )
    lines.append(f"  database {stats['database_bytes']:,} bytes, WAL {stats['wal_bytes']:,} bytes")
    _out(args, stats, "\n".join(lines))
    return 0


async def _verify(store: _store.ControlStore, args: argparse.Namespace) -> int:
    problems = await _ledger.verify_ledger(store, limit=args.limit)
    data = {
        "problems": [{"kind": p.kind, "item_id": p.item_id, "detail": p.detail} for p in problems],
        "clean": not problems,
    }
    text = "\n".join(f"{p.kind}: item {p.item_id}: {p.detail}" for p in problems)
    _out(args, data, text or "clean: every row agrees with its history")
    return 1 if problems else 0


async def _events(store: _store.ControlStore, args: argparse.Namespace) -> int:
    try:
        events = await store.events(args.item, last=args.last)
    except (_errors.UnknownItem, _errors.InvalidInput) as exc:
        raise _Usage(_in_flags(str(exc))) from exc
    text = "\n".join(
        f"{_when(e['at'])}  {e['event_type']:<13} fence {e['fence']:<3} "
        f"owner {e['owner'] or '-'}  {json.dumps(e['detail']) if e['detail'] else ''}".rstrip()
        for e in events
    )
    _out(args, {"item_id": args.item, "events": events}, text)
    return 0


async def _purge(store: _store.ControlStore, args: argparse.Namespace) -> int:
    try:
        done = await store.purge(
            args.retention, chunk=args.chunk, archive_path=args.archive,
            progress=_progress("purged"),
        )  # fmt: skip
    finally:
        _end_progress()
    data = {
        "purged": done.purged, "chunks": done.chunks, "archive": str(done.archive_path),
        "archive_full": done.archive_full,
    }  # fmt: skip
    chunks = f"{done.chunks} chunk{'' if done.chunks == 1 else 's'}"
    _out(args, data, f"purged {done.purged:,} items in {chunks} into {done.archive_path}")
    if done.archive_full:
        _say(
            f"asyncplane purge: stopped: the archive is due to rotate again, over a "
            f"{done.archive_path.name}.1 made during this run; move {done.archive_path}.1 "
            "aside (or give --archive-max-mb more) and run it again for the rest"
        )
    return 0


def _columns(args: argparse.Namespace) -> dict[str, str]:
    """The import's ``--column FIELD=COLUMN`` pairs, as `import_pending` takes them."""
    columns = {}
    for pair in args.column:
        field, sep, column = pair.partition("=")
        if not sep:
            raise _Usage(f"--column takes FIELD=COLUMN, not {pair!r}")
        columns[field] = column
    return columns


async def _import_pending(store: _store.ControlStore, args: argparse.Namespace) -> int:
    try:
        done = await store.import_pending(
            args.source, table=args.table, columns=_columns(args), project_id=args.project,
            pending=args.pending, drop_source=args.drop_source,
            chunk=args.chunk,
            progress=_progress("source rows seen"),
        )  # fmt: skip
    except _errors.UnknownProject as exc:
        raise _Usage(str(exc)) from exc
    except _errors.NotAnAsyncplaneDatabase as exc:  # the source's, not the store's
        raise _Usage(f"--from {args.source}: {exc}") from exc
    except (_errors.InvalidInput, _errors.InvalidType) as exc:  # a source row it refuses
        raise _Usage(_in_flags(str(exc))) from exc
    finally:
        _end_progress()
    data = {
        "source": done.source, "imported": done.imported,
        "already_imported": done.already_imported, "not_pending": done.not_pending,
        "dropped": done.dropped, "changed": done.changed,
    }  # fmt: skip
    changed = f", {done.changed:,} of them changed since an earlier run" if done.changed else ""
    _out(
        args, data,
        f"imported {done.imported:,} pending rows from {done.source}{changed} "
        f"({done.already_imported:,} imported before, {done.not_pending:,} not pending"
        f"{'; source table dropped' if done.dropped else ''})",
    )  # fmt: skip
    return 0


async def _copy_verb(args: argparse.Namespace) -> int:
    source = _store.ControlStore(args.db, read_only=True)
    destination = _store.ControlStore(args.destination)
    try:
        try:
            await source.open()
            await destination.open()
        except (_errors.NotAnAsyncplaneDatabase, _errors.SchemaVersionError) as exc:
            raise _Usage(_in_flags(str(exc))) from exc
        try:
            done = await _copy.copy_store(
                source, destination, chunk=args.chunk, pending_only=args.pending_only,
                progress=_progress("items"),
            )  # fmt: skip
        except _errors.InvalidInput as exc:
            raise _Usage(_in_flags(str(exc))) from exc
        finally:
            _end_progress()
        problems = await _ledger.verify_ledger(destination, limit=10)
    finally:
        await source.close()
        await destination.close()
    data = {
        "source": source.location, "destination": destination.location,
        "projects": done.projects, "copied": done.copied, "copied_before": done.skipped,
        "chunks": done.chunks, "ledger_problems": len(problems),
    }  # fmt: skip
    _out(
        args, data,
        f"copied {_counted(done.copied)} ({done.skipped:,} copied before) and "
        f"{done.projects} new project{'' if done.projects == 1 else 's'} from "
        f"{source.location} to {destination.location}; "
        + ("the destination's ledger verifies clean" if not problems
           else f"the destination's ledger has problems: {problems[0]}"),
    )  # fmt: skip
    return 1 if problems else 0


def _counted(count: int) -> str:
    return f"{count:,} item{'' if count == 1 else 's'}"


def _when(at: dt.datetime) -> str:
    """A time as every table here prints it: UTC, to the millisecond."""
    return at.isoformat(timespec="milliseconds")


#: The keywords of the library's messages, as this command's flags.
_FLAG_WORDS = (
    ("give project_id=, or map a project_id column", "give --project, or map a project "
     "column with --column project_id=COLUMN"),
    ("project_id=", "--project"),
    ("drop_source", "--drop-source"),
    ("error_contains", "--error"),
    ("limit is", "--limit is"),
    ("limit must", "--limit must"),
    ("item_id must", "an item id must"),
    ("after must", "--after must"),
    ("last must", "--last must"),
    ("reason is", "--reason is"),
    ("reason must", "--reason must"),
    ("owner must", "--owner must"),
    ("priority must", "--priority must"),
    ("chunk must", "--chunk must"),
    ("pass archive_path", "give --archive"),
    ("archive_max_mb", "--archive-max-mb"),
    ("the per_minute bucket: give per_minute", "the --per-minute bucket: give --per-minute"),
    ("project_id must", "a project id must"),
    ("max_running must", "--max-running must"),
    ("per_minute must", "--per-minute must"),
    ("burst must", "--burst must"),
    ("token must be a str of at least", "--token must be at least"),
    ("actor_id must", "--actor must"),
    ("actor_id is", "--actor is"),
    ("max_attempts must", "--max-attempts must"),
    ("not_before is not a representable time", "--after reaches past the year 9999"),
    ("host must be a non-empty str", "--host must not be empty"),
    ("port must be an int from 0 to 65535", "--port must be 0 to 65535"),
    ("open it once without read_only", "run a verb that writes (cancel, purge, limits with a "
     "change, ...) on it once"),
)  # fmt: skip


def _in_flags(message: str) -> str:
    """A library message in this command's words, each word replaced once, in one pass
    (a flag put in is never rewritten again), the longest first where two start alike."""
    flags = dict(_FLAG_WORDS)
    words = sorted(flags, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, words)))
    return pattern.sub(lambda found: flags[found.group(0)], message)


async def _known_project(store: _store.ControlStore, args: argparse.Namespace) -> None:
    """A filter naming a project that does not exist is a usage error, as elsewhere."""
    if args.project is not None:
        try:
            await store.project(args.project)
        except _errors.UnknownProject as exc:
            raise _Usage(str(exc)) from exc


def _where(args: argparse.Namespace) -> dict[str, Any]:
    """The filter flags, as `ControlStore.items` keywords (only those given)."""
    given = {
        "project_id": args.project, "state": args.state, "owner": args.owner,
        "error_contains": args.error,
    }  # fmt: skip
    return {key: value for key, value in given.items() if value is not None}


async def _items(store: _store.ControlStore, args: argparse.Namespace) -> int:
    await _known_project(store, args)
    rows = await store.items(
        **_where(args), order="oldest" if args.oldest else "newest", after=args.after,
        limit=args.limit, include_payload=args.json,
    )  # fmt: skip
    lines = [f"{'ID':>8}  {'PROJECT':<12} {'STATE':<10} {'ATT':>3}  {'UPDATED':<29} ERROR"]
    for row in rows:
        error = _printable(row["error"] or "")
        lines.append(
            f"{row['item_id']:>8}  {row['project_id']:<12} {row['state']:<10} "
            f"{row['attempts']:>3}  {_when(row['updated_at']):<29} "
            f"{error[:60] + ('...' if len(error) > 60 else '')}".rstrip()
        )
    more = rows[-1]["item_id"] if len(rows) == args.limit else None  # a full page: maybe
    if more is not None:
        lines.append(f"(more: --after {more})")
    _out(args, {"items": rows, "next_after": more},
         "\n".join(lines) if rows else "no items")  # fmt: skip
    return 0


def _printable(text: str) -> str:
    """Stored text as one line a terminal shows as it is: a newline as a space, any other
    character that is not printable escaped (a worker's error may hold a carriage return
    that overwrites the line, or an escape sequence that clears the screen)."""
    return "".join(
        char if char.isprintable() else " " if char == "\n" else repr(char)[1:-1] for char in text
    )


async def _by_id(args: argparse.Namespace, act: Callable[[int], Any], done: str) -> int:
    """Apply ``act`` to each id (checked by `_check_args`); report each; exit 2 if any
    could not be acted on."""
    ids = [_validate.item_id(item_id) for item_id in args.ids]
    results: list[dict[str, Any]] = []
    refused = 0
    for item_id in ids:
        try:
            state = await act(item_id)
        except (_errors.UnknownItem, _errors.NotRequeueable) as exc:
            refused += 1
            results.append({"item_id": item_id, "error": str(exc)})
            continue
        results.append({"item_id": item_id, "state": state or done})
    text = "\n".join(
        f"item {r['item_id']}: {r.get('state') or 'refused: ' + r['error']}" for r in results
    )
    _out(args, {"items": results}, text)
    return 2 if refused else 0


async def _matching(store: _store.ControlStore, args: argparse.Namespace, states: Any) -> int:
    """How many items a filter-wide cancel or requeue would change now."""
    if not states:
        return 0
    where, count, after = {**_where(args), "state": states}, 0, None
    while page := await store.items(
        **where, order="oldest", after=after, limit=10_000, include_payload=False
    ):
        count += len(page)
        after = page[-1]["item_id"]
    return count


async def _where_verb(
    store: _store.ControlStore, args: argparse.Namespace, states: tuple[str, ...],
    change: Callable[..., Any], verb: str,
) -> int:  # fmt: skip
    await _known_project(store, args)
    if not args.yes:
        count = await _matching(store, args, states)
        text = f"{_counted(count)} would be {verb}; add --yes to do it"
        _out(args, {"would_change": count, "changed": 0}, text)
        return 0
    changed = await change(**_where(args))
    _out(args, {"changed": changed}, f"{verb} {_counted(changed)}")
    return 0


async def _cancel(store: _store.ControlStore, args: argparse.Namespace) -> int:
    if args.ids:
        return await _by_id(args, lambda i: store.cancel(i, reason=args.reason), "cancelled")
    states = _rules.cancel_states(_validate.states(args.state))

    async def change(**where: Any) -> int:
        return await store.cancel_where(**where, reason=args.reason)

    return await _where_verb(store, args, states, change, "cancelled")


async def _requeue(store: _store.ControlStore, args: argparse.Namespace) -> int:
    if args.ids:
        return await _by_id(args, store.requeue, "ready")
    states = _rules.requeue_states(_validate.states(args.state))
    return await _where_verb(store, args, states, store.requeue_where, "requeued")


def _show_schedule(row: dict[str, Any]) -> str:
    when = row["cron"] if row["cron"] is not None else f"every {row['every']}"
    last = "never" if row["last_at"] is None else _when(row["last_at"])
    paused = "  (paused)" if row["paused"] else ""
    return (
        f"{row['name']}: {when} ({row['timezone']}) into {row['project_id']}: next "
        f"{_when(row['next_at'])}, last {last}{paused}"
    )


async def _schedules(store: _store.ControlStore, args: argparse.Namespace) -> int:
    rows = await store.schedules()
    text = "\n".join(_show_schedule(row) for row in rows) or "no schedules"
    _out(args, {"schedules": rows}, text)
    return 0


async def _init(store: _store.ControlStore, args: argparse.Namespace) -> int:
    """Opening the store for writing made it, or migrated it: nothing more to do."""
    location = _engine.redact(str(args.db))
    _out(args, {"location": location}, f"store ready: {location}")
    return 0


async def _project(store: _store.ControlStore, args: argparse.Namespace) -> int:
    """Make the project if it does not exist (idempotent: a deployment's script may run it
    each time), then give it the status asked for."""
    created = False
    try:
        row = await store.project(args.project_id)
    except _errors.UnknownProject:
        try:
            await store.create_project(
                args.project_id, args.project_id if args.name is None else args.name,
                status="open" if args.status is None else args.status,
            )  # fmt: skip
            created = True
        except _errors.ProjectExists:
            pass  # another made it meanwhile: as if it had been there
        row = await store.project(args.project_id)
    if not created and args.name is not None and args.name != row["name"]:
        raise _Usage(f"project {args.project_id!r} exists, named {row['name']!r}: a name stays")
    was = row["status"]
    if args.status is not None and args.status != was:
        await store.set_project_status(args.project_id, args.status)
        row = await store.project(args.project_id)
    said = "made" if created else ("was " + was if row["status"] != was else "unchanged")
    _out(args, {**row, "created": created}, f"{args.project_id}: {row['status']} ({said})")
    return 0


async def _enqueue(store: _store.ControlStore, args: argparse.Namespace) -> int:
    after = None if args.after is None else store.clock.now() + args.after.total_seconds()
    try:
        item_id = await store.enqueue(
            args.project_id, args.payload, priority=args.priority, fingerprint=args.fingerprint,
            dedup=args.dedup, max_attempts=args.max_attempts, not_before=after,
        )  # fmt: skip
    except _errors.UnknownProject as exc:
        raise _Usage(str(exc)) from exc
    _out(args, {"item_id": item_id, "project_id": args.project_id}, str(item_id))
    return 0


async def _schedule(store: _store.ControlStore, args: argparse.Namespace) -> int:
    for flag, act, done in (("pause", store.pause_schedule, "paused"),
                            ("resume", store.resume_schedule, "resumed"),
                            ("delete", store.delete_schedule, "deleted")):  # fmt: skip
        if getattr(args, flag):
            try:
                await act(args.name)
            except _errors.UnknownSchedule as exc:
                raise _Usage(str(exc)) from exc
            _out(args, {"name": args.name, flag: True}, f"{args.name}: {done}")
            return 0
    try:
        row = await store.set_schedule(
            args.name, project_id=args.project, payload=args.payload, cron=args.cron,
            every=args.every, timezone="UTC" if args.timezone is None else args.timezone,
            catch_up="latest" if args.catch_up is None else args.catch_up,
            priority=0 if args.priority is None else args.priority,
            max_attempts=args.max_attempts,
        )  # fmt: skip
    except (_errors.UnknownProject, _errors.MissingExtra) as exc:
        raise _Usage(str(exc)) from exc
    _out(args, row, _show_schedule(row))
    return 0


def _limit_changes(args: argparse.Namespace) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in ("max_running", "per_minute", "burst")
        if getattr(args, name) is not ...
    }


def _show_limits(row: dict[str, Any]) -> str:
    def shown(value: Any) -> str:  # as given: 1234567 (and 2**63 - 1), never 1.23457e+06
        if value is None:
            return "-"
        if isinstance(value, int):
            return str(value)
        text = f"{value:.15g}"  # 600.0 as 600
        return text if float(text) == value else repr(value)

    tokens = "" if row["tokens"] is None else f", tokens {row['tokens']:.2f}"
    return (
        f"{row['project_id']}: max_running {shown(row['max_running'])} (running "
        f"{row['running']}), per_minute {shown(row['per_minute'])}, burst "
        f"{shown(row['burst'])}{tokens}"
    )


async def _limits(store: _store.ControlStore, args: argparse.Namespace) -> int:
    changes = _limit_changes(args)
    try:
        if changes:
            rows = [await store.set_limits(args.project, **changes)]
        elif args.project is not None:
            rows = [await store.limits(args.project)]
        else:
            rows = await store.project_limits()
    except _errors.UnknownProject as exc:
        raise _Usage(str(exc)) from exc
    text = "\n".join(_show_limits(row) for row in rows) or "no project has limits"
    _out(args, {"limits": rows}, text)
    return 0


#: The verbs that only look: they open the store read-only.
_LOOKING = ("stats", "verify", "events", "items", "schedules")
#: Each verb's own parser, for its usage line.
_VERB_PARSERS: dict[str, argparse.ArgumentParser] = {}

_VERBS: dict[str, Callable[[_store.ControlStore, argparse.Namespace], Any]] = {
    "stats": _stats,
    "verify": _verify,
    "events": _events,
    "items": _items,
    "cancel": _cancel,
    "requeue": _requeue,
    "purge": _purge,
    "import": _import_pending,
    "schedules": _schedules,
    "schedule": _schedule,
    "limits": _limits,
    "init": _init,
    "project": _project,
    "enqueue": _enqueue,
}


if __name__ == "__main__":
    sys.exit(main())
