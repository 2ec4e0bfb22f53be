//! Choosing the Burn backend at run time. Model and training code are generic over the backend;
//! this is the one place that names concrete ones.

use std::fmt;
use std::str::FromStr;

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy, NoCheckpointing};
use burn::backend::Autodiff;
use burn::tensor::Device;
use ember_kernels::TrainBackend;

/// A device as given on the command line: `cpu`, `wgpu[:N]` or `cuda[:N]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Wgpu(Option<usize>),
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, index) = match s.split_once(':') {
            Some((k, i)) => {
                let i = i.parse::<usize>().map_err(|_| format!("device `{s}`: `{i}` is not a device index"))?;
                (k, Some(i))
            }
            None => (s, None),
        };
        match (kind, index) {
            ("cpu", None) => Ok(Self::Cpu),
            ("wgpu", i) => Ok(Self::Wgpu(i)),
            ("cuda", i) => Ok(Self::Cuda(i.unwrap_or(0))),
            _ => Err(format!("device `{s}`: expected cpu, wgpu[:N] or cuda[:N]")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Wgpu(None) => write!(f, "wgpu"),
            Self::Wgpu(Some(i)) => write!(f, "wgpu:{i}"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Backends compiled into this binary.
pub fn compiled() -> Vec<&'static str> {
    let mut out = vec!["cpu (flex)"];
    if cfg!(feature = "wgpu") {
        out.push("wgpu");
    }
    if cfg!(feature = "cuda") {
        out.push("cuda");
    }
    out
}

/// Work that runs on whichever backend the user picked.
pub trait Job {
    type Output;
    fn run<B: TrainBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<Self::Output>;
}

/// Runs `job` on the backend of `spec` (with Burn's balanced activation checkpointing when asked),
/// or explains which build has it.
pub fn dispatch<J: Job>(spec: DeviceSpec, checkpointing: bool, job: J) -> anyhow::Result<J::Output> {
    if checkpointing {
        dispatch_with::<BalancedCheckpointing, J>(spec, job)
    } else {
        dispatch_with::<NoCheckpointing, J>(spec, job)
    }
}

fn dispatch_with<C: CheckpointStrategy, J: Job>(spec: DeviceSpec, job: J) -> anyhow::Result<J::Output> {
    match spec {
        DeviceSpec::Cpu => job.run::<Autodiff<burn::backend::Flex, C>>(Default::default(), "cpu (flex)"),
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu(i) => {
            use burn::backend::wgpu::WgpuDevice;
            let device = i.map_or(WgpuDevice::DefaultDevice, WgpuDevice::DiscreteGpu);
            job.run::<Autodiff<burn::backend::Wgpu, C>>(device, "wgpu")
        }
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(i) => {
            cuda_preflight(i)?;
            let device = burn::backend::cuda::CudaDevice::new(i);
            job.run::<Autodiff<burn::backend::Cuda, C>>(device, "cuda")
        }
        #[allow(unreachable_patterns)]
        other => anyhow::bail!(
            "device `{other}` is not compiled into this binary (it has: {}); rebuild with `--features {}`",
            compiled().join(", "),
            match other {
                DeviceSpec::Wgpu(_) => "wgpu",
                _ => "cuda",
            }
        ),
    }
}

/// Checks that the NVIDIA driver loads and has device `index`, so that a machine without either gets
/// an error saying so (Burn's CUDA runtime panics on another thread instead).
#[cfg(feature = "cuda")]
fn cuda_preflight(index: usize) -> anyhow::Result<()> {
    type CuInit = unsafe extern "C" fn(u32) -> i32;
    type CuDeviceGetCount = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: loading the NVIDIA driver library runs its initialisers, as Burn's runtime would.
    let lib = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"]
        .iter()
        .find_map(|name| unsafe { libloading::Library::new(name) }.ok());
    let Some(lib) = lib else {
        anyhow::bail!(
            "device cuda:{index}: the NVIDIA driver library (libcuda.so.1) is not on this machine or not on \
             the library path; install the NVIDIA driver, or pick another device (cpu, wgpu)"
        );
    };
    // SAFETY: the signatures are those of the CUDA driver API (cuda.h); `count` outlives the call.
    let count = unsafe {
        let init: libloading::Symbol<CuInit> = lib.get(b"cuInit\0")?;
        let get_count: libloading::Symbol<CuDeviceGetCount> = lib.get(b"cuDeviceGetCount\0")?;
        let status = init(0);
        if status != 0 {
            anyhow::bail!("device cuda:{index}: the NVIDIA driver failed to initialise (CUresult {status}); does `nvidia-smi` see a GPU?");
        }
        let mut count = 0i32;
        let status = get_count(&mut count);
        if status != 0 {
            anyhow::bail!("device cuda:{index}: the NVIDIA driver could not count devices (CUresult {status})");
        }
        count.max(0) as usize
    };
    match count {
        0 => anyhow::bail!("device cuda:{index}: the NVIDIA driver is installed but sees no CUDA device"),
        n if index >= n => {
            anyhow::bail!("device cuda:{index}: this machine has {n} CUDA device(s), cuda:0 to cuda:{}", n - 1)
        }
        _ => {}
    }
    Ok(())
}

/// The GPU's model name as `nvidia-smi` prints it (for the peak-FLOPs table); `None` elsewhere.
pub fn gpu_name(spec: DeviceSpec) -> Option<String> {
    let DeviceSpec::Cuda(i) = spec else { return None };
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "-i", &i.to_string()])
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !name.is_empty()).then_some(name)
}

