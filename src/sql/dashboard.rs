//! The dashboard's reads (`pgbus ui`), through `crate::admin`.

/// The live consumers (running buses), by id. No parameters.
///
/// Columns: `id` (the worker id), `awake` (false: asleep, publishers notify it),
/// `expires_at` (when the row stops counting as live without another heartbeat),
/// `subscriptions`, `started_at`, `info` (the process's description: `pid N on HOST`).
///
/// `pgbus.consumers` holds one row per running bus (a few): a scan of it.
pub const CONSUMERS_LIST: &str = "\
SELECT id, awake, beat_at, expires_at, subscriptions, started_at, info
FROM pgbus.consumers
WHERE expires_at > now()
ORDER BY id";

/// How many events each subscription finished recently: of the events created in the
/// last `$1 float8` seconds (and already due), those that the subscription matches and
/// has no delivery of any more (completed, or purged), as `done_last_minute` in
/// [`STATUS_SUBSCRIPTIONS`](super::STATUS_SUBSCRIPTIONS) counts them over a window of one's choosing, reading at most
/// `$2 int8` events and probing the deliveries at most `$3 int8` times
/// (`pgbus.done_recently`, migration 19). Completed deliveries are deleted, so the log is
/// the only cheap record of them: a retry or replay of an older event is not counted.
///
/// Columns: `subscription`, `delivered`, and `estimated`, whether the window held more
/// than `$2` events or more than `$3` pairs of an event and a matching subscription
/// (then `delivered` is estimated from an even sample of the window that includes its
/// newest event, scaled up). A subscription that finished none has no row; when none
/// did, one row of NULLs but `estimated`.
///
/// Its cost is bounded by `$2` and `$3`, whatever the backlog, the publishing rate or the
/// number of subscriptions an event matches.
pub const DELIVERED_RECENTLY: &str = "\
SELECT r.subscription, r.done AS delivered, r.estimated
FROM pgbus.done_recently($1::float8, NULL, $2::int8, $3::int8) AS r";

/// The failure history of deliveries: every failed attempt, oldest first. Parameters:
/// `$1 text` subscription, `$2 int8[]` event seqs, `$3 int8` the most rows returned.
///
/// Columns: `event_seq`, `attempt`, `error`, `worker`, `failed_at`.
///
/// One range of `delivery_failures_delivery_idx` per event seq.
pub const FAILURE_HISTORY: &str = "\
SELECT f.event_seq, f.attempt, f.error, f.worker, f.failed_at
FROM pgbus.delivery_failures AS f
WHERE f.subscription = $1::text AND f.event_seq = ANY ($2::int8[])
ORDER BY f.event_seq, f.failed_at, f.id
LIMIT $3::int8";

/// The event with this id. Parameter: `$1 text` the id. Columns: every column of
/// `pgbus.events` the claim reads (`seq`, `id`, `event_name`, `event_version`, `source`,
/// `aggregate_type`, `aggregate_id`, `correlation_id`, `causation_id`, `occurred_at`,
/// `payload`, `headers`, `created_at`, `ordering_key`); no row when there is none.
///
/// One probe of `events_id_key`.
pub const EVENT_BY_ID: &str = "\
SELECT e.seq, e.id, e.event_name, e.event_version, e.source, e.aggregate_type,
       e.aggregate_id, e.correlation_id, e.causation_id, e.occurred_at, e.payload,
       e.headers, e.created_at, e.ordering_key
FROM pgbus.events AS e
WHERE e.id = $1::text";

/// The events of one correlation id, oldest first. Parameters: `$1 text` the
/// correlation id, `$2 int8` the most rows returned. Columns as [`EVENT_BY_ID`].
///
/// The log has no index on `correlation_id`: this reads the whole log (a parallel
/// sequential scan; BENCHMARKS.md, "Dashboard queries").
pub const EVENTS_BY_CORRELATION: &str = "\
SELECT e.seq, e.id, e.event_name, e.event_version, e.source, e.aggregate_type,
       e.aggregate_id, e.correlation_id, e.causation_id, e.occurred_at, e.payload,
       e.headers, e.created_at, e.ordering_key
