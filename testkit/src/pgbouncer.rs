//! PgBouncer in transaction mode in front of a test server, configured to make pooler bugs
//! fail every time instead of now and then.
//!
//! [`PgBouncer::start`] runs the system's `pgbouncer` (found on `PATH` or at
//! [`DEBIAN_PGBOUNCER`]; as root, it runs as the `postgres` user, since PgBouncer refuses
//! to run as root) on a free port of `127.0.0.1`, in front of every database of the server
//! a configuration names (each client's database is the server's database of that name).
//! Its configuration is hostile but legal:
//!
//! - `pool_mode = transaction`: each transaction gets whichever server connection is
//!   free, and `default_pool_size = 4` gives it several;
//! - `server_reset_query = DISCARD ALL` with `server_reset_query_always = 1`: when a
//!   transaction ends, its server connection forgets everything, so a named prepared
//!   statement or a session `SET` never outlives the transaction that made it, even if
//!   the next transaction happens to get the same connection;
//! - no `ignore_startup_parameters`: a client that sends the startup parameter `options`
//!   is refused (`unsupported startup parameter: options`), as by PgBouncer's defaults in
//!   production;
//! - `max_prepared_statements = 0` where the version has it (1.21 and later): no
//!   tracking of protocol-level prepared statements.
//!
//! Clients connect without a password (`auth_type = trust`, the server's user only); the
//! pooler logs in to the server with the user and password of the configuration it was
//! given. Dropping it stops PgBouncer and removes its directory; so does the end of the
//! process (a [`shared`] one is never dropped).
//!
//! ```no_run
//! # async fn example() {
//! let db = pgbus_testkit::test_db().await;
//! let pooler = pgbus_testkit::pgbouncer::shared().await;
//! // A `DATABASE_URL` for a client that goes through the pooler to the test's database.
//! let url = pooler.url_for(db.name());
//! # let _ = url;
//! # }
//! ```

use std::fmt::Write as _;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use tokio_postgres::Config;
use tokio_postgres::config::Host;

use crate::FixtureError;
use crate::embedded::{self, RunAs};
use crate::process::{self, io_error};

/// Where Debian and Ubuntu's `pgbouncer` package installs the program.
pub const DEBIAN_PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// The address PgBouncer listens on.
pub const HOST: &str = "127.0.0.1";

/// How many server connections each database and user may have.
pub const POOL_SIZE: u32 = 4;

/// How long a start waits for PgBouncer to run a query.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How many free ports a start tries, should another process take the one chosen.
const START_ATTEMPTS: usize = 3;

/// A running PgBouncer; see the [module](self) documentation.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    guardian: Option<(Child, ChildStdin)>,
    dir: PathBuf,
    port: u16,
    user: String,
    database: String,
}

static SHARED: tokio::sync::OnceCell<PgBouncer> = tokio::sync::OnceCell::const_new();

/// One PgBouncer shared by every test of this process, in front of the server that
/// [`test_db`](crate::test_db) makes its databases on (the shared throwaway cluster, or
/// `DATABASE_URL`'s server): `url_for(db.name())` reaches a test's database through it.
///
/// # Panics
///
/// When it cannot be started (the message says why, e.g. how to install PgBouncer).
pub async fn shared() -> &'static PgBouncer {
    SHARED
        .get_or_init(|| async {
            let server = crate::harness::server_config().await;
            PgBouncer::start(&server)
                .await
                .unwrap_or_else(|e| panic!("starting PgBouncer: {e}"))
        })
        .await
}

/// The `pgbouncer` program: on `PATH`, else at [`DEBIAN_PGBOUNCER`].
///
/// # Errors
///
/// [`FixtureError::PgBouncerNotFound`], which says how to install it.
pub fn find_pgbouncer() -> Result<PathBuf, FixtureError> {
    process::find_program("pgbouncer", DEBIAN_PGBOUNCER).ok_or(FixtureError::PgBouncerNotFound)
}

