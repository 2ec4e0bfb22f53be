//! Per-head RMSNorm of queries and keys (Qwen3, Gemma 3; Dehghani et al., 2023, "Scaling Vision
//! Transformers to 22 Billion Parameters"), on the packed q/k/v rows that one projection makes:
//! each head's `Dh` values of q normalised with the weight `wq`, of k with `wk`, v untouched.
//! Gemma's `(1 + w)` weights come in already offset.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};

use crate::compute::Compute;
use crate::{flex, float, prim, reference_grads, rms_norm, EmberBackend};

/// The heads of a packed q/k/v row: `(H, K, Dh)`, query heads, key/value heads, head width. A row
/// is `[q heads | k heads | v heads]`, `(H + 2K)·Dh` wide.
pub type QkvHeads = (usize, usize, usize);

/// The gradients of the packed q/k/v, of `wq` and of `wk`.
pub type QkNormGrads<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// A backend's q/k norm; the default methods are the reference.
pub trait QkNormOps: Backend {
    /// # Shapes
    /// - qkv: `[N, (H + 2K)·Dh]`, wq, wk: `[Dh]` -> `[N, (H + 2K)·Dh]`
    fn qk_norm(
        qkv: FloatTensor<Self>,
        wq: FloatTensor<Self>,
        wk: FloatTensor<Self>,
        heads: QkvHeads,
        eps: f64,
        _cx: Compute,
    ) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(qkv), float(wq), float(wk), heads, eps))
    }

    /// Gradients of qkv, wq and wk given the output gradient.
    fn qk_norm_backward(
        qkv: FloatTensor<Self>,
        wq: FloatTensor<Self>,
        wk: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        heads: QkvHeads,
        eps: f64,
        _cx: Compute,
    ) -> QkNormGrads<Self> {
        let (dqkv, dwq, dwk) = reference_backward(float::<Self, 2>(qkv), float(wq), float(wk), float(dy), heads, eps);
        (prim(dqkv), prim(dwq), prim(dwk))
    }
}

/// The composition: the reference, and the path of backends without a kernel. Each part's heads as
/// rows of an RMSNorm ([`rms_norm::reference`]: the reduction in f32).
///
/// # Shapes
/// - qkv: `[N, (H + 2K)·Dh]`, wq, wk: `[Dh]` -> `[N, (H + 2K)·Dh]`
pub fn reference<B: Backend>(
    qkv: Tensor<B, 2>,
    wq: Tensor<B, 1>,
    wk: Tensor<B, 1>,
    (h, k, dh): QkvHeads,
    eps: f64,
) -> Tensor<B, 2> {
    let n = qkv.dims()[0];
    let norm = |first: usize, heads: usize, w: Tensor<B, 1>| {
        let part = qkv.clone().narrow(1, first * dh, heads * dh).reshape([n * heads, dh]); // [N·heads, Dh]
        rms_norm::reference(part, w, eps).reshape([n, heads * dh])
    };
    let (q, k_part) = (norm(0, h, wq), norm(h, k, wk));
    let v = qkv.narrow(1, (h + k) * dh, k * dh); // [N, K·Dh]
    Tensor::cat(vec![q, k_part, v], 1)
}

/// The reference's gradients (of qkv, wq `[Dh]` and wk `[Dh]`), through Burn's autodiff.
pub fn reference_backward<B: Backend>(
    qkv: Tensor<B, 2>,
    wq: Tensor<B, 1>,
    wk: Tensor<B, 1>,
    dy: Tensor<B, 2>,
    heads: QkvHeads,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1>) {
    let dh = heads.2;
    let [dqkv, dwq, dwk] = reference_grads([qkv, wq.reshape([1, dh]), wk.reshape([1, dh])], dy, |[qkv, wq, wk]| {
        reference(qkv, wq.reshape([dh]), wk.reshape([dh]), heads, eps)
    });
    (dqkv, dwq.reshape([dh]), dwk.reshape([dh]))
}

