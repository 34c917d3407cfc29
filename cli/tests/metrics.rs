//! The Prometheus endpoints of the command line, scraped over HTTP from running
//! processes against a real PostgreSQL: `pgbus consume --metrics-addr` and `pgbus
//! metrics --listen`. The text is parsed strictly (every line a comment, a type or a
//! sample of a declared family).

mod common;
mod proc;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::process::Stdio;

use pgbus::Event;
use proc::{Consumer, WAIT, pgbus, pgbus_on, run};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A port nobody listens on now, on the loopback address.
fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// `GET /metrics` over HTTP/1.0 (so the body ends with the connection); the body of a
/// 200 answer, `None` while nothing answers.
async fn scrape(addr: SocketAddr) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: pgbus\r\n\r\n")
        .await
        .ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    let answer = String::from_utf8(answer).expect("the answer is UTF-8");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1."), "{head}");
    assert!(head.lines().next().unwrap().contains(" 200 "), "{head}");
    Some(body.to_string())
}

/// One sample: its labels, by name, and its value.
type Samples = HashMap<String, Vec<(BTreeMap<String, String>, f64)>>;

/// Parses the Prometheus text format strictly: returns every family's type and its
/// samples (histogram series under their own names: `_bucket`, `_sum`, `_count`).
fn parse(text: &str) -> (HashMap<String, String>, Samples) {
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars().enumerate().all(|(i, c)| {
                c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
            })
    };
    let mut types = HashMap::new();
    let mut samples: Samples = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kind, name, what) = (parts.next(), parts.next(), parts.next());
            let name = name.unwrap_or_else(|| panic!("a comment without a name: {line}"));
            assert!(name_ok(name), "bad name in {line}");
            match kind {
                Some("HELP") => {}
                Some("TYPE") => {
                    let what = what.unwrap_or_default();
                    assert!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(&what),
                        "bad type in {line}"
                    );
                    assert!(
                        types.insert(name.to_string(), what.to_string()).is_none(),
                        "{name} typed twice"
                    );
                }
                _ => panic!("an unknown comment: {line}"),
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("a sample without a value: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels in {line}"));
                let mut labels = BTreeMap::new();
                for pair in inner.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .unwrap_or_else(|| panic!("bad label in {line}"));
                    assert!(name_ok(k), "bad label name in {line}");
                    let v = v
                        .strip_prefix('"')
                        .and_then(|v| v.strip_suffix('"'))
                        .unwrap_or_else(|| panic!("unquoted label value in {line}"));
                    labels.insert(k.to_string(), v.to_string());
                }
                (name, labels)
            }
        };
        assert!(name_ok(name), "bad name in {line}");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "{name} has no TYPE before it");
        samples
            .entry(name.to_string())
            .or_default()
            .push((labels, value));
    }
    (types, samples)
}

/// The value of the sample `name` whose labels include `labels`.
fn value(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples.get(name)?.iter().find_map(|(have, v)| {
        labels
            .iter()
            .all(|(k, want)| have.get(*k).is_some_and(|h| h == want))
            .then_some(*v)
    })
}

/// Scrapes `addr` until `ready` holds for the parsed text; returns it.
async fn scrape_until(
    addr: SocketAddr,
    what: &str,
    ready: impl Fn(&Samples) -> bool,
) -> (HashMap<String, String>, Samples) {
    let parsed = std::sync::Mutex::new(None);
    common::wait_for(what, WAIT, || async {
        let Some(text) = scrape(addr).await else {
            return false;
        };
        let (types, samples) = parse(&text);
        let done = ready(&samples);
        *parsed.lock().unwrap() = Some((types, samples));
        done
    })
    .await;
    parsed.into_inner().unwrap().unwrap()
}

