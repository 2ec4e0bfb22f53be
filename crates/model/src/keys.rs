//! Where an attention call's keys come from, and the RoPE and mask of a call's own positions:
//! what the plain and the latent attention share.

use burn::tensor::{backend::Backend, Bool, Tensor};

use ember_kernels::attention::causal_mask;
use ember_kernels::documents::Documents;
use ember_kernels::rope::Rope;

use crate::kv_cache::LayerKv;

/// RoPE of a call's own queries and keys at their positions, and what each query may not see:
/// causally from absolute position `start`, within `window`; with `docs`, each packed document's
/// positions restart at `start` and it sees only itself.
///
/// # Shapes
/// - q: `[B, H, T, D]`, k: `[B, K, T, D]` -> the same, and the mask `[B or 1, 1, T, T]` (true where hidden)
pub(crate) fn rotate_own<B: Backend>(
    rope: &Rope<B>,
    (q, k): (Tensor<B, 4>, Tensor<B, 4>),
    (start, docs): (usize, Option<&Documents>),
    window: Option<usize>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4, Bool>) {
    let [b, _, t, _] = q.dims();
    let device = q.device();
    match docs {
        Some(docs) => {
            assert_eq!(docs.dims(), [b, t], "documents of another batch shape than the tokens");
            let positions = docs.positions(start);
            let hidden = docs.hidden_mask::<B>(window, &device);
            (rope.apply_positions(q, &positions), rope.apply_positions(k, &positions), hidden)
        }
        None => (rope.apply(q, start), rope.apply(k, start), causal_mask::<B>(t, t, window, &device)),
    }
}

/// Where an attention call's keys and values come from.
pub(crate) enum Keys<'a, B: Backend> {
    /// The call's own: whole sequences whose first position is absolute position `start`; with
    /// `docs`, each packed document of a row alone (its positions restart at `start`).
    Own { start: usize, docs: Option<&'a Documents> },
    /// The cache's: each row's new positions follow its cached ones, and their keys and values are
    /// stored before the attention, which sees every stored key not in the query's future.
    Cache(LayerKv<'a, B>),
}
