//! `ember bench` flags: every count bounded, no 0 where a benchmark needs at least 1, and every size
//! that allocates checked against memory before it is allocated, the flag named each time (issue
//! 39). Each check runs before a config or checkpoint is read, unless it needs the model.

use super::common::*;
use super::{refuse, with_run};

const HUGE: &str = "1000000000000";

/// Runs `ember bench args` and asserts a clean refusal naming every one of `needles`.
fn bench(s: &Scratch, args: &[&str], needles: &[&str]) {
    refuse(s, &[&["bench"][..], args].concat(), needles);
}

#[test]
fn counts_past_their_bound_are_refused() {
    let s = Scratch::new();
    let missing = ["--checkpoint", "no-such-run"];
    bench(&s, &["train", "--config", "cfg.toml", "--steps", HUGE], &["--steps 1000000000000 is not in 1..=10000"]);
    bench(&s, &["train", "--config", "cfg.toml", "--warmup", HUGE], &["--warmup", "0..=10000"]);
    bench(&s, &["train", "--config", "cfg.toml", "--peak-tflops", "inf"], &["--peak-tflops"]);
    bench(&s, &["peak", "--reps", HUGE], &["--reps", "1..=1000"]);
    bench(&s, &["attention", "--reps", HUGE], &["--reps", "1..=1000"]);
    let narrow = ["--heads", "1", "--kv-heads", "1", "--head-dim", "1", "--batch", "1"];
    bench(&s, &[&["attention", "--seq", "2000000"][..], &narrow].concat(), &["--seq 2000000 is not in 1..=1048576"]);
    bench(&s, &["allreduce", "--reps", HUGE], &["--reps", "1..=1000"]);
    bench(&s, &[&["serve"][..], &missing, &["--requests", HUGE]].concat(), &["--requests", "1..=10000"]);
    bench(&s, &[&["serve"][..], &missing, &["--clients", "1,257"]].concat(), &["--clients 257"]);
    bench(&s, &[&["decode"][..], &missing, &["--new-tokens", HUGE]].concat(), &["--new-tokens"]);
    bench(&s, &[&["decode"][..], &missing, &["--uncached-tokens", HUGE]].concat(), &["--uncached-tokens"]);
    bench(&s, &["dashboard", "--steps", HUGE], &["--steps", "1..=1000000"]);
    bench(&s, &["dashboard", "--runs", HUGE], &["--runs", "1..=1000"]);
    bench(&s, &["dashboard", "--runs", "1000", "--steps", "1000000"], &["--runs × --steps 1000000000"]);
}

#[test]
fn zero_where_a_benchmark_needs_one_is_refused() {
    let s = Scratch::new();
    let missing = ["--checkpoint", "no-such-run"];
    // `--new-tokens 0` once reported 5.6 M tokens/s; `--sizes 0` cached a peak of 0 (MFU inf %).
    bench(&s, &[&["decode"][..], &missing, &["--new-tokens", "0"]].concat(), &["--new-tokens 0 is not in"]);
    bench(&s, &[&["decode"][..], &missing, &["--contexts", "16,0"]].concat(), &["--contexts 0"]);
    bench(&s, &[&["decode"][..], &missing, &["--block-size", "0"]].concat(), &["--block-size 0"]);
    bench(&s, &[&["decode"][..], &missing, &["--batch", "0"]].concat(), &["--batch 0 is not in 1..=256"]);
    bench(&s, &["peak", "--sizes", "0"], &["--sizes 0 is not in 1..=32768"]);
    assert!(!s.path().join("cache").exists(), "a refused peak benchmark wrote its cache");
    bench(&s, &["peak", "--reps", "0"], &["--reps 0"]);
    bench(&s, &["loss", "--vocab", "0"], &["--vocab 0 is not in"]);
    bench(&s, &["loss", "--tokens", "0"], &["--tokens 0"]);
    bench(&s, &["loss", "--d-model", "0"], &["--d-model 0"]);
    for flag in ["--batch", "--seq", "--heads", "--kv-heads", "--head-dim", "--reps"] {
        bench(&s, &["attention", flag, "0"], &[&format!("{flag} 0 is not in")]);
    }
    bench(&s, &["train", "--config", "cfg.toml", "--steps", "0"], &["--steps 0"]);
    bench(&s, &["train", "--config", "cfg.toml", "--peak-tflops", "0"], &["--peak-tflops 0"]);
    bench(&s, &[&["serve"][..], &missing, &["--max-tokens", "0"]].concat(), &["--max-tokens 0"]);
    bench(&s, &[&["serve"][..], &missing, &["--clients", "0"]].concat(), &["--clients 0"]);
    bench(&s, &["dashboard", "--runs", "0"], &["--runs 0"]);
    bench(&s, &["allreduce", "--bucket-mib", "0"], &["--bucket-mib 0"]);
}

