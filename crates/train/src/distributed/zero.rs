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
//! With `[muon]`, Muon's matrices leave the flat vector: each whole matrix belongs to one rank
//! (largest first to the least-loaded rank), which alone holds its momentum buffer and runs its
//! Newton–Schulz iteration. Their gradients are summed on every rank (the iteration needs the whole
//! matrix), and one all-reduce of the updates (each element has one non-zero contributor) gives
//! every rank every update, which each applies itself.
//!
//! [`AdamW`]: crate::optim::AdamW

use std::collections::{BTreeMap, HashMap};

use burn::module::{AutodiffModule, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use ember_kernels::newton_schulz::newton_schulz as newton_schulz_all;
use ember_kernels::{adamw, AdamWStep, Compute, TrainBackend};
use ember_model::weights::{visit_paths, PathVisitor};

use super::buckets::{assign_params, flatten_into, flatten_params, Slot};
use super::{Collective, DistError};
use crate::config::{MuonConfig, OptimConfig};
use crate::error::OptimizerError;
use crate::muon::{adjusted_lr, momentum, ns_step, owners, takes};
use crate::optim::clip_coefficient;
use crate::precision::LossScaler;

/// This rank's part of the flat parameter vector.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Layout {
    pub slots: Vec<Slot>,
    /// Trainable elements, and elements per rank (`total` rounded up to the world size, divided).
    pub total: usize,
    pub per_rank: usize,
    pub rank: usize,
}

impl Layout {
    /// The trainable parameters of `model` (those that require a gradient), in parameter order.
    pub(crate) fn of<B: TrainBackend, M: AutodiffModule<B>>(model: &M, rank: usize, world: usize) -> Self {
        Self::of_filtered::<B, M>(model, rank, world, &|_, _| true)
    }

    /// [`Self::of`] for the trainable parameters `keep(path, rank)` accepts.
    fn of_filtered<B: TrainBackend, M: AutodiffModule<B>>(
        model: &M,
        rank: usize,
        world: usize,
        keep: &dyn Fn(&str, usize) -> bool,
    ) -> Self {
        let (slots, total) = trainable::<B, M>(model, keep);
        let world = world.max(1);
        Self { slots, total, per_rank: total.div_ceil(world), rank }
    }

    /// This rank's range of the flat vector.
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
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

/// The trainable parameters of `model` that `keep(path, rank)` accepts, laid out one after
/// another in parameter order, and their number of values.
fn trainable<B: TrainBackend, M: AutodiffModule<B>>(
    model: &M,
    keep: &dyn Fn(&str, usize) -> bool,
) -> (Vec<Slot>, usize) {
    struct Trainable<'a> {
        keep: &'a dyn Fn(&str, usize) -> bool,
        slots: Vec<Slot>,
        total: usize,
    }
    impl<B: TrainBackend> PathVisitor<B> for Trainable<'_> {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            if t.is_require_grad() && (self.keep)(path, D) {
                let slot = Slot { path: path.to_string(), offset: self.total, dims: t.dims().to_vec() };
                self.total += slot.len();
                self.slots.push(slot);
            }
        }
    }
    let mut v = Trainable { keep, slots: Vec::new(), total: 0 };
    visit_paths(model, &mut v);
    (v.slots, v.total)
}

/// Muon's part of a sharded optimizer: whole matrices, each owned by one rank.
struct ShardedMuon {
    config: MuonConfig,
    /// Muon's peak rate over AdamW's (`schedule.lr`).
    lr_ratio: f64,
    /// The matrices, in parameter order, laid out in a flat vector of their own.
    slots: Vec<Slot>,
    total: usize,
    /// The rank that owns each matrix, and where its buffer sits in that rank's `buffers`.
    owners: Vec<usize>,
    packed: Vec<usize>,
    /// The momentum buffers of this rank's matrices, packed; every rank's padded to `max_load`
    /// values for the checkpoint's gather.
    buffers: Vec<f32>,
    max_load: usize,
    rank: usize,
}

