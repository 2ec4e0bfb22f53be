//! A GGUF model as a Hugging Face one: the architecture's metadata read as an ember
//! [`ModelConfig`] (and written out as a `config.json`), the tensors under their Hugging Face names
//! in Hugging Face's layout, dequantized to f32 — and back.
//!
//! Tensor names come from the family table ([`crate::family`]): each rule names the tensor in
//! Hugging Face, ember and llama.cpp's GGUF (`token_embd`, `blk.{i}.attn_q`, `blk.{i}.ffn_norm`, …),
//! so that one table says for each family where every tensor goes. What differs between llama.cpp's
//! architectures beyond names is each family's [`GgufRules`](super::hparams::GgufRules), in its
//! file beside its table; the keys all share are read and written in [`super::hparams`], the export
//! in `gguf/export.rs`:
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
//! | `deepseek2` | DeepSeek-V2, V3 | adjacent, as Hugging Face's | its own: latent attention's ranks and `*_mla` widths, YaRN, grouped experts; `kv_b_proj` as `attn_k_b` and `attn_v_b` |
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
//! ([`ember_model::NormKind::RmsNorm`]) rather than subtract one, so that an export of it writes the file's bits
//! again; a Gemma read from Hugging Face (`w`, [`ember_model::NormKind::RmsNormPlusOne`]) exports `1 + w` in f32,
//! the value its forward pass multiplies by, and re-imports to the same logits bit for bit.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::TensorData;
use ember_model::ModelConfig;
use serde_json::{json, Value as Json};

pub use super::export::{encode_model, expressible, Encoded, ExportType};
use super::hparams::{model_config, SplitTensor};
use super::{GgmlType, GgufError, GgufFile, Value};
use crate::family::{fill, Architecture, Rule, Stored};
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

/// Query and key/value heads: what the q/k row permutation needs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Heads {
    q: u64,
    kv: u64,
}

impl Heads {
    pub(super) fn of(config: &ModelConfig) -> Heads {
        Heads { q: config.n_heads as u64, kv: config.n_kv_heads() as u64 }
    }

    /// The heads whose rows llama.cpp reorders in tensor `hf_name` of `shape`: those of a q or k
    /// projection matrix of an architecture it permutes; `None` for every other tensor.
    pub(super) fn permuted(self, arch: Architecture, hf_name: &str, shape: &[usize]) -> Option<usize> {
        let is_q = hf_name.ends_with("q_proj.weight");
        let is_qk = is_q || hf_name.ends_with("k_proj.weight");
        (arch.gguf().permutes_qk && shape.len() == 2 && is_qk).then_some(if is_q { self.q } else { self.kv } as usize)
    }
}

/// Reorders the rows of a `[heads·Dh, in]` q or k projection between llama.cpp's adjacent rotary
/// pairs (row `h·Dh + 2i + c`) and Hugging Face's split halves (row `h·Dh + c·Dh/2 + i`).
/// `to_hf`: GGUF -> Hugging Face; otherwise the reverse.
pub(super) fn permute_rows(values: &[f32], heads: usize, cols: usize, to_hf: bool) -> Vec<f32> {
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

/// Which weights a read keeps in their stored block types ([`GgufModel::quantized`]) rather than
/// dequantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// None: every tensor f32.
    Nothing,
    /// The blocks' projection weights (q, k, v, o, gate, up, down): the frozen base of LoRA.
    Projections,
    /// The projections, the embedding table and the LM head: a model run for inference.
    Inference,
}

/// [`read`], the blocks' projection weights (q, k, v, o, gate, up, down) stored in a block type
/// kept in it ([`GgufModel::quantized`]) rather than dequantized: for LoRA on a quantized base.
pub fn read_keeping(path: &Path) -> Result<GgufModel, GgufError> {
    read_file_as(GgufFile::open(path)?, Keep::Projections)
}

/// [`read`] of a file already opened (or parsed from bytes).
pub fn read_file(f: GgufFile) -> Result<GgufModel, GgufError> {
    read_file_as(f, Keep::Nothing)
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
        let rule = family.gguf_rule(&t.name).map(|(rule, _)| rule);
        t.shape().len() == 2 && rule.is_some_and(|r| keeps(r, t.kind, Keep::Projections))
    });
    Ok(kept.fold((0, 0), |(n, b), t| (n + t.num_values(), b + t.len as u64)))
}

