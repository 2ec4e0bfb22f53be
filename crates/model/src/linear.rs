//! Linear layer in Burn's layout: `weight` is `[in, out]` and `y = x·W + b`. Hugging Face stores the
//! transpose, `[out, in]`; conversions transpose at the checkpoint boundary, never here.

use std::marker::PhantomData;

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::init::{const_param, Init};
use crate::lora::Lora;
use crate::to_dtype;
use ember_kernels::linear::{self, linear, LowRank};
use ember_kernels::{quant_linear, quant_linear_lora, Compute, EmberBackend, QuantWeight};

/// A weight matrix as a model holds it: a parameter, or the blocks of a GGUF file kept in their
/// storage type (frozen; products dequantize a tile at a time, [`quant_linear`]). A stored weight
/// has no tensor at all: nothing can read, train or save values it does not hold. Its parameter is
/// named by its field (`q_proj.weight`, `embed_tokens`), whichever the variant ([`crate::weights`]).
#[derive(Module, Debug)]
pub enum Weight<B: Backend> {
    Dense(Param<Tensor<B, 2>>),
    Stored(Stored<B>),
}

/// A weight kept in its block-quantized storage type: `d_out` rows of `d_in` values (a linear
/// layer's `[in, out]` transposed, as GGUF stores it; an embedding table's rows).
#[derive(Module, Debug)]
pub struct Stored<B: Backend> {
    #[module(skip)]
    pub blocks: QuantWeight,
    backend: PhantomData<B>,
}

impl<B: Backend> Weight<B> {
    /// The parameter, unless the weight is stored.
    pub(crate) fn dense(&self) -> Option<&Param<Tensor<B, 2>>> {
        match self {
            Weight::Dense(w) => Some(w),
            Weight::Stored(_) => None,
        }
    }

    /// The stored blocks, if the weight is kept so.
    pub(crate) fn stored(&self) -> Option<&QuantWeight> {
        match self {
            Weight::Stored(s) => Some(&s.blocks),
            Weight::Dense(_) => None,
        }
    }

    /// The dense weight's value (tests read built models' weights).
    #[cfg(test)]
    pub(crate) fn val(&self) -> Tensor<B, 2> {
        self.dense().expect("a dense weight").val()
    }
}

impl<B: Backend> Stored<B> {
    pub(crate) fn new(blocks: QuantWeight) -> Self {
        Self { blocks, backend: PhantomData }
    }
}

#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[in, out]`, or the stored blocks of a GGUF base (frozen, under LoRA or for inference).
    pub weight: Weight<B>,
    /// `[out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// A low-rank adapter added to the output, when fine-tuning with LoRA.
    pub lora: Option<Lora<B>>,
}

impl<B: Backend> Linear<B> {
    pub(crate) fn new(init: &mut Init, d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        Self {
            weight: Weight::Dense(init.normal_param([d_in, d_out], std, device)),
            bias: bias.then(|| const_param([d_out], 0.0, device)),
            lora: None,
        }
    }

    /// A layer of `blocks` (`d_out` rows of `d_in`), frozen, without bias or adapter.
    pub(crate) fn stored(blocks: QuantWeight) -> Self {
        Self { weight: Weight::Stored(Stored::new(blocks)), bias: None, lora: None }
    }

