use std::path::PathBuf;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_data::fetch::Locations;
use ember_model::ops::TrainBackend;
use ember_train::perplexity::{perplexity, Perplexity};
use ember_train::Checkpoint;

use crate::backend::{dispatch, DeviceSpec, Job};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Measure perplexity (the only evaluation so far; the flag keeps room for others).
    #[arg(long, required = true)]
    perplexity: bool,
    /// A run directory (its latest checkpoint) or a checkpoint folder.
    #[arg(long)]
    checkpoint: PathBuf,
    /// A text file, or `train` / `val` for the splits of the checkpoint's own training data.
    #[arg(long)]
    data: String,
    /// Tokens of context per window [default: the model's max_seq_len].
    #[arg(long)]
    context: Option<usize>,
    /// Tokens between window starts [default: half the context].
    #[arg(long)]
    stride: Option<usize>,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Print one JSON object: nll, perplexity, bits_per_byte, tokens.
    #[arg(long)]
    json: bool,
}

struct EvalJob {
    checkpoint: Checkpoint,
    tokens: Vec<u32>,
    bytes: usize,
    context: usize,
    stride: usize,
    batch: usize,
}

impl Job for EvalJob {
    type Output = Perplexity;
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<Perplexity> {
        let model = self.checkpoint.decoder::<B::InnerBackend>(&device)?;
        Ok(perplexity(&model, &self.tokens, self.context, self.stride, self.batch, self.bytes))
    }
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let checkpoint = Checkpoint::open(&args.checkpoint)
        .with_context(|| format!("opening checkpoint {}", args.checkpoint.display()))?;
    let max = checkpoint.model_config.max_seq_len;
    let context = args.context.unwrap_or(max);
    anyhow::ensure!(
        context >= 1 && context <= max,
        "--context {context} must be in 1..={max} (the model's max_seq_len)"
    );
    let stride = args.stride.unwrap_or((context / 2).max(1));
    anyhow::ensure!(stride >= 1 && stride <= context, "--stride {stride} must be in 1..={context} (the context)");
    let tokenizer = &checkpoint.tokenizer;
    let tokens = match args.data.as_str() {
        split @ ("train" | "val") => {
            let config = checkpoint.train_config()?;
            ember_train::data::split_tokens(config, &Locations::from_env(), split)
                .with_context(|| format!("loading the {split} split of the checkpoint's data"))?
        }
        path => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            tokenizer.encode(&text).with_context(|| format!("tokenizing {path}"))?
        }
    };
    anyhow::ensure!(tokens.len() >= 2, "{}: {} tokens, at least 2 are needed to score one", args.data, tokens.len());
    let bytes = tokenizer.decode(&tokens[1..])?.len();
    let checkpointing = false;
    let r = dispatch(
        args.device,
        checkpointing,
        EvalJob { checkpoint, tokens, bytes, context, stride, batch: args.batch },
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{}: nll {:.4} nats/token, perplexity {:.3}, {:.4} bits/byte over {} tokens ({} bytes; context {}, stride {})",
            args.data, r.nll, r.perplexity, r.bits_per_byte, r.tokens, r.bytes, r.context, r.stride
        );
    }
    Ok(())
}
