//! Linear layers: `x · w (+ b)`, the backward pass computing only the gradients asked for (a
//! frozen weight's product is never formed).

use std::borrow::Cow;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, bf16, DType, Tensor, TensorMetadata};

use crate::compute::{Compute, Cpu};
use crate::kernels::{self, LinearGrads};
use crate::{flex, float, prim, reference_grads, EmberBackend};

/// The gradients of x, w and b, those not asked for `None`.
pub type Grads<B> = (Option<FloatTensor<B>>, Option<FloatTensor<B>>, Option<FloatTensor<B>>);

/// A backend's linear layer; the default methods are the reference.
pub trait LinearOps: Backend {
    /// # Shapes
    /// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
    fn linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        _cx: Compute,
    ) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(x), float(w), b.map(float)))
    }

    /// The gradients of x, w and b that `need` asks for, given the output gradient.
    fn linear_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        need: LinearGrads,
        _cx: Compute,
    ) -> Grads<Self> {
        let (dx, dw, db) = reference_backward(float::<Self, 2>(x), float(w), float(dy));
        (need.x.then(|| prim(dx)), need.w.then(|| prim(dw)), need.b.then(|| prim(db)))
    }

    /// `x · w (+ b)` with x and b in f32 and the weight kept in bf16 (a model imported with
    /// `--dtype bf16`), in f32. The default widens the weight to f32 and runs
    /// [`LinearOps::linear_forward`]; a kernel reads the bf16 values where they are.
    ///
    /// # Shapes
    /// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
    fn linear_bf16_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        cx: Compute,
    ) -> FloatTensor<Self> {
        Self::linear_forward(x, prim(float::<Self, 2>(w).cast(DType::F32)), b, cx)
    }

    /// `x · wᵀ` with the weight stored `[N, K]` (a tied LM head: the embedding table).
    ///
    /// # Shapes
    /// - x: `[M, K]`, w: `[N, K]` -> `[M, N]`
    fn linear_nt_forward(x: FloatTensor<Self>, w: FloatTensor<Self>, _cx: Compute) -> FloatTensor<Self> {
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
        _cx: Compute,
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
        _cx: Compute,
    ) -> MultiGrads<Self> {
        reference_multi_backward::<Self>(x, ws, dy, need)
    }

    /// Side-by-side linear layers with low-rank updates (LoRA adapters) on some of them:
    /// `x · [w_1 | … | w_p] + [b_1 | … | b_p] + [s_1·(x·a_1)·b_1 | … ]`, `None` where a part has no
    /// update. The default is the composition ([`reference_lora`]); a kernel adds each update into
    /// its columns of the product.
    ///
    /// # Shapes
    /// - x: `[M, K]`, w_i: `[K, N_i]`, bias_i: `[N_i]`, A_i: `[K, r_i]`, B_i: `[r_i, N_i]` -> `[M, Σ N_i]`
    fn linear_lora_forward(
        x: FloatTensor<Self>,
        ws: Vec<FloatTensor<Self>>,
        bs: Vec<FloatTensor<Self>>,
        lora: Vec<Option<LowRank<FloatTensor<Self>>>>,
        _cx: Compute,
    ) -> FloatTensor<Self> {
        reference_lora_of::<Self>(x, ws, bs, lora)
    }

    /// The gradients that `need` asks for: the side-by-side product's and each update's `(A, B)`.
    /// The default forms them all through the composition and keeps those asked for; a kernel never
    /// forms a frozen weight's.
    fn linear_lora_backward(
        x: FloatTensor<Self>,
        ws: Vec<FloatTensor<Self>>,
        lora: Vec<Option<LowRank<FloatTensor<Self>>>>,
        dy: FloatTensor<Self>,
        need: &LoraNeed,
        _cx: Compute,
    ) -> LoraGrads<Self> {
        reference_lora_backward::<Self>(x, ws, lora, dy, need)
    }
}

/// A part's low-rank update in [`linear_lora`]: `scale · (x · a) · b`, a LoRA adapter's.
#[derive(Debug, Clone)]
pub struct LowRank<T> {
    /// `[K, r]`.
    pub a: T,
    /// `[r, N_i]`.
    pub b: T,
    pub scale: f32,
}

impl<T> LowRank<T> {
    /// The same update with `f` applied to both factors.
    pub fn map<U>(self, f: impl Fn(T) -> U) -> LowRank<U> {
        LowRank { a: f(self.a), b: f(self.b), scale: self.scale }
    }
}

/// Which gradients [`LinearOps::linear_lora_backward`] computes: the side-by-side product's, and
/// `(a, b)` of each part that has an update, in the parts' order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraNeed {
    pub multi: MultiNeed,
    pub low_rank: Vec<(bool, bool)>,
}

/// The side-by-side product's gradients and `(da, db)` of each part that has an update, those not
/// asked for `None`.
pub type LoraGrads<B> = (MultiGrads<B>, Vec<(Option<FloatTensor<B>>, Option<FloatTensor<B>>)>);

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
pub fn reference_multi<B: Backend>(
    x: Tensor<B, 2>,
    mut ws: Vec<Tensor<B, 2>>,
    mut bs: Vec<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    if ws.len() == 1 && bs.len() <= 1 {
        // One part: no concatenation (which copies even one tensor).
        return reference(x, ws.remove(0), bs.pop());
    }
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
pub fn linear_multi<B: EmberBackend>(
    x: Tensor<B, 2>,
    ws: Vec<Tensor<B, 2>>,
    bs: Vec<Tensor<B, 1>>,
    cx: Compute,
) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let same = ws.iter().all(|w| w.dtype() == dtype) && bs.iter().all(|b| b.dtype() == dtype);
    if cx.fused::<B>(dtype) && same && !ws.is_empty() && (bs.is_empty() || bs.len() == ws.len()) {
        let (ws, bs) = (ws.into_iter().map(prim).collect(), bs.into_iter().map(prim).collect());
        float(B::linear_multi_forward(prim(x), ws, bs, cx))
    } else {
        reference_multi(x, ws, bs)
    }
}

