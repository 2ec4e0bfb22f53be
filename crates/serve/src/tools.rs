//! Tool calls: a request's `tools` and `tool_choice`, the model's own format for calling them, and
//! its output parsed back into calls (streamed as deltas, or whole).
//!
//! Each model was trained on one way of writing a call, which its chat template shows; ember reads
//! it from the template's source ([`ToolFormat::detect`]):
//! - [`ToolFormat::Hermes`] (Qwen2.5, Qwen3, SmolLM3, Hermes and most others): each call is
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several one after another.
//! - [`ToolFormat::Llama3`] (Llama 3.1, 3.2, 3.3): the answer is one JSON object
//!   `{"name": ..., "parameters": {...}}`, perhaps after `<|python_tag|>`.
//! - [`ToolFormat::Mistral`] (Mistral 7B v0.3, Nemo, Small): `[TOOL_CALLS]` and a JSON list of
//!   `{"name": ..., "arguments": {...}}`.
//! - [`ToolFormat::Default`], for a template without a tools section (SmolLM2's plain ChatML): the
//!   tools are described in the system message by [`default_tools_block`] and the model is asked
//!   for Hermes' format, which is also how its calls and the tools' results are written back into
//!   the conversation (a call in the assistant's text, results as a user message of
//!   `<tool_response>\n...\n</tool_response>` blocks), so that a conversation round-trips. The
//!   block says, for the tools `[{"type": "function", "function": {"name": "get_weather", ...}}]`:
//!
//! ```text
//! You can call functions to help you answer. Each function is described by a JSON object
//! between <tools> and </tools>:
//! <tools>
//! {"type": "function", "function": {"name": "get_weather", ...}}
//! </tools>
//!
//! To call a function, answer with a JSON object holding its name and its arguments between
//! <tool_call> and </tool_call>, and nothing else:
//! <tool_call>
//! {"name": "get_weather", "arguments": {"argument_name": "value"}}
//! </tool_call>
//! To call several functions, write one <tool_call> block for each. The results come back
//! between <tool_response> and </tool_response>. If no function is needed, answer normally.
//! ```
//!
//! `tool_choice: "required"` or a named function is enforced by a grammar ([`call_grammar`]): the
//! model can only write calls, in its format, to the allowed functions, with arguments that
//! follow each function's `parameters` schema.

use std::sync::atomic::{AtomicU64, Ordering};

use ember_data::finetune::tool_text::has_tools_section;
use ember_data::finetune::ToolCall;
use serde_json::Value;

use crate::api::Invalid;

mod grammar;
mod scan;

/// The default format's text, written by the data crate so that fine-tuning writes it the same.
pub use ember_data::finetune::tool_text::{default_tools_block, hermes_calls};
pub use grammar::call_grammar;
use scan::{parse_calls, probe, Partial, Probe};

/// How a model writes its tool calls (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
    Default,
}

impl ToolFormat {
    /// The format a chat template's source shows: the markers its tools section writes.
    /// A template without a tools section ([`has_tools_section`], which the rendering reads too)
    /// is [`ToolFormat::Default`].
    pub fn detect(source: &str) -> Self {
        if !has_tools_section(source) {
            Self::Default
        } else if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<tool_call>") {
            Self::Hermes
        } else {
            Self::Llama3
        }
    }

    fn syntax(self) -> Syntax {
        match self {
            Self::Hermes | Self::Default => Syntax { open: "<tool_call>", close: Some("</tool_call>"), bare: false },
            Self::Llama3 => Syntax { open: "<|python_tag|>", close: None, bare: true },
            Self::Mistral => Syntax { open: "[TOOL_CALLS]", close: None, bare: false },
        }
    }

    /// The key of a call's arguments in the JSON the model writes.
    fn arguments_key(self) -> &'static str {
        if self == Self::Llama3 {
            "parameters"
        } else {
            "arguments"
        }
    }
}

/// Where a format's calls start and end in the text.
#[derive(Debug, Clone, Copy)]
struct Syntax {
    /// The marker before a call (Hermes), or before the list of calls (Mistral).
    open: &'static str,
    /// The marker after each call, where there is one.
    close: Option<&'static str>,
    /// A JSON object at the very start of the answer is a call too (Llama 3's custom tools).
    bare: bool,
}