impl ShardedMuon {
    fn new<B: TrainBackend, M: AutodiffModule<B>>(
        config: MuonConfig,
        adamw_lr: f64,
        model: &M,
        c: &dyn Collective,
    ) -> Self {
        let (slots, total) = trainable::<B, M>(model, &|path, rank| takes(&config, path, rank));
        let owners = owners(&slots.iter().map(Slot::len).collect::<Vec<_>>(), c.world());
        let mut load = vec![0usize; c.world().max(1)];
        let packed = slots
            .iter()
            .zip(&owners)
            .map(|(s, &r)| {
                load[r] += s.len();
                load[r] - s.len()
            })
            .collect();
        let max_load = load.iter().copied().max().unwrap_or(0);
        let buffers = vec![0.0; load[c.rank()]];
        Self { lr_ratio: config.lr / adamw_lr, config, slots, total, owners, packed, buffers, max_load, rank: c.rank() }
    }

    /// Moves the gradients of Muon's matrices out of `grads` into one vector, summed over ranks.
    fn take_grads<B: TrainBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        c: &dyn Collective,
        what: &str,
    ) -> Result<Vec<f32>, DistError> {
        struct Take<'a> {
            index: HashMap<&'a str, &'a Slot>,
            grads: &'a mut GradientsParams,
            flat: Vec<f32>,
            found: usize,
        }
        impl<B: TrainBackend> PathVisitor<B> for Take<'_> {
            fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
                let Some(slot) = self.index.get(path) else { return };
                let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) else { return };
                let d = g.into_data().convert::<f32>();
                self.flat[slot.offset..slot.offset + slot.len()]
                    .copy_from_slice(d.as_slice::<f32>().expect("converted to f32"));
                self.found += 1;
            }
        }
        let index = self.slots.iter().map(|s| (s.path.as_str(), s)).collect();
        let mut take = Take { index, grads, flat: vec![0.0; self.total], found: 0 };
        visit_paths(model, &mut take);
        if take.found != self.slots.len() {
            return Err(DistError::Rank {
                rank: c.rank(),
                message: format!(
                    "{what}: {} of Muon's {} matrices have a gradient (a trainable parameter without one?)",
                    take.found,
                    self.slots.len()
                ),
            });
        }
        if self.total > 0 {
            c.all_reduce_f32(&mut take.flat, &format!("{what}: Muon gradients"))?;
        }
        Ok(take.flat)
    }

    /// Muon's update of every matrix from the summed gradients `g` times `grad_scale`: this rank
    /// iterates on its own matrices, the updates are shared, every rank applies all of them.
    #[allow(clippy::too_many_arguments)]
    fn step<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        model: M,
        g: &[f32],
        grad_scale: f64,
        adamw_lr: f64,
        c: &dyn Collective,
        device: &Device<B>,
        cx: Compute,
        what: &str,
    ) -> Result<M, DistError> {
        let cfg = &self.config;
        let tensor = |v: &[f32], dims: &[usize]| {
            Tensor::<B::InnerBackend, 2>::from_data(TensorData::new(v.to_vec(), [dims[0], dims[1]]), device)
        };
        let mut mine = Vec::new();
        let mut us = Vec::new();
        for (i, s) in self.slots.iter().enumerate().filter(|(i, _)| self.owners[*i] == self.rank) {
            let gi = tensor(&g[s.offset..s.offset + s.len()], &s.dims);
            let gi = if grad_scale == 1.0 { gi } else { gi.mul_scalar(grad_scale) };
            let at = self.packed[i]..self.packed[i] + s.len();
            let (buf, u) = momentum(tensor(&self.buffers[at.clone()], &s.dims), gi, cfg);
            let d = buf.into_data().convert::<f32>();
            self.buffers[at].copy_from_slice(d.as_slice::<f32>().expect("converted to f32"));
            mine.push(i);
            us.push(u);
        }
        let mut flat = vec![0.0f32; self.total];
        for (i, o) in mine.into_iter().zip(newton_schulz_all(us, ns_step(cfg), cx)) {
            let s = &self.slots[i];
            let d = o.into_data().convert::<f32>();
            flat[s.offset..s.offset + s.len()].copy_from_slice(d.as_slice::<f32>().expect("converted to f32"));
        }
        if self.total == 0 {
            return Ok(model);
        }
        c.all_reduce_f32(&mut flat, &format!("{what}: Muon updates"))?;
        // p·(1 - lr·wd) - adjusted lr · O, in f32 as the replicated step's tensor ops compute it.
        let lr = adamw_lr * self.lr_ratio;
        let mut params = flatten_params(&model, &self.slots, 0..self.total);
        for s in &self.slots {
            let decay = (1.0 - lr * cfg.weight_decay) as f32;
            let rate = adjusted_lr(lr, cfg.adjust_lr, [s.dims[0], s.dims[1]]) as f32;
            let r = s.offset..s.offset + s.len();
            for (p, o) in params[r.clone()].iter_mut().zip(&flat[r]) {
                let kept = if cfg.weight_decay == 0.0 { *p } else { *p * decay };
                *p = kept - *o * rate;
            }
        }
        Ok(assign_params(model, &self.slots, &params))
    }

    /// Every matrix's momentum buffer, gathered to rank 0 (the others get nothing).
    fn state_tensors(&self, c: &dyn Collective) -> Result<Vec<(String, TensorData)>, DistError> {
        if self.max_load == 0 {
            return Ok(Vec::new());
        }
        let mut send = self.buffers.clone();
        send.resize(self.max_load, 0.0);
        let Some(all) = c.gather_f32(&send, "checkpoint: momentum_buffer")? else { return Ok(Vec::new()) };
        Ok(self
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let at = self.owners[i] * self.max_load + self.packed[i];
                (format!("{}.momentum_buffer", s.path), TensorData::new(all[at..at + s.len()].to_vec(), s.dims.clone()))
            })
            .collect())
    }

    /// Takes this rank's buffers out of `tensors` (saved unsharded by any world size) after `steps`.
    fn load_state(&mut self, tensors: &mut BTreeMap<String, TensorData>, steps: u64) -> Result<(), OptimizerError> {
        let mut buffers = vec![0.0f32; self.buffers.len()];
        for (i, s) in self.slots.iter().enumerate() {
            if tensors.contains_key(&format!("{}.exp_avg", s.path)) {
                return Err(OptimizerError::Moments(format!(
                    "`{}` has AdamW moments, but this config's [muon] trains it (a run resumes with the optimizer \
                     it started with: remove [muon], or start a new run)",
                    s.path
                )));
            }
            let Some(d) = tensors.remove(&format!("{}.momentum_buffer", s.path)) else {
                if steps == 0 {
                    continue;
                }
                return Err(OptimizerError::Moments(format!(
                    "no momentum buffer for `{}` after {steps} optimizer steps",
                    s.path
                )));
            };
            if d.num_elements() != s.len() {
                return Err(OptimizerError::Moments(format!(
                    "`{}.momentum_buffer` has {} elements, the parameter has {}",
                    s.path,
                    d.num_elements(),
                    s.len()
                )));
            }
            if self.owners[i] == self.rank {
                let d = d.convert::<f32>();
                let values =
                    d.as_slice::<f32>().map_err(|e| OptimizerError::Moments(format!("`{}`: {e:?}", s.path)))?;
                buffers[self.packed[i]..self.packed[i] + s.len()].copy_from_slice(values);
            }
        }
        self.buffers = buffers;
        Ok(())
    }
}

