//! The training config file: one TOML with `[model]`, `[data]`, `[train]`, `[optim]` and
//! `[schedule]`. Unknown keys are errors, named with their section; a value that breaks a rule is
//! an [`InvalidConfig`] naming the key, the value and the rule. Parsing reads the file alone: a
//! `[model]` left out for `init_from`'s is filled in when the source is opened
//! ([`ConfigFile::resolve`], in `init`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use ember_data::finetune::Packing;
use ember_model::{LoraConfig, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::error::{InvalidConfig, Relation, TrainError};

/// A run's config: pure data, read from TOML. `M` is the architecture: a [`ModelConfig`], or in a
/// [`ConfigFile`] an `Option` of one (`[model]` may be left out when `init_from` is set).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig<M = ModelConfig> {
    /// Start from pretrained weights: `hf:DIR` (a Hugging Face folder) or `run:DIR` (an ember run
    /// or checkpoint). `[model]` may then be left out: it comes from the source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<InitSource>,
    pub model: M,
    pub data: DataConfig,
    pub train: LoopConfig,
    pub optim: OptimConfig,
    pub schedule: ScheduleConfig,
    /// Fine-tune low-rank adapters instead of every weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// Where metrics go, and the text sampled at evaluations.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// How the ranks of a data-parallel run (`mpirun -n N ember train`) cooperate.
    #[serde(default, skip_serializing_if = "is_default_distributed")]
    pub distributed: DistributedConfig,
}

fn is_default_distributed(d: &DistributedConfig) -> bool {
    *d == DistributedConfig::default()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `jsonl` (metrics.jsonl and samples.jsonl, what `ember dashboard` reads) and/or
    /// `tensorboard` (events.out.tfevents.* files).
    #[serde(default = "default_sinks")]
    pub sinks: Vec<SinkKind>,
    /// Tokens of text generated from `sample_prompt` at every evaluation; 0 turns sampling off.
    #[serde(default = "default_sample_tokens")]
    pub sample_tokens: usize,
    #[serde(default = "default_sample_prompt")]
    pub sample_prompt: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    Jsonl,
    Tensorboard,
}

fn default_sinks() -> Vec<SinkKind> {
    vec![SinkKind::Jsonl, SinkKind::Tensorboard]
}
fn default_sample_tokens() -> usize {
    200
}
fn default_sample_prompt() -> String {
    "\n".into()
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { sinks: default_sinks(), sample_tokens: default_sample_tokens(), sample_prompt: default_sample_prompt() }
    }
}

/// Where the text comes from and how it is tokenized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// A built-in dataset (its manifest is compiled into ember), e.g. "tinyshakespeare".
    #[serde(default)]
    pub dataset: Option<String>,
    /// Or a plain text file (relative paths are relative to the working directory).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// `char`, `bpe`, `bpe:VOCAB` or a path to a tokenizer.json [default: the `init_from` model's
    /// tokenizer, else `char`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// `text` (a token stream cut into windows) or `jsonl` (fine-tuning examples: prompt/completion,
    /// chat messages or text, packed, loss on completions only) [default: from the file extension].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<DataFormat>,
    /// Fraction of the text (or of the examples) held out for validation; the dataset's manifest
    /// value when absent.
    #[serde(default)]
    pub val_fraction: Option<f64>,
    /// JSONL only: how examples fill rows: `documents` (whole examples side by side, each attending
    /// only to itself from position 0), `stream` (one stream cut into rows; examples see each
    /// other) or `none` (one example per row) [default: documents].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packing: Option<Packing>,
    /// JSONL only: cut examples longer than a row (`seq_len + 1` tokens) instead of stopping with
    /// an error (`documents` and `none` packing).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncate: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    Text,
    Jsonl,
}

impl DataConfig {
    /// The packing of JSONL examples.
    pub fn packing(&self) -> Packing {
        self.packing.unwrap_or_default()
    }

    pub fn format(&self) -> DataFormat {
        self.format.unwrap_or(match &self.path {
            Some(p) if p.extension().is_some_and(|e| e == "jsonl") => DataFormat::Jsonl,
            _ => DataFormat::Text,
        })
    }
}

