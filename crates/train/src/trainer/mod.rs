//! The training loop, nanoGPT's `while True:` in Burn: LR -> micro-batches (forward, backward,
//! accumulate) -> global-norm clip -> AdamW -> log -> maybe evaluate (a new best val loss: its
//! weights kept in `best/`) / checkpoint -> stop (at the last step, at the first evaluation at or
//! below `train.target_val_loss`, or when asked: Ctrl-C).
//!
//! The loop composes its parts, torchtitan's way: each is built from a config (what it reads of the
//! run's) by a `build`. [`setup`]: the data, the tokenizer and the starting model; [`checkpointer`]:
//! the run directory, started, resumed and checkpointed, and its best checkpoint; the objective
//! ([`objective::build`]: what a step optimizes, how the splits are scored, what the records name
//! beside the loss, what changes in the model after a step); the optimizer
//! ([`Optimizer::build`]); [`evaluator`]: the evaluation before training, the periodic ones and
//! their samples; [`recorder`]: metrics, progress bar and [`throughput`]; [`ranks`]: what the ranks
//! of a data-parallel run must agree on.

mod checkpointer;
mod evaluator;
mod ranks;
mod recorder;
mod setup;
#[cfg(test)]
mod tests;
mod throughput;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::Device;
use ember_data::fetch::Locations;
use ember_data::WindowSampler;
use ember_kernels::{Compute, TrainBackend};
use ember_model::Decoder;
use indicatif::ProgressBar;

use crate::checkpoint::{TrainState, CONFIG_FILE, TOKENIZER_FILE};
use crate::distributed::Collective;
use crate::error::{OptimizerError, TrainError};
use crate::flops::{resolve_peak, Gemms, Peak, Remeasure};
use crate::init::ResolvedConfig;
use crate::memory::MemoryProbe;
use crate::metrics::{Sinks, StepRecord};
use crate::objective::{self, Splits};
use crate::precision::{agree_with_rank0, peak_gemms, run_compute, ComputeRequest};
use crate::schedule::LrSchedule;
use crate::step::{Optimizer, StepOutput, Stepper};
use checkpointer::{Checkpointer, CheckpointerConfig};
use evaluator::{Evaluator, EvaluatorConfig};
use ranks::{check_ranks_agree, Stage};
use recorder::{open_sinks, Recorder, RecorderConfig};
pub(crate) use setup::{initial_model, prepare, Setup};

/// How to run, beyond the config.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub run_dir: PathBuf,
    /// Continue the run in `run_dir` from its latest checkpoint.
    pub resume: bool,
    /// Resume even where the data changed since the checkpoint (warned of, and recorded in the
    /// next checkpoints); otherwise such a resume is refused.
    pub accept_data_change: bool,
    /// Stop after this many optimizer steps, checkpointing there; the LR schedule still follows the
    /// config, so a later `--resume` continues the same run.
    pub stop_at: Option<usize>,
    pub show_progress: bool,
    pub locations: Locations,
    /// The folder of `[eval]`'s benchmark sets when the config names none (`$EMBER_EVAL_DIR`).
    pub eval_dir: Option<PathBuf>,
    /// The GPU's name (as `nvidia-smi` prints it), to find its peak in the table.
    pub device_name: Option<String>,
    /// Peak TFLOP/s for MFU, instead of the table or a measurement.
    pub peak_tflops: Option<f64>,
    /// Reads the device memory in use, for the metrics (the heap on the CPU).
    pub memory: Option<&'static dyn MemoryProbe>,
    /// Memory the device can give the run, checked against an estimate before the first step.
    pub memory_available: Option<u64>,
    /// The other ranks of a data-parallel run ([`crate::distributed::Solo`] alone).
    pub collective: Arc<dyn Collective>,
    /// The device's reduction engine (NCCL for CUDA, `--features nccl`); none: through the host.
    pub device_comm: Option<ember_kernels::DeviceComm>,
    /// How the binary asks the run to compute (kernels or references, the CPU's kernels).
    pub compute: ComputeRequest,
    /// Asked after every step whether to stop (a SIGINT or SIGTERM arrived): the run checkpoints
    /// the step just taken and returns, [`RunEnd::Stopped`]. In a data-parallel run the ranks agree
    /// after every step (a sum of one number over the ranks): one rank asked stops them all, at the
    /// same step. Open MPI's mpirun, given Ctrl-C, sends SIGTERM to every rank and SIGKILL a few
    /// seconds later: a checkpoint that takes longer is cut short, and the run resumes from the one
    /// before (checkpoints are replaced atomically).
    pub stop_requested: Option<fn() -> bool>,
}

