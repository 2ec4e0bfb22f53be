//! TensorBoard event files read back by an independent reader, and `ember dashboard` driven by a
//! real headless Chromium through ChromeDriver (Debian's chromium and chromium-driver; `.ci/run`
//! installs them).

mod browser;
mod common;

/// The tests of this file one at a time: the abuse tests time normal requests against a 1 s bound,
/// which a training run or a browser in a parallel test would starve on a 2-core machine (the
/// dashboard runs at a low CPU priority by design).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use browser::{free_port, keep_screenshot, wait_for, Browser, Killed};
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
    let _serial = serial();
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
    assert_eq!(scalars["loss/val"].keys().copied().collect::<Vec<_>>(), [0, 3, 6], "step 0's evaluation too");
    assert_eq!(texts.keys().copied().collect::<Vec<_>>(), [3, 6], "samples at evaluations");
    assert!(texts[&6].starts_with("```\n"), "{}", texts[&6]);
}

// --- The dashboard in a browser. ---

/// The rows of a metrics.jsonl as JSON objects, read here (not through the trainer's types).
fn metric_rows(path: &Path) -> Vec<serde_json::Map<String, Value>> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()?.as_object().cloned()).collect()
}

/// How many rows hold `key`.
fn count(rows: &[serde_json::Map<String, Value>], key: &str) -> usize {
    rows.iter().filter(|r| r.get(key).is_some_and(Value::is_number)).count()
}

/// The lowest `val_loss` after a training step (the trainer's best/: never step 0's) and its step.
fn best_val(rows: &[serde_json::Map<String, Value>]) -> (f64, u64) {
    rows.iter()
        .filter_map(|r| Some((r.get("val_loss")?.as_f64()?, r.get("step")?.as_u64()?)))
        .filter(|&(_, step)| step > 0)
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .expect("a val_loss")
}

/// What the `loss` chart should hold: each run's train_loss, eval_train_loss and val_loss, as
/// `{"RUN KIND": points}`.
fn loss_points(runs: &[(&str, &Vec<serde_json::Map<String, Value>>)]) -> Value {
    let mut want = serde_json::Map::new();
    for (run, rows) in runs {
        for (kind, key) in [("train", "train_loss"), ("eval_train", "eval_train_loss"), ("val", "val_loss")] {
            if count(rows, key) > 0 {
                want.insert(format!("{run} {kind}"), count(rows, key).into());
            }
        }
    }
    Value::Object(want)
}

/// The chart `name`'s drawn series: `{series, points: {label: count}, keys}`, or null.
fn card(b: &Browser, name: &str) -> Value {
    b.js(&format!(
        "const c = document.querySelector('#grid .card[data-chart=\"{name}\"]'); \
         return c ? {{series: Number(c.dataset.series), points: JSON.parse(c.dataset.points || '{{}}'), \
         keys: c.dataset.keys.split(','), width: c.getBoundingClientRect().width}} : null;"
    ))
}

/// `ember dashboard --logdir runs --port PORT` in `s`.
fn serve_dashboard(s: &Scratch, port: u16) -> Killed {
    let server = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["dashboard", "--logdir", "runs", "--port", &port.to_string()])
        .current_dir(s.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/");
    wait_for("the dashboard", Duration::from_secs(20), || ureq::get(&url).call().ok().map(|_| Value::Null));
    Killed(server)
}

