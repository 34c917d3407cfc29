//! `publish`: events per second committed by concurrent publishers, by batch size and
//! consumer state, against the floor: the same rows inserted into a plain table of the
//! same columns with an identity primary key and a unique text id (an outbox table an
//! application would write itself: no triggers, no other constraint or index). Every
//! transaction is `BEGIN`, one statement, `COMMIT`, for pgbus and the floor alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use tokio_postgres::Client;
use tokio_postgres::types::Type;

use super::{BenchArgs, BenchDb, PublishState, Report, Runs, Server, Target, round};
use pgbus::Event;
use pgbus::Result;

/// Default measured seconds per cell.
const DEFAULT_SECONDS: f64 = 1.0;
/// Publishing before the measurement starts, per cell.
const WARMUP: Duration = Duration::from_millis(300);

/// The floor's table: `pgbus.events`' columns, an identity primary key and a unique id.
const PLAIN_TABLE: &str = "CREATE TABLE public.bench_plain (\
     seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, id text NOT NULL UNIQUE, \
     event_name text NOT NULL, event_version integer NOT NULL DEFAULT 1, source text, \
     aggregate_type text, aggregate_id text, correlation_id text, causation_id text, \
     occurred_at timestamptz NOT NULL DEFAULT now(), payload jsonb NOT NULL DEFAULT '{}', \
     headers jsonb NOT NULL DEFAULT '{}', available_at timestamptz NOT NULL DEFAULT now(), \
     created_at timestamptz NOT NULL DEFAULT now(), ordering_key text)";
const PLAIN_ONE: &str = "INSERT INTO public.bench_plain (id, event_name, aggregate_type, aggregate_id, payload) \
     VALUES ($1, $2, $3, $4, $5)";
const PLAIN_BATCH: &str = "INSERT INTO public.bench_plain (id, event_name, aggregate_type, aggregate_id, payload) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[])";

/// `pgbus.publish()` from SQL, one event (a prepared statement; the floor's parameters).
const SQL_ONE: &str = "SELECT pgbus.publish(event_name => $2, payload => $5, id => $1, \
     aggregate_type => $3, aggregate_id => $4)";
/// `pgbus.publish()` from SQL, once per event of a batch, in one statement (the floor's
/// parameters).
const SQL_BATCH: &str = "SELECT pgbus.publish(event_name => u.n, payload => u.p, id => u.i, \
     aggregate_type => u.t, aggregate_id => u.a) \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[]) AS u(i, n, t, a, p)";

/// A raw INSERT into the log, one event (a prepared statement; the floor's parameters).
const RAW_ONE: &str = "INSERT INTO pgbus.events (id, event_name, aggregate_type, aggregate_id, payload) \
     VALUES ($1, $2, $3, $4, $5)";
/// A raw multi-row INSERT into the log.
const RAW_BATCH: &str = "INSERT INTO pgbus.events (id, event_name, aggregate_type, aggregate_id, payload) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[])";

/// What a cell publishes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `pgbus::publish` / `pgbus::publish_batch`.
    Pgbus,
    /// The SQL function `pgbus.publish()` (prepared statements).
    Sql,
    /// Plain INSERT into `bench_plain` (prepared statements).
    Plain,
    /// Plain INSERT into `pgbus.events` (prepared statements).
    Raw,
}

fn events(batch: usize, next: &AtomicU64) -> Vec<Event> {
    (0..batch)
        .map(|_| {
            let k = next.fetch_add(1, Ordering::Relaxed);
            Event::new(
                "bench.publish",
                json!({"order_id": k, "amount": 4200, "currency": "EUR", "lines": 3}),
            )
            .aggregate("order", k.to_string())
        })
        .collect()
}

