//! The commands of the `pgbus` binary, one module each, and what they share: the
//! database connection, errors and exit codes, durations and times, and output.

#[macro_use]
pub(crate) mod output;

pub(crate) mod consume;
pub(crate) mod dead;
#[cfg(feature = "demo")]
pub(crate) mod demo;
pub(crate) mod forward;
mod group;
pub(crate) mod jetstream;
pub(crate) mod keys;
pub(crate) mod metrics;
pub(crate) mod publish;
pub(crate) mod replay;
pub(crate) mod secrets;
pub(crate) mod sink;
pub(crate) mod status;
pub(crate) mod subscriptions;
pub(crate) mod sweep;
pub(crate) mod ui;

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};

/// An error that ends the command, with its exit code: 2 for bad usage or input (nothing
/// was done), 1 for everything else; 0 with no message for a reader of standard output
/// that went away (see [`output`]).
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) message: String,
    pub(crate) code: u8,
}

impl From<pgbus::Error> for Failure {
    fn from(e: pgbus::Error) -> Self {
        let code = match e {
            pgbus::Error::Invalid { .. } => 2,
            // Not bad input: the same command works against a newer server.
            pgbus::Error::UnsupportedServer { .. } => 1,
            _ => 1,
        };
        let mut message = match e {
            // Names the grant and PostgreSQL's refusal already.
            pgbus::Error::NeedsGrant { .. } => format!("error: {e}"),
            _ => format!("error: {}", with_sources(&e)),
        };
        // A missing schema says to migrate, a missing grant which one: their own words.
        let own_words = matches!(
            e,
            pgbus::Error::SchemaMissing(_) | pgbus::Error::NeedsGrant { .. }
        );
        if let (false, Some(db)) = (own_words, e.as_db_error()) {
            message = format!("error: {} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                message.push_str(&format!("\ndetail: {detail}"));
            }
            if let Some(hint) = db.hint() {
                message.push_str(&format!("\nhint: {hint}"));
            }
        }
        Failure { message, code }
    }
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Self {
        pgbus::Error::from(e).into()
    }
}

/// An error's message followed by its sources' (tokio-postgres puts the reason, e.g.
/// "Connection refused", in the source), without repeating one already included.
pub(crate) fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text.replace('\n', " ")
}

/// A usage error (exit code 2): the command line or its input was wrong.
pub(crate) fn usage(message: impl Into<String>) -> Failure {
    Failure {
        message: message.into(),
        code: 2,
    }
}

/// A failure of the operation (exit code 1).
pub(crate) fn failed(message: impl Into<String>) -> Failure {
    Failure {
        message: message.into(),
        code: 1,
    }
}

/// Parses and checks `--database-url` / `DATABASE_URL`, filling what it leaves out from
/// the `PG*` environment variables and the password file, as `psql` does.
pub(crate) fn database_config(url: Option<&str>) -> Result<pgbus::ConnectConfig, Failure> {
    database_config_with_env(url, |name| std::env::var(name).ok())
}

/// [`database_config`] with the environment read through `env`.
fn database_config_with_env(
    url: Option<&str>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<pgbus::ConnectConfig, Failure> {
    const EXAMPLE: &str = "e.g. postgres://user:password@localhost:5432/app";
    let url = url.map(str::trim).filter(|u| !u.is_empty());
    let given_by_env = ["PGHOST", "PGUSER"]
        .iter()
        .any(|v| env(v).is_some_and(|v| !v.is_empty()));
    if url.is_none() && !given_by_env {
        return Err(usage(
            "error: DATABASE_URL is not set (pass --database-url, set DATABASE_URL, or set \
             PGHOST, PGUSER and the other PG* variables)",
        ));
    }
    let mut config = pgbus::ConnectConfig::parse_with_env(url.unwrap_or(""), env).map_err(|e| {
        let reason = match &e {
            pgbus::Error::Invalid { what, reason } => format!("{what}: {reason}"),
            e => e.to_string(),
        };
        usage(format!(
            "error: DATABASE_URL is malformed ({}); {EXAMPLE}",
            reason.replace('\n', " ")
        ))
    })?;
    let pg = config.pg_config_mut();
    if pg.get_application_name().is_none() {
        pg.application_name("pgbus cli");
    }
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(Duration::from_secs(10));
    }
    Ok(config)
}

