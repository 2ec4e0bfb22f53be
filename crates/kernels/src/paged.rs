//! Attention of a cached step's new queries over a paged KV cache, reading the keys and values
//! where the block pool holds them (vLLM's paged attention, on the CPU).
//!
//! The cache keeps each layer's keys and values in one pool of fixed-size blocks, and each sequence
//! lists its blocks in a block table ([`crate::KvCache`]). The composition gathers every sequence's
//! rows out of the pool into a padded `[B, K, S, Dh]` copy, builds a `[B, 1, T, S]` mask and runs
//! masked attention: three passes over the keys and values per layer, and a mask as large as the
//! scores. The kernel reads each block once, through the table, in place.
//!
//! What a query sees is a range: query `i` of batch row `b` (at position `start_b + i`) sees the
//! stored keys `j < total_b` that are not in its future (`j <= start_b + i`) and, with a sliding
//! window `w`, not `w` or more positions back. [`PagedLayout::visible`] is that range, and both the
//! kernel and the composition's mask are made from it.
//!
//! The kernel: one task per (batch row, key/value head, group of query rows), the `H/K` query heads
//! sharing a key/value head taken together so that each key is read once for all of them. A task
//! walks the table's blocks in the visible span; per block it scores its rows against the block's
//! keys, updates each row's running maximum and sum (the online softmax of flash attention: nothing
//! as large as `T × S` is ever made) and adds the block's values weighted by the probabilities.
//! Compiled three times and chosen at run time by the caller's [`Cpu`]: with AVX-512 (F, VL) and
//! FMA (16-lane multiply-adds written out), the plain loops with AVX2 and FMA enabled (8 lanes),
//! plain otherwise.

use std::cell::OnceCell;
use std::ops::Range;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, f16, Bool, DType, Int, Tensor, TensorData};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::activation::exp;
use crate::attention::{masked_attention, Scores};
use crate::compute::{Compute, Cpu};
use crate::kernels::{lanes_dot, lanes_max, lanes_sum};
#[cfg(target_arch = "x86_64")]
use crate::simd::{self, Tier};
use crate::{flex, float, prim};

/// Where a cached call's queries find their keys: each batch row's block table and how many
/// positions it had before the call and has after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedLayout {
    /// Positions per block.
    pub block_size: usize,
    /// Per batch row: its blocks in the pool, in position order (position `p` is pool row
    /// `tables[b][p / block_size] · block_size + p % block_size`).
    pub tables: Vec<Vec<usize>>,
    /// Per batch row: the position of its first new query (positions stored before the call).
    pub starts: Vec<usize>,
    /// Per batch row: positions stored once the call's new keys are written.
    pub totals: Vec<usize>,
    /// New queries per batch row in the call's tensors (right padding included).
    pub queries: usize,
    /// The model's sliding window, if any.
    pub window: Option<usize>,
}

impl PagedLayout {
    /// Batch rows of the call.
    pub fn batch(&self) -> usize {
        self.tables.len()
    }

    /// Key positions of the padded view: the longest row's.
    pub fn keys(&self) -> usize {
        self.totals.iter().copied().max().unwrap_or(0).max(1)
    }

    /// The pool row of position `pos` of batch row `b`.
    pub fn slot(&self, b: usize, pos: usize) -> usize {
        self.tables[b][pos / self.block_size] * self.block_size + pos % self.block_size
    }

    /// The keys query `i` of batch row `b` sees (empty for a padding query that a window leaves
    /// without keys).
    pub fn visible(&self, b: usize, i: usize) -> Range<usize> {
        let pos = self.starts[b] + i;
        let hi = self.totals[b].min(pos + 1);
        let lo = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        lo..hi.max(lo)
    }

    /// Whether the layout fits a pool of `pool_rows` rows: every block of every table inside it,
    /// and every row's blocks enough for its positions.
    pub fn fits(&self, pool_rows: usize) -> bool {
        let bs = self.block_size;
        bs > 0
            && self.starts.len() == self.batch()
            && self.totals.len() == self.batch()
            && self.tables.iter().zip(&self.totals).all(|(table, &total)| {
                table.len().saturating_mul(bs) >= total && table.iter().all(|&blk| blk < pool_rows / bs)
            })
    }

    /// The pool rows of the padded view, `[B·S]` (a padding key reads row 0; it is hidden).
    pub fn read_rows(&self) -> Vec<i64> {
        let s = self.keys();
        let mut read = Vec::with_capacity(self.batch() * s);
        for (b, &total) in self.totals.iter().enumerate() {
            read.extend((0..s).map(|j| if j < total { self.slot(b, j) as i64 } else { 0 }));
        }
        read
    }

    /// The mask of the padded view, `[B, 1, T, S]` row-major, true where hidden; `None` when
    /// nothing is (one query per row, rows of equal length, no window cutting in).
    pub fn hidden(&self) -> Option<Vec<bool>> {
        let (s, t) = (self.keys(), self.queries);
        let all_see_all = (0..self.batch()).all(|b| (0..t).all(|i| self.visible(b, i) == (0..s)));
        if all_see_all {
            return None;
        }
        let mut hidden = Vec::with_capacity(self.batch() * t * s);
        for b in 0..self.batch() {
            for i in 0..t {
                let seen = self.visible(b, i);
                hidden.extend((0..s).map(|j| !seen.contains(&j)));
            }
        }
        Some(hidden)
    }
}

/// The composition's view of a layout: the pool rows to gather `[B·S]` and the mask `[B, 1, T, S]`.
type GatherView<B> = (Tensor<B, 1, Int>, Option<Tensor<B, 4, Bool>>);

/// A [`PagedLayout`] with the composition's index and mask tensors, made the first time a layer
/// needs them and shared by every layer of the call.
#[derive(Debug, Clone)]
pub struct Paged<B: Backend> {
    pub layout: PagedLayout,
    view: OnceCell<GatherView<B>>,
    device: B::Device,
}

impl<B: Backend> Paged<B> {
    pub fn new(layout: PagedLayout, device: &B::Device) -> Self {
        Self { layout, view: OnceCell::new(), device: device.clone() }
    }

    /// The padded view's pool rows `[B·S]` and mask `[B, 1, T, S]` (true where hidden).
    fn view(&self) -> &GatherView<B> {
        self.view.get_or_init(|| {
            let l = &self.layout;
            let read = l.read_rows();
            let n = read.len();
            let read = Tensor::from_data(TensorData::new(read, [n]), &self.device);
            let shape = [l.batch(), 1, l.queries, l.keys()];
            let hidden = l.hidden().map(|h| Tensor::from_data(TensorData::new(h, shape), &self.device));
            (read, hidden)
        })
    }
}

/// A backend's attention over a paged cache; the default method is the reference.
pub trait PagedAttentionOps: Backend {
    /// Attention of `q` over the keys and values the layout's tables point at, each key/value head
    /// shared by `rep` query heads, the scores made as `scores` says; both products in `cx.dtype`,
    /// the softmax in f32.
    ///
    /// # Shapes
    /// - q: `[B, H, T, Dh]`, keys, values: the pools `[N, K·Dh]` (`K = H / rep`) -> `[B, H, T, Dh]`
    fn paged_attention(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        paged: &Paged<Self>,
        (rep, scores): (usize, Scores),
        cx: Compute,
    ) -> FloatTensor<Self> {
        prim(reference(float(q), float(keys), float(values), paged, (rep, scores), cx.dtype))
    }
}

/// The composition: every row's keys and values gathered into a padded copy, then masked attention
/// with the `rep` query heads of a key/value head as one group of `rep·T` query rows (the keys are
/// never copied `rep` times).
pub fn reference<B: Backend>(
    q: Tensor<B, 4>,
    keys: Tensor<B, 2>,
    values: Tensor<B, 2>,
    paged: &Paged<B>,
    (rep, scores): (usize, Scores),
    compute: DType,
) -> Tensor<B, 4> {
    let [b, h, t, dh] = q.dims();
    let (read, hidden) = paged.view();
    let (k, s) = (h / rep, paged.layout.keys());
    // An f16 pool's rows are widened to the queries' type.
    let dtype = q.dtype();
    let gather = |pool: Tensor<B, 2>| {
        let rows = pool.select(0, read.clone()).reshape([b, s, k, dh]).swap_dims(1, 2);
        if rows.dtype() == dtype {
            rows
        } else {
            rows.cast(dtype)
        }
    };
    grouped_attention(q, gather(keys), gather(values), hidden.clone(), (rep, scores), compute).reshape([b, h, t, dh])
}

/// Masked attention with each key/value head shared by `rep` query heads: the `rep` heads of a
/// group attend as `rep·T` query rows over the group's keys.
///
/// # Shapes
/// - q: `[B, H, T, Dh]`, k: `[B, K, S, Dh]`, v: `[B, K, S, Dv]`, hidden: `[B, 1, T, S]` -> `[B, H, T, Dv]`
pub fn grouped_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    hidden: Option<Tensor<B, 4, Bool>>,
    (rep, scores): (usize, Scores),
    compute: DType,
) -> Tensor<B, 4> {
    let [b, h, t, dh] = q.dims();
    let dv = v.dims()[3];
    if rep == 1 {
        return masked_attention(q, k, v, hidden, compute, scores);
    }
    let q = q.reshape([b, h / rep, rep * t, dh]); // head j = group j / rep, row (j % rep)·T + i
    let hidden = hidden.map(|m| {
        let s = m.dims()[3];
        m.unsqueeze_dim::<5>(2).expand([b, 1, rep, t, s]).reshape([b, 1, rep * t, s])
    });
    masked_attention(q, k, v, hidden, compute, scores).reshape([b, h, t, dv])
}

