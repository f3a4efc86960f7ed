"""What is PostgreSQL's own: the mechanisms that differ from SQLite's.

The behaviour both backends share is proved by the rest of the suite, which runs every
store test on both. Here: the URL, the server's clock, several "hosts" (stores with
connections of their own) meeting on one schema, the schema guard, and NOTIFY.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import types
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import asyncpg
import pytest

from _signals import until, waiting_on
from asyncplane import (
    CommitOutcomeUnknown,
    ControlStore,
    Done,
    DrainError,
    FenceRejected,
    InvalidInput,
    Job,
    NotAnAsyncplaneDatabase,
    ReadOnlyStore,
    SchemaVersionError,
    StorageError,
    StoreClosed,
    _clock,
    _engine,
    drain,
    testing,
    verify_ledger,
    work,
)
from asyncplane import _postgres_sql as pg_sql
from asyncplane._store import engine_of
from asyncplane.testing import ManualClock

pytestmark = pytest.mark.postgresql_only

SERVER_NOW = "SELECT extract(epoch FROM clock_timestamp())::float8"
TABLES_HERE = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"


async def sql(url: str, statement: str, *args: Any) -> list[Any]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(statement, *args))
    finally:
        await conn.close()


async def lock_waits(conn: asyncpg.Connection) -> int:
    """How many sessions of the database wait for a lock now (seen through ``conn``)."""
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
    )


def test_a_url_selects_postgresql_and_its_password_stays_out_of_sight() -> None:
    store = ControlStore("postgresql://app:s3cret@db.example:5432/work?search_path=q")
    assert store.backend == "postgresql"
    assert "s3cret" not in store.location and "s3cret" not in repr(store)
    assert store.location == "postgresql://app:***@db.example:5432/work?search_path=q"
    given = ControlStore(
        "postgresql://app@db.example/work?password=s3cret&search_path=q&sslpassword=k3y"
        "&pass%77ord=s3cret&PASSWORD=s3cret"
    )
    assert given.location == (
        "postgresql://app@db.example/work?password=***&search_path=q&sslpassword=***"
        "&pass%77ord=***&PASSWORD=***"
    )
    with pytest.raises(InvalidInput, match="no file"):
        _ = store.path
    assert store.archive_path is None
    with pytest.raises(InvalidInput, match="archive_path"):
        ControlStore("postgres://db.example/work", retention=60)
    assert ControlStore("plain.db").backend == "sqlite"
    # A password holding '/', '?', '#' or '@' unencoded moves the rest of it out of the user info,
    # where nothing knows it for a password: such a URL is refused, without being shown.
    for unreadable in (
        "postgresql://app:S3cret/xyz@127.0.0.1:5432/app", "postgresql://app:S3c?ret@h/db",
        "postgresql://app:S3c#ret@h/db", "postgresql://app:S3cret@h:port/db",
        "postgresql://app:S3cret@[::1/db", "postgresql://app:S3cret@h:99999/db",
        "postgresql://app:S3cret:/x@h/db", "postgresql://app:S3c/1@h/db",
        "postgresql://app:2024?S3c@db.example.com/app", "postgresql://app:S3c@ret@h/db",
        "postgresql://app@x:S3cret@h:5432/db",
    ):  # fmt: skip
        with pytest.raises(InvalidInput, match="cannot be read") as refused:
            ControlStore(unreadable)
        assert "S3c" not in str(refused.value)
        assert _engine.redact(unreadable) == "postgresql://***"
    # An empty host (a socket directory given as ?host=) keeps its "//".
    socket = "postgresql:///db?host=/run/postgresql&password=S3cret"
    assert _engine.redact(socket) == "postgresql:///db?host=/run/postgresql&password=***"
    fine = "postgresql://app:S3cret@h/db?application_name=a@b"  # an '@' past a whole user info
    assert ControlStore(fine).location == "postgresql://app:***@h/db?application_name=a@b"
    for readable in (  # as libpq reads them: several hosts, an '@' in a parameter's value
        "postgresql://pg1:5432,pg2/app?target_session_attrs=read-write",
        "postgresql://db.example.com:5432/app?user=alice@myserver",
        "postgresql:///app?host=/var/run/postgresql&application_name=worker@host1",
    ):
        assert ControlStore(readable).location == readable


def test_without_the_extra_a_url_names_the_extra(tmp_path: pathlib.Path) -> None:
    script = (
        "import asyncio, sys\n"
        "sys.modules['asyncpg'] = None\n"
        "from asyncplane import ControlStore, MissingExtra, cli, testing\n"
        "url = 'postgresql://app:s3cret@127.0.0.1:1/db'\n"
        "try:\n"
        "    ControlStore(url)\n"
        "except MissingExtra as exc:\n"
        "    print(exc)\n"
        "try:\n"
        "    asyncio.run(testing.execute_sql(url, 'SELECT 1'))\n"
        "except MissingExtra as exc:\n"
        "    print(exc)\n"
        "raise SystemExit(cli.main([url if a == 'URL' else a for a in sys.argv[1:]]))\n"
    )
    (tmp_path / "agents.py").write_text("async def handle(claim): ...\n")
    said = "a postgresql:// store needs the postgres extra: pip install 'asyncplane[postgres]'"
    for verb, told in (
        (["stats", "URL"], f"asyncplane stats: {said}\n"),
        (["probe", "--scenario", "stall", "--store", "URL"], said),
        (["probe", "--scenario", "chaos", "--role", "worker", "--store", "URL"], said),
        (["worker", "URL", "agents:handle"], f"asyncplane worker: {said}\n"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", script, *verb],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        assert (done.returncode, done.stdout) == (2, f"{said}\n{said}\n"), done.stderr
        assert told in done.stderr and "Traceback" not in done.stderr, done.stderr


async def test_an_unreachable_server_is_a_storage_error(tmp_path: Any) -> None:
    store = ControlStore(f"postgresql://nobody@/none?host={tmp_path}", busy_timeout=2)
    with pytest.raises(StorageError, match="cannot connect"):
        await store.open()


async def test_leases_are_measured_by_the_server_clock(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This host's clock is an hour fast; the server's is right. The lease follows the
    # server, so workers on hosts with skewed clocks agree on when it lapses.
    real_now = _clock.SystemClock.now
    monkeypatch.setattr(_clock.SystemClock, "now", lambda self: real_now(self) + 3600)
    async with ControlStore(url, lease_seconds=60) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
        (server_before,) = (await sql(url, SERVER_NOW))[0]
        claim = await store.claim("w")
        (server_after,) = (await sql(url, SERVER_NOW))[0]
    assert claim is not None
    expires = claim.lease_expires_at.timestamp()
    assert server_before + 60 - 1 <= expires <= server_after + 60 + 1


async def test_two_hosts_claim_side_by_side_without_sharing_an_item(url: str) -> None:
    hosts = [ControlStore(url, lease_seconds=600) for _ in range(3)]
    try:
        await hosts[0].create_project("p", "P")
        ids = await hosts[0].enqueue_many("p", [{"n": n} for n in range(300)])

        async def work(store: ControlStore, name: str) -> list[int]:
            done = []
            while (batch := await store.claim_batch(name, 7)) != []:
                for claim in batch:
                    await store.finish(claim.item_id, fence=claim.fence)
                    done.append(claim.item_id)
            return done

        results = await asyncio.gather(
            *(work(store, f"h{n}-w{k}") for n, store in enumerate(hosts) for k in range(4))
        )
        finished = [item for result in results for item in result]
        assert sorted(finished) == ids  # every item once: none shared, none lost
        assert await verify_ledger(hosts[0]) == []
    finally:
        for store in hosts:
            await store.close()


async def test_twins_never_run_at_once_even_across_hosts(url: str) -> None:
    hosts = [ControlStore(url, lease_seconds=600) for _ in range(4)]
    try:
        await hosts[0].create_project("p", "P")
        for n in range(8):  # eight independent items with the same content
            await hosts[0].enqueue("p", {"n": n}, fingerprint="same", dedup=False)
        claims = await asyncio.gather(*(store.claim_batch(f"h{n}", 4) for n, store in
                                        enumerate(hosts)))  # fmt: skip
        running = [claim for batch in claims for claim in batch]
        assert len(running) == 1  # one of the twins; the others wait for it
        rows = await sql(url, "SELECT count(*) FROM items WHERE state = 'claimed'")
        assert rows[0][0] == 1
        assert await verify_ledger(hosts[0]) == []
    finally:
        for store in hosts:
            await store.close()


async def test_concurrent_enqueues_of_one_content_agree_on_one_item(url: str) -> None:
    hosts = [ControlStore(url) for _ in range(4)]
    try:
        await hosts[0].create_project("p", "P")
        ids = await asyncio.gather(
            *(store.enqueue("p", {"from": n}, fingerprint="f") for n, store in enumerate(hosts))
        )
        assert len(set(ids)) == 1
        counts = await hosts[0].counts()
        assert counts["ready"] == 1
    finally:
        for store in hosts:
            await store.close()


async def test_a_schema_of_another_application_is_refused(url: str) -> None:
    await sql(url, "CREATE TABLE customers (id int)")
    with pytest.raises(NotAnAsyncplaneDatabase):
        await ControlStore(url).open()
    assert [r[0] for r in await sql(url, TABLES_HERE)] == ["customers"]  # untouched


async def test_a_newer_schema_is_refused(url: str) -> None:
    async with ControlStore(url):
        pass
    await sql(url, "UPDATE asyncplane_meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(SchemaVersionError, match="999"):
        await ControlStore(url).open()


async def test_many_stores_opening_a_fresh_schema_at_once_migrate_it_once(url: str) -> None:
    stores = [ControlStore(url) for _ in range(6)]
    try:
        await asyncio.gather(*(store.open() for store in stores))
        await stores[0].create_project("p", "P")
        assert (await stores[5].project("p"))["name"] == "P"
    finally:
        for store in stores:
            await store.close()


async def test_a_read_only_store_reads_and_refuses_writes(url: str) -> None:
    async with ControlStore(url) as writer:
        await writer.create_project("p", "P")
        item = await writer.enqueue("p", {"x": 1})
    async with ControlStore(url, read_only=True) as reader:
        assert (await reader.item(item))["payload"] == {"x": 1}
        with pytest.raises(ReadOnlyStore):
            await reader.enqueue("p", {})


@contextlib.contextmanager
def a_hot_standby(primary: testing.PostgresCluster) -> Any:
    """A hot standby of ``primary`` (streaming from it), on a socket of its own: its URL.
    (Its max_connections is the primary's, as a standby's must be at least.)"""
    run_as, bindir = testing._run_as(), testing._postgres_bindir()
    root = pathlib.Path(tempfile.mkdtemp(prefix="asyncplane-standby-"))
    if run_as:
        shutil.chown(root, user="postgres")
    try:
        data = root / "data"
        subprocess.run(
            [*run_as, str(bindir / "pg_basebackup"), "-h", str(primary.socket_dir),
             "-U", "postgres", "-D", str(data), "-R", "-X", "stream", "--checkpoint=fast"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        subprocess.run(
            [*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"),
             "-o", f"-k {root} -c listen_addresses='' -c max_connections=200", "-w", "start"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        yield f"postgresql://postgres@/postgres?{urllib.parse.urlencode({'host': str(root)})}"
    finally:
        testing._remove_cluster(root, run_as)


async def test_a_read_only_store_opens_on_a_hot_standby_and_polls_it() -> None:
    # A server in recovery refuses LISTEN: a read-only store (every looking command, the
    # read-only dashboard, a copy's source) reads a replica without notifications.
    with testing.PostgresCluster() as primary:
        await testing.execute_sql(primary.url(), "CREATE SCHEMA fleet")
        async with ControlStore(primary.url(schema="fleet")) as store:
            await store.create_project("p", "P")
            await store.enqueue("p", {"n": 1})
            with a_hot_standby(primary) as standby:
                async with ControlStore(
                    testing.with_schema(standby, "fleet"), read_only=True
                ) as replica:
                    assert (await replica.counts())["ready"] == 1
                    assert await verify_ledger(replica) == []
                    backend: Any = await replica._engine.ready()
                    assert backend._deaf  # so every poll looks again
                    assert (
                        await replica._engine.data_version() != await replica._engine.data_version()
                    )
                    await store.enqueue("p", {"n": 2})
                    await until(lambda: _counted(replica, "ready", 2), what="the standby replays")
                with pytest.raises(StorageError):  # a store to write needs the primary
                    await ControlStore(testing.with_schema(standby, "fleet")).open()


async def _counted(store: ControlStore, state: str, count: int) -> bool:
    return (await store.counts())[state] == count


async def test_another_hosts_commit_is_heard_through_notify(url: str) -> None:
    async with ControlStore(url) as here, ControlStore(url) as there:
        await here.create_project("p", "P")
        before = await here._engine.data_version()
        await there.enqueue("p", {})
        for _ in range(1000):  # the notification arrives on the listener's connection
            if await here._engine.data_version() != before:
                break
            await asyncio.sleep(0.005)
        assert await here._engine.data_version() != before


async def test_a_deadlock_between_hosts_is_retried_not_reported(url: str) -> None:
    # Two rounds that lock the same two items in opposite orders: PostgreSQL breaks the
    # deadlock by failing one; its writer runs the round again and both succeed.
    async with ControlStore(url, lease_seconds=600) as a, ControlStore(url) as b:
        await a.create_project("p", "P")
        x, y = await a.enqueue_many("p", [{"n": 1}, {"n": 2}])
        cx, cy = await a.claim("w"), await a.claim("w")
        assert cx is not None and cy is not None
        backends: list[Any] = [await s._engine.ready() for s in (a, b)]
        writers = [backend.writer for backend in backends]
        locked = [asyncio.Event(), asyncio.Event()]
        touch = "UPDATE items SET updated_at = $1 WHERE item_id = $2"

        def crossing(me: int, first: int, second: int) -> Any:
            async def op(conn: Any, now: float) -> None:
                await conn.execute(touch, now, first)
                locked[me].set()
                await locked[1 - me].wait()  # each holds one row and reaches for the other
                await conn.execute(touch, now, second)

            return op

        await asyncio.gather(
            writers[0].submit(crossing(0, x, y)), writers[1].submit(crossing(1, y, x))
        )
        assert sum(w.retried_rounds for w in writers) >= 1
        assert await verify_ledger(a) == []


def test_the_cluster_helper_reports_why_it_could_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(testing, "_postgres_bindir", lambda: pathlib.Path("/nonexistent"))
    cluster = testing.PostgresCluster()
    with pytest.raises(RuntimeError, match="initdb"):
        cluster.start()
    with pytest.raises(RuntimeError, match="not running"):
        _ = cluster.socket_dir  # it cleaned up after itself


def test_a_cluster_left_by_a_killed_process_is_reaped_by_the_next_start() -> None:
    # A test run killed outright (by the OOM killer, say) leaves its server running and
    # its directory behind; the next cluster started on the machine stops and removes it.
    made = (
        "import sys; from asyncplane import testing; c = testing.PostgresCluster(); "
        "c.start(); print(c.socket_dir, flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", made], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as maker:
        try:
            assert maker.stdout is not None
            root = pathlib.Path(maker.stdout.readline().strip())
            postmaster = int((root / "data" / "postmaster.pid").read_text().split()[0])
        finally:
            maker.kill()  # as the OOM killer would: no clean-up of any kind
    assert root.is_dir() and _running(postmaster)  # orphaned, and still serving
    with testing.PostgresCluster() as cluster:
        assert cluster.socket_dir != root
        assert not root.exists()
        assert not _running(postmaster)
        # Started again while it runs: the same server, not a second one stop would leave.
        own = cluster.socket_dir
        assert cluster.start() == cluster.url() and cluster.socket_dir == own
        alive = int((own / "data" / "postmaster.pid").read_text().split()[0])
    assert not own.exists() and not _running(alive)


def test_the_cluster_helper_passes_settings_and_paths_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pg_ctl gives its -o to a shell: a space in the temporary directory's path, or in a
    # setting, split it ("invalid argument"); a $(...) in a setting ran.
    spaced = pathlib.Path(tempfile.mkdtemp(prefix="ap sp ", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(spaced, user="postgres")
    monkeypatch.setattr(tempfile, "tempdir", str(spaced))
    try:
        given = "a b [%p] $(id);x"
        with testing.PostgresCluster(settings={"application_name": given}) as cluster:
            assert " " in str(cluster.socket_dir)

            async def shown() -> str:
                conn = await asyncpg.connect(cluster.url())
                try:
                    return str(await conn.fetchval("SHOW application_name"))
                finally:
                    await conn.close()

            assert asyncio.run(shown()) == given
    finally:
        shutil.rmtree(spaced, ignore_errors=True)


def test_the_reaper_leaves_what_it_cannot_stop_or_judge(tmp_path: pathlib.Path) -> None:
    # A cluster whose server the stop could not reach (another user's, another pid
    # namespace's) lost its directory and ran on headless; one made in another pid
    # namespace (a container sharing /tmp) was reaped while its maker used it.
    root = pathlib.Path(tempfile.gettempdir())
    unstoppable = pathlib.Path(tempfile.mkdtemp(prefix=testing._PREFIX, dir=root))
    elsewhere = pathlib.Path(tempfile.mkdtemp(prefix=testing._PREFIX, dir=root))
    try:
        (unstoppable / testing._OWNER).write_text("999999999 1")  # a maker that is gone
        (unstoppable / "data").mkdir()
        (unstoppable / "data" / "postmaster.pid").write_text("12345\n")  # no stop reaches it
        (elsewhere / testing._OWNER).write_text("999999999 1")
        (elsewhere / testing._NAMESPACE).write_text("pid:[1]")
        testing._reap_orphans()
        assert (unstoppable / "data" / "postmaster.pid").exists()
        assert (elsewhere / testing._OWNER).exists()
    finally:
        shutil.rmtree(unstoppable, ignore_errors=True)
        shutil.rmtree(elsewhere, ignore_errors=True)
    versions = ["/usr/lib/postgresql/9.6/bin/initdb", "/usr/lib/postgresql/15/bin/initdb"]
    assert sorted(versions, key=testing._version)[-1] == versions[1]  # 15, not 9.6


def test_a_cluster_another_namespace_left_is_reaped_once_no_server_answers() -> None:
    # A removed container's cluster (another pid namespace, its server gone with it) was
    # never reaped: about 40 MB of the shared temporary directory each time.
    root = pathlib.Path(tempfile.gettempdir())
    long_ago = time.time() - 2 * testing._GRACE_ELSEWHERE

    def made_elsewhere(*, at: float) -> pathlib.Path:
        made = pathlib.Path(tempfile.mkdtemp(prefix=testing._PREFIX, dir=root))
        (made / testing._OWNER).write_text("999999999 1")
        (made / testing._NAMESPACE).write_text("pid:[1]")
        os.utime(made / testing._NAMESPACE, (at, at))
        return made

    gone = made_elsewhere(at=long_ago)  # no socket: its server never ran, or ran elsewhere
    stale = made_elsewhere(at=long_ago)
    with socket.socket(socket.AF_UNIX) as listener:  # a socket file whose server is gone
        listener.bind(str(stale / ".s.PGSQL.5432"))
    young = made_elsewhere(at=time.time())  # its maker may still be in initdb
    with testing.PostgresCluster() as live:
        # A server that answers, though its cluster says it was made elsewhere long ago.
        namespace = live.socket_dir / testing._NAMESPACE
        own = namespace.read_text()
        namespace.write_text("pid:[1]")
        os.utime(namespace, (long_ago, long_ago))
        try:
            testing._reap_orphans()
            assert not gone.exists() and not stale.exists()
            assert (young / testing._OWNER).exists()
            assert (live.socket_dir / "data" / "postmaster.pid").exists()
        finally:
            namespace.write_text(own)
            shutil.rmtree(young, ignore_errors=True)
            shutil.rmtree(gone, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)
        assert asyncio.run(_answers(live.url()))
        # Its server down a moment (a test's crash and restart), its maker still there
        # holding the cluster: kept (it was removed, and the restart failed).
        namespace.write_text("pid:[1]")
        os.utime(namespace, (long_ago, long_ago))
        data = live.socket_dir / "data"
        pg_ctl = [*testing._run_as(), str(testing._postgres_bindir() / "pg_ctl"), "-D", str(data)]
        subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], check=True, capture_output=True)
        try:
            testing._reap_orphans()
            assert (live.socket_dir / testing._OWNER).exists()
        finally:
            namespace.write_text(own)
            subprocess.run(  # as it ran (restart takes the options it was started with)
                [*pg_ctl, "-l", str(live.socket_dir / "server.log"), "-w", "restart"],
                check=True, capture_output=True,
            )  # fmt: skip
        assert asyncio.run(_answers(live.url()))


async def _answers(url: str) -> bool:
    conn = await asyncpg.connect(url)
    try:
        return bool(await conn.fetchval("SELECT true"))
    finally:
        await conn.close()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody has reaped yet does not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# --- found in review: races only a server database has --------------------------------------


async def test_a_row_shifted_between_pages_is_claimed_once(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The claim reads a second page of one project (its first page held that project's
    # share of the batch, and the batch needs more of it); meanwhile another host commits
    # a higher-priority item there, which shifts every row by one: the second page offers
    # a row the first already gave. It must be claimed once, not twice.
    from asyncplane import _postgres

    async with ControlStore(url) as store, ControlStore(url) as other:
        await store.create_project("p", "P")
        await store.create_project("q", "Q")
        for n in ("C", "D"):
            await store.enqueue("p", {"n": n}, priority=5)
        await store.enqueue("p", {"n": "F"}, priority=1)
        await store.enqueue("q", {"n": "E"}, priority=1)
        next_page = _postgres._next_page
        pages = 0

        async def shifting_page(*args: Any) -> Any:
            nonlocal pages
            pages += 1
            if pages == 1:  # after the first page (read with the other arms'), before the second
                await other.enqueue("p", {"n": "Z"}, priority=9)
            return await next_page(*args)

        monkeypatch.setattr(_postgres, "_next_page", shifting_page)
        got = await store.claim_batch("w", 3)
        assert pages >= 1
        assert [claim.payload["n"] for claim in got] == ["C", "D", "F"]
        ids = [claim.item_id for claim in got]
        assert len(ids) == len(set(ids))
        assert all(claim.fence == 1 for claim in got)
        assert await verify_ledger(store) == []


async def test_overlapping_enqueues_from_many_hosts_never_deadlock(url: str) -> None:
    # Each host enqueues the same contents, in its own order, many at once: the rounds'
    # content locks are taken sorted, so no two rounds wait on each other in a circle.
    hosts = [ControlStore(url) for _ in range(3)]
    try:
        await hosts[0].create_project("p", "P")
        contents = [f"c{n}" for n in range(12)]

        async def burst(store: ControlStore, order: list[str]) -> list[int]:
            return list(
                await asyncio.gather(*(store.enqueue("p", {"c": c}, fingerprint=c) for c in order))
            )

        orders = [contents, contents[::-1], contents[5:] + contents[:5]]
        results = await asyncio.gather(
            *(burst(store, order) for store, order in zip(hosts, orders, strict=True))
        )
        by_content = [
            dict(zip(order, ids, strict=True)) for order, ids in zip(orders, results, strict=True)
        ]
        assert by_content[0] == by_content[1] == by_content[2]  # one item per content
        backends: list[Any] = [await store._engine.ready() for store in hosts]
        assert sum(backend.writer.retried_rounds for backend in backends) == 0
        assert (await hosts[0].counts())["ready"] == len(contents)
    finally:
        for store in hosts:
            await store.close()


async def test_the_store_clock_follows_the_server_not_this_host(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This host's clock is five seconds slow. The drain loop's alarms, a purge's cutoff
    # and the ages in stats all read store.clock, which must agree with the server's.
    import time as real_time
    import types

    from asyncplane import _postgres

    slow = types.SimpleNamespace(time=lambda: real_time.time() - 5, monotonic=real_time.monotonic)
    monkeypatch.setattr(_postgres, "time", slow)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        (server_now,) = (await sql(url, SERVER_NOW))[0]
        assert abs(store.clock.now() - server_now) < 1.0
        due = await store.enqueue("p", {}, not_before=server_now + 0.3)
        assert (await store.item(due))["state"] == "deferred"
        started = real_time.monotonic()
        stop = asyncio.Event()

        async def done_then_stop(batch: list[Any]) -> list[Any]:
            stop.set()
            return await _all_done(batch)

        summary = await asyncio.wait_for(
            __import__("asyncplane").drain(store, done_then_stop, mode="daemon", stop=stop),
            timeout=10,
        )
        assert summary.done == 1
        assert real_time.monotonic() - started < 3  # woke when due, not five seconds late


async def _all_done(batch: list[Any]) -> list[Any]:
    from asyncplane import Done

    return [Done() for _ in batch]


async def test_reopening_a_project_elsewhere_wakes_a_listener(url: str) -> None:
    async with ControlStore(url) as here, ControlStore(url) as there:
        await here.create_project("p", "P", status="paused")
        await here.enqueue("p", {})
        before = await here._engine.data_version()
        await there.set_project_status("p", "open")
        for _ in range(1000):
            if await here._engine.data_version() != before:
                break
            await asyncio.sleep(0.005)
        assert await here._engine.data_version() != before


@contextlib.asynccontextmanager
async def a_database_of_its_own(
    server_url: str, name: str, options: str = ""
) -> AsyncIterator[str]:
    """A database made for one test (an outage of it touches no other), dropped after."""
    await sql(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    await sql(server_url, f"CREATE DATABASE {name} {options}")
    try:
        yield urllib.parse.urlunsplit(urllib.parse.urlsplit(server_url)._replace(path=f"/{name}"))
    finally:
        await sql(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def outage(server_url: str, name: str, *, down: bool) -> None:
    """The database refuses new sessions (and its open ones end), or takes them again."""
    await sql(server_url, f"ALTER DATABASE {name} ALLOW_CONNECTIONS {'false' if down else 'true'}")
    if down:
        await sql(server_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = $1 AND pid <> pg_backend_pid()", name)  # fmt: skip


async def test_a_wait_through_an_outage_fails_as_storage_then_goes_on_once_back(
    asyncplane_postgres_url: str,
) -> None:
    server, name = asyncplane_postgres_url, "asyncplane_outage"
    async with a_database_of_its_own(server, name) as where, ControlStore(where) as store:
        await store.create_project("p", "P")
        first, second = await store.enqueue_many("p", [{"n": 1}, {"n": 2}])
        waiter = asyncio.ensure_future(store.wait(first, poll_interval=0.01))
        await until(lambda: any(t.get_name() == "asyncplane-settles-local"
                                for t in asyncio.all_tasks()), what="the waiter waits")  # fmt: skip
        await outage(server, name, down=True)
        try:
            with pytest.raises(StorageError):  # (cannot connect, or not accepting sessions)
                await store.counts()  # the store meets the outage first, and is left shut
            with pytest.raises(StorageError) as raised:
                await waiter
            assert type(raised.value) is StorageError, raised.value  # not StoreClosed
        finally:
            await outage(server, name, down=False)
        # Once the server takes sessions again, a wait goes on (here one begun before).
        waiter = asyncio.ensure_future(store.wait(second, poll_interval=3600))
        await until(lambda: any(t.get_name() == "asyncplane-settles-local"
                                for t in asyncio.all_tasks()), what="the waiter waits")  # fmt: skip
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == first
        await store.finish(first, fence=claim.fence)
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == second
        async with ControlStore(where) as elsewhere:  # another host settles it
            await elsewhere.finish(second, fence=claim.fence, result={"ok": 1})
        assert (await asyncio.wait_for(waiter, 60))["result"] == {"ok": 1}


async def test_an_idle_session_ended_by_the_server_is_no_error(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A restart, or idle_session_timeout, ends the idle write session: no round broke, so
    # nothing says one did (at ERROR, with a traceback); the next call opens afresh.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        writer = backend.writer
        await sql(url, "SELECT pg_terminate_backend($1)", writer._conn.get_server_pid())
        await until(lambda: not writer.running and writer._task.done(), what="the writer ends")
        assert await store.enqueue("p", {}) == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "lost its connection; opening again" in caplog.text


async def test_a_database_whose_encoding_cannot_hold_every_text_is_refused_at_open(
    asyncplane_postgres_url: str,
) -> None:
    # In LATIN1, a settle whose text LATIN1 cannot hold failed on every retry: a drain
    # halted on it. Such a database is refused before anything is written.
    server, name = asyncplane_postgres_url, "asyncplane_latin1"
    latin1 = "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    async with a_database_of_its_own(server, name, latin1) as where:
        for read_only in (False, True):
            with pytest.raises(NotAnAsyncplaneDatabase, match=r"encoding is LATIN1.*UTF8"):
                await ControlStore(where, read_only=read_only).open()
        assert await sql(where, TABLES_HERE) == []
    # SQL_ASCII keeps the driver's UTF-8 bytes as they come: every text comes back whole.
    name = "asyncplane_sql_ascii"
    sql_ascii = "ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    async with (
        a_database_of_its_own(server, name, sql_ascii) as where,
        ControlStore(where) as store,
    ):
        await store.create_project("p", "東京")
        item = await store.enqueue("p", {"city": "東京"})
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(item, fence=claim.fence, status="failed", error="ошибка")
        assert (await store.item(item))["error"] == "ошибка"
        assert (await store.projects())[0]["name"] == "東京"


async def test_the_stores_sessions_outlive_an_idle_session_timeout(
    asyncplane_postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A server, role or database may end idle sessions; the drain guard's and the
    # listener's idle by design, and the writer's between rounds.
    server, name = asyncplane_postgres_url, "asyncplane_idle_out"
    async with a_database_of_its_own(server, name) as where:
        await sql(server, f"ALTER DATABASE {name} SET idle_session_timeout = '100ms'")
        async with ControlStore(where) as store:
            await store.create_project("p", "P")
            backend: Any = await store._engine.ready()
            writer = backend.writer
            async with backend.drain_guard() as guard:
                assert guard
                # A session of nobody's, begun after ours went idle: once the server has
                # ended it, ours have idled for longer than the timeout.
                idle = await asyncpg.connect(where)
                await until(idle.is_closed, what="the server ends an idle session")
                assert guard.lost is None
            assert not backend._deaf
            # And the read pool's, after a release (whose RESET ALL undoes a SET).
            for _ in range(2):
                async with backend._pool.acquire() as pooled:
                    assert await pooled.fetchval("SHOW idle_session_timeout") == "0"
            assert writer.running and await store.enqueue("p", {}) == 1
            assert backend.writer is writer  # never opened afresh
    assert "lost its connection" not in caplog.text


@pytest.mark.parametrize("units", [1, 2])  # 2: each under a savepoint of its own
async def test_a_connection_lost_under_a_round_is_told_as_lost_not_as_a_writer_fault(
    url: str, caplog: pytest.LogCaptureFixture, units: int
) -> None:
    # A server restart, or a terminated backend, under a round: its callers have a
    # StorageError caused by what ended the session (not by the rollback that could no
    # longer be made), and the writer's stop is a WARNING, not an ERROR traceback.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        writer = backend.writer
        running = asyncio.Event()

        async def quick(conn: Any, now: float) -> None:
            await conn.execute("SELECT 1")

        async def lost(conn: Any, now: float) -> None:
            running.set()
            await conn.execute("SELECT pg_sleep(600)")

        held, holds = asyncio.Event(), asyncio.Event()

        async def hold(conn: Any, now: float) -> None:
            holds.set()
            await held.wait()  # the requests below queue up meanwhile: one round

        holding = asyncio.ensure_future(writer.submit(hold))
        await holds.wait()
        ops = [quick, lost][-units:]
        answers = [asyncio.ensure_future(writer.submit(op)) for op in ops]
        await until(lambda: writer.requests_waiting == units, what="queued")
        held.set()
        await holding
        await running.wait()
        await sql(url, "SELECT pg_terminate_backend($1)", writer._conn.get_server_pid())
        for answer in answers:
            with pytest.raises(StorageError) as caught:
                await answer
            cause = caught.value.__cause__
            assert type(cause) is asyncpg.exceptions.ConnectionDoesNotExistError, cause
        assert await store.enqueue("p", {}) == 1  # the store opens afresh
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert "stopped: its connection was lost (ConnectionDoesNotExistError" in caplog.text


async def test_a_lost_connection_is_replaced_on_next_use(url: str) -> None:
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        pid = backend.writer._conn.get_server_pid()
        await sql(url, "SELECT pg_terminate_backend($1)", pid)  # a server restart, as it were
        # This one's fate is reported: a StorageError if it met the dead connection, or it
        # is saved, when the writer noticed its session end first and the store reopened
        # (see tests/test_reliability.py for that on its own) ...
        with contextlib.suppress(StorageError):
            await store.enqueue("p", {"lost": True})
        for _ in range(1000):
            if backend.broken:
                break
            await asyncio.sleep(0.005)
        item = await store.enqueue("p", {"after": True})  # ... and the store goes on
        assert (await store.item(item))["payload"] == {"after": True}
        assert await verify_ledger(store) == []


async def test_a_deadlocked_rounds_requests_are_answered_as_each_commits(url: str) -> None:
    # A round that deadlocks runs each request again in a transaction of its own. Those
    # already committed when the connection is lost under a later one have their answers:
    # told "not saved", a caller would write them again.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        writer = backend.writer
        release, running, calls, rounds = asyncio.Event(), asyncio.Event(), [0], [0]

        async def hold(conn: Any, now: float) -> None:
            rounds[0] = writer.rounds  # this round's number
            await release.wait()  # the three below queue up meanwhile: one round

        async def deadlocks_once(conn: Any, now: float) -> str:
            calls[0] += 1
            if calls[0] == 1:
                raise asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
            await conn.execute("INSERT INTO projects (project_id, name, status, created_at) "
                               "VALUES ('q', 'Q', 'open', $1)", now)  # fmt: skip
            return "saved"

        async def saved(conn: Any, now: float) -> str:
            return "also saved"

        async def lost(conn: Any, now: float) -> None:
            running.set()
            await conn.execute("SELECT pg_sleep(600)")

        held = asyncio.ensure_future(writer.submit(hold))
        await until(lambda: rounds[0] > 0, what="the held round")
        answers = [asyncio.ensure_future(writer.submit(op)) for op in (deadlocks_once, saved, lost)]
        await until(lambda: writer.requests_waiting == 3, what="three queued")
        release.set()
        await held
        await running.wait()
        await sql(url, "SELECT pg_terminate_backend($1)", writer._conn.get_server_pid())
        done = await asyncio.gather(*answers, return_exceptions=True)
        assert writer.rounds == rounds[0] + 1 and writer.retried_rounds == 1  # one round
        assert done[:2] == ["saved", "also saved"]
        assert type(done[2]) is StorageError, done[2]  # never run to its COMMIT: not saved
        assert (await store.project("q"))["status"] == "open"  # the first one's write stands


async def test_a_cancelled_writer_lets_its_round_finish(url: str) -> None:
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        item = await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None
        blocker = await asyncpg.connect(url)
        try:
            await blocker.execute("BEGIN")
            await blocker.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", item)
            backend: Any = await store._engine.ready()
            writer = backend.writer
            finish = asyncio.ensure_future(store.finish(item, fence=claim.fence, result="r"))
            for _ in range(1000):  # the round is on the server, waiting for the row
                if writer._round_task is not None:
                    break
                await asyncio.sleep(0.001)
            writer._task.cancel()  # as an event loop shutting down would
            await asyncio.sleep(0.05)
            await blocker.execute("ROLLBACK")
            assert await finish is None  # the round ran to its end and its caller heard
        finally:
            await blocker.close()
    async with ControlStore(url) as store:
        assert (await store.item(item))["state"] == "done"
        assert await verify_ledger(store) == []


async def test_a_daemon_wakes_on_another_hosts_enqueue_without_polling(url: str) -> None:
    # The poll interval is an hour: only the notification can wake the drainer in time.
    from asyncplane import ClaimedItem, Done, drain

    async with ControlStore(url) as here, ControlStore(url) as there:
        await here.create_project("p", "P")
        got: asyncio.Queue[int] = asyncio.Queue()
        stop = asyncio.Event()

        async def record(batch: list[ClaimedItem]) -> list[Any]:
            for claim in batch:
                got.put_nowait(claim.item_id)
            return [Done() for _ in batch]

        task = asyncio.create_task(
            drain(here, record, mode="daemon", stop=stop, poll_interval=3600)
        )
        # Until it has found nothing and gone to sleep on its watchers.
        await until(waiting_on("commit"), what="the daemon went idle")
        item = await there.enqueue("p", {"from": "another host"})
        assert await asyncio.wait_for(got.get(), timeout=10) == item
        stop.set()
        await task


async def test_a_drainer_skipping_rows_another_claim_left_alone_is_woken(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Worker A's claim locks candidates from two arms (ready r, due d) and takes only d.
    # A drainer that claimed meanwhile skipped the locked r and went to sleep; r never
    # changes state, so A's claim itself must wake it.
    from asyncplane import ClaimedItem, Done, _postgres, drain
    from asyncplane.testing import ManualClock

    clock = ManualClock()
    async with ControlStore(url, clock=clock) as here, ControlStore(url, clock=clock) as there:
        await there.create_project("p", "P")
        await there.create_project("q", "Q")
        r = await there.enqueue("p", {"r": 1}, priority=0)
        d = await there.enqueue("q", {"d": 1}, priority=10, not_before=clock.now() + 10)
        clock.advance(11)  # d falls due
        gate, paused = asyncio.Event(), asyncio.Event()
        real = _postgres._insert_events
        backend: Any = await there._engine.ready()
        a_conn = backend.writer._conn

        async def held(conn: Any, events: Any) -> None:
            if conn is a_conn and not gate.is_set():  # after A read (and locked) candidates
                paused.set()
                await gate.wait()
            await real(conn, events)

        monkeypatch.setattr(_postgres, "_insert_events", held)
        a_claim = asyncio.create_task(there.claim("worker-a"))
        await paused.wait()
        got: asyncio.Queue[int] = asyncio.Queue()

        async def record(batch: list[ClaimedItem]) -> list[Any]:
            for claim in batch:
                got.put_nowait(claim.item_id)
            return [Done() for _ in batch]

        stop = asyncio.Event()
        task = asyncio.create_task(
            drain(here, record, mode="daemon", stop=stop, project_id="p", poll_interval=3600)
        )
        await until(waiting_on("commit"), what="the drainer skipped r and went to sleep")
        gate.set()
        claimed = await a_claim
        assert claimed is not None and claimed.item_id == d
        # Well inside the five-second safety poll: the notification did it.
        assert await asyncio.wait_for(got.get(), timeout=3) == r
        stop.set()
        await task


async def test_stores_in_other_schemas_never_wait_on_each_others_locks(
    url: str, location_of: Any
) -> None:
    # Advisory locks belong to the whole database; a store's keys name its schema.
    from asyncplane import _postgres_sql

    other = location_of("other")
    async with ControlStore(url) as a, ControlStore(other) as b:
        await a.create_project("p", "P")
        await b.create_project("p", "P")
        holder = await asyncpg.connect(url)  # store a's schema, mid-enqueue of content "f"
        try:
            async with holder.transaction():
                await holder.execute(_postgres_sql.LOCK_CONTENTS, ["p"], ["f"], False)
                item = await asyncio.wait_for(b.enqueue("p", {}, fingerprint="f"), timeout=5)
                claim = await asyncio.wait_for(b.claim("w"), timeout=5)
                assert claim is not None and claim.item_id == item
        finally:
            await holder.close()


async def test_a_rounds_enqueues_take_their_content_locks_together_in_order(url: str) -> None:
    # The writer takes every content lock its round's enqueues need at its start, sorted
    # (`_postgres_writer.Locking`, also through the `Named` an enqueue is sent as), so two
    # rounds never take them in opposite orders. Seen from outside: an enqueue of the
    # content that comes last in that order, held elsewhere, queued ahead of one of the
    # other, waits holding the other's lock already (and both shards', shared).
    # (Both are queued in one turn of the loop, before the idle writer takes a round, so
    # they share it.)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        pid = backend.writer._conn.get_server_pid()
        holder = await asyncpg.connect(url)
        watcher = await asyncpg.connect(url)
        locks = "SELECT granted FROM pg_locks WHERE locktype = 'advisory' AND pid = $1"
        key = "SELECT " + pg_sql._CONTENT_KEY.format(p="'p'", f="$1::text")
        shard = "SELECT " + pg_sql._SHARD_KEY.format(p="'p'", f="$1::text")
        try:
            early, late = "x", "y"
            if await holder.fetchval(key, "x") > await holder.fetchval(key, "y"):
                early, late = "y", "x"
            shards = len({await holder.fetchval(shard, f) for f in ("x", "y")})
            async with holder.transaction():
                await holder.execute(pg_sql.LOCK_CONTENTS, ["p"], [late], False)
                both = asyncio.gather(
                    store.enqueue("p", {"n": 1}, fingerprint=late),
                    store.enqueue("p", {"n": 2}, fingerprint=early),
                )

                async def waiting() -> bool:
                    return any(not granted for (granted,) in await watcher.fetch(locks, pid))

                await until(waiting, what="the round waits for the late content's lock")
                held = [granted for (granted,) in await watcher.fetch(locks, pid)]
                assert sorted(held) == [False] + [True] * (shards + 1)  # the early one's too
            first, second = await asyncio.wait_for(both, timeout=30)
            assert first != second
        finally:
            await holder.close()
            await watcher.close()


def _server_socket(directory: str) -> pathlib.Path:
    """The server's unix socket in ``directory`` (beside it stands its lock file)."""
    (socket,) = (p for p in pathlib.Path(directory).glob(".s.PGSQL.*") if p.suffix != ".lock")
    return socket


