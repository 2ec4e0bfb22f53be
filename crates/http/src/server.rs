//! The shell around a [`Service`]: it listens, admits and watches connections, checks what every
//! request must pass, and hands the rest to the service. Nothing a client sends may take the process
//! down, hold its memory or (for a server beside training) compete with it for the CPU:
//! - a tokio runtime of its own, driven from an OS thread of its own, so the caller never waits on
//!   it; at a lower priority if asked ([`Priority`]);
//! - hyper's HTTP/1 connections with a cap on the request head ([`Limits::max_header_bytes`]) and
//!   a deadline to send it ([`Limits::header_read_timeout`]);
//! - requests announcing a body over [`Limits::max_body`] get 413 unread, and the connection is
//!   closed after the answer;
//! - at most [`Limits::max_connections`] connections (and half the process's file descriptors),
//!   treated as [`Limits::idle`] says (see [`crate::conn`]); a full house makes room by closing the
//!   idlest connection, and answers 503 only when every connection has a request in work;
//! - accept errors (out of file descriptors, say) are logged and retried, never fatal;
//! - a `Host` allow-list against DNS rebinding ([`Settings::allowed_hosts`]);
//! - a graceful stop ([`Server::drain`]): no new connections or requests, the answers in work
//!   finished within a grace period, then ended by the service ([`Service::cut`]);
//! - every refusal logged (target `ember_http`), never a request's body.

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use hyper::body::{Body, Bytes, Incoming};
use hyper::header::{HeaderValue, CONNECTION, HOST};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Notify;

use crate::conn::{Conn, Conns, Idle, Place, Watched};
use crate::hosts::AllowedHosts;

/// How long answers cut by a draining server ([`Server::drain`]) get to send their last words: one
/// event each, at once unless the client has stopped reading.
pub(crate) const CUT_WAIT: Duration = Duration::from_secs(2);

/// What a connection turned away at a full house gets (written once, without waiting).
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 15\r\n\
Retry-After: 1\r\nConnection: close\r\n\r\nserver is busy\n";

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {message}")]
    Bind { addr: SocketAddr, message: String },
    #[error("cannot start {name}'s threads: {err}")]
    Threads { name: &'static str, err: std::io::Error },
}

/// What the server allows a client.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Open connections at most (and half the process's file descriptor limit at most).
    pub max_connections: usize,
    /// A request head (request line and headers) larger than this is refused (431).
    pub max_header_bytes: usize,
    /// The request head must arrive within this (from the connection's start or the previous
    /// answer), or the connection is closed.
    pub header_read_timeout: Duration,
    /// Requests announcing a larger body get 413, unread.
    pub max_body: u64,
    /// A service that reads a body gives it this long to arrive (408).
    pub body_timeout: Duration,
    /// What happens to connections that hold a place without using it.
    pub idle: Idle,
    /// Bytes of whole answers that may wait for their clients at once (see [`Conn::reserve`]).
    pub response_budget: usize,
}

/// For an API server: bodies of a JSON request up to 1 MiB, and connections kept however long an
/// answer waits. A server that reads no bodies and answers at once lowers `max_body` and closes
/// idle connections (`ember_dashboard::Options::default()`).
impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_header_bytes: 16 << 10,
            header_read_timeout: Duration::from_secs(10),
            max_body: 1 << 20,
            body_timeout: Duration::from_secs(30),
            idle: Idle::Kept,
            response_budget: 64 << 20,
        }
    }
}

/// The scheduling of the server's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    Normal,
    /// Nice 10 (unless lower already).
    Lower,
    /// Nice 10 and `SCHED_IDLE` (Linux): only on CPU time nothing else wants, and preempted as
    /// soon as another thread wakes up. For a server beside training, which must not slow it down
    /// however hard the server is pushed; answers may then lag by seconds while every core trains.
    IdleTime,
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The name of the server's threads (and of its log lines), e.g. `ember-dashboard`.
    pub name: &'static str,
    /// Threads that serve connections, and at most as many for blocking work (at least 1).
    pub threads: usize,
    pub priority: Priority,
    /// `Host` names or addresses answered besides localhost, 127.0.0.1, [::1] and the address a
    /// connection came in on.
    pub allowed_hosts: Vec<String>,
    pub limits: Limits,
}

/// Why the shell turned a request away before the service saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// A `Host` (the header's value, empty when there is none) or absolute URI naming a host this
    /// server does not answer to (403).
    Host(String),
    /// A body announced over this many bytes (413).
    BodyTooLarge(u64),
    /// The server is draining ([`Server::drain`]): no new requests (503, the connection closed).
    ShuttingDown,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Host(host) => write!(f, "Host `{host}` is not served"),
            Self::BodyTooLarge(limit) => write!(f, "a body announced over {limit} bytes"),
            Self::ShuttingDown => f.write_str("the server is shutting down"),
        }
    }
}

