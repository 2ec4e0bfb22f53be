//! Next-token cross-entropy: the plain composition (the reference) and a tiled LM-head + loss whose
//! memory does not grow with `N·V`.
//!
//! The tiled forward walks tiles of `rows × vocab` logits, keeping a running max and sum per row
//! (online log-sum-exp), and saves only the per-row log-sum-exp. The backward recomputes each tile's
//! logits, turns them into `softmax - onehot`, and multiplies them into `dH` and `dW` at once.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::log_softmax;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{backend::Backend, DType, IndexingUpdateOp, Int, Tensor};

use super::{float, int};

/// Target id that takes no part in the loss (padding, prompt tokens).
pub const IGNORE: i32 = -1;

/// Tile sizes of the chunked loss, and the dtype of its GEMMs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkSpec {
    /// Rows (tokens) per tile.
    pub rows: usize,
    /// Vocabulary entries per tile.
    pub vocab: usize,
    /// dtype of the logits GEMMs (f32, bf16, f16); softmax and the loss are always f32.
    pub compute: DType,
}

impl ChunkSpec {
    /// Tiles of at most 32,768 vocabulary entries and about 8M logits (32 MB in f32).
    pub fn auto(n_rows: usize, vocab_size: usize, compute: DType) -> Self {
        const TILE: usize = 8 << 20;
        let vocab = vocab_size.clamp(1, 32_768);
        Self { rows: (TILE / vocab).clamp(1, n_rows.max(1)), vocab, compute }
    }
}

/// Mean negative log-likelihood of `targets` under `logits` over the targets that are not
/// [`IGNORE`]. This plain version holds the full `[N, V]` log-probabilities.
///
/// # Shapes
/// - logits: `[N, V]`, targets: `[N]` -> `[1]`
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [n, _] = logits.dims();
    let keep = targets.clone().greater_equal_elem(0).float(); // [N] 1.0 where scored
    let safe = targets.clamp_min(0).reshape([n, 1]); //         [N, 1] ignored rows read id 0
    let logp = log_softmax(logits, 1).gather(1, safe).reshape([n]); // [N]
    let count = keep.clone().sum().clamp_min(1.0);
    -(logp * keep).sum() / count
}

/// The plain LM head and loss: `[N, V]` logits in full, then [`cross_entropy`].
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
pub fn lm_head_loss_reference<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    compute: DType,
) -> Tensor<B, 1> {
    let logits = cast(hidden, compute).matmul(cast(weight, compute)); // [N, V]
    cross_entropy(cast(logits, DType::F32), targets)
}

fn cast<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        x
    } else {
        x.cast(dtype)
    }
}

/// The weight cut into vocabulary tiles, in the compute dtype: `(first id, [D, cv])`.
fn vocab_tiles<B: Backend>(weight: &Tensor<B, 2>, spec: &ChunkSpec) -> Vec<(usize, Tensor<B, 2>)> {
    let v = weight.dims()[1];
    (0..v)
        .step_by(spec.vocab)
        .map(|v0| (v0, cast(weight.clone().narrow(1, v0, spec.vocab.min(v - v0)), spec.compute)))
        .collect()
}

/// Where each row's target falls in the tile starting at `v0` of width `cv`: its column (clamped
/// into the tile) and 1.0 if it is really there, else 0.0.
///
/// # Shapes
/// - targets: `[R]` -> (`[R, 1]` Int, `[R, 1]`)
fn target_in_tile<B: Backend>(targets: &Tensor<B, 1, Int>, v0: usize, cv: usize) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let r = targets.dims()[0];
    let local = targets.clone().sub_scalar(v0 as i64); // [R] column inside the tile if in range
    let inside = local.clone().greater_equal_elem(0).float() * local.clone().lower_elem(cv as i64).float();
    (local.clamp(0, cv as i64 - 1).reshape([r, 1]), inside.reshape([r, 1]))
}

pub struct ForwardOut<B: Backend> {
    /// Mean loss, `[1]`.
    pub loss: Tensor<B, 1>,
    /// Log-sum-exp of each row's logits, `[N]` (saved for the backward).
    pub lse: Tensor<B, 1>,
}

