//! A GGUF model as a Hugging Face one: the architecture's metadata read as an ember
//! [`ModelConfig`] (and written out as a `config.json`), the tensors under their Hugging Face names
//! in Hugging Face's layout, dequantized to f32 — and back.
//!
//! Tensor names come from the family table ([`crate::family`]): each rule names the tensor in
//! Hugging Face, ember and llama.cpp's GGUF (`token_embd`, `blk.{i}.attn_q`, `blk.{i}.ffn_norm`, …),
//! so that one table says for each family where every tensor goes. What differs between llama.cpp's
//! architectures beyond names lives here:
//!
//! | GGUF     | family          | RoPE pairs            | metadata beyond the sizes                        |
//! |----------|-----------------|-----------------------|--------------------------------------------------|
//! | `llama`  | Llama, Mistral  | adjacent (rows permuted) | `rope.freq_base`, linear `rope.scaling`       |
//! | `qwen2`  | Qwen2           | halves (NEOX)         | as `llama`; q/k/v biases                          |
//! | `qwen3`  | Qwen3           | halves (NEOX)         | as `llama`; q/k norms, no biases                  |
//! | `gemma3` | Gemma 3         | halves (NEOX)         | `attention.sliding_window`, `final_logit_softcapping` |
//! | `gpt2`   | GPT-2           | none (`position_embd`) | `attention.layer_norm_epsilon`                   |
//! | `llama` with `expert_count` | Mixtral | adjacent (rows permuted) | `expert_count`, `expert_used_count`; `feed_forward_length` the experts' |
//! | `qwen2moe` | Qwen2-MoE     | halves (NEOX)         | as `qwen2`; `expert_feed_forward_length`, `expert_shared_feed_forward_length` |
//! | `qwen3moe` | Qwen3-MoE     | halves (NEOX)         | as `qwen3`; `expert_feed_forward_length`          |
//! | `olmoe`  | OLMoE           | halves (NEOX)         | q/k norms over d_model; `feed_forward_length` the experts' |
//!
//! Experts are one tensor per stacked projection in a GGUF file (`blk.{i}.ffn_gate_exps`, `[E, out,
//! in]`), one per expert in Hugging Face's; the router is `ffn_gate_inp`, Qwen2-MoE's shared expert
//! `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`. llama.cpp renormalises the top-k weights of its
//! `llama` and `qwen3moe`, not those of `qwen2moe` and `olmoe`: a model that differs is refused.
//!
//! llama.cpp's converter reorders the rows of a Llama model's q and k projections so that each
//! head's rotary pairs sit next to each other (its RoPE rotates adjacent pairs); Hugging Face pairs
//! channel `i` with `i + Dh/2`. Import undoes that permutation, export applies it. The other
//! architectures are stored in the Hugging Face layout already, but for GPT-2's `Conv1D` weights,
//! which llama.cpp transposes to `[out, in]`.
//!
//! llama.cpp's `gemma3` fixes what Hugging Face's config spells out: every 6th layer global and the
//! others within `attention.sliding_window`, RoPE base 10 000 on the local layers, and attention
//! scores scaled by `1/sqrt(head_dim)` (`1/sqrt(d_model / heads)` for the 62-layer 27B). Import reads
//! a file that way; export refuses a model that differs ([`expressible`]). Gemma's RMSNorm gains are
//! stored as `1 + w`, the factor itself, as every GGUF gain is. An import keeps them so
//! ([`NormKind::RmsNorm`]) rather than subtract one, so that an export of it writes the file's bits
//! again; a Gemma read from Hugging Face (`w`, [`NormKind::RmsNormPlusOne`]) exports `1 + w` in f32,
//! the value its forward pass multiplies by, and re-imports to the same logits bit for bit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use ember_model::{Decoder, ModelConfig, NormKind, Positions, RopeLayout, RopeScaling};
use serde_json::{json, Value as Json};

use super::{GgmlType, GgufError, GgufFile, Meta, TensorOut, Value};
use crate::family::Architecture;
use crate::HfError;
use ember_kernels::QuantWeight;

