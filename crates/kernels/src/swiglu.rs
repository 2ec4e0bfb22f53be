//! The gated linear units' gate (Shazeer, 2020, "GLU Variants Improve Transformer"): `act(g) · u`
//! of packed rows `[g | u]`, SwiGLU (`act` = SiLU: Llama, Qwen) or GeGLU (`act` = tanh GELU:
//! Gemma's `gelu_pytorch_tanh`). One kernel body serves both, one loop a gate.

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
use crate::gelu::{self, Gelu};
use crate::{flex, float, kernels, prim, reference_grads, EmberBackend};

pub use crate::activation::Gate;

/// A backend's packed gated units; the default methods are the reference.
pub trait GluOps: Backend {
    /// # Shapes
    /// - gu: `[N, 2F]` -> `[N, F]`
    fn glu(gu: FloatTensor<Self>, gate: Gate, _cx: Compute) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(gu), gate))
    }

    /// Gradient of the packed input given the output gradient.
    fn glu_backward(gu: FloatTensor<Self>, dy: FloatTensor<Self>, gate: Gate, _cx: Compute) -> FloatTensor<Self> {
        prim(reference_backward(float::<Self, 2>(gu), float(dy), gate))
    }
}

/// The composition: the reference, and the path of backends without a kernel.
///
/// # Shapes
/// - gu: `[N, 2F]` (rows `[g | u]`) -> `[N, F]`
pub fn reference<B: Backend>(gu: Tensor<B, 2>, gate: Gate) -> Tensor<B, 2> {
    let f = gu.dims()[1] / 2;
    let g = gu.clone().narrow(1, 0, f);
    let act = match gate {
        Gate::Silu => silu(g),
        Gate::GeluTanh => gelu::reference(g, Gelu::Tanh),
    };
    act * gu.narrow(1, f, f)
}

/// The reference's gradient, through Burn's autodiff.
pub fn reference_backward<B: Backend>(gu: Tensor<B, 2>, dy: Tensor<B, 2>, gate: Gate) -> Tensor<B, 2> {
    let [d] = reference_grads([gu], dy, |[gu]| reference(gu, gate));
    d
}

/// `act(g) · u` as one op where the backend runs it faster so, else the composition.
///
/// # Shapes
/// - gu: `[N, 2F]` -> `[N, F]`
pub fn glu_packed<B: EmberBackend>(gu: Tensor<B, 2>, gate: Gate, cx: Compute) -> Tensor<B, 2> {
    if cx.fused::<B>(gu.dtype()) {
        float(B::glu(prim(gu), gate, cx))
    } else {
        reference(gu, gate)
    }
}

/// SwiGLU, `silu(g) · u`: [`glu_packed`] with [`Gate::Silu`].
///
/// # Shapes
/// - gu: `[N, 2F]` -> `[N, F]`
pub fn swiglu_packed<B: EmberBackend>(gu: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    glu_packed(gu, Gate::Silu, cx)
}

/// GeGLU, `gelu_tanh(g) · u`: [`glu_packed`] with [`Gate::GeluTanh`].
///
/// # Shapes
/// - gu: `[N, 2F]` -> `[N, F]`
pub fn geglu_packed<B: EmberBackend>(gu: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    glu_packed(gu, Gate::GeluTanh, cx)
}

impl GluOps for Flex {
    fn glu(gu: FlexTensor, gate: Gate, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&gu);
        if !flex::all_f32(&[&gu]) || !shape[1].is_multiple_of(2) {
            return prim(reference(float::<Self, 2>(gu), gate));
        }
        let f = shape[1] / 2;
        flex::tensor(kernels::glu_packed(cx.elementwise_cpu(), &flex::f32s(&gu), f, gate), vec![shape[0], f])
    }

    fn glu_backward(gu: FlexTensor, dy: FlexTensor, gate: Gate, cx: Compute) -> FlexTensor {
        let shape = flex::shape(&gu);
        if !flex::all_f32(&[&gu, &dy]) || !shape[1].is_multiple_of(2) || flex::shape(&dy) != [shape[0], shape[1] / 2] {
            return prim(reference_backward(float::<Self, 2>(gu), float(dy), gate));
        }
        let d =
            kernels::glu_packed_backward(cx.elementwise_cpu(), &flex::f32s(&gu), &flex::f32s(&dy), shape[1] / 2, gate);
        flex::tensor(d, shape)
    }
}

