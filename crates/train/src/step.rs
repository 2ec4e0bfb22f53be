//! One optimizer step: the step's micro-batches (this rank's share of them), forward and backward,
//! the gradients summed over ranks, global-norm clipping, AdamW (whole or sharded).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, ElementConversion, Tensor, TensorData};
use ember_data::{Examples, LmBatch, LmBatcher, Window, WindowSampler};
use ember_kernels::{DeviceComm, TrainBackend};
use ember_model::Decoder;

use crate::config::{PreferenceConfig, TrainConfig};
use crate::distributed::buckets::{all_reduce_grads, all_reduce_grads_on_device, GradBuffers};
use crate::distributed::zero::ShardedAdamW;
use crate::distributed::{Collective, DistError};
use crate::error::{OptimizerError, TrainError};
use crate::eval::lm_loss_parts;
use crate::optim::{clip_coefficient, global_grad_norm, AdamW};
use crate::precision::LossScaler;
use crate::preference::{answer_logps, pair_loss, PairSums, StepTotals};
use ember_data::preference::answer_masks;

/// AdamW (and Muon) with every moment on every rank, or ZeRO-1's share of them.
pub enum Optimizer<B: TrainBackend> {
    Replicated(AdamW<B>),
    Sharded(ShardedAdamW),
}

impl<B: TrainBackend> Optimizer<B> {
    /// The optimizer of `config` for `model`: sharded when `[distributed] shard_optimizer` is set
    /// and there are several ranks; with the moments of `saved` (any world size's) after `steps`.
    pub fn build(
        config: &TrainConfig,
        model: &Decoder<B>,
        c: &dyn Collective,
        saved: BTreeMap<String, TensorData>,
        steps: u64,
        device: &Device<B>,
    ) -> Result<Self, OptimizerError> {
        if config.distributed.shard_optimizer && c.world() > 1 {
            let cx = model.compute();
            let muon = config.muon.as_ref().map(|m| (m, config.schedule.lr));
            let mut o = ShardedAdamW::new::<B, _>(config.optim.clone(), model, c, cx, muon)
                .map_err(OptimizerError::Sharding)?;
            o.load_state(saved, steps).map_err(OptimizerError::Moments)?;
            return Ok(Self::Sharded(o));
        }
        if config.distributed.shard_optimizer {
            tracing::info!("distributed.shard_optimizer has no effect in a single process");
        }
        let mut o =
            AdamW::<B>::new(config.optim.clone(), model.compute()).with_muon(config.muon.as_ref(), config.schedule.lr);
        o.load_state(model, saved, steps, device).map_err(OptimizerError::Moments)?;
        Ok(Self::Replicated(o))
    }

    pub fn steps(&self) -> u64 {
        match self {
            Self::Replicated(o) => o.steps(),
            Self::Sharded(o) => o.steps(),
        }
    }

    /// The moments as named tensors (sharded ones gathered: every rank must call this).
    pub fn state_tensors(&self, c: &dyn Collective) -> Result<Vec<(String, TensorData)>, DistError> {
        match self {
            Self::Replicated(o) => Ok(o.state_tensors()),
            Self::Sharded(o) => o.state_tensors(c),
        }
    }
}

pub struct StepOutput {
    /// Loss of the step: its scored tokens' summed losses over their number (all ranks).
    pub loss: f64,
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    /// The gradients overflowed under f16 loss scaling and the update was skipped.
    pub skipped: bool,
    /// Time spent in reductions and gathers with the other ranks.
    pub comm: Duration,
    /// Time spent waiting for the other ranks to finish their micro-batches (load imbalance).
    pub wait: Duration,
    /// Preference tuning: the step's pairs' metrics, summed over all ranks.
    pub preference: Option<PairSums>,
    /// A mixture of experts: the step's auxiliary losses and expert loads, over all ranks.
    pub moe: Option<MoeSums>,
}

/// What a step sums beside its loss.
enum Sums {
    Preference(PairSums),
    Moe(Option<MoeSums>),
}

/// What every step reads: the data, the config, the device and the other ranks.
pub struct Stepper<'a, B: TrainBackend> {
    pub data: &'a Examples,
    pub sampler: WindowSampler,
    pub config: &'a TrainConfig,
    pub device: &'a Device<B>,
    pub collective: &'a dyn Collective,
    /// The gradient reduction's host buffers, reused from step to step.
    pub buffers: std::cell::RefCell<GradBuffers>,
    /// Sums the gradients on the device instead (NCCL for CUDA tensors), when there is one.
    pub device_comm: Option<&'a DeviceComm>,
    /// Preference tuning with DPO or IPO: the reference model's log-probabilities of each training
    /// row's answers (`[chosen, rejected]`, by row).
    pub reference: Option<&'a [[f64; 2]]>,
}

