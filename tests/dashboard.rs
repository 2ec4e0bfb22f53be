//! TensorBoard event files read back by an independent reader, and `ember dashboard` driven by a
//! real headless Chromium through ChromeDriver (Debian's chromium and chromium-driver; `.ci/run`
//! installs them).

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use common::*;
use ember_train::metrics::read_metrics;
use serde_json::{json, Value};

// --- An independent reader of TensorBoard event files: TFRecord framing, CRC-32C, protobuf. ---

/// CRC-32C, bit by bit (Castagnoli polynomial, reflected 0x82F63B78).
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

fn masked(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let len_bytes = &bytes[i..i + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        assert_eq!(u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap()), masked(len_bytes), "length CRC");
        let data = &bytes[i + 12..i + 12 + len];
        assert_eq!(u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap()), masked(data), "data CRC");
        out.push(data.to_vec());
        i += 16 + len;
    }
    out
}

/// Protobuf fields of a message: (field number, varint / fixed64 / fixed32 / bytes).
#[derive(Debug, Clone)]
enum Field {
    Varint(u64),
    F64(f64),
    F32(f32),
    Bytes(Vec<u8>),
}

fn fields(mut b: &[u8]) -> Vec<(u32, Field)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        let (num, wire) = ((key >> 3) as u32, key & 7);
        let f = match wire {
            0 => Field::Varint(varint(&mut b)),
            1 => {
                let v = f64::from_le_bytes(b[..8].try_into().unwrap());
                b = &b[8..];
                Field::F64(v)
            }
            5 => {
                let v = f32::from_le_bytes(b[..4].try_into().unwrap());
                b = &b[4..];
                Field::F32(v)
            }
            2 => {
                let n = varint(&mut b) as usize;
                let v = b[..n].to_vec();
                b = &b[n..];
                Field::Bytes(v)
            }
            w => panic!("wire type {w}"),
        };
        out.push((num, f));
    }
    out
}

/// tag -> step -> value of every scalar.
type Scalars = BTreeMap<String, BTreeMap<u64, f32>>;

