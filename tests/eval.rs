//! `ember eval --tasks` against lm-evaluation-harness itself: on SmolLM2-135M-Instruct (the shared
//! GGUF), the same requests (prompt and continuation texts, few-shot exemplars drawn as the harness
//! draws them) and the same per-item log-likelihoods within 1e-4 relative, on slices of every
//! log-likelihood task, zero- and few-shot. The harness's numbers were made once by
//! tests/fixtures/eval/make_reference.py (lm_eval 0.4.9.1, transformers, float32) and committed.

mod assets;
mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};

use common::{assert_clean_error, assets, stderr, Scratch, SMOLLM2_GGUF};
use serde_json::{json, Value};

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/eval").join(name);
    serde_json::from_str(&std::fs::read_to_string(path).expect("the committed fixture")).expect("JSON")
}

fn evals() -> PathBuf {
    let dir = assets().join("evals");
    assert!(dir.is_dir(), "{} not found: set EMBER_TEST_ASSETS to the folder holding evals/", dir.display());
    dir
}

#[test]
fn log_likelihoods_equal_the_harness_on_smollm2() {
    let gguf = format!("gguf:{}", assets().join(SMOLLM2_GGUF).display());
    let compared = parity(&fixture("harness_smollm2.json"), &gguf, &[]);
    assert!(compared > 500, "only {compared} log-likelihoods compared");
}

/// Gemma 3 270M (the Q4_K_M file): its BOS before every context, its 262k-row head.
#[test]
fn log_likelihoods_equal_the_harness_on_gemma3() {
    let gguf = format!("gguf:{}", assets::gemma3_gguf().display());
    let compared = parity(&fixture("harness_gemma3.json"), &gguf, &[]);
    assert!(compared > 200, "only {compared} log-likelihoods compared");
}

/// `--chat` as the harness's `--apply_chat_template`: SmolLM2's template (its default system turn,
/// or MMLU's description as the system turn), exemplars and question in one user turn, the choices
/// right after the assistant's turn opens.
#[test]
fn chat_prompts_equal_the_harness_apply_chat_template() {
    let gguf = format!("gguf:{}", assets().join(SMOLLM2_GGUF).display());
    let compared = parity(&fixture("harness_smollm2_chat.json"), &gguf, &["--chat"]);
    assert!(compared >= 6 * 4 + 4 * 4 + 4 * 4, "only {compared} log-likelihoods compared");
}

/// Runs `ember eval` on `model` (with `extra` flags) for every run of `fixture` and compares
/// requests, log-likelihoods, greedy flags and metrics; the number of log-likelihoods compared.
fn parity(fixture: &Value, model: &str, extra: &[&str]) -> usize {
    let runs = fixture["runs"].as_array().expect("runs");
    // One ember call per (shots, limit): its tasks together.
    let mut calls: BTreeMap<(u64, u64), Vec<&Value>> = BTreeMap::new();
    for run in runs {
        let key = (run["num_fewshot"].as_u64().unwrap(), run["limit"].as_u64().unwrap());
        calls.entry(key).or_default().push(run);
    }
    let s = Scratch::new();
    let evals = evals();
    let mut compared = 0;
    for ((shots, limit), runs) in calls {
        let tasks: Vec<&str> = runs.iter().map(|r| r["task"].as_str().unwrap()).collect();
        let (shots, limit) = (shots.to_string(), limit.to_string());
        let out = s.ember(
            &[
                "eval",
                "--checkpoint",
                model,
                "--tasks",
                &tasks.join(","),
                "--limit",
                &limit,
                "--num-fewshot",
                &shots,
                "--eval-dir",
                evals.to_str().unwrap(),
                "--samples",
                "samples.jsonl",
                "--json",
            ]
            .iter()
            .chain(extra)
            .copied()
            .collect::<Vec<&str>>(),
        );
        assert!(out.status.success(), "ember eval failed: {}", stderr(&out));
        let report: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
        let text = std::fs::read_to_string(s.path().join("samples.jsonl")).expect("--samples file");
        let samples: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
        for run in runs {
            let task = run["task"].as_str().unwrap();
            let docs = run["docs"].as_array().unwrap();
            let mine: Vec<&Value> = samples.iter().filter(|x| x["task"] == task).collect();
            assert_eq!(mine.len(), docs.len(), "{task} ({shots}-shot): items");
            for (m, h) in mine.iter().zip(docs) {
                let id = &h["doc_id"];
                assert_eq!(m["requests"], h["requests"], "{task} ({shots}-shot) doc {id}: requests");
                let (ml, hl) = (m["loglikelihoods"].as_array().unwrap(), h["loglikelihoods"].as_array().unwrap());
                for (a, b) in ml.iter().zip(hl) {
                    let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
                    assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{task} ({shots}-shot) doc {id}: {a} vs {b}");
                    compared += 1;
                }
                assert_eq!(m["greedy"], h["greedy"], "{task} ({shots}-shot) doc {id}: greedy");
            }
            for (metric, value) in run["metrics"].as_object().unwrap() {
                let got = &report["results"][task][metric];
                let (got, want) = (got.as_f64().unwrap_or(f64::NAN), value.as_f64().unwrap());
                // Perplexity's stderr is bootstrapped by the harness; ember's is the delta method.
                if metric == "perplexity_stderr" {
                    continue;
                }
                // Accuracies exactly; perplexity as the log-likelihoods it is made of.
                let tol = if metric == "perplexity" { 1e-4 * want } else { 1e-9 };
                assert!((got - want).abs() <= tol, "{task} ({shots}-shot) {metric}: {got} vs {want}");
            }
        }
    }
    compared
}

