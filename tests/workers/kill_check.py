"""The checker of the SIGKILL campaign: what the clients were told against what the store holds.

Modelled on Jepsen's total-queue checker. Every client (tests/workers/kill_worker.py)
writes an *acknowledgement log*: one JSON object per line, written with a single
``os.write`` on an ``O_APPEND`` descriptor and fsynced, so a line that was written
survives the client's SIGKILL. Each line has ``w`` (the client's name), ``n`` (its
operation number) and ``t``:

- ``invoke``: written before the call, with the call's arguments (``f`` names it);
- ``ok``: the call returned, with what it returned;
- ``fail``: the call was refused and wrote nothing (``FenceRejected``, with the item's
  ``current_fence`` and ``state``; or ``UnknownItem``);
- ``info``: the call raised something that leaves its effect unknown (a storage error);
- ``exec``: written by a drain's executor (``n`` is the drain's operation), one per item
  it was handed, with the claim's fence and the outcome it returned.

An invoke without a completion is a call the kill cut short: its effect is unknown too.

`check` reads every log, every item of the store with its history, and the purge archive
(items that left the store), and reports:

- **lost**: an acknowledged write the store does not hold: an enqueue whose item is
  absent (and not in the archive) or holds another token; a finish(done) whose item is
  not done at that fence; an acknowledged claim, settlement or drain outcome whose event
  is missing from the ledger.
- **duplicated**: an item with two ``done`` (or two terminal) events; a claim settled
  twice at one fence (an offloaded claim is settled once more, later); an item whose
  acknowledged done settlements came from two fences; one token in two items; one claim
  (item and fence) handed to two clients, or recorded for another owner.
- **unexpected**: an item whose token no client ever invoked; a claim by an owner that
  never claimed; a settlement event no client asked for.
- **inconsistent**: a fence refusal the ledger does not explain (a late fence must be
  refused only when a higher fence exists in the ledger, or when the claim at that fence
  had already been settled), a drain summary that disagrees with what its executor saw,
  a log line that completes nothing.
- **ledger_problems**: what `asyncplane.verify_ledger` finds.
- **stuck** (with ``expect_settled``): items still pending after the final drain.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
from collections.abc import Iterable
from typing import Any

from asyncplane import ControlStore, _backend, verify_ledger

__all__ = ("PROJECT", "AckLog", "KillReport", "check", "read_acks", "read_archive")

#: The project every client of the campaign works in.
PROJECT = "kill"

#: The event types that end a claim at its fence, by the state they leave behind.
_ENDS_CLAIM = {
    "done": "done",
    "failed": "failed",
    "retried": "deferred",
    "parked": "deferred",
    "offloaded": "offloaded",
}

#: Which ledger events each settlement call (or drain outcome) may leave at its fence.
_EVENTS_OF = {
    "done": frozenset({"done"}),
    "failed": frozenset({"failed"}),
    "retry": frozenset({"retried", "failed"}),  # failed: no attempt was left
    "park": frozenset({"parked"}),
    "offload": frozenset({"offloaded"}),
}

#: Operations that write (their ``ok`` lines are acknowledged writes).
WRITES = frozenset(
    {
        "enqueue",
        "enqueue_many",
        "claim",
        "renew",
        "finish",
        "retry",
        "park",
        "offload",
        "purge",
        "drain",
    }
)


class AckLog:
    """An append-only acknowledgement log: each line is durable once `write` returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        while data:  # one write for any line this small; the loop is for form's sake
            data = data[os.write(self._fd, data) :]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


@dataclasses.dataclass
class KillReport:
    """What `check` found. The lists name each problem in words; all must be empty."""

    operations: int = 0
    acknowledged: int = 0
    refused: int = 0
    indeterminate: int = 0
    #: Calls that raised an error of unknown effect (a storage error), among the above.
    errors: int = 0
    executed: int = 0
    items: int = 0
    purged: int = 0
    takeovers: int = 0
    torn_lines: int = 0
    states: dict[str, int] = dataclasses.field(default_factory=dict)
    lost: list[str] = dataclasses.field(default_factory=list)
    duplicated: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    inconsistent: list[str] = dataclasses.field(default_factory=list)
    ledger_problems: list[str] = dataclasses.field(default_factory=list)
    stuck: list[str] = dataclasses.field(default_factory=list)

    def failures(self) -> list[str]:
        """Every problem, each prefixed by its kind."""
        return [
            f"{kind}: {problem}"
            for kind in (
                "lost",
                "duplicated",
                "unexpected",
                "inconsistent",
                "ledger_problems",
                "stuck",
            )
            for problem in getattr(self, kind)
        ]

    def counts(self) -> dict[str, int]:
        return {
            "operations": self.operations,
            "acknowledged": self.acknowledged,
            "refused": self.refused,
            "indeterminate": self.indeterminate,
            "errors": self.errors,
            "executed": self.executed,
            "items": self.items,
            "purged": self.purged,
            "takeovers": self.takeovers,
            "torn_lines": self.torn_lines,
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "unexpected": len(self.unexpected),
            "inconsistent": len(self.inconsistent),
            "ledger_problems": len(self.ledger_problems),
            "stuck": len(self.stuck),
        }


