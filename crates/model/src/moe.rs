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
use crate::init::Init;
use crate::linear::Linear;
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
        Ok(())
    }

    /// Parameters of one layer's part: the router `D·E`, the experts `3·E·D·F`, the shared expert
    /// and its gate.
    pub(crate) fn params(&self, d_model: usize) -> u64 {
        let (d, e, f) = (d_model as u64, self.n_experts as u64, self.d_expert as u64);
        let shared = self.shared_expert.map_or(0, |s| 3 * d * s as u64);
        let gate = if self.shared_expert_gate { d } else { 0 };
        d * e + 3 * e * d * f + shared + gate
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
            top_k: m.top_k,
            norm_topk: m.norm_topk,
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
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub norm_topk: bool,
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
        let probs = softmax(logits.clone(), 1);
        // The choice is made on the host from the probabilities' values (ties to the lower index,
        // as torch.topk on CPU), then the weights gathered on the device so that the gradient
        // reaches the router through them.
        let values: Vec<f32> = probs.clone().into_data().convert::<f32>().into_vec().unwrap_or_default();
        let mut experts = Vec::with_capacity(n * k);
        let mut counts = vec![0u32; e];
        let mut order: Vec<usize> = (0..e).collect();
        for row in values.chunks_exact(e) {
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &j in &order[..k] {
                experts.push(j);
                counts[j] += 1;
            }
        }
        let device = probs.device();
        let ids: Vec<i32> = experts.iter().map(|&j| j as i32).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, k]), &device);
        let weights = probs.clone().gather(1, ids.clone()); // [N, k]
        let weights = if self.norm_topk { weights.clone() / weights.sum_dim(1) } else { weights };
        // log Σ exp, shifted by each row's largest logit (no overflow).
        let top = logits.clone().max_dim(1).detach(); // [N, 1]
        let lse = (logits - top.clone()).exp().sum_dim(1).log() + top; // [N, 1]
        let z_sum = lse.powf_scalar(2.0).sum().reshape([1]);
        let route = Route { prob_sum: probs.sum_dim(0).reshape([e]), z_sum, counts, tokens: n };
        Choice { experts, ids, weights, route }
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
        let gate = experts(rows.clone(), weight(&self.gate), &starts, cx);
        let hidden = silu(gate) * experts(rows, weight(&self.up), &starts, cx); // [N·k, F]
        let y = to_dtype(experts(hidden, weight(&self.down), &starts, cx), DType::F32); // [N·k, D]
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
            // Expert j's weights, `[D, F]`, `[D, F]`, `[F, D]`, sliced out of the stacks.
            let take = |w: &Param<Tensor<B, 3>>| {
                let [_, a, b] = w.dims();
                to_dtype(w.val().slice(j..j + 1).reshape([a, b]), DType::F32)
            };
            let (w_gate, w_up, w_down) = (take(&self.gate), take(&self.up), take(&self.down));
            let hidden = silu(x.clone().matmul(w_gate)) * x.clone().matmul(w_up);
            out = out + hidden.matmul(w_down) * dense.clone().slice([0..n, j..j + 1]);
        }
        (self.add_shared(out, x, cx), choice.route)
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
