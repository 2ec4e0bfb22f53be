//! Prompts for reinforcement learning: JSON lines of `{"prompt": …}` plus any columns a reward
//! reads (`{"prompt": "2 + 3 =", "answer": "5"}`), TRL's two formats: `prompt` as text, or as chat
//! messages (the conversation up to the turn the model answers). Tokenized as TRL's `GRPOTrainer`
//! does: text with the tokenizer's special-token template (a Llama tokenizer's `<s>` first), messages
//! through the chat template with the generation prompt.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{DataError, Result};
use crate::finetune::{json_lines, ChatTemplate};
use crate::preference::{turns_of, Turns};
use crate::tokenizer::Tokenizer;

/// One line of a prompt file: its prompt and the whole row (the rewards' columns).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRecord {
    pub prompt: Turns,
    pub row: Map<String, Value>,
    /// The line of the file it was read from, from 1.
    pub line: usize,
}

/// Reads a prompt file: every line an object with `prompt` (a string or a non-empty list of
/// messages); the other keys are kept as they are.
pub fn read_prompt_jsonl(path: &Path) -> Result<Vec<PromptRecord>> {
    let bad = |line: usize, message: String| DataError::Jsonl { path: path.into(), line, message };
    let mut out = Vec::new();
    for (i, v) in json_lines(path)? {
        let line = i + 1;
        let Value::Object(row) = v else {
            return Err(bad(line, "expected an object with a \"prompt\"".into()));
        };
        let prompt = match row.get("prompt") {
            Some(value) => turns_of(value, "prompt").map_err(|m| bad(line, m.to_string()))?,
            None => {
                return Err(bad(line, "prompt is missing: expected {\"prompt\": …} and the rewards' columns".into()))
            }
        };
        match &prompt {
            Turns::Text(t) if t.is_empty() => return Err(bad(line, "prompt is empty".into())),
            Turns::Chat(m) if m.is_empty() => return Err(bad(line, "prompt is an empty list of messages".into())),
            _ => {}
        }
        out.push(PromptRecord { prompt, row, line });
    }
    if out.is_empty() {
        return Err(bad(0, "no prompts".into()));
    }
    Ok(out)
}

/// A tokenized prompt: its ids, its text as the model reads it (messages rendered) and its row.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub text: String,
    pub row: Map<String, Value>,
    /// The file and line the prompt comes from, for messages.
    pub file: std::sync::Arc<std::path::Path>,
    pub line: usize,
}

/// Tokenizes the prompts as TRL does (module docs); messages need the model's template.
pub fn encode_prompts(
    records: &[PromptRecord],
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    file: &std::path::Path,
) -> Result<Vec<Prompt>> {
    let path = file;
    let file: std::sync::Arc<std::path::Path> = file.into();
    records
        .iter()
        .map(|r| {
            let encoded = || -> Result<(String, Vec<u32>)> {
                Ok(match &r.prompt {
                    Turns::Text(t) => (t.clone(), tokenizer.encode_with_special(t)?),
                    Turns::Chat(messages) => {
                        let template = template.ok_or_else(|| {
                            DataError::Tokenizer(
                                "chat messages need a chat template (tokenizer_config.json `chat_template` or \
                                 chat_template.jinja)"
                                    .into(),
                            )
                        })?;
                        let text = template.render(messages, true)?;
                        let ids = tokenizer.encode(&text)?;
                        (text, ids)
                    }
                })
            };
            let (text, ids) =
                encoded().map_err(|e| DataError::Jsonl { path: path.into(), line: r.line, message: e.to_string() })?;
            Ok(Prompt { ids, text, row: r.row.clone(), file: file.clone(), line: r.line })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn rows_keep_their_columns_and_bad_lines_are_named() {
        let f = file("{\"prompt\": \"1 + 1 =\", \"answer\": \"2\", \"level\": 3}\n\n{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
        let records = read_prompt_jsonl(f.path()).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].row["answer"], "2");
        assert_eq!(records[0].prompt, Turns::Text("1 + 1 =".into()));
        assert_eq!(records[1].line, 3);
        assert!(matches!(records[1].prompt, Turns::Chat(ref m) if m.len() == 1));
        for (text, want) in [
            ("{\"answer\": 1}\n", ":1: prompt is missing"),
            ("{\"prompt\": 5}\n", ":1: prompt: expected a string"),
            ("{\"prompt\": \"\"}\n", "prompt is empty"),
            ("{\"prompt\": []}\n", "empty list of messages"),
            ("{\"prompt\": \"a\"}\n[1]\n", ":2: expected an object"),
            ("{\"prompt\": [{\"role\": \"bot\", \"content\": \"x\"}]}\n", "`bot` is not one of"),
        ] {
            let err = read_prompt_jsonl(file(text).path()).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
