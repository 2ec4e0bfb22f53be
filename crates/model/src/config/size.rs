//! What a config costs without building it: its parameters and its FLOPs per token, each the sum
//! of what its parts answer.

use super::{ModelConfig, Positions};

impl ModelConfig {
    /// Total number of parameters, computed from the config alone: every block's (its attention,
    /// feed-forward part and norms count their own), the embedding `V·D`, a learned position
    /// table `T·D`, the final norm and an untied head `D·V`.
    pub fn num_params(&self) -> u64 {
        let (d, v) = (self.d_model as u64, self.vocab_size as u64);
        let blocks: u64 = (0..self.n_layers).map(|layer| self.block(layer).params()).sum();
        let positions = if self.positions == Positions::Learned { self.max_seq_len as u64 * d } else { 0 };
        let head = if self.tie_embeddings { 0 } else { d * v };
        v * d + positions + blocks + self.norm().params() + head
    }

    /// Parameters that take part in a token's matmuls: every projection and the LM head (the
    /// embedding table when tied); of a mixture of experts, the router, the `k` experts a token
    /// runs through and the shared expert; of latent attention, its expanded form's projections.
    /// Not the embedding lookup, the norm gains or the biases. This is N in 6N.
    pub fn matmul_params(&self) -> u64 {
        let blocks: u64 = (0..self.n_layers).map(|layer| self.block(layer).matmul_params()).sum();
        blocks + self.d_model as u64 * self.vocab_size as u64
    }

    /// The f32 values autodiff keeps per token for a training step at context `seq_len`, summed
    /// over the blocks (each block's attention, feed-forward part and norms count their own: see
    /// `BlockConfig::activations`). What a training run's activation memory is estimated from.
    pub fn activations_per_token(&self, seq_len: usize) -> u64 {
        (0..self.n_layers).map(|layer| self.block(layer).activations(seq_len)).fold(0, u64::saturating_add)
    }

    /// Forward FLOPs per token at context `seq_len`: `2N + 4·L·T·(H·Dh)` (PaLM appendix B; a
    /// multiply-add is 2 FLOPs; the attention term counts the full T×T score matrix, as MFU does).
    /// `H·Dh` is the attention width, equal to `d_model` for Llama and Qwen2.
    pub(crate) fn forward_flops_per_token(&self, seq_len: usize) -> f64 {
        let attn_width = self.attention(0).part().width();
        2.0 * self.matmul_params() as f64 + 4.0 * self.n_layers as f64 * seq_len as f64 * attn_width
    }

    /// Training FLOPs per token (forward and backward): `6N + 12·L·T·(H·Dh)`.
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        3.0 * self.forward_flops_per_token(seq_len)
    }
}
