//! The training loop, nanoGPT's `while True:` in Burn: LR -> micro-batches (forward, backward,
//! accumulate) -> global-norm clip -> AdamW -> log -> maybe evaluate / checkpoint -> stop.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Device, ElementConversion};
use ember_data::fetch::Locations;
use ember_data::{Prepared, TokenWindows, WindowSampler};
use ember_model::weights::named_tensors;
use ember_model::Decoder;
use indicatif::{ProgressBar, ProgressStyle};

use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainState, CONFIG_FILE, TOKENIZER_FILE};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::eval::{eval_seed, evaluate, lm_loss};
use crate::metrics::{MetricsLog, StepRecord, METRICS_FILE};
use crate::optim::{clip_coefficient, global_grad_norm, AdamW};
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    pub run_dir: PathBuf,
    pub steps: usize,
    pub best_val_loss: Option<f64>,
    pub last_val_loss: Option<f64>,
    /// Training tokens per second over this invocation (evaluation and checkpoints excluded).
    pub tokens_per_sec: f64,
    pub elapsed_s: f64,
}

/// Everything the loop reads but does not change.
pub(crate) struct Setup {
    pub(crate) config: TrainConfig,
    pub(crate) data: Prepared,
    pub(crate) train: TokenWindows,
    pub(crate) val: TokenWindows,
}

/// Trains (or resumes) the run described by `config` in `opts.run_dir`.
pub fn train<B: AutodiffBackend>(
    config: TrainConfig,
    opts: &TrainOptions,
    device: &Device<B>,
) -> Result<TrainSummary, TrainError> {
    let setup = prepare(config, &opts.locations)?;
    let config = &setup.config;
    let run_dir = &opts.run_dir;
    let schedule = LrSchedule::from_config(config);

    let (mut model, mut optim, mut state) = if opts.resume {
        resume::<B>(&setup, run_dir, device)?
    } else {
        if run_dir.join(checkpoint::CHECKPOINTS).join(checkpoint::LATEST).exists()
            || std::fs::metadata(run_dir.join(METRICS_FILE)).is_ok_and(|m| m.len() > 0)
        {
            return Err(TrainError::RunExists { path: run_dir.clone() });
        }
        let model = Decoder::<B>::new(&config.model, config.train.seed, device)?;
        let state = TrainState::new(0, schedule, config.train.seed, 0);
        (model, AdamW::<B>::new(config.optim.clone()), state)
    };
    std::fs::create_dir_all(run_dir).map_err(TrainError::io(run_dir))?;
    ember_data::write_atomic(&run_dir.join(CONFIG_FILE), config.to_toml().as_bytes())?;
    setup.data.tokenizer.save(&run_dir.join(TOKENIZER_FILE))?;
    let mut metrics = MetricsLog::open(run_dir, opts.resume.then_some(state.step))?;

    let t = &config.train;
    let max_steps = t.max_steps;
    let stop = opts.stop_at.unwrap_or(max_steps).min(max_steps);
    let tokens_per_step = config.tokens_per_step();
    let sampler = WindowSampler { seed: state.sampler_seed };
    let (train_seed, val_seed) = (eval_seed(t.seed, "train"), eval_seed(t.seed, "val"));
    let mcfg = &config.model;
    tracing::info!(
        params = mcfg.num_params(),
        matmul_params = mcfg.matmul_params(),
        flops_per_token = format!("{:.3e}", mcfg.train_flops_per_token(config.seq_len())),
        tokens_per_step,
        "model: {} layers, d_model {}, {} heads ({} kv), vocab {}",
        mcfg.n_layers,
        mcfg.d_model,
        mcfg.n_heads,
        mcfg.n_kv_heads(),
        mcfg.vocab_size
    );
    if state.step == 0 {
        let val = evaluate(&model.valid(), &setup.val, val_seed, t.eval_iters, t.batch_size);
        tracing::info!("step 0: val loss {val:.4} (ln V = {:.4})", (mcfg.vocab_size as f64).ln());
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
        (model, out) = optimizer_step(model, &mut optim, &setup.train, &sampler, state.next_stream, lr, config, device);
        let StepOutput { loss, grad_norm } = out;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { step: state.step, loss });
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
            let mut record = StepRecord {
                step,
                train_loss: loss,
                lr,
                grad_norm,
                tokens_per_sec: window_tokens as f64 / window_time.as_secs_f64().max(1e-9),
                elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
                val_loss: None,
                eval_train_loss: None,
            };
            (window_time, window_tokens) = (Duration::ZERO, 0);
            if is_eval {
                let inner = model.valid();
                let tl = evaluate(&inner, &setup.train, train_seed, t.eval_iters, t.batch_size);
                let vl = evaluate(&inner, &setup.val, val_seed, t.eval_iters, t.batch_size);
                (record.eval_train_loss, record.val_loss) = (Some(tl), Some(vl));
                state.best_val_loss = Some(state.best_val_loss.map_or(vl, |b: f64| b.min(vl)));
                last_val = Some(vl);
                bar.suspend(|| tracing::info!("step {step}: train loss {tl:.4}, val loss {vl:.4}"));
            }
            bar.set_message(format!("loss {loss:.4} · {:.0} tok/s", record.tokens_per_sec));
            metrics.write(&record)?;
        }
        let periodic = t.checkpoint_interval > 0 && step % t.checkpoint_interval == 0;
        if periodic || step == stop {
            state.elapsed_s = elapsed_before + started.elapsed().as_secs_f64();
            let data = CheckpointData {
                model: named_tensors(&model),
                optimizer: optim.state_tensors(),
                state: &state,
                config,
                tokenizer: &setup.data.tokenizer,
            };
            let dir = checkpoint::save(run_dir, data, t.keep_checkpoints)?;
            bar.suspend(|| tracing::debug!(dir = %dir.display(), "checkpoint written"));
        }
        bar.set_position(step as u64);
    }
    bar.finish_and_clear();
    let summary = TrainSummary {
        run_dir: run_dir.clone(),
        steps: state.step,
        best_val_loss: state.best_val_loss,
        last_val_loss: last_val,
        tokens_per_sec: run_tokens as f64 / run_time.as_secs_f64().max(1e-9),
        elapsed_s: elapsed_before + started.elapsed().as_secs_f64(),
    };
    Ok(summary)
}

