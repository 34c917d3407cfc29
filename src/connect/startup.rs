//! Opening a connection as libpq does: every host of the list in turn, each attempt
//! bounded as a whole (TCP, the TLS request and handshake, authentication, the server's
//! parameters, up to its first ReadyForQuery, and the `target_session_attrs` check),
//! and, when it fails, the phase it was in.
//!
//! The phase comes from the bytes themselves: the stream under tokio-postgres
//! ([`ServerStream`]) and the TLS stream over it watch what the server sends during
//! startup: the one-byte answer to the TLS request, the first TLS record's header, and
//! the startup messages' types and lengths (authentication requests, parameters,
//! ReadyForQuery). Anything else is not PostgreSQL's protocol, and ends the attempt at
//! once rather than leaving the driver waiting for a message that never completes.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_postgres::config::{Host, LoadBalanceHosts, SslMode as PgSslMode, SslNegotiation};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_postgres::{CancelToken, Client, SimpleQueryMessage};

use super::{ConnectConfig, Messages, SessionAttrs};
use crate::error::{ConnectPhase, Error, Result};

/// A boxed error of any kind (the network's, the TLS library's, the driver's).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The startup bound when neither `connect_timeout` nor `PGCONNECT_TIMEOUT` sets one.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The phases in the order of [`Progress`]'s numbers.
const PHASES: [ConnectPhase; 7] = [
    ConnectPhase::Resolving,
    ConnectPhase::Connecting,
    ConnectPhase::TlsRequest,
    ConnectPhase::TlsHandshake,
    ConnectPhase::Authenticating,
    ConnectPhase::Starting,
    ConnectPhase::CheckingSession,
];

/// The longest startup message libpq accepts of a type other than an error or a notice.
const MAX_SHORT_MESSAGE: usize = 30_000;

/// The longest error or notice accepted during startup.
const MAX_LONG_MESSAGE: usize = 1 << 20;

/// Where one attempt is: written by the streams, read when the attempt ends.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    phase: AtomicU8,
    not_postgres: AtomicBool,
}

impl Progress {
    fn set(&self, phase: ConnectPhase) {
        let index = PHASES.iter().position(|p| *p == phase).unwrap_or(0);
        self.phase.store(index as u8, Ordering::Relaxed);
    }

    fn get(&self) -> ConnectPhase {
        PHASES[usize::from(self.phase.load(Ordering::Relaxed)).min(PHASES.len() - 1)]
    }
}

/// What the server sent that is not PostgreSQL's protocol.
#[derive(Debug)]
struct NotPostgres;

impl std::fmt::Display for NotPostgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the server sent bytes that are not PostgreSQL's protocol (is this port a \
             PostgreSQL server?)",
        )
    }
}

impl std::error::Error for NotPostgres {}

/// What a watched stream expects next from the server.
#[derive(Debug)]
enum Expect {
    /// The answer to the TLS request: `S` or `N`.
    TlsAnswer,
    /// The first two bytes of a TLS record: its content type and major version.
    TlsRecord { seen: u8 },
    /// Startup messages, until ReadyForQuery.
    Messages(Frames),
    /// Nothing more is checked.
    Nothing,
}

/// A startup message being read: its type, length and (for an authentication request)
/// its code, then the rest skipped.
#[derive(Debug, Default)]
struct Frames {
    head: [u8; 9],
    have: usize,
    skip: usize,
}

/// The check of one stream's startup bytes.
#[derive(Debug)]
struct Watch {
    progress: Arc<Progress>,
    expect: Expect,
}

impl Watch {
    fn not_postgres(&self) -> io::Error {
        self.progress.not_postgres.store(true, Ordering::Relaxed);
        io::Error::new(io::ErrorKind::InvalidData, NotPostgres)
    }

