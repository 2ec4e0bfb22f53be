//! `config.json` <-> [`ModelConfig`] for every family of the table in [`crate::family`]: the sizes
//! under each family's key names, then each family's own keys, read and written by the functions
//! below.
//!
//! Both RoPE spellings are read: transformers 5's `rope_parameters` (`rope_theta` and `rope_type`
//! inside; per layer type for Gemma 3) and the older top-level `rope_theta` with `rope_scaling`
//! (and Gemma 3's `rope_local_base_freq`). Exports write transformers 5's.

use ember_model::{MlaConfig, MlpKind, ModelConfig, MoeConfig, NormKind, Positions, RopeLayout, RopeScaling, Scoring};
use serde_json::{json, Map, Value};

use crate::error::HfError;
pub use crate::family::Architecture;

/// A parsed `config.json` and the file it came from, for errors.
pub struct Reader<'a> {
    obj: &'a Map<String, Value>,
    source: &'a str,
}

impl Reader<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &'static str) -> Result<usize, HfError> {
        self.opt_usize(key).ok_or(HfError::MissingField { source_name: self.source.into(), field: key })
    }

    fn opt_usize(&self, key: &str) -> Option<usize> {
        self.get(key).and_then(Value::as_u64).map(|v| v as usize)
    }

    fn flag(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    fn f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    fn bad(&self, message: String) -> HfError {
        HfError::Config { source_name: self.source.into(), message }
    }

    /// An error unless `key` is absent or `want` (the value ember's family always has).
    fn require(&self, key: &str, want: bool, why: &str) -> Result<(), HfError> {
        match self.flag(key) {
            Some(v) if v != want => Err(self.bad(format!("{key} = {v}: {why}"))),
            _ => Ok(()),
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
    let family = arch.family();
    let (r, k) = (Reader { obj, source }, &family.keys);

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
    let parts = family.parts;
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
        rope_theta: 10_000.0,
        rope_layout: RopeLayout::HalfSplit,
        rope_scaling: None,
        sliding_window: None,
        norm_eps: r.f64(k.norm_eps.0).unwrap_or(k.norm_eps.1),
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        norm: parts.norm,
        norm_bias: false,
        mlp,
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
        tie_embeddings: r.flag("tie_word_embeddings").unwrap_or(k.tie_default),
        init_std: r.f64("initializer_range").unwrap_or(0.02),
        dropout: 0.0,
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
    // Gains kept as GGUF keeps them are written the family's way ([`crate::family::Parts::holds_norm`]).
    let parts = arch.family().parts;
    let config =
        &ModelConfig { norm: if parts.holds_norm(config.norm) { parts.norm } else { config.norm }, ..config.clone() };
    // DeepSeek's files have no balancing loss (transformers computes none): its weight is training's.
    let mut config = config.clone();
    if let Some(moe) =
        config.moe.as_mut().filter(|_| matches!(arch, Architecture::DeepseekV2 | Architecture::DeepseekV3))
    {
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

// ---- Llama, Qwen2, Mistral ----

fn read_llama_like(r: &Reader, c: &mut ModelConfig, qkv_bias: bool) -> Result<(), HfError> {
    if r.flag("mlp_bias") == Some(true) {
        return Err(r.bad("mlp_bias = true: ember reads MLP biases for GPT-2 only".into()));
    }
    if !qkv_bias && r.flag("attention_bias") == Some(true) {
        return Err(r.bad("attention_bias = true (an o_proj bias): ember reads q/k/v bias only here".into()));
    }
    c.qkv_bias = qkv_bias;
    (c.rope_theta, c.rope_scaling) = read_rope(r, r.get("rope_parameters").and_then(Value::as_object), 10_000.0)?;
    Ok(())
}

pub(crate) fn read_llama(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, false)
}

pub(crate) fn read_qwen2(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, true)?;
    if r.flag("use_sliding_window") == Some(true) {
        c.sliding_window = r.opt_usize("sliding_window");
    }
    Ok(())
}

pub(crate) fn read_mistral(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, false)?;
    c.sliding_window = r.opt_usize("sliding_window");
    Ok(())
}

pub(crate) fn write_llama(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(false));
    obj.insert("mlp_bias".into(), json!(false));
}