/// Publishes until `stop`, counting committed events.
async fn publisher(
    mut client: Client,
    kind: Kind,
    batch: usize,
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicU64>,
    next: Arc<AtomicU64>,
) -> Result<Client> {
    let (one, many) = match kind {
        Kind::Sql => (SQL_ONE, SQL_BATCH),
        Kind::Raw => (RAW_ONE, RAW_BATCH),
        _ => (PLAIN_ONE, PLAIN_BATCH),
    };
    let one = client
        .prepare_typed(
            one,
            &[Type::TEXT, Type::TEXT, Type::TEXT, Type::TEXT, Type::JSONB],
        )
        .await?;
    let many = client.prepare(many).await?;
    while !stop.load(Ordering::Relaxed) {
        let evs = events(batch, &next);
        let tx = client.transaction().await?;
        match (kind, batch) {
            (Kind::Pgbus, 1) => {
                pgbus::publish(&tx, &evs[0]).await?;
            }
            (Kind::Pgbus, _) => {
                pgbus::publish_batch(&tx, &evs).await?;
            }
            (Kind::Plain | Kind::Sql | Kind::Raw, 1) => {
                let e = &evs[0];
                tx.execute(
                    &one,
                    &[
                        &e.id,
                        &e.name,
                        &e.aggregate_type,
                        &e.aggregate_id,
                        &e.payload,
                    ],
                )
                .await?;
            }
            (Kind::Plain | Kind::Sql | Kind::Raw, _) => {
                let ids: Vec<&str> = evs.iter().map(|e| e.id.as_str()).collect();
                let names: Vec<&str> = evs.iter().map(|e| e.name.as_str()).collect();
                let types: Vec<Option<&str>> =
                    evs.iter().map(|e| e.aggregate_type.as_deref()).collect();
                let agg: Vec<Option<&str>> =
                    evs.iter().map(|e| e.aggregate_id.as_deref()).collect();
                let payloads: Vec<&Value> = evs.iter().map(|e| &e.payload).collect();
                tx.execute(&many, &[&ids, &names, &types, &agg, &payloads])
                    .await?;
            }
        }
        tx.commit().await?;
        committed.fetch_add(batch as u64, Ordering::Relaxed);
    }
    Ok(client)
}

