//! Log-probabilities of a drawn token and of the most likely alternatives, from the model's own
//! distribution: the log-softmax of its raw logits, before any bias, penalty, temperature, top-k/p
//! or mask (what vLLM reports by default, and what makes the numbers comparable across requests).

/// Most alternatives a request may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probabilities that come with one generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The drawn token's.
    pub logprob: f32,
    /// The `k` most likely tokens and theirs, most likely first (ties: the lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of `token` and of the `k` most likely ids under `logits` (`[V]`).
pub fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    // log p_i = l_i - log sum_j exp(l_j), the sum taken around the maximum (no overflow).
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let logprob = |i: usize| (logits[i] as f64 - lse) as f32;
    let top = top_ids(logits, k).into_iter().map(|i| (i as u32, logprob(i))).collect();
    let chosen = logits.get(token as usize).map_or(f32::NEG_INFINITY, |_| logprob(token as usize));
    TokenLogprobs { logprob: chosen, top }
}

/// The ids of the `k` largest logits, largest first, ties by lower id: one pass keeping a sorted
/// list of at most `k` (k is small; no sort of the vocabulary).
fn top_ids(logits: &[f32], k: usize) -> Vec<usize> {
    let mut top: Vec<usize> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (i, &l) in logits.iter().enumerate() {
        // An equal logit seen later has a higher id: it goes after the ones kept.
        if top.len() == k && l.total_cmp(&logits[top[k - 1]]).is_le() {
            continue;
        }
        let at = top.partition_point(|&j| logits[j].total_cmp(&l).is_ge());
        top.insert(at, i);
        top.truncate(k);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_and_the_top_list_is_sorted() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 17) % 11) as f32 * 0.3 - 1.0).collect();
        let got = token_logprobs(&logits, 7, 5);
        // The plain formula, in f64.
        let total: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let plain = |i: usize| ((logits[i] as f64).exp() / total).ln() as f32;
        assert!((got.logprob - plain(7)).abs() < 1e-6, "{} vs {}", got.logprob, plain(7));
        let mut sorted: Vec<usize> = (0..50).collect();
        sorted.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let ids: Vec<u32> = got.top.iter().map(|&(i, _)| i).collect();
        assert_eq!(ids, sorted[..5].iter().map(|&i| i as u32).collect::<Vec<u32>>());
        for &(i, lp) in &got.top {
            assert!((lp - plain(i as usize)).abs() < 1e-6);
        }
        let probs: f64 = (0..50).map(|i| (plain(i) as f64).exp()).sum();
        assert!((probs - 1.0).abs() < 1e-5);
        assert!(token_logprobs(&logits, 7, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 7, 80).top.len(), 50);
    }
}
