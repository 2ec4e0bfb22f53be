//! Reading run directories: which folders under the log directory are runs, and their metrics as
//! columns, read incrementally as the files grow. Nothing here writes to a run directory.
//!
//! A run is a folder holding `metrics.jsonl` (one JSON object per logged step, numbers and booleans;
//! see `ember_train::metrics`). A half-written last line is kept for the next read; a malformed line
//! is skipped with a warning.
//!
//! Every file is opened through [`open_inside`]: a file (or run folder) that is a link leading out
//! of the log directory is treated as absent, with one warning.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use serde::Serialize;
use serde_json::Value;

use crate::columns::{parse_row, Column, Columns, MetricsJson, Table};
use crate::confine::{open_inside, resolve_inside, ConfineError};

const METRICS: &str = "metrics.jsonl";
const SAMPLES: &str = "samples.jsonl";
const CONFIG: &str = "config.toml";
/// Folders this deep under the log directory are searched for runs.
const MAX_DEPTH: usize = 4;
/// A file is read this much at a time, so that a long one costs bounded memory.
const CHUNK: u64 = 4 << 20;
/// A line longer than this is skipped (and counted) instead of being held whole until it ends.
const MAX_LINE: usize = 16 << 20;
/// A config.toml is shown up to this size.
const MAX_CONFIG: u64 = 1 << 20;

/// A lock whose holder panicked is still usable: the data it guards is only a cache of the files,
/// and one failed request must not turn every later one into a panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A JSON-lines file read as it grows.
#[derive(Debug, Default)]
struct Tail {
    offset: u64,
    partial: Vec<u8>,
    skipped: usize,
    /// Inside a line longer than [`MAX_LINE`], dropped up to its end.
    discarding: bool,
    /// When the file last changed, as of the last read.
    modified: Option<SystemTime>,
}

impl Tail {
    /// Complete new lines of `file` (opened at `path`; `None`: absent) since the last call, each
    /// handed to `each` with `into` (`each` says whether the line parsed). If the file shrank (a
    /// resumed run truncated it), starts over, first handing `into` to `restart`.
    fn read<S>(
        &mut self,
        file: Option<File>,
        path: &Path,
        into: &mut S,
        restart: impl FnOnce(&mut S),
        mut each: impl FnMut(&mut S, &[u8]) -> bool,
    ) -> std::io::Result<()> {
        let Some(mut file) = file else { return Ok(()) };
        let meta = file.metadata()?;
        let len = meta.len();
        if len < self.offset {
            *self = Tail::default();
            restart(into);
        }
        self.modified = meta.modified().ok();
        if len == self.offset {
            return Ok(());
        }
        // Up to the length seen now, a chunk at a time: a long file costs one chunk of memory.
        file.seek(SeekFrom::Start(self.offset))?;
        let mut file = file.take(len - self.offset);
        let mut chunk = Vec::with_capacity(CHUNK.min(len - self.offset) as usize);
        loop {
            chunk.clear();
            let n = (&mut file).take(CHUNK).read_to_end(&mut chunk)?;
            if n == 0 {
                return Ok(());
            }
            self.offset += n as u64;
            self.feed(&chunk, path, into, &mut each);
        }
    }

    /// The lines completed by `chunk` (the first one joined to what came before), each handed to
    /// `each`; what follows the last line break is kept for the next chunk.
    fn feed<S>(&mut self, chunk: &[u8], path: &Path, into: &mut S, each: &mut impl FnMut(&mut S, &[u8]) -> bool) {
        let Some(last) = chunk.iter().rposition(|&b| b == b'\n') else {
            return self.keep(chunk, path);
        };
        let (complete, rest) = chunk.split_at(last + 1);
        let mut lines = complete[..last].split(|&b| b == b'\n');
        let first = lines.next().unwrap_or_default();
        if self.discarding {
            // The end of the over-long line, already counted.
            self.discarding = false;
        } else if self.partial.is_empty() {
            self.line(first, path, into, each);
        } else if self.partial.len() + first.len() > MAX_LINE {
            self.partial = Vec::new();
            self.skipped += 1;
            tracing::warn!("{}: skipping a line longer than {MAX_LINE} bytes", path.display());
        } else {
            let mut whole = std::mem::take(&mut self.partial);
            whole.extend_from_slice(first);
            self.line(&whole, path, into, each);
        }
        for line in lines {
            self.line(line, path, into, each);
        }
        self.keep(rest, path);
    }

    fn line<S>(&mut self, line: &[u8], path: &Path, into: &mut S, each: &mut impl FnMut(&mut S, &[u8]) -> bool) {
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        if !each(into, line) {
            self.skipped += 1;
            tracing::warn!("{}: skipping a malformed line ({} bytes)", path.display(), line.len());
        }
    }

