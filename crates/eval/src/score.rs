//! Log-likelihoods of continuations, as lm-evaluation-harness's `loglikelihood` requests are
//! answered, with the context of a multiple-choice item computed once.
//!
//! An item is a group of (context, continuation) token pairs. The longest prefix the pairs share,
//! up to the last context token of the shortest context, goes through the model once into a paged
//! KV cache; every pair's sequence then holds that prefix's blocks ([`KvCache::share_prefix`]) and
//! runs only what is its own. The harness instead recomputes the whole context for every choice.
//! Items go through in batches of similar lengths, their results put back in order.

use burn::tensor::{Int, Tensor, TensorData};
use ember_kernels::EmberBackend;
use ember_model::{Decoder, KvCache};
use rayon::prelude::*;

/// One scored pair: the context's tokens, then the continuation's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub context: Vec<u32>,
    pub continuation: Vec<u32>,
}

/// The answer to one pair: `Σ log p(continuation token | everything before it)`, and whether
/// greedy decoding gives exactly the continuation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub logprob: f64,
    pub greedy: bool,
}

/// A pair as the model sees it: inputs (the pair's tokens but the last, cut from the left to the
/// model's context as the harness cuts them) and the targets of the last `scored` inputs.
struct Window {
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

impl Window {
    fn new(pair: &Pair, max_len: usize) -> Self {
        let whole: Vec<u32> = pair.context.iter().chain(&pair.continuation).copied().collect();
        let keep = whole.len().min(max_len + 1);
        let whole = &whole[whole.len() - keep..];
        let scored = pair.continuation.len().min(whole.len().saturating_sub(1));
        Window { inputs: whole[..whole.len() - 1].to_vec(), targets: whole[whole.len() - scored..].to_vec() }
    }

    /// Position of the first input whose prediction is scored.
    fn first_scored(&self) -> usize {
        self.inputs.len() + 1 - self.targets.len()
    }
}

/// How much one forward call takes: rows times padded length, in tokens.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub tokens: usize,
    /// Most logit rows computed at once (the `[rows, V]` logits of a 262k vocabulary are large).
    pub logit_rows: usize,
}

impl Budget {
    pub fn for_vocab(tokens: usize, vocab: usize) -> Self {
        Self { tokens: tokens.max(1), logit_rows: ((1usize << 24) / vocab.max(1)).clamp(1, 1024) }
    }
}

/// Scores every pair of every item; `done` is told how many items each batch finished.
pub fn score<B: EmberBackend>(
    model: &Decoder<B>,
    items: &[Vec<Pair>],
    budget: Budget,
    done: impl FnMut(usize),
) -> Vec<Vec<Scored>> {
    let sum = |tokens: &[(f64, bool)]| Scored {
        logprob: tokens.iter().map(|s| s.0).sum(),
        greedy: tokens.iter().all(|s| s.1),
    };
    score_with(model, items, budget, done, &sum)
}

/// `log p` of every continuation token of every pair, each pair alone (no prefix shared): what
/// `ember eval --data FILE.jsonl --samples` reports per token, to compare with the server's logprobs.
pub fn token_logprobs<B: EmberBackend>(model: &Decoder<B>, pairs: &[Pair], budget: Budget) -> Vec<Vec<f64>> {
    let items: Vec<Vec<Pair>> = pairs.iter().map(|p| vec![p.clone()]).collect();
    let each = |tokens: &[(f64, bool)]| tokens.iter().map(|s| s.0).collect::<Vec<f64>>();
    score_with(model, &items, budget, |_| {}, &each).into_iter().flatten().collect()
}

/// [`score`] with each pair's per-token `(log p, is the argmax)` folded by `reduce`.
fn score_with<B: EmberBackend, T: Clone>(
    model: &Decoder<B>,
    items: &[Vec<Pair>],
    budget: Budget,
    mut done: impl FnMut(usize),
    reduce: &dyn Fn(&[(f64, bool)]) -> T,
) -> Vec<Vec<T>> {
    let max_len = model.config().max_seq_len;
    let windows: Vec<Vec<Window>> =
        items.iter().map(|pairs| pairs.iter().map(|p| Window::new(p, max_len)).collect()).collect();
    // Longest first, so that the calls of a batch meet rows of similar lengths.
    let mut order: Vec<usize> = (0..items.len()).collect();
    let longest = |i: usize| windows[i].iter().map(|w| w.inputs.len()).max().unwrap_or(0);
    order.sort_by_key(|&i| std::cmp::Reverse(longest(i)));
    let mut out: Vec<Vec<T>> = vec![Vec::new(); items.len()];
    let mut start = 0;
    while start < order.len() {
        // Items while their tokens fit four calls' budget (one item at least): the cache holds them.
        let tokens = |i: usize| windows[i].iter().map(|w| w.inputs.len()).sum::<usize>();
        let mut end = start + 1;
        let mut held = tokens(order[start]);
        while end < order.len() && held + tokens(order[end]) <= 4 * budget.tokens {
            held += tokens(order[end]);
            end += 1;
        }
        let batch: Vec<&[Window]> = order[start..end].iter().map(|&i| windows[i].as_slice()).collect();
        for (&i, scored) in order[start..end].iter().zip(score_batch(model, &batch, budget, reduce)) {
            out[i] = scored;
        }
        done(end - start);
        start = end;
    }
    out
}

