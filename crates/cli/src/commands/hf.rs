//! `ember import` and `ember export`: Hugging Face model folders and GGUF files in and out.

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
    /// A Hugging Face model folder (config.json, model.safetensors or shards and their index,
    /// tokenizer.json), or a llama.cpp GGUF file, whatever its name (F32, F16,
    /// BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K).
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
    /// hf, or gguf (the default when --out ends in .gguf).
    #[arg(long, value_enum)]
    format: Option<ExportFormat>,
    /// The folder to write (must not exist or be empty), or the GGUF file (`.gguf`) to create.
    #[arg(long)]
    out: PathBuf,
    /// Fold LoRA adapters into the weights (required to export a LoRA checkpoint).
    #[arg(long)]
    merge: bool,
    /// GGUF only: how the weights are stored (default f32; q8_0 quantizes the matrices; norms
    /// stay f32).
    #[arg(long, value_enum)]
    dtype: Option<GgufDtype>,
    /// Hugging Face only: the largest safetensors shard, e.g. 5GB (the default), 500MB or a byte
    /// count.
    #[arg(long, value_parser = parse_size)]
    max_shard_size: Option<u64>,
}

/// Shards of a Hugging Face export at most this large unless `--max-shard-size` says otherwise.
const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

impl ExportArgs {
    /// The format asked for: `--format`, else GGUF for an `--out` ending in `.gguf`, else Hugging
    /// Face; an error for a flag of the other format (it would be ignored).
    fn format(&self) -> anyhow::Result<ExportFormat> {
        let gguf_name = self.out.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let format = self.format.unwrap_or(if gguf_name { ExportFormat::Gguf } else { ExportFormat::Hf });
        match format {
            ExportFormat::Hf => anyhow::ensure!(
                self.dtype.is_none(),
                "--dtype is a GGUF export's setting (add --format gguf); a Hugging Face export keeps the checkpoint's dtype"
            ),
            ExportFormat::Gguf => anyhow::ensure!(
                self.max_shard_size.is_none(),
                "--max-shard-size is a Hugging Face export's setting; a GGUF export is one file"
            ),
        }
        Ok(format)
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ExportFormat {
    /// Hugging Face transformers: config.json, model.safetensors, tokenizer.json.
    Hf,
    /// One llama.cpp GGUF file (--out FILE.gguf) with the tokenizer and chat template in it.
    Gguf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum GgufDtype {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
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
    // A new run's folder: never inside a folder of the user's own files (nor over a file).
    if args.out.is_file() {
        anyhow::bail!("{} is a file; --out names the run folder to create", args.out.display());
    }
    if std::fs::read_dir(&args.out).is_ok_and(|mut entries| entries.next().is_some()) {
        anyhow::bail!("{} exists and holds files; --out names a new (or empty) run folder", args.out.display());
    }
    let dtype = match args.dtype {
        ParamDtype::F32 => DType::F32,
        ParamDtype::Bf16 => DType::BF16,
    };
    // GGUF by its magic bytes, whatever the file's name; anything else must be a model folder.
    if ember_hf::gguf::is_gguf(&args.dir)? {
        return import_gguf(&args, dtype);
    }
    anyhow::ensure!(
        !args.dir.is_file(),
        "{}: a file that is not GGUF (it does not begin with \"GGUF\"); import takes a GGUF file or a Hugging Face model folder",
        args.dir.display()
    );
    let imported =
        ember_hf::import::<Flex>(&args.dir, dtype, args.allow_missing, args.allow_unused, &Default::default())
            .with_context(|| format!("importing {}", args.dir.display()))?;
    let tokenizer_path = args.dir.join(TOKENIZER_FILE);
    let tokenizer = Tokenizer::from_file(&tokenizer_path)?;
    let model = &imported.model;
    let dir = save_import(&args.out, model, &tokenizer, &args.dir, &imported.hf_config)?;
    println!(
        "imported {} ({} in {:?}) into {}; {} tensors loaded, {} missing, {} unused",
        imported.architecture.class_name(),
        shape_summary(model.config()),
        dtype,
        dir.display(),
        imported.loaded,
        imported.missing.len(),
        imported.unused.len()
    );
    Ok(())
}

/// Writes an imported model as the step-0 checkpoint of a new run at `out`, with the tokenizer
/// files of `tokenizer_dir` and the model's config.json.
fn save_import(
    out: &std::path::Path,
    model: &ember_model::Decoder<Flex>,
    tokenizer: &Tokenizer,
    tokenizer_dir: &std::path::Path,
    hf_config: &serde_json::Value,
) -> anyhow::Result<PathBuf> {
    let vocab = model.config().vocab_size;
    anyhow::ensure!(
        tokenizer.vocab_size() <= vocab,
        "the tokenizer has ids up to {}, past the model's vocab_size {vocab}: it does not belong to these weights",
        tokenizer.vocab_size() - 1
    );
    let data = CheckpointData {
        step: 0,
        model_config: model.config(),
        weights: named_tensors(model),
        adapters_only: false,
        tokenizer,
        tokenizer_dir: Some(tokenizer_dir),
        hf_config: Some(hf_config),
        training: None,
    };
    Ok(checkpoint::save(out, data, 1)?)
}

/// `ember import FILE` of a GGUF file: the model dequantized, its tokenizer and chat template rebuilt from
/// the metadata (written beside the weights as tokenizer.json and tokenizer_config.json).
fn import_gguf(args: &ImportArgs, dtype: DType) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let g = ember_hf::gguf::model::import::<Flex>(&args.dir, dtype, &Default::default())
        .with_context(|| format!("importing {}", args.dir.display()))?;
    let files = tempfile::tempdir().context("creating a temporary folder for the tokenizer files (TMPDIR)")?;
    let write = |name: &str, text: &str| {
        let path = files.path().join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write(TOKENIZER_FILE, &g.tokenizer_json)?;
    write("tokenizer_config.json", &serde_json::to_string_pretty(&g.tokenizer_config)?)?;
    let tokenizer = Tokenizer::from_json(&g.tokenizer_json)
        .with_context(|| format!("{}: the tokenizer rebuilt from its metadata does not load", args.dir.display()))?;
    let model = &g.imported.model;
    let dir = save_import(&args.out, model, &tokenizer, files.path(), &g.imported.hf_config)?;
    let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
    g.stored.iter().for_each(|(_, k)| *kinds.entry(*k).or_default() += 1);
    println!(
        "imported GGUF {} ({}; tensors {:?}) as {:?} into {} in {:.1} s",
        g.arch.family().gguf_arch,
        shape_summary(model.config()),
        kinds,
        dtype,
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `ember export RUN --format gguf --out FILE.gguf`.
fn export_gguf(args: &ExportArgs, ckpt: &Checkpoint, model: &ember_model::Decoder<Flex>) -> anyhow::Result<()> {
    use ember_hf::gguf::model::{encode_model, ExportType};
    let dtype = args.dtype.unwrap_or(GgufDtype::F32);
    let ty = match dtype {
        GgufDtype::F32 => ExportType::F32,
        GgufDtype::F16 => ExportType::F16,
        GgufDtype::Bf16 => ExportType::Bf16,
        GgufDtype::Q8_0 => ExportType::Q8_0,
    };
    anyhow::ensure!(!args.out.exists(), "{}: exists; choose another --out", args.out.display());
    let tokenizer_json = std::fs::read_to_string(ckpt.dir.join(TOKENIZER_FILE))
        .with_context(|| format!("reading {}", ckpt.dir.join(TOKENIZER_FILE).display()))?;
    let config_path = ckpt.dir.join("tokenizer_config.json");
    let tokenizer_config: Option<serde_json::Value> = match std::fs::read_to_string(&config_path) {
        Ok(text) => Some(serde_json::from_str(&text).with_context(|| format!("{}", config_path.display()))?),
        Err(_) => None,
    };
    let encoded = encode_model(model, ckpt.hf_config().as_ref(), &tokenizer_json, tokenizer_config.as_ref(), ty)
        .with_context(|| format!("exporting {} to GGUF", ckpt.dir.display()))?;
    ember_data::write_new(&args.out, &encoded.bytes).with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "exported {} as GGUF {} ({:?}): {} tensors, {:.1} MB in {}",
        ckpt.dir.display(),
        encoded.arch,
        dtype,
        encoded.tensors,
        encoded.bytes.len() as f64 / 1e6,
        args.out.display()
    );
    Ok(())
}

pub fn export(args: ExportArgs) -> anyhow::Result<()> {
    let format = args.format()?;
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
    if let ExportFormat::Gguf = format {
        return export_gguf(&args, &ckpt, &model);
    }
    // The tokenizer travels inside the export, so that the folder appears complete or not at all.
    let tokenizer_files: Vec<PathBuf> = std::iter::once(TOKENIZER_FILE)
        .chain(TOKENIZER_EXTRAS)
        .map(|name| ckpt.dir.join(name))
        .filter(|path| path.is_file())
        .collect();
    let shard = args.max_shard_size.unwrap_or(DEFAULT_SHARD_BYTES);
    let report = ember_hf::export(&model, ckpt.hf_config().as_ref(), &args.out, shard, &tokenizer_files)
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

/// "L layers, d_model D, vocab V, N parameters": what an import reports of the model it made.
fn shape_summary(c: &ember_model::ModelConfig) -> String {
    format!("{} layers, d_model {}, vocab {}, {} parameters", c.n_layers, c.d_model, c.vocab_size, c.num_params())
}