@contextlib.asynccontextmanager
async def cut_on_commit(
    url: str, marker: bytes = b"COMMIT", *, deliver: bool = False, then: bytes | None = None
) -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """A proxy between a store and the server, as a network would be: ``(its url, arm,
    cut)``. Once ``arm`` is set, the next COMMIT (or ``marker``) a client sends is never
    delivered: the proxy drops both sides of that connection, so no answer ever comes, and
    sets ``cut``. ``deliver``: the message is delivered, and the connection dropped once
    the server says it is idle again (a ReadyForQuery outside a transaction: what it
    carried is committed), that answer never passed on: saved, with no answer; ``arm``
    is then cleared, so that the next tries go through. ``then``: after that cut, the
    first message carrying ``then`` is dropped too, with its connection (once)."""
    idle = b"Z\x00\x00\x00\x05I"  # ReadyForQuery, status idle
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    socket = _server_socket(query["host"][0])
    # A socket's path has room for about a hundred bytes: a short directory of its own.
    here = pathlib.Path(tempfile.mkdtemp(prefix="ap-proxy-"))
    arm, cut = asyncio.Event(), asyncio.Event()
    second = [then]  # the marker still to cut on, after the first cut

    async def pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool, sent: asyncio.Event
    ) -> None:
        while data := await reader.read(65536):
            if up and cut.is_set() and second[0] is not None and second[0] in data:
                second[0] = None
                return
            if up and arm.is_set() and marker in data:
                if not deliver:
                    cut.set()
                    return
                sent.set()
            if not up and sent.is_set() and idle in data:
                arm.clear()  # once: the tries after it go through
                cut.set()
                return
            writer.write(data)
            await writer.drain()

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_unix_connection(str(socket))
        sent = asyncio.Event()  # (deliver) the marker went to the server on this connection
        try:
            ends = [
                asyncio.create_task(pipe(client_r, server_w, True, sent), name="proxy-up"),
                asyncio.create_task(pipe(server_r, client_w, False, sent), name="proxy-down"),
            ]
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            for end in ends:
                end.cancel()
            await asyncio.gather(*ends, return_exceptions=True)
        finally:
            for writer in (client_w, server_w):
                writer.transport.abort()

    proxy = await asyncio.start_unix_server(serve, path=str(here / socket.name))
    query["host"] = [str(here)]
    try:
        yield parts._replace(query=urllib.parse.urlencode(query, doseq=True)).geturl(), arm, cut
    finally:
        proxy.close()
        await proxy.wait_closed()
        shutil.rmtree(here, ignore_errors=True)


