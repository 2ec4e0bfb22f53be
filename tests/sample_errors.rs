//! `ember sample` on bad input (issue 11, hardening): every bad flag value and every tokenizer that
//! does not fit the model is a clean error that names the flag, the value and the limit, before the
//! model is loaded, and leaves the checkpoint as it was; tokenizers whose decoder shortens the text or
//! skips special tokens stream without panicking. One tiny training run serves every case.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::SystemTime;

use common::*;

/// Every file under `dir` with its bytes and modification time: equal snapshots mean nothing was
/// written, not even the same bytes again.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (Vec<u8>, SystemTime)> {
    let mut files = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
                files.insert(path.clone(), (std::fs::read(&path).unwrap(), modified));
            }
        }
    }
    assert!(!files.is_empty(), "{} is empty", dir.display());
    files
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

/// A refusal: a non-zero exit code that is neither a panic (101) nor an abort (134, or a signal),
/// and a message holding every needle.
fn assert_refused(o: &Output, needles: &[&str]) {
    let code = o.status.code();
    assert!(matches!(code, Some(c) if c != 0 && c != 101 && c != 134), "exit {code:?}, stderr: {}", stderr(o));
    for needle in needles {
        assert_clean_error(o, needle);
    }
}

/// A successful run that did not panic; returns its stdout.
fn assert_ran(o: &Output) -> String {
    assert!(o.status.success(), "exit {:?}, stderr: {}", o.status.code(), stderr(o));
    assert!(!stderr(o).contains("panicked"), "{}", stderr(o));
    stdout(o)
}

/// The checkpoint folder of the run (its only one).
fn checkpoint_of(run: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() && p.file_name().unwrap().to_string_lossy().starts_with("step-"))
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

/// A copy of the checkpoint at `name` whose tokenizer.json `edit` changed.
fn with_tokenizer(s: &Scratch, checkpoint: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = s.path().join(name);
    copy_dir(checkpoint, &dir);
    let path = dir.join("tokenizer.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, json.to_string()).unwrap();
    dir
}

fn added_token(id: u64, content: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true
    })
}

