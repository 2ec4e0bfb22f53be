//! `ember`: train, sample and prepare data for Llama-style decoders on Burn.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod alloc;
mod backend;
mod commands;

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

#[derive(Parser, Debug)]
#[command(name = "ember", version, about = "Train and sample Llama-style decoder-only transformers on Burn")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log level filter (also read from RUST_LOG), e.g. `debug` or `ember_train=debug`.
    #[arg(long, global = true, default_value = "info")]
    log: String,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a model from a TOML config.
    Train(commands::train::TrainArgs),
    /// Generate text from a checkpoint.
    Sample(commands::sample::SampleArgs),
    /// Evaluate a checkpoint: `--perplexity` on a text file or a split.
    Eval(commands::eval::EvalArgs),
    /// Read a Hugging Face model folder into a run directory.
    Import(commands::hf::ImportArgs),
    /// Write a run as a Hugging Face model folder.
    Export(commands::hf::ExportArgs),
    /// Tokenize a text file into train/val token shards.
    Prepare(commands::prepare::PrepareArgs),
    /// Serve a checkpoint over the OpenAI API (completions, chat completions, streaming) with a chat page.
    Serve(commands::serve::ServeArgs),
    /// Chat with a checkpoint in the terminal (its chat template, streamed, multi-turn).
    Chat(commands::serve::ChatArgs),
    /// Serve a web page of the runs under a log directory.
    Dashboard(commands::dashboard::DashboardArgs),
    /// Benchmarks (speed and memory).
    Bench(commands::bench::BenchArgs),
    /// Numerical checks of a backend: causality, cached decoding, the tiled loss, training steps.
    Check(commands::check::CheckArgs),
    /// Print the backends this binary was built with.
    Backends,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Train(_) | Command::Bench(_)) {
        // Steps allocate the same buffers again and again; a long-lived server keeps mimalloc's
        // default of handing memory back after a spike.
        alloc::keep_freed_memory();
    }
    // The ranks of a data-parallel run (`mpirun -n N ember train`): MPI starts before anything else.
    let collective = match cli.command {
        Command::Train(_) | Command::Bench(_) => match ember_train::distributed::init() {
            Ok(c) => c,
            Err(err) => {
                eprintln!("error: {err}");
                return ExitCode::FAILURE;
            }
        },
        _ => ember_train::distributed::solo(),
    };
    // A rank that panics stops the job at once: the others would otherwise wait in their next
    // collective until the deadline and blame it on a hang.
    // (A weak reference: the hook must not keep MPI alive past `main`, where it is finalised.)
    if collective.world() > 1 {
        let weak = std::sync::Arc::downgrade(&collective);
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            report(info);
            if let Some(c) = weak.upgrade() {
                eprintln!("error: rank {} panicked; stopping every rank", c.rank());
                c.abort(101);
            }
        }));
    }
    // Rank 0 speaks for the run; the others only warn (RUST_LOG still rules).
    let level = if collective.rank() == 0 { cli.log.clone() } else { "warn".into() };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    // Ranks on one machine share its cores.
    let local = collective.local_world();
    if local > 1 && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        ember_model::ops::init_cpu_workers(Some((cores / local).max(1)));
    }
    // Compute on a worker of the CPU kernels' thread pool (see `on_cpu_workers`); the dashboard only
    // serves files and needs no worker.
    let result = match cli.command {
        // The dashboard only serves files; the model server runs its engine on a thread of its own
        // (which enters the pool itself): neither may hold a worker of the pool while it waits.
        Command::Dashboard(_) | Command::Serve(_) => run(cli, collective.clone()),
        Command::Bench(ref b) if b.serves() => run(cli, collective.clone()),
        _ => ember_model::ops::on_cpu_workers(|| run(cli, collective.clone())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if collective.world() > 1 {
                // The other ranks would wait for this one until their timeout: stop them now.
                eprintln!("error: rank {} stops the run", collective.rank());
                collective.abort(1);
            }
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, collective: std::sync::Arc<dyn ember_train::distributed::Collective>) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => commands::train::run(args, collective),
        Command::Bench(args) => commands::bench::run(args, collective),
        Command::Sample(args) => commands::sample::run(args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Import(args) => commands::hf::import(args),
        Command::Export(args) => commands::hf::export(args),
        Command::Prepare(args) => commands::prepare::run(args),
        Command::Dashboard(args) => commands::dashboard::run(args),
        Command::Serve(args) => commands::serve::serve(args),
        Command::Chat(args) => commands::serve::chat(args),
        Command::Check(args) => commands::check::run(args),
        Command::Backends => {
            println!("{}", backend::compiled().join(", "));
            Ok(())
        }
    }
}
