"""The raw sqlite3 baseline the benchmarks compare asyncplane with.

One plain connection, one BEGIN IMMEDIATE transaction per claim and one per finish, each
writing its event row, on asyncplane's own schema (so indexes and triggers are the same):
the fastest honest way to do by hand what the store does.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import time
from typing import Any

# The store's claim order, from the same index: a fair baseline walks it as the store does
# (the benchmarks that use it hold one project).
CLAIM = """
UPDATE items SET state = 'claimed', fence = fence + 1, attempts = attempts + 1,
                 owner = ?, lease_expires_at = ?, updated_at = ?
WHERE item_id = (SELECT item_id FROM items INDEXED BY items_claim
                 WHERE project_id = (SELECT project_id FROM projects LIMIT 1)
                   AND state = 'ready' AND held = 0
                 ORDER BY priority DESC, service_class, sla IS NULL, sla, item_id LIMIT 1)
RETURNING item_id, fence
"""
FINISH = """
UPDATE items SET state = 'done', lease_expires_at = NULL, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
"""
EVENT = (
    "INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail) "
    "VALUES (?, ?, ?, ?, NULL, ?, NULL)"
)


def start_together(procs: list[subprocess.Popen[str]]) -> float:
    """Wait until every worker process says "ready", then start them all at once (a
    "go" line each): the clock's reading at the start (start-up is not timed)."""
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    started = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    return started


def go_and_wait(
    procs: list[subprocess.Popen[str]], missing: str | None = None
) -> tuple[list[dict[str, Any]], float]:
    """`start_together`, then each one's line of JSON, said as its drain ends (``missing``
    for one that said nothing): the results, and the seconds from the start until the last
    of them was said. What a worker does after it (closing, its interpreter's teardown)
    is not timed, as the probe does not time its workers' shut-down (``shutdown_s``), and
    it waits for an "exit" line (`hold_until_told`), said once every result is in, so
    that it never takes the CPU from a worker still draining, as the probe's workers
    wait for theirs."""
    started = start_together(procs)
    said = [_said(proc) for proc in procs]
    drained = time.perf_counter()
    for proc in procs:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # one that ended without its line (a broken pipe)
            proc.stdin.write("exit\n")
            proc.stdin.flush()
    for proc in procs:
        proc.communicate()
    return [json.loads(line or missing or "") for line in said], drained - started


def hold_until_told() -> None:
    """A worker's wait, its result line said, for `go_and_wait`'s "exit" line, before it
    closes anything or exits (asynchronous workers read the line in a thread)."""
    sys.stdin.readline()


def _said(proc: subprocess.Popen[str]) -> str:
    """The worker's line of JSON, read as soon as it is said ("" if it ended without one)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.lstrip().startswith("{"):
            return line
    return ""


def drain_figures(
    procs: list[subprocess.Popen[str]], items: int, label: str,
    worst: tuple[str, str] = ("longest", "max_lock_wait_s"),
) -> dict[str, float]:  # fmt: skip
    """Run workers that each end with ``{"done", "longest", "cpu"}`` (see `drain`) to the
    end: the rate, the least busy worker, the worst wait (``worst``: the workers' key and
    the figure's; the longest lock wait by default), the CPU seconds."""
    results, seconds = go_and_wait(procs)
    done = sum(r["done"] for r in results)
    if done != items:
        raise SystemExit(f"{label}: the workers finished {done} of {items} items")
    return {
        "items_per_s": items / seconds,
        "per_worker_min": min(r["done"] for r in results),
        worst[1]: max(r[worst[0]] for r in results),
        "cpu_s": sum(r["cpu"] for r in results),
    }


def cpu_seconds() -> float:
    """CPU time this process has used so far (user and system, every thread)."""
    return time.process_time()  # every thread's, at the clock's own resolution


def drain(conn: sqlite3.Connection, owner: str) -> tuple[int, float]:
    """Claim and finish until the queue is empty: (items done, longest lock wait in s)."""
    done, longest = 0, 0.0
    while True:
        asked = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        longest = max(longest, time.perf_counter() - asked)
        now = time.time()
        rows = conn.execute(CLAIM, (owner, now + 900, now)).fetchall()
        if not rows:
            conn.execute("COMMIT")
            return done, longest
        item_id, fence = rows[0]
        conn.execute(EVENT, (item_id, "claimed", fence, owner, now))
        conn.execute("COMMIT")
        asked = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        longest = max(longest, time.perf_counter() - asked)
        now = time.time()
        conn.execute(FINISH, (now, item_id, fence))
        conn.execute(EVENT, (item_id, "done", fence, owner, now))
        conn.execute("COMMIT")
        done += 1


def connect(path: str, synchronous: str) -> sqlite3.Connection:
    """A plain autocommit connection with the store's settings."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    return conn


def seed(path: str, project: str, items: int) -> None:
    """Add ready items, each with its "queued" event, in one transaction."""
    conn = sqlite3.connect(path, isolation_level=None)
    now = time.time()
    conn.execute("BEGIN IMMEDIATE")
    for n in range(items):
        (item_id,) = conn.execute(
            "INSERT INTO items (project_id, state, payload, created_at, updated_at) "
            "VALUES (?, 'ready', ?, ?, ?) RETURNING item_id",
            (project, f'{{"n": {n}}}', now, now),
        ).fetchone()
        conn.execute(EVENT, (item_id, "queued", 0, None, now))
    conn.execute("COMMIT")
    conn.close()