async def test_a_connection_lost_during_commit_says_the_outcome_is_unknown(url: str) -> None:
    # SQLite says CommitOutcomeUnknown when a failed COMMIT cannot be sealed; here, when
    # the connection goes with COMMIT on its way: the server may have applied it.
    async with cut_on_commit(url) as (through, arm, cut), ControlStore(through) as store:
        await store.create_project("p", "P")
        arm.set()
        with pytest.raises(CommitOutcomeUnknown, match="lost during COMMIT") as caught:
            await store.enqueue("p", {"fate": "unknown"})
        assert cut.is_set()
        assert isinstance(caught.value.__cause__, asyncpg.PostgresConnectionError)
        arm.clear()
        # The writer is failed, not stuck: the next call opens afresh and is saved.
        item = await store.enqueue("p", {"after": True})
        assert (await store.item(item))["payload"] == {"after": True}
        assert await verify_ledger(store) == []


async def test_a_schema_of_the_previous_release_migrates_to_cancel_and_requeue(
    url: str,
) -> None:
    # A schema as the release before operating single items left it (version 1), with a
    # ready item and a failed one, written as that release wrote them.
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await conn.execute(pg_sql.MIGRATIONS[0])
            await conn.execute(pg_sql.WRITE_META, "application", pg_sql.APPLICATION)
            await conn.execute(pg_sql.WRITE_META, "schema_version", "1")
            await conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
            await conn.execute(
                "INSERT INTO items (project_id, state, payload, fence, attempts, owner, error, "
                "created_at, updated_at) VALUES ('p', 'ready', '{}', 0, 0, NULL, NULL, 0, 0), "
                "('p', 'failed', '{}', 1, 1, 'w', 'boom', 0, 1)"
            )
            await conn.execute(
                "INSERT INTO events (item_id, event_type, fence, owner, at) VALUES "
                "(1, 'queued', 0, NULL, 0), (2, 'queued', 0, NULL, 0), "
                "(2, 'claimed', 1, 'w', 1), (2, 'failed', 1, 'w', 1)"
            )
    finally:
        await conn.close()
    async with ControlStore(url) as store:
        assert await verify_ledger(store) == []
        assert [row["item_id"] for row in await store.items(state="failed")] == [2]
        assert await store.cancel(1, reason="old") == "cancelled"
        await store.requeue(2)
        claim = await store.claim("w")
        assert claim is not None and (claim.item_id, claim.fence) == (2, 2)
        assert await verify_ledger(store) == []
        assert (await store.stats())["schema_version"] == pg_sql.SCHEMA_VERSION


async def test_a_schema_of_the_previous_version_keeps_its_import_records(
    url: str, tmp_path: pathlib.Path
) -> None:
    # Migration 14 adds the digest to a version-13 schema's records, empty: their keys
    # are passed over as before.
    source = tmp_path / "q.sqlite3"
    with contextlib.closing(sqlite3.connect(source)) as raw:
        raw.execute("CREATE TABLE q (k TEXT PRIMARY KEY, body TEXT)")
        raw.execute("INSERT INTO q VALUES ('a', '{\"v\": 1}')")
        raw.commit()
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            for script in pg_sql.MIGRATIONS[:13]:
                await conn.execute(script)
            await conn.execute(pg_sql.WRITE_META, "application", pg_sql.APPLICATION)
            await conn.execute(pg_sql.WRITE_META, "schema_version", "13")
            await conn.execute("INSERT INTO projects VALUES ('p', 'P', 'open', 0)")
            await conn.execute("INSERT INTO imports VALUES ($1, 'a', 1, 0)", f"{source}::q")
    finally:
        await conn.close()
    async with ControlStore(url) as store:
        done = await store.import_pending(
            source, table="q", columns={"payload": "body", "key": "k"}, project_id="p"
        )
        assert (done.imported, done.already_imported) == (0, 1)
        assert (await store.stats())["schema_version"] == pg_sql.SCHEMA_VERSION
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT source_key, digest FROM imports")
        assert [tuple(row) for row in rows] == [("a", None)]
    finally:
        await conn.close()


async def _two_limited_reaches_known(store: ControlStore) -> None:
    """Projects a and b, limited, with work; this process has claimed in project b and
    in the whole store, so it knows both reaches are limited."""
    for project in ("a", "b"):
        await store.create_project(project, project.upper())
        await store.set_limits(project, max_running=100)
        await store.enqueue_many(project, [{"n": n} for n in range(3)])
    for reach in ("b", None):
        claim = await store.claim("w", project_id=reach)
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)


def _limit_lock(project: str) -> str:
    """The SQL key of a project's limit lock (asyncplane_take_limits')."""
    return f"hashtextextended('asyncplane-limit:' || current_schema() || chr(1) || '{project}', 0)"


async def test_a_round_claiming_for_several_reaches_takes_their_limit_locks_in_one_order(
    url: str,
) -> None:
    # Each reach's claim took its own limits in turn: a round claiming for b, then for
    # every project, held b while it waited for a, and another host's round, holding a,
    # waited for b. PostgreSQL broke the deadlock after a second, again and again: a
    # fleet's claims ran 70 times slower. Now the round takes a's lock before b's.
    async with ControlStore(url) as store:
        await _two_limited_reaches_known(store)
        other_host = await asyncpg.connect(url)
        looking = await asyncpg.connect(url)
        try:
            held = other_host.transaction()
            await held.start()
            await other_host.execute(f"SELECT pg_advisory_xact_lock({_limit_lock('a')})")
            round_of_two = asyncio.gather(
                store.claim("w", project_id="b"), store.claim("w")
            )  # one round: requests queued in one turn
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            await until(lambda: _any_row(looking, waiting), what="the round waits for a's lock")
            free = await looking.fetchval(f"SELECT pg_try_advisory_lock({_limit_lock('b')})")
            if free:
                await looking.execute(f"SELECT pg_advisory_unlock({_limit_lock('b')})")
            await held.rollback()
            claims = await round_of_two
        finally:
            await other_host.close()
            await looking.close()
        assert free, "the round held b's limit lock while it waited for a's"
        assert [c.project_id for c in claims if c is not None] == ["b", "a"]
        assert await verify_ledger(store) == []


async def test_a_round_takes_its_reaches_limit_locks_after_the_finish_ahead_of_its_claims(
    url: str,
) -> None:
    # Taken at the round's start, the limit locks came before the locks of the finish
    # that runs ahead of the claims (a twin's hand-off lock, its row): a round of one
    # reach takes them the other way round, and another host's such round, holding the
    # hand-off lock and waiting for a's limit lock, deadlocked with this one.
    async with ControlStore(url) as store:
        await _two_limited_reaches_known(store)
        await store.create_project("c", "C")
        twin = await store.enqueue("c", {"twin": 1}, fingerprint="x")
        running = await store.claim("w", project_id="c")
        assert running is not None and running.item_id == twin
        other_host = await asyncpg.connect(url)
        looking = await asyncpg.connect(url)
        try:
            held = other_host.transaction()
            await held.start()
            hand_off = "hashtextextended(current_schema() || chr(1) || 'c' || chr(1) || 'x', 2)"
            await other_host.execute(f"SELECT pg_advisory_xact_lock({hand_off})")
            round_of_three = asyncio.gather(
                store.finish(twin, fence=running.fence),
                store.claim("w", project_id="b"),
                store.claim("w"),
            )  # one round: the finish ahead, then the claims of two reaches
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            await until(lambda: _any_row(looking, waiting), what="the finish waits")
            free = await looking.fetchval(f"SELECT pg_try_advisory_lock({_limit_lock('a')})")
            if free:
                await looking.execute(f"SELECT pg_advisory_unlock({_limit_lock('a')})")
            await held.rollback()
            _, for_b, for_any = await round_of_three
        finally:
            await other_host.close()
            await looking.close()
        assert free, "the round held a's limit lock while its finish waited"
        assert for_b is not None and for_any is not None
        assert await verify_ledger(store) == []


async def _any_row(conn: asyncpg.Connection, statement: str) -> bool:
    """Whether ``statement``'s one value is true (a count above 0)."""
    return bool(await conn.fetchval(statement))


# --- twins in line across hosts (see test_claim_reach.py for the line itself) ----------------


async def test_opposite_order_twin_enqueues_from_many_hosts_never_deadlock(url: str) -> None:
    # Each host enqueues twins of two running contents, half of them in the other order:
    # the line's triggers take no lock of their own, so no two wait on each other in a
    # circle (an earlier design with a lock per content deadlocked here).
    hosts = [ControlStore(url) for _ in range(4)]
    try:
        first = hosts[0]
        await first.create_project("p", "P")
        for content in ("x", "y"):
            await first.enqueue("p", {"c": content}, fingerprint=content, dedup=False)
        running = await first.claim_batch("w", 2)
        assert len(running) == 2

        async def burst(store: ControlStore, order: list[str]) -> None:
            for _ in range(25):
                await store.enqueue_many(
                    "p", [Job({"c": c}, fingerprint=c) for c in order], dedup=False
                )

        await asyncio.gather(*(
            burst(store, ["x", "y"] if n % 2 else ["y", "x"]) for n, store in enumerate(hosts)
        ))  # fmt: skip
        backends: list[Any] = [await store._engine.ready() for store in hosts]
        assert sum(backend.writer.retried_rounds for backend in backends) == 0
        assert await first.claim("w") is None  # every twin waits behind its running one
        for claim in running:
            await first.finish(claim.item_id, fence=claim.fence)
        assert {c.fingerprint for c in await first.claim_batch("w", 5)} == {"x", "y"}
        assert await verify_ledger(first) == []
    finally:
        for store in hosts:
            await store.close()


async def _settle_during_a_cancel(
    conn: asyncpg.Connection, settle: Coroutine[Any, Any, Any], cancelled: int
) -> None:
    """Run ``settle`` while ``conn`` holds a cancel of ``cancelled`` open (row and event, as
    the store writes them); commit the cancel once the settle waits for it."""
    cancel = conn.transaction()
    await cancel.start()
    await conn.execute(
        "UPDATE items SET state = 'cancelled', fence = fence + 1 WHERE item_id = $1", cancelled
    )
    await conn.execute(
        "INSERT INTO events (item_id, event_type, fence, at) VALUES ($1, 'cancelled', 1, 0)",
        cancelled,
    )
    settling = asyncio.ensure_future(settle)

    async def settle_waits() -> bool:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return bool(waiting)

    await until(settle_waits, what="the settle waiting for the cancel")
    await cancel.commit()
    await settling


async def _a_running_twin(store: ControlStore) -> Any:
    """The claim of an item of content "x" in project "p" (made here): a running twin."""
    await store.create_project("p", "P")
    running = await store.enqueue("p", {"n": "R"}, fingerprint="x", dedup=False)
    claim = await store.claim("w")
    assert claim is not None and claim.item_id == running
    return claim


async def test_a_held_twin_cancelled_while_its_running_twin_settles_hands_the_place_on(
    url: str,
) -> None:
    # The settle's trigger picks the first held twin to hand the place to, while another
    # transaction is cancelling that very twin: it must look again, not free a cancelled
    # row and leave the rest of the line held behind nothing.
    async with ControlStore(url) as store:
        claim = await _a_running_twin(store)
        running = claim.item_id
        first, second = [
            await store.enqueue("p", {"n": n}, fingerprint="x", dedup=False) for n in (1, 2)
        ]
        conn = await asyncpg.connect(url)
        try:
            await _settle_during_a_cancel(conn, store.finish(running, fence=claim.fence), first)
        finally:
            await conn.close()
        got = await store.claim("w")
        assert got is not None and got.item_id == second
        assert await verify_ledger(store) == []


async def test_two_moves_of_one_line_at_once_hand_the_place_on_once(url: str) -> None:
    # A twin arrived while its running twin's row was locked (a renewal in flight), so it
    # stayed claimable beside it; then it is cancelled while the running twin settles.
    # Each move's trigger, alone, would leave the handing-on to the other: one at a time,
    # the second sees the first's, and the held twin gets the place.
    async with ControlStore(url) as store:
        claim = await _a_running_twin(store)
        running = claim.item_id
        conn = await asyncpg.connect(url)
        try:
            renewal = conn.transaction()
            await renewal.start()
            await conn.execute(
                "UPDATE items SET updated_at = updated_at WHERE item_id = $1", running
            )
            beside = await store.enqueue("p", {"n": "T"}, fingerprint="x", dedup=False, priority=1)
            await renewal.commit()
            held = await store.enqueue("p", {"n": "H"}, fingerprint="x", dedup=False)
            await _settle_during_a_cancel(conn, store.finish(running, fence=claim.fence), beside)
        finally:
            await conn.close()
        got = await store.claim("w")
        assert got is not None and got.item_id == held
        assert await verify_ledger(store) == []


