"""The dashboard over HTTP: the real server on a loopback port, on both backends.

Pages and JSON, the Prometheus text, the actions and what guards them (allow_actions,
the CSRF token, the Origin, the token off loopback), scope (``actor_id``), escaping, the
live fragments, the item's ledger verdict, and the command that serves it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from asyncplane import ControlStore, InvalidInput, Job, cli, verify_ledger
from asyncplane.dashboard import Dashboard, _views
from asyncplane.testing import ManualClock

HOSTILE_PAYLOAD = {"x": "<script>window.__pwned = 1</script>"}
HOSTILE_ERROR = '"><img src=x onerror="window.__pwned = 1">'


@contextlib.asynccontextmanager
async def serving(
    store: ControlStore, host: str = "127.0.0.1", **options: Any
) -> AsyncIterator[tuple[Dashboard, str, aiohttp.ClientSession]]:
    dashboard = Dashboard(store, **options)
    url = await dashboard.start(host, 0)
    if host != "127.0.0.1":
        url = url.replace(host, "127.0.0.1")
    try:
        # unsafe: keep cookies of an IP address's site, as a browser does
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            yield dashboard, url, session
    finally:
        await dashboard.stop()


async def text(session: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, str]:
    async with session.get(url, allow_redirects=False, **kw) as response:
        return response.status, await response.text()


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf-token" content="([^"]+)"', page)
    assert found is not None
    return found.group(1)


async def post(
    session: aiohttp.ClientSession, url: str, data: dict[str, str] | None = None, **kw: Any
) -> tuple[int, str, str | None]:
    async with session.post(url, data=data or {}, allow_redirects=False, **kw) as response:
        return response.status, await response.text(), response.headers.get("Location")


async def seeded(store: ControlStore) -> dict[str, int]:
    """alpha: one done, one failed (hostile error), one running, one ready (hostile
    payload), one retrying; beta: one ready."""
    await store.create_project("beta", "Beta")
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    hostile = await store.enqueue("alpha", HOSTILE_PAYLOAD)
    other = await store.enqueue("beta", {"n": 9})
    batch = await store.claim_batch("worker-1", 4, project_id="alpha")
    await store.finish(batch[0].item_id, fence=batch[0].fence, result={"answer": 42})
    await store.finish(batch[1].item_id, fence=batch[1].fence, status="failed", error=HOSTILE_ERROR)
    await store.retry(batch[3].item_id, fence=batch[3].fence, error="flaky", delay=600)
    return {"done": ids[0], "failed": ids[1], "running": ids[2], "retrying": ids[3],
            "hostile": hostile, "beta": other}  # fmt: skip


async def test_every_page_and_the_json_answer(store: ControlStore) -> None:
    ids = await seeded(store)
    async with serving(store) as (_, url, session):
        for path in ("/", "/running", "/failures", f"/items/{ids['done']}", "/projects"):
            status, page = await text(session, url + path)
            assert status == 200, path
            assert "<title>" in page
        async with session.get(url + "/api/stats") as response:
            assert response.status == 200
            stats = await response.json()
        assert stats["states"]["ready"] == 2 and stats["states"]["failed"] == 1
        assert stats["projects"]["beta"]["ready"] == 1
        assert stats["projects"]["alpha"]["claimed"] == 1
        assert stats["items"] == 6
        _, running = await text(session, url + "/running")
        assert f'data-item="{ids["running"]}"' in running and "worker-1" in running
        _, failures = await text(session, url + "/failures")
        assert "flaky" in failures and f'data-item="{ids["retrying"]}"' in failures
        _, item = await text(session, url + f"/items/{ids['done']}")
        assert "the row agrees with its history" in item
        assert "&#34;answer&#34;: 42" in item
        for event in ("queued", "claimed", "done"):
            assert f'class="event-{event}"' in item
        async with session.get(url + f"/api/items/{ids['failed']}") as response:
            assert (await response.json())["error"] == HOSTILE_ERROR


async def test_the_overview_counts_and_charts(store: ControlStore, clock: ManualClock) -> None:
    ids = await seeded(store)
    async with serving(store) as (dashboard, url, session):
        status, page = await text(session, url + "/")
        assert status == 200
        assert re.search(r'data-state="ready">2<', page)
        assert "settled per minute" in page and "queue depth" in page
        assert re.search(r'id="failure-rate">50\.0%<', page)  # 1 failed of 2 settled
        clock.advance(60.0)
        claim = await store.claim("w2", project_id="beta")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)
        await dashboard.history.sample()
        _, page = await text(session, url + "/")
        assert re.search(r'id="failure-rate">33\.3%<', page)
        assert f'href="/items/{ids["hostile"]}"' in page  # the oldest ready item


async def test_metrics_in_prometheus_text(store: ControlStore) -> None:
    await seeded(store)
    async with serving(store) as (_, url, session), session.get(url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = await response.text()
    assert 'asyncplane_items{project="alpha",state="ready"} 1.0' in body
    assert 'asyncplane_items{project="beta",state="ready"} 1.0' in body
    assert "# TYPE asyncplane_oldest_ready_age_seconds gauge" in body
    assert "asyncplane_expired_leases 0.0" in body


async def test_actions_need_allow_actions_and_the_csrf_token(store: ControlStore) -> None:
    ids = await seeded(store)
    async with serving(store) as (_, url, session):  # actions off
        _, page = await text(session, url + "/")
        status, body, _ = await post(
            session, url + f"/items/{ids['failed']}/requeue", {"csrf": csrf_of(page)}
        )
        assert status == 403 and "actions are off" in body
        assert "<form" not in (await text(session, url + "/failures"))[1]
    assert (await store.item(ids["failed"]))["state"] == "failed"
    async with serving(store, allow_actions=True) as (_, url, session):
        target = url + f"/items/{ids['failed']}/requeue"
        assert (await post(session, target))[0] == 403  # no CSRF token
        assert (await post(session, target, {"csrf": "forged"}))[0] == 403
        _, page = await text(session, url + "/failures")
        token = csrf_of(page)
        status, body, _ = await post(
            session, target, {"csrf": token}, headers={"Origin": "http://evil.example"}
        )
        assert status == 403 and "another site" in body
        assert (await store.item(ids["failed"]))["state"] == "failed"  # nothing changed yet
        status, _, location = await post(session, target, {"csrf": token, "next": "/failures"})
        assert (status, location) == (303, "/failures")
        assert (await store.item(ids["failed"]))["state"] == "ready"
        status, body, _ = await post(session, target, {"csrf": token})
        assert status == 409  # not failed any more
        cancel = url + f"/items/{ids['running']}/cancel"
        async with session.post(
            cancel, data={"csrf": token}, headers={"Accept": "application/json"}
        ) as response:
            assert await response.json() == {"item_id": ids["running"], "state": "cancelled"}
        status, _, location = await post(
            session, url + "/failures/cancel", {"csrf": token, "error": "flaky", "next": "//x"}
        )
        assert (status, location) == (303, "/")  # never a redirect off the dashboard
        assert (await store.item(ids["retrying"]))["state"] == "cancelled"
        beta = {"csrf": token, "project_id": "beta"}
        assert (await post(session, url + "/projects/pause", beta))[0] == 303
        assert (await store.project("beta"))["status"] == "paused"
        assert (await post(session, url + "/projects/resume", beta))[0] == 303
        assert (await store.project("beta"))["status"] == "open"
        # The browser's Origin behind a TLS proxy: the same host, another scheme.
        https = {"Origin": "https://" + url.removeprefix("http://")}
        assert (await post(session, url + "/projects/pause", beta, headers=https))[0] == 303
    assert await verify_ledger(store) == []


async def test_a_failure_group_is_requeued_whole(store: ControlStore) -> None:
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    batch = await store.claim_batch("w", 4)
    for claim in batch[:3]:
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error="quota")
    await store.finish(batch[3].item_id, fence=batch[3].fence, status="failed", error="quota 2")
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        assert page.count("requeue every failed one") == 2  # two groups
        status, _, _ = await post(
            session, url + "/failures/requeue", {"csrf": csrf_of(page), "error": "quota"}
        )
        assert status == 303
    states = [(await store.item(i))["state"] for i in ids]
    assert states == ["ready", "ready", "ready", "failed"]  # the exact error, not a prefix


def form_fields(page: str, action: str) -> dict[str, str]:
    """The hidden fields of the page's form posting to ``action`` (its path)."""
    found = re.search(r'<form method="post" action="' + re.escape(action) + r'".*?</form>', page,
                      re.S)  # fmt: skip
    assert found is not None, action
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', found[0]))


