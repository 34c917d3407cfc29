//! Standard output. Every line a command prints goes through here, so that a reader that
//! went away (EPIPE) or a failing device (ENOSPC, EIO) ends the command with a documented
//! exit code instead of a panic:
//!
//! - a closed pipe ends it quietly with exit 0, as a tool killed by SIGPIPE would have
//!   ended without a complaint (the reader took what it wanted);
//! - any other write error ends it with exit 1 and a message.

use std::io::{ErrorKind, Write as _};

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