fn read_file_as(f: GgufFile, keep: Keep) -> Result<GgufModel, GgufError> {
    read_arch(&f)?;
    if f.tensor("rope_freqs.weight").is_some() {
        return Err(f.meta_err("rope_freqs.weight", "Llama 3.1 RoPE frequency factors are not supported yet"));
    }
    let (config, arch, hf_config) = read_config(&f)?;
    let (tensors, stored, quantized) = read_tensors(&f, arch, &config, keep)?;
    // Inference has its tokenizer already (built when the source was opened); a second one, a
    // JSON text and tree as large as the vocabulary (262k tokens for Gemma 3), would be made only
    // to be dropped.
    let (tokenizer_json, tokenizer_config) = match keep {
        Keep::Inference => (String::new(), Json::Null),
        _ => super::tokenizer::from_gguf(&f)?,
    };
    Ok(GgufModel { arch, config, hf_config, tensors, tokenizer_json, tokenizer_config, stored, quantized })
}

/// The family of the architecture `general.architecture` names that claims the file
/// ([`GgufRules::claims`](super::hparams::GgufRules::claims)).
fn read_arch(f: &GgufFile) -> Result<Architecture, GgufError> {
    let key = "general.architecture";
    let name = f.meta().str(key)?.ok_or_else(|| f.meta_err(key, "missing"))?;
    let supported = Architecture::supported_gguf();
    Architecture::of_gguf_file(name, f)?
        .ok_or_else(|| f.meta_err(key, format!("`{name}` is not supported ({supported} are)")))
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

/// Whether `keep` keeps a tensor of `rule`, of type `kind`, as stored: a block type, in Hugging
/// Face's orientation (`[out, in]`, not transposed as GPT-2's `Conv1D` weights are), that the
/// family's rule lets stay stored ([`Stored`]: a block's projection, or for inference the
/// embedding table or the LM head too).
fn keeps(rule: &Rule, kind: GgmlType, keep: Keep) -> bool {
    let blocks = super::quant::block_decoder(kind).is_some();
    let kept = match rule.stored {
        Stored::Dequantized => false,
        Stored::Projection => keep != Keep::Nothing,
        Stored::Table => keep == Keep::Inference,
    };
    kept && blocks && !rule.gguf_transposed
}

/// Every tensor under its Hugging Face name, dequantized to f32, in Hugging Face's layout (q/k rows
/// in its order, GPT-2's `Conv1D` weights `[in, out]`); with `keep`, the tensors
/// [`keeps`] takes as stored (rows reordered as the f32 ones are).
fn read_tensors(f: &GgufFile, arch: Architecture, config: &ModelConfig, keep: Keep) -> Result<ReadTensors, GgufError> {
    let split = arch.gguf().split.as_ref();
    let mut out = ReadTensors::default();
    // The parts of a tensor llama.cpp splits (DeepSeek's `kv_b_proj`), by layer, joined once both
    // are read.
    let mut parts: BTreeMap<usize, [Option<Vec<f32>>; 2]> = BTreeMap::new();
    for t in &f.tensors {
        if let Some((layer, part)) = split.and_then(|s| split_part(s, t, config)) {
            out.1.push((t.name.clone(), t.kind.name()));
            let want = split.and_then(|s| (s.shapes)(config)).map(|shapes| shapes[part].clone()).unwrap_or_default();
            if t.shape() != want {
                return Err(f.meta_err(&t.name, format!("shape {:?}: expected {want:?}", t.shape())));
            }
            parts.entry(layer).or_default()[part] = Some(f.dequantize(t));
            continue;
        }
        read_tensor(f, t, arch, config, keep, &mut out)?;
    }
    for (layer, pair) in parts {
        let Some(split) = split else { break };
        let key = format!("blk.{layer}.{}.weight", split.parts[0]);
        let [Some(a), Some(b)] = pair else {
            let message = format!("{} without {}, or the reverse", split.parts[0], split.parts[1]);
            return Err(f.meta_err(&key, message));
        };
        let hf = split.hf.replace("{i}", &layer.to_string());
        // The tensor whole too (older files' `attn_kv_b`): two sources of one weight, refused
        // rather than one silently winning.
        if out.0.contains_key(&hf) || out.2.contains_key(&hf) {
            let whole = arch.family().hf_to_gguf(&hf).map_or_else(|| hf.clone(), |(name, _)| name);
            let (k, v) = (split.parts[0], split.parts[1]);
            let message = format!(
                "blk.{layer}.{k}.weight and blk.{layer}.{v}.weight hold the same weight as `{whole}`, which the file \
                 has too: a file holds one or the other"
            );
            return Err(f.meta_err(&key, message));
        }
        let (values, shape) = (split.join)(f, &key, config, &a, &b)?;
        out.0.insert(hf, TensorData::new(values, shape));
    }
    Ok(out)
}

/// The layer and part (0 or 1) of tensor `t` if it is `blk.{i}.{part}.weight` of a tensor
/// llama.cpp splits, in a model that has the tensor.
fn split_part(split: &SplitTensor, t: &super::TensorInfo, config: &ModelConfig) -> Option<(usize, usize)> {
    (split.shapes)(config)?;
    let part = split.parts.iter().position(|p| t.name.ends_with(&format!(".{p}.weight")))?;
    let layer = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok())?;
    Some((layer, part))
}

