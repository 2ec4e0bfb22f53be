//! Checkpoints under fire, through the `ember` binary: a run killed with SIGKILL at pseudo-random
//! moments resumes from its newest complete checkpoint each time and ends exactly as an uninterrupted
//! run does; a run killed before its first checkpoint restarts; `ember prepare` leaves alone the files
//! it did not write.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ember_train::checkpoint::{Checkpoint, CHECKPOINTS, LATEST};
use ember_train::metrics::{read_metrics, StepRecord};

/// A model small enough that a step (a checkpoint each) takes milliseconds, so that a kill lands
/// anywhere in the cycle: in a step, in a checkpoint's files, renames or pruning, or in start-up.
fn kill_config(max_steps: usize) -> String {
    format!(
        r#"
[model]
d_model = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 32
max_seq_len = 16

[data]
path = "corpus.txt"
tokenizer = "char"

[train]
batch_size = 2
max_steps = {max_steps}
eval_interval = 100000
eval_iters = 1
log_interval = 1
checkpoint_interval = 1
keep_checkpoints = 2
seed = 7
{OPTIMIZER}
[metrics]
sample_tokens = 0
"#
    )
}

/// `ember train` started in the background, its stderr in `log`.
fn spawn_train(s: &Scratch, config: &str, run_dir: &str, resume: bool, log: &Path) -> Child {
    let mut args = vec!["train", "--config", config, "--run-dir", run_dir, "--peak-tflops", "1"];
    if resume {
        args.push("--resume");
    }
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(&args)
        .current_dir(s.path())
        .env("EMBER_CACHE_DIR", s.path().join("cache"))
        .env_remove("EMBER_DATA_DIR")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("start ember")
}

/// Log text without ANSI colour sequences.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The step a resumed process says it continues from (`resuming step=N`).
fn resumed_from(log: &str) -> Option<usize> {
    let line = log.lines().find(|l| l.contains("resuming"))?;
    let rest = &line[line.find("step=")? + 5..];
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

fn step_folders(run: &Path) -> Vec<usize> {
    let mut v: Vec<usize> = std::fs::read_dir(run.join(CHECKPOINTS))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// What a resume continues from: the checkpoint `latest` names, or, when a process was killed
/// between its first checkpoint's rename and `latest`, the newest step folder (which ember then
/// names in `latest`). `None`: no checkpoint yet.
fn newest_checkpoint(run: &Path) -> Option<usize> {
    match std::fs::read_to_string(run.join(CHECKPOINTS).join(LATEST)) {
        Ok(name) => {
            let name = name.trim();
            Some(name.strip_prefix("step-").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("latest: {name:?}")))
        }
        Err(_) => step_folders(run).last().copied(),
    }
}

/// Asserts that checkpoint `step` is complete and loads: its small files check out, its state is
/// at `step`, and both tensor files parse.
fn assert_loads(run: &Path, step: usize) {
    let dir = run.join(CHECKPOINTS).join(format!("step-{step:06}"));
    let ckpt = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("checkpoint {step} does not open: {e}"));
    assert_eq!(ckpt.state.as_ref().map(|s| s.step), Some(step), "{}", dir.display());
    ckpt.optimizer_tensors().unwrap_or_else(|e| panic!("checkpoint {step}: {e}"));
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    ember_model::weights::from_safetensors(&bytes, "model.safetensors").unwrap_or_else(|e| panic!("{step}: {e}"));
}

/// Leftovers of killed writers (`.NAME.tmp-PID`, `.NAME.old-PID`) in the run and its checkpoints.
fn leftovers(run: &Path) -> Vec<PathBuf> {
    [run.to_path_buf(), run.join(CHECKPOINTS)]
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.contains(".tmp-") || name.contains(".old-")
        })
        .collect()
}

fn metrics(run: &Path) -> Vec<StepRecord> {
    read_metrics(&run.join("metrics.jsonl")).unwrap_or_default()
}

/// xorshift64*: the kill moments, reproducible from the seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

