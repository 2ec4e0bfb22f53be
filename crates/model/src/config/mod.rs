//! Model hyper-parameters, their validation, and what follows from them without building the model:
//! the parameter count and the FLOPs per token.

use serde::{Deserialize, Serialize};

use crate::attention::GroupedConfig;
use crate::block::{AttentionConfig, BlockConfig, FeedForwardConfig};
use crate::mla::{LatentConfig, MlaConfig};
use crate::mlp::MlpConfig;
use crate::moe::{MoeConfig, MoePartConfig};
use crate::norm::NormConfig;

pub(crate) use crate::kinds::{ConfigError, MlpKind, NormKind, Positions};
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
    #[serde(default = "default_rope_theta", skip_serializing_if = "is_default_rope_theta")]
    pub rope_theta: f64,
    /// Which channels RoPE pairs up.
    #[serde(default, skip_serializing_if = "is_default")]
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

fn default_rope_theta() -> f64 {
    10_000.0
}
/// Left out of a written config at its default, as the other keys that learned positions leave
/// idle: a config written back holds no key where it has no effect.
fn is_default_rope_theta(theta: &f64) -> bool {
    *theta == default_rope_theta()
}
fn default_norm_eps() -> f64 {
    1e-5
}
fn default_init_std() -> f64 {
    0.02
}

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
    pub(crate) fn rope_dim(&self) -> usize {
        self.mla.as_ref().map_or_else(|| self.head_dim(), |mla| mla.rope_dim)
    }

    /// Whether layer `layer` runs the experts (a mixture of experts may keep the first layers dense).
    pub(crate) fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|moe| layer >= moe.dense_layers)
    }

    /// The config of layer `layer`'s attention: latent with `[model.mla]`, else grouped-query (its
    /// window depends on the layer).
    pub(crate) fn attention(&self, layer: usize) -> AttentionConfig {
        match &self.mla {
            Some(mla) => AttentionConfig::Latent(self.latent_attention(mla)),
            None => AttentionConfig::Grouped(self.grouped_attention(layer)),
        }
    }

    /// What `q·k` is multiplied by: `1/sqrt(query_pre_attn_scalar or head_dim)`.
    fn score_scale(&self) -> f64 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.head_dim() as f64).sqrt()
    }

    /// Latent attention of this model's width and heads.
    fn latent_attention(&self, mla: &MlaConfig) -> LatentConfig {
        // DeepSeek's YaRN models scale the whole score, not only the rotary part.
        let scale = match &self.rope_scaling {
            Some(scaling) => self.score_scale() * scaling.softmax_scale_factor(),
            None => self.score_scale(),
        };
        LatentConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            mla: mla.clone(),
            bias: self.qkv_bias,
            o_bias: self.o_bias,
            scale,
            init_std: self.init_std,
            out_std: self.out_std(),
        }
    }

    /// Grouped-query attention of layer `layer`.
    fn grouped_attention(&self, layer: usize) -> GroupedConfig {
        let head_dim = self.head_dim();
        GroupedConfig {
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
            scale: self.score_scale(),
            softcap: self.attn_logit_softcap,
            init_std: self.init_std,
            out_std: self.out_std(),
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
            ffn: match &self.moe {
                Some(moe) if self.is_sparse(layer) => FeedForwardConfig::Experts(MoePartConfig {
                    d_model: self.d_model,
                    moe: moe.clone(),
                    init_std: self.init_std,
                    out_std: self.out_std(),
                }),
                _ => FeedForwardConfig::Dense(self.mlp()),
            },
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
}

impl ModelConfig {
    /// A Llama of these sizes (every head its own key/value head): RMSNorm of eps 1e-5, RoPE of
    /// base 10,000 on half-split pairs, SwiGLU, no biases, an untied head, init std 0.02, no
    /// dropout. The one place every field is written out; families and presets change what
    /// differs from it.
    pub fn llama(
        vocab_size: usize,
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
        d_ff: usize,
        max_seq_len: usize,
    ) -> Self {
        ModelConfig {
            vocab_size,
            d_model,
            n_layers,
            n_heads,
            n_kv_heads: None,
            head_dim: None,
            d_ff,
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

    /// A tiny GQA model (2 layers, d_model 32, 4 heads over 2 KV heads, d_ff 64, RMSNorm eps 1e-5):
    /// the named preset tests and examples build on instead of writing the fields out.
    pub fn tiny(vocab_size: usize, max_seq_len: usize) -> Self {
        ModelConfig { n_kv_heads: Some(2), ..Self::llama(vocab_size, 32, 2, 4, 64, max_seq_len) }
    }
}

#[cfg(test)]
pub(crate) fn tiny_config() -> ModelConfig {
    ModelConfig { d_ff: 48, ..ModelConfig::tiny(37, 32) }
}

mod size;
#[cfg(test)]
mod tests;
mod validate;
