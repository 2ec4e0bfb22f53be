//! Training: config -> data -> loop (loss, AdamW, schedule) -> metrics and checkpoints.
//!
//! Read in this order: `config`, `data`, `eval`, `precision`, `optim`, `schedule`, `trainer`,
//! `metrics`, `checkpoint`; `flops` and `bench` measure.

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod distributed;
pub mod error;
pub mod eval;
pub mod flops;
pub mod init;
pub mod memory;
pub mod metrics;
pub mod muon;
pub mod optim;
pub mod perplexity;
pub mod precision;
pub mod preference;
pub mod schedule;
pub mod selfcheck;
pub mod step;
pub mod tensorboard;
#[cfg(test)]
mod testing;
pub mod trainer;

pub use checkpoint::Checkpoint;
pub use config::{ConfigFile, InitSource, TrainConfig};
pub use error::{InvalidConfig, TrainError};
pub use init::{ResolvedConfig, ResolvedInit};
pub use trainer::{train, RunEnd, TrainOptions, TrainSummary, ValPoint};
