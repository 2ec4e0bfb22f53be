//! The key/value cache of cached decoding: per layer and per sequence, the post-RoPE keys and values
//! of the K key/value heads, held in fixed-size blocks allocated as the sequence grows (a paged
//! cache) instead of one `T_max` buffer per request.
//!
//! A call through [`crate::Decoder::forward_cached`] feeds `T` new positions for each of `B`
//! sequences, of which the first `new_lens[b]` are real (right padding): sequence `b`'s new tokens
//! sit at absolute positions `len_b .. len_b + new_lens[b]`, and only those are stored.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Device, Tensor, TensorData};

use crate::config::ModelConfig;
use crate::ops::attention::{masked_attention, repeat_kv, segmented_attention};

/// Keys and values of one sequence in one layer: `[K, block_size, Dh]` blocks, the last one filled up
/// to `len % block_size`.
#[derive(Debug, Clone)]
struct SeqBlocks<B: Backend> {
    k: Vec<Tensor<B, 3>>,
    v: Vec<Tensor<B, 3>>,
    /// The first `folded` blocks concatenated, `[K, folded·block_size, Dh]`: a decode step reads the
    /// keys as this plus the blocks after it, and re-concatenates only when a block fills.
    folded: Option<(Tensor<B, 3>, Tensor<B, 3>)>,
    folded_blocks: usize,
}

impl<B: Backend> SeqBlocks<B> {
    fn new() -> Self {
        Self { k: Vec::new(), v: Vec::new(), folded: None, folded_blocks: 0 }
    }
}