async def test_only_the_settle_of_an_awaited_item_notifies(
    url: str, tmp_path: pathlib.Path
) -> None:
    # Every notifying commit wakes every listening session of the database: a settle
    # nobody waits for notifies nobody, one that a wait() marked does.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        alone, awaited = await store.enqueue("p", {}), await store.enqueue("p", {})
        listener = await asyncpg.connect(url)
        heard: list[str] = []
        marks: asyncio.Queue[str] = asyncio.Queue()
        try:
            await listener.add_listener(pg_sql.SETTLED_CHANNEL, lambda *a: heard.append(a[3]))
            await listener.add_listener("test_mark", lambda *a: marks.put_nowait(a[3]))

            async def heard_since_mark(name: str) -> list[str]:
                # Notifications come in commit order: once a later commit's has come,
                # every earlier commit's has too.
                heard.clear()
                await sql(url, f"NOTIFY test_mark, '{name}'")
                assert await marks.get() == name
                return list(heard)

            first, second = await store.claim("w"), await store.claim("w")
            assert first is not None and second is not None
            assert (first.item_id, second.item_id) == (alone, awaited)
            await store.finish(first.item_id, fence=first.fence, result=1)
            assert await heard_since_mark("unawaited") == []
            waiting = asyncio.create_task(store.wait(awaited))

            async def marked() -> bool:
                return await listener.fetch("SELECT item_id FROM awaited") == [(awaited,)]

            await until(marked, what="wait() marking its item")
            heard.clear()
            await store.finish(second.item_id, fence=second.fence, result=2)
            assert (await waiting)["result"] == 2
            await until(lambda: bool(heard), what="the awaited item's settle heard")
            assert set(heard) == {(await sql(url, "SELECT current_schema()"))[0][0]}
            await store.purge(0, archive_path=tmp_path / "archive.jsonl")
            assert await sql(url, "SELECT item_id FROM awaited") == []
        finally:
            await listener.close()


class _Heard:
    """What a connection of the test hears on the store's channel, counted between marks:
    notifications come in commit order, so once a later commit's mark has come, every
    earlier commit's notification has too."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._heard: list[str] = []
        self._marks: asyncio.Queue[str] = asyncio.Queue()
        self._conn: asyncpg.Connection | None = None
        self._channel = ""

    async def __aenter__(self) -> _Heard:
        self._conn = conn = await asyncpg.connect(self._url)
        schema = await conn.fetchval("SELECT current_schema()")
        self._channel = f"test_mark_{await conn.fetchval('SELECT pg_backend_pid()')}"

        def heard(*args: Any) -> None:
            if args[3] == schema:  # (a server shared with other schemas' stores)
                self._heard.append(args[3])

        await conn.add_listener(pg_sql.CHANNEL, heard)
        await conn.add_listener(self._channel, lambda *a: self._marks.put_nowait(a[3]))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._conn is not None
        await self._conn.close()

    async def _mark(self, name: str) -> None:
        await sql(self._url, f"NOTIFY {self._channel}, '{name}'")
        assert await self._marks.get() == name

    async def during(self, name: str, write: Coroutine[Any, Any, Any]) -> int:
        """How many NOTIFYs the commits of ``write`` sent."""
        await self._mark(f"before {name}")
        self._heard.clear()
        await write
        await self._mark(name)
        return len(self._heard)


async def test_a_fingerprinted_settle_wakes_the_fleet_only_when_it_frees_a_twin(
    url: str,
) -> None:
    # Every NOTIFY wakes every process with a store open on the database. The settle of
    # a fingerprinted item notified every time, since a twin of it might wait; now only
    # when its twin line's trigger finds one to free (migration 13).
    async with ControlStore(url) as store, _Heard(url) as heard:
        await store.create_project("p", "P")
        wakes = (await store._engine.ready()).twin_wakes
        assert wakes is not None

        async def running(content: str) -> Any:
            await store.enqueue("p", {"n": content}, fingerprint=content)
            claim = await store.claim("w")
            assert claim is not None and claim.fingerprint == content
            return claim

        alone = await running("alone")
        assert await heard.during("no twin", store.finish(alone.item_id, fence=alone.fence)) == 0
        lone = await store.enqueue("p", {}, fingerprint="lone")
        assert await heard.during("a cancel, no twin", store.cancel(lone)) == 0
        failing = await running("failing")
        fail = store.finish(failing.item_id, fence=failing.fence, status="failed", error="e")
        assert await heard.during("a failure", fail) == 0

        ahead = await running("line")
        held = [await store.enqueue("p", {}, fingerprint="line", dedup=False) for _ in "ab"]
        assert await heard.during("a held twin cancelled", store.cancel(held[1])) == 0
        settle = store.finish(ahead.item_id, fence=ahead.fence)
        assert await heard.during("a twin freed", settle) == 1
        assert await heard.during("the freed twin cancelled", store.cancel(held[0])) == 0

        later = await running("later")
        assert (wakes.sent, wakes.left_to_settles) == (0, 0)
        not_before = (await sql(url, SERVER_NOW))[0][0] + 3600

        async def deferred_beside_it() -> None:
            await store.enqueue("p", {}, fingerprint="later", dedup=False, not_before=not_before)
            # Its process looks again after its commit, in case a settle missed it: a
            # twin runs, whose settle will look after that, so no second NOTIFY.
            await until(lambda: wakes.left_to_settles == 1, what="the deferred twin's look")

        assert await heard.during("a deferred twin added", deferred_beside_it()) == 1
        settle = store.finish(later.item_id, fence=later.fence)
        assert await heard.during("a deferred twin left", settle) == 1
        assert wakes.sent == 0
        assert await verify_ledger(store) == []


def _asleep() -> set[asyncio.Task[Any]]:
    """The wait tasks of this process's claims asleep now: one the set did not have is
    a claim that woke, looked, found nothing and went back to sleep."""
    return {task for task in asyncio.all_tasks() if task.get_name() == "asyncplane-wait-work-local"}


async def _settling(conn: asyncpg.Connection, claim: Any) -> Any:
    """A settle of ``claim``'s item, done, held open on ``conn`` (row and event, as the
    store writes them): its trigger has the content's hand-off lock, and has looked."""
    settle = conn.transaction()
    await settle.start()
    await conn.execute(
        "UPDATE items SET state = 'done', lease_expires_at = NULL, result = 'null'"
        " WHERE item_id = $1",
        claim.item_id,
    )
    await conn.execute(
        "INSERT INTO events (item_id, event_type, fence, owner, at)"
        " VALUES ($1, 'done', $2, $3, 0)",
        claim.item_id, claim.fence, claim.owner,
    )  # fmt: skip
    return settle


@pytest.fixture
def notify_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sleeping claims wake on a NOTIFY alone: their safety poll is an hour."""
    from asyncplane import _postgres

    monkeypatch.setattr(_postgres, "_SAFETY_POLL_SECONDS", 3600.0)


async def _claimed_elsewhere_once_settled(
    url: str,
    here: ControlStore,
    there: ControlStore,
    claim: Any,
    arrive: Callable[[], Awaitable[int]],
) -> None:
    """With ``claim``'s settle held open and a claim waiting in ``there``: ``arrive``
    commits a twin (of ``here``) the settle missed; the claim wakes on its NOTIFY, looks,
    and sleeps again; the twin's wake-up finds the settle under way; the settle commits,
    and the waiting claim gets the twin, woken by ``here``'s wake-up."""
    wakes = (await here._engine.ready()).twin_wakes
    assert wakes is not None
    conn = await asyncpg.connect(url)
    try:
        settle = await _settling(conn, claim)
        waiting = asyncio.create_task(there.claim("v", wait=120, poll_interval=0.01))
        await until(waiting_on("local"), what="the claim elsewhere waiting")
        asleep = _asleep()
        twin = await arrive()
        await until(lambda: bool(_asleep() - asleep), what="the claim elsewhere looking")
        await until(lambda: wakes.busy > 0, what="the twin's wake-up finding the settle")
        assert wakes.sent == 0
        await settle.commit()
        got = await asyncio.wait_for(waiting, 60)
    finally:
        await conn.close()
    assert got is not None and got.item_id == twin
    await until(lambda: wakes.sent == 1, what="the wake-up counted")  # (after its NOTIFY)
    assert await verify_ledger(here) == []


@contextlib.asynccontextmanager
async def _two_stores(url: str) -> AsyncIterator[tuple[ControlStore, ControlStore]]:
    """Two stores on the schema at ``url`` (here, and a process elsewhere), project "p"
    made: where a twin arrives and where it is claimed."""
    async with ControlStore(url) as here, ControlStore(url) as there:
        await here.create_project("p", "P")
        yield here, there


async def _an_hour_on(url: str) -> float:
    """The server's time an hour from now: when a deferred item falls due in no test."""
    return float((await sql(url, SERVER_NOW))[0][0]) + 3600


