//! `config.json` <-> [`ModelConfig`] for every family (`families/`): the sizes under each
//! family's key names, then each family's own keys, read and written by its functions; and whether
//! a family can hold a model ([`expressible`]).

use ember_model::{MlpKind, ModelConfig, NormKind, Positions, RopeLayout};
use serde_json::{json, Map, Value};

use crate::config_json::Reader;
use crate::error::HfError;
use crate::family::Architecture;

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
    let arch = Architecture::from_class(class).ok_or_else(|| HfError::Unsupported {
        source_name: source.into(),
        architecture: class.into(),
        supported: Architecture::supported_classes(),
    })?;
    let family = arch.family();
    let (r, k) = (Reader::new(obj, source), &family.keys);

    let mlp = match r.get(k.activation).map(|v| v.as_str().ok_or(v)) {
        None => family.activations[0].1,
        Some(act) => {
            let found = act.ok().and_then(|a| family.activations.iter().find(|(name, _)| *name == a));
            let Some(&(_, mlp)) = found else {
                let names: Vec<&str> = family.activations.iter().map(|(n, _)| *n).collect();
                let act = act.map_or_else(|v| v.to_string(), |a| format!("`{a}`"));
                return Err(r.bad(format!("{} {act}: ember runs {class} with {}", k.activation, names.join(" or "))));
            };
            mlp
        }
    };
    let n_heads = r.usize(k.n_heads)?;
    let d_model = r.usize(k.d_model)?;
    let d_ff = match (k.d_ff_default, r.get(k.d_ff)) {
        (Some(times), None) => d_model.saturating_mul(times),
        _ => r.usize(k.d_ff)?,
    };
    let mut config = ModelConfig {
        vocab_size: r.usize("vocab_size")?,
        d_model,
        n_layers: r.usize(k.n_layers)?,
        n_heads,
        n_kv_heads: Some(k.n_kv_heads.and_then(|key| r.opt_usize(key)).unwrap_or(n_heads)),
        // Kept only when it differs from the default d_model / n_heads (Qwen3, Mistral Nemo).
        head_dim: k.head_dim.and_then(|key| r.opt_usize(key)).filter(|&h| h.checked_mul(n_heads) != Some(d_model)),
        d_ff,
        max_seq_len: r.usize(k.max_seq_len)?,
        norm_eps: r.f64(k.norm_eps.0).unwrap_or(k.norm_eps.1),
        mlp,
        tie_embeddings: r.flag("tie_word_embeddings").unwrap_or(k.tie_default),
        init_std: r.f64("initializer_range").unwrap_or(0.02),
        ..family.base_config()
    };
    (family.read)(&r, &mut config)?;
    config.validate().map_err(|e| r.bad(e.to_string()))?;
    Ok((config, arch))
}

/// A `config.json` for `config` as `arch`. Fields of `base` (the imported model's own config.json)
/// that ember does not model, such as token ids, are kept. Check [`expressible`] first: this writes
/// what it can.
pub fn from_model_config(config: &ModelConfig, arch: Architecture, base: Option<&Value>) -> Value {
    let family = arch.family();
    let k = &family.keys;
    let mut obj = base.and_then(Value::as_object).cloned().unwrap_or_default();
    for key in family.replaced_keys.iter().flat_map(|group| group.iter()) {
        obj.remove(*key);
    }
    let activation = family.activations.iter().find(|(_, m)| *m == config.mlp).unwrap_or(&family.activations[0]).0;
    let d_ff = match k.d_ff_default {
        Some(times) if config.d_ff == config.d_model * times => Value::Null,
        _ => json!(config.d_ff),
    };
    let mut fields = vec![
        ("architectures", json!([family.class_name])),
        ("model_type", json!(family.model_type)),
        ("vocab_size", json!(config.vocab_size)),
        (k.d_model, json!(config.d_model)),
        (k.n_layers, json!(config.n_layers)),
        (k.n_heads, json!(config.n_heads)),
        (k.d_ff, d_ff),
        (k.max_seq_len, json!(config.max_seq_len)),
        (k.norm_eps.0, json!(config.norm_eps)),
        (k.activation, json!(activation)),
        ("tie_word_embeddings", json!(config.tie_embeddings)),
        ("initializer_range", json!(config.init_std)),
        ("dtype", json!("float32")),
    ];
    if let Some(key) = k.n_kv_heads {
        fields.push((key, json!(config.n_kv_heads())));
    }
    if let Some(key) = k.head_dim {
        fields.push((key, json!(config.head_dim())));
    }
    obj.extend(fields.into_iter().map(|(key, v)| (key.to_string(), v)));
    (family.write)(config, &mut obj);
    Value::Object(obj)
}

/// Whether `arch` can hold `config`: what [`from_model_config`] writes must read back to the same
/// model. The error lists each field that would change (a GPT-2 without biases, a Llama with
/// LayerNorm), so that an export never writes a folder that transformers runs differently.
pub fn expressible(config: &ModelConfig, arch: Architecture) -> Result<(), HfError> {
    let class = arch.class_name();
    // Gains kept as GGUF keeps them are written the family's way (`Parts::holds_norm`).
    let family = arch.family();
    let parts = family.parts;
    let config =
        &ModelConfig { norm: if parts.holds_norm(config.norm) { parts.norm } else { config.norm }, ..config.clone() };
    // A family whose files have no balancing loss (DeepSeek's): its weight is training's.
    let mut config = config.clone();
    if let Some(moe) = config.moe.as_mut().filter(|_| !family.aux_loss_in_config) {
        moe.aux_loss_coef = 0.0;
    }
    let back =
        to_model_config(&from_model_config(&config, arch, None), &format!("{class} config.json")).map(|(c, _)| c);
    differences(&config, back, class)
}