#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    max_len: usize,
    /// `[layer][sequence]`.
    layers: Vec<Vec<SeqBlocks<B>>>,
    /// Positions stored per sequence.
    lens: Vec<usize>,
    /// The sequences of the call under way, in the order of its batch rows.
    rows: Vec<usize>,
    /// Real new positions of each batch row of the call under way.
    pending: Vec<usize>,
    device: Device<B>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `batch` sequences of a model, in blocks of `block_size` positions.
    pub fn new(config: &ModelConfig, batch: usize, block_size: usize, device: &Device<B>) -> Self {
        let empty = SeqBlocks::new();
        Self {
            block_size: block_size.max(1),
            n_kv_heads: config.n_kv_heads(),
            head_dim: config.head_dim(),
            max_len: config.max_seq_len,
            layers: vec![vec![empty; batch]; config.n_layers],
            lens: vec![0; batch],
            rows: Vec::new(),
            pending: Vec::new(),
            device: device.clone(),
        }
    }

    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Positions stored for each sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Bytes one position takes across all layers: `2 · L · K · Dh · bytes` (keys and values).
    pub fn bytes_per_token(&self, dtype: DType) -> usize {
        2 * self.layers.len() * self.n_kv_heads * self.head_dim * dtype.size()
    }

    /// Bytes of the blocks allocated so far (f32), filled or not.
    pub fn allocated_bytes(&self) -> usize {
        let blocks: usize = self.layers.first().map_or(0, |l| l.iter().map(|s| s.k.len()).sum());
        blocks * self.block_size * self.bytes_per_token(DType::F32)
    }

    /// Forgets everything stored for sequence `b` (its blocks are freed).
    pub fn reset(&mut self, b: usize) {
        for layer in &mut self.layers {
            layer[b] = SeqBlocks::new();
        }
        self.lens[b] = 0;
    }

    /// Starts a forward call that brings `new_lens[b]` real positions to sequence `b`, for every
    /// sequence of the cache: [`Self::step_rows`] over all of them.
    ///
    /// # Panics
    /// As [`Self::step_rows`].
    pub fn step(&mut self, new_lens: &[usize]) -> CacheStep<'_, B> {
        let rows: Vec<usize> = (0..self.batch()).collect();
        self.step_rows(&rows, new_lens)
    }

    /// Starts a forward call over some of the cache's sequences: batch row `i` of the call is
    /// sequence `rows[i]` and brings `new_lens[i]` real positions. The step hands each layer its view
    /// of the cache, and [`CacheStep::finish`] makes the new positions part of the sequences. The
    /// other sequences are left as they are (continuous batching runs only the live ones).
    ///
    /// # Panics
    /// If `rows` and `new_lens` differ in length, a row is named twice or does not exist, or a
    /// sequence would outgrow the model's context (callers check the lengths first:
    /// `generate_batch` and the engine refuse prompts that do not fit).
    pub fn step_rows(&mut self, rows: &[usize], new_lens: &[usize]) -> CacheStep<'_, B> {
        assert_eq!(new_lens.len(), rows.len(), "one length per row");
        for (i, (&row, &n)) in rows.iter().zip(new_lens).enumerate() {
            assert!(row < self.batch() && !rows[..i].contains(&row), "row {row} named twice or out of range");
            assert!(self.lens[row] + n <= self.max_len, "sequence {row} outgrows the context");
        }
        self.rows = rows.to_vec();
        self.pending = new_lens.to_vec();
        CacheStep { cache: self }
    }

    /// Stores the new keys and values of layer `layer` for the one sequence of a one-sequence cache
    /// and returns its keys and values as segments to attend over in order: the folded full blocks
    /// and what follows them. No copy of the whole cache is made per step; full blocks are
    /// concatenated once, when one fills.
    ///
    /// # Shapes
    /// - k, v: `[1, K, T, Dh]` -> segments of `[1, K, s_i, Dh]` with Σ s_i = stored positions
    fn append_segments(&mut self, layer: usize, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Vec<(Tensor<B, 4>, Tensor<B, 4>)> {
        assert_eq!(self.rows.len(), 1, "segments are for a one-sequence call");
        self.write(layer, 0, &k, &v);
        let (bs, row) = (self.block_size, self.rows[0]);
        let total = self.lens[row] + self.pending[0];
        let seq = &mut self.layers[layer][row];
        let full = total / bs;
        if full > seq.folded_blocks {
            let mut ks: Vec<Tensor<B, 3>> = seq.folded.iter().map(|(k, _)| k.clone()).collect();
            let mut vs: Vec<Tensor<B, 3>> = seq.folded.iter().map(|(_, v)| v.clone()).collect();
            ks.extend(seq.k[seq.folded_blocks..full].iter().cloned());
            vs.extend(seq.v[seq.folded_blocks..full].iter().cloned());
            seq.folded = Some((Tensor::cat(ks, 1), Tensor::cat(vs, 1)));
            seq.folded_blocks = full;
        }
        let mut out = Vec::new();
        if let Some((k, v)) = &seq.folded {
            out.push((k.clone().unsqueeze::<4>(), v.clone().unsqueeze::<4>()));
        }
        let rest = total - seq.folded_blocks * bs;
        if rest > 0 {
            let block = seq.folded_blocks;
            let k = seq.k[block].clone().narrow(1, 0, rest).unsqueeze::<4>();
            let v = seq.v[block].clone().narrow(1, 0, rest).unsqueeze::<4>();
            out.push((k, v));
        }
        out
    }

    /// Copies the first `pending[b]` new positions of batch row `b` of `k` and `v` into the blocks
    /// of its sequence.
    fn write(&mut self, layer: usize, b: usize, k: &Tensor<B, 4>, v: &Tensor<B, 4>) {
        let (bs, kh, dh) = (self.block_size, self.n_kv_heads, self.head_dim);
        let row = self.rows[b];
        let (start, n) = (self.lens[row], self.pending[b]);
        let seq = &mut self.layers[layer][row];
        let row = |x: &Tensor<B, 4>| x.clone().narrow(0, b, 1).reshape([kh, x.dims()[2], dh]); // [K, T, Dh]
        let (k_row, v_row) = (row(k), row(v));
        let mut written = 0;
        while written < n {
            let pos = start + written; //           absolute position being written
            let (block, offset) = (pos / bs, pos % bs);
            if block == seq.k.len() {
                seq.k.push(Tensor::zeros([kh, bs, dh], &self.device));
                seq.v.push(Tensor::zeros([kh, bs, dh], &self.device));
            }
            let m = (bs - offset).min(n - written); // positions that fit in this block
            let dst = [0..kh, offset..offset + m, 0..dh];
            let src = |x: &Tensor<B, 3>| x.clone().narrow(1, written, m);
            seq.k[block] = seq.k[block].clone().slice_assign(dst.clone(), src(&k_row));
            seq.v[block] = seq.v[block].clone().slice_assign(dst, src(&v_row));
            written += m;
        }
    }

    /// Stores layer `layer`'s new keys and values (the first `pending[b]` positions of row `b`) and
    /// returns every sequence's keys and values so far, padded to the longest.
    ///
    /// # Shapes
    /// - k, v: `[B, K, T, Dh]` -> (`[B, K, S, Dh]`, `[B, K, S, Dh]`), S = max over b of `len_b + new_b`
    fn append(&mut self, layer: usize, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let (bs, kh, dh) = (self.block_size, self.n_kv_heads, self.head_dim);
        let totals = self.totals();
        let s_max = totals.iter().copied().max().unwrap_or(0).max(1);
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for (b, &total) in totals.iter().enumerate() {
            self.write(layer, b, &k, &v);
            let seq = &self.layers[layer][self.rows[b]];
            let gather = |blocks: &[Tensor<B, 3>]| {
                let mut parts: Vec<Tensor<B, 3>> = blocks.to_vec();
                let have = blocks.len() * bs;
                if have < s_max {
                    parts.push(Tensor::zeros([kh, s_max - have, dh], &self.device));
                }
                let all = Tensor::cat(parts, 1); // [K, ≥S, Dh]; positions >= total are padding
                debug_assert!(total <= s_max);
                all.narrow(1, 0, s_max).unsqueeze::<4>() // [1, K, S, Dh]
            };
            ks.push(gather(&seq.k));
            vs.push(gather(&seq.v));
        }
        (Tensor::cat(ks, 0), Tensor::cat(vs, 0))
    }

    /// Positions each batch row's sequence holds once the call's new ones are stored.
    fn totals(&self) -> Vec<usize> {
        self.rows.iter().zip(&self.pending).map(|(&row, n)| self.lens[row] + n).collect()
    }

    /// Which keys each new query may not see: key `j` is hidden from query `i` of row `b` unless it
    /// is stored (`j < len_b + new_b`), not in the query's future (`j <= len_b + i`), and within the
    /// sliding window if there is one (`len_b + i - j < window`).
    ///
    /// `None` when nothing is hidden (one new position per row, rows of equal length, no window
    /// cutting in): the common single-sequence decode step needs no mask at all.
    ///
    /// # Shapes
    /// -> `[B, 1, T, S]`, true where hidden
    fn mask(&self, t: usize, window: Option<usize>) -> Option<Tensor<B, 4, Bool>> {
        let totals = self.totals();
        let b = totals.len();
        let s = totals.iter().copied().max().unwrap_or(0).max(1);
        let all_new = self.pending.iter().all(|&n| n == t);
        if t == 1 && all_new && totals.iter().all(|&n| n == s) && window.is_none_or(|w| s <= w) {
            return None;
        }
        let mut hidden = Vec::with_capacity(b * t * s);
        for row in 0..b {
            let (start, total) = (self.lens[self.rows[row]], totals[row]);
            for i in 0..t {
                let pos = start + i;
                hidden.extend((0..s).map(|j| !(j < total && j <= pos && window.is_none_or(|w| pos - j < w))));
            }
        }
        Some(Tensor::from_data(TensorData::new(hidden, [b, 1, t, s]), &self.device))
    }
}

