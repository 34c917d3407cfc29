//! `pgbus ui`: the web dashboard. An axum server on the command's tokio runtime, pages
//! rendered on the server (maud, which escapes everything it is given) with a little plain
//! JavaScript (`ui/app.js`, served as a static file) that polls the JSON endpoints under
//! `/api/` and updates the pages with `textContent`.
//!
//! Every read is an admin function of the library (`pgbus::admin`, `pgbus::ordering`);
//! a sampler task reads the overview every `--interval` and keeps the last minutes for
//! the charts.
//!
//! Security: every request must name in `Host` one of the names the dashboard serves
//! (the address the connection reached, the loopback names on a loopback connection, the
//! `--allowed-host` names); off the loopback address it needs `PGBUS_UI_PASSWORD` (HTTP
//! basic auth, wrong passwords backing off per client) unless `--insecure-no-auth`.
//! Read-only unless `--allow-actions`; an action is a POST that must carry the
//! per-process CSRF token both in its `SameSite=Strict; HttpOnly` cookie and in its form,
//! and whose `Origin` (or `Referer`), when sent, must name one of the served names.
//! The server caps connections (in all and per client), bounds a request's head, its
//! form and its run, and keeps actions' outcomes behind one-time ids. Every answer
//! forbids framing, sniffing and inline scripts (`Content-Security-Policy`); text that
//! hides or reorders itself is shown as marked codes (`security::Shown`).

mod pages;
mod security;
mod server;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::rejection::FormRejection;
use axum::extract::{DefaultBodyLimit, Form, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use futures::FutureExt as _;
use serde::{Deserialize, Serialize};

use super::{Failure, failed, human_duration, parse_duration, usage, with_sources};
use pgbus::admin::{self, DeadLetterFilter};
use security::{AllowedHost, Conn, Guesses, Hosts, Outcomes, client_key};

/// How long the charts look back, in samples: 5 minutes at the default interval.
const HISTORY_SAMPLES: usize = 300;

/// The window over which the throughput (delivered per second) is measured.
const THROUGHPUT_WINDOW: Duration = Duration::from_secs(10);

/// The most events of the window the throughput reads, and deliveries it probes (beyond,
/// it is estimated from an even sample of the window).
const THROUGHPUT_EVENTS: i64 = 2_000;

/// How many dead letters a subscription's page lists.
const DEAD_LETTERS_SHOWN: i64 = 50;
/// Pending deliveries listed on a subscription's page at a time.
const PENDING_SHOWN: i64 = 50;

/// How many failed attempts a subscription's page shows in all.
const FAILURES_SHOWN: i64 = 2000;

/// How many of the deliveries waiting behind a blocked key a subscription's page lists.
const WAITING_SHOWN: i64 = 5;

/// How many events a search shows.
const EVENTS_SHOWN: i64 = 20;

/// How long the oldest due delivery may wait before a subscription counts as behind.
const BEHIND_AFTER: f64 = 30.0;

/// The connections the dashboard holds at most.
const POOL_SIZE: usize = 4;

/// The JavaScript of the pages.
const APP_JS: &str = include_str!("ui/app.js");

/// The style sheet of the pages.
const STYLE_CSS: &str = include_str!("ui/style.css");

/// The name of the CSRF cookie.
const CSRF_COOKIE: &str = "pgbus_csrf";

/// The largest request body read: the actions' forms are a few hundred bytes.
const FORM_LIMIT: usize = 16 * 1024;

/// Arguments of `pgbus ui`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  pgbus ui
  pgbus ui --listen 127.0.0.1:8080 --allow-actions
  PGBUS_UI_PASSWORD=secret pgbus ui --listen 0.0.0.0:8080 --allowed-host dash.example

Serves a dashboard of the database in DATABASE_URL: every subscription's backlog, dead
letters, blocked keys and throughput with live charts, the notification queue, the live
consumers, and any event by id or correlation id. Every page's data is also served as
JSON under /api/ (/api/overview, /api/subscriptions/NAME, /api/events?q=ID,
/api/consumers).

Read-only unless --allow-actions: then a subscription's page can retry and purge dead
letters, redrive or skip a blocked key, and replay events since a time. Actions are
POSTs that must carry the process's CSRF token (a SameSite=Strict cookie and a form
field) and, when the browser sends one, an Origin naming one of the dashboard's hosts.

Every request must name in its Host header one of the dashboard's hosts: the address
the connection reached (with the port), localhost, 127.0.0.1 and [::1] on a loopback
connection, and the names given with --allowed-host (NAME: any port; NAME:PORT: that
one). Anything else is refused with 421, which keeps a site whose name was made to
resolve to this machine (DNS rebinding) from reading or acting on the dashboard; a
reverse proxy or a port mapping that keeps the browser's Host needs --allowed-host.

PGBUS_UI_PASSWORD set: every request needs HTTP basic auth with that password (any user
name); a client address that sends wrong passwords waits, longer each time (429 with
Retry-After). It listens on the loopback address unless told otherwise; off it, it
refuses to start without PGBUS_UI_PASSWORD unless given --insecure-no-auth. It has no
TLS of its own: put it behind a TLS proxy before listening elsewhere.

Limits: a request's head must arrive within --header-timeout (an idle connection is
closed after it too), a request is answered within --request-timeout, a form is at
most 16 KiB, and at most --max-connections connections (--max-connections-per-ip from
one address) are open at once; a connection over a cap is answered 503.

