//! A model written as llama.cpp's GGUF: the metadata of its family's architecture
//! ([`super::hparams`]), its tokenizer's, and its tensors under their GGUF names, q/k rows in
//! llama.cpp's order, experts stacked, stored in the export's type.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::TensorData;
use ember_model::{Decoder, ModelConfig, NormKind};
use serde_json::Value as Json;

use super::hparams::{arch_metadata, model_config, SplitTensor};
use super::model::{permute_rows, transpose, Heads};
use super::{GgmlType, TensorOut, Value};
use crate::family::Architecture;
use crate::HfError;

/// How export stores the weights (norms and biases stay f32 whatever the type: `ExportType::ggml_type`).
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
    pub(crate) fn file_type(self) -> u32 {
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
    let meta = export_metadata(config, arch, base, tokenizer_json, tokenizer_config, ty)?;
    // Every gain written as the factor itself.
    let gains = if config.norm == NormKind::LayerNorm { NormKind::LayerNorm } else { NormKind::RmsNorm };
    let tensors = crate::weights::named_hf_tensors(model, arch, gains)?;
    let out = export_tensors(&tensors, config, arch, ty)?;
    Ok(Encoded { bytes: super::encode(&meta, &out), arch: arch.family().gguf_arch, tensors: out.len() })
}

/// The metadata of an export: `general.*`, the architecture's keys, the tokenizer's and what the
/// import carried from its source file.
fn export_metadata(
    config: &ModelConfig,
    arch: Architecture,
    base: Option<&Json>,
    tokenizer_json: &str,
    tokenizer_config: Option<&Json>,
    ty: ExportType,
) -> Result<Vec<(String, Value)>, HfError> {
    let name = base.and_then(|b| b["gguf"]["name"].as_str()).filter(|n| !n.is_empty()).unwrap_or("ember export");
    let mut meta = arch_metadata(config, arch, ty.file_type(), name);
    let norm = arch.family().parts.norm;
    let hf_config = crate::from_model_config(&ModelConfig { norm, ..config.clone() }, arch, base);
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
    let mut seen = std::collections::HashSet::new();
    if let Some((key, _)) = meta.iter().find(|(k, _)| !seen.insert(k.as_str())) {
        return Err(HfError::GgufExport(format!("metadata `{key}` would be written twice")));
    }
    Ok(meta)
}

/// Every tensor of an export as llama.cpp's architecture stores it: experts' (Hugging Face's one
/// each) in their stack, written where the first was; a tensor the family splits as its parts.
fn export_tensors(
    tensors: &[(String, TensorData)],
    config: &ModelConfig,
    arch: Architecture,
    ty: ExportType,
) -> Result<Vec<TensorOut>, HfError> {
    let family = arch.family();
    let split = arch.gguf().split.as_ref();
    let heads = Heads::of(config);
    let mut out = Vec::with_capacity(tensors.len());
    let mut stacks: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (name, data) in tensors {
        let layer = split.and_then(|s| crate::family::match_pattern(s.hf, name)).flatten();
        if family.hf_to_ember(name).is_some_and(|t| t.layout == crate::family::Layout::Experts) {
            let (gname, _) = family.hf_to_gguf(name).ok_or_else(|| {
                HfError::GgufExport(format!("tensor `{name}` has no place in llama.cpp's {}", family.gguf_arch))
            })?;
            let values = f32_values(name, data)?;
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
        } else if let (Some(split), Some(layer)) = (split, layer) {
            out.extend(split_tensor(split, layer, name, data, config, ty)?.into_iter().map(Some));
        } else {
            out.push(Some(export_tensor(name, data, arch, heads, ty)?));
        }
    }
    let mut stacks = stacks.into_iter();
    out.into_iter()
        .map(|t| match t {
            Some(t) => Ok(t),
            None => {
                let (name, shape, values) = stacks.next().expect("one stack a placeholder");
                stored(name, shape, &values, ty)
            }
        })
        .collect()
}

/// A tensor's values as f32.
fn f32_values(name: &str, data: &TensorData) -> Result<Vec<f32>, HfError> {
    data.clone().convert::<f32>().into_vec::<f32>().map_err(|e| HfError::GgufExport(format!("{name}: {e:?}")))
}

