//! Causal grouped-query self-attention: H query heads share K key/value heads, H/K queries per group
//! (Ainslie et al., 2023). MHA is K = H, MQA is K = 1.

use burn::module::Module;
use burn::tensor::activation::softmax;
use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor};

use crate::config::ModelConfig;
use crate::documents::Documents;
use crate::init::Init;
use crate::kv_cache::KvCache;
use crate::linear::{forward_packed, Linear};
use crate::ops::fused::attention_rope_packed;
use crate::ops::EmberBackend;
use crate::rope::Rope;

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
    #[module(skip)]
    n_heads: usize,
    #[module(skip)]
    n_kv_heads: usize,
    #[module(skip)]
    head_dim: usize,
    #[module(skip)]
    sliding_window: Option<usize>,
}

impl<B: Backend> Attention<B> {
    pub fn new(config: &ModelConfig, init: &mut Init, device: &B::Device) -> Self {
        let (d, dh) = (config.d_model, config.head_dim());
        let (h, k) = (config.n_heads, config.n_kv_heads());
        let std = config.init_std;
        // GPT-2: residual-branch outputs scaled by 1/sqrt(2L), two branches per block.
        let out_std = std / (2.0 * config.n_layers as f64).sqrt();
        Self {
            q_proj: Linear::new(init, d, h * dh, config.qkv_bias, std, device),
            k_proj: Linear::new(init, d, k * dh, config.qkv_bias, std, device),
            v_proj: Linear::new(init, d, k * dh, config.qkv_bias, std, device),
            o_proj: Linear::new(init, h * dh, d, false, out_std, device),
            n_heads: h,
            n_kv_heads: k,
            head_dim: dh,
            sliding_window: config.sliding_window,
        }
    }
}

impl<B: EmberBackend> Attention<B> {
    /// Self-attention over a whole sequence whose first position is absolute position `start`;
    /// with `docs`, over each packed document of a row alone (positions restart at `start`).
    ///
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    ///
    /// Projections and the attention GEMMs run in `compute`; RoPE, the softmax and the result are f32.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        start: usize,
        docs: Option<&Documents>,
        compute: DType,
    ) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let (h, k, dh) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let x_device = x.device();
        let qkv = self.qkv(x.reshape([b * t, d]), compute); // [B·T, (H + 2K)·Dh]
        let windowed = self.sliding_window.is_some_and(|w| w < t);
        if compute == DType::F32 && !windowed {
            // RoPE and causal GQA attention as one op, on the projections' own layout.
            let o = attention_rope_packed(qkv, rope, (b, t), (h, k, dh), start, docs); // [B·T, H·Dh]
            return self.o_proj.forward(o, compute).reshape([b, t, d]);
        }
        let [q, key, v] = self.split_heads(qkv, b, t);
        let (q, key, hidden) = match docs {
            Some(docs) => {
                let positions = docs.positions(start);
                let hidden = docs.hidden_mask::<B>(self.sliding_window, &x_device); // [B, 1, T, T]
                (rope.apply_positions(q, &positions), rope.apply_positions(key, &positions), hidden)
            }
            None => {
                let hidden = causal_mask::<B>(t, t, self.sliding_window, &x_device); // [1, 1, T, T]
                (rope.apply(q, start), rope.apply(key, start), hidden)
            }
        };
        let key = repeat_kv(key, h / k); // [B, H, T, Dh]
        let v = repeat_kv(v, h / k); //     [B, H, T, Dh]
        let o = masked_attention(q, key, v, Some(hidden), compute); // [B, H, T, Dh]
        let o = o.swap_dims(1, 2).reshape([b * t, h * dh]); // [B·T, H·Dh]
        self.o_proj.forward(o, compute).reshape([b, t, d])
    }
}

