//! Multi-head latent attention (DeepSeek-V2, V3): the keys and values of every head are
//! up-projected from one small latent per token, `c = norm(x·W_DKV)` of `kv_lora_rank` numbers,
//! and a single rotary key `k_rope` of `qk_rope_head_dim` numbers is shared by all heads. A query
//! head is `[q_nope | q_rope]`, optionally through a low-rank query (`q_lora_rank`, with its own
//! norm); a key head is `[c·W_UK_h | k_rope]`, a value head `c·W_UV_h`.
//!
//! In [`LatentAttention`]'s projections: `q_proj` is the query's (its up-projection `q_b_proj` when
//! the query is low-rank), `k_proj` the joint down-projection to `[c | k_rope]`
//! (`kv_a_proj_with_mqa`), `v_proj` the keys' and values' up-projection `W_UKV`, per head
//! `[W_UK_h | W_UV_h]` (`kv_b_proj`), `o_proj` the output's. Its `mla` holds the rest.
//!
//! Training runs the expanded form (every head's keys and values made, then attention). Cached
//! decoding stores only `[c | k_rope]` per token and layer (`kv_lora_rank + qk_rope_head_dim`
//! numbers) and absorbs the up-projections: `q_nope·(c·W_UK_h)ᵀ = (q_nope·W_UK_hᵀ)·cᵀ`, so each head's
//! query becomes `[q_nope·W_UK_hᵀ | q_rope]` against the shared latent key, the output
//! `(softmax·c)·W_UV_h`: one key/value head of width `kv_lora_rank + qk_rope_head_dim`.

use burn::module::Module;
use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

use ember_kernels::attention::{masked_attention, Scores};
use ember_kernels::documents::Documents;
use ember_kernels::rope::Rope;
use ember_kernels::{Compute, EmberBackend};

use crate::init::Init;
use crate::keys::{rotate_own, Keys};
use crate::kinds::{positive_std, AttentionPart, ConfigError, NormKind, PartConfig, Target};
use crate::kv_cache::LayerKv;
use crate::linear::Linear;
use crate::norm::{Norm, NormConfig};

/// A model's latent attention, `[model.mla]` (Hugging Face names in brackets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaConfig {
    /// Width of the low-rank query, if the query is low-rank [q_lora_rank].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_rank: Option<usize>,
    /// Width of the joint key/value latent, what the cache stores [kv_lora_rank].
    pub kv_rank: usize,
    /// Per-head width of the query and key part without position [qk_nope_head_dim].
    pub nope_dim: usize,
    /// Width of the rotary part of the queries and of the one shared rotary key [qk_rope_head_dim].
    pub rope_dim: usize,
    /// Per-head width of the values [v_head_dim].
    pub v_dim: usize,
    /// Epsilon of the latents' RMSNorms (DeepSeek's: 1e-6, not the model's).
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
}

fn default_eps() -> f64 {
    1e-6
}

impl MlaConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let sizes = [
            ("mla.kv_rank", self.kv_rank),
            ("mla.nope_dim", self.nope_dim),
            ("mla.rope_dim", self.rope_dim),
            ("mla.v_dim", self.v_dim),
            ("mla.q_rank", self.q_rank.unwrap_or(1)),
        ];
        if let Some((name, _)) = sizes.into_iter().find(|&(_, v)| v == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        for (name, value) in sizes {
            if value > 1 << 16 {
                return Err(ConfigError::TooLarge { name, value: value as u64, limit: 1 << 16 });
            }
        }
        if !self.rope_dim.is_multiple_of(2) {
            return Err(ConfigError::Needs { key: "mla.rope_dim", needs: "an even value (RoPE rotates pairs)" });
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return Err(ConfigError::NotPositive { name: "mla.norm_eps", value: self.norm_eps });
        }
        Ok(())
    }

    /// Per-head width of the queries and keys, `nope_dim + rope_dim`.
    pub fn qk_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }

    /// Numbers the cache stores per token and layer: the latent and the rotary key.
    pub fn cache_width(&self) -> usize {
        self.kv_rank + self.rope_dim
    }
}

