//! Reading and writing (sharded) safetensors folders, the tensors renamed and laid out by the
//! family table ([`crate::family`]): Hugging Face's linear weights are `[out, in]` and ember's `[in,
//! out]`; GPT-2's `Conv1D` weights are `[in, out]` already, and its `c_attn` holds q, k and v side
//! by side.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, TensorData};
use ember_kernels::rope::interleaved_to_half_split;
use ember_kernels::EmberBackend;
use ember_kernels::QuantWeight;
use ember_model::weights::{assign_as, named_tensors, named_tensors_where, param_shapes};
use ember_model::{Decoder, NormKind, Positions, RopeLayout};
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::config_map::{expressible, from_model_config, to_model_config};
use crate::error::HfError;
use crate::family::Architecture;
use crate::family::{Family, Layout};

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

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

/// A tensor cut along its last axis into pieces `widths` wide (GPT-2's `c_attn` into q, k, v).
fn split_last(data: &TensorData, widths: &[usize]) -> Vec<TensorData> {
    let shape = data.shape.to_vec();
    let (last, size) = (shape.last().copied().unwrap_or(1), data.dtype.size());
    let rows = shape.iter().product::<usize>() / last.max(1);
    let src = data.as_bytes();
    let mut out: Vec<Vec<u8>> = widths.iter().map(|w| Vec::with_capacity(rows * w * size)).collect();
    for r in 0..rows {
        let mut at = r * last;
        for (piece, &w) in out.iter_mut().zip(widths) {
            piece.extend_from_slice(&src[at * size..(at + w) * size]);
            at += w;
        }
    }
    out.into_iter()
        .zip(widths)
        .map(|(bytes, &w)| {
            let mut s = shape.clone();
            *s.last_mut().expect("a tensor of rank >= 1") = w;
            TensorData::from_bytes_vec(bytes, s, data.dtype)
        })
        .collect()
}

/// Tensors of one shape but the last axis, side by side along it (the inverse of [`split_last`]).
fn concat_last(parts: &[TensorData]) -> TensorData {
    let shape = parts[0].shape.to_vec();
    let size = parts[0].dtype.size();
    let widths: Vec<usize> = parts.iter().map(|p| p.shape.last().copied().unwrap_or(1)).collect();
    let rows = shape.iter().product::<usize>() / widths[0].max(1);
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.as_bytes().len()).sum());
    for r in 0..rows {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p.as_bytes()[r * w * size..(r + 1) * w * size]);
        }
    }
    let mut s = shape;
    *s.last_mut().expect("a tensor of rank >= 1") = widths.iter().sum();
    TensorData::from_bytes_vec(out, s, parts[0].dtype)
}

/// Slice `j` of a stack `[E, a, b]`, transposed: expert `j`'s `[b, a]` file tensor.
fn unstack_transposed(data: &TensorData, j: usize) -> TensorData {
    let (a, b) = (data.shape[1], data.shape[2]);
    let size = data.dtype.size() * a * b;
    let bytes = data.as_bytes()[j * size..(j + 1) * size].to_vec();
    transpose(TensorData::from_bytes_vec(bytes, [a, b], data.dtype))
}

/// Experts' `[b, a]` file tensors (each present, one shape and dtype), transposed and stacked into
/// `[E, a, b]`.
fn stack_transposed(parts: Vec<TensorData>) -> TensorData {
    let (dtype, e) = (parts[0].dtype, parts.len());
    let (b, a) = (parts[0].shape[0], parts[0].shape[1]);
    let mut out = Vec::with_capacity(e * a * b * dtype.size());
    for p in parts {
        out.extend_from_slice(transpose(p).as_bytes());
    }
    TensorData::from_bytes_vec(out, [e, a, b], dtype)
}

/// The shape a file tensor of `layout` holding ember tensors of `shapes` has; `None` when they
/// cannot sit side by side.
fn hf_shape(shapes: &[&Vec<usize>], layout: Layout) -> Option<Vec<usize>> {
    match layout {
        Layout::AsIs | Layout::Gain => Some(shapes[0].clone()),
        Layout::Transposed => Some(shapes[0].iter().rev().copied().collect()),
        // One expert's: a slice of the stack, transposed.
        Layout::Experts => Some(shapes[0].iter().skip(1).rev().copied().collect()),
        Layout::Fused => {
            let (_, lead) = shapes[0].split_last()?;
            let mut width = 0;
            for s in shapes {
                let (last, l) = s.split_last()?;
                if l != lead {
                    return None;
                }
                width += last;
            }
            Some([lead, &[width][..]].concat())
        }
    }
}