/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]`
pub fn chunked_forward<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    spec: ChunkSpec,
) -> ForwardOut<B> {
    let [n, _] = hidden.dims();
    let device = hidden.device();
    let tiles = vocab_tiles(&weight, &spec);
    let keep = targets.clone().greater_equal_elem(0).float(); // [N]
    let count = keep.clone().sum().clamp_min(1.0);
    let mut total = Tensor::<B, 1>::zeros([1], &device);
    let mut lse_parts = Vec::new();
    for r0 in (0..n).step_by(spec.rows) {
        let nr = spec.rows.min(n - r0);
        let h = cast(hidden.clone().narrow(0, r0, nr), spec.compute); // [R, D]
        let t = targets.clone().narrow(0, r0, nr); //                   [R]
        let mut max: Option<Tensor<B, 2>> = None; // [R, 1] running max
        let mut sum = Tensor::<B, 2>::zeros([nr, 1], &device); // [R, 1] running sum of exp(logit - max)
        let mut picked = Tensor::<B, 2>::zeros([nr, 1], &device); // [R, 1] the target's logit
        for (v0, w) in &tiles {
            let cv = w.dims()[1];
            let logits = cast(h.clone().matmul(w.clone()), DType::F32); // [R, cv]
            let tile_max = logits.clone().max_dim(1); //                     [R, 1]
            let new_max = match &max {
                Some(m) => m.clone().max_pair(tile_max),
                None => tile_max,
            };
            if let Some(m) = &max {
                sum = sum * (m.clone() - new_max.clone()).exp();
            }
            sum = sum + (logits.clone() - new_max.clone()).exp().sum_dim(1);
            max = Some(new_max);
            let (col, inside) = target_in_tile(&t, *v0, cv);
            picked = picked + logits.gather(1, col) * inside;
        }
        let lse = max.expect("at least one vocabulary tile") + sum.log(); // [R, 1]
        let rows = (lse.clone() - picked).reshape([nr]) * keep.clone().narrow(0, r0, nr);
        total = total + rows.sum();
        lse_parts.push(lse.reshape([nr]));
    }
    ForwardOut { loss: total / count, lse: Tensor::cat(lse_parts, 0) }
}

/// Gradients of the mean loss times `grad` (`[1]`) with respect to `hidden` and (when
/// `need_weight`) `weight`, in their dtypes.
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]`, lse: `[N]`, grad: `[1]` -> (`[N, D]`, `[D, V]`)
pub fn chunked_backward<B: Backend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    lse: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    spec: ChunkSpec,
    need_weight: bool,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let [n, _] = hidden.dims();
    let (h_dtype, w_dtype) = (hidden.dtype(), weight.dtype());
    let tiles = vocab_tiles(&weight, &spec);
    let tiles_t: Vec<Tensor<B, 2>> = tiles.iter().map(|(_, w)| w.clone().transpose()).collect(); // [cv, D]
    let keep = targets.clone().greater_equal_elem(0).float(); // [N]
    let count = keep.clone().sum().clamp_min(1.0);
    let coef = cast(grad, DType::F32) / count; // [1] d(loss)/d(row loss) of a scored row
    let mut dw: Vec<Option<Tensor<B, 2>>> = vec![None; tiles.len()];
    let mut dh_parts = Vec::new();
    for r0 in (0..n).step_by(spec.rows) {
        let nr = spec.rows.min(n - r0);
        let h = cast(hidden.clone().narrow(0, r0, nr), spec.compute); // [R, D]
        let h_t = h.clone().transpose(); //                              [D, R]
        let t = targets.clone().narrow(0, r0, nr);
        let lse = lse.clone().narrow(0, r0, nr).reshape([nr, 1]);
        let scale = (keep.clone().narrow(0, r0, nr) * coef.clone()).reshape([nr, 1]); // [R, 1]
        let mut dh: Option<Tensor<B, 2>> = None;
        for (j, (v0, w)) in tiles.iter().enumerate() {
            let cv = w.dims()[1];
            let logits = cast(h.clone().matmul(w.clone()), DType::F32); // [R, cv]
            let probs = (logits - lse.clone()).exp(); //                   [R, cv] softmax
            let (col, inside) = target_in_tile(&t, *v0, cv);
            let dlogits = probs.scatter(1, col, -inside, IndexingUpdateOp::Add) * scale.clone(); // softmax - onehot
            let dlogits = cast(dlogits, spec.compute);
            let dh_tile = cast(dlogits.clone().matmul(tiles_t[j].clone()), DType::F32); // [R, D]
            dh = Some(match dh {
                Some(acc) => acc + dh_tile,
                None => dh_tile,
            });
            if need_weight {
                let dw_tile = cast(h_t.clone().matmul(dlogits), DType::F32); // [D, cv]
                dw[j] = Some(match dw[j].take() {
                    Some(acc) => acc + dw_tile,
                    None => dw_tile,
                });
            }
        }
        dh_parts.push(dh.expect("at least one vocabulary tile"));
    }
    let dh = Tensor::cat(dh_parts, 0);
    let dw = need_weight.then(|| Tensor::cat(dw.into_iter().map(|t| t.expect("every tile visited")).collect(), 1));
    (cast(dh, h_dtype), dw.map(|dw| cast(dw, w_dtype)))
}

