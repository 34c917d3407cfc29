//! Every statement the bus runs, named and documented in one place.
//!
//! The schema is in `sql/`.
//! The bus prepares these once per pooled connection (one round trip per use after
//! that). [`ALL`] lists them so that a test can prepare each against a migrated database.

/// Claims a batch of due deliveries of this bus's subscriptions and leases them.
///
/// Parameters: `$1 text[]` subscription names, `$2 int4[]` how many each may take now,
/// `$3 int4` how many in all, `$4 int8` lease in milliseconds, `$5 text` worker id,
/// `$6 int4` the batch size from which the worker marks itself awake (cost-aware notify),
/// `$7 int8` the byte budget of the claim, `$8 timestamptz[]` each subscription's floor
/// (NULL: none).
///
/// One index range scan per subscription (`deliveries_ready_idx`) picks the pending rows
/// that became claimable first (`ready_at`, migration 24), from the subscription's floor
/// on, with `FOR UPDATE SKIP LOCKED`, so the cost is O(batch) whatever the backlog, and
/// one subscription's backlog never slows another's. The floor keeps the scan off the
/// index entries of deliveries claimed since the oldest open transaction began (which no
/// vacuum may remove while it runs): every claimable delivery has `ready_at` at or above
/// it, and `floors` (every row) gives the next claim's, in `$1`'s order: five seconds
/// before this claim when it took everything it found for the subscription, the oldest
/// it took when it was full, the same floor when it took none. Attempts count claims.
/// Only heads are claimable: every delivery of an unordered subscription, and the oldest
/// unfinished delivery of each key of an ordered one.
///
/// The byte budget: of the rows picked, oldest first, only those whose running sum of
/// `pg_column_size(payload) + pg_column_size(headers)` stays within `$7` are leased, and
/// always the first, so that an event larger than the budget still flows, alone. The
/// sizes are the stored ones (compressed, read from the TOAST pointer without detoasting),
/// looked up by primary key once per picked row. Rows picked but not kept stay pending.
///
/// Always returns at least one row: `secs`, the seconds until the next delivery of these
/// subscriptions becomes due (NULL if none is scheduled); `cut`, whether the budget left
/// due deliveries behind (claim again at once); `waited`, the seconds the claimed
/// delivery had been due (since its `available_at`: its publishing transaction's
/// `now()`, its delivery time, or its retry's time), for the lag metric; the others are the claimed delivery (NULL when nothing was
/// claimed).
///
/// The lease is written by the rows' `ctid`s, which the row locks keep stable until the
/// statement ends: a TID scan, whatever the planner estimates. The bus runs this statement
/// inside `pgbus.claim` ([`CLAIM_CALL`]), whose plan is generic, built once per
/// connection: planned for given values, PostgreSQL re-planned it on every claim while
/// deliveries were pending, and a generic plan must not be able to join the lease's
/// update through a scan of the table.
///
/// A delivery whose `available_at` is `infinity` (written by SQL) is never due, and is not
/// a next due time either: `infinity - now()` is an error before PostgreSQL 17, which would
/// fail every claim of its subscription. One of `-infinity` is due at once, first.
pub const CLAIM: &str = "\
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
       (SELECT count(*) FROM sized) > (SELECT count(*) FROM kept) AS cut,
       floors.floors
FROM next_due CROSS JOIN floors
LEFT JOIN (claimed AS c JOIN pgbus.events AS e ON e.seq = c.event_seq) ON true
ORDER BY e.seq";

/// What the bus sends to claim: [`CLAIM`] inside the function `pgbus.claim` (migration
/// 11), whose body is that statement (a test checks they are the same) and which runs it
/// with a generic plan (`plan_cache_mode = force_generic_plan`), cached for the session by
/// PL/pgSQL: no planning per claim, pooler or not. Parameters and rows as [`CLAIM`]'s.
pub const CLAIM_CALL: &str = "SELECT * FROM pgbus.claim($1, $2, $3, $4, $5, $6, $7, $8)";

