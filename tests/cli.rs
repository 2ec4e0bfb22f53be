//! End-to-end runs of the `ember` binary: prepare -> train -> checkpoint -> resume -> sample.

mod common;

use common::*;
use ember_train::metrics::read_metrics;
use ember_train::Checkpoint;

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
    // The evaluation before training is metrics.jsonl's first line: step 0, a val loss near ln V
    // (the log's), and none of a step's fields.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert_eq!(first["step"], 0, "{first}");
    let val0 = first["val_loss"].as_f64().unwrap();
    assert!(stderr(&o).contains(&format!("step 0: val loss {val0:.4}")), "{}", stderr(&o));
    assert!(first.get("train_loss").is_none() && first.get("tokens_per_sec").is_none(), "{first}");
    assert!(val0 > records[5].val_loss.unwrap(), "{val0} then {:?}", records[5].val_loss);
    // The best evaluation's weights are kept apart in best/, with its step and loss, and the summary
    // says where.
    let (best_step, best_val) =
        records.iter().filter_map(|r| r.val_loss.map(|v| (r.step, v))).min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    let best: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("best/best.json")).unwrap()).unwrap();
    assert_eq!((best["step"].as_u64(), best["val_loss"].as_f64()), (Some(best_step as u64), Some(best_val)));
    assert!(!run.join("best/optimizer.safetensors").exists());
    let said = format!("best val loss {best_val:.4} at step {best_step}, kept in runs/tiny/best");
    assert!(stdout(&o).contains(&said), "{}", stdout(&o));
    // Logs to a pipe carry no colour codes.
    assert!(!stderr(&o).contains('\x1b'), "{}", stderr(&o));
    // best/ is a checkpoint for sample and eval (its own split, through its config.toml).
    let sampled = s.ember(&["sample", "--checkpoint", "runs/tiny/best", "--prompt", "ROMEO:", "--max-new-tokens", "5"]);
    assert!(sampled.status.success() && stdout(&sampled).starts_with("ROMEO:"), "{}", stderr(&sampled));
    let o = s.ember(&["eval", "--checkpoint", "runs/tiny/best", "--data", "val", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A finished run resumed: nothing to train, said so, with the way to train further.
    let o = s.ember(&["train", "--config", "tiny.toml", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("already complete at step 6 (train.max_steps = 6)"), "{text}");
    assert!(text.contains("raise train.max_steps in runs/tiny/config.toml"), "{text}");
    assert!(text.contains("ember train --config runs/tiny/config.toml --run-dir runs/tiny --resume"), "{text}");
    assert!(!text.contains("tokens/s"), "{text}");

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

#[test]
fn mixed_precision_and_activation_checkpointing() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &tiny_config(""));
    s.write("ckpt.toml", &tiny_config("activation_checkpointing = true"));
    let mut finals = Vec::new();
    for (run, config, precision) in [
        ("f32", "tiny.toml", "f32"),
        ("bf16", "tiny.toml", "bf16"),
        ("f16", "tiny.toml", "f16"),
        ("ac", "ckpt.toml", "f32"),
    ] {
        // The CPU emulates bf16/f16 (slower than f32), so ember trains in f32 unless told to run
        // the mixed-precision path anyway, as here to test it.
        let o = s.ember_env(
            &["train", "--config", config, "--run-dir", run, "--precision", precision],
            &[("EMBER_CPU_LOW_PRECISION", "1")],
        );
        assert!(o.status.success(), "{run}: {}", stderr(&o));
        let records = read_metrics(&s.path().join(run).join("metrics.jsonl")).unwrap();
        assert_eq!(records.len(), 6, "{run}");
        assert!(records.iter().all(|r| r.mfu > 0.0 && r.mfu < 1.0), "{run}: mfu");
        assert_eq!(records[0].loss_scale.is_some(), precision == "f16", "{run}: loss_scale");
        assert!(records[5].train_loss < records[0].train_loss, "{run}: loss must fall");
        finals.push(records);
    }
    let val = |i: usize| finals[i][5].val_loss.unwrap();
    // Low precision changes the arithmetic a little, not the run.
    assert!((val(1) - val(0)).abs() < 0.05, "bf16 {} vs f32 {}", val(1), val(0));
    assert!((val(2) - val(0)).abs() < 0.05, "f16 {} vs f32 {}", val(2), val(0));
    assert_ne!(val(1), val(0));
    // Recomputing activations gives the same numbers.
    for (a, b) in finals[0].iter().zip(&finals[3]) {
        assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits(), "step {}", a.step);
    }
    // By default bf16 on the CPU says what it does: f32 where the CPU lacks AVX512_BF16, bf16 operands
    // for the large GEMMs where it has it. This model's GEMMs are all below that size, so either way
    // the run is the f32 run, bit for bit.
    let o = s.ember(&["train", "--config", "tiny.toml", "--run-dir", "cpu-bf16", "--precision", "bf16"]);
    let said = |text: &str| stderr(&o).contains(text);
    assert!(
        o.status.success() && (said("slower than f32: training in f32") || said("bf16 operands with f32 sums")),
        "{}",
        stderr(&o)
    );
    let default_bf16 = read_metrics(&s.path().join("cpu-bf16/metrics.jsonl")).unwrap();
    for (a, b) in finals[0].iter().zip(&default_bf16) {
        assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits(), "step {}", a.step);
    }
    let o = s.ember(&["train", "--config", "tiny.toml", "--run-dir", "x", "--precision", "f64"]);
    assert!(!o.status.success() && stderr(&o).contains("expected f32, bf16 or f16"), "{}", stderr(&o));
}

