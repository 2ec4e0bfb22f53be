//! A Llama-style decoder-only transformer, generic over the Burn backend.
//!
//! Shape letters: B batch, T new positions in this call, S key positions (cache + T),
//! D d_model, H n_heads, K n_kv_heads, Dh head_dim, F d_ff, V vocab_size, N rows of a folded batch.

pub mod attention;
pub mod block;
pub mod config;
pub mod decoder;
pub mod init;
pub mod kv_cache;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod ops;
pub mod rope;
pub mod sample;
pub mod weights;

pub use block::Block;
pub use config::{ConfigError, ModelConfig, RopeLayout};
pub use decoder::Decoder;
pub use kv_cache::KvCache;

/// The backend the unit tests run on.
#[cfg(test)]
pub(crate) type TestBackend = burn::backend::Flex;
