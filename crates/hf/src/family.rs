//! The family table: for each Hugging Face model family ember reads and writes, its class and
//! `model_type`, the `config.json` keys of its sizes and the parts its blocks are built from, the
//! functions that read and write its other keys ([`crate::config_map`]), and how its tensor names
//! map onto ember's parameter paths.
//!
//! | family        | class               | norms                  | MLP    | positions | tensors            |
//! |---------------|---------------------|------------------------|--------|-----------|--------------------|
//! | `llama`       | `LlamaForCausalLM`  | RMSNorm                | SwiGLU | RoPE      | [`LLAMA_TENSORS`]  |
//! | `qwen2`       | `Qwen2ForCausalLM`  | RMSNorm                | SwiGLU | RoPE      | [`LLAMA_TENSORS`]  |
//! | `mistral`     | `MistralForCausalLM`| RMSNorm                | SwiGLU | RoPE      | [`LLAMA_TENSORS`]  |
//! | `qwen3`       | `Qwen3ForCausalLM`  | RMSNorm, q/k norms     | SwiGLU | RoPE      | [`LLAMA_TENSORS`]  |
//! | `gemma3_text` | `Gemma3ForCausalLM` | RMSNorm (1 + w), q/k, sandwich | GeGLU | RoPE, two bases | [`GEMMA3_TENSORS`] |
//! | `gpt2`        | `GPT2LMHeadModel`   | LayerNorm with bias    | GELU   | learned   | [`GPT2_TENSORS`]   |
//! | `mixtral`     | `MixtralForCausalLM`| RMSNorm                | experts | RoPE     | [`MIXTRAL_EXPERTS`] |
//! | `qwen2_moe`   | `Qwen2MoeForCausalLM` | RMSNorm              | experts, shared | RoPE | [`QWEN_EXPERTS`] |
//! | `qwen3_moe`   | `Qwen3MoeForCausalLM` | RMSNorm, q/k norms   | experts | RoPE     | [`QWEN_EXPERTS`] |
//! | `olmoe`       | `OlmoeForCausalLM`  | RMSNorm, whole q/k norms | experts | RoPE   | [`QWEN_EXPERTS`] |
//! | `deepseek_v2` | `DeepseekV2ForCausalLM` | RMSNorm, latent attention | dense, then experts, shared | RoPE (interleaved) | [`DEEPSEEK_TENSORS`] |
//! | `deepseek_v3` | `DeepseekV3ForCausalLM` | RMSNorm, latent attention | dense, then experts (sigmoid), shared | RoPE (interleaved), YaRN | [`DEEPSEEK_TENSORS`] |
//!
//! A tensor rule pairs a Hugging Face name with ember path(s) and with llama.cpp's GGUF name; `{i}`
//! stands for the layer index. The [`Layout`] says how the values move between Hugging Face and
//! ember: as they are, transposed (Hugging Face's `nn.Linear` is `[out, in]`, ember's `[in, out]`),
//! several ember tensors side by side in one file tensor (GPT-2's `c_attn` holds q, k and v; its
//! `Conv1D` weights are already `[in, out]`), or a norm's gain (as it is, in the family's storage of
//! gains). A GGUF tensor holds the Hugging Face one's values, transposed for GPT-2's `Conv1D`
//! weights (llama.cpp keeps every matrix `[out, in]`), and each RMSNorm gain as the factor it
//! multiplies by: Gemma's `1 + w` (see [`Family::holds_norm`] for how ember keeps those). Experts are
//! one tensor per expert in the file (`{j}` their index) and one stacked `[E, in, out]` parameter in
//! ember ([`Layout::Experts`]).

use ember_model::{MlpKind, ModelConfig, NormKind, Positions};
use serde_json::{Map, Value};

use crate::config_map::{self, Reader};
use crate::error::HfError;

/// The model families ember reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Mistral,
    Qwen3,
    Gemma3,
    Gpt2,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    Olmoe,
    DeepseekV2,
    DeepseekV3,
}

/// How a family's config.json and tensors map onto ember's. One row of [`FAMILIES`].
pub struct Family {
    pub architecture: Architecture,
    /// llama.cpp's `general.architecture` for the family (Mistral is a `llama` to llama.cpp).
    pub gguf_arch: &'static str,
    /// `architectures[0]` of its config.json.
    pub class_name: &'static str,
    pub model_type: &'static str,
    /// The keys of the sizes.
    pub keys: SizeKeys,
    /// What every model of the family is built from.
    pub parts: Parts,
    /// The values of the activation key, and the MLP each means (the first is the default).
    pub activations: &'static [(&'static str, MlpKind)],
    /// Reads the family's other keys (biases, RoPE, windows, soft caps) into a config that already
    /// holds the sizes and the parts.
    pub read: fn(&Reader, &mut ModelConfig) -> Result<(), HfError>,
    /// Writes them.
    pub write: fn(&ModelConfig, &mut Map<String, Value>),
    /// Keys of a base config.json that `write` replaces, removed first so that none goes stale.
    pub replaced_keys: &'static [&'static [&'static str]],
    /// The tensor names, in groups (the attention's and the MLP's or the experts').
    pub tensors: &'static [&'static [Rule]],
    /// Name endings of tensors some checkpoints carry that are not parameters.
    pub buffers: &'static [&'static str],
    /// A prefix the names may carry or lack (GPT-2's `transformer.`: Hub files have bare names,
    /// transformers writes the prefix, as an export does).
    pub optional_prefix: Option<&'static str>,
}

