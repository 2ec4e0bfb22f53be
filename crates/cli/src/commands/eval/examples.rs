//! `ember eval --data FILE.jsonl --samples OUT`: every example's scored tokens and the
//! log-probability of each, one JSON line per example, to set beside what a server's `logprobs`
//! say of the same tokens (the completion loss alone is one mean over the file).

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use ember_data::finetune::{encode_of_file, read_jsonl, ChatTemplate, Example};
use ember_data::Tokenizer;
use ember_eval::score::Pair;

/// One example as it is scored: its tokens from the first scored one to the last as the
/// continuation of a pair, and which of them are scored (a chat's turns between two assistant
/// turns are context, not scored).
pub(super) struct Sample {
    line: usize,
    pub(super) pair: Pair,
    scored: Vec<bool>,
}

/// The examples of `path`, tokenized as the completion loss tokenizes them (the prompt, then the
/// completion and the end-of-sequence token, scored).
pub(super) fn read(path: &Path, tokenizer: &Tokenizer, template_dir: &Path) -> anyhow::Result<Vec<Sample>> {
    let records = read_jsonl(path)?;
    let template = ChatTemplate::from_dir(template_dir)?;
    let examples = encode_of_file(path, &records, tokenizer, template.as_ref())?;
    Ok(records.iter().zip(examples).map(|(r, ex)| sample(r.line, ex)).collect())
}

fn sample(line: usize, ex: Example) -> Sample {
    // The first token has nothing before it to predict it from: never scored, as in the loss.
    let first = ex.scored.iter().position(|&s| s).unwrap_or(ex.ids.len()).max(1).min(ex.ids.len());
    let end = ex.scored.iter().rposition(|&s| s).map_or(first, |i| i + 1).max(first);
    let pair = Pair { context: ex.ids[..first].to_vec(), continuation: ex.ids[first..end].to_vec() };
    Sample { line, pair, scored: ex.scored[first..end].to_vec() }
}

/// One line per example: its file line, scored token ids (`tokens`), their log-probabilities
/// (`token_logprobs`, natural log) and the sum (`logprob`).
pub(super) fn write(path: &Path, samples: &[Sample], logprobs: &[Vec<f64>]) -> anyhow::Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for (s, lp) in samples.iter().zip(logprobs) {
        let kept = s.pair.continuation.iter().zip(lp).zip(&s.scored).filter(|(_, &k)| k);
        let (tokens, token_logprobs): (Vec<u32>, Vec<f64>) = kept.map(|((&t, &l), _)| (t, l)).unzip();
        let logprob: f64 = token_logprobs.iter().sum();
        let row = serde_json::json!({
            "line": s.line,
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "logprob": logprob,
        });
        writeln!(out, "{row}").with_context(|| format!("writing {}", path.display()))?;
    }
    out.flush().with_context(|| format!("writing {}", path.display()))
}
