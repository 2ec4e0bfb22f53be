//! SwiGLU's gate (Shazeer, 2020): `silu(g) · u` of packed rows `[g | u]`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::silu;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};

use crate::compute::Compute;
use crate::{flex, float, kernels, prim, reference_grads, EmberBackend};

/// A backend's packed SwiGLU; the default methods are the reference.
pub trait SwigluOps: Backend {
    /// # Shapes
    /// - gu: `[N, 2F]` -> `[N, F]`
    fn swiglu(gu: FloatTensor<Self>, cx: Compute) -> FloatTensor<Self> {
        let _ = cx;
        prim(reference(float::<Self, 2>(gu)))
    }

    /// Gradient of the packed input given the output gradient.
    fn swiglu_backward(gu: FloatTensor<Self>, dy: FloatTensor<Self>, cx: Compute) -> FloatTensor<Self> {
        let _ = cx;
        prim(reference_backward(float::<Self, 2>(gu), float(dy)))
    }
}

/// The composition: the reference, and the path of backends without a kernel.
///
/// # Shapes
/// - gu: `[N, 2F]` (rows `[g | u]`) -> `[N, F]`
pub fn reference<B: Backend>(gu: Tensor<B, 2>) -> Tensor<B, 2> {
    let f = gu.dims()[1] / 2;
    silu(gu.clone().narrow(1, 0, f)) * gu.narrow(1, f, f)
}

/// The reference's gradient, through Burn's autodiff.
pub fn reference_backward<B: Backend>(gu: Tensor<B, 2>, dy: Tensor<B, 2>) -> Tensor<B, 2> {
    let [d] = reference_grads([gu], dy, |[gu]| reference(gu));
    d
}

/// `silu(g) · u` as one op where the backend runs it faster so, else the composition.
///
/// # Shapes
/// - gu: `[N, 2F]` -> `[N, F]`
pub fn swiglu_packed<B: EmberBackend>(gu: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    if cx.fused::<B>(gu.dtype()) {
        float(B::swiglu(prim(gu), cx))
    } else {
        reference(gu)
    }
}

impl SwigluOps for Flex {
    fn swiglu(gu: FlexTensor, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&gu);
        if !flex::all_f32(&[&gu]) || !shape[1].is_multiple_of(2) {
            return prim(reference(float::<Self, 2>(gu)));
        }
        let f = shape[1] / 2;
        flex::tensor(kernels::swiglu_packed(cx.elementwise_cpu(), &flex::f32s(&gu), f), vec![shape[0], f])
    }

    fn swiglu_backward(gu: FlexTensor, dy: FlexTensor, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&gu);
        if !flex::all_f32(&[&gu, &dy]) || !shape[1].is_multiple_of(2) || flex::shape(&dy) != [shape[0], shape[1] / 2] {
            return prim(reference_backward(float::<Self, 2>(gu), float(dy)));
        }
        flex::tensor(
            kernels::swiglu_packed_backward(cx.elementwise_cpu(), &flex::f32s(&gu), &flex::f32s(&dy), shape[1] / 2),
            shape,
        )
    }
}

/// One graph node whose backward is the inner backend's.
impl<B: EmberBackend, C: CheckpointStrategy> SwigluOps for Autodiff<B, C> {
    fn swiglu(gu: FloatTensor<Self>, cx: Compute) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SwigluBackward;
        impl<B: EmberBackend> Backward<B, 1> for SwigluBackward {
            type State = (FloatTensor<B>, Compute);
            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (gu, cx) = ops.state;
                if let Some(n) = node {
                    grads.register::<B>(n.id, B::swiglu_backward(gu, dy, cx));
                }
            }
        }
        match SwigluBackward.prepare::<C>([gu.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::swiglu(gu.primitive.clone(), cx);
                prep.finish((gu.primitive, cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gu.primitive, cx)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf};

    #[test]
    fn fused_swiglu_equals_the_composition() {
        for (n, f) in [(1, 5), (9, 31), (64, 344)] {
            compare(&format!("swiglu {n}x{f}"), vec![leaf([n, 2 * f], 3)], [n, f], &|xs, fused| {
                if fused {
                    swiglu_packed(xs[0].clone(), Compute::default())
                } else {
                    reference(xs[0].clone())
                }
            });
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        let (gu, dy) = (leaf([7, 2 * 19], 1), leaf([7, 19], 2));
        let got = Flex::swiglu_backward(prim(gu.clone()), prim(dy.clone()), Compute::default());
        assert_close("swiglu", vec![float(got)], vec![reference_backward(gu, dy)]);
    }
}
