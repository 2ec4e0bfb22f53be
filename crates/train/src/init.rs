//! Where a fine-tuning run starts: `init_from = "hf:DIR"` (a Hugging Face model folder) or
//! `init_from = "run:DIR"` (an ember run directory or checkpoint, e.g. one made by `ember import`).

use std::path::PathBuf;

use burn::tensor::{DType, Device};
use ember_model::{Decoder, ModelConfig};

use crate::checkpoint::Checkpoint;
use crate::error::TrainError;

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

    /// The architecture of the starting model.
    pub fn model_config(&self) -> Result<ModelConfig, TrainError> {
        match self {
            Self::Hf(dir) => {
                let path = dir.join("config.json");
                let text = std::fs::read_to_string(&path).map_err(TrainError::io(&path))?;
                let json: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| self.err(format!("{}: {e}", path.display())))?;
                Ok(ember_hf::to_model_config(&json, &path.display().to_string())
                    .map_err(|e| self.err(e.to_string()))?
                    .0)
            }
            Self::Run(dir) => Ok(Checkpoint::open(dir)?.model_config),
        }
    }

    /// The folder whose tokenizer.json (and chat template) the run uses.
    pub fn tokenizer_dir(&self) -> Result<PathBuf, TrainError> {
        let dir = match self {
            Self::Hf(dir) => dir.clone(),
            Self::Run(dir) => Checkpoint::open(dir)?.dir,
        };
        if !dir.join("tokenizer.json").is_file() {
            return Err(self.err(format!("{}: no tokenizer.json", dir.display())));
        }
        Ok(dir)
    }

    /// The starting weights, as f32 parameters.
    pub fn load<B: ember_model::ops::EmberBackend>(&self, device: &Device<B>) -> Result<Decoder<B>, TrainError> {
        match self {
            Self::Hf(dir) => Ok(ember_hf::import::<B>(dir, DType::F32, false, false, device)
                .map_err(|e| self.err(e.to_string()))?
                .model),
            Self::Run(dir) => Checkpoint::open(dir)?.decoder::<B>(device),
        }
    }

    /// The source's Hugging Face config.json, carried to exports.
    pub fn hf_config(&self) -> Option<serde_json::Value> {
        let path: PathBuf = match self {
            Self::Hf(dir) => dir.join("config.json"),
            Self::Run(dir) => Checkpoint::open(dir).ok()?.dir.join(crate::checkpoint::HF_CONFIG_FILE),
        };
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
    }
}
