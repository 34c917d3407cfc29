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
