-- pgbus schema, version 19: the recent counts of `status` and of the dashboard, bounded
-- (src/sql.rs, STATUS_SUBSCRIPTIONS and DELIVERED_RECENTLY).
--
-- pgbus.done_recently(window_seconds, subscription, max_events, max_probes): how many
-- events of the last `window_seconds` (already due) each subscription (`subscription`,
-- or every one when NULL) has finished: it matches them, they were published after it
-- was created, a batch has turned them into deliveries (the boundary of migration 18
-- passed them: before, they have no delivery because none was made yet), and it has no
-- delivery of them any more (completed deliveries are deleted, so the log is the only
-- cheap record of them; a retry or replay of an older event is not counted).
--
-- Counting every event of the window and probing the deliveries once per event and
-- matching subscription grows with the traffic: 1,000,000 probes at 10,000
-- subscriptions and 1,000,000 deliveries of the last minute. So the count reads at most
-- `max_events` events and makes at most `max_probes` probes:
--
-- * a window of at most `max_events` events is read whole (its newest entries of
--   events_created_at_idx); a larger one is sampled evenly: one position of the log in
--   each stretch of `step` between the newest event and the window's first (the newest
--   itself, then an offset drawn from a hash, so that the sample cannot line up with a
--   periodic pattern of the traffic), at most `max_events` primary-key probes;
-- * each distinct event name of the sample is matched once (the pattern index); when
--   the sample's (event, subscription) pairs outnumber `max_probes`, every k-th event
--   of the sample is kept, so that about `max_probes` pairs remain (and never more);
-- * each remaining pair probes the deliveries' primary key once (a scalar subquery, so
--   that the planner cannot turn it into a join over every delivery).
--
-- A count from a sample is scaled up (by the step times k) and `estimated` says so.
-- Otherwise it is exact. One row per subscription that finished any; when none did,
-- one row whose subscription and done are NULL, for `estimated`.
CREATE OR REPLACE FUNCTION pgbus.done_recently(window_seconds float8, only_subscription text,
                                    max_events bigint, max_probes bigint)
RETURNS TABLE (subscription text, done bigint, estimated boolean)
LANGUAGE sql STABLE
SET jit = off
SET search_path = pg_catalog, pgbus, pg_temp
AS $fn$
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
$fn$;