/// One graph node whose backward is the inner backend's.
impl<B: EmberBackend, C: CheckpointStrategy> GluOps for Autodiff<B, C> {
    fn glu(gu: FloatTensor<Self>, gate: Gate, cx: Compute) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GluBackward;
        impl<B: EmberBackend> Backward<B, 1> for GluBackward {
            type State = (FloatTensor<B>, Gate, Compute);
            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (gu, gate, cx) = ops.state;
                if let Some(n) = node {
                    grads.register::<B>(n.id, B::glu_backward(gu, dy, gate, cx));
                }
            }
        }
        match GluBackward.prepare::<C>([gu.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::glu(gu.primitive.clone(), gate, cx);
                prep.finish((gu.primitive, gate, cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::glu(gu.primitive, gate, cx)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf, values};

    #[test]
    fn fused_gated_units_equal_the_composition() {
        for gate in [Gate::Silu, Gate::GeluTanh] {
            for (n, f) in [(1, 5), (9, 31), (64, 344)] {
                compare(&format!("{gate:?} {n}x{f}"), vec![leaf([n, 2 * f], 3)], [n, f], &|xs, fused| {
                    if fused {
                        glu_packed(xs[0].clone(), gate, Compute::default())
                    } else {
                        reference(xs[0].clone(), gate)
                    }
                });
            }
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        for gate in [Gate::Silu, Gate::GeluTanh] {
            let (gu, dy) = (leaf([7, 2 * 19], 1), leaf([7, 19], 2));
            let got = Flex::glu_backward(prim(gu.clone()), prim(dy.clone()), gate, Compute::default());
            assert_close(&format!("{gate:?}"), vec![float(got)], vec![reference_backward(gu, dy, gate)]);
        }
    }

    /// The named entry points are the gates they name; SwiGLU's values are its kernel's, bit for bit.
    #[test]
    fn swiglu_and_geglu_are_their_gates() {
        let gu = leaf([5, 2 * 12], 6);
        let cx = Compute::default();
        let bits = |t: Tensor<Flex, 2>| {
            t.into_data().to_vec::<f32>().expect("f32").iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(swiglu_packed(gu.clone(), cx)), bits(glu_packed(gu.clone(), Gate::Silu, cx)));
        assert_eq!(bits(geglu_packed(gu.clone(), cx)), bits(glu_packed(gu.clone(), Gate::GeluTanh, cx)));
        let direct =
            kernels::glu_packed(cx.elementwise_cpu(), &gu.to_data().to_vec::<f32>().expect("f32"), 12, Gate::Silu);
        assert_eq!(bits(swiglu_packed(gu, cx)), direct.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    /// GeGLU's kernel against `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))·u` in f64, and its
    /// gradients against the derivatives of that.
    #[test]
    fn geglu_kernel_matches_the_formula() {
        let f = 300;
        let gu: Vec<f32> = values(2 * f, 5).iter().map(|v| v * 6.0).collect();
        let dy = values(f, 6);
        let cpu = Compute::default().elementwise_cpu();
        let y = kernels::glu_packed(cpu, &gu, f, Gate::GeluTanh);
        let d = kernels::glu_packed_backward(cpu, &gu, &dy, f, Gate::GeluTanh);
        let c = (2.0 / std::f64::consts::PI).sqrt();
        for i in 0..f {
            let (g, u, dy) = (gu[i] as f64, gu[f + i] as f64, dy[i] as f64);
            let t = (c * (g + 0.044715 * g.powi(3))).tanh();
            let act = 0.5 * g * (1.0 + t);
            let act_grad = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * g * g);
            assert!((y[i] as f64 - act * u).abs() < 1e-5, "y[{i}]: {} vs {}", y[i], act * u);
            assert!((d[i] as f64 - dy * u * act_grad).abs() < 1e-5, "dg[{i}]");
            assert!((d[f + i] as f64 - dy * act).abs() < 1e-5, "du[{i}]");
        }
    }
}
