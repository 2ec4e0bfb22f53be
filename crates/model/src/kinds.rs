//! What the parts of a model config are made of, below every part: the error a config that cannot
//! be built gives, and the kinds of norm, feed-forward and positions. Parts and the config that
//! composes them import this module; it imports none of them.

use serde::{Deserialize, Serialize};

/// A model configuration that cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("model.{name} must be positive, found {value}")]
    NotPositive { name: &'static str, value: f64 },
    #[error("model.{divisor} ({divisor_value}) must divide model.{dividend} ({dividend_value})")]
    NotDivisible { divisor: &'static str, divisor_value: usize, dividend: &'static str, dividend_value: usize },
    #[error("model.head_dim must be even for RoPE, found {0}")]
    OddHeadDim(usize),
    #[error("model.dropout must be in [0, 1), found {0}")]
    Dropout(f64),
    #[error("model.vocab_size is not set (a training config may leave it out only when a tokenizer supplies it)")]
    VocabUnset,
    #[error("model.{name} = {value} is larger than ember's limit of {limit}")]
    TooLarge { name: &'static str, value: u64, limit: u64 },
    #[error("model.{key} needs {needs}")]
    Needs { key: &'static str, needs: &'static str },
}

/// What a part's config answers without building the part: its rules, its size and cost, its LoRA
/// projections and its memory. The model's totals sum over its parts' answers; a block's
/// variants (grouped or latent attention, an MLP or experts) are each one implementation.
pub(crate) trait PartConfig {
    fn validate(&self) -> Result<(), ConfigError>;
    /// Its parameters.
    fn params(&self) -> u64;
    /// Weights a token multiplies by (its share of the N of 6N).
    fn matmul_params(&self) -> u64;
    /// `(in, out)` of the projection `target` names, if the part has it.
    fn projection(&self, target: Target) -> Option<(usize, usize)>;
    /// The f32 values autodiff keeps per token at context `seq_len`.
    fn activations(&self, seq_len: usize) -> u64;
}

/// What an attention part's config answers besides.
pub(crate) trait AttentionPart: PartConfig {
    /// The width of the score and value products per position (for FLOP counts).
    fn width(&self) -> f64;
    /// Numbers a position takes in the cache's key pool and value pool.
    fn cache_widths(&self) -> (usize, usize);
}

/// A norm.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// RMSNorm, `x / rms(x) · w` (Llama, Qwen, Mistral).
    #[default]
    RmsNorm,
    /// Gemma's RMSNorm, `x / rms(x) · (1 + w)`: the weight is stored as its difference from one.
    RmsNormPlusOne,
    /// LayerNorm, `(x − mean(x)) / std(x) · w (+ b)` (GPT-2).
    LayerNorm,
}

/// A feed-forward part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// `down(silu(gate(x)) ⊙ up(x))` (Llama, Qwen, Mistral).
    #[default]
    Swiglu,
    /// `down(gelu_tanh(gate(x)) ⊙ up(x))` (Gemma).
    Geglu,
    /// `down(gelu_tanh(up(x)))`: GPT-2 as Hugging Face runs it (`gelu_new`).
    Gelu,
    /// `down(gelu(up(x)))` with the exact erf GELU: nanoGPT's (`nn.GELU()`).
    GeluExact,
    /// `down(relu(up(x))²)`: squared ReLU (So et al., 2021; the modded-nanogpt speedrun's).
    Relu2,
}

impl MlpKind {
    /// Whether the part has a gate projection.
    pub(crate) fn gated(self) -> bool {
        matches!(self, MlpKind::Swiglu | MlpKind::Geglu)
    }
}

/// How positions enter the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Positions {
    /// Rotary embeddings of the queries and keys.
    #[default]
    Rope,
    /// A learned table `[max_seq_len, d_model]` added to the token embeddings (GPT-2's `wpe`).
    Learned,
}

/// Init standard deviations must be positive and finite (the output projections' may be 0:
/// `zero_init_out`).
pub(crate) fn positive_std(init_std: f64, out_std: f64) -> Result<(), ConfigError> {
    if !(init_std > 0.0 && init_std.is_finite()) {
        return Err(ConfigError::NotPositive { name: "init_std", value: init_std });
    }
    if !(out_std >= 0.0 && out_std.is_finite()) {
        return Err(ConfigError::NotPositive { name: "init_std / sqrt(2 n_layers)", value: out_std });
    }
    Ok(())
}

/// A projection an adapter can target, spelled in configs as Hugging Face names the module (and
/// peft's `target_modules` does): `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
/// `down_proj`. The one table of them: [`Target::ALL`], [`Target::name`], [`Target::shape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::QProj,
        Target::KProj,
        Target::VProj,
        Target::OProj,
        Target::GateProj,
        Target::UpProj,
        Target::DownProj,
    ];

    /// Which of the attention's four projections, q, k, v, o, `self` is (0 to 3); `None` for an
    /// MLP's.
    pub(crate) fn attention_slot(self) -> Option<usize> {
        Target::ALL[..4].iter().position(|&t| t == self)
    }

    /// The Hugging Face module name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Target::QProj => "q_proj",
            Target::KProj => "k_proj",
            Target::VProj => "v_proj",
            Target::OProj => "o_proj",
            Target::GateProj => "gate_proj",
            Target::UpProj => "up_proj",
            Target::DownProj => "down_proj",
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