/// A backend's tiled LM-head loss; the default method is the tiled composition of tensor ops,
/// under autodiff one node whose backward recomputes each tile.
pub trait LmHeadLossOps: Backend {
    /// Mean cross-entropy of `targets` under the logits `hidden · weight`, computed over tiles of rows
    /// and vocabulary so that the `[N, V]` logits never exist at once. Targets equal to [`IGNORE`] do
    /// not count. Returns `[1]`.
    ///
    /// # Shapes
    /// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
    fn lm_head_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
    ) -> FloatTensor<Self> {
        let (h, w, t) = (float::<Self, 2>(hidden), float::<Self, 2>(weight), int::<Self, 1>(targets));
        chunked_forward(h, w, t, spec).loss.into_primitive().tensor()
    }
}

impl LmHeadLossOps for Flex {}

impl<B: LmHeadLossOps, C: CheckpointStrategy> LmHeadLossOps for Autodiff<B, C> {
    fn lm_head_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        spec: ChunkSpec,
    ) -> FloatTensor<Self> {
        /// The backward recomputes each tile's logits from `hidden`, `weight` and the per-row
        /// log-sum-exp saved by the forward: memory O(N·D + D·V + tile), never O(N·V).
        #[derive(Debug)]
        struct LmHeadCrossEntropy;

        impl<B: Backend> Backward<B, 2> for LmHeadCrossEntropy {
            type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, FloatTensor<B>, ChunkSpec);

            fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
                let [node_hidden, node_weight] = ops.parents;
                let grad = float::<B, 1>(grads.consume::<B>(&ops.node));
                let (hidden, weight, targets, lse, spec) = ops.state;
                let (dh, dw) = chunked_backward(
                    float::<B, 2>(hidden),
                    float::<B, 2>(weight),
                    int::<B, 1>(targets),
                    float::<B, 1>(lse),
                    grad,
                    spec,
                    // A frozen head (LoRA) has no node: its gradient, a third of the work, is skipped.
                    node_weight.is_some(),
                );
                if let Some(node) = node_hidden {
                    grads.register::<B>(node.id, dh.into_primitive().tensor());
                }
                if let (Some(node), Some(dw)) = (node_weight, dw) {
                    grads.register::<B>(node.id, dw.into_primitive().tensor());
                }
            }
        }

        let forward = |h: FloatTensor<B>, w: FloatTensor<B>, t: IntTensor<B>| {
            chunked_forward(float::<B, 2>(h), float::<B, 2>(w), int::<B, 1>(t), spec)
        };
        match LmHeadCrossEntropy.prepare::<C>([hidden.node.clone(), weight.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = forward(hidden.primitive.clone(), weight.primitive.clone(), targets.clone());
                let state = (hidden.primitive, weight.primitive, targets, out.lse.into_primitive().tensor(), spec);
                prep.finish(state, out.loss.into_primitive().tensor())
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(forward(hidden.primitive, weight.primitive, targets).loss.into_primitive().tensor())
            }
        }
    }
}