/// Memory free for a run: the host's available memory for the CPU, the GPU's free memory (from
/// `nvidia-smi`) for CUDA; unknown for WGPU.
pub fn memory_available(spec: DeviceSpec) -> Option<u64> {
    match spec {
        DeviceSpec::Cpu => ember_train::memory::host_available(),
        DeviceSpec::Cuda(i) => {
            let out = std::process::Command::new("nvidia-smi")
                .args(["--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", &i.to_string()])
                .output()
                .ok()?;
            let mib: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
            Some(mib << 20)
        }
        DeviceSpec::Wgpu(_) => None,
    }
}

/// The memory probe for a device: the heap on the CPU, CubeCL's memory pools on WGPU and CUDA.
pub fn memory_probe(spec: DeviceSpec) -> &'static dyn ember_train::bench::MemoryProbe {
    match spec {
        DeviceSpec::Cpu => &crate::alloc::HeapProbe,
        #[cfg(feature = "wgpu")]
        DeviceSpec::Wgpu(i) => {
            use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
            let device = i.map_or(WgpuDevice::DefaultDevice, WgpuDevice::DiscreteGpu);
            Box::leak(Box::new(cube::CubeProbe::<WgpuRuntime>::new(device)))
        }
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda(i) => {
            use burn::cubecl::cuda::CudaRuntime;
            Box::leak(Box::new(cube::CubeProbe::<CudaRuntime>::new(burn::backend::cuda::CudaDevice::new(i))))
        }
        #[allow(unreachable_patterns)]
        _ => &ember_train::bench::NoProbe,
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube {
    use std::sync::atomic::{AtomicU64, Ordering};

    use burn::cubecl::Runtime;
    use ember_train::bench::MemoryProbe;

    /// Bytes in use in CubeCL's memory pools; the peak is the higher of the largest use seen and
    /// the bytes the pools hold reserved (pools keep what they once needed).
    pub struct CubeProbe<R: Runtime> {
        device: R::Device,
        peak: AtomicU64,
    }

    impl<R: Runtime> CubeProbe<R> {
        pub fn new(device: R::Device) -> Self {
            Self { device, peak: AtomicU64::new(0) }
        }

        fn usage(&self) -> Option<(u64, u64)> {
            let u = R::client(&self.device).memory_usage().ok()?;
            Some((u.bytes_in_use, u.bytes_reserved))
        }
    }

    impl<R: Runtime> MemoryProbe for CubeProbe<R>
    where
        R::Device: Send + Sync,
    {
        fn current_bytes(&self) -> Option<u64> {
            let (used, reserved) = self.usage()?;
            self.peak.fetch_max(used.max(reserved), Ordering::Relaxed);
            Some(used)
        }
        fn reset_peak(&self) {
            let used = self.usage().map_or(0, |(u, _)| u);
            self.peak.store(used, Ordering::Relaxed);
        }
        fn peak_bytes(&self) -> Option<u64> {
            self.current_bytes()?;
            Some(self.peak.load(Ordering::Relaxed))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(1));
        assert_eq!("wgpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Wgpu(None));
        assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("expected cpu"));
        assert!("cuda:x".parse::<DeviceSpec>().unwrap_err().contains("not a device index"));
    }
}
