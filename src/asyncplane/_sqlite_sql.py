"""Every SQL statement of the SQLite backend's operations, as named constants.

(Connection pragmas live with connection setup in `asyncplane._connection`; BEGIN
IMMEDIATE and COMMIT are issued by the writer, where a reader can see them.)

Nothing here is ever formatted with user input: values travel only as bound parameters.
Where a statement has a scoped and an unscoped form, both are written out in full so a
reader sees exactly what runs. The exception: a round's many-row claim and settle come in
two forms, their rows as a JSON array or as bound parameters, each made from one template
(`_claim_items`, `_settle_done_many`), so that the settle's fence, state and scope guard
has one text for both.

Times are REAL seconds since the Unix epoch (wall clock, UTC). Item ids come from
AUTOINCREMENT so an id is never reused, even after rows are purged: a late report or an
orphaned event can then never be mistaken for a newer item's.
"""

from __future__ import annotations

import functools
from typing import Final

from asyncplane import _models

#: Written to the header so a foreign SQLite file is recognised as "not ours" ('APLN').
APPLICATION_ID: Final = 0x41504C4E

# --- schema and migrations -------------------------------------------------------------

#: Migration n takes the schema from user_version n-1 to n. Append, never edit.

# Migration 5's trigger body, which lines up the ready twins of NEW's content: the first
# in claim order is claimable (not held) unless a twin runs; every other one is held. It
# touches only the claimable one(s) (at most two: the one there was, and a newcomer) and
# the first held one, through their indexes, so it costs the same however long the line.
# (Written once for that migration and never edited, as a migration's text must not be.)
_FIRST_TWIN_5 = """(
        SELECT item_id FROM (
            SELECT * FROM (
                SELECT item_id, priority, service_class, sla FROM items INDEXED BY items_held
                WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
                  AND state = 'ready' AND held = 1
                ORDER BY priority DESC, service_class, sla IS NULL, sla, item_id LIMIT 1)
            UNION ALL
            SELECT item_id, priority, service_class, sla FROM items INDEXED BY items_next_twin
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state = 'ready' AND held = 0 AND fingerprint IS NOT NULL)
        WHERE NOT EXISTS (
            SELECT 1 FROM items AS twin INDEXED BY items_running_fingerprint
            WHERE twin.project_id = NEW.project_id AND twin.fingerprint = NEW.fingerprint
              AND twin.state IN ('claimed', 'offloaded') AND twin.fingerprint IS NOT NULL)
        ORDER BY priority DESC, service_class, sla IS NULL, sla, item_id LIMIT 1)"""
_LINE_UP_TWINS_5 = f"""
        UPDATE items SET held = 1
        WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
          AND state = 'ready' AND held = 0 AND fingerprint IS NOT NULL
          AND item_id IS NOT {_FIRST_TWIN_5};
        UPDATE items SET held = 0 WHERE item_id = {_FIRST_TWIN_5} AND held = 1;"""

# Migration 5's triggers that keep the line (written once for it, never edited; migration
# 10 makes them again from this text, their first UPDATE led by items_next_twin).
_TWIN_TRIGGERS_5 = f"""    CREATE TRIGGER items_twin_arrives AFTER INSERT ON items
    WHEN NEW.state IN ('ready', 'claimed', 'offloaded') AND NEW.fingerprint IS NOT NULL
    BEGIN {_LINE_UP_TWINS_5}
    END;
    CREATE TRIGGER items_twin_moves AFTER UPDATE OF state, fingerprint ON items
    WHEN NEW.fingerprint IS NOT NULL AND (
        (OLD.fingerprint IS NULL AND NEW.state IN ('ready', 'claimed', 'offloaded'))
        OR (OLD.state IS NOT NEW.state
            AND (NEW.state IN ('ready', 'claimed', 'offloaded')
                 OR OLD.state IN ('claimed', 'offloaded')
                 OR (OLD.state = 'ready' AND OLD.held = 0))))
    BEGIN {_LINE_UP_TWINS_5}
    END;"""

# Migration 9's twin probes (written once for it, never edited): whether NEW has a done
# twin, or a pending twin enqueued with dedup.
_DONE_TWIN_9 = """EXISTS (
            SELECT 1 FROM items AS d INDEXED BY items_fingerprint
            WHERE d.project_id = NEW.project_id AND d.fingerprint = NEW.fingerprint
              AND d.state = 'done')"""
_PENDING_TWIN_9 = """EXISTS (
            SELECT 1 FROM items AS p INDEXED BY items_fingerprint
            WHERE p.project_id = NEW.project_id AND p.fingerprint = NEW.fingerprint
              AND p.state IN ('ready', 'deferred') AND p.dedup = 1)"""

# Migration 9's triggers that note a twin pair as it forms (written once for it, never
# edited; migration 11 makes them again from this text, their pending look led by
# items_dedup_twins).
_TWIN_PAIR_TRIGGERS_9 = f"""    CREATE TRIGGER items_twin_pair_arrives AFTER INSERT ON items
    WHEN NEW.fingerprint IS NOT NULL AND (
        (NEW.state IN ('ready', 'deferred') AND NEW.dedup = 1 AND {_DONE_TWIN_9})
        OR (NEW.state = 'done' AND {_PENDING_TWIN_9}))
    BEGIN
        INSERT INTO twin_checks (project_id, fingerprint)
        VALUES (NEW.project_id, NEW.fingerprint) ON CONFLICT DO NOTHING;
    END;
    CREATE TRIGGER items_twin_pair_forms AFTER UPDATE OF state, fingerprint, dedup ON items
    WHEN NEW.fingerprint IS NOT NULL AND (
        (NEW.state IN ('ready', 'deferred') AND NEW.dedup = 1
         AND (OLD.state NOT IN ('ready', 'deferred') OR OLD.dedup = 0
              OR OLD.fingerprint IS NOT NEW.fingerprint)
         AND {_DONE_TWIN_9})
        OR (NEW.state = 'done' AND OLD.fingerprint IS NOT NEW.fingerprint
            AND {_PENDING_TWIN_9}))
    BEGIN
        INSERT INTO twin_checks (project_id, fingerprint)
        VALUES (NEW.project_id, NEW.fingerprint) ON CONFLICT DO NOTHING;
    END;"""
# Migration 11's look for a pending twin enqueued with dedup: the index of those twins.
_PENDING_TWIN_11 = _models.edited(
    _PENDING_TWIN_9, "AS p INDEXED BY items_fingerprint", "AS p INDEXED BY items_dedup_twins"
)
_TWIN_PAIR_TRIGGERS_11 = _models.edited(
    _TWIN_PAIR_TRIGGERS_9, _PENDING_TWIN_9, _PENDING_TWIN_11, times=2
)

# Migration 10's line-up: its first UPDATE names the index of claimable twins, which
# a state in items_fingerprint's key would otherwise win (three equalities against two),
# reading every ready twin of the content, held ones too, for each that arrives. (An
# UPDATE in a trigger takes no INDEXED BY; the SELECT that finds its rows does.)
_HOLD_OTHERS_5 = f"""
        UPDATE items SET held = 1
        WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
          AND state = 'ready' AND held = 0 AND fingerprint IS NOT NULL
          AND item_id IS NOT {_FIRST_TWIN_5};"""
_HOLD_OTHERS_10 = f"""
        UPDATE items SET held = 1 WHERE item_id IN (
            SELECT item_id FROM items INDEXED BY items_next_twin
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state = 'ready' AND held = 0 AND fingerprint IS NOT NULL
              AND item_id IS NOT {_FIRST_TWIN_5});"""
_TWIN_TRIGGERS_10 = _models.edited(
    _TWIN_TRIGGERS_5,
    _LINE_UP_TWINS_5,
    _models.edited(_LINE_UP_TWINS_5, _HOLD_OTHERS_5, _HOLD_OTHERS_10),
    times=2,
)
# Migration 12's: the one claimable twin to hold back, found by a seek, where migration
# 10's IN (SELECT ...) built a table of them for every firing, that is on every claim and
# every finish of a fingerprinted item. One is all there can be: a content has at most one
# claimable twin (these triggers keep it so), and a firing adds at most one more (the row
# that fired it, arriving ready, or moved back to ready), of which the first in line stays.
# That holds while a twin's place in line moves only with a firing: the store never
# changes an item's priority, service class, SLA or fingerprint (but to give one where
# there was none). A row edited by hand to go ahead of its content's claimable twin can
# leave two claimable (both still wait while a twin runs), where migration 10's hold-back
# mended that at the next firing.
_HOLD_OTHERS_12 = f"""
        UPDATE items SET held = 1 WHERE item_id = (
            SELECT item_id FROM items INDEXED BY items_next_twin
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state = 'ready' AND held = 0 AND fingerprint IS NOT NULL
              AND item_id IS NOT {_FIRST_TWIN_5}
            LIMIT 1);"""
_TWIN_TRIGGERS_12 = _models.edited(
    _TWIN_TRIGGERS_5,
    _LINE_UP_TWINS_5,
    _models.edited(_LINE_UP_TWINS_5, _HOLD_OTHERS_5, _HOLD_OTHERS_12),
    times=2,
)

