//! Hugging Face checkpoints in and out: `config.json` and safetensors (single or sharded) of the
//! Llama, Qwen2, Qwen3, Mistral, Gemma 3 and GPT-2 families, mapped onto ember's
//! [`ember_model::Decoder`]; and llama.cpp's GGUF files ([`gguf`]), read as Hugging Face models.
//!
//! Hugging Face stores linear weights `[out, in]` and ember `[in, out]`: the family table
//! ([`family`]: each family's config keys, parts and tensor names), the transposes and the RoPE
//! layout live here and nowhere else.

pub mod config_map;
pub mod error;
pub mod family;
pub mod gguf;
pub mod weights;

pub use config_map::{expressible, from_model_config, to_model_config};
pub use error::HfError;
pub use family::{Architecture, Family, FAMILIES};
pub use weights::{export, hf_tensors, import, import_tensors, ExportReport, Imported};