#[test]
fn the_grid_overlays_train_and_val_of_two_runs_and_the_table_compares_their_configs() {
    let _serial = serial();
    let s = Scratch::new();
    train_two_runs(&s);
    // A sample with a line far wider than its box (a chat template's turn without a break).
    let long = format!("<|im_start|>user\n{}<|im_end|>\n", "w".repeat(3000));
    let mut f = std::fs::OpenOptions::new().append(true).open(s.path().join("runs/a/samples.jsonl")).unwrap();
    writeln!(f, "{}", json!({"step": 7, "elapsed_s": 1.0, "prompt": long, "text": "x".repeat(2000)})).unwrap();
    let port = free_port();
    let _server = serve_dashboard(&s, port);
    let browser = Browser::start(&s.path().join("chrome-profile"));
    browser.cmd("POST", "url", json!({"url": format!("http://127.0.0.1:{port}/")}));

    // One chart per scalar, train and val of both runs on `loss`, in the runs' colours.
    let (a, b) =
        (metric_rows(&s.path().join("runs/a/metrics.jsonl")), metric_rows(&s.path().join("runs/b/metrics.jsonl")));
    let want = loss_points(&[("a", &a), ("b", &b)]);
    assert!(count(&a, "val_loss") >= 2 && want.get("b train").is_some(), "{want}");
    let loss = wait_for("train and val of both runs on one chart", Duration::from_secs(30), || {
        let c = card(&browser, "loss");
        (c["points"] == want).then_some(c)
    });
    assert_eq!(loss["series"], want.as_object().unwrap().len());
    let mut keys = vec!["train_loss"];
    if want.get("a eval_train").is_some() {
        keys.push("eval_train_loss");
    }
    keys.push("val_loss");
    assert_eq!(loss["keys"], json!(keys));
    let charts = browser.js("return document.getElementById('grid').dataset.charts.split(',');");
    assert_eq!(charts[0], "loss", "{charts}");
    let mut shown: Vec<String> = browser
        .js("return [...document.querySelectorAll('#grid .card')].flatMap(c => c.dataset.keys.split(','));")
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    shown.sort();
    let mut scalars: Vec<String> = a.iter().chain(&b).flat_map(|r| r.keys().cloned()).collect();
    scalars.retain(|k| k != "step" && k != "elapsed_s");
    scalars.sort();
    scalars.dedup();
    assert!(scalars.len() >= 8, "{scalars:?}");
    assert_eq!(shown, scalars, "every scalar on a chart, once");
    let lines = browser.js(
        "const u = window.ember.charts.get('loss').plot; \
         return u.series.slice(1).map((s, i) => ({label: s.label, stroke: s.stroke(u, i + 1), dash: s.dash || null}));",
    );
    let colour = |run: &str| browser.js(&format!("return window.ember.runs.get('{run}').color;"));
    let (ca, cb) = (colour("a"), colour("b"));
    assert_ne!(ca, cb);
    for line in lines.as_array().unwrap() {
        let label = line["label"].as_str().unwrap();
        assert_eq!(&line["stroke"], if label.starts_with("a ") { &ca } else { &cb }, "{line}");
        assert_eq!(line["dash"].is_array(), !label.ends_with(" train"), "train solid, the evaluations dashed: {line}");
    }
    let legend = browser.js("return document.getElementById('legend').textContent;");
    for word in ["a", "b", "train", "val"] {
        assert!(legend.as_str().unwrap().contains(word), "{legend}");
    }
    keep_screenshot("dashboard.png", &browser.screenshot(None));

    // A click on a chart's title enlarges it (above the others, the width of the grid); another
    // puts it back.
    let small = card(&browser, "lr")["width"].as_f64().unwrap();
    browser.click("#grid .card[data-chart='loss'] .card-head");
    let big = wait_for("the loss chart enlarged", Duration::from_secs(5), || {
        let c = card(&browser, "loss");
        (c["width"].as_f64().unwrap() > 2.0 * small).then_some(c)
    });
    assert_eq!(browser.js("return document.getElementById('grid').dataset.enlarged;"), "loss");
    assert_eq!(big["points"], want, "the same points, larger");
    let legend_rows =
        browser.js("return window.ember.charts.get('loss').plot.root.querySelectorAll('.u-legend .u-series').length;");
    assert_eq!(legend_rows, want.as_object().unwrap().len() + 1, "the enlarged chart has a legend of its series");
    keep_screenshot("dashboard-enlarged.png", &browser.screenshot(None));
    browser.click("#grid .card[data-chart='loss'] .card-head");
    wait_for("the loss chart back in the grid", Duration::from_secs(5), || {
        ((card(&browser, "loss")["width"].as_f64().unwrap() - small).abs() < 2.0).then_some(Value::Null)
    });

    // The table: what differs between the two configs (the seed), and each run's best val loss.
    let table = wait_for("the hparams table", Duration::from_secs(10), || {
        let t = browser.js(
            "return {heads: [...document.querySelectorAll('#hparams th')].map(t => t.textContent), \
             rows: Object.fromEntries([...document.querySelectorAll('#hparams tbody tr')].map(tr => [tr.dataset.run, \
             Object.fromEntries([...tr.querySelectorAll('td[data-key]')].map(td => [td.dataset.key, td.textContent]))]))};",
        );
        (t["rows"]["a"]["train.seed"] == "7").then_some(t)
    });
    assert_eq!(table["heads"], json!(["run", "state", "step", "best val_loss", "at step", "train.seed"]));
    assert_eq!(table["rows"]["b"]["train.seed"], "8");
    for (run, rows) in [("a", &a), ("b", &b)] {
        let (loss, step) = best_val(rows);
        assert_eq!(table["rows"][run]["best_val_loss"], format!("{loss:.4}"), "{run}");
        assert_eq!(table["rows"][run]["best_val_step"], step.to_string(), "{run}");
    }
    let states = browser.js("return [...document.querySelectorAll('#runs li')].map(li => li.dataset.state);");
    assert_eq!(states, json!(["finished", "finished"]), "both ran to max_steps");
    keep_screenshot("dashboard-hparams.png", &browser.screenshot(Some("#compare")));
    browser.click("#hparams-all");
    let all = wait_for("every config key", Duration::from_secs(5), || {
        let v = browser.js("return [...document.querySelectorAll('#hparams th')].map(t => t.textContent);");
        (v.as_array().unwrap().len() > 20).then_some(v)
    });
    assert!(all.as_array().unwrap().contains(&json!("model.d_model")), "{all}");

    // Samples wrap inside their boxes.
    let overflow = browser.js(
        "return [...document.querySelectorAll('#samples pre')].map(p => ({over: p.scrollWidth - p.clientWidth, \
         right: p.getBoundingClientRect().right, page: document.documentElement.clientWidth, height: p.clientHeight}));",
    );
    let boxes = overflow.as_array().unwrap();
    assert!(boxes.len() >= 2, "{overflow}");
    for b in boxes {
        assert!(b["over"].as_f64().unwrap() <= 0.0, "a sample wider than its box: {b}");
        assert!(b["right"].as_f64().unwrap() <= b["page"].as_f64().unwrap(), "a sample past the page: {b}");
    }
    assert!(boxes[0]["height"].as_f64().unwrap() > 60.0, "the long line wrapped: {}", boxes[0]);

    // A run that is still writing: new steps (and a half-written, then a malformed, line) show up
    // within a few seconds without a reload.
    let train_a = count(&a, "train_loss");
    let path = s.path().join("runs/a/metrics.jsonl");
    let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
    let last = a.last().unwrap()["step"].as_u64().unwrap();
    for step in last + 1..=last + 3 {
        writeln!(f, "{}", json!({"step": step, "train_loss": 2.0, "lr": 0.001, "grad_norm": 1.0, "tokens_per_sec": 1.0, "mfu": 0.1, "elapsed_s": 9.0})).unwrap();
    }
    writeln!(f, "{{this is not json").unwrap();
    write!(f, "{{\"step\": {}, \"train_lo", last + 4).unwrap();
    f.flush().unwrap();
    let start = Instant::now();
    wait_for("live update", Duration::from_secs(10), || {
        (card(&browser, "loss")["points"]["a train"] == train_a + 3).then_some(Value::Null)
    });
    eprintln!("live update shown after {:.1} s", start.elapsed().as_secs_f64());
    writeln!(f, "ss\": 1.5}}").unwrap();
    wait_for("the completed line", Duration::from_secs(10), || {
        (card(&browser, "loss")["points"]["a train"] == train_a + 4).then_some(Value::Null)
    });
}