    /// Checks bytes received, moving the phase on.
    fn feed(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while let Some(&byte) = bytes.first() {
            let next = match &mut self.expect {
                Expect::Nothing => return Ok(()),
                Expect::TlsAnswer => {
                    bytes = &bytes[1..];
                    match byte {
                        b'S' => {
                            self.progress.set(ConnectPhase::TlsHandshake);
                            Expect::TlsRecord { seen: 0 }
                        }
                        b'N' => {
                            self.progress.set(ConnectPhase::Authenticating);
                            Expect::Messages(Frames::default())
                        }
                        _ => return Err(self.not_postgres()),
                    }
                }
                Expect::TlsRecord { seen } => {
                    // Content types 20 to 24, then the major version, 3.
                    let fits = if *seen == 0 {
                        (20..=24).contains(&byte)
                    } else {
                        byte == 3
                    };
                    if !fits {
                        return Err(self.not_postgres());
                    }
                    bytes = &bytes[1..];
                    *seen += 1;
                    if *seen < 2 {
                        continue;
                    }
                    // What follows is encrypted: the stream over TLS checks it.
                    Expect::Nothing
                }
                Expect::Messages(frames) => {
                    if frames.skip > 0 {
                        let n = frames.skip.min(bytes.len());
                        frames.skip -= n;
                        bytes = &bytes[n..];
                        continue;
                    }
                    frames.head[frames.have] = byte;
                    frames.have += 1;
                    bytes = &bytes[1..];
                    let kind = frames.head[0];
                    let len = |head: &[u8; 9]| {
                        u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize
                    };
                    match frames.have {
                        5 => {
                            let len = len(&frames.head);
                            let (min, max) = match kind {
                                b'R' => (8, MAX_SHORT_MESSAGE),
                                b'E' | b'N' => (4, MAX_LONG_MESSAGE),
                                b'S' | b'K' | b'Z' | b'v' => (4, MAX_SHORT_MESSAGE),
                                _ => return Err(self.not_postgres()),
                            };
                            if len < min || len > max {
                                return Err(self.not_postgres());
                            }
                            match kind {
                                b'Z' => Expect::Nothing,
                                // Its code tells whether the login succeeded.
                                b'R' => continue,
                                _ => {
                                    frames.skip = len - 4;
                                    frames.have = 0;
                                    continue;
                                }
                            }
                        }
                        9 => {
                            let code = u32::from_be_bytes([
                                frames.head[5],
                                frames.head[6],
                                frames.head[7],
                                frames.head[8],
                            ]);
                            if code == 0 {
                                self.progress.set(ConnectPhase::Starting);
                            }
                            frames.skip = len(&frames.head) - 8;
                            frames.have = 0;
                            continue;
                        }
                        _ => continue,
                    }
                }
            };
            self.expect = next;
        }
        Ok(())
    }
}