A database that goes away shows as an error banner; the dashboard keeps serving and
reads again at the next interval. Stops on SIGINT, SIGTERM or SIGHUP with exit 0. Exit
codes: 1 the database cannot be reached at start or the address cannot be bound; 2 bad
usage (a malformed address, interval or host name, an empty PGBUS_UI_PASSWORD, an
address off the loopback without a password or --insecure-no-auth).")]
pub(crate) struct UiArgs {
    /// Serve the dashboard on this address, an IP and a port.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:8080",
          value_parser = super::metrics::parse_addr)]
    listen: SocketAddr,
    /// Allow the actions (retry, purge, redrive, skip, replay); read-only without.
    #[arg(long)]
    allow_actions: bool,
    /// How often the overview is sampled from the database (the charts' resolution).
    #[arg(long, default_value = "2s", value_parser = parse_interval)]
    interval: Duration,
    /// Also answer to this host name (repeatable): NAME (any port) or NAME:PORT, as the
    /// browser writes it in Host (e.g. the name a reverse proxy serves).
    #[arg(long = "allowed-host", value_name = "NAME[:PORT]",
          value_parser = security::parse_allowed_host)]
    allowed_hosts: Vec<AllowedHost>,
    /// Serve off the loopback address without PGBUS_UI_PASSWORD: anyone who can connect
    /// reads the dashboard (and, with --allow-actions, acts on the bus).
    #[arg(long)]
    insecure_no_auth: bool,
    /// How long a request's head may take to arrive; an idle kept-alive connection is
    /// closed after it too.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_limit)]
    header_timeout: Duration,
    /// How long a request may take to be answered (then 503); also how long the answer's
    /// writing may wait for a client that takes none of it (then the connection closes).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_limit)]
    request_timeout: Duration,
    /// The connections open at once at most; one more is answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max_connections: u32,
    /// The connections open at once from one client address (an IPv6 client: its /64)
    /// at most.
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max_connections_per_ip: u32,
}

/// Parses a timeout of the server: a duration of at least 100ms.
fn parse_limit(text: &str) -> Result<Duration, String> {
    let limit = parse_duration(text)?;
    if limit < Duration::from_millis(100) {
        return Err(format!(
            "the timeout must be at least 100ms, got {}",
            human_duration(limit)
        ));
    }
    Ok(limit)
}

/// Parses `--interval`: a duration of at least 100ms.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < Duration::from_millis(100) {
        return Err(format!(
            "--interval must be at least 100ms, got {}",
            human_duration(interval)
        ));
    }
    Ok(interval)
}

/// Opens the pool's connections with the command line's configuration (TLS included).
struct Opener(pgbus::ConnectConfig);

impl deadpool_postgres::Connect for Opener {
    fn connect(
        &self,
        _: &tokio_postgres::Config,
    ) -> futures::future::BoxFuture<
        '_,
        Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        async move {
            let (client, mut messages) = match self.0.connect_with_messages().await {
                Ok(c) => c,
                Err(pgbus::Error::Database(e) | pgbus::Error::SchemaMissing(e)) => return Err(e),
                Err(e) => {
                    // Only the driver's errors come out of a connection attempt; anything
                    // else is logged and reported as a failed connection.
                    pgbus::warn_limited!(error = %with_sources(&e), "pgbus ui cannot connect");
                    return Err(connect_error().await);
                }
            };
            let driver = tokio::spawn(async move {
                use futures::StreamExt as _;
                while let Some(m) = messages.next().await {
                    if m.is_err() {
                        return;
                    }
                }
            });
            Ok((client, driver))
        }
        .boxed()
    }
}

/// A `tokio_postgres::Error` of a failed connection: that of a configuration without a
/// host, which fails before any I/O.
async fn connect_error() -> tokio_postgres::Error {
    match tokio_postgres::Config::new()
        .connect(tokio_postgres::NoTls)
        .await
    {
        Err(e) => e,
        Ok(_) => unreachable!("a configuration without a host cannot connect"),
    }
}

/// One subscription's row of the overview.
#[derive(Debug, Clone, Serialize)]
struct SubscriptionRow {
    name: String,
    due: i64,
    scheduled: i64,
    processing: i64,
    dead: i64,
    blocked_keys: i64,
    /// Seconds.
    oldest_due_age: Option<f64>,
    consumers_awake: i64,
    consumers_asleep: i64,
    delivered_per_second: f64,
    /// The throughput is estimated from an even sample of a window busier than
    /// [`THROUGHPUT_EVENTS`] (shown as `~`).
    throughput_estimated: bool,
    /// `healthy`, `behind`, `paused` or `failing`.
    health: &'static str,
    /// The chart: the last minutes' samples, oldest first.
    history: Vec<Point>,
}

/// One sample of a subscription's chart.
#[derive(Debug, Clone, Copy, Serialize)]
struct Point {
    /// Milliseconds since the epoch.
    at: i64,
    delivered_per_second: f64,
    /// Due, scheduled and processing deliveries.
    backlog: i64,
}

/// The overview, as `/api/overview` serves it.
#[derive(Debug, Clone, Serialize)]
struct Overview {
    /// When the last good sample was read (`None`: never).
    sampled_at: Option<DateTime<Utc>>,
    /// Why the last sample failed, when it did.
    error: Option<String>,
    /// The most any count shows (a count at the cap means "at least").
    count_cap: i64,
    notification_queue_usage: f64,
    listeners: i64,
    consumers: i64,
    sleeping_consumers: i64,
    /// Committed events not yet turned into deliveries (up to the cap): no
    /// subscription's count includes them yet.
    not_fanned_out: i64,
    /// Seconds since the oldest transaction holding the xmin horizon back started.
    oldest_transaction_age: Option<f64>,
    /// The banner's text when that transaction is older than
    /// [`DEFAULT_LONG_TRANSACTION_WARNING`](pgbus::metrics::DEFAULT_LONG_TRANSACTION_WARNING).
    long_transaction: Option<String>,
    subscriptions: Vec<SubscriptionRow>,
}

/// What the sampler keeps.
#[derive(Debug, Default)]
struct Samples {
    overview: Option<Overview>,
    error: Option<String>,
    history: HashMap<String, VecDeque<Point>>,
}

/// The dashboard's state, shared by every request.
struct App {
    pool: deadpool_postgres::Pool,
    /// The names a request's `Host` (and an action's `Origin`) may give, which keeps a
    /// page of another site whose name was made to resolve to this machine (DNS
    /// rebinding) from reading or acting on the dashboard.
    hosts: Hosts,
    csrf: String,
    allow_actions: bool,
    password: Option<String>,
    /// The wrong passwords of each client address.
    guesses: Mutex<Guesses>,
    /// What the actions did, behind one-time ids.
    outcomes: Mutex<Outcomes>,
    request_timeout: Duration,
    samples: Mutex<Samples>,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("allow_actions", &self.allow_actions)
            .field("password", &self.password.is_some())
            .finish_non_exhaustive()
    }
}

type Shared = Arc<App>;