#[derive(Debug, Default)]
struct Figures {
    /// Processes killed while running.
    tried: usize,
    /// Starts with --resume (a checkpoint existed), and those seen continuing from it.
    resumed: usize,
    resumed_checked: usize,
    /// Starts without --resume after a kill (no checkpoint yet).
    restarted: usize,
    /// Steps trained but not checkpointed when killed, trained again after.
    lost_steps: usize,
    /// Leftover temporaries found after kills (all removed at the next start).
    leftovers: usize,
}

#[cfg(unix)]
#[test]
fn a_run_killed_at_random_moments_resumes_from_its_newest_checkpoint_and_completes() {
    const KILLS: usize = 10;
    const SEED: u64 = 0x0e3b_e211;
    const MAX_STEPS: usize = 600;
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("kill.toml", &kill_config(MAX_STEPS));

    // The uninterrupted run: what the killed one must end as, and the time scale of the kills.
    let log = s.path().join("straight.log");
    let t0 = Instant::now();
    let status = spawn_train(&s, "kill.toml", "straight", false, &log).wait().unwrap();
    let straight_time = t0.elapsed();
    assert!(status.success(), "{}", std::fs::read_to_string(&log).unwrap());
    let straight = s.path().join("straight");

    // Kill moments: the first in start-up, the others uniform in [0, R / (kills left + 2)], where R
    // is the time the uninterrupted run took for the steps still to train: on a fast machine or a
    // slow, the run cannot finish before the tenth kill unless it runs 3 times faster than it did.
    let run = s.path().join("killed");
    let mut rng = SEED;
    let mut figures = Figures::default();
    let mut before: Vec<PathBuf> = Vec::new();
    let t0 = Instant::now();
    for attempt in 0.. {
        let from = newest_checkpoint(&run);
        if let Some(step) = from {
            assert_loads(&run, step);
        }
        let resume = from.is_some();
        let log = s.path().join(format!("attempt-{attempt}.log"));
        let mut child = spawn_train(&s, "kill.toml", "killed", resume, &log);
        let kill_at = match (figures.tried, attempt) {
            (KILLS, _) => None,
            (_, 0) => Some(Duration::from_millis(next(&mut rng) % 15)),
            (tried, _) => {
                let remaining = (MAX_STEPS - from.unwrap_or(0)) as f64 / MAX_STEPS as f64;
                let span = straight_time.mul_f64(remaining / (KILLS - tried + 2) as f64);
                Some(span.mul_f64((next(&mut rng) % 1000) as f64 / 1000.0))
            }
        };
        let started = Instant::now();
        let mut killed = false;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if kill_at.is_some_and(|at| started.elapsed() >= at) {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                killed = true;
                break None;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let text = plain(&std::fs::read_to_string(&log).unwrap());
        assert!(!text.contains("panicked"), "attempt {attempt}: {text}");
        if let Some(status) = status {
            assert!(status.success(), "attempt {attempt} failed:\n{text}");
        }
        match (attempt, resume) {
            (0, _) => {}
            (_, true) => figures.resumed += 1,
            (_, false) => figures.restarted += 1,
        }
        if resume {
            // Continued from the newest complete checkpoint (when it got as far as saying so).
            if let Some(at) = resumed_from(&text) {
                assert_eq!(Some(at), from, "attempt {attempt} resumed from the wrong checkpoint:\n{text}");
                figures.resumed_checked += 1;
            }
        }
        if status.is_some() || resumed_from(&text).is_some() {
            // Past its start: what earlier kills left is gone.
            let still: Vec<_> = before.iter().filter(|p| p.exists()).collect();
            assert!(still.is_empty(), "attempt {attempt} left stale temporaries: {still:?}\n{text}");
        }
        if !killed {
            assert!(figures.tried == KILLS, "the run finished after {} kills, not {KILLS}", figures.tried);
            break;
        }
        figures.tried += 1;
        let done = metrics(&run).iter().map(|r| r.step).max().unwrap_or(0);
        let kept = newest_checkpoint(&run);
        figures.lost_steps += done.saturating_sub(kept.unwrap_or(0));
        before = leftovers(&run);
        figures.leftovers += before.len();
        println!(
            "kill {}: {} from {from:?}, killed after {} ms at step {done}; newest checkpoint {kept:?}, {} leftovers",
            figures.tried,
            if resume { "resumed" } else { "started" },
            kill_at.unwrap_or_default().as_millis(),
            before.len()
        );
    }
    let killed_time = t0.elapsed();

    // The run completed, its log lists every step once in order, and it is the uninterrupted run.
    let (a, b) = (metrics(&straight), metrics(&run));
    let steps: Vec<usize> = b.iter().map(|r| r.step).collect();
    assert_eq!(steps, (1..=MAX_STEPS).collect::<Vec<_>>(), "metrics.jsonl steps");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.train_loss.to_bits(), y.train_loss.to_bits(), "train loss at step {}", x.step);
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits(), "grad norm at step {}", x.step);
        assert_eq!(x.val_loss.map(f64::to_bits), y.val_loss.map(f64::to_bits), "val loss at step {}", x.step);
    }
    assert_eq!(newest_checkpoint(&run), Some(MAX_STEPS));
    assert_loads(&run, MAX_STEPS);
    let weights = |r: &Path| {
        let bytes = std::fs::read(r.join(CHECKPOINTS).join(format!("step-{MAX_STEPS:06}/model.safetensors"))).unwrap();
        ember_model::weights::from_safetensors(&bytes, "model.safetensors").unwrap().0
    };
    let (wa, wb) = (weights(&straight), weights(&run));
    assert_eq!(wa.keys().collect::<Vec<_>>(), wb.keys().collect::<Vec<_>>());
    for (k, t) in &wa {
        assert!(t.as_bytes() == wb[k].as_bytes(), "final {k} differs from the uninterrupted run's");
    }
    assert_eq!(step_folders(&run), [MAX_STEPS - 1, MAX_STEPS], "keep_checkpoints = 2");
    assert_eq!(leftovers(&run), Vec::<PathBuf>::new());

    println!(
        "kill test (seed {SEED:#x}, {MAX_STEPS} steps, checkpoint every step): tried {} kills, resumed {} \
         ({} seen continuing from the newest checkpoint), restarted {}, lost {} steps (trained again), {} \
         leftover temporaries removed; uninterrupted {:.1} s, killed run {:.1} s in all",
        figures.tried,
        figures.resumed,
        figures.resumed_checked,
        figures.restarted,
        figures.lost_steps,
        figures.leftovers,
        straight_time.as_secs_f64(),
        killed_time.as_secs_f64(),
    );
}

