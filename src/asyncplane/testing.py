"""Helpers for testing code that uses asyncplane: a clock you move by hand, and a
throwaway PostgreSQL cluster.

    clock = ManualClock()
    async with ControlStore(tmp_path / "t.db", lease_seconds=30, clock=clock) as store:
        claim = await store.claim(owner="a")
        clock.advance(31)                      # the lease lapses, no sleeping
        taken = await store.claim(owner="b")   # a takeover with a higher fence

The pytest plugin (`asyncplane.pytest_plugin`, loaded automatically once asyncplane is
installed) offers the same as fixtures: ``asyncplane_clock``, ``asyncplane_store`` and
``asyncplane_store_factory``.

`PostgresCluster` runs a private PostgreSQL server for a test session or a benchmark:
``initdb`` into a temporary directory, ``pg_ctl start`` listening on a unix socket only,
``pg_ctl stop`` and the directory removed at the end:

    with PostgresCluster() as cluster:
        await execute_sql(cluster.url(), "CREATE SCHEMA t1")  # a store opens in one
        store = ControlStore(cluster.url(schema="t1"))
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import glob
import math
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.parse

__all__ = (
    "DEFAULT_START",
    "ManualClock",
    "PostgresCluster",
    "execute_sql",
    "with_schema",
)

DEFAULT_START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
"""Where a ManualClock starts unless told otherwise: 2026-01-01T00:00:00Z."""


class ManualClock:
    """A wall clock that only moves when told to; safe to read from any thread."""

    def __init__(self, start: float | dt.datetime = DEFAULT_START) -> None:
        self._lock = threading.Lock()
        self._now = _seconds(start)
        self._waiters: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        """The current manual time, in seconds since the Unix epoch."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backward); return the new time."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError("seconds must be an int or float")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError("a ManualClock only moves forward, by a finite amount")
        with self._lock:
            self._now += seconds
            now = self._now
        self._wake()
        return now

    def set(self, when: float | dt.datetime) -> None:
        """Jump to ``when``, which may not be earlier than now."""
        target = _seconds(when)
        with self._lock:
            if target < self._now:
                raise ValueError("a ManualClock only moves forward")
            self._now = target
        self._wake()

    async def wait_until(self, when: float | dt.datetime) -> None:
        """Wait until the clock is moved to ``when`` or later (no real time passes)."""
        target = _seconds(when)  # NaN would wait forever: no move ever reaches it
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._now >= target:
                return
            self._waiters.append((target, future))
        try:
            await future
        finally:
            with self._lock:
                self._waiters = [(w, f) for w, f in self._waiters if f is not future]

    def _wake(self) -> None:
        with self._lock:
            due = [f for w, f in self._waiters if w <= self._now]
        for future in due:
            # advance() may run on any thread; the waiter's loop sets its future.
            with contextlib.suppress(RuntimeError):  # that loop has closed meanwhile
                future.get_loop().call_soon_threadsafe(_resolve, future)

    def datetime(self) -> dt.datetime:
        """The current manual time as an aware UTC datetime."""
        return dt.datetime.fromtimestamp(self.now(), tz=dt.timezone.utc)

    def waits(self) -> list[float]:
        """The times tasks wait for on this clock (`wait_until`), soonest first: a test
        sees a timer set before it moves the clock past it."""
        with self._lock:
            return sorted(w for w, f in self._waiters if not f.done())

    def __repr__(self) -> str:
        return f"ManualClock({self.datetime().isoformat()})"


