//! GPT-2 (`GPT2LMHeadModel`): LayerNorm with biases, GELU, learned positions, biases everywhere,
//! its own key names (`n_embd`, `n_layer`, …). Hub files name tensors without the `transformer.`
//! prefix that transformers writes; both are read. llama.cpp's `gpt2` transposes the `Conv1D`
//! weights to `[out, in]`.

use ember_model::{MlpKind, ModelConfig, NormKind, Positions};
use serde_json::{json, Map, Value};

use super::Registration;
use crate::config_json::Reader;
use crate::error::HfError;
use crate::family::{as_is, dense, fused, linear, same_name, Family, Parts, Rule, SizeKeys, Stored::Table};
use crate::gguf::hparams::{ArchKeys, GgufRules};
use crate::gguf::GgufError;

/// GPT-2: `Conv1D` weights stored `[in, out]` as ember's (no transpose); `c_attn` is q, k and v
/// side by side (`[D, 3D]`, bias `[3D]`); `c_fc` is the MLP's up projection, `c_proj` its down.
#[rustfmt::skip]
const GPT2_TENSORS: &[Rule] = &[
    as_is("transformer.wte.weight", &["embed_tokens"]).gguf("token_embd.weight").stored(Table),
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
    linear("lm_head.weight", &["lm_head.weight"]).gguf("output.weight").stored(Table),
];

/// GPT-2: `GPT2LMHeadModel`, llama.cpp's `gpt2`.
pub const GPT2: Registration = Registration {
    hf: Family {
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
        read: read_gpt2,
        write: write_gpt2,
        replaced_keys: &[&["scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"]],
        tensors: &[GPT2_TENSORS],
        // The causal mask GPT-2 checkpoints saved as a buffer (`attn.bias`, `[1, 1, T, T]`).
        buffers: &[".attn.bias", ".attn.masked_bias"],
        optional_prefix: Some("transformer."),
        export_name: same_name,
        exports: dense,
        aux_loss_in_config: true,
    },
    gguf: GgufRules { read: biases_gguf, ..GgufRules::DENSE },
};

fn read_gpt2(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    r.require("scale_attn_weights", true, "ember always scales attention scores by 1/sqrt(head_dim)")?;
    r.require("scale_attn_by_inverse_layer_idx", false, "ember does not scale scores by layer")?;
    r.require("reorder_and_upcast_attn", false, "ember does not run GPT-2's reordered attention")?;
    r.require("add_cross_attention", false, "ember's blocks have no cross-attention")?;
    (c.qkv_bias, c.o_bias, c.mlp_bias, c.norm_bias) = (true, true, true, true);
    Ok(())
}

fn write_gpt2(_: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("scale_attn_weights".into(), json!(true));
    obj.insert("scale_attn_by_inverse_layer_idx".into(), json!(false));
    obj.insert("reorder_and_upcast_attn".into(), json!(false));
}

/// llama.cpp's `gpt2` has every bias.
fn biases_gguf(_: &ArchKeys, c: &mut ModelConfig) -> Result<(), GgufError> {
    (c.qkv_bias, c.o_bias, c.mlp_bias) = (true, true, true);
    Ok(())
}