@dataclasses.dataclass
class _Item:
    """One item as last seen: its row (state, fence, payload, result) and its history."""

    item_id: int
    state: str
    fence: int
    payload: dict[str, Any]
    result: Any
    events: list[dict[str, Any]]
    where: str  # "store" or "archive"

    @property
    def token(self) -> str | None:
        token = self.payload.get("token")
        return token if isinstance(token, str) else None

    def at(self, fence: int, types: Iterable[str]) -> list[dict[str, Any]]:
        wanted = set(types)
        return [e for e in self.events if e["fence"] == fence and e["event_type"] in wanted]


def read_acks(paths: Iterable[pathlib.Path]) -> tuple[list[dict[str, Any]], int]:
    """Every record of the logs, and how many lines did not parse (a torn last line)."""
    records: list[dict[str, Any]] = []
    torn = 0
    for path in paths:
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                torn += 1
    return records, torn


def read_archive(paths: Iterable[pathlib.Path]) -> tuple[dict[int, dict[str, Any]], int]:
    """The archive's items by id (each with its ``events``), and the lines skipped.

    A purge killed mid-write leaves a torn line, which the next append ends with a
    newline; its item is still in the store then, and archived again later. An item
    archived twice (a purge killed between archiving and deleting) appears once here.
    """
    items: dict[int, dict[str, Any]] = {}
    torn = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
                item = dict(record["item"])
                item["events"] = list(record["events"])
            except (ValueError, KeyError, TypeError):
                torn += 1
                continue
            items[int(item["item_id"])] = item
    return items, torn


async def _store_items(store: ControlStore) -> dict[int, _Item]:
    """Every item of the store with its history (read through the backend's export,
    which reads a chunk of items and their events in one snapshot)."""
    backend = await store._engine.ready()
    found: dict[int, _Item] = {}
    after = 0
    while True:
        chunk = await backend.export_items(_backend.ExportOp(after, 500, False))
        if not chunk:
            return found
        for row, events in chunk:
            found[row.item_id] = _Item(
                row.item_id,
                row.state,
                row.fence,
                json.loads(row.payload_json),
                None if row.result_json is None else json.loads(row.result_json),
                [
                    {
                        "event_type": e.event_type,
                        "fence": e.fence,
                        "owner": e.owner,
                        "detail": None if e.detail_json is None else json.loads(e.detail_json),
                    }
                    for e in events
                ],
                "store",
            )
        after = chunk[-1][0].item_id


def _archived(record: dict[str, Any]) -> _Item:
    return _Item(
        int(record["item_id"]),
        record["state"],
        int(record["fence"]),
        record["payload"] if isinstance(record["payload"], dict) else {},
        record.get("result"),
        [
            {
                "event_type": e["event_type"],
                "fence": e["fence"],
                "owner": e.get("owner"),
                "detail": e.get("detail"),
            }
            for e in record["events"]
        ],
        "archive",
    )


def _exhausted(item: _Item, fence: int) -> bool:
    """A failure at this fence by a lapsed lease on the last attempt (the store's own)."""
    lapsed = item.at(fence, ["lease_expired"])
    return bool(lapsed) and any(
        str((e["detail"] or {}).get("error", "")).startswith("attempts exhausted: the lease")
        for e in item.at(fence, ["failed"])
    )


