//! The limits on what goes into the log hold for every writer and measure what readers
//! receive: the size limit counts the JSON text a consumer is sent (not the compressed,
//! stored jsonb), and keys are bounded so that ordered subscriptions can index them. A
//! refused event changes nothing: no row, no delivery, and every subscription goes on.

mod common;

use std::collections::VecDeque;

use futures::SinkExt;
use pgbus::{DeadHeadPolicy, Error, Event, MAX_EVENT_BYTES, Publisher};
use proptest::prelude::*;
use serde_json::{Value, json};
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

/// An ordered subscription "o" and an unordered one "u", both for every event.
async fn two_subscriptions(client: &Client) {
    for name in ["o", "u"] {
        pgbus::admin::register_subscription(client, name, &["*"], 25)
            .await
            .unwrap();
    }
    pgbus::ordering::set_ordering(client, "o", true, DeadHeadPolicy::Block)
        .await
        .unwrap();
}

/// How many events and deliveries there are.
async fn rows(client: &Client) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM pgbus.events), (SELECT count(*) FROM pgbus.deliveries)",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Publishes a good event and checks that both subscriptions got a delivery of it: a
/// refused event before it left the bus as it was.
async fn both_subscriptions_still_deliver(client: &Client) {
    let event = Event::new("after.refusal", json!({"ok": true})).aggregate("order", "42");
    pgbus::publish(client, &event).await.unwrap();
    common::fan_out(client).await;
    let subs: Vec<String> = client
        .query(
            "SELECT d.subscription FROM pgbus.deliveries AS d
             JOIN pgbus.events AS e ON e.seq = d.event_seq
             WHERE e.id = $1 AND d.is_head ORDER BY 1",
            &[&event.id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(subs, ["o", "u"]);
}

/// Asserts that `err` is the schema's CHECK violation of `constraint`.
fn assert_check(err: &tokio_postgres::Error, constraint: &str) {
    let db = err.as_db_error().unwrap_or_else(|| panic!("{err:?}"));
    assert_eq!(db.code(), &SqlState::CHECK_VIOLATION, "{db:?}");
    assert_eq!(db.constraint(), Some(constraint), "{db:?}");
}

/// A JSON array of `n` copies of 1e131071: a few bytes each as written and as stored,
/// 131,072 digits each as PostgreSQL sends it back.
fn number_bomb(n: usize) -> String {
    format!("[{}]", vec!["1e131071"; n].join(","))
}

/// Over the limit by text, a small fraction of it as stored: 130 numbers are 17 MB of
/// text and about 2 kB of jsonb.
const BOMB_ELEMENTS: usize = 130;

/// The case of the report: a payload copied from a table (compressed, 16 MiB and more of
/// text) went into the log by `INSERT ... SELECT`, and so through MERGE. 17 MiB of one
/// repeated character compresses to almost nothing.
#[tokio::test]
async fn a_compressed_payload_over_the_limit_is_refused_from_insert_select_and_merge() {
    let db = common::test_db().await;
    let client = db.connect().await;
    two_subscriptions(&client).await;
    let over = i32::try_from(MAX_EVENT_BYTES + 1024 * 1024).unwrap();
    client
        .batch_execute(&format!(
            "CREATE TEMP TABLE big AS SELECT jsonb_build_object('s', repeat('x', {over})) AS p"
        ))
        .await
        .unwrap();
    let stored: i32 = client
        .query_one("SELECT pg_column_size(p) FROM big", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        stored < 1024 * 1024,
        "the payload is stored compressed: {stored}"
    );

    let err = client
        .execute(
            "INSERT INTO pgbus.events (event_name, payload) SELECT 'p.big', p FROM big",
            &[],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    // Headers count too.
    let err = client
        .execute(
            "INSERT INTO pgbus.events (event_name, headers) SELECT 'p.big', p FROM big",
            &[],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    let err = client
        .execute(
            "MERGE INTO pgbus.events AS e USING big ON false
             WHEN NOT MATCHED THEN INSERT (event_name, payload) VALUES ('p.big', big.p)",
            &[],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    // The publish functions take it as text and store the same jsonb.
    let err = client
        .execute("SELECT pgbus.publish('p.big', p) FROM big", &[])
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    assert_eq!(rows(&client).await, (0, 0));
    both_subscriptions_still_deliver(&client).await;
}

/// A number that PostgreSQL writes back with 131,072 digits is stored in a few bytes:
/// COPY, a multi-row VALUES, every publish function and the library all refuse a payload
/// of them, and a batch with one such row writes nothing of the batch.
#[tokio::test]
async fn numbers_that_expand_on_the_way_out_count_at_their_delivered_size() {
    let db = common::test_db().await;
    let mut client = db.connect().await;
    two_subscriptions(&client).await;
    let bomb = number_bomb(BOMB_ELEMENTS);
    let sizes = client
        .query_one(
            "SELECT pg_column_size($1::text::jsonb), octet_length($1::text::jsonb::text)::int8",
            &[&bomb],
        )
        .await
        .unwrap();
    let (stored, text): (i32, i64) = (sizes.get(0), sizes.get(1));
    assert!(stored < 16 * 1024, "{stored}");
    assert!(text > MAX_EVENT_BYTES as i64, "{text}");

    // COPY, text format: the good row before it is not written either.
    let tx = client.transaction().await.unwrap();
    let mut sink = Box::pin(
        tx.copy_in::<_, VecDeque<u8>>("COPY pgbus.events (event_name, payload) FROM STDIN")
            .await
            .unwrap(),
    );
    let lines = format!("p.good\t{{}}\np.bomb\t{bomb}\n");
    sink.send(VecDeque::from(lines.into_bytes())).await.unwrap();
    let err = sink.as_mut().finish().await.unwrap_err();
    assert_check(&err, "events_size_limit");
    drop(tx);

    let err = client
        .execute(
            "INSERT INTO pgbus.events (event_name, payload) VALUES ('p.good', '{}'), ('p.bomb', $1::text::jsonb)",
            &[&bomb],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    let err = client
        .execute("SELECT pgbus.publish('p.bomb', $1::text::jsonb)", &[&bomb])
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    let err = client
        .execute(
            "SELECT pgbus.publish_event('bomb-1', 'p.bomb', 1, NULL, NULL, NULL, NULL, NULL, \
             NULL, $1, '{}', NULL, NULL, NULL)",
            &[&bomb],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");
    let err = client
        .execute(
            "SELECT pgbus.publish_batch('{g,b}', '{p.good,p.bomb}', '{1,1}', '{NULL,NULL}', \
             '{NULL,NULL}', '{NULL,NULL}', '{NULL,NULL}', '{NULL,NULL}', '{NULL,NULL}', \
             ARRAY['{}', $1], '{\"{}\",\"{}\"}', '{NULL,NULL}', '{NULL,NULL}', '{NULL,NULL}')",
            &[&bomb],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_size_limit");

    // The library refuses it before sending anything: the payload limit first, then the
    // schema's own limit, whatever the publisher allows.
    let payload: Value = serde_json::from_str(&bomb).unwrap();
    assert_eq!(pgbus::json_text_bytes(&payload), text as usize);
    let event = Event::new("p.bomb", payload.clone());
    let err = pgbus::publish(&client, &event).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Invalid {
                what: "payload",
                ..
            }
        ),
        "{err:?}"
    );
    let err = Publisher::new()
        .max_payload_bytes(usize::MAX)
        .publish(&client, &event)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Invalid { what: "event", .. }),
        "{err:?}"
    );
    let err = pgbus::publish_batch(&client, &[Event::new("p.good", json!({})), event])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    // Headers count towards the event's limit.
    let err = Publisher::new()
        .max_payload_bytes(usize::MAX)
        .publish(
            &client,
            &Event::new("p.bomb", json!({})).header("n", payload),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Invalid { what: "event", .. }),
        "{err:?}"
    );

    assert_eq!(rows(&client).await, (0, 0));
    both_subscriptions_still_deliver(&client).await;
}

/// The library's measure is the server's: for any JSON, `json_text_bytes` is
/// `octet_length(value::jsonb::text)`, so the library refuses exactly what the schema
/// would (numbers in every form, escapes, text outside ASCII).
#[test]
fn the_library_measures_json_as_postgresql_writes_it() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = runtime.block_on(common::test_db());
    let client = runtime.block_on(db.connect());
    let number = prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        (
            "-?(0|[1-9][0-9]{0,20})",
            proptest::option::of("[0-9]{1,20}"),
            proptest::option::of(("[eE]", "[+-]?", 0u32..1200))
        )
            .prop_map(|(int, frac, exp)| {
                let mut n = int;
                if let Some(frac) = frac {
                    n = format!("{n}.{frac}");
                }
                if let Some((e, sign, digits)) = exp {
                    n = format!("{n}{e}{sign}{digits}");
                }
                n
            }),
    ];
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("false".to_owned()),
        number,
        "[a-z\"\\\\/\u{1}-\u{1f}\u{7f}é€😀 ]{0,12}".prop_map(|s| Value::String(s).to_string()),
    ];
    let json = leaf.prop_recursive(4, 40, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6)
                .prop_map(|items| format!("[{}]", items.join(","))),
            proptest::collection::vec(("[a-z\"\\\\\n]{0,6}", inner), 0..6).prop_map(|pairs| {
                let body: Vec<String> = pairs
                    .into_iter()
                    .map(|(k, v)| format!("{}:{v}", Value::String(k)))
                    .collect();
                format!("{{{}}}", body.join(","))
            }),
        ]
    });
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    });
    runner
        .run(&json, |text| {
            let value: Value = serde_json::from_str(&text).unwrap();
            let server: i32 = runtime.block_on(async {
                client
                    .query_one("SELECT octet_length($1::text::jsonb::text)", &[&text])
                    .await
                    .unwrap_or_else(|e| panic!("{text}: {e:?}"))
                    .get(0)
            });
            prop_assert_eq!(pgbus::json_text_bytes(&value), server as usize, "{}", text);
            Ok(())
        })
        .unwrap();
}