/// An error of a request: the database's (503, the page shows a banner) or the request's.
#[derive(Debug)]
enum UiError {
    Database(String),
    NotFound(String),
    BadRequest(String),
    Forbidden(String),
    /// An action bound to what the page showed, refused because the database has changed
    /// since (409): nothing was done.
    Conflict(String),
}

impl From<pgbus::Error> for UiError {
    fn from(e: pgbus::Error) -> Self {
        match e {
            pgbus::Error::UnknownSubscription { name } => {
                UiError::NotFound(format!("no subscription {name:?}"))
            }
            pgbus::Error::Invalid { what, reason } => {
                UiError::BadRequest(format!("{what}: {reason}"))
            }
            // The dashboard's role lacks the grant the action needs: the message names it.
            e @ pgbus::Error::NeedsGrant { .. } => UiError::Forbidden(e.to_string()),
            e => UiError::Database(with_sources(&e)),
        }
    }
}

impl From<deadpool_postgres::PoolError> for UiError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        UiError::Database(format!("cannot reach the database: {}", with_sources(&e)))
    }
}

impl UiError {
    fn status(&self) -> StatusCode {
        match self {
            UiError::Database(_) => StatusCode::SERVICE_UNAVAILABLE,
            UiError::NotFound(_) => StatusCode::NOT_FOUND,
            UiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            UiError::Forbidden(_) => StatusCode::FORBIDDEN,
            UiError::Conflict(_) => StatusCode::CONFLICT,
        }
    }

    fn message(&self) -> &str {
        match self {
            UiError::Database(m)
            | UiError::NotFound(m)
            | UiError::BadRequest(m)
            | UiError::Forbidden(m)
            | UiError::Conflict(m) => m,
        }
    }

    /// As a page.
    fn page(self, app: &App) -> Response {
        let status = self.status();
        let page = pages::error_page(app.allow_actions, status, self.message());
        (status, html(page)).into_response()
    }

    /// As JSON: `{"error": "..."}`.
    fn json(self) -> Response {
        let body = serde_json::json!({ "error": self.message() });
        json(self.status(), &body)
    }
}

/// A JSON answer, every invisible or control character escaped (`security::escape_json`).
fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(text) => (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            security::escape_json(text),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot write the answer as JSON: {e}\n"),
        )
            .into_response(),
    }
}

/// A page's HTML.
fn html(markup: maud::Markup) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        markup.into_string(),
    )
        .into_response()
}

