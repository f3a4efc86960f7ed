"""Where one write round's time goes: its statements, and the Python around them.

    python benchmarks/round_python.py [--items N] [--repeats R] [--json]

A diagnostic, not a comparison with a peer: it shows what a change to the round's own
code bought, run once on each side of the change (the package on ``PYTHONPATH``, or the
installed one), in turns, on a quiet machine. It runs `finish_and_claim`'s round, the
settle of the item held and the claim of the next, exactly as the SQLite writer runs it
(`asyncplane._writer`'s transaction, the rules, the statements), on one thread, with no
event loop and no hand-off: the connection's side of a round, alone. Each statement is
timed where the connection runs it, so what is left of the round is Python: the writer's,
the rules core's and the backend's, with the rows read (``fetchall``) counted there too.

It prints, as medians over the repeats, a round's time, its statements' time and the
rest, and each statement's own median. Every repeat starts from a copy of the same file
(asyncplane's schema, ``--items`` ready items, the first claimed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import pathlib
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import asyncplane
from asyncplane import _backend, _clock, _sqlite, _write_queue, _writer


class _Timed(sqlite3.Connection):
    """A connection that times each statement it runs, by its first words."""

    spent: collections.defaultdict[str, list[float]]

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return self._timed(super().execute, sql, args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return self._timed(super().executemany, sql, args)

    def _timed(
        self, run: Callable[..., sqlite3.Cursor], sql: str, args: tuple[Any, ...]
    ) -> sqlite3.Cursor:
        started = time.perf_counter()
        try:
            return run(sql, *args)
        finally:
            self.spent[" ".join(sql.split())[:48]].append(time.perf_counter() - started)


async def _prepare(path: pathlib.Path, items: int) -> tuple[int, int]:
    """A store of ``items`` ready items, the first claimed: its id and fence."""
    async with asyncplane.ControlStore(str(path)) as store:
        await store.create_project("p", "P")
        await store.enqueue_many("p", [{"n": n} for n in range(items + 1)])
        claim = await store.claim("w")
        assert claim is not None
        return claim.item_id, claim.fence


def _rounds(path: pathlib.Path, held: tuple[int, int], items: int) -> dict[str, Any]:
    """``items`` rounds, each settling the item held and claiming the next."""
    db = sqlite3.connect(path, isolation_level=None, factory=_Timed)
    db.spent = collections.defaultdict(list)
    db.execute("PRAGMA synchronous = NORMAL")
    db.spent.clear()
    clock = _clock.SystemClock()
    item_id, fence = held
    took = 0.0
    for _ in range(items):
        settle = _backend.finish_request(
            _backend.FinishOp(item_id, fence, "done", None, None, None), _sqlite._finish_many
        )
        claim: _write_queue.Grouped[list[_backend.ClaimRow]] = _write_queue.Grouped(
            ("claim", 30.0, None, None),
            _backend.ClaimOp("w", 1, 30.0, None, None),
            _sqlite._claim_many,
            after=settle,
        )
        started = time.perf_counter()
        outcomes, _, _ = _writer._transact([settle, claim], db, clock, None, None, None)
        took += time.perf_counter() - started
        if isinstance(outcomes[1], _write_queue.Raised) or not outcomes[1]:
            raise SystemExit(f"the round did not claim: {outcomes}")
        item_id, fence = outcomes[1][0].item_id, outcomes[1][0].fence
    db.close()
    statements = sum(sum(times) for times in db.spent.values())
    return {
        "round_us": took / items * 1e6,
        "statements_us": statements / items * 1e6,
        "python_us": (took - statements) / items * 1e6,
        "each_us": {sql: statistics.median(times) * 1e6 for sql, times in db.spent.items()},
        "each_per_round": {sql: len(times) / items for sql, times in db.spent.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, run = pathlib.Path(tmp, "base.db"), pathlib.Path(tmp, "run.db")
        held = asyncio.run(_prepare(base, args.items))
        runs = []
        for _ in range(args.repeats):
            for suffix in ("", "-wal", "-shm"):
                pathlib.Path(f"{run}{suffix}").unlink(missing_ok=True)
            shutil.copy(base, run)
            runs.append(_rounds(run, held, args.items))
    report = {
        key: statistics.median(r[key] for r in runs)
        for key in ("round_us", "statements_us", "python_us")
    }
    report["each_us"] = {
        sql: statistics.median(r["each_us"][sql] for r in runs) for sql in runs[0]["each_us"]
    }
    report["each_per_round"] = runs[0]["each_per_round"]
    report["repeats"] = [round(r["python_us"], 1) for r in runs]
    if args.json:
        json.dump(report, sys.stdout)
        print()
        return
    print(f"asyncplane {asyncplane.__version__}, {args.items} rounds, medians of {args.repeats}")
    print(f"  a round       {report['round_us']:7.1f} us")
    print(f"  statements    {report['statements_us']:7.1f} us")
    print(f"  the rest      {report['python_us']:7.1f} us  (each repeat: {report['repeats']})")
    for sql, median in sorted(report["each_us"].items(), key=lambda kv: -kv[1]):
        print(f"    {median:6.1f} us x{report['each_per_round'][sql]:.2f}  {sql}")


if __name__ == "__main__":
    main()
