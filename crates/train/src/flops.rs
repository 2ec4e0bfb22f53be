//! Model FLOPs utilisation: `MFU = (6N + 12·L·T·d) · tokens/s / peak` (PaLM, appendix B), with N the
//! parameters that take part in matmuls (`4N` and the adapters' FLOPs for LoRA on a frozen base:
//! `TrainConfig::train_flops_per_token`). The peak comes from a table of dense peaks per GPU and
//! dtype, from the user, or, on the CPU and unknown devices, from measuring the best GEMM of the
//! kind the run uses (the backend's, or the CPU's bf16 kernel: [`Gemms`]), cached with the time it
//! was measured. A run faster than a measured peak measures it again ([`Remeasure`]); MFU is never
//! reported above 1 ([`utilisation`]).

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Device, Distribution, Tensor};
use serde::Serialize;

use ember_kernels::Bf16Kernel;

/// Peak FLOP/s that MFU is measured against, and where the number comes from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Peak {
    pub flops: f64,
    pub source: String,
    /// When it was measured (unix seconds): a measured peak whose cache file says so.
    pub measured_at: Option<u64>,
    /// Whether a run that beats it measures it again: a measured peak, not `--peak-tflops` nor
    /// the table's.
    pub remeasurable: bool,
}

impl Peak {
    /// A peak that is not measured here (`--peak-tflops`, the table): a run that beats it only
    /// clamps its MFU.
    fn given(flops: f64, source: String) -> Self {
        Self { flops, source, measured_at: None, remeasurable: false }
    }
}

/// Dense (no sparsity) peaks: (name fragment, 16-bit tensor-core FLOP/s, f32 FLOP/s), from the
/// vendors' data sheets. More specific names first: the first fragment found in the device name wins.
const GPU_PEAKS: &[(&str, f64, f64)] = &[
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12), // SXM
    ("GH200", 989e12, 67e12),
    ("B200", 2250e12, 80e12),
    ("A100", 312e12, 19.5e12),
    ("A10G", 70e12, 31.2e12),
    ("A10", 125e12, 31.2e12),
    ("L40S", 362e12, 91.6e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 30.3e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("RTX 3090", 71e12, 35.6e12),
    ("V100", 125e12, 15.7e12),
    ("T4", 65e12, 8.1e12),
];

/// The table's peak for a GPU name (as `nvidia-smi` prints it) and GEMM dtype.
pub(crate) fn table_peak(device_name: &str, dtype: DType) -> Option<Peak> {
    let (frag, half, full) = GPU_PEAKS.iter().find(|(frag, _, _)| device_name.contains(frag))?;
    let (flops, kind) = if dtype == DType::F32 { (*full, "f32") } else { (*half, "dense bf16/f16") };
    Some(Peak::given(flops, format!("table: {frag} {kind}")))
}

/// `MFU` for `flops_per_token` model FLOPs at `tokens_per_sec`, at most 1 ([`utilisation`]).
pub(crate) fn mfu(flops_per_token: f64, tokens_per_sec: f64, peak: &Peak) -> f64 {
    utilisation(flops_per_token * tokens_per_sec, peak)
}

/// The share of `peak` that `rate` (model FLOP/s) uses, at most 1: a rate above the peak means the
/// peak is too low (measured on a busy machine, or given too low), not that the run beat the
/// hardware.
pub(crate) fn utilisation(rate: f64, peak: &Peak) -> f64 {
    (rate / peak.flops).min(1.0)
}

/// One measured GEMM shape.
#[derive(Debug, Clone, Serialize)]
pub struct GemmRate {
    pub n: usize,
    pub ms: f64,
    pub flops: f64,
}

