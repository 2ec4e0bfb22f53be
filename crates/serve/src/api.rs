//! The OpenAI API's request and response bodies that ember serves: `/v1/completions`,
//! `/v1/chat/completions` (with `stream: true` as server-sent events) and `/v1/models`. Every
//! field a request sends is honoured or refused with a 400 naming it: the lists are
//! [`chat_fields`] and [`completion_fields`] (a silent success would be the worst answer).
//!
//! This file reads and checks the requests; `fields.rs` the fields beyond the basics
//! (`response_format`, `logit_bias`, penalties), `response.rs` writes the answers' JSON ([`Kind`],
//! [`Usage`], [`error_body`]).

mod fields;
mod response;

use ember_data::finetune::{Message, ToolCall};
use ember_generate::adjust::Adjustments;
use ember_generate::sample::SamplingConfig;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

pub use fields::{chat_fields, completion_fields, Format, MAX_TOP_LOGPROBS};
pub use response::{error_body, CallOut, Choice, ChunkHead, Delta, Kind, TokenLogprob, Usage};

/// A string or a list of strings (`prompt`, `stop`).
#[derive(Debug, Clone, PartialEq)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// What `/v1/completions` and `/v1/chat/completions` share.
///
/// Every request type here is read from JSON field by field ([`TryFrom<Value>`], which
/// `Deserialize` goes through too), so that a field of the wrong type is refused with an
/// [`Invalid`] naming the field and saying in words what it should be; serde's derived messages
/// name neither ("did not match any variant of untagged enum"). A field the endpoint does not
/// honour is refused by name (the requests' `TryFrom`, through `fields::refuse_unknown`), and
/// `null` is taken as left out.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(try_from = "Value")]
pub struct Settings {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    /// Newer clients send this instead of `max_tokens` for chat.
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stop: Option<OneOrMany>,
    /// OpenAI's seeds are signed 64-bit integers; a negative one is used as its bit pattern.
    pub seed: Option<i64>,
    pub stream: Option<bool>,
    pub n: Option<u64>,
    pub logprobs: Option<Value>,
    pub echo: Option<bool>,
    /// vLLM's extension: generate `max_tokens` whatever the model's end-of-text says (benchmarks).
    pub ignore_eos: Option<bool>,
    pub top_logprobs: Option<u64>,
    pub logit_bias: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Extensions (vLLM's names): top-k (`-1` or 0: off), min-p, the repetition penalty.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub stream_options: Option<Value>,
    pub response_format: Option<Value>,
    /// The end user's id: logged with the request.
    pub user: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub struct CompletionRequest {
    pub prompt: Prompts,
    pub settings: Settings,
}

/// A completion request's `prompt`: texts, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompts {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub settings: Settings,
    /// OpenAI tool objects (`{"type": "function", "function": {"name", "description", "parameters"}}`),
    /// checked by [`crate::tools::Tools::read`].
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

/// A chat message; `content` as a string or as a list of text parts.
#[derive(Debug, Clone)]
pub struct ChatMessage {
    pub role: String,
    /// `null` for an assistant turn that only called tools: empty text here.
    pub content: Option<Content>,
    /// An assistant turn's calls.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` turn's answer to the call of this id.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One part of a message's content: `{"type": "text", "text": ...}`; parts of other types (an
/// image) are read so that [`ChatRequest::messages`] can refuse them by their type.
#[derive(Debug, Clone)]
pub struct Part {
    pub kind: String,
    pub text: String,
}

/// What a JSON value is, in words, for a message saying what a field got instead of what it
/// should be.
fn what_is(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => {
            let shown: String = s.chars().take(40).collect();
            let more = if shown.len() < s.len() { "…" } else { "" };
            format!("the string \"{}{more}\"", shown.escape_debug())
        }
        Value::Array(a) if a.is_empty() => "an empty list".into(),
        Value::Array(a) if a.iter().all(Value::is_number) => "a list of numbers".into(),
        Value::Array(a) if a.iter().all(Value::is_array) => "a list of lists".into(),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// `param` must be `should` (in words) and is `got`.
fn wrong(param: &str, should: &str, got: &Value) -> Invalid {
    Invalid::new(param, format!("{param} must be {should}; got {}", what_is(got)))
}

/// The field `name` of `body` as a `T` (`should` says what that is, in words); `None` when it is
/// absent or `null`, as OpenAI's clients send the settings they leave out.
fn field<T: DeserializeOwned>(body: &Map<String, Value>, name: &str, should: &str) -> Result<Option<T>, Invalid> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v).map(Some).map_err(|_| wrong(name, should, v)),
    }
}

/// The body as a JSON object; the error's `param` is empty (the whole body).
fn object(body: Value) -> Result<Map<String, Value>, Invalid> {
    match body {
        Value::Object(o) => Ok(o),
        other => Err(Invalid::new("", format!("the body must be a JSON object; got {}", what_is(&other)))),
    }
}

/// `v` (the field `param`) as a string or a list of strings; `should` says so in words, and
/// `token_ids` is what to add when a list of numbers (token ids) or of lists came instead.
fn one_or_many(param: &str, v: &Value, should: &str, token_ids: &str) -> Result<OneOrMany, Invalid> {
    let hint = |v: &Value| match v {
        Value::Number(_) | Value::Array(_) => token_ids,
        _ => "",
    };
    let whole = |v: &Value| Invalid::new(param, format!("{param} must be {should}{}; got {}", hint(v), what_is(v)));
    match v {
        Value::String(s) => Ok(OneOrMany::One(s.clone())),
        // Token ids, or lists of them: said of the whole list.
        Value::Array(items)
            if !items.is_empty() && (items.iter().all(Value::is_number) || items.iter().all(Value::is_array)) =>
        {
            Err(whole(v))
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.clone()),
                _ => Err(Invalid::new(
                    param,
                    format!("{param} must be {should}{}; {param}[{i}] is {}", hint(item), what_is(item)),
                )),
            })
            .collect::<Result<_, _>>()
            .map(OneOrMany::Many),
        _ => Err(whole(v)),
    }
}

