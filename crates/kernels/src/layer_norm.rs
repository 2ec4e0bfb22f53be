//! LayerNorm (Ba et al., 2016): `y = (x − mean(x)) / sqrt(var(x) + eps) · w + b`, row by row, the
//! variance biased (divided by D) as PyTorch's; the bias optional (GPT-2 has one, nanoGPT's
//! `bias=False` none).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::compute::Compute;
use crate::{flex, float, prim, reference_grads_of, to_dtype, EmberBackend};

/// The gradients of x, w and, with a bias, b.
pub type LayerNormGrads<B> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>);

/// A backend's LayerNorm; the default methods are the reference.
pub trait LayerNormOps: Backend {
    /// # Shapes
    /// - x: `[N, D]`, w: `[D]`, b: `[D]` -> `[N, D]`
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        eps: f64,
        _cx: Compute,
    ) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(x), float(w), b.map(float), eps))
    }

    /// Gradients of x, w and (where `bias`: the forward pass had one) b given the output gradient.
    fn layer_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        bias: bool,
        eps: f64,
        _cx: Compute,
    ) -> LayerNormGrads<Self> {
        let (dx, dw, db) = reference_backward(float::<Self, 2>(x), float(w), float(dy), bias, eps);
        (prim(dx), prim(dw), db.map(prim))
    }
}

/// The composition: the reference, and the path of backends without a kernel. Computed in f32
/// whatever the input dtype, the affine part too, and then cast, as PyTorch's `layer_norm` kernels
/// do (a bf16 mean of D values loses digits as D grows).
///
/// # Shapes
/// - x: `[N, D]`, w: `[D]`, b: `[D]` -> `[N, D]`
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 1>, b: Option<Tensor<B, 1>>, eps: f64) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let x = to_dtype(x, DType::F32);
    let centred = x.clone() - x.mean_dim(1); // [N, D]
    let inv_std = centred.clone().square().mean_dim(1).add_scalar(eps).sqrt().recip(); // [N, 1]
    let y = centred * inv_std * to_dtype(w, DType::F32).unsqueeze::<2>();
    let y = match b {
        Some(b) => y + to_dtype(b, DType::F32).unsqueeze(),
        None => y,
    };
    to_dtype(y, dtype)
}

/// The reference's gradients (of x `[N, D]`, w `[D]` and, where `bias`, b `[D]`), through Burn's
/// autodiff. The bias's value changes none of them.
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 1>,
    dy: Tensor<B, 2>,
    bias: bool,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 1>, Option<Tensor<B, 1>>) {
    let d = w.dims()[0];
    let mut inputs = vec![x, w.reshape([1, d])];
    if bias {
        inputs.push(Tensor::zeros([1, d], &inputs[0].device()));
    }
    let mut grads = reference_grads_of(inputs, dy, |xs| {
        let b = xs.get(2).map(|b| b.clone().reshape([d]));
        reference(xs[0].clone(), xs[1].clone().reshape([d]), b, eps)
    })
    .into_iter();
    let (dx, dw) = (grads.next().expect("dx"), grads.next().expect("dw"));
    (dx, dw.reshape([d]), grads.next().map(|db| db.reshape([d])))
}

/// LayerNorm as one op where the backend runs it faster so, else the composition.
///
/// # Shapes
/// - x: `[N, D]`, w: `[D]`, b: `[D]` -> `[N, D]`
pub fn layer_norm<B: EmberBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 1>,
    b: Option<Tensor<B, 1>>,
    eps: f64,
    cx: Compute,
) -> Tensor<B, 2> {
    let dtype = x.dtype();
    if cx.fused::<B>(dtype) && w.dtype() == dtype && b.as_ref().is_none_or(|b| b.dtype() == dtype) {
        float(B::layer_norm_forward(prim(x), prim(w), b.map(prim), eps, cx))
    } else {
        reference(x, w, b, eps)
    }
}

