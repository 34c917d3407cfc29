//! The operator API's statements (`crate::admin`).

/// Status of each subscription (or of one: `$1 text`, NULL for all); `$2 int8` and
/// `$3 int8`, the most events read and deliveries probed for `done_last_minute`
/// ([`RECENT_EVENTS_CAP`](crate::admin::RECENT_EVENTS_CAP),
/// [`RECENT_PROBES_CAP`](crate::admin::RECENT_PROBES_CAP)).
///
/// Columns: `name`, `patterns`, `max_attempts`; `pending`, `due` (now), `processing` and
/// `dead` deliveries; `oldest_due_age`, the seconds since the oldest due delivery became
/// due (NULL when none is due); `done_last_minute`, the events published in the last
/// minute that matched and whose delivery is finished (completed, or purged), and
/// `done_estimated`, whether that count was estimated from a sample of the minute;
/// `consumers`, live consumers serving it; `blocked_keys`, keys blocked by a dead head;
/// `paused_at`, when it was paused (NULL while it delivers).
///
/// Set-based: one pass over the deliveries (of the one subscription, through the primary
/// key, when `$1` is given) grouped by subscription; the last minute's count from
/// `pgbus.done_recently` (migration 19), which reads at most `$2` events of the log and
/// probes the deliveries at most `$3` times, sampling a busier minute evenly and scaling
/// the counts up; one pass over the live consumers. Its cost follows the deliveries, not
/// the traffic nor its product with the number of subscriptions. Completed deliveries
/// are deleted, so the log is the only cheap record of them: a retry or replay of an
/// older event that completes in the last minute is not counted.
pub const STATUS_SUBSCRIPTIONS: &str = "\
WITH counts AS (
  SELECT d.subscription,
         count(*) FILTER (WHERE d.status = 'pending') AS pending,
         count(*) FILTER (WHERE d.status = 'pending' AND d.available_at <= now()) AS due,
         count(*) FILTER (WHERE d.status = 'processing') AS processing,
         count(*) FILTER (WHERE d.status = 'dead') AS dead,
         count(*) FILTER (WHERE d.status = 'dead' AND d.is_head AND d.ordering_key IS NOT NULL)
           AS blocked,
         min(d.available_at) FILTER (WHERE d.status = 'pending' AND d.available_at <= now())
           AS oldest_due
  FROM pgbus.deliveries AS d
  WHERE $1::text IS NULL OR d.subscription = $1
  GROUP BY d.subscription
),
recent AS MATERIALIZED (
  SELECT r.subscription, r.done, r.estimated
  FROM pgbus.done_recently(60, $1::text, $2::int8, $3::int8) AS r
),
live AS (
  SELECT t.name, count(*) AS n
  FROM pgbus.consumers AS k, unnest(k.subscriptions) AS t(name)
  WHERE k.expires_at > now()
  GROUP BY t.name
)
SELECT s.name, s.patterns, s.max_attempts,
       coalesce(c.pending, 0) AS pending, coalesce(c.due, 0) AS due,
       coalesce(c.processing, 0) AS processing, coalesce(c.dead, 0) AS dead,
       (extract(epoch FROM now()) - extract(epoch FROM c.oldest_due))::float8
         AS oldest_due_age,
       coalesce(done.done, 0) AS done_last_minute,
       coalesce((SELECT bool_or(r.estimated) FROM recent AS r), false) AS done_estimated,
       coalesce(live.n, 0) AS consumers,
       coalesce(c.blocked, 0) AS blocked_keys,
       s.paused_at
FROM pgbus.subscriptions AS s
LEFT JOIN counts AS c ON c.subscription = s.name
LEFT JOIN recent AS done ON done.subscription = s.name
LEFT JOIN live ON live.name = s.name
WHERE $1::text IS NULL OR s.name = $1
ORDER BY s.name";

/// The parameter types of [`STATUS_SUBSCRIPTIONS`].
pub const STATUS_SUBSCRIPTIONS_TYPES: [tokio_postgres::types::Type; 3] = [
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::INT8,
    tokio_postgres::types::Type::INT8,
];