async def test_an_action_from_a_page_shown_a_while_ago_leaves_what_moved_on(
    store: ControlStore, clock: ManualClock
) -> None:
    # A form named the item only: an old page's requeue put back an item requeued and
    # cancelled on purpose since, and a group's cancel cancelled an item a worker had
    # claimed since.
    failed, retrying = await store.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
    first, second = await store.claim_batch("w", 2)
    await store.finish(first.item_id, fence=first.fence, status="failed", error="quota")
    await store.retry(second.item_id, fence=second.fence, error="quota", delay=60)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        requeue = form_fields(page, f"/items/{failed}/requeue")
        assert requeue["state"] == "failed"
        group_cancel = form_fields(page, "/failures/cancel")
        await store.requeue(failed)  # someone else put it back, and then thought better
        assert await store.cancel(failed) == "cancelled"
        clock.advance(61)
        taken = await store.claim("w2")  # the retrying one, claimed by a worker
        assert taken is not None and taken.item_id == retrying
        status, said, _ = await post(session, url + f"/items/{failed}/requeue", requeue)
        assert status == 409 and "is cancelled, not failed as expected" in said
        assert (await post(session, url + "/failures/cancel", group_cancel))[0] == 303
    assert (await store.item(failed))["state"] == "cancelled"
    assert (await store.item(retrying))["state"] == "claimed"  # its worker goes on
    await store.finish(retrying, fence=taken.fence)


async def test_a_cancel_from_the_running_page_leaves_a_later_run_of_its_item(
    store: ControlStore, clock: ManualClock
) -> None:
    # The page shows the item claimed at fence 1; its lease lapses and a worker takes it
    # over, still claimed, at fence 2: the state alone cannot tell the two runs apart.
    item_id = await store.enqueue("alpha", {"n": 1})
    first = await store.claim("w1", lease_seconds=10)
    assert first is not None
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/running")
        cancel = form_fields(page, f"/items/{item_id}/cancel")
        assert (cancel["state"], cancel["fence"]) == ("claimed", "1")
        clock.advance(11)
        second = await store.claim("w2")
        assert second is not None and second.fence == 2
        assert (await post(session, url + f"/items/{item_id}/cancel", cancel))[0] == 303
        assert (await store.item(item_id))["state"] == "claimed"  # w2's run goes on
        _, page = await text(session, url + f"/items/{item_id}")
        shown = form_fields(page, f"/items/{item_id}/cancel")
        assert shown["fence"] == "2"
        # Not a whole number of ASCII digits, or past any fence (int() reads 4,300 digits).
        for bad in ("x", "-1", "1.5", "\u0661", "9" * 20, "9" * 5000):
            status, said, _ = await post(
                session, url + f"/items/{item_id}/cancel", {**shown, "fence": bad}
            )
            assert status == 400 and "fence" in said, (bad, status, said)
        assert (await post(session, url + f"/items/{item_id}/cancel", shown))[0] == 303
    assert (await store.item(item_id))["state"] == "cancelled"


