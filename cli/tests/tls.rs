//! The command line over TLS, against the test kit's TLS-only PostgreSQL: `sslmode` and
//! `sslrootcert` in DATABASE_URL, a wrong CA, a wrong host name and a refused plain
//! connection each end with exit code 1 and a hint that says what to fix, and a command
//! runs with no DATABASE_URL at all when the `PG*` variables and the password file say
//! where to go.

mod common;
mod proc;

use pgbus_testkit::tls::TlsServer;
use proc::{Output, pgbus, run};

/// `pgbus status` with DATABASE_URL `url`, and HOME an empty directory.
async fn status_at(url: &str) -> Output {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = pgbus();
    cmd.env("DATABASE_URL", url).env("HOME", home.path());
    run(cmd, &["status"]).await
}

#[tokio::test]
async fn status_runs_over_verified_tls() {
    let server = TlsServer::shared().await;
    let ca = server.ca_pem().display().to_string();
    let out = status_at(&server.url("verify-full", &[("sslrootcert", &ca)])).await;
    assert_eq!(out.code, 0, "{out:?}");
}

#[tokio::test]
async fn a_certificate_that_fails_its_check_ends_with_a_hint() {
    let server = TlsServer::shared().await;
    let ca = server.ca_pem().display().to_string();
    let wrong = server.wrong_ca_pem().display().to_string();

    let out = status_at(&server.url("verify-ca", &[("sslrootcert", &wrong)])).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains("hint: the server's certificate is not signed by a CA"),
        "{out:?}"
    );

    let by_address = server.url_to(
        "127.0.0.1",
        server.database(),
        "verify-full",
        &[("sslrootcert", &ca)],
    );
    let out = status_at(&by_address).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains("hint: the server's certificate does not name the host"),
        "{out:?}"
    );

    let out = status_at(&server.url("disable", &[])).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr.contains("hint: the server accepts only TLS"),
        "{out:?}"
    );

    // A root certificate that cannot be read is bad input: nothing was tried.
    let out =
        status_at(&server.url("verify-full", &[("sslrootcert", "/nonexistent/ca.pem")])).await;
    assert_eq!(out.code, 2, "{out:?}");
    assert!(out.stderr.contains("sslrootcert"), "{out:?}");
}

#[tokio::test]
async fn the_pg_variables_and_the_password_file_replace_database_url() {
    let server = TlsServer::shared().await;
    let home = tempfile::tempdir().unwrap();
    let passfile = home.path().join("pgpass");
    std::fs::write(
        &passfile,
        format!(
            "localhost:{}:{}:{}:{}\n",
            server.port(),
            server.database(),
            server.user(),
            server.password().replace('\\', "\\\\").replace(':', "\\:")
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let mut cmd = pgbus();
    cmd.env("HOME", home.path())
        .env("PGHOST", "localhost")
        .env("PGPORT", server.port().to_string())
        .env("PGUSER", server.user())
        .env("PGDATABASE", server.database())
        .env("PGSSLMODE", "verify-full")
        .env("PGSSLROOTCERT", server.ca_pem())
        .env("PGPASSFILE", &passfile);
    let out = run(cmd, &["status", "--json"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert!(out.json().is_object() || out.json().is_array(), "{out:?}");
}
