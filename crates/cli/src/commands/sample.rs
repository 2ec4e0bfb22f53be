use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_data::Tokenizer;
use ember_model::ops::TrainBackend;
use ember_model::sample::{generate, generate_batch, GenerateOptions, Sampler, SamplingConfig};
use ember_train::Checkpoint;

use crate::backend::{dispatch, DeviceSpec, Job};

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A run directory (its latest checkpoint) or a checkpoint folder inside it.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue; repeat for a batch of prompts generated together.
    #[arg(long, default_values_t = vec!["\n".to_string()])]
    prompt: Vec<String>,
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
    /// Penalise tokens already in the sequence (1 is off; 1.1 to 1.3 are common).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Stop a sequence when its text contains this string (repeatable); the string is not printed.
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Recompute the whole context for every token instead of using the KV cache (one prompt only).
    #[arg(long)]
    no_cache: bool,
    /// Positions per KV-cache block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
}

/// The text of one sequence as it grows, holding back what could still turn out to be the start of a
/// stop string.
struct Stream<'a> {
    tokenizer: &'a Tokenizer,
    stops: &'a [String],
    ids: Vec<u32>,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    stopped: bool,
}

impl<'a> Stream<'a> {
    fn new(tokenizer: &'a Tokenizer, stops: &'a [String]) -> Self {
        Self { tokenizer, stops, ids: Vec::new(), text: String::new(), emitted: 0, stopped: false }
    }

    /// Adds a token; returns the text that is now final, and whether a stop string ended the sequence.
    fn push(&mut self, id: u32) -> (String, bool) {
        if self.tokenizer.eos_id() == Some(id) {
            return (String::new(), true);
        }
        self.ids.push(id);
        let Ok(text) = self.tokenizer.decode(&self.ids) else { return (String::new(), false) };
        if text.ends_with('\u{fffd}') {
            return (String::new(), false); // a multi-byte character still incomplete
        }
        self.text = text;
        if let Some(cut) = self.stops.iter().filter_map(|s| self.text.find(s.as_str())).min() {
            self.text.truncate(cut);
            self.stopped = true;
        }
        let hold =
            if self.stopped { 0 } else { self.stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0) };
        let mut end = self.text.len().saturating_sub(hold).max(self.emitted);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        (out, self.stopped)
    }

    /// The rest, once the sequence is over.
    fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
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
        let prompts = args
            .prompt
            .iter()
            .enumerate()
            .map(|(i, p)| tokenizer.encode(p).with_context(|| format!("encoding prompt {i}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let config = SamplingConfig {
            temperature: args.temperature,
            top_k: (args.top_k > 0).then_some(args.top_k),
            top_p: args.top_p,
            repetition_penalty: args.repetition_penalty,
        };
        let mut samplers = (0..prompts.len())
            .map(|i| Sampler::new(config.clone(), args.seed.wrapping_add(i as u64)))
            .collect::<Result<Vec<_>, _>>()?;
        let model = checkpoint.decoder::<B::InnerBackend>(&device)?;
        let mut streams: Vec<Stream> = prompts.iter().map(|_| Stream::new(tokenizer, &args.stop)).collect();
        let mut out = std::io::stdout().lock();

        if prompts.len() == 1 {
            // One prompt: stream tokens as they come.
            write!(out, "{}", args.prompt[0])?;
            let mut write_err = None;
            let mut on_token = |id: u32| {
                let (text, stopped) = streams[0].push(id);
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false;
                }
                !stopped
            };
            if args.no_cache {
                generate(&model, &prompts[0], args.max_new_tokens, &mut samplers[0], on_token)?;
            } else {
                let options = options(&args, tokenizer);
                generate_batch(&model, &prompts, &options, &mut samplers, |_, id| on_token(id))?;
            }
            if let Some(e) = write_err {
                return Err(e.into());
            }
            writeln!(out, "{}", streams[0].finish())?;
            return Ok(());
        }
        anyhow::ensure!(!args.no_cache, "--no-cache generates one prompt at a time; give a single --prompt");
        generate_batch(&model, &prompts, &options(&args, tokenizer), &mut samplers, |b, id| !streams[b].push(id).1)?;
        for (i, (prompt, stream)) in args.prompt.iter().zip(&mut streams).enumerate() {
            stream.finish();
            writeln!(out, "=== {i} ===\n{prompt}{}", stream.text)?;
        }
        Ok(())
    }
}

fn options(args: &SampleArgs, tokenizer: &Tokenizer) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        stop_tokens: tokenizer.eos_id().into_iter().collect(),
        block_size: args.block_size.max(1),
    }
}

pub fn run(args: SampleArgs) -> anyhow::Result<()> {
    // The error names the folder.
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    let device = args.device;
    dispatch(device, false, SampleJob { args, checkpoint })
}
