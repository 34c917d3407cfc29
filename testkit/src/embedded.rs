//! A throwaway local PostgreSQL server, for tests, demos and benchmarks.
//!
//! [`EmbeddedPostgres::start`] runs `initdb` in a new directory and starts a server that
//! listens only on a Unix socket inside that directory: never on TCP, so it cannot collide
//! with a server on port 5432, and nothing outside this machine can reach it (unless
//! [`EmbeddedOptions::tcp_address`] asks for a TCP address too, as the
//! [`tls`](crate::tls) fixture does, on a free port of the loopback). Dropping the
//! handle stops the server and removes the directory. So does the end of the process that
//! started it, even a crash or a `kill -9`: a small guardian process waits for it.
//!
//! The server binaries are found by [`find_bin_dir`]. `initdb` refuses to run as root, so
//! when this process is root the server runs as the `postgres` OS user.
//!
//! ```no_run
//! use pgbus_testkit::embedded::{EmbeddedOptions, EmbeddedPostgres};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = EmbeddedPostgres::start(EmbeddedOptions::default()).await?;
//! let (client, connection) = pg.config("postgres").connect(tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//! client.batch_execute("CREATE TABLE t (id int)").await?;
//! println!("DATABASE_URL={}", pg.url("postgres"));
//! # Ok(())
//! # }
//! ```

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Write as _};
use std::net::IpAddr;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The environment variable that names the directory holding `initdb` and `pg_ctl`,
/// searched before anything else.
pub const PG_BIN_DIR_ENV: &str = "PG_BIN_DIR";

/// Where Debian and Ubuntu install each major version's server binaries
/// (`<this>/<version>/bin`).
pub const DEBIAN_PG_LIB_DIR: &str = "/usr/lib/postgresql";

/// The default of [`EmbeddedOptions::durable`]: off, for fast tests.
pub const DEFAULT_DURABLE: bool = false;

/// The default of [`EmbeddedOptions::max_connections`]: enough for parallel tests.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 200;

/// The default of [`EmbeddedOptions::port`]. It only names the socket file
/// (`.s.PGSQL.<port>`) in the cluster's own socket directory, so it never collides with
/// another server.
pub const DEFAULT_PORT: u16 = 5432;

/// The OS user the server runs as when this process is root.
const SERVER_USER: &str = "postgres";

/// The superuser `initdb` creates, and the user every connection string names.
const SUPERUSER: &str = "postgres";

/// The file, inside the data directory, that holds the settings written by this module.
const SETTINGS_FILE: &str = "pgbus_embedded.conf";

/// How long `pg_ctl` waits for the server to start or stop, in seconds.
const PG_CTL_TIMEOUT_SECS: &str = "120";

/// How long a start waits for a killed postmaster to be reaped.
const ZOMBIE_REAP_TIMEOUT: Duration = Duration::from_secs(30);

/// How many lines of the server log a start failure reports.
const LOG_TAIL_LINES: usize = 40;

/// The longest socket file path a Unix socket address holds (`sun_path` is 108 bytes on
/// Linux, including the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Settings this module manages: overriding them could open a TCP port or hide the socket.
const MANAGED_SETTINGS: &[&str] = &["listen_addresses", "port", "unix_socket_directories"];