/// Tensor `t` under its Hugging Face name (each expert's under its own), into `out`.
fn read_tensor(
    f: &GgufFile,
    t: &super::TensorInfo,
    arch: Architecture,
    config: &ModelConfig,
    keep: Keep,
    out: &mut ReadTensors,
) -> Result<(), GgufError> {
    let family = arch.family();
    let Some((rule, layer)) = family.gguf_rule(&t.name) else {
        return Err(GgufError::UnknownTensor { path: f.path.clone(), name: t.name.clone(), arch: family.gguf_arch });
    };
    let (hf, transposed) = (fill(rule.hf, layer), rule.gguf_transposed);
    out.1.push((t.name.clone(), t.kind.name()));
    let mut shape = t.shape();
    let heads = Heads::of(config);
    let permuted = heads.permuted(arch, &hf, &shape);
    if let Some(heads) = permuted.filter(|h| shape[0] % (2 * h) != 0) {
        let message = format!("{} rows cannot hold {heads} heads of rotary pairs", shape[0]);
        return Err(f.meta_err(&t.name, message));
    }
    if shape.len() == 2 && keeps(rule, t.kind, keep) {
        out.2.insert(hf, kept_weight(f, t, permuted)?);
        return Ok(());
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
            out.0.insert(crate::family::fill_expert(&hf, j), data);
        }
        return Ok(());
    }
    if arch.gguf().squeezes(&hf) && shape.len() == 1 {
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
    out.0.insert(hf, data);
    Ok(())
}

/// A projection weight kept in its stored type, its rows in Hugging Face's order (`permuted`: the
/// heads whose rows llama.cpp reordered). Where the weight ends up with bytes of its own (rows
/// reordered, or interleaved for the integer products), the file's pages of it are let go.
fn kept_weight(f: &GgufFile, t: &super::TensorInfo, permuted: Option<usize>) -> Result<QuantWeight, GgufError> {
    let shape = t.shape();
    let decode = super::quant::block_decoder(t.kind).expect("keeps checked the type");
    let mut weight = QuantWeight::new(t.kind.name(), [shape[0], shape[1]], t.kind.block(), f.stored(t), decode)
        .map_err(|e| f.meta_err(&t.name, e.to_string()))?;
    if let Some(heads) = permuted {
        // Row i of the Hugging Face order is the row the f32 permutation moves there.
        let rows: Vec<f32> = (0..shape[0]).map(|i| i as f32).collect();
        weight = weight.with_rows(&permute_rows(&rows, heads, 1, true).iter().map(|&r| r as usize).collect::<Vec<_>>());
        f.release(t); // a copy of its own
    }
    if let Some(format) = super::quant::dot_format(t.kind) {
        // An interleaved copy of the file's bytes lets their pages go as it grows.
        let mut consumed = |r: std::ops::Range<usize>| {
            if permuted.is_none() {
                f.release_range(t, r);
            }
        };
        weight = weight.with_dot_releasing(format, &mut consumed).map_err(|e| f.meta_err(&t.name, e.to_string()))?;
    }
    if weight.interleaved() {
        f.release(t);
    }
    Ok(weight)
}

