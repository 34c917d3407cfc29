//! Every statement the bus runs, named and documented in one place.
//!
//! Publishing's statements live in [`publish`](crate::publish()); the schema in `sql/`.
//! The bus prepares these once per pooled connection (one round trip per use after
//! that). [`ALL`] lists them so that a test can prepare each against a migrated database.

/// Claims a batch of due deliveries of this bus's subscriptions and leases them.
///
/// Parameters: `$1 text[]` subscription names, `$2 int4[]` how many each may take now,
/// `$3 int4` how many in all, `$4 int8` lease in milliseconds, `$5 text` worker id,
/// `$6 int4` the batch size from which the worker marks itself awake (cost-aware notify).
///
/// One index range scan per subscription (`deliveries_claim_idx`) picks the oldest due
/// pending rows with `FOR UPDATE SKIP LOCKED`, so the cost is O(batch) whatever the
/// backlog, and one subscription's backlog never slows another's. Attempts count claims.
///
/// Always returns at least one row: column 0 is the seconds until the next delivery of
/// these subscriptions becomes due (NULL if none is scheduled); the other columns are the
/// claimed delivery (NULL when nothing was claimed).
pub const CLAIM: &str = "\
WITH subs AS (
  SELECT * FROM unnest($1::text[], $2::int4[]) AS s(name, quota)
),
picked AS (
  SELECT p.subscription, p.event_seq, p.available_at
  FROM subs CROSS JOIN LATERAL (
    SELECT d.subscription, d.event_seq, d.available_at
    FROM pgbus.deliveries AS d
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.available_at <= now()
    ORDER BY d.available_at, d.event_seq
    LIMIT subs.quota
    FOR UPDATE SKIP LOCKED
  ) AS p
  ORDER BY p.available_at, p.event_seq
  LIMIT $3
),
claimed AS (
  UPDATE pgbus.deliveries AS d
  SET status = 'processing',
      attempts = d.attempts + 1,
      locked_until = now() + $4 * interval '1 millisecond',
      locked_by = $5
  FROM picked
  WHERE d.subscription = picked.subscription AND d.event_seq = picked.event_seq
  RETURNING d.subscription, d.event_seq, d.attempts
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
    WHERE d.subscription = subs.name AND d.status = 'pending' AND d.available_at > now()
    ORDER BY d.available_at, d.event_seq
    LIMIT 1
  ) AS n
)
SELECT next_due.secs, c.subscription, c.attempts,
       e.seq, e.id, e.event_name, e.event_version, e.source, e.aggregate_type,
       e.aggregate_id, e.correlation_id, e.causation_id, e.occurred_at, e.payload,
       e.headers, e.created_at
FROM next_due
LEFT JOIN (claimed AS c JOIN pgbus.events AS e ON e.seq = c.event_seq) ON true
ORDER BY e.seq";

/// Settles many deliveries in one statement: completions, failures and releases.
///
/// Parameters: completions `$1 text[]` subscription, `$2 int8[]` event seq, `$3 int4[]`
/// attempt; failures `$4 text[]`, `$5 int8[]`, `$6 int4[]`, `$7 text[]` error, `$8 int8[]`
/// retry delay in milliseconds, `$9 bool[]` permanent; releases `$10 text[]`,
/// `$11 int8[]`, `$12 int4[]`; `$13 text` worker id.
///
/// Fenced: a row is touched only while it still carries this worker's lease (the same
/// `locked_by` and attempt number), so a worker whose lease expired and whose delivery
/// was claimed again changes nothing. A completion is accepted in any state that still
/// carries the lease (it may have been reaped to pending and not yet reclaimed: the work
/// is done, so it is deleted); failures and releases only while `processing`.
///
/// Completed rows are deleted. A failure writes a history row and either schedules the
/// retry or dead-letters the delivery (permanent, or out of attempts). A release puts a
/// claimed but never started delivery back without consuming its attempt.
///
/// Returns one row per rejected (stale) settlement, kind `ack`, `fail` or `release`, and
/// one row of kind `dead` per delivery this statement dead-lettered.
pub const SETTLE: &str = "\
WITH acks AS (
  SELECT * FROM unnest($1::text[], $2::int8[], $3::int4[]) AS a(subscription, event_seq, attempt)
),
fails AS (
  SELECT * FROM unnest($4::text[], $5::int8[], $6::int4[], $7::text[], $8::int8[], $9::bool[])
    AS f(subscription, event_seq, attempt, error, delay_ms, permanent)
),
releases AS (
  SELECT * FROM unnest($10::text[], $11::int8[], $12::int4[]) AS r(subscription, event_seq, attempt)
),
acked AS (
  DELETE FROM pgbus.deliveries AS d
  USING acks
  WHERE d.subscription = acks.subscription AND d.event_seq = acks.event_seq
    AND d.attempts = acks.attempt AND d.locked_by = $13
  RETURNING d.subscription, d.event_seq
),
failed AS (
  UPDATE pgbus.deliveries AS d
  SET status = CASE WHEN fails.permanent OR d.attempts >= coalesce(s.max_attempts, 1)
                    THEN 'dead' ELSE 'pending' END,
      available_at = now() + fails.delay_ms * interval '1 millisecond',
      locked_until = NULL,
      last_error = fails.error
  FROM fails LEFT JOIN pgbus.subscriptions AS s ON s.name = fails.subscription
  WHERE d.subscription = fails.subscription AND d.event_seq = fails.event_seq
    AND d.attempts = fails.attempt AND d.locked_by = $13 AND d.status = 'processing'
  RETURNING d.subscription, d.event_seq, d.attempts, d.status, fails.error
),
history AS (
  INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
  SELECT subscription, event_seq, attempts, error, $13 FROM failed
),
released AS (
  UPDATE pgbus.deliveries AS d
  SET status = 'pending', attempts = d.attempts - 1, locked_until = NULL, available_at = now()
  FROM releases
  WHERE d.subscription = releases.subscription AND d.event_seq = releases.event_seq
    AND d.attempts = releases.attempt AND d.locked_by = $13 AND d.status = 'processing'
  RETURNING d.subscription, d.event_seq
)
SELECT 'ack' AS kind, a.subscription, a.event_seq FROM acks AS a
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
SELECT 'dead', subscription, event_seq FROM failed WHERE status = 'dead'";

