"""asyncplane: a durable work store for asyncio agent fleets.

Many coroutines and processes on one machine share one SQLite file that holds their
work: a queue of items per project, an atomic claim of each item by exactly one worker,
leases whose lapse hands the item on with a higher fence, an append-only ledger of every
transition, and scope enforced by the store itself. The same store runs on PostgreSQL
for fleets that outgrow one machine (a ``postgresql://`` URL instead of a path).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from asyncplane._clock import Clock, SystemClock
from asyncplane._errors import (
    ArchiveError,
    AsyncplaneError,
    ClaimAfterSettleFailed,
    CommitOutcomeUnknown,
    DatabaseLocked,
    FenceRejected,
    InvalidInput,
    InvalidPayload,
    InvalidType,
    ItemCancelled,
    ItemPurged,
    MissingExtra,
    NotAnAsyncplaneDatabase,
    NotOnAsyncio,
    NotRequeueable,
    ProjectExists,
    ReadOnlyStore,
    SchemaVersionError,
    ScopeDenied,
    StorageError,
    StoreClosed,
    UnknownItem,
    UnknownProject,
    UnknownSchedule,
    WaitTimeout,
)
from asyncplane._fingerprint import fingerprint
from asyncplane._ledger import LEDGER_PROBLEM_KINDS, verify_ledger
from asyncplane._lock import DrainLock
from asyncplane._models import ClaimedItem, Job, LedgerProblem
from asyncplane._retention import PurgeSummary
from asyncplane._store import ControlStore

if _TYPE_CHECKING:  # imported on first use (see __getattr__): a store alone needs none
    from asyncplane._copy import CopySummary, copy_store
    from asyncplane._drain import DrainError, drain
    from asyncplane._import import ImportSummary
    from asyncplane._outcomes import Done, DrainSummary, Failed, Offload, Outcome, Park, Retry
    from asyncplane._work import Handler, work

__version__ = "0.1.0"

#: Public names whose modules load on first use, so that ``import asyncplane`` stays
#: light for a program that only opens a store (the runtimes and the copy are apart).
_LAZY = {
    "CopySummary": "asyncplane._copy",
    "copy_store": "asyncplane._copy",
    "DrainError": "asyncplane._drain",
    "drain": "asyncplane._drain",
    "ImportSummary": "asyncplane._import",
    "Done": "asyncplane._outcomes",
    "DrainSummary": "asyncplane._outcomes",
    "Failed": "asyncplane._outcomes",
    "Offload": "asyncplane._outcomes",
    "Outcome": "asyncplane._outcomes",
    "Park": "asyncplane._outcomes",
    "Retry": "asyncplane._outcomes",
    "Handler": "asyncplane._work",
    "work": "asyncplane._work",
}

__all__ = (
    "LEDGER_PROBLEM_KINDS",
    "ArchiveError",
    "AsyncplaneError",
    "ClaimAfterSettleFailed",
    "ClaimedItem",
    "Clock",
    "CommitOutcomeUnknown",
    "ControlStore",
    "CopySummary",
    "DatabaseLocked",
    "Done",
    "DrainError",
    "DrainLock",
    "DrainSummary",
    "Failed",
    "FenceRejected",
    "Handler",
    "ImportSummary",
    "InvalidInput",
    "InvalidPayload",
    "InvalidType",
    "ItemCancelled",
    "ItemPurged",
    "Job",
    "LedgerProblem",
    "MissingExtra",
    "NotAnAsyncplaneDatabase",
    "NotOnAsyncio",
    "NotRequeueable",
    "Offload",
    "Outcome",
    "Park",
    "ProjectExists",
    "PurgeSummary",
    "ReadOnlyStore",
    "Retry",
    "SchemaVersionError",
    "ScopeDenied",
    "StorageError",
    "StoreClosed",
    "SystemClock",
    "UnknownItem",
    "UnknownProject",
    "UnknownSchedule",
    "WaitTimeout",
    "__version__",
    "copy_store",
    "drain",
    "fingerprint",
    "verify_ledger",
    "work",
)


# Present re-exported classes and functions as asyncplane's own (in reprs, tracebacks and
# docs), as anyio does: users import them from here, never from the private modules.
def _as_ours(value: _Any) -> _Any:
    if getattr(value, "__module__", "").startswith("asyncplane._"):
        value.__module__ = __name__
    return value


for _name in __all__:
    if _name not in _LAZY:
        _as_ours(globals()[_name])
del _name


def __getattr__(name: str) -> _Any:
    """A lazily loaded public name, loaded now (and kept, so this runs once per name)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncplane' has no attribute {name!r}")
    import importlib

    loaded = importlib.import_module(module)
    for other, where in _LAZY.items():  # the module's other public names come with it
        if where == module:
            globals()[other] = _as_ours(getattr(loaded, other))
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
