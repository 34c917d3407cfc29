//! Running the `pgbus` binary in tests: one-shot commands with a deadline, and
//! long-running `pgbus consume` processes that are killed when dropped.

#![allow(dead_code, unused_imports, unreachable_pub)]

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::common;
pub use crate::common::{WAIT, count, wait_count, wait_settled};

/// The `PG*` variables that fill a connection string's gaps.
pub const PG_VARS: [&str; 13] = [
    "PGHOST",
    "PGPORT",
    "PGUSER",
    "PGPASSWORD",
    "PGDATABASE",
    "PGAPPNAME",
    "PGCONNECT_TIMEOUT",
    "PGSSLMODE",
    "PGSSLROOTCERT",
    "PGSSLCERT",
    "PGSSLKEY",
    "PGPASSFILE",
    "PGBUS_POOLER",
];

/// The `pgbus` binary, with no DATABASE_URL or `PG*` variable from the environment.
pub fn pgbus() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pgbus"));
    for var in PG_VARS {
        cmd.env_remove(var);
    }
    cmd.env_remove("DATABASE_URL")
        .env_remove("PGBUS_LOG")
        .env_remove("TRACEPARENT")
        .env_remove("TRACESTATE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// The `pgbus` binary with DATABASE_URL naming the test's database.
pub fn pgbus_on(db: &common::TestDb) -> Command {
    let mut cmd = pgbus();
    cmd.env("DATABASE_URL", db.conninfo());
    cmd
}

#[derive(Debug)]
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"))
    }

    pub fn ok(self) -> Self {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }
}

/// Runs a command to its end, with `input` on its standard input.
pub async fn run_with(mut cmd: Command, args: &[&str], input: Option<&str>) -> Output {
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    if input.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.spawn().expect("spawning pgbus");
    if let Some(input) = input {
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
    }
    let out = common::within(
        &format!("pgbus {}", args.join(" ")),
        WAIT,
        child.wait_with_output(),
    )
    .await
    .unwrap();
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

pub async fn run(cmd: Command, args: &[&str]) -> Output {
    run_with(cmd, args, None).await
}

/// A running `pgbus consume`. Dropping it kills the process.
pub struct Consumer {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    stderr: Stderr,
}

/// What a running process wrote on standard error so far (each line is also echoed to
/// the test's output).
#[derive(Clone, Default)]
pub struct Stderr(Arc<Mutex<(Vec<String>, bool)>>);

impl Stderr {
    pub fn text(&self) -> String {
        self.0.lock().unwrap().0.join("\n")
    }

    /// Waits until standard error is closed (the process and all it started are gone),
    /// then returns all of it.
    pub async fn all(&self) -> String {
        common::wait_for("standard error to close", WAIT, || {
            let ended = self.0.lock().unwrap().1;
            async move { ended }
        })
        .await;
        self.text()
    }
}

/// Spawns `cmd` (a `pgbus consume` with standard error not yet set) and waits until it
/// says it is consuming. Its standard output is left as the caller set it.
pub async fn start_consume(mut cmd: Command) -> (Child, Stderr) {
    cmd.stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawning pgbus consume");
    let (ready_tx, mut ready) = mpsc::unbounded_channel();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let stderr = Stderr::default();
    let kept = stderr.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[consume] {line}");
            let ready = line.starts_with("pgbus: consuming");
            kept.0.lock().unwrap().0.push(line);
            if ready {
                let _ = ready_tx.send(());
            }
        }
        kept.0.lock().unwrap().1 = true;
    });
    common::within("consume to start", WAIT, ready.recv())
        .await
        .expect("consume exited before it was ready");
    (child, stderr)
}

impl Consumer {
    /// Starts `pgbus consume ARGS` and waits until it has registered its subscription.
    pub async fn start(db: &common::TestDb, args: &[&str]) -> Consumer {
        Consumer::start_in(db, args, None).await
    }

    pub async fn start_in(
        db: &common::TestDb,
        args: &[&str],
        dir: Option<&std::path::Path>,
    ) -> Self {
        let mut cmd = pgbus_on(db);
        cmd.arg("consume").args(args).stdout(Stdio::piped());
        if let Some(dir) = dir {
            cmd.current_dir(dir);
        }
        let (mut child, stderr) = start_consume(cmd).await;
        let (tx, lines) = mpsc::unbounded_channel();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Consumer {
            child,
            lines,
            stderr,
        }
    }

    /// What it wrote on standard error so far.
    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Sends `signal` (TERM, INT, HUP...) and waits, at most `within`, for the exit
    /// code; returns it with everything written on standard error.
    pub async fn stop_with(mut self, signal_name: &str, within: Duration) -> (i32, String) {
        signal(self.pid(), signal_name).await;
        let status = common::within("consume to stop", within, self.child.wait())
            .await
            .unwrap();
        (status.code().unwrap_or(-1), self.stderr.all().await)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("consume is running")
    }

    /// The next delivery printed on standard output.
    pub async fn next(&mut self) -> Value {
        let line = common::within("a delivery line", WAIT, self.lines.recv())
            .await
            .expect("consume closed its output");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    }

    /// Sends SIGTERM and waits for the exit code.
    pub async fn terminate(mut self) -> i32 {
        signal(self.pid(), "TERM").await;
        let status = common::within("consume to stop", WAIT, self.child.wait())
            .await
            .unwrap();
        status.code().unwrap_or(-1)
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

pub async fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .await
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}

/// Publishes `p.one` (id `e1`) and `p.two` (id `e2`) and makes every delivery of them a
/// dead letter after 3 attempts (`nope`), each with one failure record.
pub async fn two_dead_letters(client: &tokio_postgres::Client) {
    with_deliveries(
        client,
        "SELECT pgbus.publish('p.one', id => 'e1'); SELECT pgbus.publish('p.two', id => 'e2');",
        "UPDATE pgbus.deliveries SET status = 'dead', attempts = 3, last_error = 'nope'; \
         INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error) \
         SELECT subscription, event_seq, 3, 'nope' FROM pgbus.deliveries;",
    )
    .await;
}

/// Runs `write` (SQL that publishes or inserts events, committed), turns the events into
/// deliveries as a running bus's next claim would (`fan_out`), then runs `then` (SQL that
/// sets those deliveries up: claimed, dead, done...).
pub async fn with_deliveries(client: &tokio_postgres::Client, write: &str, then: &str) {
    client.batch_execute(write).await.unwrap();
    common::fan_out(client).await;
    client.batch_execute(then).await.unwrap();
}

/// A scratch directory of the test's own.
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cli-{name}-{:016x}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl Consumer {
    /// Kills the process with SIGKILL (no graceful anything) and waits for it to end.
    pub async fn kill_hard(mut self) {
        signal(self.pid(), "KILL").await;
        common::within("consume to die", WAIT, self.child.wait())
            .await
            .unwrap();
    }
}
