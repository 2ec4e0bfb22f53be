//! The families with experts in every block: Mixtral (`MixtralForCausalLM`), Qwen2-MoE
//! (`Qwen2MoeForCausalLM`, with a gated shared expert), Qwen3-MoE (`Qwen3MoeForCausalLM`, q/k
//! norms) and OLMoE (`OlmoeForCausalLM`, q/k norms over the whole projections). Llama's attention;
//! experts one tensor per expert in Hugging Face's files, one stack per projection in llama.cpp's
//! (`blk.{i}.ffn_gate_exps`, `[E, out, in]`), the router `ffn_gate_inp`, Qwen2-MoE's shared expert
//! `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`. llama.cpp renormalises the top-k weights of its
//! `llama` and `qwen3moe`, not those of `qwen2moe` and `olmoe`: a model that differs is refused.

use ember_model::{ModelConfig, MoeConfig};
use serde_json::{json, Map, Value};

use super::llama::{
    has_experts, llama_like, read_llama_like, read_mistral, write_mistral, LLAMA_GGUF, LLAMA_PARTS, LLAMA_REPLACED,
    LLAMA_TENSORS,
};
use super::qwen::{qkv_bias_gguf, read_qwen2, read_qwen3, write_qwen2, write_qwen3};
use super::Registration;
use crate::config_json::{rope_parameters, Reader};
use crate::error::HfError;
use crate::family::{experts, linear, Family, Parts, Rule};
use crate::gguf::hparams::{GgufExperts, GgufRules};

/// Mixtral's experts (`block_sparse_moe`: `w1` the gate, `w3` the up, `w2` the down projection)
/// and router.
#[rustfmt::skip]
const MIXTRAL_EXPERTS: &[Rule] = &[
    linear("model.layers.{i}.block_sparse_moe.gate.weight", &["layers.{i}.moe.router.weight"]).gguf("blk.{i}.ffn_gate_inp.weight"),
    experts("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", &["layers.{i}.moe.gate"]).gguf("blk.{i}.ffn_gate_exps.weight"),
    experts("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", &["layers.{i}.moe.up"]).gguf("blk.{i}.ffn_up_exps.weight"),
    experts("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", &["layers.{i}.moe.down"]).gguf("blk.{i}.ffn_down_exps.weight"),
];

