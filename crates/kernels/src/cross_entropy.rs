//! Next-token cross-entropy: the plain composition (the reference) and a tiled LM-head + loss whose
//! memory does not grow with `N·V`.
//!
//! The tiled forward walks tiles of `rows × vocab` logits, keeping a running max and sum per row
//! (online log-sum-exp), and saves only the per-row log-sum-exp. The backward recomputes each tile's
//! logits, turns them into `softmax - onehot`, and multiplies them into `dH` and `dW` at once.
//!
//! Under autodiff the loss of a training step is always differentiated, so the op computes its
//! gradients in the forward pass ([`LmHeadLossOps::lm_head_loss_and_grads`]) and the backward only
//! scales them. On the CPU ([`head_loss`]) that is one pass over blocks of rows, each against the
//! whole vocabulary: the logits are made once instead of twice.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::log_softmax;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{backend::Backend, DType, IndexingUpdateOp, Int, Tensor};

use burn::backend::flex::FlexTensor;
use rayon::prelude::*;

use crate::activation::exp;
use crate::bf16_gemm::{self, Strided};
use crate::compute::{Compute, Cpu};
use crate::kernels::{self, lanes_max, lanes_sum};
use crate::simd::multiversion;
use crate::{flex, float, int, prim};

/// Target id that takes no part in the loss (padding, prompt tokens).
pub const IGNORE: i32 = -1;

/// Tile sizes of the chunked loss, and how it computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkSpec {
    /// Rows (tokens) per tile.
    pub rows: usize,
    /// Vocabulary entries per tile.
    pub vocab: usize,
    /// The run's compute: `compute.dtype` is the logits GEMMs' (f32, bf16, f16; softmax and the
    /// loss are always f32), and on the CPU it says whether the fused kernel runs and in which
    /// precision its products are.
    pub compute: Compute,
}

impl ChunkSpec {
    /// Tiles of at most 32,768 vocabulary entries and about 8M logits (32 MB in f32).
    pub fn auto(n_rows: usize, vocab_size: usize, compute: Compute) -> Self {
        const TILE: usize = 8 << 20;
        let vocab = vocab_size.clamp(1, 32_768);
        Self { rows: (TILE / vocab).clamp(1, n_rows.max(1)), vocab, compute }
    }
}

/// Mean negative log-likelihood of `targets` under `logits` over the targets that are not
/// [`IGNORE`]. This plain version holds the full `[N, V]` log-probabilities.
///
/// # Shapes
/// - logits: `[N, V]`, targets: `[N]` -> `[1]`
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [n, _] = logits.dims();
    let keep = targets.clone().greater_equal_elem(0).float(); // [N] 1.0 where scored
    let safe = targets.clamp_min(0).reshape([n, 1]); //         [N, 1] ignored rows read id 0
    let logp = log_softmax(logits, 1).gather(1, safe).reshape([n]); // [N]
    let count = keep.clone().sum().clamp_min(1.0);
    -(logp * keep).sum() / count
}

/// The plain LM head and loss: `[N, V]` logits in full, then [`cross_entropy`].
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
pub fn lm_head_loss_reference<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    compute: DType,
) -> Tensor<B, 1> {
    let logits = cast(hidden, compute).matmul(cast(weight, compute)); // [N, V]
    cross_entropy(cast(logits, DType::F32), targets)
}

fn cast<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        x
    } else {
        x.cast(dtype)
    }
}

/// The weight cut into vocabulary tiles, in the compute dtype: `(first id, [D, cv])`.
fn vocab_tiles<B: Backend>(weight: &Tensor<B, 2>, spec: &ChunkSpec) -> Vec<(usize, Tensor<B, 2>)> {
    let v = weight.dims()[1];
    (0..v)
        .step_by(spec.vocab)
        .map(|v0| (v0, cast(weight.clone().narrow(1, v0, spec.vocab.min(v - v0)), spec.compute.dtype)))
        .collect()
}

/// Where each row's target falls in the tile starting at `v0` of width `cv`: its column (clamped
/// into the tile) and 1.0 if it is really there, else 0.0.
///
/// # Shapes
/// - targets: `[R]` -> (`[R, 1]` Int, `[R, 1]`)
fn target_in_tile<B: Backend>(targets: &Tensor<B, 1, Int>, v0: usize, cv: usize) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let r = targets.dims()[0];
    let local = targets.clone().sub_scalar(v0 as i64); // [R] column inside the tile if in range
    let inside = local.clone().greater_equal_elem(0).float() * local.clone().lower_elem(cv as i64).float();
    (local.clamp(0, cv as i64 - 1).reshape([r, 1]), inside.reshape([r, 1]))
}

pub struct ForwardOut<B: Backend> {
    /// Mean loss, `[1]`.
    pub loss: Tensor<B, 1>,
    /// Log-sum-exp of each row's logits, `[N]` (saved for the backward).
    pub lse: Tensor<B, 1>,
}