/// What a server answers, behind the shell.
pub trait Service: Send + Sync + 'static {
    type Body: Body<Data = Bytes, Error = Infallible> + Send + 'static;

    /// The answer to a request the shell turns away.
    fn refuse(&self, why: Refused) -> Response<Self::Body>;

    /// The answer to a request that passed the shell's checks, on connection `conn`.
    fn answer(
        self: Arc<Self>,
        request: Request<Incoming>,
        conn: Arc<Conn>,
    ) -> impl Future<Output = Response<Self::Body>> + Send;

    /// Ends every answer in work now, each with a last word its client can read (a draining server
    /// whose grace period is over). Answers that end on their own within moments need nothing.
    fn cut(&self) {}
}

/// A running server. Dropping it stops the server (without waiting for it).
pub struct Server {
    addr: SocketAddr,
    shutdown: Arc<Notify>,
    /// After the accept loop has ended, the runtime stays up until this is notified.
    finish: Arc<Notify>,
    draining: Arc<AtomicBool>,
    conns: Arc<Conns>,
    cut: Arc<dyn Fn() + Send + Sync>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How a drained server's answers ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Requests in work when the drain began.
    pub in_work: usize,
    /// Requests still in work when the grace period ended, ended by [`Service::cut`].
    pub cut: usize,
}

impl Server {
    /// Serves `service` on `addr` (port 0: any free port). Returns once listening; the server runs
    /// on threads of its own.
    pub fn start<S: Service>(addr: SocketAddr, settings: Settings, service: S) -> Result<Self, StartError> {
        let Settings { name, threads, priority, allowed_hosts, mut limits } = settings;
        let threads_error = |err| StartError::Threads { name, err };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .max_blocking_threads(threads.max(1))
            .thread_name(name)
            .on_thread_start(move || lower_priority(priority))
            .enable_io()
            .enable_time()
            .build()
            .map_err(threads_error)?;
        let listener = {
            let _context = runtime.enter();
            listen(addr).map_err(|e| StartError::Bind { addr, message: e.to_string() })?
        };
        let addr = listener.local_addr().unwrap_or(addr);
        // Half the descriptors at most, so that files (and, under `ember train`, training) still
        // have some when every connection is taken.
        if let Some(fds) = fd_limit() {
            limits.max_connections = limits.max_connections.min((fds / 2).max(1) as usize);
        }
        let service = Arc::new(service);
        let conns = Conns::new(limits.max_connections, limits.idle, limits.response_budget);
        let draining = Arc::new(AtomicBool::new(false));
        let shell = Arc::new(Shell {
            name,
            hosts: AllowedHosts::new(&allowed_hosts),
            conns: conns.clone(),
            limits,
            service: service.clone(),
            draining: draining.clone(),
        });
        let cut = Arc::new(move || service.cut());
        let (shutdown, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (stop, finished) = (shutdown.clone(), finish.clone());
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                lower_priority(priority);
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    runtime.block_on(shell.serve(listener, stop, finished));
                }));
                if served.is_err() {
                    tracing::error!("{name} stopped after a panic");
                }
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(threads_error)?;
        Ok(Self { addr, shutdown, finish, draining, conns, cut, thread: Some(thread) })
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
        self.end();
    }

    /// Stops gracefully: new connections are no longer accepted and new requests on open ones get
    /// 503, idle connections are closed, the requests in work have `grace` to finish, then the
    /// service ends the rest ([`Service::cut`]) and they get [`CUT_WAIT`] more to send their last
    /// words; then the server stops. Returns within `grace` + [`CUT_WAIT`] + about a second, however
    /// the clients behave (one that does not read loses its answer's last bytes).
    pub fn drain(mut self, grace: Duration) -> Drained {
        self.draining.store(true, Ordering::SeqCst);
        self.shutdown.notify_one();
        self.conns.close_idle();
        let in_work = self.conns.working();
        let settled = |within: Duration| {
            let start = Instant::now();
            while self.conns.working() > 0 && start.elapsed() < within {
                std::thread::sleep(Duration::from_millis(10));
            }
            self.conns.working()
        };
        let cut = settled(grace);
        if cut > 0 {
            (self.cut)();
            let left = settled(CUT_WAIT);
            if left > 0 {
                tracing::warn!(
                    "{left} answers did not end within {CUT_WAIT:?} of being cut; their clients do not read"
                );
            }
        }
        // The last answers' final bytes leave hyper's buffers for the sockets.
        std::thread::sleep(Duration::from_millis(100));
        self.end();
        Drained { in_work, cut }
    }

    fn end(&mut self) {
        self.shutdown.notify_one();
        self.finish.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.notify_one();
        self.finish.notify_one();
    }
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // A restarted server can take its port back while old connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    // Room for a burst of connections while the accept loop catches up.
    socket.listen(1024)
}