/// `pgbus ui`.
pub(crate) async fn run(args: UiArgs, url: Option<&str>) -> Result<(), Failure> {
    let password = match std::env::var("PGBUS_UI_PASSWORD") {
        Ok(p) if p.is_empty() => {
            return Err(usage(
                "error: PGBUS_UI_PASSWORD is empty: set a password, or unset it for no \
                 authentication",
            ));
        }
        Ok(p) => Some(p),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(usage("error: PGBUS_UI_PASSWORD is not valid UTF-8"));
        }
    };
    let loopback = args.listen.ip().to_canonical().is_loopback();
    if !loopback && password.is_none() && !args.insecure_no_auth {
        return Err(usage(format!(
            "error: --listen {} is not a loopback address, and anyone who can connect to it \
             would read the dashboard: set PGBUS_UI_PASSWORD (HTTP basic auth), or give \
             --insecure-no-auth to serve it without authentication",
            args.listen
        )));
    }
    let mut config = super::database_config(url)?;
    let pg = config.pg_config_mut();
    if pg.get_application_name() == Some("pgbus cli") {
        pg.application_name("pgbus ui");
    }
    let signals = super::shutdown_signal()?;
    // Reachable at start, as the other commands require.
    drop(super::connect(&config).await?);
    let manager = deadpool_postgres::Manager::from_connect(
        config.pg_config().clone(),
        Opener(config),
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(POOL_SIZE)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(10)))
        .create_timeout(Some(Duration::from_secs(10)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .pre_recycle(pgbus::__private::drop_closed())
        .build()
        .map_err(|e| failed(format!("error: cannot set up the connection pool: {e}")))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| failed(format!("error: cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| failed(format!("error: cannot listen on {}: {e}", args.listen)))?;
    let app = Arc::new(App {
        pool,
        hosts: Hosts::new(args.allowed_hosts),
        csrf: csrf_token()?,
        allow_actions: args.allow_actions,
        password,
        guesses: Mutex::new(Guesses::default()),
        outcomes: Mutex::new(Outcomes::default()),
        request_timeout: args.request_timeout,
        samples: Mutex::new(Samples::default()),
    });
    sample(&app).await;
    let sampler = tokio::spawn(sampler(app.clone(), args.interval));
    eprintln!(
        "pgbus: dashboard on http://{addr}/ ({}{}); stop with Ctrl-C or SIGTERM",
        if app.allow_actions {
            "actions allowed"
        } else {
            "read-only"
        },
        if app.password.is_some() {
            ", basic auth"
        } else if !loopback {
            ", NO AUTHENTICATION (--insecure-no-auth)"
        } else {
            ""
        },
    );
    let limits = server::Limits {
        header_timeout: args.header_timeout,
        write_timeout: args.request_timeout,
        connections: args.max_connections as usize,
        per_client: args.max_connections_per_ip as usize,
    };
    server::serve(listener, router(app), limits, signals).await;
    sampler.abort();
    Ok(())
}

/// A new random token of 32 bytes, in hex.
fn csrf_token() -> Result<String, Failure> {
    random_hex::<32>()
        .map_err(|e| failed(format!("error: no random numbers for the CSRF token: {e}")))
}

/// `N` random bytes from the operating system, in hex.
fn random_hex<const N: usize>() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Every route, behind the security layer.
fn router(app: Shared) -> Router {
    Router::new()
        .route("/", get(overview_page))
        .route("/subscriptions/{name}", get(subscription_page))
        .route("/events", get(events_page))
        .route("/consumers", get(consumers_page))
        .route("/api/overview", get(overview_api))
        .route("/api/subscriptions/{name}", get(subscription_api))
        .route("/api/events", get(events_api))
        .route("/api/consumers", get(consumers_api))
        .route("/static/app.js", get(app_js))
        .route("/static/style.css", get(style_css))
        .route("/subscriptions/{name}/retry", post(retry_action))
        .route("/subscriptions/{name}/purge", post(purge_action))
        .route("/subscriptions/{name}/replay", post(replay_action))
        .route(
            "/subscriptions/{name}/keys/redrive",
            post(|State(app), Path(name), form| head_action(app, name, form, false)),
        )
        .route(
            "/subscriptions/{name}/keys/skip",
            post(|State(app), Path(name), form| head_action(app, name, form, true)),
        )
        .route(
            "/subscriptions/{name}/pause",
            post(|state, path, form| set_paused(state, path, form, true)),
        )
        .route(
            "/subscriptions/{name}/resume",
            post(|state, path, form| set_paused(state, path, form, false)),
        )
        .layer(DefaultBodyLimit::max(FORM_LIMIT))
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// The security layer: the host check, basic auth when a password is set (with the
/// back-off of wrong passwords), the checks of every POST, the request's time limit,
/// and the headers of every answer. Only a request that passed the host and password
/// checks gets the CSRF cookie.
async fn guard(State(app): State<Shared>, request: Request, next: Next) -> Response {
    let (mut response, trusted) = match request.extensions().get::<Conn>().copied() {
        Some(conn) => checked(&app, conn, request, next).await,
        // Every connection's requests carry it (server.rs).
        None => (
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "no connection information\n",
            )
                .into_response(),
            false,
        ),
    };
    let headers = response.headers_mut();
    let set = |headers: &mut HeaderMap, name, value: &'static str| {
        headers.insert(name, HeaderValue::from_static(value));
    };
    set(
        headers,
        header::CONTENT_SECURITY_POLICY,
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; \
         object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    );
    set(headers, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(headers, header::X_FRAME_OPTIONS, "DENY");
    set(headers, header::REFERRER_POLICY, "same-origin");
    set(headers, header::CACHE_CONTROL, "no-store");
    if trusted
        && let Ok(cookie) = HeaderValue::from_str(&format!(
            "{CSRF_COOKIE}={}; Path=/; SameSite=Strict; HttpOnly",
            app.csrf
        ))
    {
        headers.insert(header::SET_COOKIE, cookie);
    }
    response
}

/// [`guard`]'s checks and the request's run; whether the request passed the host and
/// password checks.
async fn checked(app: &App, conn: Conn, request: Request, next: Next) -> (Response, bool) {
    let headers = request.headers();
    let host_served = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .is_some_and(|h| app.hosts.serves(&conn, h, 80))
        && request
            .uri()
            .authority()
            .is_none_or(|a| app.hosts.serves(&conn, a.as_str(), 80));
    if !host_served {
        let refusal = (
            StatusCode::MISDIRECTED_REQUEST,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "this dashboard does not answer to this host name: use the address it listens \
             on, or start pgbus ui with --allowed-host NAME\n",
        );
        return (refusal.into_response(), false);
    }
    if let Some(password) = &app.password {
        let client = client_key(conn.peer.ip());
        let now = Instant::now();
        let waiting = app
            .guesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .waiting(client, now);
        if let Some(wait) = waiting {
            return (too_many_guesses(wait), false);
        }
        if !authorized(headers, password) {
            // A request without credentials is a browser's first: not a guess.
            let wait = if headers.contains_key(header::AUTHORIZATION) {
                app.guesses
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .failed(client, now)
            } else {
                None
            };
            if let Some(wait) = wait {
                pgbus::warn_limited!(client = %conn.peer, "pgbus ui: wrong passwords, the client waits {}", human_duration(wait));
                return (too_many_guesses(wait), false);
            }
            let refusal = (
                StatusCode::UNAUTHORIZED,
                [(
                    header::WWW_AUTHENTICATE,
                    "Basic realm=\"pgbus\", charset=\"UTF-8\"",
                )],
                "authentication required\n",
            );
            return (refusal.into_response(), false);
        }
        app.guesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .succeeded(client);
    }
    let method = request.method();
    let safe = method == axum::http::Method::GET
        || method == axum::http::Method::HEAD
        || method == axum::http::Method::OPTIONS;
    if !safe {
        let origin = headers.get(header::ORIGIN).map(HeaderValue::as_bytes);
        let referer = headers.get(header::REFERER).map(HeaderValue::as_bytes);
        let refusal = if !app.allow_actions {
            Some("actions are disabled: start pgbus ui with --allow-actions".to_string())
        } else if let Err(reason) = app.hosts.same_origin(&conn, origin, referer) {
            Some(reason)
        } else if !cookie_matches(headers, &app.csrf) {
            Some("the CSRF cookie is missing or wrong: reload the page".to_string())
        } else {
            // The form's token is checked by each action, which reads the form.
            None
        };
        if let Some(reason) = refusal {
            return (UiError::Forbidden(reason).page(app), true);
        }
    }
    let response = match tokio::time::timeout(app.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => UiError::Database(format!(
            "the request took longer than {}: the database may be slow or locked",
            human_duration(app.request_timeout)
        ))
        .page(app),
    };
    (response, true)
}

/// 429 with how long to wait (`Retry-After`, in whole seconds, rounded up).
fn too_many_guesses(wait: Duration) -> Response {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    (
        StatusCode::TOO_MANY_REQUESTS,
        [
            (header::RETRY_AFTER, seconds.to_string()),
            (
                header::CONTENT_TYPE,
                "text/plain; charset=utf-8".to_string(),
            ),
        ],
        format!("too many wrong passwords from your address: try again in {seconds}s\n"),
    )
        .into_response()
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}

/// Whether the request carries basic auth with this password (any user name).
fn authorized(headers: &HeaderMap, password: &str) -> bool {
    use base64::Engine as _;
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(encoded) = value
        .strip_prefix("Basic ")
        .or_else(|| value.strip_prefix("basic "))
    else {
        return false;
    };
    let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
        return false;
    };
    let Some(colon) = decoded.iter().position(|&b| b == b':') else {
        return false;
    };
    constant_time_eq(&decoded[colon + 1..], password.as_bytes())
}

/// Whether the request's CSRF cookie holds the token.
fn cookie_matches(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .any(|(name, value)| {
            name == CSRF_COOKIE && constant_time_eq(value.as_bytes(), token.as_bytes())
        })
}

/// Samples the overview every `interval`, for ever.
async fn sampler(app: Shared, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        sample(&app).await;
    }
}

/// Reads the overview once and records it (or the error).
async fn sample(app: &App) {
    match read_overview(app).await {
        Ok(mut overview) => {
            let mut samples = app.samples.lock().unwrap_or_else(|e| e.into_inner());
            let now = overview
                .sampled_at
                .unwrap_or_else(Utc::now)
                .timestamp_millis();
            let names: std::collections::HashSet<&str> = overview
                .subscriptions
                .iter()
                .map(|s| s.name.as_str())
                .collect();
            samples
                .history
                .retain(|name, _| names.contains(name.as_str()));
            for sub in &mut overview.subscriptions {
                let history = samples.history.entry(sub.name.clone()).or_default();
                history.push_back(Point {
                    at: now,
                    delivered_per_second: sub.delivered_per_second,
                    backlog: sub.due + sub.scheduled + sub.processing,
                });
                while history.len() > HISTORY_SAMPLES {
                    history.pop_front();
                }
                sub.history = history.iter().copied().collect();
            }
            samples.overview = Some(overview);
            samples.error = None;
        }
        Err(e) => {
            pgbus::warn_limited!(error = %e.message(), "pgbus ui could not sample the overview");
            let mut samples = app.samples.lock().unwrap_or_else(|e| e.into_inner());
            samples.error = Some(e.message().to_string());
        }
    }
}

/// Reads the overview's figures: the backlog gauges' statement (bounded counts), the
/// throughput over the last window, the notification machinery and the consumers.
async fn read_overview(app: &App) -> Result<Overview, UiError> {
    let client = app.pool.get().await?;
    let client: &tokio_postgres::Client = &client;
    let backlog = admin::backlog(client, None).await?;
    let recent = admin::delivered_recently(client, THROUGHPUT_WINDOW, THROUGHPUT_EVENTS).await?;
    let delivered: HashMap<String, i64> = recent.delivered.into_iter().collect();
    let cluster = admin::cluster_status(client).await?;
    let consumers = admin::consumers(client).await?;
    let subscriptions = backlog
        .into_iter()
        .map(|b| {
            let serving = consumers
                .iter()
                .filter(|c| c.subscriptions.contains(&b.subscription));
            let (awake, asleep) =
                serving.fold(
                    (0, 0),
                    |(w, s), c| {
                        if c.awake { (w + 1, s) } else { (w, s + 1) }
                    },
                );
            let delivered_per_second = delivered.get(&b.subscription).copied().unwrap_or(0) as f64
                / THROUGHPUT_WINDOW.as_secs_f64();
            let health = if b.dead > 0 || b.blocked_keys > 0 {
                "failing"
            } else if b.paused {
                // Its deliveries wait on purpose: not behind.
                "paused"
            } else if b.oldest_due_age.is_some_and(|a| a > BEHIND_AFTER)
                || (b.due > 0 && awake + asleep == 0)
            {
                "behind"
            } else {
                "healthy"
            };
            SubscriptionRow {
                name: b.subscription,
                due: b.due,
                scheduled: b.scheduled,
                processing: b.processing,
                dead: b.dead,
                blocked_keys: b.blocked_keys,
                oldest_due_age: b.oldest_due_age,
                consumers_awake: awake,
                consumers_asleep: asleep,
                delivered_per_second,
                throughput_estimated: recent.capped,
                health,
                history: Vec::new(),
            }
        })
        .collect();
    Ok(Overview {
        sampled_at: Some(Utc::now()),
        error: None,
        count_cap: pgbus::metrics::GAUGE_COUNT_CAP,
        notification_queue_usage: cluster.notification_queue_usage,
        listeners: cluster.listeners,
        consumers: cluster.consumers,
        sleeping_consumers: cluster.sleeping_consumers,
        not_fanned_out: cluster.fan_out.events,
        oldest_transaction_age: cluster.horizon.oldest_transaction_age,
        long_transaction: long_transaction(&cluster.horizon),
        subscriptions,
    })
}

/// The banner of a transaction that has held the xmin horizon back for longer than
/// [`DEFAULT_LONG_TRANSACTION_WARNING`](pgbus::metrics::DEFAULT_LONG_TRANSACTION_WARNING).
fn long_transaction(horizon: &pgbus::metrics::XminHorizon) -> Option<String> {
    let age = horizon.oldest_transaction_age?;
    horizon
        .older_than(pgbus::metrics::DEFAULT_LONG_TRANSACTION_WARNING)
        .then(|| {
            format!(
                "A transaction has held the xmin horizon back for {} ({}): VACUUM cannot \
                 remove settled deliveries until it ends, and claims slow down.",
                human_duration(Duration::from_secs_f64(age)),
                horizon.oldest_transaction.as_deref().unwrap_or("unknown")
            )
        })
}

/// The last sample, with the last error when the latest failed.
fn current_overview(app: &App) -> Overview {
    let samples = app.samples.lock().unwrap_or_else(|e| e.into_inner());
    let mut overview = samples.overview.clone().unwrap_or_else(never_sampled);
    overview.error = samples.error.clone();
    overview
}

/// The overview before any sample.
fn never_sampled() -> Overview {
    Overview {
        sampled_at: None,
        error: None,
        count_cap: pgbus::metrics::GAUGE_COUNT_CAP,
        notification_queue_usage: 0.0,
        listeners: 0,
        consumers: 0,
        sleeping_consumers: 0,
        not_fanned_out: 0,
        oldest_transaction_age: None,
        long_transaction: None,
        subscriptions: Vec::new(),
    }
}

async fn overview_page(State(app): State<Shared>) -> Response {
    html(pages::overview(app.allow_actions, &current_overview(&app)))
}

async fn overview_api(State(app): State<Shared>) -> Response {
    json(StatusCode::OK, &current_overview(&app))
}

/// A dead letter with its failure history.
#[derive(Debug, Serialize)]
struct DeadLetterView {
    #[serde(flatten)]
    dead: admin::DeadLetter,
    failures: Vec<admin::FailedAttempt>,
}

/// A subscription's page's data, as `/api/subscriptions/NAME` serves it.
#[derive(Debug, Serialize)]
struct SubscriptionView {
    name: String,
    settings: admin::SubscriptionSettings,
    backlog: Option<pgbus::metrics::Backlog>,
    count_cap: i64,
    dead_letters: Vec<DeadLetterView>,
    dead_letters_total: i64,
    /// The page of dead letters shown starts after this one (`SEQ/SUBSCRIPTION`; `None`:
    /// the first page).
    dead_letters_after: Option<String>,
    /// The cursor of the next page, when there are more dead letters after these.
    dead_letters_next: Option<String>,
    /// A page of its pending deliveries, in event order.
    pending: Vec<admin::PendingDelivery>,
    /// The page starts after this event seq (`None`: the first page).
    pending_after: Option<i64>,
    /// The next page's start, when there are more pending deliveries after these.
    pending_next: Option<i64>,
    blocked_keys: Vec<pgbus::ordering::BlockedKey>,
    /// The first deliveries waiting behind each blocked key, by key.
    waiting: Vec<pgbus::ordering::WaitingDelivery>,
    consumers: Vec<admin::ConsumerInfo>,
}

/// A subscription's page: its dead letters from `after` on (`SEQ/SUBSCRIPTION`, as the
/// page's "next" link carries it; `None`: from the oldest).
async fn read_subscription(
    app: &App,
    name: &str,
    after: Option<&str>,
    pending_after: Option<i64>,
) -> Result<SubscriptionView, UiError> {
    let cursor = after
        .map(str::parse::<admin::DeadLetterCursor>)
        .transpose()?;
    let client = app.pool.get().await?;
    let client: &tokio_postgres::Client = &client;
    let settings = admin::subscription_settings(client, name)
        .await?
        .ok_or_else(|| UiError::NotFound(format!("no subscription {name:?}")))?;
    let backlog = admin::backlog(client, Some(&[name])).await?.pop();
    let filter = DeadLetterFilter::all().subscription(name);
    // One more than shown: whether a next page exists, without a count.
    let mut dead =
        admin::dead_letters_after(client, &filter, DEAD_LETTERS_SHOWN + 1, cursor.as_ref()).await?;
    let dead_letters_next = if dead.len() as i64 > DEAD_LETTERS_SHOWN {
        dead.truncate(DEAD_LETTERS_SHOWN as usize);
        dead.last().map(|d| d.cursor().to_string())
    } else {
        None
    };
    let seqs: Vec<i64> = dead.iter().map(|d| d.event_seq).collect();
    let mut failures = admin::failure_history(client, name, &seqs, FAILURES_SHOWN).await?;
    let dead_letters_total = backlog.as_ref().map_or(0, |b| b.dead);
    let dead_letters = dead
        .into_iter()
        .map(|dead| {
            let (mine, rest) = failures
                .drain(..)
                .partition(|f| f.event_seq == dead.event_seq);
            failures = rest;
            DeadLetterView {
                dead,
                failures: mine,
            }
        })
        .collect();
    let mut pending =
        admin::pending_deliveries(client, name, pending_after, PENDING_SHOWN + 1).await?;
    let pending_next = if pending.len() as i64 > PENDING_SHOWN {
        pending.truncate(PENDING_SHOWN as usize);
        pending.last().map(|p| p.event_seq)
    } else {
        None
    };
    let blocked_keys = pgbus::ordering::blocked_keys(client, Some(name)).await?;
    let keys: Vec<&str> = blocked_keys.iter().map(|k| k.key.as_str()).collect();
    let waiting = pgbus::ordering::waiting_behind(client, name, &keys, WAITING_SHOWN).await?;
    let consumers = admin::consumers(client)
        .await?
        .into_iter()
        .filter(|c| c.subscriptions.iter().any(|s| s == name))
        .collect();
    Ok(SubscriptionView {
        name: name.to_string(),
        settings,
        backlog,
        count_cap: pgbus::metrics::GAUGE_COUNT_CAP,
        dead_letters,
        dead_letters_total,
        dead_letters_after: cursor.map(|c| c.to_string()),
        dead_letters_next,
        pending,
        pending_after,
        pending_next,
        blocked_keys,
        waiting,
        consumers,
    })
}

/// What a subscription page's address may carry: after an action, the one-time id of
/// its outcome, which the server keeps (a link cannot make the page claim anything); and
/// the place in its dead letters to list from.
#[derive(Debug, Deserialize)]
struct Flash {
    done: Option<String>,
    /// The dead letters after this one (`SEQ/SUBSCRIPTION`).
    after: Option<String>,
    /// The pending deliveries after this event seq.
    pending_after: Option<i64>,
}

async fn subscription_page(
    State(app): State<Shared>,
    Path(name): Path<String>,
    Query(flash): Query<Flash>,
) -> Response {
    let done = flash.done.and_then(|id| {
        app.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(&id, &name)
    });
    match read_subscription(&app, &name, flash.after.as_deref(), flash.pending_after).await {
        Ok(view) => html(pages::subscription(
            app.allow_actions,
            &app.csrf,
            &view,
            done.as_deref(),
        )),
        Err(e) => e.page(&app),
    }
}

async fn subscription_api(
    State(app): State<Shared>,
    Path(name): Path<String>,
    Query(page): Query<Flash>,
) -> Response {
    match read_subscription(&app, &name, page.after.as_deref(), page.pending_after).await {
        Ok(view) => json(StatusCode::OK, &view),
        Err(e) => e.json(),
    }
}

/// An event and where its delivery stands in each subscription.
#[derive(Debug, Serialize)]
struct EventView {
    event: pgbus::Event,
    deliveries: Vec<DeliveryView>,
}

/// Where an event's delivery stands in one subscription, with its failures.
#[derive(Debug, Serialize)]
struct DeliveryView {
    #[serde(flatten)]
    delivery: admin::EventDelivery,
    failures: Vec<admin::FailedAttempt>,
}

/// The search of the events page.
#[derive(Debug, Deserialize)]
struct Search {
    q: Option<String>,
}

async fn read_events(app: &App, q: &str) -> Result<Vec<EventView>, UiError> {
    let client = app.pool.get().await?;
    let client: &tokio_postgres::Client = &client;
    let mut out = Vec::new();
    for event in admin::find_events(client, q, EVENTS_SHOWN).await? {
        let seq = event.seq.unwrap_or_default();
        let mut deliveries = Vec::new();
        for delivery in admin::event_deliveries(client, seq).await? {
            let failures =
                admin::failure_history(client, &delivery.subscription, &[seq], FAILURES_SHOWN)
                    .await?;
            deliveries.push(DeliveryView { delivery, failures });
        }
        out.push(EventView { event, deliveries });
    }
    Ok(out)
}

async fn events_page(State(app): State<Shared>, Query(search): Query<Search>) -> Response {
    let q = search.q.as_deref().map(str::trim).filter(|q| !q.is_empty());
    let events = match q {
        Some(q) => match read_events(&app, q).await {
            Ok(events) => Some(events),
            Err(e) => return e.page(&app),
        },
        None => None,
    };
    html(pages::events(app.allow_actions, q, events.as_deref()))
}

async fn events_api(State(app): State<Shared>, Query(search): Query<Search>) -> Response {
    let Some(q) = search.q.as_deref().map(str::trim).filter(|q| !q.is_empty()) else {
        return UiError::BadRequest("give an event id or correlation id as ?q=".into()).json();
    };
    match read_events(&app, q).await {
        Ok(events) => json(StatusCode::OK, &serde_json::json!({ "events": events })),
        Err(e) => e.json(),
    }
}

async fn read_consumers(app: &App) -> Result<Vec<admin::ConsumerInfo>, UiError> {
    let client = app.pool.get().await?;
    Ok(admin::consumers(&**client).await?)
}

async fn consumers_page(State(app): State<Shared>) -> Response {
    match read_consumers(&app).await {
        Ok(consumers) => html(pages::consumers(app.allow_actions, &consumers)),
        Err(e) => e.page(&app),
    }
}

async fn consumers_api(State(app): State<Shared>) -> Response {
    match read_consumers(&app).await {
        Ok(consumers) => json(
            StatusCode::OK,
            &serde_json::json!({ "consumers": consumers }),
        ),
        Err(e) => e.json(),
    }
}

async fn app_js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        APP_JS,
    )
        .into_response()
}

