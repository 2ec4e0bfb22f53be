//! Root-mean-square layer norm (Zhang and Sennrich, 2019): `x / sqrt(mean(x²) + eps) · g`, no mean
//! subtraction and no bias. The reduction runs in f32 whatever the input dtype, as Hugging Face's
//! `LlamaRMSNorm` does, because a bf16 sum of D squares loses digits as D grows.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, Tensor};

use crate::config::RmsNormConfig;
use crate::init::const_param;
use ember_kernels::rms_norm::rms_norm;
use ember_kernels::{Compute, EmberBackend};

#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Gain `[D]`, initialised to ones [HF: weight].
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl RmsNormConfig {
    /// Gains of one.
    pub(crate) fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        RmsNorm { weight: const_param([self.d_model], 1.0, device), eps: self.eps }
    }
}

impl<B: EmberBackend> RmsNorm<B> {
    /// One fused op on backends with kernels (`ember_kernels::rms_norm`), else the composition.
    ///
    /// # Shapes
    /// - x: `[..., D]` -> `[..., D]`
    pub(crate) fn forward<const N: usize>(&self, x: Tensor<B, N>, cx: Compute) -> Tensor<B, N> {
        let dims = x.dims();
        let d = dims[N - 1];
        let rows = dims.iter().product::<usize>() / d.max(1);
        rms_norm(x.reshape([rows, d]), self.weight.val(), self.eps, cx).reshape(dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TestBackend;
    use burn::tensor::TensorData;

    #[test]
    fn matches_hand_computation() {
        let dev = Default::default();
        let norm = RmsNormConfig::new(3).with_eps(1e-5).init::<TestBackend>(&dev);
        let x = Tensor::<TestBackend, 2>::from_data([[1.0, 2.0, 3.0], [0.0, -4.0, 0.0]], &dev);
        let y = norm.forward(x, Compute::default()).into_data();
        let r1 = ((1.0f32 + 4.0 + 9.0) / 3.0 + 1e-5).sqrt();
        let r2 = (16.0f32 / 3.0 + 1e-5).sqrt();
        let want = TensorData::from([[1.0 / r1, 2.0 / r1, 3.0 / r1], [0.0, -4.0 / r2, 0.0]]);
        y.assert_approx_eq::<f32>(&want, burn::tensor::Tolerance::absolute(1e-6));
    }
}
