//! The run directory: a fresh start or a resume from its latest checkpoint, and the checkpoints
//! themselves: the optimizer's moments gathered from every rank, rank 0 writing them with the
//! weights and the loop state, every rank then checking that the weights still agree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::tensor::{DType, Device, TensorData};
use ember_kernels::TrainBackend;
use ember_model::weights::named_tensors_where;
use ember_model::Decoder;
use indicatif::ProgressBar;

use super::ranks::{check_ranks_agree, Stage};
use super::setup::{initial_model, Setup};
use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainState, TrainingData};
use crate::config::TrainConfig;
use crate::distributed::Collective;
use crate::error::TrainError;
use crate::metrics::METRICS_FILE;
use crate::precision::LossScaler;
use crate::schedule::LrSchedule;
use crate::step::Optimizer;

/// What the checkpointer reads of the run's config.
pub(super) struct CheckpointerConfig {
    /// `train.checkpoint_interval`: a checkpoint every this many steps (0: only at the end).
    interval: usize,
    /// `train.keep_checkpoints`: the newest this many are kept.
    keep: usize,
    /// `[distributed]`'s deadlines: the longer one while rank 0 writes, the steps' one after.
    io_timeout: Duration,
    timeout: Duration,
}

impl CheckpointerConfig {
    pub(super) fn of(config: &TrainConfig) -> Self {
        let (t, d) = (&config.train, &config.distributed);
        Self {
            interval: t.checkpoint_interval,
            keep: t.keep_checkpoints,
            io_timeout: d.io_timeout(),
            timeout: d.timeout(),
        }
    }

    /// The checkpointer of `setup`'s run in `run_dir`, on the ranks of `collective`.
    pub(super) fn build<'a>(
        self,
        setup: &'a Setup,
        run_dir: &'a Path,
        collective: &'a dyn Collective,
    ) -> Checkpointer<'a> {
        Checkpointer { config: self, setup, run_dir, collective }
    }
}

pub(super) struct Checkpointer<'a> {
    config: CheckpointerConfig,
    setup: &'a Setup,
    run_dir: &'a Path,
    collective: &'a dyn Collective,
}

/// The model, its optimizer moments by parameter path (none before the first step) and the loop state.
pub(super) type Restored<B> = (Decoder<B>, BTreeMap<String, TensorData>, TrainState);