/// The config.json keys of the sizes ember's [`ModelConfig`] holds.
pub struct SizeKeys {
    pub d_model: &'static str,
    pub n_layers: &'static str,
    pub n_heads: &'static str,
    /// `None`: as many key/value heads as query heads.
    pub n_kv_heads: Option<&'static str>,
    /// `None`: `d_model / n_heads`.
    pub head_dim: Option<&'static str>,
    pub d_ff: &'static str,
    /// What a null or absent `d_ff` key means, in multiples of `d_model` (GPT-2's `n_inner`: 4).
    pub d_ff_default: Option<usize>,
    pub max_seq_len: &'static str,
    /// The norm epsilon's key and its default.
    pub norm_eps: (&'static str, f64),
    pub activation: &'static str,
    /// `tie_word_embeddings` when absent.
    pub tie_default: bool,
}

/// The parts of the blocks, fixed for a family (its biases are read with its other keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Parts {
    pub norm: NormKind,
    pub positions: Positions,
    pub qk_norm: bool,
    /// The q/k norms over the whole projections (OLMoE), not per head.
    pub qk_norm_whole: bool,
    pub sandwich_norms: bool,
    pub embed_scale: bool,
}

impl Parts {
    /// Whether `c` is built from these parts (its MLP aside), its norms kept either way
    /// [`Parts::holds_norm`] allows.
    pub fn of(&self, c: &ModelConfig) -> bool {
        self.holds_norm(c.norm)
            && *self
                == Parts {
                    norm: self.norm,
                    positions: c.positions,
                    qk_norm: c.qk_norm,
                    qk_norm_whole: c.qk_norm_whole,
                    sandwich_norms: c.sandwich_norms,
                    embed_scale: c.embed_scale,
                }
    }

    /// Whether a model whose norms are of `kind` is one of these: the family's own kind, or, for
    /// Gemma's RMSNorm (gain stored as `g − 1`), plain gains `g` too. A Gemma imported from GGUF keeps
    /// its gains as llama.cpp stores them (`g`, [`NormKind::RmsNorm`]), so that exporting it to GGUF
    /// again is bit for bit; a Hugging Face export writes `g − 1` ([`Layout::Gain`]).
    pub fn holds_norm(&self, kind: NormKind) -> bool {
        kind == self.norm || (self.norm == NormKind::RmsNormPlusOne && kind == NormKind::RmsNorm)
    }
}

/// How a tensor's values go between the file and ember.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The same shape and order: embeddings, norms, biases, `Conv1D` weights.
    AsIs,
    /// A linear weight: `[out, in]` in the file, `[in, out]` in ember.
    Transposed,
    /// The ember tensors side by side along the last axis, in order (GPT-2's `c_attn`: q, k, v).
    Fused,
    /// An RMSNorm's gain: the same shape, the values as the family stores gains (Gemma's `g − 1`);
    /// exports convert a model that keeps them the other way ([`Family::holds_norm`]).
    Gain,
    /// Experts' linear weights: expert `j`'s `[out, in]` file tensor is slice `j` of ember's
    /// stacked `[E, in, out]` parameter, transposed.
    Experts,
}

/// One tensor name: Hugging Face's, ember's (several for [`Layout::Fused`]) and llama.cpp's, `{i}`
/// the layer.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub hf: &'static str,
    pub ember: &'static [&'static str],
    pub layout: Layout,
    /// The name in a GGUF file (llama-arch.cpp's); empty where llama.cpp's architecture has no such
    /// tensor (an export of a model that has one is refused).
    pub gguf: &'static str,
    /// Whether the GGUF tensor is the Hugging Face one transposed (GPT-2's `Conv1D` weights).
    pub gguf_transposed: bool,
}

const fn rule(hf: &'static str, ember: &'static [&'static str], layout: Layout) -> Rule {
    Rule { hf, ember, layout, gguf: "", gguf_transposed: false }
}

const fn as_is(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::AsIs)
}

const fn linear(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Transposed)
}

const fn fused(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Fused)
}

const fn gain(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Gain)
}

