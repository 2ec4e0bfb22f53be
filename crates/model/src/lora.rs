//! Low-rank adapters (Hu et al., 2021): a frozen projection `x·W` becomes `x·W + (α/r)·x·A·B` with
//! `A: [in, r]` and `B: [r, out]` the only trained weights. `B` starts at zero, so the adapted model
//! starts as the base model.

use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, DType, Distribution, Tensor};
use serde::{Deserialize, Serialize};

use ember_kernels::linear::linear;
use ember_kernels::{Compute, EmberBackend};

use crate::config::ModelConfig;
use crate::init::{const_param, Init};
use crate::to_dtype;
use crate::weights::PathMapper;

pub use crate::kinds::Target;

impl Target {
    /// `(in, out)` of the projection in a model of `config`.
    pub fn shape(self, config: &ModelConfig) -> (usize, usize) {
        // Each block's part answers for its projection; where blocks differ (experts after dense
        // layers) the narrower. A projection no block has (a plain MLP's gate) is taken as the
        // model's MLP would have it, for the check that refuses it by name.
        let narrowest = (0..config.n_layers)
            .filter_map(|layer| config.block(layer).projection(self))
            .min_by_key(|&(d_in, d_out)| d_in.min(d_out));
        narrowest.unwrap_or((config.d_model, config.d_ff))
    }
}

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
    /// The projections to adapt. A config file's `[lora]` that leaves them out gets the seven
    /// projections (ember-train's defaults, which know the model); this default serves values read
    /// without them elsewhere.
    #[serde(default = "default_targets")]
    pub targets: Vec<Target>,
}

fn default_targets() -> Vec<Target> {
    vec![Target::QProj, Target::VProj]
}

/// A `[lora]` section that breaks a rule, named with its key and value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoraError {
    #[error("lora.rank must be at least 1")]
    ZeroRank,
    #[error("lora.alpha must be positive, found {0}")]
    Alpha(f64),
    #[error("lora.dropout must be in [0, 1), found {0}")]
    Dropout(f64),
    #[error("lora.targets is empty")]
    NoTargets,
    #[error("lora.targets: `{0}` is not a projection of this model (its MLP has no gate)")]
    NoGate(Target),
    #[error(
        "lora.rank {rank} is larger than `{target}`'s smaller side ({}, of {d_in} × {d_out}): an adapter of \
         rank past min(in, out) adds memory, not capacity",
        d_in.min(d_out)
    )]
    RankPastShape { rank: usize, target: Target, d_in: usize, d_out: usize },
}

