//! What the library's and the command line's subscription-settings tests share
//! (`tests/subscription_settings.rs`, `cli/tests/subscription_settings.rs`).

use pgbus::DeadHeadPolicy;
use pgbus::admin;

/// Subscription `ship`: `order.*`, ordered, skipping dead heads.
pub(crate) async fn ordered_ship(client: &tokio_postgres::Client) {
    admin::register_subscription(client, "ship", &["order.*"], 7)
        .await
        .unwrap();
    pgbus::ordering::set_ordering(client, "ship", true, DeadHeadPolicy::Skip)
        .await
        .unwrap();
}

/// The stored settings of `ship`.
pub(crate) async fn stored(client: &tokio_postgres::Client) -> admin::SubscriptionSettings {
    admin::subscription_settings(client, "ship")
        .await
        .unwrap()
        .expect("the subscription exists")
}
