"""Every SQL statement of the PostgreSQL backend's operations, as named constants.

The schema is the SQLite backend's, in PostgreSQL's words; the statements differ where the
mechanism differs:

* Claims read candidates ``FOR UPDATE SKIP LOCKED``: workers in other processes or on
  other hosts claim side by side, each skipping the rows another is taking, instead of
  queueing behind one write lock as SQLite does.
* Content twins (one running item per fingerprint per project) are guarded twice: a
  claim first tries a transaction-level advisory lock per content it is about to start
  (one claimer at a time starts a given content; a claim that does not get it skips that
  item, never waits), and a partial unique index refuses a second running twin whatever
  happens, so two claimers on different hosts cannot both start one.
* Enqueue dedup takes a transaction-level advisory lock per fingerprint, so two
  concurrent enqueues of the same content agree on one id.
* Times are float8 seconds since the Unix epoch. "Now" comes from the database server's
  clock (``clock_timestamp()``, read once per write transaction), so workers on hosts
  with skewed clocks agree on when a lease lapses; a test may inject a clock instead.

Parameters are positional (``$1``) and typed where PostgreSQL could not infer a NULL's
type. Nothing here is ever formatted with user input.
"""

from __future__ import annotations

import functools
from typing import Final

from asyncplane import _models, _validate

#: Written into the meta table so a foreign schema is recognised as "not ours".
APPLICATION: Final = "asyncplane"

#: The channel a commit that may have made work claimable notifies (see migration 1).
CHANNEL: Final = "asyncplane"
#: The channel a commit that settled an awaited item notifies (see migrations 2 and 6).
SETTLED_CHANNEL: Final = "asyncplane_settled"


def twin_channel(session: int) -> str:
    """The channel a twin written unheld beside a live twin tells the process of the
    session that wrote it on, in case a settle under way missed it (see migration 13)."""
    return f"asyncplane_twin_{session}"


# --- schema and migrations -------------------------------------------------------------

# Migration 3's trigger function for a twin arriving ready (written once for it, never
# edited; migration 8 makes it again with one probe changed, from this text).
_TWIN_ARRIVES_3 = """    CREATE FUNCTION asyncplane_twin_arrives() RETURNS trigger
    LANGUAGE plpgsql SET enable_seqscan = off AS $$
    DECLARE
        ahead bigint;
        ahead_held boolean;
        goes_first boolean;
    BEGIN
        -- (One query of three probes, one per index of the line, never a walk over the
        -- done twins.) No twin ready or running: no line to take a place in.
        IF NOT EXISTS (
            (SELECT 1 FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state IN ('claimed', 'offloaded') AND item_id <> NEW.item_id)
            UNION ALL
            (SELECT 1 FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state = 'ready' AND NOT held AND item_id <> NEW.item_id)
            UNION ALL
            (SELECT 1 FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state = 'ready' AND held AND item_id <> NEW.item_id))
        THEN
            NEW.held := false;
            RETURN NEW;
        END IF;
        -- A running twin holds it back (locked: it cannot stop running unseen).
        PERFORM 1 FROM items
        WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
          AND state IN ('claimed', 'offloaded') AND item_id <> NEW.item_id
        FOR SHARE SKIP LOCKED;
        IF FOUND THEN
            NEW.held := true;
            RETURN NEW;
        END IF;
        SELECT item_id, held,
               (-priority, service_class, sla IS NULL, coalesce(sla, 0), item_id)
               < (-NEW.priority, NEW.service_class, NEW.sla IS NULL, coalesce(NEW.sla, 0),
                  NEW.item_id)
        INTO ahead, ahead_held, goes_first
        FROM (
            (SELECT item_id, held, priority, service_class, sla FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state = 'ready' AND held AND item_id <> NEW.item_id
             ORDER BY priority DESC, service_class, sla NULLS LAST, item_id LIMIT 1)
            UNION ALL
            SELECT item_id, held, priority, service_class, sla FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state = 'ready' AND NOT held AND item_id <> NEW.item_id) AS line
        ORDER BY priority DESC, service_class, sla NULLS LAST, item_id LIMIT 1;
        IF ahead IS NULL OR NOT goes_first THEN
            -- First in line: the claimable twin there was waits behind it.
            NEW.held := false;
            UPDATE items SET held = true
            WHERE item_id IN (
                SELECT item_id FROM items
                WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
                  AND state = 'ready' AND NOT held AND item_id <> NEW.item_id
                FOR UPDATE SKIP LOCKED);
            RETURN NEW;
        END IF;
        -- A twin goes first: it is the claimable one (locked, or made so here).
        IF ahead_held THEN
            UPDATE items SET held = false
            WHERE item_id = (SELECT item_id FROM items
                             WHERE item_id = ahead AND state = 'ready' AND held
                             FOR UPDATE SKIP LOCKED);
        ELSE
            PERFORM 1 FROM items WHERE item_id = ahead AND state = 'ready' AND NOT held
            FOR SHARE SKIP LOCKED;
        END IF;
        NEW.held := FOUND;  -- (not found: moved, or locked; claimable beside it)
        RETURN NEW;
    END $$;"""
# Its first look, whether the content has a twin ready or running (three probes, one per
# index of the line); migration 8's, one probe of the content's live twins that filtered
# out the deferred ones (a content with many read them all); and migration 10's.
_ANY_IN_LINE_3 = """
        -- (One query of three probes, one per index of the line, never a walk over the
        -- done twins.) No twin ready or running: no line to take a place in.
        IF NOT EXISTS (
            (SELECT 1 FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state IN ('claimed', 'offloaded') AND item_id <> NEW.item_id)
            UNION ALL
            (SELECT 1 FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state = 'ready' AND NOT held AND item_id <> NEW.item_id)
            UNION ALL
            (SELECT 1 FROM items
             WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
               AND state = 'ready' AND held AND item_id <> NEW.item_id))"""
_ANY_IN_LINE_8 = """
        -- (One probe of the content's live twins, never a walk over its history.) No
        -- twin ready or running: no line to take a place in.
        IF NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state IN ('ready', 'claimed', 'offloaded') AND item_id <> NEW.item_id)"""
_ANY_LIVE_10 = """
        -- (A probe of the content's live twins that stops at the first, whatever its
        -- state: what follows finds the line, if any, through the line's own indexes.)
        -- No twin pending or running: no line to take a place in.
        IF NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state IN ('ready', 'deferred', 'claimed', 'offloaded')
              AND item_id <> NEW.item_id)"""

# Migration 3's trigger function for a twin line moving on (never edited; migration 13
# makes it again, from this text, with the wake-ups it sends).
_LINE_MOVES_ON_3 = """    CREATE FUNCTION asyncplane_line_moves_on() RETURNS trigger
    LANGUAGE plpgsql SET enable_seqscan = off AS $$
    DECLARE
        first_twin bigint;
    BEGIN
        IF NEW.state NOT IN ('claimed', 'offloaded') THEN
            -- One hand-off of a content's place at a time (a lock of its own, apart from
            -- the claimers' try-locks): each looks in a snapshot taken after the one
            -- before it committed, so of two moves at once (a cancel of the claimable
            -- twin and the settle of the running one) the second sees the first's.
            PERFORM pg_advisory_xact_lock(hashtextextended(
                current_schema() || chr(1) || NEW.project_id || chr(1) || NEW.fingerprint, 2));
            LOOP
                IF EXISTS (
                    SELECT 1 FROM items
                    WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
                      AND state IN ('claimed', 'offloaded'))
                THEN
                    RETURN NULL;  -- a twin runs: its own trigger held the line
                END IF;
                SELECT item_id INTO first_twin FROM (
                    (SELECT item_id, priority, service_class, sla FROM items
                     WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
                       AND state = 'ready' AND held
                     ORDER BY priority DESC, service_class, sla NULLS LAST, item_id LIMIT 1)
                    UNION ALL
                    SELECT item_id, priority, service_class, sla FROM items
                    WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
                      AND state = 'ready' AND NOT held) AS line
                ORDER BY priority DESC, service_class, sla NULLS LAST, item_id LIMIT 1;
                IF first_twin IS NULL THEN
                    RETURN NULL;
                END IF;
                -- The first in line becomes claimable (always: waited for if need be).
                UPDATE items SET held = false
                WHERE item_id = first_twin AND state = 'ready' AND held;
                IF NOT FOUND THEN
                    PERFORM 1 FROM items
                    WHERE item_id = first_twin AND state = 'ready' AND NOT held
                    FOR SHARE SKIP LOCKED;
                END IF;
                EXIT WHEN FOUND;  -- it is claimable, and locked here: the others wait behind it
                IF EXISTS (SELECT 1 FROM items
                           WHERE item_id = first_twin AND state = 'ready' AND NOT held) THEN
                    RETURN NULL;  -- claimable, locked by a claimer: the others stay as they are
                END IF;
                -- It moved meanwhile: look again.
            END LOOP;
        END IF;
        UPDATE items SET held = true
        WHERE item_id IN (
            SELECT item_id FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state = 'ready' AND NOT held AND item_id IS DISTINCT FROM first_twin
            FOR UPDATE SKIP LOCKED);
        RETURN NULL;
    END $$;"""


_TWIN_ARRIVES_8 = _models.edited(
    _models.edited(_TWIN_ARRIVES_3, "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"),
    _ANY_IN_LINE_3,
    _ANY_IN_LINE_8,
)
_TWIN_ARRIVES_10 = _models.edited(_TWIN_ARRIVES_8, _ANY_IN_LINE_8, _ANY_LIVE_10)
# Migration 13's: the twin line's trigger sends the wake-up a twin's settle owes the
# fleet, and only it (from migration 3's text, with three edits).
_WAKE = "PERFORM pg_notify('asyncplane', current_schema());"
_LINE_MOVES_ON_13 = _models.edited(
    _models.edited(
        _models.edited(
            _models.edited(_LINE_MOVES_ON_3, "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"),
            """
                IF first_twin IS NULL THEN
                    RETURN NULL;
                END IF;""",
            f"""
                IF first_twin IS NULL THEN
                    -- No line. Twins deferred while this one ran were left out of the
                    -- drainers' alarms (NEXT_DUE): they look again.
                    IF OLD.state IN ('claimed', 'offloaded') AND EXISTS (
                        SELECT 1 FROM items
                        WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
                          AND state = 'deferred' AND item_id <> NEW.item_id)
                    THEN
                        {_WAKE}
                    END IF;
                    RETURN NULL;
                END IF;""",
        ),
        """
                    RETURN NULL;  -- claimable, locked by a claimer: the others stay as they are""",
        f"""
                    {_WAKE}  -- (it may be claimable once this commits)
                    RETURN NULL;  -- claimable, locked by a claimer: the others stay as they are""",
    ),
    """
            END LOOP;""",
    f"""
            END LOOP;
            {_WAKE}  -- the first in line is claimable""",
)
# And migration 13's twin arriving ready, made again to tell its process when it is left
# unheld beside a live twin (not a running twin's own release: its line's trigger looks
# after that one).
_TELL_13 = """IF TG_OP = 'INSERT' OR OLD.state NOT IN ('claimed', 'offloaded') THEN
                PERFORM pg_notify('asyncplane_twin_' || pg_backend_pid(),
                                  json_build_array(NEW.project_id, NEW.fingerprint)::text);
            END IF;"""
_TWIN_ARRIVES_13 = _models.edited(
    _models.edited(
        _TWIN_ARRIVES_10,
        """
                FOR UPDATE SKIP LOCKED);
            RETURN NEW;
        END IF;""",
        f"""
                FOR UPDATE SKIP LOCKED);
            {_TELL_13}
            RETURN NEW;
        END IF;""",
    ),
    """
        NEW.held := FOUND;  -- (not found: moved, or locked; claimable beside it)
        RETURN NEW;""",
    f"""
        NEW.held := FOUND;  -- (not found: moved, or locked; claimable beside it)
        IF NOT NEW.held THEN
            {_TELL_13}
        END IF;
        RETURN NEW;""",
)
# The settle of a done item's pending twins enqueued with dedup, each with its fence, as
# migration 12's function runs it ($1 project_id, $2 fingerprint, $3 the done item, $4
# its result, $5 now: the function's first arguments). Frozen here, as migration 12's
# text.
SETTLE_TWINS_12: Final = """
        UPDATE items SET state = 'done', result = $4, error = NULL, due_at = NULL,
                         updated_at = $5
        WHERE project_id = $1 AND fingerprint = $2 AND dedup
          AND state IN ('ready', 'deferred') AND item_id <> $3
        RETURNING item_id, fence"""


