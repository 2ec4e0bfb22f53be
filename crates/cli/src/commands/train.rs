use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_data::fetch::Locations;
use ember_model::ops::TrainBackend;
use ember_train::config::Precision;
use ember_train::{TrainConfig, TrainOptions, TrainSummary};

use crate::backend::{dispatch, DeviceSpec, Job};

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Training config (TOML), e.g. configs/nano.toml.
    #[arg(long)]
    config: PathBuf,
    /// Run directory for the config copy, tokenizer, checkpoints and metrics.jsonl [default: runs/<config name>].
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Continue the run in the run directory from its latest checkpoint.
    #[arg(long)]
    resume: bool,
    /// Stop after N optimizer steps, with a checkpoint; the LR schedule still follows the config.
    #[arg(long)]
    max_steps: Option<usize>,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceArg,
    /// Never draw the progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    no_progress: bool,
    /// f32, bf16 or f16 (overrides train.precision).
    #[arg(long)]
    precision: Option<Precision>,
    /// Peak TFLOP/s of the device for MFU (instead of the table or a measured GEMM peak).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Also serve the dashboard over the run directory's parent while training.
    #[arg(long)]
    dashboard: bool,
    /// Port of --dashboard.
    #[arg(long, default_value_t = 8686)]
    dashboard_port: u16,
}

/// `--device` as written: whether it named a device index.
#[derive(Debug, Clone, Copy)]
struct DeviceArg {
    spec: DeviceSpec,
    indexed: bool,
}

impl std::str::FromStr for DeviceArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(Self { spec: s.parse()?, indexed: s.contains(':') })
    }
}

struct TrainJob {
    config: TrainConfig,
    options: TrainOptions,
}

impl Job for TrainJob {
    type Output = TrainSummary;
    fn run<B: TrainBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<TrainSummary> {
        tracing::info!("training on {name}, run directory {}", self.options.run_dir.display());
        Ok(ember_train::train::<B>(self.config, &self.options, &device)?)
    }
}

pub fn run(
    args: TrainArgs,
    collective: std::sync::Arc<dyn ember_train::distributed::Collective>,
) -> anyhow::Result<()> {
    // The error names the file and the key.
    let mut config = TrainConfig::from_file(&args.config)?;
    if let Some(p) = args.precision {
        config.train.precision = p;
    }
    let run_dir = args.run_dir.unwrap_or_else(|| {
        let stem = args.config.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or("run".into());
        PathBuf::from("runs").join(stem)
    });
    // Each rank of a data-parallel run on its own GPU of the machine: cuda:<local rank>.
    // A bare `cuda` in a data-parallel run means each rank's own GPU of the machine:
    // cuda:<local rank>. An explicit index is kept (for launchers that give each rank one GPU).
    let device = match args.device {
        DeviceArg { spec: DeviceSpec::Cuda(_), indexed: false } if collective.world() > 1 => {
            DeviceSpec::Cuda(collective.local_rank())
        }
        DeviceArg { spec, .. } => spec,
    };
    let lead = collective.rank() == 0;
    let device_comm = device_comm(device, collective.as_ref())?;
    let options = TrainOptions {
        run_dir,
        resume: args.resume,
        stop_at: args.max_steps,
        show_progress: !args.no_progress && std::io::stderr().is_terminal(),
        locations: Locations::from_env(),
        device_name: crate::backend::gpu_name(device),
        peak_tflops: args.peak_tflops,
        memory: Some(crate::backend::memory_probe(device)),
        memory_available: crate::backend::memory_available(device),
        collective,
        device_comm,
    };
    // The dashboard is a convenience: if it cannot start, training goes on without it (and what it
    // is sent once running cannot reach the training loop; see ember_dashboard::server).
    let _dashboard = if args.dashboard && lead {
        let logdir =
            options.run_dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        std::fs::create_dir_all(logdir)
            .with_context(|| format!("creating {}", logdir.display()))
            .and_then(|()| {
                crate::commands::dashboard::start(
                    logdir,
                    std::net::Ipv4Addr::LOCALHOST.into(),
                    args.dashboard_port,
                    &[],
                    true,
                )
            })
            .inspect_err(|e| tracing::warn!("no dashboard: {e:#}; training goes on without it"))
            .ok()
    } else {
        None
    };
    let checkpointing = config.train.activation_checkpointing;
    let summary = dispatch(device, checkpointing, TrainJob { config, options })?;
    if !lead {
        return Ok(());
    }
    let best = summary.best_val_loss.map_or("n/a".into(), |v| format!("{v:.4}"));
    println!(
        "trained {} steps in {:.0} s ({:.0} tokens/s, MFU {:.2}%); best val loss {best}; run directory {}",
        summary.steps,
        summary.elapsed_s,
        summary.tokens_per_sec,
        100.0 * summary.mfu,
        summary.run_dir.display()
    );
    Ok(())
}

/// NCCL for the gradients of a data-parallel CUDA run (`--features nccl`): rank 0's id is sent to
/// the others over MPI. `EMBER_NCCL=1` makes one in a single process too (to check the path on one
/// GPU); `EMBER_NCCL=0` keeps the reduction on the host.
#[cfg(feature = "nccl")]
fn device_comm(
    device: DeviceSpec,
    c: &dyn ember_train::distributed::Collective,
) -> anyhow::Result<Option<ember_model::ops::DeviceComm>> {
    let wanted = match std::env::var("EMBER_NCCL").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => c.world() > 1,
    };
    let DeviceSpec::Cuda(ordinal) = device else { return Ok(None) };
    // Every rank must take the same way, or some would wait in NCCL and the others in MPI.
    ember_train::distributed::check_same(c, &[u8::from(wanted)], "EMBER_NCCL (NCCL or the host for the gradients)")?;
    if !wanted {
        return Ok(None);
    }
    let id = if c.rank() == 0 {
        ember_model::ops::nccl::unique_id().map_err(|e| anyhow::anyhow!(e))?
    } else {
        vec![0u8; 128]
    };
    let all = c.all_gather_bytes(&id, "start-up: NCCL id")?;
    let comm =
        ember_model::ops::nccl::communicator(ordinal, c.rank(), c.world(), &all[0]).map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!("gradients summed on the device by NCCL ({} rank(s))", c.world());
    Ok(Some(comm))
}

#[cfg(not(feature = "nccl"))]
fn device_comm(
    _: DeviceSpec,
    _: &dyn ember_train::distributed::Collective,
) -> anyhow::Result<Option<ember_model::ops::DeviceComm>> {
    Ok(None)
}
