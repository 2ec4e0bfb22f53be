//! Linear layer in Burn's layout: `weight` is `[in, out]` and `y = x·W + b`. Hugging Face stores the
//! transpose, `[out, in]`; conversions transpose at the checkpoint boundary, never here.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, Tensor};

use crate::init::{const_param, Init};

#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[in, out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Linear<B> {
    pub fn new(init: &mut Init, d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        Self {
            weight: init.normal_param([d_in, d_out], std, device),
            bias: bias.then(|| const_param([d_out], 0.0, device)),
        }
    }

    pub fn d_out(&self) -> usize {
        self.weight.dims()[1]
    }

    /// # Shapes
    /// - x: `[N, in]` -> `[N, out]`
    ///
    /// Callers fold leading dimensions into N: a 2-D GEMM avoids the batched-matmul broadcast and the
    /// per-batch reduction of the weight gradient.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        burn::tensor::module::linear(x, self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }
}