def _seconds(value: float | dt.datetime) -> float:
    if isinstance(value, dt.datetime):
        if value.utcoffset() is None:  # Python's own test of a naive datetime
            raise ValueError("use an aware datetime (with tzinfo) for a ManualClock")
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError("a ManualClock time is epoch seconds or an aware datetime")
    return float(value)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class PostgresCluster:
    """A throwaway PostgreSQL server on a unix socket in a temporary directory.

    Finds ``initdb`` and ``pg_ctl`` on PATH, through ``pg_config --bindir``, or under
    ``/usr/lib/postgresql/*/bin``. PostgreSQL refuses to run as root, so under root the
    server runs as the ``postgres`` system user (through ``runuser``). ``fsync=False``
    (the default) trades crash safety, which a throwaway cluster does not need, for speed.
    Raises RuntimeError, saying why, when the server cannot be started: a test run that
    asked for PostgreSQL must fail then, not skip.
    """

    def __init__(self, *, fsync: bool = False, settings: dict[str, str] | None = None) -> None:
        self._fsync = fsync
        self._settings = dict(settings or {})
        self._root: pathlib.Path | None = None
        self._as: list[str] = []
        self._held: int | None = None  # the maker's lock on its cluster (`_IN_USE`)

    @property
    def socket_dir(self) -> pathlib.Path:
        """The directory holding the server's unix socket."""
        if self._root is None:
            raise RuntimeError("the cluster is not running")
        return self._root

    def url(self, *, schema: str | None = None, database: str = "postgres") -> str:
        """A connection URL; with ``schema``, the store's tables live in that schema (which
        must exist: see `execute_sql`)."""
        host = urllib.parse.urlencode({"host": str(self.socket_dir)})
        url = f"postgresql://postgres@/{database}?{host}"
        return url if schema is None else with_schema(url, schema)

    def start(self) -> str:
        """Create and start the cluster; return its URL.

        First it stops and removes the clusters that processes now dead left behind (a
        test run killed by the OOM killer, say): each cluster's directory names the
        process that made it, and the time that process started. A cluster already
        started is left running, and its URL returned (a second server would be left
        behind by `stop`).
        """
        if self._root is not None:
            return self.url()
        _reap_orphans()
        root = pathlib.Path(tempfile.mkdtemp(prefix=_PREFIX))
        self._root = root
        try:
            (root / _OWNER).write_text(_process_identity(os.getpid()) or "")
            (root / _NAMESPACE).write_text(_pid_namespace())
            self._held = _hold(root / _IN_USE)
            bindir = _postgres_bindir()
            self._as = _run_as()
            if self._as:
                shutil.chown(root, user="postgres")
            data = root / "data"
            self._run(
                [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                 "-E", "UTF8", "--locale=C", "--no-sync"],
                "initdb",
            )  # fmt: skip
            # pg_ctl hands -o to a shell: each option quoted (a space in the temporary
            # directory's path, a % in a setting, were split; a $(...) ran).
            settings = {"listen_addresses": "", "max_connections": "200"}
            if not self._fsync:
                settings |= {"fsync": "off", "synchronous_commit": "off",
                             "full_page_writes": "off"}  # fmt: skip
            settings |= {key: str(value) for key, value in self._settings.items()}
            options = ["-k", str(root)]
            for key, value in settings.items():
                options += ["-c", f"{key}={value}"]
            self._run(
                [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"),
                 "-o", shlex.join(options), "-w", "-t", "60", "start"],
                "pg_ctl start",
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self.url()

    def stop(self) -> None:
        """Stop the server and remove its directory; idempotent."""
        root, self._root = self._root, None
        held, self._held = self._held, None
        try:
            if root is not None:
                _remove_cluster(root, self._as)
        finally:
            if held is not None:
                os.close(held)

    def _run(self, command: list[str], what: str) -> None:
        try:
            done = subprocess.run(
                [*self._as, *command], capture_output=True, text=True, check=False, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{what} could not run: {exc}") from exc
        if done.returncode != 0:
            log = ""
            if self._root is not None and (self._root / "server.log").exists():
                log = (self._root / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"{what} failed (exit {done.returncode}): {done.stderr.strip()} {log}".strip()
            )

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.stop()


async def execute_sql(url: str, statement: str) -> None:
    """Run ``statement`` (one or several, ``;``-separated) on the PostgreSQL server at
    ``url``, on a connection of its own, closed after: for fixtures that make and drop
    schemas. Needs the ``postgres`` extra (`MissingExtra` without it)."""
    from asyncplane import _engine

    _engine.postgres_driver()
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def with_schema(url: str, schema: str) -> str:
    """The PostgreSQL URL with its ``search_path`` set to ``schema``: a store opened on it
    keeps its tables there, apart from every other schema's store."""
    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != "search_path"]
    query.append(("search_path", schema))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


#: What a cluster's directory is called (in the temporary directory), and the file in it
#: that names the process that made it.
_PREFIX = "asyncplane-pg-"
_OWNER = "owner"
#: The file that names its maker's pid namespace (a pid means nothing in another: a
#: container sharing the temporary directory). A file of its own: the owner file is read
#: by earlier releases' reapers too, which compare it whole.
_NAMESPACE = "owner-namespace"
#: The file its maker holds a lock on for as long as it has the cluster: the kernel lets
#: the lock go when the maker ends, in whatever pid namespace, so a reaper in another can
#: tell a cluster in use whose server is down a moment (restarted by its test) from one
#: a removed container left.
_IN_USE = "owner-lock"


def _hold(path: pathlib.Path) -> int | None:
    """A descriptor holding a lock on ``path`` (None where this system has no flock)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _held_elsewhere(path: pathlib.Path) -> bool | None:
    """Whether another process holds ``path``'s lock (None: no such file, an earlier
    release's cluster, or no way to tell)."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def _run_as() -> list[str]:
    """The prefix that runs PostgreSQL's programs as the ``postgres`` user when this
    process is root (PostgreSQL refuses to run as root); nothing otherwise."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return []
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root needs runuser to start PostgreSQL")
    return [runuser, "-u", "postgres", "--"]


def _remove_cluster(root: pathlib.Path, run_as: list[str]) -> None:
    """Stop the server in ``root`` (if it runs) at once, then remove the directory; the
    directory stays if the server could not be stopped (removed under a server still
    running, which another user's or another namespace's stop cannot reach, it ran on
    headless)."""
    data = root / "data"
    if data.exists() and (data / "postmaster.pid").exists():
        pg_ctl = [*run_as, str(_postgres_bindir() / "pg_ctl"), "-D", str(data)]
        subprocess.run(
            [*pg_ctl, "-m", "immediate", "-w", "stop"],
            capture_output=True, check=False, timeout=120,
        )  # fmt: skip
        still = subprocess.run([*pg_ctl, "status"], capture_output=True, check=False, timeout=60)
        if still.returncode != 3:  # 3: no server runs there
            return
    shutil.rmtree(root, ignore_errors=True)


def _process_identity(pid: int) -> str | None:
    """``pid`` and the time it started (so a reused pid is told apart), or None if no
    such process runs, or where /proc does not say. (As every release writes it in a
    cluster's owner file, which every release's reaper reads.)"""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22, after the command name in parentheses (which may hold spaces).
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


def _pid_namespace() -> str:
    """This process's pid namespace ("" where /proc does not say)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _reap_orphans() -> None:
    """Stop and remove the clusters whose maker is gone (Linux; elsewhere, nothing)."""
    if not pathlib.Path("/proc/self/stat").exists():
        return
    for root in pathlib.Path(tempfile.gettempdir()).glob(_PREFIX + "*"):
        try:
            owner = (root / _OWNER).read_text().strip()
            pid = int(owner.split()[0])
        except (OSError, ValueError, IndexError):
            continue  # not ours to judge (another user's, or its maker is still writing)
        with contextlib.suppress(OSError):  # (none: an earlier release's, taken for ours)
            if (root / _NAMESPACE).read_text() != _pid_namespace():
                # Made in another pid namespace: its pid cannot be looked up here, nor its
                # server stopped (pg_ctl would signal whatever process has that pid here).
                if _left_elsewhere(root):
                    shutil.rmtree(root, ignore_errors=True)
                continue
        if _process_identity(pid) == owner:
            continue  # its maker still runs
        with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError):
            _remove_cluster(root, _run_as())