const fn experts(hf: &'static str, ember: &'static [&'static str]) -> Rule {
    rule(hf, ember, Layout::Experts)
}

impl Rule {
    /// The same rule with its GGUF name.
    const fn gguf(self, name: &'static str) -> Rule {
        Rule { gguf: name, ..self }
    }

    /// The same rule with its GGUF name, the GGUF tensor being the Hugging Face one transposed.
    const fn gguf_t(self, name: &'static str) -> Rule {
        Rule { gguf: name, gguf_transposed: true, ..self }
    }
}

/// Llama, Qwen2 (q/k/v biases), Mistral and Qwen3 (q/k norms; all four biases with
/// `attention_bias`): ember's own names, under `model.`. The MLP's are [`LLAMA_MLP`].
#[rustfmt::skip]
pub const LLAMA_TENSORS: &[Rule] = &[
    as_is("model.embed_tokens.weight", &["embed_tokens"]).gguf("token_embd.weight"),
    gain("model.layers.{i}.input_layernorm.weight", &["layers.{i}.input_layernorm.weight"]).gguf("blk.{i}.attn_norm.weight"),
    linear("model.layers.{i}.self_attn.q_proj.weight", &["layers.{i}.self_attn.q_proj.weight"]).gguf("blk.{i}.attn_q.weight"),
    linear("model.layers.{i}.self_attn.k_proj.weight", &["layers.{i}.self_attn.k_proj.weight"]).gguf("blk.{i}.attn_k.weight"),
    linear("model.layers.{i}.self_attn.v_proj.weight", &["layers.{i}.self_attn.v_proj.weight"]).gguf("blk.{i}.attn_v.weight"),
    linear("model.layers.{i}.self_attn.o_proj.weight", &["layers.{i}.self_attn.o_proj.weight"])
        .gguf("blk.{i}.attn_output.weight"),
    as_is("model.layers.{i}.self_attn.q_proj.bias", &["layers.{i}.self_attn.q_proj.bias"]).gguf("blk.{i}.attn_q.bias"),
    as_is("model.layers.{i}.self_attn.k_proj.bias", &["layers.{i}.self_attn.k_proj.bias"]).gguf("blk.{i}.attn_k.bias"),
    as_is("model.layers.{i}.self_attn.v_proj.bias", &["layers.{i}.self_attn.v_proj.bias"]).gguf("blk.{i}.attn_v.bias"),
    as_is("model.layers.{i}.self_attn.o_proj.bias", &["layers.{i}.self_attn.o_proj.bias"]).gguf("blk.{i}.attn_output.bias"),
    gain("model.layers.{i}.self_attn.q_norm.weight", &["layers.{i}.self_attn.q_norm.weight"])
        .gguf("blk.{i}.attn_q_norm.weight"),
    gain("model.layers.{i}.self_attn.k_norm.weight", &["layers.{i}.self_attn.k_norm.weight"])
        .gguf("blk.{i}.attn_k_norm.weight"),
    gain("model.layers.{i}.post_attention_layernorm.weight", &["layers.{i}.post_attention_layernorm.weight"])
        .gguf("blk.{i}.ffn_norm.weight"),
    gain("model.norm.weight", &["norm.weight"]).gguf("output_norm.weight"),
    linear("lm_head.weight", &["lm_head.weight"]).gguf("output.weight"),
];

/// The MLP of Llama's blocks (and Gemma 3's).
#[rustfmt::skip]
pub const LLAMA_MLP: &[Rule] = &[
    linear("model.layers.{i}.mlp.gate_proj.weight", &["layers.{i}.mlp.gate_proj.weight"]).gguf("blk.{i}.ffn_gate.weight"),
    linear("model.layers.{i}.mlp.up_proj.weight", &["layers.{i}.mlp.up_proj.weight"]).gguf("blk.{i}.ffn_up.weight"),
    linear("model.layers.{i}.mlp.down_proj.weight", &["layers.{i}.mlp.down_proj.weight"]).gguf("blk.{i}.ffn_down.weight"),
];

/// Mixtral's experts (`block_sparse_moe`: `w1` the gate, `w3` the up, `w2` the down projection)
/// and router.
#[rustfmt::skip]
pub const MIXTRAL_EXPERTS: &[Rule] = &[
    linear("model.layers.{i}.block_sparse_moe.gate.weight", &["layers.{i}.moe.router.weight"]).gguf("blk.{i}.ffn_gate_inp.weight"),
    experts("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", &["layers.{i}.moe.gate"]).gguf("blk.{i}.ffn_gate_exps.weight"),
    experts("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", &["layers.{i}.moe.up"]).gguf("blk.{i}.ffn_up_exps.weight"),
    experts("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", &["layers.{i}.moe.down"]).gguf("blk.{i}.ffn_down_exps.weight"),
];

/// Qwen2-MoE's and Qwen3-MoE's experts and router, and Qwen2-MoE's gated shared expert.
#[rustfmt::skip]
pub const QWEN_EXPERTS: &[Rule] = &[
    linear("model.layers.{i}.mlp.gate.weight", &["layers.{i}.moe.router.weight"]).gguf("blk.{i}.ffn_gate_inp.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", &["layers.{i}.moe.gate"]).gguf("blk.{i}.ffn_gate_exps.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.up_proj.weight", &["layers.{i}.moe.up"]).gguf("blk.{i}.ffn_up_exps.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.down_proj.weight", &["layers.{i}.moe.down"]).gguf("blk.{i}.ffn_down_exps.weight"),
    linear("model.layers.{i}.mlp.shared_expert.gate_proj.weight", &["layers.{i}.moe.shared.gate_proj.weight"])
        .gguf("blk.{i}.ffn_gate_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_expert.up_proj.weight", &["layers.{i}.moe.shared.up_proj.weight"])
        .gguf("blk.{i}.ffn_up_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_expert.down_proj.weight", &["layers.{i}.moe.shared.down_proj.weight"])
        .gguf("blk.{i}.ffn_down_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_expert_gate.weight", &["layers.{i}.moe.shared_gate.weight"])
        .gguf("blk.{i}.ffn_gate_inp_shexp.weight"),
];

/// DeepSeek-V2 and V3: latent attention (see `ember_model::mla`: the query's projection `q_proj`,
/// or `q_a_proj`, its norm and `q_b_proj`; `kv_a_proj_with_mqa` is ember's `k_proj`, `kv_b_proj` its
/// `v_proj`), Llama's norms and head. Its dense layers' MLP is [`LLAMA_MLP`], the others'
/// [`DEEPSEEK_EXPERTS`]. An export writes `q_b_proj` for the query of a low-rank query.
#[rustfmt::skip]
pub const DEEPSEEK_TENSORS: &[Rule] = &[
    as_is("model.embed_tokens.weight", &["embed_tokens"]).gguf("token_embd.weight"),
    gain("model.layers.{i}.input_layernorm.weight", &["layers.{i}.input_layernorm.weight"]).gguf("blk.{i}.attn_norm.weight"),
    linear("model.layers.{i}.self_attn.q_proj.weight", &["layers.{i}.self_attn.q_proj.weight"]).gguf("blk.{i}.attn_q.weight"),
    linear("model.layers.{i}.self_attn.q_b_proj.weight", &["layers.{i}.self_attn.q_proj.weight"]).gguf("blk.{i}.attn_q_b.weight"),
    linear("model.layers.{i}.self_attn.q_a_proj.weight", &["layers.{i}.self_attn.mla.q_a_proj.weight"]).gguf("blk.{i}.attn_q_a.weight"),
    // llama.cpp's deepseek2 has no attention biases.
    as_is("model.layers.{i}.self_attn.q_a_proj.bias", &["layers.{i}.self_attn.mla.q_a_proj.bias"]),
    gain("model.layers.{i}.self_attn.q_a_layernorm.weight", &["layers.{i}.self_attn.mla.q_a_norm.weight"])
        .gguf("blk.{i}.attn_q_a_norm.weight"),
    linear("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", &["layers.{i}.self_attn.k_proj.weight"])
        .gguf("blk.{i}.attn_kv_a_mqa.weight"),
    as_is("model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias", &["layers.{i}.self_attn.k_proj.bias"]),
    gain("model.layers.{i}.self_attn.kv_a_layernorm.weight", &["layers.{i}.self_attn.mla.kv_a_norm.weight"])
        .gguf("blk.{i}.attn_kv_a_norm.weight"),
    // Read from llama.cpp's older files; its current ones split it per head into `attn_k_b` and
    // `attn_v_b` (`crate::gguf`).
    linear("model.layers.{i}.self_attn.kv_b_proj.weight", &["layers.{i}.self_attn.v_proj.weight"]).gguf("blk.{i}.attn_kv_b.weight"),
    linear("model.layers.{i}.self_attn.o_proj.weight", &["layers.{i}.self_attn.o_proj.weight"]).gguf("blk.{i}.attn_output.weight"),
    as_is("model.layers.{i}.self_attn.o_proj.bias", &["layers.{i}.self_attn.o_proj.bias"]),
    gain("model.layers.{i}.post_attention_layernorm.weight", &["layers.{i}.post_attention_layernorm.weight"])
        .gguf("blk.{i}.ffn_norm.weight"),
    gain("model.norm.weight", &["norm.weight"]).gguf("output_norm.weight"),
    linear("lm_head.weight", &["lm_head.weight"]).gguf("output.weight"),
];

/// DeepSeek's experts, router (with V3's selection bias) and plain shared experts.
#[rustfmt::skip]
pub const DEEPSEEK_EXPERTS: &[Rule] = &[
    linear("model.layers.{i}.mlp.gate.weight", &["layers.{i}.moe.router.weight"]).gguf("blk.{i}.ffn_gate_inp.weight"),
    as_is("model.layers.{i}.mlp.gate.e_score_correction_bias", &["layers.{i}.moe.selection_bias"]).gguf("blk.{i}.exp_probs_b.bias"),
    experts("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", &["layers.{i}.moe.gate"]).gguf("blk.{i}.ffn_gate_exps.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.up_proj.weight", &["layers.{i}.moe.up"]).gguf("blk.{i}.ffn_up_exps.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.down_proj.weight", &["layers.{i}.moe.down"]).gguf("blk.{i}.ffn_down_exps.weight"),
    linear("model.layers.{i}.mlp.shared_experts.gate_proj.weight", &["layers.{i}.moe.shared.gate_proj.weight"])
        .gguf("blk.{i}.ffn_gate_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_experts.up_proj.weight", &["layers.{i}.moe.shared.up_proj.weight"])
        .gguf("blk.{i}.ffn_up_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_experts.down_proj.weight", &["layers.{i}.moe.shared.down_proj.weight"])
        .gguf("blk.{i}.ffn_down_shexp.weight"),
];

/// Gemma 3: four norms a block (its MLP is [`LLAMA_MLP`]). Its `post_attention_layernorm` is the attention's output norm and
/// `pre_feedforward_layernorm` the MLP's input norm (Llama's `post_attention_layernorm`).
#[rustfmt::skip]
pub const GEMMA3_TENSORS: &[Rule] = &[
    as_is("model.embed_tokens.weight", &["embed_tokens"]).gguf("token_embd.weight"),
    gain("model.layers.{i}.input_layernorm.weight", &["layers.{i}.input_layernorm.weight"]).gguf("blk.{i}.attn_norm.weight"),
    linear("model.layers.{i}.self_attn.q_proj.weight", &["layers.{i}.self_attn.q_proj.weight"]).gguf("blk.{i}.attn_q.weight"),
    linear("model.layers.{i}.self_attn.k_proj.weight", &["layers.{i}.self_attn.k_proj.weight"]).gguf("blk.{i}.attn_k.weight"),
    linear("model.layers.{i}.self_attn.v_proj.weight", &["layers.{i}.self_attn.v_proj.weight"]).gguf("blk.{i}.attn_v.weight"),
    linear("model.layers.{i}.self_attn.o_proj.weight", &["layers.{i}.self_attn.o_proj.weight"])
        .gguf("blk.{i}.attn_output.weight"),
    // llama.cpp's gemma3 has no attention biases.
    as_is("model.layers.{i}.self_attn.q_proj.bias", &["layers.{i}.self_attn.q_proj.bias"]),
    as_is("model.layers.{i}.self_attn.k_proj.bias", &["layers.{i}.self_attn.k_proj.bias"]),
    as_is("model.layers.{i}.self_attn.v_proj.bias", &["layers.{i}.self_attn.v_proj.bias"]),
    as_is("model.layers.{i}.self_attn.o_proj.bias", &["layers.{i}.self_attn.o_proj.bias"]),
    gain("model.layers.{i}.self_attn.q_norm.weight", &["layers.{i}.self_attn.q_norm.weight"])
        .gguf("blk.{i}.attn_q_norm.weight"),
    gain("model.layers.{i}.self_attn.k_norm.weight", &["layers.{i}.self_attn.k_norm.weight"])
        .gguf("blk.{i}.attn_k_norm.weight"),
    gain("model.layers.{i}.post_attention_layernorm.weight", &["layers.{i}.attn_output_norm.weight"])
        .gguf("blk.{i}.post_attention_norm.weight"),
    gain("model.layers.{i}.pre_feedforward_layernorm.weight", &["layers.{i}.post_attention_layernorm.weight"])
        .gguf("blk.{i}.ffn_norm.weight"),
    gain("model.layers.{i}.post_feedforward_layernorm.weight", &["layers.{i}.mlp_output_norm.weight"])
        .gguf("blk.{i}.post_ffw_norm.weight"),
    gain("model.norm.weight", &["norm.weight"]).gguf("output_norm.weight"),
    linear("lm_head.weight", &["lm_head.weight"]).gguf("output.weight"),
];

/// GPT-2: `Conv1D` weights stored `[in, out]` as ember's (no transpose); `c_attn` is q, k and v
/// side by side (`[D, 3D]`, bias `[3D]`); `c_fc` is the MLP's up projection, `c_proj` its down.
#[rustfmt::skip]
pub const GPT2_TENSORS: &[Rule] = &[
    as_is("transformer.wte.weight", &["embed_tokens"]).gguf("token_embd.weight"),
    as_is("transformer.wpe.weight", &["embed_positions"]).gguf("position_embd.weight"),
    as_is("transformer.h.{i}.ln_1.weight", &["layers.{i}.input_layernorm.weight"]).gguf("blk.{i}.attn_norm.weight"),
    as_is("transformer.h.{i}.ln_1.bias", &["layers.{i}.input_layernorm.bias"]).gguf("blk.{i}.attn_norm.bias"),
    fused(
        "transformer.h.{i}.attn.c_attn.weight",
        &[
            "layers.{i}.self_attn.q_proj.weight",
            "layers.{i}.self_attn.k_proj.weight",
            "layers.{i}.self_attn.v_proj.weight",
        ],
    )
    .gguf_t("blk.{i}.attn_qkv.weight"),
    fused(
        "transformer.h.{i}.attn.c_attn.bias",
        &["layers.{i}.self_attn.q_proj.bias", "layers.{i}.self_attn.k_proj.bias", "layers.{i}.self_attn.v_proj.bias"],
    )
    .gguf("blk.{i}.attn_qkv.bias"),
    as_is("transformer.h.{i}.attn.c_proj.weight", &["layers.{i}.self_attn.o_proj.weight"])
        .gguf_t("blk.{i}.attn_output.weight"),
    as_is("transformer.h.{i}.attn.c_proj.bias", &["layers.{i}.self_attn.o_proj.bias"]).gguf("blk.{i}.attn_output.bias"),
    as_is("transformer.h.{i}.ln_2.weight", &["layers.{i}.post_attention_layernorm.weight"])
        .gguf("blk.{i}.ffn_norm.weight"),
    as_is("transformer.h.{i}.ln_2.bias", &["layers.{i}.post_attention_layernorm.bias"]).gguf("blk.{i}.ffn_norm.bias"),
    as_is("transformer.h.{i}.mlp.c_fc.weight", &["layers.{i}.mlp.up_proj.weight"]).gguf_t("blk.{i}.ffn_up.weight"),
    as_is("transformer.h.{i}.mlp.c_fc.bias", &["layers.{i}.mlp.up_proj.bias"]).gguf("blk.{i}.ffn_up.bias"),
    as_is("transformer.h.{i}.mlp.c_proj.weight", &["layers.{i}.mlp.down_proj.weight"]).gguf_t("blk.{i}.ffn_down.weight"),
    as_is("transformer.h.{i}.mlp.c_proj.bias", &["layers.{i}.mlp.down_proj.bias"]).gguf("blk.{i}.ffn_down.bias"),
    as_is("transformer.ln_f.weight", &["norm.weight"]).gguf("output_norm.weight"),
    as_is("transformer.ln_f.bias", &["norm.bias"]).gguf("output_norm.bias"),
    linear("lm_head.weight", &["lm_head.weight"]).gguf("output.weight"),
];

/// Llama's sizes, shared by every family but GPT-2.
const LLAMA_KEYS: SizeKeys = SizeKeys {
    d_model: "hidden_size",
    n_layers: "num_hidden_layers",
    n_heads: "num_attention_heads",
    n_kv_heads: Some("num_key_value_heads"),
    head_dim: Some("head_dim"),
    d_ff: "intermediate_size",
    d_ff_default: None,
    max_seq_len: "max_position_embeddings",
    norm_eps: ("rms_norm_eps", 1e-6),
    activation: "hidden_act",
    tie_default: false,
};

const LLAMA_PARTS: Parts = Parts {
    norm: NormKind::RmsNorm,
    positions: Positions::Rope,
    qk_norm: false,
    qk_norm_whole: false,
    sandwich_norms: false,
    embed_scale: false,
};

const SILU: &[(&str, MlpKind)] = &[("silu", MlpKind::Swiglu)];

/// What Llama's writer replaces (kept as it was before the table).
const LLAMA_REPLACED: &[&str] =
    &["rope_scaling", "rope_theta", "rope_parameters", "sliding_window", "use_sliding_window", "attention_bias"];

const fn llama_like(
    architecture: Architecture,
    gguf_arch: &'static str,
    class_name: &'static str,
    model_type: &'static str,
    read: fn(&Reader, &mut ModelConfig) -> Result<(), HfError>,
    write: fn(&ModelConfig, &mut Map<String, Value>),
) -> Family {
    Family {
        architecture,
        gguf_arch,
        class_name,
        model_type,
        keys: LLAMA_KEYS,
        parts: LLAMA_PARTS,
        activations: SILU,
        read,
        write,
        replaced_keys: &[LLAMA_REPLACED],
        tensors: &[LLAMA_TENSORS, LLAMA_MLP],
        buffers: &["rotary_emb.inv_freq"],
        optional_prefix: None,
    }
}

/// Every family, in the order [`Architecture::for_model`] prefers them.
pub const FAMILIES: [Family; 12] = [
    llama_like(
        Architecture::Llama,
        "llama",
        "LlamaForCausalLM",
        "llama",
        config_map::read_llama,
        config_map::write_llama,
    ),
    llama_like(
        Architecture::Qwen2,
        "qwen2",
        "Qwen2ForCausalLM",
        "qwen2",
        config_map::read_qwen2,
        config_map::write_qwen2,
    ),
    llama_like(
        Architecture::Mistral,
        "llama",
        "MistralForCausalLM",
        "mistral",
        config_map::read_mistral,
        config_map::write_mistral,
    ),
    Family {
        architecture: Architecture::Qwen3,
        gguf_arch: "qwen3",
        class_name: "Qwen3ForCausalLM",
        model_type: "qwen3",
        keys: LLAMA_KEYS,
        parts: Parts { qk_norm: true, ..LLAMA_PARTS },
        activations: SILU,
        read: config_map::read_qwen3,
        write: config_map::write_qwen3,
        replaced_keys: &[&[
            "rope_scaling",
            "rope_theta",
            "rope_parameters",
            "sliding_window",
            "use_sliding_window",
            "attention_bias",
            "layer_types",
        ]],
        tensors: &[LLAMA_TENSORS, LLAMA_MLP],
        buffers: &["rotary_emb.inv_freq"],
        optional_prefix: None,
    },
    Family {
        architecture: Architecture::Gemma3,
        gguf_arch: "gemma3",
        class_name: "Gemma3ForCausalLM",
        model_type: "gemma3_text",
        keys: SizeKeys { activation: "hidden_activation", tie_default: true, ..LLAMA_KEYS },
        parts: Parts {
            norm: NormKind::RmsNormPlusOne,
            qk_norm: true,
            sandwich_norms: true,
            embed_scale: true,
            ..LLAMA_PARTS
        },
        activations: &[("gelu_pytorch_tanh", MlpKind::Geglu)],
        read: config_map::read_gemma3,
        write: config_map::write_gemma3,
        replaced_keys: &[&[
            "rope_scaling",
            "rope_theta",
            "rope_parameters",
            "rope_local_base_freq",
            "sliding_window",
            "sliding_window_pattern",
            "layer_types",
            "attention_bias",
            "hidden_act",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ]],
        tensors: &[GEMMA3_TENSORS, LLAMA_MLP],
        buffers: &["rotary_emb.inv_freq", "rotary_emb_local.inv_freq"],
        optional_prefix: None,
    },
    Family {
        architecture: Architecture::Gpt2,
        gguf_arch: "gpt2",
        class_name: "GPT2LMHeadModel",
        model_type: "gpt2",
        keys: SizeKeys {
            d_model: "n_embd",
            n_layers: "n_layer",
            n_heads: "n_head",
            n_kv_heads: None,
            head_dim: None,
            d_ff: "n_inner",
            d_ff_default: Some(4),
            max_seq_len: "n_positions",
            norm_eps: ("layer_norm_epsilon", 1e-5),
            activation: "activation_function",
            tie_default: true,
        },
        parts: Parts {
            norm: NormKind::LayerNorm,
            positions: Positions::Learned,
            qk_norm: false,
            qk_norm_whole: false,
            sandwich_norms: false,
            embed_scale: false,
        },
        activations: &[("gelu_new", MlpKind::Gelu), ("gelu", MlpKind::GeluExact)],
        read: config_map::read_gpt2,
        write: config_map::write_gpt2,
        replaced_keys: &[&["scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"]],
        tensors: &[GPT2_TENSORS],
        // The causal mask GPT-2 checkpoints saved as a buffer (`attn.bias`, `[1, 1, T, T]`).
        buffers: &[".attn.bias", ".attn.masked_bias"],
        optional_prefix: Some("transformer."),
    },
    Family {
        tensors: &[LLAMA_TENSORS, MIXTRAL_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS],
        ..llama_like(
            Architecture::Mixtral,
            "llama",
            "MixtralForCausalLM",
            "mixtral",
            config_map::read_mixtral,
            config_map::write_mixtral,
        )
    },
    Family {
        tensors: &[LLAMA_TENSORS, QWEN_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS],
        ..llama_like(
            Architecture::Qwen2Moe,
            "qwen2moe",
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            config_map::read_qwen2_moe,
            config_map::write_qwen2_moe,
        )
    },
    Family {
        tensors: &[LLAMA_TENSORS, QWEN_EXPERTS],
        parts: Parts { qk_norm: true, ..LLAMA_PARTS },
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, &["layer_types"]],
        ..llama_like(
            Architecture::Qwen3Moe,
            "qwen3moe",
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            config_map::read_qwen3_moe,
            config_map::write_qwen3_moe,
        )
    },
    Family {
        tensors: &[LLAMA_TENSORS, QWEN_EXPERTS],
        parts: Parts { qk_norm: true, qk_norm_whole: true, ..LLAMA_PARTS },
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, &["clip_qkv"]],
        ..llama_like(
            Architecture::Olmoe,
            "olmoe",
            "OlmoeForCausalLM",
            "olmoe",
            config_map::read_olmoe,
            config_map::write_olmoe,
        )
    },
    Family {
        tensors: &[DEEPSEEK_TENSORS, LLAMA_MLP, DEEPSEEK_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, DEEPSEEK_KEYS],
        ..llama_like(
            Architecture::DeepseekV2,
            "deepseek2",
            "DeepseekV2ForCausalLM",
            "deepseek_v2",
            config_map::read_deepseek_v2,
            config_map::write_deepseek_v2,
        )
    },
    Family {
        tensors: &[DEEPSEEK_TENSORS, LLAMA_MLP, DEEPSEEK_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, DEEPSEEK_KEYS],
        ..llama_like(
            Architecture::DeepseekV3,
            "deepseek2",
            "DeepseekV3ForCausalLM",
            "deepseek_v3",
            config_map::read_deepseek_v3,
            config_map::write_deepseek_v3,
        )
    },
];