/// One forward call through the cache, made by [`KvCache::step`] or [`KvCache::step_rows`]. Its
/// new positions count only once [`CacheStep::finish`] is called: a step dropped without it leaves
/// the lengths where they were (and what it wrote is overwritten by the next call).
#[must_use = "a cache step's positions count only after `finish`"]
pub struct CacheStep<'a, B: Backend> {
    cache: &'a mut KvCache<B>,
}

impl<B: Backend> CacheStep<'_, B> {
    /// Layer `layer`'s view of the cache for this call.
    pub fn layer(&mut self, layer: usize) -> LayerKv<'_, B> {
        LayerKv { cache: self.cache, layer }
    }

    /// Ends the call: the new positions become part of the call's sequences.
    pub fn finish(self) {
        let c = self.cache;
        for (&row, &n) in c.rows.iter().zip(&c.pending) {
            c.lens[row] += n;
        }
        c.rows.clear();
        c.pending.clear();
    }
}

/// One layer's keys and values for the call under way: where each row's new positions start, and
/// what its queries attend over once the new keys and values are stored.
pub struct LayerKv<'a, B: Backend> {
    cache: &'a mut KvCache<B>,
    layer: usize,
}

impl<B: Backend> LayerKv<'_, B> {
    /// The absolute position of each batch row's first new token.
    pub fn starts(&self) -> Vec<usize> {
        self.cache.rows.iter().map(|&row| self.cache.lens[row]).collect()
    }

    /// Stores the new post-RoPE keys and values (the first `new_lens[b]` positions of row `b`) and
    /// returns every stored key and value the `t` new queries may see: for one sequence with one new
    /// position and nothing hidden, the cache's own segments read in place; otherwise every row's
    /// keys padded to the longest, with the mask of what each query may not see.
    ///
    /// # Shapes
    /// - k, v: `[B, K, T, Dh]`
    pub fn store(self, k: Tensor<B, 4>, v: Tensor<B, 4>, window: Option<usize>) -> KvView<B> {
        let c = self.cache;
        let [b, _, t, _] = k.dims();
        let stored = c.lens[c.rows[0]] + 1;
        if b == 1 && t == 1 && c.pending[0] == 1 && window.is_none_or(|w| stored <= w) {
            return KvView::Segments(c.append_segments(self.layer, k, v));
        }
        let (k, v) = c.append(self.layer, k, v);
        KvView::Padded { k, v, hidden: c.mask(t, window) }
    }
}

