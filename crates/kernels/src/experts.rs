//! Grouped expert products, a mixture of experts' GEMMs: the rows of `x` come grouped by expert
//! (`offsets[j]..offsets[j + 1]` are expert `j`'s), and each group is multiplied by its expert's
//! slice of the stacked weight `[E, K, N]`. One GEMM per expert over its contiguous rows; an expert
//! without rows is not read.
//!
//! Under autodiff the products are one graph node. Its backward runs the same grouping: each
//! group's input gradient `dY_j · W_jᵀ` into its rows, and each expert's weight gradient
//! `X_jᵀ · dY_j` into its slice of one `[E, K, N]` gradient (zero for an expert without rows).
//! The composition it replaces, a slice of the weight per expert, makes Burn's autodiff allocate
//! and add a whole `[E, K, N]` gradient for every expert. [`reference`] is that composition.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor};

use crate::compute::Compute;
use crate::kernels::LinearGrads;
use crate::linear::LinearOps;
use crate::{float, prim, EmberBackend};

/// A backend's grouped expert products; the defaults run one of the backend's linear products
/// per expert.
pub trait ExpertOps: LinearOps {
    /// # Shapes
    /// - x: `[P, K]`, w: `[E, K, N]`, `offsets`: `E + 1` row bounds from 0 to P -> `[P, N]`
    fn experts_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: &[usize],
        cx: Compute,
    ) -> FloatTensor<Self> {
        let (x, w) = (float::<Self, 2>(x), float::<Self, 3>(w));
        let [_, k, n] = w.dims();
        let mut parts = Vec::with_capacity(offsets.len());
        for (j, rows) in offsets.windows(2).enumerate() {
            if rows[0] == rows[1] {
                continue;
            }
            let wj = prim(w.clone().slice(j..j + 1).reshape([k, n]));
            let y = Self::linear_forward(prim(x.clone().slice(rows[0]..rows[1])), wj, None, cx);
            parts.push(float::<Self, 2>(y));
        }
        if parts.is_empty() {
            return prim(Tensor::<Self, 2>::zeros([0, n], &x.device()).cast(x.dtype()));
        }
        prim(Tensor::cat(parts, 0))
    }

    /// The input's and the weight's gradients, each when asked for.
    fn experts_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        offsets: &[usize],
        (need_x, need_w): (bool, bool),
        cx: Compute,
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        let (x, w, dy) = (float::<Self, 2>(x), float::<Self, 3>(w), float::<Self, 2>(dy));
        let [e, k, n] = w.dims();
        let device = x.device();
        // An expert without rows gets zeros of the gradients' dtype (the compute dtype's).
        let (dtype_x, dtype_w) = (x.dtype(), w.dtype());
        let need = LinearGrads { x: need_x, w: need_w, b: false };
        let (mut dxs, mut dws) = (Vec::new(), Vec::with_capacity(e));
        for (j, rows) in offsets.windows(2).enumerate() {
            if rows[0] == rows[1] {
                dws.push(Tensor::<Self, 3>::zeros([1, k, n], &device).cast(dtype_w));
                continue;
            }
            let wj = prim(w.clone().slice(j..j + 1).reshape([k, n]));
            let (xj, dyj) = (prim(x.clone().slice(rows[0]..rows[1])), prim(dy.clone().slice(rows[0]..rows[1])));
            let (dx, dw, _) = Self::linear_backward(xj, wj, dyj, need, cx);
            dxs.extend(dx.map(float::<Self, 2>));
            dws.extend(dw.map(|d| float::<Self, 2>(d).reshape([1, k, n])));
        }
        let dx = need_x.then(|| match dxs.is_empty() {
            true => prim(Tensor::<Self, 2>::zeros([0, k], &device).cast(dtype_x)),
            false => prim(Tensor::cat(dxs, 0)),
        });
        (dx, need_w.then(|| prim(Tensor::cat(dws, 0))))
    }
}

/// The grouped products as the composition of Burn ops: a slice of the weight per expert, one
/// matmul each, the outputs concatenated. What [`experts`] is tested against.
///
/// # Shapes
/// - x: `[P, K]`, w: `[E, K, N]` -> `[P, N]`
pub fn reference<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 3>, offsets: &[usize]) -> Tensor<B, 2> {
    let [_, k, n] = w.dims();
    let parts: Vec<Tensor<B, 2>> = offsets
        .windows(2)
        .enumerate()
        .filter(|(_, rows)| rows[0] < rows[1])
        .map(|(j, rows)| x.clone().slice(rows[0]..rows[1]).matmul(w.clone().slice(j..j + 1).reshape([k, n])))
        .collect();
    if parts.is_empty() {
        return Tensor::zeros([0, n], &x.device());
    }
    Tensor::cat(parts, 0)
}

