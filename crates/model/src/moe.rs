//! The mixture-of-experts feed-forward part (Shazeer et al., 2017; Mixtral, Qwen-MoE, OLMoE): a
//! linear router scores `E` SwiGLU experts per token, the top `k` run, and their outputs are added
//! weighted by the softmax scores (renormalised over the `k` where the family does). Routing is
//! dropless: every token reaches its `k` experts, whatever the load. An optional shared expert sees
//! every token, plain or behind a sigmoid gate (Qwen2-MoE).
//!
//! The experts' weights are stacked, `[E, D, F]` and `[E, F, D]`. The forward pass groups the
//! token-expert pairs by expert (a permutation read off the router's choices), runs one GEMM per
//! expert over its contiguous rows ([`ember_kernels::experts`], one graph node per stacked weight),
//! and adds the weighted rows back to their tokens; the backward pass is the same products
//! transposed, each weight's gradient one `[E, …]` tensor, the router's gradient flowing through the
//! gathered top-k weights. Experts no token chose are not read at all (decoding touches `k` of them).
//! [`Moe::forward_dense`] is the composition it is tested against: every expert over every token,
//! weighted by a dense `[N, E]` matrix that is zero outside the top k.

use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, silu, softmax};
use burn::tensor::{backend::Backend, DType, IndexingUpdateOp, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use ember_kernels::{experts, Compute, EmberBackend};

use crate::config::{positive_std, ConfigError, MlpKind};
use crate::dropout;
use crate::init::{const_param, Init};
use crate::linear::Linear;
use crate::lora::LoraConfig;
use crate::mlp::{Mlp, MlpConfig};
use crate::to_dtype;

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
pub(crate) const MAX_EXPERTS: usize = 1 << 12;

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

/// What a [`Moe`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MoePartConfig {
    pub d_model: usize,
    pub moe: MoeConfig,
    pub init_std: f64,
    pub out_std: f64,
}

impl MoePartConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.moe.validate()?;
        positive_std(self.init_std, self.out_std)
    }

    /// The part, its weights drawn from `init`: the router, the experts' gate, up and down weights,
    /// then the shared expert and its gate.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Moe<B> {
        let (d, m) = (self.d_model, &self.moe);
        let (e, f) = (m.n_experts, m.d_expert);
        let shared = m.shared_expert.map(|s| MlpConfig {
            d_model: d,
            d_ff: s,
            kind: MlpKind::Swiglu,
            bias: false,
            init_std: self.init_std,
            out_std: self.out_std,
        });
        Moe {
            router: Linear::new(init, d, e, false, self.init_std, device),
            gate: init.normal_param([e, d, f], self.init_std, device),
            up: init.normal_param([e, d, f], self.init_std, device),
            down: init.normal_param([e, f, d], self.out_std, device),
            shared: shared.map(|s| s.init(init, device)),
            shared_gate: m.shared_expert_gate.then(|| Linear::new(init, d, 1, false, self.init_std, device)),
            // Never differentiated: no optimizer (a sharded one included) takes it as trainable.
            selection_bias: m.selection_bias.then(|| const_param([e], 0.0, device).set_require_grad(false)),
            lora: None,
            top_k: m.top_k,
            norm_topk: m.norm_topk,
            scoring: m.scoring,
            groups: m.groups.zip(m.top_groups),
            routed_scale: m.routed_scale,
        }
    }
}

#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    /// `[D, E]` [Hugging Face: gate].
    pub router: Linear<B>,
    /// `[E, D, F]` [experts.{e}.gate_proj; Mixtral: w1].
    pub gate: Param<Tensor<B, 3>>,
    /// `[E, D, F]` [experts.{e}.up_proj; Mixtral: w3].
    pub up: Param<Tensor<B, 3>>,
    /// `[E, F, D]` [experts.{e}.down_proj; Mixtral: w2].
    pub down: Param<Tensor<B, 3>>,
    /// The expert every token runs through [shared_expert].
    pub shared: Option<Mlp<B>>,
    /// `[D, 1]` [shared_expert_gate].
    pub shared_gate: Option<Linear<B>>,
    /// `[E]`, added to the scores for the choice only [gate.e_score_correction_bias]. Not trainable
    /// (the choice is made on the host, no gradient reaches it): only the balancing update of
    /// `bias_update_rate` moves it.
    pub selection_bias: Option<Param<Tensor<B, 1>>>,
    /// Low-rank adapters of the experts' stacks, when fine-tuning them with LoRA.
    pub lora: Option<ExpertsLora<B>>,
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub norm_topk: bool,
    #[module(skip)]
    pub scoring: Scoring,
    /// `(groups, groups a token may use)`.
    #[module(skip)]
    pub groups: Option<(usize, usize)>,
    #[module(skip)]
    pub routed_scale: f64,
}