#[tokio::test]
async fn consume_serves_metrics_whose_acked_count_is_the_events_consumed() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let addr = free_addr();
    let mut consumer = Consumer::start(
        &db,
        &[
            "-s",
            "audit",
            "-p",
            "m.*",
            "--metrics-addr",
            &addr.to_string(),
        ],
    )
    .await;
    let events: Vec<Event> = (0..7)
        .map(|i| Event::new("m.x", json!({ "i": i })))
        .collect();
    pgbus::publish_batch(&client, &events).await.unwrap();
    for _ in 0..7 {
        consumer.next().await;
    }
    let acked = [("subscription", "audit"), ("outcome", "acked")];
    // The backlog gauges come from the maintenance tick's first sample, which under load
    // can come after the seven acknowledgements: wait for both.
    let (types, samples) = scrape_until(
        addr,
        "7 acked deliveries and the backlog gauges at /metrics",
        |s| {
            value(s, "pgbus_deliveries_total", &acked) == Some(7.0)
                && s.contains_key("pgbus_backlog")
        },
    )
    .await;
    let typed = |name: &str| types.get(name).map(String::as_str);
    assert_eq!(typed("pgbus_deliveries_total"), Some("counter"));
    assert_eq!(typed("pgbus_wakeups_total"), Some("counter"));
    assert_eq!(typed("pgbus_handler_duration_seconds"), Some("histogram"));
    assert_eq!(typed("pgbus_delivery_lag_seconds"), Some("histogram"));
    assert_eq!(typed("pgbus_claim_batch_size"), Some("histogram"));
    assert_eq!(typed("pgbus_backlog"), Some("gauge"));
    assert_eq!(
        value(&samples, "pgbus_handler_duration_seconds_count", &acked),
        Some(7.0)
    );
    assert_eq!(
        value(
            &samples,
            "pgbus_delivery_lag_seconds_count",
            &[("subscription", "audit")]
        ),
        Some(7.0)
    );
    assert_eq!(
        value(&samples, "pgbus_claim_batch_size_sum", &[]),
        Some(7.0),
        "7 deliveries claimed"
    );
    // Sampled at start, before anything was published.
    assert!(
        value(
            &samples,
            "pgbus_backlog",
            &[("subscription", "audit"), ("state", "due")]
        )
        .is_some()
    );
    assert!(
        !samples.contains_key("pgbus_published_events_total"),
        "consume publishes nothing"
    );
    assert_eq!(consumer.terminate().await, 0);
}

#[tokio::test]
async fn the_metrics_command_serves_every_subscriptions_backlog() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for (name, pattern) in [("waiting", "w.*"), ("idle", "i.*")] {
        pgbus::admin::register_subscription(&client, name, &[pattern], 25)
            .await
            .unwrap();
    }
    let mut events: Vec<Event> = (0..4)
        .map(|i| Event::new("w.x", json!({ "i": i })))
        .collect();
    events.push(Event::new("w.later", json!({})).delay(std::time::Duration::from_secs(3600)));
    pgbus::publish_batch(&client, &events).await.unwrap();
    // The deliveries a running bus would have made, due for 90 seconds.
    common::fan_out(&client).await;
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET available_at = now() - interval '90 seconds' \
             WHERE available_at <= now()",
        )
        .await
        .unwrap();

    let addr = free_addr();
    let mut cmd = pgbus_on(&db);
    cmd.args(["metrics", "--listen", &addr.to_string(), "--interval", "1s"])
        .stdout(Stdio::null());
    let mut child = start_process(cmd, "pgbus: serving metrics").await;
    let waiting = |state| [("subscription", "waiting"), ("state", state)];
    let (types, samples) = scrape_until(addr, "the backlog at /metrics", |s| {
        value(s, "pgbus_backlog", &waiting("due")) == Some(4.0)
    })
    .await;
    assert_eq!(
        types.get("pgbus_backlog").map(String::as_str),
        Some("gauge")
    );
    assert_eq!(
        value(&samples, "pgbus_backlog", &waiting("scheduled")),
        Some(1.0)
    );
    assert_eq!(
        value(&samples, "pgbus_backlog", &waiting("dead")),
        Some(0.0)
    );
    let age = value(
        &samples,
        "pgbus_oldest_due_age_seconds",
        &[("subscription", "waiting")],
    )
    .unwrap();
    assert!((90.0..120.0).contains(&age), "oldest due age {age}");
    // Sampled with them: what holds the xmin horizon back (nothing here, 0).
    assert_eq!(
        types
            .get("pgbus_oldest_transaction_age_seconds")
            .map(String::as_str),
        Some("gauge")
    );
    assert!(value(&samples, "pgbus_oldest_transaction_age_seconds", &[]).is_some());
    // And the events not yet turned into deliveries.
    for gauge in ["pgbus_fan_out_backlog", "pgbus_fan_out_oldest_age_seconds"] {
        assert_eq!(
            types.get(gauge).map(String::as_str),
            Some("gauge"),
            "{gauge}"
        );
        assert!(value(&samples, gauge, &[]).is_some(), "{gauge}");
    }
    assert_eq!(
        value(
            &samples,
            "pgbus_backlog",
            &[("subscription", "idle"), ("state", "due")]
        ),
        Some(0.0)
    );
    assert!(
        !samples.contains_key("pgbus_deliveries_total"),
        "pgbus metrics delivers nothing"
    );
    proc::signal(child.id().unwrap(), "TERM").await;
    let status = common::within("pgbus metrics to stop", WAIT, child.wait())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// Spawns `cmd` with standard error piped (echoed to the test's output) and waits for a