const PROMPT_SHOULD: &str = "a string, a list of strings, a list of token ids or a list of lists of token ids";
const MESSAGE_SHOULD: &str = "an object with `role` and `content`";
const CONTENT_SHOULD: &str = "a string or a list of text parts ({\"type\": \"text\", \"text\": \"...\"})";

impl Settings {
    fn read(body: &Map<String, Value>) -> Result<Self, Invalid> {
        let whole = "a whole number of at least 1";
        let flag = "true or false";
        let stop_should = format!("a string or a list of up to {MAX_STOPS} strings");
        Ok(Self {
            model: field(body, "model", "a string naming the model")?,
            max_tokens: field(body, "max_tokens", whole)?,
            max_completion_tokens: field(body, "max_completion_tokens", whole)?,
            temperature: field(body, "temperature", "a number from 0 to 2")?,
            top_p: field(body, "top_p", "a number above 0 and at most 1")?,
            stop: match body.get("stop") {
                None | Some(Value::Null) => None,
                Some(v) => Some(one_or_many("stop", v, &stop_should, "")?),
            },
            seed: field(body, "seed", "a whole number (a signed 64-bit integer)")?,
            stream: field(body, "stream", flag)?,
            n: field(body, "n", "a whole number from 1 to 8")?,
            logprobs: body.get("logprobs").cloned().filter(|v| !v.is_null()),
            echo: field(body, "echo", flag)?,
            ignore_eos: field(body, "ignore_eos", flag)?,
            top_logprobs: field(body, "top_logprobs", "a whole number from 0 to 20")?,
            logit_bias: body.get("logit_bias").cloned().filter(|v| !v.is_null()),
            presence_penalty: field(body, "presence_penalty", "a number from -2 to 2")?,
            frequency_penalty: field(body, "frequency_penalty", "a number from -2 to 2")?,
            top_k: field(body, "top_k", "a whole number (-1 or 0: off)")?,
            min_p: field(body, "min_p", "a number from 0 to 1")?,
            repetition_penalty: field(body, "repetition_penalty", "a number above 0")?,
            stream_options: body.get("stream_options").cloned().filter(|v| !v.is_null()),
            response_format: body.get("response_format").cloned().filter(|v| !v.is_null()),
            user: field(body, "user", "a string")?,
        })
    }
}