/// `values` of `shape` under GGUF name `name`, stored as `ty` stores a tensor of that shape.
fn stored(name: String, shape: Vec<usize>, values: &[f32], ty: ExportType) -> Result<TensorOut, HfError> {
    let kind = ty.ggml_type(&shape);
    let data = super::quant::quantize(kind, values).map_err(|e| HfError::GgufExport(format!("{name}: {e}")))?;
    Ok(TensorOut { name, shape, kind, data })
}

/// Hugging Face tensor `name` of layer `layer` as the two that llama.cpp splits it into.
fn split_tensor(
    split: &SplitTensor,
    layer: usize,
    name: &str,
    data: &TensorData,
    config: &ModelConfig,
    ty: ExportType,
) -> Result<[TensorOut; 2], HfError> {
    let shapes = (split.shapes)(config).ok_or_else(|| HfError::GgufExport(format!("{name} without [model.mla]")))?;
    let values = f32_values(name, data)?;
    let (a, b) = (split.split)(config, &values);
    let [sa, sb] = shapes;
    let part = |p: &str| format!("blk.{layer}.{p}.weight");
    Ok([stored(part(split.parts[0]), sa, &a, ty)?, stored(part(split.parts[1]), sb, &b, ty)?])
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
    let meta: BTreeMap<String, Value> =
        arch_metadata(config, arch, ExportType::F32.file_type(), "").into_iter().collect();
    let rms = |k: NormKind| k != NormKind::LayerNorm;
    if let Some(message) = (arch.gguf().refuses)(config) {
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

/// What an import kept of the source file's descriptive metadata (`carried_metadata` in `model.rs`), to be
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
    let mut values = f32_values(name, data)?;
    if transposed && shape.len() == 2 {
        values = transpose(&values, shape[0], shape[1]);
        shape.reverse();
    }
    if let Some(heads) = heads.permuted(arch, name, &shape) {
        values = permute_rows(&values, heads, shape[1], false);
    }
    if arch.gguf().squeezes(name) && shape.first() == Some(&1) {
        shape.remove(0); // Qwen2-MoE's `[1, D]` gate as llama.cpp's converter writes it, `[D]`
    }
    // The routers stay f32 whatever the type, as llama.cpp's quantizer keeps them: a rounded router
    // can pick other experts.
    let kind = if gname.contains("ffn_gate_inp") { GgmlType::F32 } else { ty.ggml_type(&shape) };
    let data = super::quant::quantize(kind, &values).map_err(|e| HfError::GgufExport(format!("{name}: {e}")))?;
    Ok(TensorOut { name: gname, shape, kind, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model of a shipped config (its `[model]` table; the vocabulary, which a run takes from
    /// its tokenizer, 65 as tinyshakespeare's characters where the table leaves it out).
    fn shipped_model(name: &str) -> ModelConfig {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs").join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        let mut table: toml::Table = text.parse().unwrap();
        let mut model = table.remove("model").unwrap_or_else(|| panic!("{name} has no [model]"));
        let model_table = model.as_table_mut().unwrap();
        model_table.entry("vocab_size").or_insert(toml::Value::Integer(65));
        model.try_into().unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// Issue 57: configs/deepseek-nano.toml's model exports to GGUF (its latents' epsilon was
    /// DeepSeek's 1e-6 and its blocks' nano's 1e-5, where llama.cpp's deepseek2 holds one).
    #[test]
    fn the_shipped_deepseek_config_exports_to_gguf() {
        let config = shipped_model("deepseek-nano.toml");
        let arch = Architecture::for_model(&config);
        assert_eq!(arch.family().gguf_arch, "deepseek2");
        expressible(&config, arch).unwrap_or_else(|e| panic!("deepseek-nano.toml: {e}"));
        // The two epsilons apart are what GGUF cannot hold: said, by name.
        let apart = ModelConfig { norm_eps: 1e-5, ..config };
        let e = expressible(&apart, arch).expect_err("two epsilons").to_string();
        assert!(e.contains("norm_eps"), "{e}");
    }
}