/// What can go wrong starting, stopping or finding an embedded server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmbeddedError {
    /// No directory holding both `initdb` and `pg_ctl` was found.
    #[error(
        "no PostgreSQL server binaries (initdb and pg_ctl) found; looked in {looked}; \
         install them (e.g. `apt-get install postgresql`) or set PG_BIN_DIR to the \
         directory that holds them"
    )]
    BinariesNotFound {
        /// Where the search looked.
        looked: String,
    },
    /// This process is root, and there is no `postgres` OS user to run the server as.
    #[error(
        "running as root, but there is no `postgres` user in /etc/passwd to run the server \
         as (initdb refuses to run as root)"
    )]
    NoServerUser,
    /// The server's OS user cannot reach the directory chosen for the cluster.
    #[error(
        "the `postgres` user cannot search {path}, so it cannot reach the cluster's \
         directory; choose a directory below world-searchable ones"
    )]
    Inaccessible {
        /// The first directory on the way that the server's user cannot search.
        path: PathBuf,
    },
    /// The data directory was made by another major version than the binaries found.
    #[error(
        "the cluster in {data_dir} was made by PostgreSQL {cluster}, but the binaries in \
         {bin_dir} are PostgreSQL {binaries}"
    )]
    VersionMismatch {
        /// The data directory.
        data_dir: PathBuf,
        /// The major version that made it (its `PG_VERSION` file).
        cluster: String,
        /// The binaries' directory.
        bin_dir: PathBuf,
        /// The binaries' major version.
        binaries: String,
    },
    /// A PostgreSQL program (`initdb`, `pg_ctl`) exited with an error.
    #[error("`{command}` failed ({status}){}", details(.output, .log))]
    Command {
        /// The program and what it was asked to do, e.g. `pg_ctl start`.
        command: String,
        /// How it exited.
        status: ExitStatus,
        /// What it printed (standard error, then standard output).
        output: String,
        /// The end of the server log, when the server was being started.
        log: Option<String>,
    },
    /// No server is running in the directory given to [`EmbeddedPostgres::attach`].
    #[error("no PostgreSQL server is running in {path}")]
    NotRunning {
        /// The cluster's directory.
        path: PathBuf,
    },
    /// A file passed with [`EmbeddedOptions::data_file`] has a name that is not a plain
    /// file name.
    #[error(
        "invalid data file name {name:?}: a plain file name is expected (no `/`, not `.` or `..`)"
    )]
    InvalidDataFile {
        /// The name given.
        name: String,
    },
    /// A setting passed with [`EmbeddedOptions::setting`] cannot be written.
    #[error("invalid setting `{name}`: {reason}")]
    InvalidSetting {
        /// The setting's name.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A file or process operation failed.
    #[error("{action}: {source}")]
    Io {
        /// What was being done, e.g. `creating /tmp/pgbus-1-ab12`.
        action: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

fn details(output: &str, log: &Option<String>) -> String {
    let mut s = String::new();
    if !output.trim().is_empty() {
        let _ = write!(s, ": {}", output.trim());
    }
    if let Some(log) = log.as_deref().filter(|l| !l.trim().is_empty()) {
        let _ = write!(s, "\nserver log (last lines):\n{}", log.trim_end());
    }
    s
}

fn io_error(action: impl Into<String>) -> impl FnOnce(io::Error) -> EmbeddedError {
    let action = action.into();
    move |source| EmbeddedError::Io { action, source }
}

/// Finds the directory that holds PostgreSQL's server programs (`initdb`, `pg_ctl`,
/// `postgres`).
///
/// Looks, in order, at the `PG_BIN_DIR` environment variable, at each directory on
/// `PATH` (following a symlinked `initdb` to the directory it lives in), and at
/// `/usr/lib/postgresql/<version>/bin`, choosing the newest major version there.
///
/// # Errors
///
/// [`EmbeddedError::BinariesNotFound`] when none of these holds both `initdb` and
/// `pg_ctl`, or when `PG_BIN_DIR` is set to a directory that does not.
pub fn find_bin_dir() -> Result<PathBuf, EmbeddedError> {
    if let Some(dir) = env::var_os(PG_BIN_DIR_ENV).filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if has_server_tools(&dir) {
            return Ok(dir);
        }
        return Err(EmbeddedError::BinariesNotFound {
            looked: format!("{PG_BIN_DIR_ENV}={}", dir.display()),
        });
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            if has_server_tools(&dir) {
                return Ok(resolve_links(dir));
            }
        }
    }
    if let Some(dir) = debian_bin_dirs().into_iter().next() {
        return Ok(dir);
    }
    Err(EmbeddedError::BinariesNotFound {
        looked: format!("${PG_BIN_DIR_ENV} (unset), $PATH, {DEBIAN_PG_LIB_DIR}/*/bin"),
    })
}

/// Whether `dir` holds executable `initdb` and `pg_ctl`.
fn has_server_tools(dir: &Path) -> bool {
    ["initdb", "pg_ctl"].iter().all(|tool| {
        fs::metadata(dir.join(tool)).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
    })
}

/// `/usr/local/bin/initdb` is often a symlink to `/usr/lib/postgresql/<v>/bin/initdb`:
/// prefer the real directory, which also holds `postgres` and its friends.
fn resolve_links(dir: PathBuf) -> PathBuf {
    fs::canonicalize(dir.join("initdb"))
        .ok()
        .and_then(|real| real.parent().map(Path::to_path_buf))
        .filter(|real| has_server_tools(real))
        .unwrap_or(dir)
}

/// `/usr/lib/postgresql/*/bin` that hold the server tools, newest version first.
pub(crate) fn debian_bin_dirs() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(DEBIAN_PG_LIB_DIR) else {
        return Vec::new();
    };
    let mut found: Vec<(Vec<u32>, PathBuf)> = entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = version_key(entry.file_name().to_str()?)?;
            let bin = entry.path().join("bin");
            has_server_tools(&bin).then_some((version, bin))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0));
    found.into_iter().map(|(_, dir)| dir).collect()
}

/// `"9.6"` → `[9, 6]`, `"16"` → `[16]`; `None` for anything that is not a version.
fn version_key(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// The major version of the binaries in `bin_dir`, from `pg_ctl --version`
/// (`pg_ctl (PostgreSQL) 15.14 (Debian 15.14-0+deb12u1)` → `15`).
pub(crate) fn binaries_major_version(bin_dir: &Path) -> Option<String> {
    let out = Command::new(bin_dir.join("pg_ctl"))
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split_whitespace().nth(2)?;
    let mut parts = version.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?;
    // Before PostgreSQL 10 the major version had two parts (`9.6`).
    match major.parse::<u32>().ok()? {
        m if m < 10 => Some(format!("{m}.{}", parts.next()?)),
        m => Some(m.to_string()),
    }
}

/// The binaries for an existing data directory: `PG_BIN_DIR` if set, else the Debian
/// directory of the version that made it, else [`find_bin_dir`].
fn bin_dir_for(data_dir: &Path) -> Result<PathBuf, EmbeddedError> {
    if env::var_os(PG_BIN_DIR_ENV).is_none_or(|d| d.is_empty())
        && let Ok(version) = fs::read_to_string(data_dir.join("PG_VERSION"))
    {
        let dir = Path::new(DEBIAN_PG_LIB_DIR)
            .join(version.trim())
            .join("bin");
        if has_server_tools(&dir) {
            return Ok(dir);
        }
    }
    find_bin_dir()
}

/// The user and group a server process runs as, when it differs from this process's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunAs {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

/// Whether this process runs as root (its effective user id is 0).
pub(crate) fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// `None` when this process is not root; else the `postgres` user from `/etc/passwd`.
pub(crate) fn server_user() -> Result<Option<RunAs>, EmbeddedError> {
    if !running_as_root() {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").map_err(io_error("reading /etc/passwd"))?;
    passwd
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            if fields.next()? != SERVER_USER {
                return None;
            }
            let _password = fields.next()?;
            let uid = fields.next()?.parse().ok()?;
            let gid = fields.next()?.parse().ok()?;
            Some(Some(RunAs { uid, gid }))
        })
        .ok_or(EmbeddedError::NoServerUser)
}

