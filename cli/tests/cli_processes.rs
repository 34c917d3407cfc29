//! `pgbus consume` and the processes around it, all real: the commands it runs (and what
//! they leave running), the signals that stop it, and a standard output that blocks,
//! fails or closes. Afterwards nothing it started is running, no delivery is acked
//! without its command having exited 0, and none is dead-lettered for pgbus's own
//! failures.

mod common;
mod proc;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use proc::{Consumer, WAIT, count, pgbus_on, run_with, scratch, signal, start_consume};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

/// How long a consumer told to stop may take here: its 1 s shutdown deadline, the 1 s
/// grace of the commands it stops, and slack for a loaded machine.
const STOPS_WITHIN: Duration = Duration::from_secs(15);

/// Whether `pid` runs (a zombie does not: it runs nothing, and the orphans' zombies stay
/// where init does not reap them).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat[stat.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        state != "Z" && state != "X"
    })
}

/// The pids a command wrote to `file` in `dir`, one per line.
fn pids(dir: &Path, file: &str) -> Vec<i32> {
    std::fs::read_to_string(dir.join(file))
        .unwrap_or_default()
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

/// Waits for `n` pids in `file`.
async fn wait_pids(dir: &Path, file: &str, n: usize) -> Vec<i32> {
    common::wait_for(&format!("{n} pids in {file}"), WAIT, || async {
        pids(dir, file).len() >= n
    })
    .await;
    pids(dir, file)
}

/// Waits until none of `pids` runs.
async fn wait_all_ended(pids: &[i32]) {
    common::wait_for(&format!("{pids:?} to end"), WAIT, || async {
        !pids.iter().any(|&p| running(p))
    })
    .await;
}

/// Asserts none of `pids` runs now.
fn assert_none_running(pids: &[i32], when: &str) {
    for &pid in pids {
        assert!(!running(pid), "{when}: process {pid} still runs");
    }
}

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

/// Rows of pgbus.deliveries by status, and the attempts they carry: (status, n, attempts).
async fn deliveries(client: &tokio_postgres::Client) -> Vec<(String, i64, i64)> {
    client
        .query(
            "SELECT status, count(*), sum(attempts)::int8 FROM pgbus.deliveries \
             GROUP BY status ORDER BY status",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn dead(client: &tokio_postgres::Client) -> i64 {
    count(
        client,
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
    )
    .await
}

#[tokio::test]
async fn a_background_child_neither_holds_the_delivery_nor_outlives_the_command() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("background");
    // The child holds the command's standard error (and pgbus's standard output) open
    // for 30 s; the command itself exits 0 at once.
    let consumer = Consumer::start_in(
        &db,
        &[
            "-s",
            "bg",
            "-p",
            "bg.*",
            "--timeout",
            "10s",
            "--kill-grace",
            "1s",
            "--exec",
            "cat > /dev/null; sleep 30 & echo $! >> bg.pids; echo \"$PGBUS_EVENT_ID\" >> done.txt",
        ],
        Some(&dir),
    )
    .await;
    let started = std::time::Instant::now();
    publish(&db, "bg.job", 3, "").await;
    proc::wait_settled(&client, "the three deliveries to be acked").await;
    // Held by the children's 30 s (or the 10 s timeout), it would take that long.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "acked after {:?}",
        started.elapsed()
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM pgbus.delivery_failures").await,
        0,
        "no attempt failed"
    );
    let children = wait_pids(&dir, "bg.pids", 3).await;
    wait_all_ended(&children).await;
    let (code, stderr) = consumer.stop_with("TERM", STOPS_WITHIN).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("3 acked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_command_past_its_timeout_is_stopped_with_its_whole_group_even_ignoring_sigterm() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("timeout");
    let consumer = Consumer::start_in(
        &db,
        &[
            "-s",
            "slow",
            "-p",
            "slow.*",
            "--max-attempts",
            "1",
            "--timeout",
            "1s",
            "--kill-grace",
            "1s",
            "--exec",
            "cat > /dev/null; trap '' TERM; echo $$ >> pids; sleep 30 & echo $! >> pids; \
             sleep 30; echo late >> done.txt",
        ],
        Some(&dir),
    )
    .await;
    publish(&db, "slow.job", 1, "").await;
    let group = wait_pids(&dir, "pids", 2).await;
    proc::wait_count(
        &client,
        "the timed-out delivery to be dead",
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
        1,
    )
    .await;
    let error: String = client
        .query_one("SELECT error FROM pgbus.delivery_failures", &[])
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("timed out after 1.0s"), "{error}");
    // SIGTERM was ignored: SIGKILL after the grace ended the shell and its child.
    wait_all_ended(&group).await;
    assert!(!dir.join("done.txt").exists());
    let (code, stderr) = consumer.stop_with("TERM", STOPS_WITHIN).await;
    assert_eq!(code, 0, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A command that outlives the shutdown deadline, ignoring SIGTERM, with a background
/// child: pgbus stopped by `signal_name` ends the whole group, exits 0, and the delivery
/// is a failed attempt, pending again, never acked.
async fn stopped_at_the_deadline_by(signal_name: &str) {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch(&format!("deadline-{signal_name}"));
    let consumer = Consumer::start_in(
        &db,
        &[
            "-s",
            "stuck",
            "-p",
            "stuck.*",
            "--shutdown-timeout",
            "1s",
            "--kill-grace",
            "1s",
            "--exec",
            "cat > /dev/null; trap '' TERM; echo $$ >> pids; sleep 30 & echo $! >> pids; \
             sleep 30; echo \"$PGBUS_EVENT_ID\" >> done.txt",
        ],
        Some(&dir),
    )
    .await;
    publish(&db, "stuck.job", 1, "").await;
    let group = wait_pids(&dir, "pids", 2).await;
    let (code, stderr) = consumer.stop_with(signal_name, STOPS_WITHIN).await;
    assert_eq!(code, 0, "SIG{signal_name}: {stderr}");
    assert_none_running(&group, &format!("after SIG{signal_name}"));
    assert!(!dir.join("done.txt").exists());
    assert_eq!(
        deliveries(&client).await,
        vec![("pending".to_string(), 1, 1)],
        "SIG{signal_name}: {stderr}"
    );
    let error: String = client
        .query_one("SELECT error FROM pgbus.delivery_failures", &[])
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("shutdown deadline"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn sigterm_at_the_deadline_ends_the_commands_whole_group() {
    stopped_at_the_deadline_by("TERM").await;
}

#[tokio::test]
async fn sigint_at_the_deadline_ends_the_commands_whole_group() {
    stopped_at_the_deadline_by("INT").await;
}

#[tokio::test]
async fn sighup_stops_gracefully_and_ends_the_commands_whole_group() {
    stopped_at_the_deadline_by("HUP").await;
}

#[tokio::test]
async fn sigusr1_and_the_other_ending_signals_stop_gracefully_too() {
    // Their default action would end pgbus on the spot, its commands running on.
    for signal_name in ["USR1", "ALRM"] {
        stopped_at_the_deadline_by(signal_name).await;
    }
}

#[tokio::test]
async fn a_command_that_exits_0_when_told_to_stop_is_acked() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("term-ok");
    let consumer = Consumer::start_in(
        &db,
        &[
            "-s",
            "polite",
            "-p",
            "polite.*",
            "--shutdown-timeout",
            "1s",
            "--kill-grace",
            "5s",
            "--exec",
            "cat > /dev/null; trap 'echo done >> done.txt; exit 0' TERM; echo $$ >> pids; \
             sleep 30 & wait",
        ],
        Some(&dir),
    )
    .await;
    publish(&db, "polite.job", 1, "").await;
    let group = wait_pids(&dir, "pids", 1).await;
    let (code, stderr) = consumer.stop_with("TERM", STOPS_WITHIN).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(dir.join("done.txt").exists());
    assert_eq!(deliveries(&client).await, vec![], "acked: {stderr}");
    assert_none_running(&group, "after the stop");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Payload padding that makes 40 lines overflow a pipe's 64 KiB buffer.
fn padding() -> String {
    format!(", \"pad\": \"{}\"", "x".repeat(4000))
}

/// Whether a thread of `pid` is blocked writing to a full pipe.
fn blocked_writing(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks.flatten().any(|task| {
                std::fs::read_to_string(task.path().join("wchan"))
                    .is_ok_and(|w| w.contains("pipe_write") || w.contains("pipe_wait"))
            })
        })
        .unwrap_or(false)
}

/// Whether every event acked was printed whole in `printed` (what the pipe received).
async fn acked_were_printed(client: &tokio_postgres::Client, printed: &str) {
    let lines: Vec<&str> = printed.lines().collect();
    let acked = client
        .query(
            "SELECT e.id FROM pgbus.events e WHERE NOT EXISTS \
             (SELECT 1 FROM pgbus.deliveries d WHERE d.event_seq = e.seq)",
            &[],
        )
        .await
        .unwrap();
    for row in acked {
        let id: String = row.get(0);
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with('}') && l.contains(&format!("\"id\":\"{id}\""))),
            "{id} acked but never printed whole"
        );
    }
}

#[tokio::test]
async fn a_stdout_nobody_reads_does_not_keep_signals_from_stopping_consume() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut cmd = pgbus_on(&db);
    cmd.args([
        "consume",
        "-s",
        "blocked",
        "-p",
        "blocked.*",
        "--shutdown-timeout",
        "1s",
    ])
    .stdout(Stdio::piped());
    let (mut child, stderr) = start_consume(cmd).await;
    // Held, never read (until the end).
    let mut stdout = child.stdout.take().unwrap();
    publish(&db, "blocked.job", 40, &padding()).await;
    // Some lines fill the pipe; then a write blocks, with deliveries left.
    let pid = child.id().unwrap();
    common::wait_for("consume to block writing its output", WAIT, || async {
        blocked_writing(pid)
    })
    .await;
    signal(pid, "TERM").await;
    let status = common::within("consume to stop", STOPS_WITHIN, child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(0), "{stderr}");
    every_ack_printed_nothing_dead_or_held(&client, &mut stdout, &stderr).await;
}

