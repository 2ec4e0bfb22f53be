//! The bad-input catalogue: every case runs the real `ember` binary on one bad input and asserts a
//! clean refusal — a non-zero exit that is neither a panic (101) nor an abort (134, or death by a
//! signal), a message naming the offending input, and every file it was given unchanged (no file
//! outside ember's cache is created, changed or removed). One file per area.

#[path = "../common.rs"]
mod common;

mod bench;
mod checkpoint;
mod config;
mod dashboard;
mod data;
mod hf;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use common::*;

/// Every file under `root` but ember's download/prepare cache, with its contents.
fn snapshot(root: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if rel == "cache" {
                continue;
            }
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                out.insert(format!("{rel}/"), Vec::new());
                walk(&p, root, out);
            } else {
                out.insert(rel, std::fs::read(&p).unwrap_or_default());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The paths whose contents differ between two snapshots.
fn changed_files(before: &BTreeMap<String, Vec<u8>>, after: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Recording mode (`$EMBER_CATALOGUE` names a file): appends what one case did as a JSON line,
/// asserting nothing, so that a run against another binary (`$EMBER_BIN`) goes through every case.
/// See `experiments/catalogue_report.py`.
fn record(path: &std::ffi::OsStr, args: &[&str], needles: &[&str], o: &Output, changed: &[String]) {
    use std::io::Write;
    use std::os::unix::process::ExitStatusExt;
    let err = stderr(o);
    let line = serde_json::json!({
        "test": std::thread::current().name().unwrap_or(""),
        "args": args,
        "needles": needles,
        "exit": o.status.code(),
        "signal": o.status.signal().is_some(),
        "signal_number": o.status.signal(),
        "panicked": err.contains("panicked"),
        "named": needles.iter().all(|n| err.contains(n)),
        "files_unchanged": changed.is_empty(),
        "changed": changed,
        "stderr_head": err.chars().take(200).collect::<String>(),
        "stderr_tail": err.chars().rev().take(200).collect::<Vec<_>>().into_iter().rev().collect::<String>(),
    });
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("open $EMBER_CATALOGUE");
    f.write_all(format!("{line}\n").as_bytes()).expect("write $EMBER_CATALOGUE");
}

/// Runs `ember args` in `s` and asserts a clean refusal that names every one of `needles`, with the
/// scratch folder unchanged. Returns the output for further checks. With `$EMBER_CATALOGUE` set it
/// records the case there instead of asserting (see [`record`]).
pub fn refuse(s: &Scratch, args: &[&str], needles: &[&str]) -> Output {
    let before = snapshot(s.path());
    let o = s.ember(args);
    if let Some(path) = std::env::var_os("EMBER_CATALOGUE").filter(|p| !p.is_empty()) {
        let after = snapshot(s.path());
        record(&path, args, needles, &o, &changed_files(&before, &after));
        return o;
    }
    let err = stderr(&o);
    let code = o.status.code();
    assert!(code.is_some(), "{args:?}: killed by a signal\n{err}");
    assert!(!matches!(code, Some(0 | 101 | 134)), "{args:?}: exit code {code:?}\n{err}");
    assert!(!err.contains("panicked"), "{args:?}: panicked\n{err}");
    for needle in needles {
        assert!(err.contains(needle), "{args:?}: stderr lacks `{needle}`:\n{err}");
    }
    let after = snapshot(s.path());
    if before != after {
        let changed = changed_files(&before, &after);
        panic!("{args:?}: files changed: {changed:?}\n{err}");
    }
    o
}

/// A scratch folder with the corpus and `config` written as `cfg.toml`.
pub fn with_config(config: &str) -> Scratch {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", config);
    s
}

/// A scratch folder holding a finished tiny run in `runs/cfg` (2 steps).
pub fn with_run() -> Scratch {
    let s = with_config(&tiny_config("").replace("max_steps = 6", "max_steps = 2"));
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    s
}
