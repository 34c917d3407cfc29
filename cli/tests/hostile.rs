//! `pgbus ui` against a hostile client: a page of another site reaching it by a name of
//! its own (DNS rebinding) or posting to it, a dashboard served off the loopback address
//! without a password, half-sent requests and too many connections, password guessing,
//! a link that writes the page's banner, and text that hides or reorders itself. Real
//! servers over real connections: raw HTTP over a `TcpStream` where a browser would not
//! send the headers, headless Chromium where the rendering is the point. Every address
//! used is in the loopback range.

mod common;
mod dashboard;
mod proc;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use dashboard::{Answer, Ui, browser, connect, csrf_cookie, http, http_from, js, read_answer};
use fantoccini::Locator;
use pgbus::Event;
use pgbus_testkit::browser::Chromedriver;
use proc::WAIT;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// "anyone:s3cret", the password of the guarded dashboards.
const RIGHT: &str = "Basic YW55b25lOnMzY3JldA==";

/// "anyone:wrong".
const WRONG: &str = "Basic YW55b25lOndyb25n";

/// How many dead deliveries the database holds.
async fn dead(client: &tokio_postgres::Client) -> i64 {
    common::count(
        client,
        "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
    )
    .await
}

/// Every route of the dashboard, with a request that would succeed from its own pages:
/// method, path, form.
fn routes(token: &str) -> Vec<(&'static str, &'static str, String)> {
    let form = format!("csrf={token}");
    vec![
        ("GET", "/", String::new()),
        ("GET", "/subscriptions/jobs", String::new()),
        ("GET", "/events?q=e1", String::new()),
        ("GET", "/consumers", String::new()),
        ("GET", "/api/overview", String::new()),
        ("GET", "/api/subscriptions/jobs", String::new()),
        ("GET", "/api/events?q=e1", String::new()),
        ("GET", "/api/consumers", String::new()),
        ("GET", "/static/app.js", String::new()),
        ("GET", "/static/style.css", String::new()),
        ("POST", "/subscriptions/jobs/retry", form.clone()),
        (
            "POST",
            "/subscriptions/jobs/purge",
            format!("{form}&confirm=yes"),
        ),
        (
            "POST",
            "/subscriptions/jobs/replay",
            format!("{form}&since=2000-01-01T00:00"),
        ),
        (
            "POST",
            "/subscriptions/jobs/keys/redrive",
            format!("{form}&key=k"),
        ),
        (
            "POST",
            "/subscriptions/jobs/keys/skip",
            format!("{form}&key=k"),
        ),
    ]
}

/// Asserts that `answer`, to a request naming a host the dashboard does not serve, was
/// refused without a CSRF cookie or any of the dashboard's content.
fn refused_host(what: &str, answer: &Answer) {
    assert!(
        answer.status == 421 || answer.status == 403,
        "{what}: {answer:?}"
    );
    assert!(answer.header("set-cookie").is_none(), "{what}: {answer:?}");
    assert!(!answer.body.contains("jobs"), "{what}: {answer:?}");
}

