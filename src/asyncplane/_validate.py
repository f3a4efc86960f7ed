"""Argument checks, run before anything is sent to the writer.

Every public call validates its arguments here first, so bad input is refused with a
typed error (InvalidInput/InvalidPayload are ValueErrors, InvalidType is a TypeError)
before a transaction is opened: a refused call writes nothing.
"""

from __future__ import annotations

import json
import math
from typing import Any

from asyncplane import _errors, _models

__all__ = (
    "MAX_BUSY_TIMEOUT",
    "MAX_ID_LENGTH",
    "MAX_INT",
    "MAX_LEASE_SECONDS",
    "encode_payload",
    "finish_status",
    "item_id",
    "lease_seconds",
    "name",
    "optional_actor",
    "positive_int",
    "project_status",
    "seconds",
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