impl TryFrom<Value> for Settings {
    type Error = Invalid;

    fn try_from(body: Value) -> Result<Self, Invalid> {
        Self::read(&object(body)?)
    }
}

impl TryFrom<Value> for CompletionRequest {
    type Error = Invalid;

    fn try_from(body: Value) -> Result<Self, Invalid> {
        let body = object(body)?;
        let prompt = match body.get("prompt") {
            None | Some(Value::Null) => {
                return Err(Invalid::new("prompt", format!("prompt is required: {PROMPT_SHOULD}")))
            }
            Some(v) => Prompts::read(v)?,
        };
        let settings = Settings::read(&body)?;
        fields::refuse_unknown(&body, &completion_fields())?;
        Ok(Self { prompt, settings })
    }
}

impl TryFrom<Value> for ChatRequest {
    type Error = Invalid;

    fn try_from(body: Value) -> Result<Self, Invalid> {
        let body = object(body)?;
        let should = format!("a list of messages, each {MESSAGE_SHOULD}");
        let messages = match body.get("messages") {
            None | Some(Value::Null) => {
                return Err(Invalid::new("messages", format!("messages is required: {should}")))
            }
            Some(Value::Array(items)) => {
                items.iter().enumerate().map(|(i, m)| ChatMessage::read(i, m)).collect::<Result<_, _>>()?
            }
            Some(v) => return Err(wrong("messages", &should, v)),
        };
        let settings = Settings::read(&body)?;
        let tools = body.get("tools").cloned().filter(|v| !v.is_null());
        let tool_choice = body.get("tool_choice").cloned().filter(|v| !v.is_null());
        let parallel_tool_calls = field(&body, "parallel_tool_calls", "true or false")?;
        fields::refuse_unknown(&body, &chat_fields())?;
        Ok(Self { messages, settings, tools, tool_choice, parallel_tool_calls })
    }
}

impl ChatMessage {
    /// Message `i` of a request.
    fn read(i: usize, v: &Value) -> Result<Self, Invalid> {
        let Value::Object(m) = v else {
            return Err(wrong(&format!("messages[{i}]"), MESSAGE_SHOULD, v));
        };
        let role_param = format!("messages[{i}].role");
        let role = match m.get("role") {
            Some(Value::String(r)) => r.clone(),
            None => {
                return Err(Invalid::new(&role_param, format!("{role_param} is required: a string such as `user`")))
            }
            Some(v) => return Err(wrong(&role_param, "a string such as `user`", v)),
        };
        let param = format!("messages[{i}].content");
        let content = match m.get("content") {
            None | Some(Value::Null) => None,
            Some(Value::String(t)) => Some(Content::Text(t.clone())),
            Some(Value::Array(parts)) => Some(Content::Parts(
                parts.iter().enumerate().map(|(j, p)| Part::read(&param, j, p)).collect::<Result<_, _>>()?,
            )),
            Some(v) => return Err(wrong(&param, CONTENT_SHOULD, v)),
        };
        let tool_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(calls)) => calls
                .iter()
                .enumerate()
                .map(|(j, c)| {
                    let place = format!("messages[{i}].tool_calls[{j}]");
                    ToolCall::read(c, &place).map_err(|e| Invalid::new(place, e.to_string()))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(wrong(&format!("messages[{i}].tool_calls"), "a list of tool calls", v)),
        };
        let tool_call_id = field(m, "tool_call_id", "a string")
            .map_err(|e| Invalid::new(format!("messages[{i}].tool_call_id"), e.message))?;
        let name = field(m, "name", "a string").map_err(|e| Invalid::new(format!("messages[{i}].name"), e.message))?;
        // An assistant message sent back as it came may carry `refusal: null`; anything else a
        // message holds is refused by name.
        const MESSAGE_KEYS: [&str; 5] = ["role", "content", "name", "tool_calls", "tool_call_id"];
        if let Some(k) =
            m.keys().find(|k| !MESSAGE_KEYS.contains(&k.as_str()) && !(k.as_str() == "refusal" && m[*k].is_null()))
        {
            let shown: String = k.chars().take(40).collect::<String>().escape_debug().to_string();
            return Err(Invalid::new(
                format!("messages[{i}].{shown}"),
                format!("messages[{i}].{shown} is not supported: a message holds {}", MESSAGE_KEYS.join(", ")),
            ));
        }
        Ok(Self { role, content, tool_calls, tool_call_id, name })
    }
}

