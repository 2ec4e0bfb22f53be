//! Ops that Burn does not fuse for us, as a backend extension: each has a plain composition of Burn
//! tensor ops as its reference, and a test that compares the two (values and gradients).
//!
//! `EmberBackend` is implemented for every concrete backend (where the default method bodies run) and
//! for `Autodiff<B, C>`, where the ops get their own backward pass.

pub mod cross_entropy;
pub mod fused;
pub mod kernels;
#[cfg(feature = "nccl")]
pub mod nccl;

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
pub use kernels::{AttnShape, LinearGrads};

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

    /// Whether bf16/f16 GEMMs run natively (GPU tensor cores), as opposed to through f32 conversions
    /// that make them slower than f32 (Burn's CPU backends). Mixed precision falls back to f32 where
    /// they do not, since it would only cost time.
    fn native_low_precision() -> bool {
        true
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

    /// `silu(g) · u` of packed rows `[g | u]`.
    ///
    /// # Shapes
    /// - gu: `[N, 2F]` -> `[N, F]`
    fn swiglu_fused(_gu: FloatTensor<Self>) -> FloatTensor<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// Gradient of the packed input given the output gradient.
    fn swiglu_fused_backward(_gu: FloatTensor<Self>, _dy: FloatTensor<Self>) -> FloatTensor<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// `x · w (+ b)`.
    ///
    /// # Shapes
    /// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
    fn linear_fused(_x: FloatTensor<Self>, _w: FloatTensor<Self>, _b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// The gradients of x, w and b that `need` asks for, given the output gradient (a frozen
    /// weight's product is never computed).
    #[allow(clippy::type_complexity)]
    fn linear_fused_backward(
        _x: FloatTensor<Self>,
        _w: FloatTensor<Self>,
        _dy: FloatTensor<Self>,
        _need: LinearGrads,
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        unreachable!("{NO_KERNEL}")
    }

    /// RoPE on the q and k parts of packed `[q | k | v]` rows (tables `[T_max, Dh/2]`), then causal
    /// GQA attention; keeps what the backward pass needs.
    ///
    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> o: `[B·T, H·Dh]`
    fn attention_fused(
        _qkv: FloatTensor<Self>,
        _cos: FloatTensor<Self>,
        _sin: FloatTensor<Self>,
        _shape: AttnShape,
    ) -> AttentionSaved<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// Gradient of the packed q/k/v (before RoPE) given the output gradient.
    fn attention_fused_backward(
        _saved: AttentionSaved<Self>,
        _d_o: FloatTensor<Self>,
        _cos: FloatTensor<Self>,
        _sin: FloatTensor<Self>,
        _shape: AttnShape,
    ) -> FloatTensor<Self> {
        unreachable!("{NO_KERNEL}")
    }

    /// One AdamW update of a flattened parameter (see [`AdamWStep`]): returns the new parameter and
    /// moments. The default body is the composition of tensor ops; Flex runs one pass over memory.
    ///
    /// # Shapes
    /// - p, g, m, v: `[n]` -> (p, m, v): `[n]`
    fn adamw_fused(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        h: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, m, v) = adamw_reference(float::<Self, 1>(p), float(g), float(m), float(v), h);
        (p.into_primitive().tensor(), m.into_primitive().tensor(), v.into_primitive().tensor())
    }

    /// `Σ x²` over all elements, for the global gradient norm.
    ///
    /// # Shapes
    /// - x: any -> `[1]`
    fn sum_squares(x: FloatTensor<Self>) -> FloatTensor<Self> {
        float::<Self, 1>(x).square().sum().into_primitive().tensor()
    }

    /// Sums the flat f32 tensor `x` (`[n]`) over the ranks of `comm`, in place on the device. Only
    /// CUDA with `--features nccl` has one; every other backend answers with an error (their
    /// gradients are reduced through the host, and no `DeviceComm` is made for them).
    fn device_all_reduce(x: FloatTensor<Self>, comm: &DeviceComm) -> Result<FloatTensor<Self>, String> {
        let _ = (x, comm);
        Err(format!("the {} backend has no device reduction engine", std::any::type_name::<Self>()))
    }

    /// The attention op the model calls where `fused` holds: the kernel's output, or under autodiff
    /// a node whose backward runs the kernel's backward.
    fn attention_op(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
    ) -> FloatTensor<Self> {
        Self::attention_fused(qkv, cos, sin, shape).o
    }
}

/// The scalars of one AdamW update (decoupled weight decay, as `torch.optim.AdamW`):
///
/// ```text
/// g = grad_scale·grad     m = β1·m + (1-β1)·g     v = β2·v + (1-β2)·g²
/// p = p·(1 - decay) - lr · (m / bias1) / (sqrt(v / bias2) + eps)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `lr · weight_decay`, or 0 for parameters that do not decay.
    pub decay: f64,
    /// `1 - β1^t` and `1 - β2^t`.
    pub bias1: f64,
    pub bias2: f64,
    /// The clipping coefficient.
    pub grad_scale: f64,
}

