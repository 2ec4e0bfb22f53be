use burn::tensor::Device;
use clap::Args;
use ember_kernels::TrainBackend;
use ember_train::selfcheck::{run as run_checks, Check};

use crate::backend::{dispatch, DeviceSpec, Job};

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Absolute tolerance of the f32 comparisons.
    #[arg(long, default_value_t = 1e-4)]
    tolerance: f64,
    /// Print one JSON object per check.
    #[arg(long)]
    json: bool,
}

struct CheckJob(f64);

impl Job for CheckJob {
    type Output = Vec<Check>;
    fn run<B: TrainBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<Vec<Check>> {
        tracing::info!("checking {name}");
        Ok(run_checks::<B>(&device, self.0))
    }
}

/// Runs the numerical checks on a device; fails if any does.
pub fn run(args: CheckArgs) -> anyhow::Result<()> {
    let checks = dispatch(args.device, false, CheckJob(args.tolerance))?;
    for c in &checks {
        if args.json {
            println!("{}", serde_json::to_string(c)?);
        } else {
            println!("{} {} ({}, {:.0} ms)", c.mark(), c.name, c.detail, c.ms);
        }
    }
    let failed = checks.iter().filter(|c| !c.passed && !c.skipped).count();
    let skipped = checks.iter().filter(|c| c.skipped).count();
    anyhow::ensure!(failed == 0, "{failed} of {} checks failed on {} ({skipped} skipped)", checks.len(), args.device);
    eprintln!("{} passed, {failed} failed, {skipped} skipped on {}", checks.len() - skipped, args.device);
    Ok(())
}
