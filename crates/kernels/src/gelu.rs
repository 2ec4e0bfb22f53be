//! GELU (Hendrycks & Gimpel, 2016): `x · Φ(x)`, element by element, exact or with the tanh
//! approximation, each as PyTorch computes it.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

use crate::activation::{exp, gelu_tanh, gelu_tanh_grad, CUBIC, SQRT_2_OVER_PI};
use crate::compute::Compute;

use crate::{flex, float, prim, reference_grads, EmberBackend};

/// Which GELU. The two differ by up to 5e-4 (near x = ±2), enough that a checkpoint should run
/// with the one it was trained with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gelu {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`: GPT-2's own, Hugging Face's `gelu_new` and
    /// `gelu_pytorch_tanh` (Gemma), PyTorch's `GELU(approximate='tanh')`.
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))`: PyTorch's `nn.GELU()` default, nanoGPT's MLP.
    Erf,
}

/// A backend's GELU; the default methods are the reference.
pub trait GeluOps: Backend {
    /// # Shapes
    /// - x: `[N, D]` -> `[N, D]`
    fn gelu_with(x: FloatTensor<Self>, approx: Gelu, _cx: Compute) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(x), approx))
    }

    /// Gradient of x given the output gradient.
    fn gelu_with_backward(
        x: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        approx: Gelu,
        _cx: Compute,
    ) -> FloatTensor<Self> {
        prim(reference_backward(float::<Self, 2>(x), float(dy), approx))
    }
}

/// The composition: the reference, and the path of backends without a kernel. PyTorch's formulas
/// written out rather than Burn's `activation::gelu`, whose backward pass is the tanh
/// approximation's derivative on backends that keep Burn's default (NdArray, the GPUs): `erf`'s own
/// derivative is exact everywhere.
///
/// # Shapes
/// - x: `[N, D]` -> `[N, D]`
pub fn reference<B: Backend>(x: Tensor<B, 2>, approx: Gelu) -> Tensor<B, 2> {
    let phi = match approx {
        Gelu::Tanh => (x.clone() + x.clone().powi_scalar(3).mul_scalar(CUBIC)).mul_scalar(SQRT_2_OVER_PI).tanh(),
        Gelu::Erf => x.clone().mul_scalar(std::f64::consts::FRAC_1_SQRT_2).erf(),
    };
    x.mul_scalar(0.5) * phi.add_scalar(1.0)
}

/// The reference's gradient, through Burn's autodiff.
pub fn reference_backward<B: Backend>(x: Tensor<B, 2>, dy: Tensor<B, 2>, approx: Gelu) -> Tensor<B, 2> {
    let [dx] = reference_grads([x], dy, |[x]| reference(x, approx));
    dx
}

/// GELU as one op where the backend runs it faster so, else the composition.
///
/// # Shapes
/// - x: `[N, D]` -> `[N, D]`
pub fn gelu<B: EmberBackend>(x: Tensor<B, 2>, approx: Gelu, cx: Compute) -> Tensor<B, 2> {
    if cx.fused::<B>(x.dtype()) {
        float(B::gelu_with(prim(x), approx, cx))
    } else {
        reference(x, approx)
    }
}

impl GeluOps for Flex {
    fn gelu_with(x: FlexTensor, approx: Gelu, cx: Compute) -> FlexTensor {
        if !flex::all_f32(&[&x]) {
            return prim(reference(float::<Self, 2>(x), approx));
        }
        let shape = flex::shape(&x);
        flex::tensor(kernel::gelu(cx.elementwise_cpu(), &flex::f32s(&x), approx), shape)
    }

    fn gelu_with_backward(x: FlexTensor, dy: FlexTensor, approx: Gelu, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&x);
        if !flex::all_f32(&[&x, &dy]) || flex::shape(&dy) != shape {
            return prim(reference_backward(float::<Self, 2>(x), float(dy), approx));
        }
        flex::tensor(kernel::gelu_backward(cx.elementwise_cpu(), &flex::f32s(&x), &flex::f32s(&dy), approx), shape)
    }
}

/// One graph node whose backward is the inner backend's.
impl<B: EmberBackend, C: CheckpointStrategy> GeluOps for Autodiff<B, C> {
    fn gelu_with(x: FloatTensor<Self>, approx: Gelu, cx: Compute) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GeluBackward;
        impl<B: EmberBackend> Backward<B, 1> for GeluBackward {
            type State = (FloatTensor<B>, Gelu, Compute);
            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, approx, cx) = ops.state;
                if let Some(n) = node {
                    grads.register::<B>(n.id, B::gelu_with_backward(x, dy, approx, cx));
                }
            }
        }
        match GeluBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::gelu_with(x.primitive.clone(), approx, cx);
                prep.finish((x.primitive, approx, cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_with(x.primitive, approx, cx)),
        }
    }
}

/// Eigen's rational approximation of `erf` on `[-4, 4]` (`generic_fast_erf_float`, the one XLA and
/// TVM lower f32 `erf` to): `erf(x) ≈ x·P(x²)/Q(x²)`, coefficients highest power first, as
/// published (f64 digits, rounded to f32 where used).
const ERF_P: [f64; 7] = [
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
];
const ERF_Q: [f64; 5] =
    [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03, -1.42647390514189e-02];

/// `erf(x)` in f32 without a libm call, so that loops over it vectorise ([`ERF_P`]): within 5e-7
/// of the f64 `erf` (test below; 4.4e-7 at |x| ≈ 3.2, where f32's spacing below 1 is 6e-8).
/// PyTorch's vectorised CPU `erf` (Abramowitz & Stegun 7.1.26 in f32) errs by as much, 5e-7 near
/// 0. Outside `[-4, 4]` erf is ±1 in f32. Plain multiply-adds, as in [`exp`]. NaN stays NaN.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = ERF_P[0] as f32;
    for &c in &ERF_P[1..] {
        p = p * x2 + c as f32;
    }
    let mut q = ERF_Q[0] as f32;
    for &c in &ERF_Q[1..] {
        q = q * x2 + c as f32;
    }
    (x * p / q).clamp(-1.0, 1.0)
}

/// The exact GELU, `0.5·x·(1 + erf(x/√2))`.
#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `d gelu_erf / dx = Φ(x) + x·φ(x)`, `φ(x) = e^(−x²/2)/√(2π)`.
#[inline(always)]
fn gelu_erf_grad(x: f32) -> f32 {
    let inv_sqrt_2pi = (0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
    0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)) + x * inv_sqrt_2pi * exp(-0.5 * (x * x))
}

/// The CPU kernels, on f32 slices.
mod kernel {
    use rayon::prelude::*;

    use super::{gelu_erf, gelu_erf_grad, gelu_tanh, gelu_tanh_grad, Gelu};
    use crate::compute::Cpu;
    use crate::simd::multiversion;

    /// Elements per rayon task.
    const CHUNK: usize = 1 << 14;

    multiversion! {
        /// `gelu(x)`, element by element.
        pub(super) fn gelu(cpu: Cpu, x: &[f32], approx: Gelu) -> Vec<f32> {
            let mut y = Box::<[f32]>::new_uninit_slice(x.len());
            y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(y, x)| match approx {
                Gelu::Tanh => y.iter_mut().zip(x).for_each(|(y, &v)| {
                    y.write(gelu_tanh(v));
                }),
                Gelu::Erf => y.iter_mut().zip(x).for_each(|(y, &v)| {
                    y.write(gelu_erf(v));
                }),
            });
            // SAFETY: the chunks of y pair with those of x, as long: every element was written.
            unsafe { y.assume_init() }.into_vec()
        }
    }

    multiversion! {
        /// `dy · gelu'(x)`, element by element.
        pub(super) fn gelu_backward(cpu: Cpu, x: &[f32], dy: &[f32], approx: Gelu) -> Vec<f32> {
            assert_eq!(x.len(), dy.len(), "gelu_backward: values and gradients");
            let mut dx = Box::<[f32]>::new_uninit_slice(x.len());
            dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK))).for_each(|(dx, (x, dy))| {
                match approx {
                    Gelu::Tanh => dx.iter_mut().zip(x.iter().zip(dy)).for_each(|(d, (&v, &g))| {
                        d.write(g * gelu_tanh_grad(v));
                    }),
                    Gelu::Erf => dx.iter_mut().zip(x.iter().zip(dy)).for_each(|(d, (&v, &g))| {
                        d.write(g * gelu_erf_grad(v));
                    }),
                }
            });
            // SAFETY: x and dy are as long (asserted), their chunks pair with dx's: every element written.
            unsafe { dx.assume_init() }.into_vec()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf, same_bits_on_every_tier, values};

    #[test]
    fn fused_gelu_equals_the_composition() {
        for approx in [Gelu::Tanh, Gelu::Erf] {
            for (n, d) in [(1, 5), (9, 31), (64, 344)] {
                // Spread to ±6 so that both tails are reached.
                let x = leaf([n, d], 4).mul_scalar(3.0);
                compare(&format!("gelu {approx:?} {n}x{d}"), vec![x], [n, d], &|xs, fused| {
                    if fused {
                        gelu(xs[0].clone(), approx, Compute::default())
                    } else {
                        reference(xs[0].clone(), approx)
                    }
                });
            }
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        for approx in [Gelu::Tanh, Gelu::Erf] {
            let (x, dy) = (leaf([7, 19], 1).mul_scalar(3.0), leaf([7, 19], 2));
            let got = Flex::gelu_with_backward(prim(x.clone()), prim(dy.clone()), approx, Compute::default());
            assert_close(&format!("gelu {approx:?}"), vec![float(got)], vec![reference_backward(x, dy, approx)]);
        }
    }

    /// Both GELUs and their derivatives, written out in f64 from their definitions.
    fn gelu64(x: f64, approx: Gelu) -> (f64, f64) {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        match approx {
            Gelu::Tanh => {
                let t = (c * (x + 0.044715 * x.powi(3))).tanh();
                (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x))
            }
            Gelu::Erf => {
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (
                    0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
                    0.5 * (1.0 + libm::erf(x / 2f64.sqrt())) + x * pdf,
                )
            }
        }
    }

    #[test]
    fn kernels_match_the_definitions() {
        let x: Vec<f32> = (0..=4000).map(|i| (i as f32 - 2000.0) * 0.004).collect(); // [-8, 8]
        let dy = values(x.len(), 3);
        for approx in [Gelu::Tanh, Gelu::Erf] {
            let cpu = Compute::default().elementwise_cpu();
            let (y, dx) = (kernel::gelu(cpu, &x, approx), kernel::gelu_backward(cpu, &x, &dy, approx));
            for i in 0..x.len() {
                let (want, grad) = gelu64(x[i] as f64, approx);
                // The exact GELU's error is erf's, 5e-7, times x/2.
                let scale = want.abs().max(1.0);
                assert!((y[i] as f64 - want).abs() < 2e-6 * scale, "{approx:?}({}): {} vs {want}", x[i], y[i]);
                let want_dx = grad * dy[i] as f64;
                assert!((dx[i] as f64 - want_dx).abs() < 2e-6, "{approx:?}'({}): {} vs {want_dx}", x[i], dx[i]);
            }
        }
    }

    #[test]
    fn erf_is_within_5e_7_of_the_f64_erf() {
        let mut worst = 0.0f64;
        for i in 0..=2_000_000 {
            let x = -6.0 + 12.0 * i as f32 / 2_000_000.0;
            worst = worst.max((erf(x) as f64 - libm::erf(x as f64)).abs());
        }
        assert!(worst < 5e-7, "worst absolute error {worst}");
        assert_eq!((erf(0.0), erf(f32::INFINITY), erf(f32::NEG_INFINITY)), (0.0, 1.0, -1.0));
        assert!(erf(f32::NAN).is_nan());
    }

    #[test]
    fn every_copy_of_the_gelu_kernels_gives_the_same_bits() {
        let x: Vec<f32> = values(50_000, 7).iter().map(|v| v * 7.0).collect();
        let dy = values(x.len(), 8);
        same_bits_on_every_tier("gelu", |cpu| {
            [Gelu::Tanh, Gelu::Erf]
                .into_iter()
                .flat_map(|a| [kernel::gelu(cpu, &x, a), kernel::gelu_backward(cpu, &x, &dy, a)])
                .collect()
        });
    }
}