/// The length of the prefix every window of an item shares, short of each one's first scored
/// position (so that every scored prediction comes from the second call).
fn shared_prefix(windows: &[Window]) -> usize {
    let Some(first) = windows.first() else { return 0 };
    let mut n = windows.iter().map(|w| w.first_scored().saturating_sub(1)).min().unwrap_or(0);
    for w in &windows[1..] {
        n = n.min(first.inputs.iter().zip(&w.inputs).take_while(|(a, b)| a == b).count());
    }
    n
}

/// Rows (cache row, tokens) split into forward calls of rows of similar lengths: longest first, a
/// call closed when its padded size would pass the budget or a row is under three quarters of its
/// longest (the padding a call computes for nothing stays small).
fn calls<'a>(mut rows: Vec<(usize, &'a [u32])>, budget: usize) -> Vec<Vec<(usize, &'a [u32])>> {
    rows.sort_by_key(|r| std::cmp::Reverse(r.1.len()));
    let mut out: Vec<Vec<(usize, &[u32])>> = Vec::new();
    for row in rows.into_iter().filter(|r| !r.1.is_empty()) {
        match out.last_mut() {
            Some(call) if (call.len() + 1) * call[0].1.len() <= budget && row.1.len() * 4 >= call[0].1.len() * 3 => {
                call.push(row)
            }
            _ => out.push(vec![row]),
        }
    }
    out
}

/// One forward call: `rows` continue their cache sequences; the final hidden states, `[R·T, D]`,
/// with `T` the call's padded length.
fn forward<B: EmberBackend>(
    model: &Decoder<B>,
    cache: &mut KvCache<B>,
    rows: &[(usize, &[u32])],
) -> (Tensor<B, 2>, usize) {
    let t = rows[0].1.len();
    let tokens = padded(rows.iter().map(|r| r.1), t);
    let ids: Vec<usize> = rows.iter().map(|r| r.0).collect();
    let lens: Vec<usize> = rows.iter().map(|r| r.1.len()).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [rows.len(), t]), &model.device());
    let hidden = model.forward_cached_rows(tokens, &ids, &lens, cache);
    (hidden.reshape([rows.len() * t, model.config().d_model]), t)
}

fn score_batch<B: EmberBackend, T: Clone>(
    model: &Decoder<B>,
    items: &[&[Window]],
    budget: Budget,
    reduce: &dyn Fn(&[(f64, bool)]) -> T,
) -> Vec<Vec<T>> {
    let rows: usize = items.iter().map(|w| w.len()).sum();
    let mut cache = model.new_cache(rows, 16);
    // Row of each item's first window; the item's other windows follow it.
    let firsts: Vec<usize> = items.iter().scan(0, |r, w| Some(std::mem::replace(r, *r + w.len()))).collect();
    let prefixes: Vec<usize> = items.iter().map(|w| shared_prefix(w)).collect();

    // 1. The shared prefixes, once per item.
    let shared: Vec<(usize, &[u32])> =
        (0..items.len()).map(|i| (firsts[i], &items[i][0].inputs[..prefixes[i]])).collect();
    for call in calls(shared, budget.tokens) {
        let _ = forward(model, &mut cache, &call);
    }
    for (i, ws) in items.iter().enumerate() {
        for j in 1..ws.len() {
            cache.share_prefix(firsts[i], firsts[i] + j, prefixes[i]);
        }
    }

    // 2. What each window has of its own, every window a row; the scored positions' logits.
    let own: Vec<(usize, &Window, usize)> = items
        .iter()
        .zip(&prefixes)
        .zip(&firsts)
        .flat_map(|((ws, &p), &first)| ws.iter().enumerate().map(move |(j, w)| (first + j, w, p)))
        .collect();
    let mut results: Vec<Option<T>> = vec![None; rows];
    let parts: Vec<(usize, &[u32])> = own.iter().map(|&(row, w, p)| (row, &w.inputs[p..])).collect();
    for call in calls(parts, budget.tokens) {
        let (hidden, t) = forward(model, &mut cache, &call);
        // (position in the call's folded hidden states, target) of every scored prediction.
        let mut picks: Vec<(i32, u32)> = Vec::new();
        let mut spans = Vec::with_capacity(call.len());
        for (r, &(row, _)) in call.iter().enumerate() {
            let (_, w, p) = own[row];
            let first = w.first_scored() - p; // position within the row's own part
            spans.push((row, picks.len(), w.targets.len()));
            for (k, &target) in w.targets.iter().enumerate() {
                picks.push(((r * t + first - 1 + k) as i32, target));
            }
        }
        let scored = log_probs(model, hidden, &picks, budget.logit_rows);
        for (row, at, n) in spans {
            results[row] = Some(reduce(&scored[at..at + n]));
        }
    }
    // Windows without a token of their own to score (empty continuations) score 0.
    let mut results = results.into_iter().map(|r| r.unwrap_or_else(|| reduce(&[])));
    items.iter().map(|ws| (0..ws.len()).filter_map(|_| results.next()).collect()).collect()
}