/// Qwen2-MoE's and Qwen3-MoE's experts and router, and Qwen2-MoE's gated shared expert.
#[rustfmt::skip]
const QWEN_EXPERTS: &[Rule] = &[
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

/// The experts' keys a mixture-of-experts family's writer replaces (with Llama's).
pub(crate) const EXPERT_KEYS: &[&str] = &[
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

/// The tensors of [`QWEN_EXPERTS`] that llama.cpp stores without their leading axis of 1.
const QWEN_SQUEEZED: &[&str] = &["shared_expert_gate.weight"];

/// Mixtral: `MixtralForCausalLM`, llama.cpp's `llama` with experts (the width in
/// `feed_forward_length`, top-k weights renormalised).
pub const MIXTRAL: Registration = Registration {
    hf: Family {
        tensors: &[LLAMA_TENSORS, MIXTRAL_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS],
        ..llama_like("llama", "MixtralForCausalLM", "mixtral", (read_mixtral, write_mixtral), |c| {
            experts_of(c).is_some_and(|shared| !c.qk_norm && !shared)
        })
    },
    gguf: GgufRules {
        claims: has_experts,
        experts: Some(GgufExperts { norm_topk: true, shared: false, width_is_ffn: true }),
        ..LLAMA_GGUF
    },
};

/// Qwen2-MoE: `Qwen2MoeForCausalLM`, llama.cpp's `qwen2moe` (q/k/v biases, the gated shared expert).
pub const QWEN2_MOE: Registration = Registration {
    hf: Family {
        tensors: &[LLAMA_TENSORS, QWEN_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS],
        ..llama_like("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe", (read_qwen2_moe, write_qwen2_moe), |c| {
            experts_of(c).is_some_and(|shared| !c.qk_norm && shared)
        })
    },
    gguf: GgufRules {
        experts: Some(GgufExperts { norm_topk: false, shared: true, width_is_ffn: false }),
        read: qkv_bias_gguf,
        squeezed: QWEN_SQUEEZED,
        ..GgufRules::DENSE
    },
};

/// Qwen3-MoE: `Qwen3MoeForCausalLM`, llama.cpp's `qwen3moe` (top-k weights renormalised).
pub const QWEN3_MOE: Registration = Registration {
    hf: Family {
        tensors: &[LLAMA_TENSORS, QWEN_EXPERTS],
        parts: Parts { qk_norm: true, ..LLAMA_PARTS },
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, &["layer_types"]],
        ..llama_like("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", (read_qwen3_moe, write_qwen3_moe), |c| {
            experts_of(c).is_some() && c.qk_norm && !c.qk_norm_whole
        })
    },
    gguf: GgufRules {
        experts: Some(GgufExperts { norm_topk: true, shared: false, width_is_ffn: false }),
        squeezed: QWEN_SQUEEZED,
        ..GgufRules::DENSE
    },
};

/// OLMoE: `OlmoeForCausalLM`, llama.cpp's `olmoe` (the width in `feed_forward_length`).
pub const OLMOE: Registration = Registration {
    hf: Family {
        tensors: &[LLAMA_TENSORS, QWEN_EXPERTS],
        parts: Parts { qk_norm: true, qk_norm_whole: true, ..LLAMA_PARTS },
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, &["clip_qkv"]],
        // Whole q/k norms are OLMoE's, with experts or without.
        ..llama_like("olmoe", "OlmoeForCausalLM", "olmoe", (read_olmoe, write_olmoe), |c| {
            c.mla.is_none() && c.qk_norm && c.qk_norm_whole
        })
    },
    gguf: GgufRules {
        experts: Some(GgufExperts { norm_topk: false, shared: false, width_is_ffn: true }),
        refuses: olmoe_refuses,
        squeezed: QWEN_SQUEEZED,
        ..GgufRules::DENSE
    },
};

/// For a model with experts and no latent attention, whether it has a shared expert or q/k/v bias
/// (what Qwen2-MoE has and Mixtral lacks): what this file's families export.
fn experts_of(c: &ModelConfig) -> Option<bool> {
    let moe = c.moe.as_ref().filter(|_| c.mla.is_none())?;
    Some(moe.shared_expert.is_some() || c.qkv_bias)
}

/// llama.cpp's `olmoe` norms the keys over d_model: it has no place for fewer key/value heads.
fn olmoe_refuses(config: &ModelConfig) -> Option<String> {
    (config.n_kv_heads() != config.n_heads).then(|| {
        format!(
            "llama.cpp's olmoe norms the keys over d_model: a model of {} key/value heads for {} query heads has \
             no place in it",
            config.n_kv_heads(),
            config.n_heads
        )
    })
}

/// The experts' keys: `experts` is the key of their count (`num_local_experts` for Mixtral,
/// `num_experts` for Qwen's, either read), `width` of an expert's width, and `norm_topk` whether
/// the family renormalises the top-k weights when its config does not say. Dense layers
/// (`mlp_only_layers`, `decoder_sparse_step` above 1) are refused: every ember block of a
/// mixture-of-experts model has experts.
pub(crate) fn read_experts(r: &Reader, width: &'static str, norm_topk: bool) -> Result<MoeConfig, HfError> {
    let n_experts = match r.opt_usize("num_experts").or_else(|| r.opt_usize("num_local_experts")) {
        Some(n) => n,
        None => r.usize("num_local_experts")?,
    };
    if r.opt_usize("decoder_sparse_step").is_some_and(|s| s > 1) {
        return Err(r.bad(
            "decoder_sparse_step > 1 (dense layers between the sparse ones): ember builds every \
                          block of a mixture-of-experts model with experts"
                .into(),
        ));
    }
    if r.get("mlp_only_layers").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        return Err(r.bad(
            "mlp_only_layers is not empty: ember builds every block of a mixture-of-experts \
                          model with experts"
                .into(),
        ));
    }
    if r.f64("router_jitter_noise").is_some_and(|j| j != 0.0) {
        return Err(r.bad("router_jitter_noise is not 0: ember's router adds no noise".into()));
    }
    Ok(MoeConfig {
        n_experts,
        top_k: r.usize("num_experts_per_tok")?,
        d_expert: r.usize(width)?,
        norm_topk: r.flag("norm_topk_prob").unwrap_or(norm_topk),
        shared_expert: None,
        shared_expert_gate: false,
        aux_loss_coef: r.f64("router_aux_loss_coef").unwrap_or(0.001),
        z_loss_coef: 0.0,
        ..Default::default()
    })
}