#: How long a cluster made in another pid namespace is left alone though no server answers
#: on its socket: its maker may still be running initdb.
_GRACE_ELSEWHERE = 3600.0


def _left_elsewhere(root: pathlib.Path) -> bool:
    """Whether a cluster made in another pid namespace was left behind (a removed
    container's): made over an hour ago, and no server answers on its socket."""
    try:
        made = (root / _NAMESPACE).stat().st_mtime
        sockets = [
            entry.path
            for entry in os.scandir(root)
            if entry.name.startswith(".s.PGSQL.") and not entry.name.endswith(".lock")
        ]
    except OSError:
        return False  # not ours to look into
    if time.time() - made < _GRACE_ELSEWHERE:
        return False
    if _held_elsewhere(root / _IN_USE):
        return False  # its maker lives: a server it stopped, to start again, say
    for path in sockets:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5.0)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                continue  # a socket file its server, now gone, left
            except OSError:
                return False  # cannot tell: leave it
            return False  # a server answers: in use
    return True


def _version(initdb: str) -> tuple[int, ...]:
    """The version in ``/usr/lib/postgresql/<version>/bin/initdb``, as numbers."""
    found = re.fullmatch(r"[\d.]+", pathlib.Path(initdb).parent.parent.name)
    return tuple(int(n) for n in found.group().split(".") if n) if found else ()


def _postgres_bindir() -> pathlib.Path:
    initdb = shutil.which("initdb")
    if initdb is not None:
        return pathlib.Path(os.path.realpath(initdb)).parent
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        found = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False
        ).stdout.strip()
        if found and (pathlib.Path(found) / "initdb").exists():
            return pathlib.Path(found)
    if sys.platform != "win32":
        versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
        if versions:
            return pathlib.Path(versions[-1]).parent  # the newest: 15 before 9.6
    raise RuntimeError("PostgreSQL's initdb was not found (PATH, pg_config, /usr/lib/postgresql)")
