//! The `pgbus` command line, run as a process against a real PostgreSQL: every command's
//! happy path and its errors.

mod common;
mod proc;

use std::collections::HashSet;
use std::process::Stdio;

use proc::{
    Consumer, WAIT, count, pgbus, pgbus_on, run, run_with, scratch, signal, wait_count,
    wait_settled,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

async fn register(client: &tokio_postgres::Client, name: &str, patterns: &[&str]) {
    pgbus::admin::register_subscription(client, name, patterns, 25)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_missing_or_malformed_database_url_is_one_line_naming_it_with_exit_2() {
    let commands: &[&[&str]] = &[
        &["migrate"],
        &["status"],
        &["publish", "order.placed", "{}"],
        &["consume", "-s", "a", "-p", "*"],
        &["dead", "list"],
        &["dead", "retry", "--all"],
        &["replay", "-s", "a", "--since", "1h"],
        &["subscriptions", "list"],
        &["sweep"],
        &["ui"],
    ];
    let urls = [
        None,
        Some(""),
        Some("not a url"),
        Some("postgres://"),
        Some("postgres://app@localhost:notaport/app"),
    ];
    for args in commands {
        for url in urls {
            let mut cmd = pgbus();
            if let Some(url) = url {
                cmd.env("DATABASE_URL", url);
            }
            let out = run(cmd, args).await;
            assert_eq!(out.code, 2, "{args:?} {url:?}: {out:?}");
            assert_eq!(
                out.stderr.trim().lines().count(),
                1,
                "{args:?} {url:?}: {out:?}"
            );
            assert!(
                out.stderr.contains("DATABASE_URL"),
                "{args:?} {url:?}: {out:?}"
            );
        }
    }
}

#[tokio::test]
async fn unknown_arguments_are_refused_with_exit_2_and_every_command_has_examples() {
    for args in [
        &["--bogus"][..],
        &["bogus"],
        &["status", "--bogus"],
        &["publish"],
        &["consume", "-s", "a"],
        &["dead", "retry"],
        &["dead", "retry", "--all", "--event", "x"],
        &["replay", "-s", "a", "--since", "yesterday"],
        &["consume", "-s", "a", "-p", "*", "--lease", "30"],
    ] {
        let out = run(pgbus(), args).await;
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.starts_with("error:"), "{args:?}: {out:?}");
    }
    for args in [
        &["migrate"][..],
        &["publish"],
        &["consume"],
        &["status"],
        &["dead", "list"],
        &["dead", "retry"],
        &["dead", "purge"],
        &["replay"],
        &["subscriptions", "list"],
        &["subscriptions", "drop"],
        &["keys", "list"],
        &["keys", "redrive"],
        &["keys", "skip"],
        &["sweep"],
        &["metrics"],
        &["ui"],
        &["demo"],
    ] {
        let mut args = args.to_vec();
        args.push("--help");
        let out = run(pgbus(), &args).await.ok();
        assert!(out.stdout.contains("Example"), "{args:?}: {}", out.stdout);
    }
}

#[tokio::test]
async fn a_closed_port_and_a_missing_schema_give_clear_errors() {
    let mut cmd = pgbus();
    cmd.env("DATABASE_URL", "postgres://pgbus@127.0.0.1:1/nothing");
    let out = run(cmd, &["status"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("could not connect") && out.stderr.contains("refused"),
        "{out:?}"
    );

    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    for args in [
        &["status"][..],
        &["dead", "list"],
        &["publish", "a.b", "{}"],
    ] {
        let out = run(pgbus_on(&db), args).await;
        assert_eq!(out.code, 1, "{args:?}: {out:?}");
        assert!(
            out.stderr.contains("run `pgbus migrate`"),
            "{args:?}: {out:?}"
        );
    }
    let out = run(pgbus_on(&db), &["migrate"]).await.ok();
    assert!(out.stdout.starts_with("applied 0001_init"), "{out:?}");
    let out = run(pgbus_on(&db), &["migrate"]).await.ok();
    assert!(out.stdout.starts_with("schema is current"), "{out:?}");
    run(pgbus_on(&db), &["status"]).await.ok();
}

#[tokio::test]
async fn the_test_kits_url_works_as_database_url() {
    let db = common::test_db().await;
    // `postgres:///<db>?host=<socket directory>&port=...&user=...` on the throwaway
    // cluster: the form sqlx reads, which the command line reads too.
    let url = db.url();
    let on_url = || {
        let mut cmd = pgbus();
        cmd.env("DATABASE_URL", &url);
        cmd
    };
    let out = run(on_url(), &["migrate"]).await.ok();
    assert!(out.stdout.starts_with("schema is current"), "{out:?}");
    run(on_url(), &["publish", "kit.url", "{}"]).await.ok();
    assert_eq!(
        count(&db.connect().await, "SELECT count(*) FROM pgbus.events").await,
        1
    );
}

#[tokio::test]
async fn published_events_are_printed_by_consume_as_json_lines_and_acked() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut consumer = Consumer::start(&db, &["-s", "audit", "-p", "order.*"]).await;

    let out = run(
        pgbus_on(&db),
        &[
            "publish",
            "order.placed",
            r#"{"order_id": 42}"#,
            "--id",
            "order-42",
            "--aggregate",
            "order:42",
            "--correlation-id",
            "req-1",
            "--header",
            "tenant=acme",
            "--json",
        ],
    )
    .await
    .ok();
    assert_eq!(out.json(), json!({"id": "order-42", "inserted": true}));
    let line = consumer.next().await;
    assert_eq!(line["subscription"], "audit");
    assert_eq!(line["id"], "order-42");
    assert_eq!(line["name"], "order.placed");
    assert_eq!(line["attempt"], 1);
    assert_eq!(line["payload"], json!({"order_id": 42}));
    assert_eq!(line["headers"], json!({"tenant": "acme"}));
    assert_eq!(line["aggregate"], json!({"type": "order", "id": "42"}));
    assert_eq!(line["correlation_id"], "req-1");
    assert!(line["occurred_at"].is_string(), "{line}");

    // The same id and content again: nothing new. Different content: refused.
    let out = run(
        pgbus_on(&db),
        &[
            "publish",
            "order.placed",
            r#"{"order_id": 42}"#,
            "--id",
            "order-42",
            "--aggregate",
            "order:42",
            "--header",
            "tenant=acme",
        ],
    )
    .await
    .ok();
    assert_eq!(out.stdout.trim(), "order-42");
    let out = run(
        pgbus_on(&db),
        &[
            "publish",
            "order.placed",
            r#"{"order_id": 43}"#,
            "--id",
            "order-42",
        ],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("different content"), "{out:?}");

    // Many events from standard input, one per line, in one transaction.
    let out = run_with(
        pgbus_on(&db),
        &["publish", "order.imported", "-", "--lines"],
        Some("{\"n\": 1}\n\n{\"n\": 2}\n{\"n\": 3}\n"),
    )
    .await
    .ok();
    let ids: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(ids.len(), 3, "{out:?}");
    // And one document from standard input, with no payload argument meaning {}.
    run_with(
        pgbus_on(&db),
        &["publish", "order.noted", "-"],
        Some("{\"note\": \"hi\"}"),
    )
    .await
    .ok();
    run(pgbus_on(&db), &["publish", "order.empty"]).await.ok();
    let mut seen = Vec::new();
    for _ in 0..5 {
        let line = consumer.next().await;
        seen.push((
            line["name"].as_str().unwrap().to_string(),
            line["payload"].clone(),
        ));
    }
    seen.sort_by_key(|(name, p)| (name.clone(), p.to_string()));
    assert_eq!(
        seen,
        vec![
            ("order.empty".to_string(), json!({})),
            ("order.imported".to_string(), json!({"n": 1})),
            ("order.imported".to_string(), json!({"n": 2})),
            ("order.imported".to_string(), json!({"n": 3})),
            ("order.noted".to_string(), json!({"note": "hi"})),
        ]
    );
    wait_settled(&client, "every delivery to be acked").await;
    assert_eq!(consumer.terminate().await, 0);
}

#[tokio::test]
async fn invalid_payloads_are_refused_with_a_typed_error_and_nothing_is_written() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let cases: &[(&[&str], Option<&str>, &str)] = &[
        (&["publish", "a.b", "{not json"], None, "invalid payload"),
        (&["publish", "a.b", r#"{"a": "x\u0000y"}"#], None, "\\u0000"),
        (&["publish", "a.b", "-"], Some(""), "invalid payload"),
        (
            &["publish", "a.b", "-", "--lines"],
            Some("{\"ok\": 1}\n{broken\n"),
            "line 2",
        ),
        (
            &["publish", "a.b", "-", "--lines"],
            Some("{\"ok\": 1}\n{\"nul\": \"\\u0000\"}\n"),
            "\\u0000",
        ),
        (&["publish", "a b", "{}"], None, "event name"),
        (
            &["publish", "a.b", "{}", "--aggregate", "nocolon"],
            None,
            "TYPE:ID",
        ),
        (&["publish", "a.b", "{}", "--lines"], None, "--lines"),
    ];
    // --lines publishes in chunks of 1,000 in one transaction: a bad line after a few
    // chunks were sent rolls them back.
    let many = format!("{}{{broken\n", "{\"ok\": 1}\n".repeat(2_500));
    let many_cases: &[(&[&str], Option<&str>, &str)] = &[
        (
            &["publish", "a.b", "-", "--lines"],
            Some(&many),
            "line 2501",
        ),
        (
            &["publish", "a.b", "{}", "--delay", "1000000000d"],
            None,
            "longest delay",
        ),
    ];
    for (args, input, expected) in cases.iter().chain(many_cases) {
        let out = run_with(pgbus_on(&db), args, *input).await;
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.contains(expected), "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 0);
}

#[tokio::test]
async fn events_inserted_by_raw_sql_are_delivered_to_consume() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut consumer = Consumer::start(&db, &["-s", "raw", "-p", "raw.*"]).await;
    client
        .batch_execute(
            "INSERT INTO pgbus.events (event_name, payload) VALUES ('raw.inserted', '{\"n\": 1}'); \
             SELECT pgbus.publish('raw.function', '{\"n\": 2}', aggregate_type => 'thing', \
                                  aggregate_id => '7');",
        )
        .await
        .unwrap();
    let mut names = HashSet::new();
    for _ in 0..2 {
        let line = consumer.next().await;
        if line["name"] == "raw.function" {
            assert_eq!(line["aggregate"], json!({"type": "thing", "id": "7"}));
        }
        names.insert(line["name"].as_str().unwrap().to_string());
    }
    assert_eq!(
        names,
        HashSet::from(["raw.inserted".to_string(), "raw.function".to_string()])
    );
    assert_eq!(consumer.terminate().await, 0);
}

#[tokio::test]
async fn a_failing_command_is_retried_then_dead_listed_and_brought_back_by_dead_retry() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let failing = Consumer::start(
        &db,
        &[
            "-s",
            "flaky",
            "-p",
            "job.*",
            "--exec",
            "cat > /dev/null; echo \"boom on attempt $PGBUS_ATTEMPT\" >&2; exit 1",
            "--max-attempts",
            "2",
            "--retry-base",
            "50ms",
        ],
    )
    .await;
    run(
        pgbus_on(&db),
        &["publish", "job.run", "{}", "--id", "job-1"],
    )
    .await
    .ok();
    wait_count(
        &client,
        "the delivery to be dead",
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
        1,
    )
    .await;
    assert_eq!(failing.terminate().await, 0);

    let out = run(pgbus_on(&db), &["dead", "list", "--json"]).await.ok();
    let dead = out.json();
    let dead = dead.as_array().unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["subscription"], "flaky");
    assert_eq!(dead[0]["event_id"], "job-1");
    assert_eq!(dead[0]["event_name"], "job.run");
    assert_eq!(dead[0]["attempts"], 2);
    let error = dead[0]["last_error"].as_str().unwrap();
    assert!(error.contains("boom on attempt 2"), "{error}");
    assert!(dead[0]["failed_at"].is_string());
    let out = run(pgbus_on(&db), &["dead", "list"]).await.ok();
    assert!(
        out.stdout.contains("job-1") && out.stdout.contains("boom"),
        "{out:?}"
    );

    let out = run(pgbus_on(&db), &["dead", "list", "--subscription", "nope"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("unknown subscription \"nope\""),
        "{out:?}"
    );
    let out = run(pgbus_on(&db), &["dead", "retry", "--event", "job-404"]).await;
    assert_eq!(out.code, 1, "{out:?}");

    let out = run(
        pgbus_on(&db),
        &["dead", "retry", "--event", "job-1", "--json"],
    )
    .await
    .ok();
    assert_eq!(out.json(), json!({"retried": 1}));
    let row = client
        .query_one(
            "SELECT status, attempts, locked_by IS NULL FROM pgbus.deliveries",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, &str>(0), "pending");
    assert_eq!(row.get::<_, i32>(1), 0);
    assert!(row.get::<_, bool>(2));
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        2,
        "the history is kept"
    );

    let healed = Consumer::start(
        &db,
        &["-s", "flaky", "-p", "job.*", "--exec", "cat > /dev/null"],
    )
    .await;
    wait_settled(&client, "the retried delivery to complete").await;
    assert_eq!(healed.terminate().await, 0);
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        2
    );
}

