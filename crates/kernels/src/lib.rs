//! ember's kernels: the ops that Burn does not fuse for us, as backend extensions, with their CPU
//! kernels. Depends on Burn and on nothing of ember; the model crate calls the tensor-level entry
//! points, the trainer the optimizer's and the loss's.
//!
//! One op a file, each with the same parts:
//! - a capability trait (`RmsNormOps`, `LayerNormOps`, `QkNormOps`, `GluOps`, `GeluOps`,
//!   `ReluSquaredOps`, `LinearOps`, `AttentionOps`, `AdamWOps`, `LmHeadLossOps`, `KvWriteOps`,
//!   `PagedAttentionOps`, `RopeOps`, `DeviceReduceOps`) whose default methods are the reference:
//!   the plain composition of Burn tensor ops for the forward pass, and its gradients through
//!   Burn's autodiff for the backward pass. A backend without kernels
//!   implements the trait with no body and is correct; nothing panics for want of a kernel;
//! - the `Flex` impl, which runs the CPU kernels (the private `kernels`, `few_rows`, `bf16_gemm`
//!   modules, or the op file's own `kernel` module) on f32 tensors and the reference otherwise;
//! - the `Autodiff` impl, which makes the op one graph node whose backward is the inner backend's;
//! - a tensor-level entry point that the model calls;
//! - tests comparing the kernels with the reference, values and gradients.
//!
//! Every op takes a [`Compute`]: how the run computes (the products' dtype, which CPU products take
//! bf16 operands, kernels or reference, which instruction-set copies may run), one value resolved
//! by the binary and carried by the model; an op's backward runs as its forward did. Nothing in
//! this crate reads the environment or keeps process-wide switches; what it caches is the CPU's
//! detection.
//!
//! [`EmberBackend`] is all of the traits, plus facts about a backend that choose a path, never
//! correctness: [`EmberBackend::fused`] (whether running an op as one node is faster than its
//! composition), [`EmberBackend::native_low_precision`] and [`EmberBackend::cpu_bf16_gemms`].

mod activation;
pub mod adamw;
pub mod attention;
pub mod bench;
mod bf16_gemm;
mod bf16_rows;
pub mod calibrate;
pub mod collective;
mod compute;
pub mod cross_entropy;
pub mod documents;
pub mod experts;
mod few_rows;
mod flex;
pub mod gelu;
pub mod interleave;
mod kernels;
pub mod kv;
pub mod layer_norm;
pub mod linear;
pub mod newton_schulz;
pub mod paged;
mod products;
pub mod profile;
pub mod qdot;
pub mod qk_norm;
pub mod quant;
pub mod relu_squared;
pub mod rms_norm;
pub mod rope;
mod simd;
pub mod swiglu;
pub mod temperature;
#[cfg(test)]
mod testing;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorPrimitive};

pub use adamw::{adamw, sum_squares, AdamWOps, AdamWStep};
pub use attention::{AttentionOps, AttentionSaved};
pub use collective::{DeviceComm, DeviceReduceOps, ReduceError};
pub use compute::{ActivationBits, Bf16Kernel, Bf16Products, Compute, Cpu, Path, Tier};
pub use cross_entropy::{lm_head_cross_entropy, ChunkSpec, LmHeadLossOps, IGNORE};
pub use experts::{experts, ExpertOps};
pub use gelu::{Gelu, GeluOps};
pub use kernels::{AttnShape, LinearGrads};
pub use kv::KvWriteOps;
pub use layer_norm::LayerNormOps;
pub use linear::LinearOps;
pub use newton_schulz::NsStep;
pub use paged::PagedAttentionOps;
pub use qk_norm::QkNormOps;
pub use quant::{quant_linear, quant_linear_lora, QuantLinearOps, QuantWeight};
pub use relu_squared::ReluSquaredOps;
pub use rms_norm::RmsNormOps;
pub use rope::RopeOps;
pub use swiglu::{Gate, GluOps};

/// A pointer to one output buffer that parallel tasks share, each writing its own disjoint part
/// (the few-rows products: whole outputs or column ranges; the bf16 GEMM and the quantized
/// products: column panels).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: the tasks sharing one write disjoint parts of the buffer, which outlives them.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The output `offset` elements in.
    ///
    /// # Safety
    /// `offset` must lie inside the output.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut f32 {
        self.0.add(offset)
    }
}

