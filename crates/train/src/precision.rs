//! Mixed precision and how a run computes: the [`Compute`] a run's precision resolves to on its
//! device, and dynamic loss scaling for f16.
//!
//! Master weights and AdamW moments are always f32; the model casts them to the compute dtype at
//! each GEMM (`ember_model::linear`), and keeps norms, softmax and the loss in f32. On the CPU,
//! `bf16` means bf16 operands (f32 sums) in the CPU kernels' large products under f32 tensors.

use burn::tensor::{DType, Device};
use ember_kernels::calibrate::Class;
use ember_kernels::{Bf16Kernel, Bf16Products, Compute, Cpu, EmberBackend, Path};
use serde::{Deserialize, Serialize};

use crate::calibration::Measured;
use crate::collective::{Collective, DistError};
use crate::config::{NsDtype, Precision, TrainConfig};
use crate::flops::Gemms;

/// What the binary asks of a run's computation before the device and the config's precision are
/// known (it reads the flags and the environment; nothing here does).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ComputeRequest {
    /// Kernels or references, and what the CPU's kernels may use.
    pub base: Compute,
    /// Compute bf16/f16 where the device only emulates them (slower): tests the mixed-precision
    /// path on the CPU.
    pub emulate_low_precision: bool,
}

/// How a run of `precision` computes on `device` (from `request`), and a note when the device
/// forced another choice or what `bf16` runs on this CPU. `calibrate` gives this CPU's measured
/// kernels ([`crate::calibration`]); it is called only for `bf16` on a CPU with a bf16 kernel.
pub(crate) fn resolve_compute<B: EmberBackend>(
    device: &Device<B>,
    precision: Precision,
    request: ComputeRequest,
    calibrate: impl FnOnce(Cpu) -> Measured,
) -> (Compute, Option<String>) {
    let supports = |d: DType| B::supports_dtype(device, d);
    let name = B::name(device);
    let base = request.base;
    let emulated = !B::native_low_precision() && !request.emulate_low_precision;
    let cpu_kernel = cpu_bf16_kernel::<B>(base);
    let (dtype, note) = match precision {
        Precision::F32 => (DType::F32, None),
        // The CPU's bf16 dot products, class by class where this CPU measured them faster than f32
        // (experiments/cpu-speed.md): the rest stays f32, as do activations, norms and the loss.
        Precision::Bf16 if emulated && cpu_kernel.is_some() => {
            let measured = calibrate(base.cpu);
            let (compute, note) = bf16_products(base, &measured, &name);
            return (compute, Some(note));
        }
        // Measured: bf16 through f32 conversions runs the nano step ~6x slower than f32 on the CPU
        // (experiments/mixed-precision-and-loss.md); it must never be a trap.
        p if emulated => (
            DType::F32,
            Some(format!(
                "{name} computes `{p}` GEMMs through f32 conversions, slower than f32: training in f32 \
                 (f32 master weights either way; the result is what `{p}` would approximate)"
            )),
        ),
        Precision::Bf16 if supports(DType::BF16) => (DType::BF16, None),
        Precision::Bf16 if supports(DType::F16) => {
            (DType::F16, Some(format!("{name} has no bf16; training in f16 with dynamic loss scaling")))
        }
        Precision::F16 if supports(DType::F16) => (DType::F16, None),
        p => (DType::F32, Some(format!("{name} supports neither bf16 nor f16; `{p}` falls back to f32"))),
    };
    (base.with_dtype(dtype).with_bf16(Bf16Products::NONE), note)
}

/// The bf16 kernel `base` allows where `B` runs ember's CPU kernels: what the calibration chooses
/// among (none: every product f32, nothing to measure).
fn cpu_bf16_kernel<B: EmberBackend>(base: Compute) -> Option<Bf16Kernel> {
    base.cpu.bf16.filter(|_| B::cpu_bf16_gemms() && base.path == Path::Kernels)
}