async def check(
    store: ControlStore,
    ack_paths: Iterable[pathlib.Path],
    archive_paths: Iterable[pathlib.Path],
    *,
    expect_settled: bool = False,
) -> KillReport:
    """Check the acknowledgement logs against the store and its archive (see the module)."""
    report = KillReport()
    records, report.torn_lines = read_acks(ack_paths)
    archive, torn_archive = read_archive(archive_paths)
    report.torn_lines += torn_archive

    # --- the items: the store's, then the archive's for those no longer in it ------------
    items = await _store_items(store)
    report.items = len(items)
    for item_id, record in archive.items():
        archived = _archived(record)
        if archived.state not in ("done", "failed"):
            report.inconsistent.append(f"item {item_id} was archived in state {archived.state}")
        present = items.get(item_id)
        if present is None:
            items[item_id] = archived
            report.purged += 1
        elif (present.state, present.fence, present.token) != (
            archived.state,
            archived.fence,
            archived.token,
        ):
            report.inconsistent.append(
                f"item {item_id} is {present.state} at fence {present.fence} in the store but "
                f"was archived {archived.state} at fence {archived.fence}"
            )
    report.states = dict(collections.Counter(item.state for item in items.values()))
    for item in items.values():
        report.takeovers += sum(
            1 for e in item.events if e["event_type"] == "lease_expired" and e["detail"]
        )
    report.ledger_problems = [
        f"{p.kind} on item {p.item_id}: {p.detail}" for p in await verify_ledger(store)
    ]

    # --- the history: invocations, their completions, the executors' lines ---------------
    invokes: dict[tuple[str, int], dict[str, Any]] = {}
    completions: dict[tuple[str, int], dict[str, Any]] = {}
    execs: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for record in records:
        key = (str(record.get("w")), int(record.get("n", -1)))
        kind = record.get("t")
        if kind == "invoke":
            if key in invokes:
                report.inconsistent.append(f"operation {key} was invoked twice")
            invokes[key] = record
        elif kind == "exec":
            execs[key].append(record)
        elif kind in ("ok", "fail", "info"):
            if key in completions:
                report.inconsistent.append(f"operation {key} completed twice")
            completions[key] = record
        else:
            report.inconsistent.append(f"an acknowledgement line of unknown kind: {record}")
    for key in completions.keys() - invokes.keys():
        report.inconsistent.append(f"operation {key} completed but was never invoked")
    for key in execs.keys() - invokes.keys():
        report.inconsistent.append(f"drain {key} executed items but was never invoked")
    report.operations = len(invokes)
    report.executed = sum(len(lines) for lines in execs.values())

    invoked_tokens: set[str] = set()
    owners: set[str] = set()
    drain_owners: set[str] = set()
    #: (item, fence) -> the event types some client asked for at that fence
    asked: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
    drain_claims: set[tuple[int, int]] = set()
    for key, invoke in invokes.items():
        op = invoke.get("f")
        if op == "enqueue":
            invoked_tokens.add(invoke["token"])
        elif op == "enqueue_many":
            invoked_tokens.update(invoke["tokens"])
        elif op in ("claim", "drain"):
            owners.add(invoke["owner"])
            if op == "drain":
                drain_owners.add(invoke["owner"])
        elif op in ("finish", "retry", "park", "offload"):
            outcome = invoke.get("status", op) if op == "finish" else op
            asked[(invoke["item_id"], invoke["fence"])].update(_EVENTS_OF[outcome])
        for line in execs.get(key, []):
            asked[(line["item_id"], line["fence"])].update(_EVENTS_OF[line["outcome"]])
            drain_claims.add((line["item_id"], line["fence"]))

    #: (item, fence) -> the operations that were handed that claim
    grants: dict[tuple[int, int], set[tuple[str, int]]] = collections.defaultdict(set)
    #: item -> fences at which a done settlement was acknowledged
    acked_done: dict[int, set[int]] = collections.defaultdict(set)
    acked_failed: dict[int, set[int]] = collections.defaultdict(set)

    def item_of(item_id: int, why: str) -> _Item | None:
        item = items.get(item_id)
        if item is None:
            report.lost.append(f"item {item_id} is in neither the store nor the archive ({why})")
        return item

    def expect_event(item_id: int, fence: int, types: Iterable[str], why: str) -> bool:
        item = item_of(item_id, why)
        if item is None:
            return False
        if not item.at(fence, types):
            report.lost.append(
                f"{why}: item {item_id} has no {'/'.join(sorted(types))} event at fence {fence}"
            )
            return False
        return True

    def granted(item_id: int, fence: int, token: Any, owner: str, key: tuple[str, int]) -> None:
        grants[(item_id, fence)].add(key)
        item = item_of(item_id, f"claimed by {key}")
        if item is None:
            return
        claimed = item.at(fence, ["claimed"])
        if not claimed:
            report.lost.append(f"{key}'s claim of item {item_id} at fence {fence} is not recorded")
        elif any(e["owner"] != owner for e in claimed):
            report.duplicated.append(
                f"{key} was handed item {item_id} at fence {fence}, but the ledger records "
                f"that claim for {sorted({str(e['owner']) for e in claimed})}"
            )
        if token != item.token:
            report.inconsistent.append(
                f"{key} was handed item {item_id} with token {token!r}; it holds {item.token!r}"
            )

    for key, invoke in invokes.items():
        op = invoke["f"]
        done = completions.get(key)
        for line in execs.get(key, []):
            granted(line["item_id"], line["fence"], line.get("token"), invoke["owner"], key)
        if done is None or done["t"] == "info":
            report.indeterminate += 1
            report.errors += done is not None
            continue
        if done["t"] == "fail":
            report.refused += 1
            _check_refusal(report, items, key, invoke, done)
            continue
        if op in WRITES:
            report.acknowledged += 1
        if op in ("enqueue", "enqueue_many"):
            pairs = (
                [(done["token"], done["item_id"])]
                if op == "enqueue"
                else list(zip(done["tokens"], done["item_ids"], strict=True))
            )
            for token, item_id in pairs:
                item = items.get(item_id)
                if item is None:
                    report.lost.append(
                        f"{key}: the acknowledged enqueue of {token!r} (item {item_id}) is in "
                        "neither the store nor the archive"
                    )
                elif item.token != token:
                    report.lost.append(
                        f"{key}: the acknowledged enqueue of {token!r} returned item {item_id}, "
                        f"which holds {item.token!r}"
                    )
        elif op == "claim":
            for item_id, fence, token in done["claims"]:
                granted(item_id, fence, token, invoke["owner"], key)
        elif op == "finish":
            status = invoke["status"]
            why = f"{key}: acknowledged finish({status}) at fence {invoke['fence']}"
            if expect_event(invoke["item_id"], invoke["fence"], [status], why):
                target = acked_done if status == "done" else acked_failed
                target[invoke["item_id"]].add(invoke["fence"])
        elif op == "retry":
            state = done["state"]
            kinds = ["retried"] if state == "deferred" else ["failed"]
            why = f"{key}: acknowledged retry ({state}) at fence {invoke['fence']}"
            expect_event(invoke["item_id"], invoke["fence"], kinds, why)
        elif op in ("park", "offload"):
            event = "parked" if op == "park" else "offloaded"
            why = f"{key}: acknowledged {op} at fence {invoke['fence']}"
            expect_event(invoke["item_id"], invoke["fence"], [event], why)
        elif op == "drain":
            _check_drain(report, items, key, done["summary"], execs.get(key, []), acked_done)

    for (item_id, fence), keys in grants.items():
        if len(keys) > 1:
            report.duplicated.append(
                f"item {item_id} at fence {fence} was handed to {sorted(keys)}"
            )

    # --- the items themselves ---------------------------------------------------------------
    by_token: dict[str, list[int]] = collections.defaultdict(list)
    for item in items.values():
        if item.token is None or item.token not in invoked_tokens:
            report.unexpected.append(
                f"item {item.item_id} holds token {item.token!r}, which no client enqueued"
            )
        if item.token is not None:
            by_token[item.token].append(item.item_id)
        types = [e["event_type"] for e in item.events]
        if types.count("done") > 1:
            report.duplicated.append(
                f"item {item.item_id} was settled done {types.count('done')} times"
            )
        elif types.count("done") + types.count("failed") > 1:
            report.duplicated.append(f"item {item.item_id} reached a terminal state twice")
        ends: dict[int, list[str]] = collections.defaultdict(list)
        for event in item.events:
            if event["event_type"] in _ENDS_CLAIM:
                ends[event["fence"]].append(event["event_type"])
        for fence, kinds in ends.items():
            # One settlement per claim; an offloaded claim is settled once more, later.
            if len(kinds) > (2 if kinds[0] == "offloaded" else 1) or kinds[1:2] == ["offloaded"]:
                report.duplicated.append(
                    f"item {item.item_id}: the claim at fence {fence} was settled {kinds}"
                )
        for event in item.events:
            kind, fence = event["event_type"], event["fence"]
            if kind == "claimed" and event["owner"] not in owners:
                report.unexpected.append(
                    f"item {item.item_id} was claimed at fence {fence} by {event['owner']!r}, "
                    "which never claimed"
                )
            if kind not in _ENDS_CLAIM or kind in asked.get((item.item_id, fence), ()):
                continue
            if kind == "parked" and (item.item_id, fence) in drain_claims:
                continue  # a drain put back an item it was handed (when interrupted)
            if kind == "parked" and event["owner"] in drain_owners:
                continue  # ... or one its executor never reported on (interrupted earlier)
            if kind == "failed" and _exhausted(item, fence):
                continue
            report.unexpected.append(
                f"item {item.item_id} has a {kind} event at fence {fence} no client asked for"
            )
        if expect_settled and item.state not in ("done", "failed"):
            report.stuck.append(f"item {item.item_id} is still {item.state}")
    for token, ids in by_token.items():
        if len(ids) > 1:
            report.duplicated.append(f"token {token!r} is held by items {sorted(ids)}")

    for item_id, fences in acked_done.items():
        item = items.get(item_id)
        if len(fences) > 1:
            report.duplicated.append(
                f"item {item_id}: done settlements were acknowledged at fences {sorted(fences)}"
            )
        if item is None:
            continue  # reported as lost already
        if item.state != "done":
            report.lost.append(
                f"item {item_id}: done was acknowledged at fence(s) {sorted(fences)}, but the "
                f"item is {item.state}"
            )
        elif isinstance(item.result, dict) and item.result.get("fence") not in fences:
            report.lost.append(
                f"item {item_id}: done was acknowledged at fence(s) {sorted(fences)}, but its "
                f"result came from fence {item.result.get('fence')}"
            )
    for item_id, fences in acked_failed.items():
        item = items.get(item_id)
        if item is not None and item.state != "failed":
            report.lost.append(
                f"item {item_id}: failed was acknowledged at fence(s) {sorted(fences)}, but "
                f"the item is {item.state}"
            )
    return report


