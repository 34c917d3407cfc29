//! Servers that never answer, or answer with something that is not PostgreSQL: every
//! connection pgbus opens (one of its own, the listener's, the bus's pool, through a
//! caller's TLS connector) gives up within the startup bound (`connect_timeout`,
//! `PGCONNECT_TIMEOUT`), with an error that names the host, the port and what it was
//! waiting for; bytes that are not PostgreSQL's protocol end the attempt at once; with
//! several hosts, each gets its own bound and the next is tried.
//!
//! The servers here are plain TCP listeners of the test's own on 127.0.0.1; the bound of
//! every attempt is 2 s, and every wait is bounded far above it (the machine may be
//! loaded): a hang fails the test, no test asserts a speed.

mod common;

use std::time::Duration;

use pgbus::{Bus, ConnectConfig, ConnectPhase, Error};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// The bound of the tests' waits: far above the 2 s startup bound.
const WAIT: Duration = Duration::from_secs(30);

/// What a test server does with each connection it accepts.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Reads nothing, sends nothing, keeps the connection open.
    Silent,
    /// Sends these bytes at once, then keeps the connection open.
    Sends(&'static [u8]),
}

/// A listener on 127.0.0.1 that treats every connection as `behaviour` says, for as
/// long as the test runs; returns its port.
async fn server(behaviour: Behaviour) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            if let Behaviour::Sends(bytes) = behaviour {
                let _ = socket.write_all(bytes).await;
            }
            held.push(socket);
        }
    });
    port
}

/// No variable from the machine's environment.
fn no_env(_: &str) -> Option<String> {
    None
}

fn config(s: &str) -> ConnectConfig {
    ConnectConfig::parse_with_env(s, no_env).unwrap()
}

/// Connects with `config`, failing the test if that takes longer than [`WAIT`].
async fn connect_error(what: &str, config: &ConnectConfig) -> Error {
    match common::within(what, WAIT, config.connect()).await {
        Ok(_) => panic!("{what}: connected"),
        Err(e) => e,
    }
}

/// Asserts that `e` is a connect error for 127.0.0.1:`port` in `phase`, timed out
/// after `bound` (or not timed out, when `None`), and that its message says so.
fn assert_connect(e: &Error, port: u16, phase: ConnectPhase, bound: Option<Duration>) {
    match e {
        Error::Connect {
            host,
            port: p,
            phase: ph,
            timed_out,
            ..
        } => {
            assert_eq!(host, "127.0.0.1", "{e}");
            assert_eq!(*p, port, "{e}");
            assert_eq!(*ph, phase, "{e}");
            assert_eq!(*timed_out, bound, "{e}");
        }
        other => panic!("not a connect error: {other:?} ({other})"),
    }
    let text = e.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains(phase.as_str()), "{text}");
    assert!(e.is_connection(), "{text}");
}

#[tokio::test]
async fn a_server_that_never_answers_fails_within_the_bound_naming_host_port_and_phase() {
    let port = server(Behaviour::Silent).await;
    // The default sslmode (prefer) asks for TLS first: the server never answers that.
    let e = connect_error(
        "connecting to a silent server",
        &config(&format!(
            "host=127.0.0.1 port={port} user=u dbname=d connect_timeout=2"
        )),
    )
    .await;
    assert_connect(
        &e,
        port,
        ConnectPhase::TlsRequest,
        Some(Duration::from_secs(2)),
    );
    assert!(e.to_string().contains("no answer within 2 s"), "{e}");

    // Without TLS, the startup message is the first thing sent.
    let e = connect_error(
        "connecting to a silent server without TLS",
        &config(&format!(
            "postgres://u@127.0.0.1:{port}/d?sslmode=disable&connect_timeout=2"
        )),
    )
    .await;
    assert_connect(
        &e,
        port,
        ConnectPhase::Authenticating,
        Some(Duration::from_secs(2)),
    );

    // PGCONNECT_TIMEOUT bounds it the same way.
    let env = |name: &str| (name == "PGCONNECT_TIMEOUT").then(|| "2".to_string());
    let from_env = ConnectConfig::parse_with_env(
        &format!("host=127.0.0.1 port={port} user=u sslmode=require"),
        env,
    )
    .unwrap();
    let e = connect_error("connecting with PGCONNECT_TIMEOUT", &from_env).await;
    assert_connect(
        &e,
        port,
        ConnectPhase::TlsRequest,
        Some(Duration::from_secs(2)),
    );
}

#[tokio::test]
async fn a_server_that_accepts_tls_and_goes_silent_is_bounded_in_the_handshake() {
    let port = server(Behaviour::Sends(b"S")).await;
    let e = connect_error(
        "connecting to a server silent after 'S'",
        &config(&format!(
            "host=127.0.0.1 port={port} user=u sslmode=require connect_timeout=2"
        )),
    )
    .await;
    assert_connect(
        &e,
        port,
        ConnectPhase::TlsHandshake,
        Some(Duration::from_secs(2)),
    );
}

#[tokio::test]
async fn a_server_that_logs_in_and_goes_silent_is_bounded_while_starting() {
    // AuthenticationOk, then nothing: no parameters, no ReadyForQuery.
    let port = server(Behaviour::Sends(b"R\0\0\0\x08\0\0\0\0")).await;
    let e = connect_error(
        "connecting to a server silent after logging in",
        &config(&format!(
            "host=127.0.0.1 port={port} user=u sslmode=disable connect_timeout=2"
        )),
    )
    .await;
    assert_connect(
        &e,
        port,
        ConnectPhase::Starting,
        Some(Duration::from_secs(2)),
    );
}

