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

use super::kernels::{self, AttnShape};
use super::{float, EmberBackend};

/// The plain compositions: the reference implementations and the path of backends without kernels.
pub mod reference {
    use burn::tensor::activation::silu;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{backend::Backend, DType, Tensor};

    use crate::attention::repeat_kv;
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
    /// - g, u: `[N, F]` -> `[N, F]`
    pub fn swiglu<B: Backend>(g: Tensor<B, 2>, u: Tensor<B, 2>) -> Tensor<B, 2> {
        silu(g) * u
    }

    /// RoPE on q and k, then causal attention with key/value heads shared by `H/K` query heads.
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
    ) -> Tensor<B, 2> {
        let heads = |y: Tensor<B, 2>, n: usize| y.reshape([b, t, n, dh]).swap_dims(1, 2); // [B, n, T, Dh]
        let q = rope.apply(heads(q, h), start);
        let k = repeat_kv(rope.apply(heads(k, kh), start), h / kh);
        let v = repeat_kv(heads(v, kh), h / kh);
        let opts = AttentionModuleOptions { is_causal: true, ..Default::default() };
        attention(q, k, v, None, None, opts).swap_dims(1, 2).reshape([b * t, h * dh])
    }
}

fn flex_f32(t: &FlexTensor) -> Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(t.to_contiguous().as_slice::<f32>().expect("contiguous f32").to_vec()),
    }
}