#[test]
fn a_run_killed_before_its_first_checkpoint_restarts_and_resume_says_so() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config(""));
    // What a run killed at step 2 leaves: logs, an events file and a half-written first checkpoint.
    let run = s.path().join("runs/cfg");
    let dead = 4_194_305; // above Linux's largest pid_max: no process has it
    let tmp = run.join(format!("checkpoints/.step-000003.tmp-{dead}"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("model.toml"), "d_model = ").unwrap();
    let old_metrics = "{\"step\":1}\n{\"step\":2}\n";
    std::fs::write(run.join("metrics.jsonl"), old_metrics).unwrap();
    let events = run.join(format!("events.out.tfevents.1.host.{dead}.ember"));
    std::fs::write(&events, "x").unwrap();
    std::fs::create_dir_all(run.join("best")).unwrap();
    std::fs::write(run.join("best/best.json"), "{\"step\":2,\"val_loss\":9.0}").unwrap();

    let o = s.ember(&["train", "--config", "cfg.toml", "--resume"]);
    assert_clean_error(&o, "has no checkpoint yet");
    assert_clean_error(&o, "run without --resume to restart it");
    // The start cleared what the dead process left, and said so.
    assert!(!tmp.exists());
    #[cfg(target_os = "linux")]
    assert_clean_error(&o, &format!(".step-000003.tmp-{dead}"));

    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = plain(&stderr(&o));
    assert!(err.contains("starting it again from step 0") && err.contains("best/ deleted"), "{err}");
    let best: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/best.json")).unwrap()).unwrap();
    assert_ne!(best["val_loss"], 9.0, "the new attempt's best: {best}");
    let steps: Vec<usize> = metrics(&run).iter().map(|r| r.step).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    assert_eq!(std::fs::read_to_string(run.join("metrics.jsonl.aborted")).unwrap(), old_metrics);
    assert!(!events.exists());

    // Now it has a checkpoint: overwriting it is refused.
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert_clean_error(&o, "already holds a run");
}

