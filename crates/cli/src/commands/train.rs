use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_kernels::TrainBackend;
use ember_train::config::Precision;
use ember_train::distributed::Collective;
use ember_train::{ConfigFile, ResolvedConfig, TrainOptions, TrainSummary};

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
    /// With --resume: continue even though the data file changed since the checkpoint (rows added,
    /// removed, shuffled or edited); the change is logged as a warning and recorded in the next
    /// checkpoints. Without it such a resume is refused.
    #[arg(long, requires = "resume")]
    accept_data_change: bool,
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
#[derive(Debug, Clone)]
struct DeviceArg {
    spec: DeviceSpec,
    indexed: bool,
    text: String,
}

impl std::str::FromStr for DeviceArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(Self { spec: s.parse()?, indexed: s.contains(':'), text: s.to_string() })
    }
}

struct TrainJob {
    run: ResolvedConfig,
    options: TrainOptions,
}

impl Job for TrainJob {
    type Output = TrainSummary;
    fn run<B: TrainBackend>(self, device: Device<B>, name: &str) -> anyhow::Result<TrainSummary> {
        tracing::info!("training on {name}, run directory {}", self.options.run_dir.display());
        Ok(ember_train::train::<B>(self.run, &self.options, &device)?)
    }
}

pub fn run(args: TrainArgs, collective: Arc<dyn Collective>) -> anyhow::Result<()> {
    // Parsing reads the file alone (errors name it and the key); resolving opens `init_from`, once.
    let mut run = ConfigFile::read(&args.config)?.resolve()?;
    if let Some(p) = args.precision {
        run.config.train.precision = p;
    }
    let device = device(&args.device, collective.as_ref());
    let lead = collective.rank() == 0;
    let options = options(&args, device, collective)?;
    let _dashboard = (args.dashboard && lead).then(|| dashboard(&options.run_dir, args.dashboard_port)).flatten();
    let checkpointing = run.config.train.activation_checkpointing;
    // Ctrl-C (SIGINT) or SIGTERM: the run checkpoints the step in hand and stops; a second one ends
    // the process at once. Under mpirun, every rank stops at the same step (see
    // TrainOptions::stop_requested) if the launcher lets them finish the checkpoint.
    crate::signals::catch_stop().context("asking for SIGINT and SIGTERM")?;
    if lead {
        say_when_stopping();
    }
    let summary = dispatch(device, checkpointing, TrainJob { run, options: options.clone() })?;
    if lead {
        println!("{summary}");
        if let ember_train::RunEnd::Stopped { .. } = summary.end {
            println!("resume with: {}", resume_command(&args, &options.run_dir, options.collective.world()));
            // Rank 0 alone says so in its status: under mpirun, a rank that ends with a failure
            // has the others killed, maybe before rank 0 has printed the above.
            return Err(Stopped { status: crate::signals::stopped_status() }.into());
        }
    }
    Ok(())
}

/// A run stopped on a signal, checkpointed and reported: `main` exits with `status` (not 0: the run
/// is not complete) and prints nothing more.
#[derive(Debug)]
pub struct Stopped {
    pub status: u8,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped on a signal (exit status {})", self.status)
    }
}

impl std::error::Error for Stopped {}

/// Says at once that a Ctrl-C was heard (the run itself stops only after the step in hand, which
/// may take a while): a thread that waits for the request and dies with the process.
fn say_when_stopping() {
    let watch = || {
        while !crate::signals::stop_requested() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        tracing::warn!(
            "stopping: the step in hand finishes and is checkpointed; press Ctrl-C again to quit at once (the run \
             then resumes from its previous checkpoint)"
        );
    };
    if let Err(e) = std::thread::Builder::new().name("stop-watch".into()).spawn(watch) {
        tracing::debug!("no message on Ctrl-C: {e}");
    }
}

/// The command that continues the run in `run_dir`: this program (as it was called) with the run's
/// own config (paths resolved, any --precision applied) and the device and flags of this one; under
/// `mpirun -n <world>` for a data-parallel run.
fn resume_command(args: &TrainArgs, run_dir: &Path, world: usize) -> String {
    let config = run_dir.join(ember_train::checkpoint::CONFIG_FILE);
    let program = std::env::args_os().next().map_or("ember".into(), |p| p.to_string_lossy().into_owned());
    let mut words = if world > 1 { vec!["mpirun".to_string(), "-n".into(), world.to_string()] } else { vec![] };
    words.extend([
        shell_word(&program),
        "train".into(),
        "--config".into(),
        shell_word(&config.to_string_lossy()),
        "--run-dir".into(),
        shell_word(&run_dir.to_string_lossy()),
        "--resume".into(),
    ]);
    if args.device.text != "cpu" {
        words.extend(["--device".into(), shell_word(&args.device.text)]);
    }
    if let Some(p) = args.peak_tflops {
        words.extend(["--peak-tflops".into(), p.to_string()]);
    }
    words.join(" ")
}

