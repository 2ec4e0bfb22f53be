//! A GGUF model as a Hugging Face one: the architecture's metadata as a `config.json`, the tensors
//! under their Hugging Face names in `[out, in]` layout, dequantized to f32 — and back.
//!
//! | GGUF                     | Hugging Face                                        |
//! |--------------------------|-----------------------------------------------------|
//! | `token_embd.weight`      | `model.embed_tokens.weight`                         |
//! | `blk.{i}.attn_norm.weight` | `model.layers.{i}.input_layernorm.weight`         |
//! | `blk.{i}.attn_{q,k,v}.{weight,bias}`, `attn_output.weight` | `…self_attn.{q,k,v,o}_proj…` |
//! | `blk.{i}.ffn_norm.weight` | `model.layers.{i}.post_attention_layernorm.weight` |
//! | `blk.{i}.ffn_{gate,up,down}.weight` | `model.layers.{i}.mlp.{gate,up,down}_proj.weight` |
//! | `output_norm.weight`     | `model.norm.weight`                                 |
//! | `output.weight` (absent when tied) | `lm_head.weight`                          |
//!
//! llama.cpp's converter reorders the rows of a Llama model's q and k projections so that each
//! head's rotary pairs sit next to each other (its RoPE rotates adjacent pairs); Hugging Face pairs
//! channel `i` with `i + Dh/2`. Import undoes that permutation, export applies it. Qwen2 files are
//! stored in the Hugging Face layout already.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use serde_json::{json, Value as Json};

use super::{GgmlType, GgufError, GgufFile, TensorOut, Value};

/// The architectures ember maps, by `general.architecture`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Qwen2,
}

