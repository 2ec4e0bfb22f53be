//! Random windows of a token shard, as Burn `Dataset` items, batched into tensors by a `Batcher`.
//!
//! Which windows a batch holds is a pure function of (seed, stream): stream `s` of the training
//! sampler is micro-batch `s` of the run (examples in epochs, token windows at random: see
//! [`WindowSampler`]). A resumed run therefore draws exactly the batches the
//! stopped run would have drawn, from nothing more than its step counter.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::{backend::Backend, Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{DataError, Result};
use crate::shards::TokenShard;

/// One training example: `target[i]` is the token after `input[i]`, or `-1` where the position is
/// not scored (a prompt token, padding).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Window {
    pub input: Vec<u32>,
    pub target: Vec<i32>,
    /// Packed documents: for each position, the index of its document's first position in the
    /// window (`None`: the window is one document).
    pub docs: Option<Vec<u32>>,
}

/// A set of examples the trainer draws batches from: windows of a token stream, or packed
/// fine-tuning examples.
pub type Examples = Arc<dyn Dataset<Window>>;

/// Every window of `seq_len + 1` consecutive tokens of a shard; item `i` starts at token `i`.
#[derive(Debug, Clone)]
pub struct TokenWindows {
    shard: Arc<TokenShard>,
    seq_len: usize,
}

impl TokenWindows {
    /// `split` names the shard in the error when it is too short for one window.
    pub fn new(shard: Arc<TokenShard>, seq_len: usize, split: &str) -> Result<Self> {
        let needed = seq_len + 1;
        if shard.tokens.len() < needed {
            return Err(DataError::TooShort { split: split.into(), tokens: shard.tokens.len(), needed });
        }
        Ok(Self { shard, seq_len })
    }
}

impl Dataset<Window> for TokenWindows {
    fn get(&self, index: usize) -> Option<Window> {
        let t = self.seq_len;
        let w = self.shard.tokens.get(index..index + t + 1)?;
        Some(Window { input: w[..t].to_vec(), target: w[1..].iter().map(|&x| x as i32).collect(), docs: None })
    }

    fn len(&self) -> usize {
        self.shard.tokens.len() - self.seq_len
    }
}

/// Draws window indices: the same (seed, stream) always gives the same batch.
///
/// Two orders. `Random` (a token stream's windows, which overlap and are far too many to visit
/// each): every row of every micro-batch drawn at random, with replacement. `Epochs` (examples):
/// the run reads one stream of row positions, micro-batch `s` of `b` rows taking positions
/// `s·b .. (s+1)·b`; position `p` is row `perm_e[p mod N]` of epoch `e = p div N`, each epoch a
/// fresh seeded permutation of the `N` rows. Every row is read exactly once an epoch, and the rows
/// of an optimizer step depend only on the step's total rows (batch × accumulation × ranks), not
/// on how they are split; a step that crosses an epoch's end takes the next epoch's first rows
/// (nothing is dropped).
#[derive(Debug, Clone, Copy)]
pub struct WindowSampler {
    pub seed: u64,
    pub epochs: bool,
}

impl WindowSampler {
    /// Rows at random, with replacement.
    pub fn random(seed: u64) -> Self {
        Self { seed, epochs: false }
    }

    /// Rows in epochs: a seeded permutation of them each epoch.
    pub fn epochs(seed: u64) -> Self {
        Self { seed, epochs: true }
    }

    pub fn indices(&self, stream: u64, batch_size: usize, n_windows: usize) -> Vec<usize> {
        if self.epochs {
            return self.in_epochs(stream, batch_size, n_windows);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(stream);
        (0..batch_size).map(|_| rng.random_range(0..n_windows)).collect()
    }

    /// Positions `stream·batch ..` of the epochs' permutations.
    fn in_epochs(&self, stream: u64, batch_size: usize, n: usize) -> Vec<usize> {
        let Some(len) = u64::try_from(n).ok().filter(|&n| n > 0) else { return Vec::new() };
        let first = stream.saturating_mul(batch_size as u64);
        let mut perm: Option<(u64, Vec<usize>)> = None;
        (first..first.saturating_add(batch_size as u64))
            .map(|p| {
                let epoch = p / len;
                if perm.as_ref().map(|(e, _)| *e) != Some(epoch) {
                    perm = Some((epoch, self.permutation(epoch, n)));
                }
                perm.as_ref().map_or(0, |(_, order)| order[(p % len) as usize])
            })
            .collect()
    }

    /// The order of the `n` rows in epoch `epoch`: Fisher–Yates over a generator seeded by the
    /// sampler's seed, on a stream of its own for each epoch.
    pub fn permutation(&self, epoch: u64, n: usize) -> Vec<usize> {
        use rand::seq::SliceRandom;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6570_6f63_6873); // "epochs"
        rng.set_stream(epoch);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rng);
        order
    }

    pub fn batch<B: Backend>(
        &self,
        data: &dyn Dataset<Window>,
        stream: u64,
        batch_size: usize,
        device: &Device<B>,
    ) -> LmBatch<B> {
        LmBatcher.batch(self.windows(data, stream, batch_size), device)
    }

    /// The windows of batch `stream`, before they become tensors.
    pub fn windows(&self, data: &dyn Dataset<Window>, stream: u64, batch_size: usize) -> Vec<Window> {
        self.indices(stream, batch_size, data.len())
            .into_iter()
            .map(|i| data.get(i).expect("index drawn below len"))
            .collect()
    }
}

