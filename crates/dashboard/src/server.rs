//! The HTTP side: one page (assets compiled into the binary) and a small JSON API over a
//! [`RunStore`]. Only GET; run names are looked up among the discovered runs, never joined to a path.
//!
//! The server may run inside `ember train --dashboard`, so nothing a client sends may take the
//! process down, hold its memory or compete with training for the CPU:
//! - a tokio runtime of its own (1–4 threads, at nice 10, or `SCHED_IDLE` beside training; see
//!   [`Options::idle_priority`]), driven from an OS thread of its own, so the caller never waits on it;
//! - hyper's HTTP/1 connections with a cap on the request head ([`Limits::max_header_bytes`]) and
//!   a deadline to send it ([`Limits::header_read_timeout`]); bodies are never read: a request
//!   announcing more than [`Limits::max_body`] bytes (or an unknown length) gets 413 and the
//!   connection is closed;
//! - at most [`Limits::max_connections`] connections, closed when silent or when the client does
//!   not take its answer (see [`crate::conn`]); a full house makes room by closing the idlest one;
//! - a run's metrics (the one answer that grows large) are written a piece at a time, as the
//!   client takes them; other answers waiting for slow clients share a fixed budget of bytes
//!   ([`Limits::response_budget`]); past it, 503;
//! - accept errors (out of file descriptors, say) are logged and retried, never fatal;
//! - a `Host` allow-list against DNS rebinding ([`AllowedHosts`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONNECTION, CONTENT_TYPE, HOST, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, Semaphore};

use crate::conn::{ConnState, Conns, Deadlines, Place, Watched};
use crate::hosts::AllowedHosts;
use crate::runs::{MetricsJson, RunError, RunStore};

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
const UPLOT_JS: &str = include_str!("../assets/vendor/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/vendor/uPlot.min.css");

/// What a connection turned away at a full house gets (written once, without waiting).
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 15\r\n\
Retry-After: 1\r\nConnection: close\r\n\r\nserver is busy\n";

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {message}")]
    Bind { addr: SocketAddr, message: String },
    #[error(transparent)]
    Runs(#[from] RunError),
    #[error("cannot start the dashboard's threads: {0}")]
    Threads(std::io::Error),
}

/// What the server allows a client.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Open connections at most (and half the process's file descriptor limit at most); see
    /// [`crate::conn`].
    pub max_connections: usize,
    /// A request head (request line and headers) larger than this is refused (431).
    pub max_header_bytes: usize,
    /// The request head must arrive within this (from the connection's start or the previous
    /// answer), or the connection is closed.
    pub header_read_timeout: Duration,
    /// A connection with no byte either way and no request being answered for this long is closed.
    pub idle_timeout: Duration,
    /// Output the client has not taken within this is dropped with its connection: a client that
    /// never reads is cut off, and one that reads a metrics answer (written in 64 KiB pieces) must
    /// take each piece within this.
    pub write_timeout: Duration,
    /// Requests announcing a larger body (or one of unknown length) get 413, unread.
    pub max_body: u64,
    /// Bytes of whole answers (all but metrics, which are written a piece at a time) that may wait
    /// for their clients at once; past it, 503.
    pub response_budget: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_header_bytes: 16 << 10,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(15),
            write_timeout: Duration::from_secs(30),
            max_body: 4 << 10,
            response_budget: 64 << 20,
        }
    }
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct Options {
    /// Threads that serve connections, and at most as many that read run files (clamped to 1–4).
    pub threads: usize,
    /// `Host` names or addresses answered besides localhost, 127.0.0.1, [::1] and the address a
    /// connection came in on.
    pub allowed_hosts: Vec<String>,
    pub limits: Limits,
    /// Run the server's threads under `SCHED_IDLE` (Linux): only on CPU time nothing else wants,
    /// and preempted as soon as another thread wakes up. For a dashboard beside training, which must
    /// not slow it down however hard the server is pushed; the page may then lag by seconds while
    /// every core trains. Otherwise the threads run at nice 10.
    pub idle_priority: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self { threads: 2, allowed_hosts: Vec::new(), limits: Limits::default(), idle_priority: false }
    }
}

