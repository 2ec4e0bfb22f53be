//! The HTTP side: one page (assets compiled into the binary) and a small JSON API over a
//! [`RunStore`]. Only GET; run names are looked up among the discovered runs, never joined to a path.
//!
//! The server may run inside `ember train --dashboard`, so nothing a client sends may take the
//! process down, hold its memory or compete with training for the CPU. The shell
//! ([`ember_http`]) gives it threads of its own at nice 10 (or `SCHED_IDLE` beside training; see
//! [`Options::idle_priority`]), capped request heads, at most [`Limits::max_connections`]
//! connections and a `Host` allow-list against DNS rebinding; the dashboard's own limits are these:
//! - bodies are never read: a request announcing more than [`Limits::max_body`] bytes (or an
//!   unknown length) gets 413, and a connection that sent a body is closed after its answer;
//! - connections are closed when silent or when the client does not take its answer, and a full
//!   house makes room by closing the idlest one ([`Idle::Closed`]);
//! - a run's metrics (the one answer that grows large) are written a piece at a time, as the
//!   client takes them; other answers waiting for slow clients share a fixed budget of bytes
//!   ([`Limits::response_budget`]); past it, 503.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use ember_http::{Conn, Idle, Limits, Priority, Refused, Server, Service, Settings, StartError};
use http_body_util::Full;
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONNECTION, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};

use crate::columns::MetricsJson;
use crate::runs::{RunError, RunStore};

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
const UPLOT_JS: &str = include_str!("../assets/vendor/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/vendor/uPlot.min.css");

const NO_BODIES: &str = "request bodies are not accepted\n";

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Runs(#[from] RunError),
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct Options {
    /// Threads that serve connections, and at most as many that read run files (clamped to 1–4).
    pub threads: usize,
    /// `Host` names or addresses answered besides localhost, 127.0.0.1, [::1] and the address a
    /// connection came in on.
    pub allowed_hosts: Vec<String>,
    /// By default the shell's, with bodies of 4 KiB at most (none is read) and connections closed
    /// after 15 s of silence or 30 s with an answer the client does not take (a metrics answer is
    /// written in 64 KiB pieces, each to be taken within that).
    pub limits: Limits,
    /// Run the server's threads under `SCHED_IDLE` (Linux) instead of nice 10: for a dashboard
    /// beside training (see [`Priority::IdleTime`]).
    pub idle_priority: bool,
    /// Served by `ember train --dashboard` for the run of this name (under the log directory): the
    /// page says so, and once training ends ([`Dashboard`] dropped) the server answers until a
    /// watching page has fetched the final metrics.
    pub trainer_of: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        let idle = Idle::Closed { idle: Duration::from_secs(15), write: Duration::from_secs(30) };
        let limits = Limits { max_body: 4 << 10, idle, ..Limits::default() };
        Self { threads: 2, allowed_hosts: Vec::new(), limits, idle_priority: false, trainer_of: None }
    }
}

/// How long after its last poll a page counts as watching: a trainer's server that ends waits for
/// such a page only (the page polls every 2 s).
const WATCHING: Duration = Duration::from_secs(10);
/// How long a trainer's server that ends waits for a watching page to fetch the final metrics:
/// one poll interval and the fetches of one poll.
const LAST_FETCH: Duration = Duration::from_secs(6);

/// Who serves the page, and whether the trainer serving it has finished: what `/api/server` says.
struct Serving {
    /// The log directory as given (the page shows the `ember dashboard` command that keeps it).
    logdir: String,
    trainer_of: Option<String>,
    ended: AtomicBool,
    /// When a page last polled.
    last_poll: Mutex<Option<Instant>>,
    /// A page fetched everything after being told that training ended.
    fetched_after_end: AtomicBool,
}

impl Serving {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "served_by": if self.trainer_of.is_some() { "trainer" } else { "dashboard" },
            "run": self.trainer_of,
            "logdir": self.logdir,
            "pid": std::process::id(),
            "trainer_ended": self.ended.load(Ordering::SeqCst),
        })
    }

    fn polled(&self) {
        *self.last_poll.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    fn watched(&self) -> bool {
        self.last_poll.lock().unwrap_or_else(PoisonError::into_inner).is_some_and(|t| t.elapsed() < WATCHING)
    }
}

/// A running dashboard. Dropping it stops the server (without waiting for its threads); a
/// trainer's ([`Options::trainer_of`]) first tells the pages that training ended and, if one is
/// watching, waits (a few seconds at most) until it has fetched the final metrics.
pub struct Dashboard {
    server: Option<Server>,
    serving: Arc<Serving>,
}