impl std::fmt::Debug for dyn MemoryProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryProbe")
    }
}

/// How an invocation of [`train`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEnd {
    /// It trained to its last step (`train.max_steps`, or `--max-steps`).
    Completed,
    /// An evaluation's val loss, `val_loss`, was at or below `train.target_val_loss`, `target`: the
    /// run stopped there, checkpointed as at its last step. `elapsed_s` is the run's wall time at
    /// the end of that evaluation (its clock starts after setup: data, tokenizer, model, optimizer;
    /// the step-0 evaluation and every later one are included): the time to target.
    ReachedTarget { target: f64, val_loss: f64, elapsed_s: f64 },
    /// A stop was requested ([`TrainOptions::stop_requested`]): the checkpoint of the step it
    /// stopped at is `checkpoint`.
    Stopped { checkpoint: PathBuf },
    /// A resumed run already at or past where this invocation would stop: nothing was trained.
    NothingToTrain { stop_at: Option<usize> },
}

#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    pub run_dir: PathBuf,
    /// Steps of the run so far (of all invocations).
    pub steps: usize,
    /// `train.max_steps`.
    pub max_steps: usize,
    pub best_val_loss: Option<f64>,
    /// The step of `best_val_loss`, whose weights are in `<run_dir>/best` (runs started by this
    /// version of ember; `None` otherwise).
    pub best_step: Option<usize>,
    pub last_val_loss: Option<f64>,
    /// Training tokens per second over this invocation (evaluation and checkpoints excluded).
    pub tokens_per_sec: f64,
    pub mfu: f64,
    pub elapsed_s: f64,
    /// The evaluations of this invocation (step 0's where it started the run), in order.
    pub val_curve: Vec<ValPoint>,
    pub end: RunEnd,
}

/// One evaluation of the val split.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ValPoint {
    pub step: usize,
    /// The run's wall time at the end of the evaluation.
    pub elapsed_s: f64,
    pub val_loss: f64,
}

impl TrainSummary {
    /// `<run_dir>/best`, where the run keeps its best checkpoint.
    pub(crate) fn best_dir(&self) -> Option<PathBuf> {
        self.best_step.map(|_| self.run_dir.join(crate::checkpoint::BEST_DIR))
    }
}

impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (run, steps, max) = (self.run_dir.display(), self.steps, self.max_steps);
        let best = match (self.best_val_loss, self.best_step, self.best_dir()) {
            (Some(v), Some(step), Some(dir)) => {
                format!("best val loss {v:.4} at step {step}, kept in {}", dir.display())
            }
            (Some(v), ..) => format!("best val loss {v:.4}"),
            (None, ..) => "best val loss n/a".into(),
        };
        let speed =
            format!("{:.0} s ({:.0} tokens/s, MFU {:.2}%)", self.elapsed_s, self.tokens_per_sec, 100.0 * self.mfu);
        match &self.end {
            RunEnd::Completed => write!(f, "trained {steps} steps in {speed}; {best}; run directory {run}"),
            RunEnd::ReachedTarget { target, val_loss, elapsed_s } => write!(
                f,
                "reached val loss {val_loss:.4} <= target {target} at step {steps} of {max}, {elapsed_s:.1} s into \
                 training; trained {steps} steps in {speed}; {best}; run directory {run}"
            ),
            RunEnd::Stopped { checkpoint } => write!(
                f,
                "stopped at step {steps} of {max}: checkpoint {} written; {best}; trained for {speed}; run \
                 directory {run}",
                checkpoint.display()
            ),
            RunEnd::NothingToTrain { stop_at: Some(at) } if steps < max => write!(
                f,
                "the run in {run} is at step {steps} already, at or past --max-steps {at}: nothing to train; resume \
                 without --max-steps (or with a larger one) to continue to step {max}; {best}"
            ),
            RunEnd::NothingToTrain { .. } => write!(
                f,
                "the run in {run} is already complete at step {steps} (train.max_steps = {max}): nothing to train. \
                 To train further, raise train.max_steps in {run}/config.toml (the LR schedule's decay follows it \
                 unless schedule.decay_steps is set) and resume: ember train --config {run}/config.toml --run-dir \
                 {run} --resume; {best}"
            ),
        }
    }
}

