"""The dashboard's HTTP server: routes, pages, and the rules that keep it safe.

Served by aiohttp on the store's own event loop (one dependency that is both the server
and its test client, no ASGI server to pick and run beside it); pages are Jinja2
templates with autoescaping on, so every payload, result, error and name reaches the page
as text, never as markup. The rules:

* **Loopback by default.** Binding to anything else needs a token (one is made if none
  is given); every request must then carry it: ``Authorization: Bearer TOKEN``, the
  cookie (``asyncplane_token_PORT``, the prefix appended when mounted: see
  `_cookie_name`), or ``?token=TOKEN`` once (which sets the cookie, HttpOnly and
  SameSite=Lax, and redirects to the same page without it).
* **This machine alone without a token.** A request from another address is refused
  (a mounted application cannot know whether its site listens beyond loopback).
* **No DNS rebinding.** Without a token, a request must name a loopback host in its
  ``Host`` header (or one of ``allowed_hosts``): a hostile page whose name was made to
  point at 127.0.0.1 is refused, so it can neither read a page nor its CSRF token.
* **Actions only when allowed** (``allow_actions``), only as POSTs, each carrying the
  page's CSRF token (a form field, or the ``X-CSRF-Token`` header) unless it is
  authenticated by an ``Authorization`` header (which no other site can make a browser
  send). A POST whose ``Origin`` names another host than the request's (the proxy's
  ``X-Forwarded-Host``, behind one) is refused whatever it carries.
* **Nothing runs that the package did not serve.** A Content-Security-Policy allows
  scripts, styles and images from the dashboard alone, no inline script, and no
  framing; every asset is in the package (fleets run offline).
* **Scope.** With ``actor_id``, every page and action goes through the store as that
  actor; out of scope reads as not found (404), as absent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import pathlib
import secrets
import socket as socket_module
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from asyncplane import __version__, _errors, _models, _tasks, _validate
from asyncplane._store import ControlStore
from asyncplane.dashboard import _views

try:
    import jinja2
    from aiohttp import http_exceptions, web, web_protocol
except ImportError:  # pragma: no cover - the import is checked in asyncplane.dashboard
    raise _errors.MissingExtra(
        "the dashboard needs the dashboard extra: pip install 'asyncplane[dashboard]'"
    ) from None

__all__ = ("Dashboard", "check_address", "checked_token")

_log = logging.getLogger("asyncplane.dashboard")

_HERE = pathlib.Path(__file__).parent
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_LIVE_HEADER = "X-Asyncplane-Live"
#: The longest query a page's forms send back to it (a page reads none; a link with a
#: long one made every form of the page carry it, megabytes every live update).
_KEPT_QUERY = 1024
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Seconds past `Dashboard.answer_within` the live page's script waits for an answer
#: before it says the dashboard itself does not answer.
_GIVE_UP_AFTER_ANSWER = 15.0
#: How long a stop waits for the reads it cancels (the sampler's, those of requests
#: answered 503 for their time) to end.
_ENDING_SECONDS = 5.0


class Dashboard:
    """The operator dashboard of one store, served over HTTP (see `asyncplane.dashboard`).

    Args:
        store: The store to show (a read-only store shows everything, and refuses actions).
        actor_id: Show and act only as this actor (as ``actor_id=`` in the API).
        allow_actions: Serve the actions (requeue, cancel, pause, resume); off by default.
        token: The token every request must carry; required off loopback (made by
            `start` if not given: read it from `token`).
        sample_every: Seconds between the overview's samples (queue depth, settled per
            minute).
        allowed_hosts: Host names (beyond loopback's) that requests may name in their
            ``Host`` header when there is no token (a name of this machine, say).
        answer_within: Seconds a request may wait for the store before it is answered
            503 (a server that stopped answering, a file locked by another process): the
            page says so, instead of hanging until the store is back. An action cut
            short may still take effect.
    """

    def __init__(
        self,
        store: ControlStore,
        *,
        actor_id: str | None = None,
        allow_actions: bool = False,
        token: str | None = None,
        sample_every: float = 10.0,
        allowed_hosts: tuple[str, ...] = (),
        answer_within: float = 15.0,
    ) -> None:
        if not isinstance(store, ControlStore):
            raise _errors.InvalidType(f"store must be a ControlStore, not {type(store).__name__}")
        self.store = store
        self.scope = _views.Scope(store, _validate.optional_actor(actor_id))
        self.allow_actions = _validate.boolean(allow_actions, "allow_actions")
        self.token = checked_token(token)
        self.sample_every = _validate.seconds(sample_every, "sample_every", 3600.0)
        self.answer_within = _validate.seconds(answer_within, "answer_within", 3600.0)
        #: Requests answered 503 for their time whose reads still wind up (a cancelled
        #: read of a server that stopped answering ends only once it answers, or its
        #: connection is given up): waited for at `stop`, for a while.
        self._overdue: set[asyncio.Task[web.StreamResponse]] = set()
        self.history = _views.History(self.scope)
        self.verdicts = _views.Verdicts(self.scope)
        hosts: object = allowed_hosts
        if not isinstance(hosts, tuple) or not all(isinstance(h, str) and h for h in hosts):
            raise _errors.InvalidType("allowed_hosts must be a tuple of host names")
        self._allowed_hosts = _LOOPBACK_NAMES | {h.lower() for h in allowed_hosts}
        self._csrf = secrets.token_urlsafe(32)
        self._templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(_HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self._templates.filters["ago"] = _ago
        self._templates.filters["when"] = _when
        self._templates.filters["period"] = _period
        self._runner: web.AppRunner | None = None
        #: The URL the dashboard serves at, once started.
        self.url: str | None = None
        #: Applications of this dashboard between their startup and cleanup (`_sampling`):
        #: one sampler serves them all, stopped with the last.
        self._serving = 0
        self._sampler: asyncio.Task[None] | None = None
        self._stop_sampling = asyncio.Event()

    # --- lifecycle -----------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (routes and middlewares), for embedding or testing."""
        app = web.Application(middlewares=[self._guard])
        # Sampled for as long as the application runs: the same served by start() or
        # mounted in a site of the caller's (add_subapp), whose startup starts it.
        app.cleanup_ctx.append(self._sampling)
        app.add_routes(
            [
                web.get("/", self._overview, name="overview"),
                web.get("/running", self._running),
                web.get("/failures", self._failures),
                web.get("/items/{item_id}", self._item),
                web.get("/projects", self._projects),
                web.get("/api/stats", self._api_stats),
                web.get("/api/items/{item_id}", self._api_item),
                web.get("/metrics", self._metrics),
                web.static("/static", _HERE / "static", append_version=False),
                web.post("/items/{item_id}/requeue", self._requeue),
                web.post("/items/{item_id}/cancel", self._cancel),
                web.post("/failures/requeue", self._requeue_group),
                web.post("/failures/cancel", self._cancel_group),
                # Names go in the form, not the path: a name may hold "/" or be "..".
                web.post("/projects/pause", self._pause_project),
                web.post("/projects/resume", self._resume_project),
                web.post("/schedules/pause", self._pause_schedule),
                web.post("/schedules/resume", self._resume_schedule),
            ]
        )
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 8080) -> str:
        """Serve on ``host``:``port`` (0: a free port); return the URL it serves at."""
        check_address(host, port)
        if self._runner is not None:
            raise _errors.InvalidInput("this dashboard is serving already: stop() it first")
        if not _loopback(host) and self.token is None:
            self.token = secrets.token_urlsafe(24)
        self._allowed_hosts = self._allowed_hosts | {host.lower()}
        # Requests in progress at a stop end first: each within its answer_within.
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False,
            shutdown_timeout=self.answer_within + 1.0,
        )  # fmt: skip
        try:
            await self._runner.setup()  # the application's startup: see _sampling
            await web.TCPSite(self._runner, host, port).start()
            self._sample_on()  # its own site, started: sampling from now, visited or not
        except BaseException:  # a port in use, say: nothing is left behind
            await self.stop()
            raise
        bound = self._runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"
        _log.info("dashboard of %s listening on %s", self.store.location, self.url)
        return self.url

    async def stop(self) -> None:
        """Stop serving (requests in progress end first) and stop sampling."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()  # the application's cleanup: see _sampling

    async def __aenter__(self) -> Dashboard:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _sampling(self, app: web.Application) -> AsyncIterator[None]:
        """The application's life (its ``cleanup_ctx``): the store opened and the first
        sample taken before it serves; then a sample every ``sample_every`` seconds
        (`_sample_on`: from `start`, or a mounted application's first request), until its
        cleanup. A mounted one's sampler is not started here: a site whose own startup
        fails after this one never cleans a mounted application up (aiohttp's rule), and
        its sampler would run on, for ever."""
        del app
        await self.store.open()
        await self.history.sample()
        self._serving += 1
        try:
            yield
        finally:
            self._serving -= 1
            sampler = None if self._serving else self._sampler
            ending: list[asyncio.Task[Any]] = [] if self._serving else list(self._overdue)
            if sampler is not None:
                self._sampler = None
                self._stop_sampling.set()
                ending.append(sampler)
            for task in ending:
                task.cancel()  # they only read (an action's write stands or not as a whole)
            if ending:
                # A read of a server that stopped answering ends only once it answers:
                # waited for a while, then left to end with the loop.
                await asyncio.wait(ending, timeout=_ENDING_SECONDS)

    def _sample_on(self) -> None:
        """Start the sampler, if an application of this dashboard serves and none runs."""
        if self._serving and self._sampler is None:
            self._stop_sampling = asyncio.Event()
            self._sampler = asyncio.create_task(
                self._sample(self._stop_sampling), name="asyncplane-dashboard-sampler"
            )
            self._sampler.add_done_callback(_report_failure)

    async def _sample(self, stopping: asyncio.Event) -> None:
        """Sample the overview's history every ``sample_every`` seconds until stopped."""
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await _tasks.within(stopping.wait(), self.sample_every, "dashboard-tick")
            if stopping.is_set():
                return
            try:
                await self.history.sample()
            except Exception as exc:  # the store is down: the pages say so; go on sampling
                _log.warning("dashboard: sampling failed: %s", exc)

    # --- the guard: token, actions, CSRF, headers ----------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        self._sample_on()
        answering = asyncio.get_running_loop().create_task(
            self._answer(request, handler), name="asyncplane-dashboard-request"
        )
        try:
            done, _ = await asyncio.wait([answering], timeout=self.answer_within)
        except asyncio.CancelledError:  # the client went away, say
            answering.cancel()
            self._overdue.add(answering)  # (waited for at the stop, as any cut short)
            answering.add_done_callback(self._overdue.discard)
            raise
        if done:
            response = answering.result()
        else:
            answering.cancel()
            self._overdue.add(answering)
            answering.add_done_callback(self._overdue.discard)
            _log.warning(
                "dashboard: %s %s had no answer from the store within %g s",
                request.method, request.path, self.answer_within,
            )  # fmt: skip
            response = _text(
                503,
                f"the store did not answer within {self.answer_within:g} s"
                + (" (the action may still take effect)" if request.method == "POST" else ""),
            )
        response.headers["Content-Security-Policy"] = _CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"  # "no-referrer" would send Origin: null
        response.headers["X-Frame-Options"] = "DENY"
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    async def _answer(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """The request's answer; a refusal or a failure as a plain response of its own."""
        try:
            response = await self._checked(request, handler)
        except web.HTTPException as exc:  # a redirect, a 404: answered as a plain response
            response = web.Response(status=exc.status, text=exc.text, headers=exc.headers)
        except _errors.ReadOnlyStore:
            response = _text(403, "the store is open read-only: actions are off")
        except (_errors.InvalidInput, _errors.InvalidType) as exc:  # a name too long, say
            response = _text(400, str(exc))
        except _errors.MissingExtra as exc:  # (resuming a cron schedule without cronsim)
            response = _text(501, str(exc))
        except _errors.AsyncplaneError as exc:
            if _views.not_found(exc):
                response = _text(404, "not found")
            else:
                _log.warning("dashboard: %s %s failed: %s", request.method, request.path, exc)
                response = _text(503, f"the store failed: {type(exc).__name__}")
        except Exception:  # a bug of ours: still a plain answer, with the headers
            _log.exception("dashboard: %s %s failed", request.method, request.path)
            response = _text(500, "the dashboard failed: see its log")
        return response

    async def _checked(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        by_header = False
        if self.token is None:
            if not _loopback_peer(request):
                # start() makes a token for any bind beyond loopback; an application
                # mounted in a site of the caller's cannot know the site's bind, so
                # without a token it answers this machine alone.
                return _text(403, "this dashboard has no token: it answers this machine only")
            if _host_name(request.host) not in self._allowed_hosts:
                return _text(421, "this dashboard answers to its own host names only")
        else:
            presented = self._presented(request)
            if not any(_equal(given, self.token) for given, _ in presented):
                refused = _text(401, "this dashboard needs its token (Authorization: Bearer ...)")
                refused.headers["WWW-Authenticate"] = "Bearer"
                return refused
            by_header = any(header and _equal(given, self.token) for given, header in presented)
            if "token" in request.query and request.method == "GET":
                # Once by URL: keep it in a cookie, and drop it from the address bar (to
                # a path of this dashboard, never "//elsewhere"). SameSite=Lax, not
                # Strict: the link is clicked on another site (a runbook, a chat), and
                # the redirect is part of that navigation, which a Strict cookie is not
                # sent with. A GET only reads; every POST still needs the CSRF token and
                # a same-site Origin.
                query = [(k, v) for k, v in request.query.items() if k != "token"]
                target = "/" + request.rel_url.raw_path.lstrip("/\\")
                if query:
                    target += "?" + urllib.parse.urlencode(query)
                found = web.Response(status=303, headers={"Location": target})
                # Secure when the link came over TLS (or a proxy that ends TLS says so):
                # the token is never sent back over plain HTTP to this host's other ports.
                found.set_cookie(
                    _cookie_name(request), self.token, path=_cookie_path(request),
                    httponly=True, samesite="Lax", secure=_over_tls(request),
                )  # fmt: skip
                return found
        if request.method == "POST":
            if not self.allow_actions:
                return _text(403, "actions are off: start the dashboard with --allow-actions")
            origin = request.headers.get("Origin")
            if origin is not None and not _same_host(origin, request):
                return _text(403, "a request from another site is refused")
            form = await _form(request)  # one that cannot be read: refused before acting
            if not by_header:
                sent = request.headers.get("X-CSRF-Token") or form.get("csrf")
                if not isinstance(sent, str) or not _equal(sent, self._csrf):
                    return _text(403, "missing or wrong CSRF token")
        return await handler(request)

    # --- pages ---------------------------------------------------------------------------

    def _page(self, request: web.Request, template: str, **data: Any) -> web.Response:
        """A page, or only its live part (the block ``live``) for the live updates."""
        page = self._templates.get_template(template)
        context = {
            "csrf": self._csrf,
            "actions": self.allow_actions,
            "actor": self.scope.actor_id,
            "store": self.store.location,
            "backend": self.store.backend,
            "read_only": self.store.read_only,
            "version": __version__,
            # Where a form's action comes back to; a query no page reads, however long,
            # is not copied into every form of it.
            # (measured as sent, percent-encoded: the form carries it so)
            "path": request.path_qs
            if len(request.rel_url.raw_query_string) <= _KEPT_QUERY
            else request.path,
            "root": _root(request),
            "now": self.scope.now(),
            # The live script gives up on a request out this long: past the server's own
            # limit (answered 503 then), so a live page hears the 503, not its own give-up.
            "give_up_ms": int((self.answer_within + _GIVE_UP_AFTER_ANSWER) * 1000),
            **data,
        }
        if request.headers.get(_LIVE_HEADER) == "1":
            body = "".join(page.blocks["live"](page.new_context(context)))
        else:
            body = page.render(context)
        return web.Response(text=body, content_type="text/html", charset="utf-8")

    async def _overview(self, request: web.Request) -> web.Response:
        data = await _views.overview(self.scope, self.history)
        return self._page(request, "overview.html", page="overview", **data)

    async def _running(self, request: web.Request) -> web.Response:
        data = await _views.running(self.scope)
        return self._page(request, "running.html", page="running", **data)

    async def _failures(self, request: web.Request) -> web.Response:
        data = await _views.failures(self.scope)
        return self._page(request, "failures.html", page="failures", **data)

    async def _item(self, request: web.Request) -> web.Response:
        data = await _views.item(self.scope, _item_id(request), self.verdicts)
        return self._page(request, "item.html", page="item", **data)

    async def _projects(self, request: web.Request) -> web.Response:
        data = await _views.projects(self.scope)
        return self._page(request, "projects.html", page="projects", **data)

    async def _api_stats(self, request: web.Request) -> web.Response:
        return web.json_response(await _views.stats(self.scope))

    async def _api_item(self, request: web.Request) -> web.Response:
        item_id = _item_id(request)
        row = await self.store.item(item_id, actor_id=self.scope.actor_id)
        return web.json_response(row, dumps=_json)

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import generate_latest

        stats = await _views.stats(self.scope)
        settled = await _views.last_minute_settled(self.scope, stats["at"])
        families = list(_views.prometheus_families(stats, settled))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(families))
        return web.Response(
            body=generate_latest(registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    # --- actions -------------------------------------------------------------------------

    async def _requeue(self, request: web.Request) -> web.StreamResponse:
        item_id = _item_id(request)
        expected, fence = await _shown_state(request), await _shown_fence(request)
        try:
            await self.store.requeue(
                item_id, actor_id=self.scope.actor_id, if_state=expected, if_fence=fence
            )
        except _errors.NotRequeueable as exc:
            return _text(409, str(exc))
        _log.debug("dashboard: requeued item %d", item_id, extra={"item_id": item_id})
        return await self._done(request, {"item_id": item_id, "state": "ready"})

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        item_id = _item_id(request)
        state = await self.store.cancel(
            item_id, reason="cancelled from the dashboard", actor_id=self.scope.actor_id,
            if_state=await _shown_state(request), if_fence=await _shown_fence(request),
        )  # fmt: skip
        if state == "cancelled":
            _log.debug("dashboard: cancelled item %d", item_id, extra={"item_id": item_id})
        return await self._done(request, {"item_id": item_id, "state": state})

    async def _group(self, request: web.Request, state: str) -> list[tuple[int, int]]:
        """The items of the error group a form names: by ``group`` (its key, from the
        failures page) or ``error`` (its exact text, from a script)."""
        form = await _form(request)
        key = form.get("group")
        if isinstance(key, str):
            error = await _views.group_error(self.scope, state, key)
            return [] if error is None else await _views.group_members(self.scope, error, state)
        return await _views.group_members(self.scope, await _field(request, "error"), state)

    async def _requeue_group(self, request: web.Request) -> web.StreamResponse:
        done = 0
        for item_id, fence in await self._group(request, "failed"):
            # moved on meanwhile; purged since (a retention run by updated_at, not by id),
            # or out of scope since: the rest of the group is still taken
            with contextlib.suppress(
                _errors.NotRequeueable, _errors.UnknownItem, _errors.ScopeDenied
            ):
                await self.store.requeue(
                    item_id, actor_id=self.scope.actor_id, if_state="failed", if_fence=fence
                )
                done += 1
        _log.info("dashboard: requeued %d failed item(s) of one error group", done)
        return await self._done(request, {"requeued": done})

    async def _cancel_group(self, request: web.Request) -> web.StreamResponse:
        done = 0
        for item_id, fence in await self._group(request, "deferred"):
            with contextlib.suppress(_errors.UnknownItem, _errors.ScopeDenied):  # as above
                state = await self.store.cancel(  # one claimed since the group was read stays
                    item_id, reason="cancelled from the dashboard",
                    actor_id=self.scope.actor_id, if_state="deferred", if_fence=fence,
                )  # fmt: skip
                done += state == "cancelled"
        _log.info("dashboard: cancelled %d retrying item(s) of one error group", done)
        return await self._done(request, {"cancelled": done})

    async def _pause_project(self, request: web.Request) -> web.StreamResponse:
        return await self._project_status(request, "paused")

    async def _resume_project(self, request: web.Request) -> web.StreamResponse:
        return await self._project_status(request, "open")

    async def _project_status(self, request: web.Request, status: str) -> web.StreamResponse:
        project_id = await _field(request, "project_id")
        if not await self.scope.visible(project_id):
            return _text(404, "not found")
        # A closed project was closed on purpose, elsewhere: a resume (or a stale page's
        # pause) would set its workers claiming from it again. The dashboard leaves it be,
        # and says so in the write itself: a close an instant before it is kept too.
        now = await self.store.set_project_status(project_id, status, if_status=("open", "paused"))
        if now == "closed":
            return _text(409, f"project {project_id!r} is closed: the dashboard leaves it so")
        _log.info("dashboard: project %s is now %s", project_id, status)
        return await self._done(request, {"project_id": project_id, "status": status})

    async def _pause_schedule(self, request: web.Request) -> web.StreamResponse:
        return await self._schedule_paused(request, True)

    async def _resume_schedule(self, request: web.Request) -> web.StreamResponse:
        return await self._schedule_paused(request, False)

    async def _schedule_paused(self, request: web.Request, paused: bool) -> web.StreamResponse:
        name = await _field(request, "name")
        try:
            schedule = await self.store.schedule(name)
        except _errors.UnknownSchedule:
            return _text(404, "not found")
        if not await self.scope.visible(schedule["project_id"]):
            return _text(404, "not found")
        if paused:
            await self.store.pause_schedule(name)
        else:
            await self.store.resume_schedule(name)
        _log.info("dashboard: schedule %s %s", name, "paused" if paused else "resumed")
        return await self._done(request, {"schedule": name, "paused": paused})

    def _presented(self, request: web.Request) -> list[tuple[str, bool]]:
        """Every token a request carries (the header, the cookie, the query), each with
        whether it came in an Authorization header: any one that is right lets it in, so
        a stale cookie never hides a fresh ``?token=``."""
        found = []
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":  # a scheme's name has no case (RFC 9110, 11.1)
            found.append((credentials.strip(" \t"), True))
        cookie = _cookie_name(request)
        if cookie in request.cookies:
            found.append((request.cookies[cookie], False))
        if "token" in request.query:
            found.append((request.query["token"], False))
        return found

    async def _done(self, request: web.Request, answer: dict[str, Any]) -> web.StreamResponse:
        """After an action: back to the page it came from (a form), or the answer (JSON)."""
        self.history.forget()  # a requeue or a cancel may change a minute long past
        if "application/json" in request.headers.get("Accept", ""):
            return web.json_response(answer)
        raise web.HTTPSeeOther(_back_here((await _form(request)).get("next"), _root(request)))


class _Families:
    """A prometheus_client collector that yields metric families read beforehand."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


def checked_token(token: object) -> str | None:
    """A dashboard's token as given, or `InvalidInput` (a short one is guessable; one
    with spaces at its ends could not be sent in an Authorization header)."""
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise _errors.InvalidInput("token must be a str of at least 16 characters")
    if token is not None and token != token.strip():
        raise _errors.InvalidInput("token must not begin or end with a space")
    return token


def _over_tls(request: web.Request) -> bool:
    """Whether the request came over TLS: to this server, or to a proxy in front that
    says so (``X-Forwarded-Proto: https``)."""
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.secure or forwarded == "https"


def check_address(host: object, port: object) -> None:
    """`InvalidInput` unless ``host``:``port`` is one a dashboard could serve on."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise _errors.InvalidInput(f"port must be an int from 0 to 65535, not {port!r}")
    if not isinstance(host, str) or not host:
        raise _errors.InvalidInput("host must be a non-empty str")


def _root(request: web.Request) -> str:
    """The path the dashboard is served under: "" at a site's root, "/ops" when its
    application is mounted with ``add_subapp("/ops", dashboard.app())``; every link and
    redirect of its pages begins with it."""
    return str(request.app.router["overview"].url_for()).rstrip("/")


def _cookie_name(request: web.Request) -> str:
    """The name of the token's cookie: one per dashboard of a host, as a browser keeps
    one jar per host name, whatever the port, and sends a cookie of path ``/`` to every
    path. Named by the port the request came in on and, when mounted, the prefix
    (percent-encoded: a cookie's name cannot hold "/"); its path is the prefix too."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    port = sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else ""
    return f"asyncplane_token_{port}{urllib.parse.quote(_root(request), safe='')}"


def _back_here(back: object, root: str) -> str:
    """A form's ``next`` when it is a path on this dashboard, else its overview (at
    ``root``): checked as a browser reads it (tabs and line breaks dropped first), so
    that no spelling of ``//host`` leads off it."""
    if not isinstance(back, str):
        return root + "/"
    back = back.translate(_URL_IGNORED)
    if not back.startswith(root + "/") or back[1:2] in ("/", "\\"):
        return root + "/"
    # Nor a dot segment ("/ops/../admin" is the host's /admin), however a browser spells
    # it: "%2e" for a dot, a backslash for a slash.
    path = back.split("?", 1)[0].split("#", 1)[0].replace("\\", "/")
    if any(segment.lower().replace("%2e", ".") in (".", "..") for segment in path.split("/")):
        return root + "/"
    return back


#: What a browser removes from a URL before reading it (the WHATWG URL standard).
_URL_IGNORED = dict.fromkeys(map(ord, "\t\n\r"))


def _equal(given: str, secret: str) -> bool:
    """A constant-time comparison of a presented secret (any text) with ours."""
    return hmac.compare_digest(given.encode("utf-8", "replace"), secret.encode())


def _host_name(host: str | None) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets."""
    if not host:
        return ""
    try:
        found = urllib.parse.urlsplit("//" + host).hostname
    except ValueError:  # "[::1", say: names no host of ours
        return ""
    return (found or "").lower()


def _same_host(origin: str, request: web.Request) -> bool:
    """Whether a POST's Origin names the host the request went to: host names compared
    (behind a TLS proxy the scheme and port differ, and the Host header may too, which
    the proxy then forwards)."""
    try:
        named = _host_name(urllib.parse.urlsplit(origin).netloc)
    except ValueError:
        return False
    hosts = {_host_name(request.host)}
    forwarded = request.headers.get("X-Forwarded-Host")
    if forwarded:
        hosts.add(_host_name(forwarded.split(",")[0].strip()))
    return bool(named) and named in hosts


def _item_id(request: web.Request) -> int:
    """The path's item id; any text no item could have (``0``, ``-1``, past the id range,
    not digits) is a 404, as an absent item is."""
    text = request.match_info["item_id"]
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise web.HTTPNotFound(text="not found")
    item_id = int(text)
    if not 1 <= item_id <= _validate.MAX_INT:
        raise web.HTTPNotFound(text="not found")
    return item_id


async def _form(request: web.Request) -> Any:
    """The request's form; a 400 for one that cannot be read (an unknown charset, a part
    without a name), not a server error."""
    try:
        return await request.post()
    except _UNREADABLE as exc:
        raise web.HTTPBadRequest(text=f"a form that cannot be read: {exc}") from None


#: A body that cannot be read as a form: a charset (UnicodeError is a ValueError) or a
#: part it cannot decode, or a payload the transfer cannot (a gzip that is not gzip, a
#: broken chunk).
_UNREADABLE = (
    ValueError,
    LookupError,
    web_protocol.RequestPayloadError,
    http_exceptions.HttpProcessingError,
)


async def _shown_state(request: web.Request) -> str | None:
    """The state the page showed the item in, which its form sends (``state``): the
    action is taken only if the item is still in it. None from a script that sends none."""
    form = await _form(request)
    if "state" not in form:
        return None
    state = form.get("state")
    if not isinstance(state, str):  # a file part: no state a page sends
        raise web.HTTPBadRequest(text="the form's state must be a text field")
    return state


async def _shown_fence(request: web.Request) -> int | None:
    """The fence the page showed the item at, which its form sends (``fence``): the action
    is taken only if the item is still at it, the same run (`cancel`'s ``if_fence``).
    None from a script that sends none."""
    form = await _form(request)
    if "fence" not in form:
        return None
    fence = form.get("fence")
    if not isinstance(fence, str) or not fence.isascii() or not fence.isdigit():
        raise web.HTTPBadRequest(text="the form's fence must be a whole number")
    if len(fence) > 19:  # past any 64-bit fence (and past what int() reads, at 4,300)
        raise web.HTTPBadRequest(text="the form's fence is past any fence an item can have")
    try:
        return _validate.optional_fence(int(fence), "fence")
    except _errors.InvalidInput as exc:
        raise web.HTTPBadRequest(text=f"the form's {exc}") from None


async def _field(request: web.Request, name: str) -> str:
    form = await _form(request)
    value = form.get(name)
    if not isinstance(value, str):
        raise web.HTTPBadRequest(text=f"the form needs a {name} field")
    return value


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cookie_path(request: web.Request) -> str:
    """The token cookie's path: the dashboard's own (its mount prefix), or the site's
    root for a prefix a cookie's path cannot hold (a ";", a control character); the
    cookie's name, which holds the prefix, keeps it apart all the same."""
    path = _root(request) + "/"
    return "/" if any(c == ";" or ord(c) < 32 or ord(c) == 127 for c in path) else path


def _loopback_peer(request: web.Request) -> bool:
    """Whether a request came from this machine: its peer a loopback address (IPv4 or
    IPv6, or IPv4 as IPv6 from a dual-stack socket), or a Unix socket's, local by its
    file's rights. A peer named otherwise (a proxy-headers middleware's "unknown",
    "1.2.3.4:5555", "[::1]") is not taken for this machine."""
    remote = request.remote
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:
        sock = None if request.transport is None else request.transport.get_extra_info("socket")
        unix = sock is not None and sock.family == getattr(socket_module, "AF_UNIX", None)
        # The socket's own (empty) name, not one a middleware put in its place.
        return unix and not remote
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _json(value: Any) -> str:
    import json

    return json.dumps(value, default=lambda v: v.isoformat())


def _ago(seconds: float | None) -> str:
    """A duration, short: ``42 s``, ``7 min``, ``3.2 h``, ``2.0 d``."""
    if seconds is None:
        return "-"
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 120:
        return f"{sign}{seconds:.0f} s"
    if seconds < 7200:
        return f"{sign}{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{sign}{seconds / 3600:.1f} h"
    return f"{sign}{seconds / 86400:.1f} d"


def _period(seconds: float) -> str:
    """An interval, exact: ``1.4 s``, ``2 min 30 s``, ``1 h 30 min``, ``2 d``."""
    parts = []
    whole = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if whole >= size:
            parts.append(f"{whole // size} {unit}")
            whole %= size
    rest = whole + (seconds - int(seconds))
    if rest or not parts:
        parts.append(f"{rest:g} s")
    return " ".join(parts)


def _when(value: Any) -> str:
    """A time as UTC, to the second."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        value = _models.from_timestamp(value)
    return str(value.strftime("%Y-%m-%d %H:%M:%S"))


def _report_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _log.error("dashboard: the sampler stopped", exc_info=task.exception())
