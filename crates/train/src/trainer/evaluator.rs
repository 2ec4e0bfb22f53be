//! The periodic evaluation: fixed batches of both splits (text), or every held-out example
//! (fine-tuning: the completion loss each has alone under documents packing), and a sample. The
//! batches are shared out over the ranks and their sums added.

use ember_data::{Tokenizer, Window};
use ember_model::Decoder;

use super::recorder::Recorder;
use super::setup::Setup;
use crate::config::{DataFormat, EvalStrategy, MetricsConfig, PreferenceConfig, TrainConfig};
use crate::distributed::Collective;
use crate::error::TrainError;
use crate::eval::{eval_seed, evaluate_all_part, evaluate_part, LossSum, Part};
use crate::metrics::{InitialEvalRecord, MetricsSink, SampleRecord, StepRecord};
use crate::preference::{evaluate_pairs, PairSums, Reference};

/// What the evaluator reads of the run's config.
pub(super) struct EvaluatorConfig {
    /// Fine-tuning examples (JSONL data): every held-out example is scored instead of `iters` fixed
    /// batches, and the run counts epochs.
    held_out: bool,
    /// `train.batch_size`: rows per evaluation batch.
    batch_size: usize,
    /// `train.eval_iters`: batches per split.
    iters: usize,
    /// `train.eval_interval` and `train.eval_strategy`: when to evaluate.
    interval: usize,
    strategy: EvalStrategy,
    /// `train.max_steps`: the last step always evaluates.
    max_steps: usize,
    /// `train.seed`: the fixed batches' seeds and each sample's come from it.
    seed: u64,
    /// `model.vocab_size`: ln V is the loss of a model that knows nothing.
    vocab_size: usize,
    /// `[metrics]`: the prompt and length of the sample.
    sample: MetricsConfig,
    /// `[preference]`: pairs are scored by the preference loss, with TRL's metrics.
    preference: Option<PreferenceConfig>,
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
            iters: t.eval_iters,
            interval: t.eval_interval,
            strategy: t.eval_strategy,
            max_steps: t.max_steps,
            seed: t.seed,
            vocab_size: config.model.vocab_size,
            sample: config.metrics.clone(),
            preference: config.preference.clone(),
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

    /// The evaluator of `setup`'s splits and tokenizer, its batches shared out over the ranks of
    /// `collective`.
    pub(super) fn build<'a>(
        self,
        setup: &'a Setup,
        collective: &'a dyn Collective,
        reference: Option<&'a Reference>,
        tasks: &'a [ember_eval::Prepared],
    ) -> Evaluator<'a> {
        Evaluator {
            setup,
            tasks,
            collective,
            reference,
            train_seed: eval_seed(self.seed, "train"),
            val_seed: eval_seed(self.seed, "val"),
            config: self,
        }
    }
}

pub(super) struct Evaluator<'a> {
    config: EvaluatorConfig,
    setup: &'a Setup,
    collective: &'a dyn Collective,
    /// Preference tuning with DPO or IPO: the reference log-probabilities of both splits' rows.
    reference: Option<&'a Reference>,
    /// `[eval]`'s benchmark tasks, scored by rank 0 at each evaluation.
    tasks: &'a [ember_eval::Prepared],
    train_seed: u64,
    val_seed: u64,
}

