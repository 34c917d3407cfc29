-- pgbus schema, version 22: the log runs its per-row ordering trigger only where an
-- ordered subscription exists.
--
-- `events_order_key` runs for every keyed row (a PL/pgSQL call, the configuration gate, a
-- probe for an ordered subscription): 58% of a keyed row's cost in a publish_batch, paid
-- by databases that order nothing. Now:
--
-- 1. A guard trigger that is always there refuses a forged `xid` and drops a forged
--    `key_pos`. Its WHEN clause is evaluated without calling PL/pgSQL; an honest row never
--    calls it. It is named to fire before `events_order_key` (triggers fire in name
--    order), so a position that trigger draws is never dropped.
-- 2. `events_order_key` exists while some subscription is or was ordered: the first
--    subscription that becomes ordered (created ordered, or changed to ordered, by any
--    path, raw SQL included) creates it. The invariant: an ordered subscription exists
--    only where the trigger exists. Creating the trigger takes SHARE ROW EXCLUSIVE on the
--    log, so it waits for every transaction that has inserted an event to end, and every
--    insert after it fires the trigger; the subscription's creation snapshot (or the
--    settings change's batch) comes after that wait.
-- 3. While the trigger does not exist, keyed publishers no longer hold the configuration
--    gate, so a change that takes the gate exclusively (`lock_config(true)`: a settings
--    change, an ordered subscription's creation) first takes the same lock on the log:
--    it waits for the publishers under way, as the gate made it wait for keyed ones
--    before. Lock order: the gate, then the log. A publisher without the trigger takes
--    only the log's lock and never waits for the gate while holding it; with the trigger,
--    a change never needs the log's lock. `try_lock_config` reports the log's writers in
--    the way too.
-- 4. `lock_publish_keys` (a publish_batch of several events) first fixes the trigger's
--    existence for its transaction (the log's ROW EXCLUSIVE lock, which its insert takes
--    anyway), and returns at once when the trigger does not exist: no event of the batch
--    can need a position, and no ordered subscription can appear before it commits.
--    Otherwise it takes the gate and the stripes as before (the log, then the gate: the
--    order every publisher keeps). Under REPEATABLE READ or SERIALIZABLE the answer is
--    the snapshot's: a trigger created between the snapshot and the lock is missed
--    there, and the batch's rows then take their stripes row by row, as a raw multi-row
--    INSERT does (docs/ARCHITECTURE.md: two such batches over the same keys in opposite
--    orders may deadlock, and PostgreSQL ends one).
--
-- The trigger is kept once created: dropping it would need the log's lock again, and a
-- subscription turned back to unordered leaves migration 18's cost (one probe per keyed
-- row), not a wrong result.
--
-- Every statement can run again.

LOCK TABLE pgbus.events IN ACCESS EXCLUSIVE MODE;

-- Whether the log has its ordering trigger. In READ COMMITTED a statement's snapshot
-- sees a trigger committed before it; callers hold a lock that keeps the answer from
-- changing under them where it matters (see above).
CREATE OR REPLACE FUNCTION pgbus.orders_keys() RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pgbus, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                   WHERE t.tgrelid = 'pgbus.events'::pg_catalog.regclass
                     AND t.tgname = 'events_order_key')
$$;

-- 1. The guard.
CREATE OR REPLACE FUNCTION pgbus.refuse_forged() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF NEW.xid IS DISTINCT FROM pg_current_xact_id() THEN
        RAISE EXCEPTION 'pgbus.events.xid is set by pgbus: leave it out of the insert'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'xid';
    END IF;
    NEW.key_pos := NULL;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.refuse_forged() FROM PUBLIC;

DROP TRIGGER IF EXISTS events_guard ON pgbus.events;
CREATE TRIGGER events_guard
    BEFORE INSERT ON pgbus.events
    FOR EACH ROW
    WHEN (NEW.key_pos IS NOT NULL
          OR NEW.xid IS DISTINCT FROM pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION pgbus.refuse_forged();

-- 2. The ordering trigger, created where it is needed. Its function (pgbus.order_key,
-- migration 18) is unchanged.
CREATE OR REPLACE FUNCTION pgbus.ensure_order_key_trigger() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF pgbus.orders_keys() THEN
        RETURN;
    END IF;
    LOCK TABLE pgbus.events IN SHARE ROW EXCLUSIVE MODE;
    IF pgbus.orders_keys() THEN
        RETURN;
    END IF;
    BEGIN
        CREATE TRIGGER events_order_key
            BEFORE INSERT ON pgbus.events
            FOR EACH ROW
            WHEN (NEW.ordering_key IS NOT NULL OR NEW.aggregate_id IS NOT NULL)
            EXECUTE FUNCTION pgbus.order_key();
    EXCEPTION WHEN duplicate_object THEN
        -- Created by a transaction that committed after this one's snapshot (a caller
        -- outside READ COMMITTED): it is there, which is all that is asked.
        NULL;
    END;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.ensure_order_key_trigger() FROM PUBLIC;

