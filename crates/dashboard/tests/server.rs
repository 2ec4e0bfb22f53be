//! The server in-process, with short deadlines, driven over raw TCP on 127.0.0.1: what it answers to
//! requests a browser would never send, and how it closes connections that hold it up. (The same
//! abuse against the `ember dashboard` binary, with its memory measured, is in tests/dashboard.rs.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use ember_dashboard::{Dashboard, Idle, Limits, Options};

fn line(step: usize) -> String {
    format!(
        "{{\"step\":{step},\"train_loss\":{:.6},\"lr\":0.001,\"grad_norm\":0.8123,\"step_ms\":143.2,\"tokens_per_sec\":5362.1,\"mfu\":0.1935,\"elapsed_s\":{:.3}}}\n",
        4.0 - step as f64 * 1e-5,
        step as f64 * 0.143
    )
}

fn write_run(dir: &Path, name: &str, steps: usize) {
    let run = dir.join(name);
    std::fs::create_dir_all(&run).unwrap();
    let text: String = (1..=steps).map(line).collect();
    std::fs::write(run.join("metrics.jsonl"), text).unwrap();
}

fn limits() -> Limits {
    Limits {
        max_connections: 8,
        header_read_timeout: Duration::from_millis(400),
        idle: Idle::Closed { idle: Duration::from_millis(600), write: Duration::from_millis(500) },
        ..Options::default().limits
    }
}

fn start(dir: &Path, limits: Limits) -> Dashboard {
    let options = Options { threads: 2, allowed_hosts: vec!["box.lan".into()], limits, ..Options::default() };
    ember_dashboard::start(dir, "127.0.0.1:0".parse().unwrap(), options).unwrap()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Everything the server sends until it closes (or the 5-second read timeout): the status and the
/// bytes; `None` for the status when nothing came.
fn read_all(s: &mut TcpStream) -> (Option<u16>, Vec<u8>) {
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("read: {e} after {} bytes", out.len()),
        }
    }
    let status = std::str::from_utf8(out.get(9..12).unwrap_or_default()).ok().and_then(|s| s.parse().ok());
    (status, out)
}

/// Sends `request` and reads to the end; the status and the whole answer.
fn exchange(addr: SocketAddr, request: &str) -> (Option<u16>, String) {
    let mut s = connect(addr);
    s.write_all(request.as_bytes()).unwrap();
    let (status, bytes) = read_all(&mut s);
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

fn get(addr: SocketAddr, path: &str) -> (Option<u16>, String) {
    exchange(addr, &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n", addr.port()))
}

/// A normal request answers, and quickly.
fn assert_answers(addr: SocketAddr) {
    let start = Instant::now();
    let (status, body) = get(addr, "/api/runs");
    assert_eq!(status, Some(200), "{body}");
    assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
}

#[test]
fn bodies_are_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 10);
    let d = start(dir.path(), limits());
    let addr = d.addr();
    // The length is believed by nobody: 413 at once, and the connection closed.
    let start = Instant::now();
    let (status, text) =
        exchange(addr, "GET /api/runs HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000000000000000000\r\n\r\n");
    assert_eq!(status, Some(413), "{text}");
    assert!(start.elapsed() < Duration::from_secs(1), "closed after {:?}", start.elapsed());
    let (status, _) =
        exchange(addr, "POST /api/runs HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n");
    assert_eq!(status, Some(413), "a body of unknown length");
    // A small announced body that never comes: answered, and the connection is closed rather than
    // left waiting for the body.
    let start = Instant::now();
    let (status, text) = exchange(addr, "GET /api/runs HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n");
    assert_eq!(status, Some(200), "{text}");
    assert!(text.to_ascii_lowercase().contains("connection: close"), "{text}");
    assert!(start.elapsed() < Duration::from_secs(1), "closed after {:?}", start.elapsed());
    let (status, _) = exchange(addr, "POST /api/runs HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(status, Some(405));
    assert_answers(addr);
}

#[test]
fn only_local_host_names_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 10);
    let d = start(dir.path(), limits());
    let addr = d.addr();
    let port = addr.port();
    let req = |host: &str| format!("GET /api/runs HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}"), "[::1]".into(), "BOX.lan:1".into()] {
        assert_eq!(exchange(addr, &req(&host)).0, Some(200), "{host}");
    }
    // DNS rebinding: the attacker's name pointing at 127.0.0.1.
    for host in [format!("evil.example:{port}"), "127.0.0.1.nip.io".into(), "localhost.evil.example".into()] {
        let (status, text) = exchange(addr, &req(&host));
        assert_eq!(status, Some(403), "{host}: {text}");
        assert!(!text.contains("\"name\""), "{text}");
    }
    // No Host at all (HTTP/1.0), and an absolute URI naming another host.
    assert_eq!(exchange(addr, "GET /api/runs HTTP/1.0\r\n\r\n").0, Some(403));
    let (status, _) =
        exchange(addr, "GET http://evil.example/api/runs HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    assert_eq!(status, Some(403));
}