pub(crate) fn write_qwen2(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("use_sliding_window".into(), json!(c.sliding_window.is_some()));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
}

pub(crate) fn write_mistral(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
}

// ---- Qwen3: Qwen2 with q/k norms, no q/k/v bias by default, an explicit head_dim ----

pub(crate) fn read_qwen3(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    // `attention_bias` puts a bias on all four projections, o_proj included.
    let bias = r.flag("attention_bias").unwrap_or(false);
    (c.qkv_bias, c.o_bias) = (bias, bias);
    r.require("use_sliding_window", false, "ember reads Qwen3 without sliding windows")?;
    (c.rope_theta, c.rope_scaling) = read_rope(r, r.get("rope_parameters").and_then(Value::as_object), 10_000.0)?;
    Ok(())
}

pub(crate) fn write_qwen3(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(c.qkv_bias));
    obj.insert("use_sliding_window".into(), json!(false));
    obj.insert("sliding_window".into(), Value::Null);
    obj.insert("layer_types".into(), json!(vec!["full_attention"; c.n_layers]));
}

// ---- Mixtral, Qwen2-MoE, Qwen3-MoE: experts in every block ----

/// The experts' keys: `experts` is the key of their count (`num_local_experts` for Mixtral,
/// `num_experts` for Qwen's, either read), `width` of an expert's width, and `norm_topk` whether
/// the family renormalises the top-k weights when its config does not say. Dense layers
/// (`mlp_only_layers`, `decoder_sparse_step` above 1) are refused: every ember block of a
/// mixture-of-experts model has experts.
fn read_experts(r: &Reader, width: &'static str, norm_topk: bool) -> Result<MoeConfig, HfError> {
    let n_experts = match r.opt_usize("num_experts").or_else(|| r.opt_usize("num_local_experts")) {
        Some(n) => n,
        None => r.usize("num_local_experts")?,
    };
    if r.opt_usize("decoder_sparse_step").is_some_and(|s| s > 1) {
        return Err(r.bad(
            "decoder_sparse_step > 1 (dense layers between the sparse ones): ember builds every \
                          block of a mixture-of-experts model with experts"
                .into(),
        ));
    }
    if r.get("mlp_only_layers").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        return Err(r.bad(
            "mlp_only_layers is not empty: ember builds every block of a mixture-of-experts \
                          model with experts"
                .into(),
        ));
    }
    if r.f64("router_jitter_noise").is_some_and(|j| j != 0.0) {
        return Err(r.bad("router_jitter_noise is not 0: ember's router adds no noise".into()));
    }
    Ok(MoeConfig {
        n_experts,
        top_k: r.usize("num_experts_per_tok")?,
        d_expert: r.usize(width)?,
        norm_topk: r.flag("norm_topk_prob").unwrap_or(norm_topk),
        shared_expert: None,
        shared_expert_gate: false,
        aux_loss_coef: r.f64("router_aux_loss_coef").unwrap_or(0.001),
        z_loss_coef: 0.0,
        ..Default::default()
    })
}

/// Writes the experts' keys, their count under each of `counts` (as transformers 5 writes the
/// family: it reads either).
fn write_experts(c: &ModelConfig, obj: &mut Map<String, Value>, counts: &[&str], width: &str) {
    let Some(moe) = &c.moe else { return };
    for count in counts {
        obj.insert((*count).into(), json!(moe.n_experts));
    }
    obj.insert("num_experts_per_tok".into(), json!(moe.top_k));
    obj.insert(width.into(), json!(moe.d_expert));
    obj.insert("router_aux_loss_coef".into(), json!(moe.aux_loss_coef));
    if width != "intermediate_size" {
        obj.insert("norm_topk_prob".into(), json!(moe.norm_topk));
        obj.insert("decoder_sparse_step".into(), json!(1));
        obj.insert("mlp_only_layers".into(), json!([]));
    }
}