#[test]
fn bench_commands_print_one_json_object() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &tiny_config(""));
    let json = |args: &[&str]| -> serde_json::Value {
        let o = s.ember(args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{args:?}: {e}: {}", stdout(&o)))
    };
    let t = json(&["bench", "train", "--config", "tiny.toml", "--steps", "3", "--warmup", "1", "--json"]);
    for key in ["tokens_per_sec", "mfu", "step_ms", "peak_memory_bytes", "precision", "device"] {
        assert!(!t[key].is_null(), "bench train lacks {key}: {t}");
    }
    assert_eq!(t["precision"], "f32");
    assert!(t["peak_memory_bytes"].as_u64().unwrap() > 0);
    let mfu = t["mfu"].as_f64().unwrap();
    let by_hand = t["flops_per_token"].as_f64().unwrap() * t["tokens_per_sec"].as_f64().unwrap()
        / t["peak_flops"].as_f64().unwrap();
    assert!((mfu - by_hand).abs() < 1e-12 * by_hand.max(1.0), "{mfu} vs {by_hand}");
    let l = json(&["bench", "loss", "--tokens", "256", "--d-model", "32", "--vocab", "5000", "--json"]);
    for key in ["plain_peak_bytes", "chunked_peak_bytes", "plain_ms", "chunked_ms"] {
        assert!(!l[key].is_null(), "bench loss lacks {key}: {l}");
    }
    assert!(l["chunked_peak_bytes"].as_u64().unwrap() < l["plain_peak_bytes"].as_u64().unwrap(), "{l}");
    assert!(l["loss_diff"].as_f64().unwrap() < 1e-4, "{l}");
    // LoRA on a random base: a benchmark may (the step's cost does not depend on the weights), a
    // run may not.
    s.write(
        "lora.toml",
        &format!("{}\n[lora]\nrank = 2\nalpha = 4\ntargets = [\"q_proj\", \"down_proj\"]\n", tiny_config("")),
    );
    let lora = json(&["bench", "train", "--config", "lora.toml", "--steps", "2", "--warmup", "1", "--json"]);
    assert!(lora["tokens_per_sec"].as_f64().unwrap() > 0.0, "{lora}");
    // A frozen base has no weight gradients: its FLOPs are 4N and the adapters', not 6N.
    let (lora_flops, full_flops) = (lora["flops_per_token"].as_f64().unwrap(), t["flops_per_token"].as_f64().unwrap());
    assert!(lora_flops < full_flops && lora_flops > 0.6 * full_flops, "{lora_flops} vs {full_flops}");
    // bf16 on the CPU: a bf16 run measured against the bf16 kernel's peak where the CPU has it,
    // an f32 one (said so) where it has not.
    let o = s.ember(&[
        "bench",
        "train",
        "--config",
        "tiny.toml",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--precision",
        "bf16",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let b: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let kernel = stderr(&o).contains("bf16 operands with f32 sums");
    assert_eq!(b["precision"], if kernel { "bf16" } else { "f32" }, "{b}");
    // The kernel's own peak: the vector kernel's or, on a CPU with AMX, the tiles'.
    let source = b["peak_source"].as_str().unwrap();
    assert_eq!(source.contains("bf16-") && source.contains("kernel"), kernel, "{b}");
    let o = s.ember(&["train", "--config", "lora.toml"]);
    assert_clean_error(&o, "adapters fine-tune a pretrained model; set init_from");
    let p = json(&["bench", "peak", "--sizes", "64,128", "--reps", "2", "--json"]);
    assert!(p["peak_flops"].as_f64().unwrap() > 0.0, "{p}");
    assert_eq!(p["gemms"].as_array().unwrap().len(), 2);
    let p = json(&["bench", "peak", "--sizes", "64", "--reps", "2", "--dtype", "bf16", "--json"]);
    assert_eq!(p["dtype"].as_str().unwrap().contains("kernel"), kernel, "{p}");
    // The attention kernels: f32 always, bf16 products where the CPU has the kernel, within bf16
    // rounding of f32 (160 positions: three blocks, the last partial).
    let shape = ["--batch", "1", "--seq", "160", "--heads", "4", "--kv-heads", "2", "--head-dim", "32"];
    let a = json(&[&["bench", "attention"][..], &shape, &["--reps", "2", "--json"]].concat());
    assert!(a["f32_forward_ms"].as_f64().unwrap() > 0.0 && a["f32_backward_ms"].as_f64().unwrap() > 0.0, "{a}");
    assert_eq!(a["bf16_backward_ms"].is_null(), !kernel, "{a}");
    if kernel {
        let error = a["bf16_output_error"].as_f64().unwrap();
        assert!(error > 0.0 && error < 2e-2, "{a}");
    }
    let o = s.ember(&["bench", "attention", "--heads", "9", "--kv-heads", "2"]);
    assert_clean_error(&o, "--heads 9 is not a multiple of --kv-heads 2");
    let o = s.ember(&["bench", "attention", "--seq", "100000000", "--batch", "1000"]);
    assert_clean_error(&o, "needs more than the 8 GiB");
}

#[test]
fn cached_batched_sampling_eval_and_decode_bench() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &tiny_config(""));
    let o = s.ember(&["train", "--config", "tiny.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let sample = |extra: &[&str]| {
        let mut args = vec!["sample", "--checkpoint", "runs/tiny", "--max-new-tokens", "20", "--temperature", "0"];
        args.extend_from_slice(extra);
        let o = s.ember(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        stdout(&o)
    };
    // Greedy: the KV-cached path and the full-recompute path print the same text.
    let cached = sample(&["--prompt", "ROMEO:"]);
    assert_eq!(cached, sample(&["--prompt", "ROMEO:", "--no-cache"]));
    // A batch of prompts gives each prompt's own continuation.
    let batch = sample(&["--prompt", "ROMEO:", "--prompt", "NURSE:\nthe"]);
    let alone = sample(&["--prompt", "NURSE:\nthe"]);
    assert!(batch.contains(&format!("=== 0 ===\n{}", cached.trim_end())), "{batch}");
    assert!(batch.contains(&format!("=== 1 ===\n{}", alone.trim_end())), "{batch}");
    // A stop string ends the text before it.
    let cut = cached["ROMEO:".len()..].chars().take(6).collect::<String>();
    let stop = cut.chars().skip(3).collect::<String>();
    let stopped = sample(&["--prompt", "ROMEO:", "--stop", &stop]);
    assert_eq!(stopped.trim_end_matches('\n'), format!("ROMEO:{}", &cut[..cut.len() - stop.len()]));

    let eval = |data: &str, extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["eval", "--perplexity", "--checkpoint", "runs/tiny", "--data", data, "--json"];
        args.extend_from_slice(extra);
        let o = s.ember(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        serde_json::from_str(stdout(&o).trim()).unwrap()
    };
    let val = eval("val", &["--context", "32", "--stride", "32"]);
    for key in ["nll", "perplexity", "bits_per_byte", "tokens"] {
        assert!(val[key].as_f64().is_some(), "{key}: {val}");
    }
    let nll = val["nll"].as_f64().unwrap();
    assert!((val["perplexity"].as_f64().unwrap() - nll.exp()).abs() < 1e-9 * nll.exp());
    // The run's last evaluation saw the same model on random val windows: same ballpark.
    let last = read_metrics(&s.path().join("runs/tiny/metrics.jsonl")).unwrap().last().unwrap().val_loss.unwrap();
    assert!((nll - last).abs() < 0.3, "eval nll {nll} vs training val loss {last}");
    s.write("held_out.txt", "ROMEO:\nthe night is long and love doth speak,\n");
    let file = eval("held_out.txt", &[]);
    assert_eq!(file["tokens"].as_u64().unwrap(), 45); // 46 characters, the first is context only

    let decode = |extra: &[&str]| {
        let mut args = vec!["bench", "decode", "--checkpoint", "runs/tiny"];
        args.extend_from_slice(extra);
        s.ember(&args)
    };
    let json = |o: std::process::Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(stdout(&o).trim()).unwrap()
    };
    let d = json(decode(&["--contexts", "4,16", "--new-tokens", "4", "--uncached-tokens", "2", "--json"]));
    assert_eq!(d["contexts"], serde_json::json!([4, 16]));
    assert_eq!(d["cached_ms_per_token"].as_array().unwrap().len(), 2);
    assert_eq!(d["uncached_ms_per_token"].as_array().unwrap().len(), 2);
    assert_eq!(d["batch"], 1);
    // Several sequences a step: the aggregate rate is the batch over the step time.
    let d = json(decode(&["--contexts", "8", "--new-tokens", "3", "--uncached-tokens", "1", "--batch", "3", "--json"]));
    assert_eq!(d["batch"], 3);
    let (ms, rate) = (d["cached_ms_per_token"][0].as_f64().unwrap(), d["decode_tokens_per_sec"][0].as_f64().unwrap());
    assert!((rate - 3e3 / ms).abs() <= 1e-6 * rate, "{rate} tokens/s at {ms} ms a step of 3");
    // Where a step goes: the parts add up to the step, the timed ones each some of it; and the
    // process's peak resident memory.
    let parts = &d["cached_parts_ms"][0];
    let part = |k: &str| parts[k].as_f64().unwrap();
    let sum = part("projections") + part("attention") + part("head") + part("other");
    assert!((sum - ms).abs() <= 1e-6 * ms, "parts {parts} of a {ms} ms step");
    assert!(part("projections") > 0.0 && part("attention") > 0.0 && part("head") > 0.0, "{parts}");
    assert!(d["prefill_parts_ms"][0]["projections"].as_f64().unwrap() > 0.0);
    assert!(d["peak_rss_bytes"].as_u64().unwrap() > 1 << 20);
    assert_clean_error(
        &decode(&["--contexts", "8", "--new-tokens", "3", "--batch", "0"]),
        "--batch 0 is not in 1..=256",
    );
    let o = s.ember(&["bench", "decode", "--checkpoint", "runs/tiny", "--contexts", "30"]);
    assert_clean_error(&o, "does not fit the model's max_seq_len of 32");

    // The serving bench counts every streamed token (from the usage chunk it asks for).
    let args =
        ["bench", "serve", "--checkpoint", "runs/tiny", "--clients", "1,2", "--requests", "2", "--prompt", "ROMEO:"];
    let b = json(s.ember(&[&args[..], &["--max-tokens", "5", "--json"]].concat()));
    for (load, clients) in b["loads"].as_array().unwrap().iter().zip([1, 2]) {
        assert_eq!(load["tokens"], clients * 2 * 5, "{load}");
        assert!(load["tokens_per_s"].as_f64().unwrap() > 0.0, "{load}");
    }
}

/// Ctrl-C during `ember train`: the step in hand is checkpointed, the summary says where and how to
/// resume, and the printed command resumes it.
#[test]
fn sigint_checkpoints_the_step_in_hand_and_prints_the_resume_command() {
    use std::process::Stdio;
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    // Steps enough never to finish here; no periodic checkpoint.
    let config = tiny_config("")
        .replace("max_steps = 6", "max_steps = 100000")
        .replace("checkpoint_interval = 3", "checkpoint_interval = 0");
    s.write("long.toml", &config);
    let run = s.path().join("long");
    let mut cmd = s.command(&["train", "--config", "long.toml", "--run-dir", "long"]);
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Once three steps are logged (after the step-0 evaluation's line).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < 4 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(std::time::Instant::now() < deadline, "no 3 steps in 60 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: kill(2) with the id of a child this test started and has not yet waited for.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    // Not a success (a script must not go on with the run cut short): 128 + SIGINT, as shells say.
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(!stderr(&o).contains("error: "), "{}", stderr(&o));
    let text = stdout(&o);
    let step: usize = text
        .split("stopped at step ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {text}"));
    assert!(step >= 3, "{text}");
    let ckpt = format!("step-{step:06}");
    assert!(text.contains(&format!("checkpoint long/checkpoints/{ckpt} written")), "{text}");
    assert!(stderr(&o).contains(&format!("stop requested: the run stops at step {step}")), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(run.join("checkpoints/latest")).unwrap(), ckpt);
    let records = read_metrics(&run.join("metrics.jsonl")).unwrap();
    assert_eq!(records.last().unwrap().step, step, "the step in hand finished and was logged");
    let command = text.lines().find_map(|l| l.strip_prefix("resume with: ")).unwrap_or_else(|| panic!("{text}"));
    let (program, rest) = command.split_once(" train ").unwrap_or_else(|| panic!("{command}"));
    let called = std::env::var("EMBER_BIN").ok().filter(|b| !b.is_empty());
    assert_eq!(program, called.as_deref().unwrap_or(env!("CARGO_BIN_EXE_ember")), "the program as it was called");
    assert_eq!(rest, "--config long/config.toml --run-dir long --resume");
    // The command resumes the run (two more steps here).
    let mut words: Vec<&str> = ["train"].into_iter().chain(rest.split(' ')).collect();
    let until = (step + 2).to_string();
    words.extend(["--max-steps", &until]);
    let o = s.ember(&words);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming"), "{}", stderr(&o));
    let steps: Vec<usize> = read_metrics(&run.join("metrics.jsonl")).unwrap().iter().map(|r| r.step).collect();
    assert_eq!(steps, (1..=step + 2).collect::<Vec<_>>());
    // Again up to the same step: nothing to train, and the way on.
    let o = s.ember(&words);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(&format!("at step {until} already, at or past --max-steps {until}")), "{}", stdout(&o));
}