impl Prompts {
    /// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
    fn read(v: &Value) -> Result<Self, Invalid> {
        let ids = |v: &Value, at: &str| -> Result<Vec<u32>, Invalid> {
            let Value::Array(items) = v else { unreachable!("checked by the caller") };
            items
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| {
                        Invalid::new(
                            "prompt",
                            format!("prompt{at}[{i}] must be a token id (a whole number >= 0); got {}", what_is(t)),
                        )
                    })
                })
                .collect()
        };
        match v {
            Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
                Ok(Self::Ids(vec![ids(v, "")?]))
            }
            Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_array) => Ok(Self::Ids(
                items.iter().enumerate().map(|(i, p)| ids(p, &format!("[{i}]"))).collect::<Result<_, _>>()?,
            )),
            _ => one_or_many("prompt", v, PROMPT_SHOULD, "").map(|p| Self::Texts(p.into_vec())),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Texts(t) => t.len(),
            Self::Ids(i) => i.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Part {
    /// Part `j` of the content `param`.
    fn read(param: &str, j: usize, v: &Value) -> Result<Self, Invalid> {
        let not_a_part = |what: String| Invalid::new(param, format!("{param} must be {CONTENT_SHOULD}; {what}"));
        let Value::Object(p) = v else {
            return Err(not_a_part(format!("{param}[{j}] is {}", what_is(v))));
        };
        let kind = match p.get("type") {
            Some(Value::String(k)) => k.clone(),
            Some(v) => return Err(not_a_part(format!("{param}[{j}].type is {}", what_is(v)))),
            None => return Err(not_a_part(format!("{param}[{j}] has no `type`"))),
        };
        let text = match p.get("text") {
            Some(Value::String(t)) => t.clone(),
            None | Some(Value::Null) if kind != "text" => String::new(),
            Some(v) => return Err(not_a_part(format!("{param}[{j}].text is {}", what_is(v)))),
            None => return Err(not_a_part(format!("{param}[{j}] has no `text`"))),
        };
        Ok(Self { kind, text })
    }
}

/// A request the client got wrong: answered 400 with OpenAI's error body naming the parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    /// The parameter, as OpenAI names it (`max_tokens`, `messages[2].role`).
    pub param: String,
    pub message: String,
}

impl Invalid {
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self { param: param.into(), message: message.into() }
    }
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Invalid {}

/// What the server runs for a request, once checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub sampling: SamplingConfig,
    /// `logit_bias`, the penalties, min-p.
    pub adjustments: Adjustments,
    pub seed: Option<u64>,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage and no choices.
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// Choices per prompt.
    pub n: usize,
    /// Log-probabilities asked for: of the chosen token and this many alternatives.
    pub logprobs: Option<usize>,
    /// Completions: the answer's text starts with the prompt's.
    pub echo: bool,
    pub format: Format,
    /// The grammar (llguidance's Lark) the tool calls put on the answer (`tool_choice` required
    /// or a named function); set by the chat endpoint.
    pub grammar: Option<String>,
    /// `parallel_tool_calls: false`: at most one call in the answer.
    pub single_call: bool,
    /// The end user's id (`user`): logged with the answer.
    pub user: Option<String>,
}

