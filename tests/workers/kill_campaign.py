"""The SIGKILL campaign: client processes killed at random moments, then the checker.

`run_campaign` seeds a store (project "kill"), starts ``workers`` client processes
(tests/workers/kill_worker.py), and ``kills`` times picks one at random (seeded), lets it
complete a random number of operations (it prints "op" after each), waits a random
instant more, SIGKILLs it and starts a replacement with a new seed and a new
acknowledgement log. Then it kills the rest, runs one final client that settles
everything left (so an item that can never be settled shows up as stuck), and checks the
logs against the store and its archive with `kill_check.check`.

Used by tests/test_faults_kill.py and scripts/fault_campaign.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import random
import signal
import sys
import time
from typing import BinaryIO

import kill_check

from asyncplane import ControlStore, ProjectExists

__all__ = ("WORKER", "CampaignResult", "run_campaign")

WORKER = pathlib.Path(__file__).with_name("kill_worker.py")


@dataclasses.dataclass
class CampaignResult:
    """What one campaign did and what the checker found."""

    backend: str
    seed: int
    kills: int
    seconds: float
    report: kill_check.KillReport
    #: Clients that exited without being killed, with their stderr.
    crashes: list[str] = dataclasses.field(default_factory=list)
    #: Victims that did not reach their operation count in time (killed anyway).
    stalls: int = 0
    #: The final client's last line: "clear", or "stuck" with the counts.
    final: str = ""

    def failures(self) -> list[str]:
        found = self.report.failures()
        found += [f"crashed: {crash}" for crash in self.crashes]
        if self.stalls:
            found.append(f"{self.stalls} clients made no progress before the deadline")
        if self.final != "clear":
            found.append(f"the final client did not settle everything: {self.final!r}")
        return found

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.report.counts().items())
        head = (
            f"{self.backend} seed {self.seed}: {self.kills} kills in {self.seconds:.1f} s "
            f"({self.stalls} stalls); {counts}; states {self.report.states}"
        )
        return "\n".join([head, *self.failures()[:40]])


class _Client:
    """One worker process, its progress read from its stdout."""

    def __init__(self, process: asyncio.subprocess.Process, name: str, stderr: pathlib.Path):
        self.process = process
        self.name = name
        self.stderr = stderr
        self.ready = asyncio.Event()
        self.progress = 0
        self.last = ""
        self.ended = False
        self.killed = False
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read(), name=f"kill-reader[{name}]")

    async def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            async for raw in self.process.stdout:
                line = raw.decode(errors="replace").strip()
                if line == "ready":
                    self.ready.set()
                elif line == "op":
                    self.progress += 1
                elif line:
                    self.last = line
                self._changed.set()
        finally:
            self.ended = True
            self._changed.set()

    async def wait_for(self, progress: int, deadline: float) -> bool:
        """Until it has completed ``progress`` operations in all; False on the deadline
        or if it ended first."""
        while self.progress < progress and not self.ended:
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.progress >= progress

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
        await self.reap()

    async def reap(self) -> None:
        await self.process.wait()
        await self._reader  # to the pipe's end: nothing is left open

    def crash(self) -> str | None:
        """Why it ended, if it ended without being killed (or failed its final job)."""
        code = self.process.returncode
        if self.killed and code == -signal.SIGKILL:
            return None
        if code == 0 and not self.killed:
            return None
        tail = self.stderr.read_text(errors="replace")[-3000:] if self.stderr.exists() else ""
        return f"{self.name} exited with {code}: {tail.strip()}"


def _opened(path: pathlib.Path) -> BinaryIO:
    """A client's stderr file (and the directories of its logs): quick local file work."""
    (path.parent / "acks").mkdir(parents=True, exist_ok=True)
    return open(path, "wb")


async def _spawn(
    location: str, workdir: pathlib.Path, name: str, seed: int, *extra: str
) -> _Client:
    acks, stderr = workdir / "acks", workdir / f"{name}.stderr"
    with _opened(stderr) as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            location,
            str(acks / f"{name}.acks.jsonl"),
            str(seed),
            "--archive",
            str(workdir / "archive.jsonl"),
            *extra,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
        )
    return _Client(process, name, stderr)


async def run_campaign(
    location: str,
    workdir: pathlib.Path,
    *,
    workers: int = 4,
    kills: int = 12,
    seed: int = 0,
    ops_between: tuple[int, int] = (3, 30),
    coroutines: int = 2,
    deadline_s: float = 120.0,
) -> CampaignResult:
    """Run one campaign on a fresh store at ``location``, keeping logs under ``workdir``."""
    started = time.monotonic()
    archive = workdir / "archive.jsonl"
    rng = random.Random(seed)
    async with ControlStore(location, archive_path=archive) as store:
        backend = store.backend
        with contextlib.suppress(ProjectExists):
            await store.create_project(kill_check.PROJECT, "The SIGKILL campaign")

    generation = 0
    crashes: list[str] = []
    stalls = done = 0
    live: list[_Client] = []

    async def spawn(slot: int) -> _Client:
        nonlocal generation
        generation += 1
        return await _spawn(
            location,
            workdir,
            f"w{slot}g{generation}",
            rng.randrange(2**31),
            "--coroutines",
            str(coroutines),
        )

    deadline = started + deadline_s
    final_line = ""
    try:
        live = [await spawn(slot) for slot in range(workers)]
        while done < kills:
            slot = rng.randrange(workers)
            victim = live[slot]
            if not await victim.wait_for(victim.progress + rng.randint(*ops_between), deadline):
                if victim.ended:  # it died on its own: a crash, not a kill
                    await victim.reap()
                    crashes.append(victim.crash() or f"{victim.name} ended early")
                    live[slot] = await spawn(slot)
                    continue
                stalls += 1
            await asyncio.sleep(rng.uniform(0, 0.02))  # somewhere inside its next call
            await victim.kill()
            done += 1
            live[slot] = await spawn(slot)
            if time.monotonic() > deadline:
                break
        # The survivors (and the replacements) get some work done, then the end.
        for client in live:
            await client.wait_for(client.progress + ops_between[0], deadline)
        for client in live:
            await client.kill()
            crash = client.crash()
            if crash is not None:
                crashes.append(crash)
        live = []
        final = await _spawn(location, workdir, "final", rng.randrange(2**31), "--final", "30")
        live = [final]
        await final.reap()
        final_line = final.last
        crash = final.crash()
        if crash is not None:
            crashes.append(crash)
    finally:
        for client in live:
            await client.kill()

    async with ControlStore(location, archive_path=archive) as store:
        report = await kill_check.check(
            store,
            sorted((workdir / "acks").glob("*.acks.jsonl")),
            [archive, archive.with_name(archive.name + ".1")],
            expect_settled=True,
        )
    return CampaignResult(
        backend=backend,
        seed=seed,
        kills=done,
        seconds=time.monotonic() - started,
        report=report,
        crashes=crashes,
        stalls=stalls,
        final=final_line,
    )


def main(argv: list[str]) -> int:  # pragma: no cover - a convenience for a manual run
    location, workdir = argv[0], pathlib.Path(argv[1])
    result = asyncio.run(run_campaign(location, workdir, seed=int(argv[2]) if argv[2:] else 0))
    print(result.summary())
    return 1 if result.failures() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
