//! MMLU (57 subjects, the harness's default `mmlu` prompt): the question with lettered options,
//! the letter scored; per subject a description and the first exemplars of its dev split. The
//! task's `acc` is over all items (the harness's group average weighted by size).

use serde_json::Value;

use crate::error::DocError;
use crate::task::{index, text, texts, Doc, Output, Sampler, TaskSpec};

fn parse(row: &Value) -> Result<Doc, DocError> {
    let choices = texts(row, "choices", None)?;
    if choices.len() != 4 {
        let found = format!("{} options", choices.len());
        return Err(DocError::Value { field: "choices", found, expected: "4 (the prompt lists 4)".into() });
    }
    let mut query = format!("{}\n", text(row, "question")?.trim());
    for (letter, option) in ["A", "B", "C", "D"].iter().zip(&choices) {
        query.push_str(&format!("{letter}. {option}\n"));
    }
    query.push_str("Answer:");
    let letters = ["A", "B", "C", "D"].map(String::from).to_vec();
    let mut doc = super::choice::choice_doc(query, letters, index(row, "answer")?)?;
    doc.group = Some(text(row, "subject")?.to_string());
    Ok(doc)
}

fn description(subject: Option<&str>) -> String {
    let subject = subject.unwrap_or_default().replace('_', " ");
    format!("The following are multiple choice questions (with answers) about {subject}.\n\n")
}

pub(crate) fn mmlu() -> TaskSpec {
    TaskSpec {
        fewshot_file: Some("mmlu/mmlu_dev.jsonl".into()),
        sampler: Sampler::FirstN,
        description,
        random_baseline: 0.25,
        ..TaskSpec::new("mmlu", "1.0", "mmlu/mmlu_test.jsonl", Output::MultipleChoice { norm: false }, parse)
    }
}
