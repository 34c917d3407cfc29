-- pgbus schema, version 8: replay into an ordered subscription keeps each key's order.
--
-- Replayed deliveries used to be created without a key, so an ordered subscription got a
-- key's replayed events all at once. Now a replay goes through what the fan-out does:
-- under the configuration lock (shared), it locks the keys of the replayed events, and
-- files each keyed delivery behind its key: in event order among themselves, after what
-- the key already has waiting, and as the head only where the key has none.

CREATE FUNCTION pgbus.replay(
    p_subscription text,
    p_since timestamptz,
    p_until timestamptz,
    p_pattern text)
RETURNS TABLE (found boolean, matched bigint, created bigint, woke bigint)
LANGUAGE plpgsql SET jit = off AS $$
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