#[test]
fn slow_and_oversized_heads_are_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 10);
    let d = start(dir.path(), limits());
    let addr = d.addr();
    // A head that never ends is closed at the header deadline (400 ms here).
    let mut s = connect(addr);
    s.write_all(b"GET /api/runs HTTP/1.1\r\nHost: localhost\r\nX-Slow: ").unwrap();
    let start = Instant::now();
    let (status, _) = read_all(&mut s);
    assert!(status.is_none() || status == Some(408), "{status:?}");
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(2), "closed after {waited:?}");
    // A head past the size cap.
    let big = format!("GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: {}\r\n\r\n", "x".repeat(64 << 10));
    let mut s = connect(addr);
    let _ = s.write_all(big.as_bytes());
    let (status, _) = read_all(&mut s);
    assert!(matches!(status, None | Some(431)), "{status:?}");
    // A connection that never says anything, and one kept alive after an answer, are closed.
    let mut idle = connect(addr);
    let mut kept = connect(addr);
    kept.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let start = Instant::now();
    assert_eq!(read_all(&mut idle).0, None);
    let (status, _) = read_all(&mut kept);
    assert_eq!(status, Some(200));
    assert!(start.elapsed() < Duration::from_secs(2), "closed after {:?}", start.elapsed());
    assert_answers(addr);
}

#[test]
fn a_crowd_of_idle_connections_does_not_lock_out_a_client() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 10);
    // Long deadlines: only making room can let the client in.
    let d = start(
        dir.path(),
        Limits {
            header_read_timeout: Duration::from_secs(60),
            idle: Idle::Closed { idle: Duration::from_secs(60), write: Duration::from_millis(500) },
            ..limits()
        },
    );
    let addr = d.addr();
    let crowd: Vec<TcpStream> = (0..100).map(|_| connect(addr)).collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_answers(addr);
    // The server holds 8 of them at most: the rest are closed (looked at for up to 3 s).
    let mut open = crowd;
    let start = Instant::now();
    while open.len() > 8 && start.elapsed() < Duration::from_secs(3) {
        open.retain_mut(|c| {
            c.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
            let mut b = [0u8; 1];
            match c.read(&mut b) {
                Ok(0) => false,
                Err(e) => e.kind() != std::io::ErrorKind::ConnectionReset,
                Ok(_) => true,
            }
        });
    }
    assert!(open.len() <= 8, "{} of 100 still open", open.len());
}

#[test]
fn clients_that_do_not_read_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    // About 14 MB of metrics JSON: more than the socket buffers on both sides hold.
    write_run(dir.path(), "big", 250_000);
    let d = start(dir.path(), limits());
    let addr = d.addr();
    // Written a piece at a time (chunked), and whole: valid JSON of every row.
    let url = format!("http://127.0.0.1:{}/api/metrics?run=big", addr.port());
    let mut text = Vec::new();
    ureq::get(&url).call().unwrap().into_reader().read_to_end(&mut text).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&text).unwrap();
    assert_eq!(json["rows"], 250_000);
    assert_eq!(json["columns"]["step"].as_array().unwrap().len(), 250_000);
    assert_eq!(json["columns"]["step"][249_999], 250_000.0);
    let request = format!("GET /api/metrics?run=big HTTP/1.1\r\nHost: localhost:{}\r\n\r\n", addr.port());
    let closing = request.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n");
    let (status, whole) = exchange(addr, &closing);
    assert_eq!(status, Some(200));
    let full = whole.len();
    assert!(full > 12 << 20, "{full} bytes");
    // Clients that read nothing do not hold up the others.
    let mut stuck: Vec<TcpStream> = (0..4).map(|_| connect(addr)).collect();
    for s in &mut stuck {
        s.write_all(request.as_bytes()).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(exchange(addr, &closing).0, Some(200));
    assert_answers(addr);
    // Past the write deadline (500 ms) they are cut off: each gets what the socket buffers held
    // (a few MB at most), far from the whole answer.
    std::thread::sleep(Duration::from_millis(1500));
    for s in &mut stuck {
        let (_, got) = read_all(s);
        assert!(got.len() < full / 2, "{} of {full} bytes", got.len());
    }
}