    pub fn d_out(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) => w.dims()[1],
            Weight::Stored(s) => s.blocks.d_out(),
        }
    }

    pub fn d_in(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) => w.dims()[0],
            Weight::Stored(s) => s.blocks.d_in(),
        }
    }

    /// Keeps the weight (`[d_in, d_out]` of this layer) in its quantized storage, frozen: the f32
    /// weight is dropped.
    pub(crate) fn with_quantized(self, blocks: QuantWeight) -> Self {
        Self { weight: Weight::Stored(Stored::new(blocks)), ..self }
    }

    /// The layer with its weight dequantized to an f32 parameter on `device` (frozen, as it was),
    /// for export.
    pub(crate) fn dequantized(self, device: &B::Device) -> Self {
        match self.weight {
            Weight::Stored(s) => {
                let weight = Param::from_tensor(s.blocks.to_tensor(device)).set_require_grad(false);
                Self { weight: Weight::Dense(weight), ..self }
            }
            Weight::Dense(_) => self,
        }
    }

    /// The weight the layer multiplies by, `[in, out]` in f32: dequantized (on `device`) where it
    /// is kept quantized, with the attached adapter's `(α/r)·A·B` added.
    pub(crate) fn effective_weight(&self, device: &B::Device) -> Tensor<B, 2> {
        let weight = match &self.weight {
            Weight::Stored(s) => s.blocks.to_tensor(device),
            Weight::Dense(w) => to_dtype(w.val(), DType::F32),
        };
        match &self.lora {
            Some(lora) => weight + lora.delta(),
            None => weight,
        }
    }

    /// Whether a low-rank adapter is attached.
    pub(crate) fn has_lora(&self) -> bool {
        self.lora.is_some()
    }

    /// Folds the adapter into the weight (`W + (α/r)·A·B`) and drops it; a quantized weight is
    /// dequantized first, on `device` (the merged weight is f32).
    pub(crate) fn merge_lora(self, device: &B::Device) -> Self {
        let Self { weight, bias, lora } = self.dequantized(device);
        let weight = match (weight, lora) {
            (Weight::Dense(weight), Some(lora)) => {
                let (dtype, require_grad) = (weight.val().dtype(), weight.val().is_require_grad());
                let merged = to_dtype((to_dtype(weight.val(), DType::F32) + lora.delta()).detach(), dtype);
                Weight::Dense(weight.map(|_| if require_grad { merged.require_grad() } else { merged }))
            }
            (weight, _) => weight,
        };
        Self { weight, bias, lora: None }
    }
}

impl<B: EmberBackend> Linear<B> {
    /// `x·W + b` (plus the adapter's `(α/r)·x·A·B` when one is attached) with the GEMMs in `cx.dtype`
    /// (f32, bf16 or f16) and the result in f32. With a low precision `cx.dtype`, the f32 master
    /// weights are cast on the way in; autodiff casts their gradients back to f32 on the way out.
    ///
    /// # Shapes
    /// - x: `[N, in]` -> `[N, out]`
    ///
    /// Callers fold leading dimensions into N: a 2-D GEMM avoids the batched-matmul broadcast and the
    /// per-batch reduction of the weight gradient.
    pub(crate) fn forward(&self, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        forward_packed(&[self], x, cx)
    }

    /// [`Self::forward`] as separate ops: the layer, then the adapter (with its dropout) added.
    fn forward_apart(&self, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        let bias = |y: Tensor<B, 2>| match &self.bias {
            Some(b) => y + to_dtype(b.val(), DType::F32).unsqueeze(),
            None => y,
        };
        let y = match (&self.weight, &self.lora) {
            // The adapter inside the quantized product (one graph node), where it has no dropout.
            (Weight::Stored(s), Some(lora)) if lora.dropout == 0.0 || !B::ad_enabled(&x.device()) => {
                let factors = (lora.lora_a.val(), lora.lora_b.val(), lora.scale as f32);
                return bias(quant_linear_lora(x, &s.blocks, factors, cx));
            }
            (Weight::Stored(s), _) => bias(quant_linear(x.clone(), &s.blocks, cx)),
            (Weight::Dense(w), _) => linear_packed(x.clone(), w.val(), self.bias.as_ref().map(|b| b.val()), cx),
        };
        match &self.lora {
            Some(lora) => y + lora.forward(x, cx),
            None => y,
        }
    }

    /// The adapter as the linear op's low-rank update, its factors in `compute`.
    fn low_rank(&self, compute: DType) -> Option<LowRank<Tensor<B, 2>>> {
        let lora = self.lora.as_ref()?;
        let (a, b) = (to_dtype(lora.lora_a.val(), compute), to_dtype(lora.lora_b.val(), compute));
        Some(LowRank { a, b, scale: lora.scale as f32 })
    }
}

/// Rows up to which an inference call multiplies each packed weight on its own.
const DECODE_ROWS: usize = 16;

