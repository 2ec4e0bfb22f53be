//! The names of a run directory's folders and files (the layout `checkpoint` documents). A leaf:
//! the checkpoint writes and reads them, and the config needs two of them to know a run's own copy
//! of itself (`<run_dir>/config.toml` beside `checkpoints/`) without importing the checkpoint.

pub const CHECKPOINTS: &str = "checkpoints";
pub const LATEST: &str = "latest";
pub(crate) const MODEL_FILE: &str = "model.safetensors";
pub(crate) const ADAPTER_FILE: &str = "adapter.safetensors";
pub(crate) const MODEL_CONFIG_FILE: &str = "model.toml";
pub(crate) const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub(crate) const STATE_FILE: &str = "state.json";
pub const CONFIG_FILE: &str = "config.toml";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub(crate) const HF_CONFIG_FILE: &str = "hf_config.json";
/// The file in a checkpoint folder that records what the run read (`checkpoint/inputs.rs`).
pub(crate) const INPUTS_FILE: &str = "inputs.json";
/// The run directory's folder of the best checkpoint (by val loss), and its record.
pub(crate) const BEST_DIR: &str = "best";
pub(crate) const BEST_FILE: &str = "best.json";
/// Files of a tokenizer folder that travel with tokenizer.json: the chat template, and the
/// generation settings the model's authors recommend (Hugging Face's `generation_config.json`, read
/// by `ember_serve::sampling`).
pub const TOKENIZER_EXTRAS: [&str; 3] = ["tokenizer_config.json", "chat_template.jinja", "generation_config.json"];