/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]`
pub fn chunked_forward<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    spec: ChunkSpec,
) -> ForwardOut<B> {
    let [n, _] = hidden.dims();
    let device = hidden.device();
    let tiles = vocab_tiles(&weight, &spec);
    let keep = targets.clone().greater_equal_elem(0).float(); // [N]
    let count = keep.clone().sum().clamp_min(1.0);
    let mut total = Tensor::<B, 1>::zeros([1], &device);
    let mut lse_parts = Vec::new();
    for r0 in (0..n).step_by(spec.rows) {
        let nr = spec.rows.min(n - r0);
        let h = cast(hidden.clone().narrow(0, r0, nr), spec.compute.dtype); // [R, D]
        let t = targets.clone().narrow(0, r0, nr); //                   [R]
        let mut max: Option<Tensor<B, 2>> = None; // [R, 1] running max
        let mut sum = Tensor::<B, 2>::zeros([nr, 1], &device); // [R, 1] running sum of exp(logit - max)
        let mut picked = Tensor::<B, 2>::zeros([nr, 1], &device); // [R, 1] the target's logit
        for (v0, w) in &tiles {
            let cv = w.dims()[1];
            let logits = cast(h.clone().matmul(w.clone()), DType::F32); // [R, cv]
            let tile_max = logits.clone().max_dim(1); //                     [R, 1]
            let new_max = match &max {
                Some(m) => m.clone().max_pair(tile_max),
                None => tile_max,
            };
            if let Some(m) = &max {
                sum = sum * (m.clone() - new_max.clone()).exp();
            }
            sum = sum + (logits.clone() - new_max.clone()).exp().sum_dim(1);
            max = Some(new_max);
            let (col, inside) = target_in_tile(&t, *v0, cv);
            picked = picked + logits.gather(1, col) * inside;
        }
        let lse = max.expect("at least one vocabulary tile") + sum.log(); // [R, 1]
        let rows = (lse.clone() - picked).reshape([nr]) * keep.clone().narrow(0, r0, nr);
        total = total + rows.sum();
        lse_parts.push(lse.reshape([nr]));
    }
    ForwardOut { loss: total / count, lse: Tensor::cat(lse_parts, 0) }
}

/// Gradients of the mean loss times `grad` (`[1]`) with respect to `hidden` and (when
/// `need_weight`) `weight`, in their dtypes.
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]`, lse: `[N]`, grad: `[1]` -> (`[N, D]`, `[D, V]`)
pub fn chunked_backward<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    lse: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    spec: ChunkSpec,
    need_weight: bool,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let [n, _] = hidden.dims();
    let (h_dtype, w_dtype) = (hidden.dtype(), weight.dtype());
    let tiles = vocab_tiles(&weight, &spec);
    let tiles_t: Vec<Tensor<B, 2>> = tiles.iter().map(|(_, w)| w.clone().transpose()).collect(); // [cv, D]
    let keep = targets.clone().greater_equal_elem(0).float(); // [N]
    let count = keep.clone().sum().clamp_min(1.0);
    let coef = cast(grad, DType::F32) / count; // [1] d(loss)/d(row loss) of a scored row
    let mut dw: Vec<Option<Tensor<B, 2>>> = vec![None; tiles.len()];
    let mut dh_parts = Vec::new();
    for r0 in (0..n).step_by(spec.rows) {
        let nr = spec.rows.min(n - r0);
        let h = cast(hidden.clone().narrow(0, r0, nr), spec.compute.dtype); // [R, D]
        let h_t = h.clone().transpose(); //                              [D, R]
        let t = targets.clone().narrow(0, r0, nr);
        let lse = lse.clone().narrow(0, r0, nr).reshape([nr, 1]);
        let scale = (keep.clone().narrow(0, r0, nr) * coef.clone()).reshape([nr, 1]); // [R, 1]
        let mut dh: Option<Tensor<B, 2>> = None;
        for (j, (v0, w)) in tiles.iter().enumerate() {
            let cv = w.dims()[1];
            let logits = cast(h.clone().matmul(w.clone()), DType::F32); // [R, cv]
            let probs = (logits - lse.clone()).exp(); //                   [R, cv] softmax
            let (col, inside) = target_in_tile(&t, *v0, cv);
            let dlogits = probs.scatter(1, col, -inside, IndexingUpdateOp::Add) * scale.clone(); // softmax - onehot
            let dlogits = cast(dlogits, spec.compute.dtype);
            let dh_tile = cast(dlogits.clone().matmul(tiles_t[j].clone()), DType::F32); // [R, D]
            dh = Some(match dh {
                Some(acc) => acc + dh_tile,
                None => dh_tile,
            });
            if need_weight {
                let dw_tile = cast(h_t.clone().matmul(dlogits), DType::F32); // [D, cv]
                dw[j] = Some(match dw[j].take() {
                    Some(acc) => acc + dw_tile,
                    None => dw_tile,
                });
            }
        }
        dh_parts.push(dh.expect("at least one vocabulary tile"));
    }
    let dh = Tensor::cat(dh_parts, 0);
    let dw = need_weight.then(|| Tensor::cat(dw.into_iter().map(|t| t.expect("every tile visited")).collect(), 1));
    (cast(dh, h_dtype), dw.map(|dw| cast(dw, w_dtype)))
}