/// `--precision bf16` on a CPU with bf16 kernels: each class of products on the kernel `measured`
/// chose for it (f32 where no bf16 kernel measured faster), and the note that says which and why.
fn bf16_products(base: Compute, measured: &Measured, name: &str) -> (Compute, String) {
    let c = &measured.calibration;
    let (linear, attention) = (c.choice(Class::Linear), c.choice(Class::Attention));
    // The attention's products run on the vector kernel whatever `cpu.bf16` names.
    let kernel = linear.or(attention);
    let products = Bf16Products {
        linear: linear.is_some(),
        head: linear.is_some(),
        attention: attention.is_some(),
        newton_schulz: None,
    };
    let compute = base.with_dtype(DType::F32).with_cpu(Cpu { bf16: kernel, ..base.cpu }).with_bf16(products);
    let rate = |class, k| c.rate(class, k).unwrap_or(f64::NAN);
    let mut on_bf16 = Vec::new();
    let mut on_f32 = Vec::new();
    for (class, chosen) in [(Class::Linear, linear), (Class::Attention, attention)] {
        match chosen {
            Some(k) => on_bf16.push(format!(
                "{} on {} ({:.0} GFLOP/s against f32's {:.0})",
                class.name(),
                k.name(),
                rate(class, Some(k)),
                rate(class, None)
            )),
            None => {
                let tried: Vec<String> = c
                    .rates(class)
                    .iter()
                    .filter_map(|r| r.kernel.map(|k| format!("{} {:.0}", k.name(), r.gflops)))
                    .collect();
                on_f32.push(format!(
                    "{} (f32 {:.0} GFLOP/s; {}: no faster here)",
                    class.name(),
                    rate(class, None),
                    tried.join(", ")
                ));
            }
        }
    }
    let mut note = match on_bf16.is_empty() {
        true => format!("{name} runs `bf16`'s products in f32: no bf16 kernel of this CPU outruns its f32 ones"),
        false => format!("{name} runs `bf16` as bf16 operands with f32 sums in the {}", on_bf16.join(" and the ")),
    };
    if !on_f32.is_empty() {
        note += &format!("; in f32: {}", on_f32.join("; "));
    }
    let kept = measured.file.as_ref().map_or(String::new(), |f| format!(", kept in {}", f.display()));
    note += &format!(
        "; activations, norms, softmax, loss and master weights stay f32 (kernels {}{kept}; `ember bench peak` \
         measures again)",
        measured.when()
    );
    (compute, note)
}

/// Muon's Newton-Schulz iteration in bf16 on the kernel `measured` chose for it (f32 products of
/// the bf16 values where no bf16 kernel measured faster), and the note that says which.
fn newton_schulz_kernel(compute: Compute, measured: &Measured) -> (Compute, String) {
    let c = &measured.calibration;
    let chosen = c.choice(Class::NewtonSchulz);
    let rate = |k| c.rate(Class::NewtonSchulz, k).unwrap_or(f64::NAN);
    let note = match chosen {
        Some(k) => format!(
            "Muon's Newton-Schulz iteration (bf16) on {} ({:.0} GFLOP/s against f32 products' {:.0}; kernels {})",
            k.name(),
            rate(Some(k)),
            rate(None),
            measured.when()
        ),
        None => format!(
            "Muon's Newton-Schulz iteration (bf16 values) on f32 products ({:.0} GFLOP/s; this CPU's bf16 kernels \
             no faster: {}; kernels {})",
            rate(None),
            crate::calibration::describe(c, Class::NewtonSchulz),
            measured.when()
        ),
    };
    (compute.with_bf16(Bf16Products { newton_schulz: chosen, ..compute.bf16 }), note)
}

/// How a run of `config` computes on `device`, the note logged; this CPU's kernel calibration
/// cached in `cache_dir`.
pub(crate) fn run_compute<B: EmberBackend>(
    device: &Device<B>,
    config: &TrainConfig,
    request: ComputeRequest,
    cache_dir: Option<&std::path::Path>,
) -> Compute {
    // One calibration for both choices, read or measured at most once.
    let measured = std::cell::OnceCell::new();
    let calibrate = |cpu| measured.get_or_init(|| crate::calibration::for_cpu(cpu, cache_dir)).clone();
    let (compute, note) = resolve_compute::<B>(device, config.train.precision, request, calibrate);
    if let Some(note) = note {
        tracing::warn!("{note}");
    }
    let muon_bf16 = config.muon.as_ref().is_some_and(|m| m.ns_dtype == NsDtype::Bf16);
    let compute = match cpu_bf16_kernel::<B>(request.base).filter(|_| muon_bf16) {
        Some(_) => {
            let (compute, note) = newton_schulz_kernel(compute, &calibrate(request.base.cpu));
            tracing::info!("{note}");
            compute
        }
        None => compute,
    };
    // A run's losses (validation and reference passes included) come from exact products: a
    // quantized base's 8-bit activations are for inference.
    compute.with_int8_inputs(false)
}

