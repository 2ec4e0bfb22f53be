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
pub mod tool_text;

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

/// A Hugging Face chat template (Jinja), rendered with minijinja and Python-compatible methods.
pub struct ChatTemplate {
    /// The environment holding the compiled template, as `chat`.
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
    roles: Vec<String>,
    source: String,
    /// How it gets a conversation's tools, calls and their results (probed once, in `new`).
    tool_text: ToolText,
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
    /// templates read as `bos_token` and `eos_token`, in an environment that has what
    /// transformers adds to Jinja: `tojson` as Python writes JSON, `raise_exception`,
    /// `strftime_now`, `string` as Python's `str()` and the `{% generation %}` block (which only
    /// marks the assistant's text; it renders its body).
    pub fn new(source: String, bos: String, eos: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: &minijinja::Value| jinja::py_string(v));
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", jinja::strftime_now);
        let roles = ROLES
            .iter()
            .filter(|&&r| r != "tool" || source.contains("'tool'") || source.contains("\"tool\""))
            .map(|r| r.to_string())
            .collect();
        env.add_template_owned("chat", jinja::without_generation_tags(&source)).map_err(template_error)?;
        let mut template = Self { env, bos, eos, roles, source, tool_text: ToolText::InTemplate };
        template.tool_text = ToolText::of(&template);
        Ok(template)
    }

    /// How the template gets a conversation's tools, calls and their results: through it, or
    /// written as text where it cannot write them (see [`tool_text`]).
    pub fn tool_text(&self) -> ToolText {
        self.tool_text
    }

    /// `messages` and `tools` as [`ChatTemplate::render_conversation`] gives them to the template:
    /// what it cannot write written as text (see [`tool_text`]). For a caller that reworks the
    /// messages further before [`ChatTemplate::render_with_tools`].
    pub fn with_tools_written<'a>(
        &self,
        messages: &'a [Message],
        tools: &'a [Value],
    ) -> (std::borrow::Cow<'a, [Message]>, &'a [Value]) {
        self.tool_text.write(messages, tools)
    }

    /// A conversation with the functions the assistant may call, rendered as both the server
    /// and fine-tuning render it: through the template where it writes tools, calls and their
    /// results, and as text where it cannot (see [`tool_text`]).
    pub fn render_conversation(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let (messages, tools) = self.with_tools_written(messages, tools);
        self.render_with_tools(&messages, tools, add_generation_prompt)
    }

    /// The template's Jinja source (what a server reads to know its tool-call format).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The roles a message may have: system, user and assistant, and `tool` where the template
    /// names it.
    pub fn roles(&self) -> &[String] {
        &self.roles
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the functions the assistant may call (OpenAI tool objects
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`) as the
    /// template's `tools`, as `apply_chat_template(tools=...)` passes them; none leaves `tools`
    /// undefined, as there. They are `xml_tools` too, the name SmolLM3's template reads.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let err = template_error;
        let tools = (!tools.is_empty()).then_some(tools);
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        };
        let ctx = match tools {
            Some(tools) => minijinja::context! { tools => tools, xml_tools => tools, ..ctx },
            None => ctx,
        };
        self.env.get_template("chat").map_err(err)?.render(ctx).map_err(err)
    }
}

/// Jinja's `tojson` as Hugging Face's templates get it (transformers replaces Jinja's own):
/// Python's `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`: `", "` and `": "` between items, keys in their order, and `<`, `>`, `&`
/// and `'` as they are (minijinja's own escapes them for HTML, which no prompt wants).
fn tojson(
    value: &minijinja::Value,
    indent: Option<minijinja::Value>,
    args: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent = match indent.or(args.get::<Option<minijinja::Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let separators: Option<Vec<String>> = args.get("separators")?;
    let sort_keys = args.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = args.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    args.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            let why = "tojson: separators must be two strings (item, key)";
            return Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, why));
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut out = String::new();
    PyJson { indent, item, key, sort_keys, ensure_ascii }.write(&mut out, value, 0)?;
    Ok(minijinja::Value::from_safe_string(out))
}