/// The composition of [`LinearOps::linear_lora_forward`]: the side-by-side product plus each
/// part's update `scale · (x · a) · b` (zeros where a part has none), concatenated.
///
/// # Shapes
/// - x: `[M, K]`, w_i: `[K, N_i]`, bias_i: `[N_i]`, A_i: `[K, r_i]`, B_i: `[r_i, N_i]` -> `[M, Σ N_i]`
pub fn reference_lora<B: Backend>(
    x: Tensor<B, 2>,
    ws: Vec<Tensor<B, 2>>,
    bs: Vec<Tensor<B, 1>>,
    lora: &[Option<LowRank<Tensor<B, 2>>>],
) -> Tensor<B, 2> {
    let (m, dtype, device) = (x.dims()[0], x.dtype(), x.device());
    let updates = ws.iter().zip(lora).map(|(w, update)| match update {
        Some(l) => x.clone().matmul(l.a.clone()).matmul(l.b.clone().mul_scalar(l.scale)),
        None => Tensor::<B, 2>::zeros([m, w.dims()[1]], &device).cast(dtype),
    });
    let updates = Tensor::cat(updates.collect(), 1);
    reference_multi(x, ws, bs) + updates
}

/// [`reference_lora`] on a backend's primitives.
fn reference_lora_of<B: Backend>(
    x: FloatTensor<B>,
    ws: Vec<FloatTensor<B>>,
    bs: Vec<FloatTensor<B>>,
    lora: Vec<Option<LowRank<FloatTensor<B>>>>,
) -> FloatTensor<B> {
    let lora: Vec<_> = lora.into_iter().map(|l| l.map(|l| l.map(float))).collect();
    let (ws, bs) = (ws.into_iter().map(float).collect(), bs.into_iter().map(float).collect());
    prim(reference_lora(float::<B, 2>(x), ws, bs, &lora))
}

