//! Reinforcement learning (GRPO and its variants): the loss, its metrics and every gradient against
//! TRL 1.16's `GRPOTrainer._compute_loss` on the tiny Llama (tests/fixtures/rl, made by its
//! make_fixture.py); GRPO through `ember train`, learning a verifiable reward, resuming, logging
//! rollouts; and the bad inputs a user makes, each refused by name.

mod common;
mod trl_parity;

use std::path::{Path, PathBuf};

use burn::tensor::Tensor;
use common::*;
use ember_data::preference::Turns;
use ember_data::prompts::{encode_prompts, PromptRecord};
use ember_train::config::{Importance, RlLoss, ScaleRewards};
use ember_train::metrics::read_metrics;
use ember_train::preference::scalar;
use ember_train::rl::{advantages, completion_logps, policy_loss, Answers, LossConfig, StepTotals};
use serde_json::Value;
use trl_parity::{assert_gradients, close, AD};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(numbers).collect()
}

fn ids(v: &Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .collect()
}

/// A scratch folder with the tiny Llama imported as `base`.
fn imported() -> Scratch {
    let s = Scratch::new();
    let llama = fixtures().join("hf/llama");
    let o = s.ember(&["import", llama.to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    s
}

#[test]
fn losses_metrics_and_gradients_equal_trls() {
    let s = imported();
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("rl/expected.json")).unwrap()).unwrap();
    // TRL's tokenization of text prompts.
    let tokenizer = ember_data::Tokenizer::from_file(&fixtures().join("hf/llama/tokenizer.json")).unwrap();
    let records: Vec<PromptRecord> = want["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, p)| PromptRecord {
            prompt: Turns::Text(p.as_str().unwrap().into()),
            row: Default::default(),
            line: i + 1,
        })
        .collect();
    let prompts = encode_prompts(&records, &tokenizer, None, std::path::Path::new("prompts.jsonl")).unwrap();
    let trl_prompts = ids(&want["prompt_ids"]);
    assert_eq!(prompts.iter().map(|p| p.ids.clone()).collect::<Vec<_>>(), trl_prompts);
    // TRL's advantages from the rewards.
    let (adv, _) = advantages(&numbers(&want["rewards"]), 2, ScaleRewards::Group, 0.0);
    for (got, trl) in adv.iter().zip(numbers(&want["advantages"])) {
        assert!(close(*got, trl, 1e-6, 1e-3), "advantage {got} vs TRL's {trl}");
    }

    let completions = ids(&want["completions"]);
    let n = completions.len();
    let base = Answers {
        prompts: (0..n).map(|i| trl_prompts[i / 2].clone()).collect(),
        completions: completions.clone(),
        advantages: adv,
        masked: vec![false; n],
        old_logps: None,
        ref_logps: None,
    };
    let temperature = want["temperature"].as_f64().unwrap();
    let device = Default::default();
    let checkpoint = ember_train::Checkpoint::open(&s.path().join("base")).unwrap();

    // The policy's per-token log-probabilities (at the temperature) and entropies.
    let policy = checkpoint.decoder::<AD>(&device).unwrap();
    let (logps, entropy) = completion_logps(&policy, &base, temperature, &device);
    let c = base.width();
    let flat = |t: Tensor<AD, 2>| t.inner().into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let (logps, entropy) = (flat(logps), flat(entropy));
    for (i, (lp, ent)) in rows(&want["per_token_logps"]).iter().zip(rows(&want["entropies"])).enumerate() {
        for j in 0..lp.len() {
            assert!(
                close(logps[i * c + j] as f64, lp[j], 1e-5, 1e-2),
                "logp [{i}][{j}] {} vs TRL's {}",
                logps[i * c + j],
                lp[j]
            );
            assert!(close(entropy[i * c + j] as f64, ent[j], 1e-5, 1e-2), "entropy [{i}][{j}]");
        }
    }

    let tokens: f64 = completions.iter().map(|c| c.len() as f64).sum();
    let totals = StepTotals::of(1.0, tokens, &base);
    let cases = want["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 18);
    for case in cases {
        let loss = match case["loss_type"].as_str().unwrap() {
            "grpo" => RlLoss::Grpo,
            "bnpo" => RlLoss::Bnpo,
            "dr_grpo" => RlLoss::DrGrpo,
            "dapo" => RlLoss::Dapo,
            other => panic!("{other}"),
        };
        let importance = match case["importance"].as_str().unwrap() {
            "token" => Importance::Token,
            _ => Importance::Sequence,
        };
        let (beta, mu) = (case["beta"].as_f64().unwrap(), case["num_iterations"].as_u64().unwrap());
        let name = format!("{loss:?} {importance:?} β={beta} μ={mu}");
        let config = LossConfig {
            loss,
            importance,
            epsilon_low: want["epsilon"].as_f64().unwrap(),
            epsilon_high: want["epsilon_high"].as_f64().unwrap(),
            beta,
            max_new_tokens: want["max_new_tokens"].as_u64().unwrap() as usize,
        };
        let answers = Answers {
            old_logps: (mu > 1).then(|| rows(&want["old_per_token_logps"])),
            ref_logps: (beta != 0.0).then(|| rows(&want["ref_per_token_logps"])),
            ..base.clone()
        };
        let policy = checkpoint.decoder::<AD>(&device).unwrap();
        let (logps, entropy) = completion_logps(&policy, &answers, temperature, &device);
        let out = policy_loss(&config, logps, entropy, &answers, totals);
        let got = scalar(out.loss.clone().inner());
        let trl = case["loss"].as_f64().unwrap();
        // The loss is a mean of terms of size |A|·r ~ 1 that cancel (on-policy to 0 exactly): f32
        // rounding of the terms is compared on their scale (1e-5 of 1e-2), not on the small result.
        assert!(close(got, trl, 1e-5, 1e-2), "{name}: loss {got} vs TRL's {trl}");
        for (key, value) in out.sums.named(beta) {
            let trl = case["metrics"][&key].as_f64().unwrap_or_else(|| panic!("{name}: TRL has no {key}"));
            assert!(close(value, trl, 1e-5, 1e-3), "{name}: {key} {value} vs TRL's {trl}");
        }
        assert_eq!(out.sums.named(beta).len(), case["metrics"].as_object().unwrap().len(), "{name}");

        // Every parameter's gradient, in Hugging Face's layout: its sum of squares within 1e-5, and 8
        // elements within 2e-5 of the larger of themselves and the gradient's RMS (f32 rounding: one
        // element of layer 1's q_proj is 1.1-1.3e-5 off under μ = 2, every other within 1e-5).
        assert_gradients(policy, out.loss, &case["gradients"], 1e-5, 2e-5, &name);
    }
}