/// A stream whose startup bytes are watched.
#[derive(Debug)]
pub(crate) struct Watched<S> {
    io: S,
    watch: Watch,
    /// A cancel request's stream: before it is shut down, it waits for the server to
    /// close it, as libpq does. PgBouncer takes a cancel connection closed before it
    /// answered for a client in a bad state and exits, dropping every connection it
    /// holds (the bus's claims through it then fail until it is restarted).
    linger: bool,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        if !matches!(this.watch.expect, Expect::Nothing) {
            this.watch.feed(&buf.filled()[before..])?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        while this.linger {
            let mut discard = [0u8; 64];
            let mut buf = ReadBuf::new(&mut discard);
            match ready!(Pin::new(&mut this.io).poll_read(cx, &mut buf)) {
                Ok(()) if !buf.filled().is_empty() => {}
                // Closed by the server (or broken): nothing left to wait for.
                Ok(()) | Err(_) => this.linger = false,
            }
        }
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

impl<S: TlsStream + Unpin> TlsStream for Watched<S> {
    fn channel_binding(&self) -> ChannelBinding {
        self.io.channel_binding()
    }
}

/// The transport under a [`ServerStream`].
#[derive(Debug)]
enum Transport {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Tcp(s) => s.is_write_vectored(),
            #[cfg(unix)]
            Transport::Unix(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// The byte stream to a server that pgbus opened (TCP, or a Unix socket), which a TLS
/// connector given to [`ConnectConfig::with_tls`] wraps: every connector generic over
/// its stream (`tokio-postgres-rustls`, `postgres-native-tls`, `postgres-openssl`)
/// takes it. While the connection starts, it checks that what the server sends is
/// PostgreSQL's protocol, and tells pgbus what it is waiting for.
#[derive(Debug)]
pub struct ServerStream(Watched<Transport>);

impl AsyncRead for ServerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ServerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// A TLS connector whose handshake and stream report to the attempt's [`Progress`].
struct WatchTls<C> {
    inner: C,
    progress: Arc<Progress>,
}

impl<C> TlsConnect<ServerStream> for WatchTls<C>
where
    C: TlsConnect<ServerStream>,
    C::Future: Send + 'static,
    C::Stream: 'static,
    C::Error: 'static,
{
    type Stream = Watched<C::Stream>;
    type Error = C::Error;
    type Future = BoxFuture<'static, std::result::Result<Self::Stream, C::Error>>;

    fn connect(self, stream: ServerStream) -> Self::Future {
        self.progress.set(ConnectPhase::TlsHandshake);
        let handshake = self.inner.connect(stream);
        let progress = self.progress;
        async move {
            let io = handshake.await?;
            progress.set(ConnectPhase::Authenticating);
            Ok(Watched {
                io,
                watch: Watch {
                    progress,
                    expect: Expect::Messages(Frames::default()),
                },
                linger: false,
            })
        }
        .boxed()
    }
}

/// A TLS connector with its type erased, so that one [`ConnectConfig`] can carry rustls
/// or a caller's own connector.
pub(super) trait Connector: Send + Sync {
    /// Starts a connection over `stream`: TLS as `config`'s `sslmode` asks, the login,
    /// up to ReadyForQuery.
    fn handshake<'a>(
        &'a self,
        config: &'a tokio_postgres::Config,
        domain: &'a str,
        stream: ServerStream,
        progress: Arc<Progress>,
    ) -> BoxFuture<'a, std::result::Result<(Client, Messages), BoxError>>;

    /// Sends a cancel request over `stream`.
    fn cancel<'a>(
        &'a self,
        token: &'a CancelToken,
        domain: &'a str,
        stream: ServerStream,
    ) -> BoxFuture<'a, std::result::Result<(), BoxError>>;
}

/// A [`Connector`] of a `MakeTlsConnect`.
pub(super) struct Erased<T>(pub(super) T);

impl<T> Connector for Erased<T>
where
    T: MakeTlsConnect<ServerStream> + Clone + Send + Sync + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send + 'static,
    <T::TlsConnect as TlsConnect<ServerStream>>::Future: Send + 'static,
    <T::TlsConnect as TlsConnect<ServerStream>>::Error: 'static,
{
    fn handshake<'a>(
        &'a self,
        config: &'a tokio_postgres::Config,
        domain: &'a str,
        stream: ServerStream,
        progress: Arc<Progress>,
    ) -> BoxFuture<'a, std::result::Result<(Client, Messages), BoxError>> {
        let mut make = self.0.clone();
        async move {
            let inner = make.make_tls_connect(domain).map_err(Into::into)?;
            let tls = WatchTls { inner, progress };
            let (client, mut connection) = config.connect_raw(stream, tls).await?;
            let messages: Messages =
                futures::stream::poll_fn(move |cx| connection.poll_message(cx)).boxed();
            Ok((client, messages))
        }
        .boxed()
    }

    fn cancel<'a>(
        &'a self,
        token: &'a CancelToken,
        domain: &'a str,
        stream: ServerStream,
    ) -> BoxFuture<'a, std::result::Result<(), BoxError>> {
        let mut make = self.0.clone();
        async move {
            let tls = make.make_tls_connect(domain).map_err(Into::into)?;
            token.cancel_query_raw(stream, tls).await?;
            Ok(())
        }
        .boxed()
    }
}

/// One entry of the host list: where to connect, and how the errors name it.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) host: Host,
    addr: Option<IpAddr>,
    pub(super) port: u16,
    label: String,
}

impl Target {
    /// The name TLS checks the certificate against (and sends as SNI).
    fn domain(&self) -> String {
        match (&self.host, self.addr) {
            (Host::Tcp(name), _) if !name.is_empty() => name.clone(),
            (_, Some(addr)) => addr.to_string(),
            _ => "localhost".to_string(),
        }
    }
}