#: Migration n takes the schema from version n-1 to n. Append, never edit.
MIGRATIONS: Final[tuple[str, ...]] = (
    # 1: the whole store as of SQLite schema 3, in one step.
    """
    CREATE TABLE asyncplane_meta (
        key   text PRIMARY KEY,
        value text NOT NULL
    );
    CREATE TABLE projects (
        project_id  text PRIMARY KEY,
        name        text NOT NULL,
        status      text NOT NULL,
        created_at  float8 NOT NULL
    );
    CREATE TABLE assignments (
        actor_id    text NOT NULL,
        project_id  text NOT NULL REFERENCES projects (project_id),
        assigned_at float8 NOT NULL,
        PRIMARY KEY (actor_id, project_id)
    );
    CREATE TABLE items (
        item_id          bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        project_id       text NOT NULL REFERENCES projects (project_id),
        state            text NOT NULL,
        payload          text NOT NULL,
        fence            bigint NOT NULL DEFAULT 0,
        attempts         bigint NOT NULL DEFAULT 0,
        owner            text,
        lease_expires_at float8,
        created_at       float8 NOT NULL,
        updated_at       float8 NOT NULL,
        priority         bigint NOT NULL DEFAULT 0,
        service_class    text NOT NULL DEFAULT 'standard',
        sla              float8,
        fingerprint      text,
        dedup            boolean NOT NULL DEFAULT true,
        max_attempts     bigint,
        due_at           float8,
        result           text,
        error            text,
        offload_handle   text
    );
    -- The claim order, from the index: higher priority first, then realtime before
    -- standard, then the earliest SLA with none last, then the oldest id.
    CREATE INDEX items_ready
        ON items (priority DESC, service_class, sla NULLS LAST, item_id)
        WHERE state = 'ready';
    CREATE INDEX items_lease ON items (lease_expires_at) WHERE state = 'claimed';
    CREATE INDEX items_due ON items (due_at) WHERE state = 'deferred';
    CREATE INDEX items_fingerprint ON items (project_id, fingerprint)
        WHERE fingerprint IS NOT NULL;
    -- At most one running item per content: the guard that holds across hosts.
    CREATE UNIQUE INDEX items_running_fingerprint ON items (project_id, fingerprint)
        WHERE fingerprint IS NOT NULL AND state IN ('claimed', 'offloaded');
    CREATE INDEX items_offloaded ON items (offload_handle) WHERE state = 'offloaded';
    CREATE INDEX items_settled ON items (updated_at) WHERE state IN ('done', 'failed');
    CREATE TABLE events (
        event_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        item_id    bigint NOT NULL,
        event_type text NOT NULL,
        fence      bigint NOT NULL,
        owner      text,
        actor_id   text,
        at         float8 NOT NULL,
        detail     text
    );
    CREATE INDEX events_by_item ON events (item_id, event_type, fence);
    CREATE TABLE imports (
        source      text NOT NULL,
        source_key  text NOT NULL,
        item_id     bigint NOT NULL,
        imported_at float8 NOT NULL,
        PRIMARY KEY (source, source_key)
    );
    -- Append-only: an event, once written, is never rewritten, and never removed while
    -- its item exists (retention removes an item first, then its history).
    CREATE FUNCTION asyncplane_refuse_event_update() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'the asyncplane ledger is append-only';
    END $$;
    CREATE TRIGGER events_append_only BEFORE UPDATE ON events
        FOR EACH ROW EXECUTE FUNCTION asyncplane_refuse_event_update();
    CREATE FUNCTION asyncplane_refuse_event_delete() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF EXISTS (SELECT 1 FROM items WHERE item_id = OLD.item_id) THEN
            RAISE EXCEPTION 'the asyncplane ledger is append-only';
        END IF;
        RETURN OLD;
    END $$;
    CREATE TRIGGER events_kept BEFORE DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION asyncplane_refuse_event_delete();
    -- Wake sleeping drainers (LISTEN asyncplane) when work may have become claimable:
    -- an item was added, went back to waiting (a retry, a park), or settled while twins
    -- of it may wait. A plain claim or finish notifies nobody: every notification costs
    -- each listening process a wake-up, and a commit that notifies takes the server's
    -- notification lock. PostgreSQL sends it at commit, once per transaction.
    CREATE FUNCTION asyncplane_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('asyncplane', current_schema());
        RETURN NULL;
    END $$;
    CREATE TRIGGER items_added AFTER INSERT ON items
        FOR EACH STATEMENT EXECUTE FUNCTION asyncplane_notify();
    CREATE TRIGGER items_moved AFTER UPDATE OF state ON items
        FOR EACH ROW WHEN (NEW.state IS DISTINCT FROM OLD.state
                           AND (NEW.state IN ('ready', 'deferred')
                                OR (NEW.state IN ('done', 'failed')
                                    AND NEW.fingerprint IS NOT NULL)))
        EXECUTE FUNCTION asyncplane_notify();
    -- A project reopened, or an actor given one, may make waiting items claimable too.
    CREATE TRIGGER projects_moved AFTER UPDATE OF status ON projects
        FOR EACH STATEMENT EXECUTE FUNCTION asyncplane_notify();
    CREATE TRIGGER assignments_added AFTER INSERT ON assignments
        FOR EACH STATEMENT EXECUTE FUNCTION asyncplane_notify();
    """,
    # 2: operating single items, as SQLite's migration 4: the cancelled state (purged like
    # done and failed; a cancelled item with twins wakes drainers, as a settled one does),
    # listing indexes, and a channel of its own for settles, which wait() listens to
    # (drainers do not: a settle makes no work claimable unless it frees twins).
    """
    DROP INDEX items_settled;
    CREATE INDEX items_settled ON items (updated_at)
        WHERE state IN ('done', 'failed', 'cancelled');
    CREATE INDEX items_by_state ON items (state, item_id) WHERE state <> 'claimed';
    CREATE INDEX items_by_project ON items (project_id, state, item_id)
        WHERE state <> 'claimed';
    DROP TRIGGER items_moved ON items;
    CREATE TRIGGER items_moved AFTER UPDATE OF state ON items
        FOR EACH ROW WHEN (NEW.state IS DISTINCT FROM OLD.state
                           AND (NEW.state IN ('ready', 'deferred')
                                OR (NEW.state IN ('done', 'failed', 'cancelled')
                                    AND NEW.fingerprint IS NOT NULL)))
        EXECUTE FUNCTION asyncplane_notify();
    CREATE FUNCTION asyncplane_notify_settled() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('asyncplane_settled', current_schema());
        RETURN NULL;
    END $$;
    CREATE TRIGGER items_settled_notify AFTER UPDATE OF state ON items
        FOR EACH ROW WHEN (NEW.state IS DISTINCT FROM OLD.state
                           AND NEW.state IN ('done', 'failed', 'cancelled'))
        EXECUTE FUNCTION asyncplane_notify_settled();
    """,
    # 3: no claim pays for work it cannot take, as SQLite's migration 5: the claim order
    # per project, and twins in line (held out of the claim index while a twin runs or
    # goes first). Transactions on several hosts move one content's twins at once. The
    # rule that keeps a twin from being lost: a trigger holds a twin back only while it
    # has a lock on the row it relies on (the running twin, or the claimable one ahead;
    # FOR SHARE), so that row cannot stop running, or leave the line, until this
    # transaction commits, and the trigger of whoever moves it then sees the held twin and
    # hands it the place. Holding back is never waited for: with that row locked by
    # another transaction (a claimer, a renewal), the twin stays claimable beside it (the
    # claim still skips a twin of a running item), and the line is set right when it next
    # moves. Handing the place on is always done, one hand-off per content at a time (a
    # lock per content, taken only by a move that ends a running or claimable twin), and
    # checked again against the row (it may have been cancelled meanwhile).
    f"""
    ALTER TABLE items ADD COLUMN held boolean NOT NULL DEFAULT false;
    UPDATE items SET held = true
    WHERE state = 'ready' AND fingerprint IS NOT NULL AND item_id NOT IN (
        SELECT item_id FROM (
            SELECT item_id, project_id, fingerprint, row_number() OVER (
                PARTITION BY project_id, fingerprint
                ORDER BY priority DESC, service_class, sla NULLS LAST, item_id) AS place
            FROM items WHERE state = 'ready' AND fingerprint IS NOT NULL) AS ranked
        WHERE place = 1 AND NOT EXISTS (
            SELECT 1 FROM items AS twin
            WHERE twin.project_id = ranked.project_id AND twin.fingerprint = ranked.fingerprint
              AND twin.state IN ('claimed', 'offloaded')));
    DROP INDEX items_ready;
    CREATE INDEX items_claim
        ON items (project_id, priority DESC, service_class, sla NULLS LAST, item_id)
        WHERE state = 'ready' AND NOT held;
    CREATE INDEX items_project_due ON items (project_id, due_at) WHERE state = 'deferred';
    CREATE INDEX items_held
        ON items (project_id, fingerprint, priority DESC, service_class, sla NULLS LAST, item_id)
        WHERE state = 'ready' AND held;
    CREATE INDEX items_next_twin ON items (project_id, fingerprint)
        WHERE state = 'ready' AND NOT held AND fingerprint IS NOT NULL;
    -- Their plans must come from the line's indexes even when the table's statistics are
    -- stale (a bulk enqueue into a fresh store), or each row would scan the table.
    --
    -- A twin that arrives ready (enqueued, requeued, released) takes its place in line
    -- before it is written, so a bulk enqueue of one content's twins writes each row
    -- once, not once claimable and then again held.
{_TWIN_ARRIVES_3}
    CREATE TRIGGER items_twin_arrives BEFORE INSERT OR UPDATE OF state, fingerprint ON items
        FOR EACH ROW WHEN (NEW.state = 'ready' AND NEW.fingerprint IS NOT NULL)
        EXECUTE FUNCTION asyncplane_twin_arrives();
    -- A twin that starts running holds every claimable twin back; one that stops running,
    -- or a claimable one that leaves the line, hands its place to the first in line. (At
    -- most one twin runs at a time here: the unique index on running twins makes a second
    -- wait until this transaction commits.)
{_LINE_MOVES_ON_3}
    -- (A running twin copied in from another store holds its twins back as well.)
    CREATE TRIGGER items_running_twin_arrives AFTER INSERT ON items
        FOR EACH ROW WHEN (NEW.state IN ('claimed', 'offloaded') AND NEW.fingerprint IS NOT NULL)
        EXECUTE FUNCTION asyncplane_line_moves_on();
    CREATE TRIGGER items_line_moves_on AFTER UPDATE OF state, fingerprint ON items
        FOR EACH ROW WHEN (NEW.fingerprint IS NOT NULL AND (
            (OLD.fingerprint IS NULL AND NEW.state IN ('claimed', 'offloaded'))
            OR (OLD.state IS DISTINCT FROM NEW.state
                AND ((NEW.state IN ('claimed', 'offloaded'))
                         <> (OLD.state IN ('claimed', 'offloaded'))
                     OR (OLD.state = 'ready' AND NOT OLD.held)))))
        EXECUTE FUNCTION asyncplane_line_moves_on();
    """,
    # 4: schedules and limits, as SQLite's migration 6. A claim takes the locks of the
    # limited projects in its reach (asyncplane_take_limits: an advisory lock per project,
    # taken in project order, then their claimed items counted in a statement of its own,
    # which sees every claim committed before the locks were had), so two hosts never both
    # take a project's last slot or token; claims of projects without limits take none.
    # A claimed item of a project with max_running that stops running wakes the drainers
    # of every host (a slot freed), as does any change of limits.
    """
    CREATE TABLE project_limits (
        project_id  text PRIMARY KEY REFERENCES projects (project_id),
        max_running bigint,
        per_minute  float8,
        burst       bigint,
        tokens      float8,
        refilled_at float8
    );
    CREATE INDEX items_running ON items (project_id) WHERE state = 'claimed';
    CREATE TABLE schedules (
        name          text PRIMARY KEY,
        project_id    text NOT NULL REFERENCES projects (project_id),
        payload       text NOT NULL,
        cron          text,
        every         float8,
        timezone      text NOT NULL,
        catch_up      text NOT NULL,
        priority      bigint NOT NULL,
        service_class text NOT NULL,
        fingerprint   text,
        dedup         boolean NOT NULL,
        max_attempts  bigint,
        paused        boolean NOT NULL DEFAULT false,
        anchor        float8 NOT NULL,
        next_at       float8 NOT NULL,
        last_at       float8,
        created_at    float8 NOT NULL,
        updated_at    float8 NOT NULL
    );
    CREATE INDEX schedules_due ON schedules (next_at) WHERE NOT paused;
    CREATE TABLE schedule_ticks (
        name    text NOT NULL,
        tick_at float8 NOT NULL,
        item_id bigint,
        at      float8 NOT NULL,
        PRIMARY KEY (name, tick_at)
    );
    CREATE INDEX schedule_ticks_at ON schedule_ticks (at);
    CREATE FUNCTION asyncplane_take_limits(reach_project text, reach_actor text,
                                           only_these text[])
    RETURNS TABLE (project_id text, max_running bigint, per_minute float8, burst bigint,
                   tokens float8, refilled_at float8, running bigint)
    -- Planned once per session, not per claim (the server would plan the queries below
    -- afresh each time, for arrays and reaches it cannot size).
    LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
    #variable_conflict use_column
    DECLARE
        taken text[] := '{}';
        limited text;
    BEGIN
        -- Held shared to the commit, before any project's lock: see CLAIM_CANDIDATES.
        PERFORM pg_advisory_xact_lock_shared(
            hashtextextended('asyncplane-limits:' || current_schema(), 0));
        -- Each limited project's lock (an advisory lock: nothing written to take it), in
        -- one order on every host; projects limited since the claim began (only_these)
        -- are not waited for: this claim holds item locks by now, and those another
        -- claimer holds are left to it.
        FOR limited IN
            SELECT l.project_id FROM project_limits AS l
            JOIN projects AS p ON p.project_id = l.project_id
            WHERE p.status = 'open'
              AND (reach_project IS NULL OR l.project_id = reach_project)
              AND (reach_actor IS NULL OR l.project_id IN (
                  SELECT a.project_id FROM assignments AS a WHERE a.actor_id = reach_actor))
              AND (only_these IS NULL OR l.project_id = ANY (only_these))
            ORDER BY l.project_id
        LOOP
            IF only_these IS NULL THEN
                PERFORM pg_advisory_xact_lock(hashtextextended(
                    'asyncplane-limit:' || current_schema() || chr(1) || limited, 0));
            ELSIF NOT pg_try_advisory_xact_lock(hashtextextended(
                    'asyncplane-limit:' || current_schema() || chr(1) || limited, 0)) THEN
                CONTINUE;
            END IF;
            taken := taken || limited;
        END LOOP;
        RETURN QUERY
        SELECT l.project_id, l.max_running, l.per_minute, l.burst, l.tokens, l.refilled_at,
               (SELECT count(*) FROM items AS i
                WHERE i.project_id = l.project_id AND i.state = 'claimed')
        FROM project_limits AS l WHERE l.project_id = ANY (taken)
        ORDER BY l.project_id;
    END $$;
    CREATE FUNCTION asyncplane_slot_freed() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF EXISTS (SELECT 1 FROM project_limits
                   WHERE project_id = NEW.project_id AND max_running IS NOT NULL) THEN
            PERFORM pg_notify('asyncplane', current_schema());
        END IF;
        RETURN NULL;
    END $$;
    CREATE TRIGGER items_slot_freed AFTER UPDATE OF state ON items
        FOR EACH ROW WHEN (OLD.state = 'claimed' AND NEW.state <> 'claimed')
        EXECUTE FUNCTION asyncplane_slot_freed();
    -- Limits set, changed or cleared (not a claim drawing from a bucket: that notifies
    -- nobody, as any plain claim).
    CREATE TRIGGER limits_moved
        AFTER INSERT OR DELETE OR UPDATE OF max_running, per_minute, burst ON project_limits
        FOR EACH STATEMENT EXECUTE FUNCTION asyncplane_notify();
    -- A schedule added, changed or resumed: sleeping drainers look at the next tick again.
    CREATE TRIGGER schedules_moved
        AFTER INSERT OR UPDATE OF cron, every, timezone, paused ON schedules
        FOR EACH STATEMENT EXECUTE FUNCTION asyncplane_notify();
    """,
    # 5: observability. When the current claim began (renewals leave it be), for the time
    # an item has run; and the producer's trace context, saved at enqueue, so the span of
    # the item's execution links to the span that enqueued it, across processes.
    """
    ALTER TABLE items ADD COLUMN claimed_at float8;
    ALTER TABLE items ADD COLUMN trace_context text;
    """,
    # 6: a settle wakes only the waiters of its item. A notifying commit signals every
    # listening session of the database, and every process behind one wakes; with each
    # finish notifying, a fleet of N processes paid N wake-ups per commit (and the commits
    # took the server's notification lock in turn). wait() marks its item awaited first
    # (MARK_AWAITED); the trigger notifies only for a marked item. The item's lock, shared
    # by a settle before it looks for the mark and exclusive for the first marker, orders
    # the two: a settle that looked before the mark committed has committed before that
    # waiter looks at the item. A mark is kept until its item is purged (a second settle
    # of it, after a requeue, wakes waiters once more, which is harmless).
    # And whether a project has limits, read afresh: the one-statement claim
    # (CLAIM_ALONE) asks after trying the limits lock, in a snapshot that may be older.
    """
    CREATE TABLE awaited (item_id bigint PRIMARY KEY);
    CREATE OR REPLACE FUNCTION asyncplane_notify_settled() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock_shared(hashtextextended(
            'asyncplane-awaited:' || current_schema() || chr(1) || NEW.item_id::text, 0));
        IF EXISTS (SELECT 1 FROM awaited WHERE item_id = NEW.item_id) THEN
            PERFORM pg_notify('asyncplane_settled', current_schema());
        END IF;
        RETURN NULL;
    END $$;
    CREATE FUNCTION asyncplane_limited(project text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $$
    BEGIN
        RETURN EXISTS (SELECT 1 FROM project_limits WHERE project_id = project);
    END $$;
    """,
    # 7: preflight that costs what changed, as SQLite's migration 9: a twin pair's content
    # noted as it forms, and the items without a fingerprint in an index of their own.
    # Writers run side by side here, and a trigger cannot see a twin that another
    # transaction is changing: a twin may become done (a finish) while this transaction
    # is still open, and that finish settles only the pending twins its snapshot shows.
    # So, when the item has a twin, the trigger tries the content's hand-off lock, the
    # one a twin that stops running takes (asyncplane_line_moves_on), which every finish
    # takes before it settles its twins, and looks only then, in a snapshot taken after
    # it. Had: any finish before it has committed (the look sees it), any after it waits
    # for this transaction (and its settle sees this item); the same holds between two
    # writes that form a pair from either side. Not had (another holds it now): the
    # content is noted whatever the look would show. An item with no twin takes no lock
    # (an enqueue's row, as a rule; a bulk enqueue would hold a lock a row): a twin that
    # a transaction not yet committed is adding, and that runs and finishes before this
    # one commits, is the one case a step misses, left to a full pass (not two enqueues:
    # they take turns on the content's enqueue lock, and the second finds the first's
    # item). A note is a row of its own, never updated, so a preflight forgets only the
    # notes it read: one made meanwhile, by a transaction it could not see, stays. The
    # triggers come before the notes of the pairs already there, whose look then sees
    # every pair committed before the migration took the table's lock.
    """
    CREATE TABLE twin_checks (
        note_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        project_id  text NOT NULL,
        fingerprint text NOT NULL
    );
    -- VOLATILE (written out, since the argument rests on it): each of its statements
    -- takes a snapshot of its own, so the look after the lock sees what committed before.
    CREATE FUNCTION asyncplane_twin_pair() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
    DECLARE
        alone boolean;
    BEGIN
        IF NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND item_id <> NEW.item_id)
        THEN
            RETURN NULL;  -- no twin: no lock (an enqueue's usual row, and a bulk one's)
        END IF;
        alone := pg_try_advisory_xact_lock(hashtextextended(
            current_schema() || chr(1) || NEW.project_id || chr(1) || NEW.fingerprint, 2));
        IF alone AND NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND item_id <> NEW.item_id
              AND CASE WHEN NEW.state = 'done' THEN state IN ('ready', 'deferred') AND dedup
                       ELSE state = 'done' END)
        THEN
            RETURN NULL;
        END IF;
        INSERT INTO twin_checks (project_id, fingerprint)
        VALUES (NEW.project_id, NEW.fingerprint);
        RETURN NULL;
    END $$;
    CREATE TRIGGER items_twin_pair_arrives AFTER INSERT ON items
        FOR EACH ROW WHEN (NEW.fingerprint IS NOT NULL AND (
            (NEW.state IN ('ready', 'deferred') AND NEW.dedup) OR NEW.state = 'done'))
        EXECUTE FUNCTION asyncplane_twin_pair();
    CREATE TRIGGER items_twin_pair_forms AFTER UPDATE OF state, fingerprint, dedup ON items
        FOR EACH ROW WHEN (NEW.fingerprint IS NOT NULL AND (
            (NEW.state IN ('ready', 'deferred') AND NEW.dedup
             AND (OLD.state NOT IN ('ready', 'deferred') OR NOT OLD.dedup
                  OR OLD.fingerprint IS DISTINCT FROM NEW.fingerprint))
            OR (NEW.state = 'done' AND OLD.fingerprint IS DISTINCT FROM NEW.fingerprint)))
        EXECUTE FUNCTION asyncplane_twin_pair();
    INSERT INTO twin_checks (project_id, fingerprint)
    SELECT DISTINCT p.project_id, p.fingerprint FROM items AS p
    WHERE p.state IN ('ready', 'deferred') AND p.dedup AND p.fingerprint IS NOT NULL
      AND EXISTS (SELECT 1 FROM items AS d
                  WHERE d.project_id = p.project_id AND d.fingerprint = p.fingerprint
                    AND d.state = 'done');
    CREATE INDEX items_unfingerprinted ON items (item_id) WHERE fingerprint IS NULL;
    """,
    # 8: a content's history costs nothing (as SQLite's migration 10, another way). Every
    # look at a content's twins in given states (a done finish settling the pending
    # ones, the enqueue's look for a done or a live one, the pair probes of the trigger
    # below and of the preflight) read all of its twins through items_fingerprint and
    # tested each row's state: a content run again and again (dedup off, or a
    # schedule's) paid for every earlier run on every finish. Now a content's twins are
    # in one of two indexes, by whether they are settled, each with that test for its
    # predicate. The live twins (pending or running: few, a content's backlog) are
    # looked up by content; the settled ones (its history) by content and state, so a
    # look for its done twins seeks them past its failed and cancelled ones. A look names
    # the states it wants, and no index but its group's serves it as closely, so no plan
    # reads a content's history, whatever it expects. (Keying items_fingerprint by state,
    # as on SQLite, whose statements name their index, did not do: with no statistics,
    # or in a generic plan, the planner expects a content's twins to be few, and an
    # `IN` of states is then left out of the seek and filtered; and an index of the done
    # twins beside items_fingerprint lost to it, whose entries for one content are a
    # single posting list.) A row version is in one of the two, where it was in
    # items_fingerprint: no write adds an entry. The pair trigger looks at one side's
    # states (the function as migration 7 made it otherwise: a CASE between the sides
    # matches no index), and for any twin at all with a probe of each index.
    f"""
    DROP INDEX items_fingerprint;
    CREATE INDEX items_live_twins ON items (project_id, fingerprint, item_id)
        WHERE fingerprint IS NOT NULL
          AND state IN ('ready', 'deferred', 'claimed', 'offloaded');
    CREATE INDEX items_settled_twins ON items (project_id, fingerprint, state, item_id)
        WHERE fingerprint IS NOT NULL AND state IN ('done', 'failed', 'cancelled');
{_TWIN_ARRIVES_8}
    CREATE OR REPLACE FUNCTION asyncplane_twin_pair() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
    DECLARE
        alone boolean;
    BEGIN
        -- (Two looks, each planned for its first row: as one EXISTS over a UNION ALL,
        -- a plan read every twin of a long line into a bitmap first.)
        IF NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state IN ('ready', 'deferred', 'claimed', 'offloaded')
              AND item_id <> NEW.item_id)
           AND NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state IN ('done', 'failed', 'cancelled') AND item_id <> NEW.item_id)
        THEN
            RETURN NULL;  -- no twin: no lock (an enqueue's usual row, and a bulk one's)
        END IF;
        alone := pg_try_advisory_xact_lock(hashtextextended(
            current_schema() || chr(1) || NEW.project_id || chr(1) || NEW.fingerprint, 2));
        IF alone AND NEW.state = 'done' AND NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state IN ('ready', 'deferred') AND dedup AND item_id <> NEW.item_id)
        THEN
            RETURN NULL;
        END IF;
        IF alone AND NEW.state <> 'done' AND NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state = 'done' AND item_id <> NEW.item_id)
        THEN
            RETURN NULL;
        END IF;
        INSERT INTO twin_checks (project_id, fingerprint)
        VALUES (NEW.project_id, NEW.fingerprint);
        RETURN NULL;
    END $$;
    """,
    # 9: the planner told that a content has few twins. The looks at a content's twins
    # of migration 8 seek it in a partial index and take the first by id; with
    # statistics that saw few contents (a store where a handful recur), the planner
    # judged a content so common that a walk of the table in id order (items_pkey), or of
    # the settled items (items_settled), would meet it at once, and for a content with
    # no such twin read them all on every enqueue. Fingerprints are counted as distinct
    # for every other row, whatever a sample saw, from the next ANALYZE on.
    """
    ALTER TABLE items ALTER COLUMN fingerprint SET (n_distinct = -0.5);
    """,
    # 10: a content's deferred twins cost nothing to its line. Migration 8's first look of
    # the twin line's trigger, whether the content has a twin ready or running, was a
    # probe of items_live_twins that tested each entry's state: a content with many
    # twins deferred (due later, or enqueued with dedup off) read every one of them for
    # each twin that arrived ready or went back to ready. It now stops at the first live
    # twin, whatever its state; a content whose live twins are all deferred then goes on
    # to the line's own looks (the running twin, the first held and the claimable one,
    # each a probe of its index), which find no line, as before.
    f"""
{_TWIN_ARRIVES_10}
    """,
    # 11: a content's backlog costs nothing either (as SQLite's migration 11, another
    # way). A done finish settles the content's pending twins enqueued with dedup, and
    # read every live twin to find them: a line of twins enqueued with dedup off (a
    # content run again and again, faster than it runs) paid for its whole length on
    # every finish, so draining it was quadratic. Those twins, the ones a settle and a
    # pair's pending side want, now have an index of their own, whose predicate is
    # exactly that look's state and dedup test: no plan, generic or custom, made on an
    # empty table or not, finds a cheaper way to them (no other index leaves less to
    # test). (Keying items_live_twins by dedup did not do: on a table with no
    # statistics, items_by_project then cost the same to the planner, and won.) A pending
    # twin enqueued with dedup, a fingerprinted enqueue's usual row, has an entry here
    # besides its entry in items_live_twins.
    """
    CREATE INDEX items_dedup_twins ON items (project_id, fingerprint, item_id)
        WHERE fingerprint IS NOT NULL AND dedup AND state IN ('ready', 'deferred');
    """,
    # 12: a fingerprint costs a claim and a finish no round trip. A claim of a
    # fingerprinted item tried its content's lock and then claimed it with the twin guard,
    # each a statement of its own, so that the guard's look came in a snapshot taken after
    # the lock was had; a done finish settled its twins in a statement after the finish,
    # in a snapshot taken after the content's hand-off lock (see migration 7). Each took
    # five round trips (a claim's transaction; a finish's one statement, which left it,
    # and then its transaction) where a plain item's is one statement. A function
    # declared VOLATILE takes a snapshot for each statement it runs, so each pair of steps
    # is now a function, in that order, which the one statement of a claim (CLAIM_ALONE)
    # or of a round of finishes (FINISH_MANY) calls for each fingerprinted row: the lock,
    # then the look. The twin guard tries the claimers' lock of the content; the settle
    # takes the hand-off lock (the finish's own trigger takes it again, at the end of the
    # statement: a lock held is had at once), then settles the pending twins enqueued with
    # dedup (through items_dedup_twins, as the statement it replaces) and writes their
    # events, as the rules core's template says (`_rules.twin_event`: the caller passes
    # its type, owner and detail), and answers how many it settled.
    f"""
    CREATE FUNCTION asyncplane_twin_may_start(project text, content text, item bigint)
    RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
    BEGIN
        IF NOT pg_try_advisory_xact_lock(hashtextextended(
                current_schema() || chr(1) || project || chr(1) || content, 1)) THEN
            RETURN false;  -- another transaction is starting a twin: this one waits
        END IF;
        RETURN NOT EXISTS (
            SELECT 1 FROM items
            WHERE project_id = project AND fingerprint = content
              AND state IN ('claimed', 'offloaded') AND item_id <> item);
    END $$;
    CREATE FUNCTION asyncplane_settle_twins(project text, content text, done_item bigint,
                                            outcome text, settled_at float8, actor text,
                                            twin_type text, twin_owner text, twin_detail text)
    RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        settled bigint;
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtextextended(
            current_schema() || chr(1) || project || chr(1) || content, 2));
        WITH twins AS ({SETTLE_TWINS_12})
        INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
        SELECT item_id, twin_type, fence, twin_owner, actor, settled_at, twin_detail
        FROM twins ORDER BY item_id;
        GET DIAGNOSTICS settled = ROW_COUNT;
        RETURN settled;
    END $$;
    """,
    # 13: a twin's settle wakes the fleet only when it frees a twin. Every store listens
    # for this channel, and every NOTIFY wakes every listening process of the database; a
    # done, failed or cancelled fingerprinted item notified every time (items_moved, as
    # migrations 1 and 2 made it), whether a twin waited or not. Now the twin line's
    # trigger notifies, after the content's hand-off lock and in a snapshot taken after
    # it, when a twin that stopped running (or a claimable one that left the line) leaves
    # a first in line, or leaves twins deferred, which the drainers' alarms left out
    # while it ran (NEXT_DUE).
    #
    # A twin that arrives while another moves can miss that look. One held back is safe:
    # it holds the row it waits behind (the running twin, or the claimable one ahead) for
    # share, so that row's move waits for its commit, and its look sees it. One left
    # unheld is not: it found that row locked (a settle has the running twin's, a claimer
    # the claimable one's), or went first while a claimer had the twin it would have
    # held, or is deferred (a deferred twin
    # holds nothing back). If it commits before a settle whose look came before it, its
    # own NOTIFY wakes drainers that still see a twin running, and the settle sends none.
    # So a twin that arrives pending and unheld beside a live twin (enqueued, requeued,
    # copied in, given its fingerprint) tells this session's process, on a channel named
    # after this session that only that process listens to, heard once it has committed:
    # the twin line's trigger of a ready one (asyncplane_twin_arrives, made again), a
    # trigger of its own for a deferred one. That process then, on a connection that
    # holds nothing, tries the content's hand-off lock shared (asyncplane_twins_waited,
    # for all it heard of; again a little later while a settle has one) and, once had,
    # notifies unless a twin runs: every settle that looked before the arrival committed
    # has committed by then, and every later one looks after it and sees it (that twin's
    # settle will notify). Nothing waits while holding anything. Not covered, as in
    # migration 7: a twin that another transaction is adding, and that is claimed and
    # whose settle looks before this one commits (neither saw the other); this one then
    # waits for the drainers' safety poll. (Looking at the commit instead, in a deferred
    # trigger, narrows that to the commit's instant, but cost every fingerprinted enqueue
    # a trigger call: 3.5 µs, 6%.)
    f"""
    DROP TRIGGER items_moved ON items;
    CREATE TRIGGER items_moved AFTER UPDATE OF state ON items
        FOR EACH ROW WHEN (NEW.state IS DISTINCT FROM OLD.state
                           AND NEW.state IN ('ready', 'deferred'))
        EXECUTE FUNCTION asyncplane_notify();
{_LINE_MOVES_ON_13}
{_TWIN_ARRIVES_13}
    CREATE FUNCTION asyncplane_twin_deferred() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
    BEGIN
        IF EXISTS (
            SELECT 1 FROM items
            WHERE project_id = NEW.project_id AND fingerprint = NEW.fingerprint
              AND state IN ('ready', 'deferred', 'claimed', 'offloaded')
              AND item_id <> NEW.item_id)
        THEN
            {_TELL_13}
        END IF;
        RETURN NULL;
    END $$;
    CREATE TRIGGER items_deferred_twin_arrives AFTER INSERT ON items
        FOR EACH ROW WHEN (NEW.state = 'deferred' AND NEW.fingerprint IS NOT NULL)
        EXECUTE FUNCTION asyncplane_twin_deferred();
    CREATE TRIGGER items_deferred_twin_moves AFTER UPDATE OF state, fingerprint ON items
        FOR EACH ROW WHEN (NEW.state = 'deferred' AND NEW.fingerprint IS NOT NULL
                           AND (OLD.state IS DISTINCT FROM NEW.state
                                OR OLD.fingerprint IS DISTINCT FROM NEW.fingerprint))
        EXECUTE FUNCTION asyncplane_twin_deferred();
    -- Contents (a hundred of a pass's, in arrays): for each, the hand-off lock tried
    -- shared (busy: the indexes of those another transaction has; looked again later);
    -- for each had, whether a twin runs (running: its settle will look, and see what
    -- committed before) or not (woken: the pass notifies once, after all its looks).
    CREATE FUNCTION asyncplane_twins_waited(projects text[], contents text[],
                                            OUT busy int[], OUT woken int, OUT running int)
    LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
    BEGIN
        busy := '{{}}';
        woken := 0;
        running := 0;
        FOR i IN 1 .. coalesce(array_length(projects, 1), 0) LOOP
            IF NOT pg_try_advisory_xact_lock_shared(hashtextextended(
                    current_schema() || chr(1) || projects[i] || chr(1) || contents[i], 2)) THEN
                busy := busy || i;
            ELSIF EXISTS (
                SELECT 1 FROM items
                WHERE project_id = projects[i] AND fingerprint = contents[i]
                  AND state IN ('claimed', 'offloaded'))
            THEN
                running := running + 1;
            ELSE
                woken := woken + 1;
            END IF;
        END LOOP;
    END $$;
    """,
    # 14: an import knows a source row by its content as well as its key, as SQLite's
    # migration 13: records from before have no digest (NULL), and are taken as they were.
    """
    ALTER TABLE imports ADD COLUMN IF NOT EXISTS digest text;
    """,
    # 15: TRUNCATE fires no row's trigger: it emptied the ledger past the append-only
    # triggers (the verifier then saw items with no history). A statement's trigger
    # refuses it as they refuse an UPDATE or a DELETE; asyncplane never truncates.
    """
    CREATE OR REPLACE FUNCTION asyncplane_refuse_event_truncate() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'the asyncplane ledger is append-only';
    END $$;
    DROP TRIGGER IF EXISTS events_not_truncated ON events;
    CREATE TRIGGER events_not_truncated BEFORE TRUNCATE ON events
        FOR EACH STATEMENT EXECUTE FUNCTION asyncplane_refuse_event_truncate();
    """,
    # 16: migration 6's settle took an advisory lock for each item it settled, and each
    # lock takes an entry of the server's shared lock table to the commit: a cancel_where
    # of 25,000 items, or a finish settling as many twins, failed "out of shared memory"
    # (other sessions' transactions too). It takes none now: the row lock its UPDATE
    # holds to its commit orders it against a waiter, who, its mark committed, reads the
    # item's row FOR SHARE (SETTLES_UNDER_WAY), so waits for a settle that looked for
    # marks before the mark was there; a settle that looks after sees it.
    """
    CREATE OR REPLACE FUNCTION asyncplane_notify_settled() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF EXISTS (SELECT 1 FROM awaited WHERE item_id = NEW.item_id) THEN
            PERFORM pg_notify('asyncplane_settled', current_schema());
        END IF;
        RETURN NULL;
    END $$;
    """,
)

