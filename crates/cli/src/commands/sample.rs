use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use burn::tensor::Device;
use clap::Args;
use ember_data::finetune::{ChatTemplate, Message};
use ember_data::stream::TextStream;
use ember_generate::constraint::{Constraint, ConstraintError};
use ember_generate::sample::{
    check_prompts, generate, generate_batch_constrained, GenerateOptions, Sampler, SamplingConfig,
};
use ember_grammar::{Grammars, Spec};
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
    #[command(flatten)]
    kv_cache: super::KvCacheFlag,
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
    /// Hold every answer to the JSON schema in FILE (compact JSON, keys in the schema's order; a
    /// keyword the grammar engine cannot enforce is an error). Logs what the mask costs a token.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
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
    /// `--json-schema`: the grammar every sequence is held to.
    schema: Option<JsonSchema>,
}

impl Job for SampleJob {
    type Output = ();
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<()> {
        let Self { args, checkpoint, config, prompts, ends, schema } = self;
        let tokenizer = &checkpoint.tokenizer;
        let mut samplers = (0..prompts.len())
            .map(|i| Sampler::new(config.clone(), args.seed.wrapping_add(i as u64)))
            .collect::<Result<Vec<_>, _>>()?;
        let compute = args.kv_cache.apply(crate::env::compute());
        let model = checkpoint.decoder::<B::InnerBackend>(&device)?.with_compute(compute);
        let mut streams: Vec<TextStream> =
            prompts.iter().map(|p| TextStream::new(tokenizer, p, args.stop.clone(), &ends)).collect();
        let mut out = std::io::stdout().lock();
        let timing = MaskTiming { on: schema.is_some(), ..MaskTiming::default() };
        let mut constraints: Vec<Option<Box<dyn Constraint>>> = match &schema {
            Some(s) => {
                (0..prompts.len()).map(|_| Ok(Some(timing.timed(s.constraint()?)))).collect::<anyhow::Result<_>>()?
            }
            None => (0..prompts.len()).map(|_| None).collect(),
        };

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
                let on_token = |_, id| timing.token() && on_token(id);
                generate_batch_constrained(&model, &prompts, &options, &mut samplers, &mut constraints, on_token)?;
            }
            if let Some(e) = write_err {
                return Err(e.into());
            }
            writeln!(out, "{}", streams[0].finish())?;
            timing.report(schema.as_ref());
            return check(&mut streams[0], 0);
        }
        let mut texts = vec![String::new(); prompts.len()];
        let options = options(&args, &ends);
        generate_batch_constrained(&model, &prompts, &options, &mut samplers, &mut constraints, |b, id| {
            let (text, stopped) = streams[b].push(id);
            texts[b].push_str(&text);
            timing.token() && !stopped
        })?;
        timing.report(schema.as_ref());
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
    anyhow::ensure!(
        args.json_schema.is_none() || !args.no_cache,
        "--json-schema draws through the KV cache; leave out --no-cache"
    );
    // The file is read (and its errors named) before a checkpoint is opened.
    let schema_file = args.json_schema.as_deref().map(read_schema).transpose()?;
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
                Some(t) => t.render(&[Message::new("user", p.clone())], true)?,
                None => p.clone(),
            };
            tokenizer.encode_prompt(&text).with_context(|| format!("encoding prompt {i}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ends = checkpoint.tokenizer.end_ids();
    // Without the cache a long prompt is cropped to the context; with it, it must fit.
    let limit = if args.no_cache { usize::MAX } else { context };
    check_prompts(&prompts, limit, checkpoint.model_config.vocab_size)?;
    let schema = match (schema_file, &args.json_schema) {
        (Some(schema), Some(file)) => Some(JsonSchema::new(file, schema, &checkpoint)?),
        _ => None,
    };
    let device = args.device;
    dispatch(device, false, SampleJob { args, checkpoint, config, prompts, ends, schema })
}

/// `--json-schema FILE` read as JSON; errors name the file.
pub(crate) fn read_schema(file: &Path) -> anyhow::Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("--json-schema {}: cannot read it", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("--json-schema {}: not JSON", file.display()))
}

