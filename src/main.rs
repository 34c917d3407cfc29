//! The `pgbus` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// pgbus: a transactional outbox and push-driven event bus on PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "pgbus", version, about, long_about = None)]
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
    /// Run a benchmark workload and print its figures.
    Bench(pgbus::bench::BenchArgs),
}

/// An error that ends the command, with its exit code.
struct Failure {
    message: String,
    code: u8,
}

impl From<pgbus::Error> for Failure {
    fn from(e: pgbus::Error) -> Self {
        let mut message = format!("error: {e}");
        if let Some(db) = e.as_db_error() {
            message = format!("error: {} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                message.push_str(&format!("\ndetail: {detail}"));
            }
            if let Some(hint) = db.hint() {
                message.push_str(&format!("\nhint: {hint}"));
            }
        }
        Failure { message, code: 1 }
    }
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Self {
        pgbus::Error::from(e).into()
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure {
        message: message.into(),
        code: 2,
    }
}

fn database_config(url: Option<&str>) -> Result<tokio_postgres::Config, Failure> {
    let url = url.ok_or_else(|| {
        usage("error: DATABASE_URL is not set (pass --database-url or set DATABASE_URL)")
    })?;
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| usage(format!("error: DATABASE_URL is malformed: {e}")))?;
    if config.get_application_name().is_none() {
        config.application_name("pgbus cli");
    }
    Ok(config)
}

async fn connect(config: &tokio_postgres::Config) -> Result<tokio_postgres::Client, Failure> {
    let (client, connection) =
        config
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(|e| Failure {
                message: format!("error: could not connect to the database: {e}"),
                code: 1,
            })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "connection closed");
        }
    });
    Ok(client)
}

async fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Migrate => {
            let config = database_config(cli.database_url.as_deref())?;
            let client = connect(&config).await?;
            let applied = pgbus::migrate(&client).await?;
            if applied.is_empty() {
                println!(
                    "schema is current (version {})",
                    pgbus::schema::latest_version()
                );
            } else {
                for m in &applied {
                    println!("applied {:04}_{}", m.version, m.name);
                }
            }
            Ok(())
        }
        Command::Bench(args) => {
            pgbus::bench::run(args, cli.database_url.as_deref()).await?;
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PGBUS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("{}", f.message);
            ExitCode::from(f.code)
        }
    }
}