/// Cluster-wide status, one row: `notification_queue_usage` (0 to 1), `listeners` (the
/// backends of this database named `pgbus listener` in `pg_stat_activity`), `consumers`
/// (live ones), and `sleeping_consumers` (how many of them are asleep: publishers notify
/// them).
pub const STATUS_CLUSTER: &str = "\
SELECT pg_notification_queue_usage() AS notification_queue_usage,
       (SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'pgbus listener')
         AS listeners,
       (SELECT count(*) FROM pgbus.consumers WHERE expires_at > now()) AS consumers,
       (SELECT count(*) FROM pgbus.consumers WHERE expires_at > now() AND NOT awake)
         AS sleeping_consumers";

/// The events committed and not yet turned into deliveries, one row: `events` (up to
/// `$1`) and `oldest_age`, the seconds since the oldest of them was written (NULL when
/// none). Index probes on the log's `xid` from the boundary (`pgbus.not_fanned_out`).
pub const FAN_OUT_BACKLOG: &str = "SELECT events, oldest_age FROM pgbus.not_fanned_out($1)";
/// [`FAN_OUT_BACKLOG`]'s parameter types.
pub const FAN_OUT_BACKLOG_TYPES: [tokio_postgres::types::Type; 1] =
    [tokio_postgres::types::Type::INT8];

/// What holds the database's xmin horizon back, one row: `oldest_transaction_age`, the
/// seconds since the oldest transaction of this database that holds it started (a
/// session other than this one whose `backend_xmin` or `backend_xid` is set, autovacuum
/// aside, or a prepared transaction; NULL when none), `oldest_transaction`, which one
/// (`pid N (application, state)` or `prepared transaction 'gid'`), and
/// `slot_xmin_age`, the age in transactions of the oldest xmin a replication slot holds
/// (NULL when none). Reads `pg_stat_activity` (only the connecting role's sessions
/// without `pg_read_all_stats`), `pg_prepared_xacts` and `pg_replication_slots`: a few
/// rows each.
pub const XMIN_HORIZON: &str = "\
SELECT h.age AS oldest_transaction_age, h.holder AS oldest_transaction,
       (SELECT max(pg_catalog.age(s.xmin)) FROM pg_catalog.pg_replication_slots AS s
        WHERE s.xmin IS NOT NULL)::int8 AS slot_xmin_age
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
  SELECT extract(epoch FROM now() - t.started)::float8 AS age, t.holder
  FROM (
    SELECT a.xact_start AS started,
           format('pid %s (%s, %s)', a.pid,
                  coalesce(nullif(a.application_name, ''), 'no application name'),
                  a.state) AS holder
    FROM pg_catalog.pg_stat_activity AS a
    WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
      AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
      AND a.xact_start IS NOT NULL
      AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
    UNION ALL
    SELECT p.prepared, format('prepared transaction %L', p.gid)
    FROM pg_catalog.pg_prepared_xacts AS p
    WHERE p.database = current_database()
  ) AS t
  ORDER BY t.started
  LIMIT 1
) AS h ON true";

/// Whether a subscription exists. Parameter: `$1 text` name. Returns one row: `exists`.
pub const SUBSCRIPTION_EXISTS: &str =
    "SELECT EXISTS (SELECT 1 FROM pgbus.subscriptions WHERE name = $1::text) AS exists";

/// Dead letters, oldest event first, a page at a time. Parameters: `$1 text`
/// subscription (NULL: all), `$2 text` event id (NULL: all), `$3 int8` the most rows to
/// return, `$4 int8` and `$5 text`: only after this (event seq, subscription), the last
/// row of the previous page (NULL: from the start).
///
/// Columns: `subscription`, `event_seq`, `event_id` and `event_name` (NULL if the event is
/// gone), `attempts`, `last_error`, `failed_at` (the last failed attempt, from the
/// history).
///
/// Index-backed and bounded: `deliveries_dead_idx` (one subscription) or
/// `deliveries_dead_seq_idx` (all) in the listing's order, at most `$3` rows, then each
/// row's event and last failure looked up by key (`OFFSET 0`: a probe per row, where a
/// join may merge the page with the log from its first event).
pub const DEAD_LIST: &str = "\
SELECT d.subscription, d.event_seq, e.id AS event_id, e.event_name, d.attempts, d.last_error,
       f.failed_at