/// Checks that the server's OS user can reach `dir`: every directory above it must be
/// searchable by that user. Only matters when this process is root (the server then runs
/// as `postgres`); otherwise it always succeeds.
///
/// # Errors
///
/// [`EmbeddedError::Inaccessible`] names the first directory the server's user cannot
/// search; [`EmbeddedError::NoServerUser`] when running as root without a `postgres` user.
pub fn check_directory(dir: &Path) -> Result<(), EmbeddedError> {
    match server_user()? {
        Some(user) => check_reachable(dir, user),
        None => Ok(()),
    }
}

pub(crate) fn check_reachable(dir: &Path, user: RunAs) -> Result<(), EmbeddedError> {
    let absolute = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        env::current_dir()
            .map_err(io_error("reading the current directory"))?
            .join(dir)
    };
    for ancestor in absolute.ancestors().skip(1) {
        let Ok(meta) = fs::metadata(ancestor) else {
            continue; // not created yet: it will be created by this process
        };
        let mode = meta.mode();
        let searchable = if meta.uid() == user.uid {
            mode & 0o100 != 0
        } else if meta.gid() == user.gid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !searchable {
            return Err(EmbeddedError::Inaccessible {
                path: ancestor.to_path_buf(),
            });
        }
    }
    Ok(())
}

pub(crate) fn chown(path: &Path, run_as: Option<RunAs>) -> Result<(), EmbeddedError> {
    match run_as {
        Some(user) => std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).map_err(
            io_error(format!("changing the owner of {}", path.display())),
        ),
        None => Ok(()),
    }
}

/// Creates a new directory `<parent>/<prefix><pid>-<random>`.
pub(crate) fn unique_dir(parent: &Path, prefix: &str) -> Result<PathBuf, EmbeddedError> {
    let mut tries = 0;
    loop {
        let dir = parent.join(format!(
            "{prefix}{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        match fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
            Err(e) => return Err(io_error(format!("creating {}", dir.display()))(e)),
        }
    }
}

fn socket_path_fits(socket_dir: &Path, port: u16) -> bool {
    socket_dir
        .join(format!(".s.PGSQL.{port}"))
        .as_os_str()
        .len()
        <= MAX_SOCKET_PATH
}

/// Writes `dir/name` with `content`, readable by its owner only (mode 0600), owned by
/// `run_as` when given. `name` must be a plain file name.
pub(crate) fn write_private_file(
    dir: &Path,
    name: &str,
    content: &[u8],
    run_as: Option<RunAs>,
) -> Result<PathBuf, EmbeddedError> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(EmbeddedError::InvalidDataFile { name: name.into() });
    }
    let path = dir.join(name);
    // Removed first: an existing file would keep its mode.
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(format!("removing {}", path.display()))(e)),
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_error(format!("creating {}", path.display())))?;
    file.write_all(content)
        .map_err(io_error(format!("writing {}", path.display())))?;
    chown(&path, run_as)?;
    Ok(path)
}

/// How to stop a server; see `pg_ctl stop -m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShutdownMode {
    /// Disconnect the clients, roll back their transactions and shut down cleanly.
    Fast,
    /// Quit at once, as in a crash: the next start runs crash recovery.
    Immediate,
}

impl ShutdownMode {
    fn as_arg(self) -> &'static str {
        match self {
            ShutdownMode::Fast => "fast",
            ShutdownMode::Immediate => "immediate",
        }
    }
}

/// How to set up an [`EmbeddedPostgres`].
///
/// ```
/// use pgbus_testkit::embedded::EmbeddedOptions;
///
/// let options = EmbeddedOptions::default()
///     .durable(true)
///     .max_connections(50)
///     .setting("log_min_duration_statement", "100ms");
/// assert!(options.durable);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EmbeddedOptions {
    /// Whether the server keeps PostgreSQL's durable defaults. When `false`, it runs with
    /// `fsync=off`, `synchronous_commit=off` and `full_page_writes=off`: fast, but a crash
    /// of the machine loses data, and its timings say nothing about production. Benchmarks
    /// want `true`. Default: `false` ([`DEFAULT_DURABLE`]).
    pub durable: bool,
    /// The server's `max_connections`. Default: 200 ([`DEFAULT_MAX_CONNECTIONS`]).
    pub max_connections: u32,
    /// The port, which names the socket file, and the TCP port when
    /// [`tcp_address`](Self::tcp_address) is set. Default: 5432 ([`DEFAULT_PORT`]).
    pub port: u16,
    /// An address the server listens on over TCP too, at [`port`](Self::port) (which the
    /// caller then chooses free). Default: `None`, the Unix socket only.
    pub tcp_address: Option<IpAddr>,
    /// Files written into the data directory at every start, before the server starts:
    /// (file name, content). Each is written with mode 0600 and owned by the server's OS
    /// user, as PostgreSQL wants a private key to be; a file named like one of the
    /// cluster's (`pg_hba.conf`) replaces it. Default: none.
    pub data_files: Vec<(String, Vec<u8>)>,
    /// More `name = value` server settings, applied last, in order. Default: none.
    pub settings: Vec<(String, String)>,
    /// Where the cluster lives. Default: `None`, a new directory under
    /// [`std::env::temp_dir`], removed when the server stops. When set, the directory is
    /// created if needed and kept; a cluster already in it (from an earlier start) is
    /// started again instead of being created anew.
    pub directory: Option<PathBuf>,
    /// The directory holding `initdb` and `pg_ctl`. Default: `None`, found by
    /// [`find_bin_dir`].
    pub bin_dir: Option<PathBuf>,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            durable: DEFAULT_DURABLE,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            port: DEFAULT_PORT,
            tcp_address: None,
            data_files: Vec::new(),
            settings: Vec::new(),
            directory: None,
            bin_dir: None,
        }
    }
}