#[tokio::test]
async fn a_foreign_host_is_refused_on_every_route_on_every_address() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["p.*"], 3)
        .await
        .unwrap();
    proc::two_dead_letters(&client).await;
    let on_loopback = Ui::start(&db, &["--allow-actions"], &[]).await;
    let everywhere = Ui::listen(
        &db.conninfo(),
        ip("0.0.0.0"),
        &["--allow-actions", "--insecure-no-auth"],
        &[],
    )
    .await;
    // The listener on every address, reached through 127.0.0.1.
    let everywhere_local = SocketAddr::from(([127, 0, 0, 1], everywhere.addr.port()));
    for (ui_addr, what) in [
        (on_loopback.addr, "127.0.0.1"),
        (everywhere_local, "0.0.0.0"),
    ] {
        let port = ui_addr.port();
        let token = {
            let answer = http(ui_addr, "GET", "/", &[], "").await;
            assert_eq!(answer.status, 200, "{what}: {answer:?}");
            let cookie = answer.header("set-cookie").expect("a CSRF cookie");
            cookie
                .split(';')
                .next()
                .and_then(|c| c.strip_prefix("pgbus_csrf="))
                .unwrap()
                .to_string()
        };
        let cookie = format!("pgbus_csrf={token}");
        for host in [
            format!("attacker.example:{port}"),
            format!("127.0.0.1.attacker.example:{port}"),
            format!("localhost.attacker.example:{port}"),
            "attacker.example".to_string(),
        ] {
            // The attacker's page is same-origin with itself: its Origin names its host.
            let origin = format!("http://{host}");
            for (method, path, form) in routes(&token) {
                let answer = http(
                    ui_addr,
                    method,
                    path,
                    &[("Host", &host), ("Cookie", &cookie), ("Origin", &origin)],
                    &form,
                )
                .await;
                refused_host(&format!("{what}: {method} {path} as {host}"), &answer);
            }
            assert_eq!(dead(&client).await, 2, "{what}: no action ran");
        }
        // The names it serves: the address the connection reached, and the loopback names.
        for host in [
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("LocalHost:{port}"),
        ] {
            let answer = http(ui_addr, "GET", "/api/overview", &[("Host", &host)], "").await;
            assert_eq!(answer.status, 200, "{what} as {host}: {answer:?}");
        }
        // Another port is another origin.
        let host = format!("127.0.0.1:{}", port.wrapping_add(1));
        let answer = http(ui_addr, "GET", "/", &[("Host", &host)], "").await;
        refused_host(&format!("{what} as {host}"), &answer);
    }
    // Reached through 127.0.0.2, the listener on every address serves that name too.
    let second = SocketAddr::from(([127, 0, 0, 2], everywhere.addr.port()));
    let answer = http(second, "GET", "/api/overview", &[], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // The address a connection reached is not a name for another connection's.
    let host = format!("127.0.0.2:{}", on_loopback.addr.port());
    let answer = http(on_loopback.addr, "GET", "/", &[("Host", &host)], "").await;
    refused_host("127.0.0.1 as 127.0.0.2", &answer);
    assert_eq!(dead(&client).await, 2);
}

#[tokio::test]
async fn actions_from_a_foreign_origin_are_refused_and_allowed_hosts_are_served() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["p.*"], 3)
        .await
        .unwrap();
    proc::two_dead_letters(&client).await;
    let ui = Ui::start(
        &db,
        &["--allow-actions", "--allowed-host", "dash.example"],
        &[],
    )
    .await;
    let port = ui.addr.port();
    let token = csrf_cookie(&ui, &[]).await;
    let cookie = format!("pgbus_csrf={token}");
    let form = format!("csrf={token}&event_id=e1");
    let other_port = format!("http://127.0.0.1:{}", port.wrapping_add(1));
    let attacker = format!("http://attacker.example:{port}");
    let attacker_referer = format!("http://attacker.example:{port}/subscriptions/jobs");
    for (what, header, value) in [
        ("a foreign origin", "Origin", attacker.as_str()),
        ("another port's origin", "Origin", other_port.as_str()),
        ("an opaque origin", "Origin", "null"),
        ("a foreign referer", "Referer", attacker_referer.as_str()),
        ("a referer without a scheme", "Referer", "attacker.example"),
    ] {
        let answer = http(
            ui.addr,
            "POST",
            "/subscriptions/jobs/retry",
            &[("Cookie", &cookie), (header, value)],
            &form,
        )
        .await;
        assert_eq!(answer.status, 403, "{what}: {answer:?}");
        assert_eq!(dead(&client).await, 2, "{what}: nothing was retried");
    }
    // An allowed host name: served, and an origin of its own.
    let named = format!("dash.example:{port}");
    let answer = http(ui.addr, "GET", "/api/overview", &[("Host", &named)], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let answer = http(ui.addr, "GET", "/", &[("Host", "DASH.example")], "").await;
    assert_eq!(
        answer.status, 200,
        "any port of a name without one: {answer:?}"
    );
    let answer = http(
        ui.addr,
        "POST",
        "/subscriptions/jobs/retry",
        &[
            ("Host", &named),
            ("Cookie", &cookie),
            ("Origin", "https://dash.example"),
        ],
        &form,
    )
    .await;
    assert_eq!(answer.status, 303, "{answer:?}");
    assert_eq!(dead(&client).await, 1);
    let answer = http(
        ui.addr,
        "GET",
        "/",
        &[("Host", &format!("dash.example.attacker.example:{port}"))],
        "",
    )
    .await;
    refused_host("a name that starts with an allowed one", &answer);
    // Bad --allowed-host values are refused at start.
    for bad in [
        "",
        "a b",
        "http://dash.example",
        "dash.example:99999",
        "x/y",
    ] {
        let out = proc::run(proc::pgbus_on(&db), &["ui", "--allowed-host", bad]).await;
        assert_eq!(out.code, 2, "{bad:?}: {out:?}");
        assert!(out.stderr.contains("--allowed-host"), "{bad:?}: {out:?}");
    }
}