/// Reads what the consumer wrote to its pipe: every acked event is a whole line there,
/// nothing is dead, and nothing is left processing.
async fn every_ack_printed_nothing_dead_or_held(
    client: &tokio_postgres::Client,
    stdout: &mut tokio::process::ChildStdout,
    stderr: &str,
) {
    let mut printed = String::new();
    common::within(
        "the pipe's content",
        WAIT,
        stdout.read_to_string(&mut printed),
    )
    .await
    .unwrap();
    acked_were_printed(client, &printed).await;
    assert_eq!(dead(client).await, 0, "{stderr}");
    assert_eq!(
        count(
            client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'pending'"
        )
        .await,
        0,
        "{stderr}"
    );
}

#[tokio::test]
async fn a_stdout_that_takes_nothing_for_the_output_timeout_stops_consume_with_exit_1() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut cmd = pgbus_on(&db);
    cmd.args([
        "consume",
        "-s",
        "stalled",
        "-p",
        "stalled.*",
        "--output-timeout",
        "1s",
        "--shutdown-timeout",
        "1s",
    ])
    .stdout(Stdio::piped());
    let (mut child, stderr) = start_consume(cmd).await;
    let mut stdout = child.stdout.take().unwrap();
    publish(&db, "stalled.job", 40, &padding()).await;
    // No signal: it stops by itself.
    let status = common::within("consume to give up", STOPS_WITHIN, child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("standard output took no line for"),
        "{stderr}"
    );
    every_ack_printed_nothing_dead_or_held(&client, &mut stdout, &stderr).await;
}