#[test]
fn bad_sampling_input_is_a_clean_error_and_odd_tokenizers_stream() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config("").replace("max_steps = 6", "max_steps = 2"));
    assert_ran(&s.ember(&["train", "--config", "cfg.toml"]));
    let run = s.path().join("runs/cfg");
    let checkpoint = checkpoint_of(&run);
    let before = snapshot(&run);
    let model_toml = std::fs::read_to_string(checkpoint.join("model.toml")).unwrap();
    let vocab_size: usize = model_toml
        .lines()
        .find_map(|l| l.strip_prefix("vocab_size = "))
        .expect("vocab_size in model.toml")
        .trim()
        .parse()
        .unwrap();

    // Flags out of range: each names itself, its value and, where there is one, the limit.
    let sample = |extra: &[&str]| {
        let mut args = vec!["sample", "--checkpoint", "runs/cfg", "--prompt", "ROMEO:"];
        args.extend_from_slice(extra);
        s.ember(&args)
    };
    assert_refused(&sample(&["--stop", ""]), &["--stop ''", "empty stop string"]);
    assert_refused(&sample(&["--stop", "ROMEO", "--stop", ""]), &["--stop ''"]);
    assert_refused(&sample(&["--max-new-tokens", "100000000000"]), &["--max-new-tokens 100000000000", "1048576"]);
    assert_refused(&sample(&["--block-size", "0"]), &["--block-size 0 must be in 1..=32", "max_seq_len"]);
    assert_refused(&sample(&["--block-size", "100000"]), &["--block-size 100000 must be in 1..=32"]);
    assert_refused(&sample(&["--top-p", "0"]), &["--top-p 0", "(0, 1]"]);
    assert_refused(&sample(&["--top-p", "1.5"]), &["--top-p 1.5", "(0, 1]"]);
    assert_refused(&sample(&["--temperature", "-1"]), &["--temperature -1", ">= 0"]);
    assert_refused(&sample(&["--temperature", "NaN"]), &["--temperature NaN"]);
    assert_refused(&sample(&["--repetition-penalty", "0"]), &["--repetition-penalty 0", "> 0"]);
    assert_refused(&sample(&["--repetition-penalty", "-1.5"]), &["--repetition-penalty -1.5"]);

    // The reference text, and the same seed and prompt with stop strings: cut right before the
    // first occurrence, also of a two-character stop held back across tokens.
    let args = ["--max-new-tokens", "200", "--temperature", "1.0"];
    let full = assert_ran(&sample(&args));
    let generated = full.strip_prefix("ROMEO:").unwrap().strip_suffix('\n').unwrap().to_string();
    assert!(generated.chars().count() >= 150, "{full:?}");
    let chars: Vec<char> = generated.chars().collect();
    let stop: String = chars[20..22].iter().collect();
    let cut = &generated[..generated.find(&stop).unwrap()];
    let o = sample(&[&args[..], &["--stop", &stop, "--stop", "never seen"]].concat());
    assert_eq!(assert_ran(&o), format!("ROMEO:{cut}\n"), "stop {stop:?}");
    // Several prompts as one batch, each with its own stream.
    let o = sample(&[&args[..], &["--prompt", "JULIET:", "--stop", &stop]].concat());
    let batch = assert_ran(&o);
    assert!(batch.starts_with(&format!("=== 0 ===\nROMEO:{cut}\n=== 1 ===\nJULIET:")), "{batch}");
    assert!(!batch.split("=== 1 ===\nJULIET:").nth(1).unwrap().contains(&stop), "{batch}");

    // A tokenizer with an id past the model's vocabulary: named with its file and both sizes.
    let past = with_tokenizer(&s, &checkpoint, "past_vocab", |json| {
        json["model"]["vocab"]["<|extra|>"] = 100_000.into();
        json["added_tokens"].as_array_mut().unwrap().push(added_token(100_000, "<|extra|>"));
    });
    let past_before = snapshot(&past);
    let o = s.ember(&["sample", "--checkpoint", "past_vocab", "--prompt", "ROMEO:"]);
    assert_refused(&o, &["past_vocab/tokenizer.json", "<|extra|>", "id 100000", &format!("vocab_size {vocab_size}")]);
    assert_eq!(snapshot(&past), past_before);

    // A decoder that shortens the text (every lowercase word followed by a space is removed once the
    // space comes): the same ids as the reference, streamed without a panic.
    assert!(generated.chars().zip(generated.chars().skip(1)).any(|(a, b)| a.is_ascii_lowercase() && b == ' '));
    with_tokenizer(&s, &checkpoint, "shortening", |json| {
        json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Fuse"},
            {"type": "Replace", "pattern": {"Regex": "[a-z]+ "}, "content": ""}
        ]});
    });
    for extra in [&[][..], &["--stop", &stop][..], &["--prompt", "JULIET:"][..]] {
        let o = s.ember(&[&["sample", "--checkpoint", "shortening", "--prompt", "ROMEO:"], &args[..], extra].concat());
        let text = assert_ran(&o);
        assert!(text.len() > "ROMEO:\n".len() + 10, "{text:?}");
    }

    // Training samples at its evaluations through the same stream: with this tokenizer, a run
    // finishes and logs text.
    std::fs::copy(s.path().join("shortening/tokenizer.json"), s.path().join("shortening.json")).unwrap();
    let cfg = tiny_config("").replace("max_steps = 6", "max_steps = 3");
    s.write("short.toml", &cfg.replace("tokenizer = \"char\"", "tokenizer = \"shortening.json\""));
    assert_ran(&s.ember(&["train", "--config", "short.toml"]));
    let samples = std::fs::read_to_string(s.path().join("runs/short/samples.jsonl")).unwrap();
    let texts: Vec<String> = samples
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap().to_string())
        .collect();
    assert!(!texts.is_empty() && texts.iter().all(|t| !t.is_empty()), "{samples}");

    // A special token in the vocabulary (the space's id renamed `<|im_start|>`): not printed. Same
    // ids again, so the text is the reference without its spaces.
    assert!(generated.contains(' '));
    with_tokenizer(&s, &checkpoint, "special", |json| {
        let vocab = json["model"]["vocab"].as_object_mut().unwrap();
        let id = vocab.remove(" ").unwrap();
        vocab.insert("<|im_start|>".into(), id.clone());
        json["added_tokens"].as_array_mut().unwrap().push(added_token(id.as_u64().unwrap(), "<|im_start|>"));
    });
    let o = s.ember(&[&["sample", "--checkpoint", "special", "--prompt", "ROMEO:"], &args[..]].concat());
    assert_eq!(assert_ran(&o), full.replace(' ', ""));

    assert_eq!(snapshot(&run), before, "sampling changed the checkpoint");
}

