//! The schema: one struct per section of the config file, each key with its default and the reason
//! for it. The rules they must follow are in [`super::validate`].
//!
//! Here the sections of the run: `[data]`, `[train]` (the loop), `[metrics]`, `[eval]` and
//! `[distributed]`; [`optim`]: AdamW, Muon and the schedule; [`objective`]: `[preference]` and
//! `[rl]`, what a step optimizes besides the next token.

use std::path::PathBuf;
use std::time::Duration;

use ember_data::finetune::Packing;
use serde::{Deserialize, Serialize};

use crate::error::UnknownPrecision;

mod objective;
mod optim;

pub use objective::{
    Importance, PreferenceConfig, PreferenceMethod, RewardConfig, RewardKind, RlConfig, RlLoss, RlMethod, ScaleRewards,
};
pub use optim::{AdjustLr, MuonConfig, NsDtype, OptimConfig, ScheduleConfig, ScheduleShape};

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
    /// The text sampled from [default: a newline]. (Left out of the run directory's copy at its
    /// default, as are the other keys below whose effect depends on other keys: a copy read back
    /// as a file holds no key where it has no effect, `config::effect`.)
    #[serde(default = "default_sample_prompt", skip_serializing_if = "is_default_sample_prompt")]
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
fn is_default_sample_prompt(p: &str) -> bool {
    p == "\n"
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
    /// value when absent (0.1 for a file). 0: no validation (evaluations score the training split
    /// and the benchmark tasks only; the run keeps no best checkpoint).
    #[serde(default)]
    pub val_fraction: Option<f64>,
    /// A separate validation file of the same format as `path` (the training file is then used
    /// whole; `val_fraction` does not apply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
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
    pub(crate) fn packing(&self) -> Packing {
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
    /// Sequences per micro-batch [default: 8, Hugging Face Trainer's and TRL's; filled in when the
    /// file is read, `config::defaults`].
    pub batch_size: usize,
    /// Tokens per sequence [default: JSONL examples: the longest, rounded up to a multiple of
    /// 64; text: `model.max_seq_len`; either at most 2048 for a model from `init_from`].
    #[serde(default)]
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step (gradients are averaged over them).
    #[serde(default = "one")]
    pub grad_accum_steps: usize,
    /// Optimizer steps of the whole run; or [`Self::num_epochs`] instead.
    #[serde(default)]
    pub max_steps: usize,
    /// JSONL data: passes over the training rows instead of `max_steps`, which becomes
    /// `ceil(num_epochs × rows / (batch_size × grad_accum_steps × ranks))` once the data is loaded
    /// (the run directory's config.toml keeps that `max_steps`). Fractions are allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_epochs: Option<f64>,
    /// Evaluate every this many steps (and at the first and last) [default: `max_steps / 10`, at
    /// least 1: ten evaluations a run]; not used with `eval_strategy = "epoch"` (0 there).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub eval_interval: usize,
    /// `steps` (every `eval_interval` steps) or `epoch` (JSONL data: each time the run has drawn
    /// as many rows as the training examples fill) [default: steps].
    #[serde(default, skip_serializing_if = "EvalStrategy::is_steps")]
    pub eval_strategy: EvalStrategy,
    /// Batches per split in each evaluation (of the train split only for JSONL data, whose
    /// held-out examples are all scored) [default: 20, nanoGPT's CPU setting].
    #[serde(default = "default_eval_iters")]
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
    /// Stop at the first evaluation (after step 0) whose val loss is at or below this, checkpointed
    /// as at the end of a run: time to target (`ember bench target`). Finite, above 0 [default: none:
    /// train to `max_steps`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_val_loss: Option<f64>,
    /// Seeds the initial weights and the batch sampler.
    #[serde(default = "default_seed", with = "seed_u64")]
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
    type Err = UnknownPrecision;
    fn from_str(s: &str) -> Result<Self, UnknownPrecision> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            _ => Err(UnknownPrecision(s.into())),
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
fn is_zero(n: &usize) -> bool {
    *n == 0
}
fn two() -> usize {
    2
}
fn default_seed() -> u64 {
    1337
}
fn default_eval_iters() -> usize {
    20
}

/// `[eval]`: benchmark tasks scored at every evaluation of the run (crates/eval: lm-evaluation-
/// harness's definitions), written beside the val loss as `eval/<task>/<metric>` and `eval/core`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalTasksConfig {
    /// Task names as `ember eval --tasks` takes them, each optionally `NAME:N` (its first N items):
    /// `["hellaswag:500", "arc_easy"]`.
    pub tasks: Vec<String>,
    /// The folder of the evaluation sets, laid out as shared/evals [default: $EMBER_EVAL_DIR].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<std::path::PathBuf>,
    /// Few-shot exemplars before each item [default: each task's own, 0 but for GSM8K].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_fewshot: Option<usize>,
    /// Seed of the few-shot draws [default: 1234, the harness's].
    #[serde(default = "fewshot_seed", skip_serializing_if = "is_default_fewshot_seed", with = "seed_u64")]
    pub seed: u64,
}

fn fewshot_seed() -> u64 {
    1234
}
fn is_default_fewshot_seed(s: &u64) -> bool {
    *s == fewshot_seed()
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
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_s)
    }

    pub(crate) fn io_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.io_timeout_s.max(self.timeout_s))
    }

    pub(crate) fn bucket_elems(&self) -> usize {
        self.bucket_mib * (1 << 20) / 4
    }
}

/// Seeds are u64 and TOML's integers i64: a seed above 2^63 − 1 (`ember bench target --seed`) is
/// written as the string of its digits, and either form is read back (issue 57: serialising it
/// panicked).
mod seed_u64 {
    use serde::{de, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(seed: &u64, s: S) -> Result<S::Ok, S::Error> {
        match i64::try_from(*seed) {
            Ok(v) => s.serialize_i64(v),
            Err(_) => s.serialize_str(&seed.to_string()),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(Seed)
    }

    struct Seed;

    impl de::Visitor<'_> for Seed {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "an integer from 0 to {} (above {}, as a string of digits)", u64::MAX, i64::MAX)
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            v.parse().map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
        }
    }
}