impl EmbeddedOptions {
    /// Sets [`EmbeddedOptions::durable`]. Default: `false`.
    pub fn durable(mut self, durable: bool) -> Self {
        self.durable = durable;
        self
    }

    /// Sets [`EmbeddedOptions::max_connections`]. Default: 200.
    pub fn max_connections(mut self, max_connections: u32) -> Self {
        self.max_connections = max_connections;
        self
    }

    /// Sets [`EmbeddedOptions::port`]. Default: 5432.
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// Sets [`EmbeddedOptions::tcp_address`]. Default: none (Unix socket only).
    pub fn tcp_address(mut self, address: IpAddr) -> Self {
        self.tcp_address = Some(address);
        self
    }

    /// Adds a file to [`EmbeddedOptions::data_files`], e.g. `pg_hba.conf` or a TLS key.
    /// `name` is a plain file name; anything else is refused at start
    /// ([`EmbeddedError::InvalidDataFile`]).
    pub fn data_file(mut self, name: impl Into<String>, content: impl Into<Vec<u8>>) -> Self {
        self.data_files.push((name.into(), content.into()));
        self
    }

    /// Adds a server setting, like `postgres -c name=value`. Default: none.
    /// `listen_addresses`, `port` and `unix_socket_directories` are refused at start.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Sets [`EmbeddedOptions::directory`]. Default: a new temporary directory.
    pub fn directory(mut self, directory: impl Into<PathBuf>) -> Self {
        self.directory = Some(directory.into());
        self
    }

    /// Sets [`EmbeddedOptions::bin_dir`]. Default: found by [`find_bin_dir`].
    pub fn bin_dir(mut self, bin_dir: impl Into<PathBuf>) -> Self {
        self.bin_dir = Some(bin_dir.into());
        self
    }

    /// The settings file's content.
    fn settings_file(&self, socket_dir: &Path) -> Result<String, EmbeddedError> {
        let socket_dir = socket_dir.to_str().ok_or(EmbeddedError::InvalidSetting {
            name: "unix_socket_directories".into(),
            reason: "the socket directory's path is not UTF-8",
        })?;
        let mut settings: Vec<(&str, String)> = vec![
            (
                "listen_addresses",
                self.tcp_address
                    .map(|address| address.to_string())
                    .unwrap_or_default(),
            ),
            ("port", self.port.to_string()),
            ("unix_socket_directories", socket_dir.to_owned()),
            ("max_connections", self.max_connections.to_string()),
        ];
        if !self.durable {
            for name in ["fsync", "synchronous_commit", "full_page_writes"] {
                settings.push((name, "off".into()));
            }
        }
        for (name, value) in &self.settings {
            let invalid = |reason| EmbeddedError::InvalidSetting {
                name: name.clone(),
                reason,
            };
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            {
                return Err(invalid("a name has only letters, digits, `_` and `.`"));
            }
            if MANAGED_SETTINGS.contains(&name.to_ascii_lowercase().as_str()) {
                return Err(invalid("it is managed by the embedded server"));
            }
            if value.contains(['\n', '\r', '\0']) {
                return Err(invalid("a value cannot hold a line break or NUL"));
            }
            settings.push((name, value.clone()));
        }
        let mut file = String::from("# Written by pgbus_testkit::embedded at every start.\n");
        for (name, value) in settings {
            let quoted = value.replace('\\', "\\\\").replace('\'', "''");
            let _ = writeln!(file, "{name} = '{quoted}'");
        }
        Ok(file)
    }
}

/// Runs PostgreSQL's programs for one cluster.
#[derive(Debug, Clone)]
struct Ctl {
    bin_dir: PathBuf,
    dir: PathBuf,
    data_dir: PathBuf,
    log_file: PathBuf,
    run_as: Option<RunAs>,
}

