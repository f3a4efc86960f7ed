"""Argument checks, run before anything is sent to the writer.

Every public call validates its arguments here first, so bad input is refused with a
typed error (InvalidInput/InvalidPayload are ValueErrors, InvalidType is a TypeError)
before a transaction is opened: a refused call writes nothing.

The same few rules hold for every value, whichever entry point it came through (the API,
an outcome, the CLI, an import):

- text must be storable: no lone surrogate (what ``surrogateescape`` decoding of a file
  name or of subprocess output produces) and, where the database cannot hold one, no NUL;
- numbers must be finite and in range: an int too large for a float is refused as out
  of range, never raised as a bare OverflowError;
- JSON must round-trip anywhere: at most `MAX_JSON_DEPTH` levels of nesting, so any
  worker decodes it whatever its call stack, and integers of at most `MAX_INT_DIGITS`
  digits, which every Python process can read back whatever its int-to-str limit.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import inspect
import json
import math
import os
import stat
import string
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from asyncplane import _errors, _models, _schedule

if TYPE_CHECKING:
    import pathlib

__all__ = (
    "MAX_BURST",
    "MAX_BUSY_TIMEOUT",
    "MAX_DURATION_SECONDS",
    "MAX_EPOCH_SECONDS",
    "MAX_ERROR_LENGTH",
    "MAX_ID_LENGTH",
    "MAX_INT",
    "MAX_INT_DIGITS",
    "MAX_JSON_DEPTH",
    "MAX_LEASE_SECONDS",
    "MAX_READ_CONNECTIONS",
    "absolute_path",
    "boolean",
    "burst_value",
    "callback",
    "delay",
    "duration",
    "encode_payload",
    "encode_result",
    "error_text",
    "fingerprint",
    "finish_status",
    "identity",
    "instant",
    "item_id",
    "lease_seconds",
    "megabytes",
    "name",
    "optional_actor",
    "optional_fence",
    "optional_positive_int",
    "path_text",
    "positive_int",
    "priority",
    "project_status",
    "project_statuses",
    "read_connections",
    "resolved_path",
    "seconds",
    "service_class",
    "shown",
    "storable_text",
    "strict_json",
    "text_id",
)

#: Longest accepted project, owner or actor id, in characters.
MAX_ID_LENGTH = 256
#: Largest id or fence: SQLite's integers are signed 64-bit.
MAX_INT = 2**63 - 1
#: Longest lease: a year. A lease is a promise to report back, not a reservation forever,
#: and its end must stay a representable time.
MAX_LEASE_SECONDS = 366 * 24 * 3600.0
#: Longest wait for the write lock, in seconds.
MAX_BUSY_TIMEOUT = 24 * 3600.0
#: Longest duration taken anywhere else (a retention, a delay, a schedule's period): a
#: century, so that now plus it stays a representable time.
MAX_DURATION_SECONDS = 100 * 366 * 24 * 3600.0
#: Times at or past this (the year 10000) are refused: they could not be shown as
#: datetimes. The last microsecond of 9999 is accepted.
MAX_EPOCH_SECONDS = 253402300800.0
#: Longest error description kept with an item, in characters.
MAX_ERROR_LENGTH = 16 * 1024
#: Deepest nesting of a payload or result: the object itself is level 1, each list or
#: dict inside it one more. Far below the interpreter's recursion limit, so decoding never
#: fails because of where in its call stack a worker decodes.
MAX_JSON_DEPTH = 100
#: Most read connections a store may keep open at once.
MAX_READ_CONNECTIONS = 64
#: Most digits of an int in a payload or result: 640 is the lowest int-to-str limit a
#: Python process may set (sys.set_int_max_str_digits), so every reader can decode it.
MAX_INT_DIGITS = 640
_INT_BOUND = 10**MAX_INT_DIGITS


def text_id(value: object, what: str) -> str:
    """A non-empty, printable string id of bounded length (project, owner, actor)."""
    if not isinstance(value, str):
        raise _errors.InvalidType(f"{what} must be a str, not {type(value).__name__}")
    if not value.strip():
        raise _errors.InvalidInput(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise _errors.InvalidInput(f"{what} is longer than {MAX_ID_LENGTH} characters")
    if not value.isprintable():
        raise _errors.InvalidInput(
            f"{what} must not contain control characters or lone surrogates: {value!r}"
        )
    return value


def storable_text(value: str, what: str) -> str:
    """``value`` if the database can hold it: UTF-8 encodable (no lone surrogate), no NUL."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _errors.InvalidInput(
            f"{what} holds a lone surrogate at position {exc.start} ({value[exc.start]!r}), "
            "which cannot be stored: decode text with errors='replace', not 'surrogateescape'"
        ) from None
    if "\x00" in value:  # PostgreSQL text cannot hold it; refused on every backend
        raise _errors.InvalidInput(f"{what} must not contain NUL characters")
    return value


