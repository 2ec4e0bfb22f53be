//! The key table between Hugging Face tensor names and ember parameter paths, and reading and writing
//! (sharded) safetensors folders.
//!
//! | Hugging Face (`[out, in]`)                          | ember (`[in, out]`)                        |
//! |-----------------------------------------------------|--------------------------------------------|
//! | `model.embed_tokens.weight` `[V, D]`                | `embed_tokens` `[V, D]` (no transpose)     |
//! | `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`  | `layers.{i}.self_attn.{q,k,v,o}_proj.weight` (transposed) |
//! | `model.layers.{i}.self_attn.{q,k,v}_proj.bias`      | `layers.{i}.self_attn.{q,k,v}_proj.bias`   |
//! | `model.layers.{i}.mlp.{gate,up,down}_proj.weight`   | `layers.{i}.mlp.{gate,up,down}_proj.weight` (transposed) |
//! | `model.layers.{i}.{input,post_attention}_layernorm.weight` | same without `model.`               |
//! | `model.norm.weight`                                 | `norm.weight`                              |
//! | `lm_head.weight` `[V, D]` (absent when tied)         | `lm_head.weight` `[D, V]` (transposed)     |

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, TensorData};
use ember_kernels::rope::interleaved_to_half_split;
use ember_kernels::EmberBackend;
use ember_model::weights::{assign, named_tensors, named_tensors_where, param_shapes};
use ember_model::{Decoder, RopeLayout};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::config_map::{from_model_config, to_model_config, Architecture};
use crate::error::HfError;

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// The ember path of a Hugging Face tensor, and whether it is a linear weight to transpose.
pub fn hf_to_ember(key: &str) -> Option<(String, bool)> {
    if key == "lm_head.weight" {
        return Some((key.into(), true));
    }
    let rest = key.strip_prefix("model.")?;
    if rest == "embed_tokens.weight" {
        return Some(("embed_tokens".into(), false));
    }
    if rest.contains("rotary_emb") {
        return None;
    }
    Some((rest.into(), rest.ends_with("_proj.weight")))
}

/// The Hugging Face name of an ember parameter (the inverse of [`hf_to_ember`]).
pub fn ember_to_hf(path: &str) -> Option<(String, bool)> {
    match path {
        "embed_tokens" => Some(("model.embed_tokens.weight".into(), false)),
        "lm_head.weight" => Some((path.into(), true)),
        "norm.weight" => Some(("model.norm.weight".into(), false)),
        p if p.starts_with("layers.") && !ember_model::lora::is_adapter(p) => {
            Some((format!("model.{p}"), p.ends_with("_proj.weight")))
        }
        _ => None,
    }
}

/// Buffers some checkpoints carry that are not parameters.
fn ignorable(key: &str) -> bool {
    key.ends_with("rotary_emb.inv_freq")
}

/// A 2-D tensor transposed on the host, whatever its dtype.
fn transpose(data: TensorData) -> TensorData {
    let (rows, cols) = (data.shape[0], data.shape[1]);
    let size = data.dtype.size();
    let src = data.as_bytes();
    let mut out = vec![0u8; src.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (from, to) = ((r * cols + c) * size, (c * rows + r) * size);
            out[to..to + size].copy_from_slice(&src[from..from + size]);
        }
    }
    TensorData::from_bytes_vec(out, [cols, rows], data.dtype)
}

