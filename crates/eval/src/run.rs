//! A task run end to end: items read and limited, few-shot contexts drawn, texts tokenized as the
//! harness tokenizes them, log-likelihoods scored, metrics computed.

use std::path::Path;

use ember_data::finetune::{ChatTemplate, Message};
use ember_data::Tokenizer;
use ember_kernels::EmberBackend;
use ember_model::Decoder;
use serde::Serialize;

use crate::error::EvalError;
use crate::generate::generate;
use crate::metrics::{centred, task_metrics, Estimate, Generated, ItemScore};
use crate::schema::Schema;
use crate::score::{score, Budget, Pair};
use crate::task::{read_docs, Doc, FewShot, Output, Query, TaskSpec};

/// How a set of tasks runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Exemplars before each item (`None`: the task's default, 0 for every task here).
    pub num_fewshot: Option<usize>,
    /// Seed of the few-shot draws (the harness's `fewshot_random_seed`, 1234 by default).
    pub seed: u64,
    /// Tokens per forward call (rows × padded length).
    pub batch_tokens: usize,
    /// Sequences generated together in generation tasks.
    pub generate_batch: usize,
    /// The JSON Schema generation tasks' answers follow (`--json-schema`); log-likelihood tasks
    /// score given texts and ignore it.
    pub schema: Option<Schema>,
}

impl Default for Options {
    fn default() -> Self {
        Self { num_fewshot: None, seed: 1234, batch_tokens: 4096, generate_batch: 8, schema: None }
    }
}

/// A task's items ready to score: their context texts and token pairs.
pub struct Prepared {
    pub spec: TaskSpec,
    pub docs: Vec<Doc>,
    /// Items in the whole file (before any limit).
    pub original: usize,
    pub num_fewshot: usize,
    /// Per item, per pair: the context text and continuation text as the harness sends them.
    pub requests: Vec<Vec<(String, String)>>,
    pub pairs: Vec<Vec<Pair>>,
}

/// How the model reads text: its tokenizer, its context, and for `--chat` its chat template.
#[derive(Clone, Copy)]
pub struct Encoding<'a> {
    pub tokenizer: &'a Tokenizer,
    pub max_len: usize,
    /// Wrap each prompt in the chat template, as the harness's `--apply_chat_template`: the
    /// description as a system turn, exemplars and question as one user turn, the assistant's
    /// turn opened, the choices right after it (no delimiter).
    pub chat: Option<&'a ChatTemplate>,
}

/// Reads `spec`'s items under `dir`, keeps the first `limit`, and builds their requests.
pub fn prepare(
    spec: &TaskSpec,
    dir: &Path,
    limit: Option<usize>,
    options: &Options,
    encoding: Encoding,
) -> Result<Prepared, EvalError> {
    let mut docs = read_docs(&dir.join(&spec.file), spec.parse)?;
    let original = docs.len();
    let pool = match (&spec.fewshot_file, spec.fixed_shots) {
        (_, Some(fixed)) => Some(fixed()),
        (Some(file), None) => Some(read_docs(&dir.join(file), spec.parse)?),
        (None, None) => None,
    };
    let num_fewshot = options.num_fewshot.unwrap_or(spec.default_fewshot);
    let (pool_docs, same_split) = match &pool {
        Some(p) => (p.as_slice(), false),
        None => (docs.as_slice(), true),
    };
    if num_fewshot > 0 && pool_docs.len() < num_fewshot + usize::from(same_split) {
        return Err(EvalError::Task {
            task: spec.name.clone(),
            message: format!("--num-fewshot {num_fewshot}: the few-shot pool has only {} items", pool_docs.len()),
        });
    }
    let keep = limit.unwrap_or(usize::MAX).min(docs.len());
    if keep == 0 {
        let why = if docs.is_empty() { "its file has no items".to_string() } else { "a limit of 0 items".to_string() };
        return Err(EvalError::Task { task: spec.name.clone(), message: format!("nothing to score: {why}") });
    }
    let mut shots = FewShot::new(spec, pool_docs, same_split, options.seed);
    let mut requests = Vec::with_capacity(keep);
    for doc in &docs[..keep] {
        let (description, exemplars) = shots.context(doc, num_fewshot);
        requests.push(match encoding.chat {
            Some(chat) => chat_requests(spec, doc, chat, description, &exemplars)?,
            None => requests_of(spec, doc, &format!("{description}{exemplars}")),
        });
    }
    docs.truncate(keep);
    let pairs = encode_requests(spec, &requests, encoding)?;
    Ok(Prepared { spec: spec.clone(), docs, original, num_fewshot, requests, pairs })
}

