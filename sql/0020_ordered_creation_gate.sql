-- pgbus schema, version 20: a new ordered subscription is a settings change.
--
-- 1. Creating an ordered subscription takes the configuration gate exclusively, as a
--    settings change does. A keyed publisher holds the gate (shared) from its first keyed
--    event to its commit, and decides at each event whether an ordered subscription
--    exists; an ordered subscription created between two events of one transaction gave
--    the later one a key position and the earlier one none, and a batch puts events
--    without a position after those with one: the new subscription received the
--    transaction's events of a key in reverse. Now the creation waits for keyed publishers
--    under way and takes its creation snapshot after them (their events are not the new
--    subscription's), and publishers that start after it wait for its commit. A trigger,
--    so that a row written by raw SQL waits too.
-- 2. pgbus.join_subscription returns at once for a subscription that exists: a bus
--    joining its ordered subscription does not wait behind publishers.
--
-- Every statement can run again.

-- 1.
--
-- The creation snapshot (`created_in`) is taken again after the gate: the column's default
-- was computed before the trigger waited, and would still list the publishers it waited
-- for as running, handing their events without positions to the new subscription. In
-- READ COMMITTED only, as for a settings change: a snapshot older than the statement
-- could list as running a keyed publisher that committed before the gate was taken.
CREATE OR REPLACE FUNCTION pgbus.gate_new_ordered() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM pgbus.require_read_committed('creating an ordered subscription');
    PERFORM pgbus.lock_config(true);
    NEW.created_in := pgbus.snapshot_of_others();
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.gate_new_ordered() FROM PUBLIC;

DROP TRIGGER IF EXISTS subscriptions_gate_new_ordered ON pgbus.subscriptions;
CREATE TRIGGER subscriptions_gate_new_ordered
    BEFORE INSERT ON pgbus.subscriptions
    FOR EACH ROW
    WHEN (NEW.ordered)
    EXECUTE FUNCTION pgbus.gate_new_ordered();

-- 2. The trigger fires before ON CONFLICT looks, so a subscription that exists is
-- answered first (a concurrent creation of the same name still ends in DO NOTHING).
CREATE OR REPLACE FUNCTION pgbus.join_subscription(
    p_name text, p_patterns text[], p_max_attempts integer, p_ordered boolean, p_on_dead text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pgbus.subscriptions AS s WHERE s.name = p_name) THEN
        RETURN false;
    END IF;
    INSERT INTO pgbus.subscriptions (name, patterns, max_attempts, ordered, on_dead)
    VALUES (p_name, p_patterns, p_max_attempts, p_ordered, p_on_dead)
    ON CONFLICT (name) DO NOTHING;
    RETURN FOUND;
END
$$;