DROP TRIGGER IF EXISTS events_order_key ON pgbus.events;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pgbus.subscriptions AS s WHERE s.ordered) THEN
        PERFORM pgbus.ensure_order_key_trigger();
    END IF;
END
$$;

-- Creating an ordered subscription (migration 20's gate): the gate and the log's lock,
-- the trigger, then the creation snapshot.
CREATE OR REPLACE FUNCTION pgbus.gate_new_ordered() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM pgbus.require_read_committed('creating an ordered subscription');
    PERFORM pgbus.lock_config(true);
    PERFORM pgbus.ensure_order_key_trigger();
    NEW.created_in := pgbus.snapshot_of_others();
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.gate_new_ordered() FROM PUBLIC;

-- Changing a subscription to ordered, by try_configure_subscription (which holds the gate
-- and, without the trigger, the log's lock already) or by raw SQL.
CREATE OR REPLACE FUNCTION pgbus.ordered_needs_trigger() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM pgbus.ensure_order_key_trigger();
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.ordered_needs_trigger() FROM PUBLIC;

DROP TRIGGER IF EXISTS subscriptions_ordered_needs_trigger ON pgbus.subscriptions;
CREATE TRIGGER subscriptions_ordered_needs_trigger
    BEFORE UPDATE OF ordered ON pgbus.subscriptions
    FOR EACH ROW
    WHEN (NEW.ordered AND NOT OLD.ordered)
    EXECUTE FUNCTION pgbus.ordered_needs_trigger();

-- 3. The exclusive gate waits for the log's writers while the trigger does not exist.
CREATE OR REPLACE FUNCTION pgbus.lock_config(exclusive boolean) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF exclusive THEN
        LOCK TABLE pgbus.config_gate IN EXCLUSIVE MODE;
        IF NOT pgbus.orders_keys() THEN
            LOCK TABLE pgbus.events IN SHARE ROW EXCLUSIVE MODE;
        END IF;
    ELSE
        LOCK TABLE pgbus.config_gate IN ROW EXCLUSIVE MODE;
    END IF;
END
$$;

-- Migration 13's report of who is in the way, with the log's writers (a lock on the log
-- that conflicts with SHARE ROW EXCLUSIVE) beside the gate's holders.
CREATE OR REPLACE FUNCTION pgbus.try_lock_config(wait_ms integer) RETURNS jsonb
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
            AND (l.relation = 'pgbus.config_gate'::regclass
                 OR (l.relation = 'pgbus.events'::regclass
                     AND l.mode NOT IN ('AccessShareLock', 'RowShareLock')
                     AND NOT pgbus.orders_keys()))
            AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid()
          GROUP BY l.pid, a.usename, a.application_name, a.xact_start) AS h;
    RETURN v_sessions;
END
$$;

-- 4. A batch's keys.
CREATE OR REPLACE FUNCTION pgbus.lock_publish_keys(names text[], keys text[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
DECLARE
    v_any_order boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    LOCK TABLE pgbus.events IN ROW EXCLUSIVE MODE;
    IF NOT pgbus.orders_keys() THEN
        RETURN;
    END IF;
    PERFORM pgbus.lock_config(false);
    PERFORM 1 FROM pgbus.publish_stripes AS k
    WHERE k.stripe = ANY (ARRAY(
        SELECT (hashtextextended(t.k, 7305) & 65535)::integer
        FROM unnest(names, keys) AS t(n, k)
        WHERE t.k IS NOT NULL
          AND (v_any_order OR EXISTS (SELECT 1 FROM pgbus.subscriptions_matching(t.n) AS m
                                      WHERE m.ordered))))
    ORDER BY k.stripe
    FOR NO KEY UPDATE;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.lock_publish_keys(text[], text[]) FROM PUBLIC;

GRANT EXECUTE ON FUNCTION pgbus.orders_keys() TO PUBLIC;