/// The parameter types of [`CLAIM`] and [`CLAIM_CALL`], for preparing them.
pub const CLAIM_TYPES: [tokio_postgres::types::Type; 8] = [
    tokio_postgres::types::Type::TEXT_ARRAY,
    tokio_postgres::types::Type::INT4_ARRAY,
    tokio_postgres::types::Type::INT4,
    tokio_postgres::types::Type::INT8,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::INT4,
    tokio_postgres::types::Type::INT8,
    tokio_postgres::types::Type::TIMESTAMPTZ_ARRAY,
];

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
/// For ordered subscriptions (`pgbus.settle` in `sql/0004_ordered.sql`), it first locks
/// the keys involved; deleting a completed head (or skipping a dead one under
/// `on_dead = 'skip'`) promotes the key's next delivery in the same statement, and wakes
/// sleeping buses when it did.
///
/// Returns one row per rejected (stale) settlement, kind `ack`, `fail` or `release`; one
/// row of kind `dead` per delivery dead-lettered; one of kind `promoted` per new head; and
/// one of kind `woke` if it notified.
///
/// [`ACK_IN`] runs the same function for one completion in an application's transaction.
pub const SETTLE: &str = "\
SELECT kind, subscription, event_seq
FROM pgbus.settle($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)";

/// Completes one delivery inside the application's transaction ([`Delivery::ack_in`],
/// `Context::ack_in`): `pgbus.ack_in` (`sql/0009_ack_in.sql`) calls `pgbus.settle` with
/// this one completion, so the fence and an ordered key's promotion are [`SETTLE`]'s.
///
/// Parameters: `$1 text` subscription, `$2 int8` event seq, `$3 int4` attempt, `$4 text`
/// worker id. A stale lease raises SQLSTATE `PGB01` ([`LEASE_LOST`]), which aborts the
/// caller's transaction. Sent as an unnamed statement (`query_typed`), so it runs behind a
/// transaction-mode pooler too.
///
/// [`Delivery::ack_in`]: crate::Delivery::ack_in
pub const ACK_IN: &str = "SELECT pgbus.ack_in($1::text, $2::int8, $3::int4, $4::text)";

/// The SQLSTATE [`ACK_IN`] raises when the lease is no longer this worker's.
pub const LEASE_LOST: &str = "PGB01";

/// Extends the leases of deliveries still held by this worker (one statement for all).
///
/// Parameters: `$1 text[]` subscription, `$2 int8[]` event seq, `$3 int4[]` attempt,
/// `$4 int8` lease in milliseconds, `$5 text` worker id. Returns the number extended.
///
/// A row locked by another transaction is skipped (`SKIP LOCKED`), not waited for: it is
/// being settled, by the acker or by an application's transaction that completed it with
/// [`ACK_IN`] and has not ended yet, and waiting would hold every other lease's extension
/// until that transaction ends. A row skipped and still held is extended on the next
/// round, a third of the lease later. `pgbus.extend_leases` (`sql/0017_operator_role.sql`)
/// runs with the owner's rights: consumers have no UPDATE on the deliveries.
pub const EXTEND: &str = "SELECT pgbus.extend_leases($1, $2, $3, $4, $5) AS extended";

/// Returns expired leases to pending, or to the dead letters when out of attempts, with
/// a history row each, and notifies the listening buses when anything became due.
///
/// Parameters: `$1 int4` the most rows to reap in one go. Any number of processes may
/// reap at once: `SKIP LOCKED` gives each its own rows. Under `on_dead = 'skip'`, a head
/// that dies is skipped and its key's next delivery promoted (`pgbus.reap` in
/// `sql/0004_ordered.sql`).
///
/// Returns one row: `returned` (reaped back to pending), `dead` (reaped to dead).
pub const REAP: &str = "SELECT returned, dead FROM pgbus.reap($1)";

/// Finds keys of ordered subscriptions with pending deliveries but no head, which must
/// never happen, and promotes their oldest delivery. Parameter: `$1 int4` the most keys to
/// repair. Returns one row per repair: `subscription`, `ordering_key`, `event_seq`.
pub const REPAIR: &str =
    "SELECT subscription, ordering_key, event_seq FROM pgbus.promote_orphans($1)";

