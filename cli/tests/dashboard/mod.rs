//! Running `pgbus ui` in tests and talking to it: raw HTTP over a `TcpStream` (so a test
//! can send the headers a browser would never forge, from any loopback address) and a
//! browser session on a chromedriver of the test's own.

#![allow(dead_code, unreachable_pub)]

use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;

use fantoccini::{Client, ClientBuilder};
use pgbus_testkit::browser::Chromedriver;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::common;
use crate::proc::{self, WAIT};

/// A running `pgbus ui`, killed when dropped.
pub struct Ui {
    _child: tokio::process::Child,
    pub addr: SocketAddr,
}

impl Ui {
    /// Starts `pgbus ui --listen <free port of 127.0.0.1> --interval 200ms ARGS` with
    /// `env`, and waits until it says it serves.
    pub async fn start(db: &common::TestDb, args: &[&str], env: &[(&str, &str)]) -> Ui {
        Ui::start_on(&db.conninfo(), args, env).await
    }

    /// [`Ui::start`] on the database at `url`.
    pub async fn start_on(url: &str, args: &[&str], env: &[(&str, &str)]) -> Ui {
        Ui::listen(url, "127.0.0.1".parse().unwrap(), args, env).await
    }

    /// [`Ui::start_on`] listening on a free port of `ip`.
    pub async fn listen(url: &str, ip: IpAddr, args: &[&str], env: &[(&str, &str)]) -> Ui {
        let addr = free_port(ip);
        let mut cmd = proc::pgbus();
        cmd.env("DATABASE_URL", url)
            .args(["ui", "--listen", &addr.to_string(), "--interval", "200ms"])
            .args(args)
            .env_remove("PGBUS_UI_PASSWORD")
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawning pgbus ui");
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        common::within("pgbus ui to serve", WAIT, async {
            loop {
                let line = stderr
                    .next_line()
                    .await
                    .unwrap()
                    .expect("pgbus ui ended before serving");
                eprintln!("ui: {line}");
                if line.contains("dashboard on http://") {
                    break;
                }
            }
        })
        .await;
        tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                eprintln!("ui: {line}");
            }
        });
        Ui {
            _child: child,
            addr,
        }
    }

    /// Sends SIGTERM and waits for the end; the exit code.
    pub async fn stop(mut self) -> Option<i32> {
        let pid = self._child.id().expect("pgbus ui still runs");
        proc::signal(pid, "TERM").await;
        common::within("pgbus ui to stop", WAIT, self._child.wait())
            .await
            .unwrap()
            .code()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// A port of `ip` that was free a moment ago.
pub fn free_port(ip: IpAddr) -> SocketAddr {
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    listener.local_addr().unwrap()
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    /// The value of the first header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// A connection to `addr` from `from` (an address of the loopback range), or from the
/// address the system picks.
pub async fn connect(from: Option<IpAddr>, addr: SocketAddr) -> tokio::net::TcpStream {
    match from {
        None => tokio::net::TcpStream::connect(addr).await.unwrap(),
        Some(ip) => {
            let socket = match ip {
                IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
                IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
            }
            .unwrap();
            socket.bind(SocketAddr::new(ip, 0)).unwrap();
            socket.connect(addr).await.unwrap()
        }
    }
}

/// One HTTP/1.0 request (the body ends with the connection).
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    http_from(None, addr, method, path, headers, body).await
}

/// [`http`] from the address `from`.
pub async fn http_from(
    from: Option<IpAddr>,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut stream = connect(from, addr).await;
    let mut request = format!("{method} {path} HTTP/1.0\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        request.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
        request.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    read_answer(&mut stream).await
}

/// Reads an HTTP answer to the end of the connection.
pub async fn read_answer(stream: &mut tokio::net::TcpStream) -> Answer {
    let mut answer = Vec::new();
    common::within("an HTTP answer", WAIT, stream.read_to_end(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("an HTTP answer, not {answer:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head}"));
    Answer {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

/// A browser session on a chromedriver of the test's own.
pub async fn browser(driver: &Chromedriver) -> Client {
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(driver.capabilities())
        .connect(&driver.url())
        .await
        .unwrap_or_else(|e| panic!("a browser session: {e}\n{}", driver.log_tail()))
}

/// Runs `script` in the page; its result.
pub async fn js(browser: &Client, script: &str) -> Value {
    browser.execute(script, vec![]).await.unwrap()
}

/// The CSRF token of a `pgbus ui`: its cookie's value.
pub async fn csrf_cookie(ui: &Ui, auth: &[(&str, &str)]) -> String {
    let answer = http(ui.addr, "GET", "/", auth, "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let cookie = answer.header("set-cookie").expect("a CSRF cookie");
    assert!(cookie.contains("SameSite=Strict"), "{cookie}");
    assert!(cookie.contains("HttpOnly"), "{cookie}");
    cookie
        .split(';')
        .next()
        .and_then(|c| c.strip_prefix("pgbus_csrf="))
        .expect("the pgbus_csrf cookie")
        .to_string()
}

/// A form POSTed to `path` as the dashboard's own page sends it: its CSRF token in the
/// cookie and in the form, from the dashboard's origin. `fields` are the form's other
/// fields, URL-encoded (empty: none). Returns the answer and the cookie, for following
/// its redirect as the same browser.
pub async fn post_form(ui: &Ui, path: &str, fields: &str) -> (Answer, String) {
    let token = csrf_cookie(ui, &[]).await;
    let cookie = format!("pgbus_csrf={token}");
    let origin = format!("http://{}", ui.addr);
    let body = if fields.is_empty() {
        format!("csrf={token}")
    } else {
        format!("csrf={token}&{fields}")
    };
    let answer = http(
        ui.addr,
        "POST",
        path,
        &[("Cookie", &cookie), ("Origin", &origin)],
        &body,
    )
    .await;
    (answer, cookie)
}

/// The body of the page at `first` and of every page its `id="NEXT_ID"` link leads to,
/// in order, each answered 200; a browser's requests (the link's fragment left out).
/// Fails past `max` pages.
pub async fn follow_pages(ui: &Ui, first: &str, next_id: &str, max: usize) -> Vec<String> {
    let link = format!("id=\"{next_id}\" href=\"");
    let mut path = first.to_owned();
    let mut pages = Vec::new();
    loop {
        let page = http(ui.addr, "GET", &path, &[], "").await;
        assert_eq!(page.status, 200, "{path}: {page:?}");
        pages.push(page.body);
        assert!(pages.len() <= max, "more than {max} pages from {first}");
        let body = pages.last().unwrap();
        let Some(at) = body.find(&link) else {
            return pages;
        };
        let rest = &body[at + link.len()..];
        let href = rest[..rest.find('"').unwrap()].replace("&amp;", "&");
        path = href.split('#').next().unwrap().to_owned();
    }
}
