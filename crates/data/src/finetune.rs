//! Fine-tuning data: JSON lines of `{"prompt", "completion"}`, `{"messages": [...]}` (rendered with
//! the tokenizer's chat template) or `{"text"}`, tokenized with a loss mask so that only completion
//! (assistant) tokens are scored, and packed into full context windows.
//!
//! Packing concatenates the examples, each ending with the end-of-text token, and cuts the stream
//! into rows of `seq_len + 1` tokens; attention runs across example boundaries within a row, as in
//! the common packed fine-tuning recipes (TRL's `ConstantLengthDataset`).

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

/// One line of a fine-tuning file.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Scored whole.
    Text(String),
    /// Only the completion is scored.
    Completion { prompt: String, completion: String },
    /// Only assistant turns are scored.
    Chat(Vec<Message>),
}

/// Reads a JSON-lines file; a bad line is an error naming the file and line.
pub fn read_jsonl(path: &Path) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).map_err(DataError::io(path))?;
    let bad = |line: usize, message: String| DataError::Jsonl { path: path.into(), line, message };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?;
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(String::from);
        let record = if let Some(m) = v.get("messages") {
            let messages: Vec<Message> =
                serde_json::from_value(m.clone()).map_err(|e| bad(i + 1, format!("messages: {e}")))?;
            if !messages.iter().any(|m| m.role == "assistant") {
                return Err(bad(i + 1, "messages without an assistant turn: nothing to learn".into()));
            }
            Record::Chat(messages)
        } else if let (Some(prompt), Some(completion)) = (s("prompt"), s("completion")) {
            Record::Completion { prompt, completion }
        } else if let Some(text) = s("text") {
            Record::Text(text)
        } else {
            return Err(bad(i + 1, "expected {\"prompt\", \"completion\"}, {\"messages\"} or {\"text\"}".into()));
        };
        out.push(record);
    }
    Ok(out)
}

/// A Hugging Face chat template (Jinja), rendered with minijinja and Python-compatible methods.
pub struct ChatTemplate {
    /// The environment holding the compiled template, as `chat`.
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
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
        env.add_template_owned("chat", source).map_err(template_error)?;
        Ok(Self { env, bos, eos })
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

/// Tokenizes records. Chats are rendered turn by turn so that the text of each assistant turn is
/// known: the difference between the rendering up to the turn (with the generation prompt) and the
/// rendering including it is the scored part.
pub fn encode(records: &[Record], tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> Result<Vec<Example>> {
    let eos = tokenizer.eos_id();
    records
        .iter()
        .map(|r| {
            let mut ex = Example { ids: Vec::new(), scored: Vec::new() };
            match r {
                Record::Text(t) => ex.push(tokenizer.encode_with_special(t)?, true),
                Record::Completion { prompt, completion } => {
                    ex.push(tokenizer.encode_with_special(prompt)?, false);
                    ex.push(tokenizer.encode(completion)?, true);
                }
                Record::Chat(messages) => {
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
                    // The template may end turns with the end-of-text token already.
                    if eos.is_some() && ex.ids.last() == eos.as_ref() {
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

/// Packed rows of `seq_len + 1` tokens; a row's targets are `-1` where the token is not scored.
#[derive(Debug, Clone)]
pub struct PackedExamples {
    rows: Vec<Window>,
}

impl PackedExamples {
    /// Packs `examples` in order; the tail is padded with `pad` (unscored). Rows without a scored
    /// target are dropped.
    pub fn new(examples: &[Example], seq_len: usize, pad: u32) -> Self {
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
            if target.iter().any(|&t| t >= 0) {
                rows.push(Window { input, target });
            }
            start += seq_len;
        }
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
        assert_eq!(r[1], Record::Text("plain".into()));
        std::fs::write(&p, "{\"prompt\": \"x\", \"completion\": \"y\"}\n{\"question\": 1}\n").unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:2:") && e.contains("expected {\"prompt\""), "{e}");
        std::fs::write(&p, "{not json\n").unwrap();
        assert!(read_jsonl(&p).unwrap_err().to_string().contains("d.jsonl:1:"));
    }

    #[test]
    fn only_completions_and_assistant_turns_are_scored() {
        let tok = tokenizer();
        let ex =
            encode(&[Record::Completion { prompt: "Q: hi".into(), completion: " A: ho".into() }], &tok, None).unwrap();
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        assert_eq!(scored, " A: ho");
        let template = ChatTemplate::new(CHATML.into(), String::new(), "<|im_end|>".into()).unwrap();
        let chat = Record::Chat(vec![
            Message { role: "user".into(), content: "hi".into() },
            Message { role: "assistant".into(), content: "ho".into() },
            Message { role: "user".into(), content: "why".into() },
            Message { role: "assistant".into(), content: "so".into() },
        ]);
        let ex = encode(&[chat], &tok, Some(&template)).unwrap();
        let all = tok.decode(&ex[0].ids).unwrap();
        assert_eq!(all, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nho<|im_end|>\n<|im_start|>user\nwhy<|im_end|>\n<|im_start|>assistant\nso<|im_end|>\n");
        let scored: String =
            ex[0].ids.iter().zip(&ex[0].scored).filter(|(_, &s)| s).map(|(&i, _)| tok.decode(&[i]).unwrap()).collect();
        assert_eq!(scored, "ho<|im_end|>\nso<|im_end|>\n");
        assert!(encode(&[Record::Chat(vec![])], &tok, None).is_err());
    }

    #[test]
    fn packing_fills_rows_and_masks_targets() {
        let ex = vec![
            Example { ids: vec![1, 2, 3, 4], scored: vec![false, false, true, true] },
            Example { ids: vec![5, 6, 7], scored: vec![false, true, true] },
        ];
        let p = PackedExamples::new(&ex, 3, 0);
        assert_eq!(p.len(), 2);
        assert_eq!(p.get(0).unwrap(), Window { input: vec![1, 2, 3], target: vec![-1, 3, 4] });
        assert_eq!(p.get(1).unwrap(), Window { input: vec![4, 5, 6], target: vec![-1, 6, 7] });
        assert_eq!(p.scored_tokens(), 4);
    }
}