def optional_actor(value: object) -> str | None:
    """None (the control plane itself) or an actor id."""
    if value is None:
        return None
    return text_id(value, "actor_id")


def name(value: object) -> str:
    """A project's display name: any non-empty str."""
    if not isinstance(value, str):
        raise _errors.InvalidType(f"name must be a str, not {type(value).__name__}")
    if not value.strip():
        raise _errors.InvalidInput("name must not be empty")
    return storable_text(value, "name")


def item_id(value: object) -> int:
    """A positive int item id (bool is refused: True is not an id)."""
    return positive_int(value, "item_id")


def stored_int(value: object, what: str) -> int:
    """Any int a 64-bit integer column can hold, bool excluded: an id to look up as it
    may be stored, a tamperer's -3 too (`verify_ledger` of one item)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _errors.InvalidType(f"{what} must be an int, not {type(value).__name__}")
    if not -MAX_INT - 1 <= value <= MAX_INT:
        raise _errors.InvalidInput(f"{what} must fit in 64 bits, got {shown(value)}")
    return value


def positive_int(value: object, what: str) -> int:
    """A positive int that fits SQLite's 64-bit integers, bool excluded."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _errors.InvalidType(f"{what} must be an int, not {type(value).__name__}")
    if value < 1:
        raise _errors.InvalidInput(f"{what} must be positive, got {shown(value)}")
    if value > MAX_INT:
        raise _errors.InvalidInput(f"{what} must be at most {MAX_INT}, got {shown(value)}")
    return value


def optional_fence(value: object, what: str) -> int | None:
    """None, or a fence as an item may hold it: an int from 0 (never claimed) up, bool
    excluded."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _errors.InvalidType(f"{what} must be an int or None, not {type(value).__name__}")
    if not 0 <= value <= MAX_INT:
        raise _errors.InvalidInput(f"{what} must be from 0 to {MAX_INT}, got {shown(value)}")
    return value


def lease_seconds(value: object) -> float:
    """A lease length: positive, and at most MAX_LEASE_SECONDS."""
    return seconds(value, "lease_seconds", MAX_LEASE_SECONDS)


def seconds(value: object, what: str, most: float) -> float:
    """A finite number of seconds in (0, most] (int or float, bool excluded)."""
    number = _number(value, what, "an int or float")
    if not math.isfinite(number) or number <= 0:
        raise _errors.InvalidInput(f"{what} must be positive and finite, got {shown(value)}")
    if number > most:
        raise _errors.InvalidInput(f"{what} must be at most {most:g} seconds, got {shown(value)}")
    return number


def finish_status(value: object) -> str:
    """One of the terminal statuses finish() accepts."""
    return _one_of(value, "status", _models.FINISH_STATUSES)


def project_status(value: object) -> str:
    """One of the project statuses; only "open" projects hand out claims."""
    return _one_of(value, "project status", _models.PROJECT_STATUSES)


def project_statuses(value: object, what: str) -> tuple[str, ...]:
    """None (any status), one project status, or several (a tuple or list of them)."""
    return states(value, what, _models.PROJECT_STATUSES, "status")


def _one_of(value: object, what: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise _errors.InvalidType(f"{what} must be a str, not {type(value).__name__}")
    if value not in allowed:
        choices = ", ".join(repr(s) for s in allowed)
        raise _errors.InvalidInput(f"unknown {what} {shown(value)}: expected one of {choices}")
    return value


def event(value: object, what: str) -> asyncio.Event:
    """An asyncio.Event, or a new one for None."""
    if value is None:
        return asyncio.Event()
    if not isinstance(value, asyncio.Event):
        raise _errors.InvalidType(f"{what} must be an asyncio.Event, not {type(value).__name__}")
    return value


def states(
    value: object,
    what: str = "state",
    allowed: tuple[str, ...] = _models.ITEM_STATES,
    noun: str = "state",
) -> tuple[str, ...]:
    """None (any state), one item state, or several (a tuple or list of them); or, with
    ``allowed``, of those (`project_statuses`)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (_one_of(value, what, allowed),)
    if not isinstance(value, (tuple, list, set, frozenset)):
        raise _errors.InvalidType(
            f"{what} must be a str or a tuple of them, not {type(value).__name__}"
        )
    chosen = {_one_of(state, what, allowed) for state in value}
    if not chosen:
        raise _errors.InvalidInput(f"{what} names no {noun}: pass None for any")
    return tuple(state for state in allowed if state in chosen)