/// 40 prompts over the fixture's vocabulary (8 texts, each with an `answer` column).
fn prompts_file(s: &Scratch) {
    let prompts = [
        "First Citizen:",
        "All:",
        "Caius Marcius:",
        "Before we proceed:",
        "Speak, speak.",
        "You are all resolved",
        "We know it,",
        "Hear me speak.",
    ];
    let mut text = String::new();
    for i in 0..40 {
        text.push_str(&format!("{}\n", serde_json::json!({"prompt": prompts[i % 8], "answer": (i % 5).to_string()})));
    }
    s.write("prompts.jsonl", &text);
}

/// GRPO on the tiny Llama: the reward is 1 for an answer with a comma or a period in it.
fn config(steps: usize, extra: &str) -> String {
    format!(
        r#"
init_from = "run:base"

[data]
path = "prompts.jsonl"
val_fraction = 0.2

[train]
batch_size = 2
max_steps = {steps}
eval_interval = 10
log_interval = 1
checkpoint_interval = 10
seed = 3

[optim]
weight_decay = 0.0

[schedule]
lr = 1e-2
warmup_steps = 2

[rl]
group_size = 8
max_new_tokens = 6
log_rollouts = 5
{extra}
[[rl.rewards]]
kind = "regex"
pattern = "[,.]"
"#
    )
}

