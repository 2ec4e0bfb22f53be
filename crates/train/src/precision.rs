//! Mixed precision: which GEMM dtype a device can run, and dynamic loss scaling for f16.
//!
//! Master weights and AdamW moments are always f32; the model casts them to the compute dtype at
//! each GEMM (`ember_model::linear`), and keeps norms, softmax and the loss in f32.

use burn::tensor::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::config::{Precision, TrainConfig};
use crate::flops::Gemms;
use ember_model::ops::{EmberBackend, TrainBackend};

/// The GEMM dtype for `precision` on `device`, and a note when the device forced another choice.
pub fn compute_dtype<B: EmberBackend>(device: &Device<B>, precision: Precision) -> (DType, Option<String>) {
    let supports = |d: DType| B::supports_dtype(device, d);
    let name = B::name(device);
    match precision {
        Precision::F32 => (DType::F32, None),
        // The CPU's bf16 dot products: the linear layers' large GEMMs take bf16 operands, the rest
        // stays f32 (experiments/cpu-speed.md).
        Precision::Bf16 if !B::native_low_precision() && B::cpu_bf16_gemms() && !forced_low_precision() => (
            DType::F32,
            Some(format!(
                "{name} runs `bf16` as bf16 operands with f32 sums in the large GEMMs of the linear \
                 layers and the LM head ({}) and in the attention's products (sequences over 256 \
                 positions); activations, norms, softmax, loss and master weights stay f32",
                ember_model::ops::bf16_gemm::kernel().map_or("AVX512_BF16", |k| k.name())
            )),
        ),
        // Measured: bf16 through f32 conversions runs the nano step ~6x slower than f32 on the CPU
        // (experiments/mixed-precision-and-loss.md); it must never be a trap.
        p if !B::native_low_precision() && !forced_low_precision() => (
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
    }
}

/// `EMBER_CPU_LOW_PRECISION=1`: compute bf16/f16 where it is emulated anyway (slower), to test the
/// mixed-precision path on the CPU.
fn forced_low_precision() -> bool {
    std::env::var("EMBER_CPU_LOW_PRECISION").is_ok_and(|v| v == "1")
}

/// The CPU's bf16 GEMMs, switched on for one run (`--precision bf16` on a CPU with AVX512_BF16) and
/// off again when the run ends. The switch is process-wide: one such run at a time.
#[must_use = "the switch goes off when this is dropped"]
pub(crate) struct CpuBf16Gemms {
    on: bool,
}

impl CpuBf16Gemms {
    /// The GEMMs a run's MFU is measured against: the bf16 kernel's while it is on.
    pub(crate) fn peak_gemms(&self, dtype: DType) -> Gemms {
        if self.on {
            Gemms::CpuBf16
        } else {
            Gemms::Backend(dtype)
        }
    }
}

impl Drop for CpuBf16Gemms {
    fn drop(&mut self) {
        if self.on {
            ember_model::ops::kernels::set_bf16_gemms(false);
        }
    }
}

/// The GEMM dtype for the config's precision on this device, said out loud when it differs, and the
/// CPU's bf16 GEMMs for the run's lifetime where they apply.
pub(crate) fn resolve_dtype<B: TrainBackend>(device: &Device<B>, config: &TrainConfig) -> (DType, CpuBf16Gemms) {
    let (dtype, note) = compute_dtype::<B>(device, config.train.precision);
    if let Some(note) = note {
        tracing::warn!("{note}");
    }
    let cpu_bf16 = dtype == DType::F32 && config.train.precision == Precision::Bf16 && B::cpu_bf16_gemms();
    let on = cpu_bf16 && ember_model::ops::kernels::set_bf16_gemms(true);
    (dtype, CpuBf16Gemms { on })
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
    pub fn update(&mut self, finite: bool) -> bool {
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
        // Flex and NdArray compute bf16/f16 GEMMs through f32 conversions, slower than f32: f32.
        for (d, note) in [
            compute_dtype::<burn::backend::Flex>(&Default::default(), Precision::F16),
            compute_dtype::<burn::backend::NdArray>(&Default::default(), Precision::Bf16),
        ] {
            assert_eq!(d, DType::F32);
            assert!(note.unwrap().contains("slower than f32: training in f32"));
        }
        // bf16 on Flex: bf16 GEMM operands where the CPU has AVX512_BF16, f32 otherwise; f32 tensors
        // either way.
        let (d, note) = compute_dtype::<burn::backend::Flex>(&Default::default(), Precision::Bf16);
        assert_eq!(d, DType::F32);
        let want =
            if burn::backend::Flex::cpu_bf16_gemms() { "bf16 operands with f32 sums" } else { "training in f32" };
        assert!(note.unwrap().contains(want));
        assert_eq!(compute_dtype::<burn::backend::Flex>(&Default::default(), Precision::F32), (DType::F32, None));
    }
}
