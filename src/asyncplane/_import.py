"""import_pending: move the pending work of another SQLite queue into a store, once.

A queue kept in some other SQLite database (an older asyncplane table, persist-queue,
litequeue, a home-grown table) can hand its pending rows over: `import_pending` reads the
source table read-only, in chunks ordered by a key column, copies only the rows that are
not terminal into the store with fresh ids and a "queued" event that names the source,
and leaves terminal history behind. Every copied row is recorded in the store (its source
and key), in the same transaction as the item itself, so a second run, or a run after a
crash half-way, imports nothing twice (a row whose key was recorded is passed over; where
the key is a rowid SQLite may give again, `_keys_reused`, that is said, and the table is
not dropped). The record keeps a digest of the row's payload (`_digest`): a recorded key
whose row holds another payload now is another row (the table dropped and made again gives
its keys out anew) or the row rewritten, and is copied again; so is every row under a key
recorded before an import dropped the source table (`record_source_dropped`: the rows
since are of a table made again), whatever it holds (`_rules.imported_before`).
Only once everything is copied, and nothing was written to the source file
since the import began, may it drop the source table (``drop_source=True``, `_Watch`),
and only if no ``pending`` value is of a kind the state column never holds
(`_check_pending_kinds`). A run
reads the rows up to the largest key there at its start (`_last_key`); the store's own
file is refused as a source.

Table and column names cannot be bound as SQL parameters. They are accepted only if they
are names of the source table's own columns (read through ``pragma_table_info``), and are
quoted; values always travel as parameters.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import os
import pathlib
import re
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import anyio.to_thread

from asyncplane import (
    _backend,
    _connection,
    _engine,
    _errors,
    _models,
    _rules,
    _tasks,
    _validate,
)

__all__ = ("FIELDS", "ImportSummary", "check_request", "import_pending")

_log = logging.getLogger("asyncplane.import")

#: The store fields a source column may fill. "payload" is required; "key" orders and
#: identifies source rows (default: SQLite's rowid); "state" with ``pending`` says which
#: rows are still to be done.
FIELDS = frozenset(
    {"payload", "key", "state", "project_id", "priority", "service_class", "sla",
     "fingerprint", "max_attempts", "not_before"}
)  # fmt: skip


# The source is another application's SQLite file: its own few statements, not the store's.
_SOURCE_COLUMNS = "SELECT name FROM pragma_table_info(?)"
_SOURCE_TABLE_EXISTS = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
_SOURCE_TABLE_SQL = "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?"
# The table's rowid alias: its one primary key column, declared INTEGER.
_SOURCE_ROWID_ALIAS = """
SELECT name FROM pragma_table_info(?)
WHERE pk = 1 AND upper(type) = 'INTEGER'
  AND (SELECT count(*) FROM pragma_table_info(?) WHERE pk > 0) = 1
