//! AdamW with decoupled weight decay (Loshchilov and Hutter, 2019), matching `torch.optim.AdamW`:
//!
//! ```text
//! m = β1·m + (1-β1)·g          v = β2·v + (1-β2)·g²
//! p = p·(1 - lr·wd) - lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps)
//! ```
//!
//! Weight decay applies to parameters of rank >= 2 only (projections and the embedding, nanoGPT's
//! rule), never to norm gains or biases. Burn 0.21 has no parameter groups and clips per parameter,
//! so ember does both itself: the trainer computes one global clipping coefficient from
//! [`global_grad_norm`] and [`clip_coefficient`], and [`AdamW::step`] scales every gradient by it.
//! State is keyed by parameter path, so optimizer checkpoints are readable safetensors files.
//!
//! With a `[muon]` section, [`Muon`] trains the hidden matrices instead (its momentum buffers saved
//! as `<path>.momentum_buffer`, torch's name) and AdamW the rest.

use std::collections::{BTreeMap, HashMap};

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Device, ElementConversion, Tensor, TensorData};

use ember_kernels::{adamw, sum_squares, AdamWStep, Compute, TrainBackend};
use ember_model::weights::{map_paths, param_shapes, PathMapper};

use crate::collective::{Collective, DistError, Solo};
use crate::config::{MuonConfig, OptimConfig};
use crate::error::OptimizerError;
use crate::muon::{adjusted_lr, Muon};

/// First and second moments of one parameter, flattened.
struct Moments<B: Backend> {
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
}

pub(crate) struct AdamW<B: TrainBackend> {
    config: OptimConfig,
    /// How the updates compute: the model's.
    compute: Compute,
    /// Optimizer steps taken (t in the bias corrections is `steps + 1` during a step).
    steps: u64,
    state: HashMap<String, Moments<B::InnerBackend>>,
    /// Muon for the hidden matrices, when the config has `[muon]`.
    muon: Option<Muon<B::InnerBackend>>,
}

impl<B: TrainBackend> AdamW<B> {
    pub(crate) fn new(config: OptimConfig, compute: Compute) -> Self {
        Self { config, compute, steps: 0, state: HashMap::new(), muon: None }
    }

    /// The hidden matrices trained by Muon of `muon` (when given), whose rate follows AdamW's
    /// schedule scaled by `muon.lr / adamw_lr` (`adamw_lr`: `schedule.lr`).
    pub(crate) fn with_muon(mut self, muon: Option<&MuonConfig>, adamw_lr: f64) -> Self {
        self.muon = muon.map(|m| Muon::new(m.clone(), adamw_lr));
        self
    }

    pub(crate) fn steps(&self) -> u64 {
        self.steps
    }

