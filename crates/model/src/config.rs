//! Model hyper-parameters, their validation, and what follows from them without building the model:
//! the parameter count and the FLOPs per token.

use serde::{Deserialize, Serialize};

use ember_kernels::rope::Rope;
pub use ember_kernels::rope::{RopeLayout, RopeScaling};

/// Architecture of a Llama-style decoder. Hugging Face `config.json` names in brackets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Vocabulary size [vocab_size]. In a training config it may be left out (0): the tokenizer's is taken.
    #[serde(default)]
    pub vocab_size: usize,
    /// Model width [hidden_size].
    pub d_model: usize,
    /// Number of blocks [num_hidden_layers].
    pub n_layers: usize,
    /// Query heads [num_attention_heads].
    pub n_heads: usize,
    /// Key/value heads [num_key_value_heads]; must divide `n_heads`. Defaults to `n_heads` (MHA).
    #[serde(default)]
    pub n_kv_heads: Option<usize>,
    /// Per-head width [head_dim]; defaults to `d_model / n_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// SwiGLU hidden width [intermediate_size].
    pub d_ff: usize,
    /// Longest sequence the RoPE tables cover [max_position_embeddings].
    pub max_seq_len: usize,
    /// RoPE base [rope_theta]. 10,000 for Llama 2, 500,000 for Llama 3, 1,000,000 for Qwen2.5.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Which channels RoPE pairs up.
    #[serde(default)]
    pub rope_layout: RopeLayout,
    /// Frequency scaling for contexts beyond the pretraining length [rope_scaling].
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Each query sees at most this many keys, itself included (Mistral v0.1: 4096) [sliding_window].
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// RMSNorm epsilon [rms_norm_eps].
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Bias on the q/k/v projections (Qwen2: true; Llama, Mistral: false).
    #[serde(default)]
    pub qkv_bias: bool,
    /// LM head shares the embedding table [tie_word_embeddings].
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Standard deviation of the normal init (GPT-2: 0.02). Output projections get it over sqrt(2 L).
    #[serde(default = "default_init_std")]
    pub init_std: f64,
    /// Dropout on the embedding output and on each block's attention and MLP outputs during training
    /// (nanoGPT's resid/embedding dropout; 0 turns it off).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropout: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_norm_eps() -> f64 {
    1e-5
}
fn default_init_std() -> f64 {
    0.02
}

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
}

