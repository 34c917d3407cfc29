-- pgbus schema, version 17: consumers consume, operators operate.
--
-- The consumer grant was near operator power: UPDATE and DELETE on the deliveries, the
-- subscriptions and the consumers let a consumer role rewrite any subscription's settings
-- (skipping configure_subscription's lock and backlog conversion), purge every dead letter
-- and `LOCK TABLE ... IN ACCESS EXCLUSIVE MODE` the tables every publish and commit reads
-- (LOCK TABLE in any mode stronger than ROW EXCLUSIVE needs UPDATE, DELETE or TRUNCATE;
-- `SELECT ... FOR UPDATE` or `FOR SHARE` needs UPDATE on a column). A publisher's
-- UPDATE (id) on the log, which publishing's ON CONFLICT needed, let it lock any event's
-- row.
--
-- 1. What a running bus does goes through owner-rights (SECURITY DEFINER) functions:
--    claim, settle, ack_in, reap, promote_orphans, mark_asleep, and new ones for what the
--    bus wrote with statements of its own: extend_leases, heartbeat, leave,
--    join_subscription (create a subscription that does not exist). Consumers keep SELECT
--    on the tables (the gauges, a subscription's settings) and write nothing directly.
-- 2. Operator actions go through owner-rights functions granted by the new
--    pgbus.grant_operator: configure_subscription and try_configure_subscription
--    (settings), purge_dead, replay, skip_dead_head, ensure_heads, and new ones for the
--    statements the operator commands sent: retry_dead and redrive_head. Operators read
--    every table (status, dead letters, the dashboard).
-- 3. Publishing's functions (publish_batch, publish_event) run with the owner's rights;
--    publishers keep INSERT on the publishable columns (a plain INSERT and COPY publish)
--    and SELECT, and lose UPDATE (id).
-- 4. Nobody but the owner has rights on pgbus.config_gate or EXECUTE on pgbus.lock_keys:
--    only owner-rights functions take the bus's locks.
-- 5. Roles granted by earlier versions are narrowed to the new grants.
--
-- The migration can run again over itself (every statement is idempotent).
--
-- Every owner-rights function validates what it is given (the tables' constraints check
-- the rest) and runs with search_path = pg_catalog, pgbus, pg_temp. EXECUTE on each is
-- revoked from PUBLIC and granted by grant_consumer, grant_operator or grant_publisher.

-- 1. The consumer's functions.

ALTER FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)
    SECURITY DEFINER;
ALTER FUNCTION pgbus.settle(text[], bigint[], integer[], text[], bigint[], integer[], text[],
                            bigint[], boolean[], text[], bigint[], integer[], text)
    SECURITY DEFINER;
ALTER FUNCTION pgbus.ack_in(text, bigint, integer, text) SECURITY DEFINER;
ALTER FUNCTION pgbus.reap(integer) SECURITY DEFINER;
ALTER FUNCTION pgbus.promote_orphans(integer) SECURITY DEFINER;
ALTER FUNCTION pgbus.mark_asleep(text) SECURITY DEFINER;

-- Extends the leases a worker still holds (the library's EXTEND): returns how many.
-- A row locked by another transaction is skipped, not waited for (it is being settled).
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
      WHERE h.attempts = t.attempt AND h.locked_by = p_worker AND h.status = 'processing'
      FOR UPDATE OF h SKIP LOCKED
    ) AS held
    WHERE d.subscription = held.subscription AND d.event_seq = held.event_seq;
    GET DIAGNOSTICS v_extended = ROW_COUNT;
    RETURN v_extended;
END
$$;

-- Registers a bus in pgbus.consumers or renews its heartbeat (keeping its awake flag);
-- returns the bus's subscriptions that no longer exist.
CREATE OR REPLACE FUNCTION pgbus.heartbeat(
    p_id text, p_ttl_ms bigint, p_subscriptions text[], p_info text, p_awake boolean)
RETURNS text[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF p_id IS NULL OR p_ttl_ms IS NULL OR p_ttl_ms < 0 THEN
        RAISE EXCEPTION 'pgbus.heartbeat: the worker id and a time to live of at least 0 ms are needed'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pgbus.consumers AS c (id, awake, expires_at, subscriptions, info)
    VALUES (p_id, p_awake, now() + p_ttl_ms * interval '1 millisecond', p_subscriptions, p_info)
    ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN ARRAY(SELECT n FROM unnest(p_subscriptions) AS n
                 WHERE NOT EXISTS (SELECT 1 FROM pgbus.subscriptions AS s WHERE s.name = n)
                 ORDER BY n);
END
$$;

-- Removes a bus from pgbus.consumers at its shutdown; returns whether it was there.
CREATE OR REPLACE FUNCTION pgbus.leave(p_id text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    DELETE FROM pgbus.consumers WHERE id = p_id;
    RETURN FOUND;
END
$$;

-- Creates a subscription unless one of that name exists (a starting bus's); returns
-- whether it created it. The table's constraints check the name, patterns, maximum and
-- policy. Changing an existing subscription is an operator's configure_subscription.
CREATE OR REPLACE FUNCTION pgbus.join_subscription(
    p_name text, p_patterns text[], p_max_attempts integer, p_ordered boolean, p_on_dead text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    INSERT INTO pgbus.subscriptions (name, patterns, max_attempts, ordered, on_dead)
    VALUES (p_name, p_patterns, p_max_attempts, p_ordered, p_on_dead)
    ON CONFLICT (name) DO NOTHING;
    RETURN FOUND;
END
$$;

-- 2. The operator's functions.

ALTER FUNCTION pgbus.configure_subscription(text, text[], integer, boolean, text)
    SECURITY DEFINER;
ALTER FUNCTION pgbus.try_configure_subscription(text, text[], integer, boolean, text, integer)
    SECURITY DEFINER;
ALTER FUNCTION pgbus.purge_dead(text, text) SECURITY DEFINER;
ALTER FUNCTION pgbus.replay(text, timestamptz, timestamptz, text) SECURITY DEFINER;
ALTER FUNCTION pgbus.skip_dead_head(text, text) SECURITY DEFINER;
ALTER FUNCTION pgbus.ensure_heads(text[], text[]) SECURITY DEFINER;

-- Puts dead letters (subscription and event id filters, NULL for all) back to pending,
-- due now, with their attempts reset and no lease; their failure history is kept.
-- Notifies the buses when any was retried. Returns how many were retried, the
-- notifications sent (0 or 1), and the subscriptions and keys of retried deliveries of
-- ordered subscriptions that had been skipped (their keys may need a head: ensure_heads).
CREATE OR REPLACE FUNCTION pgbus.retry_dead(p_subscription text, p_event_id text)
RETURNS TABLE (retried bigint, woke bigint, subscriptions text[], keys text[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    RETURN QUERY
    WITH done AS (
      UPDATE pgbus.deliveries AS d
      SET status = 'pending', attempts = 0, available_at = now(), locked_until = NULL,
          locked_by = NULL
      WHERE d.status = 'dead'
        AND (p_subscription IS NULL OR d.subscription = p_subscription)
        AND (p_event_id IS NULL
             OR d.event_seq = (SELECT e.seq FROM pgbus.events AS e WHERE e.id = p_event_id))
      RETURNING d.subscription, d.ordering_key, d.is_head
    ),
    wake AS (
      SELECT pg_notify('pgbus', '') FROM (SELECT 1 FROM done LIMIT 1) AS x
    )
    SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM wake),
           (SELECT array_agg(r.subscription) FROM done AS r
            WHERE r.ordering_key IS NOT NULL AND NOT r.is_head),
           (SELECT array_agg(r.ordering_key) FROM done AS r
            WHERE r.ordering_key IS NOT NULL AND NOT r.is_head);
END
$$;

-- Makes a key's head due now: a dead head gets its attempts back, a head backing off is
-- retried at once; notifies the buses. Returns the heads redriven (0 or 1) and the
-- notifications sent.
CREATE OR REPLACE FUNCTION pgbus.redrive_head(p_subscription text, p_key text)
RETURNS TABLE (redriven bigint, woke bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    RETURN QUERY
    WITH done AS (
      UPDATE pgbus.deliveries AS d
      SET attempts = CASE WHEN d.status = 'dead' THEN 0 ELSE d.attempts END,
          status = 'pending', available_at = now(),
          locked_until = NULL, locked_by = NULL
      WHERE d.subscription = p_subscription AND d.ordering_key = p_key AND d.is_head
        AND d.status IN ('dead', 'pending')
      RETURNING 1
    )
    SELECT count(*),
           (SELECT count(*) FROM (SELECT pg_notify('pgbus', '') FROM done LIMIT 1) AS n)
    FROM done;
END
$$;

-- 3. Publishing with the owner's rights (ON CONFLICT ... DO UPDATE needed UPDATE (id)).
ALTER FUNCTION pgbus.publish_batch(text[], text[], integer[], text[], text[], text[], text[],
                                   text[], timestamptz[], text[], text[], timestamptz[],
                                   bigint[], text[])
    SECURITY DEFINER;
ALTER FUNCTION pgbus.publish_event(text, text, integer, text, text, text, text, text,
                                   timestamptz, text, text, timestamptz, bigint, text)
    SECURITY DEFINER;

REVOKE EXECUTE ON FUNCTION
    pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint),
    pgbus.settle(text[], bigint[], integer[], text[], bigint[], integer[], text[], bigint[],
                 boolean[], text[], bigint[], integer[], text),
    pgbus.ack_in(text, bigint, integer, text),
    pgbus.reap(integer),
    pgbus.promote_orphans(integer),
    pgbus.mark_asleep(text),
    pgbus.extend_leases(text[], bigint[], integer[], bigint, text),
    pgbus.heartbeat(text, bigint, text[], text, boolean),
    pgbus.leave(text),
    pgbus.join_subscription(text, text[], integer, boolean, text),
    pgbus.configure_subscription(text, text[], integer, boolean, text),
    pgbus.try_configure_subscription(text, text[], integer, boolean, text, integer),
    pgbus.purge_dead(text, text),
    pgbus.replay(text, timestamptz, timestamptz, text),
    pgbus.skip_dead_head(text, text),
    pgbus.ensure_heads(text[], text[]),
    pgbus.retry_dead(text, text),
    pgbus.redrive_head(text, text),
    pgbus.publish_batch(text[], text[], integer[], text[], text[], text[], text[], text[],
                        timestamptz[], text[], text[], timestamptz[], bigint[], text[]),
    pgbus.publish_event(text, text, integer, text, text, text, text, text, timestamptz, text,
                        text, timestamptz, bigint, text)
FROM PUBLIC;

-- The grants.

-- A publisher: INSERT on the publishable columns and SELECT on the log; the publish
-- functions.
CREATE OR REPLACE FUNCTION pgbus.grant_publisher(publisher regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', publisher);
    EXECUTE format('GRANT SELECT, INSERT (id, event_name, event_version, source, '
                   'aggregate_type, aggregate_id, correlation_id, causation_id, occurred_at, '
                   'payload, headers, available_at, ordering_key) ON pgbus.events TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish(text, jsonb, jsonb, text, text, '
                   'text, text, text, text, integer, timestamptz, text) TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish_batch(text[], text[], integer[], '
                   'text[], text[], text[], text[], text[], timestamptz[], text[], text[], '
                   'timestamptz[], bigint[], text[]) TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish_event(text, text, integer, '
                   'text, text, text, text, text, timestamptz, text, text, timestamptz, '
                   'bigint, text) TO %s', publisher);
END
$$;

-- A consumer: what a running bus does, through the functions above; it reads the tables
-- and writes none of them directly.
CREATE OR REPLACE FUNCTION pgbus.grant_consumer(consumer regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', consumer);
    EXECUTE format('GRANT SELECT ON pgbus.events, pgbus.settings, pgbus.deliveries, '
                   'pgbus.delivery_failures, pgbus.consumers, pgbus.subscriptions TO %s',
                   consumer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION '
                   'pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint), '
                   'pgbus.settle(text[], bigint[], integer[], text[], bigint[], integer[], '
                   'text[], bigint[], boolean[], text[], bigint[], integer[], text), '
                   'pgbus.ack_in(text, bigint, integer, text), '
                   'pgbus.reap(integer), '
                   'pgbus.promote_orphans(integer), '
                   'pgbus.mark_asleep(text), '
                   'pgbus.extend_leases(text[], bigint[], integer[], bigint, text), '
                   'pgbus.heartbeat(text, bigint, text[], text, boolean), '
                   'pgbus.leave(text), '
                   'pgbus.join_subscription(text, text[], integer, boolean, text), '
                   'pgbus.sweep(bigint, integer, bigint) TO %s', consumer);
END
$$;

-- An operator: settings, dead letters (retry, purge), replay, a blocked key's head (skip,
-- redrive), through the functions above; it reads every table (status, the dashboard).
-- Dropping a subscription and pgbus.settings stay the owner's.
CREATE OR REPLACE FUNCTION pgbus.grant_operator(operator regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', operator);
    EXECUTE format('GRANT SELECT ON pgbus.events, pgbus.settings, pgbus.deliveries, '
                   'pgbus.delivery_failures, pgbus.consumers, pgbus.subscriptions, '
                   'pgbus.subscription_patterns TO %s', operator);
    EXECUTE format('GRANT EXECUTE ON FUNCTION '
                   'pgbus.configure_subscription(text, text[], integer, boolean, text), '
                   'pgbus.try_configure_subscription(text, text[], integer, boolean, text, '
                   'integer), '
                   'pgbus.purge_dead(text, text), '
                   'pgbus.replay(text, timestamptz, timestamptz, text), '
                   'pgbus.skip_dead_head(text, text), '
                   'pgbus.ensure_heads(text[], text[]), '
                   'pgbus.retry_dead(text, text), '
                   'pgbus.redrive_head(text, text) TO %s', operator);
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.grant_operator(regrole) FROM PUBLIC;

-- 4. Only the owner takes the bus's locks directly. grant_owned_locks (migration 13)
-- granted them to consumers; nothing grants them now.
DROP FUNCTION IF EXISTS pgbus.grant_owned_locks(regrole);

-- 5. Roles granted by earlier versions. Every role with a right on a table of pgbus or
-- EXECUTE on lock_keys loses every table right but SELECT (and a publisher's INSERT on
-- the log) and its locks; a consumer (it could update deliveries) and a publisher (it
-- could insert into the log) then get the new grants.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        WITH granted AS (
          SELECT a.grantee, c.relname, a.privilege_type
          FROM pg_catalog.pg_class AS c, LATERAL pg_catalog.aclexplode(c.relacl) AS a
          WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pgbus'::pg_catalog.regnamespace
            AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
          UNION ALL
          SELECT a.grantee, c.relname, a.privilege_type
          FROM pg_catalog.pg_attribute AS t
          JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) t.attrelid,
               LATERAL pg_catalog.aclexplode(t.attacl) AS a
          WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pgbus'::pg_catalog.regnamespace
            AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
          UNION ALL
          SELECT a.grantee, 'lock_keys', a.privilege_type
          FROM pg_catalog.pg_proc AS p, LATERAL pg_catalog.aclexplode(p.proacl) AS a
          WHERE p.oid OPERATOR(pg_catalog.=) 'pgbus.lock_keys(text[], text[])'::pg_catalog.regprocedure
            AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
        )
        SELECT g.grantee::pg_catalog.regrole AS role,
               bool_or(g.relname OPERATOR(pg_catalog.=) 'deliveries'
                       AND g.privilege_type OPERATOR(pg_catalog.=) 'UPDATE') AS consumer,
               bool_or(g.relname OPERATOR(pg_catalog.=) 'events'
                       AND g.privilege_type OPERATOR(pg_catalog.=) 'INSERT') AS publisher
        FROM granted AS g
        WHERE g.grantee OPERATOR(pg_catalog.<>) 0
        GROUP BY g.grantee
    LOOP
        EXECUTE pg_catalog.format(
            'REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON '
            'pgbus.deliveries, pgbus.delivery_failures, pgbus.consumers, pgbus.subscriptions, '
            'pgbus.settings, pgbus.subscription_patterns, pgbus.config_gate, pgbus.key_stripes, '
            'pgbus.duties FROM %s', r.role);
        EXECUTE pg_catalog.format(
            'REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON pgbus.events FROM %s', r.role);
        EXECUTE pg_catalog.format(
            'REVOKE ALL ON ALL SEQUENCES IN SCHEMA pgbus FROM %s', r.role);
        EXECUTE pg_catalog.format(
            'REVOKE EXECUTE ON FUNCTION pgbus.lock_keys(text[], text[]) FROM %s', r.role);
        IF r.consumer THEN
            PERFORM pgbus.grant_consumer(r.role);
        END IF;
        IF r.publisher THEN
            PERFORM pgbus.grant_publisher(r.role);
        END IF;
    END LOOP;
END
$$;
