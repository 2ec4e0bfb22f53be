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

fn meta_err(f: &GgufFile, key: &str, message: impl Into<String>) -> GgufError {
    GgufError::Metadata { path: f.path.clone(), key: key.into(), message: message.into() }
}

fn u64_key(f: &GgufFile, key: &str) -> Result<u64, GgufError> {
    f.get(key)
        .ok_or_else(|| meta_err(f, key, "missing"))?
        .as_u64()
        .ok_or_else(|| meta_err(f, key, "not an unsigned integer"))
}

/// The Hugging Face name of a GGUF tensor.
pub fn gguf_to_hf(name: &str) -> Option<String> {
    Some(match name {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = name.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            layer.parse::<usize>().ok()?;
            let hf = match part {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_q.bias" => "self_attn.q_proj.bias",
                "attn_k.bias" => "self_attn.k_proj.bias",
                "attn_v.bias" => "self_attn.v_proj.bias",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}")
        }
    })
}

/// The GGUF name of a Hugging Face tensor (the inverse of [`gguf_to_hf`]).
pub fn hf_to_gguf(name: &str) -> Option<String> {
    Some(match name {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = name.strip_prefix("model.layers.")?;
            let (layer, part) = rest.split_once('.')?;
            let g = match part {
                "input_layernorm.weight" => "attn_norm.weight",
                "post_attention_layernorm.weight" => "ffn_norm.weight",
                "self_attn.q_proj.weight" => "attn_q.weight",
                "self_attn.k_proj.weight" => "attn_k.weight",
                "self_attn.v_proj.weight" => "attn_v.weight",
                "self_attn.q_proj.bias" => "attn_q.bias",
                "self_attn.k_proj.bias" => "attn_k.bias",
                "self_attn.v_proj.bias" => "attn_v.bias",
                "self_attn.o_proj.weight" => "attn_output.weight",
                "mlp.gate_proj.weight" => "ffn_gate.weight",
                "mlp.up_proj.weight" => "ffn_up.weight",
                "mlp.down_proj.weight" => "ffn_down.weight",
                _ => return None,
            };
            format!("blk.{layer}.{g}")
        }
    })
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
    let arch_name = f
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| meta_err(&f, "general.architecture", "missing"))?;
    let arch = match arch_name {
        "llama" => GgufArch::Llama,
        "qwen2" => GgufArch::Qwen2,
        other => {
            return Err(meta_err(
                &f,
                "general.architecture",
                format!("`{other}` is not supported (llama and qwen2 are)"),
            ))
        }
    };
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let n_layers = u64_key(&f, &key("block_count"))?;
    let d_model = u64_key(&f, &key("embedding_length"))?;
    let d_ff = u64_key(&f, &key("feed_forward_length"))?;
    let n_heads = u64_key(&f, &key("attention.head_count"))?;
    let n_kv_heads = match f.get(&key("attention.head_count_kv")) {
        Some(v) => {
            v.as_u64().ok_or_else(|| meta_err(&f, &key("attention.head_count_kv"), "not an unsigned integer"))?
        }
        None => n_heads,
    };
    let context = u64_key(&f, &key("context_length"))?;
    let rope_theta = f.get(&key("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10_000.0);
    let eps = f.get(&key("attention.layer_norm_rms_epsilon")).and_then(Value::as_f64).unwrap_or(1e-5);
    let tokens_len = f.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[Value]>::len);
    let vocab = match f.get(&key("vocab_size")) {
        Some(v) => v.as_u64().ok_or_else(|| meta_err(&f, &key("vocab_size"), "not an unsigned integer"))?,
        None => tokens_len.ok_or_else(|| meta_err(&f, "tokenizer.ggml.tokens", "missing (and no vocab_size)"))? as u64,
    };
    if n_heads == 0 || n_kv_heads == 0 {
        return Err(meta_err(&f, &key("attention.head_count"), "zero heads"));
    }
    if f.tensor("rope_freqs.weight").is_some() {
        return Err(meta_err(&f, "rope_freqs.weight", "Llama 3.1 RoPE frequency factors are not supported yet"));
    }
    let head_dim = f.get(&key("attention.key_length")).and_then(Value::as_u64).unwrap_or(d_model / n_heads);
    let tied = f.tensor("output.weight").is_none();
    let id = |k: &str| f.get(k).and_then(Value::as_u64);
    let mut hf_config = json!({
        "architectures": [arch.hf_class()],
        "model_type": a,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": d_model,
        "intermediate_size": d_ff,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rope_theta": rope_theta,
        "rms_norm_eps": eps,
        "tie_word_embeddings": tied,
        "gguf": {
            "name": f.get("general.name").and_then(Value::as_str).unwrap_or_default(),
            "tokenizer.ggml.pre": f.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or_default(),
        },
    });
    // Descriptive metadata (licence, organization, names, languages) and tokenizer facts the
    // rebuilt tokenizer.json does not carry, kept for an export to write back.
    let mut carry = serde_json::Map::new();
    for (key, value) in &f.metadata {
        let kept = (key.starts_with("general.")
            && !matches!(
                key.as_str(),
                "general.architecture" | "general.alignment" | "general.file_type" | "general.quantization_version"
            ))
            || matches!(key.as_str(), "tokenizer.ggml.unknown_token_id" | "tokenizer.ggml.add_space_prefix");
        let json = match value {
            Value::String(s) => Some(json!(s)),
            Value::Bool(b) => Some(json!(b)),
            Value::Array(items) if items.iter().all(|v| v.as_str().is_some()) => {
                Some(json!(items.iter().filter_map(Value::as_str).collect::<Vec<_>>()))
            }
            v => v.as_u64().map(|n| json!(n)),
        };
        if let (true, Some(json)) = (kept, json) {
            carry.insert(key.clone(), json);
        }
    }
    hf_config["gguf"]["carry"] = Json::Object(carry);
    if let Some(bos) = id("tokenizer.ggml.bos_token_id") {
        hf_config["bos_token_id"] = json!(bos);
    }
    if let Some(eos) = id("tokenizer.ggml.eos_token_id") {
        hf_config["eos_token_id"] = json!(eos);
    }
    if let (Some("linear"), Some(factor)) = (
        f.get(&key("rope.scaling.type")).and_then(Value::as_str),
        f.get(&key("rope.scaling.factor")).and_then(Value::as_f64),
    ) {
        hf_config["rope_scaling"] = json!({"rope_type": "linear", "factor": factor});
    }

    let mut tensors = BTreeMap::new();
    let mut stored = Vec::new();
    for t in &f.tensors {
        let Some(hf) = gguf_to_hf(&t.name) else {
            return Err(GgufError::Unsupported {
                path: path.into(),
                name: t.name.clone(),
                kind: "a tensor ember does not map".into(),
            });
        };
        stored.push((t.name.clone(), t.kind.name()));
        let shape = t.shape();
        let mut values = f.dequantize(t);
        if arch.permutes_qk() && shape.len() == 2 && (hf.ends_with("q_proj.weight") || hf.ends_with("k_proj.weight")) {
            let heads = if hf.ends_with("q_proj.weight") { n_heads } else { n_kv_heads } as usize;
            if shape[0] % (2 * heads) != 0 {
                return Err(meta_err(
                    &f,
                    &t.name,
                    format!("{} rows cannot hold {heads} heads of rotary pairs", shape[0]),
                ));
            }
            values = permute_rows(&values, heads, shape[1], true);
        }
        tensors.insert(hf, TensorData::new(values, shape));
    }
    let (tokenizer_json, tokenizer_config) = super::tokenizer::from_gguf(&f)?;
    Ok(GgufModel { arch, hf_config, tensors, tokenizer_json, tokenizer_config, stored })
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
    let arch = match class {
        "LlamaForCausalLM" | "MistralForCausalLM" => GgufArch::Llama,
        "Qwen2ForCausalLM" => GgufArch::Qwen2,
        other => return Err(format!("{other} has no GGUF mapping")),
    };
    let a = arch.name();
    let num = |k: &str| hf_config[k].as_u64().ok_or_else(|| format!("config.json has no `{k}`"));
    let (n_heads, d_model) = (num("num_attention_heads")?, num("hidden_size")?);
    let n_kv = hf_config["num_key_value_heads"].as_u64().unwrap_or(n_heads);
    let head_dim = hf_config["head_dim"].as_u64().unwrap_or(d_model / n_heads.max(1));
    let rope_theta =
        hf_config["rope_parameters"]["rope_theta"].as_f64().or(hf_config["rope_theta"].as_f64()).unwrap_or(10_000.0);
    let file_type = match ty {
        ExportType::F32 => 0,
        ExportType::F16 => 1,
        ExportType::Q8_0 => 7,
        ExportType::Bf16 => 32,
    };
    let s = |v: &str| Value::String(v.into());
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(a)),
        ("general.name".into(), s(hf_config["gguf"]["name"].as_str().unwrap_or("ember export"))),
        ("general.file_type".into(), Value::U32(file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
        (format!("{a}.block_count"), Value::U32(num("num_hidden_layers")? as u32)),
        (format!("{a}.context_length"), Value::U32(num("max_position_embeddings")? as u32)),
        (format!("{a}.embedding_length"), Value::U32(d_model as u32)),
        (format!("{a}.feed_forward_length"), Value::U32(num("intermediate_size")? as u32)),
        (format!("{a}.attention.head_count"), Value::U32(n_heads as u32)),
        (format!("{a}.attention.head_count_kv"), Value::U32(n_kv as u32)),
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
    if hf_config["rope_scaling"]["rope_type"].as_str().or(hf_config["rope_scaling"]["type"].as_str()) == Some("linear")
    {
        meta.push((format!("{a}.rope.scaling.type"), s("linear")));
        meta.push((
            format!("{a}.rope.scaling.factor"),
            Value::F32(hf_config["rope_scaling"]["factor"].as_f64().unwrap_or(1.0) as f32),
        ));
    }
    // What an import kept of the source file's descriptive metadata, written back.
    for (key, value) in hf_config["gguf"]["carry"].as_object().into_iter().flatten() {
        if key == "general.name" {
            continue; // written above
        }
        let v = match value {
            Json::String(x) => s(x),
            Json::Bool(b) => Value::Bool(*b),
            Json::Number(n) => Value::U32(n.as_u64().unwrap_or(0) as u32),
            Json::Array(items) => Value::Array(items.iter().filter_map(Json::as_str).map(s).collect()),
            _ => continue,
        };
        meta.push((key.clone(), v));
    }
    let pre = hf_config["gguf"]["tokenizer.ggml.pre"].as_str().filter(|p| !p.is_empty());
    meta.extend(super::tokenizer::to_gguf(tokenizer_json, tokenizer_config, hf_config, pre)?);

    let mut out = Vec::with_capacity(tensors.len());
    for (name, data) in tensors {
        let gname = hf_to_gguf(name).ok_or_else(|| format!("tensor `{name}` has no GGUF name"))?;
        let shape = data.shape.to_vec();
        let mut values = data.clone().convert::<f32>().into_vec::<f32>().map_err(|e| format!("{name}: {e:?}"))?;
        if arch.permutes_qk()
            && shape.len() == 2
            && (name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight"))
        {
            let heads = if name.ends_with("q_proj.weight") { n_heads } else { n_kv } as usize;
            values = permute_rows(&values, heads, shape[1], false);
        }
        let kind = match ty {
            ExportType::F32 => GgmlType::F32,
            ExportType::F16 => GgmlType::F16,
            ExportType::Bf16 => GgmlType::Bf16,
            // llama.cpp keeps 1-D tensors (norms, biases) in f32; rows must be whole blocks.
            ExportType::Q8_0 if shape.len() == 2 && shape[1] % 32 == 0 => GgmlType::Q8_0,
            ExportType::Q8_0 => GgmlType::F32,
        };
        let data = super::quant::quantize(kind, &values).map_err(|e| format!("{name}: {e}"))?;
        out.push(TensorOut { name: gname, shape, kind, data });
    }
    Ok(super::encode(&meta, &out))
}

/// A GGUF model imported as a decoder, with its tokenizer files' contents.
pub struct GgufImport<B: ember_model::ops::EmberBackend> {
    pub imported: crate::Imported<B>,
    pub arch: GgufArch,
    pub tokenizer_json: String,
    pub tokenizer_config: Json,
    /// (name, type) of every tensor as stored.
    pub stored: Vec<(String, &'static str)>,
}

/// Reads a GGUF file into a decoder whose parameters are stored in `param_dtype`.
pub fn import<B: ember_model::ops::EmberBackend>(
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
