//! Will a config fit? An estimate of training memory as a table of named terms (llm.c's habit of
//! listing every buffer), checked against what the device has before the first step, so that a
//! config too big fails with a message instead of an allocation failure or swapping.

use serde::Serialize;

use crate::config::TrainConfig;

#[derive(Debug, Clone, Serialize)]
pub struct MemoryEstimate {
    /// `(what, bytes)`, largest first.
    pub terms: Vec<(String, u64)>,
    pub total: u64,
}

/// Training memory of `config` in bytes: f32 weights (LoRA adapters besides), gradients and AdamW
/// moments for the trained parameters, the activations autodiff keeps for one micro-batch, and a
/// checkpoint's copy of what it saves.
///
/// Activations per token, in f32 (this implementation), as each block's parts answer
/// ([`ember_model::ModelConfig::activations_per_token`]): for a dense Llama block the block input
/// and two norm outputs (3D), q, k, v and their rotated copies (2·H·Dh + 3·K·Dh), the attention
/// output and projection (2·H·Dh), the MLP's gate, up, activation and product (4F), its output
/// (D), and the `[T, T]` score and probability matrices per head (2·H·T); experts count the `k`
/// a token runs through, latent attention its own widths. Low-precision compute keeps cast copies
/// of the GEMM inputs besides (counted as half again, in 2 bytes). The LM head's loss adds a
/// `[D, V]` gradient and up to 24M logits (three tiles of the composition, or the CPU kernel's block
/// of rows), and in low precision the weight packed twice in 2 bytes (the CPU's bf16 GEMMs);
/// preference tuning holds the whole logits three times over (`[B·T, V]`).
pub fn estimate(config: &TrainConfig, trainable: u64) -> MemoryEstimate {
    estimate_keeping(config, trainable, (0, 0))
}

/// [`estimate`] of a LoRA run whose base keeps `kept = (weights, bytes)` of its projections in a
/// quantized storage type (`init_from = "gguf:FILE"`: [`crate::ResolvedInit::kept_quantized`]).
pub(crate) fn estimate_keeping(config: &TrainConfig, trainable: u64, kept: (u64, u64)) -> MemoryEstimate {
    // In u128 and saturated: every size is bounded by validation, but a product of bounds may still
    // pass 2^64, and a wrapped estimate would wave a config through.
    let m = &config.model;
    let (d, l) = (m.d_model as u128, m.n_layers as u128);
    let (b, t) = (config.train.batch_size as u128, config.seq_len() as u128);
    let tokens = b * t;
    let n = m.num_params() as u128;
    let trainable = trainable as u128;
    let mut act = 4 * tokens * m.activations_per_token(config.seq_len()) as u128;
    if config.train.precision != crate::config::Precision::F32 {
        act += act / 4; // half again, at 2 bytes a value
    }
    if config.train.activation_checkpointing {
        act /= 2; // elementwise outputs are recomputed; GEMM outputs and scores stay
    }
    let mut loss = 4 * (d * m.vocab_size as u128 + 3 * (8 << 20));
    if config.preference.is_some() || config.rl.is_some() {
        // Pairs are scored through the whole `[B·T, V]` logits: them, their log-softmax and its
        // gradient.
        loss += 3 * 4 * tokens * m.vocab_size as u128;
    }
    if config.train.precision != crate::config::Precision::F32 {
        loss += 4 * d * m.vocab_size as u128;
    }
    let sat = |x: u128| u64::try_from(x).unwrap_or(u64::MAX);
    // Adapters are parameters besides the base's; a checkpoint copies what it saves (the trained
    // weights — the adapters alone under LoRA — and the moments) and serialises the copy whole.
    let (adapters, saved) = match config.lora {
        Some(_) => (4 * trainable, 4 * trainable),
        None => (0, 4 * n),
    };
    // LoRA on a GGUF file keeps the blocks' quantized projections in their stored types.
    let (kept, kept_bytes) = match config.lora {
        Some(_) => (kept.0 as u128, kept.1 as u128),
        None => (0, 0),
    };
    let mut terms = vec![
        ("weights (f32)".to_string(), sat(4 * (n - kept.min(n)))),
        ("quantized projections (as stored)".to_string(), sat(kept_bytes)),
        ("LoRA adapters (f32)".to_string(), sat(adapters)),
        ("gradients".to_string(), sat(4 * trainable)),
        ("AdamW moments".to_string(), sat(8 * trainable)),
        ("checkpoint write (a copy, serialised)".to_string(), sat(2 * (saved + 8 * trainable))),
        (format!("activations ({b}×{t} tokens, {l} layers)"), sat(act)),
        ("LM head + loss (weight gradient, logits, packed weight)".to_string(), sat(loss)),
    ];
    terms.retain(|t| t.1 > 0);
    terms.sort_by_key(|t| std::cmp::Reverse(t.1));
    let total = terms.iter().fold(0u64, |acc, (_, v)| acc.saturating_add(*v));
    MemoryEstimate { terms, total }
}

/// Memory the CPU can still give (`MemAvailable` of /proc/meminfo).
pub fn host_available() -> Option<u64> {
    ember_model::weights::host_available()
}

pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Reads the memory in use, where the backend's memory can be observed (on the CPU: the heap).
pub trait MemoryProbe: Send + Sync {
    /// Bytes in use now.
    fn current_bytes(&self) -> Option<u64>;
    /// Restarts the high-water mark from the current use.
    fn reset_peak(&self);
    /// Highest use since the last reset.
    fn peak_bytes(&self) -> Option<u64>;
}

/// For backends whose memory is not observed.
pub struct NoProbe;

