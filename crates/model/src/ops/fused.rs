//! Fused ops at the tensor level: RMSNorm, SwiGLU, and RoPE + causal grouped-query attention.
//!
//! Each op has a reference, the plain composition of Burn tensor ops the model used before (in
//! [`reference`]), which every backend without fused kernels keeps running (WGPU, CUDA, NdArray).
//! On Flex in f32 the ops run the CPU kernels of [`super::kernels`]; under autodiff they are single
//! graph nodes whose backward runs the kernels' backward passes. The tests compare both paths,
//! values and gradients.

use std::borrow::Cow;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};

use super::kernels::{self, AttnShape, LinearGrads};
use super::{float, EmberBackend};

/// The plain compositions: the reference implementations and the path of backends without kernels.
pub mod reference {
    use burn::tensor::activation::silu;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{backend::Backend, DType, Tensor};

    use crate::attention::{masked_attention, repeat_kv};
    use crate::documents::Documents;
    use crate::rope::Rope;

    /// # Shapes
    /// - x: `[N, D]`, w: `[D]` -> `[N, D]`
    pub fn rms_norm<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
        let dtype = x.dtype();
        let x = crate::to_dtype(x, DType::F32);
        let inv_rms = x.clone().square().mean_dim(1).add_scalar(eps).sqrt().recip(); // [N, 1]
        crate::to_dtype(x * inv_rms, dtype) * crate::to_dtype(w, dtype).unsqueeze::<2>()
    }

    /// # Shapes
    /// - gu: `[N, 2F]` (rows `[g | u]`) -> `[N, F]`
    pub fn swiglu_packed<B: Backend>(gu: Tensor<B, 2>) -> Tensor<B, 2> {
        let f = gu.dims()[1] / 2;
        silu(gu.clone().narrow(1, 0, f)) * gu.narrow(1, f, f)
    }

    /// # Shapes
    /// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
    pub fn linear<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
        burn::tensor::module::linear(x, w, b)
    }

    /// [`attention_rope`] of packed `[q | k | v]` rows.
    ///
    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> `[B·T, H·Dh]`
    pub fn attention_rope_packed<B: Backend>(
        qkv: Tensor<B, 2>,
        rope: &Rope<B>,
        (b, t): (usize, usize),
        (h, kh, dh): (usize, usize, usize),
        start: usize,
        docs: Option<&Documents>,
    ) -> Tensor<B, 2> {
        let q = qkv.clone().narrow(1, 0, h * dh);
        let k = qkv.clone().narrow(1, h * dh, kh * dh);
        let v = qkv.narrow(1, (h + kh) * dh, kh * dh);
        attention_rope(q, k, v, rope, (b, t), (h, kh, dh), start, docs)
    }

    /// RoPE on q and k, then causal attention with key/value heads shared by `H/K` query heads.
    /// With `docs`, positions restart and attention stays inside each document.
    ///
    /// # Shapes
    /// - q: `[B·T, H·Dh]`, k, v: `[B·T, K·Dh]` (rows of `[B, T, heads, Dh]`) -> `[B·T, H·Dh]`
    #[allow(clippy::too_many_arguments)]
    pub fn attention_rope<B: Backend>(
        q: Tensor<B, 2>,
        k: Tensor<B, 2>,
        v: Tensor<B, 2>,
        rope: &Rope<B>,
        (b, t): (usize, usize),
        (h, kh, dh): (usize, usize, usize),
        start: usize,
        docs: Option<&Documents>,
    ) -> Tensor<B, 2> {
        let heads = |y: Tensor<B, 2>, n: usize| y.reshape([b, t, n, dh]).swap_dims(1, 2); // [B, n, T, Dh]
        let (q, k, v) = (heads(q, h), heads(k, kh), heads(v, kh));
        let o = match docs {
            Some(docs) => {
                let positions = docs.positions(start);
                let (q, k) = (rope.apply_positions(q, &positions), rope.apply_positions(k, &positions));
                let (k, v) = (repeat_kv(k, h / kh), repeat_kv(v, h / kh)); // [B, H, T, Dh]
                let hidden = docs.hidden_mask::<B>(None, &q.device()); //      [B, 1, T, T]
                masked_attention(q, k, v, Some(hidden), DType::F32)
            }
            None => {
                let (q, k) = (rope.apply(q, start), rope.apply(k, start));
                let (k, v) = (repeat_kv(k, h / kh), repeat_kv(v, h / kh)); // [B, H, T, Dh]
                let opts = AttentionModuleOptions { is_causal: true, ..Default::default() };
                attention(q, k, v, None, None, opts)
            }
        };
        o.swap_dims(1, 2).reshape([b * t, h * dh])
    }
}

