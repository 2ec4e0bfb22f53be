//! Reading run directories: which folders under the log directory are runs, and their metrics as
//! columns, read incrementally as the files grow. Nothing here writes to a run directory.
//!
//! A run is a folder holding `metrics.jsonl` (one JSON object per logged step, numbers and booleans;
//! see `ember_train::metrics`). A half-written last line is kept for the next read; a malformed line
//! is skipped with a warning.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::Serialize;
use serde_json::Value;

const METRICS: &str = "metrics.jsonl";
const SAMPLES: &str = "samples.jsonl";
/// Folders this deep under the log directory are searched for runs.
const MAX_DEPTH: usize = 4;

/// One run's metrics, column by column; `None` where a record lacks the key.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Columns {
    pub rows: usize,
    pub columns: BTreeMap<String, Vec<Option<f64>>>,
}

/// A metric value as read: numbers and booleans count, anything else is skipped.
struct Scalar(Option<f64>);

impl<'de> serde::Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(Some(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(Some(v as f64)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(Some(v as f64)))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(Some(v as u8 as f64)))
            }
            fn visit_str<E>(self, _: &str) -> Result<Scalar, E> {
                Ok(Scalar(None))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Scalar, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Scalar, A::Error> {
                while a.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {}
                Ok(Scalar(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// One metrics line: key and value pairs, keys borrowed from the line where they can be.
type Row<'a> = Vec<(std::borrow::Cow<'a, str>, Scalar)>;

fn parse_row(line: &[u8]) -> Option<Row<'_>> {
    struct RowVisitor;
    impl<'de> serde::de::Visitor<'de> for RowVisitor {
        type Value = Row<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Row<'de>, A::Error> {
            let mut out = Vec::with_capacity(16);
            while let Some(k) = a.next_key::<std::borrow::Cow<'de, str>>()? {
                out.push((k, a.next_value::<Scalar>()?));
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(line);
    let row = serde::Deserializer::deserialize_map(&mut de, RowVisitor).ok()?;
    de.end().ok()?;
    Some(row)
}

impl Columns {
    fn push(&mut self, row: Row<'_>) {
        for (k, Scalar(v)) in row {
            let Some(v) = v else { continue };
            match self.columns.get_mut(k.as_ref()) {
                Some(col) => col.push(Some(v)),
                None => {
                    let mut col = vec![None; self.rows];
                    col.push(Some(v));
                    self.columns.insert(k.into_owned(), col);
                }
            }
        }
        self.rows += 1;
        for col in self.columns.values_mut() {
            if col.len() < self.rows {
                col.resize(self.rows, None);
            }
        }
    }

    /// Rows from `from` on.
    pub fn since(&self, from: usize) -> Columns {
        let from = from.min(self.rows);
        Columns {
            rows: self.rows - from,
            columns: self.columns.iter().map(|(k, v)| (k.clone(), v[from..].to_vec())).collect(),
        }
    }
}

/// A JSON-lines file read as it grows.
#[derive(Debug, Default)]
struct Tail {
    offset: u64,
    partial: Vec<u8>,
    skipped: usize,
}

impl Tail {
    /// Whether the file is now shorter than what was read (rewritten by a resumed run).
    fn truncated(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|m| m.len() < self.offset)
    }

    /// Complete new lines since the last call, each handed to `each` (which says whether it
    /// parsed); starts over if the file shrank (a resumed run truncated it), and says so.
    fn read(&mut self, path: &Path, mut each: impl FnMut(&[u8]) -> bool) -> std::io::Result<bool> {
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        let restarted = len < self.offset;
        if restarted {
            *self = Tail::default();
        }
        if len == self.offset {
            return Ok(restarted);
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::with_capacity((len - self.offset) as usize);
        file.take(len - self.offset).read_to_end(&mut buf)?;
        self.offset += buf.len() as u64;
        let mut data = std::mem::take(&mut self.partial);
        data.extend_from_slice(&buf);
        let complete = data.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        self.partial = data[complete..].to_vec();
        for line in data[..complete].split(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)) {
            if !each(line) {
                self.skipped += 1;
                tracing::warn!("{}: skipping a malformed line ({} bytes)", path.display(), line.len());
            }
        }
        Ok(restarted)
    }
}

#[derive(Debug, Default)]
struct RunData {
    metrics: Columns,
    metrics_tail: Tail,
    samples: Vec<Value>,
    samples_tail: Tail,
}

/// What the run list shows.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub name: String,
    pub rows: usize,
    pub last_step: Option<f64>,
    /// Seconds since the metrics file last changed.
    pub updated_s: f64,
    pub metrics: Vec<String>,
    pub samples: usize,
    pub skipped_lines: usize,
}

/// The runs under a log directory, cached and refreshed on request.
pub struct RunStore {
    root: PathBuf,
    runs: Mutex<BTreeMap<String, Arc<Mutex<RunData>>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}: the log directory does not exist or is not a directory")]
    NoLogDir(PathBuf),
    #[error("no run named `{0}` under the log directory")]
    NoSuchRun(String),
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
}

