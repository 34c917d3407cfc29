//! The chaos soak: producers publish (committing, rolling back on purpose, losing their
//! connection mid-commit) while consumers in this process and in child processes deliver,
//! and the test, at random moments, terminates the bus's backends, restarts PostgreSQL
//! (fast, and once immediate), SIGKILLs a consumer process and starts another, and pauses
//! one (SIGSTOP) past its lease; handlers fail and panic for some events. At the end every
//! committed event was delivered to every matching subscription at least once, no
//! rolled-back event was delivered, nothing is left pending, processing or dead, and the
//! buses reconnected on their own, once per outage.
//!
//! The CI run publishes 3,000 events over about 40 s. A longer one:
//! `PGBUS_CHAOS_EVENTS=50000 PGBUS_CHAOS_MINUTES=5 cargo test --test chaos -- --nocapture`.

mod common;
#[path = "shared/logs.rs"]
mod logs;

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pgbus::{
    Bus, BusBuilder, Error, Event, HandlerError, RetryPolicy, RunningBus, Subscription,
    SubscriptionOptions,
};
use pgbus_testkit::embedded::{EmbeddedPostgres, ShutdownMode};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_postgres::{Client, Config, NoTls};

/// The subscriptions and their patterns.
const SUBS: [(&str, &str); 3] = [
    ("chaos-all", "*"),
    ("chaos-orders", "order.*"),
    ("chaos-shipping", "ship.sent"),
];
/// The event names published: each matches one, two or three subscriptions.
const NAMES: [&str; 4] = ["order.placed", "order.paid", "ship.sent", "user.seen"];

/// A consumer's lease: short, so that a paused or killed consumer's deliveries come back
/// within seconds.
const LEASE: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(500);
/// Enough attempts for the planned failures plus the attempts that kills, pauses and
/// restarts consume.
const MAX_ATTEMPTS: i32 = 25;

/// How long a consumer process takes over each delivery.
const CHILD_WORK: Duration = Duration::from_millis(20);

/// Set in a child consumer process: the database to consume from.
const CHILD_ENV: &str = "PGBUS_CHAOS_CHILD_URL";
/// Marks the lines a child writes for the parent (libtest writes its own lines too).
const MARK: &str = "CHAOS ";

/// What an event asks of its handlers (its payload's `trouble`).
const FAIL_ONCE: i64 = 1;
const FAIL_TWICE: i64 = 2;
const PANIC_ONCE: i64 = 3;

const PLANNED_PANIC: &str = "chaos: planned panic";

/// The run's size: `PGBUS_CHAOS_EVENTS` (default 3,000) published over
/// `PGBUS_CHAOS_MINUTES` (default 0.7).
fn plan() -> (usize, Duration) {
    let events = std::env::var("PGBUS_CHAOS_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_000usize);
    let minutes = std::env::var("PGBUS_CHAOS_MINUTES")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.7);
    (events, Duration::from_secs_f64(minutes * 60.0))
}

fn retry() -> RetryPolicy {
    RetryPolicy::exponential(Duration::from_millis(50))
        .cap(Duration::from_millis(500))
        .max_attempts(MAX_ATTEMPTS)
}

fn consumer_builder(config: Config) -> BusBuilder {
    Bus::builder(config)
        .lease(LEASE)
        // Killed and paused consumers include the leader: it is replaced within 2.25 of
        // these, well inside the drain's bound.
        .leader_lease(LEASE)
        .poll_interval(POLL)
        .retry(retry())
        .concurrency(8)
        .batch_size(20)
        .shutdown_timeout(Duration::from_secs(10))
}

/// One line of a consumer's record: a handler run, a settlement's result, or a start.
fn line_run(sub: &str, id: &str, attempt: i32, ok: bool) -> Value {
    json!({"kind": "run", "sub": sub, "id": id, "attempt": attempt, "ok": ok})
}

fn line_settled(sub: &str, id: &str, attempt: i32, result: &pgbus::Result<()>) -> Value {
    let result = match result {
        Ok(()) => "applied".to_string(),
        Err(Error::LeaseLost) => "lease_lost".to_string(),
        Err(e) => format!("error: {e}"),
    };
    json!({"kind": "settled", "sub": sub, "id": id, "attempt": attempt, "result": result})
}

