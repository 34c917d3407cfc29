//! The TLS-only server fixture does what it promises: plain TCP is refused, a rustls
//! client that verifies against its CA gets in (over TLS, with the password), the
//! certificate names `localhost` only, the wrong CA signed nothing, and each new database
//! is migrated and apart from the others.

use std::path::Path;
use std::sync::Arc;

use pgbus_testkit::tls::{HOST, SERVER_NAME, TlsServer};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

/// A rustls connector that trusts the CA in `ca_pem` only.
fn verifying_against(ca_pem: &Path) -> MakeRustlsConnect {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca_pem).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    MakeRustlsConnect::new(config)
}

async fn connect_tls(config: &Config, ca_pem: &Path) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(verifying_against(ca_pem)).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// The server's database at `host` (`Config::host` adds a host to those of
/// `TlsServer::config`: a connection would try `localhost` first).
fn reached_at(server: &TlsServer, host: &str, sslmode: &str) -> Config {
    let config: Config = server
        .url_to(host, server.database(), sslmode, &[])
        .parse()
        .unwrap();
    assert_eq!(config.get_hosts().len(), 1);
    config
}

#[tokio::test]
async fn a_connection_without_tls_is_refused() {
    let server = TlsServer::shared().await;
    for host in [HOST, SERVER_NAME] {
        let config = reached_at(server, host, "disable");
        let e = config.connect(NoTls).await.err().expect("plain TCP got in");
        let text = pgbus_testkit::error_chain(&e);
        assert!(
            text.contains("pg_hba.conf rejects connection") && text.contains("no encryption"),
            "{text}"
        );
    }
}

#[tokio::test]
async fn a_rustls_client_verified_against_the_ca_gets_in_over_tls_with_the_password() {
    let server = TlsServer::shared().await;
    let mut config = server.config();
    config.ssl_mode(SslMode::Require);
    let client = connect_tls(&config, server.ca_pem()).await.unwrap();
    let row = client
        .query_one(
            "SELECT ssl, current_user::text AS who FROM pg_stat_ssl \
             WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>("ssl"));
    assert_eq!(row.get::<_, String>("who"), server.user());
    assert_eq!(
        pgbus::schema::schema_version(&client).await.unwrap(),
        Some(pgbus::schema::latest_version())
    );

    let mut wrong_password = config.clone();
    wrong_password.password("not the password");
    let e = connect_tls(&wrong_password, server.ca_pem())
        .await
        .expect_err("a wrong password got in");
    assert!(
        pgbus_testkit::error_chain(&e).contains("password authentication failed"),
        "{e:?}"
    );
}

#[tokio::test]
async fn the_certificate_names_localhost_only_and_the_wrong_ca_signed_nothing() {
    let server = TlsServer::shared().await;
    // Verified against the right CA, but reached by address: the name does not match.
    let by_address = reached_at(server, HOST, "require");
    let e = connect_tls(&by_address, server.ca_pem())
        .await
        .expect_err("the certificate matched 127.0.0.1");
    assert!(
        pgbus_testkit::error_chain(&e).contains("certificate not valid for name"),
        "{}",
        pgbus_testkit::error_chain(&e)
    );

    let mut config = server.config();
    config.ssl_mode(SslMode::Require);
    let e = connect_tls(&config, server.wrong_ca_pem())
        .await
        .expect_err("the wrong CA verified the server");
    assert!(
        pgbus_testkit::error_chain(&e).contains("UnknownIssuer"),
        "{}",
        pgbus_testkit::error_chain(&e)
    );
}

#[tokio::test]
async fn each_new_database_is_migrated_and_apart() {
    let server = TlsServer::shared().await;
    let (a, b) = (
        server.new_database().await.unwrap(),
        server.new_database().await.unwrap(),
    );
    assert_ne!(a, b);
    let mut clients = Vec::new();
    for name in [&a, &b] {
        let mut config = server.config();
        config.dbname(name).ssl_mode(SslMode::Require);
        clients.push(connect_tls(&config, server.ca_pem()).await.unwrap());
    }
    pgbus::publish(
        &clients[0],
        &pgbus::Event::new("tls.checked", serde_json::json!({})),
    )
    .await
    .unwrap();
    let events = "SELECT count(*) FROM pgbus.events";
    assert_eq!(pgbus_testkit::count(&clients[0], events).await, 1);
    assert_eq!(pgbus_testkit::count(&clients[1], events).await, 0);
}

#[tokio::test]
async fn its_urls_name_the_user_the_port_the_database_and_the_modes() {
    let server = TlsServer::shared().await;
    let ca = server.ca_pem().to_str().unwrap();
    let url = server.url("verify-full", &[("sslrootcert", ca)]);
    assert!(
        url.starts_with(&format!(
            "postgresql://pgbus_tls:{}@localhost:{}/pgbus_tls?sslmode=verify-full&sslrootcert=",
            server.password(),
            server.port()
        )),
        "{url}"
    );
    // tokio-postgres parses what it knows of it (sslmode `require`; verify-* are
    // libpq's).
    let url = server.url_to(HOST, "other db", "require", &[]);
    let config: Config = url.parse().unwrap();
    assert_eq!(config.get_dbname(), Some("other db"));
    assert_eq!(config.get_ports(), [server.port()]);
    assert_eq!(config.get_password(), Some(server.password().as_bytes()));
}