/// Low-rank adapters of a stack of experts: expert `e`'s weight `W_e` becomes
/// `W_e + (α/r)·A_e·B_e`, each expert its own `A_e` and `B_e` (PEFT's LoRA on every expert's
/// projection, stacked as the weights are).
#[derive(Module, Debug)]
pub struct StackLora<B: Backend> {
    /// `[E, in, r]`, uniform(±1/sqrt(in)) as PEFT's Kaiming-uniform default.
    pub lora_a: Param<Tensor<B, 3>>,
    /// `[E, r, out]`, zeros.
    pub lora_b: Param<Tensor<B, 3>>,
    #[module(skip)]
    pub scale: f64,
    #[module(skip)]
    pub dropout: f64,
}

impl<B: Backend> StackLora<B> {
    pub(crate) fn new(init: &mut Init, [e, d_in, d_out]: [usize; 3], config: &LoraConfig, device: &B::Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        Self {
            lora_a: init.uniform_param([e, d_in, config.rank], bound, device),
            lora_b: const_param([e, config.rank, d_out], 0.0, device),
            scale: config.alpha / config.rank as f64,
            dropout: config.dropout,
        }
    }

    /// The update folded into the stack: `(α/r)·A_e·B_e` per expert, `[E, in, out]`, f32.
    pub fn delta(&self) -> Tensor<B, 3> {
        let (a, b) = (to_dtype(self.lora_a.val(), DType::F32), to_dtype(self.lora_b.val(), DType::F32));
        a.matmul(b).mul_scalar(self.scale)
    }
}

/// The adapters of a mixture's three stacks (those the LoRA targets name: `gate_proj`, `up_proj`,
/// `down_proj`).
#[derive(Module, Debug)]
pub struct ExpertsLora<B: Backend> {
    pub gate: Option<StackLora<B>>,
    pub up: Option<StackLora<B>>,
    pub down: Option<StackLora<B>>,
}

/// One layer's routing, for the auxiliary losses and the load metrics.
#[derive(Debug, Clone)]
pub struct Route<B: Backend> {
    /// Every token's router probabilities summed over the tokens, `[E]` (differentiable).
    pub prob_sum: Tensor<B, 1>,
    /// Squared log-sum-exp of the router logits summed over the tokens, `[1]` (differentiable).
    pub z_sum: Tensor<B, 1>,
    /// Token-expert pairs each expert received.
    pub counts: Vec<u32>,
    /// Tokens routed.
    pub tokens: usize,
}

/// The router's choice for `N` tokens: their experts, and each pair's weight.
struct Choice<B: Backend> {
    /// `[N, k]` expert indices, as read back on the host, row by row.
    experts: Vec<usize>,
    /// The same indices on the device.
    ids: Tensor<B, 2, Int>,
    /// `[N, k]` weights (differentiable).
    weights: Tensor<B, 2>,
    route: Route<B>,
}

impl<B: EmberBackend> Moe<B> {
    pub fn n_experts(&self) -> usize {
        self.gate.dims()[0]
    }

