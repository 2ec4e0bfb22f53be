//! Generation tasks: GSM8K (the harness's `gsm8k`, 5 exemplars drawn from the train split, and
//! `gsm8k_cot`, its 8 written chain-of-thought exemplars) and NQ-Open.

use serde_json::Value;

use crate::error::DocError;
use crate::generate::{Filter, Generation};
use crate::task::{text, texts, Doc, Output, Query, Sampler, TaskSpec};

const NUMBER: &str = r"(-?[$0-9.,]{2,})|(-?[0-9]+)";
const GSM8K_IGNORE: &[&str] = &[",", r"\$", r"(?s).*#### ", r"\.$"];

static GSM8K: Generation = Generation {
    until: &["Question:", "</s>", "<|im_end|>"],
    max_gen_toks: 256,
    filters: &[
        ("exact_match_strict", Filter::Regex { pattern: r"#### (\-?[0-9\.\,]+)", last: false }),
        ("exact_match_flexible", Filter::Regex { pattern: NUMBER, last: true }),
    ],
    ignore: GSM8K_IGNORE,
    ignore_case: true,
    ignore_punctuation: false,
};

static GSM8K_COT: Generation = Generation {
    until: &["Q:", "</s>", "<|im_end|>"],
    max_gen_toks: 256,
    filters: &[
        ("exact_match_strict", Filter::Regex { pattern: r"The answer is (\-?[0-9\.\,]+).", last: false }),
        ("exact_match_flexible", Filter::Regex { pattern: NUMBER, last: true }),
    ],
    ignore: GSM8K_IGNORE,
    ignore_case: true,
    ignore_punctuation: false,
};

static NQ_OPEN: Generation = Generation {
    until: &["\n", ".", ","],
    max_gen_toks: 256,
    filters: &[("exact_match", Filter::RemoveWhitespace)],
    ignore: &[r"\b(?:The |the |An |A |The |a |an )"],
    ignore_case: true,
    ignore_punctuation: true,
};

fn generation(
    name: &str,
    version: &'static str,
    file: &str,
    output: &'static Generation,
    parse: fn(&Value) -> Result<Doc, DocError>,
) -> TaskSpec {
    TaskSpec {
        random_baseline: 0.0,
        primary: "exact_match_flexible",
        ..TaskSpec::new(name, version, file, Output::Generate(output), parse)
    }
}

fn doc(query: String, references: Vec<String>, shot_answer: String) -> Doc {
    Doc {
        shot: (query.clone(), shot_answer),
        query: Query::Shared(query),
        continuations: references,
        gold: 0,
        group: None,
    }
}

pub(crate) fn gsm8k() -> TaskSpec {
    TaskSpec {
        fewshot_file: Some("gsm8k/train.jsonl".into()),
        default_fewshot: 5,
        ..generation("gsm8k", "3.0", "gsm8k/test.jsonl", &GSM8K, |row| {
            let answer = text(row, "answer")?.to_string();
            Ok(doc(format!("Question: {}\nAnswer:", text(row, "question")?), vec![answer.clone()], answer))
        })
    }
}

/// The final number of a GSM8K answer (`… #### 72`).
fn final_answer(answer: &str) -> String {
    answer.rsplit("####").next().unwrap_or(answer).trim().to_string()
}

fn cot_doc(question: &str, target: String) -> Doc {
    doc(format!("Q: {question}\nA:"), vec![final_answer(&target)], target)
}

pub(crate) fn gsm8k_cot() -> TaskSpec {
    TaskSpec {
        fixed_shots: Some(|| COT_SHOTS.iter().map(|(q, a)| cot_doc(q, a.to_string())).collect()),
        default_fewshot: 8,
        sampler: Sampler::FirstN,
        ..generation("gsm8k_cot", "3.0", "gsm8k/test.jsonl", &GSM8K_COT, |row| {
            let answer = text(row, "answer")?;
            Ok(cot_doc(text(row, "question")?, final_answer(answer)))
        })
    }
}

pub(crate) fn nq_open() -> TaskSpec {
    TaskSpec {
        fewshot_delimiter: "\n",
        description: |_| "Answer these questions:\n\n".into(),
        primary: "exact_match",
        ..generation("nq_open", "4.0", "nq_open/nq_open_validation.jsonl", &NQ_OPEN, |row| {
            let answers = texts(row, "answer", None)?;
            let first =
                answers.first().cloned().ok_or(DocError::Field { field: "answer".into(), expected: "an answer" })?;
            Ok(doc(format!("Q: {}?\nA:", text(row, "question")?), answers, first))
        })
    }
}

/// The chain-of-thought exemplars of the harness's `gsm8k-cot.yaml` (Wei et al.), in its order.
const COT_SHOTS: [(&str, &str); 8] = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been 21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. The answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. The answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars left. 23 - 15 is 8. The answer is 8."),
];
