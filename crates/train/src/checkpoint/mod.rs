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
//!     inputs.json            what the run read: its data file's digest and rows (and a
//!                            token stream's shards), a LoRA run's base's weights (`inputs.rs`)
//! <run_dir>/checkpoints/latest   the name of the newest complete checkpoint
//! <run_dir>/best/            runs that evaluate: the weights of the best val loss so far, with
//!     model.toml, tokenizer, config.toml, inputs.json and best.json (its step and val loss); no optimizer or
//!     loop state (it is for sample, eval and export, not for resuming)
//! ```
//! A checkpoint is written in a temporary folder and renamed into place, then `latest` is replaced
//! atomically: a crash leaves the previous checkpoint as the latest, never a partial one. Each step
//! is fsynced before the next depends on it (files, their folder, its rename, `latest`), and old
//! checkpoints are pruned only after that, so a power loss cannot either: without the syncs the
//! file system may persist the renames before the data, or the pruning before the new `latest`.
//!
//! A killed writer leaves `.step-N.tmp-PID` (or `.step-N.old-PID`) behind;
//! [`run_dir::remove_stale_temporaries`] clears them at the next start.
//!
//! This module is the format (file names, the loop state, what a checkpoint holds) and reading it;
//! `save.rs` writes one durably; `run_dir.rs` gets a run directory ready to start or resume.

mod inputs;
mod run_dir;
mod save;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, TensorData};
use ember_data::Tokenizer;
use ember_model::weights::{assign, from_safetensors_releasing, named_tensors};
use ember_model::{Decoder, ModelConfig};
use serde::{Deserialize, Serialize};

use crate::config::{InitSource, TrainConfig};
use crate::error::TrainError;
use crate::schedule::LrSchedule;

pub use inputs::{BaseRecord, DataRecord, FileDigest, RunInputs, ShardRecord};
pub(crate) use run_dir::{has_checkpoint, set_aside_dead_attempt, tidy_run_dir};
pub use save::save;
pub(crate) use save::save_best;
// The names live in a leaf module, which the config reads too.
pub(crate) use crate::run_layout::{
    ADAPTER_FILE, BEST_DIR, BEST_FILE, HF_CONFIG_FILE, INPUTS_FILE, MODEL_CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE,
    STATE_FILE,
};
pub use crate::run_layout::{CHECKPOINTS, CONFIG_FILE, LATEST, TOKENIZER_EXTRAS, TOKENIZER_FILE};

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
    /// The step of `best_val_loss` (whose weights `<run_dir>/best` holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_step: Option<usize>,
    /// The training rows are read in epochs (examples: a permutation of them each epoch) rather
    /// than drawn at random (token windows; and runs from before epochs, which resume as they began).
    #[serde(default)]
    pub epochs: bool,
}

/// `best/best.json`: which evaluation the best checkpoint comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct BestRecord {
    pub step: usize,
    pub val_loss: f64,
}

