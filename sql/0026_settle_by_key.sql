-- pgbus schema, version 26: a settlement and a lease extension look their deliveries up
-- by key, whatever the statistics say of the table.
--
-- Both joined the arrays they are given to pgbus.deliveries on the primary key. Behind a
-- transaction held open elsewhere, the rows settled since it began stay (dead, but not
-- removable), and autovacuum's ANALYZE then records a table of a few live rows. Planned
-- for one row, the join scanned the table or its primary key whole, once for each of the
-- acknowledgements, failures and releases: 5,000 rows and entries read to settle three
-- deliveries behind 2,500 settled ones (tests/claim_cost.rs), and settlements that went
-- from 1.6 to 26 ms within three minutes of such a transaction (BENCHMARKS.md, "A claim
-- behind a long transaction"). Each lookup now also says which keys it wants as arrays
-- (`subscription = ANY (...) AND event_seq = ANY (...)`), conditions the primary key
-- answers directly; the join keeps the exact pairs. A kind of settlement with nothing
-- to settle (most batches hold only acknowledgements) does not look at all: its
-- `cardinality(...) > 0` is decided once, before any scan. Same results, same
-- signatures, same rights.
--
-- Every statement can run again.

CREATE OR REPLACE FUNCTION pgbus.settle_unlocked(
    ack_subs text[], ack_seqs bigint[], ack_attempts integer[],
    fail_subs text[], fail_seqs bigint[], fail_attempts integer[], fail_errors text[],
    fail_delays_ms bigint[], fail_permanent boolean[],
    rel_subs text[], rel_seqs bigint[], rel_attempts integer[],
    worker text)
RETURNS TABLE (kind text, subscription text, event_seq bigint)
LANGUAGE plpgsql SET jit = off SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_subs text[];
    v_keys text[];
BEGIN
    -- Only deliveries of ordered subscriptions are looked up: with none, this is free.
    SELECT array_agg(d.subscription), array_agg(d.ordering_key) INTO v_subs, v_keys
    FROM (SELECT * FROM unnest(ack_subs, ack_seqs)
          UNION ALL SELECT * FROM unnest(fail_subs, fail_seqs)) AS t(s, q)
    JOIN pgbus.subscriptions AS o ON o.name = t.s AND o.ordered
    JOIN pgbus.deliveries AS d ON d.subscription = t.s AND d.event_seq = t.q
    WHERE d.ordering_key IS NOT NULL
      AND d.subscription = ANY (ack_subs || fail_subs)
      AND d.event_seq = ANY (ack_seqs || fail_seqs);
    IF v_subs IS NOT NULL THEN
        PERFORM pgbus.lock_keys(v_subs, v_keys);
    END IF;

    RETURN QUERY
    WITH acks AS (
      SELECT * FROM unnest(ack_subs, ack_seqs, ack_attempts) AS a(subscription, event_seq, attempt)
    ),
    fails AS (
      SELECT * FROM unnest(fail_subs, fail_seqs, fail_attempts, fail_errors, fail_delays_ms, fail_permanent)
        AS f(subscription, event_seq, attempt, error, delay_ms, permanent)
    ),
    releases AS (
      SELECT * FROM unnest(rel_subs, rel_seqs, rel_attempts) AS r(subscription, event_seq, attempt)
    ),
    acked AS (
      DELETE FROM pgbus.deliveries AS d
      USING acks
      WHERE d.subscription = acks.subscription AND d.event_seq = acks.event_seq
        AND d.subscription = ANY (ack_subs) AND d.event_seq = ANY (ack_seqs)
        AND pg_catalog.cardinality(ack_subs) > 0
        AND d.attempts = acks.attempt AND d.locked_by = worker
      RETURNING d.subscription, d.event_seq, d.ordering_key, d.is_head
    ),
    failed AS (
      UPDATE pgbus.deliveries AS d
      SET status = CASE WHEN fails.permanent OR d.attempts >= coalesce(s.max_attempts, 1)
                        THEN 'dead' ELSE 'pending' END,
          is_head = CASE WHEN (fails.permanent OR d.attempts >= coalesce(s.max_attempts, 1))
                              AND d.ordering_key IS NOT NULL AND s.on_dead = 'skip'
                         THEN false ELSE d.is_head END,
          available_at = now() + fails.delay_ms * interval '1 millisecond',
          locked_until = NULL,
          last_error = fails.error
      FROM fails LEFT JOIN pgbus.subscriptions AS s ON s.name = fails.subscription
      WHERE d.subscription = fails.subscription AND d.event_seq = fails.event_seq
        AND d.subscription = ANY (fail_subs) AND d.event_seq = ANY (fail_seqs)
        AND pg_catalog.cardinality(fail_subs) > 0
        AND d.attempts = fails.attempt AND d.locked_by = worker AND d.status = 'processing'
      RETURNING d.subscription, d.event_seq, d.attempts, d.status, d.ordering_key, d.is_head,
                fails.error
    ),
    history AS (
      INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
      SELECT f.subscription, f.event_seq, f.attempts, f.error, worker FROM failed AS f
    ),
    released AS (
      UPDATE pgbus.deliveries AS d
      SET status = 'pending', attempts = d.attempts - 1, locked_until = NULL, available_at = now()
      FROM releases
      WHERE d.subscription = releases.subscription AND d.event_seq = releases.event_seq
        AND d.subscription = ANY (rel_subs) AND d.event_seq = ANY (rel_seqs)
        AND pg_catalog.cardinality(rel_subs) > 0
        AND d.attempts = releases.attempt AND d.locked_by = worker AND d.status = 'processing'
      RETURNING d.subscription, d.event_seq
    ),
    vacated AS (
      SELECT x.subscription, x.ordering_key FROM acked AS x
       WHERE x.ordering_key IS NOT NULL AND x.is_head
      UNION
      SELECT x.subscription, x.ordering_key FROM failed AS x
       WHERE x.ordering_key IS NOT NULL AND x.status = 'dead' AND NOT x.is_head
    ),
    promoted AS (
      UPDATE pgbus.deliveries AS d SET is_head = true
      FROM vacated AS v
      WHERE d.subscription = v.subscription
        AND d.event_seq = pgbus.next_of_key(v.subscription, v.ordering_key)
      RETURNING d.subscription, d.event_seq
    ),
    wake AS (
      SELECT pg_notify('pgbus', '') FROM (SELECT 1 FROM promoted LIMIT 1) AS x
      WHERE pgbus.notify_needed()
    )
    SELECT 'ack'::text, a.subscription, a.event_seq FROM acks AS a
     WHERE NOT EXISTS (SELECT 1 FROM acked AS x
                       WHERE x.subscription = a.subscription AND x.event_seq = a.event_seq)
    UNION ALL
    SELECT 'fail', f.subscription, f.event_seq FROM fails AS f
     WHERE NOT EXISTS (SELECT 1 FROM failed AS x
                       WHERE x.subscription = f.subscription AND x.event_seq = f.event_seq)
    UNION ALL
    SELECT 'release', r.subscription, r.event_seq FROM releases AS r
     WHERE NOT EXISTS (SELECT 1 FROM released AS x
                       WHERE x.subscription = r.subscription AND x.event_seq = r.event_seq)
    UNION ALL
    SELECT 'dead', x.subscription, x.event_seq FROM failed AS x WHERE x.status = 'dead'
    UNION ALL
    SELECT 'promoted', p.subscription, p.event_seq FROM promoted AS p
    UNION ALL
    SELECT 'woke', NULL, NULL FROM wake;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.extend_leases(
    p_subs text[], p_seqs bigint[], p_attempts integer[], p_lease_ms bigint, p_worker text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_extended bigint;
BEGIN
    IF p_lease_ms IS NULL OR p_lease_ms < 0 OR p_worker IS NULL THEN
        RAISE EXCEPTION 'pgbus.extend_leases: the lease must be at least 0 ms, and the worker given'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pgbus.deliveries AS d
    SET locked_until = now() + p_lease_ms * interval '1 millisecond'
    FROM (
      SELECT h.subscription, h.event_seq
      FROM pgbus.deliveries AS h
      JOIN unnest(p_subs, p_seqs, p_attempts) AS t(subscription, event_seq, attempt)
        ON h.subscription = t.subscription AND h.event_seq = t.event_seq
      WHERE h.subscription = ANY (p_subs) AND h.event_seq = ANY (p_seqs)
        AND h.attempts = t.attempt AND h.locked_by = p_worker AND h.status = 'processing'
      FOR UPDATE OF h SKIP LOCKED
    ) AS held
    WHERE d.subscription = held.subscription AND d.event_seq = held.event_seq
      AND d.subscription = ANY (p_subs) AND d.event_seq = ANY (p_seqs);
    GET DIAGNOSTICS v_extended = ROW_COUNT;
    RETURN v_extended;
END
$$;
