//! Which request fields the server honours, and the ones beyond the basics: `response_format`,
//! `logprobs`/`top_logprobs`, `logit_bias`, the penalties and the extension fields (`top_k`,
//! `min_p`, `repetition_penalty`, `ignore_eos`). A field outside the endpoint's list is refused by
//! name ([`refuse_unknown`]): a request is never answered as if a setting it sent had been applied.

use serde_json::{Map, Value};

use super::{wrong, Invalid};

/// The fields both endpoints honour: the settings `Settings::read` reads.
const SETTINGS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
];

/// The fields only `/v1/chat/completions` honours.
const CHAT_ONLY: &[&str] =
    &["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"];

/// The fields only `/v1/completions` honours.
const COMPLETION_ONLY: &[&str] = &["prompt", "echo"];

/// The fields `/v1/chat/completions` honours (README, "Serving", and `/v1/models` list them too).
pub fn chat_fields() -> Vec<&'static str> {
    [CHAT_ONLY, SETTINGS].concat()
}

/// The fields `/v1/completions` honours.
pub fn completion_fields() -> Vec<&'static str> {
    [COMPLETION_ONLY, SETTINGS].concat()
}

/// Refuses the first field of `body` that is not in `known` (`null` ones too: a client that sends a
/// field means something by it, and OpenAI's own server refuses the ones it does not know).
pub fn refuse_unknown(body: &Map<String, Value>, known: &[&str]) -> Result<(), Invalid> {
    match body.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => {
            let shown: String = k.chars().take(60).collect::<String>().escape_debug().to_string();
            Err(Invalid::new(
                k.clone(),
                format!(
                    "Unrecognized request argument supplied: {shown} (this endpoint honours: {})",
                    known.join(", ")
                ),
            ))
        }
        None => Ok(()),
    }
}

/// The most `top_logprobs` (and completions' `logprobs`) a request may ask for, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// What `response_format` asks for.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Format {
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against `schema` (`strict` or not, the schema is enforced).
    JsonSchema { name: String, schema: Value, strict: bool },
}

impl Format {
    /// `response_format` as sent: `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub fn read(v: &Value) -> Result<Self, Invalid> {
        let should = "an object {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}";
        let Value::Object(o) = v else { return Err(wrong("response_format", should, v)) };
        match o.get("type").and_then(Value::as_str) {
            Some("text") => Ok(Self::Text),
            Some("json_object") => Ok(Self::JsonObject),
            Some("json_schema") => {
                let param = "response_format.json_schema";
                let Some(Value::Object(js)) = o.get("json_schema") else {
                    return Err(Invalid::new(
                        param,
                        format!("{param} is required for the type json_schema: an object with `name` and `schema`"),
                    ));
                };
                let name = match js.get("name") {
                    Some(Value::String(n)) => n.clone(),
                    None | Some(Value::Null) => String::new(),
                    Some(v) => return Err(wrong(&format!("{param}.name"), "a string", v)),
                };
                let schema = match js.get("schema") {
                    Some(s @ Value::Object(_)) => s.clone(),
                    Some(Value::Bool(true)) | None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(v) => return Err(wrong(&format!("{param}.schema"), "a JSON Schema object", v)),
                };
                let strict = match js.get("strict") {
                    Some(Value::Bool(b)) => *b,
                    None | Some(Value::Null) => false,
                    Some(v) => return Err(wrong(&format!("{param}.strict"), "true or false", v)),
                };
                Ok(Self::JsonSchema { name, schema, strict })
            }
            Some(other) => Err(Invalid::new(
                "response_format.type",
                format!(
                    "response_format.type `{}` is not supported: one of text, json_object, json_schema",
                    other.chars().take(40).collect::<String>().escape_debug()
                ),
            )),
            None => Err(wrong("response_format", should, v)),
        }
    }
}

/// `logit_bias`: `{"token id": bias}` with ids below `vocab_size` and biases in [-100, 100].
pub fn logit_bias(v: &Value, vocab_size: usize) -> Result<Vec<(u32, f32)>, Invalid> {
    let should = "an object mapping token ids (as strings) to numbers from -100 to 100";
    let Value::Object(o) = v else { return Err(wrong("logit_bias", should, v)) };
    let mut out = Vec::with_capacity(o.len());
    for (k, b) in o {
        let id = k.trim().parse::<u32>().ok().filter(|&id| (id as usize) < vocab_size).ok_or_else(|| {
            let shown: String = k.chars().take(40).collect::<String>().escape_debug().to_string();
            Invalid::new(
                "logit_bias",
                format!(
                    "logit_bias key `{shown}` is not a token id of this model (0 to {})",
                    vocab_size.saturating_sub(1)
                ),
            )
        })?;
        let bias = b.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            Invalid::new("logit_bias", format!("logit_bias[\"{id}\"] must be a number from -100 to 100; got {b}"))
        })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

/// A penalty (`presence_penalty`, `frequency_penalty`) in OpenAI's range [-2, 2].
pub fn penalty(name: &str, v: Option<f64>) -> Result<f32, Invalid> {
    match v {
        None => Ok(0.0),
        Some(p) if (-2.0..=2.0).contains(&p) => Ok(p as f32),
        Some(p) => Err(Invalid::new(name, format!("{name} must be from -2 to 2; got {p}"))),
    }
}

/// `stream_options`: `{"include_usage": bool}`, only beside `stream: true`.
pub fn include_usage(v: Option<&Value>, stream: bool) -> Result<bool, Invalid> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(false) };
    let should = "an object {\"include_usage\": true or false}";
    let Value::Object(o) = v else { return Err(wrong("stream_options", should, v)) };
    if let Some(k) = o.keys().find(|k| k.as_str() != "include_usage") {
        return Err(Invalid::new("stream_options", format!("stream_options.{k} is not supported: {should}")));
    }
    if !stream {
        return Err(Invalid::new("stream_options", "stream_options is only allowed when stream is true"));
    }
    match o.get("include_usage") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(wrong("stream_options.include_usage", "true or false", v)),
    }
}