impl<B: EmberBackend> Attention<B> {
    /// The three projections as one GEMM.
    ///
    /// # Shapes
    /// - x: `[N, D]` -> `[N, (H + 2K)·Dh]`, rows `[q | k | v]`
    fn qkv(&self, x: Tensor<B, 2>, compute: DType) -> Tensor<B, 2> {
        forward_packed(&[&self.q_proj, &self.k_proj, &self.v_proj], x, compute)
    }

    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> q: `[B, H, T, Dh]`, k, v: `[B, K, T, Dh]`
    fn split_heads(&self, qkv: Tensor<B, 2>, b: usize, t: usize) -> [Tensor<B, 4>; 3] {
        let (h, k, dh) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let part =
            |start: usize, n: usize| qkv.clone().narrow(1, start * dh, n * dh).reshape([b, t, n, dh]).swap_dims(1, 2);
        [part(0, h), part(h, k), part(h + k, k)]
    }

    /// Self-attention of new positions against the cache: row `b`'s new tokens start at its cached
    /// length; their post-RoPE keys and values are stored in `cache` (layer `layer`) before the
    /// attention, which sees every stored key of the row that is not in the query's future.
    ///
    /// # Shapes
    /// - x: `[B, T, D]` -> `[B, T, D]`
    pub fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        rope: &Rope<B>,
        compute: DType,
        cache: &mut KvCache<B>,
        layer: usize,
    ) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let (h, k, dh) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let [q, key, v] = self.split_heads(self.qkv(x.reshape([b * t, d]), compute), b, t);
        let starts = cache.lens().to_vec();
        let q = rope.apply_rows(q, &starts); //     [B, H, T, Dh]
        let key = rope.apply_rows(key, &starts); // [B, K, T, Dh]
        let stored = cache.lens()[0] + 1;
        let o = if b == 1 && t == 1 && self.sliding_window.is_none_or(|w| stored <= w) {
            // One sequence, one new position: every stored key is visible; read the cache in place.
            let segments = cache.append_segments(layer, key, v); // [1, K, s_i, Dh] post-RoPE, as stored
            let segments = segments.into_iter().map(|(k2, v2)| (repeat_kv(k2, h / k), repeat_kv(v2, h / k))).collect();
            segmented_attention(q, segments, compute)
        } else {
            let (key, v) = cache.append(layer, key, v); //         [B, K, S, Dh] post-RoPE, as stored
            let hidden = cache.mask(t, self.sliding_window); //     [B, 1, T, S]
            masked_attention(q, repeat_kv(key, h / k), repeat_kv(v, h / k), hidden, compute)
            // [B, H, T, Dh]
        };
        let o = o.swap_dims(1, 2).reshape([b * t, h * dh]);
        self.o_proj.forward(o, compute).reshape([b, t, d])
    }
}

/// Attention of queries over keys and values held in segments (in position order), every key
/// visible: one softmax across all segments' scores, then the segments' values weighted by their
/// share. Equal to [`masked_attention`] over the concatenated segments without building them.
///
/// # Shapes
/// - q: `[B, H, T, Dh]`, segments: (`[B, H, s_i, Dh]`, `[B, H, s_i, Dh]`) -> `[B, H, T, Dh]`
pub fn segmented_attention<B: Backend>(
    q: Tensor<B, 4>,
    segments: Vec<(Tensor<B, 4>, Tensor<B, 4>)>,
    compute: DType,
) -> Tensor<B, 4> {
    let dh = q.dims()[3];
    let cast = |x: Tensor<B, 4>, d: DType| if x.dtype() == d { x } else { x.cast(d) };
    let q = cast(q, compute);
    let sizes: Vec<usize> = segments.iter().map(|(k, _)| k.dims()[2]).collect();
    let scores: Vec<Tensor<B, 4>> = segments
        .iter()
        .map(|(k, _)| cast(q.clone().matmul(cast(k.clone(), compute).swap_dims(2, 3)), DType::F32))
        .collect();
    let probs = softmax(Tensor::cat(scores, 3).div_scalar((dh as f64).sqrt()), 3); // [B, H, T, S]
    let mut start = 0;
    let mut out: Option<Tensor<B, 4>> = None;
    for ((_, v), size) in segments.into_iter().zip(sizes) {
        let p = cast(probs.clone().narrow(3, start, size), compute);
        let part = cast(p.matmul(cast(v, compute)), DType::F32);
        out = Some(match out {
            Some(acc) => acc + part,
            None => part,
        });
        start += size;
    }
    out.expect("at least one segment")
}

