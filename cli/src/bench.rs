//! The workloads of `pgbus bench`.
//!
//! Each workload runs against the server `--database-url` names on the command line (never
//! `DATABASE_URL` from the environment) or, when none is given, a throwaway cluster
//! with PostgreSQL's durable defaults (fsync on, synchronous_commit on), in a database of
//! its own created for each run (`CREATE DATABASE` + [`pgbus::migrate`]) and dropped after
//! it, so runs never see each other's rows ([`pgbus_testkit::bench`], which the criterion
//! benches in the library's `benches/` share).
//!
//! | workload | what it measures |
//! | --- | --- |
//! | `latency` | idle bus: commit returned → handler started, and the raw LISTEN/NOTIFY floor |
//! | `throughput` | draining a backlog with no-op handlers, with one and four subscriptions |
//! | `publish` | publish rate by batch size, publishers and consumer state, against plain INSERT |
//! | `mixed` | latency while producers run at a fixed offered rate |
//! | `memory` | peak RSS of a consumer draining a backlog |
//! | `batch` | `publish_batch` (unnest) against binary COPY, and the cost of one call |
//! | `forward` | `pgbus forward` into NATS JetStream: a backlog's rate, and commit → PubAck at idle (not in `all`: it needs `nats-server`) |
//!
//! Latencies come from an HDR histogram (microsecond resolution) and are reported in
//! milliseconds; rates in events per second. Every figure is the median of `--runs` runs,
//! with the runs' values beside it.

use std::time::{Duration, Instant};

use pgbus::Result;
use serde_json::{Value, json};

mod batch;
mod forward;
mod latency;
mod memory;
mod mixed;
mod publish;
mod throughput;

use pgbus_testkit::bench::{
    BenchDb, Server, prepare_copy, publish_by_copy, sample_events, seed_backlog, seed_keyed_backlog,
};

/// An [`Error::Invalid`](pgbus::Error::Invalid) about `what`.
fn invalid(what: &'static str, reason: impl ToString) -> pgbus::Error {
    pgbus::Error::Invalid {
        what,
        reason: reason.to_string(),
    }
}

/// The workloads of `pgbus bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[non_exhaustive]
pub(crate) enum Workload {
    /// Idle bus: commit-to-handler latency, and the raw LISTEN/NOTIFY round trip.
    Latency,
    /// Drain a backlog with no-op handlers (one and four subscriptions per event).
    Throughput,
    /// Publish rate by batch size, concurrent publishers and consumer state.
    Publish,
    /// Latency and keeping up at fixed offered rates.
    Mixed,
    /// Peak RSS of a consumer draining a large backlog.
    Memory,
    /// `publish_batch` (unnest) against binary COPY; the cost of one call.
    Batch,
    /// Every workload above, in that order.
    All,
    /// `pgbus forward` into NATS JetStream (a `nats-server -js` of its own): a backlog's
    /// rate, unordered and ordered, and commit → PubAck latency at idle.
    Forward,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Latency => "latency",
            Workload::Throughput => "throughput",
            Workload::Publish => "publish",
            Workload::Mixed => "mixed",
            Workload::Memory => "memory",
            Workload::Batch => "batch",
            Workload::All => "all",
            Workload::Forward => "forward",
        }
    }
}

/// The consumer states of the `publish` workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[non_exhaustive]
pub(crate) enum PublishState {
    /// The notify trigger is disabled: the same schema with notification switched off.
    Off,
    /// No consumer is registered: every commit notifies (nobody is known to be awake).
    None,
    /// A consumer is registered and asleep, and LISTENs: every commit notifies.
    Asleep,
    /// A consumer is registered and awake (draining): no commit notifies.
    Busy,
    /// A real bus with a no-op handler runs while the publishers publish.
    Live,
    /// As `busy`, but the publishers call the SQL function `pgbus.publish()`.
    Sql,
    /// As `busy`, but the publishers INSERT into `pgbus.events` themselves, as raw SQL
    /// or COPY would.
    Raw,
}

