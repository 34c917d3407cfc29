//! The command line against a server that never answers, and a port that is not
//! PostgreSQL: `pgbus status` gives up within `connect_timeout` (or `PGCONNECT_TIMEOUT`)
//! and exits 1, saying which host and port and what it was waiting for.

mod common;
mod proc;

use proc::{Output, pgbus, run};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// A listener on 127.0.0.1 that sends `greeting` to every connection and then keeps it
/// open without a word more; returns its port.
async fn server(greeting: &'static [u8]) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            let _ = socket.write_all(greeting).await;
            held.push(socket);
        }
    });
    port
}

/// `pgbus status` with DATABASE_URL `url` (and `vars`), HOME an empty directory.
async fn status_at(url: &str, vars: &[(&str, &str)]) -> Output {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = pgbus();
    cmd.env("DATABASE_URL", url).env("HOME", home.path());
    for (name, value) in vars {
        cmd.env(name, value);
    }
    // `run` fails the test if the command does not end within its bound.
    run(cmd, &["status"]).await
}

#[tokio::test]
async fn status_against_a_silent_server_gives_up_naming_host_and_phase() {
    let port = server(b"").await;
    let out = status_at(
        &format!("postgres://u@127.0.0.1:{port}/d?connect_timeout=2"),
        &[],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains(&format!("127.0.0.1:{port}")), "{out:?}");
    assert!(
        out.stderr
            .contains("no answer within 2 s waiting for the answer to the TLS request"),
        "{out:?}"
    );

    let out = status_at(
        &format!("postgres://u@127.0.0.1:{port}/d?sslmode=disable"),
        &[("PGCONNECT_TIMEOUT", "2")],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(
        out.stderr
            .contains("no answer within 2 s waiting for authentication"),
        "{out:?}"
    );
}

#[tokio::test]
async fn status_against_a_port_that_is_not_postgres_says_so() {
    let port = server(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
    let out = status_at(
        &format!("postgres://u@127.0.0.1:{port}/d?sslmode=disable"),
        &[],
    )
    .await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains(&format!("127.0.0.1:{port}")), "{out:?}");
    assert!(out.stderr.contains("not PostgreSQL's protocol"), "{out:?}");
}
