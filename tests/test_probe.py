"""The qualification probe, run as a user runs it: the command line, real processes.

Each scenario runs small here; the figures at full size come from
benchmarks/probe_vs_raw.py. The probe must also really fail: a run corrupted behind the
store's back exits 1 and names the count that is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time
import types
import urllib.parse
from typing import Any

import asyncpg
import pytest

from _fleet import COMMAND_LOOP
from asyncplane import ControlStore, InvalidInput, probe, testing
from asyncplane.probe import _cli as _probe_cli
from asyncplane.probe._report import _KILL_EVERY_SECONDS
from asyncplane.testing import ManualClock

REQUIRED_KEYS = {
    "scenario", "workers", "items", "seconds", "items_per_s", "duplicates", "lost",
    "locked_errors", "fence_rejections", "ledger_problems", "passed",
}  # fmt: skip


def run_probe(
    where: pathlib.Path | Any, *args: str, module: bool = True, loop: str | None = None
) -> tuple[int, Any, str]:
    """Run the probe on ``where``: a directory (the store is probe.db in it), or the
    ``location_of`` fixture (a fresh file, or a fresh PostgreSQL schema); ``loop`` is
    what ASYNCPLANE_LOOP says (None: unset)."""
    env = {key: value for key, value in os.environ.items() if key != "ASYNCPLANE_LOOP"}
    if loop is not None:
        env["ASYNCPLANE_LOOP"] = loop
    command = (
        [sys.executable, "-m", "asyncplane.probe"]
        if module
        else [sys.executable, "-m", "asyncplane.cli", "probe"]
    )
    store = str(where / "probe.db") if isinstance(where, pathlib.Path) else where("probe.db")
    done = subprocess.run(
        [*command, "--store", store, "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    report = json.loads(done.stdout) if done.stdout.strip() else None
    return done.returncode, report, done.stderr


def test_a_worker_that_dies_before_it_is_ready_fails_the_run_without_a_traceback(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (As the system's OOM killer would, or a crash on a bad file system.) It ended in a
    # RuntimeError's traceback, and --json printed nothing.
    dies = tmp_path / "dies"
    dies.mkdir()
    (dies / "sitecustomize.py").write_text(
        "import os, sys\nif '--name' in sys.argv:\n    os._exit(9)\n"  # workers only
    )
    paths = [str(dies), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    code, report, err = run_probe(
        tmp_path, "--scenario", "concurrent-queue", "--workers", "2", "--items", "20"
    )
    assert code == 1, err
    assert "Traceback" not in err and "exited 9 before it was ready" in err
    assert report["passed"] is False
    assert re.match(r"worker w\d exited 9 before it was ready", report["failures"][0])


def test_concurrent_queue_counts_are_exact(location_of: Any) -> None:
    code, report, err = run_probe(
        location_of, "--scenario", "concurrent-queue", "--workers", "4", "--items", "300",
        "--concurrency", "2",
    )  # fmt: skip
    assert code == 0, (report, err)
    assert set(report) >= REQUIRED_KEYS
    assert report["passed"] is True
    assert (report["workers"], report["items"], report["concurrency"]) == (4, 300, 2)
    for count in ("duplicates", "lost", "locked_errors", "fence_rejections", "ledger_problems"):
        assert report[count] == 0, count
    assert report["items_per_s"] > 0
    assert report["per_worker_min"] >= 0 and report["per_worker_max"] <= 300
    # Start-up (interpreters, imports, connections, the first thread hand-off) is counted
    # apart, before the timed window starts.
    assert report["startup_s"] > 0
    # So is the shut-down: from the last worker's summary (its drain over) to every exit.
    assert report["shutdown_s"] > 0
    # Left to choose, the workers run on uvloop (installed with the suite).
    assert report["event_loop"] == COMMAND_LOOP


def test_kill_and_reclaim_fences_out_the_dead_worker(location_of: Any) -> None:
    code, report, err = run_probe(location_of, "--scenario", "kill-and-reclaim")
    assert code == 0, (report, err)
    assert report["fence_rejections"] == 1  # the stand-in's late report, refused
    assert report["re_executions"] == 1  # the lapsed lease was taken over once
    assert report["kills"] == 1  # the holder's (it said 0)
    assert report["startup_s"] > 0  # the two workers' start-ups, counted apart
    assert (report["duplicates"], report["lost"], report["ledger_problems"]) == (0, 0, 0)


def test_stall_fences_out_the_stopped_worker(location_of: Any) -> None:
    code, report, err = run_probe(location_of, "--scenario", "stall", "--lease-seconds", "0.5")
    assert code == 0, (report, err)
    assert report["fence_rejections"] == 1
    assert (report["duplicates"], report["lost"], report["ledger_problems"]) == (0, 0, 0)


@pytest.mark.sqlite_only
def test_chaos_with_one_worker_kills_only_a_worker_at_work(tmp_path: pathlib.Path) -> None:
    # Every worker here takes longer to start than the time between kills (a start-up
    # slowed by a sitecustomize, as a loaded machine slows it): a lone worker killed
    # before it was warm would be replaced, and killed again, for ever.
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os, time\n"
        f"if os.environ.get('ASYNCPLANE_PROBE_STORE'):  # a worker\n"
        f"    time.sleep({2 * _KILL_EVERY_SECONDS})\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", str(tmp_path / "p.db"), "--json",
         "--scenario", "chaos", "--workers", "1", "--items", "5000", "--seed", "3"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(slow), *sys.path])},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["duplicates"], report["lost"], report["ledger_problems"]) == (0, 0, 0)
    assert report["kills"] >= 1


def test_chaos_survives_kills(location_of: Any) -> None:
    code, report, err = run_probe(
        location_of, "--scenario", "chaos", "--workers", "4", "--items", "3000", "--seed", "7",
    )  # fmt: skip
    assert code == 0, (report, err)
    assert report["kills"] >= 1
    assert (report["duplicates"], report["lost"], report["ledger_problems"]) == (0, 0, 0)
    assert report["locked_errors"] == 0


def test_chaos_that_killed_no_worker_fails(tmp_path: pathlib.Path) -> None:
    # A queue drained before the first kill (a fast disk, few --items) passed: a
    # qualified verdict that had tested no crash at all.
    code, report, err = run_probe(
        tmp_path, "--scenario", "chaos", "--workers", "1", "--items", "1", "--seed", "1"
    )
    assert code == 1, (report, err)
    assert report["kills"] == 0 and (report["duplicates"], report["lost"]) == (0, 0)
    assert report["failures"] == [
        "no worker was killed before the queue drained: give chaos more --items"
    ]


def test_chaos_figures_are_per_the_items_of_the_workers_that_said_them() -> None:
    # A killed worker says nothing of its CPU or lock time: the sums of the others were
    # divided by every item and the whole drain ("0.00 s per 1,000 items", "held 0%").
    report = probe.ProbeReport(
        scenario="chaos", workers=4, items=3000, concurrency=8, synchronous="NORMAL",
        lease_seconds=1.0, seconds=2.0, kills=5, summarised_items=1000, worker_cpu_s=2.0,
        lock_held_s=0.25, filesystem="ext4",
    )  # fmt: skip
    text = _probe_cli._human(report)
    assert "(2.00 s per 1,000 items, the 1,000 items of the workers not killed)" in text
    assert "held 250 us per item, the 1,000 items of the workers not killed" in text
    assert "of the drain" not in text
    calm = dataclasses.replace(report, kills=0, summarised_items=3000)
    assert "held 12% of the drain, 83 us per item\n" in _probe_cli._human(calm)
    # A coordinator starts no workers: none of their figures (all nought) is shown.
    far = dataclasses.replace(report, role="coordinator", kills=0, summarised_items=0)
    assert "per worker" not in _probe_cli._human(far)
    assert "start-up" not in _probe_cli._human(far)
    # A worker host never counts lost items nor checks the ledger: it said "lost 0".
    host = _probe_cli._human(dataclasses.replace(report, role="worker"))
    assert "lost" not in host.replace("lost items and the ledger: the coordinator", "")
    assert "ledger problems" not in host


@pytest.mark.parametrize(
    ("fault", "count"), [("duplicate-finish", "duplicates"), ("delete-item", "lost")]
)
def test_a_corrupted_run_fails_and_names_the_count(
    location_of: Any, fault: str, count: str
) -> None:
    code, report, _ = run_probe(
        location_of, "--scenario", "concurrent-queue", "--workers", "3", "--items", "200",
        "--fault", fault,
    )  # fmt: skip
    assert code == 1
    assert report["passed"] is False
    assert report[count] >= 1
    assert any(failure.startswith(f"{count} is ") for failure in report["failures"])


def test_an_item_done_by_no_worker_of_the_run_fails_it(location_of: Any) -> None:
    # Every count was right, and the run passed, though the fleet never did that item.
    code, report, _ = run_probe(
        location_of, "--scenario", "concurrent-queue", "--workers", "2", "--items", "50",
        "--fault", "ghost-finish",
    )  # fmt: skip
    assert code == 1
    assert (report["duplicates"], report["lost"]) == (0, 0)
    assert "done_by_no_worker is 1, must be 0" in report["failures"]


def test_human_report_names_the_wrong_count(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", str(tmp_path / "p.db"),
         "--scenario", "concurrent-queue", "--workers", "2", "--items", "50",
         "--fault", "delete-item"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert "FAILED: lost is 1, must be 0" in done.stdout
    assert "asyncplane probe: concurrent-queue" in done.stdout
    assert f"synchronous=NORMAL, on {COMMAND_LOOP}" in done.stdout
    assert re.search(r"start-up \(every worker warm, not timed\) \d+\.\d\d s", done.stdout)


def test_the_asyncplane_command_runs_the_probe(location_of: Any) -> None:
    code, report, err = run_probe(
        location_of, "--scenario", "concurrent-queue", "--workers", "2", "--items", "40",
        module=False, loop="asyncio",
    )  # fmt: skip
    assert code == 0, err
    assert report["passed"] is True
    # ASYNCPLANE_LOOP=asyncio reaches every worker: the standard loop, uvloop installed.
    assert report["event_loop"] == "asyncio"


def test_a_wrong_event_loop_choice_is_refused_before_anything_runs(
    tmp_path: pathlib.Path,
) -> None:
    code, report, err = run_probe(
        tmp_path, "--scenario", "concurrent-queue", "--workers", "2", "--items", "10",
        loop="tokio",
    )  # fmt: skip
    assert (code, report) == (2, None)
    assert "ASYNCPLANE_LOOP is 'tokio'" in err
    assert not (tmp_path / "probe.db").exists()


def test_an_existing_file_is_not_overwritten_without_asking(tmp_path: pathlib.Path) -> None:
    (tmp_path / "probe.db").write_bytes(b"precious")
    code, _, err = run_probe(tmp_path, "--scenario", "kill-and-reclaim")
    assert code == 2
    assert "exists" in err
    assert (tmp_path / "probe.db").read_bytes() == b"precious"
    # Nor with it: --overwrite deletes an asyncplane store, never another file.
    code, _, err = run_probe(tmp_path, "--scenario", "kill-and-reclaim", "--overwrite")
    assert code == 2 and "not an asyncplane store" in err
    assert (tmp_path / "probe.db").read_bytes() == b"precious"


@pytest.mark.sqlite_only
def test_overwrite_through_a_link_probes_the_store_the_link_leads_to(
    tmp_path: pathlib.Path, location_of: Any
) -> None:
    # The store opens where a link leads; --overwrite deleted the link and probed a new
    # file in the link's directory: another disk than the fleet's, perhaps.
    there, here = tmp_path / "there", tmp_path / "here"
    there.mkdir()
    here.mkdir()
    code, _, err = run_probe(there, "--scenario", "kill-and-reclaim")
    assert code == 0, err
    (here / "probe.db").symlink_to(there / "probe.db")
    code, report, err = run_probe(here, "--scenario", "kill-and-reclaim", "--overwrite")
    assert code == 0 and report["passed"], err
    assert (here / "probe.db").is_symlink()  # the link kept, the store behind it probed
    assert sorted(p.name for p in here.iterdir()) == ["probe.db"]


def first_column(url: str, query: str) -> list[Any]:
    """The first column of ``query``'s rows on the server at ``url``, sorted."""

    async def fetch() -> list[Any]:
        conn = await asyncpg.connect(url)
        try:
            return sorted(row[0] for row in await conn.fetch(query))
        finally:
            await conn.close()

    return asyncio.run(fetch())