/// DeepSeek's own keys, replaced by its writer.
const DEEPSEEK_KEYS: &[&str] = &[
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "topk_method",
    "scoring_func",
    "rope_interleave",
    "moe_layer_freq",
    "mlp_bias",
];

/// The experts' keys a mixture-of-experts family's writer replaces (with Llama's).
const EXPERT_KEYS: &[&str] = &[
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
    "decoder_sparse_step",
    "mlp_only_layers",
];

impl Architecture {
    /// Its row of the family table.
    pub fn family(self) -> &'static Family {
        FAMILIES.iter().find(|f| f.architecture == self).expect("every architecture has a row")
    }

    pub fn class_name(self) -> &'static str {
        self.family().class_name
    }

    pub fn model_type(self) -> &'static str {
        self.family().model_type
    }

    /// The architecture a GGUF file's `general.architecture` names, if ember maps it (`llama` is
    /// Llama's, not Mistral's).
    pub fn from_gguf(name: &str) -> Option<Self> {
        FAMILIES.iter().find(|f| !f.gguf_arch.is_empty() && f.gguf_arch == name).map(|f| f.architecture)
    }

    /// The architecture of a `architectures[0]` class name, if ember supports it.
    pub fn from_class(name: &str) -> Option<Self> {
        FAMILIES.iter().find(|f| f.class_name == name).map(|f| f.architecture)
    }

    /// The family an ember model exports as: the one built from its parts (GPT-2 for LayerNorm and
    /// learned positions, Gemma 3 for Gemma's norms, Qwen3 for q/k norms); among Llama's, Qwen2
    /// when it has q/k/v bias, Mistral with a sliding window, Llama otherwise. A model no family
    /// is built from gets Llama's rule, and [`crate::config_map::expressible`] says why it fails.
    pub fn for_model(c: &ModelConfig) -> Self {
        if c.mla.is_some() {
            let v3 = c.moe.as_ref().is_some_and(|m| m.scoring == ember_model::Scoring::Sigmoid || m.selection_bias);
            return if v3 { Self::DeepseekV3 } else { Self::DeepseekV2 };
        }
        if let Some(moe) = &c.moe {
            return match (c.qk_norm, moe.shared_expert.is_some() || c.qkv_bias) {
                (true, _) if c.qk_norm_whole => Self::Olmoe,
                (true, _) => Self::Qwen3Moe,
                (false, true) => Self::Qwen2Moe,
                (false, false) => Self::Mixtral,
            };
        }
        let llama = || {
            if c.qkv_bias {
                Self::Qwen2
            } else if c.sliding_window.is_some() {
                Self::Mistral
            } else {
                Self::Llama
            }
        };
        match FAMILIES.iter().find(|f| f.parts.of(c) && f.activations.iter().any(|&(_, m)| m == c.mlp)) {
            Some(f) if f.parts == LLAMA_PARTS => llama(),
            Some(f) => f.architecture,
            None => llama(),
        }
    }
}

