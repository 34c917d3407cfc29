//! Worker processes killed with SIGKILL mid-handler: their deliveries come back after
//! the lease, and an event that kills its worker every time ends as a dead letter.

mod common;
mod proc;

use std::path::Path;

use proc::{Consumer, WAIT, count, pgbus_on, run, scratch, signal, wait_count, wait_settled};

/// The handler: notes its process id (the shell `exec`s into `sleep`, keeping it), then
/// hangs until killed.
const HANG: &str = "echo $$ >> pids.txt; exec sleep 600";

fn consume_args(max_attempts: &str) -> Vec<&str> {
    vec![
        "-s",
        "crash",
        "-p",
        "crash.*",
        "--lease",
        "2s",
        "--poll-interval",
        "200ms",
        "--max-attempts",
        max_attempts,
        "--exec",
        HANG,
    ]
}

fn handler_pids(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("pids.txt"))
        .unwrap_or_default()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

/// Waits until the `n`th handler runs with its delivery claimed, then kills the worker
/// and its handler with SIGKILL.
async fn kill_mid_handler(
    consumer: Consumer,
    client: &tokio_postgres::Client,
    dir: &Path,
    n: usize,
) {
    common::wait_for("the handler to start", WAIT, || async {
        handler_pids(dir).len() == n
    })
    .await;
    assert_eq!(
        count(
            client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing' AND locked_by IS NOT NULL"
        )
        .await,
        1
    );
    consumer.kill_hard().await;
    signal(handler_pids(dir)[n - 1], "KILL").await;
}

#[tokio::test]
async fn a_worker_killed_mid_handler_is_redelivered_after_its_lease() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("crash");
    let worker = Consumer::start_in(&db, &consume_args("25"), Some(&dir)).await;
    run(
        pgbus_on(&db),
        &["publish", "crash.boom", "{}", "--id", "e1"],
    )
    .await
    .ok();
    kill_mid_handler(worker, &client, &dir, 1).await;

    // A second worker gets it once the dead worker's lease has run out.
    let mut rescuer = Consumer::start(
        &db,
        &["-s", "crash", "-p", "crash.*", "--poll-interval", "200ms"],
    )
    .await;
    let line = rescuer.next().await;
    assert_eq!(line["id"], "e1");
    assert_eq!(line["attempt"], 2);
    wait_settled(&client, "the delivery to complete").await;
    let history = client
        .query("SELECT attempt, error FROM pgbus.delivery_failures", &[])
        .await
        .unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].get::<_, i32>(0), 1);
    let error: &str = history[0].get(1);
    assert!(error.starts_with("lease expired"), "{error}");
    assert_eq!(rescuer.terminate().await, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_poison_event_that_kills_its_worker_every_time_is_dead_after_max_attempts() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("poison");
    let first = Consumer::start_in(&db, &consume_args("2"), Some(&dir)).await;
    run(
        pgbus_on(&db),
        &["publish", "crash.poison", "{}", "--id", "poison"],
    )
    .await
    .ok();
    kill_mid_handler(first, &client, &dir, 1).await;
    let second = Consumer::start_in(&db, &consume_args("2"), Some(&dir)).await;
    kill_mid_handler(second, &client, &dir, 2).await;

    // A third worker reaps the second lease: out of attempts, so dead, never run again.
    let third = Consumer::start_in(&db, &consume_args("2"), Some(&dir)).await;
    wait_count(
        &client,
        "the poison event to be dead",
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead' AND attempts = 2",
        1,
    )
    .await;
    assert_eq!(third.terminate().await, 0);
    assert_eq!(handler_pids(&dir).len(), 2, "the handler ran a third time");
    let out = run(pgbus_on(&db), &["dead", "list", "--json"]).await.ok();
    let dead = out.json();
    assert_eq!(dead[0]["event_id"], "poison");
    assert_eq!(dead[0]["attempts"], 2);
    assert!(
        dead[0]["last_error"]
            .as_str()
            .unwrap()
            .starts_with("lease expired"),
        "{dead}"
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.delivery_failures WHERE error LIKE 'lease expired%'"
        )
        .await,
        2
    );
    let _ = std::fs::remove_dir_all(&dir);
}
