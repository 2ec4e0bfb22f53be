//! Rewards of `[[rl.rewards]]`: built-in verifiers (GSM8K's final number, an exact column, a
//! regular expression, a length penalty) and any program that reads the answers as JSON lines and
//! writes one number a line. A reward that cannot score an answer stops the run, naming the row.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::{Map, Value};

use crate::config::{RewardConfig, RewardKind};
use crate::error::TrainError;

/// One answer to score: its prompt (as the model read it), its text and token count, and the row
/// of the prompt file (with its line, for messages).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub tokens: usize,
    pub row: &'a Map<String, Value>,
    /// The prompt's file and line, for messages.
    pub file: &'a std::path::Path,
    pub line: usize,
}

/// The rewards of a run, compiled.
pub(crate) struct Rewards {
    rewards: Vec<(RewardConfig, Option<regex::Regex>)>,
}

/// Each reward's scores (`[reward][answer]`) and their weighted sums.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Scores {
    pub per_reward: Vec<Vec<f64>>,
    pub total: Vec<f64>,
}

impl Rewards {
    /// `config`'s rewards (validated: a regex compiles, each kind has its keys).
    pub(crate) fn new(config: &[RewardConfig]) -> Result<Self, TrainError> {
        let rewards = config
            .iter()
            .map(|r| {
                let re = match (r.kind, &r.pattern) {
                    (RewardKind::Regex, Some(p)) => Some(
                        regex::Regex::new(p)
                            .map_err(|e| TrainError::Rl(format!("reward {}: pattern {p:?}: {e}", r.name())))?,
                    ),
                    _ => None,
                };
                Ok((r.clone(), re))
            })
            .collect::<Result<_, TrainError>>()?;
        Ok(Self { rewards })
    }

    /// The names in the metrics, in order.
    pub(crate) fn names(&self) -> Vec<String> {
        self.rewards.iter().map(|(r, _)| r.name().to_string()).collect()
    }

    /// The row's columns every reward needs, missing from `row`: `(reward, column)`.
    pub(crate) fn missing_columns(&self, row: &Map<String, Value>) -> Option<(String, String)> {
        self.rewards.iter().find_map(|(r, _)| {
            let column = column(r)?;
            (!row.contains_key(column)).then(|| (r.name().to_string(), column.to_string()))
        })
    }