SCHEMA_VERSION: Final = len(MIGRATIONS)

#: ``('done', 'failed', 'cancelled')``, for SQL below (from `_models.SETTLED_STATES`).
_SETTLED_STATES: Final = _models.sql_list(_models.SETTLED_STATES)
#: ``('ready', 'deferred')`` (from `_models.PENDING_STATES`).
_PENDING_STATES: Final = _models.sql_list(_models.PENDING_STATES)
#: ``('ready', 'deferred', 'claimed', 'offloaded')`` (from `_models.LIVE_STATES`):
#: items_live_twins' states.
_LIVE_STATES: Final = _models.sql_list(_models.LIVE_STATES)


# Serialises schema creation between processes opening a fresh database at once.
MIGRATION_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtextextended('asyncplane-migrate', 0))"
CURRENT_SCHEMA: Final = "SELECT current_schema()"
SERVER_ENCODING: Final = "SELECT current_setting('server_encoding')"
META_EXISTS: Final = (
    "SELECT to_regclass(format('%I.asyncplane_meta', current_schema())) IS NOT NULL"
)
# The write connection's plans, made again once the items table has grown (the writer's
# docstring): its size in bytes, and the statement that drops the plans.
ITEMS_SIZE: Final = "SELECT pg_relation_size('items')"
DISCARD_PLANS: Final = "DISCARD PLANS"
# The single-drainer guard: a session lock per schema, held by the drain's connection.
DRAIN_TRY_LOCK: Final = (
    "SELECT pg_try_advisory_lock(hashtextextended('asyncplane-drain:' || current_schema(), 0))"
)
COUNT_TABLES: Final = """
SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = current_schema()
"""
READ_META: Final = "SELECT key, value FROM asyncplane_meta"
WRITE_META: Final = """
INSERT INTO asyncplane_meta (key, value) VALUES ($1, $2)
ON CONFLICT (key) DO UPDATE SET value = excluded.value
"""
SERVER_NOW: Final = "SELECT extract(epoch FROM clock_timestamp())::float8"
# Every session of the store's is exempt from idle_session_timeout, which a server, a role
# or a database may set: the drain guard's and the listener's sessions sit idle by design
# (see PostgresBackend._connect). The parameter exists from PostgreSQL 14 on, so it is set
# only where the server knows it (on an older one this sets nothing).
NEVER_IDLE_OUT: Final = """
SELECT set_config('idle_session_timeout', '0', false)
WHERE current_setting('idle_session_timeout', true) IS NOT NULL
"""
BACKEND_PID: Final = "SELECT pg_backend_pid()"
# After the commits of twins told of on `twin_channel` ($1 project ids, $2 fingerprints):
# each content's hand-off lock tried, and whether a twin runs; WAKE_DRAINERS follows
# (see migration 13).
TWINS_WAITED: Final = "SELECT busy, woken, running FROM asyncplane_twins_waited($1, $2)"