/// A row-major `[rows, cols]` matrix transposed.
pub(super) fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// A GGUF model imported as a decoder, with its tokenizer files' contents.
pub struct GgufImport<B: ember_kernels::EmberBackend> {
    pub imported: crate::Imported<B>,
    pub arch: Architecture,
    /// tokenizer.json's text ([`super::tokenizer::from_gguf`]); empty from [`import_for_inference`],
    /// whose callers build their tokenizer once, from the file.
    pub tokenizer_json: String,
    /// tokenizer_config.json's (null from [`import_for_inference`]).
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

/// [`import`] for inference: the blocks' projections, the embedding table and the LM head kept in
/// their stored block types ([`Keep::Inference`]), products on the stored blocks. The tokenizer
/// files are left empty.
pub fn import_for_inference<B: ember_kernels::EmberBackend>(
    path: &Path,
    device: &burn::tensor::Device<B>,
) -> Result<GgufImport<B>, crate::HfError> {
    import_from(read_file_as(GgufFile::open(path)?, Keep::Inference)?, path, burn::tensor::DType::F32, device)
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
    let load = crate::weights::Load {
        config: m.config,
        architecture: m.arch,
        hf_config: m.hf_config,
        config_path: path,
        dir: path,
        param_dtype,
        allow_missing: false,
        allow_unused: false,
        quantized: m.quantized,
    };
    let imported = crate::weights::load_tensors(load, tensors, device)?;
    Ok(GgufImport {
        imported,
        arch: m.arch,
        tokenizer_json: m.tokenizer_json,
        tokenizer_config: m.tokenizer_config,
        stored: m.stored,
    })
}

#[cfg(test)]
mod tests {
    use super::super::hparams::arch_metadata;
    use super::*;
    use crate::families::gemma3::GEMMA3;
    use crate::families::gpt2::GPT2;
    use crate::families::llama::LLAMA;
    use crate::families::qwen::QWEN2;
    use crate::families::qwen::QWEN3;
    use ember_model::RopeScaling;

    #[test]
    fn names_map_both_ways_per_architecture() {
        let cases = [
            (LLAMA.architecture(), "blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", false),
            (LLAMA.architecture(), "blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight", false),
            (QWEN2.architecture(), "blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias", false),
            (QWEN3.architecture(), "blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight", false),
            // Gemma's four norms: the attention's output norm is llama.cpp's post_attention_norm,
            // the MLP's input norm its ffn_norm.
            (
                GEMMA3.architecture(),
                "blk.2.post_attention_norm.weight",
                "model.layers.2.post_attention_layernorm.weight",
                false,
            ),
            (GEMMA3.architecture(), "blk.2.ffn_norm.weight", "model.layers.2.pre_feedforward_layernorm.weight", false),
            (
                GEMMA3.architecture(),
                "blk.2.post_ffw_norm.weight",
                "model.layers.2.post_feedforward_layernorm.weight",
                false,
            ),
            (GPT2.architecture(), "position_embd.weight", "transformer.wpe.weight", false),
            (GPT2.architecture(), "blk.0.attn_qkv.weight", "transformer.h.0.attn.c_attn.weight", true),
            (GPT2.architecture(), "blk.0.attn_qkv.bias", "transformer.h.0.attn.c_attn.bias", false),
            (GPT2.architecture(), "blk.1.ffn_down.weight", "transformer.h.1.mlp.c_proj.weight", true),
            (GPT2.architecture(), "output.weight", "lm_head.weight", false),
        ];
        for (arch, g, hf, transposed) in cases {
            let f = arch.family();
            assert_eq!(f.gguf_to_hf(g), Some((hf.to_string(), transposed)), "{arch:?} {g}");
            assert_eq!(f.hf_to_gguf(hf), Some((g.to_string(), transposed)), "{arch:?} {hf}");
        }
        // Hub GPT-2 names lack the prefix; Gemma's biases have no GGUF tensor; unknown names none.
        assert_eq!(GPT2.architecture().family().hf_to_gguf("h.0.ln_1.bias").unwrap().0, "blk.0.attn_norm.bias");
        assert_eq!(GEMMA3.architecture().family().hf_to_gguf("model.layers.0.self_attn.q_proj.bias"), None);
        assert_eq!(LLAMA.architecture().family().gguf_to_hf("blk.x.attn_q.weight"), None);
        assert_eq!(LLAMA.architecture().family().gguf_to_hf("rope_freqs.weight"), None);
        assert_eq!(Architecture::from_gguf("llama"), Some(LLAMA.architecture()), "not Mistral");
    }

