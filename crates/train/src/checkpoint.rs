//! Checkpoints: everything a stopped run needs to continue exactly, in one folder per step.
//!
//! ```text
//! <run_dir>/checkpoints/step-000250/
//!     model.toml             the architecture (always)
//!     model.safetensors      parameters by path, Burn layout (linear weights [in, out])
//!       or adapter.safetensors   LoRA runs: the adapters only (the base is `init_from`)
//!     tokenizer.json         (+ tokenizer_config.json / chat_template.jinja when the model has them)
//!     hf_config.json         the Hugging Face config.json a model was imported from, if any
//!     optimizer.safetensors  AdamW moments, `<path>.exp_avg` / `<path>.exp_avg_sq`   } training
//!     state.json             step, LR schedule, sampler seed and data position, ...  } runs
//!     config.toml            the resolved training config                             } only
//! <run_dir>/checkpoints/latest   the name of the newest complete checkpoint
//! ```
//! A checkpoint is written in a temporary folder and renamed into place, then `latest` is replaced
//! atomically: a crash leaves the previous checkpoint as the latest, never a partial one. Each step
//! is fsynced before the next depends on it (files, their folder, its rename, `latest`), and old
//! checkpoints are pruned only after that, so a power loss cannot either: without the syncs the
//! file system may persist the renames before the data, or the pruning before the new `latest`.
//!
//! A killed writer leaves `.step-N.tmp-PID` (or `.step-N.old-PID`) behind;
//! [`remove_stale_temporaries`] clears them at the next start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, TensorData};
use ember_data::Tokenizer;
use ember_model::weights::{assign, from_safetensors, named_tensors, to_safetensors};
use ember_model::{Decoder, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::config::{InitSource, TrainConfig};
use crate::error::TrainError;
use crate::schedule::LrSchedule;

pub const CHECKPOINTS: &str = "checkpoints";
pub const LATEST: &str = "latest";
pub const MODEL_FILE: &str = "model.safetensors";
pub const ADAPTER_FILE: &str = "adapter.safetensors";
pub const MODEL_CONFIG_FILE: &str = "model.toml";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const CONFIG_FILE: &str = "config.toml";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const HF_CONFIG_FILE: &str = "hf_config.json";
/// Files of a tokenizer folder that travel with tokenizer.json (the chat template).
pub const TOKENIZER_EXTRAS: [&str; 2] = ["tokenizer_config.json", "chat_template.jinja"];
const FORMAT_VERSION: u32 = 1;

/// Loop state at the moment of the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: usize,
    pub schedule: LrSchedule,
    /// Seed of the window sampler.
    pub sampler_seed: u64,
    /// Data position: the sampler stream of the next micro-batch.
    pub next_stream: u64,
    pub best_val_loss: Option<f64>,
    pub elapsed_s: f64,
    pub tokens_seen: u64,
    /// AdamW updates applied (fewer than `step` when f16 overflows skipped some).
    pub optimizer_steps: u64,
    /// Dynamic loss scaling state, in f16 runs.
    pub loss_scaler: Option<crate::precision::LossScaler>,
    /// Data-parallel ranks of the run that wrote the checkpoint (each step drew
    /// `grad_accum_steps × world_size` micro-batches).
    #[serde(default = "one")]
    pub world_size: usize,
}

fn one() -> usize {
    1
}

impl TrainState {
    pub fn new(step: usize, schedule: LrSchedule, sampler_seed: u64, next_stream: u64) -> Self {
        Self {
            format_version: FORMAT_VERSION,
            step,
            schedule,
            sampler_seed,
            next_stream,
            best_val_loss: None,
            elapsed_s: 0.0,
            tokens_seen: 0,
            optimizer_steps: 0,
            loss_scaler: None,
            world_size: 1,
        }
    }
}

/// The training-run part of a checkpoint.
pub struct TrainingData<'a> {
    pub optimizer: Vec<(String, TensorData)>,
    pub state: &'a TrainState,
    pub config: &'a TrainConfig,
}

