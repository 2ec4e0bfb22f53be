//! Helpers shared by the end-to-end tests: a scratch directory, a small corpus, a tiny config, and
//! running the `ember` binary in it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub struct Scratch {
    pub dir: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Self {
        Self { dir: tempfile::tempdir().expect("temp dir") }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path().join(name);
        std::fs::write(&p, text).expect("write scratch file");
        p
    }

    /// [`Scratch::ember`] with extra environment variables.
    pub fn ember_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = self.command(args);
        cmd.envs(env.iter().copied());
        cmd.output().expect("run ember")
    }

    /// Runs `ember args...` with the scratch folder as working directory and download cache.
    /// `$EMBER_BIN`, when set, names another binary to run instead of the one cargo built (to run
    /// a test against an older build, as `experiments/reliability.md` does).
    pub fn ember(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run ember")
    }

    /// The command [`Scratch::ember`] runs, to add to.
    pub fn command(&self, args: &[&str]) -> Command {
        let bin = std::env::var_os("EMBER_BIN")
            .filter(|b| !b.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ember")));
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .current_dir(self.path())
            .env("EMBER_CACHE_DIR", self.path().join("cache"))
            .env_remove("EMBER_DATA_DIR")
            .env_remove("EMBER_CPU_LOW_PRECISION")
            .env("RUST_LOG", "info");
        cmd
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean failure: non-zero exit, the message on stderr, and no panic.
pub fn assert_clean_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, stdout: {}", stdout(o));
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(err.contains(needle), "stderr lacks `{needle}`:\n{err}");
}

/// About 30 KB of play-shaped text: names, colons, line breaks.
pub fn corpus() -> String {
    let names = ["ROMEO", "JULIET", "MERCUTIO", "NURSE", "FRIAR LAURENCE"];
    let words = [
        "the", "night", "is", "long", "and", "love", "doth", "speak", "of", "fair", "Verona", "where", "we", "lay",
        "our", "scene", "what", "light", "through", "yonder", "window", "breaks",
    ];
    let mut s = String::new();
    let mut x: u64 = 7;
    for i in 0..400 {
        s.push_str(names[i % names.len()]);
        s.push_str(":\n");
        for _ in 0..2 {
            for w in 0..8 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if w > 0 {
                    s.push(' ');
                }
                s.push_str(words[(x >> 33) as usize % words.len()]);
            }
            s.push_str(",\n");
        }
        s.push('\n');
    }
    s
}

/// A LoRA fine-tune of run `init` on the JSONL examples in `data`: rank 8 on every projection,
/// `steps` steps of 2 × 16 positions at learning rate `lr`, evaluated every `eval_interval` steps on
/// one batch, checkpointed at the end.
pub fn lora_config(init: &str, data: &str, steps: usize, eval_interval: usize, lr: f64, seed: u64) -> String {
    format!(
        r#"
init_from = "run:{init}"

[data]
path = "{data}"

[train]
batch_size = 2
seq_len = 16
max_steps = {steps}
eval_interval = {eval_interval}
eval_iters = 1
log_interval = {log_interval}
checkpoint_interval = {steps}
seed = {seed}

[optim]
weight_decay = 0.0

[schedule]
lr = {lr:e}
warmup_steps = 2

[lora]
rank = 8
alpha = 16.0
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"#,
        log_interval = (eval_interval / 2).max(1)
    )
}

/// A tiny model on `data.path = corpus.txt`: 6 steps, evaluating every 3.
pub fn tiny_config(extra_train: &str) -> String {
    format!(
        r#"
[model]
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
d_ff = 64
max_seq_len = 32

[data]
path = "corpus.txt"
tokenizer = "char"

[train]
batch_size = 4
max_steps = 6
eval_interval = 3
eval_iters = 2
log_interval = 1
checkpoint_interval = 3
seed = 7
{extra_train}
{OPTIMIZER}"#
    )
}

/// The optimizer and schedule of the tests' small runs (AdamW, warmup then cosine to a tenth).
pub const OPTIMIZER: &str = r#"
[optim]
weight_decay = 0.1
grad_clip = 1.0

[schedule]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
"#;

#[path = "assets.rs"]
mod shared_assets;
pub use shared_assets::assets;

/// The SmolLM2-135M-Instruct GGUF of the shared test assets, under [`assets`].
pub const SMOLLM2_GGUF: &str = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";

/// SmolLM2 imported into `smol` under the scratch folder; its path.
pub fn import_smollm2(s: &Scratch) -> PathBuf {
    let gguf = assets().join(SMOLLM2_GGUF);
    assert!(gguf.is_file(), "{} not found: set EMBER_TEST_ASSETS to the folder holding models/", gguf.display());
    let out = s.ember(&["import", gguf.to_str().unwrap(), "--out", "smol"]);
    assert!(out.status.success(), "import failed: {}", stderr(&out));
    s.path().join("smol")
}