/// A GGUF model read as a Hugging Face one.
pub struct GgufModel {
    pub arch: Architecture,
    /// The model's config, Gemma's norms as the file keeps their gains.
    pub config: ModelConfig,
    /// A `config.json` for the model (with the GGUF facts export needs under `"gguf"`).
    pub hf_config: Json,
    /// Hugging Face name -> f32 tensor in Hugging Face's layout.
    pub tensors: BTreeMap<String, TensorData>,
    /// `tokenizer.json` rebuilt from the metadata.
    pub tokenizer_json: String,
    /// `tokenizer_config.json`: chat template, BOS and EOS.
    pub tokenizer_config: Json,
    /// (name, type) of every tensor as stored, for reports.
    pub stored: Vec<(String, &'static str)>,
    /// Hugging Face name -> a projection weight kept in its quantized type ([`read_keeping`]; its
    /// q/k rows restored), absent from `tensors`.
    pub quantized: BTreeMap<String, QuantWeight>,
}

/// Whether llama.cpp permutes the q/k rows of this architecture's files (its `llama`, whose RoPE
/// rotates adjacent pairs).
fn permutes_qk(arch: Architecture) -> bool {
    arch.family().gguf_arch == "llama"
}

/// llama.cpp's gemma3: every 6th layer global (`hparams.set_swa_pattern(6)`), RoPE base 10 000 on
/// the others, whatever the file says.
const GEMMA3_PATTERN: usize = 6;
const GEMMA3_LOCAL_THETA: f64 = 10_000.0;
/// The layer count of Gemma 3 27B, whose scores llama.cpp scales by `1/sqrt(d_model / heads)`.
const GEMMA3_27B_LAYERS: usize = 62;

/// Query and key/value heads: what the q/k row permutation needs.
#[derive(Debug, Clone, Copy)]
struct Heads {
    q: u64,
    kv: u64,
}

impl Heads {
    /// The heads whose rows llama.cpp reorders in tensor `hf_name` of `shape`: those of a q or k
    /// projection matrix of an architecture it permutes; `None` for every other tensor.
    fn permuted(self, arch: Architecture, hf_name: &str, shape: &[usize]) -> Option<usize> {
        let is_q = hf_name.ends_with("q_proj.weight");
        let is_qk = is_q || hf_name.ends_with("k_proj.weight");
        (permutes_qk(arch) && shape.len() == 2 && is_qk).then_some(if is_q { self.q } else { self.kv } as usize)
    }
}

/// Reorders the rows of a `[heads·Dh, in]` q or k projection between llama.cpp's adjacent rotary
/// pairs (row `h·Dh + 2i + c`) and Hugging Face's split halves (row `h·Dh + c·Dh/2 + i`).
/// `to_hf`: GGUF -> Hugging Face; otherwise the reverse.
fn permute_rows(values: &[f32], heads: usize, cols: usize, to_hf: bool) -> Vec<f32> {
    let rows = values.len() / cols;
    let (dh, half) = (rows / heads, rows / heads / 2);
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for c in 0..2 {
                let gguf_row = h * dh + 2 * i + c;
                let hf_row = h * dh + c * half + i;
                let (from, to) = if to_hf { (gguf_row, hf_row) } else { (hf_row, gguf_row) };
                out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// Reads a GGUF model: config, tensors (dequantized, q/k rows restored), tokenizer.
pub fn read(path: &Path) -> Result<GgufModel, GgufError> {
    read_file(GgufFile::open(path)?)
}

/// [`read`], the blocks' projection weights (q, k, v, o, gate, up, down) stored in a block type
/// kept in it ([`GgufModel::quantized`]) rather than dequantized: for LoRA on a quantized base.
pub fn read_keeping(path: &Path) -> Result<GgufModel, GgufError> {
    read_file_as(GgufFile::open(path)?, true)
}

/// [`read`] of a file already opened (or parsed from bytes).
pub fn read_file(f: GgufFile) -> Result<GgufModel, GgufError> {
    read_file_as(f, false)
}

/// The config a GGUF file describes, its architecture and a Hugging Face config.json for it,
/// without reading its tensors.
pub fn read_config(f: &GgufFile) -> Result<(ModelConfig, Architecture, Json), GgufError> {
    let arch = read_arch(f)?;
    let tokens = f.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[Value]>::len);
    let config = model_config(&f.metadata, &f.path, arch, f.tensor("output.weight").is_none(), tokens)?;
    let hf_config = hf_config(f, &config, arch);
    Ok((config, arch, hf_config))
}

/// (weights, bytes) of the projections [`read_keeping`] keeps in their stored types, without
/// reading them: what a LoRA run on the file holds of them.
pub fn kept_sizes(f: &GgufFile) -> Result<(u64, u64), GgufError> {
    let family = read_arch(f)?.family();
    let kept = f.tensors.iter().filter(|t| {
        let mapped = family.gguf_to_hf(&t.name);
        t.shape().len() == 2 && mapped.is_some_and(|(hf, transposed)| keeps(family, &hf, t.kind, transposed))
    });
    Ok(kept.fold((0, 0), |(n, b), t| (n + t.num_values(), b + t.len as u64)))
}

fn read_file_as(f: GgufFile, keep_quantized: bool) -> Result<GgufModel, GgufError> {
    read_arch(&f)?;
    if f.tensor("rope_freqs.weight").is_some() {
        return Err(f.meta_err("rope_freqs.weight", "Llama 3.1 RoPE frequency factors are not supported yet"));
    }
    let (config, arch, hf_config) = read_config(&f)?;
    let (tensors, stored, quantized) = read_tensors(&f, arch, &config, keep_quantized)?;
    let (tokenizer_json, tokenizer_config) = super::tokenizer::from_gguf(&f)?;
    Ok(GgufModel { arch, config, hf_config, tensors, tokenizer_json, tokenizer_config, stored, quantized })
}

/// The architecture `general.architecture` names.
fn read_arch(f: &GgufFile) -> Result<Architecture, GgufError> {
    let key = "general.architecture";
    let name = f.meta().str(key)?.ok_or_else(|| f.meta_err(key, "missing"))?;
    let supported = "llama, qwen2, qwen3, gemma3, gpt2, qwen2moe, qwen3moe, olmoe and deepseek2 are";
    let arch = Architecture::from_gguf(name)
        .ok_or_else(|| f.meta_err(key, format!("`{name}` is not supported ({supported})")))?;
    // llama.cpp's deepseek2 is DeepSeek-V3 where its routers have the selection bias.
    if arch == Architecture::DeepseekV2 && f.tensors.iter().any(|t| t.name.ends_with(".exp_probs_b.bias")) {
        return Ok(Architecture::DeepseekV3);
    }
    // llama.cpp's `llama` with experts is Mixtral.
    let experts = f.meta().u64("llama.expert_count")?.is_some_and(|n| n > 0);
    Ok(if arch == Architecture::Llama && experts { Architecture::Mixtral } else { arch })
}

/// The model a GGUF file's `{arch}.*` metadata describes, as llama.cpp runs it: its sizes, with
/// defaults for the keys a file may leave out (KV heads = heads, `head_dim` = d_model / heads, RoPE
/// base 10 000, norm epsilon 1e-5), the parts of its family, and the rules llama.cpp fixes for the
/// architecture. `tied`: the file has no `output.weight`; `tokens`: the tokenizer's size, for a file
/// without `vocab_size`.
fn model_config(
    meta: &BTreeMap<String, Value>,
    path: &Path,
    arch: Architecture,
    tied: bool,
    tokens: Option<usize>,
) -> Result<ModelConfig, GgufError> {
    let family = arch.family();
    let a = family.gguf_arch;
    let key = |k: &str| format!("{a}.{k}");
    let err = |k: &str, message: String| GgufError::Metadata { path: path.into(), key: k.into(), message };
    let meta = Meta { path, map: meta };
    let opt_u64 = |k: &str| meta.u64(&key(k));
    let u64_of = |k: &str| opt_u64(k)?.ok_or_else(|| err(&key(k), "missing".into()));
    let f64_of = |k: &str| meta.float(&key(k));
    let usize_of = |k: &str| -> Result<usize, GgufError> { Ok(u64_of(k)? as usize) };

    let n_layers = usize_of("block_count")?;
    let d_model = usize_of("embedding_length")?;
    let n_heads = usize_of("attention.head_count")?;
    let n_kv_heads = opt_u64("attention.head_count_kv")?.map_or(n_heads, |v| v as usize);
    if n_heads == 0 || n_kv_heads == 0 {
        return Err(err(&key("attention.head_count"), "zero heads".into()));
    }
    let vocab_size = match opt_u64("vocab_size")? {
        Some(v) => v as usize,
        None => tokens.ok_or_else(|| err("tokenizer.ggml.tokens", "missing (and no vocab_size)".into()))?,
    };
    if a == "deepseek2" {
        let sizes = ModelConfig { n_layers, d_model, n_heads, ..ModelConfig::tiny(vocab_size, 1) };
        return deepseek2_config(&meta, path, arch, sizes, tied);
    }
    let head_dim = opt_u64("attention.key_length")?.map_or(d_model / n_heads, |v| v as usize);
    // RoPE over part of each head (llama.cpp's n_rot below key_length) is not a model ember runs.
    if let Some(n_rot) = opt_u64("rope.dimension_count")?.filter(|_| family.parts.positions != Positions::Learned) {
        if n_rot != head_dim as u64 {
            let message = format!("{n_rot}: RoPE over part of a head of {head_dim} is not supported");
            return Err(err(&key("rope.dimension_count"), message));
        }
    }
    let parts = family.parts;
    let layer_norm = parts.norm == NormKind::LayerNorm;
    let eps_key = if layer_norm { "attention.layer_norm_epsilon" } else { "attention.layer_norm_rms_epsilon" };
    let rope_scaling = match (meta.str(&key("rope.scaling.type"))?, f64_of("rope.scaling.factor")?) {
        (Some("linear"), Some(factor)) => Some(RopeScaling::Linear { factor }),
        _ => None,
    };
    let (qkv_bias, o_bias, mlp_bias) = match arch {
        Architecture::Qwen2 | Architecture::Qwen2Moe => (true, false, false),
        Architecture::Gpt2 => (true, true, true),
        _ => (false, false, false),
    };
    let mut c = ModelConfig {
        vocab_size,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads: Some(n_kv_heads),
        head_dim: Some(head_dim).filter(|&h| h.checked_mul(n_heads) != Some(d_model)),
        d_ff: usize_of("feed_forward_length")?,
        max_seq_len: usize_of("context_length")?,
        rope_theta: f64_of("rope.freq_base")?.unwrap_or(10_000.0),
        rope_layout: RopeLayout::HalfSplit,
        rope_scaling,
        sliding_window: None,
        norm_eps: f64_of(eps_key)?.unwrap_or(1e-5),
        qkv_bias,
        o_bias,
        mlp_bias,
        // GGUF stores every RMSNorm gain as the factor itself (Gemma's `1 + w` included).
        norm: if parts.norm == NormKind::RmsNormPlusOne { NormKind::RmsNorm } else { parts.norm },
        norm_bias: layer_norm,
        mlp: family.activations[0].1,
        moe: None,
        mla: None,
        positions: parts.positions,
        qk_norm: parts.qk_norm,
        qk_norm_whole: parts.qk_norm_whole,
        sandwich_norms: parts.sandwich_norms,
        parallel_block: false,
        embed_scale: parts.embed_scale,
        sliding_window_pattern: None,
        rope_local_theta: None,
        query_pre_attn_scalar: None,
        attn_logit_softcap: None,
        final_logit_softcap: None,
        zero_init_out: false,
        tie_embeddings: tied,
        init_std: 0.02,
        dropout: 0.0,
    };
    if let Some(n_experts) = opt_u64("expert_count")?.filter(|&n| n > 0) {
        // llama.cpp renormalises the top-k weights of its `llama` (Mixtral) and `qwen3moe`, not
        // those of `qwen2moe` and `olmoe`; Qwen2-MoE's shared expert is always gated.
        let qwen2 = arch == Architecture::Qwen2Moe;
        c.moe = Some(ember_model::MoeConfig {
            n_experts: n_experts as usize,
            top_k: usize_of("expert_used_count")?,
            d_expert: opt_u64("expert_feed_forward_length")?.map_or(c.d_ff, |v| v as usize),
            norm_topk: matches!(arch, Architecture::Mixtral | Architecture::Qwen3Moe),
            shared_expert: if qwen2 { Some(usize_of("expert_shared_feed_forward_length")?) } else { None },
            shared_expert_gate: qwen2,
            aux_loss_coef: 0.001,
            z_loss_coef: 0.0,
            ..Default::default()
        });
    } else if matches!(
        arch,
        Architecture::Mixtral | Architecture::Qwen2Moe | Architecture::Qwen3Moe | Architecture::Olmoe
    ) {
        return Err(err(&key("expert_count"), "missing: the architecture has experts".into()));
    }
    if arch == Architecture::Gemma3 {
        let window = opt_u64("attention.sliding_window")?.filter(|&w| w > 0);
        c.sliding_window = window.map(|w| w as usize);
        c.sliding_window_pattern = window.map(|_| GEMMA3_PATTERN);
        // The pattern repeats: its first period says (and a huge block_count costs nothing here).
        let any_local = (0..n_layers.min(GEMMA3_PATTERN)).any(|l| c.is_local(l));
        c.rope_local_theta = Some(GEMMA3_LOCAL_THETA).filter(|&t| any_local && t != c.rope_theta);
        if n_layers == GEMMA3_27B_LAYERS {
            c.query_pre_attn_scalar = Some((d_model / n_heads) as f64).filter(|&s| s != head_dim as f64);
        }
        c.final_logit_softcap = f64_of("final_logit_softcapping")?.filter(|&s| s > 0.0);
    }
    c.validate().map_err(|e| err(&key("block_count"), format!("the model the metadata describes: {e}")))?;
    Ok(c)
}

/// llama.cpp's layer counts of DeepSeek-V2-Lite-shaped models, whose `q_lora_rank` it never reads
/// (their queries are never low-rank).
fn deepseek2_lite(n_layers: usize, vocab: usize) -> bool {
    matches!(n_layers, 26 | 27) || (n_layers == 48 && vocab == 128_256)
}

/// The model llama.cpp's `deepseek2` metadata describes (`sizes` holds the vocabulary, the layers,
/// the width and the heads): latent attention (`key_length_mla` / `value_length_mla`, or the older
/// files' `key_length` / `value_length`), its latents normed with the model's epsilon, RoPE on
/// interleaved pairs (YaRN with `yarn_log_multiplier` = 0.1 · mscale_all_dim, and llama.cpp's
/// mscale equal to it), experts after `leading_dense_block_count` dense layers, scored by
/// `expert_gating_func` (1 softmax, 2 sigmoid), grouped, scaled and renormalised as the keys say.
fn deepseek2_config(
    meta: &Meta<'_>,
    path: &Path,
    arch: Architecture,
    sizes: ModelConfig,
    tied: bool,
) -> Result<ModelConfig, GgufError> {
    let key = |k: &str| format!("deepseek2.{k}");
    let err = |k: &str, message: String| GgufError::Metadata { path: path.into(), key: key(k), message };
    let opt = |k: &str| meta.u64(&key(k));
    let req = |k: &str| -> Result<usize, GgufError> { Ok(opt(k)?.ok_or_else(|| err(k, "missing".into()))? as usize) };
    let rope_dim = req("rope.dimension_count")?;
    let kv_rank = req("attention.kv_lora_rank")?;
    let (qk, v) = match (opt("attention.key_length_mla")?, opt("attention.value_length_mla")?) {
        (Some(k), Some(v)) if k > 0 && v > 0 => (k as usize, v as usize),
        _ => (req("attention.key_length")?, req("attention.value_length")?),
    };
    let nope_dim = qk.checked_sub(rope_dim).filter(|&n| n > 0).ok_or_else(|| {
        err("rope.dimension_count", format!("{rope_dim}: no room in heads of {qk} for a part without position"))
    })?;
    let q_rank = match deepseek2_lite(sizes.n_layers, sizes.vocab_size) {
        true => None,
        false => Some(req("attention.q_lora_rank")?).filter(|&q| q > 0),
    };
    let eps = meta.float(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6);
    let rope_scaling = match meta.str(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("yarn") => {
            let factor =
                meta.float(&key("rope.scaling.factor"))?.ok_or_else(|| err("rope.scaling.factor", "missing".into()))?;
            let all = meta.float(&key("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0) / 0.1;
            let all = (all != 0.0).then_some((all * 1e6).round() / 1e6);
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: req("rope.scaling.original_context_length")?,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: all,
                mscale_all_dim: all,
                // llama.cpp's deepseek2 leaves cos and sin unscaled (its mscale over mscale_all_dim,
                // 1; without the log multiplier it divides YaRN's default factor back out).
                attention_factor: all.is_none().then_some(1.0),
                truncate: true,
            })
        }
        Some("linear") => Some(RopeScaling::Linear {
            factor: meta
                .float(&key("rope.scaling.factor"))?
                .ok_or_else(|| err("rope.scaling.factor", "missing".into()))?,
        }),
        Some(other) => return Err(err("rope.scaling.type", format!("`{other}` is not supported (yarn, linear are)"))),
    };
    let moe = match opt("expert_count")?.filter(|&n| n > 0) {
        None => None,
        Some(n_experts) => {
            let scoring = match opt("expert_gating_func")?.unwrap_or(1) {
                1 => ember_model::Scoring::Softmax,
                2 => ember_model::Scoring::Sigmoid,
                other => {
                    return Err(err(
                        "expert_gating_func",
                        format!("{other}: ember scores experts by softmax (1) or sigmoid (2)"),
                    ))
                }
            };
            let groups = opt("expert_group_count")?.filter(|&g| g > 1).map(|g| g as usize);
            let top_groups = match groups {
                Some(_) => Some(req("expert_group_used_count")?),
                None => None,
            };
            if groups.is_some() && scoring == ember_model::Scoring::Softmax {
                return Err(err(
                    "expert_group_count",
                    "groups of a softmax router: llama.cpp scores them by their best two experts, DeepSeek-V2 by its best one".into(),
                ));
            }
            let d_expert = req("expert_feed_forward_length")?;
            let shared = opt("expert_shared_count")?.unwrap_or(0) as usize;
            let scale = meta.float(&key("expert_weights_scale"))?.unwrap_or(0.0);
            Some(ember_model::MoeConfig {
                n_experts: n_experts as usize,
                top_k: req("expert_used_count")?,
                d_expert,
                norm_topk: meta.bool(&key("expert_weights_norm"))?.unwrap_or(false),
                shared_expert: match shared {
                    0 => None,
                    n => Some(
                        n.checked_mul(d_expert).ok_or_else(|| err("expert_shared_count", format!("{n}: too many")))?,
                    ),
                },
                shared_expert_gate: false,
                aux_loss_coef: 0.0,
                z_loss_coef: 0.0,
                scoring,
                selection_bias: arch == Architecture::DeepseekV3,
                groups,
                top_groups,
                routed_scale: if scale == 0.0 { 1.0 } else { scale },
                dense_layers: opt("leading_dense_block_count")?.unwrap_or(0) as usize,
                bias_update_rate: 0.0,
            })
        }
    };
    let c = ModelConfig {
        n_kv_heads: None,
        head_dim: None,
        d_ff: req("feed_forward_length")?,
        max_seq_len: req("context_length")?,
        rope_theta: meta.float(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_layout: RopeLayout::Interleaved,
        rope_scaling,
        norm_eps: eps,
        moe,
        mla: Some(ember_model::MlaConfig { q_rank, kv_rank, nope_dim, rope_dim, v_dim: v, norm_eps: eps }),
        tie_embeddings: tied,
        ..sizes
    };
    c.validate().map_err(|e| err("block_count", format!("the model the metadata describes: {e}")))?;
    Ok(c)
}

/// llama.cpp's `attn_k_b` (`[H, r, nope]`: each head's key up-projection, transposed) and
/// `attn_v_b` (`[H, v, r]`) of one layer as Hugging Face's `kv_b_proj`, `[H·(nope + v), r]`.
fn join_kv_b(k_b: &[f32], v_b: &[f32], heads: usize, rank: usize) -> Result<(Vec<f32>, Vec<usize>), String> {
    let (nope, v) = (k_b.len() / (heads * rank).max(1), v_b.len() / (heads * rank).max(1));
    if nope * heads * rank != k_b.len() || v * heads * rank != v_b.len() || nope == 0 || v == 0 {
        return Err(format!(
            "attn_k_b / attn_v_b of {} / {} values for {heads} heads of a {rank}-wide latent",
            k_b.len(),
            v_b.len()
        ));
    }
    let mut out = Vec::with_capacity(k_b.len() + v_b.len());
    for h in 0..heads {
        for i in 0..nope {
            out.extend((0..rank).map(|c| k_b[(h * rank + c) * nope + i]));
        }
        out.extend_from_slice(&v_b[h * v * rank..(h + 1) * v * rank]);
    }
    Ok((out, vec![heads * (nope + v), rank]))
}

/// The reverse of [`join_kv_b`]: `(attn_k_b [H, r, nope], attn_v_b [H, v, r])`.
fn split_kv_b(kv_b: &[f32], heads: usize, nope: usize, rank: usize) -> (Vec<f32>, Vec<f32>) {
    let per = kv_b.len() / heads.max(1) / rank.max(1); // nope + v
    let (mut k_b, mut v_b) = (Vec::with_capacity(heads * nope * rank), Vec::new());
    for h in 0..heads {
        let head = &kv_b[h * per * rank..(h + 1) * per * rank];
        for c in 0..rank {
            k_b.extend((0..nope).map(|i| head[i * rank + c]));
        }
        v_b.extend_from_slice(&head[nope * rank..]);
    }
    (k_b, v_b)
}

/// A `config.json` for the model (transformers' layout of its family), with the token ids and what
/// an export needs to write the file back under `"gguf"`.
fn hf_config(f: &GgufFile, config: &ModelConfig, arch: Architecture) -> Json {
    let parts = arch.family().parts;
    let as_family = ModelConfig { norm: parts.norm, ..config.clone() };
    let mut hf_config = crate::from_model_config(&as_family, arch, None);
    hf_config["gguf"] = json!({
        "name": f.get("general.name").and_then(Value::as_str).unwrap_or_default(),
        "tokenizer.ggml.pre": f.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or_default(),
    });
    hf_config["gguf"]["carry"] = Json::Object(carried_metadata(f));
    let id = |k: &str| f.get(k).and_then(Value::as_u64);
    if let Some(bos) = id("tokenizer.ggml.bos_token_id") {
        hf_config["bos_token_id"] = json!(bos);
    }
    if let Some(eos) = id("tokenizer.ggml.eos_token_id") {
        hf_config["eos_token_id"] = json!(eos);
    }
    hf_config
}

/// Descriptive metadata (licence, organization, names, languages) and tokenizer facts the
/// rebuilt tokenizer.json does not carry, kept for an export to write back.
fn carried_metadata(f: &GgufFile) -> serde_json::Map<String, Json> {
    let is_carried = |key: &str| {
        (key.starts_with("general.")
            && !matches!(
                key,
                "general.architecture" | "general.alignment" | "general.file_type" | "general.quantization_version"
            ))
            || matches!(key, "tokenizer.ggml.unknown_token_id" | "tokenizer.ggml.add_space_prefix")
    };
    f.metadata
        .iter()
        .filter(|(key, _)| is_carried(key))
        .filter_map(|(key, value)| Some((key.clone(), carried_to_json(value)?)))
        .collect()
}

/// A carried metadata value as JSON: strings, booleans, unsigned integers and arrays of strings;
/// `None` for any other value, which is not carried.
fn carried_to_json(value: &Value) -> Option<Json> {
    match value {
        Value::String(s) => Some(json!(s)),
        Value::Bool(b) => Some(json!(b)),
        Value::Array(items) if items.iter().all(|v| v.as_str().is_some()) => {
            Some(json!(items.iter().filter_map(Value::as_str).collect::<Vec<_>>()))
        }
        v => v.as_u64().map(|n| json!(n)),
    }
}

/// Hugging Face name -> f32 tensor, (name, type) of every tensor as stored, and the weights kept
/// quantized.
type ReadTensors = (BTreeMap<String, TensorData>, Vec<(String, &'static str)>, BTreeMap<String, QuantWeight>);

/// The Hugging Face names of the projections a quantized base keeps in their stored type.
const KEPT_PROJECTIONS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// Whether tensor `hf` (stored `[out, in]`, Hugging Face's orientation) of type `kind` is a block
/// projection weight that a quantized base keeps as stored.
fn keeps(family: &crate::Family, hf: &str, kind: GgmlType, transposed: bool) -> bool {
    // A shared expert's projections are the experts part's, not a block's: dequantized.
    let shared = hf.contains(".shared_expert.") || hf.contains(".shared_experts.");
    let projection = KEPT_PROJECTIONS.iter().any(|p| hf.ends_with(&format!("{p}.weight"))) && !shared;
    let single =
        family.hf_to_ember(hf).is_some_and(|t| t.paths.len() == 1 && t.layout == crate::family::Layout::Transposed);
    projection && single && !transposed && super::quant::block_decoder(kind).is_some()
}

/// Every tensor under its Hugging Face name, dequantized to f32, in Hugging Face's layout (q/k rows
/// in its order, GPT-2's `Conv1D` weights `[in, out]`); with `keep_quantized`, the projections
/// [`keeps`] takes as stored (rows reordered as the f32 ones are).
fn read_tensors(
    f: &GgufFile,
    arch: Architecture,
    config: &ModelConfig,
    keep_quantized: bool,
) -> Result<ReadTensors, GgufError> {
    let family = arch.family();
    let heads = Heads { q: config.n_heads as u64, kv: config.n_kv_heads() as u64 };
    let mut tensors = BTreeMap::new();
    let mut stored = Vec::new();
    let mut quantized = BTreeMap::new();
    // DeepSeek's per-head key and value up-projections, joined into `kv_b_proj` once both are read.
    let mut kv_b: BTreeMap<usize, [Option<Vec<f32>>; 2]> = BTreeMap::new();
    for t in &f.tensors {
        let split = ["attn_k_b", "attn_v_b"].iter().position(|p| t.name.ends_with(&format!(".{p}.weight")));
        let layer = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok());
        if let (Some(part), Some(layer), Some(mla)) = (split, layer, config.mla.as_ref()) {
            stored.push((t.name.clone(), t.kind.name()));
            let want = [[config.n_heads, mla.kv_rank, mla.nope_dim], [config.n_heads, mla.v_dim, mla.kv_rank]][part];
            if t.shape() != want {
                return Err(f.meta_err(&t.name, format!("shape {:?}: expected {want:?}", t.shape())));
            }
            kv_b.entry(layer).or_default()[part] = Some(f.dequantize(t));
            continue;
        }
        let Some((hf, transposed)) = family.gguf_to_hf(&t.name) else {
            return Err(GgufError::Unsupported {
                path: f.path.clone(),
                name: t.name.clone(),
                kind: format!("a tensor ember does not map for {}", family.gguf_arch),
            });
        };
        stored.push((t.name.clone(), t.kind.name()));
        let mut shape = t.shape();
        let permuted = heads.permuted(arch, &hf, &shape);
        if let Some(heads) = permuted.filter(|h| shape[0] % (2 * h) != 0) {
            let message = format!("{} rows cannot hold {heads} heads of rotary pairs", shape[0]);
            return Err(f.meta_err(&t.name, message));
        }
        if keep_quantized && shape.len() == 2 && keeps(family, &hf, t.kind, transposed) {
            let decode = super::quant::block_decoder(t.kind).expect("keeps checked the type");
            let weight =
                QuantWeight::new(t.kind.name(), [shape[0], shape[1]], t.kind.block(), f.raw(t).to_vec(), decode)
                    .map_err(|e| f.meta_err(&t.name, e.to_string()))?;
            let weight = match permuted {
                Some(heads) => {
                    // Row i of the Hugging Face order is the row the f32 permutation moves there.
                    let rows: Vec<f32> = (0..shape[0]).map(|i| i as f32).collect();
                    weight
                        .with_rows(&permute_rows(&rows, heads, 1, true).iter().map(|&r| r as usize).collect::<Vec<_>>())
                }
                None => weight,
            };
            quantized.insert(hf, weight);
            continue;
        }
        let mut values = f.dequantize(t);
        if hf.contains("{j}") {
            // Experts stacked `[E, out, in]` in llama.cpp's file, one tensor each in Hugging Face's.
            let Some((&experts, one)) = shape.split_first().filter(|(_, one)| one.len() == 2) else {
                return Err(f.meta_err(&t.name, format!("shape {shape:?}: expected [experts, out, in]")));
            };
            let size = one.iter().product::<usize>();
            for (j, chunk) in values.chunks_exact(size.max(1)).take(experts).enumerate() {
                let data = TensorData::new(chunk.to_vec(), one.to_vec());
                ember_model::weights::warn_non_finite(&f.path.display().to_string(), &t.name, &data);
                tensors.insert(crate::family::fill_expert(&hf, j), data);
            }
            continue;
        }
        if hf.ends_with("shared_expert_gate.weight") && shape.len() == 1 {
            shape.insert(0, 1); // llama.cpp's converter keeps Qwen2-MoE's `[1, D]` gate as `[D]`
        }
        if let Some(heads) = permuted {
            values = permute_rows(&values, heads, shape[1], true);
        }
        if transposed && shape.len() == 2 {
            values = transpose(&values, shape[0], shape[1]);
            shape.reverse();
        }
        let data = TensorData::new(values, shape);
        ember_model::weights::warn_non_finite(&f.path.display().to_string(), &t.name, &data);
        tensors.insert(hf, data);
    }
    for (layer, parts) in kv_b {
        let (Some(mla), [Some(k_b), Some(v_b)]) = (config.mla.as_ref(), parts) else {
            return Err(
                f.meta_err(&format!("blk.{layer}.attn_k_b.weight"), "attn_k_b without attn_v_b, or the reverse")
            );
        };
        let (values, shape) = join_kv_b(&k_b, &v_b, config.n_heads, mla.kv_rank)
            .map_err(|e| f.meta_err(&format!("blk.{layer}.attn_k_b.weight"), e))?;
        tensors.insert(format!("model.layers.{layer}.self_attn.kv_b_proj.weight"), TensorData::new(values, shape));
    }
    Ok((tensors, stored, quantized))
}

/// A row-major `[rows, cols]` matrix transposed.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// How export stores the weights (norms and biases stay f32 whatever the type: [`ExportType::ggml_type`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportType {
    F32,
    F16,
    Bf16,
    /// Matrices in Q8_0.
    Q8_0,
}

impl ExportType {
    /// `general.file_type`: llama.cpp's `llama_ftype` of a file mostly in this type.
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 7,
            Self::Bf16 => 32,
        }
    }

    /// The type a tensor of `shape` is stored in.
    /// Only matrices take the file's type: llama.cpp keeps 1-D tensors (norms, biases) in f32, as
    /// its converter writes them, and its CPU kernels cannot add an f16 or bf16 bias or scale by such a
    /// norm ("binary_op: unsupported types"). Q8_0 rows must be whole blocks.
    fn ggml_type(self, shape: &[usize]) -> GgmlType {
        // Matrices, and experts' stacks of them (`[E, out, in]`); rows are the last axis.
        let matrix = shape.len() >= 2;
        let row = shape.last().copied().unwrap_or(0);
        match self {
            Self::F16 if matrix => GgmlType::F16,
            Self::Bf16 if matrix => GgmlType::Bf16,
            Self::Q8_0 if matrix && row.is_multiple_of(32) => GgmlType::Q8_0,
            Self::F32 | Self::F16 | Self::Bf16 | Self::Q8_0 => GgmlType::F32,
        }
    }
}

/// What an export wrote.
pub struct Encoded {
    pub bytes: Vec<u8>,
    /// llama.cpp's architecture.
    pub arch: &'static str,
    pub tensors: usize,
}

/// `model` as a GGUF file of llama.cpp's architecture for its family (the base config.json's,
/// `base`, when there is one), with the tokenizer (and chat template) of `tokenizer_json` /
/// `tokenizer_config` in the metadata. A model llama.cpp would run differently is refused
/// ([`expressible`]).
pub fn encode_model<B: ember_kernels::EmberBackend>(
    model: &Decoder<B>,
    base: Option<&Json>,
    tokenizer_json: &str,
    tokenizer_config: Option<&Json>,
    ty: ExportType,
) -> Result<Encoded, HfError> {
    let config = model.config();
    let arch = base
        .and_then(|v| Architecture::from_class(v.get("architectures")?.get(0)?.as_str()?))
        .unwrap_or_else(|| Architecture::for_model(config));
    expressible(config, arch)?;
    let family = arch.family();
    let name = base.and_then(|b| b["gguf"]["name"].as_str()).filter(|n| !n.is_empty()).unwrap_or("ember export");
    let mut meta = arch_metadata(config, arch, ty, name);
    let hf_config = crate::from_model_config(&ModelConfig { norm: family.parts.norm, ..config.clone() }, arch, base);
    let pre = hf_config["gguf"]["tokenizer.ggml.pre"].as_str().filter(|p| !p.is_empty());
    let tokenizer = super::tokenizer::to_gguf(tokenizer_json, tokenizer_config, &hf_config, pre)
        .map_err(|e| HfError::GgufExport(format!("the tokenizer: {e}")))?;
    meta.extend(tokenizer);
    // The source's descriptive keys, but those the tokenizer's metadata already has (a SentencePiece
    // tokenizer's `add_space_prefix` and `unknown_token_id`): a key twice is an error to llama.cpp's
    // readers.
    for (key, value) in carried_back(&hf_config) {
        if !meta.iter().any(|(k, _)| *k == key) {
            meta.push((key, value));
        }
    }
    // Every gain written as the factor itself.
    let gains = if config.norm == NormKind::LayerNorm { NormKind::LayerNorm } else { NormKind::RmsNorm };
    let mut seen = std::collections::HashSet::new();
    if let Some((key, _)) = meta.iter().find(|(k, _)| !seen.insert(k.as_str())) {
        return Err(HfError::GgufExport(format!("metadata `{key}` would be written twice")));
    }
    let tensors = crate::weights::named_hf_tensors(model, arch, gains)?;
    let heads = Heads { q: config.n_heads as u64, kv: config.n_kv_heads() as u64 };
    let mut out = Vec::with_capacity(tensors.len());
    // Experts' tensors (Hugging Face's one each) go into their stack, written at the first.
    let mut stacks: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (name, data) in &tensors {
        match family.hf_to_ember(name).filter(|t| t.layout == crate::family::Layout::Experts) {
            Some(_) => {
                let (gname, _) = family.hf_to_gguf(name).ok_or_else(|| {
                    HfError::GgufExport(format!("tensor `{name}` has no place in llama.cpp's {}", family.gguf_arch))
                })?;
                let values = data.clone().convert::<f32>().into_vec::<f32>();
                let values = values.map_err(|e| HfError::GgufExport(format!("{name}: {e:?}")))?;
                match stacks.iter_mut().find(|(g, _, _)| *g == gname) {
                    Some((_, shape, stack)) => {
                        shape[0] += 1;
                        stack.extend(values);
                    }
                    None => {
                        stacks.push((gname.clone(), [&[1][..], &data.shape[..]].concat(), values));
                        out.push(None); // its place among the tensors
                    }
                }
            }
            None if family.gguf_arch == "deepseek2" && name.ends_with(".self_attn.kv_b_proj.weight") => {
                // llama.cpp's current layout: per head, the keys' part transposed and the values'.
                let mla =
                    config.mla.as_ref().ok_or_else(|| HfError::GgufExport(format!("{name} without [model.mla]")))?;
                let values = data.clone().convert::<f32>().into_vec::<f32>();
                let values = values.map_err(|e| HfError::GgufExport(format!("{name}: {e:?}")))?;
                let (k_b, v_b) = split_kv_b(&values, config.n_heads, mla.nope_dim, mla.kv_rank);
                let base = name.trim_end_matches(".self_attn.kv_b_proj.weight").replace("model.layers.", "blk.");
                let h = config.n_heads;
                for (part, values, shape) in [
                    ("attn_k_b", k_b, vec![h, mla.kv_rank, mla.nope_dim]),
                    ("attn_v_b", v_b, vec![h, mla.v_dim, mla.kv_rank]),
                ] {
                    let kind = ty.ggml_type(&shape);
                    let gname = format!("{base}.{part}.weight");
                    let data = super::quant::quantize(kind, &values)
                        .map_err(|e| HfError::GgufExport(format!("{gname}: {e}")))?;
                    out.push(Some(TensorOut { name: gname, shape, kind, data }));
                }
            }
            None => out.push(Some(export_tensor(name, data, arch, heads, ty)?)),
        }
    }
    let mut stacks = stacks.into_iter();
    let out = out
        .into_iter()
        .map(|t| match t {
            Some(t) => Ok(t),
            None => {
                let (name, shape, values) = stacks.next().expect("one stack a placeholder");
                let kind = ty.ggml_type(&shape);
                let data =
                    super::quant::quantize(kind, &values).map_err(|e| HfError::GgufExport(format!("{name}: {e}")))?;
                Ok(TensorOut { name, shape, kind, data })
            }
        })
        .collect::<Result<Vec<_>, HfError>>()?;
    Ok(Encoded { bytes: super::encode(&meta, &out), arch: family.gguf_arch, tensors: out.len() })
}

/// Whether llama.cpp's architecture for `arch` runs `config` as ember does: the metadata an export
/// writes must read back to the same model (training-only fields aside; an RMSNorm's gains are
/// written as factors whichever way ember keeps them). The error lists each field that would
/// change: Mistral's sliding window (llama.cpp's `llama` has none), Llama 3's RoPE scaling (which
/// llama.cpp keeps in a `rope_freqs` tensor ember does not write), a Gemma 3 layer pattern other
/// than 5 local : 1 global, a `query_pre_attn_scalar` other than `head_dim`, Qwen3's biases.
pub fn expressible(config: &ModelConfig, arch: Architecture) -> Result<(), HfError> {
    let family = arch.family();
    let name = format!("GGUF {}", family.gguf_arch);
    let meta: BTreeMap<String, Value> = arch_metadata(config, arch, ExportType::F32, "").into_iter().collect();
    let rms = |k: NormKind| k != NormKind::LayerNorm;
    if arch == Architecture::Olmoe && config.n_kv_heads() != config.n_heads {
        let message = format!(
            "llama.cpp's olmoe norms the keys over d_model: a model of {} key/value heads for {} query heads has \
             no place in it",
            config.n_kv_heads(),
            config.n_heads
        );
        return Err(HfError::Inexpressible { architecture: name, fields: vec![message] });
    }
    // The balancing losses' weights are training's, not the model's: GGUF has no key for them.
    let losses = |m: ember_model::MoeConfig| match &config.moe {
        Some(c) => ember_model::MoeConfig {
            aux_loss_coef: c.aux_loss_coef,
            z_loss_coef: c.z_loss_coef,
            bias_update_rate: c.bias_update_rate,
            ..m
        },
        None => m,
    };
    let back = model_config(&meta, Path::new(&name), arch, config.tie_embeddings, None).map(|b| ModelConfig {
        norm: if rms(b.norm) && rms(config.norm) { config.norm } else { b.norm },
        moe: b.moe.map(losses),
        init_std: config.init_std,
        ..b
    });
    crate::config_map::differences(config, back.map_err(HfError::from), &name)
}

/// `general.*` and the `{arch}.*` hyperparameters of `config`, as llama.cpp's converter writes
/// them for the architecture.
fn arch_metadata(config: &ModelConfig, arch: Architecture, ty: ExportType, name: &str) -> Vec<(String, Value)> {
    let a = arch.family().gguf_arch;
    if a == "deepseek2" {
        return deepseek2_metadata(config, ty, name);
    }
    let s = |v: &str| Value::String(v.into());
    let u = |v: usize| Value::U32(v as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(a)),
        ("general.name".into(), s(name)),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (format!("{a}.block_count"), u(config.n_layers)),
        (format!("{a}.context_length"), u(config.max_seq_len)),
        (format!("{a}.embedding_length"), u(config.d_model)),
        (format!("{a}.feed_forward_length"), u(config.d_ff)),
        (format!("{a}.attention.head_count"), u(config.n_heads)),
    ];
    if config.norm == NormKind::LayerNorm {
        meta.push((format!("{a}.attention.layer_norm_epsilon"), Value::F32(config.norm_eps as f32)));
    } else {
        let head_dim = config.head_dim();
        meta.extend([
            (format!("{a}.attention.head_count_kv"), u(config.n_kv_heads())),
            (format!("{a}.attention.key_length"), u(head_dim)),
            (format!("{a}.attention.value_length"), u(head_dim)),
            (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(config.norm_eps as f32)),
        ]);
    }
    if config.positions == Positions::Rope {
        meta.push((format!("{a}.rope.dimension_count"), u(config.head_dim())));
        meta.push((format!("{a}.rope.freq_base"), Value::F32(config.rope_theta as f32)));
        if let Some(RopeScaling::Linear { factor }) = config.rope_scaling {
            meta.push((format!("{a}.rope.scaling.type"), s("linear")));
            meta.push((format!("{a}.rope.scaling.factor"), Value::F32(factor as f32)));
        }
    }
    if arch == Architecture::Gemma3 {
        if let Some(w) = config.sliding_window.filter(|_| (0..config.n_layers).any(|l| config.is_local(l))) {
            meta.push((format!("{a}.attention.sliding_window"), u(w)));
        }
        if let Some(cap) = config.final_logit_softcap {
            meta.push((format!("{a}.final_logit_softcapping"), Value::F32(cap as f32)));
        }
    }
    if let Some(moe) = &config.moe {
        meta.push((format!("{a}.expert_count"), u(moe.n_experts)));
        meta.push((format!("{a}.expert_used_count"), u(moe.top_k)));
        if matches!(arch, Architecture::Mixtral | Architecture::Olmoe) {
            // llama.cpp's `llama` and `olmoe` take the experts' width from feed_forward_length.
            meta.retain(|(k, _)| *k != format!("{a}.feed_forward_length"));
            meta.push((format!("{a}.feed_forward_length"), u(moe.d_expert)));
        } else {
            meta.push((format!("{a}.expert_feed_forward_length"), u(moe.d_expert)));
        }
        if let Some(shared) = moe.shared_expert {
            meta.push((format!("{a}.expert_shared_feed_forward_length"), u(shared)));
        }
    }
    meta.push((format!("{a}.vocab_size"), u(config.vocab_size)));
    meta
}