/// The q/k norm as one op where the backend runs it faster so, else the composition.
///
/// # Panics
/// If the rows are not `(H + 2K)·Dh` wide or a weight not `Dh` long.
///
/// # Shapes
/// - qkv: `[N, (H + 2K)·Dh]`, wq, wk: `[Dh]` -> `[N, (H + 2K)·Dh]`
pub fn qk_norm_packed<B: EmberBackend>(
    qkv: Tensor<B, 2>,
    wq: Tensor<B, 1>,
    wk: Tensor<B, 1>,
    heads: QkvHeads,
    eps: f64,
    cx: Compute,
) -> Tensor<B, 2> {
    let (h, k, dh) = heads;
    assert!(
        qkv.dims()[1] == (h + 2 * k) * dh && wq.dims() == [dh] && wk.dims() == [dh],
        "qk_norm_packed: rows of {} for {h} + 2·{k} heads of {dh}, weights {:?} and {:?}",
        qkv.dims()[1],
        wq.dims(),
        wk.dims()
    );
    let dtype = qkv.dtype();
    if cx.fused::<B>(dtype) && wq.dtype() == dtype && wk.dtype() == dtype {
        float(B::qk_norm(prim(qkv), prim(wq), prim(wk), heads, eps, cx))
    } else {
        reference(qkv, wq, wk, heads, eps)
    }
}

/// Whether the kernels take these tensors: f32, rows of `(H + 2K)·Dh`, weights of `Dh`, and at
/// least one head.
fn kernel_fits(qkv: &FlexTensor, wq: &FlexTensor, wk: &FlexTensor, (h, k, dh): QkvHeads) -> bool {
    let shape = flex::shape(qkv);
    flex::all_f32(&[qkv, wq, wk])
        && dh > 0
        && h + k > 0
        && shape.len() == 2
        && shape[1] == (h + 2 * k) * dh
        && flex::shape(wq) == [dh]
        && flex::shape(wk) == [dh]
}

impl QkNormOps for Flex {
    fn qk_norm(qkv: FlexTensor, wq: FlexTensor, wk: FlexTensor, heads: QkvHeads, eps: f64, cx: Compute) -> FlexTensor {
        if !kernel_fits(&qkv, &wq, &wk, heads) {
            return prim(reference(float::<Self, 2>(qkv), float(wq), float(wk), heads, eps));
        }
        let shape = flex::shape(&qkv);
        let (qkv, wq, wk) = (flex::f32s(&qkv), flex::f32s(&wq), flex::f32s(&wk));
        flex::tensor(kernel::qk_norm(cx.elementwise_cpu(), &qkv, &wq, &wk, (heads.0, heads.1), eps as f32), shape)
    }

    fn qk_norm_backward(
        qkv: FlexTensor,
        wq: FlexTensor,
        wk: FlexTensor,
        dy: FlexTensor,
        heads: QkvHeads,
        eps: f64,
        cx: Compute,
    ) -> QkNormGrads<Self> {
        let shape = flex::shape(&qkv);
        if !kernel_fits(&qkv, &wq, &wk, heads) || !flex::all_f32(&[&dy]) || flex::shape(&dy) != shape {
            let (dqkv, dwq, dwk) =
                reference_backward(float::<Self, 2>(qkv), float(wq), float(wk), float(dy), heads, eps);
            return (prim(dqkv), prim(dwq), prim(dwk));
        }
        let (x, wq, wk, dy) = (flex::f32s(&qkv), flex::f32s(&wq), flex::f32s(&wk), flex::f32s(&dy));
        let cpu = cx.elementwise_cpu();
        let (dqkv, dwq, dwk) = kernel::qk_norm_backward(cpu, &x, &wq, &wk, &dy, (heads.0, heads.1), eps as f32);
        (flex::tensor(dqkv, shape), flex::tensor(dwq, vec![heads.2]), flex::tensor(dwk, vec![heads.2]))
    }
}

