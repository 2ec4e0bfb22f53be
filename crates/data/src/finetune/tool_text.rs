//! Tools, calls and their results written as text, where a chat template cannot write them: one
//! rendering for the server's prompts and for fine-tuning rows, so that a model trains on what it
//! is served.
//!
//! How a template gets them is decided once, when it is compiled ([`ToolText`]):
//! - a template with a tools section ([`has_tools_section`]) that writes an assistant's
//!   `tool_calls` (Qwen, Llama 3.1, Mistral) gets `tools`, the calls and the `tool` messages as
//!   they are, as transformers' `apply_chat_template(tools=...)` passes them;
//! - one with a tools section that drops the calls (SmolLM3's, in transformers too) gets the
//!   tools, and each call as Hermes' `<tool_call>` text after the assistant's own text, which is
//!   how that model writes its calls, so that a past call stays in the history;
//! - one without a tools section (SmolLM2's plain ChatML) gets everything as text: the tools'
//!   description by [`default_tools_block`] at the end of the first system message (or as one,
//!   first), each call as Hermes' text, and each run of `tool` messages as one user message of
//!   `<tool_response>\n...\n</tool_response>` blocks. ember-serve's `tools` module documents the
//!   block's words.

use std::borrow::Cow;

use serde_json::Value;

use super::{ChatTemplate, Message, ToolCall};

/// Whether a chat template's source has a tools section: the markers of the call formats it asks
/// for (Hermes' `<tool_call>`, Mistral's `[TOOL_CALLS]`, Llama 3's `<|python_tag|>` or its JSON
/// calls with `"parameters"`). The server reads the format from the same markers.
pub fn has_tools_section(source: &str) -> bool {
    source.contains("[TOOL_CALLS]")
        || source.contains("<tool_call>")
        || source.contains("<|python_tag|>")
        || (source.contains("<|eot_id|>") && source.contains("\"parameters\""))
}

/// How a template gets a conversation's tools, calls and their results (see the module's
/// documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolText {
    /// All through the template.
    InTemplate,
    /// The tools through the template; an assistant's calls as Hermes text in its content.
    CallsAsText,
    /// All written as text: no tools section.
    AllAsText,
}

/// The name of the probe's call: nothing a template would write by itself.
const PROBE_CALL: &str = "ember_probe_does_this_template_write_calls";

impl ToolText {
    /// How `template` gets tools: written as text without a tools section; with one, whether a
    /// probe (a conversation with a call to a function of a name no template writes) shows the
    /// call. A template that fails on the probe keeps everything (its error comes at use).
    pub(super) fn of(template: &ChatTemplate) -> Self {
        if !has_tools_section(template.source()) {
            return Self::AllAsText;
        }
        // Mistral's templates want ids of 9 letters and digits.
        let call = ToolCall { id: "ember0001".into(), name: PROBE_CALL.into(), arguments: serde_json::json!({}) };
        let probe = [Message::new("user", "Hello"), Message::calls("", vec![call])];
        let tools = [serde_json::json!({"type": "function", "function": {
            "name": "ember_tool", "description": "", "parameters": {"type": "object", "properties": {}}}})];
        match template.render_with_tools(&probe, &tools, false) {
            Ok(text) if !text.contains(PROBE_CALL) => Self::CallsAsText,
            _ => Self::InTemplate,
        }
    }

    /// `messages` and `tools` as the template gets them (see [`ToolText`]); borrowed where
    /// nothing is written.
    pub(super) fn write<'a>(self, messages: &'a [Message], tools: &'a [Value]) -> (Cow<'a, [Message]>, &'a [Value]) {
        let no_calls = messages.iter().all(|m| m.tool_calls.is_empty());
        match self {
            Self::InTemplate => (Cow::Borrowed(messages), tools),
            Self::CallsAsText if no_calls => (Cow::Borrowed(messages), tools),
            Self::CallsAsText => (Cow::Owned(messages.iter().map(with_calls_as_text).collect()), tools),
            Self::AllAsText if no_calls && tools.is_empty() && messages.iter().all(|m| m.role != "tool") => {
                (Cow::Borrowed(messages), &[])
            }
            Self::AllAsText => (Cow::Owned(write_all(messages, tools)), &[]),
        }
    }
}