/// Several projections of the same input, side by side: `x·[W_1 | W_2 | …] + [b_1 | b_2 | …]` as
/// one op ([`linear::linear_multi`]: on the CPU each weight is read where it is and gets its own
/// contiguous gradient; elsewhere the weights are concatenated per call). Attached adapters run
/// inside that op ([`linear::linear_lora`]): each `(α/r)·(x·A)·B` accumulates into its projection's
/// columns and the frozen weights are never differentiated. When decoding a few rows, and with
/// adapter dropout (one mask each), each projection runs on its own and the outputs are
/// concatenated. Computed in `cx.dtype`, returned in f32.
///
/// # Shapes
/// - x: `[N, in]` -> `[N, Σ out_i]`
pub(crate) fn forward_packed<B: EmberBackend>(parts: &[&Linear<B>], x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    ember_kernels::profile::time(ember_kernels::profile::Part::Projections, || packed(parts, x, cx))
}

fn packed<B: EmberBackend>(parts: &[&Linear<B>], x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
    let compute = cx.dtype;
    let biased = parts.iter().filter(|p| p.bias.is_some()).count();
    let adapted = parts.iter().any(|p| p.has_lora());
    // Decoding (a few rows, no autodiff): the weights are read where they are, one GEMM each;
    // concatenating them would copy every packed weight at every token (280 MB a token for
    // SmolLM2-135M) for a product that is bound by reading the weights anyway.
    let training = B::ad_enabled(&x.device());
    let decoding = x.dims()[0] <= DECODE_ROWS && !training;
    let dropout = training && parts.iter().any(|p| p.lora.as_ref().is_some_and(|l| l.dropout > 0.0));
    let apart = decoding || dropout || (biased != 0 && biased != parts.len());
    // One layer: the plain linear op, and its adapter added where no kernel takes it inside.
    let apart = apart || (parts.len() == 1 && !(adapted && cx.fused::<B>(compute)));
    // A quantized weight has its own product (a tile dequantized at a time), each on its own.
    let apart = apart || parts.iter().any(|p| p.weight.dense().is_none());
    if apart {
        let outputs: Vec<_> = parts.iter().map(|p| p.forward_apart(x.clone(), cx)).collect();
        return if outputs.len() == 1 {
            outputs.into_iter().next().expect("one output")
        } else {
            Tensor::cat(outputs, 1)
        };
    }
    let weights = parts.iter().filter_map(|p| p.weight.dense().map(|w| to_dtype(w.val(), compute))).collect();
    let biases = parts.iter().filter_map(|p| p.bias.as_ref().map(|b| to_dtype(b.val(), compute))).collect();
    let x = to_dtype(x, compute);
    let y = match adapted {
        true => linear::linear_lora(x, weights, biases, parts.iter().map(|p| p.low_rank(compute)).collect(), cx),
        false => linear::linear_multi(x, weights, biases, cx),
    };
    to_dtype(y, DType::F32)
}

/// `x·W + b` in `cx.dtype`, returned in f32.
fn linear_packed<B: EmberBackend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
    cx: Compute,
) -> Tensor<B, 2> {
    // A weight kept in bf16 (`import --dtype bf16`) under f32 products, decoding: multiplied as
    // stored, half an f32 weight's bytes read, instead of widened to a new f32 copy at every call.
    let decoding = x.dims()[0] <= DECODE_ROWS && !B::ad_enabled(&x.device());
    if decoding && cx.dtype == DType::F32 && w.dtype() == DType::BF16 {
        return linear::linear_bf16_weight(to_dtype(x, DType::F32), w, b, cx);
    }
    let bias = b.map(|b| to_dtype(b, cx.dtype));
    to_dtype(linear(to_dtype(x, cx.dtype), to_dtype(w, cx.dtype), bias, cx), DType::F32)
}