"""


@dataclasses.dataclass(frozen=True)
class ImportSummary:
    """What one import did.

    Attributes:
        source: The name the imported rows are recorded under (``<file>::<table>``).
        imported: Rows copied into the store by this run.
        already_imported: Pending rows an earlier run had copied (skipped).
        not_pending: Source rows left behind because their state is not in ``pending``
            (terminal history, which is not copied).
        dropped: Whether the source table was dropped afterwards.
        changed: Rows among ``imported`` whose key an earlier run had recorded, with
            another payload or before an import dropped the table: the table was made
            again (its keys given out anew), or the row was rewritten since. Each became a
            new item.
    """

    source: str
    imported: int
    already_imported: int
    not_pending: int
    dropped: bool
    changed: int = 0


#: ``freeing(op, call)``: await a write that can free work, then wake this process's
#: waiting claims, even if cancelled once its answer was in (`ControlStore._freeing`).
Freeing = Callable[[Any, Awaitable[Any]], Awaitable[Any]]


async def import_pending(
    engine: _engine.Engine,
    freeing: Freeing,
    source_path: str | os.PathLike[str],
    *,
    table: str,
    columns: Mapping[str, str],
    project_id: str | None = None,
    pending: Collection[Any] | None = None,
    drop_source: bool = False,
    chunk: int = 1000,
    progress: Callable[[int], None] | None = None,
) -> ImportSummary:
    """Copy a source table's pending rows into the store, once; see the module docstring."""
    source = _validate.absolute_path(source_path, "source_path")
    if not isinstance(table, str):
        raise _errors.InvalidType(f"table must be a str, not {type(table).__name__}")
    table = _validate.storable_text(table, "table")
    progress = _validate.callback(progress, "progress")
    mapping = _check_mapping(columns, project_id, pending)
    chunk = _validate.positive_int(chunk, "chunk")
    project = None if project_id is None else _validate.text_id(project_id, "project_id")
    # Before the first read, the check's included: a drop happens only if nothing was
    # written to the file since.
    if not _engine.is_postgres_url(engine.location) and _same_file(source, engine.location):
        # Each chunk would read the rows the one before it wrote, without end.
        raise _errors.InvalidInput(f"the source {source} is this store's own file")
    watch = await anyio.to_thread.run_sync(_Watch, source) if drop_source else None
    try:
        await anyio.to_thread.run_sync(_check_source, source, table, mapping)
        if watch is not None and pending is not None:
            await anyio.to_thread.run_sync(_check_pending_kinds, source, table, mapping, pending)
        reused = await anyio.to_thread.run_sync(_keys_reused, source, table, mapping)
        # The rows there at the start, and no more: a source written to meanwhile still
        # ends (what comes later is the next run's; the drop is refused then anyway).
        last = await anyio.to_thread.run_sync(_last_key, source, table, mapping)
        return await _import(
            engine, freeing, source, table, mapping, project, pending, watch, reused, chunk,
            progress, last,
        )  # fmt: skip
    finally:
        if watch is not None:
            watch.close()  # (the drop closes it on its own thread: nothing else uses it)


async def _import(
    engine: _engine.Engine, freeing: Freeing, source: pathlib.Path, table: str,
    mapping: dict[str, str], project: str | None, pending: Collection[Any] | None,
    watch: _Watch | None, reused: bool, chunk: int, progress: Callable[[int], None] | None,
    last: Any,
) -> ImportSummary:  # fmt: skip
    name = f"{source}::{table}"
    backend = await engine.ready()
    known = {p.project_id for p in await backend.list_projects()}
    if project is not None and project not in known:
        raise _rules.unknown_project(project)
    dropping = _rules.dropped_source(name)
    if watch is not None and len(dropping.encode()) > _rules.MAX_IMPORT_RECORD_BYTES:
        raise _errors.InvalidInput(  # its drop is recorded under the name: before a drop
            f"the source's name (its path and table) is longer than "
            f"{_rules.MAX_IMPORT_RECORD_BYTES - len('#dropped:')} bytes of UTF-8, more than "
            "an import that drops its table records: nothing was imported"
        )
    # As found before any chunk is read: a drop by another import since is refused.
    dropped_up_to = await backend.source_dropped_up_to(name)
    after: Any = None
    outcomes: collections.Counter[_backend.ImportOutcome] = collections.Counter()
    left = 0
    pending_as_text = None if pending is None else _as_text(pending)
    while last is not None:
        rows = await anyio.to_thread.run_sync(
            _read_chunk, source, table, mapping, after, last, chunk
        )
        if not rows:
            break
        after = rows[-1]["key"]
        wanted: dict[str, list[tuple[str, str, _backend.NewItem]]] = {}
        for row in rows:
            if "state" in mapping and not _is_pending(row["state"], pending, pending_as_text):
                left += 1
                continue
            target = (
                project
                if project is not None
                else _validate.text_id(
                    row["project_id"], f"{mapping['project_id']} of source row {row['key']!r}"
                )
            )
            if target not in known:  # before any of the chunk is written
                error = _rules.unknown_project(target)
                raise type(error)(f"source row {row['key']!r}: {error}")
            item = _new_item(engine, row)
            key = _validate.storable_text(
                str(row["key"]), f"the key of source row {_validate.shown(row['key'])}"
            )
            wanted.setdefault(target, []).append((key, _digest(row), item))
        for target, items in wanted.items():
            op = _backend.ImportOp(name, target, tuple(items), dropped_up_to)
            outcomes.update(await freeing(op, backend.import_rows(op)))  # waiters woken
        if progress is not None:
            progress(outcomes.total() + left)
        if len(rows) < chunk:
            break
    imported = outcomes["new"] + outcomes["changed"]
    skipped = outcomes["again"] + outcomes["unverified"]
    if outcomes["changed"]:
        _log.warning(
            "%d row(s) of %s were imported before under the same key, with another payload "
            "or before an import dropped the table (a table made again gives its keys out "
            "anew), or the rows were rewritten since: each was imported again, as a new "
            "item", outcomes["changed"], name,
        )  # fmt: skip
    if skipped and reused and watch is None:
        _log.warning(
            "%d row(s) of %s were passed over as imported before, by rowids SQLite may have "
            "given again to new rows (no AUTOINCREMENT)%s: a row written since one was "
            "taken, %smay be among them, not imported; map a key that is never reused",
            skipped, name,
            "" if outcomes["unverified"] else " and by their payload",
            "" if outcomes["unverified"] else "with the same payload, ",
        )  # fmt: skip
    if watch is not None:
        if skipped and reused:
            raise _errors.InvalidInput(
                f"{skipped} row(s) of {table} were passed over as imported before, by keys "
                "SQLite may have given again to new rows (a rowid, without AUTOINCREMENT: a "
                "taken row's rowid goes to the next one), and a new row with a taken one's "
                f"payload cannot be told from it: {table} was not dropped. Look at it, and "
                "drop it yourself"
            )
        # The drop, then its record, each to its end: a cancel that comes meanwhile is
        # raised after (the record said after the drop: a table made again since, under
        # a key recorded now, is another row, whatever it holds).
        _, cancelled = await _tasks.to_the_end(
            _drop(backend, watch, table, name), "asyncplane-import-drop"
        )
        if cancelled:
            raise asyncio.CancelledError
    return ImportSummary(name, imported, skipped, left, watch is not None, outcomes["changed"])