/// What a [`LatentAttention`] is built from: the model's width and heads, the latent's widths, and
/// the options it takes (no window, no q/k norm, no soft cap: the model's config refuses those with
/// `[model.mla]`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LatentConfig {
    pub d_model: usize,
    pub n_heads: usize,
    pub mla: MlaConfig,
    /// Biases on the two down-projections, the query's and the joint key/value one (`qkv_bias`).
    pub bias: bool,
    pub o_bias: bool,
    /// What `q·k` is multiplied by.
    pub scale: f64,
    /// Init standard deviation of the projections and of the output projection.
    pub init_std: f64,
    pub out_std: f64,
}

impl LatentConfig {
    /// The four projections' `(in, out)`: query, key/value down, key/value up, output.
    pub(crate) fn shapes(&self) -> [(usize, usize); 4] {
        let (m, d, h) = (&self.mla, self.d_model, self.n_heads);
        [
            (m.q_rank.unwrap_or(d), h * m.qk_dim()),
            (d, m.cache_width()),
            (m.kv_rank, h * (m.nope_dim + m.v_dim)),
            (h * m.v_dim, d),
        ]
    }

    /// The part, its weights drawn from `init`: the latent's parts (the low-rank query's
    /// down-projection first), then q, k, v, o. Call [`LatentConfig::validate`] first.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> LatentAttention<B> {
        let (m, d, std) = (&self.mla, self.d_model, self.init_std);
        let norm = |d| NormConfig { d_model: d, eps: m.norm_eps, kind: NormKind::RmsNorm, bias: false };
        let mla = Latent {
            q_a_proj: m.q_rank.map(|r| Linear::new(init, d, r, self.bias, std, device)),
            q_a_norm: m.q_rank.map(|r| norm(r).init(device)),
            kv_a_norm: norm(m.kv_rank).init(device),
        };
        let [q, kv_down, kv_up, o] = self.shapes();
        LatentAttention {
            mla,
            q_proj: Linear::new(init, q.0, q.1, false, std, device),
            k_proj: Linear::new(init, kv_down.0, kv_down.1, self.bias, std, device),
            v_proj: Linear::new(init, kv_up.0, kv_up.1, false, std, device),
            o_proj: Linear::new(init, o.0, o.1, self.o_bias, self.out_std, device),
            heads: self.n_heads,
            kv_rank: m.kv_rank,
            nope_dim: m.nope_dim,
            rope_dim: m.rope_dim,
            v_dim: m.v_dim,
            scores: Scores { scale: self.scale, softcap: None },
        }
    }
}

impl PartConfig for LatentConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some((name, _)) =
            [("d_model", self.d_model), ("n_heads", self.n_heads)].into_iter().find(|&(_, v)| v == 0)
        {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        self.mla.validate()?;
        positive_std(self.init_std, self.out_std)
    }

    /// Its parameters: the four projections of [`Self::shapes`], the low-rank query's
    /// down-projection and norm, the latent's norm and the biases.
    fn params(&self) -> u64 {
        let (m, d) = (&self.mla, self.d_model as u64);
        let products: u64 = self.shapes().iter().map(|&(i, o)| (i * o) as u64).sum();
        let q_down = m.q_rank.map_or(0, |r| d * r as u64 + r as u64 + if self.bias { r as u64 } else { 0 });
        let biases = if self.bias { m.cache_width() as u64 } else { 0 } + if self.o_bias { d } else { 0 };
        products + q_down + m.kv_rank as u64 + biases
    }

    /// Weights a token multiplies by (the expanded form's).
    fn matmul_params(&self) -> u64 {
        let products: u64 = self.shapes().iter().map(|&(i, o)| (i * o) as u64).sum();
        products + self.mla.q_rank.map_or(0, |r| (self.d_model * r) as u64)
    }

    /// `(in, out)` of the projection `target` names, if it is one of the four.
    fn projection(&self, target: Target) -> Option<(usize, usize)> {
        let i = target.attention_slot()?;
        Some(self.shapes()[i])
    }

    /// The f32 values autodiff keeps per token for the expanded form: the queries and their
    /// concatenation with the rotated part (2·H·(dn + dr)), a low-rank query's down-projection and
    /// norm (2·q_rank), the joint down-projection, the normed latent and the rotated key
    /// (2·r + 2·dr), the keys and values made from the latent and the keys' concatenation
    /// (H·(dn + dv) + H·(dn + dr)), the attention output and projection (2·H·dv), and the `[T, T]`
    /// score and probability matrices per head (2·H·T).
    fn activations(&self, seq_len: usize) -> u64 {
        let (m, h, t) = (&self.mla, self.n_heads as u64, seq_len as u64);
        let (qk, r, dr, dv) = (m.qk_dim() as u64, m.kv_rank as u64, m.rope_dim as u64, m.v_dim as u64);
        let queries = 2 * h * qk + 2 * m.q_rank.unwrap_or(0) as u64;
        let latent = 2 * r + 2 * dr;
        let expanded = h * (m.nope_dim as u64 + dv) + h * qk;
        queries + latent + expanded + 2 * h * dv + 2 * h * t
    }
}

