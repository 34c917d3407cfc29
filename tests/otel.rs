//! Trace context across the bus (the `opentelemetry` feature), through a real PostgreSQL:
//! an in-memory OpenTelemetry exporter behind the `tracing-opentelemetry` layer shows the
//! handler's `process` span as a child of (and linked to) the publisher's span, with the
//! messaging conventions' attributes; the headers carry the W3C context.
//!
//! One subscriber for the whole binary (the bus's tasks run on the runtime's threads):
//! each test finds its own spans by the trace id of a root span of its own.

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use pgbus::trace_context::TraceParent;
use pgbus::{Bus, Event, HandlerError, Published, RetryPolicy, SubscriptionOptions};
use serde_json::json;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// The exporter every span of this binary ends in.
fn exporter() -> &'static InMemorySpanExporter {
    static INSTALLED: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    let (exporter, _) = INSTALLED.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("pgbus-tests"));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .expect("no other subscriber in this binary");
        (exporter, provider)
    });
    exporter
}

/// A root span of the test's own (a new trace), and its trace id.
fn root(name: &'static str) -> (tracing::Span, TraceId) {
    exporter();
    let span = tracing::info_span!("test", otel.name = name);
    let trace = span.context().span().span_context().trace_id();
    assert_ne!(trace, TraceId::INVALID, "the root span is recorded");
    (span, trace)
}

/// The finished spans of trace `trace`.
fn spans_of(trace: TraceId) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect()
}

/// Waits until trace `trace` holds a finished span named `name`, and returns it.
async fn span_named(trace: TraceId, name: &str) -> SpanData {
    common::wait_for(&format!("a span {name:?}"), common::WAIT, || async {
        spans_of(trace).iter().any(|s| s.name == name)
    })
    .await;
    spans_of(trace)
        .into_iter()
        .find(|s| s.name == name)
        .unwrap()
}

