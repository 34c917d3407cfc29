//! The command line and the dashboard say which grant an action needs: a role with only
//! the consumer grant is refused each operator command (exit 1) and dashboard action
//! (403) with the statement that gives it the operator grant, and a subscription's drop
//! with the owner's; with the operator grant the same commands and actions run. The
//! library's part is in `tests/security.rs`.

mod common;
mod dashboard;
mod proc;
#[path = "../../tests/shared/roles.rs"]
mod roles;

use dashboard::{Ui, csrf_cookie, http};
use proc::{pgbus, run};
use roles::Roles;
use tokio::process::Command;

/// The test's database's connection string for `role`.
fn url_as(db: &common::TestDb, role: &str) -> String {
    let mut config = db.config();
    config.user(role);
    common::conninfo(&config)
}

/// The `pgbus` binary connecting to the test's database as `role`.
fn pgbus_as(db: &common::TestDb, role: &str) -> Command {
    let mut cmd = pgbus();
    cmd.env("DATABASE_URL", url_as(db, role));
    cmd
}

/// A role with the consumer grant, and an ordered subscription `s` whose key `k` is
/// blocked by a dead head (three attempts made).
async fn consumer_and_a_dead_letter(db: &common::TestDb, admin: &tokio_postgres::Client) -> Roles {
    let roles = Roles::create(db.config(), &["consumer"]).await;
    admin
        .execute(
            "SELECT pgbus.grant_consumer($1::text::regrole)",
            &[&roles.names[0]],
        )
        .await
        .unwrap();
    admin
        .batch_execute(
            "INSERT INTO pgbus.subscriptions (name, patterns, ordered) VALUES ('s', '{*}', true);
             SELECT pgbus.publish('a.b', '{}', id => 'e1', ordering_key => 'k');",
        )
        .await
        .unwrap();
    common::fan_out(admin).await;
    admin
        .batch_execute("UPDATE pgbus.deliveries SET status = 'dead', attempts = 3")
        .await
        .unwrap();
    roles
}

#[tokio::test]
async fn each_operator_command_names_the_grant_it_needs() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = consumer_and_a_dead_letter(&db, &admin).await;
    let role = &roles.names[0];
    let commands: &[&[&str]] = &[
        &["dead", "retry", "--all", "--subscription", "s"],
        &["dead", "purge", "--all", "--subscription", "s", "--yes"],
        &["replay", "-s", "s", "--since", "1d"],
        &["subscriptions", "set", "s", "--max-attempts", "9"],
        &["keys", "redrive", "s", "k"],
        &["keys", "skip", "s", "k"],
    ];
    let fix = format!("SELECT pgbus.grant_operator('{role}')");
    for args in commands {
        let out = run(pgbus_as(&db, role), args).await;
        assert_eq!(out.code, 1, "{args:?}: {out:?}");
        assert_eq!(out.stderr.lines().count(), 1, "{args:?}: {out:?}");
        assert!(out.stderr.contains("(SQLSTATE 42501)"), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains("needs the operator grant") && out.stderr.contains(&fix),
            "{args:?}: {out:?}"
        );
    }
    let out = run(
        pgbus_as(&db, role),
        &["subscriptions", "drop", "s", "--force"],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("the schema's owner"), "{out:?}");
    let dead: i64 = admin
        .query_one(
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead' AND attempts = 3",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dead, 1, "a refused command changed something");

    // With the operator grant, the same commands run.
    admin
        .execute("SELECT pgbus.grant_operator($1::text::regrole)", &[role])
        .await
        .unwrap();
    for args in commands {
        // Each command finds the key's head dead (a purge deletes it; the replay after
        // it brings it back).
        admin
            .batch_execute("UPDATE pgbus.deliveries SET status = 'dead', is_head = true")
            .await
            .unwrap();
        run(pgbus_as(&db, role), args).await.ok();
    }
}

#[tokio::test]
async fn a_dashboard_action_names_the_grant_it_needs() {
    let db = common::test_db().await;
    let admin = db.connect().await;
    let roles = consumer_and_a_dead_letter(&db, &admin).await;
    let role = &roles.names[0];
    let ui = Ui::start_on(&url_as(&db, role), &["--allow-actions"], &[]).await;
    let token = csrf_cookie(&ui, &[]).await;
    let cookie = format!("pgbus_csrf={token}");
    let origin = format!("http://{}", ui.addr);
    let headers = [("Cookie", cookie.as_str()), ("Origin", origin.as_str())];
    let form = format!("csrf={token}");
    let retry = || http(ui.addr, "POST", "/subscriptions/s/retry", &headers, &form);
    let answer = retry().await;
    assert_eq!(answer.status, 403, "{answer:?}");
    assert!(
        answer.body.contains("needs the operator grant")
            && answer.body.contains("pgbus.grant_operator(")
            && answer.body.contains(role.as_str()),
        "{}",
        answer.body
    );
    admin
        .execute("SELECT pgbus.grant_operator($1::text::regrole)", &[role])
        .await
        .unwrap();
    let answer = retry().await;
    assert_eq!(answer.status, 303, "{answer:?}");
}
