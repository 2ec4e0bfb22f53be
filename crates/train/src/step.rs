//! One optimizer step: the step's micro-batches (this rank's share of them), forward and backward,
//! the gradients summed over ranks, global-norm clipping, AdamW (whole or sharded).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::{Device, TensorData};
use ember_data::{Examples, WindowSampler};
use ember_kernels::{DeviceComm, TrainBackend};
use ember_model::Decoder;

use crate::config::TrainConfig;
use crate::distributed::buckets::{all_reduce_grads, all_reduce_grads_on_device, GradBuffers};
use crate::distributed::zero::ShardedAdamW;
use crate::distributed::{Collective, DistError};
use crate::error::{OptimizerError, TrainError};
use crate::objective::{MicroBatches, Objective};
use crate::optim::{clip_coefficient, global_grad_norm, AdamW};
use crate::precision::LossScaler;

/// AdamW (and Muon) with every moment on every rank, or ZeRO-1's share of them.
pub(crate) enum Optimizer<B: TrainBackend> {
    Replicated(AdamW<B>),
    Sharded(ShardedAdamW),
}

impl<B: TrainBackend> Optimizer<B> {
    /// The optimizer of `config` for `model`: sharded when `[distributed] shard_optimizer` is set
    /// and there are several ranks; with the moments of `saved` (any world size's) after `steps`.
    pub(crate) fn build(
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
            let mut o = ShardedAdamW::new::<B, _>(config.optim.clone(), model, c, cx, muon)?;
            o.load_state(saved, steps)?;
            return Ok(Self::Sharded(o));
        }
        if config.distributed.shard_optimizer {
            tracing::info!("distributed.shard_optimizer has no effect in a single process");
        }
        let mut o =
            AdamW::<B>::new(config.optim.clone(), model.compute()).with_muon(config.muon.as_ref(), config.schedule.lr);
        o.load_state(model, saved, steps, device)?;
        Ok(Self::Replicated(o))
    }

    pub(crate) fn steps(&self) -> u64 {
        match self {
            Self::Replicated(o) => o.steps(),
            Self::Sharded(o) => o.steps(),
        }
    }

    /// The moments as named tensors (sharded ones gathered: every rank must call this).
    pub(crate) fn state_tensors(&self, c: &dyn Collective) -> Result<Vec<(String, TensorData)>, DistError> {
        match self {
            Self::Replicated(o) => Ok(o.state_tensors()),
            Self::Sharded(o) => o.state_tensors(c),
        }
    }
}

pub(crate) struct StepOutput {
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
    /// What the objective sums beside the loss, summed over all ranks (its to read:
    /// [`Objective::record_step`], [`Objective::after_step`]).
    pub sums: Vec<f64>,
}

/// What every step reads: the data, the config, the objective, the device and the other ranks.
pub(crate) struct Stepper<'a, B: TrainBackend> {
    pub data: &'a Examples,
    pub sampler: WindowSampler,
    pub config: &'a TrainConfig,
    pub(crate) objective: &'a dyn Objective<B>,
    pub device: &'a Device<B>,
    pub collective: &'a dyn Collective,
    /// The gradient reduction's host buffers, reused from step to step.
    pub buffers: std::cell::RefCell<GradBuffers>,
    /// Sums the gradients on the device instead (NCCL for CUDA tensors), when there is one.
    pub device_comm: Option<&'a DeviceComm>,
}

impl<B: TrainBackend> Stepper<'_, B> {
    /// Micro-batches of the data stream one step consumes, over all ranks.
    pub(crate) fn micro_batches_per_step(&self) -> u64 {
        (self.config.train.grad_accum_steps * self.collective.world()) as u64
    }

    /// Step number `step` (1-based, for messages): micro-batches `first_stream ..` of the stream,
    /// of which this rank computes every world-th; the gradients summed over ranks; clipping; AdamW.
    /// With a loss scaler (f16), the loss is scaled before the backward pass and the gradients
    /// unscaled in the clipping coefficient; a step with non-finite gradients is skipped.
    pub(crate) fn step(
        &self,
        model: Decoder<B>,
        optim: &mut Optimizer<B>,
        first_stream: u64,
        step: usize,
        lr: f64,
        scaler: Option<&mut LossScaler>,
    ) -> Result<(Decoder<B>, StepOutput), TrainError> {
        let c = self.collective;
        let what = format!("step {step}");
        let (batch, n) = (self.config.train.batch_size, self.data.len());
        let indices =
            (0..self.micro_batches_per_step()).map(|j| self.sampler.indices(first_stream + j, batch, n)).collect();
        let (rank, world, device) = (c.rank(), c.world(), self.device);
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale);
        let batches = MicroBatches { data: self.data, indices, rank, world, device, loss_scale, step, collective: c };
        let computed = self.objective.forward_backward(&model, batches)?;
        // Every rank has computed its gradients: the one that has not within the timeout is named.
        let t = Instant::now();
        c.arrive(step as u64, &what)?;
        let wait = t.elapsed();
        let (model, out) = self.update(model, optim, computed, lr, scaler, &what)?;
        Ok((model, StepOutput { wait, ..out }))
    }

    /// The objective's sums and the gradients added over the ranks, the gradients clipped and
    /// applied by the optimizer (whole or sharded).
    fn update(
        &self,
        model: Decoder<B>,
        optim: &mut Optimizer<B>,
        (grads, mut sums): (GradientsParams, Vec<f64>),
        lr: f64,
        scaler: Option<&mut LossScaler>,
        what: &str,
    ) -> Result<(Decoder<B>, StepOutput), TrainError> {
        let t = Instant::now();
        let c = self.collective;
        let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale);
        c.all_reduce_f64(&mut sums, &format!("{what}: loss"))?;
        let out = StepOutput {
            loss: sums[0],
            grad_norm: 0.0,
            skipped: false,
            comm: Duration::ZERO,
            wait: Duration::ZERO,
            sums: sums.split_off(1),
        };
        let bucket = self.config.distributed.bucket_elems();
        match optim {
            Optimizer::Replicated(adamw) => {
                let sums = format!("{what}: gradients");
                let grads = match self.device_comm {
                    Some(dc) => all_reduce_grads_on_device(dc, c.rank(), &model, grads, bucket, &sums)?,
                    None => all_reduce_grads(c, &model, grads, bucket, &mut self.buffers.borrow_mut(), &sums)?,
                };
                let comm = t.elapsed();
                let scaled_norm = global_grad_norm(&model, &grads, model.compute());
                let grad_norm = scaled_norm / loss_scale;
                if let Some(scaler) = scaler {
                    if !scaler.update(scaled_norm.is_finite()) {
                        return Ok((model, StepOutput { grad_norm, skipped: true, comm, ..out }));
                    }
                }
                let scale = clip_coefficient(grad_norm, self.config.optim.grad_clip) / loss_scale;
                let model = adamw.step_shared(lr, model, grads, scale, c, what)?;
                Ok((model, StepOutput { grad_norm, comm, ..out }))
            }
            Optimizer::Sharded(zero) => {
                // Reduce-scatter, the update of this rank's shard and the all-gather, timed whole
                // (the shard's update is 1/N of AdamW's work).
                let s = zero.step(c, lr, model, grads, loss_scale, scaler, self.device, what)?;
                let comm = t.elapsed();
                Ok((s.model, StepOutput { grad_norm: s.grad_norm, skipped: s.skipped, comm, ..out }))
            }
        }
    }
}
