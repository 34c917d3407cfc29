//! The process group of a command `pgbus consume --exec` runs: the shell and everything
//! it started (unless a process left the group on purpose, with `setsid` or `setpgid`).
//!
//! Every group is ended by pgbus: [`Group::end`] stops what is left of it with SIGTERM,
//! a grace period, then SIGKILL, and returns once nothing of it runs; a group dropped
//! without being ended (a future dropped at shutdown) is killed with SIGKILL at once.
//!
//! And however pgbus ends (SIGKILL, a crash), the groups end with it: each is registered
//! with a [`Watchdog`], a small shell of pgbus's own that reads the group numbers from a
//! pipe whose only write end pgbus holds. When pgbus dies the kernel closes that end; the
//! watchdog reads the end of its input and kills every group still registered.

use std::io::Write as _;
use std::process::{Child, ChildStdin, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};

/// How often a group is looked at while it is given time to stop.
const POLL: Duration = Duration::from_millis(20);

/// How long a group killed with SIGKILL may take to be gone (the kernel ends its
/// processes at once; a process in uninterruptible sleep, say on NFS, may take longer).
const KILLED_WITHIN: Duration = Duration::from_secs(5);

/// The watchdog: registers (`+ PGID`) and unregisters (`- PGID`) groups, one a line,
/// until its input ends, then kills what is registered. It ignores the signals that
/// would end it with pgbus (a Ctrl-C at the terminal, a supervisor's SIGTERM), and is
/// in a process group of its own.
const WATCHDOG: &str = r#"trap '' INT TERM HUP QUIT USR1 USR2 PIPE ALRM
live=' '
while read -r op pgid; do
  case $pgid in ''|*[!0-9]*) continue ;; esac
  case $op in
    +) live="$live$pgid " ;;
    -) case $live in *" $pgid "*) live="${live%% $pgid *} ${live#* $pgid }" ;; esac ;;
  esac
done
for pgid in $live; do kill -9 "-$pgid" 2>/dev/null; done
"#;

/// The process that kills the registered groups when pgbus dies (see the module's
/// documentation).
#[derive(Debug)]
pub(crate) struct Watchdog {
    input: Mutex<Option<ChildStdin>>,
    child: Mutex<Child>,
}

impl Watchdog {
    /// Starts the watchdog.
    pub(crate) fn start() -> std::io::Result<Arc<Watchdog>> {
        use std::os::unix::process::CommandExt as _;
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("pgbus-watchdog")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        let input = child.stdin.take();
        Ok(Arc::new(Watchdog {
            input: Mutex::new(input),
            child: Mutex::new(child),
        }))
    }

    /// Writes one line to the watchdog (a few bytes: never blocks while it reads).
    fn tell(&self, line: &str) {
        let mut input = self.input.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(pipe) = input.as_mut()
            && let Err(e) = pipe.write_all(line.as_bytes())
        {
            eprintln!(
                "pgbus: warning: the watchdog of the commands' process groups is gone ({e}): \
                 should pgbus be killed, the commands running then would run on"
            );
            *input = None;
        }
    }

    /// Stops the watchdog (every group is gone by now): its input is closed, and it is
    /// waited for a moment.
    pub(crate) async fn stop(&self) {
        drop(self.input.lock().unwrap_or_else(|p| p.into_inner()).take());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while tokio::time::Instant::now() < deadline {
            let exited = self
                .child
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .try_wait()
                .map_or(true, |status| status.is_some());
            if exited {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// A command's process group, killed when dropped unless [`Group::end`] ran.
#[derive(Debug)]
pub(crate) struct Group {
    pgid: Option<Pid>,
    watchdog: Option<Arc<Watchdog>>,
}

impl Group {
    /// The group led by `leader`, a process started with `process_group(0)`, registered
    /// with `watchdog`.
    pub(crate) fn led_by(leader: Option<u32>, watchdog: Option<Arc<Watchdog>>) -> Group {
        let pgid = leader
            .and_then(|p| i32::try_from(p).ok())
            .and_then(Pid::from_raw);
        if let (Some(pgid), Some(watchdog)) = (pgid, &watchdog) {
            watchdog.tell(&format!("+ {}\n", pgid.as_raw_pid()));
        }
        Group { pgid, watchdog }
    }

    /// Forgets the group, once gone (or killed): the watchdog no longer watches it.
    fn forget(&mut self) {
        if let (Some(pgid), Some(watchdog)) = (self.pgid.take(), &self.watchdog) {
            watchdog.tell(&format!("- {}\n", pgid.as_raw_pid()));
        }
    }

    /// Sends `signal` to every process of the group (a group already gone is fine).
    pub(crate) fn signal(&self, signal: Signal) {
        if let Some(pgid) = self.pgid {
            let _ = kill_process_group(pgid, signal);
        }
    }

    /// Whether a process of the group still runs. Zombies do not count: they run
    /// nothing, and an orphan's zombie stays until its new parent reaps it (which a
    /// container's init may never do). Read from /proc; where it cannot be read, any
    /// process (zombies included) counts.
    pub(crate) fn alive(&self) -> bool {
        let Some(pgid) = self.pgid else {
            return false;
        };
        match std::fs::read_dir("/proc") {
            Ok(entries) => entries.flatten().any(|entry| {
                let name = entry.file_name();
                let Some(name) = name.to_str() else {
                    return false;
                };
                if !name.bytes().all(|b| b.is_ascii_digit()) {
                    return false;
                }
                std::fs::read_to_string(entry.path().join("stat"))
                    .ok()
                    .and_then(|stat| running_in_group(&stat))
                    == Some(pgid.as_raw_pid())
            }),
            Err(_) => test_kill_process_group(pgid).is_ok(),
        }
    }

    /// Ends the group: if anything of it still runs, SIGTERM, then up to `grace` for it
    /// to stop, then SIGKILL; returns once nothing of it runs (or, for a process SIGKILL
    /// cannot end at once, after a bound).
    pub(crate) async fn end(&mut self, grace: Duration) {
        if self.alive() {
            self.signal(Signal::TERM);
            let deadline = tokio::time::Instant::now() + grace;
            while self.alive() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(POLL).await;
            }
        }
        self.kill().await;
    }

    /// Kills what is left of the group with SIGKILL and waits until nothing of it runs
    /// (bounded).
    pub(crate) async fn kill(&mut self) {
        if self.alive() {
            self.signal(Signal::KILL);
            let deadline = tokio::time::Instant::now() + KILLED_WITHIN;
            while self.alive() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(POLL).await;
            }
        }
        self.forget();
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Not ended (its future was dropped): nothing may outlive pgbus, and there is no
        // time left for a grace period.
        self.signal(Signal::KILL);
        self.forget();
    }
}

/// The process group of a running (not zombie) process, from its `/proc/PID/stat`.
fn running_in_group(stat: &str) -> Option<i32> {
    // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    (state != "Z" && state != "X").then_some(pgrp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_give_the_group_of_running_processes_only() {
        assert_eq!(running_in_group("12 (sh) S 1 12 12 0 -1 4194560"), Some(12));
        assert_eq!(running_in_group("13 (a (b) c) R 12 12 12 0 -1 0"), Some(12));
        assert_eq!(running_in_group("14 (sleep) Z 1 12 12 0 -1 0"), None);
        assert_eq!(running_in_group("garbage"), None);
    }
}
