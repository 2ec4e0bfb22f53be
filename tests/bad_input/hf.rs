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
        ("architectures", serde_json::json!(["PhiForCausalLM"]), "PhiForCausalLM"),
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

/// Flags that one format would ignore, an import into a folder of the user's own files, and a
/// run's unreadable hf_config.json: each said, never silent.
#[test]
fn settings_that_would_be_ignored_and_folders_that_are_not_new() {
    let s = with_model();
    let o = s.ember(&["import", "model", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    refuse(&s, &["export", "run", "--out", "out", "--dtype", "q8_0"], &["--dtype", "--format gguf"]);
    refuse(&s, &["export", "run", "--out", "m.gguf", "--max-shard-size", "1GB"], &["--max-shard-size", "one file"]);
    refuse(&s, &["export", "run", "--format", "gguf", "--out", "m", "--max-shard-size", "1GB"], &["--max-shard-size"]);
    std::fs::create_dir(s.path().join("mine")).unwrap();
    s.write("mine/notes.txt", "keep me");
    refuse(&s, &["import", "model", "--out", "mine"], &["mine exists and holds files"]);
    refuse(&s, &["import", "model", "--out", "mine/notes.txt"], &["notes.txt is a file"]);
    // An --out ending in .gguf is a GGUF export without --format.
    let o = s.ember(&["export", "run", "--out", "auto.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(s.path().join("auto.gguf")).unwrap().starts_with(b"GGUF"));
    // A damaged hf_config.json is warned of, not silently dropped.
    let latest = std::fs::read_to_string(s.path().join("run/checkpoints/latest")).unwrap();
    s.write(&format!("run/checkpoints/{}/hf_config.json", latest.trim()), "{\"model_type\": ");
    let o = s.ember(&["export", "run", "--out", "again.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("hf_config.json: not JSON"), "{}", stderr(&o));
}

/// A scratch folder with the Qwen2 fixture imported as `run` and exported as `model.gguf` (f32).
fn with_gguf() -> (Scratch, Vec<u8>) {
    let s = with_model();
    let o = s.ember(&["import", "model", "--out", "run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["export", "run", "--format", "gguf", "--out", "model.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(s.path().join("model.gguf")).unwrap();
    (s, bytes)
}

/// The byte offset just past the first occurrence of `needle`.
fn after(bytes: &[u8], needle: &[u8]) -> usize {
    bytes.windows(needle.len()).position(|w| w == needle).expect("needle in file") + needle.len()
}

#[test]
fn gguf_files() {
    let (s, good) = with_gguf();
    let import = |s: &Scratch, file: &str, bytes: &[u8], needles: &[&str]| {
        std::fs::write(s.path().join(file), bytes).unwrap();
        refuse(s, &["import", file, "--out", "again"], needles);
    };
    import(&s, "truncated.gguf", &good[..good.len() / 2], &["truncated.gguf", "run past the end"]);
    import(&s, "header.gguf", &good[..40], &["header.gguf"]);
    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGML");
    import(&s, "magic.gguf", &magic, &["magic.gguf", "magic"]);
    let mut version = good.clone();
    version[4..8].copy_from_slice(&7u32.to_le_bytes());
    import(&s, "version.gguf", &version, &["version 7"]);
    let mut counts = good.clone();
    counts[16..24].copy_from_slice(&(1u64 << 62).to_le_bytes());
    import(&s, "counts.gguf", &counts, &["cannot fit"]);
    // The token list claims 2^40 entries.
    let at = after(&good, b"tokenizer.ggml.tokens") + 4 + 4;
    let mut array = good.clone();
    array[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    import(&s, "array.gguf", &array, &["tokenizer.ggml.tokens", "cannot fit"]);
    // The norm tensor's offset points past the end; its type is one ember cannot read.
    let name = b"\x12\0\0\0\0\0\0\0output_norm.weight";
    let info = after(&good, name);
    let (kind_at, offset_at) = (info + 4 + 8, info + 4 + 8 + 4);
    let mut offset = good.clone();
    offset[offset_at..offset_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    import(&s, "offset.gguf", &offset, &["output_norm.weight", "run past the end"]);
    let mut kind = good.clone();
    kind[kind_at..kind_at + 4].copy_from_slice(&23u32.to_le_bytes());
    import(&s, "kind.gguf", &kind, &["output_norm.weight", "IQ4_XS"]);
    // An architecture ember does not map.
    let at = after(&good, b"general.architecture") + 4 + 8;
    let mut arch = good.clone();
    arch[at..at + 5].copy_from_slice(b"gemma");
    import(&s, "arch.gguf", &arch, &["general.architecture", "`gemma` is not supported"]);
    // Export refuses to overwrite.
    refuse(&s, &["export", "run", "--format", "gguf", "--out", "model.gguf"], &["model.gguf", "exists"]);
    refuse(&s, &["export", "run", "--format", "gguf", "--dtype", "q4_k", "--out", "q.gguf"], &["q4_k"]);
}

/// Issue 39: a metadata key twice is refused (not "the later one wins").
#[test]
fn gguf_duplicate_metadata_key() {
    let (s, good) = with_gguf();
    // `qwen2.block_count` renamed `general.file_type` (both 17 bytes): that key twice.
    let at = after(&good, b"qwen2.block_count") - 17;
    let mut twice = good.clone();
    twice[at..at + 17].copy_from_slice(b"general.file_type");
    std::fs::write(s.path().join("twice.gguf"), &twice).unwrap();
    refuse(&s, &["import", "twice.gguf", "--out", "again"], &["twice.gguf", "`general.file_type` appears twice"]);
}

/// Issue 39: GGUF is told by its magic bytes, not by its name; NaN weights import with a warning
/// that names the tensor.
#[test]
fn gguf_by_magic_and_non_finite_weights() {
    let (s, good) = with_gguf();
    std::fs::write(s.path().join("model.bin"), &good).unwrap();
    let o = s.ember(&["import", "model.bin", "--out", "bin"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("imported GGUF qwen2"), "{}", stdout(&o));
    // Two NaNs in the final norm's gains (f32): a warning, not a refusal.
    let file = ember_hf::gguf::GgufFile::parse(good.clone(), Path::new("model.gguf")).unwrap();
    let norm = file.tensor("output_norm.weight").expect("a final norm").clone();
    let mut nan = good.clone();
    for i in 0..2 {
        nan[norm.start + 4 * i..norm.start + 4 * i + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(s.path().join("nan.gguf"), &nan).unwrap();
    let o = s.ember(&["import", "nan.gguf", "--out", "nan"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = format!("output_norm.weight: 2 NaN/Inf values of {}", norm.num_values());
    assert!(stderr(&o).contains(&want), "stderr lacks `{want}`:\n{}", stderr(&o));
}

/// Issue 39: a path that is neither a file nor a folder is named for what it is (it was
/// "config.json: Not a directory"), and never opened; a file that is not GGUF says so.
#[test]
fn import_of_a_fifo_or_a_plain_file() {
    let s = Scratch::new();
    // The FIFO lives outside the scratch folder, whose snapshot would block reading it.
    let elsewhere = Scratch::new();
    let fifo = elsewhere.path().join("model.gguf");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.to_str().unwrap();
    refuse(&s, &["import", fifo, "--out", "run"], &[fifo, "is a FIFO"]);
    s.write("notes.txt", "not a model");
    refuse(&s, &["import", "notes.txt", "--out", "run"], &["notes.txt", "a file that is not GGUF"]);
}

/// A thread that, after `secs`, opens `fifo` to write and closes it: an ember that hangs reading
/// the FIFO (the fault tested for) then gets an end of file and fails the test's needles instead of
/// hanging it. A fixed ember never opens it; the thread then waits unseen until the tests end.
fn unblock_later(fifo: &Path, secs: u64) {
    let fifo = fifo.to_path_buf();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(secs));
        drop(std::fs::OpenOptions::new().write(true).open(&fifo));
    });
}

/// Issue 57: a source that is not what its prefix says is named with the prefix it needs: a FIFO
/// refused at once (`init_from = "gguf:FIFO"` hung; a config that is a FIFO too), a GGUF file
/// given as `hf:` or `run:` told to use `gguf:` (it was "config.json: Not a directory"), a folder
/// given as `gguf:` told to use `hf:` or `run:`.
#[test]
fn sources_that_are_not_what_their_prefix_says() {
    let (s, _) = with_gguf();
    let elsewhere = Scratch::new();
    let fifo = elsewhere.path().join("pipe");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    unblock_later(&fifo, 60);
    let fifo = fifo.to_str().unwrap();
    let sample = |source: &str, needles: &[&str]| {
        refuse(&s, &["sample", "--checkpoint", source, "--prompt", "a"], needles);
    };
    sample(&format!("gguf:{fifo}"), &[&format!("{fifo} is a FIFO (named pipe), not a GGUF file")]);
    sample(&format!("hf:{fifo}"), &["is a FIFO (named pipe), not a Hugging Face model folder"]);
    sample("hf:model.gguf", &["--checkpoint hf:model.gguf: model.gguf is a GGUF file: use gguf:model.gguf"]);
    sample("run:model.gguf", &["model.gguf is a GGUF file: use gguf:model.gguf"]);
    sample("gguf:model", &["model is a folder, not a GGUF file (a Hugging Face model folder): use hf:model"]);
    sample("gguf:run", &["run is a folder, not a GGUF file (an ember run): use run:run"]);
    let lora = "\n[data]\npath = \"corpus.txt\"\n[lora]\nrank = 4\nalpha = 8\n[train]\nbatch_size = 2\nmax_steps = 1\n";
    s.write("corpus.txt", &corpus());
    s.write("ft.toml", &format!("init_from = \"gguf:{fifo}\"\n{lora}"));
    refuse(&s, &["train", "--config", "ft.toml"], &[&format!("init_from = \"gguf:{fifo}\""), "is a FIFO"]);
    s.write("hf.toml", &format!("init_from = \"hf:model.gguf\"\n{lora}"));
    refuse(&s, &["train", "--config", "hf.toml"], &["init_from = \"hf:model.gguf\"", "use gguf:model.gguf"]);
    refuse(&s, &["train", "--config", fifo], &[&format!("{fifo}: is a FIFO (named pipe), not a regular file")]);
}

/// Issue 57: `--allow-missing` keeps the size check: a config describing 5.7 B parameters over a
/// 160 KB folder is refused, naming the config and both sizes, before anything is allocated (it
/// allocated 22 GB, and aborted where that was not there).
#[test]
fn allow_missing_keeps_the_size_check() {
    let s = with_model();
    for (key, value) in [("hidden_size", 4096), ("intermediate_size", 11008), ("num_hidden_layers", 28)] {
        edit_config(&s, key, serde_json::json!(value));
    }
    edit_config(&s, "num_attention_heads", serde_json::json!(32));
    edit_config(&s, "num_key_value_heads", serde_json::json!(32));
    let needles = ["model/config.json", "describes 5667606528 parameters", "hold only 164992 bytes", "--allow-missing"];
    refuse(&s, &["import", "model", "--out", "run", "--allow-missing"], &needles);
}