fn flex_f32(t: &FlexTensor) -> Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(t.to_contiguous().as_slice::<f32>().expect("contiguous f32").to_vec()),
    }
}

/// A tensor whose storage holds exactly its elements in order, so that `storage_mut` can update it
/// in place (copying first only when the storage is shared).
fn flex_exclusive(t: FlexTensor) -> FlexTensor {
    let n: usize = shape_of(&t).iter().product();
    if t.as_slice::<f32>().is_some() && t.storage::<f32>().len() == n {
        t
    } else {
        t.to_contiguous()
    }
}

fn flex_new(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn shape_of(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

/// The CPU kernels, for f32 tensors.
/// Whether the CPU kernels are switched off with `EMBER_FUSED=0` (read once): the model then runs
/// the reference compositions, to compare speeds or to rule the kernels out when debugging.
fn kernels_disabled() -> bool {
    static DISABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DISABLED.get_or_init(|| std::env::var("EMBER_FUSED").is_ok_and(|v| v == "0"))
}

impl EmberBackend for Flex {
    fn fused(dtype: DType) -> bool {
        dtype == DType::F32 && !kernels_disabled()
    }

    fn native_low_precision() -> bool {
        false
    }

    fn rms_norm_fused(x: FlexTensor, w: FlexTensor, eps: f64) -> FlexTensor {
        let shape = shape_of(&x);
        flex_new(kernels::rms_norm(&flex_f32(&x), &flex_f32(&w), eps as f32), shape)
    }

    fn rms_norm_fused_backward(x: FlexTensor, w: FlexTensor, dy: FlexTensor, eps: f64) -> (FlexTensor, FlexTensor) {
        let (xs, ws) = (shape_of(&x), shape_of(&w));
        let (dx, dw) = kernels::rms_norm_backward(&flex_f32(&x), &flex_f32(&w), &flex_f32(&dy), eps as f32);
        (flex_new(dx, xs), flex_new(dw, ws))
    }

    fn swiglu_fused(gu: FlexTensor) -> FlexTensor {
        let shape = shape_of(&gu);
        let f = shape[1] / 2;
        flex_new(kernels::swiglu_packed(&flex_f32(&gu), f), vec![shape[0], f])
    }

    fn swiglu_fused_backward(gu: FlexTensor, dy: FlexTensor) -> FlexTensor {
        let shape = shape_of(&gu);
        flex_new(kernels::swiglu_packed_backward(&flex_f32(&gu), &flex_f32(&dy), shape[1] / 2), shape)
    }

    fn linear_fused(x: FlexTensor, w: FlexTensor, b: Option<FlexTensor>) -> FlexTensor {
        let (xs, ws) = (shape_of(&x), shape_of(&w));
        let b = b.as_ref().map(flex_f32);
        let y = kernels::linear(&flex_f32(&x), &flex_f32(&w), b.as_deref(), (xs[0], xs[1], ws[1]));
        flex_new(y, vec![xs[0], ws[1]])
    }

    fn linear_fused_backward(
        x: FlexTensor,
        w: FlexTensor,
        dy: FlexTensor,
        need: LinearGrads,
    ) -> (Option<FlexTensor>, Option<FlexTensor>, Option<FlexTensor>) {
        let (xs, ws) = (shape_of(&x), shape_of(&w));
        let (dx, dw, db) =
            kernels::linear_backward(&flex_f32(&x), &flex_f32(&w), &flex_f32(&dy), (xs[0], xs[1], ws[1]), need);
        (dx.map(|dx| flex_new(dx, xs)), dw.map(|dw| flex_new(dw, ws.clone())), db.map(|db| flex_new(db, vec![ws[1]])))
    }

    fn adamw_fused(
        p: FlexTensor,
        g: FlexTensor,
        m: FlexTensor,
        v: FlexTensor,
        h: super::AdamWStep,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        if [&p, &g, &m, &v].iter().any(|t| t.dtype() != DType::F32) {
            let (p, m, v) = super::adamw_reference(float::<Self, 1>(p), float(g), float(m), float(v), h);
            return (p.into_primitive().tensor(), m.into_primitive().tensor(), v.into_primitive().tensor());
        }
        let (mut p, mut m, mut v) = (flex_exclusive(p), flex_exclusive(m), flex_exclusive(v));
        kernels::adamw(p.storage_mut(), &flex_f32(&g), m.storage_mut(), v.storage_mut(), &h);
        (p, m, v)
    }

    fn sum_squares(x: FlexTensor) -> FlexTensor {
        if x.dtype() != DType::F32 {
            return float::<Self, 1>(x).square().sum().into_primitive().tensor();
        }
        flex_new(vec![kernels::sum_squares(&flex_f32(&x)) as f32], vec![1])
    }

    fn attention_fused(qkv: FlexTensor, cos: FlexTensor, sin: FlexTensor, s: AttnShape) -> AttentionSaved<Self> {
        let rows = shape_of(&qkv)[0];
        let qkv_rot = kernels::rope_packed(&flex_f32(&qkv), &s, &flex_f32(&cos), &flex_f32(&sin), false);
        let out = kernels::attention(&qkv_rot, &s);
        AttentionSaved {
            o: flex_new(out.o, vec![rows, s.heads * s.head_dim]),
            lse: flex_new(out.lse, vec![s.batch * s.heads * s.seq]),
            qkv_rot: flex_new(qkv_rot, vec![rows, s.packed_width()]),
        }
    }

    fn attention_fused_backward(
        saved: AttentionSaved<Self>,
        d_o: FlexTensor,
        cos: FlexTensor,
        sin: FlexTensor,
        s: AttnShape,
    ) -> FlexTensor {
        let shape = shape_of(&saved.qkv_rot);
        let (o, lse) = (flex_f32(&saved.o), flex_f32(&saved.lse));
        let d_rot = kernels::attention_backward(&flex_f32(&saved.qkv_rot), (&o, &lse), &flex_f32(&d_o), &s);
        flex_new(kernels::rope_packed(&d_rot, &s, &flex_f32(&cos), &flex_f32(&sin), true), shape)
    }
}

/// What the fused attention keeps for its backward pass.
#[derive(Debug, Clone)]
pub struct AttentionSaved<B: Backend> {
    /// `[B·T, H·Dh]`
    pub o: FloatTensor<B>,
    /// `[B·H·T]`
    pub lse: FloatTensor<B>,
    /// `[B·T, (H + 2K)·Dh]`: the packed q/k/v after RoPE.
    pub qkv_rot: FloatTensor<B>,
}

/// Autodiff over a backend with kernels: each fused op is one node with its own backward.
pub(super) fn rms_norm_autodiff<B: EmberBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    eps: f64,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct RmsNormBackward;
    impl<B: EmberBackend> Backward<B, 2> for RmsNormBackward {
        type State = (FloatTensor<B>, FloatTensor<B>, f64);
        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node_x, node_w] = ops.parents;
            let dy = grads.consume::<B>(&ops.node);
            let (x, w, eps) = ops.state;
            let (dx, dw) = B::rms_norm_fused_backward(x, w, dy, eps);
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
            let y = B::rms_norm_fused(x.primitive.clone(), w.primitive.clone(), eps);
            prep.finish((x.primitive, w.primitive, eps), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::rms_norm_fused(x.primitive, w.primitive, eps)),
    }
}