/// Consumes one stream subscription: fails and panics as each event asks, on the
/// attempts it names, and acknowledges the rest after recording the run with `emit`.
async fn consume_stream(
    mut stream: Subscription,
    work: Duration,
    emit: Arc<dyn Fn(Value) + Send + Sync>,
) {
    while let Some(delivery) = stream.next().await {
        // The handler's work: a consumer process takes its time, so that it always
        // holds deliveries when it is killed or paused.
        tokio::time::sleep(work).await;
        let sub = delivery.subscription().to_string();
        let id = delivery.event().id.clone();
        let attempt = delivery.attempt();
        let trouble = delivery.event().payload["trouble"].as_i64().unwrap_or(0);
        let fail = matches!(trouble, FAIL_ONCE | FAIL_TWICE) && i64::from(attempt) <= trouble;
        if trouble == PANIC_ONCE && attempt == 1 {
            // A task that panics while it holds the delivery: dropping it on the way out
            // counts as a failed attempt.
            emit(line_run(&sub, &id, attempt, false));
            let _ = tokio::spawn(async move {
                let _held = delivery;
                panic!("{PLANNED_PANIC}");
            })
            .await;
        } else if fail {
            emit(line_run(&sub, &id, attempt, false));
            let result = delivery.fail(HandlerError::new("planned failure")).await;
            emit(line_settled(&sub, &id, attempt, &result));
        } else {
            emit(line_run(&sub, &id, attempt, true));
            let result = delivery.ack().await;
            emit(line_settled(&sub, &id, attempt, &result));
        }
    }
}

/// A consumer process: the soak re-runs this test binary with only this test selected
/// and [`CHILD_ENV`] set. It consumes the three subscriptions through streams, writes one
/// line per handler run and settlement to stdout (flushed before the acknowledgement is
/// sent), and shuts down when its stdin closes.
#[tokio::test]
#[ignore = "a consumer process that the chaos soak starts; does nothing on its own"]
async fn chaos_consumer_process() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    quiet_planned_panics();
    let config: Config = url.parse().expect("the child's database url");
    let mut bus = consumer_builder(config).build().unwrap();
    let streams: Vec<Subscription> = SUBS
        .iter()
        .map(|(name, pattern)| bus.subscribe(name, [*pattern]).unwrap())
        .collect();
    let running = bus.start().await.expect("starting the child's bus");
    let emit: Arc<dyn Fn(Value) + Send + Sync> = Arc::new(|line: Value| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{MARK}{line}");
        let _ = out.flush();
    });
    emit(json!({"kind": "started", "worker": running.worker_id()}));
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(consume_stream(s, CHILD_WORK, emit.clone())))
        .collect();
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink)
    })
    .await;
    running.shutdown().await.unwrap();
    for t in tasks {
        let _ = t.await;
    }
}

/// One handler run: consumer, subscription, event id, attempt (0: not known to a
/// handler), whether it succeeded.
type Run = (String, String, String, i32, bool);

/// One settlement a child reported: consumer, subscription, event id, attempt, result.
type Settled = (String, String, String, i32, String);

/// Everything the consumers did, and what the children reported.
#[derive(Default)]
struct Record {
    runs: Mutex<Vec<Run>>,
    /// Every settlement a child reported: consumer, subscription, event id, attempt and
    /// result (`applied`, `lease_lost` or an error).
    settled: Mutex<Vec<Settled>>,
    /// Runs per (subscription, id) in this process's handlers, to fail the first ones.
    handler_runs: Mutex<HashMap<(String, String), i64>>,
}

impl Record {
    fn take_line(&self, consumer: &str, line: &Value) {
        let s = |k: &str| line[k].as_str().unwrap_or_default().to_string();
        match line["kind"].as_str() {
            Some("run") => self.runs.lock().unwrap().push((
                consumer.to_string(),
                s("sub"),
                s("id"),
                line["attempt"].as_i64().unwrap_or(0) as i32,
                line["ok"].as_bool().unwrap_or(false),
            )),
            Some("settled") => {
                self.settled.lock().unwrap().push((
                    consumer.to_string(),
                    s("sub"),
                    s("id"),
                    line["attempt"].as_i64().unwrap_or(0) as i32,
                    s("result"),
                ));
            }
            _ => {}
        }
    }

    /// The results `consumer` reported for the deliveries in `held` (subscription, event
    /// id, attempt), in the order reported.
    fn results_for(&self, consumer: &str, held: &[(String, String, i32)]) -> Vec<String> {
        self.settled
            .lock()
            .unwrap()
            .iter()
            .filter(|(c, sub, id, attempt, _)| {
                c == consumer
                    && held
                        .iter()
                        .any(|(s, i, a)| s == sub && i == id && a == attempt)
            })
            .map(|(.., result)| result.clone())
            .collect()
    }

