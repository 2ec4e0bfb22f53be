//! Headless Chromium driven over WebDriver (chromedriver), for the tests of ember's web pages, and
//! the process helpers they share.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub struct Killed(pub Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<Value>) -> Value {
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
pub struct Browser {
    base: String,
    session: String,
    _driver: Killed,
}

/// A program named by the environment variable `var`, or the first of `names` on PATH. The browser
/// test needs both programs: when one is missing it fails (it does not skip), since CI installs them.
pub fn find_program(var: &str, names: &[&str]) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "{var}={} is not a file", p.display());
        return p;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    names
        .iter()
        .flat_map(|n| std::env::split_paths(&path).map(move |dir| dir.join(n)))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "none of {names:?} on PATH and {var} not set: install Debian's chromium and chromium-driver \
                 (.ci/run does), or point {var} at the program"
            )
        })
}

impl Browser {
    pub fn start(profile: &Path) -> Browser {
        let driver = find_program("EMBER_CHROMEDRIVER", &["chromedriver"]);
        let chromium = find_program("EMBER_CHROMIUM", &["chromium", "chromium-browser", "google-chrome"]);
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
        let caps = json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": {"binary": chromium.to_string_lossy(), "args": [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--window-size=1300,900", format!("--user-data-dir={}", profile.display())
        ]}}}});
        let resp: Value = ureq::post(&format!("{base}/session")).send_json(caps).unwrap().into_json().unwrap();
        let session = resp["value"]["sessionId"].as_str().unwrap().to_string();
        Browser { base, session, _driver: driver }
    }

    pub fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}/{path}", self.base, self.session);
        let resp = if method == "GET" { ureq::get(&url).call() } else { ureq::post(&url).send_json(body) };
        match resp {
            Ok(r) => r.into_json::<Value>().unwrap()["value"].clone(),
            Err(ureq::Error::Status(code, r)) => {
                panic!("WebDriver {method} {path}: {code}: {}", r.into_string().unwrap_or_default())
            }
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
    }

    pub fn js(&self, script: &str) -> Value {
        self.cmd("POST", "execute/sync", json!({"script": script, "args": []}))
    }

    /// The WebDriver id of the first element matching `css`.
    pub fn element(&self, css: &str) -> String {
        let found = self.cmd("POST", "element", json!({"using": "css selector", "value": css}));
        // The id is the one value of a key named by the WebDriver spec.
        let id = found.as_object().and_then(|o| o.values().next()).and_then(Value::as_str);
        id.unwrap_or_else(|| panic!("no element {css}: {found}")).to_string()
    }

    /// A click on the first element matching `css`, as a user's (the browser checks that it is
    /// visible and not covered).
    pub fn click(&self, css: &str) {
        let id = self.element(css);
        let r = self.cmd("POST", &format!("element/{id}/click"), json!({}));
        assert!(r.is_null(), "clicking {css}: {r}");
    }

    /// A PNG of the window, or of the first element matching `css`.
    pub fn screenshot(&self, css: Option<&str>) -> Vec<u8> {
        use base64::Engine;
        let path = match css {
            Some(css) => format!("element/{}/screenshot", self.element(css)),
            None => "screenshot".to_string(),
        };
        let shot = self.cmd("GET", &path, Value::Null);
        let png = base64::engine::general_purpose::STANDARD.decode(shot.as_str().unwrap()).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        png
    }
}

/// Writes a screenshot to `$EMBER_ARTIFACTS_DIR` (else cargo's temporary folder for tests).
pub fn keep_screenshot(name: &str, png: &[u8]) {
    let dir = std::env::var_os("EMBER_ARTIFACTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), png).unwrap();
    eprintln!("screenshot: {}", dir.join(name).display());
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = ureq::delete(&format!("{}/session/{}", self.base, self.session)).call();
    }
}
