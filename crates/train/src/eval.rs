//! Loss of a model on batches: the training objective and the periodic evaluation.
//!
//! Losses are token-weighted: a set of batches scores the sum of its scored tokens' losses divided
//! by the number of scored tokens, not a mean of per-batch means (which would weigh the tokens of
//! sparse batches more, as masked fine-tuning batches are).

use burn::data::dataset::Dataset;
use burn::tensor::Tensor;
use ember_data::{LmBatch, Window, WindowSampler};
use ember_kernels::EmberBackend;
use ember_model::moe::{load_balancing_loss, router_z_loss};
use ember_model::{Decoder, Documents};

/// Mean next-token cross-entropy over the scored targets of a batch, through the tiled LM head +
/// loss: the `[B·T, V]` logits are never held at once, in the forward or the backward pass. Rows
/// packed with documents are attended to document by document.
pub(crate) fn lm_loss<B: EmberBackend>(model: &Decoder<B>, batch: LmBatch<B>) -> Tensor<B, 1> {
    lm_loss_parts(model, batch).lm
}

/// A micro-batch's training objective and its parts.
pub(crate) struct LossParts<B: burn::tensor::backend::Backend> {
    /// The next-token loss plus, for a mixture of experts, the weighted auxiliary losses.
    pub objective: Tensor<B, 1>,
    /// The next-token loss alone.
    pub lm: Tensor<B, 1>,
    /// A mixture of experts' load-balancing loss, z-loss (unweighted) and token-expert pairs per
    /// layer and expert.
    pub moe: Option<(Tensor<B, 1>, Tensor<B, 1>, Vec<Vec<u32>>)>,
}

/// [`lm_loss`] with its parts: for a model with experts, `objective = lm + aux_loss_coef · aux +
/// z_loss_coef · z` over every layer's routing of the batch (as Hugging Face adds
/// `router_aux_loss_coef · aux_loss` to the loss).
pub(crate) fn lm_loss_parts<B: EmberBackend>(model: &Decoder<B>, batch: LmBatch<B>) -> LossParts<B> {
    let [b, t] = batch.inputs.dims();
    let d = model.config().d_model;
    let docs = batch.docs.map(|first| Documents::new(first, b, t).expect("the batcher writes valid document starts"));
    let (hidden, routes) = model.hidden_routed(batch.inputs, 0, docs.as_ref());
    let lm = model.loss(hidden.reshape([b * t, d]), batch.targets.reshape([b * t])); // [B·T, D] in
    let (Some(moe), Some(aux), Some(z)) =
        (model.config().moe.as_ref(), load_balancing_loss(&routes), router_z_loss(&routes))
    else {
        return LossParts { objective: lm.clone(), lm, moe: None };
    };
    let mut objective = lm.clone() + aux.clone().mul_scalar(moe.aux_loss_coef);
    if moe.z_loss_coef > 0.0 {
        objective = objective + z.clone().mul_scalar(moe.z_loss_coef);
    }
    let counts = routes.into_iter().map(|r| r.counts).collect();
    LossParts { objective, lm, moe: Some((aux, z, counts)) }
}

/// Sampler seeds of the fixed evaluation batches, one per split, apart from the training stream.
pub(crate) fn eval_seed(seed: u64, split: &str) -> u64 {
    let tag = split.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    seed ^ tag
}

/// Loss over every item of `data` once, in order, in batches of `batch_size`, token-weighted: the
/// held-out loss of fine-tuning examples (with `documents` packing, each example's completion loss
/// as it has alone).
pub(crate) fn evaluate_all<B: EmberBackend>(model: &Decoder<B>, data: &dyn Dataset<Window>, batch_size: usize) -> f64 {
    evaluate_all_part(model, data, batch_size, Part::WHOLE).mean()
}

/// Which batches of an evaluation a rank computes: batch i belongs to rank `i % world`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    pub rank: usize,
    pub world: usize,
}

impl Part {
    pub(crate) const WHOLE: Part = Part { rank: 0, world: 1 };

    pub(crate) fn keeps(&self, i: usize) -> bool {
        i % self.world.max(1) == self.rank
    }
}

/// A token-weighted loss in parts: `Σ loss_i · n_i` and `Σ n_i` over some batches, summed over
/// ranks before the division.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct LossSum {
    pub weighted: f64,
    pub scored: f64,
}

impl LossSum {
    pub(crate) fn mean(&self) -> f64 {
        if self.scored == 0.0 {
            0.0
        } else {
            self.weighted / self.scored
        }
    }
}