/// Connects once, for a command's statements.
pub(crate) async fn connect(
    config: &pgbus::ConnectConfig,
) -> Result<tokio_postgres::Client, Failure> {
    config.connect().await.map_err(|e| {
        let text = with_sources(&e);
        let mut message = format!("error: could not connect to DATABASE_URL: {text}");
        if let Some(hint) = connect_hint(&text, config) {
            message.push_str("\nhint: ");
            message.push_str(hint);
        }
        failed(message)
    })
}

/// What to do about a failed connection, when its reason says.
fn connect_hint(reason: &str, config: &pgbus::ConnectConfig) -> Option<&'static str> {
    use pgbus::SslMode;
    if reason.contains("UnknownIssuer") || reason.contains("BadSignature") {
        Some(
            "the server's certificate is not signed by a CA in sslrootcert (or the system's \
             store): name the CA that signed it with sslrootcert=<file>",
        )
    } else if reason.contains("NotValidForName") || reason.contains("not valid for name") {
        Some(
            "the server's certificate does not name the host connected to (sslmode=verify-full): \
             connect by a name the certificate holds, or use sslmode=verify-ca",
        )
    } else if reason.contains("server does not support TLS") {
        Some("the server does not accept TLS: use sslmode=prefer or disable, or turn ssl on")
    } else if reason.contains("no encryption") && config.ssl_mode() <= SslMode::Prefer {
        Some("the server accepts only TLS connections: use sslmode=require or stronger")
    } else {
        None
    }
}

/// Parses and checks the URL, then connects.
pub(crate) async fn connect_url(url: Option<&str>) -> Result<tokio_postgres::Client, Failure> {
    connect(&database_config(url)?).await
}

/// Parses a duration: a number and a unit (`ms`, `s`, `m`, `h`, `d`), or several
/// (`1h30m`). Every duration on the command line goes through this.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration (e.g. 30s, 500ms, 2m, 1h, 7d)".into());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(digits);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("invalid duration {text:?} (e.g. 30s, 500ms, 2m, 1h, 7d)"))?;
        let seconds = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            "" => {
                return Err(format!(
                    "duration {text:?} has no unit (e.g. {number}s or {number}ms)"
                ));
            }
            other => {
                return Err(format!(
                    "unknown unit {other:?} in duration {text:?} (ms, s, m, h or d)"
                ));
            }
        };
        total += Duration::try_from_secs_f64(value * seconds)
            .map_err(|_| format!("duration {text:?} is out of range"))?;
        rest = tail;
    }
    Ok(total)
}

/// A point in time on the command line: an RFC 3339 timestamp
/// (`2025-01-31T12:00:00Z`), a date (`2025-01-31`, midnight UTC), or a duration meaning
/// that long ago by the database's clock (`1h`, `7d`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum TimeArg {
    At(DateTime<Utc>),
    Ago(Duration),
}

pub(crate) fn parse_time(text: &str) -> Result<TimeArg, String> {
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(TimeArg::At(at.with_timezone(&Utc)));
    }
    if let Ok(date) = NaiveDate::parse_from_str(text, "%Y-%m-%d") {
        return Ok(TimeArg::At(
            date.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc(),
        ));
    }
    parse_duration(text).map(TimeArg::Ago).map_err(|_| {
        format!(
            "invalid time {text:?}: give an RFC 3339 timestamp (2025-01-31T12:00:00Z), \
             a date (2025-01-31) or a duration ago (1h, 7d)"
        )
    })
}

impl TimeArg {
    /// The time, reading "ago" by the database's clock.
    pub(crate) async fn resolve(
        self,
        client: &tokio_postgres::Client,
    ) -> Result<DateTime<Utc>, Failure> {
        match self {
            TimeArg::At(at) => Ok(at),
            TimeArg::Ago(ago) => {
                // Unnamed (query_typed), like every statement of the operator commands:
                // a named one would not survive a pooler in transaction mode.
                let rows = client.query_typed("SELECT now()", &[]).await?;
                let now: DateTime<Utc> = rows
                    .first()
                    .ok_or(pgbus::Error::Unexpected("SELECT now() returned no row"))?
                    .try_get(0)?;
                let ago = chrono::Duration::from_std(ago)
                    .map_err(|_| usage("error: the time is too far back"))?;
                Ok(now - ago)
            }
        }
    }
}