FROM (
  SELECT d.subscription, d.event_seq, d.attempts, d.last_error
  FROM pgbus.deliveries AS d
  WHERE d.status = 'dead'
    AND ($1::text IS NULL OR d.subscription = $1)
    AND ($2::text IS NULL OR d.event_seq = (SELECT seq FROM pgbus.events WHERE id = $2))
    AND ($4::int8 IS NULL OR (d.event_seq, d.subscription) > ($4, $5::text))
  ORDER BY d.event_seq, d.subscription
  LIMIT $3::int8
) AS d
LEFT JOIN LATERAL (
  SELECT e.id, e.event_name FROM pgbus.events AS e WHERE e.seq = d.event_seq OFFSET 0
) AS e ON true
LEFT JOIN LATERAL (
  SELECT max(h.failed_at) AS failed_at FROM pgbus.delivery_failures AS h
  WHERE h.subscription = d.subscription AND h.event_seq = d.event_seq
) AS f ON true
ORDER BY d.event_seq, d.subscription";

/// Counts dead letters. Parameters as [`DEAD_LIST`] without the limit: `$1`
/// subscription, `$2` event id, `$3`, `$4` only after this (event seq, subscription).
/// Returns one row: `dead_letters`.
pub const DEAD_COUNT: &str = "\
SELECT count(*) AS dead_letters FROM pgbus.deliveries AS d
WHERE d.status = 'dead'
  AND ($1::text IS NULL OR d.subscription = $1)
  AND ($2::text IS NULL OR d.event_seq = (SELECT seq FROM pgbus.events WHERE id = $2))
  AND ($3::int8 IS NULL OR (d.event_seq, d.subscription) > ($3, $4::text))";

/// Puts dead letters back to pending, due now, with their attempts reset to 0 and no
/// lease; their failure history is kept. Notifies the listening buses when any was
/// retried. Parameters `$1`, `$2` as [`DEAD_COUNT`]. Returns one row: `retried`, how many
/// were retried; `woke`, how many notifications it sent (0 or 1); `subscriptions` and
/// `keys`, of retried deliveries of ordered subscriptions that had been skipped (not
/// heads), NULL when none: their keys may need a head ([`ENSURE_HEADS`]). An operator
/// action (`pgbus.retry_dead`, granted by `pgbus.grant_operator`).
pub const DEAD_RETRY: &str =
    "SELECT retried, woke, subscriptions, keys FROM pgbus.retry_dead($1, $2)";

/// Gives keys of ordered subscriptions a head where they have pending deliveries and none
/// (after an operator brings skipped dead letters back). Parameters: `$1 text[]`
/// subscriptions, `$2 text[]` keys. Returns the promoted deliveries: `subscription`,
/// `ordering_key`, `event_seq`.
pub const ENSURE_HEADS: &str =
    "SELECT subscription, ordering_key, event_seq FROM pgbus.ensure_heads($1, $2)";

/// Deletes dead letters and their failure history (`pgbus.purge_dead` in
/// `sql/0005_least_privilege.sql`). Parameters: `$1 text` subscription (NULL: all), `$2
/// text` event id (NULL: all). A purged dead letter that was its key's head (a blocked
/// key) hands the head to the key's next delivery in the same transaction. Returns one
/// row: `purged` (deliveries deleted), `failures` (history rows deleted).
pub const DEAD_PURGE: &str = "SELECT purged, failures FROM pgbus.purge_dead($1, $2)";

/// Creates deliveries of a subscription for events still in the log (`pgbus.replay` in
/// `sql/0008_ordered_replay.sql`).
///
/// Parameters: `$1 text` subscription, `$2 timestamptz` events created at or after,
/// `$3 timestamptz` and before (NULL: no bound), `$4 text` a pattern the events must also
/// match (NULL: only the subscription's own patterns).
///
/// Events the subscription already has a delivery of are skipped. The events are locked
/// `FOR KEY SHARE`, so the retention sweep cannot delete one under a new delivery. In an
/// ordered subscription each keyed delivery joins its key, behind what the key already
/// has waiting and in event order, under the key locks and the configuration lock, as
/// the fan-out does. Notifies the listening buses when anything was created. Returns one
/// row: `found` (whether the subscription exists), `matched` (events matched), `created`
/// (deliveries created), `woke` (notifications sent).
pub const REPLAY: &str = "SELECT found, matched, created, woke FROM pgbus.replay($1::text, $2::timestamptz, $3::timestamptz, $4::text)";