# --- projects and scope ----------------------------------------------------------------

PROJECT_EXISTS: Final = "SELECT 1 FROM projects WHERE project_id = $1"
INSERT_PROJECT: Final = """
INSERT INTO projects (project_id, name, status, created_at) VALUES ($1, $2, $3, $4)
ON CONFLICT (project_id) DO NOTHING
RETURNING project_id
"""
PROJECT_STATUS_LOCKED: Final = "SELECT status FROM projects WHERE project_id = $1 FOR UPDATE"
SET_PROJECT_STATUS: Final = "UPDATE projects SET status = $1 WHERE project_id = $2"
GET_PROJECT: Final = (
    "SELECT project_id, name, status, created_at FROM projects WHERE project_id = $1"
)
LIST_PROJECTS: Final = (
    'SELECT project_id, name, status, created_at FROM projects ORDER BY project_id COLLATE "C"'
)
# A project row locked for share: an assignment cannot slip past a concurrent check.
PROJECT_LOCKED: Final = "SELECT 1 FROM projects WHERE project_id = $1 FOR SHARE"
ASSIGN: Final = """
INSERT INTO assignments (actor_id, project_id, assigned_at) VALUES ($1, $2, $3)
ON CONFLICT (actor_id, project_id) DO NOTHING
"""
UNASSIGN: Final = "DELETE FROM assignments WHERE actor_id = $1 AND project_id = $2"
VISIBLE_PROJECTS: Final = (
    'SELECT project_id FROM assignments WHERE actor_id = $1 ORDER BY project_id COLLATE "C"'
)
# A write in an actor's name holds the assignment rows its scope check read (KEY SHARE) to
# its commit: unassign()'s DELETE then waits for a write that passed the check, and a
# write that comes after it finds the row gone. (Read plainly, an actor's write that
# checked before an unassign, then waited on a row lock, committed after it returned.)
# Reads check plainly: a read-only connection cannot lock.
IS_ASSIGNED: Final = (
    "SELECT 1 FROM assignments WHERE actor_id = $1 AND project_id = $2 FOR KEY SHARE"
)

# --- items -----------------------------------------------------------------------------

# Ids are drawn first, so a bulk insert's ids are known in input order.
NEXT_ITEM_IDS: Final = """
SELECT nextval(pg_get_serial_sequence('items', 'item_id')) FROM generate_series(1, $1)
"""
INSERT_ITEMS: Final = """
INSERT INTO items (item_id, project_id, state, payload, priority, service_class, sla,
                   fingerprint, dedup, max_attempts, due_at, created_at, updated_at,
                   trace_context)
SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::bigint[],
                     $6::text[], $7::float8[], $8::text[], $9::boolean[], $10::bigint[],
                     $11::float8[], $12::float8[], $13::float8[], $14::text[])
"""
INSERT_EVENT: Final = """
INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
VALUES ($1, $2, $3, $4, $5, $6, $7)
"""
INSERT_EVENTS: Final = """
INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[],
                     $6::float8[], $7::text[])
"""

# Advisory locks are the database's, not a schema's: every key names the schema, so stores in
# different schemas of one database never wait on each other.
# Two enqueues of the same content in one project take turns from the dedup check to the
# commit: held to the end of the transaction. The writer takes every lock a round needs
# at its start, in one sorted pass, so two rounds never hold them in opposite orders.
# Each content lock takes an entry of the server's shared lock table to the commit, and
# an enqueue_many of 30,000 contents ran it out ("out of shared memory"): so a content's
# lock comes with its shard's (one of 64, by the content), shared, and a round of more
# than CONTENTS_LOCKED_ONE_BY_ONE contents takes its shards alone instead, and no
# content's (at most 64 entries, and such a round waits for, and holds back, every
# enqueue of a content in them). Shards first, then contents, each in one order.
# ($1 project ids, $2 fingerprints, pairwise; $3 whether by shards alone)
CONTENTS_LOCKED_ONE_BY_ONE: Final = 1024
_CONTENT_KEY = "hashtextextended(current_schema() || chr(1) || {p} || chr(1) || {f}, 0)"
_SHARD_KEY = (
    "hashtextextended('asyncplane-content-shard:' || current_schema() || chr(1) || "
    "(abs(hashtextextended({p} || chr(1) || {f}, 3)) % 64)::text, 0)"
)
LOCK_CONTENTS: Final = f"""
SELECT CASE WHEN kind = 1 THEN pg_advisory_xact_lock(key)
            WHEN $3::boolean THEN pg_advisory_xact_lock(key)
            ELSE pg_advisory_xact_lock_shared(key) END
FROM (
    SELECT DISTINCT 0 AS kind, {_SHARD_KEY.format(p="project_id", f="fingerprint")} AS key
    FROM unnest($1::text[], $2::text[]) AS content (project_id, fingerprint)
    UNION
    SELECT 1, {_CONTENT_KEY.format(p="project_id", f="fingerprint")}
    FROM unnest($1::text[], $2::text[]) AS content (project_id, fingerprint)
    WHERE NOT $3::boolean
) AS locks
ORDER BY kind, key
"""
# Enqueue dedup: for each fingerprint, an earlier item of the project with it that has not
# failed nor been cancelled, the oldest done one first (its result is there already),
# else the oldest live one. Led by the fingerprints (subqueries run for each), each a
# seek to the first of the content's twins in those states, in the index of such twins
# (migration 8): a custom plan of `fingerprint = ANY(...)` walked the project's whole part
# of items_fingerprint instead, an enqueue costing the project's size, and a look at all
# of a content's twins cost its whole history. ($1 project_id, $2 fingerprints, distinct;
# a row for each one with a twin)
_TWIN_OF_WANTED = "project_id = $1 AND fingerprint = wanted.fingerprint"
FIND_TWINS: Final = f"""
SELECT fingerprint, item_id FROM (
    SELECT wanted.fingerprint, coalesce(
        (SELECT item_id FROM items WHERE {_TWIN_OF_WANTED} AND state = 'done'
         ORDER BY item_id LIMIT 1),
        (SELECT item_id FROM items WHERE {_TWIN_OF_WANTED} AND state IN {_LIVE_STATES}
         ORDER BY item_id LIMIT 1)) AS item_id
    FROM unnest($2::text[]) AS wanted (fingerprint)) AS twin
WHERE item_id IS NOT NULL
"""

# A schedule's tick takes the id of a pending twin with dedup off only (`_rules.tick_item`:
# one nothing settles unrun), the oldest; under the content's lock (LOCK_CONTENTS' key,
# tried: TRY_LOCK_CONTENT), so that a tick of another schedule of the same content,
# committing now, is seen.
TRY_LOCK_CONTENT: Final = f"""
SELECT pg_try_advisory_xact_lock_shared({_SHARD_KEY.format(p="$1", f="$2")})
   AND pg_try_advisory_xact_lock({_CONTENT_KEY.format(p="$1", f="$2")})
"""
PENDING_TWIN: Final = f"""
SELECT min(item_id) FROM items
WHERE project_id = $1 AND fingerprint = $2 AND state IN {_models.sql_list(_models.PENDING_STATES)}
    AND NOT dedup
"""

# --- claims ----------------------------------------------------------------------------
# Rows another transaction is claiming are skipped, never waited for. A claim visits the
# projects in its reach only (open, the one asked for, the actor's), each through its
# part of a per-project index, so nothing another project holds is ever stepped over;
# held twins are out of that index (migration 3). The lapsed claims are few and read for
# all projects in reach at once.

CLAIM_ORDER: Final = "priority DESC, service_class, sla NULLS LAST, item_id"
_CLAIM_COLUMNS = (
    "item_id, state, fence, owner, attempts, max_attempts, project_id, fingerprint, "
    "priority, service_class, sla"
)
_IN_REACH = """
      AND project_id IN (SELECT project_id FROM projects WHERE status = 'open')
      AND ($1::text IS NULL OR project_id = $1::text)
      AND ($2::text IS NULL
           OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text))
"""
_TWIN = """
           SELECT 1 FROM items AS twin
           WHERE twin.project_id = items.project_id AND twin.fingerprint = items.fingerprint
             AND twin.state IN ('claimed', 'offloaded') AND twin.fingerprint IS NOT NULL
             AND twin.item_id <> items.item_id"""
# A ready or deferred item may run: no twin of it runs (a running twin holds it back).
_NO_RUNNING_TWIN = f"(fingerprint IS NULL OR NOT EXISTS ({_TWIN}))"


def _ready(project: str, limit: str, offset: str) -> str:
    """One project's claimable ready items, in claim order, from its part of items_claim."""
    return f"""
    SELECT {_CLAIM_COLUMNS} FROM items
    WHERE items.project_id = {project} AND state = 'ready' AND NOT held
      AND {_NO_RUNNING_TWIN}
    ORDER BY {CLAIM_ORDER} LIMIT {limit} OFFSET {offset}
    FOR UPDATE SKIP LOCKED"""


def _due(project: str, limit: str, offset: str, now: str) -> str:
    """One project's deferred items that have fallen due, in claim order."""
    return f"""
    SELECT {_CLAIM_COLUMNS} FROM items
    WHERE items.project_id = {project} AND state = 'deferred' AND due_at <= {now}
      AND {_NO_RUNNING_TWIN}
    ORDER BY {CLAIM_ORDER} LIMIT {limit} OFFSET {offset}
    FOR UPDATE SKIP LOCKED"""


# A claim whose lease lapsed: no twin can be running beside it (the unique index covers
# claimed and offloaded items alike), so nothing holds it back but the attempt budget.
def _lapsed(limit: str, offset: str, now: str, reach: str = _IN_REACH) -> str:
    return f"""
    SELECT {_CLAIM_COLUMNS} FROM items
    WHERE state = 'claimed' AND lease_expires_at <= {now}
      AND (max_attempts IS NULL OR attempts < max_attempts) {reach}
    ORDER BY {CLAIM_ORDER} LIMIT {limit} OFFSET {offset}
    FOR UPDATE SKIP LOCKED"""