#[tokio::test]
async fn off_loopback_the_dashboard_needs_a_password_unless_told_otherwise() {
    let db = common::test_db().await;
    for listen in ["0.0.0.0", "[::]"] {
        let addr = format!("{listen}:{}", dashboard::free_port(ip("127.0.0.1")).port());
        let out = proc::run(proc::pgbus_on(&db), &["ui", "--listen", &addr]).await;
        assert_eq!(out.code, 2, "{addr}: {out:?}");
        assert!(
            out.stderr.contains("PGBUS_UI_PASSWORD") && out.stderr.contains("--insecure-no-auth"),
            "{addr}: {out:?}"
        );
        assert!(!out.stderr.contains("dashboard on"), "{addr}: {out:?}");
    }
    // With a password, or told explicitly, it serves.
    let guarded = Ui::listen(
        &db.conninfo(),
        ip("0.0.0.0"),
        &[],
        &[("PGBUS_UI_PASSWORD", "s3cret")],
    )
    .await;
    let local = SocketAddr::from(([127, 0, 0, 1], guarded.addr.port()));
    let answer = http(local, "GET", "/api/overview", &[], "").await;
    assert_eq!(answer.status, 401, "{answer:?}");
    let answer = http(
        local,
        "GET",
        "/api/overview",
        &[("Authorization", RIGHT)],
        "",
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let open = Ui::listen(&db.conninfo(), ip("0.0.0.0"), &["--insecure-no-auth"], &[]).await;
    let local = SocketAddr::from(([127, 0, 0, 1], open.addr.port()));
    let answer = http(local, "GET", "/api/overview", &[], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
}

#[tokio::test]
async fn another_loopback_address_is_served_by_its_own_name() {
    let db = common::test_db().await;
    let ui = Ui::listen(&db.conninfo(), ip("127.0.0.2"), &[], &[]).await;
    let port = ui.addr.port();
    for host in [format!("127.0.0.2:{port}"), format!("localhost:{port}")] {
        let answer = http(ui.addr, "GET", "/", &[("Host", &host)], "").await;
        assert_eq!(answer.status, 200, "{host}: {answer:?}");
        assert!(answer.body.contains("Subscriptions"), "{host}: {answer:?}");
    }
    let answer = http(
        ui.addr,
        "GET",
        "/",
        &[("Host", &format!("attacker.example:{port}"))],
        "",
    )
    .await;
    refused_host("127.0.0.2 as attacker.example", &answer);
}

#[tokio::test]
async fn half_sent_headers_are_dropped_after_the_header_timeout() {
    let db = common::test_db().await;
    let ui = Ui::start(&db, &["--header-timeout", "1s"], &[]).await;
    let mut half = connect(None, ui.addr).await;
    half.write_all(format!("GET / HTTP/1.1\r\nHost: {}\r\nX-Slow: ", ui.addr).as_bytes())
        .await
        .unwrap();
    // The dashboard gives up on the request and closes the connection (read_answer would
    // wait for ever otherwise, and fails after WAIT).
    let started = Instant::now();
    let mut rest = Vec::new();
    common::within(
        "the half-sent request to be dropped",
        WAIT,
        tokio::io::AsyncReadExt::read_to_end(&mut half, &mut rest),
    )
    .await
    .ok();
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "dropped after the timeout, not before"
    );
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.is_empty() || rest.starts_with("HTTP/1.1 408"),
        "nothing, or a 408: {rest:?}"
    );
    // An idle connection kept alive after an answer is closed too.
    let mut idle = connect(None, ui.addr).await;
    idle.write_all(
        format!(
            "GET /static/style.css HTTP/1.1\r\nHost: {}\r\n\r\n",
            ui.addr
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let answer = read_answer(&mut idle).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // A whole request is still served.
    let answer = http(ui.addr, "GET", "/api/overview", &[], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
}

#[tokio::test]
async fn a_stop_ends_despite_idle_and_half_sent_connections() {
    let db = common::test_db().await;
    let ui = Ui::start(&db, &["--header-timeout", "10m"], &[]).await;
    let _half = hold(ip("127.0.0.1"), &ui).await;
    let mut idle = connect(None, ui.addr).await;
    idle.write_all(format!("GET /static/app.js HTTP/1.1\r\nHost: {}\r\n\r\n", ui.addr).as_bytes())
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    tokio::io::AsyncReadExt::read_exact(&mut idle, &mut byte)
        .await
        .unwrap();
    assert_eq!(ui.stop().await, Some(0));
}

/// A connection that sent half a request and holds it open.
async fn hold(from: IpAddr, ui: &Ui) -> tokio::net::TcpStream {
    let mut stream = connect(Some(from), ui.addr).await;
    stream
        .write_all(format!("GET / HTTP/1.1\r\nHost: {}\r\n", ui.addr).as_bytes())
        .await
        .unwrap();
    stream
}

/// The answer to a connection from `from` that sends nothing: the refusal of a
/// connection over a cap.
async fn refused_connection(from: IpAddr, ui: &Ui) -> Answer {
    let mut stream = connect(Some(from), ui.addr).await;
    read_answer(&mut stream).await
}

#[tokio::test]
async fn connections_are_capped_in_all_and_per_client_address() {
    let db = common::test_db().await;
    let ui = Ui::start(
        &db,
        &[
            "--max-connections",
            "4",
            "--max-connections-per-ip",
            "2",
            "--header-timeout",
            "10m",
        ],
        &[],
    )
    .await;
    let (one, three, four) = (ip("127.0.0.1"), ip("127.0.0.3"), ip("127.0.0.4"));
    let mut held = vec![hold(one, &ui).await, hold(one, &ui).await];
    // The connections are taken in order: the third of 127.0.0.1 is over its cap.
    let answer = refused_connection(one, &ui).await;
    assert_eq!(answer.status, 503, "{answer:?}");
    assert!(answer.body.contains("address"), "{answer:?}");
    // Another client still gets in, up to the cap of all.
    held.push(hold(three, &ui).await);
    held.push(hold(three, &ui).await);
    let answer = refused_connection(four, &ui).await;
    assert_eq!(answer.status, 503, "{answer:?}");
    assert!(answer.body.contains("at most 4"), "{answer:?}");
    // The other client's connections were taken: one, finished, is answered.
    let mut finished = held.pop().unwrap();
    finished
        .write_all(b"Connection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = read_answer(&mut finished).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // A closed connection frees its place.
    drop(held.remove(0));
    common::wait_for("a place to free up", WAIT, || async {
        let mut stream = connect(Some(four), ui.addr).await;
        stream
            .write_all(
                format!("GET /api/overview HTTP/1.0\r\nHost: {}\r\n\r\n", ui.addr).as_bytes(),
            )
            .await
            .ok();
        read_answer(&mut stream).await.status == 200
    })
    .await;
}

#[tokio::test]
async fn wrong_passwords_back_off_per_client_address() {
    let db = common::test_db().await;
    let ui = Ui::start(&db, &[], &[("PGBUS_UI_PASSWORD", "s3cret")]).await;
    let (one, three) = (ip("127.0.0.1"), ip("127.0.0.3"));
    let attempt = |from: IpAddr, auth: &'static str| {
        let addr = ui.addr;
        async move {
            http_from(
                Some(from),
                addr,
                "GET",
                "/api/overview",
                &[("Authorization", auth)],
                "",
            )
            .await
        }
    };
    // A request without credentials is the browser's first one: not a failure.
    for _ in 0..10 {
        let answer = http(ui.addr, "GET", "/", &[], "").await;
        assert_eq!(answer.status, 401, "{answer:?}");
    }
    let mut failures = 0;
    let blocked = loop {
        let answer = attempt(one, WRONG).await;
        failures += 1;
        if answer.status == 429 {
            break answer;
        }
        assert_eq!(answer.status, 401, "{answer:?}");
        assert!(
            failures < 10,
            "still no back-off after {failures} wrong passwords"
        );
    };
    let blocked_at = Instant::now();
    let retry_after: u64 = blocked
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a Retry-After in seconds: {blocked:?}"));
    assert!(retry_after >= 1, "{blocked:?}");
    assert!(blocked.header("set-cookie").is_none(), "{blocked:?}");
    // While it lasts, even the right password is refused from that address...
    let answer = attempt(one, RIGHT).await;
    assert!(
        answer.status == 429 || blocked_at.elapsed() >= Duration::from_secs(retry_after),
        "{answer:?}"
    );
    // ...and accepted from another.
    let answer = attempt(three, RIGHT).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // The next wrong password after the wait is refused for longer.
    let longer = std::cell::Cell::new(0);
    common::wait_for("a longer back-off", WAIT, || async {
        let answer = attempt(one, WRONG).await;
        assert_eq!(answer.status, 429, "{answer:?}");
        longer.set(
            answer
                .header("retry-after")
                .and_then(|v| v.parse().ok())
                .unwrap(),
        );
        longer.get() > retry_after
    })
    .await;
    let longer = longer.get();
    assert!(longer >= 2 * retry_after, "{longer} after {retry_after}");
}

#[tokio::test]
async fn the_csrf_cookie_goes_only_to_requests_that_passed_host_and_auth() {
    let db = common::test_db().await;
    let ui = Ui::start(
        &db,
        &["--allow-actions"],
        &[("PGBUS_UI_PASSWORD", "s3cret")],
    )
    .await;
    let foreign = format!("attacker.example:{}", ui.addr.port());
    for (what, headers) in [
        ("no credentials", vec![]),
        ("a wrong password", vec![("Authorization", WRONG)]),
        (
            "a foreign host",
            vec![("Authorization", RIGHT), ("Host", foreign.as_str())],
        ),
    ] {
        for path in [
            "/",
            "/subscriptions/jobs",
            "/api/overview",
            "/static/app.js",
        ] {
            let answer = http(ui.addr, "GET", path, &headers, "").await;
            assert!(answer.status >= 400, "{what} {path}: {answer:?}");
            assert!(
                answer.header("set-cookie").is_none(),
                "{what} {path}: {answer:?}"
            );
        }
    }
    let token = csrf_cookie(&ui, &[("Authorization", RIGHT)]).await;
    assert_eq!(token.len(), 64);
}

#[tokio::test]
async fn a_link_cannot_write_the_banner() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["p.*"], 3)
        .await
        .unwrap();
    let ui = Ui::start(&db, &["--allow-actions"], &[]).await;
    for done in [
        "retried%2099%20dead%20letters",
        "purged%20everything",
        "00000000000000000000000000000000",
    ] {
        let page = http(
            ui.addr,
            "GET",
            &format!("/subscriptions/jobs?done={done}"),
            &[],
            "",
        )
        .await;
        assert_eq!(page.status, 200, "{page:?}");
        assert!(!page.body.contains("retried 99"), "{}", page.body);
        assert!(!page.body.contains("purged everything"), "{}", page.body);
        assert!(
            !page.body.contains("role=\"status\""),
            "no banner: {}",
            page.body
        );
    }
}

#[tokio::test]
async fn forms_are_small_and_slow_requests_end() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["p.*"], 3)
        .await
        .unwrap();
    proc::two_dead_letters(&client).await;
    let ui = Ui::start(&db, &["--allow-actions", "--request-timeout", "2s"], &[]).await;
    let token = csrf_cookie(&ui, &[]).await;
    let cookie = format!("pgbus_csrf={token}");
    let big = format!("csrf={token}&event_id=e1&pad={}", "x".repeat(20 * 1024));
    let answer = http(
        ui.addr,
        "POST",
        "/subscriptions/jobs/retry",
        &[("Cookie", &cookie)],
        &big,
    )
    .await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(dead(&client).await, 2, "nothing was retried");
    // A read that waits on a lock ends with the request's timeout.
    let mut locker = db.connect().await;
    let tx = locker.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE pgbus.subscriptions IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let answer = http(ui.addr, "GET", "/subscriptions/jobs", &[], "").await;
    assert_eq!(answer.status, 503, "{answer:?}");
    assert!(answer.body.contains("took longer than"), "{answer:?}");
    tx.rollback().await.unwrap();
    common::wait_for("the page to read again", WAIT, || async {
        http(ui.addr, "GET", "/subscriptions/jobs", &[], "")
            .await
            .status
            == 200
    })
    .await;
}