/// llama.cpp's `deepseek2` keys of `config`, as its converter writes them for MLA in its current
/// layout (one key/value head of `kv_lora_rank + rope` for the absorbed attention, the per-head
/// widths under `*_mla`, `q_lora_rank` 0 for a plain query).
fn deepseek2_metadata(config: &ModelConfig, ty: ExportType, name: &str) -> Vec<(String, Value)> {
    let a = "deepseek2";
    let s = |v: &str| Value::String(v.into());
    let u = |v: usize| Value::U32(v as u32);
    let f = |v: f64| Value::F32(v as f32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(a)),
        ("general.name".into(), s(name)),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
    ];
    let mut keys: Vec<(&str, Value)> = vec![
        ("block_count", u(config.n_layers)),
        ("context_length", u(config.max_seq_len)),
        ("embedding_length", u(config.d_model)),
        ("feed_forward_length", u(config.d_ff)),
        ("attention.head_count", u(config.n_heads)),
        ("attention.head_count_kv", u(1)),
        ("attention.layer_norm_rms_epsilon", f(config.norm_eps)),
        ("rope.freq_base", f(config.rope_theta)),
        ("vocab_size", u(config.vocab_size)),
    ];
    if let Some(mla) = &config.mla {
        keys.extend([
            ("attention.q_lora_rank", u(mla.q_rank.unwrap_or(0))),
            ("attention.kv_lora_rank", u(mla.kv_rank)),
            ("attention.key_length", u(mla.cache_width())),
            ("attention.value_length", u(mla.kv_rank)),
            ("attention.key_length_mla", u(mla.qk_dim())),
            ("attention.value_length_mla", u(mla.v_dim)),
            ("rope.dimension_count", u(mla.rope_dim)),
        ]);
    }
    match config.rope_scaling {
        Some(RopeScaling::Yarn { factor, original_max_position_embeddings, mscale_all_dim, .. }) => keys.extend([
            ("rope.scaling.type", s("yarn")),
            ("rope.scaling.factor", f(factor)),
            ("rope.scaling.original_context_length", u(original_max_position_embeddings)),
            ("rope.scaling.yarn_log_multiplier", f(0.1 * mscale_all_dim.unwrap_or(0.0))),
        ]),
        Some(RopeScaling::Linear { factor }) => {
            keys.extend([("rope.scaling.type", s("linear")), ("rope.scaling.factor", f(factor))])
        }
        _ => {}
    }
    if let Some(moe) = &config.moe {
        let gating = if moe.scoring == ember_model::Scoring::Sigmoid { 2 } else { 1 };
        keys.extend([
            ("leading_dense_block_count", u(moe.dense_layers)),
            ("expert_count", u(moe.n_experts)),
            ("expert_used_count", u(moe.top_k)),
            ("expert_feed_forward_length", u(moe.d_expert)),
            ("expert_shared_count", u(moe.shared_expert.map_or(0, |w| w / moe.d_expert.max(1)))),
            ("expert_weights_scale", f(moe.routed_scale)),
            ("expert_weights_norm", Value::Bool(moe.norm_topk)),
            ("expert_gating_func", u(gating)),
        ]);
        if let (Some(groups), Some(top)) = (moe.groups, moe.top_groups) {
            keys.extend([("expert_group_count", u(groups)), ("expert_group_used_count", u(top))]);
        }
    }
    meta.extend(keys.into_iter().map(|(k, v)| (format!("{a}.{k}"), v)));
    meta
}

