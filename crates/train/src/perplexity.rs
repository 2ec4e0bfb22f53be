//! `ember eval --perplexity`: the negative log-likelihood of a token stream under a model, with
//! sliding windows where the stream is longer than the context (Hugging Face's "perplexity of
//! fixed-length models"): each token is scored once, with at least `context - stride` tokens of
//! context except near the start.

use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use ember_kernels::{EmberBackend, IGNORE};
use ember_model::Decoder;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Perplexity {
    /// Mean negative log-likelihood per scored token, nats.
    pub nll: f64,
    /// exp(nll).
    pub perplexity: f64,
    /// Total NLL in bits over the bytes of the scored text.
    pub bits_per_byte: f64,
    /// Tokens scored (every token but the first).
    pub tokens: usize,
    /// UTF-8 bytes of the scored tokens.
    pub bytes: usize,
    pub context: usize,
    pub stride: usize,
}

/// One window: inputs `tokens[start .. start + len]`, predicting `tokens[start + 1 ..= start + len]`,
/// of which the last `scored` count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EvalWindow {
    pub start: usize,
    pub len: usize,
    pub scored: usize,
}

/// The windows covering targets `1..n` once each: a window of up to `context` inputs every `stride`
/// tokens, scoring the targets that the previous windows did not.
pub(crate) fn sliding_windows(n_tokens: usize, context: usize, stride: usize) -> Vec<EvalWindow> {
    let mut out = Vec::new();
    let last_target = n_tokens.saturating_sub(1);
    let mut scored_up_to = 0; // targets 1..=scored_up_to are done
    let mut start = 0;
    while scored_up_to < last_target {
        let end = (start + context).min(last_target); // last target of this window
        out.push(EvalWindow { start, len: end - start, scored: end - scored_up_to });
        scored_up_to = end;
        start += stride;
    }
    out
}

/// Scores `tokens` with windows of `context` every `stride`, `batch` windows at a time.
/// `bytes` is the UTF-8 length of the scored text (for bits per byte).
pub fn perplexity<B: EmberBackend>(
    model: &Decoder<B>,
    tokens: &[u32],
    context: usize,
    stride: usize,
    batch: usize,
    bytes: usize,
) -> Perplexity {
    let device = model.device();
    let d = model.config().d_model;
    let windows = sliding_windows(tokens.len(), context, stride);
    let mut total = 0.0f64;
    // Windows of equal length go through together; only the last one is ever shorter.
    for group in windows.chunk_by(|a, b| a.len == b.len) {
        for chunk in group.chunks(batch.max(1)) {
            let (b, t) = (chunk.len(), chunk[0].len);
            let mut inputs = Vec::with_capacity(b * t);
            let mut targets = Vec::with_capacity(b * t);
            for w in chunk {
                inputs.extend(tokens[w.start..w.start + t].iter().map(|&x| x as i32));
                let first_scored = t - w.scored;
                targets.extend((0..t).map(|i| if i >= first_scored { tokens[w.start + i + 1] as i32 } else { IGNORE }));
            }
            let count: usize = chunk.iter().map(|w| w.scored).sum();
            let inputs = Tensor::<B, 2, Int>::from_data(TensorData::new(inputs, [b, t]), &device);
            let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets, [b * t]), &device);
            let hidden = model.hidden(inputs, 0).reshape([b * t, d]);
            let mean = model.loss(hidden, targets);
            total += mean.into_scalar().elem::<f64>() * count as f64;
        }
    }
    let n = tokens.len().saturating_sub(1);
    let nll = total / n.max(1) as f64;
    Perplexity {
        nll,
        perplexity: nll.exp(),
        bits_per_byte: total / std::f64::consts::LN_2 / bytes.max(1) as f64,
        tokens: n,
        bytes,
        context,
        stride,
    }
}

/// The completion loss of fine-tuning examples (`ember eval --data FILE.jsonl`): only scored
/// (completion, assistant) tokens count, each example attended to alone.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionLoss {
    /// Mean negative log-likelihood per scored token, nats.
    pub nll: f64,
    /// exp(nll).
    pub perplexity: f64,
    /// Examples read (`None` for the split of a run, whose rows are already packed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub examples: Option<usize>,
    /// Rows of `context` positions they were packed into.
    pub rows: usize,
    /// Scored tokens.
    pub tokens: usize,
    pub context: usize,
}