def _check_refusal(
    report: KillReport,
    items: dict[int, _Item],
    key: tuple[str, int],
    invoke: dict[str, Any],
    done: dict[str, Any],
) -> None:
    """A refusal must be explained by the ledger (see the module's docstring)."""
    item_id, fence, op = invoke.get("item_id"), invoke.get("fence"), invoke["f"]
    item = items.get(item_id) if isinstance(item_id, int) else None
    error = done.get("error")
    if error == "UnknownItem":
        if item is None or item.where != "archive":
            where = "absent from the archive" if item is None else f"in the {item.where}"
            report.inconsistent.append(
                f"{key}: {op} was refused as unknown item {item_id}, which is {where}"
            )
        return
    if error != "FenceRejected" or item is None or not isinstance(fence, int):
        report.inconsistent.append(f"{key}: {op} on item {item_id} refused with {error!r}")
        return
    current, state = done["current_fence"], done["state"]
    claims = {e["fence"] for e in item.events if e["event_type"] == "claimed"}
    ended = bool(item.at(fence, [*_ENDS_CLAIM, "lease_expired"]))
    if current > fence:
        if current in claims and ended:
            return
        report.inconsistent.append(
            f"{key}: {op} at fence {fence} on item {item_id} was refused for fence {current}, "
            f"but the ledger holds claims at {sorted(claims)} and "
            f"{'an' if ended else 'no'} end of the claim at {fence}"
        )
        return
    settles_offloaded = op in ("finish", "retry")
    if current == fence and state != "claimed" and not (settles_offloaded and state == "offloaded"):
        left = [k for k, s in _ENDS_CLAIM.items() if s == state]
        if item.at(fence, left):
            return
    report.inconsistent.append(
        f"{key}: {op} at fence {fence} on item {item_id} was refused (item {state} at fence "
        f"{current}), which the ledger does not explain"
    )