impl LayerNormOps for Flex {
    fn layer_norm_forward(x: FlexTensor, w: FlexTensor, b: Option<FlexTensor>, eps: f64, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&x);
        let fits = |t: &FlexTensor| flex::all_f32(&[t]) && flex::shape(t) == [shape[1]];
        if !flex::all_f32(&[&x]) || !fits(&w) || !b.as_ref().is_none_or(fits) {
            return prim(reference(float::<Self, 2>(x), float(w), b.map(float), eps));
        }
        let b = b.as_ref().map(flex::f32s);
        let y = kernel::layer_norm(cx.elementwise_cpu(), &flex::f32s(&x), &flex::f32s(&w), b.as_deref(), eps as f32);
        flex::tensor(y, shape)
    }

    fn layer_norm_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        bias: bool,
        eps: f64,
        cx: Compute,
    ) -> LayerNormGrads<Self> {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        if !flex::all_f32(&[&x, &w, &dy]) || ws != [xs[1]] || flex::shape(&dy) != xs {
            let (dx, dw, db) = reference_backward(float::<Self, 2>(x), float(w), float(dy), bias, eps);
            return (prim(dx), prim(dw), db.map(prim));
        }
        let (dx, dw, db) = kernel::layer_norm_backward(
            cx.elementwise_cpu(),
            &flex::f32s(&x),
            &flex::f32s(&w),
            &flex::f32s(&dy),
            eps as f32,
        );
        (flex::tensor(dx, xs), flex::tensor(dw, ws.clone()), bias.then(|| flex::tensor(db, ws)))
    }
}

/// One graph node whose backward is the inner backend's; the bias, when there is one, is its third
/// parent.
impl<B: EmberBackend, C: CheckpointStrategy> LayerNormOps for Autodiff<B, C> {
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        eps: f64,
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LayerNormBackward<const N: usize>;
        impl<B: EmberBackend, const N: usize> Backward<B, N> for LayerNormBackward<N> {
            type State = (FloatTensor<B>, FloatTensor<B>, f64, Compute);
            fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
                let node = |i: usize| ops.parents.get(i).cloned().flatten();
                let dy = grads.consume::<B>(&ops.node);
                let (x, w, eps, cx) = ops.state;
                let (dx, dw, db) = B::layer_norm_backward(x, w, dy, N == 3, eps, cx);
                for (node, grad) in [(node(0), Some(dx)), (node(1), Some(dw)), (node(2), db)] {
                    if let (Some(n), Some(g)) = (node, grad) {
                        grads.register::<B>(n.id, g);
                    }
                }
            }
        }
        // One node type per parent count.
        macro_rules! node {
            ($n:literal, [$($parent:expr),+], $b:expr) => {
                match LayerNormBackward::<$n>.prepare::<C>([$($parent.node.clone()),+]).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let y = B::layer_norm_forward(x.primitive.clone(), w.primitive.clone(), $b, eps, cx);
                        prep.finish((x.primitive, w.primitive, eps, cx), y)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::layer_norm_forward(x.primitive, w.primitive, $b, eps, cx)),
                }
            };
        }
        match b {
            Some(b) => node!(3, [x, w, b], Some(b.primitive)),
            None => node!(2, [x, w], None),
        }
    }
}

/// The CPU kernels, on f32 slices.
mod kernel {
    use rayon::prelude::*;

    use crate::compute::Cpu;
    use crate::kernels::{lanes_sum, lanes_sum_by, rows_per_task};
    use crate::simd::multiversion;

    /// A row's mean and `1/sqrt(var + eps)`: the variance from the centred values (two passes), not
    /// `mean(x²) − mean²`, which cancels where the mean is large against the spread.
    #[inline(always)]
    fn moments(x: &[f32], eps: f32) -> (f32, f32) {
        let d = x.len() as f32;
        let mean = lanes_sum(x) / d;
        let var = lanes_sum_by(x.len(), |j| (x[j] - mean) * (x[j] - mean)) / d;
        (mean, 1.0 / (var + eps).sqrt())
    }

