//! The run directory: a fresh start or a resume from its latest checkpoint (checked first against
//! the config and the data read now), and the checkpoints themselves: the optimizer's moments
//! gathered from every rank, rank 0 writing them with the weights, the loop state and the record of
//! what the run read, every rank then checking that the weights still agree.

use std::cell::{OnceCell, RefCell};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use burn::tensor::{DType, Device, TensorData};
use ember_kernels::TrainBackend;
use ember_model::weights::named_tensors_where;
use ember_model::Decoder;
use indicatif::ProgressBar;

use super::ranks::{check_ranks_agree, Stage};
use super::setup::{initial_model, Setup};
use crate::checkpoint::{self, Checkpoint, CheckpointData, RunInputs, TrainState, TrainingData};
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

    /// The checkpointer of `setup`'s run in `run_dir`, on the ranks of `collective`; a resume on
    /// data that changed since its checkpoint refused unless `accept_data_change`.
    pub(super) fn build<'a>(
        self,
        setup: &'a Setup,
        run_dir: &'a Path,
        collective: &'a dyn Collective,
        accept_data_change: bool,
    ) -> Checkpointer<'a> {
        Checkpointer {
            config: self,
            setup,
            run_dir,
            collective,
            accept_data_change,
            inputs: OnceCell::new(),
            resuming: RefCell::new(None),
        }
    }
}

pub(super) struct Checkpointer<'a> {
    config: CheckpointerConfig,
    setup: &'a Setup,
    run_dir: &'a Path,
    collective: &'a dyn Collective,
    /// `--accept-data-change`: a resume continues on data that changed since its checkpoint.
    accept_data_change: bool,
    /// What the run reads, written into its checkpoints (rank 0); set by [`Checkpointer::ready`].
    inputs: OnceCell<RunInputs>,
    /// The checkpoint a resume continues from, opened and checked by [`Checkpointer::ready`].
    resuming: RefCell<Option<Checkpoint>>,
}

/// The model, its optimizer moments by parameter path (none before the first step) and the loop state.
pub(super) type Restored<B> = (Decoder<B>, BTreeMap<String, TensorData>, TrainState);

