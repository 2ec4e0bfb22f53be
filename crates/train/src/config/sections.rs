//! The schema: one struct per section of the config file, each key with its default and the reason
//! for it. The rules they must follow are in [`super::validate`].

use std::path::PathBuf;
use std::time::Duration;

use ember_data::finetune::Packing;
use serde::{Deserialize, Serialize};

use crate::error::UnknownPrecision;

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

/// AdamW (Loshchilov and Hutter, 2019) with decoupled weight decay on matrices only. Every key
/// has a default, and the section may be left out.
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

/// Muon (Jordan et al., 2024) for the hidden matrices: momentum, then the update orthogonalised by a
/// Newton–Schulz iteration, as `torch.optim.Muon` computes it. The section is optional: without it
/// every parameter trains with AdamW. With it, the 2-D weights inside the blocks (attention and MLP
/// projections) train with Muon and everything else (embedding, LM head, norms, biases) with AdamW
/// under `[optim]`. Muon's rate follows the `[schedule]` shape, scaled by `lr / schedule.lr`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MuonConfig {
    /// Peak learning rate of the Muon matrices (modded-nanogpt: 0.05 with `adjust_lr = "original"`).
    pub lr: f64,
    #[serde(default = "muon_momentum")]
    pub momentum: f64,
    /// Nesterov momentum: the iteration reads `lerp(grad, buf, momentum)` instead of `buf`.
    #[serde(default = "yes")]
    pub nesterov: bool,
    /// Newton–Schulz iterations (torch refuses 100 or more).
    #[serde(default = "ns_steps")]
    pub ns_steps: usize,
    /// The quintic's coefficients (a, b, c): `X <- a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`.
    #[serde(default = "ns_coefficients")]
    pub ns_coefficients: [f64; 3],
    /// Floor of the Frobenius norm the iteration's input is divided by.
    #[serde(default = "muon_eps")]
    pub eps: f64,
    /// Decoupled weight decay: `p <- p·(1 - lr·weight_decay)` before the update.
    #[serde(default)]
    pub weight_decay: f64,
    /// The shape scale of the rate (torch's `adjust_lr_fn`).
    #[serde(default)]
    pub adjust_lr: AdjustLr,
    /// The iteration's arithmetic: `f32`, or `bf16` as torch computes it (operands and results
    /// rounded to bf16, products accumulated in f32).
    #[serde(default)]
    pub ns_dtype: NsDtype,
    /// Muon on LoRA's adapter matrices too (by default they train with AdamW).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lora: bool,
}

/// How Muon scales its rate by a matrix's shape, for a weight of `fan_out × fan_in` (torch's
/// orientation; ember stores linear weights as `[fan_in, fan_out]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// Keller Jordan's `lr · max(1, fan_out / fan_in)^½`.
    #[default]
    Original,
    /// Moonshot's `lr · 0.2 · max(fan_out, fan_in)^½`: the update's RMS matches AdamW's, so AdamW's
    /// rate and weight decay carry over.
    MatchRmsAdamw,
}

/// The Newton–Schulz iteration's arithmetic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NsDtype {
    #[default]
    F32,
    Bf16,
}

/// Preference tuning: each JSONL line is a pair of answers to one prompt (`prompt`, `chosen`,
/// `rejected`), and the loss rewards the chosen over the rejected (TRL's `DPOTrainer`,
/// `CPOTrainer` with SimPO, `ORPOTrainer`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreferenceConfig {
    /// `dpo` (sigmoid), `ipo`, `simpo` or `orpo` [default: dpo].
    #[serde(default)]
    pub method: PreferenceMethod,
    /// β: DPO's and IPO's strength of the reference (IPO's τ), SimPO's reward scale, ORPO's λ
    /// [default: 0.1, TRL's].
    #[serde(default = "beta")]
    pub beta: f64,
    /// `dpo` and `simpo`: the probability that a pair's labels are flipped (conservative DPO),
    /// in [0, 0.5) [default: 0].
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub label_smoothing: f64,
    /// `simpo`: the target reward margin γ [default: 0.5, TRL's `simpo_gamma`].
    #[serde(default = "simpo_gamma", skip_serializing_if = "is_default_simpo_gamma")]
    pub simpo_gamma: f64,
    /// Adds this times the chosen answers' NLL (per token, over the step) to the loss: RPO, TRL's
    /// `loss_type = ["sigmoid", "sft"]` with `loss_weights = [1, w]`; it keeps the chosen answers
    /// likely while the pair's margin grows. ORPO has the NLL term already (weight 1 + this)
    /// [default: 0].
    #[serde(default)]
    pub sft_weight: f64,
}

