use std::path::PathBuf;

/// What keeps a row of a task's file from being one of its items.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DocError {
    /// A field missing, or of another type.
    #[error("field `{field}`: expected {expected}")]
    Field { field: String, expected: &'static str },
    /// A field of the right type whose value the task cannot use.
    #[error("field `{field}`: {found}, expected {expected}")]
    Value { field: &'static str, found: String, expected: String },
    /// The right answer's index past the choices.
    #[error("answer index {gold} of {choices} choices")]
    Gold { gold: usize, choices: usize },
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}{}: {message}", path.display(), if *line > 0 { format!(" line {line}") } else { String::new() })]
    Data { path: PathBuf, line: usize, message: String },
    #[error("no evaluation folder: give --eval-dir DIR or set EMBER_EVAL_DIR (laid out as shared/evals: hellaswag/hellaswag_val.jsonl, …)")]
    NoEvalDir,
    #[error("unknown task `{name}`; known tasks: {known}")]
    UnknownTask { name: String, known: String },
    #[error("`{0}`: the count after `:` must be a whole number of items")]
    Limit(String),
    #[error("task {task}: {message}")]
    Task { task: String, message: String },
    #[error("generating: {0}")]
    Generate(String),
    #[error("tokenizing: {0}")]
    Tokenizer(#[from] ember_data::DataError),
}