@pytest.mark.postgresql_only
def test_overwrite_drops_no_schema_of_another_application(location_of: Any) -> None:
    # Its tables share a store's names (items), which a drop of the store would take.
    url = location_of("app")
    asyncio.run(testing.execute_sql(url, "CREATE TABLE items (id int PRIMARY KEY, name text)"))
    code, _, err = run_probe(lambda _: url, "--scenario", "kill-and-reclaim", "--overwrite")
    assert code == 2 and "another application" in err

    columns = first_column(
        url,
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = 'items'",
    )
    assert columns == ["id", "name"]


@pytest.mark.postgresql_only
def test_overwrite_drops_no_store_beside_another_applications_tables(location_of: Any) -> None:
    # A view of the store's items and a table of its own: a drop would take the view along.
    url = location_of("beside")
    code, _, err = run_probe(lambda _: url, "--scenario", "kill-and-reclaim")
    assert code == 0, err
    asyncio.run(
        testing.execute_sql(
            url, "CREATE VIEW app_view AS SELECT item_id FROM items; CREATE TABLE app (n int)"
        )
    )
    code, _, err = run_probe(lambda _: url, "--scenario", "kill-and-reclaim", "--overwrite")
    assert code == 2 and "nothing was dropped" in err, err

    relations = first_column(
        url,
        "SELECT relname FROM pg_class JOIN pg_namespace n ON n.oid = relnamespace"
        " WHERE nspname = current_schema() AND relname IN ('app', 'app_view', 'items')",
    )
    assert relations == ["app", "app_view", "items"]


