"""What ``import asyncplane`` costs, as a ratio to ``import asyncio`` alone, in one run.

    python benchmarks/import_time.py [--repeats R] [--json]

Each import runs in a fresh interpreter under ``-X importtime``, the two interleaved,
``--repeats`` times each; the figures are the median and the fastest of the cumulative
time of the top module. asyncplane's modules are compiled first (``compileall``), as an installed
package's are, so that the figure is the import and not the compilation (with
``PYTHONDONTWRITEBYTECODE`` set, nothing would be cached otherwise). It also prints the
modules that cost the most of their own time, asyncplane's and those it brings.
Target (issue 17): at most 1.5x ``import asyncio``.
"""

from __future__ import annotations

import argparse
import compileall
import json
import pathlib
import statistics
import subprocess
import sys

import asyncplane

PACKAGE = pathlib.Path(asyncplane.__file__).parent


def timed(module: str) -> tuple[float, list[tuple[int, str]]]:
    """The import's cumulative time in ms, and every module's own time (µs, name)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
        rows.append((int(own), name, int(cumulative)))
    top = next(cumulative for _, name, cumulative in reversed(rows) if name == module)
    return top / 1000, [(own, name) for own, name, _ in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    compileall.compile_dir(str(PACKAGE), quiet=1)
    times: dict[str, list[float]] = {"asyncio": [], "asyncplane": []}
    own: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for module in times:
            took, rows = timed(module)
            times[module].append(took)
            if module == "asyncplane":
                for micros, name in rows:
                    own.setdefault(name, []).append(micros)
    median = {module: statistics.median(found) for module, found in times.items()}
    # The fastest of the repeats is the import with the least noise in it: the figure
    # to compare across runs on a shared machine (the median is printed beside it).
    fastest = {module: min(found) for module, found in times.items()}
    heaviest = sorted(
        ((statistics.median(found) / 1000, name) for name, found in own.items()), reverse=True
    )[:12]
    report = {
        "repeats": args.repeats,
        "ms": median,
        "ratio": median["asyncplane"] / median["asyncio"],
        "fastest_ms": fastest,
        "fastest_ratio": fastest["asyncplane"] / fastest["asyncio"],
        "heaviest_ms": [[name, round(ms, 2)] for ms, name in heaviest],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"import asyncio    median {median['asyncio']:6.1f} ms, fastest "
          f"{fastest['asyncio']:6.1f} ms")  # fmt: skip
    print(f"import asyncplane median {median['asyncplane']:6.1f} ms, fastest "
          f"{fastest['asyncplane']:6.1f} ms")  # fmt: skip
    print(
        f"ratio: median {report['ratio']:.2f}x, fastest {report['fastest_ratio']:.2f}x "
        "(target <= 1.5x)"
    )
    print("own time of the heaviest modules:")
    for ms, name in heaviest:
        print(f"  {ms:6.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