/// The loop: batch shape, length, and how often to log, evaluate and checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopConfig {
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Tokens per sequence; `model.max_seq_len` when absent.
    #[serde(default)]
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step (gradients are averaged over them).
    #[serde(default = "one")]
    pub grad_accum_steps: usize,
    /// Optimizer steps of the whole run.
    pub max_steps: usize,
    /// Evaluate every this many steps (and at the first and last).
    pub eval_interval: usize,
    /// `steps` (every `eval_interval` steps) or `epoch` (JSONL data: each time the run has drawn
    /// as many rows as the training examples fill) [default: steps].
    #[serde(default, skip_serializing_if = "EvalStrategy::is_steps")]
    pub eval_strategy: EvalStrategy,
    /// Batches per split in each evaluation.
    pub eval_iters: usize,
    /// Write a metrics record every this many steps.
    #[serde(default = "one")]
    pub log_interval: usize,
    /// Save a checkpoint every this many steps (and at the end); 0: only at the end.
    #[serde(default)]
    pub checkpoint_interval: usize,
    /// Checkpoints kept in the run directory (older ones are deleted).
    #[serde(default = "two")]
    pub keep_checkpoints: usize,
    /// Seeds the initial weights and the batch sampler.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// dtype of the GEMMs: "f32", or "bf16"/"f16" mixed precision (f32 master weights and moments).
    #[serde(default)]
    pub precision: Precision,
    /// Recompute memory-bound activations in the backward pass (Burn's balanced checkpointing).
    #[serde(default)]
    pub activation_checkpointing: bool,
}

/// When a run evaluates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalStrategy {
    #[default]
    Steps,
    Epoch,
}

impl EvalStrategy {
    fn is_steps(&self) -> bool {
        *self == EvalStrategy::Steps
    }
}

/// Training precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    F16,
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            _ => Err(format!("precision `{s}`: expected f32, bf16 or f16")),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

impl Precision {
    pub fn dtype(self) -> burn::tensor::DType {
        match self {
            Self::F32 => burn::tensor::DType::F32,
            Self::Bf16 => burn::tensor::DType::BF16,
            Self::F16 => burn::tensor::DType::F16,
        }
    }
}

fn one() -> usize {
    1
}
fn two() -> usize {
    2
}
fn default_seed() -> u64 {
    1337
}

/// AdamW (Loshchilov and Hutter, 2019) with decoupled weight decay on matrices only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    #[serde(default = "beta1")]
    pub beta1: f64,
    #[serde(default = "beta2")]
    pub beta2: f64,
    #[serde(default = "eps")]
    pub eps: f64,
    /// Applied to parameters of rank >= 2 (projections, embedding); never to norm gains or biases.
    #[serde(default)]
    pub weight_decay: f64,
    /// Clip the global gradient norm (over all parameters) to this; 0 disables clipping.
    #[serde(default)]
    pub grad_clip: f64,
}

fn beta1() -> f64 {
    0.9
}
fn beta2() -> f64 {
    0.95
}
fn eps() -> f64 {
    1e-8
}

/// Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps`, then constant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    #[serde(default)]
    pub warmup_steps: usize,
    /// Step at which the cosine reaches `min_lr`; `train.max_steps` when absent.
    #[serde(default)]
    pub decay_steps: Option<usize>,
}

/// A config file as written, parsed and checked without opening anything but itself. `model` is
/// `None` where `[model]` is left out for the `init_from` model's: [`ConfigFile::resolve`] opens
/// the source (once) and takes it from there.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub config: TrainConfig<Option<ModelConfig>>,
}

/// What a config file is read for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A training run: every rule.
    Run,
    /// A speed measurement (`ember bench train`): LoRA adapters may sit on a random base, since
    /// the step's cost does not depend on the weights' values.
    Bench,
}

impl ConfigFile {
    pub fn read(path: &Path) -> Result<Self, TrainError> {
        Self::read_for(path, Purpose::Run)
    }

    pub fn read_for(path: &Path, purpose: Purpose) -> Result<Self, TrainError> {
        let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
        Self::parse_for(&text, path, purpose)
    }

    /// Syntax, keys and types, then every rule that does not need the model; errors name the file
    /// and the key.
    pub fn parse(text: &str, path: &Path) -> Result<Self, TrainError> {
        Self::parse_for(text, path, Purpose::Run)
    }

