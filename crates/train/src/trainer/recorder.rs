//! What the loop reports: metrics records (throughput since the last one, MFU against the device's
//! peak, memory, wall time) into the sinks (rank 0's), and the progress bar. A run faster than its
//! measured peak measures the peak again and raises it; MFU is never reported above 1.

use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::throughput::{Clock, Throughput};
use super::{RunEnd, TrainOptions, TrainSummary, ValPoint};
use crate::checkpoint::TrainState;
use crate::config::{SinkKind, TrainConfig};
use crate::error::TrainError;
use crate::flops::{now_unix, store_peak, utc_minute, utilisation, Peak, Remeasure};
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
    /// records go to `sinks` (rank 0's: the other ranks have none). A run faster than `peak`
    /// measures it again with `remeasure` (rank 0's: the others report nothing).
    pub(super) fn build(
        self,
        opts: &TrainOptions,
        peak: Peak,
        remeasure: Option<Remeasure>,
        state: &TrainState,
        sinks: Sinks,
    ) -> Recorder {
        let c = opts.collective.as_ref();
        Recorder {
            world: c.world(),
            memory: opts.memory,
            peak: PeakCheck { peak, remeasure, records: 0, remeasured_at: None, told: false, reports: c.rank() == 0 },
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

/// Records between two measurements of a peak that the run beats: a run that really beats its
/// GEMMs (its peak raised to its own rate) does not measure them at every record.
const REMEASURE_EVERY: usize = 50;

/// The peak MFU is measured against, measured again where the run beats it.
struct PeakCheck {
    peak: Peak,
    remeasure: Option<Remeasure>,
    /// Records checked so far.
    records: usize,
    /// The record at which the peak was last measured again.
    remeasured_at: Option<usize>,
    /// Whether the log said that MFU was clamped at 1.
    told: bool,
    /// Whether this rank logs a clamped MFU (rank 0's: the others report nothing).
    reports: bool,
}

impl PeakCheck {
    /// MFU at `rate` model FLOP/s of one rank, in the record of step `step`: at most 1. A rate above
    /// a measured peak has it measured again (not again within [`REMEASURE_EVERY`] records) and
    /// raised to the higher of that and the rate, cached; above another peak, MFU is clamped.
    fn mfu(&mut self, rate: f64, step: usize, bar: &ProgressBar) -> f64 {
        self.records += 1;
        if rate.is_finite() && rate > self.peak.flops {
            self.beaten(rate, step, bar);
        }
        utilisation(rate, &self.peak)
    }

    fn beaten(&mut self, rate: f64, step: usize, bar: &ProgressBar) {
        let tf = |flops: f64| flops / 1e12;
        let (old, records) = (&self.peak, self.records);
        let due = self.remeasured_at.is_none_or(|at| records - at >= REMEASURE_EVERY);
        let Some(remeasure) = self.remeasure.as_mut().filter(|_| old.remeasurable && due) else {
            if self.reports && !std::mem::replace(&mut self.told, true) {
                let why = match old.remeasurable {
                    true => format!("measured again fewer than {REMEASURE_EVERY} records ago"),
                    false => "not measured here (a --peak-tflops or table peak below the run's rate?)".into(),
                };
                bar.suspend(|| {
                    tracing::warn!(
                        "step {step}: {:.4} TFLOP/s of model FLOPs per rank, above the peak of {:.4} TFLOP/s ({}), \
                         {why}: MFU is reported as at most 100 %",
                        tf(rate),
                        tf(old.flops),
                        old.source
                    )
                });
            }
            return;
        };
        self.remeasured_at = Some(records);
        let fresh = (remeasure.measure)();
        let (now, measured) = (fresh.measured_at.unwrap_or_else(now_unix), fresh.flops);
        let raised = match measured >= rate {
            true => fresh,
            false => Peak {
                flops: rate,
                source: format!(
                    "the run's own rate at step {step}, {} UTC, above its GEMMs measured again ({:.4} TFLOP/s)",
                    utc_minute(now),
                    tf(measured)
                ),
                measured_at: Some(now),
                remeasurable: true,
            },
        };
        if let Some(file) = &remeasure.cache {
            store_peak(file, raised.flops, now);
        }
        bar.suspend(|| {
            tracing::warn!(
                "step {step}: {:.4} TFLOP/s of model FLOPs per rank beat the peak of {:.4} TFLOP/s ({}); measured \
                 again: {:.4} TFLOP/s; the peak is now {:.4} TFLOP/s ({})",
                tf(rate),
                tf(old.flops),
                old.source,
                tf(measured),
                tf(raised.flops),
                raised.source
            )
        });
        self.peak = raised;
    }
}

pub(super) struct Recorder {
    config: RecorderConfig,
    world: usize,
    memory: Option<&'static dyn MemoryProbe>,
    peak: PeakCheck,
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
        let tokens_per_sec = self.speed.window_rate();
        let rate = self.config.flops_per_token * tokens_per_sec / self.world as f64;
        let mfu = self.peak.mfu(rate, state.step, &self.bar);
        let (world, speed) = (self.world, &self.speed);
        let tokens_per_step = self.tokens_per_step();
        let mut record = StepRecord {
            step: state.step,
            train_loss: out.loss,
            lr,
            grad_norm: out.grad_norm,
            clipped: clip_coefficient(out.grad_norm, self.config.grad_clip) < 1.0,
            step_ms: speed.window_ms_per_step(tokens_per_step),
            tokens_per_sec,
            mfu,
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
            mfu: utilisation(self.config.flops_per_token * tokens_per_sec / self.world as f64, &self.peak.peak),
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    /// A check of `peak` whose re-measurements give `measured` FLOP/s, counted in `calls`, cached
    /// in `cache`.
    fn check(peak: Peak, measured: f64, calls: &Arc<AtomicUsize>, cache: Option<PathBuf>) -> PeakCheck {
        let calls = calls.clone();
        let measure = Box::new(move || {
            calls.fetch_add(1, Ordering::SeqCst);
            Peak {
                flops: measured,
                source: "measured now: test".into(),
                measured_at: Some(1_796_630_400),
                remeasurable: true,
            }
        });
        let remeasure = Some(Remeasure { measure, cache });
        PeakCheck { peak, remeasure, records: 0, remeasured_at: None, told: false, reports: true }
    }

    fn peak(flops: f64, remeasurable: bool) -> Peak {
        Peak { flops, source: "measured while busy".into(), measured_at: None, remeasurable }
    }

    #[test]
    fn a_run_faster_than_its_measured_peak_measures_it_again_once() {
        let (calls, bar, dir) = (Arc::new(AtomicUsize::new(0)), ProgressBar::hidden(), tempfile::tempdir().unwrap());
        let file = dir.path().join("peak.txt");
        store_peak(&file, 1.48e11, 1);
        // The run: 1.9e11 FLOP/s against a busy machine's 1.48e11; its GEMMs now reach 1.8e11.
        let mut c = check(peak(1.48e11, true), 1.8e11, &calls, Some(file.clone()));
        assert_eq!(c.mfu(1e11, 10, &bar), 1e11 / 1.48e11);
        assert_eq!(calls.load(Ordering::SeqCst), 0, "below the peak: nothing measured");
        let mfu = c.mfu(1.9e11, 20, &bar);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(mfu, 1.0);
        assert_eq!(c.peak.flops, 1.9e11, "the higher of the run's rate and the measurement");
        assert!(c.peak.remeasurable && c.peak.source.contains("step 20"), "{}", c.peak.source);
        // Cached, with the time of the measurement.
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "190000000000\n1796630400\n");
        // Faster again at the next records: clamped, not measured again for a while.
        for step in 30..30 + REMEASURE_EVERY - 1 {
            assert_eq!(c.mfu(2e11, step, &bar), 1.0);
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(c.peak.flops, 1.9e11);
        // Then once more, and a measurement above the rate is the peak itself.
        let mut c2 = check(c.peak.clone(), 2.5e11, &calls, None);
        (c2.records, c2.remeasured_at) = (c.records, c.remeasured_at);
        assert_eq!(c2.mfu(2e11, 100, &bar), 2e11 / 2.5e11);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(c2.peak.source, "measured now: test");
    }

    #[test]
    fn a_given_peak_below_the_run_clamps_mfu_without_measuring() {
        let (calls, bar) = (Arc::new(AtomicUsize::new(0)), ProgressBar::hidden());
        let mut c = check(peak(1e11, false), 5e11, &calls, None);
        assert_eq!(c.mfu(1.3e11, 10, &bar), 1.0);
        assert_eq!(c.mfu(1.2e11, 20, &bar), 1.0);
        assert_eq!(c.mfu(5e10, 30, &bar), 0.5);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert_eq!(c.peak.flops, 1e11);
        assert!(c.told);
    }
}