class _HeldArrival:
    """A ready twin of content x in project p, enqueued (row and event, as the store
    writes them) by a round of ``backend``'s writer whose transaction stays open until
    `commit`."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._inserted, self._release = asyncio.Event(), asyncio.Event()
        self._arriving: asyncio.Future[int] | None = None

    async def _arrive(self, conn: asyncpg.Connection, now: float) -> int:
        twin: int = await conn.fetchval(
            "INSERT INTO items (project_id, state, payload, created_at, updated_at,"
            " fingerprint, dedup) VALUES ('p', 'ready', '{}', $1, $1, 'x', false)"
            " RETURNING item_id",
            now,
        )
        await conn.execute(
            "INSERT INTO events (item_id, event_type, fence, at) VALUES ($1, 'queued', 0, $2)",
            twin, now,
        )  # fmt: skip
        self._inserted.set()
        await self._release.wait()
        return twin

    async def start(self) -> None:
        self._arriving = asyncio.ensure_future(self._backend.writer.submit(self._arrive))
        await self._inserted.wait()

    async def commit(self) -> int:
        assert self._arriving is not None
        self._release.set()
        return await self._arriving


@pytest.mark.usefixtures("notify_alone")
@pytest.mark.parametrize("arrives", ["ready", "deferred"])
async def test_a_twin_that_arrives_while_its_running_twin_settles_is_claimed_at_once(
    url: str, arrives: str
) -> None:
    # The settle's look missed the twin (it was not there yet), and the twin could not wait
    # behind the running one (the settle had its row), so it committed first: its NOTIFY
    # woke drainers that still saw its twin running, and the settle sends none. The
    # twin's process wakes them again once the settle has committed (migration 13).
    async with _two_stores(url) as (here, there):
        running = await here.enqueue("p", {"n": "R"}, fingerprint="x", dedup=False)
        claim = await here.claim("w")
        assert claim is not None and claim.item_id == running

        async def arrive() -> int:
            not_before = None
            if arrives == "deferred":
                not_before = (await sql(url, SERVER_NOW))[0][0] + 0.5
            twin = await here.enqueue(
                "p", {"n": "T"}, fingerprint="x", dedup=False, not_before=not_before
            )
            assert (await here.item(twin))["state"] == arrives
            return twin

        await _claimed_elsewhere_once_settled(url, here, there, claim, arrive)


@pytest.mark.usefixtures("notify_alone")
async def test_a_twin_unheld_while_its_twin_is_claimed_and_settled_is_claimed(url: str) -> None:
    # The twin arrives while no twin of it runs: its twin is deferred and due, so nothing
    # holds it back. Before it commits, that twin is claimed elsewhere and its settle
    # begins: the claim and the settle's look both came before the arrival committed.
    # Unheld beside a live twin, it tells its process, which wakes the drainers once the
    # settle has committed (migration 13).
    async with _two_stores(url) as (here, there):
        later = await _an_hour_on(url)
        due = await here.enqueue("p", {"n": "R"}, fingerprint="x", dedup=False, not_before=later)
        await sql(url, "UPDATE items SET due_at = 0 WHERE item_id = $1", due)
        arrival = _HeldArrival(await here._engine.ready())
        await arrival.start()
        claim = await there.claim("w")
        assert claim is not None and claim.item_id == due
        await _claimed_elsewhere_once_settled(url, here, there, claim, arrival.commit)


@pytest.mark.usefixtures("notify_alone")
async def test_a_twin_behind_one_a_claimer_is_taking_is_claimed_after_that_ones_settle(
    url: str,
) -> None:
    # The twin arrives behind a claimable twin whose row a claimer has locked, so it
    # cannot wait behind it and stays claimable beside it. Before it commits, that claim
    # commits and the claimed twin's settle begins, looking before the arrival committed.
    # Unheld beside a live twin, it tells its process (migration 13).
    async with _two_stores(url) as (here, there):
        ahead = await here.enqueue("p", {"n": "A"}, fingerprint="x", dedup=False, priority=1)
        arrival = _HeldArrival(await here._engine.ready())
        claimer = await asyncpg.connect(url)
        try:
            claiming = claimer.transaction()
            await claiming.start()
            await claimer.execute(
                "UPDATE items SET state = 'claimed', fence = 1, attempts = 1, owner = 'k',"
                " lease_expires_at = 1e12 WHERE item_id = $1",
                ahead,
            )
            await claimer.execute(
                "INSERT INTO events (item_id, event_type, fence, owner, at)"
                " VALUES ($1, 'claimed', 1, 'k', 0)",
                ahead,
            )
            await arrival.start()
            await claiming.commit()
        finally:
            await claimer.close()
        claim = types.SimpleNamespace(item_id=ahead, fence=1, owner="k")
        await _claimed_elsewhere_once_settled(url, here, there, claim, arrival.commit)


async def test_a_twin_told_of_while_its_contents_look_is_under_way_is_looked_at_again(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A look answers for the twins committed before it had the content's lock; one told
    # of while it ran (a settle may have looked before that one committed, and after the
    # look) is looked at again, not forgotten with the answer.
    async with ControlStore(url) as store:
        await _a_running_twin(store)
        wakes = (await store._engine.ready()).twin_wakes
        assert wakes is not None
        # The look, held after it has looked until the test lets it answer.
        await sql(
            url,
            "CREATE FUNCTION test_gated(projects text[], contents text[], OUT busy int[],"
            " OUT woken int, OUT running int) LANGUAGE plpgsql AS $$ BEGIN"
            " SELECT w.busy, w.woken, w.running INTO busy, woken, running"
            " FROM asyncplane_twins_waited(projects, contents) AS w;"
            " PERFORM pg_advisory_xact_lock_shared(4242); END $$",
        )
        monkeypatch.setattr(
            pg_sql, "TWINS_WAITED", "SELECT busy, woken, running FROM test_gated($1, $2)"
        )
        later = await _an_hour_on(url)
        gate = await asyncpg.connect(url)
        try:
            await gate.execute("SELECT pg_advisory_lock(4242)")
            await store.enqueue("p", {"n": 1}, fingerprint="x", dedup=False, not_before=later)

            async def look_waits() -> bool:
                return bool(await gate.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND objid = 4242 AND NOT granted"
                ))  # fmt: skip

            await until(look_waits, what="the look under way")
            await store.enqueue("p", {"n": 2}, fingerprint="x", dedup=False, not_before=later)
            await until(lambda: wakes.told == 2, what="the second twin told of")
            await gate.execute("SELECT pg_advisory_unlock(4242)")
            await until(lambda: wakes.left_to_settles == 2, what="the second look")
        finally:
            await gate.close()
        assert (wakes.sent, wakes.busy) == (0, 0)


@pytest.mark.usefixtures("notify_alone")
async def test_a_deferred_item_given_a_settling_twins_fingerprint_is_claimed_when_due(
    url: str,
) -> None:
    # A deferred item without a fingerprint is given one (the preflight's backfill) while
    # the running twin of that content settles: the drainers' alarms leave it out from
    # then on, and the settle's look came before it was a twin. Its process wakes them
    # once the settle has committed (migration 13).
    async with _two_stores(url) as (here, there):
        later = await _an_hour_on(url)
        item = await here.enqueue("p", {"n": "D"}, not_before=later)
        running = await here.enqueue("p", {"n": "R"}, fingerprint="x", dedup=False)
        claim = await here.claim("w")
        assert claim is not None and claim.item_id == running
        backend = await here._engine.ready()
        wakes = backend.twin_wakes
        assert wakes is not None

        async def given(conn: asyncpg.Connection, now: float) -> None:
            # (as SET_FINGERPRINT writes it, and due at once)
            await conn.execute(
                "UPDATE items SET fingerprint = 'x', due_at = 0 WHERE item_id = $1", item
            )

        conn = await asyncpg.connect(url)
        try:
            settle = await _settling(conn, claim)
            waiting = asyncio.create_task(there.claim("v", wait=120, poll_interval=0.01))
            await until(waiting_on("local"), what="the claim elsewhere waiting")
            await backend.writer.submit(given)
            await until(lambda: wakes.busy > 0, what="the item's wake-up finding the settle")
            await settle.commit()
            got = await asyncio.wait_for(waiting, 60)
        finally:
            await conn.close()
        assert got is not None and got.item_id == item
        await until(lambda: wakes.sent == 1, what="the wake-up counted")  # (after its NOTIFY)


async def test_the_write_statements_plans_are_led_by_the_primary_key(url: str) -> None:
    # The write connection plans each statement once, for any parameters. A plan made
    # while the table's statistics are unknown (a fresh store filled since) must still
    # look the items up by id, not scan the table for each round's handful.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
    conn = await asyncpg.connect(url, server_settings={"plan_cache_mode": "force_generic_plan"})
    try:
        await conn.execute(
            "INSERT INTO items (project_id, state, payload, created_at, updated_at)"
            " SELECT 'p', 'ready', '{}', 0, 0 FROM generate_series(1, 10000)"
        )
        statements = {
            "claim": (pg_sql.CLAIM_ITEMS, 11, {2: "{1}", 3: "{w}", 4: "{1}", 5: "{f}", 7: "{f}"}),
            "finish": (pg_sql.FINISH_MANY, 11, {2: "{1}", 3: "{1}", 5: "{done}"}),
        }
        for name, (statement, count, arrays) in statements.items():
            args = ", ".join(
                f"'{arrays[n]}'" if n in arrays else "NULL" for n in range(1, count + 1)
            )
            async with conn.transaction():
                await conn.execute(f"PREPARE s AS {statement}")
                plan = "\n".join(
                    row[0] for row in await conn.fetch(f"EXPLAIN (COSTS OFF) EXECUTE s({args})")
                )
                await conn.execute("DEALLOCATE s")
            assert "Seq Scan on items" not in plan, (name, plan)
            assert "items_pkey" in plan, (name, plan)
    finally:
        await conn.close()


async def test_a_round_of_finishes_commits_by_itself_twins_and_all(url: str) -> None:
    # A round of finishes is one statement, which commits by itself: no BEGIN, no COMMIT,
    # the done finish of a fingerprinted item that settles its twins included (migration
    # 12; before, that one went on in a transaction of four more round trips). A finish
    # it cannot do alone (refused) goes on in a transaction, as before.
    async with (
        ControlStore(url) as store,
        ControlStore(url, identity=("task",)) as fingerprinting,
    ):
        await store.create_project("p", "P")
        writer: Any = (await store._engine.ready()).writer
        plain = await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == plain
        alone, rounds = writer.alone_rounds, writer.rounds
        assert await store.finish(plain, fence=claim.fence, result=1) is None
        assert (writer.alone_rounds - alone, writer.rounds - rounds) == (1, 1)
        with pytest.raises(FenceRejected):
            await store.finish(plain, fence=claim.fence + 1, result=2)
        assert (await store.item(plain))["result"] == 1

        # Twins written without fingerprints, fingerprinted by the preflight.
        done_id, twin = [await store.enqueue("p", {"task": "t"}) for _ in range(2)]
        assert await fingerprinting.dedup_pending_against_done() == 0
        claim = await fingerprinting.claim("w")
        assert claim is not None and claim.item_id == done_id
        writer = (await fingerprinting._engine.ready()).writer
        alone, rounds = writer.alone_rounds, writer.rounds
        await fingerprinting.finish(done_id, fence=claim.fence, result="shared")
        assert (writer.alone_rounds - alone, writer.rounds - rounds) == (1, 1)
        assert (await store.item(twin))["state"] == "done"
        assert (await store.item(twin))["result"] == "shared"
        assert (await store.events(twin))[-1]["detail"] == {"deduplicated_from": done_id}
        assert await verify_ledger(store) == []


async def test_a_fingerprinted_claim_and_finish_are_one_statement_each(url: str) -> None:
    # An item with a content of its own is claimed and finished as a plain one is: each a
    # statement that commits by itself (CLAIM_ALONE and FINISH_MANY; before migration 12,
    # five round trips each, mostly a transaction's, and the claim went the general way
    # for the next 64 claims too). Twins among the first ready items still go the general
    # way, which takes one of them.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        writer: Any = (await store._engine.ready()).writer
        first, second = await store.enqueue_many("p", [
            Job({"n": 1}, fingerprint="one"), Job({"n": 2}, fingerprint="two"),
        ])  # fmt: skip
        for item in (first, second):
            alone, rounds = writer.alone_rounds, writer.rounds
            claim = await store.claim("w")
            assert claim is not None and claim.item_id == item
            await store.finish(item, fence=claim.fence, result=item)
            assert (writer.alone_rounds - alone, writer.rounds - rounds) == (2, 2)

        # Two claimable twins at once (a hand edit; the line keeps one as a rule).
        twins = await store.enqueue_many(
            "p", [Job({"n": n}, fingerprint="both") for n in range(2)], dedup=False
        )
        other = await store.enqueue("p", {"n": 3}, fingerprint="other")
        await sql(url, "UPDATE items SET held = false WHERE fingerprint = 'both'")
        alone = writer.alone_rounds
        batch = await store.claim_batch("w", 2)
        assert [c.item_id for c in batch] == [twins[0], other]
        assert writer.alone_rounds == alone
        assert await verify_ledger(store) == []


async def test_a_claim_leaves_a_twin_another_claimer_is_starting_and_wakes_the_drainers(
    url: str,
) -> None:
    # The one-statement claim takes a fingerprinted item only if its content's claim lock
    # is had (tried, never waited for) and no twin runs: while another transaction holds
    # that lock, the item is left, and the drainers are told (the claim locked a row it
    # did not take, which any claimer meanwhile skipped).
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        writer: Any = (await store._engine.ready()).writer
        item = await store.enqueue("p", {}, fingerprint="c")
        claimer = await asyncpg.connect(url)
        listener = await asyncpg.connect(url)
        heard: list[str] = []
        try:
            await listener.add_listener(pg_sql.CHANNEL, lambda *a: heard.append(a[3]))
            starting = claimer.transaction()
            await starting.start()
            await claimer.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended("
                " current_schema() || chr(1) || 'p' || chr(1) || 'c', 1))"
            )
            alone = writer.alone_rounds
            assert await store.claim("w") is None
            assert writer.alone_rounds == alone + 1
            await until(lambda: bool(heard), what="the drainers woken")
            assert set(heard) == {(await sql(url, "SELECT current_schema()"))[0][0]}
            assert (await store.item(item))["state"] == "ready"
            await starting.rollback()
            claim = await store.claim("w")
            assert claim is not None and claim.item_id == item
        finally:
            await claimer.close()
            await listener.close()
        assert await verify_ledger(store) == []


async def test_a_done_finish_settles_the_twins_committed_while_it_waited_for_the_content(
    url: str,
) -> None:
    # The one-statement finish settles a done item's pending twins after its content's
    # hand-off lock, in a snapshot of its own (asyncplane_settle_twins): a twin whose
    # transaction held that lock when the finish began, and committed while the finish
    # waited for it, is settled, though the finish's statement began before it existed.
    # (Its own pair trigger had the lock, so it noted nothing: this settle is its only
    # one.)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        writer: Any = (await store._engine.ready()).writer
        running = await store.enqueue("p", {}, fingerprint="c")
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == running
        alone = writer.alone_rounds
        adding = await asyncpg.connect(url)
        watcher = await asyncpg.connect(url)
        try:
            enqueue = adding.transaction()
            await enqueue.start()
            await adding.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended("
                " current_schema() || chr(1) || 'p' || chr(1) || 'c', 2))"
            )
            twin = await adding.fetchval(
                "INSERT INTO items (project_id, state, payload, created_at, updated_at,"
                " fingerprint, due_at) VALUES ('p', 'deferred', '{}', 0, 0, 'c',"
                " extract(epoch FROM clock_timestamp()) + 86400)"
                " RETURNING item_id"
            )
            finishing = asyncio.create_task(
                store.finish(running, fence=claim.fence, result="shared"), name="finish"
            )

            async def waits_for_the_content() -> bool:
                return bool(await watcher.fetchval(
                    "SELECT count(*) FROM pg_locks JOIN pg_stat_activity USING (pid)"
                    " WHERE locktype = 'advisory' AND NOT granted"
                    " AND query LIKE '%WITH asked AS%'"  # FINISH_MANY's opening
                ))  # fmt: skip

            await until(waits_for_the_content, what="the finish waiting for the content")
            await enqueue.commit()
            await finishing
        finally:
            await adding.close()
            await watcher.close()
        assert writer.alone_rounds == alone + 1  # the one statement, not a transaction
        settled = await store.item(twin)
        assert (settled["state"], settled["result"]) == ("done", "shared")
        assert (await store.events(twin))[-1]["detail"] == {"deduplicated_from": running}
        assert await sql(url, "SELECT 1 FROM twin_checks") == []


async def test_a_dropped_store_leaves_its_schema_empty_and_opens_again(url: str) -> None:
    # The probe's --overwrite drops the store in its schema (`drop_store`): every table
    # and function every migration made, so that the next store there migrates from
    # nothing. (It left migration 7's table and function behind, and the next open failed
    # on "already exists".)
    from asyncplane import _probe_support

    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {}, fingerprint="c")
    await _probe_support.drop_store(url)
    left = await sql(
        url,
        "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace"
        " UNION ALL SELECT proname FROM pg_proc"
        " WHERE pronamespace = current_schema()::regnamespace",
    )
    assert left == []
    assert await _probe_support.schema_is_empty(url)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        assert await store.enqueue("p", {}, fingerprint="c") > 0
        assert await verify_ledger(store) == []


async def test_the_twin_guard_looks_after_it_has_the_content_lock(url: str) -> None:
    # asyncplane_twin_may_start looks for a running twin in a snapshot taken after it has
    # the content's lock, not in the snapshot of the statement that calls it: a twin that
    # started running after that statement began, and before the lock was tried, is seen.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        first, second = await store.enqueue_many(
            "p", [Job({"n": n}, fingerprint="c") for n in range(2)], dedup=False
        )
        calling = await asyncpg.connect(url)
        holding = await asyncpg.connect(url)
        try:
            await holding.execute("SELECT pg_advisory_lock(4242)")
            called = asyncio.create_task(calling.fetchval(
                "WITH paused AS MATERIALIZED (SELECT pg_advisory_lock(4242))"
                " SELECT asyncplane_twin_may_start('p', 'c', $1::bigint) FROM paused", second,
            ), name="guard")  # fmt: skip
            pid = calling.get_server_pid()

            async def paused() -> bool:
                return bool(await holding.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted", pid
                ))  # fmt: skip

            await until(paused, what="the calling statement begun, and waiting")
            claim = await store.claim("w")  # the first twin starts running, and commits
            assert claim is not None and claim.item_id == first
            await holding.execute("SELECT pg_advisory_unlock(4242)")
            assert await called is False
        finally:
            await calling.close()
            await holding.close()


async def test_a_round_of_finishes_settles_each_contents_twins_after_every_finish(
    url: str,
) -> None:
    # One FINISH_MANY of four finishes: two done items with pending twins (two and one),
    # a failed one with a twin (left pending: only a done item settles its twins) and a
    # plain one. Each answers how many twins it settled; every finish's event comes
    # before any twin's, as in a transaction of a statement each.
    from asyncplane import _backend, _postgres

    async with (
        ControlStore(url) as store,
        ControlStore(url, identity=("task",)) as fingerprinting,
    ):
        await store.create_project("p", "P")
        tasks = ["a", "a", "a", "b", "b", "c", "c"]
        ids = await store.enqueue_many("p", [{"task": task} for task in tasks])
        plain = await store.enqueue("p", {"n": 1})
        assert await fingerprinting.dedup_pending_against_done() == 0  # fingerprints given
        batch = await fingerprinting.claim_batch("w", 4)
        assert [c.item_id for c in batch] == [ids[0], ids[3], ids[5], plain]
        ops = [
            _backend.FinishOp(c.item_id, c.fence, status, None, f'"{c.item_id}"', error)
            for c, (status, error) in zip(
                batch, [("done", None), ("done", None), ("failed", "no"), ("done", None)],
                strict=True,
            )
        ]  # fmt: skip
        now = (await sql(url, SERVER_NOW))[0][0]
        rows = await sql(url, pg_sql.FINISH_MANY, *_postgres._finishes(ops, now))
        assert sorted((row[0], row[3]) for row in rows) == [
            (ids[0], 2),
            (ids[3], 1),
            (ids[5], 0),
            (plain, 0),
        ]
        for twin, done_id in ((ids[1], ids[0]), (ids[2], ids[0]), (ids[4], ids[3])):
            item = await store.item(twin)
            assert (item["state"], item["result"]) == ("done", str(done_id))
            assert (await store.events(twin))[-1]["detail"] == {"deduplicated_from": done_id}
        assert (await store.item(ids[6]))["state"] == "ready"
        [(last_finish, first_twin)] = await sql(
            url,
            "SELECT max(event_id) FILTER (WHERE item_id = ANY ($1::bigint[])),"
            " min(event_id) FILTER (WHERE detail LIKE '%deduplicated_from%') FROM events",
            [op.item_id for op in ops],
        )
        assert last_finish < first_twin
        assert await verify_ledger(store) == []


async def test_a_connection_lost_under_a_finish_alone_says_the_outcome_is_unknown(
    url: str,
) -> None:
    # The statement commits by itself: a connection lost with it on its way leaves the
    # round as unknown as one lost during COMMIT.
    async with (
        cut_on_commit(url, marker=b"twin_detail") as (through, arm, cut),
        ControlStore(through) as store,
    ):
        await store.create_project("p", "P")
        item = await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None
        arm.set()
        with pytest.raises(CommitOutcomeUnknown):
            await store.finish(item, fence=claim.fence, result=1)
        assert cut.is_set()
        arm.clear()
        assert (await store.item(item))["state"] == "claimed"  # never delivered
        await store.finish(item, fence=claim.fence, result=1)
        assert (await store.item(item))["state"] == "done"
        assert await verify_ledger(store) == []


async def test_work_counts_a_settle_saved_with_its_answer_lost_as_settled(url: str) -> None:
    # The finish reaches the server and is committed, but the connection goes before its
    # answer comes: the worker hears CommitOutcomeUnknown and tries again, and the fence
    # refuses the second try. The ledger shows the first one stood: counted done, not as
    # taken over.
    async with (
        cut_on_commit(url, marker=b"saved-unanswered", deliver=True) as (through, arm, cut),
        ControlStore(through, lease_seconds=60) as store,
    ):
        await store.create_project("p", "P")
        item = await store.enqueue("p", {})

        async def handle(claim: Job) -> Done:
            arm.set()  # the claim is in: the next message carrying the marker is the finish's
            return Done({"mark": "saved-unanswered"})

        summary = await work(store, handle, concurrency=1, until_empty=True)
        assert cut.is_set()
        assert (summary.done, summary.fence_rejected, summary.unsaved) == (1, 0, 0)
        assert (await store.item(item))["result"] == {"mark": "saved-unanswered"}
        assert [e["event_type"] for e in await store.events(item)] == ["queued", "claimed", "done"]
        assert await verify_ledger(store) == []


@pytest.mark.parametrize("then", ["claims again", "stops"])
async def test_work_gives_back_what_a_claim_saved_with_its_answer_lost_took(
    url: str, then: str
) -> None:
    # The claim reaches the server and is committed, but its answer never comes back: the
    # worker heard CommitOutcomeUnknown and claimed again, and the item it had taken ran
    # nowhere, was given back by no stop, and failed unrun at its lease's end where that
    # was its last attempt. Once the store answers (its next claim, or the stop), the
    # worker gives back what that claim took, its attempt refunded.
    owner = "orphan-claimer"  # in the claim's bound parameters: the marker
    async with (
        cut_on_commit(url, marker=owner.encode(), deliver=True) as (through, arm, cut),
        ControlStore(through, lease_seconds=600) as store,
    ):
        await store.create_project("p", "P")
        item = await store.enqueue("p", {}, max_attempts=1)
        ran: list[int] = []
        stop = asyncio.Event()

        async def handle(claim: Job) -> Done:
            ran.append(claim.item_id)
            return Done()

        arm.set()
        if then == "claims again":
            summary = await work(store, handle, concurrency=1, owner=owner, until_empty=True)
            assert ran == [item] and summary.done == 1
        else:

            def cut_then_stop() -> None:
                stop.set()  # the claim's answer is lost: stop before any other claim

            watcher = asyncio.get_running_loop().create_task(cut.wait())
            watcher.add_done_callback(lambda _: cut_then_stop())
            summary = await work(store, handle, concurrency=1, owner=owner, stop=stop)
            assert ran == [] and summary.done == 0
        assert cut.is_set()
        assert summary.released == 1
        row = await store.item(item)
        assert row["attempts"] == (1 if then == "claims again" else 0)
        assert row["state"] == ("done" if then == "claims again" else "ready")
        events = [e["event_type"] for e in await store.events(item)]
        assert events[:3] == ["queued", "claimed", "released"]
        assert await verify_ledger(store) == []


async def test_drain_gives_back_what_a_claim_saved_with_its_answer_lost_took(url: str) -> None:
    # As work() does: drain() raises the claim's CommitOutcomeUnknown, and the item that
    # claim took ran nowhere and failed unrun at its lease's end (its last attempt). It
    # is given back first, its attempt refunded.
    owner = "orphan-drainer"  # in the claim's bound parameters: the marker
    async with (
        cut_on_commit(url, marker=owner.encode(), deliver=True) as (through, arm, cut),
        ControlStore(through, lease_seconds=600) as store,
    ):
        await store.create_project("p", "P")
        item = await store.enqueue("p", {}, max_attempts=1)

        async def execute(batch: list[Job]) -> list[Done]:
            return [Done() for _ in batch]

        arm.set()
        with pytest.raises(CommitOutcomeUnknown):
            await drain(store, execute, owner=owner)
        assert cut.is_set()
        row = await store.item(item)
        assert (row["state"], row["attempts"]) == ("ready", 0)
        events = [e["event_type"] for e in await store.events(item)]
        assert events == ["queued", "claimed", "released"]
        summary = await drain(store, execute, owner=owner)
        assert summary.done == 1
        assert await verify_ledger(store) == []


async def test_work_tries_again_to_give_back_what_a_lost_claim_took(url: str) -> None:
    # The first give-back's connection is lost too: it is tried again (the outage passes
    # in a moment), not dropped with the rest of the lost claim's items left to their
    # leases, to fail unrun on their last attempt.
    owner = "orphan-claimer"
    async with (
        cut_on_commit(
            url, marker=owner.encode(), deliver=True, then=b"attempts = attempts - 1"
        ) as (through, arm, cut),
        ControlStore(through, lease_seconds=600) as store,
    ):
        await store.create_project("p", "P")
        items = [await store.enqueue("p", {"n": n}, max_attempts=1) for n in range(3)]
        ran: list[int] = []

        async def handle(claim: Job) -> Done:
            ran.append(claim.item_id)
            return Done()

        arm.set()
        summary = await work(store, handle, concurrency=3, owner=owner, until_empty=True)
        assert cut.is_set()
        assert sorted(ran) == items
        assert (summary.released, summary.done) == (3, 3)
        assert await verify_ledger(store) == []


async def test_work_stopped_while_the_store_fails_returns_its_summary(url: str) -> None:
    # The run ends as asked, but the count of what is left cannot be read (a server
    # restarting as the worker stops): work() raised, and its caller lost the summary
    # of everything the run did (the worker command exited 3 for a graceful stop).
    async with (
        cut_on_commit(url, marker=b"SELECT 'claimed', count(*)") as (through, arm, cut),
        ControlStore(through, lease_seconds=60) as store,
    ):
        await store.create_project("p", "P")
        item = await store.enqueue("p", {})
        stop = asyncio.Event()

        async def handle(claim: Job) -> Done:
            arm.set()  # from here the store's counts cannot be read
            stop.set()
            return Done({"ok": True})

        summary = await work(store, handle, concurrency=1, stop=stop)
        assert cut.is_set()
        # Not counted: None, where 0 would say the queue is empty.
        assert (summary.done, summary.remaining) == (1, None)
        arm.clear()
        assert (await store.item(item))["state"] == "done"


async def test_drain_ended_while_the_store_fails_returns_its_summary(url: str) -> None:
    # drain()'s twin of the above: the count of what is left raised, and the summary of
    # what the drain had done was lost with it.
    async with (
        cut_on_commit(url, marker=b"SELECT 'claimed', count(*)") as (through, arm, cut),
        ControlStore(through, lease_seconds=60) as store,
    ):
        await store.create_project("p", "P")
        items = [await store.enqueue("p", {"n": n}) for n in range(2)]

        async def execute(batch: list[Job]) -> list[Done]:
            arm.set()  # from here the store's counts cannot be read
            return [Done() for _ in batch]

        summary = await drain(store, execute, batch_size=2)
        assert cut.is_set()
        assert (summary.done, summary.remaining) == (2, None)
        arm.clear()
        assert [(await store.item(i))["state"] for i in items] == ["done", "done"]


async def test_work_counts_a_give_back_saved_with_its_answer_lost_as_released(url: str) -> None:
    # The same for the release a stop makes: saved, its answer lost, tried again and
    # refused; counted released, not as taken over.
    actor = "saved-unanswered"
    async with (
        cut_on_commit(url, marker=actor.encode(), deliver=True) as (through, arm, cut),
        ControlStore(through, lease_seconds=60) as store,
    ):
        await store.create_project("p", "P")
        await store.assign("p", actor)
        item = await store.enqueue("p", {})
        stop = asyncio.Event()

        async def handle(claim: Job) -> Done:
            arm.set()  # the next message carrying the actor is the release
            stop.set()
            await asyncio.Event().wait()  # until the stop cancels it
            raise AssertionError("unreachable")

        summary = await work(store, handle, concurrency=1, actor_id=actor, stop=stop, grace=0)
        assert cut.is_set()
        assert (summary.released, summary.fence_rejected, summary.unsaved) == (1, 0, 0)
        row = await store.item(item)
        assert (row["state"], row["attempts"]) == ("ready", 0)
        assert await verify_ledger(store) == []


async def test_a_plain_claim_is_one_statement_and_any_other_reach_goes_the_general_way(
    url: str,
) -> None:
    # One open project, no limits, nothing lapsed or due, no two twins among the items
    # taken: the claim is one statement that commits by itself, and claims what the
    # general claim would. A reach that is not plain goes the general way, and its next
    # claims do not try the one statement again for a while.
    async with ControlStore(url, lease_seconds=60) as store:
        await store.create_project("p", "P")
        ids = await store.enqueue_many("p", [{"n": n} for n in range(6)])
        urgent = await store.enqueue("p", {"urgent": True}, priority=5)
        writer: Any = (await store._engine.ready()).writer
        backend: Any = store._engine.backend

        async def runs_alone() -> int:
            async def read(conn: Any, now: float) -> int:
                return int(await conn.fetchval(
                    "SELECT coalesce(sum(generic_plans), 0) FROM pg_prepared_statements"
                    " WHERE statement = $1", pg_sql.CLAIM_ALONE,
                ))  # fmt: skip

            return int(await backend._write(read))

        alone = writer.alone_rounds
        batch = await store.claim_batch("w", 3)
        assert [c.item_id for c in batch] == [urgent, ids[0], ids[1]]
        assert [c.fence for c in batch] == [1, 1, 1]
        assert writer.alone_rounds == alone + 1
        assert [e["event_type"] for e in await store.events(urgent)] == ["queued", "claimed"]
        assert (await store.item(urgent))["claimed_at"] is not None

        await store.create_project("q", "Q")  # two projects in reach: not plain
        tried = await runs_alone()
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == ids[2]
        assert await runs_alone() == tried + 1  # tried, and went the general way
        assert writer.alone_rounds == alone + 1
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == ids[3]
        assert await runs_alone() == tried + 1  # not tried again
        claim = await store.claim("w", project_id="p")  # another reach, and a plain one
        assert claim is not None and claim.item_id == ids[4]
        assert writer.alone_rounds == alone + 2
        assert await verify_ledger(store) == []


async def test_a_preflight_steps_plans_never_walk_the_items(url: str) -> None:
    # A step's cost follows what changed, not the store's size: its statements lead by
    # the notes of twin pairs or by the items without a fingerprint (their own index),
    # and reach other items by content only, whatever the plan: generic (the write
    # connection's, perhaps made before the table had statistics) or not, before the
    # table is analysed and after. No walk of the table, nor of the pending or done items
    # through an index on state, nor of the table in id order for a LIMIT.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
    conn = await asyncpg.connect(url)
    try:
        for state in ("ready", "done"):
            await conn.execute(
                "INSERT INTO items"
                " (project_id, state, payload, created_at, updated_at, fingerprint)"
                f" SELECT 'p', '{state}', '{{}}', 0, 0, 'f' || n"
                " FROM generate_series(1, 10000) AS n"
            )
        twins = ("items_dedup_twins", "items_settled_twins")  # (the two sides of a pair)
        statements = {
            "look": (pg_sql.ANY_TWIN_NOTED, "NULL, NULL", ()),
            "notes": (pg_sql.TWIN_NOTES, "500, NULL, NULL, 0", ()),
            "pairs": (pg_sql.NOTED_TWIN_PAIRS, "500, '{p}', '{f1}'", twins),
            "forget": (pg_sql.FORGET_TWIN_NOTES, "'{1}'", twins),
            "backfill": (
                pg_sql.MISSING_FINGERPRINTS,
                "0, 500, NULL, NULL",
                ("items_unfingerprinted",),
            ),
        }
        walks = ("Seq Scan on items", "items_by_state", "items_by_project", "items_pkey")
        for analysed in (False, True):
            if analysed:
                await conn.execute("ANALYZE items")
            for mode in ("force_generic_plan", "auto"):
                await conn.execute(f"SET plan_cache_mode = {mode}")
                for name, (statement, args, indexes) in statements.items():
                    async with conn.transaction():
                        await conn.execute(f"PREPARE s AS {statement}")
                        explained = await conn.fetch(f"EXPLAIN (COSTS OFF) EXECUTE s({args})")
                        await conn.execute("DEALLOCATE s")
                    plan = "\n".join(row[0] for row in explained)
                    seen = (analysed, mode, name, plan)
                    assert not [walk for walk in walks if walk in plan], seen
                    assert all(index in plan for index in indexes), seen
    finally:
        await conn.close()


async def test_the_writer_plans_again_once_the_table_has_grown(url: str) -> None:
    # The write connection keeps one plan a statement. A plan made while the table held a
    # handful of rows, kept as it grows, walks every claimed item for one renewal (and
    # hashes the whole table for a round's ids): the writer drops its plans once the
    # table has doubled, and each is made again for the table as it is.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        writer = backend.writer
        writer.plan_check_seconds = float("inf")  # no look until this test asks for one
        await store.enqueue_many("p", [{"n": n} for n in range(3)])
        claim = await store.claim("w")
        assert claim is not None
        await store.renew(claim.item_id, fence=claim.fence)  # planned on a tiny table

        async def renewal_plan(conn: Any, now: float) -> str:
            name = await conn.fetchval(
                "SELECT name FROM pg_prepared_statements WHERE statement = $1", pg_sql.RENEW
            )
            explained = await conn.fetch(
                f"EXPLAIN (COSTS OFF) EXECUTE {name}(1e9, 1e9, {claim.item_id}, 1, NULL)"
            )
            return "\n".join(row[0] for row in explained)

        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "INSERT INTO items (project_id, state, payload, created_at, updated_at,"
                " lease_expires_at, owner, fence)"
                " SELECT 'p', 'claimed', '{}', 0, 0, 1e9, 'x', 1"
                " FROM generate_series(1, 20000)"
            )
        finally:
            await conn.close()
        before = await backend._write(renewal_plan)
        assert "items_pkey" not in before, before  # a walk of the claimed items, kept
        writer.plan_check_seconds = 0.0  # a look before the next round
        await store.renew(claim.item_id, fence=claim.fence)
        assert writer.replans == 1
        after = await backend._write(renewal_plan)
        assert "Index Cond: (item_id = $3)" in after, after
        await store.renew(claim.item_id, fence=claim.fence)
        assert writer.replans == 1  # not again until it doubles again


async def plans_as_the_table_grows(
    url: str,
    statements: dict[str, tuple[str, str]],
    fill: str,
    modes: tuple[str, ...] = ("force_generic_plan", "force_custom_plan"),
) -> AsyncIterator[tuple[str, list[Any], str, tuple[Any, ...]]]:
    """Each statement's rows and EXPLAIN ANALYZE plan in each of ``modes`` (the write
    connection's generic plans, by default, and custom ones), prepared (and a generic
    plan made) on the store as it is, then run after ``fill``, before and after the items
    and the projects are analysed: (name, rows, plan, what was seen). Run six times
    first, so that ``auto`` (the read connections') has chosen between its plans."""
    conn = await asyncpg.connect(url)
    try:
        for mode in modes:
            await conn.execute(f"SET plan_cache_mode = {mode}")
            for n, (statement, args) in enumerate(statements.values()):
                await conn.execute(f"PREPARE s{n}_{mode} AS {statement}")
                await conn.execute(f"EXECUTE s{n}_{mode}({args})")
        await conn.execute(fill)
        for analysed in (False, True):
            if analysed:
                await conn.execute("ANALYZE items; ANALYZE projects")
            for mode in modes:
                await conn.execute(f"SET plan_cache_mode = {mode}")
                for n, (name, (_, args)) in enumerate(statements.items()):
                    for _ in range(6):
                        rows = await conn.fetch(f"EXECUTE s{n}_{mode}({args})")
                    explained = await conn.fetch(
                        f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) EXECUTE s{n}_{mode}({args})"
                    )
                    plan = "\n".join(row[0] for row in explained)
                    yield name, list(rows), plan, (analysed, mode, name, plan)
    finally:
        await conn.close()


