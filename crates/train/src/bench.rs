//! `ember bench train`: the speed of the training step, measured on the real data pipeline.

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Device;
use ember_data::fetch::Locations;
use ember_data::WindowSampler;
use ember_model::Decoder;
use serde::Serialize;

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::optim::AdamW;
use crate::schedule::LrSchedule;
use crate::trainer::{optimizer_step, prepare};

#[derive(Debug, Clone, Serialize)]
pub struct TrainBench {
    pub device: String,
    pub steps: usize,
    /// Median wall time of one optimizer step (forward, backward, clipping, AdamW), milliseconds.
    pub step_ms: f64,
    pub step_ms_min: f64,
    pub step_ms_max: f64,
    pub tokens_per_step: usize,
    /// Tokens per second at the median step time.
    pub tokens_per_sec: f64,
    /// Training FLOPs per token, 6N + 12·L·T·d.
    pub flops_per_token: f64,
    /// Model FLOPs per second achieved: flops_per_token · tokens_per_sec.
    pub achieved_flops: f64,
}

/// Times `steps` optimizer steps after `warmup` untimed ones.
pub fn bench_train<B: AutodiffBackend>(
    config: TrainConfig,
    locations: &Locations,
    warmup: usize,
    steps: usize,
    device: &Device<B>,
    device_name: &str,
) -> Result<TrainBench, TrainError> {
    let setup = prepare(config, locations)?;
    let config = &setup.config;
    let mut model = Decoder::<B>::new(&config.model, config.train.seed, device)?;
    let mut optim = AdamW::<B>::new(config.optim.clone());
    let schedule = LrSchedule::from_config(config);
    let sampler = WindowSampler { seed: config.train.seed };
    let accum = config.train.grad_accum_steps as u64;
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let start = Instant::now();
        (model, _) =
            optimizer_step(model, &mut optim, &setup.train, &sampler, i as u64 * accum, schedule.lr(i), config, device);
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let step_ms = times[times.len() / 2];
    let tokens_per_step = config.tokens_per_step();
    let tokens_per_sec = tokens_per_step as f64 / (step_ms / 1e3);
    let flops_per_token = config.model.train_flops_per_token(config.seq_len());
    Ok(TrainBench {
        device: device_name.to_string(),
        steps,
        step_ms,
        step_ms_min: times[0],
        step_ms_max: times[times.len() - 1],
        tokens_per_step,
        tokens_per_sec,
        flops_per_token,
        achieved_flops: flops_per_token * tokens_per_sec,
    })
}