    /// Keeps the start of a line that has not ended yet, unless it is over-long (then it is
    /// skipped up to its end, and counted once).
    fn keep(&mut self, rest: &[u8], path: &Path) {
        if self.discarding || rest.is_empty() {
            return;
        }
        if self.partial.len() + rest.len() > MAX_LINE {
            self.partial = Vec::new();
            self.skipped += 1;
            self.discarding = true;
            tracing::warn!("{}: skipping a line longer than {MAX_LINE} bytes", path.display());
        } else {
            self.partial.extend_from_slice(rest);
        }
    }
}

#[derive(Debug, Default)]
struct RunData {
    metrics: Table,
    metrics_tail: Tail,
    samples: Vec<Value>,
    samples_tail: Tail,
    config: Hparams,
}

/// A run's config.toml flattened to `section.key` pairs, re-read when the file changes.
#[derive(Debug, Default)]
struct Hparams {
    /// Modification time and length of the file last read.
    stamp: Option<(Option<SystemTime>, u64)>,
    /// Bumped each time the file is read again, so that the page knows to fetch it.
    version: u64,
    pairs: Vec<(String, Value)>,
    /// `[train] max_steps`: the step at which the run is finished.
    max_steps: Option<f64>,
}

impl Hparams {
    /// Reads `file` again if it changed since the last call (absent: no pairs).
    fn refresh(&mut self, file: Option<File>, path: &Path) {
        let stamp = file.as_ref().and_then(|f| f.metadata().ok()).map(|m| (m.modified().ok(), m.len()));
        if stamp == self.stamp {
            return;
        }
        self.stamp = stamp;
        self.version += 1;
        let mut text = Vec::new();
        if let Some(file) = file {
            if let Err(e) = file.take(MAX_CONFIG).read_to_end(&mut text) {
                tracing::warn!("{}: {e}", path.display());
            }
        }
        let table = match std::str::from_utf8(&text).map(toml::from_str::<toml::Table>) {
            Ok(Ok(table)) => table,
            // A config the trainer is writing (it writes atomically, so rarely) or one that is not
            // TOML: no pairs, and the next change reads it again.
            _ => toml::Table::new(),
        };
        self.pairs.clear();
        flatten("", &table, &mut self.pairs);
        self.max_steps = self.pairs.iter().find(|(k, _)| k == "train.max_steps").and_then(|(_, v)| v.as_f64());
    }
}

/// `table`'s values under dotted keys (`train.lr`); arrays are kept whole.
fn flatten(prefix: &str, table: &toml::Table, out: &mut Vec<(String, Value)>) {
    for (k, v) in table {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            v => out.push((key, toml_to_json(v))),
        }
    }
}

fn toml_to_json(v: &toml::Value) -> Value {
    match v {
        toml::Value::String(s) => Value::String(s.clone()),
        toml::Value::Integer(i) => Value::from(*i),
        toml::Value::Float(f) => {
            serde_json::Number::from_f64(*f).map_or_else(|| Value::String(f.to_string()), Value::Number)
        }
        toml::Value::Boolean(b) => Value::Bool(*b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => Value::Object(t.iter().map(|(k, v)| (k.clone(), toml_to_json(v))).collect()),
    }
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
    /// `[train] max_steps` of the run's config.toml.
    pub max_steps: Option<f64>,
    /// The last step logged is `max_steps`: training ran to its end.
    pub finished: bool,
    /// Changes whenever config.toml does (the page fetches [`RunStore::hparams`] again).
    pub config_version: u64,
}

/// The runs under a log directory, cached and refreshed on request.
pub struct RunStore {
    root: PathBuf,
    runs: Mutex<BTreeMap<String, Arc<Mutex<RunData>>>>,
    /// Threads that read runs in parallel for the run list.
    parallelism: usize,
    /// Paths already warned about (a link out is seen on every refresh).
    warned: Mutex<HashSet<PathBuf>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}: the log directory does not exist or is not a directory")]
    NoLogDir(PathBuf),
    #[error("no run named `{0}` under the log directory")]
    NoSuchRun(String),
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error(transparent)]
    File(#[from] ConfineError),
}