pub(super) fn swiglu_autodiff<B: EmberBackend, C: CheckpointStrategy>(
    gu: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct SwigluBackward;
    impl<B: EmberBackend> Backward<B, 1> for SwigluBackward {
        type State = FloatTensor<B>;
        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node] = ops.parents;
            let dy = grads.consume::<B>(&ops.node);
            if let Some(n) = node {
                grads.register::<B>(n.id, B::swiglu_fused_backward(ops.state, dy));
            }
        }
    }
    match SwigluBackward.prepare::<C>([gu.node.clone()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let y = B::swiglu_fused(gu.primitive.clone());
            prep.finish(gu.primitive, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::swiglu_fused(gu.primitive)),
    }
}

pub(super) fn linear_autodiff<B: EmberBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
    b: Option<FloatTensor<Autodiff<B, C>>>,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct LinearBackward;
    impl<B: EmberBackend> Backward<B, 3> for LinearBackward {
        type State = (FloatTensor<B>, FloatTensor<B>);
        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node_x, node_w, node_b] = ops.parents;
            let dy = grads.consume::<B>(&ops.node);
            let (x, w) = ops.state;
            let need = LinearGrads { x: node_x.is_some(), w: node_w.is_some(), b: node_b.is_some() };
            let (dx, dw, db) = B::linear_fused_backward(x, w, dy, need);
            for (node, grad) in [(node_x, dx), (node_w, dw), (node_b, db)] {
                if let (Some(n), Some(g)) = (node, grad) {
                    grads.register::<B>(n.id, g);
                }
            }
        }
    }
    #[derive(Debug)]
    struct LinearNoBiasBackward;
    impl<B: EmberBackend> Backward<B, 2> for LinearNoBiasBackward {
        type State = (FloatTensor<B>, FloatTensor<B>);
        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node_x, node_w] = ops.parents;
            let dy = grads.consume::<B>(&ops.node);
            let (x, w) = ops.state;
            let need = LinearGrads { x: node_x.is_some(), w: node_w.is_some(), b: false };
            let (dx, dw, _) = B::linear_fused_backward(x, w, dy, need);
            for (node, grad) in [(node_x, dx), (node_w, dw)] {
                if let (Some(n), Some(g)) = (node, grad) {
                    grads.register::<B>(n.id, g);
                }
            }
        }
    }
    let forward = |x: FloatTensor<B>, w: FloatTensor<B>, b: Option<FloatTensor<B>>| B::linear_fused(x, w, b);
    match b {
        Some(b) => match LinearBackward
            .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = forward(x.primitive.clone(), w.primitive.clone(), Some(b.primitive));
                prep.finish((x.primitive, w.primitive), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive, w.primitive, Some(b.primitive))),
        },
        None => match LinearNoBiasBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = forward(x.primitive.clone(), w.primitive.clone(), None);
                prep.finish((x.primitive, w.primitive), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive, w.primitive, None)),
        },
    }
}