    /// One update of every parameter that has a gradient in `grads`, each gradient first multiplied
    /// by `grad_scale` (the clipping coefficient). Parameters without a gradient are left alone.
    pub(crate) fn step<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        grad_scale: f64,
    ) -> M {
        match self.step_shared(lr, model, grads, grad_scale, &Solo, "step") {
            Ok(model) => model,
            Err(e) => unreachable!("a single process has no collective to fail: {e}"),
        }
    }

    /// [`Self::step`] in a data-parallel run whose gradients `c` has already summed: the ranks share
    /// Muon's orthogonalisations (`what` names the step in errors).
    pub(crate) fn step_shared<M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        mut grads: GradientsParams,
        grad_scale: f64,
        c: &dyn Collective,
        what: &str,
    ) -> Result<M, DistError> {
        let muon_updates = match self.muon.as_mut() {
            Some(muon) => muon.orthogonalized::<B, M>(&model, &grads, grad_scale, c, what, self.compute)?,
            None => HashMap::new(),
        };
        self.steps += 1;
        let t = self.steps as i32;
        let c = &self.config;
        let mut mapper = Update::<B> {
            compute: self.compute,
            grads: &mut grads,
            state: &mut self.state,
            lr,
            grad_scale,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            bias1: 1.0 - c.beta1.powi(t),
            bias2: 1.0 - c.beta2.powi(t),
            muon: self.muon.as_ref().map(|m| (m.lr(lr), m.config.weight_decay, m.config.adjust_lr)),
            muon_updates,
        };
        Ok(map_paths(model, &mut mapper))
    }

    /// Moments as named tensors: `<param path>.exp_avg` and `<param path>.exp_avg_sq` (torch's names).
    pub(crate) fn state_tensors(&self) -> Vec<(String, TensorData)> {
        let mut keys: Vec<&String> = self.state.keys().collect();
        keys.sort();
        keys.into_iter()
            .flat_map(|k| {
                let s = &self.state[k];
                [(format!("{k}.exp_avg"), s.m.to_data()), (format!("{k}.exp_avg_sq"), s.v.to_data())]
            })
            .chain(self.muon.iter().flat_map(|m| {
                let mut keys: Vec<&String> = m.buffers.keys().collect();
                keys.sort();
                keys.into_iter().map(|k| (format!("{k}.momentum_buffer"), m.buffers[k].to_data()))
            }))
            .collect()
    }

    /// Restores moments saved by [`Self::state_tensors`] after `steps` steps. Every moment must
    /// belong to a parameter of `model` and have its number of elements.
    pub(crate) fn load_state<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        mut tensors: BTreeMap<String, TensorData>,
        steps: u64,
        device: &Device<B::InnerBackend>,
    ) -> Result<(), OptimizerError> {
        let mut state = HashMap::new();
        let mut buffers = HashMap::new();
        for (path, shape) in param_shapes::<B, M>(model) {
            let n = &shape.iter().product::<usize>();
            let muon = self.muon.as_ref().is_some_and(|m| m.takes(&path, shape.len()));
            if let Some(buffer) = tensors.remove(&format!("{path}.momentum_buffer")) {
                if !muon {
                    return Err(OptimizerError::Moments(format!(
                        "`{path}.momentum_buffer` is Muon's, but Muon does not train `{path}` in this config \
                         (a run resumes with the optimizer it started with: restore its [muon] section)"
                    )));
                }
                if buffer.shape.to_vec() != shape {
                    return Err(OptimizerError::Moments(format!(
                        "`{path}.momentum_buffer` has shape {:?}, the parameter has {shape:?}",
                        buffer.shape
                    )));
                }
                let values = buffer.convert::<f32>().into_vec::<f32>().expect("converted to f32");
                buffers.insert(path.clone(), Tensor::from_data(TensorData::new(values, [shape[0], shape[1]]), device));
            }
            let m = tensors.remove(&format!("{path}.exp_avg"));
            let v = tensors.remove(&format!("{path}.exp_avg_sq"));
            match (m, v) {
                (Some(_), Some(_)) if muon => {
                    return Err(OptimizerError::Moments(format!(
                        "`{path}` has AdamW moments, but this config's [muon] trains it (a run resumes with \
                         the optimizer it started with: remove [muon], or start a new run)"
                    )));
                }
                (Some(m), Some(v)) => {
                    for (name, d) in [("exp_avg", &m), ("exp_avg_sq", &v)] {
                        if d.num_elements() != *n {
                            return Err(OptimizerError::Moments(format!(
                                "`{path}.{name}` has {} elements, the parameter has {n}",
                                d.num_elements()
                            )));
                        }
                    }
                    let load = |d: TensorData| {
                        let values = d.convert::<f32>().into_vec::<f32>().expect("converted to f32");
                        Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(values, [*n]), device)
                    };
                    state.insert(path.clone(), Moments { m: load(m), v: load(v) });
                }
                (None, None) => {} // before the first step, or a parameter that never had a gradient (frozen)
                _ => return Err(OptimizerError::Moments(format!("`{path}` has only one of exp_avg and exp_avg_sq"))),
            }
        }
        if let Some(k) = tensors.keys().next() {
            return Err(OptimizerError::Moments(format!("moment `{k}` belongs to no parameter of the model")));
        }
        self.state = state;
        if let Some(muon) = self.muon.as_mut() {
            muon.buffers = buffers;
        }
        self.steps = steps;
        Ok(())
    }
}

