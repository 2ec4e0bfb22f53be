//! Causal grouped-query self-attention: H query heads share K key/value heads, H/K queries per group
//! (Ainslie et al., 2023). MHA is K = H, MQA is K = 1. Options the families need: biases on the
//! projections (Qwen2, GPT-2), a per-head norm of the queries and keys before RoPE (Qwen3, Gemma 3),
//! a sliding window (Mistral; Gemma 3's local layers), a scale other than `1/sqrt(Dh)` (Gemma's
//! `query_pre_attn_scalar`) and soft-capped scores (Gemma 2).

use burn::module::Module;
use burn::tensor::{backend::Backend, DType, Tensor};

use ember_kernels::attention::{attention_rope_packed, masked_attention, repeat_kv, Scores};
use ember_kernels::documents::Documents;
use ember_kernels::qk_norm::qk_norm_packed;
use ember_kernels::rope::Rope;
use ember_kernels::{Compute, EmberBackend};

use crate::init::Init;
use crate::keys::{rotate_own, Keys};
use crate::kinds::{positive_std, AttentionPart, ConfigError, PartConfig, Target};
use crate::kv_cache::LayerKv;
use crate::linear::{forward_packed, Linear};
use crate::norm::{Norm, NormConfig};

/// What an [`Attention`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GroupedConfig {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// The per-head norm of queries and keys (over `head_dim`), if any.
    pub qk_norm: Option<NormConfig>,
    /// The q/k norms over each projection's whole width rather than per head (OLMoE).
    pub qk_norm_whole: bool,
    pub sliding_window: Option<usize>,
    /// What `q·k` is multiplied by, and the soft cap of the scores.
    pub scale: f64,
    pub softcap: Option<f64>,
    /// Init standard deviation of the q/k/v projections and of the output projection.
    pub init_std: f64,
    pub out_std: f64,
}

impl GroupedConfig {
    /// Multi-head attention of `n_heads` heads over `d_model` (one key/value head a query head, no
    /// bias, no window, init std 0.02): the fields are public for the rest.
    #[cfg(test)]
    pub(crate) fn new(d_model: usize, n_heads: usize) -> Self {
        let head_dim = d_model / n_heads.max(1);
        Self {
            d_model,
            n_heads,
            n_kv_heads: n_heads,
            head_dim,
            qkv_bias: false,
            o_bias: false,
            qk_norm: None,
            qk_norm_whole: false,
            sliding_window: None,
            scale: 1.0 / (head_dim as f64).sqrt(),
            softcap: None,
            init_std: 0.02,
            out_std: 0.02,
        }
    }

    /// The q or k norm of `heads` heads: per head, or over the projection's whole width.
    fn whole(&self, norm: &NormConfig, heads: usize) -> NormConfig {
        match self.qk_norm_whole {
            true => NormConfig { d_model: heads * self.head_dim, ..norm.clone() },
            false => norm.clone(),
        }
    }

    /// The projections, drawn from `init` (q, k, v, o in that order); the q/k norms start at a
    /// gain of one. Call [`GroupedConfig::validate`] first (as `Decoder::new` does): a config
    /// that breaks its rules builds a part that panics when run.
    pub(crate) fn init<B: Backend>(&self, init: &mut Init, device: &B::Device) -> Attention<B> {
        let (d, dh, h, k) = (self.d_model, self.head_dim, self.n_heads, self.n_kv_heads);
        let scores = Scores { scale: self.scale, softcap: self.softcap };
        Attention {
            q_proj: Linear::new(init, d, h * dh, self.qkv_bias, self.init_std, device),
            k_proj: Linear::new(init, d, k * dh, self.qkv_bias, self.init_std, device),
            v_proj: Linear::new(init, d, k * dh, self.qkv_bias, self.init_std, device),
            o_proj: Linear::new(init, h * dh, d, self.o_bias, self.out_std, device),
            q_norm: self.qk_norm.as_ref().map(|n| self.whole(n, h).init(device)),
            k_norm: self.qk_norm.as_ref().map(|n| self.whole(n, k).init(device)),
            qk_norm_whole: self.qk_norm_whole,
            n_heads: h,
            n_kv_heads: k,
            head_dim: dh,
            sliding_window: self.sliding_window,
            scores,
        }
    }
}