/// The gauges' sample (`pgbus_backlog`, `pgbus_oldest_due_age_seconds`,
/// `pgbus_blocked_keys`): one row per subscription, by name (`pgbus.backlog` in
/// `sql/0010_backlog.sql`, a function only to run with `jit = off`).
///
/// Parameters: `$1 text[]` the subscriptions (NULL: every registered one), `$2 int8` the
/// most deliveries counted per subscription and state (NULL: no limit).
///
/// Columns: `subscription`; `due` (pending, due now: the claimable heads and, in an
/// ordered subscription, the deliveries waiting behind their key's head), `scheduled`
/// (pending, due later), `processing`, `dead`; `oldest_due_age`, the seconds since the
/// oldest claimable delivery became due (NULL when none is due); `blocked_keys`, keys
/// whose head is a dead letter.
///
/// Index-backed, each count bounded by `$2`: the heads through `deliveries_claim_idx`
/// (one range each side of `now()`, and its first entry for the oldest age), the
/// deliveries behind a head through `deliveries_key_idx` (an unordered subscription has
/// none: an empty range), dead letters and blocked keys through `deliveries_dead_idx`,
/// and the leased ones through `deliveries_reap_idx` (all of them, grouped: they are as
/// many as the consumers hold). So a sample costs at most a few times `$2` index entries
/// per subscription, whatever the backlog (BENCHMARKS.md, "The gauges' statement").
pub const BACKLOG: &str = "\
SELECT subscription, due, scheduled, processing, dead, oldest_due_age, blocked_keys
FROM pgbus.backlog($1::text[], $2::int8)";

/// [`BACKLOG`] for the subscriptions of every live bus and `$1`'s (the leader samples the
/// gauges for all of them). Parameters and rows as [`BACKLOG`]'s.
pub const BACKLOG_LIVE: &str = "\
SELECT subscription, due, scheduled, processing, dead, oldest_due_age, blocked_keys
FROM pgbus.backlog(ARRAY(SELECT n FROM pgbus.consumers AS c, unnest(c.subscriptions) AS n
                         WHERE c.expires_at > now()
                         UNION SELECT unnest($1::text[])), $2::int8)";

/// The parameter types of [`BACKLOG`].
pub const BACKLOG_TYPES: [tokio_postgres::types::Type; 2] = [
    tokio_postgres::types::Type::TEXT_ARRAY,
    tokio_postgres::types::Type::INT8,
];

/// Registers this bus in `pgbus.consumers`, or renews its heartbeat (keeping its awake
/// flag). Parameters: `$1 text` worker id, `$2 int8` time to live in milliseconds,
/// `$3 text[]` subscriptions, `$4 text` a description (host, pid), `$5 bool` the awake
/// flag of a new row (a poll-only bus is always awake: notifying it is useless).
///
/// Returns one row: `missing`, the bus's subscriptions that no longer exist (dropped by
/// an operator while it runs), empty when all do. `pgbus.heartbeat` runs with the owner's
/// rights: consumers have no INSERT or UPDATE on `pgbus.consumers`.
pub const CONSUMER_HEARTBEAT: &str = "SELECT pgbus.heartbeat($1, $2, $3, $4, $5) AS missing";

/// Renews this bus's row as [`CONSUMER_HEARTBEAT`] does and, with `$6` set, takes or
/// renews the maintenance leadership for `$6` milliseconds unless another bus holds it
/// live (`pgbus.beat`, migration 23). Parameters: [`CONSUMER_HEARTBEAT`]'s, then `$6 int8`
/// the leadership's length (NULL: do not run for it).
///
/// Returns one row: `missing` (as [`CONSUMER_HEARTBEAT`]), `leads`, whether this bus now
/// leads, and `next_expiry_ms`, for a leader the milliseconds until the earliest lease of
/// any bus runs out (NULL when none is leased or the bus does not lead), and
/// `leader_expiry_ms`, for a follower the milliseconds until the leadership runs out.
pub const CONSUMER_BEAT: &str = "SELECT missing, leads, next_expiry_ms, leader_expiry_ms
     FROM pgbus.beat($1, $2, $3, $4, $5, $6)";

