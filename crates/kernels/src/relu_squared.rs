//! Squared ReLU (So et al., 2021, "Primer"): `relu(x)²`, element by element; the MLP activation of
//! the modded-nanoGPT speedrun.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::relu;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};

use crate::compute::Compute;
use crate::{flex, float, prim, reference_grads, EmberBackend};

/// A backend's squared ReLU; the default methods are the reference.
pub trait ReluSquaredOps: Backend {
    /// # Shapes
    /// - x: `[N, D]` -> `[N, D]`
    fn relu_squared(x: FloatTensor<Self>, _cx: Compute) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(x)))
    }

    /// Gradient of x given the output gradient.
    fn relu_squared_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>, _cx: Compute) -> FloatTensor<Self> {
        prim(reference_backward(float::<Self, 2>(x), float(dy)))
    }
}

/// The composition: the reference, and the path of backends without a kernel.
///
/// # Shapes
/// - x: `[N, D]` -> `[N, D]`
pub fn reference<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    relu(x).square()
}

/// The reference's gradient, through Burn's autodiff.
pub fn reference_backward<B: Backend>(x: Tensor<B, 2>, dy: Tensor<B, 2>) -> Tensor<B, 2> {
    let [dx] = reference_grads([x], dy, |[x]| reference(x));
    dx
}

/// `relu(x)²` as one op where the backend runs it faster so, else the composition.
///
/// # Shapes
/// - x: `[N, D]` -> `[N, D]`
pub fn relu_squared<B: EmberBackend>(x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    if cx.fused::<B>(x.dtype()) {
        float(B::relu_squared(prim(x), cx))
    } else {
        reference(x)
    }
}

impl ReluSquaredOps for Flex {
    fn relu_squared(x: FlexTensor, cx: Compute) -> FlexTensor {
        if !flex::all_f32(&[&x]) {
            return prim(reference(float::<Self, 2>(x)));
        }
        let shape = flex::shape(&x);
        flex::tensor(kernel::relu_squared(cx.elementwise_cpu(), &flex::f32s(&x)), shape)
    }

    fn relu_squared_backward(x: FlexTensor, dy: FlexTensor, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&x);
        if !flex::all_f32(&[&x, &dy]) || flex::shape(&dy) != shape {
            return prim(reference_backward(float::<Self, 2>(x), float(dy)));
        }
        flex::tensor(kernel::relu_squared_backward(cx.elementwise_cpu(), &flex::f32s(&x), &flex::f32s(&dy)), shape)
    }
}

/// One graph node whose backward is the inner backend's.
impl<B: EmberBackend, C: CheckpointStrategy> ReluSquaredOps for Autodiff<B, C> {
    fn relu_squared(x: FloatTensor<Self>, cx: Compute) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct ReluSquaredBackward;
        impl<B: EmberBackend> Backward<B, 1> for ReluSquaredBackward {
            type State = (FloatTensor<B>, Compute);
            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, cx) = ops.state;
                if let Some(n) = node {
                    grads.register::<B>(n.id, B::relu_squared_backward(x, dy, cx));
                }
            }
        }
        match ReluSquaredBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::relu_squared(x.primitive.clone(), cx);
                prep.finish((x.primitive, cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::relu_squared(x.primitive, cx)),
        }
    }
}

/// The CPU kernels, on f32 slices.
mod kernel {
    use rayon::prelude::*;

    use crate::compute::Cpu;
    use crate::simd::multiversion;

    /// Elements per rayon task.
    const CHUNK: usize = 1 << 14;

    multiversion! {
        /// `max(x, 0)²`, element by element.
        pub(super) fn relu_squared(cpu: Cpu, x: &[f32]) -> Vec<f32> {
            let mut y = Box::<[f32]>::new_uninit_slice(x.len());
            y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(y, x)| {
                for (y, &v) in y.iter_mut().zip(x) {
                    let r = if v > 0.0 { v } else { 0.0 };
                    y.write(r * r);
                }
            });
            // SAFETY: the chunks of y pair with those of x, as long: every element was written.
            unsafe { y.assume_init() }.into_vec()
        }
    }

    multiversion! {
        /// `dy · 2·max(x, 0)`, element by element.
        pub(super) fn relu_squared_backward(cpu: Cpu, x: &[f32], dy: &[f32]) -> Vec<f32> {
            assert_eq!(x.len(), dy.len(), "relu_squared_backward: values and gradients");
            let mut dx = Box::<[f32]>::new_uninit_slice(x.len());
            dx.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK))).for_each(|(dx, (x, dy))| {
                for (d, (&v, &g)) in dx.iter_mut().zip(x.iter().zip(dy)) {
                    let r = if v > 0.0 { v } else { 0.0 };
                    d.write(g * (2.0 * r));
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
    fn fused_relu_squared_equals_the_composition() {
        for (n, d) in [(1, 5), (9, 31), (64, 344)] {
            compare(&format!("relu² {n}x{d}"), vec![leaf([n, d], 4)], [n, d], &|xs, fused| {
                if fused {
                    relu_squared(xs[0].clone(), Compute::default())
                } else {
                    reference(xs[0].clone())
                }
            });
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        let (x, dy) = (leaf([7, 19], 1), leaf([7, 19], 2));
        let got = Flex::relu_squared_backward(prim(x.clone()), prim(dy.clone()), Compute::default());
        assert_close("relu²", vec![float(got)], vec![reference_backward(x, dy)]);
    }

    #[test]
    fn kernels_match_the_definition() {
        let mut x = values(1000, 1);
        x.extend([0.0, -0.0, f32::MIN_POSITIVE, -3.0, 3.0]);
        let dy = values(x.len(), 2);
        let cpu = Compute::default().elementwise_cpu();
        let (y, dx) = (kernel::relu_squared(cpu, &x), kernel::relu_squared_backward(cpu, &x, &dy));
        for i in 0..x.len() {
            let r = x[i].max(0.0);
            assert_eq!((y[i], dx[i]), (r * r, dy[i] * 2.0 * r), "at {}", x[i]);
        }
    }

    #[test]
    fn every_copy_of_the_relu_squared_kernels_gives_the_same_bits() {
        let (x, dy) = (values(50_000, 3), values(50_000, 4));
        same_bits_on_every_tier("relu²", |cpu| {
            vec![kernel::relu_squared(cpu, &x), kernel::relu_squared_backward(cpu, &x, &dy)]
        });
    }
}
