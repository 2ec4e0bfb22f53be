//! The decoder: token embedding (scaled by `sqrt(D)` in Gemma; plus a learned position table in
//! GPT-2), a stack of blocks, a final norm and the LM head (optionally the embedding table itself;
//! soft-capped in Gemma 2). A model whose weights stay in a GGUF file's stored block types is built
//! by [`stored`].

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use burn::module::{Module, Param};
use burn::tensor::module::embedding;
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

use crate::block::Block;
use crate::config::ModelConfig;
use crate::init::Init;
use crate::keys::Keys;
use crate::kinds::{ConfigError, Positions};
use crate::kv_cache::KvCache;
use crate::linear::{Linear, Stored, Weight};
use crate::lora::{FreezeBase, Lora, LoraConfig, Target};
use crate::moe::{ExpertsLora, Route, StackLora};
use crate::norm::Norm;
use crate::to_dtype;
use ember_kernels::documents::Documents;
use ember_kernels::rope::Rope;
use ember_kernels::{Compute, EmberBackend, QuantWeight};

pub(crate) mod stored;
use stored::gather_rows;

#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    /// `[V, D]`; or kept in its block-quantized storage type (a GGUF file run for inference): rows
    /// are decoded as they are looked up, and a tied head multiplies on the stored blocks.
    pub embed_tokens: Weight<B>,
    /// `[T_max, D]`, learned positions (GPT-2's `wpe`).
    pub embed_positions: Option<Param<Tensor<B, 2>>>,
    pub layers: Vec<Block<B>>,
    /// Final norm: with pre-norm blocks the residual stream grows with depth and the head needs it.
    pub norm: Norm<B>,
    /// `[D, V]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Linear<B>>,
    /// The RoPE tables of the global layers (with learned positions, the identity).
    pub rope: Rope<B>,
    /// The sliding-window layers' RoPE tables where their base differs (Gemma 3).
    pub rope_local: Option<Rope<B>>,
    /// Both tables grown past the model's own for the positions a session has reached
    /// ([`Rope::covering`]: the model's start with `FIRST_ROWS` rows at most), shared by its clones.
    #[module(skip)]
    grown: Grown,
    #[module(skip)]
    config: ModelConfig,
    /// How the model computes: the GEMMs' dtype (mixed precision; parameters and everything else
    /// stay f32), the CPU products' precision, kernels or reference. Every op is called with it.
    #[module(skip)]
    compute: Compute,
}

impl<B: EmberBackend> Decoder<B> {
    /// Builds a freshly initialised model: normal(0, init_std) everywhere, output projections scaled
    /// by 1/sqrt(2L), norm gains 1, biases 0. The same seed gives the same weights on every backend.
    pub fn new(config: &ModelConfig, seed: u64, device: &B::Device) -> Result<Self, ConfigError> {
        Self::build(config, Init::new(seed), device)
    }

    /// A model with every weight zero (norm gains one), cheap to build: for loading weights into.
    pub fn empty(config: &ModelConfig, device: &B::Device) -> Result<Self, ConfigError> {
        Self::build(config, Init::zeros(), device)
    }

    fn build(config: &ModelConfig, init: Init, device: &B::Device) -> Result<Self, ConfigError> {
        Self::build_with(config, init, device, [None, None], |_, block| block)
    }

    /// The model, each block passed through `each` (with its index) as it is built; the embedding
    /// table and the untied head kept as the stored blocks `[embedding, head]` hold where given.
    fn build_with(
        config: &ModelConfig,
        mut init: Init,
        device: &B::Device,
        [embed, head]: [Option<QuantWeight>; 2],
        mut each: impl FnMut(usize, Block<B>) -> Block<B>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let (v, d) = (config.vocab_size, config.d_model);
        let embed_tokens = match embed {
            Some(blocks) => Weight::Stored(Stored::new(blocks)),
            None => Weight::Dense(init.normal_param([v, d], config.init_std, device)),
        };
        let learned = config.positions == Positions::Learned;
        let embed_positions = learned.then(|| init.normal_param([config.max_seq_len, d], config.init_std, device));
        let layers = (0..config.n_layers).map(|l| each(l, config.block(l).init(&mut init, device))).collect();
        let lm_head = (!config.tie_embeddings).then(|| match head {
            Some(blocks) => Linear::stored(blocks),
            None => Linear::new(&mut init, d, v, false, config.init_std, device),
        });
        Ok(Self {
            embed_tokens,
            embed_positions,
            layers,
            norm: config.norm().init(device),
            lm_head,
            rope: config.rope(device),
            rope_local: config.rope_local(device),
            grown: Grown::default(),
            config: config.clone(),
            compute: Compute::default(),
        })
    }

