//! Payload numbers come back exactly as jsonb holds them through `pgbus publish` and
//! `pgbus consume` (its JSON lines and a command's standard input): the delivered JSON
//! equals `payload::text` read from PostgreSQL, number for number. The library's paths
//! are in `tests/exact_numbers.rs`.

mod common;
mod proc;
#[path = "../../tests/shared/exact_numbers.rs"]
mod shared;

use proc::{Consumer, pgbus_on, run, scratch, wait_settled};
use serde_json::Value;
use shared::{PAYLOADS, assert_exact, stored_payload};

#[tokio::test]
async fn cli_publish_to_consume_lines_and_exec_stdin_keep_every_digit() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("exact");
    let mut printer = Consumer::start(&db, &["-s", "printer", "-p", "n.*"]).await;
    let exec = Consumer::start_in(
        &db,
        &[
            "-s",
            "exec",
            "-p",
            "n.*",
            "--exec",
            "cat > \"$PGBUS_EVENT_ID.json\"",
        ],
        Some(&dir),
    )
    .await;
    for (i, text) in PAYLOADS.iter().enumerate() {
        run(
            pgbus_on(&db),
            &["publish", "n.cli", text, "--id", &format!("cli-{i}")],
        )
        .await
        .ok();
    }
    for _ in PAYLOADS {
        let line = printer.next().await;
        let id = line["id"].as_str().unwrap().to_string();
        let i: usize = id["cli-".len()..].parse().unwrap();
        let (stored, equal) = stored_payload(&client, &id, PAYLOADS[i]).await;
        assert!(equal, "{id}: the stored payload is not {}", PAYLOADS[i]);
        assert_exact(&format!("consume line, {id}"), &line["payload"], &stored);
    }
    wait_settled(&client, "both consumers").await;
    for (i, text) in PAYLOADS.iter().enumerate() {
        let id = format!("cli-{i}");
        let input = std::fs::read_to_string(dir.join(format!("{id}.json"))).unwrap();
        let input: Value = serde_json::from_str(&input).unwrap();
        let (stored, _) = stored_payload(&client, &id, text).await;
        assert_exact(&format!("--exec stdin, {id}"), &input["payload"], &stored);
    }
    assert_eq!(printer.terminate().await, 0);
    assert_eq!(exec.terminate().await, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
