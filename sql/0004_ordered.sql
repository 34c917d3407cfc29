-- pgbus schema, version 4: ordered subscriptions.
--
-- For an ordered subscription only the oldest unfinished delivery of each ordering key
-- (the "head") is claimable. That is stored at write time: a delivery carries its key and
-- an is_head flag, and the claim index holds only heads, so the claim statement and its
-- O(batch) cost are the same as for unordered subscriptions, however deep a key's
-- backlog. Fan-out and completion are serialized per (subscription, key) with
-- transaction-scoped advisory locks, taken in sorted order.

-- The caller's explicit key; when NULL the key is the aggregate ("type:id"), if any.
ALTER TABLE pgbus.events ADD COLUMN ordering_key text;

ALTER TABLE pgbus.subscriptions
    ADD COLUMN ordered boolean NOT NULL DEFAULT false,
    ADD COLUMN on_dead text NOT NULL DEFAULT 'block',
    ADD CONSTRAINT subscriptions_on_dead_check CHECK (on_dead IN ('block', 'skip'));

-- ordering_key is set only for keyed deliveries of ordered subscriptions; every other
-- delivery is a head. key_pos orders a key's deliveries: taken from a sequence after the
-- key's lock, so it follows the order in which publishing transactions held the lock,
-- which for one key is their commit order.
ALTER TABLE pgbus.deliveries
    ADD COLUMN ordering_key text,
    ADD COLUMN is_head boolean NOT NULL DEFAULT true,
    ADD COLUMN key_pos bigint;

CREATE SEQUENCE pgbus.key_pos_seq;

DROP INDEX pgbus.deliveries_claim_idx;
CREATE INDEX deliveries_claim_idx ON pgbus.deliveries (subscription, available_at, event_seq)
    WHERE status = 'pending' AND is_head;

-- Finds the next delivery of a key (promotion).
CREATE INDEX deliveries_key_idx ON pgbus.deliveries (subscription, ordering_key, key_pos, event_seq)
    WHERE ordering_key IS NOT NULL;

-- At most one head per (subscription, key). Deferred: a completion deletes the head and
-- promotes the next in one statement, in either order.
ALTER TABLE pgbus.deliveries ADD CONSTRAINT deliveries_one_head
    EXCLUDE USING btree (subscription WITH =, ordering_key WITH =)
    WHERE (is_head AND ordering_key IS NOT NULL)
    DEFERRABLE INITIALLY DEFERRED;

