//! The harness of the tests that need PostgreSQL.
//!
//! Every test takes a database of its own, cloned from a template migrated once:
//!
//! ```no_run
//! # async fn example() {
//! let db = pgbus_testkit::test_db().await;
//! let client = db.connect().await;
//! # }
//! ```
//!
//! With `DATABASE_URL` set, the databases are made on that server (its user needs
//! `CREATEDB`). Without it, on one throwaway cluster shared by every test binary of the
//! run: it lives in `<target>/tmp/pgbus-test-pg-<major>/`, one for each major version of
//! the server binaries found (see [`find_bin_dir`](crate::embedded::find_bin_dir);
//! `PG_BIN_DIR` picks them), so that a run on another version never reuses a cluster
//! still running from the last (the target directory is found from the test executable's
//! path, `<target>/<profile>/deps/<test>`; the system's temporary directory when that is
//! not where it runs), listens on a Unix socket only, runs with
//! `fsync=off`, and a watchdog stops it about ten seconds after the last test process
//! has ended (it needs `flock`, from util-linux). `KEEP_TEST_DB=1` keeps each test's
//! database, and the cluster running, for a look after the run (`psql "<the url
//! printed>"`); the next run without it cleans up.

use std::fs::{self, File};
use std::future::Future;
use std::hash::Hasher as _;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use tokio_postgres::{Client, Config, NoTls};

use crate::embedded::{self, EmbeddedOptions, EmbeddedPostgres};
use crate::{connect, conninfo, url};

/// How long the watchdog waits, with no test process alive, before it stops the shared
/// cluster. Cargo runs test binaries one after another; this covers the gap between two.
const IDLE_SECONDS_BEFORE_STOP: u32 = 10;

/// Serializes template creation across processes (on the maintenance database).
const TEMPLATE_LOCK_KEY: i64 = 0x7067_6275_735f_746d; // "pgbus_tm"

/// Where the test databases are made, shared by the tests of this process.
struct Server {
    /// A connection to the maintenance database, for `CREATE/DROP DATABASE`.
    admin: Config,
    /// The shared embedded cluster, unless `DATABASE_URL` was given. A detached handle:
    /// dropping it never stops the server.
    cluster: Option<EmbeddedPostgres>,
}

static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();

/// The shared lock on `users.lock`, held for the life of this process: while any test
/// process holds it, the watchdog leaves the cluster running.
static USERS_LOCK: OnceLock<File> = OnceLock::new();

static TEMPLATE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();

fn server() -> &'static Server {
    match SERVER.get_or_init(init_server) {
        Ok(server) => server,
        Err(e) => panic!("test database server unavailable: {e}"),
    }
}

fn init_server() -> Result<Server, String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => {
            let admin: Config = url
                .parse()
                .map_err(|e| format!("DATABASE_URL is not a valid connection string: {e}"))?;
            if admin.get_dbname().is_none() {
                return Err("DATABASE_URL names no database".into());
            }
            Ok(Server {
                admin,
                cluster: None,
            })
        }
        _ => {
            let cluster = shared_cluster()?;
            Ok(Server {
                admin: cluster.config("postgres"),
                cluster: Some(cluster),
            })
        }
    }
}

/// Cargo's target temporary directory, `<target>/tmp` (what `CARGO_TARGET_TMPDIR` names
/// to integration tests), found from this executable's path, `<target>/<profile>/deps/`;
/// `None` when it runs from anywhere else.
fn target_tmp_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    if deps.file_name()? != "deps" {
        return None;
    }
    Some(deps.parent()?.parent()?.join("tmp"))
}

