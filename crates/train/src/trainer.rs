//! The training loop, nanoGPT's `while True:` in Burn: LR -> micro-batches (forward, backward,
//! accumulate) -> global-norm clip -> AdamW -> log -> maybe evaluate / checkpoint -> stop.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Device, ElementConversion, Tensor};
use ember_data::fetch::Locations;
use ember_data::{Examples, Tokenizer, WindowSampler};
use ember_model::ops::TrainBackend;
use ember_model::weights::named_tensors_where;
use ember_model::Decoder;
use indicatif::{ProgressBar, ProgressStyle};

use crate::bench::MemoryProbe;
use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainState, TrainingData, CONFIG_FILE, TOKENIZER_FILE};
use crate::config::TrainConfig;
use crate::config::{MetricsConfig, SinkKind};
use crate::error::TrainError;
use crate::eval::{eval_seed, evaluate, lm_loss};
use crate::flops::{mfu, resolve_peak, Peak};
use crate::init::InitSource;
use crate::metrics::{JsonlSink, MetricsSink, SampleRecord, Sinks, StepRecord, TensorBoardSink, METRICS_FILE};
use crate::optim::{clip_coefficient, global_grad_norm, AdamW};
use crate::precision::{compute_dtype, LossScaler};
use crate::schedule::LrSchedule;

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

/// Everything the loop reads but does not change.
pub(crate) struct Setup {
    pub(crate) config: TrainConfig,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) tokenizer_dir: Option<PathBuf>,
    pub(crate) hf_config: Option<serde_json::Value>,
    pub(crate) train: Examples,
    pub(crate) val: Examples,
}