/// The loss and, where asked for, its gradients for an upstream gradient of one: `(loss [1],
/// dH [N, D], dW [D, V])`.
pub type LossAndGrads<B> = (FloatTensor<B>, Option<FloatTensor<B>>, Option<FloatTensor<B>>);

/// A backend's tiled LM-head loss; the default methods are the tiled composition of tensor ops,
/// under autodiff one node whose gradients are computed with the loss.
pub trait LmHeadLossOps: Backend {
    /// Mean cross-entropy of `targets` under the logits `hidden · weight`, computed over tiles of rows
    /// and vocabulary so that the `[N, V]` logits never exist at once. Targets equal to [`IGNORE`] do
    /// not count. Returns `[1]`.
    ///
    /// # Shapes
    /// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
    fn lm_head_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
    ) -> FloatTensor<Self> {
        reference_loss::<Self>(hidden, weight, targets, spec)
    }

    /// [`Self::lm_head_cross_entropy`] with the gradients of the loss (for an upstream gradient of
    /// one) with respect to `hidden` and `weight` where `need` = `(hidden, weight)` asks for them.
    /// The default is the tiled forward, then the tiled backward.
    ///
    /// # Shapes
    /// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> (`[1]`, `[N, D]`, `[D, V]`)
    fn lm_head_loss_and_grads(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
        need: (bool, bool),
    ) -> LossAndGrads<Self> {
        reference_loss_and_grads::<Self>(hidden, weight, targets, spec, need)
    }

    /// `grad · by` (`by`: `[1]`, the upstream gradient of the loss): the backward's scaling of a
    /// gradient [`Self::lm_head_loss_and_grads`] made for an upstream gradient of one.
    fn scale_saved_grad(grad: FloatTensor<Self>, by: FloatTensor<Self>) -> FloatTensor<Self> {
        scale_composition::<Self>(grad, by)
    }
}

/// [`LmHeadLossOps::scale_saved_grad`] as a broadcast product.
fn scale_composition<B: Backend>(grad: FloatTensor<B>, by: FloatTensor<B>) -> FloatTensor<B> {
    let g = float::<B, 2>(grad);
    let by = float::<B, 1>(by).cast(g.dtype()).reshape([1, 1]);
    prim(g * by)
}

/// The tiled forward: [`LmHeadLossOps::lm_head_cross_entropy`]'s reference.
pub fn reference_loss<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    spec: ChunkSpec,
) -> FloatTensor<B> {
    prim(chunked_forward(float::<B, 2>(hidden), float(weight), int(targets), spec).loss)
}

/// The tiled forward, then the tiled backward for an upstream gradient of one:
/// [`LmHeadLossOps::lm_head_loss_and_grads`]'s reference.
pub fn reference_loss_and_grads<B: Backend>(
    hidden: FloatTensor<B>,
    weight: FloatTensor<B>,
    targets: IntTensor<B>,
    spec: ChunkSpec,
    need: (bool, bool),
) -> LossAndGrads<B> {
    let (h, w, t) = (float::<B, 2>(hidden), float::<B, 2>(weight), int::<B, 1>(targets));
    let out = chunked_forward(h.clone(), w.clone(), t.clone(), spec);
    if !need.0 && !need.1 {
        return (prim(out.loss), None, None);
    }
    let one = Tensor::<B, 1>::ones([1], &h.device());
    let (dh, dw) = chunked_backward(h, w, t, out.lse, one, spec, need.1);
    (prim(out.loss), need.0.then(|| prim(dh)), dw.map(prim))
}

/// What [`head_loss`] computes: the mean loss and, where asked for, its gradients for an upstream
/// gradient of one.
#[derive(Debug)]
pub struct HeadLoss {
    pub loss: f32,
    /// `[N, D]`.
    pub dh: Option<Vec<f32>>,
    /// `[D, V]` row-major, or `[V, D]` row-major (its transpose) where `dw_transposed`.
    pub dw: Option<Vec<f32>>,
    /// Whether `dw` is stored `[V, D]`: so it is where the weight is read through a row stride of
    /// one (a tied head: the `[V, D]` embedding table seen transposed), and the gradient then adds
    /// to the table's own gradient without a transposing copy.
    pub dw_transposed: bool,
}

/// Rows of logits a block of [`head_loss`] holds: about 64M logits (256 MB) at once, between 8 and
/// 512 rows, the blocks of one call equal. Each block streams the whole `[D, V]` weight through
/// the GEMM, so fewer rows make the head memory-bound on a large vocabulary: at Gemma 3's 262,144
/// entries, 64 rows a block (16M logits) ran its LoRA step at 111 tokens/s in f32, 256 rows at 197
/// (512 rows: 196, and 0.25 GiB more); 2 Xeon cores, configs/gemma3-270m-lora.toml.
fn head_block_rows(n: usize, v: usize) -> usize {
    let most = ((64 << 20) / v.max(1)).clamp(8, 512);
    n.div_ceil(n.div_ceil(most).max(1)).max(1)
}

