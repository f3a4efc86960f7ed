"""The qualification probe: does SQLite hold up on *this* disk, with separate processes?

    python -m asyncplane.probe --store PATH --scenario concurrent-queue --workers 16 --items 10000
    python -m asyncplane.probe --store PATH --scenario kill-and-reclaim
    python -m asyncplane.probe --store PATH --scenario chaos --workers 16 --items 10000
    python -m asyncplane.probe --store PATH --scenario stall

Threads or coroutines in one interpreter share a connection pool and a GIL, and pass where
the deployed shape fails; so every worker here is a separate interpreter
(`asyncplane._probe_worker`), started fresh (never forked from a running event loop), with
its own ControlStore on the file. The probe exits 0 only when every count is exactly what
it must be (no duplicate claim, no lost item, no "database is locked", a clean ledger) and
1 otherwise, naming each count that is wrong. If it fails on the disk you deploy on, the
answer is a server database, not a retry loop that hides an unsuitable substrate.

Scenarios:

``concurrent-queue``
    Enqueue the items, start the workers, each with ``--concurrency`` claiming coroutines,
    and drain the queue. Duplicates are counted from the workers' own records and from the
    ledger; lost items from the rows.
``kill-and-reclaim``
    A worker claims an item and is killed (SIGKILL) mid-work. Once the lease lapses another
    worker reclaims it with a higher fence and finishes it; a stand-in for the dead worker
    then reports with the old fence and must be refused; exactly one terminal event.
``chaos``
    ``concurrent-queue`` with short leases while a random worker is killed and respawned
    every 200 ms: nothing lost, nothing settled twice, a clean ledger.
``stall``
    A worker holding an item is stopped (SIGSTOP) for longer than its lease, then resumed
    (SIGCONT); by then the item was taken over and finished, so its report must be fenced
    out; exactly one terminal event.

On PostgreSQL (``--store postgresql://...``, a fresh schema) the same scenarios run, and
``concurrent-queue`` and ``chaos`` can span hosts: ``--role coordinator`` seeds the items,
waits for the queue to drain and checks every count from the database; ``--role worker``,
started on as many hosts as you like, runs ``--workers`` local worker processes against
the seeded store until it is drained and checks what they reported. Without ``--role``,
one command does both on this host.
"""

from __future__ import annotations

from asyncplane.probe._cli import main, run_probe
from asyncplane.probe._filesystem import (
    filesystem_in_mountinfo,
    filesystem_of,
    network_filesystem_warning,
)
from asyncplane.probe._report import NETWORK_FILESYSTEMS, SCENARIOS, ProbeReport

__all__ = (
    "NETWORK_FILESYSTEMS",
    "SCENARIOS",
    "ProbeReport",
    "filesystem_in_mountinfo",
    "filesystem_of",
    "main",
    "network_filesystem_warning",
    "run_probe",
)
