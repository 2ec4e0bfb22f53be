use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::tensor::{DType, Device};
use clap::Args;
use ember_data::finetune::PackedExamples;
use ember_data::Tokenizer;
use ember_kernels::TrainBackend;
use ember_train::config::DataFormat;
use ember_train::config::InitSource;
use ember_train::perplexity::{completion_loss, perplexity, CompletionLoss, Perplexity};
use ember_train::{Checkpoint, ResolvedInit};

use crate::backend::{dispatch, DeviceSpec, Job};

mod examples;
mod tasks;

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Perplexity of a text, or completion loss of fine-tuning examples, with `--data` (the
    /// measure `--data` takes; the flag is optional).
    #[arg(long, conflicts_with = "tasks")]
    #[allow(dead_code)]
    perplexity: bool,
    /// A run directory (its latest checkpoint), a checkpoint folder, or a run's best/ folder; with
    /// `--tasks` also `gguf:FILE` or `hf:DIR`.
    #[arg(long)]
    checkpoint: String,
    /// A text file, a `.jsonl` file of fine-tuning examples (only completion tokens are scored), or
    /// `train` / `val` for the splits of the checkpoint's own training data.
    #[arg(long, required_unless_present = "tasks", conflicts_with = "tasks")]
    data: Option<String>,
    /// Benchmark tasks, comma-separated, each as lm-evaluation-harness defines it: hellaswag,
    /// arc_easy, arc_challenge, piqa, boolq, openbookqa, commonsense_qa, winogrande, mmlu,
    /// lambada_openai, gsm8k, gsm8k_cot, nq_open, blimp (all 67 paradigms) or blimp_<paradigm>; `NAME:N` scores its first N
    /// items.
    #[arg(long)]
    tasks: Option<String>,
    /// The folder of the evaluation sets, laid out as shared/evals [default: $EMBER_EVAL_DIR].
    #[arg(long)]
    eval_dir: Option<PathBuf>,
    /// Few-shot exemplars before each item [default: 0].
    #[arg(long)]
    num_fewshot: Option<usize>,
    /// Score only the first N items of each task.
    #[arg(long)]
    limit: Option<usize>,
    /// Seed of the few-shot draws (the harness's default is 1234).
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Wrap each prompt in the model's chat template (lm-evaluation-harness's
    /// `--apply_chat_template`): the task's description as a system turn, exemplars and question
    /// as one user turn, the assistant's turn opened; choices follow with no delimiter.
    #[arg(long, requires = "tasks")]
    chat: bool,
    /// Write a JSON line per item (requests, log-likelihoods, prediction, gold) to this file. With
    /// `--data FILE.jsonl`, a line per example: its scored token ids (`tokens`: the completion and
    /// the end-of-sequence token), the natural-log probability of each (`token_logprobs`) and
    /// their sum (`logprob`).
    #[arg(long)]
    samples: Option<PathBuf>,
    /// A JSON Schema file: the answers of the generation tasks (gsm8k, gsm8k_cot, nq_open) are
    /// generated under it (compact JSON, properties in the schema's order), ending where the JSON
    /// does (the tasks' stop strings do not apply); their filters and exact match then read that
    /// JSON text. Log-likelihood tasks score given texts and ignore it; a list without a
    /// generation task is refused. A keyword the grammar engine does not implement is an error.
    #[arg(long, value_name = "FILE", requires = "tasks")]
    json_schema: Option<PathBuf>,
    /// Tokens per forward call when scoring tasks or `--samples` (rows × padded length).
    #[arg(long, default_value_t = 4096)]
    batch_tokens: usize,
    /// Sequences generated together in generation tasks (GSM8K, NQ-Open).
    #[arg(long, default_value_t = 8)]
    generate_batch: usize,
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

/// What `ember eval` scores: a token stream (perplexity over sliding windows) or fine-tuning
/// examples (their completion tokens, each example alone).
enum Scored {
    Stream { tokens: Vec<u32>, bytes: usize, context: usize, stride: usize },
    Examples { rows: PackedExamples, examples: Option<usize>, context: usize },
}

struct EvalJob {
    checkpoint: Checkpoint,
    /// The checkpoint's `init_from` source, where reading the data opened it already.
    init: Option<ResolvedInit>,
    scored: Scored,
    batch: usize,
    /// `--samples` of a `.jsonl` file: the examples to score token by token.
    samples: Option<(Vec<examples::Sample>, usize)>,
}

enum Report {
    Perplexity(Perplexity),
    Completion(CompletionLoss),
}

impl Job for EvalJob {
    type Output = (Report, Option<(Vec<examples::Sample>, Vec<Vec<f64>>)>);
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<Self::Output> {
        let model = self.checkpoint.decoder_over::<B::InnerBackend>(self.init.as_ref(), &device)?;
        // A perplexity is the model's, from exact products (not 8-bit activations).
        let model = model.with_compute(crate::env::compute().with_int8_inputs(false).with_kv_cache(DType::F32));
        let samples = self.samples.map(|(samples, batch_tokens)| {
            let pairs: Vec<ember_eval::score::Pair> = samples.iter().map(|s| s.pair.clone()).collect();
            let budget = ember_eval::score::Budget::for_vocab(batch_tokens, model.config().vocab_size);
            let logprobs = ember_eval::score::token_logprobs(&model, &pairs, budget);
            (samples, logprobs)
        });
        let report = match self.scored {
            Scored::Stream { tokens, bytes, context, stride } => {
                Report::Perplexity(perplexity(&model, &tokens, context, stride, self.batch, bytes))
            }
            Scored::Examples { rows, examples, context } => {
                Report::Completion(completion_loss(&model, &rows, examples, context, self.batch))
            }
        };
        Ok((report, samples))
    }
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    if let Some(list) = &args.tasks {
        anyhow::ensure!(args.batch_tokens >= 1, "--batch-tokens must be at least 1");
        let options = ember_eval::Options {
            num_fewshot: args.num_fewshot,
            seed: args.seed,
            batch_tokens: args.batch_tokens,
            generate_batch: args.generate_batch,
            schema: None,
        };
        return tasks::run(tasks::TasksArgs {
            checkpoint: &args.checkpoint,
            tasks: list,
            eval_dir: args.eval_dir.as_deref(),
            limit: args.limit,
            options,
            samples: args.samples.as_ref(),
            json_schema: args.json_schema.as_deref(),
            json: args.json,
            chat: args.chat,
            device: args.device,
        });
    }
    for (flag, given) in [
        ("--num-fewshot", args.num_fewshot.is_some()),
        ("--limit", args.limit.is_some()),
        ("--eval-dir", args.eval_dir.is_some()),
        ("--chat", args.chat),
        ("--json-schema", args.json_schema.is_some()),
    ] {
        anyhow::ensure!(!given, "{flag} is a flag of `--tasks`; `--data` scores perplexity or completion loss");
    }
    let data = args.data.clone().unwrap_or_default();
    anyhow::ensure!(
        args.samples.is_none() || data.ends_with(".jsonl"),
        "--samples with --data needs a .jsonl file of examples (it writes their completion tokens' log-probabilities)"
    );
    let checkpoint = Checkpoint::open(Path::new(&args.checkpoint))
        .with_context(|| format!("opening checkpoint {}", args.checkpoint))?;
    let max = checkpoint.model_config.max_seq_len;
    let context = args.context.unwrap_or(max);
    anyhow::ensure!(
        context >= 1 && context <= max,
        "--context {context} must be in 1..={max} (the model's max_seq_len)"
    );
    let stride = args.stride.unwrap_or((context / 2).max(1));
    anyhow::ensure!(stride >= 1 && stride <= context, "--stride {stride} must be in 1..={context} (the context)");
    let (scored, init) = scored_data(&checkpoint, &data, context, stride)?;
    let samples = match &args.samples {
        Some(_) => {
            anyhow::ensure!(args.batch_tokens >= 1, "--batch-tokens must be at least 1");
            Some((examples::read(Path::new(&data), &checkpoint.tokenizer, &checkpoint.dir)?, args.batch_tokens))
        }
        None => None,
    };
    let checkpointing = false;
    let job = EvalJob { checkpoint, init, scored, batch: args.batch, samples };
    let (r, samples) = dispatch(args.device, checkpointing, job)?;
    if let (Some(path), Some((samples, logprobs))) = (&args.samples, samples) {
        examples::write(path, &samples, &logprobs)?;
    }
    match (&r, args.json) {
        (Report::Perplexity(r), true) => println!("{}", serde_json::to_string(r)?),
        (Report::Completion(r), true) => println!("{}", serde_json::to_string(r)?),
        (Report::Perplexity(r), false) => println!(
            "{}: nll {:.4} nats/token, perplexity {:.3}, {:.4} bits/byte over {} tokens ({} bytes; context {}, stride {})",
            data, r.nll, r.perplexity, r.bits_per_byte, r.tokens, r.bytes, r.context, r.stride
        ),
        (Report::Completion(r), false) => println!(
            "{}: completion nll {:.4} nats/token, perplexity {:.3} over {} scored tokens in {} rows{} (context {})",
            data,
            r.nll,
            r.perplexity,
            r.tokens,
            r.rows,
            r.examples.map_or(String::new(), |n| format!(" of {n} examples")),
            r.context
        ),
    }
    Ok(())
}

/// The tokens or examples `--data` names: a split of the checkpoint's own data, a `.jsonl` file of
/// fine-tuning examples, or a text file; with the checkpoint's `init_from` source where reading a
/// split opened it.
fn scored_data(
    checkpoint: &Checkpoint,
    data: &str,
    context: usize,
    stride: usize,
) -> anyhow::Result<(Scored, Option<ResolvedInit>)> {
    let tokenizer = &checkpoint.tokenizer;
    let tokens = match data {
        split @ ("train" | "val") => return split_data(checkpoint, split, context, stride),
        path if path.ends_with(".jsonl") => {
            let (rows, examples) =
                ember_train::data::jsonl_examples(Path::new(path), tokenizer, &checkpoint.dir, context)
                    .with_context(|| format!("reading fine-tuning examples from {path}"))?;
            anyhow::ensure!(rows.scored_tokens() > 0, "{path}: no scored (completion) tokens to evaluate");
            return Ok((Scored::Examples { rows, examples: Some(examples), context }, None));
        }
        path => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            // A document: `<bos>` first where the tokenizer puts one (Gemma, Llama), as transformers does.
            tokenizer.encode_prompt(&text).with_context(|| format!("tokenizing {path}"))?
        }
    };
    Ok((stream(tokenizer, tokens, data, context, stride)?, None))
}

