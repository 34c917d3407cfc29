-- pgbus schema, version 13: coordination on locks that only pgbus's own roles can take.
--
-- The bus coordinated through advisory locks on fixed keys: the configuration gate, one
-- lock per (subscription, ordering key), the wake lock and the sweep's lock. Any role
-- that can merely connect can take any advisory lock, and one that held them made every
-- insert into the log wait past statement_timeout and publishers block in COMMIT. Now:
--
-- 1. The configuration gate is a table lock on pgbus.config_gate: ROW EXCLUSIVE for the
--    fan-out, settlement, reaping, repairs, replay and purges (they never conflict with
--    each other), EXCLUSIVE for a settings change. LOCK TABLE checks privileges before it
--    queues: ROW EXCLUSIVE needs INSERT on the table, EXCLUSIVE needs UPDATE. The owner
--    has both; grant_consumer grants both (a consumer changes settings with
--    `reconfigure`); nobody else has any, and the table refuses every row.
-- 2. Key locks are row locks (FOR NO KEY UPDATE, in stripe order) on the 65,536 rows of
--    pgbus.key_stripes, taken by pgbus.lock_keys with the owner's rights: a key's stripe
--    is the low 16 bits of the hash that named its advisory lock. Two keys that share a
--    stripe only serialize. EXECUTE on lock_keys: the owner and consumers.
-- 3. The wake lock stays an advisory lock that can no longer make anyone wait: a
--    publisher only tries it at commit and notifies when it cannot have it (a spare
--    notification costs an empty claim); a consumer falling asleep waits for it at most
--    200 ms and otherwise stays awake, polling on its short backoff.
-- 4. One sweep at a time: a row of pgbus.duties locked FOR UPDATE SKIP LOCKED, with the
--    owner's rights. The sweep's lock_key parameter is kept for callers and ignored.
-- 5. A settings change tries the gate for a bounded time (pgbus.try_configure_subscription)
--    and reports the sessions holding it; pgbus.configure_subscription retries it with
--    backoff, so publishes and settlements get through between tries instead of queueing
--    behind a change that waits for a long transaction.

-- 1. The configuration gate.
CREATE TABLE pgbus.config_gate (
    CONSTRAINT config_gate_is_a_lock CHECK (false)
);
REVOKE ALL ON pgbus.config_gate FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgbus.lock_config(exclusive boolean) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF exclusive THEN
        LOCK TABLE pgbus.config_gate IN EXCLUSIVE MODE;
    ELSE
        LOCK TABLE pgbus.config_gate IN ROW EXCLUSIVE MODE;
    END IF;
END
$$;

-- 2. The key stripes.
CREATE TABLE pgbus.key_stripes (
    stripe integer PRIMARY KEY CHECK (stripe BETWEEN 0 AND 65535)
);
INSERT INTO pgbus.key_stripes (stripe) SELECT g FROM pg_catalog.generate_series(0, 65535) AS g;
ANALYZE pgbus.key_stripes;
REVOKE ALL ON pgbus.key_stripes FROM PUBLIC;

-- Locks the stripes of (subscription, key) pairs, in stripe order so that two statements
-- locking overlapping sets never deadlock, until the end of the transaction. FOR NO KEY
-- UPDATE is the weakest row lock that conflicts with itself; nobody ever updates a
-- stripe, so under REPEATABLE READ a stripe locked and released since the snapshot is no
-- serialization failure.
CREATE OR REPLACE FUNCTION pgbus.lock_keys(subs text[], keys text[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM 1 FROM pgbus.key_stripes AS k
    WHERE k.stripe = ANY (ARRAY(
        SELECT (pg_catalog.hashtextextended(t.s || pg_catalog.chr(31) || t.k, 7305) & 65535)::integer
        FROM unnest(subs, keys) AS t(s, k)
        WHERE t.k IS NOT NULL))
    ORDER BY k.stripe
    FOR NO KEY UPDATE;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.lock_keys(text[], text[]) FROM PUBLIC;

-- 3. The wake lock (see migration 5 for its protocol), tried, never waited for, by
-- publishers: when it is taken (a consumer is marking itself asleep, or a session
-- outside pgbus holds it), the commit notifies.
CREATE OR REPLACE FUNCTION pgbus.notify_at_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM pg_catalog.set_config('pgbus.notify_queued', 'off', true);
    IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(8099550711435458411) THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
        RETURN NULL;
    END IF;
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed'
       OR (SELECT coalesce(bool_or(NOT c.awake), true)
           FROM pgbus.consumers AS c
           WHERE c.expires_at > pg_catalog.clock_timestamp()) THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
    END IF;
    RETURN NULL;
END
$$;

-- A consumer falls asleep: it waits for the wake lock at most 200 ms (every publisher
-- that read "awake" holds it shared until its commit ends). When it cannot have it, it
-- raises lock_not_available and the consumer stays awake, polling on a short backoff.
CREATE OR REPLACE FUNCTION pgbus.mark_asleep(p_id text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_lock_timeout text := pg_catalog.current_setting('lock_timeout');
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', '200ms', true);
    PERFORM pg_catalog.pg_advisory_xact_lock(8099550711435458411);
    PERFORM pg_catalog.set_config('lock_timeout', v_lock_timeout, true);
    UPDATE pgbus.consumers SET awake = false WHERE id = p_id;
END
$$;

-- 4. Duties that one process at a time performs.
CREATE TABLE pgbus.duties (
    name text PRIMARY KEY
);
INSERT INTO pgbus.duties (name) VALUES ('sweep');
REVOKE ALL ON pgbus.duties FROM PUBLIC;

-- The sweep of migration 11, but one at a time by the duty's row instead of an advisory
-- lock (lock_key is ignored).
CREATE OR REPLACE FUNCTION pgbus.sweep(retention_ms bigint, max_rows integer, lock_key bigint)
RETURNS TABLE (got boolean, events bigint, failures bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp SET jit = off AS $$
DECLARE
    v_cutoff timestamptz;
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

-- 5. Changing a subscription's settings without stalling the bus.
--
-- Tries to take the configuration gate exclusively, waiting at most wait_ms (at least
-- 1 ms). NULL when it has it (until the end of the transaction); otherwise nothing is
-- held and the answer is a JSON array of the sessions holding or awaiting the gate, the
-- longest-running transaction first: pid (NULL for a prepared transaction), role,
-- application_name, xact_age_ms (NULL where this role may not see it), waiting.
CREATE FUNCTION pgbus.try_lock_config(wait_ms integer) RETURNS jsonb
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_lock_timeout text := pg_catalog.current_setting('lock_timeout');
    v_sessions jsonb;
BEGIN
    BEGIN
        PERFORM pg_catalog.set_config('lock_timeout',
                                      greatest(coalesce(wait_ms, 1), 1)::text || 'ms', true);
        PERFORM pgbus.lock_config(true);
        PERFORM pg_catalog.set_config('lock_timeout', v_lock_timeout, true);
        RETURN NULL;
    EXCEPTION WHEN lock_not_available THEN
        -- The subtransaction's end undid the setting and dropped the request.
        NULL;
    END;
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'pid', h.pid, 'role', h.role, 'application_name', h.application_name,
               'xact_age_ms', h.xact_age_ms, 'waiting', h.waiting)
             ORDER BY h.xact_age_ms DESC NULLS LAST, h.pid), '[]'::jsonb)
      INTO v_sessions
    FROM (SELECT l.pid, a.usename::text AS role, a.application_name,
                 (extract(epoch FROM pg_catalog.clock_timestamp() - a.xact_start) * 1000)::bigint
                   AS xact_age_ms,
                 NOT bool_and(l.granted) AS waiting
          FROM pg_catalog.pg_locks AS l
          LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
          WHERE l.locktype = 'relation'
            AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                              WHERE d.datname = pg_catalog.current_database())
            AND l.relation = 'pgbus.config_gate'::regclass
            AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid()
          GROUP BY l.pid, a.usename, a.application_name, a.xact_start) AS h;
    RETURN v_sessions;