-- The key an event is ordered by: the explicit key, else "aggregate_type:aggregate_id".
CREATE FUNCTION pgbus.event_key(ordering_key text, aggregate_type text, aggregate_id text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(ordering_key, aggregate_type || ':' || aggregate_id)
$$;

-- The delivery to promote when a key's head is done: its oldest pending follower (one
-- probe of deliveries_key_idx). STABLE: it reads the calling statement's snapshot.
CREATE FUNCTION pgbus.next_of_key(p_subscription text, p_key text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT n.event_seq FROM pgbus.deliveries AS n
    WHERE n.subscription = p_subscription AND n.ordering_key = p_key
      AND NOT n.is_head AND n.status = 'pending'
    ORDER BY n.key_pos, n.event_seq
    LIMIT 1
$$;

-- Takes the transaction-scoped advisory locks of (subscription, key) pairs, in sorted
-- order so that two statements locking overlapping sets never deadlock. The setting
-- pgbus.key_locks = 'off' disables them; it exists only so a test can show what the locks
-- prevent.
CREATE FUNCTION pgbus.lock_keys(subs text[], keys text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('pgbus.key_locks', true) IS NOT DISTINCT FROM 'off' THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(h)
    FROM (SELECT DISTINCT hashtextextended(s || chr(31) || k, 7305) AS h
          FROM unnest(subs, keys) AS t(s, k)
          WHERE k IS NOT NULL
          ORDER BY 1) AS sorted;
END
$$;

-- Keeps what migrations 2 and 3 gave the fan-out: no JIT (its queries are simple, and
-- with pgbus.subscriptions rarely analyzed a large batch can be costed above
-- jit_above_cost), and the rights of the schema's owner with a fixed search_path (a
-- publisher needs no rights on deliveries; lock_keys and key_pos_seq run as the owner).
CREATE OR REPLACE FUNCTION pgbus.fan_out() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus SET jit = off AS $$
DECLARE
    v_subs text[];
    v_keys text[];
    v_pos bigint;
BEGIN
    -- Unordered subscriptions, and events without a key: every delivery is a head.
    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at)
    SELECT s.name, e.seq, e.available_at
    FROM new_events AS e
    JOIN pgbus.subscriptions AS s
      ON EXISTS (SELECT 1 FROM unnest(s.patterns) AS p
                 WHERE pgbus.pattern_matches(p, e.event_name))
    WHERE NOT (s.ordered
               AND pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) IS NOT NULL);

    IF NOT EXISTS (SELECT 1 FROM pgbus.subscriptions WHERE ordered) THEN
        RETURN NULL;
    END IF;

    -- Ordered subscriptions: lock the keys first, then decide heads with a fresh
    -- snapshot (the next statement), which sees every earlier holder's committed rows.
    SELECT array_agg(sub), array_agg(key) INTO v_subs, v_keys
    FROM (SELECT DISTINCT s.name AS sub,
                 pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
          FROM new_events AS e
          JOIN pgbus.subscriptions AS s
            ON s.ordered
           AND EXISTS (SELECT 1 FROM unnest(s.patterns) AS p
                       WHERE pgbus.pattern_matches(p, e.event_name))) AS keyed
    WHERE key IS NOT NULL;
    IF v_subs IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM pgbus.lock_keys(v_subs, v_keys);
    v_pos := nextval('pgbus.key_pos_seq');

    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at, ordering_key, is_head, key_pos)
    SELECT m.sub, m.seq, m.available_at, m.key,
           row_number() OVER (PARTITION BY m.sub, m.key ORDER BY m.seq) = 1
             AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                             WHERE d.subscription = m.sub AND d.ordering_key = m.key AND d.is_head),
           v_pos
    FROM (SELECT s.name AS sub, e.seq, e.available_at,
                 pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
          FROM new_events AS e
          JOIN pgbus.subscriptions AS s
            ON s.ordered
           AND EXISTS (SELECT 1 FROM unnest(s.patterns) AS p
                       WHERE pgbus.pattern_matches(p, e.event_name))) AS m
    WHERE m.key IS NOT NULL;
    RETURN NULL;
END
$$;

-- Settles a batch of deliveries (see pgbus::sql::SETTLE): completions, failures and
-- releases, fenced by the lease token. For ordered subscriptions it first locks the keys
-- involved, then, in the same statement that deletes a completed head (or skips a dead
-- one), promotes the key's next delivery, and wakes sleeping buses when it did.
CREATE FUNCTION pgbus.settle(
    ack_subs text[], ack_seqs bigint[], ack_attempts integer[],
    fail_subs text[], fail_seqs bigint[], fail_attempts integer[], fail_errors text[],
    fail_delays_ms bigint[], fail_permanent boolean[],
    rel_subs text[], rel_seqs bigint[], rel_attempts integer[],
    worker text)
RETURNS TABLE (kind text, subscription text, event_seq bigint)
LANGUAGE plpgsql SET jit = off AS $$
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
    WHERE d.ordering_key IS NOT NULL;
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

-- Returns expired leases to pending (or dead when out of attempts), with a history row
-- each; for ordered subscriptions under on_dead = 'skip', a head that dies is skipped and
-- the next delivery of its key promoted. Notifies when anything became due. The keys are
-- locked before the rows (the same order as publishing and settling).
CREATE FUNCTION pgbus.reap(max_rows integer)
RETURNS TABLE (returned bigint, dead bigint)
LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    v_subs text[];
    v_seqs bigint[];
    v_keys text[];