async def test_a_look_at_the_tables_size_that_fails_leaves_the_round_alone(url: str) -> None:
    # The look is the writer's own business: when it fails (here the table is locked by
    # another session, past the connection's lock_timeout), the round's requests run as
    # if it had not been made, and a later look tries again.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        writer = backend.writer

        async def impatient(conn: Any, now: float) -> None:
            await conn.execute("SET lock_timeout = '50ms'")

        await backend._write(impatient)
        locker = await asyncpg.connect(url)
        try:
            async with locker.transaction():
                await locker.execute("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
                writer.plan_check_seconds = 0.0  # a look before each round
                await store.create_project("q", "Q")  # the look timed out; the round ran
        finally:
            await locker.close()
        assert [p["project_id"] for p in await store.projects()] == ["p", "q"]
        assert writer.replans == 0


async def test_the_read_connections_are_replaced_as_the_writer_plans_again(url: str) -> None:
    # The read connections plan as PostgreSQL chooses (`auto`): after five runs of a
    # statement it may keep a generic plan, and one chosen on a tiny table is kept as the
    # writer's were (seen: counts() of a small project then walked the whole table, after
    # a dashboard's counts of the whole store on a new store). When the writer drops its
    # plans, the read connections are replaced, and plan afresh.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        backend: Any = await store._engine.ready()
        writer = backend.writer
        writer.plan_check_seconds = float("inf")  # no look until this test asks for one

        async def reader() -> int:
            [row] = await backend._fetch("SELECT pg_backend_pid()")
            return int(row[0])

        before = await reader()
        assert await reader() == before  # one read connection, reused
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "INSERT INTO items (project_id, state, payload, created_at, updated_at)"
                " SELECT 'p', 'done', '{}', 0, 0 FROM generate_series(1, 20000)"
            )
        finally:
            await conn.close()
        writer.plan_check_seconds = 0.0  # a look before the next round
        await store.create_project("q", "Q")
        assert writer.replans == 1
        after = await reader()
        assert after != before  # a fresh connection, with no plan made on a tiny table
        assert await store.counts(project_id="p") == {
            **dict.fromkeys(await store.counts(project_id="q"), 0),
            "done": 20000,
        }


def item_walks(plan: str, most: int = 100, table: str = "items") -> list[str]:
    """The lines of an EXPLAIN ANALYZE plan that read more items (or rows of ``table``)
    than a look needs: a scan of the table, or a scan of it yielding (or filtering out)
    more than ``most`` rows (an aggregate over a walk, or a walk for a few)."""
    walks, node, on = [], "", f" on {table}"
    for line in plan.splitlines():
        if " on " in line and ("Scan" in line or "Bitmap" in line):
            node = line
            read = re.search(r"actual rows=(\d+) loops=(\d+)", line)
            if on in line and ("Seq Scan" in line or (read and int(read[1]) * int(read[2]) > most)):
                walks.append(line.strip())
        elif "Rows Removed" in line and on in node and int(line.split(":")[1]) > most:
            walks.append(f"{node.strip()}: {line.strip()}")
    return walks


async def test_a_purge_passes_over_a_row_another_transaction_holds(
    url: str, asyncplane_clock: testing.ManualClock, tmp_path: pathlib.Path
) -> None:
    # A delete that waited for a held row (an item being requeued) would keep that row
    # locked to its commit after its check failed: a claim meanwhile passed the item by.
    archive = tmp_path / "archive.jsonl"
    async with ControlStore(url, clock=asyncplane_clock, archive_path=archive) as store:
        await store.create_project("p", "P")
        held, free = await store.enqueue_many("p", [{"n": 1}, {"n": 2}])
        for _ in range(2):
            claim = await store.claim("w")
            assert claim is not None
            await store.finish(claim.item_id, fence=claim.fence)
        asyncplane_clock.advance(10)
        other = await asyncpg.connect(url)
        try:
            holding = other.transaction()
            await holding.start()
            await other.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", held)
            summary = await asyncio.wait_for(store.purge(0), 30)  # not a wait for the row
            assert summary.purged == 1
            assert [i["item_id"] for i in await store.items(limit=10)] == [held]
            await holding.rollback()
        finally:
            await other.close()
        assert (await store.purge(0)).purged == 1  # archived again (a duplicate), gone now
        assert await store.items(limit=10) == [] and free
        # Held, first of all, in chunks of one: the purge goes on past it (the next one
        # tries it again), not reading and archiving the same chunk again and again.
        asyncplane_clock.advance(10)
        held, *_ = await store.enqueue_many("p", [{"n": n} for n in range(3, 6)])
        for _ in range(3):
            claim = await store.claim("w")
            assert claim is not None
            await store.finish(claim.item_id, fence=claim.fence)
            asyncplane_clock.advance(1)
        asyncplane_clock.advance(10)
        lines = len(archive.read_text().splitlines())
        other = await asyncpg.connect(url)
        try:
            holding = other.transaction()
            await holding.start()
            await other.execute("SELECT 1 FROM items WHERE item_id = $1 FOR KEY SHARE", held)
            summary = await asyncio.wait_for(store.purge(0, chunk=1), 30)
            assert (summary.purged, summary.chunks) == (2, 3)  # the two behind it too
            assert len(archive.read_text().splitlines()) == lines + 3  # each once
            assert [i["item_id"] for i in await store.items(limit=10)] == [held]
            await holding.rollback()
        finally:
            await other.close()


async def test_a_purge_reads_only_the_items_and_events_of_its_chunk(url: str) -> None:
    # A purge chunk's statements (the events of the items it archives, and the deletes)
    # read the chunk's items and events by id, planned on a table that has grown and was
    # never analysed (the writer, and the read connections, plan again as the table
    # doubles; autovacuum analyses it later, if ever). The events' look (a read
    # connection's, generic or custom) does so in a plan made on the near-empty table too.
    # (The delete's test that an item is settled took items_settled, every settled item;
    # the events' order took a walk of every event.)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.enqueue("p", {})
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)  # a handful of rows
    conn = await asyncpg.connect(url)
    modes = ("force_generic_plan", "force_custom_plan")
    try:
        for mode in modes:
            await conn.execute(f"SET plan_cache_mode = {mode}")
            await conn.execute(f"PREPARE early_{mode} AS {pg_sql.EVENTS_OF_ITEMS}")
            await conn.execute(f"EXECUTE early_{mode}('{{1}}')")
        await conn.execute(
            "INSERT INTO items (project_id, state, payload, created_at, updated_at)"
            " SELECT 'p', 'done', '{}', n, n FROM generate_series(1, 30000) AS n;"
            " INSERT INTO events (item_id, event_type, fence, at)"
            " SELECT item_id, kind, 0, 0"
            " FROM items, unnest(ARRAY['enqueued', 'claimed', 'done']) AS kind"
        )
        statements = {
            "events": pg_sql.EVENTS_OF_ITEMS,
            "purge items": pg_sql.PURGE_ITEMS,
            "standing as archived": pg_sql.STANDING_AS_ARCHIVED,
            "purge events": pg_sql.PURGE_EVENTS,
        }
        for mode in modes:
            await conn.execute(f"SET plan_cache_mode = {mode}")
            for name, statement in {"events, planned early": None, **statements}.items():
                prepared = f"early_{mode}" if statement is None else "late"
                tr = conn.transaction()
                await tr.start()
                try:
                    if statement is not None:
                        await conn.execute(f"PREPARE late AS {statement}")
                    chunk = [50, 60, 70]  # each as archived: fence 0, changed at its id - 1
                    if name == "purge events":  # (an item goes first, then its history)
                        gone = await conn.fetch(pg_sql.PURGE_ITEMS, chunk, [0] * 3, [49, 59, 69])
                        assert sorted(row[0] for row in gone) == chunk
                    args = (
                        "('{50,60,70}', '{0,0,0}', '{49,59,69}')"
                        if name in ("purge items", "standing as archived")
                        else "('{50,60,70}')"
                    )
                    explain = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) EXECUTE"
                    explained = await conn.fetch(f"{explain} {prepared}{args}")
                finally:
                    await tr.rollback()  # (nothing purged: each runs on the same store)
                    if statement is not None:
                        await conn.execute("DEALLOCATE late")
                plan = "\n".join(row[0] for row in explained)
                walks = item_walks(plan) + item_walks(plan, table="events")
                assert not walks, (mode, name, plan)
                if name in ("purge items", "standing as archived"):  # arrays read once
                    scans = [line for line in plan.split("\n") if "Function Scan" in line]
                    assert scans and all("loops=1)" in line for line in scans), (mode, plan)
    finally:
        await conn.close()


async def test_the_enqueue_look_for_twins_reads_only_the_contents_asked_for(url: str) -> None:
    # An enqueue of fingerprinted items looks for a twin of each: one probe a content,
    # whatever the plan, generic or custom, made on the empty table (as the write
    # connection's first enqueue makes it) or on a full one, analysed or not. Written as
    # `fingerprint = ANY(...)`, such plans read the whole project's part of the index (or
    # the table), so each enqueue cost the project's size: 108 to 476 µs an item over
    # 30,000 items.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.create_project("q", "Q")
        twin = await store.enqueue("p", {}, fingerprint="f7")
    asked = "{" + ",".join(["f7", *(f"h{n}" for n in range(500))]) + "}"
    fill = (
        "INSERT INTO items (project_id, state, payload, created_at, updated_at, fingerprint)"
        " SELECT CASE WHEN n % 10 = 0 THEN 'q' ELSE 'p' END, 'done', '{}', 0, 0, 'g' || n"
        " FROM generate_series(1, 20000) AS n"
    )
    statements = {"find": (pg_sql.FIND_TWINS, f"'p', '{asked}'")}
    async for _, rows, plan, seen in plans_as_the_table_grows(url, statements, fill):
        assert [tuple(row) for row in rows] == [("f7", twin)], seen
        assert not item_walks(plan), seen


#: What a content gathers: its history (runs done, or failed), or its backlog (twins
#: pending, enqueued with dedup off: a content enqueued faster than it runs).
GATHERED = {
    "history": "CASE WHEN n % 3 = 0 THEN 'failed' ELSE 'done' END",
    "backlog": "CASE WHEN n % 3 = 0 THEN 'ready' ELSE 'deferred' END",
}


@pytest.mark.parametrize("gathered", sorted(GATHERED))
async def test_a_look_at_a_contents_twins_never_reads_what_it_gathered(
    url: str, gathered: str
) -> None:
    # A content run again and again (dedup off, or a schedule's) gathers done twins, and
    # one that keeps failing gathers failed ones; one enqueued with dedup off faster than
    # it runs gathers a backlog of pending twins. Each look at a content's twins reads
    # the states it names only (the pending twins a done finish settles, the oldest done
    # or else live twin an enqueue takes, a noted pair's two sides), in any plan, made on
    # the empty table or not: 15,000 twins of each content, among 30,000 other contents,
    # cost nothing. (Looked up through items_fingerprint by content alone, each read
    # every twin there had been; by content alone among the live twins, the settle and
    # the pending side of a pair read every pending twin, dedup or not.)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        done = {}
        for content in ("again", "paired"):
            await store.enqueue("p", {}, fingerprint=content, dedup=False)
            claim = await store.claim("w")
            assert claim is not None
            await store.finish(claim.item_id, fence=claim.fence, result={"run": content})
            done[content] = claim.item_id
        live = await store.enqueue("p", {}, fingerprint="failing", dedup=False)
    [(pending,)] = await sql(
        url,
        "INSERT INTO items (project_id, state, payload, created_at, updated_at, fingerprint)"
        " VALUES ('p', 'ready', '{}', 0, 0, 'paired') RETURNING item_id",
    )
    [(note,)] = await sql(url, "SELECT note_id FROM twin_checks WHERE fingerprint = 'paired'")
    fill = (
        "INSERT INTO items"
        " (project_id, state, payload, created_at, updated_at, fingerprint, dedup)"
        f" SELECT 'p', {GATHERED[gathered]}, '{{}}', 0, 0,"
        " (ARRAY['failing', 'again', 'paired'])[n % 3 + 1], false"
        " FROM generate_series(1, 45000) AS n;"
        # and a store's many other contents, once each (as its statistics then show)
        " INSERT INTO items (project_id, state, payload, created_at, updated_at, fingerprint)"
        " SELECT 'p', 'done', '{}', 0, 0, 'other' || n FROM generate_series(1, 30000) AS n"
    )
    statements = {
        "find": (pg_sql.FIND_TWINS, "'p', '{again,failing,paired,new}'"),
        # (the statement asyncplane_settle_twins runs, planned as a function's are)
        "settle": (pg_sql.SETTLE_TWINS_12, "'p', 'again', 0, '{}', 0"),
        "pairs": (pg_sql.NOTED_TWIN_PAIRS, "500, '{p}', '{paired}'"),
        "forget": (pg_sql.FORGET_TWIN_NOTES, f"'{{{note}}}'"),
    }
    expected: dict[str, list[tuple[Any, ...]]] = {
        "find": [("again", done["again"]), ("failing", live), ("paired", done["paired"])],
        "settle": [],
        "pairs": [(pending, 0, done["paired"], '{"run":"paired"}')],
        "forget": [],
    }
    async for name, rows, plan, seen in plans_as_the_table_grows(url, statements, fill):
        assert sorted(tuple(row) for row in rows) == expected[name], seen
        assert not item_walks(plan), seen
    assert await sql(url, "SELECT 1 FROM twin_checks WHERE note_id = $1", note)  # pair stays