/// The layer index `key` has where `pattern` says `{i}`: `Some(None)` for a pattern without one.
/// A pattern with an expert index `{j}` as well matches that index too ([`match_expert`]).
fn match_pattern(pattern: &str, key: &str) -> Option<Option<usize>> {
    if pattern.contains("{j}") {
        return match_expert(pattern, key).map(|(i, _)| Some(i));
    }
    let Some((before, after)) = pattern.split_once("{i}") else {
        return (pattern == key).then_some(None);
    };
    let digits = key.strip_prefix(before)?.strip_suffix(after)?;
    Some(Some(index(digits)?))
}

/// A decimal index as written in a name: `01` and `+1` are not 1.
fn index(digits: &str) -> Option<usize> {
    let i: usize = digits.parse().ok()?;
    (i.to_string() == digits).then_some(i)
}

/// The layer and expert indices of `key` where `pattern` says `{i}`, then `{j}`.
pub(crate) fn match_expert(pattern: &str, key: &str) -> Option<(usize, usize)> {
    let (before, rest) = pattern.split_once("{i}")?;
    let (middle, after) = rest.split_once("{j}")?;
    let rest = key.strip_prefix(before)?.strip_suffix(after)?;
    let end = rest.find(|c: char| !c.is_ascii_digit())?;
    let (layer, tail) = rest.split_at(end);
    Some((index(layer)?, index(tail.strip_prefix(middle)?)?))
}

