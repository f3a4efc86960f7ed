"""What a probe worker tells its coordinator: one typed message per stdout line.

The worker (`asyncplane._probe_worker`) writes each message as one JSON line with a
``kind``; the coordinator (`asyncplane.probe`) reads them back as the same classes, so
the two sides agree on one schema instead of on string keys. A line cut short by a kill
reads as nothing (`decode` returns None).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, TypeAlias

__all__ = (
    "PARENT_VARIABLE",
    "STORE_FAILED",
    "STORE_VARIABLE",
    "Claimed",
    "Finished",
    "FinishedMany",
    "Message",
    "Ready",
    "Reported",
    "Summary",
    "decode",
    "encode",
)


#: Where the probe gives a worker its store: a URL's password stays off the process list
#: (a process's environment is its owner's to read; its command line is everyone's).
STORE_VARIABLE = "ASYNCPLANE_PROBE_STORE"
#: The probe's process id, given to each worker it starts: a worker dies with it.
PARENT_VARIABLE = "ASYNCPLANE_PROBE_PARENT"
#: A worker's exit status when its store failed under it (a full disk, a server gone):
#: the probe then says the store failed (its own status 3), not that items were lost.
STORE_FAILED = 3


@dataclasses.dataclass(frozen=True)
class Ready:
    """The worker opened the store and waits for its go line."""

    name: str
    #: The event loop the worker runs on: "uvloop" or "asyncio" (`asyncplane._loops`);
    #: "" from a worker that did not say.
    event_loop: str = ""


@dataclasses.dataclass(frozen=True)
class Finished:
    """The worker finished an item at this fence (the store acknowledged it)."""

    item: int
    fence: int


@dataclasses.dataclass(frozen=True)
class FinishedMany:
    """The items (``[item, fence]`` pairs) the worker finished in one turn of its event
    loop, each acknowledged by the store: one line for a round's worth."""

    items: list[list[int]]


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A holding worker claimed an item and now waits, holding it."""

    item: int
    fence: int
    lease_expires_at: float


@dataclasses.dataclass(frozen=True)
class Reported:
    """A holding worker reported late: its finish was accepted, or refused by the fence."""

    outcome: Literal["finished", "fence_rejected"]
    item: int
    fence: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """The worker's totals, its last message."""

    name: str
    claimed: int
    finished: int
    locked: int
    fence_rejected: int
    max_lock_wait: float
    #: CPU seconds (user + system, every thread) from the go line to the summary.
    cpu_s: float = 0.0
    #: The 99th percentile of the worker's claim latencies, in seconds.
    claim_p99: float = 0.0
    #: Seconds the worker's writer held SQLite's write lock, summed (0 on PostgreSQL).
    lock_held: float = 0.0


Message: TypeAlias = Ready | Finished | FinishedMany | Claimed | Reported | Summary

_KINDS: dict[str, type[Message]] = {
    cls.__name__.lower(): cls for cls in (Ready, Finished, FinishedMany, Claimed, Reported, Summary)
}


def encode(message: Message) -> str:
    """One JSON line (without its newline) for ``message``."""
    fields = vars(message)  # flat dataclasses: no deep copy needed
    return json.dumps({"kind": type(message).__name__.lower(), **fields}, separators=(",", ":"))


def decode(line: str | bytes) -> Message | None:
    """The message on a line, or None for a line that is not one (cut short by a kill)."""
    try:
        fields: Any = json.loads(line)
        cls = _KINDS[fields.pop("kind")]
        return cls(**fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