/// Every rank runs the bf16 kernels rank 0 chose: each rank reads or measures this CPU's
/// calibration itself, measuring while the others work, and could choose otherwise; the ranks of a
/// run must multiply alike.
pub(crate) fn agree_with_rank0(compute: Compute, c: &dyn Collective) -> Result<Compute, DistError> {
    if c.world() == 1 {
        return Ok(compute);
    }
    let mut buf = [if c.rank() == 0 { f64::from(agree_with_rank0_code(&compute)) } else { 0.0 }];
    c.all_reduce_f64(&mut buf, "the bf16 kernels")?;
    let code = buf[0] as u8;
    let bit = |i: u8| code >> i & 1 == 1;
    // A rank without rank 0's kernel keeps f32 products rather than fail (the same machine type is
    // what data parallelism runs on; this only guards a mixed one).
    let kernel = |bits: u8| {
        match bits & 3 {
            1 => Some(Bf16Kernel::Avx512),
            2 => Some(Bf16Kernel::Amx),
            _ => None,
        }
        .filter(|k| k.runs_here())
    };
    let bf16 = Bf16Products { linear: bit(0), head: bit(1), attention: bit(2), newton_schulz: kernel(code >> 3) };
    Ok(compute.with_cpu(Cpu { bf16: kernel(code >> 5), ..compute.cpu }).with_bf16(bf16))
}

/// [`agree_with_rank0`]'s number for a choice: the model's classes on bf16 in bits 0–2, Muon's
/// kernel in bits 3–4, the model's kernel in bits 5–6.
fn agree_with_rank0_code(compute: &Compute) -> u8 {
    let p = compute.bf16;
    let kernel = |k: Option<Bf16Kernel>| match k {
        None => 0,
        Some(Bf16Kernel::Avx512) => 1,
        Some(Bf16Kernel::Amx) => 2,
    };
    let classes = u8::from(p.linear) | u8::from(p.head) << 1 | u8::from(p.attention) << 2;
    classes | kernel(p.newton_schulz) << 3 | kernel(compute.cpu.bf16) << 5
}

/// The GEMMs a run's MFU is measured against: the CPU's bf16 kernel's where its products run on it.
pub(crate) fn peak_gemms(compute: &Compute) -> Gemms {
    match compute.bf16_kernel().filter(|_| compute.cpu_bf16()) {
        Some(kernel) => Gemms::CpuBf16(kernel),
        None => Gemms::Backend(compute.dtype),
    }
}

/// The precision a run computes in, for reports: f32 tensors with the bf16 kernel's products are a
/// bf16 run.
pub(crate) fn precision_label(compute: &Compute) -> String {
    if compute.cpu_bf16() {
        "bf16".into()
    } else {
        format!("{:?}", compute.dtype).to_lowercase()
    }
}

/// Dynamic loss scaling, with `torch.amp.GradScaler`'s defaults: the loss is multiplied by `scale`
/// before the backward pass so that small f16 gradients do not flush to zero; a step whose gradients
/// overflow is skipped and the scale halved; after `growth_interval` clean steps it doubles.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossScaler {
    pub scale: f64,
    /// Clean steps since the last change of scale.
    pub good_steps: u32,
    pub growth_interval: u32,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self { scale: 65_536.0, good_steps: 0, growth_interval: 2000 }
    }
}

