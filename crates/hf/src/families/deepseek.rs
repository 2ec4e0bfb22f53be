//! DeepSeek-V2 (`DeepseekV2ForCausalLM`) and V3 (`DeepseekV3ForCausalLM`): latent attention (see
//! `ember_model::mla`), dense MLPs in the first layers and experts with plain shared experts after
//! them, RoPE on interleaved pairs. llama.cpp's `deepseek2` holds both (V3's routers have the
//! selection bias, `exp_probs_b`) with keys of its own, and splits `kv_b_proj` per head into
//! `attn_k_b` and `attn_v_b`.

use ember_model::{MlaConfig, ModelConfig, MoeConfig, RopeLayout, RopeScaling, Scoring};
use serde_json::{json, Map, Value};

use super::experts::EXPERT_KEYS;
use super::llama::{llama_like, ATTN_OUTPUT, BIASES, EMBEDDING, FFN_NORM, HEAD, LLAMA_MLP, LLAMA_REPLACED, QUERY};
use super::Registration;
use crate::config_json::{read_default_rope, rope_parameters, Reader};
use crate::error::HfError;
use crate::family::{as_is, experts, gain, join, linear, without_gguf, Family, Rule};
use crate::gguf::hparams::{size_keys, ArchKeys, ArchWriter, GgufRules, OwnKeys, SplitTensor};
use crate::gguf::{GgufError, GgufFile, Value as GgufValue};

/// DeepSeek's latent attention: the query's projection `q_proj`, or `q_a_proj`, its norm and
/// `q_b_proj`; `kv_a_proj_with_mqa` is ember's `k_proj`, `kv_b_proj` its `v_proj`. llama.cpp's
/// deepseek2 has no attention biases.
#[rustfmt::skip]
const LATENT_ATTENTION: &[Rule] = &[
    linear("model.layers.{i}.self_attn.q_b_proj.weight", &["layers.{i}.self_attn.q_proj.weight"]).gguf("blk.{i}.attn_q_b.weight"),
    linear("model.layers.{i}.self_attn.q_a_proj.weight", &["layers.{i}.self_attn.mla.q_a_proj.weight"]).gguf("blk.{i}.attn_q_a.weight"),
    as_is("model.layers.{i}.self_attn.q_a_proj.bias", &["layers.{i}.self_attn.mla.q_a_proj.bias"]),
    gain("model.layers.{i}.self_attn.q_a_layernorm.weight", &["layers.{i}.self_attn.mla.q_a_norm.weight"])
        .gguf("blk.{i}.attn_q_a_norm.weight"),
    linear("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", &["layers.{i}.self_attn.k_proj.weight"])
        .gguf("blk.{i}.attn_kv_a_mqa.weight"),
    as_is("model.layers.{i}.self_attn.kv_a_proj_with_mqa.bias", &["layers.{i}.self_attn.k_proj.bias"]),
    gain("model.layers.{i}.self_attn.kv_a_layernorm.weight", &["layers.{i}.self_attn.mla.kv_a_norm.weight"])
        .gguf("blk.{i}.attn_kv_a_norm.weight"),
    // Read from llama.cpp's older files; its current ones split it per head into `attn_k_b` and
    // `attn_v_b` ([`KV_B`]).
    linear("model.layers.{i}.self_attn.kv_b_proj.weight", &["layers.{i}.self_attn.v_proj.weight"]).gguf("blk.{i}.attn_kv_b.weight"),
];

/// DeepSeek-V2 and V3: Llama's input norm and query (`q_proj`, a plain query; an export writes
/// `q_b_proj` for a low-rank one), the latent attention, Llama's output projection (its bias without
/// a GGUF name), norms and head. Its dense layers' MLP is Llama's, the others' [`DEEPSEEK_EXPERTS`].
const DEEPSEEK_TENSORS: &[Rule] =
    &join::<16>(&[EMBEDDING, QUERY, LATENT_ATTENTION, ATTN_OUTPUT, &without_gguf([BIASES[3]]), FFN_NORM, HEAD]);

