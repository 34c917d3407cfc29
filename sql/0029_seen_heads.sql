-- pgbus schema, version 29: skip and redrive the head an operator saw, or nothing.
--
-- pgbus.skip_dead_head and pgbus.redrive_head act on whatever a key's head is when they
-- run. An operator who looked at a blocked key and clicked Skip acted on the head shown
-- then; a form sent again, or one sent from a page loaded before the head changed (it
-- was redriven, settled, skipped by someone else), skipped or redrove a head the operator
-- never saw. The two new functions take the event id of the head that was shown and act
-- only if it is still the key's head, in the state the action needs (dead, to skip; dead
-- or pending, to redrive). Otherwise they change nothing and say what the head is now,
-- so the caller can answer "changed since you loaded the page". Both are the operator's,
-- as the functions they sit beside are.
--
-- Every statement can run again.

-- The skip, on one named head (p_event_id) or on any dead head (NULL): the body of the
-- two-argument function, which now calls this one.
CREATE OR REPLACE FUNCTION pgbus.skip_dead_head_unlocked(p_subscription text, p_key text,
                                                         p_event_id text)
RETURNS TABLE (skipped bigint, promoted bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
DECLARE
    v_skipped bigint;
    v_promoted bigint;
BEGIN
    PERFORM pgbus.lock_keys(ARRAY[p_subscription], ARRAY[p_key]);
    UPDATE pgbus.deliveries AS d SET is_head = false
    WHERE d.subscription = p_subscription AND d.ordering_key = p_key
      AND d.is_head AND d.status = 'dead'
      AND (p_event_id IS NULL
           OR d.event_seq = (SELECT e.seq FROM pgbus.events AS e WHERE e.id = p_event_id))
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
$fn$;

CREATE OR REPLACE FUNCTION pgbus.skip_dead_head_unlocked(p_subscription text, p_key text)
RETURNS TABLE (skipped bigint, promoted bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM pgbus.skip_dead_head_unlocked(p_subscription, p_key, NULL);
END
$fn$;

-- What a key's head is now: its event's id and its state (no row: the key has none).
CREATE OR REPLACE FUNCTION pgbus.head_of_key(p_subscription text, p_key text)
RETURNS TABLE (head text, head_status text)
LANGUAGE sql STABLE SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
    SELECT e.id, d.status FROM pgbus.deliveries AS d
    LEFT JOIN pgbus.events AS e ON e.seq = d.event_seq
    WHERE d.subscription = p_subscription AND d.ordering_key = p_key AND d.is_head
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.head_of_key(text, text) FROM PUBLIC;

-- Skips the key's dead head if it is the event p_event_id. One row: what was skipped and
-- promoted (the events' ids; both NULL when nothing was done), and the key's head after
-- the call (its event id and state; NULL when the key has none).
CREATE OR REPLACE FUNCTION pgbus.skip_seen_head(p_subscription text, p_key text,
                                                p_event_id text)
RETURNS TABLE (skipped text, promoted text, head text, head_status text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
DECLARE
    v_skipped bigint;
    v_promoted bigint;
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.skip_seen_head');
    PERFORM pgbus.lock_config(false);
    SELECT s.skipped, s.promoted INTO v_skipped, v_promoted
    FROM pgbus.skip_dead_head_unlocked(p_subscription, p_key, p_event_id) AS s;
    RETURN QUERY
    SELECT (SELECT e.id FROM pgbus.events AS e WHERE e.seq = v_skipped),
           (SELECT e.id FROM pgbus.events AS e WHERE e.seq = v_promoted),
           h.head, h.head_status
    FROM (SELECT 1) AS one LEFT JOIN pgbus.head_of_key(p_subscription, p_key) AS h ON true;
END
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.skip_seen_head(text, text, text) FROM PUBLIC;

-- Redrives the key's head if it is the event p_event_id and dead or pending (as
-- pgbus.redrive_head: a dead head gets its attempts back, a head backing off is due at
-- once; notifies the buses). One row: `redriven` (0 or 1) and the key's head after the
-- call.
CREATE OR REPLACE FUNCTION pgbus.redrive_seen_head(p_subscription text, p_key text,
                                                   p_event_id text)
RETURNS TABLE (redriven bigint, head text, head_status text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
DECLARE
    v_redriven bigint;
BEGIN
    WITH done AS (
      UPDATE pgbus.deliveries AS d
      SET attempts = CASE WHEN d.status = 'dead' THEN 0 ELSE d.attempts END,
          status = 'pending', available_at = now(),
          locked_until = NULL, locked_by = NULL
      WHERE d.subscription = p_subscription AND d.ordering_key = p_key AND d.is_head
        AND d.status IN ('dead', 'pending')
        AND d.event_seq = (SELECT e.seq FROM pgbus.events AS e WHERE e.id = p_event_id)
      RETURNING 1
    )
    SELECT count(*) INTO v_redriven FROM done;
    IF v_redriven > 0 THEN
        PERFORM pg_notify('pgbus', '');
    END IF;
    RETURN QUERY
    SELECT v_redriven, h.head, h.head_status
    FROM (SELECT 1) AS one LEFT JOIN pgbus.head_of_key(p_subscription, p_key) AS h ON true;
END
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.redrive_seen_head(text, text, text) FROM PUBLIC;

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
                   'pgbus.skip_seen_head(text, text, text), '
                   'pgbus.ensure_heads(text[], text[]), '
                   'pgbus.retry_dead(text, text), '
                   'pgbus.redrive_head(text, text), '
                   'pgbus.redrive_seen_head(text, text, text), '
                   'pgbus.pause_subscription(text), '
                   'pgbus.resume_subscription(text) TO %s', operator);
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.grant_operator(regrole) FROM PUBLIC;

-- Whoever operates may act on the heads they saw.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS role
        FROM pg_catalog.pg_proc AS p,
             pg_catalog.aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgbus.purge_dead(text, text)'::regprocedure
          AND a.grantee <> 0 AND a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.skip_seen_head(text, text, text), '
                       'pgbus.redrive_seen_head(text, text, text) TO %s', r.role);
    END LOOP;
END
$$;
