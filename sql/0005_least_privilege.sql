-- pgbus schema, version 5: least privilege that holds, and heads that survive operators,
-- isolation levels and concurrent configuration changes.
--
-- 1. Every owner-rights (SECURITY DEFINER) function pins its search_path with pg_temp
--    LAST. PostgreSQL searches pg_temp first for relations and types unless it is named,
--    so a caller could otherwise shadow `text` or a table with an object of its own and
--    have it used with the owner's rights.
-- 2. Publishers may insert only the publishable columns of the log (not seq, not
--    created_at); consumers may no longer delete from it: the retention sweep is an
--    owner-rights function that deletes only what the retention allows.
-- 3. No setting a caller can change alters what owner-rights code does (the key-lock
--    switch is gone).
-- 4. A subscription's settings change only under an exclusive configuration lock that
--    every fan-out and settlement takes shared, so a change never splits one publish or
--    settlement between two modes, and converts the backlog in one step.
-- 5. Heads are decided from what the key locks protect, whatever the caller's isolation
--    level; every path that removes a head promotes the next one in the same transaction.

-- The advisory lock that serializes changes of subscription settings ("pgbus_cf").
-- Fan-out, settlement, reaping and head repairs take it shared (cheap, never waiting on
-- each other); changing a subscription takes it exclusively, so it waits for every
-- transaction that read the old settings to end, and those after it read the new ones.
CREATE FUNCTION pgbus.lock_config(exclusive boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF exclusive THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(8099550711435453286);
    ELSE
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(8099550711435453286);
    END IF;
END
$$;

-- Raised where a function decides from the latest committed state and so needs a fresh
-- snapshot per statement.
CREATE FUNCTION pgbus.require_read_committed(what text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION '% must run in a READ COMMITTED transaction (this one is %)',
            what, pg_catalog.current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
END
$$;

-- Keys are always locked: no setting turns this off.
CREATE OR REPLACE FUNCTION pgbus.lock_keys(subs text[], keys text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(h)
    FROM (SELECT DISTINCT pg_catalog.hashtextextended(s || pg_catalog.chr(31) || k, 7305) AS h
          FROM unnest(subs, keys) AS t(s, k)
          WHERE k IS NOT NULL
          ORDER BY 1) AS sorted;
END
$$;

-- The awake check, ordered with the consumers' sleep marks through the wake lock ("pgbus_wk").
-- A publisher takes it shared just before reading the consumers and holds it to the end
-- of its commit (through synchronous replication and any deferred trigger after this
-- one); a consumer falling asleep takes it exclusively before its mark. So a publisher
-- that saw a consumer awake (and sent nothing) has committed before that consumer's
-- mark, and the claim the consumer runs right after the mark finds its events; a
-- publisher after the mark sees it asleep. Under REPEATABLE READ or SERIALIZABLE the
-- check would read the consumers as of an older snapshot, so it always notifies.
CREATE OR REPLACE FUNCTION pgbus.notify_at_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM pg_catalog.set_config('pgbus.notify_queued', 'off', true);
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(8099550711435458411);
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed'
       OR pgbus.notify_needed() THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
    END IF;
    RETURN NULL;
END
$$;

-- A consumer falls asleep (see notify_at_commit).
CREATE FUNCTION pgbus.mark_asleep(p_id text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(8099550711435458411);
    UPDATE pgbus.consumers SET awake = false WHERE id = p_id;
END
$$;

-- The subscriptions an event name matches, with their ordering. A plain SQL function
-- taking a column, so that the planner inlines it into the fan-out's statements (whose
-- plans the trigger caches) instead of planning it on every call; migration 6 replaces
-- its body with an index lookup.
CREATE FUNCTION pgbus.subscriptions_matching(event_name text)
RETURNS TABLE (subscription text, ordered boolean)
LANGUAGE sql STABLE AS $$
    SELECT s.name, s.ordered
    FROM pgbus.subscriptions AS s
    WHERE EXISTS (SELECT 1 FROM unnest(s.patterns) AS p
                  WHERE pgbus.pattern_matches(p, subscriptions_matching.event_name))
$$;

-- Fan-out, rewritten:
-- * it takes the configuration lock shared before reading the subscriptions, so their
--   ordering cannot change until this transaction ends: the unordered and the ordered
--   statements below see the same ordered flags, and no publish is split between two
--   modes;
-- * under REPEATABLE READ or SERIALIZABLE, whose snapshot may be older than a change of
--   the settings, it locks the subscriptions it matched FOR SHARE: one changed since
--   the snapshot raises a serialization failure (40001: retry the transaction) instead
--   of filing deliveries under stale settings;
-- * heads are decided from what the key locks protect, not from the snapshot (below).
-- With no ordered subscription and READ COMMITTED it is two statements, as before.
CREATE OR REPLACE FUNCTION pgbus.fan_out() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp SET jit = off AS $$
DECLARE
    v_subs text[];
    v_keys text[];
    v_pos bigint;
    v_first record;
    v_lock_timeout text;
    v_snapshot boolean := pg_catalog.current_setting('transaction_isolation') <> 'read committed';
BEGIN
    PERFORM pgbus.lock_config(false);

    IF v_snapshot THEN
        -- Fails with 40001 if a matched subscription changed since this snapshot.
        PERFORM 1 FROM pgbus.subscriptions AS s
        WHERE s.name IN (SELECT m.subscription FROM new_events AS e,
                                pgbus.subscriptions_matching(e.event_name) AS m)
        ORDER BY s.name
        FOR SHARE;
    END IF;

    -- Unordered subscriptions, and events without a key: every delivery is a head.
    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at)
    SELECT m.subscription, e.seq, e.available_at
    FROM new_events AS e, pgbus.subscriptions_matching(e.event_name) AS m
    WHERE NOT (m.ordered
               AND pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) IS NOT NULL);

    IF NOT EXISTS (SELECT 1 FROM pgbus.subscriptions WHERE ordered) THEN
        RETURN NULL;
    END IF;

    -- Ordered: lock the keys first, then decide heads with a fresh snapshot (the next
    -- statement), which sees every earlier holder's committed rows.
    SELECT array_agg(k.sub), array_agg(k.key) INTO v_subs, v_keys
    FROM (SELECT DISTINCT m.subscription AS sub,
                 pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
          FROM new_events AS e, pgbus.subscriptions_matching(e.event_name) AS m
          WHERE m.ordered) AS k
    WHERE k.key IS NOT NULL;
    IF v_subs IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM pgbus.lock_keys(v_subs, v_keys);
    v_pos := nextval('pgbus.key_pos_seq');

    -- Under READ COMMITTED this statement's snapshot is fresh (taken after the locks):
    -- a key has a head exactly when this snapshot shows one. Under REPEATABLE READ or
    -- SERIALIZABLE the snapshot is the transaction's, possibly older than the lock, so
    -- the deliveries go in as followers and each key's first one then tries to become
    -- the head, checked at once against the one-head constraint, which reads the latest
    -- committed rows: it becomes the head exactly when the key has none.
    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at, ordering_key, is_head, key_pos)
    SELECT o.sub, o.seq, o.available_at, o.key,
           NOT v_snapshot
             AND row_number() OVER (PARTITION BY o.sub, o.key ORDER BY o.seq) = 1
             AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                             WHERE d.subscription = o.sub AND d.ordering_key = o.key AND d.is_head),
           v_pos
    FROM (SELECT m.subscription AS sub, e.seq, e.available_at,
                 pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
          FROM new_events AS e, pgbus.subscriptions_matching(e.event_name) AS m
          WHERE m.ordered) AS o
    WHERE o.key IS NOT NULL;

    IF v_snapshot THEN
        v_lock_timeout := pg_catalog.current_setting('lock_timeout');
        FOR v_first IN
            SELECT DISTINCT ON (d.subscription, d.ordering_key)
                   d.subscription AS sub, d.ordering_key AS key, d.event_seq AS seq
            FROM pgbus.deliveries AS d
            JOIN new_events AS e ON d.event_seq = e.seq
            WHERE d.ordering_key IS NOT NULL
            ORDER BY d.subscription, d.ordering_key, d.event_seq
        LOOP
            -- The check may have to wait for a transaction that is changing the key's
            -- head row (a claim), whose own check at commit may wait for this one: it
            -- waits up to 500 ms (less than the deadlock detector's 1 s, so this side
            -- gives way), and otherwise reports a serialization failure instead of a
            -- deadlock.
            BEGIN
                PERFORM pg_catalog.set_config('lock_timeout', '500ms', true);
                UPDATE pgbus.deliveries AS d SET is_head = true
                WHERE d.subscription = v_first.sub AND d.event_seq = v_first.seq;
                SET CONSTRAINTS pgbus.deliveries_one_head IMMEDIATE;
                SET CONSTRAINTS pgbus.deliveries_one_head DEFERRED;
                PERFORM pg_catalog.set_config('lock_timeout', v_lock_timeout, true);
            EXCEPTION
                WHEN exclusion_violation THEN
                    NULL; -- the key has a head: this delivery waits behind it
                WHEN lock_not_available THEN
                    RAISE EXCEPTION 'could not serialize access: the head of ordering key % is being changed concurrently', v_first.key
                        USING ERRCODE = 'serialization_failure', HINT = 'retry the transaction';
            END;
        END LOOP;
    END IF;
    RETURN NULL;
