"""The benchmark scripts run and report what they promise (their figures are not judged
here: speed is measured by running them, never by a timed test)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


def test_claim_finish_benchmark_reports_rates_and_ratios() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "claim_finish.py"),
            "--items",
            "200",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["rates"]) == {"raw", "1 coroutine", "64 coroutines"}
    assert all(rate > 0 for rate in report["rates"].values())
    assert set(report["ratios"]) == {"1 coroutine / raw", "64 coroutines / raw"}
