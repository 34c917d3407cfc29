//! Ids and names an operator reads are refused when they carry control characters or
//! invisible formatting characters (bidirectional overrides, zero-width characters):
//! by the library before anything is sent, and by the schema for raw SQL.

mod common;

use pgbus::{Error, Event};
use serde_json::json;
use tokio_postgres::error::SqlState;

const SPOOFS: &[&str] = &[
    "evil\r",
    "\u{1b}[2Jclear",
    "a\u{85}b",
    "\u{202E}txt.exe",
    "ab\u{200B}cd",
    "x\u{2066}y",
    "\u{FEFF}bom",
    "rl\u{200F}m",
];

#[tokio::test]
async fn spoofing_characters_are_refused_in_ids_and_names_and_nothing_is_written() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for spoof in SPOOFS {
        let cases = [
            Event::new(format!("order.{spoof}"), json!({})),
            Event::new("order.placed", json!({})).id(*spoof),
            Event::new("order.placed", json!({})).correlation_id(*spoof),
            Event::new("order.placed", json!({})).aggregate("order", *spoof),
            Event::new("order.placed", json!({})).ordering_key(*spoof),
        ];
        for event in cases {
            let err = pgbus::publish(&client, &event).await.unwrap_err();
            assert!(matches!(err, Error::Invalid { .. }), "{spoof:?}: {err:?}");
        }
        // Raw SQL meets the schema's constraints.
        for sql in [
            "INSERT INTO pgbus.events (event_name) VALUES ('order.' || $1)",
            "INSERT INTO pgbus.events (event_name, id) VALUES ('order.placed', $1)",
            "INSERT INTO pgbus.events (event_name, correlation_id) VALUES ('order.placed', $1)",
            "INSERT INTO pgbus.events (event_name, ordering_key) VALUES ('order.placed', $1)",
            "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('s' || $1, '{*}')",
        ] {
            let err = client.execute(sql, &[spoof]).await.unwrap_err();
            assert_eq!(
                err.code(),
                Some(&SqlState::CHECK_VIOLATION),
                "{sql} {spoof:?}"
            );
        }
        let err = pgbus::admin::register_subscription(&client, &format!("s{spoof}"), &["*"], 1)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{spoof:?}: {err:?}");
    }
    let written: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM pgbus.events) + (SELECT count(*) FROM pgbus.subscriptions)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 0);
    // Ordinary text outside ASCII stays welcome.
    pgbus::publish(
        &client,
        &Event::new("commande.passée", json!({}))
            .id("идентификатор-1")
            .aggregate("注文", "42"),
    )
    .await
    .unwrap();
}
