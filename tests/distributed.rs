//! Data-parallel training over MPI, end to end: `mpirun -n 2 ember train` on configs/nano.toml
//! (30 steps) against one process, ZeRO-1 against plain data parallelism, resuming at another world
//! size, and ranks that die, hang or disagree. Needs Open MPI (`mpirun`, or `$EMBER_MPIRUN`) and the
//! binary built with `--features mpi`; `.ci/run` installs and builds both.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{stderr, Scratch};

/// One MPI job at a time: two ranks already fill the two cores, and the failure tests time exits.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn datasets() -> PathBuf {
    let assets = std::env::var_os("EMBER_TEST_ASSETS")
        .expect("EMBER_TEST_ASSETS must name the shared test assets (datasets/tinyshakespeare); .ci/run sets it");
    PathBuf::from(assets).join("datasets")
}

fn ember_bin() -> PathBuf {
    std::env::var_os("EMBER_BIN")
        .filter(|b| !b.is_empty())
        .map_or(PathBuf::from(env!("CARGO_BIN_EXE_ember")), PathBuf::from)
}

/// configs/nano.toml cut to `steps` steps (logging every step, evaluating and checkpointing every
/// 15), with `grad_accum_steps = accum` and `extra` appended.
fn nano(s: &Scratch, name: &str, steps: usize, accum: usize, extra: &str) -> PathBuf {
    let base = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/nano.toml")).unwrap();
    let mut text = String::new();
    for line in base.lines() {
        let key = line.split('=').next().unwrap_or("").trim();
        let line = match key {
            "max_steps" | "decay_steps" => format!("{key} = {steps}"),
            "grad_accum_steps" => format!("grad_accum_steps = {accum}"),
            "log_interval" => "log_interval = 1".into(),
            "eval_interval" | "checkpoint_interval" => format!("{key} = 15"),
            "eval_iters" => "eval_iters = 4".into(),
            "warmup_steps" => "warmup_steps = 5".into(),
            _ => line.to_string(),
        };
        text.push_str(&line);
        text.push('\n');
    }
    text.push_str(extra);
    s.write(name, &text)
}

/// `ember args` as `ranks` MPI ranks (one plain process when `ranks` is 0), one CPU thread each.
fn command(s: &Scratch, ranks: usize, args: &[&str]) -> Command {
    let mut cmd = if ranks == 0 {
        Command::new(ember_bin())
    } else {
        let mpirun = std::env::var_os("EMBER_MPIRUN").unwrap_or("mpirun".into());
        let mut c = Command::new(mpirun);
        c.args(["--allow-run-as-root", "--oversubscribe", "-n", &ranks.to_string()]).arg(ember_bin());
        c
    };
    cmd.args(args);
    in_scratch(&mut cmd, s);
    cmd
}

/// The scratch folder as working directory, the shared datasets, one CPU thread per rank.
fn in_scratch(cmd: &mut Command, s: &Scratch) {
    cmd.current_dir(s.path())
        .env("EMBER_DATA_DIR", datasets())
        .env("EMBER_CACHE_DIR", s.path().join("cache"))
        .env("RAYON_NUM_THREADS", "1")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1");
}

fn train(s: &Scratch, ranks: usize, config: &Path, run: &str, more: &[&str]) -> Output {
    let mut args = vec!["train", "--no-progress", "--config", config.to_str().unwrap(), "--run-dir", run];
    args.extend_from_slice(more);
    let out = command(s, ranks, &args).output().expect("run mpirun / ember");
    assert!(out.status.success(), "{ranks} rank(s), {run}: {}", stderr(&out));
    out
}

/// (step, train loss) of a run's metrics.jsonl (whose step-0 evaluation has no train loss).
fn losses(s: &Scratch, run: &str) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(s.path().join(run).join("metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64().unwrap(), v["train_loss"].as_f64()?))
        })
        .collect()
}

