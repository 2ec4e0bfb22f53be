//! Reading a config file: TOML syntax and unknown keys first (errors with the line, the column and
//! the dotted key), then the rules; writing the resolved config a run directory keeps; the
//! `init_from` source.

use std::path::{Path, PathBuf};

use ember_model::lora::Target;
use ember_model::{MlpKind, ModelConfig};

use super::{defaults, effect, keys, values, PendingLength, TrainConfig};
use crate::error::{InvalidConfig, TrainError, UnknownInitSource};

/// A config file as written, parsed and checked without opening anything but itself. `model` is
/// `None` where `[model]` is left out for the `init_from` model's: [`ConfigFile::resolve`] opens
/// the source (once) and takes it from there.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub config: TrainConfig<Option<ModelConfig>>,
    /// The defaults put in for keys the file leaves out that follow other keys (the batch, the
    /// rate, LoRA's alpha and targets, …): logged when the config is completed.
    pub defaults: Vec<defaults::Applied>,
}

/// Who wrote the text being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Author {
    /// A person: every rule, and no key where it has no effect ([`effect`]).
    User,
    /// ember, as a run directory's config.toml: every key is written out, and copies written by
    /// earlier versions hold keys at their defaults where they have no effect.
    Ember,
}

/// What a config file is read for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A training run: every rule.
    Run,
    /// A speed measurement (`ember bench train`): LoRA adapters may sit on a random base, since
    /// the step's cost does not depend on the weights' values.
    Bench,
}

impl ConfigFile {
    pub fn read(path: &Path) -> Result<Self, TrainError> {
        Self::read_for(path, Purpose::Run)
    }

    pub fn read_for(path: &Path, purpose: Purpose) -> Result<Self, TrainError> {
        let text = ember_data::read_file_to_string(path).map_err(TrainError::io(path))?;
        // A run directory's own copy (what a refused resume points to) is ember's: those written
        // by earlier versions hold keys at their defaults where they have no effect.
        let author = match run_dir_copy(path) {
            true => Author::Ember,
            false => Author::User,
        };
        Self::parse_by(&text, path, purpose, author)
    }

    /// Syntax, keys and types, then every rule that does not need the model; errors name the file
    /// and the key.
    pub fn parse(text: &str, path: &Path) -> Result<Self, TrainError> {
        Self::parse_for(text, path, Purpose::Run)
    }

    pub(crate) fn parse_for(text: &str, path: &Path, purpose: Purpose) -> Result<Self, TrainError> {
        Self::parse_by(text, path, purpose, Author::User)
    }