impl Checkpointer<'_> {
    /// Gets the run directory ready, before anything costly is computed: leftovers of killed
    /// writers cleared (by rank 0), so that what is checked is what resuming reads; a fresh run
    /// refused where the directory holds a checkpoint (never overwritten); a resume's checkpoint
    /// opened and compared with the config, the data and (LoRA) the base read now. A run without a
    /// checkpoint (killed before its first) has nothing to resume and nothing to lose: it starts
    /// again without --resume.
    pub(super) fn ready(&self, resume: bool) -> Result<(), TrainError> {
        let (run_dir, c) = (self.run_dir, self.collective);
        if c.rank() == 0 {
            checkpoint::tidy_run_dir(run_dir)?;
        }
        // The other ranks read the run directory after rank 0 has tidied it.
        c.arrive(0, "start-up (run directory)")?;
        if !resume {
            if checkpoint::has_checkpoint(run_dir) {
                return Err(TrainError::RunExists { path: run_dir.to_path_buf() });
            }
            // Rank 0 alone writes checkpoints.
            let inputs = if c.rank() == 0 { self.inputs_now()? } else { RunInputs::default() };
            let _ = self.inputs.set(inputs);
            return Ok(());
        }
        if run_dir.is_dir() && !checkpoint::has_checkpoint(run_dir) {
            return Err(TrainError::Resume {
                path: run_dir.to_path_buf(),
                message: "it has no checkpoint yet (the run stopped before its first one); run without \
                          --resume to restart it from step 0"
                    .into(),
            });
        }
        let ckpt = Checkpoint::open(run_dir)?;
        let (Some(theirs), Some(state)) = (&ckpt.config, &ckpt.state) else {
            return Err(TrainError::Resume {
                path: ckpt.dir.clone(),
                message: "not a training checkpoint (an import?): start a run from it with init_from = \"run:DIR\""
                    .into(),
            });
        };
        // The data first, where the config names the same: a changed file is the cause of what
        // follows from it (a char vocabulary's size in [model]).
        let inputs = self.inputs_now()?;
        if theirs.data == self.setup.config.data {
            self.check_same_data(&ckpt, state.step, inputs.data.as_ref())?;
            let then = ckpt.inputs.as_ref().and_then(|i| i.val.as_ref());
            if let (Some(now), Some(then)) = (inputs.val.as_ref(), then) {
                self.refuse_changed("validation file (data.val_path)", &ckpt, state.step, now, then)?;
            }
        }
        self.check_same_run(&ckpt, theirs, state)?;
        // A LoRA run's base: its weights are the ones the adapters were trained on.
        if let Some(init) = self.setup.init.as_ref().filter(|_| self.setup.config.lora.is_some()) {
            ckpt.check_base(init)?;
            if ckpt.inputs.as_ref().is_none_or(|i| i.base.is_none()) {
                tracing::info!(
                    "{} has no record of its base's weights (an earlier ember): resuming over {} as it is now, \
                     recorded from now on",
                    ckpt.dir.display(),
                    init.source
                );
            }
        }
        let _ = self.inputs.set(inputs);
        *self.resuming.borrow_mut() = Some(ckpt);
        Ok(())
    }

    /// What the run reads now: its data, and a LoRA run's base.
    fn inputs_now(&self) -> Result<RunInputs, TrainError> {
        let setup = self.setup;
        let base = match (&setup.init, &setup.config.lora) {
            (Some(init), Some(_)) => Some(init.identity()?.clone()),
            _ => None,
        };
        Ok(RunInputs { data: Some(setup.data_origin.record()?), val: setup.data_origin.record_val()?, base })
    }

    /// Refuses a config that trains differently from the checkpoint's (every section that changes
    /// the optimisation, named with its first differing keys), and a number of micro-batches per
    /// step that differs: the world size may change, `grad_accum_steps × ranks` must not.
    fn check_same_run(&self, ckpt: &Checkpoint, theirs: &TrainConfig, state: &TrainState) -> Result<(), TrainError> {
        let (ours, world) = (&self.setup.config, self.collective.world());
        if let Some(difference) = config_difference(theirs, ours) {
            return Err(TrainError::Resume {
                path: ckpt.dir.clone(),
                message: format!(
                    "{difference}; resume with the run's config.toml ({})",
                    self.run_dir.join(checkpoint::CONFIG_FILE).display()
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
        Ok(())
    }

    /// Refuses data that changed since the checkpoint of step `step` was written, unless
    /// `--accept-data-change` (then warned of); a checkpoint without the record resumes with a note.
    fn check_same_data(
        &self,
        ckpt: &Checkpoint,
        step: usize,
        now: Option<&checkpoint::DataRecord>,
    ) -> Result<(), TrainError> {
        let Some(now) = now else { return Ok(()) };
        let Some(then) = ckpt.inputs.as_ref().and_then(|i| i.data.as_ref()) else {
            tracing::info!(
                "{} has no record of its data (an earlier ember): resuming on {} as it is now, recorded from now on",
                ckpt.dir.display(),
                now.path.display()
            );
            return Ok(());
        };
        self.refuse_changed("data file", ckpt, step, now, then)
    }

    /// Refuses the `what` (the data file, or the validation file) that changed since the
    /// checkpoint of step `step` was written (`then`, against `now`), unless
    /// `--accept-data-change` (then warned of).
    fn refuse_changed(
        &self,
        what: &str,
        ckpt: &Checkpoint,
        step: usize,
        now: &checkpoint::DataRecord,
        then: &checkpoint::DataRecord,
    ) -> Result<(), TrainError> {
        let Some(change) = now.changes_since(then)? else {
            if self.accept_data_change {
                tracing::info!("--accept-data-change: the {what} is the checkpoint's, unchanged");
            }
            return Ok(());
        };
        let file = now.path.display();
        if self.accept_data_change {
            tracing::warn!(
                "the {what} {file} changed since the checkpoint of step {step}: {change}; continuing on it as it is \
                 now (--accept-data-change), and recording it in the next checkpoints"
            );
            return Ok(());
        }
        Err(TrainError::Resume {
            path: ckpt.dir.clone(),
            message: format!(
                "the {what} {file} changed since this checkpoint was written: {change}. Start afresh in a new \
                 --run-dir, or continue on the data as it is now with `ember train --resume --accept-data-change`"
            ),
        })
    }

    /// A fresh run, or the resumed one (opened and checked by [`Checkpointer::ready`]).
    pub(super) fn start<B: TrainBackend>(
        &self,
        resume: bool,
        dtype: DType,
        device: &Device<B>,
    ) -> Result<Restored<B>, TrainError> {
        let (config, run_dir, c) = (&self.setup.config, self.run_dir, self.collective);
        if resume {
            return self.resume::<B>(device);
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

    /// Model, optimizer moments and loop state from the checkpoint [`Checkpointer::ready`] checked.
    fn resume<B: TrainBackend>(&self, device: &Device<B>) -> Result<Restored<B>, TrainError> {
        let ckpt = self.resuming.borrow_mut().take().expect("Checkpointer::ready opened the checkpoint to resume");
        let state = ckpt.state.clone().expect("ready checked that the checkpoint has a state");
        // A LoRA run's base comes from the run's own `init_from` source, the same as the checkpoint's.
        let model = ckpt.decoder_over::<B>(self.setup.init.as_ref(), device)?;
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
            let dir = checkpoint::save_best(self.run_dir, data, &self.setup.config, self.inputs(), val_loss)?;
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
        let training = TrainingData { optimizer, state, config: &self.setup.config, inputs: self.inputs() };
        checkpoint::save(self.run_dir, self.data(model, state.step, Some(training)), self.config.keep)
    }

    /// What the run read, for its checkpoints.
    fn inputs(&self) -> &RunInputs {
        self.inputs.get().expect("Checkpointer::ready records the inputs")
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

/// The sections of a config that change the optimisation, as JSON (a section left out: null):
/// `init_from`, `[model]`, `[data]`, `[train]`'s batch shape, seed and precision, `[optim]`,
/// `[schedule]`, `[lora]`, `[muon]`, `[preference]` and `[rl]` (but how often it logs rollouts).
/// Left out as not changing it: the run's length and what and when it evaluates, logs and
/// checkpoints, `[eval]`, `[metrics]`, `[distributed]`.
fn optimisation_sections(c: &TrainConfig) -> [(&'static str, Value); 10] {
    fn json(x: &impl serde::Serialize) -> Value {
        serde_json::to_value(x).unwrap_or(Value::Null)
    }
    let mut rl = json(&c.rl);
    if let Some(rl) = rl.as_object_mut() {
        rl.remove("log_rollouts");
    }
    let t = &c.train;
    let train = serde_json::json!({
        "batch_size": t.batch_size,
        "seq_len": c.seq_len(),
        "seed": t.seed,
        "precision": json(&t.precision),
    });
    [
        ("init_from", json(&c.init_from)),
        ("model", json(&c.model)),
        ("data", json(&c.data)),
        ("train", train),
        ("optim", json(&c.optim)),
        ("schedule", json(&c.schedule)),
        ("lora", json(&c.lora)),
        ("muon", json(&c.muon)),
        ("preference", json(&c.preference)),
        ("rl", rl),
    ]
}

/// The first section of `ours` that trains differently from `theirs` (the checkpoint's), in
/// words: `the config's [muon] differs from the checkpoint's: lr is 0.2 in the checkpoint, 0.02 now`.
fn config_difference(theirs: &TrainConfig, ours: &TrainConfig) -> Option<String> {
    let sections = optimisation_sections(theirs).into_iter().zip(optimisation_sections(ours));
    let differing: Vec<(&str, Value, Value)> = sections
        .filter(|((_, then), (_, now))| then != now)
        .map(|((name, then), (_, now))| (name, then, now))
        .collect();
    let (name, then, now) = differing.first()?;
    let others: Vec<String> = differing[1..].iter().map(|(n, ..)| shown_section(n)).collect();
    let others = match others.len() {
        0 => String::new(),
        1 => format!(" (and {} differs too)", others[0]),
        _ => format!(" (and {} differ too)", others.join(", ")),
    };
    let what = match (then, now) {
        (Value::Null, _) => format!("the checkpoint's config has no {}, this one has", shown_section(name)),
        (_, Value::Null) => format!("this config has no {}, the checkpoint's has", shown_section(name)),
        _ if *name == "init_from" => format!("it is {} in the checkpoint, {} now", shown(then), shown(now)),
        _ => {
            let mut found = Vec::new();
            differences("", then, now, &mut found);
            match found.len() {
                0 => "their values differ".into(),
                n if n > 3 => format!("{} (and {} more)", found[..3].join(", "), n - 3),
                _ => found.join(", "),
            }
        }
    };
    Some(format!("the config's {} differs from the checkpoint's{others}: {what}", shown_section(name)))
}

/// `[muon]`, or `init_from` (a key, not a section).
fn shown_section(name: &str) -> String {
    if name == "init_from" {
        name.into()
    } else {
        format!("[{name}]")
    }
}

/// Each key under `key` whose value differs, as `lr is 0.2 in the checkpoint, 0.02 now`
/// (a key one side leaves out counts as not set).
fn differences(key: &str, then: &Value, now: &Value, found: &mut Vec<String>) {
    if then == now {
        return;
    }
    let join = |k: &str| if key.is_empty() { k.to_string() } else { format!("{key}.{k}") };
    match (then, now) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let (x, y) = (a.get(k).unwrap_or(&Value::Null), b.get(k).unwrap_or(&Value::Null));
                differences(&join(k), x, y, found);
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() && a.iter().all(Value::is_object) => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(&format!("{key}[{i}]"), x, y, found);
            }
        }
        _ => found.push(format!("{key} is {} in the checkpoint, {} now", shown(then), shown(now))),
    }
}

/// A value as the config file writes it (shortened past 60 characters).
fn shown(v: &Value) -> String {
    let text = match v {
        Value::Null => "not set".into(),
        other => other.to_string(),
    };
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> TrainConfig {
        let toml = format!(
            "[model]\nd_model = 8\nn_layers = 1\nn_heads = 2\nd_ff = 16\nmax_seq_len = 8\n\n\
             [data]\npath = \"t.txt\"\ntokenizer = \"char\"\n\n\
             [train]\nbatch_size = 1\nmax_steps = 6\n\n[schedule]\nlr = 1e-3\n{extra}"
        );
        TrainConfig::from_toml(&toml, Path::new("t.toml")).unwrap()
    }

    #[test]
    fn a_config_difference_names_the_section_key_and_both_values() {
        let base = config("\n[muon]\nlr = 0.2\n");
        assert_eq!(config_difference(&base, &base), None);
        let lr = config_difference(&base, &config("\n[muon]\nlr = 0.02\n")).unwrap();
        assert_eq!(lr, "the config's [muon] differs from the checkpoint's: lr is 0.2 in the checkpoint, 0.02 now");
        let removed = config_difference(&base, &config("")).unwrap();
        assert_eq!(
            removed,
            "the config's [muon] differs from the checkpoint's: this config has no [muon], the checkpoint's has"
        );
        let added = config_difference(&config(""), &base).unwrap();
        assert!(added.ends_with("the checkpoint's config has no [muon], this one has"), "{added}");
        // Several sections: the first named with its keys, the others listed.
        let both = config("\n[muon]\nlr = 0.2\nmomentum = 0.9\n[optim]\nbeta1 = 0.8\n");
        let text = config_difference(&base, &both).unwrap();
        assert_eq!(
            text,
            "the config's [optim] differs from the checkpoint's (and [muon] differs too): beta1 is 0.9 in the \
             checkpoint, 0.8 now"
        );
        // What does not change the optimisation passes.
        let mut longer = base.clone();
        (longer.train.max_steps, longer.train.eval_interval, longer.train.checkpoint_interval) = (60, 7, 3);
        assert_eq!(config_difference(&base, &longer), None);
        let mut seed = base.clone();
        seed.train.seed += 1;
        assert!(config_difference(&base, &seed).unwrap().contains("[train] differs from the checkpoint's: seed is"));
    }
}
