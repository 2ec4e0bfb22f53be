//! Generation tasks (GSM8K, NQ-Open): greedy continuations until a stop string, as the harness's
//! `generate_until` requests are answered, then its filters (a regex's match, whitespace removed)
//! and its `exact_match` against the references. Under a JSON Schema (`--json-schema`) each answer
//! is generated under the schema instead, and ends where its JSON does.

use ember_data::Tokenizer;
use ember_generate::constraint::Constraint;
use ember_generate::sample::{generate_batch_constrained, GenerateOptions, Sampler, SamplingConfig};
use ember_kernels::EmberBackend;
use ember_model::Decoder;

use crate::error::EvalError;
use crate::schema::Schema;

/// A generation task's settings and scoring, as its harness YAML has them.
#[derive(Debug)]
pub struct Generation {
    /// Stop strings: the text is cut at the first of them (the model's EOS token ends it too).
    pub until: &'static [&'static str],
    /// New tokens at most (the harness's `max_gen_toks`, 256).
    pub max_gen_toks: usize,
    /// Each filter gives one metric: (metric name, the filter before `exact_match`).
    pub filters: &'static [(&'static str, Filter)],
    /// `exact_match`'s `regexes_to_ignore`, removed from the prediction and the reference.
    pub ignore: &'static [&'static str],
    pub ignore_case: bool,
    pub ignore_punctuation: bool,
}

/// One of the harness's filters, followed by `take_first`.
#[derive(Debug, Clone, Copy)]
pub enum Filter {
    /// `regex`: the first (or, with `last`, the last) match; of a pattern with groups, the match's
    /// first non-empty group; `[invalid]` when nothing matches.
    Regex { pattern: &'static str, last: bool },
    /// `remove_whitespace`: leading whitespace removed.
    RemoveWhitespace,
}

impl Filter {
    pub fn apply(&self, text: &str) -> String {
        match self {
            Filter::RemoveWhitespace => text.trim_start().to_string(),
            Filter::Regex { pattern, last } => {
                let re = regex::Regex::new(pattern).expect("the task's own pattern compiles");
                let found: Vec<regex::Captures> = re.captures_iter(text).collect();
                let Some(m) = (if *last { found.last() } else { found.first() }) else {
                    return "[invalid]".into();
                };
                let picked = match m.len() {
                    1 => m.get(0).map(|g| g.as_str()),
                    _ => m.iter().skip(1).flatten().map(|g| g.as_str()).find(|s| !s.is_empty()),
                };
                picked.map_or_else(|| "[invalid]".into(), |s| s.trim().to_string())
            }
        }
    }
}

impl Generation {
    /// The harness's `exact_match` of one prediction against any of the references.
    pub fn exact_match(&self, prediction: &str, references: &[String]) -> bool {
        let norm = |s: &str| {
            let mut s = s.to_string();
            for pattern in self.ignore {
                s = regex::Regex::new(pattern)
                    .expect("the task's own pattern compiles")
                    .replace_all(&s, "")
                    .into_owned();
            }
            if self.ignore_case {
                s = s.to_lowercase();
            }
            if self.ignore_punctuation {
                s.retain(|c| !c.is_ascii_punctuation());
            }
            s
        };
        let p = norm(prediction);
        references.iter().any(|r| norm(r) == p)
    }

