"""Every SQL statement of the SQLite backend's operations, as named constants.

(Connection pragmas live with connection setup in `asyncplane._connection`; BEGIN
IMMEDIATE and COMMIT are issued by the writer, where a reader can see them.)

Nothing here is ever formatted with user input: values travel only as bound parameters.
Where a statement has a scoped and an unscoped form, both are written out in full so a
reader sees exactly what runs.

Times are REAL seconds since the Unix epoch (wall clock, UTC). Item ids come from
AUTOINCREMENT so an id is never reused, even after rows are purged: a late report or an
orphaned event can then never be mistaken for a newer item's.
"""

from __future__ import annotations

from typing import Final

#: Written to the header so a foreign SQLite file is recognised as "not ours" ('APLN').
APPLICATION_ID: Final = 0x41504C4E

# --- schema and migrations -------------------------------------------------------------

#: Migration n takes the schema from user_version n-1 to n. Append, never edit.
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
)

SCHEMA_VERSION: Final = len(MIGRATIONS)

READ_HEADER: Final = "SELECT * FROM pragma_application_id, pragma_user_version"
COUNT_OBJECTS: Final = "SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"

# --- projects and scope ----------------------------------------------------------------

PROJECT_EXISTS: Final = "SELECT 1 FROM projects WHERE project_id = ?"
INSERT_PROJECT: Final = (
    "INSERT INTO projects (project_id, name, status, created_at) VALUES (?, ?, ?, ?)"
)
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