    pub fn parse_for(text: &str, path: &Path, purpose: Purpose) -> Result<Self, TrainError> {
        let syntax = |e: toml::de::Error| TrainError::Config {
            path: path.into(),
            message: match e.span() {
                // 1-based line and column of the fault, as editors count them.
                Some(span) => {
                    let before = &text[..span.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                    format!("line {line}, column {column}: {}", e.message())
                }
                None => e.message().to_string(),
            },
            key: toml_key(text, e.span()),
        };
        // Syntax first, as a plain table: its errors carry the line and column.
        toml::from_str::<toml::Table>(text).map_err(syntax)?;
        let config: TrainConfig<Option<ModelConfig>> = toml::from_str(text).map_err(|e| TrainError::Config {
            path: path.into(),
            message: e.message().to_string(),
            key: toml_key(text, e.span()),
        })?;
        config.validate_sections_for(purpose).map_err(|error| TrainError::Invalid { path: path.into(), error })?;
        Ok(Self { path: path.into(), config })
    }

    /// The config of a file that names its model: nothing is opened.
    pub fn complete(mut self) -> Result<TrainConfig, TrainError> {
        match self.config.model.take() {
            Some(model) => self.complete_with(model),
            None => Err(TrainError::Config {
                path: self.path,
                key: Some("model".into()),
                message: match self.config.init_from {
                    None => "missing: describe the model, or start from one with init_from".into(),
                    Some(_) => "left out for init_from's: the config must be resolved (ConfigFile::resolve)".into(),
                },
            }),
        }
    }

    /// The config with the architecture `model`, checked against the rules that need it.
    pub fn complete_with(self, model: ModelConfig) -> Result<TrainConfig, TrainError> {
        let config = self.config.with_model(model);
        config.validate_model().map_err(|error| TrainError::Invalid { path: self.path, error })?;
        Ok(config)
    }
}

impl TrainConfig {
    /// Reads a complete config file (one with `[model]`, as every run directory's config.toml):
    /// nothing but the file is opened; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self, TrainError> {
        ConfigFile::read(path)?.complete()
    }

    pub fn from_toml(text: &str, path: &Path) -> Result<Self, TrainError> {
        ConfigFile::parse(text, path)?.complete()
    }

    /// Makes the paths of the config absolute (relative ones are relative to the working
    /// directory), so that the copy saved in a run directory works from anywhere.
    pub fn absolutize_paths(&mut self) {
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        if let Some(p) = &self.data.path {
            self.data.path = Some(abs(p));
        }
        if let Some(t) = &self.data.tokenizer {
            if t.ends_with(".json") {
                self.data.tokenizer = Some(abs(Path::new(t)).display().to_string());
            }
        }
        self.init_from = self.init_from.as_ref().map(InitSource::absolute);
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }

    pub fn seq_len(&self) -> usize {
        self.train.seq_len.unwrap_or(self.model.max_seq_len)
    }

    /// Model FLOPs per token of a training step, for MFU: `6N + 12·L·T·d`, or with LoRA (a frozen
    /// base: no weight gradients but the adapters') `4N + 6·L·Σ r·(in + out) + 12·L·T·d`.
    pub fn train_flops_per_token(&self) -> f64 {
        match &self.lora {
            Some(lora) => self.model.lora_train_flops_per_token(self.seq_len(), lora.rank, &lora.targets),
            None => self.model.train_flops_per_token(self.seq_len()),
        }
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.train.batch_size * self.seq_len() * self.train.grad_accum_steps
    }

    /// Every rule, within and across sections. The model's own rules run once the vocabulary is
    /// known (a vocabulary of 0 comes from the tokenizer).
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        self.validate_sections()?;
        self.validate_model()
    }

    /// The rules that need the model: its own, and the sequence length within its context.
    fn validate_model(&self) -> Result<(), InvalidConfig> {
        if self.seq_len() == 0 || self.seq_len() > self.model.max_seq_len {
            return Err(InvalidConfig::Bounded {
                key: "train.seq_len",
                value: self.seq_len().to_string(),
                relation: Relation::OneTo,
                bound_key: "model.max_seq_len",
                bound: self.model.max_seq_len.to_string(),
            });
        }
        if self.model.vocab_size != 0 {
            self.model.validate()?;
        } else {
            // Everything but the vocabulary can be checked now.
            ModelConfig { vocab_size: 1, ..self.model.clone() }.validate()?;
        }
        Ok(())
    }
}