/// Every scalar, the text summaries by step, and the file version.
fn read_events(path: &Path) -> (Scalars, BTreeMap<u64, String>, String) {
    let (mut scalars, mut texts, mut version) = (BTreeMap::new(), BTreeMap::new(), String::new());
    for rec in records(&std::fs::read(path).unwrap()) {
        let event = fields(&rec);
        let step = event
            .iter()
            .find_map(|(n, f)| {
                matches!((n, f), (2, Field::Varint(_))).then(|| if let Field::Varint(v) = f { *v } else { 0 })
            })
            .unwrap_or(0);
        for (n, f) in &event {
            match (n, f) {
                (1, Field::F64(wall)) => assert!(*wall > 1.6e9, "wall time {wall}"),
                (3, Field::Bytes(v)) => version = String::from_utf8(v.clone()).unwrap(),
                (5, Field::Bytes(summary)) => {
                    for (_, value) in fields(summary) {
                        let Field::Bytes(value) = value else { continue };
                        let vf = fields(&value);
                        let tag = vf
                            .iter()
                            .find_map(|(n, f)| match (n, f) {
                                (1, Field::Bytes(t)) => Some(String::from_utf8(t.clone()).unwrap()),
                                _ => None,
                            })
                            .unwrap();
                        for (n, f) in &vf {
                            match (n, f) {
                                (2, Field::F32(x)) => {
                                    scalars.entry(tag.clone()).or_insert_with(BTreeMap::new).insert(step, *x);
                                }
                                (8, Field::Bytes(tensor)) => {
                                    for (n, f) in fields(tensor) {
                                        if let (8, Field::Bytes(s)) = (n, f) {
                                            texts.insert(step, String::from_utf8(s).unwrap());
                                        }
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
    (scalars, texts, version)
}

fn train_two_runs(s: &Scratch) {
    s.write("corpus.txt", &corpus());
    for (run, seed) in [("a", 7), ("b", 8)] {
        s.write(&format!("{run}.toml"), &tiny_config("").replace("seed = 7", &format!("seed = {seed}")));
        let o = s.ember(&["train", "--config", &format!("{run}.toml"), "--run-dir", &format!("runs/{run}")]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
}

#[test]
fn tensorboard_events_hold_the_logged_values() {
    let s = Scratch::new();
    train_two_runs(&s);
    let run = s.path().join("runs/a");
    let events: Vec<PathBuf> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let (scalars, texts, version) = read_events(&events[0]);
    assert_eq!(version, "brain.Event:2");
    let records = read_metrics(&run.join("metrics.jsonl")).unwrap();
    assert_eq!(scalars["loss/train"].len(), records.len());
    for r in &records {
        let step = r.step as u64;
        assert_eq!(scalars["loss/train"][&step], r.train_loss as f32, "step {step}");
        assert_eq!(scalars["lr"][&step], r.lr as f32);
        assert_eq!(scalars["grad_norm"][&step], r.grad_norm as f32);
        assert_eq!(scalars["mfu"][&step], r.mfu as f32);
        if let Some(v) = r.val_loss {
            assert_eq!(scalars["loss/val"][&step], v as f32);
        }
    }
    assert_eq!(scalars["loss/val"].keys().copied().collect::<Vec<_>>(), [3, 6]);
    assert_eq!(texts.keys().copied().collect::<Vec<_>>(), [3, 6], "samples at evaluations");
    assert!(texts[&6].starts_with("```\n"), "{}", texts[&6]);
}

// --- The dashboard in a browser. ---

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<Value>) -> Value {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A WebDriver session on headless Chromium.
struct Browser {
    base: String,
    session: String,
    _driver: Killed,
}

impl Browser {
    fn start(profile: &Path) -> Browser {
        let driver = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        assert!(
            Path::new(&driver).exists() && Path::new(&chromium).exists(),
            "{driver} or {chromium} not found: install Debian's chromium and chromium-driver (.ci/run does)"
        );
        let port = free_port();
        let child = Command::new(&driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let driver = Killed(child);
        let base = format!("http://127.0.0.1:{port}");
        wait_for("chromedriver", Duration::from_secs(20), || {
            ureq::get(&format!("{base}/status")).call().ok().map(|_| Value::Null)
        });
        let caps = json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": {"binary": chromium, "args": [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--window-size=1300,900", format!("--user-data-dir={}", profile.display())
        ]}}}});
        let resp: Value = ureq::post(&format!("{base}/session")).send_json(caps).unwrap().into_json().unwrap();
        let session = resp["value"]["sessionId"].as_str().unwrap().to_string();
        Browser { base, session, _driver: driver }
    }

    fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}/{path}", self.base, self.session);
        let resp = if method == "GET" { ureq::get(&url).call() } else { ureq::post(&url).send_json(body) };
        resp.unwrap().into_json::<Value>().unwrap()["value"].clone()
    }

    fn js(&self, script: &str) -> Value {
        self.cmd("POST", "execute/sync", json!({"script": script, "args": []}))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = ureq::delete(&format!("{}/session/{}", self.base, self.session)).call();
    }
}

fn points(b: &Browser) -> Value {
    b.js("const s = document.getElementById('chart-status'); return s ? {series: s.dataset.series, points: JSON.parse(s.dataset.points || '{}'), metric: s.dataset.metric} : null;")
}

#[test]
fn the_page_lists_runs_draws_them_and_follows_a_live_run() {
    let s = Scratch::new();
    train_two_runs(&s);
    let port = free_port();
    let server = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["dashboard", "--logdir", "runs", "--port", &port.to_string()])
        .current_dir(s.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _server = Killed(server);
    let url = format!("http://127.0.0.1:{port}/");
    wait_for("the dashboard", Duration::from_secs(20), || ureq::get(&url).call().ok().map(|_| Value::Null));

    let browser = Browser::start(&s.path().join("chrome-profile"));
    browser.cmd("POST", "url", json!({"url": url}));
    let rows = read_metrics(&s.path().join("runs/a/metrics.jsonl")).unwrap().len();
    let state = wait_for("both runs drawn", Duration::from_secs(30), || {
        let p = points(&browser);
        (p["series"] == "2" && p["points"]["a"] == rows && p["points"]["b"] == rows).then_some(p)
    });
    assert_eq!(state["metric"], "train_loss");
    let names = browser.js("return [...document.querySelectorAll('#runs li')].map(li => li.dataset.run);");
    assert_eq!(names, json!(["a", "b"]));
    let drawn = browser.js("return window.ember.chart.series.length;");
    assert_eq!(drawn, json!(3), "x and one series per run, overlaid on one chart");

    let shot = browser.cmd("GET", "screenshot", Value::Null);
    let png = base64::engine::general_purpose::STANDARD.decode(shot.as_str().unwrap()).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let dir = std::env::var_os("EMBER_ARTIFACTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("dashboard.png"), &png).unwrap();
    eprintln!("screenshot: {}", dir.join("dashboard.png").display());

    // A run that is still writing: new steps (and a half-written, then a malformed, line) show up
    // within a few seconds without a reload.
    let path = s.path().join("runs/a/metrics.jsonl");
    let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
    for step in rows + 1..=rows + 3 {
        writeln!(f, "{}", json!({"step": step, "train_loss": 2.0, "lr": 0.001, "grad_norm": 1.0, "tokens_per_sec": 1.0, "mfu": 0.1, "elapsed_s": 9.0})).unwrap();
    }
    writeln!(f, "{{this is not json").unwrap();
    write!(f, "{{\"step\": {}, \"train_lo", rows + 4).unwrap();
    f.flush().unwrap();
    let start = Instant::now();
    wait_for("live update", Duration::from_secs(10), || {
        (points(&browser)["points"]["a"] == rows + 3).then_some(Value::Null)
    });
    eprintln!("live update shown after {:.1} s", start.elapsed().as_secs_f64());
    writeln!(f, "ss\": 1.5}}").unwrap();
    wait_for("the completed line", Duration::from_secs(10), || {
        (points(&browser)["points"]["a"] == rows + 4).then_some(Value::Null)
    });
}

#[test]
fn the_server_stays_inside_the_log_directory() {
    let s = Scratch::new();
    std::fs::create_dir_all(s.path().join("runs/a")).unwrap();
    s.write("runs/a/metrics.jsonl", "{\"step\":1,\"train_loss\":3.0}\n");
    std::fs::create_dir_all(s.path().join("secret")).unwrap();
    s.write("secret/metrics.jsonl", "{\"step\":1,\"train_loss\":0.0}\n");
    s.write("secret/config.toml", "password = 1\n");
    std::os::unix::fs::symlink(s.path().join("secret"), s.path().join("runs/link")).unwrap();
    let port = free_port();
    let server = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["dashboard", "--logdir", "runs", "--port", &port.to_string()])
        .current_dir(s.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Killed(server);
    let base = format!("http://127.0.0.1:{port}");
    wait_for("the dashboard", Duration::from_secs(20), || ureq::get(&base).call().ok().map(|_| Value::Null));
    let runs: Value = ureq::get(&format!("{base}/api/runs")).call().unwrap().into_json().unwrap();
    assert_eq!(runs.as_array().unwrap().iter().map(|r| r["name"].clone()).collect::<Vec<_>>(), [json!("a")]);
    for bad in ["../secret", "link", "/etc", "..", "a/../../secret", "%2e%2e%2fsecret"] {
        for api in ["metrics", "config", "samples"] {
            let code = match ureq::get(&format!("{base}/api/{api}?run={bad}")).call() {
                Err(ureq::Error::Status(code, _)) => code,
                other => panic!("{api}?run={bad}: {:?}", other.map(|r| r.status())),
            };
            assert_eq!(code, 404, "{api}?run={bad}");
        }
    }
    for path in ["/../secret/config.toml", "/assets/../../secret/config.toml", "/etc/passwd"] {
        let code = match ureq::get(&format!("{base}{path}")).call() {
            Err(ureq::Error::Status(code, _)) => code,
            other => panic!("{path}: {:?}", other.map(|r| r.status())),
        };
        assert_eq!(code, 404, "{path}");
    }
    assert!(matches!(ureq::post(&format!("{base}/api/runs")).call(), Err(ureq::Error::Status(405, _))));
    // Loopback only by default: the server said so.
    server.0.kill().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(server.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains(&format!("dashboard: http://127.0.0.1:{port}")), "{err}");
}
