-- pgbus schema, version 3: least-privilege roles.
--
-- A publisher needs only to write events; a consumer (a running bus) only to claim and
-- settle deliveries. The work the triggers do on a publisher's behalf (creating the
-- deliveries, reading the subscriptions and live consumers to decide on a notification)
-- runs with the rights of the schema's owner: the trigger functions are SECURITY
-- DEFINER, with a fixed search_path so that no caller can slip in objects of its own.
--
--   SELECT pgbus.grant_publisher('orders_service');
--   SELECT pgbus.grant_consumer('mailer');
--
-- Run them as the schema's owner (the role that ran `pgbus migrate`), again after a
-- migration that adds tables or sequences.

ALTER FUNCTION pgbus.fan_out() SECURITY DEFINER SET search_path = pg_catalog, pgbus;
ALTER FUNCTION pgbus.notify_at_commit() SECURITY DEFINER SET search_path = pg_catalog, pgbus;

-- The log is insert-only. Publishing's ON CONFLICT ... DO UPDATE SET id = EXCLUDED.id (a
-- no-op that makes a conflicting row visible) needs UPDATE on the id column, which would
-- let a publisher rename events; this trigger refuses every update that changes a row.
CREATE FUNCTION pgbus.events_are_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'pgbus.events is insert-only: event % cannot be changed', OLD.id
        USING ERRCODE = 'insufficient_privilege';
END
$$;

CREATE TRIGGER events_immutable
    BEFORE UPDATE ON pgbus.events
    FOR EACH ROW
    WHEN (OLD IS DISTINCT FROM NEW)
    EXECUTE FUNCTION pgbus.events_are_immutable();

-- A publisher: publish with pgbus::publish / publish_batch, pgbus.publish(...) or a plain
-- INSERT INTO pgbus.events. It reads the log (idempotency compares an id's content) and
-- cannot touch deliveries, subscriptions or consumers.
CREATE FUNCTION pgbus.grant_publisher(publisher regrole) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', publisher);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE (id) ON pgbus.events TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish(text, jsonb, jsonb, text, text, '
                   'text, text, text, text, integer, timestamptz) TO %s', publisher);
END
$$;

-- A consumer: what a running bus does. Claim, settle, extend and reap deliveries (with
-- their failure history), register its subscriptions and itself, read the events it
-- delivers, and sweep events past their retention. Operator commands (status, dead
-- letters, replay, dropping subscriptions) are for the schema's owner.
CREATE FUNCTION pgbus.grant_consumer(consumer regrole) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', consumer);
    -- UPDATE (id): the sweep locks the events it deletes (FOR UPDATE needs it); the
    -- trigger above still refuses any change.
    EXECUTE format('GRANT SELECT, DELETE, UPDATE (id) ON pgbus.events TO %s', consumer);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON pgbus.deliveries, '
                   'pgbus.delivery_failures, pgbus.consumers TO %s', consumer);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON pgbus.subscriptions TO %s', consumer);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgbus TO %s', consumer);
END
$$;

REVOKE EXECUTE ON FUNCTION pgbus.grant_publisher(regrole), pgbus.grant_consumer(regrole)
    FROM PUBLIC;
