//! Not committed: needs `Delivery::release()` in the library. A failure of consume's own
//! output charges no attempt and dead-letters nothing, even on a delivery's last attempt.

mod common;
mod proc;

use std::process::Stdio;
use std::time::Duration;

use proc::{WAIT, count, pgbus_on, run_with, start_consume};
use tokio::io::{AsyncBufReadExt, BufReader};

async fn publish(db: &common::TestDb, name: &str, n: usize) {
    let input: String = (0..n).map(|i| format!("{{\"i\": {i}}}\n")).collect();
    run_with(
        pgbus_on(db),
        &["publish", name, "-", "--lines"],
        Some(&input),
    )
    .await
    .ok();
}

/// No delivery dead, none charged an attempt, none left processing.
async fn nothing_charged(client: &tokio_postgres::Client, stderr: &str) {
    assert_eq!(
        count(
            client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'pending' OR attempts <> 0"
        )
        .await,
        0,
        "{stderr}"
    );
    assert_eq!(
        count(client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        0,
        "{stderr}"
    );
}

#[tokio::test]
async fn a_full_stdout_charges_no_attempt_even_on_the_last_one() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut cmd = pgbus_on(&db);
    cmd.args([
        "consume",
        "-s",
        "full",
        "-p",
        "full.*",
        "--max-attempts",
        "1",
    ])
    .stdout(std::fs::File::create("/dev/full").unwrap());
    let (mut child, stderr) = start_consume(cmd).await;
    publish(&db, "full.job", 5).await;
    let status = common::within("consume to stop", Duration::from_secs(15), child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    nothing_charged(&client, &stderr).await;
}

#[tokio::test]
async fn a_reader_that_goes_away_charges_no_attempt() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut cmd = pgbus_on(&db);
    cmd.args([
        "consume",
        "-s",
        "head",
        "-p",
        "head.*",
        "--max-attempts",
        "1",
    ])
    .stdout(Stdio::piped());
    let (mut child, stderr) = start_consume(cmd).await;
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    publish(&db, "head.job", 20).await;
    common::within("a first line", WAIT, stdout.next_line())
        .await
        .unwrap()
        .unwrap();
    drop(stdout);
    let status = common::within("consume to stop", Duration::from_secs(15), child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    nothing_charged(&client, &stderr).await;
}