/// The keys and values a layer's new queries attend over, as the cache hands them out (post-RoPE,
/// `K` heads).
pub enum KvView<B: Backend> {
    /// One sequence's keys and values in position order, every one visible: `[1, K, s_i, Dh]`.
    Segments(Vec<(Tensor<B, 4>, Tensor<B, 4>)>),
    /// Every row's keys and values padded to `S`: `[B, K, S, Dh]`, and `[B, 1, T, S]` true where
    /// hidden (`None`: nothing is).
    Padded { k: Tensor<B, 4>, v: Tensor<B, 4>, hidden: Option<Tensor<B, 4, Bool>> },
}

impl<B: Backend> KvView<B> {
    /// Attention of `q` over these keys and values, each key/value head shared by `rep` query heads.
    ///
    /// # Shapes
    /// - q: `[B, H, T, Dh]` -> `[B, H, T, Dh]`
    pub fn attend(self, q: Tensor<B, 4>, rep: usize, compute: DType) -> Tensor<B, 4> {
        match self {
            Self::Segments(segments) => {
                let segments = segments.into_iter().map(|(k, v)| (repeat_kv(k, rep), repeat_kv(v, rep))).collect();
                segmented_attention(q, segments, compute)
            }
            Self::Padded { k, v, hidden } => masked_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), hidden, compute),
        }
    }
}