pub(super) fn attention_autodiff<B: EmberBackend, C: CheckpointStrategy>(
    qkv: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    s: AttnShape,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct AttentionBackward;
    impl<B: EmberBackend> Backward<B, 1> for AttentionBackward {
        type State = (AttentionSaved<B>, FloatTensor<B>, FloatTensor<B>, AttnShape);
        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node] = ops.parents;
            let d_o = grads.consume::<B>(&ops.node);
            let (saved, cos, sin, s) = ops.state;
            if let Some(n) = node {
                grads.register::<B>(n.id, B::attention_fused_backward(saved, d_o, cos, sin, s));
            }
        }
    }
    let prep = AttentionBackward.prepare::<C>([qkv.node.clone()]).compute_bound().stateful();
    let saved = B::attention_fused(qkv.primitive, cos.clone(), sin.clone(), s.clone());
    match prep {
        OpsKind::Tracked(prep) => {
            let o = saved.o.clone();
            prep.finish((saved, cos, sin, s), o)
        }
        OpsKind::UnTracked(prep) => prep.finish(saved.o),
    }
}

/// RMSNorm through the fused kernel where the backend has one, else the composition.
///
/// # Shapes
/// - x: `[N, D]`, w: `[D]` -> `[N, D]`
pub fn rms_norm<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    if B::fused(x.dtype()) && w.dtype() == x.dtype() {
        float(B::rms_norm_fused(x.into_primitive().tensor(), w.into_primitive().tensor(), eps))
    } else {
        reference::rms_norm(x, w, eps)
    }
}

/// `silu(g) · u` of packed rows `[g | u]`.
///
/// # Shapes
/// - gu: `[N, 2F]` -> `[N, F]`
pub fn swiglu_packed<B: EmberBackend>(gu: Tensor<B, 2>) -> Tensor<B, 2> {
    if B::fused(gu.dtype()) {
        float(B::swiglu_fused(gu.into_primitive().tensor()))
    } else {
        reference::swiglu_packed(gu)
    }
}

/// `x · w (+ b)`; on CPU kernels the two products of the backward pass run side by side.
///
/// # Shapes
/// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
pub fn linear<B: EmberBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>, b: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    let dtype = x.dtype();
    if B::fused(dtype) && w.dtype() == dtype && b.as_ref().is_none_or(|b| b.dtype() == dtype) {
        let b = b.map(|b| b.into_primitive().tensor());
        float(B::linear_fused(x.into_primitive().tensor(), w.into_primitive().tensor(), b))
    } else {
        reference::linear(x, w, b)
    }
}