async def _drop(backend: _backend.Backend, watch: _Watch, table: str, name: str) -> None:
    """Drop the source table, then record that an import dropped it."""
    await anyio.to_thread.run_sync(watch.drop, table)
    try:
        await backend.record_source_dropped(name)
    except _errors.StorageError as exc:
        raise _errors.StorageError(
            f"{table} was dropped, every row imported, but the store failed as it "
            f"recorded the drop ({exc}): a table made there again will be told from the "
            "one dropped by its rows' payloads alone"
        ) from exc


def check_request(
    source: pathlib.Path, table: str, columns: Mapping[str, str], project_id: str | None,
    pending: Collection[Any] | None,
) -> None:  # fmt: skip
    """What `import_pending` checks of its request and of the source before it reads a
    row, here without a store: so the command refuses a mistake before it opens the store,
    whose opening may write (a migration). Blocking: the source is read."""
    _check_source(source, table, _check_mapping(columns, project_id, pending))


def _check_mapping(
    columns: Mapping[str, str], project_id: str | None, pending: Collection[Any] | None
) -> dict[str, str]:
    if not isinstance(columns, Mapping):
        raise _errors.InvalidType("columns must map store fields to source column names")
    mapping = dict(columns)
    for field in mapping:
        if not isinstance(field, str):
            raise _errors.InvalidType(
                f"columns keys are store field names (str), not {_validate.shown(field)}"
            )
    unknown = set(mapping) - FIELDS
    if unknown:
        raise _errors.InvalidInput(
            f"unknown fields in columns: {sorted(unknown)}; known: {sorted(FIELDS)}"
        )
    if "payload" not in mapping:
        raise _errors.InvalidInput("columns must name the source column that holds the payload")
    if (project_id is None) == ("project_id" not in mapping):
        raise _errors.InvalidInput(
            "give project_id=, or map a project_id column, exactly one of the two"
        )
    if ("state" in mapping) != (pending is not None):
        raise _errors.InvalidInput(
            "a state column and pending= (its values that are still to be done) go together"
        )
    if pending is not None and (
        isinstance(pending, (str, bytes)) or not isinstance(pending, Collection)
    ):
        raise _errors.InvalidType("pending must be a collection of state values, like [0, 1]")
    for field, column in mapping.items():
        if not isinstance(column, str) or not column:
            raise _errors.InvalidInput(f"columns[{field!r}] must be a column name")
    mapping.setdefault("key", "rowid")
    return mapping


