//! The norms over the residual stream and over heads: RMSNorm (Zhang and Sennrich, 2019) `x /
//! sqrt(mean(x²) + eps) · g`, Gemma's RMSNorm whose gain is stored as `g − 1`, and LayerNorm (Ba et
//! al., 2016) `(x − mean(x)) / sqrt(var(x) + eps) · g + b`. The reductions run in f32 whatever the
//! input dtype, as Hugging Face's norms do, because a bf16 sum of D squares loses digits as D grows.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, Tensor};

use ember_kernels::layer_norm::layer_norm;
use ember_kernels::rms_norm::rms_norm;
use ember_kernels::{Compute, EmberBackend};

use crate::init::const_param;
use crate::kinds::{ConfigError, NormKind};

/// What a [`Norm`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NormConfig {
    /// Channels normalised together (`d_model`, or `head_dim` for a per-head norm).
    pub d_model: usize,
    pub eps: f64,
    pub kind: NormKind,
    /// A LayerNorm's bias.
    pub bias: bool,
}

impl NormConfig {
    /// An RMSNorm over `d_model` channels with eps 1e-5 (Llama's; Qwen2 uses 1e-6).
    #[cfg(test)]
    pub(crate) fn new(d_model: usize) -> Self {
        Self { d_model, eps: 1e-5, kind: NormKind::RmsNorm, bias: false }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.d_model == 0 {
            return Err(ConfigError::NotPositive { name: "d_model", value: 0.0 });
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return Err(ConfigError::NotPositive { name: "norm_eps", value: self.eps });
        }
        Ok(())
    }

    /// Its parameters: the gain, and a LayerNorm's bias.
    pub(crate) fn params(&self) -> u64 {
        self.d_model as u64 * if self.bias { 2 } else { 1 }
    }

    /// The f32 values autodiff keeps per token: the output, `D`.
    pub(crate) fn activations(&self) -> u64 {
        self.d_model as u64
    }

    /// A norm of gain one (Gemma's stored weight zero) and bias zero.
    pub(crate) fn init<B: Backend>(&self, device: &B::Device) -> Norm<B> {
        let stored_one = if self.kind == NormKind::RmsNormPlusOne { 0.0 } else { 1.0 };
        Norm {
            weight: const_param([self.d_model], stored_one, device),
            bias: self.bias.then(|| const_param([self.d_model], 0.0, device)),
            kind: self.kind,
            eps: self.eps,
        }
    }
}

#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    /// The stored gain `[D]` [HF: weight]: `g`, or `g − 1` for Gemma's RMSNorm.
    pub weight: Param<Tensor<B, 1>>,
    /// `[D]`, a LayerNorm's [HF: bias].
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub kind: NormKind,
    #[module(skip)]
    pub eps: f64,
}

impl<B: Backend> Norm<B> {
    /// The gain the norm multiplies by: the stored weight, plus one for Gemma's RMSNorm.
    ///
    /// # Shapes
    /// - `[D]`
    pub(crate) fn gain(&self) -> Tensor<B, 1> {
        match self.kind {
            NormKind::RmsNormPlusOne => self.weight.val().add_scalar(1.0),
            NormKind::RmsNorm | NormKind::LayerNorm => self.weight.val(),
        }
    }
}

impl<B: EmberBackend> Norm<B> {
    /// One fused op on backends with kernels, else the composition.
    ///
    /// # Shapes
    /// - x: `[..., D]` -> `[..., D]`
    pub(crate) fn forward<const N: usize>(&self, x: Tensor<B, N>, cx: Compute) -> Tensor<B, N> {
        let dims = x.dims();
        let d = dims[N - 1];
        let rows = dims.iter().product::<usize>() / d.max(1);
        let x = x.reshape([rows, d]); // [rows, D]
        let y = match self.kind {
            NormKind::LayerNorm => layer_norm(x, self.gain(), self.bias.as_ref().map(|b| b.val()), self.eps, cx),
            NormKind::RmsNorm | NormKind::RmsNormPlusOne => rms_norm(x, self.gain(), self.eps, cx),
        };
        y.reshape(dims)
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
        let norm = NormConfig { eps: 1e-5, ..NormConfig::new(3) }.init::<TestBackend>(&dev);
        let x = Tensor::<TestBackend, 2>::from_data([[1.0, 2.0, 3.0], [0.0, -4.0, 0.0]], &dev);
        let y = norm.forward(x, Compute::default()).into_data();
        let r1 = ((1.0f32 + 4.0 + 9.0) / 3.0 + 1e-5).sqrt();
        let r2 = (16.0f32 / 3.0 + 1e-5).sqrt();
        let want = TensorData::from([[1.0 / r1, 2.0 / r1, 3.0 / r1], [0.0, -4.0 / r2, 0.0]]);
        y.assert_approx_eq::<f32>(&want, burn::tensor::Tolerance::absolute(1e-6));
    }

    #[test]
    fn every_kind_matches_its_formula() {
        let dev = Default::default();
        let x = Tensor::<TestBackend, 2>::from_data([[1.0, 2.0, 3.0, -2.0], [0.5, -4.0, 0.0, 1.5]], &dev);
        let (w, b) = ([0.5f32, -1.0, 2.0, 0.25], [0.1f32, 0.2, -0.3, 0.0]);
        let rows: Vec<Vec<f32>> = x.to_data().to_vec::<f32>().unwrap().chunks(4).map(<[f32]>::to_vec).collect();
        for kind in [NormKind::RmsNorm, NormKind::RmsNormPlusOne, NormKind::LayerNorm] {
            let config = NormConfig { d_model: 4, eps: 1e-6, kind, bias: kind == NormKind::LayerNorm };
            let mut norm = config.init::<TestBackend>(&dev);
            norm.weight = Param::from_tensor(Tensor::from_data(w, &dev));
            if let Some(bias) = norm.bias.as_mut() {
                *bias = Param::from_tensor(Tensor::from_data(b, &dev));
            }
            let got = norm.forward(x.clone(), Compute::default()).to_data().to_vec::<f32>().unwrap();
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|r| {
                    let n = r.len() as f64;
                    let mean =
                        if kind == NormKind::LayerNorm { r.iter().map(|&v| v as f64).sum::<f64>() / n } else { 0.0 };
                    let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
                    let inv = 1.0 / (var + 1e-6).sqrt();
                    r.iter().enumerate().map(move |(j, &v)| {
                        let gain = if kind == NormKind::RmsNormPlusOne { 1.0 + w[j] as f64 } else { w[j] as f64 };
                        let bias = if kind == NormKind::LayerNorm { b[j] as f64 } else { 0.0 };
                        ((v as f64 - mean) * inv * gain + bias) as f32
                    })
                })
                .collect();
            for (g, e) in got.iter().zip(&want) {
                assert!((g - e).abs() < 1e-5, "{kind:?}: {got:?} vs {want:?}");
            }
        }
    }
}