/// Upper bounds on a config's sizes, checked before anything is allocated: far above any released
/// model of this family (Llama 3 405B: d_model 16,384, 126 layers, 128 heads, d_ff 53,248; Gemma's
/// 262,144-token vocabulary; 1M-token contexts), low enough that products of them cannot overflow.
pub(crate) const LIMITS: [(&str, u64); 8] = [
    ("vocab_size", 1 << 24),
    ("d_model", 1 << 16),
    ("n_layers", 1 << 10),
    ("n_heads", 1 << 10),
    ("n_kv_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("d_ff", 1 << 20),
    ("max_seq_len", 1 << 20),
];

/// Parameters a config may describe (4.4 trillion).
pub(crate) const MAX_PARAMS: u64 = 1 << 42;

impl ModelConfig {
    /// The RoPE tables of this model (its base, layout and scaling), `[T_max, Dh/2]`.
    pub(crate) fn rope<B: burn::tensor::backend::Backend>(&self, device: &B::Device) -> Rope<B> {
        let scaling = self.rope_scaling.as_ref();
        Rope::with_scaling(self.max_seq_len, self.head_dim(), self.rope_theta, self.rope_layout, scaling, device)
    }
}

impl ModelConfig {
    /// Key/value heads, `n_heads` when not given.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Per-head width, `d_model / n_heads` when not given.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Checks every rule `init` relies on, so that building never panics on a bad config: the
    /// sizes, then each part's own rules, then the model-wide ones.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_sizes()?;
        if self.n_kv_heads() == 0 {
            return Err(ConfigError::NotPositive { name: "n_kv_heads", value: 0.0 });
        }
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_heads) {
            return Err(ConfigError::NotDivisible {
                divisor: "n_heads",
                divisor_value: self.n_heads,
                dividend: "d_model",
                dividend_value: self.d_model,
            });
        }
        self.block().validate()?;
        if let Some(scaling) = &self.rope_scaling {
            validate_rope_scaling(scaling)?;
        }
        for (name, value) in [("rope_theta", self.rope_theta), ("init_std", self.init_std)] {
            if !(value > 0.0 && value.is_finite()) {
                return Err(ConfigError::NotPositive { name, value });
            }
        }
        let params = self.num_params();
        if params > MAX_PARAMS {
            return Err(ConfigError::TooLarge { name: "parameter count", value: params, limit: MAX_PARAMS });
        }
        Ok(())
    }

    /// Every size positive (the vocabulary set) and within [`LIMITS`].
    fn validate_sizes(&self) -> Result<(), ConfigError> {
        if self.vocab_size == 0 {
            return Err(ConfigError::VocabUnset);
        }
        let sizes = [
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
            ("max_seq_len", self.max_seq_len),
        ];
        if let Some((name, _)) = sizes.into_iter().find(|&(_, value)| value == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        let values = [
            self.vocab_size,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads(),
            self.head_dim.unwrap_or(0),
            self.d_ff,
            self.max_seq_len,
        ];
        for ((name, limit), value) in LIMITS.into_iter().zip(values) {
            if value as u64 > limit {
                return Err(ConfigError::TooLarge { name, value: value as u64, limit });
            }
        }
        Ok(())
    }

    /// The config of every block's attention.
    pub(crate) fn attention(&self) -> AttentionConfig {
        AttentionConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads(),
            head_dim: self.head_dim(),
            qkv_bias: self.qkv_bias,
            sliding_window: self.sliding_window,
            init_std: self.init_std,
            out_std: self.residual_out_std(),
        }
    }

    /// The config of every block's MLP.
    pub(crate) fn mlp(&self) -> MlpConfig {
        MlpConfig { d_model: self.d_model, d_ff: self.d_ff, init_std: self.init_std, out_std: self.residual_out_std() }
    }

    /// The config of every RMSNorm of the model.
    pub(crate) fn norm(&self) -> RmsNormConfig {
        RmsNormConfig { d_model: self.d_model, eps: self.norm_eps }
    }

    /// The config of every block.
    pub(crate) fn block(&self) -> BlockConfig {
        BlockConfig { attention: self.attention(), mlp: self.mlp(), norm: self.norm(), dropout: self.dropout }
    }

    /// GPT-2's init of the projections that write into the residual stream: `init_std / sqrt(2L)`,
    /// two such branches per block.
    fn residual_out_std(&self) -> f64 {
        self.init_std / (2.0 * self.n_layers as f64).sqrt()
    }

    /// Total number of parameters, computed from the config alone.
    ///
    /// Per block: q/k/v/o projections `D·H·Dh + 2·D·K·Dh + H·Dh·D` (+ `H·Dh + 2·K·Dh` bias), SwiGLU
    /// `3·D·F`, two RMSNorm gains `2·D`. Plus the embedding `V·D`, the final norm `D`, and an untied head `D·V`.
    pub fn num_params(&self) -> u64 {
        let (d, v, l) = (self.d_model as u64, self.vocab_size as u64, self.n_layers as u64);
        let q = (self.n_heads * self.head_dim()) as u64;
        let kv = (self.n_kv_heads() * self.head_dim()) as u64;
        let bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        let block = d * q + 2 * d * kv + q * d + bias + 3 * d * self.d_ff as u64 + 2 * d;
        let head = if self.tie_embeddings { 0 } else { d * v };
        v * d + l * block + d + head
    }

    /// Parameters that take part in matmuls: every projection and the LM head (the embedding table
    /// when tied). Not the embedding lookup, the norm gains or the biases. This is N in 6N.
    pub fn matmul_params(&self) -> u64 {
        let (d, v, l) = (self.d_model as u64, self.vocab_size as u64, self.n_layers as u64);
        let q = (self.n_heads * self.head_dim()) as u64;
        let kv = (self.n_kv_heads() * self.head_dim()) as u64;
        l * (d * q + 2 * d * kv + q * d + 3 * d * self.d_ff as u64) + d * v
    }

    /// Forward FLOPs per token at context `seq_len`: `2N + 4·L·T·(H·Dh)` (PaLM appendix B; a
    /// multiply-add is 2 FLOPs; the attention term counts the full T×T score matrix, as MFU does).
    /// `H·Dh` is the attention width, equal to `d_model` for Llama and Qwen2.
    pub(crate) fn forward_flops_per_token(&self, seq_len: usize) -> f64 {
        let attn_width = (self.n_heads * self.head_dim()) as f64;
        2.0 * self.matmul_params() as f64 + 4.0 * self.n_layers as f64 * seq_len as f64 * attn_width
    }

    /// Training FLOPs per token (forward and backward): `6N + 12·L·T·(H·Dh)`.
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        3.0 * self.forward_flops_per_token(seq_len)
    }
}