async fn style_css() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        STYLE_CSS,
    )
        .into_response()
}

/// The form of every action: the CSRF token and what the action needs.
#[derive(Debug, Deserialize)]
struct ActionForm {
    /// The CSRF token (absent: empty, refused).
    #[serde(default)]
    csrf: String,
    /// Retry: one dead letter, by its event's id (absent: every dead letter). Redrive and
    /// skip: the event id of the key's head as the page showed it.
    event_id: Option<String>,
    /// Redrive and skip: the key.
    key: Option<String>,
    /// Replay: since when (RFC 3339, or the `datetime-local` form, read as UTC).
    since: Option<String>,
    /// Purge: must be `yes`.
    confirm: Option<String>,
}

/// The page that says why an action's form cannot be read (too large: 413), with
/// whatever the reason quotes marked as any shown text is.
fn form_refused(app: &App, e: &FormRejection) -> Response {
    let status = e.status();
    let page = pages::error_page(app.allow_actions, status, &e.body_text());
    (status, html(page)).into_response()
}

/// Checks the form's CSRF token, runs `action` and sends the browser back to the
/// subscription's page with what it did.
async fn act<F, Fut>(app: &App, name: &str, form: &ActionForm, action: F) -> Response
where
    F: FnOnce(deadpool_postgres::Object) -> Fut,
    Fut: std::future::Future<Output = Result<String, UiError>>,
{
    if !constant_time_eq(form.csrf.as_bytes(), app.csrf.as_bytes()) {
        return UiError::Forbidden("the CSRF token is missing or wrong: reload the page".into())
            .page(app);
    }
    let client = match app.pool.get().await {
        Ok(c) => c,
        Err(e) => return UiError::from(e).page(app),
    };
    match action(client).await {
        Ok(done) => {
            let page = format!("/subscriptions/{}", percent(name));
            match random_hex::<16>() {
                Ok(id) => {
                    let to = format!("{page}?done={id}");
                    app.outcomes
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .put(id, name, done);
                    Redirect::to(&to).into_response()
                }
                Err(e) => {
                    pgbus::warn_limited!(error = %e, "pgbus ui: no random id for an action's outcome");
                    Redirect::to(&page).into_response()
                }
            }
        }
        Err(e) => e.page(app),
    }
}

