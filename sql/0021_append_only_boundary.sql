-- pgbus schema, version 21: the batch boundary is appended, never updated.
--
-- Migration 18 kept the boundary in one row that every batch updated. Under a transaction
-- held open elsewhere (the xmin horizon held back), no old version of that row can be
-- removed, and every read of the row, three a batch, walked all of them: a batch of one
-- event (round trip and commit included) went from 0.5 ms to 1.0-1.2 ms over 10,000
-- batches behind one open transaction, and kept growing (BENCHMARKS.md, "The boundary
-- behind an open transaction").
--
-- 1. Each batch appends its boundary to pgbus.fan_out_ticks; the boundary is the newest
--    tick, one step down the primary key from its end, where the newest entry is live
--    however many old ones wait for the horizon. A batch deletes old ticks now and then,
--    in a bounded range below its own.
-- 2. The cutters' lock is the row of pgbus.fan_out_lock (the old cursor table, renamed),
--    which is locked and never updated: a row lock writes no new version.
-- 3. pgbus.fan_out_cursor is now a view of the newest tick, so that whatever read the
--    boundary from it (the sweep, pgbus.not_fanned_out, an operator's query) reads the
--    same boundary as before.
-- 4. The sweep cuts a batch before it reads the boundary. A bus sweeps on its first
--    maintenance tick; when that came before its first claim, events committed before
--    the bus started were not yet passed, and stayed until the next sweep, an hour later.
--
-- Every statement can run again.

-- No batch is cut while the boundary moves (a batch locks the old table's row).
DO $$
BEGIN
    IF pg_catalog.to_regclass('pgbus.fan_out_lock') IS NULL THEN
        LOCK TABLE pgbus.fan_out_cursor IN ACCESS EXCLUSIVE MODE;
    END IF;
END
$$;

CREATE TABLE IF NOT EXISTS pgbus.fan_out_ticks (
    tick     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    boundary pg_catalog.pg_snapshot NOT NULL,
    cut_at   timestamptz NOT NULL DEFAULT pg_catalog.now()
);
-- Readable by every role that may use the schema, as the cursor was; written only by the
-- owner's pgbus.fan_out_committed.
REVOKE ALL ON pgbus.fan_out_ticks FROM PUBLIC;
GRANT SELECT ON pgbus.fan_out_ticks TO PUBLIC;

DO $$
BEGIN
    IF pg_catalog.to_regclass('pgbus.fan_out_lock') IS NULL THEN
        INSERT INTO pgbus.fan_out_ticks (boundary, cut_at)
        SELECT c.boundary, c.cut_at FROM pgbus.fan_out_cursor AS c;
        ALTER TABLE pgbus.fan_out_cursor RENAME TO fan_out_lock;
        ALTER TABLE pgbus.fan_out_lock DROP COLUMN boundary, DROP COLUMN cut_at;
        ALTER INDEX pgbus.fan_out_cursor_pkey RENAME TO fan_out_lock_pkey;
        ALTER TABLE pgbus.fan_out_lock RENAME CONSTRAINT fan_out_cursor_one_check
            TO fan_out_lock_one_check;
        -- Only the owner's functions lock it.
        REVOKE ALL ON pgbus.fan_out_lock FROM PUBLIC;
    END IF;
END
$$;

CREATE OR REPLACE VIEW pgbus.fan_out_cursor AS
SELECT true AS one, t.boundary, t.cut_at
FROM pgbus.fan_out_ticks AS t
ORDER BY t.tick DESC
LIMIT 1;
REVOKE ALL ON pgbus.fan_out_cursor FROM PUBLIC;
GRANT SELECT ON pgbus.fan_out_cursor TO PUBLIC;

CREATE OR REPLACE FUNCTION pgbus.fan_out_boundary() RETURNS pg_catalog.pg_snapshot
LANGUAGE sql STABLE SECURITY INVOKER SET search_path = pg_catalog, pgbus, pg_temp AS $$
    SELECT t.boundary FROM pgbus.fan_out_ticks AS t ORDER BY t.tick DESC LIMIT 1
$$;

-- Migration 18's batch (its comment says what each step is for), with the boundary read
-- from and appended to the ticks, the lock taken on fan_out_lock, and the check for the
-- caller's own events made only when the caller had written before the batch.
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
    v_tick bigint;
    -- Whether the caller's transaction wrote before this batch (the locks below give it
    -- an xid in any case).
    v_own xid8 := pg_current_xact_id_if_assigned();
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgbus.require_read_committed('pgbus.fan_out_committed');
    END IF;
    SELECT t.boundary INTO v_prev FROM pgbus.fan_out_ticks AS t ORDER BY t.tick DESC LIMIT 1;
    IF coalesce((SELECT e.xid FROM pgbus.events AS e WHERE e.xid IS NOT NULL
                 ORDER BY e.xid DESC LIMIT 1) < pg_snapshot_xmax(v_prev), true)
       AND NOT EXISTS (SELECT 1 FROM pg_snapshot_xip(v_prev) AS x(xid)
                       WHERE EXISTS (SELECT 1 FROM pgbus.events AS e WHERE e.xid = x.xid)) THEN
        RETURN 0;
    END IF;

    PERFORM pgbus.lock_config(false);
    PERFORM 1 FROM pgbus.fan_out_lock FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        v_lock_timeout := current_setting('lock_timeout');
        BEGIN
            PERFORM set_config('lock_timeout', '2s', true);
            PERFORM 1 FROM pgbus.fan_out_lock FOR UPDATE;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            RETURN 0;
        END;
    END IF;

    SELECT t.boundary INTO v_prev FROM pgbus.fan_out_ticks AS t ORDER BY t.tick DESC LIMIT 1;
    SELECT pg_current_snapshot(),
           ARRAY(SELECT e.seq FROM pgbus.events AS e
                 WHERE e.xid >= pg_snapshot_xmax(v_prev)
                   AND e.xid < pg_snapshot_xmax(pg_current_snapshot())
                 UNION ALL
                 SELECT e.seq FROM pg_snapshot_xip(v_prev) AS x(xid)
                 CROSS JOIN LATERAL (SELECT e.seq FROM pgbus.events AS e
                                     WHERE e.xid = x.xid) AS e)
      INTO v_cur, v_seqs;
    IF v_own IS NOT NULL THEN
        v_seqs := ARRAY(SELECT e.seq FROM pgbus.events AS e
                        WHERE e.seq = ANY (v_seqs) AND e.xid <> v_own);
    END IF;
    -- The caller's transaction stays in the boundary's in-progress list: events it wrote
    -- before, or writes after, are taken by a batch after its commit.
    v_cur := pgbus.running_too(v_cur, pg_current_xact_id());
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
        ORDER BY s.name LIMIT 1) IS NOT NULL THEN
        SELECT array_agg(k.sub), array_agg(k.key) INTO v_subs, v_keys
        FROM (SELECT DISTINCT m.subscription AS sub,
                     pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
              FROM pgbus.events AS e
              CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
              JOIN pgbus.subscriptions AS s ON s.name = m.subscription
              WHERE e.seq = ANY (v_seqs) AND m.ordered
                AND (s.created_in IS NULL
                     OR NOT pg_visible_in_snapshot(e.xid, s.created_in))) AS k
        WHERE k.key IS NOT NULL;
    END IF;
    IF v_subs IS NOT NULL THEN
        PERFORM pgbus.lock_keys(v_subs, v_keys);
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

    INSERT INTO pgbus.fan_out_ticks (boundary) VALUES (v_cur) RETURNING tick INTO v_tick;
    -- Old ticks go, 256 ticks at a time, in a range that overlaps the two before it (a
    -- batch that rolled back skips its turn; the next one covers it). The range is
    -- bounded: a scan of it reads at most 768 entries, however many deleted ones wait
    -- for the horizon below it. Once in 65,536 batches, everything older.
    IF v_tick % 256 = 0 THEN
        IF v_tick % 65536 = 0 THEN
            DELETE FROM pgbus.fan_out_ticks AS t WHERE t.tick < v_tick - 256;
        ELSE
            DELETE FROM pgbus.fan_out_ticks AS t
            WHERE t.tick >= v_tick - 1024 AND t.tick < v_tick - 256;
        END IF;
    END IF;
    RETURN cardinality(v_seqs);
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.fan_out_committed() FROM PUBLIC;

-- 4. Migration 18's sweep, cutting first.
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
    -- What committed becomes deliveries first (in READ COMMITTED, as every batch), so
    -- that a sweep right after a bus starts, before its first claim, does not keep
    -- until the next sweep events that no delivery needs. Then the boundary, read after
    -- the duty's lock and the batch: this transaction's own batch, and one that
    -- committed before, passed their events with their deliveries, which the statement
    -- below sees.
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM pgbus.fan_out_committed();
    END IF;
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