impl Dashboard {
    pub fn addr(&self) -> SocketAddr {
        self.server.as_ref().map_or(SocketAddr::from(([127, 0, 0, 1], 0)), Server::addr)
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(server) = self.server.take() {
            server.wait();
        }
    }

    /// Stops accepting connections, drops the open ones and waits (about a second at most) for the
    /// server's threads to end.
    pub fn stop(mut self) {
        if let Some(server) = self.server.take() {
            server.stop();
        }
    }

    /// Training ended: pages are told so, and a watching one gets [`LAST_FETCH`] to fetch what
    /// training wrote last. Whether one fetched it.
    fn end_of_training(&self) -> bool {
        self.serving.ended.store(true, Ordering::SeqCst);
        if !self.serving.watched() {
            return false;
        }
        let start = Instant::now();
        while start.elapsed() < LAST_FETCH {
            if self.serving.fetched_after_end.load(Ordering::SeqCst) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        if self.server.is_none() {
            return;
        }
        if let Some(run) = &self.serving.trainer_of {
            self.end_of_training();
            eprintln!(
                "dashboard: stopped with the training of {run}; `ember dashboard --logdir {}` keeps browsing the runs",
                self.serving.logdir
            );
        }
    }
}

/// Serves `logdir` on `addr` (port 0: any free port). Returns once listening; the server runs on
/// threads of its own.
pub fn start(logdir: &std::path::Path, addr: SocketAddr, options: Options) -> Result<Dashboard, ServeError> {
    let threads = options.threads.clamp(1, 4);
    let store = RunStore::new(logdir)?.with_parallelism(threads);
    let serving = Arc::new(Serving {
        logdir: logdir.display().to_string(),
        trainer_of: options.trainer_of,
        ended: AtomicBool::new(false),
        last_poll: Mutex::new(None),
        fetched_after_end: AtomicBool::new(false),
    });
    let settings = Settings {
        name: "ember-dashboard",
        threads,
        priority: if options.idle_priority { Priority::IdleTime } else { Priority::Lower },
        allowed_hosts: options.allowed_hosts,
        limits: options.limits,
    };
    let server = Server::start(addr, settings, Pages { store, serving: serving.clone() })?;
    Ok(Dashboard { server: Some(server), serving })
}

/// The page and the JSON API over the runs.
struct Pages {
    store: RunStore,
    serving: Arc<Serving>,
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

impl Service for Pages {
    type Body = Reply;

    fn refuse(&self, why: Refused) -> Answer {
        match why {
            Refused::Host(_) => text(403, "this dashboard answers only to localhost (see --allow-host)\n"),
            Refused::BodyTooLarge(_) => text(413, NO_BODIES),
            Refused::ShuttingDown => text(503, "the dashboard is stopping\n"),
        }
    }

    async fn answer(self: Arc<Self>, request: Request<Incoming>, conn: Arc<Conn>) -> Answer {
        if request.body().is_end_stream() {
            return self.route(&request, &conn).await;
        }
        // Never read: a body of unknown length is refused, a small one left unread, and the
        // connection is closed after the answer.
        let mut r = if request.body().size_hint().upper().is_none() {
            text(413, NO_BODIES)
        } else {
            self.clone().route(&request, &conn).await
        };
        r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
        r
    }
}

impl Pages {
    async fn route(self: Arc<Self>, request: &Request<Incoming>, conn: &Conn) -> Answer {
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
            "/api/server" => {
                // The page asks first in each poll, and again with `fetched` at the end of a poll
                // that began after training ended.
                self.serving.polled();
                let params = query(request.uri().query().unwrap_or(""));
                if params.iter().any(|(k, _)| k == "fetched") && self.serving.ended.load(Ordering::SeqCst) {
                    self.serving.fetched_after_end.store(true, Ordering::SeqCst);
                }
                answer(200, "application/json", self.serving.json().to_string())
            }
            "/api/runs" | "/api/metrics" | "/api/samples" | "/api/config" | "/api/hparams" => {
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
                    Ok(Api::Whole(json)) if conn.reserve(json.len()) => answer(200, "application/json", json),
                    Ok(Api::Whole(_)) => {
                        let mut r = text(503, "too many answers are waiting for their clients\n");
                        r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
                        r
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
            "/api/hparams" => self.store.hparams(&name).map(|h| json(serde_json::to_vec(&h))),
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