/// Attention of `q` over a latent cache (multi-head latent attention, decoded with its key and value
/// up-projections absorbed): each pool row is one position's latent, `[c | k_rope]`, the one key
/// every head reads; the values are its first `value_width` numbers, `c`. Gathered through the
/// layout's tables and masked as [`reference`] does.
///
/// # Shapes
/// - q: `[B, H, T, W]`, pool: `[N, W]` -> `[B, H, T, value_width]`
pub fn latent_attention<B: Backend>(
    q: Tensor<B, 4>,
    pool: Tensor<B, 2>,
    value_width: usize,
    paged: &Paged<B>,
    scores: Scores,
    compute: DType,
) -> Tensor<B, 4> {
    let [b, h, _, w] = q.dims();
    let (read, hidden) = paged.view();
    let s = paged.layout.keys();
    let keys = pool.select(0, read.clone()).reshape([b, 1, s, w]);
    let values = keys.clone().narrow(3, 0, value_width);
    grouped_attention(q, keys, values, hidden.clone(), (h, scores), compute)
}

impl PagedAttentionOps for Flex {
    fn paged_attention(
        q: FlexTensor,
        keys: FlexTensor,
        values: FlexTensor,
        paged: &Paged<Self>,
        (rep, scores): (usize, Scores),
        cx: Compute,
    ) -> FlexTensor {
        let (qs, ks, vs) = (flex::shape(&q), flex::shape(&keys), flex::shape(&values));
        let l = &paged.layout;
        // f16 pools are read in place: contiguous (a cache's pools always are).
        let f16_pools = keys.as_slice::<f16>().is_some() && values.as_slice::<f16>().is_some();
        let fits = cx.fused::<Self>(cx.dtype)
            && scores.softcap.is_none()
            && flex::all_f32(&[&q])
            && (flex::all_f32(&[&keys, &values]) || f16_pools)
            && qs.len() == 4
            && ks.len() == 2
            && ks == vs
            && rep > 0
            && qs[1] > 0
            && qs[3] > 0
            && qs[1] % rep == 0
            && qs[0] == l.batch()
            && qs[2] == l.queries
            && ks[1] == qs[1] / rep * qs[3]
            && l.fits(ks[0]);
        if !fits {
            return prim(reference(float(q), float(keys), float(values), paged, (rep, scores), cx.dtype));
        }
        let heads = Heads { heads: qs[1], kv_heads: qs[1] / rep, head_dim: qs[3], scale: scores.scale as f32 };
        let q = flex::f32s(&q);
        let o = match (keys.as_slice::<f16>(), values.as_slice::<f16>()) {
            (Some(k), Some(v)) => attend(cx.elementwise_cpu(), &q, Pool::F16(k), Pool::F16(v), l, heads, true),
            _ => {
                let (keys, values) = (flex::f32s(&keys), flex::f32s(&values));
                attend(cx.elementwise_cpu(), &q, Pool::F32(&keys), Pool::F32(&values), l, heads, true)
            }
        };
        // `[B, T, H, Dh]` seen as `[B, H, T, Dh]`: the caller's swap back to the positions' order
        // then costs no copy.
        flex::tensor(o, vec![qs[0], qs[2], qs[1], qs[3]]).transpose(1, 2)
    }
}

impl<B: PagedAttentionOps, C: CheckpointStrategy> PagedAttentionOps for Autodiff<B, C> {}

/// Head counts of an attention: `heads` query heads, `kv_heads` key/value heads, `head_dim` each.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// What `q·k` is multiplied by (`1/sqrt(head_dim)` unless the model says otherwise).
    pub scale: f32,
}

/// Query rows one task carries at most (heads times positions: a decode step's heads fit).
const ROWS_PER_TASK: usize = 16;

/// The kernel: attention of `q` `[B, H, T, Dh]` over the pools `[N, K·Dh]` through the layout's
/// tables, `[B, H, T, Dh]` out; a row that sees no key comes out zero.
///
/// Tasks: (batch row, up to [`ROWS_PER_TASK`] of its query rows, all heads' rows together so that a
/// decode step reads each pool row whole, once). Every block of a sequence is its own share (flash
/// decoding's split, at fixed places): its partial maxima, sums and outputs are merged in block
/// order after. So a row's numbers depend only on its own query and keys — never on the other rows
/// of the batch, nor on where its prompt's chunks began (a block a row cannot see merges as an exact
/// no-op): a seeded request gets the same bits alone or beside others. How the shares are spread
/// over tasks is only a matter of speed: with few groups, a group's blocks are split into up to two
/// runs a thread; with groups enough to keep the threads busy, one task computes all of a group's.
/// Then, on AVX-512, blocks that several sequences' tables share (a common prompt's, held once by
/// the cache's prefix sharing) are folded first for all their rows at once, sixteen rows of a
/// key/value head to a vector, and each group goes on from there over its own blocks (cascade
/// attention: a shared prompt's keys and values are read once a step, not once a sequence).
///
/// The copy of the loops that runs is the widest `cpu` allows (the CPU's widest at most).
///
/// # Panics
/// If the slices or the layout do not match the shapes (the op checks them first).
pub fn attention(cpu: Cpu, q: &[f32], keys: &[f32], values: &[f32], layout: &PagedLayout, s: Heads) -> Vec<f32> {
    attend(cpu, q, Pool::F32(keys), Pool::F32(values), layout, s, false)
}

/// [`attention`] over pools of either type.
pub fn attention_on(cpu: Cpu, q: &[f32], keys: Pool<'_>, values: Pool<'_>, layout: &PagedLayout, s: Heads) -> Vec<f32> {
    attend(cpu, q, keys, values, layout, s, false)
}

/// A layer's key or value pool as the kernel reads it: f32, or f16 (half the bytes a step reads
/// and the cache holds). A task widens an f16 block's rows to f32 as it reaches them (the heads it
/// reads, the positions its rows see) and computes on them as on an f32 pool: an f16 pool gives
/// the bits of an f32 pool holding the same values.
#[derive(Debug, Clone, Copy)]
pub enum Pool<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl Pool<'_> {
    fn len(&self) -> usize {
        match self {
            Pool::F32(p) => p.len(),
            Pool::F16(p) => p.len(),
        }
    }

    /// Element `i`'s address and the bytes an element takes (for prefetching).
    fn byte_at(&self, i: usize) -> (*const i8, usize) {
        match self {
            Pool::F32(p) => (p.as_ptr().wrapping_add(i).cast(), 4),
            Pool::F16(p) => (p.as_ptr().wrapping_add(i).cast(), 2),
        }
    }
}