impl<B: TrainBackend> Stepper<'_, B> {
    /// Micro-batches of the data stream one step consumes, over all ranks.
    pub fn micro_batches_per_step(&self) -> u64 {
        (self.config.train.grad_accum_steps * self.collective.world()) as u64
    }

    /// Step number `step` (1-based, for messages): micro-batches `first_stream ..` of the stream,
    /// of which this rank computes every world-th; the gradients summed over ranks; clipping; AdamW.
    /// With a loss scaler (f16), the loss is scaled before the backward pass and the gradients
    /// unscaled in the clipping coefficient; a step with non-finite gradients is skipped.
    pub fn step(
        &self,
        model: Decoder<B>,
        optim: &mut Optimizer<B>,
        first_stream: u64,
        step: usize,
        lr: f64,
        scaler: Option<&mut LossScaler>,
    ) -> Result<(Decoder<B>, StepOutput), TrainError> {
        let c = self.collective;
        let (rank, world) = (c.rank(), c.world());
        let what = format!("step {step}");
        let batch = self.config.train.batch_size;
        let n = self.data.len();
        let all: Vec<Vec<usize>> =
            (0..self.micro_batches_per_step()).map(|j| self.sampler.indices(first_stream + j, batch, n)).collect();
        let rows = |idx: &[usize]| -> Vec<Window> {
            idx.iter().map(|&i| self.data.get(i).expect("index drawn below len")).collect()
        };
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale);
        let (loss, grads, sums) = match &self.config.preference {
            None => {
                let all: Vec<Vec<Window>> = all.iter().map(|idx| rows(idx)).collect();
                let total = all.iter().map(|b| scored(b)).sum::<usize>();
                let mine: Vec<Vec<Window>> = all.into_iter().skip(rank).step_by(world).collect();
                let (loss, grads, moe) = forward_backward(&model, mine, total, self.device, loss_scale);
                (loss, grads, Sums::Moe(moe))
            }
            Some(pc) => {
                let all: Vec<(Vec<Window>, Option<Vec<[f64; 2]>>)> = all
                    .iter()
                    .map(|idx| (rows(idx), self.reference.map(|r| idx.iter().map(|&i| r[i]).collect())))
                    .collect();
                let chosen_tokens =
                    all.iter().flat_map(|(b, _)| b).map(|w| answer_masks(w).0.iter().sum::<f32>() as f64);
                let totals = StepTotals {
                    pairs: (batch as u64 * self.micro_batches_per_step()) as f64,
                    chosen_tokens: chosen_tokens.sum(),
                };
                let mine = all.into_iter().skip(rank).step_by(world).collect();
                let (loss, grads, sums) =
                    preference_forward_backward(&model, pc, mine, totals, self.device, loss_scale);
                (loss, grads, Sums::Preference(sums))
            }
        };
        // Every rank has computed its gradients: the one that has not within the timeout is named.
        let t = Instant::now();
        c.arrive(step as u64, &what)?;
        let wait = t.elapsed();
        let t = Instant::now();
        let mut reduced = vec![loss];
        match &sums {
            Sums::Preference(p) => reduced.extend(p.to_vec()),
            Sums::Moe(Some(m)) => reduced.extend(m.to_vec()),
            Sums::Moe(None) => {}
        }
        c.all_reduce_f64(&mut reduced, &format!("{what}: loss"))?;
        let loss = reduced[0];
        let (preference, moe) = match &sums {
            Sums::Preference(_) => (Some(PairSums::from_slice(&reduced[1..])), None),
            Sums::Moe(m) => (None, m.as_ref().map(|m| m.from_slice(&reduced[1..]))),
        };
        let bucket = self.config.distributed.bucket_elems();
        match optim {
            Optimizer::Replicated(adamw) => {
                let sums = format!("{what}: gradients");
                let grads = match self.device_comm {
                    Some(dc) => all_reduce_grads_on_device(dc, rank, &model, grads, bucket, &sums)?,
                    None => all_reduce_grads(c, &model, grads, bucket, &mut self.buffers.borrow_mut(), &sums)?,
                };
                let comm = t.elapsed();
                let scaled_norm = global_grad_norm(&model, &grads, model.compute());
                let grad_norm = scaled_norm / loss_scale;
                if let Some(scaler) = scaler {
                    if !scaler.update(scaled_norm.is_finite()) {
                        return Ok((model, StepOutput { loss, grad_norm, skipped: true, comm, wait, preference, moe }));
                    }
                }
                let scale = clip_coefficient(grad_norm, self.config.optim.grad_clip) / loss_scale;
                let model = adamw.step_shared(lr, model, grads, scale, c, &what)?;
                Ok((model, StepOutput { loss, grad_norm, skipped: false, comm, wait, preference, moe }))
            }
            Optimizer::Sharded(zero) => {
                // Reduce-scatter, the update of this rank's shard and the all-gather, timed whole
                // (the shard's update is 1/N of AdamW's work).
                let s = zero.step(c, lr, model, grads, loss_scale, scaler, self.device, &what)?;
                let comm = t.elapsed();
                let (grad_norm, skipped) = (s.grad_norm, s.skipped);
                Ok((s.model, StepOutput { loss, grad_norm, skipped, comm, wait, preference, moe }))
            }
        }
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
    let mut grads = GradientsAccumulator::<Decoder<B>>::new();
    // The losses stay on the device until every backward pass is queued: one read per step, not a
    // wait between each forward and its backward (which would drain a GPU's queue). The reported
    // loss is the next-token loss; a mixture of experts' auxiliary losses (in the objective) are
    // summed apart, weighted as it is.
    let mut loss_sum: Option<Tensor<B::InnerBackend, 1>> = None;
    let mut moe_sum: Option<(Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>)> = None;
    let mut counts: Vec<f64> = Vec::new();
    for items in micro_batches {
        let n = scored(&items);
        let batch: LmBatch<B> = LmBatcher.batch(items, device);
        let share = n as f64 / total;
        let parts = lm_loss_parts(model, batch);
        let weigh = |t: Tensor<B, 1>| if share == 1.0 { t } else { t.mul_scalar(share) };
        let value = weigh(parts.lm).inner();
        loss_sum = Some(match loss_sum {
            Some(sum) => sum + value,
            None => value,
        });
        if let Some((aux, z, layer_counts)) = parts.moe {
            let (aux, z) = (weigh(aux).inner(), weigh(z).inner());
            moe_sum = Some(match moe_sum {
                Some((a, b)) => (a + aux, b + z),
                None => (aux, z),
            });
            let flat = layer_counts.iter().flatten().map(|&c| c as f64);
            if counts.is_empty() {
                counts = flat.collect();
            } else {
                counts.iter_mut().zip(flat).for_each(|(s, c)| *s += c);
            }
        }
        let loss = weigh(parts.objective);
        let loss = if loss_scale == 1.0 { loss } else { loss.mul_scalar(loss_scale) };
        grads.accumulate(model, GradientsParams::from_grads(loss.backward(), model));
    }
    let loss = loss_sum.map_or(0.0, |sum| sum.into_scalar().elem::<f64>());
    let moe_config = model.config().moe.as_ref();
    let moe = moe_sum.map(|(aux, z)| MoeSums {
        aux: aux.into_scalar().elem::<f64>(),
        z: z.into_scalar().elem::<f64>(),
        experts: moe_config.map_or(1, |m| m.n_experts),
        first_layer: moe_config.map_or(0, |m| m.dense_layers),
        counts,
    });
    (loss, grads.grads(), moe)
}

