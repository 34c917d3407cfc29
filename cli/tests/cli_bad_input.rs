//! Bad input on the command line: malformed or unreachable `DATABASE_URL`s, a database
//! without the schema, JSON text that is not valid (lone UTF-16 surrogates, `\u0000`,
//! nesting past the parser's limit), bad event names and unknown arguments. Each fails
//! with a clear message and a non-zero exit code, and writes nothing.

mod common;

use std::io::{Read as _, Write as _};
use std::os::unix::ffi::OsStrExt as _;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn pgbus(url: Option<&str>, args: &[&std::ffi::OsStr], stdin: Option<&[u8]>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgbus"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env("PGBUS_LOG", "off")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    let mut child = cmd.spawn().expect("running pgbus");
    let mut input = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        input.write_all(bytes).unwrap();
    }
    drop(input);
    // Every case here fails fast: a hang is a bug, failed here within a deadline.
    let deadline = Instant::now() + DEADLINE;
    let read = |mut pipe: Box<dyn std::io::Read + Send>| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            let _ = tx.send(bytes);
        });
        rx
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pgbus {args:?} did not end within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let rest = |rx: mpsc::Receiver<Vec<u8>>| {
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("pgbus {args:?}: its output did not close"))
    };
    Output {
        status,
        stdout: rest(stdout),
        stderr: rest(stderr),
    }
}

/// How long one case may take.
const DEADLINE: Duration = Duration::from_secs(30);

fn os<'a>(args: &[&'a str]) -> Vec<&'a std::ffi::OsStr> {
    args.iter().map(|a| std::ffi::OsStr::new(*a)).collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Fails with `code`, says `needle` on stderr and nothing on stdout.
fn assert_fails(out: &Output, code: i32, needle: &str, case: &str) {
    let err = stderr(out);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{case}: exit status {:?}, stderr: {err}",
        out.status
    );
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "{case}: stderr does not say {needle:?}: {err}"
    );
    assert!(out.stdout.is_empty(), "{case}: printed {:?}", out.stdout);
}

#[test]
fn a_malformed_database_url_is_a_usage_error() {
    for url in [
        "postgres://user@host:notaport/db",
        "postgresql://[::1/db",
        "host=/tmp port=abc",
        "this is not a connection string",
        "postgres://user@host/db?sslmode=sometimes",
    ] {
        let out = pgbus(Some(url), &os(&["migrate"]), None);
        assert_fails(&out, 2, "DATABASE_URL is malformed", url);
    }
    let out = pgbus(None, &os(&["migrate"]), None);
    assert_fails(&out, 2, "DATABASE_URL is not set", "no url");
}

#[test]
fn a_closed_port_says_it_could_not_connect() {
    // A port that was free a moment ago: nothing listens on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?connect_timeout=5");
    let out = pgbus(Some(&url), &os(&["migrate"]), None);
    assert_fails(&out, 1, "could not connect", &url);
}

#[test]
fn unknown_arguments_are_usage_errors() {
    for args in [
        &["migrate", "--no-such-flag"][..],
        &["no-such-command"],
        &["--database-url"],
    ] {
        let out = pgbus(Some("host=/nonexistent"), &os(args), None);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).is_empty());
    }
}