MIGRATIONS: Final[tuple[str, ...]] = (
    # 1: projects, assignments, items, the append-only event ledger.
    """
    CREATE TABLE projects (
        project_id  TEXT PRIMARY KEY NOT NULL,
        name        TEXT NOT NULL,
        status      TEXT NOT NULL,
        created_at  REAL NOT NULL
    );
    CREATE TABLE assignments (
        actor_id    TEXT NOT NULL,
        project_id  TEXT NOT NULL REFERENCES projects (project_id),
        assigned_at REAL NOT NULL,
        PRIMARY KEY (actor_id, project_id)
    ) WITHOUT ROWID;
    CREATE TABLE items (
        item_id          INTEGER PRIMARY KEY AUTOINCREMENT,
        project_id       TEXT NOT NULL REFERENCES projects (project_id),
        state            TEXT NOT NULL,
        payload          TEXT NOT NULL,
        fence            INTEGER NOT NULL DEFAULT 0,
        attempts         INTEGER NOT NULL DEFAULT 0,
        owner            TEXT,
        lease_expires_at REAL,
        created_at       REAL NOT NULL,
        updated_at       REAL NOT NULL
    );
    -- The claim order comes from these two partial indexes, never from a table scan.
    CREATE INDEX items_ready ON items (item_id) WHERE state = 'ready';
    CREATE INDEX items_lease ON items (lease_expires_at) WHERE state = 'claimed';
    CREATE TABLE events (
        event_id   INTEGER PRIMARY KEY AUTOINCREMENT,
        item_id    INTEGER NOT NULL,
        event_type TEXT NOT NULL,
        fence      INTEGER NOT NULL,
        owner      TEXT,
        actor_id   TEXT,
        at         REAL NOT NULL,
        detail     TEXT
    );
    -- Covers the ledger checks (per item, by type, with fence) without touching the table.
    CREATE INDEX events_by_item ON events (item_id, event_type, fence);
    -- Append-only: an event, once written, is never rewritten, and never removed while
    -- its item exists (retention removes an item first, then its history).
    CREATE TRIGGER events_append_only BEFORE UPDATE ON events
    BEGIN
        SELECT RAISE(ABORT, 'the asyncplane ledger is append-only');
    END;
    CREATE TRIGGER events_kept BEFORE DELETE ON events
    WHEN EXISTS (SELECT 1 FROM items WHERE item_id = OLD.item_id)
    BEGIN
        SELECT RAISE(ABORT, 'the asyncplane ledger is append-only');
    END;
    """,
    # 2: lane-queue semantics. Ordering (priority, service class, SLA), deferral (retry,
    # park, not_before), content fingerprints, results and errors, offloading.
    """
    ALTER TABLE items ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE items ADD COLUMN service_class TEXT NOT NULL DEFAULT 'standard';
    ALTER TABLE items ADD COLUMN sla REAL;
    ALTER TABLE items ADD COLUMN fingerprint TEXT;
    ALTER TABLE items ADD COLUMN dedup INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE items ADD COLUMN max_attempts INTEGER;
    ALTER TABLE items ADD COLUMN due_at REAL;
    ALTER TABLE items ADD COLUMN result TEXT;
    ALTER TABLE items ADD COLUMN error TEXT;
    ALTER TABLE items ADD COLUMN offload_handle TEXT;
    -- The claim order, from the index: higher priority first, then realtime before
    -- standard (the two classes sort that way), then the earliest SLA with none last,
    -- then the oldest id.
    DROP INDEX items_ready;
    CREATE INDEX items_ready
        ON items (priority DESC, service_class, sla IS NULL, sla, item_id)
        WHERE state = 'ready';
    CREATE INDEX items_due ON items (due_at) WHERE state = 'deferred';
    CREATE INDEX items_fingerprint ON items (project_id, fingerprint)
        WHERE fingerprint IS NOT NULL;
    CREATE INDEX items_running_fingerprint ON items (project_id, fingerprint)
        WHERE fingerprint IS NOT NULL AND state IN ('claimed', 'offloaded');
    CREATE INDEX items_offloaded ON items (offload_handle) WHERE state = 'offloaded';
    """,
    # 3: operating a store. Retention finds settled items by age; imports remember every
    # source row they copied, so an import never copies a row twice, even after a crash
    # or after the copied item was purged.
    """
    CREATE INDEX items_settled ON items (updated_at) WHERE state IN ('done', 'failed');
    CREATE TABLE imports (
        source      TEXT NOT NULL,
        source_key  TEXT NOT NULL,
        item_id     INTEGER NOT NULL,
        imported_at REAL NOT NULL,
        PRIMARY KEY (source, source_key)
    ) WITHOUT ROWID;
    """,
    # 4: operating single items. A new settled state, cancelled (retention purges it like
    # done and failed); listing by state, newest or oldest first, straight from an index,
    # for the whole store or one project.
    """
    DROP INDEX items_settled;
    CREATE INDEX items_settled ON items (updated_at)
        WHERE state IN ('done', 'failed', 'cancelled');
    -- Claimed items are left out: every item passes through that state, so leaving it
    -- out halves what a claim and a finish write to these indexes, and the claimed are
    -- few (one per running worker), read through items_lease.
    CREATE INDEX items_by_state ON items (state, item_id) WHERE state <> 'claimed';
    CREATE INDEX items_by_project ON items (project_id, state, item_id)
        WHERE state <> 'claimed';
    """,
    # 5: no claim pays for work it cannot take. The claim order per project, so a claim
    # walks only the projects in its reach; and twins in line: of the ready items of one
    # content (project and fingerprint) only the first in claim order is in that index,
    # and none while a twin runs; the others are held, so a claim never steps over them.
    # The triggers keep the line whatever moves an item (_LINE_UP_TWINS_5).
    f"""
    ALTER TABLE items ADD COLUMN held INTEGER NOT NULL DEFAULT 0;
    UPDATE items SET held = 1
    WHERE state = 'ready' AND fingerprint IS NOT NULL AND item_id NOT IN (
        SELECT item_id FROM (
            SELECT item_id, project_id, fingerprint, row_number() OVER (
                PARTITION BY project_id, fingerprint
                ORDER BY priority DESC, service_class, sla IS NULL, sla, item_id) AS place
            FROM items WHERE state = 'ready' AND fingerprint IS NOT NULL) AS ranked
        WHERE place = 1 AND NOT EXISTS (
            SELECT 1 FROM items AS twin
            WHERE twin.project_id = ranked.project_id AND twin.fingerprint = ranked.fingerprint
              AND twin.state IN ('claimed', 'offloaded')));
    DROP INDEX items_ready;
    CREATE INDEX items_claim
        ON items (project_id, priority DESC, service_class, sla IS NULL, sla, item_id)
        WHERE state = 'ready' AND held = 0;
    CREATE INDEX items_project_due ON items (project_id, due_at) WHERE state = 'deferred';
    CREATE INDEX items_held
        ON items (project_id, fingerprint, priority DESC, service_class, sla IS NULL, sla,
                  item_id)
        WHERE state = 'ready' AND held = 1;
    CREATE INDEX items_next_twin ON items (project_id, fingerprint)
        WHERE state = 'ready' AND held = 0 AND fingerprint IS NOT NULL;
{_TWIN_TRIGGERS_5}
    """,
    # 6: schedules and limits. A project's limits, with its rate bucket (the claimed items
    # it counts are found through items_running, a few per project); schedules, and the key
    # of every tick enqueued, written with its item so that a tick is enqueued once.
    """
    CREATE TABLE project_limits (
        project_id  TEXT PRIMARY KEY NOT NULL REFERENCES projects (project_id),
        max_running INTEGER,
        per_minute  REAL,
        burst       INTEGER,
        tokens      REAL,
        refilled_at REAL
    ) WITHOUT ROWID;
    CREATE INDEX items_running ON items (project_id) WHERE state = 'claimed';
    CREATE TABLE schedules (
        name          TEXT PRIMARY KEY NOT NULL,
        project_id    TEXT NOT NULL REFERENCES projects (project_id),
        payload       TEXT NOT NULL,
        cron          TEXT,
        every         REAL,
        timezone      TEXT NOT NULL,
        catch_up      TEXT NOT NULL,
        priority      INTEGER NOT NULL,
        service_class TEXT NOT NULL,
        fingerprint   TEXT,
        dedup         INTEGER NOT NULL,
        max_attempts  INTEGER,
        paused        INTEGER NOT NULL DEFAULT 0,
        anchor        REAL NOT NULL,
        next_at       REAL NOT NULL,
        last_at       REAL,
        created_at    REAL NOT NULL,
        updated_at    REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX schedules_due ON schedules (next_at) WHERE paused = 0;
    CREATE TABLE schedule_ticks (
        name    TEXT NOT NULL,
        tick_at REAL NOT NULL,
        item_id INTEGER,
        at      REAL NOT NULL,
        PRIMARY KEY (name, tick_at)
    ) WITHOUT ROWID;
    CREATE INDEX schedule_ticks_at ON schedule_ticks (at);
    """,
    # 7: observability. When the current claim began (renewals leave it be), for the time
    # an item has run; and the producer's trace context, saved at enqueue, so the span of
    # the item's execution links to the span that enqueued it, across processes.
    """
    ALTER TABLE items ADD COLUMN claimed_at REAL;
    ALTER TABLE items ADD COLUMN trace_context TEXT;
    """,
    # 8: combining rounds across processes. A holder that serves a slot's posted claims and
    # finishes writes the round's random token in the slot's row, in the same transaction,
    # so a waiter whose holder died can tell whether the round committed (see _combine).
    # A row is replaced only when its slot is served again, after its owner has looked.
    """
    CREATE TABLE combined_rounds (
        slot  INTEGER PRIMARY KEY,
        token BLOB NOT NULL
    );
    """,
    # 9: preflight that costs what changed, not the store's size. A pending item enqueued
    # with dedup and a done twin beside it (a "twin pair") is settled by the preflight,
    # which used to find pairs by joining every pending fingerprinted item against the
    # done ones, each step. Now the triggers below note the content (project and
    # fingerprint) of every pair as it forms, in the transaction that forms it, and the
    # preflight settles the noted contents only. A pair forms when an item becomes
    # pending with dedup while a done twin exists (inserted by an import or a copy,
    # requeued, released, retried, given its fingerprint by the backfill), or becomes
    # done while a pending twin exists without settling it (inserted done by a copy, or
    # given its fingerprint while done). A finish settles its pending twins itself, in
    # its own transaction, so a state moving to done is not watched. The pairs already
    # there are noted here.
    f"""
    CREATE TABLE twin_checks (
        project_id  TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        PRIMARY KEY (project_id, fingerprint)
    ) WITHOUT ROWID;
    INSERT OR IGNORE INTO twin_checks (project_id, fingerprint)
    SELECT DISTINCT p.project_id, p.fingerprint
    FROM items AS p
    JOIN items AS d INDEXED BY items_fingerprint
      ON d.project_id = p.project_id AND d.fingerprint = p.fingerprint AND d.state = 'done'
    WHERE p.state IN ('ready', 'deferred') AND p.dedup = 1 AND p.fingerprint IS NOT NULL;
{_TWIN_PAIR_TRIGGERS_9}
    """,
    # 10: a content's history costs nothing. Every look at a content's twins in a given
    # state (a done finish settling the pending ones, the enqueue's look for a done or a
    # live one, the pair probes of migration 9's triggers and of the preflight) read all
    # of its twins through items_fingerprint and tested each row's state: a content run
    # again and again (dedup off, or a schedule's) paid for every earlier run on every
    # finish. With the state in the key, each is a seek to the states it asks for. The
    # name stays: the triggers and statements that name the index (INDEXED BY) read it
    # as they did.
    # (And migration 5's line-keeping triggers made again, their first UPDATE led by the
    # index of claimable twins: see _HOLD_OTHERS_10.)
    f"""
    DROP INDEX items_fingerprint;
    CREATE INDEX items_fingerprint ON items (project_id, fingerprint, state)
        WHERE fingerprint IS NOT NULL;
    DROP TRIGGER items_twin_arrives;
    DROP TRIGGER items_twin_moves;
{_TWIN_TRIGGERS_10}
    """,
    # 11: a content's backlog costs nothing either. A done finish settles the content's
    # pending twins enqueued with dedup, and read every pending twin to find them: a line
    # of twins enqueued with dedup off (a content run again and again, faster than it
    # runs) paid for its whole length on every finish, so draining it was quadratic.
    # Those twins, the ones a settle and a pair's pending side want, now have an index of
    # their own (as on PostgreSQL), named by each look, the pair triggers' too (made
    # again). (dedup in items_fingerprint's key did it too, but each look for the first
    # id of some states, whatever the dedup, then sought every value of dedup: an
    # enqueue's look for a twin cost 3 to 5 µs more.)
    f"""
    CREATE INDEX items_dedup_twins ON items (project_id, fingerprint)
        WHERE fingerprint IS NOT NULL AND dedup = 1 AND state IN ('ready', 'deferred');
    DROP TRIGGER items_twin_pair_arrives;
    DROP TRIGGER items_twin_pair_forms;
{_TWIN_PAIR_TRIGGERS_11}
    """,
    # 12: the twin line's triggers without a table a firing. Migration 10's hold-back
    # (an UPDATE of the rows an IN (SELECT ...) lists) built a temporary table for every
    # firing, on every claim and every finish of a fingerprinted item: a claim and a
    # finish of one cost 1.8x a plain item's (0.9 ms against 0.5). The one claimable twin
    # to hold back is found by a seek (_HOLD_OTHERS_12).
    f"""
    DROP TRIGGER items_twin_arrives;
    DROP TRIGGER items_twin_moves;
{_TWIN_TRIGGERS_12}
    """,
    # 13: an import knows a source row by its content as well as its key. A key is given
    # out anew when the source table is dropped and made again (an import's own drop,
    # then the old queue started again), so a later import passed the new rows over as
    # imported before, and dropped them with the table. Each record keeps a digest of
    # what it copied; records from before have none (NULL), and are taken as they were.
    """
    ALTER TABLE imports ADD COLUMN digest TEXT;
    """,
)

