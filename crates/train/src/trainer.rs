//! The training loop, nanoGPT's `while True:` in Burn: LR -> micro-batches (forward, backward,
//! accumulate) -> global-norm clip -> AdamW -> log -> maybe evaluate / checkpoint -> stop.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::tensor::{DType, Device, TensorData};
use ember_data::fetch::Locations;
use ember_data::{Examples, Tokenizer, WindowSampler};
use ember_model::ops::TrainBackend;
use ember_model::weights::named_tensors_where;
use ember_model::Decoder;
use indicatif::{ProgressBar, ProgressStyle};

use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainState, TrainingData, CONFIG_FILE, TOKENIZER_FILE};
use crate::config::{DataFormat, EvalStrategy};
use crate::config::{MetricsConfig, SinkKind};
use crate::config::{Precision, TrainConfig};
use crate::distributed::{digest, Collective};
use crate::error::TrainError;
use crate::eval::{eval_seed, evaluate_all_part, evaluate_part, LossSum, Part};
use crate::flops::{mfu, resolve_peak, Gemms, Peak};
use crate::init::{ResolvedConfig, ResolvedInit};
use crate::memory::MemoryProbe;
use crate::metrics::{JsonlSink, MetricsSink, SampleRecord, Sinks, StepRecord, TensorBoardSink, METRICS_FILE};
use crate::optim::clip_coefficient;
use crate::precision::{compute_dtype, LossScaler};
use crate::schedule::LrSchedule;
use crate::step::{Optimizer, StepOutput, Stepper};

/// How to run, beyond the config.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub run_dir: PathBuf,
    /// Continue the run in `run_dir` from its latest checkpoint.
    pub resume: bool,
    /// Stop after this many optimizer steps, checkpointing there; the LR schedule still follows the
    /// config, so a later `--resume` continues the same run.
    pub stop_at: Option<usize>,
    pub show_progress: bool,
    pub locations: Locations,
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
    pub device_comm: Option<ember_model::ops::DeviceComm>,
}

impl std::fmt::Debug for dyn MemoryProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryProbe")
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    pub run_dir: PathBuf,
    pub steps: usize,
    pub best_val_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    /// Training tokens per second over this invocation (evaluation and checkpoints excluded).
    pub tokens_per_sec: f64,
    pub mfu: f64,
    pub elapsed_s: f64,
}

impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let best = self.best_val_loss.map_or("n/a".into(), |v| format!("{v:.4}"));
        write!(
            f,
            "trained {} steps in {:.0} s ({:.0} tokens/s, MFU {:.2}%); best val loss {best}; run directory {}",
            self.steps,
            self.elapsed_s,
            self.tokens_per_sec,
            100.0 * self.mfu,
            self.run_dir.display()
        )
    }
}

/// Everything the loop reads but does not change.
pub(crate) struct Setup {
    pub(crate) config: TrainConfig,
    /// The `init_from` source, opened once for the whole run.
    pub(crate) init: Option<ResolvedInit>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) tokenizer_dir: Option<PathBuf>,
    pub(crate) train: Examples,
    pub(crate) val: Examples,
}

/// Trains (or resumes) the run described by `run` (its `init_from` source already open) in
/// `opts.run_dir`: nanoGPT's loop of step -> record -> maybe evaluate -> maybe checkpoint, its parts
/// below. In a data-parallel run every rank calls this; rank 0 alone writes the run directory.
pub fn train<B: TrainBackend>(
    run: ResolvedConfig,
    opts: &TrainOptions,
    device: &Device<B>,
) -> Result<TrainSummary, TrainError> {
    // A run's config, however it was made: adapters need a pretrained base (only `ember bench
    // train` may put them on a random one).
    run.config.validate_sections().map_err(|error| TrainError::Invalid { path: "config".into(), error })?;
    let setup = prepare(run, &opts.locations)?;
    let (config, c) = (&setup.config, opts.collective.as_ref());
    // Start-up waits for slow work of other ranks (loading a model); steps do not.
    c.set_timeout(config.distributed.io_timeout());
    let (dtype, bf16_gemms) = resolve_dtype::<B>(device, config);
    let (mut model, mut optim, mut state, sinks) = open_run::<B>(&setup, opts, dtype, device)?;
    c.set_timeout(config.distributed.timeout());
    let t = &config.train;
    let schedule = LrSchedule::from_config(config);
    let stop = opts.stop_at.unwrap_or(t.max_steps).min(t.max_steps);
    let stepper = Stepper {
        data: &setup.train,
        sampler: WindowSampler { seed: state.sampler_seed },
        config,
        device,
        collective: c,
        buffers: Default::default(),
        device_comm: opts.device_comm.as_ref(),
    };
    let peak = device_peak::<B>(opts, device, bf16_gemms.peak_gemms(dtype));
    log_setup(config, dtype, &peak, config.tokens_per_step() * c.world());
    log_data_parallel(&stepper, matches!(optim, Optimizer::Sharded(_)));
    let evaluator = Evaluator::new(&setup, c);
    if state.step == 0 {
        evaluator.initial(&model.valid())?;
    }
    let checkpointer = Checkpointer { setup: &setup, run_dir: &opts.run_dir, collective: c };
    let mut rec = Recorder::new(config, opts, peak, &state, sinks);
    let mut last_val = None;
    while state.step < stop {
        let (started, lr) = (Instant::now(), schedule.lr(state.step));
        let epoch_before = evaluator.epoch(state.next_stream);
        let out;
        (model, out) = take_step(&stepper, model, &mut optim, &mut state, lr, &rec.bar)?;
        rec.speed.add(started.elapsed(), rec.tokens_per_step(), &out);
        let (step, epoch) = (state.step, evaluator.epoch(state.next_stream));
        let is_eval = evaluator.due(step, epoch_before, epoch);
        if step % t.log_interval == 0 || is_eval {
            let mut record = rec.step_record(&state, &out, lr, epoch);
            if is_eval {
                let vl = evaluator.record(&model.valid(), &mut record, &mut rec)?;
                state.best_val_loss = Some(state.best_val_loss.map_or(vl, |b: f64| b.min(vl)));
                last_val = Some(vl);
            }
            rec.write(&record)?;
        }
        if checkpointer.due(step, stop) {
            state.elapsed_s = rec.clock.elapsed_s();
            checkpointer.save(&model, &optim, &mut state, &rec.bar)?;
        }
        rec.bar.set_position(step as u64);
    }
    Ok(rec.finish(&opts.run_dir, &state, last_val))
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
    state.step += 1;
    state.next_stream += stepper.micro_batches_per_step();
    state.tokens_seen += (stepper.config.tokens_per_step() * stepper.collective.world()) as u64;
    Ok((model, out))
}

