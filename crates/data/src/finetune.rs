//! Fine-tuning data: JSON lines of `{"prompt", "completion"}`, `{"messages": [...]}` (rendered with
//! the tokenizer's chat template) or `{"text"}`, tokenized with a loss mask so that only completion
//! (assistant) tokens are scored, and packed into full context windows.
//!
//! Three ways to put examples into rows of `seq_len` positions ([`Packing`]):
//! - `documents` (the default): whole examples side by side, each marked as its own document, so that
//!   the model restarts positions and attends only within an example (block-diagonal causal): an
//!   example's loss is the one it has alone, whatever is packed before it.
//! - `stream`: the examples concatenated and cut into rows of `seq_len + 1` tokens; attention runs
//!   across example boundaries and positions continue (TRL's old `ConstantLengthDataset`).
//! - `none`: one example per row, padded.

use std::path::Path;

use burn::data::dataset::Dataset;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{DataError, Result};
use crate::loader::Window;
use crate::tokenizer::Tokenizer;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The roles chat templates know (Hugging Face's conventions): a message's role is one of these.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// One row of a fine-tuning file, and its line there.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub body: Body,
    /// The line of the file it was read from, 1-based as editors count (blank lines included);
    /// 0 for an example made in memory. Errors about the example name it.
    pub line: usize,
}

impl From<Body> for Record {
    /// An example made in memory (no line).
    fn from(body: Body) -> Self {
        Record { body, line: 0 }
    }
}

/// What a row of a fine-tuning file holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// Scored whole.
    Text(String),
    /// Only the completion is scored.
    Completion { prompt: String, completion: String },
    /// Only assistant turns are scored.
    Chat(Vec<Message>),
}

/// Bytes of one JSONL line at most: far past any context window, and well short of what tokenizing
/// it would take (tens of bytes of memory per byte of text).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Reads a JSON-lines file; a bad line is an error naming the file and line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Record>> {
    let bad = |line: usize, message: String| DataError::Jsonl { path: path.into(), line, message };
    let mut out = Vec::new();
    let rows = json_lines(path)?;
    // The file line of its first row (blank lines before it counted), for errors about the whole.
    let first_line = rows.first().map_or(1, |(i, _)| i + 1);
    for (i, v) in rows {
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(String::from);
        let body = if let Some(m) = v.get("messages") {
            let Value::Array(items) = m else {
                let found = json_type(m);
                return Err(bad(
                    i + 1,
                    format!("messages: expected a list of {{\"role\", \"content\"}}, found {found}"),
                ));
            };
            let messages = messages_of(items, "messages").map_err(|e| bad(i + 1, e.to_string()))?;
            if !messages.iter().any(|m| m.role == "assistant") {
                return Err(bad(i + 1, "messages without an assistant turn: nothing to learn".into()));
            }
            Body::Chat(messages)
        } else if let (Some(prompt), Some(completion)) = (s("prompt"), s("completion")) {
            Body::Completion { prompt, completion }
        } else if let Some(text) = s("text") {
            Body::Text(text)
        } else {
            return Err(bad(i + 1, "expected {\"prompt\", \"completion\"}, {\"messages\"} or {\"text\"}".into()));
        };
        out.push(Record { body, line: i + 1 });
    }
    // Examples whose completions are empty teach only the end-of-text token: all of them is a
    // mistake in the file (a misnamed key, an export gone wrong), some of them worth a word.
    let scored = out.iter().filter(|r| !matches!(r.body, Body::Text(_))).count();
    let empty = out.iter().filter(|r| r.completion_is_empty()).count();
    if empty > 0 && empty == scored && scored == out.len() {
        let message =
            format!("every example's completion is empty ({empty} of {scored}): only end-of-text would be learned");
        return Err(bad(first_line, message));
    }
    if empty > 0 {
        tracing::warn!(
            "{}: {empty} of {scored} examples have an empty completion: they teach only end-of-text",
            path.display()
        );
    }
    Ok(out)
}

