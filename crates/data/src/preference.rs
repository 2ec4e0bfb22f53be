//! Preference data: JSON lines of `{"prompt", "chosen", "rejected"}`, TRL's two formats: plain
//! text (three strings) or conversational (three lists of messages: the prompt's turns, then the
//! chosen and the rejected answer's). Each pair is tokenized as TRL's `DPOTrainer` does: the
//! prompt alone, and the prompt followed by each answer (plain text: with the end-of-sequence
//! token); the answers start where both tokenizations part from the prompt's. A pair becomes one
//! row of two documents, prompt + chosen then prompt + rejected, so that one forward pass scores
//! both (each document restarts its positions and attends only to itself).

use std::path::Path;

use serde_json::Value;

use crate::error::{DataError, Result};
use crate::finetune::{json_lines, json_type, messages_of, ChatTemplate, Message, TurnsError};
use crate::loader::Window;
use crate::tokenizer::Tokenizer;

/// A prompt or an answer: text, or chat messages.
#[derive(Debug, Clone, PartialEq)]
pub enum Turns {
    Text(String),
    Chat(Vec<Message>),
}

/// One line of a preference file.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceRecord {
    pub prompt: Turns,
    pub chosen: Turns,
    pub rejected: Turns,
    /// The line of the file it was read from, 1-based as editors count (blank lines included);
    /// 0 for a pair made in memory. Errors about the pair name it.
    pub line: usize,
}

/// Lines listed in a message at most (the rest counted).
const LINES_SHOWN: usize = 5;

/// The value of `key` as TRL reads it: a string, or a list of chat messages of known roles; the
/// error names the key (and the message) in words.
pub(crate) fn turns_of(value: &Value, key: &str) -> std::result::Result<Turns, TurnsError> {
    match value {
        Value::String(s) => Ok(Turns::Text(s.clone())),
        Value::Array(items) => Ok(Turns::Chat(messages_of(items, key)?)),
        other => Err(TurnsError::NotTurns { place: key.into(), found: json_type(other) }),
    }
}

/// Reads a preference file; a bad line is an error naming the file, the line and the key. Pairs
/// whose chosen answer is their rejected one carry no preference (DPO's loss on them is ln 2 at
/// every step, their gradient zero): some are a warning naming their lines, all an error.
pub fn read_preference_jsonl(path: &Path) -> Result<Vec<PreferenceRecord>> {
    let bad = |line: usize, message: String| DataError::Jsonl { path: path.into(), line, message };
    let mut out = Vec::new();
    for (i, v) in json_lines(path)? {
        let turns = |key: &str| -> Result<Turns> {
            match v.get(key) {
                Some(value) => turns_of(value, key).map_err(|m| bad(i + 1, m.to_string())),
                None => Err(bad(i + 1, format!("{key} is missing: expected {{\"prompt\", \"chosen\", \"rejected\"}}"))),
            }
        };
        let record = PreferenceRecord {
            prompt: turns("prompt")?,
            chosen: turns("chosen")?,
            rejected: turns("rejected")?,
            line: i + 1,
        };
        let chat = [&record.prompt, &record.chosen, &record.rejected].map(|t| matches!(t, Turns::Chat(_)));
        if chat.iter().any(|&c| c != chat[0]) {
            return Err(bad(i + 1, "prompt, chosen and rejected must be all strings or all lists of messages".into()));
        }
        for (key, turns) in [("chosen", &record.chosen), ("rejected", &record.rejected)] {
            let empty = match turns {
                Turns::Text(t) => t.is_empty(),
                Turns::Chat(m) => !m.iter().any(|m| m.role == "assistant"),
            };
            if empty {
                let what = if chat[0] { "has no assistant message" } else { "is empty" };
                return Err(bad(i + 1, format!("{key} {what}: nothing to compare")));
            }
        }
        out.push(record);
    }
    if out.is_empty() {
        return Err(bad(0, "no preference pairs".into()));
    }
    let same = identical_pairs(&out);
    if let Some(&first) = same.first() {
        let (n, lines) = (out.len(), line_list(&same));
        if same.len() == n {
            let message = format!(
                "every pair's chosen answer is the same as its rejected one ({n} of {n}; {lines}): the \
                 pairs carry no preference to learn"
            );
            return Err(bad(first, message));
        }
        tracing::warn!(
            "{}: {} of {n} pairs have the same chosen and rejected answer ({lines}): they carry no \
             preference signal (DPO's loss on them stays ln 2)",
            path.display(),
            same.len()
        );
    }
    Ok(out)
}