INSERT_ITEM: Final = (
    "INSERT INTO items (project_id, state, payload, created_at, updated_at) "
    "VALUES (?, 'ready', ?, ?, ?) RETURNING item_id"
)
INSERT_EVENT: Final = (
    "INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)

# Claim candidates: the oldest ready items, merged with the oldest items whose lease has
# lapsed, of open projects only. Each arm walks its own partial index (INDEXED BY: the
# order must come from an index, whatever the planner guesses; a claim must not sort the
# queue), and the outer ORDER BY merges at most 2 * limit rows. Run inside BEGIN
# IMMEDIATE: the write lock is held from this read to the UPDATE that records the claim,
# so no other writer can slip in between.
CLAIM_CANDIDATES: Final = """
SELECT item_id, state, fence, owner FROM (
    SELECT item_id, state, fence, owner FROM items INDEXED BY items_ready
    WHERE state = 'ready'
      AND project_id IN (SELECT project_id FROM projects WHERE status = 'open')
    ORDER BY item_id LIMIT :limit
)
UNION ALL
SELECT item_id, state, fence, owner FROM (
    SELECT item_id, state, fence, owner FROM items INDEXED BY items_lease
    WHERE state = 'claimed' AND lease_expires_at <= :now
      AND project_id IN (SELECT project_id FROM projects WHERE status = 'open')
    ORDER BY item_id LIMIT :limit
)
ORDER BY item_id LIMIT :limit
"""

CLAIM_CANDIDATES_SCOPED: Final = """
SELECT item_id, state, fence, owner FROM (
    SELECT item_id, state, fence, owner FROM items INDEXED BY items_ready
    WHERE state = 'ready'
      AND project_id IN (
          SELECT a.project_id FROM assignments AS a JOIN projects AS p USING (project_id)
          WHERE a.actor_id = :actor_id AND p.status = 'open')
    ORDER BY item_id LIMIT :limit
)
UNION ALL
SELECT item_id, state, fence, owner FROM (
    SELECT item_id, state, fence, owner FROM items INDEXED BY items_lease
    WHERE state = 'claimed' AND lease_expires_at <= :now
      AND project_id IN (
          SELECT a.project_id FROM assignments AS a JOIN projects AS p USING (project_id)
          WHERE a.actor_id = :actor_id AND p.status = 'open')
    ORDER BY item_id LIMIT :limit
)
ORDER BY item_id LIMIT :limit
"""

# The fence rises by one on every claim and is never set any other way.
CLAIM_ITEM: Final = """
UPDATE items
SET state = 'claimed', fence = fence + 1, attempts = attempts + 1,
    owner = ?, lease_expires_at = ?, updated_at = ?
WHERE item_id = ?
RETURNING item_id, project_id, payload, fence, attempts
"""

RENEW: Final = """
UPDATE items SET lease_expires_at = ?, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
RETURNING lease_expires_at
"""
RENEW_SCOPED: Final = """
UPDATE items SET lease_expires_at = ?, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
  AND project_id IN (SELECT project_id FROM assignments WHERE actor_id = ?)
RETURNING lease_expires_at
"""

FINISH: Final = """
UPDATE items SET state = ?, lease_expires_at = NULL, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
RETURNING owner
"""
FINISH_SCOPED: Final = """
UPDATE items SET state = ?, lease_expires_at = NULL, updated_at = ?
WHERE item_id = ? AND state = 'claimed' AND fence = ?
  AND project_id IN (SELECT project_id FROM assignments WHERE actor_id = ?)
RETURNING owner
"""

# Why a fenced update matched nothing: absent, out of scope, or a stale fence.
DIAGNOSE_ITEM: Final = """
SELECT state, fence,
       EXISTS (SELECT 1 FROM assignments AS a
               WHERE a.actor_id = ? AND a.project_id = items.project_id) AS in_scope
FROM items WHERE item_id = ?
"""

_ITEM_COLUMNS = (
    "item_id, project_id, state, payload, fence, attempts, owner, lease_expires_at, "
    "created_at, updated_at"
)
GET_ITEM: Final = f"SELECT {_ITEM_COLUMNS} FROM items WHERE item_id = ?"
GET_ITEM_SCOPED: Final = (
    f"SELECT {_ITEM_COLUMNS} FROM items WHERE item_id = ? "
    "AND project_id IN (SELECT project_id FROM assignments WHERE actor_id = ?)"
)

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

# --- counts --------------------------------------------------------------------------------

COUNT_STATES: Final = "SELECT state, count(*) FROM items GROUP BY state"

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
# ... and items claimed more often than one first claim plus one per recorded takeover:
# a claim that no lapsed lease explains is a duplicate claim.
UNEXPLAINED_CLAIMS: Final = """
SELECT item_id FROM events
GROUP BY item_id
HAVING sum(event_type = 'claimed') > 1 + sum(event_type = 'lease_expired')
ORDER BY item_id
"""
# Items in a given state (the probe's check for lost work).
ITEM_IDS_IN_STATE: Final = "SELECT item_id FROM items WHERE state = ? ORDER BY item_id"

# --- deliberate faults, for the probe's self-test only --------------------------------------
# A second terminal event for the first done item: what a double report would leave.
FAULT_DUPLICATE_FINISH: Final = """
INSERT INTO events (item_id, event_type, fence, owner, at)
SELECT item_id, 'done', fence, 'fault', ? FROM items
WHERE state = 'done' ORDER BY item_id LIMIT 1
"""
# A queued item deleted behind the store's back: lost work.
FAULT_DELETE_ITEM: Final = """
DELETE FROM items WHERE item_id = (SELECT max(item_id) FROM items WHERE state = 'ready')
"""

# --- the ledger verifier ---------------------------------------------------------------
# One query per problem kind, each returning (item_id, detail), each a single pass over
# an index. They run in one read transaction so every check sees the same snapshot.

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
        "two_terminal_events",
        """
        SELECT e.item_id, count(*) || ' terminal events: ' || group_concat(e.event_type, ', ')
        FROM events AS e
        WHERE e.event_type IN ('done', 'failed')
          AND EXISTS (SELECT 1 FROM items AS i WHERE i.item_id = e.item_id)
        GROUP BY e.item_id HAVING count(*) > 1
        """,
    ),
    (
        "terminal_without_event",
        """
        SELECT i.item_id, 'row is ' || i.state || ' but no terminal event was recorded'
        FROM items AS i
        WHERE i.state IN ('done', 'failed')
          AND NOT EXISTS (SELECT 1 FROM events AS e
                          WHERE e.item_id = i.item_id AND e.event_type IN ('done', 'failed'))
        """,
    ),
    (
        "terminal_events_disagree",
        """
        SELECT i.item_id, 'row is ' || i.state || ' but an event says ' || e.event_type
        FROM items AS i JOIN events AS e ON e.item_id = i.item_id
        WHERE i.state IN ('done', 'failed')
          AND e.event_type IN ('done', 'failed') AND e.event_type <> i.state
        GROUP BY i.item_id
        """,
    ),
    (
        "event_without_terminal",
        """
        SELECT i.item_id, 'a ' || e.event_type || ' event exists but the row is ' || i.state
        FROM items AS i JOIN events AS e ON e.item_id = i.item_id
        WHERE i.state NOT IN ('done', 'failed') AND e.event_type IN ('done', 'failed')
        GROUP BY i.item_id
        """,
    ),
    (
        "fence_not_monotonic",
        """
        SELECT item_id, 'claim fence ' || fence || ' follows claim fence ' || previous
        FROM (SELECT item_id, fence,
                     lag(fence) OVER (PARTITION BY item_id ORDER BY event_id) AS previous
              FROM events WHERE event_type = 'claimed')
        WHERE fence <= previous
        GROUP BY item_id
        """,
    ),
    (
        "fence_disagrees",
        """
        SELECT i.item_id,
               'row fence ' || i.fence || ' but the last claim recorded fence '
               || coalesce(c.fence, 'none')
        FROM items AS i
        LEFT JOIN (SELECT item_id, fence FROM events
                   WHERE event_id IN (SELECT max(event_id) FROM events
                                      WHERE event_type = 'claimed' GROUP BY item_id)) AS c
               ON c.item_id = i.item_id
        WHERE i.fence IS NOT coalesce(c.fence, 0)
        """,
    ),
    (
        "ready_after_claim",
        """
        SELECT i.item_id, 'row is ready but the item was claimed at fence ' || max(e.fence)
        FROM items AS i JOIN events AS e ON e.item_id = i.item_id
        WHERE i.state = 'ready' AND e.event_type = 'claimed'
        GROUP BY i.item_id
        """,
    ),
    (
        # What the kinds above leave out: a state no event leads to. A row "claimed" with
        # no claim recorded, or in a state asyncplane never writes.
        "state_disagrees",
        """
        SELECT i.item_id,
               CASE WHEN i.state IN ('ready', 'claimed', 'done', 'failed')
                    THEN 'row is ' || i.state || ' but no claim was ever recorded'
                    ELSE 'row is in unknown state ' || quote(i.state) END
        FROM items AS i
        WHERE i.state NOT IN ('ready', 'claimed', 'done', 'failed')
           OR (i.state = 'claimed'
               AND NOT EXISTS (SELECT 1 FROM events AS e
                               WHERE e.item_id = i.item_id AND e.event_type = 'claimed'))
        """,
    ),
    (
        "orphan_events",
        """
        SELECT e.item_id, count(*) || ' event(s) for an item that does not exist'
        FROM events AS e
        WHERE NOT EXISTS (SELECT 1 FROM items AS i WHERE i.item_id = e.item_id)
        GROUP BY e.item_id
        """,
    ),
)