    /// The settlements `consumer` saw rejected as stale; `None`: every consumer's.
    fn lease_lost_by(&self, consumer: Option<&str>) -> u64 {
        self.settled
            .lock()
            .unwrap()
            .iter()
            .filter(|(c, .., result)| result == "lease_lost" && consumer.is_none_or(|n| n == c))
            .count() as u64
    }

    fn lease_lost(&self, consumer: &str) -> u64 {
        self.lease_lost_by(Some(consumer))
    }

    /// The handler of this process's handler bus: fails the first runs (here) of the
    /// events that ask for it, and panics on the first run of those that ask for that.
    fn handle(&self, sub: &str, event: &Event) -> Result<(), HandlerError> {
        let trouble = event.payload["trouble"].as_i64().unwrap_or(0);
        let run = {
            let mut runs = self.handler_runs.lock().unwrap();
            let n = runs.entry((sub.to_string(), event.id.clone())).or_default();
            *n += 1;
            *n
        };
        let ok = !(matches!(trouble, FAIL_ONCE | FAIL_TWICE) && run <= trouble
            || trouble == PANIC_ONCE && run == 1);
        self.runs.lock().unwrap().push((
            "handlers".to_string(),
            sub.to_string(),
            event.id.clone(),
            0,
            ok,
        ));
        if trouble == PANIC_ONCE && run == 1 {
            panic!("{PLANNED_PANIC}");
        }
        if ok {
            Ok(())
        } else {
            Err(HandlerError::new("planned failure"))
        }
    }
}

/// A consumer process and what it reported.
struct ChildConsumer {
    name: String,
    child: Child,
    worker: Arc<Mutex<Option<String>>>,
}

impl ChildConsumer {
    fn pid(&self) -> u32 {
        self.child.id().expect("the child is running")
    }
}

static CHILDREN_STARTED: AtomicU64 = AtomicU64::new(0);

async fn start_child(url: &str, record: &Arc<Record>) -> ChildConsumer {
    let n = CHILDREN_STARTED.fetch_add(1, Ordering::Relaxed);
    let name = format!("child-{n}");
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chaos-{}-{name}.log", std::process::id()));
    let stderr = std::fs::File::create(&log).expect("creating the child's log");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "chaos_consumer_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .kill_on_drop(true)
        .spawn()
        .expect("starting a consumer process");
    let stdout = child.stdout.take().unwrap();
    let worker = Arc::new(Mutex::new(None));
    let (record, worker_slot, consumer) = (record.clone(), worker.clone(), name.clone());
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let Some(at) = line.find(MARK) else { continue };
            let Ok(value) = serde_json::from_str::<Value>(&line[at + MARK.len()..]) else {
                continue;
            };
            if value["kind"] == "started" {
                *worker_slot.lock().unwrap() = value["worker"].as_str().map(String::from);
            }
            record.take_line(&consumer, &value);
        }
    });
    let started = worker.clone();
    common::wait_for(
        &format!("{name} to start (log: {})", log.display()),
        Duration::from_secs(60),
        || {
            let started = started.clone();
            async move { started.lock().unwrap().is_some() }
        },
    )
    .await;
    ChildConsumer {
        name,
        child,
        worker,
    }
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill {sig} {pid} failed");
}

/// What each producer transaction became.
#[derive(Default)]
struct Outcomes {
    committed: HashSet<String>,
    /// Rolled back on purpose, or failed before COMMIT: never to be delivered.
    rolled_back: HashSet<String>,
    /// The connection failed during COMMIT: the log says which.
    uncertain: HashSet<String>,
    transactions: u64,
    batches: u64,
    broken: u64,
}

async fn connect(config: &Config) -> Option<Client> {
    let (client, connection) = config.connect(NoTls).await.ok()?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Some(client)
}

