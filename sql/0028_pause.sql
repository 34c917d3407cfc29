-- pgbus schema, version 28: a subscription can be paused.
--
-- An operator pauses a subscription (pgbus.pause_subscription) to stop it handing out
-- deliveries, say while a downstream system is down, and resumes it
-- (pgbus.resume_subscription) to deliver what waited. While it is paused:
-- - publishing goes on: its deliveries are made as before, and wait;
-- - the claim takes none of its deliveries and reports no next due time for it, and its
--   floor stays where it was, so a resumed claim from that floor still finds every
--   delivery made meanwhile (the floor invariant of migration 24);
-- - what its consumers hold when it is paused is settled as usual, an expired lease is
--   reaped as usual, and an ordered key's next delivery is still promoted when its head
--   settles: on resume every key goes on in order from its head;
-- - its consumers stay connected; pgbus.backlog says it is paused (the gauge).
-- Resuming notifies the buses, so a sleeping consumer claims at once. Both functions run
-- with the owner's rights and are the operator's (pgbus.grant_operator): pausing is a
-- change of delivery, as skipping a head or purging a dead letter is.
--
-- Every statement can run again.

ALTER TABLE pgbus.subscriptions ADD COLUMN IF NOT EXISTS paused_at timestamptz;
ALTER TABLE pgbus.subscriptions ADD COLUMN IF NOT EXISTS paused_by text;

CREATE OR REPLACE FUNCTION pgbus.pause_subscription(p_name text)
RETURNS TABLE (known boolean, since timestamptz, already boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
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
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.pause_subscription(text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgbus.resume_subscription(p_name text)
RETURNS TABLE (known boolean, since timestamptz, resumed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
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
$fn$;
REVOKE EXECUTE ON FUNCTION pgbus.resume_subscription(text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer,
                                           bigint, timestamptz[])
RETURNS TABLE (secs float8, subscription text, attempts integer, seq bigint, id text,
               event_name text, event_version integer, source text, aggregate_type text,
               aggregate_id text, correlation_id text, causation_id text,
               occurred_at timestamptz, payload jsonb, headers jsonb, created_at timestamptz,
               ordering_key text, waited float8, cut boolean, floors timestamptz[])
LANGUAGE plpgsql SECURITY DEFINER SET plan_cache_mode = force_generic_plan SET jit = off
SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
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
$fn$;

-- The gauges' sample says which subscriptions are paused: a new column, so the function
-- is made again (it is PUBLIC's, as migration 10 made it).
DROP FUNCTION IF EXISTS pgbus.backlog(text[], bigint);
CREATE FUNCTION pgbus.backlog(subscriptions text[], cap bigint)
RETURNS TABLE (subscription text, due bigint, scheduled bigint, processing bigint,
               dead bigint, oldest_due_age float8, blocked_keys bigint,
               paused boolean)
LANGUAGE sql STABLE SET jit = off SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
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
$fn$;

CREATE OR REPLACE FUNCTION pgbus.grant_operator(operator regrole) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pgbus, pg_temp AS $$
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
                   'pgbus.ensure_heads(text[], text[]), '
                   'pgbus.retry_dead(text, text), '
                   'pgbus.redrive_head(text, text), '
                   'pgbus.pause_subscription(text), '
                   'pgbus.resume_subscription(text) TO %s', operator);
END
$$;
REVOKE EXECUTE ON FUNCTION pgbus.grant_operator(regrole) FROM PUBLIC;

-- Whoever operates may pause and resume: the roles granted the operator's functions.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT a.grantee::regrole AS role
        FROM pg_catalog.pg_proc AS p,
             pg_catalog.aclexplode(p.proacl) AS a
        WHERE p.oid = 'pgbus.purge_dead(text, text)'::regprocedure
          AND a.grantee <> 0 AND a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgbus.pause_subscription(text), '
                       'pgbus.resume_subscription(text) TO %s', r.role);
    END LOOP;
END
$$;