/// Where to connect: the host list with its ports and addresses, as libpq pairs them.
pub(super) fn targets(pg: &tokio_postgres::Config) -> Result<Vec<Target>> {
    let hosts = pg.get_hosts();
    let addrs = pg.get_hostaddrs();
    let ports = pg.get_ports();
    let n = hosts.len().max(addrs.len());
    if n == 0 {
        return Err(Error::invalid(
            "connection string",
            "no host: name one in the connection string or in PGHOST",
        ));
    }
    if !hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len() {
        return Err(Error::invalid(
            "hostaddr",
            format!("{} addresses for {} hosts", addrs.len(), hosts.len()),
        ));
    }
    if ports.len() > 1 && ports.len() != n {
        return Err(Error::invalid(
            "port",
            format!("{} ports for {n} hosts", ports.len()),
        ));
    }
    let mut targets: Vec<Target> = (0..n)
        .map(|i| {
            let addr = addrs.get(i).copied();
            let host = hosts
                .get(i)
                .cloned()
                .unwrap_or_else(|| Host::Tcp(addr.map(|a| a.to_string()).unwrap_or_default()));
            let port = ports
                .get(i)
                .or(ports.first().filter(|_| ports.len() == 1))
                .copied()
                .unwrap_or(5432);
            let label = match &host {
                Host::Tcp(name) => name.clone(),
                #[cfg(unix)]
                Host::Unix(dir) => dir.display().to_string(),
            };
            Target {
                host,
                addr,
                port,
                label,
            }
        })
        .collect();
    if pg.get_load_balance_hosts() == LoadBalanceHosts::Random {
        fastrand::shuffle(&mut targets);
    }
    Ok(targets)
}

/// Where one attempt connects.
enum Endpoint {
    Tcp(SocketAddr),
    #[cfg(unix)]
    Unix(std::path::PathBuf),
}

/// Runs `work` within `bound`, if there is one.
async fn bounded<T>(
    bound: Option<Duration>,
    work: impl Future<Output = T>,
) -> std::result::Result<T, Duration> {
    match bound {
        Some(bound) => tokio::time::timeout(bound, work).await.map_err(|_| bound),
        None => Ok(work.await),
    }
}

impl ConnectConfig {
    /// The startup bound of each attempt: none when set to 0, else `connect_timeout`
    /// (or `PGCONNECT_TIMEOUT`), [`DEFAULT_CONNECT_TIMEOUT`] when neither sets one.
    pub(super) fn bound(&self, pg: &tokio_postgres::Config) -> Option<Duration> {
        match pg.get_connect_timeout() {
            _ if self.unbounded => None,
            Some(timeout) => Some(*timeout),
            None => Some(DEFAULT_CONNECT_TIMEOUT),
        }
    }

    /// Connects with `pg` (this configuration's, possibly changed): every host in turn
    /// (twice for `prefer-standby`: a standby first, then any), each attempt bounded.
    pub(super) async fn open(&self, pg: &tokio_postgres::Config) -> Result<(Client, Messages)> {
        let targets = targets(pg)?;
        let bound = self.bound(pg);
        let passes: &[SessionAttrs] = match self.session {
            SessionAttrs::PreferStandby => &[SessionAttrs::Standby, SessionAttrs::Any],
            ref one => std::slice::from_ref(one),
        };
        let mut failures: Vec<Error> = Vec::new();
        for want in passes {
            for target in &targets {
                match self.attempt(pg, target, bound, *want).await {
                    Ok(connected) => return Ok(connected),
                    Err(errors) => failures.extend(errors),
                }
            }
        }
        let mut last = failures
            .pop()
            .unwrap_or(Error::Unexpected("no host was tried"));
        if let Error::Connect { earlier, .. } = &mut last {
            *earlier = failures.iter().map(ToString::to_string).collect();
        }
        Err(last)
    }

    /// The configuration for one host: its password from the password file, and no TLS
    /// over a Unix socket (as libpq).
    fn for_target(&self, pg: &tokio_postgres::Config, target: &Target) -> tokio_postgres::Config {
        let mut pg = pg.clone();
        if let Some(password) = self.passfile_password(&pg, target) {
            pg.password(password);
        }
        #[cfg(unix)]
        if matches!(target.host, Host::Unix(_)) && target.addr.is_none() {
            pg.ssl_mode(PgSslMode::Disable);
        }
        if self.no_tls && pg.get_ssl_mode() == PgSslMode::Prefer {
            pg.ssl_mode(PgSslMode::Disable);
        }
        pg
    }

