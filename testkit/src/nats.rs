//! A NATS server with JetStream for tests: `nats-server -js` on a free port of
//! `127.0.0.1`, with a store directory of its own.
//!
//! [`NatsServer::start`] runs the system's `nats-server` (found on `PATH` or at
//! [`DEBIAN_NATS_SERVER`]) and waits until a client connection gets the server's `INFO`
//! line. It never uses a server already running (Debian's package starts one on 4222).
//! [`NatsServer::restart`] stops it and starts it again on the same port with the same
//! store, as an operator's restart would. Dropping it stops the server and removes its
//! directory; so does the end of the process that started it, however it ends (a
//! guardian process waits for the end of a pipe only that process holds).
//!
//! ```no_run
//! # async fn example() {
//! let nats = pgbus_testkit::nats::NatsServer::start().await.unwrap();
//! let url = nats.url(); // nats://127.0.0.1:<port>
//! # let _ = url;
//! # }
//! ```

use std::fs;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::AsyncBufReadExt;

use crate::FixtureError;
use crate::process::{self, io_error};

/// Where Debian and Ubuntu's `nats-server` package installs the program.
pub const DEBIAN_NATS_SERVER: &str = "/usr/sbin/nats-server";

/// The address the server listens on.
pub const HOST: &str = "127.0.0.1";

/// How long a start waits for the server to greet a client.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How many free ports a first start tries, should another process take the one chosen.
const START_ATTEMPTS: usize = 3;

/// A running `nats-server -js`; see the [module](self) documentation.
#[derive(Debug)]
pub struct NatsServer {
    program: PathBuf,
    /// Options added to `nats-server`'s command line (e.g. `--user`, `--pass`).
    extra: Vec<String>,
    child: Option<Child>,
    guardian: Option<(Child, ChildStdin)>,
    dir: PathBuf,
    port: u16,
}

/// The `nats-server` program: on `PATH`, else at [`DEBIAN_NATS_SERVER`].
///
/// # Errors
///
/// [`FixtureError::NatsServerNotFound`], which says how to install it.
pub fn find_nats_server() -> Result<PathBuf, FixtureError> {
    process::find_program("nats-server", DEBIAN_NATS_SERVER).ok_or(FixtureError::NatsServerNotFound)
}

impl NatsServer {
    /// Starts `nats-server -js` on a free port with a new store directory and waits until
    /// it greets a client.
    ///
    /// # Errors
    ///
    /// [`FixtureError::NatsServerNotFound`] (with how to install it),
    /// [`FixtureError::NatsServerExited`] or [`FixtureError::NatsServerNotReady`] with the
    /// end of its log, [`FixtureError::Io`].
    pub async fn start() -> Result<NatsServer, FixtureError> {
        Self::start_with(&[]).await
    }

    /// [`start`](Self::start) with more options for `nats-server` (e.g. `["--user", "relay",
    /// "--pass", "secret"]`: clients must then authenticate).
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn start_with(options: &[&str]) -> Result<NatsServer, FixtureError> {
        let program = find_nats_server()?;
        let mut attempt = 1;
        loop {
            let dir = crate::embedded::unique_dir(&std::env::temp_dir(), "pgbus-nats-")?;
            let mut server = NatsServer {
                program: program.clone(),
                extra: options.iter().map(|o| o.to_string()).collect(),
                child: None,
                guardian: None,
                dir,
                port: crate::free_port()?,
            };
            match server.run().await {
                Err(FixtureError::NatsServerExited { log, .. })
                    if attempt < START_ATTEMPTS && log.contains("address already in use") =>
                {
                    attempt += 1;
                }
                Err(e) => return Err(e),
                Ok(()) => return Ok(server),
            }
        }
    }

    /// Starts the process (on [`port`](Self::port), with the store in the directory) and
    /// its guardian, and waits until it is ready.
    async fn run(&mut self) -> Result<(), FixtureError> {
        let log = self.dir.join("nats-server.log");
        let child = Command::new(&self.program)
            .arg("-js")
            .args(["-a", HOST, "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(self.dir.join("store"))
            .arg("-l")
            .arg(&log)
            .args(&self.extra)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io_error(format!("starting {}", self.program.display())))?;
        let pid = child.id();
        self.child = Some(child);
        self.guardian = Some(process::spawn_guardian("nats-server", pid, &self.dir)?);
        self.wait_ready().await
    }

    /// Connects until the server sends its `INFO` line, it exits, or [`READY_TIMEOUT`]
    /// passes.
    async fn wait_ready(&mut self) -> Result<(), FixtureError> {
        let started = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child
                    .try_wait()
                    .map_err(io_error("waiting for nats-server"))?
            {
                return Err(FixtureError::NatsServerExited {
                    status,
                    log: self.log_tail(),
                });
            }
            let last_error = match greeting(self.port).await {
                Ok(line) if line.starts_with("INFO ") && line.contains("\"jetstream\":true") => {
                    return Ok(());
                }
                Ok(line) => format!("it sent {line:?}"),
                Err(e) => e.to_string(),
            };
            if started.elapsed() >= READY_TIMEOUT {
                return Err(FixtureError::NatsServerNotReady {
                    waited: READY_TIMEOUT,
                    last_error,
                    log: self.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the server (SIGTERM: it flushes its store) and starts it again on the same
    /// port with the same store, then waits until it is ready.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn restart(&mut self) -> Result<(), FixtureError> {
        self.stop();
        self.run().await
    }

    /// Starts a [stopped](Self::stop) server again on the same port with the same store,
    /// and waits until it is ready; a running one is restarted.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn start_again(&mut self) -> Result<(), FixtureError> {
        self.restart().await
    }

    /// Stops the server (SIGTERM, then SIGKILL after 5 s), keeping its store for
    /// [`start_again`](Self::start_again). Clients see an outage until then.
    pub fn stop(&mut self) {
        process::dismiss(self.guardian.take());
        if let Some(mut child) = self.child.take() {
            process::stop(&mut child);
        }
    }

    /// The end of the server's log.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.dir.join("nats-server.log"))
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://{HOST}:{}", self.port)
    }
}

/// The first line a new connection to the server receives.
async fn greeting(port: u16) -> std::io::Result<String> {
    let connect = async {
        let stream = tokio::net::TcpStream::connect((HOST, port)).await?;
        let mut line = String::new();
        tokio::io::BufReader::new(stream)
            .read_line(&mut line)
            .await?;
        Ok(line)
    };
    tokio::time::timeout(Duration::from_secs(2), connect)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
