"""The SIGKILL family of the fault suite, modelled on Jepsen's total-queue checker.

Client processes (tests/workers/kill_worker.py) run a seeded random mix of every write
the store offers, recording each call before and after it in an fsynced acknowledgement
log, while the campaign (tests/workers/kill_campaign.py) SIGKILLs one at random moments
and starts a replacement. Afterwards the checker (tests/workers/kill_check.py) holds the
logs against the store and its purge archive: nothing acknowledged lost, nothing done
twice, nothing nobody asked for, every fence refusal explained by the ledger, and
verify_ledger clean. The checker must also really fail: doctored logs below.

Set ASYNCPLANE_KILL_SEED to replay a campaign's schedule of victims (the moments still
depend on timing); scripts/fault_campaign.py runs many campaigns in a row.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import pytest

from asyncplane import ControlStore, verify_ledger

sys.path.insert(0, str(pathlib.Path(__file__).parent / "workers"))
import kill_campaign
import kill_check

SEED = int(os.environ.get("ASYNCPLANE_KILL_SEED", "20261201"))
KILLS = 12
WORKERS = 4


@pytest.mark.slow
async def test_sigkilled_clients_lose_nothing_and_settle_nothing_twice(
    location_of: Callable[[str], str],
    tmp_path: pathlib.Path,
    raw_of: Callable[[ControlStore], Any],
) -> None:
    location, work = location_of("kill.db"), tmp_path / "campaign"
    result = await kill_campaign.run_campaign(
        location, work, workers=WORKERS, kills=KILLS, seed=SEED
    )
    assert result.failures() == [], result.summary()
    assert result.kills == KILLS, result.summary()
    report = result.report
    assert report.lost == [] and report.duplicated == [] and report.unexpected == []
    assert report.inconsistent == [] and report.ledger_problems == [] and report.stuck == []
    # The campaign did exercise what it is about: acknowledged writes, refused late
    # reports, leases taken over, items purged to the archive and checked there.
    assert report.acknowledged > 100, result.summary()
    assert report.refused > 0 and report.takeovers > 0 and report.purged > 0, result.summary()
    assert set(report.states) <= {"done", "failed"}, result.summary()

    # The same checker, on the same store, once an acknowledged item has gone behind the
    # store's back (deleted as a purge deletes, but never archived): lost, and named.
    acks = sorted((work / "acks").glob("*.acks.jsonl"))
    archive = work / "archive.jsonl"
    records, _ = kill_check.read_acks(acks)
    acked = {r["item_id"] for r in records if r["t"] == "ok" and r["f"] == "enqueue"}
    async with ControlStore(location, archive_path=archive) as store:
        raw = raw_of(store)
        in_store = {row[0] for row in raw.execute("SELECT item_id FROM items").fetchall()}
        victim = min(acked & in_store)
        raw.execute("DELETE FROM items WHERE item_id = ?", (victim,))
        raw.execute("DELETE FROM events WHERE item_id = ?", (victim,))
        tampered = await kill_check.check(store, acks, [archive])
    assert any(f"(item {victim})" in problem for problem in tampered.lost), tampered.failures()


# --- the checker can fail -------------------------------------------------------------------


class History:
    """An acknowledgement log written by hand, in the clients' format."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.n = 0

    def call(
        self,
        op: str,
        args: dict[str, Any],
        done: dict[str, Any] | None = None,
        *,
        t: str = "ok",
        w: str = "c1",
    ) -> int:
        self.n += 1
        self.records.append({"w": w, "n": self.n, "t": "invoke", "f": op, **args})
        self.records.append({"w": w, "n": self.n, "t": t, "f": op, **(done or {})})
        return self.n

    def write(self, path: pathlib.Path) -> pathlib.Path:
        log = kill_check.AckLog(path)
        try:
            for record in self.records:
                log.write(record)
        finally:
            log.close()
        return path


async def true_history(store: ControlStore) -> tuple[History, dict[str, int]]:
    """Real calls on the store, recorded as a client records them."""
    history = History()
    await store.create_project(kill_check.PROJECT, "K")
    a = await store.enqueue(kill_check.PROJECT, {"token": "c1-1"})
    history.call("enqueue", {"token": "c1-1"}, {"token": "c1-1", "item_id": a})
    b = await store.enqueue(kill_check.PROJECT, {"token": "c1-2"})
    history.call("enqueue", {"token": "c1-2"}, {"token": "c1-2", "item_id": b})
    (claim,) = await store.claim_batch("c1", 1)
    assert claim.item_id == a
    history.call("claim", {"owner": "c1", "limit": 1}, {"claims": [[a, claim.fence, "c1-1"]]})
    await store.finish(a, fence=claim.fence, result={"fence": claim.fence})
    history.call("finish", {"item_id": a, "fence": claim.fence, "status": "done"})
    return history, {"a": a, "b": b, "fence": claim.fence}