/// line that starts with `ready`.
async fn start_process(
    mut cmd: tokio::process::Command,
    ready: &'static str,
) -> tokio::process::Child {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    cmd.stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawning pgbus");
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stderr.take().unwrap()));
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[pgbus] {line}");
            if line.starts_with(ready) {
                let _ = tx.send(());
            }
        }
    });
    common::within("pgbus to start", WAIT, rx.recv())
        .await
        .expect("pgbus exited before it was ready");
    child
}

#[tokio::test]
async fn a_bad_metrics_address_is_refused_with_exit_2_and_nothing_started() {
    let db = common::test_db().await;
    let client = db.connect().await;
    const CONSUME: [&str; 6] = ["consume", "-s", "a", "-p", "*", "--metrics-addr"];
    const METRICS: [&str; 2] = ["metrics", "--listen"];
    let bad: [(&[&str], &[&str]); 7] = [
        (&CONSUME, &["nonsense"]),
        (&CONSUME, &["127.0.0.1"]),
        (&CONSUME, &["localhost:9187"]),
        (&METRICS, &["127.0.0.1:99999"]),
        (&METRICS, &[""]),
        (&METRICS[..1], &[]),
        (&METRICS, &["127.0.0.1:9187", "--interval", "10ms"]),
    ];
    for (command, rest) in bad {
        let args = [command, rest].concat();
        let out = run(pgbus_on(&db), &args).await;
        assert_eq!(out.code, 2, "{args:?}: {out:?}");
        assert!(out.stderr.starts_with("error:"), "{args:?}: {out:?}");
    }
    // An address already taken: the consumer stops before it registers anything.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for command in [&CONSUME[..], &METRICS] {
        let args = [command, &[addr.as_str()]].concat();
        let out = run(pgbus_on(&db), &args).await;
        assert_eq!(out.code, 1, "{args:?}: {out:?}");
        assert!(
            out.stderr
                .contains(&format!("cannot serve metrics on {addr}")),
            "{args:?}: {out:?}"
        );
    }
    assert_eq!(
        common::count(&client, "SELECT count(*) FROM pgbus.subscriptions").await,
        0,
        "no subscription was registered"
    );
    let help = run(pgbus(), &["metrics", "--help"]).await.ok();
    assert!(help.stdout.contains("--listen 127.0.0.1:9187"), "{help:?}");
    let help = run(pgbus(), &["consume", "--help"]).await.ok();
    assert!(
        help.stdout.contains("--metrics-addr 127.0.0.1:9187"),
        "{help:?}"
    );
}