END
$$;

-- Settlement, reaping and head repairs keep migration 4's bodies, renamed, behind
-- wrappers that first refuse any isolation level but READ COMMITTED and take the
-- configuration lock shared, so a concurrent change of ordering is wholly before or
-- wholly after them. The wrapped function runs as a statement after the lock, with a
-- snapshot that sees every change committed before it.
ALTER FUNCTION pgbus.settle(text[], bigint[], integer[], text[], bigint[], integer[], text[],
                            bigint[], boolean[], text[], bigint[], integer[], text)
    RENAME TO settle_unlocked;
CREATE FUNCTION pgbus.settle(
    ack_subs text[], ack_seqs bigint[], ack_attempts integer[],
    fail_subs text[], fail_seqs bigint[], fail_attempts integer[], fail_errors text[],
    fail_delays_ms bigint[], fail_permanent boolean[],
    rel_subs text[], rel_seqs bigint[], rel_attempts integer[],
    worker text)
RETURNS TABLE (kind text, subscription text, event_seq bigint)
LANGUAGE plpgsql SET jit = off AS $$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.settle');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.settle_unlocked(
        ack_subs, ack_seqs, ack_attempts, fail_subs, fail_seqs, fail_attempts, fail_errors,
        fail_delays_ms, fail_permanent, rel_subs, rel_seqs, rel_attempts, worker);