impl LossScaler {
    /// Records a step whose (scaled) gradients were `finite`; returns whether to apply it.
    pub(crate) fn update(&mut self, finite: bool) -> bool {
        if !finite {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Solo;
    use ember_kernels::calibrate::{Calibration, Rate};

    #[test]
    fn scaler_backs_off_and_grows() {
        let mut s = LossScaler { growth_interval: 3, ..Default::default() };
        assert!(!s.update(false));
        assert_eq!(s.scale, 32_768.0);
        assert!(s.update(true) && s.update(true) && s.update(true));
        assert_eq!(s.scale, 65_536.0);
        assert_eq!(s.good_steps, 0);
    }

    fn measured(linear: (f64, f64), attention: (f64, f64)) -> Measured {
        let rates = |(f, b): (f64, f64)| {
            vec![Rate { kernel: None, gflops: f }, Rate { kernel: Some(Bf16Kernel::Avx512), gflops: b }]
        };
        let calibration =
            Calibration { linear: rates(linear), attention: rates(attention), newton_schulz: rates((60.0, 40.0)) };
        Measured { calibration, measured_at: 1_796_630_400, now: false, file: None }
    }

    #[test]
    fn cpu_backends_train_low_precision_in_f32_and_say_so() {
        let real = |cpu| crate::calibration::for_cpu(cpu, None);
        let resolve =
            |precision, request| resolve_compute::<burn::backend::Flex>(&Default::default(), precision, request, real);
        let plain = ComputeRequest::default();
        // Flex and NdArray compute bf16/f16 GEMMs through f32 conversions, slower than f32: f32.
        for (c, note) in [
            resolve(Precision::F16, plain),
            resolve_compute::<burn::backend::NdArray>(&Default::default(), Precision::Bf16, plain, real),
        ] {
            assert_eq!((c.dtype, c.bf16), (DType::F32, Bf16Products::NONE));
            assert!(note.unwrap().contains("slower than f32: training in f32"));
        }
        // bf16 on Flex: bf16 products where the CPU has a bf16 kernel that measures faster than
        // f32, f32 otherwise; f32 tensors either way.
        let (c, note) = resolve(Precision::Bf16, plain);
        assert_eq!(c.dtype, DType::F32);
        let kernel = Cpu::detect().bf16;
        if kernel.is_none() {
            assert!(!c.cpu_bf16() && note.unwrap().contains("training in f32"));
        } else {
            let note = note.unwrap();
            assert!(note.contains("kernels measured now"), "{note}");
            assert_eq!(note.contains("in f32: "), !(c.bf16.linear && c.bf16.attention), "{note}");
        }
        assert_eq!(
            peak_gemms(&c),
            c.bf16_kernel().filter(|_| c.cpu_bf16()).map_or(Gemms::Backend(DType::F32), Gemms::CpuBf16)
        );
        let (c, note) = resolve(Precision::F32, plain);
        assert_eq!((c.dtype, c.cpu_bf16(), note), (DType::F32, false, None));
        // The reference path has no bf16 kernel; emulation asks for bf16 tensors.
        let reference = ComputeRequest { base: Compute::default().with_path(Path::Reference), ..plain };
        assert!(!resolve(Precision::Bf16, reference).0.cpu_bf16());
        let emulated = ComputeRequest { emulate_low_precision: true, ..plain };
        assert_eq!(resolve(Precision::Bf16, emulated).0.dtype, DType::BF16);
    }

    #[test]
    fn bf16_runs_each_class_on_the_kernel_this_cpu_measured_faster() {
        // The decision alone, on every CPU: one said to have the vector kernel (nothing is
        // multiplied here; `resolve_compute` takes this branch only where the CPU has one).
        let cpu = Cpu { bf16: Some(Bf16Kernel::Avx512), ..Cpu::detect() };
        let resolve = |m: Measured| bf16_products(Compute::default().with_cpu(cpu), &m, "autodiff<flex>");
        // An Intel Xeon without AMX: AVX512_BF16 at 58 % of f32. Every product f32, said with rates.
        let (c, note) = resolve(measured((342.0, 199.0), (120.0, 80.0)));
        assert_eq!((c.dtype, c.bf16, c.cpu.bf16, c.cpu_bf16()), (DType::F32, Bf16Products::NONE, None, false));
        assert_eq!(peak_gemms(&c), Gemms::Backend(DType::F32));
        assert!(note.contains("runs `bf16`'s products in f32"), "{note}");
        assert!(
            note.contains("linear layers and LM head (f32 342 GFLOP/s; AVX512_BF16 199: no faster here)"),
            "{note}"
        );
        assert!(note.contains("kernels measured 2026-12-07 08:00 UTC"), "{note}");
        // A Zen 4/5: both classes on bf16.
        let (c, note) = resolve(measured((180.0, 330.0), (100.0, 125.0)));
        assert_eq!((c.bf16, c.cpu.bf16), (Bf16Products::ALL, Some(Bf16Kernel::Avx512)));
        assert_eq!(peak_gemms(&c), Gemms::CpuBf16(Bf16Kernel::Avx512));
        assert!(!note.contains("in f32:"), "{note}");
        assert!(note.contains("linear layers and LM head on AVX512_BF16 (330 GFLOP/s against f32's 180)"), "{note}");
        // The linear layers only: the attention stays f32 and the note says why.
        let (c, note) = resolve(measured((180.0, 330.0), (100.0, 90.0)));
        let linear = Bf16Products { attention: false, ..Bf16Products::ALL };
        assert_eq!((c.bf16, c.cpu.bf16), (linear, Some(Bf16Kernel::Avx512)));
        assert!(note.contains("in f32: attention (f32 100 GFLOP/s; AVX512_BF16 90: no faster here)"), "{note}");
        // The attention only: the linear layers' products see no bf16 kernel.
        let (c, _) = resolve(measured((180.0, 150.0), (100.0, 125.0)));
        assert_eq!(c.bf16, Bf16Products { attention: true, ..Bf16Products::NONE });
        assert!(c.cpu_bf16());
    }

    /// Rank 1 of 2, rank 0 sending `rank0` to every sum; the rest is [`Solo`]'s.
    struct SecondRank {
        rank0: Compute,
    }

    impl Collective for SecondRank {
        fn rank(&self) -> usize {
            1
        }
        fn world(&self) -> usize {
            2
        }
        fn local_rank(&self) -> usize {
            1
        }
        fn local_world(&self) -> usize {
            2
        }
        fn engine(&self) -> String {
            "rank 1 of a stand-in pair".into()
        }
        fn set_timeout(&self, _: std::time::Duration) {}
        fn arrive(&self, _: u64, _: &str) -> Result<(), DistError> {
            Ok(())
        }
        fn all_reduce_f32(&self, buf: &mut [f32], what: &str) -> Result<(), DistError> {
            Solo.all_reduce_f32(buf, what)
        }
        fn all_reduce_f32_into(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
            Solo.all_reduce_f32_into(send, recv, what)
        }
        /// Rank 0's value of [`agree_with_rank0`] added, as rank 0 itself computes it.
        fn all_reduce_f64(&self, buf: &mut [f64], what: &str) -> Result<(), DistError> {
            assert_eq!(what, "the bf16 kernels");
            buf[0] += f64::from(agree_with_rank0_code(&self.rank0));
            Ok(())
        }
        fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
            Solo.reduce_scatter_f32(send, recv, what)
        }
        fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
            Solo.all_gather_f32(send, recv, what)
        }
        fn all_gather_bytes(&self, send: &[u8], what: &str) -> Result<Vec<Vec<u8>>, DistError> {
            Solo.all_gather_bytes(send, what)
        }
        fn gather_f32(&self, send: &[f32], what: &str) -> Result<Option<Vec<f32>>, DistError> {
            Solo.gather_f32(send, what)
        }
        fn all_reduce_baseline(&self, send: &[f32], recv: &mut [f32]) {
            Solo.all_reduce_baseline(send, recv)
        }
        fn abort(&self, code: i32) -> ! {
            panic!("abort({code})")
        }
    }

