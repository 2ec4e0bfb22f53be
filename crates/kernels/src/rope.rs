//! Rotary position embedding (Su et al., 2021): channel pair `i` of every head is rotated by the angle
//! `pos · theta^(-2i/Dh)`. Applied to queries and keys, never to values.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor, TensorData};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::compute::Compute;
use crate::{flex, float, prim, EmberBackend};

/// How RoPE pairs the channels of a head.
///
/// Both rotate pairs of channels by `pos * theta^(-2i/Dh)`; they differ in which channels form pair `i`.
/// A checkpoint trained with one layout works with the other after permuting the output columns of the
/// query and key projections (see [`interleaved_to_half_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeLayout {
    /// Pairs `(2i, 2i + 1)`: Meta's reference Llama code and Burn's `RotaryEncoding`.
    Interleaved,
    /// Pairs `(i, i + Dh/2)` (`rotate_half`): Hugging Face Llama, Qwen2 and Mistral checkpoints.
    #[default]
    HalfSplit,
}

/// RoPE frequency scaling, as in Hugging Face's `rope_scaling`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    /// Positions divided by `factor` (Chen et al., 2023, position interpolation).
    Linear { factor: f64 },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
    /// YaRN (Peng et al., 2023; DeepSeek-V2/V3): frequencies that turn fewer than `beta_slow` times
    /// over the pretraining length divided by `factor`, those that turn more than `beta_fast` times
    /// kept, a linear ramp between; cos and sin multiplied by the attention factor (given, or
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`), and with `mscale_all_dim` the
    /// attention's softmax scale by `mscale(factor, mscale_all_dim)²` (the model applies that one).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        #[serde(default = "default_beta_fast")]
        beta_fast: f64,
        #[serde(default = "default_beta_slow")]
        beta_slow: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale_all_dim: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
        /// The ramp's ends rounded outwards to whole channels (Hugging Face's default).
        #[serde(default = "default_truncate")]
        truncate: bool,
    },
}

fn default_beta_fast() -> f64 {
    32.0
}
fn default_beta_slow() -> f64 {
    1.0
}
fn default_truncate() -> bool {
    true
}

/// YaRN's `mscale`: `0.1 · m · ln(s) + 1` above a scale of one, 1 at or below it.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The inverse frequencies of the channel pairs of a `head_dim`-wide rotation with base `theta`
    /// (Hugging Face's `_compute_*_parameters`).
    pub fn inv_freqs(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        let dim = head_dim as f64;
        let plain = (0..head_dim / 2).map(|i| theta.powf(-2.0 * i as f64 / dim));
        match *self {
            Self::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
                let old = original_max_position_embeddings as f64;
                // The channel pair that turns `rotations` times over the pretraining length.
                let pair =
                    |rotations: f64| dim * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
                let (mut low, mut high) = (pair(beta_fast), pair(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                plain
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp; // the share of the unscaled frequency
                        f / factor * ramp + f * keep
                    })
                    .collect()
            }
            _ => plain.map(|f| self.scale(f)).collect(),
        }
    }

    /// What cos and sin are multiplied by: YaRN's attention factor, 1 otherwise.
    pub fn attention_factor(&self) -> f64 {
        match *self {
            Self::Yarn { factor, mscale, mscale_all_dim, attention_factor, .. } => {
                attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                    _ => yarn_mscale(factor, 1.0),
                })
            }
            _ => 1.0,
        }
    }

    /// What a multi-head latent attention's softmax scale is multiplied by: YaRN's
    /// `mscale(factor, mscale_all_dim)²` where `mscale_all_dim` is given and non-zero, 1 otherwise.
    pub fn softmax_scale_factor(&self) -> f64 {
        match *self {
            Self::Yarn { factor, mscale_all_dim: Some(all), .. } if all != 0.0 => yarn_mscale(factor, all).powi(2),
            _ => 1.0,
        }
    }

    /// Scales the inverse frequency of one channel pair (linear and Llama 3 scaling; YaRN's depends
    /// on the channel, see [`Self::inv_freqs`]).
    fn scale(&self, inv_freq: f64) -> f64 {
        match *self {
            Self::Yarn { .. } => inv_freq,
            Self::Linear { factor } => inv_freq / factor,
            Self::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                if wavelen < high_wavelen {
                    inv_freq
                } else if wavelen > low_wavelen {
                    inv_freq / factor
                } else {
                    let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
                }
            }
        }
    }
}

/// Rows a model's tables are first built with: a session's positions past them are added as it
/// reaches them ([`Rope::covering`]), so that a model with a long context (Gemma 3's 32,768
/// positions: 67 MB of tables for its two bases) does not hold them all from the start.
pub const FIRST_ROWS: usize = 1024;

/// Precomputed cos/sin tables, `[rows, Dh/2]`, and the pairing convention; with what computes
/// more rows, up to the model's `max_seq_len`.
#[derive(Module, Debug)]
pub struct Rope<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    #[module(skip)]
    layout: RopeLayout,
    /// False for [`Rope::identity`]: the kernels skip the rotation instead of multiplying by 1 and 0.
    #[module(skip)]
    rotates: bool,
    /// What computes the tables' rows (`None` for tables given whole, [`Rope::from_tables`]).
    #[module(skip)]
    angles: Option<Angles>,
}

/// How a table's rows are computed: each channel pair's inverse frequency and the gain on cos and
/// sin (`None`: angle zero, the identity), and the most rows the tables may have.
#[derive(Debug, Clone)]
struct Angles {
    inv_freq: Option<std::sync::Arc<[f64]>>,
    gain: f64,
    half: usize,
    max_seq_len: usize,
}

impl Angles {
    /// Rows `from..to` of the cos and sin tables, row-major.
    fn rows(&self, from: usize, to: usize) -> (Vec<f32>, Vec<f32>) {
        let n = (to - from) * self.half;
        let Some(inv_freq) = &self.inv_freq else { return (vec![1.0; n], vec![0.0; n]) };
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for pos in from..to {
            for &inv_freq in inv_freq.iter() {
                let (s, c) = (pos as f64 * inv_freq).sin_cos();
                cos.push((c * self.gain) as f32);
                sin.push((s * self.gain) as f32);
            }
        }
        (cos, sin)
    }
}

impl<B: Backend> Rope<B> {
    /// Angles are computed in f64 on the host and stored in f32; low precision angles drift at long
    /// positions. The tables start with `min(max_seq_len, FIRST_ROWS)` rows.
    pub fn new(max_seq_len: usize, head_dim: usize, theta: f64, layout: RopeLayout, device: &B::Device) -> Self {
        Self::with_scaling(max_seq_len, head_dim, theta, layout, None, device)
    }

    pub fn with_scaling(
        max_seq_len: usize,
        head_dim: usize,
        theta: f64,
        layout: RopeLayout,
        scaling: Option<&RopeScaling>,
        device: &B::Device,
    ) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = match scaling {
            Some(s) => s.inv_freqs(head_dim, theta),
            None => (0..half).map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64)).collect(),
        };
        let gain = scaling.map_or(1.0, RopeScaling::attention_factor);
        let angles = Angles { inv_freq: Some(inv_freq.into()), gain, half, max_seq_len };
        Self::from_angles(angles, layout, true, device)
    }

    /// Tables of the first rows `angles` gives.
    fn from_angles(angles: Angles, layout: RopeLayout, rotates: bool, device: &B::Device) -> Self {
        let rows = angles.max_seq_len.min(FIRST_ROWS);
        let (cos, sin) = angles.rows(0, rows);
        let table = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [rows, angles.half]), device);
        Self { cos: table(cos), sin: table(sin), layout, rotates, angles: Some(angles) }
    }

    /// These tables grown to cover positions `0..positions` (twice the rows they had at least, the
    /// model's `max_seq_len` at most: a session's growth costs a few recomputations), or `None`
    /// where they already do, or cannot grow (tables given whole, or at `max_seq_len`). Rows
    /// already there keep their values: growing changes no result.
    pub fn covering(&self, positions: usize) -> Option<Self> {
        let (have, angles) = (self.max_seq_len(), self.angles.as_ref()?);
        let rows = positions.max(2 * have).min(angles.max_seq_len);
        if positions <= have || rows <= have {
            return None;
        }
        let (cos, sin) = angles.rows(have, rows);
        let device = self.cos.device();
        let more = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [rows - have, angles.half]), &device);
        Some(Self {
            cos: Tensor::cat(vec![self.cos.clone(), more(cos)], 0),
            sin: Tensor::cat(vec![self.sin.clone(), more(sin)], 0),
            layout: self.layout,
            rotates: self.rotates,
            angles: self.angles.clone(),
        })
    }

    /// Tables of angle zero (cos 1, sin 0): the rotation is the identity, exactly (`x·1 − y·0 = x`).
    /// What a model with learned positions runs through the attention ops; the CPU kernels see
    /// [`Rope::rotates`] false and skip the rotation, the compositions multiply by 1 and 0.
    pub fn identity(max_seq_len: usize, head_dim: usize, layout: RopeLayout, device: &B::Device) -> Self {
        let angles = Angles { inv_freq: None, gain: 1.0, half: head_dim / 2, max_seq_len };
        Self::from_angles(angles, layout, false, device)
    }

    /// Rope over given cos and sin tables, `[T_max, Dh/2]` each (as [`Self::tables`] returns them).
    pub fn from_tables(cos: Tensor<B, 2>, sin: Tensor<B, 2>, layout: RopeLayout) -> Self {
        Self { cos, sin, layout, rotates: true, angles: None }
    }

    /// The cos and sin tables, `[T_max, Dh/2]` each.
    pub fn tables(&self) -> (Tensor<B, 2>, Tensor<B, 2>) {
        (self.cos.clone(), self.sin.clone())
    }

    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// The device the tables live on.
    pub fn device(&self) -> B::Device {
        self.cos.device()
    }

    /// False for [`Rope::identity`]'s tables.
    pub fn rotates(&self) -> bool {
        self.rotates
    }

    /// Longest sequence the tables cover now ([`Self::covering`] grows them).
    pub fn max_seq_len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates each row of `x` from its own start: position `t` of row `b` is absolute position
    /// `starts[b] + t` (positions past the table, only ever padding, reuse its last row).
    ///
    /// # Shapes
    /// - x: `[B, H, T, Dh]` -> `[B, H, T, Dh]`, one start per row
    pub fn apply_rows(&self, x: Tensor<B, 4>, starts: &[usize]) -> Tensor<B, 4> {
        let t = x.dims()[2];
        if starts.iter().all(|&s| s == starts[0]) && starts[0] + t <= self.max_seq_len() {
            return self.apply(x, starts[0]);
        }
        let positions: Vec<usize> = starts.iter().flat_map(|&s| s..s + t).collect();
        self.apply_positions(x, &positions)
    }

    /// Rotates position `t` of row `b` by the angles of absolute position `positions[b·T + t]`
    /// (positions past the table, only ever padding, reuse its last row).
    ///
    /// # Shapes
    /// - x: `[B, H, T, Dh]` -> `[B, H, T, Dh]`, positions: `[B·T]`
    pub fn apply_positions(&self, x: Tensor<B, 4>, positions: &[usize]) -> Tensor<B, 4> {
        rotate_positions(x, self.cos.clone(), self.sin.clone(), positions, self.layout)
    }

    /// Rotates `x` whose position 0 sits at absolute position `start`.
    ///
    /// # Shapes
    /// - x: `[B, H, T, Dh]` -> `[B, H, T, Dh]`, with `start + T <= T_max`
    pub fn apply(&self, x: Tensor<B, 4>, start: usize) -> Tensor<B, 4> {
        let t = x.dims()[2];
        let cos = self.cos.clone().narrow(0, start, t).unsqueeze::<4>(); // [1, 1, T, Dh/2]
        let sin = self.sin.clone().narrow(0, start, t).unsqueeze::<4>();
        self.rotate(x, cos, sin)
    }

    fn rotate(&self, x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
        rotate(x, cos, sin, self.layout)
    }
}

impl<B: EmberBackend> Rope<B> {
    /// [`Self::apply_rows`] as one op where the backend has a kernel for it (the CPU's: one pass,
    /// where the composition makes a strided pass per product over small decode tensors).
    ///
    /// # Shapes
    /// - x: `[B, H, T, Dh]` -> `[B, H, T, Dh]`, one start per row
    pub fn apply_rows_op(&self, x: Tensor<B, 4>, starts: &[usize], cx: Compute) -> Tensor<B, 4> {
        if !cx.fused::<B>(x.dtype()) || self.cos.dtype() != x.dtype() {
            return self.apply_rows(x, starts);
        }
        let t = x.dims()[2];
        let positions: Vec<usize> = starts.iter().flat_map(|&s| s..s + t).collect();
        float(B::rope_positions(prim(x), prim(self.cos.clone()), prim(self.sin.clone()), &positions, self.layout))
    }
}

/// A backend's RoPE at given positions; the default method is the reference.
pub trait RopeOps: Backend {
    /// Position `t` of row `b` of `x` rotated by the angles of `positions[b·T + t]` (clamped to
    /// the table's last row).
    ///
    /// # Shapes
    /// - x: `[B, H, T, Dh]`, cos, sin: `[T_max, Dh/2]`, positions: `[B·T]` -> `[B, H, T, Dh]`
    fn rope_positions(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: &[usize],
        layout: RopeLayout,
    ) -> FloatTensor<Self> {
        prim(rotate_positions(float::<Self, 4>(x), float(cos), float(sin), positions, layout))
    }
}

/// The composition: the tables' rows gathered by position, then [`rotate`].
///
/// # Shapes
/// - x: `[B, H, T, Dh]`, cos, sin: `[T_max, Dh/2]`, positions: `[B·T]` -> `[B, H, T, Dh]`
pub fn rotate_positions<B: Backend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    positions: &[usize],
    layout: RopeLayout,
) -> Tensor<B, 4> {
    let [b, _, t, dh] = x.dims();
    let last = cos.dims()[0].saturating_sub(1);
    let ids: Vec<i32> = positions.iter().map(|&p| p.min(last) as i32).collect();
    let ids = Tensor::<B, 1, burn::tensor::Int>::from_data(TensorData::new(ids, [b * t]), &x.device());
    let rows = |table: Tensor<B, 2>| table.select(0, ids.clone()).reshape([b, 1, t, dh / 2]);
    rotate(x, rows(cos), rows(sin), layout)
}

/// # Shapes
/// - x: `[B, H, T, Dh]`, cos, sin: `[B or 1, 1, T, Dh/2]` -> `[B, H, T, Dh]`
pub fn rotate<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>, layout: RopeLayout) -> Tensor<B, 4> {
    let [b, h, t, dh] = x.dims();
    let half = dh / 2;
    let dtype = x.dtype();
    let (cos, sin) = (cos.cast(dtype), sin.cast(dtype));
    match layout {
        RopeLayout::HalfSplit => {
            let x1 = x.clone().narrow(3, 0, half); // [B, H, T, Dh/2]: first channel of each pair
            let x2 = x.narrow(3, half, half); //      second channel
            Tensor::cat(vec![x1.clone() * cos.clone() - x2.clone() * sin.clone(), x1 * sin + x2 * cos], 3)
        }
        RopeLayout::Interleaved => {
            let rows = cos.dims()[0];
            let cos = cos.reshape([rows, 1, t, half, 1]);
            let sin = sin.reshape([rows, 1, t, half, 1]);
            let x = x.reshape([b, h, t, half, 2]);
            let xe = x.clone().narrow(4, 0, 1); // [B, H, T, Dh/2, 1]: channels 2i
            let xo = x.narrow(4, 1, 1); //         channels 2i + 1
            Tensor::cat(vec![xe.clone() * cos.clone() - xo.clone() * sin.clone(), xe * sin + xo * cos], 4)
                .reshape([b, h, t, dh])
        }
    }
}

/// One pass over `x` (logical order), each head's position rotated by its row of the tables.
impl RopeOps for Flex {
    fn rope_positions(
        x: FlexTensor,
        cos: FlexTensor,
        sin: FlexTensor,
        positions: &[usize],
        layout: RopeLayout,
    ) -> FlexTensor {
        let (xs, cs) = (flex::shape(&x), flex::shape(&cos));
        let fits = flex::all_f32(&[&x, &cos, &sin])
            && xs.len() == 4
            && cs.len() == 2
            && cs[0] > 0
            && flex::shape(&sin) == cs
            && xs[3] == 2 * cs[1]
            && xs[2] * xs[3] > 0
            && positions.len() == xs[0] * xs[2];
        if !fits {
            return prim(rotate_positions(float::<Self, 4>(x), float(cos), float(sin), positions, layout));
        }
        let [h, t, dh] = [xs[1], xs[2], xs[3]];
        let (x, cos, sin) = (flex::f32s(&x), flex::f32s(&cos), flex::f32s(&sin));
        let (half, last) = (dh / 2, cs[0] - 1);
        let mut y = vec![0.0f32; x.len()];
        y.par_chunks_mut(t * dh).zip(x.par_chunks(t * dh)).enumerate().for_each(|(bh, (y, x))| {
            let row = bh / h;
            for (pos, (y, x)) in y.chunks_exact_mut(dh).zip(x.chunks_exact(dh)).enumerate() {
                let p = positions[row * t + pos].min(last);
                let (c, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
                for i in 0..half {
                    let (a, b) = match layout {
                        RopeLayout::HalfSplit => (i, i + half),
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    };
                    y[a] = x[a] * c[i] - x[b] * s[i];
                    y[b] = x[a] * s[i] + x[b] * c[i];
                }
            }
        });
        flex::tensor(y, xs)
    }
}

impl<B: RopeOps, C: CheckpointStrategy> RopeOps for Autodiff<B, C> {}

/// Reorders the output columns of a q or k projection trained with interleaved RoPE so that the
/// half-split layout computes the same attention scores: within each head, column `c·Dh/2 + i` of the
/// result is column `2i + c` of the input. This is the permutation Hugging Face's
/// `convert_llama_weights_to_hf.py` applies to Meta's checkpoints.
///
/// # Shapes
/// - weight: `[in, n_heads·Dh]` -> `[in, n_heads·Dh]`
pub fn interleaved_to_half_split<B: Backend>(weight: Tensor<B, 2>, n_heads: usize) -> Tensor<B, 2> {
    let [d_in, width] = weight.dims();
    let half = width / n_heads / 2;
    weight
        .reshape([d_in, n_heads, half, 2]) // [in, H, Dh/2, pair]
        .swap_dims(2, 3) //                   [in, H, pair, Dh/2]
        .reshape([d_in, width])
}

#[cfg(test)]
/// Inverse of [`interleaved_to_half_split`].
pub(crate) fn half_split_to_interleaved<B: Backend>(weight: Tensor<B, 2>, n_heads: usize) -> Tensor<B, 2> {
    let [d_in, width] = weight.dims();
    let half = width / n_heads / 2;
    weight
        .reshape([d_in, n_heads, 2, half]) // [in, H, pair, Dh/2]
        .swap_dims(2, 3) //                   [in, H, Dh/2, pair]
        .reshape([d_in, width])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TestBackend;
    use burn::tensor::{Distribution, Tolerance};

    type B = TestBackend;

    /// The textbook definition, one pair at a time.
    fn rope_slow(x: &[f32], t: usize, dh: usize, start: usize, theta: f64, layout: RopeLayout) -> Vec<f32> {
        let mut out = x.to_vec();
        for pos in 0..t {
            for i in 0..dh / 2 {
                let angle = (start + pos) as f64 * theta.powf(-2.0 * i as f64 / dh as f64);
                let (s, c) = angle.sin_cos();
                let (a, b) = match layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::HalfSplit => (i, i + dh / 2),
                };
                let (xa, xb) = (x[pos * dh + a] as f64, x[pos * dh + b] as f64);
                out[pos * dh + a] = (xa * c - xb * s) as f32;
                out[pos * dh + b] = (xa * s + xb * c) as f32;
            }
        }
        out
    }

    #[test]
    fn kernel_matches_the_composition_at_any_positions() {
        use burn::backend::Flex;
        let dev = Default::default();
        let (b, h, t, dh, max) = (3, 2, 4, 8, 16);
        let positions: Vec<usize> = vec![0, 1, 2, 3, 7, 8, 9, 10, 14, 15, 16, 40]; // the last two past the table
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = Rope::<Flex>::new(max, dh, 10_000.0, layout, &dev);
            // A strided view, as the attention hands it over: [B, T, H, Dh] with heads and steps swapped.
            let x = Tensor::<Flex, 4>::random([b, t, h, dh], Distribution::Normal(0.0, 1.0), &dev).swap_dims(1, 2);
            let (cos, sin) = rope.tables();
            let got = <Flex as RopeOps>::rope_positions(prim(x.clone()), prim(cos), prim(sin), &positions, layout);
            let want = rope.apply_positions(x.clone(), &positions);
            float::<Flex, 4>(got).into_data().assert_approx_eq::<f32>(&want.into_data(), Tolerance::absolute(1e-6));
            let starts = [0, 7, 14];
            let fused = rope.apply_rows_op(x.clone(), &starts, Compute::default());
            fused
                .into_data()
                .assert_approx_eq::<f32>(&rope.apply_rows(x, &starts).into_data(), Tolerance::absolute(1e-6));
        }
    }

    /// Tables start with `FIRST_ROWS` rows at most and grow to twice their rows at least, up to the
    /// model's `max_seq_len` (never past it); rows already there keep their bits, new rows follow
    /// the definition, the identity's stay angle zero.
    #[test]
    fn tables_grow_to_cover_what_a_session_reaches() {
        let dev = Default::default();
        let (dh, max) = (8, 3 * FIRST_ROWS);
        let short = Rope::<B>::new(100, dh, 10_000.0, RopeLayout::HalfSplit, &dev);
        assert_eq!(short.max_seq_len(), 100);
        assert!(short.covering(100).is_none() && short.covering(5_000).is_none(), "at max_seq_len already");
        let rope = Rope::<B>::new(max, dh, 10_000.0, RopeLayout::HalfSplit, &dev);
        assert_eq!(rope.max_seq_len(), FIRST_ROWS);
        assert!(rope.covering(FIRST_ROWS).is_none());
        let grown = rope.covering(FIRST_ROWS + 1).expect("grown");
        assert_eq!(grown.max_seq_len(), 2 * FIRST_ROWS);
        assert_eq!(grown.covering(2 * FIRST_ROWS + 1).expect("grown again").max_seq_len(), max);
        assert_eq!(rope.covering(10 * FIRST_ROWS).expect("grown to the end").max_seq_len(), max);
        let (cos, sin) = rope.tables();
        let (big_cos, big_sin) = grown.tables();
        big_cos.narrow(0, 0, FIRST_ROWS).into_data().assert_eq(&cos.into_data(), true);
        big_sin.narrow(0, 0, FIRST_ROWS).into_data().assert_eq(&sin.into_data(), true);
        // Rows past the first tables: their positions' angles.
        let far = FIRST_ROWS + FIRST_ROWS / 2;
        let x = Tensor::<B, 4>::random([1, 1, 2, dh], Distribution::Normal(0.0, 1.0), &dev);
        let xs = x.to_data().to_vec::<f32>().unwrap();
        let want = rope_slow(&xs, 2, dh, far, 10_000.0, RopeLayout::HalfSplit);
        let got = grown.apply(x, far).into_data();
        got.assert_approx_eq::<f32>(&TensorData::new(want, [1, 1, 2, dh]), Tolerance::absolute(1e-5));
        let identity =
            Rope::<B>::identity(max, dh, RopeLayout::HalfSplit, &dev).covering(FIRST_ROWS + 1).expect("grown");
        let (cos, sin) = identity.tables();
        assert!(!identity.rotates());
        assert_eq!(cos.dims(), [2 * FIRST_ROWS, dh / 2]);
        cos.into_data()
            .assert_eq(&TensorData::new(vec![1.0f32; 2 * FIRST_ROWS * dh / 2], [2 * FIRST_ROWS, dh / 2]), true);
        sin.into_data()
            .assert_eq(&TensorData::new(vec![0.0f32; 2 * FIRST_ROWS * dh / 2], [2 * FIRST_ROWS, dh / 2]), true);
    }

    #[test]
    fn both_layouts_match_the_definition() {
        let dev = Default::default();
        let (t, dh, start) = (5, 8, 3);
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = Rope::<B>::new(16, dh, 10_000.0, layout, &dev);
            let x = Tensor::<B, 4>::random([1, 1, t, dh], Distribution::Normal(0.0, 1.0), &dev);
            let xs = x.to_data().to_vec::<f32>().unwrap();
            let want = rope_slow(&xs, t, dh, start, 10_000.0, layout);
            let got = rope.apply(x, start).into_data();
            got.assert_approx_eq::<f32>(&TensorData::new(want, [1, 1, t, dh]), Tolerance::absolute(1e-5));
        }
    }

    #[test]
    fn permutation_turns_interleaved_into_half_split() {
        let dev = Default::default();
        let (h, dh, t) = (3, 8, 6);
        let w = Tensor::<B, 2>::random([5, h * dh], Distribution::Normal(0.0, 1.0), &dev);
        let x = Tensor::<B, 2>::random([t, 5], Distribution::Normal(0.0, 1.0), &dev);
        let heads = |y: Tensor<B, 2>| y.reshape([1, t, h, dh]).swap_dims(1, 2); // [1, H, T, Dh]
        let inter = Rope::<B>::new(t, dh, 10_000.0, RopeLayout::Interleaved, &dev);
        let half = Rope::<B>::new(t, dh, 10_000.0, RopeLayout::HalfSplit, &dev);
        let a = inter.apply(heads(x.clone().matmul(w.clone())), 0);
        let w2 = interleaved_to_half_split(w.clone(), h);
        let b = half.apply(heads(x.matmul(w2.clone())), 0);
        // Same rotated vectors up to the same within-head channel permutation: dot products agree.
        let dots = |q: Tensor<B, 4>| q.clone().matmul(q.swap_dims(2, 3)).into_data();
        dots(a).assert_approx_eq::<f32>(&dots(b), Tolerance::absolute(1e-4));
        half_split_to_interleaved(w2, h).into_data().assert_eq(&w.into_data(), true);
    }
}
