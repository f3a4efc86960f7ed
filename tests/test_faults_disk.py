"""Faults, a full disk: every write path runs into a disk with no room left, and recovers.

Each test starts a child process (tests/workers/disk_worker.py) in a private mount
namespace of its own, ``unshare --mount``, on a tmpfs of a few MiB mounted there (it
disappears with the process), with SQLite's temporary files on it too. The child fills
the disk with a filler file and drives one write path into it, keeping a model of what
each acknowledged call did; it copies the database and its -wal at the refusal, as a
crash then would leave them; then it deletes the filler, retries the refused call and
holds the same store object, a second one opened beside it, a third opened after both
closed, and the crash copy against the model. It reports JSON lines; the tests assert:

- the refused call raised an `AsyncplaneError` that is, or is caused by, a `StorageError`
  (an `ArchiveError` for the purge archive), never a bare OSError or sqlite3 error;
- every acknowledged call is there, with the state its last acknowledged call gave it,
  and nothing a refused call would have done is;
- once space returns the same store object works again (the refused call, retried,
  succeeds), so do fresh ones, the ledger is clean and the file passes integrity_check;
- drain() on a full disk strands nothing a new drain cannot take over and settle.

SQLite only: the PostgreSQL server's disk is not the test's to fill. The mount needs root
(CI runs as root); without it the tests try a user namespace, and fail, not skip, if
neither works.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

import pytest

pytestmark = pytest.mark.sqlite_only  # the mechanism is SQLite's own files on a full disk

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "disk_worker.py"
#: The tmpfs most scenarios run on, in KiB: small, so that filling it is quick.
SMALL_DISK = 3 * 1024
#: Where the -wal must grow past a checkpoint's threshold (1,000 pages) or its index's
#: first region (16 MiB of frames) and then fit beside the database it is copied into.
CHECKPOINT_DISK = 12 * 1024
WAL_INDEX_DISK = 40 * 1024
#: How to get a private mount namespace to mount the tmpfs in: as root, then (for a user
#: who is not) inside a user namespace of the test's own.
ISOLATIONS = (("unshare", "--mount"), ("unshare", "--user", "--map-root-user", "--mount"))
#: The child's shell: mount the tmpfs on DIR, then become the worker.
MOUNT_THEN_RUN = (
    'mount -t tmpfs -o size="$1" tmpfs "$2" && '
    'exec "$3" -W always::ResourceWarning "$4" "$2" "$5" "$6"'
)
#: What the child's stderr must not hold: leaked connections, files or tasks.
LEAKS = ("ResourceWarning", "was destroyed but it is pending", "Exception ignored")


@functools.cache
def isolation() -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The command prefix under which a tmpfs can be mounted, and why the others failed."""
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as where:
        for prefix in ISOLATIONS:
            probe = [*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", where]
            try:
                done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as exc:
                failures.append(f"{' '.join(prefix)}: {exc}")
                continue
            if done.returncode == 0:
                return prefix, tuple(failures)
            failures.append(f"{' '.join(prefix)}: exit {done.returncode}: {done.stderr.strip()}")
    return None, tuple(failures)


@dataclasses.dataclass
class Report:
    """What one child reported: its JSON lines, its exit status and its stderr."""

    scenario: str
    records: list[dict[str, Any]]
    returncode: int
    stderr: str

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [
            record
            for record in self.records
            if record["kind"] == kind and all(record.get(k) == v for k, v in match.items())
        ]

    def one(self, kind: str, **match: Any) -> dict[str, Any]:
        found = self.of(kind, **match)
        assert len(found) == 1, f"expected one {kind} {match}, got {len(found)}\n{self}"
        return found[0]

    def fact(self, what: str) -> dict[str, Any]:
        return self.one("fact", what=what)

    def refusals(self) -> list[dict[str, Any]]:
        return self.of("refused")

    def __str__(self) -> str:
        lines = "\n".join(json.dumps(record)[:1500] for record in self.records)
        return f"scenario {self.scenario}, exit {self.returncode}:\n{lines}\n{self.stderr[-4000:]}"


def sqlite_names(*names: str) -> list[str]:
    """The driver's error names a worker reports: sqlite3 gives them from Python 3.11 on
    (before, the worker says "?")."""
    return list(names) if sys.version_info >= (3, 11) else ["?"] * len(names)


def run_scenario(scenario: str, tmp_path: pathlib.Path, size_kib: int = SMALL_DISK) -> Report:
    """Run one scenario of the worker on a fresh tmpfs of ``size_kib`` KiB."""
    prefix, failures = isolation()
    if prefix is None:
        pytest.fail(
            "the full-disk tests mount a small tmpfs in a private mount namespace, and "
            "neither `unshare --mount` (needs root) nor `unshare --user --map-root-user "
            "--mount` (needs unprivileged user namespaces) could: " + "; ".join(failures)
        )
    disk = tmp_path / "disk"  # the mount point; the tmpfs covers it inside the namespace
    elsewhere = tmp_path / "elsewhere"  # on the real disk: crash copies, sources, archives
    disk.mkdir()
    elsewhere.mkdir()
    command = [
        *prefix, "sh", "-c", MOUNT_THEN_RUN, "sh",
        f"{size_kib}k", str(disk), sys.executable, str(WORKER), scenario, str(elsewhere),
    ]  # fmt: skip
    # SQLite's temporary files (statement journals, sorts) go to the full disk too.
    env = {**os.environ, "SQLITE_TMPDIR": str(disk)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    records = []
    for line in done.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append({"kind": "unparsed", "line": line})
    return Report(scenario, records, done.returncode, done.stderr)


def assert_recovered(report: Report, *, size_kib: int = SMALL_DISK, refusals: bool = True) -> None:
    """What every scenario must show: typed refusals, nothing lost or phantom, recovery."""
    problems: list[str] = []
    if report.returncode != 0 or report.of("crash") or report.of("unparsed"):
        problems.append("the child did not end cleanly")
    leaks = [line for line in report.stderr.splitlines() if any(m in line for m in LEAKS)]
    if leaks:
        problems.append(f"the child leaked: {leaks[:5]}")
    if [r["scenario"] for r in report.of("end")] != [report.scenario]:
        problems.append("no end record")
    start = report.one("start")
    if not 0 < start["available"] <= size_kib * 1024:
        problems.append(f"the child's disk is not the {size_kib} KiB tmpfs: {start}")
    if refusals and not report.refusals():
        problems.append("nothing was refused: the disk never filled")
    for refusal in report.refusals():
        if not (refusal["asyncplane"] and refusal["storage"]):
            problems.append(f"{refusal['call']} raised {refusal['chain']}, not a StorageError")
    for never in report.of("never_refused"):
        problems.append(f"{never['call']} was never refused on the full disk")
    for retried in report.of("retried"):
        if not retried["ok"]:
            problems.append(f"{retried['call']} failed again once space returned: {retried}")
    for read in report.of("read_while_full"):
        if not read["ok"] or read["ledger"]:
            problems.append(f"reading the full store failed: {read}")
    phases = [check["phase"] for check in report.of("check")]
    if phases[:3] != ["same", "fresh", "reopened"]:
        problems.append(f"the checks ran in phases {phases}")
    for check in report.of("check"):
        where = f"{check['phase']} ({check.get('call', '')})"
        if "crashed" in check:
            problems.append(f"{where}: the check crashed: {check['crashed']}")
            continue
        for key in ("lost", "wrong", "projects_lost", "projects_phantom", "ledger"):
            if check[key]:
                problems.append(f"{where}: {key} {check[key]}")
        if check["phantoms"]:
            problems.append(
                f"{where}: {check['phantoms']} item(s) no acknowledged call made "
                f"({check['stored']} stored, {check['items']} modelled): {check['phantom_items']}"
            )
        if not check["write_ok"] or check["lost_after_write"] or check["wrong_after_write"]:
            problems.append(f"{where}: the store took no new write: {check['write_error']}")
    for closed in report.of("closed"):
        if not closed["ok"]:
            problems.append(f"closing failed: {closed}")
    for facts in report.of("file"):
        if facts["integrity"] != ["ok"]:
            problems.append(f"integrity_check of the {facts['which']}: {facts['integrity']}")
        if facts["which"] == "store" and facts["wal_left"]:
            problems.append("the last close left a -wal though space had returned")
    assert not problems, "\n".join(problems) + f"\n\n{report}"


def calls_refused(report: Report) -> list[str]:
    return [refusal["call"] for refusal in report.refusals()]


# --- every write path --------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario",
    [
        "enqueue",
        "enqueue_many",
        "claim",
        "claim_batch",
        "renew",
        "finish_done",
        "finish_failed",
        "retry",
        "park",
        "offload",
        "create_project",
    ],
)
def test_a_write_on_a_full_disk_is_a_storage_error_and_the_store_recovers(
    scenario: str, tmp_path: pathlib.Path
) -> None:
    # The disk is filled but for a few KiB: some calls still fit and are acknowledged (and
    # must survive), then one is refused; retried once the filler is gone, it succeeds.
    report = run_scenario(scenario, tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["call"] == scenario
    assert refusal["acknowledged"] >= 1, report  # calls did land on the nearly full disk
    assert refusal["sqlite"] == sqlite_names("SQLITE_FULL"), report
    assert [check["phase"] for check in report.of("check")] == [
        "same", "fresh", "reopened", "crash_copy",
    ]  # fmt: skip


def test_the_other_writes_on_a_full_disk(tmp_path: pathlib.Path) -> None:
    # set_project_status, assign, unassign, import_pending, dedup_pending_against_done.
    report = run_scenario("other_writes", tmp_path)
    assert_recovered(report)
    assert calls_refused(report) == [
        "set_project_status", "assign", "unassign", "import_pending",
        "dedup_pending_against_done",
    ]  # fmt: skip
    assert report.one("retried", call="dedup_pending_against_done")["ok"]
    assert report.fact("dedup")["settled"] == 40  # the retry settled every pending twin


def test_a_statement_whose_journal_cannot_spill_fails_alone(tmp_path: pathlib.Path) -> None:
    # A finish that settles 120 pending twins rewrites them in one UPDATE, whose statement
    # journal spills to a temporary file on the full disk: the statement fails inside the
    # writer's transaction (not at its COMMIT), which is rolled back whole.
    report = run_scenario("twins", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["call"] == "finish_twins"
    assert refusal["raised_in"][-1] != "_transact", report  # not the COMMIT: the statement


def test_a_group_commit_on_a_full_disk_answers_each_request_on_its_own(
    tmp_path: pathlib.Path,
) -> None:
    # Seven requests meet in one round; the twins' finish fails inside its statement, the
    # round is rolled back and run again without it, and the six others commit.
    report = run_scenario("group_commit", tmp_path)
    assert_recovered(report)
    assert report.fact("rounds")["rounds"] == 1, report
    assert calls_refused(report) == ["finish_twins"]
    assert {answer["call"] for answer in report.of("answered")} == {
        "enqueue", "enqueue_many", "claim", "renew", "park", "finish_small",
    }  # fmt: skip


# --- retention ---------------------------------------------------------------------------------


def test_a_purge_whose_archive_fills_the_disk_is_an_archive_error(tmp_path: pathlib.Path) -> None:
    report = run_scenario("purge", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["archive"], report  # ArchiveError, a StorageError
    assert refusal["chain"][1] == "builtins.OSError" and "No space left" in refusal["message"]
    after = report.fact("after_refused_purge")
    assert after["lost"] == [] and after["wrong"] == []  # nothing was deleted
    # 12 KiB of the chunk's lines went in before the disk was full, and were taken back
    # (the chunk was not deleted, and the next purge writes it again).
    assert after["archive_bytes"] == 0
    assert report.fact("purged")["purged"] == 30
    archive = report.fact("archive")
    assert archive["missing"] == [] and archive["archived"] == archive["distinct"] == 30


def test_a_purge_whose_delete_is_refused_keeps_every_item(tmp_path: pathlib.Path) -> None:
    # The archive on another disk takes the first chunk; its delete is refused: the items
    # stay in the store, and the next purge archives them again (duplicates, no loss).
    report = run_scenario("purge_delete", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert not refusal["archive"] and refusal["sqlite"] == sqlite_names("SQLITE_FULL"), report
    assert report.fact("after_refused_purge")["lost"] == []
    archive = report.fact("archive")
    assert archive["missing"] == [] and archive["distinct"] == 30
    assert archive["archived"] == 40  # the first chunk twice


# --- drain -------------------------------------------------------------------------------------


def assert_drain_recovered(report: Report, items: int) -> dict[str, Any]:
    """The new drain, with space back and the failed drain's leases lapsed, settles all."""
    after = report.fact("after_refused_drain")
    assert set(after["states"]) <= {"ready", "deferred", "claimed", "done"}, report
    recovery = report.fact("recovery_drain")
    assert recovery["ok"], report
    assert recovery["claimed"] == recovery["unsettled_before"] == recovery["done"], report
    assert recovery["remaining"] == 0
    assert recovery["counts"] == {
        "ready": 0, "deferred": 0, "claimed": 0, "offloaded": 0, "done": items, "failed": 0,
        "cancelled": 0,
    }  # fmt: skip
    return after


def test_drain_on_a_filling_disk_settles_what_it_can_and_strands_nothing(
    tmp_path: pathlib.Path,
) -> None:
    # Rounds of four big results each until a settlement is refused: DrainError, caused by
    # the StorageError; what its summary counts as done is exactly what is done.
    report = run_scenario("drain_settle", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["drain_error"] and refusal["storage"], report
    after = assert_drain_recovered(report, 40)
    assert after["states"].get("done", 0) == after["done_by_summary"] > 0, report


def test_drain_whose_disk_fills_under_the_executor_strands_nothing(
    tmp_path: pathlib.Path,
) -> None:
    # Every settlement of the batch is refused, and so is putting it back: the items stay
    # claimed until their leases lapse, then a new drain takes them over and settles them.
    report = run_scenario("drain_executor_fills", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["drain_error"] and refusal["storage"], report
    after = assert_drain_recovered(report, 12)
    assert after["done_by_summary"] == 0 and "done" not in after["states"], report


def test_drain_on_a_full_disk_claims_nothing(tmp_path: pathlib.Path) -> None:
    report = run_scenario("drain_full", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["error"] == "asyncplane.StorageError", report  # its claim, refused
    after = assert_drain_recovered(report, 12)
    assert after["states"] == {"ready": 12}


def test_drains_own_purge_on_a_full_disk_is_logged_and_the_drain_goes_on(
    tmp_path: pathlib.Path,
) -> None:
    # docs/operating.md: an archive that cannot be written does not stop the drain; the
    # claim after it does meet the full disk, as a StorageError.
    report = run_scenario("drain_retention", tmp_path)
    assert_recovered(report)
    [refusal] = report.refusals()
    assert refusal["error"] == "asyncplane.StorageError", report
    [warning] = report.fact("purge_warnings")["warnings"]
    assert "purge cut short" in warning and "No space left" in warning
    recovery = report.fact("recovery_drain")
    assert (recovery["purged"], recovery["done"], recovery["missing"]) == (20, 6, [])


# --- opening a store, and checkpoints ----------------------------------------------------------


def test_schema_creation_on_a_full_disk_is_typed_and_opens_cleanly_after(
    tmp_path: pathlib.Path,
) -> None:
    # From no room at all to enough, 4 KiB at a time: each opening (schema creation and
    # the first writes) either succeeds or is a StorageError; with space back, the same
    # store object opens, and so does every copy taken at a refusal.
    report = run_scenario("open_new", tmp_path)
    assert_recovered(report)
    refused = {refusal["leave"] for refusal in report.refusals()}
    opened = {fact["leave"] for fact in report.of("fact", what="opened")}
    assert 0 in refused and 200 * 1024 in opened, report
    assert refused | opened == set(range(0, 201 * 1024, 4 * 1024))
    assert "open" in {refusal["stage"] for refusal in report.refusals()}  # the schema's own
    assert len(report.of("retried", ok=True)) == len(refused | opened)


def test_opening_a_closed_store_on_a_full_disk_is_typed(tmp_path: pathlib.Path) -> None:
    # A cleanly closed store has no -shm: opening it needs room for one, which is refused.
    report = run_scenario("open_existing", tmp_path)
    assert_recovered(report)
    assert calls_refused(report) == ["open_existing"]


def test_the_checkpoint_on_close_finds_no_room_and_loses_nothing(tmp_path: pathlib.Path) -> None:
    report = run_scenario("checkpoint_on_close", tmp_path, CHECKPOINT_DISK)
    assert report.refusals() == [], report
    # Closing on the full disk is quiet: the checkpoint cannot grow the database, so the
    # -wal stays whole beside it, and the store opens from it even before space returns.
    assert report.one("closed", phase="full")["ok"], report
    closed = report.fact("closed_full")
    assert closed["frames_after"] == closed["frames_before"] > 300, report
    reopened = report.fact("reopened_full")
    assert reopened["ok"] and reopened["lost"] == [] and reopened["ledger"] == [], report
    assert_recovered(report, size_kib=CHECKPOINT_DISK, refusals=False)  # nothing was refused


def test_a_checkpoint_started_by_a_commit_runs_out_of_room(tmp_path: pathlib.Path) -> None:
    # Past 1,000 WAL pages each commit starts a checkpoint, which fails part-way into the
    # database file: the commits themselves are acknowledged and stay; the next is refused.
    report = run_scenario("autocheckpoint", tmp_path, CHECKPOINT_DISK)
    assert_recovered(report, size_kib=CHECKPOINT_DISK)
    [refusal] = report.refusals()
    assert refusal["acknowledged"] >= 1, report
    fact = report.fact("autocheckpoint")
    assert fact["frames"] >= 1000 and fact["db_after"] > fact["db_before"], report


def test_a_checkpoint_by_another_program_on_a_full_disk_harms_nothing(
    tmp_path: pathlib.Path,
) -> None:
    report = run_scenario("outside_checkpoint", tmp_path, CHECKPOINT_DISK)
    assert_recovered(report, size_kib=CHECKPOINT_DISK)
    assert not report.fact("outside_checkpoint")["ok"]  # sqlite3's own error, not ours
    assert calls_refused(report) == ["enqueue_after_checkpoint"]


def test_a_commit_refused_while_the_wal_index_grows_is_not_there_after_a_crash(
    tmp_path: pathlib.Path,
) -> None:
    # A long read keeps the WAL growing past the 4,062 frames the first 32 KiB of its
    # index covers; the disk has room for the next commit's frames but not for the index's
    # next region. The call is refused (SQLITE_IOERR_SHMSIZE) and the live store does not
    # show it, but its commit frame is in the -wal: the copy taken at the refusal, opened
    # as after a crash, must still hold exactly the acknowledged calls.
    report = run_scenario("wal_index_growth", tmp_path, WAL_INDEX_DISK)
    [refusal] = report.refusals()
    assert refusal["sqlite"] == sqlite_names("SQLITE_IOERR_SHMSIZE"), report
    fact = report.fact("wal_index")
    assert fact["frames_before"] + fact["per_call"] > 4062, report
    assert_recovered(report, size_kib=WAL_INDEX_DISK)


@pytest.mark.parametrize("scenario", ["concurrent-queue", "chaos"])
def test_a_probe_whose_workers_fill_the_disk_says_the_store_failed(
    tmp_path: pathlib.Path, scenario: str
) -> None:
    # The probe's seed fits on the disk; its workers' claims and finishes do not. That is
    # the disk failing under the probe (status 3), not items lost (1), and chaos must not
    # go on killing and replacing workers that can only fail.
    prefix, failures = isolation()
    assert prefix is not None, failures
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = (
        'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" -m asyncplane.probe '
        '--store "$1/probe.db" --scenario "$3" --workers 3 --items 6000 --seed 1'
    )
    done = subprocess.run(
        [*prefix, "sh", "-c", probe, "sh", str(disk), sys.executable, scenario],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert re.fullmatch(
        r"python -m asyncplane.probe: the store failed: worker w\d+: StorageError: "
        r"OperationalError: database or disk is full\n",
        done.stderr,
    ), done.stderr


def test_a_probe_told_to_overwrite_a_store_on_a_read_only_disk_says_the_disk_failed(
    tmp_path: pathlib.Path,
) -> None:
    prefix, failures = isolation()
    assert prefix is not None, failures
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "asyncplane.probe", "--store", str(disk / "probe.db"),
         "--scenario", "kill-and-reclaim"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # a store to overwrite
    probe = (
        'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "$2" -m '
        'asyncplane.probe --store "$1/probe.db" --scenario kill-and-reclaim --overwrite'
    )
    done = subprocess.run(
        [*prefix, "sh", "-c", probe, "sh", str(disk), sys.executable],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith(
        "python -m asyncplane.probe: the store failed: cannot delete the old store: "
        "[Errno 30] Read-only file system"
    ), done.stderr
    assert (disk / "probe.db").exists()