/// Every tensor of a model folder, by Hugging Face name, with the file it came from.
fn read_tensors(dir: &Path) -> Result<BTreeMap<String, (TensorData, PathBuf)>, HfError> {
    let index = dir.join(INDEX);
    // `exists`, not `is_file`: a FIFO or a folder in a file's place is named for what it is.
    let files: Vec<(PathBuf, Option<Vec<String>>)> = if index.exists() {
        let text = ember_data::read_file_to_string(&index).map_err(HfError::io(&index))?;
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
            if file.contains('/') || !path.exists() {
                return Err(HfError::MissingShard { index: index.clone(), shard: file });
            }
            out.push((path, Some(keys)));
        }
        out
    } else if dir.join(SINGLE).exists() {
        vec![(dir.join(SINGLE), None)]
    } else {
        return Err(HfError::NoWeights { dir: dir.into() });
    };
    let mut tensors = BTreeMap::new();
    for (path, keys) in files {
        let bytes = ember_data::FileBytes::open(&path).map_err(HfError::io(&path))?;
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
            // Copied: the file's pages of it are let go (the file and its copy not held at once).
            bytes.release_bytes(view.data());
            ember_model::weights::warn_non_finite(&path.display().to_string(), &name, &data);
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
    let text = ember_data::read_file_to_string(&config_path).map_err(HfError::io(&config_path))?;
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
    let load = Load {
        config,
        architecture,
        hf_config,
        config_path,
        dir,
        param_dtype,
        allow_missing,
        allow_unused,
        quantized: BTreeMap::new(),
    };
    load_tensors(load, tensors, device)
}

/// What [`load_tensors`] builds: a model of `config` (a GGUF file's, whose Gemma norms keep their
/// gains as the file stores them) of the family `architecture`, with the config.json `hf_config`
/// read from `config_path`; `dir` names the source in messages. `quantized`: projection weights
/// kept in their stored types (by Hugging Face name).
pub(crate) struct Load<'a> {
    pub config: ember_model::ModelConfig,
    pub architecture: Architecture,
    pub hf_config: Value,
    pub config_path: &'a Path,
    pub dir: &'a Path,
    pub param_dtype: DType,
    pub allow_missing: bool,
    pub allow_unused: bool,
    pub quantized: BTreeMap<String, QuantWeight>,
}

/// [`import_tensors`] into the model `load` describes.
pub(crate) fn load_tensors<B: EmberBackend>(
    load: Load,
    tensors: BTreeMap<String, (TensorData, PathBuf)>,
    device: &Device<B>,
) -> Result<Imported<B>, HfError> {
    let (config_path, dir) = (load.config_path, load.dir);
    let bad = |message: String| HfError::Config { source_name: config_path.display().to_string(), message };
    // Checked before the model is allocated, `allow_missing` or not: a tensor left at zero is a
    // gap in a model, never most of one (the check asks a byte of file per parameter, half of what
    // bf16 weights hold), so a config describing far more than its files is refused here, not by
    // an allocation that fails.
    let bytes = tensors.values().fold(0u64, |n, (t, _)| n.saturating_add(t.as_bytes().len() as u64));
    // A kept weight counts as the f32 values it stands for (the check's unit).
    let kept = load.quantized.values().map(|q| (q.d_in() * q.d_out() * 4) as u64).sum::<u64>();
    let bytes = bytes.saturating_add(kept);
    ember_model::weights::check_model_size(&load.config, &format!("the weights of {}", dir.display()), bytes).map_err(
        |e| match (load.allow_missing, e) {
            (true, e @ ember_model::weights::SizeError::LargerThanFiles { .. }) => {
                bad(format!("{e} (--allow-missing keeps a few missing tensors at zero, not most of a model)"))
            }
            (_, e) => bad(e.to_string()),
        },
    )?;
    let family = load.architecture.family();
    // Projections kept quantized have no parameter from the start (their f32 zeros never exist):
    // nothing of theirs is expected.
    let kept = load.quantized.len();
    let model = Decoder::<B>::empty_keeping(&load.config, device, kept_paths(family, load.quantized, dir)?)
        .map_err(|e| bad(e.to_string()))?;
    let expected: HashMap<String, Vec<usize>> = param_shapes::<B, _>(&model).into_iter().collect();
    let Placed { mut values, unused } = place(family, tensors, &expected, dir)?;
    let mut missing: Vec<String> = expected.keys().filter(|k| !values.contains_key(*k)).cloned().collect();
    missing.sort();
    if !missing.is_empty() && !load.allow_missing {
        // A fused tensor is named once for all its parts.
        let mut seen = HashSet::new();
        let keys = missing
            .iter()
            .map(|k| family.ember_to_hf(k).map_or(k.clone(), |h| h.name))
            .filter(|k| seen.insert(k.clone()))
            .collect();
        return Err(HfError::Missing { dir: dir.into(), keys });
    }
    if !unused.is_empty() && !load.allow_unused {
        return Err(HfError::Unused { dir: dir.into(), keys: unused });
    }
    let loaded = values.len() + kept;
    let model = model.with_param_dtype(load.param_dtype);
    // Missing parameters (allowed) keep their zeros: fill them in from the model itself (only
    // those are read back).
    if !missing.is_empty() {
        for (k, data) in named_tensors_where::<B, _, _>(&model, |k| !values.contains_key(k)) {
            values.insert(k, data);
        }
    }
    let model = assign_as(model, values, &dir.display().to_string(), false, Some(load.param_dtype))
        .map_err(|e| HfError::Config { source_name: dir.display().to_string(), message: e.to_string() })?;
    tracing::info!(loaded, missing = missing.len(), unused = unused.len(), "imported {}", dir.display());
    let (architecture, hf_config) = (load.architecture, load.hf_config);
    Ok(Imported { model, architecture, hf_config, loaded, missing, unused })
}

