//! Gemma 3 (`Gemma3ForCausalLM`, `model_type` `gemma3_text`): RMSNorm gains stored as `w` for
//! `1 + w`, per-head q/k norms, sandwich norms (four a block), GeGLU, the embedding scaled by
//! `sqrt(d_model)`, sliding-window layers with their own RoPE base, soft caps. Llama's attention
//! names with four norms of its own; llama.cpp's `gemma3` has no attention biases.
//!
//! Both RoPE spellings are read: transformers 5's `rope_parameters` per layer type
//! (`full_attention`, `sliding_attention`) and 4.x's `rope_theta`, `rope_scaling` and
//! `rope_local_base_freq`. llama.cpp's `gemma3` fixes what config.json spells out: every 6th layer
//! global and the others within `attention.sliding_window`, RoPE base 10 000 on the local layers,
//! and attention scores scaled by `1/sqrt(head_dim)` (`1/sqrt(d_model / heads)` for the 62-layer
//! 27B). Import reads a file that way; export refuses a model that differs.

use ember_model::{MlpKind, ModelConfig, NormKind};
use serde_json::{json, Map, Value};

use super::llama::{
    ATTN_OUTPUT, BIASES, EMBEDDING, HEAD, KEY_VALUE, LLAMA_KEYS, LLAMA_MLP, LLAMA_PARTS, QK_NORMS, QUERY,
};
use super::Registration;
use crate::config_json::{read_rope, rope_parameters, Reader};
use crate::error::HfError;
use crate::family::{dense, gain, join, same_name, without_gguf, Family, Parts, Rule, SizeKeys};
use crate::gguf::hparams::{ArchKeys, ArchWriter, GgufRules};
use crate::gguf::tokenizer::{MergeOrder, VocabRules};
use crate::gguf::GgufError;

/// Gemma 3's own norms. Its `post_attention_layernorm` is the attention's output norm and
/// `pre_feedforward_layernorm` the MLP's input norm (Llama's `post_attention_layernorm`).
#[rustfmt::skip]
const GEMMA3_NORMS: &[Rule] = &[
    gain("model.layers.{i}.post_attention_layernorm.weight", &["layers.{i}.attn_output_norm.weight"])
        .gguf("blk.{i}.post_attention_norm.weight"),
    gain("model.layers.{i}.pre_feedforward_layernorm.weight", &["layers.{i}.post_attention_layernorm.weight"])
        .gguf("blk.{i}.ffn_norm.weight"),
    gain("model.layers.{i}.post_feedforward_layernorm.weight", &["layers.{i}.mlp_output_norm.weight"])
        .gguf("blk.{i}.post_ffw_norm.weight"),
];

/// Gemma 3: Llama's attention (its biases without GGUF names) and four norms a block; its MLP is
/// Llama's.
pub(crate) const GEMMA3_TENSORS: &[Rule] =
    &join::<17>(&[EMBEDDING, QUERY, KEY_VALUE, ATTN_OUTPUT, &without_gguf(BIASES), QK_NORMS, GEMMA3_NORMS, HEAD]);

/// Gemma 3: `Gemma3ForCausalLM`, llama.cpp's `gemma3`.
pub const GEMMA3: Registration = Registration {
    hf: Family {
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
        read: read_gemma3,
        write: write_gemma3,
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
        export_name: same_name,
        exports: dense,
        aux_loss_in_config: true,
    },
    gguf: GgufRules { read: read_gguf, write: write_gguf, vocab: GEMMA_VOCAB, ..GgufRules::DENSE },
};

/// Gemma's SentencePiece vocabulary, in Gemma 1's and 2's files too: merges ranked by the merged
/// piece's position (its scores do not follow the merge order) and runs of spaces spelled with
/// `▁`, as transformers' GGUF reader builds Gemma's; Google's chat template for Gemma 3 files that
/// carry none.
const GEMMA_VOCAB: VocabRules = VocabRules {
    merges: MergeOrder::Position,
    space_runs_as_pieces: true,
    also_in: &["gemma", "gemma2"],
    chat_template: Some(GEMMA3_CHAT_TEMPLATE),
};