/// The page's view of who serves it and of run `run`: `{server, text, state}`.
fn serving(b: &Browser, run: &str) -> Value {
    b.js(&format!(
        "const li = document.querySelector('#runs li[data-run=\"{run}\"]'); \
         return {{server: document.body.dataset.server || '', text: document.getElementById('server').textContent, \
         status: document.getElementById('logdir-status').textContent, state: li ? li.dataset.state : null, \
         final: !!window.ember.finalFetched}};"
    ))
}

#[test]
fn the_page_outlives_the_trainer_that_served_it() {
    let _serial = serial();
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    // About 3 s of training on a CPU: long enough for the page to open while it runs.
    let config = tiny_config("")
        .replace("max_steps = 6", "max_steps = 3000")
        .replace("eval_interval = 3", "eval_interval = 750")
        .replace("log_interval = 1", "log_interval = 50")
        .replace("checkpoint_interval = 3", "checkpoint_interval = 0");
    assert!(config.contains("max_steps = 3000") && config.contains("checkpoint_interval = 0"), "{config}");
    s.write("long.toml", &config);
    let browser = Browser::start(&s.path().join("chrome-profile"));
    let port = free_port();
    let log = s.path().join("train.log");
    let trainer = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["train", "--config", "long.toml", "--run-dir", "runs/t", "--dashboard"])
        .args(["--dashboard-port", &port.to_string()])
        .current_dir(s.path())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut trainer = Killed(trainer);
    let url = format!("http://127.0.0.1:{port}/");
    wait_for("the trainer's dashboard", Duration::from_secs(20), || ureq::get(&url).call().ok().map(|_| Value::Null));
    browser.cmd("POST", "url", json!({"url": url}));
    let live = wait_for("the run live, served by its trainer", Duration::from_secs(10), || {
        let v = serving(&browser, "t");
        (v["server"] == "trainer" && v["state"] == "live").then_some(v)
    });
    assert!(live["text"].as_str().unwrap().contains("served by the trainer of run t"), "{live}");

    let start = Instant::now();
    let status = loop {
        if let Some(status) = trainer.0.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "training did not end");
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{log}");
    assert!(log.contains("`ember dashboard --logdir runs` keeps browsing"), "{log}");

    // The trainer answered until the page had the final evaluation; then the page kept it all and
    // says who served it.
    let rows = metric_rows(&s.path().join("runs/t/metrics.jsonl"));
    let want = loss_points(&[("t", &rows)]);
    assert_eq!(count(&rows, "val_loss"), 5, "steps 0, 750, …, 3000: {rows:?}");
    let ended = wait_for("the page after its server exited", Duration::from_secs(10), || {
        let v = serving(&browser, "t");
        (v["server"] == "trainer-exited" && card(&browser, "loss")["points"] == want).then_some(v)
    });
    assert_eq!(ended["state"], "finished", "{ended}");
    assert_eq!(ended["final"], true, "the page fetched once more after training ended: {ended}");
    let text = ended["text"].as_str().unwrap();
    assert!(
        text.contains("served by the trainer of run t — it has exited")
            && text.contains("ember dashboard --logdir runs"),
        "{text}"
    );
    // A poll later the server is gone for good: still no error, still the same charts.
    std::thread::sleep(Duration::from_millis(2500));
    let later = serving(&browser, "t");
    assert_eq!(later["server"], "trainer-exited", "{later}");
    assert!(!later["status"].as_str().unwrap().contains("error"), "{later}");
    assert_eq!(card(&browser, "loss")["points"], want);
    let table = browser
        .js("return document.querySelector('#hparams tr[data-run=\"t\"] td[data-key=\"best_val_loss\"]').textContent;");
    assert_eq!(table, format!("{:.4}", best_val(&rows).0));
    keep_screenshot("dashboard-trainer-exited.png", &browser.screenshot(None));

    // `ember dashboard` on the same port: the page carries on with it.
    let _server = serve_dashboard(&s, port);
    let back = wait_for("the page served by ember dashboard", Duration::from_secs(10), || {
        let v = serving(&browser, "t");
        (v["server"] == "dashboard").then_some(v)
    });
    assert_eq!(back["state"], "finished");
    assert!(back["text"].as_str().unwrap().contains("served by ember dashboard"), "{back}");
    assert_eq!(card(&browser, "loss")["points"], want);
}

