-- pgbus schema, version 25: a bus's row in pgbus.consumers says when it last beat.
--
-- The row kept only its expiry, and readers (`admin::consumers`, the dashboard) took the
-- last heartbeat to be the expiry less the time to live of the default leader lease. A
-- bus with another leader lease beats on another schedule with another time to live, so
-- what they showed was wrong for it. `beat_at` is set by a trigger on every write of the
-- row (`pgbus.beat`, `pgbus.heartbeat`, and the writes of buses of earlier releases),
-- to the writing transaction's time, which is the time the expiry is computed from.
--
-- Every statement can run again.

-- A row written before this migration reads as having beaten at it: it beats again within
-- its schedule.
ALTER TABLE pgbus.consumers
    ADD COLUMN IF NOT EXISTS beat_at timestamptz NOT NULL DEFAULT pg_catalog.now();

CREATE OR REPLACE FUNCTION pgbus.consumer_beat_at() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    NEW.beat_at := now();
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.consumer_beat_at() FROM PUBLIC;

DROP TRIGGER IF EXISTS consumers_beat_at ON pgbus.consumers;
CREATE TRIGGER consumers_beat_at BEFORE INSERT OR UPDATE ON pgbus.consumers
    FOR EACH ROW EXECUTE FUNCTION pgbus.consumer_beat_at();
