//! The process group of a command `pgbus consume --exec` runs: the shell and everything
//! it started (unless a process left the group on purpose, with `setsid` or `setpgid`).
//!
//! Every group is ended by pgbus: [`Group::end`] stops what is left of it with SIGTERM,
//! a grace period, then SIGKILL; a group dropped without being ended (a future dropped at
//! shutdown) is killed with SIGKILL at once.

use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};

/// How often a group is looked at while it is given time to stop.
const POLL: Duration = Duration::from_millis(20);

/// A command's process group, killed when dropped unless [`Group::end`] ran.
#[derive(Debug)]
pub(crate) struct Group {
    pgid: Option<Pid>,
}

impl Group {
    /// The group led by `leader`, a process started with `process_group(0)`.
    pub(crate) fn led_by(leader: Option<u32>) -> Group {
        Group {
            pgid: leader
                .and_then(|p| i32::try_from(p).ok())
                .and_then(Pid::from_raw),
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
    /// to stop, then SIGKILL.
    pub(crate) async fn end(mut self, grace: Duration) {
        if self.alive() {
            self.signal(Signal::TERM);
            let deadline = tokio::time::Instant::now() + grace;
            while self.alive() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(POLL).await;
            }
            if self.alive() {
                self.signal(Signal::KILL);
            }
        }
        self.pgid = None;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Not ended (its future was dropped): nothing may outlive pgbus, and there is no
        // time left for a grace period.
        self.signal(Signal::KILL);
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