/// Every subscription: `name`, `patterns`, `max_attempts`, `created_at`, `updated_at`,
/// `paused_at` (NULL unless paused), and `consumers`, the live consumers serving it.
pub const SUBSCRIPTIONS_LIST: &str = "\
SELECT s.name, s.patterns, s.max_attempts, s.created_at, s.updated_at, s.paused_at,
       (SELECT count(*) FROM pgbus.consumers AS k
         WHERE k.expires_at > now() AND s.name = ANY (k.subscriptions)) AS consumers
FROM pgbus.subscriptions AS s
ORDER BY s.name";

/// Drops a subscription with its deliveries and their failure history, unless some of
/// its deliveries are processing and `$2 bool` (force) is false. Parameter `$1 text`:
/// the name.
///
/// It also removes deliveries left under the name without a subscription row (a publish
/// that committed while an earlier drop ran). Returns one row: `known` (whether anything
/// was known under the name), `processing` (deliveries processing), `dropped` (whether
/// it was dropped), `deliveries` (deliveries deleted), `failures` (history rows
/// deleted).
pub const SUBSCRIPTION_DROP: &str = "\
WITH sub AS (
  SELECT name FROM pgbus.subscriptions WHERE name = $1::text FOR UPDATE
),
known AS (
  SELECT EXISTS (SELECT 1 FROM sub)
      OR EXISTS (SELECT 1 FROM pgbus.deliveries WHERE subscription = $1) AS known
),
busy AS (
  SELECT count(*) AS n FROM pgbus.deliveries WHERE subscription = $1 AND status = 'processing'
),
go AS (
  SELECT 1 FROM known, busy WHERE known.known AND ($2::bool OR busy.n = 0)
),
deliveries AS (
  DELETE FROM pgbus.deliveries AS d
  WHERE d.subscription = $1 AND EXISTS (SELECT 1 FROM go)
  RETURNING 1
),
failures AS (
  DELETE FROM pgbus.delivery_failures AS f
  WHERE f.subscription = $1 AND EXISTS (SELECT 1 FROM go)
  RETURNING 1
),
dropped AS (
  DELETE FROM pgbus.subscriptions AS s
  WHERE s.name = $1 AND EXISTS (SELECT 1 FROM go)
  RETURNING 1
)
SELECT (SELECT known FROM known) AS known, (SELECT n FROM busy) AS processing,
       EXISTS (SELECT 1 FROM go) AS dropped, (SELECT count(*) FROM deliveries) AS deliveries,
       (SELECT count(*) FROM failures) AS failures";

/// One batch of the retention sweep (`pgbus.sweep`, an owner-rights function, so that
/// consumers need no DELETE on the log): deletes events created before `now() - $1 int8`
/// milliseconds (never less than `pgbus.settings.min_retention`) that no delivery refers
/// to, at most `$2 int4` of them, oldest first, with their failure history.
///
/// Runs only when it gets the sweep's row of `pgbus.duties` (`FOR UPDATE SKIP LOCKED`,
/// until the batch commits), so at most one sweep runs at a time across all processes;
/// the events are taken `FOR UPDATE SKIP LOCKED`. The function's third parameter, the
/// advisory lock key of migrations before 13, is ignored. Returns one row: `got`
/// (whether it got the duty), `events` (events deleted), `failures` (history rows
/// deleted).
pub const SWEEP: &str = "SELECT got, events, failures FROM pgbus.sweep($1, $2, 0)";

/// A subscription's stored settings. Parameter: `$1 text` name. Columns: `patterns`,
/// `max_attempts`, `ordered`, `on_dead`; no row when it does not exist.
pub const SUBSCRIPTION_SETTINGS: &str = "\
SELECT patterns, max_attempts, ordered, on_dead FROM pgbus.subscriptions WHERE name = $1::text";