/// The JSON values of a JSON-lines file with their 0-based line numbers (blank lines skipped); a
/// line too long or not JSON is an error naming the file and line.
pub fn json_lines(path: &Path) -> Result<Vec<(usize, Value)>> {
    let text = crate::read_file_to_string(path).map_err(DataError::io(path))?;
    let bad = |line: usize, message: String| DataError::Jsonl { path: path.into(), line, message };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        if line.len() > MAX_LINE_BYTES {
            let message = format!("a line of {} MiB; at most {} MiB", line.len() >> 20, MAX_LINE_BYTES >> 20);
            return Err(bad(i + 1, message));
        }
        out.push((i, serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?));
    }
    Ok(out)
}

/// A JSON value that is not the text or the chat messages a row's key must hold; `place` names
/// the key or the message (`prompt`, `messages[2]`). The caller adds the file and the line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum TurnsError {
    #[error("{place}: expected a string or a list of messages, found {found}")]
    NotTurns { place: String, found: &'static str },
    #[error("{place}: expected a message {{\"role\", \"content\"}}, found {found}")]
    NotMessage { place: String, found: &'static str },
    #[error("{place}.content: expected a string, found a list (of parts?): give the text as one string")]
    ContentParts { place: String },
    #[error("{place}.{field}: expected a string, found {found}")]
    NotString { place: String, field: &'static str, found: &'static str },
    #[error("{place}.{field} is missing")]
    Missing { place: String, field: &'static str },
    #[error("{place}.role `{role}` is not one of {roles}", roles = ROLES.join(", "))]
    UnknownRole { place: String, role: String },
}

/// The chat messages of the list `items` at `key`, each of a known role; the error names the
/// message (`messages[2]`, `prompt[1]`) and its field.
pub(crate) fn messages_of(items: &[Value], key: &str) -> std::result::Result<Vec<Message>, TurnsError> {
    let messages = items
        .iter()
        .enumerate()
        .map(|(j, m)| message_of(m, &format!("{key}[{j}]")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if let Some((j, m)) = messages.iter().enumerate().find(|(_, m)| !ROLES.contains(&m.role.as_str())) {
        let role = m.role.escape_debug().to_string();
        return Err(TurnsError::UnknownRole { place: format!("{key}[{j}]"), role });
    }
    Ok(messages)
}

/// A chat message, `{"role", "content"}` of two strings (other keys are not read); the error names
/// the message (`place`: `prompt[1]`) and its field.
fn message_of(value: &Value, place: &str) -> std::result::Result<Message, TurnsError> {
    let Value::Object(m) = value else {
        return Err(TurnsError::NotMessage { place: place.into(), found: json_type(value) });
    };
    let field = |field: &'static str| match m.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(_)) if field == "content" => Err(TurnsError::ContentParts { place: place.into() }),
        Some(other) => Err(TurnsError::NotString { place: place.into(), field, found: json_type(other) }),
        None => Err(TurnsError::Missing { place: place.into(), field }),
    };
    Ok(Message { role: field("role")?, content: field("content")? })
}

/// The JSON type of `v`, in words.
pub(crate) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl Record {
    /// Whether the text to learn is empty: a blank completion, or assistant turns all blank.
    fn completion_is_empty(&self) -> bool {
        match &self.body {
            Body::Text(_) => false,
            Body::Completion { completion, .. } => completion.trim().is_empty(),
            Body::Chat(messages) => {
                messages.iter().filter(|m| m.role == "assistant").all(|m| m.content.trim().is_empty())
            }
        }
    }
}

/// A Hugging Face chat template (Jinja), rendered with minijinja and Python-compatible methods.
pub struct ChatTemplate {
    /// The environment holding the compiled template, as `chat`.
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
    roles: Vec<String>,
}

impl ChatTemplate {
    /// The template of a tokenizer folder: `chat_template.jinja`, or `chat_template` in
    /// `tokenizer_config.json`. `None` when the folder has neither.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(t) => {
                serde_json::from_str(&t).map_err(|e| DataError::Tokenizer(format!("{}: {e}", config_path.display())))?
            }
            Err(_) => Value::Null,
        };
        let token = |k: &str| match config.get(k) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
            _ => String::new(),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(s) => s,
            Err(_) => match config.get("chat_template").and_then(Value::as_str) {
                Some(s) => s.to_string(),
                None => return Ok(None),
            },
        };
        Self::new(source, token("bos_token"), token("eos_token")).map(Some)
    }

    /// Compiles `source` (once; a syntax error is reported here) with the BOS and EOS strings that
    /// templates read as `bos_token` and `eos_token`.
    pub fn new(source: String, bos: String, eos: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let roles = ROLES
            .iter()
            .filter(|&&r| r != "tool" || source.contains("'tool'") || source.contains("\"tool\""))
            .map(|r| r.to_string())
            .collect();
        env.add_template_owned("chat", source).map_err(template_error)?;
        Ok(Self { env, bos, eos, roles })
    }

    /// The roles a message may have: system, user and assistant, and `tool` where the template
    /// names it.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let err = template_error;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        };
        self.env.get_template("chat").map_err(err)?.render(ctx).map_err(err)
    }
}