/// A chat fine-tune's evaluation samples answer the first held-out conversation (up to its last user
/// turn, through the chat template), not a bare newline.
#[test]
fn chat_fine_tunes_sample_a_held_out_conversation() {
    let s = Scratch::new();
    let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen2");
    let o = s.ember(&["import", fixture.to_str().unwrap(), "--out", "base"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}\
                    {% if add_generation_prompt %}<assistant>{% endif %}";
    s.write("base/checkpoints/step-000000/chat_template.jinja", template);
    let mut jsonl = String::new();
    for i in 0..10 {
        let messages = serde_json::json!([
            {"role": "user", "content": format!("hi {i}")},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": format!("count to {i}")},
            {"role": "assistant", "content": format!("done {i}")},
        ]);
        jsonl.push_str(&serde_json::json!({ "messages": messages }).to_string());
        jsonl.push('\n');
    }
    s.write("chat.jsonl", &jsonl);
    s.write(
        "chat.toml",
        "init_from = \"run:base\"\n\n[data]\npath = \"chat.jsonl\"\n\n\
         [train]\nbatch_size = 2\nseq_len = 64\nmax_steps = 2\neval_interval = 2\neval_iters = 1\n\n\
         [optim]\n\n[schedule]\nlr = 1e-3\n\n[metrics]\nsample_tokens = 4\n",
    );
    let o = s.ember(&["train", "--config", "chat.toml", "--run-dir", "chat"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let samples = std::fs::read_to_string(s.path().join("chat/samples.jsonl")).unwrap();
    let sample: serde_json::Value = serde_json::from_str(samples.lines().last().unwrap()).unwrap();
    // The held-out example is the file's last (one in ten held out).
    assert_eq!(sample["prompt"], "<user>hi 9\n<assistant>hello\n<user>count to 9\n<assistant>", "{sample}");
}

/// `ember import --dtype bf16` saves bf16 tensors (half the f32 file); inference keeps its
/// projections in bf16 (decoding multiplies them as stored, the log says so) and answers as the same
/// values widened to f32 do (its f32 export, served from a folder of f32 tensors).
#[test]
fn a_bf16_import_is_saved_and_decoded_in_bf16() {
    let s = Scratch::new();
    let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen2");
    for (dtype, out) in [("bf16", "half"), ("f32", "full")] {
        let o = s.ember(&["import", fixture.to_str().unwrap(), "--dtype", dtype, "--out", out]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let weights = |run: &str| s.path().join(run).join("checkpoints/step-000000/model.safetensors");
    let bytes = std::fs::read(weights("half")).unwrap();
    let (tensors, _) = ember_model::weights::from_safetensors(&bytes, "half").unwrap();
    for (name, data) in &tensors {
        assert_eq!(data.dtype, burn::tensor::DType::BF16, "{name}");
    }
    let full = std::fs::metadata(weights("full")).unwrap().len();
    assert!((bytes.len() as u64) < full * 6 / 10, "{} bytes against {full}", bytes.len());
    let o = s.ember(&["export", "half", "--out", "widened"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let greedy = |checkpoint: &str| {
        let o = s.ember(&[
            "sample",
            "--checkpoint",
            checkpoint,
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--log",
            "info",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        (stdout(&o), stderr(&o).contains("the projections kept in bf16, as stored"))
    };
    let (kept, said) = greedy("half");
    assert!(said, "the log names the bf16 projections");
    let (widened, said) = greedy("hf:widened");
    assert!(!said, "an f32 folder is run in f32");
    assert_eq!(kept, widened);
    // The same values as GGUF files, run from the files (their tokenizer is rebuilt from the
    // metadata, so they are compared with each other): bf16 kept, f32 as it is, the same answer.
    for dtype in ["bf16", "f32"] {
        let o = s.ember(&["export", "half", "--dtype", dtype, "--out", &format!("{dtype}.gguf")]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let (kept, said) = greedy("gguf:bf16.gguf");
    assert!(said, "a bf16 GGUF file keeps its projections in bf16");
    let (widened, said) = greedy("gguf:f32.gguf");
    assert!(!said, "an f32 GGUF file is run in f32");
    assert_eq!(kept, widened);
}

/// [`tiny_config`] for `ember bench target`: checkpoints only at the end.
fn target_config() -> String {
    tiny_config("").replace("checkpoint_interval = 3", "checkpoint_interval = 0")
}

#[test]
fn bench_target_stops_at_the_first_evaluation_at_or_below_the_target() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &target_config());
    let (target, max_steps) = (TARGET_EASY, 200);
    let t = target.to_string();
    let args = ["bench", "target", "--config", "tiny.toml", "--target-val", &t, "--max-steps", "200", "--runs", "2"];
    let args = [&args[..], &["--eval-interval", "10", "--eval-iters", "2", "--seed", "3", "--out", "out"]].concat();
    let o = s.ember(&[&args[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("reached val loss"), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one JSON object");
    for key in ["config", "target_val", "reached", "median_time_to_target_s", "median_steps", "runs"] {
        assert!(!j[key].is_null(), "bench target lacks {key}: {j}");
    }
    let runs = j["runs"].as_array().unwrap();
    assert_eq!((j["reached"].as_bool(), runs.len()), (Some(true), 2), "{j}");
    let mut times_and_steps = Vec::new();
    for (run, seed) in runs.iter().zip([3u64, 4]) {
        for key in ["time_to_target_s", "steps", "tokens", "step_ms", "elapsed_s", "best_val_loss", "curve"] {
            assert!(!run[key].is_null(), "a run lacks {key}: {run}");
        }
        assert_eq!(run["seed"].as_u64(), Some(seed), "{run}");
        let steps = run["steps"].as_u64().unwrap();
        assert!(steps < max_steps && steps.is_multiple_of(10), "{run}");
        assert_eq!(run["tokens"].as_u64(), Some(steps * 4 * 32), "{run}");
        let curve = run["curve"].as_array().unwrap();
        let vals: Vec<f64> = curve.iter().map(|p| p["val_loss"].as_f64().unwrap()).collect();
        let (last, earlier) = vals.split_last().unwrap();
        assert!(*last <= target && earlier.iter().all(|&v| v > target), "{vals:?}");
        assert_eq!(curve.last().unwrap()["step"].as_u64(), Some(steps));
        let t = run["time_to_target_s"].as_f64().unwrap();
        assert_eq!(curve.last().unwrap()["elapsed_s"].as_f64(), Some(t));
        assert!(t > 0.0 && t <= run["elapsed_s"].as_f64().unwrap(), "{run}");
        // The run, in --out: its last checkpoint at the target's step, its best/, the record of
        // that evaluation marked in metrics.jsonl.
        let dir = s.path().join(format!("out/seed-{seed}"));
        assert!(dir.join(format!("checkpoints/step-{steps:06}")).is_dir() && dir.join("best").is_dir(), "{seed}");
        let records = read_metrics(&dir.join("metrics.jsonl")).unwrap();
        let marked: Vec<_> = records.iter().filter_map(|r| r.target_reached_s.map(|at| (r.step, at))).collect();
        assert_eq!(marked, [(steps as usize, t)]);
        times_and_steps.push((t, steps as f64));
    }
    // The median of two: their mean.
    let [(t0, s0), (t1, s1)] = times_and_steps[..] else { unreachable!() };
    assert!((j["median_time_to_target_s"].as_f64().unwrap() - (t0 + t1) / 2.0).abs() < 1e-9, "{j}");
    assert_eq!(j["median_steps"].as_f64(), Some((s0 + s1) / 2.0), "{j}");
    // Again into the same --out: refused, the first run kept.
    assert_clean_error(&s.ember(&args), "exists already");
}

/// A val loss the tiny config reaches in about 60 of its 200 steps (from 3.7 at step 0, 1.05 at 200).
const TARGET_EASY: f64 = 1.7;

#[test]
fn bench_target_not_reached_exits_2_and_bad_values_are_refused() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("tiny.toml", &target_config());
    let bench = |extra: &[&str]| s.ember(&[&["bench", "target", "--config", "tiny.toml"][..], extra].concat());
    let o = bench(&["--target-val", "0.01", "--max-steps", "20", "--eval-interval", "10", "--runs", "2", "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("did not reach --target-val 0.01 within 20 steps (seeds 7, 8)"), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one JSON object");
    assert_eq!((j["reached"].as_bool(), j["median_time_to_target_s"].is_null()), (Some(false), true), "{j}");
    let runs = j["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for (run, seed) in runs.iter().zip([7, 8]) {
        assert_eq!((run["seed"].as_u64(), run["steps"].as_u64()), (Some(seed), Some(20)), "{run}");
        assert!(run["time_to_target_s"].is_null() && run["curve"].as_array().unwrap().len() == 3, "{run}");
    }
    for (args, message) in [
        (&["--target-val", "-1"][..], "--target-val -1 is not a val loss"),
        (&["--target-val", "NaN"], "--target-val NaN is not a val loss"),
        (&["--target-val", "inf"], "--target-val inf is not a val loss"),
        (&["--target-val", "1.5", "--eval-interval", "0"], "--eval-interval 0 is not in 1..="),
        (&["--target-val", "1.5", "--max-steps", "0"], "--max-steps 0 is not in 1..="),
        (&["--target-val", "1.5", "--runs", "0"], "--runs 0 is not in 1..=100"),
    ] {
        assert_clean_error(&bench(args), message);
    }
    // The config key is checked as such.
    s.write("bad.toml", &target_config().replace("seed = 7", "seed = 7\ntarget_val_loss = -2.0"));
    assert_clean_error(&s.ember(&["train", "--config", "bad.toml"]), "train.target_val_loss");
}

/// The tiny config with a mixture of 4 experts (top 2) in place of each block's MLP.
fn moe_config(extra_train: &str) -> String {
    tiny_config(extra_train).replace(
        "max_seq_len = 32\n",
        "max_seq_len = 32\n\n[model.moe]\nn_experts = 4\ntop_k = 2\nd_expert = 16\nnorm_topk = true\naux_loss_coef = 0.05\nz_loss_coef = 0.001\n",
    )
}

#[test]
fn a_mixture_of_experts_trains_logs_its_routing_resumes_bitwise_and_exports() {
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    s.write("moe.toml", &moe_config(""));
    let o = s.ember(&["train", "--config", "moe.toml", "--run-dir", "straight"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("4 experts of 16 (top 2)"), "{}", stderr(&o));
    let records = read_metrics(&s.path().join("straight/metrics.jsonl")).unwrap();
    assert_eq!(records.len(), 6);
    for r in &records {
        // Each layer's load: four fractions summing to one; the balancing loss near k = 2 when even.
        let load = r.expert_load.as_ref().expect("the experts' load");
        assert_eq!(load.len(), 2, "{load:?}");
        assert!(load.iter().all(|row| row.len() == 4 && (row.iter().sum::<f64>() - 1.0).abs() < 1e-9), "{load:?}");
        let worst = load.iter().map(|row| row.iter().copied().fold(0.0, f64::max) * 4.0).fold(0.0, f64::max);
        assert!((r.named["expert_load_max_over_mean"] - worst).abs() < 1e-9, "{:?}", r.named);
        assert!(r.named.contains_key("expert_load_max_over_mean/layer1"), "{:?}", r.named);
        let (aux, z) = (r.named["aux_loss"], r.named["z_loss"]);
        assert!((1.0..4.0).contains(&aux) && z > 0.0, "aux {aux}, z {z}");
    }
    // Stopped at 4 and resumed: the same numbers bit for bit (the routing and the stacked experts
    // are checkpointed and restored whole).
    let o = s.ember(&["train", "--config", "moe.toml", "--run-dir", "split", "--max-steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = s.ember(&["train", "--config", "moe.toml", "--run-dir", "split", "--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let resumed = read_metrics(&s.path().join("split/metrics.jsonl")).unwrap();
    for (x, y) in records.iter().zip(&resumed) {
        assert_eq!(x.train_loss.to_bits(), y.train_loss.to_bits(), "step {}", x.step);
        assert_eq!(x.named["aux_loss"].to_bits(), y.named["aux_loss"].to_bits(), "step {}", x.step);
        assert_eq!(x.expert_load, y.expert_load, "step {}", x.step);
    }
    let o = s.ember(&["sample", "--checkpoint", "straight/best", "--prompt", "ROMEO:", "--max-new-tokens", "5"]);
    assert!(o.status.success() && stdout(&o).starts_with("ROMEO:"), "{}", stderr(&o));
    // Exported as the family its parts make: Mixtral (experts, no shared expert, no q/k/v bias).
    let o = s.ember(&["export", "straight", "--format", "hf", "--out", "hf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.path().join("hf/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "MixtralForCausalLM", "{cfg}");
    assert_eq!((cfg["num_local_experts"].as_u64(), cfg["num_experts_per_tok"].as_u64()), (Some(4), Some(2)));
    assert_eq!(cfg["router_aux_loss_coef"].as_f64(), Some(0.05));
    // LoRA on the trained mixture of experts: the attention's projections and, with the MLP's
    // targets, every expert's (one adapter each, stacked as the experts are). The checkpoints hold
    // the adapters only; the merged export is a plain Mixtral folder again.
    s.write("lora.toml", &lora_config("straight", "corpus.txt", 2, 2, 1e-3, 7));
    let o = s.ember(&["train", "--config", "lora.toml", "--run-dir", "lora"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("4 experts of 16 (top 2)"), "{}", stderr(&o));
    let latest = Checkpoint::open(&s.path().join("lora")).unwrap().dir;
    assert!(!latest.join("model.safetensors").exists());
    let bytes = std::fs::read(latest.join("adapter.safetensors")).unwrap();
    let saved = ember_model::weights::from_safetensors(&bytes, "lora").unwrap().0;
    for stack in ["gate", "up", "down"] {
        let b = &saved[&format!("layers.1.moe.lora.{stack}.lora_b")];
        assert_eq!(b.shape[0], 4, "one adapter an expert");
        assert!(b.to_vec::<f32>().unwrap().iter().any(|&v| v != 0.0), "{stack}: trained off zero");
    }
    assert!(saved.keys().all(|k| k.contains(".lora.")), "adapters only: {:?}", saved.keys().collect::<Vec<_>>());
    let o = s.ember(&["export", "lora", "--format", "hf", "--merge", "--out", "merged"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let names = std::fs::read_to_string(s.path().join("merged/config.json")).unwrap();
    assert!(names.contains("MixtralForCausalLM"), "{names}");
}