/// DeepSeek's experts, router (with V3's selection bias) and plain shared experts.
#[rustfmt::skip]
const DEEPSEEK_EXPERTS: &[Rule] = &[
    linear("model.layers.{i}.mlp.gate.weight", &["layers.{i}.moe.router.weight"]).gguf("blk.{i}.ffn_gate_inp.weight"),
    as_is("model.layers.{i}.mlp.gate.e_score_correction_bias", &["layers.{i}.moe.selection_bias"]).gguf("blk.{i}.exp_probs_b.bias"),
    experts("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", &["layers.{i}.moe.gate"]).gguf("blk.{i}.ffn_gate_exps.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.up_proj.weight", &["layers.{i}.moe.up"]).gguf("blk.{i}.ffn_up_exps.weight"),
    experts("model.layers.{i}.mlp.experts.{j}.down_proj.weight", &["layers.{i}.moe.down"]).gguf("blk.{i}.ffn_down_exps.weight"),
    linear("model.layers.{i}.mlp.shared_experts.gate_proj.weight", &["layers.{i}.moe.shared.gate_proj.weight"])
        .gguf("blk.{i}.ffn_gate_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_experts.up_proj.weight", &["layers.{i}.moe.shared.up_proj.weight"])
        .gguf("blk.{i}.ffn_up_shexp.weight"),
    linear("model.layers.{i}.mlp.shared_experts.down_proj.weight", &["layers.{i}.moe.shared.down_proj.weight"])
        .gguf("blk.{i}.ffn_down_shexp.weight"),
];

/// DeepSeek's own keys, replaced by its writer.
const DEEPSEEK_KEYS: &[&str] = &[
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "topk_method",
    "scoring_func",
    "rope_interleave",
    "moe_layer_freq",
    "mlp_bias",
];

/// DeepSeek-V2: `DeepseekV2ForCausalLM`, llama.cpp's `deepseek2` without selection biases. It
/// exports a model of latent attention whose router is V2's.
pub const DEEPSEEK_V2: Registration = Registration {
    hf: deepseek(llama_like(
        "deepseek2",
        "DeepseekV2ForCausalLM",
        "deepseek_v2",
        (read_deepseek_v2, write_deepseek_v2),
        |c| c.mla.is_some() && !v3_router(c),
    )),
    gguf: GgufRules { claims: no_selection_bias, ..deepseek_gguf(read_gguf_v2) },
};

/// DeepSeek-V3: `DeepseekV3ForCausalLM`, llama.cpp's `deepseek2` with selection biases. It exports
/// a model of latent attention whose router is V3's.
pub const DEEPSEEK_V3: Registration = Registration {
    hf: deepseek(llama_like(
        "deepseek2",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        (read_deepseek_v3, write_deepseek_v3),
        |c| c.mla.is_some() && v3_router(c),
    )),
    gguf: deepseek_gguf(read_gguf_v3),
};

/// A DeepSeek family: Llama's sizes and parts (`llama`, of llama.cpp's `deepseek2`), its tensors
/// and keys.
const fn deepseek(llama: Family) -> Family {
    Family {
        tensors: &[DEEPSEEK_TENSORS, LLAMA_MLP, DEEPSEEK_EXPERTS],
        replaced_keys: &[LLAMA_REPLACED, EXPERT_KEYS, DEEPSEEK_KEYS],
        export_name: low_rank_query_name,
        aux_loss_in_config: false,
        ..llama
    }
}

/// Whether the router is V3's: sigmoid scores or the selection bias.
fn v3_router(c: &ModelConfig) -> bool {
    c.moe.as_ref().is_some_and(|m| m.scoring == Scoring::Sigmoid || m.selection_bias)
}

/// llama.cpp's `deepseek2`: its own keys (read by `read`), `kv_b_proj` split in two.
const fn deepseek_gguf(read: fn(&ArchKeys, ModelConfig) -> Result<ModelConfig, GgufError>) -> GgufRules {
    let own = OwnKeys { read, write: write_gguf, key_of: gguf_key_of };
    GgufRules { own_keys: Some(own), split: Some(KV_B), ..GgufRules::DENSE }
}