/// The file's tensors in ember's layout by parameter path, and the names that match no parameter.
struct Placed {
    values: BTreeMap<String, TensorData>,
    unused: Vec<String>,
}

/// Each file tensor in its parameter(s) of `expected` (path -> shape), its shape checked: moved as
/// the family's rule says, experts' stacked once every expert of a stack is read.
fn place(
    family: &Family,
    tensors: BTreeMap<String, (TensorData, PathBuf)>,
    expected: &HashMap<String, Vec<usize>>,
    dir: &Path,
) -> Result<Placed, HfError> {
    let mut values = BTreeMap::new();
    // Experts' tensors by stack, each in its slot until the stack is whole.
    let mut stacks: BTreeMap<String, Vec<Option<TensorData>>> = BTreeMap::new();
    let mut unused = Vec::new();
    for (key, (data, file)) in tensors {
        let to = family.hf_to_ember(&key).filter(|t| t.paths.iter().all(|p| expected.contains_key(p)));
        let Some(to) = to else {
            if !family.is_buffer(&key) {
                unused.push(key);
            }
            continue;
        };
        let shapes: Vec<&Vec<usize>> = to.paths.iter().map(|p| &expected[p]).collect();
        let want_hf = hf_shape(&shapes, to.layout).unwrap_or_default();
        if data.shape.as_slice() != want_hf.as_slice() {
            return Err(HfError::Shape { file, key, expected: want_hf, found: data.shape.to_vec() });
        }
        match to.layout {
            Layout::AsIs | Layout::Gain => drop(values.insert(to.paths[0].clone(), data)),
            Layout::Transposed => drop(values.insert(to.paths[0].clone(), transpose(data))),
            Layout::Fused => {
                let widths: Vec<usize> = shapes.iter().map(|s| s.last().copied().unwrap_or(0)).collect();
                values.extend(to.paths.into_iter().zip(split_last(&data, &widths)));
            }
            Layout::Experts => {
                let n = shapes[0].first().copied().unwrap_or(0);
                match to.expert.filter(|&j| j < n) {
                    Some(j) => stacks.entry(to.paths[0].clone()).or_insert_with(|| vec![None; n])[j] = Some(data),
                    None => unused.push(key), // an expert past the config's count
                }
            }
        }
    }
    for (path, slots) in stacks {
        let dtypes: HashSet<DType> = slots.iter().flatten().map(|d| d.dtype).collect();
        if dtypes.len() > 1 {
            let message = format!("the experts of `{path}` are stored in different dtypes");
            return Err(HfError::Config { source_name: dir.display().to_string(), message });
        }
        // A stack missing an expert is left out: reported with the missing tensors.
        if let Some(parts) = slots.into_iter().collect::<Option<Vec<_>>>() {
            values.insert(path, stack_transposed(parts));
        }
    }
    Ok(Placed { values, unused })
}

