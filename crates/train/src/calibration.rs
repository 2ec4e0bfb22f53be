//! This CPU's measured choice of kernel for each class of `--precision bf16` products
//! ([`ember_kernels::calibrate`]), measured at first use and cached per CPU model, flag set and
//! thread count in ember's cache folder, so that a run starts without measuring again and every run
//! on the machine chooses alike.

use std::path::{Path, PathBuf};

use ember_kernels::calibrate::{Calibration, Class};
use ember_kernels::{Bf16Kernel, Cpu};
use serde::{Deserialize, Serialize};

use crate::flops::{cpu_file_stem, now_unix, utc_minute};

/// Repetitions of each candidate when measuring (the best kept).
const REPS: usize = 3;

/// The cache file's version: a file of another version is measured again.
const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheFile {
    version: u32,
    /// Unix seconds.
    measured_at: u64,
    calibration: Calibration,
}

/// A calibration, when it was measured and where it is kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub calibration: Calibration,
    /// Unix seconds.
    pub measured_at: u64,
    /// Whether it was measured by this call (not read from the cache).
    pub now: bool,
    /// The cache file (none without a cache folder).
    pub file: Option<PathBuf>,
}

impl Measured {
    /// When, for the logs: `measured now` or `measured 2026-12-07 08:30 UTC`.
    pub fn when(&self) -> String {
        match self.now {
            true => "measured now".into(),
            false => format!("measured {} UTC", utc_minute(self.measured_at)),
        }
    }
}

/// The cache file of this CPU's calibration in `dir`.
pub fn cache_file(dir: &Path) -> PathBuf {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    dir.join(file_name(&cpuinfo, ember_kernels::cpu_workers()))
}

fn file_name(cpuinfo: &str, threads: usize) -> String {
    format!("{}.json", cpu_file_stem("calibration", cpuinfo, threads))
}

/// This CPU's calibration for `cpu`'s kernels: the one cached in `dir` when it covers them, else
/// measured now and cached (a cache that cannot be read is measured over, one that cannot be
/// written is a warning).
pub fn for_cpu(cpu: Cpu, dir: Option<&Path>) -> Measured {
    let file = dir.map(cache_file);
    if let Some(found) = file.as_deref().and_then(|f| read(f, cpu)) {
        return Measured { calibration: found.calibration, measured_at: found.measured_at, now: false, file };
    }
    measure(cpu, file)
}

/// Measures `cpu`'s calibration now and caches it in `file`.
pub fn measure(cpu: Cpu, file: Option<PathBuf>) -> Measured {
    let calibration = Calibration::measure(cpu, REPS);
    let measured_at = now_unix();
    if let Some(f) = &file {
        let cached = CacheFile { version: VERSION, measured_at, calibration: calibration.clone() };
        let text = serde_json::to_string_pretty(&cached).unwrap_or_default();
        if let Err(e) = ember_data::write_atomic(f, text.as_bytes()) {
            tracing::warn!("cannot cache the kernel calibration in {}: {e}", f.display());
        }
    }
    Measured { calibration, measured_at, now: true, file }
}

/// The cached calibration in `file`, when it is one of this version that covers `cpu`'s kernels
/// (a damaged or stale file is said and ignored).
fn read(file: &Path, cpu: Cpu) -> Option<CacheFile> {
    let text = std::fs::read_to_string(file).ok()?;
    match serde_json::from_str::<CacheFile>(&text) {
        Ok(c) if c.version == VERSION && c.calibration.covers(cpu) => Some(c),
        Ok(_) => {
            tracing::info!("{}: made for other kernels or by another version: measuring again", file.display());
            None
        }
        Err(e) => {
            tracing::warn!("{}: not a kernel calibration ({e}): measuring again", file.display());
            None
        }
    }
}

/// How a kernel is named in the logs.
pub fn kernel_name(kernel: Option<Bf16Kernel>) -> &'static str {
    kernel.map_or("f32", Bf16Kernel::name)
}