def _connect(
    source: pathlib.Path, *, write: bool = False, any_thread: bool = False
) -> sqlite3.Connection:
    try:
        found = source.is_file()
    except OSError as exc:  # a name too long, say
        raise _errors.InvalidInput(f"cannot look at the source {source}: {exc}") from exc
    if not found:
        raise _errors.InvalidInput(f"no source database at {source}")
    uri = source.as_uri() + ("" if write else "?mode=ro")
    try:
        return sqlite3.connect(
            uri, uri=True, isolation_level=None, timeout=30, check_same_thread=not any_thread
        )
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc


def _check_source(source: pathlib.Path, table: str, mapping: dict[str, str]) -> None:
    conn = _connect(source)
    try:
        if conn.execute(_SOURCE_TABLE_EXISTS, (table,)).fetchone() is None:
            raise _errors.InvalidInput(f"the source database has no table {table!r}")
        names = {row[0] for row in conn.execute(_SOURCE_COLUMNS, (table,))}
        for field, column in mapping.items():
            if column != "rowid" and column not in names:
                raise _errors.InvalidInput(
                    f"table {table!r} has no column {column!r} (for {field}); "
                    f"it has {sorted(names)}"
                )
        # Rows are read in key order and remembered by key, as text: a key must name one
        # row, and keep one type, or the integer 1 and the text '1' would be one key.
        key = _quote(mapping["key"])
        rows, keys, distinct, types = conn.execute(
            f"SELECT count(*), count({key}), count(DISTINCT {key}), "
            f"count(DISTINCT typeof({key})) FROM {_quote(table)}"
        ).fetchone()  # both names were checked against the schema just above
        if keys != rows:
            raise _errors.InvalidInput(f"the key column {mapping['key']!r} has NULLs")
        if types > 1:
            raise _errors.InvalidInput(
                f"the key column {mapping['key']!r} mixes value types (integer and text, "
                "say): keys are remembered as text, so 1 and '1' would be the same key"
            )
        if distinct != rows:
            raise _errors.InvalidInput(
                f"the key column {mapping['key']!r} is not unique: rows would be skipped"
            )
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        conn.close()


def _same_file(source: pathlib.Path, store: str) -> bool:
    """Whether the source is the store's own database file (by any name)."""
    try:
        return os.path.samefile(source, store)
    except OSError:  # either not there (yet): not one file
        return False


def _last_key(source: pathlib.Path, table: str, mapping: dict[str, str]) -> Any:
    """The table's largest key now (None for an empty table): where this run's reads end."""
    conn = _connect(source)
    try:
        # Both names were checked against the schema (_check_source).
        row = conn.execute(f"SELECT max({_quote(mapping['key'])}) FROM {_quote(table)}")
        return row.fetchone()[0]
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        conn.close()


#: The distinct states an import that drops its source looks at, at most (`_check_pending_kinds`).
_STATES_LOOKED_AT = 10_000


