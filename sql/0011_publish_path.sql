-- pgbus schema, version 11: a cheaper publish path.
--
-- What a publishing transaction pays for, measured per event with a profile of the
-- server: planning that was repeated on every call, where a plan can be kept.
--
-- 1. The client libraries' publish statement becomes two functions, pgbus.publish_batch
--    and pgbus.publish_event (one event), so that their plans are cached per session. `pgbus::publish`, `publish_batch` and
--    `pgbus::sqlx` sent the statement below unnamed on every call (so that it works
--    behind transaction-mode poolers); the server parsed and planned the whole statement
--    each time, which cost more than executing it. PL/pgSQL caches the plans of the
--    statements in a function's body per session, and the call
--    `SELECT * FROM pgbus.publish_batch($1, ... $14)` is cheap to plan unnamed.
-- 2. The notification's decision at commit reads pgbus.consumers in a statement of the
--    trigger's own (a plan kept for the session) instead of calling the SQL function
--    pgbus.notify_needed(), whose body has subqueries and so is never inlined: it was
--    parsed and planned again at every commit. The "first event of the transaction"
--    test runs built-in functions in the trigger's WHEN clause instead of a SQL function
--    whose body was parsed again for every statement.
-- 3. The CHECK constraints on event names and identifiers spell their tests out instead
--    of calling pgbus.valid_name() and pgbus.visible_text(): a constraint's expression is
--    prepared for every INSERT statement, and each SQL function in it was parsed again
--    to be inlined. Same rules, same constraint names.
-- 4. The index on deliveries.event_seq alone goes: every publish and every claim wrote
--    into it, and what read it can probe the primary key instead.
-- 5. The claim statement runs inside a function, pgbus.claim, with a plan built once per
--    session instead of once per claim.

-- 1. Publishing from the client libraries. One event or many: the parameters are one
-- array per column, in the order of the columns below (a single event is a batch of one).
-- Returns one row: `inserted`, how many events were inserted, and `conflict`, the id of
-- an event already in the log with different content (NULL when none does); on a
-- conflict nothing is inserted.
--
-- The content compared is the name, version, aggregate, payload and headers, less the
-- trace context (`traceparent`, `tracestate`: they describe one attempt to publish, as a
-- correlation id does), so a retry from another trace is a duplicate. `conflicting` finds
-- an id already in the log with different content. A conflicting row committed after
-- this statement's snapshot is caught by ON CONFLICT, whose no-op update makes it visible
-- in RETURNING; an identical one is left alone and returns nothing (a duplicate).
--
-- SECURITY INVOKER (the default): the caller needs the publisher's grants on the log, as
-- for an INSERT of its own. No `SET` clause: a function with one pays for a
-- configuration save and restore on every call, and every name here is qualified.
CREATE FUNCTION pgbus.publish_batch(
    ids             text[],
    event_names     text[],
    event_versions  integer[],
    sources         text[],
    aggregate_types text[],
    aggregate_ids   text[],
    correlation_ids text[],
    causation_ids   text[],
    occurred_ats    timestamptz[],
    payloads        text[],
    headers         text[],
    deliver_ats     timestamptz[],
    delays_ms       bigint[],
    ordering_keys   text[],
    OUT inserted bigint,
    OUT conflict text
) RETURNS record
LANGUAGE plpgsql AS $fn$
BEGIN
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
$fn$;

-- One event: the same contract as a batch of one, with scalar parameters. Cheaper than
-- the batch's statement for a single event (no arrays to decode and expand, no join):
-- an id already in the log is compared first and then nothing is written; otherwise the
-- insert, whose ON CONFLICT catches a row committed meanwhile as the batch's does.
CREATE FUNCTION pgbus.publish_event(
    p_id text, p_event_name text, p_event_version integer, p_source text,
    p_aggregate_type text, p_aggregate_id text, p_correlation_id text, p_causation_id text,
    p_occurred_at timestamptz, p_payload text, p_headers text, p_deliver_at timestamptz,
    p_delay_ms bigint, p_ordering_key text, OUT inserted bigint, OUT conflict text)
RETURNS record LANGUAGE plpgsql AS $fn$
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
$fn$;

