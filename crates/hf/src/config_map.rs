//! `config.json` of the Llama, Qwen2 and Mistral families <-> [`ModelConfig`].
//!
//! Hugging Face names appear only in this crate. Both RoPE spellings are read: transformers 5's
//! `rope_parameters` (`rope_theta` and `rope_type` inside) and the older top-level `rope_theta` with
//! `rope_scaling`.

use ember_model::{MlpKind, ModelConfig, NormKind, Positions, RopeLayout, RopeScaling};
use serde_json::{json, Map, Value};

use crate::error::HfError;

/// The model families ember reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Mistral,
}

impl Architecture {
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Mistral => "MistralForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Mistral => "mistral",
        }
    }

    /// The architecture of a `architectures[0]` class name, if ember supports it.
    pub fn from_class(name: &str) -> Option<Self> {
        [Self::Llama, Self::Qwen2, Self::Mistral].into_iter().find(|a| a.class_name() == name)
    }

    /// The family an ember model exports as: Qwen2 when it has q/k/v bias, Mistral with a sliding
    /// window, Llama otherwise.
    pub fn for_model(c: &ModelConfig) -> Self {
        if c.qkv_bias {
            Self::Qwen2
        } else if c.sliding_window.is_some() {
            Self::Mistral
        } else {
            Self::Llama
        }
    }
}

/// Reads a model config out of a parsed `config.json`. `source` (the file) names errors.
pub fn to_model_config(json: &Value, source: &str) -> Result<(ModelConfig, Architecture), HfError> {
    let obj = json
        .as_object()
        .ok_or_else(|| HfError::Config { source_name: source.into(), message: "not a JSON object".into() })?;
    let class = obj
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .ok_or_else(|| HfError::Config { source_name: source.into(), message: "no `architectures` entry".into() })?;
    let arch = Architecture::from_class(class)
        .ok_or_else(|| HfError::Unsupported { source_name: source.into(), architecture: class.into() })?;
    let get = |k: &'static str| -> Result<usize, HfError> {
        obj.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or(HfError::MissingField { source_name: source.into(), field: k })
    };
    let opt_usize = |k: &str| obj.get(k).and_then(Value::as_u64).map(|v| v as usize);
    let flag = |k: &str| obj.get(k).and_then(Value::as_bool);
    let bad = |message: String| HfError::Config { source_name: source.into(), message };

    if let Some(act) = obj.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(bad(format!("hidden_act `{act}`: ember's MLP is SwiGLU (silu)")));
        }
    }
    if flag("mlp_bias") == Some(true) {
        return Err(bad("mlp_bias = true: ember's MLP projections have no bias".into()));
    }
    let qkv_bias = match arch {
        Architecture::Qwen2 => true,
        _ if flag("attention_bias") == Some(true) => {
            return Err(bad("attention_bias = true (an o_proj bias): ember has q/k/v bias only".into()))
        }
        _ => false,
    };
    let n_heads = get("num_attention_heads")?;
    let rope = obj.get("rope_parameters").and_then(Value::as_object);
    let rope_theta = rope
        .and_then(|r| r.get("rope_theta"))
        .or_else(|| obj.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10_000.0);
    let scaling = rope.or_else(|| obj.get("rope_scaling").and_then(Value::as_object));
    let rope_scaling = match scaling {
        Some(s) => rope_scaling(s).map_err(bad)?,
        None => None,
    };
    let sliding_window = match arch {
        Architecture::Mistral => opt_usize("sliding_window"),
        Architecture::Qwen2 if flag("use_sliding_window") == Some(true) => opt_usize("sliding_window"),
        _ => None,
    };
    let tie_default = false;
    let config = ModelConfig {
        vocab_size: get("vocab_size")?,
        d_model: get("hidden_size")?,
        n_layers: get("num_hidden_layers")?,
        n_heads,
        n_kv_heads: Some(opt_usize("num_key_value_heads").unwrap_or(n_heads)),
        // Kept only when it differs from the default d_model / n_heads (Qwen3, Mistral Nemo).
        head_dim: opt_usize("head_dim").filter(|&h| h * n_heads != get("hidden_size").unwrap_or(0)),
        d_ff: get("intermediate_size")?,
        max_seq_len: get("max_position_embeddings")?,
        rope_theta,
        rope_layout: RopeLayout::HalfSplit,
        rope_scaling,
        sliding_window,
        norm_eps: obj.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
        qkv_bias,
        o_bias: false,
        mlp_bias: false,
        norm: NormKind::RmsNorm,
        norm_bias: false,
        mlp: MlpKind::Swiglu,
        positions: Positions::Rope,
        qk_norm: false,
        sandwich_norms: false,
        parallel_block: false,
        embed_scale: false,
        sliding_window_pattern: None,
        rope_local_theta: None,
        query_pre_attn_scalar: None,
        attn_logit_softcap: None,
        final_logit_softcap: None,
        tie_embeddings: flag("tie_word_embeddings").unwrap_or(tie_default),
        init_std: obj.get("initializer_range").and_then(Value::as_f64).unwrap_or(0.02),
        dropout: 0.0,
    };
    config.validate().map_err(|e| bad(e.to_string()))?;
    Ok((config, arch))
}