/// The device's peak FLOP/s, for MFU: `--peak-tflops`, the table, or a measured GEMM rate.
fn device_peak<B: TrainBackend>(opts: &TrainOptions, device: &Device<B>, gemms: Gemms) -> Peak {
    let cache = Some(opts.locations.cache_dir.as_path());
    resolve_peak::<B::InnerBackend>(device, opts.device_name.as_deref(), gemms, opts.peak_tflops, cache)
}

type Opened<B> = (Decoder<B>, Optimizer<B>, TrainState, Sinks);

/// The run's model, optimizer, loop state and metric sinks: checked against the device's memory,
/// started or resumed, agreed on by every rank; the run directory's config and tokenizer written.
fn open_run<B: TrainBackend>(
    setup: &Setup,
    opts: &TrainOptions,
    dtype: DType,
    device: &Device<B>,
) -> Result<Opened<B>, TrainError> {
    let (config, run_dir, c) = (&setup.config, &opts.run_dir, opts.collective.as_ref());
    // Before any weight is allocated: a config too big for the device is an error, not an abort.
    check_fits(config, opts.memory_available)?;
    let (model, saved, state) = start::<B>(setup, opts, dtype, device)?;
    check_ranks_agree(c, setup, &model, "start")?;
    let optim = Optimizer::build(config, &model, c, saved, state.optimizer_steps, device)
        .map_err(|message| TrainError::Checkpoint { path: run_dir.clone(), message })?;
    let model = model.with_compute_dtype(dtype);
    if c.rank() != 0 {
        return Ok((model, optim, state, Sinks(Vec::new())));
    }
    std::fs::create_dir_all(run_dir).map_err(TrainError::io(run_dir))?;
    ember_data::write_atomic(&run_dir.join(CONFIG_FILE), config.to_toml().as_bytes())?;
    setup.tokenizer.save(&run_dir.join(TOKENIZER_FILE))?;
    let metrics = open_sinks(config, run_dir, opts.resume.then_some(state.step), state.elapsed_s)?;
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

/// What the loop reports: metrics records (throughput since the last one, MFU against the device's
/// peak, memory, wall time) into the sinks (rank 0's), and the progress bar.
struct Recorder<'a> {
    config: &'a TrainConfig,
    world: usize,
    memory: Option<&'static dyn MemoryProbe>,
    peak: Peak,
    clock: Clock,
    speed: Throughput,
    sinks: Sinks,
    bar: ProgressBar,
}

impl<'a> Recorder<'a> {
    /// Starts the clock (after the time of earlier invocations) and the bar at `state.step`.
    fn new(config: &'a TrainConfig, opts: &TrainOptions, peak: Peak, state: &TrainState, sinks: Sinks) -> Self {
        let c = opts.collective.as_ref();
        Self {
            config,
            world: c.world(),
            memory: opts.memory,
            peak,
            bar: progress_bar(opts.show_progress && c.rank() == 0, config.train.max_steps, state.step),
            clock: Clock { started: Instant::now(), before: state.elapsed_s },
            speed: Throughput::default(),
            sinks,
        }
    }

    /// Tokens of one step over all ranks.
    fn tokens_per_step(&self) -> usize {
        self.config.tokens_per_step() * self.world
    }

    /// The metrics record of the step just taken (evaluation left to the evaluator); starts a new
    /// throughput window.
    fn step_record(&mut self, state: &TrainState, out: &StepOutput, lr: f64, epoch: Option<f64>) -> StepRecord {
        let (config, world, speed) = (self.config, self.world, &self.speed);
        let tokens_per_step = self.tokens_per_step();
        let tokens_per_sec = speed.window_rate();
        let flops_per_token = config.train_flops_per_token();
        let record = StepRecord {
            step: state.step,
            train_loss: out.loss,
            lr,
            grad_norm: out.grad_norm,
            clipped: clip_coefficient(out.grad_norm, config.optim.grad_clip) < 1.0,
            step_ms: speed.window_ms_per_step(tokens_per_step),
            tokens_per_sec,
            mfu: mfu(flops_per_token, tokens_per_sec, &self.peak) / world as f64,
            loss_scale: state.loss_scaler.as_ref().map(|s| s.scale),
            memory_bytes: self.memory.and_then(|m| m.current_bytes()),
            elapsed_s: self.clock.elapsed_s(),
            val_loss: None,
            eval_train_loss: None,
            epoch,
            comm_ms: (world > 1).then(|| speed.per_step_ms(speed.window_comm, tokens_per_step)),
            wait_ms: (world > 1).then(|| speed.per_step_ms(speed.window_wait, tokens_per_step)),
        };
        self.speed.reset_window();
        record
    }