@pytest.mark.parametrize("action", ["requeue", "cancel"])
async def test_a_group_action_leaves_a_member_that_ran_again_since_the_group_was_read(
    store: ControlStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    # Between the group's read and the action on its member, the item runs again and
    # ends with another error, in the same state: it is no longer of the group, and the
    # action, which takes each member at the fence it was read at, leaves it.
    item_id = await store.enqueue("alpha", {"n": 1})
    first = await store.claim("w1")
    assert first is not None
    if action == "requeue":
        await store.finish(item_id, fence=first.fence, status="failed", error="disk full")
    else:
        await store.retry(item_id, fence=first.fence, error="disk full", delay=5)
    read = _views.group_members

    async def read_then_it_runs_again(*args: Any) -> Any:
        members = await read(*args)
        if action == "requeue":
            await store.requeue(item_id)
        clock.advance(6)
        again = await store.claim("w2")
        assert again is not None
        if action == "requeue":
            await store.finish(item_id, fence=again.fence, status="failed", error="bad input")
        else:
            await store.retry(item_id, fence=again.fence, error="bad input", delay=600)
        return members

    monkeypatch.setattr(_views, "group_members", read_then_it_runs_again)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        status, said, _ = await post(
            session,
            url + f"/failures/{action}",
            {"csrf": csrf_of(page), "error": "disk full"},
            headers={"Accept": "application/json"},
        )
    assert status == 200, said
    assert json.loads(said) == {"requeued" if action == "requeue" else "cancelled": 0}
    item = await store.item(item_id)
    assert (item["state"], item["error"]) == (
        "failed" if action == "requeue" else "deferred",
        "bad input",
    )


@pytest.mark.parametrize("action", ["requeue", "cancel"])
async def test_a_group_action_goes_past_a_member_purged_since_the_group_was_read(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    # A retention purge goes by age, not by id: a member read with the group can be gone
    # when its turn comes. The action answered 404 there, and left the rest untouched.
    ids = []
    for n in range(2):
        item_id = await store.enqueue("alpha", {"n": n})
        claim = await store.claim("w")
        assert claim is not None
        if action == "requeue":
            await store.finish(item_id, fence=claim.fence, status="failed", error="db down")
        else:
            await store.retry(item_id, fence=claim.fence, error="db down", delay=600)
        ids.append(item_id)
    read = _views.group_members

    async def one_purged_meanwhile(*args: Any) -> Any:
        return [(2**62, 1), *await read(*args)]  # (no item has that id any more)

    monkeypatch.setattr(_views, "group_members", one_purged_meanwhile)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        status, said, _ = await post(
            session,
            url + f"/failures/{action}",
            {"csrf": csrf_of(page), "error": "db down"},
            headers={"Accept": "application/json"},
        )
    assert status == 200, said
    assert json.loads(said) == {"requeued" if action == "requeue" else "cancelled": 2}
    states = {(await store.item(item_id))["state"] for item_id in ids}
    assert states == {"ready" if action == "requeue" else "cancelled"}


async def test_resuming_a_cron_schedule_without_cronsim_says_what_to_install(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It answered 503, "the store failed": nothing had failed but a missing package.
    from asyncplane import MissingExtra, _schedule

    await store.set_schedule("nightly", project_id="alpha", payload={}, cron="0 3 * * *")
    await store.pause_schedule("nightly")

    def no_cronsim() -> Any:
        raise MissingExtra("cron schedules need the cron extra: pip install 'asyncplane[cron]'")

    monkeypatch.setattr(_schedule, "_cronsim", no_cronsim)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/projects")
        fields = {"csrf": csrf_of(page), "name": "nightly"}
        status, said, _ = await post(session, url + "/schedules/resume", fields)
    assert (status, "asyncplane[cron]" in said) == (501, True), (status, said)
    assert (await store.schedule("nightly"))["paused"] is True


async def test_the_dashboard_leaves_a_closed_project_closed(store: ControlStore) -> None:
    await store.create_project("legacy", "Legacy")
    await store.set_project_status("legacy", "closed")
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/projects")
        row = page.split('data-project="legacy"', 1)[1].split("</tr>", 1)[0]
        assert "resume" not in row and "pause" not in row  # no button for it
        for action in ("resume", "pause"):  # nor a form posted from an older page
            fields = {"csrf": csrf_of(page), "project_id": "legacy"}
            status, said, _ = await post(session, url + f"/projects/{action}", fields)
            assert (status, "is closed" in said) == (409, True), (action, status, said)
    assert (await store.project("legacy"))["status"] == "closed"


async def test_a_close_just_before_a_resume_is_kept(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another operator closes the project while the dashboard's resume is on its way:
    # the close lands first, and the resume (asked of the store "if open or paused")
    # leaves it closed, as it would a project closed before the page was posted.
    await store.create_project("legacy", "Legacy", status="paused")
    change = store.set_project_status

    async def closed_first(project_id: str, status: str, **guard: Any) -> str:
        await change(project_id, "closed")
        return await change(project_id, status, **guard)

    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/projects")
        monkeypatch.setattr(store, "set_project_status", closed_first)
        fields = {"csrf": csrf_of(page), "project_id": "legacy"}
        status, said, _ = await post(session, url + "/projects/resume", fields)
    assert (status, "is closed" in said) == (409, True), (status, said)
    assert (await store.project("legacy"))["status"] == "closed"


async def test_a_token_guards_every_request_off_loopback(store: ControlStore) -> None:
    ids = await seeded(store)
    async with serving(store, host="0.0.0.0", allow_actions=True) as (dashboard, url, session):
        token = dashboard.token
        assert token is not None and len(token) >= 16  # made, as none was given
        for path in (
            "/",
            "/api/stats",
            "/metrics",
            f"/items/{ids['done']}",
            "/static/dashboard.js",
        ):
            assert (await text(session, url + path))[0] == 401, path
        bearer = {"Authorization": f"Bearer {token}"}
        assert (await text(session, url + "/api/stats", headers=bearer))[0] == 200
        wrong = {"Authorization": "Bearer " + "x" * len(token)}
        assert (await text(session, url + "/api/stats", headers=wrong))[0] == 401
        # Once by URL: a cookie, and the same page without the token in its address.
        async with session.get(url + f"/running?token={token}", allow_redirects=False) as answer:
            assert answer.status == 303 and answer.headers["Location"] == "/running"
            cookie = answer.cookies[f"asyncplane_token_{url.rsplit(':', 1)[1]}"]
            assert cookie["httponly"] and cookie["samesite"] == "Lax"
        status, _ = await text(session, url + "/running")
        assert status == 200
        # A script authenticated by its header needs no CSRF token; a cookie-borne one does.
        target = url + f"/items/{ids['failed']}/requeue"
        assert (await post(session, target))[0] == 403
        async with aiohttp.ClientSession() as script:
            status, _, _ = await post(script, target, headers=bearer)
            assert status == 303
    assert (await store.item(ids["failed"]))["state"] == "ready"


async def test_a_given_token_holds_on_loopback_too(store: ControlStore) -> None:
    async with serving(store, token="t" * 20) as (_, url, session):
        assert (await text(session, url + "/"))[0] == 401
        headers = {"Authorization": "Bearer " + "t" * 20}
        assert (await text(session, url + "/", headers=headers))[0] == 200


async def test_the_token_by_header_by_any_case_and_its_cookie_secure_over_tls(
    store: ControlStore,
) -> None:
    token = "t" * 20
    async with serving(store, token=token) as (_, url, session):
        async with session.get(url + "/api/stats") as refused:
            assert refused.status == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
        for scheme in ("Bearer", "bearer", "BEARER"):  # a scheme's name has no case
            headers = {"Authorization": f"{scheme} {token}"}
            assert (await text(session, url + "/api/stats", headers=headers))[0] == 200, scheme
        for forwarded, secure in (({}, False), ({"X-Forwarded-Proto": "https"}, True)):
            async with session.get(
                url + f"/?token={token}", headers=forwarded, allow_redirects=False
            ) as answer:
                cookie = answer.cookies[f"asyncplane_token_{url.rsplit(':', 1)[1]}"]
                assert bool(cookie["secure"]) is secure, forwarded
    with pytest.raises(InvalidInput, match="space"):  # no header could carry it whole
        Dashboard(store, token=" " + token + " ")


async def test_a_long_query_is_not_copied_into_every_form(store: ControlStore) -> None:
    await store.enqueue("alpha", {})
    # Every form's "next" carried the page's query: a link with 7,000 characters of it
    # made the failures page 4 MB, fetched again every 2 seconds by the live updates.
    for claim in await store.claim_batch("w", 1) or []:
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error="boom")
    async with serving(store, allow_actions=True) as (_, url, session):
        _, short = await text(session, url + "/failures?x=1")
        _, long = await text(session, url + "/failures?x=" + "a" * 7000)
        _, encoded = await text(session, url + "/failures?x=" + "%F4%8F%BF%BF" * 600)
    assert 'value="/failures?x=1"' in short
    assert "a" * 7000 not in long and 'value="/failures"' in long
    # 600 characters once read, 7,200 as sent, and so as every form would carry them
    assert "%F4%8F%BF%BF" * 10 not in encoded and 'value="/failures"' in encoded


async def test_an_actor_sees_and_touches_only_its_projects(store: ControlStore) -> None:
    ids = await seeded(store)
    await store.assign("beta", "agent-b")
    async with serving(store, actor_id="agent-b", allow_actions=True) as (_, url, session):
        async with session.get(url + "/api/stats") as response:
            stats = await response.json()
        assert list(stats["projects"]) == ["beta"] and stats["items"] == 1
        assert stats["actor_id"] == "agent-b"
        hidden = await text(session, url + f"/items/{ids['failed']}")
        absent = await text(session, url + "/items/999999")
        assert hidden == absent == (404, "not found\n")  # out of scope looks like absent
        _, page = await text(session, url + "/")
        assert 'data-project="alpha"' not in page and 'data-project="beta"' in page
        for path in ("/running", "/failures", "/projects"):
            assert "alpha" not in (await text(session, url + path))[1], path
        token = csrf_of(page)
        for action, fields in ((f"/items/{ids['failed']}/requeue", {}),
                               (f"/items/{ids['running']}/cancel", {}),
                               ("/projects/pause", {"project_id": "alpha"})):  # fmt: skip
            status, _, _ = await post(session, url + action, {"csrf": token, **fields})
            assert status == 404, action
        body = await text(session, url + "/metrics")
        assert 'project="alpha"' not in body[1] and 'project="beta"' in body[1]
    assert (await store.item(ids["failed"]))["state"] == "failed"
    assert (await store.item(ids["running"]))["state"] == "claimed"
    assert (await store.project("alpha"))["status"] == "open"


async def test_everything_shown_is_escaped(store: ControlStore) -> None:
    ids = await seeded(store)
    async with serving(store) as (_, url, session):
        for path in (f"/items/{ids['hostile']}", f"/items/{ids['failed']}", "/failures"):
            status, page = await text(session, url + path)
            assert status == 200
            assert "<script>window" not in page and "<img src=x" not in page, path
        _, item = await text(session, url + f"/items/{ids['hostile']}")
        assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in item
        async with session.get(url + "/") as response:
            policy = response.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy


async def test_an_item_page_shows_the_first_64_kib_of_a_value(store: ControlStore) -> None:
    # Nested deep, a payload within the store's limits was 90 MB pretty-printed whole,
    # made on the store's event loop every 2 seconds while its page was open.
    deep: Any = [0] * 5_000  # within the 64 KiB a result may be
    for _ in range(90):
        deep = [deep]
    item_id = await store.enqueue("alpha", {"p": deep})
    small = await store.enqueue("alpha", {"n": 1})
    (claim,) = await store.claim_batch("w", 1)
    assert claim.item_id == item_id
    await store.finish(item_id, fence=claim.fence, result=deep)
    async with serving(store) as (_, url, session):
        for live in ({}, {"X-Asyncplane-Live": "1"}):
            status, page = await text(session, url + f"/items/{item_id}", headers=live)
            assert status == 200 and len(page) < 2 * 64 * 1024 + 10_000, len(page)
            cut = f'cut; the whole of it at <a href="/api/items/{item_id}">'
            assert page.count(cut) == 2  # the payload, the result
        async with session.get(url + f"/api/items/{item_id}") as response:
            assert (await response.json())["result"] == deep  # whole there
        _, page = await text(session, url + f"/items/{small}")
        assert "cut;" not in page and '"n": 1' in page.replace("&#34;", '"')


async def test_live_updates_get_the_changing_part_alone(store: ControlStore) -> None:
    ids = await seeded(store)
    async with serving(store) as (_, url, session):
        live = {"X-Asyncplane-Live": "1"}
        status, part = await text(session, url + f"/items/{ids['running']}", headers=live)
        assert status == 200
        assert "<html" not in part and 'id="item-state">claimed<' in part
        await store.cancel(ids["running"])
        _, part = await text(session, url + f"/items/{ids['running']}", headers=live)
        assert 'id="item-state">cancelled<' in part


async def test_the_item_page_gives_the_ledger_verdict_on_that_item(
    store: ControlStore, raw: Any
) -> None:
    ids = await seeded(store)
    raw.execute("UPDATE items SET state = 'done' WHERE item_id = ?", (ids["hostile"],))
    everywhere = await verify_ledger(store)
    assert [p.kind for p in everywhere] == ["terminal_without_event"]
    assert await verify_ledger(store, item_id=ids["hostile"]) == everywhere
    assert await verify_ledger(store, item_id=ids["done"]) == []
    async with serving(store) as (_, url, session):
        _, page = await text(session, url + f"/items/{ids['hostile']}")
        assert "<b>terminal_without_event</b>" in page
        _, page = await text(session, url + f"/items/{ids['done']}")
        assert "the row agrees with its history" in page


async def test_a_held_twins_verdict_is_read_again_when_its_twin_changes(
    store: ControlStore, raw: Any
) -> None:
    # The verdict was kept while the item's own row and history stayed as they were; a
    # held twin's also reads its running twin's row, which changes without them.
    await store.enqueue("alpha", {"n": 1}, fingerprint="f")
    running = await store.claim("w")
    assert running is not None
    held = await store.enqueue("alpha", {"n": 2}, fingerprint="f", dedup=False)
    async with serving(store) as (_, url, session):
        _, page = await text(session, url + f"/items/{held}")
        assert "the row agrees with its history" in page
        raw.execute("UPDATE items SET fingerprint = 'g' WHERE item_id = ?", (running.item_id,))
        assert [p.kind for p in await verify_ledger(store, item_id=held)] == ["twin_stranded"]
        _, page = await text(session, url + f"/items/{held}")
        assert "<b>twin_stranded</b>" in page


async def test_an_items_verdict_is_read_again_when_a_column_a_check_reads_is_edited(
    store: ControlStore, raw: Any
) -> None:
    # Kept by state, fence, updated_at and the last event: an owner edited behind the
    # store's back moved none of them, and the page said the row agreed.
    await store.enqueue("alpha", {"n": 1})
    claim = await store.claim("w")
    assert claim is not None
    async with serving(store) as (_, url, session):
        _, page = await text(session, url + f"/items/{claim.item_id}")
        assert "the row agrees with its history" in page
        raw.execute("UPDATE items SET owner = 'intruder' WHERE item_id = ?", (claim.item_id,))
        _, page = await text(session, url + f"/items/{claim.item_id}")
        assert "<b>owner_disagrees</b>" in page
        # A ready item held in line behind no twin, by an edit no item page shows.
        ready = await store.enqueue("alpha", {"n": 2})
        _, page = await text(session, url + f"/items/{ready}")
        assert "the row agrees with its history" in page
        raw.execute("UPDATE items SET held = ? WHERE item_id = ?", (True, ready))
        _, page = await text(session, url + f"/items/{ready}")
        assert "<b>twin_stranded</b>" in page


async def test_the_queue_depth_card_is_read_now(store: ControlStore) -> None:
    async with serving(store) as (_, url, session):
        await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
        _, page = await text(session, url + "/")
        assert '<span class="n" id="depth-now">5</span>' in page


async def test_an_interval_schedule_shows_its_interval_exactly(store: ControlStore) -> None:
    for name, every in (("a", 150), ("b", 5400), ("c", 1.4), ("d", 86400 * 2 + 60)):
        await store.set_schedule(name, project_id="alpha", payload={}, every=every)
    async with serving(store) as (_, url, session):
        _, page = await text(session, url + "/projects")
    for shown in ("every 2 min 30 s<", "every 1 h 30 min<", "every 1.4 s<", "every 2 d 1 min<"):
        assert shown in page, shown


async def test_settled_per_minute_counts_by_minute_project_and_state(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.create_project("beta", "Beta")
    await store.assign("beta", "agent-b")
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    await store.enqueue("beta", {"n": 9})
    start = clock.now() - clock.now() % 60
    clock.set(start + 1)
    batch = await store.claim_batch("w", 4)
    await store.finish(batch[0].item_id, fence=batch[0].fence)
    await store.finish(batch[1].item_id, fence=batch[1].fence, status="failed", error="x")
    clock.set(start + 61)
    for claim in batch[2:]:
        await store.finish(claim.item_id, fence=claim.fence)
    rows = await store.settled_per_minute(since=start)
    assert [(r["minute"].timestamp() - start, r["project_id"], r["state"], r["count"])
            for r in rows] == [(0, "alpha", "done", 1), (0, "alpha", "failed", 1),
                               (60, "alpha", "done", 1), (60, "beta", "done", 1)]  # fmt: skip
    scoped = await store.settled_per_minute(since=start, actor_id="agent-b")
    assert [(r["project_id"], r["count"]) for r in scoped] == [("beta", 1)]
    assert await store.settled_per_minute(since=start + 120) == []
    assert len(await store.settled_per_minute()) == 4  # the last hour, by default


def test_the_command_serves_until_a_signal(
    location_of: Callable[[str], str], asyncplane_backend: str
) -> None:
    location = location_of("served.db")

    async def seed() -> None:
        async with ControlStore(location) as store:
            await store.create_project("alpha", "Alpha")
            await store.enqueue("alpha", {"n": 1})

    asyncio.run(seed())
    given = "g" * 20  # from the environment: off the process list, which --token is on
    for extra, needs_token, env in (
        ([], False, {}), (["--host", "0.0.0.0"], True, {}),
        (["--host", "0.0.0.0"], given, {"ASYNCPLANE_DASHBOARD_TOKEN": given}),
    ):  # fmt: skip
        with subprocess.Popen(
            [sys.executable, "-m", "asyncplane.cli", "dashboard", location, "--port", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env},
        ) as served:  # fmt: skip
            try:
                _look_at(served, needs_token)
                # SIGHUP (its terminal closed) as SIGTERM: it killed the command before.
                served.send_signal(signal.SIGHUP if env else signal.SIGTERM)
                assert served.wait(timeout=30) == 0
            finally:
                if served.poll() is None:
                    served.kill()
                    served.wait()


@pytest.mark.postgresql_only
async def test_a_second_signal_ends_the_command_at_once(url: str) -> None:
    # A stop waits for the requests in progress (and a store that stopped answering held
    # its closing up for a minute): further signals did nothing, for minutes.
    import asyncpg

    from _signals import until

    async with ControlStore(url) as store:
        await store.create_project("alpha", "Alpha")
    holder = await asyncpg.connect(url)
    held = holder.transaction()
    await held.start()
    await holder.execute("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")  # every page waits
    served = _dashboard_command(url, "--log-level", "info")
    try:
        assert served.stdout is not None and served.stderr is not None
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"

        async def pages_waiting() -> bool:
            # (From a connection of its own: a transaction reads the activity once.)
            looker = await asyncpg.connect(url)
            try:
                return bool(await looker.fetchval(waiting))
            finally:
                await looker.close()

        # Its first sample waits already (before it serves): the command is stopped then.
        await until(pages_waiting, what="the dashboard's first read held up")
        assert served.poll() is None
        served.send_signal(signal.SIGTERM)
        line = ""
        while "stopping" not in line:  # (a deadline: the line never said fails the test)
            line = await asyncio.wait_for(asyncio.to_thread(served.stderr.readline), 60)
            assert line, "the command ended"
        served.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(served.wait, 30) == 1
        assert "stopped at once (a second signal)" in served.stderr.read()
    finally:
        if served.poll() is None:
            served.kill()
            served.wait()
        served.stdout.close()  # type: ignore[union-attr]
        served.stderr.close()  # type: ignore[union-attr]
        await held.rollback()
        await holder.close()


def _dashboard_command(location: str, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncplane.cli", "dashboard", location, "--port", "0", *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip


def _look_at(served: subprocess.Popen[str], needs_token: bool | str) -> None:
    """Read the command's first lines, then ask it for its stats (with its token: the one
    it printed, or the one given, ``needs_token``, which it must not print)."""
    assert served.stdout is not None and served.stderr is not None
    lines = []
    while not (line := served.stdout.readline()).startswith("listening on "):
        assert line, served.stderr.read()
        lines.append(line)
    found = re.fullmatch(r"listening on http://([\d.]+):(\d+)\n", line)
    assert found is not None, line
    port = int(found.group(2))
    tokens = [x.split(": ", 1)[1].strip() for x in lines if x.startswith("token: ")]
    if isinstance(needs_token, str):
        assert not tokens and needs_token not in "".join(lines)  # given, so not printed
        tokens = [needs_token]
        refused = urllib.request.Request(f"http://127.0.0.1:{port}/api/stats")
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(refused, timeout=30)
    else:
        assert bool(tokens) == needs_token
    headers = {"Authorization": f"Bearer {tokens[0]}"} if tokens else {}
    stats = urllib.request.Request(f"http://127.0.0.1:{port}/api/stats", headers=headers)
    with urllib.request.urlopen(stats, timeout=30) as response:
        assert json.load(response)["states"]["ready"] == 1
    if not tokens:  # read-only without --allow-actions: no forms at all
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
            assert b"<form" not in response.read()


@pytest.mark.sqlite_only
async def test_a_read_only_store_refuses_actions_even_when_allowed(
    asyncplane_store_factory: Callable[..., Any], tmp_path: Any
) -> None:
    writer: ControlStore = await asyncplane_store_factory("ro.db")
    await writer.create_project("alpha", "Alpha")
    item_id = await writer.enqueue("alpha", {"n": 1})
    reader = ControlStore(tmp_path / "ro.db", read_only=True)
    try:
        async with serving(reader, allow_actions=True) as (_, url, session):
            _, page = await text(session, url + "/")
            status, body, _ = await post(
                session, url + f"/items/{item_id}/cancel", {"csrf": csrf_of(page)}
            )
            assert status == 403 and "read-only" in body
    finally:
        await reader.close()
    assert (await writer.item(item_id))["state"] == "ready"


@pytest.mark.sqlite_only
def test_an_address_the_command_cannot_serve_on_is_a_usage_error(tmp_path: Any) -> None:
    # A port taken, a host that does not resolve: a setting to change (2), not a store
    # that failed (3).
    asyncio.run(_make_store(str(tmp_path / "s.db")))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for extra, said in (
            (["--port", port], f"cannot serve on --host 127.0.0.1 --port {port}"),
            (["--host", "nowhere.invalid", "--port", "0"], "cannot serve on --host nowhere"),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "asyncplane.cli", "dashboard", str(tmp_path / "s.db"),
                 *extra],
                capture_output=True, text=True, timeout=60,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )  # fmt: skip
            assert done.returncode == 2, done.stderr
            assert said in done.stderr, done.stderr


def test_without_the_extra_the_command_names_it(tmp_path: Any) -> None:
    script = (
        "import sys; sys.modules['aiohttp'] = None\n"
        "from asyncplane import cli\n"
        "raise SystemExit(cli.main(['dashboard', sys.argv[1]]))\n"
    )
    asyncio.run(_make_store(str(tmp_path / "s.db")))
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s.db")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'asyncplane[dashboard]'" in done.stderr


async def _make_store(path: str) -> None:
    async with ControlStore(path) as store:
        await store.create_project("alpha", "Alpha")


async def test_a_page_named_by_another_host_is_refused_without_a_token(
    store: ControlStore,
) -> None:
    # DNS rebinding: a hostile name pointed at 127.0.0.1 would make its pages same-origin
    # with the dashboard's; naming it in Host is refused, so nothing can be read or sent.
    ids = await seeded(store)
    async with serving(store, allow_actions=True) as (_, url, session):
        port = url.rsplit(":", 1)[1]
        evil = {"Host": f"evil.example:{port}"}
        assert (await text(session, url + "/api/stats", headers=evil))[0] == 421
        _, page = await text(session, url + "/")
        status, _, _ = await post(
            session, url + f"/items/{ids['running']}/cancel", {"csrf": csrf_of(page)},
            headers={**evil, "Origin": f"http://evil.example:{port}"},
        )  # fmt: skip
        assert status == 421
        for name in ("localhost", "127.0.0.1"):
            found = {"Host": f"{name}:{port}"}
            assert (await text(session, url + "/api/stats", headers=found))[0] == 200
    assert (await store.item(ids["running"]))["state"] == "claimed"


async def test_the_token_link_never_leads_off_the_dashboard(store: ControlStore) -> None:
    token = "s" * 24
    async with serving(store, token=token) as (_, url, session):
        for path, target in (("//evil.example/", "/evil.example/"),
                             ("/%2F%2Fevil.example", "/%2F%2Fevil.example"),
                             ("/running", "/running")):  # fmt: skip
            async with session.get(
                url + path + f"?token={token}&x=1", allow_redirects=False
            ) as response:
                assert response.status == 303, path
                assert response.headers["Location"] == target + "?x=1", path
    # A stale cookie (an earlier run's token) does not hide a fresh ?token=.
    async with serving(store, token=token) as (_, url, _unused):
        port = url.rsplit(":", 1)[1]
        stale = {"Cookie": f"asyncplane_token_{port}={'stale' * 5}"}
        async with aiohttp.ClientSession() as browser:
            assert (await text(browser, url + "/", headers=stale))[0] == 401
            assert (await text(browser, url + f"/?token={token}", headers=stale))[0] == 303
            right = {"Cookie": f"asyncplane_token_{port}={token}"}
            assert (await text(browser, url + "/?token=caf\u00e9", headers=right))[0] == 303


async def test_group_actions_reach_past_one_page(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncplane.dashboard import _views

    monkeypatch.setattr(_views, "PAGE_ROWS", 2)
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(5)])
    for claim in await store.claim_batch("w", 5):
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error="quota")
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        (key,) = group_keys(page)
        assert "5 failed (the newest 2 shown)" in page  # the heading counts them all
        # Newer failures push the group past the page's rows: its key is still found.
        newer = await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
        for claim in await store.claim_batch("w", 3):
            await store.finish(claim.item_id, fence=claim.fence, status="failed", error="other")
        for fields, then in (({"group": "0" * 32}, "failed"), ({"group": key}, "ready"),
                             ({"error": "quota"}, "ready")):  # fmt: skip
            status, _, _ = await post(
                session, url + "/failures/requeue", {"csrf": csrf_of(page), **fields}
            )
            assert status == 303
            assert [(await store.item(i))["state"] for i in ids] == [then] * 5, fields
            for claim in await store.claim_batch("w", 5):  # failed again, for the next
                await store.finish(claim.item_id, fence=claim.fence, status="failed", error="quota")
    assert [(await store.item(i))["state"] for i in newer] == ["failed"] * 3


async def test_a_group_key_is_looked_for_among_the_newest_rows_only(
    store: ControlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stale key (a second click) walked every item in the state: seconds on a big store.
    from asyncplane.dashboard import _views

    monkeypatch.setattr(_views, "PAGE_ROWS", 2)
    monkeypatch.setattr(_views, "LOOK_ROWS", 4)
    (old,) = await store.enqueue_many("alpha", [{"n": 0}])
    claim = await store.claim("w")
    assert claim is not None
    await store.finish(old, fence=claim.fence, status="failed", error="ancient")
    key = _views.group_key("ancient")
    newer = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    for claim in await store.claim_batch("w", 4):
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error="recent")
    read: list[int] = []
    items = store.items

    async def counted(**kwargs: Any) -> Any:
        read.append(1)
        return await items(**kwargs)

    monkeypatch.setattr(store, "items", counted)
    assert await _views.group_error(_views.Scope(store, None), "failed", key) is None
    assert len(read) == 2  # LOOK_ROWS / PAGE_ROWS pages, not the whole state
    assert (await store.item(old))["state"] == "failed" and len(newer) == 4


async def test_a_project_or_schedule_of_any_name_is_acted_on_by_name(
    store: ControlStore,
) -> None:
    for name in ("a/b", ".."):
        await store.create_project(name, "odd")
    await store.set_schedule("../nightly", project_id="a/b", payload={}, every=60)
    await store.set_schedule("nightly", project_id="alpha", payload={}, every=60)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/projects")
        token = csrf_of(page)
        for name in ("a/b", ".."):
            fields = {"csrf": token, "project_id": name}
            assert (await post(session, url + "/projects/pause", fields))[0] == 303
            assert (await store.project(name))["status"] == "paused"
        fields = {"csrf": token, "name": "../nightly"}
        assert (await post(session, url + "/schedules/pause", fields))[0] == 303
    assert (await store.schedule("../nightly"))["paused"]
    assert not (await store.schedule("nightly"))["paused"]
    assert (await store.project("alpha"))["status"] == "open"


async def test_malformed_requests_get_plain_refusals(store: ControlStore) -> None:
    ids = await seeded(store)
    async with serving(store, allow_actions=True) as (dashboard, url, session):
        port = url.rsplit(":", 1)[1]
        assert (await text(session, url + "/", headers={"Host": "[::1"}))[0] == 421
        for no_item in ("%C2%B2", "0", "-1", "00", str(2**63), "9" * 19, "9" * 20):
            assert (await text(session, url + f"/items/{no_item}"))[0] == 404, no_item
            assert (await text(session, url + f"/api/items/{no_item}"))[0] == 404, no_item
        _, page = await text(session, url + "/")
        token = csrf_of(page)
        long_name = {"csrf": token, "name": "x" * 1000}
        assert (await post(session, url + "/schedules/pause", long_name))[0] == 400
        # The Origin's host is what counts: a TLS proxy changes its scheme and port.
        cancel = url + f"/items/{ids['running']}/cancel"
        status, _, _ = await post(
            session, cancel, {"csrf": token},
            headers={"Origin": "https://evil.example:8443", "Host": f"localhost:{port}"},
        )  # fmt: skip
        assert status == 403
        assert (await store.item(ids["running"]))["state"] == "claimed"
        status, _, _ = await post(
            session, cancel, {"csrf": token},
            headers={"Origin": "https://localhost:8443", "Host": f"localhost:{port}"},
        )  # fmt: skip
        assert status == 303
        assert (await store.item(ids["running"]))["state"] == "cancelled"
        with pytest.raises(InvalidInput, match="serving already"):
            await dashboard.start("127.0.0.1", 0)


async def test_a_wrong_bearer_beside_a_good_cookie_still_needs_the_csrf_token(
    store: ControlStore,
) -> None:
    ids = await seeded(store)
    token = "k" * 20
    async with serving(store, token=token, allow_actions=True) as (_, url, session):
        assert (await text(session, url + f"/?token={token}"))[0] == 303  # the cookie
        wrong = {"Authorization": "Bearer nope"}
        status, _, _ = await post(session, url + f"/items/{ids['running']}/cancel", headers=wrong)
        assert status == 403
    assert (await store.item(ids["running"]))["state"] == "claimed"


def group_keys(page: str) -> list[str]:
    """The error groups' keys in a failures page's forms, in the page's order."""
    return re.findall(r'name="group" value="([0-9a-f]+)"', page)


@pytest.mark.parametrize("stored", ["Ärger: TIMEOUT", "upstream said:\nrate limited"])
async def test_an_error_group_is_acted_on_whole(store: ControlStore, stored: str) -> None:
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    for claim in await store.claim_batch("w", 3):
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error=stored)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        (key,) = group_keys(page)
        status, _, _ = await post(
            session, url + "/failures/requeue", {"csrf": csrf_of(page), "group": key}
        )
        assert status == 303
    assert [(await store.item(i))["state"] for i in ids] == ["ready"] * 3


async def test_groups_whose_errors_differ_in_line_breaks_are_listed_and_acted_on_apart(
    store: ControlStore,
) -> None:
    # A browser sends a form's field with every line break as CR LF: with the error in
    # the form, a group's action reached every group its text read as once sent.
    errors = ["a\r\nb", "a\rb", "a\nb"]
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    claims = sorted(await store.claim_batch("w", 4), key=lambda c: c.item_id)
    for claim, error in zip(claims, [*errors, "a\rb"], strict=True):
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error=error)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        keys = group_keys(page)
        assert len(keys) == 3  # "a\rb" (twice: the biggest group), then "a\nb", "a\r\nb"
        fields = {"csrf": csrf_of(page), "group": keys[2]}
        assert (await post(session, url + "/failures/requeue", fields))[0] == 303
        assert [(await store.item(i))["state"] for i in ids] == [
            "ready",
            "failed",
            "failed",
            "failed",
        ]
        fields = {"csrf": csrf_of(page), "error": "a\rb"}  # a script: the exact text
        assert (await post(session, url + "/failures/requeue", fields))[0] == 303
    assert [(await store.item(i))["state"] for i in ids] == ["ready", "ready", "failed", "ready"]


