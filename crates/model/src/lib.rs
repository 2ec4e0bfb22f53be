//! A Llama-style decoder-only transformer, generic over the Burn backend.
//!
//! Shape letters: B batch, T new positions in this call, S key positions (cache + T),
//! D d_model, H n_heads, K n_kv_heads, Dh head_dim, F d_ff, V vocab_size, N rows of a folded batch.

mod attention;
mod block;
mod config;
mod decoder;
mod init;
mod keys;
mod kinds;
mod kv_cache;
mod linear;
pub mod lora;
mod mla;
mod mlp;
pub mod moe;
mod norm;
pub mod weights;

pub use block::{Block, SelfAttention};
pub use config::{ModelConfig, RopeLayout, RopeScaling};
pub use decoder::{stored::KeepError, Decoder};
pub use ember_kernels::documents::{Documents, DocumentsError};
pub use ember_kernels::Compute;
pub use kinds::{ConfigError, MlpKind, NormKind, Positions};
pub use kv_cache::KvCache;
pub use linear::Weight;
pub use lora::LoraConfig;
pub use mla::MlaConfig;
pub use moe::{MoeConfig, Scoring};

pub(crate) use ember_kernels::to_dtype;

/// Inverted dropout with probability `p`, active only while autodiff records (training).
pub(crate) fn dropout<B: burn::tensor::backend::Backend, const D: usize>(
    x: burn::tensor::Tensor<B, D>,
    p: f64,
) -> burn::tensor::Tensor<B, D> {
    if p == 0.0 || !B::ad_enabled(&x.device()) {
        return x;
    }
    let keep = x.random_like(burn::tensor::Distribution::Bernoulli(1.0 - p));
    x * keep.div_scalar(1.0 - p)
}

/// The backend the unit tests run on.
#[cfg(test)]
pub(crate) type TestBackend = burn::backend::Flex;