/// Marks this bus asleep: from now on publishers notify it. Parameter: `$1 text` worker id.
///
/// `pgbus.mark_asleep` first takes the wake lock exclusively, which every publishing
/// transaction that got it holds shared from its awake check to the end of its commit (a
/// publisher that cannot have it notifies): the mark waits for the publishers that saw
/// this bus awake (and sent no notification) to commit, so the claim that follows the
/// mark finds their events. It waits at most 200 ms and otherwise fails
/// (`lock_not_available`): the bus stays awake and polls on a short backoff.
pub const CONSUMER_SLEEP: &str = "SELECT pgbus.mark_asleep($1)";

/// Removes this bus from `pgbus.consumers` at shutdown (`pgbus.leave`, with the owner's
/// rights). Parameter: `$1 text` worker id. Returns one row: `left`, whether it was there.
pub const CONSUMER_REMOVE: &str = "SELECT pgbus.leave($1) AS left";

/// Gives up the maintenance leadership as the bus's shutdown begins (`pgbus.resign`, with
/// the owner's rights; it notifies the followers). Parameter: `$1 text` worker id.
/// Returns one row: `resigned`, whether this bus led.
pub const LEADER_RESIGN: &str = "SELECT pgbus.resign($1) AS resigned";

// ---- Operating the bus (crate::admin) ----

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
/// `consumers`, live consumers serving it; `blocked_keys`, keys blocked by a dead head.
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
       coalesce(c.blocked, 0) AS blocked_keys
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
/// `deliveries_dead_seq_idx` (all) in the listing's order, at most `$3` rows, each
/// joined by key.
pub const DEAD_LIST: &str = "\
SELECT d.subscription, d.event_seq, e.id AS event_id, e.event_name, d.attempts, d.last_error,
       f.failed_at
FROM pgbus.deliveries AS d
LEFT JOIN pgbus.events AS e ON e.seq = d.event_seq
LEFT JOIN LATERAL (
  SELECT max(h.failed_at) AS failed_at FROM pgbus.delivery_failures AS h
  WHERE h.subscription = d.subscription AND h.event_seq = d.event_seq
) AS f ON true
WHERE d.status = 'dead'
  AND ($1::text IS NULL OR d.subscription = $1)
  AND ($2::text IS NULL OR d.event_seq = (SELECT seq FROM pgbus.events WHERE id = $2))
  AND ($4::int8 IS NULL OR (d.event_seq, d.subscription) > ($4, $5::text))
ORDER BY d.event_seq, d.subscription
LIMIT $3::int8";

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
/// and `consumers`, the live consumers serving it.
pub const SUBSCRIPTIONS_LIST: &str = "\
SELECT s.name, s.patterns, s.max_attempts, s.created_at, s.updated_at,
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

// ---- The dashboard (`pgbus ui`): reads of crate::admin ----

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
/// [`STATUS_SUBSCRIPTIONS`] counts them over a window of one's choosing, reading at most
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

/// Publishes events ([`publish`](crate::publish()), [`publish_batch`](crate::publish_batch()),
/// and `pgbus::sqlx`'s): a call of `pgbus.publish_batch` (migration 11), whose statement
/// PL/pgSQL plans once per connection, so that this call can be sent unnamed (pooler-safe)
/// and still cost no planning of the statement itself.
///
/// Parameters: one array per column, all of the same length (one event is a batch of
/// one): `$1 text[]` ids, `$2 text[]` names, `$3 int4[]` versions, `$4 text[]` sources,
/// `$5 text[]` aggregate types, `$6 text[]` aggregate ids, `$7 text[]` correlation ids,
/// `$8 text[]` causation ids, `$9 timestamptz[]` occurred at, `$10 text[]` payloads (JSON
/// text), `$11 text[]` headers (JSON text), `$12 timestamptz[]` deliver at, `$13 int8[]`
/// delays in milliseconds, `$14 text[]` ordering keys.
///
/// Returns one row: `inserted`, how many events were inserted, and `conflict`, the id of
/// an event already in the log with different content (NULL when none does; then nothing
/// was inserted). An id already in the log with the same content (less the trace context)
/// is a duplicate: skipped, not counted.
pub const PUBLISH_BATCH: &str = "SELECT inserted, conflict \
     FROM pgbus.publish_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