    /// Writes `record` and shows its loss and speed on the bar.
    fn write(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        let mfu = 100.0 * record.mfu;
        let (loss, rate) = (record.train_loss, record.tokens_per_sec);
        self.bar.set_message(format!("loss {loss:.4} · {rate:.0} tok/s · MFU {mfu:.1}%"));
        self.sinks.record(record)
    }

    /// Clears the bar; the summary of this invocation (its training throughput: evaluation and
    /// checkpoints excluded).
    fn finish(self, run_dir: &Path, state: &TrainState, last_val_loss: Option<f64>) -> TrainSummary {
        self.bar.finish_and_clear();
        let tokens_per_sec = self.speed.total_rate();
        let flops_per_token = self.config.train_flops_per_token();
        TrainSummary {
            run_dir: run_dir.to_path_buf(),
            steps: state.step,
            best_val_loss: state.best_val_loss,
            last_val_loss,
            tokens_per_sec,
            mfu: mfu(flops_per_token, tokens_per_sec, &self.peak) / self.world as f64,
            elapsed_s: self.clock.elapsed_s(),
        }
    }
}

/// Checkpoints: the optimizer's moments gathered from every rank, rank 0 writing them with the
/// weights and the loop state, every rank then checking that the weights still agree.
struct Checkpointer<'a> {
    setup: &'a Setup,
    run_dir: &'a Path,
    collective: &'a dyn Collective,
}

impl Checkpointer<'_> {
    /// Whether step `step` ends with a checkpoint: every `checkpoint_interval` steps (0: never)
    /// and at the last step of this invocation, `stop`.
    fn due(&self, step: usize, stop: usize) -> bool {
        let every = self.setup.config.train.checkpoint_interval;
        (every > 0 && step % every == 0) || step == stop
    }

    fn save<B: TrainBackend>(
        &self,
        model: &Decoder<B>,
        optim: &Optimizer<B>,
        state: &mut TrainState,
        bar: &ProgressBar,
    ) -> Result<(), TrainError> {
        let c = self.collective;
        let d = &self.setup.config.distributed;
        state.world_size = c.world();
        // The other ranks wait while rank 0 writes: the longer deadline.
        c.set_timeout(d.io_timeout());
        let optimizer = optim.state_tensors(c)?;
        state.optimizer_steps = optim.steps();
        if c.rank() == 0 {
            let dir = save_checkpoint(self.run_dir, model, optimizer, state, self.setup)?;
            bar.suspend(|| tracing::debug!(dir = %dir.display(), "checkpoint written"));
        }
        check_ranks_agree(c, self.setup, model, &format!("step {}", state.step))?;
        c.set_timeout(d.timeout());
        Ok(())
    }
}

/// In a data-parallel run: every rank runs the same config with the same ember on the same data and
/// holds the same weights (a SHA-256 of each), checked at the start and at every checkpoint.
fn check_ranks_agree<B: TrainBackend>(
    c: &dyn Collective,
    setup: &Setup,
    model: &Decoder<B>,
    at: &str,
) -> Result<(), TrainError> {
    if c.world() == 1 {
        return Ok(());
    }
    if at == "start" {
        let version = crate::distributed::code_version();
        let what = format!("the config and the ember binary ({version})");
        let config = setup.config.to_toml();
        crate::distributed::check_same(c, &digest([config.as_bytes(), version.as_bytes()]), &what)?;
        crate::distributed::check_same(c, &data_digest(setup), "the data (tokenizer, examples, first batch)")?;
    }
    let weights = named_tensors_where(model, |_| true);
    let sum = digest(weights.iter().flat_map(|(k, d)| [k.as_bytes(), d.as_bytes()]));
    crate::distributed::check_same(c, &sum, &format!("the weights at {at}"))?;
    Ok(())
}

/// What the ranks' data must agree on: the tokenizer's vocabulary, the number of training and
/// held-out rows, and the tokens of the first training micro-batch and held-out row.
fn data_digest(setup: &Setup) -> [u8; 32] {
    use burn::data::dataset::Dataset;
    let t = &setup.config.train;
    let first = WindowSampler { seed: t.seed }.windows(setup.train.as_ref(), 0, t.batch_size);
    let mut tokens: Vec<u8> = Vec::new();
    for w in first.iter().chain(setup.val.get(0).as_ref()) {
        tokens.extend(w.input.iter().flat_map(|x| x.to_le_bytes()));
        tokens.extend(w.target.iter().flat_map(|x| x.to_le_bytes()));
    }
    let sizes = [setup.tokenizer.vocab_size() as u64, setup.train.len() as u64, setup.val.len() as u64];
    let sizes: Vec<u8> = sizes.iter().flat_map(|x| x.to_le_bytes()).collect();
    digest([sizes.as_slice(), tokens.as_slice()])
}

