//! What a benchmark task is: where its items are, how an item becomes the texts the model scores,
//! and how its scores become metrics, each as lm-evaluation-harness's task definition says.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{DocError, EvalError};
use crate::generate::Generation;
use crate::pyrandom::PyRandom;

/// One item, as the harness's `doc_to_text` / `doc_to_choice` / `doc_to_target` make it.
#[derive(Debug, Clone, PartialEq)]
pub struct Doc {
    pub query: Query,
    /// The continuations scored: the choices of a multiple-choice item, the one target of a
    /// log-likelihood item or of an item whose choices are its contexts ([`Query::PerChoice`]).
    pub continuations: Vec<String>,
    /// The index of the right choice.
    pub gold: usize,
    /// What the item shows as a few-shot exemplar: its text and its answer.
    pub shot: (String, String),
    /// A group within the task that draws its own exemplars and description (MMLU's subject).
    pub group: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Query {
    /// One context for every continuation.
    Shared(String),
    /// One context per choice, all continued by the same target (WinoGrande's partial scoring).
    PerChoice(Vec<String>),
}

/// How the scores of an item become its metrics.
#[derive(Debug, Clone, Copy)]
pub enum Output {
    /// The most likely choice: `acc`, with `acc_norm` (log-likelihood per character of the choice)
    /// where `norm` is set.
    MultipleChoice { norm: bool },
    /// One continuation: `perplexity` (exp of the mean negative log-likelihood per item) and `acc`
    /// (greedy decoding gives exactly the continuation), LAMBADA's metrics.
    Loglikelihood,
    /// Greedy generation until a stop string, filtered and matched against the references (the
    /// item's continuations).
    Generate(&'static Generation),
}

/// How exemplars are drawn from the few-shot pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampler {
    /// The harness's default: `random.Random(seed).sample(pool, n)` per item, one generator for the
    /// whole task, the item itself dropped when the pool is its own split.
    Random,
    /// The first `n` of the pool (MMLU's `first_n`).
    FirstN,
}

/// A task: lm-evaluation-harness's definition of it, over the file laid out as `shared/evals` is.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    pub name: String,
    /// The harness task's version, reported with the results.
    pub version: &'static str,
    /// The scored items, relative to the evaluation folder.
    pub file: String,
    /// The few-shot pool, relative to the evaluation folder (`None`: the scored items themselves).
    pub fewshot_file: Option<String>,
    /// Exemplars written in the task's definition (GSM8K's chain-of-thought ones), used instead of
    /// a pool file.
    pub fixed_shots: Option<fn() -> Vec<Doc>>,
    /// Exemplars when `--num-fewshot` is not given (the harness YAML's `num_fewshot`).
    pub default_fewshot: usize,
    pub output: Output,
    pub target_delimiter: &'static str,
    pub fewshot_delimiter: &'static str,
    pub sampler: Sampler,
    /// Turns one row of the file into an item.
    pub parse: fn(&Value) -> Result<Doc, DocError>,
    /// Text before the exemplars, per group (MMLU's "The following are multiple choice questions…").
    pub description: fn(Option<&str>) -> String,
    /// Accuracy of a random guess, for the centred CORE-style aggregate.
    pub random_baseline: f64,
    /// The metric the aggregate and a one-line summary take.
    pub primary: &'static str,
}

pub(crate) fn no_description(_: Option<&str>) -> String {
    String::new()
}

impl TaskSpec {
    /// A task with the harness's defaults: exemplars drawn at random from the scored split itself,
    /// `" "` before a target and `"\n\n"` after an exemplar, no description, `acc` against a coin
    /// flip.
    pub fn new(
        name: impl Into<String>,
        version: &'static str,
        file: impl Into<String>,
        output: Output,
        parse: fn(&Value) -> Result<Doc, DocError>,
    ) -> Self {
        TaskSpec {
            name: name.into(),
            version,
            file: file.into(),
            fewshot_file: None,
            fixed_shots: None,
            default_fewshot: 0,
            output,
            target_delimiter: " ",
            fewshot_delimiter: "\n\n",
            sampler: Sampler::Random,
            parse,
            description: no_description,
            random_baseline: 0.5,
            primary: "acc",
        }
    }
}

/// Reads a task's items: JSON lines, gzip-compressed where the name ends in `.gz`.
pub fn read_docs(path: &Path, parse: fn(&Value) -> Result<Doc, DocError>) -> Result<Vec<Doc>, EvalError> {
    let io = |e: std::io::Error| EvalError::Io { path: path.to_path_buf(), source: e };
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(EvalError::Data { path: path.to_path_buf(), line: 0, message: "not a regular file".into() });
        }
    }
    let file = std::fs::File::open(path).map_err(io)?;
    let mut text = String::new();
    use std::io::Read;
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(file).read_to_string(&mut text).map_err(io)?;
    } else {
        std::io::BufReader::new(file).read_to_string(&mut text).map_err(io)?;
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| EvalError::Data { path: path.to_path_buf(), line: i + 1, message };
        let value: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let doc = parse(&value).map_err(|e| bad(e.to_string()))?;
        if doc.continuations.is_empty() || doc.gold >= doc.choice_count() {
            return Err(bad(format!("answer index {} of {} choices", doc.gold, doc.choice_count())));
        }
        docs.push(doc);
    }
    Ok(docs)
}

