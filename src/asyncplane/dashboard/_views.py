"""What each dashboard page shows, read through the public store API.

The dashboard is a client of `ControlStore` like any other: every read and action passes
the dashboard's ``actor_id``, so ``--actor`` scopes the pages exactly as ``actor_id=``
scopes the API (a project, item or schedule outside the actor's projects is "not found",
never "forbidden": a denial does not reveal that the target exists).

`History` keeps what the overview's charts need and the store cannot give in one read:
the settled items per minute over the last hour (the whole hour read at the first sample
of each minute and after each of the dashboard's own actions, only the last two minutes
at the samples between: an item requeued or purged leaves its minute within a minute)
and the queue depth, sampled here since the dashboard started (a store keeps no history
of its depth).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from asyncplane import _errors, _ledger, _models
from asyncplane._store import ControlStore

__all__ = ("Glance", "History", "Scope", "Shown", "Verdicts")

#: The most rows a list page shows (the newest first).
PAGE_ROWS = 500
#: The most claimed items the running page looks through for lapsed leases, to show
#: those first (the most one listing reads).
LOOK_ROWS = 10_000
#: The window of the overview's charts, in seconds.
WINDOW = 3600.0
#: The most characters of one value an item page shows (its payload, its result, an
#: event's detail; an error is at most 16 KiB, the store's MAX_ERROR_LENGTH): a page is
#: made whole on the store's event loop, and asked for again every 2 seconds while it is
#: open, so it must stay small whatever the store holds (a 1 MiB payload nested 98 levels
#: deep, pretty-printed whole, was 90 MB).
SHOWN_CHARS = 64 * 1024
#: The most characters of a group's error the failures page shows (it lists up to 1,000
#: groups; the whole error is on its items' pages).
GROUP_SHOWN_CHARS = 1024
_SETTLED = ("done", "failed", "cancelled")
_LIVE = ("ready", "deferred", "claimed", "offloaded")


@dataclasses.dataclass(frozen=True)
class Glance:
    """What the overview and ``/api/stats`` show first, read together."""

    counts: dict[str, dict[str, int]]
    totals: dict[str, int]
    oldest: dict[str, Any] | None
    oldest_age: float | None
    expired: int | None
    at: float


@dataclasses.dataclass(frozen=True)
class Scope:
    """The store and the actor every read and action of the dashboard goes through."""

    store: ControlStore
    actor_id: str | None

    def now(self) -> float:
        """The store's "now" (its clock), in epoch seconds."""
        return float(self.store.clock.now())

    async def projects(self) -> list[dict[str, Any]]:
        """The projects the dashboard may show."""
        found = await self.store.projects()
        if self.actor_id is None:
            return found
        visible = set(await self.store.visible_projects(self.actor_id))
        return [p for p in found if p["project_id"] in visible]

    async def visible(self, project_id: str) -> bool:
        """Whether the dashboard may show (and act on) this project."""
        return any(p["project_id"] == project_id for p in await self.projects())

    async def counts(self) -> dict[str, dict[str, int]]:
        """Items per state, per project (every project shown, every state a key)."""
        return (await self._counts())[0]

    async def _counts(self) -> tuple[dict[str, dict[str, int]], dict[str, Any] | None]:
        """The counts, and the store's stats they were read from (None for an actor,
        whose counts are its projects' own)."""
        if self.actor_id is not None:
            return await self._actor_counts(), None
        stats = await self.store.stats()
        found: dict[str, dict[str, int]] = stats["projects"]
        for project in await self.projects():
            found.setdefault(project["project_id"], dict.fromkeys(_models.ITEM_STATES, 0))
        return dict(sorted(found.items())), stats

    async def glance(self, *, expired: bool = False) -> Glance:
        """Counts, their totals and the oldest ready item in one look; with ``expired``,
        the lapsed leases too (from the same read of the store's stats, or, for an
        actor, counted among its own claimed items)."""
        now = self.now()
        counts, stats = await self._counts()
        totals = {state: sum(c[state] for c in counts.values()) for state in _models.ITEM_STATES}
        first = await self.items(state="ready", order="oldest", limit=1, include_payload=False)
        oldest = first[0] if first else None
        lapsed = None
        if expired:
            lapsed = await self._lapsed(stats, now)
        if stats is not None:  # the store's own figure: its oldest by time, not by id
            oldest_age = stats["oldest_ready_age_s"]
        elif oldest is not None:
            oldest_age = _models.waited(now, oldest["created_at"].timestamp())
        else:
            oldest_age = None
        return Glance(counts, totals, oldest, oldest_age, lapsed, now)

    async def _lapsed(self, stats: dict[str, Any] | None, now: float) -> int:
        """Claims whose lease has lapsed: the store's count (``stats``), or, for an actor,
        those among the first `LOOK_ROWS` of its claimed items."""
        if stats is not None:
            return int(stats["expired_leases"])
        claimed = await self.items(state="claimed", limit=LOOK_ROWS, include_payload=False)
        return sum(1 for item in claimed if item["lease_expires_at"].timestamp() <= now)

    async def lapsed(self) -> int:
        """Claims whose lease has lapsed (see `_lapsed`)."""
        stats = None if self.actor_id is not None else await self.store.stats()
        return await self._lapsed(stats, self.now())

    async def _actor_counts(self) -> dict[str, dict[str, int]]:
        return {
            p["project_id"]: await self.store.counts(
                project_id=p["project_id"], actor_id=self.actor_id
            )
            for p in await self.projects()
        }

    async def items(self, **filters: Any) -> list[dict[str, Any]]:
        """A page of items (as `ControlStore.items` lists them), in scope."""
        return await self.store.items(actor_id=self.actor_id, **filters)


