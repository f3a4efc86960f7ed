"""Fuzzing the whole public API with Hypothesis, on both backends.

Every call gets its arguments from two kinds of strategy. Valid ones draw what the store
must accept, boundaries included: ids of 256 characters, priorities at 32 bits, leases of
366 days, times in the years 1970 and 9999, payloads exactly 1 MiB or 100 levels deep.
Wild ones draw anything: any Python object where an id, a number or a time goes (an
object whose repr and == raise, among them); text with lone surrogates, NUL and control
characters, or just past a length limit; ints past a float's range and past
`MAX_INT_DIGITS`; NaN and infinity; naive datetimes and aware ones at the ends of their
range; payloads and results of every shape, nested past `MAX_JSON_DEPTH`. At most two
arguments of a call are wild (so the others get it past their own checks). Outcomes are
built from fuzzed arguments and settled through drain(); the constructor's options are
fuzzed too. For each call the tests assert the contract of docs/errors.md:

- the call succeeds, or raises an `AsyncplaneError` of a kind that call may raise; never
  a bare TypeError, ValueError, OverflowError, UnicodeEncodeError, RecursionError,
  KeyError, AttributeError...; with every argument valid it raises only what valid
  arguments can meet (a fence that is not current, an actor that is not assigned);
- a refused call wrote nothing: counts, projects, assignments and the item's row and
  ledger are exactly as before;
- the store still works afterwards: a normal item is enqueued, claimed and finished, and
  `verify_ledger` finds nothing.

drain() must return a summary (a DrainError would mean the store failed, and it never
does here) and leave no item claimed. Oracles check more where they can: a payload or a
result is accepted exactly when it is plain JSON within its limit, and comes back with the
same types; a clock that reads nonsense must not get its readings written; a size option
at 2**63 - 1 must not exhaust memory (checked in a subprocess with bounded memory).

Each test has one store (the ``store`` fixture, so it runs on SQLite and on PostgreSQL),
reused across its examples; every example makes its own items (and projects, where it
needs fresh ones). Run with ``--hypothesis-show-statistics`` to see, per call, how often
it succeeded and how it was refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import enum
import itertools
import json
import math
import os
import pathlib
import random
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

from asyncplane import (
    ArchiveError,
    AsyncplaneError,
    ClaimedItem,
    ControlStore,
    Done,
    DrainLock,
    DrainSummary,
    Failed,
    FenceRejected,
    InvalidInput,
    InvalidPayload,
    InvalidType,
    Job,
    Offload,
    Park,
    ProjectExists,
    Retry,
    ScopeDenied,
    StorageError,
    UnknownItem,
    UnknownProject,
    copy_store,
    drain,
    fingerprint,
    verify_ledger,
)
from asyncplane._validate import (
    MAX_EPOCH_SECONDS,
    MAX_ERROR_LENGTH,
    MAX_ID_LENGTH,
    MAX_INT,
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    MAX_LEASE_SECONDS,
)
from asyncplane.testing import ManualClock

T = TypeVar("T")

# A falsifying example may hold a megabyte of payload; showing it is fine.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

FUZZ = settings(
    max_examples=50,
    deadline=None,
    # The same examples on every run, so CI is deterministic; set ASYNCPLANE_FUZZ_RANDOM=1
    # to explore new ones (and keep what they find in Hypothesis's database).
    derandomize=not os.environ.get("ASYNCPLANE_FUZZ_RANDOM"),
    database=None if not os.environ.get("ASYNCPLANE_FUZZ_RANDOM") else settings().database,
    # No explain phase: it reruns a failure hundreds of times against a shared store.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
#: No single call may take longer than this: a hang is a failure, not a slow test.
CALL_TIMEOUT = 20.0

ACTOR = "agent-a"  # assigned to "alpha"
STRANGER = "agent-b"  # assigned to nothing
HEALTH = "health"  # the project the after-call check uses; no strategy names it
KNOWN_PROJECTS = ("alpha", "beta", "paused", "ghost")  # ghost does not exist

_SEQ = itertools.count(1)

# What each kind of call may raise, besides succeeding.
BAD_ARGUMENT = (InvalidInput, InvalidType)
REFUSALS_ON_ITEMS = (*BAD_ARGUMENT, FenceRejected, UnknownItem, ScopeDenied)
REFUSALS_ON_PROJECTS = (*BAD_ARGUMENT, UnknownProject, ScopeDenied)


# --- odd values ------------------------------------------------------------------------


class HostileError(Exception):
    """Raised by `Hostile`: if it escapes a store call, the store called into the value."""


class Hostile:
    """A value whose repr, str, format and comparisons raise.

    Validation must refuse it by its type without printing or comparing it. (Hypothesis
    shows it through ``_repr_pretty_``, which works.)
    """

    def __repr__(self) -> str:
        raise HostileError("repr")

    def __str__(self) -> str:
        raise HostileError("str")

    def __format__(self, spec: str) -> str:
        raise HostileError("format")

    def __eq__(self, other: object) -> bool:
        raise HostileError("eq")

    __hash__ = object.__hash__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text("Hostile()")


class MyStr(str):
    """A str subclass: must behave as the str it is."""

    __slots__ = ()


class MyInt(int):
    """An int subclass (not a bool)."""


class MyFloat(float):
    """A float subclass."""


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2**40


class Status(str, enum.Enum):
    DONE = "done"
    FAILED = "failed"
    OPEN = "open"


class Marker:
    """A named value no strategy draws otherwise (compared by identity only)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: Stands for the id of the item an example claimed, among fuzzed ids.
THE_ITEM = Marker("THE_ITEM")


def inside(directory: pathlib.Path, name: str) -> pathlib.Path:
    """``directory / name`` that stays in ``directory`` (a "/" would lead anywhere)."""
    return directory / str(name).replace("/", "_")


def splice(text: str, extra: str, position: int) -> str:
    position = min(position, len(text))
    return text[:position] + extra + text[position:]