    /// Scores every answer with every reward.
    pub(crate) fn score(&self, items: &[Item<'_>]) -> Result<Scores, TrainError> {
        let mut per_reward = Vec::with_capacity(self.rewards.len());
        for (r, re) in &self.rewards {
            let scores = match r.kind {
                RewardKind::Command => self.command(r, items)?,
                _ => items.iter().map(|item| self.builtin(r, re.as_ref(), item)).collect::<Result<_, _>>()?,
            };
            per_reward.push(scores);
        }
        let total = (0..items.len())
            .map(|i| self.rewards.iter().zip(&per_reward).map(|((r, _), s)| r.weight * s[i]).sum())
            .collect();
        Ok(Scores { per_reward, total })
    }

    fn builtin(&self, r: &RewardConfig, re: Option<&regex::Regex>, item: &Item<'_>) -> Result<f64, TrainError> {
        let gold = || -> Result<String, TrainError> {
            let column = column(r).unwrap_or("answer");
            match item.row.get(column) {
                Some(Value::String(s)) => Ok(s.clone()),
                Some(v @ Value::Number(_)) => Ok(v.to_string()),
                Some(other) => {
                    Err(self.row_error(r, item, format!("column `{column}` is {other}, not a string or a number")))
                }
                None => Err(self.row_error(r, item, format!("the row has no column `{column}`"))),
            }
        };
        Ok(match r.kind {
            RewardKind::Gsm8k => {
                let gold = gold()?;
                let want = gold.rsplit_once("####").map_or(gold.as_str(), |(_, n)| n);
                let want = normalize_number(want);
                match final_number(item.completion) {
                    Some(got) if !want.is_empty() => same_number(&got, &want) as u8 as f64,
                    _ => 0.0,
                }
            }
            RewardKind::Exact => (item.completion.trim() == gold()?.trim()) as u8 as f64,
            RewardKind::Regex => re.is_some_and(|re| re.is_match(item.completion)) as u8 as f64,
            RewardKind::Length => -(item.tokens.saturating_sub(r.limit.unwrap_or(usize::MAX)) as f64),
            RewardKind::Command => unreachable!("commands score a batch"),
        })
    }

    fn row_error(&self, r: &RewardConfig, item: &Item<'_>, message: String) -> TrainError {
        TrainError::Rl(format!("reward {} on {}:{}: {message}", r.name(), item.file.display(), item.line))
    }

    /// Runs the reward's program once for all answers: JSON lines in, one number a line out.
    fn command(&self, r: &RewardConfig, items: &[Item<'_>]) -> Result<Vec<f64>, TrainError> {
        let command = r.command.as_deref().unwrap_or_default();
        let fail = |m: String| TrainError::Rl(format!("reward {} (`{command}`): {m}", r.name()));
        let mut input = Vec::new();
        for item in items {
            // The row as the file has it (its `prompt` text or messages), the prompt as the model
            // read it, and the answer.
            let mut line = item.row.clone();
            line.insert("prompt_text".into(), Value::String(item.prompt.to_string()));
            line.insert("completion".into(), Value::String(item.completion.to_string()));
            serde_json::to_writer(&mut input, &Value::Object(line)).map_err(|e| fail(e.to_string()))?;
            input.push(b'\n');
        }
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| fail(format!("cannot start: {e}")))?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        // Written beside the read, so that a program that answers as it reads cannot block on a
        // full pipe; a program that exits early closes the pipe (reported by its status).
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
        let out = child.wait_with_output().map_err(|e| fail(format!("cannot read its output: {e}")))?;
        let _ = writer.join();
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: String = stderr
                .trim()
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            return Err(fail(format!(
                "exited with {}{}",
                out.status,
                if tail.is_empty() { String::new() } else { format!(": {tail}") }
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.len() != items.len() {
            return Err(fail(format!(
                "wrote {} numbers for {} answers (one a line, in order)",
                lines.len(),
                items.len()
            )));
        }
        lines
            .iter()
            .zip(items)
            .enumerate()
            .map(|(k, (l, item))| match l.trim().parse::<f64>() {
                Ok(v) if v.is_finite() => Ok(v),
                _ => Err(fail(format!(
                    "line {} of its output, for the answer to {}:{}, is {:?}: not a finite number",
                    k + 1,
                    item.file.display(),
                    item.line,
                    l.trim()
                ))),
            })
            .collect()
    }
}

/// The column a reward reads.
fn column(r: &RewardConfig) -> Option<&str> {
    match r.kind {
        RewardKind::Gsm8k => Some(r.column.as_deref().unwrap_or("answer")),
        RewardKind::Exact => r.column.as_deref(),
        _ => None,
    }
}

/// The answer's final number: after its last `####`, else the last number it writes.
pub(crate) fn final_number(text: &str) -> Option<String> {
    static NUMBER: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let number = NUMBER.get_or_init(|| regex::Regex::new(r"-?[$0-9.,]*[0-9]").expect("a valid pattern"));
    let scope = text.rsplit_once("####").map_or(text, |(_, after)| after);
    let found = if text.contains("####") { number.find(scope) } else { number.find_iter(scope).last() };
    found.map(|m| normalize_number(m.as_str())).filter(|n| !n.is_empty())
}

/// A number as written, without `$`, thousands commas, spaces or a final period.
fn normalize_number(s: &str) -> String {
    let s: String = s.trim().chars().filter(|c| !matches!(c, ',' | '$' | ' ')).collect();
    s.trim_end_matches('.').to_string()
}

/// Equal as numbers (`72.0` and `72`), or as text where one does not parse.
fn same_number(a: &str, b: &str) -> bool {
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => (x - y).abs() <= 1e-9 * y.abs().max(1.0),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn reward(toml: &str) -> RewardConfig {
        toml::from_str(toml).unwrap()
    }

    fn row(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn builtin_rewards_score_as_documented() {
        let rewards = Rewards::new(&[
            reward("kind = \"gsm8k\""),
            reward("kind = \"exact\"\ncolumn = \"word\""),
            reward("kind = \"regex\"\npattern = \"^<think>\"\nweight = 0.5"),
            reward("kind = \"length\"\nlimit = 3"),
        ])
        .unwrap();
        let r = row(serde_json::json!({"answer": "She pays 3 * 24 = 72.\n#### 72", "word": " yes"}));
        let item = |completion: &'static str, tokens| Item {
            prompt: "q",
            completion,
            tokens,
            row: &r,
            file: Path::new("p.jsonl"),
            line: 4,
        };
        let s = rewards
            .score(&[item("<think>6 * 12 = 72 dollars", 2), item("#### 7,200\nthen 72", 5), item("yes ", 3)])
            .unwrap();
        assert_eq!(s.per_reward[0], [1.0, 0.0, 0.0]);
        assert_eq!(s.per_reward[1], [0.0, 0.0, 1.0]);
        assert_eq!(s.per_reward[2], [1.0, 0.0, 0.0]);
        assert_eq!(s.per_reward[3], [0.0, -2.0, 0.0]);
        assert_eq!(s.total, [1.5, -2.0, 1.0]);
        assert_eq!(final_number("The total is $1,234.50."), Some("1234.50".into()));
        assert_eq!(final_number("no digits"), None);
        assert!(same_number("72.0", "72"));

        let missing = row(serde_json::json!({"word": "x"}));
        let err = rewards
            .score(&[Item {
                prompt: "q",
                completion: "1",
                tokens: 1,
                row: &missing,
                file: Path::new("p.jsonl"),
                line: 9,
            }])
            .unwrap_err();
        assert_eq!(err.to_string(), "[rl] reward gsm8k on p.jsonl:9: the row has no column `answer`");
        assert_eq!(rewards.missing_columns(&missing), Some(("gsm8k".into(), "answer".into())));
    }

    #[test]
    fn a_command_reads_json_lines_and_its_failures_name_the_row() {
        let r = row(serde_json::json!({"answer": "5"}));
        let items = [
            Item { prompt: "2 + 3 =", completion: " 5", tokens: 1, row: &r, file: Path::new("p.jsonl"), line: 1 },
            Item { prompt: "2 + 3 =", completion: " 6", tokens: 1, row: &r, file: Path::new("p.jsonl"), line: 2 },
        ];
        // Each line's completion against its answer, by a shell program.
        let script = r#"while read -r l; do case "$l" in *'"completion":" 5"'*) echo 1;; *) echo 0.25;; esac; done"#;
        let rewards = Rewards::new(&[reward(&format!("kind = \"command\"\ncommand = '''{script}'''"))]).unwrap();
        assert_eq!(rewards.score(&items).unwrap().total, [1.0, 0.25]);
        for (command, want) in [
            ("cat >/dev/null; echo 1; echo oops", "line 2 of its output, for the answer to p.jsonl:2, is \"oops\""),
            ("cat >/dev/null; echo boom >&2; exit 3", "exited with exit status: 3: boom"),
            ("cat >/dev/null; echo 1", "wrote 1 numbers for 2 answers"),
        ] {
            let rewards = Rewards::new(&[reward(&format!("kind = \"command\"\ncommand = '{command}'"))]).unwrap();
            let err = rewards.score(&items).unwrap_err().to_string();
            assert!(err.contains(want), "{command}: {err}");
        }
    }
}