/// The query of a low-rank query is `q_b_proj` (its up-projection): the rules' first name for
/// ember's query is the plain `q_proj`.
fn low_rank_query_name(config: &ModelConfig, name: String) -> String {
    let low_rank_query = config.mla.as_ref().is_some_and(|m| m.q_rank.is_some());
    if low_rank_query && name.ends_with(".self_attn.q_proj.weight") {
        return name.replace(".self_attn.q_proj.", ".self_attn.q_b_proj.");
    }
    name
}

/// llama.cpp's deepseek2 is DeepSeek-V2 where its routers lack the selection bias (V3 otherwise).
fn no_selection_bias(f: &GgufFile) -> Result<bool, GgufError> {
    Ok(!f.tensors.iter().any(|t| t.name.ends_with(".exp_probs_b.bias")))
}

// ---- config.json ----

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
    (c.rope_theta, c.rope_scaling) = read_default_rope(r)?;
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

fn read_deepseek_v2(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
    read_deepseek(r, c, false)
}

fn read_deepseek_v3(r: &Reader, c: &mut ModelConfig) -> Result<(), HfError> {
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

fn write_deepseek_v2(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_deepseek(c, obj, false);
}

fn write_deepseek_v3(c: &ModelConfig, obj: &mut Map<String, Value>) {
    write_deepseek(c, obj, true);
}

// ---- GGUF ----

/// llama.cpp's layer counts of DeepSeek-V2-Lite-shaped models, whose `q_lora_rank` it never reads
/// (their queries are never low-rank).
fn deepseek2_lite(n_layers: usize, vocab: usize) -> bool {
    matches!(n_layers, 26 | 27) || (n_layers == 48 && vocab == 128_256)
}

/// `kv_b_proj` as llama.cpp's current files hold it: per head, the keys' part transposed
/// (`attn_k_b`) and the values' (`attn_v_b`).
const KV_B: SplitTensor = SplitTensor {
    hf: "model.layers.{i}.self_attn.kv_b_proj.weight",
    parts: ["attn_k_b", "attn_v_b"],
    shapes: kv_b_shapes,
    join: kv_b_join,
    split: kv_b_split,
};

fn kv_b_shapes(c: &ModelConfig) -> Option<[Vec<usize>; 2]> {
    let mla = c.mla.as_ref()?;
    Some([vec![c.n_heads, mla.kv_rank, mla.nope_dim], vec![c.n_heads, mla.v_dim, mla.kv_rank]])
}

fn kv_b_join(
    f: &GgufFile,
    key: &str,
    c: &ModelConfig,
    k_b: &[f32],
    v_b: &[f32],
) -> Result<(Vec<f32>, Vec<usize>), GgufError> {
    let rank = c.mla.as_ref().map_or(0, |m| m.kv_rank);
    join_kv_b(k_b, v_b, c.n_heads, rank).ok_or_else(|| {
        let message = format!(
            "attn_k_b / attn_v_b of {} / {} values for {} heads of a {rank}-wide latent",
            k_b.len(),
            v_b.len(),
            c.n_heads
        );
        f.meta_err(key, message)
    })
}

fn kv_b_split(c: &ModelConfig, kv_b: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (nope, rank) = c.mla.as_ref().map_or((0, 0), |m| (m.nope_dim, m.kv_rank));
    split_kv_b(kv_b, c.n_heads, nope, rank)
}

/// The `deepseek2.*` key (after the prefix) of a model field of DeepSeek's own, or of one whose key
/// differs from the shared architectures' (its shared experts are counted, not sized).
fn gguf_key_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "mla.norm_eps" => "attention.layer_norm_rms_epsilon",
        "moe.shared_expert" => "expert_shared_count",
        "moe.dense_layers" => "leading_dense_block_count",
        "moe.groups" => "expert_group_count",
        "moe.top_groups" => "expert_group_used_count",
        "moe.routed_scale" => "expert_weights_scale",
        "mla.kv_rank" => "attention.kv_lora_rank",
        "mla.q_rank" => "attention.q_lora_rank",
        "mla.rope_dim" => "rope.dimension_count",
        "mla.nope_dim" => "attention.key_length_mla",
        "mla.v_dim" => "attention.value_length_mla",
        _ => return None,
    })
}