    /// The addresses of a host (its name looked up within the bound), or the failure
    /// that names it.
    async fn endpoints(
        &self,
        target: &Target,
        bound: Option<Duration>,
    ) -> std::result::Result<Vec<Endpoint>, Error> {
        let port = target.port;
        if let Some(addr) = target.addr {
            return Ok(vec![Endpoint::Tcp(SocketAddr::new(addr, port))]);
        }
        match &target.host {
            #[cfg(unix)]
            Host::Unix(dir) => Ok(vec![Endpoint::Unix(dir.join(format!(".s.PGSQL.{port}")))]),
            Host::Tcp(name) => {
                if let Ok(addr) = name.parse::<IpAddr>() {
                    return Ok(vec![Endpoint::Tcp(SocketAddr::new(addr, port))]);
                }
                let lookup = tokio::net::lookup_host((name.as_str(), port));
                match bounded(bound, lookup).await {
                    Ok(Ok(addrs)) => Ok(addrs.map(Endpoint::Tcp).collect()),
                    Ok(Err(e)) => Err(failure(
                        target,
                        ConnectPhase::Resolving,
                        None,
                        Some(Box::new(e)),
                    )),
                    Err(bound) => Err(failure(target, ConnectPhase::Resolving, Some(bound), None)),
                }
            }
        }
    }

    /// Tries one host: each of its addresses in turn, each within the bound.
    async fn attempt(
        &self,
        pg: &tokio_postgres::Config,
        target: &Target,
        bound: Option<Duration>,
        want: SessionAttrs,
    ) -> std::result::Result<(Client, Messages), Vec<Error>> {
        let endpoints = self.endpoints(target, bound).await.map_err(|e| vec![e])?;
        let pg = self.for_target(pg, target);
        let mut errors = Vec::new();
        for endpoint in endpoints {
            let progress = Arc::new(Progress::default());
            let work = self.start(&pg, target, endpoint, want, progress.clone());
            let error = match bounded(bound, work).await {
                Ok(Ok(connected)) => return Ok(connected),
                Ok(Err(e)) => {
                    let source: BoxError = if progress.not_postgres.load(Ordering::Relaxed) {
                        Box::new(NotPostgres)
                    } else {
                        e
                    };
                    failure(target, progress.get(), None, Some(source))
                }
                Err(bound) => failure(target, progress.get(), Some(bound), None),
            };
            errors.push(error);
        }
        if errors.is_empty() {
            errors.push(failure(
                target,
                ConnectPhase::Resolving,
                None,
                Some("the host name has no address".into()),
            ));
        }
        Err(errors)
    }

    /// One attempt, unbounded: the connection, the startup, the session check.
    async fn start(
        &self,
        pg: &tokio_postgres::Config,
        target: &Target,
        endpoint: Endpoint,
        want: SessionAttrs,
        progress: Arc<Progress>,
    ) -> std::result::Result<(Client, Messages), BoxError> {
        progress.set(ConnectPhase::Connecting);
        let transport = open_transport(pg, &endpoint).await?;
        let expect = match (pg.get_ssl_mode(), pg.get_ssl_negotiation()) {
            (PgSslMode::Disable, _) => {
                progress.set(ConnectPhase::Authenticating);
                Expect::Messages(Frames::default())
            }
            (_, SslNegotiation::Direct) => {
                progress.set(ConnectPhase::TlsHandshake);
                Expect::TlsRecord { seen: 0 }
            }
            _ => {
                progress.set(ConnectPhase::TlsRequest);
                Expect::TlsAnswer
            }
        };
        let stream = ServerStream(Watched {
            io: transport,
            watch: Watch {
                progress: progress.clone(),
                expect,
            },
            linger: false,
        });
        let domain = target.domain();
        let (client, mut messages) = self
            .connector
            .handshake(pg, &domain, stream, progress.clone())
            .await?;
        if want != SessionAttrs::Any {
            progress.set(ConnectPhase::CheckingSession);
            check_session(&client, &mut messages, want).await?;
        }
        Ok((client, messages))
    }

