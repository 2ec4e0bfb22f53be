//! The tasks ember knows, each as lm-evaluation-harness defines it (prompt text, choices, target
//! delimiter, few-shot pool and sampler, metrics), over the files laid out as `shared/evals` is.
//! A new task is one function here or in a file beside this one, and one line in [`registry`].

mod blimp;
mod choice;
mod generation;
mod lambada;
mod mmlu;
mod winogrande;

use crate::error::EvalError;
use crate::task::TaskSpec;

pub use blimp::PARADIGMS as BLIMP_PARADIGMS;

/// Every task by name, BLiMP's 67 paradigms as `blimp_<paradigm>`.
pub fn registry() -> Vec<TaskSpec> {
    let mut tasks = vec![
        choice::hellaswag(),
        choice::arc("arc_easy", "arc_easy/ARC-Easy-Test.jsonl", "arc_easy/ARC-Easy-Dev.jsonl"),
        choice::arc("arc_challenge", "arc_challenge/ARC-Challenge-Test.jsonl", "arc_challenge/ARC-Challenge-Dev.jsonl"),
        choice::piqa(),
        choice::boolq(),
        choice::openbookqa(),
        choice::commonsense_qa(),
        winogrande::winogrande(),
        mmlu::mmlu(),
        lambada::lambada_openai(),
        generation::gsm8k(),
        generation::gsm8k_cot(),
        generation::nq_open(),
    ];
    tasks.extend(blimp::PARADIGMS.iter().map(|p| blimp::paradigm(p)));
    tasks
}

/// The tasks a `--tasks` list names, in its order: task names, `blimp` for all of BLiMP's
/// paradigms, each optionally with `:N` (its first N items).
pub fn select(list: &str) -> Result<Vec<(TaskSpec, Option<usize>)>, EvalError> {
    let all = registry();
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, limit) = match entry.split_once(':') {
            Some((name, n)) => {
                let n: usize = n.parse().map_err(|_| EvalError::Limit(entry.to_string()))?;
                (name, Some(n))
            }
            None => (entry, None),
        };
        let found: Vec<TaskSpec> = match name {
            "blimp" => all.iter().filter(|t| t.name.starts_with("blimp_")).cloned().collect(),
            _ => all.iter().filter(|t| t.name == name).cloned().collect(),
        };
        if found.is_empty() {
            let mut names: Vec<&str> =
                all.iter().map(|t| t.name.as_str()).filter(|n| !n.starts_with("blimp_")).collect();
            names.push("blimp");
            return Err(EvalError::UnknownTask { name: name.to_string(), known: names.join(", ") });
        }
        out.extend(found.into_iter().map(|t| (t, limit)));
    }
    if out.is_empty() {
        return Err(EvalError::UnknownTask { name: list.to_string(), known: "a comma-separated list".into() });
    }
    Ok(out)
}