impl PublishState {
    fn name(self) -> &'static str {
        match self {
            PublishState::Off => "off",
            PublishState::None => "none",
            PublishState::Asleep => "asleep",
            PublishState::Busy => "busy",
            PublishState::Live => "live",
            PublishState::Sql => "sql",
            PublishState::Raw => "raw",
        }
    }
}

/// Arguments of `pgbus bench`.
#[derive(Debug, Clone, clap::Args)]
#[non_exhaustive]
pub(crate) struct BenchArgs {
    /// The workload to run.
    #[arg(value_enum, default_value = "all")]
    pub workload: Workload,

    /// Print one JSON object per workload instead of text.
    #[arg(long)]
    pub json: bool,

    /// How many times to run each workload; figures are the median, with every run's
    /// value beside it.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: u32,

    /// The workloads' own settings.
    #[command(flatten)]
    pub knobs: Box<Knobs>,

    /// The bus's own transactions (claims, acknowledgements) with this
    /// `synchronous_commit`: `on` waits for each one's WAL flush, `off` does not
    /// (at-least-once delivery allows it: a lost acknowledgement is redelivered). Default:
    /// the bus's default, off.
    #[arg(long, default_value_t = pgbus::DEFAULT_SYNCHRONOUS_COMMIT, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new(), value_name = "on|off")]
    pub bus_synchronous_commit: bool,

    /// Record the bus's metrics in a Prometheus exporter serving /metrics on this
    /// address (e.g. 127.0.0.1:9187) during the run: the figures with metrics on.
    #[arg(long, value_name = "IP:PORT", value_parser = crate::cli::metrics::parse_addr)]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// memory: run as the consumer child process (internal).
    #[arg(long, hide = true)]
    pub child: bool,
}

/// The settings of particular workloads (each names the workloads it applies to).
#[derive(Debug, Clone, clap::Args)]
#[non_exhaustive]
pub(crate) struct Knobs {
    /// latency, forward: events published (one per transaction) at idle. mixed: seconds of offered load
    /// are set by --seconds instead.
    #[arg(long, default_value_t = 1000)]
    pub events: u64,

    /// latency, forward: pause between two events, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub interval_ms: u64,

    /// latency: run the bus without a listener (woken by its 1 s poll timer only).
    #[arg(long)]
    pub poll_only: bool,

    /// throughput, forward: events pending when the bus starts (default 20,000; forward
    /// takes the first).
    /// memory: the backlogs compared (default 20,000 and 1,000,000).
    #[arg(long, value_delimiter = ',')]
    pub backlog: Vec<u64>,

    /// throughput: subscriptions per event (default: 1, then 4).
    #[arg(long, value_delimiter = ',')]
    pub fan_out: Vec<u32>,

    /// throughput, mixed, memory: deliveries handled at once by the bus.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// throughput: make the subscriptions ordered, with the events spread over this many
    /// ordering keys (0: unordered). forward: the ordered case's keys (0: 100).
    #[arg(long, default_value_t = 0)]
    pub ordered_keys: u64,

    /// publish: events per transaction.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10, 100, 1000])]
    pub batch: Vec<usize>,

    /// publish: subscriptions registered, one matching the events and the others not
    /// (what every publish would pay for if it looked at each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub subscriptions: u32,

    /// publish: concurrent publishers.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16, 64])]
    pub publishers: Vec<usize>,

    /// publish: consumer states (the plain INSERT floor always runs).
    #[arg(long, value_enum, value_delimiter = ',',
          default_values_t = [PublishState::Off, PublishState::None, PublishState::Asleep, PublishState::Busy, PublishState::Sql, PublishState::Raw])]
    pub states: Vec<PublishState>,

    /// publish: measured seconds per cell (after a short warm-up).
    /// mixed: seconds of offered load per rate. batch: seconds per size and method.
    #[arg(long)]
    pub seconds: Option<f64>,

    /// mixed: offered rates, in events per second.
    #[arg(long, value_delimiter = ',', default_values_t = [1000, 5000])]
    pub rate: Vec<u64>,

    /// batch: batch sizes compared.
    #[arg(long, value_delimiter = ',', default_values_t = [10, 100, 10000])]
    pub sizes: Vec<usize>,
}

