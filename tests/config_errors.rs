//! Config files as a new user meets them (issue 38): every problem of a file reported at once,
//! each naming its section, key and line as the file writes them, with what a misspelt name may
//! have meant; the defaults that let a fine-tuning config be short; `ember init`'s templates.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

#[test]
fn every_problem_is_listed_at_once_naming_section_key_and_line() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    let config = tiny_config("")
        .replace("batch_size = 4\n", "bath_size = 4\n")
        .replace("max_steps = 6\n", "")
        .replace("[optim]", "[optim]\nlr = 1e-3\nbeta1 = \"high\"")
        .replace("[schedule]", "[schedul]")
        + "\n[lora]\nrank = 4\n";
    s.write("bad.toml", &config);
    let line = |needle: &str| config.lines().position(|l| l == needle).unwrap() + 1;
    let o = s.ember(&["train", "--config", "bad.toml"]);
    let want = [
        "error: bad.toml: 5 problems:".to_string(),
        format!("  line {}: [train] unknown key \"bath_size\" — did you mean \"batch_size\"?", line("bath_size = 4")),
        format!("  line {}: [optim] unknown key \"lr\" — it belongs in [schedule]", line("lr = 1e-3")),
        format!("  line {}: [optim] beta1: invalid type: string \"high\", expected f64", line("beta1 = \"high\"")),
        format!("  line {}: [schedul] unknown section — did you mean [schedule]?", line("[schedul]")),
        "  [train] max_steps is missing".into(),
    ];
    assert_clean_error(&o, &want.join("\n"));
    assert!(!s.path().join("runs").exists(), "a refused config starts no run");
    // Once every key reads, every rule its values break, at once too.
    let config = tiny_config("").replace("batch_size = 4", "batch_size = 0").replace("[optim]", "[optim]\nbeta2 = 1.5");
    s.write("bad.toml", &config);
    let line = |needle: &str| config.lines().position(|l| l == needle).unwrap() + 1;
    let o = s.ember(&["train", "--config", "bad.toml"]);
    let want = [
        "error: bad.toml: 2 problems:".to_string(),
        format!("  line {}: train.batch_size must be at least 1, found 0", line("batch_size = 0")),
        format!("  line {}: optim.beta2 must be in [0, 1), found 1.5", line("beta2 = 1.5")),
    ];
    assert_clean_error(&o, &want.join("\n"));
}

#[test]
fn a_short_fine_tuning_config_is_completed_by_its_defaults() {
    // No [model], [optim] or [schedule], no evaluation cadence, no seq_len: the parse succeeds and
    // what is left is the run's (init_from is opened only when the run starts, and is missing).
    let s = Scratch::new();
    s.write("ft.toml", "init_from = \"run:nowhere\"\n[data]\npath = \"chat.jsonl\"\n[train]\nbatch_size = 2\nmax_steps = 40\n[lora]\nrank = 4\nalpha = 8\n");
    let o = s.ember(&["train", "--config", "ft.toml"]);
    // The source is opened only then, and is named (its own message is init.rs's).
    assert_clean_error(&o, "nowhere");
    assert!(!stderr(&o).contains("missing"), "{}", stderr(&o));
}

