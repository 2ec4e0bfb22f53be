//! LAMBADA (OpenAI's test set): the last word of a passage given the rest; the harness's
//! `lambada_openai` scores its log-likelihood (perplexity) and whether greedy decoding gives it.

use crate::task::{no_description, text, Doc, Output, Query, Sampler, TaskSpec};

pub(crate) fn lambada_openai() -> TaskSpec {
    TaskSpec {
        name: "lambada_openai".into(),
        version: "1.0",
        file: "lambada_openai/lambada_test.jsonl".into(),
        fewshot_file: None,
        fixed_shots: None,
        default_fewshot: 0,
        output: Output::Loglikelihood,
        target_delimiter: " ",
        fewshot_delimiter: "\n\n",
        sampler: Sampler::Random,
        parse: |row| {
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
        },
        description: no_description,
        random_baseline: 0.0,
        primary: "acc",
    }
}