async def test_the_failures_page_shows_a_bounded_piece_of_each_error(
    store: ControlStore,
) -> None:
    # Each error whole, escaped, twice (shown and in its group's form): 500 errors of
    # 16,000 '"' made an 80 MB page, on the store's event loop, every 2 seconds.
    ids = await store.enqueue_many("alpha", [{"n": n} for n in range(20)])
    for claim in await store.claim_batch("w", 20):
        error = f"{claim.item_id} " + '"' * 16_000
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error=error)
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        assert len(page) < 20 * 8_000, len(page)  # 1,024 characters a group, escaped
        assert page.count("cut; the whole of it on") == 20
        assert f'cut; the whole of it on <a href="/items/{ids[0]}">' in page
        keys = group_keys(page)
        assert len(keys) == 20
        fields = {"csrf": csrf_of(page), "group": keys[0]}
        assert (await post(session, url + "/failures/requeue", fields))[0] == 303
    assert [(await store.item(i))["state"] for i in ids].count("ready") == 1


async def test_the_failures_page_finds_items_retrying_behind_many_deferred_without_error(
    store: ControlStore,
) -> None:
    # The page read the newest 500 deferred items and kept those with an error: 500 items
    # deferred without one (not_before, a park, a rate limit) hid every retrying item.
    item_id = await store.enqueue("alpha", {})
    claim = await store.claim("w")
    assert claim is not None
    await store.retry(item_id, fence=claim.fence, error="DB connection refused", delay=3600)
    later = datetime.now(timezone.utc) + timedelta(days=1)
    await store.enqueue_many("alpha", [Job({"n": n}, not_before=later) for n in range(501)])
    async with serving(store) as (_, url, session):
        _, page = await text(session, url + "/failures")
    assert "DB connection refused" in page
    assert f'href="/items/{item_id}"' in page


