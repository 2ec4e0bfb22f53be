//! Scalar activations the CPU kernels share, below every op module: `e^x` without libm, the
//! sigmoid, the tanh GELU and its derivative, and the gate of a gated unit.

use serde::{Deserialize, Serialize};

/// √(2/π), the tanh approximation's scale.
pub(crate) const SQRT_2_OVER_PI: f64 = std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2;
/// The cubic term's weight in the tanh approximation (Hendrycks & Gimpel, 2016, §2).
pub(crate) const CUBIC: f64 = 0.044715;

/// `e^x` in f32 without a libm call, so that loops over it vectorise: `x = n·ln2 + r` with
/// `|r| <= ln2/2`, `e^r` from a degree-6 polynomial (Cephes' `expf` coefficients), `2^n` built in the
/// exponent bits. Plain multiply-adds: `mul_add` is a libm call where the target has no FMA.
/// Within 2e-7 relative of `f32::exp` for normal results (tested with the kernels); inputs are clamped to
/// `[-87.3, 88.7]`, so results below f32's smallest normal come out as about 1e-38 instead of 0.
/// NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer held in the low bits
    let x = x.clamp(-87.3, 88.7);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let er = p * (r * r) + r + 1.0;
    let bits = (shifted.to_bits() as i32 - ROUND.to_bits() as i32 + 127) << 23;
    er * f32::from_bits(bits as u32)
}

#[inline(always)]
pub(crate) fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + exp(-z))
}

/// The tanh approximation, `0.5·x·(1 + tanh z)` with `z = √(2/π)·(x + 0.044715·x³)`, computed as
/// `x·σ(2z)`: the same value (`1 + tanh z = 2σ(2z)`), without the cancellation of `1 + tanh z`
/// where `tanh z` is near −1.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    let two_z = (2.0 * SQRT_2_OVER_PI) as f32 * (x + CUBIC as f32 * (x * x * x));
    x * sigmoid(two_z)
}

/// `d gelu_tanh / dx = s + x·2s(1 − s)·√(2/π)·(1 + 3·0.044715·x²)`, `s = σ(2z)`.
#[inline(always)]
pub(crate) fn gelu_tanh_grad(x: f32) -> f32 {
    let two_z = (2.0 * SQRT_2_OVER_PI) as f32 * (x + CUBIC as f32 * (x * x * x));
    let s = sigmoid(two_z);
    s + x * (2.0 * s * (1.0 - s)) * (SQRT_2_OVER_PI as f32 * (1.0 + (3.0 * CUBIC) as f32 * (x * x)))
}

/// The activation of a gated unit's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// `silu(g) = g·σ(g)`: SwiGLU.
    Silu,
    /// The tanh-approximated GELU ([`Gelu::Tanh`]): GeGLU as Gemma runs it.
    GeluTanh,
}