    fn parse_by(text: &str, path: &Path, purpose: Purpose, author: Author) -> Result<Self, TrainError> {
        let syntax = |e: toml::de::Error| TrainError::Config {
            path: path.into(),
            message: match e.span() {
                // 1-based line and column of the fault, as editors count them.
                Some(span) => {
                    let before = &text[..span.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                    format!("line {line}, column {column}: {}", e.message())
                }
                None => e.message().to_string(),
            },
            key: toml_key(text, e.span()),
        };
        // Syntax first, as a plain table: its errors carry the line and column.
        let mut table = toml::from_str::<toml::Table>(text).map_err(syntax)?;
        // Then every key at once (serde stops at the first): unknown, missing, mistyped.
        let mut problems = keys::check(&mut table, text);
        // What the file writes, before the defaults are put in: a key left out is never refused.
        let written = effect::written(&table);
        let defaults = defaults::fill(&mut table);
        problems.extend(values::check_values(&table, text));
        if !problems.is_empty() {
            // In the order of the file; keys left out (no line) last.
            problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
            return Err(TrainError::Problems { path: path.into(), problems });
        }
        // A length in epochs leaves max_steps, and the defaults left out that follow it, to the data.
        let left_out = |section: &str, key: &str| table.get(section).and_then(|t| t.get(key)).is_none();
        let (eval_interval, warmup_steps) = (left_out("train", "eval_interval"), left_out("schedule", "warmup_steps"));
        let mut config: TrainConfig<Option<ModelConfig>> =
            toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| TrainError::Config {
                path: path.into(),
                message: e.message().to_string(),
                key: None,
            })?;
        config.pending =
            config.train.num_epochs.map(|num_epochs| PendingLength { num_epochs, eval_interval, warmup_steps });
        // Every rule broken, at once: one as before, several (or a key with no effect, whose line
        // the message needs) as a list with their lines.
        let mut broken = config.broken_rules(purpose);
        if author == Author::User {
            broken.extend(config.idle_keys(&written));
        }
        // A key with no effect, or a reward of a list, is named by its line even alone.
        let placed = |e: &InvalidConfig| match e {
            InvalidConfig::NoEffect { .. } => true,
            InvalidConfig::Rl(m) => m.starts_with("rewards["),
            _ => false,
        };
        match broken.len() {
            0 => Ok(Self { path: path.into(), config, defaults }),
            1 if !placed(&broken[0]) => Err(TrainError::Invalid { path: path.into(), error: broken.remove(0) }),
            _ => {
                let mut problems: Vec<_> =
                    broken.into_iter().map(|rule| keys::ConfigProblem::rule(rule, text)).collect();
                problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
                Err(TrainError::Problems { path: path.into(), problems })
            }
        }
    }

    /// The config of a file that names its model: nothing is opened.
    pub fn complete(mut self) -> Result<TrainConfig, TrainError> {
        match self.config.model.take() {
            Some(model) => self.complete_with(model),
            None => Err(TrainError::Config {
                path: self.path,
                key: Some("model".into()),
                message: match self.config.init_from {
                    None => "missing: describe the model, or start from one with init_from".into(),
                    Some(_) => "left out for init_from's: the config must be resolved (ConfigFile::resolve)".into(),
                },
            }),
        }
    }

    /// The config with the architecture `model`, checked against the rules that need it; the
    /// defaults the file's keys left to ember are logged.
    pub fn complete_with(mut self, model: ModelConfig) -> Result<TrainConfig, TrainError> {
        // LoRA's default targets are the blocks' seven projections, those the model has: a plain
        // (GPT-2) MLP has no gate.
        let gated = matches!(model.mlp, MlpKind::Swiglu | MlpKind::Geglu);
        if let (Some(lora), false) = (self.config.lora.as_mut(), gated) {
            if let Some(d) = self.defaults.iter_mut().find(|d| (d.section, d.key) == ("lora", "targets")) {
                lora.targets.retain(|t| *t != Target::GateProj);
                let names: Vec<String> = lora.targets.iter().map(|t| format!("\"{t}\"")).collect();
                d.value = format!("[{}]", names.join(", "));
            }
        }
        let config = self.config.with_model(model);
        config.validate_model().map_err(|error| TrainError::Invalid { path: self.path, error })?;
        for d in &self.defaults {
            tracing::info!("{d}");
        }
        Ok(config)
    }
}

impl TrainConfig {
    /// Reads a complete config file (one with `[model]`, as every run directory's config.toml):
    /// nothing but the file is opened; errors name the file and the key.
    /// Keys that have no effect where they stand are not refused here: a copy written by an
    /// earlier version holds some at their defaults.
    pub fn from_file(path: &Path) -> Result<Self, TrainError> {
        let text = ember_data::read_file_to_string(path).map_err(TrainError::io(path))?;
        ConfigFile::parse_by(&text, path, Purpose::Run, Author::Ember)?.complete()
    }

    #[cfg(test)]
    pub(crate) fn from_toml(text: &str, path: &Path) -> Result<Self, TrainError> {
        ConfigFile::parse(text, path)?.complete()
    }