/// Trains (or resumes) the run described by `run` (its `init_from` source already open) in
/// `opts.run_dir`: nanoGPT's loop of step -> record -> maybe evaluate -> maybe checkpoint, its parts
/// in the modules above. In a data-parallel run every rank calls this; rank 0 alone writes the run
/// directory.
pub fn train<B: TrainBackend>(
    run: ResolvedConfig,
    opts: &TrainOptions,
    device: &Device<B>,
) -> Result<TrainSummary, TrainError> {
    // A run's config, however it was made: adapters need a pretrained base (only `ember bench
    // train` may put them on a random one).
    run.config.validate_sections().map_err(|error| TrainError::Invalid { path: "config".into(), error })?;
    let setup = prepare(run, &opts.locations, opts.collective.world())?;
    let (config, c) = (&setup.config, opts.collective.as_ref());
    // Start-up waits for slow work of other ranks (loading a model); steps do not.
    c.set_timeout(config.distributed.io_timeout());
    let compute = run_compute::<B>(device, config, opts.compute, Some(opts.locations.cache_dir.as_path()));
    let compute = agree_with_rank0(compute, c)?;
    let checkpointer = CheckpointerConfig::of(config).build(&setup, &opts.run_dir, c, opts.accept_data_change);
    // Before anything costly (an objective's reference scores): a resume that cannot go on fails
    // at once.
    checkpointer.ready(opts.resume)?;
    // Before the run's model is built: an objective may score the data with the starting model.
    let splits = Splits { train: &setup.train, val: &setup.val };
    let starting = || Ok(initial_model::<B>(&setup, device)?.with_compute(compute).valid());
    let rl = setup.prompts.as_ref().map(|prompts| objective::RlData {
        prompts,
        tokenizer: &setup.tokenizer,
        rollouts: (c.rank() == 0).then(|| opts.run_dir.join("rollouts.jsonl")),
    });
    let objective = objective::build::<B>(config, splits, rl, starting, c)?;
    let (model, mut optim, mut state, sinks) = open_run::<B>(&setup, &checkpointer, opts, compute, device)?;
    c.set_timeout(config.distributed.timeout());
    let schedule = LrSchedule::from_config(config);
    let stop = opts.stop_at.unwrap_or(config.train.max_steps).min(config.train.max_steps);
    let stepper = Stepper {
        data: &setup.train,
        sampler: match state.epochs {
            true => WindowSampler::epochs(state.sampler_seed),
            false => WindowSampler::random(state.sampler_seed),
        },
        config,
        objective: objective.as_ref(),
        device,
        collective: c,
        buffers: Default::default(),
        device_comm: opts.device_comm.as_ref(),
    };
    let (peak, remeasure) = device_peak::<B>(opts, device, peak_gemms(&compute));
    setup::log_setup(config, &compute, &peak, config.tokens_per_step() * c.world());
    log_data_parallel(&stepper, matches!(optim, Optimizer::Sharded(_)));
    let tasks = EvaluatorConfig::tasks(config, &setup, opts.eval_dir.as_deref())?;
    let evaluator = EvaluatorConfig::of(config).build(&setup, c, objective.as_ref(), &tasks);
    let mut rec = RecorderConfig::of(config).build(opts, peak, remeasure, &state, sinks);
    if state.step >= stop {
        let end = RunEnd::NothingToTrain { stop_at: opts.stop_at };
        return Ok(rec.finish(&opts.run_dir, &state, None, Vec::new(), end));
    }
    let mut curve = Vec::new();
    if state.step == 0 {
        if let Some(val_loss) = evaluator.initial(&model.valid(), &mut rec)? {
            curve.push(ValPoint { step: 0, elapsed_s: rec.clock.elapsed_s(), val_loss });
        }
    }
    let parts = Parts { opts, stepper, evaluator, checkpointer, schedule, stop, target: config.train.target_val_loss };
    let (end, last_val) = parts.run(model, &mut optim, &mut state, &mut rec, &mut curve)?;
    Ok(rec.finish(&opts.run_dir, &state, last_val, curve, end))
}

/// The parts the loop composes, built by [`train`], and where it stops: at step `stop`, or at the
/// first evaluation at or below `target`.
struct Parts<'a, B: TrainBackend> {
    opts: &'a TrainOptions,
    stepper: Stepper<'a, B>,
    evaluator: Evaluator<'a, B>,
    checkpointer: Checkpointer<'a>,
    schedule: LrSchedule,
    stop: usize,
    target: Option<f64>,
}