-- Publishers call them (EXECUTE is also PUBLIC's by default; the grant says it).
CREATE OR REPLACE FUNCTION pgbus.grant_publisher(publisher regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA pgbus TO %s', publisher);
    EXECUTE format('GRANT SELECT, UPDATE (id), INSERT (id, event_name, event_version, source, '
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
$$;

-- 2. The notification's decision at commit (see migration 5 for the lock's protocol).
-- One scan of pgbus.consumers: notify when a live consumer is asleep, or when none is
-- live (bool_or over no rows is NULL).
CREATE OR REPLACE FUNCTION pgbus.notify_at_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $$
BEGIN
    PERFORM pg_catalog.set_config('pgbus.notify_queued', 'off', true),
            pg_catalog.pg_advisory_xact_lock_shared(8099550711435458411);
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed'
       OR (SELECT coalesce(bool_or(NOT c.awake), true)
           FROM pgbus.consumers AS c
           WHERE c.expires_at > pg_catalog.clock_timestamp()) THEN
        PERFORM pg_catalog.pg_notify('pgbus', '');
    END IF;
    RETURN NULL;
END
$$;

-- The first event of a transaction queues the check, the others do not: the marker is a
-- transaction-local setting, so a rolled-back savepoint forgets it with its rows.
DROP TRIGGER events_notify ON pgbus.events;
CREATE CONSTRAINT TRIGGER events_notify
    AFTER INSERT ON pgbus.events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (CASE WHEN pg_catalog.current_setting('pgbus.notify_queued', true) = 'on' THEN false
               ELSE pg_catalog.set_config('pgbus.notify_queued', 'on', true) = 'on' END)
    EXECUTE FUNCTION pgbus.notify_at_commit();
DROP FUNCTION pgbus.first_event_in_transaction();

-- 3. The same rules as pgbus.valid_name() and pgbus.visible_text(), written out. NOT
-- VALID: every stored row passed the equivalent constraint it replaces, so the log is
-- not scanned again.
DO $$
DECLARE
    -- visible_text's bracket of refused characters (it depends on the encoding).
    v_class text := (SELECT substring(p.prosrc FROM $re$^SELECT t !~ '(.*)'$re$)
                     FROM pg_catalog.pg_proc AS p
                     WHERE p.oid = 'pgbus.visible_text(text)'::pg_catalog.regprocedure);
BEGIN
    IF v_class IS NULL THEN
        RAISE EXCEPTION 'pgbus.visible_text() does not have the body migration 7 gave it';
    END IF;
    ALTER TABLE pgbus.events
        DROP CONSTRAINT events_event_name_check,
        DROP CONSTRAINT events_ids_visible;
    EXECUTE pg_catalog.format(
        'ALTER TABLE pgbus.events
           ADD CONSTRAINT events_event_name_check
             CHECK (octet_length(event_name) BETWEEN 1 AND 255
                    AND event_name !~ %L AND event_name !~ %L) NOT VALID,
           ADD CONSTRAINT events_ids_visible
             CHECK ((id || coalesce(correlation_id, %L) || coalesce(causation_id, %L)
                     || coalesce(aggregate_type, %L) || coalesce(aggregate_id, %L)
                     || coalesce(ordering_key, %L) || coalesce(source, %L)) !~ %L) NOT VALID',
        '[[:space:][:cntrl:]*]', v_class, '', '', '', '', '', '', v_class);
END
$$;

-- 4. No index on deliveries.event_seq alone. Each publish wrote an entry into it for
-- every delivery, and each claim another (a claim's update cannot be HOT: status is in
-- the partial indexes' predicates). What used it now goes through the primary key,
-- (subscription, event_seq): the retention sweep probes it once per subscription that
-- has deliveries, and the fan-out under REPEATABLE READ once per ordered subscription;
-- dead letters by event use deliveries_dead_seq_idx.
DROP INDEX pgbus.deliveries_event_seq_idx;

-- The fan-out of migration 5, but for the statement that finds the first new delivery of
-- each key under REPEATABLE READ or SERIALIZABLE, which probes the primary key.
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
            FROM new_events AS e
            JOIN pgbus.subscriptions AS s ON s.ordered
            JOIN pgbus.deliveries AS d ON d.subscription = s.name AND d.event_seq = e.seq
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


-- The sweep of migration 5, but for "does any delivery still refer to this event?":
-- the subscriptions that have deliveries (a skip scan of the primary key, in the same
-- statement and snapshot, so a delivery of a subscription that has no row in
-- pgbus.subscriptions counts too), then one probe of the primary key for each.
CREATE OR REPLACE FUNCTION pgbus.sweep(retention_ms bigint, max_rows integer, lock_key bigint)
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
$$;

-- 5. Claiming, with a plan built once per session. The bus's claim statement (CLAIM in
-- the library's statements module, which a test compares with this body) was prepared
-- once per connection, but PostgreSQL planned it again for the given values on every
-- claim while deliveries were pending (a custom plan each time: the generic one's
-- estimates looked worse), which cost more than running it. Here it runs with a generic
-- plan that PL/pgSQL keeps for the session, behind a pooler too. The statement writes the
-- lease by the locked rows' ctids, so no generic plan can reach them through a scan of
-- the table. SECURITY INVOKER: the consumer's own rights, as for the statement itself.
CREATE FUNCTION pgbus.claim(text[], integer[], integer, bigint, text, integer, bigint)
RETURNS TABLE (secs float8, subscription text, attempts integer, seq bigint, id text,
               event_name text, event_version integer, source text, aggregate_type text,
               aggregate_id text, correlation_id text, causation_id text,
               occurred_at timestamptz, payload jsonb, headers jsonb, created_at timestamptz,
               ordering_key text, waited float8, cut boolean)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET jit = off AS $fn$
#variable_conflict use_column
BEGIN
RETURN QUERY
WITH subs AS (
  SELECT * FROM unnest($1::text[], $2::int4[]) AS s(name, quota)
),
picked AS (
  SELECT p.row_id, p.subscription, p.event_seq, p.available_at
  FROM subs CROSS JOIN LATERAL (
    SELECT d.ctid AS row_id, d.subscription, d.event_seq, d.available_at
    FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
      AND d.available_at <= now()
    ORDER BY d.available_at, d.event_seq
    LIMIT subs.quota
    FOR UPDATE SKIP LOCKED
  ) AS p
  ORDER BY p.available_at, p.event_seq
  LIMIT $3
),
sized AS (
  SELECT p.row_id, p.subscription, p.event_seq,
         row_number() OVER w AS n,
         sum(coalesce((SELECT pg_column_size(e.payload)::int8 + pg_column_size(e.headers)
                       FROM pgbus.events AS e WHERE e.seq = p.event_seq), 0)) OVER w AS bytes
  FROM picked AS p
  WINDOW w AS (ORDER BY p.available_at, p.event_seq, p.subscription
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
  RETURNING d.subscription, d.event_seq, d.attempts, d.available_at
),
awake AS (
  UPDATE pgbus.consumers SET awake = true
  WHERE id = $5 AND NOT awake AND (SELECT count(*) FROM claimed) >= $6
  RETURNING 1
),
next_due AS (
  SELECT extract(epoch FROM min(n.available_at) - now())::float8 AS secs
  FROM subs CROSS JOIN LATERAL (
    SELECT d.available_at FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
      AND d.available_at > now() AND d.available_at < 'infinity'
    ORDER BY d.available_at, d.event_seq
    LIMIT 1
  ) AS n
)
SELECT next_due.secs, c.subscription, c.attempts,
       e.seq, e.id, e.event_name, e.event_version, e.source, e.aggregate_type,
       e.aggregate_id, e.correlation_id, e.causation_id, e.occurred_at, e.payload,
       e.headers, e.created_at, e.ordering_key,
       (extract(epoch FROM now()) - extract(epoch FROM c.available_at))::float8 AS waited,
       (SELECT count(*) FROM sized) > (SELECT count(*) FROM kept) AS cut
FROM next_due
LEFT JOIN (claimed AS c JOIN pgbus.events AS e ON e.seq = c.event_seq) ON true
ORDER BY e.seq;
END
$fn$;