/// A request's `tools`, checked: each `{"type": "function", "function": {"name", "description",
/// "parameters"}}`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tools {
    json: Vec<Value>,
}

impl Tools {
    /// The field `tools` of a request (`None`: left out or null, no tools). Refused, naming the
    /// field, when not a list of function tools with distinct names of letters, digits, `_` and
    /// `-` (at most 64, as OpenAI's), and `parameters` an object; a key ember does not honour (in
    /// a tool or its function) is refused by name, and so is `strict: true` (see [`Tools::strict`]).
    pub fn read(value: Option<&Value>) -> Result<Self, Invalid> {
        let list = match value {
            None | Some(Value::Null) => return Ok(Self::default()),
            Some(Value::Array(list)) => list,
            Some(_) => {
                return Err(Invalid::new(
                    "tools",
                    "tools must be a list of {\"type\": \"function\", \"function\": {...}}",
                ))
            }
        };
        let mut names: Vec<&str> = Vec::new();
        for (i, tool) in list.iter().enumerate() {
            let name = Self::check(i, tool)?;
            if names.contains(&name) {
                return Err(Invalid::new(format!("tools[{i}].function.name"), format!("two tools are named `{name}`")));
            }
            names.push(name);
        }
        Ok(Self { json: list.clone() })
    }

    /// Tool `i`'s name, once the tool is checked.
    fn check(i: usize, tool: &Value) -> Result<&str, Invalid> {
        let param = format!("tools[{i}]");
        let should = "must be {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}";
        let Some(tool) = tool.as_object() else {
            return Err(Invalid::new(&param, format!("{param} {should}")));
        };
        if let Some(kind) = tool.get("type").filter(|k| k.as_str() != Some("function")) {
            return Err(Invalid::new(
                format!("{param}.type"),
                format!("only tools of type `function` are supported; got {kind}"),
            ));
        }
        let Some(Value::Object(function)) = tool.get("function") else {
            return Err(Invalid::new(format!("{param}.function"), format!("{param} {should}")));
        };
        let unknown = |keys: &serde_json::Map<String, Value>, known: &[&str], at: &str| {
            keys.keys().find(|k| !known.contains(&k.as_str())).map(|k| {
                let shown: String = k.chars().take(40).collect::<String>().escape_debug().to_string();
                Invalid::new(
                    format!("{at}.{shown}"),
                    format!("{at}.{shown} is not supported: {at} holds {}", known.join(", ")),
                )
            })
        };
        if let Some(e) = unknown(tool, &["type", "function"], &param) {
            return Err(e);
        }
        if let Some(e) =
            unknown(function, &["name", "description", "parameters", "strict"], &format!("{param}.function"))
        {
            return Err(e);
        }
        match function.get("strict") {
            None | Some(Value::Null) | Some(Value::Bool(_)) => {}
            Some(_) => return Err(Invalid::new(format!("{param}.function.strict"), "strict must be true or false")),
        }
        let name = match function.get("name") {
            Some(Value::String(n)) if valid_name(n) => n.as_str(),
            _ => {
                let why = "must be a function name of 1 to 64 letters, digits, `_` or `-`";
                return Err(Invalid::new(format!("{param}.function.name"), format!("{param}.function.name {why}")));
            }
        };
        if function.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
            return Err(Invalid::new(
                format!("{param}.function.description"),
                "a function's description must be a string",
            ));
        }
        if function.get("parameters").is_some_and(|p| !p.is_object() && !p.is_null()) {
            let why = "a function's parameters must be a JSON Schema object";
            return Err(Invalid::new(format!("{param}.function.parameters"), why));
        }
        Ok(name)
    }

    /// The tools as the request gave them (what the chat template gets).
    pub fn json(&self) -> &[Value] {
        &self.json
    }

    /// The first tool whose function asks for `strict: true` (calls that follow its schema
    /// exactly): honoured where a grammar writes the calls (`tool_choice` required or named).
    pub fn strict(&self) -> Option<usize> {
        self.json.iter().position(|t| t["function"]["strict"] == Value::Bool(true))
    }

    pub fn is_empty(&self) -> bool {
        self.json.is_empty()
    }

    /// The functions' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.json.iter().filter_map(|t| t["function"]["name"].as_str())
    }

    /// The `parameters` schema of the function `name` (any object when it has none).
    fn parameters(&self, name: &str) -> Value {
        let tool = self.json.iter().find(|t| t["function"]["name"].as_str() == Some(name));
        match tool.map(|t| &t["function"]["parameters"]) {
            Some(p @ Value::Object(_)) => p.clone(),
            _ => serde_json::json!({"type": "object"}),
        }
    }
}

