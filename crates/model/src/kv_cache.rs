//! The key/value cache of cached decoding: per layer, the post-RoPE keys and values of the K
//! key/value heads in one pool of fixed-size blocks, each sequence holding the blocks its block
//! table lists (a paged cache, as vLLM's): memory grows with the positions stored, not with
//! `T_max` per sequence, and a finished sequence's blocks go back to the pool for the next.
//!
//! A call through [`crate::Decoder::forward_cached`] feeds `T` new positions for each of `B`
//! sequences, of which the first `new_lens[b]` are real (right padding): sequence `b`'s new tokens
//! sit at absolute positions `len_b .. len_b + new_lens[b]`, and only those are stored.
//!
//! A step costs the same two ops per layer whatever the batch: one write of every sequence's new
//! rows into the pool ([`KvWriteOps::kv_write`], in place on the CPU) and one attention that reads
//! the keys and values through the block tables ([`PagedAttentionOps::paged_attention`], in place
//! on the CPU; elsewhere a gather and a mask, made once for all layers).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Device, Int, Tensor, TensorData, TensorPrimitive};

use crate::config::ModelConfig;
use ember_kernels::attention::causal_mask;
use ember_kernels::attention::Scores;
use ember_kernels::kv::KvWriteOps;
use ember_kernels::paged::{grouped_attention, latent_attention, Paged, PagedAttentionOps, PagedLayout};
use ember_kernels::Compute;

#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    block_size: usize,
    /// Numbers a position takes in each layer's key pool and value pool: `K·Dh` each, or a latent
    /// attention's `kv_rank + rope_dim` and none (its values are part of the latent).
    key_width: usize,
    value_width: usize,
    /// What the pools store: f32, or f16 ([`ember_kernels::Compute::kv_cache`]).
    dtype: DType,
    max_len: usize,
    /// The model's sliding window: a query at position `p` of a local layer sees keys after
    /// `p - window`.
    window: Option<usize>,
    /// Per layer: whether it attends within the window (Gemma 3 mixes local and global layers).
    local: Vec<bool>,
    /// Per layer: keys and values of every block of the pool, one row a position,
    /// `[blocks · block_size, K·Dh]`; with latent attention the keys are the latents,
    /// `[blocks · block_size, kv_rank + rope_dim]`, and there are no value pools.
    keys: Vec<Tensor<B, 2>>,
    values: Vec<Tensor<B, 2>>,
    /// Blocks of the pool no sequence holds.
    free: Vec<usize>,
    /// Per block of the pool: how many sequences hold it (more than one where a prefix is shared,
    /// [`KvCache::share_prefix`]).
    holders: Vec<u32>,
    /// Per sequence: its blocks, in position order.
    tables: Vec<Vec<usize>>,
    /// Positions stored per sequence.
    lens: Vec<usize>,
    /// The call under way, if any.
    plan: Option<Plan<B>>,
    device: Device<B>,
}

/// What every layer of one call shares: where the new rows go and where the queries find their
/// keys.
#[derive(Debug, Clone)]
struct Plan<B: Backend> {
    /// The sequences of the call, in the order of its batch rows.
    rows: Vec<usize>,
    /// Real new positions of each batch row.
    pending: Vec<usize>,
    /// New positions per batch row in the call's tensors (`T`, real ones first).
    t: usize,
    /// Pool rows the call's real new positions go to, batch row by batch row.
    write: Vec<usize>,
    /// Which of the `B·T` new rows are real (`None`: all are).
    real: Option<Tensor<B, 1, Int>>,
    /// The batch rows' block tables and lengths, for the attention (of the local layers, when
    /// some attend globally).
    paged: Paged<B>,
    /// The same without the window, for the global layers of a model that mixes them.
    paged_global: Option<Paged<B>>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `batch` sequences of a model, in blocks of `block_size` positions, its
    /// keys and values stored in `dtype` (f16 or f32; latent attention's always f32).
    pub(crate) fn new(
        config: &ModelConfig,
        (batch, block_size): (usize, usize),
        dtype: DType,
        device: &Device<B>,
    ) -> Self {
        // Every layer's attention answers alike (the window aside): the first's widths are all's.
        let (key_width, value_width) = config.attention(0).part().cache_widths();
        // Latent attention has no value pools (its values are part of the latent), and reads its
        // latents through the composition: f32.
        let dtype = if value_width > 0 && dtype == DType::F16 { DType::F16 } else { DType::F32 };
        let empty = |w| match w {
            0 => Vec::new(),
            w => (0..config.n_layers).map(|_| zeros([0, w], dtype, device)).collect::<Vec<_>>(),
        };
        Self {
            block_size: block_size.max(1),
            key_width,
            value_width,
            dtype,
            max_len: config.max_seq_len,
            window: config.sliding_window,
            local: (0..config.n_layers).map(|l| config.is_local(l)).collect(),
            keys: empty(key_width),
            values: empty(value_width),
            free: Vec::new(),
            holders: Vec::new(),
            tables: vec![Vec::new(); batch],
            lens: vec![0; batch],
            plan: None,
            device: device.clone(),
        }
    }

