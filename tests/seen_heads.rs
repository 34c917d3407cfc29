//! Skipping and redriving the head an operator saw (migration 29): the action is done only
//! while the key's head is the event the caller names, in a state the action applies to;
//! otherwise nothing changes and the answer says what the head is now.

mod common;

use pgbus::ordering::{self, SeenHead};
use tokio_postgres::Client;

/// Key `k` of the ordered subscription `o`: `e1` its dead head, then `e2` and `e3`
/// waiting behind it.
async fn blocked_key(client: &Client) {
    pgbus::admin::register_subscription(client, "o", &["o.*"], 1)
        .await
        .unwrap();
    ordering::set_ordering(client, "o", true, pgbus::DeadHeadPolicy::Block)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, payload, ordering_key) \
             VALUES ('e1', 'o.x', '{}', 'k'), ('e2', 'o.x', '{}', 'k'), ('e3', 'o.x', '{}', 'k')",
        )
        .await
        .unwrap();
    common::fan_out(client).await;
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'dead', attempts = 1, last_error = 'boom' \
             WHERE is_head",
        )
        .await
        .unwrap();
    assert_eq!(heads(client).await, "e1 dead");
}

/// The key's head: its event id and state.
async fn heads(client: &Client) -> String {
    let rows = client
        .query(
            "SELECT e.id || ' ' || d.status FROM pgbus.deliveries AS d \
             JOIN pgbus.events AS e ON e.seq = d.event_seq WHERE d.is_head ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| r.get::<_, String>(0))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every delivery's state, for "nothing changed".
async fn deliveries(client: &Client) -> Vec<String> {
    client
        .query(
            "SELECT e.id || ' ' || d.status || ' ' || d.attempts || ' ' || d.is_head \
             FROM pgbus.deliveries AS d JOIN pgbus.events AS e ON e.seq = d.event_seq \
             ORDER BY d.event_seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn changed(head: &str, status: &str) -> SeenHead {
    SeenHead::Changed {
        head: Some(head.to_owned()),
        status: Some(status.to_owned()),
    }
}

/// A skip of the head seen is done and promotes the next; the same skip sent again (a
/// resubmitted form) finds another head and changes nothing; a skip naming an event
/// that is not the head changes nothing either.
#[tokio::test]
async fn a_skip_acts_only_on_the_head_that_was_seen() {
    let db = common::test_db().await;
    let client = db.connect().await;
    blocked_key(&client).await;

    let before = deliveries(&client).await;
    let refused = ordering::skip_seen_head(&client, "o", "k", "e2")
        .await
        .unwrap();
    assert_eq!(refused, changed("e1", "dead"), "e2 is not the head");
    assert_eq!(
        refused.change_from("e2").as_deref(),
        Some("its head is now e1 (dead), not e2")
    );
    assert_eq!(
        deliveries(&client).await,
        before,
        "a refused skip changed something"
    );

    assert_eq!(
        ordering::skip_seen_head(&client, "o", "k", "e1")
            .await
            .unwrap(),
        SeenHead::Done {
            promoted: Some("e2".to_owned())
        }
    );
    assert_eq!(heads(&client).await, "e2 pending");

    // Sent again: e2 is the head now, and pending: nothing is skipped.
    let before = deliveries(&client).await;
    assert_eq!(
        ordering::skip_seen_head(&client, "o", "k", "e1")
            .await
            .unwrap(),
        changed("e2", "pending")
    );
    assert_eq!(deliveries(&client).await, before);

    // The head seen, but no longer dead (redriven by someone else): not skipped.
    let refused = ordering::skip_seen_head(&client, "o", "k", "e2")
        .await
        .unwrap();
    assert_eq!(refused, changed("e2", "pending"));
    assert_eq!(
        refused.change_from("e2").as_deref(),
        Some("its head e2 is pending now")
    );
    assert_eq!(deliveries(&client).await, before);
}

/// A redrive of the head seen is done; one naming an event that is no longer the head
/// (it was skipped meanwhile) changes nothing and names the head now; a key with no head
/// says so.
#[tokio::test]
async fn a_redrive_acts_only_on_the_head_that_was_seen() {
    let db = common::test_db().await;
    let client = db.connect().await;
    blocked_key(&client).await;

    assert_eq!(
        ordering::skip_seen_head(&client, "o", "k", "e1")
            .await
            .unwrap(),
        SeenHead::Done {
            promoted: Some("e2".to_owned())
        }
    );
    let before = deliveries(&client).await;
    assert_eq!(
        ordering::redrive_seen_head(&client, "o", "k", "e1")
            .await
            .unwrap(),
        changed("e2", "pending"),
        "e1 was skipped: its redrive must not touch e2"
    );
    assert_eq!(deliveries(&client).await, before);

    client
        .batch_execute("UPDATE pgbus.deliveries SET status = 'dead', attempts = 1 WHERE is_head")
        .await
        .unwrap();
    assert_eq!(
        ordering::redrive_seen_head(&client, "o", "k", "e2")
            .await
            .unwrap(),
        SeenHead::Done { promoted: None }
    );
    assert_eq!(heads(&client).await, "e2 pending");
    let attempts: i32 = client
        .query_one("SELECT attempts FROM pgbus.deliveries WHERE is_head", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(attempts, 0, "a redriven dead head gets its attempts back");

    let refused = ordering::redrive_seen_head(&client, "o", "nokey", "e2")
        .await
        .unwrap();
    assert_eq!(
        refused,
        SeenHead::Changed {
            head: None,
            status: None
        }
    );
    assert_eq!(
        refused.change_from("e2").as_deref(),
        Some("it has no head now")
    );
    assert_eq!(SeenHead::Done { promoted: None }.change_from("e2"), None);
}