FROM pgbus.events AS e
WHERE e.correlation_id = $1::text
ORDER BY e.seq
LIMIT $2::int8";

/// Where one event's delivery stands in each subscription that has it or matches it.
/// Parameter: `$1 int8` the event's seq.
///
/// Columns: `subscription`; `status`, the delivery's (`pending`, `processing`, `dead`),
/// or `done` when the subscription matches the event, existed when it was published and
/// has no delivery of it any more (completed, or purged); `attempts`, `available_at`,
/// `locked_by`, `last_error` (NULL when done); `ordering_key` and `is_head`, for ordered
/// subscriptions.
///
/// The deliveries through the primary key, one probe per subscription that has
/// deliveries (a skip scan of the primary key finds them, as the retention sweep does;
/// there is no index on `event_seq` alone), the matching subscriptions through the
/// pattern index.
pub const EVENT_DELIVERIES: &str = "\
WITH RECURSIVE subs AS (
  (SELECT d.subscription FROM pgbus.deliveries AS d ORDER BY d.subscription LIMIT 1)
  UNION ALL
  SELECT (SELECT d.subscription FROM pgbus.deliveries AS d
          WHERE d.subscription > subs.subscription
          ORDER BY d.subscription LIMIT 1)
  FROM subs WHERE subs.subscription IS NOT NULL
),
e AS (
  SELECT seq, event_name, created_at FROM pgbus.events WHERE seq = $1::int8
),
matched AS (
  SELECT m.subscription FROM e
  CROSS JOIN LATERAL pgbus.subscriptions_matching(e.event_name) AS m
  JOIN pgbus.subscriptions AS s ON s.name = m.subscription
  WHERE e.created_at >= s.created_at
)
SELECT coalesce(d.subscription, matched.subscription) AS subscription,
       coalesce(d.status, 'done') AS status, d.attempts, d.available_at, d.locked_by,
       d.last_error, d.ordering_key, d.is_head
FROM (SELECT d.* FROM subs
      JOIN pgbus.deliveries AS d
        ON d.subscription = subs.subscription AND d.event_seq = $1::int8) AS d
FULL JOIN matched ON matched.subscription = d.subscription
ORDER BY 1";

/// A subscription's pending deliveries in event order, a page at a time. Parameters: `$1
/// text` subscription, `$2 int8` only those after this event seq (NULL: from the first),
/// `$3 int8` the most rows.
///
/// Columns: `event_seq`, `event_id` and `event_name` (NULL when the event is gone),
/// `attempts`, `available_at`, `ordering_key`, and `state`: `due` (claimable now),
/// `scheduled` (due later: a retry backing off, a delayed event) or `waiting` (behind its
/// key's head).
///
/// One range of the primary key from `$2` on, stopped at `$3` rows: it also steps over
/// the subscription's deliveries in other states within the range (processing, dead).
/// Each row's event is then one probe of the log's primary key (`OFFSET 0` keeps the
/// lookup a probe per row: joined, the planner merged the page with the log from its
/// first event, 150 ms for a page deep in a log of 2,000,000).
pub const PENDING_LIST: &str = "\
SELECT d.event_seq, e.id AS event_id, e.event_name, d.attempts, d.available_at,
       d.ordering_key, d.state
FROM (
  SELECT d.event_seq, d.attempts, d.available_at, d.ordering_key,
         CASE WHEN NOT d.is_head THEN 'waiting'
              WHEN d.available_at > now() THEN 'scheduled'
              ELSE 'due' END AS state
  FROM pgbus.deliveries AS d
  WHERE d.subscription = $1::text AND d.status = 'pending'
    AND d.event_seq > coalesce($2::int8, -9223372036854775808)
  ORDER BY d.event_seq
  LIMIT $3::int8
) AS d
LEFT JOIN LATERAL (
  SELECT e.id, e.event_name FROM pgbus.events AS e WHERE e.seq = d.event_seq OFFSET 0
) AS e ON true
ORDER BY d.event_seq";