/// The report's case: an 8,000-character aggregate id. It used to be published and then
/// break ordering (the key did not fit in an index entry): now the library and the schema
/// refuse it, and every writer gets the error naming the column.
#[tokio::test]
async fn an_over_long_key_is_refused_and_ordering_goes_on() {
    let db = common::test_db().await;
    let client = db.connect().await;
    two_subscriptions(&client).await;
    // Not compressible: 8,000 hex digits.
    let long: String = client
        .query_one(
            "SELECT string_agg(md5(i::text), '') FROM generate_series(1, 250) AS i",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(long.len(), 8000);

    let cases = [
        (
            "aggregate id",
            Event::new("k.long", json!({})).aggregate("order", &long),
        ),
        (
            "aggregate type",
            Event::new("k.long", json!({})).aggregate(&long[..256], "42"),
        ),
        (
            "ordering key",
            Event::new("k.long", json!({})).ordering_key(&long[..513]),
        ),
        (
            "correlation id",
            Event::new("k.long", json!({})).correlation_id(&long[..513]),
        ),
        (
            "causation id",
            Event::new("k.long", json!({})).causation_id(&long[..513]),
        ),
        (
            "source",
            Event::new("k.long", json!({})).source(&long[..256]),
        ),
    ];
    for (what, event) in cases {
        let err = pgbus::publish(&client, &event).await.unwrap_err();
        match &err {
            Error::Invalid { what: w, reason } => {
                assert_eq!(*w, what, "{err}");
                assert!(reason.contains("must be at most"), "{err}");
            }
            other => panic!("{what}: expected Invalid, got {other:?}"),
        }
    }

    for (column, constraint, text) in [
        ("aggregate_id", "events_aggregate_id_length", &long[..]),
        (
            "aggregate_type",
            "events_aggregate_type_length",
            &long[..256],
        ),
        ("ordering_key", "events_ordering_key_length", &long[..513]),
        (
            "correlation_id",
            "events_correlation_id_length",
            &long[..513],
        ),
        ("causation_id", "events_causation_id_length", &long[..513]),
        ("source", "events_source_length", &long[..256]),
    ] {
        let err = client
            .execute(
                &format!("INSERT INTO pgbus.events (event_name, {column}) VALUES ('k.long', $1)"),
                &[&text],
            )
            .await
            .unwrap_err();
        assert_check(&err, constraint);
    }
    let err = client
        .execute(
            "SELECT pgbus.publish('k.long', aggregate_type => 'order', aggregate_id => $1)",
            &[&long],
        )
        .await
        .unwrap_err();
    assert_check(&err, "events_aggregate_id_length");
    assert_eq!(rows(&client).await, (0, 0));

    // At the bounds, the longest key there can be (255 + 1 + 512 bytes) is ordered.
    let longest = Event::new("k.edge", json!({})).aggregate(&long[..255], &long[..512]);
    pgbus::publish(&client, &longest).await.unwrap();
    let keyed = Event::new("k.edge", json!({})).ordering_key(&long[..512]);
    pgbus::publish(&client, &keyed).await.unwrap();
    common::fan_out(&client).await;
    let heads: i64 = client
        .query_one(
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'o' AND is_head \
             AND octet_length(ordering_key) IN (512, 768)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(heads, 2);
    both_subscriptions_still_deliver(&client).await;
    // Turning ordering off and on again re-keys the backlog: every key fits.
    for ordered in [false, true] {
        pgbus::ordering::set_ordering(&client, "o", ordered, DeadHeadPolicy::Block)
            .await
            .unwrap();
    }
}

/// An event written before the bounds existed, with a key no index entry can hold, does
/// not stop the upgrade or ordering: migration 14 does not recheck old rows, and such a
/// key is ordered under its SHA-256 digest, so `subscriptions set --ordered` converts the
/// backlog and a replay files the event behind its key.
#[tokio::test]
async fn a_long_key_written_before_the_upgrade_is_ordered_by_its_digest() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // The schema as it was before version 14.
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    for m in pgbus::schema::MIGRATIONS.iter().filter(|m| m.version < 14) {
        client
            .batch_execute(&format!(
                "BEGIN;
                 CREATE SCHEMA IF NOT EXISTS pgbus;
                 CREATE TABLE IF NOT EXISTS pgbus.schema_migrations (
                     version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now());
                 {}
                 ;",
                m.sql
            ))
            .await
            .unwrap_or_else(|e| panic!("migration {}: {e:?}", m.version));
        client
            .execute(
                "INSERT INTO pgbus.schema_migrations (version, name, checksum) \
                 VALUES ($1, $2, md5($3::text))",
                &[&m.version, &m.name, &m.sql],
            )
            .await
            .unwrap();
        client.batch_execute("COMMIT").await.unwrap();
    }
    pgbus::admin::register_subscription(&client, "o", &["*"], 25)
        .await
        .unwrap();
    let long_id = "SELECT string_agg(md5(i::text), '') FROM generate_series(1, 250) AS i";
    client
        .execute(
            &format!(
                "INSERT INTO pgbus.events (id, event_name, aggregate_type, aggregate_id) \
                 VALUES ('legacy-1', 'k.legacy', 'order', ({long_id})), \
                        ('legacy-2', 'k.legacy', 'order', ({long_id}))"
            ),
            &[],
        )
        .await
        .unwrap();

    let applied = pgbus::migrate(&client).await.unwrap();
    assert!(applied.iter().any(|m| m.version == 14), "{applied:?}");
    pgbus::ordering::set_ordering(&client, "o", true, DeadHeadPolicy::Block)
        .await
        .unwrap();
    let keys: Vec<(String, bool)> = client
        .query(
            "SELECT ordering_key, is_head FROM pgbus.deliveries WHERE subscription = 'o' \
             ORDER BY event_seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys[0].0.starts_with("sha256:") && keys[0].0.len() == 71,
        "{keys:?}"
    );
    assert_eq!(keys[0].0, keys[1].0, "one key, one order");
    assert_eq!((keys[0].1, keys[1].1), (true, false));

    // Replayed, the events go behind their key, not beside it.
    client
        .batch_execute("DELETE FROM pgbus.deliveries")
        .await
        .unwrap();
    let replayed: i64 = client
        .query_one(
            "SELECT created FROM pgbus.replay('o', '-infinity', NULL, NULL)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(replayed, 2);
    let heads: i64 = client
        .query_one(
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'o' AND is_head \
             AND ordering_key LIKE 'sha256:%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(heads, 1);
}

/// The size limit accepts a pair of uncompressed documents of at most 512 stored bytes
/// without measuring their text (migration 16). That holds only while no document of
/// that size prints beyond the limit: the densest ones (numbers with the largest
/// exponents, escaped control characters, nested numbers) print far below it.
#[tokio::test]
async fn what_the_size_limit_admits_unmeasured_prints_below_the_limit() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for element in [
        "1e131071",
        "-1e131071",
        "1e-16383",
        "\"\\u0001\"",
        "[1e131071]",
        "{\"a\":1e131071}",
    ] {
        let row = client
            .query_one(
                "SELECT count(*)::int4 AS documents, max(pg_column_size(d))::int4 AS stored,
                        max(octet_length(d::text))::int4 AS text_bytes
                 FROM (SELECT ('[' || array_to_string(array_fill($1::text, ARRAY[n]), ',')
                               || ']')::jsonb AS d
                       FROM generate_series(1, 200) AS n) AS docs
                 WHERE pg_column_size(d) + pg_column_size('{}'::jsonb) <= 512",
                &[&element],
            )
            .await
            .unwrap();
        let (documents, stored, text): (i32, i32, i32) = (
            row.get("documents"),
            row.get("stored"),
            row.get("text_bytes"),
        );
        // The series reaches past 512 stored bytes, so the largest admitted one is here.
        assert!(
            documents > 0 && documents < 200,
            "{element}: {documents} documents"
        );
        assert!(stored <= 512, "{element}: {stored}");
        assert!(
            i64::from(text) <= MAX_EVENT_BYTES as i64 / 2,
            "{element}: {documents} elements in {stored} stored bytes print as {text} bytes"
        );
        // And the schema takes the largest of them.
        let payload = format!(
            "[{}]",
            std::iter::repeat_n(element, documents as usize)
                .collect::<Vec<_>>()
                .join(",")
        );
        client
            .execute(
                "SELECT pgbus.publish('dense.document', $1::text::jsonb)",
                &[&payload],
            )
            .await
            .unwrap();
    }
}
