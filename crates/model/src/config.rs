//! Model hyper-parameters, their validation, and what follows from them without building the model:
//! the parameter count and the FLOPs per token.

use serde::{Deserialize, Serialize};

use crate::attention::AttentionConfig;
use crate::block::BlockConfig;
use crate::mla::MlaConfig;
use crate::mlp::MlpConfig;
pub use crate::moe::MoeConfig;
use crate::moe::MoePartConfig;
use crate::norm::NormConfig;

use ember_kernels::rope::Rope;
pub use ember_kernels::rope::{RopeLayout, RopeScaling};

/// Architecture of a decoder: the sizes, then the parts each block is made of (the defaults are
/// Llama's: RMSNorm, RoPE, SwiGLU, no biases). Hugging Face `config.json` names in brackets; the
/// family table in `ember-hf` maps each family's keys onto these.
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
    /// MLP hidden width [intermediate_size; GPT-2: n_inner, 4·n_embd].
    pub d_ff: usize,
    /// Longest sequence the positions cover: the RoPE tables, or the learned table
    /// [max_position_embeddings; GPT-2: n_positions].
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
    /// Norm epsilon [rms_norm_eps; GPT-2: layer_norm_epsilon].
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Bias on the q/k/v projections (Qwen2, GPT-2: true; Llama, Mistral: false).
    #[serde(default)]
    pub qkv_bias: bool,
    /// Bias on the attention's output projection (GPT-2).
    #[serde(default, skip_serializing_if = "is_false")]
    pub o_bias: bool,
    /// Biases on the MLP's projections (GPT-2).
    #[serde(default, skip_serializing_if = "is_false")]
    pub mlp_bias: bool,
    /// The norms of the blocks and the final norm.
    #[serde(default, skip_serializing_if = "is_default")]
    pub norm: NormKind,
    /// Bias on every LayerNorm (GPT-2; nanoGPT's `bias=False` has none).
    #[serde(default, skip_serializing_if = "is_false")]
    pub norm_bias: bool,
    /// The feed-forward part.
    #[serde(default, skip_serializing_if = "is_default")]
    pub mlp: MlpKind,
    /// A mixture of SwiGLU experts in place of every block's MLP (`d_ff` then unused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention in place of the plain projections (DeepSeek-V2, V3): leave
    /// `n_kv_heads` and `head_dim` out (the latent's widths are its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
    /// How positions enter: RoPE in the attention, or a learned table added to the embeddings.
    #[serde(default, skip_serializing_if = "is_default")]
    pub positions: Positions,
    /// A per-head norm of the queries and keys before RoPE, of the model's norm kind (Qwen3,
    /// Gemma 3; the recipe's QK-norm).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// With `qk_norm`: each norm over its projection's whole width, `[H·Dh]` and `[K·Dh]`, rather
    /// than per head (OLMoE).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm_whole: bool,
    /// Norms of the attention's and the MLP's outputs too, before each residual add (Gemma 2, 3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub sandwich_norms: bool,
    /// The attention and the MLP read the same normed input and add to the residual together.
    #[serde(default, skip_serializing_if = "is_false")]
    pub parallel_block: bool,
    /// Embeddings multiplied by `sqrt(d_model)` (Gemma).
    #[serde(default, skip_serializing_if = "is_false")]
    pub embed_scale: bool,
    /// With `sliding_window`: every this-many-th layer attends globally, the others within the
    /// window (Gemma 3: 6, five local layers to one global) [sliding_window_pattern].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
    /// RoPE base of the sliding-window layers when it differs from `rope_theta` (Gemma 3: 10,000
    /// local, 1,000,000 global) [rope_local_base_freq].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_theta: Option<f64>,
    /// Attention scores scaled by `1/sqrt(this)` instead of `1/sqrt(head_dim)` [query_pre_attn_scalar].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// Attention scores soft-capped as `c·tanh(s/c)` (Gemma 2) [attn_logit_softcapping].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcap: Option<f64>,
    /// Logits soft-capped as `c·tanh(z/c)` (Gemma 2) [final_logit_softcapping].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcap: Option<f64>,
    /// LM head shares the embedding table [tie_word_embeddings].
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Standard deviation of the normal init (GPT-2: 0.02). Output projections get it over sqrt(2 L).
    #[serde(default = "default_init_std")]
    pub init_std: f64,
    /// The attention's and the MLP's output projections start at zero (the modded-nanogpt
    /// speedrun's), so every block starts as the identity. Their draws are made and discarded, so
    /// every other weight is the default init's.
    #[serde(default, skip_serializing_if = "is_false")]
    pub zero_init_out: bool,
    /// Dropout on the embedding output and on each block's attention and MLP outputs during training
    /// (nanoGPT's resid/embedding dropout; 0 turns it off).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropout: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn is_false(x: &bool) -> bool {
    !*x
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
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
    pub fn gated(self) -> bool {
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
    #[error("model.{key} needs {needs}")]
    Needs { key: &'static str, needs: &'static str },
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
    /// The RoPE tables of this model's global layers (its base, layout and scaling), `[T_max, Dh/2]`;
    /// with learned positions, tables of angle zero (the rotation is the identity, exactly).
    pub(crate) fn rope<B: burn::tensor::backend::Backend>(&self, device: &B::Device) -> Rope<B> {
        match self.positions {
            Positions::Rope => {
                let scaling = self.rope_scaling.as_ref();
                Rope::with_scaling(
                    self.max_seq_len,
                    self.rope_dim(),
                    self.rope_theta,
                    self.rope_layout,
                    scaling,
                    device,
                )
            }
            Positions::Learned => Rope::identity(self.max_seq_len, self.rope_dim(), self.rope_layout, device),
        }
    }

    /// The RoPE tables of the sliding-window layers, where their base differs (Gemma 3; no scaling).
    pub(crate) fn rope_local<B: burn::tensor::backend::Backend>(&self, device: &B::Device) -> Option<Rope<B>> {
        let theta = self.rope_local_theta.filter(|_| self.positions == Positions::Rope && self.has_local_layers())?;
        Some(Rope::new(self.max_seq_len, self.head_dim(), theta, self.rope_layout, device))
    }

    /// Whether layer `layer` attends within the sliding window (every layer with a window and no
    /// pattern, Mistral's; with a pattern, all but every `pattern`-th, Gemma 3's).
    pub fn is_local(&self, layer: usize) -> bool {
        match (self.sliding_window, self.sliding_window_pattern) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(_), Some(p)) => !(layer + 1).is_multiple_of(p.max(1)),
        }
    }

    /// Whether some layers attend within a window and others globally.
    pub(crate) fn has_local_layers(&self) -> bool {
        (0..self.n_layers).any(|l| self.is_local(l))
    }
}

