//! Numerical checks of a backend, runnable where `cargo test` is not (a GPU machine with only the
//! `ember` binary): `ember check --device cuda`. The same checks run in the test suite on the CPU and,
//! in CI, on WGPU over a software Vulkan driver.

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, ElementConversion, Int, Tensor, TensorData};
use ember_kernels::cross_entropy::lm_head_loss_reference;
use ember_kernels::{lm_head_cross_entropy, ChunkSpec, Compute, TrainBackend};
use ember_model::lora::Target;
use ember_model::{Decoder, ModelConfig, RopeLayout, Weight};
use serde::Serialize;

use crate::config::OptimConfig;
use crate::optim::AdamW;

impl Check {
    /// `ok  `, `skip` or `FAIL`, for a line of a report.
    pub fn mark(&self) -> &'static str {
        if self.skipped {
            "skip"
        } else if self.passed {
            "ok  "
        } else {
            "FAIL"
        }
    }
}

/// How the detail of a check that could not run begins.
const SKIPPED: &str = "skipped:";

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    /// The check ran and held.
    pub passed: bool,
    /// The check could not run on this device (neither passed nor failed).
    pub skipped: bool,
    pub detail: String,
    pub ms: f64,
}

fn config(n_kv_heads: usize, layout: RopeLayout) -> ModelConfig {
    ModelConfig {
        d_model: 64,
        n_kv_heads: Some(n_kv_heads),
        d_ff: 128,
        rope_layout: layout,
        qkv_bias: true,
        init_std: 0.1,
        ..ModelConfig::tiny(53, 32)
    }
}

fn tokens<B: burn::tensor::backend::Backend>(ids: &[i32], rows: usize, device: &Device<B>) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(ids.to_vec(), [rows, ids.len() / rows]), device)
}

fn max_abs<B: burn::tensor::backend::Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f64 {
    (a - b).abs().max().into_scalar().elem::<f64>()
}

/// Runs every check on `device`; `tol` is the absolute tolerance of the f32 comparisons.
pub fn run<B: TrainBackend>(device: &Device<B>, tol: f64) -> Vec<Check> {
    let mut out = Vec::new();
    let mut check = |name: &str, f: &mut dyn FnMut() -> (bool, String)| {
        let start = Instant::now();
        let (passed, detail) = f();
        let ms = start.elapsed().as_secs_f64() * 1e3;
        // A check that could not run says so in its detail, and counts as neither pass nor fail.
        let skipped = detail.starts_with(SKIPPED);
        out.push(Check { name: name.into(), passed: passed && !skipped, skipped, detail, ms });
    };
    check("causality: a prefix gives the full sequence's outputs", &mut || causality::<B>(device, tol));
    check("cached decoding equals the full forward (MHA, GQA, MQA; both RoPE layouts)", &mut || {
        cached_decoding::<B>(device, tol)
    });
    check("tiled LM-head cross-entropy equals the plain one (values and gradients)", &mut || {
        tiled_loss::<B>(device, tol)
    });
    check("data-parallel gradients through the host: flattened, summed, put back; ZeRO-1 equals AdamW", &mut || {
        data_parallel::<B>(device, tol)
    });
    for precision in [DType::F32, DType::F16, DType::BF16] {
        let name = format!("a few training steps lower the loss ({precision:?})");
        if precision != DType::F32 && !<B as burn::tensor::backend::Backend>::supports_dtype(device, precision) {
            check(&name, &mut || (false, format!("{SKIPPED} the device does not support this dtype")));
            continue;
        }
        check(&name, &mut || training_steps::<B>(device, precision));
    }
    out
}

type IB<B> = <B as burn::tensor::backend::AutodiffBackend>::InnerBackend;

/// Token ids of the checks: 24 of a 53-token vocabulary.
fn ids() -> Vec<i32> {
    (0..24).map(|i| (i * 7 + 3) % 53).collect()
}

fn causality<B: TrainBackend>(device: &Device<B>, tol: f64) -> (bool, String) {
    let ids = ids();
    let model = Decoder::<IB<B>>::new(&config(2, RopeLayout::HalfSplit), 1, device).expect("valid");
    let full = model.forward(tokens(&ids, 1, device)).narrow(1, 0, 10);
    let prefix = model.forward(tokens(&ids[..10], 1, device));
    let d = max_abs(full, prefix);
    (d < tol, format!("max |diff| {d:.2e}"))
}

fn cached_decoding<B: TrainBackend>(device: &Device<B>, tol: f64) -> (bool, String) {
    let ids = ids();
    let mut worst = 0.0f64;
    for n_kv in [4, 2, 1] {
        for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
            let cfg = config(n_kv, layout);
            let model = Decoder::<IB<B>>::new(&cfg, 2, device).expect("valid");
            let full = model.forward(tokens(&ids, 1, device)).reshape([ids.len(), cfg.vocab_size]);
            let mut cache = model.new_cache(1, 8);
            let h = model.forward_cached(tokens(&ids[..5], 1, device), &[5], &mut cache);
            worst = worst.max(max_abs(model.logits(h.reshape([5, cfg.d_model])), full.clone().narrow(0, 0, 5)));
            for i in 5..ids.len() {
                let h = model.forward_cached(tokens(&ids[i..i + 1], 1, device), &[1], &mut cache);
                worst = worst.max(max_abs(model.logits(h.reshape([1, cfg.d_model])), full.clone().narrow(0, i, 1)));
            }
        }
    }
    (worst < tol, format!("max |diff| {worst:.2e}"))
}