impl BenchArgs {
    /// Arguments for `workload` with every default, as `pgbus bench <workload>` has them.
    #[cfg(test)]
    pub(crate) fn new(workload: Workload) -> BenchArgs {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: BenchArgs,
        }
        let mut args = Wrapper::parse_from(["pgbus-bench"]).args;
        args.workload = workload;
        args
    }
}

/// Runs the workloads `args` names and prints their figures.
///
/// # Errors
///
/// When PostgreSQL cannot be reached or a workload fails.
pub(crate) async fn run(args: BenchArgs, database_url: Option<&str>) -> Result<()> {
    if args.child {
        return memory::run_child(&args, database_url).await;
    }
    let server = Server::start(database_url).await?;
    let settings = server.settings().await?;
    let machine = machine();
    if !args.json {
        println!("{}", describe(&machine, &settings));
        println!(
            "bus transactions: synchronous_commit={}; {} run(s) per figure: median (every run)",
            if args.bus_synchronous_commit {
                "on"
            } else {
                "off"
            },
            args.runs
        );
    }
    let workloads: &[Workload] = match args.workload {
        Workload::All => &[
            Workload::Latency,
            Workload::Throughput,
            Workload::Publish,
            Workload::Mixed,
            Workload::Memory,
            Workload::Batch,
        ],
        ref one => std::slice::from_ref(one),
    };
    let mut targets = Vec::new();
    for &workload in workloads {
        let mut reports = Vec::new();
        match workload {
            Workload::Latency => {
                if args.workload == Workload::All {
                    reports.push(latency::run(&server, &args, false).await?);
                    reports.push(latency::run(&server, &args, true).await?);
                } else {
                    reports.push(latency::run(&server, &args, args.knobs.poll_only).await?);
                }
            }
            Workload::Throughput => reports.push(throughput::run(&server, &args).await?),
            Workload::Publish => reports.push(publish::run(&server, &args).await?),
            Workload::Mixed => reports.push(mixed::run(&server, &args).await?),
            Workload::Memory => reports.push(memory::run(&server, &args).await?),
            Workload::Batch => reports.push(batch::run(&server, &args).await?),
            Workload::Forward => reports.push(forward::run(&server, &args).await?),
            Workload::All => {}
        }
        for report in reports {
            if args.json {
                let mut object = report.json;
                object["workload"] = json!(workload.name());
                object["runs"] = json!(args.runs);
                object["bus_synchronous_commit"] = json!(args.bus_synchronous_commit);
                object["settings"] = settings.clone();
                object["machine"] = machine.clone();
                object["targets"] = report.targets.iter().map(Target::json).collect();
                println!("{object}");
            } else {
                println!("\n== {} ==\n{}", workload.name(), report.text.trim_end());
                for target in &report.targets {
                    println!("{}", target.line());
                }
            }
            targets.extend(report.targets);
        }
    }
    if workloads.len() > 1 {
        let passed = targets.iter().filter(|t| t.pass()).count();
        if args.json {
            println!(
                "{}",
                json!({
                    "workload": "targets",
                    "passed": passed,
                    "missed": targets.len() - passed,
                    "targets": targets.iter().map(Target::json).collect::<Vec<_>>(),
                    "machine": machine,
                })
            );
        } else {
            println!("\n== targets: {passed} of {} met ==", targets.len());
            for target in &targets {
                println!("{}", target.line());
            }
        }
    }
    server.stop().await;
    Ok(())
}

/// A bus builder for `config` with the bench's concurrency and `synchronous_commit`.
fn bus(config: &pgbus::ConnectConfig, args: &BenchArgs) -> pgbus::BusBuilder {
    pgbus::Bus::builder(config.clone())
        .concurrency(args.knobs.concurrency)
        .synchronous_commit(args.bus_synchronous_commit)
}

/// What one workload found: its JSON object and its text.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// The figures, under the field names `pgbus bench --json` prints.
    pub json: Value,
    /// The same figures for people.
    pub text: String,
    /// The performance targets this workload's figures are checked against.
    pub targets: Vec<Target>,
}

