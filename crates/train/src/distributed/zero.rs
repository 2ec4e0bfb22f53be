//! ZeRO-1 (Rajbhandari et al., 2020, stage 1): the AdamW moments sharded over ranks.
//!
//! The trainable parameters are laid out as one flat vector (parameter order, padded to a multiple
//! of the world size) and cut into N equal contiguous shards. Each step: reduce-scatter of the
//! gradients (rank r receives the sum of shard r), the global norm from the shards' sums of
//! squares, AdamW on shard r with rank r's moments (the same per-element update as [`AdamW`], each
//! parameter's piece with its own weight decay rule), and an all-gather of the updated shards into
//! every rank's parameters. A rank holds 1/N of the moments; checkpoints gather them into the
//! unsharded format, so a run resumes at any world size, with or without sharding.
//!
//! [`AdamW`]: crate::optim::AdamW

use std::collections::BTreeMap;

use burn::module::{AutodiffModule, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use ember_kernels::{adamw, AdamWStep, Compute, TrainBackend};
use ember_model::weights::{visit_paths, PathVisitor};

use super::buckets::{assign_params, flatten_into, flatten_params, Slot};
use super::{Collective, DistError};
use crate::config::OptimConfig;
use crate::optim::clip_coefficient;
use crate::precision::LossScaler;

/// This rank's part of the flat parameter vector.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub slots: Vec<Slot>,
    /// Trainable elements, and elements per rank (`total` rounded up to the world size, divided).
    pub total: usize,
    pub per_rank: usize,
    pub rank: usize,
}

impl Layout {
    /// The trainable parameters of `model` (those that require a gradient), in parameter order.
    pub fn of<B: TrainBackend, M: AutodiffModule<B>>(model: &M, rank: usize, world: usize) -> Self {
        struct Trainable {
            slots: Vec<Slot>,
            total: usize,
        }
        impl<B: TrainBackend> PathVisitor<B> for Trainable {
            fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
                let t = param.val();
                if t.is_require_grad() {
                    let slot = Slot { path: path.to_string(), offset: self.total, dims: t.dims().to_vec() };
                    self.total += slot.len();
                    self.slots.push(slot);
                }
            }
        }
        let mut v = Trainable { slots: Vec::new(), total: 0 };
        visit_paths(model, &mut v);
        let world = world.max(1);
        Self { slots: v.slots, total: v.total, per_rank: v.total.div_ceil(world), rank }
    }

    /// This rank's range of the flat vector.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.rank * self.per_rank..(self.rank + 1) * self.per_rank
    }

    /// The pieces of parameters inside this rank's range: (slot, flat range).
    fn pieces(&self) -> impl Iterator<Item = (&Slot, std::ops::Range<usize>)> {
        let r = self.range();
        self.slots.iter().filter_map(move |s| {
            let lo = r.start.max(s.offset);
            let hi = r.end.min(s.offset + s.len());
            (lo < hi).then_some((s, lo..hi))
        })
    }
}

/// AdamW with this rank's share of the moments.
pub struct ShardedAdamW {
    config: OptimConfig,
    /// How the updates compute: the model's.
    compute: Compute,
    steps: u64,
    layout: Layout,
    /// Moments of `layout.range()` (zeros in the padding).
    m: Vec<f32>,
    v: Vec<f32>,
    /// Host buffers kept across steps (a fresh one is faulted in page by page every step): the
    /// flattened gradients, and the gathered parameters.
    grads: Vec<f32>,
    gathered: Vec<f32>,
}

/// What a sharded step did.
pub struct ShardedStep<B: TrainBackend, M: AutodiffModule<B>> {
    pub model: M,
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    pub skipped: bool,
    _b: std::marker::PhantomData<B>,
}

