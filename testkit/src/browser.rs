//! A headless Chromium for tests, driven over WebDriver: the system's `chromedriver` on a
//! free port of `127.0.0.1`, with a directory of its own for its log and the browser's
//! profile.
//!
//! [`Chromedriver::start`] runs `chromedriver` (found on `PATH` or at
//! [`DEBIAN_CHROMEDRIVER`]) and waits until its `/status` says it is ready.
//! [`Chromedriver::capabilities`] are what a WebDriver client's new session asks for:
//! Chromium ([`find_chromium`]) headless, with the flags it needs as root and on a closed
//! network (no sandbox, no GPU, no background networking, component updates or sync)
//! and a new profile directory. Dropping it stops chromedriver (and so its browsers) and
//! removes its directory; so does the end of the process that started it, however it
//! ends (a guardian process waits for the end of a pipe only that process holds).
//!
//! ```no_run
//! # async fn example() {
//! let driver = pgbus_testkit::browser::Chromedriver::start().await.unwrap();
//! let url = driver.url(); // http://127.0.0.1:<port>
//! let capabilities = driver.capabilities(); // for the client's new session
//! # let _ = (url, capabilities);
//! # }
//! ```

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::FixtureError;
use crate::process::{self, io_error};

/// Where Debian's `chromium-driver` package installs chromedriver.
pub const DEBIAN_CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Where Debian's `chromium` package installs the browser.
pub const DEBIAN_CHROMIUM: &str = "/usr/bin/chromium";

/// The address chromedriver listens on.
pub const HOST: &str = "127.0.0.1";

/// How long a start waits for chromedriver to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How many free ports a start tries, should another process take the one chosen.
const START_ATTEMPTS: usize = 3;

/// The browser: `chromium` on `PATH`, else at [`DEBIAN_CHROMIUM`].
///
/// # Errors
///
/// [`FixtureError::BrowserNotFound`], which says how to install it.
pub fn find_chromium() -> Result<PathBuf, FixtureError> {
    process::find_program("chromium", DEBIAN_CHROMIUM).ok_or(FixtureError::BrowserNotFound {
        program: "chromium",
        fallback: DEBIAN_CHROMIUM,
    })
}

/// The driver: `chromedriver` on `PATH`, else at [`DEBIAN_CHROMEDRIVER`].
///
/// # Errors
///
/// [`FixtureError::BrowserNotFound`], which says how to install it.
pub fn find_chromedriver() -> Result<PathBuf, FixtureError> {
    process::find_program("chromedriver", DEBIAN_CHROMEDRIVER).ok_or(
        FixtureError::BrowserNotFound {
            program: "chromedriver",
            fallback: DEBIAN_CHROMEDRIVER,
        },
    )
}

/// A running chromedriver; see the [module](self) documentation.
#[derive(Debug)]
pub struct Chromedriver {
    chromium: PathBuf,
    child: Option<Child>,
    guardian: Option<(Child, ChildStdin)>,
    dir: PathBuf,
    port: u16,
}

impl Chromedriver {
    /// Starts chromedriver on a free port with a new directory and waits until it is
    /// ready.
    ///
    /// # Errors
    ///
    /// [`FixtureError::BrowserNotFound`] (with how to install it),
    /// [`FixtureError::ChromedriverExited`] or [`FixtureError::ChromedriverNotReady`]
    /// with the end of its log, [`FixtureError::Io`].
    pub async fn start() -> Result<Chromedriver, FixtureError> {
        let chromium = find_chromium()?;
        let program = find_chromedriver()?;
        let mut attempt = 1;
        loop {
            let dir = crate::embedded::unique_dir(&std::env::temp_dir(), "pgbus-chromedriver-")?;
            let mut driver = Chromedriver {
                chromium: chromium.clone(),
                child: None,
                guardian: None,
                dir,
                port: crate::free_port()?,
            };
            match driver.run(&program).await {
                Err(FixtureError::ChromedriverExited { log, .. })
                    if attempt < START_ATTEMPTS
                        && (log.contains("Address already in use")
                            || log.contains("bind() failed")) =>
                {
                    attempt += 1;
                }
                Err(e) => return Err(e),
                Ok(()) => return Ok(driver),
            }
        }
    }