/// The record of the best checkpoint of the run in `run_dir`, where it has one.
#[cfg(test)]
pub(crate) fn read_best(run_dir: &Path) -> Option<BestRecord> {
    let text = std::fs::read_to_string(run_dir.join(BEST_DIR).join(BEST_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

fn one() -> usize {
    1
}

impl TrainState {
    pub(crate) fn new(step: usize, schedule: LrSchedule, sampler_seed: u64, next_stream: u64) -> Self {
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
            best_step: None,
            epochs: false,
        }
    }
}

/// The training-run part of a checkpoint.
pub struct TrainingData<'a> {
    pub optimizer: Vec<(String, TensorData)>,
    pub state: &'a TrainState,
    pub config: &'a TrainConfig,
    /// What the run read (`inputs.json`).
    pub inputs: &'a RunInputs,
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

/// The folder of the checkpoint of step `step` in `run_dir`.
pub(crate) fn step_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join(CHECKPOINTS).join(step_dir_name(step))
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
        if ember_hf::gguf::is_gguf(path).unwrap_or(false) {
            return Err(not(format!(
                "a GGUF file; import it into a run directory first (`ember import {} --out DIR`) and give DIR",
                path.display()
            )));
        }
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
    if path.join("config.json").is_file() {
        return Err(not(format!(
            "a Hugging Face model folder (config.json); import it into a run directory first (`ember import {} \
             --out DIR`) and give DIR",
            path.display()
        )));
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
    /// What the run read (`inputs.json`), where it was recorded (runs of an older ember have none).
    pub inputs: Option<RunInputs>,
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
        // A training checkpoint has both; the best checkpoint (`best/`) the config alone.
        if state.is_some() && config.is_none() {
            return Err(damaged(format!("{STATE_FILE} without {CONFIG_FILE}")));
        }
        if !dir.join(MODEL_FILE).is_file() && !dir.join(ADAPTER_FILE).is_file() {
            return Err(damaged(format!("neither {MODEL_FILE} nor {ADAPTER_FILE} is there")));
        }
        if state.is_some() && !dir.join(OPTIMIZER_FILE).is_file() {
            return Err(damaged(format!("{OPTIMIZER_FILE} is missing")));
        }
        // No record: a checkpoint of an ember from before the records.
        let inputs = match std::fs::read_to_string(dir.join(INPUTS_FILE)) {
            Ok(text) => Some(serde_json::from_str(&text).map_err(|e| damaged(format!("{INPUTS_FILE}: {e}")))?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(damaged(format!("{INPUTS_FILE}: {e}"))),
        };
        Ok(Self { dir, model_config, tokenizer, state, config, inputs })
    }

    /// The training config, for what needs a training run's checkpoint.
    pub(crate) fn train_config(&self) -> Result<&TrainConfig, TrainError> {
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

    /// The Hugging Face config.json the model came from, if any. One that cannot be read as JSON
    /// is warned of (what an export takes from it, the name, licence and pre-tokenizer, is lost).
    pub fn hf_config(&self) -> Option<serde_json::Value> {
        let path = self.dir.join(HF_CONFIG_FILE);
        let text = std::fs::read_to_string(&path).ok()?;
        serde_json::from_str(&text)
            .inspect_err(|e| {
                tracing::warn!(
                    "{}: not JSON ({e}): ignored, and with it the model's name, licence and pre-tokenizer",
                    path.display()
                )
            })
            .ok()
    }

    /// The `init_from` source a LoRA checkpoint's adapters sit on; `None` for a full checkpoint.
    pub(crate) fn adapter_source(&self) -> Result<Option<InitSource>, TrainError> {
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

    /// Whether this is a full checkpoint whose projection weights are stored in bf16 (`ember import
    /// --dtype bf16`): inference keeps them so ([`ember_model::Decoder::with_bf16_projections`]).
    pub(crate) fn stores_bf16_projections(&self) -> bool {
        let model = self.dir.join(MODEL_FILE);
        model.is_file() && crate::init::projections_in_bf16(&[model])
    }

    /// The decoder of a full checkpoint, from its own weights.
    pub(crate) fn own_decoder<B: ember_kernels::EmberBackend>(
        &self,
        device: &Device<B>,
    ) -> Result<Decoder<B>, TrainError> {
        let path = self.dir.join(MODEL_FILE);
        // Sizes first: a model.toml that describes more than its weights file is refused
        // before the model is allocated.
        let bytes = std::fs::metadata(&path).map_err(TrainError::io(&path))?.len();
        ember_model::weights::check_model_size(&self.model_config, &path.display().to_string(), bytes)
            .map_err(|e| TrainError::Checkpoint { path: self.dir.join(MODEL_CONFIG_FILE), message: e.to_string() })?;
        let model = Decoder::empty(&self.model_config, device)?;
        Ok(assign(model, read_tensors(&path)?, &path.display().to_string(), false)?)
    }

    /// A LoRA checkpoint's adapters attached to `base`, the model its `init_from` source gives.
    pub(crate) fn with_adapters<B: ember_kernels::EmberBackend>(
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

/// The tensors of a weights file, each with NaN or infinite values warned of (which tensor, how
/// many): a model of such weights computes NaN, so sampling and serving say so before it does.
fn read_tensors(path: &Path) -> Result<BTreeMap<String, TensorData>, TrainError> {
    let bytes = ember_data::FileBytes::open(path).map_err(TrainError::io(path))?;
    let source = path.display().to_string();
    let tensors = from_safetensors_releasing(&bytes, &source, |inner| bytes.release_bytes(inner))?.0;
    for (name, data) in &tensors {
        ember_model::weights::warn_non_finite(&source, name, data);
    }
    Ok(tensors)
}

/// Test helpers shared by the writing and the run-directory tests.
#[cfg(test)]
mod testing {
    use super::*;

    pub(super) fn mkdirs(root: &Path, names: &[&str]) {
        for n in names {
            std::fs::create_dir_all(root.join(n)).unwrap();
        }
    }

    pub(super) fn names(root: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    pub(super) fn data(step: usize, tokenizer: &Tokenizer) -> CheckpointData<'_> {
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