fn read_gguf_v2(k: &ArchKeys, sizes: ModelConfig) -> Result<ModelConfig, GgufError> {
    read_gguf(k, sizes, false)
}

fn read_gguf_v3(k: &ArchKeys, sizes: ModelConfig) -> Result<ModelConfig, GgufError> {
    read_gguf(k, sizes, true)
}

/// The model llama.cpp's `deepseek2` metadata describes (`sizes` holds the vocabulary, the layers,
/// the width and the heads): latent attention (`key_length_mla` / `value_length_mla`, or the older
/// files' `key_length` / `value_length`), its latents normed with the model's epsilon, RoPE on
/// interleaved pairs, experts after `leading_dense_block_count` dense layers ([`gguf_experts`]).
fn read_gguf(k: &ArchKeys, sizes: ModelConfig, v3: bool) -> Result<ModelConfig, GgufError> {
    let rope_dim = k.usize("rope.dimension_count")?;
    let kv_rank = k.usize("attention.kv_lora_rank")?;
    let (qk, v) = match (k.opt_u64("attention.key_length_mla")?, k.opt_u64("attention.value_length_mla")?) {
        (Some(qk), Some(v)) if qk > 0 && v > 0 => (qk as usize, v as usize),
        _ => (k.usize("attention.key_length")?, k.usize("attention.value_length")?),
    };
    let nope_dim = qk.checked_sub(rope_dim).filter(|&n| n > 0).ok_or_else(|| {
        k.err("rope.dimension_count", format!("{rope_dim}: no room in heads of {qk} for a part without position"))
    })?;
    let q_rank = match deepseek2_lite(sizes.n_layers, sizes.vocab_size) {
        true => None,
        false => Some(k.usize("attention.q_lora_rank")?).filter(|&q| q > 0),
    };
    let eps = k.float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    let rope_scaling = gguf_rope_scaling(k)?;
    let moe = gguf_experts(k, v3)?;
    Ok(ModelConfig {
        n_kv_heads: None,
        head_dim: None,
        d_ff: k.usize("feed_forward_length")?,
        max_seq_len: k.usize("context_length")?,
        rope_theta: k.float("rope.freq_base")?.unwrap_or(10_000.0),
        rope_layout: RopeLayout::Interleaved,
        rope_scaling,
        norm_eps: eps,
        moe,
        mla: Some(MlaConfig { q_rank, kv_rank, nope_dim, rope_dim, v_dim: v, norm_eps: eps }),
        ..sizes
    })
}

/// YaRN with `yarn_log_multiplier` = 0.1 · mscale_all_dim (llama.cpp's mscale equal to it), or
/// linear.
fn gguf_rope_scaling(k: &ArchKeys) -> Result<Option<RopeScaling>, GgufError> {
    let factor = || k.float("rope.scaling.factor")?.ok_or_else(|| k.err("rope.scaling.factor", "missing".into()));
    Ok(match k.str("rope.scaling.type")? {
        None | Some("none") => None,
        Some("yarn") => {
            let factor = factor()?;
            let all = k.float("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0) / 0.1;
            let all = (all != 0.0).then_some((all * 1e6).round() / 1e6);
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: k.usize("rope.scaling.original_context_length")?,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: all,
                mscale_all_dim: all,
                // llama.cpp's deepseek2 leaves cos and sin unscaled (its mscale over mscale_all_dim,
                // 1; without the log multiplier it divides YaRN's default factor back out).
                attention_factor: all.is_none().then_some(1.0),
                truncate: true,
            })
        }
        Some("linear") => Some(RopeScaling::Linear { factor: factor()? }),
        Some(other) => return Err(k.err("rope.scaling.type", format!("`{other}` is not supported (yarn, linear are)"))),
    })
}

