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
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    // Compute on a worker of the CPU kernels' thread pool (see `on_cpu_workers`); the dashboard only
    // serves files and needs no worker.
    let result = match cli.command {
        Command::Dashboard(_) => run(cli),
        _ => ember_model::ops::on_cpu_workers(|| run(cli)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => commands::train::run(args),
        Command::Sample(args) => commands::sample::run(args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Import(args) => commands::hf::import(args),
        Command::Export(args) => commands::hf::export(args),
        Command::Prepare(args) => commands::prepare::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Dashboard(args) => commands::dashboard::run(args),
        Command::Check(args) => commands::check::run(args),
        Command::Backends => {
            println!("{}", backend::compiled().join(", "));
            Ok(())
        }
    }
}
