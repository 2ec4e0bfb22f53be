use std::path::PathBuf;

/// Everything that can go wrong between a text file and a batch of token windows. Each variant names
/// the file, key or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: invalid manifest: {message}")]
    Manifest { path: PathBuf, message: String },
    #[error("unknown dataset `{name}` (built in: {known}); give a text file with `data.path` instead")]
    UnknownDataset { name: String, known: String },
    #[error("{path}: expected {expected} bytes, found {found}")]
    Size { path: PathBuf, expected: u64, found: u64 },
    #[error("{path}: sha256 is {found}, expected {expected} (a different or corrupted file)")]
    Checksum { path: PathBuf, expected: String, found: String },
    #[error(
        "dataset `{name}` not found and the download failed ({reason}).\n  \
         Put `{file}` (sha256 {sha256}) in one of:\n{places}"
    )]
    NotFound { name: String, file: String, sha256: String, reason: String, places: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{path}: cannot load tokenizer: {message}")]
    TokenizerFile { path: PathBuf, message: String },
    #[error("tokenizer spec `{0}`: expected `char`, `bpe`, `bpe:VOCAB` (VOCAB >= 257) or a path to a tokenizer.json")]
    TokenizerSpec(String),
    #[error("character {ch:?} at byte {offset} is not in the char-level vocabulary")]
    UnknownChar { ch: char, offset: usize },
    #[error("{path}: not an ember token shard: {message}")]
    Shard { path: PathBuf, message: String },
    #[error(
        "the {split} split has {tokens} tokens, fewer than the {needed} a window of seq_len + 1 needs; \
         use a longer text or a shorter context"
    )]
    TooShort { split: String, tokens: usize, needed: usize },
    #[error("{0}")]
    Download(String),
    #[error("{}:{line}: {message}", path.display())]
    Jsonl { path: PathBuf, line: usize, message: String },
    #[error(
        "fine-tuning example {index} has {tokens} tokens, more than the {window} a row of seq_len + 1 holds; \
         raise train.seq_len, or set data.truncate = true to cut long examples"
    )]
    ExampleTooLong { index: usize, tokens: usize, window: usize },
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> DataError {
        let path = path.into();
        move |err| DataError::Io { path, err }
    }
}

pub type Result<T, E = DataError> = std::result::Result<T, E>;