/// Extends the leases of deliveries still held by this worker (one statement for all).
///
/// Parameters: `$1 text[]` subscription, `$2 int8[]` event seq, `$3 int4[]` attempt,
/// `$4 int8` lease in milliseconds, `$5 text` worker id. Returns the number extended.
pub const EXTEND: &str = "\
UPDATE pgbus.deliveries AS d
SET locked_until = now() + $4 * interval '1 millisecond'
FROM unnest($1::text[], $2::int8[], $3::int4[]) AS t(subscription, event_seq, attempt)
WHERE d.subscription = t.subscription AND d.event_seq = t.event_seq
  AND d.attempts = t.attempt AND d.locked_by = $5 AND d.status = 'processing'";

/// Returns expired leases to pending, or to the dead letters when out of attempts, with
/// a history row each, and notifies the listening buses when anything became due.
///
/// Parameters: `$1 int4` the most rows to reap in one go. Any number of processes may
/// reap at once: `SKIP LOCKED` gives each its own rows.
///
/// Returns one row: reaped back to pending, reaped to dead.
pub const REAP: &str = "\
WITH expired AS (
  SELECT subscription, event_seq FROM pgbus.deliveries
  WHERE status = 'processing' AND locked_until < now()
  ORDER BY locked_until
  LIMIT $1
  FOR UPDATE SKIP LOCKED
),
reaped AS (
  UPDATE pgbus.deliveries AS d
  SET status = CASE WHEN d.attempts >= coalesce(s.max_attempts, 1) THEN 'dead' ELSE 'pending' END,
      available_at = now(),
      locked_until = NULL,
      last_error = 'lease expired (worker ' || coalesce(d.locked_by, 'unknown') || ')'
  FROM expired LEFT JOIN pgbus.subscriptions AS s ON s.name = expired.subscription
  WHERE d.subscription = expired.subscription AND d.event_seq = expired.event_seq
  RETURNING d.subscription, d.event_seq, d.attempts, d.status, d.last_error, d.locked_by
),
history AS (
  INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker)
  SELECT subscription, event_seq, attempts, last_error, locked_by FROM reaped
),
wake AS (
  SELECT pg_notify('pgbus', '') FROM (SELECT 1 FROM reaped WHERE status = 'pending' LIMIT 1) AS x
)
SELECT count(*) FILTER (WHERE status = 'pending'),
       count(*) FILTER (WHERE status = 'dead'),
       (SELECT count(*) FROM wake)
FROM reaped";

/// Registers this bus in `pgbus.consumers`, or renews its heartbeat (keeping its awake
/// flag). Parameters: `$1 text` worker id, `$2 int8` time to live in milliseconds,
/// `$3 text[]` subscriptions, `$4 text` a description (host, pid), `$5 bool` the awake
/// flag of a new row (a poll-only bus is always awake: notifying it is useless).
pub const CONSUMER_HEARTBEAT: &str = "\
INSERT INTO pgbus.consumers AS c (id, awake, expires_at, subscriptions, info)
VALUES ($1, $5, now() + $2 * interval '1 millisecond', $3, $4)
ON CONFLICT (id) DO UPDATE SET expires_at = EXCLUDED.expires_at";

/// Marks this bus asleep: from now on publishers notify it. Parameter: `$1 text` worker id.
pub const CONSUMER_SLEEP: &str = "UPDATE pgbus.consumers SET awake = false WHERE id = $1";

/// Removes this bus from `pgbus.consumers` at shutdown. Parameter: `$1 text` worker id.
pub const CONSUMER_REMOVE: &str = "DELETE FROM pgbus.consumers WHERE id = $1";

/// Every statement above, by name.
pub const ALL: &[(&str, &str)] = &[
    ("CLAIM", CLAIM),
    ("SETTLE", SETTLE),
    ("EXTEND", EXTEND),
    ("REAP", REAP),
    ("CONSUMER_HEARTBEAT", CONSUMER_HEARTBEAT),
    ("CONSUMER_SLEEP", CONSUMER_SLEEP),
    ("CONSUMER_REMOVE", CONSUMER_REMOVE),
];