/// [`attention`], its output `[B, T, H, Dh]` where `positions_outer` (the layout the output
/// projection reads), `[B, H, T, Dh]` otherwise.
fn attend<'a>(
    cpu: Cpu,
    q: &'a [f32],
    keys: Pool<'a>,
    values: Pool<'a>,
    layout: &'a PagedLayout,
    s: Heads,
    positions_outer: bool,
) -> Vec<f32> {
    let (b, t, dh) = (layout.batch(), layout.queries, s.head_dim);
    assert!(s.kv_heads > 0 && dh > 0 && s.heads.is_multiple_of(s.kv_heads), "paged attention: head counts {s:?}");
    let rep = s.heads / s.kv_heads;
    assert!(q.len() == b * s.heads * t * dh && keys.len() == values.len(), "paged attention: shapes");
    assert!(layout.fits(keys.len() / (s.kv_heads * dh).max(1)), "paged attention: tables outside the pool");
    if let (Pool::F16(k), Pool::F16(v), true) = (keys, values, t > 1) {
        // A prompt's chunk: many tasks read each block, so the blocks are widened once for all of
        // them (the same values, so the same bits as widening them task by task).
        let (compact, k, v) = widened_blocks(layout, (k, v), s.kv_heads * dh);
        return attend(cpu, q, Pool::F32(&k), Pool::F32(&v), &compact, s, positions_outer);
    }
    // A batch row's queries, `H · T` of them (head-major): row r is head r / T at position r % T,
    // and reads key/value head r / T / rep.
    let rows = s.heads * t;
    let row_at = |bi: usize, r: usize| (bi * rows + r) * dh;
    let groups: Vec<(usize, usize)> =
        (0..b).flat_map(|bi| (0..rows).step_by(ROWS_PER_TASK).map(move |r0| (bi, r0))).collect();
    let want = 2 * rayon::current_num_threads();
    let blocks_of = |bi: usize| layout.totals[bi].div_ceil(layout.block_size).max(1);
    let runs = if groups.len() >= want { 1 } else { want };
    let tasks: Vec<(usize, Range<usize>)> = groups
        .iter()
        .enumerate()
        .flat_map(|(n, &(bi, _))| {
            let blocks = blocks_of(bi);
            let k = runs.min(blocks);
            (0..k).map(move |i| (n, blocks * i / k..blocks * (i + 1) / k))
        })
        .collect();
    let scale = s.scale;
    // With a task a group, the task folds its blocks' partials in block order itself (the same
    // arithmetic as the fold below, without a partial a block kept); otherwise each task returns
    // one partial per block of its run, in block order.
    let folded = runs == 1;
    // The AVX-512 kernel holds a task's query rows as the lanes of a vector, positions as i32.
    #[cfg(target_arch = "x86_64")]
    let lanes_kernel = simd::detected().min(cpu.tier) == Tier::Avx512 && layout.keys() <= i32::MAX as usize;
    #[cfg(not(target_arch = "x86_64"))]
    let lanes_kernel = false;
    let query = |bi: usize, r: usize| Query {
        q: &q[row_at(bi, r)..][..dh],
        seen: layout.visible(bi, r % t),
        offset: r / t / rep * dh,
    };
    let task = |rows: Vec<Query<'a>>, table: &'a [usize]| Task {
        lanes: if lanes_kernel { lane_groups(&rows, dh) } else { Vec::new() },
        rows,
        keys,
        values,
        table,
        blocks: 0..0,
        block_size: layout.block_size,
        width: s.kv_heads * dh,
        scale,
    };
    // Blocks that several sequences share (a common prompt's) first, read once for all their rows
    // (cascade attention); each group's fold then goes on from there over its own blocks. The lanes
    // kernel folds a row's blocks in block order whatever rows share its vector, so the bits are
    // the same as without.
    let cascades = if folded && lanes_kernel { shared_prefixes(layout, blocks_of) } else { Vec::new() };
    // Per task: the rows' state after the shared blocks (tasks are the groups, in order, when folded).
    let mut seeds: Vec<Option<Partial>> = (0..tasks.len()).map(|_| None).collect();
    // Per batch row: the blocks its cascade folded (the fold goes on after them).
    let mut skip = vec![0; b];
    for shared in &cascades {
        shared.members.iter().for_each(|&bi| skip[bi] = shared.blocks);
    }
    let cascade_tasks: Vec<(usize, Vec<(usize, usize)>)> = cascades
        .iter()
        .enumerate()
        .flat_map(|(c, shared)| {
            (0..s.kv_heads).flat_map(move |head| {
                let rows: Vec<(usize, usize)> = shared
                    .members
                    .iter()
                    .flat_map(|&bi| (0..rows).filter(move |r| r / t / rep == head).map(move |r| (bi, r)))
                    .collect();
                rows.chunks(LANES).map(|chunk| (c, chunk.to_vec())).collect::<Vec<_>>()
            })
        })
        .collect();
    let cascaded: Vec<Partial> = cascade_tasks
        .par_iter()
        .map(|(c, members)| {
            let shared = &cascades[*c];
            let mut task =
                task(members.iter().map(|&(bi, r)| query(bi, r)).collect(), &layout.tables[shared.members[0]]);
            task.blocks = 0..shared.blocks;
            let mut part = Partial::empty(members.len(), dh);
            task.run(cpu, &mut part, &mut Scratch::default());
            part
        })
        .collect();
    let groups_per_row = rows.div_ceil(ROWS_PER_TASK);
    for ((_, members), part) in cascade_tasks.iter().zip(&cascaded) {
        for (i, &(bi, r)) in members.iter().enumerate() {
            let n = bi * groups_per_row + r / ROWS_PER_TASK;
            let (r0, r1) = (groups[n].1, (groups[n].1 + ROWS_PER_TASK).min(rows));
            let seed = seeds[n].get_or_insert_with(|| Partial::empty(r1 - r0, dh));
            seed.copy_row(r - r0, part, i, dh);
        }
    }
    let partials: Vec<Vec<Partial>> = tasks
        .into_par_iter()
        .zip(seeds)
        .map(|((n, run), seed)| {
            let (bi, r0) = groups[n];
            let r1 = (r0 + ROWS_PER_TASK).min(rows);
            let mut task = task((r0..r1).map(|r| query(bi, r)).collect(), &layout.tables[bi]);
            let run = run.start.max(skip[bi])..run.end;
            let n_rows = task.rows.len();
            let mut scratch = Scratch::default();
            if !folded {
                return run
                    .clone()
                    .map(|blk| {
                        task.blocks = blk..blk + 1;
                        let mut part = Partial::empty(n_rows, dh);
                        task.run(cpu, &mut part, &mut scratch);
                        part
                    })
                    .collect();
            }
            if !task.lanes.is_empty() {
                // The lanes kernel merges each block into its rows itself, as the fold would.
                let mut whole = seed.unwrap_or_else(|| Partial::empty(n_rows, dh));
                task.blocks = run.clone();
                task.run(cpu, &mut whole, &mut scratch);
                return vec![whole];
            }
            let (mut whole, mut block) = (Partial::empty(n_rows, dh), Partial::empty(n_rows, dh));
            for blk in run.clone() {
                task.blocks = blk..blk + 1;
                block.clear();
                task.run(cpu, &mut block, &mut scratch);
                if blk == run.start {
                    std::mem::swap(&mut whole, &mut block);
                } else {
                    whole.merge(&block, dh);
                }
            }
            vec![whole]
        })
        .collect();
    let mut partials = partials.into_iter().flatten();
    let mut o = vec![0.0f32; q.len()];
    for &(bi, r0) in &groups {
        let mut whole = partials.next().unwrap_or_default();
        let shares = if folded { 1 } else { blocks_of(bi) };
        for share in partials.by_ref().take(shares - 1) {
            whole.merge(&share, dh);
        }
        for (r, row) in (r0..).zip(whole.normalised(dh).chunks_exact(dh.max(1))) {
            let at = if positions_outer { ((bi * t + r % t) * s.heads + r / t) * dh } else { row_at(bi, r) };
            o[at..][..dh].copy_from_slice(row);
        }
    }
    o
}

/// The blocks the layout's tables list, widened from f16 pools (rows `w` values wide) into f32
/// pools of those blocks alone, and the layout with its tables numbered into them.
fn widened_blocks(
    layout: &PagedLayout,
    (keys, values): (&[f16], &[f16]),
    w: usize,
) -> (PagedLayout, Vec<f32>, Vec<f32>) {
    let bs = layout.block_size;
    let mut order: Vec<usize> = Vec::new();
    let mut compact = layout.clone();
    let mut renumbered = std::collections::HashMap::new();
    for table in &mut compact.tables {
        for blk in table.iter_mut() {
            *blk = *renumbered.entry(*blk).or_insert_with(|| {
                order.push(*blk);
                order.len() - 1
            });
        }
    }
    let widen = |pool: &[f16]| {
        let mut out = vec![0f32; order.len() * bs * w];
        for (dst, &blk) in out.chunks_exact_mut(bs * w).zip(&order) {
            pool[blk * bs * w..(blk + 1) * bs * w].convert_to_f32_slice(dst);
        }
        out
    };
    let (k, v) = (widen(keys), widen(values));
    (compact, k, v)
}

/// Sequences whose tables begin with the same blocks, and how many of their blocks they share.
struct SharedPrefix {
    members: Vec<usize>,
    blocks: usize,
}

/// The batch rows grouped by their first block, each group of two or more with the blocks all its
/// rows have in common (at most the blocks each reads: `blocks_of`).
fn shared_prefixes(layout: &PagedLayout, blocks_of: impl Fn(usize) -> usize) -> Vec<SharedPrefix> {
    let mut by_first: Vec<(usize, Vec<usize>)> = Vec::new();
    for (bi, table) in layout.tables.iter().enumerate() {
        let Some(&first) = table.first() else { continue };
        match by_first.iter_mut().find(|(blk, _)| *blk == first) {
            Some((_, members)) => members.push(bi),
            None => by_first.push((first, vec![bi])),
        }
    }
    by_first
        .into_iter()
        .filter(|(_, members)| members.len() > 1)
        .map(|(_, members)| {
            let lead = &layout.tables[members[0]];
            let blocks = members
                .iter()
                .map(|&bi| {
                    let table = &layout.tables[bi];
                    let common = lead.iter().zip(table).take_while(|(x, y)| x == y).count();
                    common.min(blocks_of(bi))
                })
                .min()
                .unwrap_or(0);
            SharedPrefix { members, blocks }
        })
        .filter(|shared| shared.blocks > 0)
        .collect()
}

/// A task's rows before normalising: each row's running maximum score, its sum of `e^(score -
/// max)`, and its values weighted by those terms.
#[derive(Debug, Default)]
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
    /// `rows` rows that have seen no key yet.
    fn empty(rows: usize, dh: usize) -> Self {
        Self { max: vec![f32::NEG_INFINITY; rows], sum: vec![0.0; rows], acc: vec![0.0; rows * dh] }
    }

    /// Back to [`Self::empty`]'s state, keeping the buffers.
    fn clear(&mut self) {
        self.max.fill(f32::NEG_INFINITY);
        self.sum.fill(0.0);
        self.acc.fill(0.0);
    }

    /// Row `r` set to row `i` of `other`.
    fn copy_row(&mut self, r: usize, other: &Partial, i: usize, dh: usize) {
        (self.max[r], self.sum[r]) = (other.max[i], other.sum[i]);
        self.acc[r * dh..(r + 1) * dh].copy_from_slice(&other.acc[i * dh..(i + 1) * dh]);
    }

    /// Adds another share of the same rows' keys.
    fn merge(&mut self, other: &Partial, dh: usize) {
        for r in 0..self.max.len() {
            let max = self.max[r].max(other.max[r]);
            if max == f32::NEG_INFINITY {
                continue; // neither share saw a key
            }
            let (a, b) = (exp(self.max[r] - max), exp(other.max[r] - max));
            self.sum[r] = self.sum[r] * a + other.sum[r] * b;
            let (mine, theirs) = (&mut self.acc[r * dh..(r + 1) * dh], &other.acc[r * dh..(r + 1) * dh]);
            mine.iter_mut().zip(theirs).for_each(|(x, &y)| *x = *x * a + y * b);
            self.max[r] = max;
        }
    }

    /// The attention outputs, `rows × Dh` (zero where a row saw no key).
    fn normalised(mut self, dh: usize) -> Vec<f32> {
        for (out, &total) in self.acc.chunks_exact_mut(dh.max(1)).zip(&self.sum) {
            if total > 0.0 {
                let inv = 1.0 / total;
                out.iter_mut().for_each(|x| *x *= inv);
            }
        }
        self.acc
    }
}