impl AttentionPart for LatentConfig {
    /// The width of the score and value products per position: the mean of the scores' `qk_dim`
    /// and the values' `v_dim`, times the heads.
    fn width(&self) -> f64 {
        self.n_heads as f64 * ((self.mla.qk_dim() + self.mla.v_dim) as f64 / 2.0)
    }

    /// Numbers a position takes in the cache's key pool and value pool: the latent and the rotary
    /// key, and no values (they are part of the latent).
    fn cache_widths(&self) -> (usize, usize) {
        (self.mla.cache_width(), 0)
    }
}

/// Latent attention's parts: the four projections (as the module doc names them), and the rest
/// under `mla`.
#[derive(Module, Debug)]
pub struct LatentAttention<B: Backend> {
    /// `[D or q_rank, H·(dn + dr)]` [q_proj; q_b_proj].
    pub q_proj: Linear<B>,
    /// `[D, r + dr]` [kv_a_proj_with_mqa].
    pub k_proj: Linear<B>,
    /// `[r, H·(dn + dv)]` [kv_b_proj].
    pub v_proj: Linear<B>,
    /// `[H·dv, D]` [o_proj].
    pub o_proj: Linear<B>,
    /// The low-rank query's down-projection and norm, the latent's norm.
    pub(crate) mla: Latent<B>,
    #[module(skip)]
    heads: usize,
    #[module(skip)]
    kv_rank: usize,
    #[module(skip)]
    nope_dim: usize,
    #[module(skip)]
    rope_dim: usize,
    #[module(skip)]
    v_dim: usize,
    #[module(skip)]
    scores: Scores,
}

/// The parts of a latent attention beside its four projections.
#[derive(Module, Debug)]
pub(crate) struct Latent<B: Backend> {
    /// `[D, q_rank]`, the low-rank query's down-projection [q_a_proj].
    pub q_a_proj: Option<Linear<B>>,
    /// `[q_rank]` [q_a_layernorm].
    pub q_a_norm: Option<Norm<B>>,
    /// `[kv_rank]` [kv_a_layernorm].
    pub kv_a_norm: Norm<B>,
}

/// A call's queries split at the rotary part, `q_nope` `[B, H, T, dn]` and `q_rope` `[B, H, T, dr]`;
/// its latents `c` `[B·T, r]` and rotary keys `k_rope` `[B, 1, T, dr]`; and `(B, T)`.
struct Parts<B: Backend> {
    queries: (Tensor<B, 4>, Tensor<B, 4>),
    keys: (Tensor<B, 2>, Tensor<B, 4>),
    bt: (usize, usize),
}

