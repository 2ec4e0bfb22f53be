//! `ember bench target`: time to a validation loss, the speedrun's measure (experiments/speedrun.md).
//! Each run trains the config with `train.target_val_loss` set, so it stops at its first evaluation
//! at or below the target; the time is the run's clock at the end of that evaluation (started
//! after setup: data, tokenizer, model and optimizer; evaluations, the step-0 one included, count).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_kernels::TrainBackend;
use ember_train::{ConfigFile, RunEnd, TrainOptions, TrainSummary, ValPoint};
use serde::Serialize;

use super::{in_range, Common};
use crate::backend::{dispatch, Job};

/// The exit status of a bench with a run that did not reach the target.
const NOT_REACHED: u8 = 2;

#[derive(Args, Debug)]
pub(super) struct TargetBenchArgs {
    /// Training config (TOML), e.g. configs/nano.toml.
    #[arg(long)]
    config: PathBuf,
    /// The val loss to reach: finite, above 0 (sets train.target_val_loss).
    #[arg(long, allow_negative_numbers = true)]
    target_val: f64,
    /// Evaluate every N steps, 1..=1000000 (overrides train.eval_interval).
    #[arg(long)]
    eval_interval: Option<usize>,
    /// Batches per split in each evaluation, 1..=1048576 (overrides train.eval_iters).
    #[arg(long)]
    eval_iters: Option<usize>,
    /// Give up after N steps, 1..=1000000000 (overrides train.max_steps, which the LR schedule's
    /// decay follows unless schedule.decay_steps is set).
    #[arg(long)]
    max_steps: Option<usize>,
    /// Seed of the first run (overrides train.seed); run i has seed + i.
    #[arg(long)]
    seed: Option<u64>,
    /// Runs, seeds seed..seed+K-1, each reported, with the median time to target, 1..=100.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Keep the runs in DIR/seed-<seed> (which must not exist) [default: a temporary directory,
    /// deleted afterwards].
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

/// One run of the bench.
#[derive(Debug, Serialize)]
struct TargetRun {
    seed: u64,
    reached: bool,
    /// Seconds from the start of training to the end of the first evaluation at or below the
    /// target; `None` when no evaluation reached it.
    time_to_target_s: Option<f64>,
    /// Steps trained (to the target, or `max_steps`).
    steps: usize,
    max_steps: usize,
    /// Training tokens of those steps.
    tokens: u64,
    /// Mean milliseconds of a training step (evaluations and checkpoints excluded).
    step_ms: f64,
    /// Wall time of the whole run, the final checkpoint included.
    elapsed_s: f64,
    best_val_loss: Option<f64>,
    best_step: Option<usize>,
    /// The run's directory (`None`: a temporary one, deleted).
    run_dir: Option<PathBuf>,
    /// Every evaluation: step, seconds (at its end) and val loss; step 0's first.
    curve: Vec<ValPoint>,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct TargetBench {
    config: PathBuf,
    target_val: f64,
    /// Whether every run reached the target.
    reached: bool,
    /// Median over the runs of `time_to_target_s` and of `steps` (`None` unless every run reached it).
    median_time_to_target_s: Option<f64>,
    median_steps: Option<f64>,
    runs: Vec<TargetRun>,
}

impl std::fmt::Display for TargetRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let seed = self.seed;
        match self.time_to_target_s {
            Some(t) => write!(f, "seed {seed}: reached the target in {t:.2} s at step {}", self.steps)?,
            None => write!(f, "seed {seed}: did not reach the target in {} steps", self.steps)?,
        }
        let best = self.best_val_loss.map_or("n/a".into(), |v| format!("{v:.4}"));
        writeln!(
            f,
            " ({} tokens, {:.1} ms/step, best val loss {best}, {:.1} s in all)",
            self.tokens, self.step_ms, self.elapsed_s
        )?;
        writeln!(f, "  step  seconds  val loss")?;
        for p in &self.curve {
            writeln!(f, "  {:>4}  {:>7.2}  {:.4}", p.step, p.elapsed_s, p.val_loss)?;
        }
        Ok(())
    }
}

impl std::fmt::Display for TargetBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "time to val loss <= {} ({}):", self.target_val, self.config.display())?;
        for run in &self.runs {
            write!(f, "{run}")?;
        }
        match (self.median_time_to_target_s, self.median_steps) {
            (Some(t), Some(s)) => write!(f, "median of {} runs: {t:.2} s, {s} steps", self.runs.len()),
            _ => write!(f, "not every run reached the target"),
        }
    }
}

/// Trains one run to completion (or the target) on the chosen backend.
struct TargetJob {
    run: ember_train::ResolvedConfig,
    options: TrainOptions,
}

impl Job for TargetJob {
    type Output = TrainSummary;
    fn run<B: TrainBackend>(self, device: Device<B>, _: &str) -> anyhow::Result<TrainSummary> {
        Ok(ember_train::train::<B>(self.run, &self.options, &device)?)
    }
}