def test_a_server_that_cannot_be_reached_exits_3_and_shows_no_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 3: the store failed under the probe (not 1, a wrong count; not 2, a usage error).
    url = "postgresql://app:s3cret@127.0.0.1:1/x?search_path=s"
    assert probe.main(["--store", url, "--scenario", "stall"]) == 3
    err = capsys.readouterr().err
    assert "the store failed" in err and "s3cret" not in err and "app:***@" in err
    # A parameter the driver cannot use is the user's to mend (2), not a traceback.
    for bad in ("sslmode=bogus", "target_session_attrs=zz"):
        with pytest.raises(SystemExit) as usage:
            probe.main(["--store", f"postgresql://app:s3cret@127.0.0.1:1/x?{bad}",
                        "--scenario", "stall"])  # fmt: skip
        assert usage.value.code == 2
        err = capsys.readouterr().err
        assert "the driver cannot use" in err and "s3cret" not in err, err


def test_overwrite_names_what_is_not_a_store_file(tmp_path: pathlib.Path) -> None:
    # A FIFO held the probe in open() for ever; an unreadable file ended in a traceback.
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    code, _, err = run_probe(lambda _: str(fifo), "--scenario", "stall", "--overwrite")
    assert code == 2 and "not a regular file" in err, err


@pytest.mark.postgresql_only
def test_the_probes_log_shows_no_password(
    location_of: Any, caplog: pytest.LogCaptureFixture
) -> None:
    parts = urllib.parse.urlsplit(location_of("logged"))
    url = urllib.parse.urlunsplit(
        parts._replace(netloc=f"{parts.username}:s3cret@{parts.hostname or ''}")
    )
    with caplog.at_level(logging.INFO, logger="asyncplane.probe"):
        assert probe.main(["--store", url, "--scenario", "kill-and-reclaim", "--json"]) == 0
    assert "starting on" in caplog.text
    assert "s3cret" not in caplog.text and ":***@" in caplog.text


def test_the_store_may_come_from_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # So that a URL's password stays off the process list of the probe itself too.
    monkeypatch.setenv("ASYNCPLANE_PROBE_STORE", str(tmp_path / "from_env.db"))
    assert probe.main(["--scenario", "kill-and-reclaim", "--json"]) == 0
    assert (tmp_path / "from_env.db").exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--wait-seconds", "nan"], "--wait-seconds must be positive"),
        (["--wait-seconds", "-1"], "--wait-seconds must be positive"),
        (["--store", ""], "--store names no file"),
    ],
)
def test_a_bad_option_is_a_usage_error(tmp_path: pathlib.Path, args: list[str], words: str) -> None:
    code, _, err = run_probe(tmp_path, "--scenario", "kill-and-reclaim", *args)
    assert code == 2 and words in err, err


