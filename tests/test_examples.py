"""Every example runs, as a user would run it, and says what it promises."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def run(
    script: str, *args: str, cwd: pathlib.Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_every_example_is_covered() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == {
        "quickstart.py",
        "fleet.py",
        "agent_fleet.py",
        "operating_items.py",
        "quota.py",
        "observe.py",
    }


def test_quickstart_runs_the_seed_examples_as_written(tmp_path: pathlib.Path) -> None:
    scratch = tmp_path / "tmp"  # where the example's own temporary directory goes
    scratch.mkdir()
    done = run("quickstart.py", cwd=tmp_path, env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    assert "ledger clean" in done.stdout
    assert list(tmp_path.iterdir()) == [scratch]  # it works in a directory of its own ...
    assert list(scratch.iterdir()) == []  # ... and leaves nothing behind (each run did)


def test_fleet_demo_settles_everything_once(tmp_path: pathlib.Path, location_of: Any) -> None:
    done = run("fleet.py", location_of("fleet.db"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "items settled: 22 done, 2 failed" in done.stdout
    found = re.search(r"lease takeovers: (\d+), late reports refused: (\d+)", done.stdout)
    assert found is not None
    assert int(found[1]) >= 1  # the stalled agent's item was taken over ...
    assert int(found[2]) >= 1  # ... and its late report refused
    assert "verify_ledger: clean" in done.stdout


def test_the_demos_leave_nothing_behind_and_say_when_a_store_is_not_new(
    tmp_path: pathlib.Path,
) -> None:
    # Each run left a directory in /tmp; a second run on one file ended in a traceback.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for script in ("fleet.py", "agent_fleet.py"):
        done = run(script, cwd=tmp_path, env={**os.environ, "TMPDIR": str(scratch)})
        assert done.returncode == 0, done.stdout + done.stderr
        assert list(scratch.iterdir()) == [], script
        kept = str(tmp_path / f"{script}.db")
        assert run(script, kept, cwd=tmp_path).returncode == 0
        again = run(script, kept, cwd=tmp_path)
        assert again.returncode == 2 and "holds this demo's projects already" in again.stdout


def test_agent_fleet_drains_while_producers_enqueue(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    done = run("agent_fleet.py", location_of("agents.db"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"(\d+) questions asked, (\d+) distinct items: (\d+) done", done.stdout)
    assert found is not None
    asked, distinct, finished = (int(found[n]) for n in (1, 2, 3))
    assert asked == 50 and distinct < asked  # repeated questions were answered once
    assert finished == distinct
    assert re.search(r"[1-9]\d* offloaded", done.stdout)
    assert "offloaded items collected later" in done.stdout
    assert "verify_ledger: clean" in done.stdout


def test_operating_items_finds_cancels_requeues_and_waits(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    done = run("operating_items.py", location_of("operating.db"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"cancelled the running item \d+: cancelled", done.stdout)
    assert done.stdout.count("rate limit reached") == 2
    assert "requeued 2 rate-limited items" in done.stdout
    assert "answers: 6 done; the running agent stopped: True" in done.stdout
    assert "'done': 6, 'failed': 0, 'cancelled': 1" in done.stdout
    assert "verify_ledger: clean" in done.stdout


def test_quota_keeps_a_fleet_within_its_limits_and_sweeps_once_per_tick(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    done = run("quota.py", location_of("quota.db"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\d+ calls answered by 3 workers", done.stdout)
    at_once = re.search(r"at most (\d+) calls at once", done.stdout)
    per_second = re.search(r"at most (\d+) claims in any second", done.stdout)
    assert at_once is not None and int(at_once[1]) <= 8
    assert per_second is not None and int(per_second[1]) <= 30
    sweeps = re.search(r"sweeps enqueued: (\d+), one per tick: True", done.stdout)
    assert sweeps is not None and int(sweeps[1]) >= 1
    assert "verify_ledger: clean" in done.stdout


def test_observe_links_every_run_to_its_request_and_serves_the_counts(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    done = run("observe.py", location_of("observe.db"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worked: 11 done, 1 failed" in done.stdout
    assert "execution spans linked to the request's trace: 12 of 12" in done.stdout
    assert "asyncplane.items.settled: {'done': 11, 'failed': 1}" in done.stdout
    assert "dashboard /api/stats: 11 done, 1 failed" in done.stdout
    assert 'asyncplane_items{project="docs",state="done"} 11.0' in done.stdout
