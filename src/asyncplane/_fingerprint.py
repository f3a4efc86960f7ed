"""Content fingerprints: the identity that deduplication compares.

A fingerprint is the SHA-256 hex digest of a tuple of fields. Each field is UTF-8
encoded and prefixed with its length, so no choice of delimiter inside a field can make
two different tuples hash alike (("a|b", "c") and ("a", "b|c") differ). A missing field
(None) has its own marker, distinct from the empty string.

A store configured with ``identity`` (payload keys) derives an item's fingerprint from
those payload fields: strings as they are, any other JSON value as canonical JSON; a
payload with none of those keys gets no fingerprint. The
keys are the user's choice of "what makes two pieces of work the same answer": fields that
only choose the executor (a model, a lane) are left out of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from asyncplane import _errors

__all__ = ("backfill", "fingerprint", "from_payload", "from_stored")

_MISSING = b"\xff" * 8  # never a length prefix: lengths are below 2**63


def fingerprint(*fields: str | None) -> str:
    """The SHA-256 hex digest of ``fields``, each UTF-8 encoded and length-prefixed.

    Args:
        *fields: The fields that identify the work; None marks a missing field.

    Returns:
        64 lowercase hex characters.
    """
    import hashlib  # on first use: only stores with an identity, or callers, fingerprint

    digest = hashlib.sha256()
    for field in fields:
        if field is None:
            digest.update(_MISSING)
            continue
        if not isinstance(field, str):
            raise _errors.InvalidType(
                f"fingerprint fields are str or None, not {type(field).__name__}"
            )
        try:
            data = field.encode("utf-8")
        except UnicodeEncodeError:
            raise _errors.InvalidInput(
                f"fingerprint field {field!r} holds a lone surrogate, which has no UTF-8 form"
            ) from None
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def from_payload(payload: Mapping[str, Any], identity: Sequence[str]) -> str | None:
    """The fingerprint of a payload's ``identity`` fields; None if it has none of them.

    A payload with none of the identity keys says nothing about its content's identity,
    so it gets no fingerprint (and is never deduplicated) rather than one shared by every
    such payload.
    """
    if not any(key in payload for key in identity):
        return None
    return fingerprint(*(_field(payload.get(key)) for key in identity))


def from_stored(payload_json: str, identity: Sequence[str]) -> str | None:
    """`from_payload` of a stored payload's JSON; None if this process cannot decode it.

    The preflight backfills fingerprints of items written without one. A payload written
    before today's limits (too deep, or an int too long for this interpreter) must not
    stop that pass: it simply stays without a fingerprint.
    """
    try:
        payload = json.loads(payload_json)
    except (ValueError, RecursionError):
        return None
    return from_payload(payload, identity) if isinstance(payload, dict) else None


def backfill(
    rows: Sequence[Any], after: int, chunk: int, identity: Sequence[str], end: int | None = None
) -> tuple[list[tuple[str, int]], int, int]:
    """One step of the preflight's backfill of items written without a fingerprint.

    ``rows`` are the stored ``(item_id, payload_json)`` its look found after the mark
    ``after`` (at most ``chunk``, in id order, none running). ``end`` is the table's last
    id in the look's snapshot, when the backend can tell that no item below it is still
    to come. Returns ``(fingerprint, item_id)`` for each row that gets one (a payload
    with no identity field, or that this process cannot decode, gets none and is not
    written), where the next look starts, and how many rows were seen. The mark moves
    past the rows seen, and to ``end`` when the look reached it (fewer rows than a
    chunk). An item running as the look passed it is left to a full pass.
    """
    found = ((from_stored(payload, identity), item_id) for item_id, payload in rows)
    writes = [(value, int(item_id)) for value, item_id in found if value is not None]
    mark = int(rows[-1][0]) if rows else after
    if end is not None and len(rows) < chunk:
        mark = max(mark, int(end))
    return writes, mark, len(rows)


def _field(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
