//! Hugging Face checkpoints in and out: `config.json` and safetensors (single or sharded) of the
//! Llama, Qwen2 and Mistral families, mapped onto ember's [`ember_model::Decoder`]; and llama.cpp's
//! GGUF files ([`gguf`]), read as Hugging Face models.
//!
//! Hugging Face stores linear weights `[out, in]` and ember `[in, out]`: the transposes, the key
//! table and the RoPE layout live here and nowhere else.

pub mod config_map;
pub mod error;
pub mod gguf;
pub mod weights;

pub use config_map::{from_model_config, to_model_config, Architecture};
pub use error::HfError;
pub use weights::{export, hf_tensors, import, import_tensors, ExportReport, Imported};
