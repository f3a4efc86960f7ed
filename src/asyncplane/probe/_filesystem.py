"""Which file system a store's path is on, and whether SQLite's WAL is safe there."""

from __future__ import annotations

import os
import re

from asyncplane import (
    _engine,
)
from asyncplane.probe._report import NETWORK_FILESYSTEMS

# --- the filesystem check ------------------------------------------------------------------


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding ``path`` (Linux: from /proc/self/mountinfo).

    Returns "" where it cannot be told, and "postgresql" for a database URL.
    """
    if _engine.is_postgres_url(path):
        return "postgresql"
    target = os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            return filesystem_in_mountinfo(mounts.read(), target)
    except OSError:
        return ""


def filesystem_in_mountinfo(mountinfo: str, target: str) -> str:
    """The filesystem type of the deepest mount holding ``target``, per a mountinfo text."""
    best, best_type = "", ""
    for line in mountinfo.splitlines():
        # id parent major:minor root mount-point options ... - fstype source super-options
        before, _, after = line.partition(" - ")
        fields = before.split()
        if len(fields) < 5 or not after:
            continue
        mount_point = _unescaped(fields[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, after.split()[0]
    return best_type


def _unescaped(field: str) -> str:
    """A mountinfo path as it is: the kernel writes a space, a tab, a newline and a
    backslash in it as octal escapes (\\040, \\011, \\012, \\134)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def network_filesystem_warning(path: str | os.PathLike[str], filesystem: str) -> str | None:
    """The warning to print before a run on a network filesystem, or None."""
    if filesystem not in NETWORK_FILESYSTEMS:
        return None
    return (
        f"WARNING: {os.fspath(path)} is on a {filesystem} network filesystem. SQLite's WAL "
        "mode needs every process on one host sharing memory, so on a network filesystem "
        "it is not safe, whatever this probe reports. Use a local disk, or a server database."
    )