/// Puts the calling thread at nice 10 (unless it is lower already) and, for
/// [`Priority::IdleTime`], under `SCHED_IDLE`, so that the server takes little CPU from whatever
/// else runs (training, under `ember train --dashboard`). On Linux both are per thread, and new
/// threads inherit them. Failures leave the thread as it was.
fn lower_priority(priority: Priority) {
    if priority == Priority::Normal {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread's own id, with a parameter struct they read.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        if libc::getpriority(libc::PRIO_PROCESS, tid) < 10 {
            libc::setpriority(libc::PRIO_PROCESS, tid, 10);
        }
        if priority == Priority::IdleTime {
            let param = libc::sched_param { sched_priority: 0 };
            libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
        }
    }
}

/// The soft limit on open file descriptors.
fn fd_limit() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `getrlimit` writes the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    #[allow(clippy::unnecessary_cast)] // `rlim_t` is not `u64` on every target
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as u64)
}

pub enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Whichever of `a` and `b` finishes first (`a` when both are ready).
pub async fn race<A: Future, B: Future>(a: A, b: B) -> Either<A::Output, B::Output> {
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

struct Shell<S> {
    name: &'static str,
    hosts: AllowedHosts,
    conns: Arc<Conns>,
    limits: Limits,
    service: Arc<S>,
    draining: Arc<AtomicBool>,
}

impl<S: Service> Shell<S> {
    async fn serve(self: Arc<Self>, listener: TcpListener, shutdown: Arc<Notify>, finish: Arc<Notify>) {
        let reaper = tokio::spawn({
            let conns = self.conns.clone();
            async move {
                let mut tick = tokio::time::interval(conns.reap_period());
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                loop {
                    tick.tick().await;
                    conns.reap();
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
                        tracing::warn!("{}: cannot accept a connection: {e}{more}; retrying", self.name);
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
        // New connections are refused by the system from here; the open ones are served until
        // the server is told to finish.
        drop(listener);
        finish.notified().await;
        reaper.abort();
    }

    fn admit(self: Arc<Self>, stream: TcpStream) {
        let Some(place) = self.conns.admit() else {
            // Every place is taken: say so and close, without waiting.
            tracing::warn!(
                "{}: every connection has a request in work; a new one from {} was turned away (503)",
                self.name,
                stream.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string())
            );
            let _ = stream.try_write(BUSY);
            return;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(self.connection(stream, place));
    }

    async fn connection(self: Arc<Self>, stream: TcpStream, place: Place) {
        let local = stream.local_addr().ok().map(|a| a.ip());
        let conn = place.state.clone();
        let shell = self.clone();
        let service = hyper::service::service_fn(move |request| {
            let (shell, conn) = (shell.clone(), conn.clone());
            async move { Ok::<_, Infallible>(shell.request(request, local, conn).await) }
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
            Either::Right(Err(e)) => tracing::debug!("{} connection: {e}", self.name),
        }
    }

    /// The checks every request passes (Host, announced body size), then the service's answer.
    async fn request(&self, request: Request<Incoming>, local: Option<IpAddr>, conn: Arc<Conn>) -> Response<S::Body> {
        let _working = conn.working();
        let refuse = |why: Refused, close: bool| {
            tracing::info!("{}: {} {} refused: {why}", self.name, request.method(), request.uri().path());
            let mut r = self.service.refuse(why);
            if close {
                r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            }
            r
        };
        if self.draining.load(Ordering::SeqCst) {
            return refuse(Refused::ShuttingDown, true);
        }
        let host = request.headers().get(HOST).map(|h| h.to_str());
        let host_ok = matches!(host, Some(Ok(host)) if self.hosts.allows(host, local));
        let authority_ok = request.uri().authority().is_none_or(|a| self.hosts.allows(a.as_str(), local));
        if !host_ok || !authority_ok {
            let host = host.and_then(Result::ok).unwrap_or_default();
            return refuse(Refused::Host(host.to_string()), false);
        }
        if request.body().size_hint().upper().is_some_and(|n| n > self.limits.max_body) {
            // Never read: the connection is closed after the answer.
            return refuse(Refused::BodyTooLarge(self.limits.max_body), true);
        }
        self.service.clone().answer(request, conn).await
    }
}
