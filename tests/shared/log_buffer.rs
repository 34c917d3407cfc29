//! The log lines a test's tracing subscriber writes, kept in memory
//! (`tracing_subscriber::fmt().with_writer(move || buffer.clone())`), shared by the tests
//! of what pgbus logs (`tests/log_noise.rs`, `tests/quiet_migrate.rs`, `tests/chaos.rs`).

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

/// What was logged, as the subscriber wrote it.
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
    /// Everything logged so far (e.g. to write it to a file).
    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }

    /// How many lines logged so far contain `needle`.
    pub(crate) fn count(&self, needle: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// The lines logged since the last call, taken out.
    pub(crate) fn take(&self) -> Vec<String> {
        let bytes = std::mem::take(&mut *self.0.lock().unwrap());
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}