# Further pages of one arm, read when the merge skipped twins on the first one:
# ($1 project, $2 limit, $3 offset); the due arm also ($4 now).
CLAIM_READY: Final = _ready("$1::text", "$2", "$3")
CLAIM_DUE: Final = _due("$1::text", "$2", "$3", "$4")
# ($1 project_id, $2 actor_id, $3 limit, $4 offset, $5 now)
CLAIM_LAPSED: Final = _lapsed("$3", "$4", "$5")
# Every claim holds this lock, shared, to its commit; set_limits takes it alone. So limits
# set for a project none had are in force for every claim that began before (set_limits
# waits for it to commit, and a claim that counts afterwards sees what it took), or it is
# refused by CLAIM_ITEMS, whose snapshot comes after (the claim waited for set_limits).
_LIMITS_KEY = "hashtextextended('asyncplane-limits:' || current_schema(), 0)"
_CLAIMING = f"pg_advisory_xact_lock_shared({_LIMITS_KEY})"
LIMITS_CHANGE: Final = f"SELECT pg_advisory_xact_lock({_LIMITS_KEY})"
# The first page of every arm, and the lapsed claims that spent their last attempt, in one
# statement (one round trip for the common claim): each row tagged with its arm ('r'
# ready, 'd' due, per project in reach; 'l' lapsed; 'x' exhausted) and the size of the
# page it came in (a project's share of the batch: `_rules.first_page`, here in SQL, as
# the reach is known only here). A limited project is in the reach only as the claim's
# locked limits gave it room ($6, $7: its first page no bigger); one limited since
# those were taken is named in a row of its own ('q'), for the claim to take its limits
# then. ($1 project_id, $2 actor_id, $3 batch, $4 now, $5 how many exhausted claims to
# fail, $6 limited projects with room, $7 their room, $8 every limited project locked)
# The lapsed and exhausted arms take the reach as open_reach found it, its assignment
# rows held: by _IN_REACH's plain read, from the statement's snapshot, they still took
# an item of a project an unassign had taken from the actor while the statement waited
# for the row.
_IN_OPEN_REACH = "AND project_id IN (SELECT project_id FROM open_reach)"
CLAIM_CANDIDATES: Final = f"""
WITH claiming AS (SELECT {_CLAIMING}),
open_reach AS (
    SELECT project_id FROM projects CROSS JOIN claiming
    WHERE status = 'open' AND ($1::text IS NULL OR project_id = $1::text)
      AND ($2::text IS NULL OR project_id IN (
               SELECT project_id FROM assignments WHERE actor_id = $2::text FOR KEY SHARE))),
reach AS (
    SELECT project_id,
           ($7::bigint[])[array_position($6::text[], project_id)] AS room
    FROM open_reach
    WHERE project_id = ANY ($6::text[])
       OR project_id NOT IN (SELECT project_id FROM project_limits)),
page AS (SELECT ($3::bigint - 1) / greatest(count(*), 1) + 1 AS size FROM reach),
sized AS (
    SELECT reach.project_id, least(page.size, coalesce(reach.room, page.size)) AS size
    FROM reach CROSS JOIN page)
SELECT 'r' AS arm, sized.size, ready.*
FROM sized CROSS JOIN LATERAL ({_ready("sized.project_id", "sized.size", "0")}) AS ready
UNION ALL
SELECT 'd', sized.size, due.*
FROM sized CROSS JOIN LATERAL ({_due("sized.project_id", "sized.size", "0", "$4")}) AS due
UNION ALL
SELECT 'q', 0, NULL::bigint, NULL::text, NULL::bigint, NULL::text, NULL::bigint, NULL::bigint,
       project_id, NULL::text, NULL::bigint, NULL::text, NULL::float8
FROM open_reach
WHERE project_id IN (SELECT project_id FROM project_limits) AND project_id <> ALL ($8::text[])
UNION ALL
SELECT 'l', $3::bigint, * FROM ({_lapsed("$3", "0", "$4", _IN_OPEN_REACH)}) AS lapsed
UNION ALL
SELECT 'x', $5::bigint, * FROM (
    SELECT {_CLAIM_COLUMNS} FROM items
    WHERE state = 'claimed' AND lease_expires_at <= $4
      AND max_attempts IS NOT NULL AND attempts >= max_attempts {_IN_OPEN_REACH}
    ORDER BY {CLAIM_ORDER} LIMIT $5
    FOR UPDATE SKIP LOCKED) AS exhausted
"""


def _claim_set(source: str, now: str) -> str:
    """What a claim writes into an item: from ``source``'s owner and lease expiry."""
    return f"""
    SET state = 'claimed', fence = items.fence + 1, attempts = items.attempts + 1,
        owner = {source}.owner, lease_expires_at = {source}.expires, due_at = NULL,
        updated_at = {now}, claimed_at = {now}"""


_NOTIFY_WORK = "pg_notify('asyncplane', current_schema())"
# The wake-up `TwinWakes` sends once a pass's looks are done (see TWINS_WAITED).
WAKE_DRAINERS: Final = f"SELECT {_NOTIFY_WORK}"
# The common claim in one statement, which commits by itself: when the reach is one
# open project without limits, with no lapsed claim and nothing fallen due, no two of the
# first ready items in claim order are twins, and no set_limits is under way (its lock is
# tried, never waited for), the claim takes exactly those, as the general claim
# (CLAIM_CANDIDATES, then CLAIM_ITEMS) would: each to the request its slot names
# (`_rules.slots`), with its "claimed" event; a fingerprinted one only if it may start
# (asyncplane_twin_may_start, migration 12: its content's claim lock tried, then no twin
# running, in a snapshot of its own), as CLAIM_ITEMS's guard after TRY_LOCK_CONTENTS.
# Otherwise it takes nothing and answers one row with a NULL slot, and the claim runs as
# the general one. The slot of each claimed row comes first, then its candidate columns
# as they were, then the claimed columns CLAIM_ITEMS returns. ($1 project_id, $2
# actor_id, $3 now, $4 how many, $5 the owner of each slot, $6 its lease's expiry)
CLAIM_ALONE: Final = f"""
WITH claiming AS (SELECT pg_try_advisory_xact_lock_shared({_LIMITS_KEY}) AS got),
reach AS (
    SELECT project_id FROM projects CROSS JOIN claiming
    WHERE claiming.got AND status = 'open' AND ($1::text IS NULL OR project_id = $1::text)
      AND ($2::text IS NULL OR project_id IN (
               SELECT project_id FROM assignments WHERE actor_id = $2::text FOR KEY SHARE))),
plain AS (
    SELECT reach.project_id FROM reach
    WHERE (SELECT count(*) FROM reach) = 1
      AND NOT asyncplane_limited(reach.project_id)
      AND NOT EXISTS (
          SELECT 1 FROM items WHERE items.project_id = reach.project_id
            AND state = 'claimed' AND lease_expires_at <= $3)
      AND NOT EXISTS (
          SELECT 1 FROM items WHERE items.project_id = reach.project_id
            AND state = 'deferred' AND due_at <= $3)),
picked AS (
    SELECT row_number() OVER (ORDER BY {CLAIM_ORDER}) AS slot, ready.*
    FROM plain CROSS JOIN LATERAL ({_ready("plain.project_id", "$4", "0")}) AS ready),
verdict AS (
    SELECT EXISTS (SELECT 1 FROM plain)
           AND (SELECT count(DISTINCT fingerprint) = count(fingerprint) FROM picked) AS ok),
claimed AS (
    UPDATE items {_claim_set("s", "$3")}
    FROM picked AS p
         JOIN unnest($5::text[], $6::float8[]) WITH ORDINALITY AS s (owner, expires, slot)
         ON s.slot = p.slot
    WHERE items.item_id = p.item_id AND (SELECT ok FROM verdict)
      AND (p.fingerprint IS NULL
           OR asyncplane_twin_may_start(p.project_id, p.fingerprint, p.item_id))
    RETURNING p.slot, p.item_id, p.state, p.fence, p.owner, p.attempts, p.max_attempts,
              p.project_id, p.fingerprint, p.priority, p.service_class, p.sla,
              items.item_id AS claimed_id, items.project_id AS claimed_project,
              items.payload, items.fence AS claimed_fence, items.attempts AS claimed_attempts,
              items.created_at, items.trace_context, items.owner AS claimed_owner),
logged AS (
    INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
    SELECT claimed_id, 'claimed', claimed_fence, claimed_owner, $2::text, $3, NULL
    FROM claimed ORDER BY claimed_id)
SELECT slot, item_id, state, fence, owner, attempts, max_attempts, project_id, fingerprint,
       priority, service_class, sla, claimed_id, claimed_project, payload, claimed_fence,
       claimed_attempts, created_at, trace_context
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL
FROM verdict
WHERE CASE WHEN NOT verdict.ok AND NOT EXISTS (SELECT 1 FROM picked) THEN true
           -- Rows it locked and left were skipped by any claimer meanwhile: wake them
           -- (a row with a NULL slot if it bailed out; none if it claimed, some twin
           -- that may not start left).
           WHEN NOT verdict.ok
                OR (SELECT count(*) FROM picked) > (SELECT count(*) FROM claimed)
           THEN (SELECT count(*) FROM (SELECT {_NOTIFY_WORK}) AS woken) > 0 AND NOT verdict.ok
           ELSE false END
"""
# A claimer of a fingerprinted item first takes the lock of its (project, fingerprint),
# without waiting: held, another transaction is starting a twin, and this one skips the
# item. Claimers thus never wait on each other's unique-index entries (which could
# deadlock), and a claimer that has the lock sees every committed twin in its next
# statement. ($1 project ids, $2 fingerprints) -> (position, had it)
TRY_LOCK_CONTENTS: Final = """
SELECT position, pg_try_advisory_xact_lock(
           hashtextextended(current_schema() || chr(1) || project_id || chr(1) || fingerprint, 1))
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS c (project_id, fingerprint, position)
ORDER BY project_id, fingerprint
"""
# Claim many candidates at once, each for its own owner and lease, with its "claimed"
# event; a fingerprinted ready or deferred one (guarded) only if it may start
# (asyncplane_twin_may_start: its content's lock, already had from TRY_LOCK_CONTENTS, and
# no twin running now, in a snapshot taken after it).
# The fence rises by one. What the claims took from limited projects' rate buckets is
# written in the same statement (as `_rules.spend` says, counting every item dealt).
# An item of a project limited since this claim read its reach, and whose limits it did
# not take, is not claimed: its limits were not counted. ($1 now, $2 item ids, $3 owners,
# $4 lease expiries, $5 guarded, $6 actor_id, $7 whether the item's project's limits are
# the claim's: taken, and counted; then the event each claim records first, if any (a
# takeover's "lease_expired", made by `_rules.takeover_event`), written only for an item
# claimed: $8 its type, $9 fence, $10 owner, $11 detail)
_CLAIMED = f"""claimed AS (
    UPDATE items {_claim_set("c", "$1")}
    FROM unnest($2::bigint[], $3::text[], $4::float8[], $5::boolean[], $7::boolean[],
                $8::text[], $9::bigint[], $10::text[], $11::text[])
         AS c (item_id, owner, expires, guarded, counted,
               before_type, before_fence, before_owner, before_detail)
    WHERE items.item_id = c.item_id AND items.item_id = ANY ($2::bigint[])
      AND (c.counted OR NOT EXISTS (
          SELECT 1 FROM project_limits AS l WHERE l.project_id = items.project_id))
      AND (NOT c.guarded
           OR asyncplane_twin_may_start(items.project_id, items.fingerprint, items.item_id))
    RETURNING items.item_id, items.project_id, items.payload, items.fence, items.attempts,
              items.created_at, items.trace_context,
              items.owner, c.before_type, c.before_fence, c.before_owner, c.before_detail),
logged AS (
    INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
    SELECT item_id, event_type, fence, owner, $6::text, $1, detail FROM (
        SELECT item_id, before_type AS event_type, before_fence AS fence,
               before_owner AS owner, before_detail AS detail, 0 AS step
        FROM claimed WHERE before_type IS NOT NULL
        UNION ALL
        SELECT item_id, 'claimed', fence, owner, NULL, 1 FROM claimed) AS claim_events
    ORDER BY item_id, step)
SELECT item_id, project_id, payload, fence, attempts, created_at, trace_context
FROM claimed
"""
CLAIM_ITEMS: Final = "WITH " + _CLAIMED
# The same, writing what the claims took of rate buckets (a statement apart, so that the
# common claim's plan is not planned anew each time for arrays it never has). ($12 the
# projects whose buckets were drawn from, $13 the tokens each has left, $14 refilled at)
CLAIM_ITEMS_SPENDING: Final = (
    """
WITH spent AS (
    UPDATE project_limits AS l SET tokens = s.tokens, refilled_at = s.refilled_at
    FROM unnest($12::text[], $13::float8[], $14::float8[]) AS s (project_id, tokens, refilled_at)
    WHERE l.project_id = s.project_id),
"""
    + _CLAIMED
)
# The limits of the claim's reach, locked ($1 project_id, $2 actor_id, $3 NULL: wait for
# them all; or only these projects, skipping those another claimer holds).
TAKE_LIMITS: Final = "SELECT * FROM asyncplane_take_limits($1::text, $2::text, $3::text[])"
# A round that claims for several reaches takes every limited project's lock of them all
# first, in one order, as asyncplane_take_limits takes one reach's (the claims' shared
# lock first, then each project's, by id; a lock held is taken again at once): each
# reach's claim took its own in turn, so a round claiming for b, then for every project,
# held b and waited for a, while another host's round held a and waited for b.
# ($1 reaches' project ids, $2 their actor ids, NULL for any)
CLAIMS_SHARED: Final = f"SELECT {_CLAIMING}"
LOCK_REACHES_LIMITS: Final = """
SELECT pg_advisory_xact_lock(hashtextextended(
    'asyncplane-limit:' || current_schema() || chr(1) || limited.project_id, 0))
FROM (
    SELECT DISTINCT l.project_id FROM project_limits AS l
    JOIN projects AS p ON p.project_id = l.project_id
    JOIN unnest($1::text[], $2::text[]) AS reach (project_id, actor_id)
      ON (reach.project_id IS NULL OR l.project_id = reach.project_id)
     AND (reach.actor_id IS NULL OR l.project_id IN (
          SELECT a.project_id FROM assignments AS a WHERE a.actor_id = reach.actor_id))
    WHERE p.status = 'open'
) AS limited
ORDER BY limited.project_id
"""
# One project's limits (all None: it has none), or every limited project's, each with
# its count of claimed items.
_LIMITS_COLUMNS = """
    p.project_id, l.max_running, l.per_minute, l.burst, l.tokens, l.refilled_at,
    (SELECT count(*) FROM items
     WHERE items.project_id = p.project_id AND items.state = 'claimed')"""
GET_LIMITS: Final = f"""
SELECT {_LIMITS_COLUMNS}
FROM projects AS p LEFT JOIN project_limits AS l ON l.project_id = p.project_id
WHERE p.project_id = $1
"""
ALL_LIMITS: Final = f"""
SELECT {_LIMITS_COLUMNS}
FROM project_limits AS l JOIN projects AS p ON p.project_id = l.project_id
ORDER BY p.project_id COLLATE "C"
"""
# set_limits changes one project's limits at a time on every host: it holds the project's
# row (not so strongly that an enqueue's key check of it waits) while it reads and writes.
LOCK_PROJECT: Final = "SELECT 1 FROM projects WHERE project_id = $1 FOR NO KEY UPDATE"
# ... and its limits' lock, the one a claim takes (asyncplane_take_limits), so that a
# claim drawing from the bucket now commits first, and what it spent is read (not given
# back). ($1 project_id)
LOCK_LIMITS: Final = """
SELECT pg_advisory_xact_lock(
    hashtextextended('asyncplane-limit:' || current_schema() || chr(1) || $1::text, 0))
"""
PUT_LIMITS: Final = """
INSERT INTO project_limits (project_id, max_running, per_minute, burst, tokens, refilled_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (project_id) DO UPDATE SET
    max_running = excluded.max_running, per_minute = excluded.per_minute,
    burst = excluded.burst, tokens = excluded.tokens, refilled_at = excluded.refilled_at
"""
DELETE_LIMITS: Final = "DELETE FROM project_limits WHERE project_id = $1"
# Said by a claim that locked candidates it did not take (another claimer skipped them
# meanwhile, and may have gone to sleep for want of work): wake the drainers.
NOTIFY: Final = "SELECT " + _NOTIFY_WORK
EXHAUST_ITEM: Final = """
UPDATE items SET state = 'failed', lease_expires_at = NULL, error = $1, updated_at = $2
WHERE item_id = $3 AND state = 'claimed' AND fence = $4
"""
RENEW: Final = """
UPDATE items SET lease_expires_at = $1, updated_at = $2
WHERE item_id = $3 AND state = 'claimed' AND fence = $4
  AND ($5::text IS NULL OR project_id IN (
           SELECT project_id FROM assignments WHERE actor_id = $5::text FOR KEY SHARE))
RETURNING lease_expires_at
"""

# --- settling ------------------------------------------------------------------------------
# Fenced and state-guarded in the UPDATE's WHERE clause: under READ COMMITTED, an UPDATE
# that waited for another transaction's lock re-checks its WHERE against the row as that
# transaction left it, so a settlement racing a takeover matches at most one of them.
# Parameters: $1 item_id, $2 fence, $3 actor_id, $4 now, then the statement's own.

