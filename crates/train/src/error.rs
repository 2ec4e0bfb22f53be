use std::path::PathBuf;

use ember_data::DataError;
use ember_model::weights::WeightsError;
use ember_model::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}: {}{message}", path.display(), key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Config { path: PathBuf, key: Option<String>, message: String },
    #[error("{}: {error}", path.display())]
    Invalid { path: PathBuf, error: InvalidConfig },
    /// Every unknown, missing or mistyped key of a config file, in the order of the file.
    #[error("{}: {}", path.display(), problem_list(problems))]
    Problems { path: PathBuf, problems: Vec<ConfigProblem> },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("{path}: not a checkpoint: {reason}")]
    NotACheckpoint { path: PathBuf, reason: String },
    #[error("{path}: damaged checkpoint: {message}")]
    Checkpoint { path: PathBuf, message: String },
    /// Reinforcement learning's rollouts: a reward that failed, a prompt that does not fit.
    #[error("[rl] {0}")]
    Rl(String),
    #[error("[eval] tasks: {0}")]
    Eval(#[from] ember_eval::EvalError),
    #[error("cannot build the optimizer: {0}")]
    Optimizer(#[from] OptimizerError),
    #[error(
        "run directory {path} already holds a run with a checkpoint; pass --resume to continue it, \
         or choose another --run-dir"
    )]
    RunExists { path: PathBuf },
    #[error("cannot resume {path}: {message}")]
    Resume { path: PathBuf, message: String },
    #[error("training diverged at step {step}: loss is {loss}; lower schedule.lr or set optim.grad_clip")]
    Diverged { step: usize, loss: f64 },
    #[error("init_from = \"{spec}\": {message}")]
    InitFrom { spec: String, message: String },
    #[error(
        "the run needs about {need} but the device has {have} available ({terms}); lower train.batch_size \
         or train.seq_len, set train.activation_checkpointing = true or train.precision = \"bf16\", or \
         use a larger device"
    )]
    DoesNotFit { need: String, have: String, terms: String },
    #[error(transparent)]
    Distributed(#[from] crate::collective::DistError),
    #[error("model.vocab_size ({config}) is smaller than the tokenizer's vocabulary ({tokenizer})")]
    VocabTooSmall { config: usize, tokenizer: usize },
}

/// One problem on the line of the file name; several, one a line below it.
fn problem_list(problems: &[ConfigProblem]) -> String {
    match problems {
        [one] => one.to_string(),
        many => {
            let lines: Vec<String> = many.iter().map(|p| format!("\n  {p}")).collect();
            format!("{} problems:{}", many.len(), lines.concat())
        }
    }
}

impl TrainError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> TrainError {
        let path = path.into();
        move |err| TrainError::Io { path, err }
    }
}

/// Why `Optimizer::build` (the `step` module's) failed. Moments that do not fit the model can only come
/// from a checkpoint being resumed (the trainer reports those as a damaged checkpoint); a model
/// ZeRO-1 cannot shard is a fault of the run's config, fresh or resumed.
#[derive(Debug, thiserror::Error)]
pub enum OptimizerError {
    /// ZeRO-1 (`distributed.shard_optimizer`) refuses the model; the message says why and what to
    /// do instead.
    #[error("{0}")]
    Sharding(String),
    /// Saved AdamW moments that do not fit the model's parameters: `` `w.exp_avg` has 3 elements,
    /// the parameter has 4 ``.
    #[error("{0}")]
    Moments(String),
}

/// `--precision` (or another spelling of `train.precision`) that names no precision.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("precision `{0}`: expected f32, bf16 or f16")]
pub struct UnknownPrecision(pub String);

/// `init_from` in none of its forms (the TOML error names the key; this says what is wrong with
/// the value).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "\"{0}\" is neither `hf:DIR` (a Hugging Face folder), `run:DIR` (an ember run or checkpoint) nor \
     `gguf:FILE` (a GGUF model)"
)]
pub struct UnknownInitSource(pub String);

