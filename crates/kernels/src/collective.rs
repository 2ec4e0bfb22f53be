//! Sums over the ranks of a data-parallel run on the device: NCCL for CUDA tensors
//! (`--features nccl`). Every other backend's gradients are summed through host memory.

#[cfg(feature = "nccl")]
pub mod nccl;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

/// A reduction on the device that failed.
#[derive(Debug, thiserror::Error)]
pub enum ReduceError {
    #[error("the {0} backend has no device reduction engine")]
    NoEngine(&'static str),
    #[error("NCCL reduces contiguous f32 buckets; got {dtype}, contiguous {contiguous}")]
    Layout { dtype: String, contiguous: bool },
    /// A CUDA or NCCL call, and what it answered.
    #[error("{call}: {answer}")]
    Call { call: String, answer: String },
}

/// A reduction engine on the device over the ranks of a data-parallel run: NCCL for CUDA tensors
/// (`--features nccl`, made by `nccl::communicator`).
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

/// A backend's reduction over ranks on the device; by default it has none.
pub trait DeviceReduceOps: Backend {
    /// Sums the flat f32 tensor `x` (`[n]`) over the ranks of `comm`, in place on the device. Only
    /// CUDA with `--features nccl` has one; every other backend answers with an error (their
    /// gradients are reduced through the host, and no `DeviceComm` is made for them).
    fn device_all_reduce(x: FloatTensor<Self>, comm: &DeviceComm) -> Result<FloatTensor<Self>, ReduceError> {
        let _ = (x, comm);
        Err(ReduceError::NoEngine(std::any::type_name::<Self>()))
    }
}

impl<B: DeviceReduceOps, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy> DeviceReduceOps
    for burn::backend::Autodiff<B, C>
{
}

#[cfg(feature = "cuda")]
impl DeviceReduceOps for burn::backend::Cuda {
    #[cfg(feature = "nccl")]
    fn device_all_reduce(x: FloatTensor<Self>, comm: &DeviceComm) -> Result<FloatTensor<Self>, ReduceError> {
        nccl::all_reduce(x, &comm.nccl)
    }
}