_SETTLE_GUARD = """
WHERE item_id = $1 AND fence = $2 AND state IN ('claimed', 'offloaded')
  AND ($3::text IS NULL OR project_id IN (
           SELECT project_id FROM assignments WHERE actor_id = $3::text FOR KEY SHARE))
"""
_SETTLED = "RETURNING owner, project_id, fingerprint, attempts, max_attempts, state"
SETTLE_FAILED: Final = f"""
UPDATE items SET state = 'failed', error = $5, lease_expires_at = NULL, due_at = NULL,
                 offload_handle = NULL, updated_at = $4
{_SETTLE_GUARD} {_SETTLED}
"""
# A finish and its ledger event in one statement (one round trip). ($1 item_id, $2 fence,
# $3 actor_id, $4 now, $5 result or error, $6 the event's detail)
_LOGGED = """
, logged AS (
    INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
    SELECT $1, state, $2, owner, $3, $4, $6 FROM settled)
SELECT owner, project_id, fingerprint FROM settled
"""
FINISH_DONE: Final = f"""
WITH settled AS (
    UPDATE items SET state = 'done', result = $5, error = NULL, lease_expires_at = NULL,
                     due_at = NULL, offload_handle = NULL, updated_at = $4
    {_SETTLE_GUARD} RETURNING owner, project_id, fingerprint, state){_LOGGED}"""
FINISH_FAILED: Final = f"""
WITH settled AS (
    UPDATE items SET state = 'failed', error = $5, lease_expires_at = NULL, due_at = NULL,
                     offload_handle = NULL, updated_at = $4
    {_SETTLE_GUARD} RETURNING owner, project_id, fingerprint, state){_LOGGED}"""
# Finishes that came together, all in one statement: each row fenced and state-guarded as
# in FINISH_DONE, each with its own event; a done one with a fingerprint then settles its
# pending twins (asyncplane_settle_twins, migration 12: after the content's hand-off lock,
# in a snapshot of its own), each with the event of the twin template (`_rules.twin_event`).
# An asked row missing from the answer matched nothing and wrote nothing. The writer
# sends it alone, and PostgreSQL commits it by itself. ($1 now, then arrays, pairwise:
# item ids, fences, actor ids, statuses, results, errors, event details; then the twin
# events' type and owner, and each finish's twin event detail) -> each settled item,
# with how many twins it settled
FINISH_MANY: Final = """
WITH asked AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::text[], $6::text[],
                         $7::text[], $8::text[], $11::text[])
        AS a (item_id, fence, actor_id, status, result, error, detail, twin_detail)),
settled AS (
    UPDATE items
    SET state = a.status,
        result = CASE WHEN a.status = 'done' THEN a.result ELSE items.result END,
        error = CASE WHEN a.status = 'done' THEN NULL ELSE a.error END,
        lease_expires_at = NULL, due_at = NULL, offload_handle = NULL, updated_at = $1
    FROM asked AS a
    WHERE items.item_id = a.item_id AND items.item_id = ANY ($2::bigint[])
      AND items.fence = a.fence
      AND items.state IN ('claimed', 'offloaded')
      AND (a.actor_id IS NULL OR items.project_id IN (
               SELECT project_id FROM assignments WHERE actor_id = a.actor_id
               FOR KEY SHARE))
    RETURNING items.item_id, items.owner, items.project_id, items.fingerprint, items.state,
              a.fence, a.actor_id, a.detail, a.result, a.twin_detail),
logged AS (
    INSERT INTO events (item_id, event_type, fence, owner, actor_id, at, detail)
    SELECT item_id, state, fence, owner, actor_id, $1, detail FROM settled
    RETURNING item_id)
SELECT s.item_id, s.project_id, s.fingerprint,
       CASE WHEN s.state = 'done' AND s.fingerprint IS NOT NULL
            THEN asyncplane_settle_twins(s.project_id, s.fingerprint, s.item_id, s.result, $1,
                                         s.actor_id, $9, $10, s.twin_detail)
            ELSE 0 END
FROM settled AS s
-- (Every finish's event is written first, once, before any row is read here: the twins'
-- events come after the finishes', as they did in a transaction. A join with `logged`
-- did the same, but its plan read `logged` again for each row: a round of 256 finishes
-- cost 11 ms, against 8.)
WHERE (SELECT count(*) FROM logged) >= 0
"""
READ_BUDGET: Final = f"""
SELECT attempts, max_attempts, owner FROM items {_SETTLE_GUARD}
FOR UPDATE
"""
# $5 due_at, $6 error, $7 refund (0 or 1), $8 from claimed only
SETTLE_DEFERRED: Final = f"""
UPDATE items SET state = 'deferred', due_at = $5, error = $6,
                 attempts = attempts - $7, lease_expires_at = NULL, offload_handle = NULL,
                 updated_at = $4
{_SETTLE_GUARD} AND (NOT $8::boolean OR state = 'claimed') {_SETTLED}
"""
# A claim given back unrun: ready again at once, its attempt refunded (as on SQLite).
RELEASE: Final = f"""
UPDATE items SET state = 'ready', attempts = attempts - 1, lease_expires_at = NULL,
                 updated_at = $4
{_SETTLE_GUARD} AND state = 'claimed' {_SETTLED}
"""
SETTLE_OFFLOADED: Final = f"""
UPDATE items SET state = 'offloaded', offload_handle = $5, lease_expires_at = NULL,
                 updated_at = $4
{_SETTLE_GUARD} AND state = 'claimed' {_SETTLED}
"""
# A done item's pending twins enqueued with dedup, settled with its result after the
# content's hand-off lock, each with its event (migration 12: $1 project_id, $2
# fingerprint, $3 the done item, $4 its result, $5 now, $6 actor_id, then the twin
# events' type, owner and detail) -> how many
SETTLE_TWINS: Final = "SELECT asyncplane_settle_twins($1, $2, $3, $4, $5, $6, $7, $8, $9)"
# Preflight, as on SQLite: the contents noted as they formed a twin pair (migration 7),
# read a chunk of notes at a time; their pending twins settled with the oldest done
# twin's result (locked, skipping any another transaction holds); then the notes read
# whose content has no pair left are forgotten, in a snapshot taken after the settles, so
# a twin skipped while locked keeps its note. The look: $1 project_id, $2 actor_id; the
# notes: $1 chunk, $2 project_id, $3 actor_id.
ANY_TWIN_NOTED: Final = """
SELECT EXISTS (
    SELECT 1 FROM twin_checks
    WHERE ($1::text IS NULL OR project_id = $1::text)
      AND ($2::text IS NULL
           OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text)))
"""
# $1 how many, $2 project, $3 actor, $4 the last note an earlier page of the step read.
TWIN_NOTES: Final = """
SELECT note_id, project_id, fingerprint FROM twin_checks
WHERE note_id > $4::bigint
  AND ($2::text IS NULL OR project_id = $2::text)
  AND ($3::text IS NULL OR project_id IN (
           SELECT project_id FROM assignments WHERE actor_id = $3::text FOR KEY SHARE))
ORDER BY note_id LIMIT $1
"""
# Each looked up from its content, for any plan, generic (the write connection's, perhaps
# made before the table had statistics) or not: the contents lead (LATERAL keeps them
# outside), and each side's state test is the predicate of its own index of a content's
# twins (migration 8), so no plan walks the pending or done items of the store through
# another (items_by_state, items_by_project), nor the whole table in id order for the
# LIMIT, nor every twin a content ever had. What makes a pair is written once
# (_PAIR_PENDING, _PAIR_DONE): the settle, the forgetting and the full pass must agree on
# it, or a note would go while its pair stays.
_PAIR_PENDING = f"p.state IN {_PENDING_STATES} AND p.dedup"
_PAIR_DONE = "d.state = 'done'"
# $1 chunk, $2 the notes' projects, $3 their fingerprints (distinct contents).
NOTED_TWIN_PAIRS: Final = f"""
SELECT p.item_id, p.fence, d.item_id, d.result
FROM unnest($2::text[], $3::text[]) AS c (project_id, fingerprint)
CROSS JOIN LATERAL (
    SELECT p.item_id, p.fence FROM items AS p
    WHERE p.project_id = c.project_id AND p.fingerprint = c.fingerprint AND {_PAIR_PENDING}
    FOR UPDATE SKIP LOCKED) AS p
CROSS JOIN LATERAL (
    SELECT d.item_id, d.result FROM items AS d
    WHERE d.project_id = c.project_id AND d.fingerprint = c.fingerprint AND {_PAIR_DONE}
    ORDER BY d.item_id LIMIT 1) AS d
LIMIT $1
"""
# The notes read ($1 ids, $2 projects, $3 fingerprints) whose content's hand-off lock this
# transaction has or gets now (tried, never waited for: held elsewhere, the note stays).
LOCK_NOTED_CONTENTS: Final = """
SELECT c.note_id FROM unnest($1::bigint[], $2::text[], $3::text[])
    AS c (note_id, project_id, fingerprint)
WHERE pg_try_advisory_xact_lock(hashtextextended(
    current_schema() || chr(1) || c.project_id || chr(1) || c.fingerprint, 2))
"""
# (A scalar subquery, run for each note read: as NOT EXISTS the planner may make it an
# anti join that walks every pending item.)
FORGET_TWIN_NOTES: Final = f"""
DELETE FROM twin_checks AS c
WHERE c.note_id = ANY ($1::bigint[]) AND NOT coalesce((
    SELECT true FROM items AS p
    WHERE p.project_id = c.project_id AND p.fingerprint = c.fingerprint AND {_PAIR_PENDING}
      AND EXISTS (SELECT 1 FROM items AS d
                  WHERE d.project_id = c.project_id AND d.fingerprint = c.fingerprint
                    AND {_PAIR_DONE})
    LIMIT 1), false)
"""
SETTLE_ONE_TWIN: Final = """
UPDATE items SET state = 'done', result = $1, error = NULL, due_at = NULL, updated_at = $2
WHERE item_id = $3 AND state IN ('ready', 'deferred')
"""
# A full pass: every pair's content in scope ($1 project_id, $2 actor_id), found by a
# walk of the pending items (a read), then noted.
ALL_TWIN_PAIRS: Final = f"""
SELECT DISTINCT p.project_id, p.fingerprint FROM items AS p
WHERE {_PAIR_PENDING} AND p.fingerprint IS NOT NULL
  AND EXISTS (SELECT 1 FROM items AS d
              WHERE d.project_id = p.project_id AND d.fingerprint = p.fingerprint
                AND {_PAIR_DONE})
  AND ($1::text IS NULL OR p.project_id = $1::text)
  AND ($2::text IS NULL
       OR p.project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text))
"""
NOTE_TWIN_CHECK: Final = "INSERT INTO twin_checks (project_id, fingerprint) VALUES ($1, $2)"
# Backfill, through the items without a fingerprint (their own index): $1 after, $2 chunk,
# $3 project_id, $4 actor_id; read first, and only those that get a fingerprint written
# ($1 their ids; each locked, skipping any another transaction holds).
MISSING_FINGERPRINTS: Final = """
SELECT item_id, payload FROM items
WHERE fingerprint IS NULL AND item_id > $1
  AND state NOT IN ('claimed', 'offloaded')  -- never under a running claim
  AND ($3::text IS NULL OR project_id = $3::text)
  AND ($4::text IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $4::text))
ORDER BY item_id LIMIT $2
"""
LOCK_UNFINGERPRINTED: Final = """
SELECT item_id FROM items
WHERE item_id = ANY ($1::bigint[])
  AND fingerprint IS NULL AND state NOT IN ('claimed', 'offloaded')
FOR UPDATE SKIP LOCKED
"""
SET_FINGERPRINT: Final = """
UPDATE items SET fingerprint = $1
WHERE item_id = $2 AND fingerprint IS NULL AND state NOT IN ('claimed', 'offloaded')
"""

# The drain loop's alarm ($1 project_id, $2 actor_id): the earliest moment a deferred item
# falls due or a lease lapses, among items a claim with the same filters could take.
# Projects with limits are read apart (NEXT_DUE_LIMITED).
# Led by the projects in reach without limits, two reads of each. Its first deferred item
# that may run: from the project's place in items_project_due on, asked for by a row
# comparison on that index's columns, which leads every plan there (asked as
# `project_id = ... ORDER BY due_at`, plans walked the store's deferred items in due order
# through items_due, filtering for the project, once a project: 760 ms for 100 projects
# beside 50,000 deferred items of another); its own items held back by a running twin
# are stepped over, and the first row of any other project ends the scan (and means none:
# filtered too, the scan ran on into the next projects' held items). And its claimed
# items' first lease, `+ 0` keeping the planner from reading it off items_lease (the
# store's claimed items in lease order, once a project), so it reads the project's own
# through items_running. (Written as min()s over the items, every plan read every
# deferred item of the reach, each time a claimer went to sleep.)
_UNLIMITED = "AND project_id NOT IN (SELECT project_id FROM project_limits)"
NEXT_DUE: Final = f"""
SELECT min(due.at) FROM projects AS p
CROSS JOIN LATERAL (
    SELECT first.due_at AS at FROM (
        SELECT project_id, due_at FROM items
        WHERE state = 'deferred' AND (project_id, due_at) >= (p.project_id, '-Infinity')
          AND (project_id <> p.project_id OR {_NO_RUNNING_TWIN})
        ORDER BY project_id, due_at LIMIT 1) AS first
    WHERE first.project_id = p.project_id
    UNION ALL
    SELECT min(lease_expires_at + 0) FROM items
    WHERE items.project_id = p.project_id AND state = 'claimed') AS due
WHERE TRUE {_IN_REACH} {_UNLIMITED}
"""
# The same per limited project in reach, with its limits (`_rules.limited_due`): whether
# it has ready items, when its first deferred one falls due, its first lease lapses.
# ($1 project_id, $2 actor_id)
NEXT_DUE_LIMITED: Final = f"""
SELECT l.project_id, l.max_running, l.per_minute, l.burst, l.tokens, l.refilled_at,
       (SELECT count(*) FROM items WHERE items.project_id = l.project_id
          AND state = 'claimed'),
       EXISTS (SELECT 1 FROM items WHERE items.project_id = l.project_id
                 AND state = 'ready' AND NOT held
                 AND {_NO_RUNNING_TWIN}),
       (SELECT min(due_at) FROM items WHERE items.project_id = l.project_id
          AND state = 'deferred' AND {_NO_RUNNING_TWIN}),
       (SELECT min(lease_expires_at) FROM items WHERE items.project_id = l.project_id
          AND state = 'claimed')
FROM project_limits AS l JOIN projects AS p ON p.project_id = l.project_id
WHERE p.status = 'open' AND ($1::text IS NULL OR l.project_id = $1::text)
  AND ($2::text IS NULL
       OR l.project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text))
"""

DIAGNOSE_ITEM: Final = """
SELECT state, fence,
       EXISTS (SELECT 1 FROM assignments AS a
               WHERE a.actor_id = $1 AND a.project_id = items.project_id) AS in_scope,
       error
FROM items WHERE item_id = $2
"""
# The same, locking the row for the rest of the transaction: a cancel or a requeue
# decides on what it read, so nothing may change it in between.
# (Its assignment held, as IS_ASSIGNED's.)
TARGET_ITEM: Final = """
SELECT state, fence,
       EXISTS (SELECT 1 FROM assignments AS a
               WHERE a.actor_id = $1 AND a.project_id = items.project_id
               FOR KEY SHARE) AS in_scope,
       error
FROM items WHERE item_id = $2 FOR UPDATE OF items
"""

# --- operating single items ---------------------------------------------------------------
# As on SQLite (see its SQL): `asyncplane._rules` decides, these write it.

CANCEL_ITEM: Final = """
UPDATE items SET state = 'cancelled', fence = $1, error = $2, lease_expires_at = NULL,
                 due_at = NULL, updated_at = $3
WHERE item_id = $4
"""
REQUEUE_ITEM: Final = """
UPDATE items SET state = 'ready', attempts = 0, error = NULL, result = NULL, owner = NULL,
                 lease_expires_at = NULL, due_at = NULL, offload_handle = NULL, updated_at = $1
WHERE item_id = $2
"""

