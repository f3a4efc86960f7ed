"""The ``asyncplane`` command: look at, check and maintain a store without writing Python.

    asyncplane stats DB                       counts by state and project, ages, sizes
    asyncplane verify DB                      the ledger check; exit 1 if it finds problems
    asyncplane events DB ITEM                 one item's history
    asyncplane purge DB --retention 7d        archive, then delete, old settled items
    asyncplane import DB --from SRC --table T --column payload=data ...
    asyncplane copy SRC DST                   move a store to another (SQLite <-> PostgreSQL)
    asyncplane probe --store PATH --scenario ...   (see asyncplane.probe)

DB, SRC and DST are SQLite files or ``postgresql://`` URLs.

Every verb takes ``--json`` for one JSON object on stdout. Long operations (purge, import,
copy) show their progress on stderr when it is a terminal. stats, verify and events open the
file read-only and write nothing. Exit status: 0 on success, 1 when verify finds problems,
2 for a usage error, a missing file, a file that is not an asyncplane store, or a store
of another schema version (stats, verify and events need the current one; purge and
import migrate an older store), 3 when the store or the disk fails under the command.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from asyncplane import __version__, _copy, _engine, _errors, _ledger, _sqlite, _store, probe

__all__ = ("main", "parse_duration")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> dt.timedelta:
    """'90s', '15m', '12h', '7d', '2w' or plain seconds, as a timedelta."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use seconds, or a number with s, m, h, d or w)"
        )
    return dt.timedelta(seconds=float(found[1]) * _UNITS.get(found[2] or "s", 1))