/// Percent-encodes everything but unreserved characters, for a path segment or a query
/// value.
fn percent(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn retry_action(
    State(app): State<Shared>,
    Path(name): Path<String>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let form = match form {
        Ok(Form(form)) => form,
        Err(e) => return form_refused(&app, &e),
    };
    let event_id = form.event_id.clone().filter(|e| !e.is_empty());
    let sub = name.clone();
    act(&app, &name, &form, |client| async move {
        let mut filter = DeadLetterFilter::all().subscription(sub);
        if let Some(id) = &event_id {
            filter = filter.event_id(id);
        }
        let n = admin::retry_dead_letters(&**client, &filter).await?;
        Ok(format!("retried {n} dead letter{}", plural(n)))
    })
    .await
}

async fn purge_action(
    State(app): State<Shared>,
    Path(name): Path<String>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let form = match form {
        Ok(Form(form)) => form,
        Err(e) => return form_refused(&app, &e),
    };
    if form.confirm.as_deref() != Some("yes") {
        return UiError::BadRequest("purging needs its confirmation (confirm=yes)".into())
            .page(&app);
    }
    let event_id = form.event_id.clone().filter(|e| !e.is_empty());
    let sub = name.clone();
    act(&app, &name, &form, |client| async move {
        let mut filter = DeadLetterFilter::all().subscription(sub);
        if let Some(id) = &event_id {
            filter = filter.event_id(id);
        }
        let purged = admin::purge_dead_letters(&**client, &filter).await?;
        Ok(format!(
            "purged {} dead letter{}",
            purged.dead_letters,
            plural(purged.dead_letters)
        ))
    })
    .await
}

async fn replay_action(
    State(app): State<Shared>,
    Path(name): Path<String>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let form = match form {
        Ok(Form(form)) => form,
        Err(e) => return form_refused(&app, &e),
    };
    let since = match form.since.as_deref().map(parse_since) {
        Some(Ok(since)) => since,
        Some(Err(e)) => return UiError::BadRequest(e).page(&app),
        None => return UiError::BadRequest("replay needs a time to start from".into()).page(&app),
    };
    let sub = name.clone();
    act(&app, &name, &form, |client| async move {
        let replayed = admin::replay(&**client, &sub, since, None, None).await?;
        Ok(format!(
            "replayed since {}: {} matched, {} deliveries created",
            since.to_rfc3339(),
            replayed.matched,
            replayed.created
        ))
    })
    .await
}

/// Reads a replay's start: RFC 3339, or a `datetime-local` field's value (UTC).
fn parse_since(text: &str) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(at.with_timezone(&Utc));
    }
    for format in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"] {
        if let Ok(at) = chrono::NaiveDateTime::parse_from_str(text, format) {
            return Ok(at.and_utc());
        }
    }
    Err(format!(
        "invalid time {text:?}: give a UTC time such as 2025-01-31T12:00"
    ))
}

