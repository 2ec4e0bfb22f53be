//! A model's experts as its config names them, `[model.moe]`: their counts and widths, the
//! router's scoring, and what they cost.

use serde::{Deserialize, Serialize};

use crate::kinds::ConfigError;

/// A model's experts, `[model.moe]` (Hugging Face names in brackets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Experts per layer [num_local_experts; num_experts].
    pub n_experts: usize,
    /// Experts each token runs through [num_experts_per_tok].
    pub top_k: usize,
    /// Each expert's hidden width [moe_intermediate_size; Mixtral: intermediate_size].
    pub d_expert: usize,
    /// The `k` chosen scores renormalised to sum to one (Mixtral; Qwen3-MoE's checkpoints) or kept
    /// as the softmax gave them (Qwen2-MoE, OLMoE) [norm_topk_prob].
    #[serde(default)]
    pub norm_topk: bool,
    /// Hidden width of a shared expert every token runs through (Qwen2-MoE)
    /// [shared_expert_intermediate_size].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert: Option<usize>,
    /// The shared expert's output scaled by `sigmoid(x·g)` (Qwen2-MoE's `shared_expert_gate`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub shared_expert_gate: bool,
    /// Weight of the load-balancing loss `E · Σₑ fₑ·Pₑ` in the training loss [router_aux_loss_coef].
    #[serde(default = "default_aux")]
    pub aux_loss_coef: f64,
    /// Weight of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub z_loss_coef: f64,
    /// How the router's logits become scores: a softmax over the experts, or each its own sigmoid
    /// (DeepSeek-V3) [scoring_func].
    #[serde(default, skip_serializing_if = "is_default")]
    pub scoring: Scoring,
    /// A per-expert bias added to the scores for the choice only, not to the weights: DeepSeek-V3's
    /// auxiliary-loss-free balancing [e_score_correction_bias]. Not trained by the gradient.
    #[serde(default, skip_serializing_if = "is_false")]
    pub selection_bias: bool,
    /// Experts in this many equal groups, the choice limited to the best `top_groups` of them
    /// (DeepSeek's group-limited routing; a group's score is its best expert's with a softmax, the
    /// sum of its best two with sigmoid scores) [n_group].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<usize>,
    /// Groups a token's experts may come from [topk_group].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_groups: Option<usize>,
    /// The chosen weights multiplied by this (DeepSeek) [routed_scaling_factor].
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub routed_scale: f64,
    /// The first this-many layers keep the dense MLP of `d_ff` (DeepSeek) [first_k_dense_replace].
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub dense_layers: usize,
    /// With `selection_bias`: after every training step each expert's bias moves by this much
    /// towards an even load, up for the experts below the mean load and down for those above
    /// (DeepSeek-V3's auxiliary-loss-free balancing, its γ = 0.001). 0 leaves the biases as loaded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bias_update_rate: f64,
}

/// The fields a `[model.moe]` table may leave out, as serde fills them in (and no experts: a base
/// for struct updates, not a config that validates).
impl Default for MoeConfig {
    fn default() -> Self {
        Self {
            n_experts: 0,
            top_k: 0,
            d_expert: 0,
            norm_topk: false,
            shared_expert: None,
            shared_expert_gate: false,
            aux_loss_coef: default_aux(),
            z_loss_coef: 0.0,
            scoring: Scoring::default(),
            selection_bias: false,
            groups: None,
            top_groups: None,
            routed_scale: one(),
            dense_layers: 0,
            bias_update_rate: 0.0,
        }
    }
}

/// How a router scores the experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scoring {
    #[default]
    Softmax,
    Sigmoid,
}

