//! Delivery, on a durable server: the claim statement's cost with no, a small and a large
//! backlog; commit-to-handler latency of an idle bus (the clock starts when the
//! producer's COMMIT returns) beside the raw LISTEN/NOTIFY round trip; and the time to
//! drain a burst of 2,000 events with no-op handlers.
//!
//! `cargo bench --bench delivery`; uses `DATABASE_URL`, or a throwaway durable cluster.
//! `PGBUS_BENCH_BACKLOG` sets the large backlog (default 1,000,000; seeding it takes a
//! minute or two; 2,000 when `cargo test --all-targets` runs the benches once).

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;
use pgbus::{Bus, Event};
use pgbus_testkit::bench::{Server, seed_backlog};
use tokio::runtime::Runtime;
use tokio_postgres::AsyncMessage;

const DEFAULT_LARGE_BACKLOG: u64 = 1_000_000;
const BURST: u64 = 2_000;

/// The large backlog. `cargo bench` passes `--bench`; without it (`cargo test
/// --all-targets` runs every bench once, as a smoke test) it stays small.
fn large_backlog() -> u64 {
    if !std::env::args().any(|a| a == "--bench") {
        return 2_000;
    }
    std::env::var("PGBUS_BENCH_BACKLOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_LARGE_BACKLOG)
}

fn server(rt: &Runtime) -> Server {
    let url = std::env::var("DATABASE_URL").ok();
    rt.block_on(Server::start(url.as_deref())).expect("server")
}

/// The CLAIM statement for one subscription, 100 at most, in a transaction rolled back
/// afterwards so that the backlog stays as it is. Only the statement is timed.
fn claim(c: &mut Criterion) {
    let rt = Runtime::new().expect("runtime");
    let server = server(&rt);
    let db = rt
        .block_on(server.fresh_database("criterion_claim"))
        .expect("database");
    let mut client = rt.block_on(db.connect()).expect("connect");
    let large = large_backlog();
    rt.block_on(async {
        pgbus::admin::register_subscription(&client, "bench-empty", &["bench.none"], 25).await?;
        seed_backlog(&client, &["bench-small".into()], "bench.small", 1_000).await?;
        seed_backlog(&client, &["bench-large".into()], "bench.large", large).await
    })
    .expect("seed");
    let claim = rt
        .block_on(pgbus_testkit::claim_statement(&client))
        .expect("read the claim statement");
    let stmt = rt
        .block_on(client.prepare_typed(&claim, &pgbus_testkit::sql::CLAIM_TYPES))
        .expect("prepare the claim statement");

    let mut group = c.benchmark_group("claim_100");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (name, pending) in [
        ("bench-empty", 0u64),
        ("bench-small", 1_000),
        ("bench-large", large),
    ] {
        group.bench_with_input(BenchmarkId::new("pending", pending), &name, |b, &name| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let tx = client.transaction().await.expect("begin");
                        let started = Instant::now();
                        let rows = tx
                            .query(
                                &stmt,
                                &[
                                    &vec![name],
                                    &vec![100i32],
                                    &100i32,
                                    &60_000i64,
                                    &"bench-worker",
                                    &i32::MAX,
                                    &(pgbus::DEFAULT_CLAIM_BYTES as i64),
                                    &Vec::<Option<chrono::DateTime<chrono::Utc>>>::new(),
                                ],
                            )
                            .await
                            .expect("claim");
                        total += started.elapsed();
                        assert!(!rows.is_empty());
                        tx.rollback().await.expect("rollback");
                    }
                    total
                })
            })
        });
    }
    group.finish();
    drop(client);
    rt.block_on(db.drop_database()).expect("drop database");
}