SCHEMA_VERSION: Final = len(MIGRATIONS)

#: ``('done', 'failed', 'cancelled')``, for SQL below (from `_models.SETTLED_STATES`).
_SETTLED_STATES: Final = _models.sql_list(_models.SETTLED_STATES)
#: ``('ready', 'deferred', 'claimed', 'offloaded')`` (from `_models.LIVE_STATES`).
_LIVE_STATES: Final = _models.sql_list(_models.LIVE_STATES)

READ_HEADER: Final = "SELECT * FROM pragma_application_id, pragma_user_version"
COUNT_OBJECTS: Final = "SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"

# --- projects and scope ----------------------------------------------------------------

PROJECT_EXISTS: Final = "SELECT 1 FROM projects WHERE project_id = ?"
INSERT_PROJECT: Final = (
    "INSERT INTO projects (project_id, name, status, created_at) VALUES (?, ?, ?, ?)"
)
PROJECT_STATUS: Final = "SELECT status FROM projects WHERE project_id = ?"
SET_PROJECT_STATUS: Final = "UPDATE projects SET status = ? WHERE project_id = ?"
GET_PROJECT: Final = (
    "SELECT project_id, name, status, created_at FROM projects WHERE project_id = ?"
)
LIST_PROJECTS: Final = (
    "SELECT project_id, name, status, created_at FROM projects ORDER BY project_id"
)
ASSIGN: Final = (
    "INSERT INTO assignments (actor_id, project_id, assigned_at) VALUES (?, ?, ?) "
    "ON CONFLICT (actor_id, project_id) DO NOTHING"
)
UNASSIGN: Final = "DELETE FROM assignments WHERE actor_id = ? AND project_id = ?"
VISIBLE_PROJECTS: Final = (
    "SELECT project_id FROM assignments WHERE actor_id = ? ORDER BY project_id"
)
IS_ASSIGNED: Final = "SELECT 1 FROM assignments WHERE actor_id = ? AND project_id = ?"

# --- items -----------------------------------------------------------------------------

INSERT_ITEM: Final = """
INSERT INTO items (project_id, state, payload, priority, service_class, sla, fingerprint,
                   dedup, max_attempts, due_at, created_at, updated_at, trace_context)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
INSERT_ITEM_RETURNING: Final = INSERT_ITEM.rstrip() + " RETURNING item_id"
# A bulk insert's rows, several a statement, as the events below (`INSERT_EVENT_ROWS`).
# Besides the AUTOINCREMENT bookkeeping: a statement that fires triggers (a fingerprinted
# row's twin line and pair checks) keeps a journal of the pages it changes that its
# transaction changed before it, in a temporary file, so that it can be undone alone;
# one row a statement, that was a write a page, about 15 a row (2.3x a bulk enqueue's
# cost). 256 rows a statement journal each page once for all of them.
INSERT_ITEM_ROWS: Final = tuple(
    (rows, INSERT_ITEM.rstrip() + ", (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)" * (rows - 1))
    for rows in (256, 32, 8)
)
# Under the write lock, AUTOINCREMENT hands out consecutive ids: the next ones follow this.
LAST_ITEM_ID: Final = "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'items'), 0)"
INSERT_EVENT: Final = (
    "INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# A round's events, several rows a statement: an INSERT pays its AUTOINCREMENT bookkeeping
# (reading and writing sqlite_sequence) once a statement, where executemany pays it once a
# row. Two sizes only, so that the statements stay in the connection's statement cache:
# (rows, statement), largest first; what is left over goes one row a statement.
INSERT_EVENT_ROWS: Final = tuple(
    (rows, INSERT_EVENT + ", (?, ?, ?, ?, ?, ?, ?)" * (rows - 1)) for rows in (32, 8)
)

# Enqueue dedup: an earlier item of the project with the same fingerprint that has not
# failed nor been cancelled, the oldest done one first (its result is there already),
# else the oldest live one; NULL if none. Each a seek to its states in items_fingerprint
# (migration 10), so a content's long history is never read; and first a seek for any
# twin at all, so a content new to the store (an enqueue's usual one) costs one seek,
# not one a state.
FIND_TWIN: Final = f"""
SELECT CASE WHEN EXISTS (SELECT 1 FROM items INDEXED BY items_fingerprint
                         WHERE project_id = :project_id AND fingerprint = :fingerprint)
    THEN coalesce(
    (SELECT min(item_id) FROM items INDEXED BY items_fingerprint
     WHERE project_id = :project_id AND fingerprint = :fingerprint AND state = 'done'),
    (SELECT min(item_id) FROM items INDEXED BY items_fingerprint
     WHERE project_id = :project_id AND fingerprint = :fingerprint AND state IN {_LIVE_STATES})) END
"""

# A schedule's tick takes the id of a pending twin with dedup off only (`_rules.tick_item`:
# one nothing settles unrun), the oldest.
PENDING_TWIN: Final = f"""
SELECT min(item_id) FROM items INDEXED BY items_fingerprint
WHERE project_id = ? AND fingerprint = ? AND state IN {_models.sql_list(_models.PENDING_STATES)}
    AND dedup = 0
"""

# --- claims ----------------------------------------------------------------------------
# A claim runs inside BEGIN IMMEDIATE: the write lock is held from these reads to the
# UPDATE that records the claim, so no other writer can slip in between. It first lists
# the projects in its reach (open, the one asked for, the actor's: REACH_SIZE, _REACH), then
# reads, per project, the kinds of claimable item, each through its own partial index:
#   ready items, walked in claim order through that project's part of items_claim
#     (INDEXED BY: the order must come from the index, whatever the planner guesses, so a
#     claim costs the same at a thousand items or a million, and nothing another project
#     holds is ever stepped over);
#   deferred items of that project that have fallen due (retried, parked, not_before);
#   claimed items whose lease has lapsed (a takeover: few, read for all projects at once).
# The backend merges them in claim order (`_rules.ClaimMerge`). A ready item whose content
# twin is in line behind another one is held, out of items_claim (migration 5's triggers);
# every arm still skips an item whose twin runs (claimed here, or offloaded to an external
# batch): twins wait until it settles, so one piece of work is never paid twice, nor run
# twice at once. A claimed twin holds its pending twins back even after its lease lapses:
# it is the one to take over (with a higher fence, so its old holder cannot go on beside
# the new one). Between claimed twins (left from before a fingerprint was known) only a
# live lease holds back, so that one of two lapsed twins can always be taken over.

CLAIM_ORDER: Final = "priority DESC, service_class, sla IS NULL, sla, item_id"
_CLAIM_COLUMNS = (
    "item_id, state, fence, owner, attempts, max_attempts, project_id, fingerprint, "
    "priority, service_class, sla"
)
_IN_REACH = """
      AND project_id IN (SELECT project_id FROM projects WHERE status = 'open')
      AND (:project_id IS NULL OR project_id = :project_id)
      AND (:actor_id IS NULL
           OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
"""
_REACH = """
    status = 'open' AND (:project_id IS NULL OR project_id = :project_id)
    AND (:actor_id IS NULL
         OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))"""
# A project with limits is visited apart (LIMITS_IN_REACH), its first page no bigger than
# what its limits leave; one with nothing left is not visited at all.
_OPEN_REACH = f"""{_REACH}
    AND project_id NOT IN (SELECT project_id FROM project_limits)"""
# How many projects without limits a claim visits: with those limited ones that have
# room, the size of its first pages (`_rules.first_page`). A paused project, or one the
# actor is not assigned to, is never visited at all, whatever it holds.
REACH_SIZE: Final = f"SELECT count(*) FROM projects WHERE {_OPEN_REACH}"
# The limited projects in a claim's reach, each with its count of claimed items, read in
# the claim's write transaction (`_rules.quota` decides what each may give).
LIMITS_IN_REACH: Final = f"""
SELECT l.project_id, l.max_running, l.per_minute, l.burst, l.tokens, l.refilled_at,
       (SELECT count(*) FROM items INDEXED BY items_running
        WHERE items.project_id = l.project_id AND items.state = 'claimed')
