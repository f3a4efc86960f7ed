"""The event loop asyncplane's own commands run on (`asyncplane._loops`).

The suite installs uvloop (the ``speed`` extra), so a command left to choose picks it;
ASYNCPLANE_LOOP overrides the choice. That every worker of a command follows it, in
real processes, is checked where the commands are (tests/test_probe.py, test_work.py).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import asyncplane
from _fleet import COMMAND_LOOP
from asyncplane import InvalidInput, MissingExtra, _loops, cli, probe


async def _kind() -> str:
    return _loops.running()


def test_left_to_choose_a_command_runs_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_loops.ENV, raising=False)
    assert _loops.chosen() == COMMAND_LOOP
    assert _loops.run(_kind()) == COMMAND_LOOP
    monkeypatch.setenv(_loops.ENV, "auto")
    assert _loops.run(_kind()) == COMMAND_LOOP


def test_asyncplane_loop_asyncio_keeps_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_loops.ENV, "asyncio")
    assert _loops.chosen() == "asyncio"
    assert _loops.run(_kind()) == "asyncio"


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")
def test_asyncplane_loop_uvloop_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_loops.ENV, " UVLOOP ")
    assert _loops.run(_kind()) == "uvloop"


def test_uvloop_asked_for_but_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: import fails
    monkeypatch.delenv(_loops.ENV, raising=False)
    assert _loops.chosen() == "asyncio"  # left to choose: the standard loop, quietly
    monkeypatch.setenv(_loops.ENV, "uvloop")
    with pytest.raises(MissingExtra, match="ASYNCPLANE_LOOP=uvloop"):
        _loops.chosen()
    coroutine = _kind()
    with pytest.raises(MissingExtra):
        _loops.run(coroutine)  # closed, not left un-awaited (warnings are errors here)
    assert coroutine.cr_frame is None


def test_a_wrong_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_loops.ENV, "trio")
    with pytest.raises(InvalidInput, match=r"ASYNCPLANE_LOOP is 'trio'.*auto, asyncio, uvloop"):
        _loops.chosen()


def test_the_command_refuses_a_wrong_choice_with_its_usage_status(
    tmp_path: pathlib.Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.cli", "items", str(tmp_path / "none.db")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, _loops.ENV: "libuv"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "asyncplane items: ASYNCPLANE_LOOP is 'libuv'" in done.stderr


def test_the_commands_refuse_uvloop_asked_for_but_missing(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    monkeypatch.setenv(_loops.ENV, "uvloop")
    # Refused before the store is looked at (there is none: that would be refused too).
    assert cli.main(["items", str(tmp_path / "none.db")]) == 2
    assert "asyncplane items: ASYNCPLANE_LOOP=uvloop" in capsys.readouterr().err
    kept = tmp_path / "p.db"
    kept.write_bytes(b"not touched")
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--store", str(kept), "--scenario", "concurrent-queue", "--overwrite"])
    assert exit_.value.code == 2
    assert "ASYNCPLANE_LOOP=uvloop" in capsys.readouterr().err
    assert kept.read_bytes() == b"not touched"  # refused before --overwrite deleted it


def test_every_command_starts_its_loop_here() -> None:
    """No module of the package but this one starts an event loop itself: a command that
    did would run on asyncio's loop whatever is installed or asked for."""
    starters = {"run", "Runner", "new_event_loop", "run_until_complete", "run_forever"}
    found = []
    for path in pathlib.Path(asyncplane.__file__).parent.rglob("*.py"):
        if path.name == "_loops.py":
            continue
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in starters
                and isinstance(node.value, ast.Name)
                and node.value.id in ("asyncio", "uvloop", "anyio", "trio", "loop")
            ):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("asyncio", "uvloop"):
                for name in {alias.name for alias in node.names} & starters:
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {name}")
    assert found == []