pub(crate) fn read_mixtral(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_mistral(r, c)?;
    if r.flag("norm_topk_prob") == Some(false) {
        return Err(r.bad("norm_topk_prob = false: Mixtral renormalises its top-k weights".into()));
    }
    c.moe = Some(read_experts(r, "intermediate_size", true)?);
    Ok(())
}

pub(crate) fn write_mixtral(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_mistral(c, obj);
    // transformers' Mixtral writes `null` for d_model / n_heads.
    obj.insert("head_dim".into(), json!(c.head_dim));
    write_experts(c, obj, &["num_local_experts"], "intermediate_size");
}

pub(crate) fn read_qwen2_moe(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_qwen2(r, c)?;
    c.qkv_bias = r.flag("qkv_bias").unwrap_or(true);
    let mut moe = read_experts(r, "moe_intermediate_size", false)?;
    // Qwen2-MoE always has the shared expert, behind its sigmoid gate.
    moe.shared_expert = Some(r.usize("shared_expert_intermediate_size")?);
    moe.shared_expert_gate = true;
    c.moe = Some(moe);
    Ok(())
}

pub(crate) fn write_qwen2_moe(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_qwen2(c, obj);
    // transformers' Qwen2-MoE has no head_dim key (it reads one if present), and writes 0 for no window.
    if c.head_dim.is_none() {
        obj.remove("head_dim");
    }
    obj.insert("sliding_window".into(), json!(c.sliding_window.unwrap_or(0)));
    obj.insert("qkv_bias".into(), json!(c.qkv_bias));
    write_experts(c, obj, &["num_experts"], "moe_intermediate_size");
    let shared = c.moe.as_ref().and_then(|m| m.shared_expert);
    obj.insert("shared_expert_intermediate_size".into(), json!(shared));
}

pub(crate) fn read_qwen3_moe(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_qwen3(r, c)?;
    c.moe = Some(read_experts(r, "moe_intermediate_size", false)?);
    Ok(())
}

pub(crate) fn write_qwen3_moe(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_qwen3(c, obj);
    obj.remove("layer_types"); // transformers' Qwen3-MoE has none
    write_experts(c, obj, &["num_local_experts"], "moe_intermediate_size");
}

pub(crate) fn read_olmoe(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_llama_like(r, c, false)?;
    if r.f64("clip_qkv").is_some() {
        return Err(r.bad("clip_qkv is set: ember does not clamp the queries, keys and values".into()));
    }
    c.moe = Some(read_experts(r, "intermediate_size", false)?);
    Ok(())
}

pub(crate) fn write_olmoe(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(false));
    obj.insert("clip_qkv".into(), Value::Null);
    obj.remove("head_dim"); // OLMoE's heads are d_model / n_heads
    write_experts(c, obj, &["num_experts"], "intermediate_size");
    if let Some(moe) = &c.moe {
        obj.insert("norm_topk_prob".into(), json!(moe.norm_topk));
    }
}

// ---- DeepSeek-V2, V3: latent attention, experts after the first dense layers ----