def _check_pending_kinds(
    source: pathlib.Path, table: str, mapping: dict[str, str], pending: Collection[Any]
) -> None:
    """Before an import that drops its source writes anything: no value of ``pending``
    may be of a kind the state column never holds, a text that is no number where every
    state is a number (``--pending READY`` for an integer column), or a number where no
    state is one or reads as one. Such a value matches no row, ever: a slip that would
    leave its rows behind as not pending, for the drop to take. (A value of the right
    kind that no row holds now is a state with no row in it, a worker's "locked" once
    the workers are stopped, say: taken.)"""
    conn = _connect(source)
    try:
        # Both names were checked against the schema (_check_source); BINARY, as rows
        # are matched in Python (a NOCASE column's distinct values would hide some).
        states = [
            row[0]
            for row in conn.execute(
                f"SELECT DISTINCT {_quote(mapping['state'])} COLLATE BINARY "
                f"FROM {_quote(table)} LIMIT ?",
                (_STATES_LOOKED_AT + 1,),
            )
        ]
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        conn.close()
    if len(states) > _STATES_LOOKED_AT:
        raise _errors.InvalidInput(
            f"the state column {mapping['state']!r} holds more than {_STATES_LOOKED_AT:,} "
            f"distinct values: not a queue's states; {table} is not dropped"
        )
    texts = [state for state in states if isinstance(state, str)]
    numbers = [state for state in states if isinstance(state, (int, float))]
    numeric = bool(numbers) or any(_PLAIN_DECIMAL.fullmatch(text) for text in texts)
    never = [
        value for value in pending
        if (isinstance(value, str) and not texts and numbers
            and _PLAIN_DECIMAL.fullmatch(value) is None)
        or (isinstance(value, (int, float)) and not isinstance(value, bool)
            and texts and not numeric)
    ]  # fmt: skip
    if never:
        found = ", ".join(repr(state) for state in sorted(states, key=repr)[:20])
        raise _errors.InvalidInput(
            f"pending value(s) {', '.join(map(repr, never))} can match no row's "
            f"{mapping['state']!r} (the states found: {found}): with drop_source, every "
            f"row not pending would be dropped with {table}. Give the pending states as "
            "they are stored, or import without drop_source; nothing was imported"
        )


def _keys_reused(source: pathlib.Path, table: str, mapping: dict[str, str]) -> bool:
    """Whether the import's key is the table's rowid (by name, or its INTEGER PRIMARY KEY
    alias) on a table without AUTOINCREMENT: SQLite then gives a deleted last row's rowid
    to the next row, and a row recorded as imported may be another by now."""
    conn = _connect(source)
    try:
        key = mapping["key"]
        alias = conn.execute(_SOURCE_ROWID_ALIAS, (table, table)).fetchone()
        if key.lower() not in ("rowid", "_rowid_", "oid") and (alias is None or alias[0] != key):
            return False
        found = conn.execute(_SOURCE_TABLE_SQL, (table,)).fetchone()
        return found is None or "AUTOINCREMENT" not in (found[0] or "").upper()
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        conn.close()


def _quote(identifier: str) -> str:
    """An identifier already checked against the source's schema, quoted for SQL."""
    return '"' + identifier.replace('"', '""') + '"'


def _read_chunk(
    source: pathlib.Path, table: str, mapping: dict[str, str], after: Any, last: Any,
    chunk: int,
) -> list[dict[str, Any]]:  # fmt: skip
    fields = sorted(mapping)
    selected = ", ".join(_quote(mapping[f]) for f in fields)
    key = _quote(mapping["key"])
    # Every name here was checked against the table's own columns in _check_source.
    statement = (
        f"SELECT {selected} FROM {_quote(table)} "
        f"WHERE (? IS NULL OR {key} > ?) AND {key} <= ? ORDER BY {key} LIMIT ?"
    )
    conn = _connect(source)
    try:
        rows = conn.execute(statement, (after, after, last, chunk)).fetchall()
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
    finally:
        conn.close()
    return [dict(zip(fields, row, strict=True)) for row in rows]


def _new_item(engine: _engine.Engine, row: dict[str, Any]) -> _backend.NewItem:
    raw = row["payload"]
    if isinstance(raw, bytes):
        raise _errors.InvalidPayload(
            f"source row {row['key']!r} holds a binary payload (pickled, perhaps); asyncplane "
            "imports JSON or text only: re-encode the source first"
        )
    try:
        decoded = _validate.strict_json(raw) if isinstance(raw, str) else raw
    except (ValueError, RecursionError):  # not JSON (or too deep to be a payload): text
        decoded = raw
    payload = decoded if isinstance(decoded, dict) else {"data": decoded}
    job = _models.Job(
        payload,
        priority=0 if row.get("priority") is None else row["priority"],
        service_class=row.get("service_class") or "standard",
        sla=row.get("sla"),
        fingerprint=row.get("fingerprint"),
        max_attempts=row.get("max_attempts"),
        not_before=row.get("not_before"),
    )
    try:
        return engine.new_item(job, True)
    except _errors.AsyncplaneError as exc:
        raise type(exc)(f"source row {row['key']!r}: {exc}") from None