/// A fresh run, or the resumed one. Leftovers of killed writers are cleared first (by rank 0), so
/// that what is checked is what resuming reads. A run without a checkpoint (killed before its
/// first) has nothing to resume and nothing to lose: it starts again without --resume. One with a
/// checkpoint is never overwritten.
fn start<B: TrainBackend>(
    setup: &Setup,
    opts: &TrainOptions,
    dtype: DType,
    device: &Device<B>,
) -> Result<Restored<B>, TrainError> {
    let (config, run_dir) = (&setup.config, &opts.run_dir);
    let c = opts.collective.as_ref();
    if c.rank() == 0 {
        checkpoint::tidy_run_dir(run_dir)?;
    }
    // The other ranks read the run directory after rank 0 has tidied it.
    c.arrive(0, "start-up (run directory)")?;
    if opts.resume {
        if run_dir.is_dir() && !checkpoint::has_checkpoint(run_dir) {
            return Err(TrainError::Resume {
                path: run_dir.clone(),
                message: "it has no checkpoint yet (the run stopped before its first one); run without \
                          --resume to restart it from step 0"
                    .into(),
            });
        }
        return resume::<B>(setup, run_dir, c.world(), device);
    }
    if checkpoint::has_checkpoint(run_dir) {
        return Err(TrainError::RunExists { path: run_dir.clone() });
    }
    if c.rank() == 0 {
        checkpoint::set_aside_dead_attempt(run_dir, &[METRICS_FILE, crate::metrics::SAMPLES_FILE])?;
    }
    let model = initial_model::<B>(setup, device)?;
    let mut state = TrainState::new(0, LrSchedule::from_config(config), config.train.seed, 0);
    state.loss_scaler = (dtype == DType::F16).then(LossScaler::default);
    Ok((model, BTreeMap::new(), state))
}

/// Wall time of a run across resumes: `before` seconds of earlier invocations, then this one's.
struct Clock {
    started: Instant,
    before: f64,
}

impl Clock {
    fn elapsed_s(&self) -> f64 {
        self.before + self.started.elapsed().as_secs_f64()
    }
}

/// Time and tokens of training steps (evaluation and checkpoints excluded): since the last record,
/// and over this invocation.
#[derive(Default)]
struct Throughput {
    window: (Duration, usize),
    total: (Duration, usize),
    /// Communication and waiting time since the last record.
    window_comm: Duration,
    window_wait: Duration,
}

impl Throughput {
    fn add(&mut self, dt: Duration, tokens: usize, out: &StepOutput) {
        self.window = (self.window.0 + dt, self.window.1 + tokens);
        self.total = (self.total.0 + dt, self.total.1 + tokens);
        self.window_comm += out.comm;
        self.window_wait += out.wait;
    }

    /// Milliseconds per step of `d`, averaged over the window's steps.
    fn per_step_ms(&self, d: Duration, tokens_per_step: usize) -> f64 {
        d.as_secs_f64() * 1e3 / (self.window.1 / tokens_per_step).max(1) as f64
    }

    fn window_rate(&self) -> f64 {
        self.window.1 as f64 / self.window.0.as_secs_f64().max(1e-9)
    }

    fn window_ms_per_step(&self, tokens_per_step: usize) -> f64 {
        self.per_step_ms(self.window.0, tokens_per_step)
    }

    fn reset_window(&mut self) {
        self.window = (Duration::ZERO, 0);
        self.window_comm = Duration::ZERO;
        self.window_wait = Duration::ZERO;
    }

    fn total_rate(&self) -> f64 {
        self.total.1 as f64 / self.total.0.as_secs_f64().max(1e-9)
    }
}

/// The periodic evaluation: fixed batches of both splits (text), or every held-out example
/// (fine-tuning: the completion loss each has alone under documents packing), and a sample. The
/// batches are shared out over the ranks and their sums added.
struct Evaluator<'a> {
    setup: &'a Setup,
    collective: &'a dyn Collective,
    held_out: bool,
    train_seed: u64,
    val_seed: u64,
}

impl<'a> Evaluator<'a> {
    fn new(setup: &'a Setup, collective: &'a dyn Collective) -> Self {
        let seed = setup.config.train.seed;
        Self {
            setup,
            collective,
            held_out: setup.config.data.format() == DataFormat::Jsonl,
            train_seed: eval_seed(seed, "train"),
            val_seed: eval_seed(seed, "val"),
        }
    }

    fn part(&self) -> Part {
        Part { rank: self.collective.rank(), world: self.collective.world() }
    }

    /// `sum` added over the ranks, as a mean.
    fn reduce(&self, sum: LossSum, what: &str) -> Result<f64, TrainError> {
        let mut v = [sum.weighted, sum.scored];
        self.collective.all_reduce_f64(&mut v, what)?;
        Ok(LossSum { weighted: v[0], scored: v[1] }.mean())
    }

    fn val<IB: ember_model::ops::EmberBackend>(&self, model: &Decoder<IB>) -> Result<f64, TrainError> {
        let t = &self.setup.config.train;
        let sum = if self.held_out {
            evaluate_all_part(model, self.setup.val.as_ref(), t.batch_size, self.part())
        } else {
            evaluate_part(model, self.setup.val.as_ref(), self.val_seed, t.eval_iters, t.batch_size, self.part())
        };
        self.reduce(sum, "evaluation (val)")
    }

    /// The loss before training, beside ln V (what a model that knows nothing scores).
    fn initial<IB: ember_model::ops::EmberBackend>(&self, model: &Decoder<IB>) -> Result<(), TrainError> {
        let val = self.val(model)?;
        let ln_v = (self.setup.config.model.vocab_size as f64).ln();
        tracing::info!("step 0: val loss {val:.4} (ln V = {ln_v:.4})");
        Ok(())
    }

    /// Whether step `step` ends with an evaluation: every `eval_interval` steps, or each time the
    /// run completes an epoch of the (fine-tuning) examples; and at the last step.
    fn due(&self, step: usize, epoch_before: Option<f64>, epoch: Option<f64>) -> bool {
        let t = &self.setup.config.train;
        step == t.max_steps
            || match t.eval_strategy {
                EvalStrategy::Steps => step % t.eval_interval == 0,
                EvalStrategy::Epoch => matches!((epoch_before, epoch), (Some(a), Some(b)) if b.floor() > a.floor()),
            }
    }