/// One graph node whose backward is the inner backend's.
impl<B: EmberBackend, C: CheckpointStrategy> QkNormOps for Autodiff<B, C> {
    fn qk_norm(
        qkv: FloatTensor<Self>,
        wq: FloatTensor<Self>,
        wk: FloatTensor<Self>,
        heads: QkvHeads,
        eps: f64,
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct QkNormBackward;
        impl<B: EmberBackend> Backward<B, 3> for QkNormBackward {
            type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, QkvHeads, f64, Compute);
            fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
                let dy = grads.consume::<B>(&ops.node);
                let (qkv, wq, wk, heads, eps, cx) = ops.state;
                let (dqkv, dwq, dwk) = B::qk_norm_backward(qkv, wq, wk, dy, heads, eps, cx);
                for (node, grad) in ops.parents.into_iter().zip([dqkv, dwq, dwk]) {
                    if let Some(n) = node {
                        grads.register::<B>(n.id, grad);
                    }
                }
            }
        }
        let parents = [qkv.node.clone(), wq.node.clone(), wk.node.clone()];
        match QkNormBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::qk_norm(qkv.primitive.clone(), wq.primitive.clone(), wk.primitive.clone(), heads, eps, cx);
                prep.finish((qkv.primitive, wq.primitive, wk.primitive, heads, eps, cx), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::qk_norm(qkv.primitive, wq.primitive, wk.primitive, heads, eps, cx))
            }
        }
    }
}

/// The CPU kernels, on f32 slices. A head's norm is RMSNorm's row, `rms_norm` in `kernels`.
mod kernel {
    use rayon::prelude::*;

    use crate::compute::Cpu;
    use crate::kernels::{lanes_dot, lanes_sum_by, rows_per_task};
    use crate::simd::multiversion;