fn fill(pattern: &str, layer: Option<usize>) -> String {
    match layer {
        Some(i) => pattern.replace("{i}", &i.to_string()),
        None => pattern.to_string(),
    }
}

/// `name` (a pattern filled with its layer) with expert `j`'s index.
pub(crate) fn fill_expert(name: &str, j: usize) -> String {
    name.replace("{j}", &j.to_string())
}

/// A file tensor's place in ember: its path(s) and layout, and an expert's index in its stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToEmber {
    pub paths: Vec<String>,
    pub layout: Layout,
    pub expert: Option<usize>,
}

/// An ember parameter's place in the file: the tensor's name and layout, and, for a fused tensor,
/// every path it holds (this parameter at `part`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToHf {
    pub name: String,
    pub layout: Layout,
    pub paths: Vec<String>,
    pub part: usize,
}

impl Family {
    /// Where a file tensor goes; `None` for a name the family does not have.
    pub fn hf_to_ember(&self, key: &str) -> Option<ToEmber> {
        let find = |key: &str| {
            self.rules().find_map(|r| {
                let layer = match_pattern(r.hf, key)?;
                let expert = match_expert(r.hf, key).map(|(_, j)| j);
                let paths = r.ember.iter().map(|e| fill(e, layer)).collect();
                Some(ToEmber { paths, layout: r.layout, expert })
            })
        };
        find(key).or_else(|| {
            let prefix = self.optional_prefix?;
            (!key.starts_with(prefix)).then(|| find(&format!("{prefix}{key}"))).flatten()
        })
    }