# --- the overview --------------------------------------------------------------------------


class History:
    """The overview's last hour: settled per minute (from the store) and queue depth
    (sampled here). `sample` is called every few seconds by the dashboard's sampler."""

    def __init__(self, scope: Scope) -> None:
        self._scope = scope
        #: minute start -> state -> count, over the window.
        self.minutes: dict[float, collections.Counter[str]] = {}
        #: (time, ready, deferred) samples, oldest first.
        self.depth: collections.deque[tuple[float, int, int]] = collections.deque()
        #: The minute whose first sample read the whole hour (None: read it next).
        self._hour_read_in: float | None = None
        #: Set after every sample (tests and the first page wait for it).
        self.sampled = asyncio.Event()

    def forget(self) -> None:
        """Read the whole hour again at the next sample (an action may have moved an
        item out of a minute long past: a requeue, a purge)."""
        self._hour_read_in = None

    async def sample(self) -> None:
        """Read the settled counts of the last minutes and the queue depth now."""
        now = self._scope.now()
        minute = math.floor(now / 60) * 60
        whole = self._hour_read_in != minute
        since = now - WINDOW if whole else minute - 60
        rows = await self._scope.store.settled_per_minute(
            since=since, actor_id=self._scope.actor_id
        )
        fresh: dict[float, collections.Counter[str]] = {}
        for row in rows:
            at = row["minute"].timestamp()
            fresh.setdefault(at, collections.Counter())[row["state"]] += row["count"]
        for at in [at for at in self.minutes if at >= math.floor(since / 60) * 60]:
            del self.minutes[at]  # read again just now
        self.minutes.update(fresh)
        for at in [at for at in self.minutes if at < now - WINDOW - 60]:
            del self.minutes[at]
        if whole:
            self._hour_read_in = minute
        counts = await self._scope.counts()
        ready = sum(c["ready"] for c in counts.values())
        deferred = sum(c["deferred"] for c in counts.values())
        self.depth.append((now, ready, deferred))
        while self.depth and self.depth[0][0] < now - WINDOW:
            self.depth.popleft()
        self.sampled.set()

    def throughput(self, now: float) -> list[tuple[float, int, int]]:
        """(minute start, settled, failed) for each of the last 60 whole minutes and the
        current one, oldest first."""
        last = float(math.floor(now / 60) * 60)
        series: list[tuple[float, int, int]] = []
        for step in range(60, -1, -1):
            at = last - 60 * step
            counts = self.minutes.get(at, collections.Counter())
            series.append((at, sum(counts[s] for s in _SETTLED), counts["failed"]))
        return series