/// Publishes `quota` events at an even pace until `until`, in single and batch
/// transactions, one in ten rolled back on purpose; reconnects after any failure.
async fn produce(
    producer: usize,
    config: Config,
    quota: usize,
    window: Duration,
    outcomes: Arc<Mutex<Outcomes>>,
) {
    let start = Instant::now();
    let mut client: Option<Client> = None;
    let mut n = 0usize;
    let mut rng = fastrand::Rng::with_seed(producer as u64 * 7919 + 1);
    while n < quota {
        // Pace: event n is due at n/quota of the window.
        let due = window.mul_f64(n as f64 / quota as f64);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let Some(c) = client.as_mut() else {
            client = connect(&config).await;
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            continue;
        };
        let size = if rng.u8(..3) == 0 {
            rng.usize(2..=20).min(quota - n)
        } else {
            1
        };
        let events: Vec<Event> = (0..size)
            .map(|i| {
                let trouble = match rng.u8(..100) {
                    0..=3 => FAIL_ONCE,
                    4..=6 => FAIL_TWICE,
                    7..=9 => PANIC_ONCE,
                    _ => 0,
                };
                Event::new(
                    NAMES[rng.usize(..NAMES.len())],
                    json!({"producer": producer, "n": n + i, "trouble": trouble}),
                )
                .id(format!("p{producer}-{}", n + i))
            })
            .collect();
        n += size;
        let ids: Vec<String> = events.iter().map(|e| e.id.clone()).collect();
        let rollback = rng.u8(..10) == 0;
        let mixed = rng.bool();
        // Ok(true): committed; Ok(false): rolled back on purpose; Err(false): failed
        // before COMMIT (never committed); Err(true): failed during COMMIT (unknown).
        let result: Result<bool, bool> = async {
            let tx = c.transaction().await.map_err(|_| false)?;
            if size == 1 {
                pgbus::publish(&tx, &events[0]).await.map_err(|_| false)?;
            } else if mixed {
                // A batch, then singles, in one transaction.
                let (head, tail) = events.split_at(size / 2);
                pgbus::publish_batch(&tx, head).await.map_err(|_| false)?;
                for e in tail {
                    pgbus::publish(&tx, e).await.map_err(|_| false)?;
                }
            } else {
                pgbus::publish_batch(&tx, &events)
                    .await
                    .map_err(|_| false)?;
            }
            if rollback {
                tx.rollback().await.map_err(|_| false)?;
                return Ok(false);
            }
            tx.commit().await.map_err(|_| true)?;
            Ok(true)
        }
        .await;
        let mut o = outcomes.lock().unwrap();
        o.transactions += 1;
        if size > 1 {
            o.batches += 1;
        }
        match result {
            Ok(true) => o.committed.extend(ids),
            Ok(false) => o.rolled_back.extend(ids),
            Err(at_commit) => {
                o.broken += 1;
                if at_commit {
                    o.uncertain.extend(ids);
                } else {
                    o.rolled_back.extend(ids);
                }
                client = None;
            }
        }
    }
}

#[derive(Debug, Default)]
struct Faults {
    terminate_listener: u32,
    terminate_workers: u32,
    restart_fast: u32,
    restart_immediate: u32,
    kill_consumer: u32,
    pause_consumer: u32,
    stale_rejected_after_pause: u64,
    held_by_killed: u64,
    held_by_paused: u64,
    /// Of those, the ones the paused consumer did not complete itself with a settlement
    /// it had sent before the pause (and the server applied while it was stopped).
    taken_from_paused: u64,
    downtime: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    TerminateListener,
    TerminateWorkers,
    RestartFast,
    RestartImmediate,
    KillConsumer,
    PauseConsumer,
}

/// How many deliveries `worker` holds (processing, or reaped and not claimed again).
/// What a stopped worker holds once the statements it had sent have finished: the count
/// of its deliveries, once it reads the same three times 200 ms apart (at most 10 s).
async fn settled_held_by(config: &Config, worker: &str) -> u64 {
    let mut last = u64::MAX;
    let mut same = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await; // sampling period
        let now = held_by(config, worker).await;
        same = if now == last { same + 1 } else { 0 };
        last = now;
        if same >= 2 || tokio::time::Instant::now() > deadline {
            return now;
        }
    }
}

/// The deliveries `worker` holds: subscription, event id, attempt and the event's
/// `trouble`.
async fn held_list(config: &Config, worker: &str) -> Vec<(String, String, i32, i64)> {
    let client = connect(config).await.expect("connecting");
    client
        .query(
            "SELECT d.subscription, e.id, d.attempts, \
             coalesce((e.payload->>'trouble')::int8, 0) FROM pgbus.deliveries d \
             JOIN pgbus.events e ON e.seq = d.event_seq WHERE d.locked_by = $1",
            &[&worker],
        )
        .await
        .expect("listing a worker's deliveries")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
}

/// The current rows of these deliveries (subscription, event id, attempt): status,
/// attempts, holder and last error, for a failure's message.
async fn rows_of(config: &Config, held: &[(String, String, i32)]) -> Vec<String> {
    let client = connect(config).await.expect("connecting");
    let mut rows = Vec::new();
    for (sub, id, _) in held {
        let row = client
            .query_opt(
                "SELECT d.status, d.attempts, d.locked_by, d.last_error FROM pgbus.deliveries d \
                 JOIN pgbus.events e ON e.seq = d.event_seq \
                 WHERE d.subscription = $1 AND e.id = $2",
                &[sub, id],
            )
            .await
            .expect("reading a delivery");
        rows.push(match row {
            Some(r) => format!(
                "{sub}/{id}: {} attempt {} by {:?} ({:?})",
                r.get::<_, String>(0),
                r.get::<_, i32>(1),
                r.get::<_, Option<String>>(2),
                r.get::<_, Option<String>>(3)
            ),
            None => format!("{sub}/{id}: settled"),
        });
    }
    rows
}