/// Tensor-level entry point of [`LmHeadLossOps::lm_head_cross_entropy`].
///
/// # Shapes
/// - hidden: `[N, D]`, weight: `[D, V]`, targets: `[N]` -> `[1]`
pub fn lm_head_cross_entropy<B: LmHeadLossOps>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    spec: ChunkSpec,
) -> Tensor<B, 1> {
    float(B::lm_head_cross_entropy(
        hidden.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        targets.into_primitive(),
        spec,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, TensorData};
    use rand::{Rng, SeedableRng};

    type AB = Autodiff<Flex>;

    #[test]
    fn plain_cross_entropy_matches_a_hand_computation_and_skips_ignored_targets() {
        let dev = Default::default();
        let logits = Tensor::<Flex, 2>::from_data([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [3.0, -1.0, 0.0]], &dev);
        let targets = Tensor::<Flex, 1, Int>::from_data(TensorData::new(vec![2, IGNORE, 0], [3]), &dev);
        let got = cross_entropy(logits, targets).into_scalar();
        let nll = |row: [f64; 3], t: usize| row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[t];
        let want = (nll([1.0, 2.0, 3.0], 2) + nll([3.0, -1.0, 0.0], 0)) / 2.0;
        assert!((got as f64 - want).abs() < 1e-6, "{got} vs {want}");
    }

    fn max_rel(a: &TensorData, b: &TensorData) -> f64 {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let scale = b.iter().fold(0f64, |m, &x| m.max(x.abs() as f64)).max(1e-12);
        a.iter().zip(&b).fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs())) / scale
    }

    /// Loss and both gradients of the tiled op against the plain composition.
    fn compare(n: usize, d: usize, v: usize, spec: ChunkSpec, ignored: usize, tied: bool) {
        let dev = Default::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((n * 31 + v) as u64);
        let mut targets: Vec<i32> = (0..n).map(|_| rng.random_range(0..v as i32)).collect();
        for i in 0..ignored.min(n) {
            targets[(i * 7) % n] = IGNORE;
        }
        let t = || Tensor::<AB, 1, Int>::from_data(TensorData::new(targets.clone(), [n]), &dev);
        let h0 = Tensor::<Flex, 2>::random([n, d], Distribution::Normal(0.0, 1.0), &dev);
        let w0 = Tensor::<Flex, 2>::random(if tied { [v, d] } else { [d, v] }, Distribution::Normal(0.0, 0.3), &dev);
        let run = |chunked: bool| {
            let h = Tensor::<AB, 2>::from_inner(h0.clone()).require_grad();
            let w = Tensor::<AB, 2>::from_inner(w0.clone()).require_grad();
            let head = if tied { w.clone().transpose() } else { w.clone() };
            let loss = if chunked {
                lm_head_cross_entropy(h.clone(), head, t(), spec)
            } else {
                lm_head_loss_reference(h.clone(), head, t(), DType::F32)
            };
            let grads = loss.backward();
            (loss.into_data(), h.grad(&grads).unwrap().into_data(), w.grad(&grads).unwrap().into_data())
        };
        let (l1, dh1, dw1) = run(true);
        let (l0, dh0, dw0) = run(false);
        let tag = format!("n {n} d {d} v {v} {spec:?} ignored {ignored} tied {tied}");
        assert!(max_rel(&l1, &l0) < 1e-5, "loss {tag}: {l1:?} vs {l0:?}");
        assert!(max_rel(&dh1, &dh0) < 1e-5, "dH {tag}: {}", max_rel(&dh1, &dh0));
        assert!(max_rel(&dw1, &dw0) < 1e-5, "dW {tag}: {}", max_rel(&dw1, &dw0));
    }

    #[test]
    fn chunked_equals_plain_values_and_gradients() {
        let spec = |rows, vocab| ChunkSpec { rows, vocab, compute: DType::F32 };
        // Vocabulary and rows not divisible by the tile sizes; a single tile; one row at a time.
        compare(37, 16, 101, spec(8, 24), 0, false);
        compare(37, 16, 101, spec(8, 24), 5, false);
        compare(12, 8, 65, spec(64, 128), 3, false);
        compare(5, 8, 33, spec(1, 7), 1, false);
        compare(1, 4, 9, spec(1, 4), 0, false);
        // The head tied to an embedding table ([V, D], transposed).
        compare(20, 8, 50, spec(6, 16), 2, true);
    }

    #[test]
    fn a_frozen_head_gets_no_gradient_and_the_hidden_one_is_unchanged() {
        let dev = Default::default();
        let (n, d, v) = (19, 8, 45);
        let t =
            || Tensor::<AB, 1, Int>::from_data(TensorData::new((0..n as i32).map(|i| i * 7 % 45).collect(), [n]), &dev);
        let h0 = Tensor::<Flex, 2>::random([n, d], Distribution::Normal(0.0, 1.0), &dev);
        let w0 = Tensor::<Flex, 2>::random([d, v], Distribution::Normal(0.0, 0.3), &dev);
        let spec = ChunkSpec { rows: 6, vocab: 16, compute: DType::F32 };
        let dh = |frozen: bool| {
            let h = Tensor::<AB, 2>::from_inner(h0.clone()).require_grad();
            let w = Tensor::<AB, 2>::from_inner(w0.clone());
            let w = if frozen { w } else { w.require_grad() };
            let grads = lm_head_cross_entropy(h.clone(), w.clone(), t(), spec).backward();
            assert_eq!(w.grad(&grads).is_some(), !frozen, "frozen {frozen}");
            h.grad(&grads).expect("hidden gradient").into_data()
        };
        assert_eq!(dh(true), dh(false));
    }

    #[test]
    fn all_ignored_gives_zero_loss_and_zero_gradients() {
        let dev = Default::default();
        let h = Tensor::<AB, 2>::random([4, 3], Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let w = Tensor::<AB, 2>::random([3, 5], Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let t = Tensor::<AB, 1, Int>::from_data(TensorData::new(vec![IGNORE; 4], [4]), &dev);
        let loss = lm_head_cross_entropy(h.clone(), w.clone(), t, ChunkSpec::auto(4, 5, DType::F32));
        let grads = loss.backward();
        assert_eq!(loss.into_scalar(), 0.0);
        assert_eq!(h.grad(&grads).unwrap().abs().max().into_scalar(), 0.0);
        assert_eq!(w.grad(&grads).unwrap().abs().max().into_scalar(), 0.0);
    }

    #[test]
    fn bf16_gemms_stay_close_to_f32() {
        let dev = Default::default();
        let h = Tensor::<Flex, 2>::random([32, 16], Distribution::Normal(0.0, 1.0), &dev);
        let w = Tensor::<Flex, 2>::random([16, 40], Distribution::Normal(0.0, 0.3), &dev);
        let t = Tensor::<Flex, 1, Int>::from_data(
            TensorData::new((0..32).map(|i| i % 40).collect::<Vec<i32>>(), [32]),
            &dev,
        );
        let f32_loss = lm_head_loss_reference(h.clone(), w.clone(), t.clone(), DType::F32).into_scalar();
        let spec = ChunkSpec { rows: 8, vocab: 16, compute: DType::BF16 };
        let out = chunked_forward(h, w, t, spec);
        assert_eq!(out.loss.dtype(), DType::F32);
        let bf16_loss = out.loss.into_scalar();
        assert!((bf16_loss - f32_loss).abs() < 2e-2 * f32_loss.abs(), "{bf16_loss} vs {f32_loss}");
    }

    #[test]
    fn auto_tiles_bound_the_tile() {
        let s = ChunkSpec::auto(8192, 128_256, DType::F32);
        assert_eq!(s.vocab, 32_768);
        assert!(s.rows * s.vocab <= 8 << 20);
        let s = ChunkSpec::auto(768, 65, DType::F32);
        assert_eq!((s.rows, s.vocab), (768, 65));
    }
}