/// DeepSeek's keys. V2: softmax scores, routing `greedy` or `group_limited_greedy` (a group scored
/// by its best expert), weights not renormalised; V3: sigmoid scores with the selection bias, every
/// token's experts from the best `topk_group` of `n_group` groups (a group scored by its best two),
/// renormalised per `norm_topk_prob`. Both: `routed_scaling_factor`, `n_shared_experts` plain shared
/// experts of `moe_intermediate_size` (one MLP `n_shared_experts` times as wide), dense MLPs of
/// `intermediate_size` in the first `first_k_dense_replace` layers, RoPE on interleaved pairs
/// (V3 unless `rope_interleave` is false). transformers computes no auxiliary loss for either: the
/// coefficient is 0.
fn read_deepseek(r: &Reader, c: &mut ModelConfig, v3: bool) -> Result<(), HfError> {
    let bias = r.flag("attention_bias").unwrap_or(false);
    (c.qkv_bias, c.o_bias) = (bias, bias);
    if r.flag("mlp_bias") == Some(true) {
        return Err(r.bad("mlp_bias = true: ember's experts and DeepSeek's MLPs have no biases".into()));
    }
    (c.rope_theta, c.rope_scaling) = read_rope(r, r.get("rope_parameters").and_then(Value::as_object), 10_000.0)?;
    let interleaved = !v3 || r.flag("rope_interleave").unwrap_or(true);
    c.rope_layout = if interleaved { RopeLayout::Interleaved } else { RopeLayout::HalfSplit };
    // Latent attention's head widths are its own; `head_dim` is the rotary part, `num_key_value_heads` unused.
    (c.head_dim, c.n_kv_heads) = (None, None);
    // An absent q_lora_rank is the class default (1536); null is no low-rank query.
    let q_rank = match r.obj.get("q_lora_rank") {
        None => Some(1536),
        Some(_) => r.opt_usize("q_lora_rank"),
    };
    c.mla = Some(MlaConfig {
        q_rank,
        kv_rank: r.usize("kv_lora_rank")?,
        nope_dim: r.usize("qk_nope_head_dim")?,
        rope_dim: r.usize("qk_rope_head_dim")?,
        v_dim: r.usize("v_head_dim")?,
        norm_eps: 1e-6,
    });
    if r.opt_usize("moe_layer_freq").is_some_and(|f| f != 1) {
        return Err(r.bad("moe_layer_freq is not 1: ember's experts are in every layer after the dense ones".into()));
    }
    let scoring = match r.get("scoring_func").and_then(Value::as_str) {
        None => {
            if v3 {
                Scoring::Sigmoid
            } else {
                Scoring::Softmax
            }
        }
        Some("sigmoid") => Scoring::Sigmoid,
        Some("softmax") => Scoring::Softmax,
        Some(other) => return Err(r.bad(format!("scoring_func `{other}`: ember scores experts by softmax or sigmoid"))),
    };
    let grouped = |groups: usize, top: usize| (groups > 1).then_some((groups, top));
    let groups = if v3 {
        grouped(r.opt_usize("n_group").unwrap_or(8), r.opt_usize("topk_group").unwrap_or(4))
    } else {
        match r.get("topk_method").and_then(Value::as_str).unwrap_or("greedy") {
            "greedy" => None,
            "group_limited_greedy" => grouped(r.usize("n_group")?, r.usize("topk_group")?),
            other => {
                return Err(
                    r.bad(format!("topk_method `{other}`: ember routes DeepSeek-V2 by greedy or group_limited_greedy"))
                )
            }
        }
    };
    let moe_width = r.usize("moe_intermediate_size")?;
    let shared = r.opt_usize("n_shared_experts").unwrap_or(if v3 { 1 } else { 2 });
    c.moe = Some(MoeConfig {
        n_experts: r.usize("n_routed_experts")?,
        top_k: r.usize("num_experts_per_tok")?,
        d_expert: moe_width,
        norm_topk: v3 && r.flag("norm_topk_prob").unwrap_or(true),
        shared_expert: match shared {
            0 => None,
            n => Some(n.checked_mul(moe_width).ok_or_else(|| r.bad(format!("n_shared_experts {n}: too many")))?),
        },
        shared_expert_gate: false,
        aux_loss_coef: 0.0,
        z_loss_coef: 0.0,
        scoring,
        selection_bias: v3,
        groups: groups.map(|g| g.0),
        top_groups: groups.map(|g| g.1),
        routed_scale: r.f64("routed_scaling_factor").unwrap_or(if v3 { 2.5 } else { 1.0 }),
        dense_layers: r.opt_usize("first_k_dense_replace").unwrap_or(if v3 { 3 } else { 0 }),
        bias_update_rate: 0.0,
    });
    Ok(())
}

pub(crate) fn read_deepseek_v2(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_deepseek(r, c, false)
}

pub(crate) fn read_deepseek_v3(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_deepseek(r, c, true)
}