struct Update<'a, B: TrainBackend> {
    compute: Compute,
    grads: &'a mut GradientsParams,
    state: &'a mut HashMap<String, Moments<B::InnerBackend>>,
    lr: f64,
    grad_scale: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    bias1: f64,
    bias2: f64,
    /// Muon's rate at this step, its weight decay and shape scale.
    muon: Option<(f64, f64, crate::config::AdjustLr)>,
    /// Muon's orthogonalised updates, by path.
    muon_updates: HashMap<String, Tensor<B::InnerBackend, 2>>,
}

impl<B: TrainBackend> PathMapper<B> for Update<'_, B> {
    fn map<const D: usize>(&mut self, path: &str, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let dims = tensor.dims();
        if let (Some(o), Some((lr, wd, adjust))) = (self.muon_updates.remove(path), self.muon) {
            let p = tensor.inner();
            let p = if wd == 0.0 { p } else { p.mul_scalar(1.0 - lr * wd) };
            let p = p - o.mul_scalar(adjusted_lr(lr, adjust, [dims[0], dims[1]])).reshape(dims);
            return Param::from_mapped_value(id, Tensor::<B, D>::from_inner(p).require_grad(), mapper);
        }
        let n = tensor.shape().num_elements();
        let key = path.to_string();
        let g = grad.reshape([n]); // [n]
        let moments = self.state.remove(&key).unwrap_or_else(|| {
            let zeros = || Tensor::zeros([n], &g.device());
            Moments { m: zeros(), v: zeros() }
        });
        let h = AdamWStep {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            decay: if D >= 2 { self.lr * self.weight_decay } else { 0.0 },
            bias1: self.bias1,
            bias2: self.bias2,
            grad_scale: self.grad_scale,
        };
        let (p, m, v) = adamw(tensor.inner().reshape([n]), g, moments.m, moments.v, h, self.compute);
        self.state.insert(key, Moments { m, v });
        let p = Tensor::<B, D>::from_inner(p.reshape(dims)).require_grad();
        Param::from_mapped_value(id, p, mapper)
    }
}

/// The L2 norm of all gradients together, as `torch.nn.utils.clip_grad_norm_` computes it, in f32.
pub(crate) fn global_grad_norm<B: TrainBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
    cx: Compute,
) -> f64 {
    struct SumSquares<'a, IB: Backend> {
        grads: &'a GradientsParams,
        total: Option<Tensor<IB, 1>>,
        cx: Compute,
    }
    impl<B: TrainBackend> ModuleVisitor<B> for SumSquares<'_, B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                let s = sum_squares(g, self.cx);
                self.total = Some(match self.total.take() {
                    Some(t) => t + s,
                    None => s,
                });
            }
        }
    }
    let mut v = SumSquares::<B::InnerBackend> { grads, total: None, cx };
    model.visit(&mut v);
    v.total.map_or(0.0, |t| t.into_scalar().elem::<f64>().sqrt())
}

