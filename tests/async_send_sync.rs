//! The public types can cross threads and live in spawned tasks.

fn send_sync_static<T: Send + Sync + 'static>() {}
fn send_static<T: Send + 'static>() {}

#[test]
fn public_types_are_send_sync_and_static() {
    send_sync_static::<pgbus::Bus>();
    send_sync_static::<pgbus::BusBuilder>();
    send_sync_static::<pgbus::RunningBus>();
    send_sync_static::<pgbus::Event>();
    send_sync_static::<pgbus::Error>();
    send_sync_static::<pgbus::PoolError>();
    send_sync_static::<pgbus::HandlerError>();
    send_sync_static::<pgbus::Delivery>();
    send_sync_static::<pgbus::Stats>();
    send_sync_static::<pgbus::RetryPolicy>();
    send_sync_static::<pgbus::SubscriptionOptions>();
    send_sync_static::<pgbus::Published>();
    send_sync_static::<pgbus::Publisher>();
    send_sync_static::<pgbus_testkit::embedded::EmbeddedPostgres>();
}

#[test]
fn streams_are_send_and_static() {
    // Streams are polled by one task at a time; Send is what spawning them needs.
    send_static::<pgbus::Subscription>();
}
