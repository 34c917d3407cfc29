//! A log captured in memory, for the tests that count what pgbus logs
//! (`tests/log_noise.rs`, `tests/warning_limits.rs`, `tests/metrics.rs`, `tests/chaos.rs`,
//! `tests/quiet_migrate.rs`).

use std::sync::{Arc, Mutex};

/// Everything the installed subscriber wrote.
#[derive(Clone, Default)]
pub(crate) struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogBuffer {
    /// Installs a subscriber for the whole test binary (unless one already is: then
    /// nothing is written here), filtered by `filter` (an `EnvFilter` directive), that
    /// writes here.
    #[allow(dead_code)]
    pub(crate) fn install(filter: &str) -> LogBuffer {
        let logs = LogBuffer::default();
        let writer = logs.clone();
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .try_init();
        logs
    }

    /// A subscriber for this thread only (until the guard drops), filtered by `filter`,
    /// that writes here: with `#[tokio::test]`'s one thread, it sees the bus's tasks and
    /// no other test's.
    #[allow(dead_code)]
    pub(crate) fn scoped(filter: &str) -> (LogBuffer, tracing::subscriber::DefaultGuard) {
        let logs = LogBuffer::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// The lines written so far.
    pub(crate) fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// How many lines contain `needle`.
    #[allow(dead_code)]
    pub(crate) fn count(&self, needle: &str) -> usize {
        self.lines().iter().filter(|l| l.contains(needle)).count()
    }

    /// The lines written since the last call, taken out.
    #[allow(dead_code)]
    pub(crate) fn take(&self) -> Vec<String> {
        let bytes = std::mem::take(&mut *self.0.lock().unwrap());
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}