impl<M> TrainConfig<M> {
    /// The same config with the architecture `model`.
    pub fn with_model<N>(self, model: N) -> TrainConfig<N> {
        let Self { init_from, model: _, data, train, optim, schedule, lora, metrics, distributed } = self;
        TrainConfig { init_from, model, data, train, optim, schedule, lora, metrics, distributed }
    }

    pub fn decay_steps(&self) -> usize {
        self.schedule.decay_steps.unwrap_or(self.train.max_steps)
    }

    /// The rules of every section but `[model]`, then those across sections.
    pub fn validate_sections(&self) -> Result<(), InvalidConfig> {
        self.validate_sections_for(Purpose::Run)
    }

    /// [`Self::validate_sections`] for `purpose`.
    pub fn validate_sections_for(&self, purpose: Purpose) -> Result<(), InvalidConfig> {
        self.distributed.validate()?;
        self.metrics.validate()?;
        if let Some(lora) = &self.lora {
            lora.validate().map_err(InvalidConfig::Lora)?;
            if self.init_from.is_none() && purpose == Purpose::Run {
                return Err(InvalidConfig::LoraWithoutInit);
            }
        }
        self.data.validate()?;
        if self.data.format() == DataFormat::Text && self.train.eval_strategy == EvalStrategy::Epoch {
            return Err(InvalidConfig::JsonlOnly { key: "train.eval_strategy", value: "\"epoch\"".into() });
        }
        self.train.validate()?;
        self.optim.validate()?;
        self.schedule.validate()?;
        if self.schedule.warmup_steps > self.decay_steps() {
            return Err(InvalidConfig::Bounded {
                key: "schedule.warmup_steps",
                value: self.schedule.warmup_steps.to_string(),
                relation: Relation::NotAbove,
                // `decay_steps` is `train.max_steps` when absent.
                bound_key: if self.schedule.decay_steps.is_some() { "schedule.decay_steps" } else { "train.max_steps" },
                bound: self.decay_steps().to_string(),
            });
        }
        Ok(())
    }
}

impl MetricsConfig {
    fn validate(&self) -> Result<(), InvalidConfig> {
        if self.sinks.is_empty() {
            return Err(InvalidConfig::NoSinks);
        }
        // Far above any sensible sample; keeps the generation's buffers far from overflow.
        at_most("metrics.sample_tokens", self.sample_tokens, 1 << 20)
    }
}

impl DataConfig {
    fn validate(&self) -> Result<(), InvalidConfig> {
        if self.format() == DataFormat::Jsonl && self.path.is_none() {
            return Err(InvalidConfig::Needs { key: "data.format", value: "\"jsonl\"".into(), needs: "data.path" });
        }
        match (&self.dataset, &self.path) {
            (None, None) => return Err(InvalidConfig::NoData),
            (Some(dataset), Some(path)) => {
                return Err(InvalidConfig::TwoData { dataset: dataset.clone(), path: path.display().to_string() })
            }
            _ => {}
        }
        if self.format() == DataFormat::Text {
            if let Some(p) = self.packing {
                return Err(InvalidConfig::JsonlOnly { key: "data.packing", value: format!("\"{p}\"") });
            }
            if self.truncate {
                return Err(InvalidConfig::JsonlOnly { key: "data.truncate", value: "true".into() });
            }
        }
        match self.val_fraction {
            Some(f) if !(f > 0.0 && f < 1.0) => Err(out_of_range("data.val_fraction", f, "in (0, 1)")),
            _ => Ok(()),
        }
    }
}