    /// Computes as `compute` says (see [`Compute`]; the default: f32 on ember's kernels, with
    /// everything the CPU has).
    pub fn with_compute(mut self, compute: Compute) -> Self {
        self.compute = compute;
        self
    }

    pub fn compute(&self) -> Compute {
        self.compute
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device the model's parameters live on (the final norm's: every model has one, dense).
    pub fn device(&self) -> B::Device {
        self.norm.weight.device()
    }

    /// Final hidden states (after the last norm) of a sequence starting at absolute position `start`.
    ///
    /// # Shapes
    /// - tokens: `[B, T]` -> `[B, T, D]`, with `start + T <= max_seq_len`
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>, start: usize) -> Tensor<B, 3> {
        self.hidden_documents(tokens, start, None)
    }

    /// [`Self::hidden`] of rows packed with several documents (`docs`, `[B, T]`): each document's
    /// positions start at `start` and its tokens attend only to its own earlier tokens, so that its
    /// hidden states are those it would have alone. `None` is one document per row.
    ///
    /// # Shapes
    /// - tokens: `[B, T]` -> `[B, T, D]`
    pub fn hidden_documents(&self, tokens: Tensor<B, 2, Int>, start: usize, docs: Option<&Documents>) -> Tensor<B, 3> {
        self.hidden_routed(tokens, start, docs).0
    }

    /// [`Self::hidden_documents`] with every mixture-of-experts layer's routing (none for a model
    /// without experts), for the auxiliary losses and the load metrics.
    ///
    /// # Shapes
    /// - tokens: `[B, T]` -> `[B, T, D]`
    pub fn hidden_routed(
        &self,
        tokens: Tensor<B, 2, Int>,
        start: usize,
        docs: Option<&Documents>,
    ) -> (Tensor<B, 3>, Vec<Route<B>>) {
        let [b, t] = tokens.dims();
        let positions = || match docs {
            Some(docs) => docs.positions(start),
            None => (0..b).flat_map(|_| start..start + t).collect(),
        };
        let x = self.embed(tokens, positions); // [B, T, D]
        let mut x = crate::dropout(x, self.config.dropout);
        let mut routes = Vec::new();
        let ropes = self.ropes(start + t);
        for (l, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x, ropes.of(&self.config, l), Keys::Own { start, docs }, self.compute, &mut routes);
        }
        (self.norm.forward(x, self.compute), routes)
    }

    /// The blocks' input: token embeddings (times `sqrt(D)` where the model scales them), plus the
    /// learned table's rows at `positions` (`B·T` of them, row by row) where the model has one.
    ///
    /// # Shapes
    /// - tokens: `[B, T]` -> `[B, T, D]`
    fn embed(&self, tokens: Tensor<B, 2, Int>, positions: impl FnOnce() -> Vec<usize>) -> Tensor<B, 3> {
        let [b, t] = tokens.dims();
        let x = match &self.embed_tokens {
            Weight::Stored(table) => gather_rows(&table.blocks, tokens),
            Weight::Dense(table) => to_dtype(embedding(table.val(), tokens), DType::F32), // [B, T, D]
        };
        let x = if self.config.embed_scale { x.mul_scalar((self.config.d_model as f32).sqrt()) } else { x };
        let Some(table) = &self.embed_positions else { return x };
        let last = self.config.max_seq_len.saturating_sub(1);
        let ids: Vec<i32> = positions().into_iter().map(|p| p.min(last) as i32).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, t]), &x.device());
        x + to_dtype(embedding(table.val(), ids), DType::F32)
    }

    /// The RoPE tables covering positions `0..positions` (up to `max_seq_len`): the model's own,
    /// or grown from them the first time a session reaches past them.
    fn ropes(&self, positions: usize) -> Ropes<B> {
        let own = Ropes { global: self.rope.clone(), local: self.rope_local.clone() };
        if positions <= self.rope.max_seq_len() {
            return own;
        }
        let mut grown = self.grown.0.lock().unwrap_or_else(PoisonError::into_inner);
        // Tables grown for another backend or device (the model's autodiff-free copy, or the
        // model moved since) are grown again from the model's own.
        let base = grown
            .take()
            .and_then(|g| g.downcast::<Ropes<B>>().ok())
            .filter(|g| g.global.device() == self.rope.device())
            .map_or(own, |g| *g);
        let grow = |rope: Rope<B>| rope.covering(positions).unwrap_or(rope);
        let ropes = Ropes { global: grow(base.global), local: base.local.map(grow) };
        *grown = Some(Box::new(ropes.clone()));
        ropes
    }

    /// Final hidden states of new positions fed through the KV cache: row `b` brings `new_lens[b]`
    /// real tokens (the rest of its `T` is right padding), placed after the row's cached positions.
    ///
    /// # Shapes
    /// - tokens: `[B, T]` -> `[B, T, D]`; rows of padding give values that mean nothing
    ///
    /// # Panics
    /// If a row would outgrow `max_seq_len` or `new_lens` has not one entry per cached sequence.
    pub fn forward_cached(
        &self,
        tokens: Tensor<B, 2, Int>,
        new_lens: &[usize],
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let rows: Vec<usize> = (0..cache.batch()).collect();
        self.forward_cached_rows(tokens, &rows, new_lens, cache)
    }

    /// [`Self::forward_cached`] over some of the cache's sequences: row `i` of `tokens` continues
    /// sequence `rows[i]`; the others are not touched (continuous batching runs only live requests).
    ///
    /// # Shapes
    /// - tokens: `[R, T]` -> `[R, T, D]`, R = `rows.len()`
    ///
    /// # Panics
    /// As [`KvCache::step_rows`].
    pub fn forward_cached_rows(
        &self,
        tokens: Tensor<B, 2, Int>,
        rows: &[usize],
        new_lens: &[usize],
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let t = tokens.dims()[1];
        let mut step = cache.step_rows(rows, new_lens);
        let starts = step.layer(0).starts();
        let x = self.embed(tokens, || starts.iter().flat_map(|&s| s..s + t).collect()); // [R, T, D]
        let mut x = x;
        let ropes = self.ropes(starts.iter().map(|&s| s + t).max().unwrap_or(0));
        for (i, layer) in self.layers.iter().enumerate() {
            let rope = ropes.of(&self.config, i);
            x = layer.forward(x, rope, Keys::Cache(step.layer(i)), self.compute, &mut Vec::new());
        }
        step.finish();
        self.norm.forward(x, self.compute)
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing after a training step: each layer with experts
    /// (in order, `loads[i]` the `i`-th such layer's share of pairs per expert) moves its selection
    /// bias by `rate` towards an even load ([`crate::moe::Moe::balance_selection_bias`]).
    pub fn balance_selection_bias(mut self, loads: &[Vec<f64>], rate: f64) -> Self {
        let experts = self.layers.iter_mut().filter_map(|layer| layer.moe_mut());
        for (moe, load) in experts.zip(loads) {
            moe.balance_selection_bias(load, rate);
        }
        self
    }

    /// A fresh KV cache for `batch` sequences of this model.
    pub fn new_cache(&self, batch: usize, block_size: usize) -> KvCache<B> {
        KvCache::new(&self.config, (batch, block_size), self.compute.kv_cache, &self.device())
    }

    /// The LM head as a matrix, `[D, V]`: the transposed embedding table when tied; stored blocks
    /// dequantized.
    pub(crate) fn head_weight(&self) -> Tensor<B, 2> {
        match (&self.lm_head, &self.embed_tokens) {
            (Some(head), _) => match &head.weight {
                Weight::Stored(s) => s.blocks.to_tensor(&self.device()),
                Weight::Dense(w) => w.val(),
            },
            (None, Weight::Stored(table)) => table.blocks.to_tensor(&self.device()),
            (None, Weight::Dense(table)) => table.val().transpose(),
        }
    }

    /// # Shapes
    /// - hidden: `[N, D]` -> `[N, V]`
    pub fn logits(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        ember_kernels::profile::time(ember_kernels::profile::Part::Head, || self.head(hidden))
    }

    fn head(&self, hidden: Tensor<B, 2>) -> Tensor<B, 2> {
        let dtype = self.compute.dtype;
        let hidden = to_dtype(hidden, dtype);
        let logits = match (&self.lm_head, &self.embed_tokens) {
            (Some(head), _) => match &head.weight {
                // Stored blocks: their integer products for a few rows, decoded tiles for more.
                Weight::Stored(_) => head.forward(hidden, self.compute),
                // Kept in bf16 for inference (`with_bf16_projections`): a few rows multiply it as
                // stored, more widen it (the op decides).
                Weight::Dense(w) if w.val().dtype() == DType::BF16 && dtype == DType::F32 => {
                    ember_kernels::linear::linear_bf16_weight(hidden, w.val(), None, self.compute)
                }
                Weight::Dense(w) => hidden.matmul(to_dtype(w.val(), dtype)),
            },
            (None, Weight::Stored(table)) => ember_kernels::quant_linear(hidden, &table.blocks, self.compute),
            // Tied: the embedding table `[V, D]` read where it is; `h · Eᵀ` through matmul would
            // copy the whole transposed table (113 MB for SmolLM2) at every call.
            (None, Weight::Dense(table)) => {
                ember_kernels::linear::linear_nt(hidden, to_dtype(table.val(), dtype), self.compute)
            }
        };
        let logits = to_dtype(logits, DType::F32);
        match self.config.final_logit_softcap {
            Some(c) => logits.div_scalar(c).tanh().mul_scalar(c),
            None => logits,
        }
    }

    /// Mean next-token cross-entropy of `targets` (those not [`ember_kernels::IGNORE`]) under the
    /// logits of `hidden`: the tiled LM head + loss (the `[N, V]` logits never held at once, in the
    /// forward or the backward pass), or, for a model that soft-caps its logits, the logits then the
    /// loss.
    ///
    /// # Shapes
    /// - hidden: `[N, D]`, targets: `[N]` -> `[1]`
    pub fn loss(&self, hidden: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        if self.config.final_logit_softcap.is_some() {
            return ember_kernels::cross_entropy::cross_entropy(self.logits(hidden), targets);
        }
        let spec = ember_kernels::ChunkSpec::auto(hidden.dims()[0], self.config.vocab_size, self.compute);
        ember_kernels::lm_head_cross_entropy(hidden, self.head_weight(), targets, spec)
    }

    /// Adds LoRA adapters to the projections `config.targets` names in every block and freezes
    /// everything else; adapter `A` weights are drawn from `seed`.
    pub fn with_lora(self, config: &LoraConfig, seed: u64) -> Self {
        let device = self.device();
        let mut init = Init::new(seed);
        let mut model = crate::weights::map_paths(self, &mut FreezeBase);
        for layer in model.layers.iter_mut() {
            // In the table's order, whatever the config's: the adapters' draws do not depend on it.
            for target in Target::ALL.into_iter().filter(|t| config.targets.contains(t)) {
                // A target the model lacks (a plain MLP's gate) is refused by the config's checks.
                if let Some(lin) = layer.projection_mut(target) {
                    lin.lora = Some(Lora::new(&mut init, lin.d_in(), lin.d_out(), config, &device));
                }
            }
            // A mixture's MLP targets: every expert's projection (one adapter each, stacked) and
            // the shared expert's.
            let Some(moe) = layer.moe_mut() else { continue };
            let on = [Target::GateProj, Target::UpProj, Target::DownProj].map(|t| config.targets.contains(&t));
            if !on.contains(&true) {
                continue;
            }
            let [e, d, f] = moe.gate.dims();
            let mut stack = |on: bool, shape| on.then(|| StackLora::new(&mut init, shape, config, &device));
            let (gate, up, down) = (stack(on[0], [e, d, f]), stack(on[1], [e, d, f]), stack(on[2], [e, f, d]));
            moe.lora = Some(ExpertsLora { gate, up, down });
            if let Some(shared) = moe.shared.as_mut() {
                let parts = [
                    (on[0], shared.gate_proj.as_mut()),
                    (on[1], Some(&mut shared.up_proj)),
                    (on[2], Some(&mut shared.down_proj)),
                ];
                for (_, lin) in parts.into_iter().filter(|(on, _)| *on) {
                    if let Some(lin) = lin {
                        lin.lora = Some(Lora::new(&mut init, lin.d_in(), lin.d_out(), config, &device));
                    }
                }
            }
        }
        model
    }

    /// Whether any projection (or stack of experts) carries a LoRA adapter.
    pub fn has_lora(&self) -> bool {
        self.layers.iter().any(|layer| {
            let experts = layer.moe().is_some_and(|m| {
                let shared = m
                    .shared
                    .as_ref()
                    .is_some_and(|s| s.gate_proj.iter().chain([&s.up_proj, &s.down_proj]).any(Linear::has_lora));
                m.has_lora() || shared
            });
            experts || Target::ALL.into_iter().any(|t| layer.projection(t).is_some_and(Linear::has_lora))
        })
    }

    /// The model with its adapters folded in ([`Self::merge_lora`]) and its weights trainable
    /// again, as a model read from a file is: where a run that starts from a LoRA run begins.
    pub fn merged_for_training(self) -> Self {
        crate::weights::map_paths(self.merge_lora(), &mut crate::lora::ThawBase)
    }

    /// Folds every adapter into its projection's weight; quantized projections are dequantized
    /// (the merged model is plain f32 weights).
    pub fn merge_lora(mut self) -> Self {
        let device = self.device();
        let layers = std::mem::take(&mut self.layers);
        self.layers = layers.into_iter().map(|layer| layer.merge_lora(&device)).collect();
        self.lm_head = self.lm_head.map(|head| head.merge_lora(&device));
        if let Weight::Stored(table) = &self.embed_tokens {
            let rows = table.blocks.to_tensor::<B>(&device).transpose();
            self.embed_tokens = Weight::Dense(Param::from_tensor(rows).set_require_grad(false));
        }
        self
    }

    /// Stores every parameter in `dtype` (f32 for training; bf16 or f16 halves the memory of a model
    /// used for inference). Computation keeps its own dtype: see [`Self::with_compute`].
    pub fn with_param_dtype(self, dtype: DType) -> Self {
        struct Cast(DType);
        impl<B: Backend> burn::module::ModuleMapper<B> for Cast {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
                let dtype = self.0;
                if !param.is_initialized() {
                    // Lazy zeros (a model about to be loaded) stay lazy: zeros of `dtype` if read.
                    let dims: [usize; D] = param.lazy_shape().dims();
                    return crate::init::lazy_zeros_as(param.id, dims, param.lazy_device(), Some(dtype));
                }
                param.map(|t| {
                    let require_grad = t.is_require_grad();
                    let t = to_dtype(t, dtype).detach();
                    if require_grad {
                        t.require_grad()
                    } else {
                        t
                    }
                })
            }
        }
        self.map(&mut Cast(dtype))
    }

    /// For inference on weights stored in bf16: the blocks' projection weights (attention q, k, v, o;
    /// the MLP's gate, up, down, and a dense MoE's shared expert) and an untied LM head held in bf16,
    /// everything else as it is. Decoding multiplies such a weight as stored (half an f32 weight's
    /// bytes read a token, [`ember_kernels::linear::linear_bf16_weight`]); longer inputs widen it.
    /// The values are the bf16 values the model was stored in when `self` holds their exact f32
    /// widening (a bf16 file loaded as f32), so outputs change only by summation order. A tied
    /// embedding table stays as it is (the head reads it whole every token through the f32 kernel);
    /// latent attention (MLA) keeps every weight (its products go through merged weights).
    pub fn with_bf16_projections(self) -> Self {
        struct Narrow;
        impl<B: Backend> crate::weights::PathMapper<B> for Narrow {
            fn map<const D: usize>(&mut self, path: &str, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
                if D != 2 || !is_projection_weight(path) {
                    return param;
                }
                param.map(|t| if t.is_require_grad() { t } else { to_dtype(t, DType::BF16) })
            }
        }
        if self.config.mla.is_some() {
            return self;
        }
        crate::weights::map_paths(self, &mut Narrow)
    }

    /// Logits for every position.
    ///
    /// # Shapes
    /// - tokens: `[B, T]` -> `[B, T, V]`
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, t] = tokens.dims();
        let h = self.hidden(tokens, 0).reshape([b * t, self.config.d_model]);
        self.logits(h).reshape([b, t, self.config.vocab_size])
    }
}