/// [`EmberBackend::adamw_fused`] as a composition of tensor ops: the reference.
pub fn adamw_reference<B: Backend>(
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
    h: AdamWStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let g = if h.grad_scale == 1.0 { g } else { g.mul_scalar(h.grad_scale) };
    let m = m.mul_scalar(h.beta1) + g.clone().mul_scalar(1.0 - h.beta1);
    let v = v.mul_scalar(h.beta2) + g.square().mul_scalar(1.0 - h.beta2);
    let denom = v.clone().div_scalar(h.bias2).sqrt().add_scalar(h.eps);
    let update = m.clone().div_scalar(h.bias1) / denom;
    let p = if h.decay == 0.0 { p } else { p.mul_scalar(1.0 - h.decay) };
    (p - update.mul_scalar(h.lr), m, v)
}

/// Tensor-level entry point of [`EmberBackend::adamw_fused`].
pub fn adamw<B: EmberBackend>(
    p: Tensor<B, 1>,
    g: Tensor<B, 1>,
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
    h: AdamWStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let prim = |t: Tensor<B, 1>| t.into_primitive().tensor();
    let (p, m, v) = B::adamw_fused(prim(p), prim(g), prim(m), prim(v), h);
    (float(p), float(m), float(v))
}

/// Runs `f` on a thread of rayon's global pool (16 MiB stacks), which the CPU kernels (ours and
/// Flex's GEMMs and element-wise ops) use. Called from outside the pool, every parallel op is
/// injected into it and the caller sleeps until a worker wakes and finishes: one wake-up per op,
/// thousands per training step. From inside, the ops start as local jobs. A nano training step
/// measured 15% faster this way (`experiments/cpu-speed.md`).
/// Builds the CPU kernels' thread pool with `threads` workers (the default: one per core, or
/// `RAYON_NUM_THREADS`); before the first [`on_cpu_workers`]. Data-parallel ranks that share a
/// machine split its cores this way.
pub fn init_cpu_workers(threads: Option<usize>) {
    let mut b = rayon::ThreadPoolBuilder::new().stack_size(16 << 20);
    if let Some(n) = threads {
        b = b.num_threads(n.max(1));
    }
    // Fails only when the pool already exists, which is fine: then it is used as it is.
    let _ = b.build_global();
}

/// A reduction engine on the device over the ranks of a data-parallel run: NCCL for CUDA tensors
/// (`--features nccl`, made by `ops::nccl::communicator`). Without it, gradients are summed
/// through host memory.
#[derive(Clone)]
pub struct DeviceComm {
    #[cfg(feature = "nccl")]
    pub(crate) nccl: std::sync::Arc<nccl::Nccl>,
    #[cfg(not(feature = "nccl"))]
    _none: (),
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceComm")
    }
}

/// Threads of the CPU kernels' pool (what a measured CPU peak depends on).
pub fn cpu_workers() -> usize {
    rayon::current_num_threads()
}

pub fn on_cpu_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // Fails only when the pool already exists, which is fine: then it is used as it is.
    let _ = rayon::ThreadPoolBuilder::new().stack_size(16 << 20).build_global();
    rayon::scope(|_| f())
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

impl EmberBackend for burn::backend::NdArray {
    fn native_low_precision() -> bool {
        false
    }
}
#[cfg(feature = "wgpu")]
impl EmberBackend for burn::backend::Wgpu {}
#[cfg(feature = "cuda")]
impl EmberBackend for burn::backend::Cuda {
    #[cfg(feature = "nccl")]
    fn device_all_reduce(x: FloatTensor<Self>, comm: &DeviceComm) -> Result<FloatTensor<Self>, String> {
        nccl::all_reduce(x, &comm.nccl)
    }
}

impl<B: EmberBackend, C: CheckpointStrategy> EmberBackend for Autodiff<B, C> {
    fn fused(dtype: DType) -> bool {
        B::fused(dtype)
    }

    fn native_low_precision() -> bool {
        B::native_low_precision()
    }

    fn rms_norm_fused(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        fused::rms_norm_autodiff::<B, C>(x, w, eps)
    }

    fn swiglu_fused(gu: FloatTensor<Self>) -> FloatTensor<Self> {
        fused::swiglu_autodiff::<B, C>(gu)
    }

    fn linear_fused(x: FloatTensor<Self>, w: FloatTensor<Self>, b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        fused::linear_autodiff::<B, C>(x, w, b)
    }

    fn attention_op(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: AttnShape,
    ) -> FloatTensor<Self> {
        fused::attention_autodiff::<B, C>(qkv, cos.primitive, sin.primitive, shape)
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
