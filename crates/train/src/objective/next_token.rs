//! The language-modelling objective: next-token cross-entropy over the scored targets,
//! token-weighted over a step's micro-batches; for a mixture of experts, plus the weighted
//! load-balancing and router z-losses, the experts' loads recorded, and DeepSeek-V3's
//! "auxiliary-loss-free" balancing of the selection bias after each step.

use burn::optim::GradientsParams;
use burn::tensor::{Device, ElementConversion, Tensor};
use ember_data::{LmBatch, LmBatcher, Window};
use ember_kernels::TrainBackend;
use ember_model::Decoder;

use super::{Accumulation, EvalBatches, Evaluated, MicroBatches, Objective, Split, Splits};
use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::eval::{evaluate_all_part, evaluate_part, lm_loss_parts, LossSum, Part};
use crate::metrics::StepRecord;

/// Next-token prediction on a run's splits.
pub(crate) struct NextToken<'a> {
    splits: Splits<'a>,
    eval: EvalBatches,
    /// A mixture of experts: experts per layer and the first layer with experts.
    experts: Option<(usize, usize)>,
    /// LoRA: the base, the selection bias with it, stays as loaded.
    frozen_base: bool,
}

impl<'a> NextToken<'a> {
    pub(crate) fn new(config: &TrainConfig, splits: Splits<'a>) -> Self {
        Self {
            splits,
            eval: EvalBatches::of(config),
            experts: config.model.moe.as_ref().map(|m| (m.n_experts, m.dense_layers)),
            frozen_base: config.lora.is_some(),
        }
    }

    /// The experts' sums of a step's sums (the loss left out), for a mixture of experts.
    fn moe_sums(&self, sums: &[f64]) -> Option<MoeSums> {
        let (experts, first_layer) = self.experts?;
        (sums.len() >= 2).then(|| MoeSums {
            aux: sums[0],
            z: sums[1],
            experts,
            first_layer,
            counts: sums[2..].to_vec(),
        })
    }
}

impl<B: TrainBackend> Objective<B> for NextToken<'_> {
    fn forward_backward(
        &self,
        model: &Decoder<B>,
        batches: MicroBatches<'_, B>,
    ) -> Result<(GradientsParams, Vec<f64>), TrainError> {
        let all: Vec<Vec<Window>> = batches.indices.iter().map(|idx| batches.rows(idx)).collect();
        let total = all.iter().map(|b| scored(b)).sum::<usize>();
        let (device, loss_scale) = (batches.device, batches.loss_scale);
        let (loss, grads, moe) = forward_backward(model, batches.mine(all), total, device, loss_scale);
        let mut sums = vec![loss];
        sums.extend(moe.iter().flat_map(MoeSums::to_vec));
        Ok((grads, sums))
    }

    fn record_step(&self, sums: &[f64], record: &mut StepRecord) {
        if let Some(moe) = self.moe_sums(sums) {
            record.expert_load = Some(moe.load());
            record.named.extend(moe.named());
        }
    }

    /// DeepSeek-V3's balancing by the selection bias, from the step's loads summed over the ranks
    /// (the same on every rank). Not under LoRA: the base, the bias with it, stays as loaded (its
    /// checkpoints hold the adapters only).
    fn after_step(&self, model: Decoder<B>, sums: &[f64]) -> Decoder<B> {
        let rate = model.config().moe.as_ref().map_or(0.0, |m| m.bias_update_rate);
        let rate = if self.frozen_base { 0.0 } else { rate };
        match self.moe_sums(sums) {
            Some(moe) if rate > 0.0 => model.balance_selection_bias(&moe.load(), rate),
            _ => model,
        }
    }

    /// The fixed batches of the split (every held-out example for fine-tuning's val split), as
    /// `[Σ loss · scored, scored]`.
    fn evaluate(&self, model: &Decoder<B::InnerBackend>, split: Split, part: Part) -> Result<Vec<f64>, TrainError> {
        let e = &self.eval;
        let sum = match split {
            Split::Val if e.held_out => evaluate_all_part(model, self.splits.val.as_ref(), e.batch_size, part),
            Split::Val => evaluate_part(model, self.splits.val.as_ref(), e.val_seed, e.iters, e.batch_size, part),
            Split::Train => evaluate_part(model, self.splits.train.as_ref(), e.train_seed, e.iters, e.batch_size, part),
        };
        Ok(vec![sum.weighted, sum.scored])
    }

    fn evaluated(&self, sums: &[f64], _split: Split) -> Evaluated {
        Evaluated { loss: LossSum { weighted: sums[0], scored: sums[1] }.mean(), ..Evaluated::default() }
    }
}

/// Scored targets of a micro-batch.
fn scored(batch: &[Window]) -> usize {
    batch.iter().flat_map(|w| &w.target).filter(|&&t| t >= 0).count()
}