async def test_a_form_that_cannot_be_read_is_a_bad_request_with_the_usual_headers(
    store: ControlStore,
) -> None:
    item_id = await store.enqueue("alpha", {})
    unknown_charset = {"Content-Type": "application/x-www-form-urlencoded; charset=nosuch"}
    multipart = {"Content-Type": "multipart/form-data; boundary=b"}
    nameless_part = b"--b\r\nContent-Disposition: form-data\r\n\r\n1\r\n--b--\r\n"
    token = "t" * 20
    bearer = {"Authorization": f"Bearer {token}"}  # no CSRF form to read: read all the same
    async with serving(store, allow_actions=True, token=token) as (_, url, session):
        for body, headers in (
            (b"csrf=x", unknown_charset), (nameless_part, multipart),
            (b"next=/", {**unknown_charset, **bearer}),
        ):  # fmt: skip
            async with session.post(
                url + f"/items/{item_id}/cancel", data=body, headers={**bearer, **headers},
                allow_redirects=False,
            ) as response:  # fmt: skip
                assert response.status == 400, await response.text()
                assert response.headers["X-Frame-Options"] == "DENY"
                assert "Content-Security-Policy" in response.headers
    assert (await store.item(item_id))["state"] == "ready"  # refused before acting


async def test_a_request_the_store_does_not_answer_in_time_is_answered_503(
    location_of: Callable[[str], str], asyncplane_backend: str
) -> None:
    # A store that stopped answering (a server frozen, a file another process locks)
    # held every page until it was back: 116 s against a frozen server, and the live
    # page's script, waiting too, never said it was paused.
    where = location_of("held.db")
    async with (
        ControlStore(where) as store,
        serving(store, allow_actions=True) as (dashboard, url, session),
    ):
        await store.create_project("alpha", "Alpha")
        item = await store.enqueue("alpha", {"n": 1})
        token = csrf_of((await text(session, url + "/projects"))[1])  # before the hold
        # A short limit while the store is held (a page of a loaded machine, unheld, may
        # take longer than that), and the client's own, so that this fails, not hangs.
        within = aiohttp.ClientTimeout(total=30)
        async with _store_held(where, asyncplane_backend):
            dashboard.answer_within = 0.3
            status, body, _ = await post(
                session, url + f"/items/{item}/cancel", {"csrf": token}, timeout=within
            )
            assert status == 503
            assert body == (
                "the store did not answer within 0.3 s (the action may still take effect)\n"
            )
            if asyncplane_backend == "postgresql":  # (SQLite's reads go on beside a writer)
                async with session.get(url + "/", timeout=within) as response:
                    assert response.status == 503
                    assert await response.text() == "the store did not answer within 0.3 s\n"
                    assert "default-src 'none'" in response.headers["Content-Security-Policy"]
        dashboard.answer_within = 15.0
        assert (await text(session, url + "/projects"))[0] == 200  # answered again
        assert (await store.item(item))["state"] in ("ready", "cancelled")  # whole, or not
        assert await verify_ledger(store) == []


