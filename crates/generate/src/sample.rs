//! Turning logits into tokens: temperature, top-k, top-p, greedy at temperature 0; and a plain
//! generation loop that recomputes the whole window for each new token.

use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::adjust::{apply_mask, AdjustError, Adjustments};
use crate::constraint::{Constraint, ConstraintError};
use ember_kernels::{temperature, Cpu, EmberBackend};
use ember_model::Decoder;
use ember_model::KvCache;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`, in (0, 1].
    pub top_p: Option<f32>,
    /// Divide positive logits (multiply negative ones) of tokens already in the sequence by this
    /// (Keskar et al., 2019); 1 is off.
    pub repetition_penalty: f32,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self { temperature: 0.8, top_k: Some(200), top_p: None, repetition_penalty: 1.0 }
    }
}

impl SamplingConfig {
    /// Checks every setting, so that a bad one is refused before a model is loaded rather than
    /// sampled from: a NaN or negative temperature would make every probability NaN, a top-p of 0
    /// or above 1 keeps no token or means nothing, and a penalty of 0 divides by zero.
    pub fn validate(&self) -> Result<(), SampleError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SampleError::Temperature(self.temperature));
        }
        if self.top_k == Some(0) {
            return Err(SampleError::TopK);
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(SampleError::TopP(p));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(SampleError::RepetitionPenalty(self.repetition_penalty));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("temperature must be a finite number >= 0, found {0}")]
    Temperature(f32),
    #[error("top_k must be at least 1, found 0")]
    TopK,
    #[error("top_p must be in (0, 1], found {0}")]
    TopP(f32),
    #[error("repetition_penalty must be a finite number > 0, found {0}")]
    RepetitionPenalty(f32),
    #[error("the prompt is empty: give at least one token")]
    EmptyPrompt,
    #[error("prompt {index} has {tokens} tokens, more than the model's context of {context}")]
    PromptTooLong { index: usize, tokens: usize, context: usize },
    /// An id the embedding table has no row for: the tokenizer is not the model's.
    #[error("prompt {index} has token id {id}, past the model's vocabulary of {vocab_size} ids")]
    TokenPastVocab { index: usize, id: u32, vocab_size: usize },
    #[error(transparent)]
    Adjust(#[from] AdjustError),
    /// A constrained sequence of [`generate_batch_constrained`] that cannot go on: its constraint
    /// failed, or its mask (with any bans) allowed no token.
    #[error("sequence {index}: {error}")]
    Constraint { index: usize, error: ConstraintError },
}

impl SampleError {
    /// The `SamplingConfig` or `Adjustments` field a settings error is about (`None` for errors
    /// about prompts and constraints).
    pub fn setting(&self) -> Option<&'static str> {
        match self {
            Self::Temperature(_) => Some("temperature"),
            Self::TopK => Some("top_k"),
            Self::TopP(_) => Some("top_p"),
            Self::RepetitionPenalty(_) => Some("repetition_penalty"),
            Self::Adjust(e) => Some(e.setting()),
            Self::EmptyPrompt | Self::PromptTooLong { .. } | Self::TokenPastVocab { .. } | Self::Constraint { .. } => {
                None
            }
        }
    }
}

/// Checks prompts against the model before anything runs: each is non-empty, fits the context of
/// `context` positions, and has only ids below `vocab_size` (an id past the embedding table would
/// index out of it).
pub fn check_prompts(prompts: &[impl AsRef<[u32]>], context: usize, vocab_size: usize) -> Result<(), SampleError> {
    for (index, p) in prompts.iter().map(AsRef::as_ref).enumerate() {
        if p.is_empty() {
            return Err(SampleError::EmptyPrompt);
        }
        if p.len() > context {
            return Err(SampleError::PromptTooLong { index, tokens: p.len(), context });
        }
        if let Some(&id) = p.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(SampleError::TokenPastVocab { index, id, vocab_size });
        }
    }
    Ok(())
}

/// A seeded sampler: the same seed and logits give the same tokens. Each request has its own, so
/// its draws do not depend on what else is in the batch.
pub struct Sampler {
    config: SamplingConfig,
    adjust: Adjustments,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(config: SamplingConfig, seed: u64) -> Result<Self, SampleError> {
        config.validate()?;
        Ok(Self { config, adjust: Adjustments::default(), rng: ChaCha8Rng::seed_from_u64(seed) })
    }

    /// The sampler with OpenAI's adjustments (logit bias, presence and frequency penalties, min-p),
    /// checked.
    pub fn adjusted(self, adjust: Adjustments) -> Result<Self, SampleError> {
        adjust.validate()?;
        Ok(Self { adjust, ..self })
    }

    /// Picks a token id from one row of logits `[V]` of a sequence whose tokens so far are
    /// `history`, the last `generated` of them generated (the presence and frequency penalties
    /// count those; the repetition penalty all), only among the tokens `mask` allows (a
    /// [`Constraint`]'s). `None` when no token may come: the mask and the bans leave none.
    pub(crate) fn sample_next(
        &mut self,
        logits: &[f32],
        history: &[u32],
        generated: usize,
        mask: Option<&[u32]>,
    ) -> Option<usize> {
        if mask.is_none() && !self.adjust.changes_logits() {
            return Some(self.sample_with_history(logits, history));
        }
        let mut row = logits.to_vec();
        self.adjust.apply(&mut row, &history[history.len().saturating_sub(generated)..]);
        if self.config.repetition_penalty != 1.0 {
            penalise_repeats(&mut row, history, self.config.repetition_penalty);
        }
        let allowed = mask.is_none_or(|m| apply_mask(&mut row, m));
        // A bias of -100 bans (-inf): where it and the mask leave nothing, nothing may be drawn.
        (allowed && row.iter().any(|l| l.is_finite())).then(|| self.sample(&row))
    }

    /// Picks a token id from one row of logits `[V]`, given the ids already in the sequence
    /// (used by the repetition penalty).
    pub(crate) fn sample_with_history(&mut self, logits: &[f32], history: &[u32]) -> usize {
        let p = self.config.repetition_penalty;
        if p == 1.0 || history.is_empty() {
            return self.sample(logits);
        }
        let mut penalised = logits.to_vec();
        penalise_repeats(&mut penalised, history, p);
        self.sample(&penalised)
    }

    /// Picks a token id from one row of logits `[V]`.
    pub(crate) fn sample(&mut self, logits: &[f32]) -> usize {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (i, &l)| if l > best.1 { (i, l) } else { best })
                .0
        };
        if self.config.temperature == 0.0 {
            return argmax();
        }
        let (order, probs) = self.candidates(logits);
        let mut u: f64 = self.rng.random::<f64>();
        for (&id, &p) in order.iter().zip(&probs) {
            if u < p {
                return id;
            }
            u -= p;
        }
        // Rounding left u past the last probability: the last candidate that may be drawn (not one
        // a mask or a ban gave none).
        order.iter().zip(&probs).rev().find(|(_, &p)| p > 0.0).map_or(order[0], |(&id, _)| id)
    }

    /// The ids a draw picks from and their probabilities (summing to 1), after temperature, top-k
    /// and top-p. With top-p they are in order, most likely first (ties: the lower id first).
    fn candidates(&self, logits: &[f32]) -> (Vec<usize>, Vec<f64>) {
        // Candidates by logit, most likely first; ties keep the lower id first. With top-k, only
        // the k best (a partition first: no sort of the whole vocabulary per token).
        let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let mut order: Vec<usize> = (0..logits.len()).collect();
        if let Some(k) = self.config.top_k.filter(|&k| k < order.len()) {
            order.select_nth_unstable_by(k, by_logit);
            order.truncate(k);
        }
        let inv_t = 1.0 / self.config.temperature;
        let max = order.iter().map(|&i| logits[i]).fold(f32::NEG_INFINITY, f32::max);
        // e^((l − max)/T): over the whole vocabulary at once where every token is a candidate
        // (vectorised), one at a time after a top-k (the same function: the same numbers).
        let all = (order.len() == logits.len()).then(|| temperature::weights(Cpu::detect(), logits, max, inv_t));
        let weight =
            |i: usize| f64::from(all.as_ref().map_or_else(|| temperature::weight(logits[i], max, inv_t), |w| w[i]));
        if let Some(top_p) = self.config.top_p {
            // The nucleus: the fewest most likely candidates whose probability reaches top_p. Found
            // among the best 64 sorted, or 256, …: a whole sort of a 49k vocabulary would cost
            // milliseconds a token, and the nucleus is mostly a few dozen.
            // (Over the table itself where there is one: `order` is then every id, in order.)
            let total: f64 = match &all {
                Some(w) => w.iter().map(|&x| f64::from(x)).sum(),
                None => order.iter().map(|&i| weight(i)).sum(),
            };
            let mut k = order.len().min(64);
            loop {
                let best = if k < order.len() {
                    best_k(&order, logits, k)
                } else {
                    order.sort_by(by_logit);
                    std::mem::take(&mut order)
                };
                let mut mass = 0.0;
                let reached = best.iter().position(|&i| {
                    mass += weight(i) / total;
                    mass >= top_p as f64
                });
                match reached {
                    Some(last) => {
                        order = best;
                        order.truncate(last + 1);
                        break;
                    }
                    None if k == best.len() && order.is_empty() => {
                        order = best;
                        break;
                    }
                    None => k = (4 * k).min(order.len()),
                }
            }
        }
        if let Some(min_p) = self.adjust.min_p {
            // Relative to the most likely candidate, whose weight is 1 (the maximum is among them).
            order.retain(|&i| weight(i) >= min_p as f64);
        }
        let mut probs: Vec<f64> = order.iter().map(|&i| weight(i)).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        (order, probs)
    }
}

/// The `k` best of `ids` by logit, most likely first, ties the lower id first (the order
/// `candidates` sorts by): one pass keeping the best `k` in a heap, rather than a partition of
/// the whole vocabulary.
fn best_k(ids: &[usize], logits: &[f32], k: usize) -> Vec<usize> {
    use std::cmp::{Ordering, Reverse};
    use std::collections::BinaryHeap;
    /// A candidate, greater when more likely (a higher logit, then a lower id).
    struct Ranked(f32, usize);
    impl Ord for Ranked {
        fn cmp(&self, other: &Self) -> Ordering {
            self.0.total_cmp(&other.0).then(other.1.cmp(&self.1))
        }
    }
    impl PartialOrd for Ranked {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl PartialEq for Ranked {
        fn eq(&self, other: &Self) -> bool {
            self.cmp(other) == Ordering::Equal
        }
    }
    impl Eq for Ranked {}
    let mut heap: BinaryHeap<Reverse<Ranked>> = BinaryHeap::with_capacity(k + 1);
    for &i in ids {
        let r = Ranked(logits[i], i);
        if heap.len() < k {
            heap.push(Reverse(r));
        } else if heap.peek().is_some_and(|Reverse(worst)| r > *worst) {
            heap.pop();
            heap.push(Reverse(r));
        }
    }
    // Ascending `Reverse`s: the most likely first.
    heap.into_sorted_vec().into_iter().map(|Reverse(Ranked(_, i))| i).collect()
}

/// Divides positive logits (multiplies negative ones) of the tokens in `history` by `p`, once each.
fn penalise_repeats(row: &mut [f32], history: &[u32], p: f32) {
    let mut seen = vec![false; row.len()];
    for &id in history {
        if let Some(l) = row.get_mut(id as usize) {
            if !std::mem::replace(&mut seen[id as usize], true) {
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
}

/// Generates up to `max_new_tokens` after `prompt`, recomputing the last `max_seq_len` tokens for
/// every new token (O(T) work per layer per token; the reference for the cached path). Calls
/// `on_token` with each new id as it is produced and stops early when it returns false.
pub fn generate<B: EmberBackend>(
    model: &Decoder<B>,
    prompt: &[u32],
    max_new_tokens: usize,
    sampler: &mut Sampler,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Vec<u32>, SampleError> {
    // Longer prompts are cropped to the window below; only emptiness and ids are errors here.
    check_prompts(&[prompt], usize::MAX, model.config().vocab_size)?;
    let device = model.device();
    let window = model.config().max_seq_len;
    let mut ids = prompt.to_vec();
    for _ in 0..max_new_tokens {
        let ctx = &ids[ids.len().saturating_sub(window)..];
        let data: Vec<i32> = ctx.iter().map(|&t| t as i32).collect();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(data, [1, ctx.len()]), &device);
        let hidden = model.hidden(tokens, 0); // [1, T, D]
        let last = hidden.narrow(1, ctx.len() - 1, 1).reshape([1, model.config().d_model]);
        let logits = model.logits(last).into_data().convert::<f32>();
        let logits = logits.as_slice::<f32>().expect("f32 logits");
        let next = sampler.sample_with_history(logits, &ids) as u32;
        ids.push(next);
        if !on_token(next) {
            break;
        }
    }
    Ok(ids.split_off(prompt.len()))
}

/// Limits of a cached generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// A sequence ends after producing one of these (end-of-text ids).
    pub stop_tokens: Vec<u32>,
    /// Positions per KV-cache block.
    pub block_size: usize,
}

/// Generates continuations of several prompts of different lengths at once through the KV cache:
/// one prefill pass over the right-padded prompts, then one position per sequence per step. Each
/// sequence stops on its own: at a stop token, at `max_new_tokens`, or when `on_token(sequence, id)`
/// returns false. A sequence that fills the model's context goes on from the last three quarters of
/// it, re-prefilled at positions from 0 (the cached form of cropping the context). `samplers` holds
/// one sampler per prompt.
pub fn generate_batch<B: EmberBackend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    samplers: &mut [Sampler],
    on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>, SampleError> {
    let mut none: Vec<Option<Box<dyn Constraint>>> = (0..prompts.len()).map(|_| None).collect();
    generate_batch_constrained(model, prompts, options, samplers, &mut none, on_token)
}

/// [`generate_batch`] with a constraint per prompt (`None`: free): each draw is among the tokens of
/// its mask, each token drawn is committed, and a sequence whose constraint is finished ends there
/// (as at a stop token). A constraint that fails, or a mask that allows nothing, is an error
/// ([`SampleError::Constraint`]): the grammar and the vocabulary disagree.
pub fn generate_batch_constrained<B: EmberBackend>(
    model: &Decoder<B>,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    samplers: &mut [Sampler],
    constraints: &mut [Option<Box<dyn Constraint>>],
    mut on_token: impl FnMut(usize, u32) -> bool,
) -> Result<Vec<Vec<u32>>, SampleError> {
    let context = model.config().max_seq_len;
    check_prompts(prompts, context, model.config().vocab_size)?;
    assert_eq!(samplers.len(), prompts.len(), "one sampler per prompt");
    assert_eq!(constraints.len(), prompts.len(), "one constraint (or None) per prompt");
    let n = prompts.len();
    let keep = (context * 3 / 4).max(1);
    let mut cache = model.new_cache(n, options.block_size);
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut active = vec![options.max_new_tokens > 0; n];
    // Prefill: all prompts in one pass.
    let mut logits = feed(model, &mut cache, prompts);

    for _ in 0..options.max_new_tokens {
        let mut inputs: Vec<Vec<u32>> = vec![Vec::new(); n];
        for b in 0..n {
            if !active[b] {
                continue;
            }
            let (tok, finished) =
                draw_constrained(&mut samplers[b], &mut constraints[b], &logits[b], &history[b], outputs[b].len())
                    .map_err(|error| SampleError::Constraint { index: b, error })?;
            outputs[b].push(tok);
            history[b].push(tok);
            let done = finished || options.stop_tokens.contains(&tok) || outputs[b].len() >= options.max_new_tokens;
            if !on_token(b, tok) || done {
                active[b] = false;
            } else if cache.lens()[b] < context {
                inputs[b] = vec![tok];
            } else {
                cache.reset(b);
                inputs[b] = history[b][history[b].len() - keep..].to_vec();
            }
        }
        if !active.iter().any(|&a| a) {
            break;
        }
        // Finished rows ride along with no new position: nothing is stored for them.
        logits = feed(model, &mut cache, &inputs);
    }
    Ok(outputs)
}

/// One draw of a sequence under its constraint, if any: the mask taken before it, the token
/// committed after it; the token, and whether the constraint is finished.
pub(crate) fn draw_constrained(
    sampler: &mut Sampler,
    constraint: &mut Option<Box<dyn Constraint>>,
    logits: &[f32],
    history: &[u32],
    generated: usize,
) -> Result<(u32, bool), ConstraintError> {
    let Some(c) = constraint.as_mut() else {
        let token = sampler.sample_next(logits, history, generated, None);
        return token.map(|t| (t as u32, false)).ok_or_else(nothing_allowed);
    };
    let token = sampler.sample_next(logits, history, generated, Some(c.mask()?)).ok_or_else(nothing_allowed)? as u32;
    c.commit(token)?;
    Ok((token, c.finished()))
}

fn nothing_allowed() -> ConstraintError {
    ConstraintError(crate::constraint::NOTHING_ALLOWED.into())
}

/// Runs `inputs[b]` (possibly empty) after each row's cached positions; returns each row's logits
/// at its last new position (rows without input: at their first padding position, unused).
fn feed<B: EmberBackend>(model: &Decoder<B>, cache: &mut KvCache<B>, inputs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let rows: Vec<usize> = (0..inputs.len()).collect();
    feed_rows(model, cache, &rows, inputs)
}

/// [`feed`] over some of the cache's sequences: `inputs[i]` continues sequence `rows[i]`.
pub(crate) fn feed_rows<B: EmberBackend>(
    model: &Decoder<B>,
    cache: &mut KvCache<B>,
    rows: &[usize],
    inputs: &[Vec<u32>],
) -> Vec<Vec<f32>> {
    let n = inputs.len();
    let t = inputs.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut ids = vec![0i32; n * t];
    for (b, row) in inputs.iter().enumerate() {
        for (i, &tok) in row.iter().enumerate() {
            ids[b * t + i] = tok as i32;
        }
    }
    let device = model.device();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, t]), &device);
    let new_lens: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let hidden = model.forward_cached_rows(tokens, rows, &new_lens, cache); // [N, T, D]
    let last: Vec<i32> = new_lens.iter().map(|&l| l.max(1) as i32 - 1).collect();
    last_logits(model, hidden, &last)
}

/// Host logits of position `rows[b]` of each row.
///
/// # Shapes
/// - hidden: `[N, T, D]` -> N rows of V logits
fn last_logits<B: EmberBackend>(model: &Decoder<B>, hidden: Tensor<B, 3>, rows: &[i32]) -> Vec<Vec<f32>> {
    let [n, _, d] = hidden.dims();
    let idx: Vec<i32> = rows.iter().flat_map(|&r| std::iter::repeat_n(r, d)).collect();
    let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(idx, [n, 1, d]), &hidden.device());
    let last = hidden.gather(1, idx).reshape([n, d]); // [N, D]
    let data = model.logits(last).into_data().convert::<f32>();
    let flat = data.as_slice::<f32>().unwrap_or_default();
    flat.chunks(model.config().vocab_size.max(1)).map(<[f32]>::to_vec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_keeps_the_head() {
        let logits = [0.0, 5.0, 4.9, -2.0];
        let mut s = Sampler::new(SamplingConfig { temperature: 1.0, top_k: Some(1), ..Default::default() }, 3).unwrap();
        assert!((0..50).all(|_| s.sample(&logits) == 1));
        let mut s =
            Sampler::new(SamplingConfig { temperature: 1.0, top_k: None, top_p: Some(0.9), ..Default::default() }, 3)
                .unwrap();
        let picks: Vec<usize> = (0..200).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&i| i == 1 || i == 2));
        assert!(picks.contains(&1) && picks.contains(&2));
    }

    #[test]
    fn top_k_by_partition_keeps_the_candidates_of_a_full_sort() {
        // Ties at the cut (several 1.5s), so the lower ids must be the ones kept.
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 23) as f32 * 0.25 - 2.0).collect();
        let k = 7;
        let mut sorted: Vec<usize> = (0..logits.len()).collect();
        sorted.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let masked: Vec<f32> =
            (0..logits.len()).map(|i| if sorted[..k].contains(&i) { logits[i] } else { f32::NEG_INFINITY }).collect();
        let draw = |top_k: Option<usize>, logits: &[f32]| {
            let mut s = Sampler::new(SamplingConfig { temperature: 1.0, top_k, ..Default::default() }, 9).unwrap();
            (0..300).map(|_| s.sample(logits)).collect::<Vec<usize>>()
        };
        let picks = draw(Some(k), &logits);
        assert_eq!(picks, draw(None, &masked));
        assert!(picks.iter().all(|i| sorted[..k].contains(i)));
    }

    /// The nucleus found among the best 64, 256, … candidates is the one of a whole sort: peaked
    /// logits (a few candidates), flat ones (most of the vocabulary) and ties.
    #[test]
    fn top_p_without_a_whole_sort_keeps_the_nucleus_of_one() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let peaked: Vec<f32> =
            (0..5000).map(|i| if i % 97 == 0 { 8.0 } else { rng.random_range(-4.0f32..0.0) }).collect();
        let flat: Vec<f32> = (0..5000).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        let ties: Vec<f32> = (0..5000).map(|i| (i % 7) as f32 * 0.5).collect();
        for logits in [peaked, flat, ties] {
            for top_p in [0.3f32, 0.9, 1.0] {
                let config = SamplingConfig { temperature: 0.7, top_k: None, top_p: Some(top_p), ..Default::default() };
                let (got, got_p) = Sampler::new(config, 1).unwrap().candidates(&logits);
                // The reference: every id sorted, then the shortest prefix reaching top_p.
                let mut sorted: Vec<usize> = (0..logits.len()).collect();
                sorted.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                let w: Vec<f64> = sorted
                    .iter()
                    .map(|&i| ((logits[i] as f64 - logits[sorted[0]] as f64) / 0.7f32 as f64).exp())
                    .collect();
                let total: f64 = w.iter().sum();
                let mut mass = 0.0;
                let keep = w.iter().position(|&x| {
                    mass += x / total;
                    mass >= top_p as f64
                });
                let keep = keep.map_or(sorted.len(), |i| i + 1);
                assert_eq!(got, sorted[..keep].to_vec(), "top_p {top_p}");
                let kept: f64 = w[..keep].iter().sum();
                // The weights are f32 exponentials (vectorised): f32 rounds their arguments.
                for (p, x) in got_p.iter().zip(&w) {
                    assert!((p - x / kept).abs() <= 1e-5 * x / kept, "top_p {top_p}: {p} vs {}", x / kept);
                }
            }
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 1/4, 3/4
        let cfg = SamplingConfig { temperature: 1.0, top_k: None, ..Default::default() };
        let mut s = Sampler::new(cfg.clone(), 11).unwrap();
        let ones = (0..4000).filter(|_| s.sample(&logits) == 1).count();
        assert!((2850..3150).contains(&ones), "{ones}");
        let a: Vec<usize> = {
            let mut s = Sampler::new(cfg.clone(), 5).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<usize> = {
            let mut s = Sampler::new(cfg, 5).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
    }

    #[test]
    fn bad_settings_are_errors() {
        let bad = |c: SamplingConfig| Sampler::new(c, 0).err().map(|e| e.to_string());
        assert_eq!(
            bad(SamplingConfig { top_p: Some(0.0), ..Default::default() }).unwrap(),
            "top_p must be in (0, 1], found 0"
        );
        assert!(bad(SamplingConfig { top_p: Some(1.5), ..Default::default() }).is_some());
        assert!(bad(SamplingConfig { top_k: Some(0), ..Default::default() }).is_some());
        assert!(bad(SamplingConfig { temperature: -1.0, ..Default::default() }).is_some());
        assert!(bad(SamplingConfig { top_p: Some(1.0), ..Default::default() }).is_none());
        assert!(bad(SamplingConfig { repetition_penalty: 0.0, ..Default::default() }).is_some());
    }

    #[test]
    fn every_bad_setting_names_its_field() {
        let bad = |c: SamplingConfig| c.validate().unwrap_err();
        for (config, field) in [
            (SamplingConfig { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingConfig { temperature: f32::NAN, ..Default::default() }, "temperature"),
            (SamplingConfig { temperature: f32::INFINITY, ..Default::default() }, "temperature"),
            (SamplingConfig { top_k: Some(0), ..Default::default() }, "top_k"),
            (SamplingConfig { top_p: Some(f32::NAN), ..Default::default() }, "top_p"),
            (SamplingConfig { top_p: Some(-0.5), ..Default::default() }, "top_p"),
            (SamplingConfig { repetition_penalty: -1.0, ..Default::default() }, "repetition_penalty"),
            (SamplingConfig { repetition_penalty: f32::NAN, ..Default::default() }, "repetition_penalty"),
        ] {
            let e = bad(config);
            assert_eq!(e.setting(), Some(field), "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        assert!(SamplingConfig { temperature: 0.0, top_p: Some(1.0), ..Default::default() }.validate().is_ok());
        assert_eq!(SampleError::EmptyPrompt.setting(), None);
    }

    #[test]
    fn prompts_are_checked_against_context_and_vocabulary() {
        assert!(check_prompts(&[vec![0, 9], vec![3]], 4, 10).is_ok());
        assert_eq!(check_prompts(&[vec![1], vec![]], 4, 10), Err(SampleError::EmptyPrompt));
        assert_eq!(
            check_prompts(&[vec![1; 5]], 4, 10),
            Err(SampleError::PromptTooLong { index: 0, tokens: 5, context: 4 })
        );
        let e = check_prompts(&[vec![1], vec![2, 10]], 4, 10).unwrap_err();
        assert_eq!(e, SampleError::TokenPastVocab { index: 1, id: 10, vocab_size: 10 });
        assert_eq!(e.to_string(), "prompt 1 has token id 10, past the model's vocabulary of 10 ids");
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let greedy = SamplingConfig { temperature: 0.0, repetition_penalty: 2.0, ..Default::default() };
        let mut s = Sampler::new(greedy, 0).unwrap();
        // Token 0 leads, but it was seen: 3.0 / 2 = 1.5 < 2.0.
        assert_eq!(s.sample_with_history(&[3.0, 2.0, -1.0], &[0]), 1);
        assert_eq!(s.sample_with_history(&[3.0, 2.0, -1.0], &[2]), 0);
    }

    #[test]
    fn a_bias_of_minus_100_bans_at_any_temperature() {
        let logits = [0.5f32, 400.0, 0.25, -1.0];
        let ban = Adjustments { logit_bias: vec![(1, -100.0)], ..Default::default() };
        for temperature in [0.0, 1.0] {
            let config = SamplingConfig { temperature, top_k: None, ..Default::default() };
            let mut s = Sampler::new(config, 4).unwrap().adjusted(ban.clone()).unwrap();
            let picks: Vec<usize> = (0..300).map(|_| s.sample_next(&logits, &[], 0, None).unwrap()).collect();
            assert!(!picks.contains(&1), "temperature {temperature}");
            assert!(temperature > 0.0 || picks.iter().all(|&i| i == 0), "greedy takes the argmax after the bias");
        }
        // Other biases add: 0.25 + 1 > 0.5.
        let greedy = |logit_bias: Vec<(u32, f32)>| {
            let adj = Adjustments { logit_bias, ..Default::default() };
            Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap().adjusted(adj)
        };
        assert_eq!(greedy(vec![(1, -100.0), (2, 1.0)]).unwrap().sample_next(&logits, &[], 0, None), Some(2));
        let all = (0..4).map(|i| (i, -100.0)).collect();
        assert_eq!(greedy(all).unwrap().sample_next(&logits, &[], 0, None), None, "every token banned");
        assert_eq!(greedy(vec![(1, -101.0)]).err().and_then(|e| e.setting()), Some("logit_bias"));
    }

    #[test]
    fn penalties_count_only_the_generated_tokens() {
        // Token 0 leads by 0.5: in the prompt only, it is not penalised; generated twice, it is
        // (2 - 0.25 - 2 * 0.25 < 1.5).
        let logits = [2.0f32, 1.5, 0.0];
        let adj = Adjustments { presence_penalty: 0.25, frequency_penalty: 0.25, ..Default::default() };
        let greedy = SamplingConfig { temperature: 0.0, ..Default::default() };
        let mut s = Sampler::new(greedy, 0).unwrap().adjusted(adj).unwrap();
        assert_eq!(s.sample_next(&logits, &[1, 0, 0], 0, None), Some(0));
        assert_eq!(s.sample_next(&logits, &[1, 0, 0], 2, None), Some(1));
        assert_eq!(s.sample_next(&logits, &[1, 0, 1], 2, None), Some(0), "1 is generated once, 0 once");
    }

    #[test]
    fn min_p_keeps_the_tokens_near_the_top_one() {
        // Probabilities 8:4:2:1 over the four (temperature 1): min_p 0.2 keeps those >= 1.6/8.
        let logits: Vec<f32> = [8.0f32, 4.0, 2.0, 1.0].iter().map(|p| p.ln()).collect();
        let config = SamplingConfig { temperature: 1.0, top_k: None, ..Default::default() };
        let sampler = |min_p: f32| {
            Sampler::new(config.clone(), 1)
                .unwrap()
                .adjusted(Adjustments { min_p: Some(min_p), ..Default::default() })
                .unwrap()
        };
        let (mut kept, probs) = sampler(0.2).candidates(&logits);
        kept.sort();
        assert_eq!(kept, vec![0, 1, 2]);
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(sampler(0.6).candidates(&logits).0, vec![0]);
        assert_eq!(sampler(1.0).candidates(&logits).0, vec![0], "the top one is always kept");
        assert_eq!(sampler(0.0).candidates(&logits).0.len(), 4);
    }

    #[test]
    fn a_mask_limits_the_draw_and_its_absence_changes_nothing() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 13) % 7) as f32 * 0.4).collect();
        let config =
            SamplingConfig { temperature: 0.9, top_k: Some(20), repetition_penalty: 1.3, ..Default::default() };
        let (mut a, mut b) = (Sampler::new(config.clone(), 2).unwrap(), Sampler::new(config, 2).unwrap());
        for _ in 0..50 {
            assert_eq!(a.sample_next(&logits, &[3, 5], 1, None), Some(b.sample_with_history(&logits, &[3, 5])));
        }
        let mask = [1u32 << 7 | 1 << 30, 1 << 2]; // 7, 30, 34
        let picks: Vec<usize> = (0..100).map(|_| a.sample_next(&logits, &[], 0, Some(&mask)).unwrap()).collect();
        assert!(picks.iter().all(|i| [7, 30, 34].contains(i)), "{picks:?}");
        assert_eq!(a.sample_next(&logits, &[], 0, Some(&[0, 0])), None);
    }
}
