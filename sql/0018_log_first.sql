-- pgbus schema, version 18: the log-first publish. A publish writes its event and nothing
-- per subscription; the bus turns committed events into deliveries afterwards, in batches
-- (docs/ARCHITECTURE.md, "The log-first publish", says why each step is safe).
--
-- 1. Each event records the top-level transaction that wrote it (`xid`, always the
--    writer's own: a trigger refuses any other value) and, for a keyed event that an
--    ordered subscription may need in commit order, its position in its key (`key_pos`,
--    drawn from pgbus.key_pos_seq after the key's publish lock, which the publishing
--    transaction holds to its end).
-- 2. The fan-out trigger goes. pgbus.fan_out_committed() cuts a batch: the events whose
--    transactions are visible in a new snapshot and were not in the previous one, which
--    pgbus.fan_out_cursor holds (PgQ's batches between two snapshots). It writes their
--    deliveries set-based, in the same transaction as the new boundary. A transaction
--    still open when a batch is cut is in the new boundary's in-progress list, and its
--    events are taken by the batch after it commits; it holds back nothing else.
-- 3. pgbus.claim cuts first: at idle a wake-up still costs one call.
-- 4. The sweep keeps every event the boundary has not passed; a replay files only passed
--    events (the others get their deliveries from the batch that takes them).
-- 5. A settings change turns what committed into deliveries under the old settings first;
--    a new subscription records the snapshot it was created in and receives only events
--    committed after it.

-- Every statement can run again (migrate re-applies a migration whose record is gone);
-- the boundary, once there, is kept.
--
-- The migration holds the log exclusively from here to its commit: every transaction that
-- inserted an event through the old trigger has ended (its deliveries are written), and
-- none can insert until the new path is in place. The first boundary below therefore
-- passes exactly the events that already have their deliveries.
LOCK TABLE pgbus.events IN ACCESS EXCLUSIVE MODE;

-- 1. The writer's transaction and the key position. No default on ADD COLUMN (a volatile
-- one would rewrite the log); existing rows keep NULL, which no batch ever takes.
ALTER TABLE pgbus.events ADD COLUMN IF NOT EXISTS xid pg_catalog.xid8,
    ADD COLUMN IF NOT EXISTS key_pos bigint;
ALTER TABLE pgbus.events ALTER COLUMN xid SET DEFAULT pg_catalog.pg_current_xact_id();
CREATE INDEX IF NOT EXISTS events_xid_idx ON pgbus.events (xid);

-- The publish locks of keys: the same striping as pgbus.key_stripes, a table of its own
-- so that a publisher holding its key (for as long as its transaction stays open) never
-- makes a batch, a claim or a settlement wait.
CREATE TABLE IF NOT EXISTS pgbus.publish_stripes (
    stripe integer PRIMARY KEY CHECK (stripe BETWEEN 0 AND 65535)
);
INSERT INTO pgbus.publish_stripes (stripe) SELECT g FROM pg_catalog.generate_series(0, 65535) AS g
ON CONFLICT DO NOTHING;
ANALYZE pgbus.publish_stripes;
REVOKE ALL ON pgbus.publish_stripes FROM PUBLIC;

-- Whether any subscription is ordered, in one index probe however many there are (the
-- trigger below and every batch ask; without it, 10,000 unordered subscriptions were
-- read on every keyed publish). Asked as "the first ordered name": an EXISTS may be
-- planned as a scan that expects to stop early, and reads every row when none is.
CREATE INDEX IF NOT EXISTS subscriptions_ordered_idx ON pgbus.subscriptions (name)
    WHERE ordered;

-- Before each inserted event that has a key, names a key position, or names a transaction
-- not its own (the trigger's WHEN clause; the others never call it):
-- - an xid other than the writer's is refused: a batch finds events by it;
-- - a keyed event that an ordered subscription matches (or may match: under REPEATABLE
--   READ or SERIALIZABLE the subscriptions seen are the snapshot's, so every keyed event
--   counts) takes its key's publish lock and then draws its position: the positions of a
--   key follow the order in which publishers held it, which is their commit order. The
--   configuration gate (shared) keeps a settings change from deciding "ordered" between
--   this test and the commit.
--
-- Per row, so every step counts (a keyed publish_batch of 1,000 rows runs it 1,000
-- times): the configuration gate is taken inline (the lock pgbus.lock_config(false)
-- takes, without a nested call), a database without an ordered subscription stops at
-- one probe, and the pattern match runs on a generic plan (planned for its value, the
-- inlined match was planned again on every row: 0.8 ms a row).
CREATE OR REPLACE FUNCTION pgbus.order_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_key text;
BEGIN
    IF NEW.xid IS DISTINCT FROM pg_current_xact_id() THEN
        RAISE EXCEPTION 'pgbus.events.xid is set by pgbus: leave it out of the insert'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'xid';
    END IF;
    NEW.key_pos := NULL;
    v_key := pgbus.event_key(NEW.ordering_key, NEW.aggregate_type, NEW.aggregate_id);
    IF v_key IS NULL THEN
        RETURN NEW;
    END IF;
    LOCK TABLE pgbus.config_gate IN ROW EXCLUSIVE MODE;
    IF current_setting('transaction_isolation') = 'read committed'
       AND ((SELECT s.name FROM pgbus.subscriptions AS s WHERE s.ordered
             ORDER BY s.name LIMIT 1) IS NULL
            OR NOT EXISTS (SELECT 1 FROM pgbus.subscriptions_matching(NEW.event_name) AS m
                           WHERE m.ordered)) THEN
        RETURN NEW;
    END IF;
    PERFORM 1 FROM pgbus.publish_stripes AS k
    WHERE k.stripe = (hashtextextended(v_key, 7305) & 65535)::integer
    FOR NO KEY UPDATE;
    NEW.key_pos := nextval('pgbus.key_pos_seq');
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.order_key() FROM PUBLIC;

DROP TRIGGER IF EXISTS events_order_key ON pgbus.events;
CREATE TRIGGER events_order_key
    BEFORE INSERT ON pgbus.events
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL OR NEW.aggregate_id IS NOT NULL
          OR NEW.key_pos IS NOT NULL
          OR NEW.xid IS DISTINCT FROM pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION pgbus.order_key();

-- A statement of many events takes its keys' publish locks up front, in stripe order, so
-- that two batches with keys in opposite orders never deadlock; the trigger then finds
-- each lock already held. `publish_batch` calls it; a raw multi-row INSERT of several
-- keys takes them row by row (docs/ARCHITECTURE.md says so). names and keys are parallel.
CREATE OR REPLACE FUNCTION pgbus.lock_publish_keys(names text[], keys text[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_any_order boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    PERFORM pgbus.lock_config(false);
    PERFORM 1 FROM pgbus.publish_stripes AS k
    WHERE k.stripe = ANY (ARRAY(
        SELECT (hashtextextended(t.k, 7305) & 65535)::integer
        FROM unnest(names, keys) AS t(n, k)
        WHERE t.k IS NOT NULL
          AND (v_any_order OR EXISTS (SELECT 1 FROM pgbus.subscriptions_matching(t.n) AS m
                                      WHERE m.ordered))))
    ORDER BY k.stripe
    FOR NO KEY UPDATE;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.lock_publish_keys(text[], text[]) FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgbus.publish_batch(
    ids             text[],
    event_names     text[],
    event_versions  integer[],
    sources         text[],
    aggregate_types text[],
    aggregate_ids   text[],
    correlation_ids text[],
    causation_ids   text[],
    occurred_ats    timestamptz[],
    payloads        text[],
    headers         text[],
    deliver_ats     timestamptz[],
    delays_ms       bigint[],
    ordering_keys   text[],
    OUT inserted bigint,
    OUT conflict text
) RETURNS record
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
BEGIN
    IF pg_catalog.cardinality(ids) > 1 THEN
        PERFORM pgbus.lock_publish_keys(event_names, ARRAY(
            SELECT pgbus.event_key(u.o, u.t, u.a)
            FROM ROWS FROM (pg_catalog.unnest(ordering_keys), pg_catalog.unnest(aggregate_types),
                            pg_catalog.unnest(aggregate_ids)) AS u(o, t, a)));
    END IF;
    WITH t AS (
      SELECT * FROM ROWS FROM (
          pg_catalog.unnest(ids), pg_catalog.unnest(event_names),
          pg_catalog.unnest(event_versions), pg_catalog.unnest(sources),
          pg_catalog.unnest(aggregate_types), pg_catalog.unnest(aggregate_ids),
          pg_catalog.unnest(correlation_ids), pg_catalog.unnest(causation_ids),
          pg_catalog.unnest(occurred_ats), pg_catalog.unnest(payloads),
          pg_catalog.unnest(headers), pg_catalog.unnest(deliver_ats),
          pg_catalog.unnest(delays_ms), pg_catalog.unnest(ordering_keys))
        AS u(id, event_name, event_version, source, aggregate_type, aggregate_id,
             correlation_id, causation_id, occurred_at, payload, headers, deliver_at,
             delay_ms, ordering_key)
    ),
    conflicting AS (
      SELECT t.id FROM t JOIN pgbus.events AS e ON e.id = t.id
      WHERE (e.event_name, e.event_version, e.aggregate_type, e.aggregate_id, e.payload,
             e.headers - '{traceparent,tracestate}'::text[])
            IS DISTINCT FROM
            (t.event_name, t.event_version, t.aggregate_type, t.aggregate_id,
             t.payload::jsonb, t.headers::jsonb - '{traceparent,tracestate}'::text[])
      LIMIT 1
    ),
    written AS (
      INSERT INTO pgbus.events AS e
        (id, event_name, event_version, source, aggregate_type, aggregate_id, correlation_id,
         causation_id, occurred_at, payload, headers, available_at, ordering_key)
      SELECT t.id, t.event_name, t.event_version, t.source, t.aggregate_type, t.aggregate_id,
             t.correlation_id, t.causation_id, coalesce(t.occurred_at, pg_catalog.now()),
             t.payload::jsonb, t.headers::jsonb,
             coalesce(t.deliver_at,
                      pg_catalog.now() + t.delay_ms * interval '1 millisecond',
                      pg_catalog.now()),
             t.ordering_key
      FROM t
      WHERE NOT EXISTS (SELECT 1 FROM conflicting)
      ON CONFLICT ON CONSTRAINT events_id_key DO UPDATE SET id = EXCLUDED.id
      WHERE (e.event_name, e.event_version, e.aggregate_type, e.aggregate_id, e.payload,
             e.headers - '{traceparent,tracestate}'::text[])
            IS DISTINCT FROM
            (EXCLUDED.event_name, EXCLUDED.event_version, EXCLUDED.aggregate_type,
             EXCLUDED.aggregate_id, EXCLUDED.payload,
             EXCLUDED.headers - '{traceparent,tracestate}'::text[])
      RETURNING e.id, xmax = 0 AS fresh
    )
    SELECT (SELECT count(*) FROM written WHERE fresh),
           coalesce((SELECT c.id FROM conflicting AS c),
                    (SELECT w.id FROM written AS w WHERE NOT w.fresh LIMIT 1))
      INTO inserted, conflict;
END
$fn$;


-- 2. No more deliveries from the publisher's transaction.
DROP TRIGGER IF EXISTS events_fan_out ON pgbus.events;
DROP FUNCTION IF EXISTS pgbus.fan_out();

-- The current snapshot with the calling transaction counted as still running: a snapshot
-- never lists its own transaction, so a boundary or a creation snapshot taken by a
-- transaction that has an xid would count that transaction's own events as committed
-- before it. At or above xmax an xid already counts as running; below, it is listed
-- (xmax stays: every xid at or above it counts as running, listed or not).
CREATE OR REPLACE FUNCTION pgbus.running_too(p_snap pg_catalog.pg_snapshot, p_xid pg_catalog.xid8)
RETURNS pg_catalog.pg_snapshot
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    -- PL/pgSQL, not SQL: a SQL function with a subquery is planned again at every call,
    -- and every batch calls this one.
    IF p_xid IS NULL OR p_xid >= pg_snapshot_xmax(p_snap) THEN
        RETURN p_snap;
    END IF;
    RETURN (least(pg_snapshot_xmin(p_snap), p_xid)::text || ':'
            || pg_snapshot_xmax(p_snap)::text || ':'
            || (SELECT string_agg(q.x::text, ',' ORDER BY q.x)
                FROM (SELECT pg_snapshot_xip(p_snap) AS x UNION SELECT p_xid) AS q)
           )::pg_snapshot;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.snapshot_of_others() RETURNS pg_catalog.pg_snapshot
LANGUAGE sql VOLATILE SET search_path = pg_catalog, pgbus, pg_temp AS $$
    SELECT pgbus.running_too(pg_current_snapshot(), pg_current_xact_id_if_assigned())
$$;

-- A new subscription's creation snapshot: events visible in it committed before the
-- subscription existed and are not its (events of the creating transaction itself are). NULL (every subscription created before this
-- version) takes every batch.
ALTER TABLE pgbus.subscriptions ADD COLUMN IF NOT EXISTS created_in pg_catalog.pg_snapshot;
ALTER TABLE pgbus.subscriptions ALTER COLUMN created_in SET DEFAULT pgbus.snapshot_of_others();

-- The boundary: one row, the snapshot the last batch was cut at.
CREATE TABLE IF NOT EXISTS pgbus.fan_out_cursor (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    boundary pg_catalog.pg_snapshot NOT NULL,
    cut_at   timestamptz NOT NULL DEFAULT pg_catalog.now()
);
-- Readable by whoever may use the schema (status and the gauges of every role read it;
-- a snapshot tells nothing the server does not tell anyone); written only by the owner's
-- functions.
REVOKE ALL ON pgbus.fan_out_cursor FROM PUBLIC;
GRANT SELECT ON pgbus.fan_out_cursor TO PUBLIC;
INSERT INTO pgbus.fan_out_cursor (boundary) VALUES (pg_catalog.pg_current_snapshot())
ON CONFLICT DO NOTHING;

-- Whether a boundary has passed a transaction: its events either have their deliveries
-- or never will (rolled back). NULL (events written before this version): passed.
CREATE OR REPLACE FUNCTION pgbus.passed(p_xid pg_catalog.xid8, p_boundary pg_catalog.pg_snapshot)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pgbus, pg_temp AS $$
    SELECT p_xid IS NULL OR pg_catalog.pg_visible_in_snapshot(p_xid, p_boundary)
$$;

-- The current boundary.
CREATE OR REPLACE FUNCTION pgbus.fan_out_boundary() RETURNS pg_catalog.pg_snapshot
LANGUAGE sql STABLE SECURITY INVOKER SET search_path = pg_catalog, pgbus, pg_temp AS $$
    SELECT c.boundary FROM pgbus.fan_out_cursor AS c
$$;

-- Cuts one batch and writes its deliveries; returns how many events it took (0: none
-- committed since the last batch, or another process is cutting one: its deliveries are
-- visible when it commits, and this caller's claim waits at most 2 s for that).
--
-- A first look needs no lock: nothing new when no visible event has an xid at or above
-- the boundary's xmax or in its in-progress list (index probes on events_xid_idx). Then,
-- in this order: the configuration gate (shared: a settings change, which holds it
-- exclusively, turns what committed into deliveries before it changes anything), the
-- cursor row, and in ONE statement the new boundary (pg_current_snapshot(), the
-- statement's own snapshot) with the events visible in it that the old one did not pass:
-- those with an xid at or above its xmax, and those in its in-progress list. Everything
-- else in the snapshot either was taken by an earlier batch or rolled back.
--
-- Deliveries go in as the fan-out trigger wrote them: one per matching subscription (less
-- subscriptions created after the event committed), unordered ones as heads; for ordered
-- subscriptions the (subscription, key) locks of settlements are taken first, then a
-- fresh statement decides each key's head among the batch by (key_pos, seq), the order
-- the publish locks gave. ON CONFLICT DO NOTHING: a delivery made meanwhile by a replay
-- stays as it is.
--
-- Plans: generic, built once per session (planning the pattern match for its values
-- cost more than a whole small batch), and O(batch) as such: the first look is one step
-- down events_xid_idx for the newest xid and one probe per xid of the in-progress list;
-- the batch's range is bounded on both sides (from the old boundary's xmax to the new
-- snapshot's), which a generic plan reads through events_xid_idx where `xid >= $1`
-- alone would be planned as a third of the log.
CREATE OR REPLACE FUNCTION pgbus.fan_out_committed() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp SET jit = off
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    v_prev pg_snapshot;
    v_cur pg_snapshot;
    v_seqs bigint[];
    v_subs text[];
    v_keys text[];
    v_pos bigint;
    v_lock_timeout text;
    v_own xid8;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgbus.require_read_committed('pgbus.fan_out_committed');
    END IF;
    SELECT c.boundary INTO v_prev FROM pgbus.fan_out_cursor AS c;
    IF coalesce((SELECT e.xid FROM pgbus.events AS e WHERE e.xid IS NOT NULL
                 ORDER BY e.xid DESC LIMIT 1) < pg_snapshot_xmax(v_prev), true)
       AND NOT EXISTS (SELECT 1 FROM pg_snapshot_xip(v_prev) AS x(xid)
                       WHERE EXISTS (SELECT 1 FROM pgbus.events AS e WHERE e.xid = x.xid)) THEN
        RETURN 0;
    END IF;

    PERFORM pgbus.lock_config(false);
    -- The cursor's lock: at once when nobody is cutting (no subtransaction on the way
    -- of every claim); otherwise waiting at most 2 s for the cutter to commit.
    PERFORM 1 FROM pgbus.fan_out_cursor FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        v_lock_timeout := current_setting('lock_timeout');
        BEGIN
            PERFORM set_config('lock_timeout', '2s', true);
            PERFORM 1 FROM pgbus.fan_out_cursor FOR UPDATE;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            RETURN 0;
        END;
    END IF;

    SELECT c.boundary INTO v_prev FROM pgbus.fan_out_cursor AS c;
    SELECT pg_current_snapshot(),
           ARRAY(SELECT e.seq FROM pgbus.events AS e
                 WHERE e.xid >= pg_snapshot_xmax(v_prev)
                   AND e.xid < pg_snapshot_xmax(pg_current_snapshot())
                 UNION ALL
                 SELECT e.seq FROM pg_snapshot_xip(v_prev) AS x(xid)
                 CROSS JOIN LATERAL (SELECT e.seq FROM pgbus.events AS e
                                     WHERE e.xid = x.xid) AS e)
      INTO v_cur, v_seqs;
    -- A cut inside a transaction that has written already (a settings change in the
    -- caller's transaction, say): the snapshot counts that transaction as finished, so
    -- its own events, earlier or later, would be passed without deliveries. They are
    -- left out, and the transaction stays in the boundary's in-progress list: a batch
    -- after its commit takes them.
    v_own := pg_current_xact_id_if_assigned();
    IF v_own IS NOT NULL THEN
        v_seqs := ARRAY(SELECT e.seq FROM pgbus.events AS e
                        WHERE e.seq = ANY (v_seqs) AND e.xid <> v_own);
        v_cur := pgbus.running_too(v_cur, v_own);
    END IF;
    IF cardinality(v_seqs) = 0 THEN
        RETURN 0;
    END IF;

    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at)
    SELECT m.subscription, e.seq, e.available_at
    FROM pgbus.events AS e
    CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
    JOIN pgbus.subscriptions AS s ON s.name = m.subscription
    WHERE e.seq = ANY (v_seqs)
      AND (s.created_in IS NULL OR NOT pg_visible_in_snapshot(e.xid, s.created_in))
      AND NOT (m.ordered
               AND pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) IS NOT NULL)
    ON CONFLICT (subscription, event_seq) DO NOTHING;

    -- The ordered subscriptions' deliveries (none to look for when none is ordered).
    IF (SELECT s.name FROM pgbus.subscriptions AS s WHERE s.ordered
        ORDER BY s.name LIMIT 1) IS NULL THEN
        UPDATE pgbus.fan_out_cursor SET boundary = v_cur, cut_at = now();
        RETURN cardinality(v_seqs);
    END IF;
    SELECT array_agg(k.sub), array_agg(k.key) INTO v_subs, v_keys
    FROM (SELECT DISTINCT m.subscription AS sub,
                 pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
          FROM pgbus.events AS e
          CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
          JOIN pgbus.subscriptions AS s ON s.name = m.subscription
          WHERE e.seq = ANY (v_seqs) AND m.ordered
            AND (s.created_in IS NULL OR NOT pg_visible_in_snapshot(e.xid, s.created_in))) AS k
    WHERE k.key IS NOT NULL;
    IF v_subs IS NOT NULL THEN
        PERFORM pgbus.lock_keys(v_subs, v_keys);
        -- A keyed event published while no ordered subscription matched it has no
        -- position; it goes after the positioned ones of this batch.
        v_pos := nextval('pgbus.key_pos_seq');
        INSERT INTO pgbus.deliveries (subscription, event_seq, available_at, ordering_key,
                                      is_head, key_pos)
        SELECT o.sub, o.seq, o.available_at, o.key,
               row_number() OVER (PARTITION BY o.sub, o.key ORDER BY o.pos, o.seq) = 1
                 AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                                 WHERE d.subscription = o.sub AND d.ordering_key = o.key
                                   AND d.is_head),
               o.pos
        FROM (SELECT m.subscription AS sub, e.seq, e.available_at,
                     pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key,
                     coalesce(e.key_pos, v_pos) AS pos
              FROM pgbus.events AS e
              CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
              JOIN pgbus.subscriptions AS s ON s.name = m.subscription
              WHERE e.seq = ANY (v_seqs) AND m.ordered
                AND (s.created_in IS NULL OR NOT pg_visible_in_snapshot(e.xid, s.created_in))
                AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                                WHERE d.subscription = m.subscription
                                  AND d.event_seq = e.seq)) AS o
        WHERE o.key IS NOT NULL;
    END IF;

    UPDATE pgbus.fan_out_cursor SET boundary = v_cur, cut_at = now();
    RETURN cardinality(v_seqs);
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.fan_out_committed() FROM PUBLIC;

-- Events committed and not yet turned into deliveries, counted up to cap (NULL: all), and
-- the age in seconds of the oldest (NULL when none): the backlog before the deliveries.
-- It gives up after 1 s when the log is locked (a migration, a LOCK TABLE): a running
-- bus samples it with its other duties (lease extension among them), which must not
-- wait behind that lock for a gauge.
CREATE OR REPLACE FUNCTION pgbus.not_fanned_out(cap bigint)
RETURNS TABLE (events bigint, oldest_age float8)
LANGUAGE plpgsql STABLE SECURITY INVOKER SET lock_timeout = '1s'
SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_boundary pg_snapshot;
BEGIN
    SELECT c.boundary INTO v_boundary FROM pgbus.fan_out_cursor AS c;
    -- Planned for the boundary's values (EXECUTE), as the batch's statement.
    RETURN QUERY EXECUTE '
    WITH waiting AS (
      SELECT e.created_at FROM pgbus.events AS e WHERE e.xid >= $1
      UNION ALL
      SELECT e.created_at FROM pg_catalog.pg_snapshot_xip($2) AS x(xid)
      CROSS JOIN LATERAL (SELECT e.created_at FROM pgbus.events AS e
                          WHERE e.xid = x.xid) AS e
      LIMIT $3
    )
    SELECT pg_catalog.count(*),
           pg_catalog.date_part(''epoch'', pg_catalog.now() - pg_catalog.min(w.created_at))::float8
    FROM waiting AS w'
    USING pg_snapshot_xmax(v_boundary), v_boundary, cap;
END
$$;

-- 3. A claim cuts first. Migration 11's claim (the library's CLAIM statement) keeps its
-- body, its generic plan and its rights under the name claim_due, granted to nobody now;
-- pgbus.claim, which consumers are granted, cuts and then runs it: one call at idle, as
-- before. Renamed once: a second run finds claim_due there.
DO $$
BEGIN
    IF pg_catalog.to_regprocedure(
           'pgbus.claim_due(text[], integer[], integer, bigint, text, integer, bigint)') IS NULL THEN
        ALTER FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)
            RENAME TO claim_due;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)
