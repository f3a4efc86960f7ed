"""`Record`: `typing.NamedTuple` for the type checker, made without compiling at import.

The seam's parameters and rows, the rules core's and a few others are NamedTuples:
immutable, typed, and cheap to build on the hot path. But making a NamedTuple class
compiles its ``__new__`` and type-checks each field's annotation, about 90 µs a class;
the 48 that ``import asyncplane`` makes cost it about 4.5 ms, a tenth of what
``import asyncio`` costs (issue 17's target is at most 1.5x ``import asyncio``).

A class written ``class ClaimOp(Record)`` is, to mypy, exactly a NamedTuple (``Record``
*is* ``typing.NamedTuple`` when type checking). At run time it is a tuple subclass with
the same fields, defaults, field properties and methods (``_make``, ``_replace``,
``_asdict``, ``_fields``, ``_field_defaults``, ``__match_args__``, the same ``repr``,
pickling and equality), made in about 20 µs: the methods that take no field list are
shared, and ``__new__`` is compiled, as `collections.namedtuple` compiles it, on the
class's first construction (a class a program never builds never pays for it). After
that, building one costs what building a NamedTuple costs.

A subclass of a record class (``class CancelWhereOp(WhereOp)``) is a plain subclass,
adding no fields, as with ``typing.NamedTuple``.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

__all__ = ("Record",)

#: namedtuple's own field property (C; `collections` falls back to Python without it).
_tuplegetter: Callable[[int, str], Any] = vars(collections)["_tuplegetter"]

_tuple_new = tuple.__new__
#: What namedtuple's _replace raises for a field it does not have (ValueError until 3.13).
_REPLACE_ERROR = TypeError if sys.version_info >= (3, 13) else ValueError


class _Fields(tuple):  # type: ignore[type-arg]
    """The methods every record class shares; the fields are each class's own."""

    __slots__ = ()
    if TYPE_CHECKING:  # (no annotations at run time: typing.get_type_hints shows fields only)
        _fields: tuple[str, ...]
        _field_defaults: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The first construction of a record class: compile its __new__ (a function with
        # the fields as parameters, as namedtuple's), put it in place, and build with it.
        owner = next(klass for klass in cls.__mro__ if "_fields" in klass.__dict__)
        new = _compiled_new(owner)
        owner.__new__ = new  # type: ignore[method-assign]
        return new(cls, *args, **kwargs)

    @classmethod
    def _make(cls, iterable: Iterable[Any]) -> Any:
        made = _tuple_new(cls, iterable)
        if len(made) != len(cls._fields):
            raise TypeError(f"Expected {len(cls._fields)} arguments, got {len(made)}")
        return made

    def _replace(self, /, **changes: Any) -> Any:
        made = self._make(map(changes.pop, self._fields, self))
        if changes:
            raise _REPLACE_ERROR(f"Got unexpected field names: {list(changes)!r}")
        return made

    if sys.version_info >= (3, 13):
        __replace__ = _replace  # copy.replace(), as a NamedTuple has from 3.13

    def _asdict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self, strict=True))

    def __repr__(self) -> str:
        shown = (f"{name}={value!r}" for name, value in zip(self._fields, self, strict=True))
        return f"{type(self).__name__}({', '.join(shown)})"

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(self)


def _compiled_new(owner: type) -> Any:
    """A record class's ``__new__``, compiled once, as `collections.namedtuple`'s."""
    fields: tuple[str, ...] = owner.__dict__["_fields"]
    listed = ", ".join(fields) + ("," if len(fields) == 1 else "")
    namespace = {"_tuple_new": _tuple_new, "__builtins__": {}}
    new = eval(f"lambda _cls, {', '.join(fields)}: _tuple_new(_cls, ({listed}))", namespace)
    new.__name__ = "__new__"
    new.__qualname__ = f"{owner.__qualname__}.__new__"
    defaults = owner.__dict__["_field_defaults"]
    new.__defaults__ = tuple(defaults.values()) or None
    new.__doc__ = f"Create new instance of {owner.__name__}({', '.join(fields)})"
    return staticmethod(new)


class _RecordMeta(type):
    """Makes ``class X(Record)`` a tuple subclass with X's annotated fields."""

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> Any:
        if not bases:  # Record itself
            return super().__new__(mcls, name, bases, namespace)
        if bases != (Record,):
            raise TypeError("a record class inherits from Record alone")
        annotations: dict[str, Any] = namespace.get("__annotations__", {})
        fields = tuple(annotations)
        defaults: dict[str, Any] = {}
        for field in fields:
            if field.startswith("_"):
                raise TypeError(f"a record's field may not start with an underscore: {field!r}")
            if field in namespace:
                defaults[field] = namespace.pop(field)
            elif defaults:
                raise TypeError(
                    f"non-default record field {field!r} cannot follow default field"
                    f"{'s' if len(defaults) > 1 else ''} {', '.join(defaults)}"
                )
        body = dict(namespace)
        body.setdefault("__doc__", f"{name}({', '.join(fields)})")
        body["__slots__"] = ()
        body["_fields"] = fields
        body["_field_defaults"] = defaults
        body["__match_args__"] = fields
        for index, field in enumerate(fields):
            body[field] = _tuplegetter(index, f"Alias for field number {index}")
        return type(name, (_Fields,), body)


if TYPE_CHECKING:
    from typing import NamedTuple as Record
else:

    class Record(metaclass=_RecordMeta):
        """The base of a record class (see the module's docstring)."""