/// `m` with its calls (if any) written as Hermes text after its own, on a line of their own.
fn with_calls_as_text(m: &Message) -> Message {
    if m.tool_calls.is_empty() {
        return m.clone();
    }
    let calls = hermes_calls(&m.tool_calls);
    let content = if m.content.is_empty() { calls } else { format!("{}\n{calls}", m.content) };
    Message { content, tool_calls: Vec::new(), ..m.clone() }
}

/// The messages with the tools, the calls and their results written as text, for a template
/// without a tools section: the tools' description ends the first system message (or is one),
/// calls follow the assistant's text in Hermes' format, and each run of `tool` messages is one
/// user message of `<tool_response>` blocks.
fn write_all(messages: &[Message], tools: &[Value]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if !tools.is_empty() {
        let block = default_tools_block(tools);
        match messages.first() {
            Some(m) if m.role == "system" => {
                let content = if m.content.is_empty() { block } else { format!("{}\n\n{block}", m.content) };
                out.push(Message { content, ..m.clone() });
                rest = &messages[1..];
            }
            _ => out.push(Message::new("system", block)),
        }
    }
    let mut in_results = false;
    for m in rest {
        if m.role == "tool" {
            let result = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                Some(last) if in_results => last.content = format!("{}\n{result}", last.content),
                _ => out.push(Message::new("user", result)),
            }
            in_results = true;
            continue;
        }
        in_results = false;
        out.push(with_calls_as_text(m));
    }
    out
}

/// The system-message text that describes `tools` (OpenAI tool objects) to a model whose
/// template has no tools section (the text is in ember-serve's `tools` module documentation).
pub fn default_tools_block(tools: &[Value]) -> String {
    let mut text = String::from(
        "You can call functions to help you answer. Each function is described by a JSON object between <tools> \
         and </tools>:\n<tools>\n",
    );
    for tool in tools {
        text.push_str(&py_json(tool));
        text.push('\n');
    }
    let example = tools.iter().find_map(|t| t["function"]["name"].as_str()).unwrap_or("function_name");
    text.push_str(&format!(
        "</tools>\n\nTo call a function, answer with a JSON object holding its name and its arguments between \
         <tool_call> and </tool_call>, and nothing else:\n<tool_call>\n{{\"name\": \"{example}\", \"arguments\": \
         {{\"argument_name\": \"value\"}}}}\n</tool_call>\nTo call several functions, write one <tool_call> block for \
         each. The results come back between <tool_response> and </tool_response>. If no function is needed, answer \
         normally."
    ));
    text
}

/// Calls as Hermes' format writes them: one `<tool_call>\n{"name": ..., "arguments": {...}}\n
/// </tool_call>` block each, a line break between blocks.
pub fn hermes_calls(calls: &[ToolCall]) -> String {
    let call = |c: &ToolCall| {
        // Name first, as models write it (a JSON map may sort its keys).
        let (name, arguments) = (py_json(&Value::from(c.name.as_str())), py_json(&c.arguments));
        format!("<tool_call>\n{{\"name\": {name}, \"arguments\": {arguments}}}\n</tool_call>")
    };
    calls.iter().map(call).collect::<Vec<_>>().join("\n")
}

/// JSON as Python's `json.dumps` writes it (`", "` and `": "`), as templates show JSON to models.
fn py_json(v: &Value) -> String {
    match v {
        Value::Object(o) => {
            let items: Vec<String> =
                o.iter().map(|(k, v)| format!("{}: {}", py_json(&Value::from(k.as_str())), py_json(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(py_json).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}