/// Checks Hugging Face's `rope_scaling` factors: each positive and finite, the high-frequency
/// factor above the low one.
fn validate_rope_scaling(scaling: &RopeScaling) -> Result<(), ConfigError> {
    let factors: Vec<(&'static str, f64)> = match *scaling {
        RopeScaling::Linear { factor } => vec![("rope_scaling.factor", factor)],
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            vec![
                ("rope_scaling.factor", factor),
                ("rope_scaling.low_freq_factor", low_freq_factor),
                ("rope_scaling.high_freq_factor - low_freq_factor", high_freq_factor - low_freq_factor),
                ("rope_scaling.original_max_position_embeddings", original_max_position_embeddings as f64),
            ]
        }
    };
    match factors.into_iter().find(|(_, v)| !(*v > 0.0 && v.is_finite())) {
        Some((name, value)) => Err(ConfigError::NotPositive { name, value }),
        None => Ok(()),
    }
}

/// What an `Attention` is built from (its `init` is in the attention module).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub sliding_window: Option<usize>,
    /// Init standard deviation of the q/k/v projections and of the output projection.
    pub init_std: f64,
    pub out_std: f64,
}

impl AttentionConfig {
    /// Multi-head attention of `n_heads` heads over `d_model` (one key/value head a query head, no
    /// bias, no window, init std 0.02): the fields are public for the rest.
    #[cfg(test)]
    pub(crate) fn new(d_model: usize, n_heads: usize) -> Self {
        let head_dim = d_model / n_heads.max(1);
        let (init_std, out_std) = (0.02, 0.02);
        Self {
            d_model,
            n_heads,
            n_kv_heads: n_heads,
            head_dim,
            qkv_bias: false,
            sliding_window: None,
            init_std,
            out_std,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let sizes = [("d_model", self.d_model), ("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)];
        if let Some((name, _)) = sizes.into_iter().find(|&(_, value)| value == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(ConfigError::NotDivisible {
                divisor: "n_kv_heads",
                divisor_value: self.n_kv_heads,
                dividend: "n_heads",
                dividend_value: self.n_heads,
            });
        }
        if self.head_dim == 0 {
            return Err(ConfigError::NotPositive { name: "head_dim", value: 0.0 });
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim(self.head_dim));
        }
        if self.sliding_window == Some(0) {
            return Err(ConfigError::NotPositive { name: "sliding_window", value: 0.0 });
        }
        positive_std(self.init_std, self.out_std)
    }
}

/// What an `Mlp` is built from (its `init` is in the mlp module).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MlpConfig {
    pub d_model: usize,
    pub d_ff: usize,
    /// Init standard deviation of the gate and up projections and of the down projection.
    pub init_std: f64,
    pub out_std: f64,
}

impl MlpConfig {
    /// A SwiGLU MLP of width `d_ff` over `d_model`, init std 0.02.
    #[cfg(test)]
    pub(crate) fn new(d_model: usize, d_ff: usize) -> Self {
        Self { d_model, d_ff, init_std: 0.02, out_std: 0.02 }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if let Some((name, _)) = [("d_model", self.d_model), ("d_ff", self.d_ff)].into_iter().find(|&(_, v)| v == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        positive_std(self.init_std, self.out_std)
    }
}

/// What an `RmsNorm` is built from (its `init` is in the norm module).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RmsNormConfig {
    pub d_model: usize,
    pub eps: f64,
}

impl RmsNormConfig {
    /// An RMSNorm over `d_model` channels with eps 1e-5 (Llama's; Qwen2 uses 1e-6).
    #[cfg(test)]
    pub(crate) fn new(d_model: usize) -> Self {
        Self { d_model, eps: 1e-5 }
    }