RETURNS TABLE (secs float8, subscription text, attempts integer, seq bigint, id text,
               event_name text, event_version integer, source text, aggregate_type text,
               aggregate_id text, correlation_id text, causation_id text,
               occurred_at timestamptz, payload jsonb, headers jsonb, created_at timestamptz,
               ordering_key text, waited float8, cut boolean)
LANGUAGE plpgsql SECURITY DEFINER SET jit = off
SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
BEGIN
    PERFORM pgbus.fan_out_committed();
    RETURN QUERY SELECT * FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7);
END
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)
FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer, bigint)
FROM PUBLIC;

-- Whoever could claim (the grants of claim went with the rename) claims through the new
-- function, and no longer calls the old one directly.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS role
        FROM pg_catalog.pg_proc AS p,
             pg_catalog.aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgbus.claim_due(text[], integer[], integer, bigint, text, integer, bigint)'::regprocedure
          AND a.grantee <> 0 AND a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pgbus.claim_due(text[], integer[], integer, '
                       'bigint, text, integer, bigint) FROM %s', r.role);
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.claim(text[], integer[], integer, '
                       'bigint, text, integer, bigint) TO %s', r.role);
    END LOOP;
END
$$;


-- 4. The sweep of migration 13, keeping every event the boundary has not passed.
CREATE OR REPLACE FUNCTION pgbus.sweep(retention_ms bigint, max_rows integer, lock_key bigint)
RETURNS TABLE (got boolean, events bigint, failures bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp SET jit = off AS $$
DECLARE
    v_cutoff timestamptz;
    v_boundary pg_snapshot;
BEGIN
    IF retention_ms IS NULL OR retention_ms < 0 OR max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION 'pgbus.sweep: retention must be at least 0 and max_rows at least 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM pgbus.duties AS d WHERE d.name = 'sweep' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    -- Read after the duty's lock: a batch that committed before this statement passed
    -- its events with their deliveries, which the statement below sees.
    SELECT c.boundary INTO v_boundary FROM pgbus.fan_out_cursor AS c;
    SELECT pg_catalog.now() - greatest(LEAST(retention_ms, 9000000000000000) * interval '1 millisecond',
                                       st.min_retention)
      INTO v_cutoff
    FROM pgbus.settings AS st;
    RETURN QUERY
    WITH RECURSIVE subs AS (
      (SELECT d.subscription FROM pgbus.deliveries AS d ORDER BY d.subscription LIMIT 1)
      UNION ALL
      SELECT (SELECT d.subscription FROM pgbus.deliveries AS d
              WHERE d.subscription > subs.subscription
              ORDER BY d.subscription LIMIT 1)
      FROM subs WHERE subs.subscription IS NOT NULL
    ),
    doomed AS (
      SELECT e.seq FROM pgbus.events AS e
      WHERE e.created_at < v_cutoff
        AND pgbus.passed(e.xid, v_boundary)
        AND NOT EXISTS (SELECT 1 FROM subs
                        JOIN pgbus.deliveries AS d
                          ON d.subscription = subs.subscription AND d.event_seq = e.seq)
      ORDER BY e.created_at
      LIMIT max_rows
      FOR UPDATE OF e SKIP LOCKED
    ),
    gone_failures AS (
      DELETE FROM pgbus.delivery_failures AS f
      USING doomed
      WHERE f.event_seq = doomed.seq
      RETURNING 1
    ),
    swept AS (
      DELETE FROM pgbus.events AS e USING doomed WHERE e.seq = doomed.seq
      RETURNING 1
    )
    SELECT true, (SELECT count(*) FROM swept), (SELECT count(*) FROM gone_failures);
END
$$;


-- A replay (migration 8's) files only events the boundary has passed; the others get
-- their deliveries from the batch that takes them.
CREATE OR REPLACE FUNCTION pgbus.replay(
    p_subscription text,
    p_since timestamptz,
    p_until timestamptz,
    p_pattern text)
RETURNS TABLE (found boolean, matched bigint, created bigint, woke bigint)
LANGUAGE plpgsql SECURITY DEFINER SET jit = off SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_sub pgbus.subscriptions;
    v_seqs bigint[];
    v_avail timestamptz[];
    v_keys text[];
    v_lock_subs text[];
    v_lock_keys text[];
    v_created bigint := 0;
    v_keyed bigint := 0;
    v_pos bigint;
    v_boundary pg_snapshot := pgbus.fan_out_boundary();
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.replay');
    PERFORM pgbus.lock_config(false);
    SELECT * INTO v_sub FROM pgbus.subscriptions AS s WHERE s.name = p_subscription;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::bigint, 0::bigint, 0::bigint;
        RETURN;
    END IF;

    -- The events, locked against the retention sweep, with their keys where ordered.
    SELECT array_agg(e.seq ORDER BY e.seq), array_agg(e.available_at ORDER BY e.seq),
           array_agg(CASE WHEN v_sub.ordered
                          THEN pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id)
                     END ORDER BY e.seq)
      INTO v_seqs, v_avail, v_keys
    FROM (SELECT e.* FROM pgbus.events AS e
          WHERE e.created_at >= p_since
            AND pgbus.passed(e.xid, v_boundary)
            AND (p_until IS NULL OR e.created_at < p_until)
            AND EXISTS (SELECT 1 FROM unnest(v_sub.patterns) AS p
                        WHERE pgbus.pattern_matches(p, e.event_name))
            AND (p_pattern IS NULL OR pgbus.pattern_matches(p_pattern, e.event_name))
          FOR KEY SHARE OF e) AS e;
    IF v_seqs IS NULL THEN
        RETURN QUERY SELECT true, 0::bigint, 0::bigint, 0::bigint;
        RETURN;
    END IF;

    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at)
    SELECT p_subscription, t.seq, greatest(t.available_at, now())
    FROM unnest(v_seqs, v_avail, v_keys) AS t(seq, available_at, key)
    WHERE t.key IS NULL
    ON CONFLICT (subscription, event_seq) DO NOTHING;
    GET DIAGNOSTICS v_created = ROW_COUNT;

    SELECT array_agg(DISTINCT t.key) INTO v_lock_keys
    FROM unnest(v_keys) AS t(key) WHERE t.key IS NOT NULL;
    IF v_lock_keys IS NOT NULL THEN
        v_lock_subs := array_fill(p_subscription, ARRAY[cardinality(v_lock_keys)]);
        PERFORM pgbus.lock_keys(v_lock_subs, v_lock_keys);
        v_pos := nextval('pgbus.key_pos_seq');
        -- A fresh snapshot (this statement, after the locks): a key has a head exactly
        -- when this shows one. Events that already have a delivery are left out first,
        -- so that heads are chosen among the deliveries really created.
        INSERT INTO pgbus.deliveries (subscription, event_seq, available_at, ordering_key,
                                      is_head, key_pos)
        SELECT p_subscription, n.seq, greatest(n.available_at, now()), n.key,
               row_number() OVER (PARTITION BY n.key ORDER BY n.seq) = 1
                 AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                                 WHERE d.subscription = p_subscription
                                   AND d.ordering_key = n.key AND d.is_head),
               v_pos
        FROM (SELECT t.seq, t.available_at, t.key
              FROM unnest(v_seqs, v_avail, v_keys) AS t(seq, available_at, key)
              WHERE t.key IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                                WHERE d.subscription = p_subscription
                                  AND d.event_seq = t.seq)) AS n;
        GET DIAGNOSTICS v_keyed = ROW_COUNT;
        v_created := v_created + v_keyed;
    END IF;

    IF v_created > 0 THEN
        PERFORM pg_notify('pgbus', '');
    END IF;
    RETURN QUERY SELECT true, cardinality(v_seqs)::bigint, v_created,
                        (v_created > 0)::int::bigint;