/// A running dashboard. Dropping it stops the server (without waiting for it).
pub struct Dashboard {
    addr: SocketAddr,
    shutdown: Arc<Notify>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dashboard {
    /// Serves `logdir` on `addr` (port 0: any free port) from `threads` threads, with the default
    /// [`Limits`].
    pub fn start(logdir: &std::path::Path, addr: SocketAddr, threads: usize) -> Result<Self, ServeError> {
        Self::start_with(logdir, addr, Options { threads, ..Options::default() })
    }

    /// Serves `logdir` on `addr`. Returns once listening; the server runs on threads of its own.
    pub fn start_with(logdir: &std::path::Path, addr: SocketAddr, options: Options) -> Result<Self, ServeError> {
        let threads = options.threads.clamp(1, 4);
        let store = RunStore::new(logdir)?.with_parallelism(threads);
        let idle = options.idle_priority;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .max_blocking_threads(threads)
            .thread_name("ember-dashboard")
            .on_thread_start(move || lower_priority(idle))
            .enable_io()
            .enable_time()
            .build()
            .map_err(ServeError::Threads)?;
        let listener = {
            let _context = runtime.enter();
            listen(addr).map_err(|e| ServeError::Bind { addr, message: e.to_string() })?
        };
        let addr = listener.local_addr().unwrap_or(addr);
        let mut limits = options.limits;
        // Half the descriptors at most, so that files (and, under `ember train`, training) still
        // have some when every connection is taken.
        if let Some(fds) = fd_limit() {
            limits.max_connections = limits.max_connections.min((fds / 2).max(1) as usize);
        }
        let server = Arc::new(Server {
            store,
            hosts: AllowedHosts::new(&options.allowed_hosts),
            conns: Conns::new(limits.max_connections),
            budget: Arc::new(Semaphore::new(kib(limits.response_budget) as usize)),
            limits,
        });
        let shutdown = Arc::new(Notify::new());
        let stop = shutdown.clone();
        let thread = std::thread::Builder::new()
            .name("ember-dashboard".into())
            .spawn(move || {
                lower_priority(idle);
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    runtime.block_on(server.serve(listener, stop));
                }));
                if served.is_err() {
                    tracing::error!("the dashboard stopped after a panic");
                }
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(ServeError::Threads)?;
        Ok(Self { addr, shutdown, thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops accepting connections, drops the open ones and waits (about a second at most) for the
    /// server's threads to end.
    pub fn stop(mut self) {
        self.shutdown.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        self.shutdown.notify_one();
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // A restarted dashboard can take its port back while old connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    // Room for a burst of connections while the accept loop catches up.
    socket.listen(1024)
}

/// Puts the calling thread at nice 10 (unless it is lower already) and, if `idle`, under
/// `SCHED_IDLE`, so that the server takes little CPU from whatever else runs (training, under
/// `ember train --dashboard`). On Linux both are per thread, and new threads inherit them. Failures
/// leave the thread as it was.
fn lower_priority(idle: bool) {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread's own id, with a parameter struct they read.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        if libc::getpriority(libc::PRIO_PROCESS, tid) < 10 {
            libc::setpriority(libc::PRIO_PROCESS, tid, 10);
        }
        if idle {
            let param = libc::sched_param { sched_priority: 0 };
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = idle;
}

/// The soft limit on open file descriptors.
fn fd_limit() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `getrlimit` writes the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    #[allow(clippy::unnecessary_cast)] // `rlim_t` is not `u64` on every target
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as u64)
}

fn kib(bytes: usize) -> u32 {
    bytes.div_ceil(1024).clamp(1, u32::MAX as usize) as u32
}

enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Whichever of `a` and `b` finishes first (`a` when both are ready).
async fn race<A: Future, B: Future>(a: A, b: B) -> Either<A::Output, B::Output> {
    let mut a = std::pin::pin!(a);
    let mut b = std::pin::pin!(b);
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(x) = a.as_mut().poll(cx) {
            return Poll::Ready(Either::Left(x));
        }
        b.as_mut().poll(cx).map(Either::Right)
    })
    .await
}

struct Server {
    store: RunStore,
    hosts: AllowedHosts,
    conns: Arc<Conns>,
    /// KiB of answers that may wait for their clients.
    budget: Arc<Semaphore>,
    limits: Limits,
}