    /// Scores, top-k choice and weights of `x`'s tokens (`[N, D]`).
    fn choose(&self, x: Tensor<B, 2>, cx: Compute) -> Choice<B> {
        let [n, _] = x.dims();
        let (e, k) = (self.n_experts(), self.top_k);
        let logits = self.router.forward(x, cx); // [N, E], f32
        let scores = match self.scoring {
            Scoring::Softmax => softmax(logits.clone(), 1),
            Scoring::Sigmoid => sigmoid(logits.clone()),
        };
        // The choice is made on the host from the scores' values (plus the selection bias; ties
        // to the lower index, as torch.topk on CPU), then the weights gathered on the device so
        // that the gradient reaches the router through them.
        let host = |t: Tensor<B, 1>| t.into_data().convert::<f32>().into_vec().unwrap_or_default();
        let values: Vec<f32> = host(scores.clone().reshape([n * e]));
        let bias: Vec<f32> = self.selection_bias.as_ref().map_or_else(|| vec![0.0; e], |b| host(b.val()));
        let mut experts = Vec::with_capacity(n * k);
        let mut counts = vec![0u32; e];
        let mut order: Vec<usize> = (0..e).collect();
        let mut biased = vec![0f32; e];
        for row in values.chunks_exact(e) {
            for (j, b) in biased.iter_mut().enumerate() {
                *b = row[j] + bias[j];
            }
            if let Some((groups, top)) = self.groups {
                self.mask_groups(&mut biased, groups, top);
            }
            order.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
            for &j in &order[..k] {
                experts.push(j);
                counts[j] += 1;
            }
        }
        let device = scores.device();
        let ids: Vec<i32> = experts.iter().map(|&j| j as i32).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, k]), &device);
        let weights = scores.clone().gather(1, ids.clone()); // [N, k]
        let weights = if self.norm_topk { weights.clone() / (weights.sum_dim(1) + 1e-20) } else { weights };
        let weights = if self.routed_scale == 1.0 { weights } else { weights * self.routed_scale };
        // log Σ exp, shifted by each row's largest logit (no overflow).
        let top = logits.clone().max_dim(1).detach(); // [N, 1]
        let lse = (logits - top.clone()).exp().sum_dim(1).log() + top; // [N, 1]
        let z_sum = lse.powf_scalar(2.0).sum().reshape([1]);
        // The balancing loss's probabilities: sigmoid scores normalised per token (DeepSeek-V3's).
        let probs = match self.scoring {
            Scoring::Softmax => scores,
            Scoring::Sigmoid => scores.clone() / scores.sum_dim(1),
        };
        let route = Route { prob_sum: probs.sum_dim(0).reshape([e]), z_sum, counts, tokens: n };
        Choice { experts, ids, weights, route }
    }

    /// Group-limited routing: the scores of every expert outside the `top` best of `groups` equal
    /// groups set to −∞. A group scores its best expert with a softmax (DeepSeek-V2), the sum of its
    /// best two with sigmoid scores (DeepSeek-V3).
    fn mask_groups(&self, scores: &mut [f32], groups: usize, top: usize) {
        let size = scores.len() / groups;
        let group_score = |g: &[f32]| match self.scoring {
            Scoring::Softmax => g.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            Scoring::Sigmoid => {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &x in g {
                    if x > a {
                        (a, b) = (x, a);
                    } else if x > b {
                        b = x;
                    }
                }
                a + b
            }
        };
        let best: Vec<f32> = scores.chunks_exact(size).map(group_score).collect();
        let mut order: Vec<usize> = (0..groups).collect();
        order.sort_by(|&a, &b| best[b].total_cmp(&best[a]).then(a.cmp(&b)));
        for &g in &order[top..] {
            scores[g * size..(g + 1) * size].fill(f32::NEG_INFINITY);
        }
    }

    /// The part's output, its routing.
    ///
    /// # Shapes
    /// - x: `[N, D]` -> `[N, D]`
    pub(crate) fn forward(&self, x: Tensor<B, 2>, cx: Compute) -> (Tensor<B, 2>, Route<B>) {
        let [n, d] = x.dims();
        let (e, k) = (self.n_experts(), self.top_k);
        let choice = self.choose(x.clone(), cx);
        // The pairs in expert order: `pairs[i]` is pair `token·k + slot`.
        let mut starts = vec![0usize; e + 1];
        for &j in &choice.experts {
            starts[j + 1] += 1;
        }
        for j in 0..e {
            starts[j + 1] += starts[j];
        }
        let mut next = starts.clone();
        let mut pairs = vec![0usize; n * k];
        for (p, &j) in choice.experts.iter().enumerate() {
            pairs[next[j]] = p;
            next[j] += 1;
        }
        let device = x.device();
        let index = |v: Vec<i32>| {
            let len = v.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [len]), &device)
        };
        let tokens = index(pairs.iter().map(|&p| (p / k) as i32).collect());
        let rows = to_dtype(x.clone().select(0, tokens.clone()), cx.dtype); // [N·k, D], grouped
        let weight = |w: &Param<Tensor<B, 3>>| to_dtype(w.val(), cx.dtype);
        // Each stack's grouped product, plus its adapter's `(α/r)·(x·A_e)·B_e` through the same
        // grouping (the frozen stack takes no weight gradient).
        let product = |rows: Tensor<B, 2>, w: &Param<Tensor<B, 3>>, lora: Option<&StackLora<B>>| {
            let y = experts(rows.clone(), weight(w), &starts, cx);
            let Some(l) = lora else { return y };
            let low = experts(dropout(rows, l.dropout), to_dtype(l.lora_a.val(), cx.dtype), &starts, cx);
            y + experts(low, to_dtype(l.lora_b.val(), cx.dtype), &starts, cx).mul_scalar(l.scale)
        };
        let lora = self.lora.as_ref();
        let gate = product(rows.clone(), &self.gate, lora.and_then(|l| l.gate.as_ref()));
        let hidden = silu(gate) * product(rows, &self.up, lora.and_then(|l| l.up.as_ref())); // [N·k, F]
        let y = product(hidden, &self.down, lora.and_then(|l| l.down.as_ref()));
        let y = to_dtype(y, DType::F32); // [N·k, D]
        let weights = choice.weights.reshape([n * k]).select(0, index(pairs.iter().map(|&p| p as i32).collect()));
        let y = y * weights.unsqueeze_dim(1);
        let out = Tensor::<B, 2>::zeros([n, d], &device).select_assign(0, tokens, y, IndexingUpdateOp::Add);
        (self.add_shared(out, x, cx), choice.route)
    }

    /// [`Self::forward`] as the dense composition: every expert over every token, each output
    /// weighted by the token's weight for it (zero outside its top k). The reference the grouped
    /// forward is tested against.
    ///
    /// # Shapes
    /// - x: `[N, D]` -> `[N, D]`
    pub fn forward_dense(&self, x: Tensor<B, 2>, cx: Compute) -> (Tensor<B, 2>, Route<B>) {
        let [n, d] = x.dims();
        let e = self.n_experts();
        let choice = self.choose(x.clone(), cx);
        let device = x.device();
        let dense =
            Tensor::<B, 2>::zeros([n, e], &device).scatter(1, choice.ids, choice.weights, IndexingUpdateOp::Add);
        let mut out = Tensor::<B, 2>::zeros([n, d], &device);
        for j in 0..e {
            // Expert j's weights, `[D, F]`, `[D, F]`, `[F, D]`, sliced out of the stacks, each plus
            // its adapter's `(α/r)·A_j·B_j`.
            let take = |w: &Param<Tensor<B, 3>>, lora: Option<&StackLora<B>>| {
                let [_, a, b] = w.dims();
                let w = to_dtype(w.val().slice(j..j + 1).reshape([a, b]), DType::F32);
                match lora {
                    Some(l) => {
                        let r = l.lora_a.dims()[2];
                        let a_j = to_dtype(l.lora_a.val().slice(j..j + 1).reshape([a, r]), DType::F32);
                        let b_j = to_dtype(l.lora_b.val().slice(j..j + 1).reshape([r, b]), DType::F32);
                        w + a_j.matmul(b_j).mul_scalar(l.scale)
                    }
                    None => w,
                }
            };
            let lora = self.lora.as_ref();
            let w_gate = take(&self.gate, lora.and_then(|l| l.gate.as_ref()));
            let w_up = take(&self.up, lora.and_then(|l| l.up.as_ref()));
            let w_down = take(&self.down, lora.and_then(|l| l.down.as_ref()));
            let hidden = silu(x.clone().matmul(w_gate)) * x.clone().matmul(w_up);
            out = out + hidden.matmul(w_down) * dense.clone().slice([0..n, j..j + 1]);
        }
        (self.add_shared(out, x, cx), choice.route)
    }

    /// Whether any stack carries an adapter.
    pub fn has_lora(&self) -> bool {
        self.lora.as_ref().is_some_and(|l| l.gate.is_some() || l.up.is_some() || l.down.is_some())
    }

    /// Folds the stacks' adapters into their weights and drops them.
    pub fn merge_lora(mut self) -> Self {
        let Some(lora) = self.lora.take() else { return self };
        let fold = |w: Param<Tensor<B, 3>>, l: Option<StackLora<B>>| match l {
            Some(l) => w.map(|t| {
                let (dtype, require_grad) = (t.dtype(), t.is_require_grad());
                let merged = to_dtype((to_dtype(t, DType::F32) + l.delta()).detach(), dtype);
                if require_grad {
                    merged.require_grad()
                } else {
                    merged
                }
            }),
            None => w,
        };
        self.gate = fold(self.gate, lora.gate);
        self.up = fold(self.up, lora.up);
        self.down = fold(self.down, lora.down);
        self
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing step: each expert's selection bias moves by
    /// `rate` up where its share of the token-expert pairs (`load`, summing to one) is below the
    /// mean `1/E`, down where it is above, not at all where it is equal.
    pub fn balance_selection_bias(&mut self, load: &[f64], rate: f64) {
        let Some(bias) = self.selection_bias.take() else { return };
        let e = load.len() as f64;
        let step: Vec<f32> = load
            .iter()
            .map(|&l| match (1.0 / e - l).partial_cmp(&0.0) {
                Some(std::cmp::Ordering::Greater) => rate as f32,
                Some(std::cmp::Ordering::Less) => -rate as f32,
                _ => 0.0,
            })
            .collect();
        let n = step.len();
        self.selection_bias = Some(bias.map(|b| {
            let step = Tensor::<B, 1>::from_data(TensorData::new(step, [n]), &b.device());
            b.detach() + step
        }));
    }

    /// `out` plus the shared expert's output where the part has one (times its sigmoid gate).
    fn add_shared(&self, out: Tensor<B, 2>, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        let Some(shared) = &self.shared else { return out };
        let y = shared.forward(x.clone(), cx);
        let y = match &self.shared_gate {
            Some(gate) => y * sigmoid(gate.forward(x, cx)),
            None => y,
        };
        out + y
    }
}

