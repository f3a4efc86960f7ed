"""Faults, power loss: a store whose WAL was cut anywhere comes back as an acknowledged prefix.

A power loss leaves the database file and a ``-wal`` file that stops somewhere: at a frame
boundary, inside a frame's 24-byte header, inside its page, inside the WAL's 32-byte
header, or with damaged bytes. A workload of every kind of call runs on a live store while
a read transaction pins the base, so the WAL holds every commit; the files are copied with
the store still open, and each damaged copy is opened as a fresh store. It must open, pass
the ledger check, take new work, and hold exactly the calls acknowledged up to the last
commit frame wholly before the damage, nothing after.

The generation and the checks live in scripts/power_cuts.py, which runs the same check at
scale (every frame boundary, many random cuts); here about fifty cuts are sampled.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import random
import sys
import types
from typing import Any

import pytest

pytestmark = pytest.mark.sqlite_only  # the mechanism is SQLite's WAL file


def _load_power_cuts() -> types.ModuleType:
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "power_cuts.py"
    spec = importlib.util.spec_from_file_location("power_cuts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


power_cuts = _load_power_cuts()

SEED = 20260101
ITEMS = 25  # about 70 calls (one commit each) in some 400 frames
SAMPLED_CUTS = 50


@pytest.fixture(scope="module", params=["NORMAL", "FULL"])
def workload(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One workload per synchronous level, its files copied while the store was open."""
    directory = tmp_path_factory.mktemp(f"power-{request.param.lower()}")
    return asyncio.run(
        power_cuts.generate(
            directory,
            seed=SEED,
            items=ITEMS,
            synchronous=request.param,
            live_copy_at=ITEMS,
        )
    )


async def check(workload: Any, damage: Any, tmp_path: pathlib.Path, **kwargs: Any) -> Any:
    where = tmp_path / f"{damage.kind}-{damage.position}"
    return await power_cuts.check_copy(workload, damage, where, **kwargs)


def test_the_wal_holds_every_acknowledged_commit_over_an_untouched_base(workload: Any) -> None:
    # What the rest rests on: no checkpoint reached the database file, the WAL is whole
    # frames of one generation, and each acknowledged call is one commit frame with a
    # state of its own.
    assert workload.base_untouched
    size = power_cuts.FRAME_HEADER + workload.page_size
    assert len(workload.wal) == power_cuts.WAL_HEADER + len(workload.frames) * size
    acks = workload.acks
    assert [ack.commits for ack in acks] == list(range(len(acks)))
    assert len(workload.commit_frames) == len(acks) - 1
    assert workload.frames[-1].commit
    assert len({ack.state for ack in acks}) == len(acks)
    assert set(workload.calls()) == set(power_cuts.CALLS)
    assert workload.refused > 0  # stale reports were refused, and wrote nothing
    # Commits are spread over frames: cuts inside a transaction's frames are possible.
    assert len(workload.frames) > 2 * len(workload.commit_frames)


async def test_a_cut_at_the_full_length_loses_nothing(
    workload: Any, tmp_path: pathlib.Path
) -> None:
    outcome = await check(workload, power_cuts.Damage("full", len(workload.wal)), tmp_path)
    assert outcome.ok, outcome.describe(workload)
    assert outcome.matched == len(workload.acks) - 1
    assert outcome.lost == 0


async def test_every_sampled_cut_comes_back_as_the_acknowledged_prefix(
    workload: Any, tmp_path: pathlib.Path
) -> None:
    damages = power_cuts.sample_cuts(workload, SAMPLED_CUTS, random.Random(SEED))
    assert {damage.kind for damage in damages} == {
        "wal-header",
        "boundary",
        "frame-header",
        "page-data",
        "full",
    }
    outcomes = [await check(workload, damage, tmp_path) for damage in damages]
    failures = [outcome.describe(workload) for outcome in outcomes if not outcome.ok]
    assert not failures, "\n".join(failures)
    # The later the cut, the longer the prefix, from the base to the last call.
    reflected = [outcome.matched for outcome in outcomes]
    assert reflected == sorted(reflected)
    assert reflected[0] == 0
    assert reflected[-1] == len(workload.acks) - 1
    assert len(set(reflected)) > 5


async def test_cuts_inside_a_commit_frame_lose_that_commit_alone(
    workload: Any, tmp_path: pathlib.Path
) -> None:
    # The last byte of a commit frame missing loses its transaction; the whole frame
    # keeps it; a cut just inside the next frame's header changes nothing.
    frame = workload.commit_frames[len(workload.commit_frames) // 2]
    before, whole, after = [
        await check(workload, power_cuts.Damage(kind, position), tmp_path)
        for kind, position in (
            ("page-data", frame.end - 1),
            ("boundary", frame.end),
            ("frame-header", frame.end + 1),
        )
    ]
    for outcome in (before, whole, after):
        assert outcome.ok, outcome.describe(workload)
    assert whole.matched == before.matched + 1 == after.matched


@pytest.mark.parametrize("position", [0, 1, 8, 16, 24, 31])
async def test_a_cut_inside_the_wal_header_comes_back_as_the_base(
    workload: Any, tmp_path: pathlib.Path, position: int
) -> None:
    outcome = await check(workload, power_cuts.Damage("wal-header", position), tmp_path)
    assert outcome.ok, outcome.describe(workload)
    assert outcome.matched == 0


@pytest.mark.parametrize(
    ("which", "lost"),
    [
        ("wal-header", "everything"),
        ("first-commit-frame", "everything"),
        ("last-frame-header", "the last call"),
        ("last-frame-page", "the last call"),
    ],
)
async def test_a_flipped_byte_ends_the_log_before_its_frame(
    workload: Any, tmp_path: pathlib.Path, which: str, lost: str
) -> None:
    # A checksum mismatch is a cut at the damaged frame: that frame and every later one
    # are lost, even whole commits after it (the checksums chain).
    names = ["wal-header", "first-commit-frame", "last-frame-header", "last-frame-page"]
    damage = power_cuts.flips(workload)[names.index(which)]
    outcome = await check(workload, damage, tmp_path)
    assert outcome.ok, outcome.describe(workload)
    last = len(workload.acks) - 1
    assert outcome.matched == (0 if lost == "everything" else last - 1)


async def test_a_copy_taken_while_the_writer_runs_is_a_prefix_too(
    workload: Any, tmp_path: pathlib.Path
) -> None:
    live = workload.live
    damage = power_cuts.live_cut(workload)  # the base, and a prefix of the final WAL
    outcome = await check(workload, damage, tmp_path)
    assert outcome.ok, outcome.describe(workload)
    assert live.first <= outcome.matched <= live.last


async def test_the_check_notices_a_copy_that_is_not_the_predicted_prefix(
    workload: Any, tmp_path: pathlib.Path
) -> None:
    # The check is not vacuous: told to expect one commit more, or one fewer, than a cut
    # at a commit frame's end keeps, it reports a phantom or a lost call.
    frame = workload.commit_frames[len(workload.commit_frames) // 3]
    damage = power_cuts.Damage("boundary", frame.end)
    commits = power_cuts.commits_before(workload.frames, frame.end)
    more = await check(workload, damage, tmp_path / "more", expect_commits=commits + 1)
    fewer = await check(workload, damage, tmp_path / "fewer", expect_commits=commits - 1)
    assert not more.ok and more.lost == 1 and more.phantom == 0
    assert not fewer.ok and fewer.phantom == 1 and fewer.lost == 0
