//! Tiny random Llama, Qwen2 and Mistral models saved by transformers (tests/fixtures/hf, made by
//! tests/fixtures/make_hf_fixtures.py): ember's logits and greedy tokens match transformers', exports
//! round-trip, and damaged folders give errors that name the problem.

mod common;

use std::path::Path;

use burn::tensor::DType;
use common::{fixture, greedy, ids, logits, B};
use ember_hf::families::{
    llama::{LLAMA, MISTRAL},
    qwen::QWEN2,
};
use ember_hf::{export, import};
use ember_model::weights::named_tensors;
use ember_model::{Decoder, ModelConfig};
use serde_json::Value;

fn expected(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap()
}

#[test]
fn logits_and_greedy_tokens_match_transformers() {
    for (name, arch) in
        [("llama", LLAMA.architecture()), ("qwen2", QWEN2.architecture()), ("mistral", MISTRAL.architecture())]
    {
        let want = expected(name);
        let imported = import::<B>(&fixture(name), DType::F32, false, false, &Default::default()).unwrap();
        assert_eq!(imported.architecture, arch);
        assert!(imported.missing.is_empty() && imported.unused.is_empty());
        let prompt = ids(&want["ids"]);
        let got = logits(&imported.model, &prompt);
        let reference: Vec<f32> =
            want["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        assert_eq!(got.len(), reference.len());
        let diff = got.iter().zip(&reference).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(diff < 1e-4, "{name}: max |ember - transformers| = {diff} (logits up to {scale})");
        assert_eq!(greedy(&imported.model, &prompt, 20), ids(&want["generated"]), "{name}: greedy tokens");
    }
}

#[test]
fn fixture_features_are_the_ones_meant() {
    let cfg = |n: &str| {
        import::<B>(&fixture(n), DType::F32, false, false, &Default::default()).unwrap().model.config().clone()
    };
    let llama = cfg("llama");
    assert!(matches!(llama.rope_scaling, Some(ember_model::RopeScaling::Llama3 { .. })), "{llama:?}");
    assert!(fixture("llama").join("model.safetensors.index.json").is_file(), "sharded");
    let qwen = cfg("qwen2");
    assert!(qwen.qkv_bias && qwen.tie_embeddings && qwen.rope_theta == 1e6);
    assert_eq!(cfg("mistral").sliding_window, Some(8));
}

#[test]
fn export_then_import_gives_identical_tensors() {
    for name in ["llama", "qwen2", "mistral"] {
        let a = import::<B>(&fixture(name), DType::F32, false, false, &Default::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("export");
        // A small shard limit: the Llama export is sharded too.
        let report = export(&a.model, Some(&a.hf_config), &out, 64 * 1024, &[]).unwrap();
        assert_eq!(report.architecture, a.architecture);
        let b = import::<B>(&out, DType::F32, false, false, &Default::default()).unwrap();
        assert_eq!(b.model.config(), a.model.config(), "{name}");
        for ((ka, ta), (kb, tb)) in named_tensors::<B, _>(&a.model).into_iter().zip(named_tensors::<B, _>(&b.model)) {
            assert_eq!(ka, kb);
            assert!(ta.as_bytes() == tb.as_bytes(), "{name}: {ka} differs after the round trip");
        }
        // Token ids and other fields of the original config.json travel along.
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["eos_token_id"], a.hf_config["eos_token_id"]);
    }
}

#[test]
fn an_export_holds_its_extra_files_or_is_not_there_at_all() {
    let a = import::<B>(&fixture("qwen2"), DType::F32, false, false, &Default::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = fixture("qwen2").join("tokenizer.json");
    let out = dir.path().join("export");
    let report = export(&a.model, Some(&a.hf_config), &out, u64::MAX, std::slice::from_ref(&tokenizer)).unwrap();
    assert!(report.files.contains(&out.join("tokenizer.json")), "{:?}", report.files);
    assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), std::fs::read(&tokenizer).unwrap());

    // An extra file that cannot be copied: an error naming it, and no folder, whole or partial.
    let out = dir.path().join("second");
    let missing = dir.path().join("no-such-tokenizer.json");
    let err = export(&a.model, Some(&a.hf_config), &out, u64::MAX, &[tokenizer, missing]).unwrap_err().to_string();
    assert!(err.contains("no-such-tokenizer.json"), "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("export")], "left behind: {left:?}");
}

#[test]
fn interleaved_models_export_in_the_half_split_layout() {
    // An ember model trained with interleaved RoPE exports as half-split: same logits after import.
    let cfg = ModelConfig {
        rope_layout: ember_model::RopeLayout::Interleaved,
        qkv_bias: true,
        init_std: 0.2,
        ..ModelConfig::tiny(50, 32)
    };
    let model = Decoder::<B>::new(&cfg, 4, &Default::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    export(&model, None, &dir.path().join("x"), u64::MAX, &[]).unwrap();
    let back = import::<B>(&dir.path().join("x"), DType::F32, false, false, &Default::default()).unwrap();
    assert_eq!(back.architecture, QWEN2.architecture());
    assert_eq!(back.model.config().rope_layout, ember_model::RopeLayout::HalfSplit);
    let prompt: Vec<u32> = (0..20).map(|i| (i * 7) % 50).collect();
    let (a, b) = (logits(&model, &prompt), logits(&back.model, &prompt));
    let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn qwen25_05b_shapes_build_with_the_published_count() {
    let text = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "vocab_size": 151936}"#;
    let (cfg, _) = ember_hf::to_model_config(&serde_json::from_str(text).unwrap(), "config.json").unwrap();
    // Only the first 64 positions of RoPE tables: the parameter count does not depend on them.
    let cfg = ModelConfig { max_seq_len: 64, ..cfg };
    let model = Decoder::<B>::empty(&cfg, &Default::default()).unwrap();
    assert_eq!(burn::module::Module::num_params(&model), 494_032_768);
}

fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

fn import_err(dir: &Path) -> String {
    match import::<B>(dir, DType::F32, false, false, &Default::default()) {
        Ok(_) => panic!("{} imported", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn damaged_folders_give_errors_that_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    // A missing shard.
    let d = tmp.path().join("shard");
    copy_fixture("llama", &d);
    std::fs::remove_file(d.join("model-00002-of-00004.safetensors")).unwrap();
    let e = import_err(&d);
    assert!(
        e.contains("model.safetensors.index.json: lists shard `model-00002-of-00004.safetensors`, which is missing"),
        "{e}"
    );
    // A truncated file.
    let d = tmp.path().join("trunc");
    copy_fixture("qwen2", &d);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = import_err(&d);
    assert!(e.contains("model.safetensors: not a readable safetensors file") && e.contains("truncated"), "{e}");
    // A tensor of the wrong shape: claim a wider model than the weights are.
    let d = tmp.path().join("shape");
    copy_fixture("mistral", &d);
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = serde_json::json!(96);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = import_err(&d);
    assert!(e.contains("`model.layers.0.mlp.down_proj.weight`: expected shape [64, 96], found [64, 128]"), "{e}");
    // An unsupported architecture, named.
    let d = tmp.path().join("arch");
    copy_fixture("mistral", &d);
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["PhiForCausalLM"]);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    assert!(import_err(&d).contains("architecture `PhiForCausalLM` is not supported"));
    // A tensor the model does not have: an error unless allowed.
    let d = tmp.path().join("extra");
    copy_fixture("qwen2", &d);
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = serde_json::json!(1);
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = import_err(&d);
    assert!(e.contains("model.layers.1.") && e.contains("match no ember parameter"), "{e}");
    assert!(import::<B>(&d, DType::F32, false, true, &Default::default()).is_ok());
}

/// Issue 57: GGUF files whose faults were reported under another cause are refused for the real
/// one: an expert count under its own key (it was `llama.block_count`), an unknown tensor name as
/// unknown (it was "stored as a tensor ember does not map, which ember cannot read"), a token text
/// twice by both ids (it surfaced only as the tokenizers crate's warning), and a DeepSeek file with
/// both `attn_kv_b` and `attn_k_b`/`attn_v_b` by both names (one silently won).
#[test]
fn gguf_faults_are_refused_for_their_real_cause() {
    use ember_hf::gguf::model::{encode_model, read_file, ExportType};
    use ember_hf::gguf::{encode, GgmlType, GgufFile, TensorOut, Value};
    // A fixture's model (the DeepSeek-V3 one without its YaRN scaling, which GGUF holds otherwise)
    // exported as GGUF (f32), as its metadata and tensors, to be edited and encoded again.
    let exported = |name: &str| {
        let m = import::<B>(&fixture(name), DType::F32, false, false, &Default::default()).unwrap();
        let tokenizer = std::fs::read_to_string(fixture(name).join("tokenizer.json")).unwrap();
        let (model, base) = match name {
            "deepseek_v3" => {
                let config = ModelConfig { rope_scaling: None, ..m.model.config().clone() };
                (Decoder::<B>::new(&config, 0, &Default::default()).unwrap(), None)
            }
            _ => (m.model, Some(m.hf_config)),
        };
        let bytes = encode_model(&model, base.as_ref(), &tokenizer, None, ExportType::F32).unwrap().bytes;
        let f = GgufFile::parse(bytes, Path::new("m.gguf")).unwrap();
        let tensors: Vec<TensorOut> = f
            .tensors
            .iter()
            .map(|t| TensorOut { name: t.name.clone(), shape: t.shape(), kind: t.kind, data: f.raw(t).to_vec() })
            .collect();
        (f.metadata.clone(), tensors, model.config().clone())
    };
    let refused = |meta: &std::collections::BTreeMap<String, Value>, tensors: &[TensorOut]| {
        let meta: Vec<(String, Value)> = meta.clone().into_iter().collect();
        let f = GgufFile::parse(encode(&meta, tensors), Path::new("m.gguf")).unwrap();
        read_file(f).err().expect("an error").to_string()
    };

    let (mut meta, tensors, _) = exported("mixtral");
    meta.insert("llama.expert_count".into(), Value::U32(1_000_000));
    let e = refused(&meta, &tensors);
    assert!(e.contains("m.gguf: metadata `llama.expert_count`") && e.contains("moe.n_experts = 1000000"), "{e}");
    meta.insert("llama.expert_count".into(), Value::U32(2));
    meta.insert("llama.expert_used_count".into(), Value::U32(3));
    let e = refused(&meta, &tensors);
    assert!(e.contains("metadata `llama.expert_used_count`") && e.contains("moe.top_k"), "{e}");

    let (mut meta, mut tensors, _) = exported("qwen2");
    let extra =
        TensorOut { name: "blk.0.attn_foo.weight".into(), shape: vec![4], kind: GgmlType::F32, data: vec![0; 16] };
    tensors.push(extra);
    let e = refused(&meta, &tensors);
    assert!(e.contains("tensor `blk.0.attn_foo.weight` is not a tensor of llama.cpp's `qwen2` architecture"), "{e}");
    assert!(!e.contains("cannot read"), "{e}");
    tensors.pop();
    let Some(Value::Array(tokens)) = meta.get_mut("tokenizer.ggml.tokens") else { panic!("tokens") };
    tokens[9] = tokens[8].clone();
    let text = tokens[8].as_str().unwrap().to_string();
    let e = refused(&meta, &tensors);
    let want = format!("`tokenizer.ggml.tokens`: token {text:?} appears twice, as ids 8 and 9");
    assert!(e.contains(&want), "{e}");
    // Empty tokens are no duplicates of each other: read as llama.cpp reads them, `[EMPTY_<id>]`.
    let Some(Value::Array(tokens)) = meta.get_mut("tokenizer.ggml.tokens") else { panic!("tokens") };
    (tokens[8], tokens[9]) = (Value::String(String::new()), Value::String(String::new()));
    let f = GgufFile::parse(encode(&meta.clone().into_iter().collect::<Vec<_>>(), &tensors), Path::new("m.gguf"));
    let read = read_file(f.unwrap()).unwrap_or_else(|e| panic!("{e}"));
    assert!(read.tokenizer_json.contains("\"[EMPTY_9]\":9"), "{}", read.tokenizer_json);

    let (meta, mut tensors, config) = exported("deepseek_v3");
    assert!(tensors.iter().any(|t| t.name == "blk.0.attn_k_b.weight"), "the split form");
    let mla = config.mla.unwrap();
    let shape = vec![config.n_heads * (mla.nope_dim + mla.v_dim), mla.kv_rank];
    let n = shape.iter().product::<usize>();
    tensors.push(TensorOut { name: "blk.0.attn_kv_b.weight".into(), shape, kind: GgmlType::F32, data: vec![0; 4 * n] });
    let e = refused(&meta, &tensors);
    assert!(
        e.contains("blk.0.attn_k_b.weight and blk.0.attn_v_b.weight hold the same weight as `blk.0.attn_kv_b.weight`"),
        "{e}"
    );
}
