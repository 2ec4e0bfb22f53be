//! The answers' JSON: a whole answer or a streamed piece of `/v1/completions` and
//! `/v1/chat/completions` ([`Kind`]), with its token counts ([`Usage`]), and OpenAI's error body.

use serde::Serialize;
use serde_json::{json, Value};

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

impl Kind {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Self::Completion, _) => "text_completion",
            (Self::Chat, false) => "chat.completion",
            (Self::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A whole answer.
    pub fn response(self, id: &str, created: u64, model: &str, text: &str, finish: &str, usage: Usage) -> Value {
        let choice = match self {
            Self::Completion => json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null}),
            Self::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": null,
            }),
        };
        json!({"id": id, "object": self.object(false), "created": created, "model": model, "choices": [choice], "usage": usage})
    }

    /// One streamed piece: text (`finish` None), or the last piece with the reason and the usage.
    pub fn chunk(
        self,
        id: &str,
        created: u64,
        model: &str,
        text: &str,
        finish: Option<&str>,
        usage: Option<Usage>,
    ) -> Value {
        let choice = match self {
            Self::Completion => json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null}),
            Self::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"role": "assistant", "content": text})
                };
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
        };
        let mut v =
            json!({"id": id, "object": self.object(true), "created": created, "model": model, "choices": [choice]});
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }
}

/// OpenAI's error body.
pub fn error_body(kind: &str, message: &str, param: Option<&str>, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}
