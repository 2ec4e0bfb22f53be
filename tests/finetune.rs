//! Hugging Face models in and out through the CLI, and a LoRA fine-tune of a tiny imported model.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData};
use common::*;
use ember_train::metrics::read_metrics;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf").join(name)
}

fn tensors(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            for (k, t) in ember_model::weights::from_safetensors(&bytes, "x").unwrap().0 {
                out.insert(k, t.as_bytes().to_vec());
            }
        }
    }
    out
}

fn logits(model: &ember_model::Decoder<Flex>, ids: &[i32]) -> Vec<f32> {
    let t = Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &Default::default());
    model.forward(t).into_data().to_vec::<f32>().unwrap()
}

#[test]
fn import_sample_export_round_trip() {
    let s = Scratch::new();
    let dir = fixture("llama");
    let o = s.ember(&["import", dir.to_str().unwrap(), "--out", "llama"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("imported LlamaForCausalLM"), "{}", stdout(&o));
    let o = s.ember(&[
        "sample",
        "--checkpoint",
        "llama",
        "--prompt",
        "First Citizen",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("First Citizen"));
    let o = s.ember(&["export", "llama", "--format", "hf", "--out", "out", "--max-shard-size", "100KB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = s.path().join("out");
    for f in ["config.json", "tokenizer.json", "model.safetensors.index.json"] {
        assert!(out.join(f).is_file(), "{f}");
    }
    assert_eq!(tensors(&out), tensors(&dir), "export of an import gives the original tensors, byte for byte");
    // Exporting into a folder that holds something is refused.
    let o = s.ember(&["export", "llama", "--out", "out"]);
    assert_clean_error(&o, "the output folder exists and is not empty");
    // Importing into an existing run is refused.
    let o = s.ember(&["import", dir.to_str().unwrap(), "--out", "llama"]);
    assert_clean_error(&o, "already holds a run");
}

/// The tiny Qwen2 fixture imported as `base`, 36 prompt/completion examples in `data.jsonl`, and
/// `lora.toml`: 30 LoRA steps of rank 4 on five of the projections, evaluated every 10, with
/// `extra` appended.
fn lora_run(s: &Scratch, extra: &str) {
    let base = fixture("qwen2");
    let o = s.ember(&["import", base.to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut jsonl = String::new();
    let pairs = [
        ("First Citizen", " You are all resolved."),
        ("All", " Speak, speak."),
        ("Caius Marcius", " chief enemy to the people."),
    ];
    for i in 0..36 {
        let (p, c) = pairs[i % 3];
        jsonl.push_str(&serde_json::json!({"prompt": format!("{p}:"), "completion": c}).to_string());
        jsonl.push('\n');
    }
    s.write("data.jsonl", &jsonl);
    s.write(
        "lora.toml",
        (r#"
init_from = "run:base"

[data]
path = "data.jsonl"

[train]
batch_size = 4
seq_len = 32
max_steps = 30
eval_interval = 10
eval_iters = 2
log_interval = 5
checkpoint_interval = 10
seed = 3

[optim]
weight_decay = 0.0
grad_clip = 1.0

[schedule]
lr = 5e-3
warmup_steps = 3

[lora]
rank = 4
alpha = 8.0
targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
"#
        .to_string()
            + extra)
            .as_str(),
    );
}

/// With `[muon] lora = true`, Muon trains the adapters (its buffers in the optimizer's state, no
/// AdamW moments for them) and the completion loss falls as with AdamW.
#[test]
fn lora_with_muon_on_the_adapters_lowers_the_loss() {
    let s = Scratch::new();
    lora_run(&s, "\n[muon]\nlr = 0.02\nlora = true\n");
    let o = s.ember(&["train", "--config", "lora.toml", "--run-dir", "ft"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let records = read_metrics(&s.path().join("ft/metrics.jsonl")).unwrap();
    let vals: Vec<f64> = records.iter().filter_map(|r| r.val_loss).collect();
    assert!(vals[vals.len() - 1] < vals[0] - 0.1, "completion loss must fall: {vals:?}");
    let bytes = std::fs::read(s.path().join("ft/checkpoints/step-000030/optimizer.safetensors")).unwrap();
    let state = ember_model::weights::from_safetensors(&bytes, "optimizer").unwrap().0;
    let buffers: Vec<&String> = state.keys().filter(|k| k.ends_with(".momentum_buffer")).collect();
    assert_eq!(buffers.len(), 2 * 5 * 2, "A and B of 5 projections in 2 layers: {:?}", state.keys());
    assert!(buffers.iter().all(|k| k.contains(".lora.lora_")) && !state.keys().any(|k| k.ends_with(".exp_avg")));
}

/// Examples are read in epochs: a step's rows do not depend on its split, so 8 × 1, 4 × 2 and
/// 2 × 4 (examples of uneven lengths, token-weighted) give the same losses and gradient norms step
/// by step; and a run paused mid-epoch and resumed ends with the unbroken run's adapters.
#[test]
fn a_step_reads_the_same_examples_whatever_its_split() {
    let s = Scratch::new();
    lora_run(&s, "");
    let base = std::fs::read_to_string(s.path().join("lora.toml")).unwrap();
    let mut runs = Vec::new();
    for (batch, accum) in [(8, 1), (4, 2), (2, 4)] {
        let text = base
            .replace("batch_size = 4", &format!("batch_size = {batch}\ngrad_accum_steps = {accum}"))
            .replace("max_steps = 30", "max_steps = 6")
            .replace("checkpoint_interval = 10", "checkpoint_interval = 3")
            .replace("log_interval = 5", "log_interval = 1");
        let (config, run) = (format!("{batch}x{accum}.toml"), format!("r{batch}x{accum}"));
        s.write(&config, &text);
        let o = s.ember(&["train", "--config", &config, "--run-dir", &run]);
        assert!(o.status.success(), "{}", stderr(&o));
        let records = read_metrics(&s.path().join(&run).join("metrics.jsonl")).unwrap();
        runs.push(records.iter().map(|r| (r.step, r.train_loss, r.grad_norm)).collect::<Vec<_>>());
    }
    assert_eq!(runs[0].len(), 6, "{:?}", runs[0]);
    for other in &runs[1..] {
        for ((step, l0, g0), (_, l1, g1)) in runs[0].iter().zip(other) {
            assert!((l0 - l1).abs() <= 1e-5 * l0 && (g0 - g1).abs() <= 1e-5 * g0, "step {step}: {runs:?}");
        }
    }
    // Paused at step 3 of 6, mid-epoch, and resumed.
    let records = read_metrics(&s.path().join("r8x1/metrics.jsonl")).unwrap();
    let epoch = records[2].epoch.unwrap();
    assert!(epoch.fract() > 0.05 && epoch.fract() < 0.95, "step 3 ends mid-epoch: {epoch}");
    let o = s.ember(&["train", "--config", "8x1.toml", "--run-dir", "paused", "--max-steps", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["train", "--config", "8x1.toml", "--run-dir", "paused", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let last = |run: &str| tensors(&s.path().join(run).join("checkpoints/step-000006"));
    assert_eq!(last("paused"), last("r8x1"), "resumed mid-epoch vs unbroken");

    // The same run's length given as 4 epochs of its 11 rows (the 32 examples packed):
    // ceil(4 × 11 / 8) = 6 steps, the same run; the run directory keeps the steps.
    let rows = (8.0 / records[0].epoch.unwrap()).round();
    assert_eq!(rows, 11.0, "{:?}", records[0]);
    let text = std::fs::read_to_string(s.path().join("8x1.toml")).unwrap().replace("max_steps = 6", "num_epochs = 4");
    s.write("epochs.toml", &text);
    let o = s.ember(&["train", "--config", "epochs.toml", "--run-dir", "epochs"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("train.num_epochs = 4: 11 rows, 8 a step"), "{}", stderr(&o));
    let saved = std::fs::read_to_string(s.path().join("epochs/config.toml")).unwrap();
    assert!(saved.contains("max_steps = 6\n") && !saved.contains("num_epochs"), "{saved}");
    let epochs = read_metrics(&s.path().join("epochs/metrics.jsonl")).unwrap();
    let end = epochs.last().map(|r| (r.step, r.epoch.map(|e| (e * 11.0).round())));
    assert_eq!(end, Some((6, Some(48.0))), "6 steps of 8 rows");
    assert_eq!(last("epochs"), last("r8x1"), "4 epochs vs 6 steps");
}

#[test]
fn lora_fine_tune_lowers_the_loss_keeps_the_base_and_merges() {
    let s = Scratch::new();
    lora_run(&s, "");
    let o = s.ember(&["train", "--config", "lora.toml", "--run-dir", "ft"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let records = read_metrics(&s.path().join("ft/metrics.jsonl")).unwrap();
    let vals: Vec<f64> = records.iter().filter_map(|r| r.val_loss).collect();
    assert_eq!(vals.len(), 3);
    assert!(vals[2] < vals[0] - 0.1, "completion loss must fall: {vals:?}");

    // The checkpoint holds adapters only, and the optimizer only their moments.
    let ckpt = s.path().join("ft/checkpoints/step-000030");
    assert!(ckpt.join("adapter.safetensors").is_file() && !ckpt.join("model.safetensors").exists());
    let adapters = tensors(&ckpt);
    assert!(!adapters.is_empty() && adapters.keys().all(|k| k.contains(".lora.")), "{:?}", adapters.keys());
    let bytes = std::fs::read(ckpt.join("optimizer.safetensors")).unwrap();
    let moments = ember_model::weights::from_safetensors(&bytes, "optimizer").unwrap().0;
    assert!(moments.keys().all(|k| k.contains(".lora.")), "{:?}", moments.keys());

    // Base weights are untouched: every non-adapter parameter is bit-identical to the import.
    let tuned =
        ember_train::Checkpoint::open(&s.path().join("ft")).unwrap().decoder::<Flex>(&Default::default()).unwrap();
    let imported =
        ember_train::Checkpoint::open(&s.path().join("base")).unwrap().decoder::<Flex>(&Default::default()).unwrap();
    let base_params: BTreeMap<String, TensorData> =
        ember_model::weights::named_tensors(&imported).into_iter().collect();
    let mut checked = 0;
    for (k, t) in ember_model::weights::named_tensors(&tuned) {
        if !k.contains(".lora.") {
            assert!(t.as_bytes() == base_params[&k].as_bytes(), "{k} changed");
            checked += 1;
        }
    }
    assert_eq!(checked, base_params.len());

    // `eval` of the held-out examples scores their completions: the run's last validation loss.
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "ft", "--data", "val", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let nll = r["nll"].as_f64().unwrap();
    assert!((nll - vals[2]).abs() < 1e-4, "eval of val {nll} vs the run's last val loss {}", vals[2]);
    // And a JSONL file, completions only, each example alone.
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "ft", "--data", "data.jsonl", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(r["examples"].as_u64(), Some(36));
    assert!(r["nll"].as_f64().unwrap() < vals[0], "the tuned model scores the training completions well: {r}");
    s.write("bad.jsonl", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{not json\n");
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "ft", "--data", "bad.jsonl"]);
    assert_clean_error(&o, "bad.jsonl:2:");

    // Export needs --merge; the merged export has the adapter model's logits.
    let o = s.ember(&["export", "ft", "--out", "merged"]);
    assert_clean_error(&o, "pass --merge");
    assert!(!s.path().join("merged").exists(), "a refused export leaves no folder");
    let o = s.ember(&["export", "ft", "--out", "merged", "--merge"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let merged =
        ember_hf::import::<Flex>(&s.path().join("merged"), DType::F32, false, false, &Default::default()).unwrap();
    assert_eq!(merged.architecture, ember_hf::families::qwen::QWEN2.architecture());
    let ids: Vec<i32> = (0..24).map(|i| (i * 5 + 1) % 128).collect();
    let (a, b) = (logits(&tuned, &ids), logits(&merged.model, &ids));
    let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff < 1e-4, "merged export vs adapters: {diff}");
    let moved = a.iter().zip(&logits(&imported, &ids)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(moved > 1e-3, "fine-tuning changed the model ({moved})");
    // Sampling works on the adapter checkpoint.
    let o =
        s.ember(&["sample", "--checkpoint", "ft", "--prompt", "All:", "--max-new-tokens", "6", "--temperature", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// LoRA on a quantized base: the tiny Qwen2 exported as a Q8_0 GGUF and trained from as
/// `init_from = "gguf:FILE"`. Its projections stay Q8_0 (the log counts them), the run's losses are
/// those of the same file imported to f32 (the same numbers as the base), its checkpoints hold the
/// adapters only and resume exactly, `sample` runs on it, and the merged export (f32, and
/// re-quantized to Q8_0) gives the adapted model's logits.
#[test]
fn lora_on_a_quantized_gguf_base_trains_resumes_and_merges() {
    let s = Scratch::new();
    lora_run(&s, "");
    let o = s.ember(&["export", "base", "--format", "gguf", "--dtype", "q8_0", "--out", "base-q8.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["import", "base-q8.gguf", "--out", "base-f32"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let toml = std::fs::read_to_string(s.path().join("lora.toml")).unwrap();
    s.write("q.toml", &toml.replace("init_from = \"run:base\"", "init_from = \"gguf:base-q8.gguf\""));
    s.write("f.toml", &toml.replace("init_from = \"run:base\"", "init_from = \"run:base-f32\""));
    let o = s.ember(&["train", "--config", "q.toml", "--run-dir", "q"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // 2 layers × 7 projections, 64 × 64 (q, o), 64 × 32 (k, v), 64 × 128 (gate, up, down), Q8_0's
    // 34 bytes a block of 32.
    let kept_bytes = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) / 32 * 34;
    let kept = format!("14 projections kept quantized ({:.1} MiB)", kept_bytes as f64 / (1 << 20) as f64);
    assert!(stderr(&o).contains(&kept), "{kept}: {}", stderr(&o));
    let o = s.ember(&["train", "--config", "f.toml", "--run-dir", "f"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("kept quantized"), "an f32 run keeps nothing quantized");
    let losses = |run: &str| -> Vec<f64> {
        let records = read_metrics(&s.path().join(run).join("metrics.jsonl")).unwrap();
        records
            .iter()
            .filter(|r| r.step > 0)
            .map(|r| r.train_loss)
            .chain(records.iter().filter_map(|r| r.val_loss))
            .collect()
    };
    let (q, f) = (losses("q"), losses("f"));
    assert_eq!(q.len(), f.len());
    for (a, b) in q.iter().zip(&f) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "quantized base {q:?} vs its f32 import {f:?}");
    }
    let vals: Vec<f64> =
        read_metrics(&s.path().join("q/metrics.jsonl")).unwrap().iter().filter_map(|r| r.val_loss).collect();
    assert!(vals[2] < vals[0] - 0.1, "completion loss must fall: {vals:?}");
    let ckpt = s.path().join("q/checkpoints/step-000030");
    assert!(ckpt.join("adapter.safetensors").is_file() && !ckpt.join("model.safetensors").exists());
    // Without [lora] every weight trains: the file is dequantized to f32, nothing kept.
    let full = toml.replace("init_from = \"run:base\"", "init_from = \"gguf:base-q8.gguf\"");
    s.write("full.toml", &full[..full.find("[lora]").unwrap()].replace("lr = 5e-3", "lr = 1e-3"));
    let o = s.ember(&["train", "--config", "full.toml", "--run-dir", "full", "--max-steps", "10"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("kept quantized"), "{}", stderr(&o));
    assert!(s.path().join("full/checkpoints/step-000010/model.safetensors").is_file());

    // Stopped at step 10 and resumed: the same adapters as the unbroken run.
    let o = s.ember(&["train", "--config", "q.toml", "--run-dir", "r", "--max-steps", "10"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["train", "--config", "q.toml", "--run-dir", "r", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(tensors(&s.path().join("r/checkpoints/step-000030")), tensors(&ckpt), "resumed vs unbroken");

    let o =
        s.ember(&["sample", "--checkpoint", "q", "--prompt", "All:", "--max-new-tokens", "6", "--temperature", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("All:"), "{}", stdout(&o));

    // Merged: the adapters folded into the dequantized weights.
    let tuned =
        ember_train::Checkpoint::open(&s.path().join("q")).unwrap().decoder::<Flex>(&Default::default()).unwrap();
    assert_eq!(tuned.quantized_projections().0, 14, "the run's model sits on the Q8_0 base");
    // Exact products, as the run computed (8-bit activations would add their own error).
    let tuned = tuned.clone().with_compute(tuned.compute().with_int8_inputs(false));
    let o = s.ember(&["export", "q", "--out", "merged", "--merge"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let merged =
        ember_hf::import::<Flex>(&s.path().join("merged"), DType::F32, false, false, &Default::default()).unwrap();
    let ids: Vec<i32> = (0..24).map(|i| (i * 5 + 1) % 128).collect();
    let (a, b) = (logits(&tuned, &ids), logits(&merged.model, &ids));
    let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff < 1e-4, "merged export vs adapters on the quantized base: {diff}");
    // Re-quantized when asked: the merged matrices in Q8_0 again.
    let o = s.ember(&["export", "q", "--out", "merged-q8.gguf", "--merge", "--format", "gguf", "--dtype", "q8_0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let file = ember_hf::gguf::model::read(&s.path().join("merged-q8.gguf")).unwrap();
    let q8 = file.stored.iter().filter(|(name, kind)| name.ends_with(".weight") && *kind == "Q8_0").count();
    assert!(q8 >= 14, "{:?}", file.stored);
}

/// `data.val_path` holds the run's validation examples (the training file is read whole): the
/// run's last val loss is `ember eval`'s of that file. `data.val_fraction = 0` trains without
/// validation: no val loss, no best checkpoint, said in the log; and a target val loss is refused.
#[test]
fn a_validation_file_of_its_own_or_none() {
    let s = Scratch::new();
    lora_run(&s, "");
    let lora = std::fs::read_to_string(s.path().join("lora.toml")).unwrap().replace("max_steps = 30", "max_steps = 10");
    let held: String = ["First Citizen:", "All:"]
        .iter()
        .map(|p| serde_json::json!({"prompt": p, "completion": " Speak."}).to_string() + "\n")
        .collect();
    s.write("held.jsonl", &held);
    s.write("own.toml", &lora.replace("path = \"data.jsonl\"", "path = \"data.jsonl\"\nval_path = \"held.jsonl\""));
    let o = s.ember(&["train", "--config", "own.toml", "--run-dir", "own", "--max-steps", "5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("train_examples=36") && stderr(&o).contains("val_examples=2"), "{}", stderr(&o));
    // The validation file is recorded too: changed, the resume is refused; as it was, it goes on.
    s.write("held.jsonl", &held.replace("Speak.", "Speak!"));
    let o = s.ember(&["train", "--config", "own.toml", "--run-dir", "own", "--resume"]);
    assert_clean_error(&o, "the validation file (data.val_path)");
    assert_clean_error(&o, "held.jsonl changed since this checkpoint was written");
    s.write("held.jsonl", &held);
    let o = s.ember(&["train", "--config", "own.toml", "--run-dir", "own", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let vals: Vec<f64> =
        read_metrics(&s.path().join("own/metrics.jsonl")).unwrap().iter().filter_map(|r| r.val_loss).collect();
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "own", "--data", "held.jsonl", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let (nll, last) = (r["nll"].as_f64().unwrap(), *vals.last().unwrap());
    assert!((nll - last).abs() < 1e-4, "eval of held.jsonl {nll} vs the run's last val loss {last}");

    s.write("none.toml", &lora.replace("path = \"data.jsonl\"", "path = \"data.jsonl\"\nval_fraction = 0"));
    let o = s.ember(&["train", "--config", "none.toml", "--run-dir", "none"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("no validation (data.val_fraction = 0)"), "{}", stderr(&o));
    assert!(stderr(&o).contains("train_examples=36") && stderr(&o).contains("val_examples=0"), "{}", stderr(&o));
    let records = read_metrics(&s.path().join("none/metrics.jsonl")).unwrap();
    assert!(records.iter().all(|r| r.val_loss.is_none()), "no val loss without validation");
    assert!(records.iter().any(|r| r.eval_train_loss.is_some()), "evaluations still score the training split");
    assert!(!s.path().join("none/best").exists(), "no best checkpoint without validation");
    assert!(s.path().join("none/checkpoints/step-000010").is_dir());
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "none", "--data", "val"]);
    assert_clean_error(&o, "trained without validation (data.val_fraction = 0)");

    let both =
        lora.replace("path = \"data.jsonl\"", "path = \"data.jsonl\"\nval_fraction = 0.2\nval_path = \"held.jsonl\"");
    s.write("both.toml", &both);
    let o = s.ember(&["train", "--config", "both.toml", "--run-dir", "both"]);
    assert_clean_error(&o, "data.val_fraction must be left out where data.val_path is set");
    let target = lora
        .replace("path = \"data.jsonl\"", "path = \"data.jsonl\"\nval_fraction = 0")
        .replace("seed = 3", "seed = 3\ntarget_val_loss = 1.0");
    s.write("target.toml", &target);
    let o = s.ember(&["train", "--config", "target.toml", "--run-dir", "target"]);
    assert_clean_error(&o, "train.target_val_loss = 1 needs validation");
}

/// What a LoRA run reads is checked when it is read again: its JSONL examples on resume (rows
/// added, shuffled or edited are refused by kind, a blank line is not a change), and its `gguf:`
/// base, replaced by weights of the same shapes, by `sample` and on resume (it used to be used
/// silently, and reported on resume as a diverged run).
#[test]
fn a_lora_run_refuses_changed_examples_and_a_replaced_base() {
    let s = Scratch::new();
    lora_run(&s, "");
    let o = s.ember(&["export", "base", "--format", "gguf", "--dtype", "q8_0", "--out", "base.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let toml = std::fs::read_to_string(s.path().join("lora.toml")).unwrap();
    s.write("g.toml", &toml.replace("init_from = \"run:base\"", "init_from = \"gguf:base.gguf\""));
    let o = s.ember(&["train", "--config", "g.toml", "--run-dir", "g", "--max-steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let resume = || s.ember(&["train", "--config", "g.toml", "--run-dir", "g", "--resume", "--max-steps", "3"]);

    let data = std::fs::read_to_string(s.path().join("data.jsonl")).unwrap();
    let lines: Vec<&str> = data.lines().collect();
    let changed = |lines: &[&str], needle: &str| {
        s.write("data.jsonl", &(lines.join("\n") + "\n"));
        let o = resume();
        assert_clean_error(&o, "data.jsonl changed since this checkpoint was written");
        assert!(stderr(&o).contains(needle), "{needle}: {}", stderr(&o));
    };
    let mut added = lines.clone();
    added.push(r#"{"prompt": "All:", "completion": " Speak."}"#);
    changed(&added, "36 rows then, 37 now (1 row added at the end, the first 36 as they were)");
    let mut shuffled = lines.clone();
    shuffled.swap(0, 1);
    changed(&shuffled, "the same 36 rows in another order (shuffled)");
    let mut edited = lines.clone();
    edited[5] = r#"{"prompt": "All:", "completion": " Resolved."}"#;
    changed(&edited, "36 rows then and now, but their content changed (rows edited or replaced");
    changed(&lines[1..], "36 rows then, 35 now (1 row removed");
    // Blank lines are not rows: the same data.
    s.write("data.jsonl", &data.replace('\n', "\n\n"));
    let o = resume();
    assert!(o.status.success(), "{}", stderr(&o));

    // The base replaced by other weights of the same shapes: one quantized value changed.
    let gguf = s.path().join("base.gguf");
    let mut bytes = std::fs::read(&gguf).unwrap();
    let last = bytes.len() - 1;
    bytes[last] = bytes[last].wrapping_add(1);
    std::fs::write(&gguf, &bytes).unwrap();
    let needles = [
        "its base gguf:",
        "base.gguf changed since the run was trained (sha256 ",
        "point init_from at the original file",
    ];
    let o = s.ember(&["sample", "--checkpoint", "g", "--prompt", "All:", "--max-new-tokens", "2"]);
    assert_clean_error(&o, needles[0]);
    assert!(needles.iter().all(|n| stderr(&o).contains(n)), "{}", stderr(&o));
    let o = resume();
    assert_clean_error(&o, needles[1]);
    assert!(!stderr(&o).contains("diverged"), "{}", stderr(&o));
}

/// Issue 55: a LoRA fine-tune of SmolLM2 on TRL tool-calling rows (`messages` with an assistant's
/// `tool_calls` and a `tool` turn's answer, the row's `tools`) trains, scoring exactly what the
/// data crate's `encode` scores: the assistant's call as the template writes it and its answer.
/// The run's tokenizer folder gets Qwen2.5's template (ChatML with the same special tokens, and a
/// tools section); SmolLM2's own, which has none, gets the tools and the call as text, as the
/// server writes them, and scores the call all the same.
#[test]
fn a_lora_fine_tune_on_tool_calling_rows_trains_on_the_calls() {
    use ember_data::finetune::{encode, read_jsonl, ChatTemplate};
    let s = Scratch::new();
    let run = import_smollm2(&s);
    let tokenizer_dir = run.join("checkpoints/step-000000");
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates/qwen2.5.jinja");
    std::fs::copy(qwen, tokenizer_dir.join("chat_template.jinja")).unwrap();
    let tools = serde_json::json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let rows: String = (0..20)
        .map(|i| {
            let (city, temp) = [("Paris", 21), ("Rome", 25), ("Oslo", 8), ("Lima", 19), ("Cairo", 30)][i % 5];
            let row = serde_json::json!({"messages": [
                {"role": "user", "content": format!("Weather in {city}?")},
                {"role": "assistant", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
                {"role": "tool", "content": format!("{temp} C")},
                {"role": "assistant", "content": format!("It is {temp} C in {city}.")},
            ], "tools": tools});
            format!("{row}\n")
        })
        .collect();
    let data = s.write("tools.jsonl", &rows);
    // Rows of the longest example (train.seq_len left out), 4 steps of 2.
    s.write("lora.toml", &lora_config("smol", "tools.jsonl", 4, 2, 3e-3, 3).replace("seq_len = 16\n", ""));
    let o = s.ember(&["train", "--config", "lora.toml", "--run-dir", "ft"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // What encode scores: the call, as Qwen2.5's template writes it, and the answer.
    let template = ChatTemplate::from_dir(&tokenizer_dir).unwrap().unwrap();
    let tokenizer = ember_train::Checkpoint::open(&run).unwrap().tokenizer;
    let records = read_jsonl(&data).unwrap();
    let examples = encode(&records, &tokenizer, Some(&template)).unwrap();
    let scored: Vec<u32> =
        examples[0].ids.iter().zip(&examples[0].scored).filter(|(_, &s)| s).map(|(&i, _)| i).collect();
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>";
    let text = tokenizer.decode(&scored).unwrap();
    assert!(text.starts_with(call) && text.contains("It is 21 C in Paris.<|im_end|>"), "{text}");
    let smollm2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates/smollm2.jinja");
    let own = ChatTemplate::new(std::fs::read_to_string(smollm2).unwrap(), String::new(), "<|im_end|>".into()).unwrap();
    let example = &encode(&records[..1], &tokenizer, Some(&own)).unwrap()[0];
    let scored: Vec<u32> = example.ids.iter().zip(&example.scored).filter(|(_, &s)| s).map(|(&i, _)| i).collect();
    let own_text = tokenizer.decode(&scored).unwrap();
    assert!(own_text.starts_with(call) && own_text.contains("It is 21 C in Paris.<|im_end|>"), "{own_text}");
    assert!(tokenizer.decode(&example.ids).unwrap().contains("<tool_response>\n21 C\n</tool_response>"));
    // The run scored the same tokens: those of its 18 training rows (the last 2 held out).
    let want: usize = examples[..18].iter().map(|e| e.scored.iter().filter(|&&s| s).count()).sum();
    let log = stderr(&o);
    assert!(log.contains(&format!("train_examples=18 val_examples=2 train_scored_tokens={want} ")), "{want}: {log}");
    let records = read_metrics(&s.path().join("ft/metrics.jsonl")).unwrap();
    let vals: Vec<f64> = records.iter().filter_map(|r| r.val_loss).collect();
    assert!(vals.len() >= 2 && vals.iter().all(|v| v.is_finite()), "{vals:?}");
    assert!(vals[vals.len() - 1] < vals[0] * 0.5, "the loss on held-out tool calls falls: {vals:?}");
}