/// Issue 57: the minimal LoRA config (a source, the data, a rank, a length) was refused for its
/// batch size and LoRA alpha. It trains, each default it takes named in the log as one, and its
/// run directory's copy reads back as a config file (what a resumed run is given).
#[test]
fn the_minimal_lora_config_trains_and_logs_its_defaults() {
    let s = Scratch::new();
    let o = s.ember(&["import", repo("tests/fixtures/hf/qwen2").to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: String = (0..12)
        .map(|i| {
            format!("{}\n", serde_json::json!({"prompt": format!("Citizen {i}:"), "completion": " Speak, speak."}))
        })
        .collect();
    s.write("data.jsonl", &rows);
    s.write(
        "min.toml",
        "init_from = \"run:base\"\n[data]\npath = \"data.jsonl\"\n[lora]\nrank = 4\n[train]\nmax_steps = 2\n",
    );
    let o = s.ember(&["train", "--config", "min.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for default in [
        "[train] batch_size = 8 (default: Hugging Face Trainer's and TRL's per-device batch)",
        "[lora] alpha = 8.0 (default: 2 × rank, an update scaled by 2)",
        "[lora] targets = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"] (default",
        "[schedule] lr = 0.0002 (default: LoRA)",
    ] {
        assert!(stderr(&o).contains(default), "{default}: {}", stderr(&o));
    }
    let copy = s.path().join("runs/min/config.toml");
    let saved = ember_train::ConfigFile::read(&copy).unwrap_or_else(|e| panic!("{e}")).complete().unwrap();
    let lora = saved.lora.as_ref().unwrap();
    assert_eq!((saved.train.batch_size, lora.alpha, lora.targets.len()), (8, 8.0, 7));
}

#[test]
fn init_writes_each_template_and_never_overwrites() {
    let s = Scratch::new();
    for kind in ["pretrain", "lora", "full", "dpo", "grpo"] {
        let o = s.ember(&["init", kind]);
        assert!(o.status.success(), "{}", stderr(&o));
        let file = format!("{kind}.toml");
        let written = std::fs::read_to_string(s.path().join(&file)).unwrap();
        assert_eq!(written, std::fs::read_to_string(repo(&format!("configs/{file}"))).unwrap(), "{kind}");
        let parsed = ember_train::ConfigFile::read(&s.path().join(&file)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parsed.config.lora.is_some(), ["lora", "dpo", "grpo"].contains(&kind));
        assert_eq!(parsed.config.preference.is_some(), kind == "dpo");
        assert_eq!(parsed.config.rl.is_some(), kind == "grpo");
        assert!(stdout(&o).contains(&format!("ember train --config {file}")), "{}", stdout(&o));
    }
    // An existing file is kept as it is, whatever the kind asked for.
    s.write("mine.toml", "# my notes\n");
    for args in [&["init", "lora", "--out", "mine.toml"][..], &["init", "pretrain", "--out", "lora.toml"]] {
        let o = s.ember(args);
        assert_clean_error(&o, "already exists; remove it or choose another --out");
    }
    assert_eq!(std::fs::read_to_string(s.path().join("mine.toml")).unwrap(), "# my notes\n");
    assert_eq!(
        std::fs::read_to_string(s.path().join("lora.toml")).unwrap(),
        std::fs::read_to_string(repo("configs/lora.toml")).unwrap()
    );
    let o = s.ember(&["init", "lora", "--out", "no/such/folder/x.toml"]);
    assert_clean_error(&o, "creating no/such/folder/x.toml");
    let o = s.ember(&["init", "qlora"]);
    assert_clean_error(&o, "qlora");
}

/// `ember init lora` and then `ember init dpo` as written, on SmolLM2-135M-Instruct imported from
/// its GGUF and the repository's examples, as the README chains them (two steps each show that they
/// run). LoRA: the seq_len it leaves out comes from the longest example, not the model's 8,192
/// positions. DPO starts from the LoRA template's run (runs/lora, its adapters merged) on the
/// example pairs: the length in epochs becomes steps (144 training pairs, 4 a step: 2 epochs are
/// 72 steps), and the first evaluation is DPO at its reference (ln 2) plus the chosen answers' NLL
/// (`sft_weight = 1`).
#[test]
fn the_lora_and_dpo_templates_run_on_smollm2() {
    let model = assets().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.is_file(), "{} not found: set EMBER_TEST_ASSETS (../shared)", model.display());
    let s = Scratch::new();
    std::fs::create_dir(s.path().join("examples")).unwrap();
    for file in ["chat.jsonl", "preference.jsonl"] {
        std::fs::copy(repo(&format!("examples/{file}")), s.path().join("examples").join(file)).unwrap();
    }
    let o = s.ember(&["import", model.to_str().unwrap(), "--out", "runs/smollm2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for kind in ["lora", "dpo"] {
        let o = s.ember(&["init", kind]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let o = s.ember(&["train", "--config", "lora.toml", "--max-steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let saved = ember_train::TrainConfig::from_file(&s.path().join("runs/lora/config.toml")).unwrap();
    // The longest example of examples/chat.jsonl is 51 tokens through SmolLM2's chat template.
    assert_eq!(saved.train.seq_len, Some(64));
    assert_eq!((saved.schedule.lr, saved.train.eval_interval, saved.schedule.warmup_steps), (2e-4, 6, 3));
    assert!(stderr(&o).contains("train.seq_len left out: 64"), "{}", stderr(&o));

    let o = s.ember(&["train", "--config", "dpo.toml", "--max-steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("train.num_epochs = 2: 144 rows, 4 a step"), "{}", stderr(&o));
    assert!(stderr(&o).contains("init_from is a LoRA run: its adapters are merged"), "{}", stderr(&o));
    let saved = ember_train::TrainConfig::from_file(&s.path().join("runs/dpo/config.toml")).unwrap();
    assert_eq!((saved.train.max_steps, saved.train.num_epochs), (72, None));
    let metrics = std::fs::read_to_string(s.path().join("runs/dpo/metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let start = first["val_loss"].as_f64().unwrap();
    assert!(start > std::f64::consts::LN_2 + 0.5 && start.is_finite(), "step 0 val loss {start}");
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!(last["rewards/accuracies"].is_number(), "{last}");
}

/// `ember init grpo` as written, on SmolLM2-135M-Instruct and the repository's arithmetic prompts:
/// the held-out prompts are answered greedily at step 0 (the "val loss" is minus their mean
/// reward), and two steps of 2 prompts × 8 answers run and record TRL's metrics.
#[test]
fn the_grpo_template_runs_on_smollm2() {
    let model = assets().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.is_file(), "{} not found: set EMBER_TEST_ASSETS (../shared)", model.display());
    let s = Scratch::new();
    std::fs::create_dir(s.path().join("examples")).unwrap();
    std::fs::copy(repo("examples/arithmetic.jsonl"), s.path().join("examples/arithmetic.jsonl")).unwrap();
    let o = s.ember(&["import", model.to_str().unwrap(), "--out", "runs/smollm2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["init", "grpo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["train", "--config", "grpo.toml", "--max-steps", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("prompts from") && stderr(&o).contains("train_prompts=450 val_prompts=50"),
        "{}",
        stderr(&o)
    );
    let metrics = std::fs::read_to_string(s.path().join("runs/grpo/metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let start = -first["val_loss"].as_f64().unwrap();
    // SmolLM2 answers some sums right without training, and none in the #### form.
    assert!((0.1..1.0).contains(&start), "step 0 held-out reward {start}");
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    for key in ["reward", "rewards/gsm8k/mean", "rewards/format/mean", "completions/mean_length", "entropy"] {
        assert!(last[key].is_number(), "{key}: {last}");
    }
    let rollouts = std::fs::read_to_string(s.path().join("runs/grpo/rollouts.jsonl")).unwrap();
    assert_eq!(rollouts.lines().count(), 16, "step 1's answers");
}
