//! Cross-entropy of next-token prediction.

use burn::tensor::activation::log_softmax;
use burn::tensor::{backend::Backend, Int, Tensor};

/// Target id that takes no part in the loss (padding, prompt tokens).
pub const IGNORE: i32 = -1;

/// Mean negative log-likelihood of `targets` under `logits`, over the targets that are not
/// [`IGNORE`]. This plain version holds the full `[N, V]` log-probabilities.
///
/// # Shapes
/// - logits: `[N, V]`, targets: `[N]` -> `[1]`
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [n, _] = logits.dims();
    let keep = targets.clone().greater_equal_elem(0); //         [N] true where scored
    let safe = targets.clamp_min(0).reshape([n, 1]); //          [N, 1] ignored rows read id 0
    let logp = log_softmax(logits, 1).gather(1, safe).reshape([n]); // [N]
    let weight = keep.float(); //                                 [N] 1.0 or 0.0
    let count = weight.clone().sum().clamp_min(1.0);
    -(logp * weight).sum() / count
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    type B = burn::backend::Flex;

    #[test]
    fn matches_a_hand_computation_and_skips_ignored_targets() {
        let dev = Default::default();
        let logits = Tensor::<B, 2>::from_data([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [3.0, -1.0, 0.0]], &dev);
        let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![2, IGNORE, 0], [3]), &dev);
        let got = cross_entropy(logits, targets).into_scalar();
        let nll = |row: [f64; 3], t: usize| {
            let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
            lse - row[t]
        };
        let want = (nll([1.0, 2.0, 3.0], 2) + nll([3.0, -1.0, 0.0], 0)) / 2.0;
        assert!((got as f64 - want).abs() < 1e-6, "{got} vs {want}");
    }
}
