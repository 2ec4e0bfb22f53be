//! Linear layer in Burn's layout: `weight` is `[in, out]` and `y = x·W + b`. Hugging Face stores the
//! transpose, `[out, in]`; conversions transpose at the checkpoint boundary, never here.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::init::{const_param, Init};
use crate::lora::Lora;
use crate::to_dtype;

#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[in, out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// A low-rank adapter added to the output, when fine-tuning with LoRA.
    pub lora: Option<Lora<B>>,
}

impl<B: Backend> Linear<B> {
    pub fn new(init: &mut Init, d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        Self {
            weight: init.normal_param([d_in, d_out], std, device),
            bias: bias.then(|| const_param([d_out], 0.0, device)),
            lora: None,
        }
    }

    pub fn d_out(&self) -> usize {
        self.weight.dims()[1]
    }

    /// `x·W + b` with the GEMM in `compute` (f32, bf16 or f16) and the result in f32. With a low
    /// precision `compute`, the f32 master weight is cast on the way in; autodiff casts its gradient
    /// back to f32 on the way out.
    ///
    /// # Shapes
    /// - x: `[N, in]` -> `[N, out]`
    ///
    /// Callers fold leading dimensions into N: a 2-D GEMM avoids the batched-matmul broadcast and the
    /// per-batch reduction of the weight gradient.
    pub fn forward(&self, x: Tensor<B, 2>, compute: DType) -> Tensor<B, 2> {
        let weight = to_dtype(self.weight.val(), compute);
        let bias = self.bias.as_ref().map(|b| to_dtype(b.val(), compute));
        let y = burn::tensor::module::linear(to_dtype(x.clone(), compute), weight, bias);
        let y = to_dtype(y, DType::F32);
        match &self.lora {
            Some(lora) => y + lora.forward(x, compute),
            None => y,
        }
    }

    pub fn d_in(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Folds the adapter into the weight (`W + (α/r)·A·B`) and drops it.
    pub fn merge_lora(mut self) -> Self {
        if let Some(lora) = self.lora.take() {
            let (dtype, require_grad) = (self.weight.val().dtype(), self.weight.val().is_require_grad());
            let merged = (to_dtype(self.weight.val(), DType::F32) + lora.delta()).detach();
            let merged = to_dtype(merged, dtype);
            self.weight = self.weight.map(|_| if require_grad { merged.require_grad() } else { merged });
        }
        self
    }
}
