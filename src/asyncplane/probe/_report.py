"""What a probe run found, and the names of its scenarios and roles."""

from __future__ import annotations

import dataclasses
from typing import Any

SCENARIOS = ("concurrent-queue", "kill-and-reclaim", "chaos", "stall")
ROLES = ("all", "coordinator", "worker")
#: Scenarios whose workers may run on other hosts (``--role``).
SPREADABLE = ("concurrent-queue", "chaos")

#: File systems on which SQLite's WAL mode is not safe (its shared-memory index needs one
#: host's memory), or whose locking is not to be trusted.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "9p", "afs", "ceph",
        "glusterfs", "fuse.glusterfs", "lustre", "gpfs", "ocfs2", "gfs2", "fuse.sshfs",
        "sshfs", "davfs", "fuse.davfs2", "fuse.s3fs", "fuse.rclone", "fuse.gcsfuse",
        "fuse.juicefs", "beegfs", "orangefs", "pvfs2",
    }
)  # fmt: skip

_KILL_EVERY_SECONDS = 0.2
_PROJECT = "probe"


@dataclasses.dataclass
class ProbeReport:
    """What a probe run counted; ``passed`` only when every count is what it must be."""

    scenario: str
    workers: int
    items: int
    concurrency: int
    synchronous: str
    lease_seconds: float
    seconds: float = 0.0
    #: Seconds from the first worker's start to every worker ready (warm), not timed.
    startup_s: float = 0.0
    #: Seconds from the last worker's summary (its drain over) to every worker exited:
    #: closing stores and interpreters, not timed (concurrent-queue, and a worker host's).
    shutdown_s: float = 0.0
    items_per_s: float = 0.0
    duplicates: int = 0
    lost: int = 0
    locked_errors: int = 0
    fence_rejections: int = 0
    expected_fence_rejections: int = 0
    ledger_problems: int = 0
    per_worker_min: int = 0
    per_worker_max: int = 0
    max_lock_wait_s: float = 0.0
    #: CPU seconds the workers spent from their go line to their summary (start-up not
    #: counted), all workers together: those that said a summary (a killed one cannot).
    worker_cpu_s: float = 0.0
    #: The items the workers that said a summary finished: what ``worker_cpu_s`` and
    #: ``lock_held_s`` are per (all of them, unless a worker was killed).
    summarised_items: int = 0
    #: The worst worker's 99th percentile claim latency, in seconds.
    claim_p99_s: float = 0.0
    #: Seconds the workers held SQLite's write lock, all together: over the drain's
    #: seconds, how busy the lock was.
    lock_held_s: float = 0.0
    #: The event loop the workers ran on ("uvloop", "asyncio"; both, comma-separated, if
    #: they differed; "" where the scenario does not tally its workers).
    event_loop: str = ""
    role: str = "all"
    kills: int = 0
    re_executions: int = 0
    worker_crashes: int = 0
    filesystem: str = ""
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no count is wrong."""
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON values (``passed`` included)."""
        return {**dataclasses.asdict(self), "passed": self.passed}

    def expect(self, name: str, value: int, must_be: int) -> None:
        """Record a failure unless ``value`` is exactly ``must_be``."""
        if value != must_be:
            self.failures.append(f"{name} is {value}, must be {must_be}")
