//! Checkpoints: everything a stopped run needs to continue exactly, in one folder per step.
//!
//! ```text
//! <run_dir>/checkpoints/step-000250/
//!     model.safetensors      parameters by path, Burn layout (linear weights [in, out]), f32
//!     optimizer.safetensors  AdamW moments, `<path>.exp_avg` / `<path>.exp_avg_sq`
//!     state.json             step, LR schedule, sampler seed and data position, best val loss, clock
//!     config.toml            the resolved training config
//!     tokenizer.json
//! <run_dir>/checkpoints/latest   the name of the newest complete checkpoint
//! ```
//! A checkpoint is written in a temporary folder and renamed into place, then `latest` is replaced
//! atomically: a crash leaves the previous checkpoint as the latest, never a partial one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{backend::Backend, Device, TensorData};
use ember_data::Tokenizer;
use ember_model::weights::{assign, from_safetensors, to_safetensors};
use ember_model::Decoder;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::schedule::LrSchedule;

pub const CHECKPOINTS: &str = "checkpoints";
pub const LATEST: &str = "latest";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const CONFIG_FILE: &str = "config.toml";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
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
        }
    }
}

/// What goes into a checkpoint.
pub struct CheckpointData<'a> {
    pub model: Vec<(String, TensorData)>,
    pub optimizer: Vec<(String, TensorData)>,
    pub state: &'a TrainState,
    pub config: &'a TrainConfig,
    pub tokenizer: &'a Tokenizer,
}

fn step_dir_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// Writes a checkpoint of `data.state.step` and makes it the latest; keeps the newest `keep`.
pub fn save(run_dir: &Path, data: CheckpointData<'_>, keep: usize) -> Result<PathBuf, TrainError> {
    let root = run_dir.join(CHECKPOINTS);
    std::fs::create_dir_all(&root).map_err(TrainError::io(&root))?;
    let name = step_dir_name(data.state.step);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(TrainError::io(&tmp))?;
    let meta = |kind: &str| {
        Some(std::collections::HashMap::from([
            ("format".to_string(), "ember".to_string()),
            ("content".to_string(), kind.to_string()),
            ("step".to_string(), data.state.step.to_string()),
        ]))
    };
    let files: [(&str, Vec<u8>); 5] = [
        (MODEL_FILE, to_safetensors(&data.model, meta("model"))),
        (OPTIMIZER_FILE, to_safetensors(&data.optimizer, meta("adamw"))),
        (STATE_FILE, serde_json::to_vec_pretty(data.state).expect("state serialises")),
        (CONFIG_FILE, data.config.to_toml().into_bytes()),
        (TOKENIZER_FILE, data.tokenizer.to_json()?.into_bytes()),
    ];
    for (file, bytes) in files {
        ember_data::write_atomic(&tmp.join(file), &bytes)?;
    }
    let dest = root.join(&name);
    if dest.exists() {
        // A resumed run that passes the same step again: replace the older copy.
        let old = root.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(&dest, &old).map_err(TrainError::io(&dest))?;
        std::fs::remove_dir_all(&old).map_err(TrainError::io(&old))?;
    }
    std::fs::rename(&tmp, &dest).map_err(TrainError::io(&dest))?;
    ember_data::write_atomic(&root.join(LATEST), name.as_bytes())?;
    prune(&root, keep, &name)?;
    Ok(dest)
}

/// Deletes all but the newest `keep` step folders (never `current`).
fn prune(root: &Path, keep: usize, current: &str) -> Result<(), TrainError> {
    let mut steps: Vec<String> = std::fs::read_dir(root)
        .map_err(TrainError::io(root))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-") && n[5..].chars().all(|c| c.is_ascii_digit()))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for name in steps.into_iter().take(excess).filter(|n| n != current) {
        let dir = root.join(&name);
        std::fs::remove_dir_all(&dir).map_err(TrainError::io(&dir))?;
    }
    Ok(())
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
    if path.join(STATE_FILE).is_file() {
        return Ok(path.into());
    }
    let latest = path.join(CHECKPOINTS).join(LATEST);
    if latest.is_file() {
        let name = std::fs::read_to_string(&latest).map_err(TrainError::io(&latest))?;
        let dir = path.join(CHECKPOINTS).join(name.trim());
        if dir.join(STATE_FILE).is_file() {
            return Ok(dir);
        }
        return Err(not(format!("{} names `{}`, which is not a checkpoint", latest.display(), name.trim())));
    }
    Err(not(format!(
        "no {STATE_FILE} (a checkpoint folder) and no {CHECKPOINTS}/{LATEST} (a run directory with checkpoints)"
    )))
}

/// A checkpoint's small files, read and checked; tensors are read on demand.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: TrainState,
    pub config: TrainConfig,
    pub tokenizer: Tokenizer,
}

impl Checkpoint {
    /// Opens a run directory (its latest checkpoint) or a checkpoint folder.
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        let dir = resolve(path)?;
        let damaged = |message: String| TrainError::Checkpoint { path: dir.clone(), message };
        let state_path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&state_path).map_err(TrainError::io(&state_path))?;
        let state: TrainState = serde_json::from_str(&text).map_err(|e| damaged(format!("{STATE_FILE}: {e}")))?;
        if state.format_version != FORMAT_VERSION {
            return Err(damaged(format!("format version {}, this ember reads {FORMAT_VERSION}", state.format_version)));
        }
        let config = TrainConfig::from_file(&dir.join(CONFIG_FILE))?;
        let tokenizer = Tokenizer::from_file(&dir.join(TOKENIZER_FILE))?;
        for file in [MODEL_FILE, OPTIMIZER_FILE] {
            if !dir.join(file).is_file() {
                return Err(damaged(format!("{file} is missing")));
            }
        }
        Ok(Self { dir, state, config, tokenizer })
    }

    pub fn model_tensors(&self) -> Result<BTreeMap<String, TensorData>, TrainError> {
        read_tensors(&self.dir.join(MODEL_FILE))
    }

    pub fn optimizer_tensors(&self) -> Result<BTreeMap<String, TensorData>, TrainError> {
        read_tensors(&self.dir.join(OPTIMIZER_FILE))
    }

    /// The decoder with this checkpoint's weights.
    pub fn decoder<B: Backend>(&self, device: &Device<B>) -> Result<Decoder<B>, TrainError> {
        let model = Decoder::new(&self.config.model, 0, device)?;
        let path = self.dir.join(MODEL_FILE);
        Ok(assign(model, self.model_tensors()?, &path.display().to_string(), false)?)
    }
}

fn read_tensors(path: &Path) -> Result<BTreeMap<String, TensorData>, TrainError> {
    let bytes = std::fs::read(path).map_err(TrainError::io(path))?;
    Ok(from_safetensors(&bytes, &path.display().to_string())?.0)
}
