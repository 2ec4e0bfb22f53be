//! Linear layers: `x · w (+ b)`, the backward pass computing only the gradients asked for (a
//! frozen weight's product is never formed).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};

use super::kernels::LinearGrads;
use super::{flex, float, kernels, prim, reference_grads, EmberBackend};

/// The gradients of x, w and b, those not asked for `None`.
pub type Grads<B> = (Option<FloatTensor<B>>, Option<FloatTensor<B>>, Option<FloatTensor<B>>);

/// A backend's linear layer; the default methods are the reference.
pub trait LinearOps: Backend {
    /// # Shapes
    /// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
    fn linear_forward(x: FloatTensor<Self>, w: FloatTensor<Self>, b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(x), float(w), b.map(float)))
    }

    /// The gradients of x, w and b that `need` asks for, given the output gradient.
    fn linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        need: LinearGrads,
    ) -> Grads<Self> {
        let (dx, dw, db) = reference_backward(float::<Self, 2>(x), float(w), float(dy));
        (need.x.then(|| prim(dx)), need.w.then(|| prim(dw)), need.b.then(|| prim(db)))
    }

    /// `x · wᵀ` with the weight stored `[N, K]` (a tied LM head: the embedding table).
    ///
    /// # Shapes
    /// - x: `[M, K]`, w: `[N, K]` -> `[M, N]`
    fn linear_nt_forward(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        prim(reference_nt(float::<Self, 2>(x), float(w)))
    }
}

/// `x · wᵀ` as `(w · xᵀ)ᵀ`: the reference of [`linear_nt`]. It reads `w` where it is (`x · wᵀ`
/// would make some backends copy the whole transposed table) and transposes only the small result.
///
/// # Shapes
/// - x: `[M, K]`, w: `[N, K]` -> `[M, N]`
pub fn reference_nt<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Tensor<B, 2> {
    w.matmul(x.transpose()).transpose()
}

/// `x · wᵀ` with w stored `[N, K]`: one op where the backend has a kernel (on the CPU, for the few
/// rows of decoding: [`super::few_rows::product_nt`]), else the composition.
///
/// # Shapes
/// - x: `[M, K]`, w: `[N, K]` -> `[M, N]`
pub fn linear_nt<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Tensor<B, 2> {
    if B::fused(x.dtype()) && w.dtype() == x.dtype() {
        float(B::linear_nt_forward(prim(x), prim(w)))
    } else {
        reference_nt(x, w)
    }
}

/// The composition: the reference, and the path of backends without a kernel.
///
/// # Shapes
/// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    burn::tensor::module::linear(x, w, b)
}

/// The reference's gradients of x `[M, K]`, w `[K, N]` and a bias `[N]`, through Burn's autodiff.
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    dy: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1>) {
    let n = w.dims()[1];
    let b = Tensor::<B, 2>::zeros([1, n], &x.device()).cast(x.dtype());
    let [dx, dw, db] = reference_grads([x, w, b], dy, |[x, w, b]| reference(x, w, Some(b.reshape([n]))));
    (dx, dw, db.reshape([n]))
}

/// `x · w (+ b)` as one op where the backend runs it faster so (on the CPU kernels the two
/// products of the backward pass run side by side), else the composition.
///
/// # Shapes
/// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
pub fn linear<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    let dtype = x.dtype();
    if B::fused(dtype) && w.dtype() == dtype && b.as_ref().is_none_or(|b| b.dtype() == dtype) {
        float(B::linear_forward(prim(x), prim(w), b.map(prim)))
    } else {
        reference(x, w, b)
    }
}

impl LinearOps for Flex {
    fn linear_forward(x: FlexTensor, w: FlexTensor, b: Option<FlexTensor>) -> FlexTensor {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        let bias_fits = b.as_ref().is_none_or(|b| flex::all_f32(&[b]) && flex::shape(b) == [ws[1]]);
        if !flex::all_f32(&[&x, &w]) || !bias_fits || xs[1] != ws[0] {
            // Other dtypes, and shapes that do not fit (which Burn's ops then name).
            return prim(reference(float::<Self, 2>(x), float(w), b.map(float)));
        }
        let b = b.as_ref().map(flex::f32s);
        let y = kernels::linear(&flex::f32s(&x), &flex::f32s(&w), b.as_deref(), (xs[0], xs[1], ws[1]));
        flex::tensor(y, vec![xs[0], ws[1]])
    }

    fn linear_nt_forward(x: FlexTensor, w: FlexTensor) -> FlexTensor {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        if !flex::all_f32(&[&x, &w]) || xs[1] != ws[1] || xs[0] > kernels::FEW_ROWS || w.as_slice::<f32>().is_none() {
            // Many rows (a GEMM's job), other dtypes, a weight that is a view, shapes that do not
            // fit (which Burn's ops then name).
            return prim(reference_nt(float::<Self, 2>(x), float(w)));
        }
        let mut y = vec![0.0f32; xs[0] * ws[0]];
        super::few_rows::product_nt(&mut y, &flex::f32s(&x), &flex::f32s(&w), (xs[0], xs[1], ws[0]));
        flex::tensor(y, vec![xs[0], ws[0]])
    }