FROM project_limits AS l JOIN projects USING (project_id)
WHERE {_REACH}
ORDER BY l.project_id
"""
# One project's limits (all None: it has none), or every limited project's, each with
# its count of claimed items.
_LIMITS_COLUMNS = """
    p.project_id, l.max_running, l.per_minute, l.burst, l.tokens, l.refilled_at,
    (SELECT count(*) FROM items INDEXED BY items_running
     WHERE items.project_id = p.project_id AND items.state = 'claimed')"""
GET_LIMITS: Final = f"""
SELECT {_LIMITS_COLUMNS}
FROM projects AS p LEFT JOIN project_limits AS l ON l.project_id = p.project_id
WHERE p.project_id = ?
"""
ALL_LIMITS: Final = f"""
SELECT {_LIMITS_COLUMNS}
FROM project_limits AS l JOIN projects AS p ON p.project_id = l.project_id
ORDER BY p.project_id
"""
PUT_LIMITS: Final = """
INSERT INTO project_limits (project_id, max_running, per_minute, burst, tokens, refilled_at)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (project_id) DO UPDATE SET
    max_running = excluded.max_running, per_minute = excluded.per_minute,
    burst = excluded.burst, tokens = excluded.tokens, refilled_at = excluded.refilled_at
"""
DELETE_LIMITS: Final = "DELETE FROM project_limits WHERE project_id = ?"
# What a claim leaves in a project's rate bucket. (tokens, refilled_at, project_id)
SPEND_TOKENS: Final = """
UPDATE project_limits SET tokens = ?, refilled_at = ? WHERE project_id = ?
"""


def _twin_of(alias: str) -> str:
    """A running twin of the row ``alias`` (claimed, or offloaded to an external batch)."""
    return f"""
           SELECT 1 FROM items AS twin INDEXED BY items_running_fingerprint
           WHERE twin.project_id = {alias}.project_id AND twin.fingerprint = {alias}.fingerprint
             AND twin.state IN ('claimed', 'offloaded') AND twin.fingerprint IS NOT NULL
             AND twin.item_id <> {alias}.item_id"""


_TWIN = _twin_of("items")
# A ready or deferred item may run: no twin of it runs (a running twin holds it back).
_NO_RUNNING_TWIN = f"(fingerprint IS NULL OR NOT EXISTS ({_TWIN}))"
# A claimed item with a lapsed lease: an offloaded twin, or one claimed under a live lease.
_TAKEABLE = f"""{_IN_REACH}
      AND (fingerprint IS NULL OR NOT EXISTS ({_TWIN}
             AND (twin.state = 'offloaded' OR twin.lease_expires_at > :now)))
"""
# One project's ready items, in claim order. (:project, :limit, :offset)
CLAIM_READY: Final = f"""
SELECT {_CLAIM_COLUMNS} FROM items INDEXED BY items_claim
WHERE project_id = :project AND state = 'ready' AND held = 0
  AND {_NO_RUNNING_TWIN}
ORDER BY {CLAIM_ORDER} LIMIT :limit OFFSET :offset
"""
# One project's deferred items that have fallen due. (:project, :now, :limit, :offset)
CLAIM_DUE: Final = f"""
SELECT {_CLAIM_COLUMNS} FROM items INDEXED BY items_project_due
WHERE project_id = :project AND state = 'deferred' AND due_at <= :now
  AND {_NO_RUNNING_TWIN}
ORDER BY {CLAIM_ORDER} LIMIT :limit OFFSET :offset
"""
_FIRST_COLUMNS = ", ".join(f"items.{column.strip()}" for column in _CLAIM_COLUMNS.split(","))
_FIRST_ORDER = "i.priority DESC, i.service_class, i.sla IS NULL, i.sla, i.item_id"
# The first page of every project in reach, ready ("r") and fallen due ("d"), in one
# statement: per project, one descent of its part of the index, each a correlated
# subquery SQLite runs in its own loop (a few microseconds a project, where a statement
# per project would cost a round through Python each). The rows of a page come in id
# order; `_rules.first_pages` puts them in claim order. (:project_id, :actor_id, :page;
# the due one also :now)
CLAIM_FIRST_PAGES: Final = f"""
WITH reach AS (SELECT project_id FROM projects WHERE {_OPEN_REACH})
SELECT 'r', {_FIRST_COLUMNS} FROM reach CROSS JOIN items
WHERE items.item_id IN (
    SELECT i.item_id FROM items AS i INDEXED BY items_claim
    WHERE i.project_id = reach.project_id AND i.state = 'ready' AND i.held = 0
      AND (i.fingerprint IS NULL OR NOT EXISTS ({_twin_of("i")}))
    ORDER BY {_FIRST_ORDER} LIMIT :page)
"""
# The same for the deferred items fallen due, read only when ANY_LAPSED_OR_DUE found any.
CLAIM_FIRST_DUE: Final = f"""
WITH reach AS (SELECT project_id FROM projects WHERE {_OPEN_REACH})
SELECT 'd', {_FIRST_COLUMNS} FROM reach CROSS JOIN items
WHERE items.item_id IN (
    SELECT i.item_id FROM items AS i INDEXED BY items_project_due
    WHERE i.project_id = reach.project_id AND i.state = 'deferred' AND i.due_at <= :now
      AND (i.fingerprint IS NULL OR NOT EXISTS ({_twin_of("i")}))
    ORDER BY {_FIRST_ORDER} LIMIT :page)
"""
CLAIM_LAPSED: Final = f"""
SELECT {_CLAIM_COLUMNS} FROM items INDEXED BY items_lease
WHERE state = 'claimed' AND lease_expires_at <= :now
  AND (max_attempts IS NULL OR attempts < max_attempts) {_TAKEABLE}
ORDER BY {CLAIM_ORDER} LIMIT :limit OFFSET :offset
"""
# Whether any lease has lapsed, or any deferred item fallen due, or any project has
# limits, at all: three index probes that let the common claim (nothing lapsed, nothing
# due, no limits) skip those arms entirely; and the reach's size (REACH_SIZE), in the
# same statement.
ANY_LAPSED_OR_DUE: Final = f"""
SELECT
    EXISTS (SELECT 1 FROM items INDEXED BY items_lease
            WHERE state = 'claimed' AND lease_expires_at <= :now),
    EXISTS (SELECT 1 FROM items INDEXED BY items_due
            WHERE state = 'deferred' AND due_at <= :now),
    EXISTS (SELECT 1 FROM project_limits),
    ({REACH_SIZE})
"""
# Lapsed claims that spent their last attempt: a claim fails them (a bounded number at a
# time) before it looks for work, instead of handing them on.
LAPSED_EXHAUSTED: Final = f"""
SELECT {_CLAIM_COLUMNS} FROM items INDEXED BY items_lease
WHERE state = 'claimed' AND lease_expires_at <= :now
  AND max_attempts IS NOT NULL AND attempts >= max_attempts {_TAKEABLE}
ORDER BY {CLAIM_ORDER} LIMIT :limit
"""

# The fence rises by one on every claim, and on a cancel (CANCEL_ITEM), never otherwise.
CLAIM_ITEM: Final = """
UPDATE items
SET state = 'claimed', fence = fence + 1, attempts = attempts + 1,
    owner = :owner, lease_expires_at = :lease_expires_at, due_at = NULL, updated_at = :now,
    claimed_at = :now
WHERE item_id = :item_id
RETURNING item_id, project_id, payload, fence, attempts, created_at, trace_context
"""
# A round's claims and finishes go several to a statement, their rows in one of two forms,
# each statement written once for both (the first parameter is now, bound in a CTE ``t``
# that the statement reads it from; plain ``?`` throughout, as numbered ones, ``?1``, made
# Python 3.12.0 to 3.12.3 warn on every binding, a CPython bug fixed in 3.12.4):
# - a JSON array, the second parameter, read through ``json_each``: any number of rows,
#   one statement;
# - VALUES_ROWS rows of bound parameters (the rest), for a round with at least VALUES_FROM
#   rows left, padded with rows of NULLs, which match no item. Bound, no ``json_each``
#   row is made and no ``json_extract`` looks its row up in SQLite's small cache of parsed
#   JSON (comparing the row's text, which holds a settle's result) and walks its path: a
#   claim costs about 1.4 µs less and a settle 0.7 µs.
# Only one size of the second: every statement a process runs is another compiled program
# (an UPDATE of items carries its triggers, about a thousand instructions). With a ladder
# of eleven sizes in rotation, 16 workers one item at a time drained about a tenth slower,
# compiled ahead or not (docs/architecture.md; most likely each size ran from cold caches).
#: The rows of a chunk of bound parameters.
VALUES_ROWS: Final = 64
#: The fewest rows a chunk of bound parameters is used for (the rest padding).
VALUES_FROM: Final = 48
assert 0 < VALUES_FROM <= VALUES_ROWS
#: The parameters of one row of a round's claims, and of its finishes as done.
CLAIM_ROW_WIDTH: Final = 3
SETTLE_ROW_WIDTH: Final = 4


def _values(rows: int, width: int) -> str:
    """``rows`` rows of ``width`` parameters, after now's."""
    return ",\n".join("(" + ", ".join("?" * width) + ")" for _ in range(rows))


#: The round's time, the first parameter of a chunk statement, read as ``(SELECT now FROM t)``.
_NOW_FIRST = "WITH t (now) AS (SELECT ?)"
_NOW = "(SELECT now FROM t)"


def _claim_items(rows: int | None) -> str:
    """CLAIM_ITEMS (``rows`` None: the JSON array) or CLAIM_ITEM_ROWS."""
    if rows is None:
        given, source = f"{_NOW_FIRST}\n", "json_each(?) AS c"
        item, owner, lease = (f"json_extract(c.value, '$[{n}]')" for n in range(CLAIM_ROW_WIDTH))
    else:
        rows_given = _values(rows, CLAIM_ROW_WIDTH)
        given = f"{_NOW_FIRST},\nc (item_id, owner, lease_expires_at) AS (VALUES {rows_given})\n"
        source, item, owner, lease = "c", "c.item_id", "c.owner", "c.lease_expires_at"
    return f"""
{given}UPDATE items
SET state = 'claimed', fence = fence + 1, attempts = attempts + 1,
    owner = {owner}, lease_expires_at = {lease},
    due_at = NULL, updated_at = {_NOW}, claimed_at = {_NOW}
FROM {source}
WHERE items.item_id = {item}
RETURNING items.item_id, items.project_id, items.payload, items.fence, items.attempts,
          items.created_at, items.trace_context
"""


