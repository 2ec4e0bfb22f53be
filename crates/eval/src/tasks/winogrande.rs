//! WinoGrande with partial scoring (the harness's `winogrande`): each option fills the blank to
//! make a context, and the rest of the sentence after the blank is scored after each.

use crate::error::DocError;
use crate::task::{text, Doc, Output, Query, TaskSpec};

pub(crate) fn winogrande() -> TaskSpec {
    let output = Output::MultipleChoice { norm: false };
    TaskSpec::new("winogrande", "1.0", "winogrande/winogrande_dev.jsonl", output, |row| {
        let sentence = text(row, "sentence")?;
        let blank = sentence.find('_').ok_or_else(|| DocError::Value {
            field: "sentence",
            found: "no blank".into(),
            expected: "a `_` where an option goes".into(),
        })?;
        let options = [text(row, "option1")?, text(row, "option2")?];
        let contexts: Vec<String> = options.iter().map(|o| format!("{}{o}", &sentence[..blank])).collect();
        let target = sentence[blank + 1..].trim().to_string();
        let gold = match text(row, "answer")? {
            "1" => 0,
            "2" => 1,
            other => {
                let found = format!("{other:?}");
                return Err(DocError::Value { field: "answer", found, expected: "\"1\" or \"2\"".into() });
            }
        };
        Ok(Doc {
            shot: (contexts[gold].clone(), target.clone()),
            query: Query::PerChoice(contexts),
            continuations: vec![target],
            gold,
            group: None,
        })
    })
}