impl RunStore {
    pub fn new(root: &Path) -> Result<Self, RunError> {
        let root = root.canonicalize().map_err(|_| RunError::NoLogDir(root.into()))?;
        if !root.is_dir() {
            return Err(RunError::NoLogDir(root));
        }
        let parallelism = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Self { root, runs: Mutex::new(BTreeMap::new()), parallelism, warned: Mutex::new(HashSet::new()) })
    }

    /// Reads at most `threads` runs at once for the run list (the server keeps it to its own few
    /// threads, so that it never competes with training for every core).
    pub fn with_parallelism(mut self, threads: usize) -> Self {
        self.parallelism = threads.max(1);
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn warn_once(&self, e: &ConfineError) {
        let path = match e {
            ConfineError::Outside(p) | ConfineError::NotAFile(p) => p,
            _ => return,
        };
        if lock(&self.warned).insert(path.clone()) {
            tracing::warn!("{e}: ignored");
        }
    }

    /// `path` opened if it lies inside the log directory; `None` when it is absent, leads outside
    /// or is not a regular file.
    fn open(&self, path: &Path) -> Result<Option<File>, RunError> {
        match open_inside(&self.root, path) {
            Ok(f) => Ok(Some(f)),
            Err(ConfineError::NotFound(_)) => Ok(None),
            Err(e @ (ConfineError::Outside(_) | ConfineError::NotAFile(_))) => {
                self.warn_once(&e);
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether `dir` (resolved, inside the root) holds a metrics file that stays inside the root.
    fn has_metrics(&self, dir: &Path) -> bool {
        match resolve_inside(&self.root, &dir.join(METRICS)) {
            Ok(real) => real.is_file(),
            Err(e) => {
                self.warn_once(&e);
                false
            }
        }
    }

    /// Run folders under the root, by name (their path relative to the root, `/`-separated). A
    /// symbolic link is followed only if it stays inside the root.
    pub fn discover(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![(self.root.clone(), 0usize)];
        while let Some((dir, depth)) = stack.pop() {
            let real = match resolve_inside(&self.root, &dir) {
                Ok(real) => real,
                Err(e) => {
                    self.warn_once(&e);
                    continue;
                }
            };
            if self.has_metrics(&real) {
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
        let known = lock(&self.runs).contains_key(name);
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
        let run = lock(&self.runs).entry(name.to_string()).or_default().clone();
        let mut guard = lock(&run);
        let run = &mut *guard;
        let path = dir.join(METRICS);
        let file = self.open(&path)?;
        run.metrics_tail
            .read(
                file,
                &path,
                &mut run.metrics,
                |m| *m = Table::default(),
                |m, line| match parse_row(line) {
                    Some(row) => {
                        m.push(row);
                        true
                    }
                    None => false,
                },
            )
            .map_err(|err| RunError::Io { path: path.clone(), err })?;
        let path = dir.join(SAMPLES);
        let file = self.open(&path)?;
        run.samples_tail
            .read(
                file,
                &path,
                &mut run.samples,
                |s| s.clear(),
                |s, line| match serde_json::from_slice::<Value>(line) {
                    Ok(v) if v.is_object() => {
                        s.push(v);
                        true
                    }
                    _ => false,
                },
            )
            .map_err(|err| RunError::Io { path: path.clone(), err })?;
        let path = dir.join(CONFIG);
        let file = self.open(&path)?;
        run.config.refresh(file, &path);
        Ok(())
    }

    /// Every run with a summary, all refreshed (runs are read in parallel).
    pub fn summaries(&self) -> Vec<RunSummary> {
        let names = self.discover();
        let dir_of = |name: &str| if name == "." { self.root.clone() } else { self.root.join(name) };
        let workers = self.parallelism.min(names.len().max(1));
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
        let runs = lock(&self.runs);
        names
            .iter()
            .filter_map(|name| {
                let run = lock(runs.get(name)?);
                let updated_s = run
                    .metrics_tail
                    .modified
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .map_or(0.0, |d| d.as_secs_f64());
                let last_step = run.metrics.columns.get("step").and_then(Column::last);
                let max_steps = run.config.max_steps;
                Some(RunSummary {
                    name: name.clone(),
                    rows: run.metrics.rows,
                    last_step,
                    updated_s,
                    metrics: run.metrics.columns.keys().cloned().collect(),
                    samples: run.samples.len(),
                    skipped_lines: run.metrics_tail.skipped,
                    max_steps,
                    finished: matches!((last_step, max_steps), (Some(last), Some(max)) if last >= max),
                    config_version: run.config.version,
                })
            })
            .collect()
    }

    /// A run's metric columns from row `since` on (refreshed first).
    pub fn metrics(&self, name: &str, since: usize) -> Result<Columns, RunError> {
        self.refresh(name)?;
        let run = self.run(name)?;
        let run = lock(&run);
        Ok(run.metrics.since(since))
    }

    /// What [`RunStore::metrics`] returns, as JSON text to be written out a piece at a time.
    pub fn metrics_json(&self, name: &str, since: usize) -> Result<MetricsJson, RunError> {
        self.refresh(name)?;
        let run = self.run(name)?;
        let run = lock(&run);
        Ok(run.metrics.json(since))
    }

    pub fn samples(&self, name: &str) -> Result<Vec<Value>, RunError> {
        self.refresh(name)?;
        let run = self.run(name)?;
        let samples = lock(&run).samples.clone();
        Ok(samples)
    }

    /// The run's config.toml as `section.key` pairs (none when it has no config, or one that is
    /// not TOML).
    pub fn hparams(&self, name: &str) -> Result<Vec<(String, Value)>, RunError> {
        self.refresh(name)?;
        let run = self.run(name)?;
        let pairs = lock(&run).config.pairs.clone();
        Ok(pairs)
    }

    fn run(&self, name: &str) -> Result<Arc<Mutex<RunData>>, RunError> {
        lock(&self.runs).get(name).cloned().ok_or_else(|| RunError::NoSuchRun(name.into()))
    }

    /// The run's config.toml, as text (empty when it has none, or when it leads outside the log
    /// directory; cut at 1 MiB).
    pub fn config(&self, name: &str) -> Result<String, RunError> {
        let dir = self.run_dir(name)?;
        let path = dir.join(CONFIG);
        let Some(file) = self.open(&path)? else { return Ok(String::new()) };
        let mut bytes = Vec::new();
        file.take(MAX_CONFIG).read_to_end(&mut bytes).map_err(|err| RunError::Io { path, err })?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
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
    fn long_lines_span_chunks_and_over_long_ones_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a")).unwrap();
        let path = dir.path().join("a/metrics.jsonl");
        let padded = |step: usize, bytes: usize| format!("{{\"step\":{step},\"pad\":\"{}\"}}\n", "x".repeat(bytes));
        // A line longer than a read chunk, then one longer than MAX_LINE.
        let text = format!("{}{}{}{}", line(1), padded(2, 5 << 20), padded(3, MAX_LINE + 10), line(4));
        // Written in two parts, the cut inside the over-long line: the read waits, then skips it.
        let cut = text.len() - line(4).len() - 1000;
        std::fs::write(&path, &text[..cut]).unwrap();
        let store = RunStore::new(dir.path()).unwrap();
        assert_eq!(store.metrics("a", 0).unwrap().rows, 2);
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(&text.as_bytes()[cut..]).unwrap();
        let m = store.metrics("a", 0).unwrap();
        assert_eq!(m.columns["step"], vec![Some(1.0), Some(2.0), Some(4.0)]);
        assert_eq!(store.summaries()[0].skipped_lines, 1);
        // Written at once: the over-long line outgrows the limit between two chunks.
        std::fs::create_dir_all(dir.path().join("b")).unwrap();
        std::fs::write(dir.path().join("b/metrics.jsonl"), &text).unwrap();
        assert_eq!(store.metrics("b", 0).unwrap().columns["step"], vec![Some(1.0), Some(2.0), Some(4.0)]);
        assert_eq!(store.summaries()[1].skipped_lines, 1);
    }

    #[test]
    fn configs_are_flattened_and_a_run_at_max_steps_is_finished() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a")).unwrap();
        std::fs::write(dir.path().join("a/metrics.jsonl"), format!("{}{}", line(1), line(2))).unwrap();
        let store = RunStore::new(dir.path()).unwrap();
        let summary = &store.summaries()[0];
        assert_eq!((summary.max_steps, summary.finished), (None, false), "no config: not known to be finished");
        assert!(store.hparams("a").unwrap().is_empty());
        let config = "init_from = \"run:x\"\n[train]\nmax_steps = 2\nseed = 7\n[schedule]\nlr = 3e-3\n\
                      [metrics]\nsinks = [\"jsonl\"]\n";
        std::fs::write(dir.path().join("a/config.toml"), config).unwrap();
        let summary = &store.summaries()[0];
        assert_eq!((summary.max_steps, summary.finished), (Some(2.0), true));
        let version = summary.config_version;
        assert_eq!(
            store.hparams("a").unwrap(),
            [
                ("init_from".to_string(), Value::from("run:x")),
                ("metrics.sinks".to_string(), serde_json::json!(["jsonl"])),
                ("schedule.lr".to_string(), Value::from(3e-3)),
                ("train.max_steps".to_string(), Value::from(2)),
                ("train.seed".to_string(), Value::from(7)),
            ]
        );
        // Unchanged: the same version; rewritten (a longer run resumed): read again.
        assert_eq!(store.summaries()[0].config_version, version);
        std::fs::write(dir.path().join("a/config.toml"), config.replace("max_steps = 2", "max_steps = 20")).unwrap();
        let summary = &store.summaries()[0];
        assert_eq!((summary.max_steps, summary.finished), (Some(20.0), false));
        assert!(summary.config_version > version);
        // Not TOML: no pairs, no error.
        std::fs::write(dir.path().join("a/config.toml"), "[train\nmax_steps = ").unwrap();
        assert!(store.hparams("a").unwrap().is_empty());
        assert!(!store.summaries()[0].finished);
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