/// OpenAI's rule for a function's name.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Whether and which tools the model must call (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls: the tools are still shown, the output is all content.
    None,
    /// The model decides.
    Auto,
    /// At least one call, of any of the tools.
    Required,
    /// One call, of this function.
    Named(String),
}

impl ToolChoice {
    /// The field `tool_choice` of a request with `tools`: `"none"`, `"auto"`, `"required"` or
    /// `{"type": "function", "function": {"name": ...}}` naming one of them. Left out, it is
    /// `auto` with tools and `none` without, as OpenAI's.
    pub fn read(value: Option<&Value>, tools: &Tools) -> Result<Self, Invalid> {
        let should = "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
        let wrong = |got: &Value| Invalid::new("tool_choice", format!("tool_choice must be {should}; got {got}"));
        let choice = match value {
            None | Some(Value::Null) if tools.is_empty() => return Ok(Self::None),
            None | Some(Value::Null) => return Ok(Self::Auto),
            Some(v @ Value::String(s)) => match s.as_str() {
                "none" => Self::None,
                "auto" => Self::Auto,
                "required" => Self::Required,
                _ => return Err(wrong(v)),
            },
            Some(v @ Value::Object(o)) => {
                if o.get("type").is_some_and(|t| t != "function") {
                    return Err(wrong(v));
                }
                match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
                    Some(name) => Self::Named(name.to_string()),
                    None => return Err(wrong(v)),
                }
            }
            Some(other) => return Err(wrong(other)),
        };
        match &choice {
            Self::Required | Self::Named(_) if tools.is_empty() => {
                Err(Invalid::new("tool_choice", "tool_choice asks for a tool call, but the request has no tools"))
            }
            Self::Named(name) if !tools.names().any(|n| n == name) => Err(Invalid::new(
                "tool_choice",
                format!("tool_choice names the function `{name}`, which is not one of the tools"),
            )),
            _ => Ok(choice),
        }
    }
}

/// What [`ToolStream`] says as the answer's text arrives.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolDelta {
    /// Text outside the calls.
    Content(String),
    /// Call `index` (counted over the answer) starts: its id and function.
    CallStart { index: usize, id: String, name: String },
    /// The next piece of call `index`'s arguments, as JSON text: the pieces of a call together
    /// are its arguments object.
    Arguments { index: usize, text: String },
}

/// The answer once all of it is read.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// The text outside the calls (white space between and after calls left out).
    pub content: String,
    pub calls: Vec<ToolCall>,
    /// Each call's arguments as the model wrote them (what OpenAI's API returns: a number past
    /// f64's range or precision kept as written).
    pub arguments: Vec<String>,
}

/// Reads a model's answer piece by piece (each piece as the detokenizer gives it) and tells the
/// text apart from the calls, in the model's [`ToolFormat`]. Text that might be the start of a
/// call's marker is held back until it is known not to be; a marker split across pieces is found.
/// A call is announced once its name is read, and its arguments stream as they are written. A
/// call that does not parse (not JSON, no name, arguments not an object, no closing marker before
/// more text) is text: nothing the model wrote is lost. Only a call cut off at the end (the token
/// limit) can have been announced and then end up as text in [`ToolStream::finish`].
#[derive(Debug)]
pub struct ToolStream {
    format: ToolFormat,
    syntax: Syntax,
    /// Text not yet said: in [`State::Text`] the tail held back, in [`State::Block`] the block.
    buf: String,
    state: State,
    /// Whether text other than white space was read before (Llama 3: a call only comes first).
    wrote: bool,
    content: String,
    calls: Vec<ToolCall>,
    /// Each call's arguments as written.
    written: Vec<String>,
    /// The calls of the current block announced so far.
    live: Vec<Live>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Text,
    /// A block: `ws` bytes of white space held before it, then the marker of `open` bytes (0 for
    /// Llama's bare JSON), then its JSON.
    Block {
        ws: usize,
        open: usize,
    },
}