/// The load-balancing loss over every layer's routing, as Hugging Face's
/// `load_balancing_loss_func` computes it over the layers' router logits concatenated:
/// `E · Σₑ fₑ·Pₑ`, `fₑ` the pairs expert `e` received over all layers' `L·N` tokens (a fraction
/// per top-k slot, summed over the slots) and `Pₑ` its mean router probability. `fₑ` is a count, so
/// the gradient flows through `Pₑ` alone. `None` without routing.
pub fn load_balancing_loss<B: Backend>(routes: &[Route<B>]) -> Option<Tensor<B, 1>> {
    let first = routes.first()?;
    let e = first.counts.len();
    let tokens: usize = routes.iter().map(|r| r.tokens).sum();
    let mut counts = vec![0f64; e];
    for r in routes {
        for (c, &n) in counts.iter_mut().zip(&r.counts) {
            *c += n as f64;
        }
    }
    let scale = e as f64 / (tokens as f64 * tokens as f64);
    let weights: Vec<f32> = counts.iter().map(|&c| (c * scale) as f32).collect();
    let weights = Tensor::<B, 1>::from_data(TensorData::new(weights, [e]), &first.prob_sum.device());
    let probs = routes.iter().map(|r| r.prob_sum.clone()).reduce(|a, b| a + b)?;
    Some((probs * weights).sum())
}

