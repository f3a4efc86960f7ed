"""Copying a store to another: how a fleet moves from SQLite to PostgreSQL (or back).

Every project, assignment, limit, schedule and item goes across with its id, its row as
it stands and its whole history, so each item's ledger verifies in the destination as it
did in the source (a source's own problems, events whose item is gone, are not carried);
a claim copied mid-lease keeps its fence, and once its lease lapses in the destination it
is taken over with a higher one. A schedule keeps its place (its next
tick), so the destination does not run again a tick the source ran. Each chunk of items
is one transaction in the destination, and the destination remembers every item it
copied (keyed by the source store, however its location is written: `source_label`),
so a second run, or a run after a crash half-way, copies nothing twice and finishes the
job.

The source's import records come too (an import run again on the destination skips the
rows the source took in), and the destination never hands out an item id the source ever
did (a purged item's included: an archive may name it).

A copy keeps item ids, so the destination must hold no item of its own (one no copy from
this source brought): a fresh store, or one this source was copied into before, taking
no work meanwhile. The copy looks before it writes anything, and refuses any other
destination whole. Each project, assignment, project's limits and schedule is added once
from one source (the destination records it, `_rules.copy_settings_plan`), and one the
destination already has under the same id stays as it is there, so that a second copy
never undoes what was changed there: nothing revoked, cleared or deleted comes back. A
schedule added before moves on to the source's next tick, so no tick the source ran runs
again. Stop the workers on the source first (or let them drain): a report sent to the
source after its item was copied is not carried over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from asyncplane import _backend, _rules, _store, _validate
from asyncplane._store import ControlStore

__all__ = ("CopySummary", "copy_store")


@dataclasses.dataclass
class CopySummary:
    """What a copy did: projects added, items copied now, items copied by an earlier run."""

    projects: int = 0
    copied: int = 0
    skipped: int = 0
    chunks: int = 0


async def source_label(source: ControlStore) -> str:
    """What a destination keys the items copied from ``source`` by: the store itself, as
    its backend names it (`asyncplane._backend.Backend.store_identity`), however its
    location is written: two spellings of one URL are one source, and two stores one URL
    could name (for different users, a search_path of "$user"; two servers behind one
    tunnel's address) are two. Where the backend cannot say, the location as written:
    a resume spelled otherwise is refused then, never taken for another source's."""
    identity = await (await _store.engine_of(source).ready()).store_identity()
    return f"copy:{source.location}" if identity is None else f"copy:{identity}"


async def copy_store(
    source: ControlStore,
    destination: ControlStore,
    *,
    chunk: int = 500,
    pending_only: bool = False,
    progress: Callable[[int], None] | None = None,
) -> CopySummary:
    """Copy every project, assignment, project's limits, schedule (keeping its next tick) and
    item (with its history) from ``source`` into ``destination``; idempotent.

    Args:
        source: The store to copy from (any backend); it is only read.
        destination: The store to copy into (any backend): empty, or filled by an earlier
            copy from the same source.
        chunk: Items per destination transaction.
        pending_only: Leave settled (done, failed, cancelled) items behind. By default they come
            too: their results serve dedup, and their histories are the ledger.
        progress: Called with the running count of items looked at, after each chunk.

    Raises InvalidInput, before anything is written, when the destination holds an item
    of its own (one no copy from this source brought), or has handed out ids of its own
    (items purged since: ids are never reused); and, for a chunk, when such an
    item has taken one of its ids meanwhile (a destination that took work during the
    copy: the chunks before stay, and a run once it is still finishes the job).
    """
    size = _validate.positive_int(chunk, "chunk")
    progress = _validate.callback(progress, "progress")
    pending = _validate.boolean(pending_only, "pending_only")
    src = await _store.engine_of(source).ready()
    dst = await _store.engine_of(destination).ready()
    label = await source_label(source)
    if await source_label(destination) == label:
        raise _rules.copy_into_itself()
    foreign = await dst.first_foreign_item(label)
    if foreign is not None:
        # A copy begun when the label was the location as written goes on under that one.
        legacy = f"copy:{source.location}"
        if legacy == label or await dst.first_foreign_item(legacy) is not None:
            raise _rules.copy_id_taken(foreign)  # before anything is written, even projects
        label = legacy
    # Read before anything is written too, so a source that cannot say fails a copy whole.
    # (An id handed out after this reading is kept clear once its item is copied, now or
    # by the next run.)
    last = await src.last_item_id()
    copied, kept_clear = await dst.copied_up_to(label)
    refused = _rules.copy_ids_handed_out(await dst.last_item_id(), copied, kept_clear, last)
    if refused is not None:
        raise refused  # before anything is written too
    # An import record the destination cannot keep (an earlier release's SQLite import
    # recorded a key PostgreSQL cannot index): refused before anything is written, not
    # after the items went across.
    after: tuple[str, str] | None = None
    while dst.import_records_bounded and (records := await src.export_imports(after, size)):
        for source_name, key, *_ in records:
            if (refused := _rules.copy_unrecordable(source_name, key)) is not None:
                raise refused
        after = records[-1][:2]
    summary = CopySummary()
    projects = tuple(await src.list_projects())
    assignments = tuple(await src.list_assignments())
    limits = tuple(await src.get_limits(None))
    schedules = tuple(await src.list_schedules(None))
    summary.projects = await dst.copy_projects(
        _backend.CopyProjectsOp(label, projects, assignments, limits, schedules)
    )
    after_id = 0
    while True:
        found = await src.export_items(_backend.ExportOp(after_id, size, pending))
        if not found:
            break
        items = tuple((item, tuple(events)) for item, events in found)
        copied, skipped = await dst.copy_items(_backend.CopyOp(label, items))
        summary.copied += copied
        summary.skipped += skipped
        summary.chunks += 1
        after_id = found[-1][0].item_id
        if progress is not None:
            progress(summary.copied + summary.skipped)
        if len(found) < size:
            break
    # What the source remembers of its imports, so that an import run again on the
    # destination skips what the source took in (as a backup's restore would).
    after = None
    while records := await src.export_imports(after, size):
        await dst.copy_imports(tuple(records))
        after = records[-1][:2]
    # Ids are never reused: the destination hands out none the source ever did (an item
    # purged there, or left behind by pending_only, could still be named in an archive).
    if last:  # a source that never handed out an id has none to keep clear
        await dst.advance_item_ids(last, label)
    return summary