/// A config value that breaks a rule: each variant names the key, the value and the rule, in the
/// words of the model's own [`ConfigError`]s.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidConfig {
    /// `[eval] tasks` names no task, or one ember does not know.
    #[error("eval.tasks: {0}")]
    EvalTasks(String),
    /// `[rl]`'s rules that name more than one key, or a reward by its place in the list.
    #[error("rl: {0}")]
    Rl(String),
    /// `train.batch_size must be at least 1, found 0`.
    #[error("{key} must be {rule}, found {value}")]
    OutOfRange { key: &'static str, value: String, rule: &'static str },
    /// A size past the bound that keeps products of sizes (tokens per step, memory estimates) far
    /// from overflow.
    #[error("{key} = {value} is larger than ember's limit of {limit}")]
    TooLarge { key: &'static str, value: u64, limit: u64 },
    /// A value bounded by another key's: `schedule.min_lr (0.1) must not exceed schedule.lr (0.01)`.
    #[error("{key} ({value}) {relation}{bound_key} ({bound})")]
    Bounded { key: &'static str, value: String, relation: Relation, bound_key: &'static str, bound: String },
    /// A value that needs another key set: `data.format = "jsonl" needs data.path`.
    #[error("{key} = {value} needs {needs}")]
    Needs { key: &'static str, value: String, needs: &'static str },
    /// A fine-tuning setting on data that is a token stream.
    #[error("{key} = {value} applies to JSONL examples; this data is a text stream")]
    JsonlOnly { key: &'static str, value: String },
    #[error("data: set `dataset` (a built-in name) or `path` (a text file)")]
    NoData,
    #[error("data: set only one of `dataset` (\"{dataset}\") and `path` ({path})")]
    TwoData { dataset: String, path: String },
    #[error("metrics.sinks is empty: name jsonl and/or tensorboard")]
    NoSinks,
    #[error("lora: adapters fine-tune a pretrained model; set init_from")]
    LoraWithoutInit,
    /// `[lora]`'s own rules (their message names the key and the value).
    #[error("{0}")]
    Lora(ember_model::lora::LoraError),
    #[error(transparent)]
    Model(#[from] ConfigError),
    /// A key the file writes where it does nothing (config::effect's table): `[preference]
    /// simpo_gamma has no effect with method = "dpo" (only simpo uses it); remove it`.
    #[error("[{section}] {}has no effect {when} ({reason}); {fix}", key.map(|k| format!("{k} ")).unwrap_or_default())]
    NoEffect {
        /// The section (`model.moe` for a nested table).
        section: &'static str,
        /// The key; `None`: the section as a whole.
        key: Option<&'static str>,
        /// Where it stands: `with method = "dpo"`.
        when: String,
        reason: &'static str,
        fix: &'static str,
    },
}

/// How [`InvalidConfig::Bounded`]'s value relates to its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    /// `value <= bound`.
    NotAbove,
    /// `1 <= value <= bound`.
    OneTo,
}

impl std::fmt::Display for Relation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotAbove => "must not exceed ",
            Self::OneTo => "must be in 1..=",
        })
    }
}

/// One thing wrong with a config file, where the file says it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}{}{what}", line.map(|l| format!("line {l}: ")).unwrap_or_default(), place(section.as_deref()))]
pub struct ConfigProblem {
    /// 1-based line of the key (or the section header) in the file, where it has one.
    pub line: Option<usize>,
    /// The section (`None`: the top of the file, before any `[section]`).
    pub section: Option<String>,
    pub what: Problem,
}

fn place(section: Option<&str>) -> String {
    section.map(|s| format!("[{s}] ")).unwrap_or_default()
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Problem {
    #[error("unknown key \"{key}\"{hint}")]
    UnknownKey { key: String, hint: Hint },
    #[error("unknown section{hint}")]
    UnknownSection { hint: Hint },
    #[error("{key} is missing")]
    Missing { key: String },
    /// A section left out that has no default: what to put in it.
    #[error("is missing: {needs}")]
    MissingSection { needs: &'static str },
    #[error("must be a table (a [section] of keys), found {found}")]
    NotATable { found: &'static str },
    /// A value of the wrong type or outside its choices: serde's words (`key` is empty where
    /// serde does not say which key).
    #[error("{}{message}", if key.is_empty() { String::new() } else { format!("{key}: ") })]
    BadValue { key: String, message: String },
    /// Two keys that say the same thing two ways.
    #[error("{key} and {other} are both set: give one ({other} follows from {key})")]
    Exclusive { key: &'static str, other: &'static str },
    /// A value that breaks a rule (its message names the dotted key).
    #[error("{0}")]
    Rule(InvalidConfig),
}

/// What an unknown name may have meant.
#[derive(Debug, Clone, PartialEq)]
pub enum Hint {
    None,
    /// A known name a typo away.
    DidYouMean(String),
    /// The key exists in one other section, and only there.
    BelongsIn(String),
    /// The key exists in several other sections, each its own (`beta`: DPO's and GRPO's).
    KeyOf(Vec<String>),
    /// A known section a typo away.
    Section(String),
    /// A section's own name, written as a key of another.
    IsSection(String),
}

impl std::fmt::Display for Hint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hint::None => Ok(()),
            Hint::DidYouMean(name) => write!(f, " — did you mean \"{name}\"?"),
            Hint::BelongsIn(section) => write!(f, " — it belongs in [{section}]"),
            Hint::KeyOf(sections) => {
                let names: Vec<String> = sections.iter().map(|s| format!("[{s}]")).collect();
                write!(f, " — a key of {}, each its own", names.join(" and "))
            }
            Hint::Section(section) => write!(f, " — did you mean [{section}]?"),
            Hint::IsSection(section) => write!(f, " — [{section}] is a section: write it as a table header"),
        }
    }
}