/// What an import kept of the source file's descriptive metadata ([`carried_metadata`]), to be
/// written back; `general.name` is left to [`arch_metadata`].
fn carried_back(hf_config: &Json) -> Vec<(String, Value)> {
    let from_json = |value: &Json| match value {
        Json::String(x) => Some(Value::String(x.clone())),
        Json::Bool(b) => Some(Value::Bool(*b)),
        Json::Number(n) => Some(Value::U32(n.as_u64().unwrap_or(0) as u32)),
        Json::Array(items) => {
            Some(Value::Array(items.iter().filter_map(Json::as_str).map(|x| Value::String(x.into())).collect()))
        }
        _ => None,
    };
    hf_config["gguf"]["carry"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(key, _)| *key != "general.name")
        .filter_map(|(key, value)| Some((key.clone(), from_json(value)?)))
        .collect()
}

/// One tensor as export writes it: under its GGUF name, q/k rows in llama.cpp's order, GPT-2's
/// `Conv1D` weights transposed, stored as `ty` stores a tensor of its shape.
fn export_tensor(
    name: &str,
    data: &TensorData,
    arch: Architecture,
    heads: Heads,
    ty: ExportType,
) -> Result<TensorOut, HfError> {
    let family = arch.family();
    let (gname, transposed) = family.hf_to_gguf(name).ok_or_else(|| {
        HfError::GgufExport(format!("tensor `{name}` has no place in llama.cpp's {}", family.gguf_arch))
    })?;
    let mut shape = data.shape.to_vec();
    let mut values =
        data.clone().convert::<f32>().into_vec::<f32>().map_err(|e| HfError::GgufExport(format!("{name}: {e:?}")))?;
    if transposed && shape.len() == 2 {
        values = transpose(&values, shape[0], shape[1]);
        shape.reverse();
    }
    if let Some(heads) = heads.permuted(arch, name, &shape) {
        values = permute_rows(&values, heads, shape[1], false);
    }
    if name.ends_with("shared_expert_gate.weight") && shape.first() == Some(&1) {
        shape.remove(0); // Qwen2-MoE's `[1, D]` gate as llama.cpp's converter writes it, `[D]`
    }
    // The routers stay f32 whatever the type, as llama.cpp's quantizer keeps them: a rounded router
    // can pick other experts.
    let kind = if gname.contains("ffn_gate_inp") { GgmlType::F32 } else { ty.ggml_type(&shape) };
    let data = super::quant::quantize(kind, &values).map_err(|e| HfError::GgufExport(format!("{name}: {e}")))?;
    Ok(TensorOut { name: gname, shape, kind, data })
}

