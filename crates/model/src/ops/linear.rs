//! Linear layers: `x · w (+ b)`, the backward pass computing only the gradients asked for (a
//! frozen weight's product is never formed).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor, TensorMetadata};

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

    /// Several linear layers of one input (q/k/v, gate/up), their outputs side by side:
    /// `x · [w_1 | … | w_p] + [b_1 | … | b_p]`, the biases all there or all absent. The default
    /// concatenates the weights (the reference); a kernel reads each where it is.
    ///
    /// # Shapes
    /// - x: `[M, K]`, w_i: `[K, N_i]`, b_i: `[N_i]` -> `[M, Σ N_i]`
    fn linear_multi_forward(
        x: FloatTensor<Self>,
        ws: Vec<FloatTensor<Self>>,
        bs: Vec<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        prim(reference_multi(
            float::<Self, 2>(x),
            ws.into_iter().map(float).collect(),
            bs.into_iter().map(float).collect(),
        ))
    }

    /// The gradients of x and of each part's weight and bias that `need` asks for.
    fn linear_multi_backward(
        x: FloatTensor<Self>,
        ws: Vec<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        need: &MultiNeed,
    ) -> MultiGrads<Self> {
        reference_multi_backward::<Self>(x, ws, dy, need)
    }
}

/// Which gradients [`LinearOps::linear_multi_backward`] computes: the input's, each part's weight's,
/// and each part's bias's (empty without biases).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiNeed {
    pub x: bool,
    pub w: Vec<bool>,
    pub b: Vec<bool>,
}

/// The gradients of x, of each part's weight and of each part's bias, those not asked for `None`.
pub type MultiGrads<B> = (Option<FloatTensor<B>>, Vec<Option<FloatTensor<B>>>, Vec<Option<FloatTensor<B>>>);

/// The composition of [`LinearOps::linear_multi_forward`]: the weights (and biases) concatenated,
/// one linear layer.
///
/// # Shapes
/// - x: `[M, K]`, w_i: `[K, N_i]`, b_i: `[N_i]` -> `[M, Σ N_i]`
pub fn reference_multi<B: Backend>(x: Tensor<B, 2>, ws: Vec<Tensor<B, 2>>, bs: Vec<Tensor<B, 1>>) -> Tensor<B, 2> {
    let b = (!bs.is_empty()).then(|| Tensor::cat(bs, 0));
    reference(x, Tensor::cat(ws, 1), b)
}

/// Several linear layers of one input with their outputs side by side (`[M, Σ N_i]`): one op where
/// the backend has a kernel (on the CPU the weights are read where they are, never concatenated,
/// and each weight's gradient comes out contiguous), else the concatenated composition. `bs`: one
/// bias a weight, or none.
///
/// # Shapes
/// - x: `[M, K]`, w_i: `[K, N_i]`, b_i: `[N_i]` -> `[M, Σ N_i]`
pub fn linear_multi<B: EmberBackend>(x: Tensor<B, 2>, ws: Vec<Tensor<B, 2>>, bs: Vec<Tensor<B, 1>>) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let same = ws.iter().all(|w| w.dtype() == dtype) && bs.iter().all(|b| b.dtype() == dtype);
    if B::fused(dtype) && same && !ws.is_empty() && (bs.is_empty() || bs.len() == ws.len()) {
        float(B::linear_multi_forward(prim(x), ws.into_iter().map(prim).collect(), bs.into_iter().map(prim).collect()))
    } else {
        reference_multi(x, ws, bs)
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

    fn linear_multi_forward(x: FlexTensor, ws: Vec<FlexTensor>, bs: Vec<FlexTensor>) -> FlexTensor {
        let Some((m, k, ns)) = multi_fits(&x, &ws, &bs) else {
            let (ws, bs) = (ws.into_iter().map(float).collect(), bs.into_iter().map(float).collect());
            return prim(reference_multi(float::<Self, 2>(x), ws, bs));
        };
        let total = ns.iter().sum();
        let w: Vec<_> = ws.iter().map(flex::f32s).collect();
        let w: Vec<&[f32]> = w.iter().map(|w| &w[..]).collect();
        let b = (!bs.is_empty()).then(|| bs.iter().flat_map(|b| flex::f32s(b).into_owned()).collect::<Vec<f32>>());
        let x = flex::f32s(&x);
        let y = match multi_in_bf16(m, k, total) {
            // The bf16 GEMM packs its operands anyway: the weights concatenated for it.
            true => kernels::linear_in(&x, &kernels::concat_columns(&w, &ns, k), b.as_deref(), (m, k, total), true),
            false => kernels::linear_multi(&x, &w, &ns, b.as_deref(), (m, k)),
        };
        flex::tensor(y, vec![m, total])
    }

    fn linear_multi_backward(x: FlexTensor, ws: Vec<FlexTensor>, dy: FlexTensor, need: &MultiNeed) -> MultiGrads<Self> {
        let fits = multi_fits(&x, &ws, &[]).filter(|(m, _, ns)| flex::shape(&dy) == [*m, ns.iter().sum()]);
        let needs_fit = need.w.len() == ws.len() && (need.b.is_empty() || need.b.len() == ws.len());
        let Some((m, k, ns)) = fits.filter(|_| flex::all_f32(&[&dy]) && needs_fit) else {
            return reference_multi_backward::<Self>(x, ws, dy, need);
        };
        let total: usize = ns.iter().sum();
        let w: Vec<_> = ws.iter().map(flex::f32s).collect();
        let w: Vec<&[f32]> = w.iter().map(|w| &w[..]).collect();
        let (x, dy) = (flex::f32s(&x), flex::f32s(&dy));
        let (dx, dws) = match multi_in_bf16(m, k, total) {
            true => {
                let packed = kernels::concat_columns(&w, &ns, k);
                let grads = LinearGrads { x: need.x, w: need.w.iter().any(|&w| w), b: false };
                let (dx, dw, _) = kernels::linear_backward_in(&x, &packed, &dy, (m, k, total), grads, true);
                let parts = ns.iter().scan(0, |at, &n| Some((std::mem::replace(at, *at + n), n)));
                let dws = parts.zip(&need.w).map(|(part, &want)| {
                    dw.as_ref().filter(|_| want).map(|dw| kernels::column_block(dw, total, part, k))
                });
                (dx, dws.collect())
            }
            false => kernels::linear_multi_backward(&x, &w, &ns, &dy, (m, k), (need.x, &need.w)),
        };
        let mut at = 0;
        let dbs = ns.iter().zip(&need.b).map(|(&n, &want)| {
            let part = want.then(|| {
                let mut db = vec![0.0f32; n];
                for row in dy.chunks_exact(total) {
                    db.iter_mut().zip(&row[at..at + n]).for_each(|(a, b)| *a += b);
                }
                flex::tensor(db, vec![n])
            });
            at += n;
            part
        });
        let dbs: Vec<_> = dbs.collect();
        let dws = dws.into_iter().zip(&ns).map(|(dw, &n)| dw.map(|dw| flex::tensor(dw, vec![k, n]))).collect();
        (dx.map(|dx| flex::tensor(dx, vec![m, k])), dws, dbs)
    }
}