impl Ctl {
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(program));
        // The server's user must be able to read its working directory, or PostgreSQL's
        // programs fail to find themselves.
        cmd.current_dir(&self.dir)
            .stdin(Stdio::null())
            .env("LC_ALL", "C");
        for (name, _) in env::vars_os() {
            if name.to_str().is_some_and(|n| n.starts_with("PG")) {
                cmd.env_remove(name);
            }
        }
        if let Some(user) = self.run_as {
            cmd.uid(user.uid).gid(user.gid);
        }
        cmd
    }

    fn run(&self, mut cmd: Command, what: &str, with_log: bool) -> Result<(), EmbeddedError> {
        let out = cmd.output().map_err(io_error(format!(
            "running {}",
            self.bin_dir
                .join(what.split(' ').next().unwrap_or(what))
                .display()
        )))?;
        if out.status.success() {
            return Ok(());
        }
        let mut output = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !stdout.trim().is_empty() {
            output.push('\n');
            output.push_str(stdout.trim());
        }
        Err(EmbeddedError::Command {
            command: what.to_owned(),
            status: out.status,
            output,
            log: with_log.then(|| self.log_tail()),
        })
    }

    fn initdb(&self) -> Result<(), EmbeddedError> {
        let mut cmd = self.command("initdb");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C"])
            .arg("--no-sync");
        self.run(cmd, "initdb", false)
    }

    fn start(&self) -> Result<(), EmbeddedError> {
        self.wait_for_reaped_postmaster();
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&self.log_file)
            .args(["-w", "-t", PG_CTL_TIMEOUT_SECS, "start"]);
        self.run(cmd, "pg_ctl start", true)
    }

    /// A killed postmaster stays a zombie until its parent (init) reaps it, and until
    /// then PostgreSQL takes its `postmaster.pid` for a live server's and refuses to
    /// start: wait for the reaping (bounded; the start reports it if it never comes).
    fn wait_for_reaped_postmaster(&self) {
        let Ok(text) = fs::read_to_string(self.data_dir.join("postmaster.pid")) else {
            return;
        };
        let Some(pid) = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok())
        else {
            return;
        };
        let deadline = Instant::now() + ZOMBIE_REAP_TIMEOUT;
        while process_state(pid) == Some('Z') && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&self, mode: ShutdownMode) -> Result<(), EmbeddedError> {
        let mut cmd = self.command("pg_ctl");
        cmd.arg("-D").arg(&self.data_dir).args([
            "-m",
            mode.as_arg(),
            "-w",
            "-t",
            PG_CTL_TIMEOUT_SECS,
            "stop",
        ]);
        self.run(cmd, "pg_ctl stop", false)
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(&self.log_file).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }
}

/// What `postmaster.pid` says about a running server.
#[derive(Debug)]
struct PidFile {
    pid: u32,
    port: u16,
    socket_dir: PathBuf,
}

impl PidFile {
    /// Reads `postmaster.pid`; `None` unless it names a live `postgres` process.
    fn read(data_dir: &Path) -> Option<PidFile> {
        let text = fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
        let lines: Vec<&str> = text.lines().collect();
        let pid: u32 = lines.first()?.trim().parse().ok()?;
        let port = lines.get(3)?.trim().parse().ok()?;
        let socket_dir = PathBuf::from(lines.get(4)?.trim());
        process_is_live_postgres(pid).then_some(PidFile {
            pid,
            port,
            socket_dir,
        })
    }
}

/// Whether `pid` is a running `postgres` process: not some other program that reused the
/// pid, and not a zombie (a killed postmaster whose parent has not reaped it yet).
fn process_is_live_postgres(pid: u32) -> bool {
    process_stat(pid).is_some_and(|(comm, state)| {
        comm == "postgres" && !matches!(state, Some('Z' | 'X' | 'x') | None)
    })
}

/// The state letter of process `pid` (`R`, `S`, `Z`, ...), if it exists.
fn process_state(pid: u32) -> Option<char> {
    process_stat(pid).and_then(|(_, state)| state)
}

/// Whether this system has Linux's `/proc/<pid>/` files; elsewhere (macOS, the BSDs)
/// processes are inspected with `ps`.
fn has_proc_files() -> bool {
    Path::new("/proc/self/stat").exists()
}

/// The name and state letter of process `pid`: from `/proc/<pid>/stat`, or from `ps`
/// where there is no such file.
fn process_stat(pid: u32) -> Option<(String, Option<char>)> {
    if !has_proc_files() {
        let comm = ps(pid, "comm")?;
        // macOS's `ps` prints the executable's path.
        let comm = comm.rsplit('/').next().unwrap_or(&comm).to_owned();
        let state = ps(pid, "state").and_then(|s| s.chars().next());
        return Some((comm, state));
    }
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `<pid> (<comm>) <state> ...`; the name may itself hold parentheses.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let comm = stat.get(open + 1..close)?.to_owned();
    let state = stat[close + 1..].trim_start().chars().next();
    Some((comm, state))
}

/// The arguments process `pid` was started with: from `/proc/<pid>/cmdline`, or from
/// `ps` (split at white space) where there is no such file. `None` when there is no such
/// process.
pub(crate) fn process_args(pid: u32) -> Option<Vec<String>> {
    if !has_proc_files() {
        let args = ps(pid, "args")?;
        return Some(args.split_whitespace().map(str::to_owned).collect());
    }
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        cmdline
            .split(|b| *b == 0)
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect(),
    )
}

