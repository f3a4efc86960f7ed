"""Argument checks, run before anything is sent to the writer.

Every public call validates its arguments here first, so bad input is refused with a
typed error (InvalidInput/InvalidPayload are ValueErrors, InvalidType is a TypeError)
before a transaction is opened: a refused call writes nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import pathlib
from typing import Any

from asyncplane import _errors, _models

__all__ = (
    "MAX_BUSY_TIMEOUT",
    "MAX_EPOCH_SECONDS",
    "MAX_ERROR_LENGTH",
    "MAX_ID_LENGTH",
    "MAX_INT",
    "MAX_LEASE_SECONDS",
    "absolute_path",
    "boolean",
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
    "optional_positive_int",
    "positive_int",
    "priority",
    "project_status",
    "seconds",
    "service_class",
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
#: Times beyond this (year 9999) are refused: they could not be shown as datetimes.
MAX_EPOCH_SECONDS = 253402300799.0
#: Longest error description kept with an item, in characters.
MAX_ERROR_LENGTH = 16 * 1024


def text_id(value: object, what: str) -> str:
    """A non-empty, printable string id of bounded length (project, owner, actor)."""
    if not isinstance(value, str):
        raise _errors.InvalidType(f"{what} must be a str, not {type(value).__name__}")
    if not value.strip():
        raise _errors.InvalidInput(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise _errors.InvalidInput(f"{what} is longer than {MAX_ID_LENGTH} characters")
    if not value.isprintable():
        raise _errors.InvalidInput(f"{what} must not contain control characters: {value!r}")
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
    if "\x00" in value:  # PostgreSQL text cannot hold it; refused on every backend
        raise _errors.InvalidInput("name must not contain NUL characters")
    return value


def item_id(value: object) -> int:
    """A positive int item id (bool is refused: True is not an id)."""
    return positive_int(value, "item_id")


def positive_int(value: object, what: str) -> int:
    """A positive int that fits SQLite's 64-bit integers, bool excluded."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _errors.InvalidType(f"{what} must be an int, not {type(value).__name__}")
    if value < 1:
        raise _errors.InvalidInput(f"{what} must be positive, got {value}")
    if value > MAX_INT:
        raise _errors.InvalidInput(f"{what} must be at most {MAX_INT}, got {value}")
    return value


def lease_seconds(value: object) -> float:
    """A lease length: positive, and at most MAX_LEASE_SECONDS."""
    return seconds(value, "lease_seconds", MAX_LEASE_SECONDS)


def seconds(value: object, what: str, most: float) -> float:
    """A finite number of seconds in (0, most] (int or float, bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _errors.InvalidType(f"{what} must be an int or float, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise _errors.InvalidInput(f"{what} must be positive and finite, got {value!r}")
    if number > most:
        raise _errors.InvalidInput(f"{what} must be at most {most:g} seconds, got {value!r}")
    return number


def finish_status(value: object) -> str:
    """One of the terminal statuses finish() accepts."""
    return _one_of(value, "status", _models.FINISH_STATUSES)


def project_status(value: object) -> str:
    """One of the project statuses; only "open" projects hand out claims."""
    return _one_of(value, "project status", _models.PROJECT_STATUSES)


def _one_of(value: object, what: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise _errors.InvalidType(f"{what} must be a str, not {type(value).__name__}")
    if value not in allowed:
        choices = ", ".join(repr(s) for s in allowed)
        raise _errors.InvalidInput(f"unknown {what} {value!r}: expected one of {choices}")
    return value


def encode_payload(payload: object, max_bytes: int) -> str:
    """Serialise a payload to compact JSON, refusing anything that would not round-trip.

    A payload is a JSON object: a dict with str keys whose values are None, bool, int,
    finite float, str, list or dict, nested the same way. Anything else (a datetime, a
    set, a tuple that would come back as a list, an int key that would come back as a str,
    NaN) is refused rather than silently changed.
    """
    if not isinstance(payload, dict):
        raise _errors.InvalidPayload(
            f"payload must be a JSON object (a dict), not {type(payload).__name__}"
        )
    try:
        _check_json_value(payload, "payload")
    except RecursionError:
        raise _errors.InvalidPayload("payload is nested too deeply") from None
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise _errors.InvalidPayload(
            f"payload is {size} bytes of JSON, more than the limit of {max_bytes} bytes"
        )
    return text


def _check_json_value(value: Any, where: str) -> None:
    # Exact type checks on the hot scalar path; containers recurse.
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return
    if kind is float:
        if not math.isfinite(value):
            raise _errors.InvalidPayload(f"{where} is {value!r}: NaN and infinity are not JSON")
        return
    if isinstance(value, dict):
        for key, inner in value.items():
            if type(key) is not str:
                raise _errors.InvalidPayload(
                    f"{where} has a key of type {type(key).__name__}: JSON keys are str"
                )
            _check_json_value(inner, f"{where}[{key!r}]")
        return
    if kind is list:
        for index, inner in enumerate(value):
            _check_json_value(inner, f"{where}[{index}]")
        return
    raise _errors.InvalidPayload(
        f"{where} is a {kind.__name__}, which is not a JSON value "
        "(use None, bool, int, float, str, list or dict)"
    )


def priority(value: object) -> int:
    """A priority: an int (higher is claimed first), within 32 bits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _errors.InvalidType(f"priority must be an int, not {type(value).__name__}")
    if not -(2**31) <= value < 2**31:
        raise _errors.InvalidInput(f"priority must fit in 32 bits, got {value}")
    return value