impl RunStore {
    pub fn new(root: &Path) -> Result<Self, RunError> {
        let root = root.canonicalize().map_err(|_| RunError::NoLogDir(root.into()))?;
        if !root.is_dir() {
            return Err(RunError::NoLogDir(root));
        }
        Ok(Self { root, runs: Mutex::new(BTreeMap::new()) })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Run folders under the root, by name (their path relative to the root, `/`-separated). A
    /// symbolic link is followed only if it stays inside the root.
    pub fn discover(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![(self.root.clone(), 0usize)];
        while let Some((dir, depth)) = stack.pop() {
            let Ok(real) = dir.canonicalize() else { continue };
            if !real.starts_with(&self.root) {
                tracing::warn!("{}: leads outside the log directory, skipped", dir.display());
                continue;
            }
            if real.join(METRICS).is_file() {
                if let Ok(rel) = dir.strip_prefix(&self.root) {
                    let name = rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/");
                    out.push(if name.is_empty() { ".".to_string() } else { name });
                }
            }
            if depth >= MAX_DEPTH {
                continue;
            }
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let p = e.path();
                    if p.is_dir() && !e.file_name().to_string_lossy().starts_with('.') && e.file_name() != "checkpoints"
                    {
                        stack.push((p, depth + 1));
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// The folder of a discovered run; anything else (`..`, absolute paths, links out) is refused.
    /// A name the store already holds was found by an earlier discovery, so only an unknown one
    /// costs a walk of the log directory (a run that started since the last listing).
    fn run_dir(&self, name: &str) -> Result<PathBuf, RunError> {
        let known = self.runs.lock().expect("run store lock").contains_key(name);
        if !known && !self.discover().iter().any(|n| n == name) {
            return Err(RunError::NoSuchRun(name.into()));
        }
        let dir = if name == "." { self.root.clone() } else { self.root.join(name) };
        match dir.canonicalize() {
            Ok(real) if real.starts_with(&self.root) => Ok(dir),
            _ => Err(RunError::NoSuchRun(name.into())),
        }
    }

    fn refresh(&self, name: &str) -> Result<(), RunError> {
        let dir = self.run_dir(name)?;
        self.refresh_at(name, &dir)
    }

    fn refresh_at(&self, name: &str, dir: &Path) -> Result<(), RunError> {
        let run = self.runs.lock().expect("run store lock").entry(name.to_string()).or_default().clone();
        let mut guard = run.lock().expect("run lock");
        let run = &mut *guard;
        let path = dir.join(METRICS);
        if run.metrics_tail.truncated(&path) {
            run.metrics = Columns::default();
        }
        let metrics = &mut run.metrics;
        run.metrics_tail
            .read(&path, |line| match parse_row(line) {
                Some(row) => {
                    metrics.push(row);
                    true
                }
                None => false,
            })
            .map_err(|err| RunError::Io { path: path.clone(), err })?;
        let path = dir.join(SAMPLES);
        let mut samples = Vec::new();
        let restarted = run
            .samples_tail
            .read(&path, |line| match serde_json::from_slice::<Value>(line) {
                Ok(v) if v.is_object() => {
                    samples.push(v);
                    true
                }
                _ => false,
            })
            .map_err(|err| RunError::Io { path: path.clone(), err })?;
        if restarted {
            run.samples.clear();
        }
        run.samples.extend(samples);
        Ok(())
    }

    /// Every run with a summary, all refreshed (runs are read in parallel).
    pub fn summaries(&self) -> Vec<RunSummary> {
        let names = self.discover();
        let dir_of = |name: &str| if name == "." { self.root.clone() } else { self.root.join(name) };
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(names.len().max(1));
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(name) = names.get(i) else { break };
                    if let Err(e) = self.refresh_at(name, &dir_of(name)) {
                        tracing::warn!("{e}");
                    }
                });
            }
        });
        let runs = self.runs.lock().expect("run store lock");
        names
            .iter()
            .filter_map(|name| {
                let run = runs.get(name)?.lock().expect("run lock");
                let updated_s = std::fs::metadata(dir_of(name).join(METRICS))
                    .ok()
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .map_or(0.0, |d| d.as_secs_f64());
                Some(RunSummary {
                    name: name.clone(),
                    rows: run.metrics.rows,
                    last_step: run.metrics.columns.get("step").and_then(|c| c.last().copied().flatten()),
                    updated_s,
                    metrics: run.metrics.columns.keys().cloned().collect(),
                    samples: run.samples.len(),
                    skipped_lines: run.metrics_tail.skipped,
                })
            })
            .collect()
    }

    /// A run's metric columns from row `since` on (refreshed first).
    pub fn metrics(&self, name: &str, since: usize) -> Result<Columns, RunError> {
        self.refresh(name)?;
        let run = self.runs.lock().expect("run store lock")[name].clone();
        let run = run.lock().expect("run lock");
        Ok(run.metrics.since(since))
    }

    pub fn samples(&self, name: &str) -> Result<Vec<Value>, RunError> {
        self.refresh(name)?;
        let run = self.runs.lock().expect("run store lock")[name].clone();
        let samples = run.lock().expect("run lock").samples.clone();
        Ok(samples)
    }

    /// The run's config.toml, as text (empty when it has none).
    pub fn config(&self, name: &str) -> Result<String, RunError> {
        let dir = self.run_dir(name)?;
        Ok(std::fs::read_to_string(dir.join("config.toml")).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn line(step: usize) -> String {
        format!("{{\"step\":{step},\"train_loss\":{},\"lr\":0.001,\"clipped\":false}}\n", 4.0 - step as f64 * 0.01)
    }

    #[test]
    fn reads_incrementally_and_skips_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a")).unwrap();
        let path = dir.path().join("a/metrics.jsonl");
        std::fs::write(&path, format!("{}{}not json\n{}", line(1), line(2), "{\"step\":3,\"train_lo")).unwrap();
        let store = RunStore::new(dir.path()).unwrap();
        assert_eq!(store.discover(), ["a"]);
        let m = store.metrics("a", 0).unwrap();
        assert_eq!(m.rows, 2, "the bad line is skipped and the half line waits");
        assert_eq!(store.summaries()[0].skipped_lines, 1);
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"ss\":3.9}\n").unwrap();
        f.write_all(line(4).as_bytes()).unwrap();
        let m = store.metrics("a", 2).unwrap();
        assert_eq!(m.rows, 2);
        assert_eq!(m.columns["step"], vec![Some(3.0), Some(4.0)]);
        assert_eq!(m.columns["lr"], vec![None, Some(0.001)]);
        // A resumed run truncates the file: the store starts over.
        std::fs::write(&path, line(1)).unwrap();
        assert_eq!(store.metrics("a", 0).unwrap().rows, 1);
    }

    #[test]
    fn names_outside_the_log_directory_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("metrics.jsonl"), line(1)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("runs/a")).unwrap();
        std::fs::write(dir.path().join("runs/a/metrics.jsonl"), line(1)).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("runs/escape")).unwrap();
        let store = RunStore::new(&dir.path().join("runs")).unwrap();
        assert_eq!(store.discover(), ["a"], "the link out is not a run");
        for name in ["escape", "../runs/a", "/etc", "a/../../x", ""] {
            assert!(matches!(store.metrics(name, 0), Err(RunError::NoSuchRun(_))), "{name}");
        }
        assert_eq!(store.metrics("a", 0).unwrap().rows, 1);
        // A run the store knows, whose folder is then swapped for a link out, is refused too.
        std::fs::remove_dir_all(dir.path().join("runs/a")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("runs/a")).unwrap();
        assert!(matches!(store.metrics("a", 0), Err(RunError::NoSuchRun(_))));
    }
}