def chart(values: Sequence[float], *, width: int = 600, height: int = 120) -> dict[str, Any]:
    """An SVG line chart's geometry for ``values`` (a polyline's points, the top value);
    numbers only, so the template draws it with nothing to escape."""
    top = max([*values, 1.0])
    if len(values) < 2:
        values = [*values, *values] if values else [0.0, 0.0]
    step = width / (len(values) - 1)
    points = " ".join(
        f"{i * step:.1f},{height - (v / top) * (height - 4) - 2:.1f}" for i, v in enumerate(values)
    )
    return {"points": points, "top": top, "width": width, "height": height}


async def overview(scope: Scope, history: History) -> dict[str, Any]:
    """The overview page: counts, the oldest ready item, the charts, the failure rate."""
    seen = await scope.glance()
    series = history.throughput(seen.at)
    settled_hour = sum(s for _, s, _ in series)
    failed_hour = sum(f for _, _, f in series)
    depth = [ready + deferred for _, ready, deferred in history.depth]
    return {
        "counts": seen.counts,
        "totals": seen.totals,
        "states": _models.ITEM_STATES,
        "oldest": seen.oldest,
        "oldest_age": seen.oldest_age,
        "throughput": chart([float(s) for _, s, _ in series]),
        "throughput_last": series[-2][1] if len(series) > 1 else 0,
        "depth": chart([float(d) for d in depth]),
        # Read now, as the cards above it are (the chart's last sample may be 10 s old).
        "depth_now": seen.totals["ready"] + seen.totals["deferred"],
        "depth_samples": len(depth),
        "settled_hour": settled_hour,
        "failed_hour": failed_hour,
        "failure_rate": None if not settled_hour else failed_hour / settled_hour,
    }


async def stats(scope: Scope) -> dict[str, Any]:
    """``GET /api/stats``: counts by state and by project, and the oldest ready age."""
    seen = await scope.glance(expired=True)
    return {
        "states": seen.totals,
        "projects": seen.counts,
        "items": sum(seen.totals.values()),
        "oldest_ready_age_s": seen.oldest_age,
        "expired_leases": seen.expired,
        "actor_id": scope.actor_id,
        "at": seen.at,
    }


# --- running, failures ---------------------------------------------------------------------


async def running(scope: Scope) -> dict[str, Any]:
    """Claimed items, lapsed leases (stuck) first, then the longest running: the first
    `PAGE_ROWS` of them, looked for among `LOOK_ROWS` (a lapsed lease is rarely the
    oldest claim, so the oldest 500 would hide it); ``stuck`` and ``claimed`` count them
    all."""
    now = scope.now()
    rows = []
    for item in await scope.items(
        state="claimed", order="oldest", limit=LOOK_ROWS, include_payload=False
    ):
        lease_left = item["lease_expires_at"].timestamp() - now
        started = item["claimed_at"] or item["updated_at"]
        rows.append(
            {**item, "running_s": now - started.timestamp(), "lease_left_s": lease_left,
             "stuck": lease_left <= 0}
        )  # fmt: skip
    rows.sort(key=lambda row: (not row["stuck"], -row["running_s"]))
    if len(rows) < LOOK_ROWS:
        stuck, claimed = sum(row["stuck"] for row in rows), len(rows)
    else:  # more than one look: count from the store
        stuck = await scope.lapsed()
        claimed = sum(c["claimed"] for c in (await scope.counts()).values())
    return {"rows": rows[:PAGE_ROWS], "stuck": stuck, "claimed": max(claimed, len(rows))}


