//! Hugging Face folders: `ember import` and `ember export`.

use std::path::Path;

use super::common::*;
use super::{refuse, with_run};

/// A scratch folder holding a copy of the Qwen2 fixture as `model/`.
fn with_model() -> Scratch {
    let s = Scratch::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen2");
    std::fs::create_dir(s.path().join("model")).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), s.path().join("model").join(f)).unwrap();
    }
    s
}

fn edit_config(s: &Scratch, key: &str, value: serde_json::Value) {
    let path = s.path().join("model/config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c[key] = value;
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
}

#[test]
fn config_json_values() {
    for (key, value, needle) in [
        ("vocab_size", serde_json::json!(1_000_000_000_000u64), "vocab_size = 1000000000000 is larger"),
        ("max_position_embeddings", serde_json::json!(1_000_000_000_000u64), "max_seq_len = 1000000000000 is larger"),
        ("hidden_size", serde_json::json!(-5), "hidden_size"),
        ("num_attention_heads", serde_json::json!(3), "must divide"),
        // Within every limit, but 64 layers where the file holds 2: the config does not describe it.
        ("num_hidden_layers", serde_json::json!(1000), "does not belong to these weights"),
        ("architectures", serde_json::json!(["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    ] {
        let s = with_model();
        edit_config(&s, key, value);
        refuse(&s, &["import", "model", "--out", "run"], &["config.json", needle]);
    }
    let s = with_model();
    s.write("model/config.json", "{\"hidden_size\": ");
    refuse(&s, &["import", "model", "--out", "run"], &["config.json"]);
    std::fs::remove_file(s.path().join("model/config.json")).unwrap();
    refuse(&s, &["import", "model", "--out", "run"], &["config.json"]);
    refuse(&s, &["import", "nowhere", "--out", "run"], &["nowhere"]);
}

#[test]
fn weight_files() {
    let s = with_model();
    let path = s.path().join("model/model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    refuse(&s, &["import", "model", "--out", "run"], &["model.safetensors"]);
    // A header that claims 2^62 bytes of JSON: an error, not an allocation.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    refuse(&s, &["import", "model", "--out", "run"], &["model.safetensors"]);
    std::fs::remove_file(&path).unwrap();
    refuse(&s, &["import", "model", "--out", "run"], &["no model.safetensors"]);
    s.write(
        "model/model.safetensors.index.json",
        "{\"weight_map\": {\"model.embed_tokens.weight\": \"part-1.safetensors\"}}",
    );
    refuse(&s, &["import", "model", "--out", "run"], &["part-1.safetensors"]);
    let s = with_model();
    refuse(&s, &["import", "model", "--out", "run", "--dtype", "f8"], &["f8"]);
}

#[test]
fn import_and_export_destinations() {
    let s = with_model();
    let o = s.ember(&["import", "model", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    refuse(&s, &["import", "model", "--out", "run"], &["already holds a run"]);
    std::fs::create_dir(s.path().join("full")).unwrap();
    s.write("full/notes.txt", "mine");
    refuse(&s, &["export", "run", "--out", "full"], &["the output folder exists and is not empty"]);
    refuse(&s, &["export", "run", "--out", "out", "--max-shard-size", "0.1B"], &["below the smallest shard size"]);
    refuse(&s, &["export", "run", "--out", "out", "--max-shard-size", "lots"], &["lots"]);
    refuse(&s, &["export", "run", "--out", "out", "--format", "onnx"], &["onnx"]);
    let r = with_run();
    refuse(&r, &["export", "nowhere", "--out", "out"], &["nowhere"]);
}
