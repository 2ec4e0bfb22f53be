//! Parameter initialisation on the host from a seeded generator, so that a seed gives the same weights
//! on every backend (CPU, WGPU, CUDA) and every run.

use burn::module::Param;
use burn::tensor::{backend::Backend, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Seeded source of initial weights. ChaCha8's output is fixed by its specification, so a seed keeps
/// meaning the same weights across `rand` releases.
pub(crate) struct Init {
    /// `None`: every weight is zero (a model about to be overwritten by loaded weights).
    rng: Option<ChaCha8Rng>,
}

impl Init {
    pub(crate) fn new(seed: u64) -> Self {
        Self { rng: Some(ChaCha8Rng::seed_from_u64(seed)) }
    }

    /// Zeros instead of random draws: cheap for a model whose weights are loaded next.
    pub(crate) fn zeros() -> Self {
        Self { rng: None }
    }

    /// `n` draws from normal(0, std), by Box-Muller in f64.
    pub(crate) fn normal(&mut self, n: usize, std: f64) -> Vec<f32> {
        let Some(rng) = self.rng.as_mut() else { return vec![0.0; n] };
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            // u1 in (0, 1] keeps ln(u1) finite.
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
            out.push((r * c) as f32);
            out.push((r * s) as f32);
        }
        out.truncate(n);
        out
    }

    /// A trainable parameter drawn from uniform(-bound, bound).
    pub(crate) fn uniform_param<B: Backend, const D: usize>(
        &mut self,
        shape: [usize; D],
        bound: f64,
        device: &B::Device,
    ) -> Param<Tensor<B, D>> {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = match self.rng.as_mut() {
            Some(rng) => (0..n).map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32).collect(),
            None => return lazy_zeros(shape, device),
        };
        Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// A trainable parameter drawn from normal(0, std).
    pub(crate) fn normal_param<B: Backend, const D: usize>(
        &mut self,
        shape: [usize; D],
        std: f64,
        device: &B::Device,
    ) -> Param<Tensor<B, D>> {
        if self.rng.is_none() {
            return lazy_zeros(shape, device);
        }
        let values = self.normal(shape.iter().product(), std);
        Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device))
    }
}

/// A trainable parameter of zeros that holds no memory until it is read: a model about to be
/// overwritten by loaded weights then never holds its zeros and the weights at once
/// ([`crate::weights::assign`] replaces it without reading it).
fn lazy_zeros<B: Backend, const D: usize>(shape: [usize; D], device: &B::Device) -> Param<Tensor<B, D>> {
    lazy_zeros_as(burn::module::ParamId::new(), shape, device.clone(), None)
}

/// [`lazy_zeros`] with parameter id `id`, in `dtype` (the device's default where `None`).
pub(crate) fn lazy_zeros_as<B: Backend, const D: usize>(
    id: burn::module::ParamId,
    shape: [usize; D],
    device: B::Device,
    dtype: Option<burn::tensor::DType>,
) -> Param<Tensor<B, D>> {
    let init = move |device: &B::Device, require_grad: bool| {
        let zeros = Tensor::<B, D>::zeros(shape, device);
        let zeros = match dtype {
            Some(dtype) => crate::to_dtype(zeros, dtype),
            None => zeros,
        };
        if require_grad {
            zeros.require_grad()
        } else {
            zeros
        }
    };
    Param::uninitialized(id, init, device, true, shape.into())
}

/// A trainable parameter filled with `value` (RMSNorm gains: 1, biases: 0).
pub(crate) fn const_param<B: Backend, const D: usize>(
    shape: [usize; D],
    value: f32,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    Param::from_tensor(Tensor::full(shape, value, device))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_the_requested_moments_and_is_seeded() {
        let x = Init::new(7).normal(200_001, 0.02);
        assert_eq!(x.len(), 200_001);
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
        assert_eq!(Init::new(7).normal(10, 1.0), Init::new(7).normal(10, 1.0));
        assert_ne!(Init::new(7).normal(10, 1.0), Init::new(8).normal(10, 1.0));
    }
}
