//! What the loop reports: metrics records (throughput since the last one, MFU against the device's
//! peak, memory, wall time) into the sinks (rank 0's), and the progress bar.

use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::throughput::{Clock, Throughput};
use super::{RunEnd, TrainOptions, TrainSummary, ValPoint};
use crate::checkpoint::TrainState;
use crate::config::{SinkKind, TrainConfig};
use crate::error::TrainError;
use crate::flops::{mfu, Peak};
use crate::memory::MemoryProbe;
use crate::metrics::{JsonlSink, MetricsSink, Sinks, StepRecord, TensorBoardSink};
use crate::objective::Objective;
use crate::optim::clip_coefficient;
use crate::step::StepOutput;

/// What the recorder reads of the run's config.
pub(super) struct RecorderConfig {
    /// Tokens of one optimizer step on one rank.
    tokens_per_step: usize,
    /// Model FLOPs per token of a training step, for MFU.
    flops_per_token: f64,
    /// `optim.grad_clip`: each record says whether its step was clipped.
    grad_clip: f64,
    /// `train.log_interval`: a record every this many steps (and at every evaluation).
    log_interval: usize,
    /// `train.max_steps`: the progress bar's length.
    max_steps: usize,
}

impl RecorderConfig {
    pub(super) fn of(config: &TrainConfig) -> Self {
        Self {
            tokens_per_step: config.tokens_per_step(),
            flops_per_token: config.train_flops_per_token(),
            grad_clip: config.optim.grad_clip,
            log_interval: config.train.log_interval,
            max_steps: config.train.max_steps,
        }
    }

    /// Starts the clock (after the time of earlier invocations) and the bar at `state.step`; the
    /// records go to `sinks` (rank 0's: the other ranks have none).
    pub(super) fn build(self, opts: &TrainOptions, peak: Peak, state: &TrainState, sinks: Sinks) -> Recorder {
        let c = opts.collective.as_ref();
        Recorder {
            world: c.world(),
            memory: opts.memory,
            peak,
            bar: progress_bar(opts.show_progress && c.rank() == 0, self.max_steps, state.step),
            clock: Clock::after(state.elapsed_s),
            speed: Throughput::default(),
            sinks,
            config: self,
        }
    }
}

/// The metric sinks of `kinds` in `run_dir`, continuing the files of a run resumed at step
/// `resumed_at` (`elapsed` seconds into it).
pub(super) fn open_sinks(
    kinds: &[SinkKind],
    run_dir: &Path,
    resumed_at: Option<usize>,
    elapsed: f64,
) -> Result<Sinks, TrainError> {
    let mut sinks: Vec<Box<dyn MetricsSink>> = Vec::new();
    for kind in kinds {
        sinks.push(match kind {
            SinkKind::Jsonl => Box::new(JsonlSink::open(run_dir, resumed_at)?),
            SinkKind::Tensorboard => Box::new(TensorBoardSink::create(run_dir, resumed_at, elapsed)?),
        });
    }
    Ok(Sinks(sinks))
}

pub(super) struct Recorder {
    config: RecorderConfig,
    world: usize,
    memory: Option<&'static dyn MemoryProbe>,
    peak: Peak,
    pub(super) clock: Clock,
    speed: Throughput,
    pub(super) sinks: Sinks,
    pub(super) bar: ProgressBar,
}

impl Recorder {
    /// Tokens of one step over all ranks.
    fn tokens_per_step(&self) -> usize {
        self.config.tokens_per_step * self.world
    }

    /// Counts a training step that took `dt`.
    pub(super) fn add_step(&mut self, dt: Duration, out: &StepOutput) {
        let tokens = self.tokens_per_step();
        self.speed.add(dt, tokens, out);
    }

    /// Whether step `step` writes a record: every `log_interval` steps, and at every evaluation.
    pub(super) fn due(&self, step: usize, evaluates: bool) -> bool {
        step.is_multiple_of(self.config.log_interval) || evaluates
    }

    /// The metrics record of the step just taken (evaluation left to the evaluator), with what the
    /// `objective` names of its sums; starts a new throughput window.
    pub(super) fn step_record<B: ember_kernels::TrainBackend>(
        &mut self,
        state: &TrainState,
        out: &StepOutput,
        lr: f64,
        epoch: Option<f64>,
        objective: &dyn Objective<B>,
    ) -> StepRecord {
        let (world, speed) = (self.world, &self.speed);
        let tokens_per_step = self.tokens_per_step();
        let tokens_per_sec = speed.window_rate();
        let mut record = StepRecord {
            step: state.step,
            train_loss: out.loss,
            lr,
            grad_norm: out.grad_norm,
            clipped: clip_coefficient(out.grad_norm, self.config.grad_clip) < 1.0,
            step_ms: speed.window_ms_per_step(tokens_per_step),
            tokens_per_sec,
            mfu: mfu(self.config.flops_per_token, tokens_per_sec, &self.peak) / world as f64,
            loss_scale: state.loss_scaler.as_ref().map(|s| s.scale),
            memory_bytes: self.memory.and_then(|m| m.current_bytes()),
            elapsed_s: self.clock.elapsed_s(),
            epoch,
            comm_ms: (world > 1).then(|| speed.per_step_ms(speed.window_comm, tokens_per_step)),
            wait_ms: (world > 1).then(|| speed.per_step_ms(speed.window_wait, tokens_per_step)),
            // The evaluation's and the objective's fields are filled in by them.
            ..StepRecord::default()
        };
        objective.record_step(&out.sums, &mut record);
        self.speed.reset_window();
        record
    }

    /// Writes `record` and shows its loss and speed on the bar.
    pub(super) fn write(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        let mfu = 100.0 * record.mfu;
        let (loss, rate) = (record.train_loss, record.tokens_per_sec);
        self.bar.set_message(format!("loss {loss:.4} · {rate:.0} tok/s · MFU {mfu:.1}%"));
        self.sinks.record(record)
    }

    /// Clears the bar; the summary of this invocation (its training throughput: evaluation and
    /// checkpoints excluded).
    pub(super) fn finish(
        self,
        run_dir: &Path,
        state: &TrainState,
        last_val_loss: Option<f64>,
        val_curve: Vec<ValPoint>,
        end: RunEnd,
    ) -> TrainSummary {
        self.bar.finish_and_clear();
        let tokens_per_sec = self.speed.total_rate();
        TrainSummary {
            run_dir: run_dir.to_path_buf(),
            steps: state.step,
            max_steps: self.config.max_steps,
            best_val_loss: state.best_val_loss,
            best_step: state.best_step,
            last_val_loss,
            tokens_per_sec,
            mfu: mfu(self.config.flops_per_token, tokens_per_sec, &self.peak) / self.world as f64,
            elapsed_s: self.clock.elapsed_s(),
            val_curve,
            end,
        }
    }
}

fn progress_bar(show: bool, len: usize, pos: usize) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps · {msg} · eta {eta}").expect("valid template"),
    );
    bar.set_position(pos as u64);
    bar
}