/// A split of the checkpoint's own training data. Its `init_from` source is opened (once) where
/// the data's tokenizer or the model's base comes from it.
fn split_data(
    checkpoint: &Checkpoint,
    split: &str,
    context: usize,
    stride: usize,
) -> anyhow::Result<(Scored, Option<ResolvedInit>)> {
    // An import (`ember import`) is weights and a tokenizer: no training data to take a split of.
    let Some(config) = checkpoint.config.as_ref() else {
        anyhow::bail!(
            "--data {split}: {} has no training data of its own (no {} beside its weights: an `ember import`, not a \
             training run), so it has no {split} split; give --data a text file, or a .jsonl file of fine-tuning \
             examples",
            checkpoint.dir.display(),
            ember_train::checkpoint::CONFIG_FILE
        );
    };
    anyhow::ensure!(
        split != "val" || config.data.val_fraction != Some(0.0),
        "--data val: {} trained without validation (data.val_fraction = 0), so it has no val split; give --data \
         a file",
        checkpoint.dir.display()
    );
    let needed = config.data.tokenizer.is_none() || checkpoint.is_adapter();
    let init = config.init_from.as_ref().filter(|_| needed).map(InitSource::resolve).transpose();
    let init = init.context("opening the run's init_from source")?;
    let locations = crate::env::locations();
    if config.data.format() == DataFormat::Jsonl {
        let loaded = ember_train::data::load(config, init.as_ref(), &locations)
            .with_context(|| format!("loading the {split} examples of the checkpoint's data"))?;
        let rows = examples_of(if split == "train" { loaded.train } else { loaded.val }.as_ref());
        return Ok((Scored::Examples { rows, examples: None, context: config.seq_len() }, init));
    }
    let tokens = ember_train::data::split_tokens(config, init.as_ref(), &locations, split)
        .with_context(|| format!("loading the {split} split of the checkpoint's data"))?;
    Ok((stream(&checkpoint.tokenizer, tokens, split, context, stride)?, init))
}

/// `tokens` to score as one stream (at least two: the first is only context), with the UTF-8 bytes
/// they stand for.
fn stream(
    tokenizer: &Tokenizer,
    tokens: Vec<u32>,
    data: &str,
    context: usize,
    stride: usize,
) -> anyhow::Result<Scored> {
    anyhow::ensure!(tokens.len() >= 2, "{data}: {} tokens, at least 2 are needed to score one", tokens.len());
    let bytes = tokenizer.decode(&tokens[1..])?.len();
    Ok(Scored::Stream { tokens, bytes, context, stride })
}

/// The rows of a packed split, as one set to score.
fn examples_of(rows: &dyn burn::data::dataset::Dataset<ember_data::Window>) -> PackedExamples {
    PackedExamples::from_rows((0..rows.len()).filter_map(|i| rows.get(i)).collect())
}