/// One query row: its values, the keys it sees, and its key/value head's first column in a pool row.
struct Query<'a> {
    q: &'a [f32],
    seen: Range<usize>,
    offset: usize,
}

/// One task's query rows of one sequence, in some of the sequence's blocks. The rows of all heads
/// go together, so that a block's pool rows are read whole, in address order.
struct Task<'a> {
    rows: Vec<Query<'a>>,
    /// The rows as vector lanes, a group per key/value head ([`lane_groups`]), for the AVX-512
    /// kernel; empty for the others.
    lanes: Vec<LaneGroup>,
    keys: Pool<'a>,
    values: Pool<'a>,
    table: &'a [usize],
    /// The blocks of the table this task reads.
    blocks: Range<usize>,
    block_size: usize,
    /// Pool row width (`K·Dh`).
    width: usize,
    scale: f32,
}

/// A task's working buffers, kept from block to block: its scores, and the block's rows of f16
/// pools widened.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl Task<'_> {
    /// Block `blk`'s keys and values as f32 rows `K·Dh` apart, the block's first position first: in
    /// the pools for f32 pools; for f16 pools the positions before `end` widened into the scratch,
    /// the heads at `offsets` only (the other columns are not read). The pointers hold until the
    /// scratch's buffers change.
    fn block_rows(
        &self,
        blk: usize,
        (end, offsets, dh): (usize, &[usize], usize),
        scratch: &mut Scratch,
    ) -> (*const f32, *const f32) {
        let (bs, w) = (self.block_size, self.width);
        let (base, rows) = (self.table[blk] * bs * w, bs.min(end.saturating_sub(blk * bs)));
        let widen = |pool: Pool<'_>, buf: &mut Vec<f32>| match pool {
            Pool::F32(p) => p.as_ptr().wrapping_add(base),
            Pool::F16(p) => {
                buf.resize(bs * w, 0.0);
                for r in 0..rows {
                    for &offset in offsets {
                        let at = r * w + offset;
                        p[base + at..][..dh].convert_to_f32_slice(&mut buf[at..][..dh]);
                    }
                }
                buf.as_ptr()
            }
        };
        (widen(self.keys, &mut scratch.keys), widen(self.values, &mut scratch.values))
    }

    /// What the task reads of a block: its rows' heads (their first columns, ascending), a head's
    /// width, and one past the last position any of its rows sees.
    fn reach(&self) -> (Vec<usize>, usize, usize) {
        let mut heads: Vec<usize> = self.rows.iter().map(|r| r.offset).collect();
        heads.sort_unstable();
        heads.dedup();
        let dh = self.rows.first().map_or(0, |row| row.q.len());
        (heads, dh, self.rows.iter().map(|r| r.seen.end).max().unwrap_or(0))
    }

    /// The task's rows over its blocks, added to `part`.
    fn run(&self, cpu: Cpu, part: &mut Partial, scratch: &mut Scratch) {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = cpu;
        #[cfg(target_arch = "x86_64")]
        match simd::detected().min(cpu.tier) {
            // SAFETY (all): `detected()` found the features these copies are compiled for.
            Tier::Avx512 if !self.lanes.is_empty() => return unsafe { self.run_lanes(part, scratch) },
            Tier::Avx512 => return unsafe { self.run_avx512(part, scratch) },
            Tier::Avx2 => return unsafe { self.run_avx2(part, scratch) },
            Tier::Baseline => {}
        }
        // SAFETY: the portable compilation needs no CPU feature.
        unsafe { self.run_with::<false>(part, scratch) }
    }

    /// The portable loops compiled with AVX2 and FMA: eight lanes where the CPU has no AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, part: &mut Partial, scratch: &mut Scratch) {
        // SAFETY: the portable loops need no CPU feature.
        unsafe { self.run_with::<false>(part, scratch) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn run_avx512(&self, part: &mut Partial, scratch: &mut Scratch) {
        // SAFETY: this function's features are the ones `AVX512` asks for.
        unsafe { self.run_with::<true>(part, scratch) }
    }

    /// The online softmax over the task's blocks; `AVX512`: the dot products and weighted sums use
    /// AVX-512 and FMA explicitly.
    ///
    /// # Safety
    /// With `AVX512`, the CPU must have AVX-512F and FMA.
    #[inline(always)]
    unsafe fn run_with<const AVX512: bool>(&self, part: &mut Partial, scratch: &mut Scratch) {
        let (bs, w) = (self.block_size, self.width);
        let (heads, dh, end) = self.reach();
        let mut scores = std::mem::take(&mut scratch.scores);
        scores.resize(bs, 0.0);
        for blk in self.blocks.clone() {
            let c0 = blk * bs;
            let (keys, values) = self.block_rows(blk, (end, &heads, dh), scratch);
            for (r, Query { q, seen, offset }) in self.rows.iter().enumerate() {
                let (a, e) = (seen.start.max(c0), seen.end.min(c0 + bs));
                if a >= e {
                    continue;
                }
                let row_of = |j: usize| (j - c0) * w + offset;
                // SAFETY: `block_rows` gives the block's rows, every position a row sees in it,
                // `w` apart: in the pool, or in the scratch (bs·w values).
                let rows_from = |pool: *const f32, j: usize, len: usize| unsafe {
                    std::slice::from_raw_parts(pool.add(row_of(j)), len)
                };
                let sc = &mut scores[..e - a];
                for (j, out) in (a..e).zip(sc.iter_mut()) {
                    // SAFETY: as this function's.
                    *out = unsafe { dot::<AVX512>(q, rows_from(keys, j, dh)) } * self.scale;
                }
                let old = part.max[r];
                let max = lanes_max(sc).max(old);
                let out = &mut part.acc[r * dh..(r + 1) * dh];
                if max > old && old > f32::NEG_INFINITY {
                    let factor = exp(old - max);
                    part.sum[r] *= factor;
                    out.iter_mut().for_each(|x| *x *= factor);
                }
                part.max[r] = max;
                sc.iter_mut().for_each(|p| *p = exp(*p - max));
                part.sum[r] += lanes_sum(sc);
                // The block's value rows are `w` apart: the last one ends at row_of(e - 1) + dh.
                let rows = rows_from(values, a, row_of(e - 1) + dh - row_of(a));
                // SAFETY: as this function's.
                unsafe { weighted_sum::<AVX512>(out, sc, rows, w) };
            }
        }
        scratch.scores = scores;
    }
}

/// Vector lanes of the AVX-512 kernel: that many query rows of a group side by side.
const LANES: usize = 16;

/// Query rows of one task that read the same key/value head, as the lanes of one vector
/// (the AVX-512 kernel's layout): their queries transposed and the keys each sees.
struct LaneGroup {
    /// The task row in each lane.
    rows: Vec<usize>,
    /// The key/value head's first column in a pool row.
    offset: usize,
    /// `qt[d·LANES + l]`: value `d` of lane `l`'s query (zero in lanes past `rows`).
    qt: Vec<f32>,
    /// Per lane, the keys it sees, `lo[l]..hi[l]` (empty in lanes past `rows`).
    lo: [i32; LANES],
    hi: [i32; LANES],
}

/// The task's rows grouped by key/value head, in row order, [`LANES`] rows a group at most.
/// Positions must fit an `i32`.
fn lane_groups(rows: &[Query], dh: usize) -> Vec<LaneGroup> {
    let mut groups: Vec<LaneGroup> = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        let at = match groups.iter().position(|g| g.offset == row.offset && g.rows.len() < LANES) {
            Some(at) => at,
            None => {
                let qt = vec![0.0; dh * LANES];
                groups.push(LaneGroup { rows: Vec::new(), offset: row.offset, qt, lo: [0; LANES], hi: [0; LANES] });
                groups.len() - 1
            }
        };
        let g = &mut groups[at];
        let l = g.rows.len();
        for (d, &x) in row.q.iter().enumerate() {
            g.qt[d * LANES + l] = x;
        }
        (g.lo[l], g.hi[l]) = (row.seen.start as i32, row.seen.end as i32);
        g.rows.push(r);
    }
    groups
}

/// `K` keys' scores against a group's lanes: lane `l` of score `i` is `Σ_d qt[d·LANES + l] ·
/// keys[i][d]`, one fused multiply-add after another in `d` order (so the same bits whatever the
/// vector it is a lane of); `K` chains side by side, so that they do not wait on each other.
///
/// # Safety
/// The CPU must have AVX-512F and FMA; `qt` must hold `dh·LANES` values and each key `dh`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn lane_scores<const K: usize>(
    qt: *const f32,
    keys: [*const f32; K],
    dh: usize,
) -> [std::arch::x86_64::__m512; K] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); K];
    for d in 0..dh {
        // SAFETY: in bounds by the caller's promise.
        let qd = unsafe { _mm512_loadu_ps(qt.add(d * LANES)) };
        for (sum, key) in acc.iter_mut().zip(&keys) {
            // SAFETY: as above.
            *sum = _mm512_fmadd_ps(qd, _mm512_set1_ps(unsafe { *key.add(d) }), *sum);
        }
    }
    acc
}