END
$$;

ALTER FUNCTION pgbus.reap(integer) RENAME TO reap_unlocked;
CREATE FUNCTION pgbus.reap(max_rows integer)
RETURNS TABLE (returned bigint, dead bigint)
LANGUAGE plpgsql SET jit = off AS $$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.reap');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.reap_unlocked(max_rows);
END
$$;

ALTER FUNCTION pgbus.ensure_heads(text[], text[]) RENAME TO ensure_heads_unlocked;
CREATE FUNCTION pgbus.ensure_heads(subs text[], keys text[])
RETURNS TABLE (subscription text, ordering_key text, event_seq bigint)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.ensure_heads');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.ensure_heads_unlocked(subs, keys);
END
$$;

ALTER FUNCTION pgbus.skip_dead_head(text, text) RENAME TO skip_dead_head_unlocked;
CREATE FUNCTION pgbus.skip_dead_head(p_subscription text, p_key text)
RETURNS TABLE (skipped bigint, promoted bigint)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.skip_dead_head');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.skip_dead_head_unlocked(p_subscription, p_key);
END
$$;

-- Deletes dead letters (subscription and event id filters, NULL for all) with their
-- failure history. A dead letter that was its key's head hands the head to the key's
-- next delivery in the same transaction, so purging a blocked key unblocks it.
-- Returns deliveries deleted, history rows deleted, heads promoted.
CREATE FUNCTION pgbus.purge_dead(p_subscription text, p_event_id text)
RETURNS TABLE (purged bigint, failures bigint, promoted bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_subs text[];
    v_keys text[];
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.purge_dead');
    PERFORM pgbus.lock_config(false);
    SELECT array_agg(d.subscription), array_agg(d.ordering_key) INTO v_subs, v_keys
    FROM pgbus.deliveries AS d
    WHERE d.status = 'dead' AND d.ordering_key IS NOT NULL AND d.is_head
      AND (p_subscription IS NULL OR d.subscription = p_subscription)
      AND (p_event_id IS NULL OR d.event_seq = (SELECT seq FROM pgbus.events WHERE id = p_event_id));
    IF v_subs IS NOT NULL THEN
        PERFORM pgbus.lock_keys(v_subs, v_keys);
    END IF;
    RETURN QUERY
    WITH gone AS (
      DELETE FROM pgbus.deliveries AS d
      WHERE d.status = 'dead'
        AND (p_subscription IS NULL OR d.subscription = p_subscription)
        AND (p_event_id IS NULL OR d.event_seq = (SELECT seq FROM pgbus.events WHERE id = p_event_id))
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

-- Changes a subscription's settings (NULL: keep) as an operator action that is safe
-- against concurrent publishers, settlers and reapers: it takes the configuration lock
-- exclusively, so it waits for every transaction that read the old settings and the
-- ones after it read the new ones, and converts the backlog in the same transaction.
--
-- Ordering on: every waiting delivery of an event with a key joins its key, ordered by
--   event seq before anything published later; per key the oldest pending delivery is
--   the head. Dead letters join as skipped (a retry gives their key a head if it needs
--   one). Deliveries processing at the switch stay outside their key: they finish, or
--   are retried, as the unordered deliveries they were claimed as, and never hold a
--   key without a head.
-- Ordering off: every delivery leaves its key and becomes claimable.
-- Patterns apply to events published after the change.
-- Returns whether the subscription exists, and how many deliveries were converted.
CREATE FUNCTION pgbus.configure_subscription(
    p_name text,
    p_patterns text[] DEFAULT NULL,
    p_max_attempts integer DEFAULT NULL,
    p_ordered boolean DEFAULT NULL,
    p_on_dead text DEFAULT NULL)
RETURNS TABLE (found boolean, converted bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_was boolean;
    v_now boolean;
    v_converted bigint := 0;
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.configure_subscription');
    PERFORM pgbus.lock_config(true);
    SELECT s.ordered INTO v_was FROM pgbus.subscriptions AS s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::bigint;
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
    RETURN QUERY SELECT true, v_converted;
END
$$;

-- Settings the owner keeps for everyone: the shortest retention the sweep honours,
-- whoever asks for less.
CREATE TABLE pgbus.settings (
    only_row      boolean  PRIMARY KEY DEFAULT true CHECK (only_row),
    min_retention interval NOT NULL DEFAULT '1 hour' CHECK (min_retention >= '0'::interval)
);
INSERT INTO pgbus.settings DEFAULT VALUES;

-- One batch of the retention sweep, with the owner's rights, so that consumers need no
-- DELETE on the log: deletes at most max_rows events created before
-- now() - greatest(retention, settings.min_retention) that no delivery refers to, oldest
-- first, with their failure history. Runs only when it gets the advisory lock lock_key
-- (one sweep at a time). Returns whether it got the lock, events deleted, history rows
-- deleted.
CREATE FUNCTION pgbus.sweep(retention_ms bigint, max_rows integer, lock_key bigint)
RETURNS TABLE (got boolean, events bigint, failures bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp SET jit = off AS $$
DECLARE
    v_cutoff timestamptz;
BEGIN
    IF retention_ms IS NULL OR retention_ms < 0 OR max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION 'pgbus.sweep: retention must be at least 0 and max_rows at least 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT pg_catalog.pg_try_advisory_xact_lock(lock_key) THEN
        RETURN QUERY SELECT false, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    SELECT pg_catalog.now() - greatest(LEAST(retention_ms, 9000000000000000) * interval '1 millisecond',
                                       st.min_retention)
      INTO v_cutoff
    FROM pgbus.settings AS st;
    RETURN QUERY
    WITH doomed AS (
      SELECT e.seq FROM pgbus.events AS e
      WHERE e.created_at < v_cutoff
        AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d WHERE d.event_seq = e.seq)
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
REVOKE EXECUTE ON FUNCTION pgbus.sweep(bigint, integer, bigint) FROM PUBLIC;

-- Rows that no client can decode stay out of the log (new rows; existing ones are not
-- rechecked, and the claim dead-letters such a row alone).
ALTER TABLE pgbus.events
    ADD CONSTRAINT events_times_finite
        CHECK (isfinite(occurred_at) AND isfinite(available_at) AND isfinite(created_at)) NOT VALID;

-- The size limit for every writer, SQL included: payload and headers together at most
-- 16 MiB as stored jsonb (pg_column_size reads the datum's header: no parsing). The
-- library's own limit (1 MiB of JSON text by default) is checked before sending; this
-- one keeps a raw INSERT from growing every consumer that claims the row.
ALTER TABLE pgbus.events
    ADD CONSTRAINT events_size_limit
        CHECK (pg_column_size(payload) + pg_column_size(headers) <= 16777216) NOT VALID;

-- The grants, narrowed.
--
-- A publisher inserts the publishable columns only: not seq (OVERRIDING SYSTEM VALUE
-- would let it take sequence numbers from under every later publish) and not
-- created_at (the retention clock). It reads the log (idempotency compares an id's
-- content) and may "update" id to itself (ON CONFLICT ... DO UPDATE; the immutability
-- trigger refuses any real change).
CREATE OR REPLACE FUNCTION pgbus.grant_publisher(publisher regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', publisher);
    EXECUTE format('GRANT SELECT, UPDATE (id), INSERT (id, event_name, event_version, source, '
                   'aggregate_type, aggregate_id, correlation_id, causation_id, occurred_at, '
                   'payload, headers, available_at, ordering_key) ON pgbus.events TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish(text, jsonb, jsonb, text, text, '
                   'text, text, text, text, integer, timestamptz, text) TO %s', publisher);
END
$$;

-- A consumer: claims, settles, extends and reaps deliveries (with their failure
-- history), registers its subscriptions and itself, reads the events it delivers, and
-- sweeps through pgbus.sweep. It never deletes from the log and never inserts
-- deliveries (fan-out and replay do, with the owner's rights or as the owner).
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
END
$$;

-- Roles granted by earlier versions lose what they no longer need.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole AS role, a.privilege_type
        FROM pg_catalog.pg_class AS c, LATERAL pg_catalog.aclexplode(c.relacl) AS a
        WHERE c.oid = 'pgbus.events'::regclass
          AND a.grantee <> c.relowner AND a.grantee <> 0
          AND a.privilege_type IN ('INSERT', 'DELETE')
    LOOP
        IF r.privilege_type = 'INSERT' THEN
            EXECUTE format('REVOKE INSERT ON pgbus.events FROM %s', r.role);
            PERFORM pgbus.grant_publisher(r.role);
        ELSE
            EXECUTE format('REVOKE DELETE ON pgbus.events FROM %s', r.role);
            EXECUTE format('REVOKE INSERT ON pgbus.deliveries FROM %s', r.role);
            PERFORM pgbus.grant_consumer(r.role);
        END IF;
    END LOOP;
END
$$;