    /// Epochs of the training rows drawn before micro-batch `stream` (fine-tuning runs only).
    fn epoch(&self, stream: u64) -> Option<f64> {
        let rows = self.setup.train.len().max(1) as f64;
        self.held_out.then(|| stream as f64 * self.setup.config.train.batch_size as f64 / rows)
    }

    /// Evaluates both splits into `record`, logs them, writes a sample (rank 0); returns the val loss.
    fn record<IB: ember_model::ops::EmberBackend>(
        &self,
        model: &Decoder<IB>,
        record: &mut StepRecord,
        rec: &mut Recorder<'_>,
    ) -> Result<f64, TrainError> {
        let (config, step) = (&self.setup.config, record.step);
        let t = &config.train;
        let part =
            evaluate_part(model, self.setup.train.as_ref(), self.train_seed, t.eval_iters, t.batch_size, self.part());
        let tl = self.reduce(part, "evaluation (train)")?;
        let vl = self.val(model)?;
        (record.eval_train_loss, record.val_loss) = (Some(tl), Some(vl));
        if self.collective.rank() != 0 {
            return Ok(vl);
        }
        let memory =
            record.memory_bytes.map_or(String::new(), |m| format!(", memory in use {}", crate::memory::gib(m)));
        rec.bar.suspend(|| tracing::info!("step {step}: train loss {tl:.4}, val loss {vl:.4}{memory}"));
        if let Some(text) = sample_text(model, &self.setup.tokenizer, &config.metrics, t.seed ^ step as u64) {
            let prompt = config.metrics.sample_prompt.clone();
            rec.sinks.sample(&SampleRecord { step, elapsed_s: rec.clock.elapsed_s(), prompt, text })?;
        }
        Ok(vl)
    }
}

/// Saves the run at `state.step` (a LoRA run its adapters only: the frozen base is not even read
/// back), keeping the newest `train.keep_checkpoints`.
fn save_checkpoint<B: TrainBackend>(
    run_dir: &Path,
    model: &Decoder<B>,
    optimizer: Vec<(String, TensorData)>,
    state: &TrainState,
    setup: &Setup,
) -> Result<PathBuf, TrainError> {
    let config = &setup.config;
    let lora = config.lora.is_some();
    let data = CheckpointData {
        step: state.step,
        model_config: model.config(),
        weights: named_tensors_where(model, |k| !lora || k.contains(".lora.")),
        adapters_only: lora,
        tokenizer: &setup.tokenizer,
        tokenizer_dir: setup.tokenizer_dir.as_deref(),
        hf_config: setup.init.as_ref().and_then(|i| i.hf_config.as_ref()),
        training: Some(TrainingData { optimizer, state, config }),
    };
    checkpoint::save(run_dir, data, config.train.keep_checkpoints)
}

/// Fails before the model is built when the estimated memory of the run exceeds what the device has.
fn check_fits(config: &TrainConfig, available: Option<u64>) -> Result<(), TrainError> {
    let e = crate::memory::estimate(config, trainable_params(config));
    let terms = e.terms.iter().map(|(k, v)| format!("{k} {}", crate::memory::gib(*v))).collect::<Vec<_>>().join(", ");
    tracing::info!("estimated training memory {} ({terms})", crate::memory::gib(e.total));
    match available {
        Some(have) if e.total > have => {
            Err(TrainError::DoesNotFit { need: crate::memory::gib(e.total), have: crate::memory::gib(have), terms })
        }
        _ => Ok(()),
    }
}

/// Parameters that receive gradients, from the config alone: all of them, or the LoRA adapters
/// (`r·(d_in + d_out)` per adapted projection and layer).
fn trainable_params(config: &TrainConfig) -> u64 {
    let m = &config.model;
    let Some(lora) = &config.lora else { return m.num_params() };
    let (d, f) = (m.d_model as u64, m.d_ff as u64);
    let (q, kv) = ((m.n_heads * m.head_dim()) as u64, (m.n_kv_heads() * m.head_dim()) as u64);
    let per_layer: u64 = lora
        .targets
        .iter()
        .map(|t| match t.as_str() {
            "q_proj" => d + q,
            "k_proj" | "v_proj" => d + kv,
            "o_proj" => q + d,
            "gate_proj" | "up_proj" | "down_proj" => d + f,
            _ => 0,
        })
        .sum();
    lora.rank as u64 * per_layer * m.n_layers as u64
}

fn open_sinks(
    config: &TrainConfig,
    run_dir: &Path,
    resumed_at: Option<usize>,
    elapsed: f64,
) -> Result<Sinks, TrainError> {
    let mut sinks: Vec<Box<dyn MetricsSink>> = Vec::new();
    for kind in &config.metrics.sinks {
        sinks.push(match kind {
            SinkKind::Jsonl => Box::new(JsonlSink::open(run_dir, resumed_at)?),
            SinkKind::Tensorboard => Box::new(TensorBoardSink::create(run_dir, resumed_at, elapsed)?),
        });
    }
    Ok(Sinks(sinks))
}

