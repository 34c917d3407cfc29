//! `pgbus forward` into a real NATS JetStream (`nats-server -js` of the test's own, on a
//! free port): exactly once and in key order through crashes of the forwarder and a
//! restart of NATS, rolled-back publishes never forwarded, and a stream that does not fit
//! refused at start.

mod common;
mod proc;

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use pgbus::Event;
use pgbus_testkit::nats::NatsServer;
use proc::{WAIT, count, pgbus_on, run, signal};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::sync::mpsc;

/// The stream the forwarder creates by default.
const STREAM: &str = "PGBUS";

/// A running `pgbus forward`, killed when dropped.
struct Forwarder {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Forwarder {
    /// Starts `pgbus forward ARGS` against `nats` and waits until it forwards.
    async fn start(db: &common::TestDb, nats: &NatsServer, args: &[&str]) -> Forwarder {
        Forwarder::start_at(db, &nats.url(), args).await
    }

    /// Starts `pgbus forward --nats-url URL ARGS` and waits until it forwards.
    async fn start_at(db: &common::TestDb, url: &str, args: &[&str]) -> Forwarder {
        let mut cmd = pgbus_on(db);
        cmd.arg("forward").args(["--nats-url", url]);
        Forwarder::spawn(cmd, args).await
    }

    /// Starts `pgbus forward ARGS` with NATS_URL=URL and waits until it forwards.
    async fn start_with_env(db: &common::TestDb, url: &str, args: &[&str]) -> Forwarder {
        let mut cmd = pgbus_on(db);
        cmd.env("NATS_URL", url).arg("forward");
        Forwarder::spawn(cmd, args).await
    }

    async fn spawn(mut cmd: tokio::process::Command, args: &[&str]) -> Forwarder {
        cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawning pgbus forward");
        let (ready_tx, mut ready) = mpsc::unbounded_channel();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let kept = stderr.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[forward] {line}");
                if line.starts_with("pgbus: forwarding") {
                    let _ = ready_tx.send(());
                }
                kept.lock().unwrap().push(line);
            }
        });
        common::within("forward to start", WAIT, ready.recv())
            .await
            .expect("forward exited before it was ready");
        Forwarder { child, stderr }
    }

    /// Waits until a line of its standard error contains `text`.
    async fn wait_said(&self, text: &str) {
        common::wait_for(&format!("forward to say {text:?}"), WAIT, || async {
            self.stderr.lock().unwrap().iter().any(|l| l.contains(text))
        })
        .await;
    }

    /// SIGKILL: no graceful anything.
    async fn kill_hard(mut self) {
        signal(self.child.id().unwrap(), "KILL").await;
        common::within("forward to die", WAIT, self.child.wait())
            .await
            .unwrap();
    }

    /// Waits until it exits by itself, and gives the exit code.
    async fn exit_code(mut self) -> i32 {
        let status = common::within("forward to exit", WAIT, self.child.wait())
            .await
            .unwrap();
        status.code().unwrap_or(-1)
    }

    /// SIGTERM, and the exit code.
    async fn terminate(mut self) -> i32 {
        signal(self.child.id().unwrap(), "TERM").await;
        let status = common::within("forward to stop", WAIT, self.child.wait())
            .await
            .unwrap();
        status.code().unwrap_or(-1)
    }
}

async fn jetstream_of(nats: &NatsServer) -> jetstream::Context {
    let client = async_nats::connect(nats.url()).await.unwrap();
    jetstream::new(client)
}

/// How many messages `stream` holds (0 while it does not exist or NATS cannot answer).
async fn stream_messages(js: &jetstream::Context, stream: &str) -> u64 {
    match js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    }
}

/// Waits until `stream` holds at least `n` messages.
async fn wait_messages(js: &jetstream::Context, stream: &str, n: u64) {
    common::wait_for(&format!("{n} messages in {stream}"), WAIT, || async {
        stream_messages(js, stream).await >= n
    })
    .await;
}

/// Waits until the forwarder has turned every committed event into deliveries and every
/// delivery of `subscription` is acknowledged (forwarded).
async fn wait_forwarded(client: &tokio_postgres::Client, subscription: &str) {
    common::wait_count(
        client,
        &format!("every delivery of {subscription} forwarded"),
        &format!(
            "SELECT (SELECT count(*) FROM pgbus.deliveries WHERE subscription = '{subscription}') \
             + (SELECT events FROM pgbus.not_fanned_out(NULL))"
        ),
        0,
    )
    .await;
}