/// What goes into a checkpoint.
pub struct CheckpointData<'a> {
    pub step: usize,
    pub model_config: &'a ModelConfig,
    /// All parameters, or only the LoRA adapters (`adapters_only`).
    pub weights: Vec<(String, TensorData)>,
    pub adapters_only: bool,
    pub tokenizer: &'a Tokenizer,
    /// Folder with the tokenizer's chat template files, copied along when present.
    pub tokenizer_dir: Option<&'a Path>,
    pub hf_config: Option<&'a serde_json::Value>,
    pub training: Option<TrainingData<'a>>,
}

fn step_dir_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// Writes a checkpoint of `data.step` and makes it the latest; keeps the newest `keep`.
pub fn save(run_dir: &Path, data: CheckpointData<'_>, keep: usize) -> Result<PathBuf, TrainError> {
    let root = run_dir.join(CHECKPOINTS);
    if !root.is_dir() {
        std::fs::create_dir_all(&root).map_err(TrainError::io(&root))?;
        // `checkpoints/` itself must survive a power loss for the first checkpoint in it to.
        sync_dir(run_dir)?;
    }
    let name = step_dir_name(data.step);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    let meta = |kind: &str| {
        Some(std::collections::HashMap::from([
            ("format".to_string(), "ember".to_string()),
            ("content".to_string(), kind.to_string()),
            ("step".to_string(), data.step.to_string()),
        ]))
    };
    let weights_file = if data.adapters_only { ADAPTER_FILE } else { MODEL_FILE };
    let model_toml = toml::to_string_pretty(data.model_config).expect("model config serialises");
    let mut files: Vec<(&str, Vec<u8>)> = vec![
        (weights_file, to_safetensors(&data.weights, meta("model"))),
        (MODEL_CONFIG_FILE, model_toml.into_bytes()),
        (TOKENIZER_FILE, data.tokenizer.to_json()?.into_bytes()),
    ];
    if let Some(hf) = data.hf_config {
        files.push((HF_CONFIG_FILE, serde_json::to_vec_pretty(hf).expect("json serialises")));
    }
    if let Some(t) = &data.training {
        files.push((OPTIMIZER_FILE, to_safetensors(&t.optimizer, meta("adamw"))));
        files.push((STATE_FILE, serde_json::to_vec_pretty(t.state).expect("state serialises")));
        files.push((CONFIG_FILE, t.config.to_toml().into_bytes()));
    }
    for extra in TOKENIZER_EXTRAS {
        if let Some(src) = data.tokenizer_dir.map(|d| d.join(extra)).filter(|p| p.is_file()) {
            files.push((extra, std::fs::read(&src).map_err(TrainError::io(&src))?));
        }
    }
    // Inside the temporary folder nothing needs replacing atomically (the folder is the unit), but
    // every file must be on disk before the folder's rename can be.
    for (file, bytes) in files {
        write_synced(&tmp.join(file), &bytes)?;
    }
    sync_dir(&tmp)?;
    let dest = root.join(&name);
    if dest.exists() {
        // A resumed run that passes the same step again: replace the older copy.
        let old = root.join(format!(".{name}.old-{}", std::process::id()));
        rename(&dest, &old)?;
        std::fs::remove_dir_all(&old).map_err(TrainError::io(&old))?;
    }
    rename(&tmp, &dest)?;
    sync_dir(&root)?;
    // `latest` is written (and it and its folder synced) only once the folder it names is durable,
    // and pruning waits for `latest`: a power loss at any point leaves a `latest` naming a whole
    // checkpoint that is still there.
    ember_data::write_atomic(&root.join(LATEST), name.as_bytes())?;
    journal(|| format!("latest {name}"));
    prune(&root, keep, &name)?;
    Ok(dest)
}

/// Deletes all but the newest `keep` step folders (never `current`). Newest by step number, not by
/// name: names are zero-padded to six digits only, so as text `step-1000000` sorts before
/// `step-999999` and the newest checkpoints would be the ones deleted.
fn prune(root: &Path, keep: usize, current: &str) -> Result<(), TrainError> {
    let mut steps: Vec<(u64, String)> = std::fs::read_dir(root)
        .map_err(TrainError::io(root))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| step_of(&n).map(|s| (s, n)))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, name) in steps.into_iter().take(excess).filter(|(_, n)| n != current) {
        let dir = root.join(&name);
        std::fs::remove_dir_all(&dir).map_err(TrainError::io(&dir))?;
        journal(|| format!("prune {name}"));
    }
    Ok(())
}