/// A performance target: a measured figure against its goal, which it meets or misses.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// A stable name (`publish_16_vs_insert`).
    pub name: &'static str,
    /// The measured figure (a ratio, a rate or milliseconds).
    pub value: f64,
    /// The goal.
    pub goal: f64,
    /// Whether the figure must stay at or below the goal (a latency) rather than reach it.
    pub at_most: bool,
    /// What the figure is, for people.
    pub what: String,
}

impl Target {
    /// A figure that must reach `goal`.
    pub(crate) fn at_least(name: &'static str, value: f64, goal: f64, what: &str) -> Target {
        Target::new(name, value, goal, false, what)
    }

    /// A figure that must stay at or below `goal`.
    pub(crate) fn at_most(name: &'static str, value: f64, goal: f64, what: &str) -> Target {
        Target::new(name, value, goal, true, what)
    }

    fn new(name: &'static str, value: f64, goal: f64, at_most: bool, what: &str) -> Target {
        let what = what.to_string();
        Target {
            name,
            value,
            goal,
            at_most,
            what,
        }
    }

    /// Whether the figure meets its goal (a figure that could not be measured does not).
    pub(crate) fn pass(&self) -> bool {
        if self.at_most {
            self.value <= self.goal
        } else {
            self.value >= self.goal
        }
    }

    fn json(&self) -> Value {
        json!({
            "name": self.name,
            "value": round(self.value),
            "target": self.goal,
            "comparison": if self.at_most { "<=" } else { ">=" },
            "pass": self.pass(),
            "what": self.what,
        })
    }

    /// `PASS name: value (target >= goal)  what`.
    fn line(&self) -> String {
        format!(
            "{} {}: {} (target {} {})  {}",
            if self.pass() { "PASS" } else { "MISS" },
            self.name,
            fmt_num(round(self.value)),
            if self.at_most { "<=" } else { ">=" },
            fmt_num(self.goal),
            self.what
        )
    }
}

impl Report {
    /// A report of several cases: the headline case's figures at the top level, and
    /// every case under `cases`.
    fn of_cases(
        cases: Vec<serde_json::Map<String, Value>>,
        headline: usize,
        text: String,
    ) -> Report {
        let mut object = cases.get(headline).cloned().unwrap_or_default();
        object.insert("cases".into(), json!(cases));
        Report {
            json: object.into(),
            text,
            targets: Vec::new(),
        }
    }
}

/// The machine: cores, memory, CPU model and load at start, as a JSON object.
pub(crate) fn machine() -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ");
    json!({
        "cores": cores,
        "memory_gib": (mem_kb as f64 / 1024.0 / 1024.0 * 10.0).round() / 10.0,
        "cpu": cpu,
        "load_at_start": load,
    })
}

fn describe(machine: &Value, settings: &Value) -> String {
    let s = |k: &str| settings[k].as_str().unwrap_or("?").to_string();
    format!(
        "machine: {} cores, {} GiB, {} (load {})\n\
         postgres {} ({}): fsync={} synchronous_commit={} full_page_writes={} \
         wal_sync_method={} shared_buffers={} wal_level={} max_connections={}",
        machine["cores"],
        machine["memory_gib"],
        machine["cpu"].as_str().unwrap_or("?"),
        machine["load_at_start"].as_str().unwrap_or("?"),
        s("server_version"),
        if settings["embedded"].as_bool() == Some(true) {
            "throwaway cluster"
        } else {
            "--database-url"
        },
        s("fsync"),
        s("synchronous_commit"),
        s("full_page_writes"),
        s("wal_sync_method"),
        s("shared_buffers"),
        s("wal_level"),
        s("max_connections"),
    )
}

/// A latency histogram in microseconds, from 1 µs to 10 minutes.
pub(crate) fn histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// Records `d` in `h` (in microseconds, clamped to the histogram's range).
pub(crate) fn record(h: &mut hdrhistogram::Histogram<u64>, d: Duration) {
    h.saturating_record((d.as_micros() as u64).max(1));
}