/// The rate of square `n×n×n` GEMMs in `dtype` for each `n`: the fastest of `reps` after a warm-up
/// (the best the backend reaches, as a peak should be).
pub(crate) fn measure_gemm<B: Backend>(
    device: &Device<B>,
    dtype: DType,
    sizes: &[usize],
    reps: usize,
) -> Vec<GemmRate> {
    sizes
        .iter()
        .map(|&n| {
            let a = Tensor::<B, 2>::random([n, n], Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let b = Tensor::<B, 2>::random([n, n], Distribution::Normal(0.0, 1.0), device).cast(dtype);
            let _ = B::sync(device);
            let times: Vec<f64> = (0..reps + 1)
                .map(|_| {
                    let start = Instant::now();
                    let c = a.clone().matmul(b.clone());
                    let _ = B::sync(device);
                    drop(c);
                    start.elapsed().as_secs_f64()
                })
                .skip(1)
                .collect();
            let t = times.iter().copied().fold(f64::INFINITY, f64::min);
            GemmRate { n, ms: t * 1e3, flops: 2.0 * (n as f64).powi(3) / t }
        })
        .collect()
}

/// The rate of square `n×n×n` GEMMs through the CPU's bf16 kernel `kernel` (f32 in and out, the
/// operands rounded to bf16, the sums f32), the fastest of `reps` after a warm-up: what
/// `--precision bf16` runs its large GEMMs on there. `None` where the CPU lacks the kernel.
pub(crate) fn measure_cpu_bf16_gemm(kernel: Bf16Kernel, sizes: &[usize], reps: usize) -> Option<Vec<GemmRate>> {
    let rates = sizes.iter().map(|&n| {
        let t = ember_kernels::bench::bf16_gemm_seconds(kernel, n, reps)?;
        Some(GemmRate { n, ms: t * 1e3, flops: 2.0 * (n as f64).powi(3) / t })
    });
    rates.collect()
}

/// Which GEMMs a run's MFU is measured against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gemms {
    /// The backend's matmul in this dtype.
    Backend(DType),
    /// The CPU's bf16 kernel under f32 tensors (`--precision bf16` on a CPU with AVX512_BF16): up
    /// to twice the f32 rate on the vector kernel (more on AMX tiles), so that an f32 peak would put
    /// MFU near 200 %.
    CpuBf16(Bf16Kernel),
}

impl Gemms {
    /// The dtype of a device's table peak.
    fn dtype(self) -> DType {
        match self {
            Gemms::Backend(dtype) => dtype,
            Gemms::CpuBf16(_) => DType::BF16,
        }
    }

    /// How the cache file and the logs name these GEMMs.
    fn label(self) -> String {
        match self {
            Gemms::Backend(dtype) => format!("{dtype:?}"),
            Gemms::CpuBf16(Bf16Kernel::Avx512) => "bf16-kernel".into(),
            Gemms::CpuBf16(Bf16Kernel::Amx) => "bf16-amx-kernel".into(),
        }
    }

    /// The best square-GEMM rates in `sizes` (each the fastest of `reps`).
    pub(crate) fn measure<B: Backend>(self, device: &Device<B>, sizes: &[usize], reps: usize) -> Vec<GemmRate> {
        let kernel = match self {
            Gemms::CpuBf16(kernel) => measure_cpu_bf16_gemm(kernel, sizes, reps),
            Gemms::Backend(_) => None,
        };
        kernel.unwrap_or_else(|| measure_gemm::<B>(device, self.dtype(), sizes, reps))
    }
}

/// The peak for MFU: `override_tflops`, else the table entry for `device_name`, else the GEMM peak
/// measured on this machine: read from `cache` (written by `ember bench peak` or an earlier run),
/// or measured now and cached, so that MFU is comparable across runs.
pub(crate) fn resolve_peak<B: Backend>(
    device: &Device<B>,
    device_name: Option<&str>,
    gemms: Gemms,
    override_tflops: Option<f64>,
    cache: Option<&Path>,
) -> Peak {
    if let Some(t) = override_tflops {
        return Peak::given(t * 1e12, "--peak-tflops".into());
    }
    if let Some(p) = device_name.and_then(|n| table_peak(n, gemms.dtype())) {
        return p;
    }
    let file = cache.map(|dir| dir.join(peak_cache_name::<B>(device, gemms)));
    if let Some((flops, at)) = file.as_deref().and_then(read_peak) {
        let when = at.map_or_else(|| "earlier (when not recorded)".into(), |t| format!("{} UTC", utc_minute(t)));
        let source = format!("measured {when}: best {} GEMM on {}", gemms.label(), B::name(device));
        return Peak { flops, source, measured_at: at, remeasurable: true };
    }
    let peak = measure_peak::<B>(device, gemms);
    if let Some(f) = file {
        store_peak(&f, peak.flops, peak.measured_at.unwrap_or_else(now_unix));
    }
    peak
}