impl<B: TrainBackend> Parts<'_, B> {
    /// The steps from `state` on: step -> record -> maybe evaluate -> maybe checkpoint -> maybe
    /// stop. Returns how the run ended and its last val loss.
    fn run(
        &self,
        mut model: Decoder<B>,
        optim: &mut Optimizer<B>,
        state: &mut TrainState,
        rec: &mut Recorder,
        curve: &mut Vec<ValPoint>,
    ) -> Result<(RunEnd, Option<f64>), TrainError> {
        let mut last_val = None;
        while state.step < self.stop {
            let (started, lr) = (Instant::now(), self.schedule.lr(state.step));
            let epoch_before = self.evaluator.epoch(state.next_stream);
            let out;
            (model, out) = take_step(&self.stepper, model, optim, state, lr, &rec.bar)?;
            rec.add_step(started.elapsed(), &out);
            let (step, epoch) = (state.step, self.evaluator.epoch(state.next_stream));
            let is_eval = self.evaluator.due(step, epoch_before, epoch);
            let mut reached = None;
            if rec.due(step, is_eval) {
                let mut record = rec.step_record(state, &out, lr, epoch, self.stepper.objective);
                if is_eval {
                    let vl;
                    (vl, reached) = self.evaluate(&model, state, &mut record, rec, curve)?;
                    last_val = vl.or(last_val);
                }
                rec.write(&record)?;
            }
            // Reaching the target ends the run: its last checkpoint, as at `stop`.
            let saved = self.checkpointer.due(step, if reached.is_some() { step } else { self.stop });
            if saved {
                state.elapsed_s = rec.clock.elapsed_s();
                self.checkpointer.save(&model, optim, state, &rec.bar)?;
            }
            rec.bar.set_position(step as u64);
            if let Some(end) = reached {
                return Ok((end, last_val));
            }
            // (At the last step there is nothing left to stop: the run completes.)
            if step < self.stop && stop_requested(self.opts, step)? {
                rec.bar.suspend(|| tracing::info!("stop requested: the run stops at step {step}, checkpointed"));
                if !saved {
                    state.elapsed_s = rec.clock.elapsed_s();
                    self.checkpointer.save(&model, optim, state, &rec.bar)?;
                }
                let checkpoint = crate::checkpoint::step_dir(&self.opts.run_dir, step);
                return Ok((RunEnd::Stopped { checkpoint }, last_val));
            }
        }
        Ok((RunEnd::Completed, last_val))
    }

    /// The evaluation after step `state.step`, into `record`: a new best val loss kept as the best
    /// checkpoint, the val curve extended. Returns the val loss (none without validation), and the
    /// end of the run where it reached the target.
    fn evaluate(
        &self,
        model: &Decoder<B>,
        state: &mut TrainState,
        record: &mut StepRecord,
        rec: &mut Recorder,
        curve: &mut Vec<ValPoint>,
    ) -> Result<(Option<f64>, Option<RunEnd>), TrainError> {
        let step = state.step;
        let Some(vl) = self.evaluator.record(&model.valid(), record, rec)? else { return Ok((None, None)) };
        // Every rank has the same (reduced) loss, so they all agree on a new best.
        if vl.is_finite() && state.best_val_loss.is_none_or(|b| vl < b) {
            (state.best_val_loss, state.best_step) = (Some(vl), Some(step));
            self.checkpointer.save_best(model, step, vl, &rec.bar)?;
        }
        let elapsed_s = rec.clock.elapsed_s();
        curve.push(ValPoint { step, elapsed_s, val_loss: vl });
        let Some(target) = self.target.filter(|&t| vl <= t) else { return Ok((Some(vl), None)) };
        record.target_reached_s = Some(elapsed_s);
        rec.bar
            .suspend(|| tracing::info!("reached val loss {vl:.4} <= target {target} at step {step}, {elapsed_s:.1} s"));
        Ok((Some(vl), Some(RunEnd::ReachedTarget { target, val_loss: vl, elapsed_s })))
    }
}

/// Whether to stop after step `step`: asked of [`TrainOptions::stop_requested`], and agreed by
/// every rank (any one asked stops them all).
fn stop_requested(opts: &TrainOptions, step: usize) -> Result<bool, TrainError> {
    let Some(asked) = opts.stop_requested else { return Ok(false) };
    let mut flag = [f64::from(u8::from(asked()))];
    let c = opts.collective.as_ref();
    if c.world() > 1 {
        c.all_reduce_f64(&mut flag, &format!("step {step}: stop request"))?;
    }
    Ok(flag[0] > 0.0)
}

