//! The sections of the optimisation: `[optim]` (AdamW), `[muon]` and `[schedule]` (the learning
//! rate's course).

use serde::{Deserialize, Serialize};

/// AdamW (Loshchilov and Hutter, 2019) with decoupled weight decay on matrices only. Every key
/// has a default, and the section may be left out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    #[serde(default = "beta1")]
    pub beta1: f64,
    #[serde(default = "beta2")]
    pub beta2: f64,
    #[serde(default = "eps")]
    pub eps: f64,
    /// Applied to parameters of rank >= 2 (projections, embedding); never to norm gains or biases.
    #[serde(default)]
    pub weight_decay: f64,
    /// Clip the global gradient norm (over all parameters) to this; 0 disables clipping.
    #[serde(default)]
    pub grad_clip: f64,
}

fn beta1() -> f64 {
    0.9
}
fn beta2() -> f64 {
    0.95
}
fn eps() -> f64 {
    1e-8
}

/// Muon (Jordan et al., 2024) for the hidden matrices: momentum, then the update orthogonalised by a
/// Newton–Schulz iteration, as `torch.optim.Muon` computes it. The section is optional: without it
/// every parameter trains with AdamW. With it, the 2-D weights inside the blocks (attention and MLP
/// projections) train with Muon and everything else (embedding, LM head, norms, biases) with AdamW
/// under `[optim]`. Muon's rate follows the `[schedule]` shape, scaled by `lr / schedule.lr`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MuonConfig {
    /// Peak learning rate of the Muon matrices (modded-nanogpt: 0.05 with `adjust_lr = "original"`).
    pub lr: f64,
    #[serde(default = "muon_momentum")]
    pub momentum: f64,
    /// Nesterov momentum: the iteration reads `lerp(grad, buf, momentum)` instead of `buf`.
    #[serde(default = "yes")]
    pub nesterov: bool,
    /// Newton–Schulz iterations (torch refuses 100 or more).
    #[serde(default = "ns_steps")]
    pub ns_steps: usize,
    /// The quintic's coefficients (a, b, c): `X <- a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`.
    #[serde(default = "ns_coefficients")]
    pub ns_coefficients: [f64; 3],
    /// Floor of the Frobenius norm the iteration's input is divided by.
    #[serde(default = "muon_eps")]
    pub eps: f64,
    /// Decoupled weight decay: `p <- p·(1 - lr·weight_decay)` before the update.
    #[serde(default)]
    pub weight_decay: f64,
    /// The shape scale of the rate (torch's `adjust_lr_fn`).
    #[serde(default)]
    pub adjust_lr: AdjustLr,
    /// The iteration's arithmetic: `f32`, or `bf16` as torch computes it (operands and results
    /// rounded to bf16, products accumulated in f32).
    #[serde(default)]
    pub ns_dtype: NsDtype,
    /// Muon on LoRA's adapter matrices too (by default they train with AdamW).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lora: bool,
}

/// How Muon scales its rate by a matrix's shape, for a weight of `fan_out × fan_in` (torch's
/// orientation; ember stores linear weights as `[fan_in, fan_out]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// Keller Jordan's `lr · max(1, fan_out / fan_in)^½`.
    #[default]
    Original,
    /// Moonshot's `lr · 0.2 · max(fan_out, fan_in)^½`: the update's RMS matches AdamW's, so AdamW's
    /// rate and weight decay carry over.
    MatchRmsAdamw,
}

/// The Newton–Schulz iteration's arithmetic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NsDtype {
    #[default]
    F32,
    Bf16,
}

fn muon_momentum() -> f64 {
    0.95
}
fn yes() -> bool {
    true
}
fn ns_steps() -> usize {
    5
}
fn ns_coefficients() -> [f64; 3] {
    [3.4445, -4.7750, 2.0315]
}
fn muon_eps() -> f64 {
    1e-7
}

/// Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps`, then constant. Every key
/// has a default, and the section may be left out; the defaults that depend on other keys are
/// filled in when the file is read (`config::defaults`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Peak learning rate [default: with `[lora]` 2e-4, 1e-4 with `[preference]`, 5e-5 with
    /// `[rl]`; for every weight of an `init_from` model 5e-5, 1e-6 with `[preference]` or `[rl]`
    /// (TRL's); from scratch 6e-4: `config::defaults`].
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    /// [default: `decay_steps / 20`].
    #[serde(default)]
    pub warmup_steps: usize,
    /// Step at which the cosine reaches `min_lr`; `train.max_steps` when absent.
    #[serde(default)]
    pub decay_steps: Option<usize>,
    /// `cosine` (default), or `wsd`: warmup, the rate held, then a linear cool-down to `min_lr`
    /// ending at `decay_steps`.
    #[serde(default, skip_serializing_if = "is_cosine")]
    pub shape: ScheduleShape,
    /// With `shape = "wsd"`: the fraction of `decay_steps` the cool-down takes, in (0, 1].
    #[serde(default = "cooldown_frac", skip_serializing_if = "is_default_cooldown_frac")]
    pub cooldown_frac: f64,
}

/// The learning rate's course after the warmup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleShape {
    /// Cosine decay from `lr` to `min_lr` (nanoGPT).
    #[default]
    Cosine,
    /// Warmup-stable-decay: `lr` held, then a linear cool-down (modded-nanogpt, MiniCPM).
    Wsd,
}

fn is_cosine(s: &ScheduleShape) -> bool {
    *s == ScheduleShape::Cosine
}
fn cooldown_frac() -> f64 {
    0.4
}
fn is_default_cooldown_frac(f: &f64) -> bool {
    *f == cooldown_frac()
}
