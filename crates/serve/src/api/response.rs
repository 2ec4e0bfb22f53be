//! The answers' JSON: a whole answer or a streamed piece of `/v1/completions` and
//! `/v1/chat/completions` ([`Kind`]), with its token counts ([`Usage`]), log-probabilities
//! ([`TokenLogprob`]), tool calls ([`CallOut`]), and OpenAI's error body.
//!
//! Streams are framed as OpenAI frames them: a chat choice opens with a chunk carrying only the
//! role, then content (or tool-call) deltas without it, then a chunk with an empty delta and the
//! finish reason; with `stream_options.include_usage` one last chunk holds the usage and no
//! choices (every chunk before it carries `"usage": null`).

use serde::Serialize;
use serde_json::{json, Map, Value};

/// Token counts of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// Which endpoint an answer is for: the shapes of its JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// One generated token's log-probability and the most likely alternatives at its place.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text and its bytes (a token may hold part of a UTF-8 character).
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
    /// Completions: where the token's text starts in the answer.
    pub text_offset: usize,
}

/// A tool call of an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct CallOut {
    pub id: String,
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

impl CallOut {
    fn json(&self, index: usize) -> Value {
        json!({"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// One choice of a whole answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub index: usize,
    pub text: String,
    pub tool_calls: Vec<CallOut>,
    pub finish: &'static str,
    /// `None`: not asked for.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// A piece of a streamed choice.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// Chat: the first chunk of a choice, the role alone.
    Role,
    Text(String, Option<Vec<TokenLogprob>>),
    /// Chat: a call starting (its id and name, arguments empty) or more of its arguments.
    Call {
        index: usize,
        id: Option<String>,
        name: Option<String>,
        arguments: String,
    },
    Finish(&'static str),
}

impl Kind {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Self::Completion, _) => "text_completion",
            (Self::Chat, false) => "chat.completion",
            (Self::Chat, true) => "chat.completion.chunk",
        }
    }

    fn logprobs(self, lp: Option<&[TokenLogprob]>) -> Value {
        let Some(lp) = lp else { return Value::Null };
        match self {
            Self::Completion => json!({
                "tokens": lp.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": lp.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": lp.iter().map(|t| {
                    let mut top = Map::new();
                    for (s, _, l) in &t.top {
                        top.entry(s.clone()).or_insert(json!(l));
                    }
                    Value::Object(top)
                }).collect::<Vec<_>>(),
                "text_offset": lp.iter().map(|t| t.text_offset).collect::<Vec<_>>(),
            }),
            Self::Chat => json!({
                "content": lp.iter().map(|t| json!({
                    "token": t.token,
                    "logprob": t.logprob,
                    "bytes": t.bytes,
                    "top_logprobs": t.top.iter().map(|(s, b, l)| json!({"token": s, "logprob": l, "bytes": b})).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
                "refusal": null,
            }),
        }
    }

    /// A whole answer.
    pub fn response(self, id: &str, created: u64, model: &str, choices: &[Choice], usage: Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .map(|c| {
                let logprobs = self.logprobs(c.logprobs.as_deref());
                match self {
                    Self::Completion => {
                        json!({"index": c.index, "text": c.text, "finish_reason": c.finish, "logprobs": logprobs})
                    }
                    Self::Chat => {
                        let mut message = json!({"role": "assistant", "content": c.text, "refusal": null});
                        if !c.tool_calls.is_empty() {
                            message["tool_calls"] = c
                                .tool_calls
                                .iter()
                                .enumerate()
                                .map(|(i, t)| {
                                    let mut v = t.json(i);
                                    v.as_object_mut().map(|o| o.remove("index"));
                                    v
                                })
                                .collect();
                            if c.text.is_empty() {
                                message["content"] = Value::Null;
                            }
                        }
                        json!({"index": c.index, "message": message, "finish_reason": c.finish, "logprobs": logprobs})
                    }
                }
            })
            .collect();
        json!({"id": id, "object": self.object(false), "created": created, "model": model, "choices": choices, "usage": usage})
    }

    /// One streamed chunk: a piece of choice `index`. `with_usage`: the stream ends with a usage
    /// chunk, and every chunk before it says `"usage": null`.
    pub fn chunk(self, head: &ChunkHead, index: usize, delta: &Delta) -> Value {
        let choice = match (self, delta) {
            (Self::Completion, Delta::Role | Delta::Call { .. }) => return Value::Null,
            (Self::Completion, Delta::Text(t, lp)) => {
                json!({"index": index, "text": t, "finish_reason": null, "logprobs": self.logprobs(lp.as_deref())})
            }
            (Self::Completion, Delta::Finish(f)) => {
                json!({"index": index, "text": "", "finish_reason": f, "logprobs": null})
            }
            (Self::Chat, Delta::Role) => {
                json!({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null})
            }
            (Self::Chat, Delta::Text(t, lp)) => {
                json!({"index": index, "delta": {"content": t}, "finish_reason": null, "logprobs": self.logprobs(lp.as_deref())})
            }
            (Self::Chat, Delta::Call { index: call, id, name, arguments }) => {
                let mut function = json!({"arguments": arguments});
                if let Some(n) = name {
                    function["name"] = json!(n);
                }
                let mut c = json!({"index": call, "function": function});
                if let Some(id) = id {
                    c["id"] = json!(id);
                    c["type"] = json!("function");
                }
                json!({"index": index, "delta": {"tool_calls": [c]}, "finish_reason": null, "logprobs": null})
            }
            (Self::Chat, Delta::Finish(f)) => {
                json!({"index": index, "delta": {}, "finish_reason": f, "logprobs": null})
            }
        };
        let mut v = head.wrap(self, vec![choice]);
        if head.with_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    pub fn usage_chunk(self, head: &ChunkHead, usage: Usage) -> Value {
        let mut v = head.wrap(self, Vec::new());
        v["usage"] = json!(usage);
        v
    }
}

/// What every chunk of one streamed answer repeats.
#[derive(Debug, Clone)]
pub struct ChunkHead {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub with_usage: bool,
}

impl ChunkHead {
    fn wrap(&self, kind: Kind, choices: Vec<Value>) -> Value {
        json!({"id": self.id, "object": kind.object(true), "created": self.created, "model": self.model, "choices": choices})
    }
}

/// OpenAI's error body.
pub fn error_body(kind: &str, message: &str, param: Option<&str>, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}
