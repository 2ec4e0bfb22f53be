//! AdamW (Loshchilov & Hutter, 2019) on a flattened parameter, and the sum of squares the global
//! gradient norm is made of: the optimizer's ops (the optimizer itself is `ember_train::optim`).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};

use crate::compute::{Compute, Path};
use crate::newton_schulz::NsStep;
use crate::{flex, float, kernels, prim, EmberBackend};

/// The scalars of one AdamW update (decoupled weight decay, as `torch.optim.AdamW`):
///
/// ```text
/// g = grad_scale·grad     m = β1·m + (1-β1)·g     v = β2·v + (1-β2)·g²
/// p = p·(1 - decay) - lr · (m / bias1) / (sqrt(v / bias2) + eps)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `lr · weight_decay`, or 0 for parameters that do not decay.
    pub decay: f64,
    /// `1 - β1^t` and `1 - β2^t`.
    pub bias1: f64,
    pub bias2: f64,
    /// The clipping coefficient.
    pub grad_scale: f64,
}

/// A backend's optimizer ops; the default methods are the reference.
pub trait AdamWOps: Backend {
    /// One AdamW update: returns the new parameter and moments.
    ///
    /// # Shapes
    /// - p, g, m, v: `[n]` -> (p, m, v): `[n]`
    fn adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        h: AdamWStep,
        cx: Compute,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _ = cx;
        let (p, m, v) = adamw_reference(float::<Self, 1>(p), float(g), float(m), float(v), h);
        (prim(p), prim(m), prim(v))
    }

    /// `Σ x²` over all elements, for the global gradient norm.
    ///
    /// # Shapes
    /// - x: any -> `[1]`
    fn sum_squares(x: FloatTensor<Self>, cx: Compute) -> FloatTensor<Self> {
        let _ = cx;
        prim(float::<Self, 1>(x).square().sum())
    }

    /// Muon's Newton–Schulz iteration of each matrix of `gs`.
    ///
    /// # Shapes
    /// - gs: each `[R, C]` -> each `[R, C]`
    fn newton_schulz(gs: Vec<FloatTensor<Self>>, h: NsStep, cx: Compute) -> Vec<FloatTensor<Self>> {
        let _ = cx;
        crate::newton_schulz::reference_each::<Self>(gs, h)
    }
}

/// [`AdamWOps::adamw`] as a composition of tensor ops: the reference.
pub fn adamw_reference<B: Backend>(
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
    h: AdamWStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let g = if h.grad_scale == 1.0 { g } else { g.mul_scalar(h.grad_scale) };
    let m = m.mul_scalar(h.beta1) + g.clone().mul_scalar(1.0 - h.beta1);
    let v = v.mul_scalar(h.beta2) + g.square().mul_scalar(1.0 - h.beta2);
    let denom = v.clone().div_scalar(h.bias2).sqrt().add_scalar(h.eps);
    let update = m.clone().div_scalar(h.bias1) / denom;
    let p = if h.decay == 0.0 { p } else { p.mul_scalar(1.0 - h.decay) };
    (p - update.mul_scalar(h.lr), m, v)
}

/// Tensor-level entry point of [`AdamWOps::adamw`]: the backend's kernel, or the reference where
/// `cx` asks for the reference path.
pub fn adamw<B: EmberBackend>(
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
    h: AdamWStep,
    cx: Compute,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    if cx.path == Path::Reference {
        return adamw_reference(p, g, m, v, h);
    }
    let (p, m, v) = B::adamw(prim(p), prim(g), prim(m), prim(v), h, cx);
    (float(p), float(m), float(v))
}

/// `Σ x²` over all elements (`[1]`), for the global gradient norm: the backend's kernel, or the
/// composition where `cx` asks for the reference path.
pub fn sum_squares<B: EmberBackend, const D: usize>(x: Tensor<B, D>, cx: Compute) -> Tensor<B, 1> {
    let n = x.shape().num_elements();
    let x = x.reshape([n]);
    match cx.path {
        Path::Kernels => float(B::sum_squares(prim(x), cx)),
        Path::Reference => x.square().sum(),
    }
}