pub(super) fn target(a: TargetBenchArgs) -> anyhow::Result<()> {
    let t = a.target_val;
    anyhow::ensure!(t.is_finite() && t > 0.0, "--target-val {t} is not a val loss: give a finite number above 0");
    for (flag, v, max) in [
        ("--eval-interval", a.eval_interval, 1_000_000),
        ("--eval-iters", a.eval_iters, 1 << 20),
        ("--max-steps", a.max_steps, 1_000_000_000),
    ] {
        v.map_or(Ok(()), |v| in_range(flag, v, 1..=max))?;
    }
    in_range("--runs", a.runs, 1..=100)?;
    let temp = tempfile::Builder::new().prefix("ember-bench-target-").tempdir().context("a temporary directory")?;
    let root = a.out.as_deref().unwrap_or(temp.path());
    let mut runs = Vec::new();
    for i in 0..a.runs {
        runs.push(one_run(&a, i as u64, root)?);
    }
    let done = |f: fn(&TargetRun) -> Option<f64>| median(runs.iter().map(f).collect::<Option<Vec<_>>>()?);
    let bench = TargetBench {
        config: a.config.clone(),
        target_val: t,
        reached: runs.iter().all(|r| r.reached),
        median_time_to_target_s: done(|r| r.time_to_target_s),
        median_steps: done(|r| r.reached.then_some(r.steps as f64)),
        runs,
    };
    super::report(a.common.json, &bench)?;
    if !bench.reached {
        let missed: Vec<String> = bench.runs.iter().filter(|r| !r.reached).map(|r| r.seed.to_string()).collect();
        let max = bench.runs.iter().map(|r| r.max_steps).max().unwrap_or(0);
        eprintln!(
            "error: val loss did not reach --target-val {t} within {max} steps (seed{} {}): raise --max-steps or the \
             target",
            if missed.len() > 1 { "s" } else { "" },
            missed.join(", ")
        );
        // Reported: main exits with this status and prints nothing more.
        return Err(super::super::train::Stopped { status: NOT_REACHED }.into());
    }
    Ok(())
}

/// Run `i` of the bench: the config with the flags' overrides, seed + i, in `root`/seed-<seed>.
fn one_run(a: &TargetBenchArgs, i: u64, root: &Path) -> anyhow::Result<TargetRun> {
    let mut run = ConfigFile::read(&a.config)?.resolve()?;
    if let Some(p) = &mut run.config.pending {
        anyhow::ensure!(
            a.max_steps.is_none(),
            "--max-steps with train.num_epochs in {}: give one or the other",
            a.config.display()
        );
        p.eval_interval &= a.eval_interval.is_none();
    }
    let c = &mut run.config.train;
    c.target_val_loss = Some(a.target_val);
    c.eval_interval = a.eval_interval.unwrap_or(c.eval_interval);
    c.eval_iters = a.eval_iters.unwrap_or(c.eval_iters);
    c.max_steps = a.max_steps.unwrap_or(c.max_steps);
    c.seed = a.seed.unwrap_or(c.seed).wrapping_add(i);
    let seed = c.seed;
    let run_dir = root.join(format!("seed-{seed}"));
    anyhow::ensure!(!run_dir.exists(), "{} exists already: give --out a new directory", run_dir.display());
    let tokens_per_step = run.config.tokens_per_step() as u64;
    let device = a.common.device;
    let options = TrainOptions {
        run_dir: run_dir.clone(),
        resume: false,
        accept_data_change: false,
        stop_at: None,
        show_progress: false,
        locations: crate::env::locations(),
        eval_dir: crate::env::eval_dir(),
        device_name: crate::backend::gpu_name(device),
        peak_tflops: None,
        memory: Some(crate::backend::memory_probe(device)),
        memory_available: crate::backend::memory_available(device),
        collective: Arc::new(ember_train::distributed::Solo),
        device_comm: None,
        compute: crate::env::compute_request(),
        stop_requested: None,
    };
    let checkpointing = run.config.train.activation_checkpointing;
    let s = dispatch(device, checkpointing, TargetJob { run, options })?;
    let time_to_target_s = match s.end {
        RunEnd::ReachedTarget { elapsed_s, .. } => Some(elapsed_s),
        _ => None,
    };
    Ok(TargetRun {
        seed,
        reached: time_to_target_s.is_some(),
        time_to_target_s,
        steps: s.steps,
        max_steps: s.max_steps,
        tokens: s.steps as u64 * tokens_per_step,
        step_ms: 1e3 * tokens_per_step as f64 / s.tokens_per_sec.max(1e-9),
        elapsed_s: s.elapsed_s,
        best_val_loss: s.best_val_loss,
        best_step: s.best_step,
        run_dir: a.out.is_some().then_some(run_dir),
        curve: s.val_curve,
    })
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (n > 0).then(|| if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}