def listing_order(value: object) -> bool:
    """True for "newest" (first), False for "oldest"."""
    return _one_of(value, "order", ("newest", "oldest")) == "newest"


#: The case folding of a search: ASCII letters only, as SQLite's lower() folds and as the
#: PostgreSQL dialect folds with translate(), so that a match never depends on a build's
#: Unicode support or on a server's locale (other letters match as written).
ASCII_UPPER: Final = string.ascii_uppercase
ASCII_LOWER: Final = string.ascii_lowercase
_FOLD: Final = str.maketrans(ASCII_UPPER, ASCII_LOWER)


def search_text(value: object, what: str) -> str | None:
    """None, or a non-empty text to look for, its ASCII letters lower-cased: the match
    ignores the case of ASCII letters (see `ASCII_UPPER`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _errors.InvalidType(f"{what} must be a str, not {type(value).__name__}")
    if not value or len(value) > MAX_ERROR_LENGTH:
        raise _errors.InvalidInput(f"{what} must be 1 to {MAX_ERROR_LENGTH} characters")
    return storable_text(value, what).translate(_FOLD)


def lock_file_apart(
    path: pathlib.Path, database: pathlib.Path | None, archive: pathlib.Path | None
) -> None:
    """InvalidInput when a lock file given (``lock_path``) is one of the store's own: its
    database, a file of the store's beside it (``-wal``, ``-shm``, ``-writers``, the
    writers' board and its files), or its archive's (the archive, ``.1``, ``.lock``): the
    lock's holder line is written over the file, a descriptor of the database opened and
    closed in this process drops the SQLite locks the process holds on it, and the
    archive's lock, held by the drain, held its own purge up for ever. By name, and, for
    a file that exists, by the file itself (a hard link to one of them; another spelling
    of its name on a file system that ignores case)."""
    own: list[pathlib.Path] = []
    if archive is not None:
        own += [archive.with_name(archive.name + suffix) for suffix in ("", ".1", ".lock")]
    board = ""
    if database is not None:
        suffixes = ("", "-wal", "-shm", "-journal", "-writers")
        own += [database.with_name(database.name + suffix) for suffix in suffixes]
        board = database.name + "-combine"  # (the writers' board, and its files: -<slot>...)
    if path in own or (
        database is not None
        and path.parent == database.parent
        and (path.name == board or path.name.startswith(board + "-"))
    ):
        raise _own_file(path)
    try:
        found = os.stat(path)
    except OSError:
        return  # not there yet: the lock makes a file of its own
    if not stat.S_ISREG(found.st_mode):  # a directory, a device, the writers' wake pipes
        raise _errors.InvalidInput(
            f"lock_path {path} is not a regular file: name a file of the lock's own"
        )
    if not found.st_ino:
        return  # a file system that numbers no file (some FUSE mounts): by name alone
    if database is not None:
        own.append(database.with_name(board))  # (its slots' files: by name above)
    for name in own:
        try:
            theirs = os.stat(name)
        except OSError:
            continue
        if (theirs.st_dev, theirs.st_ino) == (found.st_dev, found.st_ino):
            raise _own_file(path)


def _own_file(path: pathlib.Path) -> _errors.InvalidInput:
    return _errors.InvalidInput(
        f"lock_path {path} is the store's own file: name a file of the lock's own"
    )


def strict_json(text: str) -> Any:
    """``text`` read as JSON, and JSON alone: ValueError for NaN and the infinities
    (Python's json reads them; JSON has none, nor has any payload), for a number too
    large for a float, and for nesting too deep to read (no payload either)."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _not_json(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def encode_payload(payload: object, max_bytes: int) -> str:
    """Serialise a payload to compact JSON, refusing anything that would not round-trip.

    A payload is a JSON object: a dict (or, at its top, any mapping: a TypedDict's, a
    ``MappingProxyType``) with str keys whose values are None, bool, int, finite float,
    str, list or dict, nested the same way. Anything else (a datetime, a set, a tuple that
    would come back as a list, an int key that would come back as a str, NaN, a lone
    surrogate, nesting past `MAX_JSON_DEPTH`) is refused rather than silently changed or
    left to fail later.
    """
    if not isinstance(payload, dict):
        if not isinstance(payload, Mapping):
            raise _errors.InvalidPayload(
                f"payload must be a JSON object (a dict), not {type(payload).__name__}"
            )
        payload = dict(payload)
    return _encode_json(payload, "payload", max_bytes)


def encode_result(result: object, max_bytes: int) -> str:
    """A result: any JSON value (as for payloads, but not only objects), compact JSON."""
    return _encode_json(result, "result", max_bytes)


def _encode_json(value: object, what: str, max_bytes: int) -> str:
    try:
        _check_json_value(value, what, 1)
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        # Within MAX_JSON_DEPTH, yet the caller's own stack is nearly full.
        raise _errors.InvalidPayload(
            f"{what} is nested too deeply to encode from this call stack"
        ) from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        _find_surrogate(value, what)  # raises, naming where
        raise  # pragma: no cover - json.dumps only writes what it was given
    if size > max_bytes:
        raise _errors.InvalidPayload(
            f"{what} is {size} bytes of JSON, more than the limit of {max_bytes} bytes"
        )
    return text


def _check_json_value(value: Any, where: str, depth: int) -> None:
    # Exact type checks on the hot scalar path; containers recurse, one level each.
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return
    if kind is int:
        if -_INT_BOUND < value < _INT_BOUND:
            return
        raise _errors.InvalidPayload(
            f"{where} is an int of more than {MAX_INT_DIGITS} digits, which not every "
            "reader can decode"
        )
    if kind is float:
        if not math.isfinite(value):
            raise _errors.InvalidPayload(f"{where} is {value!r}: NaN and infinity are not JSON")
        return
    if depth > MAX_JSON_DEPTH and isinstance(value, (dict, list)):
        root = where.split("[", 1)[0]  # the whole path would be as long as the nesting
        raise _errors.InvalidPayload(f"{root} is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, dict):
        for key, inner in value.items():
            if type(key) is not str:
                raise _errors.InvalidPayload(
                    f"{where} has a key of type {type(key).__name__}: JSON keys are str"
                )
            _check_json_value(inner, f"{where}[{key!r}]", depth + 1)
        return
    if kind is list:
        for index, inner in enumerate(value):
            _check_json_value(inner, f"{where}[{index}]", depth + 1)
        return
    raise _errors.InvalidPayload(
        f"{where} is a {kind.__name__}, which is not a JSON value "
        "(use None, bool, int, float, str, list or dict)"
    )


def _find_surrogate(value: Any, where: str) -> None:
    """Raise InvalidPayload naming the first string (or key) that cannot be encoded."""
    if isinstance(value, str):
        try:
            storable_text(value.replace("\x00", ""), where)
        except _errors.InvalidInput as exc:
            raise _errors.InvalidPayload(str(exc)) from None
    elif isinstance(value, dict):
        for key, inner in value.items():
            _find_surrogate(key, f"a key of {where}")
            _find_surrogate(inner, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            _find_surrogate(inner, f"{where}[{index}]")


def priority(value: object) -> int:
    """A priority: an int (higher is claimed first), within 32 bits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _errors.InvalidType(f"priority must be an int, not {type(value).__name__}")
    if not -(2**31) <= value < 2**31:
        raise _errors.InvalidInput(f"priority must fit in 32 bits, got {shown(value)}")
    return value


def service_class(value: object) -> str:
    """ "standard" or "realtime"."""
    return _one_of(value, "service class", _models.SERVICE_CLASSES)


def instant(value: object, what: str) -> float | None:
    """None, or an absolute time: an aware datetime, or seconds since the Unix epoch."""
    if value is None:
        return None
    given = value
    if isinstance(value, dt.datetime):
        try:  # Python's own test of awareness: a tzinfo whose offset is None is naive too
            seconds = None if value.utcoffset() is None else value.timestamp()
            if seconds is not None and seconds >= MAX_EPOCH_SECONDS:
                # Its last microseconds round up to the year 10000 as a float (whose
                # steps are 30 µs there): one still in 9999 in UTC is its last float.
                value.astimezone(dt.timezone.utc)  # OverflowError past 9999
                seconds = math.nextafter(MAX_EPOCH_SECONDS, 0.0)
        except Exception as exc:  # the caller's tzinfo failed, or the time is out of range
            raise _errors.InvalidInput(f"{what} is not a representable time: {exc}") from exc
        if seconds is None:
            raise _errors.InvalidInput(
                f"{what} must be an aware datetime (with tzinfo); a naive one is ambiguous"
            )
        value = seconds
    number = _number(value, what, "an aware datetime or epoch seconds")
    if not math.isfinite(number) or not 0 <= number < MAX_EPOCH_SECONDS:
        raise _errors.InvalidInput(f"{what} is not a representable time: {shown(given)}")
    return number


def optional_positive_int(value: object, what: str) -> int | None:
    """None, or a positive int."""
    return None if value is None else positive_int(value, what)


#: The slowest rate a limit takes, in claims a minute: one a century, so that the time
#: the next token comes stays a representable time.
MIN_PER_MINUTE = 60.0 / MAX_DURATION_SECONDS


#: The largest burst: the rules core counts a bucket's tokens in floats, exact to 2**53
#: (a larger one came back as 2**63 on PostgreSQL, past a bigint, and failed claims).
MAX_BURST = 2**53


def burst_value(value: object) -> int | None:
    """None, or a positive int of at most `MAX_BURST` claims at once."""
    if value is None:
        return None
    number = positive_int(value, "burst")
    if number > MAX_BURST:
        raise _errors.InvalidInput(f"burst must be at most {MAX_BURST} (2**53), got {number}")
    return number


def per_minute(value: object) -> float:
    """A rate: a finite number of claims a minute, from one a century to a million a
    second."""
    number = _number(value, "per_minute", "an int or float")
    if not math.isfinite(number) or not MIN_PER_MINUTE <= number <= 60e6:
        raise _errors.InvalidInput(
            "per_minute must be at least one a century "
            f"({MIN_PER_MINUTE:.3g}) and at most 60000000, got {shown(value)}"
        )
    return number


def limit_changes(
    max_running: object, per_minute_value: object, burst: object
) -> tuple[tuple[str, int | float | None], ...]:
    """What set_limits changes: each keyword given (``...``: left as it is), checked; None
    clears a limit."""
    changes: list[tuple[str, int | float | None]] = []
    if max_running is not ...:
        changes.append(("max_running", optional_positive_int(max_running, "max_running")))
    if per_minute_value is not ...:
        rate = None if per_minute_value is None else per_minute(per_minute_value)
        changes.append(("per_minute", rate))
    if burst is not ...:
        changes.append(("burst", burst_value(burst)))
    if not changes:
        raise _errors.InvalidInput("set_limits needs max_running=, per_minute= or burst=")
    return tuple(changes)


def catch_up(value: object) -> str:
    """What a schedule does with missed ticks: "latest", "all" or "none"."""
    return _one_of(value, "catch_up", _schedule.CATCH_UP)


def fingerprint(value: object) -> str | None:
    """None, or a fingerprint: a non-empty printable str of at most 256 characters."""
    return None if value is None else text_id(value, "fingerprint")


def delay(value: object, what: str) -> float:
    """A delay: finite seconds, zero or more, at most MAX_LEASE_SECONDS."""
    number = _number(value, what, "an int or float")
    if not math.isfinite(number) or not 0 <= number <= MAX_LEASE_SECONDS:
        raise _errors.InvalidInput(
            f"{what} must be between 0 and a year of seconds, got {shown(value)}"
        )
    return number


def error_text(value: object, what: str = "error") -> str | None:
    """None, or an error description (``what``: a cancel's reason, say) of at most
    MAX_ERROR_LENGTH characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _errors.InvalidType(f"{what} must be a str, not {type(value).__name__}")
    if len(value) > MAX_ERROR_LENGTH:
        raise _errors.InvalidInput(
            f"{what} is {len(value)} characters, more than {MAX_ERROR_LENGTH}; shorten it"
        )
    return storable_text(value, what)


def boolean(value: object, what: str) -> bool:
    """A real bool (1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise _errors.InvalidType(f"{what} must be a bool, not {type(value).__name__}")
    return value


def identity(value: object) -> tuple[str, ...]:
    """The identity keys: a sequence of distinct payload keys (empty or None: none)."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise _errors.InvalidType("identity must be a list or tuple of payload keys")
    keys = tuple(text_id(key, "identity key") for key in value)
    if len(set(keys)) != len(keys):
        raise _errors.InvalidInput(f"identity keys repeat: {keys!r}")
    return keys


def duration(value: object, what: str) -> float:
    """A duration of zero or more: a timedelta, or seconds (at most a century)."""
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    number = _number(value, what, "a timedelta or seconds")
    if not math.isfinite(number) or not 0 <= number <= MAX_DURATION_SECONDS:
        raise _errors.InvalidInput(
            f"{what} must be zero or more, and at most a century, got {shown(value)}"
        )
    return number


def absolute_path(value: object, what: str) -> pathlib.Path:
    """A str or PathLike, made absolute now (so a later chdir cannot move it), as given:
    a name that stands for itself (an import's source, whose name keys what it imported)."""
    import pathlib  # on first use: see "What importing asyncplane loads"

    return pathlib.Path(os.path.abspath(path_text(value, what)))


def resolved_path(value: object, what: str) -> pathlib.Path:
    """A str or PathLike, made absolute now, with its symbolic links resolved as the
    kernel resolves them (``link/..`` is the link target's parent, not the link's): every
    name of one file comes to one path, so what is named after it (SQLite's -wal and -shm,
    the write queue, the board, a drain's lock, an archive's lock) is one set, whatever
    name each process was given."""
    import pathlib  # on first use: see "What importing asyncplane loads"

    return pathlib.Path(os.path.realpath(path_text(value, what)))


def path_text(value: object, what: str) -> str:
    """A file name given as a str or a PathLike of str: not empty, no NUL, and one the
    file system can be given (a lone surrogate that ``surrogateescape`` did not make is
    refused; one it made is a legitimate undecodable byte of a POSIX name)."""
    if not isinstance(value, (str, os.PathLike)):
        raise _errors.InvalidType(f"{what} must be a str or PathLike, not {type(value).__name__}")
    try:
        text = os.fspath(value)
    except Exception as exc:  # a PathLike whose __fspath__ raises
        raise _errors.InvalidType(f"{what}: its __fspath__ failed: {exc!r}") from None
    if not isinstance(text, str):
        raise _errors.InvalidType(f"{what} must be a str path, not {type(text).__name__}")
    if not text:
        raise _errors.InvalidInput(f"{what} must not be empty")
    if "\x00" in text:  # no file name can hold one
        raise _errors.InvalidInput(f"{what} must not contain NUL characters")
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        raise _errors.InvalidInput(
            f"{what} holds a character no file name can: {shown(text)}"
        ) from None
    return text


def read_connections(value: object) -> int:
    """How many read connections a store keeps: 1 to MAX_READ_CONNECTIONS."""
    count = positive_int(value, "read_connections")
    if count > MAX_READ_CONNECTIONS:
        raise _errors.InvalidInput(
            f"read_connections must be at most {MAX_READ_CONNECTIONS}, got {shown(count)}"
        )
    return count


def callback(value: object, what: str) -> Any:
    """None, or something callable (a progress callback, say)."""
    if value is not None and not callable(value):
        raise _errors.InvalidType(f"{what} must be callable, not {type(value).__name__}")
    return value


def megabytes(value: object, what: str) -> int:
    """A positive size in MiB (int or float), returned in bytes (at least one: a size
    that came to none would rotate the archive at every append)."""
    number = _number(value, what, "a number of MiB")
    if not math.isfinite(number) or not 1 <= number * 1024 * 1024 <= 1024**4:
        raise _errors.InvalidInput(
            f"{what} must be a positive number of MiB (at least a byte), got {shown(value)}"
        )
    return int(number * 1024 * 1024)


def _number(value: object, what: str, expected: str) -> float:
    """An int or float (bool excluded) as a float; an int too large for one is out of range
    (InvalidInput), like any other number past a limit."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _errors.InvalidType(f"{what} must be {expected}, not {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise _errors.InvalidInput(
            f"{what} is out of range: an int too large for any time, duration or size"
        ) from None


def shown(value: object) -> str:
    """``value`` for an error message: its repr, cut short; an int too long to print (past
    the interpreter's int-to-str limit) by its size, so the message itself cannot fail."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__: the message must not fail
        return f"a {type(value).__name__} that cannot be shown"
    return text if len(text) <= 80 else text[:77] + "..."


def callable_problem(handle: object, takes: str) -> str | None:
    """Why ``handle`` cannot be a handler or an executor (None: it can), checked before
    anything runs: it must be callable with one argument (``takes``: the claim, the
    batch), and not a class (calling that makes an
    instance). One that is plainly not async is refused too (it would do its work, then
    fail to be awaited, on every attempt): a plain ``def``, an object whose ``__call__``
    is one, a partial of one, with no coroutine function anywhere along its wrappers. A
    lambda, or a compiled callable, shows what it returns only when called: a call that
    gives no awaitable retries its item (`_work._handled`, `_drain`)."""
    if inspect.isclass(handle) or not callable(handle):
        return f"got {type(handle).__name__} {handle!r}"[:200]
    layers = _layers(handle)
    if any(inspect.isasyncgenfunction(layer) for layer in layers):
        return f"{handle!r} is an async generator (it yields), not an async def"[:200]
    if not any(inspect.iscoroutinefunction(layer) for layer in layers):
        plain = [layer for layer in layers if inspect.isfunction(layer)]
        if plain and plain[-1].__name__ != "<lambda>":  # (a lambda may return a coroutine)
            return f"{handle!r} is a plain def, not an async def"[:200]
    try:
        inspect.signature(handle).bind(None)
    except TypeError:
        return f"{handle!r} cannot be called with one argument, {takes}"[:200]
    except ValueError:  # no signature to read (a builtin): it is called and answers then
        pass
    return None


def _layers(handle: object) -> list[object]:
    """``handle`` and what it wraps: a partial's function, a bound method's, an object's
    ``__call__``, each ``__wrapped__`` (functools.wraps) in turn."""
    layers: list[object] = []
    found: object = handle
    while found is not None and len(layers) < 32 and not any(found is x for x in layers):
        layers.append(found)
        if isinstance(found, functools.partial):
            found = found.func
        elif inspect.ismethod(found):
            found = found.__func__
        elif not inspect.isroutine(found) and callable(found):
            found = getattr(type(found), "__call__", None)  # noqa: B004 - its own, not callable()
        else:
            found = getattr(found, "__wrapped__", None)
    return layers