/// A step's mixture-of-experts metrics on one rank, summed over the ranks: the auxiliary losses
/// (token-weighted like the loss) and the token-expert pairs of every layer and expert.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSums {
    pub aux: f64,
    pub z: f64,
    /// Experts per layer.
    pub experts: usize,
    /// The first layer with experts (the ones before are dense).
    pub first_layer: usize,
    /// `[layers with experts × experts]`, row by row.
    pub counts: Vec<f64>,
}

impl MoeSums {
    fn to_vec(&self) -> Vec<f64> {
        [self.aux, self.z].into_iter().chain(self.counts.iter().copied()).collect()
    }

    fn from_slice(&self, v: &[f64]) -> Self {
        Self { aux: v[0], z: v[1], counts: v[2..].to_vec(), ..*self }
    }

    /// Each layer's load (of the layers with experts, in order: entry `i` is layer
    /// `first_layer + i`): the fraction of its pairs each expert received.
    pub fn load(&self) -> Vec<Vec<f64>> {
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
    pub fn named(&self) -> Vec<(String, f64)> {
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

/// [`forward_backward`] for preference pairs: each micro-batch's rows (with their reference
/// log-probabilities, DPO and IPO) scored in one forward pass, its share of the step's loss
/// (`Σ pair losses / the step's pairs`, [`crate::preference::pair_loss`]) backpropagated. Returns
/// this rank's part of the loss, its gradients times `loss_scale` and its pairs' metric sums.
pub(crate) fn preference_forward_backward<B: TrainBackend>(
    model: &Decoder<B>,
    config: &PreferenceConfig,
    micro_batches: Vec<(Vec<Window>, Option<Vec<[f64; 2]>>)>,
    totals: StepTotals,
    device: &Device<B>,
    loss_scale: f64,
) -> (f64, GradientsParams, PairSums) {
    let mut grads = GradientsAccumulator::<Decoder<B>>::new();
    // The losses stay on the device until the end, as in `forward_backward`.
    let (mut loss_sum, mut sums): (Option<Tensor<B::InnerBackend, 1>>, _) = (None, PairSums::default());
    for (rows, reference) in micro_batches {
        let logps = answer_logps(model, &rows, device);
        let out = pair_loss(config, logps, reference.as_deref(), totals);
        let value = out.loss.clone().inner();
        loss_sum = Some(match loss_sum {
            Some(sum) => sum + value,
            None => value,
        });
        sums.add(&out.sums);
        let loss = if loss_scale == 1.0 { out.loss } else { out.loss.mul_scalar(loss_scale) };
        grads.accumulate(model, GradientsParams::from_grads(loss.backward(), model));
    }
    (loss_sum.map_or(0.0, |sum| sum.into_scalar().elem::<f64>()), grads.grads(), sums)
}

/// The total scored tokens of micro-batches (for [`forward_backward`] over all of them).
#[cfg(test)]
pub(crate) fn total_scored(micro_batches: &[Vec<Window>]) -> usize {
    micro_batches.iter().map(|b| scored(b)).sum()
}
