//! Llama (`LlamaForCausalLM`) and Mistral (`MistralForCausalLM`, Llama with a sliding window):
//! RMSNorm, SwiGLU, RoPE. Their tensor groups, sizes' keys and parts are the base the other
//! families' tables extend. llama.cpp's `llama` holds both (Mistral's window has no key there) and
//! stores the q/k rows with each head's rotary pairs side by side.

use ember_model::{MlpKind, ModelConfig, NormKind, Positions};
use serde_json::{json, Map, Value};

use super::Registration;
use crate::config_json::{read_default_rope, rope_parameters, Reader};
use crate::error::HfError;
use crate::family::Stored::{Projection, Table};
use crate::family::{as_is, dense, gain, join, linear, same_name, Family, Parts, ReadKeys, Rule, SizeKeys, WriteKeys};
use crate::gguf::hparams::GgufRules;
use crate::gguf::{GgufError, GgufFile};

/// The embedding, `model.embed_tokens`.
#[rustfmt::skip]
pub(crate) const EMBEDDING: &[Rule] = &[
    as_is("model.embed_tokens.weight", &["embed_tokens"]).gguf("token_embd.weight").stored(Table),
];

/// The block's input norm and the query.
#[rustfmt::skip]
pub(crate) const QUERY: &[Rule] = &[
    gain("model.layers.{i}.input_layernorm.weight", &["layers.{i}.input_layernorm.weight"]).gguf("blk.{i}.attn_norm.weight"),
    linear("model.layers.{i}.self_attn.q_proj.weight", &["layers.{i}.self_attn.q_proj.weight"]).gguf("blk.{i}.attn_q.weight").stored(Projection),
];

/// The keys and values.
#[rustfmt::skip]
pub(crate) const KEY_VALUE: &[Rule] = &[
    linear("model.layers.{i}.self_attn.k_proj.weight", &["layers.{i}.self_attn.k_proj.weight"]).gguf("blk.{i}.attn_k.weight").stored(Projection),
    linear("model.layers.{i}.self_attn.v_proj.weight", &["layers.{i}.self_attn.v_proj.weight"]).gguf("blk.{i}.attn_v.weight").stored(Projection),
];

/// The attention's output projection.
#[rustfmt::skip]
pub(crate) const ATTN_OUTPUT: &[Rule] = &[
    linear("model.layers.{i}.self_attn.o_proj.weight", &["layers.{i}.self_attn.o_proj.weight"]).gguf("blk.{i}.attn_output.weight").stored(Projection),
];

/// The four projections' biases (Qwen2's q/k/v; all four with Qwen3's `attention_bias`).
#[rustfmt::skip]
pub(crate) const BIASES: [Rule; 4] = [
    as_is("model.layers.{i}.self_attn.q_proj.bias", &["layers.{i}.self_attn.q_proj.bias"]).gguf("blk.{i}.attn_q.bias"),
    as_is("model.layers.{i}.self_attn.k_proj.bias", &["layers.{i}.self_attn.k_proj.bias"]).gguf("blk.{i}.attn_k.bias"),
    as_is("model.layers.{i}.self_attn.v_proj.bias", &["layers.{i}.self_attn.v_proj.bias"]).gguf("blk.{i}.attn_v.bias"),
    as_is("model.layers.{i}.self_attn.o_proj.bias", &["layers.{i}.self_attn.o_proj.bias"]).gguf("blk.{i}.attn_output.bias"),
];

/// The per-head q/k norms (Qwen3's, Gemma 3's; OLMoE's over the whole projections).
#[rustfmt::skip]
pub(crate) const QK_NORMS: &[Rule] = &[
    gain("model.layers.{i}.self_attn.q_norm.weight", &["layers.{i}.self_attn.q_norm.weight"]).gguf("blk.{i}.attn_q_norm.weight"),
    gain("model.layers.{i}.self_attn.k_norm.weight", &["layers.{i}.self_attn.k_norm.weight"]).gguf("blk.{i}.attn_k_norm.weight"),
];

/// The MLP's input norm, Hugging Face's `post_attention_layernorm`.
#[rustfmt::skip]
pub(crate) const FFN_NORM: &[Rule] = &[
    gain("model.layers.{i}.post_attention_layernorm.weight", &["layers.{i}.post_attention_layernorm.weight"]).gguf("blk.{i}.ffn_norm.weight"),
];

/// The final norm and the LM head.
#[rustfmt::skip]
pub(crate) const HEAD: &[Rule] = &[
    gain("model.norm.weight", &["norm.weight"]).gguf("output_norm.weight"),
    linear("lm_head.weight", &["lm_head.weight"]).gguf("output.weight").stored(Table),
];

/// Llama, Qwen2 (q/k/v biases), Mistral and Qwen3 (q/k norms; all four biases with
/// `attention_bias`): ember's own names, under `model.`. The MLP's are [`LLAMA_MLP`].
pub(crate) const LLAMA_TENSORS: &[Rule] =
    &join::<15>(&[EMBEDDING, QUERY, KEY_VALUE, ATTN_OUTPUT, &BIASES, QK_NORMS, FFN_NORM, HEAD]);

