//! Multiple-choice tasks whose items continue one context with each choice.

use serde_json::Value;

use crate::error::DocError;
use crate::task::{index, text, texts, Doc, Output, Query, TaskSpec};

/// A multiple-choice task with `acc_norm` as the harness's ARC, HellaSwag, PIQA and OpenBookQA.
fn spec(name: &str, version: &'static str, file: &str, parse: fn(&Value) -> Result<Doc, DocError>) -> TaskSpec {
    TaskSpec {
        random_baseline: 0.25,
        primary: "acc_norm",
        ..TaskSpec::new(name, version, file, Output::MultipleChoice { norm: true }, parse)
    }
}

/// An item whose exemplar answer is its right choice.
pub(crate) fn choice_doc(query: String, choices: Vec<String>, gold: usize) -> Result<Doc, DocError> {
    let answer = choices.get(gold).cloned().ok_or(DocError::Gold { gold, choices: choices.len() })?;
    Ok(Doc { shot: (query.clone(), answer), query: Query::Shared(query), continuations: choices, gold, group: None })
}

/// An `answerKey` that names no choice.
fn answer_key(key: &str, expected: &str) -> DocError {
    DocError::Value { field: "answerKey", found: format!("{key:?}"), expected: expected.into() }
}

/// HellaSwag's WikiHow artefacts removed as the harness's `preprocess` does.
fn preprocess(text: &str) -> String {
    static BRACKETS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = BRACKETS.get_or_init(|| regex::Regex::new(r"\[.*?\]").expect("a valid pattern"));
    let text = text.trim().replace(" [title]", ". ");
    re.replace_all(&text, "").replace("  ", " ")
}

/// Python's `str.capitalize`: the first character upper case, the rest lower case.
fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars.flat_map(char::to_lowercase)).collect(),
        None => String::new(),
    }
}

pub(crate) fn hellaswag() -> TaskSpec {
    spec("hellaswag", "1.0", "hellaswag/hellaswag_val.jsonl", |row| {
        let ctx = format!("{} {}", text(row, "ctx_a")?, capitalize(text(row, "ctx_b")?));
        let query = preprocess(&format!("{}: {ctx}", text(row, "activity_label")?));
        let choices = texts(row, "endings", None)?.iter().map(|e| preprocess(e)).collect();
        choice_doc(query, choices, index(row, "label")?)
    })
}

pub(crate) fn arc(name: &str, file: &str, dev: &str) -> TaskSpec {
    TaskSpec {
        fewshot_file: Some(dev.to_string()),
        ..spec(name, "1.0", file, |row| {
            let labels = texts(row, "choices", Some("label"))?;
            let key = text(row, "answerKey")?;
            let gold = labels.iter().position(|l| l == key).ok_or_else(|| answer_key(key, "one of the labels"))?;
            choice_doc(
                format!("Question: {}\nAnswer:", text(row, "question")?),
                texts(row, "choices", Some("text"))?,
                gold,
            )
        })
    }
}

pub(crate) fn piqa() -> TaskSpec {
    TaskSpec {
        random_baseline: 0.5,
        ..spec("piqa", "1.0", "piqa/piqa_validation.jsonl", |row| {
            let choices = vec![text(row, "sol1")?.to_string(), text(row, "sol2")?.to_string()];
            choice_doc(format!("Question: {}\nAnswer:", text(row, "goal")?), choices, index(row, "label")?)
        })
    }
}

pub(crate) fn boolq() -> TaskSpec {
    TaskSpec {
        output: Output::MultipleChoice { norm: false },
        random_baseline: 0.5,
        primary: "acc",
        ..spec("boolq", "2.0", "boolq/boolq_validation.jsonl", |row| {
            let query = format!("{}\nQuestion: {}?\nAnswer:", text(row, "passage")?, text(row, "question")?);
            choice_doc(query, vec!["no".into(), "yes".into()], index(row, "label")?)
        })
    }
}

pub(crate) fn openbookqa() -> TaskSpec {
    TaskSpec {
        fewshot_file: Some("openbookqa/openbookqa_validation.jsonl".into()),
        ..spec("openbookqa", "1.0", "openbookqa/openbookqa_test.jsonl", |row| {
            let labels = texts(row, "choices", Some("label"))?;
            let key = text(row, "answerKey")?.trim_start();
            let gold = labels.iter().position(|l| l == key).ok_or_else(|| answer_key(key, "one of the labels"))?;
            choice_doc(text(row, "question_stem")?.to_string(), texts(row, "choices", Some("text"))?, gold)
        })
    }
}

pub(crate) fn commonsense_qa() -> TaskSpec {
    TaskSpec {
        output: Output::MultipleChoice { norm: false },
        random_baseline: 0.2,
        primary: "acc",
        ..spec("commonsense_qa", "1.0", "commonsense_qa/commonsense_qa_validation.jsonl", |row| {
            let options = texts(row, "choices", Some("text"))?;
            if options.len() != 5 {
                let found = format!("{} options", options.len());
                return Err(DocError::Value {
                    field: "choices.text",
                    found,
                    expected: "5 (the prompt lists 5)".into(),
                });
            }
            let mut query = format!("Question: {}\n", text(row, "question")?.trim());
            for (letter, option) in ["A", "B", "C", "D", "E"].iter().zip(&options) {
                query.push_str(&format!("{letter}. {option}\n"));
            }
            query.push_str("Answer:");
            let letters: Vec<String> = ["A", "B", "C", "D", "E"].map(String::from).to_vec();
            let key = text(row, "answerKey")?;
            let gold = letters.iter().position(|l| l == key).ok_or_else(|| answer_key(key, "one of A..E"))?;
            choice_doc(query, letters, gold)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellaswag_preprocessing_as_the_harness() {
        assert_eq!(preprocess(" Do it [title] Now [step] go  on "), "Do it. Now go on");
        assert_eq!(capitalize("tHE cat"), "The cat");
        let row = serde_json::json!({"activity_label": "Cooking", "ctx_a": "A man cuts.", "ctx_b": "THEN he",
            "endings": ["eats [title] it", "b"], "label": "1"});
        let doc = (hellaswag().parse)(&row).unwrap();
        assert_eq!(doc.query, Query::Shared("Cooking: A man cuts. Then he".into()));
        assert_eq!(doc.continuations, vec!["eats. it".to_string(), "b".into()]);
        assert_eq!(doc.gold, 1);
    }
}
