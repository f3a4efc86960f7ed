"""Logs: every logger asyncplane uses is documented, and what each says at which level.

Nothing is logged per item above DEBUG except failures, and a record about one item
carries its id (and project, attempt, fence) as ``extra`` fields.
"""

from __future__ import annotations

import logging
import pathlib
import re

import pytest

from asyncplane import ClaimedItem, ControlStore, Done, drain, work

ROOT = pathlib.Path(__file__).parent.parent


def used_loggers() -> set[str]:
    found = set()
    for path in (ROOT / "src" / "asyncplane").rglob("*.py"):
        found.update(re.findall(r'getLogger\("(asyncplane[a-z._]*)"\)', path.read_text()))
    return found


def test_every_logger_is_documented() -> None:
    page = (ROOT / "docs" / "observability.md").read_text()
    page = page[page.index("## Logs") : page.index("## Metrics")]
    documented = set(re.findall(r"^\| `(asyncplane[a-z._]*)` \|", page, flags=re.MULTILINE))
    used = used_loggers() - {"asyncplane"}  # the root is only configured (the commands)
    assert used <= documented, used - documented
    assert documented <= used, documented - used


async def test_per_item_records_are_debug_but_failures(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    async def handle(claim: ClaimedItem) -> Done:
        if claim.payload["n"] == 2:
            raise ValueError("the model said no")
        return Done()

    with caplog.at_level(logging.DEBUG, logger="asyncplane"):
        ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
        await work(store, handle, until_empty=True, owner="w")
    records = [r for r in caplog.records if r.name.startswith("asyncplane")]
    assert {r.name for r in records} <= used_loggers() - {"asyncplane"}
    about_items = [r for r in records if hasattr(r, "item_id")]
    loud = [r for r in about_items if r.levelno > logging.DEBUG]
    assert [(r.name, r.levelname, r.item_id) for r in loud] == [
        ("asyncplane.worker", "WARNING", ids[2])
    ]
    (failure,) = loud
    assert (failure.project_id, failure.attempt, failure.fence) == ("alpha", 1, 1)
    assert failure.exc_info is not None
    quiet = [r for r in records if r.levelno > logging.DEBUG and r not in loud]
    assert [(r.name, r.levelname) for r in quiet] == [
        ("asyncplane.worker", "INFO"), ("asyncplane.worker", "INFO")
    ]  # fmt: skip
    assert any(r.levelno == logging.DEBUG and r.name == "asyncplane.store" for r in records)


async def test_drain_says_when_it_starts_stops_or_is_skipped(
    store: ControlStore, caplog: pytest.LogCaptureFixture
) -> None:
    await store.enqueue("alpha", {"n": 1})

    async def execute(batch: list[ClaimedItem]) -> list[Done]:
        with caplog.at_level(logging.INFO, logger="asyncplane"):
            skipped = await drain(store, execute, owner="second")
        assert skipped.skipped
        return [Done() for _ in batch]

    with caplog.at_level(logging.INFO, logger="asyncplane"):
        await drain(store, execute, owner="first")
    said = [(r.name, r.getMessage()) for r in caplog.records if r.name == "asyncplane.drain"]
    assert said[0] == ("asyncplane.drain", "drain first starting (foreground)")
    assert said[1] == ("asyncplane.drain", "drain second skipped: another drainer holds the guard")
    assert said[2][1].startswith("drain first stopped: ")