/// A Burn backend with every one of ember's ops.
pub trait EmberBackend:
    Backend
    + RmsNormOps
    + LayerNormOps
    + QkNormOps
    + GluOps
    + GeluOps
    + ReluSquaredOps
    + LinearOps
    + ExpertOps
    + QuantLinearOps
    + AttentionOps
    + AdamWOps
    + LmHeadLossOps
    + KvWriteOps
    + PagedAttentionOps
    + RopeOps
    + DeviceReduceOps
{
    /// Whether the model should call the ops as single nodes for tensors of `dtype` (this backend
    /// has kernels for them that beat the composition). Without, it runs the compositions, which
    /// Burn fuses or differentiates op by op. Either way the results are the ops' results.
    fn fused(_dtype: DType) -> bool {
        false
    }

    /// Whether bf16/f16 GEMMs run natively (GPU tensor cores), as opposed to through f32 conversions
    /// that make them slower than f32 (Burn's CPU backends). Mixed precision falls back to f32 where
    /// they do not, since it would only cost time.
    fn native_low_precision() -> bool {
        true
    }

    /// Whether, without native low precision, the large matrix products can take bf16 operands with
    /// f32 sums on this CPU ([`Compute::bf16`]): what `--precision bf16` then runs.
    fn cpu_bf16_gemms() -> bool {
        false
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

/// Backends without kernels: every op is its reference.
macro_rules! reference_ops {
    ($backend:ty) => {
        impl RmsNormOps for $backend {}
        impl LayerNormOps for $backend {}
        impl QkNormOps for $backend {}
        impl GluOps for $backend {}
        impl GeluOps for $backend {}
        impl ReluSquaredOps for $backend {}
        impl LinearOps for $backend {}
        impl ExpertOps for $backend {}
        impl QuantLinearOps for $backend {}
        impl AttentionOps for $backend {}
        impl AdamWOps for $backend {}
        impl LmHeadLossOps for $backend {}
        impl KvWriteOps for $backend {}
        impl PagedAttentionOps for $backend {}
        impl RopeOps for $backend {}
    };
}

reference_ops!(burn::backend::NdArray);
impl DeviceReduceOps for burn::backend::NdArray {}
impl EmberBackend for burn::backend::NdArray {
    fn native_low_precision() -> bool {
        false
    }
}

#[cfg(feature = "wgpu")]
reference_ops!(burn::backend::Wgpu);
#[cfg(feature = "wgpu")]
impl DeviceReduceOps for burn::backend::Wgpu {}
#[cfg(feature = "wgpu")]
impl EmberBackend for burn::backend::Wgpu {}

#[cfg(feature = "cuda")]
reference_ops!(burn::backend::Cuda);
#[cfg(feature = "cuda")]
impl EmberBackend for burn::backend::Cuda {}

impl<B: EmberBackend, C: CheckpointStrategy> EmberBackend for Autodiff<B, C> {
    fn fused(dtype: DType) -> bool {
        B::fused(dtype)
    }

    fn native_low_precision() -> bool {
        B::native_low_precision()
    }

    fn cpu_bf16_gemms() -> bool {
        B::cpu_bf16_gemms()
    }
}

/// `x` in `dtype`, without a cast op when it already is.
pub fn to_dtype<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        x
    } else {
        x.cast(dtype)
    }
}

/// The gradient of `Σ f(inputs) ⊙ dy` with respect to each input, through Burn's autodiff over
/// `B`: the reference backward pass of an op whose forward pass is the composition `f`. An input
/// the output does not depend on gets zeros.
pub(crate) fn reference_grads<B: Backend, const N: usize>(
    inputs: [Tensor<B, 2>; N],
    dy: Tensor<B, 2>,
    f: impl FnOnce([Tensor<Autodiff<B>, 2>; N]) -> Tensor<Autodiff<B>, 2>,
) -> [Tensor<B, 2>; N] {
    fn as_array<T, const N: usize>(xs: Vec<T>) -> [T; N] {
        xs.try_into().unwrap_or_else(|_| unreachable!("N inputs, N leaves, N gradients"))
    }
    as_array(reference_grads_of(inputs.into(), dy, |leaves| f(as_array(leaves))))
}

/// [`reference_grads`] of any number of inputs.
pub(crate) fn reference_grads_of<B: Backend>(
    inputs: Vec<Tensor<B, 2>>,
    dy: Tensor<B, 2>,
    f: impl FnOnce(Vec<Tensor<Autodiff<B>, 2>>) -> Tensor<Autodiff<B>, 2>,
) -> Vec<Tensor<B, 2>> {
    let zeros: Vec<Tensor<B, 2>> = inputs.iter().map(Tensor::zeros_like).collect();
    let leaves: Vec<_> = inputs.into_iter().map(|x| Tensor::<Autodiff<B>, 2>::from_inner(x).require_grad()).collect();
    let y = f(leaves.clone());
    let grads = (y * Tensor::from_inner(dy)).sum().backward();
    zeros.into_iter().zip(&leaves).map(|(zero, leaf)| leaf.grad(&grads).unwrap_or(zero)).collect()
}

/// Threads of the CPU kernels' pool (what a measured CPU peak depends on).
pub fn cpu_workers() -> usize {
    rayon::current_num_threads()
}

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

/// Runs `f` on a thread of rayon's global pool (16 MiB stacks), which the CPU kernels (ours and
/// Flex's GEMMs and element-wise ops) use. Called from outside the pool, every parallel op is
/// injected into it and the caller sleeps until a worker wakes and finishes: one wake-up per op,
/// thousands per training step. From inside, the ops start as local jobs. A nano training step
/// measured 15% faster this way (`experiments/cpu-speed.md`).
pub fn on_cpu_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    init_cpu_workers(None);
    rayon::scope(|_| f())
}