# Listing: an arm per state from items_by_project or items_by_state (the claimed from
# items_lease), as on SQLite. The
# parameters: $1 project_id, $2 owner, $3 fingerprint, $4-$7 created after/before and
# updated after/before, $8 error_contains, $9 actor_id, $10 after, $11 limit, $12 states.
_LISTED = (
    "item_id, project_id, state, {payload}, fence, attempts, owner, lease_expires_at, "
    "created_at, updated_at, priority, service_class, sla, fingerprint, max_attempts, "
    "due_at, {result}, error, offload_handle, dedup, claimed_at, trace_context"
)
# A search folds the case of ASCII letters only, whatever the server's locale: lower()
# would fold more under a UTF-8 ctype, and nothing but ASCII under C (see _validate).
_FOLDED_ERROR = f"translate(error, '{_validate.ASCII_UPPER}', '{_validate.ASCII_LOWER}')"
_LIST_FILTERS = f"""
      AND ($2::text IS NULL OR owner = $2)
      AND ($3::text IS NULL OR fingerprint = $3)
      AND ($4::float8 IS NULL OR created_at > $4)
      AND ($5::float8 IS NULL OR created_at < $5)
      AND ($6::float8 IS NULL OR updated_at > $6)
      AND ($7::float8 IS NULL OR updated_at < $7)
      AND ($8::text IS NULL OR strpos({_FOLDED_ERROR}, $8) > 0)
      AND ($9::text IS NULL
           OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $9))
"""


#: The listing indexes' own WHERE, repeated in each arm they serve.
_NOT_CLAIMED: Final = "AND state <> 'claimed'"


@functools.lru_cache(maxsize=256)
def list_items(states: tuple[str, ...], project: bool, newest: bool, payload: bool) -> str:
    """The listing for ``states`` (none: any state; $12 is their array, for the chunk
    lock), of one project ($1) or of all, within the keyset bound $10
    (`_rules.keyset_start`), at most $11 rows.
    The states are written into the SQL, as on SQLite, so the partial indexes serve it."""
    assert all(state in _models.ITEM_STATES for state in states)
    columns = _LISTED.format(
        payload="payload" if payload else "NULL::text", result="result" if payload else "NULL::text"
    )
    order = "item_id DESC" if newest else "item_id"
    keyset = "item_id <= $10" if newest else "item_id > $10"
    scope = "AND project_id = $1::text" if project else "AND $1::text IS NULL"
    where = f"{keyset} {scope} AND $12::text[] IS NOT NULL {_LIST_FILTERS}"
    if not states:
        return f"SELECT {columns} FROM items WHERE {where} ORDER BY {order} LIMIT $11"
    selects = [
        f"(SELECT {columns} FROM items WHERE state = '{state}' "
        f"{'' if state == 'claimed' else _NOT_CLAIMED} AND {where} "
        f"ORDER BY {order} LIMIT $11)"
        for state in states
    ]
    arms_sql = " UNION ALL ".join(selects)
    return f"SELECT * FROM ({arms_sql}) AS listed ORDER BY {order} LIMIT $11"


# A chunk's rows, locked, as they are once locked: a row another transaction changed in
# between is read again, and left out if the filter no longer takes it. ($13: the ids)
# (The actor's assignments held, as IS_ASSIGNED's.)
_HELD_FILTERS = _LIST_FILTERS.replace("WHERE actor_id = $9)", "WHERE actor_id = $9 FOR KEY SHARE)")
assert _HELD_FILTERS != _LIST_FILTERS
LOCK_CHUNK: Final = f"""
SELECT item_id, state, fence FROM items
WHERE item_id = ANY($13::bigint[]) AND state = ANY($12::text[])
  AND ($1::text IS NULL OR project_id = $1) AND $10::bigint IS NOT NULL
  AND $11::bigint IS NOT NULL {_HELD_FILTERS}
ORDER BY item_id FOR UPDATE
"""

_ITEM_COLUMNS = (
    "item_id, project_id, state, payload, fence, attempts, owner, lease_expires_at, "
    "created_at, updated_at, priority, service_class, sla, fingerprint, max_attempts, "
    "due_at, result, error, offload_handle, dedup, claimed_at, trace_context"
)
GET_ITEM: Final = f"SELECT {_ITEM_COLUMNS} FROM items WHERE item_id = $1"
#: Of the items `wait()` callers wait for, those in one of the states given, or gone.
ENDED_AMONG: Final = """
SELECT waited.id FROM unnest($1::bigint[]) AS waited (id)
LEFT JOIN items ON items.item_id = waited.id
WHERE items.item_id IS NULL OR items.state = ANY($2::text[])
"""
GET_ITEM_SCOPED: Final = (
    f"SELECT {_ITEM_COLUMNS} FROM items WHERE item_id = $1 "
    "AND project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2)"
)
OFFLOADED: Final = f"""
SELECT {_ITEM_COLUMNS} FROM items
WHERE state = 'offloaded' AND offload_handle = $1
  AND ($2::text IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text))
ORDER BY item_id
"""
GET_EVENTS: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM items AS i LEFT JOIN events AS e ON e.item_id = i.item_id
WHERE i.item_id = $1
ORDER BY e.event_id
"""
GET_EVENTS_SCOPED: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM items AS i LEFT JOIN events AS e ON e.item_id = i.item_id
WHERE i.item_id = $1
  AND i.project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2)
ORDER BY e.event_id
"""
# The newest $3 events of an item, oldest first ($2 the actor or NULL), as SQLite's: the
# item's own ids first (OFFSET 0 keeps the planner from walking the whole ledger's
# primary key backwards, filtering for the item), then only those rows.
GET_LAST_EVENTS: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM items AS i LEFT JOIN events AS e ON e.item_id = i.item_id
  AND e.event_id IN (SELECT m.event_id
                     FROM (SELECT event_id FROM events WHERE item_id = $1 OFFSET 0) AS m
                     ORDER BY m.event_id DESC LIMIT $3)
WHERE i.item_id = $1
  AND ($2::text IS NULL
       OR i.project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2))
ORDER BY e.event_id
"""

# --- retention -----------------------------------------------------------------------------

# A purge's next chunk ($1 cutoff, $2 chunk), after the last one the chunk before read
# ($3 its last change, $4 its id), so rows it passed over are not read again this purge.
PURGE_CANDIDATES: Final = f"""
SELECT {_ITEM_COLUMNS} FROM items
WHERE state IN {_SETTLED_STATES} AND updated_at < $1
  AND (updated_at > $3 OR (updated_at = $3 AND item_id > $4))
ORDER BY updated_at, item_id
LIMIT $2
"""
# The events of a chunk of items ($1 ids), oldest first: looked up from each id (the
# ORDER BY inside keeps the LATERAL a subquery run for each, never a join that a plan made
# on a near-empty table turns into a walk of every event in id order).
EVENTS_OF_ITEMS: Final = """
SELECT e.event_id, e.item_id, e.event_type, e.fence, e.owner, e.actor_id, e.at, e.detail
FROM unnest($1::bigint[]) AS c (item_id)
CROSS JOIN LATERAL (
    SELECT event_id, item_id, event_type, fence, owner, actor_id, at, detail FROM events
    WHERE events.item_id = c.item_id ORDER BY event_id) AS e
ORDER BY e.event_id
"""
# (The settled test written `IS TRUE`, which no index serves: as a plain test, a plan made
# on a grown table without statistics took items_settled for it, every settled item read
# for each chunk, beside the ids' own probes.)
# Each only as archived ($1 ids, $2 their fences, $3 their last changes): a probe of the
# primary key for each archived row. (Beside `item_id = ANY($1)`, a generic plan led by
# that and rescanned the arrays for each item: 3.5 s for a chunk of 5,000, against 14 ms.)
_ARCHIVED: Final = (
    "unnest($1::bigint[], $2::bigint[], $3::float8[]) AS a (item_id, fence, updated_at)"
)
_AS_ARCHIVED: Final = f"""items.item_id = a.item_id AND items.fence = a.fence
      AND items.updated_at = a.updated_at AND (items.state IN {_SETTLED_STATES}) IS TRUE"""
# The items ($1 ids, $2 fences, $3 last changes) that still stand settled as archived: a
# probe of the primary key for each (LATERAL, LIMIT 1: never a walk of the table).
STANDING_AS_ARCHIVED: Final = f"""
SELECT a.item_id FROM {_ARCHIVED}
CROSS JOIN LATERAL (SELECT 1 FROM items WHERE {_AS_ARCHIVED} LIMIT 1) AS standing
"""
# Deleted as archived: only rows no one else holds (SKIP LOCKED). A delete that waited
# for a row being requeued would, its check failing on the new row, still hold that row's
# lock to its commit, and a claim meanwhile (SKIP LOCKED) would pass the item by.
PURGE_ITEMS: Final = f"""
WITH doomed AS (
    SELECT locked.item_id FROM {_ARCHIVED}
    CROSS JOIN LATERAL (SELECT item_id FROM items WHERE {_AS_ARCHIVED}
                        FOR UPDATE SKIP LOCKED) AS locked)
DELETE FROM items USING doomed WHERE items.item_id = doomed.item_id
RETURNING items.item_id
"""
PURGE_EVENTS: Final = "DELETE FROM events WHERE item_id = ANY($1::bigint[])"
# A waiter marks its item awaited (its settle will notify); then, the mark committed, it
# reads the item's row FOR SHARE, a statement alone, so it waits for a settle under way,
# which may have looked for marks before the mark was there and holds the row to its
# commit (migration 16). Not a claimable item's: a claim passing a row held so skips
# it, and the drainers then slept to their next look (up to 5 s: a producer's enqueue
# and wait, the wait's read as the enqueue's notification woke them). So a cancel, or a
# twin's settle, of a ready or deferred item, at the very moment of its first wait, is
# heard at the wait's safety look, every 5 s. ($1 item id)
MARK_AWAITED: Final = "INSERT INTO awaited (item_id) VALUES ($1) ON CONFLICT DO NOTHING"
SETTLES_UNDER_WAY: Final = (
    "SELECT 1 FROM items WHERE item_id = $1 AND state NOT IN ('ready', 'deferred') FOR SHARE"
)
PURGE_AWAITED: Final = "DELETE FROM awaited WHERE item_id = ANY($1::bigint[])"

# --- imports --------------------------------------------------------------------------------

# Imports of one source take turns, so two at once never copy a row twice.
LOCK_SOURCE: Final = (
    "SELECT pg_advisory_xact_lock("
    "hashtextextended('import:' || current_schema() || chr(1) || $1::text, 0))"
)
ALREADY_IMPORTED: Final = "SELECT 1 FROM imports WHERE source = $1 AND source_key = $2"


# A copy's record of an item it brought (no digest: its key is the item's own id).
RECORD_IMPORT: Final = (
    "INSERT INTO imports (source, source_key, item_id, imported_at) VALUES ($1, $2, $3, $4)"
)
# An imported row's record, as on SQLite: a row copied again takes its key's record over.
# An import's drop of a source table, as on SQLite. ($1 the drop's record name, $2 its
# key, $3 the source, $4 now)
DROPPED_UP_TO: Final = "SELECT item_id FROM imports WHERE source = $1 AND source_key = $2"
RECORD_DROPPED: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at)
VALUES ($1, $2, (SELECT coalesce(max(item_id), 0) FROM imports WHERE source = $3), $4)
ON CONFLICT (source, source_key) DO UPDATE
SET item_id = excluded.item_id, imported_at = excluded.imported_at
"""
IMPORTED_AS: Final = "SELECT digest, item_id FROM imports WHERE source = $1 AND source_key = $2"
RECORD_IMPORTED_ROW: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at, digest) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (source, source_key) DO UPDATE
SET item_id = excluded.item_id, imported_at = excluded.imported_at, digest = excluded.digest
"""

# --- copying between stores -----------------------------------------------------------------

LIST_ASSIGNMENTS: Final = """
SELECT actor_id, project_id, assigned_at FROM assignments
ORDER BY project_id COLLATE "C", actor_id COLLATE "C"
"""
EXPORT_ITEMS: Final = f"""
SELECT {_ITEM_COLUMNS} FROM items
WHERE item_id > $1 AND (NOT $3::boolean OR state NOT IN {_SETTLED_STATES})
ORDER BY item_id LIMIT $2
"""
COPY_LIMITS: Final = """
INSERT INTO project_limits (project_id, max_running, per_minute, burst, tokens, refilled_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (project_id) DO NOTHING
"""
COPY_PROJECT: Final = """
INSERT INTO projects (project_id, name, status, created_at) VALUES ($1, $2, $3, $4)
ON CONFLICT (project_id) DO NOTHING
RETURNING project_id
"""
COPY_ASSIGNMENT: Final = """
INSERT INTO assignments (actor_id, project_id, assigned_at) VALUES ($1, $2, $3)
ON CONFLICT (actor_id, project_id) DO NOTHING
"""
# The settings a copy added, recorded as on SQLite (see `_sqlite_sql.RECORDED_SETTINGS`).
RECORDED_SETTINGS: Final = "SELECT source_key FROM imports WHERE source = $1"
RECORD_SETTING: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at) VALUES ($1, $2, 0, $3)
ON CONFLICT (source, source_key) DO NOTHING
"""
# Whether a copy from this source brought anything here (its items' records).
ANY_RECORD: Final = "SELECT 1 FROM imports WHERE source = $1 LIMIT 1"
# A schedule copied before moves on to the source's place (`_rules.copy_settings_plan`).
MOVE_COPIED_SCHEDULE: Final = (
    "UPDATE schedules SET next_at = $2, last_at = $3, updated_at = $4 WHERE name = $1"
)
ITEM_EXISTS: Final = "SELECT 1 FROM items WHERE item_id = $1"
# A running content twin of an item a copy brings (`items_running_fingerprint` holds one).
RUNNING_TWIN: Final = """
SELECT item_id FROM items
WHERE project_id = $1 AND fingerprint = $2 AND state IN ('claimed', 'offloaded')
"""
# What a copy compares of an item it copied before with the source's (`_rules.copied_here`).
COPIED_ITEM: Final = "SELECT project_id, created_at FROM items WHERE item_id = $1"
# The first item no copy from a source brought (a copy records each under its id's text,
# `_copy_items`): the look a copy takes before it writes.
FIRST_FOREIGN_ITEM: Final = """
SELECT item_id FROM items
WHERE NOT EXISTS (SELECT 1 FROM imports
                  WHERE source = $1 AND source_key = items.item_id::text)
ORDER BY item_id LIMIT 1
"""
COPY_ITEM: Final = f"""
INSERT INTO items ({_ITEM_COLUMNS})
VALUES ({", ".join(f"${n}" for n in range(1, 23))})
"""
# Ids a copy brought in are never handed out again: the sequence moves past them (and
# never back, so the ids of purged items stay unused too).
# A copy's record of the ids it kept clear (`<source>#ids`, key "last"), beside its items'.
RECORD_ITEM_IDS: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at)
VALUES ($1 || '#ids', 'last', $2, $3)
ON CONFLICT (source, source_key) DO UPDATE SET item_id = greatest(imports.item_id, excluded.item_id)
"""
# The highest id copies from a source brought (their items' keys are the ids) or kept clear.
COPIED_UP_TO: Final = """
SELECT coalesce((SELECT max(source_key::bigint) FROM imports
                 WHERE source = $1 AND source_key ~ '^[0-9]+$'), 0),
       (SELECT item_id FROM imports WHERE source = $1 || '#ids' AND source_key = 'last')
