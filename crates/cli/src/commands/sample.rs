use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_model::ops::TrainBackend;
use ember_model::sample::{generate, Sampler, SamplingConfig};
use ember_train::Checkpoint;

use crate::backend::{dispatch, DeviceSpec, Job};

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A run directory (its latest checkpoint) or a checkpoint folder inside it.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    #[arg(long, default_value_t = 500)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the K most likely tokens; 0 keeps all.
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    /// Sample among the most likely tokens holding this much probability, in (0, 1].
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
}

struct SampleJob {
    args: SampleArgs,
    checkpoint: Checkpoint,
}

impl Job for SampleJob {
    type Output = ();
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<()> {
        let Self { args, checkpoint } = self;
        let tokenizer = &checkpoint.tokenizer;
        let prompt = tokenizer.encode(&args.prompt).context("encoding the prompt")?;
        let config = SamplingConfig {
            temperature: args.temperature,
            top_k: (args.top_k > 0).then_some(args.top_k),
            top_p: args.top_p,
        };
        let mut sampler = Sampler::new(config, args.seed)?;
        let model = checkpoint.decoder::<B::InnerBackend>(&device)?;
        let mut out = std::io::stdout().lock();
        write!(out, "{}", args.prompt)?;
        // Decode the whole continuation each time and print what is new, so that multi-token
        // characters (byte-level BPE) come out whole.
        let (mut ids, mut printed) = (Vec::new(), 0usize);
        let mut write_err = None;
        generate(&model, &prompt, args.max_new_tokens, &mut sampler, |id| {
            ids.push(id);
            if let Ok(text) = tokenizer.decode(&ids) {
                if text.len() > printed && text.is_char_boundary(printed) && !text.ends_with('\u{fffd}') {
                    if let Err(e) = out.write_all(text[printed..].as_bytes()).and_then(|_| out.flush()) {
                        write_err = Some(e);
                        return false;
                    }
                    printed = text.len();
                }
            }
            true
        })?;
        if let Some(e) = write_err {
            return Err(e.into());
        }
        writeln!(out)?;
        Ok(())
    }
}

pub fn run(args: SampleArgs) -> anyhow::Result<()> {
    let checkpoint = Checkpoint::open(&args.checkpoint)
        .with_context(|| format!("opening checkpoint {}", args.checkpoint.display()))?;
    let device = args.device;
    dispatch(device, false, SampleJob { args, checkpoint })
}