@contextlib.asynccontextmanager
async def _store_held(where: str, backend: str) -> AsyncIterator[None]:
    """Hold the store's items from another connection: every write of them waits (and,
    on PostgreSQL, every read)."""
    if backend == "sqlite":
        import sqlite3

        holder = sqlite3.connect(where, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    import asyncpg

    conn = await asyncpg.connect(where)
    try:
        async with conn.transaction():
            await conn.execute("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await conn.close()


async def test_a_port_in_use_leaves_nothing_behind(store: ControlStore) -> None:
    async with serving(store) as (_, url, _session):
        taken = int(url.rsplit(":", 1)[1])
        second = Dashboard(store)
        with pytest.raises(OSError, match="in use"):
            await second.start("127.0.0.1", taken)
        url_again = await second.start("127.0.0.1", 0)  # stopped cleanly: it starts again
        await second.stop()
        assert url_again != url


async def test_a_body_the_transfer_cannot_decode_is_a_bad_request(store: ControlStore) -> None:
    item_id = await store.enqueue("alpha", {})
    token = "t" * 20
    headers = {"Authorization": f"Bearer {token}", "Content-Encoding": "gzip",
               "Content-Type": "application/x-www-form-urlencoded"}  # fmt: skip
    async with (
        serving(store, allow_actions=True, token=token) as (_, url, session),
        session.post(
            url + f"/items/{item_id}/cancel", data=b"csrf=x&next=/", headers=headers,
            allow_redirects=False,
        ) as response,
    ):  # fmt: skip
        assert response.status == 400, await response.text()
        assert "Content-Security-Policy" in response.headers
    assert (await store.item(item_id))["state"] == "ready"


async def test_an_empty_error_group_is_no_deferred_item_without_an_error(
    store: ControlStore, clock: ManualClock
) -> None:
    later = await store.enqueue("alpha", {"n": 1}, not_before=clock.now() + 600)
    await store.enqueue("alpha", {"n": 2})
    (claim,) = await store.claim_batch("w", 1)
    await store.finish(claim.item_id, fence=claim.fence, status="failed")  # no error text
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/failures")
        fields = {"csrf": csrf_of(page), "error": ""}
        assert (await post(session, url + "/failures/cancel", fields))[0] == 303
        assert (await post(session, url + "/failures/requeue", fields))[0] == 303
    assert (await store.item(later))["state"] == "deferred"  # deferred, never failed
    assert (await store.item(claim.item_id))["state"] == "ready"  # the "" failed group


async def test_the_next_page_after_an_action_stays_on_the_dashboard(store: ControlStore) -> None:
    await store.enqueue("alpha", {})
    async with serving(store, allow_actions=True) as (_, url, session):
        _, page = await text(session, url + "/")
        for back, target in (("/\t/evil.example/", "/"), ("/\r\n/evil.example/", "/"),
                             ("/\\evil.example/", "/"), ("https://evil.example/", "/"),
                             ("/running\t", "/running"), ("/../admin", "/"),
                             ("/%2e%2E/admin", "/"), ("/.%2e/admin?x", "/"),
                             ("/x/..\\admin", "/"), ("/items/1/./", "/"),
                             ("/items/..1", "/items/..1")):  # fmt: skip
            fields = {"csrf": csrf_of(page), "project_id": "alpha", "next": back}
            status, _, location = await post(session, url + "/projects/pause", fields)
            assert (status, location) == (303, target), back


async def test_the_running_page_shows_lapsed_leases_first_beyond_one_page(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.enqueue_many("alpha", [{"n": n} for n in range(510)])
    await store.claim_batch("long", 500, lease_seconds=3600)
    lapsing = await store.claim_batch("short", 10, lease_seconds=30)
    clock.advance(60)
    async with serving(store) as (_, url, session):
        _, page = await text(session, url + "/running")
        assert "510 (showing 500" in page and ">10 stuck<" in page
        shown = [int(i) for i in re.findall(r'<tr class="stuck" data-item="(\d+)"', page)]
        assert sorted(shown) == sorted(c.item_id for c in lapsing)
        async with session.get(url + "/api/stats") as response:
            assert (await response.json())["expired_leases"] == 10


async def test_the_settled_figures_follow_a_requeue(
    store: ControlStore, clock: ManualClock
) -> None:
    await store.enqueue_many("alpha", [{"n": n} for n in range(4)])
    batch = await store.claim_batch("w", 4)
    for claim, error in zip(batch, ("quota", "quota", "other"), strict=False):
        await store.finish(claim.item_id, fence=claim.fence, status="failed", error=error)
    await store.finish(batch[3].item_id, fence=batch[3].fence)
    async with serving(store, allow_actions=True) as (dashboard, url, session):
        await dashboard.history.sample()
        _, page = await text(session, url + "/")
        assert re.search(r'id="failure-rate">75\.0%<', page)
        clock.advance(300)  # minutes later: the failures' minute is long past
        await dashboard.history.sample()
        fields = {"csrf": csrf_of(page), "error": "quota"}
        assert (await post(session, url + "/failures/requeue", fields))[0] == 303
        await dashboard.history.sample()
        _, page = await text(session, url + "/")
        assert "(1 of 2)" in page, "the dashboard's own requeue shows at once"
        await store.requeue(batch[2].item_id)  # elsewhere: shown from the next minute on
        clock.advance(60)
        await dashboard.history.sample()
        _, page = await text(session, url + "/")
        assert "(0 of 1)" in page


async def test_the_oldest_ready_age_is_the_stores_own(
    store: ControlStore, clock: ManualClock, asyncplane_store_factory: Any
) -> None:
    first = await store.enqueue("alpha", {})
    ahead = ManualClock(clock.now() + 600)  # a writer whose clock runs ten minutes ahead
    other = await asyncplane_store_factory(clock=ahead)
    await other.enqueue("alpha", {})
    clock.advance(30)
    async with serving(store) as (_, url, session), session.get(url + "/api/stats") as response:
        shown = (await response.json())["oldest_ready_age_s"]
    assert shown == (await store.stats())["oldest_ready_age_s"] == 30.0
    await store.cancel(first)
    async with serving(store) as (_, url, session), session.get(url + "/api/stats") as response:
        assert (await response.json())["oldest_ready_age_s"] == 0.0  # never below
    assert (await store.stats())["oldest_ready_age_s"] == 0.0


async def test_metrics_give_the_last_minute_as_the_store_has_it_now(
    store: ControlStore, clock: ManualClock
) -> None:
    # Settled after the dashboard's last sample: a scrape early in the next minute still
    # counts them (the history is only as fresh as its sample).
    clock.set(clock.now() - clock.now() % 60 + 30)  # half a minute into a minute
    await store.enqueue_many("alpha", [{"n": n} for n in range(3)])
    async with serving(store) as (dashboard, url, session):
        await dashboard.history.sample()
        clock.advance(10)
        for claim in await store.claim_batch("w", 3):
            await store.finish(claim.item_id, fence=claim.fence)
        clock.advance(25)  # the next minute, before the next sample
        async with session.get(url + "/metrics") as response:
            body = await response.text()
    assert 'asyncplane_settled_per_minute{state="done"} 3.0' in body


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("short", "holds 5 characters: a dashboard's token is at least 16"),
        ("", "holds 0 characters"),  # set, but empty: a secret not filled in, not "none"
        ("t" * 20 + "\n", "holds 21 characters, with a space or a newline at an end"),
    ],
)
def test_a_bad_token_from_the_environment_is_a_usage_error_naming_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    given: str, said: str,
) -> None:  # fmt: skip
    asyncio.run(_make_store(str(tmp_path / "s.db")))
    monkeypatch.setenv("ASYNCPLANE_DASHBOARD_TOKEN", given)
    assert cli.main(["dashboard", str(tmp_path / "s.db")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncplane dashboard: $ASYNCPLANE_DASHBOARD_TOKEN ") and said in err
    assert "--token" not in err


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--token", "short"], "--token must be at least 16 characters"),
        (["--actor", ""], "--actor must not be empty"),
        (["--actor", "a" * 300], "--actor is longer than 256 characters"),
        (["--host", ""], "--host must not be empty"),
        (["--port", "70000"], "--port must be 0 to 65535, not 70000"),
    ],
)
def test_a_bad_option_is_a_usage_error(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], option: list[str], said: str
) -> None:
    asyncio.run(_make_store(str(tmp_path / "s.db")))
    assert cli.main(["dashboard", str(tmp_path / "s.db"), *option]) == 2
    assert capsys.readouterr().err == f"asyncplane dashboard: {said}\n"