/// `(log p(target), target is the argmax)` of each pick `(row of hidden, target)`, a bounded number
/// of logit rows at a time; the log-softmax in one pass over each row on the host.
fn log_probs<B: EmberBackend>(
    model: &Decoder<B>,
    hidden: Tensor<B, 2>,
    picks: &[(i32, u32)],
    logit_rows: usize,
) -> Vec<(f64, bool)> {
    let device = model.device();
    let mut out = Vec::with_capacity(picks.len());
    for chunk in picks.chunks(logit_rows.max(1)) {
        let n = chunk.len();
        let index = TensorData::new(chunk.iter().map(|c| c.0).collect::<Vec<i32>>(), [n]);
        let logits = model.logits(hidden.clone().select(0, Tensor::<B, 1, Int>::from_data(index, &device)));
        let logits = logits.into_data().convert::<f32>().into_vec::<f32>().unwrap_or_default();
        let v = logits.len() / n.max(1);
        let rows: Vec<(f64, bool)> = logits
            .par_chunks(v.max(1))
            .zip(chunk)
            .map(|(row, &(_, target))| {
                let (mut max, mut best) = (f32::NEG_INFINITY, 0);
                for (i, &x) in row.iter().enumerate() {
                    if x > max {
                        (max, best) = (x, i);
                    }
                }
                let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
                let logprob = (row[target as usize] - max) as f64 - sum.ln();
                (logprob, best == target as usize)
            })
            .collect();
        out.extend(rows);
    }
    out
}

/// Rows of tokens right-padded with 0 to `t`, as one `[rows · t]` vector.
fn padded<'a>(rows: impl Iterator<Item = &'a [u32]>, t: usize) -> Vec<i32> {
    let mut out = Vec::new();
    for row in rows {
        out.extend(row.iter().map(|&x| x as i32));
        out.extend(std::iter::repeat_n(0, t - row.len()));
    }
    out
}

/// The slow reference: every pair alone, its whole window through the model's plain forward pass,
/// the log-softmax of every position's logits in f64 on the host.
pub fn score_reference<B: EmberBackend>(model: &Decoder<B>, items: &[Vec<Pair>]) -> Vec<Vec<Scored>> {
    let device = model.device();
    let max_len = model.config().max_seq_len;
    let d = model.config().d_model;
    items
        .iter()
        .map(|pairs| {
            pairs
                .iter()
                .map(|pair| {
                    let w = Window::new(pair, max_len);
                    let n = w.inputs.len();
                    let data = TensorData::new(w.inputs.iter().map(|&x| x as i32).collect::<Vec<i32>>(), [1, n]);
                    let hidden = model.hidden(Tensor::<B, 2, Int>::from_data(data, &device), 0).reshape([n, d]);
                    let logits =
                        model.logits(hidden).into_data().convert::<f32>().into_vec::<f32>().unwrap_or_default();
                    let v = logits.len() / n.max(1);
                    let first = w.first_scored();
                    let mut logprob = 0.0;
                    let mut greedy = true;
                    for (k, &target) in w.targets.iter().enumerate() {
                        let row = &logits[(first - 1 + k) * v..(first + k) * v];
                        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                        let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
                        logprob += row[target as usize] as f64 - lse;
                        let best = (0..v).fold(0, |b, i| if row[i] > row[b] { i } else { b });
                        greedy &= best == target as usize;
                    }
                    Scored { logprob, greedy }
                })
                .collect()
        })
        .collect()
}