#: A round's claims at once (one statement instead of one per item: a sixth to a quarter
#: less time per claim), each item with its own owner and lease: rows of ``[item_id,
#: owner, lease_expires_at]``, distinct items, as a JSON array. RETURNING as CLAIM_ITEM's,
#: in no particular order.
CLAIM_ITEMS: Final = _claim_items(None)
#: The same for VALUES_ROWS rows of bound parameters.
CLAIM_ITEM_ROWS: Final = _claim_items(VALUES_ROWS)

# A lapsed lease with no attempts left: the item fails instead of being taken over.
EXHAUST_ITEM: Final = """
UPDATE items SET state = 'failed', lease_expires_at = NULL, error = ?, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
"""

RENEW: Final = """
UPDATE items SET lease_expires_at = ?, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
  AND (? IS NULL OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = ?))
RETURNING lease_expires_at
"""

# --- settling ------------------------------------------------------------------------------
# Every settlement is fenced and state-guarded: it matches only the current claim of a
# claimed item, or of an offloaded one (an external batch settles later, at the fence the
# item had when it was offloaded). The guard is the UPDATE's WHERE clause, so a refused
# settlement writes nothing. RETURNING gives what the ledger event needs.

_SETTLE_GUARD = """
WHERE item_id = :item_id AND fence = :fence AND state IN ('claimed', 'offloaded')
  AND (:actor_id IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
"""
_SETTLED = "RETURNING owner, project_id, fingerprint, attempts, max_attempts, state"
SETTLE_DONE: Final = f"""
UPDATE items SET state = 'done', result = :result, error = NULL, lease_expires_at = NULL,
                 due_at = NULL, offload_handle = NULL, updated_at = :now
{_SETTLE_GUARD} {_SETTLED}
"""
SETTLE_FAILED: Final = f"""
UPDATE items SET state = 'failed', error = :error, lease_expires_at = NULL, due_at = NULL,
                 offload_handle = NULL, updated_at = :now
{_SETTLE_GUARD} {_SETTLED}
"""


def _settle_done_many(rows: int | None) -> str:
    """SETTLE_DONE_MANY (``rows`` None: the JSON array) or SETTLE_DONE_ROWS."""
    if rows is None:
        given, source = f"{_NOW_FIRST}\n", "json_each(?) AS f"
        item, fence, result, actor = (
            f"json_extract(f.value, '$[{n}]')" for n in range(SETTLE_ROW_WIDTH)
        )
    else:
        rows_given = _values(rows, SETTLE_ROW_WIDTH)
        given = f"{_NOW_FIRST},\nf (item_id, fence, result, actor_id) AS (VALUES {rows_given})\n"
        source, item, fence, result, actor = "f", "f.item_id", "f.fence", "f.result", "f.actor_id"
    return f"""
{given}UPDATE items SET state = 'done', result = {result}, error = NULL,
                 lease_expires_at = NULL, due_at = NULL, offload_handle = NULL,
                 updated_at = {_NOW}
FROM {source}
WHERE items.item_id = {item} AND items.fence = {fence}
  AND items.state IN ('claimed', 'offloaded')
  AND ({actor} IS NULL
       OR items.project_id IN (SELECT project_id FROM assignments WHERE actor_id = {actor}))
RETURNING items.item_id, items.owner, items.project_id, items.fingerprint
"""


#: A round's finishes as done at once, distinct items: rows of ``[item_id, fence,
#: result_json, actor_id]`` as a JSON array. Each is guarded as SETTLE_DONE is; a finish
#: it did not match wrote nothing. RETURNING gives the item ids that matched, then what
#: SETTLE_DONE returns, in no particular order.
SETTLE_DONE_MANY: Final = _settle_done_many(None)
#: The same for VALUES_ROWS rows of bound parameters.
SETTLE_DONE_ROWS: Final = _settle_done_many(VALUES_ROWS)
# Retry reads the attempt budget first (it decides between deferred and failed).
READ_BUDGET: Final = f"""
SELECT attempts, max_attempts, owner FROM items {_SETTLE_GUARD}
"""
SETTLE_DEFERRED: Final = f"""
UPDATE items SET state = 'deferred', due_at = :due_at, error = :error,
                 attempts = attempts - :refund, lease_expires_at = NULL, offload_handle = NULL,
                 updated_at = :now
{_SETTLE_GUARD} AND (:from_claimed_only = 0 OR state = 'claimed') {_SETTLED}
"""
# A claim given back unrun (a worker stopping): ready again at once, its attempt refunded.
RELEASE: Final = f"""
UPDATE items SET state = 'ready', attempts = attempts - 1, lease_expires_at = NULL,
                 updated_at = :now
{_SETTLE_GUARD} AND state = 'claimed' {_SETTLED}
"""
SETTLE_OFFLOADED: Final = f"""
UPDATE items SET state = 'offloaded', offload_handle = :handle, lease_expires_at = NULL,
                 updated_at = :now
{_SETTLE_GUARD} AND state = 'claimed' {_SETTLED}
"""

# When an item finishes done, its pending twins (same project, same fingerprint, ready or
# deferred, enqueued with dedup) are settled with a copy of its result, in the same
# transaction: from their own index (migration 11), never a read of the twins enqueued
# with dedup off.
SETTLE_TWINS: Final = """
UPDATE items INDEXED BY items_dedup_twins
SET state = 'done', result = :result, error = NULL, due_at = NULL, updated_at = :now
WHERE project_id = :project_id AND fingerprint = :fingerprint AND dedup = 1
  AND state IN ('ready', 'deferred') AND item_id <> :item_id
RETURNING item_id, fence
"""

# Preflight. A pending item enqueued with dedup whose twin is done is settled with a copy
# of the oldest done twin's result. The triggers of migration 9 note the content of each
# such pair as it forms (twin_checks), so a step looks at the noted contents only: the
# look (is one noted, in scope?) is a read of that table, and the write settles their
# pairs, then forgets the contents with no pair left. The whole store's pairs, found by
# the join below, are noted only by a full pass (`dedup_pending_against_done`). What
# makes a pair is written once (_PAIR_PENDING, _PAIR_DONE): the settle, the forgetting
# and the full pass must agree on it, or a note would go while its pair stays.
_PAIR_PENDING = "p.state IN ('ready', 'deferred') AND p.dedup = 1"
_PAIR_DONE = "d.state = 'done'"
_TWIN_CHECK_SCOPE = """
  AND (:project_id IS NULL OR c.project_id = :project_id)
  AND (:actor_id IS NULL
       OR c.project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
"""
ANY_TWIN_NOTED: Final = (
    f"SELECT EXISTS (SELECT 1 FROM twin_checks AS c WHERE 1 {_TWIN_CHECK_SCOPE})"
)
# (The oldest done twin by a seek to the content's first done id, not a join with every
# done twin: a content run again and again has many.)
NOTED_TWIN_PAIRS: Final = f"""
SELECT p.item_id, p.fence, oldest.item_id, oldest.result
FROM twin_checks AS c  -- first (CROSS JOIN keeps the order): the notes lead, not the store
CROSS JOIN items AS p INDEXED BY items_dedup_twins
CROSS JOIN items AS oldest
WHERE p.project_id = c.project_id AND p.fingerprint = c.fingerprint AND {_PAIR_PENDING}
  AND oldest.item_id = (
      SELECT min(d.item_id) FROM items AS d INDEXED BY items_fingerprint
      WHERE d.project_id = c.project_id AND d.fingerprint = c.fingerprint AND {_PAIR_DONE})
  {_TWIN_CHECK_SCOPE}
ORDER BY p.item_id
LIMIT :chunk
"""
FORGET_TWIN_CHECKS: Final = f"""
DELETE FROM twin_checks AS c
WHERE NOT EXISTS (
    SELECT 1 FROM items AS p INDEXED BY items_dedup_twins
    WHERE p.project_id = c.project_id AND p.fingerprint = c.fingerprint AND {_PAIR_PENDING}
      AND EXISTS (SELECT 1 FROM items AS d INDEXED BY items_fingerprint
                  WHERE d.project_id = c.project_id AND d.fingerprint = c.fingerprint
                    AND {_PAIR_DONE})) {_TWIN_CHECK_SCOPE}
"""
SETTLE_ONE_TWIN: Final = """
UPDATE items SET state = 'done', result = ?, error = NULL, due_at = NULL, updated_at = ?
WHERE item_id = ? AND state IN ('ready', 'deferred')
"""
# A full pass: every pair's content in scope, found by a join (a read), then noted.
ALL_TWIN_PAIRS: Final = f"""
SELECT DISTINCT p.project_id, p.fingerprint
FROM items AS p
JOIN items AS d INDEXED BY items_fingerprint
  ON d.project_id = p.project_id AND d.fingerprint = p.fingerprint AND {_PAIR_DONE}
WHERE {_PAIR_PENDING} AND p.fingerprint IS NOT NULL
  AND (:project_id IS NULL OR p.project_id = :project_id)
  AND (:actor_id IS NULL
       OR p.project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
"""
NOTE_TWIN_CHECK: Final = (
    "INSERT INTO twin_checks (project_id, fingerprint) VALUES (?, ?) ON CONFLICT DO NOTHING"
)
# Backfill: items without a fingerprint after a given id, in bounded chunks; read first,
# and written only when one of them gets a fingerprint. A look that reaches the end of the
# table moves the mark to the table's last id (BACKFILL_END, read in the same read
# transaction: a later item has a higher id, the writer's commits coming in id order), so
# a step walks the items written since the last, not the store (`_fingerprint.backfill`).
# (An index of the items without a fingerprint would do it too, as on PostgreSQL, but every
# enqueue of a store without an identity would pay for it: 26.4 against 25.0 µs an item in
# a bulk enqueue.)
MISSING_FINGERPRINTS: Final = """
SELECT item_id, payload FROM items
WHERE fingerprint IS NULL AND item_id > :after
  AND state NOT IN ('claimed', 'offloaded')  -- never under a running claim
  AND (:project_id IS NULL OR project_id = :project_id)
  AND (:actor_id IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
ORDER BY item_id LIMIT :chunk
"""
BACKFILL_END: Final = "SELECT max(item_id) FROM items"
SET_FINGERPRINT: Final = """
UPDATE items SET fingerprint = ?
WHERE item_id = ? AND fingerprint IS NULL AND state NOT IN ('claimed', 'offloaded')
"""