/// The best rate of `gemms` on `device`, measured now (square GEMMs of 512, 1024 and 2048).
fn measure_peak<B: Backend>(device: &Device<B>, gemms: Gemms) -> Peak {
    let rates = gemms.measure::<B>(device, &[512, 1024, 2048], 3);
    let best = rates.iter().max_by(|a, b| a.flops.total_cmp(&b.flops)).expect("three sizes");
    let (label, n) = (gemms.label(), best.n);
    let source = format!("measured now: best {label} GEMM on {} ({n}³)", B::name(device));
    Peak { flops: best.flops, source, measured_at: Some(now_unix()), remeasurable: true }
}

/// How a run measures its peak again when it beats it: the run's GEMMs measured now (`measure`),
/// the raised peak remembered in `cache` (the file [`resolve_peak`] reads).
pub(crate) struct Remeasure {
    pub(crate) measure: Box<dyn FnMut() -> Peak + Send>,
    pub(crate) cache: Option<PathBuf>,
}

impl Remeasure {
    /// Measures `gemms` on `device`, as [`resolve_peak`] does, caching in `cache_dir`.
    pub(crate) fn of<B: Backend>(device: &Device<B>, gemms: Gemms, cache_dir: Option<&Path>) -> Self {
        let cache = cache_dir.map(|dir| dir.join(peak_cache_name::<B>(device, gemms)));
        let device = device.clone();
        Self { measure: Box::new(move || measure_peak::<B>(&device, gemms)), cache }
    }
}

/// Seconds since the Unix epoch, now.
pub(crate) fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `unix` seconds as a UTC date and minute, `2026-12-07 08:30` (the proleptic Gregorian calendar:
/// Howard Hinnant's days-to-civil).
pub(crate) fn utc_minute(unix: u64) -> String {
    let (days, secs) = ((unix / 86_400) as i64, unix % 86_400);
    // Days since 0000-03-01, in eras of 400 years (146,097 days) that start on a March 1st.
    let z = days + 719_468;
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}", secs / 3600, secs % 3600 / 60)
}

/// The cache file of a measured peak: backend, GEMMs, CPU model, a hash of the CPU's feature flags
/// and the thread count in the name.
pub(crate) fn peak_cache_name<B: Backend>(device: &Device<B>, gemms: Gemms) -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    // The pool's threads, not the machine's cores: data-parallel ranks (and RAYON_NUM_THREADS)
    // run with fewer.
    cache_name(&format!("{}-{}", B::name(device), gemms.label()), &cpuinfo, ember_kernels::cpu_workers())
}

/// [`peak_cache_name`] given the text of `/proc/cpuinfo`.
fn cache_name(backend: &str, cpuinfo: &str, threads: usize) -> String {
    format!("{}.txt", cpu_file_stem(&format!("peak-{backend}"), cpuinfo, threads))
}

/// A cache file's name for something measured on this CPU, without its extension: `kind`, the CPU's
/// model, a hash of its feature flags and the thread count (`cpuinfo`: the text of `/proc/cpuinfo`),
/// every character other than ASCII letters, digits and `-` replaced by `_`.
pub(crate) fn cpu_file_stem(kind: &str, cpuinfo: &str, threads: usize) -> String {
    let field = |name: &str| {
        let line = cpuinfo.lines().find(|l| l.split(':').next().is_some_and(|k| k.trim() == name));
        line.and_then(|l| l.split_once(':')).map_or("", |(_, v)| v.trim())
    };
    // Virtual machines often name only the vendor ("AMD EPYC" for a Zen 3 with AVX2 and a Zen 4
    // with AVX-512 alike): the flags tell them apart.
    let flags = fnv1a(field("flags").as_bytes());
    let key = format!("{kind}-{}-{flags:08x}-{threads}", field("model name"));
    key.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
}