async fn events(db: &common::TestDb) -> Vec<(String, Value)> {
    let client = db.connect().await;
    client
        .query(
            "SELECT event_name, payload FROM pgbus.events ORDER BY seq",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test]
async fn a_database_without_the_schema_says_to_run_migrate() {
    let db = common::test_db().await;
    db.connect()
        .await
        .batch_execute("DROP SCHEMA pgbus CASCADE")
        .await
        .unwrap();
    let out = pgbus(
        Some(&db.conninfo()),
        &os(&["publish", "order.placed", "{}"]),
        None,
    );
    assert_fails(&out, 1, "pgbus migrate", "no schema");
}

#[tokio::test]
async fn invalid_json_text_is_refused_and_writes_nothing() {
    let db = common::test_db().await;
    let url = db.conninfo();
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    let cases: Vec<(&str, &str)> = vec![
        (r#"{"a": "\ud800"}"#, "lone leading surrogate"),
        (r#"{"a": "\udc00"}"#, "lone trailing surrogate"),
        (r#"{"a": "\udc00\ud800"}"#, "surrogates in the wrong order"),
        (r#"{"a": "\ud800x"}"#, "leading surrogate before a letter"),
        (r#"{"a": "\u0000"}"#, "\\u0000"),
        (r#"{"a": [1, {"b": "x\u0000"}]}"#, "\\u0000 at depth"),
        (r#"{"a": "\x"}"#, "unknown escape"),
        (r#"{"a": "\u12"}"#, "short \\u escape"),
        ("{\"a\": \"tab\there\"}", "control character in a string"),
        (r#"{"a": 1"#, "truncated"),
        ("{} {}", "two documents"),
        ("NaN", "NaN"),
        ("{'a': 1}", "single quotes"),
        (&deep, "nesting past the parser's limit"),
    ];
    for (text, case) in &cases {
        // As an argument, and on standard input.
        let out = pgbus(Some(&url), &os(&["publish", "order.placed", text]), None);
        assert!(!out.status.success(), "{case}: accepted {text}");
        assert!(stderr(&out).contains("payload"), "{case}: {}", stderr(&out));
        let out = pgbus(
            Some(&url),
            &os(&["publish", "order.placed", "-"]),
            Some(text.as_bytes()),
        );
        assert!(!out.status.success(), "{case} (stdin): accepted {text}");
    }
    // Bytes that are not UTF-8 at all.
    let bad = std::ffi::OsStr::from_bytes(b"{\"a\": \"\xff\xfe\"}");
    let out = pgbus(
        Some(&url),
        &[
            std::ffi::OsStr::new("publish"),
            std::ffi::OsStr::new("order.placed"),
            bad,
        ],
        None,
    );
    assert!(!out.status.success(), "invalid UTF-8 accepted");
    let out = pgbus(
        Some(&url),
        &os(&["publish", "order.placed", "-"]),
        Some(b"{\"a\": \"\xff\xfe\"}"),
    );
    assert!(!out.status.success(), "invalid UTF-8 on stdin accepted");
    assert_eq!(events(&db).await, [], "a refused payload wrote something");

    // Bad event names.
    for name in ["", "a b", "order.*", "tab\there", &"x".repeat(256)] {
        let out = pgbus(Some(&url), &os(&["publish", name, "{}"]), None);
        assert!(!out.status.success(), "name {name:?} accepted");
        assert!(
            stderr(&out).contains("event name"),
            "{name:?}: {}",
            stderr(&out)
        );
    }
    assert_eq!(events(&db).await, [], "a refused name wrote something");

    // What is valid goes in exactly: a surrogate pair, every escape.
    let text =
        r#"{"a": "\ud83d\ude00 \" \\ \/ \b \f \n \r \t \u00e9 \u2028", "n": [1.5, -0, 1e300]}"#;
    let out = pgbus(Some(&url), &os(&["publish", "order.placed", text]), None);
    assert!(out.status.success(), "{}", stderr(&out));
    let expected: Value = serde_json::from_str(text).unwrap();
    assert_eq!(
        expected["a"],
        json!("😀 \" \\ / \u{8} \u{c} \n \r \t é \u{2028}")
    );
    // Numbers are compared as jsonb writes them (exact, canonical: -0 is 0, 1e300 has
    // all its digits), which is how they are delivered.
    let canonical: String = db
        .connect()
        .await
        .query_one("SELECT $1::text::jsonb::text", &[&text])
        .await
        .unwrap()
        .get(0);
    let expected: Value = serde_json::from_str(&canonical).unwrap();
    assert_eq!(events(&db).await, [("order.placed".to_string(), expected)]);
}

/// Runs `pgbus ARGS` with no DATABASE_URL.
fn pgbus_args(args: &[&str]) -> Output {
    pgbus(None, &os(args), None)
}

#[tokio::test]
async fn a_password_on_the_command_line_is_refused_unshown_and_nothing_is_done() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // The test's database accepts any password: without the refusal these would run.
    let keyword = format!("{} password=s3cretpw", db.conninfo());
    let quoted = format!("{} password='s3cret pw'", db.conninfo());
    for url in [
        keyword.as_str(),
        quoted.as_str(),
        "postgres://app:s3cretpw@127.0.0.1:1/app",
        "postgresql://app@127.0.0.1:1/app?sslmode=disable&password=s3cretpw",
    ] {
        for args in [
            &["publish", "t.refused", "{}", "--database-url", url][..],
            &["--database-url", url, "migrate"],
            &["status", "--database-url", url],
            &["demo", "--database-url", url],
        ] {
            let out = pgbus_args(args);
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(
                err.contains("--database-url holds a password"),
                "{args:?}: {err}"
            );
            assert!(
                err.contains("DATABASE_URL environment variable"),
                "{args:?}: {err}"
            );
            assert!(
                err.contains("PGPASSFILE") && err.contains("~/.pgpass"),
                "{err}"
            );
            assert!(!err.contains("s3cret"), "{args:?}: {err}");
        }
        let out = pgbus(
            Some(&db.conninfo()),
            &os(&["consume", "-s", "refused", "-p", "*", "--listen-url", url]),
            None,
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("--listen-url holds a password"), "{err}");
        assert!(err.contains("PGBUS_LISTEN_URL"), "{err}");
        assert!(!err.contains("s3cret"), "{err}");
    }
    let events: i64 = client
        .query_one("SELECT count(*) FROM pgbus.events", &[])
        .await
        .unwrap()
        .get(0);
    let subscriptions: i64 = client
        .query_one("SELECT count(*) FROM pgbus.subscriptions", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((events, subscriptions), (0, 0));
    // The same URL in DATABASE_URL is how it is meant to be given.
    let out = pgbus(Some(&keyword), &os(&["publish", "t.fine", "{}"]), None);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_malformed_database_url_is_reported_without_its_password() {
    for url in [
        "postgres://app:s3cretpw@127.0.0.1:notaport/app",
        "postgres://app:s3cret%2Fpw@127.0.0.1:99999999/app",
        "host=127.0.0.1 port=nope password=s3cretpw",
        "postgres://app:s3cretpw@[::1/app",
    ] {
        let out = pgbus(Some(url), &os(&["status"]), None);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{url}: {err}");
        assert!(!err.contains("s3cret"), "{url}: {err}");
    }
}
