-- The pgbus schema at its newest migration, rendered from the catalogs.
-- Regenerate with scripts/schema-sql; tests/schema.rs checks it matches.

-- Tables

CREATE TABLE pgbus.config_gate (
    CONSTRAINT config_gate_is_a_lock CHECK (false)
);

CREATE UNLOGGED TABLE pgbus.consumers (
    id text NOT NULL,
    awake boolean DEFAULT false NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    subscriptions text[] DEFAULT '{}'::text[] NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    info text,
    beat_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT consumers_pkey PRIMARY KEY (id)
);

CREATE TABLE pgbus.deliveries (
    subscription text NOT NULL,
    event_seq bigint NOT NULL,
    status text DEFAULT 'pending'::text NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    locked_until timestamp with time zone,
    locked_by text,
    last_error text,
    ordering_key text,
    is_head boolean DEFAULT true NOT NULL,
    key_pos bigint,
    ready_at timestamp with time zone DEFAULT clock_timestamp(),
    CONSTRAINT deliveries_pkey PRIMARY KEY (subscription, event_seq),
    CONSTRAINT deliveries_one_head EXCLUDE USING btree (subscription WITH =, ordering_key WITH =) WHERE ((is_head AND (ordering_key IS NOT NULL))) DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT deliveries_ready_check CHECK (((status <> 'pending'::text) OR (ready_at IS NOT NULL))),
    CONSTRAINT deliveries_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'processing'::text, 'dead'::text])))
) WITH (autovacuum_vacuum_scale_factor=0.01, autovacuum_vacuum_insert_scale_factor=0.05);

CREATE TABLE pgbus.delivery_failures (
    id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    subscription text NOT NULL,
    event_seq bigint NOT NULL,
    attempt integer NOT NULL,
    error text NOT NULL,
    worker text,
    failed_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT delivery_failures_pkey PRIMARY KEY (id)
);

CREATE TABLE pgbus.duties (
    name text NOT NULL,
    CONSTRAINT duties_pkey PRIMARY KEY (name)
);

CREATE TABLE pgbus.events (
    seq bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    id text DEFAULT (pgbus.uuid_v7())::text NOT NULL,
    event_name text NOT NULL,
    event_version integer DEFAULT 1 NOT NULL,
    source text,
    aggregate_type text,
    aggregate_id text,
    correlation_id text,
    causation_id text,
    occurred_at timestamp with time zone DEFAULT now() NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    ordering_key text,
    xid xid8 DEFAULT pg_current_xact_id(),
    key_pos bigint,
    CONSTRAINT events_pkey PRIMARY KEY (seq),
    CONSTRAINT events_id_key UNIQUE (id),
    CONSTRAINT events_aggregate_id_length CHECK ((octet_length(aggregate_id) <= 512)) NOT VALID,
    CONSTRAINT events_aggregate_type_length CHECK ((octet_length(aggregate_type) <= 255)) NOT VALID,
    CONSTRAINT events_causation_id_length CHECK ((octet_length(causation_id) <= 512)) NOT VALID,
    CONSTRAINT events_correlation_id_length CHECK ((octet_length(correlation_id) <= 512)) NOT VALID,
    CONSTRAINT events_event_name_check CHECK ((((octet_length(event_name) >= 1) AND (octet_length(event_name) <= 255)) AND (event_name !~ '[\u0001-\u001f\u007f-\u009f\u00ad\u034f\u061c\u115f-\u1160\u17b4-\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff\u2028-\u2029\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000*]'::text))) NOT VALID,
    CONSTRAINT events_headers_check CHECK ((jsonb_typeof(headers) = 'object'::text)),
    CONSTRAINT events_id_check CHECK (((octet_length(id) >= 1) AND (octet_length(id) <= 255))),
    CONSTRAINT events_ids_visible CHECK ((((((((id || COALESCE(correlation_id, ''::text)) || COALESCE(causation_id, ''::text)) || COALESCE(aggregate_type, ''::text)) || COALESCE(aggregate_id, ''::text)) || COALESCE(ordering_key, ''::text)) || COALESCE(source, ''::text)) !~ '[\u0001-\u001f\u007f-\u009f\u00ad\u034f\u061c\u115f-\u1160\u17b4-\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff\u2028-\u2029]'::text)) NOT VALID,
    CONSTRAINT events_ordering_key_length CHECK ((octet_length(ordering_key) <= 512)) NOT VALID,
    CONSTRAINT events_size_limit CHECK ((((pg_column_compression(payload) IS NULL) AND (pg_column_compression(headers) IS NULL) AND ((pg_column_size(payload) + pg_column_size(headers)) <= 512)) OR ((octet_length((payload)::text) + octet_length((headers)::text)) <= 16777216))) NOT VALID,
    CONSTRAINT events_source_length CHECK ((octet_length(source) <= 255)) NOT VALID,
    CONSTRAINT events_times_finite CHECK ((isfinite(occurred_at) AND isfinite(available_at) AND isfinite(created_at))) NOT VALID
);

CREATE TABLE pgbus.fan_out_lock (
    one boolean DEFAULT true NOT NULL,
    CONSTRAINT fan_out_lock_pkey PRIMARY KEY (one),
    CONSTRAINT fan_out_lock_one_check CHECK (one)
);

CREATE TABLE pgbus.fan_out_ticks (
    tick bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    boundary pg_snapshot NOT NULL,
    cut_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT fan_out_ticks_pkey PRIMARY KEY (tick)
);

CREATE TABLE pgbus.key_stripes (
    stripe integer NOT NULL,
    CONSTRAINT key_stripes_pkey PRIMARY KEY (stripe),
    CONSTRAINT key_stripes_stripe_check CHECK (((stripe >= 0) AND (stripe <= 65535)))
);

CREATE UNLOGGED TABLE pgbus.leader (
    one boolean DEFAULT true NOT NULL,
    worker text NOT NULL,
    elected_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    CONSTRAINT leader_pkey PRIMARY KEY (one),
    CONSTRAINT leader_one_check CHECK (one)
);

CREATE TABLE pgbus.publish_stripes (
    stripe integer NOT NULL,
    CONSTRAINT publish_stripes_pkey PRIMARY KEY (stripe),
    CONSTRAINT publish_stripes_stripe_check CHECK (((stripe >= 0) AND (stripe <= 65535)))
);

CREATE TABLE pgbus.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT schema_migrations_pkey PRIMARY KEY (version)
);

CREATE TABLE pgbus.settings (
    only_row boolean DEFAULT true NOT NULL,
    min_retention interval DEFAULT '01:00:00'::interval NOT NULL,
    CONSTRAINT settings_pkey PRIMARY KEY (only_row),
    CONSTRAINT settings_min_retention_check CHECK ((min_retention >= '00:00:00'::interval)),
    CONSTRAINT settings_only_row_check CHECK (only_row)
);

CREATE TABLE pgbus.subscription_patterns (
    prefix text NOT NULL,
    exact boolean NOT NULL,
    subscription text NOT NULL,
    CONSTRAINT subscription_patterns_pkey PRIMARY KEY (prefix, exact, subscription)
);

CREATE TABLE pgbus.subscriptions (
    name text NOT NULL,
    patterns text[] DEFAULT '{*}'::text[] NOT NULL,
    max_attempts integer DEFAULT 25 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    ordered boolean DEFAULT false NOT NULL,
    on_dead text DEFAULT 'block'::text NOT NULL,
    created_in pg_snapshot DEFAULT pgbus.snapshot_of_others(),
    paused_at timestamp with time zone,
    paused_by text,
    CONSTRAINT subscriptions_pkey PRIMARY KEY (name),
    CONSTRAINT subscriptions_max_attempts_check CHECK ((max_attempts >= 1)),
    CONSTRAINT subscriptions_name_check CHECK (pgbus.valid_name(name)),
    CONSTRAINT subscriptions_on_dead_check CHECK ((on_dead = ANY (ARRAY['block'::text, 'skip'::text]))),
    CONSTRAINT subscriptions_patterns_check CHECK (pgbus.valid_patterns(patterns))
);

-- Sequences

CREATE SEQUENCE pgbus.key_pos_seq AS bigint;

-- Indexes

CREATE INDEX deliveries_dead_idx ON pgbus.deliveries USING btree (subscription, event_seq) WHERE (status = 'dead'::text);

CREATE INDEX deliveries_dead_seq_idx ON pgbus.deliveries USING btree (event_seq, subscription) WHERE (status = 'dead'::text);

CREATE INDEX deliveries_key_idx ON pgbus.deliveries USING btree (subscription, ordering_key, key_pos, event_seq) WHERE (ordering_key IS NOT NULL);

CREATE INDEX deliveries_ready_idx ON pgbus.deliveries USING btree (subscription, ready_at, event_seq) WHERE ((status = 'pending'::text) AND is_head);

CREATE INDEX deliveries_reap_idx ON pgbus.deliveries USING btree (locked_until) WHERE (status = 'processing'::text);

CREATE INDEX delivery_failures_delivery_idx ON pgbus.delivery_failures USING btree (subscription, event_seq);

CREATE INDEX events_created_at_idx ON pgbus.events USING btree (created_at);

CREATE INDEX events_xid_idx ON pgbus.events USING btree (xid);

CREATE INDEX subscription_patterns_subscription_idx ON pgbus.subscription_patterns USING btree (subscription);

CREATE INDEX subscriptions_ordered_idx ON pgbus.subscriptions USING btree (name) WHERE ordered;

-- Triggers

CREATE TRIGGER consumers_beat_at BEFORE INSERT OR UPDATE ON pgbus.consumers FOR EACH ROW EXECUTE FUNCTION pgbus.consumer_beat_at();

CREATE TRIGGER deliveries_ready_insert BEFORE INSERT ON pgbus.deliveries FOR EACH ROW WHEN (((new.status = 'pending'::text) AND new.is_head AND ((new.ready_at IS NULL) OR (new.ready_at < new.available_at)))) EXECUTE FUNCTION pgbus.ready_at();

CREATE TRIGGER deliveries_ready_update BEFORE UPDATE ON pgbus.deliveries FOR EACH ROW WHEN (((new.status = 'pending'::text) AND new.is_head AND ((old.status <> 'pending'::text) OR (NOT old.is_head) OR (new.available_at IS DISTINCT FROM old.available_at) OR (new.ready_at IS NULL) OR (new.ready_at < new.available_at)))) EXECUTE FUNCTION pgbus.ready_at();

CREATE TRIGGER events_guard BEFORE INSERT ON pgbus.events FOR EACH ROW WHEN (((new.key_pos IS NOT NULL) OR (new.xid IS DISTINCT FROM pg_current_xact_id()))) EXECUTE FUNCTION pgbus.refuse_forged();