    /// Sequences the cache holds.
    pub(crate) fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Positions stored for each sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Bytes one position takes across all layers in `dtype`: `2 · L · K · Dh · bytes` (keys and
    /// values); with latent attention `L · (kv_rank + rope_dim) · bytes`.
    pub fn bytes_per_token(&self, dtype: DType) -> usize {
        self.keys.len() * (self.key_width + self.value_width) * dtype.size()
    }

    /// What the pools store.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes the pools hold now, every block of every layer, free or held.
    #[cfg(test)]
    pub(crate) fn pool_bytes(&self) -> usize {
        let rows = |pools: &[Tensor<B, 2>]| pools.iter().map(|p| p.dims()[0] * p.dims()[1]).sum::<usize>();
        (rows(&self.keys) + rows(&self.values)) * self.dtype.size()
    }

    /// Forgets everything stored for sequence `b`; its blocks go back to the pool (a block shared
    /// with another sequence once that one lets it go too).
    pub fn reset(&mut self, b: usize) {
        for block in std::mem::take(&mut self.tables[b]) {
            self.holders[block] -= 1;
            if self.holders[block] == 0 {
                self.free.push(block);
            }
        }
        self.lens[b] = 0;
    }

    /// Blocks held by at least one sequence (a shared block counted once).
    pub fn held_blocks(&self) -> usize {
        self.holders.iter().filter(|&&h| h > 0).count()
    }

    /// Blocks of the pool no sequence holds (taken before the pool grows).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks sequence `row` takes from the pool to store `n` more positions: the new ones past its
    /// last block, and a copy of that block if it is partly filled and shared.
    pub fn blocks_needed(&self, row: usize, n: usize) -> usize {
        let (len, table) = (self.lens[row], &self.tables[row]);
        let grows = (len + n).div_ceil(self.block_size).saturating_sub(table.len());
        let copies = table
            .get(len / self.block_size)
            .is_some_and(|&b| n > 0 && len % self.block_size > 0 && self.holders[b] > 1);
        grows + usize::from(copies)
    }

    /// Gives sequence `row` blocks for `positions` positions, growing the pool when none are free.
    fn reserve(&mut self, row: usize, positions: usize) {
        let need = positions.div_ceil(self.block_size).saturating_sub(self.tables[row].len());
        if need > self.free.len() {
            self.grow(need - self.free.len());
        }
        let start = self.free.len() - need;
        for &block in &self.free[start..] {
            self.holders[block] = 1;
        }
        self.tables[row].extend(self.free.drain(start..).rev());
    }

    /// Adds at least `blocks` blocks to the pool (doubling it, so that growing is amortised).
    fn grow(&mut self, blocks: usize) {
        let have = self.keys.first().map_or(0, |k| k.dims()[0]) / self.block_size;
        let add = blocks.max(have).max(1);
        for (pools, width) in [(&mut self.keys, self.key_width), (&mut self.values, self.value_width)] {
            let zeros = zeros::<B>([add * self.block_size, width], self.dtype, &self.device);
            for pool in pools.iter_mut() {
                *pool = Tensor::cat(vec![pool.clone(), zeros.clone()], 0);
            }
        }
        self.free.extend((have..have + add).rev());
        self.holders.resize(have + add, 0);
    }

    /// The pool row of position `pos` of sequence `row`.
    fn slot(&self, row: usize, pos: usize) -> usize {
        self.tables[row][pos / self.block_size] * self.block_size + pos % self.block_size
    }

    fn plan(&self, rows: &[usize], pending: &[usize]) -> Plan<B> {
        let t = pending.iter().copied().max().unwrap_or(0).max(1);
        let mut write = Vec::new();
        let mut real = Vec::new();
        for (b, (&row, &n)) in rows.iter().zip(pending).enumerate() {
            for i in 0..n {
                write.push(self.slot(row, self.lens[row] + i));
                real.push((b * t + i) as i64);
            }
        }
        let all_real = real.len() == rows.len() * t;
        let layout = PagedLayout {
            block_size: self.block_size,
            tables: rows.iter().map(|&row| self.tables[row].clone()).collect(),
            starts: rows.iter().map(|&row| self.lens[row]).collect(),
            totals: rows.iter().zip(pending).map(|(&row, n)| self.lens[row] + n).collect(),
            queries: t,
            window: self.window,
        };
        let mixed = self.window.is_some() && self.local.contains(&false);
        let global = mixed.then(|| Paged::new(PagedLayout { window: None, ..layout.clone() }, &self.device));
        let n = real.len();
        Plan {
            rows: rows.to_vec(),
            pending: pending.to_vec(),
            t,
            write,
            real: (!all_real).then(|| Tensor::from_data(TensorData::new(real, [n]), &self.device)),
            paged: Paged::new(layout, &self.device),
            paged_global: global,
        }
    }
}

/// One forward call through the cache, made by [`KvCache::step`] or [`KvCache::step_rows`]. Its
/// new positions count only once [`CacheStep::finish`] is called: a step dropped without it leaves
/// the lengths where they were (and what it wrote is overwritten by the next call).
#[must_use = "a cache step's positions count only after `finish`"]
pub(crate) struct CacheStep<'a, B: Backend> {
    cache: &'a mut KvCache<B>,
}