END
$$;


-- 5. A settings change (migration 13's) turns what committed into deliveries first,
-- under the settings it is about to change.
CREATE OR REPLACE FUNCTION pgbus.try_configure_subscription(
    p_name text,
    p_patterns text[],
    p_max_attempts integer,
    p_ordered boolean,
    p_on_dead text,
    p_wait_ms integer)
RETURNS TABLE (got boolean, found boolean, converted bigint, waiting_on jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_was boolean;
    v_now boolean;
    v_converted bigint := 0;
    v_waiting jsonb;
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.configure_subscription');
    v_waiting := pgbus.try_lock_config(p_wait_ms);
    IF v_waiting IS NOT NULL THEN
        RETURN QUERY SELECT false, NULL::boolean, 0::bigint, v_waiting;
        RETURN;
    END IF;
    -- What committed under the old settings becomes deliveries under them.
    PERFORM pgbus.fan_out_committed();
    SELECT s.ordered INTO v_was FROM pgbus.subscriptions AS s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT true, false, 0::bigint, NULL::jsonb;
        RETURN;
    END IF;
    v_now := coalesce(p_ordered, v_was);
    UPDATE pgbus.subscriptions AS s
    SET patterns = coalesce(p_patterns, s.patterns),
        max_attempts = coalesce(p_max_attempts, s.max_attempts),
        ordered = v_now,
        on_dead = coalesce(p_on_dead, s.on_dead),
        updated_at = now()
    WHERE s.name = p_name
      AND (s.patterns, s.max_attempts, s.ordered, s.on_dead)
          IS DISTINCT FROM (coalesce(p_patterns, s.patterns), coalesce(p_max_attempts, s.max_attempts),
                            v_now, coalesce(p_on_dead, s.on_dead));

    IF v_was AND NOT v_now THEN
        UPDATE pgbus.deliveries AS d
        SET is_head = true, ordering_key = NULL, key_pos = NULL
        WHERE d.subscription = p_name AND (d.ordering_key IS NOT NULL OR NOT d.is_head);
        GET DIAGNOSTICS v_converted = ROW_COUNT;
    ELSIF v_now AND NOT v_was THEN
        -- Hold every delivery of the subscription first: a claim under way finishes
        -- (claims skip locked rows, so no new one starts), and the statement below, with
        -- a fresh snapshot, decides heads from rows nobody can change under it.
        PERFORM 1 FROM pgbus.deliveries AS d WHERE d.subscription = p_name FOR UPDATE;
        UPDATE pgbus.deliveries AS d
        SET ordering_key = c.key,
            key_pos = 0,
            is_head = c.head
        FROM (SELECT x.event_seq, x.key,
                     x.status <> 'dead'
                       AND row_number() OVER (PARTITION BY x.key, x.status = 'dead'
                                              ORDER BY x.event_seq) = 1 AS head
              FROM (SELECT d2.event_seq, d2.status,
                           pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
                    FROM pgbus.deliveries AS d2
                    JOIN pgbus.events AS e ON e.seq = d2.event_seq
                    WHERE d2.subscription = p_name AND d2.status <> 'processing') AS x
              WHERE x.key IS NOT NULL) AS c
        WHERE d.subscription = p_name AND d.event_seq = c.event_seq;
        GET DIAGNOSTICS v_converted = ROW_COUNT;
    END IF;
    IF v_converted > 0 THEN
        PERFORM pg_notify('pgbus', '');
    END IF;
    RETURN QUERY SELECT true, true, v_converted, NULL::jsonb;
END
$$;

-- Who runs what: a claim (the consumer's), a settings change and a replay (the
-- operator's), and a publish of many events run with the owner's rights since migration
-- 17, so the functions that write (fan_out_committed, order_key, lock_publish_keys) are
-- the owner's alone. The ones that read (fan_out_boundary, passed, not_fanned_out) run
-- with the caller's rights and every role may call them.

GRANT EXECUTE ON FUNCTION pgbus.fan_out_boundary(), pgbus.not_fanned_out(bigint),
    pgbus.passed(pg_catalog.xid8, pg_catalog.pg_snapshot) TO PUBLIC;
-- A new subscription's default calls it, whoever inserts the row.
GRANT EXECUTE ON FUNCTION pgbus.snapshot_of_others(),
    pgbus.running_too(pg_catalog.pg_snapshot, pg_catalog.xid8) TO PUBLIC;