pub(crate) fn float<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

pub(crate) fn int<B: Backend, const D: usize>(p: IntTensor<B>) -> Tensor<B, D, Int> {
    Tensor::from_primitive(p)
}

pub(crate) fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// The backend the unit tests run on.
#[cfg(test)]
pub(crate) type TestBackend = burn::backend::Flex;

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tolerance};

    /// A backend without kernels answers every op with its reference, forward and backward: no
    /// op panics for want of a kernel.
    #[test]
    fn a_backend_without_kernels_runs_every_op_as_its_reference() {
        type B = NdArray;
        let dev = Default::default();
        let t = |shape: [usize; 2]| Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), &dev);
        let (x, w, dy) = (t([5, 8]), t([1, 8]).reshape([8]), t([5, 8]));
        let cx = Compute::default();
        let y = float::<B, 2>(B::rms_norm(prim(x.clone()), prim(w.clone()), 1e-5, cx));
        y.into_data().assert_approx_eq::<f32>(
            &rms_norm::reference(x.clone(), w.clone(), 1e-5).into_data(),
            Tolerance::absolute(1e-6),
        );
        let (dx, dw) = B::rms_norm_backward(prim(x.clone()), prim(w.clone()), prim(dy.clone()), 1e-5, cx);
        let (want_dx, want_dw) = rms_norm::reference_backward(x.clone(), w.clone(), dy.clone(), 1e-5);
        float::<B, 2>(dx).into_data().assert_approx_eq::<f32>(&want_dx.into_data(), Tolerance::absolute(1e-6));
        float::<B, 1>(dw).into_data().assert_approx_eq::<f32>(&want_dw.into_data(), Tolerance::absolute(1e-6));
        let (dx, dw, db) = B::layer_norm_backward(prim(x.clone()), prim(w.clone()), prim(dy.clone()), true, 1e-5, cx);
        let (want_dx, want_dw, want_db) = layer_norm::reference_backward(x.clone(), w.clone(), dy.clone(), true, 1e-5);
        float::<B, 2>(dx).into_data().assert_approx_eq::<f32>(&want_dx.into_data(), Tolerance::absolute(1e-6));
        float::<B, 1>(dw).into_data().assert_approx_eq::<f32>(&want_dw.into_data(), Tolerance::absolute(1e-6));
        assert!(db.is_some() && want_db.is_some());
        let gu = t([5, 16]);
        for gate in [Gate::Silu, Gate::GeluTanh] {
            let d = float::<B, 2>(B::glu_backward(prim(gu.clone()), prim(dy.clone()), gate, cx));
            assert_eq!(d.dims(), [5, 16]);
        }
        // The exact GELU's gradient is its own on every backend (not Burn's default `gelu_backward`,
        // the tanh approximation's): Φ(x) + x·φ(x) at x = 1.5.
        let at = Tensor::<B, 2>::from_data([[1.5f32]], &dev);
        let d = float::<B, 2>(B::gelu_with_backward(prim(at.clone()), prim(at.ones_like()), Gelu::Erf, cx));
        let want =
            0.5 * (1.0 + libm::erf(1.5 / 2f64.sqrt())) + 1.5 * (-1.125f64).exp() / (2.0 * std::f64::consts::PI).sqrt();
        assert!((d.into_scalar() as f64 - want).abs() < 1e-6, "exact GELU's gradient");
        let qkv = t([5, 6]);
        let qk = (1, 1, 2);
        let (w2, w2b) = (t([1, 2]).reshape([2]), t([1, 2]).reshape([2]));
        let (dqkv, _, _) = B::qk_norm_backward(
            prim(qkv.clone()),
            prim(w2.clone()),
            prim(w2b.clone()),
            prim(qkv.clone()),
            qk,
            1e-6,
            cx,
        );
        assert_eq!(float::<B, 2>(dqkv).dims(), [5, 6]);
        let lw = t([8, 3]);
        let need = LinearGrads { x: true, w: false, b: true };
        let (dx, dw, db) = B::linear_backward(prim(x.clone()), prim(lw.clone()), prim(t([5, 3])), need, cx);
        assert!(dx.is_some() && dw.is_none() && db.is_some());
        let y = float::<B, 2>(B::linear_forward(prim(x), prim(lw), None, cx));
        assert_eq!(y.dims(), [5, 3]);
        let rope = rope::Rope::<B>::new(8, 4, 10_000.0, rope::RopeLayout::HalfSplit, &dev);
        let s = AttnShape {
            batch: 1,
            seq: 3,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            start: 0,
            layout: rope::RopeLayout::HalfSplit,
            rotate: true,
            scale: 0.5,
            docs: None,
        };
        let (cos, sin) = rope.tables();
        let qkv = t([3, s.packed_width()]);
        let saved = B::attention_forward(prim(qkv), prim(cos.clone()), prim(sin.clone()), s.clone(), cx);
        let width = s.packed_width();
        let d = float::<B, 2>(B::attention_backward(saved, prim(t([3, 8])), prim(cos), prim(sin), s, cx));
        assert_eq!(d.dims(), [3, width]);
    }
}