async def test_the_enqueue_look_never_walks_the_table_when_few_contents_recur(
    url: str,
) -> None:
    # A store where a handful of contents recur: statistics that saw few contents made
    # the planner walk the table in id order for "the first done twin", hoping to meet
    # the content at once, and read all of it for a content with none (migration 9).
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "INSERT INTO items"
            " (project_id, state, payload, created_at, updated_at, fingerprint, dedup)"
            " SELECT 'p', 'done', '{}', 0, 0, (ARRAY['a', 'b', 'c'])[n % 3 + 1], false"
            " FROM generate_series(1, 40000) AS n"
        )
        await conn.execute("ANALYZE items")
        for mode in ("force_generic_plan", "force_custom_plan"):
            await conn.execute(f"SET plan_cache_mode = {mode}")
            async with conn.transaction():
                await conn.execute(f"PREPARE find AS {pg_sql.FIND_TWINS}")
                explained = await conn.fetch(
                    "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) EXECUTE find('p', '{new,a}')"
                )
                await conn.execute("DEALLOCATE find")
            plan = "\n".join(row[0] for row in explained)
            assert not item_walks(plan), (mode, plan)
    finally:
        await conn.close()


async def items_entries_read(conn: asyncpg.Connection) -> int:
    """The rows and index entries of items this transaction has read (counted from the
    last ``pg_stat_force_next_flush()``)."""
    read = await conn.fetchval(
        "SELECT sum(pg_stat_get_xact_tuples_returned(c.oid))"
        " FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = current_schema() AND c.relname LIKE 'items%'"
    )
    return int(read)


@pytest.mark.parametrize(
    ("gathered", "states"),
    [("history", ("failed", "done")), ("backlog", ("ready", "deferred"))],
)
async def test_the_pair_triggers_never_read_what_a_content_gathered(
    url: str, gathered: str, states: tuple[str, str]
) -> None:
    # A twin arriving pending with dedup looks for a done twin, one arriving done (a
    # copy, an import) for a pending one enqueued with dedup: each reads those only,
    # beside 5,000 twins in each of two other states (its history, or its backlog
    # enqueued with dedup off). (The look by content alone read past every failed twin
    # to find a done one, and every done twin to find no pending one; the look by
    # content among the live twins read every pending twin enqueued with dedup off.)
    # And an item of a new content looks for any twin by content, never through the
    # store's settled items (items_settled), 20,000 of other contents.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
    columns = "(project_id, state, payload, created_at, updated_at, fingerprint, dedup)"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f"INSERT INTO items {columns} SELECT 'p', 'done', '{{}}', n, n, 'o' || n, false"
            " FROM generate_series(1, 20000) AS n"
        )
        for state in states:
            await conn.execute(
                f"INSERT INTO items {columns} SELECT 'p', '{state}', '{{}}', 0, 0, 'c', false"
                " FROM generate_series(1, 5000)"
            )
        await conn.execute("SELECT pg_stat_force_next_flush()")  # counting from here
        async with conn.transaction():
            for state, content in (("ready", "c"), ("done", "c"), ("ready", "new")):
                await conn.execute(
                    f"INSERT INTO items {columns}"
                    f" VALUES ('p', '{state}', '{{}}', 0, 0, '{content}', true)"
                )
            read = await items_entries_read(conn)
        assert read < 20, read
        # each noted its pair (in the backlog, the pending twin arriving has no done one)
        noted = {"history": 2, "backlog": 1}[gathered]
        assert await conn.fetchval("SELECT count(*) FROM twin_checks") == noted
    finally:
        await conn.close()


async def test_a_twin_costs_the_same_to_line_up_however_long_its_line(url: str) -> None:
    # The triggers that keep a content's line touch its claimable twin and its first held
    # one through their own indexes: a twin arriving ready, or the claimable one
    # cancelled, reads a handful of index entries beside 2,000 held twins.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.enqueue_many("p", [Job({}, fingerprint="c") for _ in range(3)], dedup=False)
    arrives = (
        "INSERT INTO items (project_id, state, payload, created_at, updated_at, fingerprint)"
        " VALUES ('p', 'ready', '{}', 0, 0, 'c')"
    )
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"{arrives}, " + ", ".join(["('p', 'ready', '{}', 0, 0, 'c')"] * 1999))
        await conn.execute("ANALYZE items")
        [(claimable,)] = await conn.fetch("SELECT item_id FROM items WHERE NOT held")
        for statement in (
            arrives,
            f"UPDATE items SET state = 'cancelled' WHERE item_id = {claimable}",
        ):
            await conn.execute("SELECT pg_stat_force_next_flush()")  # counting from here
            async with conn.transaction():
                await conn.execute(statement)
                read = await items_entries_read(conn)
                assert read < 20, (statement, read)
                in_front = "SELECT count(*) FROM items WHERE state = 'ready' AND NOT held"
                assert await conn.fetchval(in_front) == 1
    finally:
        await conn.close()


async def test_a_contents_deferred_twins_cost_nothing_to_its_line(url: str) -> None:
    # A content's deferred twins (due later, enqueued with dedup off) are not in its line:
    # a twin arriving ready, claimed, going back to ready, cancelled, reads a handful of
    # index entries beside 2,000 of them. (Migration 8's first look of the line's trigger
    # read every deferred twin for a twin arriving ready or going back to ready.)
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        await store.enqueue_many(
            "p", [Job({}, fingerprint="c", not_before=4e9) for _ in range(2000)], dedup=False
        )
    columns = "(project_id, state, payload, created_at, updated_at, fingerprint, dedup)"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("ANALYZE items")
        for statement in (
            f"INSERT INTO items {columns} VALUES ('p', 'ready', '{{}}', 0, 0, 'c', false)",
            "UPDATE items SET state = 'claimed' WHERE state = 'ready'",
            "UPDATE items SET state = 'ready' WHERE state = 'claimed'",
            "UPDATE items SET state = 'cancelled' WHERE state = 'ready'",
        ):
            await conn.execute("SELECT pg_stat_force_next_flush()")  # counting from here
            async with conn.transaction():  # (each committed: the next moves its row)
                await conn.execute(statement)
                read = await items_entries_read(conn)
            assert read < 20, (statement, read)
    finally:
        await conn.close()


async def test_counts_and_the_next_due_time_read_a_project_by_its_own_items(url: str) -> None:
    # counts() of one project (a dashboard's row each) and the next due time (each time a
    # claimer goes to sleep) read that project's part of an index, a probe of each
    # project's deferred items, and each project's claimed items: never the whole table,
    # nor the store's deferred items, nor its claimed items once a project. big holds
    # 50,000 deferred items due before small's (its first 2,000 held back by a running
    # twin), 50,000 ready and 5,000 claimed; 100 projects that sort before it hold none.
    async with ControlStore(url) as store:
        for project in ("big", "small"):
            await store.create_project(project, project)
        await store.enqueue("small", {}, not_before=4e9)
        await store.enqueue("small", {})
        claim = await store.claim("w", project_id="small", lease_seconds=600)
        assert claim is not None
        await store.enqueue("big", {}, fingerprint="g")
        assert await store.claim("w", project_id="big", lease_seconds=6000) is not None
    fill = (
        "INSERT INTO items (project_id, state, payload, created_at, updated_at, due_at,"
        " fingerprint)"
        " SELECT 'big', CASE WHEN n % 2 = 0 THEN 'deferred' ELSE 'ready' END, '{}', 0, 0,"
        " CASE WHEN n % 2 = 0 THEN 3e9 + n END, CASE WHEN n % 2 = 0 AND n <= 4000 THEN 'g' END"
        " FROM generate_series(1, 100000) AS n;"
        " INSERT INTO items (project_id, state, payload, created_at, updated_at,"
        " lease_expires_at, owner, fence)"
        " SELECT 'big', 'claimed', '{}', 0, 0, 3e9 + n, 'x', 1 FROM generate_series(1, 5000) AS n;"
        " INSERT INTO projects (project_id, name, status, created_at)"
        " SELECT 'a' || n, 'A', 'open', 0 FROM generate_series(1, 100) AS n"
    )
    statements = {
        "counts of small": (pg_sql.COUNT_STATES, "'small', NULL"),
        "next due of small": (pg_sql.NEXT_DUE, "'small', NULL"),
        "next due of a7": (pg_sql.NEXT_DUE, "'a7', NULL"),
        "next due of all": (pg_sql.NEXT_DUE, "NULL, NULL"),
    }
    # As the read connections plan (`auto`, which may choose a generic plan too; counts()
    # relies on custom ones, and on the connections' replacement as the table grows).
    modes = ("auto", "force_custom_plan", "force_generic_plan")
    lease = pytest.approx(claim.lease_expires_at.timestamp(), abs=1)
    async for name, rows, plan, seen in plans_as_the_table_grows(url, statements, fill, modes):
        if name == "counts of small" and seen[1] == "force_generic_plan":
            continue
        if name == "next due of all":  # big's own deferred and claimed items, once
            assert not item_walks(plan, 50_000 + 5_002 + 200), seen
        else:
            assert not item_walks(plan), seen
        if name == "counts of small":
            assert sorted(tuple(row) for row in rows) == [("claimed", 1), ("deferred", 1)]
        elif name == "next due of a7":
            assert rows[0][0] is None, seen
        else:  # small's lease lapses before any other lease or deferred item
            assert rows[0][0] == lease, seen


async def test_listings_keep_the_ids_byte_order_whatever_the_databases_collation(
    asyncplane_postgres_url: str, asyncplane_clock: testing.ManualClock
) -> None:
    # Sorted by a database's own collation (here ICU's en-US: "_x", "a", "A", "b", "B"),
    # a listing would differ from SQLite's, which compares bytes.
    server = urllib.parse.urlsplit(asyncplane_postgres_url)
    database = "asyncplane_collated"
    await sql(asyncplane_postgres_url, f"DROP DATABASE IF EXISTS {database}")
    await sql(
        asyncplane_postgres_url,
        f"CREATE DATABASE {database} TEMPLATE template0 LOCALE_PROVIDER icu "
        "ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'",
    )
    ids = ["b", "B", "_x", "a", "A"]
    try:
        where = urllib.parse.urlunsplit(server._replace(path=f"/{database}"))
        assert sorted(
            r[0] for r in await sql(where, "SELECT unnest($1::text[]) ORDER BY 1", ids)
        ) != [
            r[0] for r in await sql(where, "SELECT unnest($1::text[]) ORDER BY 1", ids)
        ]  # this database does not sort by bytes
        async with ControlStore(where, clock=asyncplane_clock) as store:
            for project in ids:
                await store.create_project(project, project)
                await store.set_limits(project, max_running=1)
                await store.set_schedule(project, project_id=project, payload={}, every=60)
                await store.enqueue(project, {"n": 1})
            while (claim := await store.claim("w")) is not None:
                await store.finish(claim.item_id, fence=claim.fence)
            asyncplane_clock.advance(60)
            assert await store.run_schedules() == len(ids)
            due = [c.project_id for c in await store.claim_batch("w", 10)]
            assert [p["project_id"] for p in await store.project_limits()] == sorted(ids)
            assert [s["name"] for s in await store.schedules()] == sorted(ids)
            assert [r["project_id"] for r in await store.settled_per_minute()] == sorted(ids)
            assert due == sorted(ids)  # the ticks enqueued in name order, claimed in id order
    finally:
        await sql(asyncplane_postgres_url, f"DROP DATABASE IF EXISTS {database}")