impl<B: Backend> CacheStep<'_, B> {
    /// Layer `layer`'s view of the cache for this call.
    pub(crate) fn layer(&mut self, layer: usize) -> LayerKv<'_, B> {
        LayerKv { cache: self.cache, layer }
    }

    /// Ends the call: the new positions become part of the call's sequences.
    pub(crate) fn finish(self) {
        let c = self.cache;
        if let Some(plan) = c.plan.take() {
            for (&row, &n) in plan.rows.iter().zip(&plan.pending) {
                c.lens[row] += n;
            }
        }
    }
}

/// One layer's keys and values for the call under way: where each row's new positions start, and
/// what its queries attend over once the new keys and values are stored.
pub(crate) struct LayerKv<'a, B: Backend> {
    cache: &'a mut KvCache<B>,
    layer: usize,
}

impl<B: KvWriteOps> KvCache<B> {
    /// Makes sequence `to` hold the first `len` positions of sequence `from` without storing them
    /// twice: the blocks are shared (held by both), and new positions go after them. A shared block
    /// that is partly filled is copied by the first sequence that writes into it (copy-on-write:
    /// [`KvCache::step_rows`]), so that the sequences part at the first position they differ. What
    /// `to` held before is let go; `from == to` keeps the first `len` positions of the sequence.
    /// The choices of a multiple-choice question, several samples of one prompt, or requests that
    /// open with the same system prompt then continue one prefix computed once.
    ///
    /// # Panics
    /// If either sequence does not exist or `from` holds fewer than `len` positions.
    pub fn share_prefix(&mut self, from: usize, to: usize, len: usize) {
        assert!(from < self.batch() && to < self.batch(), "sequences {from} and {to}");
        assert!(len <= self.lens[from], "sequence {from} holds {} positions, not {len}", self.lens[from]);
        let blocks: Vec<usize> = self.tables[from][..len.div_ceil(self.block_size)].to_vec();
        // Held before `to` lets its own go, so that sharing with itself keeps them.
        for &block in &blocks {
            self.holders[block] += 1;
        }
        self.reset(to);
        self.tables[to] = blocks;
        self.lens[to] = len;
    }

    /// Gives sequence `row` a block of its own in place of a partly filled last block it shares,
    /// the positions stored so far copied: its next positions go into that block, and the other
    /// holders' do not see them.
    fn own_last_block(&mut self, row: usize) {
        let (full, tail) = (self.lens[row] / self.block_size, self.lens[row] % self.block_size);
        let Some(&shared) = self.tables[row].get(full).filter(|&&b| tail > 0 && self.holders[b] > 1) else {
            return;
        };
        if self.free.is_empty() {
            self.grow(1);
        }
        let Some(own) = self.free.pop() else { return };
        self.holders[own] = 1;
        self.holders[shared] -= 1;
        self.tables[row][full] = own;
        let (src, dst) = (shared * self.block_size, own * self.block_size);
        let dst: Vec<usize> = (dst..dst + tail).collect();
        for pool in self.keys.iter_mut().chain(self.values.iter_mut()) {
            // The rows read out first (a copy of their own), so that the write finds the pool
            // unshared and writes in place.
            let rows = Tensor::<B, 2>::from_data(pool.clone().slice([src..src + tail]).into_data(), &self.device);
            // Widened (exactly) from an f16 pool: the write rounds f32 rows to the pool's type.
            let rows = if rows.dtype() == DType::F32 { rows } else { rows.cast(DType::F32) };
            let owned = std::mem::replace(pool, Tensor::zeros([0, 1], &self.device));
            *pool = float(B::kv_write(prim(owned), &dst, prim(rows)));
        }
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
    pub(crate) fn step_rows(&mut self, rows: &[usize], new_lens: &[usize]) -> CacheStep<'_, B> {
        assert_eq!(new_lens.len(), rows.len(), "one length per row");
        for (i, (&row, &n)) in rows.iter().zip(new_lens).enumerate() {
            assert!(row < self.batch() && !rows[..i].contains(&row), "row {row} named twice or out of range");
            assert!(self.lens[row] + n <= self.max_len, "sequence {row} outgrows the context");
        }
        for (&row, &n) in rows.iter().zip(new_lens) {
            if n > 0 {
                self.own_last_block(row);
            }
            self.reserve(row, self.lens[row] + n);
        }
        self.plan = Some(self.plan(rows, new_lens));
        CacheStep { cache: self }
    }
}