/// A call announced while its block is still being written.
#[derive(Debug)]
struct Live {
    id: String,
    /// Bytes of its arguments' text sent.
    sent: usize,
}

impl ToolStream {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            syntax: format.syntax(),
            buf: String::new(),
            state: State::Text,
            wrote: false,
            content: String::new(),
            calls: Vec::new(),
            written: Vec::new(),
            live: Vec::new(),
        }
    }

    /// Reads the next piece of the answer; what can be said of it now.
    pub fn push(&mut self, piece: &str) -> Vec<ToolDelta> {
        self.buf.push_str(piece);
        let mut out = Vec::new();
        self.advance(&mut out, false);
        out
    }

    /// The answer has ended: the last deltas (the text held back, calls not yet announced), and
    /// the whole answer.
    pub fn finish(mut self) -> (Vec<ToolDelta>, Parsed) {
        let mut out = Vec::new();
        self.advance(&mut out, true);
        (out, Parsed { content: self.content, calls: self.calls, arguments: self.written })
    }

    fn advance(&mut self, out: &mut Vec<ToolDelta>, end: bool) {
        loop {
            let more = match self.state {
                State::Text => self.text(out, end),
                State::Block { ws, open } => self.block(out, ws, open, end),
            };
            if !more {
                return;
            }
        }
    }

    /// Says the text up to a marker (then the block starts: `true`), or all of it but a tail that
    /// might start one.
    fn text(&mut self, out: &mut Vec<ToolDelta>, end: bool) -> bool {
        if self.syntax.bare && !self.wrote {
            let body = self.buf.trim_start();
            if body.starts_with('{') {
                self.state = State::Block { ws: self.buf.len() - body.len(), open: 0 };
                return true;
            }
            if body.is_empty() && !end {
                return false;
            }
        }
        if let Some(at) = self.buf.find(self.syntax.open) {
            let before = self.buf[..at].trim_end().len();
            let text: String = self.buf.drain(..before).collect();
            self.say(out, text);
            self.state = State::Block { ws: at - before, open: self.syntax.open.len() };
            return true;
        }
        if end {
            let text = std::mem::take(&mut self.buf);
            // White space after calls is left out.
            if !text.trim().is_empty() || self.calls.is_empty() {
                self.say(out, text);
            }
            return false;
        }
        // Held back: a tail that may start the marker, and the white space before it (dropped if
        // a call follows).
        let partial = (1..self.syntax.open.len().min(self.buf.len() + 1))
            .rev()
            .find(|&n| {
                self.buf.is_char_boundary(self.buf.len() - n)
                    && self.syntax.open.starts_with(&self.buf[self.buf.len() - n..])
            })
            .unwrap_or(0);
        let keep = self.buf[..self.buf.len() - partial].trim_end().len();
        let text: String = self.buf.drain(..keep).collect();
        self.say(out, text);
        false
    }

    fn say(&mut self, out: &mut Vec<ToolDelta>, text: String) {
        if text.is_empty() {
            return;
        }
        self.wrote |= !text.trim().is_empty();
        self.content.push_str(&text);
        out.push(ToolDelta::Content(text));
    }

    /// Reads the block at the head of the buffer: announces and streams its calls, and once it
    /// is whole keeps its calls (`true`: text follows) or turns it back into text.
    fn block(&mut self, out: &mut Vec<ToolDelta>, ws: usize, open: usize, end: bool) -> bool {
        let start = ws + open;
        let probe = probe(&self.buf[start..], self.format.arguments_key());
        let (json_end, partial) = match probe {
            Probe::Malformed => return self.refuse(out, ws, open),
            Probe::Pending(_) if end => return self.refuse(out, ws, open),
            Probe::Pending(partial) => {
                self.stream(out, start, &partial);
                return false;
            }
            Probe::Complete(json_end, partial) => (start + json_end, partial),
        };
        let Some(calls) = parse_calls(&self.buf[start..json_end], self.format.arguments_key()) else {
            return self.refuse(out, ws, open);
        };
        let mut rest = json_end;
        if let Some(close) = self.syntax.close {
            let after = self.buf[json_end..].trim_start();
            let skipped = self.buf.len() - json_end - after.len();
            if after.starts_with(close) {
                rest = json_end + skipped + close.len();
            } else if !end && close.starts_with(after) {
                self.stream(out, start, &partial);
                return false;
            } else if after.contains(close) {
                // Text inside the block after its JSON: not a call (Qwen's parser fails on it too).
                return self.refuse(out, ws, open);
            } else if !end {
                // Text after the JSON and no closing marker yet: held until one comes (then not a
                // call) or the answer ends (then a call without its marker, as vLLM's parser takes
                // it), so that a call announced while it was written is not taken back for this.
                self.stream(out, start, &partial);
                return false;
            }
        }
        self.keep(out, start, &partial, calls);
        self.buf.drain(..rest);
        self.state = State::Text;
        self.wrote = true;
        true
    }

    /// The block is not a call: its white space and marker are text, and what follows is read
    /// again as text.
    fn refuse(&mut self, out: &mut Vec<ToolDelta>, ws: usize, open: usize) -> bool {
        let text: String = self.buf.drain(..ws + open).collect();
        self.wrote = true;
        self.say(out, text);
        self.live.clear();
        self.state = State::Text;
        true
    }

    /// Announces the block's calls whose names are read, and sends their arguments' new text.
    fn stream(&mut self, out: &mut Vec<ToolDelta>, start: usize, partial: &[Partial]) {
        for (k, call) in partial.iter().enumerate() {
            let (Some(name), Some((from, to))) = (&call.name, call.arguments) else {
                return; // in order: a later call waits for this one
            };
            let index = self.calls.len() + k;
            if k == self.live.len() {
                let id = self.id();
                out.push(ToolDelta::CallStart { index, id: id.clone(), name: name.clone() });
                self.live.push(Live { id, sent: 0 });
            }
            let text = &self.buf[start + from..start + to.unwrap_or(self.buf.len() - start)];
            let live = &mut self.live[k];
            if text.len() > live.sent {
                out.push(ToolDelta::Arguments { index, text: text[live.sent..].to_string() });
                live.sent = text.len();
            }
        }
    }

    /// Keeps a whole block's calls, announcing and finishing those not yet said.
    fn keep(&mut self, out: &mut Vec<ToolDelta>, start: usize, partial: &[Partial], calls: Vec<(String, Value)>) {
        let live = std::mem::take(&mut self.live);
        for (k, (name, arguments)) in calls.into_iter().enumerate() {
            let index = self.calls.len();
            let raw = partial
                .get(k)
                .and_then(|p| p.arguments)
                .and_then(|(from, to)| Some(&self.buf[start + from..start + to?]));
            let (id, sent) = match live.get(k) {
                Some(l) => (l.id.clone(), l.sent),
                None => {
                    let id = self.id();
                    out.push(ToolDelta::CallStart { index, id: id.clone(), name: name.clone() });
                    (id, 0)
                }
            };
            let written = raw.map_or_else(|| arguments.to_string(), str::to_string);
            let text = written[sent.min(written.len())..].to_string();
            if !text.is_empty() {
                out.push(ToolDelta::Arguments { index, text });
            }
            self.written.push(written);
            self.calls.push(ToolCall { id, name, arguments });
        }
    }

    fn id(&self) -> String {
        new_id(self.format)
    }
}

/// Parses a whole answer (what a non-streamed response holds): one read of [`ToolStream`].
pub fn parse(format: ToolFormat, text: &str) -> Parsed {
    let mut stream = ToolStream::new(format);
    stream.push(text);
    stream.finish().1
}

/// A call's id: `call_` and 24 letters or digits as OpenAI's; Mistral's templates want exactly 9.
fn new_id(format: ToolFormat) -> String {
    use std::hash::{BuildHasher, Hasher};
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let len = if format == ToolFormat::Mistral { 9 } else { 24 };
    let mut out = String::with_capacity(len + 5);
    if format != ToolFormat::Mistral {
        out.push_str("call_");
    }
    // The standard library's random hasher keys, seeded once per process, mixed with a counter.
    let mut bits = 0u64;
    for i in 0..len {
        if i % 10 == 0 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
            bits = h.finish();
        }
        out.push(ALPHABET[(bits % 62) as usize] as char);
        bits /= 62;
    }
    out
}

#[cfg(test)]
mod tests;