    #[cfg(test)]
    pub(crate) fn with_eps(self, eps: f64) -> Self {
        Self { eps, ..self }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.d_model == 0 {
            return Err(ConfigError::NotPositive { name: "d_model", value: 0.0 });
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return Err(ConfigError::NotPositive { name: "norm_eps", value: self.eps });
        }
        Ok(())
    }
}

/// What a `Block` is built from (its `init` is in the block module).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlockConfig {
    pub attention: AttentionConfig,
    pub mlp: MlpConfig,
    /// Both norms of the block.
    pub norm: RmsNormConfig,
    pub dropout: f64,
}

impl BlockConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.attention.validate()?;
        self.mlp.validate()?;
        self.norm.validate()?;
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::Dropout(self.dropout));
        }
        Ok(())
    }
}

fn positive_std(init_std: f64, out_std: f64) -> Result<(), ConfigError> {
    match [("init_std", init_std), ("init_std / sqrt(2 n_layers)", out_std)]
        .into_iter()
        .find(|(_, v)| !(*v > 0.0 && v.is_finite()))
    {
        Some((name, value)) => Err(ConfigError::NotPositive { name, value }),
        None => Ok(()),
    }
}

impl ModelConfig {
    /// A tiny GQA model (2 layers, d_model 32, 4 heads over 2 KV heads, d_ff 64, RMSNorm eps 1e-5):
    /// the named preset tests and examples build on instead of writing the 17 fields out.
    pub fn tiny(vocab_size: usize, max_seq_len: usize) -> Self {
        ModelConfig {
            vocab_size,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: Some(2),
            head_dim: None,
            d_ff: 64,
            max_seq_len,
            rope_theta: 10_000.0,
            rope_layout: RopeLayout::HalfSplit,
            rope_scaling: None,
            sliding_window: None,
            norm_eps: 1e-5,
            qkv_bias: false,
            tie_embeddings: false,
            init_std: 0.02,
            dropout: 0.0,
        }
    }
}

