//! The HTTP side: one page (assets compiled into the binary) and a small JSON API over a
//! [`RunStore`]. Only GET; run names are looked up among the discovered runs, never joined to a path.

use std::net::SocketAddr;
use std::sync::Arc;

use tiny_http::{Header, Method, Request, Response, Server};

use crate::runs::{RunError, RunStore};

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
const UPLOT_JS: &str = include_str!("../assets/vendor/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/vendor/uPlot.min.css");

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {message}")]
    Bind { addr: SocketAddr, message: String },
    #[error(transparent)]
    Runs(#[from] RunError),
}

/// A running dashboard.
pub struct Dashboard {
    server: Arc<Server>,
    addr: SocketAddr,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Dashboard {
    /// Serves `logdir` on `addr` (port 0: any free port) from `threads` worker threads.
    pub fn start(logdir: &std::path::Path, addr: SocketAddr, threads: usize) -> Result<Self, ServeError> {
        let store = Arc::new(RunStore::new(logdir)?);
        let server = Arc::new(Server::http(addr).map_err(|e| ServeError::Bind { addr, message: e.to_string() })?);
        let addr = server.server_addr().to_ip().unwrap_or(addr);
        let threads = (0..threads.max(1))
            .map(|_| {
                let (server, store) = (server.clone(), store.clone());
                std::thread::spawn(move || {
                    for request in server.incoming_requests() {
                        handle(&store, request);
                    }
                })
            })
            .collect();
        Ok(Self { server, addr, threads })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends.
    pub fn wait(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }

    /// Stops accepting requests.
    pub fn stop(self) {
        self.server.unblock();
        for _ in 1..self.threads.len() {
            self.server.unblock();
        }
    }
}

fn header(k: &str, v: &str) -> Header {
    Header::from_bytes(k.as_bytes(), v.as_bytes()).expect("valid header")
}

fn respond(request: Request, status: u16, content_type: &str, body: String) {
    let response = Response::from_string(body)
        .with_status_code(status)
        .with_header(header("Content-Type", content_type))
        .with_header(header("Cache-Control", "no-store"))
        .with_header(header("X-Content-Type-Options", "nosniff"));
    if let Err(e) = request.respond(response) {
        tracing::debug!("response not sent: {e}");
    }
}

fn json<T: serde::Serialize>(request: Request, value: &T) {
    respond(request, 200, "application/json", serde_json::to_string(value).expect("serialisable"));
}

/// `key=value` pairs of a query string, percent-decoded.
fn query(url: &str) -> Vec<(String, String)> {
    let Some((_, q)) = url.split_once('?') else { return Vec::new() };
    q.split('&').filter_map(|kv| kv.split_once('=').map(|(k, v)| (decode(k), decode(v)))).collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(&s[i + 1..i + 3], 16) {
                Ok(b) => {
                    out.push(b);
                    i += 2;
                }
                Err(_) => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn handle(store: &RunStore, request: Request) {
    if request.method() != &Method::Get {
        return respond(request, 405, "text/plain", "GET only\n".into());
    }
    let url = request.url().to_string();
    let path = url.split('?').next().unwrap_or("/");
    let q = query(&url);
    let param = |k: &str| q.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    match path {
        "/" | "/index.html" => respond(request, 200, "text/html; charset=utf-8", INDEX.into()),
        "/assets/app.js" => respond(request, 200, "text/javascript", APP_JS.into()),
        "/assets/app.css" => respond(request, 200, "text/css", APP_CSS.into()),
        "/assets/uPlot.iife.min.js" => respond(request, 200, "text/javascript", UPLOT_JS.into()),
        "/assets/uPlot.min.css" => respond(request, 200, "text/css", UPLOT_CSS.into()),
        "/api/runs" => json(request, &store.summaries()),
        "/api/metrics" | "/api/samples" | "/api/config" => {
            let Some(name) = param("run") else {
                return respond(request, 400, "text/plain", "missing ?run=NAME\n".into());
            };
            let since = param("since").and_then(|s| s.parse().ok()).unwrap_or(0);
            let result = match path {
                "/api/metrics" => store.metrics(&name, since).map(|m| serde_json::to_value(m).expect("json")),
                "/api/samples" => store.samples(&name).map(serde_json::Value::Array),
                _ => store.config(&name).map(serde_json::Value::String),
            };
            match result {
                Ok(v) => json(request, &v),
                Err(e @ RunError::NoSuchRun(_)) => respond(request, 404, "text/plain", format!("{e}\n")),
                Err(e) => respond(request, 500, "text/plain", format!("{e}\n")),
            }
        }
        _ => respond(request, 404, "text/plain", "not found\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_decode() {
        assert_eq!(
            query("/api/metrics?run=exp%2Fnano&since=3"),
            vec![("run".into(), "exp/nano".into()), ("since".into(), "3".into())]
        );
        assert_eq!(decode("a+b%20c%zz"), "a b c%zz");
    }
}