/// Loss over `iters` fixed batches, in parts: the sum over the batches of `part`, token-weighted
/// (the same batches at every evaluation, so that the numbers are comparable across steps and runs).
pub(crate) fn evaluate_part<B: EmberBackend>(
    model: &Decoder<B>,
    data: &dyn Dataset<Window>,
    seed: u64,
    iters: usize,
    batch_size: usize,
    part: Part,
) -> LossSum {
    let sampler = WindowSampler::random(seed);
    let batches =
        (0..iters as u64).filter(|&i| part.keeps(i as usize)).map(|i| sampler.windows(data, i, batch_size)).collect();
    loss_of_batches(model, batches)
}

/// [`evaluate_all`]'s sum over the batches of `part`.
pub(crate) fn evaluate_all_part<B: EmberBackend>(
    model: &Decoder<B>,
    data: &dyn Dataset<Window>,
    batch_size: usize,
    part: Part,
) -> LossSum {
    let items: Vec<Window> = (0..data.len()).filter_map(|i| data.get(i)).collect();
    let batches =
        items.chunks(batch_size.max(1)).enumerate().filter(|(i, _)| part.keeps(*i)).map(|(_, c)| c.to_vec()).collect();
    loss_of_batches(model, batches)
}

fn loss_of_batches<B: EmberBackend>(model: &Decoder<B>, batches: Vec<Vec<Window>>) -> LossSum {
    use burn::data::dataloader::batcher::Batcher;
    use ember_data::LmBatcher;
    if batches.is_empty() {
        return LossSum::default();
    }
    let device = model.device();
    let mut scored = Vec::with_capacity(batches.len());
    // Every batch's loss stays on the device; they are read back together, once.
    let losses: Vec<Tensor<B, 1>> = batches
        .into_iter()
        .map(|items| {
            let batch: LmBatch<B> = LmBatcher.batch(items, &device);
            scored.push(batch.scored);
            lm_loss(model, batch)
        })
        .collect();
    let losses = Tensor::cat(losses, 0).into_data().convert::<f64>();
    let losses = losses.as_slice::<f64>().expect("converted to f64");
    LossSum {
        weighted: losses.iter().zip(&scored).map(|(l, &n)| l * n as f64).sum::<f64>(),
        scored: scored.iter().sum::<usize>() as f64,
    }
}

/// Mean loss of the windows starting at `starts`, as one batch (the training objective).
#[cfg(test)]
pub(crate) fn windows_loss<B: EmberBackend>(model: &Decoder<B>, data: &dyn Dataset<Window>, starts: &[usize]) -> f64 {
    use burn::data::dataloader::batcher::Batcher;
    use burn::tensor::ElementConversion;
    use ember_data::LmBatcher;
    let device = model.device();
    let items = starts.iter().map(|&i| data.get(i).expect("window start in range")).collect();
    let batch = <LmBatcher as Batcher<B, Window, LmBatch<B>>>::batch(&LmBatcher, items, &device);
    lm_loss(model, batch).into_scalar().elem::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::ElementConversion;
    use burn::tensor::{Int, TensorData};
    use rand::{Rng, SeedableRng};

    type B = burn::backend::Flex;

    #[test]
    fn loss_at_initialisation_is_ln_vocab() {
        let config = crate::config::TrainConfig::from_toml(
            include_str!("../../../configs/nano.toml"),
            std::path::Path::new("configs/nano.toml"),
        )
        .unwrap();
        let dev = Default::default();
        for (vocab, tied) in [(65, false), (65, true), (512, false)] {
            let cfg = ember_model::ModelConfig { vocab_size: vocab, tie_embeddings: tied, ..config.model.clone() };
            let model = Decoder::<B>::new(&cfg, 1337, &dev).unwrap();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
            let ids: Vec<i32> = (0..12 * 65).map(|_| rng.random_range(0..vocab as i32)).collect();
            let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [12, 65]), &dev);
            let batch = LmBatch {
                inputs: tokens.clone().narrow(1, 0, 64),
                targets: tokens.narrow(1, 1, 64),
                docs: None,
                scored: 12 * 64,
            };
            let loss = lm_loss(&model, batch).into_scalar().elem::<f64>();
            let ln_v = (vocab as f64).ln();
            assert!((loss - ln_v).abs() < 0.1, "vocab {vocab} tied {tied}: loss {loss}, ln V {ln_v}");
        }
    }
}
