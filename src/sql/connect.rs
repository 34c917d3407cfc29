//! The statements of a connection's setup: its session settings, its isolation, and
//! what `target_session_attrs` asks of a server.

/// The bus's session settings as `SET` commands, for the session (`scope` `""`) or the
/// transaction (`"LOCAL "`): the statement timeout in milliseconds, synchronous_commit,
/// and the pinned search_path
/// ([`PINNED_SEARCH_PATH`](crate::schema::PINNED_SEARCH_PATH)).
pub(crate) fn session_settings(scope: &str, timeout_ms: u128, synchronous_commit: bool) -> String {
    format!(
        "SET {scope}statement_timeout = {timeout_ms}; SET {scope}synchronous_commit = {}; \
         SET {scope}search_path = {}",
        if synchronous_commit { "on" } else { "off" },
        crate::schema::PINNED_SEARCH_PATH,
    )
}

/// Makes the session's transactions READ COMMITTED whatever the database's default: the
/// bus's settlements, reaps and repairs decide heads from rows only a fresh snapshot per
/// statement shows.
pub(crate) const READ_COMMITTED: &str =
    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// What `target_session_attrs` checks of a server, as libpq asks it: whether it is in
/// recovery, and its `transaction_read_only`. Sent with the simple query protocol before
/// the connection is handed out.
pub(crate) const SESSION_ATTRS: &str = "SELECT pg_catalog.pg_is_in_recovery(), \
     pg_catalog.current_setting('transaction_read_only')";