#[test]
fn bad_task_lists_and_folders_are_named() {
    let s = Scratch::new();
    let gguf = format!("gguf:{}", assets().join(SMOLLM2_GGUF).display());
    let evals = evals();
    let dir = evals.to_str().unwrap();
    let out = s.ember(&["eval", "--checkpoint", &gguf, "--tasks", "hellaswag,nope", "--eval-dir", dir]);
    assert_clean_error(&out, "unknown task `nope`; known tasks: hellaswag");
    let out = s.ember(&["eval", "--checkpoint", &gguf, "--tasks", "piqa:ten", "--eval-dir", dir]);
    assert_clean_error(&out, "`piqa:ten`: the count after `:` must be a whole number");
    let out = s.ember_env(&["eval", "--checkpoint", &gguf, "--tasks", "piqa"], &[("EMBER_EVAL_DIR", "")]);
    assert_clean_error(&out, "no evaluation folder");
    // A folder without the task's file, and a file with a broken row: both named.
    let out = s.ember(&["eval", "--checkpoint", &gguf, "--tasks", "piqa", "--eval-dir", s.path().to_str().unwrap()]);
    assert_clean_error(&out, "piqa/piqa_validation.jsonl");
    std::fs::create_dir_all(s.path().join("piqa")).unwrap();
    s.write("piqa/piqa_validation.jsonl", "{\"goal\": \"g\", \"sol1\": \"a\", \"sol2\": \"b\", \"label\": 0}\n{\"goal\": 3, \"sol1\": \"a\", \"sol2\": \"b\", \"label\": 0}\n");
    let out = s.ember(&["eval", "--checkpoint", &gguf, "--tasks", "piqa", "--eval-dir", s.path().to_str().unwrap()]);
    assert_clean_error(&out, "piqa_validation.jsonl line 2: field `goal`: expected a string");
    let out =
        s.ember(&["eval", "--checkpoint", &gguf, "--tasks", "arc_easy", "--num-fewshot", "999", "--eval-dir", dir]);
    assert_clean_error(&out, "--num-fewshot 999: the few-shot pool has only 570 items");
    let out = s.ember(&["eval", "--checkpoint", &gguf, "--tasks", "piqa:0", "--eval-dir", dir]);
    assert_clean_error(&out, "task piqa: nothing to score: a limit of 0 items");
    let out = s.ember(&["eval", "--checkpoint", &gguf, "--data", "x.txt", "--limit", "3"]);
    assert_clean_error(&out, "--limit is a flag of `--tasks`");
}