    #[test]
    fn every_rank_runs_the_kernels_rank_0_chose() {
        let mine = Compute::default().with_bf16(Bf16Products::NONE);
        assert_eq!(agree_with_rank0(mine, &Solo).unwrap(), mine, "one process keeps its own choice");
        let kernel = Bf16Kernel::reachable().into_iter().next();
        let attention = Bf16Products { attention: true, ..Bf16Products::NONE };
        let newton_schulz = Bf16Products { newton_schulz: kernel, ..Bf16Products::NONE };
        for products in [Bf16Products::ALL, attention, newton_schulz, Bf16Products::NONE] {
            let rank0 = Compute::default().with_cpu(Cpu { bf16: kernel, ..Cpu::detect() }).with_bf16(products);
            let agreed = agree_with_rank0(mine, &SecondRank { rank0 }).unwrap();
            assert_eq!((agreed.bf16, agreed.cpu.bf16), (products, kernel));
        }
    }

    #[test]
    fn muon_runs_its_iteration_on_the_kernel_this_cpu_measured_faster() {
        let base = Compute::default().with_bf16(Bf16Products { attention: true, ..Bf16Products::NONE });
        // The vector kernel at 40 GFLOP/s against f32 products' 60: f32 products of the bf16 values.
        let (c, note) = newton_schulz_kernel(base, &measured((1.0, 1.0), (1.0, 1.0)));
        assert_eq!(c.bf16, base.bf16);
        assert!(note.contains("on f32 products (60 GFLOP/s"), "{note}");
        let mut faster = measured((1.0, 1.0), (1.0, 1.0));
        faster.calibration.newton_schulz[1].gflops = 90.0;
        let (c, note) = newton_schulz_kernel(base, &faster);
        assert_eq!(c.bf16, Bf16Products { newton_schulz: Some(Bf16Kernel::Avx512), ..base.bf16 });
        assert_eq!(c.cpu, base.cpu, "the model's kernel is its own");
        assert!(note.contains("on AVX512_BF16 (90 GFLOP/s against f32 products' 60"), "{note}");
    }
}