/// The directory holding the shared cluster and its lock files: under Cargo's target
/// temporary directory, or, when the `postgres` user (the server's, when tests run as
/// root) cannot reach that or the test does not run from a target directory, under the
/// system's temporary directory.
fn shared_base() -> Result<PathBuf, String> {
    let name = shared_base_name()?;
    let Some(target_tmp) = target_tmp_dir() else {
        return Ok(
            std::env::temp_dir().join(format!("{name}-uid{}", rustix::process::geteuid().as_raw()))
        );
    };
    let target_tmp = target_tmp.as_path();
    let base = target_tmp.join(&name);
    match embedded::check_directory(&base) {
        Ok(()) => Ok(base),
        Err(embedded::EmbeddedError::Inaccessible { .. }) => {
            let mut hash = Fnv::default();
            hash.write(target_tmp.as_os_str().as_encoded_bytes());
            Ok(std::env::temp_dir().join(format!("{name}-{:016x}", hash.finish())))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `pgbus-test-pg-<major>`, after the major version of the server binaries the cluster
/// would be started with: a cluster of one version is never attached to by a run meant
/// for another (say, `PG_BIN_DIR` set to PostgreSQL 18's binaries right after a run on
/// Debian's 15, whose cluster is still running until its watchdog stops it).
fn shared_base_name() -> Result<String, String> {
    let bin_dir = embedded::find_bin_dir().map_err(|e| e.to_string())?;
    Ok(match embedded::binaries_major_version(&bin_dir) {
        Some(major) => format!("pgbus-test-pg-{major}"),
        None => "pgbus-test-pg".to_owned(),
    })
}

/// Starts the shared cluster, or finds it running.
fn shared_cluster() -> Result<EmbeddedPostgres, String> {
    let base = shared_base()?;
    fs::create_dir_all(&base).map_err(|e| format!("creating {}: {e}", base.display()))?;
    let open = |name: &str| {
        let path = base.join(name);
        File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("opening {}: {e}", path.display()))
    };
    // Users first, then the start lock; the watchdog takes them the other way around but
    // never waits for the users' lock, so neither can deadlock.
    let users = open("users.lock")?;
    users
        .lock_shared()
        .map_err(|e| format!("locking users.lock: {e}"))?;
    let _ = USERS_LOCK.set(users);
    let start_lock = open("start.lock")?;
    start_lock
        .lock()
        .map_err(|e| format!("locking start.lock: {e}"))?;

    let dir = base.join("cluster");
    let cluster = match EmbeddedPostgres::attach(&dir) {
        Ok(cluster) => cluster,
        Err(_) => {
            let options = EmbeddedOptions::default().directory(&dir);
            let mut cluster = match EmbeddedPostgres::start_blocking(options.clone()) {
                Ok(cluster) => cluster,
                Err(
                    first @ (embedded::EmbeddedError::Command { .. }
                    | embedded::EmbeddedError::VersionMismatch { .. }),
                ) => {
                    // A broken or outdated cluster (it only ever holds test databases):
                    // start from scratch.
                    eprintln!("pgbus tests: recreating the test cluster: {first}");
                    let _ = fs::remove_dir_all(&dir);
                    EmbeddedPostgres::start_blocking(options).map_err(|e| e.to_string())?
                }
                Err(e) => return Err(e.to_string()),
            };
            cluster.detach();
            drop_leftover_databases(&cluster);
            cluster
        }
    };
    // With KEEP_TEST_DB, the kept databases stay reachable after the run: the watchdog
    // leaves the server running until a run without it.
    let keep = base.join("keep");
    if std::env::var_os("KEEP_TEST_DB").is_some() {
        fs::write(&keep, b"").map_err(|e| format!("writing {}: {e}", keep.display()))?;
    } else {
        let _ = fs::remove_file(&keep);
        ensure_watchdog(&base, &cluster)?;
    }
    drop(start_lock);
    Ok(cluster)
}

/// Drops the databases that tests killed before their end left behind. Only run by the
/// process that (re)started the cluster, under the start lock: no test is using it yet.
fn drop_leftover_databases(cluster: &EmbeddedPostgres) {
    let config = cluster.config("postgres");
    let template = template_name();
    let result = std::thread::spawn(move || {
        block_on(async move {
            let client = connect(&config).await?;
            let rows = client
                .query(
                    "SELECT datname FROM pg_database \
                     WHERE (datname LIKE 'pgbus\\_t\\_%' OR datname LIKE 'pgbus\\_tmpl\\_%') \
                       AND datname <> $1",
                    &[&template],
                )
                .await?;
            for row in rows {
                let name: String = row.get(0);
                client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        })
    })
    .join();
    if let Ok(Err(e)) = result {
        eprintln!("pgbus tests: could not drop leftover databases: {e}");
    }
}

/// The watchdog: a detached shell loop that stops the shared cluster once no test process
/// has held `users.lock` for [`IDLE_SECONDS_BEFORE_STOP`] seconds. It stops the server
/// while holding both `start.lock` and `users.lock`, so a test process arriving then waits
/// and finds the server stopped (and starts it again) rather than losing it halfway.
/// It leaves the server running when a `keep` file appears (a run with `KEEP_TEST_DB`).
const WATCHDOG_SCRIPT: &str = r#"idle=0
while [ -f "$3/postmaster.pid" ] && [ ! -e keep ]; do
    if flock -n -x users.lock true; then idle=$((idle + 1)); else idle=0; fi
    if [ "$idle" -ge "$1" ]; then
        if flock -x start.lock flock -n -x users.lock "$2" -D "$3" -m immediate -w stop; then
            exit 0
        fi
        idle=0
    fi
    sleep 1
done
"#;

const WATCHDOG_NAME: &str = "pgbus-test-pg-watchdog";

fn ensure_watchdog(base: &Path, cluster: &EmbeddedPostgres) -> Result<(), String> {
    let pid_file = base.join("watchdog.pid");
    let alive = fs::read_to_string(&pid_file)
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .and_then(embedded::process_args)
        .is_some_and(|args| args.iter().any(|arg| arg == WATCHDOG_NAME));
    if alive {
        return Ok(());
    }
    let has_flock = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join("flock").is_file()));
    if !has_flock {
        eprintln!(
            "pgbus tests: `flock` (util-linux) is missing, so nothing will stop the test \
             cluster in {}; stop it with `pg_ctl -D {} stop`",
            base.display(),
            cluster.data_dir().display()
        );
        return Ok(());
    }
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(WATCHDOG_SCRIPT)
        .arg(WATCHDOG_NAME)
        .arg(IDLE_SECONDS_BEFORE_STOP.to_string())
        .arg(cluster.bin_dir().join("pg_ctl"))
        .arg(cluster.data_dir())
        .current_dir(base)
        // Cargo waits for whoever holds the test's output pipes: hold none.
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Outlives this process, and a Ctrl-C at the terminal.
        .process_group(0);
    // pg_ctl refuses to run as root: run the watchdog as the server's user.
    let data = fs::metadata(cluster.data_dir()).map_err(|e| e.to_string())?;
    if embedded::running_as_root() && data.uid() != 0 {
        cmd.uid(data.uid()).gid(data.gid());
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("starting the test cluster's watchdog: {e}"))?;
    fs::write(&pid_file, child.id().to_string())
        .map_err(|e| format!("writing {}: {e}", pid_file.display()))?;
    // Not waited for: the watchdog outlives this process (and is reaped by init).
    Ok(())
}

/// The template's name: it changes with the migrations, so a changed migration never
/// meets a stale template.
fn template_name() -> String {
    let mut hash = Fnv::default();
    for migration in pgbus::schema::MIGRATIONS {
        hash.write(&migration.version.to_le_bytes());
        hash.write(migration.name.as_bytes());
        hash.write(&[0]);
        hash.write(migration.sql.as_bytes());
        hash.write(&[0]);
    }
    format!("pgbus_tmpl_{:016x}", hash.finish())
}

/// The migrated template, created once per server by whichever process comes first.
async fn template() -> &'static str {
    TEMPLATE
        .get_or_init(|| async {
            let server = spawn_blocking(server).await;
            let name = template_name();
            if let Err(e) = create_template(&server.admin, &name).await {
                panic!("creating the template database {name}: {e}");
            }
            name
        })
        .await
}

