"""The documentation's dashboard screenshots: an hour of a small fleet, then each page.

    python scripts/dashboard_screenshots.py OUT_DIR [DATABASE]

It plays an hour of work on a store with a manual clock (items enqueued, claimed,
settled, some failing, one worker stalling), samples the dashboard's history once a
simulated minute, then opens each page in headless Chromium (the system's, through
chromium-driver) and saves ``dashboard-<page>.png`` into OUT_DIR. docs/images/ holds the
ones the docs show; the browser tests run this script too.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import shutil
import sys
import tempfile

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from asyncplane import ControlStore
from asyncplane.dashboard import Dashboard
from asyncplane.testing import ManualClock

PAGES = {"overview": "/", "running": "/running", "failures": "/failures",
         "projects": "/projects", "item": "/items/{item}"}  # fmt: skip
ERRORS = ("rate limited by the provider (429)", "the model refused: content policy",
          "timed out after 120 s")  # fmt: skip


async def an_hour(store: ControlStore, clock: ManualClock, dashboard: Dashboard) -> int:
    """Play an hour of a fleet; return the id of an item with a history worth showing."""
    rng = random.Random(7)
    for project, name in (("research", "Research agents"), ("support", "Support replies"),
                          ("ingest", "Document ingest")):  # fmt: skip
        await store.create_project(project, name)
    await store.set_limits("support", max_running=4, per_minute=120, burst=10)
    await store.set_schedule("nightly-digest", project_id="research", payload={"digest": True},
                             cron="0 3 * * *")  # fmt: skip
    await store.set_schedule("inbox-sweep", project_id="support", payload={"sweep": True},
                             every=300)  # fmt: skip
    shown = 0
    for minute in range(60):
        for project, rate in (("research", 6), ("support", 10), ("ingest", 14)):
            burst = rate + int(rate * 0.8 * (1 + (minute % 20 > 12)))
            count = rng.randint(rate, burst)
            prompt = "summarise the attached report"
            jobs = [{"task": f"{project}-{minute}-{n}", "prompt": prompt} for n in range(count)]
            await store.enqueue_many(project, jobs)
        for _ in range(rng.randint(18, 30)):
            claim = await store.claim(f"agent-{rng.randint(1, 6)}@host-{rng.randint(1, 3)}")
            if claim is None:
                break
            roll = rng.random()
            if roll < 0.06:
                await store.finish(claim.item_id, fence=claim.fence, status="failed",
                                   error=rng.choice(ERRORS))  # fmt: skip
                shown = shown or claim.item_id
            elif roll < 0.1:
                await store.retry(claim.item_id, fence=claim.fence, error=ERRORS[0], delay=900)
            else:
                await store.finish(claim.item_id, fence=claim.fence, result={"words": 120})
        await store.run_schedules()
        clock.advance(60.0)
        await dashboard.history.sample()
    if shown:
        await store.requeue(shown)
        again = await store.claim("agent-2@host-1")
        assert again is not None
        await store.finish(again.item_id, fence=again.fence, result={"words": 96})
        shown = again.item_id
    stalled = await store.claim("agent-1@host-1", lease_seconds=60)  # its worker stalled
    assert stalled is not None
    clock.advance(75.0)
    for n in range(4):  # running now
        claim = await store.claim(f"agent-{n + 2}@host-{n % 3 + 1}", lease_seconds=300)
        assert claim is not None
        clock.advance(10.0)
    await dashboard.history.sample()
    return shown


async def main(out: pathlib.Path, location: str) -> None:
    clock = ManualClock()
    clock.set(clock.now() - clock.now() % 3600)
    async with ControlStore(location, clock=clock) as store:
        dashboard = Dashboard(store, allow_actions=True, sample_every=3600)
        url = await dashboard.start("127.0.0.1", 0)
        try:
            item = await an_hour(store, clock, dashboard)
            await asyncio.to_thread(shoot, url, item, out)
        finally:
            await dashboard.stop()


def shoot(url: str, item: int, out: pathlib.Path) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,860", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, path in PAGES.items():
            driver.get(url + path.format(item=item))
            driver.save_screenshot(str(out / f"dashboard-{name}.png"))
    finally:
        driver.quit()


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1])
    if len(sys.argv) > 2:
        asyncio.run(main(target, sys.argv[2]))
    else:  # a plain path, as the pages show it (not a random temporary name)
        home = pathlib.Path(tempfile.gettempdir()) / "asyncplane-demo"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir()
        try:
            asyncio.run(main(target, str(home / "fleet.db")))
        finally:
            shutil.rmtree(home, ignore_errors=True)