CREATE TRIGGER events_immutable BEFORE UPDATE ON pgbus.events FOR EACH ROW WHEN ((old.* IS DISTINCT FROM new.*)) EXECUTE FUNCTION pgbus.events_are_immutable();

CREATE CONSTRAINT TRIGGER events_notify AFTER INSERT ON pgbus.events DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (
        CASE
            WHEN (current_setting('pgbus.notify_queued'::text, true) = 'on'::text) THEN false
            ELSE (set_config('pgbus.notify_queued'::text, 'on'::text, true) = 'on'::text)
        END) EXECUTE FUNCTION pgbus.notify_at_commit();

CREATE TRIGGER subscriptions_gate_new_ordered BEFORE INSERT ON pgbus.subscriptions FOR EACH ROW WHEN (new.ordered) EXECUTE FUNCTION pgbus.gate_new_ordered();

CREATE TRIGGER subscriptions_index_patterns AFTER INSERT OR DELETE OR UPDATE OF name, patterns ON pgbus.subscriptions FOR EACH ROW EXECUTE FUNCTION pgbus.index_patterns();

CREATE TRIGGER subscriptions_ordered_needs_trigger BEFORE UPDATE OF ordered ON pgbus.subscriptions FOR EACH ROW WHEN ((new.ordered AND (NOT old.ordered))) EXECUTE FUNCTION pgbus.ordered_needs_trigger();

-- Functions

CREATE OR REPLACE FUNCTION pgbus.ack_in(p_subscription text, p_event_seq bigint, p_attempt integer, p_worker text)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_kind text;
    v_promoted boolean := false;
BEGIN
    FOR v_kind IN
        SELECT s.kind FROM pgbus.settle(
            ARRAY[p_subscription], ARRAY[p_event_seq], ARRAY[p_attempt],
            '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}', p_worker) AS s
    LOOP
        IF v_kind = 'ack' THEN
            RAISE EXCEPTION 'pgbus: the lease on delivery % of subscription % (attempt %) was lost',
                p_event_seq, p_subscription, p_attempt
                USING ERRCODE = 'PGB01',
                      HINT = 'The delivery was reaped or claimed again; it will be delivered again. Roll back.';
        ELSIF v_kind = 'promoted' THEN
            v_promoted := true;
        END IF;
    END LOOP;
    IF v_promoted THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
    END IF;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.backlog(subscriptions text[], cap bigint)
 RETURNS TABLE(subscription text, due bigint, scheduled bigint, processing bigint, dead bigint, oldest_due_age double precision, blocked_keys bigint, paused boolean)
 LANGUAGE sql
 STABLE
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
WITH subs AS (
  SELECT s.name, s.paused_at IS NOT NULL AS paused FROM pgbus.subscriptions AS s
  WHERE $1::text[] IS NULL OR s.name = ANY ($1::text[])
),
leased AS (
  SELECT d.subscription, count(*) AS n
  FROM pgbus.deliveries AS d
  WHERE d.status = 'processing'
  GROUP BY d.subscription
)
SELECT subs.name AS subscription,
       heads.due + behind.due AS due,
       heads.scheduled + behind.scheduled AS scheduled,
       least(coalesce(leased.n, 0), $2::int8) AS processing,
       dead.n AS dead,
       (extract(epoch FROM now()) - extract(epoch FROM heads.oldest))::float8 AS oldest_due_age,
       dead.blocked AS blocked_keys,
       subs.paused
FROM subs
CROSS JOIN LATERAL (
  SELECT
    (SELECT count(*) FROM (
       SELECT 1 FROM pgbus.deliveries AS d
       WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
         AND d.ready_at <= now()
       ORDER BY d.ready_at, d.event_seq
       LIMIT $2) AS x) AS due,
    (SELECT count(*) FROM (
       SELECT 1 FROM pgbus.deliveries AS d
       WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
         AND d.ready_at > now()
       ORDER BY d.ready_at, d.event_seq
       LIMIT $2) AS x) AS scheduled,
    (SELECT min(o.available_at) FROM (
       SELECT d.available_at FROM pgbus.deliveries AS d
       WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
         AND d.ready_at <= now()
       ORDER BY d.ready_at, d.event_seq
       LIMIT 100) AS o) AS oldest
) AS heads
CROSS JOIN LATERAL (
  SELECT count(*) FILTER (WHERE w.available_at <= now()) AS due,
         count(*) FILTER (WHERE w.available_at > now()) AS scheduled
  FROM (
    SELECT d.available_at FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.ordering_key IS NOT NULL
      AND d.status = 'pending' AND NOT d.is_head
    ORDER BY d.ordering_key, d.key_pos, d.event_seq
    LIMIT $2) AS w
) AS behind
CROSS JOIN LATERAL (
  SELECT
    (SELECT count(*) FROM (
       SELECT 1 FROM pgbus.deliveries AS d
       WHERE d.subscription = subs.name AND d.status = 'dead'
       ORDER BY d.subscription, d.event_seq
       LIMIT $2) AS x) AS n,
    (SELECT count(*) FROM (
       SELECT 1 FROM pgbus.deliveries AS d
       WHERE d.subscription = subs.name AND d.status = 'dead' AND d.is_head
         AND d.ordering_key IS NOT NULL
       ORDER BY d.subscription, d.event_seq
       LIMIT $2) AS x) AS blocked
) AS dead
LEFT JOIN leased ON leased.subscription = subs.name
ORDER BY subs.name
$function$;

CREATE OR REPLACE FUNCTION pgbus.beat(p_id text, p_ttl_ms bigint, p_subscriptions text[], p_info text, p_awake boolean, p_lead_ms bigint)
 RETURNS TABLE(missing text[], leads boolean, next_expiry_ms bigint, leader_expiry_ms bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)
 RETURNS TABLE(secs double precision, subscription text, attempts integer, seq bigint, id text, event_name text, event_version integer, source text, aggregate_type text, aggregate_id text, correlation_id text, causation_id text, occurred_at timestamp with time zone, payload jsonb, headers jsonb, created_at timestamp with time zone, ordering_key text, waited double precision, cut boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.fan_out_committed();
    RETURN QUERY SELECT * FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint, timestamp with time zone[])
 RETURNS TABLE(secs double precision, subscription text, attempts integer, seq bigint, id text, event_name text, event_version integer, source text, aggregate_type text, aggregate_id text, correlation_id text, causation_id text, occurred_at timestamp with time zone, payload jsonb, headers jsonb, created_at timestamp with time zone, ordering_key text, waited double precision, cut boolean, floors timestamp with time zone[])
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.fan_out_committed();
    RETURN QUERY SELECT * FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7, $8);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer, bigint)
 RETURNS TABLE(secs double precision, subscription text, attempts integer, seq bigint, id text, event_name text, event_version integer, source text, aggregate_type text, aggregate_id text, correlation_id text, causation_id text, occurred_at timestamp with time zone, payload jsonb, headers jsonb, created_at timestamp with time zone, ordering_key text, waited double precision, cut boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
RETURN QUERY
SELECT c.secs, c.subscription, c.attempts, c.seq, c.id, c.event_name, c.event_version,
       c.source, c.aggregate_type, c.aggregate_id, c.correlation_id, c.causation_id,
       c.occurred_at, c.payload, c.headers, c.created_at, c.ordering_key, c.waited, c.cut
FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7, '{}'::timestamptz[]) AS c;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer, bigint, timestamp with time zone[])
 RETURNS TABLE(secs double precision, subscription text, attempts integer, seq bigint, id text, event_name text, event_version integer, source text, aggregate_type text, aggregate_id text, correlation_id text, causation_id text, occurred_at timestamp with time zone, payload jsonb, headers jsonb, created_at timestamp with time zone, ordering_key text, waited double precision, cut boolean, floors timestamp with time zone[])
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
#variable_conflict use_column
BEGIN
RETURN QUERY
WITH subs AS (
  SELECT s.name, s.quota, s.floor, s.ord,
         EXISTS (SELECT 1 FROM pgbus.subscriptions AS p
                 WHERE p.name = s.name AND p.paused_at IS NOT NULL) AS paused
  FROM unnest($1::text[], $2::int4[], $8::timestamptz[]) WITH ORDINALITY
    AS s(name, quota, floor, ord)
),
candidates AS (
  SELECT p.row_id, p.subscription, p.event_seq, p.ready_at
  FROM subs CROSS JOIN LATERAL (
    SELECT d.ctid AS row_id, d.subscription, d.event_seq, d.ready_at
    FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
      AND d.ready_at >= coalesce(subs.floor, '-infinity')
      AND d.ready_at <= now() + interval '1 second'
      AND d.available_at <= now()
    ORDER BY d.ready_at, d.event_seq
    LIMIT CASE WHEN subs.paused THEN 0 ELSE subs.quota END
    FOR UPDATE SKIP LOCKED
  ) AS p
),
picked AS (
  SELECT c.row_id, c.subscription, c.event_seq, c.ready_at FROM candidates AS c
  ORDER BY c.ready_at, c.event_seq
  LIMIT $3
),
sized AS (
  SELECT p.row_id, p.subscription, p.event_seq,
         row_number() OVER w AS n,
         sum(coalesce((SELECT pg_column_size(e.payload)::int8 + pg_column_size(e.headers)
                       FROM pgbus.events AS e WHERE e.seq = p.event_seq), 0)) OVER w AS bytes
  FROM picked AS p
  WINDOW w AS (ORDER BY p.ready_at, p.event_seq, p.subscription
               ROWS UNBOUNDED PRECEDING)
),
kept AS (
  SELECT row_id FROM sized WHERE n = 1 OR bytes <= $7::int8
),
claimed AS (
  UPDATE pgbus.deliveries AS d
  SET status = 'processing',
      attempts = d.attempts + 1,
      locked_until = now() + $4 * interval '1 millisecond',
      locked_by = $5
  WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM kept))
  RETURNING d.subscription, d.event_seq, d.attempts, d.available_at, d.ready_at
),
awake AS (
  UPDATE pgbus.consumers SET awake = true
  WHERE id = $5 AND NOT awake AND (SELECT count(*) FROM claimed) >= $6
  RETURNING 1
),
whole AS (
  SELECT (SELECT count(*) FROM candidates) = (SELECT count(*) FROM kept) AS took_all
),
floors AS (
  SELECT array_agg(
           CASE WHEN subs.paused THEN subs.floor
                WHEN whole.took_all
                     AND (SELECT count(*) FROM candidates AS c
                          WHERE c.subscription = subs.name) < subs.quota
                  THEN now() - interval '5 seconds'
                WHEN EXISTS (SELECT 1 FROM claimed AS c WHERE c.subscription = subs.name)
                  THEN least((SELECT min(c.ready_at) FROM claimed AS c
                              WHERE c.subscription = subs.name),
                             now() - interval '5 seconds')
                ELSE subs.floor
           END ORDER BY subs.ord) AS floors
  FROM subs CROSS JOIN whole
),
next_due AS (
  -- A head due later became claimable at its due time: its ready_at is its available_at.
  SELECT extract(epoch FROM min(n.available_at) - now())::float8 AS secs
  FROM subs CROSS JOIN LATERAL (
    SELECT d.available_at FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
      AND d.ready_at > now() AND d.ready_at < 'infinity'
      AND d.available_at > now()
    ORDER BY d.ready_at, d.event_seq
    LIMIT CASE WHEN subs.paused THEN 0 ELSE 1 END
  ) AS n
)
SELECT next_due.secs, c.subscription, c.attempts,
       e.seq, e.id, e.event_name, e.event_version, e.source, e.aggregate_type,
       e.aggregate_id, e.correlation_id, e.causation_id, e.occurred_at, e.payload,
       e.headers, e.created_at, e.ordering_key,
       (extract(epoch FROM now()) - extract(epoch FROM c.available_at))::float8 AS waited,
       (SELECT count(*) FROM sized) > (SELECT count(*) FROM kept) AS cut,
       floors.floors
