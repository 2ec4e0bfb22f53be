//! Ops that Burn does not fuse for us, as a backend extension: each has a plain composition of Burn
//! tensor ops as its reference, and a test that compares the two (values and gradients).
//!
//! `EmberBackend` is implemented for every concrete backend (where the default method bodies run) and
//! for `Autodiff<B, C>`, where the ops get their own backward pass.

pub mod cross_entropy;
pub mod fused;
pub mod kernels;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

pub use cross_entropy::{cross_entropy, lm_head_loss_reference, ChunkSpec, IGNORE};
pub use fused::AttentionSaved;
pub use kernels::AttnShape;

const NO_KERNEL: &str = "fused kernels are called only where `EmberBackend::fused` is true";

/// A Burn backend with ember's fused ops.
pub trait EmberBackend: Backend {
    /// Mean cross-entropy of `targets` under the logits `hidden · weight`, computed over tiles of rows
    /// and vocabulary so that the `[N, V]` logits never exist at once. Targets equal to [`IGNORE`] do
    /// not count. Returns `[1]`.
    ///
    /// # Shapes
    /// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
    fn lm_head_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
    ) -> FloatTensor<Self> {
        let (h, w, t) = (float::<Self, 2>(hidden), float::<Self, 2>(weight), int::<Self, 1>(targets));
        cross_entropy::chunked_forward(h, w, t, spec).loss.into_primitive().tensor()
    }

    /// Whether this backend has fused kernels (RMSNorm, SwiGLU, RoPE + attention) for `dtype`.
    /// Without them the model runs the plain compositions of [`fused::reference`].
    fn fused(_dtype: DType) -> bool {
        false
    }

    /// # Shapes
    /// - x: `[N, D]`, w: `[D]` -> `[N, D]`
    fn rms_norm_fused(_x: FloatTensor<Self>, _w: FloatTensor<Self>, _eps: f64) -> FloatTensor<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// Gradients of x and w given the output gradient.
    fn rms_norm_fused_backward(
        _x: FloatTensor<Self>,
        _w: FloatTensor<Self>,
        _dy: FloatTensor<Self>,
        _eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("{NO_KERNEL}")
    }

    /// `silu(g) · u`.
    fn swiglu_fused(_g: FloatTensor<Self>, _u: FloatTensor<Self>) -> FloatTensor<Self> {
        unreachable!("{NO_KERNEL}")
    }

    fn swiglu_fused_backward(
        _g: FloatTensor<Self>,
        _u: FloatTensor<Self>,
        _dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("{NO_KERNEL}")
    }

    /// RoPE on q and k (tables `[T_max, Dh/2]`), then causal GQA attention; keeps what the backward
    /// pass needs.
    ///
    /// # Shapes
    /// - q: `[B·T, H·Dh]`, k, v: `[B·T, K·Dh]` -> o: `[B·T, H·Dh]`
    fn attention_fused(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _cos: FloatTensor<Self>,
        _sin: FloatTensor<Self>,
        _shape: AttnShape,
    ) -> AttentionSaved<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// Gradients of q, k and v (before RoPE) given the output gradient.
    fn attention_fused_backward(
        _saved: AttentionSaved<Self>,
        _v: FloatTensor<Self>,
        _d_o: FloatTensor<Self>,
        _cos: FloatTensor<Self>,
        _sin: FloatTensor<Self>,
        _shape: AttnShape,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("{NO_KERNEL}")
    }

    /// The attention op the model calls where `fused` holds: the kernel's output, or under autodiff
    /// a node whose backward runs the kernel's backward.
    fn attention_op(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
    ) -> FloatTensor<Self> {
        Self::attention_fused(q, k, v, cos, sin, shape).o
    }
}

/// A backend to train on: autodiff over an [`EmberBackend`], whose inner backend (used for
/// evaluation and sampling) has the ops too.
pub trait TrainBackend: EmberBackend + AutodiffBackend<InnerBackend: EmberBackend> {}

impl<B> TrainBackend for B
where
    B: EmberBackend + AutodiffBackend,
    B::InnerBackend: EmberBackend,
{
}

pub(crate) fn float<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

pub(crate) fn int<B: Backend, const D: usize>(p: IntTensor<B>) -> Tensor<B, D, Int> {
    Tensor::from_primitive(p)
}

impl EmberBackend for burn::backend::NdArray {}
#[cfg(feature = "wgpu")]
impl EmberBackend for burn::backend::Wgpu {}
#[cfg(feature = "cuda")]
impl EmberBackend for burn::backend::Cuda {}

impl<B: EmberBackend, C: CheckpointStrategy> EmberBackend for Autodiff<B, C> {
    fn fused(dtype: DType) -> bool {
        B::fused(dtype)
    }

    fn rms_norm_fused(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        fused::rms_norm_autodiff::<B, C>(x, w, eps)
    }

    fn swiglu_fused(g: FloatTensor<Self>, u: FloatTensor<Self>) -> FloatTensor<Self> {
        fused::swiglu_autodiff::<B, C>(g, u)
    }

    fn attention_op(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
    ) -> FloatTensor<Self> {
        fused::attention_autodiff::<B, C>(q, k, v, cos.primitive, sin.primitive, shape)
    }

    fn lm_head_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
    ) -> FloatTensor<Self> {
        /// The backward recomputes each tile's logits from `hidden`, `weight` and the per-row
        /// log-sum-exp saved by the forward: memory O(N·D + D·V + tile), never O(N·V).
        #[derive(Debug)]
        struct LmHeadCrossEntropy;

        impl<B: Backend> Backward<B, 2> for LmHeadCrossEntropy {
            type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, FloatTensor<B>, ChunkSpec);

            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node_hidden, node_weight] = ops.parents;
                let grad = float::<B, 1>(grads.consume::<B>(&ops.node));
                let (hidden, weight, targets, lse, spec) = ops.state;
                let (dh, dw) = cross_entropy::chunked_backward(
                    float::<B, 2>(hidden),
                    float::<B, 2>(weight),
                    int::<B, 1>(targets),
                    float::<B, 1>(lse),
                    grad,
                    spec,
                );
                if let Some(node) = node_hidden {
                    grads.register::<B>(node.id, dh.into_primitive().tensor());
                }
                if let Some(node) = node_weight {
                    grads.register::<B>(node.id, dw.into_primitive().tensor());
                }
            }
        }

        let forward = |h: FloatTensor<B>, w: FloatTensor<B>, t: IntTensor<B>| {
            cross_entropy::chunked_forward(float::<B, 2>(h), float::<B, 2>(w), int::<B, 1>(t), spec)
        };
        match LmHeadCrossEntropy.prepare::<C>([hidden.node.clone(), weight.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = forward(hidden.primitive.clone(), weight.primitive.clone(), targets.clone());
                let state = (hidden.primitive, weight.primitive, targets, out.lse.into_primitive().tensor(), spec);
                prep.finish(state, out.loss.into_primitive().tensor())
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(forward(hidden.primitive, weight.primitive, targets).loss.into_primitive().tensor())
            }
        }
    }
}

/// Tensor-level entry point of [`EmberBackend::lm_head_cross_entropy`].
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
pub fn lm_head_cross_entropy<B: EmberBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    spec: ChunkSpec,
) -> Tensor<B, 1> {
    float(B::lm_head_cross_entropy(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        spec,
    ))
}