def _literal(text: str) -> int | float | str:
    """A command-line value as the source column most likely holds it."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncplane", description="Look at, check and maintain asyncplane stores."
    )
    parser.add_argument("--version", action="version", version=f"asyncplane {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="print one JSON object")
        return sub

    stats = verb("stats", "counts by state and project, oldest ready item, sizes")
    stats.add_argument("db")
    verify = verb("verify", "check every row against its history; exit 1 on problems")
    verify.add_argument("db")
    verify.add_argument("--limit", type=int, default=None, help="stop after this many")
    events = verb("events", "one item's history, oldest first")
    events.add_argument("db")
    events.add_argument("item", type=int)
    purge = verb("purge", "archive, then delete, settled items older than the retention")
    purge.add_argument("db")
    purge.add_argument("--retention", type=parse_duration, required=True, help="e.g. 7d")
    purge.add_argument("--chunk", type=int, default=500, help="items per transaction")
    purge.add_argument("--archive", type=pathlib.Path, default=None, help="the JSONL archive")
    imported = verb("import", "copy another SQLite queue's pending rows in, once")
    imported.add_argument("db")
    imported.add_argument("--from", dest="source", type=pathlib.Path, required=True)
    imported.add_argument("--table", required=True)
    imported.add_argument(
        "--column", action="append", default=[], metavar="FIELD=COLUMN",
        help="map a store field to a source column (payload is required); repeatable",
    )  # fmt: skip
    imported.add_argument("--project", help="the project every row goes to")
    imported.add_argument(
        "--pending", action="append", default=None, metavar="VALUE", type=_literal,
        help="a value of the state column that means still to be done (numbers are read "
        "as numbers); repeatable",
    )  # fmt: skip
    imported.add_argument("--drop-source", action="store_true", help="drop the table after")
    imported.add_argument("--chunk", type=int, default=1000)
    copied = verb("copy", "copy a store, items and histories, into another; idempotent")
    copied.add_argument("db", metavar="SRC", help="the store to copy (only read)")
    copied.add_argument("destination", metavar="DST", help="an empty store, or a new file")
    copied.add_argument("--chunk", type=int, default=500, help="items per transaction")
    copied.add_argument(
        "--pending-only", action="store_true", help="leave settled (done, failed) items behind"
    )
    verbs.add_parser("probe", help="qualify a disk: separate processes, exact counts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncplane`` command; return its exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "probe":
        return probe.main(args_list[1:], prog="asyncplane probe")  # it owns its options
    args = _parser().parse_args(args_list)
    try:
        _check_is_a_store(args.db)  # before any event loop: a plain, quick file read
        if args.verb == "copy" and pathlib.Path(args.destination).exists():
            _check_is_a_store(args.destination)  # an existing file must be a store too
        return asyncio.run(_run(args))
    except _Usage as problem:
        print(f"asyncplane {args.verb}: {problem}", file=sys.stderr)
        return 2
    except (_errors.AsyncplaneError, OSError) as problem:
        # The store or the file system failed under the command (a lock held too long, a
        # read-only disk): say so plainly; 1 is verify's "problems found", so use 3.
        print(f"asyncplane {args.verb}: failed: {problem}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # pragma: no cover - output piped into `head` and cut short
        sys.stderr.close()
        return 0


class _Usage(Exception):
    """Something the user has to fix: exit status 2."""


def _check_is_a_store(location: str) -> None:
    """Refuse, before opening anything, a file that is not an asyncplane store (an empty
    file included: the store would create its schema in it). A PostgreSQL schema is
    checked by the store itself, when it opens it read-only."""
    if _engine.is_postgres_url(location):
        return
    path = pathlib.Path(location)
    if not path.is_file():
        raise _Usage(f"no such file: {path}")
    try:
        _sqlite.vet_store_file(path)
    except _errors.StorageError as exc:
        raise _Usage(f"{path} is not an asyncplane store ({exc})") from exc


async def _run(args: argparse.Namespace) -> int:
    # Looking (stats, verify, events) opens the file read-only: no migration, no write lock,
    # nothing written. Only purge, import and copy (its destination) write.
    if args.verb == "copy":
        return await _copy_verb(args)
    store = _store.ControlStore(args.db, read_only=args.verb in ("stats", "verify", "events"))
    try:
        try:
            await store.open()
        except (_errors.NotAnAsyncplaneDatabase, _errors.SchemaVersionError) as exc:
            raise _Usage(str(exc)) from exc
        return int(await _VERBS[args.verb](store, args))
    except _errors.InvalidInput as exc:
        raise _Usage(str(exc)) from exc
    finally:
        await store.close()


def _out(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, default=_jsonable) if args.json else text)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
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
        events = await store.events(args.item)
    except _errors.UnknownItem as exc:
        raise _Usage(str(exc)) from exc
    text = "\n".join(
        f"{e['at'].isoformat()}  {e['event_type']:<13} fence {e['fence']:<3} "
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
    data = {"purged": done.purged, "chunks": done.chunks, "archive": str(done.archive_path)}
    chunks = f"{done.chunks} chunk{'' if done.chunks == 1 else 's'}"
    _out(args, data, f"purged {done.purged:,} items in {chunks} into {done.archive_path}")
    return 0


async def _import(store: _store.ControlStore, args: argparse.Namespace) -> int:
    columns = {}
    for pair in args.column:
        field, sep, column = pair.partition("=")
        if not sep:
            raise _Usage(f"--column takes FIELD=COLUMN, not {pair!r}")
        columns[field] = column
    if not args.source.is_file():
        raise _Usage(f"no such file: {args.source}")
    try:
        done = await store.import_pending(
            args.source, table=args.table, columns=columns, project_id=args.project,
            pending=args.pending, drop_source=args.drop_source, chunk=args.chunk,
            progress=_progress("source rows seen"),
        )  # fmt: skip
    except _errors.UnknownProject as exc:
        raise _Usage(str(exc)) from exc
    finally:
        _end_progress()
    data = {
        "source": done.source, "imported": done.imported,
        "already_imported": done.already_imported, "not_pending": done.not_pending,
        "dropped": done.dropped,
    }  # fmt: skip
    _out(
        args, data,
        f"imported {done.imported:,} pending rows from {done.source} "
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
            raise _Usage(str(exc)) from exc
        try:
            done = await _copy.copy_store(
                source, destination, chunk=args.chunk, pending_only=args.pending_only,
                progress=_progress("items"),
            )  # fmt: skip
        except _errors.InvalidInput as exc:
            raise _Usage(str(exc)) from exc
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
        f"copied {done.copied:,} items ({done.skipped:,} copied before) and "
        f"{done.projects} new projects from {source.location} to {destination.location}; "
        + ("the destination's ledger verifies clean" if not problems
           else f"the destination's ledger has problems: {problems[0]}"),
    )  # fmt: skip
    return 1 if problems else 0


_VERBS: dict[str, Callable[[_store.ControlStore, argparse.Namespace], Any]] = {
    "stats": _stats,
    "verify": _verify,
    "events": _events,
    "purge": _purge,
    "import": _import,
}


if __name__ == "__main__":
    sys.exit(main())
