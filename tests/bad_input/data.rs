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
    // An example longer than a row, under documents packing, without truncation: named by its
    // line (issue 57: by its index, wrong past a blank line).
    s.write("data.jsonl", &(examples(3, "so") + "\n" + &examples(1, &"the night is long ".repeat(6))));
    refuse(&s, &["train", "--config", "cfg.toml"], &["data.jsonl:5: the example has", "data.truncate = true"]);
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

#[test]
fn data_paths_that_are_not_files() {
    let s = with_config(&tiny_config(""));
    std::fs::remove_file(s.path().join("corpus.txt")).unwrap();
    std::fs::create_dir(s.path().join("corpus.txt")).unwrap();
    refuse(&s, &["train", "--config", "cfg.toml"], &["corpus.txt: data.path: a directory"]);
    // A FIFO outside the scratch folder (whose snapshot would wait on it).
    let elsewhere = tempfile::tempdir().unwrap();
    let fifo = elsewhere.path().join("corpus.fifo");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let s = with_config(
        &tiny_config("").replace("path = \"corpus.txt\"", &format!("path = {:?}", fifo.display().to_string())),
    );
    refuse(&s, &["train", "--config", "cfg.toml"], &["corpus.fifo: data.path: not a regular file"]);
}

#[test]
fn a_jsonl_line_past_the_bound() {
    let s = with_config(&jsonl_config(""));
    let huge = format!("{{\"text\": \"{}\"}}\n", "a".repeat(17 << 20));
    s.write("data.jsonl", &(examples(3, "so") + &huge));
    refuse(&s, &["train", "--config", "cfg.toml"], &["data.jsonl:4:", "a line of 17 MiB; at most 16 MiB"]);
}

#[test]
fn a_lora_rank_past_the_model_is_refused_before_anything_is_written() {
    let s = Scratch::new();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen2");
    let o = s.ember(&["import", fixture.to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    s.write("data.jsonl", &examples(8, "so"));
    s.write(
        "lora.toml",
        "init_from = \"run:base\"\n[data]\npath = \"data.jsonl\"\n[train]\nbatch_size = 2\nseq_len = 16\n\
         max_steps = 2\neval_interval = 2\neval_iters = 1\n[optim]\nweight_decay = 0.0\n[schedule]\nlr = 1e-3\n\
         warmup_steps = 0\n[lora]\nrank = 1000000\nalpha = 16.0\n",
    );
    // The fixture's narrowest adapted projections are k_proj and v_proj, 64 × 32 (two key-value
    // heads of 16); the default targets (all seven projections) name the first of them.
    refuse(
        &s,
        &["train", "--config", "lora.toml", "--run-dir", "ft"],
        &["lora.rank 1000000", "`k_proj`'s smaller side (32, of 64 × 32)"],
    );
}
