use std::path::PathBuf;

/// What can go wrong reading or writing a Hugging Face model folder; each names the file and key.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{source_name}: {message}")]
    Config { source_name: String, message: String },
    #[error("{source_name}: missing field `{field}`")]
    MissingField { source_name: String, field: &'static str },
    /// A class no family has; `supported` lists the registered families' classes.
    #[error("{source_name}: architecture `{architecture}` is not supported ({supported} are)")]
    Unsupported { source_name: String, architecture: String, supported: String },
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("{index}: lists shard `{shard}`, which is missing")]
    MissingShard { index: PathBuf, shard: String },
    #[error("{file}: not a readable safetensors file ({message}); truncated or damaged?")]
    Safetensors { file: PathBuf, message: String },
    #[error("{file}: `{key}` has dtype {dtype}, expected a float type")]
    Dtype { file: PathBuf, key: String, dtype: String },
    #[error("{file}: `{key}`: expected shape {expected:?}, found {found:?}")]
    Shape { file: PathBuf, key: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{dir}: missing tensor(s) {} (pass --allow-missing to keep them at zero)", keys.join(", "))]
    Missing { dir: PathBuf, keys: Vec<String> },
    #[error("{dir}: tensor(s) {} match no ember parameter (pass --allow-unused to skip them)", keys.join(", "))]
    Unused { dir: PathBuf, keys: Vec<String> },
    #[error("this model cannot be written as {architecture}: {}", fields.join("; "))]
    Inexpressible { architecture: String, fields: Vec<String> },
    #[error("parameter `{0}` has no Hugging Face name (merge LoRA adapters before exporting)")]
    NoHfName(String),
    #[error("{0}: the output folder exists and is not empty; choose another --out")]
    OutputExists(PathBuf),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error("GGUF export: {0}")]
    GgufExport(String),
}

impl HfError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> HfError {
        let path = path.into();
        move |err| HfError::Io { path, err }
    }
}
