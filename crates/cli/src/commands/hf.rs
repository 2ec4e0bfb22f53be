//! `ember import` and `ember export`: Hugging Face model folders in and out.

use std::path::PathBuf;

use anyhow::Context;
use burn::backend::Flex;
use burn::tensor::DType;
use clap::{Args, ValueEnum};
use ember_data::Tokenizer;
use ember_model::weights::named_tensors;
use ember_train::checkpoint::{self, CheckpointData, TOKENIZER_EXTRAS, TOKENIZER_FILE};
use ember_train::Checkpoint;

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// A Hugging Face model folder: config.json, model.safetensors (or shards and their index),
    /// tokenizer.json.
    dir: PathBuf,
    /// The run directory to create (sample, eval, export or fine-tune from it).
    #[arg(long)]
    out: PathBuf,
    /// Parameter dtype: f32, or bf16 to halve the memory of an inference copy.
    #[arg(long, default_value = "f32")]
    dtype: ParamDtype,
    /// Keep parameters the folder lacks at zero instead of failing.
    #[arg(long)]
    allow_missing: bool,
    /// Skip tensors that match no parameter instead of failing.
    #[arg(long)]
    allow_unused: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ParamDtype {
    F32,
    Bf16,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A run directory (its latest checkpoint) or a checkpoint folder.
    run_dir: PathBuf,
    #[arg(long, value_enum, default_value = "hf")]
    format: ExportFormat,
    /// The folder to write (must not exist or be empty).
    #[arg(long)]
    out: PathBuf,
    /// Fold LoRA adapters into the weights (required to export a LoRA checkpoint).
    #[arg(long)]
    merge: bool,
    /// Largest safetensors shard, e.g. 5GB, 500MB or a byte count.
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ExportFormat {
    /// Hugging Face transformers: config.json, model.safetensors, tokenizer.json.
    Hf,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = [("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)]
        .iter()
        .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n, *m)))
        .unwrap_or((s, 1.0));
    // Below a kilobyte every tensor would get a shard of its own: surely a typo for a larger unit.
    const MIN: f64 = 1e3;
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v * mult >= MIN => Ok((v * mult) as u64),
        Ok(v) if v.is_finite() && v > 0.0 => {
            Err(format!("`{s}` is {} bytes, below the smallest shard size of 1KB", (v * mult) as u64))
        }
        _ => Err(format!("`{s}`: expected a size such as 5GB, 500MB or 1000000")),
    }
}

pub fn import(args: ImportArgs) -> anyhow::Result<()> {
    if args.out.join(checkpoint::CHECKPOINTS).exists() {
        anyhow::bail!("{} already holds a run; choose another --out", args.out.display());
    }
    let dtype = match args.dtype {
        ParamDtype::F32 => DType::F32,
        ParamDtype::Bf16 => DType::BF16,
    };
    let imported =
        ember_hf::import::<Flex>(&args.dir, dtype, args.allow_missing, args.allow_unused, &Default::default())
            .with_context(|| format!("importing {}", args.dir.display()))?;
    let tokenizer_path = args.dir.join(TOKENIZER_FILE);
    let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
    let model = &imported.model;
    let data = CheckpointData {
        step: 0,
        model_config: model.config(),
        weights: named_tensors(model),
        adapters_only: false,
        tokenizer: &tokenizer,
        tokenizer_dir: Some(&args.dir),
        hf_config: Some(&imported.hf_config),
        training: None,
    };
    let dir = checkpoint::save(&args.out, data, 1)?;
    let c = model.config();
    println!(
        "imported {} ({} layers, d_model {}, vocab {}, {} parameters in {:?}) into {}; {} tensors loaded, {} missing, {} unused",
        imported.architecture.class_name(),
        c.n_layers,
        c.d_model,
        c.vocab_size,
        c.num_params(),
        dtype,
        dir.display(),
        imported.loaded,
        imported.missing.len(),
        imported.unused.len()
    );
    Ok(())
}

pub fn export(args: ExportArgs) -> anyhow::Result<()> {
    let ExportFormat::Hf = args.format;
    let ckpt = Checkpoint::open(&args.run_dir).with_context(|| format!("opening {}", args.run_dir.display()))?;
    let mut model = ckpt.decoder::<Flex>(&Default::default())?;
    if model.has_lora() {
        anyhow::ensure!(
            args.merge,
            "{} holds LoRA adapters: pass --merge to fold them into the weights",
            ckpt.dir.display()
        );
        model = model.merge_lora();
    }
    // The tokenizer travels inside the export, so that the folder appears complete or not at all.
    let tokenizer_files: Vec<PathBuf> = std::iter::once(TOKENIZER_FILE)
        .chain(TOKENIZER_EXTRAS)
        .map(|name| ckpt.dir.join(name))
        .filter(|path| path.is_file())
        .collect();
    let report = ember_hf::export(&model, ckpt.hf_config().as_ref(), &args.out, args.max_shard_size, &tokenizer_files)
        .with_context(|| format!("exporting to {}", args.out.display()))?;
    println!(
        "exported {} as {}: {} tensors, {:.1} MB in {} file(s) under {}",
        ckpt.dir.display(),
        report.architecture.class_name(),
        report.tensors,
        report.bytes as f64 / 1e6,
        report.files.iter().filter(|f| f.extension().is_some_and(|e| e == "safetensors")).count(),
        args.out.display()
    );
    Ok(())
}