/// The weights kept quantized (by Hugging Face name) under the paths of their projections.
fn kept_paths(
    family: &Family,
    quantized: BTreeMap<String, QuantWeight>,
    dir: &Path,
) -> Result<Vec<(String, QuantWeight)>, HfError> {
    let mut by_path = Vec::with_capacity(quantized.len());
    for (hf, weight) in quantized {
        let Some(path) = family.hf_to_ember(&hf).and_then(|t| t.paths.into_iter().next()) else {
            return Err(HfError::Unused { dir: dir.into(), keys: vec![hf] });
        };
        by_path.push((path.trim_end_matches(".weight").to_string(), weight));
    }
    Ok(by_path)
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
    expressible(config, arch)?;
    let tensors = hf_tensors(model, arch)?;
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

/// Every parameter of `model` under its Hugging Face name as `arch` names it, in that family's
/// layout (transposed, or fused), and in the half-split RoPE order for an interleaved-RoPE model.
pub fn hf_tensors<B: EmberBackend>(
    model: &Decoder<B>,
    arch: Architecture,
) -> Result<Vec<(String, TensorData)>, HfError> {
    named_hf_tensors(model, arch, arch.family().parts.norm)
}

/// [`hf_tensors`] with RMSNorm gains stored as `gains` says (GGUF: [`NormKind::RmsNorm`], the
/// factor itself), converted where the model keeps them the other way.
pub(crate) fn named_hf_tensors<B: EmberBackend>(
    model: &Decoder<B>,
    arch: Architecture,
    gains: NormKind,
) -> Result<Vec<(String, TensorData)>, HfError> {
    let config = model.config();
    let family = arch.family();
    // Latent attention's rotary columns stay interleaved (DeepSeek's files keep them so).
    let interleaved =
        config.rope_layout == RopeLayout::Interleaved && config.positions == Positions::Rope && config.mla.is_none();
    // +1 for a gain kept as `g − 1` written as `g`, −1 the other way, 0 for none.
    let shift = match (config.norm, gains) {
        (NormKind::RmsNormPlusOne, NormKind::RmsNorm) => 1.0,
        (NormKind::RmsNorm, NormKind::RmsNormPlusOne) => -1.0,
        _ => 0.0,
    };
    let mut named: Vec<(String, Option<TensorData>)> = Vec::new();
    for (path, data) in named_tensors::<B, _>(model) {
        // q/k columns (and the per-head q/k norm gains) move to the half-split pairs.
        let heads = |p: &str| match p.rsplit('.').nth(1) {
            Some("q_proj") => Some(config.n_heads),
            Some("k_proj") => Some(config.n_kv_heads()),
            Some("q_norm" | "k_norm") => Some(1),
            _ => None,
        };
        let data = match heads(&path).filter(|_| interleaved) {
            Some(h) => permute_rope(data, h, model),
            None => data,
        };
        let is_gain = family.ember_to_hf(&path).is_some_and(|to| to.layout == Layout::Gain);
        let data = if is_gain && shift != 0.0 { shift_values(data, shift) } else { data };
        named.push((path, Some(data)));
    }
    let index: HashMap<String, usize> = named.iter().enumerate().map(|(i, (p, _))| (p.clone(), i)).collect();
    let mut tensors: Vec<(String, TensorData)> = Vec::new();
    for i in 0..named.len() {
        let path = named[i].0.clone();
        let mut to = family.ember_to_hf(&path).ok_or_else(|| HfError::NoHfName(path.clone()))?;
        to.name = (family.export_name)(config, to.name);
        let parts: Vec<usize> = to.paths.iter().filter_map(|p| index.get(p).copied()).collect();
        if parts.len() != to.paths.len() {
            let fields = vec![format!("`{}` holds {}, and the model lacks some", to.name, to.paths.join(", "))];
            return Err(HfError::Inexpressible { architecture: arch.class_name().into(), fields });
        }
        if to.part != 0 {
            continue; // written with the first part
        }
        let mut take = |j: usize| named[j].1.take().expect("each parameter is written once");
        let data = match to.layout {
            Layout::AsIs | Layout::Gain => take(i),
            Layout::Transposed => transpose(take(i)),
            Layout::Experts => {
                let stack = take(i);
                for j in 0..stack.shape.first().copied().unwrap_or(0) {
                    tensors.push((crate::family::fill_expert(&to.name, j), unstack_transposed(&stack, j)));
                }
                continue;
            }
            Layout::Fused => {
                let parts: Vec<TensorData> = parts.into_iter().map(take).collect();
                if parts.iter().any(|p| p.dtype != parts[0].dtype || p.shape.is_empty()) {
                    let fields = vec![format!("the parts of `{}` differ in dtype", to.name)];
                    return Err(HfError::Inexpressible { architecture: arch.class_name().into(), fields });
                }
                concat_last(&parts)
            }
        };
        tensors.push((to.name, data));
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

/// `data + shift`, computed in f32 and stored in `data`'s dtype (a norm gain between `g` and
/// `g − 1`).
fn shift_values(data: TensorData, shift: f32) -> TensorData {
    let dtype = data.dtype;
    let shape = data.shape.to_vec();
    let values: Vec<f32> = data.convert_dtype(DType::F32).to_vec::<f32>().expect("f32 after conversion");
    let shifted: Vec<f32> = values.into_iter().map(|v| v + shift).collect();
    TensorData::new(shifted, shape).convert_dtype(dtype)
}

/// q/k projection columns (ember layout `[in, heads·Dh]`, or a bias `[heads·Dh]`) from interleaved
/// to half-split RoPE pairs.
fn permute_rope<B: EmberBackend>(data: TensorData, heads: usize, model: &Decoder<B>) -> TensorData {
    let device = model.device();
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
    use crate::families::llama::LLAMA;

    #[test]
    fn llama_key_table_is_as_before() {
        let llama = LLAMA.architecture().family();
        let (as_is, t, gain) = (Layout::AsIs, Layout::Transposed, Layout::Gain);
        for (hf, ember, layout) in [
            ("model.embed_tokens.weight", "embed_tokens", as_is),
            ("model.layers.3.self_attn.q_proj.weight", "layers.3.self_attn.q_proj.weight", t),
            ("model.layers.3.self_attn.k_proj.bias", "layers.3.self_attn.k_proj.bias", as_is),
            ("model.layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight", t),
            ("model.layers.0.post_attention_layernorm.weight", "layers.0.post_attention_layernorm.weight", gain),
            ("model.norm.weight", "norm.weight", gain),
            ("lm_head.weight", "lm_head.weight", t),
        ] {
            let to = llama.hf_to_ember(hf).unwrap();
            assert_eq!((to.paths, to.layout), (vec![ember.to_string()], layout), "{hf}");
            let back = llama.ember_to_hf(ember).unwrap();
            assert_eq!((back.name.as_str(), back.layout), (hf, layout), "{ember}");
        }
        assert_eq!(llama.hf_to_ember("model.layers.0.self_attn.rotary_emb.inv_freq"), None);
    }

    #[test]
    fn fused_tensors_split_and_join_on_the_last_axis() {
        // [2, 5] = [2, 2] | [2, 1] | [2, 2], in bf16 (any dtype: bytes move).
        let d = TensorData::new((0..10).map(|x| x as f32).collect::<Vec<_>>(), [2, 5]).convert_dtype(DType::BF16);
        let parts = split_last(&d, &[2, 1, 2]);
        let f32s = |t: &TensorData| t.clone().convert_dtype(DType::F32).to_vec::<f32>().unwrap();
        assert_eq!(
            parts.iter().map(f32s).collect::<Vec<_>>(),
            [vec![0., 1., 5., 6.], vec![2., 7.], vec![3., 4., 8., 9.]]
        );
        assert_eq!(parts[1].shape.to_vec(), vec![2, 1]);
        assert_eq!(concat_last(&parts).as_bytes(), d.as_bytes());
        let bias = TensorData::new(vec![1.0f32, 2.0, 3.0], [3]);
        let split = split_last(&bias, &[1, 1, 1]);
        assert_eq!(concat_last(&split).as_bytes(), bias.as_bytes());
        assert_eq!(hf_shape(&[&vec![4, 2], &vec![4, 1]], Layout::Fused), Some(vec![4, 3]));
        assert_eq!(hf_shape(&[&vec![4, 2], &vec![3, 1]], Layout::Fused), None);
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