impl ShardedAdamW {
    /// The sharded optimizer of `model`'s trainable parameters. MPI counts a collective's values in
    /// a C int, so the flat vector (padded) must stay below 2^31 values: about 2.1 billion
    /// trainable parameters.
    pub fn new<B: TrainBackend, M: AutodiffModule<B>>(
        config: OptimConfig,
        model: &M,
        c: &dyn Collective,
        compute: Compute,
    ) -> Result<Self, String> {
        let layout = Layout::of::<B, M>(model, c.rank(), c.world());
        if layout.per_rank * c.world() > i32::MAX as usize {
            return Err(format!(
                "distributed.shard_optimizer: {} trainable values are more than ember's ZeRO-1 over MPI handles \
                 (2^31 - 1); train without it, or with LoRA",
                layout.total
            ));
        }
        let n = layout.per_rank;
        let (m, v) = (vec![0.0; n], vec![0.0; n]);
        Ok(Self { config, compute, steps: 0, layout, m, v, grads: Vec::new(), gathered: Vec::new() })
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// One step from this rank's (unreduced) gradients; every rank calls it.
    #[allow(clippy::too_many_arguments)]
    pub fn step<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        c: &dyn Collective,
        lr: f64,
        model: M,
        mut grads: GradientsParams,
        loss_scale: f64,
        scaler: Option<&mut LossScaler>,
        device: &Device<B>,
        what: &str,
    ) -> Result<ShardedStep<B, M>, DistError> {
        let world = c.world();
        let flat = flatten_into(&model, &mut grads, &mut self.grads);
        if flat.slots != self.layout.slots {
            return Err(DistError::Rank {
                rank: c.rank(),
                message: format!(
                    "{what}: the gradients cover {} parameters, the optimizer's layout {} (a trainable parameter \
                     without a gradient?)",
                    flat.slots.len(),
                    self.layout.slots.len()
                ),
            });
        }
        self.grads.resize(self.layout.per_rank * world, 0.0);
        let mut g = vec![0.0f32; self.layout.per_rank];
        c.reduce_scatter_f32(&self.grads, &mut g, &format!("{what}: gradient reduce-scatter"))?;
        let mut sum_squares = [g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()];
        c.all_reduce_f64(&mut sum_squares, &format!("{what}: gradient norm"))?;
        let scaled_norm = sum_squares[0].sqrt();
        let grad_norm = scaled_norm / loss_scale;
        if let Some(scaler) = scaler {
            if !scaler.update(scaled_norm.is_finite()) {
                return Ok(ShardedStep { model, grad_norm, skipped: true, _b: Default::default() });
            }
        }
        self.steps += 1;
        let t = self.steps as i32;
        let o = &self.config;
        let scale = clip_coefficient(grad_norm, o.grad_clip) / loss_scale;
        let range = self.layout.range();
        let mut mine = flatten_params(&model, &self.layout.slots, range.clone());
        let tensor =
            |v: &[f32]| Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device);
        let read = |t: Tensor<B::InnerBackend, 1>, out: &mut [f32]| {
            let d = t.into_data().convert::<f32>();
            out.copy_from_slice(d.as_slice::<f32>().expect("converted to f32"));
        };
        let pieces: Vec<(bool, std::ops::Range<usize>)> =
            self.layout.pieces().map(|(s, r)| (s.decays(), r.start - range.start..r.end - range.start)).collect();
        for (decays, r) in pieces {
            let h = AdamWStep {
                lr,
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps,
                decay: if decays { lr * o.weight_decay } else { 0.0 },
                bias1: 1.0 - o.beta1.powi(t),
                bias2: 1.0 - o.beta2.powi(t),
                grad_scale: scale,
            };
            let (p, m, v) = adamw(
                tensor(&mine[r.clone()]),
                tensor(&g[r.clone()]),
                tensor(&self.m[r.clone()]),
                tensor(&self.v[r.clone()]),
                h,
                self.compute,
            );
            read(p, &mut mine[r.clone()]);
            read(m, &mut self.m[r.clone()]);
            read(v, &mut self.v[r]);
        }
        self.gathered.resize(self.layout.per_rank * world, 0.0);
        c.all_gather_f32(&mine, &mut self.gathered, &format!("{what}: parameter all-gather"))?;
        let model = assign_params(model, &self.layout.slots, &self.gathered);
        Ok(ShardedStep { model, grad_norm, skipped: false, _b: Default::default() })
    }

    /// The moments of every parameter, gathered to rank 0 (the one that writes checkpoints) and
    /// named as [`AdamW::state_tensors`] names them; the other ranks get nothing and hold no more
    /// than their share. Every rank calls this.
    ///
    /// [`AdamW::state_tensors`]: crate::optim::AdamW::state_tensors
    pub fn state_tensors(&self, c: &dyn Collective) -> Result<Vec<(String, TensorData)>, DistError> {
        if self.steps == 0 {
            return Ok(Vec::new());
        }
        let mut out: Vec<(String, TensorData)> = Vec::new();
        for (name, moments) in [("exp_avg", &self.m), ("exp_avg_sq", &self.v)] {
            let Some(all) = c.gather_f32(moments, &format!("checkpoint: {name}"))? else { continue };
            for s in &self.layout.slots {
                let r = s.offset..s.offset + s.len();
                out.push((format!("{}.{name}", s.path), TensorData::new(all[r].to_vec(), [s.len()])));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Takes this rank's share of moments saved unsharded (by any world size), after `steps`.
    pub fn load_state(&mut self, mut tensors: BTreeMap<String, TensorData>, steps: u64) -> Result<(), String> {
        let range = self.layout.range();
        let (mut m, mut v) = (vec![0.0f32; self.layout.per_rank], vec![0.0f32; self.layout.per_rank]);
        for s in &self.layout.slots {
            let pair =
                (tensors.remove(&format!("{}.exp_avg", s.path)), tensors.remove(&format!("{}.exp_avg_sq", s.path)));
            let (em, ev) = match pair {
                (Some(a), Some(b)) => (a, b),
                (None, None) if steps == 0 => continue,
                (None, None) => return Err(format!("no moments for `{}` after {steps} optimizer steps", s.path)),
                _ => return Err(format!("`{}` has only one of exp_avg and exp_avg_sq", s.path)),
            };
            for (name, d) in [("exp_avg", &em), ("exp_avg_sq", &ev)] {
                if d.num_elements() != s.len() {
                    return Err(format!(
                        "`{}.{name}` has {} elements, the parameter has {}",
                        s.path,
                        d.num_elements(),
                        s.len()
                    ));
                }
            }
            let lo = range.start.max(s.offset);
            let hi = range.end.min(s.offset + s.len());
            if lo >= hi {
                continue;
            }
            for (d, out) in [(em, &mut m), (ev, &mut v)] {
                let d = d.convert::<f32>();
                let all = d.as_slice::<f32>().map_err(|e| format!("`{}`: {e:?}", s.path))?;
                out[lo - range.start..hi - range.start].copy_from_slice(&all[lo - s.offset..hi - s.offset]);
            }
        }
        if let Some(k) = tensors.keys().next() {
            return Err(format!("moment `{k}` belongs to no trainable parameter of the model"));
        }
        (self.m, self.v, self.steps) = (m, v, steps);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::Solo;
    use crate::optim::AdamW;
    use crate::testing::{Two, AB};

    fn model(dev: &Device<AB>) -> Two<AB> {
        Two::new([[0.5, -1.0, 0.3], [2.0, 0.25, -0.7]], [0.1, -0.2, 0.05], dev)
    }

    fn grads(m: &Two<AB>, dev: &Device<AB>) -> GradientsParams {
        let x = Tensor::<AB, 2>::from_data([[1.0, 2.0], [-1.0, 0.5], [0.3, 0.3]], dev);
        let loss = (x.matmul(m.w.val()) + m.b.val().unsqueeze()).powi_scalar(2).mean();
        GradientsParams::from_grads(loss.backward(), m)
    }

    fn config() -> OptimConfig {
        OptimConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, grad_clip: 0.5 }
    }

    /// One rank's ZeRO-1 equals plain AdamW (with clipping), and its state round-trips through the
    /// unsharded checkpoint format.
    #[test]
    fn one_shard_is_adamw() {
        let dev = Default::default();
        let (mut a, mut z) = (model(&dev), model(&dev));
        let mut plain = AdamW::<AB>::new(config(), Compute::default());
        let mut sharded = ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default()).unwrap();
        for _ in 0..3 {
            let g = grads(&a, &dev);
            let norm = crate::optim::global_grad_norm(&a, &g, Compute::default());
            a = plain.step(0.01, a, g, clip_coefficient(norm, 0.5));
            let g = grads(&z, &dev);
            let step = sharded.step(&Solo, 0.01, z, g, 1.0, None, &dev, "test").unwrap();
            assert!((step.grad_norm - norm).abs() < 1e-6 * norm);
            z = step.model;
        }
        let (aw, zw) = (a.w.val().into_data().to_vec::<f32>().unwrap(), z.w.val().into_data().to_vec::<f32>().unwrap());
        for (x, y) in aw.iter().zip(&zw) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1e-3), "{x} vs {y}");
        }
        let state: BTreeMap<_, _> = sharded.state_tensors(&Solo).unwrap().into_iter().collect();
        let theirs: BTreeMap<_, _> = plain.state_tensors().into_iter().collect();
        assert_eq!(state.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>());
        let mut back = ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default()).unwrap();
        back.load_state(state.clone(), 3).unwrap();
        assert_eq!(back.state_tensors(&Solo).unwrap().into_iter().collect::<BTreeMap<_, _>>(), state);
    }

    #[test]
    fn shards_cover_the_parameters_once() {
        let dev = Default::default();
        let m = model(&dev);
        // 9 trainable values over 4 ranks: 3 per rank, the last rank's shard all padding.
        let shards: Vec<Layout> = (0..4).map(|r| Layout::of::<AB, _>(&m, r, 4)).collect();
        assert_eq!(shards[0].per_rank, 3);
        let mut covered = vec![0; 9];
        for l in &shards {
            for (_, r) in l.pieces() {
                r.for_each(|i| covered[i] += 1);
            }
        }
        assert_eq!(covered, vec![1; 9]);
        assert_eq!(shards[3].pieces().count(), 0);
        // w (6 values) is split between ranks 0 and 1; b (3) sits in rank 2.
        let decays: Vec<Vec<bool>> = shards.iter().map(|l| l.pieces().map(|(s, _)| s.decays()).collect()).collect();
        assert_eq!(decays, [vec![true], vec![true], vec![false], vec![]]);
    }
}
