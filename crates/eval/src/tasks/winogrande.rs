//! WinoGrande with partial scoring (the harness's `winogrande`): each option fills the blank to
//! make a context, and the rest of the sentence after the blank is scored after each.

use crate::task::{no_description, text, Doc, Output, Query, Sampler, TaskSpec};

pub(crate) fn winogrande() -> TaskSpec {
    TaskSpec {
        name: "winogrande".into(),
        version: "1.0",
        file: "winogrande/winogrande_dev.jsonl".into(),
        fewshot_file: None,
        fixed_shots: None,
        default_fewshot: 0,
        output: Output::MultipleChoice { norm: false },
        target_delimiter: " ",
        fewshot_delimiter: "\n\n",
        sampler: Sampler::Random,
        parse: |row| {
            let sentence = text(row, "sentence")?;
            let blank = sentence.find('_').ok_or("field `sentence`: no `_` blank")?;
            let options = [text(row, "option1")?, text(row, "option2")?];
            let contexts: Vec<String> = options.iter().map(|o| format!("{}{o}", &sentence[..blank])).collect();
            let target = sentence[blank + 1..].trim().to_string();
            let gold = match text(row, "answer")? {
                "1" => 0,
                "2" => 1,
                other => return Err(format!("field `answer`: {other:?}, expected \"1\" or \"2\"")),
            };
            Ok(Doc {
                shot: (contexts[gold].clone(), target.clone()),
                query: Query::PerChoice(contexts),
                continuations: vec![target],
                gold,
                group: None,
            })
        },
        description: no_description,
        random_baseline: 0.5,
        primary: "acc",
    }
}