/// RoPE and causal grouped-query attention over packed `[q | k | v]` rows of whole sequences
/// starting at position `start`; with `docs`, block-diagonal: each document of a row restarts its
/// positions and sees only itself.
///
/// # Shapes
/// - qkv: `[B·T, (H + 2K)·Dh]` -> `[B·T, H·Dh]`
pub fn attention_rope_packed<B: EmberBackend>(
    qkv: Tensor<B, 2>,
    rope: &crate::rope::Rope<B>,
    (b, t): (usize, usize),
    (h, kh, dh): (usize, usize, usize),
    start: usize,
    docs: Option<&crate::documents::Documents>,
) -> Tensor<B, 2> {
    if !(B::fused(qkv.dtype()) && start + t <= rope.max_seq_len()) {
        return reference::attention_rope_packed(qkv, rope, (b, t), (h, kh, dh), start, docs);
    }
    let s = AttnShape {
        batch: b,
        seq: t,
        heads: h,
        kv_heads: kh,
        head_dim: dh,
        start,
        layout: rope.layout(),
        scale: 1.0 / (dh as f32).sqrt(),
        docs: docs.map(|d| d.first_positions().clone()),
    };
    let (cos, sin) = rope.tables();
    float(B::attention_op(
        qkv.into_primitive().tensor(),
        cos.into_primitive().tensor(),
        sin.into_primitive().tensor(),
        s,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeLayout;
    use crate::documents::Documents;
    use crate::rope::Rope;
    use burn::tensor::Distribution;

    type AB = Autodiff<Flex>;

    fn rel_err(a: Tensor<Flex, 2>, b: Tensor<Flex, 2>) -> f32 {
        // Floor: a gradient that is zero in theory (one key per query) is compared absolutely.
        let scale = b.clone().abs().max().into_scalar().max(0.1);
        (a - b).abs().max().into_scalar() / scale
    }

    fn leaf(shape: [usize; 2], seed: u64) -> Tensor<Flex, 2> {
        <Flex as Backend>::seed(&Default::default(), seed);
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
    }

    /// An op under test: the fused path (`true`) or the reference.
    type FusedOrReference<'a> = dyn Fn(&[Tensor<AB, 2>], bool) -> Tensor<AB, 2> + 'a;

    /// Runs `f` on fresh leaves built from `inputs`, with fused kernels or the reference, and returns
    /// the output and the gradient of `Σ out ⊙ weight` for every input.
    fn run(
        inputs: &[Tensor<Flex, 2>],
        weight: &Tensor<Flex, 2>,
        f: &FusedOrReference<'_>,
        fused: bool,
    ) -> (Tensor<Flex, 2>, Vec<Tensor<Flex, 2>>) {
        let leaves: Vec<Tensor<AB, 2>> = inputs.iter().map(|x| Tensor::from_inner(x.clone()).require_grad()).collect();
        let out = f(&leaves, fused);
        let loss = (out.clone() * Tensor::from_inner(weight.clone())).sum();
        let grads = loss.backward();
        (out.inner(), leaves.iter().map(|l| l.grad(&grads).expect("gradient")).collect())
    }

    fn compare(name: &str, inputs: Vec<Tensor<Flex, 2>>, out_shape: [usize; 2], f: &FusedOrReference) {
        let weight = leaf(out_shape, 99);
        let (y1, g1) = run(&inputs, &weight, f, true);
        let (y0, g0) = run(&inputs, &weight, f, false);
        let e = rel_err(y1, y0);
        assert!(e < 1e-5, "{name}: output relative error {e}");
        for (i, (a, b)) in g1.into_iter().zip(g0).enumerate() {
            let e = rel_err(a, b);
            assert!(e < 1e-5, "{name}: gradient {i} relative error {e}");
        }
    }

    #[test]
    fn fused_rms_norm_equals_the_composition() {
        for (n, d) in [(1, 8), (7, 13), (96, 128)] {
            let w = leaf([1, d], 2).reshape([1, d]);
            compare(&format!("rms_norm {n}x{d}"), vec![leaf([n, d], 1), w], [n, d], &|xs, fused| {
                let w = xs[1].clone().reshape([d]);
                if fused {
                    rms_norm(xs[0].clone(), w, 1e-5)
                } else {
                    reference::rms_norm(xs[0].clone(), w, 1e-5)
                }
            });
        }
    }

    #[test]
    fn fused_swiglu_equals_the_composition() {
        for (n, f) in [(1, 5), (9, 31), (64, 344)] {
            compare(&format!("swiglu {n}x{f}"), vec![leaf([n, 2 * f], 3)], [n, f], &|xs, fused| {
                if fused {
                    swiglu_packed(xs[0].clone())
                } else {
                    reference::swiglu_packed(xs[0].clone())
                }
            });
        }
    }

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
                    reference::linear(xs[0].clone(), xs[1].clone(), b)
                }
            });
        }
    }

    #[test]
    fn fused_adamw_and_sum_squares_equal_the_compositions() {
        let vec1 = |n: usize, seed: u64| leaf([1, n], seed).reshape([n]);
        for (n, decay, grad_scale) in [(1, 0.0, 1.0), (1001, 1e-4, 0.37), (40_000, 1e-3, 1.0)] {
            let (p, g, m) = (vec1(n, 1), vec1(n, 2), vec1(n, 3));
            let v = vec1(n, 4).abs();
            let h = super::super::AdamWStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                decay,
                bias1: 1.0 - 0.9f64.powi(3),
                bias2: 1.0 - 0.99f64.powi(3),
                grad_scale,
            };
            let want = super::super::adamw_reference(p.clone(), g.clone(), m.clone(), v.clone(), h);
            // `p` is still shared here: the kernel must copy, not write into the caller's tensor.
            let got = super::super::adamw(p.clone(), g.clone(), m, v, h);
            for (name, a, b) in [("p", got.0, want.0), ("m", got.1, want.1), ("v", got.2, want.2)] {
                let err = rel_err(a.unsqueeze::<2>(), b.unsqueeze::<2>());
                assert!(err < 1e-5, "adamw n={n} {name}: {err}");
            }
            assert!(rel_err(p.clone().unsqueeze::<2>(), vec1(n, 1).unsqueeze::<2>()) == 0.0, "input changed");
            // The kernel itself, on slices (the backend op above must be it, not the default body).
            let vals = |t: &Tensor<Flex, 1>| t.to_data().into_vec::<f32>().expect("f32");
            let (mut pk, mut mk, mut vk) = (vals(&p), vals(&vec1(n, 3)), vals(&vec1(n, 4).abs()));
            kernels::adamw(&mut pk, &vals(&g), &mut mk, &mut vk, &h);
            let got_p = super::super::adamw(p.clone(), g.clone(), vec1(n, 3), vec1(n, 4).abs(), h).0;
            assert_eq!(pk, vals(&got_p), "adamw n={n}: the backend op is not the kernel");
            let fused: f32 = float::<Flex, 1>(Flex::sum_squares(g.clone().into_primitive().tensor())).into_scalar();
            let plain: f32 = g.clone().square().sum().into_scalar();
            assert_eq!(fused, kernels::sum_squares(&vals(&g)) as f32, "sum of squares: not the kernel");
            assert!((fused - plain).abs() <= 1e-5 * plain.abs(), "sum of squares n={n}: {fused} vs {plain}");
        }
    }

    #[test]
    fn fused_attention_equals_the_composition() {
        let dev = Default::default();
        // (batch, seq, heads, kv heads, head dim, start, layout): odd sizes, a batch of one, GQA, MQA.
        let cases = [
            (2, 7, 4, 2, 6, 0, RopeLayout::HalfSplit),
            (1, 9, 3, 1, 8, 0, RopeLayout::Interleaved),
            (1, 1, 2, 2, 4, 0, RopeLayout::HalfSplit),
            (3, 5, 6, 6, 10, 4, RopeLayout::HalfSplit),
            (2, 64, 4, 4, 32, 0, RopeLayout::HalfSplit),
            // Longer than one causal block of the kernels (64 rows): 3 blocks, the last partial.
            (1, 150, 4, 2, 8, 2, RopeLayout::HalfSplit),
        ];
        for (b, t, h, kh, dh, start, layout) in cases {
            let rope = Rope::<AB>::new(start + t + 3, dh, 10_000.0, layout, &dev);
            // Plain causal rows, and rows cut into documents (one of a single position, one
            // crossing the kernels' 64-row blocks).
            let cut = |t: usize| if t < 3 { vec![t] } else { vec![1, t / 2 - 1, t - t / 2] };
            let docs = Documents::from_lengths(&vec![cut(t); b], t).unwrap();
            for docs in [None, Some(&docs)] {
                let inputs = vec![leaf([b * t, (h + 2 * kh) * dh], 5)];
                let name =
                    format!("attention b{b} t{t} h{h} k{kh} dh{dh} start{start} {layout:?} docs {}", docs.is_some());
                compare(&name, inputs, [b * t, h * dh], &|xs, fused| {
                    if fused {
                        attention_rope_packed(xs[0].clone(), &rope, (b, t), (h, kh, dh), start, docs)
                    } else {
                        reference::attention_rope_packed(xs[0].clone(), &rope, (b, t), (h, kh, dh), start, docs)
                    }
                });
            }
        }
    }
}