/// The value of attribute `key`.
fn attr(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

/// Asserts that `span` is pgbus's (`messaging.system`) and has each attribute of
/// `expected`.
fn assert_attrs(span: &SpanData, expected: &[(&str, Value)]) {
    let system = ("messaging.system", Value::from("pgbus"));
    for (key, value) in expected.iter().chain([&system]) {
        assert_eq!(
            attr(span, key).as_ref(),
            Some(value),
            "{key} of span {:?}: {:?}",
            span.name,
            span.attributes
        );
    }
}

/// The `traceparent` stored with event `id`.
async fn stored_traceparent(client: &tokio_postgres::Client, id: &str) -> Option<String> {
    client
        .query_one(
            "SELECT headers->>'traceparent' FROM pgbus.events WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

/// The `traceparent` of a finished span.
fn traceparent_of(span: &SpanData) -> String {
    let sc = &span.span_context;
    TraceParent::new(
        sc.trace_id().to_bytes(),
        sc.span_id().to_bytes(),
        sc.trace_flags().to_u8(),
    )
    .unwrap()
    .to_string()
}

/// A running bus whose subscription `name` acks every event matching `pattern`.
async fn acking_bus(db: &common::TestDb, name: &str, pattern: &str) -> pgbus::RunningBus {
    bus_with(db, name, pattern, SubscriptionOptions::new(), Ok).await
}

/// A running bus whose subscription `name` answers `outcome` to every event matching
/// `pattern`.
async fn bus_with(
    db: &common::TestDb,
    name: &str,
    pattern: &str,
    options: SubscriptionOptions,
    outcome: fn(()) -> Result<(), HandlerError>,
) -> pgbus::RunningBus {
    Bus::builder(db.config())
        .poll_interval(Duration::from_millis(100))
        .handler_fn_with(name, [pattern], options, move |_event: Event| async move {
            outcome(())
        })
        .build()
        .unwrap()
        .start()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_process_span_is_a_child_of_the_publishers_span_across_postgresql() {
    let (root, trace) = root("checkout");
    let db = common::test_db().await;
    let client = db.connect().await;
    let running = acking_bus(&db, "mailer", "order.*").await;
    let event = Event::new("order.placed", json!({"order_id": 42})).correlation_id("req-7");
    let published = pgbus::publish(&client, &event)
        .instrument(root.clone())
        .await
        .unwrap();
    assert_eq!(published, Published::Inserted);

    let process = span_named(trace, "process mailer").await;
    let create = span_named(trace, "publish order.placed").await;
    let root_id = root.context().span().span_context().span_id();

    // The publisher's span: a child of the caller's, its context in the headers.
    assert_eq!(create.parent_span_id, root_id);
    assert_eq!(create.span_kind, SpanKind::Producer);
    assert_attrs(
        &create,
        &[
            ("messaging.operation.type", "create".into()),
            ("messaging.operation.name", "publish".into()),
            ("messaging.destination.name", "order.placed".into()),
            ("messaging.message.id", event.id.clone().into()),
        ],
    );
    assert_eq!(
        stored_traceparent(&client, &event.id).await,
        Some(traceparent_of(&create))
    );

    // The handler's span: in the same trace, parented by and linked to the publisher's.
    assert_eq!(process.span_context.trace_id(), trace);
    assert_eq!(process.parent_span_id, create.span_context.span_id());
    assert!(
        process.parent_span_is_remote,
        "the parent came through the event"
    );
    let links: Vec<_> = process
        .links
        .iter()
        .map(|l| l.span_context.clone())
        .collect();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(links[0].span_id(), create.span_context.span_id());
    assert_eq!(links[0].trace_id(), trace);
    assert_eq!(process.span_kind, SpanKind::Consumer);
    assert_attrs(
        &process,
        &[
            ("messaging.operation.type", "process".into()),
            ("messaging.operation.name", "process".into()),
            ("messaging.destination.name", "order.placed".into()),
            ("messaging.destination.subscription.name", "mailer".into()),
            ("messaging.message.id", event.id.clone().into()),
            ("messaging.message.conversation_id", "req-7".into()),
        ],
    );
    assert_eq!(attr(&process, "error.type"), None);
    assert_eq!(process.status, Status::Unset);
    common::wait_settled(&client, "the delivery's ack").await;
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handlers_process_span_has_its_error_type() {
    let (root, trace) = root("failing");
    let db = common::test_db().await;
    let client = db.connect().await;
    let retry = SubscriptionOptions::new().retry(RetryPolicy::fixed(Duration::from_secs(3600)));
    let refuse = |()| Err(HandlerError::new("smtp refused"));
    let running = bus_with(&db, "doomed", "*", retry, refuse).await;
    pgbus::publish(&client, &Event::new("mail.send", json!({})))
        .instrument(root)
        .await
        .unwrap();
    let process = span_named(trace, "process doomed").await;
    assert_eq!(attr(&process, "error.type"), Some("handler_error".into()));
    assert!(
        matches!(process.status, Status::Error { .. }),
        "{:?}",
        process.status
    );
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_the_caller_set_is_kept_and_parents_the_process_span() {
    let (root, _) = root("caller-set");
    let db = common::test_db().await;
    let client = db.connect().await;
    let given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let event = Event::new("order.placed", json!({}))
        .header("traceparent", given)
        .header("tracestate", "congo=t61rcWkgMzE");
    let running = acking_bus(&db, "given", "*").await;
    pgbus::publish(&client, &event)
        .instrument(root)
        .await
        .unwrap();
    assert_eq!(
        stored_traceparent(&client, &event.id).await.as_deref(),
        Some(given)
    );
    let tp: TraceParent = given.parse().unwrap();
    let process = span_named(TraceId::from_bytes(tp.trace_id()), "process given").await;
    assert_eq!(process.parent_span_id.to_bytes(), tp.parent_id());
    assert_eq!(
        process
            .links
            .iter()
            .next()
            .unwrap()
            .span_context
            .trace_state()
            .header(),
        "congo=t61rcWkgMzE"
    );
    running.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_from_another_trace_is_a_duplicate_and_keeps_the_first_context() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let event = Event::new("order.placed", json!({"order_id": 1})).id("order-1-placed");
    let (first, first_trace) = root("first attempt");
    let (second, second_trace) = root("second attempt");
    assert_ne!(first_trace, second_trace);

    let outcome = pgbus::publish(&client, &event).instrument(first).await;
    assert_eq!(outcome.unwrap(), Published::Inserted);
    let outcome = pgbus::publish(&client, &event)
        .instrument(second.clone())
        .await;
    assert_eq!(outcome.unwrap(), Published::Duplicate);
    let batch = pgbus::publish_batch(&client, std::slice::from_ref(&event))
        .instrument(second.clone())
        .await;
    assert_eq!(batch.unwrap(), 0, "a batch's retry is a duplicate too");
    let stored: TraceParent = stored_traceparent(&client, &event.id)
        .await
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(TraceId::from_bytes(stored.trace_id()), first_trace);

    // Content still decides: another payload under the id is a conflict.
    let changed = Event::new("order.placed", json!({"order_id": 2})).id("order-1-placed");
    let outcome = pgbus::publish(&client, &changed).instrument(second).await;
    assert!(
        matches!(outcome, Err(pgbus::Error::Conflict { .. })),
        "{outcome:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_of_a_batch_carries_the_batch_spans_context() {
    let (root, trace) = root("batch");
    let db = common::test_db().await;
    let client = db.connect().await;
    let events: Vec<Event> = (0..3)
        .map(|i| Event::new(format!("order.n{i}"), json!({"n": i})))
        .collect();
    let inserted = pgbus::publish_batch(&client, &events)
        .instrument(root)
        .await
        .unwrap();
    assert_eq!(inserted, 3);
    let batch = span_named(trace, "publish").await;
    assert_attrs(
        &batch,
        &[
            ("messaging.operation.type", "create".into()),
            ("messaging.batch.message_count", 3_i64.into()),
        ],
    );
    for event in &events {
        assert_eq!(
            stored_traceparent(&client, &event.id).await,
            Some(traceparent_of(&batch)),
            "{}",
            event.id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_and_settle_spans_follow_the_messaging_conventions() {
    exporter();
    let db = common::test_db().await;
    let client = db.connect().await;
    let running = acking_bus(&db, "conventions", "*").await;
    let event = Event::new("a.b", json!({}));
    pgbus::publish(&client, &event).await.unwrap();
    common::wait_settled(&client, "the delivery's ack").await;
    running.shutdown().await.unwrap();
    let named = |name: &str, count: i64| {
        let op = KeyValue::new("messaging.batch.message_count", count);
        exporter()
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .find(|s| s.name == name && s.attributes.contains(&op))
            .unwrap_or_else(|| panic!("no {name:?} span of {count} message"))
    };
    assert_attrs(
        &named("claim", 1),
        &[
            ("messaging.operation.type", "receive".into()),
            ("messaging.operation.name", "claim".into()),
        ],
    );
    assert_attrs(
        &named("settle", 1),
        &[
            ("messaging.operation.type", "settle".into()),
            ("messaging.operation.name", "settle".into()),
        ],
    );
}
