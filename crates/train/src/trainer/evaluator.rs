//! The periodic evaluation: both splits scored by the objective (fixed batches, or every held-out
//! example), the benchmark tasks and a sample. The batches are shared out over the ranks and their
//! sums added.

use ember_data::Tokenizer;
use ember_kernels::TrainBackend;
use ember_model::Decoder;

use super::recorder::Recorder;
use super::setup::Setup;
use crate::config::{DataFormat, EvalStrategy, MetricsConfig, TrainConfig};
use crate::distributed::Collective;
use crate::error::TrainError;
use crate::eval::Part;
use crate::metrics::{InitialEvalRecord, MetricsSink, SampleRecord, StepRecord};
use crate::objective::{Evaluated, Objective, Split};

/// What the evaluator reads of the run's config.
pub(super) struct EvaluatorConfig {
    /// Fine-tuning examples (JSONL data): the run counts epochs.
    held_out: bool,
    /// `train.batch_size`: rows per micro-batch, for the epochs.
    batch_size: usize,
    /// `train.eval_interval` and `train.eval_strategy`: when to evaluate.
    interval: usize,
    strategy: EvalStrategy,
    /// `train.max_steps`: the last step always evaluates.
    max_steps: usize,
    /// `train.seed`: each sample's seed comes from it.
    seed: u64,
    /// `model.vocab_size`: ln V is the loss of a model that knows nothing.
    vocab_size: usize,
    /// `[metrics]`: the prompt and length of the sample.
    sample: MetricsConfig,
    /// `[eval]`: the benchmark tasks' options.
    tasks: ember_eval::Options,
    /// `[distributed]`'s deadlines of a step and of slow work (the tasks run on rank 0 alone).
    timeouts: (std::time::Duration, std::time::Duration),
}

impl EvaluatorConfig {
    pub(super) fn of(config: &TrainConfig) -> Self {
        let t = &config.train;
        Self {
            held_out: config.data.format() == DataFormat::Jsonl,
            batch_size: t.batch_size,
            interval: t.eval_interval,
            strategy: t.eval_strategy,
            max_steps: t.max_steps,
            seed: t.seed,
            vocab_size: config.model.vocab_size,
            sample: config.metrics.clone(),
            tasks: task_options(config),
            timeouts: (config.distributed.timeout(), config.distributed.io_timeout()),
        }
    }

    /// `[eval]`'s tasks read and tokenized once, for every evaluation of the run (none without
    /// `[eval]`).
    pub(super) fn tasks(
        config: &TrainConfig,
        setup: &Setup,
        default_dir: Option<&std::path::Path>,
    ) -> Result<Vec<ember_eval::Prepared>, TrainError> {
        let Some(eval) = &config.eval else { return Ok(Vec::new()) };
        let dir = ember_eval::eval_dir(eval.dir.as_deref(), default_dir)?;
        let options = task_options(config);
        let encoding =
            ember_eval::Encoding { tokenizer: &setup.tokenizer, max_len: config.model.max_seq_len, chat: None };
        let selected = ember_eval::tasks::select(&eval.tasks.join(","))?;
        let prepared = selected.iter().map(|(spec, limit)| ember_eval::prepare(spec, &dir, *limit, &options, encoding));
        Ok(prepared.collect::<Result<_, _>>()?)
    }

    /// The evaluator of `setup`'s splits by `objective`, its batches shared out over the ranks of
    /// `collective`.
    pub(super) fn build<'a, B: TrainBackend>(
        self,
        setup: &'a Setup,
        collective: &'a dyn Collective,
        objective: &'a dyn Objective<B>,
        tasks: &'a [ember_eval::Prepared],
    ) -> Evaluator<'a, B> {
        Evaluator { setup, tasks, collective, objective, config: self }
    }
}

pub(super) struct Evaluator<'a, B: TrainBackend> {
    config: EvaluatorConfig,
    setup: &'a Setup,
    collective: &'a dyn Collective,
    /// What the splits are scored by.
    objective: &'a dyn Objective<B>,
    /// `[eval]`'s benchmark tasks, scored by rank 0 at each evaluation.
    tasks: &'a [ember_eval::Prepared],
}

