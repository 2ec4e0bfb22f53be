//! Training configs and the flags of `ember train`.

use super::common::*;
use super::{refuse, with_config};

/// `tiny_config` with `from` replaced by `to`; the replacement must happen.
fn edit(from: &str, to: &str) -> String {
    let base = tiny_config("");
    assert!(base.contains(from), "the tiny config has no `{from}`");
    base.replace(from, to)
}

fn train_refuses(config: &str, needles: &[&str]) {
    let s = with_config(config);
    refuse(&s, &["train", "--config", "cfg.toml"], needles);
}

#[test]
fn sizes_past_their_limits_are_named_before_anything_is_allocated() {
    let cases = [
        ("d_model = 32", "d_model = 131072", "model.d_model = 131072 is larger than ember's limit of 65536"),
        ("d_ff = 64", "d_ff = 10000000", "model.d_ff = 10000000 is larger than ember's limit of 1048576"),
        ("max_seq_len = 32", "max_seq_len = 1000000000000", "model.max_seq_len = 1000000000000 is larger"),
        ("n_layers = 2", "n_layers = 5000", "model.n_layers = 5000 is larger than ember's limit of 1024"),
        ("n_heads = 4", "n_heads = 4096\nhead_dim = 8", "model.n_heads = 4096 is larger"),
        ("n_layers = 2", "n_layers = 2\nvocab_size = 1000000000000", "model.vocab_size = 1000000000000 is larger"),
        ("batch_size = 4", "batch_size = 4611686018427387904", "train.batch_size = 4611686018427387904 is larger"),
        ("max_steps = 6", "max_steps = 100000000000000", "train.max_steps = 100000000000000 is larger"),
        ("eval_iters = 2", "eval_iters = 100000000", "train.eval_iters = 100000000 is larger"),
        ("seed = 7", "seed = 7\ngrad_accum_steps = 100000000", "train.grad_accum_steps = 100000000 is larger"),
    ];
    for (from, to, needle) in cases {
        train_refuses(&edit(from, to), &[needle, "cfg.toml"]);
    }
}

#[test]
fn a_model_too_big_for_memory_fails_before_its_weights_exist() {
    // Within every size limit, but about 4 TB of weights: the estimate runs before allocation.
    let config = edit("d_model = 32", "d_model = 65536").replace("n_layers = 2", "n_layers = 10");
    let config = config.replace("d_ff = 64", "d_ff = 262144");
    train_refuses(&config, &["the run needs about"]);
    train_refuses(&edit("batch_size = 4", "batch_size = 400000"), &["the run needs about", "lower train.batch_size"]);
}

#[test]
fn zero_and_out_of_range_values() {
    let cases = [
        ("batch_size = 4", "batch_size = 0", "train.batch_size must be at least 1, found 0"),
        ("eval_iters = 2", "eval_iters = 0", "train.eval_iters must be at least 1"),
        ("n_layers = 2", "n_layers = 0", "model.n_layers must be positive"),
        ("n_kv_heads = 2", "n_kv_heads = 3", "model.n_kv_heads (3) must divide model.n_heads (4)"),
        ("d_model = 32", "d_model = 30", "model.n_heads (4) must divide model.d_model (30)"),
        ("n_heads = 4", "n_heads = 4\nhead_dim = 7", "model.head_dim must be even for RoPE, found 7"),
        ("n_layers = 2", "n_layers = 2\ndropout = 1.5", "model.dropout must be in [0, 1), found 1.5"),
        ("seed = 7", "seed = 7\nseq_len = 64", "train.seq_len (64) must be in 1..=model.max_seq_len (32)"),
        ("weight_decay = 0.1", "weight_decay = 0.1\nbeta1 = 1.0", "optim.beta1 must be in [0, 1), found 1"),
        (
            "tokenizer = \"char\"",
            "tokenizer = \"char\"\nval_fraction = 1.5",
            "data.val_fraction must be in (0, 1), found 1.5",
        ),
        ("seed = 7", "seed = 7\nprecision = \"f8\"", "f8"),
    ];
    for (from, to, needle) in cases {
        train_refuses(&edit(from, to), &[needle]);
    }
    let cfg = tiny_config("") + "\n[metrics]\nsample_tokens = 1000000000000\n";
    train_refuses(&cfg, &["metrics.sample_tokens = 1000000000000 is larger"]);
    let cfg = tiny_config("") + "\n[metrics]\nsinks = []\n";
    train_refuses(&cfg, &["metrics.sinks is empty"]);
}

#[test]
fn structure_keys_and_sections() {
    train_refuses(
        &edit("n_layers = 2", "n_layers = 2\nn_kv_head = 2"),
        &["[model] unknown key \"n_kv_head\" — did you mean \"n_kv_heads\"?"],
    );
    train_refuses(&(tiny_config("") + "\n[extras]\nx = 1\n"), &["[extras] unknown section"]);
    train_refuses(&edit("d_model = 32", "d_model = "), &["cfg.toml", "line"]);
    train_refuses(
        &edit("d_model = 32", "d_model = \"wide\""),
        &["[model] d_model: invalid type: string \"wide\"", "cfg.toml"],
    );
    train_refuses(
        &edit("path = \"corpus.txt\"", "dataset = \"tinyshakespeare\"\npath = \"corpus.txt\""),
        &["data: set only one of `dataset` (\"tinyshakespeare\") and `path` (corpus.txt)"],
    );
    train_refuses(&edit("path = \"corpus.txt\"", ""), &["set `dataset` (a built-in name) or `path`"]);
    train_refuses(
        &edit("tokenizer = \"char\"", "tokenizer = \"char\"\npacking = \"documents\""),
        &["data.packing = \"documents\" applies to JSONL examples"],
    );
    train_refuses(
        &edit("seed = 7", "seed = 7\neval_strategy = \"epoch\""),
        &["eval_strategy = \"epoch\" applies to JSONL"],
    );
    train_refuses(&format!("init_from = \"ftp:somewhere\"\n{}", tiny_config("")), &["ftp:somewhere"]);
    train_refuses(
        &(tiny_config("") + "\n[lora]\nrank = 4\nalpha = 8.0\n"),
        &["lora: adapters fine-tune a pretrained model; set init_from"],
    );
}

#[test]
fn command_line_flags_and_files() {
    let s = with_config(&tiny_config(""));
    refuse(&s, &["train", "--config", "missing.toml"], &["missing.toml"]);
    std::fs::create_dir(s.path().join("adir")).unwrap();
    refuse(&s, &["train", "--config", "adir"], &["adir"]);
    refuse(&s, &["train", "--config", "cfg.toml", "--precision", "f8"], &["f8"]);
    refuse(&s, &["train", "--config", "cfg.toml", "--device", "tpu"], &["tpu"]);
    refuse(&s, &["train", "--config", "cfg.toml", "--max-steps", "-3"], &["-3"]);
    refuse(&s, &["train", "--config", "cfg.toml", "--device", "cuda"], &["cuda"]);
}