/// What a request is checked against.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    pub model: String,
    pub vocab_size: usize,
    /// The sampling of what a request leaves out (the model's chat defaults).
    pub defaults: SamplingConfig,
}

/// Stop strings at most, as OpenAI allows.
pub const MAX_STOPS: usize = 4;

/// Bytes of one stop string at most (the text held back while it might be starting grows with it).
pub const MAX_STOP_BYTES: usize = 256;

/// Choices per prompt at most (`n`), each a sequence of the engine sharing the prompt's cache blocks.
pub const MAX_N: u64 = 8;

impl Settings {
    /// Checks the settings against OpenAI's ranges and turns them into a [`Generation`]; what the
    /// request leaves out (`temperature`, `top_p`, and top-k and the repetition penalty where it
    /// does not send the extension fields) comes from the served model's defaults (its chat
    /// defaults, see [`crate::sampling::ChatDefaults`]).
    pub fn generation(&self, kind: Kind, served: &Served) -> Result<Generation, Invalid> {
        if let Some(m) = &self.model {
            if m != &served.model {
                return Err(Invalid::new(
                    "model",
                    format!("the model `{m}` does not exist; this server serves `{}`", served.model),
                ));
            }
        }
        let n = match self.n {
            None => 1,
            Some(n @ 1..=MAX_N) => n as usize,
            Some(n) => return Err(Invalid::new("n", format!("n must be from 1 to {MAX_N}; got {n}"))),
        };
        if let Some(t) = self.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
            return Err(Invalid::new("temperature", format!("{t} is not in [0, 2]")));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(Invalid::new("top_p", format!("{p} is not in (0, 1]")));
        }
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) => return Err(Invalid::new("max_tokens", "must be at least 1")),
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };
        let stop = self.stops()?;
        let stream = self.stream.unwrap_or(false);
        let echo = self.echo == Some(true);
        if echo && kind == Kind::Chat {
            return Err(Invalid::new("echo", "echo is a field of /v1/completions"));
        }
        let logprobs = self.logprobs(kind)?;
        if echo && logprobs.is_some() {
            return Err(Invalid::new("echo", "echo with logprobs (the prompt's log-probabilities) is not supported"));
        }
        let format = self.response_format.as_ref().map(Format::read).transpose()?.unwrap_or_default();
        Ok(Generation {
            sampling: self.sampling(&served.defaults)?,
            adjustments: self.adjustments(served.vocab_size)?,
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            stop,
            stream,
            include_usage: fields::include_usage(self.stream_options.as_ref(), stream)?,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n,
            logprobs,
            echo,
            format,
            grammar: None,
            single_call: false,
            user: self.user.clone(),
        })
    }

    fn stops(&self) -> Result<Vec<String>, Invalid> {
        let stop = self.stop.clone().map(OneOrMany::into_vec).unwrap_or_default();
        if stop.len() > MAX_STOPS {
            return Err(Invalid::new("stop", format!("{} stop strings; at most {MAX_STOPS}", stop.len())));
        }
        if stop.iter().any(String::is_empty) {
            return Err(Invalid::new("stop", "an empty stop string would end every answer at once"));
        }
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(Invalid::new(
                "stop",
                format!("a stop string of {} bytes; at most {MAX_STOP_BYTES}", long.len()),
            ));
        }
        Ok(stop)
    }

    /// Chat: `logprobs: true` and `top_logprobs` (0–20); completions: `logprobs` a count (0–20).
    fn logprobs(&self, kind: Kind) -> Result<Option<usize>, Invalid> {
        let top = match (kind, &self.logprobs) {
            (Kind::Chat, None | Some(Value::Bool(false))) => {
                if self.top_logprobs.is_some() {
                    return Err(Invalid::new("top_logprobs", "top_logprobs needs logprobs set to true"));
                }
                return Ok(None);
            }
            (Kind::Chat, Some(Value::Bool(true))) => self.top_logprobs.unwrap_or(0),
            (Kind::Chat, Some(v)) => return Err(wrong("logprobs", "true or false", v)),
            (Kind::Completion, None) => return Ok(None),
            (Kind::Completion, Some(v)) => {
                v.as_u64().ok_or_else(|| wrong("logprobs", "a whole number from 0 to 20", v))?
            }
        };
        let param = if kind == Kind::Chat { "top_logprobs" } else { "logprobs" };
        if top > MAX_TOP_LOGPROBS {
            return Err(Invalid::new(param, format!("{param} must be from 0 to {MAX_TOP_LOGPROBS}; got {top}")));
        }
        Ok(Some(top as usize))
    }

    /// The sampler's settings: `defaults` with what the request sets.
    fn sampling(&self, defaults: &SamplingConfig) -> Result<SamplingConfig, Invalid> {
        let mut sampling = defaults.clone();
        if let Some(t) = self.temperature {
            sampling.temperature = t as f32;
        }
        if let Some(p) = self.top_p {
            sampling.top_p = (p < 1.0).then_some(p as f32);
        }
        match self.top_k {
            None => {}
            Some(-1 | 0) => sampling.top_k = None,
            Some(k) if k > 0 => sampling.top_k = Some(k as usize),
            Some(k) => {
                return Err(Invalid::new("top_k", format!("top_k must be -1 or 0 (off) or at least 1; got {k}")))
            }
        }
        if let Some(p) = self.repetition_penalty {
            if !(p > 0.0 && p <= 10.0) {
                return Err(Invalid::new(
                    "repetition_penalty",
                    format!("repetition_penalty must be above 0 and at most 10; got {p}"),
                ));
            }
            sampling.repetition_penalty = p as f32;
        }
        Ok(sampling)
    }

    fn adjustments(&self, vocab_size: usize) -> Result<Adjustments, Invalid> {
        let min_p = match self.min_p {
            None => None,
            Some(p) if (0.0..=1.0).contains(&p) => (p > 0.0).then_some(p as f32),
            Some(p) => return Err(Invalid::new("min_p", format!("min_p must be from 0 to 1; got {p}"))),
        };
        Ok(Adjustments {
            logit_bias: self
                .logit_bias
                .as_ref()
                .map(|b| fields::logit_bias(b, vocab_size))
                .transpose()?
                .unwrap_or_default(),
            presence_penalty: fields::penalty("presence_penalty", self.presence_penalty)?,
            frequency_penalty: fields::penalty("frequency_penalty", self.frequency_penalty)?,
            min_p,
        })
    }
}

