//! What the fixtures that run a server program share: finding the program, the guardian
//! that stops it when the test process dies, stopping it, and the end of its log.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::FixtureError;

/// How long a stop waits for the program to exit after SIGTERM before it kills it.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// How many lines of a log an error reports.
const LOG_TAIL_LINES: usize = 30;

/// Stops the program (`$1`, only if that process's name still contains `$3`) with
/// SIGTERM and removes its directory (`$2`) when the process that started it ends, however
/// it ends: it waits for the end of its standard input, whose other end only that
/// process holds.
const GUARDIAN_SCRIPT: &str = r#"read -r _
if [ -r "/proc/$1/comm" ]; then name=$(cat "/proc/$1/comm"); else name=$(ps -o comm= -p "$1"); fi
case "$name" in *"$3"*) kill -TERM "$1" ;; esac
rm -rf "$2"
"#;

/// The program `name`: on `PATH`, else at `fallback` (where Debian installs it).
pub(crate) fn find_program(name: &str, fallback: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    on_path.or_else(|| Some(PathBuf::from(fallback)).filter(|p| p.is_file()))
}

pub(crate) fn io_error(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> FixtureError {
    let action = action.into();
    move |source| FixtureError::Io { action, source }
}

/// Starts the guardian of process `pid` (named like `name`), which stops it and removes
/// `dir` once the returned standard input closes.
pub(crate) fn spawn_guardian(
    name: &str,
    pid: u32,
    dir: &Path,
) -> Result<(Child, ChildStdin), FixtureError> {
    let mut guardian = Command::new("/bin/sh")
        .arg("-c")
        .arg(GUARDIAN_SCRIPT)
        .arg(format!("pgbus-{name}-guardian"))
        .arg(pid.to_string())
        .arg(dir)
        .arg(name)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C at the terminal must not kill it before it has
        // cleaned up.
        .process_group(0)
        .spawn()
        .map_err(io_error(format!(
            "starting {name}'s guardian process (/bin/sh)"
        )))?;
    let stdin = guardian.stdin.take().expect("stdin is piped");
    Ok((guardian, stdin))
}

/// Stops a guardian without its clean-up.
pub(crate) fn dismiss(guardian: Option<(Child, ChildStdin)>) {
    if let Some((mut guardian, stdin)) = guardian {
        let _ = guardian.kill();
        let _ = guardian.wait();
        drop(stdin);
    }
}

/// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]; waits for the end.
pub(crate) fn stop(child: &mut Child) {
    // Only while the child is not yet reaped: until then its pid names no other process.
    if let (Ok(None), Some(pid)) = (
        child.try_wait(),
        i32::try_from(child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw),
    ) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + STOP_TIMEOUT;
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The last lines of the log at `path`.
pub(crate) fn log_tail(path: &Path) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}
