//! The sections of what a step optimizes besides the next token: `[preference]` (pairs of
//! answers) and `[rl]` with its `[[rl.rewards]]` (answers sampled and scored).

use serde::{Deserialize, Serialize};

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
    /// A JSON Schema file: every answer (sampled and held-out) is generated under it, the
    /// tokens each step may take masked to those that keep the answer valid JSON of the schema
    /// (compact, properties in the schema's order). Checked (read, parsed, compiled for the
    /// tokenizer) before training starts; a keyword the grammar engine does not implement is
    /// refused [default: none].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<std::path::PathBuf>,
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
    #[serde(default = "super::one")]
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
    pub(crate) fn set_keys(&self) -> Vec<&'static str> {
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
    pub(crate) fn epsilon_high(&self) -> f64 {
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