async fn create_template(admin: &Config, name: &str) -> Result<(), String> {
    let client = connect(admin).await.map_err(|e| e.to_string())?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&TEMPLATE_LOCK_KEY])
        .await
        .map_err(|e| e.to_string())?;
    let exists = client
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await
        .map_err(|e| e.to_string())?
        .is_some();
    if !exists {
        // Built under another name and renamed when complete, so that a failed
        // migration never leaves a template behind that later runs would trust.
        let building = format!("{name}_build");
        client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {building} WITH (FORCE)"))
            .await
            .map_err(|e| e.to_string())?;
        client
            .batch_execute(&format!("CREATE DATABASE {building}"))
            .await
            .map_err(|e| e.to_string())?;
        let mut config = admin.clone();
        config.dbname(&building);
        let (db, connection) = config.connect(NoTls).await.map_err(|e| e.to_string())?;
        let connection = tokio::spawn(connection);
        pgbus::migrate(&db)
            .await
            .map_err(|e| format!("migrating: {e}"))?;
        // CREATE DATABASE ... TEMPLATE fails while anyone is connected to the template:
        // close the connection, and wait until it is closed.
        drop(db);
        let _ = connection.await;
        client
            .batch_execute(&format!("ALTER DATABASE {building} RENAME TO {name}"))
            .await
            .map_err(|e| e.to_string())?;
        // Nobody connects to it by mistake and blocks the clones.
        client
            .batch_execute(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"))
            .await
            .map_err(|e| e.to_string())?;
    }
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&TEMPLATE_LOCK_KEY])
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A database of the test's own, migrated, dropped when this value is dropped (unless
/// `KEEP_TEST_DB` is set).
#[derive(Debug)]
pub struct TestDb {
    name: String,
    config: Config,
    admin: Config,
}