# Every code point, surrogates included; the odd ones spliced in, since they are rare.
any_chars = st.characters(blacklist_categories=())
SURROGATES = ("\ud800", "\udbff", "\udc80", "\udcff", "\udfff")
ODD_CHARS = ("\x00", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\u200b", "\u2028", "\ufeff")
odd_chars = st.sampled_from(SURROGATES + ODD_CHARS)
any_text = st.text(alphabet=any_chars, max_size=12)
spiked_text = st.builds(splice, any_text, odd_chars, st.integers(0, 12))
#: Lengths at and around the limits: ids (256), errors (16384), results (64 KiB).
LENGTHS = (
    MAX_ID_LENGTH - 1,
    MAX_ID_LENGTH,
    MAX_ID_LENGTH + 1,
    MAX_ERROR_LENGTH,
    MAX_ERROR_LENGTH + 1,
    70_000,
)
long_text = st.builds(
    lambda char, length: char * length,
    st.one_of(st.just("x"), st.just("\u00e9"), st.just("\U0001f600"), any_chars),
    st.sampled_from(LENGTHS),
)
#: The strings most likely to break something, drawn often.
NASTY_TEXT = (
    "",
    " ",
    "\t\n",
    "\u3000",
    "\x00",
    "a\x00b",
    "\ud800",
    "x\udc80y",
    "\udfff",
    "\u2028",
    "\x1b[0m",
    "x" * (MAX_ID_LENGTH + 1),
)
texts = st.one_of(
    st.sampled_from(NASTY_TEXT),
    spiked_text,
    any_text,
    long_text,
    st.builds(MyStr, any_text),
)

huge_ints = st.one_of(
    st.integers(min_value=MAX_INT - 2, max_value=MAX_INT + 2),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(
        [
            2**63,
            -(2**63) - 1,
            2**1024,  # too large for a float
            -(2**1024),
            10**400,
            10**MAX_INT_DIGITS - 1,  # 640 digits: the most a payload may hold
            10**MAX_INT_DIGITS,
            -(10**MAX_INT_DIGITS),
        ]
    ),
    # Past the interpreter's int-to-str limit: built, since a strategy's repr shows its
    # constants (and this one's repr raises).
    st.builds(pow, st.just(10), st.just(5000)),
)
special_floats = st.sampled_from(
    [
        0.0,
        -0.0,
        5e-324,
        1e-300,
        math.nan,
        -math.nan,
        math.inf,
        -math.inf,
        1e308,
        -1e308,
        MAX_LEASE_SECONDS,
        MAX_LEASE_SECONDS + 1,
        MAX_EPOCH_SECONDS,
        MAX_EPOCH_SECONDS - 1,
        24 * 3600.0 + 1,
    ]
)
numbers = st.one_of(
    st.integers(min_value=-10, max_value=10**6),
    huge_ints,
    st.floats(),
    special_floats,
    st.builds(MyInt, st.integers(-5, 10**6)),
    st.builds(MyFloat, st.floats()),
    st.sampled_from(list(Level)),
)


class NoOffset(dt.tzinfo):
    """A tzinfo without an offset (Python counts its datetimes as naive)."""

    def utcoffset(self, when: dt.datetime | None) -> dt.timedelta | None:
        return None


TIMEZONES = (
    dt.timezone.utc,
    dt.timezone(dt.timedelta(hours=14)),
    dt.timezone(-dt.timedelta(hours=23, minutes=59)),
    dt.timezone(dt.timedelta(hours=5, minutes=30)),
)
datetimes = st.one_of(
    st.datetimes(),  # naive
    st.datetimes(timezones=st.one_of(st.sampled_from(TIMEZONES), st.timezones())),
    st.sampled_from(
        [
            dt.datetime.min,
            dt.datetime.max,
            dt.datetime.min.replace(tzinfo=TIMEZONES[1]),
            dt.datetime.max.replace(tzinfo=TIMEZONES[2]),
            dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc),
            dt.datetime(1969, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc),
            dt.datetime(9999, 12, 31, 23, 59, 58, tzinfo=dt.timezone.utc),
            dt.datetime(2026, 12, 5, tzinfo=NoOffset()),
        ]
    ),
)
timedeltas = st.one_of(
    st.timedeltas(),
    st.sampled_from([dt.timedelta.max, dt.timedelta.min, dt.timedelta(0), -dt.timedelta(1)]),
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=6),
    st.complex_numbers(),
    st.decimals(),
    st.fractions(),
    st.dates(),
    datetimes,
    timedeltas,
    st.tuples(st.integers()),
    st.lists(st.integers(), max_size=2),
    st.frozensets(st.integers(), max_size=2),
    st.sets(st.text(max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(Hostile),
    st.sampled_from(
        [
            object(),
            bytearray(b"alpha"),
            memoryview(b"alpha"),
            pathlib.PurePosixPath("alpha"),
            Ellipsis,
            NotImplemented,
            int,
            len,
            ("alpha",),
            ["alpha"],
        ]
    ),
)


def hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


hashable_junk = junk.filter(hashable)
#: Junk for a path argument: never a str or PathLike, which would be a relative path (and a
#: file made wherever the tests run).
path_junk = junk.filter(lambda value: not isinstance(value, (str, os.PathLike)))
#: Junk for a callback: nothing callable (a callable's own exception is the caller's).
not_callable = junk.filter(lambda value: not callable(value))


class BytesPath:
    """A PathLike whose __fspath__ gives bytes (os.fspath allows it)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = os.fsencode(path)

    def __fspath__(self) -> bytes:
        return self.path

    def __repr__(self) -> str:
        return f"BytesPath({self.path!r})"


def nasty_paths(directory: pathlib.Path) -> st.SearchStrategy[Any]:
    """Paths that are no file name, or no file this process can make: every one inside
    ``directory`` (so nothing is ever made anywhere else)."""
    return st.one_of(
        st.sampled_from(
            [
                str(directory / "surrogate\ud800.x"),  # no UTF-8 form, no surrogateescape
                str(directory / "surrogate\udc80.x"),  # surrogateescape: a valid file name
                str(directory / "nul\x00.x"),
                "",
                directory,  # a directory
                str(directory / "missing" / "file.x"),
            ]
        ),
        st.builds(BytesPath, st.just(directory / "bytes.x")),
        st.builds(lambda name: str(inside(directory, name)), texts),
        path_junk,
    )


# Ids: the known ones (so calls reach the database), any text, any object.
project_ids = st.one_of(st.sampled_from(KNOWN_PROJECTS), texts, junk)
actor_ids = st.one_of(st.sampled_from([None, ACTOR, STRANGER]), texts, junk)
owners = st.one_of(st.sampled_from(["worker-1", MyStr("worker-2")]), texts, junk)
names = st.one_of(st.sampled_from(["Project", "résumé ✓ 中文"]), texts, junk)
handles = st.one_of(st.sampled_from(["batch-1", "batch-2"]), texts, junk)
fingerprints = st.one_of(st.none(), st.sampled_from(["fp-a", "fp-b"]), texts, junk)
project_statuses = st.one_of(
    st.sampled_from(["open", "paused", "closed", Status.OPEN, "OPEN", "done"]), texts, junk
)
finish_statuses = st.one_of(
    st.sampled_from(["done", "failed", Status.DONE, Status.FAILED, "DONE", "ready"]), texts, junk
)
service_classes = st.one_of(st.sampled_from(["standard", "realtime", "Realtime"]), texts, junk)
flags = st.one_of(st.booleans(), junk)
priorities = st.one_of(
    st.integers(min_value=-(2**31) - 2, max_value=2**31 + 1),
    st.sampled_from([-(2**31), 2**31 - 1, 2**31, -(2**31) - 1]),
    numbers,
    junk,
)
#: Positive ints (limits, chunks, budgets, ids): small ones, boundaries, and the rest.
counts_like = st.one_of(
    st.integers(min_value=-3, max_value=5), st.sampled_from([MAX_INT, MAX_INT + 1]), numbers, junk
)
durations = st.one_of(numbers, timedeltas, junk)
errors = st.one_of(st.none(), texts, junk)
instants = st.one_of(st.none(), numbers, datetimes, junk)
identities = st.one_of(
    st.none(),
    st.lists(st.one_of(st.sampled_from(["task", "model"]), texts, junk), max_size=3),
    st.lists(st.sampled_from(["task", "model"]), max_size=3).map(tuple),
    texts,
    junk,
)


# --- valid values ------------------------------------------------------------------------
#
# Each argument of a call is drawn from its valid strategy (values the store must accept,
# boundaries included) or, for at most two arguments of the call, from its wild one (any
# of the above). With every argument valid, the call must work: a refusal then is a
# validation bug too, of the other kind.

utf8_chars = st.characters(codec="utf-8")  # every code point but the surrogates
storable_chars = st.characters(codec="utf-8", exclude_characters="\x00")
printable_chars = st.characters(categories=("L", "M", "N", "P", "S"), include_characters=" ")

valid_ids = st.one_of(
    st.text(printable_chars, min_size=1, max_size=24).filter(lambda text: text.strip() != ""),
    st.sampled_from(
        ["x", " padded ", "résumé ✓ 中文", "x" * MAX_ID_LENGTH, "\U0001f600" * MAX_ID_LENGTH]
    ),
    st.builds(MyStr, st.sampled_from(["x", "worker-9"])),
)
valid_names = st.one_of(
    st.text(storable_chars, min_size=1, max_size=24).filter(lambda text: text.strip() != ""),
    st.sampled_from(["tab\there", "n" * 100_000, "\U0010ffff"]),
)
valid_errors = st.one_of(
    st.none(),
    st.text(storable_chars, max_size=24),
    st.sampled_from(["e" * MAX_ERROR_LENGTH, "\u00e9" * MAX_ERROR_LENGTH]),
)
valid_project_statuses = st.sampled_from(["open", "paused", "closed", Status.OPEN])
valid_finish_statuses = st.sampled_from(["done", "failed", Status.DONE, Status.FAILED])
valid_service_classes = st.sampled_from(["standard", "realtime"])
valid_priorities = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.sampled_from([-(2**31), 2**31 - 1, MyInt(7), Level.LOW]),
)
valid_counts = st.one_of(
    st.integers(1, 5), st.sampled_from([MAX_INT, 2**31, 2**32, MyInt(2), Level.LOW])
)
valid_leases = st.one_of(
    st.floats(min_value=1e-3, max_value=MAX_LEASE_SECONDS),
    st.integers(1, int(MAX_LEASE_SECONDS)),
    st.sampled_from([5e-324, MAX_LEASE_SECONDS, 30, MyFloat(2.5)]),
)
valid_delays = st.one_of(
    st.floats(min_value=0, max_value=MAX_LEASE_SECONDS),
    st.integers(0, int(MAX_LEASE_SECONDS)),
    st.sampled_from([0, -0.0, MAX_LEASE_SECONDS]),
)
valid_instants = st.one_of(
    st.none(),
    st.floats(min_value=0, max_value=MAX_EPOCH_SECONDS - 1),
    st.integers(0, int(MAX_EPOCH_SECONDS) - 1),
    st.datetimes(
        min_value=dt.datetime(1970, 1, 2),
        max_value=dt.datetime(9999, 12, 30),
        timezones=st.one_of(st.sampled_from(TIMEZONES), st.timezones()),
    ),
)
valid_fingerprints = st.one_of(st.none(), st.sampled_from(["fp-a", "fp-b"]), valid_ids)
valid_actors = st.sampled_from([None, None, ACTOR, STRANGER])


# --- JSON values ---------------------------------------------------------------------


def nested(depth: int, kind: str) -> Any:
    """A list or dict ``depth`` levels deep (1: a flat one)."""
    value: Any = [] if kind == "list" else {}
    for _ in range(depth - 1):
        value = [value] if kind == "list" else {"k": value}
    return value


plain_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=1 - 10**MAX_INT_DIGITS, max_value=10**MAX_INT_DIGITS - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(utf8_chars, max_size=12),  # NUL included: JSON escapes it
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(utf8_chars, max_size=6), inner)
    ),
    max_leaves=12,
)
plain_payloads = st.one_of(
    st.dictionaries(st.text(utf8_chars, max_size=8), plain_values, max_size=5),
    st.just(nested(MAX_JSON_DEPTH, "dict")),
    st.just({"d": nested(MAX_JSON_DEPTH - 1, "list")}),
    st.just({"x": "a" * ((1 << 20) - 8)}),  # exactly the default limit, 1 MiB
)
plain_results = st.one_of(
    st.none(),
    plain_values,
    st.just(nested(MAX_JSON_DEPTH, "list")),
    st.just("r" * ((1 << 16) - 2)),  # exactly the default limit, 64 KiB
)

json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), huge_ints, st.floats(), special_floats, texts
)
odd_leaves = st.one_of(
    st.binary(max_size=4),
    st.complex_numbers(),
    st.decimals(allow_nan=False),
    st.datetimes(),
    st.frozensets(st.integers(), max_size=2),
    st.sets(st.integers(), max_size=2),
    st.builds(MyInt, st.integers()),
    st.builds(MyStr, any_text),
    st.builds(MyFloat, st.floats()),
    st.sampled_from(list(Level)),
    st.builds(Hostile),
    st.just(object()),
)
keys = st.one_of(
    texts,
    st.integers(),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.binary(max_size=2),
    st.tuples(st.integers()),
    st.builds(MyStr, any_text),
)
json_values = st.recursive(
    st.one_of(json_leaves, json_leaves, json_leaves, odd_leaves),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(texts, texts, keys), inner, max_size=4),
        st.tuples(inner, inner),
    ),
    max_leaves=12,
)
deep_values = st.builds(
    nested,
    st.one_of(st.integers(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 3), st.sampled_from([1000, 5000])),
    st.sampled_from(["list", "dict"]),
)
payloads = st.one_of(
    plain_payloads,
    st.dictionaries(st.one_of(texts, texts, texts, keys), json_values, max_size=5),
    st.builds(lambda deep: {"d": deep}, deep_values),
    st.builds(nested, st.integers(MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 2), st.just("dict")),
    st.just({"x": "a" * ((1 << 20) - 7)}),  # one byte past the limit
    json_values,
    junk,
)
results = st.one_of(
    plain_results,
    json_values,
    deep_values,
    st.just("r" * ((1 << 16) - 1)),  # one byte past the limit
    st.builds(lambda text: {"t": text}, long_text),
)


def plain_json(value: Any, depth: int = 1) -> bool:
    """The oracle: would ``value`` come back unchanged from any reader (docs/errors.md)?"""
    kind = type(value)
    if value is None or kind is bool:
        return True
    if kind is int:
        return abs(value) < 10**MAX_INT_DIGITS
    if kind is float:
        return math.isfinite(value)
    if kind is str:
        return encodable(value)
    if kind not in (list, dict) or depth > MAX_JSON_DEPTH:
        return False
    if kind is list:
        return all(plain_json(inner, depth + 1) for inner in value)
    return all(
        type(key) is str and encodable(key) and plain_json(inner, depth + 1)
        for key, inner in value.items()
    )


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_size(value: Any) -> int:
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return len(text.encode("utf-8"))


def same_json(got: Any, sent: Any) -> bool:
    """Equal, and of the same types all the way down (True is not 1, 1.0 is not 1)."""
    if type(got) is not type(sent):
        return False
    if isinstance(sent, list):
        return len(got) == len(sent) and all(map(same_json, got, sent))
    if isinstance(sent, dict):
        return list(got) == list(sent) and all(same_json(got[k], sent[k]) for k in sent)
    if isinstance(sent, float):
        return got == sent and math.copysign(1, got) == math.copysign(1, sent)
    return bool(got == sent)


# --- drawing a call's arguments ----------------------------------------------------------


#: Leave this argument out: the call's default.
OMIT = Marker("OMIT")


def omittable(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(OMIT), strategy)


@dataclasses.dataclass(frozen=True)
class Arg:
    """How one argument is drawn: a valid value, or (when it is chosen to be) anything;
    one without a wild strategy (which call to make, say) is never wild."""

    valid: st.SearchStrategy[Any]
    wild: st.SearchStrategy[Any] | None = None


@dataclasses.dataclass(frozen=True)
class Args:
    """One call's arguments. ``wild`` names those drawn from anything; the rest are valid."""

    wild: frozenset[str]
    values: dict[str, Any]

    @property
    def tame(self) -> bool:
        return not self.wild

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        value = self.values.get(name, OMIT)
        return default if value is OMIT else value

    def kwargs(self, *names: str) -> dict[str, Any]:
        """The named arguments that are not left out, as keyword arguments."""
        return {name: self.values[name] for name in names if self.values[name] is not OMIT}


def strategy(arg: Arg, wild: bool) -> st.SearchStrategy[Any]:
    return arg.wild if wild and arg.wild is not None else arg.valid


def arguments(max_wild: int = 2, **specs: Arg) -> st.SearchStrategy[Args]:
    """A call's arguments: every one valid, but for at most ``max_wild`` of them."""
    names = sorted(specs)
    may_be_wild = [name for name in names if specs[name].wild is not None]

    def drawn(wild: frozenset[str]) -> st.SearchStrategy[Args]:
        fields = {name: strategy(specs[name], name in wild) for name in names}
        return st.builds(Args, st.just(wild), st.fixed_dictionaries(fields))

    if not may_be_wild or max_wild == 0:
        return drawn(frozenset())
    return st.frozensets(st.sampled_from(may_be_wild), max_size=max_wild).flatmap(drawn)


# --- calling, and checking -------------------------------------------------------------


async def attempt(
    call: Awaitable[T], allowed: tuple[type[AsyncplaneError], ...]
) -> tuple[T | None, AsyncplaneError | None]:
    """Run one store call: (its value, None), or (None, the refusal) if it raised one of
    ``allowed``. Any other exception propagates and fails the test, as does a hang."""
    name = getattr(call, "__qualname__", "call")
    try:
        value = await asyncio.wait_for(call, CALL_TIMEOUT)
    except AsyncplaneError as exc:
        refused = exc
    else:
        event(f"{name}: succeeded")
        return value, None
    event(f"{name}: {type(refused).__name__}")
    return None, checked(refused, allowed)


def attempt_sync(
    call: Callable[[], T], allowed: tuple[type[AsyncplaneError], ...]
) -> tuple[T | None, AsyncplaneError | None]:
    """`attempt` for a plain function."""
    try:
        value = call()
    except AsyncplaneError as exc:
        refused = exc
    else:
        event("succeeded")
        return value, None
    event(type(refused).__name__)
    return None, checked(refused, allowed)


def checked(
    refused: AsyncplaneError, allowed: tuple[type[AsyncplaneError], ...]
) -> AsyncplaneError:
    """A refusal of one of the ``allowed`` kinds, in the right built-in families."""
    assert isinstance(refused, allowed), (
        f"refused with {type(refused).__name__}, not one of "
        f"{[kind.__name__ for kind in allowed]}: {refused}"
    )
    note(f"refused: {type(refused).__name__}: {refused}")
    if isinstance(refused, InvalidInput):
        assert isinstance(refused, ValueError)
    if isinstance(refused, InvalidType):
        assert isinstance(refused, TypeError)
    if isinstance(refused, (UnknownItem, UnknownProject)):
        assert isinstance(refused, LookupError)
    str(refused)  # a refusal's message can always be shown
    return refused


def refusals(args: Args, wild: Sequence[type[AsyncplaneError]], *legit: Any) -> Any:
    """What a call may raise: ``legit`` (refusals of valid arguments: a fence that is not
    current, an actor that may not), plus ``wild`` if any argument was drawn wild."""
    return (*legit, *wild) if args.wild else tuple(legit)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a refused call must leave exactly as it was."""

    counts: dict[str, int]
    projects: list[dict[str, Any]]
    visible: dict[str, list[str]]
    item: dict[str, Any] | None
    events: list[dict[str, Any]] | None


async def snapshot(store: ControlStore, item_id: int | None = None) -> Snapshot:
    visible = {actor: await store.visible_projects(actor) for actor in (ACTOR, STRANGER)}
    return Snapshot(
        await store.counts(),
        await store.projects(),
        visible,
        None if item_id is None else await store.item(item_id),
        None if item_id is None else await store.events(item_id),
    )


async def assert_store_works(store: ControlStore) -> None:
    """A normal item goes all the way through, and the ledger agrees with every row."""
    item_id = await store.enqueue(HEALTH, {"n": next(_SEQ)}, dedup=False)
    claim = await store.claim("health-worker", project_id=HEALTH)
    assert claim is not None and claim.item_id == item_id
    await store.finish(item_id, fence=claim.fence, result={"ok": True})
    assert (await store.item(item_id))["state"] == "done"
    assert await verify_ledger(store) == []


async def claimed_item(store: ControlStore, project: str | None = None) -> ClaimedItem:
    """A fresh item, claimed: in ``project``, or in a fresh project assigned to ACTOR
    (so nothing left by an earlier example comes first)."""
    if project is None:
        project = await fresh_project(store, "claimed")
        await store.assign(project, ACTOR)
    item_id = await store.enqueue(project, {"n": next(_SEQ)}, dedup=False)
    claim = await store.claim("worker-1", project_id=project)
    assert claim is not None and claim.item_id == item_id
    return claim


async def fresh_project(store: ControlStore, prefix: str) -> str:
    project = f"{prefix}-{next(_SEQ)}"
    await store.create_project(project, prefix.title())
    return project


@pytest.fixture
async def world(store: ControlStore) -> ControlStore:
    """The test's store: "alpha" (assigned to ACTOR), "beta", "paused", and HEALTH."""
    await store.create_project("beta", "Project Beta")
    await store.create_project("paused", "Project Paused", status="paused")
    await store.create_project(HEALTH, "Health checks")
    await store.assign("alpha", ACTOR)
    return store


# --- projects and scope ----------------------------------------------------------------


PROJECT_CALLS = arguments(
    op=Arg(
        st.sampled_from(
            ["create_project", "set_project_status", "project", "assign", "unassign", "visible"]
        )
    ),
    project_id=Arg(st.one_of(st.sampled_from(KNOWN_PROJECTS), valid_ids), project_ids),
    name=Arg(valid_names, names),
    status=Arg(valid_project_statuses, project_statuses),
    actor_id=Arg(st.sampled_from([ACTOR, STRANGER, "agent-c"]), actor_ids),
)


@FUZZ
@given(args=PROJECT_CALLS)
async def test_projects_and_scope(world: ControlStore, args: Args) -> None:
    """create_project, set_project_status, project, assign, unassign, visible_projects:
    fuzzed ids, names and statuses."""
    op, project_id, actor_id = args["op"], args["project_id"], args["actor_id"]
    call: Awaitable[Any]
    if op == "create_project":
        call = world.create_project(project_id, args["name"], status=args["status"])
        allowed = refusals(args, BAD_ARGUMENT, ProjectExists)
    elif op == "set_project_status":
        call = world.set_project_status(project_id, args["status"])
        allowed = refusals(args, BAD_ARGUMENT, UnknownProject)
    elif op == "project":
        call = world.project(project_id)
        allowed = refusals(args, BAD_ARGUMENT, UnknownProject)
    elif op == "assign":
        call = world.assign(project_id, actor_id)
        allowed = refusals(args, BAD_ARGUMENT, UnknownProject)
    elif op == "unassign":
        call = world.unassign(project_id, actor_id)
        allowed = refusals(args, BAD_ARGUMENT, UnknownProject)
    else:
        call = world.visible_projects(actor_id)
        allowed = refusals(args, BAD_ARGUMENT)
    before = await snapshot(world)
    _, refused = await attempt(call, allowed)
    after = await snapshot(world)
    if refused is not None:
        assert after == before
    elif op == "create_project":
        made = await world.project(project_id)
        assert (made["project_id"], made["name"], made["status"]) == (
            project_id,
            args["name"],
            args["status"],
        )
    elif op == "assign":
        assert project_id in await world.visible_projects(actor_id)
    elif op == "unassign":
        assert project_id not in await world.visible_projects(actor_id)
    elif op in ("project", "visible"):
        assert after == before
    await assert_store_works(world)


# --- enqueue -----------------------------------------------------------------------------


LANE_FIELDS = {
    "priority": Arg(omittable(valid_priorities), priorities),
    "service_class": Arg(omittable(valid_service_classes), service_classes),
    "sla": Arg(omittable(valid_instants), instants),
    "fingerprint": Arg(omittable(valid_fingerprints), fingerprints),
    "max_attempts": Arg(omittable(st.one_of(st.none(), valid_counts)), counts_like),
    "not_before": Arg(omittable(valid_instants), instants),
}
ENQUEUE_CALLS = arguments(
    project_id=Arg(st.sampled_from(["alpha", "alpha", "beta", "paused"]), project_ids),
    payload=Arg(plain_payloads, payloads),
    dedup=Arg(omittable(st.booleans()), flags),
    actor_id=Arg(omittable(valid_actors), actor_ids),
    **LANE_FIELDS,
)


@FUZZ
@given(args=ENQUEUE_CALLS)
async def test_enqueue(world: ControlStore, args: Args) -> None:
    """enqueue: every argument (payload, priority, service class, sla, fingerprint, dedup,
    max_attempts, not_before, actor); a new row keeps exactly what it was given."""
    project_id, payload = args["project_id"], args["payload"]
    options = args.kwargs("dedup", "actor_id", *LANE_FIELDS)
    before = await snapshot(world)
    item_id, refused = await attempt(
        world.enqueue(project_id, payload, **options),
        refusals(args, (*BAD_ARGUMENT, UnknownProject), ScopeDenied),
    )
    after = await snapshot(world)
    if refused is not None:
        assert after == before
    else:
        assert isinstance(item_id, int)
        row = await world.item(item_id)
        if sum(after.counts.values()) == sum(before.counts.values()) + 1:  # a new row
            assert row["project_id"] == project_id
            assert same_json(row["payload"], payload), row["payload"]
            assert row["priority"] == args.get("priority", 0)
            assert row["service_class"] == args.get("service_class", "standard")
            assert row["fingerprint"] == args.get("fingerprint")
            assert row["state"] in ("ready", "deferred")
        else:  # dedup: the twin's id came back, and nothing was written
            assert after == before
            fingerprint_given = args.get("fingerprint")
            assert fingerprint_given is not None and row["fingerprint"] == fingerprint_given
    await assert_store_works(world)


@FUZZ
@given(payload=payloads)
async def test_payload_accepted_exactly_when_plain_json(world: ControlStore, payload: Any) -> None:
    """No plain JSON payload within the limit is refused, no other one is accepted, and
    every accepted one comes back unchanged, from item() and from a claim."""
    valid = type(payload) is dict and plain_json(payload) and json_size(payload) <= 1 << 20
    project = await fresh_project(world, "payloads")
    before = await snapshot(world)
    item_id, refused = await attempt(world.enqueue(project, payload), (InvalidPayload,))
    if refused is not None:
        assert not valid, f"a plain JSON payload was refused: {refused}"
        assert await snapshot(world) == before
    else:
        assert valid, "a payload that does not come back unchanged was accepted"
        assert item_id is not None
        assert same_json((await world.item(item_id))["payload"], payload)
        claim = await world.claim("worker-1", project_id=project)
        assert claim is not None and same_json(claim.payload, payload)
        await world.finish(item_id, fence=claim.fence)
    await world.set_project_status(project, "closed")
    await assert_store_works(world)


@FUZZ
@given(result=results)
async def test_result_accepted_exactly_when_plain_json(world: ControlStore, result: Any) -> None:
    """The same for finish()'s result (any JSON value, at most 64 KiB); a refused result
    leaves the claim valid, so the worker can finish again."""
    valid = plain_json(result) and json_size(result) <= 1 << 16
    claim = await claimed_item(world)
    before = await snapshot(world, claim.item_id)
    _, refused = await attempt(
        world.finish(claim.item_id, fence=claim.fence, result=result), (InvalidPayload,)
    )
    if refused is not None:
        assert not valid, f"a plain JSON result was refused: {refused}"
        assert await snapshot(world, claim.item_id) == before
        await world.finish(claim.item_id, fence=claim.fence, result={"second": "try"})
    else:
        assert valid, "a result that does not come back unchanged was accepted"
        assert same_json((await world.item(claim.item_id))["result"], result)
    await assert_store_works(world)


def shaped(items: list[Any], shape: str) -> Any:
    if shape == "tuple":
        return tuple(items)
    if shape == "generator":
        return (item for item in items)
    return items


def build_job(args: Args) -> Job:
    return Job(args["payload"], **args.kwargs(*LANE_FIELDS))


valid_jobs = st.one_of(
    plain_payloads,
    arguments(max_wild=0, payload=Arg(plain_payloads), **LANE_FIELDS).map(build_job),
)
wild_jobs = st.one_of(
    payloads,
    arguments(max_wild=3, payload=Arg(plain_payloads, payloads), **LANE_FIELDS).map(build_job),
    junk,
)
ENQUEUE_MANY_CALLS = arguments(
    project_id=Arg(st.sampled_from(["alpha", "alpha", "beta"]), project_ids),
    jobs=Arg(st.lists(valid_jobs, max_size=4), st.lists(st.one_of(valid_jobs, wild_jobs))),
    shape=Arg(st.sampled_from(["list", "tuple", "generator"]), st.one_of(texts, junk)),
    dedup=Arg(omittable(st.booleans()), flags),
    actor_id=Arg(omittable(valid_actors), actor_ids),
)


@FUZZ
@given(args=ENQUEUE_MANY_CALLS)
async def test_enqueue_many(world: ControlStore, args: Args) -> None:
    """Jobs as dicts or Jobs with fuzzed fields, in a list, a tuple or a generator, or
    something that is not a collection of jobs at all (``shape`` drawn wild)."""
    shape, job_list = args["shape"], args["jobs"]
    if "shape" in args.wild:  # not a collection of jobs, or some other one
        jobs, expected = shape, len(shape) if isinstance(shape, (list, tuple, set)) else None
    else:
        jobs, expected = shaped(job_list, shape), len(job_list)
    before = await snapshot(world)
    ids, refused = await attempt(
        world.enqueue_many(args["project_id"], jobs, **args.kwargs("dedup", "actor_id")),
        refusals(args, (*BAD_ARGUMENT, UnknownProject), ScopeDenied),
    )
    after = await snapshot(world)
    if refused is not None:
        assert after == before
    else:
        assert ids is not None and expected in (None, len(ids))
        for item_id in ids:
            assert (await world.item(item_id))["project_id"] == args["project_id"]
    await assert_store_works(world)


# --- claims ------------------------------------------------------------------------------


CLAIM_CALLS = arguments(
    owner=Arg(valid_ids, owners),
    limit=Arg(omittable(valid_counts), counts_like),  # left out: claim(), else claim_batch()
    actor_id=Arg(omittable(valid_actors), actor_ids),
    project_id=Arg(omittable(st.sampled_from([None, "alpha", "beta", "ghost"])), project_ids),
    lease_seconds=Arg(omittable(st.one_of(st.none(), valid_leases)), durations),
)


@FUZZ
@given(args=CLAIM_CALLS)
async def test_claims(world: ControlStore, clock: ManualClock, args: Args) -> None:
    """claim and claim_batch: owner, limit, actor, project, lease; a claim's lease ends
    exactly lease_seconds from now."""
    item_id = await world.enqueue("alpha", {"n": next(_SEQ)}, dedup=False)
    owner, limit = args["owner"], args["limit"]
    options = args.kwargs("actor_id", "project_id", "lease_seconds")
    call = (
        world.claim(owner, **options)
        if limit is OMIT
        else world.claim_batch(owner, limit, **options)
    )
    before = await snapshot(world, item_id)
    value, refused = await attempt(
        call, refusals(args, REFUSALS_ON_PROJECTS, ScopeDenied, UnknownProject)
    )
    after = await snapshot(world, item_id)
    claims: list[ClaimedItem] = []
    if refused is not None:
        assert after == before
    else:
        claims = [] if value is None else value if isinstance(value, list) else [value]
        lease = args.get("lease_seconds")
        for claim in claims:
            assert claim.owner == owner
            expected = world.lease_seconds if lease is None else float(lease)
            assert claim.lease_expires_at.timestamp() == pytest.approx(
                clock.now() + expected, abs=1e-3
            )
    for claim in claims:  # nothing stays claimed
        await world.finish(claim.item_id, fence=claim.fence)
    await assert_store_works(world)


# --- settling a claim ---------------------------------------------------------------------


SETTLE_CALLS = arguments(
    op=Arg(st.sampled_from(["renew", "finish", "retry", "park", "offload"])),
    item_id=Arg(st.just(THE_ITEM), counts_like),
    # The claim's own fence, or one next to it (legitimately refused).
    fence=Arg(st.sampled_from([0, 0, 0, 1, -1]), counts_like),
    status=Arg(omittable(valid_finish_statuses), finish_statuses),
    result=Arg(omittable(plain_results), results),
    error=Arg(omittable(valid_errors), errors),
    delay=Arg(omittable(valid_delays), durations),
    handle=Arg(st.sampled_from(["batch-1", "batch-2"]), handles),
    lease_seconds=Arg(omittable(st.one_of(st.none(), valid_leases)), durations),
    actor_id=Arg(omittable(valid_actors), actor_ids),
)


@FUZZ
@given(args=SETTLE_CALLS)
async def test_settlements(world: ControlStore, clock: ManualClock, args: Args) -> None:
    """renew, finish, retry, park, offload on a fresh claim: fuzzed item ids, fences (the
    current one, its neighbours, anything), statuses, results, errors, delays, handles,
    leases and actors. With valid arguments, only a fence that is not current or an actor
    that is not assigned may be refused."""
    claim = await claimed_item(world)
    op = args["op"]
    item_id = claim.item_id if args["item_id"] is THE_ITEM else args["item_id"]
    fence = args["fence"] if "fence" in args.wild else max(1, claim.fence + args["fence"])
    actor = args.kwargs("actor_id")
    call: Awaitable[Any]
    legit: list[type[AsyncplaneError]] = [FenceRejected, ScopeDenied]
    if op == "renew":
        call = world.renew(item_id, fence=fence, **actor, **args.kwargs("lease_seconds"))
    elif op == "finish":
        status = args.get("status", "done")
        if (status == "done" and args.get("error") is not None) or (
            status == "failed" and args.get("result") is not None
        ):
            legit.append(InvalidInput)  # a result goes with done, an error with failed
        options = args.kwargs("status", "result", "error")
        call = world.finish(item_id, fence=fence, **actor, **options)
    elif op == "retry":
        call = world.retry(item_id, fence=fence, **actor, **args.kwargs("error", "delay"))
    elif op == "park":
        delay = args.get("delay", 0) if "delay" not in args.wild else args["delay"]
        call = world.park(item_id, fence=fence, delay=delay, **actor)
    else:
        call = world.offload(item_id, fence=fence, handle=args["handle"], **actor)
    before = await snapshot(world, claim.item_id)
    value, refused = await attempt(call, refusals(args, REFUSALS_ON_ITEMS, *legit))
    after = await snapshot(world, claim.item_id)
    row = await world.item(claim.item_id)
    if refused is not None:
        assert after == before
        if isinstance(refused, FenceRejected):
            assert refused.fence == fence
        if isinstance(refused, (FenceRejected, ScopeDenied)) and args.tame:
            # Refused only for what it is: a fence not current, an actor not assigned.
            assert args["fence"] != 0 or args.get("actor_id") == STRANGER, refused
    elif item_id is not claim.item_id:
        note("settled another item than the one claimed for this example")
    elif op == "finish":
        assert row["state"] == args.get("status", "done")
        if row["state"] == "done" and args.get("result") is not None:
            assert same_json(row["result"], args.get("result"))
        if row["state"] == "failed":
            assert row["error"] == args.get("error")
    elif op == "retry":
        assert value in ("deferred", "failed") and row["state"] == value
    elif op == "park":
        assert row["state"] == "deferred" and row["attempts"] == claim.attempts - 1
    elif op == "offload":
        assert row["state"] == "offloaded" and row["offload_handle"] == args["handle"]
        assert [r["item_id"] for r in await world.offloaded(args["handle"])] == [claim.item_id]
    else:
        lease = args.get("lease_seconds")
        expected = world.lease_seconds if lease is None else float(lease)
        assert isinstance(value, dt.datetime)
        assert value.timestamp() == pytest.approx(clock.now() + expected, abs=1e-3)
    if row["state"] in ("claimed", "offloaded"):  # nothing stays claimed, or offloaded
        await world.finish(claim.item_id, fence=claim.fence)
    await assert_store_works(world)


# --- reads -------------------------------------------------------------------------------


READ_CALLS = arguments(
    op=Arg(
        st.sampled_from(
            ["item", "events", "counts", "next_due", "offloaded", "visible", "verify", "stats"]
        )
    ),
    item_id=Arg(st.just(THE_ITEM), counts_like),
    project_id=Arg(st.sampled_from([None, "alpha", "beta", "ghost"]), project_ids),
    actor_id=Arg(valid_actors, actor_ids),
    handle=Arg(st.sampled_from(["batch-1", "nothing-here"]), handles),
    limit=Arg(st.one_of(st.none(), valid_counts), counts_like),
)


@FUZZ
@given(args=READ_CALLS)
async def test_reads_write_nothing(world: ControlStore, args: Args) -> None:
    """item, events, counts, next_due, offloaded, visible_projects, verify_ledger (its
    limit), stats: fuzzed ids and scopes; no read changes anything."""
    claim = await claimed_item(world)
    op, actor_id, project_id = args["op"], args["actor_id"], args["project_id"]
    target = claim.item_id if args["item_id"] is THE_ITEM else args["item_id"]
    call: Awaitable[Any]
    if op == "item":
        call = world.item(target, actor_id=actor_id)
    elif op == "events":
        call = world.events(target, actor_id=actor_id)
    elif op == "counts":
        call = world.counts(project_id=project_id, actor_id=actor_id)
    elif op == "next_due":
        call = world.next_due(project_id=project_id, actor_id=actor_id)
    elif op == "offloaded":
        call = world.offloaded(args["handle"], actor_id=actor_id)
    elif op == "visible":  # the control plane (None) is no actor here
        wild_actor = "actor_id" in args.wild
        call = world.visible_projects(STRANGER if actor_id is None and not wild_actor else actor_id)
    elif op == "verify":
        call = verify_ledger(world, limit=args["limit"])
    else:
        call = world.stats()
    before = await snapshot(world, claim.item_id)
    value, refused = await attempt(
        call, refusals(args, (*REFUSALS_ON_ITEMS, UnknownProject), ScopeDenied, UnknownProject)
    )
    assert await snapshot(world, claim.item_id) == before
    if refused is None and op == "counts":
        assert set(value) == set(before.counts)
    elif refused is None and op == "verify":
        assert value == []
    await world.finish(claim.item_id, fence=claim.fence)
    await assert_store_works(world)


@FUZZ
@given(fields=st.lists(st.one_of(st.none(), texts, junk), max_size=4))
def test_fingerprint_function(fields: list[Any]) -> None:
    """fingerprint(*fields): str or None fields only, deterministic."""
    value, refused = attempt_sync(lambda: fingerprint(*fields), BAD_ARGUMENT)
    if refused is None:
        assert isinstance(value, str) and len(value) == 64
        assert value == fingerprint(*fields)


# --- dedup and purge ----------------------------------------------------------------------


def archive_paths(tmp_path: pathlib.Path) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda name: inside(tmp_path, f"archive-{name}.jsonl"), any_text),
        nasty_paths(tmp_path),
    )