/// One pass over memory for f32 parameters, updating the moments in place.
impl AdamWOps for Flex {
    fn adamw(
        p: FlexTensor,
        g: FlexTensor,
        m: FlexTensor,
        v: FlexTensor,
        h: AdamWStep,
        cx: Compute,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        if !flex::all_f32(&[&p, &g, &m, &v]) {
            let (p, m, v) = adamw_reference(float::<Self, 1>(p), float(g), float(m), float(v), h);
            return (prim(p), prim(m), prim(v));
        }
        let (mut p, mut m, mut v) = (flex::exclusive(p), flex::exclusive(m), flex::exclusive(v));
        kernels::adamw(cx.elementwise_cpu(), p.storage_mut(), &flex::f32s(&g), m.storage_mut(), v.storage_mut(), &h);
        (p, m, v)
    }

    fn sum_squares(x: FlexTensor, cx: Compute) -> FlexTensor {
        if !flex::all_f32(&[&x]) {
            return prim(float::<Self, 1>(x).square().sum());
        }
        flex::tensor(vec![kernels::sum_squares(cx.elementwise_cpu(), &flex::f32s(&x)) as f32], vec![1])
    }

    fn newton_schulz(gs: Vec<FlexTensor>, h: NsStep, cx: Compute) -> Vec<FlexTensor> {
        crate::newton_schulz::flex_newton_schulz(gs, h, cx)
    }
}

/// The optimizer runs on the inner backend's tensors; under autodiff these are the reference.
impl<B: EmberBackend, C: CheckpointStrategy> AdamWOps for Autodiff<B, C> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{leaf, rel_err};

    #[test]
    fn fused_adamw_and_sum_squares_equal_the_compositions() {
        let vec1 = |n: usize, seed: u64| leaf([1, n], seed).reshape([n]);
        for (n, decay, grad_scale) in [(1, 0.0, 1.0), (1001, 1e-4, 0.37), (40_000, 1e-3, 1.0)] {
            let (p, g, m) = (vec1(n, 1), vec1(n, 2), vec1(n, 3));
            let v = vec1(n, 4).abs();
            let h = AdamWStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                decay,
                bias1: 1.0 - 0.9f64.powi(3),
                bias2: 1.0 - 0.99f64.powi(3),
                grad_scale,
            };
            let want = adamw_reference(p.clone(), g.clone(), m.clone(), v.clone(), h);
            // `p` is still shared here: the kernel must copy, not write into the caller's tensor.
            let cx = Compute::default();
            let got = adamw(p.clone(), g.clone(), m, v, h, cx);
            for (name, a, b) in [("p", got.0, want.0), ("m", got.1, want.1), ("v", got.2, want.2)] {
                let err = rel_err(a.unsqueeze::<2>(), b.unsqueeze::<2>());
                assert!(err < 1e-5, "adamw n={n} {name}: {err}");
            }
            assert!(rel_err(p.clone().unsqueeze::<2>(), vec1(n, 1).unsqueeze::<2>()) == 0.0, "input changed");
            // The kernel itself, on slices (the backend op above must be it, not the default body).
            let vals = |t: &Tensor<Flex, 1>| t.to_data().into_vec::<f32>().expect("f32");
            let (mut pk, mut mk, mut vk) = (vals(&p), vals(&vec1(n, 3)), vals(&vec1(n, 4).abs()));
            kernels::adamw(cx.cpu, &mut pk, &vals(&g), &mut mk, &mut vk, &h);
            let got_p = adamw(p.clone(), g.clone(), vec1(n, 3), vec1(n, 4).abs(), h, cx).0;
            assert_eq!(pk, vals(&got_p), "adamw n={n}: the backend op is not the kernel");
            let fused: f32 = sum_squares(g.clone(), cx).into_scalar();
            let plain: f32 = g.clone().square().sum().into_scalar();
            assert_eq!(fused, kernels::sum_squares(cx.cpu, &vals(&g)) as f32, "sum of squares: not the kernel");
            assert!((fused - plain).abs() <= 1e-5 * plain.abs(), "sum of squares n={n}: {fused} vs {plain}");
        }
    }
}
