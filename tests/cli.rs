//! End-to-end runs of the `ember` binary: prepare -> train -> checkpoint -> resume -> sample.

mod common;

use common::*;
use ember_train::metrics::read_metrics;

#[test]
fn prepare_train_sample() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    let o = s.ember(&["prepare", "--data", "corpus.txt", "--tokenizer", "char", "--out", "prep"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("train tokens"), "{}", stdout(&o));
    for f in ["train.bin", "val.bin", "tokenizer.json", "meta.json"] {
        assert!(s.path().join("prep").join(f).is_file(), "{f}");
    }
    // A second prepare reuses the shards.
    let o = s.ember(&["prepare", "--data", "corpus.txt", "--tokenizer", "char", "--out", "prep"]);
    assert!(stdout(&o).contains("reused"), "{}", stdout(&o));

    s.write("tiny.toml", &tiny_config(""));
    let o = s.ember(&["train", "--config", "tiny.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = s.path().join("runs/tiny");
    for f in ["config.toml", "tokenizer.json", "metrics.jsonl", "checkpoints/latest"] {
        assert!(run.join(f).is_file(), "{f}");
    }
    let ckpt = run.join("checkpoints/step-000006");
    for f in ["model.safetensors", "optimizer.safetensors", "state.json", "config.toml", "tokenizer.json"] {
        assert!(ckpt.join(f).is_file(), "{f}");
    }
    let records = read_metrics(&run.join("metrics.jsonl")).unwrap();
    assert_eq!(records.iter().map(|r| r.step).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    assert!(records[2].val_loss.is_some() && records[5].val_loss.is_some() && records[0].val_loss.is_none());
    assert!(records.iter().all(|r| r.tokens_per_sec > 0.0 && r.grad_norm > 0.0 && r.lr > 0.0));

    let o = s.ember(&["sample", "--checkpoint", "runs/tiny", "--prompt", "ROMEO:", "--max-new-tokens", "40"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.starts_with("ROMEO:"), "{text}");
    assert!(text.chars().count() >= 40, "{text}");
    // The same seed gives the same text; a checkpoint folder works as well as the run directory.
    let again = s.ember(&[
        "sample",
        "--checkpoint",
        "runs/tiny/checkpoints/step-000006",
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "40",
    ]);
    assert_eq!(stdout(&again), text);

    // Training again into the same run directory without --resume would lose the run: refused.
    let o = s.ember(&["train", "--config", "tiny.toml"]);
    assert_clean_error(&o, "already holds a run");
}

#[test]
fn a_stopped_and_resumed_run_matches_an_uninterrupted_one_bitwise() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &tiny_config("grad_accum_steps = 2"));
    let o = s.ember(&["train", "--config", "tiny.toml", "--run-dir", "straight"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["train", "--config", "tiny.toml", "--run-dir", "split", "--max-steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(s.path().join("split/checkpoints/step-000004").is_dir());
    let o = s.ember(&["train", "--config", "tiny.toml", "--run-dir", "split", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let a = read_metrics(&s.path().join("straight/metrics.jsonl")).unwrap();
    let b = read_metrics(&s.path().join("split/metrics.jsonl")).unwrap();
    assert_eq!(a.len(), 6);
    assert_eq!(b.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.step, y.step);
        assert_eq!(x.train_loss.to_bits(), y.train_loss.to_bits(), "step {}", x.step);
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits(), "step {}", x.step);
        assert_eq!(x.lr.to_bits(), y.lr.to_bits(), "step {}", x.step);
        assert_eq!(x.val_loss.map(f64::to_bits), y.val_loss.map(f64::to_bits), "step {}", x.step);
    }
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let read = |run: &str| {
            let bytes = std::fs::read(s.path().join(run).join("checkpoints/step-000006").join(file)).unwrap();
            ember_model::weights::from_safetensors(&bytes, file).unwrap().0
        };
        let (wa, wb) = (read("straight"), read("split"));
        assert_eq!(wa.keys().collect::<Vec<_>>(), wb.keys().collect::<Vec<_>>());
        for (k, ta) in &wa {
            assert!(ta.as_bytes() == wb[k].as_bytes(), "{file}: {k} differs");
        }
    }
    // keep_checkpoints = 2: the resumed run pruned step 3 and kept the stop point and the end.
    let kept: Vec<bool> =
        [3, 4, 6].iter().map(|n| s.path().join(format!("split/checkpoints/step-{n:06}")).exists()).collect();
    assert_eq!(kept, [false, true, true]);
}