impl MemoryProbe for NoProbe {
    fn current_bytes(&self) -> Option<u64> {
        None
    }
    fn reset_peak(&self) {}
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nano_is_small_and_a_7b_model_is_not() {
        let text = include_str!("../../../configs/nano.toml");
        let mut c = TrainConfig::from_toml(text, std::path::Path::new("nano.toml")).unwrap();
        c.model.vocab_size = 65;
        let e = estimate(&c, c.model.num_params());
        assert!(e.total < 600 << 20, "{}", gib(e.total));
        assert_eq!(e.terms.iter().map(|(_, v)| v).sum::<u64>(), e.total);
        assert!(!e.terms.iter().any(|(k, _)| k.starts_with("LoRA")), "{:?}", e.terms);
        // Adapters count as weights of their own, with their gradients, moments and saved copy.
        let lora: ember_model::lora::LoraConfig = toml::from_str("rank = 8\nalpha = 16.0").unwrap();
        let trainable = 1_000_000;
        let e = estimate(&TrainConfig { lora: Some(lora), ..c.clone() }, trainable);
        let term = |name: &str| e.terms.iter().find(|(k, _)| k.starts_with(name)).map(|t| t.1);
        assert_eq!(term("LoRA adapters"), Some(4 * trainable));
        assert_eq!(term("AdamW moments"), Some(8 * trainable));
        assert_eq!(term("checkpoint write"), Some(2 * 12 * trainable));
        assert_eq!(term("quantized projections"), None);
        // A base keeping projections quantized: those as stored, the rest (embeddings, norms) f32.
        let lora: ember_model::lora::LoraConfig = toml::from_str("rank = 8\nalpha = 16.0").unwrap();
        let kept = (100_000, 62_500);
        let q = estimate_keeping(&TrainConfig { lora: Some(lora), ..c.clone() }, trainable, kept);
        let qterm = |name: &str| q.terms.iter().find(|(k, _)| k.starts_with(name)).map(|t| t.1);
        assert_eq!(qterm("quantized projections"), Some(kept.1));
        assert_eq!(qterm("weights (f32)"), Some(term("weights (f32)").unwrap() - 4 * kept.0));
        // Without [lora] the file is dequantized: nothing kept.
        let full = estimate_keeping(&c, c.model.num_params(), kept);
        assert_eq!(full.terms, estimate(&c, c.model.num_params()).terms);
        c.model = ember_model::ModelConfig::llama(32_000, 4096, 32, 32, 11_008, 4096); // Llama 2 7B
        let e = estimate(&c, c.model.num_params());
        // 16 bytes per parameter for weights, gradients and moments: over 100 GB before activations.
        assert!(e.total > 100_000_000_000, "{}", gib(e.total));
    }

    /// The activations term of an estimate: `4·B·T` times what each block's parts keep per token
    /// (a dense block's as the flat formula always had it; experts the `k` a token runs through;
    /// latent attention its own widths).
    #[test]
    fn activations_follow_each_block_s_parts() {
        let text = include_str!("../../../configs/nano.toml");
        let mut c = TrainConfig::from_toml(text, std::path::Path::new("nano.toml")).unwrap();
        c.model.vocab_size = 65;
        let activations = |c: &TrainConfig| {
            let e = estimate(c, c.model.num_params());
            e.terms.iter().find(|(k, _)| k.starts_with("activations")).map(|t| t.1).unwrap()
        };
        let m = c.model.clone();
        let (b, t, l) = (c.train.batch_size as u64, c.seq_len() as u64, m.n_layers as u64);
        let (d, f, h, k, dh) =
            (m.d_model as u64, m.d_ff as u64, m.n_heads as u64, m.n_kv_heads() as u64, m.head_dim() as u64);
        let (norms, mlp) = (3 * d, 4 * f + d);
        let grouped = 2 * h * dh + 3 * k * dh + 2 * h * dh + 2 * h * t;
        assert_eq!(activations(&c), 4 * b * t * l * (norms + grouped + mlp));

        // Experts after one dense layer: the router's logits and scores, two experts' rows, the
        // shared expert as an MLP, the output.
        let moe = ember_model::MoeConfig {
            n_experts: 8,
            top_k: 2,
            d_expert: 64,
            shared_expert: Some(96),
            dense_layers: 1,
            ..Default::default()
        };
        let experts = 2 * 8 + 2 * (2 * d + 4 * 64) + (4 * 96 + d) + d;
        assert_ne!(experts, mlp);
        let sparse = TrainConfig { model: ember_model::ModelConfig { moe: Some(moe), ..m.clone() }, ..c.clone() };
        let per_token = (norms + grouped + mlp) + (l - 1) * (norms + grouped + experts);
        assert_eq!(activations(&sparse), 4 * b * t * per_token);

        // Latent attention: its queries, latent, expanded keys and values, output and scores.
        let mla = ember_model::MlaConfig {
            q_rank: Some(48),
            kv_rank: 32,
            nope_dim: 24,
            rope_dim: 8,
            v_dim: 16,
            norm_eps: 1e-6,
        };
        let (qk, dv) = (24 + 8, 16);
        let latent = 2 * h * qk + 2 * 48 + (2 * 32 + 2 * 8) + (h * (24 + dv) + h * qk) + 2 * h * dv + 2 * h * t;
        let model = ember_model::ModelConfig { mla: Some(mla), n_kv_heads: None, ..m.clone() };
        let deepseek = TrainConfig { model, ..c.clone() };
        assert_eq!(activations(&deepseek), 4 * b * t * l * (norms + latent + mlp));
    }
}