impl Evaluator<'_> {
    fn part(&self) -> Part {
        Part { rank: self.collective.rank(), world: self.collective.world() }
    }

    /// `sum` added over the ranks, as a mean.
    fn reduce(&self, sum: LossSum, what: &str) -> Result<f64, TrainError> {
        let mut v = [sum.weighted, sum.scored];
        self.collective.all_reduce_f64(&mut v, what)?;
        Ok(LossSum { weighted: v[0], scored: v[1] }.mean())
    }

    /// The preference loss of `rows` (and TRL's metrics), its batches shared over the ranks.
    fn pairs<IB: ember_kernels::EmberBackend>(
        &self,
        model: &Decoder<IB>,
        config: &PreferenceConfig,
        rows: &[Window],
        reference: Option<&[[f64; 2]]>,
        what: &str,
    ) -> Result<(f64, PairSums), TrainError> {
        let part = self.part();
        let (loss, sums) = evaluate_pairs(model, config, rows, reference, self.config.batch_size, |i| part.keeps(i));
        let mut v = vec![loss];
        v.extend(sums.to_vec());
        self.collective.all_reduce_f64(&mut v, what)?;
        Ok((v[0], PairSums::from_slice(&v[1..])))
    }

    fn val<IB: ember_kernels::EmberBackend>(&self, model: &Decoder<IB>) -> Result<f64, TrainError> {
        Ok(self.val_with_pairs(model)?.0)
    }

    /// The val loss, and for preference pairs their metrics.
    fn val_with_pairs<IB: ember_kernels::EmberBackend>(
        &self,
        model: &Decoder<IB>,
    ) -> Result<(f64, Option<PairSums>), TrainError> {
        let c = &self.config;
        if let Some(p) = &c.preference {
            let rows: Vec<Window> = (0..self.setup.val.len()).filter_map(|i| self.setup.val.get(i)).collect();
            let reference = self.reference.map(|r| r.val.as_slice());
            let (loss, sums) = self.pairs(model, p, &rows, reference, "evaluation (val)")?;
            return Ok((loss, Some(sums)));
        }
        let sum = if c.held_out {
            evaluate_all_part(model, self.setup.val.as_ref(), c.batch_size, self.part())
        } else {
            evaluate_part(model, self.setup.val.as_ref(), self.val_seed, c.iters, c.batch_size, self.part())
        };
        Ok((self.reduce(sum, "evaluation (val)")?, None))
    }

    /// The loss of the fixed training batches: `eval_iters` batches drawn at random (the same at
    /// every evaluation).
    fn eval_train<IB: ember_kernels::EmberBackend>(&self, model: &Decoder<IB>) -> Result<f64, TrainError> {
        let c = &self.config;
        let Some(p) = &c.preference else {
            let part =
                evaluate_part(model, self.setup.train.as_ref(), self.train_seed, c.iters, c.batch_size, self.part());
            return self.reduce(part, "evaluation (train)");
        };
        let sampler = ember_data::WindowSampler::random(self.train_seed);
        let data = self.setup.train.as_ref();
        let idx: Vec<usize> = (0..c.iters as u64).flat_map(|i| sampler.indices(i, c.batch_size, data.len())).collect();
        let rows: Vec<Window> = idx.iter().filter_map(|&i| data.get(i)).collect();
        let reference: Option<Vec<[f64; 2]>> = self.reference.map(|r| idx.iter().map(|&i| r.train[i]).collect());
        Ok(self.pairs(model, p, &rows, reference.as_deref(), "evaluation (train)")?.0)
    }

    /// The loss before training, beside ln V (what a model that knows nothing scores), logged and
    /// recorded as step 0 (rank 0), where the val curve starts.
    pub(super) fn initial<IB: ember_kernels::EmberBackend>(
        &self,
        model: &Decoder<IB>,
        rec: &mut Recorder,
    ) -> Result<f64, TrainError> {
        let val = self.val(model)?;
        if self.collective.rank() != 0 {
            return Ok(val);
        }
        let ln_v = (self.config.vocab_size as f64).ln();
        tracing::info!("step 0: val loss {val:.4} (ln V = {ln_v:.4})");
        let epoch = self.epoch(0);
        rec.sinks.initial(&InitialEvalRecord { step: 0, elapsed_s: rec.clock.elapsed_s(), val_loss: val, epoch })?;
        Ok(val)
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

    /// Evaluates both splits into `record`, logs them, writes a sample (rank 0); returns the val loss.
    pub(super) fn record<IB: ember_kernels::EmberBackend>(
        &self,
        model: &Decoder<IB>,
        record: &mut StepRecord,
        rec: &mut Recorder,
    ) -> Result<f64, TrainError> {
        let (c, step) = (&self.config, record.step);
        let tl = self.eval_train(model)?;
        let (vl, pairs) = self.val_with_pairs(model)?;
        (record.eval_train_loss, record.val_loss) = (Some(tl), Some(vl));
        if let Some(m) = pairs.and_then(|p| p.metrics()) {
            record.named.extend(m.named("val_"));
        }
        self.score_tasks(model, record, rec)?;
        if self.collective.rank() != 0 {
            return Ok(vl);
        }
        let memory =
            record.memory_bytes.map_or(String::new(), |m| format!(", memory in use {}", crate::memory::gib(m)));
        let accuracy = record
            .named
            .get("val_rewards/accuracies")
            .map_or(String::new(), |a| format!(", held-out reward accuracy {a:.3}"));
        rec.bar.suspend(|| tracing::info!("step {step}: train loss {tl:.4}, val loss {vl:.4}{accuracy}{memory}"));
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

impl Evaluator<'_> {
    /// `[eval]`'s tasks on the model, as `eval/<task>/<metric>` in `record` and the log, with
    /// `eval/core`, the CORE-style aggregate. Rank 0 scores them while the other ranks wait for it
    /// under the longer deadline (`distributed.io_timeout_s`), as for a checkpoint.
    fn score_tasks<IB: ember_kernels::EmberBackend>(
        &self,
        model: &Decoder<IB>,
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

    fn score_tasks_here<IB: ember_kernels::EmberBackend>(
        &self,
        model: &Decoder<IB>,
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
    use ember_model::sample::{generate_batch, GenerateOptions, Sampler, SamplingConfig};
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