/// The lines of the pairs whose chosen answer is their rejected one.
fn identical_pairs(records: &[PreferenceRecord]) -> Vec<usize> {
    records.iter().filter(|r| r.chosen == r.rejected).map(|r| r.line).collect()
}

/// `lines` for a message, "line 3" or "lines 1, 4": the first [`LINES_SHOWN`], then how many more.
fn line_list(lines: &[usize]) -> String {
    let shown: Vec<String> = lines.iter().take(LINES_SHOWN).map(usize::to_string).collect();
    let word = if lines.len() == 1 { "line" } else { "lines" };
    match lines.len().saturating_sub(LINES_SHOWN) {
        0 => format!("{word} {}", shown.join(", ")),
        more => format!("{word} {} and {more} more", shown.join(", ")),
    }
}

/// A tokenized pair: the prompt's tokens and each answer's after it.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// Tokenizes the pairs as TRL does (module docs); chat needs the model's template.
pub fn encode_pairs(
    records: &[PreferenceRecord],
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Vec<Pair>> {
    records.iter().map(|r| encode_pair(r, tokenizer, template)).collect()
}

/// [`encode_pairs`] for the pairs read from `path`: an error names the file and the pair's line.
pub fn encode_pairs_of_file(
    path: &Path,
    records: &[PreferenceRecord],
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> Result<Vec<Pair>> {
    records
        .iter()
        .map(|r| {
            encode_pair(r, tokenizer, template).map_err(|e| DataError::Jsonl {
                path: path.into(),
                line: r.line,
                message: e.to_string(),
            })
        })
        .collect()
}

/// One pair, tokenized as TRL does (module docs).
fn encode_pair(r: &PreferenceRecord, tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> Result<Pair> {
    let eos = tokenizer.eos_id();
    let (prompt, chosen, rejected) = match (&r.prompt, &r.chosen, &r.rejected) {
        (Turns::Text(p), Turns::Text(c), Turns::Text(x)) => {
            // TRL appends the end-of-sequence token to plain answers.
            let full = |answer: &str| -> Result<Vec<u32>> {
                let mut ids = tokenizer.encode_with_special(&format!("{p}{answer}"))?;
                if let Some(e) = eos.filter(|e| ids.last() != Some(e)) {
                    ids.push(e);
                }
                Ok(ids)
            };
            (tokenizer.encode_with_special(p)?, full(c)?, full(x)?)
        }
        (Turns::Chat(p), Turns::Chat(c), Turns::Chat(x)) => {
            let template = template.ok_or_else(|| {
                DataError::Tokenizer(
                    "chat messages need a chat template (tokenizer_config.json `chat_template` or chat_template.jinja)"
                        .into(),
                )
            })?;
            let full = |answer: &[Message]| -> Result<Vec<u32>> {
                let messages: Vec<Message> = p.iter().chain(answer).cloned().collect();
                tokenizer.encode(&template.render(&messages, false)?)
            };
            (tokenizer.encode(&template.render(p, true)?)?, full(c)?, full(x)?)
        }
        _ => return Err(DataError::Tokenizer("a pair mixes text and messages".into())),
    };
    let common = |a: &[u32]| prompt.iter().zip(a).take_while(|(x, y)| x == y).count();
    let n = common(&chosen).min(common(&rejected));
    Ok(Pair { chosen: chosen[n..].to_vec(), rejected: rejected[n..].to_vec(), prompt: prompt[..n].to_vec() })
}

impl Pair {
    /// Positions the pair's row needs: both documents, prompt and answer each.
    pub fn len(&self) -> usize {
        2 * self.prompt.len() + self.chosen.len() + self.rejected.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pair as one row of `seq_len` positions: prompt + chosen (the document starting at 0),
    /// prompt + rejected (the second), then padding (a document of its own). Position `i` of a
    /// document predicts its token `i + 1` where that token is an answer's (the others are `-1`).
    /// `None` when the two do not fit.
    pub fn row(&self, seq_len: usize, pad: u32) -> Option<Window> {
        if self.len() > seq_len {
            return None;
        }
        let (mut input, mut target, mut docs) = (Vec::new(), Vec::new(), Vec::new());
        for answer in [&self.chosen, &self.rejected] {
            let start = input.len() as u32;
            let doc: Vec<u32> = self.prompt.iter().chain(answer.iter()).copied().collect();
            for i in 0..doc.len() {
                input.push(doc[i]);
                let scored = i + 1 < doc.len() && i + 1 >= self.prompt.len();
                target.push(if scored { doc[i + 1] as i32 } else { -1 });
                docs.push(start);
            }
        }
        let start = input.len() as u32;
        input.resize(seq_len, pad);
        target.resize(seq_len, -1);
        docs.resize(seq_len, start);
        Some(Window { input, target, docs: Some(docs) })
    }
}

/// Which positions of a pair's row score the chosen answer (its first document) and which the
/// rejected (the second): the row's masks, `1.0` where scored.
pub fn answer_masks(row: &Window) -> (Vec<f32>, Vec<f32>) {
    let docs = row.docs.as_deref().unwrap_or(&[]);
    let second = docs.iter().copied().find(|&d| d != 0);
    let (mut chosen, mut rejected) = (vec![0.0; row.target.len()], vec![0.0; row.target.len()]);
    for (i, &t) in row.target.iter().enumerate() {
        if t < 0 {
            continue;
        }
        match docs.get(i).copied() {
            Some(0) => chosen[i] = 1.0,
            d if d.is_some() && d == second => rejected[i] = 1.0,
            _ => {}
        }
    }
    (chosen, rejected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_is_two_documents_scored_on_their_answers() {
        let pair = Pair { prompt: vec![1, 2], chosen: vec![3, 4], rejected: vec![5] };
        let row = pair.row(10, 0).unwrap();
        assert_eq!(row.input, [1, 2, 3, 4, 1, 2, 5, 0, 0, 0]);
        assert_eq!(row.target, [-1, 3, 4, -1, -1, 5, -1, -1, -1, -1]);
        assert_eq!(row.docs.as_deref(), Some(&[0, 0, 0, 0, 4, 4, 4, 7, 7, 7][..]));
        let (c, r) = answer_masks(&row);
        assert_eq!(c, [0., 1., 1., 0., 0., 0., 0., 0., 0., 0.]);
        assert_eq!(r, [0., 0., 0., 0., 0., 1., 0., 0., 0., 0.]);
        assert!(pair.row(6, 0).is_none());
        assert!(pair.row(7, 0).is_some());
    }

    #[test]
    fn bad_lines_are_named() {
        let dir = std::env::temp_dir().join(format!("ember-pref-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        for (line, want) in [
            (r#"{"prompt": "a", "chosen": "b"}"#, ":1: rejected is missing"),
            (r#"{"prompt": "a", "chosen": "", "rejected": "c"}"#, ":1: chosen is empty"),
            (
                r#"{"prompt": "a", "chosen": 3, "rejected": "c"}"#,
                ":1: chosen: expected a string or a list of messages, found a number",
            ),
            (
                r#"{"prompt": ["a"], "chosen": [], "rejected": []}"#,
                ":1: prompt[0]: expected a message {\"role\", \"content\"}, found a string",
            ),
            (r#"{"prompt": [{"role": "user"}], "chosen": [], "rejected": []}"#, ":1: prompt[0].content is missing"),
            (
                r#"{"prompt": [{"role": "user", "content": null}], "chosen": [], "rejected": []}"#,
                ":1: prompt[0].content: expected a string, found null",
            ),
            (
                r#"{"prompt": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "chosen": [], "rejected": []}"#,
                ":1: prompt[0].content: expected a string, found a list (of parts?)",
            ),
            (
                r#"{"prompt": [{"role": 1, "content": "a"}], "chosen": [], "rejected": []}"#,
                ":1: prompt[0].role: expected a string, found a number",
            ),
            (
                r#"{"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}"#,
                "all strings or all lists",
            ),
            (
                r#"{"prompt": [{"role": "human", "content": "a"}], "chosen": [], "rejected": []}"#,
                "prompt[0].role `human`",
            ),
        ] {
            std::fs::write(&path, format!("{line}\n")).unwrap();
            let e = read_preference_jsonl(&path).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("p.jsonl"), "{line}: {e}");
        }
        std::fs::write(&path, "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n").unwrap();
        assert_eq!(read_preference_jsonl(&path).unwrap().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The messages `f` logs at warning level.
    fn warnings(f: impl FnOnce()) -> Vec<String> {
        use std::sync::{Arc, Mutex};
        use tracing::span::{Attributes, Id, Record};
        struct Capture(Arc<Mutex<Vec<String>>>);
        struct Text<'a>(&'a mut String);
        impl tracing::field::Visit for Text<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    *self.0 = format!("{value:?}");
                }
            }
        }
        impl tracing::Subscriber for Capture {
            fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
                true
            }
            fn new_span(&self, _: &Attributes<'_>) -> Id {
                Id::from_u64(1)
            }
            fn record(&self, _: &Id, _: &Record<'_>) {}
            fn record_follows_from(&self, _: &Id, _: &Id) {}
            fn event(&self, event: &tracing::Event<'_>) {
                if *event.metadata().level() == tracing::Level::WARN {
                    let mut text = String::new();
                    event.record(&mut Text(&mut text));
                    self.0.lock().unwrap().push(text);
                }
            }
            fn enter(&self, _: &Id) {}
            fn exit(&self, _: &Id) {}
        }
        let seen = Arc::new(Mutex::new(Vec::new()));
        tracing::subscriber::with_default(Capture(seen.clone()), f);
        let seen = seen.lock().unwrap().clone();
        seen
    }

    /// Issue 57: a pair too long for `train.seq_len` was reported by its index, wrong past a blank
    /// line; each record carries its own line, which the errors about it name.
    #[test]
    fn records_carry_their_file_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let text = r#"{"prompt": "a", "chosen": "b", "rejected": "c"}"#;
        let chat = r#"{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}"#;
        std::fs::write(&path, format!("\n{text}\r\n\n  \n{chat}\n\n")).unwrap();
        let records = read_preference_jsonl(&path).unwrap();
        assert_eq!(records.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 5]);
        // The chat pair needs a template: the error names its line, not its index (2).
        let tokenizer = Tokenizer::train_char("abc");
        let e = encode_pairs_of_file(&path, &records, &tokenizer, None).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:5: ") && e.contains("chat template"), "{e}");
        assert_eq!(encode_pairs_of_file(&path, &records[..1], &tokenizer, None).unwrap().len(), 1);
    }

    /// Issue 57: pairs whose chosen answer is their rejected one train at ln 2 with no gradient:
    /// some are a warning naming their lines, all an error naming the file.
    #[test]
    fn pairs_without_a_preference_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let pair = |c: &str, r: &str| format!("{{\"prompt\": \"q\", \"chosen\": \"{c}\", \"rejected\": \"{r}\"}}\n");
        std::fs::write(&path, [pair("a", "a"), pair("a", "b"), "\n".into(), pair("b", "b")].concat()).unwrap();
        let mut read = None;
        let warned = warnings(|| read = Some(read_preference_jsonl(&path)));
        assert_eq!(read.unwrap().unwrap().len(), 3, "some such pairs are trained on");
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(
            warned[0].contains("2 of 3 pairs have the same chosen and rejected") && warned[0].contains("(lines 1, 4)")
        );
        assert!(warned[0].contains("p.jsonl"), "{}", warned[0]);
        // A file of nothing else is refused; chat pairs compare their messages.
        let m = |role: &str, content: &str| serde_json::json!([{ "role": role, "content": content }]);
        let chat = serde_json::json!({"prompt": m("user", "q"), "chosen": m("assistant", "a"), "rejected": m("assistant", "a")});
        for file in [pair("a", "a").repeat(7), format!("\n{chat}\n{chat}\n")] {
            std::fs::write(&path, &file).unwrap();
            let e = read_preference_jsonl(&path).unwrap_err().to_string();
            let first = if file.starts_with('\n') { ":2: " } else { ":1: " };
            assert!(
                e.contains(&format!("p.jsonl{first}every pair's chosen answer is the same as its rejected")),
                "{e}"
            );
        }
        let e = read_preference_jsonl(&path).unwrap_err().to_string();
        assert!(e.contains("(2 of 2; lines 2, 3)"), "{e}");
        std::fs::write(&path, pair("a", "a").repeat(7)).unwrap();
        let e = read_preference_jsonl(&path).unwrap_err().to_string();
        assert!(e.contains("(7 of 7; lines 1, 2, 3, 4, 5 and 2 more)"), "{e}");
        assert_eq!(line_list(&[3]), "line 3");
        // Answers that differ by a message's role or content are a preference.
        let other = serde_json::json!({"prompt": m("user", "q"), "chosen": m("assistant", "a"), "rejected": m("assistant", "a ")});
        std::fs::write(&path, format!("{chat}\n{other}\n")).unwrap();
        assert_eq!(read_preference_jsonl(&path).unwrap().len(), 2);
    }
}
