//! `ember dashboard` flags (the server's behaviour under hostile requests is tests/dashboard.rs).

use std::time::{Duration, Instant};

use super::common::*;
use super::refuse;

#[test]
fn flags_that_cannot_serve() {
    let s = Scratch::new();
    std::fs::create_dir(s.path().join("runs")).unwrap();
    refuse(&s, &["dashboard", "--logdir", "runs", "--host", "not-an-address"], &["not-an-address"]);
    refuse(&s, &["dashboard", "--logdir", "runs", "--port", "70000"], &["70000"]);
    // A port already taken: the bind error names it, and the process ends (bounded wait).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut child = s
        .command(&["dashboard", "--logdir", "runs", "--port", &port])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("ember dashboard on a taken port {port} is still running after 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!matches!(o.status.code(), Some(0 | 101 | 134) | None), "{:?}\n{err}", o.status);
    assert!(err.contains(&port) && !err.contains("panicked"), "{err}");
}