END
$$;

-- The change itself, with the gate tried for at most wait_ms: `got` false (and nothing
-- done or held) with `waiting_on` as pgbus.try_lock_config returns it, or `got` true and
-- what pgbus.configure_subscription returns (migration 5 documents the conversion).
CREATE FUNCTION pgbus.try_configure_subscription(
    p_name text,
    p_patterns text[],
    p_max_attempts integer,
    p_ordered boolean,
    p_on_dead text,
    p_wait_ms integer)
RETURNS TABLE (got boolean, found boolean, converted bigint, waiting_on jsonb)
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
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

-- The SQL API's change, which waits as long as it must (the caller's statement_timeout
-- bounds it) without stalling the bus: it tries the gate for 200 ms at a time and sleeps
-- between tries (50 ms, doubling up to 1 s), so shared takers get through meanwhile.
CREATE OR REPLACE FUNCTION pgbus.configure_subscription(
    p_name text,
    p_patterns text[] DEFAULT NULL,
    p_max_attempts integer DEFAULT NULL,
    p_ordered boolean DEFAULT NULL,
    p_on_dead text DEFAULT NULL)
RETURNS TABLE (found boolean, converted bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_try record;
    v_pause float8 := 0.05;
BEGIN
    LOOP
        SELECT * INTO v_try
        FROM pgbus.try_configure_subscription(p_name, p_patterns, p_max_attempts, p_ordered,
                                              p_on_dead, 200);
        IF v_try.got THEN
            RETURN QUERY SELECT v_try.found, v_try.converted;
            RETURN;
        END IF;
        PERFORM pg_catalog.pg_sleep(v_pause);
        v_pause := least(v_pause * 2, 1.0);
    END LOOP;
END
$$;

-- The grants. Consumers take the gate (shared for settling, exclusive for `reconfigure`),
-- lock keys while settling, and change settings; publishers need none of it (the
-- fan-out runs with the owner's rights).
CREATE FUNCTION pgbus.grant_owned_locks(consumer regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT INSERT, UPDATE ON pgbus.config_gate TO %s', consumer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.lock_keys(text[], text[]) TO %s', consumer);
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.grant_owned_locks(regrole) FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgbus.grant_consumer(consumer regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', consumer);
    EXECUTE format('GRANT SELECT ON pgbus.events, pgbus.settings TO %s', consumer);
    EXECUTE format('GRANT SELECT, UPDATE, DELETE ON pgbus.deliveries TO %s', consumer);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON pgbus.delivery_failures, '
                   'pgbus.consumers TO %s', consumer);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON pgbus.subscriptions TO %s', consumer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.sweep(bigint, integer, bigint) TO %s', consumer);
    PERFORM pgbus.grant_owned_locks(consumer);
END
$$;

-- Roles granted as consumers by earlier versions (they may update deliveries) get the
-- new locks.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole AS role
        FROM pg_catalog.pg_class AS c, LATERAL pg_catalog.aclexplode(c.relacl) AS a
        WHERE c.oid = 'pgbus.deliveries'::regclass
          AND a.grantee <> c.relowner AND a.grantee <> 0
          AND a.privilege_type = 'UPDATE'
    LOOP
        PERFORM pgbus.grant_owned_locks(r.role);
    END LOOP;
END
$$;