/// The step of a checkpoint folder's name (`step-000250` -> 250); `None` for anything else.
fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The checkpoint folder a user means: a checkpoint folder itself, or a run directory (its latest).
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    let not = |reason: String| TrainError::NotACheckpoint { path: path.into(), reason };
    if !path.exists() {
        return Err(not("no such file or directory".into()));
    }
    if !path.is_dir() {
        return Err(not("a file, expected a run directory or a checkpoint folder".into()));
    }
    if path.join(MODEL_CONFIG_FILE).is_file() {
        return Ok(path.into());
    }
    let latest = path.join(CHECKPOINTS).join(LATEST);
    if latest.is_file() {
        let name = std::fs::read_to_string(&latest).map_err(TrainError::io(&latest))?;
        let dir = path.join(CHECKPOINTS).join(name.trim());
        if dir.join(MODEL_CONFIG_FILE).is_file() {
            return Ok(dir);
        }
        return Err(not(format!("{} names `{}`, which is not a checkpoint", latest.display(), name.trim())));
    }
    Err(not(format!(
        "no {MODEL_CONFIG_FILE} (a checkpoint folder) and no {CHECKPOINTS}/{LATEST} (a run directory with checkpoints)"
    )))
}

/// A checkpoint's small files, read and checked; tensors are read on demand.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub model_config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// Present for checkpoints of training runs (not for `ember import`s).
    pub state: Option<TrainState>,
    pub config: Option<TrainConfig>,
}

