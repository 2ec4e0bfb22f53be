pub mod bench;
pub mod chat;
pub mod check;
pub mod dashboard;
pub mod eval;
pub mod hf;
pub mod init;
pub mod prepare;
pub mod sample;
pub mod serve;
pub mod source;
pub mod train;

/// `--kv-cache`: the type a generating command's KV cache stores keys and values in.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct KvCacheFlag {
    /// The KV cache's type: f32, or f16 (half its memory and of what a decode step's attention
    /// reads; each key and value rounded to f16, as llama.cpp's default cache) [default: f32, or
    /// EMBER_KV_CACHE].
    #[arg(long, value_enum)]
    kv_cache: Option<KvCacheType>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum KvCacheType {
    F32,
    F16,
}

impl KvCacheFlag {
    /// `compute` with the flag's cache type, where it is given.
    pub fn apply(self, compute: ember_kernels::Compute) -> ember_kernels::Compute {
        match self.kv_cache {
            Some(KvCacheType::F32) => compute.with_kv_cache(burn::tensor::DType::F32),
            Some(KvCacheType::F16) => compute.with_kv_cache(burn::tensor::DType::F16),
            None => compute,
        }
    }
}
