//! Data: text files, JSONL examples, tokenizers, token shards and `ember prepare`.

use super::common::*;
use super::{refuse, with_config};

fn jsonl_config(extra_data: &str) -> String {
    // A char tokenizer cannot read JSONL: the examples need a tokenizer.json (the fixture's).
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen2/tokenizer.json");
    tiny_config("")
        .replace("path = \"corpus.txt\"", &format!("path = \"data.jsonl\"\n{extra_data}"))
        .replace("tokenizer = \"char\"", &format!("tokenizer = {:?}", tok.display().to_string()))
}

fn examples(n: usize, completion: &str) -> String {
    (0..n).map(|i| format!("{{\"prompt\": \"the night {i}\", \"completion\": \"{completion}\"}}\n")).collect()
}

#[test]
fn text_data() {
    let s = Scratch::new();
    s.write("cfg.toml", &tiny_config(""));
    refuse(&s, &["train", "--config", "cfg.toml"], &["corpus.txt: data.path: no such file"]);
    s.write("corpus.txt", "To be, or not to be.\n");
    refuse(&s, &["train", "--config", "cfg.toml"], &["fewer than the 33 a window of seq_len + 1 needs"]);
    let s = with_config(&tiny_config("").replace("path = \"corpus.txt\"", "dataset = \"wikipedia-all\""));
    refuse(&s, &["train", "--config", "cfg.toml"], &["unknown dataset `wikipedia-all`"]);
    for (spec, needle) in [("bpe:10", "bpe:10"), ("missing.json", "missing.json"), ("words", "words")] {
        let s = with_config(&tiny_config("").replace("tokenizer = \"char\"", &format!("tokenizer = \"{spec}\"")));
        refuse(&s, &["train", "--config", "cfg.toml"], &[needle]);
    }
    let s = with_config(&tiny_config("").replace("tokenizer = \"char\"", "tokenizer = \"tok.json\""));
    s.write("tok.json", "{\"model\": ");
    refuse(&s, &["train", "--config", "cfg.toml"], &["tok.json"]);
}

#[test]
fn a_cached_shard_with_ids_past_the_vocabulary() {
    let s = with_config(&tiny_config("").replace("max_steps = 6", "max_steps = 2"));
    let o = s.ember(&["train", "--config", "cfg.toml", "--run-dir", "first"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Damage the cached train shard: header vocabulary 200, one id 198 (the char vocabulary has ~40).
    let prepared = s.path().join("cache/prepared");
    let dir = std::fs::read_dir(&prepared).unwrap().next().unwrap().unwrap().path();
    let shard = dir.join("train.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[24..28].copy_from_slice(&200u32.to_le_bytes());
    bytes[32..34].copy_from_slice(&198u16.to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    refuse(&s, &["train", "--config", "cfg.toml", "--run-dir", "second"], &["train.bin", "token id 198", "delete"]);
    // A shard that is not one at all.
    std::fs::write(&shard, b"not a shard").unwrap();
    refuse(&s, &["train", "--config", "cfg.toml", "--run-dir", "second"], &["train.bin"]);
}

#[test]
fn jsonl_examples() {
    let s = with_config(&jsonl_config(""));
    s.write("data.jsonl", &(examples(3, "so") + "{not json\n"));
    refuse(&s, &["train", "--config", "cfg.toml"], &["data.jsonl:4:"]);
    s.write("data.jsonl", "{\"question\": \"why\"}\n");
    refuse(&s, &["train", "--config", "cfg.toml"], &["data.jsonl:1:", "expected {\"prompt\""]);
    s.write("data.jsonl", &examples(1, "so"));
    refuse(&s, &["train", "--config", "cfg.toml"], &["need at least 2 examples"]);
    s.write("data.jsonl", &"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"ho\"}]}\n".repeat(4));
    refuse(&s, &["train", "--config", "cfg.toml"], &["chat template"]);
    s.write("data.jsonl", &"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n".repeat(4));
    refuse(&s, &["train", "--config", "cfg.toml"], &["without an assistant turn"]);
    // An example longer than a row, under documents packing, without truncation.
    s.write("data.jsonl", &(examples(3, "so") + &examples(1, &"the night is long ".repeat(6))));
    refuse(&s, &["train", "--config", "cfg.toml"], &["fine-tuning example 4 has", "data.truncate"]);
    let s = with_config(&jsonl_config("packing = \"interleaved\""));
    s.write("data.jsonl", &examples(4, "so"));
    refuse(&s, &["train", "--config", "cfg.toml"], &["interleaved"]);
}

#[test]
fn prepare_flags() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    refuse(&s, &["prepare", "--data", "nowhere.txt", "--out", "p"], &["nowhere.txt"]);
    refuse(&s, &["prepare", "--data", "corpus.txt", "--tokenizer", "bpe:3", "--out", "p"], &["bpe:3"]);
    refuse(&s, &["prepare", "--data", "corpus.txt", "--val-fraction", "2", "--out", "p"], &["2"]);
}
