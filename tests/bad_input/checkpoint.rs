//! Checkpoints and runs as `sample`, `eval` and `train --resume` read them.

use super::common::*;
use super::{refuse, with_run};

#[test]
fn folders_that_are_not_checkpoints() {
    let s = with_run();
    refuse(&s, &["sample", "--checkpoint", "nonexistent"], &["nonexistent: not a checkpoint: no such file"]);
    refuse(&s, &["sample", "--checkpoint", "corpus.txt"], &["corpus.txt: not a checkpoint"]);
    std::fs::create_dir(s.path().join("empty")).unwrap();
    refuse(&s, &["sample", "--checkpoint", "empty"], &["empty: not a checkpoint: no model.toml"]);
    refuse(&s, &["eval", "--perplexity", "--checkpoint", "empty", "--data", "val"], &["empty: not a checkpoint"]);
    s.write("runs/cfg/checkpoints/latest", "step-999999");
    refuse(&s, &["sample", "--checkpoint", "runs/cfg"], &["step-999999", "not a checkpoint"]);
}

/// The run's latest checkpoint folder.
fn latest(s: &Scratch) -> std::path::PathBuf {
    let name = std::fs::read_to_string(s.path().join("runs/cfg/checkpoints/latest")).unwrap();
    s.path().join("runs/cfg/checkpoints").join(name.trim())
}

#[test]
fn damaged_checkpoint_files() {
    let s = with_run();
    let dir = latest(&s);
    let model_toml = std::fs::read_to_string(dir.join("model.toml")).unwrap();
    std::fs::write(dir.join("model.toml"), "d_model = ").unwrap();
    refuse(&s, &["sample", "--checkpoint", "runs/cfg"], &["damaged checkpoint", "model.toml"]);
    std::fs::write(dir.join("model.toml"), model_toml.replace("d_model = 32", "d_model = 1000000")).unwrap();
    refuse(&s, &["sample", "--checkpoint", "runs/cfg"], &["model.d_model = 1000000 is larger"]);
    // Within the limits, but far more parameters than model.safetensors holds.
    std::fs::write(dir.join("model.toml"), model_toml.replace("n_layers = 2", "n_layers = 1000")).unwrap();
    refuse(&s, &["sample", "--checkpoint", "runs/cfg"], &["does not belong to these weights"]);
    std::fs::write(dir.join("model.toml"), &model_toml).unwrap();
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 3]).unwrap();
    refuse(&s, &["sample", "--checkpoint", "runs/cfg"], &["model.safetensors"]);
}

#[test]
fn eval_flags_and_files() {
    let s = with_run();
    let eval = |extra: &[&str]| -> Vec<String> {
        ["eval", "--perplexity", "--checkpoint", "runs/cfg"].iter().chain(extra).map(|x| x.to_string()).collect()
    };
    let run = |args: Vec<String>, needles: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refuse(&s, &args, needles);
    };
    run(eval(&["--data", "missing.txt"]), &["reading missing.txt"]);
    run(eval(&["--data", "val", "--context", "64"]), &["--context 64 must be in 1..=32"]);
    run(eval(&["--data", "val", "--context", "0"]), &["--context 0 must be in 1..=32"]);
    run(eval(&["--data", "val", "--context", "16", "--stride", "20"]), &["--stride 20 must be in 1..=16"]);
    s.write("one.txt", "a");
    run(eval(&["--data", "one.txt"]), &["one.txt: 1 tokens, at least 2 are needed"]);
    s.write("odd.txt", "Zounds, qu'est-ce que c'est?");
    run(eval(&["--data", "odd.txt"]), &["not in the char-level vocabulary"]);
    s.write("ex.jsonl", "{\"prompt\": 3}\n");
    run(eval(&["--data", "ex.jsonl"]), &["ex.jsonl:1:"]);
}

#[test]
fn resuming_and_restarting_runs() {
    let s = with_run();
    // A finished run is not overwritten by a new one.
    refuse(&s, &["train", "--config", "cfg.toml"], &["runs/cfg", "--resume"]);
    // Resuming with a config that describes another run names the section.
    s.write("other.toml", &tiny_config("").replace("max_steps = 6", "max_steps = 2").replace("d_ff = 64", "d_ff = 96"));
    refuse(&s, &["train", "--config", "other.toml", "--run-dir", "runs/cfg", "--resume"], &["[model] differs"]);
    s.write("lr.toml", &tiny_config("").replace("max_steps = 6", "max_steps = 2").replace("lr = 3e-3", "lr = 1e-2"));
    refuse(
        &s,
        &["train", "--config", "lr.toml", "--run-dir", "runs/cfg", "--resume"],
        &["[schedule] differs", "lr is 0.003 in the checkpoint, 0.01 now", "resume with the run's config.toml"],
    );
}

/// Every section that changes the optimisation is compared on resume, as a config difference (a
/// `[muon]` added used to be reported as a damaged checkpoint); and the data file is compared with
/// the checkpoint's record of it.
#[test]
fn resuming_after_the_optimisation_or_the_data_changed() {
    let s = with_run();
    let resume = |config: &str, needles: &[&str]| {
        refuse(&s, &["train", "--config", config, "--run-dir", "runs/cfg", "--resume"], needles);
    };
    let cfg = std::fs::read_to_string(s.path().join("cfg.toml")).unwrap();
    s.write("muon.toml", &format!("{cfg}\n[muon]\nlr = 0.02\n"));
    resume("muon.toml", &["[muon] differs", "the checkpoint's config has no [muon], this one has", "config.toml"]);
    s.write("seed.toml", &cfg.replace("seed = 7", "seed = 8"));
    resume("seed.toml", &["[train] differs", "seed is 7 in the checkpoint, 8 now"]);
    // The corpus changed after the run (characters it holds already: the vocabulary stays).
    let corpus = corpus();
    s.write("corpus.txt", &format!("{corpus}ROMEO:\nthe night is long,\n"));
    resume(
        "cfg.toml",
        &["corpus.txt changed since this checkpoint", "2 lines added at the end", "--accept-data-change", "--run-dir"],
    );
    s.write("corpus.txt", &corpus.replacen("night", "light", 1));
    resume("cfg.toml", &["corpus.txt changed", "content changed (lines edited or replaced"]);
    s.write("corpus.txt", &corpus.replacen("ROMEO:\n", "", 1));
    resume("cfg.toml", &["corpus.txt changed", "1 line removed"]);
    // Without --resume the flag means nothing: refused by name.
    refuse(&s, &["train", "--config", "cfg.toml", "--accept-data-change"], &["--accept-data-change", "--resume"]);
}

/// Weights holding NaN are sampled (the run is the user's), but not without a word naming the
/// tensor and the count.
#[test]
fn non_finite_weights_are_reported_when_sampled() {
    let s = with_run();
    let path = latest(&s).join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let (name, info) = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, v)| k.as_str() != "__metadata__" && v["dtype"] == "F32")
        .expect("an f32 tensor");
    let start = 8 + header_len + info["data_offsets"][0].as_u64().unwrap() as usize;
    for i in 0..3 {
        bytes[start + 4 * i..start + 4 * i + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&path, &bytes).unwrap();
    let o = s.ember(&["sample", "--checkpoint", "runs/cfg", "--prompt", "ROMEO:", "--max-new-tokens", "2"]);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(&format!("{name}: 3 NaN/Inf values of")), "{err}");
}