    /// Starts the process and its guardian, and waits until it is ready.
    async fn run(&mut self, program: &Path) -> Result<(), FixtureError> {
        let log = self.dir.join("chromedriver.log");
        let child = Command::new(program)
            .arg(format!("--port={}", self.port))
            .arg(format!("--log-path={}", log.display()))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A process group of its own, with the browsers it starts: stopping it stops
            // them too.
            .process_group(0)
            .spawn()
            .map_err(io_error(format!("starting {}", program.display())))?;
        let pid = child.id();
        self.child = Some(child);
        self.guardian = Some(process::spawn_guardian("chromedriver", pid, &self.dir)?);
        self.wait_ready().await
    }

    /// Asks `/status` until it says ready, chromedriver exits, or [`READY_TIMEOUT`] passes.
    async fn wait_ready(&mut self) -> Result<(), FixtureError> {
        let started = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child
                    .try_wait()
                    .map_err(io_error("waiting for chromedriver"))?
            {
                return Err(FixtureError::ChromedriverExited {
                    status,
                    log: self.log_tail(),
                });
            }
            let last_error = match status(self.port).await {
                Ok(body) if body.contains("\"ready\":true") => return Ok(()),
                Ok(body) => format!("it answered {body:?}"),
                Err(e) => e.to_string(),
            };
            if started.elapsed() >= READY_TIMEOUT {
                return Err(FixtureError::ChromedriverNotReady {
                    waited: READY_TIMEOUT,
                    last_error,
                    log: self.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The WebDriver capabilities of a new session: headless Chromium with the flags it
    /// needs as root on a closed network, and a profile directory of its own under this
    /// driver's directory (a new one per call).
    pub fn capabilities(&self) -> serde_json::Map<String, serde_json::Value> {
        let profile = self
            .dir
            .join(format!("profile-{}", fastrand::u64(..)))
            .display()
            .to_string();
        let args = [
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            "--window-size=1280,900".into(),
            format!("--user-data-dir={profile}"),
        ];
        let value = serde_json::json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": self.chromium.display().to_string(),
                "args": args,
            },
        });
        match value {
            serde_json::Value::Object(map) => map,
            _ => unreachable!("a JSON object"),
        }
    }

    /// The end of chromedriver's log.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.dir.join("chromedriver.log"))
    }

    /// The port chromedriver listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The WebDriver URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{HOST}:{}", self.port)
    }

    /// A directory of this driver's, removed with it (for a test's files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops chromedriver and the browsers it started (SIGTERM to its process group, then
    /// SIGKILL to chromedriver after 5 s).
    pub fn stop(&mut self) {
        process::dismiss(self.guardian.take());
        if let Some(mut child) = self.child.take() {
            // Only while the child is not yet reaped: until then its pid names no other
            // process group.
            if let (Ok(None), Some(pid)) = (
                child.try_wait(),
                i32::try_from(child.id())
                    .ok()
                    .and_then(rustix::process::Pid::from_raw),
            ) {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::TERM);
            }
            process::stop(&mut child);
        }
    }
}

/// The body of `GET /status` (HTTP/1.1: chromedriver refuses 1.0), white space removed.
async fn status(port: u16) -> std::io::Result<String> {
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect((HOST, port)).await?;
        stream
            .write_all(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await?;
        // chromedriver keeps the connection open: read up to the body's length.
        let mut answer = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = stream.read(&mut chunk).await?;
            answer.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&answer).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head.lines().find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())
                        .flatten()
                });
                if n == 0 || length.is_some_and(|l| body.len() >= l) {
                    return Ok(body.replace(char::is_whitespace, ""));
                }
            } else if n == 0 {
                return Ok(String::new());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