async def test_a_lapsed_item_whose_row_another_session_holds_makes_no_waiter_spin(
    url: str,
) -> None:
    # A host frozen inside a transaction holds a lapsed item's row: claims pass it by
    # (SKIP LOCKED), yet next_due still names its lapsed lease, in the past. A waiter told
    # a past time goes again at once, once; told the same past time again, it looks a
    # second later, not at once (it claimed some 850 times a second while the row was held).
    clock = ManualClock()
    async with ControlStore(url, clock=clock) as store:
        await store.create_project("alpha", "Alpha")
        item_id = await store.enqueue("alpha", {})
        assert await store.claim("frozen") is not None
        holder = await asyncpg.connect(url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", item_id)
                clock.advance(store.lease_seconds + 1)  # the lease lapses
                rounds = engine_of(store).backend.writer
                assert rounds is not None
                before = rounds.rounds
                got = await store.claim("w", wait=0.5, poll_interval=3600)
                assert got is None
                assert rounds.rounds - before <= 3, rounds.rounds - before
        finally:
            await holder.close()
        taken = await store.claim("w")  # let go: taken over, with a higher fence
        assert taken is not None and (taken.item_id, taken.fence) == (item_id, 2)


async def test_writes_queued_behind_a_round_whose_connection_is_lost_hear_storage_error(
    url: str,
) -> None:
    # Nobody closed the store: a write refused because its writer's connection was lost
    # hears StorageError, as the round's own callers do (StoreClosed is a close's; code
    # that retries on StorageError died on it), and the next call opens the store afresh.
    async with ControlStore(url) as store:
        await store.create_project("alpha", "Alpha")
        item_id = await store.enqueue("alpha", {})
        claim = await store.claim("w")
        assert claim is not None
        holder = await asyncpg.connect(url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", item_id)
                settling = asyncio.create_task(store.finish(item_id, fence=claim.fence))
                watcher = await asyncpg.connect(url)
                try:

                    async def the_round_waits() -> bool:
                        query = (
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        )
                        return bool(await watcher.fetchval(query))

                    await until(the_round_waits, what="the settle's round waits for the row")
                    queued = [
                        asyncio.create_task(store.enqueue("alpha", {"n": n})) for n in range(3)
                    ]
                    await until(
                        lambda: engine_of(store).backend.writer.requests_waiting == 3,  # type: ignore[union-attr]
                        what="the enqueues are queued behind it",
                    )
                    writer_pid = engine_of(store).backend.writer._conn.get_server_pid()  # type: ignore[union-attr]
                    await watcher.execute("SELECT pg_terminate_backend($1)", writer_pid)
                finally:
                    await watcher.close()
                outcomes = await asyncio.gather(settling, *queued, return_exceptions=True)
        finally:
            await holder.close()
        assert all(type(outcome) is StorageError for outcome in outcomes[1:]), outcomes
        assert isinstance(outcomes[0], StorageError), outcomes[0]
        assert await store.enqueue("alpha", {"after": True}) > item_id  # opened afresh


async def test_a_drain_on_a_schema_that_does_not_exist_fails_named_not_skipped(url: str) -> None:
    # The guard's key is the schema's name: with none, the try-lock answered NULL, read as
    # "another drainer holds it", and every drain quietly skipped.
    missing = testing.with_schema(url, "no_such_schema_here")

    async def execute(batch: list[Any]) -> list[Any]:
        return [Done() for _ in batch]

    store = ControlStore(missing)
    try:
        with pytest.raises(NotAnAsyncplaneDatabase, match="no schema to drain"):
            await drain(store, execute, mode="foreground")
    finally:
        await store.close()


@pytest.mark.parametrize("runtime", ["drain", "work"])
async def test_a_guard_lost_under_a_running_batch_stops_it_at_once(url: str, runtime: str) -> None:
    # The guard's session ends while an item runs (a failover, pg_terminate_backend):
    # another drainer may take the guard and run at once, so this one cancels its running
    # work and gives it back now, rather than when its batch is done (its executor ran on
    # for the batch's whole length beside the other's).
    async with ControlStore(url) as store:
        await store.create_project("alpha", "Alpha")
        item_id = await store.enqueue("alpha", {})
        started, stopped = asyncio.Event(), asyncio.Event()

        async def execute(batch: list[Any]) -> list[Any]:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                stopped.set()
            return []

        async def handle(claim: Any) -> Any:
            return (await execute([claim]))[0]

        running = asyncio.create_task(
            drain(store, execute, mode="daemon")
            if runtime == "drain"
            else work(store, handle, exclusive=True)
        )
        await asyncio.wait_for(started.wait(), 30)
        watcher = await asyncpg.connect(url)
        try:
            (pid,) = [
                row[0]
                for row in await watcher.fetch(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                )
            ]
            await watcher.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await watcher.close()
        with pytest.raises(DrainError, match="guard was lost"):
            await asyncio.wait_for(running, 30)
        assert stopped.is_set()
        again = await store.claim("other")
        assert again is not None and again.item_id == item_id  # back for the next drainer


async def test_a_listener_the_server_ended_is_replaced_on_the_next_call(url: str) -> None:
    # Without its listener every idle drainer polled for ever (a claim round each poll),
    # and the twins' wake-ups heard on it were lost: the store opens afresh instead.
    async with ControlStore(url) as store, ControlStore(url) as other:
        await store.create_project("alpha", "Alpha")
        engine = engine_of(store)
        backend: Any = await engine.ready()
        opens = engine.opens
        watcher = await asyncpg.connect(url)
        try:
            await watcher.execute(
                "SELECT pg_terminate_backend($1)", backend._listener.get_server_pid()
            )
        finally:
            await watcher.close()
        await until(lambda: backend.broken, what="the store saw its listener's session end")
        assert await store.counts() is not None  # the next call opens it afresh
        assert engine.opens == opens + 1 and not backend.broken
        # And a waiting claim hears another host's enqueue again (no poll for an hour).
        waiting = asyncio.create_task(store.claim("w", wait=3600, poll_interval=3600))
        await until(waiting_on("commit"), what="the claim waits")
        await other.enqueue("alpha", {})
        assert (await asyncio.wait_for(waiting, 30)) is not None


@contextlib.asynccontextmanager
async def _reads_queued_behind_a_lock(
    store: ControlStore, url: str, item_id: int
) -> AsyncIterator[tuple[asyncpg.Connection, list[asyncio.Task[Any]]]]:
    """Five reads of a store with one read connection: one waits for a table lock held by
    the connection given, the others for the pool. Closed (the lock let go) at the end."""
    holder = await asyncpg.connect(url)
    try:
        await holder.execute("BEGIN; LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
        reads = [asyncio.create_task(store.item(item_id)) for _ in range(5)]
        await until(
            lambda: _sessions_waiting_for_a_lock(holder),
            what="a read waits for the lock, the others for the pool",
        )
        yield holder, reads
    finally:
        await holder.close()


async def _sessions_waiting_for_a_lock(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"))


async def test_reads_queued_while_a_lost_listener_reopens_the_store(url: str) -> None:
    # Reads waiting for a connection of the pool the reopen closes hear a lost
    # connection's StorageError, as writes do, never StoreClosed: nobody closed the store.
    async with ControlStore(url, read_connections=1) as store:
        await store.create_project("alpha", "Alpha")
        item_id = await store.enqueue("alpha", {})
        engine = engine_of(store)
        backend: Any = await engine.ready()
        async with _reads_queued_behind_a_lock(store, url, item_id) as (holder, reads):
            await holder.execute(
                "SELECT pg_terminate_backend($1)", backend._listener.get_server_pid()
            )
            await until(lambda: backend.broken, what="the store saw its listener's session end")
            pool = backend._pool
            reopen = asyncio.create_task(store.counts())
            await until(pool.is_closing, what="the reopen closes the pool")
            await holder.execute("COMMIT")
            results = await asyncio.gather(*reads, reopen, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed, "every read was served: the test no longer queues one"
        assert all(type(r) is StorageError for r in failed), failed
        assert "nothing was read" in str(failed[0])
        assert await store.item(item_id) is not None  # and the next call is served


@pytest.mark.parametrize("listener_lost", [False, True])
async def test_reads_queued_while_the_store_closes_hear_it_closed(
    url: str, listener_lost: bool
) -> None:
    # Closed by the program, even one whose listener was lost before the next call could
    # open it afresh: StoreClosed.
    async with ControlStore(url, read_connections=1) as store:
        await store.create_project("alpha", "Alpha")
        item_id = await store.enqueue("alpha", {})
        backend: Any = await engine_of(store).ready()
        pool = backend._pool
        async with _reads_queued_behind_a_lock(store, url, item_id) as (holder, reads):
            if listener_lost:
                await holder.execute(
                    "SELECT pg_terminate_backend($1)", backend._listener.get_server_pid()
                )
                await until(lambda: backend.broken, what="the store saw its listener end")
            closing = asyncio.create_task(store.close())
            await until(pool.is_closing, what="the close closes the pool")
            await holder.execute("COMMIT")
            results = await asyncio.gather(*reads, closing, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed, "every read was served: the test no longer queues one"
        assert all(type(r) is StoreClosed for r in failed), failed


# --- found in a hunt: an unassignment racing an actor's write ------------------------------

_BLOCKERS = {
    # What holds the write up after its scope check: its event (a write of several
    # statements), or its item's row (one that waits in its UPDATE).
    "events": "LOCK TABLE events IN SHARE MODE",
    "item": "SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE",
}


@pytest.mark.parametrize(
    ("write", "blocker"),
    [
        ("enqueue", "events"),
        ("claim", "events"),
        ("cancel", "item"),
        ("cancel_where", "item"),
        ("finish", "item"),
        ("renew", "item"),
        ("retry", "item"),
        ("release", "item"),
    ],
)
async def test_unassign_waits_for_an_actor_write_that_passed_its_scope_check(
    url: str, write: str, blocker: str
) -> None:
    # The scope check read the assignment plainly: an actor's write that passed it and then
    # waited (on a row lock, say) committed after unassign() had returned, in the name of
    # an actor no longer assigned.
    async with ControlStore(url) as store, ControlStore(url) as operator:
        await store.create_project("alpha", "A")
        await store.create_project("beta", "B")
        await store.assign("alpha", "a1")
        await store.assign("beta", "a1")
        item = await store.enqueue("alpha", {"n": 1})
        claimed = ("finish", "renew", "retry", "release")
        claim = await store.claim("w", actor_id="a1") if write in claimed else None
        writes: dict[str, Callable[[], Awaitable[Any]]] = {
            "enqueue": lambda: store.enqueue("alpha", {"n": 2}, actor_id="a1"),
            # Two reaches in one round: the claim of several statements (one reach alone
            # is a single statement, held up before it reads anything).
            "claim": lambda: asyncio.gather(
                store.claim("w", actor_id="a1", project_id="alpha"),
                store.claim("w2", actor_id="a1", project_id="beta"),
            ),
            "cancel": lambda: store.cancel(item, actor_id="a1"),
            "cancel_where": lambda: store.cancel_where(state="ready", actor_id="a1"),
            "finish": lambda: store.finish(item, fence=claim.fence, actor_id="a1"),  # type: ignore[union-attr]
            "renew": lambda: store.renew(item, fence=claim.fence, actor_id="a1"),  # type: ignore[union-attr]
            "retry": lambda: store.retry(item, fence=claim.fence, actor_id="a1", error="e"),  # type: ignore[union-attr]
            "release": lambda: store.release(item, fence=claim.fence, actor_id="a1"),  # type: ignore[union-attr]
        }
        holder = await asyncpg.connect(url)
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute(_BLOCKERS[blocker], *((item,) if blocker == "item" else ()))

            async def waiting(count: int) -> bool:
                return await lock_waits(holder) >= count

            writing = asyncio.ensure_future(writes[write]())
            await until(lambda: waiting(1), what="the write held up after its check")
            unassigning = asyncio.ensure_future(operator.unassign("alpha", "a1"))
            await until(
                lambda: unassigning.done() or waiting(2), what="the unassign done, or waiting"
            )
            returned_first = unassigning.done()
            await held.commit()
            await writing
            await unassigning
        finally:
            await holder.close()
        assert not returned_first  # it waited for the write, which committed first
        assert await operator.visible_projects("a1") == ["beta"]
        assert await verify_ledger(store) == []


async def test_an_unassign_beside_other_writes_meets_no_deadlock(url: str) -> None:
    # An unassign ran in a round beside this process's other writes, whose row locks it
    # kept while its DELETE waited for another host's actor write; that write, holding the
    # assignment row, waited on one of those rows: a deadlock, broken after
    # deadlock_timeout (a second) and the round run again. An unassign has a round alone.
    async with ControlStore(url) as operator, ControlStore(url) as host:
        await operator.create_project("alpha", "A")
        await operator.assign("alpha", "a1")
        first, second = await operator.enqueue_many("alpha", [{"n": 1}, {"n": 2}])
        holder = await asyncpg.connect(url)
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", second)
            # One round: the first cancel locks its item, the second waits on the holder.
            operating = asyncio.gather(
                operator.cancel(first),
                operator.cancel(second),
                operator.unassign("alpha", "a1"),
            )
            await until(lambda: _waiting(holder, 1), what="the second cancel held up")
            # The other host's actor write: its scope check holds the assignment row,
            # then it waits on the first item's row, which the operator's round holds.
            acting = asyncio.ensure_future(host.cancel(first, actor_id="a1"))
            await until(lambda: _waiting(holder, 2), what="the actor's cancel held up")
            await held.commit()
            await asyncio.wait_for(operating, 60)
            # Its scope check passed before the unassign, and it committed first: it
            # finds the item cancelled by the operator (run again after a deadlock, it
            # found the project unassigned: ScopeDenied).
            assert await asyncio.wait_for(acting, 60) == "cancelled"
        finally:
            await holder.close()
        backends: list[Any] = [await store._engine.ready() for store in (operator, host)]
        assert sum(backend.writer.retried_rounds for backend in backends) == 0  # no deadlock
        assert await operator.visible_projects("a1") == []
        assert await verify_ledger(operator) == []


async def _waiting(conn: asyncpg.Connection, count: int) -> bool:
    return await lock_waits(conn) >= count


async def test_a_claim_takes_no_lapsed_item_of_a_project_unassigned_as_it_waited(
    url: str,
) -> None:
    # The claim's reach waited on the assignment row an unassign was deleting, and left
    # the project out once that committed; but its lapsed and exhausted arms read the
    # assignments from the statement's snapshot, from before the unassign, and took the
    # project's lapsed item in the name of an actor no longer assigned.
    clock = ManualClock()
    async with ControlStore(url, clock=clock) as store:
        await store.create_project("alpha", "A")
        await store.create_project("beta", "B")
        await store.assign("alpha", "a1")
        await store.assign("beta", "a1")
        await store.enqueue("alpha", {"n": 1})
        await store.enqueue("alpha", {"n": 2})
        for owner in ("w0", "w1"):
            assert await store.claim(owner, lease_seconds=1) is not None
        clock.advance(5)  # both lapsed
        taken = await store.claim("w2", actor_id="a1")  # the general claim, as reaches go
        assert taken is not None and taken.project_id == "alpha"
        unassigning = await asyncpg.connect(url)
        try:
            deleting = unassigning.transaction()
            await deleting.start()
            await unassigning.execute(
                "DELETE FROM assignments WHERE actor_id = 'a1' AND project_id = 'alpha'"
            )
            claiming = asyncio.ensure_future(store.claim("w3", actor_id="a1"))

            async def waiting() -> bool:
                return await lock_waits(unassigning) > 0

            await until(waiting, what="the claim waiting on the assignment row")
            await deleting.commit()
            assert await claiming is None  # beta has nothing; alpha is no longer a1's
        finally:
            await unassigning.close()
        assert await verify_ledger(store) == []


def test_a_big_settle_takes_no_lock_table_entry_for_each_item() -> None:
    # The settle's trigger took an advisory lock for each item it settled, each an entry
    # of the server's shared lock table to the commit: a cancel_where of 25,000 items (a
    # finish settling as many twins) failed "out of shared memory", as here with a small
    # table (a few hundred entries) and 1,000.
    with testing.PostgresCluster(
        settings={"max_locks_per_transaction": "10", "max_connections": "20"}
    ) as cluster:

        async def scenario() -> None:
            async with ControlStore(cluster.url()) as store:
                await store.create_project("p", "P")
                await store.enqueue_many("p", [{"n": n} for n in range(1000)])
                awaited = await store.enqueue("p", {"awaited": True})
                waiting = asyncio.ensure_future(store.wait(awaited, poll_interval=3600))
                marks = "SELECT count(*) FROM awaited"
                await until(lambda: _first(cluster.url(), marks), what="the waiter's mark")
                assert await store.cancel_where(project_id="p", chunk=5000) == 1001
                # Still told by its settle's notification (the poll is an hour away).
                assert (await asyncio.wait_for(waiting, 60))["state"] == "cancelled"
                assert await verify_ledger(store) == []

        asyncio.run(scenario())


def test_an_enqueue_of_many_contents_takes_a_bounded_number_of_locks() -> None:
    # Each content's enqueue lock took an entry of the server's shared lock table: an
    # enqueue_many of 30,000 fingerprints failed "out of shared memory", as here with a
    # small table and 2,000; dedup still holds, against itself and a second store.
    with testing.PostgresCluster(
        settings={"max_locks_per_transaction": "10", "max_connections": "20"}
    ) as cluster:

        async def scenario() -> None:
            async with ControlStore(cluster.url()) as store, ControlStore(cluster.url()) as other:
                await store.create_project("p", "P")
                jobs = [Job({"n": n}, fingerprint=f"f{n}") for n in range(2000)]
                first, again = await asyncio.gather(
                    store.enqueue_many("p", jobs), other.enqueue_many("p", jobs)
                )
                assert first == again  # one item a content: the second found the first's
                assert len(set(first)) == 2000
                few = await asyncio.gather(
                    *(store.enqueue("p", {"n": n}, fingerprint=f"f{n}") for n in range(10))
                )
                assert few == first[:10]
                # Many callers' batches in one round, each small: the round goes by shards,
                # and none of them takes its contents' locks besides (each did).
                more = [Job({"n": n}, fingerprint=f"g{n}") for n in range(1800)]
                batches = await asyncio.gather(
                    *(store.enqueue_many("p", more[i : i + 150]) for i in range(0, 1800, 150))
                )
                assert len({i for batch in batches for i in batch}) == 1800
                assert await verify_ledger(store) == []

        asyncio.run(scenario())


async def _first(url: str, query: str) -> Any:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def test_a_read_only_stores_wait_hears_a_settle_at_the_safety_look(url: str) -> None:
    # A read-only store writes no mark, so no settle notifies it: its waits were to hear
    # settles at the 5 s safety look, but looked only every poll_interval (an hour here).
    async with ControlStore(url) as store, ControlStore(url, read_only=True) as reader:
        await store.create_project("p", "P")
        item = await store.enqueue("p", {"n": 1})
        waiting = asyncio.ensure_future(reader.wait(item, poll_interval=3600))

        def asleep() -> bool:  # its first look made: it sleeps on its watch
            return any(t.get_name() == "asyncplane-settles-local" for t in asyncio.all_tasks())

        await until(asleep, what="the wait asleep")
        claim = await store.claim("w")
        assert claim is not None
        await store.finish(claim.item_id, fence=claim.fence)
        assert (await asyncio.wait_for(waiting, 30))["state"] == "done"


async def test_a_waiters_mark_waits_for_no_settle_of_another_item(url: str) -> None:
    # Migration 16's first version ordered a mark and a settle by a lock one of 64 by item
    # id: a wait() stood behind an open settle of any item of its share (and the round it
    # marked in, and the writes behind that), and deadlocked with such settles.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        ids = await store.enqueue_many("p", [{"n": n} for n in range(65)])
        held, awaited = ids[0], ids[64]  # one share of 64 by id, whatever the ids
        assert held % 64 == awaited % 64
        settling = await asyncpg.connect(url)
        try:
            async with settling.transaction():  # another's settle of held, not committed
                await settling.execute(
                    "UPDATE items SET state = 'cancelled', fence = fence + 1 "
                    "WHERE item_id = $1", held,
                )  # fmt: skip
                waiting = asyncio.ensure_future(store.wait(awaited, poll_interval=3600))
                await asyncio.wait_for(store.enqueue("p", {"after": True}), 10)
                claim = await asyncio.wait_for(store.claim("w"), 10)
                assert claim is not None and claim.item_id != held
                await store.finish(claim.item_id, fence=claim.fence)
                if claim.item_id == awaited:
                    assert (await asyncio.wait_for(waiting, 10))["state"] == "done"
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                await settling.execute("SELECT 1")  # (its transaction rolls back)
                raise _Rollback
        except _Rollback:
            pass
        finally:
            await settling.close()


class _Rollback(Exception):
    """Leaves a transaction block so that it rolls back."""


@pytest.mark.parametrize("runtime", ["drain", "work"])
def test_a_runtime_cancelled_as_its_claims_answer_is_lost_gives_the_claim_back(
    runtime: str,
) -> None:
    # The claim's commit was saved but its answer lost (the session ended while COMMIT
    # waited), with a cancel already come: to_the_end raises the cancel, the loss its
    # cause, which the runtimes' CommitOutcomeUnknown handlers never saw. Its items stayed
    # claimed, unrun, and with one attempt failed once their leases lapsed.
    with testing.PostgresCluster(settings={"synchronous_commit": "on"}) as cluster:

        async def scenario() -> None:
            url = cluster.url()
            async with ControlStore(url, lease_seconds=600) as store:
                await store.create_project("p", "P")
                await store.enqueue_many("p", [Job({"n": n}, max_attempts=1) for n in range(3)])
                backend: Any = await store._engine.ready()
                writer = backend.writer._conn.get_server_pid()
                admin = await asyncpg.connect(url)
                ran: list[int] = []

                async def execute(batch: list[Any]) -> list[Any]:
                    ran.extend(claim.item_id for claim in batch)
                    return [Done() for _ in batch]

                async def handle(claim: Any) -> Any:
                    ran.append(claim.item_id)
                    return Done()

                try:
                    await admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nosuch'")
                    await admin.execute("SELECT pg_reload_conf()")
                    running = asyncio.ensure_future(
                        drain(store, execute, mode="daemon")
                        if runtime == "drain"
                        else work(store, handle, concurrency=4)
                    )

                    async def committing() -> bool:  # the claim's COMMIT waits, saved here
                        return bool(
                            await admin.fetchval(
                                "SELECT count(*) FROM pg_stat_activity "
                                "WHERE pid = $1 AND wait_event = 'SyncRep'",
                                writer,
                            )
                        )

                    await until(committing, what="the claim's commit waiting")
                    running.cancel()
                    await admin.execute("SELECT pg_terminate_backend($1)", writer)
                    await admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
                    await admin.execute("SELECT pg_reload_conf()")
                    with pytest.raises(asyncio.CancelledError):
                        await asyncio.wait_for(running, 60)
                finally:
                    await admin.close()
                assert ran == []
                assert (await store.counts()).get("claimed", 0) == 0  # given back, not kept
                assert await verify_ledger(store) == []

        asyncio.run(scenario())


async def test_an_idle_daemon_whose_listener_is_lost_hears_other_hosts_soon(url: str) -> None:
    # What another host's commit notified while the listener was gone was lost, and the
    # waiting daemon looked again only at its poll interval (an hour here).
    async with ControlStore(url) as store, ControlStore(url) as other:
        await store.create_project("p", "P")
        done: list[int] = []

        async def execute(batch: list[Any]) -> list[Any]:
            done.extend(claim.item_id for claim in batch)
            return [Done() for _ in batch]

        draining = asyncio.ensure_future(drain(store, execute, mode="daemon", poll_interval=3600))
        try:
            await until(waiting_on("commit"), what="the daemon idle")
            backend: Any = await store._engine.ready()
            listener = backend._listener.get_server_pid()
            await sql(url, "SELECT pg_terminate_backend($1)", listener)
            item = await other.enqueue("p", {"n": 1})
            await until(lambda: done == [item], what="the other host's item drained")
        finally:
            draining.cancel()
            await asyncio.gather(draining, return_exceptions=True)


async def test_a_first_wait_waits_for_a_settle_under_way_and_holds_no_claimable_item(
    url: str,
) -> None:
    # A settle that looked for marks before a waiter's mark was there notifies nobody: the
    # waiter reads its item's row FOR SHARE once its mark has committed, so waits for that
    # settle to commit (migration 16; untested, it could be dropped unseen). A ready item's
    # row it does not hold: a claim passing it then skipped it, and the drainers slept.
    async with ControlStore(url) as store:
        await store.create_project("p", "P")
        running, ready = await store.enqueue_many("p", [{"n": 1}, {"n": 2}])
        claim = await store.claim("w")
        assert claim is not None and claim.item_id == running
        settling = await asyncpg.connect(url)
        watcher = await asyncpg.connect(url)
        try:
            async with settling.transaction():  # its trigger looks now: no mark yet
                await settling.execute(
                    "UPDATE items SET state = 'done' WHERE item_id = $1", running
                )
                waiting = asyncio.ensure_future(store.wait(running, poll_interval=3600))

                async def held_up() -> bool:
                    return await lock_waits(watcher) > 0

                await until(held_up, what="the first wait held up by the settle under way")
            assert (await asyncio.wait_for(waiting, 30))["state"] == "done"
            async with settling.transaction():  # a claimer holding the ready item
                await settling.execute("SELECT 1 FROM items WHERE item_id = $1 FOR UPDATE", ready)
                ready_wait = asyncio.ensure_future(store.wait(ready, poll_interval=3600))

                def asleep() -> bool:  # its mark made, and no row of it held: on its watch
                    return any(
                        t.get_name() == "asyncplane-settles-local" for t in asyncio.all_tasks()
                    )

                await until(asleep, what="the wait on the ready item asleep")
            ready_wait.cancel()
            await asyncio.gather(ready_wait, return_exceptions=True)
        finally:
            await settling.close()
            await watcher.close()