FROM next_due CROSS JOIN floors
LEFT JOIN (claimed AS c JOIN pgbus.events AS e ON e.seq = c.event_seq) ON true
ORDER BY e.seq;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.configure_subscription(p_name text, p_patterns text[] DEFAULT NULL::text[], p_max_attempts integer DEFAULT NULL::integer, p_ordered boolean DEFAULT NULL::boolean, p_on_dead text DEFAULT NULL::text)
 RETURNS TABLE(found boolean, converted bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_try record;
    v_pause float8 := 0.05;
BEGIN
    LOOP
        SELECT * INTO v_try
        FROM pgbus.try_configure_subscription(p_name, p_patterns, p_max_attempts, p_ordered,
                                              p_on_dead, 200);
        IF v_try.got THEN
            RETURN QUERY SELECT v_try.found, v_try.converted;
            RETURN;
        END IF;
        PERFORM pg_catalog.pg_sleep(v_pause);
        v_pause := least(v_pause * 2, 1.0);
    END LOOP;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.consumer_beat_at()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    NEW.beat_at := now();
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.done_recently(window_seconds double precision, only_subscription text, max_events bigint, max_probes bigint)
 RETURNS TABLE(subscription text, done bigint, estimated boolean)
 LANGUAGE sql
 STABLE
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
WITH newest AS (
  SELECT e.seq, e.event_name, e.created_at, e.available_at, e.xid FROM pgbus.events AS e
  WHERE e.created_at > now() - $1 * interval '1 second'
  ORDER BY e.created_at DESC
  LIMIT $3 + 1
),
span AS (
  SELECT w.over, w.hi,
         CASE WHEN w.over THEN greatest(1, ceil((w.hi - w.lo + 1)::numeric / $3))::int8
              ELSE 1 END AS step,
         w.lo
  FROM (
    SELECT (SELECT count(*) FROM newest) > $3 AS over,
           (SELECT e.seq FROM pgbus.events AS e
            WHERE e.created_at > now() - $1 * interval '1 second'
            ORDER BY e.created_at LIMIT 1) AS lo,
           (SELECT max(e.seq) FROM pgbus.events AS e) AS hi
  ) AS w
),
sample AS (
  SELECT n.seq, n.event_name, n.created_at, n.xid
  FROM span, newest AS n
  WHERE NOT span.over AND n.available_at <= now()
  UNION ALL
  -- Empty unless over: then one position in each stretch of `step` from the newest down
  -- to the window's first, the newest itself first, the others at an offset drawn from a
  -- hash of the stretch's number, so that no periodic pattern of the traffic (a
  -- publisher cycling through names) lines up with the step.
  SELECT e.seq, e.event_name, e.created_at, e.xid
  FROM span
  CROSS JOIN generate_series(0, CASE WHEN span.over THEN (span.hi - span.lo) / span.step
                                         ELSE -1 END) AS g(k)
  JOIN pgbus.events AS e
    ON e.seq = span.hi - g.k * span.step
               - CASE WHEN g.k = 0 THEN 0
                      ELSE (hashint8(g.k) & 2147483647) % span.step END
  WHERE e.created_at > now() - $1 * interval '1 second' AND e.available_at <= now()
),
named AS (
  SELECT s.event_name, count(*) AS events FROM sample AS s GROUP BY s.event_name
),
matched AS (
  SELECT n.event_name, n.events, m.subscription, s.created_at
  FROM named AS n
  CROSS JOIN LATERAL pgbus.subscriptions_matching(n.event_name) AS m
  JOIN pgbus.subscriptions AS s ON s.name = m.subscription
  WHERE $2 IS NULL OR m.subscription = $2
),
thin AS (
  SELECT greatest(1, ceil(coalesce(sum(m.events), 0)::numeric / $4))::int8 AS k
  FROM matched AS m
),
kept AS (
  SELECT r.seq, r.event_name, r.created_at, r.xid
  FROM (SELECT s.*, row_number() OVER (ORDER BY s.seq DESC) AS i FROM sample AS s) AS r,
       thin
  WHERE (r.i - 1) % thin.k = 0
),
pairs AS (
  SELECT e.seq, e.xid, m.subscription
  FROM kept AS e JOIN matched AS m ON m.event_name = e.event_name
  WHERE e.created_at >= m.created_at
  LIMIT $4
),
boundary AS (
  SELECT pgbus.fan_out_boundary() AS b
),
done AS (
  SELECT p.subscription, count(*) AS n
  FROM pairs AS p, boundary
  WHERE pgbus.passed(p.xid, boundary.b)
    AND (SELECT 1 FROM pgbus.deliveries AS d
         WHERE d.subscription = p.subscription AND d.event_seq = p.seq) IS NULL
  GROUP BY p.subscription
)
SELECT done.subscription, done.n * span.step * thin.k AS done,
       span.over OR thin.k > 1 AS estimated
FROM span CROSS JOIN thin
LEFT JOIN done ON true
ORDER BY done.subscription
$function$;

