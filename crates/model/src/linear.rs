//! Linear layer in Burn's layout: `weight` is `[in, out]` and `y = x·W + b`. Hugging Face stores the
//! transpose, `[out, in]`; conversions transpose at the checkpoint boundary, never here.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::init::{const_param, Init};
use crate::lora::Lora;
use crate::ops::linear;
use crate::ops::EmberBackend;
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

    pub fn d_in(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Whether a low-rank adapter is attached.
    pub fn has_lora(&self) -> bool {
        self.lora.is_some()
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

impl<B: EmberBackend> Linear<B> {
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
        let y = linear_packed(x.clone(), self.weight.val(), self.bias.as_ref().map(|b| b.val()), compute);
        match &self.lora {
            Some(lora) => y + lora.forward(x, compute),
            None => y,
        }
    }
}

/// Rows up to which an inference call multiplies each packed weight on its own.
const DECODE_ROWS: usize = 16;

/// Several projections of the same input, side by side: `x·[W_1 | W_2 | …] + [b_1 | b_2 | …]` as
/// one GEMM (the concatenated weight is built per call; its gradient splits back into the parts).
/// With adapters attached, and when decoding a few rows, each projection runs on its own and the
/// outputs are concatenated.
/// Computed in `compute`, returned in f32.
///
/// # Shapes
/// - x: `[N, in]` -> `[N, Σ out_i]`
pub fn forward_packed<B: EmberBackend>(parts: &[&Linear<B>], x: Tensor<B, 2>, compute: DType) -> Tensor<B, 2> {
    let biased = parts.iter().filter(|p| p.bias.is_some()).count();
    // Decoding (a few rows, no autodiff): the weights are read where they are, one GEMM each;
    // concatenating them would copy every packed weight at every token (280 MB a token for
    // SmolLM2-135M) for a product that is bound by reading the weights anyway.
    let decoding = x.dims()[0] <= DECODE_ROWS && !B::ad_enabled(&x.device());
    if parts.len() == 1 || decoding || parts.iter().any(|p| p.has_lora()) || (biased != 0 && biased != parts.len()) {
        let outputs: Vec<_> = parts.iter().map(|p| p.forward(x.clone(), compute)).collect();
        return if outputs.len() == 1 {
            outputs.into_iter().next().expect("one output")
        } else {
            Tensor::cat(outputs, 1)
        };
    }
    let weight = Tensor::cat(parts.iter().map(|p| p.weight.val()).collect(), 1);
    let bias =
        (biased != 0).then(|| Tensor::cat(parts.iter().filter_map(|p| p.bias.as_ref().map(|b| b.val())).collect(), 0));
    linear_packed(x, weight, bias, compute)
}

/// `x·W + b` in `compute`, returned in f32.
fn linear_packed<B: EmberBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
    compute: DType,
) -> Tensor<B, 2> {
    let bias = b.map(|b| to_dtype(b, compute));
    to_dtype(linear(to_dtype(x, compute), to_dtype(w, compute), bias), DType::F32)
}
