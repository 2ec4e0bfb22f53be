//! `ember eval --tasks`: benchmark tasks (crates/eval) on a run, a GGUF file or a Hugging Face
//! folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::backend::{dispatch, DeviceSpec, Job};
use crate::commands::source::ModelSource;
use anyhow::Context;
use burn::tensor::{DType, Device};
use ember_eval::schema::Schema;
use ember_eval::task::{Output, TaskSpec};
use ember_eval::{evaluate, prepare, Options, Prepared, TaskResult};
use ember_kernels::TrainBackend;

pub struct TasksArgs<'a> {
    pub checkpoint: &'a str,
    pub tasks: &'a str,
    pub eval_dir: Option<&'a Path>,
    /// Items of each task, its first ones (a task's own `:N` wins).
    pub limit: Option<usize>,
    pub options: Options,
    pub samples: Option<&'a PathBuf>,
    /// The JSON Schema file the generation tasks' answers follow.
    pub json_schema: Option<&'a Path>,
    pub json: bool,
    pub chat: bool,
    pub device: DeviceSpec,
}

struct TasksJob<'a> {
    source: ModelSource,
    prepared: &'a [Prepared],
    options: Options,
}

impl Job for TasksJob<'_> {
    type Output = Vec<TaskResult>;
    fn run<B: TrainBackend>(self, device: Device<B>, _name: &str) -> anyhow::Result<Vec<TaskResult>> {
        // Log-likelihoods and generations as the f32 model gives them: a GGUF's stored blocks are
        // decoded for exact products, not multiplied with 8-bit inputs.
        // Exact log-likelihoods: f32 products and an f32 cache whatever EMBER_KV_CACHE says.
        let compute = crate::env::compute().with_int8_inputs(false).with_kv_cache(DType::F32);
        let model = self.source.decoder::<B::InnerBackend>(&device)?.with_compute(compute);
        let tokenizer = &self.source.tokenizer;
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
            let result = evaluate(&model, tokenizer, task, &self.options, |n| bar.inc(n as u64))?;
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
    let source = ModelSource::open(Path::new(args.checkpoint))?;
    let tokenizer = source.tokenizer.clone();
    let mut options = args.options;
    options.schema = schema(args.json_schema, args.tasks, &selected, &source)?;
    let template = match args.chat {
        true => Some(ember_data::finetune::ChatTemplate::from_dir(&source.dir)?.ok_or_else(|| {
            anyhow::anyhow!(
                "--chat: {} has no chat template (chat_template.jinja or tokenizer_config.json)",
                args.checkpoint
            )
        })?),
        false => None,
    };
    let encoding = ember_eval::Encoding {
        tokenizer: &tokenizer,
        max_len: source.model_config.max_seq_len,
        chat: template.as_ref(),
    };
    let mut prepared = Vec::with_capacity(selected.len());
    for (spec, limit) in &selected {
        let limit = limit.or(args.limit);
        let task =
            prepare(spec, &dir, limit, &options, encoding).with_context(|| format!("preparing task {}", spec.name))?;
        prepared.push(task);
    }
    let job = TasksJob { source, prepared: &prepared, options: options.clone() };
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
        "num_fewshot": options.num_fewshot,
        "limit": args.limit,
        "fewshot_seed": options.seed,
        "json_schema": args.json_schema,
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

/// `--json-schema`'s schema, compiled for `source`'s tokenizer: refused where `selected` (the
/// `--tasks` list `tasks`) holds no generation task, whose answers alone it constrains.
fn schema(
    path: Option<&Path>,
    tasks: &str,
    selected: &[(TaskSpec, Option<usize>)],
    source: &ModelSource,
) -> anyhow::Result<Option<Schema>> {
    let Some(path) = path else { return Ok(None) };
    anyhow::ensure!(
        selected.iter().any(|(spec, _)| matches!(spec.output, Output::Generate(_))),
        "--json-schema constrains the answers of generation tasks (gsm8k, gsm8k_cot, nq_open), and `{tasks}` names \
         none: log-likelihood tasks score given texts"
    );
    let tokenizer = &source.tokenizer;
    let schema = Schema::load(path, tokenizer, &tokenizer.end_ids(), source.model_config.vocab_size)
        .with_context(|| format!("--json-schema {}", path.display()))?;
    Ok(Some(schema))
}