/// The experts, scored by `expert_gating_func` (1 softmax, 2 sigmoid), grouped, scaled and
/// renormalised as the keys say; V3's routers have the selection bias.
fn gguf_experts(k: &ArchKeys, v3: bool) -> Result<Option<MoeConfig>, GgufError> {
    let Some(n_experts) = k.opt_u64("expert_count")?.filter(|&n| n > 0) else { return Ok(None) };
    let scoring = match k.opt_u64("expert_gating_func")?.unwrap_or(1) {
        1 => Scoring::Softmax,
        2 => Scoring::Sigmoid,
        other => {
            let message = format!("{other}: ember scores experts by softmax (1) or sigmoid (2)");
            return Err(k.err("expert_gating_func", message));
        }
    };
    let groups = k.opt_u64("expert_group_count")?.filter(|&g| g > 1).map(|g| g as usize);
    let top_groups = match groups {
        Some(_) => Some(k.usize("expert_group_used_count")?),
        None => None,
    };
    if groups.is_some() && scoring == Scoring::Softmax {
        return Err(k.err(
            "expert_group_count",
            "groups of a softmax router: llama.cpp scores them by their best two experts, DeepSeek-V2 by its best one"
                .into(),
        ));
    }
    let d_expert = k.usize("expert_feed_forward_length")?;
    let shared = k.opt_u64("expert_shared_count")?.unwrap_or(0) as usize;
    let scale = k.float("expert_weights_scale")?.unwrap_or(0.0);
    Ok(Some(MoeConfig {
        n_experts: n_experts as usize,
        top_k: k.usize("expert_used_count")?,
        d_expert,
        norm_topk: k.bool("expert_weights_norm")?.unwrap_or(false),
        shared_expert: match shared {
            0 => None,
            n => Some(n.checked_mul(d_expert).ok_or_else(|| k.err("expert_shared_count", format!("{n}: too many")))?),
        },
        shared_expert_gate: false,
        aux_loss_coef: 0.0,
        z_loss_coef: 0.0,
        scoring,
        selection_bias: v3,
        groups,
        top_groups,
        routed_scale: if scale == 0.0 { 1.0 } else { scale },
        dense_layers: k.opt_u64("leading_dense_block_count")?.unwrap_or(0) as usize,
        bias_update_rate: 0.0,
    }))
}

/// llama.cpp's `deepseek2` keys of `config`, as its converter writes them for MLA in its current
/// layout (one key/value head of `kv_lora_rank + rope` for the absorbed attention, the per-head
/// widths under `*_mla`, `q_lora_rank` 0 for a plain query).
fn write_gguf(config: &ModelConfig, w: &mut ArchWriter) {
    size_keys(config, w);
    w.u("attention.head_count_kv", 1);
    w.f("attention.layer_norm_rms_epsilon", config.norm_eps);
    w.f("rope.freq_base", config.rope_theta);
    w.u("vocab_size", config.vocab_size);
    if let Some(mla) = &config.mla {
        w.u("attention.q_lora_rank", mla.q_rank.unwrap_or(0));
        w.u("attention.kv_lora_rank", mla.kv_rank);
        w.u("attention.key_length", mla.cache_width());
        w.u("attention.value_length", mla.kv_rank);
        w.u("attention.key_length_mla", mla.qk_dim());
        w.u("attention.value_length_mla", mla.v_dim);
        w.u("rope.dimension_count", mla.rope_dim);
    }
    match config.rope_scaling {
        Some(RopeScaling::Yarn { factor, original_max_position_embeddings, mscale_all_dim, .. }) => {
            w.s("rope.scaling.type", "yarn");
            w.f("rope.scaling.factor", factor);
            w.u("rope.scaling.original_context_length", original_max_position_embeddings);
            w.f("rope.scaling.yarn_log_multiplier", 0.1 * mscale_all_dim.unwrap_or(0.0));
        }
        Some(RopeScaling::Linear { factor }) => {
            w.s("rope.scaling.type", "linear");
            w.f("rope.scaling.factor", factor);
        }
        _ => {}
    }
    if let Some(moe) = &config.moe {
        let gating = if moe.scoring == Scoring::Sigmoid { 2 } else { 1 };
        w.u("leading_dense_block_count", moe.dense_layers);
        w.u("expert_count", moe.n_experts);
        w.u("expert_used_count", moe.top_k);
        w.u("expert_feed_forward_length", moe.d_expert);
        w.u("expert_shared_count", moe.shared_expert.map_or(0, |s| s / moe.d_expert.max(1)));
        w.f("expert_weights_scale", moe.routed_scale);
        w.put("expert_weights_norm", GgufValue::Bool(moe.norm_topk));
        w.u("expert_gating_func", gating);
        if let (Some(groups), Some(top)) = (moe.groups, moe.top_groups) {
            w.u("expert_group_count", groups);
            w.u("expert_group_used_count", top);
        }
    }
}