/// p50, p90, p99 and max of `h`, in milliseconds.
pub(crate) fn percentiles(h: &hdrhistogram::Histogram<u64>) -> [f64; 4] {
    let ms = |us: u64| us as f64 / 1000.0;
    [
        ms(h.value_at_quantile(0.50)),
        ms(h.value_at_quantile(0.90)),
        ms(h.value_at_quantile(0.99)),
        ms(h.max()),
    ]
}

/// The names of [`percentiles`]' figures in JSON.
pub(crate) const PERCENTILE_FIELDS: [&str; 4] = ["p50_ms", "p90_ms", "p99_ms", "max_ms"];

/// The median of `values` (the mean of the middle two for an even count).
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Rounds for printing: 3 significant digits below 100, whole numbers above.
fn round(x: f64) -> f64 {
    if !x.is_finite() {
        return x;
    }
    if x.abs() >= 100.0 {
        x.round()
    } else if x.abs() >= 1.0 {
        (x * 100.0).round() / 100.0
    } else {
        (x * 1000.0).round() / 1000.0
    }
}

/// Figures of several runs: each named value, in run order.
#[derive(Debug, Default, Clone)]
struct Runs {
    values: Vec<(String, Vec<f64>)>,
}

impl Runs {
    fn push(&mut self, name: &str, value: f64) {
        match self.values.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => v.push(value),
            None => self.values.push((name.to_string(), vec![value])),
        }
    }

    fn push_percentiles(&mut self, prefix: &str, h: &hdrhistogram::Histogram<u64>) {
        for (field, value) in PERCENTILE_FIELDS.iter().zip(percentiles(h)) {
            self.push(&format!("{prefix}{field}"), value);
        }
    }

    fn median(&self, name: &str) -> f64 {
        self.values
            .iter()
            .find(|(n, _)| n == name)
            .map_or(f64::NAN, |(_, v)| median(v))
    }

    fn all(&self, name: &str) -> Vec<f64> {
        self.values
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.iter().copied().map(round).collect())
            .unwrap_or_default()
    }

    /// `{name: median, name_runs: [..]}` for every value whose name starts with `prefix`
    /// (the prefix removed).
    fn json(&self, prefix: &str) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        for (name, _) in &self.values {
            if let Some(short) = name.strip_prefix(prefix) {
                m.insert(short.to_string(), json!(round(self.median(name))));
                m.insert(format!("{short}_runs"), json!(self.all(name)));
            }
        }
        m
    }

    /// "median (runs a, b, c)".
    fn show(&self, name: &str) -> String {
        let runs = self.all(name);
        let runs: Vec<String> = runs.iter().map(|v| fmt_num(*v)).collect();
        if runs.len() > 1 {
            format!(
                "{} (runs {})",
                fmt_num(round(self.median(name))),
                runs.join(", ")
            )
        } else {
            fmt_num(round(self.median(name)))
        }
    }

    /// "p50 a / p90 b / p99 c / max d ms" of the medians.
    fn show_latency(&self, prefix: &str) -> String {
        let v: Vec<String> = PERCENTILE_FIELDS
            .iter()
            .map(|f| fmt_num(round(self.median(&format!("{prefix}{f}")))))
            .collect();
        format!(
            "p50 {} / p90 {} / p99 {} / max {} ms",
            v[0], v[1], v[2], v[3]
        )
    }
}

fn fmt_num(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() >= 1000.0 {
        // Thousands separators for rates.
        let s = format!("{}", v as i64);
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i) % 3 == 0 && c != '-' {
                out.push(',');
            }
            out.push(c);
        }
        out
    } else {
        format!("{v}")
    }
}

/// Polls `done` every millisecond until it holds or `deadline` passes.
async fn wait_until(deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        let args = BenchArgs::new(Workload::Publish);
        assert_eq!(args.runs, 3);
        assert_eq!(args.knobs.batch, [1, 10, 100, 1000]);
        assert_eq!(args.knobs.publishers, [1, 4, 16, 64]);
        assert_eq!(args.knobs.rate, [1000, 5000]);
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(fmt_num(12345.0), "12,345");
        assert_eq!(fmt_num(0.41), "0.41");
    }
}