/// Whether `path` names a dense projection weight that [`Decoder::with_bf16_projections`] narrows:
/// `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`,
/// `layers.N.moe.shared.{gate,up,down}_proj.weight`, `lm_head.weight`.
fn is_projection_weight(path: &str) -> bool {
    if path == "lm_head.weight" {
        return true;
    }
    let Some(rest) = path.strip_prefix("layers.") else { return false };
    let Some((layer, rest)) = rest.split_once('.') else { return false };
    if layer.parse::<usize>().is_err() {
        return false;
    }
    let attention = ["q_proj", "k_proj", "v_proj", "o_proj"];
    let mlp = ["gate_proj", "up_proj", "down_proj"];
    let named = |prefix: &str, names: &[&str]| {
        rest.strip_prefix(prefix).and_then(|r| r.strip_suffix(".weight")).is_some_and(|name| names.contains(&name))
    };
    named("self_attn.", &attention) || named("mlp.", &mlp) || named("moe.shared.", &mlp)
}

/// [`Ropes`] grown past a model's own, behind a type that does not name the backend (a module's
/// skipped field may not).
#[derive(Debug, Clone, Default)]
struct Grown(Arc<Mutex<Option<Box<dyn Any + Send>>>>);

/// A model's RoPE tables: the global layers' and, where their base differs, the sliding-window
/// layers'.
#[derive(Debug, Clone)]
struct Ropes<B: Backend> {
    global: Rope<B>,
    local: Option<Rope<B>>,
}