fn template_error(e: minijinja::Error) -> DataError {
    DataError::Tokenizer(format!("chat template: {e:#}"))
}

/// Token ids of one example and which of them are scored.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub scored: Vec<bool>,
}

impl Example {
    fn push(&mut self, ids: Vec<u32>, scored: bool) {
        self.scored.extend(std::iter::repeat_n(scored, ids.len()));
        self.ids.extend(ids);
    }
}

/// Tokenizes the records of the file `path` ([`encode`]); an error names the file and the
/// record's line: `data.jsonl:7: tokenizer: chat template: …`.
pub fn encode_of_file(
    path: &Path,
    records: &[Record],
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Vec<Example>> {
    records
        .iter()
        .map(|r| {
            encode(std::slice::from_ref(r), tokenizer, template)
                .map(|mut one| one.remove(0))
                .map_err(|e| DataError::Jsonl { path: path.into(), line: r.line, message: e.to_string() })
        })
        .collect()
}

/// Tokenizes records. Chats are rendered turn by turn so that the text of each assistant turn is
/// known: the difference between the rendering up to the turn (with the generation prompt) and the
/// rendering including it is the scored part.
pub fn encode(records: &[Record], tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> Result<Vec<Example>> {
    let eos = tokenizer.eos_id();
    records
        .iter()
        .map(|r| {
            let mut ex = Example { ids: Vec::new(), scored: Vec::new() };
            match &r.body {
                Body::Text(t) => ex.push(tokenizer.encode_with_special(t)?, true),
                Body::Completion { prompt, completion } => {
                    ex.push(tokenizer.encode_with_special(prompt)?, false);
                    ex.push(tokenizer.encode(completion)?, true);
                }
                Body::Chat(messages) => {
                    let template = template.ok_or_else(|| {
                        DataError::Tokenizer("chat messages need a chat template (tokenizer_config.json `chat_template` or chat_template.jinja)".into())
                    })?;
                    let mut done = String::new();
                    for (i, m) in messages.iter().enumerate() {
                        let before = if m.role == "assistant" { template.render(&messages[..i], true)? } else { done.clone() };
                        let after = template.render(&messages[..=i], false)?;
                        let (head, tail) = (before.strip_prefix(done.as_str()).unwrap_or(&before), after.strip_prefix(before.as_str()));
                        ex.push(tokenizer.encode(head)?, false);
                        match tail {
                            Some(tail) => ex.push(tokenizer.encode(tail)?, m.role == "assistant"),
                            None => ex.push(tokenizer.encode(after.strip_prefix(done.as_str()).unwrap_or(&after))?, false),
                        }
                        done = after;
                    }
                    // The template may end the last turn with the end-of-sequence token already,
                    // perhaps followed by a newline (ChatML's `<|im_end|>\n`): nothing to add then.
                    if eos.is_some_and(|e| ex.ids.iter().rev().take(3).any(|&i| i == e)) {
                        return Ok(ex);
                    }
                }
            }
            if let Some(eos) = eos {
                ex.push(vec![eos], true); // learning to stop is part of the completion
            }
            Ok(ex)
        })
        .collect()
}

/// How fine-tuning examples fill rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Packing {
    /// Whole examples side by side in a row, each attending only to itself from position 0.
    #[default]
    Documents,
    /// One token stream cut into rows; examples see the ones before them in the row.
    Stream,
    /// One example per row, padded.
    None,
}

impl std::fmt::Display for Packing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Packing::Documents => "documents",
            Packing::Stream => "stream",
            Packing::None => "none",
        })
    }
}