/// The router z-loss over every layer's routing: the mean over the layers' tokens of the squared
/// log-sum-exp of the router logits. `None` without routing.
pub fn router_z_loss<B: Backend>(routes: &[Route<B>]) -> Option<Tensor<B, 1>> {
    let tokens: usize = routes.iter().map(|r| r.tokens).sum();
    let sum = routes.iter().map(|r| r.z_sum.clone()).reduce(|a, b| a + b)?;
    Some(sum.div_scalar(tokens.max(1) as f64))
}

/// Each layer's expert load: the fraction of its token-expert pairs each expert received.
pub fn expert_load<B: Backend>(routes: &[Route<B>]) -> Vec<Vec<f64>> {
    routes
        .iter()
        .map(|r| {
            let total = r.counts.iter().map(|&c| c as f64).sum::<f64>().max(1.0);
            r.counts.iter().map(|&c| c as f64 / total).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::activation::sigmoid as sigmoid_fn;
    use burn::tensor::{Distribution, Tolerance};

    type AB = Autodiff<Flex>;

    fn part(shared: bool, norm_topk: bool) -> Moe<AB> {
        let moe = MoeConfig {
            n_experts: 5,
            top_k: 2,
            d_expert: 6,
            norm_topk,
            shared_expert: shared.then_some(7),
            shared_expert_gate: shared,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            ..Default::default()
        };
        let config = MoePartConfig { d_model: 8, moe, init_std: 0.3, out_std: 0.3 };
        config.validate().unwrap();
        config.init(&mut Init::new(3), &Default::default())
    }

    #[test]
    fn grouped_experts_equal_the_dense_composition_with_every_gradient() {
        for (shared, norm_topk) in [(false, true), (true, false)] {
            let moe = part(shared, norm_topk);
            let x = Tensor::<AB, 2>::random([11, 8], Distribution::Normal(0.0, 1.0), &Default::default());
            let grads = |dense: bool| {
                let x = x.clone().detach().require_grad();
                let (y, route) = if dense {
                    moe.forward_dense(x.clone(), Compute::default())
                } else {
                    moe.forward(x.clone(), Compute::default())
                };
                let aux = load_balancing_loss(&[route]).unwrap();
                let loss = (y.clone() * y.clone()).sum() + aux;
                let g = loss.backward();
                let take2 = |t: &Tensor<AB, 2>| t.grad(&g).unwrap().into_data();
                let take3 = |p: &Param<Tensor<AB, 3>>| p.val().grad(&g).unwrap().into_data();
                (
                    y.into_data(),
                    vec![
                        take2(&x),
                        take2(&moe.router.weight.val()),
                        take3(&moe.gate),
                        take3(&moe.up),
                        take3(&moe.down),
                    ],
                )
            };
            let (y_dense, g_dense) = grads(true);
            let (y, g) = grads(false);
            y.assert_approx_eq::<f32>(&y_dense, Tolerance::absolute(1e-5));
            for (a, b) in g.iter().zip(&g_dense) {
                a.assert_approx_eq::<f32>(b, Tolerance::absolute(1e-4));
            }
        }
    }

    /// DeepSeek-V3's router: sigmoid scores, a selection bias, 4 groups of 2 of which the best 2
    /// (by the sum of their best two biased scores) may be chosen from, weights renormalised and
    /// scaled by 2.5; DeepSeek-V2's: softmax, groups scored by their best expert, not renormalised.
    fn deepseek_part(sigmoid: bool) -> Moe<AB> {
        let moe = MoeConfig {
            n_experts: 8,
            top_k: 3,
            d_expert: 6,
            norm_topk: sigmoid,
            shared_expert: Some(5),
            shared_expert_gate: false,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            scoring: if sigmoid { Scoring::Sigmoid } else { Scoring::Softmax },
            selection_bias: sigmoid,
            groups: Some(4),
            top_groups: Some(2),
            routed_scale: if sigmoid { 2.5 } else { 1.5 },
            dense_layers: 0,
            bias_update_rate: 0.0,
        };
        let config = MoePartConfig { d_model: 8, moe, init_std: 0.5, out_std: 0.3 };
        config.validate().unwrap();
        let mut part: Moe<AB> = config.init(&mut Init::new(4), &Default::default());
        // Not trainable: an optimizer that lays out every trainable parameter (ZeRO's) leaves it out.
        assert!(part.selection_bias.as_ref().is_none_or(|b| !b.val().is_require_grad()));
        if sigmoid {
            let bias = Tensor::random([8], Distribution::Uniform(-0.3, 0.3), &Default::default());
            part.selection_bias = Some(Param::from_tensor(bias));
        }
        part
    }

    /// The choice written out per token, as transformers' DeepSeek routers make it.
    fn deepseek_choice(scores: &[f32], bias: &[f32], sigmoid: bool, k: usize) -> Vec<(usize, f32)> {
        let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let group_score = |g: usize| {
            let mut v = biased[2 * g..2 * g + 2].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            if sigmoid {
                v[0] + v[1]
            } else {
                v[0]
            }
        };
        let mut groups: Vec<usize> = (0..4).collect();
        groups.sort_by(|&a, &b| group_score(b).total_cmp(&group_score(a)));
        let mut allowed: Vec<usize> = groups[..2].iter().flat_map(|&g| [2 * g, 2 * g + 1]).collect();
        allowed.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]));
        let chosen = &allowed[..k];
        let sum: f32 = chosen.iter().map(|&j| scores[j]).sum();
        let (norm, scale) = if sigmoid { (sum + 1e-20, 2.5) } else { (1.0, 1.5) };
        chosen.iter().map(|&j| (j, scores[j] / norm * scale)).collect()
    }

    #[test]
    fn deepseek_routing_chooses_and_weighs_as_written_out() {
        for sigmoid in [true, false] {
            let moe = deepseek_part(sigmoid);
            let x = Tensor::<AB, 2>::random([17, 8], Distribution::Normal(0.0, 1.0), &Default::default());
            let logits = moe.router.forward(x.clone(), Compute::default());
            let scores = if sigmoid { sigmoid_fn(logits) } else { softmax(logits, 1) };
            let scores = scores.into_data().to_vec::<f32>().unwrap();
            let bias = match &moe.selection_bias {
                Some(b) => b.val().into_data().to_vec::<f32>().unwrap(),
                None => vec![0.0; 8],
            };
            let choice = moe.choose(x.clone(), Compute::default());
            let weights = choice.weights.into_data().to_vec::<f32>().unwrap();
            for (n, row) in scores.chunks_exact(8).enumerate() {
                let want = deepseek_choice(row, &bias, sigmoid, 3);
                let mut got: Vec<(usize, f32)> =
                    (0..3).map(|i| (choice.experts[3 * n + i], weights[3 * n + i])).collect();
                got.sort_by_key(|&(j, _)| j);
                let mut want = want;
                want.sort_by_key(|&(j, _)| j);
                for ((gj, gw), (wj, ww)) in got.iter().zip(&want) {
                    assert_eq!(gj, wj, "token {n}: experts");
                    assert!((gw - ww).abs() < 1e-5, "token {n}: weight {gw} vs {ww}");
                }
            }
            // The grouped kernel equals the dense composition for this router too, gradients included.
            let run = |dense: bool| {
                let x = x.clone().detach().require_grad();
                let (y, route) = if dense {
                    moe.forward_dense(x.clone(), Compute::default())
                } else {
                    moe.forward(x.clone(), Compute::default())
                };
                let loss = (y.clone() * y.clone()).sum() + load_balancing_loss(&[route]).unwrap();
                let g = loss.backward();
                // The selection bias only chooses: no gradient reaches it, so no optimizer moves it.
                assert!(moe.selection_bias.as_ref().is_none_or(|b| b.val().grad(&g).is_none()));
                (y.into_data(), x.grad(&g).unwrap().into_data(), moe.router.weight.val().grad(&g).unwrap().into_data())
            };
            let (a, b) = (run(false), run(true));
            a.0.assert_approx_eq::<f32>(&b.0, Tolerance::absolute(1e-5));
            a.1.assert_approx_eq::<f32>(&b.1, Tolerance::absolute(1e-4));
            a.2.assert_approx_eq::<f32>(&b.2, Tolerance::absolute(1e-4));
        }
    }

    #[test]
    fn adapters_on_the_stacks_equal_the_composition_and_merge_into_the_weights() {
        let mut moe = deepseek_part(true);
        let config = LoraConfig { rank: 2, alpha: 6.0, dropout: 0.0, targets: Vec::new() };
        let mut init = Init::new(9);
        let dev = Default::default();
        let mut stack = |shape: [usize; 3]| {
            let mut l = StackLora::<AB>::new(&mut init, shape, &config, &dev);
            let b = Tensor::random([shape[0], 2, shape[2]], Distribution::Normal(0.0, 0.5), &dev);
            l.lora_b = Param::from_tensor(b); // B non-zero: the adapters change the part
            l
        };
        // Adapters on the gate and down stacks, none on the up one.
        moe.lora = Some(ExpertsLora { gate: Some(stack([8, 8, 6])), up: None, down: Some(stack([8, 6, 8])) });
        assert!(moe.has_lora());
        let x = Tensor::<AB, 2>::random([13, 8], Distribution::Normal(0.0, 1.0), &dev);
        let run = |dense: bool| {
            let x = x.clone().detach().require_grad();
            let (y, _) = if dense {
                moe.forward_dense(x.clone(), Compute::default())
            } else {
                moe.forward(x.clone(), Compute::default())
            };
            let g = (y.clone() * y.clone()).sum().backward();
            let lora = moe.lora.as_ref().unwrap();
            let take = |p: &Param<Tensor<AB, 3>>| p.val().grad(&g).unwrap().into_data();
            let (gate, down) = (lora.gate.as_ref().unwrap(), lora.down.as_ref().unwrap());
            (y.into_data(), vec![take(&gate.lora_a), take(&gate.lora_b), take(&down.lora_a), take(&down.lora_b)])
        };
        let ((y, g), (y_ref, g_ref)) = (run(false), run(true));
        y.assert_approx_eq::<f32>(&y_ref, Tolerance::absolute(1e-5));
        for (a, b) in g.iter().zip(&g_ref) {
            // Relative to the tensor's largest gradient (they reach the hundreds): f32 sums in
            // another order.
            let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(diff <= 1e-5 * scale, "adapter gradient {diff} off (up to {scale})");
        }
        let merged = moe.clone().merge_lora();
        assert!(!merged.has_lora());
        let (a, _) = merged.forward(x.clone(), Compute::default());
        let (b, _) = moe.forward(x, Compute::default());
        a.into_data().assert_approx_eq::<f32>(&b.into_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn the_selection_bias_moves_towards_an_even_load() {
        let mut moe = deepseek_part(true);
        let bias = |m: &Moe<AB>| m.selection_bias.as_ref().unwrap().val().into_data().to_vec::<f32>().unwrap();
        let before = bias(&moe);
        moe.balance_selection_bias(&[0.5, 0.125, 0.0, 0.125, 0.125, 0.125, 0.0, 0.125], 0.01);
        let moved: Vec<f32> =
            bias(&moe).iter().zip(&before).map(|(a, b)| ((a - b) * 1000.0).round() / 1000.0).collect();
        assert_eq!(moved, [-0.01, 0.0, 0.01, 0.0, 0.0, 0.0, 0.01, 0.0]);
    }

    #[test]
    fn routing_counts_and_the_balancing_loss_follow_the_choice() {
        let moe = part(false, true);
        let x = Tensor::<AB, 2>::random([13, 8], Distribution::Normal(0.0, 1.0), &Default::default());
        let (_, route) = moe.forward(x, Compute::default());
        assert_eq!(route.counts.iter().sum::<u32>(), 26, "two experts a token, none dropped");
        assert_eq!(route.tokens, 13);
        // A perfectly even router (every probability 1/E) scores k: E · Σ (count/N) · (1/E).
        let even = Route::<AB> {
            prob_sum: Tensor::full([5], 13.0 / 5.0, &Default::default()),
            z_sum: Tensor::zeros([1], &Default::default()),
            counts: route.counts.clone(),
            tokens: 13,
        };
        let aux: f32 = load_balancing_loss(&[even.clone(), even]).unwrap().into_scalar();
        assert!((aux - 2.0).abs() < 1e-5, "{aux}");
        let load = expert_load(&[route]);
        assert!((load[0].iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let good = part(false, false);
        drop(good);
        let base = MoeConfig {
            n_experts: 4,
            top_k: 2,
            d_expert: 8,
            norm_topk: false,
            shared_expert: None,
            shared_expert_gate: false,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            ..Default::default()
        };
        let err = |c: MoeConfig| c.validate().unwrap_err().to_string();
        assert!(err(MoeConfig { top_k: 5, ..base.clone() }).contains("moe.top_k"));
        assert!(err(MoeConfig { n_experts: 0, ..base.clone() }).contains("moe.n_experts"));
        assert!(err(MoeConfig { shared_expert_gate: true, ..base.clone() }).contains("moe.shared_expert_gate"));
        assert!(err(MoeConfig { aux_loss_coef: f64::NAN, ..base.clone() }).contains("moe.aux_loss_coef"));
        assert!(err(MoeConfig { d_expert: 1 << 21, ..base.clone() }).contains("moe.d_expert"));
        assert!(err(MoeConfig { shared_expert: Some(1 << 21), ..base.clone() }).contains("moe.shared_expert"));
        assert!(err(MoeConfig { n_experts: 1 << 13, ..base }).contains("moe.n_experts"));
    }
}