fn write_deepseek(c: &ModelConfig, obj: &mut Map<String, Value>, v3: bool) {
    obj.insert("rope_parameters".into(), rope_parameters(c.rope_theta, c.rope_scaling.as_ref()));
    obj.insert("attention_bias".into(), json!(c.qkv_bias));
    if let Some(mla) = &c.mla {
        let entries = [
            ("q_lora_rank", json!(mla.q_rank)),
            ("kv_lora_rank", json!(mla.kv_rank)),
            ("qk_nope_head_dim", json!(mla.nope_dim)),
            ("qk_rope_head_dim", json!(mla.rope_dim)),
            ("v_head_dim", json!(mla.v_dim)),
            ("head_dim", json!(mla.rope_dim)),
            ("qk_head_dim", json!(mla.qk_dim())),
            ("num_key_value_heads", json!(c.n_heads)),
        ];
        obj.extend(entries.into_iter().map(|(k, v)| (k.to_string(), v)));
    }
    if v3 {
        obj.insert("rope_interleave".into(), json!(c.rope_layout == RopeLayout::Interleaved));
    }
    let Some(moe) = &c.moe else { return };
    let shared = moe.shared_expert.map_or(0, |s| s / moe.d_expert.max(1));
    let (groups, top) = (moe.groups.unwrap_or(1), moe.top_groups.unwrap_or(1));
    let entries = [
        ("n_routed_experts", json!(moe.n_experts)),
        ("num_experts_per_tok", json!(moe.top_k)),
        ("moe_intermediate_size", json!(moe.d_expert)),
        ("n_shared_experts", json!(shared)),
        ("routed_scaling_factor", json!(moe.routed_scale)),
        ("first_k_dense_replace", json!(moe.dense_layers)),
        ("norm_topk_prob", json!(moe.norm_topk)),
        ("n_group", json!(groups)),
        ("topk_group", json!(top)),
    ];
    obj.extend(entries.into_iter().map(|(k, v)| (k.to_string(), v)));
    if !v3 {
        let method = if moe.groups.is_some() { "group_limited_greedy" } else { "greedy" };
        obj.insert("topk_method".into(), json!(method));
        obj.insert("mlp_bias".into(), json!(false));
    }
}

pub(crate) fn write_deepseek_v2(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_deepseek(c, obj, false);
}

pub(crate) fn write_deepseek_v3(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_deepseek(c, obj, true);
}

// ---- Gemma 3 ----

/// Gemma 3's defaults where its config.json is silent (transformers' `Gemma3TextConfig`).
const GEMMA3_HEAD_DIM: usize = 256;
const GEMMA3_PATTERN: usize = 6;
const GEMMA3_THETA: (f64, f64) = (1e6, 1e4);

