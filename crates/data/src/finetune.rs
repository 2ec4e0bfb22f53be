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

mod jinja;
mod template;
pub mod tool_text;

pub use template::ChatTemplate;
pub use tool_text::ToolText;

/// One chat turn. It reaches the chat template as Hugging Face's conversations have it: `role`
/// and `content`, and only where set `tool_calls` (an assistant turn's calls, each
/// `{"id", "type": "function", "function": {"name", "arguments": {...}}}`), `tool_call_id` and
/// `name` (a `tool` turn's answer to a call). Templates test `'tool_calls' in message` and
/// `message.tool_calls is defined`, so a field left unset is absent, never empty.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, serde::Serialize)]
pub struct Message {
    pub role: String,
    /// Empty for an assistant turn that only calls tools.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), ..Self::default() }
    }

    /// An assistant turn calling tools, with the text it wrote beside the calls (often none).
    pub fn calls(content: impl Into<String>, tool_calls: Vec<ToolCall>) -> Self {
        Self { tool_calls, ..Self::new("assistant", content) }
    }

    /// A `tool` turn: the result of the call `tool_call_id`.
    pub fn tool_result(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self { tool_call_id: Some(tool_call_id.into()), ..Self::new("tool", content) }
    }
}

/// `content: null` (an assistant turn that only calls tools) read as empty text.
fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// One call of a tool (a function) by the assistant.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The id a `tool` turn's `tool_call_id` answers (OpenAI's `call_...`; Mistral's templates
    /// want 9 letters and digits).
    pub id: String,
    pub name: String,
    /// A JSON object: the arguments by name.
    pub arguments: Value,
}

impl ToolCall {
    /// The call as OpenAI's API writes it in a response: the arguments as a string of JSON.
    pub fn openai_json(&self) -> Value {
        serde_json::json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments.to_string()},
        })
    }

    /// A call as OpenAI's API and Hugging Face's datasets write it: `{"id", "type": "function",
    /// "function": {"name", "arguments"}}`, the arguments an object or a string of JSON holding
    /// one (OpenAI's way). A missing `id` is empty and missing arguments are `{}`. `place` names
    /// the call in errors (`messages[2].tool_calls[0]`).
    pub fn read(value: &Value, place: &str) -> std::result::Result<Self, ToolCallError> {
        let Value::Object(call) = value else {
            return Err(ToolCallError::NotCall { place: place.into(), found: json_type(value) });
        };
        let string =
            |object: &serde_json::Map<String, Value>, place: String, field: &'static str| match object.get(field) {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                None | Some(Value::Null) => Ok(None),
                Some(other) => Err(ToolCallError::NotString { place, field, found: json_type(other) }),
            };
        let id = string(call, place.into(), "id")?.unwrap_or_default();
        let place = format!("{place}.function");
        let function = match call.get("function") {
            Some(Value::Object(f)) => f,
            Some(other) => return Err(ToolCallError::NotCall { place, found: json_type(other) }),
            None => return Err(ToolCallError::Missing { place, field: "name" }),
        };
        let name = string(function, place.clone(), "name")?
            .filter(|n| !n.is_empty())
            .ok_or_else(|| ToolCallError::Missing { place: place.clone(), field: "name" })?;
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => Value::Object(Default::default()),
            Some(Value::Object(_)) => function["arguments"].clone(),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                _ => return Err(ToolCallError::Arguments { place, found: "a string that is not a JSON object" }),
            },
            Some(other) => return Err(ToolCallError::Arguments { place, found: json_type(other) }),
        };
        Ok(Self { id, name, arguments })
    }
}

/// A tool call that is not `{"id", "type": "function", "function": {"name", "arguments"}}`;
/// `place` names it (`messages[2].tool_calls[0]`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolCallError {
    #[error("{place}: expected a tool call {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}, found {found}")]
    NotCall { place: String, found: &'static str },
    #[error("{place}.{field}: expected a string, found {found}")]
    NotString { place: String, field: &'static str, found: &'static str },
    #[error("{place}.{field} is missing")]
    Missing { place: String, field: &'static str },
    #[error("{place}.arguments: expected a JSON object (or a string holding one), found {found}")]
    Arguments { place: String, found: &'static str },
}

/// Hugging Face's shape, which chat templates read: `tool_call.function.name` and
/// `tool_call.function.arguments` (an object: templates write it with `tojson`).
impl serde::Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        #[derive(serde::Serialize)]
        struct Function<'a> {
            name: &'a str,
            arguments: &'a Value,
        }
        let mut map = s.serialize_map(Some(3))?;
        map.serialize_entry("id", &self.id)?;
        map.serialize_entry("type", "function")?;
        map.serialize_entry("function", &Function { name: &self.name, arguments: &self.arguments })?;
        map.end()
    }
}