impl LoopConfig {
    fn validate(&self) -> Result<(), InvalidConfig> {
        for (key, v) in [
            ("train.batch_size", self.batch_size),
            ("train.grad_accum_steps", self.grad_accum_steps),
            ("train.max_steps", self.max_steps),
            ("train.eval_interval", self.eval_interval),
            ("train.eval_iters", self.eval_iters),
            ("train.log_interval", self.log_interval),
            ("train.keep_checkpoints", self.keep_checkpoints),
        ] {
            if v == 0 {
                return Err(out_of_range(key, v, "at least 1"));
            }
        }
        // Bounds that keep every product of sizes (tokens per step, memory estimates, evaluation
        // work) far from overflow, each far above any sensible run.
        at_most("train.batch_size", self.batch_size, 1 << 20)?;
        at_most("train.grad_accum_steps", self.grad_accum_steps, 1 << 20)?;
        at_most("train.max_steps", self.max_steps, 1 << 40)?;
        at_most("train.eval_iters", self.eval_iters, 1 << 20)?;
        at_most("train.keep_checkpoints", self.keep_checkpoints, 1 << 20)
    }
}

impl OptimConfig {
    fn validate(&self) -> Result<(), InvalidConfig> {
        for (key, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(out_of_range(key, v, "in [0, 1)"));
            }
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return Err(out_of_range("optim.eps", self.eps, "positive"));
        }
        for (key, v) in [("optim.weight_decay", self.weight_decay), ("optim.grad_clip", self.grad_clip)] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(out_of_range(key, v, ">= 0"));
            }
        }
        Ok(())
    }
}

impl ScheduleConfig {
    /// The rates (the warmup against the decay steps, `train.max_steps` by default, is checked
    /// across sections).
    fn validate(&self) -> Result<(), InvalidConfig> {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(out_of_range("schedule.lr", self.lr, "positive"));
        }
        if !(self.min_lr >= 0.0 && self.min_lr.is_finite()) {
            return Err(out_of_range("schedule.min_lr", self.min_lr, ">= 0"));
        }
        if self.min_lr > self.lr {
            return Err(InvalidConfig::Bounded {
                key: "schedule.min_lr",
                value: self.min_lr.to_string(),
                relation: Relation::NotAbove,
                bound_key: "schedule.lr",
                bound: self.lr.to_string(),
            });
        }
        Ok(())
    }
}

fn out_of_range(key: &'static str, value: impl std::fmt::Display, rule: &'static str) -> InvalidConfig {
    InvalidConfig::OutOfRange { key, value: value.to_string(), rule }
}

fn at_most(key: &'static str, value: usize, limit: u64) -> Result<(), InvalidConfig> {
    match value as u64 {
        v if v > limit => Err(InvalidConfig::TooLarge { key, value: v, limit }),
        _ => Ok(()),
    }
}

/// The dotted key at a TOML error position: the section header above it and the key on its line.
fn toml_key(text: &str, span: Option<std::ops::Range<usize>>) -> Option<String> {
    let start = span?.start.min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let key = text[line_start..line_end].split('=').next()?.trim();
    let section = text[..line_start]
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix('[').and_then(|l| l.strip_suffix(']')))
        .map(str::trim);
    if key.is_empty() || key.starts_with('[') {
        return section.map(String::from);
    }
    Some(match section {
        Some(s) => format!("{s}.{key}"),
        None => key.to_string(),
    })
}

/// Parsed once, when the config is read (`init_from` in TOML is its text form).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum InitSource {
    Hf(PathBuf),
    Run(PathBuf),
}

impl TryFrom<String> for InitSource {
    type Error = String;
    /// The TOML error names the key; this says what is wrong with the value.
    fn try_from(spec: String) -> Result<Self, String> {
        Self::parse(&spec).map_err(|_| {
            format!("\"{spec}\" is neither `hf:DIR` (a Hugging Face folder) nor `run:DIR` (an ember run or checkpoint)")
        })
    }
}

impl From<InitSource> for String {
    fn from(s: InitSource) -> String {
        s.to_string()
    }
}

impl std::fmt::Display for InitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Hf(d) => write!(f, "hf:{}", d.display()),
            Self::Run(d) => write!(f, "run:{}", d.display()),
        }
    }
}

impl InitSource {
    /// The same source with its folder made absolute (relative to the working directory), so that
    /// a run directory's config works from anywhere.
    pub fn absolute(&self) -> Self {
        let abs = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
        match self {
            Self::Hf(d) => Self::Hf(abs(d)),
            Self::Run(d) => Self::Run(abs(d)),
        }
    }

