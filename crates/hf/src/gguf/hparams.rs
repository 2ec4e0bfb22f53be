//! llama.cpp's `{arch}.*` hyper-parameters: the keys every architecture has, read and written
//! here, and [`GgufRules`], what a family adds to them (each family's in its file of `families/`).
//!
//! Every architecture: `block_count`, `embedding_length`, `attention.head_count` (and
//! `head_count_kv`), `vocab_size` (or the tokenizer's size), `feed_forward_length`,
//! `context_length`, `attention.key_length`, `rope.dimension_count`, `rope.freq_base`, a linear
//! `rope.scaling`, the norm epsilon (`attention.layer_norm_rms_epsilon`, or
//! `attention.layer_norm_epsilon` for LayerNorm) and, with experts, `expert_count`,
//! `expert_used_count` and the experts' widths.

use std::collections::BTreeMap;
use std::path::Path;

use ember_model::{ModelConfig, MoeConfig, NormKind, Positions, RopeScaling};

use super::tokenizer::VocabRules;
use super::{GgufError, GgufFile, Meta, Value};
use crate::family::{Architecture, Family};

/// What a family adds to the keys every architecture has. One per family, in its file.
pub struct GgufRules {
    /// Whether llama.cpp reorders the rows of the q and k projections (its `llama`, whose RoPE
    /// rotates adjacent pairs; Hugging Face pairs channel `i` with `i + Dh/2`).
    pub permutes_qk: bool,
    /// Whether a file of llama.cpp's architecture holds this family, by its metadata and tensors:
    /// the first family of the architecture that claims a file reads it (llama.cpp's `llama` is
    /// Llama's, or with experts Mixtral's, never Mistral's; its `deepseek2` with selection biases
    /// is DeepSeek-V3's).
    pub claims: fn(&GgufFile) -> Result<bool, GgufError>,
    /// The experts' keys, for a family that has experts.
    pub experts: Option<GgufExperts>,
    /// Reads the family's own keys into a model the shared keys describe.
    pub read: fn(&ArchKeys, &mut ModelConfig) -> Result<(), GgufError>,
    /// Writes them (after the shared keys, before the experts').
    pub write: fn(&ModelConfig, &mut ArchWriter),
    /// Keys that replace the shared ones altogether (DeepSeek's latent attention).
    pub own_keys: Option<OwnKeys>,
    /// Why llama.cpp's architecture cannot hold `config` beyond what its keys say; `None` when it can.
    pub refuses: fn(&ModelConfig) -> Option<String>,
    /// A Hugging Face tensor llama.cpp stores as two.
    pub split: Option<SplitTensor>,
    /// Name endings of Hugging Face tensors `[1, D]` that llama.cpp stores as `[D]` (Qwen2-MoE's
    /// shared expert gate).
    pub squeezed: &'static [&'static str],
    /// How the family's files spell their tokenizer.
    pub vocab: VocabRules,
}

impl GgufRules {
    /// Whether Hugging Face tensor `name` is one llama.cpp stores without its leading axis of 1.
    pub fn squeezes(&self, name: &str) -> bool {
        self.squeezed.iter().any(|s| name.ends_with(s))
    }
}

impl GgufRules {
    /// A dense family's: no experts, no keys of its own, q/k rows as Hugging Face has them.
    pub const DENSE: GgufRules = GgufRules {
        permutes_qk: false,
        claims: every_file,
        experts: None,
        read: no_keys,
        write: no_keys_written,
        own_keys: None,
        refuses: refuses_nothing,
        split: None,
        squeezed: &[],
        vocab: VocabRules::SCORES,
    };
}

fn every_file(_: &GgufFile) -> Result<bool, GgufError> {
    Ok(true)
}

fn no_keys(_: &ArchKeys, _: &mut ModelConfig) -> Result<(), GgufError> {
    Ok(())
}

fn no_keys_written(_: &ModelConfig, _: &mut ArchWriter) {}

fn refuses_nothing(_: &ModelConfig) -> Option<String> {
    None
}

/// How llama.cpp's architecture keeps a family's experts.
#[derive(Debug, Clone, Copy)]
pub struct GgufExperts {
    /// Whether llama.cpp renormalises the top-k weights (its `llama` and `qwen3moe`).
    pub norm_topk: bool,
    /// Whether the family has a gated shared expert (`expert_shared_feed_forward_length`).
    pub shared: bool,
    /// Whether the experts' width is `feed_forward_length` (llama.cpp's `llama` and `olmoe`), not
    /// `expert_feed_forward_length`.
    pub width_is_ffn: bool,
}