/// What `ps -o <field>= -p <pid>` prints, trimmed; `None` when there is no such process.
fn ps(pid: u32, field: &str) -> Option<String> {
    let out = Command::new("ps")
        .args(["-o", &format!("{field}="), "-p", &pid.to_string()])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

/// A process that stops the server and removes its directory when the process that
/// started the server ends, however it ends: it waits for the end of its standard input,
/// whose other end only this process holds.
#[derive(Debug)]
struct Guardian {
    child: Child,
    _stdin: ChildStdin,
}

const GUARDIAN_SCRIPT: &str = r#"read -r _
"$1" -D "$2" -m immediate -w stop >/dev/null 2>&1
[ -z "$3" ] || rm -rf "$3"
[ -z "$4" ] || rm -rf "$4"
"#;

impl Guardian {
    fn spawn(ctl: &Ctl, remove: &[Option<&Path>; 2]) -> Result<Guardian, EmbeddedError> {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(GUARDIAN_SCRIPT)
            .arg("pgbus-embedded-guardian")
            .arg(ctl.bin_dir.join("pg_ctl"))
            .arg(&ctl.data_dir);
        for path in remove {
            cmd.arg(path.map(Path::as_os_str).unwrap_or_default());
        }
        cmd.current_dir(&ctl.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: a Ctrl-C at the terminal must not kill it before it
            // has cleaned up.
            .process_group(0);
        if let Some(user) = ctl.run_as {
            cmd.uid(user.uid).gid(user.gid);
        }
        let mut child = cmd
            .spawn()
            .map_err(io_error("starting the guardian process (/bin/sh)"))?;
        let stdin = child.stdin.take().expect("stdin is piped");
        Ok(Guardian {
            child,
            _stdin: stdin,
        })
    }

    fn dismiss(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A PostgreSQL server of its own, in a directory of its own, listening on a Unix socket
/// only.
///
/// Connect with [`config`](Self::config), [`connection_string`](Self::connection_string)
/// or [`url`](Self::url); the superuser is `postgres`, authenticated by `trust`.
///
/// Dropping it stops the server at once (`pg_ctl stop -m immediate`) and removes its
/// directory (unless that directory was given with [`EmbeddedOptions::directory`]); this
/// blocks for the few milliseconds the server takes to stop. The same happens when this
/// process ends without dropping it. [`detach`](Self::detach) leaves the server running.
#[derive(Debug)]
pub struct EmbeddedPostgres {
    ctl: Ctl,
    socket_dir: PathBuf,
    port: u16,
    /// Remove `ctl.dir` when dropped.
    owns_dir: bool,
    /// Remove `socket_dir` when dropped (it is outside `ctl.dir`).
    owns_socket_dir: bool,
    detached: bool,
    guardian: Option<Guardian>,
}

impl EmbeddedPostgres {
    /// Creates a cluster and starts its server; see [`EmbeddedPostgres::start_blocking`].
    /// The blocking work runs on Tokio's blocking thread pool.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Errors
    ///
    /// As [`EmbeddedPostgres::start_blocking`].
    pub async fn start(options: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        tokio::task::spawn_blocking(move || Self::start_blocking(options))
            .await
            .map_err(|e| EmbeddedError::Io {
                action: "starting the embedded server".into(),
                source: io::Error::other(e.to_string()),
            })?
    }

    /// Creates a cluster (`initdb`) unless [`EmbeddedOptions::directory`] already holds
    /// one, writes the settings, and starts the server (`pg_ctl start`), waiting until it
    /// accepts connections. Takes a second or two for a new cluster.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::BinariesNotFound`] without server binaries;
    /// [`EmbeddedError::NoServerUser`] or [`EmbeddedError::Inaccessible`] when running as
    /// root and the `postgres` user cannot be used; [`EmbeddedError::InvalidSetting`];
    /// [`EmbeddedError::VersionMismatch`] when the directory holds a cluster of another
    /// major version; [`EmbeddedError::Command`] with the program's output and the server
    /// log when `initdb` or `pg_ctl` fails; [`EmbeddedError::Io`].
    pub fn start_blocking(options: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        let run_as = server_user()?;
        let (dir, owns_dir) = match &options.directory {
            Some(dir) => {
                if let Some(user) = run_as {
                    check_reachable(dir, user)?;
                }
                fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
                (dir.clone(), false)
            }
            None => {
                let tmp = env::temp_dir();
                if let Some(user) = run_as {
                    check_reachable(&tmp.join("x"), user)?;
                }
                (unique_dir(&tmp, "pgbus-")?, true)
            }
        };
        // The cluster's directory may be relative: PostgreSQL's programs run inside it.
        let dir =
            fs::canonicalize(&dir).map_err(io_error(format!("resolving {}", dir.display())))?;
        let data_dir = dir.join("data");
        let existing = data_dir.join("PG_VERSION").is_file();
        let bin_dir = match (&options.bin_dir, existing) {
            (Some(bin_dir), _) => Ok(bin_dir.clone()),
            (None, true) => bin_dir_for(&data_dir),
            (None, false) => find_bin_dir(),
        };
        let mut pg = EmbeddedPostgres {
            ctl: Ctl {
                bin_dir: PathBuf::new(),
                log_file: dir.join("server.log"),
                data_dir,
                dir: dir.clone(),
                run_as,
            },
            socket_dir: dir.clone(),
            port: options.port,
            owns_dir,
            owns_socket_dir: false,
            detached: false,
            guardian: None,
        };
        // From here on, dropping `pg` on an error removes what was created.
        pg.ctl.bin_dir = bin_dir?;
        chown(&dir, run_as)?;
        if !socket_path_fits(&dir, options.port) {
            let tmp = env::temp_dir();
            let parent = if socket_path_fits(&tmp.join("pgbus-s-4294967295-ffffffff"), 65535) {
                tmp
            } else {
                PathBuf::from("/tmp")
            };
            pg.socket_dir = unique_dir(&parent, "pgbus-s-")?;
            pg.owns_socket_dir = true;
            chown(&pg.socket_dir, run_as)?;
        }
        let settings = options.settings_file(&pg.socket_dir)?;

        if existing {
            if let Some(binaries) = binaries_major_version(&pg.ctl.bin_dir) {
                let cluster = fs::read_to_string(pg.ctl.data_dir.join("PG_VERSION"))
                    .unwrap_or_default()
                    .trim()
                    .to_owned();
                if cluster != binaries {
                    return Err(EmbeddedError::VersionMismatch {
                        data_dir: pg.ctl.data_dir.clone(),
                        cluster,
                        bin_dir: pg.ctl.bin_dir.clone(),
                        binaries,
                    });
                }
            }
        } else {
            if pg.ctl.data_dir.exists() {
                // Left over from an initdb that did not finish.
                fs::remove_dir_all(&pg.ctl.data_dir)
                    .map_err(io_error(format!("removing {}", pg.ctl.data_dir.display())))?;
            }
            pg.ctl.initdb()?;
            let conf = pg.ctl.data_dir.join("postgresql.conf");
            let mut file = fs::OpenOptions::new()
                .append(true)
                .open(&conf)
                .map_err(io_error(format!("opening {}", conf.display())))?;
            writeln!(file, "\ninclude '{SETTINGS_FILE}'")
                .map_err(io_error(format!("writing {}", conf.display())))?;
        }
        write_private_file(&pg.ctl.data_dir, SETTINGS_FILE, settings.as_bytes(), run_as)?;
        for (name, content) in &options.data_files {
            write_private_file(&pg.ctl.data_dir, name, content, run_as)?;
        }

        // A server left running in this directory (by a process that detached it) would
        // keep the old settings.
        if PidFile::read(&pg.ctl.data_dir).is_some() {
            pg.ctl.stop(ShutdownMode::Fast)?;
        }
        let remove_dir = pg.owns_dir.then_some(pg.ctl.dir.as_path());
        let remove_socket_dir = pg.owns_socket_dir.then_some(pg.socket_dir.as_path());
        pg.guardian = Some(Guardian::spawn(&pg.ctl, &[remove_dir, remove_socket_dir])?);
        pg.ctl.start()?;
        tracing::debug!(
            dir = %pg.ctl.dir.display(),
            socket_dir = %pg.socket_dir.display(),
            durable = options.durable,
            "embedded postgres started"
        );
        Ok(pg)
    }

    /// A handle on a server already running in `dir` (the directory given to
    /// [`EmbeddedOptions::directory`] when it was started, by this or another process).
    ///
    /// The handle is detached: dropping it leaves the server running and the directory in
    /// place.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::NotRunning`] when no live server's `postmaster.pid` is in
    /// `dir/data`; [`EmbeddedError::BinariesNotFound`].
    pub fn attach(dir: impl AsRef<Path>) -> Result<Self, EmbeddedError> {
        let dir = dir.as_ref();
        let not_running = || EmbeddedError::NotRunning {
            path: dir.to_path_buf(),
        };
        let dir = fs::canonicalize(dir).map_err(|_| not_running())?;
        let data_dir = dir.join("data");
        let pid_file = PidFile::read(&data_dir).ok_or_else(not_running)?;
        let run_as = match running_as_root() {
            true => {
                let meta = fs::metadata(&data_dir)
                    .map_err(io_error(format!("reading {}", data_dir.display())))?;
                Some(RunAs {
                    uid: meta.uid(),
                    gid: meta.gid(),
                })
            }
            false => None,
        };
        Ok(EmbeddedPostgres {
            ctl: Ctl {
                bin_dir: bin_dir_for(&data_dir)?,
                log_file: dir.join("server.log"),
                data_dir,
                dir,
                run_as,
            },
            socket_dir: pid_file.socket_dir,
            port: pid_file.port,
            owns_dir: false,
            owns_socket_dir: false,
            detached: true,
            guardian: None,
        })
    }

    /// Leaves the server running, and its directory in place, when this handle is dropped
    /// or this process ends. [`EmbeddedPostgres::attach`] finds it again.
    pub fn detach(&mut self) {
        if let Some(guardian) = self.guardian.take() {
            guardian.dismiss();
        }
        self.detached = true;
    }

    /// A libpq `key=value` connection string for database `dbname`, e.g.
    /// `host=/tmp/pgbus-1-ab12cd34 port=5432 user=postgres dbname=postgres`.
    /// `tokio_postgres::Config` parses it, as does `psql`.
    pub fn connection_string(&self, dbname: &str) -> String {
        format!(
            "host={} port={} user={SUPERUSER} dbname={}",
            quote_value(&self.socket_dir.to_string_lossy()),
            self.port,
            quote_value(dbname)
        )
    }

    /// A `postgresql://` URL for database `dbname`, with the socket directory
    /// percent-encoded as the host, e.g.
    /// `postgresql://postgres@%2Ftmp%2Fpgbus-1-ab12cd34:5432/postgres`.
    pub fn url(&self, dbname: &str) -> String {
        format!(
            "postgresql://{SUPERUSER}@{}:{}/{}",
            percent_encode(&self.socket_dir.to_string_lossy()),
            self.port,
            percent_encode(dbname)
        )
    }

    /// A `tokio_postgres::Config` for database `dbname`.
    pub fn config(&self, dbname: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host_path(&self.socket_dir)
            .port(self.port)
            .user(SUPERUSER)
            .dbname(dbname);
        config
    }

    /// The cluster's directory (holding `data/` and `server.log`).
    pub fn dir(&self) -> &Path {
        &self.ctl.dir
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.ctl.data_dir
    }

    /// The directory holding the server's Unix socket.
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// The port, which names the socket file.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory of the PostgreSQL programs this server runs.
    pub fn bin_dir(&self) -> &Path {
        &self.ctl.bin_dir
    }

    /// The server's log file.
    pub fn log_file(&self) -> &Path {
        &self.ctl.log_file
    }

    /// The postmaster's process id, while the server runs.
    pub fn pid(&self) -> Option<u32> {
        PidFile::read(&self.ctl.data_dir).map(|p| p.pid)
    }

    /// Whether the server is running (its `postmaster.pid` names a live process).
    pub fn is_running(&self) -> bool {
        self.pid().is_some()
    }

    /// Stops the server (`pg_ctl stop -m <mode>`), keeping the cluster, and waits until it
    /// has stopped. [`start_again`](Self::start_again) starts it again.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::Command`] when `pg_ctl` fails, e.g. because the server is not
    /// running.
    pub async fn stop(&self, mode: ShutdownMode) -> Result<(), EmbeddedError> {
        let ctl = self.ctl.clone();
        blocking(move || ctl.stop(mode)).await
    }

    /// Starts the stopped server again and waits until it accepts connections (after
    /// crash recovery, if it was stopped with [`ShutdownMode::Immediate`]).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::Command`] with the server log when `pg_ctl` fails, e.g. because
    /// the server is already running.
    pub async fn start_again(&self) -> Result<(), EmbeddedError> {
        let ctl = self.ctl.clone();
        blocking(move || ctl.start()).await
    }

    /// Stops the server with `mode` and starts it again; every connection is cut.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Errors
    ///
    /// As [`stop`](Self::stop) and [`start_again`](Self::start_again).
    pub async fn restart(&self, mode: ShutdownMode) -> Result<(), EmbeddedError> {
        let ctl = self.ctl.clone();
        blocking(move || {
            ctl.stop(mode)?;
            ctl.start()
        })
        .await
    }
}

async fn blocking(
    f: impl FnOnce() -> Result<(), EmbeddedError> + Send + 'static,
) -> Result<(), EmbeddedError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| EmbeddedError::Io {
            action: "running pg_ctl".into(),
            source: io::Error::other(e.to_string()),
        })?
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        if let Some(guardian) = self.guardian.take() {
            guardian.dismiss();
        }
        if self.detached {
            return;
        }
        if PidFile::read(&self.ctl.data_dir).is_some()
            && let Err(e) = self.ctl.stop(ShutdownMode::Immediate)
        {
            tracing::warn!(error = %e, "could not stop the embedded postgres");
        }
        if self.owns_dir {
            let _ = fs::remove_dir_all(&self.ctl.dir);
        }
        if self.owns_socket_dir {
            let _ = fs::remove_dir_all(&self.socket_dir);
        }
    }
}

/// Quotes a libpq connection-string value when it needs it.
fn quote_value(value: &str) -> String {
    if !value.is_empty() && !value.contains(|c: char| c.is_whitespace() || c == '\'' || c == '\\') {
        return value.to_owned();
    }
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Percent-encodes everything but unreserved URL characters.
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for byte in s.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<EmbeddedPostgres>();
        assert_send_sync::<EmbeddedOptions>();
        assert_send_sync::<EmbeddedError>();
    }

    #[test]
    fn versions_sort_numerically() {
        let mut versions = vec![
            version_key("9.6").unwrap(),
            version_key("16").unwrap(),
            version_key("10").unwrap(),
        ];
        versions.sort();
        assert_eq!(versions, vec![vec![9, 6], vec![10], vec![16]]);
        assert_eq!(version_key("main"), None);
    }

    #[test]
    fn settings_are_quoted_and_checked() {
        let options = EmbeddedOptions::default().setting("search_path", "it's");
        let file = options.settings_file(Path::new("/tmp/x")).unwrap();
        assert!(file.contains("listen_addresses = ''\n"), "{file}");
        assert!(file.contains("fsync = 'off'\n"), "{file}");
        assert!(file.contains("search_path = 'it''s'\n"), "{file}");
        assert!(
            !EmbeddedOptions::default()
                .durable(true)
                .settings_file(Path::new("/tmp/x"))
                .unwrap()
                .contains("fsync")
        );
        for (name, value) in [("port", "1"), ("bad name", "1"), ("work_mem", "1\n")] {
            let err = EmbeddedOptions::default()
                .setting(name, value)
                .settings_file(Path::new("/tmp/x"))
                .unwrap_err();
            assert!(matches!(err, EmbeddedError::InvalidSetting { .. }), "{err}");
        }
    }

    #[test]
    fn connection_strings_parse() {
        let pg = EmbeddedPostgres {
            ctl: Ctl {
                bin_dir: PathBuf::new(),
                dir: PathBuf::from("/tmp/a dir"),
                data_dir: PathBuf::from("/tmp/a dir/data"),
                log_file: PathBuf::new(),
                run_as: None,
            },
            socket_dir: PathBuf::from("/tmp/a dir's"),
            port: 5433,
            owns_dir: false,
            owns_socket_dir: false,
            detached: true,
            guardian: None,
        };
        for s in [pg.connection_string("db 1"), pg.url("db 1")] {
            let config: tokio_postgres::Config = s.parse().unwrap();
            assert_eq!(
                config.get_hosts(),
                &[tokio_postgres::config::Host::Unix("/tmp/a dir's".into())],
                "{s}"
            );
            assert_eq!(config.get_ports(), &[5433], "{s}");
            assert_eq!(config.get_dbname(), Some("db 1"), "{s}");
            assert_eq!(config.get_user(), Some("postgres"), "{s}");
        }
    }
}