fn one() -> f64 {
    1.0
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

fn is_zero_usize(x: &usize) -> bool {
    *x == 0
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

fn default_aux() -> f64 {
    0.01
}

fn is_false(x: &bool) -> bool {
    !*x
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Upper bound on `n_experts` (DeepSeek-V3 has 256 routed experts).
const MAX_EXPERTS: usize = 1 << 12;

/// Upper bound on an expert's width, as on `d_ff`: with `d_model` and `n_experts` bounded too, the
/// parameter counts below cannot overflow.
const MAX_WIDTH: usize = 1 << 20;

impl MoeConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let sizes = [("moe.n_experts", self.n_experts), ("moe.top_k", self.top_k), ("moe.d_expert", self.d_expert)];
        if let Some((name, _)) = sizes.into_iter().find(|&(_, v)| v == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        let widths = [("moe.d_expert", self.d_expert), ("moe.shared_expert", self.shared_expert.unwrap_or(0))];
        for (name, value, limit) in [("moe.n_experts", self.n_experts, MAX_EXPERTS)]
            .into_iter()
            .chain(widths.map(|(name, value)| (name, value, MAX_WIDTH)))
        {
            if value > limit {
                return Err(ConfigError::TooLarge { name, value: value as u64, limit: limit as u64 });
            }
        }
        if self.top_k > self.n_experts {
            return Err(ConfigError::Needs { key: "moe.top_k", needs: "a value no larger than moe.n_experts" });
        }
        if self.shared_expert == Some(0) {
            return Err(ConfigError::NotPositive { name: "moe.shared_expert", value: 0.0 });
        }
        if self.shared_expert_gate && self.shared_expert.is_none() {
            return Err(ConfigError::Needs { key: "moe.shared_expert_gate", needs: "moe.shared_expert" });
        }
        for (name, value) in [("moe.aux_loss_coef", self.aux_loss_coef), ("moe.z_loss_coef", self.z_loss_coef)] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(ConfigError::NotPositive { name, value });
            }
        }
        if !(self.bias_update_rate >= 0.0 && self.bias_update_rate.is_finite()) {
            return Err(ConfigError::NotPositive { name: "moe.bias_update_rate", value: self.bias_update_rate });
        }
        if self.bias_update_rate > 0.0 && !self.selection_bias {
            return Err(ConfigError::Needs { key: "moe.bias_update_rate", needs: "moe.selection_bias = true" });
        }
        if !(self.routed_scale > 0.0 && self.routed_scale.is_finite()) {
            return Err(ConfigError::NotPositive { name: "moe.routed_scale", value: self.routed_scale });
        }
        match (self.groups, self.top_groups) {
            (None, None) => {}
            (Some(_), None) => return Err(ConfigError::Needs { key: "moe.groups", needs: "moe.top_groups" }),
            (None, Some(_)) => return Err(ConfigError::Needs { key: "moe.top_groups", needs: "moe.groups" }),
            (Some(g), Some(top)) => {
                if g == 0 || top == 0 {
                    let name = if g == 0 { "moe.groups" } else { "moe.top_groups" };
                    return Err(ConfigError::NotPositive { name, value: 0.0 });
                }
                if !self.n_experts.is_multiple_of(g) {
                    return Err(ConfigError::NotDivisible {
                        divisor: "moe.groups",
                        divisor_value: g,
                        dividend: "moe.n_experts",
                        dividend_value: self.n_experts,
                    });
                }
                if top > g || top * (self.n_experts / g) < self.top_k {
                    return Err(ConfigError::Needs {
                        key: "moe.top_groups",
                        needs: "a value no larger than moe.groups whose groups hold at least moe.top_k experts",
                    });
                }
                if self.scoring == Scoring::Sigmoid && self.n_experts / g < 2 {
                    return Err(ConfigError::Needs {
                        key: "moe.groups",
                        needs: "groups of two experts or more with sigmoid scores (a group scores its best two)",
                    });
                }
            }
        }
        Ok(())
    }

    /// Parameters of one layer's part: the router `D·E`, the experts `3·E·D·F`, the shared expert
    /// and its gate, the selection bias.
    pub(crate) fn params(&self, d_model: usize) -> u64 {
        let (d, e, f) = (d_model as u64, self.n_experts as u64, self.d_expert as u64);
        let shared = self.shared_expert.map_or(0, |s| 3 * d * s as u64);
        let gate = if self.shared_expert_gate { d } else { 0 };
        let bias = if self.selection_bias { e } else { 0 };
        d * e + 3 * e * d * f + shared + gate + bias
    }

    /// Parameters one token multiplies by in one layer's part: the router, `k` experts, the shared
    /// expert and its gate (what FLOP counts take, not every expert's).
    pub(crate) fn active_params(&self, d_model: usize) -> u64 {
        let (d, k, f) = (d_model as u64, self.top_k as u64, self.d_expert as u64);
        let shared = self.shared_expert.map_or(0, |s| 3 * d * s as u64);
        let gate = if self.shared_expert_gate { d } else { 0 };
        d * self.n_experts as u64 + 3 * k * d * f + shared + gate
    }
}