/// Keys that replace the shared ones: `read` gets the sizes (vocabulary, layers, width, heads,
/// tied head) and returns the model; `write` writes every `{arch}.*` key, `vocab_size` included;
/// `key_of` names the key (after the prefix) that holds a model field of the family's own, for
/// errors about it (`None`: the shared keys').
pub struct OwnKeys {
    pub read: fn(&ArchKeys, ModelConfig) -> Result<ModelConfig, GgufError>,
    pub write: fn(&ModelConfig, &mut ArchWriter),
    pub key_of: fn(&str) -> Option<&'static str>,
}

/// A Hugging Face tensor (`hf`, `{i}` the layer) that llama.cpp stores as two, `blk.{i}.{part}.weight`
/// for each of `parts`: DeepSeek's `kv_b_proj` as `attn_k_b` and `attn_v_b`.
pub struct SplitTensor {
    pub hf: &'static str,
    pub parts: [&'static str; 2],
    /// The parts' shapes for a model of `config`; `None` for a model without the tensor.
    pub shapes: fn(&ModelConfig) -> Option<[Vec<usize>; 2]>,
    /// The two parts' values (of a model of `config`) as the Hugging Face tensor's, and its shape;
    /// parts that do not make one are an error about the file's metadata `key`.
    pub join: fn(&GgufFile, &str, &ModelConfig, &[f32], &[f32]) -> Result<(Vec<f32>, Vec<usize>), GgufError>,
    /// The Hugging Face tensor's values as the two parts'.
    pub split: fn(&ModelConfig, &[f32]) -> (Vec<f32>, Vec<f32>),
}

/// A file's `{arch}.*` metadata, read by type: each error names the whole key.
pub struct ArchKeys<'a> {
    pub meta: Meta<'a>,
    /// llama.cpp's architecture: the keys' prefix.
    pub arch: &'static str,
    pub family: &'static Family,
}

impl ArchKeys<'_> {
    /// `{arch}.{k}`.
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// An error about key `{arch}.{k}`.
    pub fn err(&self, k: &str, message: String) -> GgufError {
        GgufError::Metadata { path: self.meta.path.into(), key: self.key(k), message }
    }

    /// An unsigned integer, `None` when absent.
    pub fn opt_u64(&self, k: &str) -> Result<Option<u64>, GgufError> {
        self.meta.u64(&self.key(k))
    }

    /// A key the model cannot do without.
    pub fn usize(&self, k: &str) -> Result<usize, GgufError> {
        Ok(self.opt_u64(k)?.ok_or_else(|| self.err(k, "missing".into()))? as usize)
    }

    /// A finite number, `None` when absent.
    pub fn float(&self, k: &str) -> Result<Option<f64>, GgufError> {
        self.meta.float(&self.key(k))
    }

    /// A string, `None` when absent.
    pub fn str(&self, k: &str) -> Result<Option<&str>, GgufError> {
        self.meta.str(&self.key(k))
    }

    /// A boolean, `None` when absent.
    pub fn bool(&self, k: &str) -> Result<Option<bool>, GgufError> {
        self.meta.bool(&self.key(k))
    }
}

/// The `{arch}.*` keys of an export, in the order they are written.
pub struct ArchWriter {
    arch: &'static str,
    pub keys: Vec<(String, Value)>,
}

impl ArchWriter {
    /// `{arch}.{k}` = `value`.
    pub fn put(&mut self, k: &str, value: Value) {
        self.keys.push((format!("{}.{k}", self.arch), value));
    }

    /// An unsigned integer, as llama.cpp's converter writes them (u32).
    pub fn u(&mut self, k: &str, v: usize) {
        self.put(k, Value::U32(v as u32));
    }

    /// A float, as f32.
    pub fn f(&mut self, k: &str, v: f64) {
        self.put(k, Value::F32(v as f32));
    }

    /// A string.
    pub fn s(&mut self, k: &str, v: &str) {
        self.put(k, Value::String(v.into()));
    }

    /// `k` moved to the end with a new value.
    fn replace(&mut self, k: &str, value: Value) {
        let key = format!("{}.{k}", self.arch);
        self.keys.retain(|(name, _)| *name != key);
        self.keys.push((key, value));
    }
}

