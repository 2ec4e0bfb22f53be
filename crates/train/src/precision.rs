//! Mixed precision and how a run computes: the [`Compute`] a run's precision resolves to on its
//! device, and dynamic loss scaling for f16.
//!
//! Master weights and AdamW moments are always f32; the model casts them to the compute dtype at
//! each GEMM (`ember_model::linear`), and keeps norms, softmax and the loss in f32. On the CPU,
//! `bf16` means bf16 operands (f32 sums) in the CPU kernels' large products under f32 tensors.

use burn::tensor::{DType, Device};
use ember_kernels::{Bf16Kernel, Bf16Products, Compute, EmberBackend, Path};
use serde::{Deserialize, Serialize};

use crate::config::{Precision, TrainConfig};
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
/// forced another choice.
pub(crate) fn resolve_compute<B: EmberBackend>(
    device: &Device<B>,
    precision: Precision,
    request: ComputeRequest,
) -> (Compute, Option<String>) {
    let supports = |d: DType| B::supports_dtype(device, d);
    let name = B::name(device);
    let base = request.base;
    let emulated = !B::native_low_precision() && !request.emulate_low_precision;
    let cpu_kernel = base.cpu.bf16.filter(|_| B::cpu_bf16_gemms() && base.path == Path::Kernels);
    let (dtype, note) = match precision {
        Precision::F32 => (DType::F32, None),
        // The CPU's bf16 dot products: the large products of the linear layers, the LM head and,
        // where the vector kernel outruns f32, the attention take bf16 operands, the rest stays f32
        // (experiments/cpu-speed.md).
        Precision::Bf16 if emulated && cpu_kernel.is_some() => {
            let kernel = cpu_kernel.map_or("AVX512_BF16", |k| k.name());
            let attention = Bf16Kernel::vector_outruns_f32();
            let where_ = match attention {
                true => " and in the attention's products (sequences over 256 positions)",
                false => " (the attention's products stay f32: this CPU's AVX512_BF16 does not outrun its f32)",
            };
            let note = format!(
                "{name} runs `bf16` as bf16 operands with f32 sums in the large GEMMs of the linear layers and the \
                 LM head ({kernel}){where_}; activations, norms, softmax, loss and master weights stay f32"
            );
            let bf16 = Bf16Products { attention, ..Bf16Products::ALL };
            return (base.with_dtype(DType::F32).with_bf16(bf16), Some(note));
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

/// How a run of `config` computes on `device`, the note logged.
pub(crate) fn run_compute<B: EmberBackend>(
    device: &Device<B>,
    config: &TrainConfig,
    request: ComputeRequest,
) -> Compute {
    let (compute, note) = resolve_compute::<B>(device, config.train.precision, request);
    if let Some(note) = note {
        tracing::warn!("{note}");
    }
    // A run's losses (validation and reference passes included) come from exact products: a
    // quantized base's 8-bit activations are for inference.
    compute.with_int8_inputs(false)
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

    #[test]
    fn scaler_backs_off_and_grows() {
        let mut s = LossScaler { growth_interval: 3, ..Default::default() };
        assert!(!s.update(false));
        assert_eq!(s.scale, 32_768.0);
        assert!(s.update(true) && s.update(true) && s.update(true));
        assert_eq!(s.scale, 65_536.0);
        assert_eq!(s.good_steps, 0);
    }

    #[test]
    fn cpu_backends_train_low_precision_in_f32_and_say_so() {
        let resolve =
            |precision, request| resolve_compute::<burn::backend::Flex>(&Default::default(), precision, request);
        let plain = ComputeRequest::default();
        // Flex and NdArray compute bf16/f16 GEMMs through f32 conversions, slower than f32: f32.
        for (c, note) in [
            resolve(Precision::F16, plain),
            resolve_compute::<burn::backend::NdArray>(&Default::default(), Precision::Bf16, plain),
        ] {
            assert_eq!((c.dtype, c.bf16), (DType::F32, Bf16Products::NONE));
            assert!(note.unwrap().contains("slower than f32: training in f32"));
        }
        // bf16 on Flex: bf16 products where the CPU has a bf16 kernel, f32 otherwise; f32 tensors
        // either way.
        let (c, note) = resolve(Precision::Bf16, plain);
        assert_eq!(c.dtype, DType::F32);
        let kernel = ember_kernels::Cpu::detect().bf16;
        assert_eq!(c.cpu_bf16(), kernel.is_some());
        assert_eq!(peak_gemms(&c), kernel.map_or(Gemms::Backend(DType::F32), Gemms::CpuBf16));
        let want = if kernel.is_some() { "bf16 operands with f32 sums" } else { "training in f32" };
        let note = note.unwrap();
        assert!(note.contains(want));
        // The attention's products in bf16 only where the vector kernel outruns f32, and said so.
        let attention = kernel.is_some() && Bf16Kernel::vector_outruns_f32();
        assert_eq!(c.bf16.attention, attention);
        assert_eq!(note.contains("attention's products stay f32"), kernel.is_some() && !attention);
        let (c, note) = resolve(Precision::F32, plain);
        assert_eq!((c.dtype, c.cpu_bf16(), note), (DType::F32, false, None));
        // The reference path has no bf16 kernel; emulation asks for bf16 tensors.
        let reference = ComputeRequest { base: Compute::default().with_path(Path::Reference), ..plain };
        assert!(!resolve(Precision::Bf16, reference).0.cpu_bf16());
        let emulated = ComputeRequest { emulate_low_precision: true, ..plain };
        assert_eq!(resolve(Precision::Bf16, emulated).0.dtype, DType::BF16);
    }
}