pub(crate) fn read_gemma3(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    if r.opt_usize("head_dim").is_none() {
        c.head_dim = Some(GEMMA3_HEAD_DIM).filter(|&h| h.checked_mul(c.n_heads) != Some(c.d_model));
    }
    r.require("use_bidirectional_attention", false, "ember's attention is causal")?;
    let bias = r.flag("attention_bias").unwrap_or(false);
    (c.qkv_bias, c.o_bias) = (bias, bias);
    c.attn_logit_softcap = r.f64("attn_logit_softcapping");
    c.final_logit_softcap = r.f64("final_logit_softcapping");
    let scalar = r.f64("query_pre_attn_scalar").unwrap_or(GEMMA3_HEAD_DIM as f64);
    c.query_pre_attn_scalar = Some(scalar).filter(|&s| s != c.head_dim() as f64);

    // Which layers attend within the window: `layer_types` (transformers 5), else every
    // `sliding_window_pattern`-th layer full (4.x).
    let local: Vec<bool> = match r.get("layer_types") {
        Some(types) => {
            let list = types.as_array().filter(|l| l.len() == c.n_layers);
            let list = list
                .ok_or_else(|| r.bad(format!("layer_types {types}: expected a list of {} layer types", c.n_layers)))?;
            list.iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(r.bad(format!("layer_types: `{t}` is neither sliding_attention nor full_attention"))),
                })
                .collect::<Result<_, _>>()?
        }
        None => {
            let key =
                ["sliding_window_pattern", "_sliding_window_pattern"].into_iter().find_map(|k| Some((k, r.get(k)?)));
            let p = match key {
                Some((key, v)) => v
                    .as_u64()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| r.bad(format!("{key} = {v}: expected a positive integer")))?
                    as usize,
                None => GEMMA3_PATTERN,
            };
            (0..c.n_layers).map(|l| (l + 1) % p != 0).collect()
        }
    };
    c.sliding_window = r.opt_usize("sliding_window").filter(|_| local.contains(&true));
    // With some layers full: every p-th one, p the first full layer's position.
    if let Some(first_full) = local.iter().position(|&l| !l).filter(|_| c.sliding_window.is_some()) {
        let p = first_full + 1;
        if local.iter().enumerate().any(|(l, &is_local)| is_local != ((l + 1) % p != 0)) {
            let types: Vec<&str> = local.iter().map(|&l| if l { "sliding" } else { "full" }).collect();
            return Err(r.bad(format!(
                "layer_types [{}]: ember runs a sliding-window pattern of every p-th layer full, and this is not one",
                types.join(", ")
            )));
        }
        c.sliding_window_pattern = Some(p);
    }

    // RoPE: per layer type (transformers 5), or `rope_theta`, `rope_scaling` and
    // `rope_local_base_freq` (4.x).
    let params = r.get("rope_parameters").and_then(Value::as_object);
    let per_type = params.filter(|p| p.contains_key("full_attention") || p.contains_key("sliding_attention"));
    let (full, sliding) = match per_type {
        Some(p) => {
            (p.get("full_attention").and_then(Value::as_object), p.get("sliding_attention").and_then(Value::as_object))
        }
        None => (params, None),
    };
    (c.rope_theta, c.rope_scaling) = read_rope(r, full, GEMMA3_THETA.0)?;
    let local_theta = match sliding {
        Some(s) => {
            if let Some(kind) = s.get("rope_type").and_then(Value::as_str).filter(|&k| k != "default") {
                return Err(r.bad(format!(
                    "rope_parameters.sliding_attention.rope_type `{kind}`: ember's sliding-window layers take no RoPE scaling"
                )));
            }
            s.get("rope_theta").and_then(Value::as_f64).unwrap_or(GEMMA3_THETA.1)
        }
        None => r.f64("rope_local_base_freq").unwrap_or(GEMMA3_THETA.1),
    };
    let any_local = (0..c.n_layers).any(|l| c.is_local(l));
    c.rope_local_theta = Some(local_theta).filter(|&t| any_local && t != c.rope_theta);
    Ok(())
}

pub(crate) fn write_gemma3(c: &ModelConfig, obj: &mut Map<String, Value>) {
    let types: Vec<&str> =
        (0..c.n_layers).map(|l| if c.is_local(l) { "sliding_attention" } else { "full_attention" }).collect();
    let local_theta = c.rope_local_theta.unwrap_or(c.rope_theta);
    let scalar = c.query_pre_attn_scalar.unwrap_or(c.head_dim() as f64);
    let entries = [
        ("layer_types", json!(types)),
        ("sliding_window", json!(c.sliding_window)),
        (
            "rope_parameters",
            json!({
                "full_attention": rope_parameters(c.rope_theta, c.rope_scaling.as_ref()),
                "sliding_attention": rope_parameters(local_theta, None),
            }),
        ),
        // An integer where it is one: transformers types the field `int`.
        ("query_pre_attn_scalar", if scalar.fract() == 0.0 { json!(scalar as u64) } else { json!(scalar) }),
        ("attention_bias", json!(c.qkv_bias)),
        ("attn_logit_softcapping", json!(c.attn_logit_softcap)),
        ("final_logit_softcapping", json!(c.final_logit_softcap)),
    ];
    obj.extend(entries.into_iter().map(|(k, v)| (k.to_string(), v)));
    if let Some(p) = c.sliding_window_pattern.filter(|_| c.sliding_window.is_some()) {
        obj.insert("sliding_window_pattern".into(), json!(p));
    }
}

// ---- GPT-2 ----