/// Redrive (`skip` false) or skip the head of a key, the head the page showed: the form
/// carries its event id, and a head that has changed since is left alone (409).
async fn head_action(
    app: Shared,
    name: String,
    form: Result<Form<ActionForm>, FormRejection>,
    skip: bool,
) -> Response {
    let form = match form {
        Ok(Form(form)) => form,
        Err(e) => return form_refused(&app, &e),
    };
    let verb = if skip { "skip" } else { "redrive" };
    let (Some(key), Some(seen)) = (form.key.clone(), form.event_id.clone()) else {
        return UiError::BadRequest(format!(
            "{verb} needs the key and the event id of the head the page showed: reload the page"
        ))
        .page(&app);
    };
    let sub = name.clone();
    act(&app, &name, &form, |client| async move {
        let outcome = if skip {
            pgbus::ordering::skip_seen_head(&**client, &sub, &key, &seen).await?
        } else {
            pgbus::ordering::redrive_seen_head(&**client, &sub, &key, &seen).await?
        };
        match outcome {
            pgbus::ordering::SeenHead::Done { promoted } => Ok(match (skip, promoted) {
                (true, Some(next)) => format!(
                    "skipped the dead head of key {key} (event {seen}); event {next} is its head now"
                ),
                (true, None) => format!(
                    "skipped the dead head of key {key} (event {seen}); nothing waits behind it"
                ),
                (false, _) => format!("redrove the head of key {key} (event {seen})"),
            }),
            other => Err(match other.change_from(&seen) {
                Some(now) => UiError::Conflict(format!(
                    "key {key} changed since you loaded the page: {now}; nothing was done"
                )),
                None => UiError::Database(format!("unexpected answer to the {verb} of key {key}")),
            }),
        }
    })
    .await
}