/// `[rl]`: online reinforcement learning with verifiable rewards (TRL's `GRPOTrainer`): each
/// prompt of a step (`train.batch_size` per micro-batch, from the JSONL at `data.path`) is answered
/// `group_size` times by the policy, the answers scored by `[[rl.rewards]]`, and the policy moved
/// toward the answers that scored above their group's mean by the clipped importance ratio.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlConfig {
    /// `grpo`: group-relative advantages (DAPO, Dr. GRPO and GSPO are its `loss` and
    /// `importance` settings) [default: grpo].
    #[serde(default)]
    pub method: RlMethod,
    /// How the per-token losses become the step's (TRL's `loss_type`): `grpo` (mean per answer,
    /// then over answers), `bnpo` (mean over a micro-batch's tokens), `dr_grpo` (sum over answers'
    /// tokens / (answers × max_new_tokens)), `dapo` (sum over the step's tokens / the step's tokens)
    /// [default: dapo, TRL's].
    #[serde(default)]
    pub loss: RlLoss,
    /// The importance ratio per `token`, or per `sequence` (the geometric mean of an answer's token
    /// ratios: GSPO) [default: token].
    #[serde(default)]
    pub importance: Importance,
    /// G: answers sampled per prompt, at least 2 (the advantage compares them) [default: 8].
    #[serde(default = "group_size")]
    pub group_size: usize,
    /// Tokens an answer may take [default: 256].
    #[serde(default = "max_new_tokens")]
    pub max_new_tokens: usize,
    /// The sampling temperature; the policy's log-probabilities are taken at the same temperature
    /// (TRL's) [default: 1.0].
    #[serde(default = "one_f64")]
    pub temperature: f64,
    /// Nucleus sampling, in (0, 1] [default: 1.0, off].
    #[serde(default = "one_f64")]
    pub top_p: f64,
    /// Sample among the `top_k` most likely tokens only [default: off].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    /// An answer ends after any of these texts (kept in the answer), besides the model's
    /// end-of-sequence token [default: none].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// ε: the ratio is clipped to [1 − ε, 1 + epsilon_high] [default: 0.2].
    #[serde(default = "epsilon")]
    pub epsilon: f64,
    /// The upper clip (DAPO's clip-higher: 0.28) [default: epsilon].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon_high: Option<f64>,
    /// β: weight of the KL divergence to the starting model (k3 estimator, per token) [default: 0,
    /// TRL's].
    #[serde(default)]
    pub beta: f64,
    /// μ: optimisation steps per generation of answers (the later ones reuse the answers, their
    /// ratios against the log-probabilities at generation) [default: 1].
    #[serde(default = "one")]
    pub num_iterations: usize,
    /// The advantage's scale: `group` (divided by the group's standard deviation), `batch` (by the
    /// step's) or `none` (Dr. GRPO) [default: group].
    #[serde(default)]
    pub scale_rewards: ScaleRewards,
    /// Answers cut by max_new_tokens are left out of the loss (DAPO's overlong filtering)
    /// [default: false].
    #[serde(default)]
    pub mask_truncated: bool,
    /// Write the prompts, answers, rewards and advantages of every `log_rollouts`-th step to
    /// `<run>/rollouts.jsonl` (0: never) [default: 10].
    #[serde(default = "log_rollouts")]
    pub log_rollouts: usize,
    /// The rewards, summed with their weights (at least one).
    #[serde(default)]
    pub rewards: Vec<RewardConfig>,
}

/// The algorithms of `[rl]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RlMethod {
    #[default]
    Grpo,
}

/// TRL's `loss_type`s of the clipped objective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RlLoss {
    Grpo,
    Bnpo,
    DrGrpo,
    #[default]
    Dapo,
}

/// TRL's `importance_sampling_level`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Importance {
    #[default]
    Token,
    Sequence,
}

/// TRL's `scale_rewards`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleRewards {
    #[default]
    Group,
    Batch,
    None,
}

/// One of `[[rl.rewards]]`: a scorer of answers and its weight in the sum. Each kind takes its own
/// keys (`column`, `pattern`, `limit`, `command`); another kind's key is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    pub kind: RewardKind,
    /// The reward's name in the metrics (`rewards/<name>/mean`) [default: its kind].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its weight in the sum [default: 1].
    #[serde(default = "one_f64")]
    pub weight: f64,
    /// `gsm8k` and `exact`: the row's column holding the answer [default for gsm8k: "answer"].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// `regex`: the regular expression (Rust's `regex` syntax).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// `length`: tokens an answer may take before it is penalised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// `command`: the program, run by `sh -c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
}

/// What a reward scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardKind {
    /// 1 when the answer's final number (after its last `####`, else the last number it writes)
    /// equals the row's `column` (GSM8K's `answer`: the number after its `####`), else 0.
    Gsm8k,
    /// 1 when the answer, trimmed, equals the row's `column` (a string or a number), trimmed.
    Exact,
    /// 1 when the answer matches the regular expression `pattern`, else 0.
    Regex,
    /// `-(tokens − limit)` for an answer longer than `limit` tokens, else 0.
    Length,
    /// A program (run by `sh -c`) that reads a JSON line per answer on stdin (the row's columns,
    /// `prompt` among them, `prompt_text` as the model read it, and `completion`) and writes one
    /// number a line.
    Command,
}