@FUZZ
@given(data=st.data())
async def test_purge_and_preflight_dedup(
    world: ControlStore, clock: ManualClock, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """purge (retention, chunk, archive_path, progress) and dedup_pending_against_done
    (chunk), with settled items old enough to purge and a pending twin to deduplicate."""
    project = await fresh_project(world, "purge")
    first = await world.enqueue(project, {"n": 1}, fingerprint="twin")
    claim = await world.claim("worker-1", project_id=project)
    assert claim is not None and claim.item_id == first
    await world.finish(first, fence=claim.fence, result={"r": 1})
    await world.enqueue(project, {"n": 2}, fingerprint="twin", dedup=False)
    clock.advance(10)
    args = data.draw(
        arguments(
            op=Arg(st.sampled_from(["purge", "dedup"])),
            retention=Arg(
                st.one_of(st.sampled_from([0, 5, dt.timedelta(seconds=1)]), valid_delays),
                st.one_of(st.none(), durations),
            ),
            chunk=Arg(omittable(valid_counts), counts_like),
            archive_path=Arg(
                omittable(st.just(tmp_path / "archive.jsonl")), archive_paths(tmp_path)
            ),
            progress=progress_callbacks,
        ),
        label="args",
    )
    call: Awaitable[Any]
    if args["op"] == "purge":
        options = args.kwargs("chunk", "archive_path", "progress")
        call = world.purge(args["retention"], **options)
        allowed = refusals(args, (*BAD_ARGUMENT, ArchiveError))
    else:
        call = world.dedup_pending_against_done(*args.kwargs("chunk").values())
        allowed = refusals(args, BAD_ARGUMENT)
    before = await snapshot(world)
    value, refused = await attempt(call, allowed)
    after = await snapshot(world)
    if refused is not None:
        assert after == before
    elif args["op"] == "dedup":
        assert isinstance(value, int) and value >= 0
    await assert_store_works(world)


# --- import ------------------------------------------------------------------------------


def ignore_progress(count: int) -> None:
    """A progress callback."""


progress_callbacks = Arg(omittable(st.sampled_from([None, ignore_progress])), not_callable)


def source_db(tmp_path: pathlib.Path) -> pathlib.Path:
    """Another queue's SQLite file, new: a table of pending and finished rows."""
    path = tmp_path / f"source-{next(_SEQ)}.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "CREATE TABLE queue (id INTEGER PRIMARY KEY, data TEXT, status INTEGER, "
            "proj TEXT, prio INTEGER)"
        )
        conn.executemany(
            "INSERT INTO queue (data, status, proj, prio) VALUES (?, ?, ?, ?)",
            [
                ('{"task": 1}', 0, "alpha", 1),
                ("plain text", 1, "alpha", 0),
                ('{"task": 3}', 2, "beta", None),
                ("[1, 2]", 0, "beta", 5),
            ],
        )
    conn.close()
    return path


@FUZZ
@given(data=st.data())
async def test_import_pending(
    world: ControlStore, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """Valid mappings (with project_id=, or a project column; with or without a state
    column and its pending values) and fuzzed ones, from a fresh source file."""
    source = source_db(tmp_path)
    shapes = st.sampled_from(
        [
            ({"payload": "data"}, "alpha", OMIT),
            ({"payload": "data", "state": "status"}, "beta", [0, 1]),
            ({"payload": "data", "project_id": "proj", "priority": "prio"}, OMIT, OMIT),
            ({"payload": "data", "key": "id", "state": "status"}, "alpha", (0,)),
        ]
    )
    shape = data.draw(shapes, label="mapping")
    args = data.draw(
        arguments(
            source_path=Arg(st.sampled_from([source, str(source)]), nasty_paths(tmp_path)),
            table=Arg(
                st.just("queue"),
                st.one_of(
                    st.sampled_from(["queue\ud800", "queue\x00", "sqlite_master"]), texts, junk
                ),
            ),
            columns=Arg(
                st.just(shape[0]),
                st.one_of(
                    st.sampled_from(
                        [
                            {"payload": "data", "nonsense": "data", 1: "data"},
                            {"payload": "data\ud800"},
                            {"payload": 5},
                            {"payload": "data", "key": "status"},  # not unique
                            {"payload": "data", "key": "proj", "project_id": "proj"},
                        ]
                    ),
                    st.dictionaries(
                        st.one_of(
                            st.sampled_from(["payload", "key", "state", "sla"]),
                            texts,
                            hashable_junk,
                        ),
                        st.one_of(st.sampled_from(["data", "status", "id", "rowid"]), texts, junk),
                        max_size=4,
                    ),
                    junk,
                ),
            ),
            project_id=Arg(st.just(shape[1]), st.one_of(st.none(), project_ids)),
            pending=Arg(
                st.just(shape[2]),
                st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 2), texts)), texts, junk),
            ),
            drop_source=Arg(omittable(st.just(False)), junk.filter(lambda v: v is not True)),
            chunk=Arg(omittable(valid_counts), counts_like),
            progress=progress_callbacks,
        ),
        label="args",
    )
    before = await snapshot(world)
    value, refused = await attempt(
        world.import_pending(
            args["source_path"],
            table=args["table"],
            columns=args["columns"],
            **args.kwargs("project_id", "pending", "drop_source", "chunk", "progress"),
        ),
        refusals(args, REFUSALS_ON_PROJECTS),
    )
    after = await snapshot(world)
    if refused is not None:
        assert after == before
    else:
        assert value is not None and not value.dropped
    await assert_store_works(world)