CREATE OR REPLACE FUNCTION pgbus.ensure_heads(subs text[], keys text[])
 RETURNS TABLE(subscription text, ordering_key text, event_seq bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.ensure_heads');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.ensure_heads_unlocked(subs, keys);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.ensure_heads_unlocked(subs text[], keys text[])
 RETURNS TABLE(subscription text, ordering_key text, event_seq bigint)
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.lock_keys(subs, keys);
    RETURN QUERY
    UPDATE pgbus.deliveries AS d SET is_head = true
    FROM (SELECT DISTINCT t.s, t.k FROM unnest(subs, keys) AS t(s, k)
          WHERE t.k IS NOT NULL) AS o
    WHERE d.subscription = o.s
      AND d.event_seq = pgbus.next_of_key(o.s, o.k)
      AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS h
                      WHERE h.subscription = o.s AND h.ordering_key = o.k AND h.is_head)
    RETURNING d.subscription, d.ordering_key, d.event_seq;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.ensure_order_key_trigger()
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.event_key(ordering_key text, aggregate_type text, aggregate_id text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT CASE
             WHEN pg_catalog.octet_length(coalesce(ordering_key, aggregate_type
                                                   OPERATOR(pg_catalog.||) ':'
                                                   OPERATOR(pg_catalog.||) aggregate_id))
                  OPERATOR(pg_catalog.>) 768
             THEN 'sha256:' OPERATOR(pg_catalog.||)
                  pg_catalog.encode(pg_catalog.sha256(CAST(coalesce(ordering_key, aggregate_type
                                                   OPERATOR(pg_catalog.||) ':'
                                                   OPERATOR(pg_catalog.||) aggregate_id)
                                                 AS pg_catalog.bytea)), 'hex')
             ELSE coalesce(ordering_key, aggregate_type OPERATOR(pg_catalog.||) ':'
                                         OPERATOR(pg_catalog.||) aggregate_id)
           END
$function$;

CREATE OR REPLACE FUNCTION pgbus.events_are_immutable()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    RAISE EXCEPTION 'pgbus.events is insert-only: event % cannot be changed', OLD.id
        USING ERRCODE = 'insufficient_privilege';
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.extend_leases(p_subs text[], p_seqs bigint[], p_attempts integer[], p_lease_ms bigint, p_worker text)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_extended bigint;
BEGIN
    IF p_lease_ms IS NULL OR p_lease_ms < 0 OR p_worker IS NULL THEN
        RAISE EXCEPTION 'pgbus.extend_leases: the lease must be at least 0 ms, and the worker given'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pgbus.deliveries AS d
    SET locked_until = now() + p_lease_ms * interval '1 millisecond'
    FROM (
      SELECT h.subscription, h.event_seq
      FROM pgbus.deliveries AS h
      JOIN unnest(p_subs, p_seqs, p_attempts) AS t(subscription, event_seq, attempt)
        ON h.subscription = t.subscription AND h.event_seq = t.event_seq
      WHERE h.subscription = ANY (p_subs) AND h.event_seq = ANY (p_seqs)
        AND h.attempts = t.attempt AND h.locked_by = p_worker AND h.status = 'processing'
      FOR UPDATE OF h SKIP LOCKED
    ) AS held
    WHERE d.subscription = held.subscription AND d.event_seq = held.event_seq
      AND d.subscription = ANY (p_subs) AND d.event_seq = ANY (p_seqs);
    GET DIAGNOSTICS v_extended = ROW_COUNT;
    RETURN v_extended;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.fan_out_boundary()
 RETURNS pg_snapshot
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT t.boundary FROM pgbus.fan_out_ticks AS t ORDER BY t.tick DESC LIMIT 1
$function$;

CREATE OR REPLACE FUNCTION pgbus.fan_out_committed()
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
 SET jit TO 'off'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_prev pg_snapshot;
    v_cur pg_snapshot;
    v_seqs bigint[];
    v_subs text[];
    v_keys text[];
    v_pos bigint;
    v_lock_timeout text;
    v_tick bigint;
    -- Whether the caller's transaction wrote before this batch (the locks below give it
    -- an xid in any case).
    v_own xid8 := pg_current_xact_id_if_assigned();
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pgbus.require_read_committed('pgbus.fan_out_committed');
    END IF;
    SELECT t.boundary INTO v_prev FROM pgbus.fan_out_ticks AS t ORDER BY t.tick DESC LIMIT 1;
    IF coalesce((SELECT e.xid FROM pgbus.events AS e WHERE e.xid IS NOT NULL
                 ORDER BY e.xid DESC LIMIT 1) < pg_snapshot_xmax(v_prev), true)
       AND NOT EXISTS (SELECT 1 FROM pg_snapshot_xip(v_prev) AS x(xid)
                       WHERE EXISTS (SELECT 1 FROM pgbus.events AS e WHERE e.xid = x.xid)) THEN
        RETURN 0;
    END IF;

    PERFORM pgbus.lock_config(false);
    PERFORM 1 FROM pgbus.fan_out_lock FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        v_lock_timeout := current_setting('lock_timeout');
        BEGIN
            PERFORM set_config('lock_timeout', '2s', true);
            PERFORM 1 FROM pgbus.fan_out_lock FOR UPDATE;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
            RETURN 0;
        END;
    END IF;

    SELECT t.boundary INTO v_prev FROM pgbus.fan_out_ticks AS t ORDER BY t.tick DESC LIMIT 1;
    SELECT pg_current_snapshot(),
           ARRAY(SELECT e.seq FROM pgbus.events AS e
                 WHERE e.xid >= pg_snapshot_xmax(v_prev)
                   AND e.xid < pg_snapshot_xmax(pg_current_snapshot())
                 UNION ALL
                 SELECT e.seq FROM pg_snapshot_xip(v_prev) AS x(xid)
                 CROSS JOIN LATERAL (SELECT e.seq FROM pgbus.events AS e
                                     WHERE e.xid = x.xid) AS e)
      INTO v_cur, v_seqs;
    IF v_own IS NOT NULL THEN
        v_seqs := ARRAY(SELECT e.seq FROM pgbus.events AS e
                        WHERE e.seq = ANY (v_seqs) AND e.xid <> v_own);
    END IF;
    -- The caller's transaction stays in the boundary's in-progress list: events it wrote
    -- before, or writes after, are taken by a batch after its commit.
    v_cur := pgbus.running_too(v_cur, pg_current_xact_id());
    IF cardinality(v_seqs) = 0 THEN
        RETURN 0;
    END IF;

    INSERT INTO pgbus.deliveries (subscription, event_seq, available_at)
    SELECT m.subscription, e.seq, e.available_at
    FROM pgbus.events AS e
    CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
    JOIN pgbus.subscriptions AS s ON s.name = m.subscription
    WHERE e.seq = ANY (v_seqs)
      AND (s.created_in IS NULL OR NOT pg_visible_in_snapshot(e.xid, s.created_in))
      AND NOT (m.ordered
               AND pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) IS NOT NULL)
    ON CONFLICT (subscription, event_seq) DO NOTHING;

    -- The ordered subscriptions' deliveries (none to look for when none is ordered).
    IF (SELECT s.name FROM pgbus.subscriptions AS s WHERE s.ordered
        ORDER BY s.name LIMIT 1) IS NOT NULL THEN
        SELECT array_agg(k.sub), array_agg(k.key) INTO v_subs, v_keys
        FROM (SELECT DISTINCT m.subscription AS sub,
                     pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key
              FROM pgbus.events AS e
              CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
              JOIN pgbus.subscriptions AS s ON s.name = m.subscription
              WHERE e.seq = ANY (v_seqs) AND m.ordered
                AND (s.created_in IS NULL
                     OR NOT pg_visible_in_snapshot(e.xid, s.created_in))) AS k
        WHERE k.key IS NOT NULL;
    END IF;
    IF v_subs IS NOT NULL THEN
        PERFORM pgbus.lock_keys(v_subs, v_keys);
        v_pos := nextval('pgbus.key_pos_seq');
        INSERT INTO pgbus.deliveries (subscription, event_seq, available_at, ordering_key,
                                      is_head, key_pos)
        SELECT o.sub, o.seq, o.available_at, o.key,
               row_number() OVER (PARTITION BY o.sub, o.key ORDER BY o.pos, o.seq) = 1
                 AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                                 WHERE d.subscription = o.sub AND d.ordering_key = o.key
                                   AND d.is_head),
               o.pos
        FROM (SELECT m.subscription AS sub, e.seq, e.available_at,
                     pgbus.event_key(e.ordering_key, e.aggregate_type, e.aggregate_id) AS key,
                     coalesce(e.key_pos, v_pos) AS pos
              FROM pgbus.events AS e
              CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
              JOIN pgbus.subscriptions AS s ON s.name = m.subscription
              WHERE e.seq = ANY (v_seqs) AND m.ordered
                AND (s.created_in IS NULL OR NOT pg_visible_in_snapshot(e.xid, s.created_in))
                AND NOT EXISTS (SELECT 1 FROM pgbus.deliveries AS d
                                WHERE d.subscription = m.subscription
                                  AND d.event_seq = e.seq)) AS o
        WHERE o.key IS NOT NULL;
    END IF;

    INSERT INTO pgbus.fan_out_ticks (boundary) VALUES (v_cur) RETURNING tick INTO v_tick;
    -- Old ticks go, 256 ticks at a time, in a range that overlaps the two before it (a
    -- batch that rolled back skips its turn; the next one covers it). The range is
    -- bounded: a scan of it reads at most 768 entries, however many deleted ones wait
    -- for the horizon below it. Once in 65,536 batches, everything older.
    IF v_tick % 256 = 0 THEN
        IF v_tick % 65536 = 0 THEN
            DELETE FROM pgbus.fan_out_ticks AS t WHERE t.tick < v_tick - 256;
        ELSE
            DELETE FROM pgbus.fan_out_ticks AS t
            WHERE t.tick >= v_tick - 1024 AND t.tick < v_tick - 256;
        END IF;
    END IF;
    RETURN cardinality(v_seqs);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.gate_new_ordered()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.require_read_committed('creating an ordered subscription');
    PERFORM pgbus.lock_config(true);
    PERFORM pgbus.ensure_order_key_trigger();
    NEW.created_in := pgbus.snapshot_of_others();
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.grant_consumer(consumer regrole)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', consumer);
    EXECUTE format('GRANT SELECT ON pgbus.events, pgbus.settings, pgbus.deliveries, '
                   'pgbus.delivery_failures, pgbus.consumers, pgbus.subscriptions, '
                   'pgbus.leader TO %s',
                   consumer);
    EXECUTE format('GRANT EXECUTE ON FUNCTION '
                   'pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint), '
                   'pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint, '
                   'timestamptz[]), '
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.grant_operator(operator regrole)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.grant_publisher(publisher regrole)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', publisher);
    EXECUTE format('GRANT SELECT, INSERT (id, event_name, event_version, source, '
                   'aggregate_type, aggregate_id, correlation_id, causation_id, occurred_at, '
                   'payload, headers, available_at, ordering_key) ON pgbus.events TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish(text, jsonb, jsonb, text, text, '
                   'text, text, text, text, integer, timestamptz, text) TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish_batch(text[], text[], integer[], '
                   'text[], text[], text[], text[], text[], timestamptz[], text[], text[], '
                   'timestamptz[], bigint[], text[]) TO %s', publisher);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.publish_event(text, text, integer, '
                   'text, text, text, text, text, timestamptz, text, text, timestamptz, '
                   'bigint, text) TO %s', publisher);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.head_of_key(p_subscription text, p_key text)
 RETURNS TABLE(head text, head_status text)
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT e.id, d.status FROM pgbus.deliveries AS d
    LEFT JOIN pgbus.events AS e ON e.seq = d.event_seq
    WHERE d.subscription = p_subscription AND d.ordering_key = p_key AND d.is_head
$function$;

CREATE OR REPLACE FUNCTION pgbus.heartbeat(p_id text, p_ttl_ms bigint, p_subscriptions text[], p_info text, p_awake boolean)
 RETURNS text[]
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    IF p_id IS NULL OR p_ttl_ms IS NULL OR p_ttl_ms < 0 THEN
        RAISE EXCEPTION 'pgbus.heartbeat: the worker id and a time to live of at least 0 ms are needed'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pgbus.consumers AS c (id, awake, expires_at, subscriptions, info)
    VALUES (p_id, p_awake, now() + p_ttl_ms * interval '1 millisecond', p_subscriptions, p_info)
    ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN ARRAY(SELECT n FROM unnest(p_subscriptions) AS n
                 WHERE NOT EXISTS (SELECT 1 FROM pgbus.subscriptions AS s WHERE s.name = n)
                 ORDER BY n);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.index_patterns()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM pgbus.subscription_patterns AS p WHERE p.subscription = OLD.name;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO pgbus.subscription_patterns (prefix, exact, subscription)
        SELECT DISTINCT k.prefix, k.exact, NEW.name
        FROM unnest(NEW.patterns) AS p(pattern), pgbus.pattern_key(p.pattern) AS k;
    END IF;
    RETURN NULL;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.join_subscription(p_name text, p_patterns text[], p_max_attempts integer, p_ordered boolean, p_on_dead text)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    IF EXISTS (SELECT 1 FROM pgbus.subscriptions AS s WHERE s.name = p_name) THEN
        RETURN false;
    END IF;
    INSERT INTO pgbus.subscriptions (name, patterns, max_attempts, ordered, on_dead)
    VALUES (p_name, p_patterns, p_max_attempts, p_ordered, p_on_dead)
    ON CONFLICT (name) DO NOTHING;
    RETURN FOUND;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.leave(p_id text)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_was boolean;
BEGIN
    DELETE FROM pgbus.consumers WHERE id = p_id;
    v_was := FOUND;
    PERFORM pgbus.resign(p_id);
    RETURN v_was;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.lock_config(exclusive boolean)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.lock_keys(subs text[], keys text[])
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM 1 FROM pgbus.key_stripes AS k
    WHERE k.stripe = ANY (ARRAY(
        SELECT (pg_catalog.hashtextextended(t.s || pg_catalog.chr(31) || t.k, 7305) & 65535)::integer
        FROM unnest(subs, keys) AS t(s, k)
        WHERE t.k IS NOT NULL))
    ORDER BY k.stripe
    FOR NO KEY UPDATE;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.lock_publish_keys(names text[], keys text[])
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.mark_asleep(p_id text)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_lock_timeout text := pg_catalog.current_setting('lock_timeout');
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', '200ms', true);
    PERFORM pg_catalog.pg_advisory_xact_lock(8099550711435458411);
    PERFORM pg_catalog.set_config('lock_timeout', v_lock_timeout, true);
    UPDATE pgbus.consumers SET awake = false WHERE id = p_id;
END
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.name_keys(name text, OUT prefix text, OUT exact boolean)
 RETURNS SETOF record
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT name, true
    UNION ALL
    SELECT '', false
    UNION ALL
    SELECT pg_catalog.array_to_string(parts[1:i], '.') OPERATOR(pg_catalog.||) '.', false
    FROM (SELECT pg_catalog.string_to_array(name, '.') AS parts) AS s,
         pg_catalog.generate_series(1, pg_catalog.cardinality(parts) OPERATOR(pg_catalog.-) 1) AS i
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.next_of_key(p_subscription text, p_key text)
 RETURNS bigint
 LANGUAGE sql
 STABLE
AS $function$
    SELECT n.event_seq FROM pgbus.deliveries AS n
    WHERE n.subscription OPERATOR(pg_catalog.=) p_subscription
      AND n.ordering_key OPERATOR(pg_catalog.=) p_key
      AND NOT n.is_head AND n.status OPERATOR(pg_catalog.=) 'pending'
    ORDER BY n.key_pos, n.event_seq
    LIMIT 1
$function$;

CREATE OR REPLACE FUNCTION pgbus.not_fanned_out(cap bigint)
 RETURNS TABLE(events bigint, oldest_age double precision)
 LANGUAGE plpgsql
 STABLE
 SET lock_timeout TO '1s'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_boundary pg_snapshot;
BEGIN
    SELECT c.boundary INTO v_boundary FROM pgbus.fan_out_cursor AS c;
    -- Planned for the boundary's values (EXECUTE), as the batch's statement.
    RETURN QUERY EXECUTE '
    WITH waiting AS (
      SELECT e.created_at FROM pgbus.events AS e WHERE e.xid >= $1
      UNION ALL
      SELECT e.created_at FROM pg_catalog.pg_snapshot_xip($2) AS x(xid)
      CROSS JOIN LATERAL (SELECT e.created_at FROM pgbus.events AS e
                          WHERE e.xid = x.xid) AS e
      LIMIT $3
    )
    SELECT pg_catalog.count(*),
           pg_catalog.date_part(''epoch'', pg_catalog.now() - pg_catalog.min(w.created_at))::float8
    FROM waiting AS w'
    USING pg_snapshot_xmax(v_boundary), v_boundary, cap;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.notify_at_commit()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pg_catalog.set_config('pgbus.notify_queued', 'off', true);
    IF NOT pg_catalog.pg_try_advisory_xact_lock_shared(8099550711435458411) THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
        RETURN NULL;
    END IF;
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed'
       OR (SELECT coalesce(bool_or(NOT c.awake), true)
           FROM pgbus.consumers AS c
           WHERE c.expires_at > pg_catalog.clock_timestamp()) THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
    END IF;
    RETURN NULL;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.notify_needed()
 RETURNS boolean
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT NOT EXISTS (SELECT 1 FROM pgbus.consumers WHERE expires_at > clock_timestamp())
        OR EXISTS (SELECT 1 FROM pgbus.consumers
                   WHERE expires_at > clock_timestamp() AND NOT awake)
$function$;

CREATE OR REPLACE FUNCTION pgbus.order_key()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_key text;
BEGIN
    IF NEW.xid IS DISTINCT FROM pg_current_xact_id() THEN
        RAISE EXCEPTION 'pgbus.events.xid is set by pgbus: leave it out of the insert'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'xid';
    END IF;
    NEW.key_pos := NULL;
    v_key := pgbus.event_key(NEW.ordering_key, NEW.aggregate_type, NEW.aggregate_id);
    IF v_key IS NULL THEN
        RETURN NEW;
    END IF;
    LOCK TABLE pgbus.config_gate IN ROW EXCLUSIVE MODE;
    IF current_setting('transaction_isolation') = 'read committed'
       AND ((SELECT s.name FROM pgbus.subscriptions AS s WHERE s.ordered
             ORDER BY s.name LIMIT 1) IS NULL
            OR NOT EXISTS (SELECT 1 FROM pgbus.subscriptions_matching(NEW.event_name) AS m
                           WHERE m.ordered)) THEN
        RETURN NEW;
    END IF;
    PERFORM 1 FROM pgbus.publish_stripes AS k
    WHERE k.stripe = (hashtextextended(v_key, 7305) & 65535)::integer
    FOR NO KEY UPDATE;
    NEW.key_pos := nextval('pgbus.key_pos_seq');
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.ordered_needs_trigger()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.ensure_order_key_trigger();
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.orders_keys()
 RETURNS boolean
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                   WHERE t.tgrelid = 'pgbus.events'::pg_catalog.regclass
                     AND t.tgname = 'events_order_key')
