//! Reading a config file: TOML syntax and unknown keys first (errors with the line, the column and
//! the dotted key), then the rules; writing the resolved config a run directory keeps; the
//! `init_from` source.

use std::path::{Path, PathBuf};

use ember_model::ModelConfig;

use super::TrainConfig;
use crate::error::TrainError;

/// A config file as written, parsed and checked without opening anything but itself. `model` is
/// `None` where `[model]` is left out for the `init_from` model's: [`ConfigFile::resolve`] opens
/// the source (once) and takes it from there.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub config: TrainConfig<Option<ModelConfig>>,
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
        let text = std::fs::read_to_string(path).map_err(TrainError::io(path))?;
        Self::parse_for(&text, path, purpose)
    }

    /// Syntax, keys and types, then every rule that does not need the model; errors name the file
    /// and the key.
    pub fn parse(text: &str, path: &Path) -> Result<Self, TrainError> {
        Self::parse_for(text, path, Purpose::Run)
    }

    pub fn parse_for(text: &str, path: &Path, purpose: Purpose) -> Result<Self, TrainError> {
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
        toml::from_str::<toml::Table>(text).map_err(syntax)?;
        let config: TrainConfig<Option<ModelConfig>> = toml::from_str(text).map_err(|e| TrainError::Config {
            path: path.into(),
            message: e.message().to_string(),
            key: toml_key(text, e.span()),
        })?;
        config.validate_sections_for(purpose).map_err(|error| TrainError::Invalid { path: path.into(), error })?;
        Ok(Self { path: path.into(), config })
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

    /// The config with the architecture `model`, checked against the rules that need it.
    pub fn complete_with(self, model: ModelConfig) -> Result<TrainConfig, TrainError> {
        let config = self.config.with_model(model);
        config.validate_model().map_err(|error| TrainError::Invalid { path: self.path, error })?;
        Ok(config)
    }
}

impl TrainConfig {
    /// Reads a complete config file (one with `[model]`, as every run directory's config.toml):
    /// nothing but the file is opened; errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self, TrainError> {
        ConfigFile::read(path)?.complete()
    }

    pub fn from_toml(text: &str, path: &Path) -> Result<Self, TrainError> {
        ConfigFile::parse(text, path)?.complete()
    }

    /// Makes the paths of the config absolute (relative ones are relative to the working
    /// directory), so that the copy saved in a run directory works from anywhere.
    pub fn absolutize_paths(&mut self) {
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        if let Some(p) = &self.data.path {
            self.data.path = Some(abs(p));
        }
        if let Some(t) = &self.data.tokenizer {
            if t.ends_with(".json") {
                self.data.tokenizer = Some(abs(Path::new(t)).display().to_string());
            }
        }
        self.init_from = self.init_from.as_ref().map(InitSource::absolute);
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serialises")
    }
}

/// The dotted key at a TOML error position: the section header above it and the key on its line.
fn toml_key(text: &str, span: Option<std::ops::Range<usize>>) -> Option<String> {
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
}

impl TryFrom<String> for InitSource {
    type Error = String;
    /// The TOML error names the key; this says what is wrong with the value.
    fn try_from(spec: String) -> Result<Self, String> {
        Self::parse(&spec).map_err(|_| {
            format!("\"{spec}\" is neither `hf:DIR` (a Hugging Face folder) nor `run:DIR` (an ember run or checkpoint)")
        })
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
        }
    }

    pub fn parse(spec: &str) -> Result<Self, TrainError> {
        match spec.split_once(':') {
            Some(("hf", dir)) if !dir.is_empty() => Ok(Self::Hf(dir.into())),
            Some(("run", dir)) if !dir.is_empty() => Ok(Self::Run(dir.into())),
            _ => Err(TrainError::InitFrom {
                spec: spec.into(),
                message: "expected `hf:DIR` (a Hugging Face folder) or `run:DIR` (an ember run or checkpoint)".into(),
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
    use crate::config::tests::{parse, NANO};

    #[test]
    fn an_unknown_key_is_named_with_its_section() {
        let text = NANO.replace("n_layers = 4", "n_layers = 4\nn_kv_head = 2");
        let e = parse(&text).unwrap_err();
        assert!(e.contains("unknown field `n_kv_head`"), "{e}");
        assert!(e.contains("model.n_kv_head"), "{e}");
        assert!(e.starts_with("c.toml"), "{e}");
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
    }
}