/// `--json-schema FILE` (issue 55): SmolLM2's answers, one prompt streamed and two in a batch, are
/// compact JSON valid against the schema; a missing file, a file that is not JSON and a schema the
/// grammar engine cannot enforce are refused naming the file (and the keyword).
#[test]
fn json_schema_answers_hold_to_the_schema_and_bad_schemas_are_named() {
    let s = Scratch::new();
    let gguf = format!("gguf:{}", assets().join(SMOLLM2_GGUF).display());
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            // Letters only, a bounded count: at most a token a character, so that an answer
            // always ends inside --max-new-tokens (a string of 24 characters of any alphabet can
            // take 70 tokens, and a sampled answer ran out of tokens mid-string).
            "name": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "London", "Tokyo"]},
            "hobbies": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{1,20}$"}, "maxItems": 3}
        },
        "required": ["name", "age", "city", "hobbies"],
        "additionalProperties": false
    });
    s.write("person.json", &schema.to_string());
    let valid = |text: &str| {
        let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        // Every key, in the schema's order, and no other.
        let at: Vec<Option<usize>> =
            ["name", "age", "city", "hobbies"].iter().map(|k| text.find(&format!("\"{k}\": "))).collect();
        assert!(at.iter().all(Option::is_some) && at.is_sorted() && v.as_object().unwrap().len() == 4, "{text}");
        assert!(v["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
        assert!(["Paris", "London", "Tokyo"].contains(&v["city"].as_str().unwrap()), "{text}");
        assert!(v["hobbies"].as_array().unwrap().len() <= 3, "{text}");
    };
    let prompt = "Describe a person as JSON.";
    let base = ["sample", "--checkpoint", &gguf, "--chat", "--max-new-tokens", "200", "--json-schema", "person.json"];
    let out = assert_ran(&s.ember(&[&base[..], &["--prompt", prompt]].concat()));
    let answer = out.strip_prefix(&format!("{prompt}\n")).unwrap_or_else(|| panic!("{out:?}"));
    valid(answer.trim_end_matches('\n'));
    let out = assert_ran(&s.ember(&[&base[..], &["--prompt", prompt, "--prompt", "Who lives in Tokyo?"]].concat()));
    let answers: Vec<&str> = out.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(answers.len(), 2, "{out}");
    answers.iter().for_each(|a| valid(a));

    let refused = |file: &str, needles: &[&str]| {
        let args = ["sample", "--checkpoint", &gguf, "--chat", "--json-schema", file, "--prompt", "Hi"];
        assert_refused(&s.ember(&args), needles);
    };
    refused("missing.json", &["--json-schema missing.json", "cannot read it"]);
    s.write("broken.json", "{\"type\": \"object\",");
    refused("broken.json", &["--json-schema broken.json", "not JSON"]);
    s.write("unique.json", r#"{"type": "array", "uniqueItems": true}"#);
    refused("unique.json", &["--json-schema unique.json", "invalid JSON schema", "uniqueItems"]);
}