/// An item's (context, continuation) texts after `before` (description and exemplars), as the
/// harness's `construct_requests` makes them: a choice follows the target delimiter; a
/// log-likelihood target stands as it is; a generation has only a context.
fn requests_of(spec: &TaskSpec, doc: &Doc, before: &str) -> Vec<(String, String)> {
    let delimiter = match spec.output {
        Output::Loglikelihood => "",
        Output::MultipleChoice { .. } => spec.target_delimiter,
        Output::Generate(_) => return vec![(format!("{before}{}", doc.shot.0), String::new())],
    };
    let with_delimiter = |c: &String| format!("{delimiter}{c}");
    match &doc.query {
        Query::Shared(q) => doc.continuations.iter().map(|c| (format!("{before}{q}"), with_delimiter(c))).collect(),
        Query::PerChoice(contexts) => {
            let target = with_delimiter(&doc.continuations[0]);
            contexts.iter().map(|c| (format!("{before}{c}"), target.clone())).collect()
        }
    }
}

/// [`requests_of`] through a chat template, as the harness's `--apply_chat_template`: the
/// description a system turn, exemplars and question one user turn, the assistant's turn opened,
/// each choice right after it.
fn chat_requests(
    spec: &TaskSpec,
    doc: &Doc,
    chat: &ChatTemplate,
    description: String,
    exemplars: &str,
) -> Result<Vec<(String, String)>, EvalError> {
    let refuse = |why: &str| EvalError::Task {
        task: spec.name.clone(),
        message: format!("--chat: {why}; evaluate it without --chat"),
    };
    let Query::Shared(question) = &doc.query else {
        return Err(refuse("its choices are contexts (partial scoring), which a chat turn cannot hold"));
    };
    if question.is_empty() {
        return Err(refuse("its items have no prompt to put in a turn"));
    }
    let mut messages = Vec::new();
    if !description.is_empty() {
        messages.push(Message::new("system", description));
    }
    messages.push(Message::new("user", format!("{exemplars}{question}")));
    let context = chat.render(&messages, true)?;
    Ok(match spec.output {
        Output::Generate(_) => vec![(context, String::new())],
        _ => doc.continuations.iter().map(|c| (context.clone(), c.clone())).collect(),
    })
}

/// The token pairs of every item's requests; a generation's prompt cut from the left to leave room
/// for `max_gen_toks` (as the harness cuts it).
fn encode_requests(
    spec: &TaskSpec,
    requests: &[Vec<(String, String)>],
    encoding: Encoding,
) -> Result<Vec<Vec<Pair>>, EvalError> {
    let tokenizer = encoding.tokenizer;
    if let Output::Generate(g) = spec.output {
        let room = encoding.max_len.saturating_sub(g.max_gen_toks).max(1);
        return requests
            .iter()
            .map(|item| {
                let ids = tokenizer.encode_prompt(&item[0].0)?;
                Ok(vec![Pair { context: ids[ids.len().saturating_sub(room)..].to_vec(), continuation: Vec::new() }])
            })
            .collect();
    }
    let prefix = tokenizer.bos_id().or_else(|| tokenizer.eos_id());
    requests.iter().map(|item| item.iter().map(|(c, x)| encode_pair(tokenizer, prefix, c, x)).collect()).collect()
}

/// The harness's `_encode_pair`: the context's trailing whitespace moved to the continuation, the
/// continuation's tokens those of the whole text after the context's; an empty context is the
/// model's BOS (else EOS) token alone.
pub fn encode_pair(
    tokenizer: &Tokenizer,
    prefix: Option<u32>,
    context: &str,
    continuation: &str,
) -> Result<Pair, EvalError> {
    if context.is_empty() {
        let prefix = prefix.ok_or_else(|| EvalError::Task {
            task: String::new(),
            message: "an item with no context needs a BOS or EOS token to start from; the tokenizer has neither".into(),
        })?;
        return Ok(Pair { context: vec![prefix], continuation: tokenizer.encode_prompt(continuation)? });
    }
    let trimmed = context.trim_end();
    let (context, continuation) = (trimmed, format!("{}{continuation}", &context[trimmed.len()..]));
    let whole = tokenizer.encode_prompt(&format!("{context}{continuation}"))?;
    let context = tokenizer.encode_prompt(context)?;
    let cut = context.len().min(whole.len());
    Ok(Pair { continuation: whole[cut..].to_vec(), context })
}

/// One task's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct TaskResult {
    pub name: String,
    pub version: &'static str,
    pub original: usize,
    pub effective: usize,
    pub num_fewshot: usize,
    pub metrics: Vec<(&'static str, Estimate)>,
    #[serde(skip)]
    pub primary: &'static str,
    #[serde(skip)]
    pub random_baseline: f64,
    #[serde(skip)]
    pub items: Vec<ItemScore>,
}

impl TaskResult {
    pub fn metric(&self, name: &str) -> Option<Estimate> {
        self.metrics.iter().find(|(n, _)| *n == name).map(|(_, e)| *e)
    }
}

