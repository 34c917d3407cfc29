-- pgbus schema, version 10: the backlog gauges' sample (src/sql.rs, BACKLOG).
--
-- One row per subscription ($1: these names, NULL: every registered one), each count
-- bounded by $2 (NULL: no bound): due (pending and due now, the claimable heads and the
-- deliveries waiting behind their key's head), scheduled (pending, due later), processing,
-- dead; the age in seconds of the oldest claimable due delivery (NULL when none); the
-- keys blocked by a dead head. Every count is an index range (deliveries_claim_idx,
-- deliveries_key_idx, deliveries_dead_idx, deliveries_reap_idx for the leased ones, as
-- many as the consumers hold), so a sample costs at most a few times $2 index entries
-- per subscription, whatever the backlog. Each capped count reads its rows in its index's
-- order (ORDER BY), so the planner never trades the index for a sequential scan that
-- stops at the cap: that scan reads the whole table when the subscription has fewer.
--
-- A function for one setting: jit = off. pgbus.subscriptions is a table of a few rows
-- that is rarely analyzed, so the planner guesses hundreds of subscriptions and costs
-- the statement above jit_above_cost: compiling it took half a second, a hundred times
-- what running it takes (as for the fan-out, version 2).
CREATE FUNCTION pgbus.backlog(subscriptions text[], cap bigint)
RETURNS TABLE (subscription text, due bigint, scheduled bigint, processing bigint,
               dead bigint, oldest_due_age float8, blocked_keys bigint)
LANGUAGE sql STABLE
SET jit = off
AS $fn$
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
         AND d.available_at <= now()
       ORDER BY d.available_at, d.event_seq
       LIMIT $2) AS x) AS due,
    (SELECT count(*) FROM (
       SELECT 1 FROM pgbus.deliveries AS d
       WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
         AND d.available_at > now()
       ORDER BY d.available_at, d.event_seq
       LIMIT $2) AS x) AS scheduled,
    (SELECT d.available_at FROM pgbus.deliveries AS d
     WHERE d.subscription = subs.name AND d.status = 'pending' AND d.is_head
       AND d.available_at <= now()
     ORDER BY d.available_at, d.event_seq
     LIMIT 1) AS oldest
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