impl<B: Backend> Ropes<B> {
    /// The tables layer `layer` rotates with.
    fn of(&self, config: &ModelConfig, layer: usize) -> &Rope<B> {
        match &self.local {
            Some(local) if config.is_local(layer) => local,
            _ => &self.global,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::SelfAttention;
    use crate::config::{tiny_config, MlpKind, NormKind, RopeLayout};
    use crate::lora::LoraConfig;
    use crate::TestBackend;
    use burn::tensor::{TensorData, Tolerance};
    use ember_kernels::rope::interleaved_to_half_split;

    type B = TestBackend;

    fn tokens(ids: &[i32], dev: &burn::tensor::Device<B>) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), dev)
    }

    /// A model's RoPE tables start with `FIRST_ROWS` rows and grow as a session reaches past them
    /// (both bases of a local/global model): positions past them are rotated by their own angles,
    /// the bits of tables built whole, on the whole-sequence path and through the cache alike; a
    /// sequence gives the same hidden states from position 0 and 6,000 (RoPE sees distances only),
    /// which the tables' last row reused for every later position would not.
    #[test]
    fn positions_past_the_first_tables_rotate_by_their_own_angles() {
        use ember_kernels::rope::FIRST_ROWS;
        let dev = Default::default();
        let max = 10_000;
        let cfg = ModelConfig {
            init_std: 0.2,
            n_layers: 2,
            sliding_window: Some(4_500),
            sliding_window_pattern: Some(2),
            rope_local_theta: Some(500.0),
            ..ModelConfig::tiny(37, max)
        };
        let lazy = Decoder::<B>::new(&cfg, 7, &dev).unwrap();
        assert_eq!(lazy.rope.max_seq_len(), FIRST_ROWS);
        assert_eq!(lazy.rope_local.as_ref().map(Rope::max_seq_len), Some(FIRST_ROWS));
        // The same model with tables of every position, computed here from the definition.
        let whole = |theta: f64| {
            let dh = cfg.head_dim();
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for pos in 0..max {
                for i in 0..dh / 2 {
                    let (s, c) = (pos as f64 * theta.powf(-2.0 * i as f64 / dh as f64)).sin_cos();
                    cos.push(c as f32);
                    sin.push(s as f32);
                }
            }
            let table = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [max, dh / 2]), &dev);
            Rope::from_tables(table(cos), table(sin), cfg.rope_layout)
        };
        let mut full = lazy.clone();
        (full.rope, full.rope_local) = (whole(cfg.rope_theta), Some(whole(500.0)));

        let ids = tokens(&[1, 5, 9, 2, 7, 3], &dev);
        let far = lazy.hidden(ids.clone(), 6_000);
        far.to_data().assert_eq(&full.hidden(ids.clone(), 6_000).to_data(), true);
        far.to_data().assert_approx_eq::<f32>(&lazy.hidden(ids, 0).to_data(), Tolerance::absolute(1e-4));

        // Through the cache: a prompt ending just short of the first tables' end, then steps past it.
        let prompt: Vec<i32> = (0..FIRST_ROWS as i32 - 3).map(|i| (i * 7 + 3) % 37).collect();
        for model in [&full, &lazy] {
            model.grown.0.lock().unwrap().take();
        }
        let mut outputs = Vec::new();
        for model in [&full, &lazy] {
            let mut cache = model.new_cache(1, 64);
            let mut out = vec![model.forward_cached(tokens(&prompt, &dev), &[prompt.len()], &mut cache).to_data()];
            for id in [4, 8, 15, 16, 23] {
                out.push(model.forward_cached(tokens(&[id], &dev), &[1], &mut cache).to_data());
            }
            outputs.push(out);
        }
        for (a, b) in outputs[0].iter().zip(&outputs[1]) {
            a.assert_eq(b, true);
        }
        assert!(lazy.ropes(FIRST_ROWS + 2).global.max_seq_len() >= FIRST_ROWS + 2);
    }

    #[test]
    fn num_params_matches_the_formula() {
        let dev = Default::default();
        let base = tiny_config();
        let configs = [
            base.clone(),
            ModelConfig { tie_embeddings: true, ..base.clone() },
            ModelConfig { qkv_bias: true, n_kv_heads: Some(1), ..base.clone() },
            ModelConfig { head_dim: Some(6), n_layers: 3, d_ff: 40, ..base.clone() },
            // Every optional part at once: a parallel block with sandwich norms (three norms),
            // LayerNorms with biases, whole-width q/k norms, biases everywhere, a plain MLP.
            ModelConfig {
                parallel_block: true,
                sandwich_norms: true,
                norm: NormKind::LayerNorm,
                norm_bias: true,
                qk_norm: true,
                qk_norm_whole: true,
                qkv_bias: true,
                o_bias: true,
                mlp: MlpKind::Gelu,
                mlp_bias: true,
                positions: Positions::Learned,
                ..base.clone()
            },
        ];
        for cfg in configs {
            let model = Decoder::<B>::new(&cfg, 0, &dev).unwrap();
            assert_eq!(model.num_params() as u64, cfg.num_params(), "{cfg:?}");
        }
    }

    #[test]
    fn a_prefix_gives_the_same_outputs_as_the_full_sequence() {
        let dev = Default::default();
        for n_kv in [4, 2, 1] {
            let cfg = ModelConfig { n_kv_heads: Some(n_kv), init_std: 0.2, ..tiny_config() };
            let model = Decoder::<B>::new(&cfg, 1, &dev).unwrap();
            let ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3];
            let full = model.forward(tokens(&ids, &dev));
            let prefix = model.forward(tokens(&ids[..4], &dev));
            full.clone()
                .narrow(1, 0, 4)
                .into_data()
                .assert_approx_eq::<f32>(&prefix.into_data(), Tolerance::absolute(1e-5));
            // And a change after the prefix must leave the prefix untouched but change later logits.
            let mut changed = ids;
            changed[6] = 7;
            let other = model.forward(tokens(&changed, &dev));
            full.clone()
                .narrow(1, 0, 6)
                .into_data()
                .assert_approx_eq::<f32>(&other.clone().narrow(1, 0, 6).into_data(), Tolerance::absolute(1e-5));
            let diff = (full.narrow(1, 6, 4) - other.narrow(1, 6, 4)).abs().max().into_scalar();
            assert!(diff > 1e-4, "later positions must see token 6 (diff {diff})");
        }
    }

    #[test]
    fn rope_layouts_agree_after_the_weight_permutation() {
        let dev = Default::default();
        let inter_cfg = ModelConfig { rope_layout: RopeLayout::Interleaved, init_std: 0.2, ..tiny_config() };
        let half_cfg = ModelConfig { rope_layout: RopeLayout::HalfSplit, ..inter_cfg.clone() };
        let inter = Decoder::<B>::new(&inter_cfg, 5, &dev).unwrap();
        let mut half = Decoder::<B>::new(&half_cfg, 5, &dev).unwrap();
        let (h, k) = (half_cfg.n_heads, half_cfg.n_kv_heads());
        for layer in half.layers.iter_mut() {
            let SelfAttention::Grouped(att) = &mut layer.self_attn else { panic!("grouped-query attention") };
            let permuted =
                |w: &Weight<B>, heads| Weight::Dense(Param::from_tensor(interleaved_to_half_split(w.val(), heads)));
            att.q_proj.weight = permuted(&att.q_proj.weight, h);
            att.k_proj.weight = permuted(&att.k_proj.weight, k);
        }
        let ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let a = inter.forward(tokens(&ids, &dev)).into_data();
        let b = half.forward(tokens(&ids, &dev)).into_data();
        a.assert_approx_eq::<f32>(&b, Tolerance::absolute(1e-5));
        // Without the permutation they differ: the test can fail.
        let plain = Decoder::<B>::new(&half_cfg, 5, &dev).unwrap();
        let c = plain.forward(tokens(&ids, &dev));
        let diff = (c - Tensor::from_data(a, &dev)).abs().max().into_scalar();
        assert!(diff > 1e-3, "diff {diff}");
    }

    #[test]
    fn tied_head_is_the_embedding_table() {
        let dev = Default::default();
        let cfg = ModelConfig { tie_embeddings: true, ..tiny_config() };
        let model = Decoder::<B>::new(&cfg, 0, &dev).unwrap();
        assert!(model.lm_head.is_none());
        model.head_weight().into_data().assert_eq(&model.embed_tokens.val().transpose().into_data(), true);
    }

    #[test]
    fn output_projections_are_scaled_down() {
        let dev = Default::default();
        let cfg = ModelConfig { d_model: 64, n_heads: 4, n_kv_heads: None, d_ff: 256, n_layers: 8, ..tiny_config() };
        let model = Decoder::<B>::new(&cfg, 0, &dev).unwrap();
        let std = |t: Tensor<B, 2>| t.clone().sub(t.mean().unsqueeze()).square().mean().sqrt().into_scalar();
        let l = &model.layers[0];
        let (q, o, down) = (
            std(l.projection(Target::QProj).unwrap().weight.val()),
            std(l.projection(Target::OProj).unwrap().weight.val()),
            std(l.mlp().unwrap().down_proj.weight.val()),
        );
        assert!((q - 0.02).abs() < 0.001, "q std {q}");
        let want = 0.02 / 4.0; // 1/sqrt(2·8)
        assert!((o - want).abs() < 0.0005, "o std {o}");
        assert!((down - want).abs() < 0.0005, "down std {down}");
    }

    /// `zero_init_out`: the output projections start at zero, every other weight as without it
    /// (their draws are made and discarded), and a relu2 MLP has no gate and its own parameter count.
    #[test]
    fn zero_init_out_zeroes_only_the_output_projections() {
        let dev = Default::default();
        let base = ModelConfig { mlp: MlpKind::Relu2, qk_norm: true, ..tiny_config() };
        let plain = Decoder::<B>::new(&base, 5, &dev).unwrap();
        let zeroed = Decoder::<B>::new(&ModelConfig { zero_init_out: true, ..base.clone() }, 5, &dev).unwrap();
        assert_eq!(zeroed.num_params() as u64, base.num_params());
        for (p, z) in plain.layers.iter().zip(&zeroed.layers) {
            let (pm, zm) = (p.mlp().unwrap(), z.mlp().unwrap());
            assert!(pm.gate_proj.is_none());
            for w in [z.projection(Target::OProj).unwrap().weight.val(), zm.down_proj.weight.val()] {
                assert_eq!(w.abs().max().into_scalar(), 0.0);
            }
            let (pq, zq) = (p.projection(Target::QProj).unwrap(), z.projection(Target::QProj).unwrap());
            for (a, b) in [(pq, zq), (&pm.up_proj, &zm.up_proj)] {
                a.weight.val().into_data().assert_eq(&b.weight.val().into_data(), true);
            }
        }
        plain.embed_tokens.val().into_data().assert_eq(&zeroed.embed_tokens.val().into_data(), true);
    }

    #[test]
    fn bf16_compute_keeps_f32_parameters_and_gradients_close_to_f32() {
        use burn::backend::Autodiff;
        type AB = Autodiff<B>;
        let dev = Default::default();
        let cfg = ModelConfig { init_std: 0.1, ..tiny_config() };
        let ids: Vec<i32> = (0..16).map(|i| (i * 5 + 3) % 37).collect();
        let tokens = Tensor::<AB, 2, Int>::from_data(TensorData::new(ids, [2, 8]), &dev);
        let grads_for = |dtype: DType| {
            let model = Decoder::<AB>::new(&cfg, 3, &dev).unwrap().with_compute(Compute::default().with_dtype(dtype));
            let logits = model.forward(tokens.clone());
            assert_eq!(logits.dtype(), DType::F32);
            let loss = logits.powi_scalar(2).mean();
            let grads = loss.backward();
            let q = model.layers[0].projection(Target::QProj).unwrap().weight.dense().unwrap();
            let g = q.grad(&grads).expect("gradient reaches the f32 master weight");
            assert_eq!(q.val().dtype(), DType::F32);
            assert_eq!(g.dtype(), DType::F32);
            (loss.into_scalar(), g.into_data().to_vec::<f32>().unwrap())
        };
        let (l32, g32) = grads_for(DType::F32);
        let (l16, g16) = grads_for(DType::BF16);
        assert!((l32 - l16).abs() < 0.02 * l32.abs(), "loss {l32} vs {l16}");
        let max = g32.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = g32.iter().zip(&g16).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err < 0.05 * max, "max |g_bf16 - g_f32| {err} against max |g| {max}");
        assert!(err > 0.0, "bf16 must actually change the arithmetic");
    }

    #[test]
    fn lora_starts_at_the_base_model_trains_only_adapters_and_merges() {
        use burn::backend::Autodiff;
        type AB = Autodiff<B>;
        let dev = Default::default();
        let cfg = ModelConfig { init_std: 0.1, ..tiny_config() };
        let lora = LoraConfig { rank: 4, alpha: 8.0, dropout: 0.0, targets: vec![Target::QProj, Target::DownProj] };
        let base = Decoder::<AB>::new(&cfg, 3, &dev).unwrap();
        let ids: Vec<i32> = (0..10).map(|i| (i * 3) % 37).collect();
        let tokens = Tensor::<AB, 2, Int>::from_data(TensorData::new(ids, [1, 10]), &dev);
        let adapted = base.clone().with_lora(&lora, 9);
        assert!(adapted.has_lora() && !base.has_lora());
        // B = 0: the adapted model is the base model.
        let diff = (adapted.forward(tokens.clone()) - base.forward(tokens.clone())).abs().max().into_scalar();
        assert_eq!(diff, 0.0);
        // Only adapter weights get gradients.
        let grads = adapted.forward(tokens.clone()).powi_scalar(2).mean().backward();
        let l0 = &adapted.layers[0];
        let (q, k) = (l0.projection(Target::QProj).unwrap(), l0.projection(Target::KProj).unwrap());
        assert!(q.weight.dense().unwrap().grad(&grads).is_none(), "base weights are frozen");
        assert!(adapted.embed_tokens.dense().unwrap().grad(&grads).is_none());
        assert!(q.lora.as_ref().unwrap().lora_b.grad(&grads).is_some());
        assert!(k.lora.is_none(), "k_proj is not a target");
        // With a non-zero B, merging gives the same logits without adapters.
        let mut trained = adapted;
        for layer in trained.layers.iter_mut() {
            for target in [Target::QProj, Target::DownProj] {
                let l = layer.projection_mut(target).unwrap().lora.as_mut().unwrap();
                let shape = l.lora_b.dims();
                l.lora_b =
                    Param::from_tensor(Tensor::random(shape, burn::tensor::Distribution::Normal(0.0, 0.2), &dev));
            }
        }
        let want = trained.forward(tokens.clone());
        let merged = trained.clone().merge_lora();
        assert!(!merged.has_lora());
        let diff = (merged.forward(tokens.clone()) - want.clone()).abs().max().into_scalar();
        assert!(diff < 1e-5, "merged vs adapters: {diff}");
        let moved = (want - base.forward(tokens)).abs().max().into_scalar();
        assert!(moved > 1e-3, "the adapters change the model");
    }
}
