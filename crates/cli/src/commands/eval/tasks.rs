//! `ember eval --tasks`: benchmark tasks (crates/eval) on a run, a GGUF file or a Hugging Face
//! folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::tensor::Device;
use ember_data::Tokenizer;
use ember_eval::{evaluate, prepare, Options, Prepared, TaskResult};
use ember_kernels::TrainBackend;
use ember_train::config::InitSource;
use ember_train::{Checkpoint, ResolvedInit};

use crate::backend::{dispatch, DeviceSpec, Job};

/// The model to evaluate: a run or checkpoint, or an `init_from`-style source.
pub enum Source {
    Run(Box<Checkpoint>),
    Init(Box<ResolvedInit>),
}

impl Source {
    /// `gguf:FILE`, `hf:DIR`, `run:DIR`, or a run directory / checkpoint folder.
    pub fn open(spec: &str) -> anyhow::Result<Self> {
        if spec.starts_with("gguf:") || spec.starts_with("hf:") || spec.starts_with("run:") {
            let source = InitSource::parse(spec)?;
            return Ok(Self::Init(Box::new(source.resolve().with_context(|| format!("opening {spec}"))?)));
        }
        let checkpoint = Checkpoint::open(Path::new(spec)).with_context(|| format!("opening checkpoint {spec}"))?;
        Ok(Self::Run(Box::new(checkpoint)))
    }

    pub fn max_seq_len(&self) -> usize {
        match self {
            Self::Run(c) => c.model_config.max_seq_len,
            Self::Init(init) => init.model_config.max_seq_len,
        }
    }

    /// The chat template of the model's tokenizer folder, if it has one.
    pub fn chat_template(&self) -> anyhow::Result<Option<ember_data::finetune::ChatTemplate>> {
        let dir = match self {
            Self::Run(c) => c.dir.clone(),
            Self::Init(init) => init.tokenizer_dir()?,
        };
        Ok(ember_data::finetune::ChatTemplate::from_dir(&dir)?)
    }

    pub fn tokenizer(&self) -> anyhow::Result<Tokenizer> {
        match self {
            Self::Run(c) => Ok(c.tokenizer.clone()),
            Self::Init(init) => {
                let dir = init.tokenizer_dir()?;
                Ok(Tokenizer::from_file(&dir.join("tokenizer.json"))?.with_model_eos(&dir))
            }
        }
    }

    fn decoder<B: ember_kernels::EmberBackend>(&self, device: &Device<B>) -> anyhow::Result<ember_model::Decoder<B>> {
        Ok(match self {
            Self::Run(c) => c.decoder::<B>(device)?,
            Self::Init(init) => init.load::<B>(false, device)?,
        })
    }
}

pub struct TasksArgs<'a> {
    pub checkpoint: &'a str,
    pub tasks: &'a str,
    pub eval_dir: Option<&'a Path>,
    /// Items of each task, its first ones (a task's own `:N` wins).
    pub limit: Option<usize>,
    pub options: Options,
    pub samples: Option<&'a PathBuf>,
    pub json: bool,
    pub chat: bool,
    pub device: DeviceSpec,
}

struct TasksJob<'a> {
    source: Source,
    tokenizer: Tokenizer,
    prepared: &'a [Prepared],
    options: Options,
}

impl Job for TasksJob<'_> {
    type Output = Vec<TaskResult>;
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<Vec<TaskResult>> {
        let model = self.source.decoder::<B::InnerBackend>(&device)?.with_compute(crate::env::compute());
        let total: usize = self.prepared.iter().map(|p| p.docs.len()).sum();
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} items, {per_sec}, eta {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut results = Vec::with_capacity(self.prepared.len());
        for task in self.prepared {
            bar.set_message(task.spec.name.clone());
            let started = std::time::Instant::now();
            let result = evaluate(&model, &self.tokenizer, task, &self.options, |n| bar.inc(n as u64))?;
            tracing::info!(
                "{}: {} items in {:.1} s ({:.2} items/s)",
                task.spec.name,
                result.effective,
                started.elapsed().as_secs_f64(),
                result.effective as f64 / started.elapsed().as_secs_f64().max(1e-9)
            );
            results.push(result);
        }
        bar.finish_and_clear();
        Ok(results)
    }
}

pub fn run(args: TasksArgs) -> anyhow::Result<()> {
    let dir = ember_eval::eval_dir(args.eval_dir, crate::env::eval_dir().as_deref())?;
    let selected = ember_eval::tasks::select(args.tasks)?;
    let source = Source::open(args.checkpoint)?;
    let tokenizer = source.tokenizer()?;
    let template = match args.chat {
        true => Some(source.chat_template()?.ok_or_else(|| {
            anyhow::anyhow!(
                "--chat: {} has no chat template (chat_template.jinja or tokenizer_config.json)",
                args.checkpoint
            )
        })?),
        false => None,
    };
    let encoding =
        ember_eval::Encoding { tokenizer: &tokenizer, max_len: source.max_seq_len(), chat: template.as_ref() };
    let mut prepared = Vec::with_capacity(selected.len());
    for (spec, limit) in &selected {
        let limit = limit.or(args.limit);
        let task = prepare(spec, &dir, limit, &args.options, encoding)
            .with_context(|| format!("preparing task {}", spec.name))?;
        prepared.push(task);
    }
    let job = TasksJob { source, tokenizer, prepared: &prepared, options: args.options.clone() };
    let results = ember_eval::run::with_groups(dispatch(args.device, false, job)?);
    if let Some(path) = args.samples {
        let mut out = Vec::new();
        for (task, result) in prepared.iter().zip(&results) {
            for line in ember_eval::run::sample_lines(task, result) {
                serde_json::to_writer(&mut out, &line)?;
                out.write_all(b"\n")?;
            }
        }
        ember_data::write_atomic(path, &out).with_context(|| format!("writing {}", path.display()))?;
    }
    let config = serde_json::json!({
        "model": args.checkpoint,
        "num_fewshot": args.options.num_fewshot,
        "limit": args.limit,
        "fewshot_seed": args.options.seed,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&ember_eval::run::to_json(&results, config))?);
        return Ok(());
    }
    println!("{:<58} {:>8} {:>6} {:>12} {:>10} {:>10}", "task", "items", "shots", "metric", "value", "stderr");
    for r in &results {
        for (name, e) in &r.metrics {
            println!(
                "{:<58} {:>8} {:>6} {:>12} {:>10.4} {:>10.4}",
                r.name, r.effective, r.num_fewshot, name, e.value, e.stderr
            );
        }
    }
    if let Some(core) = ember_eval::run::core(&results) {
        println!("CORE (primary accuracy centred on each task's random baseline, averaged): {core:.4}");
    }
    Ok(())
}