# --- drain, with fuzzed outcomes ----------------------------------------------------------


class Refused:
    """An outcome whose construction was refused (with an AsyncplaneError)."""

    def __repr__(self) -> str:
        return "Refused()"


def build_outcome(kind: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """The outcome ``kind(*args)``, or `Refused` if its own checks refused the arguments;
    anything but an AsyncplaneError from a constructor is a bug."""
    value, refused = attempt_sync(lambda: kind(*args), BAD_ARGUMENT)
    return Refused() if refused is not None else value


outcomes = st.one_of(
    st.builds(build_outcome, st.just(Done), st.tuples(results)),
    st.builds(build_outcome, st.just(Failed), st.tuples(st.one_of(texts, junk))),
    st.builds(
        build_outcome,
        st.just(Retry),
        st.tuples(st.one_of(texts, junk), st.one_of(st.none(), valid_delays, durations)),
    ),
    st.builds(build_outcome, st.just(Park), st.tuples(st.one_of(valid_delays, durations))),
    st.builds(build_outcome, st.just(Offload), st.tuples(handles)),
    junk,  # not an outcome at all
)


@dataclasses.dataclass
class Executor:
    """Returns the fuzzed outcomes on its first call (or raises), then Done for all."""

    first: list[Any]
    raises: bool
    calls: int = 0

    async def __call__(self, batch: list[ClaimedItem]) -> Sequence[Any]:
        self.calls += 1
        if self.calls == 1:
            if self.raises:
                raise RuntimeError("the executor failed")
            return [Done() if isinstance(o, Refused) else o for o in self.first]
        return [Done({"again": True}) for _ in batch]


def set_event() -> asyncio.Event:
    stop = asyncio.Event()
    stop.set()
    return stop


def drain_calls(tmp_path: pathlib.Path, project: str) -> st.SearchStrategy[Args]:
    small = st.integers(min_value=1, max_value=3)
    not_daemon = st.one_of(texts, junk).filter(
        lambda mode: not (isinstance(mode, str) and mode == "daemon")
    )
    return arguments(
        project_id=Arg(st.sampled_from([project, project, None]), project_ids),
        owner=Arg(omittable(st.one_of(st.none(), valid_ids)), owners),
        batch_size=Arg(omittable(st.one_of(small, st.just(MAX_INT))), counts_like),
        # A valid empty_rounds or max_iters stays small: each round is real work.
        empty_rounds=Arg(omittable(small), counts_like.filter(lambda v: not _big_count(v))),
        max_iters=Arg(omittable(st.one_of(st.none(), small)), counts_like),
        actor_id=Arg(omittable(st.sampled_from([None, ACTOR])), actor_ids),
        poll_interval=Arg(omittable(st.floats(1e-3, 3600)), durations),
        preflight_chunk=Arg(omittable(st.one_of(small, st.just(MAX_INT))), counts_like),
        mode=Arg(omittable(st.just("foreground")), not_daemon),
        lock_path=Arg(
            omittable(st.sampled_from([None, tmp_path / "drain.lock"])),
            st.one_of(
                st.sampled_from(
                    [str(tmp_path), str(tmp_path / "nul\x00.lock"), str(tmp_path / "\ud800")]
                ),
                path_junk,
            ),
        ),
        stop=Arg(
            omittable(st.one_of(st.none(), st.builds(asyncio.Event), st.builds(set_event))), junk
        ),
    )


def _big_count(value: Any) -> bool:
    """A valid positive int too large for a drain's empty_rounds to finish in a test."""
    return (type(value) in (int, MyInt) and value > 3) or isinstance(value, Level)


@FUZZ
@given(data=st.data())
async def test_drain_with_fuzzed_outcomes(
    world: ControlStore, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """drain() over 1-4 fresh items with an executor returning fuzzed outcomes (Done,
    Failed, Retry, Park, Offload built from fuzzed arguments, things that are not outcomes,
    too few or too many of them) or raising; drain's own options fuzzed. drain returns a
    summary (or refuses its options), and no item is left claimed."""
    project = await fresh_project(world, "drain")
    if data.draw(st.booleans(), label="assigned to ACTOR"):
        await world.assign(project, ACTOR)
    size = data.draw(st.integers(1, 4), label="items")
    await world.enqueue_many(project, [{"n": i} for i in range(size)], dedup=False)
    first = data.draw(
        st.one_of(st.lists(outcomes, min_size=size, max_size=size), st.lists(outcomes)),
        label="outcomes",
    )
    execute = Executor(first, data.draw(st.booleans(), label="executor raises"))
    args = data.draw(drain_calls(tmp_path, project), label="args")
    before = await snapshot(world)
    # A lock file that cannot be opened (a directory, say) is the disk's refusal.
    wild = (*BAD_ARGUMENT, StorageError) if "lock_path" in args.wild else BAD_ARGUMENT
    summary, refused = await attempt(
        drain(world, execute, **args.kwargs(*args.values)), refusals(args, wild)
    )
    if refused is not None:
        assert await snapshot(world) == before
        assert execute.calls == 0
    else:
        assert isinstance(summary, DrainSummary) and not summary.skipped
    counts = await world.counts()
    assert counts["claimed"] == 0, counts
    note(f"{project}: {await world.counts(project_id=project)}")
    # Settle what the drain left offloaded, so later drains have nothing half-done.
    for handle in {o.handle for o in first if isinstance(o, Offload)}:
        for row in await world.offloaded(handle):
            await world.finish(row["item_id"], fence=row["fence"])
    await assert_store_works(world)


@FUZZ
@given(
    kind=st.sampled_from([Done, Failed, Retry, Park, Offload]),
    args=st.lists(st.one_of(texts, numbers, durations, results, junk), max_size=3),
)
def test_outcome_constructors(kind: Callable[..., Any], args: list[Any]) -> None:
    """An outcome refuses bad fields with an AsyncplaneError (or Python's own TypeError
    for the wrong number of arguments)."""
    arity_error: TypeError | None = None
    try:
        attempt_sync(lambda: kind(*args), BAD_ARGUMENT)
    except TypeError as exc:
        if isinstance(exc, AsyncplaneError):
            raise
        arity_error = exc
    assert arity_error is None or "positional argument" in str(arity_error), arity_error


async def hold_lock(path: Any) -> bool:
    async with DrainLock(path) as lock:
        return lock.acquired


async def settled_item(store: ControlStore, clock: ManualClock) -> None:
    """A done item, old enough for any retention below 10 seconds to purge."""
    project = await fresh_project(store, "old")
    claim = await claimed_item(store, project)
    await store.finish(claim.item_id, fence=claim.fence)
    clock.advance(10)


@FUZZ
@given(data=st.data())
async def test_path_arguments(
    world: ControlStore, clock: ManualClock, tmp_path: pathlib.Path, data: st.DataObject
) -> None:
    """Every argument that names a file, given a name no file can have (a lone surrogate,
    a NUL), bytes, a directory, a missing directory, or no path at all. The disk may
    refuse (StorageError, ArchiveError); the call may never raise anything else."""
    where = inside(tmp_path, f"paths-{next(_SEQ)}")
    await asyncio.to_thread(where.mkdir)
    path = data.draw(nasty_paths(where), label="path")
    op = data.draw(
        st.sampled_from(["store", "archive_option", "purge", "import", "drain", "lock"]),
        label="op",
    )
    disk = (*BAD_ARGUMENT, StorageError)
    await settled_item(world, clock)
    before = await snapshot(world)
    if op in ("store", "archive_option"):
        options: dict[str, Any] = {"clock": clock}
        location: Any = path
        if op == "archive_option":
            location, options["archive_path"], options["retention"] = where / "s.db", path, 0
        store, refused = attempt_sync(lambda: ControlStore(location, **options), disk)
        if store is not None:
            try:
                await exercise_path(store, clock, op)
            finally:
                await attempt(store.close(), disk)
    elif op == "purge":
        await attempt(world.purge(0, archive_path=path), disk)
    elif op == "import":
        await attempt(
            world.import_pending(
                path, table="queue", columns={"payload": "data"}, project_id="alpha"
            ),
            disk,
        )
    elif op == "drain":

        async def execute(batch: list[ClaimedItem]) -> list[Done]:
            return [Done() for _ in batch]

        await attempt(drain(world, execute, lock_path=path, project_id=HEALTH), disk)
    else:
        acquired, refused = await attempt(hold_lock(path), disk)
        assert refused is not None or acquired is True
    if op == "import":  # no path here names a source database: nothing was imported
        assert await snapshot(world) == before
    await assert_store_works(world)


async def exercise_path(store: ControlStore, clock: ManualClock, op: str) -> None:
    """Open a store on a fuzzed path (or with a fuzzed archive) and purge through it."""
    disk = (*BAD_ARGUMENT, StorageError)
    _, refused = await attempt(store.open(), disk)
    if refused is not None:
        return
    _, refused = await attempt(store.create_project("p", "P"), disk)
    if refused is None:
        await settled_item(store, clock)
        await attempt(store.purge(), disk)


@FUZZ
@given(store_argument=junk)
async def test_module_functions_refuse_what_is_not_a_store(
    world: ControlStore, store_argument: Any
) -> None:
    """drain(), verify_ledger() and copy_store() given something else than a store."""

    async def execute(batch: list[ClaimedItem]) -> list[Done]:
        return [Done() for _ in batch]

    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: drain(store_argument, execute),
        lambda: verify_ledger(store_argument),
        lambda: copy_store(store_argument, world),
        lambda: copy_store(world, store_argument),
    ]
    for call in calls:
        await attempt(call(), BAD_ARGUMENT)
    await assert_store_works(world)


@pytest.fixture
async def copy_destination(asyncplane_store_factory: Any) -> ControlStore:
    store: ControlStore = await asyncplane_store_factory("copy.db")
    return store


@FUZZ
@given(
    args=arguments(
        chunk=Arg(omittable(valid_counts), counts_like),
        pending_only=Arg(omittable(st.booleans()), flags),
        progress=progress_callbacks,
    ),
    into_itself=st.booleans(),
)
async def test_copy_store_options(
    world: ControlStore, copy_destination: ControlStore, args: Args, into_itself: bool
) -> None:
    """copy_store's options; copying a store into itself is refused (its ids are taken)."""
    destination = world if into_itself else copy_destination
    legit = (InvalidInput,) if into_itself else ()
    summary, refused = await attempt(
        copy_store(world, destination, **args.kwargs("chunk", "pending_only", "progress")),
        refusals(args, BAD_ARGUMENT, *legit),
    )
    if refused is None:
        assert summary is not None
        assert await verify_ledger(destination) == []
    await assert_store_works(world)


# --- the constructor ---------------------------------------------------------------------


def listing(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.iterdir())


class OddClock:
    """A clock (it has now()) that answers with whatever it was given, or raises."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def now(self) -> Any:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def __repr__(self) -> str:
        return f"OddClock({self.answer!r})"


class NoRandom:
    """An rng without random()."""

    def __repr__(self) -> str:
        return "NoRandom()"


def constructor_calls(
    location: Any, wild_locations: st.SearchStrategy[Any], tmp_path: pathlib.Path, clock: Any
) -> st.SearchStrategy[Args]:
    archive = tmp_path / "archive.jsonl"
    return arguments(
        location=Arg(st.just(location), wild_locations),
        lease_seconds=Arg(omittable(valid_leases), durations),
        clock=Arg(
            omittable(st.just(clock)),
            st.one_of(
                st.builds(
                    OddClock,
                    st.one_of(
                        st.sampled_from(
                            [math.nan, math.inf, 1e20, -1e12, "now", None, RuntimeError("clock")]
                        ),
                        numbers,
                        junk,
                    ),
                ),
                junk,
            ),
        ),
        synchronous=Arg(
            omittable(st.sampled_from(["NORMAL", "FULL"])),
            st.one_of(st.sampled_from(["OFF", "normal"]), texts, junk),
        ),
        busy_timeout=Arg(omittable(st.floats(0.5, 24 * 3600)), durations),
        max_payload_bytes=Arg(omittable(st.integers(64, 1 << 21)), counts_like),
        max_result_bytes=Arg(omittable(st.integers(64, 1 << 17)), counts_like),
        identity=Arg(
            omittable(st.one_of(st.none(), st.lists(valid_ids, unique=True, max_size=3))),
            identities,
        ),
        max_attempts=Arg(omittable(st.one_of(st.none(), valid_counts)), counts_like),
        retry_backoff=Arg(omittable(st.floats(0, 5)), durations),
        retry_backoff_max=Arg(omittable(st.floats(5, MAX_LEASE_SECONDS)), durations),
        rng=Arg(
            omittable(st.one_of(st.none(), st.builds(random.Random, st.integers()))),
            st.one_of(st.builds(NoRandom), st.sampled_from([5, "seed", random]), junk),
        ),
        retention=Arg(omittable(st.sampled_from([None, 0, 5, dt.timedelta(days=1)])), durations),
        archive_path=Arg(
            omittable(st.sampled_from([archive, str(archive)])), archive_paths(tmp_path)
        ),
        archive_max_mb=Arg(omittable(st.floats(1e-3, 1024)), durations),
        purge_chunk=Arg(omittable(valid_counts), counts_like),
        purge_min_interval_s=Arg(omittable(valid_delays), durations),
        max_batch=Arg(omittable(valid_counts), counts_like),
        read_connections=Arg(omittable(st.integers(1, 4)), counts_like),
        read_only=Arg(omittable(st.just(False)), st.one_of(st.just(True), junk)),
    )


OPTIONS = (
    "lease_seconds", "clock", "synchronous", "busy_timeout", "max_payload_bytes",
    "max_result_bytes", "identity", "max_attempts", "retry_backoff", "retry_backoff_max",
    "rng", "retention", "archive_path", "archive_max_mb", "purge_chunk",
    "purge_min_interval_s", "max_batch", "read_connections", "read_only",
)  # fmt: skip


@settings(FUZZ, max_examples=50)
@given(data=st.data())
async def test_constructor_options(
    asyncplane_backend: str,
    asyncplane_store_factory: Any,
    clock: ManualClock,
    tmp_path: pathlib.Path,
    data: st.DataObject,
) -> None:
    """Any options: refused at once with an AsyncplaneError and no I/O; or a store that
    opens and takes items through (with valid options it must; with wild ones it may
    fail, but only with an AsyncplaneError)."""
    if asyncplane_backend == "postgresql":
        real: Any = str(await asyncplane_store_factory.location("ctor"))
        # Malformed URLs, and real ones with odd parameters (never another host).
        user_chars = st.characters(codec="utf-8", exclude_characters="@/?#:[]")
        wild_locations = st.one_of(
            st.builds(
                lambda key, value: f"{real}&{key}={value}",
                st.sampled_from(
                    ["search_path", "application_name", "sslmode", "port", "connect_timeout"]
                ),
                st.one_of(any_text, spiked_text),
            ),
            st.builds(
                lambda user: real.replace("postgres@", f"{user}@", 1),
                st.text(user_chars, max_size=8),
            ),
            st.sampled_from(
                [
                    "postgresql://[",
                    "postgresql://[::1",
                    "postgresql://host:port/db",
                    "postgresql://u:p@:99999/db",
                    "postgres://",
                    real.replace("?", "?sslmode=bogus&", 1),
                ]
            ),
        )
    else:
        real = tmp_path / f"ctor-{next(_SEQ)}.db"
        wild_locations = st.one_of(
            nasty_paths(tmp_path),  # opened too
            st.just(":memory:"),
            junk,  # refused, or a relative path: constructed, never opened
        )
    args = data.draw(constructor_calls(real, wild_locations, tmp_path, clock), label="args")
    location, options = args["location"], args.kwargs(*OPTIONS)
    if asyncplane_backend == "postgresql" and "archive_path" not in options:
        options["archive_path"] = tmp_path / "archive.jsonl"  # as the plugin's stores have
    before = listing(tmp_path)
    store, refused = attempt_sync(
        lambda: ControlStore(location, **options), refusals(args, BAD_ARGUMENT)
    )
    assert listing(tmp_path) == before, "the constructor touched the disk"
    if refused is not None:
        return
    assert store is not None
    repr(store)  # a constructed store can be shown
    str(store.location)
    opened_here = location is real or (
        isinstance(location, (str, pathlib.Path))
        and (str(location).startswith((str(tmp_path), "postgres")))
    )
    if not opened_here:  # a relative path or the like: never make files outside tmp_path
        return
    if store.backend == "postgresql" and options.get("read_connections", 2) > 64:
        # asyncpg makes one holder object per pool slot when the pool opens: a few billion
        # of them exhaust memory. test_huge_sizes_are_refused_or_harmless covers it, in a
        # process of its own with bounded memory.
        return
    try:
        await exercise(store, args, clock=clock)
    finally:
        await attempt(store.close(), (StorageError,))


async def exercise(store: ControlStore, args: Args, *, clock: ManualClock) -> None:
    """Open ``store`` and take items through it: with valid options every call works;
    with wild ones each may be refused, but only with an AsyncplaneError."""
    allowed = refusals(args, (AsyncplaneError,))
    _, refused = await attempt(store.open(), allowed)
    if refused is not None:
        return
    project = f"p-{next(_SEQ)}"
    _, refused = await attempt(store.create_project(project, "P"), allowed)
    if refused is not None:
        return
    for how in ("retry", "finish"):  # a retry draws the rng's jitter
        _, refused = await attempt(store.enqueue(project, {"n": next(_SEQ)}), allowed)
        if refused is not None:
            return
        claim, refused = await attempt(store.claim("worker", project_id=project), allowed)
        if refused is not None or claim is None:
            assert args.wild or claim is not None
            return
        if how == "retry":
            await attempt(store.retry(claim.item_id, fence=claim.fence, error="again"), allowed)
        else:
            await attempt(store.finish(claim.item_id, fence=claim.fence), allowed)
        await attempt(store.item(claim.item_id), allowed)
        await attempt(store.events(claim.item_id), allowed)
    problems, refused = await attempt(verify_ledger(store), allowed)
    assert refused is not None or problems == []
    if args.get("retention") is not None:  # purge, with the configured retention and archive
        clock.advance(10)
        await attempt(store.purge(), allowed)


CLOCK_READINGS = st.one_of(
    st.sampled_from(
        [
            math.nan,
            math.inf,
            -math.inf,
            1e20,  # past year 9999
            -1e12,  # before year 1
            -1.0,  # before 1970
            "now",
            None,
            10**400,
            RuntimeError("the clock failed"),
            True,
        ]
    ),
    numbers,
    junk,
)


@settings(FUZZ, max_examples=30)
@given(reading=CLOCK_READINGS)
async def test_clock_readings(
    asyncplane_backend: str,
    asyncplane_store_factory: Any,
    tmp_path: pathlib.Path,
    reading: Any,
) -> None:
    """A clock (anything with now()) that reads nonsense: every call either works or is
    refused with an AsyncplaneError, and nothing it refused was written: the same store,
    opened again with a sane clock, reads back and verifies."""
    name = f"clock-{next(_SEQ)}"
    location: Any = (
        str(await asyncplane_store_factory.location(name))
        if asyncplane_backend == "postgresql"
        else tmp_path / f"{name}.db"
    )
    archive = tmp_path / f"{name}.jsonl"
    odd = ControlStore(location, clock=OddClock(reading), archive_path=archive)
    anything = (AsyncplaneError,)
    try:
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: odd.create_project("p", "P"),
            lambda: odd.enqueue("p", {"n": 1}),
            lambda: odd.claim("w"),
            lambda: odd.projects(),
            lambda: odd.counts(),
            lambda: odd.stats(),
            lambda: odd.next_due(),
            lambda: odd.item(1),
            lambda: odd.events(1),
            lambda: odd.purge(0),
            lambda: verify_ledger(odd),
        ]
        for call in calls:
            await attempt(call(), anything)
    finally:
        await attempt(odd.close(), anything)
    sane = ControlStore(location, clock=ManualClock(), archive_path=archive)
    try:
        for project in await sane.projects():
            for state, count in (await sane.counts(project_id=project["project_id"])).items():
                note(f"{project['project_id']}: {count} {state}")
        await sane.stats()
        await sane.next_due()
        for item_id in range(1, sum((await sane.counts()).values()) + 1):
            await sane.item(item_id)
            await sane.events(item_id)
        assert await verify_ledger(sane) == []
        await sane.create_project("q", "Q")
        await assert_store_works_in(sane, "q")
    finally:
        await sane.close()


async def assert_store_works_in(store: ControlStore, project: str) -> None:
    item_id = await store.enqueue(project, {"n": next(_SEQ)}, dedup=False)
    claim = await store.claim("health-worker", project_id=project)
    assert claim is not None and claim.item_id == item_id
    await store.finish(item_id, fence=claim.fence, result={"ok": True})
    assert await verify_ledger(store) == []


HUGE_SIZE_SECONDS = 8  # a store that works answers in well under a second
HUGE_SIZES = ("read_connections", "max_batch", "purge_chunk", "max_payload_bytes")


@pytest.mark.parametrize("option", HUGE_SIZES)
async def test_huge_sizes_are_refused_or_harmless(
    asyncplane_backend: str,
    asyncplane_store_factory: Any,
    tmp_path: pathlib.Path,
    option: str,
) -> None:
    """A size option at its largest valid value (2**63 - 1) is refused at construction, or
    the store opens and works; it must never exhaust memory. Run in a process of its own
    with 1 GiB of address space and 8 seconds, so a failure is a MemoryError or a timeout
    there, not an exhausted machine here."""
    if asyncplane_backend == "postgresql":
        location = str(await asyncplane_store_factory.location("huge"))
    else:
        location = str(tmp_path / "huge.db")
    script = HUGE_SIZE_SCRIPT.format(
        location=location, option=option, value=MAX_INT, archive=str(tmp_path / "a.jsonl")
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), HUGE_SIZE_SECONDS)
    except asyncio.TimeoutError:
        process.kill()
        output = b"timed out"
        await process.wait()
    text = output.decode(errors="replace")
    assert text != "timed out", f"{option}={MAX_INT}: no answer in {HUGE_SIZE_SECONDS} s"
    assert process.returncode == 0, text[-3000:]
    assert text.strip().splitlines()[-1] in ("ok", "refused"), text[-3000:]


HUGE_SIZE_SCRIPT = """
import asyncio, resource
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from asyncplane import AsyncplaneError, ControlStore

async def main():
    try:
        store = ControlStore({location!r}, {option}={value}, archive_path={archive!r})
    except AsyncplaneError as exc:
        print(type(exc).__name__, exc)
        print("refused")
        return
    try:
        await store.create_project("p", "P")
        item_id = await store.enqueue("p", {{"n": 1}})
        claim = await store.claim("w")
        await store.finish(item_id, fence=claim.fence)
        print(await store.counts(), len(await store.projects()))
    finally:
        await store.close()
    print("ok")

asyncio.run(main())
"""