#[test]
fn whole_answers_waiting_for_clients_share_a_budget() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 10);
    // About 16 MB of samples: one answer, written whole.
    let sample = format!("{{\"step\":1,\"text\":\"{}\"}}\n", "x".repeat(16 << 10));
    std::fs::write(dir.path().join("a/samples.jsonl"), sample.repeat(1000)).unwrap();
    let d = start(dir.path(), Limits { response_budget: 20 << 20, ..limits() });
    let addr = d.addr();
    let request = format!("GET /api/samples?run=a HTTP/1.1\r\nHost: localhost:{}\r\n\r\n", addr.port());
    let closing = request.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n");
    let (status, text) = exchange(addr, &closing);
    assert_eq!(status, Some(200));
    let full = text.len();
    assert!(full > 15 << 20, "{full} bytes");
    // One client takes the budget and reads nothing (but the first bytes, to know its answer is
    // on the way); a second is refused meanwhile.
    let mut stuck = connect(addr);
    stuck.write_all(request.as_bytes()).unwrap();
    let mut head = [0u8; 12];
    stuck.read_exact(&mut head).unwrap();
    assert_eq!(&head[9..12], b"200");
    let (status, text) = exchange(addr, &closing);
    assert_eq!(status, Some(503), "{}", &text[..text.len().min(300)]);
    assert_answers(addr);
    // Past the write deadline the stuck client is cut off, and its share is free again.
    std::thread::sleep(Duration::from_millis(1500));
    let (_, got) = read_all(&mut stuck);
    assert!(got.len() < full / 2, "{} of {full} bytes", got.len());
    assert_eq!(exchange(addr, &closing).0, Some(200));
}

#[test]
fn files_that_lead_outside_are_not_served() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret.toml"), "password = \"hunter2\"\n").unwrap();
    std::fs::write(outside.path().join("metrics.jsonl"), line(1).repeat(3)).unwrap();
    std::fs::write(outside.path().join("samples.jsonl"), "{\"step\":1,\"text\":\"hunter2\"}\n").unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 5);
    let link =
        |target: &str, at: &str| std::os::unix::fs::symlink(outside.path().join(target), dir.path().join(at)).unwrap();
    link("secret.toml", "a/config.toml");
    link("samples.jsonl", "a/samples.jsonl");
    std::fs::create_dir_all(dir.path().join("b")).unwrap();
    link("metrics.jsonl", "b/metrics.jsonl");
    std::os::unix::fs::symlink(outside.path(), dir.path().join("c")).unwrap();
    let d = start(dir.path(), limits());
    let addr = d.addr();
    let (status, runs) = get(addr, "/api/runs");
    assert_eq!(status, Some(200));
    assert!(runs.contains("\"name\":\"a\""), "{runs}");
    assert!(!runs.contains("\"name\":\"b\"") && !runs.contains("\"name\":\"c\""), "{runs}");
    let (status, config) = get(addr, "/api/config?run=a");
    assert_eq!(status, Some(200));
    assert!(!config.contains("hunter2"), "{config}");
    let (status, samples) = get(addr, "/api/samples?run=a");
    assert_eq!(status, Some(200));
    assert!(!samples.contains("hunter2"), "{samples}");
    for run in ["b", "c"] {
        assert_eq!(get(addr, &format!("/api/metrics?run={run}")).0, Some(404), "{run}");
    }
    assert_eq!(get(addr, "/api/metrics?run=a").0, Some(200));
}

#[test]
fn stop_closes_the_port() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 3);
    let d = start(dir.path(), limits());
    let addr = d.addr();
    assert_answers(addr);
    let start = Instant::now();
    d.stop();
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(TcpStream::connect(addr).is_err(), "still listening");
}

/// The JSON body of an answer.
fn json_body(answer: &str) -> serde_json::Value {
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

#[test]
fn a_trainers_dashboard_ends_once_a_watching_page_has_the_last_metrics() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), "a", 3);
    let options = || Options { trainer_of: Some("a".into()), ..Options::default() };
    // Nobody watching: training's end does not wait.
    let d = ember_dashboard::start(dir.path(), "127.0.0.1:0".parse().unwrap(), options()).unwrap();
    let start = Instant::now();
    drop(d);
    assert!(start.elapsed() < Duration::from_millis(500), "waited {:?} for no page", start.elapsed());

    let d = ember_dashboard::start(dir.path(), "127.0.0.1:0".parse().unwrap(), options()).unwrap();
    let addr = d.addr();
    let (status, answer) = get(addr, "/api/server");
    assert_eq!(status, Some(200));
    let server = json_body(&answer);
    assert_eq!(
        (&server["served_by"], &server["run"], &server["trainer_ended"]),
        (&"trainer".into(), &"a".into(), &false.into())
    );
    assert_eq!(server["pid"], std::process::id());
    // Training ends (the trainer drops its dashboard): the page is told, and the server answers
    // until the page says it has fetched everything.
    let ending = std::thread::spawn(move || {
        let start = Instant::now();
        drop(d);
        start.elapsed()
    });
    let start = Instant::now();
    while json_body(&get(addr, "/api/server").1)["trainer_ended"] != true {
        assert!(start.elapsed() < Duration::from_secs(2), "never told that training ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(!ending.is_finished(), "the server went away before the page fetched the end");
    assert_eq!(get(addr, "/api/metrics?run=a").0, Some(200));
    assert_eq!(get(addr, "/api/server?fetched=1").0, Some(200));
    let waited = ending.join().unwrap();
    assert!(waited < Duration::from_secs(2), "waited {waited:?} after the page had everything");
}