def test_a_store_the_probe_cannot_make_is_an_error_of_its_own_not_a_wrong_count(
    tmp_path: pathlib.Path,
) -> None:
    # Exit 1 means a count was wrong: a directory given, or one that is not there, is not.
    code, _, err = run_probe(tmp_path / "missing", "--scenario", "kill-and-reclaim")
    assert code == 2 and "no directory" in err and "Traceback" not in err, err
    (tmp_path / "probe.db").mkdir()
    code, _, err = run_probe(tmp_path, "--scenario", "kill-and-reclaim", "--overwrite")
    assert code == 2 and "is a directory" in err, err


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:35 / /mnt/shared rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2
41 40 0:36 / /mnt/shared/local rw,relatime shared:21 - tmpfs tmpfs rw
42 22 0:37 / /mnt/with\\040space rw - cifs //host/share rw
43 22 0:38 / /mnt/back\\134slash\\011tab rw - nfs4 server:/other rw
"""


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/home/me", "ext4"),
        ("/mnt/shared/data", "nfs4"),
        ("/mnt/shared", "nfs4"),
        ("/mnt/shared/local/x", "tmpfs"),
        ("/mnt/sharedness", "ext4"),
        ("/mnt/with space/db", "cifs"),
        ("/mnt/back\\slash\ttab/db", "nfs4"),  # every octal escape (only \\040 was read)
    ],
)
def test_filesystem_is_read_from_mountinfo(target: str, expected: str) -> None:
    assert probe.filesystem_in_mountinfo(MOUNTINFO, target) == expected


def test_network_filesystems_get_a_clear_warning(tmp_path: pathlib.Path) -> None:
    for fs in ("nfs4", "cifs", "9p", "fuse.sshfs"):
        warning = probe.network_filesystem_warning(tmp_path / "x.db", fs)
        assert warning is not None
        assert fs in warning and "not safe" in warning
    assert probe.network_filesystem_warning(tmp_path / "x.db", "ext4") is None
    assert probe.filesystem_of(tmp_path / "x.db") != ""  # this machine's /proc is readable


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_progress_line_appears_on_a_terminal(tmp_path: pathlib.Path) -> None:
    import os
    import pty

    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "asyncplane.probe", "--store", str(tmp_path / "p.db"),
             "--scenario", "concurrent-queue", "--workers", "2", "--items", "3000"],
            stdout=subprocess.PIPE, stderr=follower, text=True, timeout=300,
        )  # fmt: skip
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if follower != -1:
            os.close(follower)
        os.close(leader)
    assert done.returncode == 0, done.stdout
    assert b"/3000 items done" in seen
    assert b"\r" in seen
    assert "items done" not in done.stdout  # the report itself stays clean


@pytest.mark.postgresql_only
@pytest.mark.parametrize("scenario", ["concurrent-queue", "chaos"])
def test_a_coordinator_and_workers_on_other_hosts_count_exactly(
    location_of: Any, scenario: str
) -> None:
    store = location_of("spread")
    base = [sys.executable, "-m", "asyncplane.probe", "--store", store, "--json",
            "--scenario", scenario, "--wait-seconds", "120"]  # fmt: skip
    coordinator = subprocess.Popen(
        [*base, "--role", "coordinator", "--items", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Two "hosts", each with its own worker processes; they wait for the items.
        hosts = [
            subprocess.Popen(
                [*base, "--role", "worker", "--workers", "2", "--concurrency", "2"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        host_reports = []
        for host in hosts:
            out, err = host.communicate(timeout=300)
            assert host.returncode == 0, f"{out}\n{err}"  # in full: the failures are at its end
            host_reports.append(json.loads(out))
        out, err = coordinator.communicate(timeout=300)
    finally:
        for process in (coordinator, *locals().get("hosts", [])):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert coordinator.returncode == 0, f"{out}\n{err}"
    report = json.loads(out)
    assert (report["role"], report["items"], report["passed"]) == ("coordinator", 400, True)
    for count in ("duplicates", "lost", "ledger_problems"):
        assert report[count] == 0, count
    # Each host reports its own share, by what its workers finished (under chaos a
    # worker killed after its finish committed never said it), and its workers' figures.
    shares = [r["items"] for r in host_reports]
    assert sum(shares) == 400 if scenario == "concurrent-queue" else 0 < sum(shares) <= 400
    assert all(r["role"] == "worker" and r["duplicates"] == 0 for r in host_reports)
    for host_report in host_reports:
        if host_report["items"]:
            assert host_report["worker_cpu_s"] > 0 and host_report["claim_p99_s"] > 0


@pytest.mark.postgresql_only
def test_a_cluster_chaos_run_no_kill_touched_says_it_proved_nothing(location_of: Any) -> None:
    # A coordinator has no kills of its own to count; with a queue drained before any
    # host's first kill, the cluster's chaos passed with nothing said.
    store = location_of("calm")
    base = [sys.executable, "-m", "asyncplane.probe", "--store", store, "--json",
            "--scenario", "chaos", "--wait-seconds", "120"]  # fmt: skip
    coordinator = subprocess.Popen(
        [*base, "--role", "coordinator", "--items", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        host = subprocess.run(
            [*base, "--role", "worker", "--workers", "1"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        out, err = coordinator.communicate(timeout=300)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    assert coordinator.returncode == 0, f"{out}\n{err}\n{host.stderr}"
    report = json.loads(out)
    assert report["re_executions"] == 0  # three items: drained before any kill
    assert any("this run proved no crash safe" in note for note in report["notes"])


@pytest.mark.postgresql_only
def test_a_coordinator_whose_queue_was_not_drained_reports_no_rate(location_of: Any) -> None:
    code, report, _ = run_probe(
        location_of, "--scenario", "concurrent-queue", "--role", "coordinator",
        "--items", "20", "--wait-seconds", "0.5",
    )  # fmt: skip
    assert code == 1 and report is not None
    assert report["lost"] == 20 and report["items_per_s"] == 0
    assert any("not drained within 0.5 s (0 of 20 done)" in f for f in report["failures"])


@pytest.mark.postgresql_only
def test_a_coordinator_opens_its_project_only_once_every_item_is_in(location_of: Any) -> None:
    # Worker hosts start when the project opens and stop when the queue is empty: had
    # they seen it open while the enqueues were still committing, they could stop early.
    from conftest import RawPostgres

    store = location_of("seeding")
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "asyncplane.probe", "--store", store, "--json",
         "--scenario", "concurrent-queue", "--role", "coordinator", "--items", "3000",
         "--wait-seconds", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    raw = RawPostgres(store)
    try:
        query = (
            "SELECT p.status, (SELECT count(*) FROM items) FROM projects AS p "
            "WHERE p.project_id = 'probe'"
        )  # one statement: the status and the count from the same snapshot
        deadline = time.monotonic() + 120
        while coordinator.poll() is None and time.monotonic() < deadline:
            # The coordinator makes the tables first. (Another process's commits: no
            # signal reaches this one, so it looks every few milliseconds.)
            if raw.execute("SELECT to_regclass('projects') IS NOT NULL").fetchone() == (True,):
                break
            time.sleep(0.005)
        seen: list[tuple[str, int]] = []
        while coordinator.poll() is None and time.monotonic() < deadline:
            row = raw.execute(query).fetchone()
            if row is not None:
                seen.append((row[0], row[1]))
                if row[0] == "open":
                    break
            time.sleep(0.005)
        assert seen and seen[-1] == ("open", 3000), seen[-3:]
        assert {status for status, _ in seen[:-1]} <= {"paused"}
    finally:
        coordinator.kill()
        coordinator.wait()
        raw.close()


async def test_a_worker_host_starts_only_once_the_coordinator_opens_the_project(
    asyncplane_store: Any,
) -> None:
    from asyncplane.probe import _hosts

    with pytest.raises(InvalidInput, match="start the coordinator"):
        await _hosts._seeded_ids(asyncplane_store, 0)
    await asyncplane_store.create_project("probe", "asyncplane probe", status="paused")
    with pytest.raises(InvalidInput, match="still being seeded"):
        await _hosts._seeded_ids(asyncplane_store, 0)  # paused: the coordinator is seeding
    with pytest.raises(InvalidInput, match="still being seeded"):
        # The wait for the store spent the time given: this one does not start it anew.
        await _hosts._seeded_ids(asyncplane_store, 600, deadline=time.monotonic() - 1)
    await asyncplane_store.set_project_status("probe", "open")
    assert await _hosts._seeded_ids(asyncplane_store, 0) == []


@pytest.mark.postgresql_only
def test_a_worker_host_does_not_take_an_earlier_runs_drained_store_for_its_items(
    location_of: Any,
) -> None:
    # It waits for a coordinator seeding this run's items: it does not pass having
    # drained nothing (nor hold the store open while the coordinator drops it).
    url = location_of("earlier")
    code, report, err = run_probe(
        lambda _: url, "--scenario", "concurrent-queue", "--items", "20", "--workers", "2"
    )
    assert code == 0 and report is not None, err
    code, _, err = run_probe(
        lambda _: url, "--scenario", "concurrent-queue", "--role", "worker",
        "--workers", "2", "--wait-seconds", "0.5",
    )  # fmt: skip
    assert code == 2 and "no probe items appeared within 0.5 s" in err, err


def test_roles_need_a_server_database_and_a_spreadable_scenario(tmp_path: pathlib.Path) -> None:
    code, _, err = run_probe(tmp_path, "--scenario", "concurrent-queue", "--role", "worker")
    assert code == 2 and "PostgreSQL" in err
    code, _, err = run_probe(tmp_path, "--scenario", "stall", "--role", "coordinator")
    assert code == 2 and "concurrent-queue and chaos only" in err


@pytest.mark.parametrize("at_end", [False, True])
async def test_a_worker_says_its_finishes_each_turn_or_after_the_drain(
    location_of: Any, at_end: bool
) -> None:
    # Each turn's finishes in a line of their own: a killed worker (chaos) loses at most
    # one turn's. With --report-at-end (concurrent-queue, which kills no one) they come
    # after the drain, in a few lines before the summary, which ends the timed window.
    from asyncplane import ControlStore
    from asyncplane import _probe_protocol as protocol

    store = location_of("said.db")
    async with ControlStore(store) as seeding:
        await seeding.create_project("probe", "asyncplane probe")
        ids = await seeding.enqueue_many("probe", [{"n": n} for n in range(5)])
    command = [sys.executable, "-m", "asyncplane._probe_worker", "--store", store,
               "--name", "w", "--no-wait", *(["--report-at-end"] if at_end else [])]  # fmt: skip
    # Its stdin ended at once: a --report-at-end worker leaves once its summary is said.
    worker = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await worker.communicate()
    assert worker.returncode == 0, err.decode()
    said = [protocol.decode(line) for line in out.splitlines()]
    kinds = [type(message).__name__ for message in said]
    finished = [
        tuple(pair) for m in said if isinstance(m, protocol.FinishedMany) for pair in m.items
    ]
    assert sorted(item for item, _ in finished) == sorted(ids)
    lines = 1 if at_end else 5  # one coroutine: one finish a turn
    assert kinds == ["Ready", *["FinishedMany"] * lines, "Summary"]


def test_finishes_said_at_the_end_come_in_lines_the_probe_can_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from asyncplane import _probe_protocol as protocol
    from asyncplane import _probe_worker

    finishes = _probe_worker._Finishes(at_end=True)
    largest = 2**63 - 1  # the widest ids and fences a store hands out
    for n in range(2 * _probe_worker.LINE_ITEMS + 1):
        finishes.add(largest - n, largest)
    finishes.flush()
    lines = capsys.readouterr().out.splitlines()
    sizes = [
        len(m.items) for m in map(protocol.decode, lines) if isinstance(m, protocol.FinishedMany)
    ]
    assert sizes == [_probe_worker.LINE_ITEMS, _probe_worker.LINE_ITEMS, 1]
    assert max(map(len, lines)) < 64 * 1024  # asyncio's StreamReader's line limit


def test_a_worker_failing_mid_drain_still_says_what_it_finished(
    location_of: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncplane import ControlStore, _probe_worker
    from asyncplane import _probe_protocol as protocol

    store = location_of("failing.db")

    async def seed() -> None:
        async with ControlStore(store) as seeding:
            await seeding.create_project("probe", "asyncplane probe")

    asyncio.run(seed())

    async def finishes_two_then_fails(
        store: Any, owner: str, tally: Any, until_drained: bool
    ) -> None:
        tally.finishes.add(1, 1)
        tally.finishes.add(2, 1)
        raise RuntimeError("the drain broke")

    monkeypatch.setattr(_probe_worker, "_drain_one", finishes_two_then_fails)
    with pytest.raises(RuntimeError, match="the drain broke"):
        _probe_worker.main(["--store", store, "--name", "w", "--no-wait", "--report-at-end"])
    said = [protocol.decode(line) for line in capsys.readouterr().out.splitlines()]
    assert [m.items for m in said if isinstance(m, protocol.FinishedMany)] == [[[1, 1], [2, 1]]]


@pytest.mark.parametrize(("scenario", "at_end"), [("concurrent-queue", True), ("chaos", False)])
async def test_only_workers_nothing_kills_keep_their_finishes_for_the_end(
    location_of: Any, monkeypatch: pytest.MonkeyPatch, scenario: str, at_end: bool
) -> None:
    import io

    from asyncplane.probe import _cli, _scenarios

    spawned: list[tuple[str, ...]] = []
    spawn = _scenarios._spawn

    async def recording(args: Any, name: str, *extra: str, **options: Any) -> Any:
        spawned.append(extra)
        return await spawn(args, name, *extra, **options)

    monkeypatch.setattr(_scenarios, "_spawn", recording)
    args = _cli._parser("probe").parse_args(
        ["--store", location_of("flags.db"), "--scenario", scenario, "--workers", "2",
         "--items", "20", "--lease-seconds", "1"]
    )  # fmt: skip
    report = await _cli.run_probe(args, progress=io.StringIO())
    # (Twenty items drain before chaos's first kill, which fails it for that alone.)
    assert [f for f in report.failures if "no worker was killed" not in f] == []
    assert spawned and all(("--report-at-end" in extra) == at_end for extra in spawned)


async def test_a_crashed_workers_items_are_not_called_done_by_no_worker(
    location_of: Any,
) -> None:
    # A worker killed from outside (kill -9) mid-drain dies before it says its finishes:
    # the run failed, rightly, on worker_crashes, and also on "done_by_no_worker is 465".
    from asyncplane.probe import _workers

    async with ControlStore(location_of("crashed.db")) as store:
        await store.create_project("probe", "asyncplane probe")
        ids = [await store.enqueue("probe", {"n": n}) for n in range(3)]
        for _ in ids:
            claim = await store.claim("gone/0")
            assert claim is not None
            await store.finish(claim.item_id, fence=claim.fence)
        for crashes, failures in ((1, []), (0, ["done_by_no_worker is 3, must be 0"])):
            report = probe.ProbeReport(
                scenario="concurrent-queue", workers=1, items=3, concurrency=1,
                synchronous="NORMAL", lease_seconds=30.0, worker_crashes=crashes,
            )  # fmt: skip
            await _workers._expect_named(report, store, ids, [])
            assert report.failures == failures


def test_a_finish_a_worker_counted_but_never_said_fails_the_run() -> None:
    from types import SimpleNamespace

    from asyncplane.probe import _workers
    from asyncplane.probe._report import ProbeReport

    def worker(counted: int, said: int, *, killed: bool = False) -> Any:
        summary = SimpleNamespace(finished=counted)
        return SimpleNamespace(
            summary=summary, finished=[(n, 1) for n in range(said)], killed=killed
        )

    def report() -> ProbeReport:
        return ProbeReport("concurrent-queue", 2, 5, 1, "NORMAL", 60.0)

    heard = report()
    _workers._expect_heard(heard, [worker(3, 3), worker(2, 2), worker(9, 1, killed=True)])
    assert heard.passed
    unheard = report()
    _workers._expect_heard(unheard, [worker(3, 3), worker(2, 0)])
    assert unheard.failures == ["finishes_unheard is 2, must be 0"]


def test_the_worker_protocol_reads_back_what_it_writes() -> None:
    from asyncplane import _probe_protocol as protocol

    messages: list[protocol.Message] = [
        protocol.Ready("w1"),
        protocol.Finished(3, 2),
        protocol.FinishedMany([[3, 2], [5, 1]]),
        protocol.Claimed(4, 1, 1767225600.5),
        protocol.Reported("fence_rejected", 4, 1),
        protocol.Summary(
            "w1",
            claimed=5,
            finished=4,
            locked=0,
            fence_rejected=1,
            max_lock_wait=0.25,
            cpu_s=0.5,
            claim_p99=0.01,
            lock_held=0.2,
        ),
    ]
    for message in messages:
        assert protocol.decode(protocol.encode(message).encode()) == message
    line = protocol.encode(messages[-1])
    assert protocol.decode(line[: len(line) // 2]) is None  # cut short by a kill
    assert protocol.decode('{"kind": "unheard-of"}') is None


#: How long a stand-in worker takes to shut down, once let go (a measured shut-down).
LINGERING = 0.3


async def _stand_in_worker(name: str, *, summary: bool, told_first: bool = False) -> Any:
    """A real process standing in for a probe worker: it says its summary (once told to
    on stdin, with ``told_first``) and, when its stdin ends, says on stderr when that was
    (`time.monotonic`, one clock for every process here) and lingers `LINGERING` seconds
    before it exits: its shut-down. Without ``summary`` it says nothing and exits at once,
    as a worker that died would."""
    from asyncplane import _probe_protocol as protocol
    from asyncplane.probe import _workers

    line = protocol.encode(
        protocol.Summary(name=name, claimed=0, finished=0, locked=0, fence_rejected=0,
                         max_lock_wait=0.0)
    )  # fmt: skip
    script = (
        "import sys, time\n"
        + ("sys.stdin.readline()\n" if told_first else "")
        + f"print({line!r}, flush=True)\n"
        + "sys.stdin.read()\n"
        + "print(time.monotonic(), file=sys.stderr, flush=True)\n"
        + f"time.sleep({LINGERING})\n"
    ) if summary else "pass"  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return _workers._Worker(name, process)


async def test_the_timed_window_ends_with_the_last_summary_and_no_worker_leaves_before_it() -> None:
    # A worker's summary comes right after its drain; closing its store and its
    # interpreter's teardown (sixteen of them on two CPUs: most of a second) are its
    # shut-down, reported apart and not timed, as its start-up is not. A worker done
    # early is held until the last summary: its shut-down would take the CPU from the
    # workers still draining (a seventh of the rate at 10,000 items, 16 workers at C=8).
    from asyncplane.probe import _workers
    from asyncplane.probe._report import ProbeReport

    started = time.monotonic()
    early = await _stand_in_worker("early", summary=True)
    late = await _stand_in_worker("late", summary=True, told_first=True)
    report = ProbeReport("concurrent-queue", 2, 0, 1, "NORMAL", 60.0)
    drained = asyncio.create_task(_workers._until_drained([early, late], started, report))
    await asyncio.wait_for(early.summarised.wait(), timeout=60)
    await late.say("summary")
    await asyncio.wait_for(drained, timeout=60)
    assert late.summary_at is not None and early.summary_at is not None
    assert early.summary_at < late.summary_at
    assert report.seconds == late.summary_at - started
    let_go = [float(worker.stderr.decode()) for worker in (early, late)]
    assert min(let_go) >= late.summary_at  # neither left before the last summary
    assert report.shutdown_s >= LINGERING  # from the last summary to the last exit


async def test_a_worker_that_never_said_its_summary_runs_the_window_to_the_last_exit() -> None:
    from asyncplane.probe import _workers
    from asyncplane.probe._report import ProbeReport

    started = time.monotonic()
    workers = [
        await _stand_in_worker("said", summary=True),
        await _stand_in_worker("died", summary=False),
    ]
    report = ProbeReport("concurrent-queue", 2, 0, 1, "NORMAL", 60.0)
    await asyncio.wait_for(_workers._until_drained(workers, started, report), timeout=60)
    assert report.shutdown_s == 0.0  # the window ran to the last exit
    let_go = float(workers[0].stderr.decode())  # then it lingered before its exit
    assert report.seconds >= let_go + LINGERING - started


async def test_a_worker_reporting_at_end_keeps_its_store_open_until_let_go(
    tmp_path: pathlib.Path,
) -> None:
    # Its summary said, a --report-at-end worker waits for its stdin to end before it
    # closes its store and exits: the probe ends them all once the last has said its
    # summary (`_until_drained`), so no worker's shut-down runs beside another's drain.
    from asyncplane import ControlStore
    from asyncplane.probe import _workers

    store = tmp_path / "held.db"
    async with ControlStore(store) as seeding:
        await seeding.counts()  # the store made: the worker finds nothing to drain
    args = argparse.Namespace(
        store=str(store), concurrency=2, lease_seconds=60.0, synchronous="NORMAL"
    )
    worker = await _workers._spawn(args, "w0", "--report-at-end")
    try:
        await worker.until_ready()
        await worker.say("go")
        await worker.until(worker.summarised, "said its summary")
        with pytest.raises(asyncio.TimeoutError):  # a second: it would be gone long before
            await asyncio.wait_for(asyncio.shield(worker.process.wait()), timeout=1.0)
        assert await asyncio.to_thread(os.path.exists, f"{store}-wal")  # still open
        worker.let_go()
        assert await asyncio.wait_for(worker.wait(), timeout=60) == 0
    finally:
        worker.kill()
        await worker.wait()


async def test_a_worker_is_given_its_store_off_the_process_list(tmp_path: pathlib.Path) -> None:
    # A command line is everyone's to read (ps); an environment is its owner's.
    from asyncplane.probe import _workers

    store = tmp_path / "s3cret.db"
    args = argparse.Namespace(
        store=str(store), concurrency=1, lease_seconds=1.0, synchronous="NORMAL"
    )
    worker = await _workers._spawn(args, "w0")
    try:
        await worker.ready.wait()  # its store open: it read where from its environment
        proc = pathlib.Path(f"/proc/{worker.process.pid}")
        command_line, environment = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
    finally:
        worker.kill()
        await worker.wait()
    assert b"s3cret" not in command_line and b"s3cret" in environment
    assert store.exists()


def test_a_url_whose_password_cannot_be_told_apart_is_refused_unshown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for url in ("postgresql://bob:Pw9Secret/xyz@127.0.0.1:5432/db", "postgresql://b:P@w9@h/db"):
        with pytest.raises(SystemExit) as ended:
            probe.main(["--store", url, "--scenario", "stall"])
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert "cannot be read" in err and "w9" not in err and "Traceback" not in err, err


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _state(pid: int) -> str:
    """A process's state letter (T: stopped), or "" once it is gone (or a zombie)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""
    return "" if state in ("Z", "X") else state