/// One stored message: its Nats-Msg-Id, headers and JSON body, in stream order.
struct Stored {
    id: String,
    headers: async_nats::HeaderMap,
    body: Value,
}

/// Every message of `stream`, in stream order, read by a pull consumer.
async fn read_all(js: &jetstream::Context, stream: &str) -> Vec<Stored> {
    let s = js.get_stream(stream).await.unwrap();
    let total = s.cached_info().state.messages as usize;
    let consumer: consumer::PullConsumer = s
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap().take(total);
    let mut out = Vec::with_capacity(total);
    while let Some(m) = common::within("the next message", WAIT, messages.next()).await {
        let m = m.unwrap();
        let headers = m.headers.clone().unwrap_or_default();
        out.push(Stored {
            id: headers.get("Nats-Msg-Id").unwrap().to_string(),
            body: serde_json::from_slice(&m.payload).unwrap(),
            headers,
        });
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_keyed_events_reach_the_stream_once_each_in_key_order_through_two_kills_and_a_nats_restart()
 {
    const EVENTS: i64 = 10_000;
    const KEYS: i64 = 100;
    let db = common::test_db().await;
    let mut nats = NatsServer::start().await.unwrap();
    let js = jetstream_of(&nats).await;
    let args = [
        "-s",
        "relay",
        "-p",
        "load.*",
        "--ordered",
        "--lease",
        "2s",
        "--poll-interval",
        "200ms",
        "--publish-timeout",
        "1s",
    ];
    let mut forwarder = Forwarder::start(&db, &nats, &args).await;

    // Published while the forwarder runs: 100 batches of 100, each in its own transaction;
    // event i has key i % 100 and is that key's (i / 100)th.
    let publisher = tokio::spawn({
        let client = db.connect().await;
        async move {
            for batch in 0..EVENTS / 100 {
                let events: Vec<Event> = (batch * 100..(batch + 1) * 100)
                    .map(|i| {
                        Event::new("load.item", json!({"key": i % KEYS, "n": i / KEYS}))
                            .ordering_key(format!("k{}", i % KEYS))
                    })
                    .collect();
                pgbus::publish_batch(&client, &events).await.unwrap();
            }
        }
    });

    wait_messages(&js, STREAM, 2_000).await;
    forwarder.kill_hard().await;
    forwarder = Forwarder::start(&db, &nats, &args).await;
    wait_messages(&js, STREAM, 4_500).await;
    // NATS goes away under the forwarder: its publishes in flight get no PubAck, and it
    // is killed while it retries them. Their keys must wait for them (the deliveries stay
    // leased to the dead forwarder until the lease ends) when NATS is back.
    nats.stop();
    forwarder.wait_said("did not take an event").await;
    forwarder.kill_hard().await;
    nats.start_again().await.unwrap();
    forwarder = Forwarder::start(&db, &nats, &args).await;
    common::within("the publisher", WAIT, publisher)
        .await
        .unwrap();

    let client = db.connect().await;
    wait_forwarded(&client, "relay").await;
    assert_eq!(forwarder.terminate().await, 0);

    let stored = read_all(&js, STREAM).await;
    let ids: HashSet<&str> = stored.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(stored.len(), EVENTS as usize, "each event stored once");
    assert_eq!(ids.len(), EVENTS as usize, "no Nats-Msg-Id twice");
    let published = count(&client, "SELECT count(*) FROM pgbus.events").await;
    assert_eq!(published, EVENTS);
    // Each key's messages, in stream order, are its events in publish order.
    let mut next: HashMap<i64, i64> = HashMap::new();
    for m in &stored {
        let key = m.body["key"].as_i64().unwrap();
        let n = m.body["n"].as_i64().unwrap();
        let expected = next.entry(key).or_insert(0);
        assert_eq!(n, *expected, "key {key} out of order at message {}", m.id);
        *expected += 1;
    }
    assert_eq!(next.len(), KEYS as usize);
    assert!(next.values().all(|&n| n == EVENTS / KEYS));
}

#[tokio::test]
async fn a_rolled_back_publish_never_reaches_nats_and_a_committed_one_arrives_with_its_envelope() {
    let db = common::test_db().await;
    let nats = NatsServer::start().await.unwrap();
    let js = jetstream_of(&nats).await;
    let forwarder = Forwarder::start(&db, &nats, &["-s", "out", "-p", "shop.*"]).await;

    let mut client = db.connect().await;
    let tx = client.transaction().await.unwrap();
    let lost = Event::new("shop.lost", json!({"never": true}));
    pgbus::publish(&tx, &lost).await.unwrap();
    tx.rollback().await.unwrap();
    let kept = Event::new("shop.order.placed", json!({"order": 42}))
        .aggregate("order", "42")
        .correlation_id("req-1")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .header("tenant id", "t-7");
    pgbus::publish(&client, &kept).await.unwrap();
    wait_forwarded(&client, "out").await;
    // A header name NATS cannot carry is named, not dropped silently.
    forwarder
        .wait_said("NATS headers cannot carry [\"tenant id\"]")
        .await;
    assert_eq!(forwarder.terminate().await, 0);

    let stored = read_all(&js, STREAM).await;
    assert_eq!(stored.len(), 1, "only the committed event is in the stream");
    let m = &stored[0];
    assert_eq!(m.id, kept.id);
    assert_ne!(m.id, lost.id);
    assert_eq!(m.body, json!({"order": 42}));
    let header = |name: &str| m.headers.get(name).map(|v| v.to_string());
    assert_eq!(header("Pgbus-Name").as_deref(), Some("shop.order.placed"));
    assert_eq!(header("Pgbus-Aggregate-Type").as_deref(), Some("order"));
    assert_eq!(header("Pgbus-Aggregate-Id").as_deref(), Some("42"));
    assert_eq!(header("Pgbus-Ordering-Key").as_deref(), Some("order:42"));
    assert_eq!(header("Pgbus-Correlation-Id").as_deref(), Some("req-1"));
    let all: Value = serde_json::from_str(&header("Pgbus-Headers").unwrap()).unwrap();
    assert_eq!(all["tenant id"], "t-7", "every header is in Pgbus-Headers");
    assert_eq!(
        header("traceparent").as_deref(),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert!(header("Pgbus-Occurred-At").is_some());
    let info = js
        .get_stream(STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.subjects, vec!["pgbus.>".to_string()]);
    assert_eq!(info.config.storage, stream::StorageType::File);
}

#[tokio::test]
async fn a_stream_that_does_not_fit_is_reported_at_start_with_exit_2_and_nothing_is_consumed() {
    let db = common::test_db().await;
    let nats = NatsServer::start().await.unwrap();
    let js = jetstream_of(&nats).await;
    js.create_stream(stream::Config {
        name: "ELSEWHERE".into(),
        subjects: vec!["other.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_stream(stream::Config {
        name: "FORGETFUL".into(),
        subjects: vec!["short.>".into()],
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .unwrap();
    let url = nats.url();
    let base = ["forward", "-s", "wrong", "-p", "*", "--nats-url", &url];

    let out = run(
        pgbus_on(&db),
        &[&base[..], &["--stream", "ELSEWHERE"]].concat(),
    )
    .await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr.contains("\"ELSEWHERE\" does not fit")
            && out.stderr.contains("do not cover \"pgbus.>\""),
        "{out:?}"
    );

    let out = run(
        pgbus_on(&db),
        &[
            &base[..],
            &["--stream", "FORGETFUL", "--subject-prefix", "short"],
        ]
        .concat(),
    )
    .await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(
        out.stderr
            .contains("duplicate window (1.0s) is shorter than --lease (1m00s)"),
        "{out:?}"
    );

    let client = db.connect().await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.subscriptions WHERE name = 'wrong'"
        )
        .await,
        0,
        "no subscription was registered"
    );
}

#[tokio::test]
async fn a_user_and_password_in_the_nats_url_authenticate_the_forwarder() {
    let db = common::test_db().await;
    let nats = NatsServer::start_with(&["--user", "relay", "--pass", "s3cret"])
        .await
        .unwrap();
    // In NATS_URL: on the command line, `ps` would show the password (refused).
    let url = format!("nats://relay:s3cret@127.0.0.1:{}", nats.port());
    let forwarder = Forwarder::start_with_env(&db, &url, &["-s", "auth", "-p", "auth.*"]).await;
    let client = db.connect().await;
    let event = Event::new("auth.checked", json!({"ok": true}));
    pgbus::publish(&client, &event).await.unwrap();
    wait_forwarded(&client, "auth").await;
    assert_eq!(forwarder.terminate().await, 0);
    let reader =
        async_nats::ConnectOptions::with_user_and_password("relay".into(), "s3cret".into())
            .connect(nats.url())
            .await
            .unwrap();
    let stored = read_all(&jetstream::new(reader), STREAM).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].id, event.id);
}

#[tokio::test]
async fn a_wrong_nats_password_ends_the_forwarder_with_exit_1_and_the_reason_unshown() {
    let db = common::test_db().await;
    let nats = NatsServer::start_with(&["--user", "relay", "--pass", "s3cret"])
        .await
        .unwrap();
    for url in [
        format!("nats://relay:wr0ngpass@127.0.0.1:{}", nats.port()),
        format!("nats://n0body:s3cret@127.0.0.1:{}", nats.port()),
    ] {
        let mut cmd = pgbus_on(&db);
        cmd.env("NATS_URL", &url);
        let out = run(cmd, &["forward", "-s", "refused", "-p", "*"]).await;
        assert_eq!(out.code, 1, "{out:?}");
        assert!(
            out.stderr
                .contains("NATS refuses the forwarder's credentials")
                && out.stderr.contains("authorization violation"),
            "{out:?}"
        );
        assert!(!out.stderr.contains("wr0ngpass"), "{out:?}");
    }
    let client = db.connect().await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.subscriptions WHERE name = 'refused'"
        )
        .await,
        0,
        "nothing was consumed"
    );
}

