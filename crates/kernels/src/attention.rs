//! RoPE and causal grouped-query attention (Ainslie et al., 2023) over packed `[q | k | v]` rows:
//! the op the model trains with, and the attention compositions every other path uses (masks,
//! shared key/value heads, attention over cached segments).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::softmax;
use burn::tensor::module::attention;
use burn::tensor::ops::{AttentionModuleOptions, FloatTensor};
use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor};

use crate::compute::Compute;
use crate::documents::Documents;
use crate::kernels::{self, AttnShape};
use crate::rope::Rope;
use crate::{flex, float, prim, reference_grads, EmberBackend};

/// How attention scores are made from `q·kᵀ`: scaled (`1/sqrt(Dh)` unless a model says otherwise:
/// Gemma's `query_pre_attn_scalar`), then optionally soft-capped as `c·tanh(s/c)` (Gemma 2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub scale: f64,
    pub softcap: Option<f64>,
}

impl Scores {
    /// `1/sqrt(head_dim)`, no cap: the usual scores.
    pub fn of_head(head_dim: usize) -> Self {
        Self { scale: 1.0 / (head_dim as f64).sqrt(), softcap: None }
    }

    /// `q·kᵀ` (f32, `[..]`) made scores.
    fn apply<B: Backend, const D: usize>(self, dots: Tensor<B, D>) -> Tensor<B, D> {
        let scores = dots.mul_scalar(self.scale);
        match self.softcap {
            Some(c) => scores.div_scalar(c).tanh().mul_scalar(c),
            None => scores,
        }
    }
}

/// What the attention's forward pass keeps for its backward pass.
#[derive(Debug, Clone)]
pub enum AttentionSaved<B: Backend> {
    /// The CPU kernels': the output `[B·T, H·Dh]`, the per-row log-sum-exp `[B·H·T]` and the packed
    /// q/k/v after RoPE `[B·T, (H + 2K)·Dh]`.
    /// The kernels' forward: its output, log-sum-exp and rotated q/k/v, and whether its products
    /// took bf16 operands (the backward then does too: `P` recomputed from the same scores).
    Kernel { o: FloatTensor<B>, lse: FloatTensor<B>, qkv_rot: FloatTensor<B>, bf16: bool },
    /// The reference's: the output and the packed q/k/v input (the backward recomputes the rest).
    Input { o: FloatTensor<B>, qkv: FloatTensor<B> },
}

impl<B: Backend> AttentionSaved<B> {
    /// The attention's output, `[B·T, H·Dh]`.
    pub fn output(&self) -> FloatTensor<B> {
        match self {
            Self::Kernel { o, .. } | Self::Input { o, .. } => o.clone(),
        }
    }
}

/// A backend's RoPE + causal GQA attention over packed rows; the default methods are the reference.
/// `cos`, `sin`: the RoPE tables `[T_max, Dh/2]`.
pub trait AttentionOps: Backend {
    /// The output and what the backward pass needs.
    ///
    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> o: `[B·T, H·Dh]`
    fn attention_forward(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
        _cx: Compute,
    ) -> AttentionSaved<Self> {
        let rope = Rope::from_tables(float::<Self, 2>(cos), float(sin), shape.layout);
        let o = prim(reference(float(qkv.clone()), &rope, &shape));
        AttentionSaved::Input { o, qkv }
    }

    /// Gradient of the packed q/k/v (before RoPE) given the output gradient.
    fn attention_backward(
        saved: AttentionSaved<Self>,
        d_o: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
        _cx: Compute,
    ) -> FloatTensor<Self> {
        match saved {
            AttentionSaved::Input { qkv, .. } => {
                prim(reference_backward(float::<Self, 2>(qkv), float(d_o), float(cos), float(sin), &shape))
            }
            // Only a backend's own forward makes this; it overrides the backward too.
            AttentionSaved::Kernel { qkv_rot, .. } => {
                let unrotated = rotate_packed::<Self>(float(qkv_rot), float(cos.clone()), float(sin.clone()), &shape);
                prim(reference_backward(unrotated, float(d_o), float(cos), float(sin), &shape))
            }
        }
    }