BEGIN
    SELECT array_agg(c.subscription), array_agg(c.event_seq), array_agg(c.ordering_key)
      INTO v_subs, v_seqs, v_keys
    FROM (SELECT d.subscription, d.event_seq, d.ordering_key FROM pgbus.deliveries AS d
          WHERE d.status = 'processing' AND d.locked_until < now()
          ORDER BY d.locked_until
          LIMIT max_rows) AS c;
    IF v_subs IS NULL THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint;
        RETURN;
    END IF;
    PERFORM pgbus.lock_keys(v_subs, v_keys);

    RETURN QUERY
    WITH expired AS (
      SELECT d.subscription, d.event_seq FROM pgbus.deliveries AS d
      JOIN unnest(v_subs, v_seqs) AS c(subscription, event_seq)
        ON d.subscription = c.subscription AND d.event_seq = c.event_seq
      WHERE d.status = 'processing' AND d.locked_until < now()
      FOR UPDATE OF d SKIP LOCKED
    ),
    reaped AS (
      UPDATE pgbus.deliveries AS d
      SET status = CASE WHEN d.attempts >= coalesce(s.max_attempts, 1) THEN 'dead' ELSE 'pending' END,
          is_head = CASE WHEN d.attempts >= coalesce(s.max_attempts, 1)
                              AND d.ordering_key IS NOT NULL AND s.on_dead = 'skip'
                         THEN false ELSE d.is_head END,
          available_at = now(),
          locked_until = NULL,
          last_error = 'lease expired (worker ' || coalesce(d.locked_by, 'unknown') || ')'
      FROM expired LEFT JOIN pgbus.subscriptions AS s ON s.name = expired.subscription
      WHERE d.subscription = expired.subscription AND d.event_seq = expired.event_seq
      RETURNING d.subscription, d.event_seq, d.attempts, d.status, d.last_error, d.locked_by,
                d.ordering_key, d.is_head
    ),
    history AS (
      INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
      SELECT r.subscription, r.event_seq, r.attempts, r.last_error, r.locked_by FROM reaped AS r
    ),
    promoted AS (
      UPDATE pgbus.deliveries AS d SET is_head = true
      FROM (SELECT r.subscription, r.ordering_key FROM reaped AS r
            WHERE r.ordering_key IS NOT NULL AND r.status = 'dead' AND NOT r.is_head) AS v
      WHERE d.subscription = v.subscription
        AND d.event_seq = pgbus.next_of_key(v.subscription, v.ordering_key)
      RETURNING d.event_seq
    ),
    wake AS (
      SELECT pg_notify('pgbus', '')
      FROM (SELECT 1 FROM reaped AS r WHERE r.status = 'pending'
            UNION ALL SELECT 1 FROM promoted) AS x
      LIMIT 1
    )
    SELECT count(*) FILTER (WHERE r.status = 'pending'),
           count(*) FILTER (WHERE r.status = 'dead') + 0 * (SELECT count(*) FROM wake)
    FROM reaped AS r;
END
$$;

-- Gives each of these (subscription, key) pairs a head if it has pending deliveries and
-- none: its oldest is promoted. Used after dead letters of a key come back (an operator's
-- retry) and by the repair check. Returns the promoted deliveries.
CREATE FUNCTION pgbus.ensure_heads(subs text[], keys text[])
RETURNS TABLE (subscription text, ordering_key text, event_seq bigint)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pgbus.lock_keys(subs, keys);
    RETURN QUERY
    UPDATE pgbus.deliveries AS d SET is_head = true
    FROM (SELECT DISTINCT t.s, t.k FROM unnest(subs, keys) AS t(s, k)
          WHERE t.k IS NOT NULL) AS o
    WHERE d.subscription = o.s
      AND d.event_seq = pgbus.next_of_key(o.s, o.k)
      AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS h
                      WHERE h.subscription = o.s AND h.ordering_key = o.k AND h.is_head)
    RETURNING d.subscription, d.ordering_key, d.event_seq;
END
$$;