    /// Sends a cancel request for `client`'s statement in flight to every host of the
    /// list (the connection does not say which one it reached; a server that does not
    /// know the key ignores it).
    pub(super) async fn cancel_everywhere(&self, client: &Client) -> Result<()> {
        let token = client.cancel_token();
        let targets = targets(&self.pg)?;
        let bound = self.bound(&self.pg);
        let sends = targets
            .iter()
            .map(|target| self.cancel_at(&token, target, bound));
        let mut first_error = None;
        for result in futures::future::join_all(sends).await {
            match result {
                Ok(()) => return Ok(()),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or(Error::Unexpected("no host to cancel on")))
    }

    async fn cancel_at(
        &self,
        token: &CancelToken,
        target: &Target,
        bound: Option<Duration>,
    ) -> Result<()> {
        let endpoints = self.endpoints(target, bound).await?;
        let pg = self.for_target(&self.pg, target);
        let mut last = None;
        for endpoint in endpoints {
            let send = async {
                let transport = open_transport(&pg, &endpoint).await?;
                let stream = ServerStream(Watched {
                    io: transport,
                    watch: Watch {
                        progress: Arc::default(),
                        expect: Expect::Nothing,
                    },
                    linger: true,
                });
                self.connector.cancel(token, &target.domain(), stream).await
            };
            match bounded(bound, send).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => last = Some(failure(target, ConnectPhase::Connecting, None, Some(e))),
                Err(bound) => {
                    last = Some(failure(target, ConnectPhase::Connecting, Some(bound), None));
                }
            }
        }
        Err(last.unwrap_or(Error::Unexpected("no address to cancel on")))
    }
}

/// An [`Error::Connect`] for `target`.
fn failure(
    target: &Target,
    phase: ConnectPhase,
    timed_out: Option<Duration>,
    source: Option<BoxError>,
) -> Error {
    Error::Connect {
        host: target.label.clone(),
        port: target.port,
        phase,
        timed_out,
        source: source.map(Arc::from),
        earlier: Vec::new(),
    }
}

/// Opens the TCP connection (with the keepalive settings of `pg`) or the Unix socket.
async fn open_transport(
    pg: &tokio_postgres::Config,
    endpoint: &Endpoint,
) -> std::result::Result<Transport, BoxError> {
    match endpoint {
        Endpoint::Tcp(addr) => {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let socket = socket2::SockRef::from(&tcp);
            if pg.get_keepalives() {
                let keepalive = socket2::TcpKeepalive::new().with_time(pg.get_keepalives_idle());
                #[cfg(any(target_os = "linux", target_os = "macos"))]
                let keepalive = match pg.get_keepalives_interval() {
                    Some(interval) => keepalive.with_interval(interval),
                    None => keepalive,
                };
                #[cfg(any(target_os = "linux", target_os = "macos"))]
                let keepalive = match pg.get_keepalives_retries() {
                    Some(retries) => keepalive.with_retries(retries),
                    None => keepalive,
                };
                socket.set_tcp_keepalive(&keepalive)?;
            }
            #[cfg(target_os = "linux")]
            if let Some(timeout) = pg.get_tcp_user_timeout() {
                socket.set_tcp_user_timeout(Some(*timeout))?;
            }
            Ok(Transport::Tcp(tcp))
        }
        #[cfg(unix)]
        Endpoint::Unix(path) => Ok(Transport::Unix(
            tokio::net::UnixStream::connect(path).await?,
        )),
    }
}

/// Checks that the server is what `target_session_attrs` asks for, driving the
/// connection meanwhile.
async fn check_session(
    client: &Client,
    messages: &mut Messages,
    want: SessionAttrs,
) -> std::result::Result<(), BoxError> {
    let rows = {
        let query = client.simple_query(crate::sql::SESSION_ATTRS);
        tokio::pin!(query);
        loop {
            tokio::select! {
                rows = &mut query => break rows?,
                message = messages.next() => match message {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e.into()),
                    None => return Err("the connection closed".into()),
                },
            }
        }
    };
    let Some((in_recovery, read_only)) = rows.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(row) => Some((row.get(0) == Some("t"), row.get(1) == Some("on"))),
        _ => None,
    }) else {
        return Err("the server did not say whether it is a standby".into());
    };
    let refused = match want {
        SessionAttrs::ReadWrite if read_only => "the server is read-only",
        SessionAttrs::ReadOnly if !read_only => "the server is not read-only",
        SessionAttrs::Primary if in_recovery => "the server is a standby",
        SessionAttrs::Standby if !in_recovery => "the server is not a standby",
        _ => return Ok(()),
    };
    Err(format!("{refused} (target_session_attrs={})", want.as_str()).into())
}
