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

use ember_kernels::{experts, Compute, EmberBackend};

use crate::dropout;
use crate::init::{const_param, Init};
use crate::kinds::{positive_std, ConfigError, MlpKind, PartConfig, Target};
use crate::linear::Linear;
use crate::lora::LoraConfig;
use crate::mlp::{Mlp, MlpConfig};
use crate::to_dtype;

mod config;
mod losses;
#[cfg(test)]
mod tests;

pub use config::{MoeConfig, Scoring};
pub use losses::{expert_load, load_balancing_loss, router_z_loss};

/// What a [`Moe`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MoePartConfig {
    pub d_model: usize,
    pub moe: MoeConfig,
    pub init_std: f64,
    pub out_std: f64,
}

impl MoePartConfig {
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

impl PartConfig for MoePartConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.moe.validate()?;
        positive_std(self.init_std, self.out_std)
    }

    /// Its parameters: every expert's, the router's, the shared expert's.
    fn params(&self) -> u64 {
        self.moe.params(self.d_model)
    }

    /// Weights a token multiplies by: the router, `k` experts, the shared expert.
    fn matmul_params(&self) -> u64 {
        self.moe.active_params(self.d_model)
    }

    /// `(in, out)` of each expert's projection `target` names (an MLP target adapts every expert).
    fn projection(&self, target: Target) -> Option<(usize, usize)> {
        let (d, f) = (self.d_model, self.moe.d_expert);
        match target {
            Target::GateProj | Target::UpProj => Some((d, f)),
            Target::DownProj => Some((f, d)),
            _ => None,
        }
    }

    /// The f32 values autodiff keeps per token: the router's logits and scores (2E); for each of
    /// the `k` experts the token runs through, its gathered input row, gate, up, activation and
    /// product and its weighted output (2D + 4F); the shared expert's, as an MLP's (4F + D); and the
    /// part's output (D).
    fn activations(&self, _seq_len: usize) -> u64 {
        let m = &self.moe;
        let (d, e, k, f) = (self.d_model as u64, m.n_experts as u64, m.top_k as u64, m.d_expert as u64);
        let shared = m.shared_expert.map_or(0, |s| 4 * s as u64 + d);
        2 * e + k * (2 * d + 4 * f) + shared + d
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
    pub(crate) fn delta(&self) -> Tensor<B, 3> {
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
    /// `[N, k]` weights (differentiable).
    weights: Tensor<B, 2>,
    route: Route<B>,
}

impl<B: EmberBackend> Moe<B> {
    pub(crate) fn n_experts(&self) -> usize {
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
        Choice { experts, weights, route }
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
    #[cfg(test)]
    pub(crate) fn forward_dense(&self, x: Tensor<B, 2>, cx: Compute) -> (Tensor<B, 2>, Route<B>) {
        let [n, d] = x.dims();
        let e = self.n_experts();
        let choice = self.choose(x.clone(), cx);
        let device = x.device();
        let k = choice.experts.len() / n.max(1);
        let ids: Vec<i32> = choice.experts.iter().map(|&j| j as i32).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, k]), &device);
        let dense = Tensor::<B, 2>::zeros([n, e], &device).scatter(1, ids, choice.weights, IndexingUpdateOp::Add);
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
    pub(crate) fn has_lora(&self) -> bool {
        self.lora.as_ref().is_some_and(|l| l.gate.is_some() || l.up.is_some() || l.down.is_some())
    }

    /// Folds the stacks' adapters into their weights and drops them.
    pub(crate) fn merge_lora(mut self) -> Self {
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
    pub(crate) fn balance_selection_bias(&mut self, load: &[f64], rate: f64) {
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
