//! LAMBADA (OpenAI's test set): the last word of a passage given the rest; the harness's
//! `lambada_openai` scores its log-likelihood (perplexity) and whether greedy decoding gives it.

use crate::task::{text, Doc, Output, Query, TaskSpec};

pub(crate) fn lambada_openai() -> TaskSpec {
    let file = "lambada_openai/lambada_test.jsonl";
    TaskSpec {
        random_baseline: 0.0,
        ..TaskSpec::new("lambada_openai", "1.0", file, Output::Loglikelihood, |row| {
            let passage = text(row, "text")?;
            // `text.split(' ')[:-1]|join(' ')` and `' ' + text.split(' ')[-1]`.
            let (context, word) = passage.rsplit_once(' ').unwrap_or(("", passage));
            let target = format!(" {word}");
            Ok(Doc {
                query: Query::Shared(context.to_string()),
                shot: (context.to_string(), target.clone()),
                continuations: vec![target],
                gold: 0,
                group: None,
            })
        })
    }
}
