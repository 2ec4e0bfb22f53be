//! RMSNorm (Zhang & Sennrich, 2019): `y = x / sqrt(mean(x²) + eps) · w`, row by row.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::compute::Compute;
use crate::{flex, float, kernels, prim, reference_grads, to_dtype, EmberBackend};

/// A backend's RMSNorm; the default methods are the reference.
pub trait RmsNormOps: Backend {
    /// # Shapes
    /// - x: `[N, D]`, w: `[D]` -> `[N, D]`
    fn rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64, cx: Compute) -> FloatTensor<Self> {
        let _ = cx;
        prim(reference(float::<Self, 2>(x), float(w), eps))
    }

    /// Gradients of x and w given the output gradient.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        eps: f64,
        cx: Compute,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _ = cx;
        let (dx, dw) = reference_backward(float::<Self, 2>(x), float(w), float(dy), eps);
        (prim(dx), prim(dw))
    }
}

/// The composition: the reference, and the path of backends without a kernel.
///
/// # Shapes
/// - x: `[N, D]`, w: `[D]` -> `[N, D]`
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let x = to_dtype(x, DType::F32);
    let inv_rms = x.clone().square().mean_dim(1).add_scalar(eps).sqrt().recip(); // [N, 1]
    to_dtype(x * inv_rms, dtype) * to_dtype(w, dtype).unsqueeze::<2>()
}

/// The reference's gradients (of x `[N, D]` and w `[D]`), through Burn's autodiff.
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 1>,
    dy: Tensor<B, 2>,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let d = w.dims()[0];
    let [dx, dw] = reference_grads([x, w.reshape([1, d])], dy, |[x, w]| reference(x, w.reshape([d]), eps));
    (dx, dw.reshape([d]))
}

/// RMSNorm as one op where the backend runs it faster so, else the composition.
///
/// # Shapes
/// - x: `[N, D]`, w: `[D]` -> `[N, D]`
pub fn rms_norm<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 1>, eps: f64, cx: Compute) -> Tensor<B, 2> {
    if cx.fused::<B>(x.dtype()) && w.dtype() == x.dtype() {
        float(B::rms_norm(prim(x), prim(w), eps, cx))
    } else {
        reference(x, w, eps)
    }
}

impl RmsNormOps for Flex {
    fn rms_norm(x: FlexTensor, w: FlexTensor, eps: f64, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&x);
        if !flex::all_f32(&[&x, &w]) || flex::shape(&w) != [shape[1]] {
            return prim(reference(float::<Self, 2>(x), float(w), eps));
        }
        flex::tensor(kernels::rms_norm(cx.elementwise_cpu(), &flex::f32s(&x), &flex::f32s(&w), eps as f32), shape)
    }

    fn rms_norm_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        eps: f64,
        cx: Compute,
    ) -> (FlexTensor, FlexTensor) {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        if !flex::all_f32(&[&x, &w, &dy]) || ws != [xs[1]] || flex::shape(&dy) != xs {
            let (dx, dw) = reference_backward(float::<Self, 2>(x), float(w), float(dy), eps);
            return (prim(dx), prim(dw));
        }
        let (dx, dw) = kernels::rms_norm_backward(
            cx.elementwise_cpu(),
            &flex::f32s(&x),
            &flex::f32s(&w),
            &flex::f32s(&dy),
            eps as f32,
        );
        (flex::tensor(dx, xs), flex::tensor(dw, ws))
    }
}

/// One graph node whose backward is the inner backend's.
impl<B: EmberBackend, C: CheckpointStrategy> RmsNormOps for Autodiff<B, C> {
    fn rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64, cx: Compute) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct RmsNormBackward;
        impl<B: EmberBackend> Backward<B, 2> for RmsNormBackward {
            type State = (FloatTensor<B>, FloatTensor<B>, f64, Compute);
            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node_x, node_w] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, w, eps, cx) = ops.state;
                let (dx, dw) = B::rms_norm_backward(x, w, dy, eps, cx);
                if let Some(n) = node_x {
                    grads.register::<B>(n.id, dx);
                }
                if let Some(n) = node_w {
                    grads.register::<B>(n.id, dw);
                }
            }
        }
        match RmsNormBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::rms_norm(x.primitive.clone(), w.primitive.clone(), eps, cx);
                prep.finish((x.primitive, w.primitive, eps, cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x.primitive, w.primitive, eps, cx)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf};

    #[test]
    fn fused_rms_norm_equals_the_composition() {
        for (n, d) in [(1, 8), (7, 13), (96, 128)] {
            let w = leaf([1, d], 2).reshape([1, d]);
            compare(&format!("rms_norm {n}x{d}"), vec![leaf([n, d], 1), w], [n, d], &|xs, fused| {
                let w = xs[1].clone().reshape([d]);
                if fused {
                    rms_norm(xs[0].clone(), w, 1e-5, Compute::default())
                } else {
                    reference(xs[0].clone(), w, 1e-5)
                }
            });
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        let (n, d) = (9, 24);
        let (x, w, dy) = (leaf([n, d], 1), leaf([1, d], 2).reshape([d]), leaf([n, d], 3));
        let (dx, dw) =
            Flex::rms_norm_backward(prim(x.clone()), prim(w.clone()), prim(dy.clone()), 1e-5, Compute::default());
        let (want_dx, want_dw) = reference_backward(x, w, dy, 1e-5);
        let got = vec![float(dx), float::<Flex, 1>(dw).unsqueeze()];
        assert_close("rms_norm", got, vec![want_dx, want_dw.unsqueeze()]);
    }
}