def _digest(row: dict[str, Any]) -> str:
    """What tells a source row from another under its key: its payload, as stored (not
    the other mapped columns, which a rerun may map otherwise, and a queue may rewrite
    as a row waits: its priority, its due time)."""
    return hashlib.blake2b(repr(row["payload"]).encode(), digest_size=16).hexdigest()


def _is_pending(state: Any, pending: Any, pending_as_text: set[str] | None) -> bool:
    """Whether a source row's state is one of ``pending``: equal to one; or, a state of
    text, written as a number of ``pending`` is (``pending=[0]`` and a text column's "0");
    or, a state that is a number, the number a text of ``pending`` reads as (the command
    line's ``--pending 0``, or ``+1``, and an integer column's 0 or 1). Text is never
    matched with text as numbers: "01" is not "1"."""
    if state in pending:
        return True
    if isinstance(state, str):
        return pending_as_text is not None and state in pending_as_text
    if isinstance(state, (int, float)):
        return any(_reads_as(value, state) for value in pending if isinstance(value, str))
    return False


def _as_text(pending: Collection[Any]) -> set[str]:
    """The numbers of ``pending`` written as text, as a text state that matches them is."""
    return {str(value) for value in pending if isinstance(value, (int, float))}


def _reads_as(text: str, number: float) -> bool:
    """Whether ``text`` is a plain decimal equal to ``number`` ("1", "+1", "1.0", "01"; not
    "1_0", " 1 " or "1e3", which Python's int() and float() would read too)."""
    if _PLAIN_DECIMAL.fullmatch(text) is None:
        return False
    return float(text) == number


_PLAIN_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


class _Watch:
    """A connection to the source, opened before an import that drops it reads anything,
    for the drop at its end: which happens in one transaction, only if SQLite's
    ``data_version`` for it has not moved since, that is, if no other connection committed
    to the file while the import ran. Then every row the import read is as it is at the
    drop, each still to be done is in the store, and a row added, changed or swapped in
    meanwhile (a deleted row's rowid given to a new one, say) is never dropped unimported.

    Only one thread uses the connection at a time: it is opened on one, its drop runs on
    another once every read is done, and a drop closes it itself, so a cancelled import
    never closes it under a drop still running on its thread."""

    def __init__(self, source: pathlib.Path) -> None:
        self._conn = _connect(source, write=True, any_thread=True)
        self._lock = threading.Lock()  # the drop, or the close: never both at once
        self._closed = False
        try:
            self._seen = _data_version(self._conn)
        except BaseException:
            self._conn.close()
            raise

    def drop(self, table: str) -> None:
        """Drop the table in a transaction, unless the file changed since the watch began;
        then close."""
        with self._lock:
            if self._closed:
                raise _errors.StoreClosed("the import was cut short before its drop")
            try:
                self._drop(table)
            finally:
                self._closed = True
                self._conn.close()

    def _drop(self, table: str) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if _data_version(conn) != self._seen:
                    raise _errors.InvalidInput(
                        f"the source file changed while the import ran (a write, or a "
                        f"checkpoint): {table} was not dropped. Stop what uses the file, "
                        "import again (the rows imported before are passed over), then drop"
                    )
                conn.execute(f"DROP TABLE {_quote(table)}")  # checked against the schema
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _connection.translate(exc) from exc

    def close(self) -> None:
        """Close it, unless a drop has it (that drop closes it when done)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._closed = True
                    self._conn.close()
            finally:
                self._lock.release()


def _data_version(conn: sqlite3.Connection) -> int:
    """A number that moves whenever another connection commits to the file."""
    try:
        return int(conn.execute("PRAGMA data_version").fetchone()[0])
    except sqlite3.Error as exc:
        raise _connection.translate(exc) from exc