def service_class(value: object) -> str:
    """ "standard" or "realtime"."""
    return _one_of(value, "service class", _models.SERVICE_CLASSES)


def instant(value: object, what: str) -> float | None:
    """None, or an absolute time: an aware datetime, or seconds since the Unix epoch."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise _errors.InvalidInput(
                f"{what} must be an aware datetime (with tzinfo); a naive one is ambiguous"
            )
        value = value.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _errors.InvalidType(
            f"{what} must be an aware datetime or epoch seconds, not {type(value).__name__}"
        )
    number = float(value)
    if not math.isfinite(number) or not 0 <= number < MAX_EPOCH_SECONDS:
        raise _errors.InvalidInput(f"{what} is not a representable time: {value!r}")
    return number


def optional_positive_int(value: object, what: str) -> int | None:
    """None, or a positive int."""
    return None if value is None else positive_int(value, what)


def fingerprint(value: object) -> str | None:
    """None, or a fingerprint: a non-empty printable str of at most 256 characters."""
    return None if value is None else text_id(value, "fingerprint")


def delay(value: object, what: str) -> float:
    """A delay: finite seconds, zero or more, at most MAX_LEASE_SECONDS."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _errors.InvalidType(f"{what} must be an int or float, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or not 0 <= number <= MAX_LEASE_SECONDS:
        raise _errors.InvalidInput(f"{what} must be between 0 and a year of seconds, got {value!r}")
    return number


def error_text(value: object) -> str | None:
    """None, or an error description of at most MAX_ERROR_LENGTH characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _errors.InvalidType(f"error must be a str, not {type(value).__name__}")
    if len(value) > MAX_ERROR_LENGTH:
        raise _errors.InvalidInput(
            f"error is {len(value)} characters, more than {MAX_ERROR_LENGTH}; shorten it"
        )
    if "\x00" in value:  # PostgreSQL text cannot hold it; refused on every backend
        raise _errors.InvalidInput("error must not contain NUL characters")
    return value


def encode_result(result: object, max_bytes: int) -> str:
    """A result: any JSON value (as for payloads, but not only objects), compact JSON."""
    try:
        _check_json_value(result, "result")
    except RecursionError:
        raise _errors.InvalidPayload("result is nested too deeply") from None
    text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise _errors.InvalidPayload(
            f"result is {size} bytes of JSON, more than the limit of {max_bytes} bytes"
        )
    return text


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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _errors.InvalidType(
            f"{what} must be a timedelta or seconds, not {type(value).__name__}"
        )
    number = float(value)
    if not math.isfinite(number) or not 0 <= number <= 100 * 366 * 24 * 3600.0:
        raise _errors.InvalidInput(f"{what} must be zero or more, and finite, got {value!r}")
    return number


def absolute_path(value: object, what: str) -> pathlib.Path:
    """A str or PathLike, made absolute now (so a later chdir cannot move it)."""
    if not isinstance(value, (str, os.PathLike)):
        raise _errors.InvalidType(f"{what} must be a str or PathLike, not {type(value).__name__}")
    text = os.fspath(value)
    if not text:
        raise _errors.InvalidInput(f"{what} must not be empty")
    return pathlib.Path(os.path.abspath(text))


def megabytes(value: object, what: str) -> int:
    """A positive size in MiB (int or float), returned in bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _errors.InvalidType(f"{what} must be a number of MiB, not {type(value).__name__}")
    if not math.isfinite(value) or not 0 < value <= 1024 * 1024:
        raise _errors.InvalidInput(f"{what} must be a positive number of MiB, got {value!r}")
    return int(value * 1024 * 1024)