/// Registers a subscription, or updates its patterns and maximum attempts when they
/// differ: `$1 text` name, `$2 text[]` patterns, `$3 int4` max attempts. The schema
/// owner's direct write ([`admin::register_subscription`](crate::admin::register_subscription)):
/// it takes no configuration lock, so it is for setting up before consumers run;
/// operators change a live subscription with [`CONFIGURE_SUBSCRIPTION`].
pub const REGISTER_SUBSCRIPTION: &str = "\
INSERT INTO pgbus.subscriptions AS s (name, patterns, max_attempts)
VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE
SET patterns = EXCLUDED.patterns, max_attempts = EXCLUDED.max_attempts, updated_at = now()
WHERE (s.patterns, s.max_attempts) IS DISTINCT FROM (EXCLUDED.patterns, EXCLUDED.max_attempts)";

/// Listens on the channel every wake-up is sent on.
pub const LISTEN: &str = "LISTEN pgbus";

/// Creates a subscription unless one of that name exists. Parameters: `$1 text` name,
/// `$2 text[]` patterns, `$3 int4` max attempts, `$4 bool` ordered, `$5 text` on_dead.
/// Returns a row (`created`) when it created it. `pgbus.join_subscription` runs with the
/// owner's rights, so a consumer creates a subscription without INSERT on the table.
pub const SUBSCRIPTION_CREATE: &str = "\
SELECT created FROM pgbus.join_subscription($1, $2, $3, $4, $5) AS created WHERE created";

/// Changes a subscription's settings (`pgbus.configure_subscription`): parameters `$1
/// text` name, then NULL to keep or the new value: `$2 text[]` patterns, `$3 int4` max
/// attempts, `$4 bool` ordered, `$5 text` on_dead.
///
/// It takes the configuration lock exclusively, so it waits for every publish and
/// settlement that read the old settings and those after it read the new ones, and
/// converts the backlog in the same transaction: ordering on gives each key one head (its
/// oldest waiting delivery); ordering off makes every delivery claimable. Returns one
/// row: `found` (whether the subscription exists), `converted` (deliveries converted).
pub const CONFIGURE_SUBSCRIPTION: &str = "\
SELECT found, converted FROM pgbus.configure_subscription($1, $2, $3, $4, $5)";

/// One try at a change of a subscription's settings
/// (`pgbus.try_configure_subscription`): the parameters of [`CONFIGURE_SUBSCRIPTION`],
/// then `$6 int4` how many milliseconds to wait for the configuration lock (it is a
/// table lock on `pgbus.config_gate`, taken exclusively). Returns one row: `got` (whether
/// it had the lock; when false nothing was done or is held), `found` and `converted` as
/// [`CONFIGURE_SUBSCRIPTION`]'s, and `waiting_on` (jsonb, when not `got`): the sessions
/// that held or awaited the lock, each with `pid`, `role`, `application_name`,
/// `xact_age_ms` and `waiting`.
pub const TRY_CONFIGURE_SUBSCRIPTION: &str = "\
SELECT got, found, converted, waiting_on
FROM pgbus.try_configure_subscription($1, $2, $3, $4, $5, $6)";

/// Keys of ordered subscriptions whose head is a dead letter, with how many deliveries
/// wait behind each. Parameter: `$1 text` a subscription, or NULL for all. Columns:
/// `subscription`, `key`, the dead head's `event_id`, `event_name`, `attempts` and
/// `last_error`, and `waiting` (deliveries behind it).
pub const BLOCKED_KEYS: &str = "\
SELECT h.subscription, h.ordering_key AS key, e.id AS event_id, e.event_name, h.attempts,
       h.last_error,
       (SELECT count(*) FROM pgbus.deliveries AS w
        WHERE w.subscription = h.subscription AND w.ordering_key = h.ordering_key
          AND NOT w.is_head AND w.status = 'pending') AS waiting