#[test]
fn sizes_that_would_not_fit_in_memory_are_refused_before_allocating() {
    let s = Scratch::new();
    let missing = ["--checkpoint", "no-such-run"];
    // Each of these aborted (or panicked: capacity overflow) allocating.
    bench(&s, &[&["decode"][..], &missing, &["--block-size", "1000000000"]].concat(), &["--block-size 1000000000"]);
    bench(&s, &[&["decode"][..], &missing, &["--contexts", "18446744073709551615"]].concat(), &["--contexts"]);
    bench(&s, &["peak", "--sizes", "256,100000"], &["--sizes 100000 is not in 1..=32768"]);
    bench(&s, &["loss", "--tokens", "1000000000"], &["--tokens 1000000000 is not in"]);
    // Each size in range, together past any machine's memory (12 TB of logits): the memory check.
    bench(&s, &["loss", "--tokens", "1000000", "--vocab", "1000000"], &["--tokens 1000000", "--vocab 1000000", "GiB"]);
    bench(&s, &["attention", "--seq", "1000000", "--batch", "4096"], &["--seq 1000000", "8 GiB"]);
    bench(&s, &["allreduce", "--sizes", "4096,1099511627776"], &["--sizes 1099511627776"]);
}

#[test]
fn decode_and_serve_sizes_past_the_model_are_refused() {
    // runs/cfg: a tiny model of max_seq_len 32.
    let s = with_run();
    let run = ["--checkpoint", "runs/cfg"];
    bench(
        &s,
        &[&["decode"][..], &run, &["--contexts", "16,100", "--new-tokens", "4", "--uncached-tokens", "2"]].concat(),
        &["--contexts 100", "max_seq_len of 32"],
    );
    let too_many = ["--contexts", "16", "--new-tokens", "20"];
    bench(&s, &[&["decode"][..], &run, &too_many].concat(), &["--contexts 16", "max_seq_len of 32"]);
    bench(&s, &[&["serve"][..], &run, &["--max-tokens", "1000"]].concat(), &["--max-tokens 1000 is not in 1..=32"]);
}

/// Issue 57: a seed past TOML's largest integer (2^63 − 1) runs (serialising the run's config
/// panicked): written as a string in the run's config.toml, read back by a resume; seed + 1 wraps.
#[test]
fn seeds_past_tomls_integers_run_and_resume() {
    let s = super::with_config(&tiny_config(""));
    let max = u64::MAX.to_string();
    let target = ["--target-val", "100", "--max-steps", "2", "--eval-interval", "1", "--eval-iters", "1"];
    let o = s.ember(
        &[&["bench", "target", "--config", "cfg.toml", "--seed", &max, "--runs", "2", "--out", "bt"], &target[..]]
            .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&format!("seed {max}: reached")) && stdout(&o).contains("seed 0: reached"),
        "{}",
        stdout(&o)
    );
    let run = format!("bt/seed-{max}");
    let config = std::fs::read_to_string(s.path().join(&run).join("config.toml")).unwrap();
    assert!(config.contains(&format!("seed = \"{max}\"")), "{config}");
    let config_path = format!("{run}/config.toml");
    let o = s.ember(&["train", "--config", &config_path, "--run-dir", &run, "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
}