impl PartConfig for GroupedConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let sizes = [("d_model", self.d_model), ("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)];
        if let Some((name, _)) = sizes.into_iter().find(|&(_, value)| value == 0) {
            return Err(ConfigError::NotPositive { name, value: 0.0 });
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(ConfigError::NotDivisible {
                divisor: "n_kv_heads",
                divisor_value: self.n_kv_heads,
                dividend: "n_heads",
                dividend_value: self.n_heads,
            });
        }
        if self.head_dim == 0 {
            return Err(ConfigError::NotPositive { name: "head_dim", value: 0.0 });
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ConfigError::OddHeadDim(self.head_dim));
        }
        if self.sliding_window == Some(0) {
            return Err(ConfigError::NotPositive { name: "sliding_window", value: 0.0 });
        }
        if let Some(norm) = &self.qk_norm {
            norm.validate()?;
        }
        positive_std(self.init_std, self.out_std)
    }

    /// Its parameters: the projections' weights and biases and the q/k norms.
    fn params(&self) -> u64 {
        let d = self.d_model as u64;
        let (q, kv) = ((self.n_heads * self.head_dim) as u64, (self.n_kv_heads * self.head_dim) as u64);
        let qkv_bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        let o_bias = if self.o_bias { d } else { 0 };
        let qk_norm = self
            .qk_norm
            .as_ref()
            .map_or(0, |n| self.whole(n, self.n_heads).params() + self.whole(n, self.n_kv_heads).params());
        self.matmul_params() + qkv_bias + o_bias + qk_norm
    }

    /// Weights a token multiplies by: `D·H·Dh + 2·D·K·Dh + H·Dh·D`.
    fn matmul_params(&self) -> u64 {
        let d = self.d_model as u64;
        let (q, kv) = ((self.n_heads * self.head_dim) as u64, (self.n_kv_heads * self.head_dim) as u64);
        d * q + 2 * d * kv + q * d
    }

    /// `(in, out)` of the projection `target` names, if it is one of the attention's.
    fn projection(&self, target: Target) -> Option<(usize, usize)> {
        let i = target.attention_slot()?;
        let d = self.d_model;
        let (q, kv) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
        Some([(d, q), (d, kv), (d, kv), (q, d)][i])
    }

    /// The f32 values autodiff keeps per token: q, k, v and their rotated copies (2·H·Dh + 3·K·Dh),
    /// the attention output and projection (2·H·Dh), and the `[T, T]` score and probability
    /// matrices per head (2·H·T).
    fn activations(&self, seq_len: usize) -> u64 {
        let (h, k, dh, t) = (self.n_heads as u64, self.n_kv_heads as u64, self.head_dim as u64, seq_len as u64);
        2 * h * dh + 3 * k * dh + 2 * h * dh + 2 * h * t
    }
}

impl AttentionPart for GroupedConfig {
    /// The width of the score and value products per position, `H·Dh`.
    fn width(&self) -> f64 {
        self.n_heads as f64 * self.head_dim as f64
    }

    /// Numbers a position takes in the cache's key pool and value pool: `K·Dh` each.
    fn cache_widths(&self) -> (usize, usize) {
        (self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
    }
}

/// Grouped-query attention's projections and q/k norms.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[D, H·Dh]`
    pub q_proj: Linear<B>,
    /// `[D, K·Dh]`
    pub k_proj: Linear<B>,
    /// `[D, K·Dh]`
    pub v_proj: Linear<B>,
    /// `[H·Dh, D]`
    pub o_proj: Linear<B>,
    /// Per-head norms of the queries and keys, `[Dh]` each; over the whole projections, `[H·Dh]`
    /// and `[K·Dh]`, with `qk_norm_whole`.
    pub q_norm: Option<Norm<B>>,
    pub k_norm: Option<Norm<B>>,
    #[module(skip)]
    qk_norm_whole: bool,
    #[module(skip)]
    n_heads: usize,
    #[module(skip)]
    n_kv_heads: usize,
    #[module(skip)]
    head_dim: usize,
    #[module(skip)]
    sliding_window: Option<usize>,
    #[module(skip)]
    scores: Scores,
}

impl<B: EmberBackend> Attention<B> {
    /// Causal self-attention of the positions `x` holds.
    ///
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    ///
    /// Projections and the attention GEMMs run in `cx.dtype`; RoPE, the softmax and the result are
    /// f32.
    pub(crate) fn forward(&self, x: Tensor<B, 3>, rope: &Rope<B>, keys: Keys<'_, B>, cx: Compute) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let qkv = self.qkv(x.reshape([b * t, d]), cx); // [B·T, (H + 2K)·Dh]
        let o = ember_kernels::profile::time(ember_kernels::profile::Part::Attention, || match keys {
            Keys::Own { start, docs } => self.attend_own(qkv, rope, (b, t), start, docs, cx),
            Keys::Cache(kv) => self.attend_cache(qkv, rope, (b, t), kv, cx),
        }); // [B·T, H·Dh]
        self.o_proj.forward(o, cx).reshape([b, t, d])
    }