def ghost_enqueue(history: History, ids: dict[str, int]) -> None:
    history.call("enqueue", {"token": "c1-9"}, {"token": "c1-9", "item_id": ids["b"] + 1000})


def done_but_ready(history: History, ids: dict[str, int]) -> None:
    history.call("finish", {"item_id": ids["b"], "fence": 1, "status": "done"})


def claim_handed_twice(history: History, ids: dict[str, int]) -> None:
    claims = {"claims": [[ids["a"], ids["fence"], "c1-1"]]}
    history.call("claim", {"owner": "c2", "limit": 1}, claims, w="c2")


def unexplained_refusal(history: History, ids: dict[str, int]) -> None:
    history.call(
        "renew",
        {"item_id": ids["a"], "fence": ids["fence"]},
        {"error": "FenceRejected", "current_fence": ids["fence"] + 3, "state": "claimed"},
        t="fail",
    )


def drain_miscounted(history: History, ids: dict[str, int]) -> None:
    summary = {"skipped": False, "claimed": 2, "fence_rejected": 0}
    history.call("drain", {"owner": "c1-d", "max_iters": 1}, {"summary": summary})


@pytest.mark.parametrize(
    ("doctor", "kind"),
    [
        (ghost_enqueue, "lost"),
        (done_but_ready, "lost"),
        (claim_handed_twice, "duplicated"),
        (unexplained_refusal, "inconsistent"),
        (drain_miscounted, "inconsistent"),
    ],
)
async def test_the_checker_fails_a_doctored_log(
    location_of: Callable[[str], str],
    tmp_path: pathlib.Path,
    doctor: Callable[[History, dict[str, int]], None],
    kind: str,
) -> None:
    archive = tmp_path / "archive.jsonl"
    async with ControlStore(location_of("doctored.db"), archive_path=archive) as store:
        history, ids = await true_history(store)
        honest = await kill_check.check(store, [history.write(tmp_path / "honest.jsonl")], [])
        assert honest.failures() == []
        assert (honest.acknowledged, honest.items) == (4, 2)
        doctor(history, ids)
        report = await kill_check.check(store, [history.write(tmp_path / "doctored.jsonl")], [])
    assert report.failures() != []
    assert getattr(report, kind), report.failures()
    others = {"lost", "duplicated", "unexpected", "inconsistent", "ledger_problems"} - {kind}
    assert all(getattr(report, other) == [] for other in others), report.failures()


async def test_the_checker_names_an_item_nobody_enqueued(
    location_of: Callable[[str], str], tmp_path: pathlib.Path
) -> None:
    async with ControlStore(location_of("stranger.db")) as store:
        history, _ = await true_history(store)
        stranger = await store.enqueue(kill_check.PROJECT, {"token": "nobody-1"})
        report = await kill_check.check(store, [history.write(tmp_path / "acks.jsonl")], [])
    assert report.unexpected == [
        f"item {stranger} holds token 'nobody-1', which no client enqueued"
    ]
    assert report.lost == report.duplicated == report.inconsistent == []


async def test_a_purged_item_counts_only_if_the_archive_holds_it(
    location_of: Callable[[str], str], tmp_path: pathlib.Path
) -> None:
    archive = tmp_path / "archive.jsonl"
    async with ControlStore(location_of("purged.db"), archive_path=archive) as store:
        history, ids = await true_history(store)
        await asyncio.sleep(0.1)  # settled before the purge's cutoff, by any clock
        assert (await store.purge(0)).purged == 1  # item a leaves the store for the archive
        acks = [history.write(tmp_path / "acks.jsonl")]
        with_archive = await kill_check.check(store, acks, [archive])
        without = await kill_check.check(store, acks, [])
        assert await verify_ledger(store) == []
    assert with_archive.failures() == [] and with_archive.purged == 1
    assert any(f"item {ids['a']}" in problem for problem in without.lost), without.failures()


def test_the_archive_reader_skips_torn_lines(tmp_path: pathlib.Path) -> None:
    # A purge killed mid-write leaves a torn line; the next append ends it with a newline.
    item = {"item_id": 7, "state": "done", "fence": 1, "payload": {"token": "t"}}
    line = {"archived_at": "2026-01-01T00:00:00+00:00", "item": item, "events": []}
    archive = tmp_path / "archive.jsonl"
    archive.write_text('{"archived_at": "2026-\n' + json.dumps(line) + "\n" + '{"item": {"ite')
    items, skipped = kill_check.read_archive([archive, tmp_path / "archive.jsonl.1"])
    assert set(items) == {7} and items[7]["state"] == "done"
    assert skipped == 2