    /// The output alone (under autodiff, a node whose backward is [`Self::attention_backward`]).
    fn attention_rope(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
        cx: Compute,
    ) -> FloatTensor<Self> {
        Self::attention_forward(qkv, cos, sin, shape, cx).output()
    }
}

/// The packed q/k/v before RoPE, from the rotated one: the q and k heads rotated back.
fn rotate_packed<B: Backend>(
    qkv_rot: Tensor<B, 2>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    s: &AttnShape,
) -> Tensor<B, 2> {
    let (b, t, dh) = (s.batch, s.seq, s.head_dim);
    let (qk, v) = (s.heads + s.kv_heads, s.kv_heads);
    // Rotating back by -θ: the same tables with the sines negated.
    let rope = Rope::from_tables(cos, sin.neg(), s.layout);
    let heads = qkv_rot.clone().narrow(1, 0, qk * dh).reshape([b, t, qk, dh]).swap_dims(1, 2);
    let back = match &s.docs {
        Some(first) => rope.apply_positions(heads, &Documents::from_parts(first.clone(), b, t).positions(s.start)),
        None => rope.apply(heads, s.start),
    };
    let back = back.swap_dims(1, 2).reshape([b * t, qk * dh]);
    Tensor::cat(vec![back, qkv_rot.narrow(1, qk * dh, v * dh)], 1)
}

/// The composition of [`AttentionOps::attention_forward`]: the reference.
///
/// # Shapes
/// - qkv: `[B·T, (H + 2K)·Dh]` -> `[B·T, H·Dh]`
pub fn reference<B: Backend>(qkv: Tensor<B, 2>, rope: &Rope<B>, s: &AttnShape) -> Tensor<B, 2> {
    let docs = s.docs.as_ref().map(|first| Documents::from_parts(first.clone(), s.batch, s.seq));
    let scores = Scores { scale: f64::from(s.scale), softcap: None };
    let shape = (s.heads, s.kv_heads, s.head_dim);
    attention_rope_reference(qkv, rope, (s.batch, s.seq), shape, (s.start, docs.as_ref()), scores)
}

/// The reference's gradient of the packed q/k/v, through Burn's autodiff.
pub fn reference_backward<B: Backend>(
    qkv: Tensor<B, 2>,
    d_o: Tensor<B, 2>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    s: &AttnShape,
) -> Tensor<B, 2> {
    let [d] = reference_grads([qkv], d_o, |[qkv]| {
        let rope = Rope::from_tables(Tensor::from_inner(cos), Tensor::from_inner(sin), s.layout);
        reference(qkv, &rope, s)
    });
    d
}

/// RoPE on the q and k parts of packed `[q | k | v]` rows, then causal attention with key/value
/// heads shared by `H/K` query heads. With `docs`, positions restart and attention stays inside
/// each document.
///
/// # Shapes
/// - qkv: `[B·T, (H + 2K)·Dh]` (rows of `[B, T, heads, Dh]`) -> `[B·T, H·Dh]`
pub fn attention_rope_reference<B: Backend>(
    qkv: Tensor<B, 2>,
    rope: &Rope<B>,
    (b, t): (usize, usize),
    (h, kh, dh): (usize, usize, usize),
    (start, docs): (usize, Option<&Documents>),
    scores: Scores,
) -> Tensor<B, 2> {
    let heads = |from: usize, n: usize| qkv.clone().narrow(1, from * dh, n * dh).reshape([b, t, n, dh]).swap_dims(1, 2);
    let (q, k, v) = (heads(0, h), heads(h, kh), heads(h + kh, kh)); // [B, heads, T, Dh]
    let o = match docs {
        Some(docs) => {
            let positions = docs.positions(start);
            let (q, k) = (rope.apply_positions(q, &positions), rope.apply_positions(k, &positions));
            let (k, v) = (repeat_kv(k, h / kh), repeat_kv(v, h / kh)); // [B, H, T, Dh]
            let hidden = docs.hidden_mask::<B>(None, &q.device()); //      [B, 1, T, T]
            masked_attention(q, k, v, Some(hidden), DType::F32, scores)
        }
        None => {
            let (q, k) = (rope.apply(q, start), rope.apply(k, start));
            let (k, v) = (repeat_kv(k, h / kh), repeat_kv(v, h / kh)); // [B, H, T, Dh]
            let opts = AttentionModuleOptions { is_causal: true, scale: Some(scores.scale), softcap: scores.softcap };
            attention(q, k, v, None, None, opts)
        }
    };
    o.swap_dims(1, 2).reshape([b * t, h * dh])
}