fn tiled_loss<B: TrainBackend>(device: &Device<B>, tol: f64) -> (bool, String) {
    let (n, d, v) = (37, 16, 101);
    let t: Vec<i32> = (0..n).map(|i| if i % 9 == 0 { -1 } else { (i * 13) % v }).collect();
    let h0 = Tensor::<IB<B>, 2>::random([n, d], burn::tensor::Distribution::Normal(0.0, 1.0), device);
    let w0 = Tensor::<IB<B>, 2>::random([d, v], burn::tensor::Distribution::Normal(0.0, 0.3), device);
    let run = |chunked: bool| {
        let h = Tensor::<B, 2>::from_inner(h0.clone()).require_grad();
        let w = Tensor::<B, 2>::from_inner(w0.clone()).require_grad();
        let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(t.clone(), [n]), device);
        let loss = if chunked {
            lm_head_cross_entropy(
                h.clone(),
                w.clone(),
                targets,
                ChunkSpec { rows: 8, vocab: 24, compute: Compute::default() },
            )
        } else {
            lm_head_loss_reference(h.clone(), w.clone(), targets, DType::F32)
        };
        let g = loss.backward();
        (loss.inner(), h.grad(&g).expect("grad"), w.grad(&g).expect("grad"))
    };
    let (l1, dh1, dw1) = run(true);
    let (l0, dh0, dw0) = run(false);
    let d = max_abs(l1, l0).max(max_abs(dh1, dh0)).max(max_abs(dw1, dw0));
    (d < tol, format!("max |diff| {d:.2e}"))
}

fn data_parallel<B: TrainBackend>(device: &Device<B>, tol: f64) -> (bool, String) {
    let ids = ids();
    use crate::distributed::buckets::{flatten, unflatten};
    use crate::distributed::{zero::ShardedAdamW, Solo};
    let cfg = config(2, RopeLayout::HalfSplit);
    let model = Decoder::<B>::new(&cfg, 4, device).expect("valid");
    let loss_grads = |m: &Decoder<B>| {
        let hidden = m.hidden(tokens(&ids, 2, device), 0).reshape([24, cfg.d_model]);
        let t = Tensor::<B, 1, Int>::from_data(
            TensorData::new(ids.iter().map(|i| (i + 1) % 53).collect::<Vec<_>>(), [24]),
            device,
        );
        let loss = m.loss(hidden, t);
        GradientsParams::from_grads(loss.backward(), m)
    };
    // Two identical ranks: the sum is twice each gradient.
    let mut grads = loss_grads(&model);
    let Some(Weight::Dense(down)) = model.layers[0].projection(Target::DownProj).map(|p| &p.weight) else {
        return (false, "the check's model has a dense down projection".into());
    };
    let want = grads.get::<IB<B>, 2>(down.id).expect("a gradient");
    let flat = flatten(&model, &mut grads);
    let doubled: Vec<f32> = flat.values.iter().map(|v| 2.0 * v).collect();
    let back = unflatten(&model, &flat, &doubled);
    let got = back.get::<IB<B>, 2>(down.id).expect("put back");
    let d_sum = max_abs(got, want.mul_scalar(2.0));
    // One rank's ZeRO-1 step against AdamW's, from the same gradients.
    let o = OptimConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, grad_clip: 0.0 };
    let mut zero = match ShardedAdamW::new::<B, _>(o.clone(), &model, &Solo, model.compute(), None) {
        Ok(z) => z,
        Err(e) => return (false, e.to_string()),
    };
    let plain = AdamW::<B>::new(o, model.compute()).step(1e-2, model.clone(), loss_grads(&model), 1.0);
    let sharded = zero.step(&Solo, 1e-2, model.clone(), loss_grads(&model), 1.0, None, device, "check");
    let d_zero = match sharded {
        Ok(s) => {
            let o_proj = |m: &Decoder<B>| match m.layers[1].projection(Target::OProj).map(|p| &p.weight) {
                Some(Weight::Dense(w)) => w.val(),
                _ => unreachable!("the check's model has dense projections"),
            };
            max_abs(o_proj(&s.model), o_proj(&plain))
        }
        Err(e) => return (false, e.to_string()),
    };
    (d_sum < tol && d_zero < tol, format!("sum max |diff| {d_sum:.2e}, ZeRO-1 max |diff| {d_zero:.2e}"))
}

fn training_steps<B: TrainBackend>(device: &Device<B>, precision: DType) -> (bool, String) {
    // A repeating pattern is easy to learn: 25 AdamW steps must cut the loss clearly.
    let cfg = config(2, RopeLayout::HalfSplit);
    let cx = Compute::default().with_dtype(precision);
    let mut model = Decoder::<B>::new(&cfg, 3, device).expect("valid").with_compute(cx);
    let mut optim =
        AdamW::<B>::new(OptimConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0, grad_clip: 1.0 }, cx);
    let pattern: Vec<i32> = (0..4 * 17).map(|i| [5, 9, 2, 44, 31, 7, 19][i % 7]).collect();
    let (inputs, targets): (Vec<i32>, Vec<i32>) =
        (0..4).flat_map(|r| (0..16).map(move |c| (r * 17 + c) as usize)).map(|i| (pattern[i], pattern[i + 1])).unzip();
    let mut losses = Vec::new();
    for _ in 0..25 {
        let hidden = model.hidden(tokens(&inputs, 4, device), 0).reshape([64, cfg.d_model]);
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [64]), device);
        let loss = model.loss(hidden, t);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads, 1.0);
    }
    let (first, last) = (losses[0], *losses.last().expect("steps"));
    (last < 0.5 * first && last.is_finite(), format!("loss {first:.3} -> {last:.3}"))
}