#[cfg(test)]
pub(crate) fn tiny_config() -> ModelConfig {
    ModelConfig { d_ff: 48, ..ModelConfig::tiny(37, 32) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama2_7b() -> ModelConfig {
        ModelConfig {
            vocab_size: 32_000,
            d_model: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: None,
            d_ff: 11_008,
            max_seq_len: 4096,
            ..tiny_config()
        }
    }

    fn qwen25_05b() -> ModelConfig {
        ModelConfig {
            vocab_size: 151_936,
            d_model: 896,
            n_layers: 24,
            n_heads: 14,
            n_kv_heads: Some(2),
            d_ff: 4864,
            max_seq_len: 32_768,
            rope_theta: 1e6,
            norm_eps: 1e-6,
            qkv_bias: true,
            tie_embeddings: true,
            ..tiny_config()
        }
    }

    #[test]
    fn published_parameter_counts() {
        // Llama 2 7B model card total; Qwen2.5-0.5B: 494,032,768 (tied embeddings, q/k/v bias).
        assert_eq!(llama2_7b().num_params(), 6_738_415_616);
        assert_eq!(qwen25_05b().num_params(), 494_032_768);
    }

    #[test]
    fn flops_formula() {
        let c = tiny_config();
        let n = c.matmul_params() as f64;
        let t = 16;
        assert_eq!(c.train_flops_per_token(t), 6.0 * n + 12.0 * 2.0 * 16.0 * 32.0);
        // Tied: the head is the embedding table, still counted once as a matmul.
        let tied = ModelConfig { tie_embeddings: true, ..c.clone() };
        assert_eq!(tied.matmul_params(), c.matmul_params());
        assert_eq!(tied.num_params() + 32 * 37, c.num_params());
    }

    #[test]
    fn validation_names_the_problem() {
        let c = ModelConfig { n_kv_heads: Some(3), ..tiny_config() };
        let e = c.validate().unwrap_err();
        assert_eq!(e.to_string(), "model.n_kv_heads (3) must divide model.n_heads (4)");
        let c = ModelConfig { n_heads: 5, n_kv_heads: Some(5), ..tiny_config() };
        assert!(matches!(c.validate(), Err(ConfigError::NotDivisible { divisor: "n_heads", .. })));
        let c = ModelConfig { vocab_size: 0, ..tiny_config() };
        assert_eq!(c.validate(), Err(ConfigError::VocabUnset));
        let c = ModelConfig { head_dim: Some(7), ..tiny_config() };
        assert_eq!(c.validate(), Err(ConfigError::OddHeadDim(7)));
        let c = ModelConfig { norm_eps: -1.0, ..tiny_config() };
        assert!(matches!(c.validate(), Err(ConfigError::NotPositive { name: "norm_eps", .. })));
        assert!(tiny_config().validate().is_ok());
    }

    #[test]
    fn parts_get_their_configs_from_the_model_and_check_their_own_rules() {
        let c = ModelConfig::tiny(50, 16);
        let att = c.attention();
        assert_eq!((att.n_heads, att.n_kv_heads, att.head_dim), (4, 2, 8));
        assert!((att.out_std - 0.02 / 2.0).abs() < 1e-12, "GPT-2 residual init: 0.02 / sqrt(2·2)");
        assert_eq!(c.mlp().d_ff, 64);
        assert_eq!(c.norm(), RmsNormConfig::new(32).with_eps(1e-5));
        c.block().validate().unwrap();

        let gqa = AttentionConfig { n_kv_heads: 3, ..AttentionConfig::new(32, 4) };
        let err = gqa.validate().unwrap_err().to_string();
        assert!(err.contains("n_kv_heads") && err.contains('3') && err.contains('4'), "{err}");
        let odd = AttentionConfig { head_dim: 7, ..AttentionConfig::new(32, 4) };
        assert!(matches!(odd.validate(), Err(ConfigError::OddHeadDim(7))));
        let err = MlpConfig::new(32, 0).validate().unwrap_err().to_string();
        assert!(err.contains("d_ff"), "{err}");
        let err = RmsNormConfig::new(8).with_eps(0.0).validate().unwrap_err().to_string();
        assert!(err.contains("norm_eps"), "{err}");
        let block = BlockConfig { dropout: 1.0, ..c.block() };
        assert!(matches!(block.validate(), Err(ConfigError::Dropout(_))));
        // A model config whose part breaks a rule is refused with the part's error.
        let bad = ModelConfig { n_kv_heads: Some(3), ..c };
        assert!(matches!(bad.validate(), Err(ConfigError::NotDivisible { divisor: "n_kv_heads", .. })));
    }
}