/// llama.cpp's `attn_k_b` (`[H, r, nope]`: each head's key up-projection, transposed) and
/// `attn_v_b` (`[H, v, r]`) of one layer as Hugging Face's `kv_b_proj`, `[H·(nope + v), r]`.
/// `None` where their sizes are no whole heads.
fn join_kv_b(k_b: &[f32], v_b: &[f32], heads: usize, rank: usize) -> Option<(Vec<f32>, Vec<usize>)> {
    let (nope, v) = (k_b.len() / (heads * rank).max(1), v_b.len() / (heads * rank).max(1));
    if nope * heads * rank != k_b.len() || v * heads * rank != v_b.len() || nope == 0 || v == 0 {
        return None;
    }
    let mut out = Vec::with_capacity(k_b.len() + v_b.len());
    for h in 0..heads {
        for i in 0..nope {
            out.extend((0..rank).map(|c| k_b[(h * rank + c) * nope + i]));
        }
        out.extend_from_slice(&v_b[h * v * rank..(h + 1) * v * rank]);
    }
    Some((out, vec![heads * (nope + v), rank]))
}

/// The reverse of [`join_kv_b`]: `(attn_k_b [H, r, nope], attn_v_b [H, v, r])`.
fn split_kv_b(kv_b: &[f32], heads: usize, nope: usize, rank: usize) -> (Vec<f32>, Vec<f32>) {
    let per = kv_b.len() / heads.max(1) / rank.max(1); // nope + v
    let (mut k_b, mut v_b) = (Vec::with_capacity(heads * nope * rank), Vec::new());
    for h in 0..heads {
        let head = &kv_b[h * per * rank..(h + 1) * per * rank];
        for c in 0..rank {
            k_b.extend((0..nope).map(|i| head[i * rank + c]));
        }
        v_b.extend_from_slice(&head[nope * rank..]);
    }
    (k_b, v_b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepseek_key_and_value_up_projections_split_per_head_and_join_back() {
        // kv_b_proj [H·(nope + v), r] with value h·1000 + row·10 + column, H 3, nope 2, v 4, r 5.
        let (h, nope, v, r) = (3, 2, 4, 5);
        let kv_b: Vec<f32> = (0..h * (nope + v) * r)
            .map(|i| (i / r / (nope + v) * 1000 + i / r % (nope + v) * 10 + i % r) as f32)
            .collect();
        let (k_b, v_b) = split_kv_b(&kv_b, h, nope, r);
        // attn_k_b [H, r, nope]: head 2's key row 1, latent column 3 at [2][3][1].
        assert_eq!(k_b[(2 * r + 3) * nope + 1], 2013.0);
        // attn_v_b [H, v, r]: head 1's value row 2 (row nope + 2 of the head), column 4.
        assert_eq!(v_b[(v + 2) * r + 4], 1044.0);
        let (back, shape) = join_kv_b(&k_b, &v_b, h, r).unwrap();
        assert_eq!((back, shape), (kv_b, vec![h * (nope + v), r]));
        assert!(join_kv_b(&k_b[1..], &v_b, h, r).is_none());
    }
}
