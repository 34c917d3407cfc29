-- pgbus schema, version 15: what the model checker found (models/, and docs/ARCHITECTURE.md,
-- "Model-checked protocols").
--
-- pgbus.purge_dead locked the keys of the dead heads its first statement saw, then
-- deleted every dead letter in a later statement, whose fresh snapshot also saw heads
-- that had died in between: such a head was deleted, and its key's next delivery
-- promoted, under no key lock. A publisher holding that key's lock had filed its
-- delivery behind the dead head (which it saw), and the purge, which could not see that
-- delivery yet, promoted nothing: the key was left with a pending delivery and no head
-- until the repair check (tests/purge_races.rs). Now the purge reads the dead heads
-- again after each round of locks until a read finds no key it has not locked, and its
-- delete takes a dead head only under its key's lock: a head that dies after the last
-- read stays a dead letter for the next purge. A second round of locks is not in the
-- sorted order of the first, so it can meet a publisher of several keys in a deadlock,
-- which PostgreSQL breaks by failing one of the two (it happens only when a head dies
-- during the purge; the purge can be run again).
CREATE OR REPLACE FUNCTION pgbus.purge_dead(p_subscription text, p_event_id text)
RETURNS TABLE (purged bigint, failures bigint, promoted bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_subs text[] := '{}';
    v_keys text[] := '{}';
    v_new_subs text[];
    v_new_keys text[];
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.purge_dead');
    PERFORM pgbus.lock_config(false);
    LOOP
        -- Each read is a statement of its own: it sees the heads that died since the
        -- last one, and their keys are locked before anything is deleted.
        SELECT array_agg(d.subscription), array_agg(d.ordering_key) INTO v_new_subs, v_new_keys
        FROM pgbus.deliveries AS d
        WHERE d.status = 'dead' AND d.ordering_key IS NOT NULL AND d.is_head
          AND (p_subscription IS NULL OR d.subscription = p_subscription)
          AND (p_event_id IS NULL OR d.event_seq = (SELECT e.seq FROM pgbus.events AS e WHERE e.id = p_event_id))
          AND NOT EXISTS (SELECT 1 FROM unnest(v_subs, v_keys) AS l(s, k)
                          WHERE l.s = d.subscription AND l.k = d.ordering_key);
        EXIT WHEN v_new_subs IS NULL;
        PERFORM pgbus.lock_keys(v_new_subs, v_new_keys);
        v_subs := v_subs || v_new_subs;
        v_keys := v_keys || v_new_keys;
    END LOOP;
    RETURN QUERY
    WITH gone AS (
      DELETE FROM pgbus.deliveries AS d
      WHERE d.status = 'dead'
        AND (p_subscription IS NULL OR d.subscription = p_subscription)
        AND (p_event_id IS NULL OR d.event_seq = (SELECT e.seq FROM pgbus.events AS e WHERE e.id = p_event_id))
        -- A head only under its key's lock.
        AND (d.ordering_key IS NULL OR NOT d.is_head
             OR EXISTS (SELECT 1 FROM unnest(v_subs, v_keys) AS l(s, k)
                        WHERE l.s = d.subscription AND l.k = d.ordering_key))
      RETURNING d.subscription, d.event_seq, d.ordering_key, d.is_head
    ),
    history AS (
      DELETE FROM pgbus.delivery_failures AS f
      USING gone AS g
      WHERE f.subscription = g.subscription AND f.event_seq = g.event_seq
      RETURNING 1
    ),
    heads AS (
      UPDATE pgbus.deliveries AS d SET is_head = true
      FROM (SELECT DISTINCT g.subscription, g.ordering_key FROM gone AS g
            WHERE g.ordering_key IS NOT NULL AND g.is_head) AS v
      WHERE d.subscription = v.subscription
        AND d.event_seq = pgbus.next_of_key(v.subscription, v.ordering_key)
      RETURNING 1
    ),
    wake AS (
      SELECT pg_notify('pgbus', '') FROM (SELECT 1 FROM heads LIMIT 1) AS x
    )
    SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM history),
           (SELECT count(*) FROM heads) + 0 * (SELECT count(*) FROM wake);
END
$$;