/// A duration for people: `850ms`, `12.3s`, `4m05s`, `3h12m`, `2d04h`.
pub(crate) fn human_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else if secs < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if secs < 3600 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else if secs < 86400 {
        format!("{}h{:02}m", secs / 3600, secs % 3600 / 60)
    } else {
        format!("{}d{:02}h", secs / 86400, secs % 86400 / 3600)
    }
}

/// Lays out rows under headers in left-aligned columns.
/// Text as a terminal may show it: control characters and invisible formatting
/// characters (which could move the cursor, clear the screen or reverse the text around
/// them) written as `\u{..}` escapes. Everything printed for people goes through it;
/// JSON output escapes by itself.
pub(crate) fn visible(text: &str) -> std::borrow::Cow<'_, str> {
    let hidden = |c: char| c.is_control() || pgbus::is_invisible(c);
    if !text.chars().any(hidden) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A table for people: columns aligned, every cell passed through [`visible`].
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| visible(c).into_owned()).collect())
        .collect();
    let rows = &rows;
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// Prints one JSON value on one line: a `json!` object, or a library type's own
/// serialisation. Through a `serde_json::Value`, so that an object's keys come out
/// sorted whatever the type's field order: the output scripts and the docs read.
pub(crate) fn print_json(value: &impl serde::Serialize) -> Result<(), Failure> {
    let value = serde_json::to_value(value)
        .map_err(|e| failed(format!("error: could not write the JSON output: {e}")))?;
    outln!("{value}")
}

/// The signals that stop a long-running command gracefully, caught from the moment this
/// returns (so a signal sent as soon as the command says it is ready is never lost to
/// the default action): SIGINT, SIGTERM and SIGHUP (a closed terminal or a supervisor's
/// reload both mean "stop cleanly", never "die mid-delivery").
#[derive(Debug)]
pub(crate) struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl StopSignals {
    pub(crate) fn catch() -> Result<StopSignals, Failure> {
        use tokio::signal::unix::{SignalKind, signal};
        let catch = |kind: SignalKind, name: &str| {
            signal(kind).map_err(|e| failed(format!("error: cannot catch {name}: {e}")))
        };
        Ok(StopSignals {
            interrupt: catch(SignalKind::interrupt(), "SIGINT")?,
            terminate: catch(SignalKind::terminate(), "SIGTERM")?,
            hangup: catch(SignalKind::hangup(), "SIGHUP")?,
        })
    }

    /// Completes at the next of them; returns its name.
    pub(crate) async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.hangup.recv() => "SIGHUP",
        }
    }
}