/// The settings of one `tojson` call.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, v: &minijinja::Value, depth: usize) -> std::result::Result<(), minijinja::Error> {
        use minijinja::value::ValueKind;
        match v.kind() {
            ValueKind::Map => {
                let mut keys: Vec<minijinja::Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let items = keys.into_iter().map(|k| {
                    let value = v.get_item(&k).unwrap_or_default();
                    (k, value)
                });
                self.container(out, '{', '}', items, depth, |out, (k, value)| {
                    self.string(out, &k.to_string());
                    out.push_str(&self.key);
                    self.write(out, &value, depth + 1)
                })
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<minijinja::Value> = v.try_iter()?.collect();
                self.container(out, '[', ']', items, depth, |out, item| self.write(out, &item, depth + 1))
            }
            ValueKind::String => {
                self.string(out, v.as_str().unwrap_or_default());
                Ok(())
            }
            ValueKind::Undefined | ValueKind::None => {
                out.push_str("null");
                Ok(())
            }
            // Numbers and booleans as serde writes them (`1.5`, `true`).
            _ => {
                let text = serde_json::to_string(v).map_err(|e| {
                    minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, "tojson: cannot write this value")
                        .with_source(e)
                })?;
                out.push_str(&text);
                Ok(())
            }
        }
    }

    /// `open`, the items each written by `each` (one per line, indented, with `indent`), `close`.
    fn container<T>(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: impl IntoIterator<Item = T>,
        depth: usize,
        mut each: impl FnMut(&mut String, T) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        let mut any = false;
        for (i, item) in items.into_iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item);
            }
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * (depth + 1)));
            }
            each(out, item)?;
            any = true;
        }
        if let (Some(n), true) = (self.indent, any) {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python writes it (serde_json escapes the same characters).
    fn string(&self, out: &mut String, s: &str) {
        let quoted = serde_json::to_string(s).unwrap_or_default();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
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
        assert_eq!(r[1], Record { body: Body::Text("plain".into()), line: 3, tools: vec![] }, "blank lines counted");
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
            Message::new("user", "hi"),
            Message::new("assistant", "ho"),
            Message::new("user", "why"),
            Message::new("assistant", "so"),
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

    /// The templates of tests/fixtures/templates and what transformers renders with them
    /// (`make_expected.py` there).
    fn expected_renderings() -> Value {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates");
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
    }

    fn fixture_template(name: &str, bos: &str, eos: &str) -> ChatTemplate {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates");
        ChatTemplate::new(std::fs::read_to_string(dir.join(name)).unwrap(), bos.into(), eos.into()).unwrap()
    }

    /// `text` with the date SmolLM3's template writes (`Today Date: ...`, from `strftime_now`) as
    /// `make_expected.py` stops transformers' clock: 02 January 2025.
    fn on_the_fixed_day(text: String) -> String {
        let Some(at) = text.find("Today Date: ").map(|i| i + "Today Date: ".len()) else { return text };
        let end = at + text[at..].find('\n').unwrap_or(text.len() - at);
        format!("{}02 January 2025{}", &text[..at], &text[end..])
    }

    /// Tools and a tool-call round trip (an assistant's call, the tool's answer) render through
    /// Qwen2.5's, Qwen3's, Llama 3.1's, Mistral Nemo's and SmolLM3's own templates byte for byte
    /// as transformers' `apply_chat_template(tools=...)` renders them.
    #[test]
    fn tool_calls_render_as_transformers_renders_them() {
        let expected = expected_renderings();
        let Value::Array(items) = &expected["messages"] else { panic!("messages") };
        let messages = messages_of(items, "messages").unwrap();
        assert_eq!(messages[2].tool_calls[0].name, "get_weather");
        assert_eq!(messages[3].tool_call_id.as_deref(), Some("call9abcd"));
        let tools = expected["tools"].as_array().unwrap().clone();
        for (name, want) in expected["rendered"].as_object().unwrap() {
            let (bos, eos) = (want["bos"].as_str().unwrap(), want["eos"].as_str().unwrap());
            let template = fixture_template(name, bos, eos);
            let dated = |text: String| if name.starts_with("smollm3") { on_the_fixed_day(text) } else { text };
            let prompt = dated(template.render_with_tools(&messages[..2], &tools, true).unwrap());
            assert_eq!(prompt, want["prompt"].as_str().unwrap(), "{name}: the prompt");
            let all = dated(template.render_with_tools(&messages, &tools, false).unwrap());
            assert_eq!(all, want["conversation"].as_str().unwrap(), "{name}: the conversation");
        }
        // Without tools, `tools` is undefined: Qwen2.5's plain system turn.
        let plain = fixture_template("qwen2.5.jinja", "", "<|im_end|>").render(&messages[..2], true).unwrap();
        assert!(plain.starts_with("<|im_start|>system\nYou are terse.<|im_end|>\n"), "{plain}");
    }

    /// SmolLM3's official template (`{% generation %}` tags, `strftime_now`, tools as
    /// `xml_tools` written with `| string`) loads and renders a conversation with neither a system
    /// turn nor tools; its calls are text in the assistant's content (the template writes no
    /// `tool_calls`, as in transformers), and training scores that text.
    #[test]
    fn smollm3s_template_loads_renders_and_trains() {
        let template = fixture_template("smollm3.jinja", "", "<|im_end|>");
        let today = jinja::strftime_now("%d %B %Y".into()).unwrap();
        let prompt = template.render(&[Message::new("user", "hi")], true).unwrap();
        assert!(prompt.starts_with("<|im_start|>system\n## Metadata\n"), "{prompt}");
        assert!(prompt.contains(&format!("Today Date: {today}\nReasoning Mode: /think\n")), "{prompt}");
        assert!(!prompt.contains("### Tools"), "{prompt}");
        assert!(prompt.ends_with("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), "{prompt}");
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "get_weather"}})];
        let record = Record {
            tools,
            ..Body::Chat(vec![
                Message::new("system", "Be brief. /no_think"),
                Message::new("user", "Weather in Paris?"),
                Message::new("assistant", call),
                Message::new("tool", "21 C"),
                Message::new("assistant", "It is 21 C."),
            ])
            .into()
        };
        let Body::Chat(messages) = &record.body else { unreachable!() };
        let text = template.render_with_tools(messages, &record.tools, false).unwrap();
        assert!(text.contains("Reasoning Mode: /no_think\n"), "{text}");
        assert!(text.contains("'function': {'name': 'get_weather'}"), "the tools as Python writes them: {text}");
        assert!(text.contains("<|im_start|>user\n21 C<|im_end|>\n"), "the tool's answer as a user turn: {text}");
        let tok = Tokenizer::train_char(&text);
        let ex = encode(&[record], &tok, Some(&template)).unwrap();
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        // The empty thinking of `/no_think` comes with the generation prompt: not scored.
        assert_eq!(scored, format!("{call}<|im_end|>\nIt is 21 C.<|im_end|>\n"));
    }

    #[test]
    fn tojson_writes_as_python_does() {
        let t = |source: &str| {
            let template = ChatTemplate::new(source.into(), String::new(), String::new()).unwrap();
            template.render(&[Message::new("user", "a<b> & 'c' é")], false).unwrap()
        };
        assert_eq!(t("{{ messages[0] | tojson }}"), r#"{"role": "user", "content": "a<b> & 'c' é"}"#);
        assert_eq!(t("{{ messages[0].content | tojson(ensure_ascii=true) }}"), r#""a<b> & 'c' \u00e9""#);
        assert_eq!(
            t("{{ messages | tojson(indent=2) }}"),
            "[\n  {\n    \"role\": \"user\",\n    \"content\": \"a<b> & 'c' é\"\n  }\n]"
        );
        assert_eq!(
            t("{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}"),
            r#"{"content":"a<b> & 'c' é","role":"user"}"#
        );
        assert_eq!(t("{{ [] | tojson(indent=2) }}{{ {} | tojson }}"), "[]{}");
    }

    /// A TRL tool-calling row (`messages` with an assistant's `tool_calls` and a `tool` turn's
    /// answer, and the row's `tools`) trains through the template with the tools: the loss covers
    /// exactly the assistant turns, its call included, and nothing of the tools or the answer.
    #[test]
    fn tool_calling_rows_score_the_assistants_calls() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        let row = serde_json::json!({
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
                ]},
                {"role": "tool", "name": "get_weather", "content": "21 C"},
                {"role": "assistant", "content": "It is 21 C."},
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city"}}],
        });
        std::fs::write(&p, format!("{row}\n")).unwrap();
        let records = read_jsonl(&p).unwrap();
        assert_eq!(records[0].tools.len(), 1);
        let Body::Chat(messages) = &records[0].body else { panic!("a chat") };
        assert_eq!(messages[1].tool_calls[0].arguments, serde_json::json!({"city": "Paris"}));
        let template = fixture_template("qwen2.5.jinja", "", "<|im_end|>");
        let text = template.render_with_tools(messages, &records[0].tools, false).unwrap();
        let tok = Tokenizer::train_char(&text);
        let ex = encode(&records, &tok, Some(&template)).unwrap();
        assert_eq!(tok.decode(&ex[0].ids).unwrap(), text);
        assert!(text.contains("\"description\": \"Weather of a city\""), "the tools are in the prompt: {text}");
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        let call =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n";
        assert_eq!(scored, format!("{call}It is 21 C.<|im_end|>\n"));
        // Bad rows are refused in words, at their line.
        for (row, want) in [
            (
                r#"{"messages": [{"role": "assistant", "tool_calls": 3}], "tools": []}"#,
                "messages[0].tool_calls: expected a list of tool calls, found a number",
            ),
            (
                r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]}"#,
                "messages[0].tool_calls[0].function.name is missing",
            ),
            (
                r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}"#,
                "messages[0].tool_calls[0].function.arguments: expected a JSON object",
            ),
            (
                r#"{"messages": [{"role": "assistant", "content": "x"}], "tools": {"a": 1}}"#,
                "tools: expected a list of tool objects",
            ),
            (r#"{"messages": [{"role": "assistant"}]}"#, "messages[0].content is missing"),
        ] {
            std::fs::write(&p, format!("{row}\n")).unwrap();
            let e = read_jsonl(&p).unwrap_err().to_string();
            assert!(e.contains(&format!("d.jsonl:1: {want}")), "{row}: {e}");
        }
    }

    /// Templates that cannot write tools or calls get them as text, in training as in the server:
    /// SmolLM2's (no tools section) gets the default tools block, the call as Hermes text and the
    /// answer as a user turn of `<tool_response>`; SmolLM3's (tools, but no calls) the call as
    /// Hermes text. The loss covers the assistant's call and answer, never the tool's result.
    #[test]
    fn tools_a_template_cannot_write_are_trained_as_text() {
        let kinds = [
            ("qwen2.5.jinja", ToolText::InTemplate),
            ("qwen3.jinja", ToolText::InTemplate),
            ("llama3.1.jinja", ToolText::InTemplate),
            ("mistral-nemo.jinja", ToolText::InTemplate),
            ("smollm2.jinja", ToolText::AllAsText),
            ("smollm3.jinja", ToolText::CallsAsText),
        ];
        for (name, kind) in kinds {
            assert_eq!(fixture_template(name, "", "</s>").tool_text(), kind, "{name}");
        }
        let call =
            ToolCall { id: "c1".into(), name: "get_weather".into(), arguments: serde_json::json!({"city": "Paris"}) };
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "get_weather"}})];
        let record = Record {
            tools: tools.clone(),
            ..Body::Chat(vec![
                Message::new("user", "Weather in Paris?"),
                Message::calls("", vec![call]),
                Message::tool_result("c1", "21 C"),
                Message::new("assistant", "It is 21 C."),
            ])
            .into()
        };
        let Body::Chat(messages) = &record.body else { unreachable!() };
        let hermes = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        for name in ["smollm2.jinja", "smollm3.jinja"] {
            let template = fixture_template(name, "", "<|im_end|>");
            let text = template.render_conversation(messages, &tools, false).unwrap();
            assert!(text.contains(&format!("<|im_start|>assistant\n{hermes}<|im_end|>\n")), "{name}: {text}");
            let tok = Tokenizer::train_char(&text);
            let ex = encode(std::slice::from_ref(&record), &tok, Some(&template)).unwrap();
            assert_eq!(tok.decode(&ex[0].ids).unwrap(), text, "{name}: encode renders as the server does");
            let scored: String = ex[0]
                .ids
                .iter()
                .zip(&ex[0].scored)
                .filter(|(_, &s)| s)
                .map(|(&i, _)| tok.decode(&[i]).unwrap())
                .collect();
            assert_eq!(scored, format!("{hermes}<|im_end|>\nIt is 21 C.<|im_end|>\n"), "{name}");
        }
        let smollm2 = fixture_template("smollm2.jinja", "", "<|im_end|>");
        let text = smollm2.render_conversation(messages, &tools, false).unwrap();
        let block = tool_text::default_tools_block(&tools);
        assert!(text.starts_with(&format!("<|im_start|>system\n{block}<|im_end|>\n")), "{text}");
        // (The tool's keys in serde_json's order: sorted, unless a crate of the build keeps them.)
        assert!(
            block.contains("<tools>\n{\"")
                && block.contains("{\"name\": \"get_weather\"}")
                && block.contains("}\n</tools>\n"),
            "{block}"
        );
        assert!(text.contains("<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n"), "{text}");
        // Nothing to write: the messages reach the template as they are.
        let plain = [Message::new("user", "hi"), Message::new("assistant", "ho")];
        assert!(matches!(smollm2.with_tools_written(&plain, &[]).0, std::borrow::Cow::Borrowed(_)));
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
