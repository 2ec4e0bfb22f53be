//! Low-rank adapters (Hu et al., 2021): a frozen projection `x·W` becomes `x·W + (α/r)·x·A·B` with
//! `A: [in, r]` and `B: [r, out]` the only trained weights. `B` starts at zero, so the adapted model
//! starts as the base model.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{backend::Backend, DType, Distribution, Tensor};
use serde::{Deserialize, Serialize};

use crate::init::{const_param, Init};
use crate::ops::{linear, EmberBackend};
use crate::to_dtype;

/// The projections an adapter can target.
pub const TARGETS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank r of the update.
    pub rank: usize,
    /// The update is scaled by alpha / r.
    pub alpha: f64,
    /// Dropout on the adapter's input during training.
    #[serde(default)]
    pub dropout: f64,
    /// Projection names to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).
    #[serde(default = "default_targets")]
    pub targets: Vec<String>,
}

fn default_targets() -> Vec<String> {
    vec!["q_proj".into(), "v_proj".into()]
}

impl LoraConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("lora.rank must be at least 1".into());
        }
        if !(self.alpha > 0.0 && self.alpha.is_finite()) {
            return Err(format!("lora.alpha must be positive, found {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("lora.dropout must be in [0, 1), found {}", self.dropout));
        }
        if self.targets.is_empty() {
            return Err("lora.targets is empty".into());
        }
        if let Some(t) = self.targets.iter().find(|t| !TARGETS.contains(&t.as_str())) {
            return Err(format!("lora.targets: unknown projection `{t}` (expected one of {})", TARGETS.join(", ")));
        }
        Ok(())
    }
}

/// The adapter of one projection.
#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// `[in, r]`, uniform(±1/sqrt(in)) as PEFT's Kaiming-uniform default.
    pub lora_a: Param<Tensor<B, 2>>,
    /// `[r, out]`, zeros.
    pub lora_b: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub scale: f64,
    #[module(skip)]
    pub dropout: f64,
}

impl<B: Backend> Lora<B> {
    pub fn new(init: &mut Init, d_in: usize, d_out: usize, config: &LoraConfig, device: &B::Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        Self {
            lora_a: init.uniform_param([d_in, config.rank], bound, device),
            lora_b: const_param([config.rank, d_out], 0.0, device),
            scale: config.alpha / config.rank as f64,
            dropout: config.dropout,
        }
    }

    /// The update folded into a weight: `(α/r) · A · B`, `[in, out]`.
    pub fn delta(&self) -> Tensor<B, 2> {
        self.lora_a.val().matmul(self.lora_b.val()).mul_scalar(self.scale)
    }
}

impl<B: EmberBackend> Lora<B> {
    /// `(α/r) · dropout(x) · A · B`, in f32: two linear ops (on the CPU, two GEMM kernels each way
    /// whose backward computes only the gradients needed), the scale folded into the small `B`
    /// rather than applied to the `[N, out]` output.
    ///
    /// # Shapes
    /// - x: `[N, in]` -> `[N, out]`
    pub fn forward(&self, x: Tensor<B, 2>, compute: DType) -> Tensor<B, 2> {
        let x = if self.dropout > 0.0 && B::ad_enabled(&x.device()) {
            let keep = 1.0 - self.dropout;
            x.clone() * x.random_like(Distribution::Bernoulli(keep)).div_scalar(keep)
        } else {
            x
        };
        let a = to_dtype(self.lora_a.val(), compute);
        let b = to_dtype(self.lora_b.val().mul_scalar(self.scale), compute);
        let u = linear(to_dtype(x, compute), a, None); // [N, r]
        to_dtype(linear(u, b, None), DType::F32)
    }
}

/// Marks every parameter outside the adapters as frozen (no gradient, not in the optimizer).
pub(crate) struct FreezeBase {
    path: Vec<String>,
}

impl FreezeBase {
    pub(crate) fn new() -> Self {
        Self { path: Vec::new() }
    }
}

impl<B: Backend> ModuleMapper<B> for FreezeBase {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.path.iter().any(|p| p == "lora") {
            return param;
        }
        param.set_require_grad(false)
    }
}