/// One step of the loop: taken at `state`, its loss checked, the loop state moved past it.
fn take_step<B: TrainBackend>(
    stepper: &Stepper<'_, B>,
    model: Decoder<B>,
    optim: &mut Optimizer<B>,
    state: &mut TrainState,
    lr: f64,
    bar: &ProgressBar,
) -> Result<(Decoder<B>, StepOutput), TrainError> {
    let (model, out) = stepper.step(model, optim, state.next_stream, state.step + 1, lr, state.loss_scaler.as_mut())?;
    if !out.loss.is_finite() {
        return Err(TrainError::Diverged { step: state.step, loss: out.loss });
    }
    if out.skipped {
        bar.suspend(|| tracing::warn!("step {}: gradients overflowed in f16, step skipped", state.step + 1));
    }
    // What the objective changes after a step that updated the model.
    let model = if out.skipped { model } else { stepper.objective.after_step(model, &out.sums) };
    state.step += 1;
    state.next_stream += stepper.micro_batches_per_step();
    state.tokens_seen += (stepper.config.tokens_per_step() * stepper.collective.world()) as u64;
    Ok((model, out))
}

/// The device's peak FLOP/s, for MFU: `--peak-tflops`, the table, or a measured GEMM rate; and, for
/// a measured one on rank 0 (the rank that reports), how to measure it again when the run beats it.
fn device_peak<B: TrainBackend>(opts: &TrainOptions, device: &Device<B>, gemms: Gemms) -> (Peak, Option<Remeasure>) {
    let cache = Some(opts.locations.cache_dir.as_path());
    let peak = resolve_peak::<B::InnerBackend>(device, opts.device_name.as_deref(), gemms, opts.peak_tflops, cache);
    let remeasure = (peak.remeasurable && opts.collective.rank() == 0)
        .then(|| Remeasure::of::<B::InnerBackend>(device, gemms, cache));
    (peak, remeasure)
}

type Opened<B> = (Decoder<B>, Optimizer<B>, TrainState, Sinks);

/// The run's model, optimizer, loop state and metric sinks: checked against the device's memory,
/// started or resumed, agreed on by every rank; the run directory's config and tokenizer written.
fn open_run<B: TrainBackend>(
    setup: &Setup,
    checkpointer: &Checkpointer<'_>,
    opts: &TrainOptions,
    compute: Compute,
    device: &Device<B>,
) -> Result<Opened<B>, TrainError> {
    let (config, run_dir, c) = (&setup.config, &opts.run_dir, opts.collective.as_ref());
    // Before any weight is allocated: a config too big for the device is an error, not an abort.
    let kept = setup.init.as_ref().map_or((0, 0), crate::ResolvedInit::kept_quantized);
    setup::check_fits(config, kept, opts.memory_available)?;
    let (model, saved, state) = checkpointer.start::<B>(opts.resume, compute.dtype, device)?;
    // Before the optimizer, which computes as the model does.
    let model = model.with_compute(compute);
    check_ranks_agree(c, setup, &model, Stage::Start)?;
    let optim = Optimizer::build(config, &model, c, saved, state.optimizer_steps, device).map_err(|e| match e {
        // Saved moments come from the checkpoint resumed: ones that do not fit the model mean it is
        // damaged (or not this model's).
        OptimizerError::Moments(message) => TrainError::Checkpoint { path: run_dir.clone(), message },
        e => TrainError::Optimizer(e),
    })?;
    if c.rank() != 0 {
        return Ok((model, optim, state, Sinks(Vec::new())));
    }
    std::fs::create_dir_all(run_dir).map_err(TrainError::io(run_dir))?;
    ember_data::write_atomic(&run_dir.join(CONFIG_FILE), config.to_toml().as_bytes())?;
    setup.tokenizer.save(&run_dir.join(TOKENIZER_FILE))?;
    let resumed_at = opts.resume.then_some(state.step);
    let metrics = open_sinks(&config.metrics.sinks, run_dir, resumed_at, state.elapsed_s)?;
    Ok((model, optim, state, metrics))
}

fn log_data_parallel<B: TrainBackend>(stepper: &Stepper<'_, B>, sharded: bool) {
    let (c, config) = (stepper.collective, stepper.config);
    if c.world() > 1 {
        tracing::info!(
            "data parallel over {} ranks ({}): {} micro-batches of {} per step, gradients in {} MiB buckets{}",
            c.world(),
            c.engine(),
            stepper.micro_batches_per_step(),
            config.train.batch_size,
            config.distributed.bucket_mib,
            if sharded { ", optimizer state sharded (ZeRO-1)" } else { "" }
        );
    }
}
