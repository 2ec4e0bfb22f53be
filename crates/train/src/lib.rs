//! Training: config -> data -> loop (loss, AdamW, schedule) -> metrics and checkpoints.
//!
//! Read in this order: `config`, `data`, `eval`, `objective` (what a step optimizes), `precision`,
//! `optim`, `schedule`, `step`, `trainer`, `metrics`, `checkpoint`; `flops` and `bench` measure.

pub mod bench;
pub mod calibration;
pub mod checkpoint;
mod collective;
pub mod config;
pub mod data;
pub mod distributed;
pub mod error;
mod eval;
pub mod flops;
mod init;
pub mod memory;
pub mod metrics;
mod muon;
mod objective;
mod optim;
pub mod perplexity;
pub mod precision;
pub mod preference;
pub mod rl;
mod run_layout;
mod schedule;
pub mod selfcheck;
mod step;
mod tensorboard;
#[cfg(test)]
mod testing;
mod trainer;

pub use checkpoint::Checkpoint;
pub use config::{ConfigFile, InitSource, TrainConfig};
pub use error::{InvalidConfig, TrainError};
pub use init::{ResolvedConfig, ResolvedInit};
pub use trainer::{train, RunEnd, TrainOptions, TrainSummary, ValPoint};
