//! Ops that Burn does not fuse for us, as a backend extension: each has a plain composition of Burn
//! tensor ops as its reference, and a test that compares the two (values and gradients).
//!
//! `EmberBackend` is implemented for every concrete backend (where the default method bodies run) and
//! for `Autodiff<B, C>`, where the ops get their own backward pass.

pub mod cross_entropy;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

pub use cross_entropy::{cross_entropy, lm_head_loss_reference, ChunkSpec, IGNORE};

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

impl EmberBackend for burn::backend::Flex {}
impl EmberBackend for burn::backend::NdArray {}
#[cfg(feature = "wgpu")]
impl EmberBackend for burn::backend::Wgpu {}
#[cfg(feature = "cuda")]
impl EmberBackend for burn::backend::Cuda {}

impl<B: EmberBackend, C: CheckpointStrategy> EmberBackend for Autodiff<B, C> {
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
