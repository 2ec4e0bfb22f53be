//! Hugging Face checkpoints in and out: `config.json` and safetensors (single or sharded) of the
//! Llama, Qwen2, Qwen3, Mistral, Gemma 3, GPT-2, Mixtral, Qwen-MoE, OLMoE and DeepSeek families,
//! mapped onto ember's [`ember_model::Decoder`]; and llama.cpp's GGUF files ([`gguf`]), read as
//! Hugging Face models.
//!
//! Hugging Face stores linear weights `[out, in]` and ember `[in, out]`: what a family is
//! ([`family`]: its config keys, parts and tensor names), each family's own file ([`families`]),
//! the transposes and the RoPE layout live here and nowhere else.

pub mod config_json;
pub mod config_map;
pub mod error;
pub mod families;
pub mod family;
pub mod gguf;
pub mod weights;

pub use config_map::{expressible, from_model_config, to_model_config};
pub use error::HfError;
pub use families::FAMILIES;
pub use family::{Architecture, Family};
pub use weights::{export, hf_tensors, import, import_tensors, ExportReport, Imported};