    /// The text a generation ends with: cut at each stop string in turn.
    pub fn cut(&self, text: &str) -> String {
        let mut s = text;
        for stop in self.until {
            if let Some(at) = s.find(stop) {
                s = &s[..at];
            }
        }
        s.to_string()
    }
}

/// Greedy continuations of `prompts`, `batch` at a time (prompts of similar lengths together), each
/// until a stop string, the model's EOS token or `max_gen_toks`; the texts cut at the stop strings.
/// Under `schema` each continuation is JSON of the schema and the stop strings do not apply (NQ-Open
/// stops at `,` and `.`, which JSON holds): it ends where the JSON does (or at `max_gen_toks`).
pub fn generate<B: EmberBackend>(
    model: &Decoder<B>,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    spec: &Generation,
    schema: Option<&Schema>,
    batch: usize,
    mut done: impl FnMut(usize),
) -> Result<Vec<String>, EvalError> {
    let until = if schema.is_some() { &[][..] } else { spec.until };
    let options = GenerateOptions {
        max_new_tokens: spec.max_gen_toks,
        stop_tokens: tokenizer.eos_id().into_iter().collect(),
        block_size: 16,
    };
    let greedy = SamplingConfig { temperature: 0.0, top_k: None, top_p: None, repetition_penalty: 1.0 };
    let mut order: Vec<usize> = (0..prompts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(prompts[i].len()));
    let mut texts = vec![String::new(); prompts.len()];
    for chunk in order.chunks(batch.max(1)) {
        let batch_prompts: Vec<Vec<u32>> = chunk.iter().map(|&i| prompts[i].clone()).collect();
        let mut samplers = (0..chunk.len())
            .map(|_| Sampler::new(greedy.clone(), 0))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EvalError::Generate(e.to_string()))?;
        let mut constraints = constraints(schema, chunk.len())?;
        let mut so_far: Vec<Vec<u32>> = vec![Vec::new(); chunk.len()];
        let outputs =
            generate_batch_constrained(model, &batch_prompts, &options, &mut samplers, &mut constraints, |b, id| {
                if until.is_empty() {
                    return true;
                }
                so_far[b].push(id);
                let text = tokenizer.decode_skipping_special(&so_far[b]).unwrap_or_default();
                !until.iter().any(|stop| text.contains(stop))
            })
            .map_err(|e| EvalError::Generate(e.to_string()))?;
        for (&i, out) in chunk.iter().zip(outputs) {
            let text = tokenizer.decode_skipping_special(&out)?;
            texts[i] = if schema.is_some() { text } else { spec.cut(&text) };
        }
        done(chunk.len());
    }
    Ok(texts)
}

/// One constraint of `schema` per sequence of a batch of `n` (none without a schema).
fn constraints(schema: Option<&Schema>, n: usize) -> Result<Vec<Option<Box<dyn Constraint>>>, EvalError> {
    (0..n)
        .map(|_| schema.map(Schema::constraint).transpose())
        .collect::<Result<_, _>>()
        .map_err(|e| EvalError::Generate(format!("--json-schema: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GSM8K: Generation = Generation {
        until: &["Question:", "</s>", "<|im_end|>"],
        max_gen_toks: 256,
        filters: &[
            ("strict", Filter::Regex { pattern: r"#### (\-?[0-9\.\,]+)", last: false }),
            ("flexible", Filter::Regex { pattern: r"(-?[$0-9.,]{2,})|(-?[0-9]+)", last: true }),
        ],
        ignore: &[",", r"\$", r"(?s).*#### ", r"\.$"],
        ignore_case: true,
        ignore_punctuation: false,
    };

    #[test]
    fn filters_and_exact_match_as_the_harness() {
        let text = " She sells 16 - 3 - 4 = 9 eggs.\nSo she makes $18.\n#### 1,800\n\nQuestion: next";
        let cut = GSM8K.cut(text);
        assert_eq!(cut, " She sells 16 - 3 - 4 = 9 eggs.\nSo she makes $18.\n#### 1,800\n\n");
        assert_eq!(GSM8K.filters[0].1.apply(&cut), "1,800");
        assert_eq!(GSM8K.filters[1].1.apply(&cut), "1,800");
        assert_eq!(GSM8K.filters[0].1.apply("no number"), "[invalid]");
        assert_eq!(GSM8K.filters[1].1.apply("it is 7 then"), "7");
        let reference = vec!["Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 1800".to_string()];
        assert!(GSM8K.exact_match("1,800", &reference));
        assert!(GSM8K.exact_match("$1800.", &reference));
        assert!(!GSM8K.exact_match("180", &reference));
    }
}