/// 32-bit FNV-1a of `bytes`: a short, stable name for a long string.
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// A cached peak and when it was measured (unix seconds; `"{flops}\n{unix}\n"`, or an older build's
/// `"{flops}\n"` without the time), ignored unless it is a finite rate above 0 (a damaged file or
/// an older build's 0).
fn read_peak(file: &Path) -> Option<(f64, Option<u64>)> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut lines = text.lines().map(str::trim);
    let flops = lines.next()?.parse::<f64>().ok()?;
    let at = lines.next().and_then(|l| l.parse::<u64>().ok());
    (flops.is_finite() && flops > 0.0).then_some((flops, at))
}

/// Remembers a peak measured at `at` (unix seconds), keeping the higher of it and any earlier one
/// (with its time): a peak is the best the machine reached (best effort: a cache that cannot be
/// written is only a warning). A peak that is 0, negative or not finite is never written (it would
/// put MFU at inf %).
pub(crate) fn store_peak(file: &Path, flops: f64, at: u64) {
    if !(flops.is_finite() && flops > 0.0) {
        return;
    }
    if read_peak(file).is_some_and(|(earlier, _)| earlier >= flops) {
        return;
    }
    let dir = file.parent().unwrap_or(Path::new("."));
    let written = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(file, format!("{flops}\n{at}\n")));
    if let Err(e) = written {
        tracing::warn!("cannot cache the measured peak in {}: {e}", file.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_model::ModelConfig;

    #[test]
    fn a_peak_of_zero_or_not_finite_is_never_cached_nor_believed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("peak.txt");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            store_peak(&file, bad, 1);
            assert!(!file.exists(), "{bad} was cached");
        }
        for bad in ["0", "-3e9", "NaN", "inf", "x"] {
            std::fs::write(&file, bad).unwrap();
            assert_eq!(read_peak(&file), None, "{bad}");
        }
        // A 0 left by an older build is replaced, not kept as the higher of the two.
        std::fs::write(&file, "0\n").unwrap();
        store_peak(&file, 2e9, 5);
        assert_eq!(read_peak(&file), Some((2e9, Some(5))));
        store_peak(&file, 1e9, 6);
        assert_eq!(read_peak(&file), Some((2e9, Some(5))));
    }

    #[test]
    fn the_cache_file_keeps_when_its_peak_was_measured() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sub").join("peak.txt");
        store_peak(&file, 1.48e11, 1_796_630_400);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "148000000000\n1796630400\n");
        assert_eq!(read_peak(&file), Some((1.48e11, Some(1_796_630_400))));
        // A higher peak replaces it, with its own time; a lower one leaves both.
        store_peak(&file, 2e11, 1_796_660_000);
        store_peak(&file, 1.9e11, 1_796_670_000);
        assert_eq!(read_peak(&file), Some((2e11, Some(1_796_660_000))));
        // An older build's one-line file: the peak, no time; a damaged time is no time.
        std::fs::write(&file, "148000000000\n").unwrap();
        assert_eq!(read_peak(&file), Some((1.48e11, None)));
        std::fs::write(&file, "1.5e11\nyesterday\n").unwrap();
        assert_eq!(read_peak(&file), Some((1.5e11, None)));
        // What a run logs of a cached peak: when it was measured.
        let dev = Default::default();
        let cache = dir.path().join("cache");
        let name = peak_cache_name::<burn::backend::Flex>(&dev, Gemms::Backend(DType::F32));
        std::fs::create_dir_all(&cache).unwrap();
        std::fs::write(cache.join(&name), "1.5e11\n1796660000\n").unwrap();
        let peak = resolve_peak::<burn::backend::Flex>(&dev, None, Gemms::Backend(DType::F32), None, Some(&cache));
        assert_eq!((peak.flops, peak.measured_at, peak.remeasurable), (1.5e11, Some(1_796_660_000), true));
        assert!(peak.source.starts_with("measured 2026-12-07 16:13 UTC: best F32 GEMM on "), "{}", peak.source);
        std::fs::write(cache.join(&name), "1.5e11\n").unwrap();
        let peak = resolve_peak::<burn::backend::Flex>(&dev, None, Gemms::Backend(DType::F32), None, Some(&cache));
        assert_eq!((peak.flops, peak.measured_at), (1.5e11, None));
        assert!(peak.source.starts_with("measured earlier (when not recorded): "), "{}", peak.source);
        // Given peaks are not measured again.
        let given = resolve_peak::<burn::backend::Flex>(&dev, None, Gemms::Backend(DType::F32), Some(2.0), None);
        assert_eq!((given.flops, given.remeasurable), (2e12, false));
        assert!(!table_peak("NVIDIA H100 PCIe", DType::BF16).unwrap().remeasurable);
    }

    #[test]
    fn utc_minutes_of_known_times() {
        assert_eq!(utc_minute(0), "1970-01-01 00:00");
        assert_eq!(utc_minute(59), "1970-01-01 00:00");
        assert_eq!(utc_minute(1_796_630_400), "2026-12-07 08:00");
        assert_eq!(utc_minute(1_796_630_400 + 8 * 3600 + 30 * 60 + 59), "2026-12-07 16:30");
        // Leap days, a century that is not a leap year and one that is.
        assert_eq!(utc_minute(951_782_400), "2000-02-29 00:00");
        assert_eq!(utc_minute(1_709_164_799), "2024-02-28 23:59");
        assert_eq!(utc_minute(1_709_164_800), "2024-02-29 00:00");
        assert_eq!(utc_minute(4_107_542_400), "2100-03-01 00:00");
        assert_eq!(utc_minute(1_735_689_599), "2024-12-31 23:59");
    }

    #[test]
    fn mfu_is_never_above_one() {
        let peak = Peak::given(1e11, "--peak-tflops".into());
        assert_eq!(utilisation(5e10, &peak), 0.5);
        assert_eq!(utilisation(1.3e11, &peak), 1.0);
        assert_eq!(mfu(1e6, 2e5, &peak), 1.0);
        assert_eq!(mfu(1e6, 5e4, &peak), 0.5);
    }

    #[test]
    fn the_peak_cache_tells_cpus_of_one_name_apart_by_their_flags() {
        let zen3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n";
        let zen4 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n";
        let name = |info| cache_name("flex-F32", info, 2);
        assert_ne!(name(zen3), name(zen4));
        assert_eq!(name(zen3), name(zen3));
        assert!(name(zen3).starts_with("peak-flex-F32-AMD_EPYC-") && name(zen3).ends_with("-2.txt"), "{}", name(zen3));
        assert_ne!(cache_name("flex-F32", zen3, 1), name(zen3));
        // No /proc/cpuinfo (another OS): still a name.
        assert_eq!(cache_name("flex-F32", "", 2), format!("peak-flex-F32--{:08x}-2.txt", fnv1a(b"")));
    }

    #[test]
    fn mfu_on_a_known_config_by_hand() {
        // configs/nano.toml with the char vocabulary.
        let text = include_str!("../../../configs/nano.toml");
        let mut c = crate::TrainConfig::from_toml(text, std::path::Path::new("nano.toml")).unwrap();
        c.model.vocab_size = 65;
        let m: &ModelConfig = &c.model;
        // N: 4 layers × (4 attention projections 128×128 + 3 MLP projections 128×344) + head 128×65.
        let n = 4 * (4 * 128 * 128 + 3 * 128 * 344) + 128 * 65;
        assert_eq!(m.matmul_params(), n as u64);
        let per_token = 6.0 * n as f64 + 12.0 * 4.0 * 64.0 * 128.0;
        assert_eq!(m.train_flops_per_token(64), per_token);
        let peak = Peak::given(315e9, "test".into());
        let got = mfu(m.train_flops_per_token(64), 5000.0, &peak);
        assert!((got - per_token * 5000.0 / 315e9).abs() < 1e-12);
        assert!((got - 0.08232).abs() < 1e-4, "{got}"); // 5,186,304 · 5000 / 315e9
    }

    #[test]
    fn a_lora_run_counts_no_weight_gradients_of_its_frozen_base() {
        // The LoRA config's shapes and adapters (its file needs `init_from` for a run).
        let text = include_str!("../../../configs/smollm2-135m-full.toml");
        let mut c = crate::TrainConfig::from_toml(text, std::path::Path::new("smollm2-135m-full.toml")).unwrap();
        let lora: toml::Table = include_str!("../../../configs/smollm2-135m-lora.toml").parse().unwrap();
        c.lora = Some(lora["lora"].clone().try_into().unwrap());
        // SmolLM2-135M: 30 layers of q/o 576×576, k/v 576×192, gate/up/down 576×1536; the tied head 49,152×576.
        let n = 30.0 * (2.0 * 576.0 * 576.0 + 2.0 * 576.0 * 192.0 + 3.0 * 576.0 * 1536.0) + 49152.0 * 576.0;
        assert_eq!(c.model.matmul_params() as f64, n);
        // Rank 8 on all seven: r·(in + out) each.
        let adapters = 30.0 * 8.0 * (2.0 * 1152.0 + 2.0 * 768.0 + 3.0 * 2112.0);
        let attention = 12.0 * 30.0 * 512.0 * 576.0;
        assert_eq!(c.train_flops_per_token(), 4.0 * n + 6.0 * adapters + attention);
        // The full fine-tune of the same shapes is the usual 6N.
        let full = crate::TrainConfig { lora: None, ..c.clone() };
        assert_eq!(full.train_flops_per_token(), 6.0 * n + attention);
    }

    #[test]
    fn a_cpu_bf16_peak_is_measured_and_cached_apart_from_f32() {
        let info = "model name\t: AMD EPYC\nflags\t\t: avx512f avx512_bf16\n";
        let f32 = cache_name(&format!("flex-{}", Gemms::Backend(DType::F32).label()), info, 2);
        let bf16 = cache_name(&format!("flex-{}", Gemms::CpuBf16(Bf16Kernel::Avx512).label()), info, 2);
        let amx = cache_name(&format!("flex-{}", Gemms::CpuBf16(Bf16Kernel::Amx).label()), info, 2);
        assert_ne!(bf16, amx, "the two kernels' peaks are cached apart");
        let backend_bf16 = cache_name(&format!("flex-{}", Gemms::Backend(DType::BF16).label()), info, 2);
        assert!(f32 != bf16 && bf16 != backend_bf16, "{f32} {bf16} {backend_bf16}");
        assert_eq!(Gemms::CpuBf16(Bf16Kernel::Avx512).dtype(), DType::BF16);
        let cpu = ember_kernels::Cpu::detect();
        match cpu.bf16.and_then(|kernel| measure_cpu_bf16_gemm(kernel, &[64, 96], 1)) {
            // Where the CPU has the kernel: a positive rate for each size, timed on a real product.
            Some(rates) => {
                assert_eq!(rates.iter().map(|r| r.n).collect::<Vec<_>>(), [64, 96]);
                assert!(rates.iter().all(|r| r.flops.is_finite() && r.flops > 0.0 && r.ms > 0.0));
            }
            None => assert!(cpu.bf16.is_none(), "the CPU's own kernel is measured"),
        }
    }

    #[test]
    fn table_finds_the_gpu() {
        assert_eq!(table_peak("NVIDIA H200", DType::BF16).unwrap().flops, 989e12);
        assert_eq!(table_peak("NVIDIA H100 80GB HBM3", DType::BF16).unwrap().flops, 989e12);
        assert_eq!(table_peak("NVIDIA H100 PCIe", DType::BF16).unwrap().flops, 756e12);
        assert_eq!(table_peak("NVIDIA A100-SXM4-80GB", DType::F32).unwrap().flops, 19.5e12);
        assert!(table_peak("llvmpipe (LLVM 15)", DType::F32).is_none());
    }

    #[test]
    fn measured_peak_is_a_positive_rate() {
        let dev = Default::default();
        let rates = measure_gemm::<burn::backend::Flex>(&dev, DType::F32, &[64, 128], 2);
        assert_eq!(rates.len(), 2);
        assert!(rates.iter().all(|r| r.flops > 1e6 && r.ms > 0.0));
    }
}