/// [`lane_scores`] computed in as few lanes as the group uses (`width`: 4, 8 or [`LANES`]), the
/// lanes past them zero. A lane's chain of multiply-adds is the same whatever the vector's width,
/// so its bits are too; a decode step's three or four rows of a key/value head cost a quarter of a
/// 16-lane vector's multiply-adds.
///
/// # Safety
/// As [`lane_scores`]'s.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512vl,fma")]
unsafe fn narrow_lane_scores<const K: usize>(
    width: usize,
    qt: *const f32,
    keys: [*const f32; K],
    dh: usize,
) -> [std::arch::x86_64::__m512; K] {
    use std::arch::x86_64::*;
    match width {
        4 => {
            let mut acc = [_mm_setzero_ps(); K];
            for d in 0..dh {
                // SAFETY: in bounds by the caller's promise.
                let qd = unsafe { _mm_loadu_ps(qt.add(d * LANES)) };
                for (sum, key) in acc.iter_mut().zip(&keys) {
                    // SAFETY: as above.
                    *sum = _mm_fmadd_ps(qd, _mm_set1_ps(unsafe { *key.add(d) }), *sum);
                }
            }
            acc.map(|x| _mm512_zextps128_ps512(x))
        }
        8 => {
            let mut acc = [_mm256_setzero_ps(); K];
            for d in 0..dh {
                // SAFETY: in bounds by the caller's promise.
                let qd = unsafe { _mm256_loadu_ps(qt.add(d * LANES)) };
                for (sum, key) in acc.iter_mut().zip(&keys) {
                    // SAFETY: as above.
                    *sum = _mm256_fmadd_ps(qd, _mm256_set1_ps(unsafe { *key.add(d) }), *sum);
                }
            }
            acc.map(|x| _mm512_zextps256_ps512(x))
        }
        // SAFETY: as this function's.
        _ => unsafe { lane_scores::<K>(qt, keys, dh) },
    }
}

/// `e^(t[l] − max[l])` in the first `W` lanes of `t` (the others left as they are).
#[inline(always)]
fn exp_lanes<const W: usize>(t: &mut [f32; LANES], max: &[f32; LANES]) {
    for (x, &m) in t[..W].iter_mut().zip(&max[..W]) {
        *x = exp(*x - m);
    }
}

impl Task<'_> {
    /// Prefetches (into L2) block `blk`'s key and value columns (`dh` wide) of the heads at
    /// `offsets`, for the positions before `end` (one past the last any of the task's rows sees).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn prefetch(&self, blk: usize, offsets: &[usize], dh: usize, end: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (bs, w) = (self.block_size, self.width);
        let (base, rows) = (self.table[blk] * bs, bs.min(end.saturating_sub(blk * bs)));
        for pool in [self.keys, self.values] {
            for row in base..base + rows {
                for &offset in offsets {
                    // A prefetch reads nothing and cannot fault: an address is all it needs.
                    let (at, size) = pool.byte_at(row * w + offset);
                    for line in (0..dh * size).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(line));
                    }
                }
            }
        }
    }

    /// The AVX-512 kernel: the rows of a [`LaneGroup`] as the lanes of a vector, so that a block's
    /// keys and values are read once for all of them and nothing is summed across lanes. A row's
    /// arithmetic is its own, whatever rows share its vector: each score a chain of multiply-adds
    /// in `d` order ([`lane_scores`]) times the scale; the block's maximum over the keys the row
    /// sees; `e^(score − max)` per key ([`exp`]); the block's sum and its weighted values added key
    /// after key. A padding row (no key seen) stays as it was. Per block and group: the scores
    /// ([`Self::lane_scores_into`]), the weights ([`lane_weights`]), the rows' running maxima and
    /// sums ([`merge_block_stats`]), the weighted values ([`Self::add_lane_values`]).
    ///
    /// # Safety
    /// The CPU must have AVX-512F, VL and FMA; the lanes' rows and ranges must be the task's.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,fma")]
    unsafe fn run_lanes(&self, part: &mut Partial, buffers: &mut Scratch) {
        let bs = self.block_size;
        let (heads, dh, end) = self.reach();
        let narrow = self.lanes.iter().any(|g| g.rows.len() < LANES);
        for blk in self.blocks.clone() {
            let c0 = blk * bs;
            // The next block's rows of the task's heads asked for while this one is computed (and
            // the first block's before it): the hardware's prefetchers do not follow a walk of
            // one head's slices through the table's blocks. Only where a group is narrow (a
            // decode step's few rows, little arithmetic a byte); full groups (a prompt's) are
            // busy enough for the reads to keep up without.
            if narrow && blk == self.blocks.start {
                self.prefetch(blk, &heads, dh, end);
            }
            if narrow && blk + 1 < self.blocks.end {
                self.prefetch(blk + 1, &heads, dh, end);
            }
            let rows = self.block_rows(blk, (end, &heads, dh), buffers);
            let scratch = &mut buffers.scores;
            for g in &self.lanes {
                let used = g.rows.len();
                let a = g.lo[..used].iter().map(|&x| x as usize).min().unwrap_or(0).max(c0);
                let e = g.hi[..used].iter().map(|&x| x as usize).max().unwrap_or(0).min(c0 + bs);
                if a >= e {
                    continue;
                }
                let n = e - a;
                // The lanes the group's rows take, rounded up to a vector of 4, 8 or 16.
                let width = match used {
                    0..=4 => 4,
                    5..=8 => 8,
                    _ => LANES,
                };
                scratch.resize(n * LANES, 0.0);
                // SAFETY (all three): the features are this function's; the scratch holds n·LANES.
                unsafe {
                    self.lane_scores_into(g, (rows.0, c0), a..e, width, scratch);
                    let (max, sum) = lane_weights(scratch, n, width);
                    let factors = merge_block_stats(part, g, &max, &sum);
                    self.add_lane_values(part, g, (rows.1, c0), a..e, scratch, &max, &factors);
                }
            }
        }
    }

    /// A group's scores against the keys `keys` of a block (scaled; −∞ in the lanes that do not
    /// see a key), key `j`'s at `scratch[(j − keys.start)·LANES..]`, eight keys at a time, then
    /// four, then one. `(rows, c0)`: the block's key rows ([`Self::block_rows`]) and its first
    /// position.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, VL and FMA; `scratch` must hold `keys.len()·LANES` values,
    /// `keys` lie in the block and `rows` hold their rows.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma")]
    unsafe fn lane_scores_into(
        &self,
        g: &LaneGroup,
        (rows, c0): (*const f32, usize),
        keys: Range<usize>,
        width: usize,
        scratch: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        let dh = g.qt.len() / LANES;
        let (w, a) = (self.width, keys.start);
        let (neg_inf, scale) = (_mm512_set1_ps(f32::NEG_INFINITY), _mm512_set1_ps(self.scale));
        let s = scratch.as_mut_ptr();
        // SAFETY: two arrays of LANES i32s.
        let (lo, hi) = unsafe { (_mm512_loadu_si512(g.lo.as_ptr().cast()), _mm512_loadu_si512(g.hi.as_ptr().cast())) };
        let sees = |j: usize| {
            let at = _mm512_set1_epi32(j as i32);
            _mm512_cmpge_epi32_mask(at, lo) & _mm512_cmplt_epi32_mask(at, hi)
        };
        // SAFETY: position j of the block is row j - c0 of `rows`, `w` wide, the head at `offset`.
        let key = |j: usize| unsafe { rows.add((j - c0) * w + g.offset) };
        let keep = |j: usize, score: __m512| {
            let score = _mm512_mask_blend_ps(sees(j), neg_inf, _mm512_mul_ps(score, scale));
            // SAFETY: key j's scores are lanes (j - a)·LANES.. of the scratch, n·LANES long.
            unsafe { _mm512_storeu_ps(s.add((j - a) * LANES), score) };
        };
        let (mut j, e) = (a, keys.end);
        while j + 8 <= e {
            // SAFETY: the group's queries and eight of the block's keys.
            let sc = unsafe { narrow_lane_scores::<8>(width, g.qt.as_ptr(), std::array::from_fn(|i| key(j + i)), dh) };
            sc.into_iter().enumerate().for_each(|(i, x)| keep(j + i, x));
            j += 8;
        }
        while j + 4 <= e {
            // SAFETY: as above, four keys.
            let sc = unsafe { narrow_lane_scores::<4>(width, g.qt.as_ptr(), std::array::from_fn(|i| key(j + i)), dh) };
            sc.into_iter().enumerate().for_each(|(i, x)| keep(j + i, x));
            j += 4;
        }
        while j < e {
            // SAFETY: as above, one key.
            let [x] = unsafe { narrow_lane_scores::<1>(width, g.qt.as_ptr(), [key(j)], dh) };
            keep(j, x);
            j += 1;
        }
    }

    /// The block's weighted values added to the group's rows (the scratch holding the weights,
    /// [`lane_weights`]'), four lanes and 64 columns at a time in registers (each value row read
    /// once for the four), then merged with the factors of [`merge_block_stats`].
    ///
    /// # Safety
    /// As [`Self::lane_scores_into`]'s; `part` must be the task's.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_lane_values(
        &self,
        part: &mut Partial,
        g: &LaneGroup,
        (rows, c0): (*const f32, usize),
        keys: Range<usize>,
        scratch: &[f32],
        max: &[f32; LANES],
        factors: &[(f32, f32); LANES],
    ) {
        use std::arch::x86_64::*;
        let dh = g.qt.len() / LANES;
        let (w, used) = (self.width, g.rows.len());
        let (a, n) = (keys.start, keys.len());
        let s = scratch.as_ptr();
        let mask = |c: usize| -> __mmask16 { ((1u32 << dh.saturating_sub(c).min(16)) - 1) as u16 };
        let out = part.acc.as_mut_ptr();
        for l0 in (0..used).step_by(4) {
            for c in (0..dh).step_by(64) {
                let masks = [mask(c), mask(c + 16), mask(c + 32), mask(c + 48)];
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for i in 0..n {
                    let v = rows.wrapping_add((a + i - c0) * w + g.offset + c);
                    // SAFETY: the unmasked columns of value row a + i are within the pool.
                    let vs: [__m512; 4] =
                        std::array::from_fn(|q| unsafe { _mm512_maskz_loadu_ps(masks[q], v.wrapping_add(16 * q)) });
                    for (t, sums) in acc.iter_mut().enumerate() {
                        // SAFETY: within the scratch (lanes past `used` hold zero).
                        let p = unsafe { *s.add(i * LANES + l0 + t) };
                        if p != 0.0 {
                            let p = _mm512_set1_ps(p);
                            for (sum, &x) in sums.iter_mut().zip(&vs) {
                                *sum = _mm512_fmadd_ps(p, x, *sum);
                            }
                        }
                    }
                }
                for (t, sums) in acc.iter().enumerate() {
                    let l = l0 + t;
                    if l >= used || max[l] == f32::NEG_INFINITY {
                        continue;
                    }
                    let (a, b) = (_mm512_set1_ps(factors[l].0), _mm512_set1_ps(factors[l].1));
                    // Columns past `dh` are masked off: never read or written (their addresses
                    // only computed, with wrapping arithmetic).
                    let o = out.wrapping_add(g.rows[l] * dh + c);
                    for (q, sum) in sums.iter().enumerate() {
                        let at = o.wrapping_add(16 * q);
                        // SAFETY: the row's unmasked columns are within part.acc.
                        let old = unsafe { _mm512_maskz_loadu_ps(masks[q], at) };
                        let merged = _mm512_add_ps(_mm512_mul_ps(old, a), _mm512_mul_ps(*sum, b));
                        // SAFETY: as the load.
                        unsafe { _mm512_mask_storeu_ps(at, masks[q], merged) };
                    }
                }
            }
        }
    }
}

