-- pgbus schema, version 1: the event log, subscriptions, per-subscription deliveries,
-- failure history, live consumers, and the fan-out / cost-aware notify triggers.
--
-- Applied by pgbus::migrate inside a transaction under an advisory lock; the runner
-- creates the schema and pgbus.schema_migrations before it runs this file.

-- A UUIDv7 (RFC 9562) as text: time-ordered, so the ids of a busy log stay index-friendly.
CREATE FUNCTION pgbus.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    placing substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

-- Event and subscription names: 1 to 255 bytes, no white space, control characters or '*'.
CREATE FUNCTION pgbus.valid_name(name text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT octet_length(name) BETWEEN 1 AND 255 AND name !~ '[[:space:][:cntrl:]*]'
$$;

-- A pattern is '*' (every event), an exact name ('order.placed'), or a prefix followed by
-- '.*' ('order.*' matches 'order.placed' and 'order.line.added', not 'order').
CREATE FUNCTION pgbus.valid_pattern(pattern text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pattern = '*'
        OR pgbus.valid_name(pattern)
        OR (right(pattern, 2) = '.*' AND pgbus.valid_name(left(pattern, -2)))
$$;

CREATE FUNCTION pgbus.valid_patterns(patterns text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT cardinality(patterns) > 0
       AND NOT EXISTS (SELECT 1 FROM unnest(patterns) AS p
                       WHERE p IS NULL OR NOT pgbus.valid_pattern(p))
$$;

CREATE FUNCTION pgbus.pattern_matches(pattern text, event_name text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pattern = '*'
        OR pattern = event_name
        OR (right(pattern, 2) = '.*' AND starts_with(event_name, left(pattern, -1)))
$$;

-- The log: insert-only. seq orders events and keys their deliveries; id is the
-- idempotency key.
CREATE TABLE pgbus.events (
    seq            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id             text        NOT NULL DEFAULT pgbus.uuid_v7()::text,
    event_name     text        NOT NULL,
    event_version  integer     NOT NULL DEFAULT 1,
    source         text,
    aggregate_type text,
    aggregate_id   text,
    correlation_id text,
    causation_id   text,
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    payload        jsonb       NOT NULL DEFAULT '{}',
    headers        jsonb       NOT NULL DEFAULT '{}',
    available_at   timestamptz NOT NULL DEFAULT now(),
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT events_id_key UNIQUE (id),
    CONSTRAINT events_id_check CHECK (octet_length(id) BETWEEN 1 AND 255),
    CONSTRAINT events_event_name_check CHECK (pgbus.valid_name(event_name)),
    CONSTRAINT events_headers_check CHECK (jsonb_typeof(headers) = 'object')
);
CREATE INDEX events_created_at_idx ON pgbus.events (created_at);

CREATE TABLE pgbus.subscriptions (
    name         text        PRIMARY KEY,
    patterns     text[]      NOT NULL DEFAULT '{*}',
    max_attempts integer     NOT NULL DEFAULT 25,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT subscriptions_name_check CHECK (pgbus.valid_name(name)),
    CONSTRAINT subscriptions_patterns_check CHECK (pgbus.valid_patterns(patterns)),
    CONSTRAINT subscriptions_max_attempts_check CHECK (max_attempts >= 1)
);

-- The mutable delivery state: one narrow row per (subscription, event). Completed
-- deliveries are deleted. No foreign keys: the fan-out trigger is the only writer of new
-- rows, and a per-row key check would sit on the publish path.
CREATE TABLE pgbus.deliveries (
    subscription text        NOT NULL,
    event_seq    bigint      NOT NULL,
    status       text        NOT NULL DEFAULT 'pending',
    attempts     integer     NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL DEFAULT now(),
    locked_until timestamptz,
    locked_by    text,
    last_error   text,
    PRIMARY KEY (subscription, event_seq),
    CONSTRAINT deliveries_status_check CHECK (status IN ('pending', 'processing', 'dead'))
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.05);

-- The claim: due pending deliveries of one subscription, oldest first.
CREATE INDEX deliveries_claim_idx ON pgbus.deliveries (subscription, available_at, event_seq)
    WHERE status = 'pending';
-- The reaper: leases that ran out.
CREATE INDEX deliveries_reap_idx ON pgbus.deliveries (locked_until)
    WHERE status = 'processing';
-- Dead letters per subscription.
CREATE INDEX deliveries_dead_idx ON pgbus.deliveries (subscription, event_seq)
    WHERE status = 'dead';
-- The retention sweep: does any delivery still refer to this event?
CREATE INDEX deliveries_event_seq_idx ON pgbus.deliveries (event_seq);

-- One row per failed attempt: the forensics of retries and dead letters.
CREATE TABLE pgbus.delivery_failures (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription text        NOT NULL,
    event_seq    bigint      NOT NULL,
    attempt      integer     NOT NULL,
    error        text        NOT NULL,
    worker       text,
    failed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX delivery_failures_delivery_idx ON pgbus.delivery_failures (subscription, event_seq);

-- One row per running bus. Unlogged: after a crash the table is empty, which reads as
-- "no live consumer" and makes every publisher notify until buses re-register.
CREATE UNLOGGED TABLE pgbus.consumers (
    id            text        PRIMARY KEY,
    awake         boolean     NOT NULL DEFAULT false,
    expires_at    timestamptz NOT NULL,
    subscriptions text[]      NOT NULL DEFAULT '{}',
    started_at    timestamptz NOT NULL DEFAULT now(),
    info          text
);

-- Fan-out: one statement-level trigger creates every delivery of every new event.
CREATE FUNCTION pgbus.fan_out() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at)
    SELECT s.name, e.seq, e.available_at
    FROM new_events AS e
    JOIN pgbus.subscriptions AS s
      ON EXISTS (SELECT 1 FROM unnest(s.patterns) AS p
                 WHERE pgbus.pattern_matches(p, e.event_name));
    RETURN NULL;
END
$$;

CREATE TRIGGER events_fan_out
    AFTER INSERT ON pgbus.events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION pgbus.fan_out();

-- Cost-aware notify. Every commit that carries a NOTIFY serializes on PostgreSQL's
-- cluster-wide notify lock, so pgbus notifies only when a consumer is asleep (or when no
-- live consumer is known). The decision is made by a deferred constraint trigger, i.e.
-- just before COMMIT, so it reads the consumers' state as late as possible.
--
-- A constraint trigger is row-level; its WHEN clause runs at insert time and lets only
-- the first row of a transaction queue the deferred check. The marker is a
-- transaction-local setting, so a rolled-back savepoint forgets it together with the rows.
CREATE FUNCTION pgbus.first_event_in_transaction() RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT CASE
        WHEN current_setting('pgbus.notify_queued', true) IS NOT DISTINCT FROM 'on' THEN false
        ELSE set_config('pgbus.notify_queued', 'on', true) = 'on'
    END
$$;

-- True when a notification can change something: some live consumer is asleep, or no
-- consumer is known to be live.
CREATE FUNCTION pgbus.notify_needed() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT NOT EXISTS (SELECT 1 FROM pgbus.consumers WHERE expires_at > clock_timestamp())
        OR EXISTS (SELECT 1 FROM pgbus.consumers
                   WHERE expires_at > clock_timestamp() AND NOT awake)
$$;

CREATE FUNCTION pgbus.notify_at_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('pgbus.notify_queued', 'off', true);
    IF pgbus.notify_needed() THEN
        PERFORM pg_notify('pgbus', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER events_notify
    AFTER INSERT ON pgbus.events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (pgbus.first_event_in_transaction())
    EXECUTE FUNCTION pgbus.notify_at_commit();

-- Publishing from any SQL client: returns the event's id. Pass p_id for idempotency: an
-- event with the same id and content is not published twice; with different content the
-- call fails with SQLSTATE 23505.
CREATE FUNCTION pgbus.publish(
    event_name     text,
    payload        jsonb       DEFAULT '{}',
    headers        jsonb       DEFAULT '{}',
    id             text        DEFAULT NULL,
    aggregate_type text        DEFAULT NULL,
    aggregate_id   text        DEFAULT NULL,
    correlation_id text        DEFAULT NULL,
    causation_id   text        DEFAULT NULL,
    source         text        DEFAULT NULL,
    event_version  integer     DEFAULT 1,
    deliver_at     timestamptz DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_id text := coalesce(publish.id, pgbus.uuid_v7()::text);
    v_existing pgbus.events;
BEGIN
    INSERT INTO pgbus.events AS e (id, event_name, event_version, source, aggregate_type,
                                   aggregate_id, correlation_id, causation_id, payload,
                                   headers, available_at)
    VALUES (v_id, publish.event_name, publish.event_version, publish.source,
            publish.aggregate_type, publish.aggregate_id, publish.correlation_id,
            publish.causation_id, coalesce(publish.payload, '{}'),
            coalesce(publish.headers, '{}'), coalesce(publish.deliver_at, now()))
    ON CONFLICT ON CONSTRAINT events_id_key DO NOTHING;
    IF NOT FOUND THEN
        SELECT * INTO v_existing FROM pgbus.events AS e WHERE e.id = v_id;
        IF (v_existing.event_name, v_existing.event_version, v_existing.aggregate_type,
            v_existing.aggregate_id, v_existing.payload, v_existing.headers)
           IS DISTINCT FROM
           (publish.event_name, publish.event_version, publish.aggregate_type,
            publish.aggregate_id, coalesce(publish.payload, '{}'), coalesce(publish.headers, '{}'))
        THEN
            RAISE EXCEPTION 'event % was already published with different content', v_id
                USING ERRCODE = 'unique_violation', CONSTRAINT = 'events_id_key';
        END IF;
    END IF;
    RETURN v_id;
END
$$;