impl Checkpointer<'_> {
    /// A fresh run, or the resumed one. Leftovers of killed writers are cleared first (by rank 0), so
    /// that what is checked is what resuming reads. A run without a checkpoint (killed before its
    /// first) has nothing to resume and nothing to lose: it starts again without --resume. One with a
    /// checkpoint is never overwritten.
    pub(super) fn start<B: TrainBackend>(
        &self,
        resume: bool,
        dtype: DType,
        device: &Device<B>,
    ) -> Result<Restored<B>, TrainError> {
        let (config, run_dir, c) = (&self.setup.config, self.run_dir, self.collective);
        if c.rank() == 0 {
            checkpoint::tidy_run_dir(run_dir)?;
        }
        // The other ranks read the run directory after rank 0 has tidied it.
        c.arrive(0, "start-up (run directory)")?;
        if resume {
            if run_dir.is_dir() && !checkpoint::has_checkpoint(run_dir) {
                return Err(TrainError::Resume {
                    path: run_dir.to_path_buf(),
                    message: "it has no checkpoint yet (the run stopped before its first one); run without \
                              --resume to restart it from step 0"
                        .into(),
                });
            }
            return self.resume::<B>(device);
        }
        if checkpoint::has_checkpoint(run_dir) {
            return Err(TrainError::RunExists { path: run_dir.to_path_buf() });
        }
        if c.rank() == 0 {
            checkpoint::set_aside_dead_attempt(run_dir, &[METRICS_FILE, crate::metrics::SAMPLES_FILE])?;
        }
        let model = initial_model::<B>(self.setup, device)?;
        let mut state = TrainState::new(0, LrSchedule::from_config(config), config.train.seed, 0);
        state.loss_scaler = (dtype == DType::F16).then(LossScaler::default);
        state.epochs = config.data.format() == crate::config::DataFormat::Jsonl;
        Ok((model, BTreeMap::new(), state))
    }

    /// Model, optimizer moments and loop state from the run's latest checkpoint, after checking that the
    /// config describes the same run. The world size may change: `grad_accum_steps × ranks` (the
    /// micro-batches of a step) must stay the same.
    fn resume<B: TrainBackend>(&self, device: &Device<B>) -> Result<Restored<B>, TrainError> {
        let (setup, world) = (self.setup, self.collective.world());
        let ckpt = Checkpoint::open(self.run_dir)?;
        let (Some(theirs), Some(state)) = (ckpt.config.clone(), ckpt.state.clone()) else {
            return Err(TrainError::Resume {
                path: ckpt.dir.clone(),
                message: "not a training checkpoint (an import?): start a run from it with init_from = \"run:DIR\""
                    .into(),
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
        let (ours_mb, theirs_mb) =
            (ours.train.grad_accum_steps * world, theirs.train.grad_accum_steps * state.world_size);
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

    /// Whether step `step` ends with a checkpoint: every `checkpoint_interval` steps (0: never)
    /// and at the last step of this invocation, `stop`.
    pub(super) fn due(&self, step: usize, stop: usize) -> bool {
        let every = self.config.interval;
        (every > 0 && step.is_multiple_of(every)) || step == stop
    }

    /// Checkpoints the run at `state.step` (every rank calls this).
    pub(super) fn save<B: TrainBackend>(
        &self,
        model: &Decoder<B>,
        optim: &Optimizer<B>,
        state: &mut TrainState,
        bar: &ProgressBar,
    ) -> Result<(), TrainError> {
        let c = self.collective;
        state.world_size = c.world();
        // The other ranks wait while rank 0 writes: the longer deadline.
        c.set_timeout(self.config.io_timeout);
        let optimizer = optim.state_tensors(c)?;
        state.optimizer_steps = optim.steps();
        if c.rank() == 0 {
            let dir = self.write(model, optimizer, state)?;
            bar.suspend(|| tracing::debug!(dir = %dir.display(), "checkpoint written"));
        }
        check_ranks_agree(c, self.setup, model, Stage::Step(state.step))?;
        c.set_timeout(self.config.timeout);
        Ok(())
    }

    /// Replaces the run's best checkpoint (`<run_dir>/best`) with the weights of step `step`, whose
    /// val loss `val_loss` is the best so far (every rank calls this; rank 0 writes while the
    /// others wait for it, under the longer deadline).
    pub(super) fn save_best<B: TrainBackend>(
        &self,
        model: &Decoder<B>,
        step: usize,
        val_loss: f64,
        bar: &ProgressBar,
    ) -> Result<(), TrainError> {
        let c = self.collective;
        c.set_timeout(self.config.io_timeout);
        if c.rank() == 0 {
            let data = self.data(model, step, None);
            let dir = checkpoint::save_best(self.run_dir, data, &self.setup.config, val_loss)?;
            bar.suspend(|| tracing::debug!(dir = %dir.display(), step, val_loss, "best checkpoint written"));
        }
        c.arrive(step as u64, &format!("step {step}: best checkpoint"))?;
        c.set_timeout(self.config.timeout);
        Ok(())
    }

    /// Saves the run at `state.step` (a LoRA run its adapters only: the frozen base is not even read
    /// back), keeping the newest `train.keep_checkpoints`.
    fn write<B: TrainBackend>(
        &self,
        model: &Decoder<B>,
        optimizer: Vec<(String, TensorData)>,
        state: &TrainState,
    ) -> Result<PathBuf, TrainError> {
        let training = TrainingData { optimizer, state, config: &self.setup.config };
        checkpoint::save(self.run_dir, self.data(model, state.step, Some(training)), self.config.keep)
    }

    /// What a checkpoint of `model` at step `step` holds (a LoRA run's: its adapters only).
    fn data<'s, B: TrainBackend>(
        &'s self,
        model: &'s Decoder<B>,
        step: usize,
        training: Option<TrainingData<'s>>,
    ) -> CheckpointData<'s> {
        let setup = self.setup;
        let lora = setup.config.lora.is_some();
        CheckpointData {
            step,
            model_config: model.config(),
            weights: named_tensors_where(model, |k| !lora || ember_model::lora::is_adapter(k)),
            adapters_only: lora,
            tokenizer: &setup.tokenizer,
            tokenizer_dir: setup.tokenizer_dir.as_deref(),
            hf_config: setup.init.as_ref().and_then(|i| i.hf_config.as_ref()),
            training,
        }
    }
}
