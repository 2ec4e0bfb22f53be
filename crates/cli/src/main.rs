//! `ember`: train, fine-tune, evaluate and serve decoder-only transformers on Burn.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod alloc;
mod backend;
mod commands;
mod env;
mod needs;
mod signals;

use needs::Needs;

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

#[derive(Parser, Debug)]
#[command(
    name = "ember",
    version,
    about = "Train, fine-tune and serve decoder-only transformers (Llama, Qwen, Gemma, GPT-2, Mixtral, DeepSeek \
             families) on Burn"
)]
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
    /// Evaluate a checkpoint: benchmark `--tasks` (HellaSwag, ARC, MMLU, …) or `--perplexity` on a
    /// text file or a split.
    Eval(commands::eval::EvalArgs),
    /// Read a model into a run directory: a Hugging Face folder or a GGUF file.
    Import(commands::hf::ImportArgs),
    /// Write a run as a Hugging Face model folder or a GGUF file.
    Export(commands::hf::ExportArgs),
    /// Tokenize a text file into train/val token shards.
    Prepare(commands::prepare::PrepareArgs),
    /// Serve a checkpoint over the OpenAI API (completions, chat completions, streaming) with a chat page.
    Serve(commands::serve::ServeArgs),
    /// Chat with a checkpoint in the terminal (its chat template, streamed, multi-turn).
    Chat(commands::chat::ChatArgs),
    /// Serve a web page of the runs under a log directory.
    Dashboard(commands::dashboard::DashboardArgs),
    /// Benchmarks (speed and memory).
    Bench(commands::bench::BenchArgs),
    /// Numerical checks of a backend: causality, cached decoding, the tiled loss, training steps.
    Check(commands::check::CheckArgs),
    /// Print the backends this binary was built with.
    Backends,
    /// Write a commented config to start from: pretrain, lora, full (fine-tuning), dpo (preference
    /// tuning) or grpo (reinforcement learning).
    Init(commands::init::InitArgs),
}

impl Command {
    /// What the command needs from the process (see [`Needs`]).
    fn needs(&self) -> Needs {
        match self {
            Command::Train(_) => Needs::TRAINING,
            // The model server's bench runs the server, whose engine enters the pool itself.
            Command::Bench(b) => Needs { cpu_worker: !b.serves(), ..Needs::TRAINING },
            Command::Dashboard(_) | Command::Serve(_) => Needs::SERVER,
            // Writes a file: nothing to compute.
            Command::Init(_) => Needs::SERVER,
            Command::Sample(_)
            | Command::Eval(_)
            | Command::Import(_)
            | Command::Export(_)
            | Command::Prepare(_)
            | Command::Chat(_)
            | Command::Check(_)
            | Command::Backends => Needs::COMPUTE,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let needs = cli.command.needs();
    let collective = match needs.set_up(&cli.log) {
        Ok(c) => c,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::FAILURE;
        }
    };
    match needs.run(|| run(cli, collective.clone())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // Already reported (`ember train` stopped by Ctrl-C, its checkpoint written).
            if let Some(stopped) = err.downcast_ref::<commands::train::Stopped>() {
                return ExitCode::from(stopped.status);
            }
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
        Command::Chat(args) => commands::chat::run(args),
        Command::Check(args) => commands::check::run(args),
        Command::Init(args) => commands::init::run(args),
        Command::Backends => {
            println!("{}", backend::compiled().join(", "));
            Ok(())
        }
    }
}