/// How a signal asks `pgbus consume` to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Finish what is in progress, up to the shutdown deadline (SIGINT, SIGTERM, SIGHUP,
    /// and every other signal whose default action would end the process).
    Graceful(&'static str),
    /// Stop at once, still ending every command started, then exit with this code (128
    /// plus the signal's number, as a shell reports a death by it): SIGQUIT, SIGABRT.
    Immediate(&'static str, u8),
}

/// Every signal whose default action would end the process (where it can be caught:
/// not SIGKILL, nor the faults SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP and SIGSYS,
/// which a process raises on itself), caught from the moment this returns. SIGPIPE is
/// left ignored, as Rust programs have it (a closed pipe is a write error). The
/// real-time signals are not caught: pgbus's watchdog ends the commands' process
/// groups however pgbus ends.
#[derive(Debug)]
pub(crate) struct AllSignals {
    caught: Vec<(tokio::signal::unix::Signal, Stop)>,
}

impl AllSignals {
    pub(crate) fn catch() -> Result<AllSignals, Failure> {
        use rustix::process::Signal as S;
        use tokio::signal::unix::{SignalKind, signal};
        let graceful = [
            (S::INT, "SIGINT"),
            (S::TERM, "SIGTERM"),
            (S::HUP, "SIGHUP"),
            (S::USR1, "SIGUSR1"),
            (S::USR2, "SIGUSR2"),
            (S::ALARM, "SIGALRM"),
            (S::VTALARM, "SIGVTALRM"),
            (S::PROF, "SIGPROF"),
            (S::IO, "SIGIO"),
            (S::POWER, "SIGPWR"),
            (S::STKFLT, "SIGSTKFLT"),
            (S::XCPU, "SIGXCPU"),
            (S::XFSZ, "SIGXFSZ"),
        ];
        let immediate = [(S::QUIT, "SIGQUIT"), (S::ABORT, "SIGABRT")];
        let mut caught = Vec::new();
        let list = graceful
            .iter()
            .map(|&(s, name)| (s, Stop::Graceful(name)))
            .chain(immediate.iter().map(|&(s, name)| {
                let code = 128 + u8::try_from(s.as_raw()).unwrap_or(0);
                (s, Stop::Immediate(name, code))
            }));
        for (s, stop) in list {
            let name = match stop {
                Stop::Graceful(name) | Stop::Immediate(name, _) => name,
            };
            let signal = signal(SignalKind::from_raw(s.as_raw()))
                .map_err(|e| failed(format!("error: cannot catch {name}: {e}")))?;
            caught.push((signal, stop));
        }
        Ok(AllSignals { caught })
    }

    /// Completes at the next of them; returns what it asks for.
    pub(crate) async fn recv(&mut self) -> Stop {
        std::future::poll_fn(|cx| {
            for (signal, stop) in &mut self.caught {
                if let std::task::Poll::Ready(Some(())) = signal.poll_recv(cx) {
                    return std::task::Poll::Ready(*stop);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// Catches the stop signals from now on; the future completes at the first of them.
pub(crate) fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, Failure> {
    let mut signals = StopSignals::catch()?;
    Ok(async move {
        signals.recv().await;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_their_units() {
        let ok = |s: &str| parse_duration(s).unwrap();
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("30s"), Duration::from_secs(30));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("7d"), Duration::from_secs(7 * 86400));
        assert_eq!(ok("1h30m"), Duration::from_secs(5400));
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
        for bad in ["", "30", "s", "3x", "-1s", "1..2s", "10 s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn times_are_timestamps_dates_or_durations_ago() {
        assert!(matches!(
            parse_time("2025-01-31T12:00:00Z"),
            Ok(TimeArg::At(t)) if t.to_rfc3339() == "2025-01-31T12:00:00+00:00"
        ));
        assert!(matches!(parse_time("2025-01-31"), Ok(TimeArg::At(_))));
        assert!(matches!(parse_time("1h"), Ok(TimeArg::Ago(d)) if d.as_secs() == 3600));
        assert!(parse_time("yesterday").is_err());
    }

    #[test]
    fn database_urls_need_a_host_and_a_user() {
        for bad in [
            None,
            Some(""),
            Some("not a url"),
            Some("postgres://"),
            Some("postgres://localhost:notaport/db"),
            Some("dbname=app"),
        ] {
            let e = database_config_with_env(bad, |_| None).unwrap_err();
            assert_eq!(e.code, 2, "{bad:?}");
            assert!(e.message.contains("DATABASE_URL"), "{bad:?}: {}", e.message);
            assert!(!e.message.contains('\n'), "{bad:?}: {}", e.message);
        }
        let ok = |url| database_config_with_env(Some(url), |_| None).is_ok();
        assert!(ok("postgres://app@localhost/app"));
        assert!(ok("host=/tmp user=postgres dbname=x"));
        let env = |name: &str| match name {
            "PGHOST" => Some("db.internal".to_string()),
            "PGUSER" => Some("app".to_string()),
            _ => None,
        };
        let config = database_config_with_env(None, env).unwrap();
        assert_eq!(config.pg_config().get_user(), Some("app"));
    }

    #[test]
    fn tables_align_their_columns() {
        let t = table(&["A", "BBB"], &[vec!["xx".into(), "y".into()]]);
        assert_eq!(t, "A   BBB\nxx  y\n");
    }

    #[test]
    fn what_a_terminal_would_interpret_is_escaped() {
        assert_eq!(visible("plain ü"), "plain ü");
        assert_eq!(visible("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(visible("x\ry"), "x\\u{d}y");
        assert_eq!(visible("\u{202e}exe.txt"), "\\u{202e}exe.txt");
        let t = table(&["A"], &[vec!["\u{200b}".into()]]);
        assert_eq!(t, "A\n\\u{200b}\n");
    }
}