    /// The row width and which weight each head of a row takes (`None`: a v head, copied).
    #[inline(always)]
    fn layout<'w>(
        wq: &'w [f32],
        wk: &'w [f32],
        (h, k): (usize, usize),
        len: usize,
    ) -> (usize, impl Fn(usize) -> Option<&'w [f32]>) {
        let dh = wq.len();
        let width = (h + 2 * k) * dh;
        assert!(
            width > 0 && wk.len() == dh && len.is_multiple_of(width),
            "qk_norm: {len} values in rows of ({h} + 2·{k})·{dh}"
        );
        (width, move |i: usize| {
            if i < h {
                Some(wq)
            } else if i < h + k {
                Some(wk)
            } else {
                None
            }
        })
    }

    multiversion! {
        /// Each q head of every row RMS-normalised with `wq`, each k head with `wk`, each v head copied.
        ///
        /// # Shapes
        /// - qkv: `[N, (H + 2K)·Dh]`, wq, wk: `[Dh]` -> `[N, (H + 2K)·Dh]`
        pub(super) fn qk_norm(cpu: Cpu, qkv: &[f32], wq: &[f32], wk: &[f32], heads: (usize, usize), eps: f32) -> Vec<f32> {
            let (width, weight) = layout(wq, wk, heads, qkv.len());
            let dh = wq.len();
            let mut y = Box::<[f32]>::new_uninit_slice(qkv.len());
            let chunk = rows_per_task(width) * width;
            y.par_chunks_mut(chunk).zip(qkv.par_chunks(chunk)).for_each(|(y, x)| {
                for (i, (yh, xh)) in y.chunks_exact_mut(dh).zip(x.chunks_exact(dh)).enumerate() {
                    match weight(i % (width / dh)) {
                        Some(w) => {
                            let inv = 1.0 / (lanes_dot(xh, xh) / dh as f32 + eps).sqrt();
                            for ((o, &v), &g) in yh.iter_mut().zip(xh).zip(w) {
                                o.write(v * inv * g);
                            }
                        }
                        None => {
                            for (o, &v) in yh.iter_mut().zip(xh) {
                                o.write(v);
                            }
                        }
                    }
                }
            });
            // SAFETY: qkv is whole rows of whole heads (asserted): every head of y was written above.
            unsafe { y.assume_init() }.into_vec()
        }
    }

    multiversion! {
        /// Gradients of [`qk_norm`]: for a normalised head, with `r = 1/sqrt(mean(x²) + eps)` and
        /// `x̂ = x·r`, `dx = r·(dy·w − x̂·mean(dy·w·x̂))` and `dw += dy·x̂` (summed over the rows and
        /// over the heads that share the weight); for a v head, `dx = dy`.
        pub(super) fn qk_norm_backward(
            cpu: Cpu,
            qkv: &[f32],
            wq: &[f32],
            wk: &[f32],
            dy: &[f32],
            heads: (usize, usize),
            eps: f32,
        ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let (width, weight) = layout(wq, wk, heads, qkv.len());
            assert_eq!(dy.len(), qkv.len(), "qk_norm_backward: values and gradients");
            let (dh, q_heads) = (wq.len(), heads.0);
            let mut dx = Box::<[f32]>::new_uninit_slice(qkv.len());
            let chunk = rows_per_task(width) * width;
            let (dwq, dwk) = dx
                .par_chunks_mut(chunk)
                .zip(qkv.par_chunks(chunk).zip(dy.par_chunks(chunk)))
                .map(|(dx, (x, dy))| {
                    let (mut dwq, mut dwk) = (vec![0.0f32; dh], vec![0.0f32; dh]);
                    let all = dx.chunks_exact_mut(dh).zip(x.chunks_exact(dh)).zip(dy.chunks_exact(dh));
                    for (i, ((dxh, xh), dyh)) in all.enumerate() {
                        let head = i % (width / dh);
                        let Some(w) = weight(head) else {
                            for (o, &g) in dxh.iter_mut().zip(dyh) {
                                o.write(g);
                            }
                            continue;
                        };
                        let dw = if head < q_heads { &mut dwq } else { &mut dwk };
                        let r = 1.0 / (lanes_dot(xh, xh) / dh as f32 + eps).sqrt();
                        let mean = r * lanes_sum_by(dh, |j| dyh[j] * w[j] * xh[j]) / dh as f32;
                        for j in 0..dh {
                            dw[j] += dyh[j] * (xh[j] * r);
                            dxh[j].write(r * (dyh[j] * w[j] - xh[j] * r * mean));
                        }
                    }
                    (dwq, dwk)
                })
                .collect::<Vec<_>>()
                // Summed in chunk order, on one thread: the result does not depend on scheduling.
                .into_iter()
                .fold((vec![0.0f32; dh], vec![0.0f32; dh]), |(mut aq, mut ak), (q, k)| {
                    aq.iter_mut().zip(&q).for_each(|(a, b)| *a += b);
                    ak.iter_mut().zip(&k).for_each(|(a, b)| *a += b);
                    (aq, ak)
                });
            // SAFETY: qkv and dy are whole rows of whole heads (asserted): every head of dx was written.
            (unsafe { dx.assume_init() }.into_vec(), dwq, dwk)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf, same_bits_on_every_tier, values};

    /// Grouped-query (3 q heads to 1 k/v head), multi-head, and one head each.
    const SHAPES: [QkvHeads; 3] = [(3, 1, 8), (4, 4, 16), (1, 1, 5)];

    #[test]
    fn fused_qk_norm_equals_the_composition() {
        for heads @ (h, k, dh) in SHAPES {
            // 300 rows: several rayon tasks, whose dwq and dwk are summed.
            for n in [1, 7, 300] {
                let width = (h + 2 * k) * dh;
                let inputs = vec![leaf([n, width], 1), leaf([1, dh], 2), leaf([1, dh], 3)];
                compare(&format!("qk_norm {n} rows of {heads:?}"), inputs, [n, width], &|xs, fused| {
                    let (wq, wk) = (xs[1].clone().reshape([dh]), xs[2].clone().reshape([dh]));
                    if fused {
                        qk_norm_packed(xs[0].clone(), wq, wk, heads, 1e-6, Compute::default())
                    } else {
                        reference(xs[0].clone(), wq, wk, heads, 1e-6)
                    }
                });
            }
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        for heads @ (h, k, dh) in SHAPES {
            let n = 9;
            let (qkv, dy) = (leaf([n, (h + 2 * k) * dh], 1), leaf([n, (h + 2 * k) * dh], 4));
            let (wq, wk) = (leaf([1, dh], 2).reshape([dh]), leaf([1, dh], 3).reshape([dh]));
            let (dqkv, dwq, dwk) = Flex::qk_norm_backward(
                prim(qkv.clone()),
                prim(wq.clone()),
                prim(wk.clone()),
                prim(dy.clone()),
                heads,
                1e-6,
                Compute::default(),
            );
            let (want, want_q, want_k) = reference_backward(qkv, wq, wk, dy, heads, 1e-6);
            let row = |t: FloatTensor<Flex>| float::<Flex, 1>(t).unsqueeze();
            assert_close(
                &format!("qk_norm {heads:?}"),
                vec![float(dqkv), row(dwq), row(dwk)],
                vec![want, want_q.unsqueeze(), want_k.unsqueeze()],
            );
        }
    }

    /// The kernels against the formulas written out in f64, head by head: `y = x/rms(x)·w` for q and
    /// k heads, `y = x` for v; the gradients of `Σ y·dy`.
    #[test]
    fn kernels_match_the_formulas() {
        let ((h, k, dh), n, eps) = ((3, 1, 6), 4, 1e-6);
        let width = (h + 2 * k) * dh;
        let (x, wq, wk, dy) = (values(n * width, 1), values(dh, 2), values(dh, 3), values(n * width, 4));
        let cpu = Compute::default().elementwise_cpu();
        let y = kernel::qk_norm(cpu, &x, &wq, &wk, (h, k), eps);
        let (dx, dwq, dwk) = kernel::qk_norm_backward(cpu, &x, &wq, &wk, &dy, (h, k), eps);
        let (mut want_dwq, mut want_dwk) = (vec![0.0f64; dh], vec![0.0f64; dh]);
        for r in 0..n {
            for head in 0..h + 2 * k {
                let at = r * width + head * dh;
                let (xh, gh) = (&x[at..at + dh], &dy[at..at + dh]);
                let Some((w, dw)) = (match head {
                    _ if head < h => Some((&wq, &mut want_dwq)),
                    _ if head < h + k => Some((&wk, &mut want_dwk)),
                    _ => None,
                }) else {
                    assert_eq!((&y[at..at + dh], &dx[at..at + dh]), (xh, gh), "v head {head} of row {r}");
                    continue;
                };
                let ms = xh.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dh as f64;
                let rr = 1.0 / (ms + eps as f64).sqrt();
                // d(x_k·r)/dx_j = r·δ_kj − x_k·x_j·r³/Dh
                for j in 0..dh {
                    let want = xh[j] as f64 * rr * w[j] as f64;
                    assert!((y[at + j] as f64 - want).abs() < 1e-5, "y at {}", at + j);
                    let want_dx: f64 = (0..dh)
                        .map(|c| {
                            let delta = if c == j { rr } else { 0.0 };
                            gh[c] as f64 * w[c] as f64 * (delta - xh[c] as f64 * xh[j] as f64 * rr.powi(3) / dh as f64)
                        })
                        .sum();
                    assert!(
                        (dx[at + j] as f64 - want_dx).abs() < 1e-5,
                        "dx at {}: {} vs {want_dx}",
                        at + j,
                        dx[at + j]
                    );
                    dw[j] += gh[j] as f64 * xh[j] as f64 * rr;
                }
            }
        }
        for j in 0..dh {
            assert!(
                (dwq[j] as f64 - want_dwq[j]).abs() < 1e-5 && (dwk[j] as f64 - want_dwk[j]).abs() < 1e-5,
                "dw [{j}]"
            );
        }
    }

    #[test]
    fn every_copy_of_the_qk_norm_kernels_gives_the_same_bits() {
        let ((h, k, dh), n) = ((6, 2, 24), 300);
        let width = (h + 2 * k) * dh;
        let (x, wq, wk, dy) = (values(n * width, 5), values(dh, 6), values(dh, 7), values(n * width, 8));
        same_bits_on_every_tier("qk_norm", |cpu| {
            let (dx, dwq, dwk) = kernel::qk_norm_backward(cpu, &x, &wq, &wk, &dy, (h, k), 1e-6);
            vec![kernel::qk_norm(cpu, &x, &wq, &wk, (h, k), 1e-6), dx, dwq, dwk]
        });
    }
}