/// Publishes one event ([`publish`](crate::publish()) and `pgbus::sqlx::publish`): a call
/// of `pgbus.publish_event` (migration 11), with [`PUBLISH_BATCH`]'s contract for a batch
/// of one, but scalar parameters of [`PUBLISH_TYPES`] in the same order: cheaper for one
/// event than arrays to decode and expand. Returns one row: `inserted` (0 or 1) and
/// `conflict` (the id, when it is in the log with different content; then nothing was
/// written).
pub const PUBLISH_EVENT: &str = "SELECT inserted, conflict \
     FROM pgbus.publish_event($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

/// The types of one event's 14 values, in the order of [`PUBLISH_BATCH`]'s parameters
/// (their element types): [`PUBLISH_EVENT`]'s parameters.
pub const PUBLISH_TYPES: [tokio_postgres::types::Type; 14] = [
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::INT4,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TIMESTAMPTZ,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TEXT,
    tokio_postgres::types::Type::TIMESTAMPTZ,
    tokio_postgres::types::Type::INT8,
    tokio_postgres::types::Type::TEXT,
];

/// Every statement above, by name.
pub const ALL: &[(&str, &str)] = &[
    ("CLAIM", CLAIM),
    ("SETTLE", SETTLE),
    ("ACK_IN", ACK_IN),
    ("EXTEND", EXTEND),
    ("REAP", REAP),
    ("REPAIR", REPAIR),
    ("ENSURE_HEADS", ENSURE_HEADS),
    ("SUBSCRIPTION_SETTINGS", SUBSCRIPTION_SETTINGS),
    ("SUBSCRIPTION_CREATE", SUBSCRIPTION_CREATE),
    ("CONFIGURE_SUBSCRIPTION", CONFIGURE_SUBSCRIPTION),
    ("TRY_CONFIGURE_SUBSCRIPTION", TRY_CONFIGURE_SUBSCRIPTION),
    ("BLOCKED_KEYS", BLOCKED_KEYS),
    ("REDRIVE_HEAD", REDRIVE_HEAD),
    ("SKIP_HEAD", SKIP_HEAD),
    ("KEY_WAITING", KEY_WAITING),
    ("CONSUMER_HEARTBEAT", CONSUMER_HEARTBEAT),
    ("CONSUMER_BEAT", CONSUMER_BEAT),
    ("BACKLOG_LIVE", BACKLOG_LIVE),
    ("CONSUMER_SLEEP", CONSUMER_SLEEP),
    ("CONSUMER_REMOVE", CONSUMER_REMOVE),
    ("LEADER_RESIGN", LEADER_RESIGN),
    ("BACKLOG", BACKLOG),
    ("STATUS_SUBSCRIPTIONS", STATUS_SUBSCRIPTIONS),
    ("STATUS_CLUSTER", STATUS_CLUSTER),
    ("XMIN_HORIZON", XMIN_HORIZON),
    ("FAN_OUT_BACKLOG", FAN_OUT_BACKLOG),
    ("SUBSCRIPTION_EXISTS", SUBSCRIPTION_EXISTS),
    ("DEAD_LIST", DEAD_LIST),
    ("DEAD_COUNT", DEAD_COUNT),
    ("DEAD_RETRY", DEAD_RETRY),
    ("DEAD_PURGE", DEAD_PURGE),
    ("REPLAY", REPLAY),
    ("SUBSCRIPTIONS_LIST", SUBSCRIPTIONS_LIST),
    ("SUBSCRIPTION_DROP", SUBSCRIPTION_DROP),
    ("SWEEP", SWEEP),
    ("PUBLISH_BATCH", PUBLISH_BATCH),
    ("PUBLISH_EVENT", PUBLISH_EVENT),
    ("CLAIM_CALL", CLAIM_CALL),
    ("CONSUMERS_LIST", CONSUMERS_LIST),
    ("DELIVERED_RECENTLY", DELIVERED_RECENTLY),
    ("FAILURE_HISTORY", FAILURE_HISTORY),
    ("EVENT_BY_ID", EVENT_BY_ID),
    ("EVENTS_BY_CORRELATION", EVENTS_BY_CORRELATION),
    ("EVENT_DELIVERIES", EVENT_DELIVERIES),
];
