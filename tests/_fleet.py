"""Running a fleet of worker processes at once: each opens its own store, says "ready",
and starts when every one has (a line on stdin), so they really run side by side."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

WORKERS = pathlib.Path(__file__).parent / "workers"
#: The event loop asyncplane's commands choose by themselves in this suite: uvloop, which
#: the test extra installs (`asyncplane._loops`; no Windows build).
COMMAND_LOOP = "asyncio" if sys.platform == "win32" else "uvloop"


def run_fleet(script: str, argvs: list[list[str]], *, timeout: float = 300) -> list[dict[str, Any]]:
    """Start ``workers/<script>`` once per argv, let them all go at once, wait for every one
    to end (each must exit 0); return the JSON line each printed last."""
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / script), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            line = worker.stdout.readline().strip()
            assert line == "ready", (line, worker.stderr.read() if worker.stderr else "")
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        outputs = [worker.communicate(timeout=timeout) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    summaries = []
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    return summaries


class FileClock:
    """A clock a fleet shares: the time last written to a file (`set`, which replaces the
    file whole, so a reader never sees half a number)."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = path

    def set(self, when: float) -> None:
        part = self._path.with_name(self._path.name + ".part")
        part.write_text(repr(when))
        os.replace(part, self._path)

    def now(self) -> float:
        return float(self._path.read_text())

    async def wait_until(self, when: float) -> None:
        # Another process moves it: there is no signal to wait on, only the file to read.
        while self.now() < when:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
