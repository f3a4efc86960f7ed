"""The dashboard in a real browser: headless Chromium (the system's ``chromium``, driven
through its ``chromium-driver`` by Selenium; nothing downloads a browser), on both
backends, with a drain running in the same event loop as the dashboard.

Every WebDriver call blocks, so each runs on a thread (`Browser`) while the loop goes on
serving the pages and running the drain. Waits are WebDriver waits on what the page
shows, never sleeps. A screenshot of each page is saved under ``artifacts/screenshots``
(``$ASYNCPLANE_ARTIFACTS`` to put it elsewhere). If the browser cannot start, the tests
fail, with what to install: they never skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp.web
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from asyncplane import ClaimedItem, ControlStore, Done, Failed, drain
from asyncplane.dashboard import Dashboard

ROOT = pathlib.Path(__file__).parent.parent
SHOTS = pathlib.Path(os.environ.get("ASYNCPLANE_ARTIFACTS", ROOT / "artifacts")) / "screenshots"
WAIT = 30.0  # seconds a page may take to show what the test waits for


class Browser:
    """One headless Chromium, each call on a thread (see the module)."""

    def __init__(self) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        driver = shutil.which("chromedriver")
        if binary is None or driver is None:
            pytest.fail(
                "the browser tests need Chromium and its driver: "
                "apt-get install chromium chromium-driver (scripts/test.sh does, as root)"
            )
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,900"):  # fmt: skip
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)

    async def call(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(function, *args)

    async def get(self, url: str) -> None:
        await self.call(self.driver.get, url)

    async def until(self, condition: Callable[[Any], Any], message: str) -> Any:
        # The live updates replace the page's elements: one read a moment ago goes stale.
        wait = WebDriverWait(
            self.driver,
            WAIT,
            poll_frequency=0.1,
            ignored_exceptions=[StaleElementReferenceException],
        )
        return await self.call(wait.until, condition, message)

    async def text(self, css: str) -> str:
        """An element's text, read in one step in the page (a live swap cannot split it)."""
        found = await self.script(f"return document.querySelector({css!r}).innerText")
        return str(found).strip()

    async def click(self, css: str) -> None:
        await self.script(f"document.querySelector({css!r}).click()")

    async def script(self, source: str) -> Any:
        return await self.call(self.driver.execute_script, source)

    async def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        await self.call(self.driver.save_screenshot, str(SHOTS / f"{name}.png"))

    def errors(self) -> list[dict[str, Any]]:
        """The console's errors since the last look."""
        return [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    found = Browser()
    try:
        yield found
    finally:
        found.driver.quit()


@pytest.fixture
def browser(chromium: Browser) -> Iterator[Browser]:
    """The module's browser on a blank page, its console cleared of what earlier tests'
    pages said (a page whose dashboard stopped goes on asking it for updates)."""
    chromium.driver.get("about:blank")
    chromium.errors()
    yield chromium
    chromium.driver.get("about:blank")


def shows(css: str, text: str) -> Callable[[Any], bool]:
    def check(driver: Any) -> bool:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        return bool(found) and found[0].text.strip() == text

    return check


@contextlib.asynccontextmanager
async def fleet(
    store: ControlStore, failing: set[int], **options: Any
) -> AsyncIterator[tuple[Dashboard, str]]:
    """A dashboard of ``store`` and a drain over it; items in ``failing`` fail once."""

    async def execute(batch: list[ClaimedItem]) -> list[Any]:
        outcomes: list[Any] = []
        for claim in batch:
            if claim.item_id in failing:
                failing.discard(claim.item_id)
                outcomes.append(Failed('quota exceeded: "><img src=x onerror="window.__pwned=1">'))
            else:
                outcomes.append(Done({"ran": claim.item_id}))
        return outcomes

    stop = asyncio.Event()
    dashboard = Dashboard(store, sample_every=0.5, **options)
    url = await dashboard.start("127.0.0.1", 0)
    drained = asyncio.create_task(drain(store, execute, mode="daemon", stop=stop), name="drain")
    try:
        yield dashboard, url
    finally:
        stop.set()
        await drained
        await dashboard.stop()


async def test_each_page_shows_the_fleet_and_follows_it_live(
    store: ControlStore, browser: Browser, asyncplane_backend: str
) -> None:
    await store.create_project("beta", "Beta")
    first = await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
    async with fleet(store, failing={first[0]}, allow_actions=True) as (_, url):
        await browser.get(url + "/")
        await browser.until(shows('.card [data-state="done"]', "4"), "the drain's work shows")
        assert await browser.text('.card [data-state="failed"]') == "1"
        await browser.script("window.__same_page = true")
        await store.enqueue_many("beta", [{"n": n} for n in range(3)])
        await browser.until(shows('.card [data-state="done"]', "7"), "new work shows, live")
        assert await browser.script("return window.__same_page") is True  # not reloaded
        assert await browser.text('#counts tr[data-project="beta"] td[data-state="done"]') == "3"
        await browser.shot(f"overview-{asyncplane_backend}")
        held = await store.enqueue("alpha", {"held": True})  # paused: stays ready
        await store.set_project_status("alpha", "paused")
        for page, css in (("running", "#running"), ("failures", ".group"),
                          ("projects", "#projects"), (f"items/{first[1]}", "#events")):  # fmt: skip
            await browser.get(f"{url}/{page}")
            await browser.until(lambda d, css=css: d.find_elements(By.CSS_SELECTOR, css), page)
            await browser.shot(f"{page.split('/')[0]}-{asyncplane_backend}")
        assert await browser.text("#verdict") == "the row agrees with its history"
        assert (await store.item(held))["state"] == "ready"
        assert browser.errors() == []


async def test_a_failed_item_is_requeued_from_the_page_and_runs(
    store: ControlStore, browser: Browser
) -> None:
    (item_id,) = await store.enqueue_many("alpha", [{"task": "flaky"}])
    async with fleet(store, failing={item_id}, allow_actions=True) as (_, url):
        await browser.get(url + "/failures")
        row = f'tr[data-item="{item_id}"]'
        await browser.until(lambda d: d.find_elements(By.CSS_SELECTOR, row), "the failure shows")
        assert await browser.text(f"{row} button") == "requeue"
        await browser.click(f"{row} button")
        await browser.until(  # back on the failures page, which no longer lists it
            lambda d: (
                d.find_elements(By.ID, "updated") and not d.find_elements(By.CSS_SELECTOR, row)
            ),
            "the page after the requeue",
        )
        await browser.get(f"{url}/items/{item_id}")
        await browser.until(shows("#item-state", "done"), "the requeued item ran")
        assert (await store.item(item_id))["attempts"] == 1
        events = [e["event_type"] for e in await store.events(item_id)]
        assert events == ["queued", "claimed", "failed", "requeued", "claimed", "done"]
        assert browser.errors() == []


async def test_the_live_refresh_leaves_selected_text_alone(
    store: ControlStore, browser: Browser
) -> None:
    # An operator selecting an error to copy lost the selection at the next refresh.
    (item_id,) = await store.enqueue_many("alpha", [{"task": "flaky"}])
    async with fleet(store, failing={item_id}) as (_, url):
        await browser.get(url + "/failures")
        row = f'tr[data-item="{item_id}"]'
        await browser.until(lambda d: d.find_elements(By.CSS_SELECTOR, row), "the failure shows")
        marked = f"document.querySelector('{row}').dataset.mark"
        await browser.script(
            f"document.querySelector('{row}').dataset.mark = 'here';"
            f"window.getSelection().selectAllChildren(document.querySelector('{row} td'));"
        )
        await browser.script("return window.asyncplaneRefresh()")
        assert await browser.script(f"return {marked}") == "here"  # not swapped away
        assert await browser.script("return window.getSelection().toString()") != ""
        # A selection that begins before the live part and ends in it counts too.
        await browser.script(
            "const range = document.createRange();"
            "range.setStartBefore(document.querySelector('header') || document.body.firstChild);"
            f"range.setEndAfter(document.querySelector('{row} td'));"
            "window.getSelection().removeAllRanges(); window.getSelection().addRange(range);"
        )
        await browser.script("return window.asyncplaneRefresh()")
        assert await browser.script(f"return {marked}") == "here"
        await browser.script("window.getSelection().removeAllRanges()")
        await browser.script("return window.asyncplaneRefresh()")
        assert await browser.script(f"return {marked} === undefined")  # swapped: live again
        assert browser.errors() == []


@pytest.mark.postgresql_only
async def test_the_live_page_says_it_is_paused_while_the_store_does_not_answer(
    store: ControlStore, browser: Browser
) -> None:
    # A store that stopped answering held the live update's request until it was back,
    # and the page went on showing its old figures as if they were live.
    await store.enqueue("alpha", {"n": 1})
    async with fleet(store, failing=set()) as (dashboard, url):
        await browser.get(url + "/")
        await browser.until(shows('.card [data-state="done"]', "1"), "the page shows")
        assert await browser.script("return document.body.dataset.giveUpMs") == "30000"
        async with _items_locked(store):
            dashboard.answer_within = 0.5  # (only while held: a loaded machine's pages)
            await browser.script("return window.asyncplaneRefresh()")
            status = "live updates paused: the dashboard answered 503"
            assert await browser.text("#status") == status
        dashboard.answer_within = 15.0
        await browser.script("return window.asyncplaneRefresh()")
        assert await browser.script("return document.getElementById('status').hidden")


@pytest.mark.postgresql_only
async def test_the_live_page_gives_up_on_a_dashboard_that_does_not_answer(
    store: ControlStore, browser: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its request had no time limit: a dashboard process that stopped answering left the
    # page showing its last figures as live. Here the dashboard waits longer (60 s) than
    # the page does (1 s: answer_within plus a margin made -59 s).
    from asyncplane.dashboard import _server

    monkeypatch.setattr(_server, "_GIVE_UP_AFTER_ANSWER", -59.0)
    await store.enqueue("alpha", {"n": 1})
    async with fleet(store, failing=set(), answer_within=60.0) as (_, url):
        await browser.get(url + "/")
        await browser.until(shows('.card [data-state="done"]', "1"), "the page shows")
        assert await browser.script("return document.body.dataset.giveUpMs") == "1000"
        async with _items_locked(store):
            await browser.script("return window.asyncplaneRefresh()")
            status = "live updates paused: the dashboard did not answer in 1 s"
            assert await browser.text("#status") == status
        await browser.script("return window.asyncplaneRefresh()")
        assert await browser.script("return document.getElementById('status').hidden")


@contextlib.asynccontextmanager
async def _items_locked(store: ControlStore) -> AsyncIterator[None]:
    """The store's items locked from another session: every page's read of them waits."""
    import asyncpg

    holder = await asyncpg.connect(store.location)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await holder.close()


async def test_nothing_from_the_store_runs_as_script(store: ControlStore, browser: Browser) -> None:
    hostile = '<script>window.__pwned = 1</script>"><img src=x onerror="window.__pwned=1">'
    await store.create_project("evil", hostile)
    item_id = await store.enqueue("evil", {"x": hostile, hostile: hostile})
    claim = await store.claim(hostile)  # the owner's name, too
    assert claim is not None
    async with fleet(store, failing=set()) as (_, url):
        for path in (f"/items/{item_id}", "/running", "/projects", "/"):
            await browser.get(url + path)
            await browser.until(lambda d: d.find_elements(By.ID, "updated"), path)
            assert await browser.script("return window.__pwned") is None, path
            images = await browser.script("return document.images.length")
            assert images == 0, path
        await browser.get(f"{url}/items/{item_id}")
        shown = await browser.text("#payload")  # as text: JSON, quotes and all
        assert "<script>window.__pwned = 1</script>" in shown and "<img src=x" in shown
        await browser.get(url + "/running")
        assert hostile in await browser.text("#running")  # the owner, whole
        assert browser.errors() == []


async def test_a_token_link_clicked_on_another_site_opens_the_page(
    store: ControlStore, browser: Browser
) -> None:
    # How an `open:` URL is shared: a link on a runbook's page, of another site
    # (localhost is another site than 127.0.0.1). The redirect that sets the cookie is
    # part of that navigation, with which a SameSite=Strict cookie is not sent: a 401.
    token = "r" * 24
    async with fleet(store, failing=set(), token=token) as (_, url):
        link = f'<a id="open" href="{url}/running?token={token}">the dashboard</a>'

        async def runbook(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.Response(text=link, content_type="text/html")

        site = aiohttp.web.Application()
        site.router.add_get("/", runbook)
        runner = aiohttp.web.AppRunner(site)
        await runner.setup()
        try:
            await aiohttp.web.TCPSite(runner, "localhost", 0).start()
            await browser.get(f"http://localhost:{runner.addresses[0][1]}/")
            await browser.until(lambda d: d.find_elements(By.ID, "open"), "the runbook")
            await browser.click("#open")
            await browser.until(lambda d: d.find_elements(By.ID, "running"), "the page, not 401")
            assert await browser.call(lambda: browser.driver.current_url) == url + "/running"
        finally:
            await runner.cleanup()


def test_the_documentation_screenshots_are_made_by_a_script(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dashboard_screenshots.py"), str(tmp_path),
         str(tmp_path / "fleet.db")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made = sorted(p.name for p in tmp_path.glob("dashboard-*.png"))
    assert made == [f"dashboard-{page}.png" for page in sorted(
        ("overview", "running", "failures", "projects", "item"))]  # fmt: skip
    assert all((tmp_path / name).stat().st_size > 10_000 for name in made)