    #[test]
    fn non_finite_and_mistyped_hyper_parameters_are_refused_by_name() {
        // The metadata an export writes for a tiny Llama with linear RoPE scaling and a tiny Gemma 3
        // with a final softcap: every float key model_config reads.
        let llama =
            ModelConfig { rope_scaling: Some(RopeScaling::Linear { factor: 2.0 }), ..ModelConfig::tiny(64, 32) };
        let gemma = ModelConfig { final_logit_softcap: Some(30.0), ..ModelConfig::tiny(64, 32) };
        let metadata = |config: &ModelConfig, arch| -> BTreeMap<String, Value> {
            arch_metadata(config, arch, ExportType::F32.file_type(), "t").into_iter().collect()
        };
        let read = |meta: &BTreeMap<String, Value>, arch| model_config(meta, Path::new("t.gguf"), arch, false, None);
        let bad = |config: &ModelConfig, arch, key: &str, value: Value| {
            let mut meta = metadata(config, arch);
            assert!(meta.insert(key.to_string(), value).is_some(), "{key} is written");
            read(&meta, arch).expect_err("an error").to_string()
        };
        assert!(read(&metadata(&llama, LLAMA.architecture()), LLAMA.architecture()).is_ok());
        assert!(read(&metadata(&gemma, GEMMA3.architecture()), GEMMA3.architecture()).is_ok());
        for (config, arch, key, value) in [
            (&llama, LLAMA.architecture(), "llama.rope.freq_base", Value::F32(f32::NAN)),
            (&llama, LLAMA.architecture(), "llama.attention.layer_norm_rms_epsilon", Value::F32(f32::INFINITY)),
            (&llama, LLAMA.architecture(), "llama.rope.scaling.factor", Value::F64(f64::NAN)),
            (&gemma, GEMMA3.architecture(), "gemma3.final_logit_softcapping", Value::F32(f32::NEG_INFINITY)),
        ] {
            let e = bad(config, arch, key, value);
            assert!(
                e.contains("t.gguf") && e.contains(&format!("`{key}`")) && e.contains("not a finite number"),
                "{e}"
            );
        }
        let e = bad(&llama, LLAMA.architecture(), "llama.rope.freq_base", Value::String("1e4".into()));
        assert!(e.contains("`llama.rope.freq_base` has type string, expected a number"), "{e}");
        let e = bad(&llama, LLAMA.architecture(), "llama.block_count", Value::F32(2.0));
        assert!(e.contains("`llama.block_count` has type f32 (2), expected an unsigned integer"), "{e}");
        let e = bad(&llama, LLAMA.architecture(), "llama.rope.scaling.type", Value::U32(1));
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
    fn the_rotary_permutation_is_undone_exactly() {
        // 2 heads of Dh 4, 3 columns: rows numbered so the permutation can be read off.
        let hf: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let gguf = permute_rows(&hf, 2, 3, false);
        // Head 0, pair 0: HF rows 0 and 2 become GGUF rows 0 and 1.
        assert_eq!(&gguf[3..6], &hf[6..9]);
        assert_eq!(permute_rows(&gguf, 2, 3, true), hf);
    }
}