/// A `--json-schema` compiled for a checkpoint's vocabulary: makes each sequence's constraint.
pub(crate) struct JsonSchema {
    file: PathBuf,
    grammars: Grammars,
    spec: Spec,
}

impl JsonSchema {
    /// `schema` (from `file`) compiled for `checkpoint`; a schema the grammar engine refuses is an
    /// error naming the file and the problem. Strict: a keyword it cannot enforce is refused.
    pub(crate) fn new(file: &Path, schema: serde_json::Value, checkpoint: &ModelSource) -> anyhow::Result<Self> {
        let tokenizer = &checkpoint.tokenizer;
        let grammars = Grammars::new(tokenizer, &tokenizer.end_ids(), checkpoint.model_config.vocab_size)
            .with_context(|| format!("--json-schema {}", file.display()))?;
        let spec = Spec::JsonSchema { schema, strict: true };
        grammars.check(&spec).with_context(|| format!("--json-schema {}", file.display()))?;
        Ok(Self { file: file.to_path_buf(), grammars, spec })
    }

    /// One sequence's constraint.
    pub(crate) fn constraint(&self) -> anyhow::Result<Box<dyn Constraint>> {
        self.grammars.constraint(&self.spec).with_context(|| format!("--json-schema {}", self.file.display()))
    }
}

/// What holding sequences to a schema costs: the time in the constraints' masks and commits, and
/// the times the tokens came (the steps they took, masks included). Off (nothing noted) without a
/// schema.
#[derive(Default)]
struct MaskTiming {
    on: bool,
    spent: Arc<Mutex<Duration>>,
    /// (when, mask time so far) at each token.
    tokens: Mutex<Vec<(Instant, Duration)>>,
}

impl MaskTiming {
    /// `inner`, its mask and commit times added here.
    fn timed(&self, inner: Box<dyn Constraint>) -> Box<dyn Constraint> {
        Box::new(Timed { inner, spent: self.spent.clone() })
    }

    /// Notes a token's arrival; true (to chain into an `on_token`).
    fn token(&self) -> bool {
        if !self.on {
            return true;
        }
        let spent = *self.spent.lock().expect("timing lock");
        self.tokens.lock().expect("timing lock").push((Instant::now(), spent));
        true
    }

    /// Logs the mask's milliseconds a token beside the step's, from the second token on (the first
    /// comes after the prefill). Nothing without a schema or with fewer than two tokens.
    fn report(&self, schema: Option<&JsonSchema>) {
        let (Some(schema), tokens) = (schema, self.tokens.lock().expect("timing lock")) else { return };
        let (Some(first), Some(last)) = (tokens.first(), tokens.last()) else { return };
        let steps = tokens.len() - 1;
        if steps == 0 {
            return;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
        let mask = ms(last.1 - first.1);
        let decode = ms(last.0 - first.0) - mask;
        tracing::info!(
            "--json-schema {}: mask and commit {mask:.3} ms/token, decode step {decode:.3} ms/token: the mask adds \
             {:.1}% ({steps} steps)",
            schema.file.display(),
            100.0 * mask / decode.max(f64::MIN_POSITIVE)
        );
    }
}

/// A constraint whose mask and commit times are added up.
struct Timed {
    inner: Box<dyn Constraint>,
    spent: Arc<Mutex<Duration>>,
}

impl Constraint for Timed {
    fn mask(&mut self) -> Result<&[u32], ConstraintError> {
        let start = Instant::now();
        let mask = self.inner.mask();
        *self.spent.lock().expect("timing lock") += start.elapsed();
        mask
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        let start = Instant::now();
        let done = self.inner.commit(token);
        *self.spent.lock().expect("timing lock") += start.elapsed();
        done
    }

    fn finished(&self) -> bool {
        self.inner.finished()
    }
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