/// Attention with an explicit mask (true = hidden; `None`: every key visible), both GEMMs in
/// `compute`, the softmax in f32.
///
/// # Shapes
/// - q: `[B, H, T, Dh]`, k, v: `[B, H, S, Dh]`, hidden: `[B or 1, 1, T, S]` -> `[B, H, T, Dh]`
pub fn masked_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    hidden: Option<Tensor<B, 4, Bool>>,
    compute: DType,
) -> Tensor<B, 4> {
    let dh = q.dims()[3];
    let cast = |x: Tensor<B, 4>, d: DType| if x.dtype() == d { x } else { x.cast(d) };
    let scores = cast(q, compute).matmul(cast(k, compute).swap_dims(2, 3)); // [B, H, T, S]
    let scores = cast(scores, DType::F32).div_scalar((dh as f64).sqrt());
    let scores = match hidden {
        Some(hidden) => scores.mask_fill(hidden, f32::NEG_INFINITY),
        None => scores,
    };
    let probs = softmax(scores, 3);
    cast(cast(probs, compute).matmul(cast(v, compute)), DType::F32)
}

/// The causal mask of `t` queries at the last `t` of `s` key positions, with an optional sliding
/// window: key `j` is hidden from query `i` (at position `s - t + i`) when it is in the future or at
/// least `window` positions back.
///
/// # Shapes
/// -> `[1, 1, T, S]`, true where hidden
///
/// Built on the device from two index ranges (no `[T, S]` upload per layer and step).
pub fn causal_mask<B: Backend>(t: usize, s: usize, window: Option<usize>, device: &B::Device) -> Tensor<B, 4, Bool> {
    let pos = Tensor::<B, 1, Int>::arange((s - t) as i64..s as i64, device).reshape([t, 1]);
    let key = Tensor::<B, 1, Int>::arange(0..s as i64, device).reshape([1, s]);
    let ahead = key - pos; // [T, S]: j - pos
    let future = ahead.clone().greater_elem(0);
    let hidden = match window {
        Some(w) => future.bool_or(ahead.lower_equal_elem(-(w as i64))),
        None => future,
    };
    hidden.reshape([1, 1, t, s])
}