#[tokio::test]
async fn a_client_that_takes_no_answer_loses_its_connection() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // Eight large events of one correlation id: their answer (7 MiB) is more than the
    // sockets' buffers hold (the client's is made small; the server's grows to 4 MiB on
    // Linux by default), so its writing waits on the client.
    let pad = "x".repeat(900 * 1024);
    for _ in 0..8 {
        let event = Event::new("big.one", json!({ "pad": pad })).correlation_id("big");
        pgbus::publish(&client, &event).await.unwrap();
    }
    let ui = Ui::start(
        &db,
        &["--max-connections-per-ip", "1", "--request-timeout", "15s"],
        &[],
    )
    .await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(ui.addr).await.unwrap();
    stalled
        .write_all(
            format!(
                "GET /api/events?q=big HTTP/1.0\r\nHost: {}\r\n\r\n",
                ui.addr
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // The answer starts (the read is done), then the client takes no more of it...
    let mut head = Vec::new();
    common::within("the answer's head", WAIT, async {
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            tokio::io::AsyncReadExt::read_exact(&mut stalled, &mut byte)
                .await
                .unwrap();
            head.push(byte[0]);
        }
    })
    .await;
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.0 200"), "{head}");
    // ...and holds the address's only place until the dashboard gives up on it.
    common::wait_for("the stalled connection to be closed", WAIT, || async {
        http(ui.addr, "GET", "/static/style.css", &[], "")
            .await
            .status
            == 200
    })
    .await;
    let mut got = Vec::new();
    let _ = common::within(
        "the rest of the stalled answer",
        WAIT,
        tokio::io::AsyncReadExt::read_to_end(&mut stalled, &mut got),
    )
    .await;
    assert!(
        got.len() < 8 * pad.len(),
        "the answer was cut short: {} bytes",
        got.len()
    );
}