pub(crate) fn read_gpt2(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    r.require("scale_attn_weights", true, "ember always scales attention scores by 1/sqrt(head_dim)")?;
    r.require("scale_attn_by_inverse_layer_idx", false, "ember does not scale scores by layer")?;
    r.require("reorder_and_upcast_attn", false, "ember does not run GPT-2's reordered attention")?;
    r.require("add_cross_attention", false, "ember's blocks have no cross-attention")?;
    (c.qkv_bias, c.o_bias, c.mlp_bias, c.norm_bias) = (true, true, true, true);
    Ok(())
}

pub(crate) fn write_gpt2(_: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("scale_attn_weights".into(), json!(true));
    obj.insert("scale_attn_by_inverse_layer_idx".into(), json!(false));
    obj.insert("reorder_and_upcast_attn".into(), json!(false));
}

// ---- RoPE ----

/// `rope_theta` and the scaling of a RoPE parameter object (`rope_parameters`, or `None` for an
/// older config.json: its top-level `rope_theta` and `rope_scaling`).
fn read_rope(
    r: &Reader,
    params: Option<&Map<String, Value>>,
    default_theta: f64,
) -> Result<(f64, Option<RopeScaling>), HfError> {
    let theta = params.and_then(|p| p.get("rope_theta")).or_else(|| r.get("rope_theta")).and_then(Value::as_f64);
    let scaling = match params.or_else(|| r.get("rope_scaling").and_then(Value::as_object)) {
        Some(s) => rope_scaling(s).map_err(|m| r.bad(m))?,
        None => None,
    };
    Ok((theta.unwrap_or(default_theta), scaling))
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
        "yarn" => {
            let opt = |k: &str| s.get(k).and_then(Value::as_f64);
            Some(RopeScaling::Yarn {
                factor: f("factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
                beta_fast: opt("beta_fast").unwrap_or(32.0),
                beta_slow: opt("beta_slow").unwrap_or(1.0),
                mscale: opt("mscale"),
                mscale_all_dim: opt("mscale_all_dim"),
                attention_factor: opt("attention_factor"),
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            })
        }
        other => {
            return Err(format!("rope scaling type `{other}` is not supported (default, linear, llama3, yarn are)"))
        }
    })
}

/// transformers 5's `rope_parameters` object.
fn rope_parameters(theta: f64, scaling: Option<&RopeScaling>) -> Value {
    let mut rope = Map::new();
    rope.insert("rope_theta".into(), json!(theta));
    match scaling {
        None => {
            rope.insert("rope_type".into(), json!("default"));
        }
        Some(&RopeScaling::Linear { factor }) => {
            rope.insert("rope_type".into(), json!("linear"));
            rope.insert("factor".into(), json!(factor));
        }
        Some(&RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            rope.insert("rope_type".into(), json!("llama3"));
            rope.insert("factor".into(), json!(factor));
            rope.insert("low_freq_factor".into(), json!(low_freq_factor));
            rope.insert("high_freq_factor".into(), json!(high_freq_factor));
            rope.insert("original_max_position_embeddings".into(), json!(original_max_position_embeddings));
        }
        Some(&RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            truncate,
        }) => {
            // Integers where they are (transformers writes its defaults 32 and 1 so); `truncate` only
            // when it is not the default.
            let number = |x: f64| if x.fract() == 0.0 && x.abs() < 1e15 { json!(x as i64) } else { json!(x) };
            let entries = [
                ("rope_type", json!("yarn")),
                ("factor", json!(factor)),
                ("original_max_position_embeddings", json!(original_max_position_embeddings)),
                ("beta_fast", number(beta_fast)),
                ("beta_slow", number(beta_slow)),
            ];
            rope.extend(entries.into_iter().map(|(k, v)| (k.to_string(), v)));
            if !truncate {
                rope.insert("truncate".into(), json!(false));
            }
            let optional =
                [("mscale", mscale), ("mscale_all_dim", mscale_all_dim), ("attention_factor", attention_factor)];
            for (key, value) in optional {
                if let Some(v) = value {
                    rope.insert(key.into(), json!(v));
                }
            }
        }
    }
    Value::Object(rope)
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
            "phi/config.json: architecture `PhiForCausalLM` is not supported \
             (Llama, Qwen2, Qwen3, Mistral, Gemma 3 and GPT-2 are)"
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