fn flex_new(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn shape_of(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}

/// The CPU kernels, for f32 tensors.
impl EmberBackend for Flex {
    fn fused(dtype: DType) -> bool {
        dtype == DType::F32
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

    fn swiglu_fused(g: FlexTensor, u: FlexTensor) -> FlexTensor {
        let shape = shape_of(&g);
        flex_new(kernels::swiglu(&flex_f32(&g), &flex_f32(&u)), shape)
    }

    fn swiglu_fused_backward(g: FlexTensor, u: FlexTensor, dy: FlexTensor) -> (FlexTensor, FlexTensor) {
        let shape = shape_of(&g);
        let (dg, du) = kernels::swiglu_backward(&flex_f32(&g), &flex_f32(&u), &flex_f32(&dy));
        (flex_new(dg, shape.clone()), flex_new(du, shape))
    }

    fn attention_fused(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        cos: FlexTensor,
        sin: FlexTensor,
        s: AttnShape,
    ) -> AttentionSaved<Self> {
        let (qs, ks) = (shape_of(&q), shape_of(&k));
        let (cos, sin) = (flex_f32(&cos), flex_f32(&sin));
        let q_rot = kernels::rope(&flex_f32(&q), s.heads, &s, &cos, &sin, false);
        let k_rot = kernels::rope(&flex_f32(&k), s.kv_heads, &s, &cos, &sin, false);
        let out = kernels::attention(&q_rot, &k_rot, &flex_f32(&v), &s);
        AttentionSaved {
            o: flex_new(out.o, qs.clone()),
            lse: flex_new(out.lse, vec![s.batch * s.heads * s.seq]),
            q_rot: flex_new(q_rot, qs),
            k_rot: flex_new(k_rot, ks),
        }
    }

    fn attention_fused_backward(
        saved: AttentionSaved<Self>,
        v: FlexTensor,
        d_o: FlexTensor,
        cos: FlexTensor,
        sin: FlexTensor,
        s: AttnShape,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let (qs, ks) = (shape_of(&saved.q_rot), shape_of(&saved.k_rot));
        let out = kernels::AttnOut { o: flex_f32(&saved.o).into_owned(), lse: flex_f32(&saved.lse).into_owned() };
        let (dq_rot, dk_rot, dv) = kernels::attention_backward(
            &flex_f32(&saved.q_rot),
            &flex_f32(&saved.k_rot),
            &flex_f32(&v),
            &out,
            &flex_f32(&d_o),
            &s,
        );
        let (cos, sin) = (flex_f32(&cos), flex_f32(&sin));
        let dq = kernels::rope(&dq_rot, s.heads, &s, &cos, &sin, true);
        let dk = kernels::rope(&dk_rot, s.kv_heads, &s, &cos, &sin, true);
        (flex_new(dq, qs), flex_new(dk, ks.clone()), flex_new(dv, ks))
    }
}

/// What the fused attention keeps for its backward pass.
#[derive(Debug, Clone)]
pub struct AttentionSaved<B: Backend> {
    /// `[B·T, H·Dh]`
    pub o: FloatTensor<B>,
    /// `[B·H·T]`
    pub lse: FloatTensor<B>,
    /// `[B·T, H·Dh]`, `[B·T, K·Dh]`: after RoPE.
    pub q_rot: FloatTensor<B>,
    pub k_rot: FloatTensor<B>,
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
    g: FloatTensor<Autodiff<B, C>>,
    u: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct SwigluBackward;
    impl<B: EmberBackend> Backward<B, 2> for SwigluBackward {
        type State = (FloatTensor<B>, FloatTensor<B>);
        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node_g, node_u] = ops.parents;
            let dy = grads.consume::<B>(&ops.node);
            let (g, u) = ops.state;
            let (dg, du) = B::swiglu_fused_backward(g, u, dy);
            if let Some(n) = node_g {
                grads.register::<B>(n.id, dg);
            }
            if let Some(n) = node_u {
                grads.register::<B>(n.id, du);
            }
        }
    }
    match SwigluBackward.prepare::<C>([g.node.clone(), u.node.clone()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let y = B::swiglu_fused(g.primitive.clone(), u.primitive.clone());
            prep.finish((g.primitive, u.primitive), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::swiglu_fused(g.primitive, u.primitive)),
    }
}

pub(super) fn attention_autodiff<B: EmberBackend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    s: AttnShape,
) -> FloatTensor<Autodiff<B, C>> {
    #[derive(Debug)]
    struct AttentionBackward;
    impl<B: EmberBackend> Backward<B, 3> for AttentionBackward {
        type State = (AttentionSaved<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, AttnShape);
        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node_q, node_k, node_v] = ops.parents;
            let d_o = grads.consume::<B>(&ops.node);
            let (saved, v, cos, sin, s) = ops.state;
            let (dq, dk, dv) = B::attention_fused_backward(saved, v, d_o, cos, sin, s);
            for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
                if let Some(n) = node {
                    grads.register::<B>(n.id, grad);
                }
            }
        }
    }
    let prep =
        AttentionBackward.prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()]).compute_bound().stateful();
    let saved = B::attention_fused(q.primitive, k.primitive, v.primitive.clone(), cos.clone(), sin.clone(), s);
    match prep {
        OpsKind::Tracked(prep) => {
            let o = saved.o.clone();
            prep.finish((saved, v.primitive, cos, sin, s), o)
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

/// `silu(g) · u`.
pub fn swiglu<B: EmberBackend>(g: Tensor<B, 2>, u: Tensor<B, 2>) -> Tensor<B, 2> {
    if B::fused(g.dtype()) && u.dtype() == g.dtype() {
        float(B::swiglu_fused(g.into_primitive().tensor(), u.into_primitive().tensor()))
    } else {
        reference::swiglu(g, u)
    }
}

/// RoPE and causal grouped-query attention over whole sequences starting at position `start`.
///
/// # Shapes
/// - q: `[B·T, H·Dh]`, k, v: `[B·T, K·Dh]` -> `[B·T, H·Dh]`
#[allow(clippy::too_many_arguments)]
pub fn attention_rope<B: EmberBackend>(
    q: Tensor<B, 2>,
    k: Tensor<B, 2>,
    v: Tensor<B, 2>,
    rope: &crate::rope::Rope<B>,
    (b, t): (usize, usize),
    (h, kh, dh): (usize, usize, usize),
    start: usize,
) -> Tensor<B, 2> {
    let same = q.dtype() == k.dtype() && k.dtype() == v.dtype();
    if !(B::fused(q.dtype()) && same && start + t <= rope.max_seq_len()) {
        return reference::attention_rope(q, k, v, rope, (b, t), (h, kh, dh), start);
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
    };
    let (cos, sin) = rope.tables();
    float(B::attention_op(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        cos.into_primitive().tensor(),
        sin.into_primitive().tensor(),
        s,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeLayout;
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

    /// Runs `f` on fresh leaves built from `inputs`, with fused kernels or the reference, and returns
    /// the output and the gradient of `Σ out ⊙ weight` for every input.
    fn run(
        inputs: &[Tensor<Flex, 2>],
        weight: &Tensor<Flex, 2>,
        f: &dyn Fn(&[Tensor<AB, 2>], bool) -> Tensor<AB, 2>,
        fused: bool,
    ) -> (Tensor<Flex, 2>, Vec<Tensor<Flex, 2>>) {
        let leaves: Vec<Tensor<AB, 2>> = inputs.iter().map(|x| Tensor::from_inner(x.clone()).require_grad()).collect();
        let out = f(&leaves, fused);
        let loss = (out.clone() * Tensor::from_inner(weight.clone())).sum();
        let grads = loss.backward();
        (out.inner(), leaves.iter().map(|l| l.grad(&grads).expect("gradient")).collect())
    }

    fn compare(
        name: &str,
        inputs: Vec<Tensor<Flex, 2>>,
        out_shape: [usize; 2],
        f: &dyn Fn(&[Tensor<AB, 2>], bool) -> Tensor<AB, 2>,
    ) {
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
            compare(&format!("swiglu {n}x{f}"), vec![leaf([n, f], 3), leaf([n, f], 4)], [n, f], &|xs, fused| {
                if fused {
                    swiglu(xs[0].clone(), xs[1].clone())
                } else {
                    reference::swiglu(xs[0].clone(), xs[1].clone())
                }
            });
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
        ];
        for (b, t, h, kh, dh, start, layout) in cases {
            let rope = Rope::<AB>::new(start + t + 3, dh, 10_000.0, layout, &dev);
            let inputs = vec![leaf([b * t, h * dh], 5), leaf([b * t, kh * dh], 6), leaf([b * t, kh * dh], 7)];
            let name = format!("attention b{b} t{t} h{h} k{kh} dh{dh} start{start} {layout:?}");
            compare(&name, inputs, [b * t, h * dh], &|xs, fused| {
                let (q, k, v) = (xs[0].clone(), xs[1].clone(), xs[2].clone());
                if fused {
                    attention_rope(q, k, v, &rope, (b, t), (h, kh, dh), start)
                } else {
                    reference::attention_rope(q, k, v, &rope, (b, t), (h, kh, dh), start)
                }
            });
        }
    }
}
