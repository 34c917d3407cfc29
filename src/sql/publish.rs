//! The publishing statements: one event or a batch, through a PL/pgSQL function.

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