/// The grouped expert products `y[rows_j] = x[rows_j] · w[j]`, in `x`'s dtype (the caller casts).
///
/// # Shapes
/// - x: `[P, K]`, w: `[E, K, N]`, `offsets`: `E + 1` nondecreasing row bounds from 0 to P -> `[P, N]`
///
/// # Panics
/// If `offsets` does not have `E + 1` nondecreasing entries from 0 to P.
pub fn experts<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 3>, offsets: &[usize], cx: Compute) -> Tensor<B, 2> {
    let ([p, _], [e, _, _]) = (x.dims(), w.dims());
    assert!(
        offsets.len() == e + 1 && offsets[0] == 0 && offsets[e] == p && offsets.windows(2).all(|r| r[0] <= r[1]),
        "expert offsets {offsets:?} do not split {p} rows among {e} experts"
    );
    float(B::experts_forward(prim(x), prim(w), offsets, cx))
}

impl ExpertOps for Flex {}

/// One graph node with the input and the stacked weight as parents; the state is both and the
/// offsets.
impl<B: EmberBackend, C: CheckpointStrategy> ExpertOps for Autodiff<B, C> {
    fn experts_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: &[usize],
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct ExpertsBackward;
        impl<B: EmberBackend> Backward<B, 2> for ExpertsBackward {
            type State = (FloatTensor<B>, FloatTensor<B>, Vec<usize>, Compute);
            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node_x, node_w] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, w, offsets, cx) = ops.state;
                let (dx, dw) = B::experts_backward(x, w, dy, &offsets, (node_x.is_some(), node_w.is_some()), cx);
                for (node, grad) in [(node_x, dx), (node_w, dw)] {
                    if let (Some(n), Some(g)) = (node, grad) {
                        grads.register::<B>(n.id, g);
                    }
                }
            }
        }
        match ExpertsBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = B::experts_forward(x.primitive.clone(), w.primitive.clone(), offsets, cx);
                prep.finish((x.primitive, w.primitive, offsets.to_vec(), cx), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::experts_forward(x.primitive, w.primitive, offsets, cx)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};

    type AB = Autodiff<Flex>;

    #[test]
    fn grouped_products_equal_the_sliced_composition_with_both_gradients() {
        let dev = Default::default();
        // Five experts, two without rows (the first and one in the middle), one with a single row.
        let offsets = [0, 0, 3, 4, 4, 9];
        let x = Tensor::<AB, 2>::random([9, 6], Distribution::Normal(0.0, 1.0), &dev);
        let w = Tensor::<AB, 3>::random([5, 6, 7], Distribution::Normal(0.0, 1.0), &dev);
        let dy = Tensor::<AB, 2>::random([9, 7], Distribution::Normal(0.0, 1.0), &dev).detach();
        let run = |grouped: bool| {
            let (x, w) = (x.clone().detach().require_grad(), w.clone().detach().require_grad());
            let y = match grouped {
                true => experts(x.clone(), w.clone(), &offsets, Compute::default()),
                false => reference(x.clone(), w.clone(), &offsets),
            };
            let g = (y.clone() * dy.clone()).sum().backward();
            (y.into_data(), x.grad(&g).unwrap().into_data(), w.grad(&g).unwrap().into_data())
        };
        let (y, dx, dw) = run(true);
        let (y_ref, dx_ref, dw_ref) = run(false);
        y.assert_approx_eq::<f32>(&y_ref, Tolerance::absolute(1e-5));
        dx.assert_approx_eq::<f32>(&dx_ref, Tolerance::absolute(1e-5));
        dw.assert_approx_eq::<f32>(&dw_ref, Tolerance::absolute(1e-5));
        // The experts without rows get zero gradients.
        let dw: Vec<f32> = dw.to_vec().unwrap();
        assert!(dw[..42].iter().chain(&dw[3 * 42..4 * 42]).all(|&v| v == 0.0));
    }

    #[test]
    #[should_panic(expected = "do not split 9 rows among 5 experts")]
    fn offsets_that_do_not_cover_the_rows_are_refused() {
        let dev = Default::default();
        let x = Tensor::<Flex, 2>::zeros([9, 6], &dev);
        let w = Tensor::<Flex, 3>::zeros([5, 6, 7], &dev);
        let _ = experts(x, w, &[0, 1, 2, 3, 4, 8], Compute::default());
    }
}
