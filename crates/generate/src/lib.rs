//! Generation over an ember [`Decoder`](ember_model::Decoder): the sampler (temperature, top-k,
//! top-p, min-p, repetition penalty), greedy and sampled generation of one prompt or a batch through
//! the paged cache, and the continuous-batching engine the server drives. The model crate below
//! computes logits; this crate decides what comes next.

pub mod adjust;
pub mod constraint;
pub mod engine;
pub mod logprobs;
pub mod sample;

/// The backend the unit tests run on.
#[cfg(test)]
pub(crate) type TestBackend = burn::backend::Flex;