async def test_mounted_under_a_prefix_every_link_and_redirect_stays_under_it(
    store: ControlStore,
) -> None:
    ids = await seeded(store)
    dashboard = Dashboard(store, allow_actions=True)
    site = aiohttp.web.Application()

    async def own_page(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text="the host's own page")

    site.router.add_get("/", own_page)
    site.add_subapp("/ops", dashboard.app())
    runner = aiohttp.web.AppRunner(site)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            status, page = await text(session, base + "/ops/failures")
            assert status == 200
            links = re.findall(r'(?:href|src|action)="([^"#]*)"', page)
            assert links and all(link.startswith("/ops/") for link in links), links
            for link in {link for link in links if not link.endswith(("/requeue", "/cancel"))}:
                assert (await text(session, base + link))[0] == 200, link
            assert await text(session, base + "/") == (200, "the host's own page")
            form = {"csrf": csrf_of(page), "next": "/elsewhere"}
            status, _, where = await post(
                session, base + f"/ops/items/{ids['failed']}/requeue", form
            )
            assert (status, where) == (303, "/ops/")  # not a page of the host's
            dots = {"csrf": form["csrf"], "project_id": "beta", "next": "/ops/../admin"}
            status, _, where = await post(session, base + "/ops/projects/pause", dots)
            assert (status, where) == (303, "/ops/")  # nor through a dot segment
            form["next"] = "/ops/failures"
            status, _, where = await post(
                session, base + f"/ops/items/{ids['hostile']}/cancel", form
            )
            assert (status, where) == (303, "/ops/failures")
    finally:
        await runner.cleanup()
    assert (await store.item(ids["failed"]))["state"] == "ready"