/// `(major, minor)` of the program, from `pgbouncer --version` (`PgBouncer 1.18.0`).
fn version(program: &Path) -> Option<(u32, u32)> {
    let out = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let number = text.lines().next()?.split_whitespace().nth(1)?;
    let mut parts = number.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

/// Where PgBouncer sends its server connections, from the configuration it fronts.
#[derive(Debug, Clone)]
struct Target {
    host: String,
    port: u16,
    user: String,
    password: Option<String>,
    database: String,
}

impl Target {
    fn from_config(config: &Config) -> Result<Self, FixtureError> {
        let bad = |what: &str| FixtureError::PgBouncerTarget(what.to_owned());
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(name)) => name.clone(),
            Some(Host::Unix(path)) => path
                .to_str()
                .ok_or_else(|| bad("the socket directory's path is not UTF-8"))?
                .to_owned(),
            None => return Err(bad("the configuration names no host")),
        };
        let target = Target {
            host,
            port: config.get_ports().first().copied().unwrap_or(5432),
            user: config
                .get_user()
                .ok_or_else(|| bad("the configuration names no user"))?
                .to_owned(),
            password: config
                .get_password()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
            database: config.get_dbname().unwrap_or("postgres").to_owned(),
        };
        let values = [&target.host, &target.user]
            .into_iter()
            .chain(target.password.as_ref());
        for value in values {
            if value.contains(['\'', '"', '\n', '\r', '\\']) {
                return Err(bad(
                    "a host, user or password holds a quote, a backslash or a line break",
                ));
            }
        }
        Ok(target)
    }
}