/// Every tensor of a checkpoint file, as f32.
fn tensors(s: &Scratch, run: &str, step: usize, file: &str) -> BTreeMap<String, Vec<f32>> {
    let path = s.path().join(run).join(format!("checkpoints/step-{step:06}/{file}"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{k}");
            (k, t.data().chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
        })
        .collect()
}

/// The largest relative L2 difference over tensors.
fn max_rel(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(k, x)| {
            let y = &b[k];
            let diff: f64 = x.iter().zip(y).map(|(p, q)| (*p as f64 - *q as f64).powi(2)).sum();
            let norm: f64 = x.iter().map(|p| (*p as f64).powi(2)).sum();
            (diff / norm.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

fn assert_same_losses(a: &[(u64, f64)], b: &[(u64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: number of records");
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb, "{what}");
        let rel = (la - lb).abs() / la.abs();
        assert!(rel <= 1e-6, "{what}: step {sa}: loss {la} vs {lb} (rel {rel:e})");
    }
}

#[test]
fn two_ranks_train_as_one_process_accumulating_two_micro_batches() {
    let _g = serial();
    let s = Scratch::new();
    let one = nano(&s, "one.toml", 30, 2, "");
    let two = nano(&s, "two.toml", 30, 1, "");
    let zero = nano(&s, "zero.toml", 30, 1, "\n[distributed]\nshard_optimizer = true\n");
    train(&s, 0, &one, "single", &[]);
    let out = train(&s, 2, &two, "dp", &[]);
    assert!(stderr(&out).contains("data parallel over 2 ranks"), "{}", stderr(&out));
    train(&s, 2, &zero, "zero", &[]);

    let single = losses(&s, "single");
    assert_eq!(single.len(), 30);
    assert!(single[29].1 < single[0].1 - 0.5, "the run learns: {single:?}");
    assert_same_losses(&single, &losses(&s, "dp"), "2 ranks vs 1 process × 2 micro-batches");
    assert_same_losses(&single, &losses(&s, "zero"), "ZeRO-1 vs 1 process");
    let w = tensors(&s, "single", 30, "model.safetensors");
    for run in ["dp", "zero"] {
        let rel = max_rel(&w, &tensors(&s, run, 30, "model.safetensors"));
        assert!(rel <= 1e-6, "{run}: final weights differ by {rel:e}");
    }
    // Sharded moments are gathered into the unsharded checkpoint format.
    let m = tensors(&s, "dp", 30, "optimizer.safetensors");
    let mz = tensors(&s, "zero", 30, "optimizer.safetensors");
    assert_eq!(m.len(), 2 * w.len());
    assert!(max_rel(&m, &mz) <= 1e-5, "ZeRO-1 moments differ by {:e}", max_rel(&m, &mz));
    // The communication time is recorded.
    let last = std::fs::read_to_string(s.path().join("dp/metrics.jsonl")).unwrap();
    let v: serde_json::Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert!(v["comm_ms"].as_f64().is_some_and(|c| c > 0.0 && c < v["step_ms"].as_f64().unwrap()), "{v}");
}

/// Muon on 2 ranks (each orthogonalising its share of the matrices, the updates summed) trains as
/// one process accumulating two micro-batches; a run paused at step 10 and resumed (the momentum
/// buffers from the checkpoint) ends with the unbroken run's weights; so does ZeRO-1 with Muon (its
/// state gathered into the same checkpoint tensors).
#[test]
fn muon_on_two_ranks_trains_as_one_process_and_resumes_exactly() {
    let _g = serial();
    let s = Scratch::new();
    let muon = "\n[muon]\nlr = 0.02\n";
    let one = nano(&s, "one.toml", 20, 2, muon);
    let two = nano(&s, "two.toml", 20, 1, muon);
    train(&s, 0, &one, "single", &[]);
    train(&s, 2, &two, "dp", &[]);
    let single = losses(&s, "single");
    assert!(single[19].1 < single[0].1 - 0.5, "the run learns: {single:?}");
    assert_same_losses(&single, &losses(&s, "dp"), "Muon: 2 ranks vs 1 process × 2 micro-batches");
    let w = tensors(&s, "single", 20, "model.safetensors");
    let rel = max_rel(&w, &tensors(&s, "dp", 20, "model.safetensors"));
    assert!(rel <= 1e-6, "Muon on 2 ranks: final weights differ by {rel:e}");
    // The hidden matrices have Muon's buffer, the rest AdamW's two moments.
    let m = tensors(&s, "single", 20, "optimizer.safetensors");
    let buffers = m.keys().filter(|k| k.ends_with(".momentum_buffer")).count();
    assert_eq!(buffers, 4 * 7, "{:?}", m.keys().collect::<Vec<_>>());
    assert!(m.contains_key("embed_tokens.exp_avg") && !m.contains_key("layers.0.mlp.up_proj.weight.exp_avg"));

    train(&s, 0, &one, "paused", &["--max-steps", "10"]);
    train(&s, 0, &one, "paused", &["--resume"]);
    let rel = max_rel(&w, &tensors(&s, "paused", 20, "model.safetensors"));
    assert!(rel <= 1e-6, "Muon resumed at step 10: final weights differ by {rel:e}");

    // ZeRO-1 with Muon: each rank holds its own matrices' buffers and AdamW's share of the moments;
    // it trains as the others do, its checkpoint (gathered) has the same tensors as the unsharded
    // run's, and a replicated single process resumes from it.
    let zero = nano(&s, "zero.toml", 20, 1, &format!("{muon}\n[distributed]\nshard_optimizer = true\n"));
    train(&s, 2, &zero, "zero", &[]);
    assert_same_losses(&single, &losses(&s, "zero"), "ZeRO-1 + Muon: 2 ranks vs 1 process × 2 micro-batches");
    // ZeRO-1 sums the gradient norm in another order (about 1e-7 apart), which clipping passes on,
    // and the iteration magnifies in the matrices' small singular directions: without clipping the
    // weights are bitwise the same, with it about 1e-5 apart after 20 steps.
    let rel = max_rel(&w, &tensors(&s, "zero", 20, "model.safetensors"));
    assert!(rel <= 3e-5, "ZeRO-1 + Muon on 2 ranks: final weights differ by {rel:e}");
    let rel = max_rel(&m, &tensors(&s, "zero", 20, "optimizer.safetensors"));
    assert!(rel <= 1e-5, "ZeRO-1 + Muon's gathered state vs the replicated run's: {rel:e}");
    // Sharded to step 10, then one process; and the other way round.
    train(&s, 2, &zero, "zero-a", &["--max-steps", "10"]);
    train(&s, 0, &one, "zero-a", &["--resume"]);
    train(&s, 0, &one, "zero-b", &["--max-steps", "10"]);
    train(&s, 2, &zero, "zero-b", &["--resume"]);
    for run in ["zero-a", "zero-b"] {
        let rel = max_rel(&w, &tensors(&s, run, 20, "model.safetensors"));
        assert!(rel <= 3e-5, "{run}: resumed across ZeRO-1 + Muon at step 10, final weights differ by {rel:e}");
    }
}

/// A LoRA fine-tune of the tiny Qwen2 fixture on JSONL examples of uneven lengths (so micro-batches
/// score different numbers of tokens): 2 ranks, plain and ZeRO-1, and one process with micro-batches
/// twice as large, against one process accumulating two micro-batches, for the training losses, the
/// held-out losses (whose batches the ranks share out) and the adapters.
#[test]
fn a_lora_fine_tune_on_two_ranks_weights_tokens_globally() {
    let _g = serial();
    let s = Scratch::new();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen2");
    let o = command(&s, 0, &["import", fixture.to_str().unwrap(), "--out", "base"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let mut jsonl = String::new();
    for i in 0..40 {
        let prompt = "Speak ".repeat(1 + i % 3);
        let completion = " what light".repeat(1 + (i * 7) % 3);
        jsonl.push_str(&serde_json::json!({"prompt": prompt, "completion": completion}).to_string());
        jsonl.push('\n');
    }
    s.write("data.jsonl", &jsonl);
    let config = |name: &str, batch: usize, accum: usize, extra: &str| {
        s.write(
            name,
            &format!(
                "init_from = \"run:base\"\n[data]\npath = \"data.jsonl\"\npacking = \"none\"\nval_fraction = 0.2\n\
                 [train]\nbatch_size = {batch}\nseq_len = 64\ngrad_accum_steps = {accum}\nmax_steps = 12\neval_interval = 6\n\
                 eval_iters = 2\nlog_interval = 1\ncheckpoint_interval = 12\nseed = 5\n\
                 [optim]\nweight_decay = 0.0\ngrad_clip = 1.0\n[schedule]\nlr = 5e-3\nwarmup_steps = 2\n\
                 [lora]\nrank = 4\nalpha = 8.0\ntargets = [\"q_proj\", \"v_proj\", \"down_proj\"]\n{extra}"
            ),
        )
    };
    // Benchmark tasks at each evaluation: rank 0 scores them while the other waits.
    let tasks = format!(
        "[eval]\ntasks = [\"arc_easy:4\", \"piqa:3\"]\ndir = \"{}\"\n",
        common::assets().join("evals").display()
    );
    let one = config("one.toml", 2, 2, &tasks);
    let two = config("two.toml", 2, 1, &tasks);
    let zero = config("zero.toml", 2, 1, "[distributed]\nshard_optimizer = true\n");
    // One process, one micro-batch of 4: the examples are read in epochs, so a step's rows are the
    // same however they are split (2 ranks x 2, 1 x 2 x 2, 1 x 4).
    let wide = config("wide.toml", 4, 1, "");
    train(&s, 0, &one, "single", &[]);
    train(&s, 2, &two, "dp", &[]);
    train(&s, 2, &zero, "zero", &[]);
    train(&s, 0, &wide, "wide", &[]);
    let single = losses(&s, "single");
    assert_eq!(single.len(), 12);
    let val = |run: &str| -> Vec<f64> {
        let text = std::fs::read_to_string(s.path().join(run).join("metrics.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
            .collect()
    };
    assert_eq!(val("single").len(), 3, "step 0 and two evaluations");
    let tasks = |run: &str| -> Vec<(String, f64)> {
        let text = std::fs::read_to_string(s.path().join(run).join("metrics.jsonl")).unwrap();
        let records = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        let named = records.flat_map(|r| r.as_object().unwrap().clone().into_iter());
        named.filter(|(k, _)| k.starts_with("eval/")).map(|(k, v)| (k, v.as_f64().unwrap())).collect()
    };
    assert_eq!(tasks("single").len(), 2 * 5, "two evaluations of arc_easy and piqa (acc, acc_norm) and core");
    assert_eq!(tasks("single"), tasks("dp"), "the tasks' metrics on one process and on two ranks");
    for run in ["dp", "zero", "wide"] {
        assert_same_losses(&single, &losses(&s, run), run);
        for (a, b) in val("single").iter().zip(val(run)) {
            assert!((a - b).abs() <= 1e-6 * a, "{run}: held-out loss {a} vs {b}");
        }
        let w = tensors(&s, "single", 12, "adapter.safetensors");
        assert!(!w.is_empty() && w.keys().all(|k| k.contains(".lora.")), "adapters only: {:?}", w.keys());
        let rel = max_rel(&w, &tensors(&s, run, 12, "adapter.safetensors"));
        assert!(rel <= 1e-6, "{run}: adapters differ by {rel:e}");
    }
}

/// DPO with LoRA: the reference log-probabilities are computed in shares by the ranks and summed,
/// and a step's pairs split over ranks as over micro-batches.
#[test]
fn dpo_on_two_ranks_trains_as_one_process() {
    let _g = serial();
    let s = Scratch::new();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/llama");
    let o = command(&s, 0, &["import", fixture.to_str().unwrap(), "--out", "base"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let prompts = ["First Citizen:", "All:", "Caius Marcius:"];
    let answers = [" You speak.", " Resolved, resolved.", " We know Caius.", " Speak, speak."];
    let mut jsonl = String::new();
    for i in 0..30 {
        let pair = serde_json::json!({"prompt": prompts[i % 3], "chosen": answers[i % 4], "rejected": answers[(i / 4 + 1 + i) % 4]});
        jsonl.push_str(&format!("{pair}\n"));
    }
    s.write("pairs.jsonl", &jsonl);
    let config = |name: &str, batch: usize, accum: usize| {
        s.write(
            name,
            &format!(
                "init_from = \"run:base\"\n[data]\npath = \"pairs.jsonl\"\nval_fraction = 0.2\n\
                 [train]\nbatch_size = {batch}\nseq_len = 64\ngrad_accum_steps = {accum}\nmax_steps = 8\neval_interval = 4\n\
                 eval_iters = 2\nlog_interval = 1\ncheckpoint_interval = 8\nseed = 5\n\
                 [optim]\nweight_decay = 0.0\ngrad_clip = 1.0\n[schedule]\nlr = 5e-3\nwarmup_steps = 2\n\
                 [lora]\nrank = 4\nalpha = 8.0\ntargets = [\"q_proj\", \"v_proj\", \"down_proj\"]\n\
                 [preference]\nmethod = \"dpo\"\nbeta = 0.2\n"
            ),
        )
    };
    let one = config("one.toml", 2, 2);
    let two = config("two.toml", 2, 1);
    let wide = config("wide.toml", 4, 1);
    train(&s, 0, &one, "single", &[]);
    let out = train(&s, 2, &two, "dp", &[]);
    assert!(stderr(&out).contains("reference log-probabilities of 24 + 6 pairs"), "{}", stderr(&out));
    train(&s, 0, &wide, "wide", &[]);
    let single = losses(&s, "single");
    assert_eq!(single.len(), 8);
    let metrics = |run: &str| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(s.path().join(run).join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    for run in ["dp", "wide"] {
        assert_same_losses(&single, &losses(&s, run), run);
        for (a, b) in metrics("single").iter().zip(metrics(run)) {
            for key in ["val_loss", "rewards/margins", "val_rewards/accuracies", "val_rewards/chosen"] {
                if let Some(x) = a[key].as_f64() {
                    let y = b[key].as_f64().unwrap_or(f64::NAN);
                    assert!((x - y).abs() <= 1e-5 * x.abs().max(0.1), "{run}, step {}: {key} {x} vs {y}", a["step"]);
                }
            }
        }
        let rel =
            max_rel(&tensors(&s, "single", 8, "adapter.safetensors"), &tensors(&s, run, 8, "adapter.safetensors"));
        assert!(rel <= 1e-5, "{run}: adapters differ by {rel:e}");
    }
}

/// GRPO with LoRA: each rank samples, scores and trains on its share of a step's prompts (the answers
/// seeded by their place in the step, so the same ones as one process accumulating the micro-batches
/// draws), the step's token count (`dapo`) and reward statistics (`scale_rewards = "batch"`) summed
/// over the ranks, the held-out prompts shared out at evaluations.
#[test]
fn grpo_on_two_ranks_trains_as_one_process() {
    let _g = serial();
    let s = Scratch::new();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/llama");
    let o = command(&s, 0, &["import", fixture.to_str().unwrap(), "--out", "base"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let prompts = ["First Citizen:", "All:", "Caius Marcius:", "Speak, speak.", "We know it,"];
    let mut jsonl = String::new();
    for i in 0..30 {
        jsonl.push_str(&format!("{}\n", serde_json::json!({"prompt": prompts[i % 5]})));
    }
    s.write("prompts.jsonl", &jsonl);
    let config = |name: &str, accum: usize| {
        s.write(
            name,
            &format!(
                "init_from = \"run:base\"\n[data]\npath = \"prompts.jsonl\"\nval_fraction = 0.2\n\
                 [train]\nbatch_size = 1\ngrad_accum_steps = {accum}\nmax_steps = 6\neval_interval = 3\n\
                 log_interval = 1\ncheckpoint_interval = 6\nseed = 5\n\
                 [optim]\nweight_decay = 0.0\n[schedule]\nlr = 1e-2\nwarmup_steps = 1\n\
                 [lora]\nrank = 4\nalpha = 8.0\ntargets = [\"q_proj\", \"v_proj\", \"down_proj\"]\n\
                 [rl]\ngroup_size = 4\nmax_new_tokens = 5\nscale_rewards = \"batch\"\n\
                 [[rl.rewards]]\nkind = \"regex\"\npattern = \"[,.]\"\n"
            ),
        )
    };
    let one = config("one.toml", 2);
    let two = config("two.toml", 1);
    train(&s, 0, &one, "single", &[]);
    train(&s, 2, &two, "dp", &[]);
    // On-policy (μ = 1) the loss is a sum of advantages that cancel within each group: about 0, so
    // compared absolutely, on the scale of its terms (|A| ~ 1).
    let (single, dp) = (losses(&s, "single"), losses(&s, "dp"));
    assert_eq!(single.len(), 6);
    assert_eq!(single.iter().map(|l| l.0).collect::<Vec<_>>(), dp.iter().map(|l| l.0).collect::<Vec<_>>());
    for ((step, a), (_, b)) in single.iter().zip(&dp) {
        assert!((a - b).abs() <= 1e-6, "step {step}: loss {a} vs {b}");
    }
    let metrics = |run: &str| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(s.path().join(run).join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    for (a, b) in metrics("single").iter().zip(metrics("dp")) {
        for key in ["val_loss", "reward", "reward_std", "completions/mean_length", "entropy", "val_reward"] {
            if let Some(x) = a[key].as_f64() {
                let y = b[key].as_f64().unwrap_or(f64::NAN);
                assert!((x - y).abs() <= 1e-5 * x.abs().max(0.1), "step {}: {key} {x} vs {y}", a["step"]);
            }
        }
    }
    let rel = max_rel(&tensors(&s, "single", 6, "adapter.safetensors"), &tensors(&s, "dp", 6, "adapter.safetensors"));
    assert!(rel <= 1e-5, "adapters differ by {rel:e}");
}

/// Three ranks (an odd split: the ZeRO-1 shards end in padding, and MPI sums three terms in an order
/// of its own) against one process accumulating three micro-batches.
#[test]
fn three_ranks_train_as_one_process_accumulating_three_micro_batches() {
    let _g = serial();
    let s = Scratch::new();
    let one = nano(&s, "one.toml", 20, 3, "");
    let three = nano(&s, "three.toml", 20, 1, "");
    let zero = nano(&s, "zero.toml", 20, 1, "\n[distributed]\nshard_optimizer = true\n");
    train(&s, 0, &one, "single", &[]);
    train(&s, 3, &three, "dp", &[]);
    train(&s, 3, &zero, "zero", &[]);
    let single = losses(&s, "single");
    let w = tensors(&s, "single", 20, "model.safetensors");
    for run in ["dp", "zero"] {
        assert_same_losses(&single, &losses(&s, run), run);
        let rel = max_rel(&w, &tensors(&s, run, 20, "model.safetensors"));
        assert!(rel <= 1e-5, "{run}: final weights differ by {rel:e}");
    }
}

#[test]
fn checkpoints_resume_at_another_world_size() {
    let _g = serial();
    let s = Scratch::new();
    let one = nano(&s, "one.toml", 30, 2, "");
    let two = nano(&s, "two.toml", 30, 1, "\n[distributed]\nshard_optimizer = true\n");
    train(&s, 0, &one, "whole", &[]);
    // 2 ranks (sharded) to step 15, then 1 process; and the other way round.
    train(&s, 2, &two, "a", &["--max-steps", "15"]);
    train(&s, 0, &one, "a", &["--resume"]);
    train(&s, 0, &one, "b", &["--max-steps", "15"]);
    train(&s, 2, &two, "b", &["--resume"]);
    let whole = losses(&s, "whole");
    for run in ["a", "b"] {
        assert_same_losses(&whole, &losses(&s, run), run);
        let rel = max_rel(&tensors(&s, "whole", 30, "model.safetensors"), &tensors(&s, run, 30, "model.safetensors"));
        assert!(rel <= 1e-6, "{run}: final weights differ by {rel:e}");
    }
    // A world size that changes the step's micro-batches is refused, naming the numbers.
    let out =
        command(&s, 2, &["train", "--no-progress", "--config", one.to_str().unwrap(), "--run-dir", "a", "--resume"])
            .output()
            .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("drew 2 micro-batches") && err.contains("would draw 4"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The processes whose parent is `parent` (from /proc: no procps needed).
fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces: split after ')'.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
                st.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(parent)
            })
        })
        .collect()
}

/// Runs `args` as 2 ranks writing run `run`; once the run has logged `steps` training steps (so
/// that the signal lands among the steps, not in a start-up slower than the step timeout), sends
/// `signal` to rank 1's process; returns the output and the seconds from the signal to the end of
/// mpirun.
fn disrupt(s: &Scratch, args: &[&str], run: &str, steps: usize, signal: i32) -> (Output, f64) {
    let mut child: Child = command(s, 2, args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = s.path().join(run).join("metrics.jsonl");
    let started = Instant::now();
    loop {
        let logged = std::fs::read_to_string(&metrics).map_or(0, |t| t.matches("\"train_loss\"").count());
        if logged >= steps {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!("the run ended ({status}) before {steps} steps: {}", stderr(&out));
        }
        assert!(started.elapsed() < Duration::from_secs(600), "no {steps} steps in {}", metrics.display());
        std::thread::sleep(Duration::from_millis(100));
    }
    // Rank 1: the process among mpirun's children whose environment says so.
    let pids = children(child.id());
    let rank1 = pids
        .iter()
        .copied()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|e| e.split(|&b| b == 0).any(|kv| kv == b"OMPI_COMM_WORLD_RANK=1"))
        })
        .unwrap_or_else(|| panic!("no rank 1 among mpirun's children {pids:?}"));
    let acted = Instant::now();
    // SAFETY: a signal to a process this test started (through mpirun).
    assert_eq!(unsafe { libc::kill(rank1 as i32, signal) }, 0, "kill rank 1 ({rank1})");
    let out = child.wait_with_output().unwrap();
    (out, acted.elapsed().as_secs_f64())
}

#[test]
fn a_killed_or_hung_rank_ends_the_run_with_its_name() {
    let _g = serial();
    let s = Scratch::new();
    // The same 5 s at checkpoints (every 15 steps), where a stopped rank would otherwise be waited
    // for an hour (io_timeout_s's default).
    let long = nano(&s, "long.toml", 100_000, 1, "\n[distributed]\ntimeout_s = 5\nio_timeout_s = 5\n");
    let args = ["train", "--no-progress", "--config", long.to_str().unwrap(), "--run-dir"];
    let (out, secs) = disrupt(&s, &[&args[..], &["killed"]].concat(), "killed", 3, libc::SIGKILL);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(secs < 30.0, "the run went on {secs:.1} s after rank 1 died");
    assert!(err.contains("rank 1"), "the message names rank 1:\n{err}");

    let (out, secs) = disrupt(&s, &[&args[..], &["hung"]].concat(), "hung", 3, libc::SIGSTOP);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(secs < 30.0, "the run went on {secs:.1} s after rank 1 stopped");
    assert!(err.contains("rank 1 (") && err.contains("within 5 s"), "the message names rank 1:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn ranks_that_disagree_do_not_start() {
    let _g = serial();
    let s = Scratch::new();
    let a = nano(&s, "a.toml", 30, 1, "");
    let b = nano(&s, "b.toml", 30, 1, "\n[distributed]\nbucket_mib = 1\n");
    // MPMD: rank 0 and rank 1 get different configs.
    let mut cmd = Command::new(std::env::var_os("EMBER_MPIRUN").unwrap_or("mpirun".into()));
    in_scratch(&mut cmd, &s);
    let train = |config: &Path| {
        ["train", "--no-progress", "--config", config.to_str().unwrap(), "--run-dir", "r"].map(String::from)
    };
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "1"]).arg(ember_bin()).args(train(&a));
    cmd.args([":", "-n", "1"]).arg(ember_bin()).args(train(&b));
    let out = cmd.output().unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("the config and the ember binary") && err.contains("rank(s) 1"), "{err}");
    assert!(!s.path().join("r").join("checkpoints").exists(), "nothing trained");
}

#[test]
fn allreduce_benchmark_compares_with_the_engine() {
    let _g = serial();
    let s = Scratch::new();
    let out =
        command(&s, 2, &["bench", "allreduce", "--sizes", "4096,1048576", "--reps", "3", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(v["world"], 2);
    assert!(v["engine"].as_str().unwrap().starts_with("MPI"), "{v}");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect::<Vec<_>>(), [4096, 1048576]);
    for r in rows {
        for k in ["engine_busbw_gbs", "bucketed_busbw_gbs", "end_to_end_busbw_gbs"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
    }
}