/// torch's coefficient: `min(1, max_norm / (norm + 1e-6))`; 1 when clipping is off.
pub(crate) fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        1.0
    } else {
        (max_norm / (norm + 1e-6)).min(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Two, AB};
    use burn::backend::Flex;
    use burn::tensor::Tolerance;

    fn model(dev: &Device<AB>) -> Two<AB> {
        Two::new([[0.5, -1.0], [2.0, 0.25]], [0.1, -0.2], dev)
    }

    fn loss(m: &Two<AB>, dev: &Device<AB>) -> Tensor<AB, 1> {
        let x = Tensor::<AB, 2>::from_data([[1.0, 2.0], [-1.0, 0.5], [0.3, 0.3]], dev);
        (x.matmul(m.w.val()) + m.b.val().unsqueeze()).powi_scalar(2).mean().reshape([1])
    }

    fn config() -> OptimConfig {
        OptimConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, grad_clip: 0.0 }
    }

    /// The update written out on host floats for one parameter, as torch documents it.
    fn reference_adamw(p: &[f32], grads: &[Vec<f32>], lr: f64, decay: bool, c: &OptimConfig) -> Vec<f32> {
        let mut p: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut m, mut v) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..p.len() {
                let gi = g[i] as f64;
                m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
                v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
                if decay {
                    p[i] *= 1.0 - lr * c.weight_decay;
                }
                let mh = m[i] / (1.0 - c.beta1.powi(t));
                let vh = v[i] / (1.0 - c.beta2.powi(t));
                p[i] -= lr * mh / (vh.sqrt() + c.eps);
            }
        }
        p.iter().map(|&x| x as f32).collect()
    }

    #[test]
    fn three_steps_match_the_reference_and_decay_only_matrices() {
        let dev = Default::default();
        let mut m = model(&dev);
        let (w0, b0) = (m.w.val().into_data().to_vec::<f32>().unwrap(), m.b.val().into_data().to_vec::<f32>().unwrap());
        let mut opt = AdamW::<AB>::new(config(), Compute::default());
        let (mut gw, mut gb) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let grads = GradientsParams::from_grads(loss(&m, &dev).backward(), &m);
            gw.push(grads.get::<Flex, 2>(m.w.id).unwrap().into_data().to_vec::<f32>().unwrap());
            gb.push(grads.get::<Flex, 1>(m.b.id).unwrap().into_data().to_vec::<f32>().unwrap());
            m = opt.step(0.01, m, grads, 1.0);
        }
        let want_w = reference_adamw(&w0, &gw, 0.01, true, &config());
        let want_b = reference_adamw(&b0, &gb, 0.01, false, &config());
        m.w.val().into_data().assert_approx_eq::<f32>(&TensorData::new(want_w, [2, 2]), Tolerance::absolute(1e-6));
        m.b.val().into_data().assert_approx_eq::<f32>(&TensorData::new(want_b, [2]), Tolerance::absolute(1e-6));
        assert_eq!(opt.steps(), 3);
    }

    #[test]
    fn global_norm_and_clipping_follow_torch() {
        let dev = Default::default();
        let m = model(&dev);
        let grads = GradientsParams::from_grads(loss(&m, &dev).backward(), &m);
        let all: Vec<f32> = [
            grads.get::<Flex, 2>(m.w.id).unwrap().into_data().to_vec::<f32>().unwrap(),
            grads.get::<Flex, 1>(m.b.id).unwrap().into_data().to_vec::<f32>().unwrap(),
        ]
        .concat();
        let want = all.iter().map(|&g| (g as f64).powi(2)).sum::<f64>().sqrt();
        let norm = global_grad_norm(&m, &grads, Compute::default());
        assert!((norm - want).abs() < 1e-5 * want, "{norm} vs {want}");
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert!((clip_coefficient(4.0, 1.0) - 1.0 / (4.0 + 1e-6)).abs() < 1e-12);
        assert_eq!(clip_coefficient(4.0, 0.0), 1.0);
    }

    #[test]
    fn state_round_trips_through_named_tensors() {
        let dev = Default::default();
        let mut m = model(&dev);
        let mut opt = AdamW::<AB>::new(config(), Compute::default());
        for _ in 0..2 {
            let grads = GradientsParams::from_grads(loss(&m, &dev).backward(), &m);
            m = opt.step(0.01, m, grads, 1.0);
        }
        let saved: BTreeMap<String, TensorData> = opt.state_tensors().into_iter().collect();
        assert_eq!(
            saved.keys().cloned().collect::<Vec<_>>(),
            ["b.exp_avg", "b.exp_avg_sq", "w.exp_avg", "w.exp_avg_sq"]
        );
        let mut restored = AdamW::<AB>::new(config(), Compute::default());
        restored.load_state(&m, saved.clone(), 2, &dev).unwrap();
        let (mut a, mut b) = (m.clone(), m.clone());
        let grads = GradientsParams::from_grads(loss(&a, &dev).backward(), &a);
        a = opt.step(0.01, a, grads, 1.0);
        let grads = GradientsParams::from_grads(loss(&b, &dev).backward(), &b);
        b = restored.step(0.01, b, grads, 1.0);
        a.w.val().into_data().assert_eq(&b.w.val().into_data(), true);
        let mut bad = saved;
        bad.insert("c.exp_avg".into(), TensorData::new(vec![0.0f32], [1]));
        let e = AdamW::<AB>::new(config(), Compute::default()).load_state(&m, bad, 2, &dev).unwrap_err();
        assert_eq!(e.to_string(), "moment `c.exp_avg` belongs to no parameter of the model");
    }
}
