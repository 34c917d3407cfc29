//! Publishing, timed per transaction (`BEGIN`, the call, `COMMIT`) on a durable server:
//! `publish` of one event, and `publish_batch` (arrays + `unnest`) against binary COPY
//! into a temporary table at 10, 100 and 1,000 events.
//!
//! `cargo bench --bench publish`; uses `DATABASE_URL`, or a throwaway durable cluster.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pgbus::Event;
use pgbus_testkit::bench::{BenchDb, Server, sample_events};
use tokio::runtime::Runtime;

/// What one timed call publishes with.
#[derive(Debug, Clone, Copy)]
enum Method {
    Publish,
    Unnest,
    Copy,
}

async fn one_tx(client: &mut tokio_postgres::Client, method: Method, events: &[Event]) -> Duration {
    let started = Instant::now();
    let tx = client.transaction().await.expect("begin");
    match method {
        Method::Publish => {
            pgbus::publish(&tx, &events[0]).await.expect("publish");
        }
        Method::Unnest => {
            pgbus::publish_batch(&tx, events)
                .await
                .expect("publish_batch");
        }
        Method::Copy => {
            pgbus_testkit::bench::publish_by_copy(&tx, events)
                .await
                .expect("publish by copy");
        }
    }
    tx.commit().await.expect("commit");
    started.elapsed()
}

fn publishing(c: &mut Criterion) {
    let rt = Runtime::new().expect("runtime");
    let url = std::env::var("DATABASE_URL").ok();
    let server = rt.block_on(Server::start(url.as_deref())).expect("server");
    let db: BenchDb = rt
        .block_on(server.fresh_database("criterion_publish"))
        .expect("database");
    let mut client = rt.block_on(db.connect()).expect("connect");
    rt.block_on(async {
        pgbus::admin::register_subscription(&client, "bench-batch", &["bench.*"], 25).await?;
        pgbus_testkit::bench::prepare_copy(&client).await
    })
    .expect("setup");
    let mut next = 0u64;

    let mut group = c.benchmark_group("publish");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let mut cases = vec![(Method::Publish, 1usize)];
    for size in [10, 100, 1000] {
        cases.push((Method::Unnest, size));
        cases.push((Method::Copy, size));
    }
    for (method, size) in cases {
        group.throughput(Throughput::Elements(size as u64));
        let name = match method {
            Method::Publish => "publish",
            Method::Unnest => "publish_batch_unnest",
            Method::Copy => "copy_then_insert",
        };
        group.bench_with_input(BenchmarkId::new(name, size), &size, |b, &size| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let events = sample_events(size, next);
                        next += size as u64;
                        total += one_tx(&mut client, method, &events).await;
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

criterion_group!(benches, publishing);
criterion_main!(benches);
