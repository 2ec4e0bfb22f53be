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
            "data.val_fraction must be in [0, 1) (0: no validation), found 1.5",
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

/// Issue 57: keys that do nothing where they stand were taken without a word; each is refused at
/// its line with the reason (the table of them is tested in ember-train's config::effect), and an
/// unknown `[muon]` key is no longer sent to [preference].
#[test]
fn keys_with_no_effect_are_refused_with_the_reason() {
    let line = |config: &str, needle: &str| config.lines().position(|l| l == needle).unwrap() + 1;
    let config = edit("warmup_steps = 2", "warmup_steps = 2\ncooldown_frac = 0.3");
    let want = format!(
        "line {}: [schedule] cooldown_frac has no effect with shape = \"cosine\" (only the wsd schedule cools \
         down); remove it, or set shape = \"wsd\"",
        line(&config, "cooldown_frac = 0.3")
    );
    train_refuses(&config, &[&want]);
    let config = edit("n_layers = 2", "n_layers = 2\npositions = \"learned\"\nrope_theta = 5e5");
    train_refuses(&config, &["[model] rope_theta has no effect with positions = \"learned\""]);
    let config = tiny_config("") + "\n[model.moe]\nn_experts = 4\ntop_k = 2\nd_expert = 16\ndense_layers = 2\n";
    train_refuses(&config, &["[model.moe] has no effect with dense_layers = 2 and n_layers = 2"]);
    let config = tiny_config("") + "\n[muon]\nlr = 0.02\nlora = true\n";
    train_refuses(&config, &["[muon] lora has no effect without [lora]"]);
    let config = tiny_config("") + "\n[muon]\nlr = 0.02\nbeta = 0.9\n";
    train_refuses(&config, &["[muon] unknown key \"beta\" — did you mean \"momentum\"?"]);
}

/// Issue 57 (found by the config fuzzing): a bad value of a key that has a default came with a
/// `missing field` for every other key of its section; a key of a nested table was blamed on the
/// table at its header; a section's name as a key was "did you mean" itself; an enum given a
/// number said only `wanted string or table`; a huge float printed 309 digits. Each is now the one
/// problem, named at its line.
#[test]
fn a_bad_value_is_named_once_at_its_key() {
    let line = |config: &str, needle: &str| config.lines().position(|l| l == needle).unwrap() + 1;
    let config = edit("batch_size = 4", "batch_size = \"x\"");
    let want = format!(
        "cfg.toml: line {}: [train] batch_size: invalid type: string \"x\"",
        line(&config, "batch_size = \"x\"")
    );
    let out = stderr(&with_config(&config).ember(&["train", "--config", "cfg.toml"]));
    assert!(out.contains(&want) && !out.contains("missing field") && !out.contains("problems"), "{out}");
    let config =
        tiny_config("") + "\n[model.mla]\nq_rank = 16\nkv_rank = 8\nnope_dim = 8\nrope_dim = 4\nv_dim = true\n";
    let want = format!(
        "line {}: [model.mla] v_dim: invalid type: boolean `true`, expected usize",
        line(&config, "v_dim = true")
    );
    train_refuses(&config, &[&want]);
    let config = edit("warmup_steps = 2", "warmup_steps = 2\nmodel = 1");
    train_refuses(&config, &["[schedule] unknown key \"model\" — [model] is a section: write it as a table header"]);
    let config = edit("warmup_steps = 2", "warmup_steps = 2\nshape = 5");
    train_refuses(&config, &["[schedule] shape: expected one of \"cosine\", \"wsd\" (a string), found integer 5"]);
    let config = edit("min_lr = 3e-4", "min_lr = 1.7976931348623157e308");
    train_refuses(&config, &["schedule.min_lr (1.7976931348623157e308) must not exceed schedule.lr"]);
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
