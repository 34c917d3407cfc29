//! `memory`: the peak resident memory (`VmHWM`) of a consumer process draining a
//! backlog, for a small and a large backlog: it should be flat, not proportional to the
//! backlog. The consumer runs as a child process (`pgbus bench memory --child`) so that
//! nothing else of the benchmark counts; outside the `pgbus` binary it runs in-process.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{BenchArgs, Report, Runs, Server, seed_backlog};
use pgbus::{Error, Result};

const DEFAULT_BACKLOGS: [u64; 2] = [20_000, 1_000_000];
const SUBSCRIPTION: &str = "bench-memory";
const EVENT: &str = "bench.memory";

/// `VmHWM` and `VmRSS` of this process, in kB, from `/proc/self/status`.
fn vm() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// The consumer: drains the backlog of the database it is given and reports its peak RSS.
async fn consume(config: pgbus::ConnectConfig, backlog: u64, args: &BenchArgs) -> Result<Value> {
    let (hwm_before, rss_before) = vm();
    let started = Instant::now();
    let running = super::bus(&config, args)
        .handler_fn(SUBSCRIPTION, [EVENT], |_event| async { Ok(()) })
        .build()?
        .start()
        .await?;
    let deadline = Duration::from_secs(600) + Duration::from_millis(backlog);
    while running.stats().delivered < backlog {
        if started.elapsed() > deadline {
            return Err(Error::Timeout("draining the memory backlog"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    running.shutdown().await?;
    let (hwm_after, rss_after) = vm();
    Ok(json!({
        "hwm_before_kb": hwm_before,
        "rss_before_kb": rss_before,
        "hwm_after_kb": hwm_after,
        "rss_after_kb": rss_after,
        "seconds": seconds,
    }))
}

/// The child side of `pgbus bench memory`: drains `--backlog` deliveries of
/// `bench-memory` in `database_url` and prints its figures as one JSON line.
pub(super) async fn run_child(args: &BenchArgs, database_url: Option<&str>) -> Result<()> {
    let url = database_url.ok_or_else(|| super::invalid("database url", "not given"))?;
    let config = pgbus::ConnectConfig::parse(url)
        .map_err(|e| super::invalid("database url", format!("{e}")))?;
    let backlog = args
        .knobs
        .backlog
        .first()
        .copied()
        .unwrap_or(DEFAULT_BACKLOGS[0]);
    println!("{}", consume(config, backlog, args).await?);
    Ok(())
}

/// Whether this process is the `pgbus` binary, which can run the consumer as a child.
fn child_exe() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    (exe.file_name()? == "pgbus").then_some(exe)
}

async fn once(server: &Server, backlog: u64, args: &BenchArgs) -> Result<(Value, bool)> {
    let db = server.fresh_database("memory").await?;
    let result = async {
        let client = db.connect().await?;
        seed_backlog(&client, &[SUBSCRIPTION.to_string()], EVENT, backlog).await?;
        match child_exe() {
            Some(exe) => {
                let output = tokio::process::Command::new(exe)
                    .args([
                        "bench",
                        "memory",
                        "--child",
                        "--backlog",
                        &backlog.to_string(),
                        "--concurrency",
                        &args.knobs.concurrency.to_string(),
                        "--bus-synchronous-commit",
                        if args.bus_synchronous_commit {
                            "on"
                        } else {
                            "off"
                        },
                    ])
                    .env("DATABASE_URL", db.conninfo())
                    .kill_on_drop(true)
                    .output()
                    .await
                    .map_err(|e| super::invalid("memory child", e.to_string()))?;
                if !output.status.success() {
                    return Err(super::invalid(
                        "memory child",
                        String::from_utf8_lossy(&output.stderr).into_owned(),
                    ));
                }
                let line = String::from_utf8_lossy(&output.stdout);
                let value: Value = serde_json::from_str(line.trim())
                    .map_err(|e| super::invalid("memory child output", e.to_string()))?;
                Ok((value, true))
            }
            None => Ok((consume(db.config.clone(), backlog, args).await?, false)),
        }
    }
    .await;
    db.drop_database().await?;
    result
}

pub(super) async fn run(server: &Server, args: &BenchArgs) -> Result<Report> {
    let backlogs = if args.knobs.backlog.is_empty() {
        DEFAULT_BACKLOGS.to_vec()
    } else {
        args.knobs.backlog.clone()
    };
    let mut cases = Vec::new();
    let mut text = String::new();
    let mut child = true;
    for &backlog in &backlogs {
        let mut runs = Runs::default();
        for _ in 0..args.runs {
            let (v, as_child) = once(server, backlog, args).await?;
            child &= as_child;
            let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            runs.push("peak_rss_mib", f("hwm_after_kb") / 1024.0);
            runs.push("rss_at_start_mib", f("rss_before_kb") / 1024.0);
            runs.push(
                "peak_growth_mib",
                (f("hwm_after_kb") - f("hwm_before_kb")) / 1024.0,
            );
            runs.push("events_per_s", backlog as f64 / f("seconds"));
        }
        let mut case = runs.json("");
        case.insert("backlog".into(), json!(backlog));
        text.push_str(&format!(
            "backlog {backlog}: peak RSS {} MiB (at start {} MiB; grew {} MiB while draining at {} events/s)\n",
            runs.show("peak_rss_mib"),
            runs.show("rss_at_start_mib"),
            runs.show("peak_growth_mib"),
            runs.show("events_per_s"),
        ));
        cases.push(case);
    }
    text.push_str(if child {
        "(measured in a child process: `pgbus bench memory --child`)\n"
    } else {
        "(measured in this process: its VmHWM includes everything before the drain)\n"
    });
    let last = cases.len().saturating_sub(1);
    let mut report = Report::of_cases(cases, last, text);
    report.json["child_process"] = json!(child);
    Ok(report)
}