/// The model a GGUF file's `{arch}.*` metadata describes, as llama.cpp runs it: its sizes, with
/// defaults for the keys a file may leave out (KV heads = heads, `head_dim` = d_model / heads, RoPE
/// base 10 000, norm epsilon 1e-5), the parts of its family, and the rules llama.cpp fixes for the
/// architecture. `tied`: the file has no `output.weight`; `tokens`: the tokenizer's size, for a file
/// without `vocab_size`.
pub(crate) fn model_config(
    meta: &BTreeMap<String, Value>,
    path: &Path,
    arch: Architecture,
    tied: bool,
    tokens: Option<usize>,
) -> Result<ModelConfig, GgufError> {
    let family = arch.family();
    let k = ArchKeys { meta: Meta { path, map: meta }, arch: family.gguf_arch, family };
    let n_layers = k.usize("block_count")?;
    let d_model = k.usize("embedding_length")?;
    let n_heads = k.usize("attention.head_count")?;
    let n_kv_heads = k.opt_u64("attention.head_count_kv")?.map_or(n_heads, |v| v as usize);
    if n_heads == 0 || n_kv_heads == 0 {
        return Err(k.err("attention.head_count", "zero heads".into()));
    }
    let vocab_size = match k.opt_u64("vocab_size")? {
        Some(v) => v as usize,
        None => tokens.ok_or_else(|| GgufError::Metadata {
            path: path.into(),
            key: "tokenizer.ggml.tokens".into(),
            message: "missing (and no vocab_size)".into(),
        })?,
    };
    let sizes = ModelConfig {
        n_layers,
        d_model,
        n_heads,
        n_kv_heads: Some(n_kv_heads),
        tie_embeddings: tied,
        ..ModelConfig::tiny(vocab_size, 1)
    };
    let rules = arch.gguf();
    let c = match &rules.own_keys {
        Some(own) => (own.read)(&k, sizes)?,
        None => {
            let mut c = shared_config(&k, &sizes)?;
            read_experts(&k, &mut c, rules.experts)?;
            (rules.read)(&k, &mut c)?;
            c
        }
    };
    c.validate().map_err(|e| k.err(key_of(&e, &rules), format!("the model the metadata describes: {e}")))?;
    Ok(c)
}

/// The `{arch}.*` key (after the prefix) that holds the model field a config error names, so that
/// the error names the key the file got wrong; `*` (every key) for the model as a whole.
fn key_of(e: &ember_model::ConfigError, rules: &GgufRules) -> &'static str {
    use ember_model::ConfigError as E;
    let field = match e {
        E::NotPositive { name, .. } | E::TooLarge { name, .. } => *name,
        E::NotDivisible { dividend, .. } => dividend,
        E::Needs { key, .. } => key,
        E::OddHeadDim(_) => "head_dim",
        E::VocabUnset => "vocab_size",
        E::Dropout(_) => "",
    };
    if let Some(key) = rules.own_keys.as_ref().and_then(|own| (own.key_of)(field)) {
        return key;
    }
    match field {
        "n_layers" => "block_count",
        "d_model" => "embedding_length",
        "n_heads" => "attention.head_count",
        "n_kv_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "d_ff" => "feed_forward_length",
        "max_seq_len" => "context_length",
        "vocab_size" => "vocab_size",
        "rope_theta" => "rope.freq_base",
        "norm_eps" => "attention.layer_norm_rms_epsilon",
        "sliding_window" => "attention.sliding_window",
        "moe.n_experts" => "expert_count",
        "moe.top_k" => "expert_used_count",
        "moe.d_expert" if rules.experts.is_some_and(|e| e.width_is_ffn) => "feed_forward_length",
        "moe.d_expert" => "expert_feed_forward_length",
        "moe.shared_expert" => "expert_shared_feed_forward_length",
        _ => "*",
    }
}

/// The model the shared keys describe, of `sizes` and the family's parts.
fn shared_config(k: &ArchKeys, sizes: &ModelConfig) -> Result<ModelConfig, GgufError> {
    let (d_model, n_heads) = (sizes.d_model, sizes.n_heads);
    let head_dim = k.opt_u64("attention.key_length")?.map_or(d_model / n_heads, |v| v as usize);
    let parts = k.family.parts;
    // RoPE over part of each head (llama.cpp's n_rot below key_length) is not a model ember runs.
    if let Some(n_rot) = k.opt_u64("rope.dimension_count")?.filter(|_| parts.positions != Positions::Learned) {
        if n_rot != head_dim as u64 {
            let message = format!("{n_rot}: RoPE over part of a head of {head_dim} is not supported");
            return Err(k.err("rope.dimension_count", message));
        }
    }
    let layer_norm = parts.norm == NormKind::LayerNorm;
    let eps_key = if layer_norm { "attention.layer_norm_epsilon" } else { "attention.layer_norm_rms_epsilon" };
    let rope_scaling = match (k.str("rope.scaling.type")?, k.float("rope.scaling.factor")?) {
        (Some("linear"), Some(factor)) => Some(RopeScaling::Linear { factor }),
        _ => None,
    };
    Ok(ModelConfig {
        vocab_size: sizes.vocab_size,
        d_model,
        n_layers: sizes.n_layers,
        n_heads,
        n_kv_heads: sizes.n_kv_heads,
        head_dim: Some(head_dim).filter(|&h| h.checked_mul(n_heads) != Some(d_model)),
        d_ff: k.usize("feed_forward_length")?,
        max_seq_len: k.usize("context_length")?,
        rope_theta: k.float("rope.freq_base")?.unwrap_or(10_000.0),
        rope_scaling,
        norm_eps: k.float(eps_key)?.unwrap_or(1e-5),
        // GGUF stores every RMSNorm gain as the factor itself (Gemma's `1 + w` included).
        norm: if parts.norm == NormKind::RmsNormPlusOne { NormKind::RmsNorm } else { parts.norm },
        norm_bias: layer_norm,
        tie_embeddings: sizes.tie_embeddings,
        ..k.family.base_config()
    })
}

