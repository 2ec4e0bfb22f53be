//! Issue 35's families (tiny random GPT-2, Qwen3 and Gemma 3 models) and issue 36's experts
//! (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), saved by transformers 5.25 (tests/fixtures/hf, made by
//! tests/fixtures/make_hf_fixtures.py). ember's logits match transformers' on every case, greedy
//! decoding (through the KV cache) picks the same 20 tokens, exports are the same files again
//! (names, bytes, config.json), a training step's loss with the load-balancing loss and every
//! gradient match transformers', and configs ember cannot run are refused by name.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::tensor::{DType, Int, Tensor, TensorData};
use common::{fixture, greedy, ids, logits, B};
use ember_hf::families::{
    deepseek::{DEEPSEEK_V2, DEEPSEEK_V3},
    experts::{MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE},
    gemma3::GEMMA3,
    gpt2::GPT2,
    qwen::QWEN3,
};
use ember_hf::{export, expressible, hf_tensors, import, to_model_config, Architecture};
use ember_model::moe::load_balancing_loss;
use ember_model::weights::{assign, named_tensors, visit_paths, PathVisitor};
use ember_model::{Decoder, MlpKind, ModelConfig, NormKind, Positions, RopeLayout, SelfAttention};
use serde_json::{json, Value};

type AB = Autodiff<Flex>;

const FAMILIES: [(&str, Architecture); 10] = [
    ("gpt2", GPT2.architecture()),
    ("qwen3", QWEN3.architecture()),
    ("gemma3_text", GEMMA3.architecture()),
    // The Gemma 3 of llama.cpp's shape that the GGUF tests export (tests/gguf.rs).
    ("gemma3_gguf", GEMMA3.architecture()),
    ("mixtral", MIXTRAL.architecture()),
    ("qwen2_moe", QWEN2_MOE.architecture()),
    ("qwen3_moe", QWEN3_MOE.architecture()),
    ("olmoe", OLMOE.architecture()),
    ("deepseek_v2", DEEPSEEK_V2.architecture()),
    ("deepseek_v3", DEEPSEEK_V3.architecture()),
];

/// The families with experts, whose fixtures have a training case.
const EXPERTS: [&str; 6] = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"];

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn import_dir(dir: &Path) -> ember_hf::Imported<B> {
    import::<B>(dir, DType::F32, false, false, &Default::default()).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The tensors of a safetensors file, by name: shape, dtype and bytes.
fn file_tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.shape().to_vec(), format!("{:?}", view.dtype()), view.data().to_vec())))
        .collect()
}