/// RoPE and causal grouped-query attention over packed `[q | k | v]` rows of whole sequences
/// starting at position `start`, as one op where the backend runs it faster so, else the
/// composition; with `docs`, block-diagonal: each document of a row restarts its positions and
/// sees only itself. The kernels take scaled scores; soft-capped ones run the composition.
///
/// # Shapes
/// - qkv: `[B·T, (H + 2K)·Dh]` -> `[B·T, H·Dh]`
pub fn attention_rope_packed<B: EmberBackend>(
    qkv: Tensor<B, 2>,
    rope: &Rope<B>,
    (b, t): (usize, usize),
    (h, kh, dh): (usize, usize, usize),
    (start, docs): (usize, Option<&Documents>),
    scores: Scores,
    cx: Compute,
) -> Tensor<B, 2> {
    if !(cx.fused::<B>(qkv.dtype()) && start + t <= rope.max_seq_len() && scores.softcap.is_none()) {
        return attention_rope_reference(qkv, rope, (b, t), (h, kh, dh), (start, docs), scores);
    }
    let s = AttnShape {
        batch: b,
        seq: t,
        heads: h,
        kv_heads: kh,
        head_dim: dh,
        start,
        layout: rope.layout(),
        rotate: rope.rotates(),
        scale: scores.scale as f32,
        docs: docs.map(|d| d.first_positions().clone()),
    };
    let (cos, sin) = rope.tables();
    float(B::attention_rope(prim(qkv), prim(cos), prim(sin), s, cx))
}

/// Attention with an explicit mask (true = hidden; `None`: every key visible), both GEMMs in
/// `compute`, the scores and the softmax in f32.
///
/// # Shapes
/// - q: `[B, H, T, Dh]`, k, v: `[B, H, S, Dh]`, hidden: `[B or 1, 1, T, S]` -> `[B, H, T, Dh]`
pub fn masked_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    hidden: Option<Tensor<B, 4, Bool>>,
    compute: DType,
    scores: Scores,
) -> Tensor<B, 4> {
    let cast = |x: Tensor<B, 4>, d: DType| if x.dtype() == d { x } else { x.cast(d) };
    let dots = cast(q, compute).matmul(cast(k, compute).swap_dims(2, 3)); // [B, H, T, S]
    let scores = scores.apply(cast(dots, DType::F32));
    let scores = match hidden {
        Some(hidden) => scores.mask_fill(hidden, f32::NEG_INFINITY),
        None => scores,
    };
    let probs = softmax(scores, 3);
    cast(cast(probs, compute).matmul(cast(v, compute)), DType::F32)
}

