//! The dashboard's accept loop: hyper's HTTP/1 connections, each with a deadline for a
//! request's head (so a half-sent request, or an idle kept-alive connection, does not
//! hold its place for ever), under a cap of connections in all and per client address.
//! A connection over a cap is answered 503 and closed, and one whose client stops taking
//! the answer is closed once its writes have made no progress for the request timeout
//! ([`WriteDeadline`]). Each request carries its connection's two addresses ([`Conn`]),
//! which the host checks need.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::security::{Conn, client_key};

/// The limits of the server.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// How long a request's head may take to arrive (and a kept-alive connection may
    /// stay idle).
    pub(super) header_timeout: Duration,
    /// How long an answer's writing may make no progress.
    pub(super) write_timeout: Duration,
    /// The connections open at once, in all.
    pub(super) connections: usize,
    /// The connections open at once from one client address.
    pub(super) per_client: usize,
}

/// The largest request head read (hyper's buffer; its least is 8 KiB).
const HEAD_BUFFER: usize = 64 * 1024;

/// Refusals being answered at once at most (beyond, a connection is just closed).
const REFUSALS_AT_ONCE: usize = 64;

/// How long a refusal may take to be written and the client to hang up.
const REFUSAL_TIME: Duration = Duration::from_secs(2);

/// How long a shutdown waits for open connections to finish their requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The open connections of each client address.
type PerClient = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// A connection's place: its share of both caps, given back when dropped.
struct Place {
    per_client: PerClient,
    client: IpAddr,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut open = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.client);
            }
        }
    }
}

/// Serves `router` on `listener` until `shutdown` completes, then lets open connections
/// finish their requests for a while.
pub(super) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let connections = Arc::new(Semaphore::new(limits.connections));
    let per_client: PerClient = Arc::default();
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    let (stop, stopped) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, mostly: wait for some to be closed.
                    pgbus::warn_limited!(error = %e, "pgbus ui cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let client = client_key(peer.ip());
        let place = {
            let mut open = per_client.lock().unwrap_or_else(|e| e.into_inner());
            let mine = open.get(&client).copied().unwrap_or(0);
            if mine >= limits.per_client {
                Err("too many connections from your address: close some and try again")
            } else if let Ok(permit) = connections.clone().try_acquire_owned() {
                *open.entry(client).or_insert(0) += 1;
                Ok(Place {
                    per_client: per_client.clone(),
                    client,
                    _permit: permit,
                })
            } else {
                Err("too many connections")
            }
        };
        match place {
            Ok(place) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(connection(
                    router.clone(),
                    stream,
                    Conn { local, peer },
                    limits,
                    place,
                    stopped.clone(),
                ));
            }
            Err(reason) => {
                let reason = if reason == "too many connections" {
                    format!(
                        "too many connections: the dashboard serves at most {} at once",
                        limits.connections
                    )
                } else {
                    reason.to_string()
                };
                if let Ok(permit) = refusals.clone().try_acquire_owned() {
                    tokio::spawn(refuse(stream, reason, permit));
                }
            }
        }
    }
    drop(listener);
    let _ = stop.send(true);
    let all = u32::try_from(limits.connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, connections.acquire_many(all)).await;
}

/// Serves one connection until it ends, or until the shutdown (then it finishes the
/// request under way).
async fn connection(
    router: Router,
    stream: TcpStream,
    conn: Conn,
    limits: Limits,
    _place: Place,
    mut stopped: watch::Receiver<bool>,
) {
    let service = hyper::service::service_fn(
        move |mut request: axum::extract::Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(conn);
            let mut router = router.clone();
            async move { tower_service::Service::call(&mut router, request).await }
        },
    );
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(HEAD_BUFFER)
        .keep_alive(true);
    let stream = WriteDeadline {
        inner: stream,
        limit: limits.write_timeout,
        stalled: None,
    };
    let served = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    tokio::pin!(served);
    tokio::select! {
        result = served.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(error = %e, client = %conn.peer, "pgbus ui connection ended");
            }
            return;
        }
        _ = stopped.changed() => {}
    }
    served.as_mut().graceful_shutdown();
    let _ = served.await;
}

/// Answers a connection over a cap with 503 and closes it. What the client sent is read
/// and dropped until it hangs up (for at most [`REFUSAL_TIME`]): closing with unread
/// data would reset the connection, and the client could lose the answer.
async fn refuse(mut stream: TcpStream, reason: String, _permit: OwnedSemaphorePermit) {
    let body = format!("{reason}\n");
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Content-Length: {}\r\nRetry-After: 1\r\nCache-Control: no-store\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIME, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// A connection whose writes fail (`TimedOut`) once they have made no progress for
/// `limit`: a client that asks for a large answer and never reads it would otherwise hold
/// its connection, and its place under the caps, for ever.
struct WriteDeadline {
    inner: TcpStream,
    limit: Duration,
    /// Since when the writes wait, as a timer.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    /// Called when a write, flush or shutdown waits: an error once it has waited too long.
    fn waiting<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took none of the answer for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Called with a write's, flush's or shutdown's outcome.
    fn progress<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match poll {
            Poll::Pending => self.waiting(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(cx, poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progress(cx, poll)
    }
}