"""
ADVANCE_ITEM_IDS: Final = """
SELECT setval(seq, greatest(coalesce(pg_sequence_last_value(seq), 0), $1::bigint))
FROM (SELECT pg_get_serial_sequence('items', 'item_id')::regclass AS seq) AS s
"""
# The highest id handed out, and whether that is exact: the sequence's last value, which
# only a role with USAGE or SELECT on the sequence may read (a reader role granted SELECT
# on the tables has neither); else the highest id the store still names, which misses an
# item purged above it.
# Which store this is, as the server says it (not as a URL spells it): its cluster's
# system identifier, the database, the schema the search_path resolved to.
STORE_IDENTITY: Final = """
SELECT (SELECT system_identifier FROM pg_catalog.pg_control_system()), current_database(),
       current_schema()
"""
LAST_ITEM_ID: Final = """
SELECT coalesce(CASE WHEN exact THEN pg_sequence_last_value(seq)
                     ELSE greatest((SELECT max(item_id) FROM items),
                                   (SELECT max(item_id) FROM imports),
                                   (SELECT max(item_id) FROM schedule_ticks)) END, 0),
       exact
FROM (SELECT seq, has_sequence_privilege(seq, 'USAGE, SELECT') AS exact
      FROM (SELECT pg_get_serial_sequence('items', 'item_id')::regclass AS seq) AS s) AS p
"""
# The import records, in key order, a page after a key (a copy carries them over).
EXPORT_IMPORTS: Final = """
SELECT source, source_key, item_id, imported_at, digest FROM imports
WHERE (source, source_key) > ($1, $2) ORDER BY source, source_key LIMIT $3
"""
# A record the destination has already is taken if the source's names a later item (a row
# imported again since: ids only rise).
COPY_IMPORTS: Final = """
INSERT INTO imports (source, source_key, item_id, imported_at, digest)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::float8[], $5::text[])
ON CONFLICT (source, source_key) DO UPDATE
SET item_id = excluded.item_id, imported_at = excluded.imported_at, digest = excluded.digest
WHERE excluded.item_id > imports.item_id
"""

# --- stats ----------------------------------------------------------------------------------

#: As COUNT_STATES counts, a part through each partial index (items_by_project, every
#: state but claimed; items_running, the claimed): an index-only scan where the table is
#: vacuumed, never a read of every row's payload.
STATES_BY_PROJECT: Final = """
SELECT project_id, state, n FROM (
    SELECT project_id, state, count(*) AS n FROM items WHERE state <> 'claimed'
    GROUP BY project_id, state
    UNION ALL
    SELECT project_id, 'claimed', count(*) FROM items WHERE state = 'claimed'
    GROUP BY project_id
) AS counted
ORDER BY project_id COLLATE "C", state
"""
OLDEST_READY: Final = "SELECT min(created_at) FROM items WHERE state = 'ready'"
EXPIRED_LEASES: Final = """
SELECT count(*) FROM items
WHERE state = 'claimed'
  AND lease_expires_at <= coalesce($1::float8, extract(epoch FROM clock_timestamp()))
"""
SCHEMA_BYTES: Final = """
SELECT coalesce(sum(pg_total_relation_size(
    format('%I.%I', schemaname, tablename)::regclass)), 0)::bigint
FROM pg_catalog.pg_tables WHERE schemaname = current_schema()
"""

# --- counts --------------------------------------------------------------------------------

# Counted from the indexes (as SQLite's): a project's part of items_by_project (every state
# but claimed) and of items_running (the claimed). Written as one count over the items, no
# index held them all, and every plan walked the table for one small project. ($1
# project_id, $2 actor_id; read with custom plans, which see the project asked for.)
_COUNTED = """($1::text IS NULL OR project_id = $1::text)
  AND ($2::text IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text))"""
COUNT_STATES: Final = f"""
SELECT state, count(*) FROM items WHERE state <> 'claimed' AND {_COUNTED}
GROUP BY state
UNION ALL
SELECT 'claimed', count(*) FROM items WHERE state = 'claimed' AND {_COUNTED}
"""
LEDGER_TALLY: Final = """
SELECT
    (SELECT count(*) FROM items) AS items,
    count(*) FILTER (WHERE event_type = 'claimed') AS claims,
    count(*) FILTER (WHERE event_type = 'lease_expired') AS takeovers,
    count(*) FILTER (WHERE event_type IN ('done', 'failed')) AS terminal_events
FROM events
"""
SETTLED_TWICE: Final = """
SELECT item_id FROM events WHERE event_type IN ('done', 'failed')
GROUP BY item_id HAVING count(*) > 1 ORDER BY item_id
"""
UNEXPLAINED_CLAIMS: Final = """
SELECT item_id FROM events
GROUP BY item_id
HAVING count(*) FILTER (WHERE event_type = 'claimed')
       > 1 + count(*) FILTER (WHERE event_type IN ('lease_expired', 'retried', 'parked',
                                                   'requeued', 'released'))
ORDER BY item_id
"""
TAKEN_FROM: Final = _models.TAKEN_FROM
TAKEN_AFTER_LAST_CLAIM: Final = _models.TAKEN_AFTER_LAST_CLAIM
ITEM_IDS_IN_STATE: Final = "SELECT item_id FROM items WHERE state = $1 ORDER BY item_id"

# --- the ledger verifier ---------------------------------------------------------------
# The SQLite backend's checks, kind for kind and word for word in their details.

#: The replay of an event type to the state it leaves: made from `_models.EVENT_TYPES`.
_REPLAYED: Final = _models.replay_case("e.event_type", "quote_literal")
#: Events that settle an item, and the states they leave (from `_models`).
_SETTLING: Final = _models.sql_list(_models.SETTLING_EVENTS)


# Settled items per minute, project and state since a time, through items_settled: the
# dashboard's throughput (an hour of it once, then only the last minutes again).
SETTLED_PER_MINUTE: Final = f"""
SELECT floor(updated_at / 60) * 60 AS minute, project_id, state, count(*)
FROM items
WHERE state IN {_SETTLED_STATES} AND updated_at >= $1
  AND ($2::text IS NULL
       OR project_id IN (SELECT project_id FROM assignments WHERE actor_id = $2::text))
GROUP BY minute, project_id, state
ORDER BY minute, project_id COLLATE "C", state COLLATE "C"
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
        "two_terminal_events",
        f"""
        SELECT s.item_id,
               'terminal events '
               || string_agg(s.previous || ' then ' || s.event_type, ', ' ORDER BY s.event_id)
               || ' with no requeue between'
        FROM (SELECT item_id, event_type, event_id,
                     lag(event_type) OVER (PARTITION BY item_id ORDER BY event_id) AS previous
              FROM events WHERE event_type IN {_SETTLING} OR event_type = 'requeued') AS s
        WHERE s.event_type <> 'requeued' AND s.previous <> 'requeued'
          AND EXISTS (SELECT 1 FROM items AS i WHERE i.item_id = s.item_id)
        GROUP BY s.item_id
        """,
    ),
    *_models.settling_checks(),
    (
        "fence_not_monotonic",
        """
        SELECT DISTINCT ON (item_id) item_id,
               event_type || ' fence ' || fence || ' follows fence ' || previous
        FROM (SELECT item_id, event_type, fence, event_id,
                     lag(fence) OVER (PARTITION BY item_id ORDER BY event_id) AS previous
              FROM events WHERE event_type IN ('claimed', 'cancelled')) AS claims
        WHERE fence <= previous
        ORDER BY item_id, event_id
        """,
    ),
    (
        "fence_disagrees",
        """
        SELECT i.item_id,
               'row fence ' || i.fence || ' but the last claim or cancel recorded fence '
               || coalesce(c.fence::text, 'none')
        FROM items AS i
        LEFT JOIN (SELECT item_id, fence FROM events
                   WHERE event_id IN (SELECT max(event_id) FROM events
                                      WHERE event_type IN ('claimed', 'cancelled')
                                      GROUP BY item_id)) AS c
               ON c.item_id = i.item_id
        WHERE i.fence IS DISTINCT FROM coalesce(c.fence, 0)
        """,
    ),
    (
        "ready_after_claim",
        _models.ready_after_claim_check(),
    ),
    (
        "state_disagrees",
        f"""
        SELECT i.item_id,
               'row is ' || quote_literal(i.state) || ' but its events lead to ' || r.replayed
        FROM items AS i
        JOIN (SELECT e.item_id,
                     {_REPLAYED} AS replayed
              FROM events AS e
              WHERE e.event_id IN (SELECT max(event_id) FROM events GROUP BY item_id)) AS r
          ON r.item_id = i.item_id
        WHERE i.state IS DISTINCT FROM r.replayed
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
        FROM items AS i
        WHERE i.state = 'ready' AND i.held
          AND NOT EXISTS (SELECT 1 FROM items AS t
                          WHERE t.project_id = i.project_id AND t.fingerprint = i.fingerprint
                            AND t.state IN ('claimed', 'offloaded') AND t.fingerprint IS NOT NULL)
          AND NOT EXISTS (SELECT 1 FROM items AS t
                          WHERE t.project_id = i.project_id AND t.fingerprint = i.fingerprint
                            AND t.state = 'ready' AND NOT t.held AND t.fingerprint IS NOT NULL)
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

#: The checks of one item (its page in the dashboard), read from that item's rows alone:
#: each check's statement with ``items`` and ``events`` standing for the item's row and
#: its events (a CTE of each name, which the statement's unqualified names then mean; in
#: its body the name is the table: a non-recursive CTE's own name is not seen there).
#: Filtered after, a check read the whole index (a second and more a page at a million
#: items). One that looks at other items too
#: (`_models.CHECKS_OF_OTHER_ITEMS`) is still read whole, then filtered.
_ONE_ITEM_SCOPED: Final = (
    "WITH events AS (SELECT * FROM events WHERE item_id = $1), "
    "items AS (SELECT * FROM items WHERE item_id = $1) {check}"
)
_ONE_ITEM_FILTERED: Final = (
    "WITH found (item_id, detail) AS ({check}) SELECT item_id, detail FROM found WHERE item_id = $1"
)
ONE_ITEM_CHECKS: Final = _models.one_item_checks(
    LEDGER_CHECKS, _ONE_ITEM_SCOPED, _ONE_ITEM_FILTERED
)

# --- the probe's tools ------------------------------------------------------------------
# A schema is fresh when it holds none of a store's tables.
STORE_TABLES: Final = ("asyncplane_meta", "projects", "assignments", "items", "events", "imports")
# The probe's worker hosts start once its project is being seeded or has items to drain
# ($1 the project).
PROBE_ITEMS_COMING: Final = f"""
SELECT EXISTS (SELECT 1 FROM projects WHERE project_id = $1 AND status = 'paused')
    OR EXISTS (SELECT 1 FROM items WHERE project_id = $1 AND state IN {_LIVE_STATES})
"""
COUNT_STORE_TABLES: Final = """
SELECT count(*) FROM pg_catalog.pg_tables
WHERE schemaname = current_schema() AND tablename = ANY($1::text[])
"""
# Everything the migrations made, for the probe's --overwrite (a test holds it whole: a
# store dropped leaves its schema as empty as it found it).
_STORE_RELATIONS: Final = (
    "asyncplane_meta", "assignments", "imports", "events", "items", "projects",
    "project_limits", "schedules", "schedule_ticks", "awaited", "twin_checks",
)  # fmt: skip
# The tables and views of a schema beside a store's own ($1: those): another
# application's, which a drop of the store would take along (its views, its foreign keys).
OTHER_RELATIONS: Final = """
SELECT count(*) FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'v', 'm', 'p', 'f')
  AND NOT c.relname = ANY($1::text[])
"""
DROP_STORE: Final = f"""
DROP TABLE IF EXISTS {", ".join(_STORE_RELATIONS)};
DROP FUNCTION IF EXISTS asyncplane_refuse_event_update(), asyncplane_refuse_event_delete(),
    asyncplane_refuse_event_truncate(),
    asyncplane_notify(), asyncplane_notify_settled(), asyncplane_twin_arrives(),
    asyncplane_line_moves_on(), asyncplane_take_limits(text, text, text[]),
    asyncplane_slot_freed(), asyncplane_limited(text), asyncplane_twin_pair(),
    asyncplane_twin_may_start(text, text, bigint),
    asyncplane_settle_twins(text, text, bigint, text, float8, text, text, text, text),
    asyncplane_twin_deferred(), asyncplane_twins_waited(text[], text[]);
"""
STORE_RELATIONS: Final = _STORE_RELATIONS

# --- schedules -----------------------------------------------------------------------------
# As on SQLite (see its SQL). A run takes the due schedules' rows, skipping those another
# host is running now; a tick's key (RESERVE_TICK) waits for a concurrent insert of the same
# key and then does nothing: the tick is enqueued once, whatever runs at once.

_SCHEDULE_COLUMNS = (
    "name, project_id, payload, cron, every, timezone, catch_up, priority, service_class, "
    "fingerprint, dedup, max_attempts, paused, anchor, next_at, last_at, created_at, updated_at"
)
GET_SCHEDULE: Final = f"SELECT {_SCHEDULE_COLUMNS} FROM schedules WHERE name = $1"
LOCK_SCHEDULE: Final = GET_SCHEDULE + " FOR UPDATE"
LIST_SCHEDULES: Final = f'SELECT {_SCHEDULE_COLUMNS} FROM schedules ORDER BY name COLLATE "C"'
PUT_SCHEDULE: Final = f"""
INSERT INTO schedules ({_SCHEDULE_COLUMNS})
VALUES ({", ".join(f"${n}" for n in range(1, 19))})
ON CONFLICT (name) DO UPDATE SET
    project_id = excluded.project_id, payload = excluded.payload, cron = excluded.cron,
    every = excluded.every, timezone = excluded.timezone, catch_up = excluded.catch_up,
    priority = excluded.priority, service_class = excluded.service_class,
    fingerprint = excluded.fingerprint, dedup = excluded.dedup,
    max_attempts = excluded.max_attempts, anchor = excluded.anchor,
    next_at = excluded.next_at, updated_at = excluded.updated_at
"""
PAUSE_SCHEDULE: Final = """
UPDATE schedules SET paused = $1, next_at = $2, updated_at = $3 WHERE name = $4
"""
DELETE_SCHEDULE: Final = "DELETE FROM schedules WHERE name = $1"
DELETE_TICKS: Final = "DELETE FROM schedule_ticks WHERE name = $1"
DUE_SCHEDULES: Final = f"""
SELECT {_SCHEDULE_COLUMNS} FROM schedules
WHERE NOT paused AND next_at <= $1 AND (cron IS NULL OR $3) AND name <> ALL($4::text[])
ORDER BY next_at, name COLLATE "C" LIMIT $2
FOR UPDATE SKIP LOCKED
"""
RESERVE_TICK: Final = """
INSERT INTO schedule_ticks (name, tick_at, item_id, at) VALUES ($1, $2, NULL, $3)
ON CONFLICT DO NOTHING
RETURNING 1
"""
FILL_TICK: Final = "UPDATE schedule_ticks SET item_id = $1 WHERE name = $2 AND tick_at = $3"
MOVE_SCHEDULE: Final = """
UPDATE schedules SET next_at = $1, last_at = coalesce($2, last_at), updated_at = $3
WHERE name = $4
"""
FORGET_TICKS: Final = "DELETE FROM schedule_ticks WHERE name = $1 AND tick_at < $2"
NEXT_TICK: Final = "SELECT min(next_at) FROM schedules WHERE NOT paused AND (cron IS NULL OR $1)"
NEXT_CRON_TICK: Final = "SELECT min(next_at) FROM schedules WHERE NOT paused AND cron IS NOT NULL"
SCHEDULE_TICKS: Final = """
SELECT name, tick_at, item_id, at FROM schedule_ticks WHERE name = $1
ORDER BY tick_at DESC LIMIT $2
"""
COPY_SCHEDULE: Final = PUT_SCHEDULE[: PUT_SCHEDULE.index("ON CONFLICT")] + (
    "ON CONFLICT (name) DO NOTHING\n"
)