FROM pgbus.deliveries AS h
JOIN pgbus.events AS e ON e.seq = h.event_seq
WHERE h.status = 'dead' AND h.is_head AND h.ordering_key IS NOT NULL
  AND ($1::text IS NULL OR h.subscription = $1)
ORDER BY h.subscription, h.ordering_key";

/// What waits behind the heads of some keys of an ordered subscription, in the order it
/// will be delivered. Parameters: `$1 text` subscription, `$2 text[]` keys, `$3 int8` the
/// most deliveries listed per key. Columns: `key`, `event_seq`, `event_id`, `event_name`,
/// `available_at`.
///
/// One range of `deliveries_key_idx` per key, in its order, stopped at `$3`.
pub const KEY_WAITING: &str = "\
SELECT w.ordering_key AS key, w.event_seq, e.id AS event_id, e.event_name, w.available_at
FROM unnest($2::text[]) AS k(key)
CROSS JOIN LATERAL (
  SELECT d.ordering_key, d.event_seq, d.available_at, d.key_pos
  FROM pgbus.deliveries AS d
  WHERE d.subscription = $1::text AND d.ordering_key = k.key
    AND NOT d.is_head AND d.status = 'pending'
  ORDER BY d.key_pos, d.event_seq
  LIMIT $3::int8
) AS w
JOIN pgbus.events AS e ON e.seq = w.event_seq
ORDER BY w.ordering_key, w.key_pos, w.event_seq";

/// Makes a key's head due now: a dead head gets its attempts back, a head backing off is
/// retried at once; notifies the listening buses. Parameters: `$1 text` subscription,
/// `$2 text` key. Returns one row: `redriven` (heads redriven, 0 or 1), `woke`
/// (notifications sent). An operator action (`pgbus.redrive_head`, granted by
/// `pgbus.grant_operator`).
pub const REDRIVE_HEAD: &str = "SELECT redriven, woke FROM pgbus.redrive_head($1, $2)";

/// Skips a key's dead head and promotes the next delivery (`pgbus.skip_dead_head`).
/// Parameters: `$1 text` subscription, `$2 text` key. Returns a row (`skipped`) when
/// there was a dead head to skip.
pub const SKIP_HEAD: &str = "SELECT skipped FROM pgbus.skip_dead_head($1, $2)";

/// Skips a key's dead head if it is the event `$3 text` (by id), as [`SKIP_HEAD`] does
/// (`pgbus.skip_seen_head`, migration 29). Parameters: `$1 text` subscription, `$2 text`
/// key, `$3 text` the head's event id as the caller saw it. Returns one row: `skipped`
/// and `promoted` (event ids; NULL when nothing was done), `head` and `head_status`, the
/// key's head after the call (NULL: none).
pub const SKIP_SEEN_HEAD: &str =
    "SELECT skipped, promoted, head, head_status FROM pgbus.skip_seen_head($1, $2, $3)";

/// Redrives a key's head if it is the event `$3 text` and dead or pending, as
/// [`REDRIVE_HEAD`] does (`pgbus.redrive_seen_head`, migration 29). Returns one row:
/// `redriven` (0 or 1), `head` and `head_status` (the key's head after the call).
pub const REDRIVE_SEEN_HEAD: &str =
    "SELECT redriven, head, head_status FROM pgbus.redrive_seen_head($1, $2, $3)";

/// Pauses a subscription (migration 28): its claims hand out nothing until it is resumed;
/// deliveries are still made. Parameter `$1 text`: the name. Returns one row: `known`
/// (whether the subscription exists), `since` (when it was paused, by this call or an
/// earlier one; NULL when unknown), `already` (it was paused before this call). The
/// operator's (`pgbus.grant_operator`).
pub const PAUSE_SUBSCRIPTION: &str =
    "SELECT known, since, already FROM pgbus.pause_subscription($1)";

/// Resumes a paused subscription and notifies the buses, so that its deliveries flow at
/// once. Parameter `$1 text`: the name. Returns one row: `known`, `since` (when it had
/// been paused; NULL when it was not), `resumed` (whether it was paused). The operator's.
pub const RESUME_SUBSCRIPTION: &str =
    "SELECT known, since, resumed FROM pgbus.resume_subscription($1)";