/// Trains (or resumes) the run described by `config` in `opts.run_dir`.
pub fn train<B: TrainBackend>(
    config: TrainConfig,
    opts: &TrainOptions,
    device: &Device<B>,
) -> Result<TrainSummary, TrainError> {
    let setup = prepare(config, &opts.locations)?;
    let config = &setup.config;
    let run_dir = &opts.run_dir;
    let schedule = LrSchedule::from_config(config);
    let dtype = resolve_dtype::<B>(device, config);

    let (model, mut optim, mut state) = if opts.resume {
        resume::<B>(&setup, run_dir, device)?
    } else {
        if run_dir.join(checkpoint::CHECKPOINTS).join(checkpoint::LATEST).exists()
            || std::fs::metadata(run_dir.join(METRICS_FILE)).is_ok_and(|m| m.len() > 0)
        {
            return Err(TrainError::RunExists { path: run_dir.clone() });
        }
        let model = initial_model::<B>(config, device)?;
        let mut state = TrainState::new(0, schedule, config.train.seed, 0);
        state.loss_scaler = (dtype == DType::F16).then(LossScaler::default);
        (model, AdamW::<B>::new(config.optim.clone()), state)
    };
    let mut model = model.with_compute_dtype(dtype);
    check_fits(config, &model, opts.memory_available)?;
    std::fs::create_dir_all(run_dir).map_err(TrainError::io(run_dir))?;
    ember_data::write_atomic(&run_dir.join(CONFIG_FILE), config.to_toml().as_bytes())?;
    setup.tokenizer.save(&run_dir.join(TOKENIZER_FILE))?;
    let mut metrics = open_sinks(config, run_dir, opts.resume.then_some(state.step), state.elapsed_s)?;

    let t = &config.train;
    let max_steps = t.max_steps;
    let stop = opts.stop_at.unwrap_or(max_steps).min(max_steps);
    let tokens_per_step = config.tokens_per_step();
    let sampler = WindowSampler { seed: state.sampler_seed };
    let (train_seed, val_seed) = (eval_seed(t.seed, "train"), eval_seed(t.seed, "val"));
    let peak_cache = opts.locations.cache_dir.clone();
    let peak = resolve_peak::<B::InnerBackend>(
        device,
        opts.device_name.as_deref(),
        dtype,
        opts.peak_tflops,
        Some(&peak_cache),
    );
    let flops_per_token = config.model.train_flops_per_token(config.seq_len());
    log_setup(config, dtype, &peak, tokens_per_step);
    if state.step == 0 {
        let val = evaluate(&model.valid(), setup.val.as_ref(), val_seed, t.eval_iters, t.batch_size);
        tracing::info!("step 0: val loss {val:.4} (ln V = {:.4})", (config.model.vocab_size as f64).ln());
    }

    let bar = progress_bar(opts.show_progress, max_steps, state.step);
    let started = Instant::now();
    let elapsed_before = state.elapsed_s;
    let (mut window_time, mut window_tokens) = (Duration::ZERO, 0usize);
    let (mut run_time, mut run_tokens) = (Duration::ZERO, 0usize);
    let mut last_val = None;

    while state.step < stop {
        let step_start = Instant::now();
        let lr = schedule.lr(state.step);
        let out;
        (model, out) = optimizer_step(
            model,
            &mut optim,
            &setup.train,
            &sampler,
            state.next_stream,
            lr,
            config,
            device,
            state.loss_scaler.as_mut(),
        );
        if !out.loss.is_finite() {
            return Err(TrainError::Diverged { step: state.step, loss: out.loss });
        }
        if out.skipped {
            bar.suspend(|| tracing::warn!("step {}: gradients overflowed in f16, step skipped", state.step + 1));
        }
        state.step += 1;
        state.next_stream += t.grad_accum_steps as u64;
        state.tokens_seen += tokens_per_step as u64;
        let dt = step_start.elapsed();
        (window_time, window_tokens) = (window_time + dt, window_tokens + tokens_per_step);
        (run_time, run_tokens) = (run_time + dt, run_tokens + tokens_per_step);

        let step = state.step;
        let is_eval = step % t.eval_interval == 0 || step == max_steps;
        if step % t.log_interval == 0 || is_eval {
            // Averaged over the steps since the last record, evaluation and checkpoint time excluded.
            let tokens_per_sec = window_tokens as f64 / window_time.as_secs_f64().max(1e-9);
            let step_mfu = mfu(flops_per_token, tokens_per_sec, &peak);
            let mut record = StepRecord {
                step,
                train_loss: out.loss,
                lr,
                grad_norm: out.grad_norm,
                clipped: clip_coefficient(out.grad_norm, config.optim.grad_clip) < 1.0,
                step_ms: window_time.as_secs_f64() * 1e3 / (window_tokens / tokens_per_step).max(1) as f64,
                tokens_per_sec,
                mfu: step_mfu,
                // Burn's balanced checkpointing recomputes only memory-bound (elementwise) ops, whose
                // FLOPs the model count leaves out: the hardware does the same matmul FLOPs.
                hfu: t.activation_checkpointing.then_some(step_mfu),
                loss_scale: state.loss_scaler.as_ref().map(|s| s.scale),
                memory_bytes: opts.memory.and_then(|m| m.current_bytes()),
                elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
                val_loss: None,
                eval_train_loss: None,
            };
            (window_time, window_tokens) = (Duration::ZERO, 0);
            if is_eval {
                let inner = model.valid();
                let tl = evaluate(&inner, setup.train.as_ref(), train_seed, t.eval_iters, t.batch_size);
                let vl = evaluate(&inner, setup.val.as_ref(), val_seed, t.eval_iters, t.batch_size);
                (record.eval_train_loss, record.val_loss) = (Some(tl), Some(vl));
                state.best_val_loss = Some(state.best_val_loss.map_or(vl, |b: f64| b.min(vl)));
                last_val = Some(vl);
                let memory =
                    record.memory_bytes.map_or(String::new(), |m| format!(", memory in use {}", crate::memory::gib(m)));
                bar.suspend(|| tracing::info!("step {step}: train loss {tl:.4}, val loss {vl:.4}{memory}"));
                if let Some(sample) = sample_text(&inner, &setup.tokenizer, &config.metrics, t.seed ^ step as u64) {
                    let elapsed_s = elapsed_before + started.elapsed().as_secs_f64();
                    metrics.sample(&SampleRecord {
                        step,
                        elapsed_s,
                        prompt: config.metrics.sample_prompt.clone(),
                        text: sample,
                    })?;
                }
            }
            bar.set_message(format!(
                "loss {:.4} · {:.0} tok/s · MFU {:.1}%",
                out.loss,
                record.tokens_per_sec,
                100.0 * record.mfu
            ));
            metrics.record(&record)?;
        }
        let periodic = t.checkpoint_interval > 0 && step % t.checkpoint_interval == 0;
        if periodic || step == stop {
            state.elapsed_s = elapsed_before + started.elapsed().as_secs_f64();
            state.optimizer_steps = optim.steps();
            let lora = config.lora.is_some();
            // A LoRA run saves its adapters only; the frozen base is not even read back.
            let weights = named_tensors_where(&model, |k| !lora || k.contains(".lora."));
            let data = CheckpointData {
                step,
                model_config: model.config(),
                weights,
                adapters_only: lora,
                tokenizer: &setup.tokenizer,
                tokenizer_dir: setup.tokenizer_dir.as_deref(),
                hf_config: setup.hf_config.as_ref(),
                training: Some(TrainingData { optimizer: optim.state_tensors(), state: &state, config }),
            };
            let dir = checkpoint::save(run_dir, data, t.keep_checkpoints)?;
            bar.suspend(|| tracing::debug!(dir = %dir.display(), "checkpoint written"));
        }
        bar.set_position(step as u64);
    }
    bar.finish_and_clear();
    let tokens_per_sec = run_tokens as f64 / run_time.as_secs_f64().max(1e-9);
    Ok(TrainSummary {
        run_dir: run_dir.clone(),
        steps: state.step,
        best_val_loss: state.best_val_loss,
        last_val_loss: last_val,
        tokens_per_sec,
        mfu: mfu(flops_per_token, tokens_per_sec, &peak),
        elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
    })
}

