"""The set-up scripts' virtual-environment step (scripts/_venv.sh), which demo.sh and
test.sh both source: CI runs only its ordinary path (a .venv with pip already there)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

VENV_STEP = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "_venv.sh"


def _step(where: pathlib.Path, python: str) -> subprocess.CompletedProcess[str]:
    """Source the step in ``where`` as the scripts do, with ``PYTHON`` set."""
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; . "{VENV_STEP}"; echo done'],
        cwd=where, env={**os.environ, "PYTHON": python},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _base_python() -> str:
    """The interpreter this suite's own venv was made from (a venv's python makes venvs
    that point at the base one anyway)."""
    return str(pathlib.Path(sys._base_executable))


def _has_pip(venv: pathlib.Path) -> bool:
    return (
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "--version"],
            capture_output=True, timeout=120, check=False,
        ).returncode
        == 0
    )  # fmt: skip


def test_the_step_makes_a_venv_with_pip_once(tmp_path: pathlib.Path) -> None:
    done = _step(tmp_path, _base_python())
    assert done.returncode == 0, done.stderr
    assert _has_pip(tmp_path / ".venv")
    marker = tmp_path / ".venv" / "kept"
    marker.write_text("a package of the developer's")
    again = _step(tmp_path, _base_python())
    assert again.returncode == 0, again.stderr
    assert marker.exists()  # made once: the second run left it as it was


def test_a_venv_without_pip_is_given_pip_and_kept(tmp_path: pathlib.Path) -> None:
    # As Debian's python3 leaves one before python3-venv is installed, or as uv makes one.
    subprocess.run(
        [_base_python(), "-m", "venv", "--without-pip", str(tmp_path / ".venv")],
        check=True, timeout=120,
    )  # fmt: skip
    marker = tmp_path / ".venv" / "kept"
    marker.write_text("a package of the developer's")
    assert not _has_pip(tmp_path / ".venv")
    done = _step(tmp_path, _base_python())
    assert done.returncode == 0, done.stderr
    assert _has_pip(tmp_path / ".venv") and marker.exists()


def test_a_venv_that_cannot_get_pip_is_named_and_never_removed(tmp_path: pathlib.Path) -> None:
    # A venv whose python has no ensurepip (Debian's without python3-venv): the step says
    # what to install and leaves the venv alone (a version re-made it with --clear).
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text('#!/bin/sh\necho "No module named $2" >&2\nexit 1\n')
    python.chmod(0o755)
    marker = tmp_path / ".venv" / "kept"
    marker.write_text("a package of the developer's")
    done = _step(tmp_path, _base_python())
    assert done.returncode == 1 and "done" not in done.stdout
    assert "install python3-venv" in done.stderr
    assert marker.exists() and python.exists()


@pytest.mark.parametrize("fails", ["at once", "half way"])
def test_a_venv_the_step_could_not_make_is_removed(tmp_path: pathlib.Path, fails: str) -> None:
    # A venv half made (the interpreter failed part way) is not left to be taken for one.
    python = tmp_path / "python3"
    half = "mkdir -p .venv/bin; touch .venv/bin/python; " if fails == "half way" else ""
    python.write_text(f"#!/bin/sh\n{half}echo 'venv failed' >&2\nexit 1\n")
    python.chmod(0o755)
    done = _step(tmp_path, str(python))
    assert done.returncode == 1 and "done" not in done.stdout
    assert not (tmp_path / ".venv").exists()
