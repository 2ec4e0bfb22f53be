//! Bad input gets a clear error that names the problem, and no panic. One test per case.

mod common;

use common::*;

#[test]
fn unknown_config_key_is_named() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("bad.toml", &tiny_config("").replace("n_layers = 2", "n_layers = 2\nn_kv_head = 2"));
    let o = s.ember(&["train", "--config", "bad.toml"]);
    assert_clean_error(&o, "[model] unknown key \"n_kv_head\" — did you mean \"n_kv_heads\"?");
    assert_clean_error(&o, "bad.toml");
}

#[test]
fn heads_not_divisible_by_kv_heads() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("bad.toml", &tiny_config("").replace("n_kv_heads = 2", "n_kv_heads = 3"));
    let o = s.ember(&["train", "--config", "bad.toml"]);
    assert_clean_error(&o, "model.n_kv_heads (3) must divide model.n_heads (4)");
}

#[test]
fn missing_dataset_file() {
    let s = Scratch::new();
    s.write("cfg.toml", &tiny_config(""));
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert_clean_error(&o, "corpus.txt: data.path: no such file");
    let o = s.ember(&["prepare", "--data", "nowhere.txt", "--out", "p"]);
    assert_clean_error(&o, "nowhere.txt");
}

#[test]
fn dataset_shorter_than_the_context() {
    let s = Scratch::new();
    s.write("corpus.txt", "To be, or not to be, that is the question.\n");
    s.write("cfg.toml", &tiny_config(""));
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert_clean_error(&o, "split has");
    assert_clean_error(&o, "fewer than the 33 a window of seq_len + 1 needs");
}

#[test]
fn a_directory_that_is_not_a_checkpoint() {
    let s = Scratch::new();
    std::fs::create_dir_all(s.path().join("empty")).unwrap();
    let o = s.ember(&["sample", "--checkpoint", "empty"]);
    assert_clean_error(&o, "empty: not a checkpoint: no model.toml");
    let o = s.ember(&["sample", "--checkpoint", "nonexistent"]);
    assert_clean_error(&o, "nonexistent: not a checkpoint: no such file or directory");
    // A checkpoint folder with a damaged model.toml.
    std::fs::create_dir_all(s.path().join("broken")).unwrap();
    s.write("broken/model.toml", "d_model = ");
    let o = s.ember(&["sample", "--checkpoint", "broken"]);
    assert_clean_error(&o, "damaged checkpoint");
}

#[test]
fn resume_without_a_checkpoint() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config(""));
    let o = s.ember(&["train", "--config", "cfg.toml", "--resume"]);
    assert_clean_error(&o, "not a checkpoint");
}

#[test]
fn bad_sampling_arguments() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config("").replace("max_steps = 6", "max_steps = 2"));
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["sample", "--checkpoint", "runs/cfg", "--top-p", "1.5"]);
    assert_clean_error(&o, "top_p must be in (0, 1], found 1.5");
    let o = s.ember(&["sample", "--checkpoint", "runs/cfg", "--prompt", "Zounds!"]);
    assert_clean_error(&o, "character 'Z' at byte 0 is not in the char-level vocabulary");
    let o = s.ember(&["sample", "--checkpoint", "runs/cfg", "--prompt", ""]);
    assert_clean_error(&o, "the prompt is empty");
}

#[test]
fn a_prompt_longer_than_the_context() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config("").replace("max_steps = 6", "max_steps = 2"));
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let long = "the night is long ".repeat(3);
    let o = s.ember(&["sample", "--checkpoint", "runs/cfg", "--prompt", &long]);
    assert_clean_error(&o, "prompt 0 has 54 tokens, more than the model's context of 32");
    let o = s.ember(&["sample", "--checkpoint", "runs/cfg", "--repetition-penalty", "0"]);
    assert_clean_error(&o, "repetition_penalty must be a finite number > 0");
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "runs/cfg", "--data", "missing.txt"]);
    assert_clean_error(&o, "reading missing.txt");
    let o = s.ember(&["eval", "--perplexity", "--checkpoint", "runs/cfg", "--data", "val", "--context", "64"]);
    assert_clean_error(&o, "--context 64 must be in 1..=32");
}

/// A model without training data (what `ember import` writes: weights, model.toml, tokenizer) has
/// no split to evaluate, and is not damaged; a GGUF file or a Hugging Face folder given as a
/// checkpoint gets the import command.
#[test]
fn checkpoints_of_other_kinds_say_what_to_do() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("cfg.toml", &tiny_config("").replace("max_steps = 6", "max_steps = 2"));
    let o = s.ember(&["train", "--config", "cfg.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::create_dir(s.path().join("imported")).unwrap();
    for f in ["model.safetensors", "model.toml", "tokenizer.json"] {
        std::fs::copy(s.path().join("runs/cfg/checkpoints/step-000002").join(f), s.path().join("imported").join(f))
            .unwrap();
    }
    let o = s.ember(&["eval", "--checkpoint", "imported", "--data", "val"]);
    assert_clean_error(&o, "--data val: imported has no training data of its own");
    assert_clean_error(&o, "give --data a text file, or a .jsonl file");
    assert!(!stderr(&o).contains("damaged"), "{}", stderr(&o));
    let o = s.ember(&["eval", "--checkpoint", "imported", "--data", "corpus.txt"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let mut gguf = b"GGUF".to_vec();
    gguf.extend([3, 0, 0, 0]);
    std::fs::write(s.path().join("model.gguf"), gguf).unwrap();
    for args in
        [&["sample", "--checkpoint", "model.gguf"][..], &["eval", "--checkpoint", "model.gguf", "--data", "val"]]
    {
        let o = s.ember(args);
        assert_clean_error(&o, "model.gguf: not a checkpoint: a GGUF file; import it into a run directory first");
        assert_clean_error(&o, "`ember import model.gguf --out DIR`");
    }
    std::fs::create_dir(s.path().join("hf")).unwrap();
    s.write("hf/config.json", "{}");
    let o = s.ember(&["sample", "--checkpoint", "hf"]);
    assert_clean_error(&o, "a Hugging Face model folder (config.json); import it");
}

#[test]
fn a_config_too_big_for_the_device_fails_before_training() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("big.toml", &tiny_config("").replace("batch_size = 4", "batch_size = 400000"));
    let o = s.ember(&["train", "--config", "big.toml"]);
    assert_clean_error(&o, "the run needs about");
    assert_clean_error(&o, "lower train.batch_size");
    assert!(!s.path().join("runs/big/checkpoints").exists());
}