/// Finds the data, fills in the vocabulary size and checks that both splits hold a window.
pub(crate) fn prepare(mut config: TrainConfig, locations: &Locations) -> Result<Setup, TrainError> {
    let data = crate::data::load(&config.data, locations)?;
    let vocab = data.tokenizer.vocab_size();
    if config.model.vocab_size == 0 {
        config.model.vocab_size = vocab;
    } else if config.model.vocab_size < vocab {
        return Err(TrainError::VocabTooSmall { config: config.model.vocab_size, tokenizer: vocab });
    }
    config.model.validate()?;
    let seq_len = config.seq_len();
    let train = TokenWindows::new(Arc::new(data.train.clone()), seq_len, "train")?;
    let val = TokenWindows::new(Arc::new(data.val.clone()), seq_len, "val")?;
    Ok(Setup { config, data, train, val })
}

type Restored<B> = (Decoder<B>, AdamW<B>, TrainState);

/// Model, optimizer and loop state from the run's latest checkpoint, after checking that the
/// config describes the same run.
fn resume<B: AutodiffBackend>(setup: &Setup, run_dir: &Path, device: &Device<B>) -> Result<Restored<B>, TrainError> {
    let ckpt = Checkpoint::open(run_dir)?;
    let (ours, theirs) = (&setup.config, &ckpt.config);
    let same_run = [
        ("model", ours.model == theirs.model),
        ("data", ours.data == theirs.data),
        ("optim", ours.optim == theirs.optim),
        ("schedule", ours.schedule == theirs.schedule),
        (
            "train (batch_size, seq_len, grad_accum_steps, seed)",
            (ours.train.batch_size, ours.seq_len(), ours.train.grad_accum_steps, ours.train.seed)
                == (theirs.train.batch_size, theirs.seq_len(), theirs.train.grad_accum_steps, theirs.train.seed),
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
        .load_state(&model, ckpt.optimizer_tensors()?, ckpt.state.step as u64, device)
        .map_err(|message| TrainError::Checkpoint { path: ckpt.dir.clone(), message })?;
    tracing::info!(step = ckpt.state.step, dir = %ckpt.dir.display(), "resuming");
    Ok((model, optim, ckpt.state))
}

pub(crate) struct StepOutput {
    /// Mean loss of the step's micro-batches.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
}

/// One optimizer step: micro-batches from stream `first_stream` on, global-norm clipping, AdamW.
#[allow(clippy::too_many_arguments)]
pub(crate) fn optimizer_step<B: AutodiffBackend>(
    model: Decoder<B>,
    optim: &mut AdamW<B>,
    data: &TokenWindows,
    sampler: &WindowSampler,
    first_stream: u64,
    lr: f64,
    config: &TrainConfig,
    device: &Device<B>,
) -> (Decoder<B>, StepOutput) {
    let (loss, grads) = forward_backward(&model, data, sampler, first_stream, config, device);
    let grad_norm = global_grad_norm(&model, &grads);
    let scale = clip_coefficient(grad_norm, config.optim.grad_clip);
    (optim.step(lr, model, grads, scale), StepOutput { loss, grad_norm })
}

/// Forward and backward over the step's micro-batches; returns the mean loss and the summed
/// gradients of the per-micro-batch losses divided by their number (the gradient of the mean).
fn forward_backward<B: AutodiffBackend>(
    model: &Decoder<B>,
    data: &TokenWindows,
    sampler: &WindowSampler,
    first_stream: u64,
    config: &TrainConfig,
    device: &Device<B>,
) -> (f64, GradientsParams) {
    let accum = config.train.grad_accum_steps;
    let mut grads = GradientsAccumulator::<Decoder<B>>::new();
    let mut loss_sum = 0.0;
    for micro in 0..accum as u64 {
        let batch = sampler.batch(data, first_stream + micro, config.train.batch_size, device);
        let loss = lm_loss(model, batch);
        let loss = if accum > 1 { loss.div_scalar(accum as f64) } else { loss };
        loss_sum += loss.clone().into_scalar().elem::<f64>();
        grads.accumulate(model, GradientsParams::from_grads(loss.backward(), model));
    }
    (loss_sum, grads.grads())
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
