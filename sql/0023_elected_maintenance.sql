-- Maintenance by one bus at a time: an elected leader reaps expired leases, repairs
-- headless keys, sweeps the log and samples the gauges; the others only claim, extend
-- their own leases and renew their rows. Leadership is a row with an expiry, taken or
-- renewed by the heartbeat's one statement: no advisory lock (a stranger could hold
-- it), no transaction held open (it would hold the xmin horizon back).
-- Runs again over itself.

CREATE UNLOGGED TABLE IF NOT EXISTS pgbus.leader (
    one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
    worker     text        NOT NULL,
    elected_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);
REVOKE ALL ON pgbus.leader FROM PUBLIC;

-- Renews the bus's row in pgbus.consumers (as pgbus.heartbeat does) and, unless p_lead_ms
-- is NULL, takes or renews leadership for p_lead_ms when nobody else holds it live.
-- Returns the bus's subscriptions that no longer exist, whether it leads, and, for a
-- leader, the milliseconds until the earliest lease of any bus runs out (NULL: no
-- delivery is leased), so that it reaps when something is due and not on a timer; for a
-- follower, the milliseconds until the leadership runs out (a follower of a short
-- leadership runs for it then).
CREATE OR REPLACE FUNCTION pgbus.beat(
    p_id text, p_ttl_ms bigint, p_subscriptions text[], p_info text, p_awake boolean,
    p_lead_ms bigint)
RETURNS TABLE (missing text[], leads boolean, next_expiry_ms bigint, leader_expiry_ms bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_leads boolean := false;
BEGIN
    IF p_id IS NULL OR p_ttl_ms IS NULL OR p_ttl_ms < 0 OR p_lead_ms < 1 THEN
        RAISE EXCEPTION 'pgbus.beat: the worker id, a time to live of at least 0 ms and a '
                        'leadership of at least 1 ms (or none) are needed'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pgbus.consumers AS c (id, awake, expires_at, subscriptions, info)
    VALUES (p_id, p_awake, now() + p_ttl_ms * interval '1 millisecond', p_subscriptions, p_info)
    ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    IF p_lead_ms IS NOT NULL THEN
        INSERT INTO pgbus.leader AS l (one, worker, elected_at, expires_at)
        VALUES (true, p_id, clock_timestamp(), clock_timestamp() + p_lead_ms * interval '1 millisecond')
        ON CONFLICT (one) DO UPDATE
            SET worker = EXCLUDED.worker,
                elected_at = CASE WHEN l.worker = EXCLUDED.worker THEN l.elected_at
                                  ELSE EXCLUDED.elected_at END,
                expires_at = EXCLUDED.expires_at
            WHERE l.worker = EXCLUDED.worker OR l.expires_at < clock_timestamp();
        v_leads := FOUND;
    END IF;
    RETURN QUERY SELECT
        ARRAY(SELECT n FROM unnest(p_subscriptions) AS n
              WHERE NOT EXISTS (SELECT 1 FROM pgbus.subscriptions AS s WHERE s.name = n)
              ORDER BY n),
        v_leads,
        CASE WHEN v_leads THEN
            (SELECT greatest(0, ceil(extract(epoch FROM d.locked_until - clock_timestamp()) * 1000))::bigint
             FROM pgbus.deliveries AS d
             WHERE d.status = 'processing'
             ORDER BY d.locked_until
             LIMIT 1)
        END,
        CASE WHEN NOT v_leads THEN
            (SELECT greatest(0, ceil(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000))::bigint
             FROM pgbus.leader AS l)
        END;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.beat(text, bigint, text[], text, boolean, bigint) FROM PUBLIC;

-- Gives up the bus's leadership, if it holds it, with a notification ('leader' on the
-- bus's channel), so a follower takes over at once instead of when the leadership runs
-- out. A bus calls it as its shutdown begins. Returns whether it led.
CREATE OR REPLACE FUNCTION pgbus.resign(p_id text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    DELETE FROM pgbus.leader WHERE worker = p_id;
    IF FOUND THEN
        PERFORM pg_notify('pgbus', 'leader');
        RETURN true;
    END IF;
    RETURN false;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.resign(text) FROM PUBLIC;

-- Removes a bus from pgbus.consumers at its shutdown, and gives up its leadership if it
-- still holds it (pgbus.resign). Returns whether its row was there.
CREATE OR REPLACE FUNCTION pgbus.leave(p_id text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_was boolean;
BEGIN
    DELETE FROM pgbus.consumers WHERE id = p_id;
    v_was := FOUND;
    PERFORM pgbus.resign(p_id);
    RETURN v_was;
END
$$;

-- Whoever may renew its heartbeat may beat.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS role
        FROM pg_catalog.pg_proc AS p,
             pg_catalog.aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgbus.heartbeat(text, bigint, text[], text, boolean)'::regprocedure
          AND a.grantee <> 0 AND a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.beat(text, bigint, text[], text, '
                       'boolean, bigint) TO %s', r.role);
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.resign(text) TO %s', r.role);
        EXECUTE format('GRANT SELECT ON pgbus.leader TO %s', r.role);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION pgbus.grant_consumer(consumer regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', consumer);
    EXECUTE format('GRANT SELECT ON pgbus.events, pgbus.settings, pgbus.deliveries, '
                   'pgbus.delivery_failures, pgbus.consumers, pgbus.subscriptions, '
                   'pgbus.leader TO %s',
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
                   'pgbus.beat(text, bigint, text[], text, boolean, bigint), '
                   'pgbus.leave(text), '
                   'pgbus.resign(text), '
                   'pgbus.join_subscription(text, text[], integer, boolean, text), '
                   'pgbus.sweep(bigint, integer, bigint) TO %s', consumer);
END
$$;