#[tokio::test]
async fn a_full_stdout_stops_consume_with_exit_1_and_charges_nothing() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut cmd = pgbus_on(&db);
    // One attempt each: a delivery charged for pgbus's own failure would die of it.
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
    publish(&db, "full.job", 5, "").await;
    let status = common::within("consume to stop", STOPS_WITHIN, child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("could not write to standard output"),
        "{stderr}"
    );
    assert_eq!(dead(&client).await, 0, "{stderr}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'full' \
             AND status = 'pending'"
        )
        .await,
        5,
        "nothing acked, nothing left processing: {stderr}"
    );
    nothing_charged(&client, &stderr).await;
}

#[tokio::test]
async fn a_reader_that_goes_away_stops_consume_with_exit_1_and_charges_nothing() {
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
    publish(&db, "head.job", 20, "").await;
    // `| head -1`: one line read, then the pipe is closed.
    let first = common::within("a first line", WAIT, stdout.next_line())
        .await
        .unwrap()
        .unwrap();
    drop(stdout);
    let status = common::within("consume to stop", STOPS_WITHIN, child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(1), "{first}\n{stderr}");
    assert!(stderr.contains("standard output was closed"), "{stderr}");
    assert_eq!(dead(&client).await, 0, "{stderr}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status <> 'pending'"
        )
        .await,
        0,
        "{stderr}"
    );
    assert!(
        count(&client, "SELECT count(*) FROM pgbus.deliveries").await > 0,
        "lines not written stay pending: {stderr}"
    );
    nothing_charged(&client, &stderr).await;
}