/// Forward and backward over this rank's micro-batches of a step. The step's loss is the sum of the
/// scored tokens' losses over all micro-batches (of all ranks) divided by the step's `total` scored
/// tokens, so that `batch 8 × accumulation 1`, `batch 4 × accumulation 2` and `batch 4 × 2 ranks`
/// give the same loss and gradient even when masks leave the micro-batches with different numbers
/// of scored tokens. The counts are known on the host before the first forward pass, so each
/// micro-batch's mean loss is weighted by its share `n_i / N` without an extra pass. Returns this
/// rank's part of that loss and its gradients times `loss_scale`.
pub(crate) fn forward_backward<B: TrainBackend>(
    model: &Decoder<B>,
    micro_batches: Vec<Vec<Window>>,
    total: usize,
    device: &Device<B>,
    loss_scale: f64,
) -> (f64, GradientsParams, Option<MoeSums>) {
    use burn::data::dataloader::batcher::Batcher;
    let total = total.max(1) as f64;
    let mut acc = Accumulation::<B>::new(loss_scale);
    // The reported loss is the next-token loss; a mixture of experts' auxiliary losses (in the
    // objective) are summed apart, weighted as it is, and also stay on the device.
    let mut moe_sum: Option<[Tensor<B::InnerBackend, 1>; 2]> = None;
    let mut counts: Vec<f64> = Vec::new();
    for items in micro_batches {
        let n = scored(&items);
        let batch: LmBatch<B> = LmBatcher.batch(items, device);
        let share = n as f64 / total;
        let parts = lm_loss_parts(model, batch);
        let weigh = |t: Tensor<B, 1>| if share == 1.0 { t } else { t.mul_scalar(share) };
        acc.report(weigh(parts.lm));
        if let Some((aux, z, layer_counts)) = parts.moe {
            let (aux, z) = (weigh(aux).inner(), weigh(z).inner());
            moe_sum = Some(match moe_sum {
                Some([a, b]) => [a + aux, b + z],
                None => [aux, z],
            });
            let flat = layer_counts.iter().flatten().map(|&c| c as f64);
            if counts.is_empty() {
                counts = flat.collect();
            } else {
                counts.iter_mut().zip(flat).for_each(|(s, c)| *s += c);
            }
        }
        acc.backward(model, weigh(parts.objective));
    }
    let (loss, grads) = acc.finish();
    let moe_config = model.config().moe.as_ref();
    let moe = moe_sum.map(|[aux, z]| MoeSums {
        aux: aux.into_scalar().elem::<f64>(),
        z: z.into_scalar().elem::<f64>(),
        experts: moe_config.map_or(1, |m| m.n_experts),
        first_layer: moe_config.map_or(0, |m| m.dense_layers),
        counts,
    });
    (loss, grads, moe)
}

/// A step's mixture-of-experts metrics on one rank, summed over the ranks: the auxiliary losses
/// (token-weighted like the loss) and the token-expert pairs of every layer and expert.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MoeSums {
    pub(crate) aux: f64,
    pub(crate) z: f64,
    /// Experts per layer.
    pub(crate) experts: usize,
    /// The first layer with experts (the ones before are dense).
    pub(crate) first_layer: usize,
    /// `[layers with experts × experts]`, row by row.
    pub(crate) counts: Vec<f64>,
}

impl MoeSums {
    fn to_vec(&self) -> Vec<f64> {
        [self.aux, self.z].into_iter().chain(self.counts.iter().copied()).collect()
    }

    /// Each layer's load (of the layers with experts, in order: entry `i` is layer
    /// `first_layer + i`): the fraction of its pairs each expert received.
    pub(crate) fn load(&self) -> Vec<Vec<f64>> {
        self.counts
            .chunks(self.experts.max(1))
            .map(|row| {
                let total = row.iter().sum::<f64>().max(1.0);
                row.iter().map(|c| c / total).collect()
            })
            .collect()
    }

    /// The metrics a step record names: `aux_loss`, `z_loss`, each layer's
    /// `expert_load_max_over_mean/layer{l}` (1 is an even load; `E` all pairs on one expert) and
    /// the worst layer's as `expert_load_max_over_mean`.
    pub(crate) fn named(&self) -> Vec<(String, f64)> {
        let per_layer: Vec<f64> =
            self.load().iter().map(|row| row.iter().copied().fold(0.0, f64::max) * row.len() as f64).collect();
        let worst = per_layer.iter().copied().fold(0.0, f64::max);
        let mut named =
            vec![("aux_loss".into(), self.aux), ("z_loss".into(), self.z), ("expert_load_max_over_mean".into(), worst)];
        named.extend(
            per_layer
                .into_iter()
                .enumerate()
                .map(|(l, v)| (format!("expert_load_max_over_mean/layer{}", l + self.first_layer), v)),
        );
        named
    }
}

/// The total scored tokens of micro-batches (for [`forward_backward`] over all of them).
#[cfg(test)]
pub(crate) fn total_scored(micro_batches: &[Vec<Window>]) -> usize {
    micro_batches.iter().map(|b| scored(b)).sum()
}