    /// The three projections as one GEMM, the queries and keys normed per head where the model
    /// does so.
    ///
    /// # Shapes
    /// - x: `[N, D]` -> `[N, (H + 2K)·Dh]`, rows `[q | k | v]`
    fn qkv(&self, x: Tensor<B, 2>, cx: Compute) -> Tensor<B, 2> {
        let qkv = forward_packed(&[&self.q_proj, &self.k_proj, &self.v_proj], x, cx);
        match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) if self.qk_norm_whole => {
                let (q, k) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
                let queries = qn.forward(qkv.clone().narrow(1, 0, q), cx);
                let keys = kn.forward(qkv.clone().narrow(1, q, k), cx);
                Tensor::cat(vec![queries, keys, qkv.narrow(1, q + k, k)], 1)
            }
            (Some(qn), Some(kn)) => {
                let shape = (self.n_heads, self.n_kv_heads, self.head_dim);
                qk_norm_packed(qkv, qn.gain(), kn.gain(), shape, qn.eps, cx)
            }
            _ => qkv,
        }
    }

    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> `[B·T, H·Dh]`
    fn attend_own(
        &self,
        qkv: Tensor<B, 2>,
        rope: &Rope<B>,
        (b, t): (usize, usize),
        start: usize,
        docs: Option<&Documents>,
        cx: Compute,
    ) -> Tensor<B, 2> {
        let (h, k, dh) = (self.n_heads, self.n_kv_heads, self.head_dim);
        if let Some(docs) = docs {
            assert_eq!(docs.dims(), [b, t], "documents of another batch shape than the tokens");
        }
        if cx.dtype == DType::F32 && self.sliding_window.is_none_or(|w| w >= t) {
            // RoPE and causal GQA attention as one op, on the projections' own layout.
            return attention_rope_packed(qkv, rope, (b, t), (h, k, dh), (start, docs), self.scores, cx);
        }
        let [q, key, v] = self.split_heads(qkv, b, t);
        let (q, key, hidden) = rotate_own(rope, (q, key), (start, docs), self.sliding_window);
        let (key, v) = (repeat_kv(key, h / k), repeat_kv(v, h / k)); // [B, H, T, Dh]
        let o = masked_attention(q, key, v, Some(hidden), cx.dtype, self.scores);
        o.swap_dims(1, 2).reshape([b * t, h * dh]) // from [B, H, T, Dh]
    }

    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> `[B·T, H·Dh]`
    fn attend_cache(
        &self,
        qkv: Tensor<B, 2>,
        rope: &Rope<B>,
        (b, t): (usize, usize),
        kv: LayerKv<'_, B>,
        cx: Compute,
    ) -> Tensor<B, 2> {
        let (h, k, dh) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let [q, key, v] = self.split_heads(qkv, b, t);
        let starts = kv.starts();
        let (q, key) = (rope.apply_rows_op(q, &starts, cx), rope.apply_rows_op(key, &starts, cx)); // post-RoPE, as stored
        let o = kv.attend(q, key, v, (h / k, self.scores), cx); // [B, H, T, Dh]
        o.swap_dims(1, 2).reshape([b * t, h * dh])
    }

    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> q: `[B, H, T, Dh]`, k, v: `[B, K, T, Dh]`
    fn split_heads(&self, qkv: Tensor<B, 2>, b: usize, t: usize) -> [Tensor<B, 4>; 3] {
        let (h, k, dh) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let part =
            |start: usize, n: usize| qkv.clone().narrow(1, start * dh, n * dh).reshape([b, t, n, dh]).swap_dims(1, 2);
        [part(0, h), part(h, k), part(h + k, k)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{tiny_config, ModelConfig};
    use crate::linear::{Linear, Weight};
    use crate::TestBackend;
    use burn::module::Param;
    use burn::tensor::activation::softmax;
    use burn::tensor::{Bool, Distribution, Tolerance};

    type B = TestBackend;

    /// The config of `cfg`'s first attention, grouped.
    fn grouped(cfg: &ModelConfig) -> GroupedConfig {
        match cfg.attention(0) {
            crate::block::AttentionConfig::Grouped(g) => g,
            crate::block::AttentionConfig::Latent(_) => panic!("a grouped-query model"),
        }
    }

    /// Plain multi-head attention, written out: explicit scores, mask and softmax, one K/V head per
    /// query head.
    fn plain_mha(att: &Attention<B>, x: Tensor<B, 3>, rope: &Rope<B>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let (h, dh) = (att.n_heads, att.head_dim);
        let proj = |l: &Linear<B>| {
            let y = x.clone().matmul(l.weight.val().unsqueeze::<3>());
            let y = match &l.bias {
                Some(bias) => y + bias.val().unsqueeze::<3>(),
                None => y,
            };
            y.reshape([b, t, h, dh]).swap_dims(1, 2)
        };
        let q = rope.apply(proj(&att.q_proj), 0);
        let k = rope.apply(proj(&att.k_proj), 0);
        let v = proj(&att.v_proj);
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((dh as f64).sqrt()); // [B, H, T, T]
        let future = Tensor::<B, 2, Bool>::tril_mask([t, t], 0, &x.device()); // true above diagonal
        let p = softmax(scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY), 3);
        let o = p.matmul(v).swap_dims(1, 2).reshape([b, t, h * dh]);
        o.matmul(att.o_proj.weight.val().unsqueeze::<3>()).reshape([b, t, d])
    }

    #[test]
    fn gqa_with_as_many_kv_heads_as_heads_is_plain_mha() {
        let dev = Default::default();
        let cfg = ModelConfig { n_kv_heads: Some(4), qkv_bias: true, ..tiny_config() };
        let mut att = grouped(&cfg).init::<B>(&mut Init::new(1), &dev);
        // Non-zero biases so that the bias path is checked too.
        for lin in [&mut att.q_proj, &mut att.k_proj, &mut att.v_proj] {
            let n = lin.d_out();
            lin.bias = Some(Param::from_tensor(Tensor::random([n], Distribution::Normal(0.0, 0.5), &dev)));
        }
        let rope = Rope::new(cfg.max_seq_len, cfg.head_dim(), cfg.rope_theta, cfg.rope_layout, &dev);
        let x = Tensor::<B, 3>::random([2, 7, cfg.d_model], Distribution::Normal(0.0, 1.0), &dev);
        let got = att.forward(x.clone(), &rope, Keys::Own { start: 0, docs: None }, Compute::default()).into_data();
        let want = plain_mha(&att, x, &rope).into_data();
        got.assert_approx_eq::<f32>(&want, Tolerance::absolute(1e-5));
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv_weights() {
        let dev = Default::default();
        let cfg = tiny_config(); // 4 heads, 2 KV heads
        let gqa = grouped(&cfg).init::<B>(&mut Init::new(2), &dev);
        let mha_cfg = ModelConfig { n_kv_heads: Some(4), ..cfg.clone() };
        let mut mha = grouped(&mha_cfg).init::<B>(&mut Init::new(3), &dev);
        let dh = cfg.head_dim();
        // KV head j serves query heads 2j and 2j+1: repeat its columns.
        let repeat = |w: Tensor<B, 2>| {
            let d = w.dims()[0];
            w.reshape([d, 2, 1, dh]).expand([d, 2, 2, dh]).reshape([d, 4 * dh])
        };
        mha.q_proj.weight = Weight::Dense(Param::from_tensor(gqa.q_proj.weight.val()));
        mha.o_proj.weight = Weight::Dense(Param::from_tensor(gqa.o_proj.weight.val()));
        mha.k_proj.weight = Weight::Dense(Param::from_tensor(repeat(gqa.k_proj.weight.val())));
        mha.v_proj.weight = Weight::Dense(Param::from_tensor(repeat(gqa.v_proj.weight.val())));
        let rope = Rope::new(cfg.max_seq_len, dh, cfg.rope_theta, cfg.rope_layout, &dev);
        let x = Tensor::<B, 3>::random([1, 9, cfg.d_model], Distribution::Normal(0.0, 1.0), &dev);
        let a = gqa.forward(x.clone(), &rope, Keys::Own { start: 0, docs: None }, Compute::default()).into_data();
        let b = mha.forward(x, &rope, Keys::Own { start: 0, docs: None }, Compute::default()).into_data();
        a.assert_approx_eq::<f32>(&b, Tolerance::absolute(1e-6));
    }

    #[test]
    fn an_attention_is_built_and_run_from_its_own_config() {
        let dev = Default::default();
        let config = GroupedConfig { n_kv_heads: 1, ..GroupedConfig::new(16, 2) };
        config.validate().unwrap();
        let att = config.init::<B>(&mut Init::new(4), &dev);
        assert_eq!((att.k_proj.d_out(), att.q_proj.d_out()), (8, 16));
        let rope = Rope::new(8, 8, 10_000.0, crate::config::RopeLayout::HalfSplit, &dev);
        let x = Tensor::<B, 3>::random([1, 5, 16], Distribution::Normal(0.0, 1.0), &dev);
        let y = att.forward(x, &rope, Keys::Own { start: 0, docs: None }, Compute::default());
        assert_eq!(y.dims(), [1, 5, 16]);
    }
}
