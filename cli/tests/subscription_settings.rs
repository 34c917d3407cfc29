//! A subscription's settings from the command line: `pgbus consume` refuses to start
//! where it asks for other settings than the stored ones, and `pgbus subscriptions set`
//! changes them for everyone. The library's part is in `tests/subscription_settings.rs`.

mod common;
mod proc;
#[path = "../../tests/shared/subscription_settings.rs"]
mod shared;

use proc::{pgbus_on, run};
use shared::{ordered_ship, stored};

#[tokio::test]
async fn the_command_line_joins_refuses_and_sets() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_ship(&client).await;

    // A consumer asking for unordered delivery refuses, with exit 2, and says how.
    let out = run(pgbus_on(&db), &["consume", "-s", "ship", "--unordered"]).await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("ordered false (stored: true)"),
        "{out:?}"
    );
    assert!(
        out.stderr
            .contains("pgbus subscriptions set ship --unordered"),
        "{out:?}"
    );
    assert!(stored(&client).await.ordered);

    // The operator's command changes it for everyone.
    let out = run(
        pgbus_on(&db),
        &["subscriptions", "set", "ship", "--unordered", "--json"],
    )
    .await
    .ok();
    let v = out.json();
    assert_eq!(v["ordered"], false);
    assert_eq!(v["on_dead"], "skip");
    assert!(!stored(&client).await.ordered);

    // Nothing to change is a usage error; an unknown subscription a failure.
    assert_eq!(
        run(pgbus_on(&db), &["subscriptions", "set", "ship"])
            .await
            .code,
        2
    );
    assert_eq!(
        run(
            pgbus_on(&db),
            &["subscriptions", "set", "nope", "--ordered"]
        )
        .await
        .code,
        1
    );
}

/// `subscriptions set` waits for a transaction left open at most `--wait`, then fails
/// (exit 1) naming its session and changing nothing; once it ends, the same command works.
/// The open transaction publishes a keyed event of an ordered subscription: that is what
/// holds the configuration gate until the commit (`pgbus.order_key`; an unkeyed publish
/// takes nothing a settings change waits for).
#[tokio::test]
async fn set_gives_up_after_its_wait_naming_the_open_session() {
    let db = common::test_db().await;
    let client = db.connect().await;
    ordered_ship(&client).await;
    let mut open = db.connect().await;
    let tx = open.transaction().await.unwrap();
    pgbus::publish(
        &tx,
        &pgbus::Event::new("order.placed", serde_json::json!({})).ordering_key("order:1"),
    )
    .await
    .unwrap();
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let before = stored(&client).await.max_attempts;
    let set = [
        "subscriptions",
        "set",
        "ship",
        "--max-attempts",
        "4",
        "--wait",
        "1s",
    ];
    let out = run(pgbus_on(&db), &set).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("gave up waiting"), "{out:?}");
    assert!(out.stderr.contains(&format!("pid {pid} ")), "{out:?}");
    assert_eq!(stored(&client).await.max_attempts, before);
    tx.commit().await.unwrap();
    run(pgbus_on(&db), &set).await.ok();
    assert_eq!(stored(&client).await.max_attempts, 4);
    // The change cut a batch first: the committed event has its delivery.
    assert_eq!(
        common::count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'ship'"
        )
        .await,
        1
    );
}