/// Side-by-side linear layers with LoRA updates on some of them (`lora`: one entry a weight,
/// `None` where a part has no adapter): one op where the backend has a kernel (on the CPU the
/// updates accumulate into the product's columns, the frozen weights are never differentiated,
/// and neither an update tensor nor a sum of two input gradients is made), else the composition.
///
/// # Shapes
/// - x: `[M, K]`, w_i: `[K, N_i]`, bias_i: `[N_i]`, A_i: `[K, r_i]`, B_i: `[r_i, N_i]` -> `[M, Σ N_i]`
pub fn linear_lora<B: EmberBackend>(
    x: Tensor<B, 2>,
    ws: Vec<Tensor<B, 2>>,
    bs: Vec<Tensor<B, 1>>,
    lora: Vec<Option<LowRank<Tensor<B, 2>>>>,
    cx: Compute,
) -> Tensor<B, 2> {
    let dtype = x.dtype();
    let factors = lora.iter().flatten().flat_map(|l| [&l.a, &l.b]);
    let same = ws.iter().chain(factors).all(|w| w.dtype() == dtype) && bs.iter().all(|b| b.dtype() == dtype);
    let parts_fit = !ws.is_empty() && lora.len() == ws.len() && (bs.is_empty() || bs.len() == ws.len());
    if cx.fused::<B>(dtype) && same && parts_fit {
        let lora = lora.into_iter().map(|l| l.map(|l| l.map(prim))).collect();
        let (ws, bs) = (ws.into_iter().map(prim).collect(), bs.into_iter().map(prim).collect());
        float(B::linear_lora_forward(prim(x), ws, bs, lora, cx))
    } else {
        reference_lora(x, ws, bs, &lora)
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
pub fn linear_nt<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    if cx.fused::<B>(x.dtype()) && w.dtype() == x.dtype() {
        float(B::linear_nt_forward(prim(x), prim(w), cx))
    } else {
        reference_nt(x, w)
    }
}

/// `x · w (+ b)` in f32 with x f32 and the weight kept in bf16 (a model imported with `--dtype
/// bf16`): one op where the backend has a kernel (on the CPU, a few rows multiply the stored bf16
/// values widened in registers, [`crate::bf16_rows`], reading half an f32 weight's bytes), else
/// the weight widened to f32 and multiplied as [`linear`] does.
///
/// # Shapes
/// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
pub fn linear_bf16_weight<B: EmberBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
    cx: Compute,
) -> Tensor<B, 2> {
    let b = b.map(|b| crate::to_dtype(b, DType::F32));
    if cx.fused::<B>(DType::F32) && x.dtype() == DType::F32 && w.dtype() == DType::BF16 {
        float(B::linear_bf16_forward(prim(x), prim(w), b.map(prim), cx))
    } else {
        linear(x, crate::to_dtype(w, DType::F32), b, cx)
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
pub fn linear<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>, cx: Compute) -> Tensor<B, 2> {
    let dtype = x.dtype();
    if cx.fused::<B>(dtype) && w.dtype() == dtype && b.as_ref().is_none_or(|b| b.dtype() == dtype) {
        float(B::linear_forward(prim(x), prim(w), b.map(prim), cx))
    } else {
        reference(x, w, b)
    }
}

impl LinearOps for Flex {
    fn linear_forward(x: FlexTensor, w: FlexTensor, b: Option<FlexTensor>, cx: Compute) -> FlexTensor {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        let bias_fits = b.as_ref().is_none_or(|b| flex::all_f32(&[b]) && flex::shape(b) == [ws[1]]);
        if !flex::all_f32(&[&x, &w]) || !bias_fits || xs[1] != ws[0] {
            // Other dtypes, and shapes that do not fit (which Burn's ops then name).
            return prim(reference(float::<Self, 2>(x), float(w), b.map(float)));
        }
        let b = b.as_ref().map(flex::f32s);
        let y = kernels::linear(cx.linear_cpu(), &flex::f32s(&x), &flex::f32s(&w), b.as_deref(), (xs[0], xs[1], ws[1]));
        flex::tensor(y, vec![xs[0], ws[1]])
    }

    fn linear_bf16_forward(x: FlexTensor, w: FlexTensor, b: Option<FlexTensor>, cx: Compute) -> FlexTensor {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        let bias_fits = b.as_ref().is_none_or(|b| flex::all_f32(&[b]) && flex::shape(b) == [ws[1]]);
        let fits = flex::all_f32(&[&x]) && bias_fits && xs[1] == ws[0] && (1..=kernels::FEW_ROWS).contains(&xs[0]);
        let Some(values) = w.as_slice::<bf16>().filter(|_| fits) else {
            // Many rows (a GEMM's job), a weight that is a view, shapes that do not fit: widened.
            return Self::linear_forward(x, prim(float::<Self, 2>(w).cast(DType::F32)), b, cx);
        };
        let (m, k, n) = (xs[0], xs[1], ws[1]);
        let mut y = match &b {
            Some(b) => flex::f32s(b).repeat(m),
            None => vec![0.0f32; m * n],
        };
        crate::bf16_rows::product(cx.linear_cpu(), &mut y, b.is_some(), &flex::f32s(&x), values, (m, k, n));
        flex::tensor(y, vec![m, n])
    }

    fn linear_nt_forward(x: FlexTensor, w: FlexTensor, cx: Compute) -> FlexTensor {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        if !flex::all_f32(&[&x, &w]) || xs[1] != ws[1] || xs[0] > kernels::FEW_ROWS || w.as_slice::<f32>().is_none() {
            // Many rows (a GEMM's job), other dtypes, a weight that is a view, shapes that do not
            // fit (which Burn's ops then name).
            return prim(reference_nt(float::<Self, 2>(x), float(w)));
        }
        let mut y = vec![0.0f32; xs[0] * ws[0]];
        crate::few_rows::product_nt(cx.linear_cpu(), &mut y, &flex::f32s(&x), &flex::f32s(&w), (xs[0], xs[1], ws[0]));
        flex::tensor(y, vec![xs[0], ws[0]])
    }

    fn linear_backward(x: FlexTensor, w: FlexTensor, dy: FlexTensor, need: LinearGrads, cx: Compute) -> Grads<Self> {
        let (xs, ws) = (flex::shape(&x), flex::shape(&w));
        if !flex::all_f32(&[&x, &w, &dy]) || xs[1] != ws[0] || flex::shape(&dy) != [xs[0], ws[1]] {
            let (dx, dw, db) = reference_backward(float::<Self, 2>(x), float(w), float(dy));
            return (need.x.then(|| prim(dx)), need.w.then(|| prim(dw)), need.b.then(|| prim(db)));
        }
        let (x, w, dy) = (flex::f32s(&x), flex::f32s(&w), flex::f32s(&dy));
        let (dx, dw, db) = kernels::linear_backward(cx.linear_cpu(), &x, &w, &dy, (xs[0], xs[1], ws[1]), need);
        let tensor = flex::tensor;
        (dx.map(|dx| tensor(dx, xs)), dw.map(|dw| tensor(dw, ws.clone())), db.map(|db| tensor(db, vec![ws[1]])))
    }

    fn linear_multi_forward(x: FlexTensor, ws: Vec<FlexTensor>, bs: Vec<FlexTensor>, cx: Compute) -> FlexTensor {
        let Some((m, k, ns)) = multi_fits(&x, &ws, &bs) else {
            let (ws, bs) = (ws.into_iter().map(float).collect(), bs.into_iter().map(float).collect());
            return prim(reference_multi(float::<Self, 2>(x), ws, bs));
        };
        let total = ns.iter().sum();
        flex::tensor(multi_product(cx.linear_cpu(), &flex::f32s(&x), &ws, &bs, (m, k), &ns), vec![m, total])
    }

    fn linear_multi_backward(
        x: FlexTensor,
        ws: Vec<FlexTensor>,
        dy: FlexTensor,
        need: &MultiNeed,
        cx: Compute,
    ) -> MultiGrads<Self> {
        let fits = multi_fits(&x, &ws, &[]).filter(|(m, _, ns)| flex::shape(&dy) == [*m, ns.iter().sum()]);
        let needs_fit = need.w.len() == ws.len() && (need.b.is_empty() || need.b.len() == ws.len());
        let Some((m, k, ns)) = fits.filter(|_| flex::all_f32(&[&dy]) && needs_fit) else {
            return reference_multi_backward::<Self>(x, ws, dy, need);
        };
        let (dx, dws, dbs) = multi_grads(cx.linear_cpu(), &flex::f32s(&x), &ws, &flex::f32s(&dy), (m, k), &ns, need);
        multi_tensors((dx, dws, dbs), (m, k), &ns)
    }

    fn linear_lora_forward(
        x: FlexTensor,
        ws: Vec<FlexTensor>,
        bs: Vec<FlexTensor>,
        lora: Vec<Option<LowRank<FlexTensor>>>,
        cx: Compute,
    ) -> FlexTensor {
        let fits = multi_fits(&x, &ws, &bs).filter(|(_, k, ns)| lora_fits(&lora, *k, ns));
        let Some((m, k, ns)) = fits else {
            return reference_lora_of::<Self>(x, ws, bs, lora);
        };
        let x = flex::f32s(&x);
        let mut y = multi_product(cx.linear_cpu(), &x, &ws, &bs, (m, k), &ns);
        let factors = lora_factors(&lora);
        kernels::add_low_rank(&mut y, &x, &ns, &low_ranks(&factors, &lora), (m, k));
        flex::tensor(y, vec![m, ns.iter().sum()])
    }

    fn linear_lora_backward(
        x: FlexTensor,
        ws: Vec<FlexTensor>,
        lora: Vec<Option<LowRank<FlexTensor>>>,
        dy: FlexTensor,
        need: &LoraNeed,
        cx: Compute,
    ) -> LoraGrads<Self> {
        let Some((m, k, ns)) = lora_backward_fits(&x, &ws, &lora, &dy, need) else {
            return reference_lora_backward::<Self>(x, ws, lora, dy, need);
        };
        let multi = &need.multi;
        let (x, dy) = (flex::f32s(&x), flex::f32s(&dy));
        let (mut dx, dws, dbs) = multi_grads(cx.linear_cpu(), &x, &ws, &dy, (m, k), &ns, multi);
        let factors = lora_factors(&lora);
        let parts = low_ranks(&factors, &lora);
        let grads = kernels::low_rank_backward(&x, &ns, &parts, &dy, (m, k), dx.as_deref_mut(), &need.low_rank);
        let shapes = parts.iter().zip(&ns).filter_map(|(p, &n)| p.as_ref().map(|lr| (lr.rank, n)));
        let low_rank = grads.into_iter().zip(shapes).map(|((da, db), (r, n))| {
            (da.map(|da| flex::tensor(da, vec![k, r])), db.map(|db| flex::tensor(db, vec![r, n])))
        });
        let low_rank = low_rank.collect();
        (multi_tensors((dx, dws, dbs), (m, k), &ns), low_rank)
    }
}

/// The side-by-side product of [`LinearOps::linear_multi_forward`] on tensors that
/// [`multi_fits`] took: one bf16 GEMM of the concatenated weights where `cpu` has a bf16 kernel and
/// it wins, else each weight read where it is.
fn multi_product(
    cpu: Cpu,
    x: &[f32],
    ws: &[FlexTensor],
    bs: &[FlexTensor],
    (m, k): (usize, usize),
    ns: &[usize],
) -> Vec<f32> {
    let total = ns.iter().sum();
    let w: Vec<_> = ws.iter().map(flex::f32s).collect();
    let w: Vec<&[f32]> = w.iter().map(|w| &w[..]).collect();
    let b = (!bs.is_empty()).then(|| bs.iter().flat_map(|b| flex::f32s(b).into_owned()).collect::<Vec<f32>>());
    match kernels::large_bf16(cpu, (m, total, k)) {
        // The bf16 GEMM packs its operands anyway: the weights concatenated for it.
        Some(_) => kernels::linear(cpu, x, &kernels::concat_columns(&w, ns, k), b.as_deref(), (m, k, total)),
        None => kernels::linear_multi(x, &w, ns, b.as_deref(), (m, k)),
    }
}

/// The side-by-side product's gradients as vectors: `dX`, each `dW_i` and each `db_i` that `need`
/// asks for.
type MultiVecs = (Option<Vec<f32>>, Vec<Option<Vec<f32>>>, Vec<Option<Vec<f32>>>);

/// The gradients of [`multi_product`] that `need` asks for, given `dy` `[M, Σ N_i]`.
fn multi_grads(
    cpu: Cpu,
    x: &[f32],
    ws: &[FlexTensor],
    dy: &[f32],
    (m, k): (usize, usize),
    ns: &[usize],
    need: &MultiNeed,
) -> MultiVecs {
    let total: usize = ns.iter().sum();
    let w: Vec<_> = ws.iter().map(flex::f32s).collect();
    let w: Vec<&[f32]> = w.iter().map(|w| &w[..]).collect();
    let (dx, dws) = match kernels::large_bf16(cpu, (m, total, k)).is_some() {
        // Nothing of the product asked for (its input and weights frozen, only an update trained).
        _ if !need.x && !need.w.contains(&true) => (None, vec![None; ns.len()]),
        true => {
            let packed = kernels::concat_columns(&w, ns, k);
            let grads = LinearGrads { x: need.x, w: need.w.iter().any(|&w| w), b: false };
            let (dx, dw, _) = kernels::linear_backward(cpu, x, &packed, dy, (m, k, total), grads);
            let parts = kernels::column_offsets(ns).into_iter().zip(ns.iter().copied());
            let dws = parts
                .zip(&need.w)
                .map(|(part, &want)| dw.as_ref().filter(|_| want).map(|dw| kernels::column_block(dw, total, part, k)));
            (dx, dws.collect())
        }
        false => kernels::linear_multi_backward(x, &w, ns, dy, (m, k), (need.x, &need.w)),
    };
    let parts = kernels::column_offsets(ns).into_iter().zip(ns.iter().copied());
    let dbs = parts.zip(&need.b).map(|(part, &want)| want.then(|| kernels::column_sums(dy, total, part)));
    (dx, dws, dbs.collect())
}

/// [`MultiVecs`] as tensors: `dX` `[M, K]`, `dW_i` `[K, N_i]`, `db_i` `[N_i]`.
fn multi_tensors((dx, dws, dbs): MultiVecs, (m, k): (usize, usize), ns: &[usize]) -> MultiGrads<Flex> {
    let dws = dws.into_iter().zip(ns).map(|(dw, &n)| dw.map(|dw| flex::tensor(dw, vec![k, n]))).collect();
    let dbs = dbs.into_iter().zip(ns).map(|(db, &n)| db.map(|db| flex::tensor(db, vec![n]))).collect();
    (dx.map(|dx| flex::tensor(dx, vec![m, k])), dws, dbs)
}

/// Whether the kernels take these updates: one entry a part, each update's factors f32 `[K, r]`
/// and `[r, N_i]` with `r ≥ 1`.
fn lora_fits(lora: &[Option<LowRank<FlexTensor>>], k: usize, ns: &[usize]) -> bool {
    let fits = |l: &LowRank<FlexTensor>, n: usize| {
        let (a, b) = (flex::shape(&l.a), flex::shape(&l.b));
        flex::all_f32(&[&l.a, &l.b]) && a.len() == 2 && a[0] == k && a[1] >= 1 && b == [a[1], n]
    };
    lora.len() == ns.len() && lora.iter().zip(ns).all(|(l, &n)| l.as_ref().is_none_or(|l| fits(l, n)))
}

/// An update's two factors as f32 slices (contiguous copies of views), `None` for a part without.
type Factors<'a> = Option<(Cow<'a, [f32]>, Cow<'a, [f32]>)>;

/// `(M, K, [N_i])` where the kernels take this backward pass (f32 tensors whose shapes fit, one
/// need a part and a pair of needs an update), else `None`.
fn lora_backward_fits(
    x: &FlexTensor,
    ws: &[FlexTensor],
    lora: &[Option<LowRank<FlexTensor>>],
    dy: &FlexTensor,
    need: &LoraNeed,
) -> Option<(usize, usize, Vec<usize>)> {
    let multi = &need.multi;
    let needs_fit = multi.w.len() == ws.len()
        && (multi.b.is_empty() || multi.b.len() == ws.len())
        && need.low_rank.len() == lora.iter().flatten().count();
    let fits = multi_fits(x, ws, &[]).filter(|(m, k, ns)| {
        flex::all_f32(&[dy]) && flex::shape(dy) == [*m, ns.iter().sum()] && lora_fits(lora, *k, ns)
    });
    fits.filter(|_| needs_fit)
}

/// Each update's factors as f32 slices.
fn lora_factors(lora: &[Option<LowRank<FlexTensor>>]) -> Vec<Factors<'_>> {
    lora.iter().map(|l| l.as_ref().map(|l| (flex::f32s(&l.a), flex::f32s(&l.b)))).collect()
}