/// Every delivery left is pending with no attempt used and no failure recorded: pgbus's
/// own output failure is never charged to an event.
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

/// A subscription dropped under a running `consume` stops it with exit 1 and a message
/// that says so, instead of leaving it idle on nothing (noticed at the bus's consumer
/// heartbeat, every 10 s).
#[tokio::test]
async fn consume_stops_when_its_subscription_is_dropped() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut cmd = pgbus_on(&db);
    cmd.args(["consume", "-s", "gone", "-p", "gone.*"])
        .stdout(Stdio::null());
    let (mut child, stderr) = start_consume(cmd).await;
    pgbus::admin::drop_subscription(&client, "gone", true)
        .await
        .unwrap();
    let status = common::within("consume to stop", Duration::from_secs(40), child.wait())
        .await
        .unwrap();
    let stderr = stderr.all().await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("was dropped"), "{stderr}");
}

/// The command of the signal tests: it ignores SIGTERM, writes its shell's pid and its
/// background child's to `pids`, and runs for a minute.
const STUBBORN: &str = "cat > /dev/null; trap '' TERM; echo $$ >> pids; sleep 60 & echo $! >> pids; \
                        sleep 60; echo \"$PGBUS_EVENT_ID\" >> done.txt";

#[tokio::test]
async fn sigquit_stops_at_once_and_still_ends_the_commands_whole_group_before_its_retry() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let dir = scratch("sigquit");
    // A shutdown deadline of a minute: a graceful stop would wait for it.
    let consumer = Consumer::start_in(
        &db,
        &[
            "-s",
            "quit",
            "-p",
            "quit.*",
            "--shutdown-timeout",
            "60s",
            "--kill-grace",
            "1s",
            "--retry-base",
            "10ms",
            "--exec",
            STUBBORN,
        ],
        Some(&dir),
    )
    .await;
    publish(&db, "quit.job", 1, "").await;
    let group = wait_pids(&dir, "pids", 2).await;
    let (code, stderr) = consumer.stop_with("QUIT", STOPS_WITHIN).await;
    assert_eq!(code, 131, "{stderr}");
    // Its whole group was gone before pgbus exited, and only then was the attempt
    // recorded: the delivery is pending again (not leased to a dead consumer).
    assert_none_running(&group, "after SIGQUIT");
    assert!(!dir.join("done.txt").exists());
    assert_eq!(
        deliveries(&client).await,
        vec![("pending".to_string(), 1, 1)],
        "{stderr}"
    );
    // Its retry runs in the next consumer, with nothing of the first run left.
    std::fs::remove_file(dir.join("pids")).unwrap();
    let next = Consumer::start_in(
        &db,
        &[
            "-s",
            "quit",
            "-p",
            "quit.*",
            "--exec",
            "cat > /dev/null; echo \"$PGBUS_ATTEMPT\" >> attempts",
        ],
        Some(&dir),
    )
    .await;
    proc::wait_settled(&client, "the retry to be acked").await;
    assert_eq!(
        std::fs::read_to_string(dir.join("attempts")).unwrap(),
        "2\n"
    );
    assert_none_running(&group, "during the retry");
    assert_eq!(next.terminate().await, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_consumer_killed_with_sigkill_takes_its_commands_groups_with_it() {
    let db = common::test_db().await;
    let dir = scratch("sigkill");
    let consumer = Consumer::start_in(
        &db,
        &["-s", "killed", "-p", "killed.*", "--exec", STUBBORN],
        Some(&dir),
    )
    .await;
    publish(&db, "killed.job", 1, "").await;
    let group = wait_pids(&dir, "pids", 2).await;
    consumer.kill_hard().await;
    // The watchdog read the end of its input and killed the group (within WAIT).
    wait_all_ended(&group).await;
    assert!(!dir.join("done.txt").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The environment an --exec command of a consumer started with `extra` arguments got,
/// with DATABASE_URL, PGBUS_LISTEN_URL, PGPASSWORD and PGAPPNAME in pgbus's own.
async fn exec_environment(extra: &[&str]) -> (common::TestDb, Vec<(String, String)>) {
    let db = common::test_db().await;
    let dir = scratch("env");
    let mut cmd = proc::pgbus_on(&db);
    cmd.env("PGBUS_LISTEN_URL", db.conninfo())
        .env("PGPASSWORD", "not-used-by-trust")
        .env("PGAPPNAME", "env-test")
        .current_dir(&dir)
        .stdout(Stdio::null())
        .args(["consume", "-s", "env", "-p", "env.*"])
        .args(extra)
        .args([
            "--exec",
            "cat > /dev/null; env > env.txt.tmp; mv env.txt.tmp env.txt",
        ]);
    let (mut child, _stderr) = start_consume(cmd).await;
    publish(&db, "env.dump", 1, "").await;
    common::wait_for("the command's environment", WAIT, || async {
        dir.join("env.txt").exists()
    })
    .await;
    let env = std::fs::read_to_string(dir.join("env.txt"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    signal(child.id().unwrap(), "TERM").await;
    common::within("consume to stop", WAIT, child.wait())
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (db, env)
}

#[tokio::test]
async fn exec_commands_get_no_database_credentials() {
    let (_db, env) = exec_environment(&[]).await;
    let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    assert!(names.contains(&"PATH"), "{names:?}");
    assert!(names.contains(&"PGBUS_EVENT_ID"), "{names:?}");
    let leaked: Vec<&&str> = names
        .iter()
        .filter(|n| {
            (**n == "DATABASE_URL" || n.starts_with("PG"))
                && !matches!(
                    **n,
                    "PGBUS_SUBSCRIPTION" | "PGBUS_EVENT_ID" | "PGBUS_EVENT_NAME" | "PGBUS_ATTEMPT"
                )
        })
        .collect();
    assert!(leaked.is_empty(), "the command got {leaked:?}");
}

#[tokio::test]
async fn exec_database_env_passes_the_database_settings_on() {
    let (db, env) = exec_environment(&["--exec-database-env"]).await;
    let get = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    assert_eq!(get("DATABASE_URL"), Some(db.conninfo()));
    assert_eq!(get("PGPASSWORD").as_deref(), Some("not-used-by-trust"));
    assert_eq!(get("PGBUS_LISTEN_URL"), Some(db.conninfo()));
    assert_eq!(get("PGAPPNAME").as_deref(), Some("env-test"));
}
