use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_data::finetune::{ChatTemplate, Message};
use ember_data::stream::TextStream;
use ember_generate::sample::{check_prompts, generate, generate_batch, GenerateOptions, Sampler, SamplingConfig};
use ember_kernels::TrainBackend;
use ember_serve::sampling::ChatDefaults;

use crate::backend::{dispatch, DeviceSpec, Job};
use crate::commands::chat::SamplingFlags;
use crate::commands::source::ModelSource;

#[derive(Args, Debug)]
#[command(after_help = super::chat::SAMPLING_HELP)]
pub struct SampleArgs {
    /// A run directory (its latest checkpoint) or a checkpoint folder inside it, or `gguf:FILE` (run on its stored
    /// quantized weights) or `hf:DIR`.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Treat each prompt as a user message: render it with the checkpoint's chat template (with the
    /// assistant's turn opened) and stop at the model's end-of-turn token.
    #[arg(long)]
    chat: bool,
    /// Text to continue; repeat for a batch of prompts generated together.
    #[arg(long, default_values_t = vec!["\n".to_string()])]
    prompt: Vec<String>,
    /// New tokens per prompt, at most 1,048,576; past the model's context, the context slides.
    #[arg(long, default_value_t = 500)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy [default: 0.8; with --chat, the chat defaults below].
    // Negative numbers parse as values, so that `--temperature -1` is refused by the range check,
    // naming the flag, rather than read as an unknown flag.
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens; 0 keeps all [default: 200; with --chat, the chat
    /// defaults].
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens holding this much probability, in (0, 1] (1 keeps all)
    /// [default: all; with --chat, the chat defaults].
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Penalise tokens already in the sequence (1 is off; 1.1 to 1.3 are common) [default: 1; with
    /// --chat, the chat defaults].
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f32>,
    /// Stop a sequence when its text contains this (non-empty) string (repeatable); the string is not
    /// printed.
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Recompute the whole context for every token instead of using the KV cache (one prompt only).
    #[arg(long)]
    no_cache: bool,
    /// Positions per KV-cache block, from 1 to the model's max_seq_len.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// cpu, wgpu[:N] or cuda[:N].
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
}

/// Most new tokens a sequence may ask for. A sequence that fills the model's context goes on from
/// the end of it (see `generate_batch`), so the model itself sets no limit, and the README's default
/// job asks for 500 tokens of a 64-position model; this bound only turns a mistyped count, which
/// would run for days while its history grows, into an error.
const MAX_NEW_TOKENS: usize = 1 << 20;

impl SampleArgs {
    fn sampling_flags(&self) -> SamplingFlags {
        SamplingFlags {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            repetition_penalty: self.repetition_penalty,
        }
    }

    /// Checks the flags that need no checkpoint, before one is opened: the sampling flags over the
    /// continuation defaults (nanoGPT's temperature 0.8 and top-k 200).
    fn sampling_config(&self) -> anyhow::Result<SamplingConfig> {
        if self.stop.iter().any(String::is_empty) {
            anyhow::bail!(
                "--stop '': an empty stop string is found before the first token and would end every \
                 sequence at once; give a non-empty string"
            );
        }
        anyhow::ensure!(
            self.max_new_tokens <= MAX_NEW_TOKENS,
            "--max-new-tokens {} is more than the limit of {MAX_NEW_TOKENS} new tokens per sequence",
            self.max_new_tokens
        );
        self.sampling_flags().over(&SamplingConfig::default())
    }
}

/// The decoding error that ended sequence `index`, if one did.
fn check(stream: &mut TextStream, index: usize) -> anyhow::Result<()> {
    match stream.take_error() {
        Some(e) => Err(anyhow::Error::from(e).context(format!("decoding the text of prompt {index}"))),
        None => Ok(()),
    }
}

/// What `ember sample` runs, every flag checked against the checkpoint before the model is loaded.
struct SampleJob {
    args: SampleArgs,
    checkpoint: ModelSource,
    config: SamplingConfig,
    prompts: Vec<Vec<u32>>,
    /// End-of-text and end-of-turn ids.
    ends: Vec<u32>,
}

impl Job for SampleJob {
    type Output = ();
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<()> {
        let Self { args, checkpoint, config, prompts, ends } = self;
        let tokenizer = &checkpoint.tokenizer;
        let mut samplers = (0..prompts.len())
            .map(|i| Sampler::new(config.clone(), args.seed.wrapping_add(i as u64)))
            .collect::<Result<Vec<_>, _>>()?;
        let model = checkpoint.decoder::<B::InnerBackend>(&device)?.with_compute(crate::env::compute());
        let mut streams: Vec<TextStream> =
            prompts.iter().map(|p| TextStream::new(tokenizer, p, args.stop.clone(), &ends)).collect();
        let mut out = std::io::stdout().lock();

        if prompts.len() == 1 {
            // One prompt: stream tokens as they come.
            // A chat answer starts on its own line; a continuation right after its prompt.
            let sep = if args.chat { "\n" } else { "" };
            write!(out, "{}{sep}", args.prompt[0])?;
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
                let options = options(&args, &ends);
                generate_batch(&model, &prompts, &options, &mut samplers, |_, id| on_token(id))?;
            }
            if let Some(e) = write_err {
                return Err(e.into());
            }
            writeln!(out, "{}", streams[0].finish())?;
            return check(&mut streams[0], 0);
        }
        let mut texts = vec![String::new(); prompts.len()];
        generate_batch(&model, &prompts, &options(&args, &ends), &mut samplers, |b, id| {
            let (text, stopped) = streams[b].push(id);
            texts[b].push_str(&text);
            !stopped
        })?;
        // As for one prompt: a chat answer starts on the line after its prompt.
        let sep = if args.chat { "\n" } else { "" };
        for (i, (prompt, stream)) in args.prompt.iter().zip(&mut streams).enumerate() {
            texts[i].push_str(&stream.finish());
            writeln!(out, "=== {i} ===\n{prompt}{sep}{}", texts[i])?;
        }
        for (i, stream) in streams.iter_mut().enumerate() {
            check(stream, i)?;
        }
        Ok(())
    }
}

fn options(args: &SampleArgs, ends: &[u32]) -> GenerateOptions {
    GenerateOptions { max_new_tokens: args.max_new_tokens, stop_tokens: ends.to_vec(), block_size: args.block_size }
}

pub fn run(args: SampleArgs) -> anyhow::Result<()> {
    let mut config = args.sampling_config()?;
    anyhow::ensure!(
        args.prompt.len() == 1 || !args.no_cache,
        "--no-cache generates one prompt at a time; give a single --prompt"
    );
    // The error names the folder.
    let checkpoint = ModelSource::open(&args.checkpoint)?;
    let context = checkpoint.model_config.max_seq_len;
    anyhow::ensure!(
        (1..=context).contains(&args.block_size),
        "--block-size {} must be in 1..={context} (the model's max_seq_len)",
        args.block_size
    );
    let tokenizer = &checkpoint.tokenizer;
    let template = if args.chat {
        let template = ChatTemplate::from_dir(&checkpoint.dir)?;
        Some(template.with_context(|| {
            format!(
                "--chat: {} has no chat template (tokenizer_config.json or chat_template.jinja)",
                checkpoint.dir.display()
            )
        })?)
    } else {
        None
    };
    if args.chat {
        // A chat samples as `ember chat` and `ember serve` do (the model's generation_config.json
        // or ember's chat defaults), with the flags given over them.
        let defaults = ChatDefaults::for_checkpoint(&checkpoint.dir)?;
        let flags = args.sampling_flags();
        config = flags.over(&defaults.sampling)?;
        tracing::info!("sampling: {}", flags.describe(&config, &defaults));
    }
    let prompts = args
        .prompt
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let text = match &template {
                Some(t) => t.render(&[Message { role: "user".into(), content: p.clone() }], true)?,
                None => p.clone(),
            };
            tokenizer.encode_prompt(&text).with_context(|| format!("encoding prompt {i}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ends = checkpoint.tokenizer.end_ids();
    // Without the cache a long prompt is cropped to the context; with it, it must fit.
    let limit = if args.no_cache { usize::MAX } else { context };
    check_prompts(&prompts, limit, checkpoint.model_config.vocab_size)?;
    let device = args.device;
    dispatch(device, false, SampleJob { args, checkpoint, config, prompts, ends })
}

#[cfg(test)]
mod tests {
    use clap::Args;

    use super::*;

    /// The `--help` line of `flag`.
    fn help(flag: &str) -> String {
        let command = SampleArgs::augment_args(clap::Command::new("sample"));
        let arg = command.get_arguments().find(|a| a.get_long() == Some(flag)).expect("the flag exists");
        arg.get_help().map(ToString::to_string).unwrap_or_default()
    }

    #[test]
    fn the_help_states_the_continuation_defaults_in_use() {
        let d = SamplingConfig::default();
        assert!(help("temperature").contains(&format!("[default: {};", d.temperature)), "{}", help("temperature"));
        assert!(help("top-k").contains(&format!("[default: {};", d.top_k.unwrap_or(0))), "{}", help("top-k"));
        assert_eq!((d.top_p, d.repetition_penalty), (None, 1.0), "{}, {}", help("top-p"), help("repetition-penalty"));
    }
}
