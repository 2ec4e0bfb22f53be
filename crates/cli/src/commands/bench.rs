use std::path::PathBuf;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Device;
use clap::{Args, Subcommand};
use ember_data::fetch::Locations;
use ember_train::bench::{bench_train, TrainBench};
use ember_train::TrainConfig;

use crate::backend::{dispatch, DeviceSpec, Job};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Time the training step of a config: step time, tokens/s, achieved FLOP/s.
    Train(TrainBenchArgs),
}

#[derive(Args, Debug)]
struct TrainBenchArgs {
    #[arg(long)]
    config: PathBuf,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

struct TrainBenchJob {
    config: TrainConfig,
    warmup: usize,
    steps: usize,
}

impl Job for TrainBenchJob {
    type Output = TrainBench;
    fn run<B: AutodiffBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<TrainBench> {
        Ok(bench_train::<B>(self.config, &Locations::from_env(), self.warmup, self.steps, &device, name)?)
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        BenchCommand::Train(a) => {
            anyhow::ensure!(a.steps > 0, "--steps must be at least 1");
            let config = TrainConfig::from_file(&a.config)?;
            let r = dispatch(a.device, TrainBenchJob { config, warmup: a.warmup, steps: a.steps })?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{}: {:.1} ms/step (median of {}, min {:.1}, max {:.1}), {:.0} tokens/s, {:.2} GFLOP/s of model FLOPs",
                    r.device,
                    r.step_ms,
                    r.steps,
                    r.step_ms_min,
                    r.step_ms_max,
                    r.tokens_per_sec,
                    r.achieved_flops / 1e9
                );
            }
            Ok(())
        }
    }
}
