//! The `pgbus` command line.

#[cfg(feature = "bench")]
mod bench;
mod cli;

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
libpq key=value pairs); a password belongs in DATABASE_URL or the password file
(PGPASSFILE, ~/.pgpass), never on the command line, where `ps` shows it: --database-url
with a password is refused. `pgbus demo` and `pgbus bench` ignore DATABASE_URL: they use
their own throwaway cluster unless given --database-url. Exit codes: 0 success, 1 failure, 2 bad usage or input (nothing
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
    Dead(cli::dead::DeadCommand),
    /// List the keys of ordered subscriptions blocked by a dead head; redrive or skip it.
    #[command(subcommand)]
    Keys(cli::keys::KeysCommand),
    /// Deliver events still in the log to a subscription again.
    Replay(cli::replay::ReplayArgs),
    /// List or drop subscriptions.
    #[command(subcommand)]
    Subscriptions(cli::subscriptions::SubscriptionsCommand),
    /// Delete events past the retention that no delivery needs.
    Sweep(cli::sweep::SweepArgs),
    /// Serve every subscription's backlog gauges at /metrics (Prometheus text format).
    Metrics(cli::metrics::MetricsArgs),
    /// Serve a web dashboard: backlogs, dead letters, blocked keys, events, consumers.
    Ui(cli::ui::UiArgs),
    /// Run producers and handlers on a throwaway PostgreSQL, with a live view.
    #[cfg(feature = "demo")]
    Demo(cli::demo::DemoArgs),
    /// Run a benchmark workload and print its figures.
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
}

/// What the command line said, beyond [`Cli`]: whether `--database-url` was written on
/// it (rather than taken from `DATABASE_URL`).
#[derive(Debug, Clone, Copy)]
struct Given {
    #[cfg_attr(not(any(feature = "demo", feature = "bench")), allow(dead_code))]
    database_url_on_command_line: bool,
}

#[cfg_attr(not(any(feature = "demo", feature = "bench")), allow(unused_variables))]
async fn run(cli: Cli, given: Given) -> Result<(), Failure> {
    // The demo and the benchmarks never use a database by accident (every sqlx project
    // exports DATABASE_URL): only one named on their command line.
    #[cfg(any(feature = "demo", feature = "bench"))]
    let explicit = cli
        .database_url
        .as_deref()
        .filter(|_| given.database_url_on_command_line);
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
        Command::Dead(command) => cli::dead::dead(command, url).await,
        Command::Keys(command) => cli::keys::keys(command, url).await,
        Command::Replay(args) => cli::replay::replay(args, url).await,
        Command::Subscriptions(command) => cli::subscriptions::subscriptions(command, url).await,
        Command::Sweep(args) => cli::sweep::sweep(args, url).await,
        Command::Metrics(args) => cli::metrics::run(args, url).await,
        Command::Ui(args) => cli::ui::run(args, url).await,
        #[cfg(feature = "demo")]
        Command::Demo(args) => cli::demo::run(args, explicit).await,
        #[cfg(feature = "bench")]
        Command::Bench(args) => {
            if let Some(addr) = args.metrics_addr {
                cli::metrics::serve(addr)?;
            }
            // The memory workload's child is handed its database in DATABASE_URL by its
            // parent (out of `ps`'s sight).
            let url = if args.child { url } else { explicit };
            bench::run(args, url).await?;
            Ok(())
        }
    }
}

/// Standard error for log lines, with the secrets pgbus was given masked.
struct RedactingStderr(std::sync::Arc<Vec<String>>);

impl std::io::Write for RedactingStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut stderr = std::io::stderr().lock();
        if self.0.is_empty() {
            stderr.write_all(buf)?;
        } else {
            // The formatter writes each log line at once.
            let text = cli::secrets::redact(&String::from_utf8_lossy(buf), &self.0);
            stderr.write_all(text.as_bytes())?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let secrets = std::sync::Arc::new(cli::secrets::known(&matches));
    let given = Given {
        database_url_on_command_line: matches!(
            matches.value_source("database_url"),
            Some(clap::parser::ValueSource::CommandLine)
        ),
    };
    if let Err(f) = cli::secrets::refuse_on_command_line(&matches) {
        eprintln!("{}", f.message);
        return ExitCode::from(f.code);
    }
    // The demo's dead letters are on purpose: their warnings would break its live view.
    let default_filter = match cli.command {
        #[cfg(feature = "demo")]
        Command::Demo(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PGBUS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer({
            let secrets = secrets.clone();
            move || RedactingStderr(secrets.clone())
        })
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
    let result = runtime.block_on(run(cli, given));
    // Tasks still blocked (a connection, a command's output) must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if !f.message.is_empty() {
                eprintln!("{}", cli::secrets::redact(&f.message, &secrets));
            }
            ExitCode::from(f.code)
        }
    }
}