impl<'de> Deserialize<'de> for ToolCall {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        Self::read(&value, "tool_call").map_err(serde::de::Error::custom)
    }
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
    /// A chat row's `tools`: the functions the assistant may call, each an OpenAI tool
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`, given to the
    /// chat template as `tools` (as TRL does). Empty for most rows.
    pub tools: Vec<Value>,
}

impl From<Body> for Record {
    /// An example made in memory (no line, no tools).
    fn from(body: Body) -> Self {
        Record { body, line: 0, tools: Vec::new() }
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
        let tools = match v.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(tools)) if tools.iter().all(Value::is_object) => tools.clone(),
            Some(other) => {
                let found =
                    if other.is_array() { "a list holding something other than objects" } else { json_type(other) };
                return Err(bad(i + 1, format!("tools: expected a list of tool objects {{\"type\": \"function\", \"function\": {{...}}}}, found {found}")));
            }
        };
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
        out.push(Record { body, line: i + 1, tools });
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
    #[error("{place}.tool_calls: expected a list of tool calls, found {found}")]
    NotCalls { place: String, found: &'static str },
    #[error(transparent)]
    ToolCall(#[from] ToolCallError),
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

/// A chat message, `{"role", "content"}` of two strings, with an assistant turn's `tool_calls`
/// (then `content` may be missing or null) and a tool turn's `tool_call_id` and `name` (other keys
/// are not read); the error names the message (`place`: `prompt[1]`) and its field.
fn message_of(value: &Value, place: &str) -> std::result::Result<Message, TurnsError> {
    let Value::Object(m) = value else {
        return Err(TurnsError::NotMessage { place: place.into(), found: json_type(value) });
    };
    let has_calls = m.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty());
    let field = |field: &'static str| match m.get(field) {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(_)) if field == "content" => Err(TurnsError::ContentParts { place: place.into() }),
        // Optional: a tool turn's fields, and the text of an assistant turn that calls tools.
        None | Some(Value::Null) if field != "role" && (field != "content" || has_calls) => Ok(None),
        Some(other) => Err(TurnsError::NotString { place: place.into(), field, found: json_type(other) }),
        None => Err(TurnsError::Missing { place: place.into(), field }),
    };
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(j, c)| ToolCall::read(c, &format!("{place}.tool_calls[{j}]")))
            .collect::<std::result::Result<_, _>>()?,
        Some(other) => return Err(TurnsError::NotCalls { place: place.into(), found: json_type(other) }),
    };
    let (role, content) = (field("role")?.unwrap_or_default(), field("content")?.unwrap_or_default());
    Ok(Message {
        tool_calls,
        tool_call_id: field("tool_call_id")?,
        name: field("name")?,
        ..Message::new(role, content)
    })
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
            Body::Chat(messages) => messages
                .iter()
                .filter(|m| m.role == "assistant")
                .all(|m| m.content.trim().is_empty() && m.tool_calls.is_empty()),
        }
    }
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
/// rendering including it is the scored part. A chat's tools and calls reach the template as in
/// [`ChatTemplate::render_conversation`], the server's rendering.
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
                    // Tools and calls the template cannot write are text in the messages, so the
                    // calls are in the assistant turns (scored) and the results in user turns.
                    let (messages, tools) = template.with_tools_written(messages, &r.tools);
                    let mut done = String::new();
                    for (i, m) in messages.iter().enumerate() {
                        let render = |upto: &[Message], open: bool| template.render_with_tools(upto, tools, open);
                        let before = if m.role == "assistant" { render(&messages[..i], true)? } else { done.clone() };
                        let after = render(&messages[..=i], false)?;
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
mod tests;