async def failures(scope: Scope) -> dict[str, Any]:
    """Failed items, and items waiting to retry after an error, grouped by their exact
    error; each group with its `group_key` (what its actions send) and the first
    `GROUP_SHOWN_CHARS` of its error."""
    failed = await scope.items(state="failed", limit=PAGE_ROWS, include_payload=False)
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for item in failed:
        groups.setdefault(item["error"] or "", {"failed": [], "retrying": []})["failed"].append(
            item
        )
    for item in await _retrying_items(scope):
        groups.setdefault(item["error"], {"failed": [], "retrying": []})["retrying"].append(item)
    ordered = sorted(
        groups.items(), key=lambda g: (-(len(g[1]["failed"]) + len(g[1]["retrying"])), g[0])
    )
    return {
        "groups": [
            {
                "error": first(error, GROUP_SHOWN_CHARS),
                "key": group_key(error),
                "failed": found["failed"],
                "retrying": found["retrying"],
                "first": (found["failed"] + found["retrying"])[0]["item_id"],
            }
            for error, found in ordered
        ],
        # every failed item the dashboard may see, as the Running page counts its rows
        "failed": sum(c.get("failed", 0) for c in (await scope.counts()).values()),
        "shown": len(failed),
    }


def group_key(error: str) -> str:
    """What names an error group in the failures page's forms: a digest of its exact
    error, not the error itself (up to 16 KiB, escaped, in each of up to 1,000 groups'
    forms: the page was 80 MB), which a browser would send back with every line break
    made CR LF, so that "a\r\nb" and "a\rb", two groups, were acted on as one."""
    return hashlib.sha256(error.encode("utf-8", "surrogatepass")).hexdigest()[:32]