/// Every tensor of a model folder, by Hugging Face name, with the file it came from.
fn read_tensors(dir: &Path) -> Result<BTreeMap<String, (TensorData, PathBuf)>, HfError> {
    let index = dir.join(INDEX);
    let files: Vec<(PathBuf, Option<Vec<String>>)> = if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(HfError::io(&index))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| HfError::Config { source_name: index.display().to_string(), message: e.to_string() })?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or(HfError::MissingField { source_name: index.display().to_string(), field: "weight_map" })?;
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (key, file) in map {
            let file = file.as_str().unwrap_or_default().to_string();
            by_file.entry(file).or_default().push(key.clone());
        }
        let mut out = Vec::new();
        for (file, keys) in by_file {
            let path = dir.join(&file);
            if file.contains('/') || !path.is_file() {
                return Err(HfError::MissingShard { index: index.clone(), shard: file });
            }
            out.push((path, Some(keys)));
        }
        out
    } else if dir.join(SINGLE).is_file() {
        vec![(dir.join(SINGLE), None)]
    } else {
        return Err(HfError::NoWeights { dir: dir.into() });
    };
    let mut tensors = BTreeMap::new();
    for (path, keys) in files {
        let bytes = std::fs::read(&path).map_err(HfError::io(&path))?;
        let file = SafeTensors::deserialize(&bytes)
            .map_err(|e| HfError::Safetensors { file: path.clone(), message: e.to_string() })?;
        let names: Vec<String> = match keys {
            Some(k) => k,
            None => file.names().into_iter().map(String::from).collect(),
        };
        for name in names {
            let view =
                file.tensor(&name).map_err(|e| HfError::Safetensors { file: path.clone(), message: e.to_string() })?;
            let dtype = match view.dtype() {
                Dtype::F32 => DType::F32,
                Dtype::BF16 => DType::BF16,
                Dtype::F16 => DType::F16,
                Dtype::F64 => DType::F64,
                other => return Err(HfError::Dtype { file: path.clone(), key: name, dtype: format!("{other:?}") }),
            };
            let data = TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype);
            tensors.insert(name, (data, path.clone()));
        }
    }
    Ok(tensors)
}

/// A model read from a Hugging Face folder.
pub struct Imported<B: EmberBackend> {
    pub model: Decoder<B>,
    pub architecture: Architecture,
    /// The folder's config.json, kept so that an export can carry its other fields.
    pub hf_config: Value,
    /// Parameters loaded.
    pub loaded: usize,
    /// Parameters the folder lacked (left at zero; only with `allow_missing`).
    pub missing: Vec<String>,
    /// Tensors that match no parameter (skipped; only with `allow_unused`).
    pub unused: Vec<String>,
}

/// Reads `dir` (config.json and model.safetensors, or shards with an index) into a decoder whose
/// parameters are stored in `param_dtype` (the file's bf16/f16 values are converted). Every shape is
/// checked first; missing and unused tensors are errors unless allowed.
pub fn import<B: EmberBackend>(
    dir: &Path,
    param_dtype: DType,
    allow_missing: bool,
    allow_unused: bool,
    device: &Device<B>,
) -> Result<Imported<B>, HfError> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(HfError::io(&config_path))?;
    let hf_config: Value = serde_json::from_str(&text)
        .map_err(|e| HfError::Config { source_name: config_path.display().to_string(), message: e.to_string() })?;
    // The tensors are read first (their size is the files'), so that a config describing far more
    // than they hold is refused before the model is allocated.
    let tensors = read_tensors(dir)?;
    import_tensors(hf_config, &config_path, dir, tensors, param_dtype, allow_missing, allow_unused, device)
}