/// The invisible characters of the test, with the code each must show as.
const HIDDEN: [(char, &str); 4] = [
    ('\u{202E}', "<U+202E>"),
    ('\u{200B}', "<U+200B>"),
    ('\u{2066}', "<U+2066>"),
    ('\u{00AD}', "<U+00AD>"),
];

#[tokio::test]
async fn invisible_characters_show_as_marked_codes() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "marks", &["marks.*"], 25)
        .await
        .unwrap();
    let sneaky = "pay\u{202E}lacol\u{200B}x\u{2066}y\u{00AD}z";
    let event = Event::new("marks.one", json!({ "to": sneaky }))
        .header("h", sneaky)
        .aggregate("acct", "1");
    let id = event.id.clone();
    pgbus::publish(&client, &event).await.unwrap();
    common::fan_out(&client).await;
    let error = format!("failed: {sneaky}");
    client
        .execute(
            "WITH d AS (UPDATE pgbus.deliveries SET status = 'dead', attempts = 1, last_error = $1 \
             RETURNING subscription, event_seq) \
             INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker) \
             SELECT subscription, event_seq, 1, $1, 'w' FROM d",
            &[&error],
        )
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO pgbus.consumers (id, awake, expires_at, subscriptions, info) \
             VALUES ('w-marks', true, now() + interval '1 hour', '{marks}', $1)",
            &[&format!("pid 1 on {sneaky}")],
        )
        .await
        .unwrap();

    let ui = Ui::start(&db, &[], &[]).await;

    // The JSON API escapes them: the same data, and nothing that reorders a terminal.
    for path in [
        format!("/api/events?q={id}"),
        "/api/subscriptions/marks".to_string(),
        "/api/consumers".to_string(),
    ] {
        let answer = http(ui.addr, "GET", &path, &[], "").await;
        assert_eq!(answer.status, 200, "{path}: {answer:?}");
        for (c, _) in HIDDEN {
            assert!(
                !answer.body.contains(c),
                "{path}: a raw {c:?} in {}",
                answer.body
            );
        }
        assert!(answer.body.contains("\\u202e"), "{path}: {}", answer.body);
    }
    let answer = http(ui.addr, "GET", &format!("/api/events?q={id}"), &[], "").await;
    let events: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(events["events"][0]["event"]["payload"], event.payload);
    assert_eq!(events["events"][0]["event"]["headers"]["h"], sneaky);

    // Every page shows them as marked codes, drawn on the server or by the script.
    let driver = Chromedriver::start().await.unwrap();
    let browser = browser(&driver).await;
    let no_raw = format!(
        "return !/[{}]/u.test(document.body.textContent);",
        HIDDEN
            .map(|(c, _)| format!("\\u{{{:X}}}", c as u32))
            .concat()
    );
    let marks = |selector: &str| {
        format!("return [...document.querySelectorAll('{selector} .cc')].map(e => e.textContent);")
    };
    let want: Vec<Value> = HIDDEN.iter().map(|(_, code)| json!(code)).collect();
    browser
        .goto(&ui.url(&format!("/events?q={id}")))
        .await
        .unwrap();
    for selector in [
        "pre.payload",
        "pre.headers",
        ".delivery > pre.error",
        ".delivery table.history",
    ] {
        assert_eq!(
            js(&browser, &marks(selector)).await,
            Value::Array(want.clone()),
            "{selector} on the event's page"
        );
    }
    assert_eq!(
        js(&browser, &no_raw).await,
        Value::Bool(true),
        "the event's page"
    );
    let shown = browser
        .find(Locator::Css("pre.payload"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        shown.contains("pay<U+202E>lacol<U+200B>x<U+2066>y<U+00AD>z"),
        "{shown}"
    );

    browser.goto(&ui.url("/subscriptions/marks")).await.unwrap();
    assert_eq!(
        js(&browser, &marks("details.dead-letter .last-error")).await,
        Value::Array(want.clone()),
        "the dead letter's error"
    );
    assert_eq!(
        js(&browser, &no_raw).await,
        Value::Bool(true),
        "the subscription's page"
    );

    // The consumers page's rows are drawn by its script from /api/consumers.
    browser.goto(&ui.url("/consumers")).await.unwrap();
    common::wait_for("the consumers page's script to draw", WAIT, || async {
        js(
            &browser,
            "return document.body.dataset.refreshed !== undefined;",
        )
        .await
            == Value::Bool(true)
    })
    .await;
    assert_eq!(
        js(&browser, &marks("#consumer-list")).await,
        Value::Array(want.clone()),
        "the consumer's process"
    );
    assert_eq!(
        js(&browser, &no_raw).await,
        Value::Bool(true),
        "the consumers page"
    );
    browser.close().await.unwrap();
}