async fn held_by(config: &Config, worker: &str) -> u64 {
    let client = connect(config).await.expect("connecting");
    let held: i64 = client
        .query_one(
            "SELECT count(*) FROM pgbus.deliveries WHERE locked_by = $1",
            &[&worker],
        )
        .await
        .expect("counting a worker's deliveries")
        .get(0);
    held as u64
}

async fn terminate(config: &Config, application_name: &str) {
    let Some(client) = connect(config).await else {
        return;
    };
    let _ = client
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1 AND pid <> pg_backend_pid()",
            &[&application_name],
        )
        .await;
}

/// Every in-process bus listens (its first connection).
async fn wait_listening(buses: &[&RunningBus]) {
    common::wait_for("the buses to listen", Duration::from_secs(60), || async {
        buses.iter().all(|b| b.is_listening())
    })
    .await;
}

/// How often each in-process bus's listener has reconnected so far.
fn reconnects(buses: &[&RunningBus]) -> Vec<u64> {
    buses.iter().map(|b| b.stats().reconnects).collect()
}

/// Every in-process bus has reconnected since `before` and listens again. (Waiting only
/// for "listening" could return before a listener noticed its connection was gone, and
/// the next fault would then fall into the same outage.)
async fn wait_reconnected(buses: &[&RunningBus], before: &[u64]) {
    common::wait_for(
        "the buses to reconnect and listen again",
        Duration::from_secs(60),
        || async {
            buses
                .iter()
                .zip(before)
                .all(|(b, n)| b.stats().reconnects > *n && b.is_listening())
        },
    )
    .await;
}