    /// Makes the paths of the config absolute (relative ones are relative to the working
    /// directory), so that the copy saved in a run directory works from anywhere.
    pub(crate) fn absolutize_paths(&mut self) {
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        if let Some(p) = &self.data.path {
            self.data.path = Some(abs(p));
        }
        if let Some(p) = &self.data.val_path {
            self.data.val_path = Some(abs(p));
        }
        if let Some(t) = &self.data.tokenizer {
            if t.ends_with(".json") {
                self.data.tokenizer = Some(abs(Path::new(t)).display().to_string());
            }
        }
        if let Some(schema) = self.rl.as_mut().and_then(|rl| rl.json_schema.as_mut()) {
            *schema = abs(schema);
        }
        self.init_from = self.init_from.as_ref().map(InitSource::absolute);
    }

    pub(crate) fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }
}

/// Whether `path` is a run directory's own `config.toml` (one beside the run's `checkpoints/`).
fn run_dir_copy(path: &Path) -> bool {
    let beside = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    path.file_name().is_some_and(|n| n == crate::run_layout::CONFIG_FILE)
        && beside.join(crate::run_layout::CHECKPOINTS).is_dir()
}

/// The dotted key at a TOML error position: the section header above it and the key on its line.
pub(super) fn toml_key(text: &str, span: Option<std::ops::Range<usize>>) -> Option<String> {
    let start = span?.start.min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let key = text[line_start..line_end].split('=').next()?.trim();
    let section = text[..line_start]
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix('[').and_then(|l| l.strip_suffix(']')))
        .map(str::trim);
    if key.is_empty() || key.starts_with('[') {
        return section.map(String::from);
    }
    Some(match section {
        Some(s) => format!("{s}.{key}"),
        None => key.to_string(),
    })
}

/// Parsed once, when the config is read (`init_from` in TOML is its text form).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum InitSource {
    Hf(PathBuf),
    Run(PathBuf),
    /// A GGUF model file: under LoRA its projections stay in their stored (quantized) types.
    Gguf(PathBuf),
}

impl TryFrom<String> for InitSource {
    type Error = UnknownInitSource;
    /// The TOML error names the key; this says what is wrong with the value.
    fn try_from(spec: String) -> Result<Self, UnknownInitSource> {
        Self::parse(&spec).map_err(|_| UnknownInitSource(spec))
    }
}

impl From<InitSource> for String {
    fn from(s: InitSource) -> String {
        s.to_string()
    }
}

impl std::fmt::Display for InitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Hf(d) => write!(f, "hf:{}", d.display()),
            Self::Run(d) => write!(f, "run:{}", d.display()),
            Self::Gguf(p) => write!(f, "gguf:{}", p.display()),
        }
    }
}

impl InitSource {
    /// The same source with its folder made absolute (relative to the working directory), so that
    /// a run directory's config works from anywhere.
    pub fn absolute(&self) -> Self {
        let abs = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
        match self {
            Self::Hf(d) => Self::Hf(abs(d)),
            Self::Run(d) => Self::Run(abs(d)),
            Self::Gguf(p) => Self::Gguf(abs(p)),
        }
    }

    pub fn parse(spec: &str) -> Result<Self, TrainError> {
        match spec.split_once(':') {
            Some(("hf", dir)) if !dir.is_empty() => Ok(Self::Hf(dir.into())),
            Some(("run", dir)) if !dir.is_empty() => Ok(Self::Run(dir.into())),
            Some(("gguf", file)) if !file.is_empty() => Ok(Self::Gguf(file.into())),
            _ => Err(TrainError::InitFrom {
                spec: spec.into(),
                message:
                    "expected `hf:DIR` (a Hugging Face folder), `run:DIR` (an ember run or checkpoint) or `gguf:FILE` \
                          (a GGUF model)"
                        .into(),
            }),
        }
    }