/// The MLP of Llama's blocks (and Gemma 3's, and DeepSeek's dense layers').
#[rustfmt::skip]
pub(crate) const LLAMA_MLP: &[Rule] = &[
    linear("model.layers.{i}.mlp.gate_proj.weight", &["layers.{i}.mlp.gate_proj.weight"]).gguf("blk.{i}.ffn_gate.weight").stored(Projection),
    linear("model.layers.{i}.mlp.up_proj.weight", &["layers.{i}.mlp.up_proj.weight"]).gguf("blk.{i}.ffn_up.weight").stored(Projection),
    linear("model.layers.{i}.mlp.down_proj.weight", &["layers.{i}.mlp.down_proj.weight"]).gguf("blk.{i}.ffn_down.weight").stored(Projection),
];

/// Llama's sizes, shared by every family but GPT-2.
pub(crate) const LLAMA_KEYS: SizeKeys = SizeKeys {
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

pub(crate) const LLAMA_PARTS: Parts = Parts {
    norm: NormKind::RmsNorm,
    positions: Positions::Rope,
    qk_norm: false,
    qk_norm_whole: false,
    sandwich_norms: false,
    embed_scale: false,
};

const SILU: &[(&str, MlpKind)] = &[("silu", MlpKind::Swiglu)];

/// What Llama's writer replaces (kept as it was before the table).
pub(crate) const LLAMA_REPLACED: &[&str] =
    &["rope_scaling", "rope_theta", "rope_parameters", "sliding_window", "use_sliding_window", "attention_bias"];

/// A family built as Llama is: its sizes' keys, parts, SiLU, tensors and buffers; `exports` says
/// which models that name no family it takes ([`Family::exports`]).
pub(crate) const fn llama_like(
    gguf_arch: &'static str,
    class_name: &'static str,
    model_type: &'static str,
    (read, write): (ReadKeys, WriteKeys),
    exports: fn(&ModelConfig) -> bool,
) -> Family {
    Family {
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
        export_name: same_name,
        exports,
        aux_loss_in_config: true,
    }
}

/// Llama: `LlamaForCausalLM`, llama.cpp's `llama` without experts. It exports a dense model
/// without q/k/v bias or window.
pub const LLAMA: Registration = Registration {
    hf: llama_like("llama", "LlamaForCausalLM", "llama", (read_llama, write_llama), |c| {
        dense(c) && !c.qkv_bias && c.sliding_window.is_none()
    }),
    gguf: GgufRules { claims: no_experts, ..LLAMA_GGUF },
};

/// Mistral: Llama with `sliding_window`; llama.cpp's `llama`, which has no window (its files are
/// read as Llama's). It exports a dense model without q/k/v bias, with a window.
pub const MISTRAL: Registration = Registration {
    hf: llama_like("llama", "MistralForCausalLM", "mistral", (read_mistral, write_mistral), |c| {
        dense(c) && !c.qkv_bias && c.sliding_window.is_some()
    }),
    gguf: GgufRules { claims: no_file, ..LLAMA_GGUF },
};

/// llama.cpp's `llama`: q/k rows permuted.
pub(crate) const LLAMA_GGUF: GgufRules = GgufRules { permutes_qk: true, ..GgufRules::DENSE };

/// Whether llama.cpp's `llama` file has experts (then it is Mixtral's).
pub(crate) fn has_experts(f: &GgufFile) -> Result<bool, GgufError> {
    Ok(f.meta().u64("llama.expert_count")?.is_some_and(|n| n > 0))
}

fn no_experts(f: &GgufFile) -> Result<bool, GgufError> {
    has_experts(f).map(|experts| !experts)
}

fn no_file(_: &GgufFile) -> Result<bool, GgufError> {
    Ok(false)
}

/// Llama's keys: RoPE, no biases (Qwen2's q/k/v biases where `qkv_bias`).
pub(crate) fn read_llama_like(r: &Reader, c: &mut ModelConfig, qkv_bias: bool) -> Result<(), HfError> {
    if r.flag("mlp_bias") == Some(true) {
        return Err(r.bad("mlp_bias = true: ember reads MLP biases for GPT-2 only".into()));
    }
    if !qkv_bias && r.flag("attention_bias") == Some(true) {
        return Err(r.bad("attention_bias = true (an o_proj bias): ember reads q/k/v bias only here".into()));
    }
    c.qkv_bias = qkv_bias;
    (c.rope_theta, c.rope_scaling) = read_default_rope(r)?;
    Ok(())
}

fn read_llama(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, false)
}

pub(crate) fn read_mistral(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, false)?;
    c.sliding_window = r.opt_usize("sliding_window");
    Ok(())
}

fn write_llama(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(false));
    obj.insert("mlp_bias".into(), json!(false));
}

pub(crate) fn write_mistral(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
}
