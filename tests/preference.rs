//! Preference tuning: DPO, IPO, SimPO and ORPO against TRL 1.16's numbers on the tiny Llama
//! (tests/fixtures/preference, made by its make_fixture.py), and DPO through `ember train`.

mod common;
mod trl_parity;

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use common::*;
use ember_data::finetune::{ChatTemplate, Message};
use ember_data::preference::{answer_masks, encode_pairs, PreferenceRecord, Turns};
use ember_model::weights::{map_paths, PathMapper};
use ember_train::config::{PreferenceConfig, PreferenceMethod};
use ember_train::metrics::read_metrics;
use ember_train::preference::{answer_logps, pair_loss, reference_logps, scalar, StepTotals};
use serde_json::Value;
use trl_parity::{assert_gradients, close, AD};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every parameter times `factor` (the fixture's reference model is the policy times 1.1).
struct Scale(f64);
impl PathMapper<Flex> for Scale {
    fn map<const D: usize>(&mut self, _: &str, p: Param<Tensor<Flex, D>>) -> Param<Tensor<Flex, D>> {
        Param::from_tensor(p.val().mul_scalar(self.0))
    }
}

/// A scratch folder with the tiny Llama imported as `base`.
fn imported() -> Scratch {
    let s = Scratch::new();
    let llama = fixtures().join("hf/llama");
    let o = s.ember(&["import", llama.to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    s
}

/// The tiny Llama imported as `base` in a scratch folder, TRL's numbers, the fixture's tokenizer.
fn setup() -> (Scratch, Value, ember_data::Tokenizer) {
    let s = imported();
    let llama = fixtures().join("hf/llama");
    let expected = serde_json::from_str(&std::fs::read_to_string(fixtures().join("preference/expected.json")).unwrap());
    let tokenizer = ember_data::Tokenizer::from_file(&llama.join("tokenizer.json")).unwrap();
    (s, expected.unwrap(), tokenizer)
}

/// The fixture's `pairs`, each part read by `turns`.
fn records(pairs: &Value, turns: impl Fn(&Value) -> Turns) -> Vec<PreferenceRecord> {
    let pairs = pairs.as_array().unwrap().iter();
    pairs
        .map(|p| PreferenceRecord {
            prompt: turns(&p["prompt"]),
            chosen: turns(&p["chosen"]),
            rejected: turns(&p["rejected"]),
            line: 0,
        })
        .collect()
}

fn text(v: &Value) -> Turns {
    Turns::Text(v.as_str().unwrap().to_string())
}

/// Ember's tokenization of the pairs is TRL's (`tokens` of the fixture).
fn assert_tokens(pairs: &[ember_data::preference::Pair], tokens: &Value) {
    assert_eq!(pairs.len(), tokens.as_array().unwrap().len());
    for (pair, want) in pairs.iter().zip(tokens.as_array().unwrap()) {
        let ids = |k: &str| want[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let trl = (&ids("prompt_ids"), &ids("chosen_ids"), &ids("rejected_ids"));
        assert_eq!((&pair.prompt, &pair.chosen, &pair.rejected), trl);
    }
}

#[test]
fn losses_metrics_and_gradients_equal_trls() {
    let (s, expected, tokenizer) = setup();
    // TRL's tokenization: the prompt, then each answer with the end-of-sequence token.
    let pairs = encode_pairs(&records(&expected["pairs"], text), &tokenizer, None).unwrap();
    assert_tokens(&pairs, &expected["tokens"]);
    // Conversational pairs through a chat template.
    let chat = &expected["chat"];
    let template = ChatTemplate::new(chat["template"].as_str().unwrap().into(), "<s>".into(), "</s>".into()).unwrap();
    let messages = |v: &Value| Turns::Chat(serde_json::from_value::<Vec<Message>>(v.clone()).unwrap());
    let chat_pairs = encode_pairs(&records(&chat["pairs"], messages), &tokenizer, Some(&template)).unwrap();
    assert_tokens(&chat_pairs, &chat["tokens"]);
    let rows: Vec<_> = pairs.iter().map(|p| p.row(48, 2).unwrap()).collect();

    let device = Default::default();
    let checkpoint = ember_train::Checkpoint::open(&s.path().join("base")).unwrap();
    let reference = map_paths(checkpoint.decoder::<Flex>(&device).unwrap(), &mut Scale(1.1));
    let reference = reference_logps(&reference, &rows, 3, &device);
    let chosen_tokens: f64 = rows.iter().map(|w| answer_masks(w).0.iter().sum::<f32>() as f64).sum();
    let totals = StepTotals { pairs: rows.len() as f64, chosen_tokens };
    let beta = expected["beta"].as_f64().unwrap();
    let simpo_gamma = expected["simpo_gamma"].as_f64().unwrap();
    for (name, method, sft_weight) in [
        ("dpo", PreferenceMethod::Dpo, 0.0),
        ("ipo", PreferenceMethod::Ipo, 0.0),
        ("simpo", PreferenceMethod::Simpo, 0.0),
        ("orpo", PreferenceMethod::Orpo, 0.0),
        // RPO: TRL's loss_type ["sigmoid", "sft"], loss_weights [1, 0.5].
        ("dpo_sft", PreferenceMethod::Dpo, 0.5),
    ] {
        let want = &expected["methods"][name];
        let config = PreferenceConfig { method, beta, label_smoothing: 0.0, simpo_gamma, sft_weight };
        let policy = checkpoint.decoder::<AD>(&device).unwrap();
        let logps = answer_logps(&policy, &rows, &device);
        let out = pair_loss(&config, logps, method.needs_reference().then_some(&reference[..]), totals);
        let loss = scalar(out.loss.clone().inner());
        let trl = want["loss"].as_f64().unwrap();
        assert!(close(loss, trl, 1e-5, 1e-3), "{name}: loss {loss} vs TRL's {trl}");
        let metrics = out.sums.metrics().unwrap();
        for (key, got) in metrics.named("") {
            let trl = want["metrics"][&key].as_f64().unwrap();
            assert!(close(got, trl, 1e-5, 1e-2), "{name}: {key} {got} vs TRL's {trl}");
        }

        // Every parameter's gradient, in Hugging Face's layout: its sum of squares and 16 elements.
        assert_gradients(policy, out.loss, &want["gradients"], 2e-5, 1e-5, name);
    }
}

/// 32 pairs over the fixture's vocabulary: the chosen answer always ends "speak." and the rejected
/// one never does.
fn pairs_file(s: &Scratch) {
    let prompts = ["First Citizen:", "All:", "Caius Marcius:", "Before we proceed:"];
    let chosen = [" You speak.", " All speak.", " We speak.", " Speak, speak."];
    let rejected = [" You are all resolved.", " Resolved.", " We know Caius.", " First, you know."];
    let mut text = String::new();
    for i in 0..32 {
        let line = serde_json::json!({"prompt": prompts[i % 4], "chosen": chosen[(i / 4) % 4], "rejected": rejected[(i + i / 4) % 4]});
        text.push_str(&format!("{line}\n"));
    }
    s.write("pairs.jsonl", &text);
}

fn config(extra: &str) -> String {
    format!(
        r#"
init_from = "run:base"

[data]
path = "pairs.jsonl"
val_fraction = 0.25

[train]
batch_size = 4
seq_len = 64
max_steps = 24
eval_interval = 8
log_interval = 1
checkpoint_interval = 8
seed = 5

[optim]
weight_decay = 0.0

[schedule]
lr = 1e-2
warmup_steps = 2

[preference]
method = "dpo"
beta = 0.5
{extra}"#
    )
}

#[test]
fn dpo_through_ember_train_learns_the_preference_and_resumes_exactly() {
    let s = imported();
    pairs_file(&s);
    let lora =
        "\n[lora]\nrank = 4\nalpha = 8.0\ntargets = [\"q_proj\", \"v_proj\", \"o_proj\", \"up_proj\", \"down_proj\"]\n";
    s.write("dpo.toml", &config(lora));
    let o = s.ember(&["train", "--config", "dpo.toml", "--run-dir", "dpo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("reference log-probabilities of 24 + 8 pairs"), "{}", stderr(&o));
    let lines = std::fs::read_to_string(s.path().join("dpo/metrics.jsonl")).unwrap();
    let first: Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    // At the start the policy is the reference: every pair's DPO loss is ln 2.
    let start = first["val_loss"].as_f64().unwrap();
    assert!((start - std::f64::consts::LN_2).abs() < 1e-5, "step 0 val loss {start}");
    let records = read_metrics(&s.path().join("dpo/metrics.jsonl")).unwrap();
    assert_eq!(records.len(), 24);
    for r in &records {
        for key in [
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
        ] {
            assert!(r.named.contains_key(key), "step {}: {key} missing: {:?}", r.step, r.named);
        }
        let p = &r.named;
        assert!((p["rewards/margins"] - (p["rewards/chosen"] - p["rewards/rejected"])).abs() < 1e-9);
    }
    let evals: Vec<_> = records.iter().filter(|r| r.val_loss.is_some()).collect();
    assert_eq!(evals.iter().map(|r| r.step).collect::<Vec<_>>(), [8, 16, 24]);
    let last = evals.last().unwrap();
    let accuracy = last.named["val_rewards/accuracies"];
    assert!(accuracy >= 0.99, "held-out reward accuracy {accuracy}: {:?}", last.named);
    assert!(last.val_loss.unwrap() < 0.3, "val loss {:?}", last.val_loss);
    // TensorBoard has TRL's names too.
    let events = std::fs::read_dir(s.path().join("dpo"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .unwrap();
    let bytes = std::fs::read(events).unwrap();
    for tag in ["rewards/accuracies", "val_rewards/margins", "logps/rejected"] {
        assert!(bytes.windows(tag.len()).any(|w| w == tag.as_bytes()), "{tag} not in the event file");
    }

    // Stopped at step 8 and resumed: the reference is computed again from the same base, and the
    // run ends with the same adapters.
    let o = s.ember(&["train", "--config", "dpo.toml", "--run-dir", "paused", "--max-steps", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A resume that would train differently is refused first, by what differs: β, the loss, the
    // pairs.
    let refused = |config: &str, needle: &str| {
        let o = s.ember(&["train", "--config", config, "--run-dir", "paused", "--resume"]);
        assert_clean_error(&o, needle);
        assert!(!stderr(&o).contains("damaged"), "{}", stderr(&o));
    };
    s.write("beta.toml", &config(lora).replace("beta = 0.5", "beta = 0.1"));
    refused(
        "beta.toml",
        "the config's [preference] differs from the checkpoint's: beta is 0.5 in the checkpoint, 0.1 now",
    );
    s.write("ipo.toml", &config(lora).replace("method = \"dpo\"", "method = \"ipo\""));
    refused("ipo.toml", "method is \"dpo\" in the checkpoint, \"ipo\" now");
    let pairs = std::fs::read_to_string(s.path().join("pairs.jsonl")).unwrap();
    s.write("pairs.jsonl", &pairs.replacen("You speak.", "You speak!", 1));
    refused(
        "dpo.toml",
        "pairs.jsonl changed since this checkpoint was written: 32 rows then and now, but their content",
    );
    s.write("pairs.jsonl", &pairs);
    let o = s.ember(&["train", "--config", "dpo.toml", "--run-dir", "paused", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let adapters = |run: &str| {
        let bytes = std::fs::read(s.path().join(run).join("checkpoints/step-000024/adapter.safetensors")).unwrap();
        let tensors = ember_model::weights::from_safetensors(&bytes, "adapters").unwrap().0;
        tensors.into_iter().map(|(k, t)| (k, t.as_bytes().to_vec())).collect::<std::collections::BTreeMap<_, _>>()
    };
    let (paused, unbroken) = (adapters("paused"), adapters("dpo"));
    assert!(paused.len() == 20 && paused == unbroken, "resumed vs unbroken adapters");
}

/// Issue 57: a pair too long for `train.seq_len` is named by its line in the file (blank lines
/// counted), not by its index; pairs whose chosen answer is the rejected one are a warning naming
/// their lines, and a file of nothing else is refused.
#[test]
fn pairs_are_named_by_their_file_lines() {
    let s = imported();
    let pair = |c: &str, r: &str| {
        serde_json::json!({"prompt": "First Citizen:", "chosen": c, "rejected": r}).to_string() + "\n"
    };
    // Lines 1 and 3 hold pairs, the second without a preference; the third pair, on line 6, is
    // too long for `seq_len = 64`.
    let long = " You speak.".repeat(40);
    let lines = [pair(" You speak.", " Resolved."), "\n".into(), pair(" All speak.", " All speak."), "\n \n".into()];
    s.write(
        "pairs.jsonl",
        &[&lines[..], &[pair(&long, " Resolved."), pair(" We speak.", " We know.")]].concat().concat(),
    );
    s.write("dpo.toml", &config(""));
    let o = s.ember(&["train", "--config", "dpo.toml", "--run-dir", "run"]);
    assert_clean_error(&o, "pairs.jsonl:6: the pair takes");
    assert!(stderr(&o).contains("1 of 4 pairs have the same chosen and rejected answer (line 3)"), "{}", stderr(&o));
    s.write("pairs.jsonl", &pair(" You speak.", " You speak.").repeat(3));
    let o = s.ember(&["train", "--config", "dpo.toml", "--run-dir", "run"]);
    assert_clean_error(
        &o,
        "pairs.jsonl:1: every pair's chosen answer is the same as its rejected one (3 of 3; lines 1, 2, 3): the \
         pairs carry no preference to learn",
    );
}

#[test]
fn full_fine_tuning_accumulates_pairs_as_one_batch() {
    let s = imported();
    pairs_file(&s);
    let mut runs = Vec::new();
    for (method, batch, accum) in
        [("ipo", 4, 1), ("ipo", 2, 2), ("orpo", 4, 1), ("orpo", 1, 4), ("simpo", 4, 1), ("simpo", 2, 2)]
    {
        let text = config("")
            .replace("method = \"dpo\"", &format!("method = \"{method}\""))
            .replace("batch_size = 4", &format!("batch_size = {batch}\ngrad_accum_steps = {accum}"))
            .replace("max_steps = 24", "max_steps = 3")
            .replace("lr = 1e-2", "lr = 1e-4");
        let run = format!("{method}-{batch}x{accum}");
        s.write("c.toml", &text);
        let o = s.ember(&["train", "--config", "c.toml", "--run-dir", &run]);
        assert!(o.status.success(), "{}", stderr(&o));
        let records = read_metrics(&s.path().join(&run).join("metrics.jsonl")).unwrap();
        runs.push(records.iter().map(|r| (r.train_loss, r.grad_norm, r.named["rewards/chosen"])).collect::<Vec<_>>());
    }
    for pair in runs.chunks(2) {
        assert_eq!(pair[0].len(), 3);
        for (a, b) in pair[0].iter().zip(&pair[1]) {
            assert!(
                close(a.0, b.0, 1e-5, 1e-3) && close(a.1, b.1, 1e-5, 1e-3) && close(a.2, b.2, 1e-5, 0.1),
                "{pair:?}"
            );
        }
    }
}

/// Sets the adapters to the fixture's (peft's `[r, in]` and `[out, r]`, transposed to ember's
/// `[in, r]` and `[r, out]`) and, once there are gradients, collects theirs.
struct Adapters<'a> {
    fixture: &'a serde_json::Map<String, Value>,
    grads: Option<&'a <AD as AutodiffBackend>::Gradients>,
    out: std::collections::BTreeMap<String, Vec<f32>>,
}

/// A fixture matrix (rows of numbers), transposed, flat.
fn transposed(v: &Value) -> (Vec<f32>, [usize; 2]) {
    let rows: Vec<Vec<f32>> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    let (n, m) = (rows.len(), rows[0].len());
    ((0..m).flat_map(|j| rows.iter().map(move |r| r[j])).collect(), [m, n])
}

impl PathMapper<AD> for Adapters<'_> {
    fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<AD, D>>) -> Param<Tensor<AD, D>> {
        let Some((layer, which)) = path.split_once(".lora.") else { return p };
        let which = if which == "lora_a" { "A" } else { "B" };
        let entry = &self.fixture[&format!("model.{layer}")];
        if let Some(grads) = self.grads {
            let g = p.val().grad(grads).unwrap_or_else(|| panic!("{path} has no gradient"));
            self.out.insert(path.to_string(), g.into_data().to_vec().unwrap());
            return p;
        }
        let (values, shape) = transposed(&entry[which]);
        assert_eq!(&shape[..], &p.val().dims()[..], "{path}");
        let data = burn::tensor::TensorData::new(values, shape);
        Param::from_tensor(Tensor::<AD, D>::from_data(data, &Default::default()).require_grad())
    }
}

#[test]
fn a_lora_dpo_step_equals_trls_with_the_base_as_reference() {
    let (s, expected, tokenizer) = setup();
    let want = &expected["lora"];
    let pairs = encode_pairs(&records(&expected["pairs"], text), &tokenizer, None).unwrap();
    let rows: Vec<_> = pairs.iter().map(|p| p.row(48, 2).unwrap()).collect();

    let device = Default::default();
    let checkpoint = ember_train::Checkpoint::open(&s.path().join("base")).unwrap();
    // The reference: the base, no adapters.
    let reference = reference_logps(&checkpoint.decoder::<Flex>(&device).unwrap(), &rows, 4, &device);
    let lora: ember_model::LoraConfig =
        serde_json::from_value(serde_json::json!({"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]})).unwrap();
    let fixture = want["adapters"].as_object().unwrap();
    let mut set = Adapters { fixture, grads: None, out: Default::default() };
    let policy = map_paths(checkpoint.decoder::<AD>(&device).unwrap().with_lora(&lora, 0), &mut set);
    let chosen_tokens: f64 = rows.iter().map(|w| answer_masks(w).0.iter().sum::<f32>() as f64).sum();
    let config = PreferenceConfig {
        method: PreferenceMethod::Dpo,
        beta: expected["beta"].as_f64().unwrap(),
        label_smoothing: 0.0,
        simpo_gamma: 0.5,
        sft_weight: 0.0,
    };
    let logps = answer_logps(&policy, &rows, &device);
    let out = pair_loss(&config, logps, Some(&reference), StepTotals { pairs: rows.len() as f64, chosen_tokens });
    let (loss, trl) = (scalar(out.loss.clone().inner()), want["loss"].as_f64().unwrap());
    assert!(close(loss, trl, 1e-5, 1e-3), "loss {loss} vs TRL's {trl}");
    for (key, got) in out.sums.metrics().unwrap().named("") {
        let trl = want["metrics"][&key].as_f64().unwrap();
        assert!(close(got, trl, 1e-5, 1e-2), "{key} {got} vs TRL's {trl}");
    }
    let grads = out.loss.backward();
    let mut collect = Adapters { fixture, grads: Some(&grads), out: Default::default() };
    let _ = map_paths(policy, &mut collect);
    assert_eq!(collect.out.len(), 8, "{:?}", collect.out.keys());
    for (path, got) in &collect.out {
        let (layer, which) = path.split_once(".lora.").unwrap();
        let (trl, _) =
            transposed(&fixture[&format!("model.{layer}")][if which == "lora_a" { "grad_A" } else { "grad_B" }]);
        let scale = (trl.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / trl.len() as f64).sqrt();
        for (g, t) in got.iter().zip(&trl) {
            assert!(((g - t) as f64).abs() <= 1e-5 * (*t as f64).abs().max(scale), "{path}: {g} vs TRL's {t}");
        }
    }
}

/// The chain TRL documents, SFT → DPO → SFT, each run started from the last through
/// `init_from = "run:DIR"` (LoRA runs all): each starts where the one before ended. A DPO run from
/// the SFT run scores its held-out pairs at step 0 as one from the SFT run's merged export does
/// (and not as one from the base), and an SFT run from the DPO run starts at the DPO run's last
/// loss on its validation file (`data.val_path`), as `ember eval` scores that file.
#[test]
fn sft_then_dpo_then_sft_each_starts_where_the_last_ended() {
    let s = imported();
    pairs_file(&s);
    let lora = "\n[lora]\nrank = 4\nalpha = 8.0\n";
    let rows = |answer: &str| -> String {
        let text = std::fs::read_to_string(s.path().join("pairs.jsonl")).unwrap();
        let pairs = text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap());
        let rows =
            pairs.map(|p| serde_json::json!({"prompt": p["prompt"], "completion": p[answer]}).to_string() + "\n");
        rows.collect()
    };
    s.write("sft.jsonl", &rows("chosen"));
    s.write("held.jsonl", &rows("rejected").lines().take(6).map(|l| format!("{l}\n")).collect::<String>());
    let sft = |init: &str, extra_data: &str| {
        format!(
            "init_from = \"{init}\"\n[data]\npath = \"sft.jsonl\"\n{extra_data}\n[train]\nbatch_size = 4\nseq_len = 32\n\
             max_steps = 12\neval_interval = 12\nlog_interval = 4\nseed = 5\n[optim]\nweight_decay = 0.0\n\
             [schedule]\nlr = 1e-2\nwarmup_steps = 2\n{lora}"
        )
    };
    let train = |name: &str, text: String| {
        s.write(&format!("{name}.toml"), &text);
        let o = s.ember(&["train", "--config", &format!("{name}.toml"), "--run-dir", name]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        read_metrics(&s.path().join(name).join("metrics.jsonl")).unwrap()
    };
    train("sft", sft("run:base", ""));
    // The SFT run's adapters folded into its weights, as a Hugging Face folder.
    let o = s.ember(&["export", "sft", "--out", "sft-merged", "--merge"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let dpo = |init: &str, steps: usize| {
        config(lora)
            .replace("init_from = \"run:base\"", &format!("init_from = \"{init}\""))
            .replace("max_steps = 24", &format!("max_steps = {steps}"))
            .replace("eval_interval = 8", &format!("eval_interval = {steps}"))
    };
    let initial = |name: &str| -> Value {
        let text = std::fs::read_to_string(s.path().join(name).join("metrics.jsonl")).unwrap();
        let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["step"].as_u64(), Some(0), "{name}: {first}");
        first
    };
    train("dpo", dpo("run:sft", 8));
    // Step 0 is all these two show (warm-up 2 steps: 2 steps each).
    train("dpo-merged", dpo("hf:sft-merged", 2));
    train("dpo-base", dpo("run:base", 2));
    let (from_run, from_merged, from_base) = (initial("dpo"), initial("dpo-merged"), initial("dpo-base"));
    for key in ["val_logps/chosen", "val_logps/rejected"] {
        let (a, b, c) =
            (from_run[key].as_f64().unwrap(), from_merged[key].as_f64().unwrap(), from_base[key].as_f64().unwrap());
        assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "{key}: from the SFT run {a}, from its merged export {b}");
        assert!((a - c).abs() > 1e-2, "{key}: the SFT run ({a}) must differ from the base ({c})");
    }

    // SFT from the DPO run: its step-0 loss on held.jsonl is the DPO run's, scored by `ember eval`.
    let records = train("sft2", sft("run:dpo", "val_path = \"held.jsonl\""));
    let first = initial("sft2")["val_loss"].as_f64().unwrap();
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "dpo", "--data", "held.jsonl", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let nll = r["nll"].as_f64().unwrap();
    assert!((first - nll).abs() < 1e-4, "step 0 of the SFT run from the DPO run {first}, the DPO run's own {nll}");
    assert!(records.iter().filter_map(|r| r.val_loss).all(|v| v.is_finite()));
}