impl<B: TrainBackend> Evaluator<'_, B> {
    /// The objective's evaluation of `split`, its batches shared out over the ranks and its sums
    /// added.
    fn evaluate(&self, model: &Decoder<B::InnerBackend>, split: Split) -> Result<Evaluated, TrainError> {
        let c = self.collective;
        let mut sums = self.objective.evaluate(model, split, Part { rank: c.rank(), world: c.world() })?;
        c.all_reduce_f64(&mut sums, &format!("evaluation ({})", split.name()))?;
        Ok(self.objective.evaluated(&sums, split))
    }

    /// Whether the run holds examples out for validation (`data.val_fraction = 0` holds none).
    fn has_val(&self) -> bool {
        burn::data::dataset::Dataset::len(self.setup.val.as_ref()) > 0
    }

    /// The loss before training, beside ln V (what a model that knows nothing scores), logged and
    /// recorded as step 0 (rank 0), where the val curve starts. None without validation.
    pub(super) fn initial(
        &self,
        model: &Decoder<B::InnerBackend>,
        rec: &mut Recorder,
    ) -> Result<Option<f64>, TrainError> {
        if !self.has_val() {
            if self.collective.rank() == 0 {
                tracing::info!(
                    "no validation (data.val_fraction = 0): evaluations score the training split and [eval]'s \
                     tasks; no best checkpoint is kept"
                );
            }
            return Ok(None);
        }
        let evaluated = self.evaluate(model, Split::Val)?;
        let val = evaluated.loss;
        if self.collective.rank() != 0 {
            return Ok(Some(val));
        }
        match evaluated.note.as_str() {
            // A loss over the vocabulary, beside what knowing nothing scores.
            "" => tracing::info!("step 0: val loss {val:.4} (ln V = {:.4})", (self.config.vocab_size as f64).ln()),
            note => tracing::info!("step 0: val loss {val:.4}{note}"),
        }
        let epoch = self.epoch(0);
        let named = evaluated.named.into_iter().collect();
        rec.sinks.initial(&InitialEvalRecord {
            step: 0,
            elapsed_s: rec.clock.elapsed_s(),
            val_loss: val,
            epoch,
            named,
        })?;
        Ok(Some(val))
    }

    /// The prompt of the evaluation samples: `metrics.sample_prompt`; for fine-tuning data left at
    /// its default, the first held-out example's prompt (a chat through its template), so that the
    /// samples show answers to a conversation the run does not train on. With the ids it encodes
    /// to (special tokens read as such where the prompt is the template's).
    fn sample_prompt(&self) -> Option<(String, Vec<u32>)> {
        let (configured, tokenizer) = (&self.config.sample.sample_prompt, &self.setup.tokenizer);
        let held_out =
            self.setup.held_out_prompt.as_ref().filter(|_| *configured == MetricsConfig::default().sample_prompt);
        let (text, ids) = match held_out {
            Some(text) => (text, tokenizer.encode_with_special(text)),
            None => (configured, tokenizer.encode(configured)),
        };
        match ids {
            Ok(ids) if !ids.is_empty() => Some((text.clone(), ids)),
            _ => {
                tracing::warn!("the sample prompt {text:?} does not encode; no samples");
                None
            }
        }
    }

    /// Whether step `step` ends with an evaluation: every `eval_interval` steps, or each time the
    /// run completes an epoch of the (fine-tuning) examples; and at the last step.
    pub(super) fn due(&self, step: usize, epoch_before: Option<f64>, epoch: Option<f64>) -> bool {
        let c = &self.config;
        step == c.max_steps
            || match c.strategy {
                EvalStrategy::Steps => step.is_multiple_of(c.interval),
                EvalStrategy::Epoch => matches!((epoch_before, epoch), (Some(a), Some(b)) if b.floor() > a.floor()),
            }
    }

    /// Epochs of the training rows drawn before micro-batch `stream` (fine-tuning runs only).
    pub(super) fn epoch(&self, stream: u64) -> Option<f64> {
        let rows = self.setup.train.len().max(1) as f64;
        self.config.held_out.then(|| stream as f64 * self.config.batch_size as f64 / rows)
    }

    /// Evaluates both splits (the val split where the run has one) into `record`, logs them, writes
    /// a sample (rank 0); returns the val loss.
    pub(super) fn record(
        &self,
        model: &Decoder<B::InnerBackend>,
        record: &mut StepRecord,
        rec: &mut Recorder,
    ) -> Result<Option<f64>, TrainError> {
        let (c, step) = (&self.config, record.step);
        let Evaluated { loss: tl, named: train_named, note: train_note } = self.evaluate(model, Split::Train)?;
        record.eval_train_loss = Some(tl);
        let val = self.has_val().then(|| self.evaluate(model, Split::Val)).transpose()?;
        let (vl, note) = match val {
            Some(val) => {
                record.val_loss = Some(val.loss);
                record.named.extend(val.named);
                (Some(val.loss), format!(", val loss {:.4}{}", val.loss, val.note))
            }
            // Without validation, the training split's own metrics (`eval_train_…`).
            None => {
                record.named.extend(train_named);
                (None, train_note)
            }
        };
        self.score_tasks(model, record, rec)?;
        if self.collective.rank() != 0 {
            return Ok(vl);
        }
        let memory =
            record.memory_bytes.map_or(String::new(), |m| format!(", memory in use {}", crate::memory::gib(m)));
        rec.bar.suspend(|| tracing::info!("step {step}: train loss {tl:.4}{note}{memory}"));
        let tokens = c.sample.sample_tokens;
        if let Some((prompt, ids)) = self.sample_prompt().filter(|_| tokens > 0) {
            if let Some(text) = sample_text(model, &self.setup.tokenizer, ids, tokens, c.seed ^ step as u64) {
                rec.sinks.sample(&SampleRecord { step, elapsed_s: rec.clock.elapsed_s(), prompt, text })?;
            }
        }
        Ok(vl)
    }
}