/// Fails before the first step when the estimated memory of the run exceeds what the device has.
fn check_fits<B: TrainBackend>(
    config: &TrainConfig,
    model: &Decoder<B>,
    available: Option<u64>,
) -> Result<(), TrainError> {
    let trainable = trainable_params(model);
    let e = crate::memory::estimate(config, trainable);
    let terms = e.terms.iter().map(|(k, v)| format!("{k} {}", crate::memory::gib(*v))).collect::<Vec<_>>().join(", ");
    tracing::info!("estimated training memory {} ({terms})", crate::memory::gib(e.total));
    match available {
        Some(have) if e.total > have => {
            Err(TrainError::DoesNotFit { need: crate::memory::gib(e.total), have: crate::memory::gib(have), terms })
        }
        _ => Ok(()),
    }
}

/// Parameters that receive gradients (all of them, or the LoRA adapters).
fn trainable_params<B: TrainBackend>(model: &Decoder<B>) -> u64 {
    struct Count(u64);
    impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<burn::tensor::Tensor<B, D>>) {
            if p.val().is_require_grad() {
                self.0 += p.shape().num_elements() as u64;
            }
        }
    }
    let mut c = Count(0);
    burn::module::Module::visit(model, &mut c);
    c.0
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
    let mut sampler = [Sampler::new(SamplingConfig::default(), seed).expect("default sampling settings are valid")];
    let options = GenerateOptions {
        max_new_tokens: config.sample_tokens,
        stop_tokens: tokenizer.eos_id().into_iter().collect(),
        block_size: 16,
    };
    let prompt = prompt[prompt.len().saturating_sub(model.config().max_seq_len)..].to_vec();
    let ids = generate_batch(model, &[prompt], &options, &mut sampler, |_, _| true).ok()?.remove(0);
    tokenizer.decode(&ids).ok()
}

/// The GEMM dtype for the config's precision on this device, said out loud when it differs.
pub(crate) fn resolve_dtype<B: TrainBackend>(device: &Device<B>, config: &TrainConfig) -> DType {
    let (dtype, note) = compute_dtype::<B>(device, config.train.precision);
    if let Some(note) = note {
        tracing::warn!("{note}");
    }
    dtype
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
    tracing::info!(
        "MFU = (6N + 12·L·T·d) · tokens/s / peak, N = {} matmul parameters, L = {}, T = {}, d = {}: {:.4e} FLOPs per token; peak {:.3} TFLOP/s ({})",
        m.matmul_params(),
        m.n_layers,
        config.seq_len(),
        m.n_heads * m.head_dim(),
        m.train_flops_per_token(config.seq_len()),
        peak.flops / 1e12,
        peak.source
    );
}

/// Finds the data, fills in the vocabulary size and checks that both splits hold a window.
pub(crate) fn prepare(mut config: TrainConfig, locations: &Locations) -> Result<Setup, TrainError> {
    config.absolutize_paths();
    let data = crate::data::load(&config, locations)?;
    let vocab = data.tokenizer.vocab_size();
    if config.model.vocab_size == 0 {
        config.model.vocab_size = vocab;
    } else if config.model.vocab_size < vocab {
        return Err(TrainError::VocabTooSmall { config: config.model.vocab_size, tokenizer: vocab });
    }
    config.model.validate()?;
    let hf_config = match &config.init_from {
        Some(spec) => InitSource::parse(spec)?.hf_config(),
        None => None,
    };
    Ok(Setup {
        config,
        tokenizer: data.tokenizer,
        tokenizer_dir: data.tokenizer_dir,
        hf_config,
        train: data.train,
        val: data.val,
    })
}

/// The model a fresh run starts from: random weights, or `init_from`'s (with LoRA adapters when
/// configured, everything else frozen).
pub(crate) fn initial_model<B: TrainBackend>(
    config: &TrainConfig,
    device: &Device<B>,
) -> Result<Decoder<B>, TrainError> {
    let Some(spec) = &config.init_from else {
        return Ok(Decoder::<B>::new(&config.model, config.train.seed, device)?);
    };
    let source = InitSource::parse(spec)?;
    let model = source.load::<B>(device)?;
    if model.config() != &config.model {
        return Err(TrainError::InitFrom {
            spec: spec.clone(),
            message: "its architecture differs from the config's [model]; leave [model] out to take the model's".into(),
        });
    }
    B::seed(device, config.train.seed);
    Ok(match &config.lora {
        Some(lora) => model.with_lora(lora, config.train.seed),
        None => model,
    })
}