/// AdamW with this rank's share of the moments.
pub(crate) struct ShardedAdamW {
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
    /// Muon's matrices (then outside `layout`), with `[muon]`.
    muon: Option<ShardedMuon>,
}

/// What a sharded step did.
pub(crate) struct ShardedStep<B: TrainBackend, M: AutodiffModule<B>> {
    pub model: M,
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    pub skipped: bool,
    _b: std::marker::PhantomData<B>,
}

impl ShardedAdamW {
    /// The sharded optimizer of `model`'s trainable parameters; with `muon` (its config and
    /// `schedule.lr`), Muon trains the matrices it takes. MPI counts a collective's values in a C
    /// int, so the flat vector (padded) must stay below 2^31 values: about 2.1 billion trainable
    /// parameters.
    pub(crate) fn new<B: TrainBackend, M: AutodiffModule<B>>(
        config: OptimConfig,
        model: &M,
        c: &dyn Collective,
        compute: Compute,
        muon: Option<(&MuonConfig, f64)>,
    ) -> Result<Self, OptimizerError> {
        let muon = muon.map(|(m, adamw_lr)| ShardedMuon::new::<B, M>(m.clone(), adamw_lr, model, c));
        let layout = match &muon {
            Some(m) => Layout::of_filtered::<B, M>(model, c.rank(), c.world(), &|p, r| !takes(&m.config, p, r)),
            None => Layout::of::<B, M>(model, c.rank(), c.world()),
        };
        let muon_total = muon.as_ref().map_or(0, |m| m.total.max(m.max_load * c.world()));
        if layout.per_rank * c.world() > i32::MAX as usize || muon_total > i32::MAX as usize {
            return Err(OptimizerError::Sharding(format!(
                "distributed.shard_optimizer: {} trainable values are more than ember's ZeRO-1 over MPI handles \
                 (2^31 - 1); train without it, or with LoRA",
                layout.total + muon.as_ref().map_or(0, |m| m.total)
            )));
        }
        let n = layout.per_rank;
        let (m, v) = (vec![0.0; n], vec![0.0; n]);
        Ok(Self { config, compute, steps: 0, layout, m, v, grads: Vec::new(), gathered: Vec::new(), muon })
    }

    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// One step from this rank's (unreduced) gradients; every rank calls it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step<B: TrainBackend, M: AutodiffModule<B>>(
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
        let muon_grads = match &self.muon {
            Some(m) => m.take_grads::<B, M>(&model, &mut grads, c, what)?,
            None => Vec::new(),
        };
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
        let muon_squares = muon_grads.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
        let scaled_norm = (sum_squares[0] + muon_squares).sqrt();
        let grad_norm = scaled_norm / loss_scale;
        if let Some(scaler) = scaler {
            if !scaler.update(scaled_norm.is_finite()) {
                return Ok(ShardedStep { model, grad_norm, skipped: true, _b: Default::default() });
            }
        }
        self.steps += 1;
        let scale = clip_coefficient(grad_norm, self.config.grad_clip) / loss_scale;
        let mut mine = flatten_params(&model, &self.layout.slots, self.layout.range());
        self.update_shard::<B>(&mut mine, &g, lr, scale, device);
        self.gathered.resize(self.layout.per_rank * world, 0.0);
        c.all_gather_f32(&mine, &mut self.gathered, &format!("{what}: parameter all-gather"))?;
        let mut model = assign_params(model, &self.layout.slots, &self.gathered);
        if let Some(muon) = self.muon.as_mut() {
            model = muon.step::<B, M>(model, &muon_grads, scale, lr, c, device, self.compute, what)?;
        }
        Ok(ShardedStep { model, grad_norm, skipped: false, _b: Default::default() })
    }

    /// AdamW on this rank's shard: the parameters `mine` and the moments updated in place from the
    /// reduced gradients `g` (times `scale`), piece by piece (weight decay where the piece decays).
    fn update_shard<B: TrainBackend>(&mut self, mine: &mut [f32], g: &[f32], lr: f64, scale: f64, device: &Device<B>) {
        let t = self.steps as i32;
        let o = &self.config;
        let range = self.layout.range();
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
    }

    /// The moments of every parameter, gathered to rank 0 (the one that writes checkpoints) and
    /// named as [`AdamW::state_tensors`] names them; the other ranks get nothing and hold no more
    /// than their share. Every rank calls this.
    ///
    /// [`AdamW::state_tensors`]: crate::optim::AdamW::state_tensors
    pub(crate) fn state_tensors(&self, c: &dyn Collective) -> Result<Vec<(String, TensorData)>, DistError> {
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
        if let Some(muon) = &self.muon {
            out.extend(muon.state_tensors(c)?);
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Takes this rank's share of moments saved unsharded (by any world size), after `steps`.
    pub(crate) fn load_state(
        &mut self,
        mut tensors: BTreeMap<String, TensorData>,
        steps: u64,
    ) -> Result<(), OptimizerError> {
        match self.muon.as_mut() {
            Some(muon) => muon.load_state(&mut tensors, steps)?,
            None => {
                if let Some(k) = tensors.keys().find(|k| k.ends_with(".momentum_buffer")) {
                    return Err(OptimizerError::Moments(format!(
                        "`{k}` is Muon's, but this config has no [muon] (a run resumes with the optimizer it \
                         started with: restore its [muon] section)"
                    )));
                }
            }
        }
        let range = self.layout.range();
        let (mut m, mut v) = (vec![0.0f32; self.layout.per_rank], vec![0.0f32; self.layout.per_rank]);
        for s in &self.layout.slots {
            let pair =
                (tensors.remove(&format!("{}.exp_avg", s.path)), tensors.remove(&format!("{}.exp_avg_sq", s.path)));
            let (em, ev) = match pair {
                (Some(a), Some(b)) => (a, b),
                (None, None) if steps == 0 => continue,
                (None, None) => {
                    return Err(OptimizerError::Moments(format!(
                        "no moments for `{}` after {steps} optimizer steps",
                        s.path
                    )))
                }
                _ => {
                    return Err(OptimizerError::Moments(format!("`{}` has only one of exp_avg and exp_avg_sq", s.path)))
                }
            };
            for (name, d) in [("exp_avg", &em), ("exp_avg_sq", &ev)] {
                if d.num_elements() != s.len() {
                    return Err(OptimizerError::Moments(format!(
                        "`{}.{name}` has {} elements, the parameter has {}",
                        s.path,
                        d.num_elements(),
                        s.len()
                    )));
                }
            }
            let lo = range.start.max(s.offset);
            let hi = range.end.min(s.offset + s.len());
            if lo >= hi {
                continue;
            }
            for (d, out) in [(em, &mut m), (ev, &mut v)] {
                let d = d.convert::<f32>();
                let all = d.as_slice::<f32>().map_err(|e| OptimizerError::Moments(format!("`{}`: {e:?}", s.path)))?;
                out[lo - range.start..hi - range.start].copy_from_slice(&all[lo - s.offset..hi - s.offset]);
            }
        }
        if let Some(k) = tensors.keys().next() {
            if let Some(path) = k.strip_suffix(".momentum_buffer") {
                return Err(OptimizerError::Moments(format!(
                    "`{k}` is Muon's, but this config's [muon] does not train `{path}`"
                )));
            }
            return Err(OptimizerError::Moments(format!(
                "moment `{k}` belongs to no trainable parameter of the model"
            )));
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
        let mut sharded = ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default(), None).unwrap();
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
        let mut back = ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default(), None).unwrap();
        back.load_state(state.clone(), 3).unwrap();
        assert_eq!(back.state_tensors(&Solo).unwrap().into_iter().collect::<BTreeMap<_, _>>(), state);
    }

    /// One rank's ZeRO-1 with `[muon]` (weight decay, both of AdamW's and Muon's) equals the
    /// replicated AdamW + Muon over 3 steps, and its state (Muon's buffers included) round-trips
    /// through the unsharded checkpoint format, which the replicated optimizer also reads.
    #[test]
    fn one_shard_with_muon_is_the_replicated_optimizer() {
        use ember_model::{Decoder, ModelConfig};
        let dev: Device<AB> = Default::default();
        let muon = MuonConfig { weight_decay: 0.05, ..toml::from_str::<MuonConfig>("lr = 0.02").unwrap() };
        let cfg = ModelConfig { init_std: 0.2, ..ModelConfig::tiny(17, 8) };
        let grads = |m: &Decoder<AB>| {
            let ids: Vec<i32> = (0..16).map(|i| i * 7 % 17).collect();
            let tokens = Tensor::<AB, 2, burn::tensor::Int>::from_data(TensorData::new(ids, [2, 8]), &dev);
            let loss = m.forward(tokens).powi_scalar(2).mean();
            GradientsParams::from_grads(loss.backward(), m)
        };
        let (mut a, mut z) = (Decoder::<AB>::new(&cfg, 5, &dev).unwrap(), Decoder::<AB>::new(&cfg, 5, &dev).unwrap());
        let mut plain = AdamW::<AB>::new(config(), Compute::default()).with_muon(Some(&muon), 0.01);
        let mut sharded =
            ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default(), Some((&muon, 0.01))).unwrap();
        assert_eq!(sharded.muon.as_ref().unwrap().slots.len(), 7 * cfg.n_layers, "q, k, v, o, gate, up, down");
        assert!(sharded.layout.slots.iter().all(|s| !s.path.starts_with("layers.") || s.dims.len() == 1));
        for _ in 0..3 {
            let g = grads(&a);
            let norm = crate::optim::global_grad_norm(&a, &g, Compute::default());
            a = plain.step(0.01, a, g, clip_coefficient(norm, 0.5));
            let g = grads(&z);
            let step = sharded.step(&Solo, 0.01, z, g, 1.0, None, &dev, "test").unwrap();
            assert!((step.grad_norm - norm).abs() < 1e-5 * norm, "{} vs {norm}", step.grad_norm);
            z = step.model;
        }
        let weights = |m: &Decoder<AB>| {
            crate::distributed::buckets::flatten_params(m, &Layout::of::<AB, _>(m, 0, 1).slots, 0..cfg_total(m))
        };
        let (aw, zw) = (weights(&a), weights(&z));
        // Per parameter, the largest difference over the largest weight (the iteration's f32
        // rounding, in a different order of the gradient norm's sum, is all that differs).
        for s in Layout::of::<AB, _>(&a, 0, 1).slots {
            let r = s.offset..s.offset + s.len();
            let diff = aw[r.clone()].iter().zip(&zw[r.clone()]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            let top = aw[r].iter().map(|x| x.abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-6 * top, "{}: sharded Muon vs replicated differ by {diff:e} (largest {top})", s.path);
        }
        let state: BTreeMap<_, _> = sharded.state_tensors(&Solo).unwrap().into_iter().collect();
        let theirs: BTreeMap<_, _> = plain.state_tensors().into_iter().collect();
        assert_eq!(state.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>());
        assert_eq!(state.keys().filter(|k| k.ends_with(".momentum_buffer")).count(), 7 * cfg.n_layers);
        let mut back =
            ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default(), Some((&muon, 0.01))).unwrap();
        back.load_state(theirs.clone(), 3).unwrap();
        let reread: BTreeMap<_, _> = back.state_tensors(&Solo).unwrap().into_iter().collect();
        for (k, v) in &reread {
            let (x, y) = (v.to_vec::<f32>().unwrap(), theirs[k].to_vec::<f32>().unwrap());
            assert_eq!(x, y, "{k}");
        }
        // Without [muon], the buffers are refused by name.
        let mut adamw_only = ShardedAdamW::new::<AB, _>(config(), &z, &Solo, Compute::default(), None).unwrap();
        let e = adamw_only.load_state(theirs, 3).unwrap_err().to_string();
        assert!(e.contains("momentum_buffer") && e.contains("[muon]"), "{e}");
    }

    fn cfg_total<M: AutodiffModule<AB>>(m: &M) -> usize {
        Layout::of::<AB, _>(m, 0, 1).total
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