/// [`import`] of tensors already read (by Hugging Face name, with the file each came from), under
/// the config `hf_config` read from `config_path`; `dir` names the source in messages.
#[allow(clippy::too_many_arguments)]
pub fn import_tensors<B: EmberBackend>(
    hf_config: Value,
    config_path: &Path,
    dir: &Path,
    tensors: BTreeMap<String, (TensorData, PathBuf)>,
    param_dtype: DType,
    allow_missing: bool,
    allow_unused: bool,
    device: &Device<B>,
) -> Result<Imported<B>, HfError> {
    let (config, architecture) = to_model_config(&hf_config, &config_path.display().to_string())?;
    if !allow_missing {
        let bytes = tensors.values().fold(0u64, |n, (t, _)| n.saturating_add(t.as_bytes().len() as u64));
        ember_model::weights::check_model_size(&config, &format!("the weights of {}", dir.display()), bytes)
            .map_err(|message| HfError::Config { source_name: config_path.display().to_string(), message })?;
    }
    let model = Decoder::<B>::empty(&config, device)
        .map_err(|e| HfError::Config { source_name: config_path.display().to_string(), message: e.to_string() })?;
    let expected: HashMap<String, Vec<usize>> = param_shapes::<B, _>(&model).into_iter().collect();

    let mut values = BTreeMap::new();
    let mut unused = Vec::new();
    for (key, (data, file)) in tensors {
        let Some((path, transposed)) = hf_to_ember(&key).filter(|(p, _)| expected.contains_key(p)) else {
            if !ignorable(&key) {
                unused.push(key);
            }
            continue;
        };
        let want = &expected[&path];
        let want_hf: Vec<usize> = if transposed { want.iter().rev().copied().collect() } else { want.clone() };
        if data.shape.as_slice() != want_hf.as_slice() {
            return Err(HfError::Shape { file, key, expected: want_hf, found: data.shape.to_vec() });
        }
        values.insert(path, if transposed { transpose(data) } else { data });
    }
    let mut missing: Vec<String> = expected.keys().filter(|k| !values.contains_key(*k)).cloned().collect();
    missing.sort();
    if !missing.is_empty() && !allow_missing {
        let keys = missing.iter().map(|k| ember_to_hf(k).map_or(k.clone(), |(h, _)| h)).collect();
        return Err(HfError::Missing { dir: dir.into(), keys });
    }
    if !unused.is_empty() && !allow_unused {
        return Err(HfError::Unused { dir: dir.into(), keys: unused });
    }
    let loaded = values.len();
    let model = model.with_param_dtype(param_dtype);
    // Missing parameters (allowed) keep their zeros: fill them in from the model itself (only
    // those are read back).
    let mut values = values;
    if !missing.is_empty() {
        for (k, data) in named_tensors_where::<B, _, _>(&model, |k| !values.contains_key(k)) {
            values.insert(k, data);
        }
    }
    let model = assign(model, values, &dir.display().to_string(), false)
        .map_err(|e| HfError::Config { source_name: dir.display().to_string(), message: e.to_string() })?;
    tracing::info!(loaded, missing = missing.len(), unused = unused.len(), "imported {}", dir.display());
    Ok(Imported { model, architecture, hf_config, loaded, missing, unused })
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExportReport {
    pub architecture: Architecture,
    pub files: Vec<PathBuf>,
    pub tensors: usize,
    pub bytes: u64,
}

/// Writes `model` as a Hugging Face folder: config.json (on top of `base_config`, the imported
/// model's, when there is one) and model.safetensors, or shards of at most `max_shard_bytes` with an
/// index. An interleaved-RoPE model gets its q/k columns permuted into the half-split layout that
/// Hugging Face's code assumes. `extra_files` (the tokenizer's) are copied in under their own
/// names. The folder is written beside `out` and renamed into place once complete (removed on an
/// error); an existing non-empty `out` is an error.
pub fn export<B: EmberBackend>(
    model: &Decoder<B>,
    base_config: Option<&Value>,
    out: &Path,
    max_shard_bytes: u64,
    extra_files: &[PathBuf],
) -> Result<ExportReport, HfError> {
    if out.exists() && std::fs::read_dir(out).map_err(HfError::io(out))?.next().is_some() {
        return Err(HfError::OutputExists(out.into()));
    }
    let config = model.config();
    let arch = base_config
        .and_then(|v| Architecture::from_class(v.get("architectures")?.get(0)?.as_str()?))
        .unwrap_or_else(|| Architecture::for_model(config));
    let tensors = hf_tensors(model)?;
    let mut hf_config = from_model_config(config, arch, base_config);
    hf_config["dtype"] = json!(match tensors.first().map(|(_, d)| d.dtype) {
        Some(DType::BF16) => "bfloat16",
        Some(DType::F16) => "float16",
        _ => "float32",
    });

    // Shards: tensors in order, a new file when the next one would pass the limit.
    let mut shards: Vec<Vec<(String, TensorData)>> = vec![Vec::new()];
    let mut size = 0u64;
    for (k, d) in tensors {
        let n = d.as_bytes().len() as u64;
        if size > 0 && size + n > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        shards.last_mut().expect("one shard").push((k, d));
    }
    let tmp = out.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(HfError::io(&tmp))?;
    let written = write_folder(&tmp, out, &shards, &hf_config, extra_files);
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let (files, total, count) = written?;
    if out.exists() {
        std::fs::remove_dir(out).map_err(HfError::io(out))?; // empty, checked above
    }
    std::fs::rename(&tmp, out).map_err(HfError::io(out))?;
    Ok(ExportReport { architecture: arch, files, tensors: count, bytes: total })
}

/// Every parameter of `model` under its Hugging Face name, in Hugging Face's `[out, in]` layout
/// (and half-split RoPE order for an interleaved-RoPE model).
pub fn hf_tensors<B: EmberBackend>(model: &Decoder<B>) -> Result<Vec<(String, TensorData)>, HfError> {
    let config = model.config();
    let interleaved = config.rope_layout == RopeLayout::Interleaved;
    let mut tensors: Vec<(String, TensorData)> = Vec::new();
    for (path, data) in named_tensors::<B, _>(model) {
        let (key, transposed) = ember_to_hf(&path).ok_or_else(|| HfError::NoHfName(path.clone()))?;
        let data = if interleaved && (path.contains("q_proj") || path.contains("k_proj")) {
            let heads = if path.contains("q_proj") { config.n_heads } else { config.n_kv_heads() };
            permute_rope(data, heads, model)
        } else {
            data
        };
        tensors.push((key, if transposed { transpose(data) } else { data }));
    }
    Ok(tensors)
}

/// The files of an exported folder, written into `tmp`: the weight shards (with an index when
/// there are several), config.json and copies of `extra_files`. Returns the files' paths under
/// `out`, the weights' bytes and the number of tensors.
fn write_folder(
    tmp: &Path,
    out: &Path,
    shards: &[Vec<(String, TensorData)>],
    hf_config: &Value,
    extra_files: &[PathBuf],
) -> Result<(Vec<PathBuf>, u64, usize), HfError> {
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let n = shards.len();
    let (mut files, mut weight_map, mut total, mut count) = (Vec::new(), serde_json::Map::new(), 0u64, 0usize);
    for (i, shard) in shards.iter().enumerate() {
        let name = if n == 1 { SINGLE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        for (k, d) in shard {
            weight_map.insert(k.clone(), json!(name));
            total += d.as_bytes().len() as u64;
            count += 1;
        }
        let bytes = ember_model::weights::to_safetensors(shard, meta.clone());
        std::fs::write(tmp.join(&name), bytes).map_err(HfError::io(tmp.join(&name)))?;
        files.push(out.join(&name));
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let text = serde_json::to_string_pretty(&index).expect("index serialises");
        std::fs::write(tmp.join(INDEX), text).map_err(HfError::io(tmp.join(INDEX)))?;
        files.push(out.join(INDEX));
    }
    let text = serde_json::to_string_pretty(hf_config).expect("config serialises");
    std::fs::write(tmp.join("config.json"), text).map_err(HfError::io(tmp.join("config.json")))?;
    files.push(out.join("config.json"));
    for src in extra_files {
        let Some(name) = src.file_name() else {
            let err = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file");
            return Err(HfError::Io { path: src.clone(), err });
        };
        std::fs::copy(src, tmp.join(name)).map_err(HfError::io(src))?;
        files.push(out.join(name));
    }
    Ok((files, total, count))
}

/// q/k projection columns (ember layout `[in, heads·Dh]`, or a bias `[heads·Dh]`) from interleaved
/// to half-split RoPE pairs.
fn permute_rope<B: EmberBackend>(data: TensorData, heads: usize, model: &Decoder<B>) -> TensorData {
    let device = model.embed_tokens.device();
    let dtype = data.dtype;
    let shape = data.shape.to_vec();
    let (rows, cols) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
    let flat = TensorData::from_bytes_vec(data.as_bytes().to_vec(), [rows, cols], dtype).convert_dtype(DType::F32);
    let w = burn::tensor::Tensor::<B, 2>::from_data(flat, &device);
    let p = interleaved_to_half_split(w, heads).into_data().convert_dtype(dtype);
    TensorData::from_bytes_vec(p.as_bytes().to_vec(), shape, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_table_round_trips() {
        for (hf, ember, t) in [
            ("model.embed_tokens.weight", "embed_tokens", false),
            ("model.layers.3.self_attn.q_proj.weight", "layers.3.self_attn.q_proj.weight", true),
            ("model.layers.3.self_attn.k_proj.bias", "layers.3.self_attn.k_proj.bias", false),
            ("model.layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight", true),
            ("model.layers.0.post_attention_layernorm.weight", "layers.0.post_attention_layernorm.weight", false),
            ("model.norm.weight", "norm.weight", false),
            ("lm_head.weight", "lm_head.weight", true),
        ] {
            assert_eq!(hf_to_ember(hf), Some((ember.to_string(), t)), "{hf}");
            assert_eq!(ember_to_hf(ember), Some((hf.to_string(), t)), "{ember}");
        }
        assert_eq!(hf_to_ember("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
    }

    #[test]
    fn host_transpose_works_for_any_dtype() {
        let d = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]);
        let t = transpose(d);
        assert_eq!(t.shape.to_vec(), vec![3, 2]);
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let h = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [3, 2]).convert_dtype(DType::BF16);
        let back = transpose(transpose(h.clone()));
        assert_eq!(back.as_bytes(), h.as_bytes());
    }
}