/// The LM head and its loss on the CPU, in one pass over blocks of rows, each against the whole
/// vocabulary: the block's logits (one GEMM); each row's log-sum-exp and, when gradients are asked
/// for (`need` = (hidden, weight)), `(softmax − onehot) / scored rows` in place of the logits; then
/// `dH = dlogits · Wᵀ` and `dW += Hᵀ · dlogits` while the block is at hand. The logits are made once
/// and never recomputed. `bf16`: the large GEMMs take bf16 operands (where the CPU can; the
/// weight packed once for all blocks) with f32 sums; softmax and loss stay f32. Targets below zero
/// ([`IGNORE`]) do not count; a target at or past the vocabulary counts with nothing picked, as in
/// the composition.
///
/// # Panics
/// If a slice is shorter than its shape (and strides) reach.
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]` with (row, column) strides, targets: `[N]`
pub fn head_loss(
    hidden: &[f32],
    weight: Strided<'_>,
    targets: &[i64],
    (n, d, v): (usize, usize, usize),
    need: (bool, bool),
    cpu: Cpu,
) -> HeadLoss {
    assert!(hidden.len() >= n * d && targets.len() >= n, "LM head: a slice is shorter than its shape");
    let scored = targets[..n].iter().filter(|&&t| t >= 0).count();
    let scale = 1.0 / scored.max(1) as f32;
    let grads = need.0 || need.1;
    let mut dh = need.0.then(|| vec![0.0f32; n * d]);
    let mut dw = need.1.then(|| vec![0.0f32; d * v]);
    let (w, (rs, cs)) = weight;
    let dw_transposed = rs == 1 && cs != 1;
    if n == 0 || v == 0 {
        return HeadLoss { loss: 0.0, dh, dw, dw_transposed };
    }
    let rows = head_block_rows(n, v);
    let w_t: Strided<'_> = (w, (cs, rs)); // [V, D]
    let bf16 = kernels::large_bf16(cpu, (rows, v, d));
    let packed_w = bf16.and_then(|kernel| bf16_gemm::pack_b(kernel, weight, (d, v)));
    let packed_wt = bf16.filter(|_| need.0).and_then(|kernel| bf16_gemm::pack_b(kernel, w_t, (v, d)));
    let mut logits = vec![0.0f32; rows * v];
    let mut total = 0.0f64;
    for r0 in (0..n).step_by(rows) {
        let r = rows.min(n - r0);
        let h: Strided<'_> = (&hidden[r0 * d..(r0 + r) * d], (d, 1));
        let block = &mut logits[..r * v];
        match &packed_w {
            Some(p) => bf16_gemm::gemm_packed(block, false, h, p, r),
            None => kernels::product(cpu, block, false, h, weight, (r, d, v)),
        }
        let rows_loss: Vec<f64> = block
            .par_chunks_mut(v)
            .zip(&targets[r0..r0 + r])
            .map(|(row, &t)| row_loss(cpu, row, t, grads.then_some(scale)))
            .collect();
        // Summed in row order: the same loss on every run, whatever the threads did.
        total += rows_loss.iter().sum::<f64>();
        let dlogits: Strided<'_> = (block, (v, 1));
        if let Some(dh) = &mut dh {
            let out = &mut dh[r0 * d..(r0 + r) * d];
            match &packed_wt {
                Some(p) => bf16_gemm::gemm_packed(out, false, dlogits, p, r),
                None => kernels::product(cpu, out, false, dlogits, w_t, (r, v, d)),
            }
        }
        if let Some(dw) = &mut dw {
            match dw_transposed {
                // dlogitsᵀ · H, `[V, D]`.
                true => kernels::product(cpu, dw, r0 > 0, (block, (1, v)), h, (v, r, d)),
                // Hᵀ · dlogits, `[D, V]`.
                false => kernels::product(cpu, dw, r0 > 0, (h.0, (1, d)), dlogits, (d, r, v)),
            }
        }
    }
    HeadLoss { loss: (total / scored.max(1) as f64) as f32, dh, dw, dw_transposed }
}

multiversion! {
    /// One row's `log-sum-exp − logit[target]` (zero for an ignored row). With `grad` (the upstream
    /// gradient of each scored row), the row becomes its logits' gradient `(softmax − onehot) · grad`
    /// (zeros for an ignored row); without, scratch.
    pub(crate) fn row_loss(cpu: Cpu, row: &mut [f32], target: i64, grad: Option<f32>) -> f64 {
        if target < 0 {
            if grad.is_some() {
                row.fill(0.0);
            }
            return 0.0;
        }
        let t = usize::try_from(target).unwrap_or(usize::MAX);
        let picked = row.get(t).copied().unwrap_or(0.0);
        let max = lanes_max(row);
        row.iter_mut().for_each(|x| *x = exp(*x - max));
        let sum = lanes_sum(row);
        if let Some(g) = grad {
            let s = g / sum;
            row.iter_mut().for_each(|x| *x *= s);
            if let Some(x) = row.get_mut(t) {
                *x -= g;
            }
        }
        f64::from(max + sum.ln() - picked)
    }
}

/// [`head_loss`] on Flex tensors, or `None` where it does not take them (other dtypes, a compute
/// dtype other than f32, the reference path asked for, shapes that do not fit): the composition
/// runs then.
fn flex_head_loss(
    hidden: &FlexTensor,
    weight: &FlexTensor,
    targets: &FlexTensor,
    spec: ChunkSpec,
    need: (bool, bool),
) -> Option<(FlexTensor, Option<FlexTensor>, Option<FlexTensor>)> {
    let (hs, ws, ts) = (flex::shape(hidden), flex::shape(weight), flex::shape(targets));
    let fits = hs.len() == 2 && ws.len() == 2 && ts.len() == 1 && hs[1] == ws[0] && ts[0] == hs[0];
    let compute = spec.compute;
    if !fits || compute.dtype != DType::F32 || !flex::all_f32(&[hidden, weight]) || !compute.fused::<Flex>(DType::F32) {
        return None;
    }
    let (n, d, v) = (hs[0], hs[1], ws[1]);
    // The weight read where it is: a tied head is the embedding table seen transposed.
    let layout = weight.layout();
    let strides = layout.strides();
    let (rs, cs) = (usize::try_from(strides[0]).ok()?, usize::try_from(strides[1]).ok()?);
    let storage = &weight.storage::<f32>()[layout.start_offset()..];
    let targets: Vec<i64> = int::<Flex, 1>(targets.clone()).into_data().iter::<i64>().collect();
    let h = flex::f32s(hidden);
    let out = head_loss(&h, (storage, (rs, cs)), &targets, (n, d, v), need, compute.head_cpu());
    let dw = out.dw.map(|dw| match out.dw_transposed {
        // `[D, V]` seen through strides over `[V, D]` storage, as the weight is.
        true => flex::tensor(dw, vec![v, d]).transpose(0, 1),
        false => flex::tensor(dw, vec![d, v]),
    });
    Some((flex::tensor(vec![out.loss], vec![1]), out.dh.map(|dh| flex::tensor(dh, vec![n, d])), dw))
}

impl LmHeadLossOps for Flex {
    fn lm_head_cross_entropy(
        hidden: FlexTensor,
        weight: FlexTensor,
        targets: FlexTensor,
        spec: ChunkSpec,
    ) -> FlexTensor {
        match flex_head_loss(&hidden, &weight, &targets, spec, (false, false)) {
            Some((loss, _, _)) => loss,
            None => reference_loss::<Self>(hidden, weight, targets, spec),
        }
    }

    fn lm_head_loss_and_grads(
        hidden: FlexTensor,
        weight: FlexTensor,
        targets: FlexTensor,
        spec: ChunkSpec,
        need: (bool, bool),
    ) -> LossAndGrads<Self> {
        match flex_head_loss(&hidden, &weight, &targets, spec, need) {
            Some(out) => out,
            None => reference_loss_and_grads::<Self>(hidden, weight, targets, spec, need),
        }
    }

    /// In place and in the gradient's own layout: a tied head's `dW` is a transposed view, which
    /// the broadcast product would copy into the other layout, only for the add to the embedding
    /// table's gradient to walk it transposed again. Nothing to do for an upstream gradient of one.
    fn scale_saved_grad(mut grad: FlexTensor, by: FlexTensor) -> FlexTensor {
        let scalar = if flex::all_f32(&[&grad, &by]) { flex::f32s(&by).first().copied() } else { None };
        if let Some(s) = scalar {
            if s == 1.0 {
                return grad;
            }
            let n: usize = flex::shape(&grad).iter().product();
            let whole = grad.layout().start_offset() == 0 && grad.storage::<f32>().len() == n;
            if let (true, Some(storage)) = (whole, grad.try_storage_mut::<f32>()) {
                storage.par_iter_mut().for_each(|x| *x *= s);
                return grad;
            }
        }
        scale_composition::<Self>(grad, by)
    }
}

impl<B: LmHeadLossOps, C: CheckpointStrategy> LmHeadLossOps for Autodiff<B, C> {
    fn lm_head_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
    ) -> FloatTensor<Self> {
        /// The gradients are computed with the loss (a training step's loss is always
        /// differentiated): the backward only scales them by the upstream gradient. Memory: `dH`
        /// `[N, D]` and, for a trained head, `dW` `[D, V]` (the head's gradient, made at the start
        /// of the backward pass anyway); never `[N, V]`. With f16 GEMMs the backward recomputes
        /// instead: the logits' gradients must carry the loss scale (the upstream gradient) before
        /// they are rounded to f16, or most of them flush to zero.
        #[derive(Debug)]
        struct LmHeadCrossEntropy;

        /// `(dH, dW)` for an upstream gradient of one, or what the tiled backward recomputes from.
        type Saved<B> = (
            Option<FloatTensor<B>>,
            Option<FloatTensor<B>>,
            Option<(FloatTensor<B>, FloatTensor<B>, IntTensor<B>, FloatTensor<B>, ChunkSpec)>,
        );

        impl<B: LmHeadLossOps> Backward<B, 2> for LmHeadCrossEntropy {
            type State = Saved<B>;

            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node_hidden, node_weight] = ops.parents;
                let grad = float::<B, 1>(grads.consume::<B>(&ops.node)); // [1]
                let (dh, dw) = match ops.state {
                    (_, _, Some((hidden, weight, targets, lse, spec))) => {
                        let (h, w, t) = (float::<B, 2>(hidden), float::<B, 2>(weight), int::<B, 1>(targets));
                        let need_weight = node_weight.is_some();
                        let (dh, dw) = chunked_backward(h, w, t, float(lse), grad, spec, need_weight);
                        (Some(prim(dh)), dw.map(prim))
                    }
                    (dh, dw, None) => {
                        let scaled = |g: FloatTensor<B>| B::scale_saved_grad(g, prim(grad.clone()));
                        (dh.map(scaled), dw.map(scaled))
                    }
                };
                if let (Some(node), Some(dh)) = (node_hidden, dh) {
                    grads.register::<B>(node.id, dh);
                }
                if let (Some(node), Some(dw)) = (node_weight, dw) {
                    grads.register::<B>(node.id, dw);
                }
            }
        }

        // A frozen input (the head under LoRA) gets no gradient: for the head that is a third of the work.
        let need = (!hidden.node.requirement.is_none(), !weight.node.requirement.is_none());
        match LmHeadCrossEntropy.prepare::<C>([hidden.node.clone(), weight.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) if spec.compute.dtype == DType::F16 => {
                let (h, w) = (float::<B, 2>(hidden.primitive), float::<B, 2>(weight.primitive));
                let out = chunked_forward(h.clone(), w.clone(), int::<B, 1>(targets.clone()), spec);
                let saved = (prim(h), prim(w), targets, prim(out.lse), spec);
                prep.finish((None, None, Some(saved)), prim(out.loss))
            }
            OpsKind::Tracked(prep) => {
                let (loss, dh, dw) = B::lm_head_loss_and_grads(hidden.primitive, weight.primitive, targets, spec, need);
                prep.finish((dh, dw, None), loss)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::lm_head_cross_entropy(hidden.primitive, weight.primitive, targets, spec))
            }
        }
    }
}

/// Tensor-level entry point of [`LmHeadLossOps::lm_head_cross_entropy`].
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
pub fn lm_head_cross_entropy<B: LmHeadLossOps>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    spec: ChunkSpec,
) -> Tensor<B, 1> {
    float(B::lm_head_cross_entropy(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        spec,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, TensorData};
    use rand::{Rng, SeedableRng};

    type AB = Autodiff<Flex>;

    #[test]
    fn plain_cross_entropy_matches_a_hand_computation_and_skips_ignored_targets() {
        let dev = Default::default();
        let logits = Tensor::<Flex, 2>::from_data([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [3.0, -1.0, 0.0]], &dev);
        let targets = Tensor::<Flex, 1, Int>::from_data(TensorData::new(vec![2, IGNORE, 0], [3]), &dev);
        let got = cross_entropy(logits, targets).into_scalar();
        let nll = |row: [f64; 3], t: usize| row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[t];
        let want = (nll([1.0, 2.0, 3.0], 2) + nll([3.0, -1.0, 0.0], 0)) / 2.0;
        assert!((got as f64 - want).abs() < 1e-6, "{got} vs {want}");
    }

    fn max_rel(a: &TensorData, b: &TensorData) -> f64 {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let scale = b.iter().fold(0f64, |m, &x| m.max(x.abs() as f64)).max(1e-12);
        a.iter().zip(&b).fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs())) / scale
    }

    /// Loss and both gradients against the plain composition (times an upstream gradient of 2.5),
    /// three ways: the op under autodiff (on Flex: the CPU kernel), the tiled composition called
    /// directly, and the op on the inner backend (loss only).
    fn compare(n: usize, d: usize, v: usize, spec: ChunkSpec, ignored: usize, tied: bool) {
        let dev = Default::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((n * 31 + v) as u64);
        let mut targets: Vec<i32> = (0..n).map(|_| rng.random_range(0..v as i32)).collect();
        for i in 0..ignored.min(n) {
            targets[(i * 7) % n] = IGNORE;
        }
        let t = || Tensor::<AB, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &dev);
        let h0 = Tensor::<Flex, 2>::random([n, d], Distribution::Normal(0.0, 1.0), &dev);
        let w0 = Tensor::<Flex, 2>::random(if tied { [v, d] } else { [d, v] }, Distribution::Normal(0.0, 0.3), &dev);
        let head = |w: Tensor<Flex, 2>| if tied { w.transpose() } else { w };
        let run = |chunked: bool| {
            let h = Tensor::<AB, 2>::from_inner(h0.clone()).require_grad();
            let w = Tensor::<AB, 2>::from_inner(w0.clone()).require_grad();
            let head = if tied { w.clone().transpose() } else { w.clone() };
            let loss = if chunked {
                lm_head_cross_entropy(h.clone(), head, t(), spec)
            } else {
                lm_head_loss_reference(h.clone(), head, t(), DType::F32)
            };
            let grads = (loss.clone() * 2.5).backward();
            (loss.into_data(), h.grad(&grads).unwrap().into_data(), w.grad(&grads).unwrap().into_data())
        };
        let (l1, dh1, dw1) = run(true);
        let (l0, dh0, dw0) = run(false);
        let tag = format!("n {n} d {d} v {v} {spec:?} ignored {ignored} tied {tied}");
        assert!(max_rel(&l1, &l0) < 1e-5, "loss {tag}: {l1:?} vs {l0:?}");
        assert!(max_rel(&dh1, &dh0) < 1e-5, "dH {tag}: {}", max_rel(&dh1, &dh0));
        assert!(max_rel(&dw1, &dw0) < 1e-5, "dW {tag}: {}", max_rel(&dw1, &dw0));
        // The tiled composition itself, and the loss alone on the inner backend.
        let t_inner = Tensor::<Flex, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &dev);
        let (l2, dh2, dw2) = reference_loss_and_grads::<Flex>(
            prim(h0.clone()),
            prim(head(w0.clone())),
            t_inner.clone().into_primitive(),
            spec,
            (true, true),
        );
        let dw2 = float::<Flex, 2>(dw2.unwrap()) * 2.5;
        let dw2 = if tied { dw2.transpose() } else { dw2 };
        assert!(max_rel(&float::<Flex, 1>(l2).into_data(), &l0) < 1e-5, "composition loss {tag}");
        assert!(max_rel(&(float::<Flex, 2>(dh2.unwrap()) * 2.5).into_data(), &dh0) < 1e-5, "composition dH {tag}");
        assert!(max_rel(&dw2.into_data(), &dw0) < 1e-5, "composition dW {tag}");
        let kernel = flex_head_loss(
            &prim(h0.clone()),
            &prim(head(w0.clone())),
            &t_inner.clone().into_primitive(),
            spec,
            (true, true),
        );
        assert!(kernel.is_some(), "the CPU kernel did not take {tag}");
        let l3 = lm_head_cross_entropy(h0.clone(), head(w0.clone()), t_inner, spec).into_data();
        assert!(max_rel(&l3, &l0) < 1e-5, "inner loss {tag}: {l3:?} vs {l0:?}");
    }

    #[test]
    fn chunked_equals_plain_values_and_gradients() {
        let spec = |rows, vocab| ChunkSpec { rows, vocab, compute: Compute::default() };
        // Vocabulary and rows not divisible by the tile sizes; a single tile; one row at a time.
        compare(37, 16, 101, spec(8, 24), 0, false);
        compare(37, 16, 101, spec(8, 24), 5, false);
        compare(12, 8, 65, spec(64, 128), 3, false);
        compare(5, 8, 33, spec(1, 7), 1, false);
        compare(1, 4, 9, spec(1, 4), 0, false);
        // The head tied to an embedding table ([V, D], transposed).
        compare(20, 8, 50, spec(6, 16), 2, true);
        // More rows than the CPU kernel's block (three blocks of 367), tied and not.
        compare(1100, 8, 40, spec(64, 16), 9, true);
        compare(1100, 8, 40, spec(64, 16), 0, false);
    }

    #[test]
    fn f16_gemms_recompute_in_the_backward_with_the_loss_scale() {
        // The upstream gradient (a loss scale) reaches the logits' gradients before their f16
        // rounding: with it applied afterwards, (softmax − onehot) / N of a large N flushes to zero.
        let dev = Default::default();
        let (n, d, v) = (64, 16, 50);
        let h0 = Tensor::<Flex, 2>::random([n, d], Distribution::Normal(0.0, 1.0), &dev);
        let w0 = Tensor::<Flex, 2>::random([d, v], Distribution::Normal(0.0, 0.3), &dev);
        let t = || Tensor::<AB, 1, Int>::from_data(TensorData::new((0..n).map(|i| i * 13 % 50).collect(), [n]), &dev);
        let grads = |compute: DType, chunked: bool| {
            let h = Tensor::<AB, 2>::from_inner(h0.clone()).require_grad();
            let w = Tensor::<AB, 2>::from_inner(w0.clone()).require_grad();
            let spec = ChunkSpec { rows: 16, vocab: 24, compute: Compute::default().with_dtype(compute) };
            let loss = if chunked {
                lm_head_cross_entropy(h.clone(), w.clone(), t(), spec)
            } else {
                lm_head_loss_reference(h.clone(), w.clone(), t(), DType::F32)
            };
            let g = (loss * 1024.0).backward();
            (h.grad(&g).unwrap().into_data(), w.grad(&g).unwrap().into_data())
        };
        let (dh, dw) = grads(DType::F16, true);
        let (want_dh, want_dw) = grads(DType::F32, false);
        assert!(max_rel(&dh, &want_dh) < 1e-2, "dH {}", max_rel(&dh, &want_dh));
        assert!(max_rel(&dw, &want_dw) < 1e-2, "dW {}", max_rel(&dw, &want_dw));
    }

    #[test]
    fn the_cpu_kernel_blocks_rows_by_the_vocabulary() {
        assert_eq!(head_block_rows(1100, 40), 367);
        assert_eq!(head_block_rows(1024, 49_152), 512);
        assert_eq!(head_block_rows(2048, 262_144), 256);
        assert_eq!(head_block_rows(3, 49_152), 3);
        assert!(head_block_rows(8192, 128_256) * 128_256 <= 64 << 20);
        assert_eq!(head_block_rows(0, 10), 1);
    }

    #[test]
    fn the_cpu_kernel_in_bf16_stays_close_to_f32() {
        if !bf16_gemm::supported() {
            eprintln!("no AVX512_BF16 on this CPU: the bf16 LM head is not reachable here");
            return;
        }
        // Large enough for bf16 GEMMs (≥ 50 MFLOP each); the weight transposed, as a tied head.
        let (n, d, v) = (64, 256, 4096);
        let h = crate::testing::values(n * d, 4);
        let w = crate::testing::values(v * d, 5); // [V, D]
        let targets: Vec<i64> = (0..n as i64).map(|i| if i % 9 == 0 { -1 } else { i * 61 % v as i64 }).collect();
        let weight: Strided<'_> = (&w, (1, d));
        let exact = head_loss(&h, weight, &targets, (n, d, v), (true, true), Cpu::f32_products());
        let low = head_loss(&h, weight, &targets, (n, d, v), (true, true), Cpu::detect());
        let close = |a: &[f32], b: &[f32], what: &str| {
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            // bf16 keeps 8 bits: operands within 2^-9 relative, sums of D or V products in f32.
            assert!(err <= 2e-2 * scale, "{what}: {err} against {scale}");
            assert!(err > 0.0, "{what}: bf16 equals f32, the bf16 path was not taken");
        };
        assert!((low.loss - exact.loss).abs() < 1e-2 * exact.loss.abs(), "{} vs {}", low.loss, exact.loss);
        close(low.dh.as_deref().unwrap(), exact.dh.as_deref().unwrap(), "dH");
        close(low.dw.as_deref().unwrap(), exact.dw.as_deref().unwrap(), "dW");
    }

    #[test]
    fn a_frozen_head_gets_no_gradient_and_the_hidden_one_is_unchanged() {
        let dev = Default::default();
        let (n, d, v) = (19, 8, 45);
        let t = || Tensor::<AB, 1, Int>::from_data(TensorData::new((0..n).map(|i| i * 7 % 45).collect(), [n]), &dev);
        let h0 = Tensor::<Flex, 2>::random([n, d], Distribution::Normal(0.0, 1.0), &dev);
        let w0 = Tensor::<Flex, 2>::random([d, v], Distribution::Normal(0.0, 0.3), &dev);
        let spec = ChunkSpec { rows: 6, vocab: 16, compute: Compute::default() };
        let dh = |frozen: bool| {
            let h = Tensor::<AB, 2>::from_inner(h0.clone()).require_grad();
            let w = Tensor::<AB, 2>::from_inner(w0.clone());
            let w = if frozen { w } else { w.require_grad() };
            let grads = lm_head_cross_entropy(h.clone(), w.clone(), t(), spec).backward();
            assert_eq!(w.grad(&grads).is_some(), !frozen, "frozen {frozen}");
            h.grad(&grads).expect("hidden gradient").into_data()
        };
        assert_eq!(dh(true), dh(false));
    }

    #[test]
    fn all_ignored_gives_zero_loss_and_zero_gradients() {
        let dev = Default::default();
        let h = Tensor::<AB, 2>::random([4, 3], Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let w = Tensor::<AB, 2>::random([3, 5], Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let t = Tensor::<AB, 1, Int>::from_data(TensorData::new(vec![IGNORE; 4], [4]), &dev);
        let loss = lm_head_cross_entropy(h.clone(), w.clone(), t, ChunkSpec::auto(4, 5, Compute::default()));
        let grads = loss.backward();
        assert_eq!(loss.into_scalar(), 0.0);
        assert_eq!(h.grad(&grads).unwrap().abs().max().into_scalar(), 0.0);
        assert_eq!(w.grad(&grads).unwrap().abs().max().into_scalar(), 0.0);
    }

    #[test]
    fn bf16_gemms_stay_close_to_f32() {
        let dev = Default::default();
        let h = Tensor::<Flex, 2>::random([32, 16], Distribution::Normal(0.0, 1.0), &dev);
        let w = Tensor::<Flex, 2>::random([16, 40], Distribution::Normal(0.0, 0.3), &dev);
        let t = Tensor::<Flex, 1, Int>::from_data(
            TensorData::new((0..32).map(|i| i % 40).collect::<Vec<i32>>(), [32]),
            &dev,
        );
        let f32_loss = lm_head_loss_reference(h.clone(), w.clone(), t.clone(), DType::F32).into_scalar();
        let spec = ChunkSpec { rows: 8, vocab: 16, compute: Compute::default().with_dtype(DType::BF16) };
        let out = chunked_forward(h, w, t, spec);
        assert_eq!(out.loss.dtype(), DType::F32);
        let bf16_loss = out.loss.into_scalar();
        assert!((bf16_loss - f32_loss).abs() < 2e-2 * f32_loss.abs(), "{bf16_loss} vs {f32_loss}");
    }

    #[test]
    fn auto_tiles_bound_the_tile() {
        let s = ChunkSpec::auto(8192, 128_256, Compute::default());
        assert_eq!(s.vocab, 32_768);
        assert!(s.rows * s.vocab <= 8 << 20);
        let s = ChunkSpec::auto(768, 65, Compute::default());
        assert_eq!((s.rows, s.vocab), (768, 65));
    }
}