    pub(crate) fn err(&self, message: impl Into<String>) -> TrainError {
        TrainError::InitFrom { spec: self.to_string(), message: message.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{parse, parse_err, NANO};
    use crate::config::REQUIRED;

    /// A run directory's own config.toml, as earlier versions wrote it (every key, those without
    /// effect at their defaults), is read as ember's: a refused resume points the user to it.
    #[test]
    fn a_run_directorys_copy_keeps_keys_without_effect() {
        let dir = tempfile::tempdir().unwrap();
        let text = NANO.replace("[schedule]", "[schedule]\ncooldown_frac = 0.4");
        let path = dir.path().join(crate::run_layout::CONFIG_FILE);
        std::fs::write(&path, &text).unwrap();
        let e = ConfigFile::read(&path).unwrap_err().to_string();
        assert!(e.contains("cooldown_frac has no effect"), "{e}");
        std::fs::create_dir(dir.path().join(crate::run_layout::CHECKPOINTS)).unwrap();
        ConfigFile::read(&path).unwrap();
    }

    #[test]
    fn an_unknown_key_is_named_with_its_section_and_line() {
        let text = NANO.replace("n_layers = 4", "n_layers = 4\nn_kv_head = 2");
        let line = text.lines().position(|l| l == "n_kv_head = 2").unwrap() + 1;
        let e = parse_err(&text);
        assert_eq!(e, format!("c.toml: line {line}: [model] unknown key \"n_kv_head\" — did you mean \"n_kv_heads\"?"));
    }

    /// Each problem of `text`, as parsing lists them (panics if parsing does not fail on its keys).
    fn problems(text: &str) -> Vec<String> {
        match ConfigFile::parse(text, Path::new("c.toml")) {
            Err(TrainError::Problems { problems, .. }) => problems.iter().map(ToString::to_string).collect(),
            other => panic!("expected key problems, got {other:?}"),
        }
    }

    #[test]
    fn every_key_problem_is_reported_at_once_in_file_order() {
        let text = NANO
            .replace("seed = 1337", "seed = 1337\neval_intervl = 5")
            .replace("max_steps = 2000\n", "")
            .replace("eps = 1e-8", "eps = \"small\"\nlr = 1e-3")
            .replace("[schedule]", "[schedul]")
            .replace("tokenizer = \"char\"", "tokenizer = \"char\"\nformat = \"csv\"")
            + "\n[lora]\ntargets = [\"q_proj\"]\n";
        let line = |needle: &str| text.lines().position(|l| l == needle).unwrap() + 1;
        assert_eq!(
            problems(&text),
            [
                format!(
                    "line {}: [data] format: unknown variant `csv`, expected `text` or `jsonl`",
                    line("format = \"csv\"")
                ),
                format!(
                    "line {}: [train] unknown key \"eval_intervl\" — did you mean \"eval_interval\"?",
                    line("eval_intervl = 5")
                ),
                format!("line {}: [optim] eps: invalid type: string \"small\", expected f64", line("eps = \"small\"")),
                format!("line {}: [optim] unknown key \"lr\" — it belongs in [schedule]", line("lr = 1e-3")),
                format!("line {}: [schedul] unknown section — did you mean [schedule]?", line("[schedul]")),
                "[train] max_steps is missing".into(),
                "[lora] rank is missing".into(),
            ]
        );
        // Printed under the file's name, one a line.
        let e = ConfigFile::parse(&text, Path::new("c.toml")).unwrap_err().to_string();
        assert!(e.starts_with("c.toml: 7 problems:\n  line "), "{e}");
        assert_eq!(e.lines().count(), 8, "{e}");
        // A nested table's key: named in its table, at its line (not `factor is missing` too).
        let text = NANO.replace("[data]", "[model.rope_scaling]\ntype = \"linear\"\nfactr = 2.0\n\n[data]");
        let at = text.lines().position(|l| l == "factr = 2.0").unwrap() + 1;
        let want = format!("line {at}: [model.rope_scaling] unknown key \"factr\" — did you mean \"factor\"?");
        assert_eq!(problems(&text), [want]);
        // Sections that are not tables, keys at the top that belong in a section, no [data].
        let text = "init_from = 3\nmax_steps = 10\ntrain = 5\n";
        assert_eq!(
            problems(text),
            [
                "line 1: init_from: expected a string (`hf:DIR`, `run:DIR` or `gguf:FILE`), found integer",
                "line 2: unknown key \"max_steps\" — it belongs in [train]",
                "line 3: [train] must be a table (a [section] of keys), found integer",
                "[data] is missing: set `dataset` (a built-in name) or `path` (a text or JSONL file)",
            ]
        );
    }

    #[test]
    fn every_broken_rule_is_reported_at_once_at_its_line() {
        let text = NANO.replace("batch_size = 12", "batch_size = 0").replace("beta1 = 0.9", "beta1 = 1.5");
        let line = |needle: &str| text.lines().position(|l| l == needle).unwrap() + 1;
        assert_eq!(
            problems(&text),
            [
                format!("line {}: train.batch_size must be at least 1, found 0", line("batch_size = 0")),
                format!("line {}: optim.beta1 must be in [0, 1), found 1.5", line("beta1 = 1.5")),
            ]
        );
        // One alone reads as it always has.
        let e = parse_err(&NANO.replace("batch_size = 12", "batch_size = 0"));
        assert_eq!(e, "c.toml: train.batch_size must be at least 1, found 0");
    }

    /// NANO with every optional section, starting from a model it names and with adapters: a
    /// config that sets a key of every section.
    fn complete() -> String {
        format!(
            "init_from = \"run:/nonexistent\"\n{NANO}\n[lora]\nrank = 8\nalpha = 16.0\ntargets = [\"q_proj\"]\n\n\
             [eval]\ntasks = [\"piqa:4\"]\n\n[metrics]\nsample_tokens = 0\n\n[distributed]\nbucket_mib = 25\n"
        )
    }

    #[test]
    fn the_required_keys_are_those_parsing_cannot_do_without() {
        let text = complete();
        ConfigFile::parse(&text, Path::new("c.toml")).unwrap();
        let mut section = None;
        let mut seen = 0;
        for (i, line) in text.lines().enumerate() {
            if let Some(h) = line.strip_prefix('[') {
                section = h.strip_suffix(']');
                continue;
            }
            let Some((key, _)) = line.split_once(" = ") else { continue };
            let (Some(s), false) = (section, line.starts_with('#')) else { continue };
            let without: Vec<&str> = text.lines().enumerate().filter(|&(j, _)| j != i).map(|(_, l)| l).collect();
            let result = ConfigFile::parse(&without.join("\n"), Path::new("c.toml"));
            let required = REQUIRED.iter().any(|(rs, keys)| *rs == s && keys.contains(&key));
            match result {
                Err(TrainError::Problems { problems, .. }) => {
                    assert!(required, "[{s}] {key} left out: {problems:?}");
                    assert_eq!(problems.len(), 1);
                    assert_eq!(problems[0].to_string(), format!("[{s}] {key} is missing"));
                }
                other => assert!(!required, "[{s}] {key} is listed as required, but without it: {other:?}"),
            }
            seen += 1;
        }
        assert!(seen > 30, "{seen} keys tried");
        // Every required key was tried.
        for (s, keys) in REQUIRED {
            for k in *keys {
                assert!(text.contains(&format!("\n{k} = ")), "[{s}] {k} is not in the complete config");
            }
        }
    }

    #[test]
    fn defaults_fill_what_a_minimal_config_leaves_out() {
        let minimal =
            "init_from = \"run:/m\"\n[data]\npath = \"chat.jsonl\"\n[train]\nbatch_size = 4\nmax_steps = 200\n";
        let lora = format!("{minimal}[lora]\nrank = 8\nalpha = 16\n");
        let c = ConfigFile::parse(&lora, Path::new("c.toml")).unwrap().config;
        assert_eq!((c.schedule.lr, c.schedule.warmup_steps, c.schedule.min_lr), (2e-4, 10, 0.0));
        assert_eq!((c.train.eval_interval, c.train.eval_iters, c.train.seq_len), (20, 20, None));
        assert_eq!((c.optim.beta1, c.optim.beta2, c.optim.eps), (0.9, 0.95, 1e-8));
        let c = ConfigFile::parse(minimal, Path::new("c.toml")).unwrap().config;
        assert_eq!(c.schedule.lr, super::super::defaults::LR_FULL);
        // Written keys win, and the warmup follows decay_steps.
        let text = format!("{minimal}eval_interval = 7\n[schedule]\nlr = 1e-3\ndecay_steps = 100\n");
        let c = ConfigFile::parse(&text, Path::new("c.toml")).unwrap().config;
        assert_eq!((c.train.eval_interval, c.schedule.lr, c.schedule.warmup_steps), (7, 1e-3, 5));
        // From scratch; a 5-step run evaluates every step.
        let text = NANO
            .replace("lr = 1e-3", "")
            .replace("eval_interval = 250", "")
            .replace("max_steps = 2000", "max_steps = 5");
        let c = parse(&text.replace("decay_steps = 2000", "").replace("warmup_steps = 100", "")).unwrap();
        assert_eq!((c.schedule.lr, c.train.eval_interval, c.schedule.warmup_steps), (6e-4, 1, 0));
        // The resolved config names every default it took.
        let saved = c.to_toml();
        assert!(saved.contains("lr = 0.0006") && saved.contains("eval_interval = 1"), "{saved}");
    }

    /// Issue 57: the minimal LoRA config (a source, the data, a rank, a length) was refused for
    /// its batch size and alpha. What it leaves out is filled in, and listed for the log.
    #[test]
    fn a_minimal_fine_tune_needs_a_source_the_data_a_rank_and_a_length() {
        let minimal =
            "init_from = \"gguf:m.gguf\"\n[data]\npath = \"chat.jsonl\"\n[lora]\nrank = 8\n[train]\nmax_steps = 20\n";
        let file = ConfigFile::parse(minimal, Path::new("c.toml")).unwrap();
        let applied: Vec<String> = file.defaults.iter().map(ToString::to_string).collect();
        assert_eq!(
            applied,
            [
                "[train] batch_size = 8 (default: Hugging Face Trainer's and TRL's per-device batch)",
                "[train] eval_interval = 2 (default: max_steps / 10)",
                "[lora] alpha = 16.0 (default: 2 × rank, an update scaled by 2)",
                "[lora] targets = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"] \
                 (default: every projection of the blocks)",
                "[schedule] lr = 0.0002 (default: LoRA)",
                "[schedule] warmup_steps = 1 (default: decay_steps / 20)",
            ]
        );
        let c = file.complete_with(ember_model::ModelConfig::tiny(0, 64)).unwrap();
        let lora = c.lora.as_ref().unwrap();
        assert_eq!((c.train.batch_size, lora.alpha, lora.targets.len()), (8, 16.0, 7));
        // Written keys win; alpha follows the rank.
        let text = minimal
            .replace("rank = 8", "rank = 4\ntargets = [\"q_proj\"]")
            .replace("max_steps", "batch_size = 2\nmax_steps");
        let c = ConfigFile::parse(&text, Path::new("c.toml")).unwrap();
        assert_eq!(c.defaults.iter().filter(|d| d.section != "schedule" && d.key != "eval_interval").count(), 1);
        let c = c.complete_with(ember_model::ModelConfig::tiny(0, 64)).unwrap();
        let lora = c.lora.as_ref().unwrap();
        assert_eq!((c.train.batch_size, lora.alpha, lora.targets.len()), (2, 8.0, 1));
        // A model whose MLP has no gate (GPT-2's) gets the six projections it has.
        let gpt2 =
            ember_model::ModelConfig { mlp: ember_model::MlpKind::Gelu, ..ember_model::ModelConfig::tiny(0, 64) };
        let c = ConfigFile::parse(minimal, Path::new("c.toml")).unwrap().complete_with(gpt2).unwrap();
        assert_eq!(c.lora.map(|l| l.targets.len()), Some(6));
        // The rate follows what is trained and how.
        let lr = |extra: &str| {
            let text = format!("{minimal}{extra}");
            ConfigFile::parse(&text, Path::new("c.toml")).unwrap_or_else(|e| panic!("{e}")).config.schedule.lr
        };
        assert_eq!(lr("[preference]\nmethod = \"dpo\"\n"), super::super::defaults::LR_PREFERENCE_LORA);
        assert_eq!(lr("[rl]\n[[rl.rewards]]\nkind = \"length\"\nlimit = 5\n"), super::super::defaults::LR_RL_LORA);
        let full = minimal.replace("[lora]\nrank = 8\n", "");
        let c = ConfigFile::parse(&format!("{full}[preference]\n"), Path::new("c.toml")).unwrap();
        assert_eq!(c.config.schedule.lr, super::super::defaults::LR_RL_FULL);
        let c = ConfigFile::parse(&full, Path::new("c.toml")).unwrap();
        assert_eq!((c.config.schedule.lr, c.config.lora), (super::super::defaults::LR_FULL, None));
    }

    #[test]
    fn a_length_in_epochs_becomes_steps_once_the_rows_are_known() {
        let minimal = "init_from = \"run:/m\"\n[data]\npath = \"chat.jsonl\"\n[train]\nbatch_size = 4\n";
        let epochs = format!("{minimal}num_epochs = 3\ngrad_accum_steps = 2\n");
        let mut c = ConfigFile::parse(&epochs, Path::new("c.toml")).unwrap().config;
        let pending = PendingLength { num_epochs: 3.0, eval_interval: true, warmup_steps: true };
        assert_eq!((c.pending, c.train.max_steps), (Some(pending), 0));
        // 1,000 rows, 16 a step on 2 ranks: ceil(3000 / 16) = 188 steps.
        c.resolve_epochs(1000, 2).unwrap();
        assert_eq!((c.train.max_steps, c.train.eval_interval, c.schedule.warmup_steps), (188, 18, 9));
        assert_eq!((c.pending, c.train.num_epochs), (None, None));
        let saved = toml::to_string(&c).unwrap();
        assert!(saved.contains("max_steps = 188\n") && !saved.contains("num_epochs"), "{saved}");
        // Keys the file gives are kept; a fraction of an epoch rounds up to whole steps.
        let text = format!("{minimal}num_epochs = 0.01\neval_interval = 7\n[schedule]\nwarmup_steps = 0\n");
        let mut c = ConfigFile::parse(&text, Path::new("c.toml")).unwrap().config;
        c.resolve_epochs(1000, 1).unwrap();
        assert_eq!((c.train.max_steps, c.train.eval_interval, c.schedule.warmup_steps), (3, 7, 0));
        // A warmup longer than the run is reported once the length is known.
        let text = format!("{minimal}num_epochs = 1\n[schedule]\nwarmup_steps = 50\n");
        let mut c = ConfigFile::parse(&text, Path::new("c.toml")).unwrap().config;
        let e = c.resolve_epochs(40, 1).unwrap_err().to_string();
        assert_eq!(e, "schedule.warmup_steps (50) must not exceed train.max_steps (10)");
        // One of the two lengths, for examples only, within bounds.
        let both = problems(&format!("{minimal}num_epochs = 2\nmax_steps = 10\n"));
        assert_eq!(
            both,
            ["line 6: [train] num_epochs and max_steps are both set: give one (max_steps follows from num_epochs)"]
        );
        assert_eq!(problems(minimal), ["[train] max_steps is missing"]);
        let text = NANO.replace("max_steps = 2000", "num_epochs = 2");
        let e = ConfigFile::parse(&text, Path::new("c.toml")).unwrap_err().to_string();
        assert!(e.contains("train.num_epochs = 2") && e.contains("JSONL"), "{e}");
        for bad in ["0", "-1", "nan", "2e6"] {
            let e = ConfigFile::parse(&format!("{minimal}num_epochs = {bad}\n"), Path::new("c.toml")).unwrap_err();
            assert!(e.to_string().contains("train.num_epochs"), "{bad}: {e}");
        }
    }

    #[test]
    fn seq_len_defaults_to_the_longest_example_within_a_cap() {
        let scratch = parse(NANO).unwrap();
        let text = format!("init_from = \"run:/m\"\n{}", NANO.replace("max_seq_len = 64", "max_seq_len = 8192"));
        let pretrained = ConfigFile::parse(&text, Path::new("c.toml")).unwrap().complete().unwrap();
        assert_eq!(pretrained.default_seq_len(Some(100)), 128);
        assert_eq!(pretrained.default_seq_len(Some(129)), 128, "129 tokens fill a row of 128 positions");
        assert_eq!(pretrained.default_seq_len(Some(130)), 192);
        assert_eq!(pretrained.default_seq_len(Some(1)), 64);
        assert_eq!(pretrained.default_seq_len(Some(100_000)), super::super::SEQ_LEN_CAP);
        assert_eq!(pretrained.default_seq_len(None), super::super::SEQ_LEN_CAP, "a text stream, from init_from");
        // A model the config describes: its own context is the bound.
        assert_eq!(scratch.default_seq_len(None), 64);
        assert_eq!(scratch.default_seq_len(Some(1000)), 64);
        assert_eq!(scratch.default_seq_len(Some(20)), 64);
    }

    /// The text of NANO without its `[model]` section, starting from `init_from`.
    fn without_model(init_from: &str) -> String {
        let (head, rest) = NANO.split_once("[model]").unwrap();
        let tail = &rest[rest.find("\n[").unwrap()..];
        format!("init_from = \"{init_from}\"\n{head}{tail}")
    }

    #[test]
    fn parsing_opens_nothing_and_resolving_opens_the_source() {
        // A source that does not exist: parsing never looks at it.
        let text = without_model("run:/nonexistent/ember-run");
        let file = ConfigFile::parse(&text, Path::new("c.toml")).unwrap();
        assert_eq!(file.config.model, None);
        assert_eq!(file.config.init_from, Some(InitSource::Run("/nonexistent/ember-run".into())));
        // Nor does reading it as a complete config: that is an error naming the key.
        let e = file.clone().complete().unwrap_err().to_string();
        assert!(e.starts_with("c.toml: model: ") && e.contains("init_from"), "{e}");
        // Resolving opens it, and says what is wrong with it.
        let e = file.resolve().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ember-run") && e.contains("no such file"), "{e}");
        // Rules that do not need the model are checked when parsing.
        let e = ConfigFile::parse(&text.replace("batch_size = 12", "batch_size = 0"), Path::new("c.toml"));
        assert!(e.unwrap_err().to_string().contains("train.batch_size must be at least 1, found 0"));
        // A GGUF file: the same, its path kept as written (made absolute by the run directory's copy).
        let text = without_model("gguf:/nonexistent/m.gguf");
        let file = ConfigFile::parse(&text, Path::new("c.toml")).unwrap();
        assert_eq!(file.config.init_from, Some(InitSource::Gguf("/nonexistent/m.gguf".into())));
        assert_eq!(InitSource::Gguf("m.gguf".into()).to_string(), "gguf:m.gguf");
        let e = file.resolve().unwrap_err().to_string();
        assert!(e.contains("gguf:/nonexistent/m.gguf") && e.contains("/nonexistent/m.gguf"), "{e}");
        let e = ConfigFile::parse(&without_model("gguf:"), Path::new("c.toml")).unwrap_err().to_string();
        assert!(e.contains("nor `gguf:FILE` (a GGUF model)"), "{e}");
    }
}
