//! `ember eval --tasks`: benchmark accuracy as lm-evaluation-harness measures it (the same
//! prompts, few-shot draws, tokenization and metrics), over local copies of the standard sets,
//! with each multiple-choice context computed once for all its choices.
//!
//! - [`task`]: what a task is; [`tasks`]: the tasks, one function each;
//! - [`score`]: log-likelihoods through the model's paged KV cache, and a slow reference;
//! - [`run`]: a task end to end; [`metrics`]: accuracies, standard errors, the CORE aggregate;
//! - [`schema`]: a JSON Schema file that generated answers follow (`--json-schema`).

mod error;
pub mod generate;
pub mod metrics;
pub mod pyrandom;
pub mod run;
pub mod schema;
pub mod score;
pub mod task;
pub mod tasks;

pub use error::{DocError, EvalError};
pub use run::{evaluate, prepare, Encoding, Options, Prepared, TaskResult};
pub use task::eval_dir;