/// One line for each class: every candidate's rate and the choice, for logs and `ember bench peak`.
pub fn describe(calibration: &Calibration, class: Class) -> String {
    let chosen = calibration.choice(class);
    let rates: Vec<String> = calibration
        .rates(class)
        .iter()
        .map(|r| {
            let mark = if r.kernel == chosen { " (chosen)" } else { "" };
            format!("{} {:.0} GFLOP/s{mark}", kernel_name(r.kernel), r.gflops)
        })
        .collect();
    format!("{}: {}", class.name(), rates.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_kernels::calibrate::Rate;

    const ZEN4: &str = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n";

    fn sample() -> Calibration {
        let rates = |f: f64, b: f64| {
            vec![Rate { kernel: None, gflops: f }, Rate { kernel: Some(Bf16Kernel::Avx512), gflops: b }]
        };
        Calibration { linear: rates(180.0, 330.0), attention: rates(100.0, 90.0), newton_schulz: rates(50.0, 70.0) }
    }

    #[test]
    fn the_cache_file_is_named_by_cpu_and_threads() {
        assert_ne!(file_name(ZEN4, 2), file_name(ZEN4, 1));
        assert_ne!(file_name(ZEN4, 2), file_name("model name\t: AMD EPYC\nflags\t\t: fpu avx2\n", 2));
        assert!(file_name(ZEN4, 2).starts_with("calibration-AMD_EPYC-") && file_name(ZEN4, 2).ends_with("-2.json"));
    }

    #[test]
    fn a_calibration_is_measured_once_then_read_from_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = Cpu::detect();
        let first = for_cpu(cpu, Some(dir.path()));
        assert!(first.now && first.calibration.covers(cpu));
        let file = first.file.clone().unwrap();
        assert!(file.exists());
        let again = for_cpu(cpu, Some(dir.path()));
        assert!(!again.now, "read from {}", file.display());
        assert!(again.when().starts_with("measured 20"), "{}", again.when());
        assert_eq!(again.measured_at, first.measured_at);
        // The rates as written (JSON's decimal digits read back within an ulp or so).
        for class in Class::ALL {
            let (a, b) = (again.calibration.rates(class), first.calibration.rates(class));
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x.kernel, y.kernel);
                assert!((x.gflops - y.gflops).abs() <= 1e-12 * y.gflops, "{x:?} {y:?}");
            }
            assert_eq!(again.calibration.choice(class), first.calibration.choice(class));
        }
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_damaged_or_foreign_cache_is_measured_again_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = Cpu::f32_products();
        let file = cache_file(dir.path());
        for text in ["{not json", "", "{\"version\": 99, \"measured_at\": 1, \"calibration\": {\"linear\": [], \"attention\": [], \"newton_schulz\": []}}"] {
            std::fs::write(&file, text).unwrap();
            let m = for_cpu(cpu, Some(dir.path()));
            assert!(m.now, "{text:?} was read as a calibration");
            assert!(read(&file, cpu).is_some(), "{text:?} was not replaced");
        }
        // A calibration made with a bf16 kernel allowed does not cover a CPU without one (and the
        // other way round).
        let with_bf16 = CacheFile { version: VERSION, measured_at: 5, calibration: sample() };
        ember_data::write_atomic(&file, serde_json::to_string(&with_bf16).unwrap().as_bytes()).unwrap();
        assert!(read(&file, cpu).is_none());
        assert!(for_cpu(cpu, Some(dir.path())).now);
        // Without a cache folder it is measured and not kept.
        let m = for_cpu(cpu, None);
        assert!(m.now && m.file.is_none());
    }

    #[test]
    fn the_description_names_every_rate_and_the_choice() {
        let c = sample();
        assert_eq!(
            describe(&c, Class::Linear),
            "linear layers and LM head: f32 180 GFLOP/s, AVX512_BF16 330 GFLOP/s (chosen)"
        );
        assert_eq!(describe(&c, Class::Attention), "attention: f32 100 GFLOP/s (chosen), AVX512_BF16 90 GFLOP/s");
    }
}