/// `Ok` when `back` (what a file written for `config` reads back to) is the same model as `config`;
/// otherwise the error lists each field that differs, naming the format `name`.
pub(crate) fn differences(config: &ModelConfig, back: Result<ModelConfig, HfError>, name: &str) -> Result<(), HfError> {
    let back = back.map(|c| canonical(&c));
    let want = canonical(config);
    let back = match back {
        Ok(back) if back == want => return Ok(()),
        Ok(back) => back,
        Err(e) => return Err(HfError::Inexpressible { architecture: name.into(), fields: vec![e.to_string()] }),
    };
    let (want, back) = (serde_json::to_value(&want), serde_json::to_value(&back));
    let (Ok(Value::Object(want)), Ok(Value::Object(back))) = (want, back) else {
        return Err(HfError::Inexpressible { architecture: name.into(), fields: vec![] });
    };
    let mut keys: Vec<&String> = want.keys().chain(back.keys()).collect();
    keys.sort();
    keys.dedup();
    // A field left out of the serialised config has its default.
    let value = |config: &Map<String, Value>, other: &Map<String, Value>, key: &str| {
        config.get(key).cloned().unwrap_or_else(|| match key {
            "norm" => json!(NormKind::default()),
            "mlp" => json!(MlpKind::default()),
            "positions" => json!(Positions::default()),
            _ if other.get(key).is_some_and(Value::is_boolean) => json!(false),
            _ => Value::Null,
        })
    };
    let fields = keys
        .into_iter()
        .filter_map(|key| {
            let (w, b) = (value(&want, &back, key), value(&back, &want, key));
            (w != b).then(|| format!("model.{key} is {w}, {name} has {b}"))
        })
        .collect();
    Err(HfError::Inexpressible { architecture: name.into(), fields })
}

/// One form of each model: the fields that do not change what it computes, as a reader leaves
/// them (`n_kv_heads` and `head_dim` spelled out or not; RoPE, whose layout exports convert, with
/// learned positions; windows on no layer; training-only dropout).
fn canonical(c: &ModelConfig) -> ModelConfig {
    let mut c = c.clone();
    c.n_kv_heads = Some(c.n_kv_heads());
    c.head_dim = c.head_dim.filter(|&h| h.checked_mul(c.n_heads) != Some(c.d_model));
    if c.mla.is_none() {
        c.rope_layout = RopeLayout::HalfSplit; // exports permute the q/k columns; latent attention's stay as they are
    }
    c.dropout = 0.0;
    c.zero_init_out = false; // how training started, not the architecture
    if let Some(moe) = c.moe.as_mut() {
        if moe.dense_layers == 0 {
            c.d_ff = 0; // no block has an MLP
        }
        moe.z_loss_coef = 0.0; // how training goes, not the architecture
        moe.bias_update_rate = 0.0;
    }
    let local = (0..c.n_layers).filter(|&l| c.is_local(l)).count();
    if local == 0 {
        c.sliding_window = None;
    }
    if local == 0 || local == c.n_layers {
        c.sliding_window_pattern = None;
    }
    if local == 0 || c.rope_local_theta == Some(c.rope_theta) {
        c.rope_local_theta = None;
    }
    if c.query_pre_attn_scalar == Some(c.head_dim() as f64) {
        c.query_pre_attn_scalar = None;
    }
    if c.positions == Positions::Learned {
        c.rope_theta = 10_000.0;
        c.rope_scaling = None;
        c.rope_local_theta = None;
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::qwen::QWEN2;

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
        assert_eq!(arch, QWEN2.architecture());
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

    /// The speedrun's squared ReLU has no Hugging Face family: the export says so by name; a model
    /// that started with zeroed output projections is the same architecture and exports.
    #[test]
    fn relu2_is_inexpressible_and_zero_init_out_is_not_architecture() {
        let (c, arch) = to_model_config(&serde_json::from_str(QWEN25_05B).unwrap(), "config.json").unwrap();
        let relu2 = ModelConfig { mlp: MlpKind::Relu2, ..c.clone() };
        let e = expressible(&relu2, Architecture::for_model(&relu2)).unwrap_err().to_string();
        assert!(e.contains("mlp") && e.contains("relu2"), "{e}");
        expressible(&ModelConfig { zero_init_out: true, ..c }, arch).unwrap();
    }

    #[test]
    fn unsupported_input_is_named() {
        let e = to_model_config(&json!({"architectures": ["PhiForCausalLM"]}), "phi/config.json").unwrap_err();
        assert_eq!(
            e.to_string(),
            "phi/config.json: architecture `PhiForCausalLM` is not supported (LlamaForCausalLM, \
             Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, GPT2LMHeadModel, \
             MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, \
             DeepseekV2ForCausalLM and DeepseekV3ForCausalLM are)"
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
        assert!(e.to_string().contains("`yarn` without `original_max_position_embeddings`"), "{e}");
        v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
        let e = to_model_config(&v, "c.json").unwrap_err();
        assert!(e.to_string().contains("`dynamic` is not supported"), "{e}");
    }
}