impl<B: EmberBackend> LatentAttention<B> {
    /// The attention of `x`'s positions.
    ///
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    pub(crate) fn forward(&self, x: Tensor<B, 3>, rope: &Rope<B>, keys: Keys<'_, B>, cx: Compute) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let (h, r, dn, dr, dv) = (self.heads, self.kv_rank, self.nope_dim, self.rope_dim, self.v_dim);
        let x = x.reshape([b * t, d]);
        let q = match (&self.mla.q_a_proj, &self.mla.q_a_norm) {
            (Some(down), Some(norm)) => self.q_proj.forward(norm.forward(down.forward(x.clone(), cx), cx), cx),
            _ => self.q_proj.forward(x.clone(), cx),
        }; // [B·T, H·(dn + dr)]
        let kv = self.k_proj.forward(x, cx); // [B·T, r + dr]
        let c = self.mla.kv_a_norm.forward(kv.clone().narrow(1, 0, r), cx); // [B·T, r]
        let k_rope = kv.narrow(1, r, dr).reshape([b, t, 1, dr]).swap_dims(1, 2); // [B, 1, T, dr]
        let q = q.reshape([b, t, h, dn + dr]).swap_dims(1, 2); // [B, H, T, dn + dr]
        let (q_nope, q_rope) = (q.clone().narrow(3, 0, dn), q.narrow(3, dn, dr));
        let parts = Parts { queries: (q_nope, q_rope), keys: (c, k_rope), bt: (b, t) };
        let o = match keys {
            Keys::Own { start, docs } => self.expanded(parts, rope, (start, docs), cx),
            Keys::Cache(kv) => self.absorbed(parts, rope, kv, cx),
        }; // [B, H, T, dv]
        let o = o.swap_dims(1, 2).reshape([b * t, h * dv]);
        self.o_proj.forward(o, cx).reshape([b, t, d])
    }

    /// The expanded form: every head's keys and values made from the latent, then causal attention
    /// of the call's own positions.
    ///
    /// # Shapes
    /// - parts as [`Parts`] -> `[B, H, T, dv]`
    fn expanded(
        &self,
        Parts { queries: (q_nope, q_rope), keys: (c, k_rope), bt: (b, t) }: Parts<B>,
        rope: &Rope<B>,
        (start, docs): (usize, Option<&Documents>),
        cx: Compute,
    ) -> Tensor<B, 4> {
        let (h, dn, dr, dv) = (self.heads, self.nope_dim, self.rope_dim, self.v_dim);
        let (q_rope, k_rope, hidden) = rotate_own(rope, (q_rope, k_rope), (start, docs), None);
        let kv = self.v_proj.forward(c, cx).reshape([b, t, h, dn + dv]).swap_dims(1, 2); // [B, H, T, dn + dv]
        let k = Tensor::cat(vec![kv.clone().narrow(3, 0, dn), k_rope.expand([b, h, t, dr])], 3);
        let v = kv.narrow(3, dn, dv);
        let q = Tensor::cat(vec![q_nope, q_rope], 3);
        masked_attention(q, k, v, Some(hidden), cx.dtype, self.scores)
    }

    /// The absorbed form over the cache: the new positions' latents and rotary keys stored, each
    /// head's query taken into the latent space, attention over the stored latents, the result
    /// taken out to the head's values.
    ///
    /// # Shapes
    /// - as [`Self::expanded`]
    fn absorbed(
        &self,
        Parts { queries: (q_nope, q_rope), keys: (c, k_rope), bt: (b, t) }: Parts<B>,
        rope: &Rope<B>,
        kv: LayerKv<'_, B>,
        cx: Compute,
    ) -> Tensor<B, 4> {
        let (h, r, dn, dv) = (self.heads, self.kv_rank, self.nope_dim, self.v_dim);
        let starts = kv.starts();
        let (q_rope, k_rope) = (rope.apply_rows_op(q_rope, &starts, cx), rope.apply_rows_op(k_rope, &starts, cx));
        // W_UKV per head: [H, r, dn + dv].
        let w = self.v_proj.effective_weight(&c.device()).reshape([r, h, dn + dv]).swap_dims(0, 1);
        let w_uk = w.clone().narrow(2, 0, dn).swap_dims(1, 2).unsqueeze::<4>(); // [1, H, dn, r]
        let w_uv = w.narrow(2, dn, dv).unsqueeze::<4>(); // [1, H, r, dv]
        let q = Tensor::cat(vec![q_nope.matmul(w_uk), q_rope], 3); // [B, H, T, r + dr]
        let latent = Tensor::cat(vec![c.reshape([b, t, 1, r]).swap_dims(1, 2), k_rope], 3); // [B, 1, T, r + dr]
        let o = kv.attend_latent(q, latent, r, self.scores, cx); // [B, H, T, r]
        o.matmul(w_uv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelConfig, RopeLayout, RopeScaling};
    use crate::lora::{LoraConfig, Target};
    use crate::moe::{MoeConfig, Scoring};
    use crate::{Decoder, TestBackend};
    use burn::module::{Module, Param};
    use burn::tensor::{DType, Distribution, Int, TensorData};

    type B = TestBackend;

    /// A DeepSeek-V3-shaped model: a low-rank query, YaRN with both scales, interleaved RoPE, a
    /// dense first layer, then sigmoid-scored grouped experts with a selection bias and a shared
    /// expert.
    fn deepseek_like(q_rank: Option<usize>) -> ModelConfig {
        let moe = MoeConfig {
            n_experts: 8,
            top_k: 2,
            d_expert: 12,
            norm_topk: true,
            shared_expert: Some(12),
            shared_expert_gate: false,
            aux_loss_coef: 0.0,
            z_loss_coef: 0.0,
            scoring: Scoring::Sigmoid,
            selection_bias: true,
            groups: Some(4),
            top_groups: Some(2),
            routed_scale: 2.5,
            dense_layers: 1,
            bias_update_rate: 0.0,
        };
        let mla = MlaConfig { q_rank, kv_rank: 16, nope_dim: 8, rope_dim: 8, v_dim: 12, norm_eps: 1e-6 };
        ModelConfig {
            n_layers: 3,
            rope_layout: RopeLayout::Interleaved,
            rope_scaling: Some(RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 8,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: Some(1.0),
                mscale_all_dim: Some(0.8),
                attention_factor: None,
                truncate: true,
            }),
            moe: Some(moe),
            mla: Some(mla),
            init_std: 0.2,
            ..ModelConfig::tiny(41, 48)
        }
    }

