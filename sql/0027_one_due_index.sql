-- pgbus schema, version 27: one due-time index on the deliveries.
--
-- Migration 24 gave the claim its own index, deliveries_ready_idx (subscription,
-- ready_at, event_seq), and kept the older deliveries_claim_idx (subscription,
-- available_at, event_seq) for the three reads that still ordered by the due time: the
-- claim's next due time, the gauges' counts (pgbus.backlog) and the claim of buses older
-- than migration 24. Both cover every pending head, so every delivery made, claimed,
-- failed, released or promoted wrote an entry into each: the drain measured 5-6% slower
-- at fan-out 1 and 11-13% at fan-out 4 than with one index (BENCHMARKS.md, "What the
-- claim's index costs the drain").
--
-- Those reads now use deliveries_ready_idx, and deliveries_claim_idx goes. A pending head
-- became claimable at ready_at, which is never before its available_at (the ready_at
-- trigger of migration 24), so:
-- - a head due later has ready_at = available_at: the next due time is the first entry
--   after now();
-- - the gauges count due heads as ready_at <= now() and scheduled ones as ready_at >
--   now(); the oldest due age is still the time since the oldest due head fell due (its
--   available_at: after an outage, since the event was published, not since the bus
--   came back and made its delivery), read as the earliest available_at among the first
--   100 claimable heads by ready_at: heads become claimable in about the order they fall
--   due, and 100 entries and rows cost the sample little whatever the backlog;
-- - the claim without floors (seven arguments, a bus older than migration 24) is the
--   claim with no floor.
--
-- Every statement can run again.

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
  SELECT * FROM unnest($1::text[], $2::int4[], $8::timestamptz[]) WITH ORDINALITY
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
    LIMIT subs.quota
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
           CASE WHEN whole.took_all
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
    LIMIT 1
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

CREATE OR REPLACE FUNCTION pgbus.claim_due(text[], integer[], integer, bigint, text, integer,
                                           bigint)
RETURNS TABLE (secs float8, subscription text, attempts integer, seq bigint, id text,
               event_name text, event_version integer, source text, aggregate_type text,
               aggregate_id text, correlation_id text, causation_id text,
               occurred_at timestamptz, payload jsonb, headers jsonb, created_at timestamptz,
               ordering_key text, waited float8, cut boolean)
LANGUAGE plpgsql SECURITY DEFINER SET jit = off
SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
BEGIN
RETURN QUERY
SELECT c.secs, c.subscription, c.attempts, c.seq, c.id, c.event_name, c.event_version,
       c.source, c.aggregate_type, c.aggregate_id, c.correlation_id, c.causation_id,
       c.occurred_at, c.payload, c.headers, c.created_at, c.ordering_key, c.waited, c.cut
FROM pgbus.claim_due($1, $2, $3, $4, $5, $6, $7, '{}'::timestamptz[]) AS c;
END
$fn$;

CREATE OR REPLACE FUNCTION pgbus.backlog(subscriptions text[], cap bigint)
RETURNS TABLE (subscription text, due bigint, scheduled bigint, processing bigint,
               dead bigint, oldest_due_age float8, blocked_keys bigint)
LANGUAGE sql STABLE SET jit = off SET search_path = pg_catalog, pgbus, pg_temp AS $fn$
WITH subs AS (
  SELECT s.name FROM pgbus.subscriptions AS s
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
       dead.blocked AS blocked_keys
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

DROP INDEX IF EXISTS pgbus.deliveries_claim_idx;