@pytest.mark.sqlite_only  # the workers' fate is the point, not the store's kind
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL", "SIGINT"])
async def test_a_probe_stopped_by_a_signal_leaves_no_worker_behind(
    tmp_path: pathlib.Path, signal_name: str
) -> None:
    # The stall scenario keeps a worker stopped (SIGSTOP) while its long lease runs out:
    # the probe is signalled then. A worker left behind would hold its claim for ever (or
    # drain on, competing with the next run).
    import signal

    from _signals import until

    probe_run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncplane.probe", "--store", str(tmp_path / "p.db"),
        "--scenario", "stall", "--lease-seconds", "600",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await until(
            lambda: any(_state(pid) == "T" for pid in _children(probe_run.pid)),
            what="the stalled worker stopped",
        )
        workers = _children(probe_run.pid)
        number = getattr(signal, signal_name)
        probe_run.send_signal(number)
        _, said = await asyncio.wait_for(probe_run.communicate(), 60)
        await until(lambda: not any(_state(pid) for pid in workers), what="every worker gone")
    finally:
        if probe_run.returncode is None:
            probe_run.kill()
            await probe_run.communicate()
    err = said.decode()
    if signal_name == "SIGKILL":  # nothing of the probe's runs: the kernel kills them
        assert probe_run.returncode == -number
    else:
        assert probe_run.returncode == 128 + number, err
        assert err.endswith("stopped by a signal; its workers were stopped\n"), err