/// Scores packed examples (every row once, token-weighted), `batch` rows at a time.
pub fn completion_loss<B: EmberBackend>(
    model: &Decoder<B>,
    rows: &ember_data::finetune::PackedExamples,
    examples: Option<usize>,
    context: usize,
    batch: usize,
) -> CompletionLoss {
    use burn::data::dataset::Dataset;
    let nll = crate::eval::evaluate_all(model, rows, batch);
    CompletionLoss { nll, perplexity: nll.exp(), examples, rows: rows.len(), tokens: rows.scored_tokens(), context }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::windows_loss;
    use burn::tensor::activation::log_softmax;
    use ember_data::{TokenShard, TokenWindows};
    use ember_model::ModelConfig;
    use std::sync::Arc;

    type B = burn::backend::Flex;

    fn model(max_seq_len: usize) -> Decoder<B> {
        let cfg = ModelConfig { init_std: 0.3, ..ModelConfig::tiny(23, max_seq_len) };
        Decoder::new(&cfg, 9, &Default::default()).unwrap()
    }

    fn stream(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| (i * i + 3 * i) % 23).collect()
    }

    #[test]
    fn windows_score_every_target_once() {
        for (n, c, s) in [(100, 16, 16), (100, 16, 5), (17, 16, 8), (5, 16, 4), (2, 8, 8)] {
            let ws = sliding_windows(n, c, s);
            let mut seen = vec![0; n];
            for w in &ws {
                assert!(w.len <= c && w.scored <= w.len && w.scored > 0, "{w:?}");
                seen[w.start + w.len - w.scored + 1..=w.start + w.len].iter_mut().for_each(|k| *k += 1);
            }
            assert_eq!(seen[0], 0);
            assert!(seen[1..].iter().all(|&k| k == 1), "n {n} c {c} s {s}: {seen:?}");
        }
    }

    #[test]
    fn sliding_windows_equal_a_brute_force_per_token_computation() {
        let model = model(16);
        let tokens = stream(45);
        let (context, stride) = (12, 5);
        let got = perplexity(&model, &tokens, context, stride, 3, 45);
        // Brute force: one forward pass per target, over exactly the context its window gives it.
        let mut total = 0.0;
        for w in sliding_windows(tokens.len(), context, stride) {
            for p in w.start + w.len - w.scored + 1..=w.start + w.len {
                let ctx: Vec<i32> = tokens[w.start..p].iter().map(|&t| t as i32).collect();
                let input =
                    Tensor::<B, 2, Int>::from_data(TensorData::new(ctx.clone(), [1, ctx.len()]), &Default::default());
                let logits = model.forward(input).narrow(1, ctx.len() - 1, 1).reshape([1, 23]);
                let logp = log_softmax(logits, 1).into_data().to_vec::<f32>().unwrap();
                total -= logp[tokens[p] as usize] as f64;
            }
        }
        let want = total / 44.0;
        assert!((got.nll - want).abs() < 1e-5, "{} vs {want}", got.nll);
        assert_eq!(got.tokens, 44);
        assert!((got.perplexity - want.exp()).abs() < 1e-4);
        assert!((got.bits_per_byte - total / std::f64::consts::LN_2 / 45.0).abs() < 1e-5);
    }

    #[test]
    fn non_overlapping_windows_equal_the_training_loss_on_the_same_tokens() {
        let model = model(16);
        let (t, windows) = (16, 6);
        let tokens = stream(t * windows + 1);
        let ppl = perplexity(&model, &tokens, t, t, 4, tokens.len());
        let data = TokenWindows::new(Arc::new(TokenShard::new(tokens.clone(), 23)), t, "val").unwrap();
        let starts: Vec<usize> = (0..windows).map(|w| w * t).collect();
        let train_loss = windows_loss(&model, &data, &starts);
        assert!((ppl.nll - train_loss).abs() < 1e-5, "{} vs {train_loss}", ppl.nll);
        assert!((ppl.perplexity - train_loss.exp()).abs() < 1e-4);
    }
}