    /// Every tensor rule of the family.
    pub fn rules(&self) -> impl Iterator<Item = &'static Rule> {
        self.tensors.iter().flat_map(|group| group.iter())
    }

    /// Where an ember parameter goes; `None` for one the family has no name for (a LoRA adapter).
    /// A stack of experts' name keeps `{j}` for the expert index ([`fill_expert`]).
    pub fn ember_to_hf(&self, path: &str) -> Option<ToHf> {
        self.rules().find_map(|r| {
            r.ember.iter().enumerate().find_map(|(part, e)| {
                let layer = match_pattern(e, path)?;
                Some(ToHf {
                    name: fill(r.hf, layer),
                    layout: r.layout,
                    paths: r.ember.iter().map(|e| fill(e, layer)).collect(),
                    part,
                })
            })
        })
    }

    /// The Hugging Face name of GGUF tensor `name`, and whether its values are the Hugging Face
    /// ones transposed; `None` for a name the family has no rule for.
    pub fn gguf_to_hf(&self, name: &str) -> Option<(String, bool)> {
        self.rules().filter(|r| !r.gguf.is_empty()).find_map(|r| {
            let layer = match_pattern(r.gguf, name)?;
            Some((fill(r.hf, layer), r.gguf_transposed))
        })
    }

    /// The GGUF name of Hugging Face tensor `name` (with or without the optional prefix), and
    /// whether it is stored transposed; `None` where llama.cpp's architecture has no such tensor.
    pub fn hf_to_gguf(&self, name: &str) -> Option<(String, bool)> {
        let find = |key: &str| {
            self.rules().filter(|r| !r.gguf.is_empty()).find_map(|r| {
                let layer = match_pattern(r.hf, key)?;
                Some((fill(r.gguf, layer), r.gguf_transposed))
            })
        };
        find(name).or_else(|| {
            let prefix = self.optional_prefix?;
            (!name.starts_with(prefix)).then(|| find(&format!("{prefix}{name}"))).flatten()
        })
    }

    /// Whether `key` is a buffer, not a parameter.
    pub fn is_buffer(&self, key: &str) -> bool {
        self.buffers.iter().any(|b| key.ends_with(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_architecture_has_one_row_and_names_round_trip() {
        for f in &FAMILIES {
            assert_eq!(f.architecture.family().class_name, f.class_name);
            assert_eq!(Architecture::from_class(f.class_name), Some(f.architecture));
            for r in f.rules() {
                for (part, e) in r.ember.iter().enumerate() {
                    let (hf, path) = (fill_expert(&fill(r.hf, Some(7)), 3), fill(e, Some(7)));
                    let to = f.hf_to_ember(&hf).unwrap();
                    assert_eq!((to.paths[part].as_str(), to.layout), (path.as_str(), r.layout), "{hf}");
                    let back = f.ember_to_hf(&path).unwrap();
                    // DeepSeek's query is `q_proj` or, low-rank, `q_b_proj`: one ember path, the
                    // first name back (an export renames it by the model's config).
                    let first = f.rules().find(|o| o.ember.contains(e)).unwrap();
                    let hf = if first.hf == r.hf { hf.clone() } else { fill_expert(&fill(first.hf, Some(7)), 3) };
                    assert_eq!((fill_expert(&back.name, 3), back.part), (hf.clone(), part), "{path}");
                    assert_eq!(to.expert, (r.layout == Layout::Experts).then_some(3), "{hf}");
                }
            }
        }
    }

    #[test]
    fn patterns_take_layer_indices_only() {
        assert_eq!(match_pattern("a.{i}.b", "a.12.b"), Some(Some(12)));
        assert_eq!(match_pattern("a.{i}.b", "a.012.b"), None);
        assert_eq!(match_pattern("a.{i}.b", "a.+1.b"), None);
        assert_eq!(match_pattern("a.{i}.b", "a..b"), None);
        assert_eq!(match_pattern("a.b", "a.b"), Some(None));
        assert_eq!(match_expert("a.{i}.e.{j}.w", "a.12.e.3.w"), Some((12, 3)));
        assert_eq!(match_expert("a.{i}.e.{j}.w", "a.12.e.03.w"), None);
        assert_eq!(match_expert("a.{i}.e.{j}.w", "a.1.2.e.3.w"), None);
        assert_eq!(match_pattern("a.{i}.e.{j}.w", "a.12.e.3.w"), Some(Some(12)));
        let mixtral = Architecture::Mixtral.family();
        let to = mixtral.hf_to_ember("model.layers.1.block_sparse_moe.experts.5.w3.weight").unwrap();
        assert_eq!((to.paths, to.layout, to.expert), (vec!["layers.1.moe.up".to_string()], Layout::Experts, Some(5)));
        let llama = Architecture::Llama.family();
        assert_eq!(llama.hf_to_ember("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
        assert!(llama.is_buffer("model.layers.0.self_attn.rotary_emb.inv_freq"));
        assert_eq!(llama.ember_to_hf("layers.0.self_attn.q_proj.lora.a"), None);
    }

    #[test]
    fn gpt2_names_come_with_or_without_the_prefix() {
        let gpt2 = Architecture::Gpt2.family();
        let qkv = |l: usize| -> Vec<String> {
            ["q", "k", "v"].iter().map(|p| format!("layers.{l}.self_attn.{p}_proj.weight")).collect()
        };
        for key in ["h.3.attn.c_attn.weight", "transformer.h.3.attn.c_attn.weight"] {
            let want = ToEmber { paths: qkv(3), layout: Layout::Fused, expert: None };
            assert_eq!(gpt2.hf_to_ember(key), Some(want), "{key}");
        }
        assert_eq!(gpt2.hf_to_ember("wpe.weight").unwrap().paths, ["embed_positions"]);
        assert_eq!(gpt2.hf_to_ember("lm_head.weight").unwrap().layout, Layout::Transposed);
        assert_eq!(gpt2.hf_to_ember("transformer.transformer.wte.weight"), None);
        let k = gpt2.ember_to_hf("layers.3.self_attn.k_proj.weight").unwrap();
        assert_eq!((k.name.as_str(), k.part, k.paths), ("transformer.h.3.attn.c_attn.weight", 1, qkv(3)));
        assert!(gpt2.is_buffer("h.0.attn.bias") && gpt2.is_buffer("transformer.h.0.attn.masked_bias"));
        assert!(!gpt2.is_buffer("h.0.attn.c_attn.bias"));
    }

    #[test]
    fn gemma3_norm_names_are_its_own() {
        let gemma = Architecture::Gemma3.family();
        let path = |k: &str| gemma.hf_to_ember(k).unwrap().paths.remove(0);
        assert_eq!(path("model.layers.2.post_attention_layernorm.weight"), "layers.2.attn_output_norm.weight");
        assert_eq!(path("model.layers.2.pre_feedforward_layernorm.weight"), "layers.2.post_attention_layernorm.weight");
        assert_eq!(path("model.layers.2.post_feedforward_layernorm.weight"), "layers.2.mlp_output_norm.weight");
    }
}