/// Gemma 3's chat template: Google's published template for its instruction-tuned models
/// (`chat_template` of google/gemma-3-*-it's tokenizer_config.json), for the Gemma 3 files that carry
/// none (GGUFs made from the pre-trained checkpoints). Turns are `<start_of_turn>{user|model}\n ...
/// <end_of_turn>\n`, a system message goes before the first user turn's text, and the generation
/// prompt opens a `model` turn. The model ends its answer with `<end_of_turn>`, one of the end
/// tokens of ember-data's `Tokenizer::end_ids`.
pub const GEMMA3_CHAT_TEMPLATE: &str = include_str!("gemma3_chat_template.jinja");

/// Gemma 3's defaults where its config.json is silent (transformers' `Gemma3TextConfig`).
const GEMMA3_HEAD_DIM: usize = 256;
const GEMMA3_THETA: (f64, f64) = (1e6, 1e4);
/// Every 6th layer global, the others local: transformers' default where config.json is silent,
/// and what llama.cpp's `gemma3` fixes whatever the file says (`hparams.set_swa_pattern(6)`).
const GEMMA3_PATTERN: usize = 6;
/// llama.cpp's RoPE base on the local layers.
const GGUF_LOCAL_THETA: f64 = 10_000.0;
/// The layer count of Gemma 3 27B, whose scores llama.cpp scales by `1/sqrt(d_model / heads)`.
const GEMMA3_27B_LAYERS: usize = 62;

fn read_gemma3(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    if r.opt_usize("head_dim").is_none() {
        c.head_dim = Some(GEMMA3_HEAD_DIM).filter(|&h| h.checked_mul(c.n_heads) != Some(c.d_model));
    }
    r.require("use_bidirectional_attention", false, "ember's attention is causal")?;
    let bias = r.flag("attention_bias").unwrap_or(false);
    (c.qkv_bias, c.o_bias) = (bias, bias);
    c.attn_logit_softcap = r.f64("attn_logit_softcapping");
    c.final_logit_softcap = r.f64("final_logit_softcapping");
    let scalar = r.f64("query_pre_attn_scalar").unwrap_or(GEMMA3_HEAD_DIM as f64);
    c.query_pre_attn_scalar = Some(scalar).filter(|&s| s != c.head_dim() as f64);

    let local = local_layers(r, c.n_layers)?;
    c.sliding_window = r.opt_usize("sliding_window").filter(|_| local.contains(&true));
    // With some layers full: every p-th one, p the first full layer's position.
    if let Some(first_full) = local.iter().position(|&l| !l).filter(|_| c.sliding_window.is_some()) {
        let p = first_full + 1;
        if local.iter().enumerate().any(|(l, &is_local)| is_local != ((l + 1) % p != 0)) {
            let types: Vec<&str> = local.iter().map(|&l| if l { "sliding" } else { "full" }).collect();
            return Err(r.bad(format!(
                "layer_types [{}]: ember runs a sliding-window pattern of every p-th layer full, and this is not one",
                types.join(", ")
            )));
        }
        c.sliding_window_pattern = Some(p);
    }
    read_gemma3_rope(r, c)
}

/// Which layers attend within the window: `layer_types` (transformers 5), else every
/// `sliding_window_pattern`-th layer full (4.x).
fn local_layers(r: &Reader, n_layers: usize) -> Result<Vec<bool>, HfError> {
    if let Some(types) = r.get("layer_types") {
        let list = types.as_array().filter(|l| l.len() == n_layers);
        let list =
            list.ok_or_else(|| r.bad(format!("layer_types {types}: expected a list of {n_layers} layer types")))?;
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(r.bad(format!("layer_types: `{t}` is neither sliding_attention nor full_attention"))),
            })
            .collect();
    }
    let key = ["sliding_window_pattern", "_sliding_window_pattern"].into_iter().find_map(|k| Some((k, r.get(k)?)));
    let p = match key {
        Some((key, v)) => {
            v.as_u64().filter(|&p| p > 0).ok_or_else(|| r.bad(format!("{key} = {v}: expected a positive integer")))?
                as usize
        }
        None => GEMMA3_PATTERN,
    };
    Ok((0..n_layers).map(|l| (l + 1) % p != 0).collect())
}