#[tokio::test]
async fn credentials_revoked_while_forwarding_end_the_forwarder_with_exit_1() {
    let db = common::test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nats.conf");
    let authorize = |password: &str| {
        std::fs::write(
            &conf,
            format!("authorization {{ user: relay, password: {password} }}\n"),
        )
        .unwrap();
    };
    authorize("s3cret");
    let mut nats = NatsServer::start_with(&["-c", conf.to_str().unwrap()])
        .await
        .unwrap();
    let url = format!("nats://relay:s3cret@127.0.0.1:{}", nats.port());
    let forwarder = Forwarder::start_with_env(&db, &url, &["-s", "revoked", "-p", "*"]).await;
    let client = db.connect().await;
    pgbus::publish(&client, &Event::new("before.revoke", json!({})))
        .await
        .unwrap();
    wait_forwarded(&client, "revoked").await;
    // The server comes back with another password: the forwarder's no longer works.
    authorize("changed");
    nats.restart().await.unwrap();
    forwarder
        .wait_said("error: NATS refuses the forwarder's credentials (authorization violation)")
        .await;
    let stderr = forwarder.stderr.lock().unwrap().join("\n");
    assert!(!stderr.contains("s3cret"), "{stderr}");
    assert_eq!(forwarder.exit_code().await, 1);
}