impl LoraConfig {
    pub fn validate(&self) -> Result<(), LoraError> {
        if self.rank == 0 {
            return Err(LoraError::ZeroRank);
        }
        if !(self.alpha > 0.0 && self.alpha.is_finite()) {
            return Err(LoraError::Alpha(self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(LoraError::Dropout(self.dropout));
        }
        if self.targets.is_empty() {
            return Err(LoraError::NoTargets);
        }
        Ok(())
    }

    /// Checks the targets against the model they adapt: a plain (GPT-2) MLP has no gate.
    pub fn validate_for(&self, model: &ModelConfig) -> Result<(), LoraError> {
        if let Some(&t) = self.targets.iter().find(|t| **t == Target::GateProj && !model.mlp.gated()) {
            return Err(LoraError::NoGate(t));
        }
        // A rank past a projection's smaller side adds parameters (and memory), never capacity:
        // `B·A` already reaches every matrix of that shape at min(in, out).
        let narrowest = self.targets.iter().map(|&t| (t, t.shape(model))).min_by_key(|(_, (i, o))| (*i).min(*o));
        match narrowest {
            Some((target, (d_in, d_out))) if self.rank > d_in.min(d_out) => {
                Err(LoraError::RankPastShape { rank: self.rank, target, d_in, d_out })
            }
            _ => Ok(()),
        }
    }

    /// Training FLOPs per token of `model` with these adapters and everything else frozen:
    /// `4N + 6·L·Σ r·(in + out) + 12·L·T·(H·Dh)`. The frozen weights take part in the forward
    /// product and the input gradient's, never in a weight gradient's, so that counting them 6N
    /// would put MFU above what the GEMMs do (over 100 %).
    pub fn train_flops_per_token(&self, model: &ModelConfig, seq_len: usize) -> f64 {
        let attention = 12.0 * model.n_layers as f64 * seq_len as f64 * (model.n_heads * model.head_dim()) as f64;
        let adapter: usize = self.targets.iter().map(|t| t.shape(model)).map(|(i, o)| self.rank * (i + o)).sum();
        4.0 * model.matmul_params() as f64 + 6.0 * (model.n_layers * adapter) as f64 + attention
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
    pub(crate) fn new(init: &mut Init, d_in: usize, d_out: usize, config: &LoraConfig, device: &B::Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        Self {
            lora_a: init.uniform_param([d_in, config.rank], bound, device),
            lora_b: const_param([config.rank, d_out], 0.0, device),
            scale: config.alpha / config.rank as f64,
            dropout: config.dropout,
        }
    }

    /// The update folded into a weight: `(α/r) · A · B`, `[in, out]`.
    pub(crate) fn delta(&self) -> Tensor<B, 2> {
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
    pub(crate) fn forward(&self, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        let compute = cx.dtype;
        let x = if self.dropout > 0.0 && B::ad_enabled(&x.device()) {
            let keep = 1.0 - self.dropout;
            x.clone() * x.random_like(Distribution::Bernoulli(keep)).div_scalar(keep)
        } else {
            x
        };
        let a = to_dtype(self.lora_a.val(), compute);
        let b = to_dtype(self.lora_b.val().mul_scalar(self.scale), compute);
        let u = linear(to_dtype(x, compute), a, None, cx); // [N, r]
        to_dtype(linear(u, b, None, cx), DType::F32)
    }
}

/// Whether the parameter at `path` belongs to an adapter (the `lora` field of a projection): the one
/// place that knows how adapters' parameters are named.
pub fn is_adapter(path: &str) -> bool {
    path.split('.').any(|p| p == "lora")
}

/// Marks every parameter outside the adapters as frozen (no gradient, not in the optimizer).
pub(crate) struct FreezeBase;

impl<B: Backend> PathMapper<B> for FreezeBase {
    fn map<const D: usize>(&mut self, path: &str, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if is_adapter(path) {
            return param;
        }
        param.set_require_grad(false)
    }
}

/// Makes trainable again what [`FreezeBase`] froze: every parameter but the experts' selection
/// bias (balanced by its own rule, never by gradients). Weights kept in their stored block types
/// have no parameter: they stay frozen.
pub(crate) struct ThawBase;

impl<B: Backend> PathMapper<B> for ThawBase {
    fn map<const D: usize>(&mut self, path: &str, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if path.ends_with("selection_bias") {
            return param;
        }
        param.set_require_grad(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_flops_count_the_frozen_base_4n_and_each_adapter_6r() {
        let c = ModelConfig { d_ff: 48, ..ModelConfig::tiny(37, 32) };
        let (n, t) = (c.matmul_params() as f64, 16);
        // LoRA r 4 on q and down: the base 4N, each adapter 6·r·(in + out) a layer.
        let (q, down) = (Target::QProj.shape(&c), Target::DownProj.shape(&c));
        assert_eq!(q, (c.d_model, c.n_heads * c.head_dim()));
        assert_eq!(down, (c.d_ff, c.d_model));
        let adapters = 6.0 * 2.0 * 4.0 * (q.0 + q.1 + down.0 + down.1) as f64;
        let lora = LoraConfig { rank: 4, alpha: 8.0, dropout: 0.0, targets: vec![Target::QProj, Target::DownProj] };
        assert_eq!(lora.train_flops_per_token(&c, t), 4.0 * n + adapters + 12.0 * 2.0 * 16.0 * 32.0);
        assert_eq!(lora.train_flops_per_token(&c, t), 3.0 * c.forward_flops_per_token(t) - 2.0 * n + adapters);
    }

    #[test]
    fn a_rank_past_the_narrowest_adapted_side_is_refused() {
        let c = ModelConfig { d_ff: 48, ..ModelConfig::tiny(37, 32) };
        let lora = |rank| LoraConfig { rank, alpha: 8.0, dropout: 0.0, targets: vec![Target::QProj, Target::DownProj] };
        let narrowest = c.d_model.min(c.d_ff).min(c.n_heads * c.head_dim());
        assert!(lora(narrowest).validate_for(&c).is_ok());
        let e = lora(1_000_000).validate_for(&c).unwrap_err().to_string();
        assert!(e.contains("lora.rank 1000000") && e.contains(&format!("smaller side ({narrowest}")), "{e}");
    }

    #[test]
    fn targets_are_spelled_as_hugging_face_names_them() {
        for t in Target::ALL {
            let toml = format!("rank = 2\nalpha = 4.0\ntargets = [\"{}\"]\n", t.name());
            let c: LoraConfig = toml::from_str(&toml).expect("a target by its name");
            assert_eq!(c.targets, [t]);
        }
        let e = toml::from_str::<LoraConfig>("rank = 2\nalpha = 4.0\ntargets = [\"qkv\"]\n").unwrap_err();
        assert!(e.to_string().contains("unknown variant `qkv`") && e.to_string().contains("q_proj"), "{e}");
    }
}