#[test]
fn prepare_refuses_to_overwrite_files_it_did_not_write() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    std::fs::create_dir_all(s.path().join("model")).unwrap();
    for (file, text) in [("tokenizer.json", "{\"version\": \"1.0\", \"mine\": true}"), ("meta.json", "{\"mine\": 1}")] {
        let path = s.write(&format!("model/{file}"), text);
        let o = s.ember(&["prepare", "--data", "corpus.txt", "--out", "model"]);
        assert_clean_error(&o, &format!("model/{file}: exists"));
        assert_clean_error(&o, "refusing to overwrite it");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "{file} unchanged");
        assert!(!s.path().join("model/train.bin").exists(), "nothing written");
        std::fs::remove_file(path).unwrap();
    }
    // Its own output it prepares again, with the same inputs or others.
    for fraction in ["0.1", "0.1", "0.2"] {
        let o = s.ember(&["prepare", "--data", "corpus.txt", "--out", "model", "--val-fraction", fraction]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
}

/// A run resumed after its data file changed is refused, naming the file and the change; with
/// `--accept-data-change` it continues, says so, and its next checkpoints record the data as it is
/// then (a later resume compares with that). Each checkpoint, `best/` too, records the data.
#[test]
fn a_resume_on_changed_data_is_refused_unless_the_change_is_accepted() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config(""));
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--config", "cfg.toml", "--run-dir", "run"];
        args.extend(extra);
        s.ember(&args)
    };
    let rows = |folder: &str| -> u64 {
        let text = std::fs::read_to_string(s.path().join("run").join(folder).join("inputs.json")).unwrap();
        let inputs: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(inputs["data"]["path"].as_str().unwrap().ends_with("corpus.txt"), "{inputs}");
        assert_eq!(inputs["data"]["shards"][0]["name"], "train.bin", "{inputs}");
        inputs["data"]["rows"].as_u64().unwrap()
    };
    let o = train(&["--max-steps", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // 400 speeches of a name and two lines (blank lines between them are not rows).
    assert_eq!((rows("checkpoints/step-000003"), rows("best")), (1200, 1200));

    s.write("corpus.txt", &format!("{}JULIET:\nthe night is long,\n", corpus()));
    let o = train(&["--resume"]);
    assert_clean_error(&o, "corpus.txt changed since this checkpoint was written: 1200 lines then, 1202 now");
    assert!(stderr(&o).contains("--accept-data-change"), "{}", stderr(&o));
    assert!(!s.path().join("run/checkpoints/step-000006").exists());

    let o = train(&["--resume", "--accept-data-change"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("WARN") && err.contains("changed since the checkpoint of step 3"), "{err}");
    assert!(err.contains("2 lines added at the end") && err.contains("(--accept-data-change)"), "{err}");
    assert_eq!(rows("checkpoints/step-000006"), 1202);
    // The run's record follows the accepted data: resuming the complete run again is quiet.
    let o = train(&["--resume"]);
    assert!(o.status.success() && !stderr(&o).contains("changed"), "{}", stderr(&o));
    // A checkpoint of an earlier ember, without the record, resumes with a note.
    std::fs::remove_file(s.path().join("run/checkpoints/step-000006/inputs.json")).unwrap();
    let o = train(&["--resume"]);
    assert!(o.status.success() && stderr(&o).contains("has no record of its data"), "{}", stderr(&o));
}
