//! The `pgbus` commands with a standard output that is closed (the reader went away)
//! or failing (a full disk): each ends with a documented exit code, never a panic, and
//! `publish` says what it committed.

mod common;
mod proc;

use std::process::Stdio;

use proc::{WAIT, count, pgbus_on, run_with};

async fn publish(db: &common::TestDb, name: &str, n: usize, payload: &str) {
    let input: String = (0..n)
        .map(|i| format!("{{\"i\": {i}{payload}}}\n"))
        .collect();
    run_with(
        pgbus_on(db),
        &["publish", name, "-", "--lines"],
        Some(&input),
    )
    .await
    .ok();
}

/// Runs `pgbus ARGS` with its standard output closed before it writes, or to
/// /dev/full; returns the exit code and standard error.
async fn with_output(db: &common::TestDb, args: &[&str], full: bool) -> (i32, String) {
    let mut cmd = pgbus_on(db);
    cmd.args(args).stderr(Stdio::piped());
    if full {
        cmd.stdout(std::fs::File::create("/dev/full").unwrap());
    } else {
        cmd.stdout(Stdio::piped());
    }
    let mut child = cmd.spawn().unwrap();
    // The reader goes away at once (`| head -0`, or a `| head -1` done reading).
    drop(child.stdout.take());
    let out = common::within(
        &format!("pgbus {}", args.join(" ")),
        WAIT,
        child.wait_with_output(),
    )
    .await
    .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn every_command_ends_with_a_documented_code_when_its_output_is_closed_or_full() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "audit", &["*"], 25)
        .await
        .unwrap();
    publish(&db, "audit.seen", 3, "").await;
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["status", "--watch", "--interval", "100ms"],
        &["subscriptions", "list"],
        &["dead", "list"],
        &["keys", "list"],
        &["migrate"],
    ] {
        let (code, stderr) = with_output(&db, args, false).await;
        assert_eq!(code, 0, "{args:?} closed: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let (code, stderr) = with_output(&db, args, true).await;
        assert_eq!(code, 1, "{args:?} full: {stderr}");
        assert!(
            stderr.contains("could not write to standard output"),
            "{args:?}: {stderr}"
        );
    }
}

#[tokio::test]
async fn publish_with_its_output_closed_says_what_it_committed_and_is_not_retried() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let input: String = (0..50).map(|i| format!("{{\"i\": {i}}}\n")).collect();
    for (full, code) in [(false, 0), (true, 1)] {
        let mut cmd = pgbus_on(&db);
        cmd.args(["publish", "order.placed", "-", "--lines"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped());
        if full {
            cmd.stdout(std::fs::File::create("/dev/full").unwrap());
        } else {
            cmd.stdout(Stdio::piped());
        }
        let mut child = cmd.spawn().unwrap();
        drop(child.stdout.take());
        let mut stdin = child.stdin.take().unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut stdin, input.as_bytes())
            .await
            .unwrap();
        drop(stdin);
        let out = common::within("publish", WAIT, child.wait_with_output())
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "full={full}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains("published and committed 50 events (50 new)")
                && stderr.contains("do not publish them again"),
            "full={full}: {stderr}"
        );
    }
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.events").await,
        100
    );
}
