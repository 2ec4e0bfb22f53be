//! NCCL for CUDA tensors (`--features nccl`): a communicator over the ranks of a data-parallel run
//! (its id carried by MPI), and an in-place sum of a flat f32 tensor of Burn's CUDA backend, on the
//! device, without a copy through the host.
//!
//! Burn's CUDA tensors live in cubecl's memory on cubecl's private streams: the tensor is resolved
//! out of the fusion graph, its pending kernels are waited for (`Backend::sync`), NCCL sums the
//! buffer on its own stream in the same (primary) CUDA context, and that stream is synchronised
//! before Burn uses the buffer again.

use std::sync::Arc;

use burn::backend::Cuda;
use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::{DeviceComm, ReduceError};

type Inner = CubeBackend<CudaRuntime, f32, i32, u8>;

/// An NCCL communicator of this rank, used by one thread at a time (the mutex), as NCCL requires.
pub struct Nccl {
    comm: std::sync::Mutex<Comm>,
    ordinal: usize,
}

// SAFETY: the communicator is only reached through the mutex.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

/// An NCCL set-up that failed.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error(
        "NCCL (libnccl.so) was not found; install it (e.g. the nvidia-nccl-cu12 wheel's library, with a \
         libnccl.so link on LD_LIBRARY_PATH) or run without --features nccl (reductions then go through \
         the host over MPI)"
    )]
    Missing,
    #[error("an NCCL id has 128 bytes, got {0}")]
    IdLength(usize),
    /// A CUDA or NCCL call, and what it answered.
    #[error("{call}: {answer}")]
    Call { call: String, answer: String },
}

fn failed(call: impl Into<String>, answer: impl std::fmt::Debug) -> NcclError {
    NcclError::Call { call: call.into(), answer: format!("{answer:?}") }
}

/// NCCL's unique id (128 bytes), made by rank 0 and sent to the others by the caller.
pub fn unique_id() -> Result<Vec<u8>, NcclError> {
    check_library()?;
    let id = Id::new().map_err(|e| failed("ncclGetUniqueId", e.0))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// The communicator of rank `rank` of `world` on CUDA device `ordinal`, from rank 0's id.
pub fn communicator(ordinal: usize, rank: usize, world: usize, id: &[u8]) -> Result<DeviceComm, NcclError> {
    check_library()?;
    let bytes: [std::ffi::c_char; 128] = id
        .iter()
        .map(|&b| b as std::ffi::c_char)
        .collect::<Vec<_>>()
        .try_into()
        .map_err(|_| NcclError::IdLength(id.len()))?;
    let ctx = CudaContext::new(ordinal).map_err(|e| failed(format!("CUDA device {ordinal}"), e))?;
    let stream = ctx.new_stream().map_err(|e| failed(format!("CUDA stream on device {ordinal}"), e))?;
    let comm = Comm::from_rank(stream, rank, world, Id::uninit(bytes))
        .map_err(|e| failed(format!("ncclCommInitRank (rank {rank} of {world})"), e.0))?;
    Ok(DeviceComm { nccl: Arc::new(Nccl { comm: std::sync::Mutex::new(comm), ordinal }) })
}

/// cudarc loads libnccl when first called and panics when it is missing: look first.
fn check_library() -> Result<(), NcclError> {
    // SAFETY: only probes for the shared library.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(NcclError::Missing)
    }
}

/// Burn's device memory, borrowed for one NCCL call.
struct Borrowed<'s> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'s Arc<CudaStream>,
}

impl DeviceSlice<f32> for Borrowed<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtrMut<f32> for Borrowed<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        // Ordering is done by hand: Burn's stream is synchronised before, NCCL's after.
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// Sums the flat f32 CUDA tensor `x` over the communicator's ranks, in place.
pub fn all_reduce(x: FloatTensor<Cuda>, c: &Nccl) -> Result<FloatTensor<Cuda>, ReduceError> {
    let failed = |call: String, answer: String| ReduceError::Call { call, answer };
    // A clone keeps `x` registered in the fusion graph; both name the same buffer.
    let cube: CubeTensor<CudaRuntime> = x.client.resolve_tensor_float::<Inner>(x.clone());
    if cube.dtype != DType::F32 || !cube.is_contiguous() {
        return Err(ReduceError::Layout { dtype: format!("{:?}", cube.dtype), contiguous: cube.is_contiguous() });
    }
    let n = cube.meta.num_elements();
    let resource = cube
        .client
        .get_resource(cube.handle.clone())
        .map_err(|e| failed("CUDA buffer of a bucket".into(), format!("{e:?}")))?;
    let ptr = resource.resource().ptr; // the handle's offset is already applied
    if resource.resource().size < (n * 4) as u64 {
        let answer = format!("{} bytes for {n} values", resource.resource().size);
        return Err(failed("CUDA buffer of a bucket".into(), answer));
    }
    // The kernels that wrote the bucket have finished.
    Inner::sync(&cube.device).map_err(|e| failed(format!("CUDA device {}", c.ordinal), format!("{e:?}")))?;
    let comm = c.comm.lock().unwrap_or_else(|p| p.into_inner());
    let stream = comm.stream();
    stream.context().bind_to_thread().map_err(|e| failed("CUDA context".into(), format!("{e:?}")))?;
    let mut buffer = Borrowed { ptr, len: n, stream: &stream };
    comm.all_reduce_in_place::<_, f32>(&mut buffer, &ReduceOp::Sum)
        .map_err(|e| failed(format!("ncclAllReduce of {n} values"), format!("NCCL error {:?}", e.0)))?;
    stream.synchronize().map_err(|e| failed("CUDA stream".into(), format!("{e:?}")))?;
    drop((resource, cube));
    Ok(x)
}