def _check_drain(
    report: KillReport,
    items: dict[int, _Item],
    key: tuple[str, int],
    summary: dict[str, Any],
    lines: list[dict[str, Any]],
    acked_done: dict[int, set[int]],
) -> None:
    """A drain that returned settled every outcome its executor gave, except those the
    store refused because the claim had lapsed (counted in ``fence_rejected``)."""
    if summary["skipped"] and lines:
        report.inconsistent.append(f"drain {key} was skipped but executed {len(lines)} items")
    if summary["claimed"] != len(lines):
        report.inconsistent.append(
            f"drain {key} claimed {summary['claimed']} items; its executor saw {len(lines)}"
        )
    unapplied = 0
    for line in lines:
        item_id, fence, outcome = line["item_id"], line["fence"], line["outcome"]
        item = items.get(item_id)
        if item is None:
            report.lost.append(
                f"item {item_id}, drained by {key}, is in neither the store nor the archive"
            )
            continue
        if item.at(fence, _EVENTS_OF[outcome]):
            if outcome == "done":
                acked_done[item_id].add(fence)
            continue
        unapplied += 1
        if not item.at(fence, ["lease_expired"]):
            report.lost.append(
                f"drain {key} returned, but its {outcome} of item {item_id} at fence {fence} "
                "is not in the ledger, and that claim never lapsed"
            )
    if unapplied > summary["fence_rejected"]:
        report.lost.append(
            f"drain {key}: {unapplied} outcomes are missing from the ledger, but only "
            f"{summary['fence_rejected']} were refused"
        )