/// Pause (`pause` true) or resume a subscription: the answer says what changed, and a
/// request sent again from a page loaded before (a pause of a paused subscription) that
/// nothing did.
async fn set_paused(
    State(app): State<Shared>,
    Path(name): Path<String>,
    form: Result<Form<ActionForm>, FormRejection>,
    pause: bool,
) -> Response {
    let form = match form {
        Ok(Form(form)) => form,
        Err(e) => return form_refused(&app, &e),
    };
    let sub = name.clone();
    let at = |t: DateTime<Utc>| t.format("%Y-%m-%d %H:%M:%S UTC").to_string();
    act(&app, &name, &form, |client| async move {
        Ok(if pause {
            let paused = admin::pause_subscription(&**client, &sub).await?;
            if paused.already {
                format!(
                    "{sub} was already paused (since {}): nothing changed",
                    at(paused.since)
                )
            } else {
                format!("paused {sub}: its deliveries wait until it is resumed")
            }
        } else {
            match admin::resume_subscription(&**client, &sub)
                .await?
                .paused_since
            {
                Some(since) => format!(
                    "resumed {sub} (paused since {}): its consumers are notified",
                    at(since)
                ),
                None => format!("{sub} was not paused: nothing changed"),
            }
        })
    })
    .await
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transaction_past_five_minutes_is_a_banner_on_the_overview() {
        let mut horizon = pgbus::metrics::XminHorizon::default();
        assert_eq!(long_transaction(&horizon), None, "none open");
        horizon.oldest_transaction_age = Some(12.0);
        horizon.oldest_transaction = Some("pid 42 (report, idle in transaction)".into());
        assert_eq!(long_transaction(&horizon), None, "a short one");
        horizon.oldest_transaction_age = Some(725.0);
        let banner = long_transaction(&horizon).unwrap();
        assert!(banner.contains("12m05s"), "{banner}");
        assert!(
            banner.contains("pid 42 (report, idle in transaction)"),
            "{banner}"
        );
        let mut overview = Overview {
            oldest_transaction_age: horizon.oldest_transaction_age,
            long_transaction: Some(banner),
            ..never_sampled()
        };
        // The banner's opening tag, hidden or not.
        let tag = |page: &str| -> String {
            let at = page
                .find(r#"id="long-transaction""#)
                .expect("the banner's place");
            let start = page[..at].rfind('<').unwrap();
            page[start..at + page[at..].find('>').unwrap()].to_string()
        };
        let page = pages::overview(false, &overview).into_string();
        assert!(!tag(&page).contains("hidden"), "{page}");
        assert!(
            page.contains("A transaction has held the xmin horizon back"),
            "{page}"
        );
        overview.long_transaction = None;
        let page = pages::overview(false, &overview).into_string();
        assert!(tag(&page).contains("hidden"), "{page}");
        assert!(!page.contains("A transaction has held"), "{page}");
    }

    #[test]
    fn equal_bytes_compare_equal_and_others_not() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn basic_auth_takes_any_user_and_the_password() {
        let mut headers = HeaderMap::new();
        assert!(!authorized(&headers, "pw"));
        // "anyone:pw"
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic YW55b25lOnB3"),
        );
        assert!(authorized(&headers, "pw"));
        assert!(!authorized(&headers, "pw2"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic !!"));
        assert!(!authorized(&headers, "pw"));
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("a=1; pgbus_csrf=tok; b=2"),
        );
        assert!(cookie_matches(&headers, "tok"));
        assert!(!cookie_matches(&headers, "other"));
    }

    #[test]
    fn replay_times_parse() {
        assert!(parse_since("2025-01-31T12:00").is_ok());
        assert!(parse_since("2025-01-31T12:00:00Z").is_ok());
        assert!(parse_since("yesterday").is_err());
        assert_eq!(percent("a b/<"), "a%20b%2F%3C");
    }
}