/// Rows of `seq_len` positions; a row's targets are `-1` where the token is not scored.
#[derive(Debug, Clone)]
pub struct PackedExamples {
    rows: Vec<Window>,
}

impl PackedExamples {
    /// Packs `examples` in order (see [`Packing`]); rows are padded with `pad` (unscored), and rows
    /// without a scored target are dropped. Under `documents` and `none` an example longer than a
    /// row (`seq_len + 1` tokens) is an error unless `truncate`, which keeps its first `seq_len + 1`.
    pub fn new(examples: &[Example], seq_len: usize, pad: u32, packing: Packing, truncate: bool) -> Result<Self> {
        let mut rows = match packing {
            Packing::Stream => Self::stream(examples, seq_len, pad),
            Packing::Documents | Packing::None => {
                let mut rows = Vec::new();
                let mut row = Window { input: Vec::new(), target: Vec::new(), docs: Some(Vec::new()) };
                for (index, e) in examples.iter().enumerate() {
                    let n = e.ids.len();
                    if n > seq_len + 1 && !truncate {
                        return Err(DataError::ExampleTooLong { index: index + 1, tokens: n, window: seq_len + 1 });
                    }
                    let n = n.min(seq_len + 1);
                    if n < 2 {
                        continue; // nothing to predict
                    }
                    let positions = n - 1;
                    if !row.input.is_empty() && (packing == Packing::None || row.input.len() + positions > seq_len) {
                        rows.push(Self::finish(std::mem::take(&mut row), seq_len, pad));
                    }
                    let docs = row.docs.get_or_insert_with(Vec::new);
                    docs.extend(std::iter::repeat_n(row.input.len() as u32, positions));
                    row.input.extend_from_slice(&e.ids[..positions]);
                    row.target.extend((1..n).map(|j| if e.scored[j] { e.ids[j] as i32 } else { -1 }));
                }
                if !row.input.is_empty() {
                    rows.push(Self::finish(row, seq_len, pad));
                }
                rows
            }
        };
        if packing == Packing::None {
            // One document per row: plain causal attention.
            rows.iter_mut().for_each(|w| w.docs = None);
        }
        rows.retain(|w| w.target.iter().any(|&t| t >= 0));
        Ok(Self { rows })
    }

    /// Pads a row of documents to `seq_len`; the padding is a document of its own.
    fn finish(mut row: Window, seq_len: usize, pad: u32) -> Window {
        let used = row.input.len();
        row.input.resize(seq_len, pad);
        row.target.resize(seq_len, -1);
        if let Some(docs) = row.docs.as_mut() {
            docs.resize(seq_len, used as u32);
        }
        row
    }

    fn stream(examples: &[Example], seq_len: usize, pad: u32) -> Vec<Window> {
        let (mut ids, mut scored) = (Vec::new(), Vec::new());
        for e in examples {
            ids.extend_from_slice(&e.ids);
            scored.extend_from_slice(&e.scored);
        }
        let mut rows = Vec::new();
        let mut start = 0;
        while start + 1 < ids.len() {
            let end = (start + seq_len + 1).min(ids.len());
            let mut input: Vec<u32> = ids[start..end - 1].to_vec();
            let mut target: Vec<i32> = (start + 1..end).map(|j| if scored[j] { ids[j] as i32 } else { -1 }).collect();
            input.resize(seq_len, pad);
            target.resize(seq_len, -1);
            rows.push(Window { input, target, docs: None });
            start += seq_len;
        }
        rows
    }

    /// Rows packed elsewhere, as one set.
    pub fn from_rows(rows: Vec<Window>) -> Self {
        Self { rows }
    }