/// `[eval]`'s few-shot settings over the library's defaults.
fn task_options(config: &TrainConfig) -> ember_eval::Options {
    let defaults = ember_eval::Options::default();
    match &config.eval {
        Some(e) => ember_eval::Options { num_fewshot: e.num_fewshot, seed: e.seed, ..defaults },
        None => defaults,
    }
}

impl<B: TrainBackend> Evaluator<'_, B> {
    /// `[eval]`'s tasks on the model, as `eval/<task>/<metric>` in `record` and the log, with
    /// `eval/core`, the CORE-style aggregate. Rank 0 scores them while the other ranks wait for it
    /// under the longer deadline (`distributed.io_timeout_s`), as for a checkpoint.
    fn score_tasks(
        &self,
        model: &Decoder<B::InnerBackend>,
        record: &mut StepRecord,
        rec: &mut Recorder,
    ) -> Result<(), TrainError> {
        if self.tasks.is_empty() {
            return Ok(());
        }
        let c = self.collective;
        c.set_timeout(self.config.timeouts.1);
        if c.rank() == 0 {
            self.score_tasks_here(model, record, rec)?;
        }
        c.arrive(record.step as u64, &format!("step {}: benchmark tasks", record.step))?;
        c.set_timeout(self.config.timeouts.0);
        Ok(())
    }

    fn score_tasks_here(
        &self,
        model: &Decoder<B::InnerBackend>,
        record: &mut StepRecord,
        rec: &mut Recorder,
    ) -> Result<(), TrainError> {
        let mut results = Vec::with_capacity(self.tasks.len());
        for task in self.tasks {
            results.push(ember_eval::evaluate(model, &self.setup.tokenizer, task, &self.config.tasks, |_| {})?);
        }
        let results = ember_eval::run::with_groups(results);
        let mut line = Vec::new();
        for r in &results {
            for (metric, e) in &r.metrics {
                record.named.insert(format!("eval/{}/{metric}", r.name), e.value);
            }
            if let Some(e) = r.metric(r.primary) {
                line.push(format!("{} {} {:.4}", r.name, r.primary, e.value));
            }
        }
        if let Some(core) = ember_eval::run::core(&results) {
            record.named.insert("eval/core".into(), core);
            line.push(format!("CORE {core:.4}"));
        }
        rec.bar.suspend(|| tracing::info!("step {}: {}", record.step, line.join(", ")));
        Ok(())
    }
}

/// Up to `max_new_tokens` of text generated after `prompt` (temperature 0.8, top-k 200) through the
/// KV cache; `None` when generating or decoding fails.
fn sample_text<B: ember_kernels::EmberBackend>(
    model: &Decoder<B>,
    tokenizer: &Tokenizer,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    seed: u64,
) -> Option<String> {
    use ember_generate::sample::{generate_batch, GenerateOptions, Sampler, SamplingConfig};
    let mut sampler = [Sampler::new(SamplingConfig::default(), seed).ok()?];
    let options =
        GenerateOptions { max_new_tokens, stop_tokens: tokenizer.eos_id().into_iter().collect(), block_size: 16 };
    let prompt = prompt[prompt.len().saturating_sub(model.config().max_seq_len)..].to_vec();
    // A sample is a nicety of the evaluation: whatever goes wrong (a prompt id past the model's
    // vocabulary, a decoder that fails), the run goes on without it, and nothing here panics.
    let ids = match generate_batch(model, std::slice::from_ref(&prompt), &options, &mut sampler, |_, _| true) {
        Ok(mut ids) => ids.remove(0),
        Err(e) => {
            tracing::warn!("no evaluation sample: {e}");
            return None;
        }
    };
    // Decoded as `ember sample` streams it: after the prompt (so SentencePiece's leading-space strip
    // does not eat the first new space), up to the end-of-text token, special tokens left out, in
    // O(1) work per token.
    let eos = tokenizer.eos_id();
    let decode = || -> Result<String, ember_data::DataError> {
        let mut stream = tokenizer.decode_stream(&prompt);
        let mut text = String::new();
        for &id in ids.iter().take_while(|&&id| Some(id) != eos) {
            text.push_str(&stream.step(id)?);
        }
        text.push_str(&stream.finish()?);
        Ok(text)
    };
    match decode() {
        Ok(text) => Some(text),
        Err(e) => {
            tracing::warn!("no evaluation sample: {e}");
            None
        }
    }
}