impl RewardKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gsm8k => "gsm8k",
            Self::Exact => "exact",
            Self::Regex => "regex",
            Self::Length => "length",
            Self::Command => "command",
        }
    }

    /// The kind's own keys: `(key, required)`.
    pub fn keys(self) -> &'static [(&'static str, bool)] {
        match self {
            Self::Gsm8k => &[("column", false)],
            Self::Exact => &[("column", true)],
            Self::Regex => &[("pattern", true)],
            Self::Length => &[("limit", true)],
            Self::Command => &[("command", true)],
        }
    }
}

impl RewardConfig {
    /// The name of the reward in the metrics.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(self.kind.as_str())
    }

    /// The kind-specific keys this reward sets.
    pub fn set_keys(&self) -> Vec<&'static str> {
        let set = [
            ("column", self.column.is_some()),
            ("pattern", self.pattern.is_some()),
            ("limit", self.limit.is_some()),
            ("command", self.command.is_some()),
        ];
        set.iter().filter(|(_, s)| *s).map(|(k, _)| *k).collect()
    }
}

impl RlConfig {
    /// The upper clip of the ratio.
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }
}

fn group_size() -> usize {
    8
}
fn max_new_tokens() -> usize {
    256
}
fn one_f64() -> f64 {
    1.0
}
fn epsilon() -> f64 {
    0.2
}
fn log_rollouts() -> usize {
    10
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

/// The preference losses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreferenceMethod {
    /// Direct preference optimisation: `-log σ(β·((π_c − ref_c) − (π_r − ref_r)))`, summed
    /// log-probabilities of the answers, against a frozen reference (the starting model).
    #[default]
    Dpo,
    /// IPO: `((π_c − ref_c)/n_c − (π_r − ref_r)/n_r − 1/(2β))²`, log-probabilities per token.
    Ipo,
    /// SimPO, reference-free: `-log σ(β·(π_c/n_c − π_r/n_r) − γ)`.
    Simpo,
    /// ORPO, reference-free: the chosen answer's token-mean NLL minus `β·log σ(log odds ratio)`
    /// of the per-token log-probabilities.
    Orpo,
}

impl PreferenceMethod {
    /// Whether the loss compares with the reference model's log-probabilities.
    pub fn needs_reference(self) -> bool {
        matches!(self, Self::Dpo | Self::Ipo)
    }
}

impl std::fmt::Display for PreferenceMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dpo => "dpo",
            Self::Ipo => "ipo",
            Self::Simpo => "simpo",
            Self::Orpo => "orpo",
        })
    }
}

fn beta() -> f64 {
    0.1
}
fn simpo_gamma() -> f64 {
    0.5
}
fn is_default_simpo_gamma(g: &f64) -> bool {
    *g == simpo_gamma()
}
fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

fn muon_momentum() -> f64 {
    0.95
}
fn yes() -> bool {
    true
}
fn ns_steps() -> usize {
    5
}
fn ns_coefficients() -> [f64; 3] {
    [3.4445, -4.7750, 2.0315]
}
fn muon_eps() -> f64 {
    1e-7
}

/// Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps`, then constant. Every key
/// has a default, and the section may be left out; the defaults that depend on other keys are
/// filled in when the file is read (`config::defaults`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Peak learning rate [default: with `[lora]` 2e-4, 1e-4 with `[preference]`, 5e-5 with
    /// `[rl]`; for every weight of an `init_from` model 5e-5, 1e-6 with `[preference]` or `[rl]`
    /// (TRL's); from scratch 6e-4: `config::defaults`].
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    /// [default: `decay_steps / 20`].
    #[serde(default)]
    pub warmup_steps: usize,
    /// Step at which the cosine reaches `min_lr`; `train.max_steps` when absent.
    #[serde(default)]
    pub decay_steps: Option<usize>,
    /// `cosine` (default), or `wsd`: warmup, the rate held, then a linear cool-down to `min_lr`
    /// ending at `decay_steps`.
    #[serde(default, skip_serializing_if = "is_cosine")]
    pub shape: ScheduleShape,
    /// With `shape = "wsd"`: the fraction of `decay_steps` the cool-down takes, in (0, 1].
    #[serde(default = "cooldown_frac", skip_serializing_if = "is_default_cooldown_frac")]
    pub cooldown_frac: f64,
}

/// The learning rate's course after the warmup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleShape {
    /// Cosine decay from `lr` to `min_lr` (nanoGPT).
    #[default]
    Cosine,
    /// Warmup-stable-decay: `lr` held, then a linear cool-down (modded-nanogpt, MiniCPM).
    Wsd,
}

fn is_cosine(s: &ScheduleShape) -> bool {
    *s == ScheduleShape::Cosine
}
fn cooldown_frac() -> f64 {
    0.4
}
fn is_default_cooldown_frac(f: &f64) -> bool {
    *f == cooldown_frac()
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

    pub fn serialize<S: Serializer>(seed: &u64, s: S) -> Result<S::Ok, S::Error> {
        match i64::try_from(*seed) {
            Ok(v) => s.serialize_i64(v),
            Err(_) => s.serialize_str(&seed.to_string()),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
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