def _with_site(tmp_path: pathlib.Path, code: str) -> dict[str, str]:
    """An environment whose processes run ``code`` first (a sitecustomize): a fault a
    probe worker meets (``ASYNCPLANE_PROBE_STORE`` is set in workers only)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('ASYNCPLANE_PROBE_STORE'):\n" + textwrap.indent(code, "    ")
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}


@pytest.mark.sqlite_only
def test_a_worker_whose_lock_wait_ran_out_is_a_locked_error_not_a_store_failure(
    tmp_path: pathlib.Path,
) -> None:
    # DatabaseLocked is a StorageError, but a lock wait that ran out is what the probe
    # counts (locked_errors, exit 1), not the disk failing under it (exit 3).
    env = _with_site(tmp_path, textwrap.dedent("""\
        from asyncplane import _errors, _store
        original, calls = _store.ControlStore.counts, [0]
        async def counts(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:  # the first is the warm-up before it says ready
                raise _errors.DatabaseLocked("database is locked: busy_timeout ran out")
            return await original(self, *args, **kwargs)
        _store.ControlStore.counts = counts
    """))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", str(tmp_path / "p.db"),
         "--scenario", "chaos", "--workers", "2", "--items", "300", "--seed", "1"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "FAILED: locked_errors is" in done.stdout, done.stdout


@pytest.mark.sqlite_only
@pytest.mark.parametrize("scenario", ["kill-and-reclaim", "stall"])
def test_a_holder_whose_store_fails_after_it_is_ready_ends_the_run_with_3(
    tmp_path: pathlib.Path, scenario: str
) -> None:
    # Its claim fails as a full disk fails it: the probe must not wait for ever for the
    # claim it will never report.
    env = _with_site(tmp_path, textwrap.dedent("""\
        from asyncplane import _errors, _store
        async def claim(self, *args, **kwargs):
            raise _errors.StorageError("OperationalError: database or disk is full")
        _store.ControlStore.claim = claim
    """))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", str(tmp_path / "p.db"),
         "--scenario", scenario],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "the store failed: worker " in done.stderr and "disk is full" in done.stderr


@pytest.mark.sqlite_only
async def test_two_runs_in_one_process_stop_only_their_own_workers(
    tmp_path: pathlib.Path,
) -> None:
    from _signals import until
    from asyncplane.probe import _cli

    def args_for(name: str, workers: int, items: int) -> argparse.Namespace:
        args = _cli._parser("probe").parse_args(
            ["--store", str(tmp_path / name), "--scenario", "concurrent-queue",
             "--workers", str(workers), "--items", str(items)]
        )  # fmt: skip
        args.lease_seconds = _cli._default_lease(args.scenario)
        return args

    long = asyncio.ensure_future(probe.run_probe(args_for("long.db", 2, 20_000)))
    await until(lambda: len(_children(os.getpid())) >= 2, what="the long run's workers")
    short = await probe.run_probe(args_for("short.db", 1, 10))  # it ends first
    assert short.passed, short.failures
    report = await long
    assert report.passed, report.failures


async def test_chaos_holds_each_takeover_to_what_befell_its_worker(
    store: ControlStore, clock: ManualClock
) -> None:
    # A killed worker's coroutine held at most one claim when it died; a worker never
    # killed hears of each of its claims taken over (a fence refusal). Checked against
    # the ledger's takeovers, named by the claimant ("<worker>/<coroutine>"), on a real
    # store.
    from asyncplane._probe_protocol import Summary
    from asyncplane.probe._report import ProbeReport
    from asyncplane.probe._scenarios import _check_takeovers

    await store.enqueue_many("alpha", [{} for _ in range(5)])

    async def lapse_and_take(count: int) -> None:
        clock.advance(store.lease_seconds + 1)
        for _ in range(count):  # the lapsed ones: older than any still ready
            taken = await store.claim("rescuer/0")
            assert taken is not None and taken.fence > 1
            await store.finish(taken.item_id, fence=taken.fence)

    # "killed/0" had one claim taken over while it went on, then died holding another;
    # "broken/0" held two at once (no coroutine does); "live/0" had one taken over.
    for owners in (["killed/0"], ["killed/0"], ["broken/0", "broken/0"], ["live/0"]):
        for owner in owners:
            assert await store.claim(owner) is not None
        await lapse_and_take(len(owners))

    def worker(name: str, killed: bool, refused: int = 0) -> Any:
        summary = None if killed else Summary(name, 0, 0, 0, refused, 0.0)
        return types.SimpleNamespace(name=name, killed=killed, summary=summary)

    async def failures(*fleet: Any) -> tuple[list[str], ProbeReport]:
        report = ProbeReport("chaos", len(fleet), 5, 1, "NORMAL", store.lease_seconds)
        await _check_takeovers(report, store, list(fleet))
        return report.failures, report

    killed, rescuer = worker("killed", True), worker("rescuer", False)
    found, report = await failures(killed, worker("live", False, 1), rescuer)
    assert found == []
    assert "takeovers: 2 of killed workers' claims, 1 of live workers'" in report.notes[-1]
    found, _ = await failures(killed, worker("broken", True), worker("live", False, 1), rescuer)
    assert found == ["takeovers_beyond_what_killed_workers_held is 1, must be 0"]
    found, _ = await failures(killed, worker("live", False, 0), rescuer)  # never told
    assert found == ["takeovers_never_heard_of is 1, must be 0"]
    found, _ = await failures(killed, worker("live", False, 2), rescuer)  # told twice
    assert found == ["fence_refusals_without_a_takeover is 1, must be 0"]