/// `values`, `rows` of `cols` row-major, as a "stored" weight of f32 blocks (one value a block): a
/// stand-in for a GGUF file's blocks whose products are exact.
#[cfg(test)]
pub(crate) fn f32_blocks(rows: usize, cols: usize, values: &[f32]) -> QuantWeight {
    fn decode(bytes: &[u8], out: &mut [f32]) {
        for (v, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    QuantWeight::new("f32", [rows, cols], (1, 4), bytes, decode).expect("whole blocks")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraConfig;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, TensorData, Tolerance};

    type AB = Autodiff<Flex>;

    #[test]
    fn adapters_inside_the_packed_op_equal_the_layers_apart() {
        // q/k/v with adapters on the first and the last (LoRA's default targets q and v leave k
        // alone), gate/up both adapted, one adapted layer alone (o_proj, down_proj); the base
        // weights trained and frozen (LoRA's case: no weight gradient, the input's still needed).
        // (widths, adapted parts, base frozen, biases: Qwen2's q/k/v, frozen as LoRA freezes them)
        type Case = (&'static [usize], &'static [usize], bool, bool);
        let cases: [Case; 5] = [
            (&[10, 4, 6], &[0, 2], false, false),
            (&[10, 4, 6], &[0, 2], true, false),
            (&[8, 4, 4], &[0, 1, 2], true, true),
            (&[7, 7], &[0, 1], true, false),
            (&[9], &[0], true, false),
        ];
        for (outs, adapted, frozen, bias) in cases {
            let dev = Default::default();
            let mut init = Init::new(7);
            let config = LoraConfig { rank: 3, alpha: 6.0, dropout: 0.0, targets: vec![] };
            let (rows, d_in) = (21, 12);
            let mut parts: Vec<Linear<AB>> =
                outs.iter().map(|&o| Linear::new(&mut init, d_in, o, bias, 0.5, &dev)).collect();
            if frozen {
                let freeze = |p: Linear<AB>| Linear {
                    weight: Weight::Dense(p.weight.dense().unwrap().clone().set_require_grad(false)),
                    bias: p.bias.map(|b| b.map(|b| b.add_scalar(0.25)).set_require_grad(false)),
                    ..p
                };
                parts = parts.into_iter().map(freeze).collect();
            }
            for &i in adapted {
                // B made non-zero so that it counts.
                let mut lora = Lora::new(&mut init, d_in, outs[i], &config, &dev);
                let b = Tensor::<AB, 2>::random([config.rank, outs[i]], Distribution::Normal(0.0, 1.0), &dev);
                lora.lora_b = lora.lora_b.map(|_| b.require_grad());
                parts[i].lora = Some(lora);
            }
            let parts: Vec<&Linear<AB>> = parts.iter().collect();
            let x0 = Tensor::<Flex, 2>::random([rows, d_in], Distribution::Normal(0.0, 1.0), &dev);
            let mix = Tensor::<AB, 2>::random([rows, outs.iter().sum()], Distribution::Normal(0.0, 1.0), &dev);
            let run = |inside: bool| -> Vec<(&str, Option<TensorData>)> {
                let x = Tensor::<AB, 2>::from_inner(x0.clone()).require_grad();
                let y = match inside {
                    true => forward_packed(&parts, x.clone(), Compute::default()),
                    false => {
                        Tensor::cat(parts.iter().map(|p| p.forward_apart(x.clone(), Compute::default())).collect(), 1)
                    }
                };
                let grads = (y.clone() * mix.clone()).sum().backward();
                let grad = |t: Tensor<AB, 2>| t.grad(&grads).map(|g| g.into_data());
                let mut out = vec![("y", Some(y.into_data())), ("dX", grad(x))];
                for p in &parts {
                    out.push(("dW", grad(p.weight.dense().unwrap().val())));
                    if let Some(lora) = &p.lora {
                        out.extend([("dA", grad(lora.lora_a.val())), ("dB", grad(lora.lora_b.val()))]);
                    }
                }
                out
            };
            let (got, want) = (run(true), run(false));
            let what = format!("{outs:?} adapted {adapted:?} frozen {frozen} bias {bias}");
            assert_eq!(got.len(), 2 + outs.len() + 2 * adapted.len(), "{what}");
            for (i, ((name, g), (_, w))) in got.iter().zip(&want).enumerate() {
                match (g, w) {
                    (Some(g), Some(w)) => {
                        g.assert_approx_eq::<f32>(w, Tolerance::absolute(1e-4));
                        assert!(g.iter::<f32>().any(|v| v != 0.0), "{what}: {name} ({i}) all zeros");
                        assert!(!(frozen && *name == "dW"), "{what}: a frozen weight got a gradient");
                    }
                    (None, None) => assert!(frozen && *name == "dW", "{what}: {name} ({i}) missing"),
                    _ => panic!("{what}: {name} ({i}) on one side only"),
                }
            }
        }
    }
}