type Restored<B> = (Decoder<B>, AdamW<B>, TrainState);

/// Model, optimizer and loop state from the run's latest checkpoint, after checking that the
/// config describes the same run.
fn resume<B: TrainBackend>(setup: &Setup, run_dir: &Path, device: &Device<B>) -> Result<Restored<B>, TrainError> {
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
            "train (batch_size, seq_len, grad_accum_steps, seed, precision)",
            (ours.train.batch_size, ours.seq_len(), ours.train.grad_accum_steps, ours.train.seed, ours.train.precision)
                == (
                    theirs.train.batch_size,
                    theirs.seq_len(),
                    theirs.train.grad_accum_steps,
                    theirs.train.seed,
                    theirs.train.precision,
                ),
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
    let model = ckpt.decoder::<B>(device)?;
    let mut optim = AdamW::<B>::new(ours.optim.clone());
    optim
        .load_state(&model, ckpt.optimizer_tensors()?, state.optimizer_steps, device)
        .map_err(|message| TrainError::Checkpoint { path: ckpt.dir.clone(), message })?;
    tracing::info!(step = state.step, dir = %ckpt.dir.display(), "resuming");
    Ok((model, optim, state))
}

pub(crate) struct StepOutput {
    /// Mean loss of the step's micro-batches.
    pub loss: f64,
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    /// The gradients overflowed under f16 loss scaling and the update was skipped.
    pub skipped: bool,
}

/// One optimizer step: micro-batches from stream `first_stream` on, global-norm clipping, AdamW.
/// With a loss scaler (f16), the loss is scaled before the backward pass and the gradients
/// unscaled in the clipping coefficient; a step with non-finite gradients is skipped.
#[allow(clippy::too_many_arguments)]
pub(crate) fn optimizer_step<B: TrainBackend>(
    model: Decoder<B>,
    optim: &mut AdamW<B>,
    data: &Examples,
    sampler: &WindowSampler,
    first_stream: u64,
    lr: f64,
    config: &TrainConfig,
    device: &Device<B>,
    scaler: Option<&mut LossScaler>,
) -> (Decoder<B>, StepOutput) {
    let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale);
    let (loss, grads) = forward_backward(&model, data, sampler, first_stream, config, device, loss_scale);
    let scaled_norm = global_grad_norm(&model, &grads);
    let grad_norm = scaled_norm / loss_scale;
    if let Some(scaler) = scaler {
        if !scaler.update(scaled_norm.is_finite()) {
            return (model, StepOutput { loss, grad_norm, skipped: true });
        }
    }
    let scale = clip_coefficient(grad_norm, config.optim.grad_clip) / loss_scale;
    (optim.step(lr, model, grads, scale), StepOutput { loss, grad_norm, skipped: false })
}

/// Forward and backward over the step's micro-batches; returns the mean loss and the summed
/// gradients of the per-micro-batch losses divided by their number (the gradient of the mean),
/// times `loss_scale`.
fn forward_backward<B: TrainBackend>(
    model: &Decoder<B>,
    data: &Examples,
    sampler: &WindowSampler,
    first_stream: u64,
    config: &TrainConfig,
    device: &Device<B>,
    loss_scale: f64,
) -> (f64, GradientsParams) {
    let accum = config.train.grad_accum_steps;
    let mut grads = GradientsAccumulator::<Decoder<B>>::new();
    // The losses stay on the device until every backward pass is queued: one read per step, not a
    // wait between each forward and its backward (which would drain a GPU's queue).
    let mut loss_sum: Option<Tensor<B::InnerBackend, 1>> = None;
    for micro in 0..accum as u64 {
        let batch = sampler.batch(data.as_ref(), first_stream + micro, config.train.batch_size, device);
        let loss = lm_loss(model, batch);
        let loss = if accum > 1 { loss.div_scalar(accum as f64) } else { loss };
        let value = loss.clone().inner();
        loss_sum = Some(match loss_sum {
            Some(sum) => sum + value,
            None => value,
        });
        let loss = if loss_scale == 1.0 { loss } else { loss.mul_scalar(loss_scale) };
        grads.accumulate(model, GradientsParams::from_grads(loss.backward(), model));
    }
    let loss = loss_sum.map_or(0.0, |sum| sum.into_scalar().elem::<f64>());
    (loss, grads.grads())
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