#[tokio::test]
async fn a_port_that_is_not_postgres_fails_at_once_naming_the_protocol() {
    let cases: [(&[u8], &str); 3] = [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "prefer"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "disable"),
        // An SSH server's banner begins with the 'S' that accepts TLS.
        (b"SSH-2.0-OpenSSH_9.6\r\n", "prefer"),
    ];
    for (bytes, sslmode) in cases {
        let port = server(Behaviour::Sends(bytes)).await;
        // No startup bound at all: only the check of the bytes can end the attempt.
        let e = connect_error(
            &format!("connecting to a non-PostgreSQL port with sslmode={sslmode}"),
            &config(&format!(
                "host=127.0.0.1 port={port} user=u sslmode={sslmode} connect_timeout=0"
            )),
        )
        .await;
        let Error::Connect { timed_out, .. } = &e else {
            panic!("not a connect error: {e:?}");
        };
        assert_eq!(*timed_out, None, "{e}");
        let text = e.to_string();
        assert!(text.contains("not PostgreSQL's protocol"), "{text}");
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    }
}

#[tokio::test]
async fn each_host_gets_its_own_bound_and_the_next_is_tried() {
    let db = common::test_db().await;
    let pg = db.config();
    let first = server(Behaviour::Silent).await;
    let second = server(Behaviour::Silent).await;

    // Two silent hosts: both tried, each for its own 2 s; the error names both.
    let e = connect_error(
        "connecting to two silent hosts",
        &config(&format!(
            "host=127.0.0.1,127.0.0.1 port={first},{second} user=u connect_timeout=2"
        )),
    )
    .await;
    assert_connect(
        &e,
        second,
        ConnectPhase::TlsRequest,
        Some(Duration::from_secs(2)),
    );
    assert!(e.to_string().contains(&format!("127.0.0.1:{first}")), "{e}");

    // A silent host, then the real server: connected, after the first host's bound.
    let real = match (pg.get_hosts().first(), pg.get_ports().first()) {
        (Some(tokio_postgres::config::Host::Tcp(host)), Some(port)) => (host.clone(), *port),
        #[cfg(unix)]
        (Some(tokio_postgres::config::Host::Unix(dir)), Some(port)) => {
            (dir.display().to_string(), *port)
        }
        _ => panic!("the test database has no host"),
    };
    let mut url = pgbus_testkit::conninfo(&pg);
    url = url
        .split(' ')
        .filter(|part| !part.starts_with("host=") && !part.starts_with("port="))
        .collect::<Vec<_>>()
        .join(" ");
    let both = config(&format!(
        "{url} host='127.0.0.1,{}' port={first},{} connect_timeout=2 sslmode=disable",
        real.0, real.1
    ));
    let client = common::within("connecting past a silent host", WAIT, both.connect())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
}

#[tokio::test]
async fn the_bus_pool_and_the_listener_report_the_connect_error_not_the_pool_timeout() {
    let port = server(Behaviour::Silent).await;
    let silent = config(&format!(
        "host=127.0.0.1 port={port} user=u dbname=d connect_timeout=2"
    ));

    // The listener's connection: the same bound and error.
    let e = match common::within(
        "the listener's connection",
        WAIT,
        silent.connect_with_messages(),
    )
    .await
    {
        Ok(_) => panic!("connected"),
        Err(e) => e,
    };
    assert_connect(
        &e,
        port,
        ConnectPhase::TlsRequest,
        Some(Duration::from_secs(2)),
    );

    // The bus's pool: its first connection fails with the error that says why.
    let started = common::within(
        "starting a bus on a silent server",
        WAIT,
        Bus::builder(silent.clone()).build().unwrap().start(),
    )
    .await;
    let e = match started {
        Ok(_) => panic!("a bus started on a silent server"),
        Err(e) => e,
    };
    assert!(
        !e.to_string().contains("Timeout occurred"),
        "the pool's own timeout: {e}"
    );
    assert_connect(
        &e,
        port,
        ConnectPhase::TlsRequest,
        Some(Duration::from_secs(2)),
    );
}

#[tokio::test]
async fn a_callers_tls_connector_is_bounded_the_same_way() {
    let port = server(Behaviour::Sends(b"S")).await;
    let roots = rustls::RootCertStore::empty();
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let with_tls = config(&format!(
        "host=127.0.0.1 port={port} user=u sslmode=require connect_timeout=2"
    ))
    .with_tls(tokio_postgres_rustls::MakeRustlsConnect::new(tls));
    let e = connect_error("connecting through the caller's connector", &with_tls).await;
    assert_connect(
        &e,
        port,
        ConnectPhase::TlsHandshake,
        Some(Duration::from_secs(2)),
    );
}

#[tokio::test]
async fn without_a_setting_the_bound_is_ten_seconds_and_zero_waits_forever() {
    assert_eq!(
        config("host=h user=u").startup_timeout(),
        Some(Duration::from_secs(10))
    );
    assert_eq!(
        config("host=h user=u connect_timeout=1").startup_timeout(),
        Some(Duration::from_secs(2)),
        "as libpq, less than 2 s is taken as 2 s"
    );
    assert_eq!(
        config("host=h user=u connect_timeout=0").startup_timeout(),
        None
    );
    assert_eq!(
        config("postgres://u@h/d?connect_timeout=7").startup_timeout(),
        Some(Duration::from_secs(7))
    );
    match ConnectConfig::parse_with_env("host=h user=u connect_timeout=soon", no_env) {
        Err(Error::Invalid { what, .. }) => assert_eq!(what, "connect_timeout"),
        other => panic!("{other:?}"),
    }
}