/// `word` as one word of a POSIX shell command line: as it is when it is made of safe characters,
/// in single quotes otherwise.
fn shell_word(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./:=+,@%".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The device of this rank. A bare `cuda` in a data-parallel run means each rank's own GPU of the
/// machine: cuda:<local rank>. An explicit index is kept (for launchers that give each rank one GPU).
fn device(arg: &DeviceArg, collective: &dyn Collective) -> DeviceSpec {
    match arg {
        DeviceArg { spec: DeviceSpec::Cuda(_), indexed: false, .. } if collective.world() > 1 => {
            DeviceSpec::Cuda(collective.local_rank())
        }
        DeviceArg { spec, .. } => *spec,
    }
}

fn options(args: &TrainArgs, device: DeviceSpec, collective: Arc<dyn Collective>) -> anyhow::Result<TrainOptions> {
    let run_dir = args.run_dir.clone().unwrap_or_else(|| {
        let stem = args.config.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or("run".into());
        PathBuf::from("runs").join(stem)
    });
    Ok(TrainOptions {
        run_dir,
        resume: args.resume,
        accept_data_change: args.accept_data_change,
        stop_at: args.max_steps,
        show_progress: !args.no_progress && std::io::stderr().is_terminal(),
        locations: crate::env::locations(),
        eval_dir: crate::env::eval_dir(),
        device_name: crate::backend::gpu_name(device),
        peak_tflops: args.peak_tflops,
        memory: Some(crate::backend::memory_probe(device)),
        memory_available: crate::backend::memory_available(device),
        device_comm: device_comm(device, collective.as_ref())?,
        collective,
        compute: crate::env::compute_request(),
        stop_requested: Some(crate::signals::stop_requested),
    })
}

/// The dashboard over the run directory's parent. It is a convenience: if it cannot start, training
/// goes on without it (and what it is sent once running cannot reach the training loop; see
/// ember_dashboard::server).
fn dashboard(run_dir: &Path, port: u16) -> Option<ember_dashboard::Dashboard> {
    let logdir = run_dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let run = run_dir.file_name().map_or_else(|| run_dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    std::fs::create_dir_all(logdir)
        .with_context(|| format!("creating {}", logdir.display()))
        .and_then(|()| {
            crate::commands::dashboard::start(logdir, std::net::Ipv4Addr::LOCALHOST.into(), port, &[], Some(&run))
        })
        .inspect_err(|e| tracing::warn!("no dashboard: {e:#}; training goes on without it"))
        .ok()
}

/// NCCL for the gradients of a data-parallel CUDA run (`--features nccl`): rank 0's id is sent to
/// the others over MPI. `EMBER_NCCL=1` makes one in a single process too (to check the path on one
/// GPU); `EMBER_NCCL=0` keeps the reduction on the host.
#[cfg(feature = "nccl")]
fn device_comm(device: DeviceSpec, c: &dyn Collective) -> anyhow::Result<Option<ember_kernels::DeviceComm>> {
    let wanted = crate::env::nccl().unwrap_or(c.world() > 1);
    let DeviceSpec::Cuda(ordinal) = device else { return Ok(None) };
    // Every rank must take the same way, or some would wait in NCCL and the others in MPI.
    ember_train::distributed::check_same(c, &[u8::from(wanted)], "EMBER_NCCL (NCCL or the host for the gradients)")?;
    if !wanted {
        return Ok(None);
    }
    let id = if c.rank() == 0 {
        ember_kernels::collective::nccl::unique_id().map_err(|e| anyhow::anyhow!(e))?
    } else {
        vec![0u8; 128]
    };
    let all = c.all_gather_bytes(&id, "start-up: NCCL id")?;
    let comm = ember_kernels::collective::nccl::communicator(ordinal, c.rank(), c.world(), &all[0])
        .map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!("gradients summed on the device by NCCL ({} rank(s))", c.world());
    Ok(Some(comm))
}

#[cfg(not(feature = "nccl"))]
fn device_comm(_: DeviceSpec, _: &dyn Collective) -> anyhow::Result<Option<ember_kernels::DeviceComm>> {
    Ok(None)
}