# When a lapsed claim can be taken over: its lapse, or later the lapse of a claimed twin's
# lease (between claimed twins, only a live lease holds back).
_TAKEOVER_AT = """max(lease_expires_at, coalesce((
        SELECT max(twin.lease_expires_at) FROM items AS twin INDEXED BY items_running_fingerprint
        WHERE twin.project_id = items.project_id AND twin.fingerprint = items.fingerprint
          AND twin.state IN ('claimed', 'offloaded') AND twin.fingerprint IS NOT NULL
          AND twin.state = 'claimed' AND twin.item_id <> items.item_id), 0))"""
_UNLIMITED = "AND project_id NOT IN (SELECT project_id FROM project_limits)"
# The earliest moment a deferred item falls due or a lease lapses, among the items a claim
# with the same filters could take then (the drain loop's alarm), in projects without
# limits: a time already past means there is work to claim now, never work this caller
# could not have. Limited projects are read apart (NEXT_DUE_LIMITED).
# The deferred side is a probe a project in reach (its first deferred item that may run,
# through its part of items_project_due): through items_due, a reach of one project
# walked every other project's deferred items due before its own first.
NEXT_DUE: Final = f"""
SELECT min(at) FROM (
    SELECT (SELECT min(due_at) FROM items INDEXED BY items_project_due
            WHERE items.project_id = projects.project_id AND state = 'deferred'
              AND {_NO_RUNNING_TWIN}) AS at
    FROM projects WHERE {_OPEN_REACH}
    UNION ALL
    SELECT min({_TAKEOVER_AT})
    FROM items INDEXED BY items_lease
    WHERE state = 'claimed' {_IN_REACH} {_UNLIMITED}
      AND (fingerprint IS NULL OR NOT EXISTS ({_TWIN} AND twin.state = 'offloaded')))
"""
# The same per limited project in reach, with its limits (`_rules.limited_due` says when
# a claim could take something of it): whether it has ready items, when its first
# deferred one falls due, when its first lapsed claim can be taken over.
NEXT_DUE_LIMITED: Final = f"""
SELECT l.project_id, l.max_running, l.per_minute, l.burst, l.tokens, l.refilled_at,
       (SELECT count(*) FROM items INDEXED BY items_running
        WHERE items.project_id = l.project_id AND items.state = 'claimed'),
       EXISTS (SELECT 1 FROM items INDEXED BY items_claim
               WHERE items.project_id = l.project_id AND state = 'ready' AND held = 0
                 AND {_NO_RUNNING_TWIN}),
       (SELECT min(due_at) FROM items INDEXED BY items_project_due
        WHERE items.project_id = l.project_id AND state = 'deferred'
          AND {_NO_RUNNING_TWIN}),
       (SELECT min({_TAKEOVER_AT}) FROM items INDEXED BY items_running
        WHERE items.project_id = l.project_id AND state = 'claimed'
          AND (fingerprint IS NULL OR NOT EXISTS ({_TWIN} AND twin.state = 'offloaded')))
FROM project_limits AS l JOIN projects USING (project_id)
WHERE {_REACH}
"""

# Why a fenced update matched nothing: absent, out of scope, or a stale fence.
DIAGNOSE_ITEM: Final = """
SELECT state, fence,
       EXISTS (SELECT 1 FROM assignments AS a
               WHERE a.actor_id = ? AND a.project_id = items.project_id) AS in_scope,
       error
FROM items WHERE item_id = ?
"""

_ITEM_COLUMNS = (
    "item_id, project_id, state, payload, fence, attempts, owner, lease_expires_at, "
    "created_at, updated_at, priority, service_class, sla, fingerprint, max_attempts, "
    "due_at, result, error, offload_handle, dedup, claimed_at, trace_context"
)
GET_ITEM: Final = f"SELECT {_ITEM_COLUMNS} FROM items WHERE item_id = ?"
#: Of the items `wait()` callers wait for (a JSON array of ids), those in one of the
#: states given (a JSON array) or gone.
ENDED_AMONG: Final = """
SELECT waited.value FROM json_each(?) AS waited
LEFT JOIN items ON items.item_id = waited.value
WHERE items.item_id IS NULL OR items.state IN (SELECT value FROM json_each(?))
"""
GET_ITEM_SCOPED: Final = (
    f"SELECT {_ITEM_COLUMNS} FROM items WHERE item_id = ? "
    "AND project_id IN (SELECT project_id FROM assignments WHERE actor_id = ?)"
)

OFFLOADED: Final = f"""
SELECT {_ITEM_COLUMNS} FROM items INDEXED BY items_offloaded
WHERE state = 'offloaded' AND offload_handle = :handle
  AND (:actor_id IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
ORDER BY item_id
"""

# A LEFT JOIN from the item, so "visible, no events yet" (one row of NULLs) differs from
# "not visible" (no row at all) in a single snapshot.
GET_EVENTS: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM items AS i LEFT JOIN events AS e ON e.item_id = i.item_id
WHERE i.item_id = ?
ORDER BY e.event_id
"""
GET_EVENTS_SCOPED: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM items AS i LEFT JOIN events AS e ON e.item_id = i.item_id
WHERE i.item_id = ?
  AND i.project_id IN (SELECT project_id FROM assignments WHERE actor_id = ?)
ORDER BY e.event_id
"""
# The newest :last events of an item, oldest first, read by id through the item's index:
# the older ones (and their details) are never read. A row of nulls for an item with none;
# no row for an item not there, or not the actor's.
GET_LAST_EVENTS: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM items AS i LEFT JOIN events AS e ON e.item_id = i.item_id
  AND e.event_id IN (SELECT event_id FROM events INDEXED BY events_by_item
                     WHERE item_id = :item_id ORDER BY event_id DESC LIMIT :last)
WHERE i.item_id = :item_id
  AND (:actor_id IS NULL
       OR i.project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
ORDER BY e.event_id
"""

# --- operating single items ---------------------------------------------------------------
# A cancel settles the item and raises its fence, as a takeover does, so whoever holds it
# is refused at their next report; a requeue puts a failed or cancelled item back in the
# ready queue with a fresh attempt budget. What they may do is `asyncplane._rules`'s to
# decide (`cancel_plan`, `requeue_event`); these write it.

CANCEL_ITEM: Final = """
UPDATE items SET state = 'cancelled', fence = ?, error = ?, lease_expires_at = NULL,
                 due_at = NULL, updated_at = ?
WHERE item_id = ?
"""
REQUEUE_ITEM: Final = """
UPDATE items SET state = 'ready', attempts = 0, error = NULL, result = NULL, owner = NULL,
                 lease_expires_at = NULL, due_at = NULL, offload_handle = NULL, updated_at = ?
WHERE item_id = ?
"""

# Listing. Each state asked for is an arm of its own, walked newest (or oldest) first
# from items_by_project (one project) or items_by_state (the whole store), so the page
# comes from an index whatever the store's size; the arms' pages meet in one ORDER BY.
# The claimed arm reads items_lease and sorts: there are as many as there are workers.
# Without a state or a project the primary key is the order. The other filters are
# checked on the rows each arm walks (a NULL parameter means "any").
_LISTED = (
    "item_id, project_id, state, {payload}, fence, attempts, owner, lease_expires_at, "
    "created_at, updated_at, priority, service_class, sla, fingerprint, max_attempts, "
    "due_at, {result}, error, offload_handle, dedup, claimed_at, trace_context"
)
# lower() folds ASCII letters only (SQLite without ICU), as a search's text is folded
# (see _validate.search_text): other letters match as written.
_LIST_FILTERS = """
      AND (:owner IS NULL OR owner = :owner)
      AND (:fingerprint IS NULL OR fingerprint = :fingerprint)
      AND (:created_after IS NULL OR created_at > :created_after)
      AND (:created_before IS NULL OR created_at < :created_before)
      AND (:updated_after IS NULL OR updated_at > :updated_after)
      AND (:updated_before IS NULL OR updated_at < :updated_before)
      AND (:error_contains IS NULL OR instr(lower(error), :error_contains) > 0)
      AND (:actor_id IS NULL
           OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
"""


@functools.lru_cache(maxsize=256)
def list_items(states: tuple[str, ...], project: bool, newest: bool, payload: bool) -> str:
    """The listing for ``states`` (none: any state), of one project (:project_id) or of
    all, within the keyset bound :after (`_rules.keyset_start`), at most :limit rows.

    The states are written into the SQL, not bound: a partial index serves a query only
    when its WHERE proves the index's, which a parameter cannot (they are names from
    `_models.ITEM_STATES`, checked here, never user input).
    """
    assert all(state in _models.ITEM_STATES for state in states)
    columns = _LISTED.format(
        payload="payload" if payload else "NULL", result="result" if payload else "NULL"
    )
    order = "item_id DESC" if newest else "item_id"
    keyset = "item_id <= :after" if newest else "item_id > :after"
    where = f"{keyset} {'AND project_id = :project_id' if project else ''} {_LIST_FILTERS}"
    if not states:
        return f"SELECT {columns} FROM items WHERE {where} ORDER BY {order} LIMIT :limit"
    listed = "items_by_project" if project else "items_by_state"
    # SQLite uses a partial index only when the query repeats its WHERE term.
    arms = {
        state: ("items_lease", "") if state == "claimed" else (listed, "AND state <> 'claimed'")
        for state in states
    }
    selects = [
        f"SELECT * FROM (SELECT {columns} FROM items INDEXED BY {index} "
        f"WHERE state = '{state}' {term} AND {where} ORDER BY {order} LIMIT :limit)"
        for state, (index, term) in arms.items()
    ]
    return " UNION ALL ".join(selects) + f" ORDER BY {order} LIMIT :limit"


# --- retention -----------------------------------------------------------------------------
# Settled items older than the cutoff, oldest first, a chunk at a time. Ready, deferred,
# claimed and offloaded items never match: only done, failed and cancelled ones are ever
# purged.

# A purge's next chunk: settled before the cutoff, after the last one the chunk before
# read (its last change, its id), so rows it passed over are not read again this purge.
PURGE_CANDIDATES: Final = f"""
SELECT {_ITEM_COLUMNS} FROM items INDEXED BY items_settled
WHERE state IN {_SETTLED_STATES} AND updated_at < :cutoff
  AND (updated_at > :after_at OR (updated_at = :after_at AND item_id > :after_id))
ORDER BY updated_at, item_id
LIMIT :chunk
"""
EVENTS_OF_ITEM: Final = """
SELECT event_id, item_id, event_type, fence, owner, actor_id, at, detail
FROM events WHERE item_id = ? ORDER BY event_id
"""
# An item still settled as archived (its id, fence and last change).
_AS_ARCHIVED: Final = f"item_id = ? AND fence = ? AND updated_at = ? AND state IN {_SETTLED_STATES}"
STANDING_AS_ARCHIVED: Final = f"SELECT 1 FROM items WHERE {_AS_ARCHIVED}"
# An item goes first, then its history (the ledger refuses to drop a live item's events).
PURGE_ITEM: Final = f"DELETE FROM items WHERE {_AS_ARCHIVED}"
PURGE_EVENTS: Final = "DELETE FROM events WHERE item_id = ?"

# --- imports --------------------------------------------------------------------------------

ALREADY_IMPORTED: Final = "SELECT 1 FROM imports WHERE source = ? AND source_key = ?"


# A copy's record of an item it brought (no digest: its key is the item's own id).
RECORD_IMPORT: Final = (
    "INSERT INTO imports (source, source_key, item_id, imported_at) VALUES (?, ?, ?, ?)"
)
# An imported row's record: the digest of its content, and the item it became. A row
# copied again (other content under its key) takes its key's record over.
# An import's drop of a source table: the last item an import of the source had made by
# then (a record of a row under an item up to it is of the table dropped). ($1 the drop's
# record name, $2 its key, $3 the source, $4 now)
DROPPED_UP_TO: Final = "SELECT item_id FROM imports WHERE source = ? AND source_key = ?"
RECORD_DROPPED: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at)
VALUES (?, ?, (SELECT coalesce(max(item_id), 0) FROM imports WHERE source = ?), ?)
ON CONFLICT (source, source_key) DO UPDATE
SET item_id = excluded.item_id, imported_at = excluded.imported_at
"""
IMPORTED_AS: Final = "SELECT digest, item_id FROM imports WHERE source = ? AND source_key = ?"
RECORD_IMPORTED_ROW: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at, digest) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (source, source_key) DO UPDATE
SET item_id = excluded.item_id, imported_at = excluded.imported_at, digest = excluded.digest
"""
# The source's columns, to check the names an import is told to read (identifiers cannot
# be bound as parameters, so they are checked against the table and quoted).

# --- copying between stores -----------------------------------------------------------------
# A copy keeps every item's id, row and history; the imports table remembers each item
# copied, keyed by the source, so a second run copies nothing twice.

LIST_ASSIGNMENTS: Final = (
    "SELECT actor_id, project_id, assigned_at FROM assignments ORDER BY project_id, actor_id"
)
EXPORT_ITEMS: Final = f"""
SELECT {_ITEM_COLUMNS} FROM items
WHERE item_id > :after AND (:pending_only = 0 OR state NOT IN {_SETTLED_STATES})
ORDER BY item_id LIMIT :chunk
"""
COPY_PROJECT: Final = """
INSERT INTO projects (project_id, name, status, created_at) VALUES (?, ?, ?, ?)
ON CONFLICT (project_id) DO NOTHING
"""
COPY_LIMITS: Final = """
INSERT INTO project_limits (project_id, max_running, per_minute, burst, tokens, refilled_at)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (project_id) DO NOTHING
"""
COPY_ASSIGNMENT: Final = (
    "INSERT INTO assignments (actor_id, project_id, assigned_at) VALUES (?, ?, ?) "
    "ON CONFLICT (actor_id, project_id) DO NOTHING"
)
# The settings a copy added, recorded under its source's label with `_rules.COPIED_SETTINGS`
# appended, in the import records (`item_id` 0: no item): never added again from it.
RECORDED_SETTINGS: Final = "SELECT source_key FROM imports WHERE source = ?"
RECORD_SETTING: Final = (
    "INSERT INTO imports (source, source_key, item_id, imported_at) VALUES (?, ?, 0, ?) "
    "ON CONFLICT (source, source_key) DO NOTHING"
)
# Whether a copy from this source brought anything here (its items' records).
ANY_RECORD: Final = "SELECT 1 FROM imports WHERE source = ? LIMIT 1"
# A schedule copied before moves on to the source's place (`_rules.copy_settings_plan`).
MOVE_COPIED_SCHEDULE: Final = (
    "UPDATE schedules SET next_at = ?, last_at = ?, updated_at = ? WHERE name = ?"
)
ITEM_EXISTS: Final = "SELECT 1 FROM items WHERE item_id = ?"
# What a copy compares of an item it copied before with the source's (`_rules.copied_here`).
COPIED_ITEM: Final = "SELECT project_id, created_at FROM items WHERE item_id = ?"
# The first item no copy from a source brought (a copy records each under its id's text,
# `_copy_items`): the look a copy takes before it writes.
FIRST_FOREIGN_ITEM: Final = """
SELECT item_id FROM items
WHERE NOT EXISTS (SELECT 1 FROM imports
                  WHERE source = ? AND source_key = CAST(items.item_id AS TEXT))
