//! Every environment variable ember reads, read here, by the binary: the library crates take what
//! these say as values (a [`Compute`], [`Locations`], a [`Launch`]), so that two runs in one process
//! can differ and a test can say what it wants without touching the environment.
//!
//! | variable | what it changes |
//! |---|---|
//! | `EMBER_FUSED=0` | the reference compositions instead of ember's kernels ([`Path::Reference`]) |
//! | `EMBER_AMX=0` | the AVX512_BF16 vector kernel instead of AMX tiles for bf16 products |
//! | `EMBER_ACTIVATIONS=16` | a quantized model's integer products on 16-bit activations (two 8-bit parts: logits within 1e-3 of the f32 model's, not 1–8%; twice the integer work) |
//! | `EMBER_KV_CACHE=f16` | KV caches in f16 (the `--kv-cache` flag's default for `sample`, `chat`, `serve` and the benches) |
//! | `EMBER_CPU_LOW_PRECISION=1` | bf16/f16 tensors on the CPU too (emulated, slower): tests mixed precision |
//! | `EMBER_DATA_DIR`, `EMBER_CACHE_DIR`, `XDG_CACHE_HOME`, `HOME` | where datasets are looked for and cached |
//! | `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `PMIX_SIZE`, `MPI_LOCALNRANKS`, `SLURM_STEP_NUM_TASKS` | how many ranks a launcher started |
//! | `RAYON_NUM_THREADS` | the CPU kernels' threads (read by rayon; ranks sharing a machine split its cores unless it is set) |
//! | `EMBER_API_KEY` | `serve --api-key` |
//! | `EMBER_NCCL` | `0`: a CUDA run's gradients through the host even with NCCL; `1`: NCCL in one process too |

use std::ffi::OsString;
use std::path::PathBuf;

use burn::tensor::DType;
use ember_data::fetch::Locations;
use ember_kernels::{ActivationBits, Bf16Kernel, Compute, Cpu, Path};
use ember_train::distributed::Launch;
use ember_train::precision::ComputeRequest;

fn var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

fn is(name: &str, value: &str) -> bool {
    var(name).is_some_and(|v| v.to_string_lossy().trim() == value)
}

/// How this process computes before any flag says more: ember's kernels or the references
/// (`EMBER_FUSED=0`), the CPU's kernels (`EMBER_AMX=0` keeps the vector kernel for bf16
/// products), the activations of quantized weights' integer products (`EMBER_ACTIVATIONS=16`)
/// and the KV caches' type (`EMBER_KV_CACHE=f16`).
pub fn compute() -> Compute {
    let mut cpu = Cpu::detect();
    if is("EMBER_AMX", "0") && cpu.bf16 == Some(Bf16Kernel::Amx) {
        cpu.bf16 = Some(Bf16Kernel::Avx512);
    }
    let path = if is("EMBER_FUSED", "0") { Path::Reference } else { Path::Kernels };
    let bits = if is("EMBER_ACTIVATIONS", "16") { ActivationBits::Sixteen } else { ActivationBits::Eight };
    let kv_cache = if is("EMBER_KV_CACHE", "f16") { DType::F16 } else { DType::F32 };
    Compute::default().with_cpu(cpu).with_path(path).with_activation_bits(bits).with_kv_cache(kv_cache)
}

/// How a training run is asked to compute: [`compute`], and `EMBER_CPU_LOW_PRECISION=1` (compute
/// bf16/f16 where it is emulated anyway, slower, to test the mixed-precision path on the CPU).
pub fn compute_request() -> ComputeRequest {
    ComputeRequest { base: compute(), emulate_low_precision: is("EMBER_CPU_LOW_PRECISION", "1") }
}

/// The folder of the benchmark sets (`ember eval --tasks`, `[eval]`): `$EMBER_EVAL_DIR`.
pub fn eval_dir() -> Option<PathBuf> {
    var("EMBER_EVAL_DIR").map(PathBuf::from)
}

/// Where datasets are looked for: `datasets/` here, `$EMBER_DATA_DIR`, then the cache
/// (`$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`, else `.ember-cache`).
pub fn locations() -> Locations {
    Locations {
        repo_dir: PathBuf::from("datasets"),
        data_dir: var("EMBER_DATA_DIR").map(PathBuf::from),
        cache_dir: cache_dir(),
    }
}

/// ember's cache folder (see [`locations`]).
pub fn cache_dir() -> PathBuf {
    var("EMBER_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("ember")))
        .or_else(|| var("HOME").map(|p| PathBuf::from(p).join(".cache").join("ember")))
        .unwrap_or_else(|| PathBuf::from(".ember-cache"))
}

/// What a launcher (mpirun, srun) says about the ranks it started; one rank outside one.
pub fn launch() -> Launch {
    // SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: the latter is set in a batch script too, where a plain
    // `ember train` is one process.
    let world_size = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS"]
        .iter()
        .filter_map(|k| var(k)?.to_string_lossy().trim().parse::<usize>().ok())
        .max()
        .unwrap_or(1);
    Launch { world_size, open_mpi: var("OMPI_COMM_WORLD_SIZE").is_some() }
}

/// Whether `RAYON_NUM_THREADS` sets the CPU kernels' threads.
pub fn threads_set() -> bool {
    var("RAYON_NUM_THREADS").is_some()
}

/// `EMBER_API_KEY`: the key `ember serve` asks for when `--api-key` is not given.
pub fn api_key() -> Option<String> {
    var("EMBER_API_KEY").map(|k| k.to_string_lossy().into_owned())
}

/// `EMBER_NCCL`: `Some(false)` for `0`, `Some(true)` for `1`, else `None` (NCCL when several ranks
/// run on CUDA).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub fn nccl() -> Option<bool> {
    match var("EMBER_NCCL")?.to_string_lossy().trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}
