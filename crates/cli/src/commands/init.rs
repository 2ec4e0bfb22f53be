//! `ember init`: writes a commented config to start from, one of the templates kept (and tested)
//! in configs/: pretraining from scratch, LoRA or full fine-tuning of a pretrained model, preference
//! tuning (DPO), reinforcement learning (GRPO).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, ValueEnum};

#[derive(Args, Debug)]
pub struct InitArgs {
    /// pretrain: a small model from scratch on tinyshakespeare; lora: LoRA fine-tuning of
    /// SmolLM2-135M-Instruct on examples/chat.jsonl; full: every weight of it; dpo: preference
    /// tuning (DPO, LoRA) of the lora run (runs/lora) on examples/preference.jsonl; grpo:
    /// reinforcement learning (GRPO, LoRA) of SmolLM2 on examples/arithmetic.jsonl with verifiable
    /// rewards.
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
    write_new(&out, |file| file.write_all(args.kind.template().as_bytes()))?;
    let next = match args.kind {
        Kind::Pretrain => String::new(),
        Kind::Lora | Kind::Full | Kind::Grpo => {
            "import the model its init_from names (see the file's first lines), then ".to_string()
        }
        Kind::Dpo => "train the lora template first (this run starts from its runs/lora; see the file's first \
                      lines), then "
            .to_string(),
    };
    println!("wrote {}; {next}run it with: ember train --config {}", out.display(), out.display());
    Ok(())
}

/// Writes the new file `out` whole or not at all ([`ember_data::write_new_with`]).
fn write_new(out: &Path, write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> anyhow::Result<()> {
    match ember_data::write_new_with(out, write) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            anyhow::bail!("{} already exists; remove it or choose another --out", out.display())
        }
        Err(e) => Err(e).with_context(|| format!("creating {}", out.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 57: a write that fails (a full disk, injected) leaves neither the file nor its
    /// temporary behind, so the retry writes it (it said "already exists" of an empty file).
    #[test]
    fn a_failed_write_leaves_no_file_and_the_retry_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("lora.toml");
        let full = |_: &mut std::fs::File| Err(std::io::Error::from(std::io::ErrorKind::StorageFull));
        let e = format!("{:#}", write_new(&out, full).unwrap_err());
        assert!(e.contains("creating") && e.contains("lora.toml"), "{e}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "nothing left behind: {left:?}");
        write_new(&out, |f| f.write_all(b"x = 1\n")).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "x = 1\n");
        let e = write_new(&out, |f| f.write_all(b"y = 2\n")).unwrap_err().to_string();
        assert!(e.contains("lora.toml already exists"), "{e}");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "x = 1\n", "never overwritten");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary left");
    }
}