#[test]
fn the_server_stays_inside_the_log_directory() {
    let _serial = serial();
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

// --- The dashboard under abuse: the `ember dashboard` binary as a child process, its memory read
// from /proc. All traffic stays on 127.0.0.1, bounded in count and time. ---

const MB: f64 = (1 << 20) as f64;

/// `ember dashboard --logdir runs` in `s`, its log in a file (a pipe nobody reads could fill up).
struct Served {
    child: Killed,
    port: u16,
    log: PathBuf,
}

impl Served {
    fn start(s: &Scratch) -> Served {
        let port = free_port();
        let log = s.path().join(format!("dashboard-{port}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(["dashboard", "--logdir", "runs", "--port", &port.to_string()])
            .current_dir(s.path())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let served = Served { child: Killed(child), port, log };
        wait_for("the dashboard", Duration::from_secs(20), || {
            (raw(port, &get_request(port, "/")).0 == Some(200)).then_some(Value::Null)
        });
        served
    }

    fn pid(&self) -> u32 {
        self.child.0.id()
    }

    /// Resident memory, bytes.
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("the server is gone");
        let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).expect("VmRSS");
        kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
    }

    /// Open file descriptors (connections, mostly).
    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map_or(0, |d| d.count())
    }

    fn assert_alive(&mut self, case: &str) {
        let status = self.child.0.try_wait().unwrap();
        assert!(status.is_none(), "{case}: the server exited ({status:?}):\n{}", self.log());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn get_request(port: u16, path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
}

fn connect(port: u16) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Sends `request` and reads the answer to its end: the status (`None`: no answer) and the bytes.
fn raw(port: u16, request: &str) -> (Option<u16>, Vec<u8>) {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return (None, Vec::new()) };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    if s.write_all(request.as_bytes()).is_err() {
        return (None, Vec::new());
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    while let Ok(n) = std::io::Read::read(&mut s, &mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    let status = std::str::from_utf8(out.get(9..12).unwrap_or_default()).ok().and_then(|s| s.parse().ok());
    (status, out)
}

/// A normal request (the run list the page polls): answered with 200 within a second. Its time.
fn normal(srv: &Served, case: &str) -> Duration {
    let start = Instant::now();
    let (status, body) = raw(srv.port, &get_request(srv.port, "/api/runs"));
    let took = start.elapsed();
    assert_eq!(status, Some(200), "{case}: {}", String::from_utf8_lossy(&body));
    assert!(took < Duration::from_secs(1), "{case}: a normal request took {took:?}");
    took
}

/// Normal requests while abuse goes on: 20 of them, each within a second; the median and the
/// slowest.
fn under_load(srv: &Served, case: &str) -> (Duration, Duration) {
    let mut times: Vec<Duration> = (0..20).map(|_| normal(srv, case)).collect();
    times.sort();
    (times[10], times[19])
}

/// After the abusive connections closed: alive, answering within a second, and back within 50 MB
/// of the resident memory it had before (polled for up to 5 s). The memory then.
fn recovered(srv: &mut Served, baseline: u64, case: &str) -> u64 {
    srv.assert_alive(case);
    normal(srv, case);
    let start = Instant::now();
    loop {
        let rss = srv.rss();
        if rss <= baseline + 50 * (1 << 20) {
            srv.assert_alive(case);
            return rss;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{case}: resident memory {:.0} MB, {:.0} MB before",
            rss as f64 / MB,
            baseline as f64 / MB
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One line of figures per case (experiments/reliability-dashboard.md keeps them).
fn report(case: &str, held: usize, before: u64, during: u64, after: u64, latency: (Duration, Duration)) {
    eprintln!(
        "abuse | {case:<44} | {held:>5} | {:>6.1} | {:>6.1} | {:>6.1} | {:>6.1} / {:>6.1} ms",
        before as f64 / MB,
        during as f64 / MB,
        after as f64 / MB,
        latency.0.as_secs_f64() * 1e3,
        latency.1.as_secs_f64() * 1e3
    );
}

/// The soft limit on this process's open files, raised to the hard limit first where `prlimit`
/// can (best effort: the count of connections below adapts to what is allowed).
fn raise_fd_limit() -> usize {
    let read = || {
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
        let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_string();
        let fields: Vec<String> = line["Max open files".len()..].split_whitespace().map(String::from).collect();
        (fields[0].clone(), fields[1].clone())
    };
    let (_, hard) = read();
    let _ = Command::new("prlimit")
        .args(["--pid", &std::process::id().to_string(), &format!("--nofile={hard}:{hard}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    read().0.parse().unwrap_or(usize::MAX)
}

/// Runs `runs/a` (small, with links out of the log directory), `runs/leak` (a metrics file that is
/// a link out) and `runs/big` (about 14 MB of metrics JSON), and the secrets outside.
fn abuse_runs(s: &Scratch) {
    std::fs::create_dir_all(s.path().join("runs/a")).unwrap();
    std::fs::create_dir_all(s.path().join("runs/leak")).unwrap();
    std::fs::create_dir_all(s.path().join("runs/big")).unwrap();
    std::fs::create_dir_all(s.path().join("secret")).unwrap();
    s.write("secret/config.toml", "password = \"hunter2\"\n");
    s.write("secret/metrics.jsonl", "{\"step\":1,\"train_loss\":0.0,\"hunter2\":1}\n");
    s.write("secret/samples.jsonl", "{\"step\":1,\"text\":\"hunter2\"}\n");
    s.write("runs/a/metrics.jsonl", "{\"step\":1,\"train_loss\":3.0}\n{\"step\":2,\"train_loss\":2.9}\n");
    let link = |target: &str, at: &str| std::os::unix::fs::symlink(s.path().join(target), s.path().join(at)).unwrap();
    link("secret/config.toml", "runs/a/config.toml");
    link("secret/samples.jsonl", "runs/a/samples.jsonl");
    link("secret/metrics.jsonl", "runs/leak/metrics.jsonl");
    let mut big = std::io::BufWriter::new(std::fs::File::create(s.path().join("runs/big/metrics.jsonl")).unwrap());
    for step in 1..=250_000 {
        writeln!(
            big,
            "{{\"step\":{step},\"train_loss\":{:.6},\"lr\":0.001,\"grad_norm\":0.8123,\"step_ms\":143.2,\"tokens_per_sec\":5362.1,\"mfu\":0.1935,\"elapsed_s\":{:.3}}}",
            4.0 - step as f64 * 1e-5,
            step as f64 * 0.143
        )
        .unwrap();
    }
    big.flush().unwrap();
}

#[test]
fn the_dashboard_survives_abuse() {
    let _serial = serial();
    let s = Scratch::new();
    abuse_runs(&s);
    let mut srv = Served::start(&s);
    let port = srv.port;
    eprintln!(
        "abuse | case | server fds during | RSS before MB | during MB | after MB | normal request during, median / max"
    );
    // Warm: every run read once (the big one's columns stay cached), so the baseline holds them.
    let (status, big) = raw(port, &get_request(port, "/api/metrics?run=big"));
    assert_eq!(status, Some(200));
    assert!(big.len() > 12 << 20, "{} bytes", big.len());
    normal(&srv, "warm-up");
    let baseline = srv.rss();

    // 1. A body announced as an exabyte: refused unread, at once.
    let before = srv.rss();
    let start = Instant::now();
    let (status, _) = raw(
        port,
        &format!("GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 1000000000000000000\r\n\r\n"),
    );
    assert_eq!(status, Some(413));
    assert!(start.elapsed() < Duration::from_secs(1), "413 after {:?}", start.elapsed());
    let during = srv.rss();
    let latency = under_load(&srv, "huge Content-Length");
    let after = recovered(&mut srv, before, "huge Content-Length");
    report("GET with Content-Length 10^18", 1, before, during, after, latency);

    // 2. Idle connections, as many as 2,000 at once (fewer if this process may not open them).
    let limit = raise_fd_limit();
    let n = 2000.min(limit.saturating_sub(200));
    eprintln!("abuse | opening {n} idle connections (open files limit {limit})");
    assert!(n >= 500, "only {n} connections possible");
    let before = srv.rss();
    let idle: Vec<_> = (0..n).map(|_| connect(port)).collect();
    std::thread::sleep(Duration::from_millis(500));
    let (held, during) = (srv.fds(), srv.rss());
    let latency = under_load(&srv, "idle connections");
    drop(idle);
    let after = recovered(&mut srv, before, "idle connections");
    report(&format!("{n} idle connections"), held, before, during, after, latency);

    // 3. Heads that announce a body that never comes, and heads that never end.
    let before = srv.rss();
    let mut slow = Vec::new();
    for i in 0..300 {
        let mut c = connect(port);
        let head = match i % 3 {
            0 => format!("GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100\r\n\r\n"),
            1 => format!("POST /api/runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 1000000\r\n\r\n"),
            _ => format!("GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: "),
        };
        c.write_all(head.as_bytes()).unwrap();
        slow.push(c);
    }
    std::thread::sleep(Duration::from_millis(500));
    let (held, during) = (srv.fds(), srv.rss());
    let latency = under_load(&srv, "slow clients");
    drop(slow);
    let after = recovered(&mut srv, before, "slow clients");
    report("300 bodies that never come / endless heads", held, before, during, after, latency);

    // 4. Clients that ask for a large answer and never read it.
    let before = srv.rss();
    let stuck: Vec<_> = (0..16)
        .map(|_| {
            let mut c = connect(port);
            c.write_all(format!("GET /api/metrics?run=big HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
                .unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let (held, during) = (srv.fds(), srv.rss());
    let latency = under_load(&srv, "unread answers");
    drop(stuck);
    let after = recovered(&mut srv, before, "unread answers");
    report("16 unread 14 MB /api/metrics answers", held, before, during, after, latency);

    // 5. Another site's name (DNS rebinding).
    for host in [format!("evil.example:{port}"), "127.0.0.1.nip.io".into()] {
        let (status, body) = raw(port, &format!("GET /api/runs HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"));
        assert_eq!(status, Some(403), "{host}: {}", String::from_utf8_lossy(&body));
    }
    let (status, _) =
        raw(port, &format!("GET /api/runs HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n"));
    assert_eq!(status, Some(200));

    // 6. Files that are links out of the log directory.
    let text = |path: &str| {
        let (status, body) = raw(port, &get_request(port, path));
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    let (status, runs) = text("/api/runs");
    assert_eq!(status, Some(200));
    assert!(runs.contains("\"name\":\"a\"") && !runs.contains("\"name\":\"leak\""), "{runs}");
    for path in ["/api/config?run=a", "/api/samples?run=a", "/api/metrics?run=leak", "/api/config?run=leak"] {
        let (status, body) = text(path);
        assert!(!body.contains("hunter2"), "{path}: {body}");
        assert!(matches!(status, Some(200 | 404)), "{path}: {status:?}");
    }
    assert_eq!(text("/api/metrics?run=leak").0, Some(404));
    let after = recovered(&mut srv, baseline, "links out");
    report("links out of the log directory", 0, baseline, after, after, under_load(&srv, "links out"));
}

#[test]
fn the_dashboard_outlives_running_out_of_file_descriptors() {
    let _serial = serial();
    let s = Scratch::new();
    abuse_runs(&s);
    let mut srv = Served::start(&s);
    let port = srv.port;
    normal(&srv, "start");
    let baseline = srv.rss();
    // Lower the running server's limit, as if training had taken the other descriptors.
    let fds = srv.fds();
    let limit = fds + 24;
    let lowered = Command::new("prlimit")
        .args(["--pid", &srv.pid().to_string(), &format!("--nofile={limit}:{limit}")])
        .status()
        .expect("prlimit (util-linux)");
    assert!(lowered.success());
    let crowd: Vec<_> = (0..200).map(|_| connect(port)).collect();
    std::thread::sleep(Duration::from_millis(500));
    let (held, during) = (srv.fds(), srv.rss());
    assert!(held <= limit, "{held} descriptors over the limit {limit}");
    let latency = under_load(&srv, "out of descriptors");
    srv.assert_alive("out of descriptors");
    let log = srv.log();
    assert!(log.contains("cannot accept a connection") && log.contains("Too many open files"), "{log}");
    drop(crowd);
    let after = recovered(&mut srv, baseline, "out of descriptors");
    report(&format!("200 connections at a limit of {limit} files"), held, baseline, during, after, latency);
}

#[test]
fn training_goes_on_when_the_dashboard_cannot_start() {
    let _serial = serial();
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &tiny_config(""));
    // The port is taken: the dashboard cannot listen, and says so; training does not mind.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let o =
        s.ember(&["train", "--config", "tiny.toml", "--run-dir", "runs/t", "--dashboard", "--dashboard-port", &port]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("no dashboard"), "{}", stderr(&o));
    assert_eq!(read_metrics(&s.path().join("runs/t/metrics.jsonl")).unwrap().len(), 6);
}