$function$;

CREATE OR REPLACE FUNCTION pgbus.passed(p_xid xid8, p_boundary pg_snapshot)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT p_xid IS NULL OR pg_catalog.pg_visible_in_snapshot(p_xid, p_boundary)
$function$;

CREATE OR REPLACE FUNCTION pgbus.pattern_key(pattern text, OUT prefix text, OUT exact boolean)
 RETURNS record
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT CASE WHEN pattern = '*' THEN ''
                WHEN right(pattern, 2) = '.*' THEN left(pattern, -1)
                ELSE pattern END,
           NOT (pattern = '*' OR right(pattern, 2) = '.*')
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.pattern_matches(pattern text, event_name text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT pattern OPERATOR(pg_catalog.=) '*'
        OR pattern OPERATOR(pg_catalog.=) event_name
        OR (pg_catalog."right"(pattern, 2) OPERATOR(pg_catalog.=) '.*'
            AND pg_catalog.starts_with(event_name, pg_catalog."left"(pattern, -1)))
$function$;

CREATE OR REPLACE FUNCTION pgbus.pause_subscription(p_name text)
 RETURNS TABLE(known boolean, since timestamp with time zone, already boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_was timestamptz;
    v_known boolean;
BEGIN
    SELECT s.paused_at INTO v_was FROM pgbus.subscriptions AS s
    WHERE s.name = p_name FOR UPDATE;
    v_known := FOUND;
    IF v_known AND v_was IS NULL THEN
        UPDATE pgbus.subscriptions AS s SET paused_at = now(), paused_by = session_user
        WHERE s.name = p_name;
    END IF;
    RETURN QUERY SELECT v_known, CASE WHEN v_known THEN coalesce(v_was, now()) END,
                        v_was IS NOT NULL;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.promote_orphans(max_keys integer)
 RETURNS TABLE(subscription text, ordering_key text, event_seq bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_subs text[];
    v_keys text[];
BEGIN
    SELECT array_agg(o.subscription), array_agg(o.ordering_key) INTO v_subs, v_keys
    FROM (SELECT d.subscription, d.ordering_key FROM pgbus.deliveries AS d
          WHERE d.ordering_key IS NOT NULL
          GROUP BY d.subscription, d.ordering_key
          HAVING NOT bool_or(d.is_head) AND bool_or(d.status = 'pending')
          LIMIT max_keys) AS o;
    IF v_subs IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM pgbus.ensure_heads(v_subs, v_keys);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.publish(event_name text, payload jsonb DEFAULT '{}'::jsonb, headers jsonb DEFAULT '{}'::jsonb, id text DEFAULT NULL::text, aggregate_type text DEFAULT NULL::text, aggregate_id text DEFAULT NULL::text, correlation_id text DEFAULT NULL::text, causation_id text DEFAULT NULL::text, source text DEFAULT NULL::text, event_version integer DEFAULT 1, deliver_at timestamp with time zone DEFAULT NULL::timestamp with time zone, ordering_key text DEFAULT NULL::text)
 RETURNS text
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_id text := coalesce(publish.id, pgbus.uuid_v7()::text);
    v_existing pgbus.events;
BEGIN
    INSERT INTO pgbus.events AS e (id, event_name, event_version, source, aggregate_type,
                                   aggregate_id, correlation_id, causation_id, payload,
                                   headers, available_at, ordering_key)
    VALUES (v_id, publish.event_name, publish.event_version, publish.source,
            publish.aggregate_type, publish.aggregate_id, publish.correlation_id,
            publish.causation_id, coalesce(publish.payload, '{}'),
            coalesce(publish.headers, '{}'), coalesce(publish.deliver_at, now()),
            publish.ordering_key)
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.publish_batch(ids text[], event_names text[], event_versions integer[], sources text[], aggregate_types text[], aggregate_ids text[], correlation_ids text[], causation_ids text[], occurred_ats timestamp with time zone[], payloads text[], headers text[], deliver_ats timestamp with time zone[], delays_ms bigint[], ordering_keys text[], OUT inserted bigint, OUT conflict text)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    IF pg_catalog.cardinality(ids) > 1 THEN
        PERFORM pgbus.lock_publish_keys(event_names, ARRAY(
            SELECT pgbus.event_key(u.o, u.t, u.a)
            FROM ROWS FROM (pg_catalog.unnest(ordering_keys), pg_catalog.unnest(aggregate_types),
                            pg_catalog.unnest(aggregate_ids)) AS u(o, t, a)));
    END IF;
    WITH t AS (
      SELECT * FROM ROWS FROM (
          pg_catalog.unnest(ids), pg_catalog.unnest(event_names),
          pg_catalog.unnest(event_versions), pg_catalog.unnest(sources),
          pg_catalog.unnest(aggregate_types), pg_catalog.unnest(aggregate_ids),
          pg_catalog.unnest(correlation_ids), pg_catalog.unnest(causation_ids),
          pg_catalog.unnest(occurred_ats), pg_catalog.unnest(payloads),
          pg_catalog.unnest(headers), pg_catalog.unnest(deliver_ats),
          pg_catalog.unnest(delays_ms), pg_catalog.unnest(ordering_keys))
        AS u(id, event_name, event_version, source, aggregate_type, aggregate_id,
             correlation_id, causation_id, occurred_at, payload, headers, deliver_at,
             delay_ms, ordering_key)
    ),
    conflicting AS (
      SELECT t.id FROM t JOIN pgbus.events AS e ON e.id = t.id
      WHERE (e.event_name, e.event_version, e.aggregate_type, e.aggregate_id, e.payload,
             e.headers - '{traceparent,tracestate}'::text[])
            IS DISTINCT FROM
            (t.event_name, t.event_version, t.aggregate_type, t.aggregate_id,
             t.payload::jsonb, t.headers::jsonb - '{traceparent,tracestate}'::text[])
      LIMIT 1
    ),
    written AS (
      INSERT INTO pgbus.events AS e
        (id, event_name, event_version, source, aggregate_type, aggregate_id, correlation_id,
         causation_id, occurred_at, payload, headers, available_at, ordering_key)
      SELECT t.id, t.event_name, t.event_version, t.source, t.aggregate_type, t.aggregate_id,
             t.correlation_id, t.causation_id, coalesce(t.occurred_at, pg_catalog.now()),
             t.payload::jsonb, t.headers::jsonb,
             coalesce(t.deliver_at,
                      pg_catalog.now() + t.delay_ms * interval '1 millisecond',
                      pg_catalog.now()),
             t.ordering_key
      FROM t
      WHERE NOT EXISTS (SELECT 1 FROM conflicting)
      ON CONFLICT ON CONSTRAINT events_id_key DO UPDATE SET id = EXCLUDED.id
      WHERE (e.event_name, e.event_version, e.aggregate_type, e.aggregate_id, e.payload,
             e.headers - '{traceparent,tracestate}'::text[])
            IS DISTINCT FROM
            (EXCLUDED.event_name, EXCLUDED.event_version, EXCLUDED.aggregate_type,
             EXCLUDED.aggregate_id, EXCLUDED.payload,
             EXCLUDED.headers - '{traceparent,tracestate}'::text[])
      RETURNING e.id, xmax = 0 AS fresh
    )
    SELECT (SELECT count(*) FROM written WHERE fresh),
           coalesce((SELECT c.id FROM conflicting AS c),
                    (SELECT w.id FROM written AS w WHERE NOT w.fresh LIMIT 1))
      INTO inserted, conflict;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.publish_event(p_id text, p_event_name text, p_event_version integer, p_source text, p_aggregate_type text, p_aggregate_id text, p_correlation_id text, p_causation_id text, p_occurred_at timestamp with time zone, p_payload text, p_headers text, p_deliver_at timestamp with time zone, p_delay_ms bigint, p_ordering_key text, OUT inserted bigint, OUT conflict text)
 RETURNS record
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_fresh boolean;
BEGIN
    inserted := 0;
    SELECT e.id INTO conflict FROM pgbus.events AS e
    WHERE e.id = p_id
      AND (e.event_name, e.event_version, e.aggregate_type, e.aggregate_id, e.payload,
           e.headers - '{traceparent,tracestate}'::text[])
          IS DISTINCT FROM
          (p_event_name, p_event_version, p_aggregate_type, p_aggregate_id, p_payload::jsonb,
           p_headers::jsonb - '{traceparent,tracestate}'::text[]);
    IF FOUND THEN
        RETURN;
    END IF;
    INSERT INTO pgbus.events AS e
        (id, event_name, event_version, source, aggregate_type, aggregate_id, correlation_id,
         causation_id, occurred_at, payload, headers, available_at, ordering_key)
    VALUES (p_id, p_event_name, p_event_version, p_source, p_aggregate_type, p_aggregate_id,
            p_correlation_id, p_causation_id, coalesce(p_occurred_at, pg_catalog.now()),
            p_payload::jsonb, p_headers::jsonb,
            coalesce(p_deliver_at, pg_catalog.now() + p_delay_ms * interval '1 millisecond',
                     pg_catalog.now()),
            p_ordering_key)
    ON CONFLICT ON CONSTRAINT events_id_key DO UPDATE SET id = EXCLUDED.id
    WHERE (e.event_name, e.event_version, e.aggregate_type, e.aggregate_id, e.payload,
           e.headers - '{traceparent,tracestate}'::text[])
          IS DISTINCT FROM
          (EXCLUDED.event_name, EXCLUDED.event_version, EXCLUDED.aggregate_type,
           EXCLUDED.aggregate_id, EXCLUDED.payload,
           EXCLUDED.headers - '{traceparent,tracestate}'::text[])
    RETURNING e.xmax = 0 INTO v_fresh;
    IF NOT FOUND THEN
        RETURN;
    ELSIF v_fresh THEN
        inserted := 1;
    ELSE
        conflict := p_id;
    END IF;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.purge_dead(p_subscription text, p_event_id text)
 RETURNS TABLE(purged bigint, failures bigint, promoted bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.ready_at()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    NEW.ready_at := greatest(NEW.available_at, clock_timestamp());
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.reap(max_rows integer)
 RETURNS TABLE(returned bigint, dead bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.reap');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.reap_unlocked(max_rows);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.reap_unlocked(max_rows integer)
 RETURNS TABLE(returned bigint, dead bigint)
 LANGUAGE plpgsql
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_subs text[];
    v_seqs bigint[];
    v_keys text[];
BEGIN
    SELECT array_agg(c.subscription), array_agg(c.event_seq), array_agg(c.ordering_key)
      INTO v_subs, v_seqs, v_keys
    FROM (SELECT d.subscription, d.event_seq, d.ordering_key FROM pgbus.deliveries AS d
          WHERE d.status = 'processing' AND d.locked_until < now()
          ORDER BY d.locked_until
          LIMIT max_rows) AS c;
    IF v_subs IS NULL THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint;
        RETURN;
    END IF;
    PERFORM pgbus.lock_keys(v_subs, v_keys);

    RETURN QUERY
    WITH expired AS (
      SELECT d.subscription, d.event_seq FROM pgbus.deliveries AS d
      JOIN unnest(v_subs, v_seqs) AS c(subscription, event_seq)
        ON d.subscription = c.subscription AND d.event_seq = c.event_seq
      WHERE d.status = 'processing' AND d.locked_until < now()
      FOR UPDATE OF d SKIP LOCKED
    ),
    reaped AS (
      UPDATE pgbus.deliveries AS d
      SET status = CASE WHEN d.attempts >= coalesce(s.max_attempts, 1) THEN 'dead' ELSE 'pending' END,
          is_head = CASE WHEN d.attempts >= coalesce(s.max_attempts, 1)
                              AND d.ordering_key IS NOT NULL AND s.on_dead = 'skip'
                         THEN false ELSE d.is_head END,
          available_at = now(),
          locked_until = NULL,
          last_error = 'lease expired (worker ' || coalesce(d.locked_by, 'unknown') || ')'
      FROM expired LEFT JOIN pgbus.subscriptions AS s ON s.name = expired.subscription
      WHERE d.subscription = expired.subscription AND d.event_seq = expired.event_seq
      RETURNING d.subscription, d.event_seq, d.attempts, d.status, d.last_error, d.locked_by,
                d.ordering_key, d.is_head
    ),
    history AS (
      INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
      SELECT r.subscription, r.event_seq, r.attempts, r.last_error, r.locked_by FROM reaped AS r
    ),
    promoted AS (
      UPDATE pgbus.deliveries AS d SET is_head = true
      FROM (SELECT r.subscription, r.ordering_key FROM reaped AS r
            WHERE r.ordering_key IS NOT NULL AND r.status = 'dead' AND NOT r.is_head) AS v
      WHERE d.subscription = v.subscription
        AND d.event_seq = pgbus.next_of_key(v.subscription, v.ordering_key)
      RETURNING d.event_seq
    ),
    wake AS (
      SELECT pg_notify('pgbus', '')
      FROM (SELECT 1 FROM reaped AS r WHERE r.status = 'pending'
            UNION ALL SELECT 1 FROM promoted) AS x
      LIMIT 1
    )
    SELECT count(*) FILTER (WHERE r.status = 'pending'),
           count(*) FILTER (WHERE r.status = 'dead') + 0 * (SELECT count(*) FROM wake)
    FROM reaped AS r;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.redrive_head(p_subscription text, p_key text)
 RETURNS TABLE(redriven bigint, woke bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    RETURN QUERY
    WITH done AS (
      UPDATE pgbus.deliveries AS d
      SET attempts = CASE WHEN d.status = 'dead' THEN 0 ELSE d.attempts END,
          status = 'pending', available_at = now(),
          locked_until = NULL, locked_by = NULL
      WHERE d.subscription = p_subscription AND d.ordering_key = p_key AND d.is_head
        AND d.status IN ('dead', 'pending')
      RETURNING 1
    )
    SELECT count(*),
           (SELECT count(*) FROM (SELECT pg_notify('pgbus', '') FROM done LIMIT 1) AS n)
    FROM done;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.redrive_seen_head(p_subscription text, p_key text, p_event_id text)
 RETURNS TABLE(redriven bigint, head text, head_status text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.refuse_forged()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    IF NEW.xid IS DISTINCT FROM pg_current_xact_id() THEN
        RAISE EXCEPTION 'pgbus.events.xid is set by pgbus: leave it out of the insert'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'xid';
    END IF;
    NEW.key_pos := NULL;
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.replay(p_subscription text, p_since timestamp with time zone, p_until timestamp with time zone, p_pattern text)
 RETURNS TABLE(found boolean, matched bigint, created bigint, woke bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
    v_boundary pg_snapshot := pgbus.fan_out_boundary();
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
            AND pgbus.passed(e.xid, v_boundary)
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
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.require_read_committed(what text)
 RETURNS void
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF pg_catalog.current_setting('transaction_isolation')
       OPERATOR(pg_catalog.<>) 'read committed' THEN
        RAISE EXCEPTION '% must run in a READ COMMITTED transaction (this one is %)',
            what, pg_catalog.current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.resign(p_id text)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    DELETE FROM pgbus.leader WHERE worker = p_id;
    IF FOUND THEN
        PERFORM pg_notify('pgbus', 'leader');
        RETURN true;
    END IF;
    RETURN false;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.resume_subscription(p_name text)
 RETURNS TABLE(known boolean, since timestamp with time zone, resumed boolean)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_was timestamptz;
    v_known boolean;
BEGIN
    SELECT s.paused_at INTO v_was FROM pgbus.subscriptions AS s
    WHERE s.name = p_name FOR UPDATE;
    v_known := FOUND;
    IF v_was IS NOT NULL THEN
        UPDATE pgbus.subscriptions AS s SET paused_at = NULL, paused_by = NULL
        WHERE s.name = p_name;
        PERFORM pg_notify('pgbus', '');
    END IF;
    RETURN QUERY SELECT v_known, v_was, v_was IS NOT NULL;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.retry_dead(p_subscription text, p_event_id text)
 RETURNS TABLE(retried bigint, woke bigint, subscriptions text[], keys text[])
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    RETURN QUERY
    WITH done AS (
      UPDATE pgbus.deliveries AS d
      SET status = 'pending', attempts = 0, available_at = now(), locked_until = NULL,
          locked_by = NULL
      WHERE d.status = 'dead'
        AND (p_subscription IS NULL OR d.subscription = p_subscription)
        AND (p_event_id IS NULL
             OR d.event_seq = (SELECT e.seq FROM pgbus.events AS e WHERE e.id = p_event_id))
      RETURNING d.subscription, d.ordering_key, d.is_head
    ),
    wake AS (
      SELECT pg_notify('pgbus', '') FROM (SELECT 1 FROM done LIMIT 1) AS x
    )
    SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM wake),
           (SELECT array_agg(r.subscription) FROM done AS r
            WHERE r.ordering_key IS NOT NULL AND NOT r.is_head),
           (SELECT array_agg(r.ordering_key) FROM done AS r
            WHERE r.ordering_key IS NOT NULL AND NOT r.is_head);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.running_too(p_snap pg_snapshot, p_xid xid8)
 RETURNS pg_snapshot
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    -- PL/pgSQL, not SQL: a SQL function with a subquery is planned again at every call,
    -- and every batch calls this one.
    IF p_xid IS NULL OR p_xid >= pg_snapshot_xmax(p_snap) THEN
        RETURN p_snap;
    END IF;
    RETURN (least(pg_snapshot_xmin(p_snap), p_xid)::text || ':'
            || pg_snapshot_xmax(p_snap)::text || ':'
            || (SELECT string_agg(q.x::text, ',' ORDER BY q.x)
                FROM (SELECT pg_snapshot_xip(p_snap) AS x UNION SELECT p_xid) AS q)
           )::pg_snapshot;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.settle(ack_subs text[], ack_seqs bigint[], ack_attempts integer[], fail_subs text[], fail_seqs bigint[], fail_attempts integer[], fail_errors text[], fail_delays_ms bigint[], fail_permanent boolean[], rel_subs text[], rel_seqs bigint[], rel_attempts integer[], worker text)
 RETURNS TABLE(kind text, subscription text, event_seq bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.settle');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.settle_unlocked(
        ack_subs, ack_seqs, ack_attempts, fail_subs, fail_seqs, fail_attempts, fail_errors,
        fail_delays_ms, fail_permanent, rel_subs, rel_seqs, rel_attempts, worker);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.settle_unlocked(ack_subs text[], ack_seqs bigint[], ack_attempts integer[], fail_subs text[], fail_seqs bigint[], fail_attempts integer[], fail_errors text[], fail_delays_ms bigint[], fail_permanent boolean[], rel_subs text[], rel_seqs bigint[], rel_attempts integer[], worker text)
 RETURNS TABLE(kind text, subscription text, event_seq bigint)
 LANGUAGE plpgsql
 SET jit TO 'off'
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_subs text[];
    v_keys text[];
BEGIN
    -- Only deliveries of ordered subscriptions are looked up: with none, this is free.
    SELECT array_agg(d.subscription), array_agg(d.ordering_key) INTO v_subs, v_keys
    FROM (SELECT * FROM unnest(ack_subs, ack_seqs)
          UNION ALL SELECT * FROM unnest(fail_subs, fail_seqs)) AS t(s, q)
    JOIN pgbus.subscriptions AS o ON o.name = t.s AND o.ordered
    JOIN pgbus.deliveries AS d ON d.subscription = t.s AND d.event_seq = t.q
    WHERE d.ordering_key IS NOT NULL
      AND d.subscription = ANY (ack_subs || fail_subs)
      AND d.event_seq = ANY (ack_seqs || fail_seqs);
    IF v_subs IS NOT NULL THEN
        PERFORM pgbus.lock_keys(v_subs, v_keys);
    END IF;

    RETURN QUERY
    WITH acks AS (
      SELECT * FROM unnest(ack_subs, ack_seqs, ack_attempts) AS a(subscription, event_seq, attempt)
    ),
    fails AS (
      SELECT * FROM unnest(fail_subs, fail_seqs, fail_attempts, fail_errors, fail_delays_ms, fail_permanent)
        AS f(subscription, event_seq, attempt, error, delay_ms, permanent)
    ),
    releases AS (
      SELECT * FROM unnest(rel_subs, rel_seqs, rel_attempts) AS r(subscription, event_seq, attempt)
    ),
    acked AS (
      DELETE FROM pgbus.deliveries AS d
      USING acks
      WHERE d.subscription = acks.subscription AND d.event_seq = acks.event_seq
        AND d.subscription = ANY (ack_subs) AND d.event_seq = ANY (ack_seqs)
        AND pg_catalog.cardinality(ack_subs) > 0
        AND d.attempts = acks.attempt AND d.locked_by = worker
      RETURNING d.subscription, d.event_seq, d.ordering_key, d.is_head
    ),
    failed AS (
      UPDATE pgbus.deliveries AS d
      SET status = CASE WHEN fails.permanent OR d.attempts >= coalesce(s.max_attempts, 1)
                        THEN 'dead' ELSE 'pending' END,
          is_head = CASE WHEN (fails.permanent OR d.attempts >= coalesce(s.max_attempts, 1))
                              AND d.ordering_key IS NOT NULL AND s.on_dead = 'skip'
                         THEN false ELSE d.is_head END,
          available_at = now() + fails.delay_ms * interval '1 millisecond',
          locked_until = NULL,
          last_error = fails.error
      FROM fails LEFT JOIN pgbus.subscriptions AS s ON s.name = fails.subscription
      WHERE d.subscription = fails.subscription AND d.event_seq = fails.event_seq
        AND d.subscription = ANY (fail_subs) AND d.event_seq = ANY (fail_seqs)
        AND pg_catalog.cardinality(fail_subs) > 0
        AND d.attempts = fails.attempt AND d.locked_by = worker AND d.status = 'processing'
      RETURNING d.subscription, d.event_seq, d.attempts, d.status, d.ordering_key, d.is_head,
                fails.error
    ),
    history AS (
      INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
      SELECT f.subscription, f.event_seq, f.attempts, f.error, worker FROM failed AS f
    ),
    released AS (
      UPDATE pgbus.deliveries AS d
      SET status = 'pending', attempts = d.attempts - 1, locked_until = NULL, available_at = now()
      FROM releases
      WHERE d.subscription = releases.subscription AND d.event_seq = releases.event_seq
        AND d.subscription = ANY (rel_subs) AND d.event_seq = ANY (rel_seqs)
        AND pg_catalog.cardinality(rel_subs) > 0
        AND d.attempts = releases.attempt AND d.locked_by = worker AND d.status = 'processing'
      RETURNING d.subscription, d.event_seq
    ),
    vacated AS (
      SELECT x.subscription, x.ordering_key FROM acked AS x
       WHERE x.ordering_key IS NOT NULL AND x.is_head
      UNION
      SELECT x.subscription, x.ordering_key FROM failed AS x
       WHERE x.ordering_key IS NOT NULL AND x.status = 'dead' AND NOT x.is_head
    ),
    promoted AS (
      UPDATE pgbus.deliveries AS d SET is_head = true
      FROM vacated AS v
      WHERE d.subscription = v.subscription
        AND d.event_seq = pgbus.next_of_key(v.subscription, v.ordering_key)
      RETURNING d.subscription, d.event_seq
    ),
    wake AS (
      SELECT pg_notify('pgbus', '') FROM (SELECT 1 FROM promoted LIMIT 1) AS x
      WHERE pgbus.notify_needed()
    )
    SELECT 'ack'::text, a.subscription, a.event_seq FROM acks AS a
     WHERE NOT EXISTS (SELECT 1 FROM acked AS x
                       WHERE x.subscription = a.subscription AND x.event_seq = a.event_seq)
    UNION ALL
    SELECT 'fail', f.subscription, f.event_seq FROM fails AS f
     WHERE NOT EXISTS (SELECT 1 FROM failed AS x
                       WHERE x.subscription = f.subscription AND x.event_seq = f.event_seq)
    UNION ALL
    SELECT 'release', r.subscription, r.event_seq FROM releases AS r
     WHERE NOT EXISTS (SELECT 1 FROM released AS x
                       WHERE x.subscription = r.subscription AND x.event_seq = r.event_seq)
    UNION ALL
    SELECT 'dead', x.subscription, x.event_seq FROM failed AS x WHERE x.status = 'dead'
    UNION ALL
    SELECT 'promoted', p.subscription, p.event_seq FROM promoted AS p
    UNION ALL
    SELECT 'woke', NULL, NULL FROM wake;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.skip_dead_head(p_subscription text, p_key text)
 RETURNS TABLE(skipped bigint, promoted bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.skip_dead_head');
    PERFORM pgbus.lock_config(false);
    RETURN QUERY SELECT * FROM pgbus.skip_dead_head_unlocked(p_subscription, p_key);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.skip_dead_head_unlocked(p_subscription text, p_key text)
 RETURNS TABLE(skipped bigint, promoted bigint)
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
BEGIN
    RETURN QUERY SELECT * FROM pgbus.skip_dead_head_unlocked(p_subscription, p_key, NULL);
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.skip_dead_head_unlocked(p_subscription text, p_key text, p_event_id text)
 RETURNS TABLE(skipped bigint, promoted bigint)
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.skip_seen_head(p_subscription text, p_key text, p_event_id text)
 RETURNS TABLE(skipped text, promoted text, head text, head_status text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.snapshot_of_others()
 RETURNS pg_snapshot
 LANGUAGE sql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT pgbus.running_too(pg_current_snapshot(), pg_current_xact_id_if_assigned())
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.subscriptions_matching(event_name text)
 RETURNS TABLE(subscription text, ordered boolean)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT s.name, s.ordered
    FROM pgbus.subscriptions AS s
    WHERE s.name OPERATOR(pg_catalog.=) ANY (
        SELECT p.subscription
        FROM pgbus.name_keys(subscriptions_matching.event_name) AS k
        JOIN pgbus.subscription_patterns AS p
          ON p.prefix OPERATOR(pg_catalog.=) k.prefix AND p.exact OPERATOR(pg_catalog.=) k.exact)
$function$;

CREATE OR REPLACE FUNCTION pgbus.sweep(retention_ms bigint, max_rows integer, lock_key bigint)
 RETURNS TABLE(got boolean, events bigint, failures bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
 SET jit TO 'off'
AS $function$
DECLARE
    v_cutoff timestamptz;
    v_boundary pg_snapshot;
BEGIN
    IF retention_ms IS NULL OR retention_ms < 0 OR max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION 'pgbus.sweep: retention must be at least 0 and max_rows at least 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM pgbus.duties AS d WHERE d.name = 'sweep' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    -- What committed becomes deliveries first (in READ COMMITTED, as every batch), so
    -- that a sweep right after a bus starts, before its first claim, does not keep
    -- until the next sweep events that no delivery needs. Then the boundary, read after
    -- the duty's lock and the batch: this transaction's own batch, and one that
    -- committed before, passed their events with their deliveries, which the statement
    -- below sees.
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM pgbus.fan_out_committed();
    END IF;
    SELECT c.boundary INTO v_boundary FROM pgbus.fan_out_cursor AS c;
    SELECT pg_catalog.now() - greatest(LEAST(retention_ms, 9000000000000000) * interval '1 millisecond',
                                       st.min_retention)
      INTO v_cutoff
    FROM pgbus.settings AS st;
    RETURN QUERY
    WITH RECURSIVE subs AS (
      (SELECT d.subscription FROM pgbus.deliveries AS d ORDER BY d.subscription LIMIT 1)
      UNION ALL
      SELECT (SELECT d.subscription FROM pgbus.deliveries AS d
              WHERE d.subscription > subs.subscription
              ORDER BY d.subscription LIMIT 1)
      FROM subs WHERE subs.subscription IS NOT NULL
    ),
    doomed AS (
      SELECT e.seq FROM pgbus.events AS e
      WHERE e.created_at < v_cutoff
        AND pgbus.passed(e.xid, v_boundary)
        AND NOT EXISTS (SELECT 1 FROM subs
                        JOIN pgbus.deliveries AS d
                          ON d.subscription = subs.subscription AND d.event_seq = e.seq)
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
$function$;

CREATE OR REPLACE FUNCTION pgbus.try_configure_subscription(p_name text, p_patterns text[], p_max_attempts integer, p_ordered boolean, p_on_dead text, p_wait_ms integer)
 RETURNS TABLE(got boolean, found boolean, converted bigint, waiting_on jsonb)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
DECLARE
    v_was boolean;
    v_now boolean;
    v_converted bigint := 0;
    v_waiting jsonb;
BEGIN
    PERFORM pgbus.require_read_committed('pgbus.configure_subscription');
    v_waiting := pgbus.try_lock_config(p_wait_ms);
    IF v_waiting IS NOT NULL THEN
        RETURN QUERY SELECT false, NULL::boolean, 0::bigint, v_waiting;
        RETURN;
    END IF;
    -- What committed under the old settings becomes deliveries under them.
    PERFORM pgbus.fan_out_committed();
    SELECT s.ordered INTO v_was FROM pgbus.subscriptions AS s WHERE s.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT true, false, 0::bigint, NULL::jsonb;
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
    RETURN QUERY SELECT true, true, v_converted, NULL::jsonb;
END
$function$;

CREATE OR REPLACE FUNCTION pgbus.try_lock_config(wait_ms integer)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
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
$function$;

-- No pinned search_path: it runs on its caller's, so every name in it must be
-- schema-qualified (sql/0012_pinned_paths.sql; tests/hostile_neighbour.rs keeps the list).
CREATE OR REPLACE FUNCTION pgbus.uuid_v7()
 RETURNS uuid
 LANGUAGE sql
 PARALLEL SAFE
AS $function$
    SELECT pg_catalog.encode(
        pg_catalog.set_bit(pg_catalog.set_bit(
            overlay(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                    placing substring(pg_catalog.int8send(pg_catalog.int8(
                        extract(epoch FROM pg_catalog.clock_timestamp())
                        OPERATOR(pg_catalog.*) 1000)) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::pg_catalog.uuid
$function$;

CREATE OR REPLACE FUNCTION pgbus.valid_name(name text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$SELECT octet_length(name) BETWEEN 1 AND 255 AND name !~ E'[\\u0001-\\u001f\\u007f-\\u009f\\u00ad\\u034f\\u061c\\u115f-\\u1160\\u17b4-\\u17b5\\u180b-\\u180f\\u200b-\\u200f\\u202a-\\u202e\\u2060-\\u206f\\u3164\\ufe00-\\ufe0f\\ufeff\\uffa0\\ufff0-\\ufff8\\U0001bca0-\\U0001bca3\\U0001d173-\\U0001d17a\\U000e0000-\\U000e0fff\\u2028-\\u2029\\u0009-\\u000d\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u202f\\u205f\\u3000*]'$function$;

CREATE OR REPLACE FUNCTION pgbus.valid_pattern(pattern text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT pattern = '*'
        OR pgbus.valid_name(pattern)
        OR (right(pattern, 2) = '.*' AND pgbus.valid_name(left(pattern, -2)))
$function$;

CREATE OR REPLACE FUNCTION pgbus.valid_patterns(patterns text[])
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$
    SELECT cardinality(patterns) > 0
       AND NOT EXISTS (SELECT 1 FROM unnest(patterns) AS p
                       WHERE p IS NULL OR NOT pgbus.valid_pattern(p))
$function$;

CREATE OR REPLACE FUNCTION pgbus.visible_text(t text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'pg_catalog', 'pgbus', 'pg_temp'
AS $function$SELECT t !~ E'[\\u0001-\\u001f\\u007f-\\u009f\\u00ad\\u034f\\u061c\\u115f-\\u1160\\u17b4-\\u17b5\\u180b-\\u180f\\u200b-\\u200f\\u202a-\\u202e\\u2060-\\u206f\\u3164\\ufe00-\\ufe0f\\ufeff\\uffa0\\ufff0-\\ufff8\\U0001bca0-\\U0001bca3\\U0001d173-\\U0001d17a\\U000e0000-\\U000e0fff\\u2028-\\u2029]'$function$;

-- Privileges (object: grantee=privileges; none listed: the owner's alone)

-- function pgbus.ack_in(text,bigint,integer,text): owner=EXECUTE
-- function pgbus.backlog(text[],bigint): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.beat(text,bigint,text[],text,boolean,bigint): owner=EXECUTE
-- function pgbus.claim(text[],integer[],integer,bigint,text,integer,bigint): owner=EXECUTE
-- function pgbus.claim(text[],integer[],integer,bigint,text,integer,bigint,timestamp with time zone[]): owner=EXECUTE
-- function pgbus.claim_due(text[],integer[],integer,bigint,text,integer,bigint): owner=EXECUTE
-- function pgbus.claim_due(text[],integer[],integer,bigint,text,integer,bigint,timestamp with time zone[]): owner=EXECUTE
-- function pgbus.configure_subscription(text,text[],integer,boolean,text): owner=EXECUTE
-- function pgbus.consumer_beat_at(): owner=EXECUTE
-- function pgbus.done_recently(double precision,text,bigint,bigint): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.ensure_heads(text[],text[]): owner=EXECUTE
-- function pgbus.ensure_heads_unlocked(text[],text[]): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.ensure_order_key_trigger(): owner=EXECUTE
-- function pgbus.event_key(text,text,text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.events_are_immutable(): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.extend_leases(text[],bigint[],integer[],bigint,text): owner=EXECUTE
-- function pgbus.fan_out_boundary(): PUBLIC=EXECUTE owner=EXECUTE
-- function pgbus.fan_out_committed(): owner=EXECUTE
-- function pgbus.gate_new_ordered(): owner=EXECUTE
-- function pgbus.grant_consumer(regrole): owner=EXECUTE
-- function pgbus.grant_operator(regrole): owner=EXECUTE
-- function pgbus.grant_publisher(regrole): owner=EXECUTE
-- function pgbus.head_of_key(text,text): owner=EXECUTE
-- function pgbus.heartbeat(text,bigint,text[],text,boolean): owner=EXECUTE
-- function pgbus.index_patterns(): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.join_subscription(text,text[],integer,boolean,text): owner=EXECUTE
-- function pgbus.leave(text): owner=EXECUTE
-- function pgbus.lock_config(boolean): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.lock_keys(text[],text[]): owner=EXECUTE
-- function pgbus.lock_publish_keys(text[],text[]): owner=EXECUTE
-- function pgbus.mark_asleep(text): owner=EXECUTE
-- function pgbus.name_keys(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.next_of_key(text,text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.not_fanned_out(bigint): PUBLIC=EXECUTE owner=EXECUTE
-- function pgbus.notify_at_commit(): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.notify_needed(): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.order_key(): owner=EXECUTE
-- function pgbus.ordered_needs_trigger(): owner=EXECUTE
-- function pgbus.orders_keys(): PUBLIC=EXECUTE owner=EXECUTE
-- function pgbus.passed(xid8,pg_snapshot): PUBLIC=EXECUTE owner=EXECUTE
-- function pgbus.pattern_key(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.pattern_matches(text,text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.pause_subscription(text): owner=EXECUTE
-- function pgbus.promote_orphans(integer): owner=EXECUTE
-- function pgbus.publish(text,jsonb,jsonb,text,text,text,text,text,text,integer,timestamp with time zone,text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.publish_batch(text[],text[],integer[],text[],text[],text[],text[],text[],timestamp with time zone[],text[],text[],timestamp with time zone[],bigint[],text[]): owner=EXECUTE
-- function pgbus.publish_event(text,text,integer,text,text,text,text,text,timestamp with time zone,text,text,timestamp with time zone,bigint,text): owner=EXECUTE
-- function pgbus.purge_dead(text,text): owner=EXECUTE
-- function pgbus.ready_at(): owner=EXECUTE
-- function pgbus.reap(integer): owner=EXECUTE
-- function pgbus.reap_unlocked(integer): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.redrive_head(text,text): owner=EXECUTE
-- function pgbus.redrive_seen_head(text,text,text): owner=EXECUTE
-- function pgbus.refuse_forged(): owner=EXECUTE
-- function pgbus.replay(text,timestamp with time zone,timestamp with time zone,text): owner=EXECUTE
-- function pgbus.require_read_committed(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.resign(text): owner=EXECUTE
-- function pgbus.resume_subscription(text): owner=EXECUTE
-- function pgbus.retry_dead(text,text): owner=EXECUTE
-- function pgbus.running_too(pg_snapshot,xid8): PUBLIC=EXECUTE owner=EXECUTE
-- function pgbus.settle(text[],bigint[],integer[],text[],bigint[],integer[],text[],bigint[],boolean[],text[],bigint[],integer[],text): owner=EXECUTE
-- function pgbus.settle_unlocked(text[],bigint[],integer[],text[],bigint[],integer[],text[],bigint[],boolean[],text[],bigint[],integer[],text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.skip_dead_head(text,text): owner=EXECUTE
-- function pgbus.skip_dead_head_unlocked(text,text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.skip_dead_head_unlocked(text,text,text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.skip_seen_head(text,text,text): owner=EXECUTE
-- function pgbus.snapshot_of_others(): PUBLIC=EXECUTE owner=EXECUTE
-- function pgbus.subscriptions_matching(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.sweep(bigint,integer,bigint): owner=EXECUTE
-- function pgbus.try_configure_subscription(text,text[],integer,boolean,text,integer): owner=EXECUTE
-- function pgbus.try_lock_config(integer): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.uuid_v7(): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.valid_name(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.valid_pattern(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.valid_patterns(text[]): default (PUBLIC=EXECUTE owner=EXECUTE)
-- function pgbus.visible_text(text): default (PUBLIC=EXECUTE owner=EXECUTE)
-- schema pgbus: default
-- sequence pgbus.delivery_failures_id_seq: default
-- sequence pgbus.events_seq_seq: default
-- sequence pgbus.fan_out_ticks_tick_seq: default
-- sequence pgbus.key_pos_seq: default
-- table pgbus.config_gate: owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.consumers: default
-- table pgbus.deliveries: default
-- table pgbus.delivery_failures: default
-- table pgbus.duties: owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.events: default
-- table pgbus.fan_out_cursor: PUBLIC=SELECT owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.fan_out_lock: owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.fan_out_ticks: PUBLIC=SELECT owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.key_stripes: owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.leader: owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.publish_stripes: owner=DELETE,INSERT,REFERENCES,SELECT,TRIGGER,TRUNCATE,UPDATE
-- table pgbus.schema_migrations: default
-- table pgbus.settings: default
-- table pgbus.subscription_patterns: default
-- table pgbus.subscriptions: default