/// The reference of [`LinearOps::linear_multi_backward`]: the concatenated composition's gradients
/// through Burn's autodiff, the parts' gradients sliced out of them.
fn reference_multi_backward<B: Backend>(
    x: FloatTensor<B>,
    ws: Vec<FloatTensor<B>>,
    dy: FloatTensor<B>,
    need: &MultiNeed,
) -> MultiGrads<B> {
    let ns: Vec<usize> = ws.iter().map(|w| w.shape()[1]).collect();
    let w = Tensor::cat(ws.into_iter().map(float::<B, 2>).collect(), 1);
    let (dx, dw, db) = reference_backward(float::<B, 2>(x), w, float(dy));
    let (mut dws, mut dbs, mut at) = (Vec::new(), Vec::new(), 0);
    for (i, &n) in ns.iter().enumerate() {
        dws.push(need.w.get(i).is_some_and(|&w| w).then(|| prim(dw.clone().slice([0..dw.dims()[0], at..at + n]))));
        dbs.push(need.b.get(i).is_some_and(|&b| b).then(|| prim(db.clone().slice(at..at + n))));
        at += n;
    }
    (need.x.then(|| prim(dx)), dws, dbs)
}

/// `(M, K, [N_i])` where the kernels take these tensors (all f32, `x` `[M, K]`, each weight
/// `[K, N_i]`, each bias `[N_i]`, one bias a weight or none), else `None`.
fn multi_fits(x: &FlexTensor, ws: &[FlexTensor], bs: &[FlexTensor]) -> Option<(usize, usize, Vec<usize>)> {
    let xs = flex::shape(x);
    let f32s = flex::all_f32(&[x]) && ws.iter().chain(bs).all(|t| flex::all_f32(&[t]));
    let ws: Vec<Vec<usize>> = ws.iter().map(flex::shape).collect();
    let fits = xs.len() == 2
        && !ws.is_empty()
        && ws.iter().all(|w| w.len() == 2 && w[0] == xs[1])
        && (bs.is_empty() || bs.len() == ws.len())
        && bs.iter().zip(&ws).all(|(b, w)| flex::shape(b) == [w[1]]);
    (f32s && fits).then(|| (xs[0], xs[1], ws.iter().map(|w| w[1]).collect()))
}