    fn tokens(ids: &[i32]) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &Default::default())
    }

    fn max_diff(a: Tensor<B, 3>, b: Tensor<B, 3>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    /// Logits of `ids` fed through the cache: a prefill of `prefill` tokens, then one at a time.
    fn cached_logits(model: &Decoder<B>, ids: &[i32], prefill: usize) -> Tensor<B, 3> {
        let logits = |hidden: Tensor<B, 3>| {
            let [b, t, d] = hidden.dims();
            model.logits(hidden.reshape([b * t, d])).reshape([b, t, 41])
        };
        let mut cache = model.new_cache(1, 4);
        let mut out = vec![logits(model.forward_cached(tokens(&ids[..prefill]), &[prefill], &mut cache))];
        for &id in &ids[prefill..] {
            out.push(logits(model.forward_cached(tokens(&[id]), &[1], &mut cache)));
        }
        Tensor::cat(out, 1)
    }

    #[test]
    fn cached_decoding_with_the_absorbed_latent_equals_the_full_forward() {
        let ids: Vec<i32> = (0..30).map(|i| (i * 7 + 3) % 41).collect();
        for q_rank in [Some(10), None] {
            let model = Decoder::<B>::new(&deepseek_like(q_rank), 5, &Default::default()).unwrap();
            let full = model.forward(tokens(&ids));
            let diff = max_diff(cached_logits(&model, &ids, 11), full.clone());
            assert!(diff < 1e-4, "q_rank {q_rank:?}: cached vs full {diff}");
            // Far enough that YaRN's ramp and the attention factor matter (positions past 8).
            assert!(full.abs().max().into_scalar() > 0.5, "logits too small to compare");
        }
    }

    #[test]
    fn the_absorbed_form_uses_the_adapted_up_projection() {
        let lora = LoraConfig { rank: 2, alpha: 4.0, dropout: 0.0, targets: Target::ALL[..4].to_vec() };
        let mut model =
            Decoder::<B>::new(&deepseek_like(Some(10)), 6, &Default::default()).unwrap().with_lora(&lora, 1);
        for layer in model.layers.iter_mut() {
            for t in [Target::QProj, Target::KProj, Target::VProj, Target::OProj] {
                let lin = layer.projection_mut(t).unwrap();
                let (i, o) = (lin.d_in(), lin.d_out());
                assert_eq!((i, o), t.shape(&deepseek_like(Some(10))), "{t}");
                let b = Tensor::random([2, o], Distribution::Normal(0.0, 0.3), &Default::default());
                lin.lora.as_mut().unwrap().lora_b = Param::from_tensor(b);
            }
        }
        let ids: Vec<i32> = (0..20).map(|i| (i * 5 + 1) % 41).collect();
        let full = model.forward(tokens(&ids));
        assert!(max_diff(cached_logits(&model, &ids, 6), full.clone()) < 1e-4);
        // The adapters change the model: the merged weights give the same logits as the adapters.
        let merged = model.clone().merge_lora();
        assert!(max_diff(merged.forward(tokens(&ids)), full) < 1e-4);
    }

    #[test]
    fn the_cache_stores_the_latent_and_the_rotary_key_only() {
        let config = deepseek_like(Some(10));
        let model = Decoder::<B>::new(&config, 7, &Default::default()).unwrap();
        let mut cache = model.new_cache(1, 4);
        // (kv_rank + rope_dim) × layers × 4 bytes, against 2 × heads × (qk or v width) × layers for the
        // same heads as plain multi-head attention (keys of 16, values padded to 16).
        assert_eq!(cache.bytes_per_token(DType::F32), (16 + 8) * 3 * 4);
        assert_eq!(cache.bytes_per_token(DType::BF16), (16 + 8) * 3 * 2);
        let ids: Vec<i32> = (0..8).collect();
        let _ = model.forward_cached(tokens(&ids), &[8], &mut cache);
        assert_eq!(cache.pool_bytes(), 8 * (16 + 8) * 3 * 4, "two blocks of four positions, the latent only");
        let mha = ModelConfig { mla: None, head_dim: Some(16), n_kv_heads: Some(4), ..config };
        let plain = Decoder::<B>::new(&mha, 7, &Default::default()).unwrap().new_cache(1, 4);
        assert_eq!(plain.bytes_per_token(DType::F32), 2 * 4 * 16 * 3 * 4);
    }

    #[test]
    fn latent_configs_that_cannot_run_are_refused_by_name() {
        let base = deepseek_like(Some(10));
        let err = |c: ModelConfig| c.validate().unwrap_err().to_string();
        let mla = |f: fn(&mut MlaConfig)| {
            let mut c = base.clone();
            f(c.mla.as_mut().unwrap());
            c
        };
        assert!(err(mla(|m| m.kv_rank = 0)).contains("mla.kv_rank"));
        assert!(err(mla(|m| m.rope_dim = 7)).contains("mla.rope_dim"));
        assert!(err(mla(|m| m.q_rank = Some(0))).contains("mla.q_rank"));
        assert!(err(ModelConfig { sliding_window: Some(4), ..base.clone() }).contains("sliding_window"));
        assert!(err(ModelConfig { qk_norm: true, ..base.clone() }).contains("qk_norm"));
        assert!(err(ModelConfig { attn_logit_softcap: Some(30.0), ..base.clone() }).contains("attn_logit_softcap"));
        assert!(err(ModelConfig { n_kv_heads: Some(base.n_heads + 1), ..base.clone() }).contains("n_kv_heads"));
        let moe = |f: fn(&mut MoeConfig)| {
            let mut c = base.clone();
            f(c.moe.as_mut().unwrap());
            c
        };
        assert!(err(moe(|m| m.groups = Some(3))).contains("moe.groups"));
        assert!(err(moe(|m| m.top_groups = Some(5))).contains("moe.top_groups"));
        assert!(err(moe(|m| m.top_groups = None)).contains("moe.top_groups"));
        assert!(err(moe(|m| m.dense_layers = 4)).contains("moe.dense_layers"));
        assert!(err(moe(|m| m.routed_scale = 0.0)).contains("moe.routed_scale"));
    }

    #[test]
    fn parameter_counts_follow_the_latent_shapes() {
        let c = deepseek_like(Some(10));
        let model = Decoder::<B>::new(&c, 8, &Default::default()).unwrap();
        assert_eq!(model.num_params() as u64, c.num_params());
        let c = ModelConfig { qkv_bias: true, o_bias: true, ..deepseek_like(None) };
        let model = Decoder::<B>::new(&c, 8, &Default::default()).unwrap();
        assert_eq!(model.num_params() as u64, c.num_params());
    }
}