/// An answer's body: whole, or a run's metrics written a piece at a time (chunked).
enum Reply {
    Whole(Full<Bytes>),
    Metrics(MetricsJson),
}

impl Body for Reply {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Reply::Whole(body) => std::pin::Pin::new(body).poll_frame(cx),
            Reply::Metrics(json) => Poll::Ready(json.next().map(|piece| Ok(Frame::data(Bytes::from(piece))))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Reply::Whole(body) => body.is_end_stream(),
            Reply::Metrics(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Reply::Whole(body) => body.size_hint(),
            Reply::Metrics(_) => SizeHint::default(),
        }
    }
}

/// What the JSON API answers.
enum Api {
    Whole(Vec<u8>),
    Metrics(MetricsJson),
}

type Answer = Response<Reply>;

fn answer(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Answer {
    with_body(status, content_type, Reply::Whole(Full::new(body.into())))
}

fn with_body(status: u16, content_type: &'static str, body: Reply) -> Answer {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    r
}

fn text(status: u16, body: impl Into<Bytes>) -> Answer {
    answer(status, "text/plain; charset=utf-8", body)
}

impl Server {
    async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: Arc<Notify>) {
        let reaper = tokio::spawn({
            let server = self.clone();
            async move {
                let l = &server.limits;
                let deadlines = Deadlines { idle: l.idle_timeout, write: l.write_timeout };
                let period =
                    (l.idle_timeout.min(l.write_timeout) / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                loop {
                    tick.tick().await;
                    server.conns.reap(deadlines);
                }
            }
        });
        let mut warned: Option<Instant> = None;
        let mut unreported = 0usize;
        loop {
            let accepted = match race(shutdown.notified(), listener.accept()).await {
                Either::Left(()) => break,
                Either::Right(accepted) => accepted,
            };
            match accepted {
                Ok((stream, _)) => self.clone().admit(stream),
                Err(e) => {
                    // Out of file descriptors (EMFILE, ENFILE), or a connection reset before it
                    // was accepted: nothing to end the server for. The connection stays queued
                    // and is accepted once a descriptor is free.
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if warned.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                        let more = if unreported > 0 {
                            format!(" ({unreported} more since the last report)")
                        } else {
                            String::new()
                        };
                        tracing::warn!("dashboard: cannot accept a connection: {e}{more}; retrying");
                        warned = Some(Instant::now());
                        unreported = 0;
                    } else {
                        unreported += 1;
                    }
                    // Out of descriptors, the idlest connection gives its own up (closed within a
                    // moment, by its task), so that a real client still gets in.
                    let made_room = out_of_fds && self.conns.evict_one();
                    tokio::time::sleep(Duration::from_millis(if made_room { 1 } else { 20 })).await;
                }
            }
        }
        reaper.abort();
    }

    fn admit(self: Arc<Self>, stream: TcpStream) {
        let Some(place) = self.conns.admit() else {
            // Every connection is being answered: say so and close, without waiting.
            let _ = stream.try_write(BUSY);
            return;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(self.connection(stream, place));
    }

    async fn connection(self: Arc<Self>, stream: TcpStream, place: Place) {
        let local = stream.local_addr().ok().map(|a| a.ip());
        let state = place.state.clone();
        let server = self.clone();
        let service = hyper::service::service_fn(move |request| {
            let (server, state) = (server.clone(), state.clone());
            async move { Ok::<_, Infallible>(server.handle(request, local, &state).await) }
        });
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(self.limits.header_read_timeout)
            .max_buf_size(self.limits.max_header_bytes.max(8192))
            .keep_alive(true);
        let connection = http.serve_connection(TokioIo::new(Watched::new(stream, place.state.clone())), service);
        match race(place.state.close.notified(), connection).await {
            Either::Left(()) => {}
            Either::Right(Ok(())) => {}
            Either::Right(Err(e)) => tracing::debug!("dashboard connection: {e}"),
        }
    }

    async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
        local: Option<IpAddr>,
        conn: &Arc<ConnState>,
    ) -> Answer {
        let _busy = conn.busy();
        let host_ok = match request.headers().get(HOST).map(|h| h.to_str()) {
            Some(Ok(host)) => self.hosts.allows(host, local),
            _ => false,
        };
        let authority_ok = request.uri().authority().is_none_or(|a| self.hosts.allows(a.as_str(), local));
        if !host_ok || !authority_ok {
            return text(403, "this dashboard answers only to localhost (see --allow-host)\n");
        }
        let body = request.body();
        if !body.is_end_stream() {
            // Never read: the body is left unread and the connection closed after the answer.
            let mut r = if body.size_hint().upper().is_none_or(|n| n > self.limits.max_body) {
                text(413, "request bodies are not accepted\n")
            } else {
                self.clone().route(&request, conn).await
            };
            r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
        self.clone().route(&request, conn).await
    }

    async fn route(self: Arc<Self>, request: &Request<Incoming>, conn: &Arc<ConnState>) -> Answer {
        if request.method() != Method::GET {
            return text(405, "GET only\n");
        }
        let path = request.uri().path();
        match path {
            "/" | "/index.html" => answer(200, "text/html; charset=utf-8", INDEX),
            "/assets/app.js" => answer(200, "text/javascript", APP_JS),
            "/assets/app.css" => answer(200, "text/css", APP_CSS),
            "/assets/uPlot.iife.min.js" => answer(200, "text/javascript", UPLOT_JS),
            "/assets/uPlot.min.css" => answer(200, "text/css", UPLOT_CSS),
            "/api/runs" | "/api/metrics" | "/api/samples" | "/api/config" => {
                let path = path.to_string();
                let params = query(request.uri().query().unwrap_or(""));
                let server = self.clone();
                // Reading runs blocks on files: on the few blocking threads, never the I/O ones.
                let result = match tokio::task::spawn_blocking(move || server.api(&path, &params)).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!("dashboard: a request failed: {e}");
                        Err((500, "internal error\n".to_string()))
                    }
                };
                match result {
                    Ok(Api::Metrics(json)) => with_body(200, "application/json", Reply::Metrics(json)),
                    Ok(Api::Whole(json)) => {
                        let Ok(permit) = self
                            .budget
                            .clone()
                            .try_acquire_many_owned(kib(json.len()).min(kib(self.limits.response_budget)))
                        else {
                            let mut r = text(503, "too many answers are waiting for their clients\n");
                            r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
                            return r;
                        };
                        conn.hold(permit);
                        answer(200, "application/json", json)
                    }
                    Err((status, message)) => text(status, message),
                }
            }
            _ => text(404, "not found\n"),
        }
    }

    /// A JSON API answer, or a status and message.
    fn api(&self, path: &str, params: &[(String, String)]) -> Result<Api, (u16, String)> {
        let param = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        let json = |r: serde_json::Result<Vec<u8>>| r.map(Api::Whole).map_err(|e| (500, format!("{e}\n")));
        if path == "/api/runs" {
            return json(serde_json::to_vec(&self.store.summaries()));
        }
        let Some(name) = param("run") else { return Err((400, "missing ?run=NAME\n".into())) };
        let since = param("since").and_then(|s| s.parse().ok()).unwrap_or(0);
        let result = match path {
            "/api/metrics" => self.store.metrics_json(&name, since).map(|m| Ok(Api::Metrics(m))),
            "/api/samples" => self.store.samples(&name).map(|s| json(serde_json::to_vec(&s))),
            _ => self.store.config(&name).map(|c| json(serde_json::to_vec(&c))),
        };
        match result {
            Ok(r) => r,
            Err(e @ RunError::NoSuchRun(_)) => Err((404, format!("{e}\n"))),
            Err(e) => {
                tracing::warn!("dashboard: {e}");
                Err((500, format!("{e}\n")))
            }
        }
    }
}

/// `key=value` pairs of a query string (what follows `?`), percent-decoded.
fn query(q: &str) -> Vec<(String, String)> {
    q.split('&').filter_map(|kv| kv.split_once('=').map(|(k, v)| (decode(k), decode(v)))).collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_decode() {
        assert_eq!(
            query("run=exp%2Fnano&since=3"),
            vec![("run".into(), "exp/nano".into()), ("since".into(), "3".into())]
        );
        assert_eq!(query("run=a?b&x"), vec![("run".into(), "a?b".into())]);
        assert!(query("").is_empty());
        assert_eq!(decode("a+b%20c%zz"), "a b c%zz");
        // A multi-byte character after `%` is not a slicing panic.
        assert_eq!(decode("%é%"), "%é%");
    }
}
