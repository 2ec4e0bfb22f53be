//! `ember init`: writes a commented config to start from, one of the templates kept (and tested)
//! in configs/: pretraining from scratch, LoRA or full fine-tuning of a pretrained model, preference
//! tuning (DPO), reinforcement learning (GRPO).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};

#[derive(Args, Debug)]
pub struct InitArgs {
    /// pretrain: a small model from scratch on tinyshakespeare; lora: LoRA fine-tuning of
    /// SmolLM2-135M-Instruct on examples/chat.jsonl; full: every weight of it; dpo: preference
    /// tuning (DPO, LoRA) of it on examples/preference.jsonl; grpo: reinforcement learning (GRPO,
    /// LoRA) of it on examples/arithmetic.jsonl with verifiable rewards.
    kind: Kind,
    /// The file to write [default: KIND.toml]; an existing file is never overwritten.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Pretrain,
    Lora,
    Full,
    Dpo,
    Grpo,
}

impl Kind {
    /// The template: configs/KIND.toml, as built into the binary.
    pub fn template(self) -> &'static str {
        match self {
            Kind::Pretrain => include_str!("../../../../configs/pretrain.toml"),
            Kind::Lora => include_str!("../../../../configs/lora.toml"),
            Kind::Full => include_str!("../../../../configs/full.toml"),
            Kind::Dpo => include_str!("../../../../configs/dpo.toml"),
            Kind::Grpo => include_str!("../../../../configs/grpo.toml"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Pretrain => "pretrain",
            Kind::Lora => "lora",
            Kind::Full => "full",
            Kind::Dpo => "dpo",
            Kind::Grpo => "grpo",
        }
    }
}

pub fn run(args: InitArgs) -> anyhow::Result<()> {
    let out = args.out.unwrap_or_else(|| PathBuf::from(format!("{}.toml", args.kind.name())));
    // `create_new` refuses a file that exists, in the same system call that creates it.
    let mut file = match std::fs::OpenOptions::new().write(true).create_new(true).open(&out) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            anyhow::bail!("{} already exists; remove it or choose another --out", out.display())
        }
        Err(e) => return Err(e).with_context(|| format!("creating {}", out.display())),
    };
    file.write_all(args.kind.template().as_bytes()).with_context(|| format!("writing {}", out.display()))?;
    let next = match args.kind {
        Kind::Pretrain => String::new(),
        Kind::Lora | Kind::Full | Kind::Dpo | Kind::Grpo => {
            "import the model its init_from names (see the file's first lines), then ".to_string()
        }
    };
    println!("wrote {}; {next}run it with: ember train --config {}", out.display(), out.display());
    Ok(())
}