impl Checkpoint {
    /// Opens a run directory (its latest checkpoint) or a checkpoint folder.
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        let dir = resolve(path)?;
        let damaged = |message: String| TrainError::Checkpoint { path: dir.clone(), message };
        let model_path = dir.join(MODEL_CONFIG_FILE);
        let text = std::fs::read_to_string(&model_path).map_err(TrainError::io(&model_path))?;
        let model_config: ModelConfig =
            toml::from_str(&text).map_err(|e| damaged(format!("{MODEL_CONFIG_FILE}: {}", e.message())))?;
        model_config.validate().map_err(|e| damaged(format!("{MODEL_CONFIG_FILE}: {e}")))?;
        let tokenizer = Tokenizer::from_file(&dir.join(TOKENIZER_FILE))?.with_model_eos(&dir);
        // Every id the tokenizer can produce must index the embedding table.
        if tokenizer.vocab_size() > model_config.vocab_size {
            let id = tokenizer.vocab_size() as u32 - 1;
            let token = tokenizer.id_to_token(id).unwrap_or_default();
            return Err(TrainError::Checkpoint {
                path: dir.join(TOKENIZER_FILE),
                message: format!(
                    "token {token:?} has id {id}, past the model's vocabulary: {MODEL_CONFIG_FILE} has vocab_size {}; \
                     the tokenizer does not belong to these weights",
                    model_config.vocab_size
                ),
            });
        }
        let state = match std::fs::read_to_string(dir.join(STATE_FILE)) {
            Ok(text) => {
                let state: TrainState =
                    serde_json::from_str(&text).map_err(|e| damaged(format!("{STATE_FILE}: {e}")))?;
                if state.format_version != FORMAT_VERSION {
                    return Err(damaged(format!(
                        "format version {}, this ember reads {FORMAT_VERSION}",
                        state.format_version
                    )));
                }
                Some(state)
            }
            Err(_) => None,
        };
        let config =
            if dir.join(CONFIG_FILE).is_file() { Some(TrainConfig::from_file(&dir.join(CONFIG_FILE))?) } else { None };
        if state.is_some() != config.is_some() {
            return Err(damaged(format!("{STATE_FILE} and {CONFIG_FILE} come together")));
        }
        if !dir.join(MODEL_FILE).is_file() && !dir.join(ADAPTER_FILE).is_file() {
            return Err(damaged(format!("neither {MODEL_FILE} nor {ADAPTER_FILE} is there")));
        }
        if state.is_some() && !dir.join(OPTIMIZER_FILE).is_file() {
            return Err(damaged(format!("{OPTIMIZER_FILE} is missing")));
        }
        Ok(Self { dir, model_config, tokenizer, state, config })
    }

    /// The training config, for what needs a training run's checkpoint.
    pub fn train_config(&self) -> Result<&TrainConfig, TrainError> {
        self.config.as_ref().ok_or_else(|| TrainError::Checkpoint {
            path: self.dir.clone(),
            message: "not a training run's checkpoint (no config.toml): it has no data or optimizer".into(),
        })
    }

    pub fn optimizer_tensors(&self) -> Result<BTreeMap<String, TensorData>, TrainError> {
        read_tensors(&self.dir.join(OPTIMIZER_FILE))
    }

    /// Whether the weights are LoRA adapters over the `init_from` model.
    pub fn is_adapter(&self) -> bool {
        self.dir.join(ADAPTER_FILE).is_file()
    }

    /// The Hugging Face config.json the model came from, if any.
    pub fn hf_config(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(self.dir.join(HF_CONFIG_FILE)).ok()?).ok()
    }

    /// The `init_from` source a LoRA checkpoint's adapters sit on; `None` for a full checkpoint.
    pub fn adapter_source(&self) -> Result<Option<InitSource>, TrainError> {
        if !self.is_adapter() {
            return Ok(None);
        }
        match self.train_config()? {
            TrainConfig { init_from: Some(source), lora: Some(_), .. } => Ok(Some(source.clone())),
            _ => Err(TrainError::Checkpoint {
                path: self.dir.clone(),
                message: format!("{ADAPTER_FILE} without init_from and [lora] in {CONFIG_FILE}"),
            }),
        }
    }

    /// The decoder of a full checkpoint, from its own weights.
    pub(crate) fn own_decoder<B: ember_model::ops::EmberBackend>(
        &self,
        device: &Device<B>,
    ) -> Result<Decoder<B>, TrainError> {
        let path = self.dir.join(MODEL_FILE);
        // Sizes first: a model.toml that describes more than its weights file is refused
        // before the model is allocated.
        let bytes = std::fs::metadata(&path).map_err(TrainError::io(&path))?.len();
        ember_model::weights::check_model_size(&self.model_config, &path.display().to_string(), bytes)
            .map_err(|message| TrainError::Checkpoint { path: self.dir.join(MODEL_CONFIG_FILE), message })?;
        let model = Decoder::empty(&self.model_config, device)?;
        Ok(assign(model, read_tensors(&path)?, &path.display().to_string(), false)?)
    }

    /// A LoRA checkpoint's adapters attached to `base`, the model its `init_from` source gives.
    pub(crate) fn with_adapters<B: ember_model::ops::EmberBackend>(
        &self,
        base: Decoder<B>,
    ) -> Result<Decoder<B>, TrainError> {
        let config = self.train_config()?;
        let Some(lora) = &config.lora else {
            return Err(TrainError::Checkpoint {
                path: self.dir.clone(),
                message: format!("{ADAPTER_FILE} without [lora] in {CONFIG_FILE}"),
            });
        };
        let base = base.with_lora(lora, config.train.seed);
        let path = self.dir.join(ADAPTER_FILE);
        let mut values: BTreeMap<String, TensorData> = named_tensors::<B, _>(&base).into_iter().collect();
        for (k, v) in read_tensors(&path)? {
            if values.insert(k.clone(), v).is_none() {
                return Err(TrainError::Checkpoint {
                    path: path.clone(),
                    message: format!("adapter `{k}` matches no parameter"),
                });
            }
        }
        Ok(assign(base, values, &path.display().to_string(), false)?)
    }
}

fn read_tensors(path: &Path) -> Result<BTreeMap<String, TensorData>, TrainError> {
    let bytes = std::fs::read(path).map_err(TrainError::io(path))?;
    Ok(from_safetensors(&bytes, &path.display().to_string())?.0)
}

/// Writes a file and fsyncs it (no rename: inside a checkpoint's temporary folder the folder's own
/// rename is what makes the files appear at once).
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(TrainError::io(path))?;
    f.write_all(bytes).map_err(TrainError::io(path))?;
    f.sync_all().map_err(TrainError::io(path))?;
    journal(|| format!("file {}", file_name(path)));
    Ok(())
}