#[allow(clippy::too_many_arguments)]
async fn inject(
    fault: Fault,
    cluster: &EmbeddedPostgres,
    config: &Config,
    url: &str,
    buses: &[&RunningBus],
    children: &mut Vec<ChildConsumer>,
    record: &Arc<Record>,
    faults: &mut Faults,
) {
    match fault {
        Fault::TerminateListener => {
            faults.terminate_listener += 1;
            let before = reconnects(buses);
            terminate(config, "pgbus listener").await;
            wait_reconnected(buses, &before).await;
        }
        Fault::TerminateWorkers => {
            faults.terminate_workers += 1;
            terminate(config, "pgbus worker").await;
        }
        Fault::RestartFast | Fault::RestartImmediate => {
            let mode = if fault == Fault::RestartFast {
                faults.restart_fast += 1;
                ShutdownMode::Fast
            } else {
                faults.restart_immediate += 1;
                ShutdownMode::Immediate
            };
            let before = reconnects(buses);
            let began = Instant::now();
            cluster.restart(mode).await.expect("restarting PostgreSQL");
            faults.downtime += began.elapsed();
            wait_reconnected(buses, &before).await;
        }
        Fault::KillConsumer => {
            faults.kill_consumer += 1;
            let victim = children.remove(fastrand::usize(..children.len()));
            let worker = victim.worker.lock().unwrap().clone().unwrap();
            signal(victim.pid(), "-9");
            faults.held_by_killed += held_by(config, &worker).await;
            let mut victim = victim;
            let _ = common::within("the killed consumer to exit", Duration::from_secs(20), {
                victim.child.wait()
            })
            .await;
            children.push(start_child(url, record).await);
        }
        Fault::PauseConsumer => {
            faults.pause_consumer += 1;
            let target = &children[fastrand::usize(..children.len())];
            let worker = target.worker.lock().unwrap().clone().unwrap();
            let before = record.lease_lost(&target.name);
            // Pause it while it holds deliveries (it usually does; if not, try again).
            let mut held = 0;
            for _ in 0..10 {
                signal(target.pid(), "-STOP");
                // Let statements it had already sent finish (a settlement it sent just
                // before the stop would otherwise complete what we count as held), then
                // see what it holds: the count must stay the same over three reads.
                held = settled_held_by(config, &worker).await;
                if held > 0 {
                    break;
                }
                signal(target.pid(), "-CONT");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            if held == 0 {
                signal(target.pid(), "-STOP");
            }
            faults.held_by_paused += held;
            // What it holds, to follow each of them through its resumption.
            let held_list = if held > 0 {
                held_list(config, &worker).await
            } else {
                Vec::new()
            };
            let held_set: Vec<_> = held_list
                .iter()
                .map(|(sub, id, attempt, _)| (sub.clone(), id.clone(), *attempt))
                .collect();
            // Its leases expire, the others' reapers return its deliveries and others
            // claim them: then every settlement it still has to send is stale.
            common::wait_for(
                "a paused consumer's deliveries to be taken over",
                Duration::from_secs(60),
                || async { held_by(config, &worker).await == 0 },
            )
            .await;
            signal(target.pid(), "-CONT");
            if held > 0 {
                let name = target.name.clone();
                // A settlement it sent just before the stop may still complete on the
                // server while it is stopped (one that waited for a lock, say): that
                // delivery was not taken over, and it reports it applied once resumed.
                // Every other held delivery comes back to it stale. So wait for a
                // rejection, or for its results on everything it held (a planned panic
                // reports none: that delivery's drop is a settlement too, unreported).
                let reportable: Vec<_> = held_list
                    .iter()
                    .filter(|(.., attempt, trouble)| !(*attempt == 1 && *trouble == PANIC_ONCE))
                    .map(|(sub, id, attempt, _)| (sub.clone(), id.clone(), *attempt))
                    .collect();
                let deadline = Instant::now() + Duration::from_secs(60);
                while record.lease_lost(&name) == before
                    && record.results_for(&name, &reportable).len() < reportable.len()
                {
                    assert!(
                        Instant::now() < deadline,
                        "timed out after 60s waiting for the resumed consumer's stale \
                         settlements to be rejected: it held {held_list:?} and reported {:?} \
                         for them; the deliveries now: {:?}",
                        record.results_for(&name, &held_set),
                        rows_of(config, &held_set).await,
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let applied = record
                    .results_for(&name, &held_set)
                    .iter()
                    .filter(|r| *r == "applied")
                    .count() as u64;
                faults.taken_from_paused += held.saturating_sub(applied);
                faults.stale_rejected_after_pause += record.lease_lost(&name) - before;
            }
        }
    }
}

/// Planned panics print nothing; any other panic prints as usual.
fn quiet_planned_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if !message.contains(PLANNED_PANIC) {
            default(info);
        }
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_loses_nothing() {
    quiet_planned_panics();
    // Collects the log lines of this process's buses.
    let logs = logs::LogBuffer::install("pgbus=info");

    let (events, window) = plan();
    let began = Instant::now();
    let (cluster, config) = common::private_cluster().await;
    let url = cluster.connection_string("postgres");
    let record = Arc::new(Record::default());

    // Consumers: a bus of handlers and a bus of streams in this process, and two
    // consumer processes.
    let mut builder = consumer_builder(config.clone());
    for (name, pattern) in SUBS {
        let record = record.clone();
        builder = builder.handler_fn_with(
            name,
            [pattern],
            SubscriptionOptions::new().retry(retry()),
            move |event: Event| {
                let record = record.clone();
                async move { record.handle(name, &event) }
            },
        );
    }
    let handlers = builder.build().unwrap().start().await.unwrap();
    let mut bus = consumer_builder(config.clone()).build().unwrap();
    let streams: Vec<Subscription> = SUBS
        .iter()
        .map(|(name, pattern)| bus.subscribe(name, [*pattern]).unwrap())
        .collect();
    let streams_bus = bus.start().await.unwrap();
    let emit: Arc<dyn Fn(Value) + Send + Sync> = {
        let record = record.clone();
        Arc::new(move |line: Value| record.take_line("streams", &line))
    };
    let stream_tasks: Vec<_> = streams
        .into_iter()
        .map(|s| tokio::spawn(consume_stream(s, Duration::ZERO, emit.clone())))
        .collect();
    let mut children = vec![
        start_child(&url, &record).await,
        start_child(&url, &record).await,
    ];
    wait_listening(&[&handlers, &streams_bus]).await;

    // Producers.
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let producers = 3;
    let publishing: Vec<_> = (0..producers)
        .map(|p| {
            let quota = events / producers + usize::from(p < events % producers);
            tokio::spawn(produce(p, config.clone(), quota, window, outcomes.clone()))
        })
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let done = done.clone();
        tokio::spawn(async move {
            for p in publishing {
                p.await.expect("a producer panicked");
            }
            done.store(true, Ordering::Release);
        })
    };

    // Faults, at random moments, until the producers are done: every kind once in each
    // round, in a random order; the immediate restart only in the first round.
    let mut faults = Faults::default();
    let mut round = 0;
    let fault_deadline = began + window + Duration::from_secs(60) * 2;
    while !done.load(Ordering::Acquire) {
        let mut kinds = vec![
            Fault::TerminateListener,
            Fault::TerminateWorkers,
            Fault::RestartFast,
            Fault::KillConsumer,
            Fault::PauseConsumer,
        ];
        if round == 0 {
            kinds.push(Fault::RestartImmediate);
        }
        fastrand::shuffle(&mut kinds);
        for fault in kinds {
            if done.load(Ordering::Acquire) && round > 0 {
                break;
            }
            let pause = Duration::from_millis(fastrand::u64(1_000..3_000));
            tokio::time::sleep(pause).await;
            inject(
                fault,
                &cluster,
                &config,
                &url,
                &[&handlers, &streams_bus],
                &mut children,
                &record,
                &mut faults,
            )
            .await;
        }
        round += 1;
        assert!(
            Instant::now() < fault_deadline,
            "the producers did not finish in time"
        );
    }
    watcher.await.unwrap();
    let published_at = began.elapsed();

    // Which uncertain commits made it: the log says.
    let client = connect(&config).await.expect("connecting");
    let in_log: HashSet<String> = client
        .query("SELECT id FROM pgbus.events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (committed, never) = {
        let o = outcomes.lock().unwrap();
        let mut committed = o.committed.clone();
        let mut never = o.rolled_back.clone();
        for id in &o.uncertain {
            if in_log.contains(id) {
                committed.insert(id.clone());
            } else {
                never.insert(id.clone());
            }
        }
        (committed, never)
    };
    for id in &never {
        assert!(!in_log.contains(id), "rolled-back event {id} is in the log");
    }
    assert_eq!(
        in_log.len(),
        committed.len(),
        "the log holds exactly the committed events"
    );

    // Everything is delivered and settled.
    let drain = Duration::from_secs(60) + window / 2;
    common::wait_for("every delivery to be settled", drain, || async {
        client
            .query_one("SELECT count(*) FROM pgbus.deliveries", &[])
            .await
            .map(|r| r.get::<_, i64>(0) == 0)
            .unwrap_or(false)
    })
    .await;
    let drained_at = began.elapsed();

    // Stop everything.
    for c in &mut children {
        drop(c.child.stdin.take());
    }
    for c in &mut children {
        let status = common::within(
            "a consumer process to shut down",
            Duration::from_secs(30),
            c.child.wait(),
        )
        .await
        .unwrap();
        assert!(status.success(), "{} exited with {status}", c.name);
    }
    let handler_stats = handlers.stats();
    let stream_stats = streams_bus.stats();
    handlers.shutdown().await.unwrap();
    streams_bus.shutdown().await.unwrap();
    for t in stream_tasks {
        t.await.unwrap();
    }
    let left: i64 = client
        .query_one("SELECT count(*) FROM pgbus.deliveries", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "deliveries left pending, processing or dead");

    // Every committed event reached every matching subscription; nothing else ran.
    let runs = record.runs.lock().unwrap().clone();
    let mut delivered: HashMap<(String, String), u32> = HashMap::new();
    let mut failed_runs = 0u64;
    for (consumer, sub, id, _attempt, ok) in &runs {
        assert!(
            !never.contains(id),
            "{consumer} ran {sub} for {id}, which never committed"
        );
        assert!(
            committed.contains(id),
            "{consumer} ran {sub} for unknown event {id}"
        );
        if *ok {
            *delivered.entry((sub.clone(), id.clone())).or_default() += 1;
        } else {
            failed_runs += 1;
        }
    }
    let names: HashMap<String, String> = client
        .query("SELECT id, event_name FROM pgbus.events", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut expected = 0u64;
    let mut lost = Vec::new();
    for id in &committed {
        for (sub, pattern) in SUBS {
            if pgbus::pattern_matches(pattern, &names[id]) {
                expected += 1;
                if !delivered.contains_key(&(sub.to_string(), id.clone())) {
                    lost.push(format!("{sub}/{id}"));
                }
            }
        }
    }
    let duplicates: u64 = delivered.values().map(|n| u64::from(n - 1)).sum();
    // The failure history, by kind of error.
    let mut history: Vec<(String, i64)> = client
        .query(
            "SELECT CASE WHEN error LIKE 'lease expired%' THEN 'lease expired' ELSE error END, \
                    count(*) FROM pgbus.delivery_failures GROUP BY 1 ORDER BY 2 DESC",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    history.sort();
    let leases_expired = history
        .iter()
        .find(|(e, _)| e == "lease expired")
        .map_or(0, |(_, n)| *n);
    let log_file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chaos-{}-bus.log", std::process::id()));
    let _ = std::fs::write(&log_file, logs.lines().join("\n"));

    // Recovery: each bus reconnected once per outage of its listener, and neither its
    // claims nor its log looped.
    let listener_outages =
        u64::from(faults.terminate_listener + faults.restart_fast + faults.restart_immediate);
    let outages = listener_outages + u64::from(faults.terminate_workers);
    let reconnect_lines = logs.count("pgbus listener reconnected");
    let claim_warnings = logs.count("pgbus claim failed; retrying");
    let warnings =
        logs.count(" WARN ") + logs.count(" ERROR ") - logs.count("pgbus handler panicked");
    let stale_reported = record.lease_lost_by(None);

    let o = outcomes.lock().unwrap();
    println!(
        "chaos: {} events committed, {} rolled back or failed ({} transactions, {} batches, \
         {} broken by faults, {} uncertain commits resolved by the log)",
        committed.len(),
        never.len(),
        o.transactions,
        o.batches,
        o.broken,
        o.uncertain.len()
    );
    println!(
        "chaos: faults: {} listener terminations, {} worker terminations, {} fast restarts, \
         {} immediate restarts ({:.1} s down), {} consumer kills (holding {} deliveries), \
         {} consumer pauses (holding {}, {} taken over; {} stale settlements rejected, {} in all); planned: \
         {} handler failures and panics",
        faults.terminate_listener,
        faults.terminate_workers,
        faults.restart_fast,
        faults.restart_immediate,
        faults.downtime.as_secs_f64(),
        faults.kill_consumer,
        faults.held_by_killed,
        faults.pause_consumer,
        faults.held_by_paused,
        faults.taken_from_paused,
        faults.stale_rejected_after_pause,
        stale_reported,
        failed_runs
    );
    println!(
        "chaos: {} deliveries expected, {} delivered, {} duplicates, {} lost, 0 dead, \
         {} leases expired; published in {:.1} s, drained at {:.1} s",
        expected,
        delivered.len(),
        duplicates,
        lost.len(),
        leases_expired,
        published_at.as_secs_f64(),
        drained_at.as_secs_f64()
    );
    for (name, s) in [("handlers", handler_stats), ("streams", stream_stats)] {
        println!(
            "chaos: bus {name}: reconnects {}, claim errors {}, settle errors {}, stale rejected {}, \
             reaped {}, delivered {}, failed {}",
            s.reconnects,
            s.claim_errors,
            s.settle_errors,
            s.stale_rejected,
            s.reaped,
            s.delivered,
            s.failed
        );
    }
    println!("chaos: failure history: {history:?}");
    println!(
        "chaos: log ({}): {reconnect_lines} reconnect lines, {claim_warnings} claim warnings, \
         {warnings} other warnings and errors",
        log_file.display()
    );
    assert!(lost.is_empty(), "lost deliveries: {lost:?}");
    assert_eq!(faults.restart_immediate, 1);
    assert!(faults.kill_consumer >= 1 && faults.pause_consumer >= 1);
    assert!(
        faults.taken_from_paused == 0 || faults.stale_rejected_after_pause > 0,
        "a paused consumer's stale settlements were not rejected"
    );
    for (name, s) in [("handlers", handler_stats), ("streams", stream_stats)] {
        assert!(
            s.reconnects >= listener_outages && s.reconnects <= 2 * listener_outages,
            "bus {name} reconnected {} times for {listener_outages} listener outages",
            s.reconnects
        );
        // A restart keeps the claimer failing while the server is down; it backs off
        // (50 ms doubling, capped at the poll interval), so a few per outage.
        let budget = 10 * outages + (faults.downtime.as_millis() as u64 / 25);
        assert!(
            s.claim_errors <= budget,
            "bus {name}: {} claim errors for {outages} outages (budget {budget}): a tight loop",
            s.claim_errors
        );
        assert_eq!(s.settle_errors, 0, "bus {name} gave up on settlements");
    }
    assert_eq!(
        reconnect_lines as u64,
        handler_stats.reconnects + stream_stats.reconnects,
        "one log line per reconnect"
    );
    assert!(
        warnings as u64 <= 2 * 4 * outages,
        "{warnings} warnings for {outages} outages: the log loops"
    );
    assert!(
        claim_warnings as u64 <= 2 * outages,
        "{claim_warnings} claim warnings for {outages} outages: an outage is logged once"
    );
}
