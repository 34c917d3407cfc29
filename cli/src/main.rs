//! The `pgbus` command line.

mod bench;
mod cli;

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use cli::Failure;

/// pgbus: a transactional outbox and push-driven event bus on PostgreSQL.
#[derive(Debug, Parser)]
#[command(
    name = "pgbus",
    version,
    about,
    long_about = None,
    after_help = "\
Every command takes --database-url or DATABASE_URL (postgres://user:password@host/db, or
libpq key=value pairs). Exit codes: 0 success, 1 failure, 2 bad usage or input (nothing
was done). A reader of standard output that goes away (`pgbus status | head -1`) ends a
command quietly with 0, as SIGPIPE would; any other failure to write standard output (a
full disk) is 1. `pgbus consume` is the exception: it cannot deliver without its output,
so both are 1 there (see `pgbus consume --help`).

New here? `pgbus demo` runs the bus on a throwaway PostgreSQL and shows it working.
Logs: PGBUS_LOG=info (or debug, or pgbus=debug), on standard error."
)]
struct Cli {
    /// The database to use, as a URL (postgres://user@host/db) or key=value pairs.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply pending schema migrations.
    ///
    /// Safe to run at every deploy and from several processes at once.
    #[command(
        after_help = "Example:\n  DATABASE_URL=postgres://postgres@localhost/app pgbus migrate"
    )]
    Migrate,
    /// Publish an event (or many, one JSON document per line of standard input).
    Publish(cli::publish::PublishArgs),
    /// Deliver a subscription's events to standard output or to a command, until stopped.
    Consume(cli::consume::ConsumeArgs),
    /// Relay a subscription into NATS JetStream, each event acknowledged after its PubAck.
    Forward(cli::forward::ForwardArgs),
    /// Show each subscription's backlog, lag, dead letters and consumers.
    Status(cli::status::StatusArgs),
    /// List, retry or purge dead letters.
    #[command(subcommand)]
    Dead(cli::admin::DeadCommand),
    /// List the keys of ordered subscriptions blocked by a dead head; redrive or skip it.
    #[command(subcommand)]
    Keys(cli::keys::KeysCommand),
    /// Deliver events still in the log to a subscription again.
    Replay(cli::admin::ReplayArgs),
    /// List or drop subscriptions.
    #[command(subcommand)]
    Subscriptions(cli::admin::SubscriptionsCommand),
    /// Delete events past the retention that no delivery needs.
    Sweep(cli::admin::SweepArgs),
    /// Serve every subscription's backlog gauges at /metrics (Prometheus text format).
    Metrics(cli::metrics::MetricsArgs),
    /// Serve a web dashboard: backlogs, dead letters, blocked keys, events, consumers.
    Ui(cli::ui::UiArgs),
    /// Run producers and handlers on a throwaway PostgreSQL, with a live view.
    Demo(cli::demo::DemoArgs),
    /// Run a benchmark workload and print its figures.
    Bench(bench::BenchArgs),
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Migrate => {
            let client = cli::connect_url(url).await?;
            let applied = pgbus::migrate(&client).await?;
            if applied.is_empty() {
                cli::output::outln!(
                    "schema is current (version {})",
                    pgbus::schema::latest_version()
                )?;
            } else {
                for m in &applied {
                    cli::output::outln!("applied {:04}_{}", m.version, m.name)?;
                }
            }
            Ok(())
        }
        Command::Publish(args) => cli::publish::run(args, url).await,
        Command::Consume(args) => cli::consume::run(args, url).await,
        Command::Forward(args) => cli::forward::run(args, url).await,
        Command::Status(args) => cli::status::run(args, url).await,
        Command::Dead(command) => cli::admin::dead(command, url).await,
        Command::Keys(command) => cli::keys::keys(command, url).await,
        Command::Replay(args) => cli::admin::replay(args, url).await,
        Command::Subscriptions(command) => cli::admin::subscriptions(command, url).await,
        Command::Sweep(args) => cli::admin::sweep(args, url).await,
        Command::Metrics(args) => cli::metrics::run(args, url).await,
        Command::Ui(args) => cli::ui::run(args, url).await,
        Command::Demo(args) => cli::demo::run(args, url).await,
        Command::Bench(args) => {
            if let Some(addr) = args.metrics_addr {
                cli::metrics::serve(addr)?;
            }
            bench::run(args, cli.database_url.as_deref()).await?;
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo's dead letters are on purpose: their warnings would break its live view.
    let default_filter = match cli.command {
        Command::Demo(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PGBUS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: could not start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(run(cli));
    // Tasks still blocked (a connection, a command's output) must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if !f.message.is_empty() {
                eprintln!("{}", f.message);
            }
            ExitCode::from(f.code)
        }
    }
}