/// `expert_count` and the keys that go with it; required where the family has experts.
fn read_experts(k: &ArchKeys, c: &mut ModelConfig, experts: Option<GgufExperts>) -> Result<(), GgufError> {
    let Some(n_experts) = k.opt_u64("expert_count")?.filter(|&n| n > 0) else {
        return match experts {
            Some(_) => Err(k.err("expert_count", "missing: the architecture has experts".into())),
            None => Ok(()),
        };
    };
    let e = experts.unwrap_or(GgufExperts { norm_topk: false, shared: false, width_is_ffn: false });
    c.moe = Some(MoeConfig {
        n_experts: n_experts as usize,
        top_k: k.usize("expert_used_count")?,
        d_expert: k.opt_u64("expert_feed_forward_length")?.map_or(c.d_ff, |v| v as usize),
        norm_topk: e.norm_topk,
        shared_expert: if e.shared { Some(k.usize("expert_shared_feed_forward_length")?) } else { None },
        shared_expert_gate: e.shared,
        aux_loss_coef: 0.001,
        z_loss_coef: 0.0,
        ..Default::default()
    });
    Ok(())
}

/// `general.*` and the `{arch}.*` hyperparameters of `config`, as llama.cpp's converter writes
/// them for the architecture; `file_type` is `general.file_type`.
pub(crate) fn arch_metadata(
    config: &ModelConfig,
    arch: Architecture,
    file_type: u32,
    name: &str,
) -> Vec<(String, Value)> {
    let a = arch.family().gguf_arch;
    let s = |v: &str| Value::String(v.into());
    let mut w = ArchWriter { arch: a, keys: Vec::new() };
    w.keys.extend([
        ("general.architecture".into(), s(a)),
        ("general.name".into(), s(name)),
        ("general.file_type".into(), Value::U32(file_type)),
        ("general.quantization_version".into(), Value::U32(2)),
    ]);
    let rules = arch.gguf();
    if let Some(own) = &rules.own_keys {
        (own.write)(config, &mut w);
        return w.keys;
    }
    shared_keys(config, &mut w);
    (rules.write)(config, &mut w);
    if let Some(moe) = &config.moe {
        w.u("expert_count", moe.n_experts);
        w.u("expert_used_count", moe.top_k);
        if rules.experts.is_some_and(|e| e.width_is_ffn) {
            w.replace("feed_forward_length", Value::U32(moe.d_expert as u32));
        } else {
            w.u("expert_feed_forward_length", moe.d_expert);
        }
        if let Some(shared) = moe.shared_expert {
            w.u("expert_shared_feed_forward_length", shared);
        }
    }
    w.u("vocab_size", config.vocab_size);
    w.keys
}

/// The sizes every architecture writes first: layers, context, width, MLP width, heads.
pub fn size_keys(config: &ModelConfig, w: &mut ArchWriter) {
    w.u("block_count", config.n_layers);
    w.u("context_length", config.max_seq_len);
    w.u("embedding_length", config.d_model);
    w.u("feed_forward_length", config.d_ff);
    w.u("attention.head_count", config.n_heads);
}

/// The keys every architecture has (but `vocab_size`, written last).
fn shared_keys(config: &ModelConfig, w: &mut ArchWriter) {
    size_keys(config, w);
    if config.norm == NormKind::LayerNorm {
        w.f("attention.layer_norm_epsilon", config.norm_eps);
    } else {
        let head_dim = config.head_dim();
        w.u("attention.head_count_kv", config.n_kv_heads());
        w.u("attention.key_length", head_dim);
        w.u("attention.value_length", head_dim);
        w.f("attention.layer_norm_rms_epsilon", config.norm_eps);
    }
    if config.positions == Positions::Rope {
        w.u("rope.dimension_count", config.head_dim());
        w.f("rope.freq_base", config.rope_theta);
        if let Some(RopeScaling::Linear { factor }) = config.rope_scaling {
            w.s("rope.scaling.type", "linear");
            w.f("rope.scaling.factor", factor);
        }
    }
}