/// RoPE: per layer type (transformers 5), or `rope_theta`, `rope_scaling` and
/// `rope_local_base_freq` (4.x).
fn read_gemma3_rope(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    let params = r.get("rope_parameters").and_then(Value::as_object);
    let per_type = params.filter(|p| p.contains_key("full_attention") || p.contains_key("sliding_attention"));
    let (full, sliding) = match per_type {
        Some(p) => {
            (p.get("full_attention").and_then(Value::as_object), p.get("sliding_attention").and_then(Value::as_object))
        }
        None => (params, None),
    };
    (c.rope_theta, c.rope_scaling) = read_rope(r, full, GEMMA3_THETA.0)?;
    let local_theta = match sliding {
        Some(s) => {
            if let Some(kind) = s.get("rope_type").and_then(Value::as_str).filter(|&k| k != "default") {
                return Err(r.bad(format!(
                    "rope_parameters.sliding_attention.rope_type `{kind}`: ember's sliding-window layers take no RoPE scaling"
                )));
            }
            s.get("rope_theta").and_then(Value::as_f64).unwrap_or(GEMMA3_THETA.1)
        }
        None => r.f64("rope_local_base_freq").unwrap_or(GEMMA3_THETA.1),
    };
    let any_local = (0..c.n_layers).any(|l| c.is_local(l));
    c.rope_local_theta = Some(local_theta).filter(|&t| any_local && t != c.rope_theta);
    Ok(())
}

fn write_gemma3(c: &ModelConfig, obj: &mut Map<String, Value>) {
    let types: Vec<&str> =
        (0..c.n_layers).map(|l| if c.is_local(l) { "sliding_attention" } else { "full_attention" }).collect();
    let local_theta = c.rope_local_theta.unwrap_or(c.rope_theta);
    let scalar = c.query_pre_attn_scalar.unwrap_or(c.head_dim() as f64);
    let entries = [
        ("layer_types", json!(types)),
        ("sliding_window", json!(c.sliding_window)),
        (
            "rope_parameters",
            json!({
                "full_attention": rope_parameters(c.rope_theta, c.rope_scaling.as_ref()),
                "sliding_attention": rope_parameters(local_theta, None),
            }),
        ),
        // An integer where it is one: transformers types the field `int`.
        ("query_pre_attn_scalar", if scalar.fract() == 0.0 { json!(scalar as u64) } else { json!(scalar) }),
        ("attention_bias", json!(c.qkv_bias)),
        ("attn_logit_softcapping", json!(c.attn_logit_softcap)),
        ("final_logit_softcapping", json!(c.final_logit_softcap)),
    ];
    obj.extend(entries.into_iter().map(|(k, v)| (k.to_string(), v)));
    if let Some(p) = c.sliding_window_pattern.filter(|_| c.sliding_window.is_some()) {
        obj.insert("sliding_window_pattern".into(), json!(p));
    }
}

/// llama.cpp's `gemma3` keys: `attention.sliding_window` (every 6th layer global, RoPE base 10 000
/// on the others) and `final_logit_softcapping`.
fn read_gguf(k: &ArchKeys, c: &mut ModelConfig) -> Result<(), GgufError> {
    let window = k.opt_u64("attention.sliding_window")?.filter(|&w| w > 0);
    c.sliding_window = window.map(|w| w as usize);
    c.sliding_window_pattern = window.map(|_| GEMMA3_PATTERN);
    // The pattern repeats: its first period says (and a huge block_count costs nothing here).
    let any_local = (0..c.n_layers.min(GEMMA3_PATTERN)).any(|l| c.is_local(l));
    c.rope_local_theta = Some(GGUF_LOCAL_THETA).filter(|&t| any_local && t != c.rope_theta);
    if c.n_layers == GEMMA3_27B_LAYERS {
        c.query_pre_attn_scalar = Some((c.d_model / c.n_heads) as f64).filter(|&s| s != c.head_dim() as f64);
    }
    c.final_logit_softcap = k.float("final_logit_softcapping")?.filter(|&s| s > 0.0);
    Ok(())
}

fn write_gguf(config: &ModelConfig, w: &mut ArchWriter) {
    if let Some(window) = config.sliding_window.filter(|_| (0..config.n_layers).any(|l| config.is_local(l))) {
        w.u("attention.sliding_window", window);
    }
    if let Some(cap) = config.final_logit_softcap {
        w.f("final_logit_softcapping", cap);
    }
}