#[test]
fn grpo_through_ember_train_raises_the_held_out_reward_and_resumes_exactly() {
    let s = imported();
    prompts_file(&s);
    s.write("grpo.toml", &config(30, ""));
    let o = s.ember(&["train", "--config", "grpo.toml", "--run-dir", "grpo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let records = read_metrics(&s.path().join("grpo/metrics.jsonl")).unwrap();
    assert_eq!(records.len(), 30);
    for r in &records {
        for key in [
            "reward",
            "reward_std",
            "frac_reward_zero_std",
            "rewards/regex/mean",
            "rewards/regex/std",
            "completions/mean_length",
            "completions/min_length",
            "completions/max_length",
            "completions/clipped_ratio",
            "completions/mean_terminated_length",
            "entropy",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/region_mean",
        ] {
            assert!(r.named.contains_key(key), "step {}: {key} missing: {:?}", r.step, r.named);
        }
        assert!(r.named["completions/max_length"] <= 6.0 && r.named["completions/min_length"] >= 1.0);
    }
    // The held-out prompts answered greedily: the reward at step 0 (in the first line) and after.
    let first: Value = serde_json::from_str(
        std::fs::read_to_string(s.path().join("grpo/metrics.jsonl")).unwrap().lines().next().unwrap(),
    )
    .unwrap();
    let start = -first["val_loss"].as_f64().unwrap();
    let evals: Vec<_> = records.iter().filter(|r| r.val_loss.is_some()).collect();
    assert_eq!(evals.iter().map(|r| r.step).collect::<Vec<_>>(), [10, 20, 30]);
    let end = evals.last().unwrap().named["val_reward"];
    assert!(start <= 0.5 && end >= start + 0.4, "held-out reward {start} -> {end}");
    let sampled =
        |rs: &[ember_train::metrics::StepRecord]| rs.iter().map(|r| r.named["reward"]).sum::<f64>() / rs.len() as f64;
    let (early, late) = (sampled(&records[..5]), sampled(&records[25..]));
    assert!(late > early + 0.3, "sampled reward {early} -> {late}");
    // Rollouts of steps 1, 5, 10, …: 2 prompts × 8 answers each.
    let rollouts = std::fs::read_to_string(s.path().join("grpo/rollouts.jsonl")).unwrap();
    let lines: Vec<Value> = rollouts.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 7 * 16);
    for l in &lines {
        let completion = l["completion"].as_str().unwrap();
        let want = if completion.contains(',') || completion.contains('.') { 1.0 } else { 0.0 };
        assert_eq!(l["rewards"]["regex"].as_f64(), Some(want), "{l}");
        assert_eq!(l["reward"].as_f64(), Some(want));
        assert!(l["advantage"].is_f64() && l["prompt"].is_string() && l["line"].is_u64());
    }

    // Stopped at step 10 and resumed: the same answers are drawn (seeded by the step) and the run
    // ends where the unbroken one did.
    let o = s.ember(&["train", "--config", "grpo.toml", "--run-dir", "paused", "--max-steps", "10"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["train", "--config", "grpo.toml", "--run-dir", "paused", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let weights = |run: &str| {
        let bytes = std::fs::read(s.path().join(run).join("checkpoints/step-000030/model.safetensors")).unwrap();
        let tensors = ember_model::weights::from_safetensors(&bytes, "model").unwrap().0;
        tensors.into_iter().map(|(k, t)| (k, t.as_bytes().to_vec())).collect::<std::collections::BTreeMap<_, _>>()
    };
    let (paused, unbroken) = (weights("paused"), weights("grpo"));
    assert!(paused.len() == 21 && paused == unbroken, "resumed vs unbroken weights");
}

#[test]
fn lora_with_kl_several_passes_and_a_command_reward() {
    let s = imported();
    prompts_file(&s);
    // The reward program: 1 when the answer holds the row's `answer` digit or an "e", else 0.
    s.write(
        "reward.sh",
        "while read -r l; do case \"$l\" in *'\"completion\":\"'*e*) echo 1;; *) echo 0;; esac; done\n",
    );
    let extra = r#"loss = "grpo"
beta = 0.04
num_iterations = 2
epsilon_high = 0.28
scale_rewards = "batch"
mask_truncated = true
stop = ["."]
temperature = 0.9

[[rl.rewards]]
kind = "command"
command = "sh reward.sh"
name = "has_e"
weight = 0.5

[lora]
rank = 4
alpha = 8.0
targets = ["q_proj", "v_proj", "up_proj"]
"#;
    s.write("grpo.toml", &config(6, extra));
    let o = s.ember(&["train", "--config", "grpo.toml", "--run-dir", "lora"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let records = read_metrics(&s.path().join("lora/metrics.jsonl")).unwrap();
    assert_eq!(records.len(), 6);
    for r in &records {
        for key in ["kl", "rewards/has_e/mean", "rewards/regex/mean"] {
            assert!(r.named.contains_key(key), "step {}: {key} missing", r.step);
        }
        let p = &r.named;
        let sum = p["rewards/regex/mean"] + 0.5 * p["rewards/has_e/mean"];
        assert!((p["reward"] - sum).abs() < 1e-9, "reward {} vs the weighted sum {sum}", p["reward"]);
    }
    // Steps 1 and 2 share a generation (μ = 2): the same answers, so the same rewards.
    assert_eq!(records[0].named["reward"], records[1].named["reward"]);
    // An answer ends at its first stop text.
    let rollouts = std::fs::read_to_string(s.path().join("lora/rollouts.jsonl")).unwrap();
    for l in rollouts.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()) {
        let c = l["completion"].as_str().unwrap();
        if let Some(at) = c.find('.') {
            assert!(c.len() - at <= 8, "the answer goes on after its stop text: {c:?}");
        }
    }
}

#[test]
fn bad_inputs_are_refused_by_name() {
    let s = imported();
    prompts_file(&s);
    let run = |name: &str, text: &str| {
        s.write(&format!("{name}.toml"), text);
        s.ember(&["train", "--config", &format!("{name}.toml"), "--run-dir", name])
    };
    // One answer per prompt: nothing to compare.
    let o = run("g1", &config(2, "").replace("group_size = 8", "group_size = 1"));
    assert_clean_error(&o, "rl.group_size must be at least 2 (the advantage compares a prompt's answers), found 1");
    // A key of another kind of reward.
    let o = run("key", &config(2, "").replace("pattern = \"[,.]\"", "pattern = \"[,.]\"\nlimit = 3"));
    assert_clean_error(&o, "rewards[0] (kind = \"regex\"): `limit` has no effect on this kind (it takes pattern)");
    // A reward reads a column the rows lack.
    let o = run("column", &config(2, "\n[[rl.rewards]]\nkind = \"exact\"\ncolumn = \"solution\"\n"));
    assert_clean_error(&o, "prompts.jsonl:1: the row has no column `solution`, which reward exact reads");
    // A reward program that fails, and one that prints text.
    let o = run("exit", &config(2, "\n[[rl.rewards]]\nkind = \"command\"\ncommand = \"echo broken >&2; exit 4\"\n"));
    assert_clean_error(&o, "reward command (`echo broken >&2; exit 4`): exited with exit status: 4: broken");
    let o = run(
        "text",
        &config(2, "\n[[rl.rewards]]\nkind = \"command\"\ncommand = \"while read -r l; do echo good; done\"\n"),
    );
    assert_clean_error(&o, "line 1 of its output, for the answer to");
    assert_clean_error(&o, "is \"good\": not a finite number");
    // A prompt that leaves no room for the answer in the model's 64 positions.
    let long = format!("{}\n", serde_json::json!({"prompt": "First Citizen: speak, speak. ".repeat(12)}));
    s.write("long.jsonl", &format!("{long}{long}"));
    let o = run("long", &config(2, "").replace("prompts.jsonl", "long.jsonl"));
    assert_clean_error(&o, "long.jsonl:1: the prompt takes");
    assert_clean_error(&o, "with rl.max_new_tokens = 6 that is more than the model's context of 64 positions");
    // A validation file of its own (`data.val_path`): its rows are named by that file's lines.
    s.write("held.jsonl", "{\"prompt\": \"All:\", \"solution\": \"x\"}\n{\"prompt\": \"All:\"}\n");
    let own = config(2, "\n[[rl.rewards]]\nkind = \"exact\"\ncolumn = \"solution\"\n");
    let own = own.replace("val_fraction = 0.2", "val_path = \"held.jsonl\"");
    let o = run("held", &own);
    assert_clean_error(&o, "prompts.jsonl:1: the row has no column `solution`");
    let with = (0..8).map(|_| "{\"prompt\": \"All:\", \"solution\": \"x\"}\n").collect::<String>();
    s.write("with.jsonl", &with);
    let o = run("held2", &own.replace("\"prompts.jsonl\"", "\"with.jsonl\""));
    assert_clean_error(&o, "held.jsonl:2: the row has no column `solution`, which reward exact reads");
    // Prompts must be JSONL with a prompt.
    s.write("noprompt.jsonl", "{\"question\": \"x\"}\n{\"question\": \"y\"}\n");
    let o = run("noprompt", &config(2, "").replace("prompts.jsonl", "noprompt.jsonl"));
    assert_clean_error(&o, "noprompt.jsonl:1: prompt is missing");
    // Two objectives.
    let o = run("both", &format!("{}\n[preference]\nmethod = \"dpo\"\n", config(2, "")));
    assert_clean_error(&o, "[rl] and [preference] are two objectives: keep one");
    for name in ["g1", "key", "column", "exit", "text", "long", "held", "held2", "noprompt", "both"] {
        assert!(!s.path().join(name).join("checkpoints").exists(), "{name} left a checkpoint");
    }
}

/// `rl.json_schema` on the tiny GPT-2 (a byte-level vocabulary, which spells any JSON): every
/// logged answer of every step is JSON of the schema, scored by the regex on that JSON; a schema
/// file that cannot constrain answers stops the run before its first step, named by the key and
/// the file.
#[test]
fn answers_follow_the_json_schema() {
    let s = Scratch::new();
    let gpt2 = fixtures().join("hf/gpt2");
    let o = s.ember(&["import", gpt2.to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    prompts_file(&s);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"verdict": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["verdict", "n"],
        "additionalProperties": false,
    });
    s.write("schema.json", &schema.to_string());
    // `{"verdict": "yes", "n": 3}` is 26 bytes: room for it beside the prompt in 64 positions.
    let with = |schema: &str| {
        config(3, &format!("json_schema = \"{schema}\"\n"))
            .replace("max_new_tokens = 6", "max_new_tokens = 32")
            .replace("log_rollouts = 5", "log_rollouts = 1")
            .replace("pattern = \"[,.]\"", "pattern = \"yes\"")
    };
    s.write("grpo.toml", &with("schema.json"));
    let o = s.ember(&["train", "--config", "grpo.toml", "--run-dir", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rollouts = std::fs::read_to_string(s.path().join("json/rollouts.jsonl")).unwrap();
    let lines: Vec<Value> = rollouts.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3 * 16);
    for l in &lines {
        let completion = l["completion"].as_str().unwrap();
        let answer: Value = serde_json::from_str(completion).unwrap_or_else(|e| panic!("{completion:?}: {e}"));
        let answer = answer.as_object().unwrap_or_else(|| panic!("{completion} is not an object"));
        assert_eq!(answer.len(), 2, "{completion}");
        assert!(["yes", "no"].contains(&answer["verdict"].as_str().unwrap_or("")), "{completion}");
        assert!(answer["n"].as_u64().is_some_and(|n| n <= 9), "{completion}");
        let want = if answer["verdict"] == "yes" { 1.0 } else { 0.0 };
        assert_eq!(l["reward"].as_f64(), Some(want), "{l}");
    }
    // No answer was cut by max_new_tokens: each ended where its JSON did.
    let records = read_metrics(&s.path().join("json/metrics.jsonl")).unwrap();
    assert!(records.iter().all(|r| r.named["completions/clipped_ratio"] == 0.0), "an answer ran past 32 tokens");

    // Files that cannot constrain answers: missing, not JSON, a schema llguidance refuses, and a
    // vocabulary without `{` (the tiny Llama's).
    s.write("broken.json", "{\"type\": ");
    s.write("blob.json", r#"{"type": "object", "properties": {"a": {"type": "blob"}}}"#);
    for (name, file, want) in [
        ("missing", "missing.json", "missing.json\": cannot read it: "),
        ("broken", "broken.json", "broken.json\": not JSON: "),
        ("blob", "blob.json", "blob.json\": invalid JSON schema: "),
    ] {
        s.write(&format!("{name}.toml"), &with(file));
        let o = s.ember(&["train", "--config", &format!("{name}.toml"), "--run-dir", name]);
        assert_clean_error(&o, "[rl] json_schema = \"");
        assert_clean_error(&o, want);
        assert!(!s.path().join(name).join("checkpoints").exists(), "{name} left a checkpoint");
    }
    let llama = imported();
    prompts_file(&llama);
    llama.write("schema.json", &schema.to_string());
    llama.write("grpo.toml", &with("schema.json").replace("max_new_tokens = 32", "max_new_tokens = 6"));
    let o = llama.ember(&["train", "--config", "grpo.toml", "--run-dir", "llama"]);
    assert_clean_error(&o, "schema.json\": no token of the tokenizer can start an answer of this schema");
}