/// A fresh, migrated database for one test.
///
/// # Panics
///
/// When no server can be had or the database cannot be created.
pub async fn test_db() -> TestDb {
    let template = template().await;
    let server = spawn_blocking(server).await;
    let name = format!("pgbus_t_{:016x}", fastrand::u64(..));
    let admin = connect(&server.admin)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test server: {e}"));
    admin
        .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
        .await
        .unwrap_or_else(|e| panic!("creating the test database {name}: {e}"));
    let mut config = server.admin.clone();
    config.dbname(&name);
    TestDb {
        name,
        config,
        admin: server.admin.clone(),
    }
}

impl TestDb {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A configuration that connects to this database.
    pub fn config(&self) -> Config {
        self.config.clone()
    }

    /// A `postgres://` URL for this database, which sqlx, tokio-postgres and libpq all
    /// read, e.g. `sqlx::PgPool::connect(&db.url())`, or a child process's
    /// `DATABASE_URL`. On the throwaway cluster, its Unix socket directory is the `host`
    /// parameter: `postgres:///pgbus_t_…?host=%2F…&port=…&user=postgres` (see
    /// [`url`](crate::url)).
    pub fn url(&self) -> String {
        url(&self.config)
    }

    /// The same connection in libpq's `key=value` form, e.g.
    /// `host='/…' port=5432 user='postgres' dbname='pgbus_t_…'`, for a caller that
    /// appends settings to it (see [`conninfo`](crate::conninfo)). sqlx does not read
    /// this form: use [`url`](Self::url).
    pub fn conninfo(&self) -> String {
        conninfo(&self.config)
    }

    /// A new connection to this database; its connection task is spawned on the current
    /// runtime.
    ///
    /// # Panics
    ///
    /// When the connection fails.
    pub async fn connect(&self) -> Client {
        connect(&self.config)
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.name))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::env::var_os("KEEP_TEST_DB").is_some() {
            eprintln!(
                "pgbus tests: keeping database {}: {}",
                self.name,
                self.url()
            );
            return;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        // Its own thread and runtime: the test's runtime may be shutting down, and
        // Drop cannot await.
        let dropped = std::thread::spawn(move || {
            block_on(async move {
                let client = connect(&admin).await?;
                client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
            })
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("pgbus tests: could not drop database {}: {e}", self.name);
        }
    }
}

/// A configuration for the maintenance database of the server [`test_db`] makes its
/// databases on (the shared cluster, or `DATABASE_URL`'s server).
///
/// # Panics
///
/// As [`test_db`].
#[cfg(feature = "fixtures")]
pub(crate) async fn server_config() -> Config {
    spawn_blocking(server).await.admin.clone()
}

/// The shared embedded cluster, or `None` when the tests use `DATABASE_URL`.
///
/// Other tests use it at the same time: never stop or restart it. A test that does that
/// takes a [`private_cluster`].
pub fn cluster() -> Option<&'static EmbeddedPostgres> {
    server().cluster.as_ref()
}

/// A cluster of the test's own, its `postgres` database migrated, for tests that stop,
/// restart or break the server. Dropping it stops the server and removes its directory.
///
/// Unlike the shared cluster it runs with `synchronous_commit=on`, so that a crash of the
/// server alone ([`ShutdownMode::Immediate`](crate::embedded::ShutdownMode)) loses no
/// committed transaction, as in production (`fsync` stays off: only a crash of the
/// machine would lose data).
///
/// # Panics
///
/// When no PostgreSQL server binaries are found or the server does not start.
pub async fn private_cluster() -> (EmbeddedPostgres, Config) {
    let options = EmbeddedOptions::default().setting("synchronous_commit", "on");
    let cluster = EmbeddedPostgres::start(options)
        .await
        .unwrap_or_else(|e| panic!("starting a private cluster: {e}"));
    let config = cluster.config("postgres");
    let client = connect(&config)
        .await
        .unwrap_or_else(|e| panic!("connecting to the private cluster: {e}"));
    pgbus::migrate(&client)
        .await
        .unwrap_or_else(|e| panic!("migrating the private cluster: {e}"));
    (cluster, config)
}

fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a runtime")
        .block_on(future)
}

async fn spawn_blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// FNV-1a, 64 bits: a hash that stays the same across Rust versions and processes.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}
