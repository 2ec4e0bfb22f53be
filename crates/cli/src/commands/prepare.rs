use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ember_data::TokenizerSpec;

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// Text file to tokenize.
    #[arg(long)]
    data: PathBuf,
    /// `char`, `bpe`, `bpe:VOCAB`, or a path to a tokenizer.json.
    #[arg(long, default_value = "char")]
    tokenizer: TokenizerSpec,
    /// Output folder for train.bin, val.bin, tokenizer.json and meta.json.
    #[arg(long)]
    out: PathBuf,
    /// Fraction of the text, from the end, held out for validation.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
}

pub fn run(args: PrepareArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.val_fraction > 0.0 && args.val_fraction < 1.0,
        "--val-fraction must be in (0, 1), found {}",
        args.val_fraction
    );
    let p = ember_data::prepare(&args.data, &args.tokenizer, args.val_fraction, &args.out)
        .with_context(|| format!("preparing {}", args.data.display()))?;
    println!(
        "{}: {} train tokens, {} val tokens, vocabulary {} ({}){}",
        p.dir.display(),
        p.meta.train_tokens,
        p.meta.val_tokens,
        p.meta.vocab_size,
        p.meta.tokenizer,
        if p.reused { ", reused" } else { "" }
    );
    Ok(())
}