/// A block's softmax terms from its scores in the scratch (`n` keys of [`LANES`] lanes): each
/// lane's maximum over the keys it sees (−∞ where it sees none: its row stays as it was), the
/// weights `e^(score − max)` written over the scores (zero where a lane does not see the key), and
/// each lane's sum of them, added key after key.
///
/// # Safety
/// The CPU must have AVX-512F and VL; the scratch must hold `n·LANES` values.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512vl,fma")]
unsafe fn lane_weights(scratch: &mut [f32], n: usize, width: usize) -> ([f32; LANES], [f32; LANES]) {
    use std::arch::x86_64::*;
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let s = scratch.as_mut_ptr();
    let mut block_max = neg_inf;
    for i in 0..n {
        // SAFETY: within the scratch's n·LANES.
        block_max = _mm512_max_ps(block_max, unsafe { _mm512_loadu_ps(s.add(i * LANES)) });
    }
    let mut max = [f32::NEG_INFINITY; LANES];
    // SAFETY: LANES f32s.
    unsafe { _mm512_storeu_ps(max.as_mut_ptr(), block_max) };
    let mut sums = _mm512_setzero_ps();
    let mut t = [0.0f32; LANES];
    for i in 0..n {
        // SAFETY: within the scratch.
        let score = unsafe { _mm512_loadu_ps(s.add(i * LANES)) };
        // SAFETY: LANES f32s.
        unsafe { _mm512_storeu_ps(t.as_mut_ptr(), score) };
        // Lanes past the group's rows hold -inf scores, zeroed below.
        match width {
            4 => exp_lanes::<4>(&mut t, &max),
            8 => exp_lanes::<8>(&mut t, &max),
            _ => exp_lanes::<LANES>(&mut t, &max),
        }
        // SAFETY: LANES f32s.
        let p = unsafe { _mm512_loadu_ps(t.as_ptr()) };
        let p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(score, neg_inf), p);
        sums = _mm512_add_ps(sums, p);
        // SAFETY: within the scratch.
        unsafe { _mm512_storeu_ps(s.add(i * LANES), p) };
    }
    let mut sum = [0.0f32; LANES];
    // SAFETY: LANES f32s.
    unsafe { _mm512_storeu_ps(sum.as_mut_ptr(), sums) };
    (max, sum)
}

/// A block's maxima and sums merged into the group's rows as [`Partial::merge`] merges a share:
/// the row's old terms times `a`, the block's times `b`; the `(a, b)` of each lane (the values
/// are merged with them), nothing for a lane that saw no key of the block.
fn merge_block_stats(part: &mut Partial, g: &LaneGroup, max: &[f32; LANES], sum: &[f32; LANES]) -> [(f32, f32); LANES] {
    let mut factors = [(0.0f32, 0.0f32); LANES];
    for (l, &r) in g.rows.iter().enumerate() {
        if max[l] == f32::NEG_INFINITY {
            continue;
        }
        let new = part.max[r].max(max[l]);
        let (a, b) = (exp(part.max[r] - new), exp(max[l] - new));
        part.sum[r] = part.sum[r] * a + sum[l] * b;
        (part.max[r], factors[l]) = (new, (a, b));
    }
    factors
}

/// `Σ a·b` (`a`, `b` of one length): 16-lane fused multiply-adds where `AVX512`, else 8
/// independent lanes.
///
/// # Safety
/// With `AVX512`, the CPU must have AVX-512F and FMA.
#[inline(always)]
unsafe fn dot<const AVX512: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX512 {
        assert_eq!(a.len(), b.len());
        // SAFETY: the features are the caller's promise; the lengths were just checked.
        return unsafe { avx512_dot(a, b) };
    }
    lanes_dot(a, b)
}

/// `Σ a·b` over 16-lane vectors, the tail masked.
///
/// # Safety
/// The CPU must have AVX-512F and FMA, and `b` be at least as long as `a`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn avx512_dot(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    // Four independent sums, so that the multiply-adds do not wait on each other.
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (l, sum) in acc.iter_mut().enumerate() {
            *sum = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * l)), _mm512_loadu_ps(pb.add(i + 16 * l)), *sum);
        }
        i += 64;
    }
    while i + 16 <= n {
        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
        i += 16;
    }
    if i < n {
        let mask: __mmask16 = (1u32 << (n - i)) as u16 - 1; // in bounds: i < n < i + 16
        acc[1] =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, pa.add(i)), _mm512_maskz_loadu_ps(mask, pb.add(i)), acc[1]);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
}

/// `out += Σ_j p[j] · rows[j·stride ..][..out.len()]`: 64 columns at a time held in four 16-lane
/// registers across all rows where `AVX512`, plain multiply-adds otherwise.
///
/// # Safety
/// With `AVX512`, the CPU must have AVX-512F and FMA.
#[inline(always)]
unsafe fn weighted_sum<const AVX512: bool>(out: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
    let dh = out.len();
    assert!(p.is_empty() || rows.len() >= (p.len() - 1) * stride + dh, "weighted_sum: rows too short");
    #[cfg(target_arch = "x86_64")]
    if AVX512 {
        // SAFETY: the features are the caller's promise; the rows' extent is checked above.
        unsafe { avx512_weighted_sum(out, p, rows, stride) };
        return;
    }
    for (j, &pj) in p.iter().enumerate() {
        for (y, &x) in out.iter_mut().zip(&rows[j * stride..j * stride + dh]) {
            *y += pj * x;
        }
    }
}

/// [`weighted_sum`] on AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F and FMA; `rows` must hold `(p.len() - 1) · stride + out.len()`
/// elements.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn avx512_weighted_sum(out: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
    use std::arch::x86_64::*;
    let dh = out.len();
    let mask = |c: usize| -> __mmask16 {
        let n = dh.saturating_sub(c).min(16);
        ((1u32 << n) - 1) as u16
    };
    for c0 in (0..dh).step_by(64) {
        let masks = [mask(c0), mask(c0 + 16), mask(c0 + 32), mask(c0 + 48)];
        // Lanes past `dh` are masked off: never read or written, their addresses only computed
        // (with wrapping arithmetic, as they may lie past the slices).
        let o = out.as_mut_ptr().wrapping_add(c0);
        let mut acc = [_mm512_setzero_ps(); 4];
        for (n, a) in acc.iter_mut().enumerate() {
            *a = _mm512_maskz_loadu_ps(masks[n], o.wrapping_add(16 * n));
        }
        // Even and odd rows into separate sums, so that one row's multiply-adds need not wait for
        // the previous row's.
        let mut odd = [_mm512_setzero_ps(); 4];
        let base = rows.as_ptr().wrapping_add(c0);
        let add = |sums: &mut [__m512; 4], pj: f32, j: usize| {
            let (weight, row) = (_mm512_set1_ps(pj), base.wrapping_add(j * stride));
            for (n, a) in sums.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(masks[n], row.wrapping_add(16 * n)), *a);
            }
        };
        let pairs = p.chunks_exact(2);
        let last = pairs.remainder().first().map(|&pj| (p.len() - 1, pj));
        for (n, pair) in pairs.enumerate() {
            add(&mut acc, pair[0], 2 * n);
            add(&mut odd, pair[1], 2 * n + 1);
        }
        if let Some((j, pj)) = last {
            add(&mut acc, pj, j);
        }
        for (n, (a, b)) in acc.iter().zip(&odd).enumerate() {
            _mm512_mask_storeu_ps(o.wrapping_add(16 * n), masks[n], _mm512_add_ps(*a, *b));
        }
    }
}

