//! Training: config -> data -> loop (loss, AdamW, schedule) -> metrics and checkpoints.
//!
//! Read in this order: `config`, `data`, `loss`/`eval`, `optim`, `schedule`, `trainer`, `metrics`,
//! `checkpoint`.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod eval;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod schedule;
pub mod trainer;

pub use checkpoint::Checkpoint;
pub use config::TrainConfig;
pub use error::TrainError;
pub use trainer::{train, TrainOptions, TrainSummary};