/// `[eval] tasks` during a LoRA fine-tune of SmolLM2: each evaluation writes the tasks' metrics
/// beside the val loss (metrics.jsonl, the TensorBoard events), equal to what `ember eval --tasks`
/// says of the checkpoint saved at that step.
#[test]
fn tasks_are_scored_at_every_evaluation_of_a_run() {
    let s = Scratch::new();
    let gguf = assets().join(SMOLLM2_GGUF);
    let rows: String = (0..16)
        .map(|_| format!("{}\n", serde_json::json!({"prompt": "Q: the sky?", "completion": " A: blue."})))
        .collect();
    s.write("sky.jsonl", &rows);
    let evals = evals();
    let config = common::lora_config("smol", "sky.jsonl", 2, 2, 1e-3, 3)
        .replace("init_from = \"run:smol\"", &format!("init_from = \"gguf:{}\"", gguf.display()))
        + &format!("\n[eval]\ntasks = [\"arc_easy:6\", \"winogrande:4\"]\ndir = \"{}\"\n", evals.display());
    s.write("lora.toml", &config);
    let out = s.ember(&["train", "--config", "lora.toml", "--run-dir", "ft"]);
    assert!(out.status.success(), "train failed: {}", stderr(&out));
    assert!(stderr(&out).contains("step 2: arc_easy acc_norm"), "{}", stderr(&out));
    let log = std::fs::read_to_string(s.path().join("ft/metrics.jsonl")).unwrap();
    let last: Value = log
        .lines()
        .rev()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r.get("val_loss").is_some())
        .unwrap();
    assert_eq!(last["step"], 2);
    for key in ["eval/arc_easy/acc", "eval/arc_easy/acc_norm", "eval/winogrande/acc", "eval/core"] {
        assert!(last[key].as_f64().is_some(), "{key} missing in {last}");
    }
    let events = std::fs::read_dir(s.path().join("ft"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .expect("an events file");
    let bytes = std::fs::read(events).unwrap();
    assert!(bytes.windows(b"eval/arc_easy/acc_norm".len()).any(|w| w == b"eval/arc_easy/acc_norm"));
    // The same numbers from the saved checkpoint (base + adapters), through `ember eval`.
    let out = s.ember(&[
        "eval",
        "--checkpoint",
        "ft",
        "--tasks",
        "arc_easy:6,winogrande:4",
        "--eval-dir",
        evals.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    for (task, metric) in [("arc_easy", "acc"), ("arc_easy", "acc_norm"), ("winogrande", "acc")] {
        let (a, b) = (
            report["results"][task][metric].as_f64().unwrap(),
            last[format!("eval/{task}/{metric}")].as_f64().unwrap(),
        );
        assert!((a - b).abs() < 1e-9, "{task} {metric}: ember eval {a}, in the run {b}");
    }
    // An unknown task is refused before training, naming the key.
    s.write("bad.toml", &config.replace("\"winogrande:4\"", "\"winogrand\""));
    let out = s.ember(&["train", "--config", "bad.toml", "--run-dir", "bad"]);
    assert_clean_error(&out, "eval.tasks: unknown task `winogrand`");
}

/// GSM8K (5-shot and chain-of-thought 8-shot) and NQ-Open: on the harness's own generations
/// (SmolLM2, greedy), ember's filters extract the same answers and its exact match agrees, item by
/// item (100 GSM8K items, 20 chain-of-thought, 40 NQ-Open); and ember's prompts and greedy
/// generations equal the harness's on the first items.
#[test]
fn generation_tasks_extract_and_generate_as_the_harness() {
    let fixture = fixture("harness_smollm2_generate.json");
    let registry = ember_eval::tasks::registry();
    let mut extracted = 0;
    for run in fixture["runs"].as_array().unwrap() {
        let task = run["task"].as_str().unwrap();
        let spec = registry.iter().find(|t| t.name == task).unwrap();
        let ember_eval::task::Output::Generate(g) = spec.output else { panic!("{task} generates") };
        for doc in run["docs"].as_array().unwrap() {
            let text = doc["generation"].as_str().unwrap();
            let targets: Vec<String> = match &doc["target"] {
                Value::String(t) => vec![t.clone()],
                Value::Array(ts) => ts.iter().map(|t| t.as_str().unwrap().to_string()).collect(),
                other => panic!("target {other}"),
            };
            // The harness's filter names, in the order of ember's metrics.
            let names: &[&str] =
                if task == "nq_open" { &["remove_whitespace"] } else { &["strict-match", "flexible-extract"] };
            for ((_, filter), name) in g.filters.iter().zip(names) {
                let want = &doc["filters"][name];
                let got = filter.apply(&g.cut(text));
                assert_eq!(got, want["filtered"].as_str().unwrap(), "{task} doc {} {name}", doc["doc_id"]);
                let matched = g.exact_match(&got, &targets);
                assert_eq!(
                    matched,
                    want["exact_match"].as_f64().unwrap() == 1.0,
                    "{task} doc {} {name}",
                    doc["doc_id"]
                );
                extracted += 1;
            }
        }
    }
    assert!(extracted >= 2 * 100 + 2 * 20 + 40, "{extracted} answers compared");

    // ember's own greedy generations on the first items.
    let s = Scratch::new();
    let gguf = format!("gguf:{}", assets().join(SMOLLM2_GGUF).display());
    let out = s.ember(&[
        "eval",
        "--checkpoint",
        &gguf,
        "--tasks",
        "gsm8k:3,nq_open:8",
        "--eval-dir",
        evals().to_str().unwrap(),
        "--samples",
        "gen.jsonl",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(s.path().join("gen.jsonl")).unwrap();
    for line in text.lines() {
        let mine: Value = serde_json::from_str(line).unwrap();
        let task = mine["task"].as_str().unwrap();
        let run = fixture["runs"].as_array().unwrap().iter().find(|r| r["task"] == task).unwrap();
        let theirs = &run["docs"][mine["doc_id"].as_u64().unwrap() as usize];
        assert_eq!(mine["requests"][0][0], theirs["prompt"], "{task} doc {}: prompt", mine["doc_id"]);
        let generated = mine["generated"]["text"].as_str().unwrap();
        let harness = theirs["generation"].as_str().unwrap();
        let spec = registry.iter().find(|t| t.name == task).unwrap();
        let ember_eval::task::Output::Generate(g) = spec.output else { unreachable!() };
        assert_eq!(generated, g.cut(harness), "{task} doc {}: generation", mine["doc_id"]);
    }
}

/// `--json-schema`: the generation tasks' answers are JSON of the schema (SmolLM2, two items of
/// GSM8K and of NQ-Open, whose stop strings `,` and `.` would cut JSON), a log-likelihood task
/// beside them scored as without it; a list of log-likelihood tasks alone is refused, and so is a
/// schema the grammar engine refuses, each by the flag and the file.
#[test]
fn generation_answers_follow_the_json_schema() {
    let s = Scratch::new();
    let gguf = format!("gguf:{}", assets().join(SMOLLM2_GGUF).display());
    let evals = evals();
    let dir = evals.to_str().unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 24}, "sure": {"enum": ["yes", "no"]}},
        "required": ["answer", "sure"],
        "additionalProperties": false,
    });
    s.write("schema.json", &schema.to_string());
    let tasks = "gsm8k:2,nq_open:2,arc_easy:2";
    let args = ["eval", "--checkpoint", &gguf, "--eval-dir", dir, "--json-schema", "schema.json"];
    let out = s.ember(&[&args[..], &["--tasks", tasks, "--samples", "json.jsonl"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(s.path().join("json.jsonl")).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 6);
    for line in &lines {
        let task = line["task"].as_str().unwrap();
        if task == "arc_easy" {
            assert!(line["generated"].is_null() && !line["loglikelihoods"].as_array().unwrap().is_empty(), "{line}");
            continue;
        }
        let answer = line["generated"]["text"].as_str().unwrap();
        let json: Value =
            serde_json::from_str(answer).unwrap_or_else(|e| panic!("{task}: {answer:?} is not JSON: {e}"));
        let object = json.as_object().unwrap_or_else(|| panic!("{task}: {answer} is not an object"));
        assert_eq!(object.keys().collect::<Vec<_>>(), ["answer", "sure"], "{task}: {answer}");
        assert!(object["answer"].as_str().is_some_and(|a| a.chars().count() <= 24), "{task}: {answer}");
        assert!(["yes", "no"].contains(&object["sure"].as_str().unwrap_or("")), "{task}: {answer}");
    }
    let out = s.ember(&[&args[..], &["--tasks", "arc_easy:2"]].concat());
    assert_clean_error(&out, "--json-schema constrains the answers of generation tasks");
    s.write("bad.json", r#"{"type": "blob"}"#);
    let out = s.ember(&[
        "eval",
        "--checkpoint",
        &gguf,
        "--eval-dir",
        dir,
        "--tasks",
        "nq_open:2",
        "--json-schema",
        "bad.json",
    ]);
    assert_clean_error(&out, "--json-schema bad.json: invalid JSON schema");
}

/// `ember serve`, killed when dropped: its child and address.
struct Served(Child, String);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Served {
    /// Starts `ember serve` on `run`, on a free port (as tests/serve.rs does).
    fn start(s: &Scratch, run: &std::path::Path) -> Self {
        let log = std::fs::File::create(s.path().join("serve.log")).unwrap();
        let args = ["serve", "--checkpoint", run.to_str().unwrap(), "--port", "0"];
        let mut child = s.command(&args).stdout(Stdio::piped()).stderr(log).spawn().expect("start ember serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("the listening line");
        let addr = line.trim().strip_prefix("listening on http://").map(str::to_string);
        let log = || std::fs::read_to_string(s.path().join("serve.log")).unwrap_or_default();
        Served(child, addr.unwrap_or_else(|| panic!("unexpected: {line}\n{}", log())))
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let url = format!("http://{}{path}", self.1);
        let resp = ureq::post(&url).timeout(std::time::Duration::from_secs(120)).send_json(body);
        resp.unwrap_or_else(|e| panic!("POST {path}: {e}")).into_json().expect("a JSON answer")
    }

    fn tokenize(&self, text: &str) -> Vec<u64> {
        let ids = self.post("/tokenize", json!({"prompt": text}))["tokens"].clone();
        ids.as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    }
}

/// The server's `logprobs` are the model's log-likelihoods: greedy completions of SmolLM2 with
/// `logprobs: 0`, and `ember eval --samples` on the same prompts and completions (scored through
/// eval's paged cache, each prompt computed at once) agree: each completion's log-likelihood within
/// 1e-5 per token, each token within 2e-5 (f32's noise between decode and prefill). Both run on
/// the f32 import, so both multiply in f32 (a `gguf:` checkpoint decodes on 8-bit activations).
#[test]
fn served_logprobs_equal_eval_log_likelihoods() {
    let s = Scratch::new();
    let run = common::import_smollm2(&s);
    let server = Served::start(&s, &run);
    let prompts = ["The capital of France is", "Once upon a time, a little fox", "def fibonacci(n):"];
    let mut rows = String::new();
    let mut served: Vec<(Vec<u64>, Vec<f64>)> = Vec::new();
    for prompt in prompts {
        let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 0});
        let answer = server.post("/v1/completions", body);
        let choice = &answer["choices"][0];
        let text = choice["text"].as_str().unwrap();
        let strings: Vec<&str> =
            choice["logprobs"]["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        let logprobs: Vec<f64> =
            choice["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
        assert_eq!(strings.concat(), text, "{prompt:?}: the tokens spell the text");
        assert_eq!(logprobs.len(), answer["usage"]["completion_tokens"].as_u64().unwrap() as usize, "{prompt:?}");
        // eval tokenizes the prompt, then the completion alone: the server's tokens only if
        // tokenizing prompt + completion splits at the prompt's end into the generated tokens.
        let (head, tail) = (server.tokenize(prompt), server.tokenize(text));
        assert_eq!(server.tokenize(&format!("{prompt}{text}")), [head, tail.clone()].concat(), "{prompt:?} + {text:?}");
        assert_eq!(tail.len(), strings.len(), "{prompt:?}: {text:?} re-tokenized");
        for (id, string) in tail.iter().zip(&strings) {
            let one = server.post("/detokenize", json!({"tokens": [id]}));
            assert_eq!(one["prompt"], *string, "{prompt:?}: token {id}");
        }
        rows.push_str(&format!("{}\n", json!({"prompt": prompt, "completion": text})));
        served.push((tail, logprobs));
    }
    drop(server);
    s.write("completions.jsonl", &rows);
    let args = ["eval", "--checkpoint", run.to_str().unwrap(), "--data", "completions.jsonl"];
    let out = s.ember(&[&args[..], &["--samples", "samples.jsonl"]].concat());
    assert!(out.status.success(), "ember eval failed: {}", stderr(&out));
    let text = std::fs::read_to_string(s.path().join("samples.jsonl")).expect("the --samples file");
    let samples: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(samples.len(), prompts.len());
    let mut compared = 0;
    for ((prompt, (ids, logprobs)), sample) in prompts.iter().zip(&served).zip(&samples) {
        // eval scores the completion and then the end-of-sequence token a fine-tune learns to stop on.
        let tokens: Vec<u64> = sample["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        assert_eq!(tokens[..tokens.len() - 1], ids[..], "{prompt:?}: eval's tokens");
        // Each row's sum within 1e-5 per token; each token within 2e-5. The server's logits come
        // from decoding one token at a time, eval's from one prefill: the same f32 model summed in
        // other orders, their logits a few ulps apart. Measured on these prompts: the
        // median token 3e-6 apart, the worst 1.2e-5 (1.6e-5 under EMBER_FUSED=0, so not a kernel's
        // doing); 1e-5 per token is that noise floor, not a bound it keeps.
        let mine: Vec<f64> = sample["token_logprobs"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
        for (k, (a, b)) in mine.iter().zip(logprobs).enumerate() {
            assert!((a - b).abs() <= 2e-5, "{prompt:?} token {k}: eval {a}, serve {b}");
            compared += 1;
        }
        let (a, b): (f64, f64) = (mine[..ids.len()].iter().sum(), logprobs.iter().sum());
        assert!((a - b).abs() <= 1e-5 * ids.len() as f64, "{prompt:?}: eval's sum {a}, serve's {b}");
    }
    assert!(compared >= 2 * 16, "only {compared} tokens compared");
}