fn rope_scaling(s: &Map<String, Value>) -> Result<Option<RopeScaling>, String> {
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    let f = |k: &str| s.get(k).and_then(Value::as_f64).ok_or_else(|| format!("rope scaling `{kind}` without `{k}`"));
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: f("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
        }),
        other => return Err(format!("rope scaling type `{other}` is not supported (default, linear, llama3 are)")),
    })
}

/// A `config.json` for `config` as `arch`. Fields of `base` (the imported model's own config.json)
/// that ember does not model, such as token ids, are kept.
pub fn from_model_config(config: &ModelConfig, arch: Architecture, base: Option<&Value>) -> Value {
    let mut obj = base.and_then(Value::as_object).cloned().unwrap_or_default();
    for k in ["rope_scaling", "rope_theta", "rope_parameters", "sliding_window", "use_sliding_window", "attention_bias"]
    {
        obj.remove(k);
    }
    let mut rope = Map::new();
    rope.insert("rope_theta".into(), json!(config.rope_theta));
    match config.rope_scaling {
        None => {
            rope.insert("rope_type".into(), json!("default"));
        }
        Some(RopeScaling::Linear { factor }) => {
            rope.insert("rope_type".into(), json!("linear"));
            rope.insert("factor".into(), json!(factor));
        }
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            rope.insert("rope_type".into(), json!("llama3"));
            rope.insert("factor".into(), json!(factor));
            rope.insert("low_freq_factor".into(), json!(low_freq_factor));
            rope.insert("high_freq_factor".into(), json!(high_freq_factor));
            rope.insert("original_max_position_embeddings".into(), json!(original_max_position_embeddings));
        }
    }
    let fields = json!({
        "architectures": [arch.class_name()],
        "model_type": arch.model_type(),
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads(),
        "head_dim": config.head_dim(),
        "intermediate_size": config.d_ff,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "rope_parameters": Value::Object(rope),
        "dtype": "float32",
    });
    obj.extend(fields.as_object().expect("object").clone());
    match arch {
        Architecture::Llama => {
            obj.insert("attention_bias".into(), json!(false));
            obj.insert("mlp_bias".into(), json!(false));
        }
        Architecture::Qwen2 => {
            obj.insert("use_sliding_window".into(), json!(config.sliding_window.is_some()));
            obj.insert("sliding_window".into(), json!(config.sliding_window));
        }
        Architecture::Mistral => {
            obj.insert("sliding_window".into(), json!(config.sliding_window));
        }
    }
    Value::Object(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-0.5B's config.json (the fields that matter).
    const QWEN25_05B: &str = r#"{
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 151936
    }"#;

    #[test]
    fn qwen25_05b_maps_to_494m_parameters() {
        let (c, arch) = to_model_config(&serde_json::from_str(QWEN25_05B).unwrap(), "config.json").unwrap();
        assert_eq!(arch, Architecture::Qwen2);
        assert!(c.qkv_bias && c.tie_embeddings);
        assert_eq!(
            (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads(), c.head_dim(), c.d_ff),
            (896, 24, 14, 2, 64, 4864)
        );
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.sliding_window, None, "use_sliding_window = false");
        assert_eq!(c.num_params(), 494_032_768);
    }

    #[test]
    fn round_trip_keeps_the_config() {
        let (c, arch) = to_model_config(&serde_json::from_str(QWEN25_05B).unwrap(), "config.json").unwrap();
        let back = from_model_config(&c, arch, None);
        let (c2, arch2) = to_model_config(&back, "out").unwrap();
        assert_eq!((c2, arch2), (c, arch));
    }

    #[test]
    fn unsupported_input_is_named() {
        let e = to_model_config(&json!({"architectures": ["GPT2LMHeadModel"]}), "gpt2/config.json").unwrap_err();
        assert_eq!(
            e.to_string(),
            "gpt2/config.json: architecture `GPT2LMHeadModel` is not supported (Llama, Qwen2 and Mistral are)"
        );
        let mut v: Value = serde_json::from_str(QWEN25_05B).unwrap();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = to_model_config(&v, "c.json").unwrap_err();
        assert_eq!(e.to_string(), "c.json: missing field `hidden_size`");
        v["hidden_size"] = json!(896);
        v["hidden_act"] = json!("gelu");
        let e = to_model_config(&v, "c.json").unwrap_err();
        assert!(e.to_string().contains("hidden_act `gelu`"), "{e}");
        v["hidden_act"] = json!("silu");
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = to_model_config(&v, "c.json").unwrap_err();
        assert!(e.to_string().contains("`yarn` is not supported"), "{e}");
    }
}