/// The causal mask of `t` queries at the last `t` of `s` key positions, with an optional sliding
/// window: key `j` is hidden from query `i` (at position `s - t + i`) when it is in the future or at
/// least `window` positions back.
///
/// # Shapes
/// -> `[1, 1, T, S]`, true where hidden
///
/// Built on the device from two index ranges (no `[T, S]` upload per layer and step).
pub fn causal_mask<B: Backend>(t: usize, s: usize, window: Option<usize>, device: &B::Device) -> Tensor<B, 4, Bool> {
    let pos = Tensor::<B, 1, Int>::arange((s - t) as i64..s as i64, device).reshape([t, 1]);
    let key = Tensor::<B, 1, Int>::arange(0..s as i64, device).reshape([1, s]);
    let ahead = key - pos; // [T, S]: j - pos
    let future = ahead.clone().greater_elem(0);
    let hidden = match window {
        Some(w) => future.bool_or(ahead.lower_equal_elem(-(w as i64))),
        None => future,
    };
    hidden.reshape([1, 1, t, s])
}

/// Shares each key/value head with its `rep` query heads: head `j` of the output is input head
/// `j / rep`. Burn's attention op needs equal head counts.
///
/// # Shapes
/// - x: `[B, K, S, Dh]` -> `[B, K·rep, S, Dh]`
pub fn repeat_kv<B: Backend>(x: Tensor<B, 4>, rep: usize) -> Tensor<B, 4> {
    if rep == 1 {
        return x;
    }
    let [b, k, s, dh] = x.dims();
    x.unsqueeze_dim::<5>(2) //         [B, K, 1, S, Dh]
        .expand([b, k, rep, s, dh]) // [B, K, rep, S, Dh]
        .reshape([b, k * rep, s, dh])
}

impl AttentionOps for Flex {
    fn attention_forward(
        qkv: FlexTensor,
        cos: FlexTensor,
        sin: FlexTensor,
        s: AttnShape,
        cx: Compute,
    ) -> AttentionSaved<Self> {
        if !flex::all_f32(&[&qkv, &cos, &sin]) {
            let rope = Rope::from_tables(float::<Self, 2>(cos), float(sin), s.layout);
            let o = prim(reference(float(qkv.clone()), &rope, &s));
            return AttentionSaved::Input { o, qkv };
        }
        let rows = flex::shape(&qkv)[0];
        let (cpu, elementwise) = (cx.attention_cpu(), cx.elementwise_cpu());
        let qkv_rot = if s.rotate {
            let rotated =
                kernels::rope_packed(elementwise, &flex::f32s(&qkv), &s, &flex::f32s(&cos), &flex::f32s(&sin), false);
            flex::tensor(rotated, vec![rows, s.packed_width()])
        } else {
            qkv
        };
        let bf16 = kernels::attention_in_bf16(cpu, &s);
        let out = kernels::attention_in(cpu, &flex::f32s(&qkv_rot), &s, bf16);
        AttentionSaved::Kernel {
            o: flex::tensor(out.o, vec![rows, s.heads * s.head_dim]),
            lse: flex::tensor(out.lse, vec![s.batch * s.heads * s.seq]),
            qkv_rot,
            bf16,
        }
    }

    fn attention_backward(
        saved: AttentionSaved<Self>,
        d_o: FlexTensor,
        cos: FlexTensor,
        sin: FlexTensor,
        s: AttnShape,
        cx: Compute,
    ) -> FlexTensor {
        let (o, lse, qkv_rot, bf16) = match saved {
            AttentionSaved::Kernel { o, lse, qkv_rot, bf16 } => (o, lse, qkv_rot, bf16),
            AttentionSaved::Input { qkv, .. } => {
                return prim(reference_backward(float::<Self, 2>(qkv), float(d_o), float(cos), float(sin), &s));
            }
        };
        let shape = flex::shape(&qkv_rot);
        let (o, lse) = (flex::f32s(&o), flex::f32s(&lse));
        let (qkv_rot, d_o) = (flex::f32s(&qkv_rot), flex::f32s(&d_o));
        let d_rot = kernels::attention_backward_in(cx.attention_cpu(), &qkv_rot, (&o, &lse), &d_o, &s, bf16);
        if !s.rotate {
            return flex::tensor(d_rot, shape);
        }
        let (cos, sin) = (flex::f32s(&cos), flex::f32s(&sin));
        flex::tensor(kernels::rope_packed(cx.elementwise_cpu(), &d_rot, &s, &cos, &sin, true), shape)
    }
}

