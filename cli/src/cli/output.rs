//! Standard output. Every line a command prints goes through here, so that a reader that
//! went away (EPIPE) or a failing device (ENOSPC, EIO) ends the command with a documented
//! exit code instead of a panic:
//!
//! - a closed pipe ends it quietly with exit 0, as a tool killed by SIGPIPE would have
//!   ended without a complaint (the reader took what it wanted);
//! - any other write error ends it with exit 1 and a message.
//!
//! `pgbus consume` writes from a thread of its own ([`LineWriter`]), so that a reader
//! that stops reading blocks that thread only, never the runtime that handles signals.

use std::io::{ErrorKind, Write as _};
use std::sync::mpsc as std_mpsc;

use tokio::sync::oneshot;

use super::{Failure, failed};

/// Prints `format!(...)` and a newline on standard output, flushed; `Err` is the
/// [`Failure`] that ends the command (see the module's documentation).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Prints `format!(...)` on standard output, flushed (see [`outln!`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::write_stdout(format_args!($($arg)*))
    };
}

pub(crate) use outln;

/// Writes and flushes `args` on standard output.
pub(crate) fn write_stdout(args: std::fmt::Arguments<'_>) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(|e| output_failure(&e))
}

/// The failure a write error on standard output ends a command with.
pub(crate) fn output_failure(e: &std::io::Error) -> Failure {
    if is_closed(e) {
        Failure {
            message: String::new(),
            code: 0,
        }
    } else {
        failed(format!("error: could not write to standard output: {e}"))
    }
}

/// Whether `e` says the reader of standard output went away.
pub(crate) fn is_closed(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::BrokenPipe
}

/// A line to write, and where to say whether it was written.
type Job = (String, oneshot::Sender<std::io::Result<()>>);

/// Writes lines to standard output from a thread of its own, one at a time, each
/// flushed before the next.
///
/// A write blocked by a reader that does not read holds only that thread: the caller
/// waits for the answer with whatever deadline it likes, and the process may exit with
/// the thread still blocked (nothing else is ever done on it). After a write fails, every
/// later line is answered with the same error without being written.
#[derive(Debug, Clone)]
pub(crate) struct LineWriter {
    jobs: std_mpsc::Sender<Job>,
}

impl LineWriter {
    /// Starts the writing thread; it ends when every clone of the writer is dropped.
    pub(crate) fn start() -> std::io::Result<LineWriter> {
        let (jobs, rx) = std_mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("pgbus-stdout".into())
            .spawn(move || {
                let mut failed: Option<(ErrorKind, String)> = None;
                for (line, reply) in rx {
                    let result = match &failed {
                        Some((kind, text)) => Err(std::io::Error::new(*kind, text.clone())),
                        None => {
                            let mut out = std::io::stdout().lock();
                            let r = out
                                .write_all(line.as_bytes())
                                .and_then(|()| out.write_all(b"\n"))
                                .and_then(|()| out.flush());
                            if let Err(e) = &r {
                                failed = Some((e.kind(), e.to_string()));
                            }
                            r
                        }
                    };
                    let _ = reply.send(result);
                }
            })?;
        Ok(LineWriter { jobs })
    }

    /// Writes `line` and a newline, flushed. Pending until the thread has written it;
    /// dropping the future leaves the line to be written (or not) by the thread.
    pub(crate) async fn write(&self, line: String) -> std::io::Result<()> {
        let (reply, answer) = oneshot::channel();
        if self.jobs.send((line, reply)).is_err() {
            return Err(std::io::Error::other("the output thread has stopped"));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("the output thread has stopped")))
    }
}

/// The text on one line (line breaks and tabs as spaces), cut at `max` characters; the
/// table escapes what else a terminal would interpret.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| {
            if matches!(c, '\n' | '\r' | '\t') {
                ' '
            } else {
                c
            }
        })
        .collect();
    if flat.chars().count() > max {
        format!("{}...", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

/// A time as the command line's tables and messages print it (`2026-12-07 15:23:37Z`).
pub(crate) fn timestamp(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%SZ").to_string()
}

/// `"s"` unless `n` is 1.
pub(crate) fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}
