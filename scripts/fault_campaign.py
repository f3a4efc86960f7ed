"""Run the SIGKILL fault campaign, and the probe's chaos scenario, many times in a row.

    python scripts/fault_campaign.py --runs 3
    python scripts/fault_campaign.py --runs 20 --kills 40 --workers 6 --backend postgresql \\
        --url postgresql://user@host/db

Each run of the campaign (tests/workers/kill_campaign.py, also run by
tests/test_faults_kill.py) starts ``--workers`` client processes on a fresh store, SIGKILLs
one at random moments ``--kills`` times (starting a replacement each time), settles what
is left with a final client, and checks every acknowledgement the clients were given
against the store, its ledger and its purge archive. Then ``python -m asyncplane.probe
--scenario chaos`` runs ``--runs`` times on a fresh store too.

On PostgreSQL every run gets a schema of its own on ``--url`` (dropped after), or on a
throwaway cluster (`asyncplane.testing.PostgresCluster`) when no URL is given. Prints the
totals; exits 1 if anything was lost, duplicated, unexpected, inconsistent or stuck, if a
client crashed, or if a chaos run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from asyncplane import testing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "workers"))
import kill_campaign  # noqa: E402  (the campaign and its checker live beside the tests)


@dataclasses.dataclass
class Totals:
    runs: int = 0
    kills: int = 0
    acknowledged: int = 0
    refused: int = 0
    takeovers: int = 0
    purged: int = 0
    lost: int = 0
    duplicated: int = 0
    unexpected: int = 0
    inconsistent: int = 0
    ledger_problems: int = 0
    stuck: int = 0
    crashed: int = 0
    campaigns_failed: int = 0
    chaos_passed: int = 0
    chaos_failed: int = 0
    seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def add(self, result: kill_campaign.CampaignResult) -> None:
        counts = result.report.counts()
        self.runs += 1
        self.kills += result.kills
        for key in (
            "acknowledged",
            "refused",
            "takeovers",
            "purged",
            "lost",
            "duplicated",
            "unexpected",
            "inconsistent",
            "ledger_problems",
            "stuck",
        ):
            setattr(self, key, getattr(self, key) + counts[key])
        self.crashed += len(result.crashes)
        self.campaigns_failed += bool(result.failures())
        self.seconds.setdefault(result.backend, []).append(result.seconds)

    @property
    def bad(self) -> bool:
        return bool(self.campaigns_failed or self.chaos_failed)


async def _admin(url: str, statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextlib.contextmanager
def _location(backend: str, server: str | None, where: pathlib.Path, name: str) -> Iterator[str]:
    """A fresh store: a file under ``where``, or a new schema on the server (dropped after)."""
    if backend == "sqlite":
        yield str(where / f"{name}.db")
        return
    assert server is not None
    schema = f"fault_{name.replace('-', '_')}_{os.getpid()}"
    asyncio.run(_admin(server, f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"))
    try:
        yield testing.with_schema(server, schema)
    finally:
        asyncio.run(_admin(server, f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def _chaos(location: str, args: argparse.Namespace, seed: int) -> tuple[bool, dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "asyncplane.probe",
        "--store",
        location,
        "--scenario",
        "chaos",
        "--overwrite",
        "--json",
        "--workers",
        str(args.workers),
        "--items",
        str(args.chaos_items),
        "--seed",
        str(seed),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"failures": [f"no report (exit {done.returncode}): {done.stderr[-2000:]}"]}
    return done.returncode == 0 and report.get("passed") is True, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="campaigns (and chaos runs) each")
    parser.add_argument("--kills", type=int, default=12, help="SIGKILLs per campaign")
    parser.add_argument("--workers", type=int, default=4, help="client processes at a time")
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--url", help="a PostgreSQL server (default: a throwaway cluster)")
    parser.add_argument("--seed", type=int, default=1, help="the first run's seed")
    parser.add_argument("--chaos-items", type=int, default=2000, help="items per chaos run")
    parser.add_argument("--keep", type=pathlib.Path, help="keep logs and stores here")
    parser.add_argument("--json", action="store_true", help="print the totals as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.kills < 0 or args.workers < 1:
        parser.error("--runs and --workers must be at least 1, --kills at least 0")
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    totals = Totals()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = args.keep or pathlib.Path(tempfile.mkdtemp(prefix="fault-campaign-"))
        root.mkdir(parents=True, exist_ok=True)
        if args.keep is None:
            stack.callback(shutil.rmtree, root, True)
        server = args.url
        if "postgresql" in backends and server is None:
            server = stack.enter_context(testing.PostgresCluster()).url()
        for backend in backends:
            for run in range(args.runs):
                seed = args.seed + run
                work = root / f"{backend}-kill-{run}"
                with _location(backend, server, root, f"{backend}-kill-{run}") as location:
                    result = asyncio.run(
                        kill_campaign.run_campaign(
                            location, work, workers=args.workers, kills=args.kills, seed=seed
                        )
                    )
                totals.add(result)
                print(
                    ("FAILED " if result.failures() else "ok     ") + result.summary(), flush=True
                )
            for run in range(args.runs):
                seed = args.seed + run
                with _location(backend, server, root, f"{backend}-chaos-{run}") as location:
                    passed, report = _chaos(location, args, seed)
                totals.chaos_passed += passed
                totals.chaos_failed += not passed
                print(
                    f"{'ok    ' if passed else 'FAILED'} chaos {backend} seed {seed}: "
                    f"{report.get('kills')} kills, {report.get('items')} items in "
                    f"{report.get('seconds', 0):.1f} s; duplicates {report.get('duplicates')}, "
                    f"lost {report.get('lost')}, ledger problems {report.get('ledger_problems')}"
                    + "".join(f"\n    {failure}" for failure in report.get("failures", [])),
                    flush=True,
                )
    per_backend = {
        backend: f"{min(s):.1f} to {max(s):.1f} s" for backend, s in totals.seconds.items()
    }
    if args.json:
        print(json.dumps({**dataclasses.asdict(totals), "per_backend": per_backend}))
    else:
        times = ", ".join(f"{backend} {spread}" for backend, spread in per_backend.items())
        print(
            f"\nkill campaigns: {totals.runs} runs ({times}), "
            f"{totals.kills} kills survived, {totals.acknowledged} acknowledged writes, "
            f"{totals.refused} refused, {totals.takeovers} takeovers, {totals.purged} purged\n"
            f"  lost {totals.lost}, duplicated {totals.duplicated}, unexpected "
            f"{totals.unexpected}, inconsistent {totals.inconsistent}, ledger problems "
            f"{totals.ledger_problems}, stuck {totals.stuck}, crashed clients {totals.crashed}\n"
            f"chaos: {totals.chaos_passed} passed, {totals.chaos_failed} failed\n"
            f"{'FAILED' if totals.bad else 'PASSED'} in {time.monotonic() - started:.0f} s"
        )
    return 1 if totals.bad else 0


if __name__ == "__main__":
    sys.exit(main())