/// Text generated from the configured prompt (temperature 0.8, top-k 200) through the KV cache;
/// `None` when sampling is off or the prompt cannot be encoded.
fn sample_text<B: ember_model::ops::EmberBackend>(
    model: &Decoder<B>,
    tokenizer: &Tokenizer,
    config: &MetricsConfig,
    seed: u64,
) -> Option<String> {
    use ember_model::sample::{generate_batch, GenerateOptions, Sampler, SamplingConfig};
    if config.sample_tokens == 0 {
        return None;
    }
    let prompt = match tokenizer.encode(&config.sample_prompt) {
        Ok(p) if !p.is_empty() => p,
        _ => {
            tracing::warn!("metrics.sample_prompt {:?} does not encode; no samples", config.sample_prompt);
            return None;
        }
    };
    let mut sampler = [Sampler::new(SamplingConfig::default(), seed).ok()?];
    let options = GenerateOptions {
        max_new_tokens: config.sample_tokens,
        stop_tokens: tokenizer.eos_id().into_iter().collect(),
        block_size: 16,
    };
    let prompt = prompt[prompt.len().saturating_sub(model.config().max_seq_len)..].to_vec();
    // A sample is a nicety of the evaluation: whatever goes wrong (a prompt id past the model's
    // vocabulary, a decoder that fails), the run goes on without it, and nothing here panics.
    let ids = match generate_batch(model, std::slice::from_ref(&prompt), &options, &mut sampler, |_, _| true) {
        Ok(mut ids) => ids.remove(0),
        Err(e) => {
            tracing::warn!("no evaluation sample: {e}");
            return None;
        }
    };
    // Decoded as `ember sample` streams it: after the prompt (so SentencePiece's leading-space strip
    // does not eat the first new space), up to the end-of-text token, special tokens left out, in
    // O(1) work per token.
    let eos = tokenizer.eos_id();
    let decode = || -> Result<String, ember_data::DataError> {
        let mut stream = tokenizer.decode_stream(&prompt);
        let mut text = String::new();
        for &id in ids.iter().take_while(|&&id| Some(id) != eos) {
            text.push_str(&stream.step(id)?);
        }
        text.push_str(&stream.finish()?);
        Ok(text)
    };
    match decode() {
        Ok(text) => Some(text),
        Err(e) => {
            tracing::warn!("no evaluation sample: {e}");
            None
        }
    }
}

/// The CPU's bf16 GEMMs, switched on for one run (`--precision bf16` on a CPU with AVX512_BF16) and
/// off again when the run ends. The switch is process-wide: one such run at a time.
#[must_use = "the switch goes off when this is dropped"]
pub(crate) struct CpuBf16Gemms {
    on: bool,
}

impl CpuBf16Gemms {
    /// The GEMMs a run's MFU is measured against: the bf16 kernel's while it is on.
    pub(crate) fn peak_gemms(&self, dtype: DType) -> Gemms {
        if self.on {
            Gemms::CpuBf16
        } else {
            Gemms::Backend(dtype)
        }
    }
}

impl Drop for CpuBf16Gemms {
    fn drop(&mut self) {
        if self.on {
            ember_model::ops::kernels::set_bf16_gemms(false);
        }
    }
}

/// The GEMM dtype for the config's precision on this device, said out loud when it differs, and the
/// CPU's bf16 GEMMs for the run's lifetime where they apply.
pub(crate) fn resolve_dtype<B: TrainBackend>(device: &Device<B>, config: &TrainConfig) -> (DType, CpuBf16Gemms) {
    let (dtype, note) = compute_dtype::<B>(device, config.train.precision);
    if let Some(note) = note {
        tracing::warn!("{note}");
    }
    let cpu_bf16 = dtype == DType::F32 && config.train.precision == Precision::Bf16 && B::cpu_bf16_gemms();
    let on = cpu_bf16 && ember_model::ops::kernels::set_bf16_gemms(true);
    (dtype, CpuBf16Gemms { on })
}

fn log_setup(config: &TrainConfig, dtype: DType, peak: &Peak, tokens_per_step: usize) {
    let m = &config.model;
    tracing::info!(
        "model: {} layers, d_model {}, {} heads ({} kv), d_ff {}, vocab {}: {} parameters; {tokens_per_step} tokens per step; GEMMs in {dtype:?}",
        m.n_layers,
        m.d_model,
        m.n_heads,
        m.n_kv_heads(),
        m.d_ff,
        m.vocab_size,
        m.num_params()
    );
    let formula = if config.lora.is_some() {
        "4N + 6·L·Σ r·(in + out) + 12·L·T·d, LoRA on a frozen base"
    } else {
        "6N + 12·L·T·d"
    };
    tracing::info!(
        "MFU = ({formula}) · tokens/s / peak, N = {} matmul parameters, L = {}, T = {}, d = {}: {:.4e} FLOPs per token; peak {:.3} TFLOP/s ({})",
        m.matmul_params(),
        m.n_layers,
        config.seq_len(),
        m.n_heads * m.head_dim(),
        config.train_flops_per_token(),
        peak.flops / 1e12,
        peak.source
    );
}

/// Finds the data, fills in the vocabulary size and checks that both splits hold a window.
pub(crate) fn prepare(run: ResolvedConfig, locations: &Locations) -> Result<Setup, TrainError> {
    let ResolvedConfig { mut config, init } = run;
    config.absolutize_paths();
    let data = crate::data::load(&config, init.as_ref(), locations)?;
    let vocab = data.tokenizer.vocab_size();
    if config.model.vocab_size == 0 {
        config.model.vocab_size = vocab;
    } else if config.model.vocab_size < vocab {
        return Err(TrainError::VocabTooSmall { config: config.model.vocab_size, tokenizer: vocab });
    }
    config.model.validate()?;
    Ok(Setup {
        config,
        init,
        tokenizer: data.tokenizer,
        tokenizer_dir: data.tokenizer_dir,
        train: data.train,
        val: data.val,
    })
}