impl Doc {
    /// Choices of the item: its contexts where each choice is a context, else its continuations.
    pub fn choice_count(&self) -> usize {
        match &self.query {
            Query::PerChoice(contexts) => contexts.len(),
            Query::Shared(_) => self.continuations.len(),
        }
    }
}

/// The few-shot text before each item, drawn as the harness draws it.
pub struct FewShot<'a> {
    spec: &'a TaskSpec,
    pool: &'a [Doc],
    /// Whether the pool is the scored split itself (an item never shows itself).
    same_split: bool,
    rng: PyRandom,
}

impl<'a> FewShot<'a> {
    pub fn new(spec: &'a TaskSpec, pool: &'a [Doc], same_split: bool, seed: u64) -> Self {
        Self { spec, pool, same_split, rng: PyRandom::new(seed) }
    }

    /// The description and the `n` exemplars before `doc` (the generator advances as the
    /// harness's does, item after item in order).
    pub fn context(&mut self, doc: &Doc, n: usize) -> (String, String) {
        let description = (self.spec.description)(doc.group.as_deref());
        let mut text = String::new();
        if n == 0 {
            return (description, text);
        }
        let pool: Vec<&Doc> = match &doc.group {
            Some(g) => self.pool.iter().filter(|d| d.group.as_ref() == Some(g)).collect(),
            None => self.pool.iter().collect(),
        };
        let chosen: Vec<&Doc> = match self.spec.sampler {
            Sampler::FirstN => pool.into_iter().take(n).collect(),
            Sampler::Random => {
                let draw = (n + usize::from(self.same_split)).min(pool.len());
                let picked = self.rng.sample(pool.len(), draw);
                picked.into_iter().map(|i| pool[i]).filter(|d| *d != doc).take(n).collect()
            }
        };
        for shot in chosen {
            text.push_str(&shot.shot.0);
            // As the harness: an exemplar without an answer is not followed by the delimiter.
            if !shot.shot.1.is_empty() {
                text.push_str(self.spec.target_delimiter);
                text.push_str(&shot.shot.1);
                text.push_str(self.spec.fewshot_delimiter);
            }
        }
        (description, text)
    }
}

/// The folder of the evaluation sets: the one given (`--eval-dir`, `[eval] dir`), else the
/// binary's default (`$EMBER_EVAL_DIR`), checked to be a folder.
pub fn eval_dir(given: Option<&Path>, default: Option<&Path>) -> Result<PathBuf, EvalError> {
    let dir = match given.or(default) {
        Some(d) => d.to_path_buf(),
        None => return Err(EvalError::NoEvalDir),
    };
    if !dir.is_dir() {
        return Err(EvalError::Io {
            path: dir,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a folder"),
        });
    }
    Ok(dir)
}

/// A string field of a row.
pub(crate) fn text<'v>(row: &'v Value, key: &str) -> Result<&'v str, DocError> {
    row.get(key).and_then(Value::as_str).ok_or_else(|| DocError::Field { field: key.into(), expected: "a string" })
}

/// An array of strings at `row[key]` (or `row[key][sub]`).
pub(crate) fn texts(row: &Value, key: &str, sub: Option<&str>) -> Result<Vec<String>, DocError> {
    let mut v = row.get(key);
    if let Some(sub) = sub {
        v = v.and_then(|v| v.get(sub));
    }
    let name = sub.map_or(key.to_string(), |s| format!("{key}.{s}"));
    let wrong = || DocError::Field { field: name.clone(), expected: "a list of strings" };
    let arr = v.and_then(Value::as_array).ok_or_else(wrong)?;
    arr.iter().map(|x| x.as_str().map(String::from).ok_or_else(wrong)).collect()
}

/// An integer field, given as a number or as a string of digits (HellaSwag's `label`).
pub(crate) fn index(row: &Value, key: &str) -> Result<usize, DocError> {
    match row.get(key) {
        Some(Value::Number(n)) => n.as_u64().map(|n| n as usize),
        Some(Value::String(s)) => s.trim().parse().ok(),
        Some(Value::Bool(b)) => Some(usize::from(*b)),
        _ => None,
    }
    .ok_or_else(|| DocError::Field { field: key.into(), expected: "a non-negative integer" })
}