async def _retrying_items(scope: Scope) -> list[dict[str, Any]]:
    """The newest `PAGE_ROWS` deferred items that wait to retry after an error, looked for
    page by page among the newest `LOOK_ROWS` deferred ones: a project that parks or
    defers hundreds of items without an error (a rate limit, ``not_before``) would
    otherwise hide every retrying one behind them."""
    found: list[dict[str, Any]] = []
    after: int | None = None
    for _ in range(LOOK_ROWS // PAGE_ROWS):
        page = await scope.items(state="deferred", after=after, limit=PAGE_ROWS,
                                 include_payload=False)  # fmt: skip
        found += [item for item in page if _retrying(item)]
        if len(found) >= PAGE_ROWS or len(page) < PAGE_ROWS:
            break
        after = page[-1]["item_id"]
    return found[:PAGE_ROWS]


def _retrying(item: dict[str, Any]) -> bool:
    """Whether a deferred item waits to retry after an error (one deferred by
    ``not_before``, or parked without an error, is in no error's group)."""
    return bool(item["error"])


def _in_group(item: dict[str, Any], state: str) -> bool:
    return state != "deferred" or _retrying(item)


async def group_error(scope: Scope, state: str, key: str) -> str | None:
    """The error of the group in ``state`` whose `group_key` is ``key``, or None (no item
    in ``state`` has that error now): looked for newest first, as the failures page
    lists them, so found in its first read unless the page is old; among the newest
    `LOOK_ROWS` at most (a stale key, from a second click, say, walked every item in the
    state: seconds a click on a store of millions)."""
    after = None
    for _ in range(LOOK_ROWS // PAGE_ROWS):
        page = await scope.items(state=state, after=after, limit=PAGE_ROWS, include_payload=False)
        for item in page:
            error = item["error"] or ""
            if _in_group(item, state) and group_key(error) == key:
                return error
        if len(page) < PAGE_ROWS:
            return None
        after = page[-1]["item_id"]
    return None


async def group_members(scope: Scope, error: str, state: str) -> list[tuple[int, int]]:
    """The ids, with their fences, of every item in ``state`` whose error is exactly
    ``error`` (a group), read page by page (the store finds its longest line, ignoring
    ASCII case; this keeps the exact ones). An action on them takes each only at the
    fence read here: one that ran again since is no longer of the group."""
    piece = max(re.split("[\r\n]", error), key=len)
    members: list[tuple[int, int]] = []
    after = None
    while True:
        page = await scope.items(
            state=state, error_contains=piece or None, after=after, limit=PAGE_ROWS,
            include_payload=False,
        )  # fmt: skip
        members.extend(
            (item["item_id"], item["fence"])
            for item in page
            if (item["error"] or "") == error and _in_group(item, state)
        )
        if len(page) < PAGE_ROWS:
            return members
        after = page[-1]["item_id"]


# --- one item, projects --------------------------------------------------------------------


class Verdicts:
    """The ledger check's verdict on items, kept while an item's history stays as it was:
    the item page asks every 2 seconds, and the check of one item still reads indexes
    shared by every item, so it runs again only once the item has a new event."""

    def __init__(self, scope: Scope, keep: int = 256) -> None:
        self._scope = scope
        self._keep = keep
        self._found: collections.OrderedDict[int, tuple[Any, list[Any]]] = collections.OrderedDict()

    async def of(
        self, item_id: int, row: dict[str, Any], events: list[dict[str, Any]]
    ) -> list[Any]:
        """The problems of the item whose row and events these are."""
        if row["state"] == "ready":
            # Held in line or not, its verdict reads its twins' rows too, which change
            # without its history (`_models.CHECKS_OF_OTHER_ITEMS`), and whether it is
            # held, which no item page shows: checked every time.
            return await _ledger.verify_ledger(self._scope.store, item_id=item_id)
        # (Events are only ever appended: the newest one's id says the history changed.)
        # (With every column a check reads: an edit behind the store's back moves no
        # event, and may leave updated_at as it was.)
        key = (row["state"], row["fence"], row["updated_at"], row["owner"],
               row["lease_expires_at"], row["due_at"],
               events[-1]["event_id"] if events else None)  # fmt: skip
        kept = self._found.get(item_id)
        if kept is not None and kept[0] == key:
            self._found.move_to_end(item_id)
            return kept[1]
        problems = await _ledger.verify_ledger(self._scope.store, item_id=item_id)
        self._found[item_id] = (key, problems)
        while len(self._found) > self._keep:
            self._found.popitem(last=False)
        return problems


#: The newest events an item's page shows: one retried thousands of times, each with an
#: error of 16 KiB, would make a page of many megabytes, on the store's event loop.
EVENTS_SHOWN = 200
#: The characters of each event's detail the timeline shows (a retry's error may be 16
#: KiB: 200 of them made a page of megabytes, fetched again every 2 seconds).
DETAIL_CHARS = 2048


async def item(scope: Scope, item_id: int, verdicts: Verdicts) -> dict[str, Any]:
    """An item's page: its row, its ledger, and the ledger check's verdict on it.

    Raises `asyncplane.UnknownItem` or `asyncplane.ScopeDenied` as the store does.
    """
    row = await scope.store.item(item_id, actor_id=scope.actor_id)
    # One more than shown, to know whether earlier ones are left out; never the whole
    # history, which may be thousands of events and megabytes of details.
    events = await scope.store.events(item_id, actor_id=scope.actor_id, last=EVENTS_SHOWN + 1)
    problems = await verdicts.of(item_id, row, events)
    shown = events[-EVENTS_SHOWN:]
    return {
        "item": row,
        "payload": pretty(row["payload"]),
        "result": None if row["result"] is None else pretty(row["result"]),
        "events": [
            {**e, "detail": None if e["detail"] is None else pretty(e["detail"], DETAIL_CHARS)}
            for e in shown
        ],
        "earlier_events": len(events) > len(shown),
        "problems": [
            {"kind": p.kind, "detail": p.detail, "meaning": _ledger.LEDGER_PROBLEM_KINDS[p.kind]}
            for p in problems
        ],
        "can_requeue": row["state"] in ("failed", "cancelled"),
        "can_cancel": row["state"] in _LIVE,
    }


async def projects(scope: Scope) -> dict[str, Any]:
    """Every project shown: status, counts, limits; and the schedules of those projects."""
    shown = await scope.projects()
    ids = {p["project_id"] for p in shown}
    counts = await scope.counts()
    limits = {row["project_id"]: row for row in await scope.store.project_limits()}
    schedules = [s for s in await scope.store.schedules() if s["project_id"] in ids]
    return {
        "projects": [
            {**p, "counts": counts.get(p["project_id"], {}), "limits": limits.get(p["project_id"])}
            for p in shown
        ],
        "schedules": schedules,
    }


async def last_minute_settled(scope: Scope, at: float) -> collections.Counter[str]:
    """Items settled in the last whole minute before ``at``, by state, read from the store
    now (the history's minutes are as old as its last sample: a scrape early in a minute
    would undercount the one before)."""
    last = math.floor(at / 60) * 60 - 60
    counts: collections.Counter[str] = collections.Counter()
    for row in await scope.store.settled_per_minute(since=last, actor_id=scope.actor_id):
        if row["minute"].timestamp() == last:
            counts[row["state"]] += row["count"]
    return counts


def prometheus_families(stats: dict[str, Any], settled: collections.Counter[str]) -> Iterable[Any]:
    """The store's gauges for ``GET /metrics``, as prometheus_client metric families
    (``settled``: `last_minute_settled`)."""
    from prometheus_client.core import GaugeMetricFamily

    items = GaugeMetricFamily(
        "asyncplane_items", "Items by project and state.", labels=["project", "state"]
    )
    for project, counts in stats["projects"].items():
        for state, count in counts.items():
            items.add_metric([project, state], count)
    yield items
    oldest = GaugeMetricFamily(
        "asyncplane_oldest_ready_age_seconds", "How long the oldest ready item has waited."
    )
    oldest.add_metric([], stats["oldest_ready_age_s"] or 0.0)
    yield oldest
    expired = GaugeMetricFamily(
        "asyncplane_expired_leases", "Claimed items whose lease has lapsed (stuck)."
    )
    expired.add_metric([], stats["expired_leases"])
    yield expired
    rate = GaugeMetricFamily(
        "asyncplane_settled_per_minute",
        "Items settled in the last whole minute, by state.",
        labels=["state"],
    )
    for state in _SETTLED:
        rate.add_metric([state], settled[state])
    yield rate


@dataclasses.dataclass(frozen=True)
class Shown:
    """A value as a page shows it: its first characters, and whether it was cut there."""

    text: str
    cut: bool


def first(text: str, limit: int = SHOWN_CHARS) -> Shown:
    """The first ``limit`` characters of ``text``."""
    return Shown(text[:limit], len(text) > limit)


def pretty(value: Any, limit: int = SHOWN_CHARS) -> Shown:
    """``value`` as indented JSON (keys sorted), its first ``limit`` characters.

    One space a level: a value nested deep is mostly indentation otherwise. Encoded
    piece by piece, stopping once past the limit, so the work is bounded too, not only
    the page (with ``indent`` the encoder is Python's generator, which yields as it goes).
    """
    encoder = json.JSONEncoder(indent=1, sort_keys=True, ensure_ascii=False)
    pieces: list[str] = []
    size = 0
    for piece in encoder.iterencode(value):
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return Shown("".join(pieces)[:limit], True)
    return Shown("".join(pieces), False)


def not_found(exc: BaseException) -> bool:
    """Whether a store error means "not found" to the dashboard (absent, or out of scope:
    the two look the same)."""
    return isinstance(exc, (_errors.UnknownItem, _errors.ScopeDenied, _errors.UnknownProject))