-- Keys of ordered subscriptions that have pending deliveries but no head. This must never
-- happen; the bus checks for it now and then and repairs it.
CREATE FUNCTION pgbus.promote_orphans(max_keys integer)
RETURNS TABLE (subscription text, ordering_key text, event_seq bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_subs text[];
    v_keys text[];
BEGIN
    SELECT array_agg(o.subscription), array_agg(o.ordering_key) INTO v_subs, v_keys
    FROM (SELECT d.subscription, d.ordering_key FROM pgbus.deliveries AS d
          WHERE d.ordering_key IS NOT NULL
          GROUP BY d.subscription, d.ordering_key
          HAVING NOT bool_or(d.is_head) AND bool_or(d.status = 'pending')
          LIMIT max_keys) AS o;
    IF v_subs IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM pgbus.ensure_heads(v_subs, v_keys);
END
$$;

-- pgbus.publish gains the ordering key (a new last parameter); grant_publisher grants the
-- new signature.
DROP FUNCTION pgbus.publish(text, jsonb, jsonb, text, text, text, text, text, text, integer, timestamptz);
CREATE FUNCTION pgbus.publish(
    event_name     text,
    payload        jsonb       DEFAULT '{}',
    headers        jsonb       DEFAULT '{}',
    id             text        DEFAULT NULL,
    aggregate_type text        DEFAULT NULL,
    aggregate_id   text        DEFAULT NULL,
    correlation_id text        DEFAULT NULL,
    causation_id   text        DEFAULT NULL,
    source         text        DEFAULT NULL,
    event_version  integer     DEFAULT 1,
    deliver_at     timestamptz DEFAULT NULL,
    ordering_key   text        DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_id text := coalesce(publish.id, pgbus.uuid_v7()::text);
    v_existing pgbus.events;
BEGIN
    INSERT INTO pgbus.events AS e (id, event_name, event_version, source, aggregate_type,
                                   aggregate_id, correlation_id, causation_id, payload,
                                   headers, available_at, ordering_key)
    VALUES (v_id, publish.event_name, publish.event_version, publish.source,
            publish.aggregate_type, publish.aggregate_id, publish.correlation_id,
            publish.causation_id, coalesce(publish.payload, '{}'),
            coalesce(publish.headers, '{}'), coalesce(publish.deliver_at, now()),
            publish.ordering_key)
    ON CONFLICT ON CONSTRAINT events_id_key DO NOTHING;
    IF NOT FOUND THEN
        SELECT * INTO v_existing FROM pgbus.events AS e WHERE e.id = v_id;
        IF (v_existing.event_name, v_existing.event_version, v_existing.aggregate_type,
            v_existing.aggregate_id, v_existing.payload, v_existing.headers)
           IS DISTINCT FROM
           (publish.event_name, publish.event_version, publish.aggregate_type,
            publish.aggregate_id, coalesce(publish.payload, '{}'), coalesce(publish.headers, '{}'))
        THEN
            RAISE EXCEPTION 'event % was already published with different content', v_id
                USING ERRCODE = 'unique_violation', CONSTRAINT = 'events_id_key';
        END IF;
    END IF;
    RETURN v_id;
END
$$;

-- An operator's decision on a blocked key: the dead head stops being the head (it stays
-- a dead letter, listed and replayable) and the key's next delivery is promoted.
-- Returns the promoted delivery's event_seq (NULL when the key had nothing waiting).
CREATE FUNCTION pgbus.skip_dead_head(p_subscription text, p_key text)
RETURNS TABLE (skipped bigint, promoted bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_skipped bigint;
    v_promoted bigint;
BEGIN
    PERFORM pgbus.lock_keys(ARRAY[p_subscription], ARRAY[p_key]);
    UPDATE pgbus.deliveries AS d SET is_head = false
    WHERE d.subscription = p_subscription AND d.ordering_key = p_key
      AND d.is_head AND d.status = 'dead'
    RETURNING d.event_seq INTO v_skipped;
    IF v_skipped IS NULL THEN
        RETURN;
    END IF;
    UPDATE pgbus.deliveries AS d SET is_head = true
    WHERE d.subscription = p_subscription
      AND d.event_seq = pgbus.next_of_key(p_subscription, p_key)
    RETURNING d.event_seq INTO v_promoted;
    IF v_promoted IS NOT NULL THEN
        PERFORM pg_notify('pgbus', '');
    END IF;
    RETURN QUERY SELECT v_skipped, v_promoted;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.grant_publisher(publisher regrole) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', publisher);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE (id) ON pgbus.events TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish(text, jsonb, jsonb, text, text, '
                   'text, text, text, text, integer, timestamptz, text) TO %s', publisher);
END
$$;