/// The kernels' view of the updates whose factors [`lora_factors`] took.
fn low_ranks<'a>(
    factors: &'a [Factors<'a>],
    lora: &[Option<LowRank<FlexTensor>>],
) -> Vec<Option<kernels::LowRank<'a>>> {
    let parts = factors.iter().zip(lora);
    let part = |(f, l): (&'a Factors<'a>, &Option<LowRank<FlexTensor>>)| {
        let ((a, b), l) = (f.as_ref()?, l.as_ref()?);
        Some(kernels::LowRank { a, b, rank: flex::shape(&l.a)[1], scale: l.scale })
    };
    parts.map(part).collect()
}

/// The reference of [`LinearOps::linear_lora_backward`]: the composition's gradients through Burn's
/// autodiff; each bias's, `dy`'s column sums.
fn reference_lora_backward<B: Backend>(
    x: FloatTensor<B>,
    ws: Vec<FloatTensor<B>>,
    lora: Vec<Option<LowRank<FloatTensor<B>>>>,
    dy: FloatTensor<B>,
    need: &LoraNeed,
) -> LoraGrads<B> {
    let (p, dy) = (ws.len(), float::<B, 2>(dy));
    let ns: Vec<usize> = ws.iter().map(|w| w.shape()[1]).collect();
    let scales: Vec<Option<f32>> = lora.iter().map(|l| l.as_ref().map(|l| l.scale)).collect();
    let mut inputs = vec![float::<B, 2>(x)];
    inputs.extend(ws.into_iter().map(float));
    inputs.extend(lora.into_iter().flatten().flat_map(|l| [float(l.a), float(l.b)]));
    let grads = super::reference_grads_of(inputs, dy.clone(), |leaves| {
        let mut factors = leaves[1 + p..].chunks(2);
        let mut update = |scale| {
            let ab = factors.next().expect("two factors an update");
            LowRank { a: ab[0].clone(), b: ab[1].clone(), scale }
        };
        let lora: Vec<_> = scales.iter().map(|s| s.map(&mut update)).collect();
        reference_lora(leaves[0].clone(), leaves[1..=p].to_vec(), vec![], &lora)
    });
    let mut grads = grads.into_iter();
    let dx = grads.next().filter(|_| need.multi.x).map(prim);
    let dws = need.multi.w.iter().map(|&want| grads.next().filter(|_| want).map(prim)).collect();
    let (m, mut at) = (dy.dims()[0], 0);
    let mut dbs = Vec::new();
    for (&n, &want) in ns.iter().zip(&need.multi.b) {
        dbs.push(want.then(|| prim(dy.clone().slice([0..m, at..at + n]).sum_dim(0).reshape([n]))));
        at += n;
    }
    let low_rank = need.low_rank.iter().map(|&(want_a, want_b)| {
        let (da, db) = (grads.next(), grads.next());
        (da.filter(|_| want_a).map(prim), db.filter(|_| want_b).map(prim))
    });
    ((dx, dws, dbs), low_rank.collect())
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

/// One graph node whose backward is the inner backend's (with a bias: three parents, else two).
impl<B: EmberBackend, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    fn linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LinearBackward<const N: usize>;
        impl<B: EmberBackend, const N: usize> Backward<B, N> for LinearBackward<N> {
            type State = (FloatTensor<B>, FloatTensor<B>, Compute);
            fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
                let node = |i: usize| ops.parents.get(i).cloned().flatten();
                let (node_x, node_w, node_b) = (node(0), node(1), node(2));
                let dy = grads.consume::<B>(&ops.node);
                let (x, w, cx) = ops.state;
                let need = LinearGrads { x: node_x.is_some(), w: node_w.is_some(), b: node_b.is_some() };
                let (dx, dw, db) = B::linear_backward(x, w, dy, need, cx);
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
                        let y = B::linear_forward(x.primitive.clone(), w.primitive.clone(), $b, cx);
                        prep.finish((x.primitive, w.primitive, cx), y)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::linear_forward(x.primitive, w.primitive, $b, cx)),
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
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct MultiBackward<const N: usize>;
        impl<B: EmberBackend, const N: usize> Backward<B, N> for MultiBackward<N> {
            /// The input, the weights and how the forward computed.
            type State = (FloatTensor<B>, Vec<FloatTensor<B>>, Compute);
            fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (x, ws, cx) = ops.state;
                let parts = ws.len();
                let need = MultiNeed {
                    x: ops.parents[0].is_some(),
                    w: ops.parents[1..=parts].iter().map(Option::is_some).collect(),
                    b: ops.parents[1 + parts..].iter().map(Option::is_some).collect(),
                };
                let dy = grads.consume::<B>(&ops.node);
                let (dx, dws, dbs) = B::linear_multi_backward(x, ws, dy, &need, cx);
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
                        let saved = (x.primitive.clone(), ws.iter().map(|w| w.primitive.clone()).collect(), cx);
                        prep.finish(saved, B::linear_multi_forward(x.primitive, inner(ws), inner(bs), cx))
                    }
                    OpsKind::UnTracked(prep) => {
                        prep.finish(B::linear_multi_forward(x.primitive, inner(ws), inner(bs), cx))
                    }
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

    /// One graph node with the input, the weights, the biases and each update's two factors as
    /// parents, for 4 to 13 of them (LoRA on one to three parts, with or without biases); other
    /// counts run the composition.
    fn linear_lora_forward(
        x: FloatTensor<Self>,
        ws: Vec<FloatTensor<Self>>,
        bs: Vec<FloatTensor<Self>>,
        lora: Vec<Option<LowRank<FloatTensor<Self>>>>,
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LoraBackward<const N: usize>;
        impl<B: EmberBackend, const N: usize> Backward<B, N> for LoraBackward<N> {
            /// The input, the weights, the updates and how the forward computed.
            type State = (FloatTensor<B>, Vec<FloatTensor<B>>, Vec<Option<LowRank<FloatTensor<B>>>>, Compute);
            fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
                let (x, ws, lora, cx) = ops.state;
                let (parts, updates) = (ws.len(), lora.iter().flatten().count());
                let biases = N - 1 - parts - 2 * updates;
                let (weights, rest) = ops.parents[1..].split_at(parts);
                let (bias_nodes, factors) = rest.split_at(biases);
                let need = LoraNeed {
                    multi: MultiNeed {
                        x: ops.parents[0].is_some(),
                        w: weights.iter().map(Option::is_some).collect(),
                        b: bias_nodes.iter().map(Option::is_some).collect(),
                    },
                    low_rank: factors.chunks(2).map(|ab| (ab[0].is_some(), ab[1].is_some())).collect(),
                };
                let dy = grads.consume::<B>(&ops.node);
                let ((dx, dws, dbs), low_rank) = B::linear_lora_backward(x, ws, lora, dy, &need, cx);
                let factor_grads = low_rank.into_iter().flat_map(|(da, db)| [da, db]);
                let all = std::iter::once(dx).chain(dws).chain(dbs).chain(factor_grads);
                for (node, grad) in ops.parents.iter().zip(all) {
                    if let (Some(n), Some(g)) = (node, grad) {
                        grads.register::<B>(n.id, g);
                    }
                }
            }
        }
        let factors = lora.iter().flatten().flat_map(|l| [&l.a, &l.b]);
        let nodes: Vec<_> = std::iter::once(&x).chain(&ws).chain(&bs).chain(factors).map(|t| t.node.clone()).collect();
        let inner = |ts: Vec<FloatTensor<Self>>| ts.into_iter().map(|t| t.primitive).collect::<Vec<_>>();
        let inner_lora = |lora: Vec<Option<LowRank<FloatTensor<Self>>>>| -> Vec<Option<LowRank<FloatTensor<B>>>> {
            lora.into_iter().map(|l| l.map(|l| l.map(|t| t.primitive))).collect()
        };
        macro_rules! node {
            ($n:literal) => {{
                let parents: [_; $n] = nodes.try_into().expect("the parent count matched");
                match LoraBackward::<$n>.prepare::<C>(parents).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let (x, ws, lora) = (x.primitive, inner(ws), inner_lora(lora));
                        let saved = (x.clone(), ws.clone(), lora.clone(), cx);
                        prep.finish(saved, B::linear_lora_forward(x, ws, inner(bs), lora, cx))
                    }
                    OpsKind::UnTracked(prep) => {
                        prep.finish(B::linear_lora_forward(x.primitive, inner(ws), inner(bs), inner_lora(lora), cx))
                    }
                }
            }};
        }
        match nodes.len() {
            4 => node!(4),
            5 => node!(5),
            6 => node!(6),
            7 => node!(7),
            8 => node!(8),
            9 => node!(9),
            10 => node!(10),
            11 => node!(11),
            12 => node!(12),
            13 => node!(13),
            _ => reference_lora_of::<Self>(x, ws, bs, lora),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, compare, leaf, FusedOrReference, AB};

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
                    linear(xs[0].clone(), xs[1].clone(), b, Compute::default())
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
                    linear_multi(xs[0].clone(), ws, bs, Compute::default())
                } else {
                    reference_multi(xs[0].clone(), ws, bs)
                }
            });
        }
    }

    /// Inputs `[x, w_1…, (b_1…), (a_j, b_j for each adapted part)…]` of a LoRA case, and a closure
    /// building the op (fused or the composition) from their leaves.
    fn lora_case<'a>(
        (m, k): (usize, usize),
        ns: &'a [usize],
        ranks: &'a [usize],
        bias: bool,
    ) -> (Vec<Tensor<Flex, 2>>, Box<FusedOrReference<'a>>) {
        let p = ns.len();
        let mut inputs = vec![leaf([m, k], 31)];
        inputs.extend(ns.iter().enumerate().map(|(i, &n)| leaf([k, n], 32 + i as u64)));
        if bias {
            inputs.extend(ns.iter().enumerate().map(|(i, &n)| leaf([1, n], 40 + i as u64)));
        }
        for (i, (&n, &r)) in ns.iter().zip(ranks).enumerate().filter(|(_, (_, &r))| r > 0) {
            inputs.extend([leaf([k, r], 50 + i as u64), leaf([r, n], 60 + i as u64)]);
        }
        let op = move |xs: &[Tensor<AB, 2>], fused: bool| {
            let ws = xs[1..=p].to_vec();
            let nb = if bias { p } else { 0 };
            let bs: Vec<_> = xs[p + 1..p + 1 + nb].iter().zip(ns).map(|(b, &n)| b.clone().reshape([n])).collect();
            let mut factors = xs[p + 1 + nb..].chunks(2);
            let lora: Vec<_> = ranks
                .iter()
                .enumerate()
                .map(|(i, &r)| {
                    let ab = (r > 0).then(|| factors.next().expect("two factors an adapted part"));
                    ab.map(|ab| LowRank { a: ab[0].clone(), b: ab[1].clone(), scale: 0.75 + i as f32 })
                })
                .collect();
            if fused {
                linear_lora(xs[0].clone(), ws, bs, lora, Compute::default())
            } else {
                reference_lora(xs[0].clone(), ws, bs, &lora)
            }
        };
        (inputs, Box::new(op))
    }

    #[test]
    fn low_rank_updates_inside_the_linear_op_equal_the_composition() {
        // q/k/v with biases, all adapted (13 parents); q and v adapted, no biases (8); gate/up (7);
        // one part alone (4); a part whose update products run on all threads; one row; four
        // parts adapted with biases (17 parents: the composition's path under autodiff); two parts
        // with biases and no update (5 parents: the node, the kernels with nothing to add).
        // (rows, K, the parts' widths, their ranks (0: no update), biases)
        type Case = (usize, usize, &'static [usize], &'static [usize], bool);
        let cases: [Case; 8] = [
            (13, 8, &[8, 4, 4], &[2, 3, 1], true),
            (9, 6, &[6, 2, 2], &[4, 0, 2], false),
            (11, 5, &[7, 7], &[3, 3], false),
            (10, 7, &[5], &[2], false),
            (2048, 16, &[1536], &[8], false),
            (1, 4, &[3, 3], &[2, 0], true),
            (7, 5, &[3, 2, 4, 1], &[1, 1, 1, 1], true),
            (6, 4, &[3, 2], &[0, 0], true),
        ];
        for (m, k, ns, ranks, bias) in cases {
            let (inputs, op) = lora_case((m, k), ns, ranks, bias);
            let name = format!("linear_lora {m}x{k}x{ns:?} ranks {ranks:?} bias {bias}");
            compare(&name, inputs, [m, ns.iter().sum()], &*op);
        }
    }

    #[test]
    fn low_rank_kernels_equal_the_reference_and_compute_only_what_is_asked() {
        let (m, k, ns, ranks) = (12, 6, [5usize, 3, 4], [2usize, 0, 3]);
        let (inputs, _) = lora_case((m, k), &ns, &ranks, false);
        let total = ns.iter().sum();
        let dy = leaf([m, total], 70);
        let lora = |xs: &[Tensor<Flex, 2>]| -> Vec<Option<LowRank<FloatTensor<Flex>>>> {
            let mut factors = xs[4..].chunks(2);
            let mut update = |i: usize| {
                let ab = factors.next().expect("two factors");
                LowRank { a: prim(ab[0].clone()), b: prim(ab[1].clone()), scale: 0.75 + i as f32 }
            };
            ranks.iter().enumerate().map(|(i, &r)| (r > 0).then(|| update(i))).collect()
        };
        let ws = |xs: &[Tensor<Flex, 2>]| xs[1..4].iter().cloned().map(prim).collect::<Vec<_>>();
        // Frozen weights (LoRA), one bias asked for, dA of the first update and dB of the second.
        let need = LoraNeed {
            multi: MultiNeed { x: true, w: vec![false; 3], b: vec![false, true, false] },
            low_rank: vec![(true, false), (false, true)],
        };
        let (x, dy_p) = (prim(inputs[0].clone()), prim(dy.clone()));
        let takes = lora_backward_fits(&x, &ws(&inputs), &lora(&inputs), &dy_p, &need);
        assert_eq!(
            takes,
            Some((m, k, ns.to_vec())),
            "the kernels do not take this case: the test compares the reference with itself"
        );
        let ((dx, dws, dbs), low_rank) = <Flex as LinearOps>::linear_lora_backward(
            x.clone(),
            ws(&inputs),
            lora(&inputs),
            dy_p.clone(),
            &need,
            Compute::default(),
        );
        let ((want_dx, _, want_dbs), want_low_rank) =
            reference_lora_backward::<Flex>(x, ws(&inputs), lora(&inputs), dy_p, &need);
        assert!(dws.iter().all(Option::is_none), "a frozen weight's gradient was formed");
        assert!(dbs[0].is_none() && dbs[2].is_none(), "a bias gradient not asked for was formed");
        assert!(low_rank[0].1.is_none() && low_rank[1].0.is_none(), "a factor gradient not asked for was formed");
        let db = |t: Option<FloatTensor<Flex>>| float::<Flex, 1>(t.expect("asked for")).unsqueeze::<2>();
        let two = |t: Option<FloatTensor<Flex>>| float::<Flex, 2>(t.expect("asked for"));
        let [(da, _), (_, dbb)] = <[_; 2]>::try_from(low_rank).expect("two updates");
        let [(want_da, _), (_, want_dbb)] = <[_; 2]>::try_from(want_low_rank).expect("two updates");
        let [_, want_db1, _] = <[_; 3]>::try_from(want_dbs).expect("three biases");
        let [_, db1, _] = <[_; 3]>::try_from(dbs).expect("three biases");
        assert_close(
            "linear_lora backward",
            vec![two(dx), db(db1), two(da), two(dbb)],
            vec![two(want_dx), db(want_db1), two(want_da), two(want_dbb)],
        );
    }

    #[test]
    fn side_by_side_weights_get_contiguous_gradients_and_frozen_ones_none() {
        let (m, k, ns) = (10, 6, [4usize, 3, 5]);
        let x = Tensor::<AB, 2>::from_inner(leaf([m, k], 1)).require_grad();
        let ws: Vec<Tensor<AB, 2>> =
            ns.iter().enumerate().map(|(i, &n)| Tensor::from_inner(leaf([k, n], 2 + i as u64))).collect();
        let ws: Vec<_> = ws.into_iter().enumerate().map(|(i, w)| if i == 1 { w } else { w.require_grad() }).collect();
        let grads = linear_multi(x.clone(), ws.clone(), vec![], Compute::default()).sum().backward();
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
            let got = float::<Flex, 2>(<Flex as LinearOps>::linear_nt_forward(
                prim(x.clone()),
                prim(w.clone()),
                Compute::default(),
            ));
            assert_close(&format!("linear_nt {m}x{k}x{n}"), vec![got], vec![x.clone().matmul(w.clone().transpose())]);
            // Under autodiff (the composition, differentiable), values and gradients.
            compare(&format!("linear_nt {m}x{k}x{n} autodiff"), vec![x, w], [m, n], &|xs, fused| {
                if fused {
                    linear_nt(xs[0].clone(), xs[1].clone(), Compute::default())
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
        let (dx, dw, db) = <Flex as LinearOps>::linear_backward(
            prim(x.clone()),
            prim(w.clone()),
            prim(dy.clone()),
            need,
            Compute::default(),
        );
        let got = [dx, dw].into_iter().map(|g| float(g.expect("asked for"))).collect();
        let (want_dx, want_dw, want_db) = reference_backward(x.clone(), w.clone(), dy.clone());
        assert_close("linear", got, vec![want_dx, want_dw]);
        let db = float::<Flex, 1>(db.expect("asked for")).unsqueeze();
        assert_close("linear bias", vec![db], vec![want_db.unsqueeze()]);
        let frozen = LinearGrads { x: true, w: false, b: false };
        let (dx, dw, db) = <Flex as LinearOps>::linear_backward(prim(x), prim(w), prim(dy), frozen, Compute::default());
        assert!(dx.is_some() && dw.is_none() && db.is_none(), "gradients not asked for were computed");
    }
}