/// A connection that LISTENs and reads every notification, as a sleeping bus does.
struct Listener {
    _client: Client,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sets the database up for `state` (`None`: the floor). Returns what must live while
/// the cell runs: a listener for `asleep`, a bus for `live`.
async fn enter_state(
    db: &BenchDb,
    admin: &Client,
    state: Option<PublishState>,
    args: &BenchArgs,
) -> Result<(Option<Listener>, Option<pgbus::RunningBus>)> {
    admin
        .batch_execute(
            "TRUNCATE pgbus.events, pgbus.deliveries, public.bench_plain; \
             DELETE FROM pgbus.consumers; \
             ALTER TABLE pgbus.events ENABLE TRIGGER events_notify",
        )
        .await?;
    let _ = admin.batch_execute("CHECKPOINT").await;
    let mut listener = None;
    let mut bus = None;
    match state {
        None | Some(PublishState::None) => {}
        Some(PublishState::Off) => {
            admin
                .batch_execute("ALTER TABLE pgbus.events DISABLE TRIGGER events_notify")
                .await?;
        }
        Some(PublishState::Asleep | PublishState::Busy | PublishState::Sql | PublishState::Raw) => {
            let awake = state != Some(PublishState::Asleep);
            admin
                .execute(
                    "INSERT INTO pgbus.consumers (id, awake, expires_at, info) \
                     VALUES ('bench-consumer', $1, now() + interval '1 hour', 'pgbus bench')",
                    &[&awake],
                )
                .await?;
            if !awake {
                // A sleeping consumer LISTENs: each notification signals its backend.
                let (client, mut messages) = db.config.connect_with_messages().await?;
                let task =
                    tokio::spawn(async move { while let Some(Ok(_)) = messages.next().await {} });
                client.batch_execute("LISTEN pgbus").await?;
                listener = Some(Listener {
                    _client: client,
                    task,
                });
            }
        }
        Some(PublishState::Live) => {
            let running = super::bus(&db.config, args)
                .handler_fn("bench-publish", ["bench.*"], |_event| async { Ok(()) })
                .build()?
                .start()
                .await?;
            bus = Some(running);
        }
    }
    Ok((listener, bus))
}

/// One cell: returns events per second.
#[allow(clippy::too_many_arguments)]
async fn cell(
    db: &BenchDb,
    admin: &Client,
    clients: &mut Vec<Client>,
    state: Option<PublishState>,
    batch: usize,
    publishers: usize,
    seconds: f64,
    args: &BenchArgs,
) -> Result<f64> {
    let (listener, bus) = enter_state(db, admin, state, args).await?;
    let kind = match state {
        None => Kind::Plain,
        Some(PublishState::Sql) => Kind::Sql,
        Some(PublishState::Raw) => Kind::Raw,
        Some(_) => Kind::Pgbus,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..publishers {
        let client = clients.pop().expect("enough publisher connections");
        tasks.push(tokio::spawn(publisher(
            client,
            kind,
            batch,
            stop.clone(),
            committed.clone(),
            next.clone(),
        )));
    }
    tokio::time::sleep(WARMUP).await;
    let c0 = committed.load(Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let c1 = committed.load(Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut first_error = None;
    for task in tasks {
        match task.await {
            Ok(Ok(client)) => clients.push(client),
            Ok(Err(e)) => first_error = first_error.or(Some(e)),
            Err(e) => panic!("a publisher panicked: {e}"),
        }
    }
    if let Some(bus) = bus {
        bus.shutdown().await?;
    }
    drop(listener);
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok((c1 - c0) as f64 / elapsed)
}

fn key(state: Option<PublishState>, batch: usize, publishers: usize) -> String {
    format!(
        "{}/{batch}/{publishers}",
        state.map_or("insert", PublishState::name)
    )
}

pub(super) async fn run(server: &Server, args: &BenchArgs) -> Result<Report> {
    let seconds = args.knobs.seconds.unwrap_or(DEFAULT_SECONDS);
    let max_publishers = args.knobs.publishers.iter().copied().max().unwrap_or(1);
    let mut states: Vec<Option<PublishState>> = vec![None];
    states.extend(args.knobs.states.iter().copied().map(Some));
    let mut runs = Runs::default();
    for _ in 0..args.runs {
        let db = server.fresh_database("publish").await?;
        let result = async {
            let admin = db.connect().await?;
            admin.batch_execute(PLAIN_TABLE).await?;
            pgbus::admin::register_subscription(&admin, "bench-publish", &["bench.*"], 25).await?;
            if args.knobs.subscriptions > 1 {
                admin
                    .execute(
                        "INSERT INTO pgbus.subscriptions (name, patterns) \
                         SELECT 'bench-other-' || i, ARRAY['other' || i || '.*'] \
                         FROM generate_series(2, $1) AS i",
                        &[&(args.knobs.subscriptions as i32)],
                    )
                    .await?;
            }
            let mut clients = Vec::new();
            for _ in 0..max_publishers {
                clients.push(db.connect().await?);
            }
            for &batch in &args.knobs.batch {
                for &publishers in &args.knobs.publishers {
                    for &state in &states {
                        let rate = cell(
                            &db,
                            &admin,
                            &mut clients,
                            state,
                            batch,
                            publishers,
                            seconds,
                            args,
                        )
                        .await?;
                        runs.push(&key(state, batch, publishers), rate);
                    }
                }
            }
            Ok::<_, pgbus::Error>(())
        }
        .await;
        db.drop_database().await?;
        result?;
    }

    let rate = |state, batch, publishers| runs.median(&key(state, batch, publishers));
    let mut cases = Vec::new();
    let mut text = format!(
        "events/s committed ({seconds} s per cell after {} ms warm-up; BEGIN, one statement, COMMIT); \
         in brackets: the ratio to the plain INSERT floor\n",
        WARMUP.as_millis()
    );
    for &batch in &args.knobs.batch {
        text.push_str(&format!("\nbatch {batch}:\n  publishers"));
        for state in &states {
            text.push_str(&format!(
                " | {:>16}",
                state.map_or("plain INSERT", |s| s.name())
            ));
        }
        text.push('\n');
        for &publishers in &args.knobs.publishers {
            let floor = rate(None, batch, publishers);
            text.push_str(&format!("  {publishers:>10}"));
            for &state in &states {
                let r = rate(state, batch, publishers);
                let ratio = r / floor;
                if state.is_some() {
                    text.push_str(&format!(" | {:>9} ({:.2})", round(r), ratio));
                } else {
                    text.push_str(&format!(" | {:>16}", round(r)));
                }
                let name = key(state, batch, publishers);
                cases.push(json!({
                    "state": state.map_or("insert", |s| s.name()),
                    "batch": batch,
                    "publishers": publishers,
                    "events_per_s": round(r),
                    "events_per_s_runs": runs.all(&name),
                    "commits_per_s": round(r / batch as f64),
                    "ratio_to_floor": round(ratio),
                }));
            }
            text.push('\n');
        }
    }

    // The targets, where the grid has the cells they need.
    let busy = Some(PublishState::Busy);
    let sql = Some(PublishState::Sql);
    let raw = Some(PublishState::Raw);
    let mut targets = Vec::new();
    let mut target = |name, value: f64, goal, what: &str| {
        if value.is_finite() {
            targets.push(Target::at_least(name, value, goal, what));
        }
    };
    target(
        "busy_16_vs_insert",
        rate(busy, 1, 16) / rate(None, 1, 16),
        0.6,
        "16 single-event publishers through pgbus::publish, consumer busy / plain INSERT",
    );
    target(
        "sql_16_vs_insert",
        rate(sql, 1, 16) / rate(None, 1, 16),
        0.6,
        "16 single-event publishers through pgbus.publish(), consumer busy / plain INSERT",
    );
    target(
        "raw_16_vs_insert",
        rate(raw, 1, 16) / rate(None, 1, 16),
        0.6,
        "16 single-event publishers through a raw INSERT into pgbus.events, consumer busy / plain INSERT",
    );
    target(
        "busy_1_vs_insert",
        rate(busy, 1, 1) / rate(None, 1, 1),
        0.6,
        "1 single-event publisher through pgbus::publish, consumer busy / plain INSERT",
    );
    target(
        "sql_1_vs_insert",
        rate(sql, 1, 1) / rate(None, 1, 1),
        0.6,
        "1 single-event publisher through pgbus.publish(), consumer busy / plain INSERT",
    );
    target(
        "batch_1000_vs_insert",
        rate(busy, 1000, 1) / rate(None, 1000, 1),
        0.7,
        "publish_batch(1000), 1 publisher, consumer busy / plain INSERT of the same rows",
    );
    target(
        "busy_16_vs_off",
        rate(busy, 1, 16) / rate(Some(PublishState::Off), 1, 16),
        0.9,
        "16 single-event publishers, consumer busy / notify trigger disabled",
    );
    target(
        "busy_16_vs_asleep",
        rate(busy, 1, 16) / rate(Some(PublishState::Asleep), 1, 16),
        2.5,
        "16 single-event publishers, consumer busy / consumer asleep (every commit notifies)",
    );

    let headline_pub = if args.knobs.publishers.contains(&16) {
        16
    } else {
        max_publishers
    };
    let headline_batch = args.knobs.batch.first().copied().unwrap_or(1);
    let headline_state = if args.knobs.states.contains(&PublishState::Busy) {
        busy
    } else {
        args.knobs.states.first().copied()
    };
    let mut object = serde_json::Map::new();
    let headline = key(headline_state, headline_batch, headline_pub);
    object.insert(
        "headline".into(),
        json!(format!(
            "state {}, batch {headline_batch}, {headline_pub} publishers",
            headline_state.map_or("insert", |s| s.name())
        )),
    );
    object.insert("events_per_s".into(), json!(round(runs.median(&headline))));
    object.insert("events_per_s_runs".into(), json!(runs.all(&headline)));
    let floor_key = key(None, headline_batch, headline_pub);
    object.insert(
        "floor".into(),
        json!({
            "what": "plain INSERT into a table of pgbus.events' columns (identity primary key, unique id)",
            "events_per_s": round(runs.median(&floor_key)),
            "events_per_s_runs": runs.all(&floor_key),
        }),
    );
    object.insert("seconds_per_cell".into(), json!(seconds));
    object.insert("cases".into(), json!(cases));
    Ok(Report {
        json: object.into(),
        text,
        targets,
    })
}