#[test]
fn logits_and_greedy_tokens_match_transformers_on_every_case() {
    for (name, arch) in FAMILIES {
        let want = read_json(&fixture(name).join("expected.json"));
        let imported = import_dir(&fixture(name));
        assert_eq!(imported.architecture, arch);
        assert!(imported.missing.is_empty() && imported.unused.is_empty(), "{name}");
        let cases = want["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 2);
        for (i, case) in cases.iter().enumerate() {
            let prompt = ids(&case["ids"]);
            let reference: Vec<f32> =
                case["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            let diff = max_diff(&logits(&imported.model, &prompt), &reference);
            let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
            eprintln!(
                "{name} case {i} ({} ids): max |ember - transformers| = {diff:.3e} (|logits| up to {scale:.2})",
                prompt.len()
            );
            assert!(diff < 1e-4, "{name} case {i}: max |ember - transformers| = {diff}");
            let generated = greedy(&imported.model, &prompt, 20);
            assert_eq!(generated, ids(&case["generated"]), "{name} case {i}: greedy tokens");
        }
    }
}

#[test]
fn fixture_features_are_the_ones_meant() {
    let gpt2 = import_dir(&fixture("gpt2")).model.config().clone();
    assert_eq!((gpt2.norm, gpt2.mlp, gpt2.positions), (NormKind::LayerNorm, MlpKind::Gelu, Positions::Learned));
    assert!(gpt2.norm_bias && gpt2.qkv_bias && gpt2.o_bias && gpt2.mlp_bias && gpt2.tie_embeddings);
    assert_eq!((gpt2.d_model, gpt2.d_ff, gpt2.max_seq_len, gpt2.norm_eps), (48, 192, 64, 1e-5), "n_inner null: 4·48");

    let qwen3 = import_dir(&fixture("qwen3")).model.config().clone();
    assert!(qwen3.qk_norm && !qwen3.qkv_bias && !qwen3.o_bias && qwen3.tie_embeddings);
    assert_eq!((qwen3.head_dim, qwen3.n_kv_heads(), qwen3.rope_theta), (Some(32), 2, 1e6));

    let gemma = import_dir(&fixture("gemma3_text")).model.config().clone();
    assert_eq!((gemma.norm, gemma.mlp), (NormKind::RmsNormPlusOne, MlpKind::Geglu));
    assert!(gemma.qk_norm && gemma.sandwich_norms && gemma.embed_scale && gemma.tie_embeddings);
    assert_eq!((gemma.sliding_window, gemma.sliding_window_pattern), (Some(6), Some(3)));
    let local: Vec<bool> = (0..4).map(|l| gemma.is_local(l)).collect();
    assert_eq!(local, [true, true, false, true]);
    assert_eq!((gemma.rope_theta, gemma.rope_local_theta), (1e6, Some(1e4)));
    assert_eq!((gemma.head_dim, gemma.query_pre_attn_scalar), (Some(16), Some(24.0)));
    assert_eq!((gemma.final_logit_softcap, gemma.attn_logit_softcap), (Some(4.0), None));
}

#[test]
fn both_gemma3_config_layouts_read_to_the_same_model() {
    let config = read_json(&fixture("gemma3_text").join("config.json"));
    let legacy = read_json(&fixture("gemma3_text").join("expected.json"))["legacy_config"].clone();
    assert!(legacy.get("layer_types").is_none() && legacy.get("rope_local_base_freq").is_some());
    let (a, _) = to_model_config(&config, "config.json").unwrap();
    let (b, arch) = to_model_config(&legacy, "legacy_config").unwrap();
    assert_eq!((a, arch), (b, GEMMA3.architecture()));
}

#[test]
fn export_writes_the_same_files_and_reimports_bit_for_bit() {
    for (name, arch) in FAMILIES {
        let a = import_dir(&fixture(name));
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("export");
        let report = export(&a.model, Some(&a.hf_config), &out, u64::MAX, &[]).unwrap();
        assert_eq!(report.architecture, arch);
        let b = import_dir(&out);
        assert_eq!(b.model.config(), a.model.config(), "{name}");
        for ((ka, ta), (kb, tb)) in named_tensors::<B, _>(&a.model).into_iter().zip(named_tensors::<B, _>(&b.model)) {
            assert_eq!(ka, kb);
            assert!(ta.as_bytes() == tb.as_bytes(), "{name}: {ka} differs after the round trip");
        }
        // transformers' own names, shapes and bytes (GPT-2's q, k, v fused back into c_attn).
        let (orig, exported) =
            (file_tensors(&fixture(name).join("model.safetensors")), file_tensors(&out.join("model.safetensors")));
        assert_eq!(orig.keys().collect::<Vec<_>>(), exported.keys().collect::<Vec<_>>(), "{name}");
        assert!(orig == exported, "{name}: a tensor's shape or bytes differ from transformers' file");
        // The family's config keys round-trip: the same config.json, key for key.
        let cfg = read_json(&out.join("config.json"));
        let original = read_json(&fixture(name).join("config.json"));
        for (k, v) in original.as_object().unwrap() {
            assert_eq!(&cfg[k], v, "{name}: config.json `{k}`");
        }
        let extra: Vec<&String> = cfg.as_object().unwrap().keys().filter(|k| original.get(*k).is_none()).collect();
        assert!(extra.is_empty(), "{name}: keys the original lacks: {extra:?}");
    }
}

#[test]
fn a_gemma3_import_from_the_older_layout_exports_the_transformers_5_layout() {
    let a = import_dir(&fixture("gemma3_text"));
    let legacy = read_json(&fixture("gemma3_text").join("expected.json"))["legacy_config"].clone();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("export");
    export(&a.model, Some(&legacy), &out, u64::MAX, &[]).unwrap();
    let cfg = read_json(&out.join("config.json"));
    for k in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
        assert!(cfg.get(k).is_none(), "`{k}` left in {cfg}");
    }
    assert_eq!(
        cfg["layer_types"],
        json!(["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    );
    assert_eq!(cfg["rope_parameters"]["sliding_attention"]["rope_theta"], json!(1e4));
    assert_eq!(cfg["rope_parameters"]["full_attention"]["rope_theta"], json!(1e6));
    assert_eq!(import_dir(&out).model.config(), a.model.config());
}

#[test]
fn models_without_a_base_config_export_as_their_family() {
    for (name, arch) in FAMILIES {
        let a = import_dir(&fixture(name));
        assert_eq!(Architecture::for_model(a.model.config()), arch, "{name}");
        let dir = tempfile::tempdir().unwrap();
        let report = export(&a.model, None, &dir.path().join("x"), u64::MAX, &[]).unwrap();
        assert_eq!(report.architecture, arch);
        let b = import_dir(&dir.path().join("x"));
        assert_eq!(b.model.config(), a.model.config(), "{name}");
    }
}

#[test]
fn hub_gpt2_names_without_the_prefix_and_with_mask_buffers_import_the_same() {
    let a = import_dir(&fixture("gpt2"));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("hub");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(fixture("gpt2").join("config.json"), d.join("config.json")).unwrap();
    let mut tensors: Vec<(String, TensorData)> = file_tensors(&fixture("gpt2").join("model.safetensors"))
        .into_iter()
        .map(|(k, (shape, _, bytes))| {
            (k.trim_start_matches("transformer.").to_string(), TensorData::from_bytes_vec(bytes, shape, DType::F32))
        })
        .collect();
    // GPT-2 checkpoints on the Hub carry the causal mask as a buffer.
    for l in 0..2 {
        tensors.push((format!("h.{l}.attn.bias"), TensorData::new(vec![1.0f32; 64 * 64], [1, 1, 64, 64])));
    }
    std::fs::write(d.join("model.safetensors"), ember_model::weights::to_safetensors(&tensors, None)).unwrap();
    let b = import_dir(&d);
    assert!(b.unused.is_empty());
    for ((ka, ta), (_, tb)) in named_tensors::<B, _>(&a.model).into_iter().zip(named_tensors::<B, _>(&b.model)) {
        assert!(ta.as_bytes() == tb.as_bytes(), "{ka}");
    }
}

#[test]
fn fixture_tokenizers_give_transformers_ids() {
    for (name, _) in FAMILIES {
        let want = read_json(&fixture(name).join("expected.json"));
        let tok = tokenizers::Tokenizer::from_file(fixture(name).join("tokenizer.json")).unwrap();
        let enc = tok.encode(want["text"].as_str().unwrap(), false).unwrap();
        assert_eq!(enc.get_ids(), ids(&want["text_ids"]).as_slice(), "{name}");
    }
}

/// `to_model_config` of the fixture's config.json with `edit` applied: the error's text.
fn config_err(name: &str, edit: impl FnOnce(&mut Value)) -> String {
    let mut cfg = read_json(&fixture(name).join("config.json"));
    edit(&mut cfg);
    to_model_config(&cfg, &format!("{name}/config.json")).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn configs_ember_cannot_run_are_refused_by_file_key_and_value() {
    let e = config_err("gpt2", |c| c["activation_function"] = json!("relu"));
    assert_eq!(e, "gpt2/config.json: activation_function `relu`: ember runs GPT2LMHeadModel with gelu_new or gelu");
    let e = config_err("gpt2", |c| c["scale_attn_by_inverse_layer_idx"] = json!(true));
    assert!(e.starts_with("gpt2/config.json: scale_attn_by_inverse_layer_idx = true:"), "{e}");
    let e = config_err("gpt2", |c| c["scale_attn_weights"] = json!(false));
    assert!(e.starts_with("gpt2/config.json: scale_attn_weights = false:"), "{e}");
    let e = config_err("gpt2", |c| c["reorder_and_upcast_attn"] = json!(true));
    assert!(e.starts_with("gpt2/config.json: reorder_and_upcast_attn = true:"), "{e}");
    let e = config_err("gpt2", |c| drop(c.as_object_mut().unwrap().remove("n_embd")));
    assert_eq!(e, "gpt2/config.json: missing field `n_embd`");

    let e = config_err("qwen3", |c| c["use_sliding_window"] = json!(true));
    assert!(e.starts_with("qwen3/config.json: use_sliding_window = true:"), "{e}");
    let e = config_err("qwen3", |c| c["hidden_act"] = json!("gelu"));
    assert_eq!(e, "qwen3/config.json: hidden_act `gelu`: ember runs Qwen3ForCausalLM with silu");

    let e = config_err("gemma3_text", |c| {
        c["layer_types"] = json!(["sliding_attention", "full_attention", "full_attention", "sliding_attention"])
    });
    assert!(e.starts_with("gemma3_text/config.json: layer_types [sliding, full, full, sliding]:"), "{e}");
    let e = config_err("gemma3_text", |c| c["layer_types"] = json!(["sliding_attention"]));
    assert!(e.contains("expected a list of 4 layer types"), "{e}");
    let e = config_err("gemma3_text", |c| c["layer_types"][0] = json!("chunked_attention"));
    assert!(e.contains("`\"chunked_attention\"` is neither"), "{e}");
    let e = config_err("gemma3_text", |c| {
        c.as_object_mut().unwrap().remove("layer_types");
        c["sliding_window_pattern"] = json!(0);
    });
    assert_eq!(e, "gemma3_text/config.json: sliding_window_pattern = 0: expected a positive integer");
    let e = config_err("gemma3_text", |c| c["use_bidirectional_attention"] = json!(true));
    assert!(e.starts_with("gemma3_text/config.json: use_bidirectional_attention = true:"), "{e}");
    let e = config_err("gemma3_text", |c| c["hidden_activation"] = json!("gelu"));
    assert!(e.contains("hidden_activation `gelu`"), "{e}");
    let e = config_err("gemma3_text", |c| c["rope_parameters"]["sliding_attention"]["rope_type"] = json!("linear"));
    assert!(e.contains("sliding_attention.rope_type `linear`"), "{e}");

    // Experts: dense layers among the sparse ones, noise, clamps and impossible routing are refused.
    let e = config_err("qwen2_moe", |c| c["mlp_only_layers"] = json!([1]));
    assert!(e.starts_with("qwen2_moe/config.json: mlp_only_layers is not empty"), "{e}");
    let e = config_err("qwen3_moe", |c| c["decoder_sparse_step"] = json!(2));
    assert!(e.starts_with("qwen3_moe/config.json: decoder_sparse_step > 1"), "{e}");
    let e = config_err("mixtral", |c| c["router_jitter_noise"] = json!(0.1));
    assert!(e.starts_with("mixtral/config.json: router_jitter_noise is not 0"), "{e}");
    let e = config_err("mixtral", |c| c["norm_topk_prob"] = json!(false));
    assert!(e.starts_with("mixtral/config.json: norm_topk_prob = false"), "{e}");
    let e = config_err("olmoe", |c| c["clip_qkv"] = json!(8.0));
    assert!(e.starts_with("olmoe/config.json: clip_qkv is set"), "{e}");
    let e = config_err("olmoe", |c| c["num_experts_per_tok"] = json!(9));
    assert_eq!(e, "olmoe/config.json: model.moe.top_k needs a value no larger than moe.n_experts");
    let e = config_err("qwen2_moe", |c| drop(c.as_object_mut().unwrap().remove("shared_expert_intermediate_size")));
    assert_eq!(e, "qwen2_moe/config.json: missing field `shared_expert_intermediate_size`");
    // Hub configs of Qwen's MoE name the count `num_experts`, transformers 5 may write `num_local_experts`.
    let renamed = |name: &str| {
        let mut cfg = read_json(&fixture(name).join("config.json"));
        let obj = cfg.as_object_mut().unwrap();
        let n = obj.remove("num_local_experts").or_else(|| obj.remove("num_experts")).unwrap();
        obj.insert("num_experts".into(), n);
        to_model_config(&cfg, "config.json").unwrap().0
    };
    assert_eq!(renamed("qwen3_moe"), import_dir(&fixture("qwen3_moe")).model.config().clone());
}

#[test]
fn other_layer_patterns_read_as_transformers_reads_them() {
    let gemma = |edit: fn(&mut Value)| {
        let mut cfg = read_json(&fixture("gemma3_text").join("config.json"));
        edit(&mut cfg);
        to_model_config(&cfg, "config.json").unwrap().0
    };
    // Every layer sliding: the window everywhere, no pattern (and so the local RoPE base only).
    let all = gemma(|c| c["layer_types"] = json!(vec!["sliding_attention"; 4]));
    assert_eq!((all.sliding_window, all.sliding_window_pattern), (Some(6), None));
    // Every layer full: no window.
    let none = gemma(|c| c["layer_types"] = json!(vec!["full_attention"; 4]));
    assert_eq!((none.sliding_window, none.rope_local_theta), (None, None));
    // The older layout's pattern, and its default of 6 (four layers: all sliding).
    let legacy = |c: &mut Value| {
        let o = c.as_object_mut().unwrap();
        o.remove("layer_types");
        o.remove("rope_parameters");
    };
    let p2 = gemma(|c| {
        c.as_object_mut().unwrap().remove("layer_types");
        c["sliding_window_pattern"] = json!(2);
    });
    assert_eq!(p2.sliding_window_pattern, Some(2));
    let default = gemma(|c| {
        let o = c.as_object_mut().unwrap();
        for k in ["layer_types", "rope_parameters", "sliding_window_pattern", "_sliding_window_pattern"] {
            o.remove(k);
        }
    });
    assert_eq!((default.sliding_window_pattern, default.rope_theta, default.rope_local_theta), (None, 1e6, Some(1e4)));
    let mut c = read_json(&fixture("gemma3_text").join("config.json"));
    legacy(&mut c);
    c["rope_scaling"] = json!({"rope_type": "linear", "factor": 8.0});
    let scaled = to_model_config(&c, "config.json").unwrap().0;
    assert_eq!(scaled.rope_scaling, Some(ember_model::RopeScaling::Linear { factor: 8.0 }));
}

#[test]
fn gemma3_270m_config_builds_with_the_published_count() {
    // google/gemma-3-270m's config.json (transformers 4.x layout; the fields that matter).
    let text = r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attn_logit_softcapping": null, "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "intermediate_size": 2048,
        "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
        "num_hidden_layers": 18, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": null,
        "rope_theta": 1000000.0, "sliding_window": 512, "sliding_window_pattern": 6,
        "use_bidirectional_attention": false, "vocab_size": 262144}"#;
    let (cfg, _) = to_model_config(&serde_json::from_str(text).unwrap(), "config.json").unwrap();
    assert_eq!((cfg.sliding_window, cfg.sliding_window_pattern, cfg.query_pre_attn_scalar), (Some(512), Some(6), None));
    assert!(cfg.tie_embeddings, "Gemma 3 ties by default");
    assert_eq!(cfg.num_params(), 268_098_176);
    let cfg = ModelConfig { max_seq_len: 64, ..cfg };
    let model = Decoder::<B>::empty(&cfg, &Default::default()).unwrap();
    assert_eq!(burn::module::Module::num_params(&model), 268_098_176);
}

#[test]
fn models_no_family_runs_are_refused_on_export() {
    // nanoGPT's block (configs/gpt2-shakespeare-char.toml): LayerNorm and GELU without biases.
    let nano = ModelConfig {
        norm: NormKind::LayerNorm,
        mlp: MlpKind::GeluExact,
        positions: Positions::Learned,
        tie_embeddings: true,
        ..ModelConfig::tiny(50, 32)
    };
    assert_eq!(Architecture::for_model(&nano), GPT2.architecture());
    let e = expressible(&nano, GPT2.architecture()).unwrap_err().to_string();
    assert!(e.starts_with("this model cannot be written as GPT2LMHeadModel:"), "{e}");
    assert!(e.contains("model.mlp_bias is false, GPT2LMHeadModel has true"), "{e}");
    assert!(e.contains("model.n_kv_heads is 2, GPT2LMHeadModel has 4"), "{e}");
    let model = Decoder::<B>::new(&nano, 1, &Default::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = export(&model, None, &dir.path().join("x"), u64::MAX, &[]).unwrap_err().to_string();
    assert_eq!(err, e);
    assert!(!dir.path().join("x").exists());
    // With GPT-2's biases and heads it is one (the exact-erf GELU is GPT-2's `gelu`).
    let gpt2 = ModelConfig {
        n_kv_heads: None,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        norm_bias: true,
        dropout: 0.1,
        ..nano
    };
    expressible(&gpt2, GPT2.architecture()).unwrap();
    // A Llama with Gemma's norms but a SwiGLU MLP is no family's.
    let odd = ModelConfig { norm: NormKind::RmsNormPlusOne, ..ModelConfig::tiny(50, 32) };
    let e = expressible(&odd, Architecture::for_model(&odd)).unwrap_err().to_string();
    assert!(e.contains("model.norm is \"rms_norm_plus_one\""), "{e}");
}

#[test]
fn interleaved_qk_norm_models_export_in_the_half_split_layout() {
    // The per-head q/k norm gains move with the q/k columns.
    let cfg =
        ModelConfig { rope_layout: RopeLayout::Interleaved, qk_norm: true, init_std: 0.2, ..ModelConfig::tiny(50, 32) };
    let mut model = Decoder::<B>::new(&cfg, 4, &Default::default()).unwrap();
    // Gains that are not all one, so that their order matters.
    for layer in &mut model.layers {
        let SelfAttention::Grouped(att) = &mut layer.self_attn else { panic!("grouped-query attention") };
        for norm in [att.q_norm.as_mut().unwrap(), att.k_norm.as_mut().unwrap()] {
            let g: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.25).collect();
            norm.weight =
                burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(g, [8]), &Default::default()));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    export(&model, None, &dir.path().join("x"), u64::MAX, &[]).unwrap();
    let back = import_dir(&dir.path().join("x"));
    assert_eq!(back.architecture, QWEN3.architecture());
    assert_eq!(back.model.config().rope_layout, RopeLayout::HalfSplit);
    let prompt: Vec<u32> = (0..20).map(|i| (i * 7) % 50).collect();
    let diff = max_diff(&logits(&model, &prompt), &logits(&back.model, &prompt));
    assert!(diff < 1e-4, "{diff}");
}

/// The gradients of `model`'s parameters (after `backward`) as a model of the inner backend, so that
/// the export's renaming and layouts apply to them.
fn gradient_model(
    model: &Decoder<AB>,
    grads: &<AB as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Decoder<B> {
    struct Grads<'a> {
        grads: &'a <AB as burn::tensor::backend::AutodiffBackend>::Gradients,
        out: BTreeMap<String, TensorData>,
    }
    impl PathVisitor<AB> for Grads<'_> {
        fn visit<const D: usize>(&mut self, path: &str, param: &burn::module::Param<Tensor<AB, D>>) {
            // DeepSeek-V3's selection bias only chooses experts: no gradient reaches it (zeros, as
            // transformers' file of gradients holds).
            let grad = match param.val().grad(self.grads) {
                Some(grad) => grad.into_data(),
                None if path.ends_with("moe.selection_bias") => param.val().inner().zeros_like().into_data(),
                None => panic!("no gradient reaches {path}"),
            };
            self.out.insert(path.to_string(), grad);
        }
    }
    let mut g = Grads { grads, out: BTreeMap::new() };
    visit_paths(model, &mut g);
    assign(model.valid(), g.out, "gradients", false).unwrap()
}

#[test]
fn a_training_step_with_the_balancing_loss_matches_transformers_with_every_gradient() {
    for name in EXPERTS {
        let want = read_json(&fixture(name).join("expected.json"))["train"].clone();
        let imported = import::<AB>(&fixture(name), DType::F32, false, false, &Default::default()).unwrap();
        let (model, arch) = (imported.model, imported.architecture);
        let rows: Vec<Vec<u32>> = want["rows"].as_array().unwrap().iter().map(ids).collect();
        let (b, t) = (rows.len(), rows[0].len());
        let inputs: Vec<i32> = rows.iter().flatten().map(|&x| x as i32).collect();
        // transformers' labels are the inputs, shifted inside: the last position of a row scores nothing.
        let targets: Vec<i32> =
            rows.iter().flat_map(|r| r[1..].iter().map(|&x| x as i32).chain([ember_kernels::IGNORE])).collect();
        let dev = Default::default();
        let tokens = Tensor::<AB, 2, Int>::from_data(TensorData::new(inputs, [b, t]), &dev);
        let targets = Tensor::<AB, 1, Int>::from_data(TensorData::new(targets, [b * t]), &dev);
        let (hidden, routes) = model.hidden_routed(tokens, 0, None);
        let lm = model.loss(hidden.reshape([b * t, model.config().d_model]), targets);
        let aux = load_balancing_loss(&routes).unwrap();
        let coef = model.config().moe.as_ref().unwrap().aux_loss_coef;
        assert_eq!(coef, want["aux_coef"].as_f64().unwrap(), "{name}: router_aux_loss_coef read");
        let loss = lm.clone() + aux.clone().mul_scalar(coef);
        let value = |t: &Tensor<AB, 1>| t.clone().into_scalar() as f64;
        // DeepSeek's transformers models compute no auxiliary loss (coefficient 0).
        let parts = [("loss", value(&loss), "loss"), ("lm", value(&lm), "lm_loss"), ("aux", value(&aux), "aux_loss")];
        for (what, got, key) in parts.into_iter().filter(|&(what, ..)| coef != 0.0 || what != "aux") {
            let diff = (got - want[key].as_f64().unwrap()).abs();
            eprintln!("{name}: {what} {got:.7} (|ember - transformers| = {diff:.2e})");
            assert!(diff < 1e-5, "{name}: {what} {got} vs {}", want[key]);
        }
        let grads = loss.backward();
        let ours: BTreeMap<String, TensorData> =
            hf_tensors(&gradient_model(&model, &grads), arch).unwrap().into_iter().collect();
        let bytes = std::fs::read(fixture(name).join("grads.safetensors")).unwrap();
        let theirs = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = theirs.names().into_iter().map(String::from).collect();
        names.sort();
        assert_eq!(names, ours.keys().cloned().collect::<Vec<_>>(), "{name}: every parameter has a gradient");
        let mut worst = (0f32, String::new());
        for key in names {
            let view = theirs.tensor(&key).unwrap();
            let reference: Vec<f32> =
                view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let got = ours[&key].to_vec::<f32>().unwrap();
            let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
            let rel = max_diff(&got, &reference) / scale;
            if rel > worst.0 {
                worst = (rel, key.clone());
            }
            assert!(rel < 1e-4, "{name}: gradient of {key}: {rel:.2e} relative");
        }
        eprintln!("{name}: every gradient within {:.2e} relative (worst {})", worst.0, worst.1);
    }
}