    pub fn parse(spec: &str) -> Result<Self, TrainError> {
        match spec.split_once(':') {
            Some(("hf", dir)) if !dir.is_empty() => Ok(Self::Hf(dir.into())),
            Some(("run", dir)) if !dir.is_empty() => Ok(Self::Run(dir.into())),
            _ => Err(TrainError::InitFrom {
                spec: spec.into(),
                message: "expected `hf:DIR` (a Hugging Face folder) or `run:DIR` (an ember run or checkpoint)".into(),
            }),
        }
    }

    pub(crate) fn err(&self, message: impl Into<String>) -> TrainError {
        TrainError::InitFrom { spec: self.to_string(), message: message.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const NANO: &str = include_str!("../../../configs/nano.toml");

    fn parse(text: &str) -> Result<TrainConfig, String> {
        TrainConfig::from_toml(text, Path::new("c.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn nano_config_is_nanogpts_cpu_setting() {
        let c = parse(NANO).unwrap();
        assert_eq!((c.model.n_layers, c.model.n_heads, c.model.d_model), (4, 4, 128));
        assert_eq!((c.seq_len(), c.train.batch_size, c.train.max_steps), (64, 12, 2000));
        assert_eq!((c.schedule.lr, c.schedule.min_lr, c.schedule.warmup_steps), (1e-3, 1e-4, 100));
        assert_eq!((c.optim.beta1, c.optim.beta2, c.optim.weight_decay, c.optim.grad_clip), (0.9, 0.99, 0.1, 1.0));
        // Round trip through the resolved form saved in run directories.
        assert_eq!(parse(&c.to_toml()).unwrap(), c);
    }

    #[test]
    fn an_unknown_key_is_named_with_its_section() {
        let text = NANO.replace("n_layers = 4", "n_layers = 4\nn_kv_head = 2");
        let e = parse(&text).unwrap_err();
        assert!(e.contains("unknown field `n_kv_head`"), "{e}");
        assert!(e.contains("model.n_kv_head"), "{e}");
        assert!(e.starts_with("c.toml"), "{e}");
    }

    #[test]
    fn heads_not_divisible_by_kv_heads_is_an_error() {
        let text = NANO.replace("n_kv_heads = 4", "n_kv_heads = 3");
        assert_eq!(parse(&text).unwrap_err(), "c.toml: model.n_kv_heads (3) must divide model.n_heads (4)");
    }

    #[test]
    fn cross_section_rules() {
        let e = parse(&NANO.replace("warmup_steps = 100", "warmup_steps = 5000")).unwrap_err();
        assert!(e.contains("schedule.warmup_steps (5000)"), "{e}");
        let e = parse(&NANO.replace("batch_size = 12", "batch_size = 0")).unwrap_err();
        assert!(e.contains("train.batch_size must be at least 1"), "{e}");
        let e = parse(&NANO.replace("dataset = \"tinyshakespeare\"", "")).unwrap_err();
        assert!(e.contains("data: set `dataset`"), "{e}");
        let e = parse(&NANO.replace("lr = 1e-3", "lr = -1.0")).unwrap_err();
        assert!(e.contains("schedule.lr must be positive"), "{e}");
        let e = parse(&NANO.replace("batch_size = 12", "batch_size = \"twelve\"")).unwrap_err();
        assert!(e.contains("train.batch_size"), "{e}");
    }

    #[test]
    fn a_broken_rule_names_the_key_the_value_and_the_rule() {
        let nano = parse(NANO).unwrap();
        let mut c = nano.clone();
        c.train.batch_size = 0;
        let want = InvalidConfig::OutOfRange { key: "train.batch_size", value: "0".into(), rule: "at least 1" };
        assert_eq!(c.validate(), Err(want));
        let mut c = nano.clone();
        c.schedule.min_lr = 0.5;
        let e = c.validate().unwrap_err();
        assert!(matches!(e, InvalidConfig::Bounded { key: "schedule.min_lr", bound_key: "schedule.lr", .. }), "{e:?}");
        assert_eq!(e.to_string(), "schedule.min_lr (0.5) must not exceed schedule.lr (0.001)");
        let mut c = nano.clone();
        c.schedule.warmup_steps = 5000;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "schedule.warmup_steps (5000) must not exceed schedule.decay_steps (2000)");
        // Without decay_steps the bound is the key it defaults to.
        c.schedule.decay_steps = None;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "schedule.warmup_steps (5000) must not exceed train.max_steps (2000)");
        let mut c = nano.clone();
        c.data.packing = Some(Packing::Stream);
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "data.packing = \"stream\" applies to JSONL examples; this data is a text stream");
        let mut c = nano;
        c.train.max_steps = 1 << 41;
        let e = c.validate().unwrap_err().to_string();
        assert_eq!(e, "train.max_steps = 2199023255552 is larger than ember's limit of 1099511627776");
    }

    /// The text of NANO without its `[model]` section, starting from `init_from`.
    fn without_model(init_from: &str) -> String {
        let (head, rest) = NANO.split_once("[model]").unwrap();
        let tail = &rest[rest.find("\n[").unwrap()..];
        format!("init_from = \"{init_from}\"\n{head}{tail}")
    }

    #[test]
    fn parsing_opens_nothing_and_resolving_opens_the_source() {
        // A source that does not exist: parsing never looks at it.
        let text = without_model("run:/nonexistent/ember-run");
        let file = ConfigFile::parse(&text, Path::new("c.toml")).unwrap();
        assert_eq!(file.config.model, None);
        assert_eq!(file.config.init_from, Some(InitSource::Run("/nonexistent/ember-run".into())));
        // Nor does reading it as a complete config: that is an error naming the key.
        let e = file.clone().complete().unwrap_err().to_string();
        assert!(e.starts_with("c.toml: model: ") && e.contains("init_from"), "{e}");
        // Resolving opens it, and says what is wrong with it.
        let e = file.resolve().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ember-run") && e.contains("no such file"), "{e}");
        // Rules that do not need the model are checked when parsing.
        let e = ConfigFile::parse(&text.replace("batch_size = 12", "batch_size = 0"), Path::new("c.toml"));
        assert!(e.unwrap_err().to_string().contains("train.batch_size must be at least 1, found 0"));
    }
}

/// `[distributed]`: how the ranks of a data-parallel run cooperate (ignored by a single process).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedConfig {
    /// ZeRO-1: each rank keeps the AdamW moments of its share of the parameters (reduce-scatter of
    /// the gradients, all-gather of the updated parameters) instead of all of them.
    #[serde(default)]
    pub shard_optimizer: bool,
    /// Size of a gradient bucket in MiB (PyTorch DDP's default is 25).
    #[serde(default = "default_bucket_mib")]
    pub bucket_mib: usize,
    /// Seconds a rank waits for the others at a training step's synchronisation points before it
    /// names the ranks that did not arrive and stops the run.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// The same at start-up and at checkpoints, where ranks wait for slow work of others (data
    /// preparation, loading a model, rank 0 writing a checkpoint).
    #[serde(default = "default_io_timeout_s")]
    pub io_timeout_s: f64,
}

fn default_bucket_mib() -> usize {
    25
}
fn default_timeout_s() -> f64 {
    300.0
}
fn default_io_timeout_s() -> f64 {
    3600.0
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            shard_optimizer: false,
            bucket_mib: default_bucket_mib(),
            timeout_s: default_timeout_s(),
            io_timeout_s: default_io_timeout_s(),
        }
    }
}

impl DistributedConfig {
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        // MPI counts elements in a C int: a bucket stays below 2^31 f32 values.
        if self.bucket_mib == 0 || self.bucket_mib > 4096 {
            return Err(out_of_range("distributed.bucket_mib", self.bucket_mib, "in 1..=4096"));
        }
        for (key, v) in [("distributed.timeout_s", self.timeout_s), ("distributed.io_timeout_s", self.io_timeout_s)] {
            if !(v > 0.0 && v <= 7.0 * 86_400.0) {
                return Err(out_of_range(key, v, "in (0, 604800] seconds"));
            }
        }
        Ok(())
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_s)
    }

    pub fn io_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.io_timeout_s.max(self.timeout_s))
    }

    pub fn bucket_elems(&self) -> usize {
        self.bucket_mib * (1 << 20) / 4
    }
}
