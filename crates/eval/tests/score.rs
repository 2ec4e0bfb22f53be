//! The batched, prefix-sharing scorer against the slow reference (each pair alone through the
//! plain forward pass, log-softmax in f64 on the host).

use burn::backend::Flex;
use ember_eval::score::{score, score_reference, token_logprobs, Budget, Pair};
use ember_model::{Decoder, ModelConfig};

type B = Flex;

fn model(config: ModelConfig) -> Decoder<B> {
    Decoder::new(&ModelConfig { init_std: 0.3, ..config }, 11, &Default::default()).expect("a valid config")
}

fn ids(seed: u32, n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed * 13 + i * i * seed) % vocab).collect()
}

fn items(vocab: u32) -> Vec<Vec<Pair>> {
    let ctx = |s, n| ids(s, n, vocab);
    vec![
        // Four choices after one context that ends inside a block (20 positions, blocks of 16).
        (1..5).map(|c| Pair { context: ctx(1, 20), continuation: ids(c + 10, c as usize + 1, vocab) }).collect(),
        // One-token choices after a context of exactly one block plus one.
        (1..4).map(|c| Pair { context: ctx(2, 17), continuation: vec![c * 3] }).collect(),
        // Per-choice contexts sharing a prefix, one continuation (WinoGrande's form).
        (0..2)
            .map(|c| Pair { context: [ctx(3, 9), ids(c + 20, 4, vocab)].concat(), continuation: ctx(4, 5) })
            .collect(),
        // A context past the model's 40 positions: cut from the left.
        vec![
            Pair { context: ctx(5, 50), continuation: ctx(6, 3) },
            Pair { context: ctx(5, 50), continuation: ctx(7, 2) },
        ],
        // A single pair, a one-token context.
        vec![Pair { context: vec![1], continuation: ctx(8, 6) }],
    ]
}

fn check(model: &Decoder<B>, budget: Budget) {
    let vocab = model.config().vocab_size as u32;
    let items = items(vocab);
    let fast = score(model, &items, budget, |_| {});
    let slow = score_reference(model, &items);
    for (i, (f, s)) in fast.iter().zip(&slow).enumerate() {
        assert_eq!(f.len(), s.len());
        for (j, (a, b)) in f.iter().zip(s).enumerate() {
            let tol = 1e-4 * b.logprob.abs().max(1.0);
            assert!((a.logprob - b.logprob).abs() < tol, "item {i} pair {j}: {} vs {}", a.logprob, b.logprob);
            assert_eq!(a.greedy, b.greedy, "item {i} pair {j}");
        }
    }
}

#[test]
fn shared_prefixes_score_as_each_pair_alone() {
    let tiny = model(ModelConfig::tiny(43, 40));
    // One item per call, and every item in one call (rows of different lengths padded).
    check(&tiny, Budget { tokens: 1, logit_rows: 3 });
    check(&tiny, Budget { tokens: 1 << 16, logit_rows: 1024 });
}

#[test]
fn sliding_window_layers_score_as_each_pair_alone() {
    // Gemma 3's mix: local layers over a window shorter than the contexts, and a global one.
    let config = ModelConfig {
        n_layers: 3,
        sliding_window: Some(8),
        sliding_window_pattern: Some(3),
        ..ModelConfig::tiny(43, 40)
    };
    check(&model(config), Budget { tokens: 256, logit_rows: 7 });
}

/// Per token (`ember eval --data FILE.jsonl --samples`): one log-probability per continuation token,
/// summing to the reference's log-likelihood of the pair.
#[test]
fn token_logprobs_sum_to_the_pairs_log_likelihoods() {
    let tiny = model(ModelConfig::tiny(43, 40));
    let pairs: Vec<Pair> = items(43).into_iter().flatten().collect();
    let tokens = token_logprobs(&tiny, &pairs, Budget { tokens: 64, logit_rows: 5 });
    let slow = score_reference(&tiny, &pairs.iter().map(|p| vec![p.clone()]).collect::<Vec<_>>());
    assert_eq!(tokens.len(), pairs.len());
    for (i, ((t, p), s)) in tokens.iter().zip(&pairs).zip(&slow).enumerate() {
        assert_eq!(t.len(), p.continuation.len(), "pair {i}");
        let sum: f64 = t.iter().sum();
        assert!((sum - s[0].logprob).abs() < 1e-4 * s[0].logprob.abs().max(1.0), "pair {i}: {sum} vs {}", s[0].logprob);
    }
}