/// Inputs and next-token targets, `[B, T]` each.
#[derive(Debug, Clone)]
pub struct LmBatch<B: Backend> {
    pub inputs: Tensor<B, 2, Int>,
    pub targets: Tensor<B, 2, Int>,
    /// Packed documents, `[B·T]` first positions (see [`Window::docs`]); `None` when every row is
    /// one document.
    pub docs: Option<Vec<u32>>,
    /// Targets that are scored (not `-1`), counted on the host.
    pub scored: usize,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct LmBatcher;

impl<B: Backend> Batcher<B, Window, LmBatch<B>> for LmBatcher {
    fn batch(&self, items: Vec<Window>, device: &Device<B>) -> LmBatch<B> {
        let (b, t) = (items.len(), items.first().map_or(0, |w| w.input.len()));
        let inputs: Vec<i32> = items.iter().flat_map(|w| w.input.iter().map(|&x| x as i32)).collect();
        let targets: Vec<i32> = items.iter().flat_map(|w| w.target.iter().copied()).collect();
        let scored = targets.iter().filter(|&&x| x >= 0).count();
        // Rows without documents are one document: every position starts at 0.
        let docs = items
            .iter()
            .any(|w| w.docs.is_some())
            .then(|| items.iter().flat_map(|w| w.docs.clone().unwrap_or_else(|| vec![0; w.input.len()])).collect());
        LmBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [b, t]), device),
            targets: Tensor::from_data(TensorData::new(targets, [b, t]), device),
            docs,
            scored,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn::backend::Flex;

    fn windows(n: u32, t: usize) -> TokenWindows {
        TokenWindows::new(Arc::new(TokenShard::new((0..n).collect(), n)), t, "train").unwrap()
    }

    #[test]
    fn windows_are_shifted_by_one() {
        let w = windows(10, 4);
        assert_eq!(w.len(), 6);
        assert_eq!(w.get(2).unwrap(), Window { input: vec![2, 3, 4, 5], target: vec![3, 4, 5, 6], docs: None });
        assert_eq!(w.get(5).unwrap().target, vec![6, 7, 8, 9]);
        assert!(w.get(6).is_none());
    }

    #[test]
    fn too_short_a_split_is_an_error() {
        let e = TokenWindows::new(Arc::new(TokenShard::new(vec![1, 2, 3], 4)), 8, "val").unwrap_err();
        assert_eq!(
            e.to_string(),
            "the val split has 3 tokens, fewer than the 9 a window of seq_len + 1 needs; use a longer text or a shorter context"
        );
    }

    /// Over the epochs every row comes exactly once an epoch, each epoch in another order, and a
    /// step's rows are the same however it is split into micro-batches.
    #[test]
    fn epochs_read_every_row_once_whatever_the_split() {
        let s = WindowSampler::epochs(7);
        let n = 37;
        // 3 epochs and a bit, read in micro-batches of 5 (so micro-batches cross the epochs' ends).
        let rows: Vec<usize> = (0..24).flat_map(|stream| s.indices(stream, 5, n)).collect();
        for (e, epoch) in rows.chunks(n).take(3).enumerate() {
            let mut counts = vec![0; n];
            epoch.iter().for_each(|&r| counts[r] += 1);
            assert_eq!(counts, vec![1; n], "epoch {e}");
            assert_eq!(epoch, s.permutation(e as u64, n).as_slice());
        }
        assert_ne!(rows[..n], rows[n..2 * n], "each epoch is shuffled anew");
        assert_ne!(s.permutation(0, n), WindowSampler::epochs(8).permutation(0, n));
        // Step 3 of 8 rows: 8 × 1, 4 × 2, 2 × 4 (micro-batch streams numbered from the step's first).
        let whole = s.indices(3, 8, n);
        for (batch, accum) in [(4u64, 2u64), (2, 4)] {
            let split: Vec<usize> = (0..accum).flat_map(|j| s.indices(3 * accum + j, batch as usize, n)).collect();
            assert_eq!(split, whole, "{batch} x {accum}");
        }
        assert!(s.indices(0, 4, 0).is_empty());
    }

    #[test]
    fn batches_depend_only_on_seed_and_stream() {
        let s = WindowSampler::random(42);
        assert_eq!(s.indices(7, 12, 1000), s.indices(7, 12, 1000));
        assert_ne!(s.indices(7, 12, 1000), s.indices(8, 12, 1000));
        assert_ne!(s.indices(7, 12, 1000), WindowSampler::random(43).indices(7, 12, 1000));
        let w = windows(100, 5);
        let batch = s.batch::<B>(&w, 3, 4, &Default::default());
        assert_eq!(batch.inputs.dims(), [4, 5]);
        let x = batch.inputs.into_data().convert::<i64>().to_vec::<i64>().unwrap();
        let y = batch.targets.into_data().convert::<i64>().to_vec::<i64>().unwrap();
        assert!(x.iter().zip(&y).all(|(a, b)| b - a == 1));
    }
}