impl ModelConfig {
    /// Key/value heads, `n_heads` when not given.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Per-head width, `d_model / n_heads` when not given; of the queries and keys with latent
    /// attention.
    pub fn head_dim(&self) -> usize {
        match &self.mla {
            Some(mla) => mla.qk_dim(),
            None => self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1)),
        }
    }

    /// Width RoPE rotates per head: the head's, or latent attention's rotary part.
    pub fn rope_dim(&self) -> usize {
        self.mla.as_ref().map_or_else(|| self.head_dim(), |mla| mla.rope_dim)
    }

    /// Whether layer `layer` runs the experts (a mixture of experts may keep the first layers dense).
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|moe| layer >= moe.dense_layers)
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
        self.block(0).validate()?;
        self.block(self.n_layers - 1).validate()?;
        if let Some(moe) = &self.moe {
            moe.validate()?; // also when every layer is dense
            if moe.dense_layers > self.n_layers {
                return Err(ConfigError::Needs { key: "moe.dense_layers", needs: "a value no larger than n_layers" });
            }
        }
        if let Some(scaling) = &self.rope_scaling {
            validate_rope_scaling(scaling)?;
        }
        let optional = [
            ("rope_local_theta", self.rope_local_theta),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcap", self.attn_logit_softcap),
            ("final_logit_softcap", self.final_logit_softcap),
        ];
        let given = optional.into_iter().filter_map(|(name, value)| Some((name, value?)));
        for (name, value) in [("rope_theta", self.rope_theta), ("init_std", self.init_std)].into_iter().chain(given) {
            if !(value > 0.0 && value.is_finite()) {
                return Err(ConfigError::NotPositive { name, value });
            }
        }
        if self.sliding_window_pattern == Some(0) {
            return Err(ConfigError::NotPositive { name: "sliding_window_pattern", value: 0.0 });
        }
        if self.moe.is_some() && (self.mlp != MlpKind::Swiglu || self.mlp_bias) {
            return Err(ConfigError::Needs {
                key: "moe",
                needs: "mlp = \"swiglu\" without mlp_bias (the experts are SwiGLU)",
            });
        }
        if self.qk_norm_whole && !self.qk_norm {
            return Err(ConfigError::Needs { key: "qk_norm_whole", needs: "qk_norm" });
        }
        if self.norm_bias && self.norm != NormKind::LayerNorm {
            return Err(ConfigError::Needs { key: "norm_bias", needs: "norm = \"layer_norm\"" });
        }
        // Both describe the local layers of a windowed model: without a window every layer is global.
        for (key, given) in [
            ("sliding_window_pattern", self.sliding_window_pattern.is_some()),
            ("rope_local_theta", self.rope_local_theta.is_some()),
        ] {
            if given && self.sliding_window.is_none() {
                return Err(ConfigError::Needs { key, needs: "sliding_window" });
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

    /// The config of layer `layer`'s attention (its window depends on the layer).
    pub(crate) fn attention(&self, layer: usize) -> AttentionConfig {
        let head_dim = self.head_dim();
        let scale = 1.0 / self.query_pre_attn_scalar.unwrap_or(head_dim as f64).sqrt();
        // DeepSeek's YaRN models scale the whole score, not only the rotary part.
        let scale = match (&self.mla, &self.rope_scaling) {
            (Some(_), Some(scaling)) => scale * scaling.softmax_scale_factor(),
            _ => scale,
        };
        AttentionConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads(),
            head_dim,
            qkv_bias: self.qkv_bias,
            o_bias: self.o_bias,
            qk_norm: self.qk_norm.then_some(NormConfig {
                d_model: head_dim,
                eps: self.norm_eps,
                kind: self.norm,
                bias: false,
            }),
            qk_norm_whole: self.qk_norm_whole,
            sliding_window: self.sliding_window.filter(|_| self.is_local(layer)),
            scale,
            softcap: self.attn_logit_softcap,
            init_std: self.init_std,
            out_std: self.out_std(),
            mla: self.mla.clone(),
        }
    }

    /// The config of every block's MLP.
    pub(crate) fn mlp(&self) -> MlpConfig {
        MlpConfig {
            d_model: self.d_model,
            d_ff: self.d_ff,
            kind: self.mlp,
            bias: self.mlp_bias,
            init_std: self.init_std,
            out_std: self.out_std(),
        }
    }

    /// The config of every norm over the residual stream (the blocks' and the final one).
    pub(crate) fn norm(&self) -> NormConfig {
        NormConfig { d_model: self.d_model, eps: self.norm_eps, kind: self.norm, bias: self.norm_bias }
    }

    /// The config of block `layer`.
    pub(crate) fn block(&self, layer: usize) -> BlockConfig {
        BlockConfig {
            attention: self.attention(layer),
            mlp: self.mlp(),
            moe: self.moe.clone().filter(|_| self.is_sparse(layer)).map(|moe| MoePartConfig {
                d_model: self.d_model,
                moe,
                init_std: self.init_std,
                out_std: self.out_std(),
            }),
            norm: self.norm(),
            sandwich_norms: self.sandwich_norms,
            parallel: self.parallel_block,
            dropout: self.dropout,
        }
    }

    /// GPT-2's init of the projections that write into the residual stream: `init_std / sqrt(2L)`,
    /// two such branches per block.
    fn residual_out_std(&self) -> f64 {
        self.init_std / (2.0 * self.n_layers as f64).sqrt()
    }

    /// The init std of the output projections: 0 (their draws zeroed) with `zero_init_out`.
    fn out_std(&self) -> f64 {
        if self.zero_init_out {
            0.0
        } else {
            self.residual_out_std()
        }
    }

    /// Total number of parameters, computed from the config alone.
    ///
    /// Per block: the projections' weights (below) and biases, the norms (two, four with sandwich
    /// norms, one in a parallel block; a weight each and a LayerNorm's bias), the q/k norms
    /// (`2·Dh`). Plus the embedding `V·D`, a learned position table `T·D`, the final norm, and an
    /// untied head `D·V`.
    pub fn num_params(&self) -> u64 {
        let (d, v, l, f) = (self.d_model as u64, self.vocab_size as u64, self.n_layers as u64, self.d_ff as u64);
        let q = (self.n_heads * self.head_dim()) as u64;
        let kv = (self.n_kv_heads() * self.head_dim()) as u64;
        let norm = if self.norm_bias { 2 * d } else { d };
        let norms = match (self.parallel_block, self.sandwich_norms) {
            (true, false) => 1,
            (true, true) => 2,
            (false, false) => 2,
            (false, true) => 4,
        };
        let qkv_bias = match (&self.mla, self.qkv_bias) {
            (Some(_), _) | (None, false) => 0, // latent attention counts its own
            (None, true) => q + 2 * kv,
        };
        let o_bias = if self.o_bias && self.mla.is_none() { d } else { 0 };
        let mlp_bias = match (self.mlp_bias, self.mlp.gated()) {
            (false, _) => 0,
            (true, true) => 2 * f + d,
            (true, false) => f + d,
        };
        let qk_norm = match (self.qk_norm, self.qk_norm_whole) {
            (false, _) => 0,
            (true, false) => 2 * self.head_dim() as u64,
            (true, true) => ((self.n_heads + self.n_kv_heads()) * self.head_dim()) as u64,
        };
        let attention = match &self.mla {
            Some(mla) => mla.params(self.d_model, self.n_heads, self.qkv_bias, self.o_bias),
            None => self.attention_params() + qkv_bias + o_bias + qk_norm,
        };
        let ffn: u64 = (0..self.n_layers)
            .map(|layer| match &self.moe {
                Some(moe) if self.is_sparse(layer) => moe.params(self.d_model),
                _ => self.mlp_params() + mlp_bias,
            })
            .sum();
        let block = attention + norms * norm;
        let positions = if self.positions == Positions::Learned { self.max_seq_len as u64 * d } else { 0 };
        let head = if self.tie_embeddings { 0 } else { d * v };
        v * d + positions + l * block + ffn + norm + head
    }

    /// A plain attention's projection weights: `D·H·Dh + 2·D·K·Dh + H·Dh·D`.
    fn attention_params(&self) -> u64 {
        let d = self.d_model as u64;
        let q = (self.n_heads * self.head_dim()) as u64;
        let kv = (self.n_kv_heads() * self.head_dim()) as u64;
        d * q + 2 * d * kv + q * d
    }

    /// A dense MLP's projection weights: `3·D·F` gated, `2·D·F` plain.
    fn mlp_params(&self) -> u64 {
        let (d, f) = (self.d_model as u64, self.d_ff as u64);
        if self.mlp.gated() {
            3 * d * f
        } else {
            2 * d * f
        }
    }

    /// Parameters that take part in a token's matmuls: every projection and the LM head (the
    /// embedding table when tied); of a mixture of experts, the router, the `k` experts a token
    /// runs through and the shared expert; of latent attention, its expanded form's projections.
    /// Not the embedding lookup, the norm gains or the biases. This is N in 6N.
    pub fn matmul_params(&self) -> u64 {
        let (d, v, l) = (self.d_model as u64, self.vocab_size as u64, self.n_layers as u64);
        let attention = match &self.mla {
            Some(mla) => mla.matmul_params(self.d_model, self.n_heads),
            None => self.attention_params(),
        };
        let ffn: u64 = (0..self.n_layers)
            .map(|layer| match &self.moe {
                Some(moe) if self.is_sparse(layer) => moe.active_params(self.d_model),
                _ => self.mlp_params(),
            })
            .sum();
        l * attention + ffn + d * v
    }

    /// Forward FLOPs per token at context `seq_len`: `2N + 4·L·T·(H·Dh)` (PaLM appendix B; a
    /// multiply-add is 2 FLOPs; the attention term counts the full T×T score matrix, as MFU does).
    /// `H·Dh` is the attention width, equal to `d_model` for Llama and Qwen2.
    pub(crate) fn forward_flops_per_token(&self, seq_len: usize) -> f64 {
        // Latent attention's scores are `qk_dim` wide and its values `v_dim`: their mean.
        let head = self.mla.as_ref().map_or(self.head_dim() as f64, |m| (m.qk_dim() + m.v_dim) as f64 / 2.0);
        let attn_width = self.n_heads as f64 * head;
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
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale,
            mscale_all_dim,
            ..
        } => vec![
            ("rope_scaling.factor", factor),
            ("rope_scaling.original_max_position_embeddings", original_max_position_embeddings as f64),
            ("rope_scaling.beta_slow", beta_slow),
            ("rope_scaling.beta_fast - beta_slow", beta_fast - beta_slow),
            ("rope_scaling.attention_factor", attention_factor.unwrap_or(1.0)),
            // 0 is "not given" to Hugging Face; negative or not finite is no scale.
            ("rope_scaling.mscale", mscale.map_or(1.0, |m| if m == 0.0 { 1.0 } else { m })),
            ("rope_scaling.mscale_all_dim", mscale_all_dim.map_or(1.0, |m| if m == 0.0 { 1.0 } else { m })),
        ],
    };
    match factors.into_iter().find(|(_, v)| !(*v > 0.0 && v.is_finite())) {
        Some((name, value)) => Err(ConfigError::NotPositive { name, value }),
        None => Ok(()),
    }
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
            o_bias: false,
            mlp_bias: false,
            norm: NormKind::RmsNorm,
            norm_bias: false,
            mlp: MlpKind::Swiglu,
            moe: None,
            mla: None,
            positions: Positions::Rope,
            qk_norm: false,
            qk_norm_whole: false,
            sandwich_norms: false,
            parallel_block: false,
            embed_scale: false,
            sliding_window_pattern: None,
            rope_local_theta: None,
            query_pre_attn_scalar: None,
            attn_logit_softcap: None,
            final_logit_softcap: None,
            tie_embeddings: false,
            init_std: 0.02,
            zero_init_out: false,
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
        use crate::attention::AttentionConfig;
        use crate::block::BlockConfig;
        use crate::mlp::MlpConfig;
        use crate::norm::NormConfig;
        let c = ModelConfig::tiny(50, 16);
        let att = c.attention(0);
        assert_eq!((att.n_heads, att.n_kv_heads, att.head_dim), (4, 2, 8));
        assert!((att.out_std - 0.02 / 2.0).abs() < 1e-12, "GPT-2 residual init: 0.02 / sqrt(2·2)");
        assert!((att.scale - 1.0 / 8f64.sqrt()).abs() < 1e-15 && att.softcap.is_none() && att.qk_norm.is_none());
        assert_eq!(c.mlp().d_ff, 64);
        assert_eq!(c.norm(), NormConfig { eps: 1e-5, ..NormConfig::new(32) });
        c.block(0).validate().unwrap();

        let gqa = AttentionConfig { n_kv_heads: 3, ..AttentionConfig::new(32, 4) };
        let err = gqa.validate().unwrap_err().to_string();
        assert!(err.contains("n_kv_heads") && err.contains('3') && err.contains('4'), "{err}");
        let odd = AttentionConfig { head_dim: 7, ..AttentionConfig::new(32, 4) };
        assert!(matches!(odd.validate(), Err(ConfigError::OddHeadDim(7))));
        let err = MlpConfig::new(32, 0).validate().unwrap_err().to_string();
        assert!(err.contains("d_ff"), "{err}");
        let err = NormConfig { eps: 0.0, ..NormConfig::new(8) }.validate().unwrap_err().to_string();
        assert!(err.contains("norm_eps"), "{err}");
        let block = BlockConfig { dropout: 1.0, ..c.block(0) };
        assert!(matches!(block.validate(), Err(ConfigError::Dropout(_))));
        // A model config whose part breaks a rule is refused with the part's error.
        let bad = ModelConfig { n_kv_heads: Some(3), ..c };
        assert!(matches!(bad.validate(), Err(ConfigError::NotDivisible { divisor: "n_kv_heads", .. })));
    }

    #[test]
    fn the_layer_pattern_and_the_scores_follow_the_config() {
        // Gemma 3's five local layers to one global.
        let c = ModelConfig {
            n_layers: 12,
            sliding_window: Some(4),
            sliding_window_pattern: Some(6),
            rope_local_theta: Some(10_000.0),
            rope_theta: 1e6,
            query_pre_attn_scalar: Some(16.0),
            attn_logit_softcap: Some(50.0),
            ..tiny_config()
        };
        let local: Vec<bool> = (0..12).map(|l| c.is_local(l)).collect();
        assert_eq!(local, [true, true, true, true, true, false, true, true, true, true, true, false]);
        assert_eq!((c.attention(0).sliding_window, c.attention(5).sliding_window), (Some(4), None));
        assert_eq!((c.attention(0).scale, c.attention(0).softcap), (0.25, Some(50.0)));
        // Mistral: every layer local; no window: none.
        let mistral = ModelConfig { sliding_window: Some(4), ..tiny_config() };
        assert!((0..2).all(|l| mistral.is_local(l)) && !tiny_config().is_local(0));
        for (bad, name) in [
            (ModelConfig { sliding_window_pattern: Some(0), ..c.clone() }, "sliding_window_pattern"),
            (ModelConfig { query_pre_attn_scalar: Some(0.0), ..c.clone() }, "query_pre_attn_scalar"),
            (ModelConfig { final_logit_softcap: Some(f64::NAN), ..c.clone() }, "final_logit_softcap"),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        let e = ModelConfig { qk_norm_whole: true, ..tiny_config() }.validate().unwrap_err().to_string();
        assert_eq!(e, "model.qk_norm_whole needs qk_norm");
        let whole = ModelConfig { qk_norm: true, qk_norm_whole: true, ..tiny_config() };
        // Norms over [H·Dh] and [K·Dh] = 32 + 16 a block, not 2·Dh = 16.
        assert_eq!(whole.num_params(), ModelConfig { qk_norm: true, ..tiny_config() }.num_params() + 2 * 32);
        let e = ModelConfig { norm_bias: true, ..tiny_config() }.validate().unwrap_err().to_string();
        assert_eq!(e, "model.norm_bias needs norm = \"layer_norm\"");
        // The local layers' keys without a window describe nothing.
        let e = ModelConfig { sliding_window: None, ..c.clone() }.validate().unwrap_err().to_string();
        assert_eq!(e, "model.sliding_window_pattern needs sliding_window");
        let e = ModelConfig { sliding_window: None, sliding_window_pattern: None, ..c }.validate().unwrap_err();
        assert_eq!(e.to_string(), "model.rope_local_theta needs sliding_window");
    }

    #[test]
    fn parameter_counts_follow_the_parts() {
        // GPT-2 small: 124,439,808 parameters (Hugging Face's count, tied head).
        let gpt2 = ModelConfig {
            vocab_size: 50_257,
            d_model: 768,
            n_layers: 12,
            n_heads: 12,
            n_kv_heads: None,
            d_ff: 3072,
            max_seq_len: 1024,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            norm: NormKind::LayerNorm,
            norm_bias: true,
            mlp: MlpKind::Gelu,
            positions: Positions::Learned,
            tie_embeddings: true,
            ..tiny_config()
        };
        assert_eq!(gpt2.num_params(), 124_439_808);
        // Qwen3-0.6B: 596,049,920 (q/k norms, head_dim 128 over d_model 1024, tied).
        let qwen3 = ModelConfig {
            vocab_size: 151_936,
            d_model: 1024,
            n_layers: 28,
            n_heads: 16,
            n_kv_heads: Some(8),
            head_dim: Some(128),
            d_ff: 3072,
            max_seq_len: 40_960,
            qk_norm: true,
            tie_embeddings: true,
            ..tiny_config()
        };
        assert_eq!(qwen3.num_params(), 596_049_920);
        // Gemma-3-270M: 268,098,176 (four norms a block, q/k norms, GeGLU, tied 262,144 vocabulary).
        let gemma = ModelConfig {
            vocab_size: 262_144,
            d_model: 640,
            n_layers: 18,
            n_heads: 4,
            n_kv_heads: Some(1),
            head_dim: Some(256),
            d_ff: 2048,
            max_seq_len: 32_768,
            norm: NormKind::RmsNormPlusOne,
            mlp: MlpKind::Geglu,
            qk_norm: true,
            sandwich_norms: true,
            tie_embeddings: true,
            ..tiny_config()
        };
        assert_eq!(gemma.num_params(), 268_098_176);
        // Mixtral 8x7B: 46,702,792,704 in all; a token multiplies by 2 of the 8 experts (the
        // "12.9B active" counts the embedding too: 12,748,587,008 + 131,072,000).
        let mixtral = ModelConfig {
            vocab_size: 32_000,
            d_model: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: Some(8),
            d_ff: 14_336,
            max_seq_len: 32_768,
            moe: Some(MoeConfig {
                n_experts: 8,
                top_k: 2,
                d_expert: 14_336,
                norm_topk: true,
                shared_expert: None,
                shared_expert_gate: false,
                aux_loss_coef: 0.02,
                z_loss_coef: 0.0,
                ..Default::default()
            }),
            ..tiny_config()
        };
        mixtral.validate().unwrap();
        assert_eq!(mixtral.num_params(), 46_702_792_704);
        assert_eq!(mixtral.matmul_params(), 12_748_587_008);
        // The experts are SwiGLU: another MLP kind with them is refused by name.
        let e = ModelConfig { mlp: MlpKind::Gelu, ..mixtral }.validate().unwrap_err().to_string();
        assert!(e.starts_with("model.moe needs mlp = \"swiglu\""), "{e}");
    }
}
