"""The engine: what a `ControlStore` is made of beneath its public face.

`ControlStore` checks arguments and turns public values into operations; the engine holds
what those operations run on, and what the store's companions (drain, retention, import,
copy, the ledger check, the probe) need of a store, so none of them reaches into the
store's private attributes:

* **The backend**, made here from the location (`backend_for`: the one place that tells
  an SQLite path from a PostgreSQL URL), opened on first use on the running event loop
  (`ready`), closed by `close`.
* **The encoder** (`new_item`): a job's fields checked and encoded for the backend, its
  fingerprint derived from the store's ``identity``.
* **Change notification** (`watch`, `notify`): events set whenever this store writes
  something that may be claimable (and, on PostgreSQL, whenever another host does), so a
  waiting drainer wakes at once.
* **The watch of items waited for** (`settles`, `asyncplane._settles`): one task that
  wakes every `wait()` caller whose item has settled.
* **Housekeeping the drain loop runs a step of each round**: the preflight's fingerprint
  backfill and twin settlement (`preflight_step`) and the throttled purge (`maybe_purge`).

An engine is bound to the event loop that opened it (its writer task lives there).
asyncplane runs on asyncio, anyio's asyncio backend included; under another event loop
(trio) every call raises `NotOnAsyncio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from asyncplane import (
    _backend,
    _clock,
    _errors,
    _fingerprint,
    _lock,
    _models,
    _retention,
    _schedule,
    _settles,
    _tasks,
    _telemetry,
    _validate,
    _write_queue,
)
from asyncplane._record import Record

if TYPE_CHECKING:
    import pathlib

__all__ = (
    "Engine",
    "Options",
    "backend_for",
    "checked_url",
    "is_postgres_url",
    "postgres_driver",
    "redact",
    "redact_urls",
    "require_asyncio",
)

_log = logging.getLogger("asyncplane.store")
_retention_log = logging.getLogger("asyncplane.retention")
_schedules_log = logging.getLogger("asyncplane.schedules")


def is_postgres_url(location: str | os.PathLike[str]) -> bool:
    """Whether a store location names a PostgreSQL schema (a URL) rather than a file."""
    return os.fspath(location).startswith(("postgresql://", "postgres://"))


#: The URL parameters that carry a secret (as a libpq connection string takes them).
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})
#: A PostgreSQL URL within a text (a message quoting what the user typed).
_URL_IN_TEXT = r"postgres(?:ql)?://[^\s'\"]+"


def _unreadable(url: str) -> bool:
    """Whether a URL's parts cannot be told apart: a host's port that is no number, or a
    user and password cut short (a ``user:pass`` before any ``@``, its password holding a
    ``/``, ``?`` or ``#`` unencoded, which moves the rest of it past the host), or one
    holding an ``@`` unencoded (the drivers end them at the first ``@``). Several
    hosts (``h1:5432,h2``) and an ``@`` in a parameter's value are read as libpq reads
    them."""
    import urllib.parse  # with a URL's first look: a program on SQLite never needs it

    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 address, say
        return True
    if "@" in parts.path + parts.fragment:  # a database name has none: a password's rest
        return True
    netloc = parts.netloc
    if netloc.count("@") > 1:  # libpq and asyncpg end the user info at the first "@"
        return True
    _, at, hosts = netloc.rpartition("@")
    for host in hosts.split(","):
        port = host.rpartition("]")[2] if host.startswith("[") else host
        _, colon, digits = port.rpartition(":")
        if colon and digits and not (digits.isascii() and digits.isdigit() and int(digits) < 65536):
            return True  # no port: a password's start, its end cut off, or a typo
    if at:
        return False
    # "user:" and a password that begins with "/": its rest, with the "@", past the host.
    if netloc.endswith(":") and "@" in url.partition("://")[2][len(netloc) :]:
        return True
    # "user:2024?pass@host": read as host "user", port 2024, and a query whose first words
    # (before its "@") are no parameter, which no query of libpq's holds.
    before, _, _ = parts.query.partition("@")
    return "@" in parts.query and any("=" not in field for field in before.split("&"))


def checked_url(url: str) -> str:
    """A PostgreSQL URL whose parts can be read (see `_unreadable`); InvalidInput, which
    never shows the URL, otherwise."""
    if _unreadable(url):
        raise _errors.InvalidInput(
            "the PostgreSQL URL cannot be read: its port is not a number, or its user or "
            "password holds a '/', '?', '#' or '@' (write them %2F, %3F, %23, %40)"
        )
    return url


def redact(url: str) -> str:
    """The URL without its password (given before the host or as a parameter), for
    messages and reprs; the rest of it as written. One whose parts cannot be told apart
    shows its scheme only: where its password ends cannot be known."""
    if _unreadable(url):
        return url.partition("://")[0] + "://***"
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        head, host = netloc.rsplit("@", 1)
        netloc = f"{head.split(':', 1)[0]}:***@{host}"
    query = "&".join(
        f"{part.split('=', 1)[0]}=***"
        if urllib.parse.unquote_plus(part.split("=", 1)[0]).lower() in _SECRET_PARAMETERS
        else part
        for part in parts.query.split("&")
    )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    # Written out, not urlunsplit: that drops the "//" of an empty host (a socket path
    # given as ?host=), and the result would read as no URL at all.
    return (
        f"{parts.scheme}://{netloc}{parts.path}{'?' + query if query else ''}"
        f"{'#' + parts.fragment if parts.fragment else ''}"
    )


def redact_urls(text: str) -> str:
    """``text`` with every PostgreSQL URL in it redacted (see `redact`)."""
    import re  # for the command line's messages only

    return re.sub(_URL_IN_TEXT, lambda found: redact(found.group()), text)


class Options(Record):
    """A store's settings, checked already, as the engine and its backend need them.

    A NamedTuple rather than a frozen dataclass: as immutable, and about 2 ms less to
    import (a dataclass compiles each of its methods when the class is made)."""

    clock: _clock.Clock | None
    synchronous: Literal["NORMAL", "FULL"]
    busy_timeout: float
    max_batch: int
    read_connections: int
    read_only: bool
    identity: tuple[str, ...]
    max_payload_bytes: int
    max_attempts: int | None
    retention: float | None
    archive_path: pathlib.Path | None
    archive_max_bytes: int
    purge_chunk: int
    purge_min_interval: float


def worker_name(kind: str) -> str:
    """A default owner for a runtime's claims: its kind, host, process and a random id."""
    return f"{kind}@{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


def postgres_driver() -> None:
    """`MissingExtra`, naming the extra, unless asyncpg (the ``postgres`` extra) can be
    imported: what every use of a ``postgresql://`` URL asks first."""
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        raise _errors.MissingExtra(
            "a postgresql:// store needs the postgres extra: pip install 'asyncplane[postgres]'"
        ) from None


def backend_for(
    location: str,
    options: Options,
    on_change: _backend.ChangeHook,
    on_settled: _backend.ChangeHook | None = None,
) -> _backend.Backend:
    """The backend a location names: an SQLite file (made absolute now, so a later chdir
    cannot move it), or the schema a ``postgresql://`` URL names (the ``postgres``
    extra; its leases follow the server's clock unless ``options.clock`` is given)."""
    # An injected clock's readings are checked before anything is written from them.
    clock = None if options.clock is None else _clock.Checked(options.clock)
    sizing = _backend.Sizing(options.max_batch, options.read_connections, options.read_only)
    if is_postgres_url(location):
        postgres_driver()
        from asyncplane import _postgres  # only a PostgreSQL store needs its driver

        return _postgres.PostgresBackend(
            location,
            sizing,
            clock=clock,
            # NOTIFY from any host wakes this process's drainers as a local write does.
            on_change=on_change,
            # NOTIFY asyncplane_settled wakes this process's wait() calls.
            on_settled=on_settled,
            connect_timeout=options.busy_timeout,
        )
    from asyncplane import _sqlite

    return _sqlite.SQLiteBackend(
        _validate.resolved_path(location, "path"),
        sizing,
        clock=clock if clock is not None else _clock.SystemClock(),
        synchronous=options.synchronous,
        busy_timeout=options.busy_timeout,
    )


class Engine:
    """A store's backend, encoder, notifier and housekeeping (see the module)."""

    def __init__(self, location: str, options: Options) -> None:
        self.options = options
        self._watchers: set[asyncio.Event] = set()
        #: How many times the store was closed: a waiter that saw it change stops waiting.
        self.closes = 0
        #: How many times the backend was opened (again after a lost connection, too).
        self.opens = 0
        self._settle_watchers: set[asyncio.Event] = set()
        self._close_watchers: set[asyncio.Event] = set()
        self.backend = backend_for(location, options, self.notify, self.notify_settled)
        #: The SQLite file (None: a PostgreSQL store), which no lock_path may name.
        self._database = (
            None if is_postgres_url(location) else _validate.resolved_path(location, "path")
        )
        #: The items `wait()` callers wait for, and the one task that watches them.
        self.settles = _settles.SettleWatch(self)
        # Where the preflight's fingerprint backfill has got to, per scope it ran in.
        self._backfill_after: dict[tuple[str | None, str | None], int] = {}
        self._last_purge: float | None = None
        self._last_schedules: float | None = None
        #: How many of `maybe_run_schedules`' looks the store answered (work() reads an
        #: answer as an outage's end; a look not made says nothing).
        self.schedule_looks = 0
        self._crons_left_said = False
        self._passed_said: set[str] = set()  # schedules passed over, said once each
        #: When the next tick of any schedule falls, as the last run here found it.
        self.next_tick: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open_lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self.is_open = False
        #: What the OpenTelemetry gauges read of this store, while it is open.
        self.gauges: _telemetry.Gauges | None = None

    @property
    def clock(self) -> _clock.Clock:
        """The clock leases and events are measured by."""
        return self.backend.clock

    # --- lifecycle -------------------------------------------------------------------------

    async def ready(self) -> _backend.Backend:
        """The backend, opened on first use."""
        if self.is_open and self._loop is _running_loop() and not self.backend.broken:
            return self.backend  # the hot path: open, on its own loop
        self._check_loop()
        async with self._opening_lock():
            if self.is_open and self.backend.broken:
                # The write connection was lost (a server restart, say): start afresh.
                _log.warning("asyncplane: %s lost its connection; opening again", self.location)
                self.is_open = False
                if self.gauges is not None:
                    # Gone with the connection: a reopen that fails leaves no open store,
                    # and close() then has nothing to close (its last values stood for
                    # ever, beside the next store's of the same name). Dropped without a
                    # wait: no cancellation may land between here and the backend's close.
                    gauges, self.gauges = self.gauges, None
                    gauges.drop()
                await self.backend.close(lost=True)
            if not self.is_open:
                self._loop = asyncio.get_running_loop()
                try:
                    await self.backend.open()
                except BaseException:
                    self._loop = None
                    raise
                self.is_open = True
                self.opens += 1
                if self.gauges is not None:  # left by a loop that ended
                    self.gauges.forget()
                self.gauges = _telemetry.Gauges(
                    self.location, self.backend.stats, self.backend.clock.now, self._loop
                )
        return self.backend

    async def close(self) -> None:
        """Finish every queued write, then release all connections; idempotent."""
        self._check_loop()
        if self._loop is None:  # never opened, or closed already
            return
        async with self._opening_lock():
            if not self.is_open:
                return
            self.is_open = False
            self.closes += 1
            self.notify()  # waiters for work (claims(), work()) see the store close
            for event in self._close_watchers:
                event.set()
            try:
                if self.gauges is not None:
                    gauges, self.gauges = self.gauges, None
                    await gauges.close()
                await self.backend.close()
            finally:
                self._loop = None

    @property
    def location(self) -> str:
        """Where the store lives, for messages (a URL without its password)."""
        return self.backend.location

    def _opening_lock(self) -> asyncio.Lock:
        """The lock that serialises opening and closing, made for the running loop."""
        loop = asyncio.get_running_loop()
        if self._open_lock is None or self._lock_loop is not loop:
            self._open_lock, self._lock_loop = asyncio.Lock(), loop
        return self._open_lock

    def _check_loop(self) -> None:
        loop = _running_loop()
        if self._loop is not None and self._loop is not loop:
            if self._loop.is_closed():
                # The loop it was opened on has ended. asyncio.run cancelled the writer,
                # which closed its connections; a loop closed without that leaves threads
                # behind, which forget() stops. Either way: start afresh on this loop.
                self.backend.forget()
                self.is_open = False
                self._loop = None
                # Its waiters will never run again: a write setting their events would
                # schedule on the dead loop (RuntimeError, and the write's caller hears it).
                self._watchers.clear()
                self._settle_watchers.clear()
                self._close_watchers.clear()
                self.settles = _settles.SettleWatch(self)
                return
            raise _errors.StoreClosed(
                "this ControlStore was opened on another event loop; "
                "close it there, or open one store per event loop"
            )

    # --- the encoder -----------------------------------------------------------------------

    def new_item(self, job: _models.Job, dedup: bool) -> _backend.NewItem:
        """Check one job's fields and encode it for the backend."""
        options = self.options
        payload_json = _validate.encode_payload(job.payload, options.max_payload_bytes)
        fp = _validate.fingerprint(job.fingerprint)
        if fp is None and options.identity:
            fp = _fingerprint.from_payload(job.payload, options.identity)
        max_attempts = _validate.optional_positive_int(job.max_attempts, "max_attempts")
        return _backend.NewItem(
            payload_json,
            _validate.priority(job.priority),
            _validate.service_class(job.service_class),
            _validate.instant(job.sla, "sla"),
            fp,
            dedup,
            options.max_attempts if max_attempts is None else max_attempts,
            _validate.instant(job.not_before, "not_before"),
        )

    # --- change notification ---------------------------------------------------------------

    def watch(self, *, settles: bool = False) -> asyncio.Event:
        """An event set whenever this store writes something that may be claimable; with
        ``settles``, also whenever another process or host settles an item (wait())."""
        event = asyncio.Event()
        (self._settle_watchers if settles else self._watchers).add(event)
        return event

    def watch_closes(self, event: asyncio.Event) -> None:
        """Set ``event`` when the store closes, and at nothing else (until `unwatch`): a
        worker whose slots are all busy waits for no new work, yet has to see a close."""
        self._close_watchers.add(event)

    def unwatch(self, event: asyncio.Event) -> None:
        """Stop setting ``event``."""
        self._watchers.discard(event)
        self._settle_watchers.discard(event)
        self._close_watchers.discard(event)

    def notify(self) -> None:
        """Wake every watcher: something may have become claimable (or settled)."""
        for event in (*self._watchers, *self._settle_watchers):
            event.set()

    def notify_settled(self) -> None:
        """Wake the settle watchers: an item settled elsewhere (drainers sleep on)."""
        for event in self._settle_watchers:
            event.set()

    async def data_version(self) -> int:
        """A number that changes whenever another connection commits to the store."""
        return await (await self.ready()).data_version()

    async def settled_mark(self) -> tuple[_backend.Backend, tuple[int, int]]:
        """The backend, and a mark that changes when an item settles
        (`Backend.settled_version`) or when the backend was opened again (after a lost
        connection, when a settle elsewhere may have gone unheard)."""
        backend = await self.ready()
        opens = self.opens
        return backend, (opens, await backend.settled_version())

    def drain_guard(self) -> contextlib.AbstractAsyncContextManager[_lock.Guard]:
        """The backend's single-drainer guard (a lock file, or an advisory lock)."""
        return self.backend.drain_guard()

    @contextlib.asynccontextmanager
    async def single_runner(self, lock_path: pathlib.Path | None) -> AsyncIterator[_lock.Guard]:
        """The guard of a runtime that runs alone (drain(), work(exclusive=True)): the lock
        file asked for, else the store's own (beside an SQLite file; a session advisory
        lock on PostgreSQL, which holds across hosts)."""
        if lock_path is not None:
            _validate.lock_file_apart(lock_path, self._database, self.options.archive_path)
            async with _lock.DrainLock(lock_path) as lock:
                yield _lock.Guard(lock.acquired)
        else:
            async with self.drain_guard() as guard:
                yield guard

    # --- housekeeping ----------------------------------------------------------------------

    async def preflight_step(
        self, chunk: int, *, project_id: str | None = None, actor_id: str | None = None
    ) -> tuple[int, bool]:
        """One bounded step of preflight dedup: (items settled, whether work may remain).

        Looks at most ``chunk`` items for missing fingerprints, continuing where the last
        step in the same scope stopped, then settles at most ``chunk`` pending twins of
        done items among the twin pairs the store noted as they formed; only within
        ``project_id`` / ``actor_id`` when given. The drain loop takes one step per round,
        so preflight never holds a round up, and a step costs what changed, not the store.
        """
        backend = await self.ready()
        op = _backend.PreflightOp(chunk, project_id, actor_id)
        seen = 0
        if self.options.identity:
            # A look first (a read of the items after the mark that lack a fingerprint):
            # the write lock is taken only for items that get one.
            scope = (project_id, actor_id)
            look = await backend.missing_fingerprints(
                op, self._backfill_after.get(scope, 0), self.options.identity
            )
            if look.writes:
                await backend.set_fingerprints(look.writes)
            self._backfill_after[scope] = look.after
            seen = look.seen
        # A look first (a read of the twin pairs noted as they formed), so that a store
        # with no twin to settle, the usual case, takes no write lock for it and reads
        # nothing in proportion to its size: work() steps once a second even idle.
        settled, more = 0, False
        if await backend.any_twin_noted(op):
            settled, more = await backend.settle_pending_twins(op)
            if settled:
                self.notify_settled()  # wait() calls of this process: at once, not polled
        _telemetry.dedup_settled(settled, "preflight")
        return settled, seen == chunk or more

    async def restart_preflight(self, chunk: int) -> None:
        """Make the next preflight steps a full pass: the backfill looks at every item
        again, and every twin pair in the store is noted, however it formed."""
        self._backfill_after.pop((None, None), None)
        backend = await self.ready()
        contents = await backend.twin_pairs(_backend.PreflightOp(chunk, None, None))
        if contents:
            await backend.note_twin_pairs(contents)

    async def run_schedules(self) -> int:
        """Enqueue every due tick (a transaction per few dozen schedules), then note when
        the next one falls; return how many items were enqueued."""
        backend = await self.ready()
        self._last_schedules = time.monotonic()
        started = self.clock.now()
        enqueued = 0
        crons = _schedule.crons_here()
        if not crons:
            await self._say_crons_are_left(backend)
        passed_over: list[str] = []
        while True:
            op = _backend.RunSchedulesOp(_SCHEDULES_PER_ROUND, crons, tuple(passed_over))
            call = backend.run_schedules(op)
            try:
                ticks, looked, passed = await call
            except asyncio.CancelledError:
                # Cancelled while its round ran, the writer tells (`Writes.orphaned`,
                # which wakes the waiters, as for any write of FREEING); once its answer
                # was in, the future holds it: a waiter woken for nothing looks once more.
                if _write_queue.has_answer(call):
                    self.notify()
                raise
            enqueued += ticks
            if ticks:  # each transaction's items, as it commits (a later one may be cut)
                self.notify()
            self._say_passed_over(passed)
            passed_over.extend(name for name, _ in passed)  # left out of the next one
            if looked + len(passed) < _SCHEDULES_PER_ROUND:
                break
        if enqueued:
            _schedules_log.debug("schedules enqueued %d item(s)", enqueued)
        tick = await backend.next_tick(crons)
        if tick is not None and tick <= started:
            # Due when the run began, and due still: its row was another process's this
            # instant (PostgreSQL skips a locked one), which enqueues it. Looked at again
            # in a while, not at once: a waiter woken for it would run the schedules again
            # and again meanwhile. (A tick that fell during the run is run at once.)
            tick = self.clock.now() + _SCHEDULES_EVERY
        self.next_tick = tick
        return enqueued

    async def schedules_until(self, done: asyncio.Event, stop: asyncio.Event, closes: int) -> int:
        """Run the schedules at their pace (`maybe_run_schedules`) until ``done`` or
        ``stop`` is set, or the store closes after ``closes`` closes, sleeping between runs
        as `until_tick_or_look` does: what a drain whose batch runs does meanwhile, so that
        no tick falls late while its items run. How many items the schedules enqueued."""
        enqueued = 0
        while not (done.is_set() or stop.is_set() or self.closes != closes):
            enqueued += await self.maybe_run_schedules(closes)
            sleeps: list[asyncio.Task[Any]] = [
                asyncio.create_task(done.wait(), name="asyncplane-busy-schedules-done"),
                asyncio.create_task(stop.wait(), name="asyncplane-busy-schedules-stop"),
                asyncio.create_task(self.until_tick_or_look(), name=BUSY_SCHEDULES),
            ]
            try:
                await asyncio.wait(sleeps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for sleep in sleeps:
                    sleep.cancel()
                await asyncio.gather(*sleeps, return_exceptions=True)
        return enqueued

    def busy_alarm(self, ring: Callable[[], object]) -> Callable[[], object]:
        """Arrange ``ring()`` for the schedules' next run, as `until_tick_or_look` would
        end; return what cancels it. A busy worker arms one for each wait for a slot, so
        where the store's clock moves with real time it is a timer of the event loop
        (re-armed each wait, within `asyncplane._clock.WALL_SLICE` of a tick, so that a
        step of the clock counts): a task each wait cost `work()` at concurrency 1 about
        a tenth more CPU per item. On a test's manual clock it is a task that waits on
        the clock (named `BUSY_SCHEDULES`)."""
        tick = self.next_tick
        if tick is None or _clock.real_time(self.clock):
            delay = _BUSY_LOOK
            if tick is not None:
                delay = min(max(tick - self.clock.now(), 0.0), _clock.WALL_SLICE)
            return asyncio.get_running_loop().call_later(delay, ring).cancel
        return asyncio.create_task(self._ring_at_tick(ring), name=BUSY_SCHEDULES).cancel

    async def _ring_at_tick(self, ring: Callable[[], object]) -> None:
        await self.until_tick_or_look()
        ring()

    async def until_tick_or_look(self) -> None:
        """Sleep until the next tick known here falls (on the store's clock), or
        `_BUSY_LOOK` seconds at most: a busy worker's or drain's pause between two runs of
        the schedules (a schedule added or changed elsewhere meanwhile is learnt of at
        the next run)."""
        tick = self.next_tick
        if tick is None:
            await asyncio.sleep(_BUSY_LOOK)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await _tasks.within(
                _clock.wait_until(self.clock, tick), _BUSY_LOOK, "asyncplane-busy-schedules-clock"
            )

    def _say_passed_over(self, passed: tuple[tuple[str, str], ...]) -> None:
        """Warn, once a process for each, of the schedules a run passed over as this host
        cannot read them: they stay due for a host that can."""
        for name, why in passed:
            if name not in self._passed_said:
                self._passed_said.add(name)
                _schedules_log.warning(
                    "schedule %r is left to a host that can read it: %s", name, why
                )

    async def _say_crons_are_left(self, backend: _backend.Backend) -> None:
        """Warn, once a process, that cron schedules fall due that this process leaves to
        another (it lacks the cron extra)."""
        if self._crons_left_said:
            return
        due = await backend.next_cron_tick()
        if due is not None and due <= self.clock.now():
            self._crons_left_said = True
            _schedules_log.warning(
                "cron schedules are due, and this process leaves them to one that has the "
                "cron extra (pip install 'asyncplane[cron]'); it runs the every= ones"
            )

    def recheck_schedules(self) -> None:
        """Look at the schedules again in the next round, however recent the last look: a
        waiter woke (a schedule may have been added, changed or resumed)."""
        self._last_schedules = None

    async def maybe_run_schedules(self, closes: int | None = None) -> int:
        """The drain loop's and work()'s schedules: at most once a second, and as soon as
        the next tick known here falls; a look first (a read), so that a store with no
        tick due takes no write lock for them. With ``closes`` (the store's close count
        when the caller began), nothing is run once the store has closed since, not even
        after a look that was out at the close: a run would open it again."""
        last = self._last_schedules
        if last is not None and time.monotonic() - last < _SCHEDULES_EVERY:
            tick = self.next_tick
            if tick is None or self.clock.now() < tick:
                return 0
        if closes is not None and self.closes != closes:
            return 0
        self._last_schedules = time.monotonic()
        tick = self.next_tick = await (await self.ready()).next_tick(_schedule.crons_here())
        self.schedule_looks += 1
        if tick is None or self.clock.now() < tick:
            return 0
        if closes is not None and self.closes != closes:
            return 0  # closed while the look was out
        return await self.run_schedules()

    async def maybe_purge(self, max_chunks: int = 20) -> int:
        """The drain loop's retention: at most every purge_min_interval_s, a bounded purge."""
        options = self.options
        if options.retention is None or options.archive_path is None:
            return 0
        now = time.monotonic()
        if self._last_purge is not None and now - self._last_purge < options.purge_min_interval:
            return 0
        self._last_purge = now
        purged = [0]  # the chunks' count so far: an archive failing later keeps theirs
        try:
            done = await _retention.purge(
                await self.ready(),
                self.clock,
                options.retention,
                chunk=options.purge_chunk,
                archive_path=options.archive_path,
                archive_max_bytes=options.archive_max_bytes,
                max_chunks=max_chunks,
                progress=lambda count: purged.__setitem__(0, count),
            )
        except _errors.ArchiveError as exc:
            # The archive cannot be written (a missing directory, a full disk): nothing of
            # that chunk was deleted, the work goes on, and the next interval tries again.
            _retention_log.warning("asyncplane: purge cut short, the archive failed: %s", exc)
            return purged[0]
        return done.purged


#: How many due schedules one transaction of run_schedules takes.
_SCHEDULES_PER_ROUND = 50
#: The least time between two runs of the schedules a drain loop makes (unless a tick
#: it knows of falls due sooner), in seconds.
_SCHEDULES_EVERY = 1.0
#: The name of a busy worker's or drain's wait for its schedules' next run (tests look for it).
BUSY_SCHEDULES = "asyncplane-busy-schedules-tick"
#: The longest a busy worker's schedules sleep without a tick known to fall (`schedules_until`):
#: a schedule added elsewhere meanwhile runs its first tick at most this late, well inside
#: the minute a ``catch_up="none"`` tick may be late and still run.
_BUSY_LOOK = 10.0


def require_asyncio() -> asyncio.AbstractEventLoop:
    """The running asyncio loop; `NotOnAsyncio` when none runs here (trio, say)."""
    return _running_loop()


def _running_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise _errors.NotOnAsyncio(
            "asyncplane runs on asyncio (anyio's asyncio backend included): no asyncio "
            "event loop is running here (trio, or a call from outside any event loop)"
        ) from None