/// A GGUF model imported as a decoder, with its tokenizer files' contents.
pub struct GgufImport<B: ember_kernels::EmberBackend> {
    pub imported: crate::Imported<B>,
    pub arch: Architecture,
    pub tokenizer_json: String,
    pub tokenizer_config: Json,
    /// (name, type) of every tensor as stored.
    pub stored: Vec<(String, &'static str)>,
}

/// Reads a GGUF file into a decoder whose parameters are stored in `param_dtype`.
pub fn import<B: ember_kernels::EmberBackend>(
    path: &Path,
    param_dtype: burn::tensor::DType,
    device: &burn::tensor::Device<B>,
) -> Result<GgufImport<B>, crate::HfError> {
    import_from(read(path)?, path, param_dtype, device)
}

/// [`import`] with the blocks' projection weights kept in their stored block types ([`read_keeping`])
/// and frozen, every other parameter f32: the base of LoRA on a quantized model.
pub fn import_keeping<B: ember_kernels::EmberBackend>(
    path: &Path,
    device: &burn::tensor::Device<B>,
) -> Result<GgufImport<B>, crate::HfError> {
    import_from(read_keeping(path)?, path, burn::tensor::DType::F32, device)
}

fn import_from<B: ember_kernels::EmberBackend>(
    m: GgufModel,
    path: &Path,
    param_dtype: burn::tensor::DType,
    device: &burn::tensor::Device<B>,
) -> Result<GgufImport<B>, crate::HfError> {
    let tensors = m.tensors.into_iter().map(|(k, v)| (k, (v, path.to_path_buf()))).collect();
    let imported = crate::weights::load_tensors(
        m.config,
        m.arch,
        m.hf_config,
        path,
        path,
        tensors,
        param_dtype,
        false,
        false,
        m.quantized,
        device,
    )?;
    Ok(GgufImport {
        imported,
        arch: m.arch,
        tokenizer_json: m.tokenizer_json,
        tokenizer_config: m.tokenizer_config,
        stored: m.stored,
    })
}

/// Writes `bytes` to `out` atomically: a temporary file beside it, fsynced, then renamed; an
/// existing `out` is an error.
pub fn write_new(out: &Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    use std::io::Write;
    if out.exists() {
        return Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "exists; choose another --out"));
    }
    let tmp = out.with_extension(format!("gguf.tmp-{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, out)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|_| out.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_per_architecture() {
        let cases = [
            (Architecture::Llama, "blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", false),
            (Architecture::Llama, "blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight", false),
            (Architecture::Qwen2, "blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias", false),
            (Architecture::Qwen3, "blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight", false),
            // Gemma's four norms: the attention's output norm is llama.cpp's post_attention_norm,
            // the MLP's input norm its ffn_norm.
            (
                Architecture::Gemma3,
                "blk.2.post_attention_norm.weight",
                "model.layers.2.post_attention_layernorm.weight",
                false,
            ),
            (Architecture::Gemma3, "blk.2.ffn_norm.weight", "model.layers.2.pre_feedforward_layernorm.weight", false),
            (
                Architecture::Gemma3,
                "blk.2.post_ffw_norm.weight",
                "model.layers.2.post_feedforward_layernorm.weight",
                false,
            ),
            (Architecture::Gpt2, "position_embd.weight", "transformer.wpe.weight", false),
            (Architecture::Gpt2, "blk.0.attn_qkv.weight", "transformer.h.0.attn.c_attn.weight", true),
            (Architecture::Gpt2, "blk.0.attn_qkv.bias", "transformer.h.0.attn.c_attn.bias", false),
            (Architecture::Gpt2, "blk.1.ffn_down.weight", "transformer.h.1.mlp.c_proj.weight", true),
            (Architecture::Gpt2, "output.weight", "lm_head.weight", false),
        ];
        for (arch, g, hf, transposed) in cases {
            let f = arch.family();
            assert_eq!(f.gguf_to_hf(g), Some((hf.to_string(), transposed)), "{arch:?} {g}");
            assert_eq!(f.hf_to_gguf(hf), Some((g.to_string(), transposed)), "{arch:?} {hf}");
        }
        // Hub GPT-2 names lack the prefix; Gemma's biases have no GGUF tensor; unknown names none.
        assert_eq!(Architecture::Gpt2.family().hf_to_gguf("h.0.ln_1.bias").unwrap().0, "blk.0.attn_norm.bias");
        assert_eq!(Architecture::Gemma3.family().hf_to_gguf("model.layers.0.self_attn.q_proj.bias"), None);
        assert_eq!(Architecture::Llama.family().gguf_to_hf("blk.x.attn_q.weight"), None);
        assert_eq!(Architecture::Llama.family().gguf_to_hf("rope_freqs.weight"), None);
        assert_eq!(Architecture::from_gguf("llama"), Some(Architecture::Llama), "not Mistral");
    }

    #[test]
    fn non_finite_and_mistyped_hyper_parameters_are_refused_by_name() {
        // The metadata an export writes for a tiny Llama with linear RoPE scaling and a tiny Gemma 3
        // with a final softcap: every float key model_config reads.
        let llama =
            ModelConfig { rope_scaling: Some(RopeScaling::Linear { factor: 2.0 }), ..ModelConfig::tiny(64, 32) };
        let gemma = ModelConfig { final_logit_softcap: Some(30.0), ..ModelConfig::tiny(64, 32) };
        let metadata = |config: &ModelConfig, arch| -> BTreeMap<String, Value> {
            arch_metadata(config, arch, ExportType::F32, "t").into_iter().collect()
        };
        let read = |meta: &BTreeMap<String, Value>, arch| model_config(meta, Path::new("t.gguf"), arch, false, None);
        let bad = |config: &ModelConfig, arch, key: &str, value: Value| {
            let mut meta = metadata(config, arch);
            assert!(meta.insert(key.to_string(), value).is_some(), "{key} is written");
            read(&meta, arch).expect_err("an error").to_string()
        };
        assert!(read(&metadata(&llama, Architecture::Llama), Architecture::Llama).is_ok());
        assert!(read(&metadata(&gemma, Architecture::Gemma3), Architecture::Gemma3).is_ok());
        for (config, arch, key, value) in [
            (&llama, Architecture::Llama, "llama.rope.freq_base", Value::F32(f32::NAN)),
            (&llama, Architecture::Llama, "llama.attention.layer_norm_rms_epsilon", Value::F32(f32::INFINITY)),
            (&llama, Architecture::Llama, "llama.rope.scaling.factor", Value::F64(f64::NAN)),
            (&gemma, Architecture::Gemma3, "gemma3.final_logit_softcapping", Value::F32(f32::NEG_INFINITY)),
        ] {
            let e = bad(config, arch, key, value);
            assert!(
                e.contains("t.gguf") && e.contains(&format!("`{key}`")) && e.contains("not a finite number"),
                "{e}"
            );
        }
        let e = bad(&llama, Architecture::Llama, "llama.rope.freq_base", Value::String("1e4".into()));
        assert!(e.contains("`llama.rope.freq_base` has type string, expected a number"), "{e}");
        let e = bad(&llama, Architecture::Llama, "llama.block_count", Value::F32(2.0));
        assert!(e.contains("`llama.block_count` has type f32 (2), expected an unsigned integer"), "{e}");
        let e = bad(&llama, Architecture::Llama, "llama.rope.scaling.type", Value::U32(1));
        assert!(e.contains("`llama.rope.scaling.type` has type u32 (1), expected string"), "{e}");
        // `general.architecture` as an integer: its type, not "missing".
        let file = GgufFile::parse(
            super::super::encode(&[("general.architecture".to_string(), Value::U32(7))], &[]),
            Path::new("t.gguf"),
        )
        .unwrap();
        let e = read_file(file).err().expect("an error").to_string();
        assert_eq!(e, "t.gguf: metadata `general.architecture` has type u32 (7), expected string");
    }

    #[test]
    fn deepseek_key_and_value_up_projections_split_per_head_and_join_back() {
        // kv_b_proj [H·(nope + v), r] with value h·1000 + row·10 + column, H 3, nope 2, v 4, r 5.
        let (h, nope, v, r) = (3, 2, 4, 5);
        let kv_b: Vec<f32> = (0..h * (nope + v) * r)
            .map(|i| (i / r / (nope + v) * 1000 + i / r % (nope + v) * 10 + i % r) as f32)
            .collect();
        let (k_b, v_b) = split_kv_b(&kv_b, h, nope, r);
        // attn_k_b [H, r, nope]: head 2's key row 1, latent column 3 at [2][3][1].
        assert_eq!(k_b[(2 * r + 3) * nope + 1], 2013.0);
        // attn_v_b [H, v, r]: head 1's value row 2 (row nope + 2 of the head), column 4.
        assert_eq!(v_b[(v + 2) * r + 4], 1044.0);
        let (back, shape) = join_kv_b(&k_b, &v_b, h, r).unwrap();
        assert_eq!((back, shape), (kv_b, vec![h * (nope + v), r]));
        assert!(join_kv_b(&k_b[1..], &v_b, h, r).is_err());
    }

    #[test]
    fn the_rotary_permutation_is_undone_exactly() {
        // 2 heads of Dh 4, 3 columns: rows numbered so the permutation can be read off.
        let hf: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let gguf = permute_rows(&hf, 2, 3, false);
        // Head 0, pair 0: HF rows 0 and 2 become GGUF rows 0 and 1.
        assert_eq!(&gguf[3..6], &hf[6..9]);
        assert_eq!(permute_rows(&gguf, 2, 3, true), hf);
    }
}