impl GgufArch {
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
        }
    }

    fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// The architecture a Hugging Face class exports as (Mistral is a Llama to llama.cpp).
    fn from_hf_class(class: &str) -> Option<Self> {
        match class {
            "LlamaForCausalLM" | "MistralForCausalLM" => Some(Self::Llama),
            "Qwen2ForCausalLM" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// Whether llama.cpp permutes the q/k rows of this architecture.
    fn permutes_qk(self) -> bool {
        self == Self::Llama
    }
}

/// A GGUF model read as a Hugging Face one.
pub struct GgufModel {
    pub arch: GgufArch,
    /// A `config.json` for the model (with the GGUF facts export needs under `"gguf"`).
    pub hf_config: Json,
    /// Hugging Face name -> f32 tensor in `[out, in]` layout.
    pub tensors: BTreeMap<String, TensorData>,
    /// `tokenizer.json` rebuilt from the metadata.
    pub tokenizer_json: String,
    /// `tokenizer_config.json`: chat template, BOS and EOS.
    pub tokenizer_config: Json,
    /// (name, type) of every tensor as stored, for reports.
    pub stored: Vec<(String, &'static str)>,
}

/// GGUF name -> Hugging Face name of the tensors outside the layers.
const MODEL_NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// GGUF name -> Hugging Face name of a layer's tensors, after `blk.{i}.` / `model.layers.{i}.`.
const LAYER_NAMES: [(&str, &str); 12] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// The Hugging Face name of a GGUF tensor.
pub fn gguf_to_hf(name: &str) -> Option<String> {
    if let Some((_, hf)) = MODEL_NAMES.iter().find(|(g, _)| *g == name) {
        return Some(hf.to_string());
    }
    let (layer, part) = name.strip_prefix("blk.")?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == part)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The GGUF name of a Hugging Face tensor (the inverse of [`gguf_to_hf`]).
pub fn hf_to_gguf(name: &str) -> Option<String> {
    if let Some((g, _)) = MODEL_NAMES.iter().find(|(_, hf)| *hf == name) {
        return Some(g.to_string());
    }
    let (layer, part) = name.strip_prefix("model.layers.")?.split_once('.')?;
    let (g, _) = LAYER_NAMES.iter().find(|(_, hf)| *hf == part)?;
    Some(format!("blk.{layer}.{g}"))
}

/// Query and key/value heads: what the q/k row permutation needs.
#[derive(Debug, Clone, Copy)]
struct Heads {
    q: u64,
    kv: u64,
}

impl Heads {
    /// The heads whose rows llama.cpp reorders in tensor `hf_name` of `shape`: those of a q or k
    /// projection matrix of an architecture it permutes; `None` for every other tensor.
    fn permuted(self, arch: GgufArch, hf_name: &str, shape: &[usize]) -> Option<usize> {
        let is_q = hf_name.ends_with("q_proj.weight");
        let is_qk = is_q || hf_name.ends_with("k_proj.weight");
        (arch.permutes_qk() && shape.len() == 2 && is_qk).then_some(if is_q { self.q } else { self.kv } as usize)
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
    let f = GgufFile::open(path)?;
    let arch = read_arch(&f)?;
    let hyper = Hyperparams::read(&f, arch)?;
    if f.tensor("rope_freqs.weight").is_some() {
        return Err(f.meta_err("rope_freqs.weight", "Llama 3.1 RoPE frequency factors are not supported yet"));
    }
    let hf_config = hf_config(&f, arch, &hyper);
    let (tensors, stored) = read_tensors(&f, arch, hyper.heads)?;
    let (tokenizer_json, tokenizer_config) = super::tokenizer::from_gguf(&f)?;
    Ok(GgufModel { arch, hf_config, tensors, tokenizer_json, tokenizer_config, stored })
}

/// The architecture `general.architecture` names.
fn read_arch(f: &GgufFile) -> Result<GgufArch, GgufError> {
    let key = "general.architecture";
    match f.get(key).and_then(Value::as_str).ok_or_else(|| f.meta_err(key, "missing"))? {
        "llama" => Ok(GgufArch::Llama),
        "qwen2" => Ok(GgufArch::Qwen2),
        other => Err(f.meta_err(key, format!("`{other}` is not supported (llama and qwen2 are)"))),
    }
}

/// Metadata `key` as an unsigned integer, `None` when absent.
fn optional_u64_key(f: &GgufFile, key: &str) -> Result<Option<u64>, GgufError> {
    f.get(key).map(|v| v.as_u64().ok_or_else(|| f.meta_err(key, "not an unsigned integer"))).transpose()
}

fn u64_key(f: &GgufFile, key: &str) -> Result<u64, GgufError> {
    optional_u64_key(f, key)?.ok_or_else(|| f.meta_err(key, "missing"))
}

/// The `{arch}.*` hyperparameters of a GGUF file, with defaults for the keys a file may leave out
/// (KV heads = heads, `head_dim` = d_model / heads, RoPE base 10 000, RMS-norm epsilon 1e-5).
struct Hyperparams {
    n_layers: u64,
    d_model: u64,
    d_ff: u64,
    heads: Heads,
    head_dim: u64,
    context: u64,
    vocab: u64,
    rope_theta: f64,
    eps: f64,
}

impl Hyperparams {
    fn read(f: &GgufFile, arch: GgufArch) -> Result<Self, GgufError> {
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let n_layers = u64_key(f, &key("block_count"))?;
        let d_model = u64_key(f, &key("embedding_length"))?;
        let d_ff = u64_key(f, &key("feed_forward_length"))?;
        let n_heads = u64_key(f, &key("attention.head_count"))?;
        let n_kv_heads = optional_u64_key(f, &key("attention.head_count_kv"))?.unwrap_or(n_heads);
        let context = u64_key(f, &key("context_length"))?;
        let rope_theta = f.get(&key("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10_000.0);
        let eps = f.get(&key("attention.layer_norm_rms_epsilon")).and_then(Value::as_f64).unwrap_or(1e-5);
        let tokens_len = f.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[Value]>::len);
        let vocab = match optional_u64_key(f, &key("vocab_size"))? {
            Some(v) => v,
            None => {
                tokens_len.ok_or_else(|| f.meta_err("tokenizer.ggml.tokens", "missing (and no vocab_size)"))? as u64
            }
        };
        if n_heads == 0 || n_kv_heads == 0 {
            return Err(f.meta_err(&key("attention.head_count"), "zero heads"));
        }
        let head_dim = f.get(&key("attention.key_length")).and_then(Value::as_u64).unwrap_or(d_model / n_heads);
        let heads = Heads { q: n_heads, kv: n_kv_heads };
        Ok(Self { n_layers, d_model, d_ff, heads, head_dim, context, vocab, rope_theta, eps })
    }
}

/// A `config.json` for the model, with what an export needs to write the file back under `"gguf"`.
fn hf_config(f: &GgufFile, arch: GgufArch, h: &Hyperparams) -> Json {
    let a = arch.name();
    let mut hf_config = json!({
        "architectures": [arch.hf_class()],
        "model_type": a,
        "hidden_act": "silu",
        "vocab_size": h.vocab,
        "hidden_size": h.d_model,
        "intermediate_size": h.d_ff,
        "num_hidden_layers": h.n_layers,
        "num_attention_heads": h.heads.q,
        "num_key_value_heads": h.heads.kv,
        "head_dim": h.head_dim,
        "max_position_embeddings": h.context,
        "rope_theta": h.rope_theta,
        "rms_norm_eps": h.eps,
        "tie_word_embeddings": f.tensor("output.weight").is_none(),
        "gguf": {
            "name": f.get("general.name").and_then(Value::as_str).unwrap_or_default(),
            "tokenizer.ggml.pre": f.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or_default(),
        },
    });
    hf_config["gguf"]["carry"] = Json::Object(carried_metadata(f));
    let id = |k: &str| f.get(k).and_then(Value::as_u64);
    if let Some(bos) = id("tokenizer.ggml.bos_token_id") {
        hf_config["bos_token_id"] = json!(bos);
    }
    if let Some(eos) = id("tokenizer.ggml.eos_token_id") {
        hf_config["eos_token_id"] = json!(eos);
    }
    if let (Some("linear"), Some(factor)) = (
        f.get(&format!("{a}.rope.scaling.type")).and_then(Value::as_str),
        f.get(&format!("{a}.rope.scaling.factor")).and_then(Value::as_f64),
    ) {
        hf_config["rope_scaling"] = json!({"rope_type": "linear", "factor": factor});
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

/// Hugging Face name -> f32 tensor, and (name, type) of every tensor as stored.
type ReadTensors = (BTreeMap<String, TensorData>, Vec<(String, &'static str)>);

/// Every tensor under its Hugging Face name, dequantized to f32, with q/k rows in Hugging Face
/// order.
fn read_tensors(f: &GgufFile, arch: GgufArch, heads: Heads) -> Result<ReadTensors, GgufError> {
    let mut tensors = BTreeMap::new();
    let mut stored = Vec::new();
    for t in &f.tensors {
        let Some(hf) = gguf_to_hf(&t.name) else {
            return Err(GgufError::Unsupported {
                path: f.path.clone(),
                name: t.name.clone(),
                kind: "a tensor ember does not map".into(),
            });
        };
        stored.push((t.name.clone(), t.kind.name()));
        let shape = t.shape();
        let mut values = f.dequantize(t);
        if let Some(heads) = heads.permuted(arch, &hf, &shape) {
            if shape[0] % (2 * heads) != 0 {
                let message = format!("{} rows cannot hold {heads} heads of rotary pairs", shape[0]);
                return Err(f.meta_err(&t.name, message));
            }
            values = permute_rows(&values, heads, shape[1], true);
        }
        tensors.insert(hf, TensorData::new(values, shape));
    }
    Ok((tensors, stored))
}

/// How export stores the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportType {
    F32,
    F16,
    Bf16,
    /// Matrices in Q8_0 (norms and biases stay f32, as llama.cpp keeps them).
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
    fn ggml_type(self, shape: &[usize]) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::Bf16 => GgmlType::Bf16,
            // llama.cpp keeps 1-D tensors (norms, biases) in f32; rows must be whole blocks.
            Self::Q8_0 if shape.len() == 2 && shape[1].is_multiple_of(32) => GgmlType::Q8_0,
            Self::Q8_0 => GgmlType::F32,
        }
    }
}

/// Writes a GGUF file from Hugging Face-named f32 tensors in `[out, in]` layout and the model's
/// `config.json`, with the tokenizer (and chat template) of `tokenizer_json` / `tokenizer_config`
/// in the metadata. Returns the encoded bytes.
pub fn encode_model(
    hf_config: &Json,
    tensors: &[(String, TensorData)],
    tokenizer_json: &str,
    tokenizer_config: Option<&Json>,
    ty: ExportType,
) -> Result<Vec<u8>, String> {
    let class = hf_config["architectures"][0].as_str().unwrap_or("LlamaForCausalLM");
    let arch = GgufArch::from_hf_class(class).ok_or_else(|| format!("{class} has no GGUF mapping"))?;
    let n_heads = config_u64(hf_config, "num_attention_heads")?;
    let heads = Heads { q: n_heads, kv: hf_config["num_key_value_heads"].as_u64().unwrap_or(n_heads) };
    let mut meta = arch_metadata(hf_config, arch, heads, ty)?;
    meta.extend(carried_back(hf_config));
    let pre = hf_config["gguf"]["tokenizer.ggml.pre"].as_str().filter(|p| !p.is_empty());
    meta.extend(super::tokenizer::to_gguf(tokenizer_json, tokenizer_config, hf_config, pre)?);
    let out =
        tensors.iter().map(|(name, data)| export_tensor(name, data, arch, heads, ty)).collect::<Result<Vec<_>, _>>()?;
    Ok(super::encode(&meta, &out))
}

fn config_u64(hf_config: &Json, key: &str) -> Result<u64, String> {
    hf_config[key].as_u64().ok_or_else(|| format!("config.json has no `{key}`"))
}

/// `general.*` and the `{arch}.*` hyperparameters of a `config.json`.
fn arch_metadata(
    hf_config: &Json,
    arch: GgufArch,
    heads: Heads,
    ty: ExportType,
) -> Result<Vec<(String, Value)>, String> {
    let a = arch.name();
    let num = |k: &str| config_u64(hf_config, k);
    let d_model = num("hidden_size")?;
    let head_dim = hf_config["head_dim"].as_u64().unwrap_or(d_model / heads.q.max(1));
    let rope_theta =
        hf_config["rope_parameters"]["rope_theta"].as_f64().or(hf_config["rope_theta"].as_f64()).unwrap_or(10_000.0);
    let s = |v: &str| Value::String(v.into());
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(a)),
        ("general.name".into(), s(hf_config["gguf"]["name"].as_str().unwrap_or("ember export"))),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (format!("{a}.block_count"), Value::U32(num("num_hidden_layers")? as u32)),
        (format!("{a}.context_length"), Value::U32(num("max_position_embeddings")? as u32)),
        (format!("{a}.embedding_length"), Value::U32(d_model as u32)),
        (format!("{a}.feed_forward_length"), Value::U32(num("intermediate_size")? as u32)),
        (format!("{a}.attention.head_count"), Value::U32(heads.q as u32)),
        (format!("{a}.attention.head_count_kv"), Value::U32(heads.kv as u32)),
        (format!("{a}.attention.key_length"), Value::U32(head_dim as u32)),
        (format!("{a}.attention.value_length"), Value::U32(head_dim as u32)),
        (format!("{a}.rope.dimension_count"), Value::U32(head_dim as u32)),
        (format!("{a}.rope.freq_base"), Value::F32(rope_theta as f32)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(hf_config["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32),
        ),
        (format!("{a}.vocab_size"), Value::U32(num("vocab_size")? as u32)),
    ];
    let scaling = &hf_config["rope_scaling"];
    if scaling["rope_type"].as_str().or(scaling["type"].as_str()) == Some("linear") {
        meta.push((format!("{a}.rope.scaling.type"), s("linear")));
        let factor = scaling["factor"].as_f64().unwrap_or(1.0) as f32;
        meta.push((format!("{a}.rope.scaling.factor"), Value::F32(factor)));
    }
    Ok(meta)
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

/// One tensor as export writes it: under its GGUF name, q/k rows in llama.cpp's order, stored as
/// `ty` stores a tensor of its shape.
fn export_tensor(
    name: &str,
    data: &TensorData,
    arch: GgufArch,
    heads: Heads,
    ty: ExportType,
) -> Result<TensorOut, String> {
    let gname = hf_to_gguf(name).ok_or_else(|| format!("tensor `{name}` has no GGUF name"))?;
    let shape = data.shape.to_vec();
    let mut values = data.clone().convert::<f32>().into_vec::<f32>().map_err(|e| format!("{name}: {e:?}"))?;
    if let Some(heads) = heads.permuted(arch, name, &shape) {
        values = permute_rows(&values, heads, shape[1], false);
    }
    let kind = ty.ggml_type(&shape);
    let data = super::quant::quantize(kind, &values).map_err(|e| format!("{name}: {e}"))?;
    Ok(TensorOut { name: gname, shape, kind, data })
}

/// A GGUF model imported as a decoder, with its tokenizer files' contents.
pub struct GgufImport<B: ember_kernels::EmberBackend> {
    pub imported: crate::Imported<B>,
    pub arch: GgufArch,
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
    let m = read(path)?;
    let tensors = m.tensors.into_iter().map(|(k, v)| (k, (v, path.to_path_buf()))).collect();
    let imported = crate::import_tensors(m.hf_config, path, path, tensors, param_dtype, false, false, device)?;
    Ok(GgufImport {
        imported,
        arch: m.arch,
        tokenizer_json: m.tokenizer_json,
        tokenizer_config: m.tokenizer_config,
        stored: m.stored,
    })
}

/// The path of a `.gguf` file, if `path` is one (by extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) && path.is_file()
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
    fn names_map_both_ways() {
        for g in [
            "token_embd.weight",
            "output.weight",
            "output_norm.weight",
            "blk.3.attn_q.weight",
            "blk.0.attn_v.bias",
            "blk.12.ffn_down.weight",
        ] {
            let hf = gguf_to_hf(g).unwrap();
            assert_eq!(hf_to_gguf(&hf).as_deref(), Some(g), "{g} -> {hf}");
        }
        assert_eq!(gguf_to_hf("blk.x.attn_q.weight"), None);
        assert_eq!(gguf_to_hf("rope_freqs.weight"), None);
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