/// Whether a side-by-side product runs as one bf16 GEMM of the concatenated weight.
fn multi_in_bf16(m: usize, k: usize, total: usize) -> bool {
    kernels::bf16_gemms() && super::bf16_gemm::supported() && kernels::bf16_worth_it(m, total, k)
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

    /// One graph node with the input, the weights and the biases as parents, for 3, 4, 5 or 7 of
    /// them (two or three parts with or without biases, or four or six without); other counts run
    /// the composition.
    fn linear_multi_forward(
        x: FloatTensor<Self>,
        ws: Vec<FloatTensor<Self>>,
        bs: Vec<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct MultiBackward<const N: usize>;
        impl<B: EmberBackend, const N: usize> Backward<B, N> for MultiBackward<N> {
            /// The input and the weights.
            type State = (FloatTensor<B>, Vec<FloatTensor<B>>);
            fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (x, ws) = ops.state;
                let parts = ws.len();
                let need = MultiNeed {
                    x: ops.parents[0].is_some(),
                    w: ops.parents[1..=parts].iter().map(Option::is_some).collect(),
                    b: ops.parents[1 + parts..].iter().map(Option::is_some).collect(),
                };
                let dy = grads.consume::<B>(&ops.node);
                let (dx, dws, dbs) = B::linear_multi_backward(x, ws, dy, &need);
                for (node, grad) in ops.parents.iter().zip(std::iter::once(dx).chain(dws).chain(dbs)) {
                    if let (Some(n), Some(g)) = (node, grad) {
                        grads.register::<B>(n.id, g);
                    }
                }
            }
        }
        let nodes: Vec<_> = std::iter::once(&x).chain(&ws).chain(&bs).map(|t| t.node.clone()).collect();
        let inner = |ts: Vec<FloatTensor<Self>>| ts.into_iter().map(|t| t.primitive).collect::<Vec<_>>();
        macro_rules! node {
            ($n:literal) => {{
                let parents: [_; $n] = nodes.try_into().expect("the parent count matched");
                match MultiBackward::<$n>.prepare::<C>(parents).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let saved = (x.primitive.clone(), ws.iter().map(|w| w.primitive.clone()).collect());
                        prep.finish(saved, B::linear_multi_forward(x.primitive, inner(ws), inner(bs)))
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::linear_multi_forward(x.primitive, inner(ws), inner(bs))),
                }
            }};
        }
        match nodes.len() {
            3 => node!(3),
            4 => node!(4),
            5 => node!(5),
            7 => node!(7),
            _ => prim(reference_multi::<Self>(
                float(x),
                ws.into_iter().map(float).collect(),
                bs.into_iter().map(float).collect(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{assert_close, compare, leaf, AB};
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
    fn side_by_side_linear_layers_equal_the_concatenated_composition() {
        // Two parts (gate/up), three with biases (Qwen2's q/k/v), four without (five parents),
        // four with biases (nine parents: the composition's path under autodiff), a forward whose
        // largest product runs on all threads (≥ 50 MFLOP), one row.
        let cases: [(usize, usize, &[usize], bool); 6] = [
            (9, 6, &[5, 7], false),
            (13, 8, &[8, 4, 4], true),
            (7, 5, &[3, 2, 4, 1], false),
            (7, 5, &[3, 2, 4, 1], true),
            (600, 128, &[384, 128, 128], false),
            (1, 4, &[3, 3], true),
        ];
        for (m, k, ns, bias) in cases {
            let mut inputs = vec![leaf([m, k], 11)];
            inputs.extend(ns.iter().enumerate().map(|(i, &n)| leaf([k, n], 12 + i as u64)));
            if bias {
                inputs.extend(ns.iter().enumerate().map(|(i, &n)| leaf([1, n], 20 + i as u64)));
            }
            let total = ns.iter().sum();
            let p = ns.len();
            compare(&format!("linear_multi {m}x{k}x{ns:?} bias {bias}"), inputs, [m, total], &|xs, fused| {
                let ws = xs[1..=p].to_vec();
                let bs = xs[p + 1..].iter().zip(ns).map(|(b, &n)| b.clone().reshape([n])).collect();
                if fused {
                    linear_multi(xs[0].clone(), ws, bs)
                } else {
                    reference_multi(xs[0].clone(), ws, bs)
                }
            });
        }
    }

    #[test]
    fn side_by_side_weights_get_contiguous_gradients_and_frozen_ones_none() {
        let (m, k, ns) = (10, 6, [4usize, 3, 5]);
        let x = Tensor::<AB, 2>::from_inner(leaf([m, k], 1)).require_grad();
        let ws: Vec<Tensor<AB, 2>> =
            ns.iter().enumerate().map(|(i, &n)| Tensor::from_inner(leaf([k, n], 2 + i as u64))).collect();
        let ws: Vec<_> = ws.into_iter().enumerate().map(|(i, w)| if i == 1 { w } else { w.require_grad() }).collect();
        let grads = linear_multi(x.clone(), ws.clone(), vec![]).sum().backward();
        assert!(ws[1].grad(&grads).is_none(), "the frozen weight got a gradient");
        for i in [0, 2] {
            let g = ws[i].grad(&grads).expect("gradient").into_primitive().tensor();
            assert!(g.as_slice::<f32>().is_some(), "weight {i}: its gradient is a view, which the optimizer copies");
            // Each entry of dW_i = Xᵀ · 1: the column sums of x.
            let want = x.clone().inner().sum_dim(0).transpose().repeat_dim(1, ns[i]);
            assert_close(
                &format!("dW {i}"),
                vec![Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(g))],
                vec![want],
            );
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