/// `pgbouncer.ini`.
fn ini(dir: &Path, port: u16, target: &Target, tracks_prepared: bool) -> String {
    let mut server = format!(
        "host='{}' port={} user='{}'",
        target.host, target.port, target.user
    );
    if let Some(password) = &target.password {
        let _ = write!(server, " password='{password}'");
    }
    let mut ini = format!(
        "; Written by pgbus_testkit::pgbouncer.\n\
         [databases]\n\
         * = {server}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = {HOST}\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = trust\n\
         auth_file = {auth}\n\
         logfile = {log}\n\
         pool_mode = transaction\n\
         default_pool_size = {POOL_SIZE}\n\
         min_pool_size = 0\n\
         reserve_pool_size = 0\n\
         max_client_conn = 500\n\
         server_reset_query = DISCARD ALL\n\
         server_reset_query_always = 1\n",
        auth = dir.join("userlist.txt").display(),
        log = dir.join("pgbouncer.log").display(),
    );
    if tracks_prepared {
        ini.push_str("max_prepared_statements = 0\n");
    }
    ini
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server `server` connects to (its first host and
    /// port, its user and password), and waits until a query through it succeeds.
    /// [`url`](Self::url) reaches `server`'s database, [`url_for`](Self::url_for) any
    /// other of that server.
    ///
    /// # Errors
    ///
    /// [`FixtureError::PgBouncerNotFound`] (with how to install it),
    /// [`FixtureError::PgBouncerTarget`] for a configuration it cannot use,
    /// [`FixtureError::PgBouncerExited`] or [`FixtureError::PgBouncerNotReady`] with the
    /// end of its log, [`FixtureError::Embedded`] when running as root without a
    /// `postgres` user, [`FixtureError::Io`].
    pub async fn start(server: &Config) -> Result<PgBouncer, FixtureError> {
        let program = find_pgbouncer()?;
        let target = Target::from_config(server)?;
        let tracks_prepared = version(&program).is_some_and(|v| v >= (1, 21));
        let run_as = embedded::server_user()?;
        let tmp = std::env::temp_dir();
        if let Some(user) = run_as {
            embedded::check_reachable(&tmp.join("x"), user)?;
        }
        let mut attempt = 1;
        loop {
            let dir = embedded::unique_dir(&tmp, "pgbus-pgbouncer-")?;
            let started =
                Self::start_in(&program, dir.clone(), &target, tracks_prepared, run_as).await;
            match started {
                Err(FixtureError::PgBouncerExited { log, .. })
                    if attempt < START_ATTEMPTS && log.contains("Address already in use") =>
                {
                    let _ = fs::remove_dir_all(&dir);
                    attempt += 1;
                }
                Err(e) => {
                    let _ = fs::remove_dir_all(&dir);
                    return Err(e);
                }
                Ok(pgbouncer) => return Ok(pgbouncer),
            }
        }
    }

    async fn start_in(
        program: &Path,
        dir: PathBuf,
        target: &Target,
        tracks_prepared: bool,
        run_as: Option<RunAs>,
    ) -> Result<PgBouncer, FixtureError> {
        embedded::chown(&dir, run_as)?;
        let port = crate::free_port()?;
        let user_line = format!("\"{}\" \"\"\n", target.user);
        embedded::write_private_file(&dir, "userlist.txt", user_line.as_bytes(), run_as)?;
        let ini = ini(&dir, port, target, tracks_prepared);
        let ini_path = embedded::write_private_file(&dir, "pgbouncer.ini", ini.as_bytes(), run_as)?;
        let mut cmd = Command::new(program);
        cmd.arg(&ini_path)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(user) = run_as {
            cmd.uid(user.uid).gid(user.gid);
        }
        let child = cmd
            .spawn()
            .map_err(io_error(format!("starting {}", program.display())))?;
        let mut pgbouncer = PgBouncer {
            child,
            guardian: None,
            dir,
            port,
            user: target.user.clone(),
            database: target.database.clone(),
        };
        // From here on, dropping `pgbouncer` on an error stops it.
        pgbouncer.guardian = Some(pgbouncer.spawn_guardian()?);
        pgbouncer.wait_ready().await?;
        Ok(pgbouncer)
    }

    fn spawn_guardian(&self) -> Result<(Child, ChildStdin), FixtureError> {
        process::spawn_guardian("pgbouncer", self.child.id(), &self.dir)
    }

    /// Connects and runs a query through the pooler (which connects to the server), until
    /// that works or PgBouncer exits or [`READY_TIMEOUT`] passes.
    async fn wait_ready(&mut self) -> Result<(), FixtureError> {
        let started = Instant::now();
        let mut config = self.config();
        config.connect_timeout(Duration::from_secs(2));
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .map_err(io_error("waiting for pgbouncer"))?
            {
                return Err(FixtureError::PgBouncerExited {
                    status,
                    log: self.log_tail(),
                });
            }
            let last_error = match crate::connect(&config).await {
                Ok(client) => match client.simple_query("SELECT 1").await {
                    Ok(_) => return Ok(()),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            if started.elapsed() >= READY_TIMEOUT {
                return Err(FixtureError::PgBouncerNotReady {
                    waited: READY_TIMEOUT,
                    last_error,
                    log: self.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The end of PgBouncer's log.
    pub fn log_tail(&self) -> String {
        process::log_tail(&self.dir.join("pgbouncer.log"))
    }

    /// The address PgBouncer listens on, [`HOST`].
    pub fn host(&self) -> &'static str {
        HOST
    }

    /// The port PgBouncer listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A configuration that reaches, through the pooler, the database of the server
    /// configuration it was started with.
    pub fn config(&self) -> Config {
        self.config_for(&self.database)
    }

    /// A configuration that reaches, through the pooler, the server's database `dbname`.
    pub fn config_for(&self, dbname: &str) -> Config {
        let mut config = Config::new();
        config
            .host(HOST)
            .port(self.port)
            .user(&self.user)
            .dbname(dbname);
        config
    }

    /// A libpq `key=value` connection string for [`config`](Self::config), e.g. for a
    /// child process's `DATABASE_URL`.
    pub fn url(&self) -> String {
        crate::conninfo(&self.config())
    }

    /// A libpq `key=value` connection string for [`config_for`](Self::config_for).
    pub fn url_for(&self, dbname: &str) -> String {
        crate::conninfo(&self.config_for(dbname))
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        process::dismiss(self.guardian.take());
        // SIGTERM: PgBouncer closes its connections and exits at once.
        process::stop(&mut self.child);
        let _ = fs::remove_dir_all(&self.dir);
    }
}
