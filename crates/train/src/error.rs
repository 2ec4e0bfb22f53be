use std::path::PathBuf;

use ember_data::DataError;
use ember_model::weights::WeightsError;
use ember_model::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}: {}{message}", path.display(), key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Config { path: PathBuf, key: Option<String>, message: String },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("{path}: not a checkpoint: {reason}")]
    NotACheckpoint { path: PathBuf, reason: String },
    #[error("{path}: damaged checkpoint: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error(
        "run directory {path} already holds a run with a checkpoint; pass --resume to continue it, \
         or choose another --run-dir"
    )]
    RunExists { path: PathBuf },
    #[error("cannot resume {path}: {message}")]
    Resume { path: PathBuf, message: String },
    #[error("training diverged at step {step}: loss is {loss}; lower schedule.lr or set optim.grad_clip")]
    Diverged { step: usize, loss: f64 },
    #[error("init_from = \"{spec}\": {message}")]
    InitFrom { spec: String, message: String },
    #[error(
        "the run needs about {need} but the device has {have} available ({terms}); lower train.batch_size \
         or train.seq_len, set train.activation_checkpointing = true or train.precision = \"bf16\", or \
         use a larger device"
    )]
    DoesNotFit { need: String, have: String, terms: String },
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistError),
    #[error("model.vocab_size ({config}) is smaller than the tokenizer's vocabulary ({tokenizer})")]
    VocabTooSmall { config: usize, tokenizer: usize },
}

impl TrainError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> TrainError {
        let path = path.into();
        move |err| TrainError::Io { path, err }
    }
}
