//! The delivery path's statements: claim, settle, maintain (the bus's own connections
//! prepare them once each).

/// Claims a batch of due deliveries of this bus's subscriptions and leases them: first
/// `pgbus.claim` turns what committed into deliveries (`pgbus.fan_out_committed`), then
/// it runs the claim query, the body of `pgbus.claim_due` (migrations 24 and 27; its current text
/// is in `sql/schema.sql`, and `pgbus_testkit::claim_statement` reads it for tests that
/// explain it). Its plan is generic (`plan_cache_mode = force_generic_plan`), cached for
/// the session by PL/pgSQL: no planning per claim, pooler or not.
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
/// one subscription's backlog never slows another's; the next due time is the same
/// index's first entry after `now()` (a head due later has `ready_at = available_at`),
/// so the deliveries carry one due-time index, not two (migration 27). The floor keeps the scan off the
/// index entries of deliveries claimed since the oldest open transaction began (which no
/// vacuum may remove while it runs): every claimable delivery has `ready_at` at or above
/// it, and `floors` (every row) gives the next claim's, in `$1`'s order: five seconds
/// before this claim when it took everything it found for the subscription, the oldest
/// it took when it was full, the same floor when it took none. Attempts count claims.
/// Only heads are claimable: every delivery of an unordered subscription, and the oldest
/// unfinished delivery of each key of an ordered one. A paused subscription (migration
/// 28; one primary-key probe of `pgbus.subscriptions` per subscription) takes nothing,
/// has no next due time, and keeps its floor, so that its first claim after the resume
/// finds every delivery made meanwhile.
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
/// inside `pgbus.claim` with a generic plan, built once per connection: planned for given
/// values, PostgreSQL re-planned it on every claim while
/// deliveries were pending, and a generic plan must not be able to join the lease's
/// update through a scan of the table.
///
/// A delivery whose `available_at` is `infinity` (written by SQL) is never due, and is not
/// a next due time either: `infinity - now()` is an error before PostgreSQL 17, which would
/// fail every claim of its subscription. One of `-infinity` is due at once, first.
pub const CLAIM_CALL: &str = "SELECT * FROM pgbus.claim($1, $2, $3, $4, $5, $6, $7, $8)";

/// The parameter types of [`CLAIM_CALL`] and of the claim query, for preparing them.
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
/// oldest claimable delivery became due (its `available_at`; NULL when none is due),
/// taken over the first 100 claimable deliveries by the time they became claimable;
/// `blocked_keys`, keys whose head is a dead letter; `paused`, whether it is paused
/// (migration 28).
///
/// Index-backed, each count bounded by `$2`: the heads through `deliveries_ready_idx`
/// (one range each side of `now()`, and its first 100 entries for the oldest age;
/// migration 27), the
/// deliveries behind a head through `deliveries_key_idx` (an unordered subscription has
/// none: an empty range), dead letters and blocked keys through `deliveries_dead_idx`,
/// and the leased ones through `deliveries_reap_idx` (all of them, grouped: they are as
/// many as the consumers hold). So a sample costs at most a few times `$2` index entries
/// per subscription, whatever the backlog (BENCHMARKS.md, "The gauges' statement").
pub const BACKLOG: &str = "\
SELECT subscription, due, scheduled, processing, dead, oldest_due_age, blocked_keys, paused
FROM pgbus.backlog($1::text[], $2::int8)";

/// [`BACKLOG`] for the subscriptions of every live bus and `$1`'s (the leader samples the
/// gauges for all of them). Parameters and rows as [`BACKLOG`]'s.
pub const BACKLOG_LIVE: &str = "\
SELECT subscription, due, scheduled, processing, dead, oldest_due_age, blocked_keys, paused
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
