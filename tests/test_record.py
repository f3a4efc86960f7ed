"""`asyncplane._record.Record`: a NamedTuple in every way the package uses one, made cheaply."""

from __future__ import annotations

import copy
import importlib
import pathlib
import pickle
import sys
import typing
from typing import Any

import pytest

import asyncplane
from asyncplane import _backend
from asyncplane._record import Record


class Lease(Record):
    """A record of the tests' own."""

    owner: str
    fence: int
    note: str | None = None
    tags: tuple[str, ...] = ()


class Twin(typing.NamedTuple):
    owner: str
    fence: int
    note: str | None = None
    tags: tuple[str, ...] = ()


class Single(Record):
    only: int


class Narrower(Lease):
    __slots__ = ()


def test_a_record_builds_compares_and_shows_as_a_namedtuple() -> None:
    lease = Lease("w1", 3)
    twin = Twin("w1", 3)
    assert lease == twin == ("w1", 3, None, ())
    assert isinstance(lease, tuple)
    assert (lease.owner, lease.fence, lease.note, lease.tags) == ("w1", 3, None, ())
    assert Lease(fence=4, owner="w2", tags=("a",)) == ("w2", 4, None, ("a",))
    assert repr(lease) == "Lease(owner='w1', fence=3, note=None, tags=())"
    assert repr(Single(1)) == "Single(only=1)" and Single(1) == (1,)
    assert hash(lease) == hash(twin)
    assert Lease._fields == Twin._fields == Lease.__match_args__
    assert Lease._field_defaults == Twin._field_defaults
    assert Lease.__doc__ == "A record of the tests' own."
    assert Single.__doc__ == "Single(only)"
    assert Lease.__module__ == __name__ and Lease.__qualname__ == "Lease"
    with pytest.raises(AttributeError):
        lease.owner = "w3"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        lease.extra = 1  # type: ignore[attr-defined]
    match lease:
        case Lease(owner, fence):
            assert (owner, fence) == ("w1", 3)


def test_a_record_has_namedtuples_methods() -> None:
    lease = Lease("w1", 3, "n")
    assert lease._replace(fence=5) == Lease("w1", 5, "n")
    assert hasattr(lease, "__replace__") == hasattr(Twin("w1", 3), "__replace__")
    if sys.version_info >= (3, 13):
        assert copy.replace(lease, fence=5) == Lease("w1", 5, "n")
    assert list(typing.get_type_hints(Lease)) == list(typing.get_type_hints(Twin))
    assert type(lease._replace(fence=5)) is Lease
    assert lease._asdict() == {"owner": "w1", "fence": 3, "note": "n", "tags": ()}
    assert Lease._make(["w1", 3, "n", ()]) == lease
    assert type(Lease._make(["w1", 3, "n", ()])) is Lease
    assert pickle.loads(pickle.dumps(lease)) == lease
    assert type(pickle.loads(pickle.dumps(lease))) is Lease
    assert copy.copy(lease) == lease and copy.deepcopy(lease) == lease


def error_of(call: Any) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    raise AssertionError("no error")


def test_a_record_refuses_what_a_namedtuple_refuses() -> None:
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'fence'"):
        Lease("w1")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'fences'"):
        Lease("w1", fences=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'owner'"):
        Lease("w1", 3, owner="w2")  # type: ignore[misc]
    with pytest.raises(TypeError, match="Expected 4 arguments, got 2"):
        Lease._make(["w1", 3])
    with pytest.raises(type(error_of(lambda: Twin("w1", 3)._replace(fences=4)))) as raised:
        Lease("w1", 3)._replace(fences=4)
    assert str(raised.value) == "Got unexpected field names: ['fences']"


def test_a_subclass_is_a_plain_subclass_built_by_its_records_new() -> None:
    narrower = Narrower("w1", 3)
    assert type(narrower) is Narrower and narrower == Lease("w1", 3)
    assert Narrower._fields == Lease._fields
    assert type(narrower._replace(fence=4)) is Narrower
    assert repr(narrower) == "Narrower(owner='w1', fence=3, note=None, tags=())"
    assert pickle.loads(pickle.dumps(narrower)) == narrower
    assert "__new__" not in Narrower.__dict__


def test_new_is_compiled_on_a_records_first_construction_only() -> None:
    class Fresh(Record):
        a: int
        b: int = 2

    # Making the class compiled nothing (that is its import-time saving) ...
    assert "__new__" not in Fresh.__dict__
    assert Fresh(1) == (1, 2)
    # ... its first construction did, once: the class now builds as a NamedTuple does.
    compiled = Fresh.__dict__["__new__"]
    assert Fresh(b=3, a=1) == (1, 3)
    assert Fresh.__dict__["__new__"] is compiled


def test_a_bad_record_class_is_refused_when_made() -> None:
    with pytest.raises(TypeError, match="non-default record field 'b' cannot follow"):

        class Gap(Record):
            a: int = 1
            b: int

    with pytest.raises(TypeError, match="may not start with an underscore: '_a'"):

        class Hidden(Record):
            _a: int

    with pytest.raises(TypeError, match="inherits from Record alone"):

        class Mixed(Record, int):  # type: ignore[misc]
            a: int


def _record_classes() -> list[type[Any]]:
    """Every record class the package makes (its modules imported, lazy ones too)."""
    package = pathlib.Path(asyncplane.__file__).parent
    for path in sorted(package.glob("_*.py")):
        if path.stem != "__init__":
            try:
                importlib.import_module(f"asyncplane.{path.stem}")
            except ImportError:  # an optional extra's module
                continue
    return [
        value
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("asyncplane")
        for value in vars(module).values()
        if isinstance(value, type)
        and value.__module__ == module_name
        and "_fields" in value.__dict__
        and not issubclass(value, BaseException)
    ]


def test_every_record_class_of_the_package_has_its_annotated_fields() -> None:
    classes = _record_classes()
    assert _backend.ClaimOp in classes and len(classes) >= 45
    for klass in classes:
        # The fields are the annotations, in order; each reads its own place; the defaults
        # are the last fields'; a record made from its own fields' values is equal to them.
        fields = tuple(klass.__annotations__)
        assert klass._fields == fields, klass
        made = klass._make(range(len(fields)))
        assert [getattr(made, name) for name in fields] == list(range(len(fields))), klass
        defaults = tuple(klass._field_defaults)
        assert fields[len(fields) - len(defaults) :] == defaults, klass
        assert klass(*made) == made and klass(**made._asdict()) == made, klass