impl ChatRequest {
    /// The messages as the chat template takes them (text parts joined), each role one of `roles`
    /// (the template's: see `ChatTemplate::roles`), exactly: a role is copied into the prompt, so
    /// an unknown one would be rendered as a turn the model never saw, and one carrying template
    /// text could forge a turn.
    pub fn messages(&self, roles: &[String]) -> Result<Vec<Message>, Invalid> {
        if self.messages.is_empty() {
            return Err(Invalid::new("messages", "at least one message is needed"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !roles.contains(&m.role) {
                    let shown: String = m.role.chars().take(40).collect::<String>().escape_debug().to_string();
                    return Err(Invalid::new(
                        format!("messages[{i}].role"),
                        format!("`{shown}` is not a role of this model's chat template: one of {}", roles.join(", ")),
                    ));
                }
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                            return Err(Invalid::new(
                                format!("messages[{i}].content"),
                                format!("content parts of type `{}` are not supported", p.kind),
                            ));
                        }
                        parts.iter().map(|p| p.text.as_str()).collect()
                    }
                };
                let mut message = Message::new(m.role.clone(), content);
                message.tool_calls = m.tool_calls.clone();
                message.tool_call_id = m.tool_call_id.clone();
                message.name = m.name.clone();
                Ok(message)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