/// Scores a prepared task; `done` is told of every batch of items finished.
pub fn evaluate<B: EmberBackend>(
    model: &Decoder<B>,
    tokenizer: &Tokenizer,
    task: &Prepared,
    options: &Options,
    mut done: impl FnMut(usize),
) -> Result<TaskResult, EvalError> {
    let items: Vec<ItemScore> = match task.spec.output {
        Output::Generate(g) => {
            let prompts: Vec<Vec<u32>> = task.pairs.iter().map(|p| p[0].context.clone()).collect();
            let schema = options.schema.as_ref();
            let texts = generate(model, tokenizer, &prompts, g, schema, options.generate_batch, &mut done)?;
            task.docs
                .iter()
                .zip(texts)
                .map(|(doc, text)| {
                    let filtered: Vec<String> = g.filters.iter().map(|(_, f)| f.apply(&text)).collect();
                    let matched = filtered.iter().map(|p| g.exact_match(p, &doc.continuations)).collect();
                    ItemScore {
                        loglikelihoods: Vec::new(),
                        greedy: Vec::new(),
                        choice_chars: Vec::new(),
                        gold: 0,
                        per_choice_contexts: false,
                        generated: Some(Generated { text, filtered, matched }),
                    }
                })
                .collect()
        }
        Output::MultipleChoice { .. } | Output::Loglikelihood => {
            let budget = Budget::for_vocab(options.batch_tokens, model.config().vocab_size);
            let scored = score(model, &task.pairs, budget, done);
            task.docs
                .iter()
                .zip(scored)
                .map(|(doc, s)| ItemScore {
                    loglikelihoods: s.iter().map(|x| x.logprob).collect(),
                    greedy: s.iter().map(|x| x.greedy).collect(),
                    choice_chars: doc.continuations.iter().map(|c| c.chars().count()).collect(),
                    gold: doc.gold,
                    per_choice_contexts: matches!(doc.query, Query::PerChoice(_)),
                    generated: None,
                })
                .collect()
        }
    };
    Ok(TaskResult {
        name: task.spec.name.clone(),
        version: task.spec.version,
        original: task.original,
        effective: items.len(),
        num_fewshot: task.num_fewshot,
        metrics: task_metrics(task.spec.output, &items),
        primary: task.spec.primary,
        random_baseline: task.spec.random_baseline,
        items,
    })
}

/// BLiMP's paradigms as one `blimp` row (accuracy over all their pairs), after the others.
pub fn with_groups(mut results: Vec<TaskResult>) -> Vec<TaskResult> {
    let blimp: Vec<&TaskResult> = results.iter().filter(|r| r.name.starts_with("blimp_")).collect();
    if blimp.len() > 1 {
        let items: Vec<ItemScore> = blimp.iter().flat_map(|r| r.items.iter().cloned()).collect();
        let group = TaskResult {
            name: "blimp".into(),
            version: "2.0",
            original: blimp.iter().map(|r| r.original).sum(),
            effective: items.len(),
            num_fewshot: blimp[0].num_fewshot,
            metrics: task_metrics(Output::MultipleChoice { norm: false }, &items),
            primary: "acc",
            random_baseline: 0.5,
            items: Vec::new(),
        };
        results.push(group);
    }
    results
}

/// The CORE-style aggregate: each task's primary accuracy centred on its random baseline, averaged
/// over the tasks (BLiMP counted once, as its group); `None` without an accuracy task.
pub fn core(results: &[TaskResult]) -> Option<f64> {
    let has_group = results.iter().any(|r| r.name == "blimp");
    let centred: Vec<f64> = results
        .iter()
        .filter(|r| !(has_group && r.name.starts_with("blimp_")))
        .filter_map(|r| r.metric(r.primary).map(|e| centred(e.value, r.random_baseline)))
        .collect();
    (!centred.is_empty()).then(|| centred.iter().sum::<f64>() / centred.len() as f64)
}

/// The results as lm-evaluation-harness prints them with `--output_path`: `results` (each metric
/// with its `_stderr`), `versions`, `n-shot`, `n-samples`; and `core`.
pub fn to_json(results: &[TaskResult], config: serde_json::Value) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let mut res = Map::new();
    let mut versions = Map::new();
    let mut shots = Map::new();
    let mut samples = Map::new();
    for r in results {
        let mut m = Map::new();
        m.insert("alias".into(), json!(r.name));
        for (name, e) in &r.metrics {
            m.insert((*name).into(), json!(e.value));
            m.insert(format!("{name}_stderr"), json!(e.stderr));
        }
        res.insert(r.name.clone(), Value::Object(m));
        versions.insert(r.name.clone(), json!(r.version));
        shots.insert(r.name.clone(), json!(r.num_fewshot));
        samples.insert(r.name.clone(), json!({"original": r.original, "effective": r.effective}));
    }
    json!({"results": res, "versions": versions, "n-shot": shots, "n-samples": samples, "core": core(results), "config": config})
}

/// One JSON line per item: what was scored and what came of it, to check a number by hand.
pub fn sample_lines(task: &Prepared, result: &TaskResult) -> Vec<serde_json::Value> {
    task.requests
        .iter()
        .zip(&result.items)
        .enumerate()
        .map(|(i, (requests, item))| {
            serde_json::json!({
                "task": task.spec.name,
                "doc_id": i,
                "requests": requests,
                "loglikelihoods": item.loglikelihoods,
                "greedy": item.greedy,
                "prediction": item.prediction(),
                "prediction_norm": item.prediction_norm(),
                "gold": item.gold,
                "generated": item.generated,
            })
        })
        .collect()
}