/// The plain loops, in f64 with a two-pass softmax: what the kernel is tested against.
pub fn attention_reference(q: &[f32], keys: &[f32], values: &[f32], layout: &PagedLayout, s: Heads) -> Vec<f32> {
    let (t, dh, rep, w) = (layout.queries, s.head_dim, s.heads / s.kv_heads, s.kv_heads * s.head_dim);
    let scale = f64::from(s.scale);
    let mut o = vec![0.0f32; q.len()];
    for b in 0..layout.batch() {
        for head in 0..s.heads {
            let off = head / rep * dh;
            for i in 0..t {
                let at = ((b * s.heads + head) * t + i) * dh;
                let qi = &q[at..at + dh];
                let seen = layout.visible(b, i);
                let scores: Vec<f64> = seen
                    .clone()
                    .map(|j| {
                        let k = &keys[layout.slot(b, j) * w + off..][..dh];
                        qi.iter().zip(k).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum::<f64>() * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (j, p) in seen.zip(weights) {
                    let v = &values[layout.slot(b, j) * w + off..][..dh];
                    for (out, &x) in o[at..at + dh].iter_mut().zip(v) {
                        *out += (p / total * f64::from(x)) as f32;
                    }
                }
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{self, Tier};
    use crate::testing::values;
    use burn::tensor::Distribution;

    /// A pool of `blocks` blocks and a layout of rows with the given (start, new) positions, their
    /// blocks taken from the pool in a scrambled order.
    fn layout(
        rows: &[(usize, usize)],
        queries: usize,
        block_size: usize,
        window: Option<usize>,
    ) -> (PagedLayout, usize) {
        let mut next = 0;
        let mut tables = Vec::new();
        for &(start, new) in rows {
            let blocks = (start + new).div_ceil(block_size);
            tables.push(
                (0..blocks)
                    .map(|_| {
                        next += 1;
                        next - 1
                    })
                    .collect::<Vec<_>>(),
            );
        }
        // Scramble: block ids reversed, so that a row's blocks are not in pool order.
        let n = next;
        tables.iter_mut().flatten().for_each(|blk| *blk = n - 1 - *blk);
        let layout = PagedLayout {
            block_size,
            tables,
            starts: rows.iter().map(|r| r.0).collect(),
            totals: rows.iter().map(|r| r.0 + r.1).collect(),
            queries,
            window,
        };
        (layout, n * block_size)
    }

    /// [`layout`]'s, every row's first `shared` blocks the same blocks of the pool (a common
    /// prompt's), the rest its own.
    fn shared_layout(
        shared: usize,
        rows: &[(usize, usize)],
        queries: usize,
        block_size: usize,
        window: Option<usize>,
    ) -> (PagedLayout, usize) {
        let (mut l, own) = layout(rows, queries, block_size, window);
        let first = own / block_size;
        for table in &mut l.tables {
            for (blk, id) in table.iter_mut().zip(first..first + shared) {
                *blk = id;
            }
        }
        (l, (first + shared) * block_size)
    }

    const HEADS: Heads = Heads { heads: 6, kv_heads: 2, head_dim: 20, scale: 0.223_606_8 };

    /// Thread pools of these sizes (blocks are shared out differently on each).
    fn thread_pools(threads: &[usize]) -> Vec<rayon::ThreadPool> {
        let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().expect("a thread pool");
        threads.iter().map(|&n| pool(n)).collect()
    }

    fn cases() -> Vec<(PagedLayout, usize)> {
        vec![
            layout(&[(0, 1)], 1, 4, None),                    // first token
            layout(&[(37, 1)], 1, 8, None),                   // decode, a partial block
            layout(&[(5, 1), (70, 1), (16, 1)], 1, 16, None), // a decode batch of unequal lengths
            layout(&[(0, 9), (12, 3), (3, 5)], 9, 4, None),   // prefill chunks, right padding
            layout(&[(30, 4), (2, 2)], 4, 8, Some(7)),        // a sliding window
            layout(&[(0, 40)], 40, 64, None),                 // a long first chunk
            layout(&[(200, 1)], 1, 8, None),                  // one sequence: blocks split
            layout(&[(300, 2)], 2, 8, Some(20)),              // a window far into a long sequence
            // A decode batch whose sequences share a prompt's three blocks (one reads only two).
            shared_layout(3, &[(30, 1), (25, 1), (40, 1), (10, 1), (33, 1)], 1, 8, None),
            // Prompt chunks after a shared prefix, a window cutting into it.
            shared_layout(2, &[(17, 4), (19, 2), (22, 3)], 4, 8, Some(12)),
        ]
    }

    #[test]
    fn kernel_matches_the_plain_loops() {
        // Head widths below one vector, between one and two, SmolLM2's, and past a group of four
        // vectors; every case on 1, 3 and 7 threads (so that blocks are shared out differently).
        let heads = [
            Heads { heads: 2, kv_heads: 1, head_dim: 8, scale: 0.353_553_4 },
            HEADS,
            Heads { heads: 9, kv_heads: 3, head_dim: 64, scale: 0.125 },
            Heads { heads: 4, kv_heads: 4, head_dim: 80, scale: 0.7 },
        ];
        let pools = thread_pools(&[1, 3, 7]);
        for (s, pool) in heads.into_iter().flat_map(|s| pools.iter().map(move |p| (s, p))) {
            for (case, (l, pool_rows)) in cases().into_iter().enumerate() {
                let w = s.kv_heads * s.head_dim;
                let q = values(l.batch() * s.heads * l.queries * s.head_dim, 1);
                let (k, v) = (values(pool_rows * w, 2), values(pool_rows * w, 3));
                let want = attention_reference(&q, &k, &v, &l, s);
                for cap in Tier::ALL.into_iter().filter(|&t| t <= simd::detected()) {
                    let got = pool.install(|| attention(Cpu::detect().capped(cap), &q, &k, &v, &l, s));
                    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                    assert!(err < 1e-5, "{s:?}, case {case}, {cap:?}: max error {err}");
                }
            }
        }
    }

    /// f16 pools give the bits of f32 pools holding the same (f16) values: on every tier, every
    /// case (shared prefixes, windows, chunks), 1 and 7 threads, two head widths.
    #[test]
    fn f16_pools_give_the_bits_of_f32_pools_of_their_values() {
        let heads = [HEADS, Heads { heads: 9, kv_heads: 3, head_dim: 64, scale: 0.125 }];
        let pools = thread_pools(&[1, 7]);
        for (s, pool) in heads.into_iter().flat_map(|s| pools.iter().map(move |p| (s, p))) {
            for (case, (l, pool_rows)) in cases().into_iter().enumerate() {
                let w = s.kv_heads * s.head_dim;
                let q = values(l.batch() * s.heads * l.queries * s.head_dim, 1);
                let half = |seed| values(pool_rows * w, seed).into_iter().map(f16::from_f32).collect::<Vec<_>>();
                let (k16, v16) = (half(2), half(3));
                let wide = |x: &[f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<_>>();
                let (k32, v32) = (wide(&k16), wide(&v16));
                for cap in Tier::ALL.into_iter().filter(|&t| t <= simd::detected()) {
                    let cpu = Cpu::detect().capped(cap);
                    let want = pool.install(|| attention(cpu, &q, &k32, &v32, &l, s));
                    let got = pool.install(|| attention_on(cpu, &q, Pool::F16(&k16), Pool::F16(&v16), &l, s));
                    assert_eq!(got, want, "{s:?}, case {case}, {cap:?}");
                }
            }
        }
    }

    #[test]
    fn blocks_shared_among_many_threads_merge_to_the_same_result() {
        let (l, pool_rows) = layout(&[(300, 1)], 1, 8, Some(250));
        let w = HEADS.kv_heads * HEADS.head_dim;
        let q = values(HEADS.heads * HEADS.head_dim, 4);
        let (k, v) = (values(pool_rows * w, 5), values(pool_rows * w, 6));
        let want = attention_reference(&q, &k, &v, &l, HEADS);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(7).build().expect("a thread pool");
        let got = pool.install(|| attention(Cpu::detect(), &q, &k, &v, &l, HEADS));
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(err < 1e-5, "max error {err}");
    }

    /// A sequence's output is the same to the bit alone or beside other sequences, whatever the
    /// threads, and a position's whether it comes in a prompt's chunk or alone (the shares are the
    /// blocks, at fixed places).
    #[test]
    fn a_sequence_gets_the_same_bits_alone_or_in_a_batch() {
        let (alone_layout, rows) = layout(&[(300, 1)], 1, 8, None);
        // The same sequence, same blocks, beside two others whose blocks follow in the pool.
        let mut batch_layout = alone_layout.clone();
        let first = rows / 8;
        batch_layout.tables.push((first..first + 6).collect());
        batch_layout.tables.push((first + 6..first + 25).collect());
        batch_layout.starts.extend([40, 150]);
        batch_layout.totals.extend([41, 151]);
        let w = HEADS.kv_heads * HEADS.head_dim;
        let per_row = HEADS.heads * HEADS.head_dim;
        let q = values(3 * per_row, 4);
        let (k, v) = (values((first + 25) * 8 * w, 5), values((first + 25) * 8 * w, 6));
        let run = |threads: usize, q: &[f32], l: &PagedLayout| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| attention(Cpu::detect(), q, &k, &v, l, HEADS))
        };
        let alone = run(2, &q[..per_row], &alone_layout);
        for threads in [1, 2, 7] {
            assert_eq!(alone, run(threads, &q[..per_row], &alone_layout), "{threads} threads, alone");
            assert_eq!(alone, run(threads, &q, &batch_layout)[..per_row].to_vec(), "{threads} threads, in a batch");
        }
        // Position 300 as the last of a 10-position chunk of the prompt: the same bits.
        let mut chunk_layout = alone_layout.clone();
        chunk_layout.starts = vec![291];
        chunk_layout.queries = 10;
        let mut chunk_q = values(10 * per_row, 9);
        // Row r of the chunk is head r / 10 at position r % 10: the last position's rows are the
        // lone query's.
        for h in 0..HEADS.heads {
            let d = HEADS.head_dim;
            chunk_q[(h * 10 + 9) * d..][..d].copy_from_slice(&q[h * d..][..d]);
        }
        // Beside five sequences that share its first 30 blocks (read once for all of them).
        let (mut shared, shared_rows) =
            shared_layout(30, &[(248, 1), (250, 1), (240, 1), (260, 1), (244, 1)], 1, 8, None);
        shared.tables.insert(0, alone_layout.tables[0].clone());
        shared.starts.insert(0, 300);
        shared.totals.insert(0, 301);
        for table in &mut shared.tables[1..] {
            table[..30].copy_from_slice(&alone_layout.tables[0][..30]);
        }
        let shared_q = values(6 * per_row, 7);
        let shared_q = [&q[..per_row], &shared_q[per_row..]].concat();
        let pool = (shared_rows.max(rows) + 25 * 8) * w;
        let (k2, v2) = (values(pool, 5), values(pool, 6));
        assert_eq!(k2[..k.len()], k[..], "the same keys where the lone sequence reads");
        let run_shared = |threads: usize, q: &[f32], l: &PagedLayout| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
            pool.install(|| attention(Cpu::detect(), q, &k2, &v2, l, HEADS))
        };
        let found = shared_prefixes(&shared, |bi| shared.totals[bi].div_ceil(8));
        assert!(found.len() == 1 && found[0].members.len() == 6 && found[0].blocks == 30, "one prefix of 30 blocks");
        // One and two threads fold each sequence in one task (the shared blocks first, once); seven
        // split the blocks into shares instead.
        for threads in [1, 2, 7] {
            let out = run_shared(threads, &shared_q, &shared);
            assert_eq!(alone, out[..per_row].to_vec(), "{threads} threads, sharing its prompt");
        }
        let chunk = run(2, &chunk_q, &chunk_layout);
        for h in 0..HEADS.heads {
            let d = HEADS.head_dim;
            assert_eq!(chunk[(h * 10 + 9) * d..][..d], alone[h * d..][..d], "head {h}");
        }
    }

    /// One position's rows as the last of chunks of 1 to 8 positions: 2 to 16 rows of its key/value
    /// head side by side, so the AVX-512 kernel scores them in vectors of 4, 8 and 16 lanes; the
    /// same bits in each.
    #[test]
    fn a_row_gets_the_same_bits_in_vectors_of_every_width() {
        for dh in [20, 64] {
            let s = Heads { heads: 2, kv_heads: 1, head_dim: dh, scale: 0.3 };
            let last = values(2 * dh, 11);
            let (l, pool_rows) = layout(&[(99, 1)], 1, 16, None);
            let (k, v) = (values(pool_rows * dh, 12), values(pool_rows * dh, 13));
            let alone = attention(Cpu::detect(), &last, &k, &v, &l, s);
            for t in 2..=8 {
                let mut chunk = l.clone();
                (chunk.starts, chunk.queries) = (vec![100 - t], t);
                // Row r is head r / t at position r % t: position 99's rows are the lone query's.
                let mut q = values(2 * t * dh, 14);
                for h in 0..2 {
                    q[(h * t + t - 1) * dh..][..dh].copy_from_slice(&last[h * dh..][..dh]);
                }
                let out = attention(Cpu::detect(), &q, &k, &v, &chunk, s);
                for h in 0..2 {
                    assert_eq!(
                        out[(h * t + t - 1) * dh..][..dh],
                        alone[h * dh..][..dh],
                        "dh {dh}, {t} positions, head {h}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_op_equals_the_composition() {
        let dev = Default::default();
        for (case, (l, pool_rows)) in cases().into_iter().enumerate() {
            let (h, k, dh) = (HEADS.heads, HEADS.kv_heads, HEADS.head_dim);
            let normal = Distribution::Normal(0.0, 1.0);
            let q = Tensor::<Flex, 4>::random([l.batch(), h, l.queries, dh], normal, &dev);
            let keys = Tensor::<Flex, 2>::random([pool_rows, k * dh], normal, &dev);
            let values = Tensor::<Flex, 2>::random([pool_rows, k * dh], normal, &dev);
            let paged = Paged::<Flex>::new(l.clone(), &dev);
            // f16 pools: the op (the kernel on them) and the composition (gathered, then widened)
            // agree too.
            let scores16 = Scores { scale: f64::from(HEADS.scale), softcap: None };
            let (k16, v16) = (keys.clone().cast(DType::F16), values.clone().cast(DType::F16));
            let want16 = reference(q.clone(), k16.clone(), v16.clone(), &paged, (h / k, scores16), DType::F32);
            let halves = |t: &Tensor<Flex, 2>| t.clone().into_data().to_vec::<f16>().unwrap();
            let q_values = q.clone().into_data().to_vec::<f32>().unwrap();
            let kernel16 = attention_on(
                Compute::default().cpu,
                &q_values,
                Pool::F16(&halves(&k16)),
                Pool::F16(&halves(&v16)),
                &l,
                HEADS,
            );
            let got16: Tensor<Flex, 4> = float(Flex::paged_attention(
                prim(q.clone()),
                prim(k16),
                prim(v16),
                &paged,
                (h / k, scores16),
                Compute::default(),
            ));
            let (got16, want16) =
                (got16.into_data().to_vec::<f32>().unwrap(), want16.into_data().to_vec::<f32>().unwrap());
            assert_eq!(got16, kernel16, "case {case}: the op on f16 pools did not run the kernel");
            for (i, (x, y)) in got16.iter().zip(&want16).enumerate() {
                // (A row a window leaves without keys: NaN in the composition, zero in the kernel.)
                assert!(y.is_nan() || (x - y).abs() < 1e-4, "case {case}, f16 pools, {i}: {x} vs {y}");
            }
            let scores = Scores { scale: f64::from(HEADS.scale), softcap: None };
            let want = reference(q.clone(), keys.clone(), values.clone(), &paged, (h / k, scores), DType::F32);
            let cx = Compute::default();
            // A strided q (a swapped view), as the model hands it over.
            let q_view = q.clone().swap_dims(1, 2).into_data();
            let q_strided = Tensor::<Flex, 4>::from_data(q_view, &dev).swap_dims(1, 2);
            assert!(l.fits(pool_rows), "case {case}: the kernel must take this layout");
            let kernel = attention(
                cx.cpu,
                &q.clone().into_data().to_vec::<f32>().unwrap(),
                &keys.clone().into_data().to_vec::<f32>().unwrap(),
                &values.clone().into_data().to_vec::<f32>().unwrap(),
                &l,
                HEADS,
            );
            let got: Tensor<Flex, 4> =
                float(Flex::paged_attention(prim(q_strided), prim(keys), prim(values), &paged, (h / k, scores), cx));
            // Compare the rows that see a key (a padding row a window leaves without any is NaN in
            // the composition, zero in the kernel).
            let (got, want) = (got.into_data().to_vec::<f32>().unwrap(), want.into_data().to_vec::<f32>().unwrap());
            // The op ran the kernel (not its fallback): its output is the kernel's, bit for bit.
            assert_eq!(got, kernel, "case {case}: the op did not run the kernel");
            let mut compared = 0;
            for b in 0..l.batch() {
                for head in 0..h {
                    for i in 0..l.queries {
                        if l.visible(b, i).is_empty() {
                            continue;
                        }
                        let at = ((b * h + head) * l.queries + i) * dh;
                        for d in 0..dh {
                            let (x, y) = (got[at + d], want[at + d]);
                            assert!((x - y).abs() < 1e-4, "case {case}: b {b} head {head} query {i}: {x} vs {y}");
                        }
                        compared += 1;
                    }
                }
            }
            assert!(compared > 0, "case {case} compared nothing");
        }
    }

    #[test]
    fn the_mask_is_the_visible_ranges_and_none_when_all_see_all() {
        let (decode, _) = layout(&[(7, 1), (7, 1)], 1, 4, None);
        assert_eq!(decode.hidden(), None);
        let (l, _) = layout(&[(2, 2), (5, 1)], 2, 4, Some(3));
        let hidden = l.hidden().expect("a mask");
        let s = l.keys();
        assert_eq!(s, 6);
        // Row 0: query 0 at position 2 sees 0..3, query 1 at 3 sees 1..4; row 1: query 0 at 5 sees
        // 3..6, query 1 (padding) at 6 sees 4..6.
        let want = [(0, 3), (1, 4), (3, 6), (4, 6)];
        for (n, &(lo, hi)) in want.iter().enumerate() {
            let got: Vec<bool> = hidden[n * s..(n + 1) * s].to_vec();
            let expect: Vec<bool> = (0..s).map(|j| !(lo..hi).contains(&j)).collect();
            assert_eq!(got, expect, "query row {n}");
        }
        assert!(l.fits(2 * 4 + 4) && !l.fits(3));
    }
}