    /// Scored target tokens over all rows.
    pub fn scored_tokens(&self) -> usize {
        self.rows.iter().map(|w| w.target.iter().filter(|&&t| t >= 0).count()).sum()
    }
}

impl Dataset<Window> for PackedExamples {
    fn get(&self, index: usize) -> Option<Window> {
        self.rows.get(index).cloned()
    }

    fn len(&self) -> usize {
        self.rows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn tokenizer() -> Tokenizer {
        Tokenizer::train_char("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ<>|_\n:?!.,")
    }

    #[test]
    fn jsonl_records_and_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(&p, "{\"prompt\": \"Q: hi\", \"completion\": \" A: ho\"}\n\n{\"text\": \"plain\"}\n").unwrap();
        let r = read_jsonl(&p).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1], Record { body: Body::Text("plain".into()), line: 3 }, "blank lines counted");
        std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \"y\"}\n{\"question\": 1}\n").unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:2:") && e.contains("expected {\"prompt\""), "{e}");
        std::fs::write(&p, "{not json\n").unwrap();
        assert!(read_jsonl(&p).unwrap_err().to_string().contains("d.jsonl:1:"));
        let chat = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "ho"}]}"#;
        std::fs::write(&p, format!("{chat}\n")).unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:1:") && e.contains("messages[1].role `wizard`"), "{e}");
        std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \" \"}\n{\"prompt\": \"y\", \"completion\": \"\"}\n")
            .unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("every example's completion is empty (2 of 2)"), "{e}");
        // Named at the first row's line, blank lines before it counted.
        std::fs::write(&p, "\n{\"prompt\": \"x\", \"completion\": \"\"}\n").unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:2: every example's completion is empty (1 of 1)"), "{e}");
        std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \"z\"}\n{\"prompt\": \"y\", \"completion\": \"\"}\n")
            .unwrap();
        assert_eq!(read_jsonl(&p).unwrap().len(), 2, "some empty completions: a warning");
    }

    /// Issue 57: a `messages` row was refused in serde's words (`invalid type: ... expected struct
    /// Message`), and an example the template refuses named neither the file nor the line.
    #[test]
    fn chat_rows_are_refused_in_words_at_their_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        let refused = |row: &str| {
            std::fs::write(&p, format!("\n{row}\n")).unwrap();
            read_jsonl(&p).unwrap_err().to_string()
        };
        let file = p.display().to_string();
        for (row, want) in [
            (r#"{"messages": 5}"#, r#"2: messages: expected a list of {"role", "content"}, found a number"#),
            (r#"{"messages": [7]}"#, r#"2: messages[0]: expected a message {"role", "content"}, found a number"#),
            (r#"{"messages": [{"role": "user"}]}"#, "2: messages[0].content is missing"),
            (
                r#"{"messages": [{"role": 1, "content": "a"}]}"#,
                "2: messages[0].role: expected a string, found a number",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
                "2: messages[0].content: expected a string, found a list (of parts?)",
            ),
        ] {
            let e = refused(row);
            assert!(e.starts_with(&format!("{file}:{want}")), "{row}: {e}");
        }
        // The template's own refusal, at the line of the row it refused.
        let strict = "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}\
                      {{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}";
        let template = ChatTemplate::new(strict.into(), String::new(), String::new()).unwrap();
        let ok = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}"#;
        let bad = r#"{"messages": [{"role": "assistant", "content": "ho"}, {"role": "user", "content": "hi"}]}"#;
        std::fs::write(&p, format!("{ok}\n\n{bad}\n")).unwrap();
        let records = read_jsonl(&p).unwrap();
        assert_eq!(records.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 3]);
        let e = encode_of_file(&p, &records, &tokenizer(), Some(&template)).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{file}:3: tokenizer: chat template: ")), "{e}");
        assert!(e.contains("Conversation roles must alternate"), "{e}");
        let e = encode_of_file(&p, &records, &tokenizer(), None).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{file}:1: tokenizer: chat messages need a chat template")), "{e}");
    }

    #[test]
    fn a_template_names_its_roles() {
        let plain = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
        assert_eq!(plain.roles(), ["system", "user", "assistant"]);
        let tools = format!("{{% if messages[0].role == 'tool' %}}{{% endif %}}{CHATML}");
        assert_eq!(ChatTemplate::new(tools, String::new(), String::new()).unwrap().roles().len(), 4);
    }

    #[test]
    fn only_completions_and_assistant_turns_are_scored() {
        let tok = tokenizer();
        let ex = encode(&[Body::Completion { prompt: "Q: hi".into(), completion: " A: ho".into() }.into()], &tok, None)
            .unwrap();
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        assert_eq!(scored, " A: ho");
        let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).unwrap();
        let chat: Record = Body::Chat(vec![
            Message { role: "user".into(), content: "hi".into() },
            Message { role: "assistant".into(), content: "ho".into() },
            Message { role: "user".into(), content: "why".into() },
            Message { role: "assistant".into(), content: "so".into() },
        ])
        .into();
        let ex = encode(&[chat], &tok, Some(&template)).unwrap();
        let all = tok.decode(&ex[0].ids).unwrap();
        assert_eq!(all, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nho<|im_end|>\n<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\nso<|im_end|>\n");
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        assert_eq!(scored, "ho<|im_end|>\nso<|im_end|>\n");
        assert!(encode(&[Body::Chat(vec![]).into()], &tok, None).is_err());
    }

    #[test]
    fn packing_fills_rows_and_masks_targets() {
        let ex = vec![
            Example { ids: vec![1, 2, 3, 4], scored: vec![false, false, true, true] },
            Example { ids: vec![5, 6, 7], scored: vec![false, true, true] },
        ];
        let p = PackedExamples::new(&ex, 3, 0, Packing::Stream, false).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p.get(0).unwrap(), Window { input: vec![1, 2, 3], target: vec![-1, 3, 4], docs: None });
        assert_eq!(p.get(1).unwrap(), Window { input: vec![4, 5, 6], target: vec![-1, 6, 7], docs: None });
        assert_eq!(p.scored_tokens(), 4);
    }

    #[test]
    fn document_packing_keeps_examples_whole_and_apart() {
        let ex = vec![
            Example { ids: vec![1, 2, 3, 4], scored: vec![false, false, true, true] },
            Example { ids: vec![5, 6, 7], scored: vec![false, true, true] },
            Example { ids: vec![8, 9], scored: vec![true, true] },
            Example { ids: vec![10], scored: vec![true] }, // nothing to predict: skipped
        ];
        let p = PackedExamples::new(&ex, 6, 0, Packing::Documents, false).unwrap();
        assert_eq!(p.len(), 1);
        // 3 + 2 positions fit in a row of 6; the third example (1 position) fits too.
        assert_eq!(
            p.get(0).unwrap(),
            Window {
                input: vec![1, 2, 3, 5, 6, 8],
                target: vec![-1, 3, 4, 6, 7, 9],
                docs: Some(vec![0, 0, 0, 3, 3, 5])
            }
        );
        assert_eq!(p.scored_tokens(), 5);
        let p = PackedExamples::new(&ex, 4, 0, Packing::Documents, false).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            p.get(1).unwrap(),
            Window { input: vec![5, 6, 8, 0], target: vec![6, 7, 9, -1], docs: Some(vec![0, 0, 2, 3]) }
        );
        let none = PackedExamples::new(&ex, 6, 0, Packing::None, false).unwrap();
        assert_eq!(none.len(), 3);
        assert_eq!(
            none.get(2).unwrap(),
            Window { input: vec![8, 0, 0, 0, 0, 0], target: vec![9, -1, -1, -1, -1, -1], docs: None }
        );
        let e = PackedExamples::new(&ex, 2, 0, Packing::Documents, false).unwrap_err().to_string();
        assert!(e.contains("example 1 has 4 tokens") && e.contains("3"), "{e}");
        let cut = PackedExamples::new(&ex, 2, 0, Packing::Documents, true).unwrap();
        assert_eq!(cut.get(0).unwrap(), Window { input: vec![1, 2], target: vec![-1, 3], docs: Some(vec![0, 0]) });
    }
}
