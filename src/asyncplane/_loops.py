"""Which event loop asyncplane's own commands run on.

The library runs on whatever asyncio event loop its program gives it. asyncplane's own
processes choose one: ``asyncplane worker`` and the other verbs of the command, and the
probe with its worker processes. They run on uvloop when it is installed (the ``speed``
extra: ``pip install 'asyncplane[speed]'``; uvloop has no Windows build), and on the
standard loop otherwise.

Why uvloop: on SQLite most of what a claim or a finish costs beyond its statements is
Python, and much of that is the event loop's own machinery: a turn of the loop, a
wake-up from the connection's thread, a handle per callback. uvloop runs that machinery
in C on libuv. It changes no rule and no guarantee of the store (the rounds, their
transactions and the ledger are the same code), and it is the loop asyncpg's authors
wrote for this kind of work. The probe's fleet drains faster on it, at less CPU per item
(the figures: docs/architecture.md, "The event loop asyncplane's commands run on").

``ASYNCPLANE_LOOP`` in the environment says which, for every process a command starts:
``uvloop`` (refused if it is not installed), ``asyncio`` (the standard loop, even with
uvloop installed), or unset or ``auto`` (uvloop if installed).
"""

from __future__ import annotations

import asyncio
import os
import sys
import types
from collections.abc import Coroutine
from typing import Any, TypeVar

from asyncplane import _errors

__all__ = ("ENV", "chosen", "run", "running")

T = TypeVar("T")

#: The environment variable that chooses the loop: ``uvloop``, ``asyncio`` or ``auto``.
ENV = "ASYNCPLANE_LOOP"
_CHOICES = ("auto", "asyncio", "uvloop")


def chosen() -> str:
    """The loop asyncplane's commands run on here: ``"uvloop"`` or ``"asyncio"``.

    Raises:
        InvalidInput: ``ASYNCPLANE_LOOP`` is set to something else than a choice.
        MissingExtra: ``ASYNCPLANE_LOOP=uvloop`` and uvloop is not installed.
    """
    wanted = os.environ.get(ENV, "").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise _errors.InvalidInput(
            f"{ENV} is {os.environ[ENV]!r}: it must be one of {', '.join(_CHOICES)}"
        )
    if wanted == "asyncio":
        return "asyncio"
    if _uvloop() is not None:
        return "uvloop"
    if wanted == "uvloop":
        raise _errors.MissingExtra(
            f"{ENV}=uvloop, but uvloop has no Windows build: unset it, or say asyncio"
            if sys.platform == "win32"
            else f"{ENV}=uvloop needs the speed extra: pip install 'asyncplane[speed]'"
        )
    return "asyncio"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop `chosen` names."""
    try:
        name = chosen()
    except _errors.AsyncplaneError:
        main.close()  # never awaited: say nothing about it
        raise
    uvloop = _uvloop() if name == "uvloop" else None
    if uvloop is None:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def running() -> str:
    """The running loop's kind: ``"uvloop"`` or ``"asyncio"`` (whoever chose it)."""
    loop = asyncio.get_running_loop()
    uvloop = sys.modules.get("uvloop")  # not imported: the loop cannot be one of its
    return "uvloop" if uvloop is not None and isinstance(loop, uvloop.Loop) else "asyncio"


def _uvloop() -> types.ModuleType | None:
    """The uvloop module, or None when it cannot be imported (not installed)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop
