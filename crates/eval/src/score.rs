//! Log-likelihoods of continuations, as lm-evaluation-harness's `loglikelihood` requests are
//! answered, with the context of a multiple-choice item computed once.
//!
//! An item is a group of (context, continuation) token pairs. The longest prefix the pairs share,
//! up to the last context token of the shortest context, goes through the model once into a paged
//! KV cache; every pair's sequence then holds that prefix's blocks ([`KvCache::share_prefix`]) and
//! runs only what is its own. The harness instead recomputes the whole context for every choice.
//! Items go through in batches of similar lengths, their results put back in order.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use ember_kernels::EmberBackend;
use ember_model::Decoder;

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
    mut done: impl FnMut(usize),
) -> Vec<Vec<Scored>> {
    let max_len = model.config().max_seq_len;
    let windows: Vec<Vec<Window>> =
        items.iter().map(|pairs| pairs.iter().map(|p| Window::new(p, max_len)).collect()).collect();
    // Longest first, so that a batch's rows are of similar lengths (and an over-budget item is met
    // at the start, not the end).
    let mut order: Vec<usize> = (0..items.len()).collect();
    let longest = |i: usize| windows[i].iter().map(|w| w.inputs.len()).max().unwrap_or(0);
    order.sort_by_key(|&i| std::cmp::Reverse(longest(i)));
    let mut out: Vec<Vec<Scored>> = vec![Vec::new(); items.len()];
    let mut start = 0;
    while start < order.len() {
        // Items while rows × the longest row fit the budget (one item at least).
        let mut end = start + 1;
        let mut rows = windows[order[start]].len();
        let width = longest(order[start]).max(1);
        while end < order.len() && (rows + windows[order[end]].len()) * width <= budget.tokens {
            rows += windows[order[end]].len();
            end += 1;
        }
        let batch: Vec<&[Window]> = order[start..end].iter().map(|&i| windows[i].as_slice()).collect();
        for (&i, scored) in order[start..end].iter().zip(score_batch(model, &batch, budget)) {
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

fn score_batch<B: EmberBackend>(model: &Decoder<B>, items: &[&[Window]], budget: Budget) -> Vec<Vec<Scored>> {
    let device = model.embed_tokens.device();
    let rows: usize = items.iter().map(|w| w.len()).sum();
    let mut cache = model.new_cache(rows, 16);
    // Row of each item's first window; the item's other windows follow it.
    let firsts: Vec<usize> = items.iter().scan(0, |r, w| Some(std::mem::replace(r, *r + w.len()))).collect();
    let prefixes: Vec<usize> = items.iter().map(|w| shared_prefix(w)).collect();

    // 1. The shared prefixes, once per item.
    let prefill: Vec<usize> = (0..items.len()).filter(|&i| prefixes[i] > 0).collect();
    if !prefill.is_empty() {
        let lens: Vec<usize> = prefill.iter().map(|&i| prefixes[i]).collect();
        let t = lens.iter().copied().max().unwrap_or(1);
        let tokens = padded(prefill.iter().map(|&i| &items[i][0].inputs[..prefixes[i]]), t);
        let rows: Vec<usize> = prefill.iter().map(|&i| firsts[i]).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [rows.len(), t]), &device);
        let _ = model.forward_cached_rows(tokens, &rows, &lens, &mut cache);
        for &i in &prefill {
            for j in 1..items[i].len() {
                cache.share_prefix(firsts[i], firsts[i] + j);
            }
        }
    }

    // 2. What each window has of its own, every window a row.
    let own: Vec<(&Window, usize)> =
        items.iter().zip(&prefixes).flat_map(|(ws, &p)| ws.iter().map(move |w| (w, p))).collect();
    let lens: Vec<usize> = own.iter().map(|(w, p)| w.inputs.len() - p).collect();
    let t = lens.iter().copied().max().unwrap_or(1).max(1);
    let tokens = padded(own.iter().map(|(w, p)| &w.inputs[*p..]), t);
    let all_rows: Vec<usize> = (0..own.len()).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [own.len(), t]), &device);
    let hidden = model.forward_cached_rows(tokens, &all_rows, &lens, &mut cache); // [R, T, D]
    let d = model.config().d_model;
    let hidden = hidden.reshape([own.len() * t, d]);

    // 3. The scored positions' log-probabilities, a bounded number of logit rows at a time.
    let mut picks: Vec<(i32, u32)> = Vec::new(); // (row in the folded hidden states, target)
    for (r, (w, p)) in own.iter().enumerate() {
        let first = w.first_scored() - p; // position within the row's own part
        for (k, &target) in w.targets.iter().enumerate() {
            picks.push(((r * t + first - 1 + k) as i32, target));
        }
    }
    let mut logprobs = Vec::with_capacity(picks.len());
    let mut greedy = Vec::with_capacity(picks.len());
    for chunk in picks.chunks(budget.logit_rows) {
        let n = chunk.len();
        let index = Tensor::<B, 1, Int>::from_data(
            TensorData::new(chunk.iter().map(|c| c.0).collect::<Vec<i32>>(), [n]),
            &device,
        );
        let logits = model.logits(hidden.clone().select(0, index)); // [n, V]
        let targets = Tensor::<B, 2, Int>::from_data(
            TensorData::new(chunk.iter().map(|c| c.1 as i32).collect::<Vec<i32>>(), [n, 1]),
            &device,
        );
        let best = logits.clone().argmax(1).reshape([n]);
        let picked = log_softmax(logits, 1).gather(1, targets).reshape([n]);
        logprobs.extend(picked.into_data().convert::<f32>().into_vec::<f32>().unwrap_or_default());
        greedy.extend(best.into_data().convert::<i64>().into_vec::<i64>().unwrap_or_default());
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(items.len());
    for ws in items {
        let mut scored = Vec::with_capacity(ws.len());
        for w in ws.iter() {
            let n = w.targets.len();
            let logprob = logprobs[at..at + n].iter().map(|&x| x as f64).sum();
            let all = w.targets.iter().zip(&greedy[at..at + n]).all(|(&t, &g)| g == t as i64);
            scored.push(Scored { logprob, greedy: all });
            at += n;
        }
        out.push(scored);
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
    let device = model.embed_tokens.device();
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