impl<B: KvWriteOps + PagedAttentionOps> LayerKv<'_, B> {
    /// The absolute position of each batch row's first new token.
    pub(crate) fn starts(&self) -> Vec<usize> {
        let plan = self.cache.plan.as_ref();
        plan.map_or_else(Vec::new, |p| p.rows.iter().map(|&row| self.cache.lens[row]).collect())
    }

    /// Stores the new post-RoPE keys and values (the first `new_lens[b]` positions of batch row
    /// `b`), then the attention of the new queries over every stored key of their sequence that
    /// is not in their future (and within the sliding window), each key/value head shared by `rep`
    /// query heads.
    ///
    /// # Shapes
    /// - q: `[B, H, T, Dh]`, k, v: `[B, K, T, Dh]` -> `[B, H, T, Dh]`
    pub(crate) fn attend(
        self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        (rep, scores): (usize, Scores),
        cx: Compute,
    ) -> Tensor<B, 4> {
        let c = self.cache;
        let width = c.key_width; // K·Dh
        let Some(plan) = c.plan.as_ref() else {
            return grouped_attention(q, k, v, None, (rep, scores), cx.dtype); // no step under way: own keys only
        };
        let b = plan.rows.len();
        let rows = |x: Tensor<B, 4>| {
            let x = x.swap_dims(1, 2).reshape([b * plan.t, width]); // [B·T, K·Dh]
            match &plan.real {
                Some(real) => x.select(0, real.clone()),
                None => x,
            }
        };
        let (nk, nv) = (rows(k), rows(v));
        let l = self.layer;
        // The pool is moved into the write (not cloned), so that it can happen in place.
        let placeholder = || Tensor::<B, 2>::empty([0, width], &c.device);
        let keys = std::mem::replace(&mut c.keys[l], placeholder());
        c.keys[l] = float(B::kv_write(prim(keys), &plan.write, prim(nk)));
        let values = std::mem::replace(&mut c.values[l], placeholder());
        c.values[l] = float(B::kv_write(prim(values), &plan.write, prim(nv)));
        let (keys, values) = (prim(c.keys[l].clone()), prim(c.values[l].clone()));
        let paged = match &plan.paged_global {
            Some(global) if !c.local[l] => global,
            _ => &plan.paged,
        };
        float(B::paged_attention(prim(q), keys, values, paged, (rep, scores), cx))
    }
}

impl<B: KvWriteOps> LayerKv<'_, B> {
    /// Stores the new positions' latents (latent attention: `[c | k_rope]` each, the first
    /// `new_lens[b]` of batch row `b`), then the attention of the new queries over every stored
    /// latent of their sequence not in their future: one key every head reads, its first
    /// `value_width` numbers the value.
    ///
    /// # Shapes
    /// - q: `[B, H, T, W]`, latent: `[B, 1, T, W]` -> `[B, H, T, value_width]`
    pub(crate) fn attend_latent(
        self,
        q: Tensor<B, 4>,
        latent: Tensor<B, 4>,
        value_width: usize,
        scores: Scores,
        cx: Compute,
    ) -> Tensor<B, 4> {
        let c = self.cache;
        let [_, h, t, w] = q.dims();
        let Some(plan) = c.plan.as_ref() else {
            // No step under way: the call's own positions only, causally.
            let values = latent.clone().narrow(3, 0, value_width);
            let hidden = causal_mask::<B>(t, t, None, &q.device());
            return grouped_attention(q, latent, values, Some(hidden), (h, scores), cx.dtype);
        };
        let b = plan.rows.len();
        let rows = latent.reshape([b * plan.t, w]);
        let rows = match &plan.real {
            Some(real) => rows.select(0, real.clone()),
            None => rows,
        };
        let l = self.layer;
        let pool = std::mem::replace(&mut c.keys[l], Tensor::<B, 2>::empty([0, w], &c.device));
        c.keys[l] = float(B::kv_write(prim(pool), &plan.write, prim(rows)));
        latent_attention(q, c.keys[l].clone(), value_width, &plan.paged, scores, cx.dtype)
    }
}

/// Zeros of `shape` in `dtype`.
fn zeros<B: Backend>(shape: [usize; 2], dtype: DType, device: &Device<B>) -> Tensor<B, 2> {
    let zeros = Tensor::<B, 2>::zeros(shape, device);
    if dtype == DType::F32 {
        zeros
    } else {
        zeros.cast(dtype)
    }
}

fn float<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}