/// One graph node whose backward is the inner backend's; the RoPE tables are constants.
impl<B: EmberBackend, C: CheckpointStrategy> AttentionOps for Autodiff<B, C> {
    fn attention_rope(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        s: AttnShape,
        cx: Compute,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct AttentionBackward;
        impl<B: EmberBackend> Backward<B, 1> for AttentionBackward {
            type State = (AttentionSaved<B>, FloatTensor<B>, FloatTensor<B>, AttnShape, Compute);
            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node] = ops.parents;
                let d_o = grads.consume::<B>(&ops.node);
                let (saved, cos, sin, s, cx) = ops.state;
                if let Some(n) = node {
                    grads.register::<B>(n.id, B::attention_backward(saved, d_o, cos, sin, s, cx));
                }
            }
        }
        let (cos, sin) = (cos.primitive, sin.primitive);
        let prep = AttentionBackward.prepare::<C>([qkv.node.clone()]).compute_bound().stateful();
        let saved = B::attention_forward(qkv.primitive, cos.clone(), sin.clone(), s.clone(), cx);
        match prep {
            OpsKind::Tracked(prep) => {
                let o = saved.output();
                prep.finish((saved, cos, sin, s, cx), o)
            }
            OpsKind::UnTracked(prep) => prep.finish(saved.output()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::RopeLayout;
    use crate::testing::{assert_close, compare, leaf, AB};
    use burn::tensor::{Distribution, Tolerance};

    type B = Flex;

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
                        let scores = Scores::of_head(dh);
                        attention_rope_packed(
                            xs[0].clone(),
                            &rope,
                            (b, t),
                            (h, kh, dh),
                            (start, docs),
                            scores,
                            Compute::default(),
                        )
                    } else {
                        attention_rope_reference(
                            xs[0].clone(),
                            &rope,
                            (b, t),
                            (h, kh, dh),
                            (start, docs),
                            Scores::of_head(dh),
                        )
                    }
                });
            }
        }
    }

    #[test]
    fn kernel_backward_equals_the_reference_backward() {
        let dev = Default::default();
        // The last case is learned positions': identity tables, which the kernels skip.
        for (b, t, h, kh, dh, start, layout, rotate) in [
            (2, 9, 4, 2, 8, 1, RopeLayout::HalfSplit, true),
            (1, 70, 3, 1, 6, 0, RopeLayout::Interleaved, true),
            (2, 9, 4, 2, 8, 1, RopeLayout::HalfSplit, false),
        ] {
            let rope = match rotate {
                true => Rope::<Flex>::new(start + t, dh, 10_000.0, layout, &dev),
                false => Rope::<Flex>::identity(start + t, dh, layout, &dev),
            };
            let s = AttnShape {
                batch: b,
                seq: t,
                heads: h,
                kv_heads: kh,
                head_dim: dh,
                start,
                layout,
                rotate: rope.rotates(),
                scale: 1.0 / (dh as f32).sqrt(),
                docs: None,
            };
            let (qkv, d_o) = (leaf([b * t, (h + 2 * kh) * dh], 4), leaf([b * t, h * dh], 5));
            let (cos, sin) = rope.tables();
            let saved = <Flex as AttentionOps>::attention_forward(
                prim(qkv.clone()),
                prim(cos.clone()),
                prim(sin.clone()),
                s.clone(),
                Compute::default(),
            );
            let got = <Flex as AttentionOps>::attention_backward(
                saved,
                prim(d_o.clone()),
                prim(cos.clone()),
                prim(sin.clone()),
                s.clone(),
                Compute::default(),
            );
            let want = reference_backward(qkv, d_o, cos, sin, &s);
            assert_close(&format!("attention b{b} t{t} {layout:?} rotate {rotate}"), vec![float(got)], vec![want]);
        }
    }

    #[test]
    fn rotating_back_undoes_the_kernels_rope() {
        let dev = Default::default();
        let (b, t, h, kh, dh) = (2, 5, 4, 2, 6);
        let docs = Documents::from_lengths(&[vec![2, 3], vec![5]], t).unwrap();
        for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
            for docs in [None, Some(docs.first_positions().clone())] {
                let rope = Rope::<Flex>::new(16, dh, 10_000.0, layout, &dev);
                let s = AttnShape {
                    batch: b,
                    seq: t,
                    heads: h,
                    kv_heads: kh,
                    head_dim: dh,
                    start: 3,
                    layout,
                    rotate: true,
                    scale: 1.0,
                    docs,
                };
                let qkv = leaf([b * t, s.packed_width()], 6);
                let (cos, sin) = rope.tables();
                let vals = |x: &Tensor<Flex, 2>| x.to_data().to_vec::<f32>().unwrap();
                let rotated =
                    kernels::rope_packed(crate::Cpu::detect(), &vals(&qkv), &s, &vals(&cos), &vals(&sin), false);
                let rotated = Tensor::<Flex, 2>::from_data(
                    burn::tensor::TensorData::new(rotated, [b * t, s.packed_width()]),
                    &dev,
                );
                let back = rotate_packed(rotated, cos, sin, &s);
                back.into_data().assert_approx_eq::<f32>(&qkv.into_data(), Tolerance::absolute(1e-5));
            }
        }
    }

    #[test]
    fn causal_mask_matches_its_definition() {
        for (t, s, window) in
            [(1, 1, None), (5, 5, None), (3, 8, None), (6, 6, Some(2)), (4, 9, Some(3)), (7, 7, Some(20))]
        {
            let got = causal_mask::<B>(t, s, window, &Default::default()).into_data().to_vec::<bool>().unwrap();
            let mut want = Vec::with_capacity(t * s);
            for i in 0..t {
                let pos = s - t + i;
                want.extend((0..s).map(|j| j > pos || window.is_some_and(|w| pos - j >= w)));
            }
            assert_eq!(got, want, "t {t}, s {s}, window {window:?}");
        }
    }

    /// Causal attention with both GEMMs in `compute` and the softmax in f32 (Burn's fused op would
    /// run its softmax in the input dtype under autodiff).
    ///
    /// # Shapes
    /// - q: `[B, H, T, Dh]`, k, v: `[B, H, S, Dh]` (f32) -> `[B, H, T, Dh]` (f32); query i sits at key
    ///   position `S - T + i`
    fn causal_attention_mixed<B: Backend>(
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        compute: DType,
    ) -> Tensor<B, 4> {
        let hidden = causal_mask::<B>(q.dims()[2], k.dims()[2], None, &q.device());
        let dh = q.dims()[3];
        masked_attention(q, k, v, Some(hidden), compute, Scores::of_head(dh))
    }

    #[test]
    fn mixed_path_in_f32_equals_the_fused_op_also_with_a_cached_prefix() {
        let dev = Default::default();
        for (t, s) in [(7, 7), (1, 9), (3, 8)] {
            let q = Tensor::<B, 4>::random([2, 3, t, 8], Distribution::Normal(0.0, 1.0), &dev);
            let k = Tensor::<B, 4>::random([2, 3, s, 8], Distribution::Normal(0.0, 1.0), &dev);
            let v = Tensor::<B, 4>::random([2, 3, s, 8], Distribution::Normal(0.0, 1.0), &dev);
            let opts = AttentionModuleOptions { is_causal: true, ..Default::default() };
            let want = attention(q.clone(), k.clone(), v.clone(), None, None, opts).into_data();
            let got = causal_attention_mixed(q, k, v, DType::F32).into_data();
            got.assert_approx_eq::<f32>(&want, Tolerance::absolute(1e-5));
        }
    }
}