@contextlib.asynccontextmanager
async def site_of(mounts: dict[str, Dashboard], host: str = "127.0.0.1") -> AsyncIterator[str]:
    """A site of the caller's with each dashboard's application mounted at its prefix:
    the site's URL."""
    site = aiohttp.web.Application()
    for prefix, dashboard in mounts.items():
        site.add_subapp(prefix, dashboard.app())
    runner = aiohttp.web.AppRunner(site)
    await runner.setup()
    try:
        await aiohttp.web.TCPSite(runner, host, 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def mounted(
    store: ControlStore, prefix: str = "/ops", host: str = "127.0.0.1", **options: Any
) -> AsyncIterator[tuple[Dashboard, str]]:
    """A dashboard mounted at ``prefix`` in a site of its own: it, and the site's URL."""
    dashboard = Dashboard(store, **options)
    async with site_of({prefix: dashboard}, host) as base:
        yield dashboard, base


def samplers() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "asyncplane-dashboard-sampler"]


async def test_a_mounted_dashboard_samples_as_a_started_one_does(store: ControlStore) -> None:
    await store.enqueue("alpha", {})
    async with mounted(store, sample_every=0.01) as (dashboard, base):
        async with aiohttp.ClientSession() as session:
            _, page = await text(session, base + "/ops/")
        shown = re.search(r"\((\d+) samples\)", page)
        assert shown is not None and int(shown.group(1)) >= 1  # the first at the startup
        dashboard.history.sampled.clear()
        await asyncio.wait_for(dashboard.history.sampled.wait(), 30)  # and on
        assert len(samplers()) == 1
    assert samplers() == []  # stopped with the site


async def test_a_started_dashboard_samples_before_anyone_looks(store: ControlStore) -> None:
    # The depth chart's last hour is there when an operator first opens the page.
    dashboard = Dashboard(store, sample_every=0.01)
    await dashboard.start("127.0.0.1", 0)
    try:
        dashboard.history.sampled.clear()
        await asyncio.wait_for(dashboard.history.sampled.wait(), 30)  # no request made
        assert len(samplers()) == 1
    finally:
        await dashboard.stop()
    assert samplers() == []


async def test_each_mounted_dashboard_keeps_its_own_token_cookie(store: ControlStore) -> None:
    # One jar per host name, whatever the port, and a cookie of path / goes to every
    # path: with one name and path for all, logging in to one logged out of the other.
    tokens = {"/a": "a" * 20, "/b": "b" * 20}
    async with (
        site_of({p: Dashboard(store, token=t) for p, t in tokens.items()}) as one,
        site_of({"/a": Dashboard(store, token="c" * 20)}) as two,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser,
    ):
        logins = [(one + "/a", "a" * 20), (one + "/b", "b" * 20), (two + "/a", "c" * 20)]
        for base, token in logins:
            async with browser.get(f"{base}/?token={token}", allow_redirects=False) as answer:
                assert answer.status == 303
                (cookie,) = answer.cookies.values()
                prefix = "/" + base.rsplit("/", 1)[1]
                port = base.split(":")[2].split("/")[0]
                assert cookie.key == f"asyncplane_token_{port}%2F{prefix[1:]}"
                assert cookie["path"] == prefix + "/"
        for base, _ in logins:
            assert (await text(browser, base + "/running"))[0] == 200, base


async def test_a_prefix_no_cookie_path_can_hold_gets_the_sites_root(
    store: ControlStore,
) -> None:
    # "Path=/a;b/" would end at the ";": a browser keeps no such cookie, and every page
    # after the ?token= link would be a 401. The name alone keeps it apart there.
    token = "t" * 20
    async with (
        site_of({"/a;b": Dashboard(store, token=token)}) as site,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser,
    ):
        async with browser.get(f"{site}/a;b/?token={token}", allow_redirects=False) as answer:
            assert answer.status == 303
            (cookie,) = answer.cookies.values()
            assert cookie["path"] == "/" and cookie.key.endswith("%2Fa%3Bb")
        assert (await text(browser, site + "/a;b/running"))[0] == 200


@pytest.mark.parametrize(
    ("peer", "status"),
    [("192.0.2.7", 403), ("2001:db8::7", 403), ("::ffff:192.0.2.7", 403),
     ("unknown", 403), ("_hidden", 403), ("192.0.2.7:5555", 403), ("[192.0.2.7]", 403),
     ("::ffff:127.0.0.1", 200), ("::1", 200), ("127.0.0.2", 200)],
)  # fmt: skip
async def test_without_a_token_a_mounted_dashboard_answers_this_machine_alone(
    store: ControlStore, peer: str, status: int
) -> None:
    # A site that listens beyond loopback (0.0.0.0, say): start() would have made a
    # token; a mounted application cannot know the bind. The peer's address is set as a
    # site's proxy-headers middleware sets it (X-Forwarded-For).
    @aiohttp.web.middleware
    async def forwarded(request: aiohttp.web.Request, handler: Any) -> Any:
        return await handler(request.clone(remote=peer))

    token = "t" * 20
    for given, expected in ((None, status), (token, 200)):  # with a token, the token decides
        site = aiohttp.web.Application(middlewares=[forwarded])
        site.add_subapp("/ops", Dashboard(store, allow_actions=True, token=given).app())
        runner = aiohttp.web.AppRunner(site)
        await runner.setup()
        try:
            await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
            base = f"http://127.0.0.1:{runner.addresses[0][1]}/ops"
            bearer = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(headers=bearer) as session:
                got, page = await text(session, base + "/projects")
                assert got == expected, given
                assert (await text(session, base + "/api/stats"))[0] == expected
                if expected == 403:
                    said = "this dashboard has no token: it answers this machine only\n"
                    assert page == said
                    fields = {"project_id": "alpha"}
                    assert (await post(session, base + "/projects/pause", fields))[0] == 403
        finally:
            await runner.cleanup()
    assert (await store.project("alpha"))["status"] == "open"


async def test_without_a_token_a_dashboard_on_a_unix_socket_answers(
    store: ControlStore, tmp_path: pathlib.Path
) -> None:
    # A Unix socket's peer has no address: the socket file's rights decide who reaches it.
    site = aiohttp.web.Application()
    site.add_subapp("/ops", Dashboard(store).app())
    runner = aiohttp.web.AppRunner(site)
    await runner.setup()
    try:
        await aiohttp.web.UnixSite(runner, str(tmp_path / "dash.sock")).start()
        connector = aiohttp.UnixConnector(path=str(tmp_path / "dash.sock"))
        async with aiohttp.ClientSession(connector=connector) as session:
            assert (await text(session, "http://localhost/ops/projects"))[0] == 200
    finally:
        await runner.cleanup()


async def test_a_site_whose_own_startup_fails_leaves_no_sampler_behind(
    store: ControlStore,
) -> None:
    # aiohttp never cleans up a mounted application when its site's startup fails after
    # the application's own: a sampler started there would run on, and reopen the store.
    site = aiohttp.web.Application()
    site.add_subapp("/ops", Dashboard(store, sample_every=0.01).app())

    async def fails(app: aiohttp.web.Application) -> None:
        raise RuntimeError("the site's own startup")

    site.on_startup.append(fails)
    runner = aiohttp.web.AppRunner(site)
    with pytest.raises(RuntimeError, match="the site's own startup"):
        await runner.setup()
    await runner.cleanup()
    assert [t for t in asyncio.all_tasks() if t.get_name() == "asyncplane-dashboard-sampler"] == []


async def test_two_sites_of_one_dashboard_sample_until_the_last_stops(
    store: ControlStore,
) -> None:
    dashboard = Dashboard(store, sample_every=0.01)
    async with site_of({"/ops": dashboard}) as first, aiohttp.ClientSession() as session:
        async with site_of({"/ops": dashboard}) as second:
            assert (await text(session, second + "/ops/"))[0] == 200  # sampling from here
        # The second site cleaned up: the first still serves, and is still sampled.
        dashboard.history.sampled.clear()
        await asyncio.wait_for(dashboard.history.sampled.wait(), 30)
        assert (await text(session, first + "/ops/"))[0] == 200
    assert samplers() == []


async def test_an_item_page_shows_the_newest_events_of_a_long_ledger(
    store: ControlStore,
) -> None:
    # Retried hundreds of times, each with a long error: the page shows the newest
    # events, and says how many earlier ones it leaves to `asyncplane events`.
    from asyncplane.dashboard import _views

    item_id = await store.enqueue("alpha", {})
    for attempt in range(_views.EVENTS_SHOWN):  # a claim and a retry each: 2 events
        claim = await store.claim("w")
        assert claim is not None
        await store.retry(item_id, fence=claim.fence, error=f"try {attempt}", delay=0)
    async with serving(store) as (_, url, session):
        status, page = await text(session, url + f"/items/{item_id}")
    assert status == 200
    rows = re.findall(r'<tr><td class="num">(\d+)</td>', page)
    assert len(rows) == _views.EVENTS_SHOWN
    assert "earlier ones: <code>asyncplane events</code>" in page
    assert int(rows[-1]) == (await store.events(item_id))[-1]["event_id"]  # the newest kept