/// Commit-to-handler latency of an idle bus, with the bus's own transactions at
/// `synchronous_commit` on and off, and the raw NOTIFY round trip.
fn latency(c: &mut Criterion) {
    let rt = Runtime::new().expect("runtime");
    let server = server(&rt);
    let db = rt
        .block_on(server.fresh_database("criterion_latency"))
        .expect("database");
    let mut group = c.benchmark_group("commit_to_handler");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));

    for sync in [true, false] {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
        let running = rt
            .block_on(async {
                Bus::builder(db.config.clone())
                    .synchronous_commit(sync)
                    .handler_fn("bench-latency", ["bench.latency"], move |_event| {
                        let _ = tx.send(Instant::now());
                        async { Ok(()) }
                    })
                    .build()?
                    .start()
                    .await
            })
            .expect("bus");
        let mut client = rt.block_on(db.connect()).expect("connect");
        let id = if sync {
            "bus_synchronous_commit_on"
        } else {
            "bus_synchronous_commit_off"
        };
        group.bench_function(id, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for i in 0..iters {
                        let event = Event::new("bench.latency", serde_json::json!({"i": i}));
                        let tx = client.transaction().await.expect("begin");
                        pgbus::publish(&tx, &event).await.expect("publish");
                        tx.commit().await.expect("commit");
                        let committed = Instant::now();
                        let started = rx.recv().await.expect("handler ran");
                        total += started.saturating_duration_since(committed);
                        // Let the acknowledgement finish: the bus is idle again.
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    total
                })
            })
        });
        rt.block_on(running.shutdown()).expect("shutdown");
    }

    // The floor: a bare NOTIFY committed on one connection, arriving on another.
    let (listener, mut messages) = rt
        .block_on(db.config.connect_with_messages())
        .expect("listen");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let reader = rt.spawn(async move {
        while let Some(Ok(m)) = messages.next().await {
            if let AsyncMessage::Notification(_) = m {
                let _ = tx.send(Instant::now());
            }
        }
    });
    rt.block_on(listener.batch_execute("LISTEN pgbus_bench_floor"))
        .expect("LISTEN");
    let producer = rt.block_on(db.connect()).expect("connect");
    group.bench_function("notify_floor", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    producer
                        .batch_execute("BEGIN; NOTIFY pgbus_bench_floor; COMMIT")
                        .await
                        .expect("notify");
                    let committed = Instant::now();
                    let arrived = rx.recv().await.expect("notification");
                    total += arrived.saturating_duration_since(committed);
                }
                total
            })
        })
    });
    group.finish();
    reader.abort();
    drop((listener, producer));
    rt.block_on(db.drop_database()).expect("drop database");
}

/// A burst of 2,000 events committed at once, drained by a running bus with no-op
/// handlers and concurrency 8: from the burst's COMMIT to its last acknowledgement.
fn drain(c: &mut Criterion) {
    let rt = Runtime::new().expect("runtime");
    let server = server(&rt);
    let db = rt
        .block_on(server.fresh_database("criterion_drain"))
        .expect("database");
    let running = rt
        .block_on(async {
            Bus::builder(db.config.clone())
                .concurrency(8)
                .handler_fn("bench-drain", ["bench.drain"], |_event| async { Ok(()) })
                .build()?
                .start()
                .await
        })
        .expect("bus");
    let client = rt.block_on(db.connect()).expect("connect");
    let mut group = c.benchmark_group("drain");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Elements(BURST));
    group.bench_function(BenchmarkId::new("burst_concurrency_8", BURST), |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let target = running.stats().delivered + BURST;
                    client
                        .execute(
                            "INSERT INTO pgbus.events (event_name, payload) \
                             SELECT 'bench.drain', jsonb_build_object('i', g) \
                             FROM generate_series(1, $1::int8) AS g",
                            &[&(BURST as i64)],
                        )
                        .await
                        .expect("seed");
                    let committed = Instant::now();
                    while running.stats().delivered < target {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    total += committed.elapsed();
                }
                total
            })
        })
    });
    group.finish();
    rt.block_on(running.shutdown()).expect("shutdown");
    drop(client);
    rt.block_on(db.drop_database()).expect("drop database");
}

criterion_group!(benches, claim, latency, drain);
criterion_main!(benches);