ORDER BY item_id LIMIT 1
"""
COPY_ITEM: Final = f"""
INSERT INTO items ({_ITEM_COLUMNS}) VALUES ({", ".join("?" * 22)})
"""
# The import records, in key order, a page after a key (a copy carries them over).
EXPORT_IMPORTS: Final = """
SELECT source, source_key, item_id, imported_at, digest FROM imports
WHERE (source, source_key) > (?, ?) ORDER BY source, source_key LIMIT ?
"""
# A record the destination has already is taken if the source's names a later item (a row
# imported again since: ids only rise).
COPY_IMPORT: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at, digest) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (source, source_key) DO UPDATE
SET item_id = excluded.item_id, imported_at = excluded.imported_at, digest = excluded.digest
WHERE excluded.item_id > imports.item_id
"""
# Ids up to a copy's source's last are never handed out here: AUTOINCREMENT's counter
# moves past them (and never back).
ADVANCE_ITEM_IDS: Final = """
UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'items'
"""
START_ITEM_IDS: Final = """
INSERT INTO sqlite_sequence (name, seq)
SELECT 'items', ? WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'items')
"""
# A copy's record of the ids it kept clear (`<source>#ids`, key "last"), beside its items'.
RECORD_ITEM_IDS: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at) VALUES (? || '#ids', 'last', ?, ?)
ON CONFLICT (source, source_key) DO UPDATE SET item_id = max(item_id, excluded.item_id)
"""
# The highest id copies from a source brought (their items' keys are the ids) or kept clear.
COPIED_UP_TO: Final = """
SELECT coalesce((SELECT max(CAST(source_key AS INTEGER)) FROM imports WHERE source = ?), 0),
       (SELECT item_id FROM imports WHERE source = ? || '#ids' AND source_key = 'last')
"""

# --- stats ----------------------------------------------------------------------------------

#: From the indexes, as COUNT_STATES counts (items_by_project holds every state but
#: claimed, items_running the claimed): never the table's rows, payloads and all, which a
#: dashboard asked for on every page and every sample (0.6 s at a million items).
STATES_BY_PROJECT: Final = """
SELECT project_id, state, count(*) FROM items INDEXED BY items_by_project
WHERE state <> 'claimed' GROUP BY project_id, state
UNION ALL
SELECT project_id, 'claimed', count(*) FROM items INDEXED BY items_running
WHERE state = 'claimed' GROUP BY project_id
ORDER BY 1, 2
"""
OLDEST_READY: Final = """
SELECT min(created_at) FROM items INDEXED BY items_by_state
WHERE state = 'ready' AND state <> 'claimed'  -- (the index leaves the claimed out)
"""
EXPIRED_LEASES: Final = """
SELECT count(*) FROM items INDEXED BY items_lease
WHERE state = 'claimed' AND lease_expires_at <= ?
"""
READ_SCHEMA_VERSION: Final = "PRAGMA user_version"
#: The store's tables, and its indexes and triggers with their text (SQLite's own objects,
#: and the indexes it makes for a key, which have no text, left out).
SCHEMA_TABLES: Final = (
    "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
)
SCHEMA_DERIVED: Final = """
    SELECT type, name, sql FROM sqlite_master
    WHERE type IN ('index', 'trigger') AND sql IS NOT NULL
      AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"""

#: Whether a slot's combined round committed; the token of the round serving a slot.
COMBINED_ROUND: Final = "SELECT 1 FROM combined_rounds WHERE slot = ? AND token = ?"
INSERT_COMBINED_ROUND: Final = "INSERT OR REPLACE INTO combined_rounds (slot, token) VALUES (?, ?)"

# --- counts --------------------------------------------------------------------------------

# Counted from the indexes, a project at a time: a project's part of items_by_project
# (every state but claimed) and of items_running (the claimed), never the table's rows
# (a scan of the whole table, payloads and all, for one small project, once a dashboard
# row). Its rows: (state, count), a state once.
_COUNTED_PROJECTS = """project_id IN (
    SELECT project_id FROM projects
    WHERE (:project_id IS NULL OR project_id = :project_id)
      AND (:actor_id IS NULL
           OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id)))"""
COUNT_STATES: Final = f"""
SELECT state, count(*) FROM items INDEXED BY items_by_project
WHERE {_COUNTED_PROJECTS} AND state <> 'claimed'
GROUP BY state
UNION ALL
SELECT 'claimed', count(*) FROM items INDEXED BY items_running
WHERE {_COUNTED_PROJECTS} AND state = 'claimed'
"""

# What the probe checks a run against: whole-store totals of the ledger, in one pass ...
LEDGER_TALLY: Final = """
SELECT
    (SELECT count(*) FROM items) AS items,
    coalesce(sum(event_type = 'claimed'), 0) AS claims,
    coalesce(sum(event_type = 'lease_expired'), 0) AS takeovers,
    coalesce(sum(event_type IN ('done', 'failed')), 0) AS terminal_events
FROM events
"""
# ... items settled more than once ...
SETTLED_TWICE: Final = """
SELECT item_id FROM events WHERE event_type IN ('done', 'failed')
GROUP BY item_id HAVING count(*) > 1 ORDER BY item_id
"""
# ... and items claimed more often than one first claim plus one per recorded way back
# to claimable (a takeover, a retry, a park): a claim nothing explains is a duplicate.
UNEXPLAINED_CLAIMS: Final = """
SELECT item_id FROM events
GROUP BY item_id
HAVING sum(event_type = 'claimed')
       > 1 + sum(event_type IN ('lease_expired', 'retried', 'parked', 'requeued', 'released'))