/// The `Nats-Msg-Id`s of the forwarder's stream, in stream order.
async fn stream_ids(js: &jetstream::Context) -> Vec<String> {
    read_all(js, STREAM)
        .await
        .into_iter()
        .map(|m| m.id)
        .collect()
}

/// Waits until every delivery of `subscription` but its dead letters is forwarded.
async fn wait_forwarded_but_dead(client: &tokio_postgres::Client, subscription: &str) {
    common::wait_count(
        client,
        &format!("every live delivery of {subscription} forwarded"),
        &format!(
            "SELECT (SELECT count(*) FROM pgbus.deliveries \
                     WHERE subscription = '{subscription}' AND status <> 'dead') \
             + (SELECT events FROM pgbus.not_fanned_out(NULL))"
        ),
        0,
    )
    .await;
}

/// Waits until the delivery of the event `id` in `subscription` is a dead letter, and
/// gives its last error.
async fn dead_letter_of(client: &tokio_postgres::Client, subscription: &str, id: &str) -> String {
    let sql = "SELECT d.last_error FROM pgbus.deliveries AS d \
               JOIN pgbus.events AS e ON e.seq = d.event_seq \
               WHERE d.subscription = $1 AND e.id = $2 AND d.status = 'dead'";
    common::wait_for("the refused event to be a dead letter", WAIT, || async {
        !client
            .query(sql, &[&subscription, &id])
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    client
        .query_one(sql, &[&subscription, &id])
        .await
        .unwrap()
        .get::<_, Option<String>>(0)
        .unwrap_or_default()
}

#[tokio::test]
async fn a_subject_the_nats_user_may_not_publish_to_dead_letters_its_event_with_the_reason() {
    let db = common::test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nats.conf");
    std::fs::write(
        &conf,
        "authorization { users = [ { user: relay, password: s3cret, \
         permissions: { publish: { deny: [\"pgbus.secret.>\"] } } } ] }\n",
    )
    .unwrap();
    let nats = NatsServer::start_with(&["-c", conf.to_str().unwrap()])
        .await
        .unwrap();
    let url = format!("nats://relay:s3cret@127.0.0.1:{}", nats.port());
    let forwarder = Forwarder::start_with_env(
        &db,
        &url,
        &["-s", "perm", "-p", "*", "--publish-timeout", "1s"],
    )
    .await;
    let client = db.connect().await;
    let secret = Event::new("secret.plans", json!({"x": 1}));
    let open = Event::new("open.news", json!({"x": 2}));
    pgbus::publish_batch(&client, &[secret.clone(), open.clone()])
        .await
        .unwrap();
    let reason = dead_letter_of(&client, "perm", &secret.id).await;
    assert!(
        reason.contains("NATS denies publishing to \"pgbus.secret.plans\"")
            && reason
                .to_ascii_lowercase()
                .contains("permissions violation"),
        "{reason}"
    );
    wait_forwarded_but_dead(&client, "perm").await;
    assert_eq!(forwarder.terminate().await, 0);
    let reader =
        async_nats::ConnectOptions::with_user_and_password("relay".into(), "s3cret".into())
            .connect(nats.url())
            .await
            .unwrap();
    assert_eq!(
        stream_ids(&jetstream::new(reader)).await,
        vec![open.id.clone()],
        "only the permitted event is in the stream"
    );
}

#[tokio::test]
async fn an_event_larger_than_the_stream_takes_is_dead_lettered_with_the_brokers_reason() {
    let db = common::test_db().await;
    let nats = NatsServer::start().await.unwrap();
    let js = jetstream_of(&nats).await;
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["pgbus.>".into()],
        max_message_size: 2_000,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    let forwarder = Forwarder::start(&db, &nats, &["-s", "big", "-p", "*"]).await;
    let client = db.connect().await;
    let big = Event::new("doc.big", json!({"text": "x".repeat(5_000)}));
    let small = Event::new("doc.small", json!({"text": "x"}));
    pgbus::publish_batch(&client, &[big.clone(), small.clone()])
        .await
        .unwrap();
    let reason = dead_letter_of(&client, "big", &big.id).await;
    assert!(reason.contains("maximum"), "{reason}");
    wait_forwarded_but_dead(&client, "big").await;
    assert_eq!(forwarder.terminate().await, 0);
    assert_eq!(
        stream_ids(&js).await,
        vec![small.id.clone()],
        "only the event the stream takes is in it"
    );
}

#[tokio::test]
async fn credentials_in_nats_url_on_the_command_line_are_refused_unshown() {
    let db = common::test_db().await;
    for url in [
        "nats://relay:s3cretpw@127.0.0.1:4222",
        "nats://t0kenvalue@127.0.0.1:4222",
    ] {
        let out = run(
            pgbus_on(&db),
            &["forward", "-s", "refused", "-p", "*", "--nats-url", url],
        )
        .await;
        assert_eq!(out.code, 2, "{out:?}");
        assert!(out.stderr.contains("NATS_URL"), "{out:?}");
        assert!(out.stderr.contains("--nats-creds"), "{out:?}");
        assert!(
            !out.stderr.contains("s3cretpw") && !out.stderr.contains("t0kenvalue"),
            "{out:?}"
        );
    }
    let client = db.connect().await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        0
    );
}

#[tokio::test]
async fn a_malformed_nats_url_with_a_password_is_reported_without_it() {
    let db = common::test_db().await;
    for url in [
        "nats://relay:s3cretpw@127.0.0.1:99999999",
        "nats://relay:s3cret/pw@127.0.0.1:4222",
        "nats://relay:s3cretpw@[::1",
    ] {
        let mut cmd = pgbus_on(&db);
        cmd.env("NATS_URL", url);
        let out = run(cmd, &["forward", "-s", "malformed", "-p", "*"]).await;
        assert_eq!(out.code, 2, "{url}: {out:?}");
        assert!(out.stderr.contains("is not valid"), "{url}: {out:?}");
        assert!(!out.stderr.contains("s3cret"), "{url}: {out:?}");
        assert!(out.stderr.contains("****"), "{url}: {out:?}");
    }
}