#[tokio::test]
async fn dead_purge_asks_for_yes_and_deletes_dead_letters_with_their_history() {
    let db = common::test_db().await;
    let client = db.connect().await;
    register(&client, "s", &["p.*"]).await;
    proc::two_dead_letters(&client).await;
    let out = run(pgbus_on(&db), &["dead", "purge", "--all"]).await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("--yes"), "{out:?}");
    let out = run(
        pgbus_on(&db),
        &["dead", "purge", "--event", "e1", "--yes", "--json"],
    )
    .await
    .ok();
    assert_eq!(out.json(), json!({"purged": 1, "failures": 1}));
    let out = run(
        pgbus_on(&db),
        &["dead", "purge", "--all", "-s", "s", "--yes"],
    )
    .await
    .ok();
    assert_eq!(
        out.stdout.trim(),
        "purged 1 dead letter and 1 failure record"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        0
    );
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 2);
}

#[tokio::test]
async fn sigterm_during_consume_with_deliveries_in_flight_loses_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("sigterm");
    let consumer = Consumer::start_in(
        &db,
        &[
            "-s",
            "slow",
            "-p",
            "slow.*",
            "--concurrency",
            "4",
            "--exec",
            "cat > /dev/null; sleep 1; echo \"$PGBUS_EVENT_ID\" >> done.txt",
        ],
        Some(&dir),
    )
    .await;
    let input: String = (0..12).map(|i| format!("{{\"i\": {i}}}\n")).collect();
    let out = run_with(
        pgbus_on(&db),
        &["publish", "slow.job", "-", "--lines"],
        Some(&input),
    )
    .await
    .ok();
    let all: HashSet<String> = out.stdout.lines().map(str::to_string).collect();
    common::wait_for("deliveries in flight", WAIT, || async {
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'processing'",
        )
        .await
            > 0
    })
    .await;
    assert_eq!(consumer.terminate().await, 0);

    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'pending'"
        )
        .await,
        0,
        "nothing left processing (or dead)"
    );
    let pending: HashSet<String> = client
        .query(
            "SELECT e.id FROM pgbus.deliveries d JOIN pgbus.events e ON e.seq = d.event_seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let read_done = || -> HashSet<String> {
        std::fs::read_to_string(dir.join("done.txt"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let done = read_done();
    assert!(!done.is_empty(), "the deliveries in flight were finished");
    for id in &all {
        assert!(
            pending.contains(id) || done.contains(id),
            "{id} was acked without being handled"
        );
    }

    // Whatever was not finished is delivered by the next consumer.
    let next = Consumer::start_in(
        &db,
        &[
            "-s",
            "slow",
            "-p",
            "slow.*",
            "--exec",
            "cat > /dev/null; echo \"$PGBUS_EVENT_ID\" >> done.txt",
        ],
        Some(&dir),
    )
    .await;
    wait_settled(&client, "the rest to be delivered").await;
    assert_eq!(next.terminate().await, 0);
    assert_eq!(read_done(), all);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn two_consumers_sharing_a_subscription_print_each_event_once() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let args = ["-s", "shared", "-p", "share.*", "--concurrency", "4"];
    let mut a = Consumer::start(&db, &args).await;
    let mut b = Consumer::start(&db, &args).await;
    let input: String = (0..200).map(|i| format!("{{\"i\": {i}}}\n")).collect();
    let out = run_with(
        pgbus_on(&db),
        &["publish", "share.it", "-", "--lines"],
        Some(&input),
    )
    .await
    .ok();
    let all: HashSet<String> = out.stdout.lines().map(str::to_string).collect();
    assert_eq!(all.len(), 200);
    let mut seen: Vec<String> = Vec::new();
    let (mut from_a, mut from_b) = (0, 0);
    while seen.len() < all.len() {
        tokio::select! {
            line = a.next() => { seen.push(line["id"].as_str().unwrap().into()); from_a += 1; }
            line = b.next() => { seen.push(line["id"].as_str().unwrap().into()); from_b += 1; }
        }
    }
    let unique: HashSet<String> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "an event was printed twice");
    assert_eq!(unique, all);
    eprintln!("consumer a printed {from_a}, b printed {from_b}");
    wait_settled(&client, "every delivery to be acked").await;
    assert_eq!(a.terminate().await, 0);
    assert_eq!(b.terminate().await, 0);
}

#[tokio::test]
async fn status_counts_each_subscription_and_watch_refreshes() {
    let db = common::test_db().await;
    let client = db.connect().await;
    register(&client, "s1", &["st.*"]).await;
    register(&client, "s2", &["other.*"]).await;
    // The deliveries a running bus would have made: one claimed, one dead, one done.
    proc::with_deliveries(
        &client,
        "SELECT pgbus.publish('st.a', id => 'a'); SELECT pgbus.publish('st.b', id => 'b'); \
         SELECT pgbus.publish('st.c', id => 'c'); SELECT pgbus.publish('st.d', id => 'd');",
        "UPDATE pgbus.deliveries SET status = 'processing', attempts = 1, locked_by = 'w', \
                locked_until = now() + interval '1 minute' \
          WHERE event_seq = (SELECT seq FROM pgbus.events WHERE id = 'b'); \
         UPDATE pgbus.deliveries SET status = 'dead', attempts = 25 \
          WHERE event_seq = (SELECT seq FROM pgbus.events WHERE id = 'c'); \
         DELETE FROM pgbus.deliveries \
          WHERE event_seq = (SELECT seq FROM pgbus.events WHERE id = 'd');",
    )
    .await;
    // Committed, not yet turned into deliveries (no bus runs): not done.
    client
        .batch_execute("SELECT pgbus.publish('st.e', id => 'e')")
        .await
        .unwrap();
    let out = run(pgbus_on(&db), &["status", "--json"]).await.ok();
    let status = out.json();
    let s1 = &status["subscriptions"][0];
    assert_eq!(s1["name"], "s1");
    assert_eq!(s1["pending"], 1);
    assert_eq!(s1["due"], 1);
    assert_eq!(s1["processing"], 1);
    assert_eq!(s1["dead"], 1);
    assert_eq!(s1["done_last_minute"], 1);
    assert_eq!(s1["done_last_minute_estimated"], false);
    assert!(s1["lag_seconds"].as_f64().unwrap() >= 0.0);
    let s2 = &status["subscriptions"][1];
    assert_eq!(s2["name"], "s2");
    assert_eq!(s2["pending"], 0);
    assert!(s2["lag_seconds"].is_null());
    assert!(status["notification_queue_usage"].as_f64().unwrap() < 0.5);
    assert_eq!(status["listeners"], 0);
    assert_eq!(status["oldest_transaction_long"], false);
    assert!(status.get("oldest_transaction_age_seconds").is_some());

    let out = run(pgbus_on(&db), &["status"]).await.ok();
    let text = out.stdout;
    assert!(text.starts_with("SUBSCRIPTION"), "{text}");
    assert!(text.contains("notification queue"), "{text}");
    assert!(text.contains("xmin horizon"), "{text}");
    let out = run(pgbus_on(&db), &["status", "-s", "s2", "--json"])
        .await
        .ok();
    assert_eq!(out.json()["subscriptions"].as_array().unwrap().len(), 1);
    let out = run(pgbus_on(&db), &["status", "-s", "nope"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("unknown subscription"), "{out:?}");

    // A running consumer is a listener and a consumer; --watch prints again and again.
    let consumer = Consumer::start(&db, &["-s", "s2", "-p", "other.*"]).await;
    let mut cmd = pgbus_on(&db);
    cmd.args(["status", "--watch", "--interval", "100ms", "--json"])
        .stdout(Stdio::piped());
    let mut watch = cmd.spawn().unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut listening = false;
    for _ in 0..200 {
        let line = common::within("a status line", WAIT, lines.next_line())
            .await
            .unwrap()
            .expect("status --watch ended");
        let v: Value = serde_json::from_str(&line).unwrap();
        if v["listeners"] == 1 && v["subscriptions"][1]["consumers"] == 1 {
            listening = true;
            break;
        }
    }
    assert!(listening, "status never saw the consumer");
    signal(watch.id().unwrap(), "INT").await;
    let code = common::within("status --watch to stop", WAIT, watch.wait())
        .await
        .unwrap();
    assert!(code.success());
    assert_eq!(consumer.terminate().await, 0);
}

#[tokio::test]
async fn replay_creates_deliveries_for_past_events_once() {
    let db = common::test_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "SELECT pgbus.publish('rp.a', id => 'a'); SELECT pgbus.publish('rp.b', id => 'b'); \
             SELECT pgbus.publish('other.x', id => 'x');",
        )
        .await
        .unwrap();
    register(&client, "late", &["rp.*"]).await;
    // The batch that takes the events gives none to a subscription created after them.
    assert_eq!(
        common::count_after_fan_out(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        0
    );

    let out = run(
        pgbus_on(&db),
        &[
            "replay",
            "-s",
            "late",
            "--since",
            "1h",
            "--pattern",
            "rp.a",
            "--json",
        ],
    )
    .await
    .ok();
    assert_eq!(
        out.json(),
        json!({"subscription": "late", "matched": 1, "created": 1})
    );
    let out = run(pgbus_on(&db), &["replay", "-s", "late", "--since", "1h"])
        .await
        .ok();
    assert_eq!(
        out.stdout.trim(),
        "replayed 1 event to \"late\" (2 matched, 1 skipped: already delivering)"
    );
    let out = run(
        pgbus_on(&db),
        &[
            "replay", "-s", "late", "--since", "2h", "--until", "1h", "--json",
        ],
    )
    .await
    .ok();
    assert_eq!(out.json()["matched"], 0);
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'late' AND status = 'pending'"
        )
        .await,
        2
    );

    let mut consumer = Consumer::start(&db, &["-s", "late", "-p", "rp.*"]).await;
    let mut ids = HashSet::new();
    for _ in 0..2 {
        ids.insert(consumer.next().await["id"].as_str().unwrap().to_string());
    }
    assert_eq!(ids, HashSet::from(["a".to_string(), "b".to_string()]));
    assert_eq!(consumer.terminate().await, 0);

    let out = run(pgbus_on(&db), &["replay", "-s", "nope", "--since", "1h"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("unknown subscription"), "{out:?}");
    let out = run(
        pgbus_on(&db),
        &[
            "replay",
            "-s",
            "late",
            "--since",
            "1h",
            "--pattern",
            "bad pattern",
        ],
    )
    .await;
    assert_eq!(out.code, 2, "{out:?}");
}

#[tokio::test]
async fn subscriptions_are_listed_and_dropped_only_when_idle_unless_forced() {
    let db = common::test_db().await;
    let client = db.connect().await;
    register(&client, "keep", &["k.*"]).await;
    register(&client, "gone", &["g.*", "k.*"]).await;
    proc::with_deliveries(
        &client,
        "SELECT pgbus.publish('g.one'); SELECT pgbus.publish('k.one');",
        "UPDATE pgbus.deliveries SET status = 'processing', attempts = 1, locked_by = 'w', \
                locked_until = now() + interval '1 minute' \
          WHERE subscription = 'gone' AND event_seq = (SELECT min(event_seq) FROM pgbus.deliveries); \
         INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error) \
         SELECT 'gone', max(event_seq), 1, 'x' FROM pgbus.deliveries;",
    )
    .await;
    let out = run(pgbus_on(&db), &["subscriptions", "list", "--json"])
        .await
        .ok();
    let list = out.json();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gone", "keep"]);
    assert_eq!(list[0]["patterns"], json!(["g.*", "k.*"]));
    let out = run(pgbus_on(&db), &["subscriptions", "list"]).await.ok();
    assert!(out.stdout.starts_with("NAME"), "{out:?}");

    let out = run(pgbus_on(&db), &["subscriptions", "drop", "gone"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("1 deliveries processing"), "{out:?}");
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        3
    );

    let out = run(
        pgbus_on(&db),
        &["subscriptions", "drop", "gone", "--force", "--json"],
    )
    .await
    .ok();
    assert_eq!(
        out.json(),
        json!({"dropped": "gone", "deliveries": 2, "failures": 1})
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'keep'"
        )
        .await,
        1
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await,
        1
    );
    let out = run(pgbus_on(&db), &["subscriptions", "drop", "gone"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("unknown subscription"), "{out:?}");
    let out = run(pgbus_on(&db), &["subscriptions", "drop", "keep"])
        .await
        .ok();
    assert_eq!(
        out.stdout.trim(),
        "dropped subscription \"keep\" (1 delivery, 0 failure records)"
    );
}

#[tokio::test]
async fn sweep_deletes_old_events_that_no_delivery_needs() {
    let db = common::test_db().await;
    let client = db.connect().await;
    register(&client, "sw", &["sw.*"]).await;
    // With the deliveries the bus's next claim would make (the sweep keeps events before).
    proc::with_deliveries(
        &client,
        "INSERT INTO pgbus.events (id, event_name, created_at) VALUES \
           ('old-pending', 'sw.pending', now() - interval '10 days'), \
           ('old-done', 'sw.done', now() - interval '10 days'), \
           ('old-unmatched', 'zz.none', now() - interval '9 days'), \
           ('new-unmatched', 'zz.new', now());",
        "INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error) \
         SELECT 'sw', seq, 1, 'x' FROM pgbus.events WHERE id IN ('old-done', 'old-pending'); \
         DELETE FROM pgbus.deliveries \
          WHERE event_seq = (SELECT seq FROM pgbus.events WHERE id = 'old-done');",
    )
    .await;
    let out = run(pgbus_on(&db), &["sweep", "--retention", "7d", "--json"])
        .await
        .ok();
    assert_eq!(
        out.json(),
        json!({"events": 2, "failures": 1, "batches": 1, "busy": false})
    );
    let left: HashSet<String> = client
        .query("SELECT id FROM pgbus.events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        left,
        HashSet::from(["old-pending".to_string(), "new-unmatched".to_string()])
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        1
    );
    let out = run(pgbus_on(&db), &["sweep", "--batch", "1"]).await.ok();
    assert_eq!(
        out.stdout.trim(),
        "swept 0 events and 0 failure records in 1 batch"
    );
    let out = run(pgbus_on(&db), &["sweep", "--retention", "0s"]).await;
    assert_eq!(out.code, 2, "{out:?}");
}

#[tokio::test]
async fn demo_runs_on_a_throwaway_cluster_and_removes_it() {
    let out = run(pgbus(), &["demo", "--seconds", "2", "--rate", "100"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.stdout.contains("published"), "{out:?}");
    assert!(out.stdout.contains("p50"), "{out:?}");
    let dir = out
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("pgbus demo: cluster in "))
        .unwrap_or_else(|| panic!("no cluster directory: {out:?}"));
    assert!(
        !std::path::Path::new(dir.trim()).exists(),
        "{dir} is still there"
    );
}

#[tokio::test]
async fn demo_ignores_an_exported_database_url_and_runs_on_its_own_cluster() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // As in every sqlx project's shell: DATABASE_URL exported, naming a real database.
    let out = run(pgbus_on(&db), &["demo", "--seconds", "1", "--rate", "50"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(
        out.stderr
            .contains("starting a throwaway PostgreSQL cluster"),
        "{out:?}"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.events").await,
        0,
        "the demo published into DATABASE_URL's database"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        0,
        "the demo subscribed in DATABASE_URL's database"
    );
}

#[tokio::test]
async fn keys_lists_a_blocked_key_and_skip_lets_it_go_on() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // An ordered consumer whose command fails for one event only: that head dies and
    // blocks its key, while the other key flows.
    let events = [
        ("order:1", 0),
        ("order:1", 1),
        ("order:1", 2),
        ("order:2", 0),
    ];
    let lines: Vec<String> = events
        .iter()
        .map(|(key, n)| json!({"key": key, "n": n}).to_string())
        .collect();
    let consumer = Consumer::start(
        &db,
        &[
            "-s",
            "o",
            "-p",
            "*",
            "--ordered",
            "--max-attempts",
            "1",
            "--exec",
            "grep -q '\"n\":1' && exit 1; cat",
        ],
    )
    .await;
    for ((key, _), line) in events.iter().zip(&lines) {
        pgbus::publish(
            &client,
            &pgbus::Event::new("o.x", serde_json::from_str(line).unwrap()).ordering_key(*key),
        )
        .await
        .unwrap();
    }
    wait_count(
        &client,
        "the dead head",
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
        1,
    )
    .await;
    wait_count(
        &client,
        "the other key",
        "SELECT count(*) FROM pgbus.deliveries WHERE ordering_key = 'order:2'",
        0,
    )
    .await;
    let out = run(pgbus_on(&db), &["keys", "list", "--json"]).await.ok();
    let listed = out.json();
    assert_eq!(listed[0]["key"], "order:1", "{listed}");
    assert_eq!(listed[0]["waiting"], 1, "{listed}");
    let out = run(pgbus_on(&db), &["status", "--json"]).await.ok();
    assert_eq!(out.json()["subscriptions"][0]["blocked_keys"], 1);
    // Bound to a head that is not the key's: nothing is skipped, and the error names it.
    let head = listed[0]["event_id"].as_str().unwrap().to_owned();
    let out = run(
        pgbus_on(&db),
        &["keys", "skip", "o", "order:1", "--head", "not-the-head"],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains(&format!(
            "its head is now {head} (dead), not not-the-head; nothing was done"
        )),
        "{out:?}"
    );
    let out = run(pgbus_on(&db), &["keys", "skip", "o", "order:1"])
        .await
        .ok();
    assert!(out.stdout.contains("skipped"), "{out:?}");
    wait_count(
        &client,
        "the rest of the key",
        "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'dead'",
        0,
    )
    .await;
    let out = run(pgbus_on(&db), &["keys", "skip", "o", "order:1"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    // The head listed earlier was skipped: a redrive bound to it changes nothing.
    let out = run(
        pgbus_on(&db),
        &["keys", "redrive", "o", "order:1", "--head", &head],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("it has no head now; nothing was done"),
        "{out:?}"
    );
    assert_eq!(consumer.terminate().await, 0);
}

/// `dead list` is a page at a time: it says how many more there are and how to list
/// them, and the cursor walks every dead letter once. What a terminal would interpret
/// (an escape sequence, a bidirectional override in a stored error) is printed escaped.
#[tokio::test]
async fn dead_list_pages_and_escapes_what_a_terminal_would_interpret() {
    let db = common::test_db().await;
    let client = db.connect().await;
    register(&client, "m", &["*"]).await;
    for n in 0..5 {
        pgbus::publish(
            &client,
            &pgbus::Event::new("a.b", json!({})).id(format!("e{n}")),
        )
        .await
        .unwrap();
    }
    common::fan_out(&client).await;
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'dead', attempts = 1,
                    last_error = 'boom' || chr(27) || '[2J' || chr(8238) || 'txt'",
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut args: Vec<String> = vec!["dead".into(), "list".into(), "--limit".into(), "2".into()];
    for expected_more in [Some(3), Some(1), None] {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(pgbus_on(&db), &argv).await.ok();
        assert!(!out.stdout.contains('\u{1b}'), "{out:?}");
        assert!(!out.stdout.contains('\u{202e}'), "{out:?}");
        assert!(out.stdout.contains("boom\\u{1b}[2J\\u{202e}txt"), "{out:?}");
        seen.extend(
            out.stdout
                .lines()
                .filter_map(|l| l.split_whitespace().nth(1))
                .filter(|id| id.starts_with('e'))
                .map(str::to_string),
        );
        let more = out.stdout.lines().find(|l| l.contains(" more: "));
        match expected_more {
            Some(n) => {
                let line = more.unwrap_or_else(|| panic!("no 'more' line: {out:?}"));
                assert!(line.starts_with(&format!("{n} more: ")), "{line}");
                let cursor = line
                    .split("--after ")
                    .nth(1)
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap();
                args = vec![
                    "dead".into(),
                    "list".into(),
                    "--limit".into(),
                    "2".into(),
                    "--after".into(),
                    cursor.to_string(),
                ];
            }
            None => assert!(more.is_none(), "{out:?}"),
        }
    }
    assert_eq!(seen, ["e0", "e1", "e2", "e3", "e4"]);
    let bad = run(pgbus_on(&db), &["dead", "list", "--after", "nope"]).await;
    assert_eq!(bad.code, 2, "{bad:?}");
}

/// `subscriptions pause` and `resume` against running consumers of an ordered and an
/// unordered subscription: while paused, their deliveries are made and wait (not one
/// attempt), `status` and `subscriptions list` say so; resumed, each consumer prints what
/// waited, the ordered one each key in order.
#[tokio::test]
async fn subscriptions_pause_and_resume_running_ordered_and_unordered_consumers() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut plain = Consumer::start(&db, &["-s", "plain", "-p", "p.*"]).await;
    let mut ordered = Consumer::start(&db, &["-s", "ordered", "-p", "p.*", "--ordered"]).await;
    for name in ["plain", "ordered"] {
        let out = run(pgbus_on(&db), &["subscriptions", "pause", name])
            .await
            .ok();
        assert!(out.stdout.starts_with("paused subscription"), "{out:?}");
        let again = run(pgbus_on(&db), &["subscriptions", "pause", name, "--json"])
            .await
            .ok();
        assert_eq!(again.json()["already"], true, "{again:?}");
    }
    for n in 0..3 {
        pgbus::publish(
            &client,
            &pgbus::Event::new("p.x", json!({ "n": n })).ordering_key("k"),
        )
        .await
        .unwrap();
    }
    wait_count(
        &client,
        "the paused subscriptions' deliveries",
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'pending' AND attempts = 0",
        6,
    )
    .await;
    let status = run(pgbus_on(&db), &["status", "--json"]).await.ok().json();
    for sub in status["subscriptions"].as_array().unwrap() {
        assert!(sub["paused_since"].is_string(), "{sub}");
        assert_eq!(sub["pending"], 3, "{sub}");
    }
    let table = run(pgbus_on(&db), &["status"]).await.ok();
    assert!(table.stdout.contains("plain (paused)"), "{table:?}");
    let listed = run(pgbus_on(&db), &["subscriptions", "list", "--json"])
        .await
        .ok()
        .json();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["paused_at"].is_string()),
        "{listed}"
    );

    for name in ["plain", "ordered"] {
        let out = run(pgbus_on(&db), &["subscriptions", "resume", name])
            .await
            .ok();
        assert!(out.stdout.starts_with("resumed subscription"), "{out:?}");
    }
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(ordered.next().await["payload"]["n"].as_i64().unwrap());
    }
    assert_eq!(got, [0, 1, 2], "the ordered key out of order");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(plain.next().await["payload"]["n"].as_i64().unwrap());
    }
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2]);
    wait_settled(&client, "every delivery to be acked").await;
    let out = run(pgbus_on(&db), &["subscriptions", "resume", "plain"])
        .await
        .ok();
    assert!(out.stdout.contains("was not paused"), "{out:?}");
    let out = run(pgbus_on(&db), &["subscriptions", "pause", "nope"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("unknown subscription"), "{out:?}");
    assert_eq!(plain.terminate().await, 0);
    assert_eq!(ordered.terminate().await, 0);
}