ORDER BY item_id
"""
# ... and, per claimant, how many of its claims were taken over.
TAKEN_FROM: Final = _models.TAKEN_FROM
TAKEN_AFTER_LAST_CLAIM: Final = _models.TAKEN_AFTER_LAST_CLAIM
# Items in a given state (the probe's check for lost work).
ITEM_IDS_IN_STATE: Final = "SELECT item_id FROM items WHERE state = ? ORDER BY item_id"


# --- the ledger verifier ---------------------------------------------------------------
# One query per problem kind, each returning (item_id, detail), each a single pass over
# an index. They run in one read transaction so every check sees the same snapshot.

#: The replay of an event type to the state it leaves: made from `_models.EVENT_TYPES`.
_REPLAYED: Final = _models.replay_case("e.event_type", "quote")
#: Events that settle an item, and the states they leave (from `_models`).
_SETTLING: Final = _models.sql_list(_models.SETTLING_EVENTS)


# Settled items per minute, project and state since a time, through items_settled: the
# dashboard's throughput (an hour of it once, then only the last minutes again).
SETTLED_PER_MINUTE: Final = f"""
SELECT CAST(updated_at / 60 AS INTEGER) * 60 AS minute, project_id, state, count(*)
FROM items INDEXED BY items_settled
WHERE state IN {_SETTLED_STATES} AND updated_at >= :since
  AND (:actor_id IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = :actor_id))
GROUP BY minute, project_id, state
ORDER BY minute, project_id, state
"""

LEDGER_CHECKS: Final[tuple[tuple[str, str], ...]] = (
    (
        "no_creation_event",
        """
        SELECT i.item_id, 'no "queued" event for an item in state ' || i.state
        FROM items AS i
        WHERE NOT EXISTS (SELECT 1 FROM events AS e
                          WHERE e.item_id = i.item_id AND e.event_type = 'queued')
        """,
    ),
    (
        # Settled twice with no requeue between: of the settling and requeue events in
        # order, one settling event follows another.
        "two_terminal_events",
        f"""
        SELECT s.item_id,
               'terminal events ' || group_concat(s.previous || ' then ' || s.event_type, ', ')
               || ' with no requeue between'
        FROM (SELECT item_id, event_type,
                     lag(event_type) OVER (PARTITION BY item_id ORDER BY event_id) AS previous
              FROM events WHERE event_type IN {_SETTLING} OR event_type = 'requeued') AS s
        WHERE s.event_type <> 'requeued' AND s.previous <> 'requeued'
          AND EXISTS (SELECT 1 FROM items AS i WHERE i.item_id = s.item_id)
        GROUP BY s.item_id
        """,
    ),
    *_models.settling_checks(),
    (
        # A claim raises the fence by one, and so does a cancel: their fences only rise.
        "fence_not_monotonic",
        """
        SELECT item_id, event_type || ' fence ' || fence || ' follows fence ' || previous
        FROM (SELECT item_id, event_type, fence,
                     lag(fence) OVER (PARTITION BY item_id ORDER BY event_id) AS previous
              FROM events WHERE event_type IN ('claimed', 'cancelled'))
        WHERE fence <= previous
        GROUP BY item_id
        """,
    ),
    (
        "fence_disagrees",
        """
        SELECT i.item_id,
               'row fence ' || i.fence || ' but the last claim or cancel recorded fence '
               || coalesce(c.fence, 'none')
        FROM items AS i
        LEFT JOIN (SELECT item_id, fence FROM events
                   WHERE event_id IN (SELECT max(event_id) FROM events
                                      WHERE event_type IN ('claimed', 'cancelled')
                                      GROUP BY item_id)) AS c
               ON c.item_id = i.item_id
        WHERE i.fence IS NOT coalesce(c.fence, 0)
        """,
    ),
    (
        "ready_after_claim",
        _models.ready_after_claim_check(),
    ),
    (
        # Replay: the state an item's last event leaves it in (see EVENT_TYPES) must be the
        # row's. Left to the kinds above: rows with no events at all, settled rows whose
        # settling events (since the last requeue) are missing or disagree, a settling
        # event under a live row, and a ready row that was claimed.
        "state_disagrees",
        f"""
        SELECT i.item_id, 'row is ' || quote(i.state) || ' but its events lead to ' || r.replayed
        FROM items AS i
        JOIN (SELECT e.item_id,
                     {_REPLAYED} AS replayed
              FROM events AS e
              WHERE e.event_id IN (SELECT max(event_id) FROM events GROUP BY item_id)) AS r
          ON r.item_id = i.item_id
        WHERE i.state IS NOT r.replayed
          {_models.left_to_other_checks("i")}
        """,
    ),
    ("owner_disagrees", _models.OWNER_DISAGREES),
    ("never_moves_on", _models.never_moves_on()),
    (
        # A held twin with no running or claimable twin of its content: nothing would
        # ever free it (the line-up triggers of the claim index prevent this).
        "twin_stranded",
        """
        SELECT i.item_id, 'held in line, but no twin of it runs or is claimable to free it'
        FROM items AS i INDEXED BY items_held
        WHERE i.state = 'ready' AND i.held = 1
          AND NOT EXISTS (SELECT 1 FROM items AS t INDEXED BY items_running_fingerprint
                          WHERE t.project_id = i.project_id AND t.fingerprint = i.fingerprint
                            AND t.state IN ('claimed', 'offloaded') AND t.fingerprint IS NOT NULL)
          AND NOT EXISTS (SELECT 1 FROM items AS t INDEXED BY items_next_twin
                          WHERE t.project_id = i.project_id AND t.fingerprint = i.fingerprint
                            AND t.state = 'ready' AND t.held = 0 AND t.fingerprint IS NOT NULL)
        """,
    ),
    (
        "orphan_events",
        """
        SELECT CASE WHEN typeof(e.item_id) = 'integer' THEN e.item_id ELSE 0 END,
               count(*) || ' event(s) for an item that does not exist'
               || CASE WHEN typeof(e.item_id) = 'integer' THEN ''
                       ELSE ' (stored under ' || quote(e.item_id) || ', not an item id)' END
        FROM events AS e
        WHERE NOT EXISTS (SELECT 1 FROM items AS i WHERE i.item_id = e.item_id)
        GROUP BY e.item_id
        """,
    ),
)

#: The checks of one item (its page in the dashboard), read from that item's rows alone:
#: each check's statement with ``items`` and ``events`` standing for the item's row and
#: its events (a CTE of each name, which the statement's unqualified names then mean; in
#: its body the name is the table). Filtered after, a check read the whole index
#: (4 s a page at a million items). One that looks at other items too
#: (`_models.CHECKS_OF_OTHER_ITEMS`) is still read whole, then filtered.
_ONE_ITEM_SCOPED: Final = (
    "WITH events AS (SELECT * FROM main.events WHERE item_id = :item_id), "
    "items AS (SELECT * FROM main.items WHERE item_id = :item_id) {check}"
)
_ONE_ITEM_FILTERED: Final = (
    "WITH found (item_id, detail) AS ({check}) "
    "SELECT item_id, detail FROM found WHERE item_id = :item_id"
)
ONE_ITEM_CHECKS: Final = _models.one_item_checks(
    LEDGER_CHECKS, _ONE_ITEM_SCOPED, _ONE_ITEM_FILTERED
)

# --- schedules -----------------------------------------------------------------------------
# `asyncplane._schedule` decides when ticks fall and which a run enqueues; these read and
# write it. A tick's key goes in first (RESERVE_TICK), in the transaction that enqueues its
# item: a tick whose key is there already is never enqueued again.

_SCHEDULE_COLUMNS = (
    "name, project_id, payload, cron, every, timezone, catch_up, priority, service_class, "
    "fingerprint, dedup, max_attempts, paused, anchor, next_at, last_at, created_at, updated_at"
)
GET_SCHEDULE: Final = f"SELECT {_SCHEDULE_COLUMNS} FROM schedules WHERE name = ?"
LIST_SCHEDULES: Final = f"SELECT {_SCHEDULE_COLUMNS} FROM schedules ORDER BY name"
# A schedule declared again keeps whether it is paused, its last tick and its birth.
PUT_SCHEDULE: Final = f"""
INSERT INTO schedules ({_SCHEDULE_COLUMNS})
VALUES ({", ".join("?" * 18)})
ON CONFLICT (name) DO UPDATE SET
    project_id = excluded.project_id, payload = excluded.payload, cron = excluded.cron,
    every = excluded.every, timezone = excluded.timezone, catch_up = excluded.catch_up,
    priority = excluded.priority, service_class = excluded.service_class,
    fingerprint = excluded.fingerprint, dedup = excluded.dedup,
    max_attempts = excluded.max_attempts, anchor = excluded.anchor,
    next_at = excluded.next_at, updated_at = excluded.updated_at
"""
PAUSE_SCHEDULE: Final = """
UPDATE schedules SET paused = ?, next_at = ?, updated_at = ? WHERE name = ?
"""
DELETE_SCHEDULE: Final = "DELETE FROM schedules WHERE name = ?"
DELETE_TICKS: Final = "DELETE FROM schedule_ticks WHERE name = ?"
# The schedules with a tick due, the earliest first. (now, limit)
DUE_SCHEDULES: Final = f"""
SELECT {_SCHEDULE_COLUMNS} FROM schedules INDEXED BY schedules_due
WHERE paused = 0 AND next_at <= ? AND (cron IS NULL OR ?)
  AND name NOT IN (SELECT value FROM json_each(?))
ORDER BY next_at, name LIMIT ?
"""
RESERVE_TICK: Final = """
INSERT INTO schedule_ticks (name, tick_at, item_id, at) VALUES (?, ?, NULL, ?)
ON CONFLICT DO NOTHING
"""
FILL_TICK: Final = "UPDATE schedule_ticks SET item_id = ? WHERE name = ? AND tick_at = ?"
MOVE_SCHEDULE: Final = """
UPDATE schedules SET next_at = ?, last_at = coalesce(?, last_at), updated_at = ? WHERE name = ?
"""
FORGET_TICKS: Final = "DELETE FROM schedule_ticks WHERE name = ? AND tick_at < ?"
NEXT_TICK: Final = """
SELECT min(next_at) FROM schedules INDEXED BY schedules_due
WHERE paused = 0 AND (cron IS NULL OR ?)
"""
NEXT_CRON_TICK: Final = """
SELECT min(next_at) FROM schedules INDEXED BY schedules_due
WHERE paused = 0 AND cron IS NOT NULL
"""
SCHEDULE_TICKS: Final = """
SELECT name, tick_at, item_id, at FROM schedule_ticks WHERE name = ?
ORDER BY tick_at DESC LIMIT ?
"""
COPY_SCHEDULE: Final = PUT_SCHEDULE[: PUT_SCHEDULE.index("ON CONFLICT")] + (
    "ON CONFLICT (name) DO NOTHING\n"
)
