"""asyncplane: a durable work store for asyncio agent fleets.

Many coroutines and processes on one machine share one SQLite file that holds their
work: a queue of items per project, an atomic claim of each item by exactly one worker,
leases whose lapse hands the item on with a higher fence, an append-only ledger of every
transition, and scope enforced by the store itself. The same store runs on PostgreSQL
for fleets that outgrow one machine (a ``postgresql://`` URL instead of a path).
"""

from asyncplane._clock import Clock, SystemClock
from asyncplane._copy import CopySummary, copy_store
from asyncplane._drain import DrainError, drain
from asyncplane._errors import (
    ArchiveError,
    AsyncplaneError,
    CommitOutcomeUnknown,
    DatabaseLocked,
    FenceRejected,
    InvalidInput,
    InvalidPayload,
    InvalidType,
    ItemCancelled,
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
from asyncplane._import import ImportSummary
from asyncplane._ledger import LEDGER_PROBLEM_KINDS, verify_ledger
from asyncplane._lock import DrainLock
from asyncplane._models import ClaimedItem, Job, LedgerProblem
from asyncplane._outcomes import Done, DrainSummary, Failed, Offload, Outcome, Park, Retry
from asyncplane._retention import PurgeSummary
from asyncplane._store import ControlStore
from asyncplane._work import Handler, work

__version__ = "0.1.0"

__all__ = (
    "LEDGER_PROBLEM_KINDS",
    "ArchiveError",
    "AsyncplaneError",
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
for _name in __all__:
    _value = globals()[_name]
    if getattr(_value, "__module__", "").startswith("asyncplane._"):
        _value.__module__ = __name__
del _name, _value