/// fsyncs a folder, so that the files created and renamed in it survive a power loss.
fn sync_dir(dir: &Path) -> Result<(), TrainError> {
    ember_data::sync_dir(dir).map_err(TrainError::io(dir))?;
    journal(|| format!("sync {}", file_name(dir)));
    Ok(())
}

fn rename(from: &Path, to: &Path) -> Result<(), TrainError> {
    std::fs::rename(from, to).map_err(TrainError::io(to))?;
    journal(|| format!("rename {} {}", file_name(from), file_name(to)));
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
thread_local! {
    /// What `save` did to the disk, in order, for the test of its durability order.
    static JOURNAL: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records a step of `save` in tests; nothing otherwise.
fn journal(event: impl FnOnce() -> String) {
    #[cfg(test)]
    JOURNAL.with(|j| j.borrow_mut().push(event()));
    #[cfg(not(test))]
    let _ = event;
}

/// Gets a run directory ready for a start or a resume: leftovers of killed writers removed
/// ([`remove_stale_temporaries`]) and a missing `latest` restored ([`recover_latest`]), so that
/// [`has_checkpoint`] then tells what a resume would find.
pub(crate) fn tidy_run_dir(run_dir: &Path) -> Result<(), TrainError> {
    remove_stale_temporaries(run_dir)?;
    recover_latest(run_dir)
}

/// Whether the run in `run_dir` has a checkpoint to resume from.
pub(crate) fn has_checkpoint(run_dir: &Path) -> bool {
    run_dir.join(CHECKPOINTS).join(LATEST).is_file()
}

/// Removes what killed writers left in `run_dir` and in its `checkpoints/`: checkpoint folders being
/// written (`.step-N.tmp-PID`) or replaced (`.step-N.old-PID`), and the temporary files of
/// `write_atomic` (`.NAME.tmp-PID`), each when process PID no longer runs. Nothing reads them, but
/// each holds up to a checkpoint's worth of disk, and one more is left by every kill.
///
/// Our own id counts as gone: this process has not yet written into the run, so a leftover with its
/// id is from an earlier process that had the same one (a restarted container starts again from the
/// same low ids). Where liveness cannot be told (no `/proc`), nothing is removed. A process of
/// another PID namespace writing into the same run is not seen; two writers of one run are not
/// supported anyway.
pub(crate) fn remove_stale_temporaries(run_dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let mut removed = Vec::new();
    for dir in [run_dir.to_path_buf(), run_dir.join(CHECKPOINTS)] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = leftover_pid(&name) else { continue };
            match process_gone(pid) {
                Some(true) => {}
                Some(false) => continue,
                None => {
                    tracing::debug!(name, pid, "cannot tell whether the writer of a temporary still runs; leaving it");
                    continue;
                }
            }
            let path = entry.path();
            let result = if entry.file_type().is_ok_and(|t| t.is_dir()) {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match result {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(TrainError::Io { path, err: e }),
            }
            tracing::info!(path = %path.display(), pid, "removed a temporary left by a process that no longer runs");
            removed.push(path);
        }
    }
    Ok(removed)
}

/// The writer's process id in the name of a leftover temporary: `.NAME.tmp-PID` or `.NAME.old-PID`.
fn leftover_pid(name: &str) -> Option<u32> {
    let (stem, pid) = name.strip_prefix('.')?.rsplit_once('-')?;
    if !(stem.ends_with(".tmp") || stem.ends_with(".old")) || pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` no longer runs (see [`remove_stale_temporaries`] for our own id); `None`
/// where this cannot be told.
fn process_gone(pid: u32) -> Option<bool> {
    if pid == std::process::id() {
        return Some(true);
    }
    if !Path::new("/proc/self").exists() {
        return None;
    }
    Some(!Path::new("/proc").join(pid.to_string()).exists())
}

/// Writes `checkpoints/latest` when it is missing, or names no checkpoint folder, but complete step
/// folders exist. A process killed after renaming its first checkpoint into place and before writing
/// `latest` leaves the first case (a folder is renamed into place only when complete); one killed
/// while replacing the very folder `latest` names (`.step-N.old-PID`) the second. Without this the
/// run would be stuck: a checkpoint to keep, so no restart, and no usable `latest`, so no resume.
/// The newest folder that opens is named.
fn recover_latest(run_dir: &Path) -> Result<(), TrainError> {
    let root = run_dir.join(CHECKPOINTS);
    let latest = root.join(LATEST);
    if let Ok(name) = std::fs::read_to_string(&latest) {
        if root.join(name.trim()).join(MODEL_CONFIG_FILE).is_file() {
            return Ok(());
        }
    }
    let Ok(entries) = std::fs::read_dir(&root) else { return Ok(()) };
    let mut steps: Vec<(u64, String)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| step_of(&n).map(|s| (s, n)))
        .collect();
    steps.sort();
    for (_, name) in steps.into_iter().rev() {
        let dir = root.join(&name);
        match Checkpoint::open(&dir) {
            Ok(_) => {
                ember_data::write_atomic(&latest, name.as_bytes())?;
                tracing::warn!(
                    dir = %dir.display(),
                    "{} was missing or named no checkpoint (a run killed while checkpointing); it now names {name}",
                    latest.display()
                );
                return Ok(());
            }
            Err(e) => tracing::warn!(dir = %dir.display(), "not naming it in {LATEST}: {e}"),
        }
    }
    Ok(())
}

/// Before a run without a checkpoint starts again from step 0: the logs of its earlier attempt
/// (killed before its first checkpoint) cover steps that are about to be trained again, and, being
/// appended to, would list them twice. The JSON-lines `logs` (`metrics.jsonl`, `samples.jsonl`) are
/// renamed to `*.aborted`, which nothing reads (kept to look at; an older one is replaced);
/// TensorBoard event files are deleted, since TensorBoard reads every file with `tfevents` in its
/// name, whatever its suffix. Says what it did in a warning.
pub(crate) fn set_aside_dead_attempt(run_dir: &Path, logs: &[&str]) -> Result<(), TrainError> {
    let Ok(entries) = std::fs::read_dir(run_dir) else { return Ok(()) };
    let events: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("tfevents") && e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .collect();
    let mut done = Vec::new();
    for name in logs {
        let path = run_dir.join(name);
        if path.is_file() {
            let aside = run_dir.join(format!("{name}.aborted"));
            std::fs::rename(&path, &aside).map_err(TrainError::io(&path))?;
            done.push(format!("{name} renamed to {name}.aborted"));
        }
    }
    for path in events {
        std::fs::remove_file(&path).map_err(TrainError::io(&path))?;
        done.push(format!("{} deleted", file_name(&path)));
    }
    if !done.is_empty() {
        tracing::warn!(
            run_dir = %run_dir.display(),
            "the run has no checkpoint (its last attempt stopped before the first one): starting it again \
             from step 0; the old attempt's logs: {}",
            done.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkdirs(root: &Path, names: &[&str]) {
        for n in names {
            std::fs::create_dir_all(root.join(n)).unwrap();
        }
    }

    fn names(root: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn prune_orders_by_step_number_past_a_million() {
        let dir = tempfile::tempdir().unwrap();
        mkdirs(dir.path(), &["step-999998", "step-999999", "step-1000000", "step-1000001", "other"]);
        prune(dir.path(), 2, "step-1000001").unwrap();
        assert_eq!(names(dir.path()), ["other", "step-1000000", "step-1000001"]);
        assert_eq!(step_of("step-000250"), Some(250));
        assert_eq!(step_of("step-"), None);
        assert_eq!(step_of("step-12a"), None);
        assert_eq!(step_of(".step-000001.tmp-12"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let root = run.join(CHECKPOINTS);
        // Above the largest pid_max Linux allows (2^22): no process has this id.
        let dead = 4_194_305u32;
        let live = std::os::unix::process::parent_id();
        let ours = std::process::id();
        mkdirs(
            &root,
            &[
                &format!(".step-000005.tmp-{dead}"),
                &format!(".step-000004.old-{dead}"),
                &format!(".step-000006.tmp-{ours}"),
                &format!(".step-000007.tmp-{live}"),
                "step-000003",
            ],
        );
        std::fs::write(root.join(format!(".step-000005.tmp-{dead}/model.toml")), "x").unwrap();
        std::fs::write(root.join(format!(".latest.tmp-{dead}")), "step-000005").unwrap();
        std::fs::write(run.join(format!(".metrics.jsonl.tmp-{dead}")), "").unwrap();
        std::fs::write(run.join("notes.tmp-1"), "").unwrap();
        let removed = remove_stale_temporaries(run).unwrap();
        assert_eq!(removed.len(), 5, "{removed:?}");
        assert_eq!(names(&root), [format!(".step-000007.tmp-{live}"), "step-000003".to_string()]);
        assert_eq!(names(run), [CHECKPOINTS, "notes.tmp-1"]);
        assert_eq!(leftover_pid(".step-000001.tmp-"), None);
        assert_eq!(leftover_pid(".step-000001.new-12"), None);
        assert_eq!(leftover_pid("step-000001.tmp-12"), None);
    }

    #[test]
    fn a_missing_latest_names_the_newest_complete_folder() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let tok = Tokenizer::train_char("abc");
        save(run, data(1, &tok), 5).unwrap();
        save(run, data(2, &tok), 5).unwrap();
        // A folder that does not open is not named.
        mkdirs(&run.join(CHECKPOINTS), &["step-000003"]);
        std::fs::remove_file(run.join(CHECKPOINTS).join(LATEST)).unwrap();
        assert!(!has_checkpoint(run));
        tidy_run_dir(run).unwrap();
        assert!(has_checkpoint(run));
        assert_eq!(std::fs::read_to_string(run.join(CHECKPOINTS).join(LATEST)).unwrap(), "step-000002");
        // A latest naming a folder that is gone.
        std::fs::write(run.join(CHECKPOINTS).join(LATEST), "step-000007").unwrap();
        tidy_run_dir(run).unwrap();
        assert_eq!(std::fs::read_to_string(run.join(CHECKPOINTS).join(LATEST)).unwrap(), "step-000002");
        // Nothing to recover from: no latest is made up.
        let empty = tempfile::tempdir().unwrap();
        tidy_run_dir(empty.path()).unwrap();
        assert!(!has_checkpoint(empty.path()));
    }

    #[test]
    fn save_syncs_each_step_before_the_next_depends_on_it() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::train_char("abc");
        save(dir.path(), data(1, &tok), 1).unwrap();
        JOURNAL.with(|j| j.borrow_mut().clear());
        save(dir.path(), data(2, &tok), 1).unwrap();
        let events = JOURNAL.with(|j| j.borrow().clone());
        let at = |prefix: &str| {
            events.iter().position(|e| e.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` in {events:?}"))
        };
        let files: Vec<usize> =
            events.iter().enumerate().filter(|(_, e)| e.starts_with("file ")).map(|(i, _)| i).collect();
        assert_eq!(files.len(), 3, "{events:?}");
        let tmp = format!(".step-000002.tmp-{}", std::process::id());
        let (sync_tmp, rename) = (at(&format!("sync {tmp}")), at(&format!("rename {tmp} step-000002")));
        let (sync_root, latest, prune) = (at("sync checkpoints"), at("latest step-000002"), at("prune step-000001"));
        assert!(files.iter().all(|&f| f < sync_tmp), "{events:?}");
        assert!(sync_tmp < rename && rename < sync_root && sync_root < latest && latest < prune, "{events:?}");
        assert_eq!(names(&dir.path().join(CHECKPOINTS)), [LATEST, "step-000002"]);
    }

    fn data(step: usize, tokenizer: &Tokenizer) -> CheckpointData<'_> {
        static CONFIG: std::sync::OnceLock<ModelConfig> = std::sync::OnceLock::new();
        let model_config = CONFIG.get_or_init(|| ModelConfig {
            d_model: 8,
            n_layers: 1,
            n_heads: 2,
            n_kv_heads: Some(1),
            d_ff: 16,
            ..ModelConfig::tiny(3, 8)
        });
        CheckpointData {
            step,
            model_config,
            weights: vec![("w".into(), TensorData::new(vec![1.0f32, 2.0], [2]))],
            adapters_only: false,
            tokenizer,
            tokenizer_dir: None,
            hf_config: None,
            training: None,
        }
    }
}