/// Shares each key/value head with its `rep` query heads: head `j` of the output is input head
/// `j / rep`. Burn's attention op needs equal head counts.
///
/// # Shapes
/// - x: `[B, K, S, Dh]` -> `[B, K·rep, S, Dh]`
pub fn repeat_kv<B: Backend>(x: Tensor<B, 4>, rep: usize) -> Tensor<B, 4> {
    if rep == 1 {
        return x;
    }
    let [b, k, s, dh] = x.dims();
    x.unsqueeze_dim::<5>(2) //         [B, K, 1, S, Dh]
        .expand([b, k, rep, s, dh]) // [B, K, rep, S, Dh]
        .reshape([b, k * rep, s, dh])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tiny_config;
    use crate::linear::Linear;
    use crate::TestBackend;
    use burn::module::Param;
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{Distribution, Tolerance};

    type B = TestBackend;

    #[test]
    fn causal_mask_matches_its_definition() {
        for (t, s, window) in
            [(1, 1, None), (5, 5, None), (3, 8, None), (6, 6, Some(2)), (4, 9, Some(3)), (7, 7, Some(20))]
        {
            let got = causal_mask::<B>(t, s, window, &Default::default()).into_data().to_vec::<bool>().unwrap();
            let mut want = Vec::with_capacity(t * s);
            for i in 0..t {
                let pos = s - t + i;
                want.extend((0..s).map(|j| j > pos || window.is_some_and(|w| pos - j >= w)));
            }
            assert_eq!(got, want, "t {t}, s {s}, window {window:?}");
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
        let mut att = Attention::<B>::new(&cfg, &mut Init::new(1), &dev);
        // Non-zero biases so that the bias path is checked too.
        for lin in [&mut att.q_proj, &mut att.k_proj, &mut att.v_proj] {
            let n = lin.d_out();
            lin.bias = Some(Param::from_tensor(Tensor::random([n], Distribution::Normal(0.0, 0.5), &dev)));
        }
        let rope = Rope::new(cfg.max_seq_len, cfg.head_dim(), cfg.rope_theta, cfg.rope_layout, &dev);
        let x = Tensor::<B, 3>::random([2, 7, cfg.d_model], Distribution::Normal(0.0, 1.0), &dev);
        let got = att.forward(x.clone(), &rope, 0, None, DType::F32).into_data();
        let want = plain_mha(&att, x, &rope).into_data();
        got.assert_approx_eq::<f32>(&want, Tolerance::absolute(1e-5));
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv_weights() {
        let dev = Default::default();
        let cfg = tiny_config(); // 4 heads, 2 KV heads
        let gqa = Attention::<B>::new(&cfg, &mut Init::new(2), &dev);
        let mha_cfg = ModelConfig { n_kv_heads: Some(4), ..cfg.clone() };
        let mut mha = Attention::<B>::new(&mha_cfg, &mut Init::new(3), &dev);
        let dh = cfg.head_dim();
        // KV head j serves query heads 2j and 2j+1: repeat its columns.
        let repeat = |w: Tensor<B, 2>| {
            let d = w.dims()[0];
            w.reshape([d, 2, 1, dh]).expand([d, 2, 2, dh]).reshape([d, 4 * dh])
        };
        mha.q_proj.weight = Param::from_tensor(gqa.q_proj.weight.val());
        mha.o_proj.weight = Param::from_tensor(gqa.o_proj.weight.val());
        mha.k_proj.weight = Param::from_tensor(repeat(gqa.k_proj.weight.val()));
        mha.v_proj.weight = Param::from_tensor(repeat(gqa.v_proj.weight.val()));
        let rope = Rope::new(cfg.max_seq_len, dh, cfg.rope_theta, cfg.rope_layout, &dev);
        let x = Tensor::<B, 3>::random([1, 9, cfg.d_model], Distribution::Normal(0.0, 1.0), &dev);
        let a = gqa.forward(x.clone(), &rope, 0, None, DType::F32).into_data();
        let b = mha.forward(x, &rope, 0, None, DType::F32).into_data();
        a.assert_approx_eq::<f32>(&b, Tolerance::absolute(1e-6));
    }

    /// Causal attention with both GEMMs in `compute` and the softmax in f32 (Burn's fused op would
    /// run its softmax in the input dtype under autodiff).
    ///
    /// # Shapes
    /// - q: `[B, H, T, Dh]`, k, v: `[B, H, S, Dh]` (f32) -> `[B, H, T, Dh]` (f32); query i sits at key
    ///   position `S - T + i`
    fn causal_attention_mixed<B: Backend>(
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        compute: DType,
    ) -> Tensor<B, 4> {
        let hidden = causal_mask::<B>(q.dims()[2], k.dims()[2], None, &q.device());
        masked_attention(q, k, v, Some(hidden), compute)
    }

    #[test]
    fn mixed_path_in_f32_equals_the_fused_op_also_with_a_cached_prefix() {
        let dev = Default::default();
        for (t, s) in [(7, 7), (1, 9), (3, 8)] {
            let q = Tensor::<B, 4>::random([2, 3, t, 8], Distribution::Normal(0.0, 1.0), &dev);
            let k = Tensor::<B, 4>::random([2, 3, s, 8], Distribution::Normal(0.0, 1.0), &dev);
            let v = Tensor::<B, 4>::random([2, 3, s, 8], Distribution::Normal(0.0, 1.0), &dev);
            let opts = AttentionModuleOptions { is_causal: true, ..Default::default() };
            let want = attention(q.clone(), k.clone(), v.clone(), None, None, opts).into_data();
            let got = causal_attention_mixed(q, k, v, DType::F32).into_data();
            got.assert_approx_eq::<f32>(&want, Tolerance::absolute(1e-5));
        }
    }
}
