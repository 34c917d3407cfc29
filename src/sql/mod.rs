//! Every statement the bus runs, named and documented in one place.
//!
//! The schema is in `sql/` (`sql/schema.sql` is its current state); the statements are
//! here, one file per wing: publishing's, the runtime's, the connections', `migrate`'s, the operator
//! API's and the dashboard's. `tests/sql_home.rs` keeps every statement of the library
//! in this folder.
//! The bus prepares these once per pooled connection (one round trip per use after
//! that). [`ALL`] lists them so that a test can prepare each against a migrated database.

mod admin;
mod connect;
mod dashboard;
mod migrate;
mod publish;
mod runtime;

pub use admin::*;
pub(crate) use connect::*;
pub use dashboard::*;
pub(crate) use migrate::*;
pub use publish::*;
pub use runtime::*;

/// Every statement above, by name.
pub const ALL: &[(&str, &str)] = &[
    ("SETTLE", SETTLE),
    ("ACK_IN", ACK_IN),
    ("EXTEND", EXTEND),
    ("REAP", REAP),
    ("REPAIR", REPAIR),
    ("ENSURE_HEADS", ENSURE_HEADS),
    ("SUBSCRIPTION_SETTINGS", SUBSCRIPTION_SETTINGS),
    ("REGISTER_SUBSCRIPTION", REGISTER_SUBSCRIPTION),
    ("SUBSCRIPTION_CREATE", SUBSCRIPTION_CREATE),
    ("CONFIGURE_SUBSCRIPTION", CONFIGURE_SUBSCRIPTION),
    ("TRY_CONFIGURE_SUBSCRIPTION", TRY_CONFIGURE_SUBSCRIPTION),
    ("BLOCKED_KEYS", BLOCKED_KEYS),
    ("REDRIVE_HEAD", REDRIVE_HEAD),
    ("SKIP_HEAD", SKIP_HEAD),
    ("SKIP_SEEN_HEAD", SKIP_SEEN_HEAD),
    ("REDRIVE_SEEN_HEAD", REDRIVE_SEEN_HEAD),
    ("PAUSE_SUBSCRIPTION", PAUSE_SUBSCRIPTION),
    ("RESUME_SUBSCRIPTION", RESUME_SUBSCRIPTION),
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
    ("PENDING_LIST", PENDING_LIST),
];