/// The model a fresh run starts from: random weights, or `init_from`'s (with LoRA adapters when
/// configured, everything else frozen).
pub(crate) fn initial_model<B: TrainBackend>(setup: &Setup, device: &Device<B>) -> Result<Decoder<B>, TrainError> {
    let config = &setup.config;
    let Some(init) = &setup.init else {
        let model = Decoder::<B>::new(&config.model, config.train.seed, device)?;
        // Adapters on a random base: only a benchmark's config gets here (a run's needs init_from).
        return Ok(match &config.lora {
            Some(lora) => model.with_lora(lora, config.train.seed),
            None => model,
        });
    };
    let model = init.load::<B>(device)?;
    if model.config() != &config.model {
        return Err(init
            .source
            .err("its architecture differs from the config's [model]; leave [model] out to take the model's"));
    }
    B::seed(device, config.train.seed);
    Ok(match &config.lora {
        Some(lora) => model.with_lora(lora, config.train.seed),
        None => model,
    })
}

/// The model, its optimizer moments by parameter path (none before the first step) and the loop state.
type Restored<B> = (Decoder<B>, BTreeMap<String, TensorData>, TrainState);

/// Model, optimizer moments and loop state from the run's latest checkpoint, after checking that the
/// config describes the same run. The world size may change: `grad_accum_steps × ranks` (the
/// micro-batches of a step) must stay the same.
fn resume<B: TrainBackend>(
    setup: &Setup,
    run_dir: &Path,
    world: usize,
    device: &Device<B>,
) -> Result<Restored<B>, TrainError> {
    let ckpt = Checkpoint::open(run_dir)?;
    let (Some(theirs), Some(state)) = (ckpt.config.clone(), ckpt.state.clone()) else {
        return Err(TrainError::Resume {
            path: ckpt.dir.clone(),
            message: "not a training checkpoint (an import?): start a run from it with init_from = \"run:DIR\"".into(),
        });
    };
    let (ours, theirs) = (&setup.config, &theirs);
    let same_run = [
        ("model", ours.model == theirs.model),
        ("data", ours.data == theirs.data),
        ("optim", ours.optim == theirs.optim),
        ("schedule", ours.schedule == theirs.schedule),
        ("lora", ours.lora == theirs.lora),
        ("init_from", ours.init_from == theirs.init_from),
        (
            "train (batch_size, seq_len, seed, precision)",
            (ours.train.batch_size, ours.seq_len(), ours.train.seed, ours.train.precision)
                == (theirs.train.batch_size, theirs.seq_len(), theirs.train.seed, theirs.train.precision),
        ),
    ];
    if let Some((section, _)) = same_run.iter().find(|(_, same)| !same) {
        return Err(TrainError::Resume {
            path: ckpt.dir.clone(),
            message: format!(
                "the config's [{section}] differs from the checkpoint's; resume with the run's config.toml"
            ),
        });
    }
    let (ours_mb, theirs_mb) = (ours.train.grad_accum_steps * world, theirs.train.grad_accum_steps * state.world_size);
    if ours_mb != theirs_mb {
        return Err(TrainError::Resume {
            path: ckpt.dir.clone(),
            message: format!(
                "the checkpoint's steps drew {theirs_mb} micro-batches (train.grad_accum_steps {} × {} rank(s)), this \
                 run's would draw {ours_mb} (train.grad_accum_steps {} × {world} rank(s)); set train.grad_accum_steps \
                 so that the two products match",
                theirs.train.grad_accum_steps, state.world_size, ours.train.grad_accum_steps
            ),
        });
    }
    // A LoRA run's base comes from the run's own `init_from` source, the same as the checkpoint's.
    let model = ckpt.decoder_over::<B>(setup.init.as_ref(), device)?;
    let moments = ckpt.optimizer_tensors()?;
    tracing::info!(step = state.step, dir = %ckpt.dir.display(), "resuming");
    Ok((model, moments, state))
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
    use super::*;
    use crate::eval::lm_loss;
    use crate::step::{forward_backward, total_scored};
    use burn::backend::{Autodiff, Flex};
    use burn::data::dataloader::batcher::Batcher;
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::optim::GradientsParams;
    use burn::tensor::{ElementConversion, Int, Tensor};
    use ember_data::finetune::{Example, PackedExamples, Packing};
    use ember_data::{LmBatch, LmBatcher, Window};
    use ember_model::{Documents, ModelConfig};

    type AB = Autodiff<Flex>;

    fn config(vocab: usize, max_seq_len: usize) -> ModelConfig {
        ModelConfig { init_std: 0.2, ..ModelConfig::tiny(vocab, max_seq_len) }
    }

    /// Every gradient of the model, flattened in parameter order.
    fn flat_grads(model: &Decoder<AB>, grads: &GradientsParams) -> Vec<f64> {
        struct Collect<'a>(&'a GradientsParams, Vec<f64>);
        impl ModuleVisitor<AB> for Collect<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
                let g = self.0.get::<Flex, D>(p.id).expect("every parameter has a gradient");
                self.1.extend(g.into_data().convert::<f64>().to_vec::<f64>().unwrap());
            }
        }
        let mut c = Collect(grads, Vec::new());
        model.visit(&mut c);
        c.1
    }

    fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
        let diff: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        let norm: f64 = b.iter().map(|y| y * y).sum();
        (diff / norm).sqrt()
    }

    /// 8 windows of 12 positions whose masks score between 1 and 12 targets.
    fn uneven_windows(vocab: u32) -> Vec<Window> {
        (0..8u32)
            .map(|r| {
                let input: Vec<u32> = (0..12).map(|i| (r * 7 + i * 5 + 1) % vocab).collect();
                let scored = [1, 12, 2, 9, 3, 3, 11, 1][r as usize];
                let target =
                    (0..12).map(|i| if i >= 12 - scored { ((r + i * 3) % vocab) as i32 } else { -1 }).collect();
                Window { input, target, docs: None }
            })
            .collect()
    }

    #[test]
    fn accumulated_micro_batches_give_the_loss_and_gradients_of_one_batch() {
        let dev = Default::default();
        let model = Decoder::<AB>::new(&config(29, 16), 3, &dev).unwrap();
        let windows = uneven_windows(29);
        let run = |per_micro: usize| {
            let micro: Vec<Vec<Window>> = windows.chunks(per_micro).map(<[Window]>::to_vec).collect();
            let total = total_scored(&micro);
            let (loss, grads) = forward_backward(&model, micro, total, &dev, 1.0);
            (loss, flat_grads(&model, &grads))
        };
        let (loss8, grads8) = run(8);
        for per_micro in [4, 2] {
            let (loss, grads) = run(per_micro);
            let rel = ((loss - loss8) / loss8).abs();
            assert!(rel < 1e-6, "batch {per_micro} x {}: loss {loss} vs {loss8} (rel {rel:e})", 8 / per_micro);
            let rel = rel_l2(&grads, &grads8);
            assert!(rel < 1e-6, "batch {per_micro} x {}: gradients differ (rel {rel:e})", 8 / per_micro);
        }
        // The mean of per-micro-batch means is a different objective on these masks.
        let means: Vec<f64> = windows
            .chunks(2)
            .map(|w| {
                let batch: LmBatch<Flex> = LmBatcher.batch(w.to_vec(), &dev);
                lm_loss(&model.valid(), batch).into_scalar().elem::<f64>()
            })
            .collect();
        let mean_of_means = means.iter().sum::<f64>() / means.len() as f64;
        assert!((mean_of_means - loss8).abs() > 1e-3, "the test masks must make the two objectives differ");
    }

    fn example(ids: &[u32], prompt: usize) -> Example {
        Example { ids: ids.to_vec(), scored: (0..ids.len()).map(|i| i >= prompt).collect() }
    }

    /// Mean loss and scored-target count of rows, through the training objective.
    fn loss_of(model: &Decoder<Flex>, rows: &PackedExamples) -> (f64, usize) {
        use burn::data::dataset::Dataset;
        let items: Vec<Window> = (0..rows.len()).map(|i| rows.get(i).unwrap()).collect();
        let batch: LmBatch<Flex> = LmBatcher.batch(items, &Default::default());
        let n = batch.scored;
        (lm_loss(model, batch).into_scalar().elem::<f64>(), n)
    }

    #[test]
    fn a_packed_document_scores_as_it_does_alone() {
        let dev = Default::default();
        let model = Decoder::<Flex>::new(&config(31, 32), 5, &dev).unwrap();
        let examples = [
            example(&[1, 4, 9, 16, 25, 5], 2),
            example(&[3, 1, 4, 1, 5, 9, 2, 6], 3),
            example(&[2, 7, 1, 8, 2], 1),
            example(&[30, 29, 28, 27], 0),
        ];
        let pack = |ex: &[Example], packing| PackedExamples::new(ex, 24, 0, packing, false).unwrap();
        let packed = pack(&examples, Packing::Documents);
        assert_eq!(burn::data::dataset::Dataset::len(&packed), 1, "all four examples fit one row");
        let (loss, n) = loss_of(&model, &packed);
        let alone: Vec<(f64, usize)> =
            examples.iter().map(|e| loss_of(&model, &pack(std::slice::from_ref(e), Packing::None))).collect();
        let want =
            alone.iter().map(|(l, n)| l * *n as f64).sum::<f64>() / alone.iter().map(|(_, n)| *n as f64).sum::<f64>();
        assert_eq!(n, alone.iter().map(|(_, n)| n).sum::<usize>());
        assert!((loss - want).abs() < 1e-5, "packed {loss} vs alone {want}");
        // Stream packing lets the examples see each other: a different loss.
        let (stream, _) = loss_of(&model, &pack(&examples, Packing::Stream));
        assert!((stream - want).abs() > 1e-4, "stream packing {stream} should differ from {want}");
    }

    #[test]
    fn an_examples_logits_do_not_depend_on_what_is_packed_before_it() {
        let dev = Default::default();
        let model = Decoder::<Flex>::new(&config(31, 32), 6, &dev).unwrap();
        let target = [11u32, 3, 17, 5, 23, 2];
        // The same example after a 4-token and after a 9-token neighbour, and alone at position 0.
        let rows: [(Vec<u32>, Vec<usize>); 3] = [
            ([vec![1, 2, 3, 4], target.to_vec()].concat(), vec![4, 6]),
            ([vec![9, 8, 7, 6, 5, 4, 3, 2, 1], target.to_vec()].concat(), vec![9, 6]),
            (target.to_vec(), vec![6]),
        ];
        let hidden_of = |(ids, lens): &(Vec<u32>, Vec<usize>), docs: bool| {
            let t = ids.len();
            let tokens = Tensor::<Flex, 2, Int>::from_data(
                TensorData::new(ids.iter().map(|&x| x as i32).collect::<Vec<_>>(), [1, t]),
                &dev,
            );
            let d = Documents::from_lengths(&[lens.clone()], t).unwrap();
            let h = model.hidden_documents(tokens, 0, docs.then_some(&d)); // [1, T, D]
            let logits = model.logits(h.narrow(1, t - 6, 6).reshape([6, 32]));
            logits.into_data().to_vec::<f32>().unwrap()
        };
        let alone = hidden_of(&rows[2], true);
        for row in &rows[..2] {
            let got = hidden_of(row, true);
            let err = got.iter().zip(&alone).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err < 1e-5, "logits moved by {err} with a neighbour packed before");
            // Without documents the neighbour and the shifted positions change them.
            let crossed = hidden_of(row, false);
            let err = crossed.iter().zip(&alone).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err > 1e-3, "without documents the logits should depend on the neighbour ({err})");
        }
    }
}