    fn linear_backward(x: FlexTensor, w: FlexTensor, dy: FlexTensor, need: LinearGrads) -> Grads<Self> {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        if !flex::all_f32(&[&x, &w, &dy]) || xs[1] != ws[0] || flex::shape(&dy) != [xs[0], ws[1]] {
            let (dx, dw, db) = reference_backward(float::<Self, 2>(x), float(w), float(dy));
            return (need.x.then(|| prim(dx)), need.w.then(|| prim(dw)), need.b.then(|| prim(db)));
        }
        let (dx, dw, db) =
            kernels::linear_backward(&flex::f32s(&x), &flex::f32s(&w), &flex::f32s(&dy), (xs[0], xs[1], ws[1]), need);
        let tensor = flex::tensor;
        (dx.map(|dx| tensor(dx, xs)), dw.map(|dw| tensor(dw, ws.clone())), db.map(|db| tensor(db, vec![ws[1]])))
    }
}

/// One graph node whose backward is the inner backend's (with a bias: three parents, else two).
impl<B: EmberBackend, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    fn linear_forward(x: FloatTensor<Self>, w: FloatTensor<Self>, b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LinearBackward<const N: usize>;
        impl<B: EmberBackend, const N: usize> Backward<B, N> for LinearBackward<N> {
            type State = (FloatTensor<B>, FloatTensor<B>);
            fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
                let node = |i: usize| ops.parents.get(i).cloned().flatten();
                let (node_x, node_w, node_b) = (node(0), node(1), node(2));
                let dy = grads.consume::<B>(&ops.node);
                let (x, w) = ops.state;
                let need = LinearGrads { x: node_x.is_some(), w: node_w.is_some(), b: node_b.is_some() };
                let (dx, dw, db) = B::linear_backward(x, w, dy, need);
                for (node, grad) in [(node_x, dx), (node_w, dw), (node_b, db)] {
                    if let (Some(n), Some(g)) = (node, grad) {
                        grads.register::<B>(n.id, g);
                    }
                }
            }
        }
        // One node type per parent count (the bias is a third parent when there is one).
        macro_rules! node {
            ($n:literal, [$($parent:expr),+], $b:expr) => {
                match LinearBackward::<$n>.prepare::<C>([$($parent.node.clone()),+]).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let y = B::linear_forward(x.primitive.clone(), w.primitive.clone(), $b);
                        prep.finish((x.primitive, w.primitive), y)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::linear_forward(x.primitive, w.primitive, $b)),
                }
            };
        }
        match b {
            Some(b) => node!(3, [x, w, b], Some(b.primitive)),
            None => node!(2, [x, w], None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_close, compare, leaf};
    use super::*;

    #[test]
    fn fused_linear_equals_the_composition() {
        for (m, k, n, bias) in [(1, 3, 2, false), (7, 13, 5, true), (768, 128, 384, true), (96, 344, 128, false)] {
            let mut inputs = vec![leaf([m, k], 8), leaf([k, n], 9)];
            if bias {
                inputs.push(leaf([1, n], 10));
            }
            compare(&format!("linear {m}x{k}x{n} bias {bias}"), inputs, [m, n], &|xs, fused| {
                let b = xs.get(2).map(|b| b.clone().reshape([n]));
                if fused {
                    linear(xs[0].clone(), xs[1].clone(), b)
                } else {
                    reference(xs[0].clone(), xs[1].clone(), b)
                }
            });
        }
    }

    #[test]
    fn transposed_weight_product_equals_the_composition() {
        // 1..=16 rows take the kernel, 17 the composition.
        for (m, k, n) in [(1, 64, 300), (8, 40, 97), (16, 576, 50), (17, 33, 20)] {
            let (x, w) = (leaf([m, k], 4), leaf([n, k], 5));
            let got = float::<Flex, 2>(<Flex as LinearOps>::linear_nt_forward(prim(x.clone()), prim(w.clone())));
            assert_close(&format!("linear_nt {m}x{k}x{n}"), vec![got], vec![x.clone().matmul(w.clone().transpose())]);
            // Under autodiff (the composition, differentiable), values and gradients.
            compare(&format!("linear_nt {m}x{k}x{n} autodiff"), vec![x, w], [m, n], &|xs, fused| {
                if fused {
                    linear_nt(xs[0].clone(), xs[1].clone())
                } else {
                    xs[0].clone().matmul(xs[1].clone().transpose())
                }
            });
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward_and_skips_what_is_not_needed() {
        let (m, k, n) = (11, 7, 5);
        let (x, w, dy) = (leaf([m, k], 1), leaf([k, n], 2), leaf([m, n], 3));
        let need = LinearGrads { x: true, w: true, b: true };
        let (dx, dw, db) =
            <Flex as LinearOps>::linear_backward(prim(x.clone()), prim(w.clone()), prim(dy.clone()), need);
        let got = [dx, dw].into_iter().map(|g| float(g.expect("asked for"))).collect();
        let (want_dx, want_dw, want_db) = reference_backward(x.clone(), w.clone(), dy.clone());
        assert_close("linear", got, vec![want_dx, want_dw]);
        let db = float::<Flex, 1>(db.expect("asked for")).unsqueeze();
        assert_close("linear bias", vec![db], vec![want_db.unsqueeze()]);
        let frozen = LinearGrads { x: true, w: false, b: false };
        let (dx, dw, db) = <Flex as LinearOps>::linear_backward(prim(x), prim(w), prim(dy), frozen);
        assert!(dx.is_some() && dw.is_none() && db.is_none(), "gradients not asked for were computed");
    }
}