    multiversion! {
        /// `y = (x − mean)·r·w + b`, `r = 1/sqrt(var + eps)`, row by row.
        ///
        /// # Shapes
        /// - x: `[N, D]`, w: `[D]`, b: `[D]` -> `[N, D]`
        pub(super) fn layer_norm(cpu: Cpu, x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32) -> Vec<f32> {
            let d = w.len();
            assert!(
                d > 0 && x.len().is_multiple_of(d) && b.is_none_or(|b| b.len() == d),
                "layer_norm: {} values in rows of {d}",
                x.len()
            );
            let mut y = Box::<[f32]>::new_uninit_slice(x.len());
            let chunk = rows_per_task(d) * d;
            y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(y, x)| {
                for (yr, xr) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                    let (mean, r) = moments(xr, eps);
                    match b {
                        Some(b) => {
                            for (((o, &v), &g), &c) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                                o.write((v - mean) * r * g + c);
                            }
                        }
                        None => {
                            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                                o.write((v - mean) * r * g);
                            }
                        }
                    }
                }
            });
            // SAFETY: x is whole rows of d (asserted), so the chunks above cover y and write every element.
            unsafe { y.assume_init() }.into_vec()
        }
    }

    multiversion! {
        /// Gradients of [`layer_norm`]: with `x̂ = (x − mean)·r` and `g = dy·w`,
        /// `dx = r·(g − mean(g) − x̂·mean(g·x̂))`, `dw = Σ_rows dy·x̂` and `db = Σ_rows dy`.
        pub(super) fn layer_norm_backward(cpu: Cpu, x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let d = w.len();
            assert!(
                d > 0 && x.len().is_multiple_of(d) && dy.len() == x.len(),
                "layer_norm_backward: {} values and {} gradients in rows of {d}",
                x.len(),
                dy.len()
            );
            let mut dx = Box::<[f32]>::new_uninit_slice(x.len());
            let chunk = rows_per_task(d) * d;
            let (dw, db) = dx
                .par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk).zip(dy.par_chunks(chunk)))
                .map(|(dx, (x, dy))| {
                    let (mut dw, mut db) = (vec![0.0f32; d], vec![0.0f32; d]);
                    for ((dxr, xr), dyr) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(dy.chunks_exact(d)) {
                        let (mean, r) = moments(xr, eps);
                        let mean_g = lanes_sum_by(d, |j| dyr[j] * w[j]) / d as f32;
                        let mean_gx = r * lanes_sum_by(d, |j| dyr[j] * w[j] * (xr[j] - mean)) / d as f32;
                        for j in 0..d {
                            let xh = (xr[j] - mean) * r;
                            dw[j] += dyr[j] * xh;
                            db[j] += dyr[j];
                            dxr[j].write(r * (dyr[j] * w[j] - mean_g - xh * mean_gx));
                        }
                    }
                    (dw, db)
                })
                .collect::<Vec<_>>()
                // Summed in chunk order, on one thread: the result does not depend on scheduling.
                .into_iter()
                .fold((vec![0.0f32; d], vec![0.0f32; d]), |(mut dw, mut db), (w, b)| {
                    dw.iter_mut().zip(&w).for_each(|(a, b)| *a += b);
                    db.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    (dw, db)
                });
            // SAFETY: x and dy are whole rows of d (asserted): every row of dx was written above.
            (unsafe { dx.assume_init() }.into_vec(), dw, db)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf, same_bits_on_every_tier, values};

    #[test]
    fn fused_layer_norm_equals_the_composition() {
        for bias in [true, false] {
            // 300 rows of 128: three rayon tasks, whose dw and db are summed.
            for (n, d) in [(1, 8), (7, 13), (300, 128)] {
                // A mean far from zero, as residual streams have.
                let x = leaf([n, d], 1).add_scalar(3.0);
                let mut inputs = vec![x, leaf([1, d], 2)];
                if bias {
                    inputs.push(leaf([1, d], 3));
                }
                compare(&format!("layer_norm {n}x{d}, bias {bias}"), inputs, [n, d], &|xs, fused| {
                    let w = xs[1].clone().reshape([d]);
                    let b = xs.get(2).map(|b| b.clone().reshape([d]));
                    if fused {
                        layer_norm(xs[0].clone(), w, b, 1e-5, Compute::default())
                    } else {
                        reference(xs[0].clone(), w, b, 1e-5)
                    }
                });
            }
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        let (n, d) = (9, 24);
        let (x, w, dy) = (leaf([n, d], 1), leaf([1, d], 2).reshape([d]), leaf([n, d], 3));
        for bias in [true, false] {
            let (dx, dw, db) = Flex::layer_norm_backward(
                prim(x.clone()),
                prim(w.clone()),
                prim(dy.clone()),
                bias,
                1e-5,
                Compute::default(),
            );
            assert_eq!(db.is_some(), bias);
            let (want_dx, want_dw, want_db) = reference_backward(x.clone(), w.clone(), dy.clone(), bias, 1e-5);
            let mut got = vec![float(dx), float::<Flex, 1>(dw).unsqueeze()];
            let mut want = vec![want_dx, want_dw.unsqueeze()];
            got.extend(db.map(|db| float::<Flex, 1>(db).unsqueeze()));
            want.extend(want_db.map(|db| db.unsqueeze()));
            assert_close(&format!("layer_norm, bias {bias}"), got, want);
        }
    }

    /// The kernels against the formulas written out in f64: `y = (x − μ)/σ·w + b` and the gradients
    /// of `Σ y·dy`, `dx_j = Σ_k dy_k·w_k·∂x̂_k/∂x_j` with `∂x̂_k/∂x_j = (δ_kj − 1/D − x̂_k·x̂_j/D)/σ`.
    #[test]
    fn kernels_match_the_formulas() {
        let (n, d, eps) = (5, 19, 1e-5);
        let x: Vec<f32> = values(n * d, 1).iter().map(|v| v * 2.0 + 1.5).collect();
        let (w, b, dy) = (values(d, 2), values(d, 3), values(n * d, 4));
        let cpu = Compute::default().elementwise_cpu();
        let y = kernel::layer_norm(cpu, &x, &w, Some(&b), eps);
        let y_nob = kernel::layer_norm(cpu, &x, &w, None, eps);
        let (dx, dw, db) = kernel::layer_norm_backward(cpu, &x, &w, &dy, eps);
        let (mut want_dw, mut want_db) = (vec![0.0f64; d], vec![0.0f64; d]);
        for r in 0..n {
            let xr: Vec<f64> = x[r * d..][..d].iter().map(|&v| v as f64).collect();
            let mean = xr.iter().sum::<f64>() / d as f64;
            let sigma = (xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64 + eps as f64).sqrt();
            let xh: Vec<f64> = xr.iter().map(|v| (v - mean) / sigma).collect();
            for j in 0..d {
                let i = r * d + j;
                let want = xh[j] * w[j] as f64;
                assert!((y[i] as f64 - want - b[j] as f64).abs() < 1e-5, "y[{i}]");
                assert!((y_nob[i] as f64 - want).abs() < 1e-5, "y without a bias [{i}]");
                let want_dx: f64 = (0..d)
                    .map(|k| {
                        let delta = if k == j { 1.0 } else { 0.0 };
                        dy[r * d + k] as f64 * w[k] as f64 * (delta - 1.0 / d as f64 - xh[k] * xh[j] / d as f64) / sigma
                    })
                    .sum();
                assert!((dx[i] as f64 - want_dx).abs() < 1e-5, "dx[{i}]: {} vs {want_dx}", dx[i]);
                want_dw[j] += dy[i] as f64 * xh[j];
                want_db[j] += dy[i] as f64;
            }
        }
        for j in 0..d {
            assert!(
                (dw[j] as f64 - want_dw[j]).abs() < 1e-5 && (db[j] as f64 - want_db[j]).abs() < 1e-5,
                "dw, db [{j}]"
            );
        }
    }

    #[test]
    fn every_copy_of_the_layer_norm_kernels_gives_the_same_bits() {
        let d = 200;
        let (x, w, b, dy) = (values(300 * d, 5), values(d, 6), values(d, 7), values(300 * d, 8));
        same_bits_on_every_tier("layer_norm", |cpu| {
            let (dx, dw, db) = kernel::layer_norm_backward(cpu, &x, &w, &dy, 1e-5);
            vec![
                kernel::layer_norm(cpu, &x, &w, Some(&b), 1e-5),
                kernel::layer_norm(cpu, &x, &w, None, 1e-5),
                dx,
                dw,
                db,
            ]
        });
    }
}