/// Writes the experts' keys, their count under each of `counts` (as transformers 5 writes the
/// family: it reads either).
fn write_experts(c: &ModelConfig, obj: &mut Map<String, Value>, counts: &[&str], width: &str) {
    let Some(moe) = &c.moe else { return };
    for count in counts {
        obj.insert((*count).into(), json!(moe.n_experts));
    }
    obj.insert("num_experts_per_tok".into(), json!(moe.top_k));
    obj.insert(width.into(), json!(moe.d_expert));
    obj.insert("router_aux_loss_coef".into(), json!(moe.aux_loss_coef));
    if width != "intermediate_size" {
        obj.insert("norm_topk_prob".into(), json!(moe.norm_topk));
        obj.insert("decoder_sparse_step".into(), json!(1));
        obj.insert("mlp_only_layers".into(), json!([]));
    }
}

fn read_mixtral(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_mistral(r, c)?;
    if r.flag("norm_topk_prob") == Some(false) {
        return Err(r.bad("norm_topk_prob = false: Mixtral renormalises its top-k weights".into()));
    }
    c.moe = Some(read_experts(r, "intermediate_size", true)?);
    Ok(())
}

fn write_mixtral(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_mistral(c, obj);
    // transformers' Mixtral writes `null` for d_model / n_heads.
    obj.insert("head_dim".into(), json!(c.head_dim));
    write_experts(c, obj, &["num_local_experts"], "intermediate_size");
}

fn read_qwen2_moe(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_qwen2(r, c)?;
    c.qkv_bias = r.flag("qkv_bias").unwrap_or(true);
    let mut moe = read_experts(r, "moe_intermediate_size", false)?;
    // Qwen2-MoE always has the shared expert, behind its sigmoid gate.
    moe.shared_expert = Some(r.usize("shared_expert_intermediate_size")?);
    moe.shared_expert_gate = true;
    c.moe = Some(moe);
    Ok(())
}

fn write_qwen2_moe(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_qwen2(c, obj);
    // transformers' Qwen2-MoE has no head_dim key (it reads one if present), and writes 0 for no window.
    if c.head_dim.is_none() {
        obj.remove("head_dim");
    }
    obj.insert("sliding_window".into(), json!(c.sliding_window.unwrap_or(0)));
    obj.insert("qkv_bias".into(), json!(c.qkv_bias));
    write_experts(c, obj, &["num_experts"], "moe_intermediate_size");
    let shared = c.moe.as_ref().and_then(|m| m.shared_expert);
    obj.insert("shared_expert_intermediate_size".into(), json!(shared));
}

fn read_qwen3_moe(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_qwen3(r, c)?;
    c.moe = Some(read_experts(r, "moe_intermediate_size", false)?);
    Ok(())
}

fn write_qwen3_moe(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_qwen3(c, obj);
    obj.remove("layer_types"); // transformers' Qwen3-MoE has none
    write_experts(c, obj, &["num_local_experts"], "moe_intermediate_size");
}

fn read_olmoe(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, false)?;
    if r.f64("clip_qkv").is_some() {
        return Err(r.bad("clip_qkv is set: ember does not clamp the queries, keys and values".into()));
    }
    c.moe = Some(read_experts(r, "intermediate_size", false)?);
    Ok(())
}

fn write_olmoe(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(false));
    obj.insert("clip_qkv".into(), Value::Null);
    obj.remove("head_dim"); // OLMoE's heads are d_model / n_heads
    write_experts(c, obj, &["num_experts"], "intermediate_size");
    if let Some(moe) = &c.moe {
        obj.insert("norm_topk_prob".into(), json!(moe.norm_topk));
    }
}
