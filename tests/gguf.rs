//! GGUF in and out on the real SmolLM2-135M-Instruct (Q8_0 embedding, Q4_1 matrices) of
//! `$EMBER_TEST_ASSETS/models`, against what independent readers give: transformers loading the
//! same file with `gguf_file=` (tokenizer ids, logits, greedy continuations recorded in
//! tests/fixtures/gguf/smollm2.json by make_gguf_fixtures.py), and the `gguf` Python package
//! reading ember's exports (run here through tests/gguf_readback.py).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use common::*;
use ember_hf::gguf::{GgufFile, Value};
use ember_model::sample::{generate, Sampler, SamplingConfig};
use ember_train::Checkpoint;

const MODEL: &str = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_file() -> PathBuf {
    let path = assets().join(MODEL);
    assert!(
        path.is_file(),
        "{} not found: set EMBER_TEST_ASSETS to the folder holding models/ (../shared)",
        path.display()
    );
    path
}

fn fixture() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A Python with the `gguf` package: $EMBER_PYTHON (`.ci/run` sets it), else `python3`.
fn python() -> String {
    let py = std::env::var("EMBER_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py).args(["-c", "import gguf, numpy"]).output().is_ok_and(|o| o.status.success());
    assert!(ok, "{py} cannot import gguf: `pip install gguf numpy` (or run .ci/run, which sets EMBER_PYTHON)");
    py
}

fn logits(model: &ember_model::Decoder<Flex>, ids: &[u32]) -> Vec<f32> {
    let t: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let input = Tensor::<Flex, 2, Int>::from_data(TensorData::new(t, [1, ids.len()]), &Default::default());
    model.forward(input).into_data().to_vec::<f32>().unwrap()
}

#[test]
fn smollm2_imports_as_transformers_reads_it_and_round_trips() {
    let fx = fixture();
    let s = Scratch::new();
    let gguf = model_file();
    let o = s.ember(&["import", gguf.to_str().unwrap(), "--out", "smol"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("\"Q4_1\": 210"), "{}", stdout(&o));
    let ckpt = Checkpoint::open(&s.path().join("smol")).unwrap();

    // The tokenizer rebuilt from the metadata gives transformers' ids on mixed text.
    let text = fx["text"].as_str().unwrap();
    assert!(text.chars().count() >= 3000);
    assert_eq!(ckpt.tokenizer.encode(text).unwrap(), ids(&fx["text_ids"]), "tokenizer ids differ from transformers'");

    // Logits (a sample of vocabulary columns at every position) and greedy continuations.
    let model = ckpt.decoder::<Flex>(&Default::default()).unwrap();
    let vocab = model.config().vocab_size;
    let (mut worst, mut largest) = (0f32, 0f32);
    for p in fx["prompts"].as_array().unwrap() {
        let prompt = ids(&p["ids"]);
        assert_eq!(ckpt.tokenizer.encode(p["prompt"].as_str().unwrap()).unwrap(), prompt);
        let got = logits(&model, &prompt);
        let cols = ids(&p["columns"]);
        for (t, row) in p["logits"].as_array().unwrap().iter().enumerate() {
            for (c, want) in cols.iter().zip(row.as_array().unwrap()) {
                let (g, w) = (got[t * vocab + *c as usize], want.as_f64().unwrap() as f32);
                worst = worst.max((g - w).abs());
                largest = largest.max(w.abs());
            }
        }
        let mut sampler = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap();
        let want = ids(&p["greedy"]);
        let mut out = Vec::new();
        generate(&model, &prompt, want.len(), &mut sampler, |id| {
            out.push(id);
            id != 2 // transformers stops after the model's EOS, <|im_end|>
        })
        .unwrap();
        assert_eq!(out, want, "greedy continuation of {:?}", p["prompt"]);
    }
    // Both compute in f32 over 30 layers with different summation orders: within 1e-4 of the
    // logits' scale (about 1e-4 absolute on logits up to ~20).
    eprintln!("largest logit difference from transformers: {worst:e} (logits up to {largest})");
    assert!(worst < 1e-4 * largest.max(1.0), "logits differ from transformers' by {worst} (scale {largest})");

    // Export f32: every tensor is the original's dequantized values in llama.cpp's layout (the q/k
    // rows permuted back), the metadata carries the tokenizer and chat template.
    let o = s.ember(&["export", "smol", "--format", "gguf", "--out", "smol-f32.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (orig, f32s) = (GgufFile::open(&gguf).unwrap(), GgufFile::open(&s.path().join("smol-f32.gguf")).unwrap());
    assert_eq!(orig.tensors.len(), f32s.tensors.len());
    for t in &orig.tensors {
        let e = f32s.tensor(&t.name).unwrap_or_else(|| panic!("export lacks {}", t.name));
        assert_eq!(e.shape(), t.shape(), "{}", t.name);
        assert!(orig.dequantize(t) == f32s.dequantize(e), "{}: values differ", t.name);
    }
    for key in [
        "general.architecture",
        "llama.block_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.context_length",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template",
        // Descriptive metadata travels through import and export.
        "general.license",
        "general.organization",
        "general.languages",
        "tokenizer.ggml.unknown_token_id",
    ] {
        let (a, b) = (orig.get(key), f32s.get(key));
        let same = match (a, b) {
            (Some(Value::Array(x)), Some(Value::Array(y))) => {
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.as_f64() == q.as_f64() && p.as_str() == q.as_str())
            }
            (Some(x), Some(y)) => x.as_f64() == y.as_f64() && x.as_str() == y.as_str(),
            _ => false,
        };
        assert!(same, "metadata {key} differs after export");
    }

    // Import of the export: identical weights.
    let o = s.ember(&["import", "smol-f32.gguf", "--out", "smol2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let weights = |run: &str| {
        let dir = Checkpoint::open(&s.path().join(run)).unwrap().dir;
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let tensors = ember_model::weights::from_safetensors(&bytes, run).unwrap().0;
        tensors.into_iter().map(|(k, t)| (k, t.as_bytes().to_vec())).collect::<std::collections::BTreeMap<_, _>>()
    };
    let (first, second) = (weights("smol"), weights("smol2"));
    assert_eq!(first.len(), 272);
    assert!(first == second, "import -> export f32 -> import changed the weights");

    // q8_0: the matrices within half a quantization step (of the f16 scale), the logits close to
    // the f32 model's.
    let o = s.ember(&["export", "smol", "--format", "gguf", "--dtype", "q8_0", "--out", "smol-q8.gguf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let q8 = GgufFile::open(&s.path().join("smol-q8.gguf")).unwrap();
    let q8_size = std::fs::metadata(s.path().join("smol-q8.gguf")).unwrap().len();
    let f32_size = std::fs::metadata(s.path().join("smol-f32.gguf")).unwrap().len();
    assert!(q8_size * 3 < f32_size, "q8_0 {q8_size} bytes vs f32 {f32_size}");
    for t in &f32s.tensors {
        let (a, b) = (f32s.dequantize(t), q8.dequantize(q8.tensor(&t.name).unwrap()));
        for (block, (x, y)) in a.chunks(32).zip(b.chunks(32)).enumerate() {
            let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let err = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            // Half a step, plus the rounding of the block's scale to f16 (127 steps · 2^-11).
            assert!(err <= (0.5 + 127.0 / 2048.0) * step + 1e-6, "{} block {block}: error {err}, step {step}", t.name);
        }
    }
    let o = s.ember(&["import", "smol-q8.gguf", "--out", "smol-q8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let q8_model = Checkpoint::open(&s.path().join("smol-q8")).unwrap().decoder::<Flex>(&Default::default()).unwrap();
    let prompt = ids(&fx["prompts"][0]["ids"]);
    let (a, b) = (logits(&model, &prompt), logits(&q8_model, &prompt));
    let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let spread = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    eprintln!("q8_0 export: {q8_size} bytes (f32 {f32_size}); largest logit change {diff} (logits up to {spread})");
    assert!(diff < 0.05 * spread, "q8_0 changed the logits by {diff}");

    // llama.cpp's own Python reader reads both exports with the same metadata and tensors.
    let py = python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/gguf_readback.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(s.path().join("smol-f32.gguf"))
        .arg(s.path().join("smol-q8.gguf"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for (line, file) in text.lines().zip([&f32s, &q8]) {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(r["metadata"]["general.architecture"], "llama");
        assert_eq!(r["metadata"]["llama.block_count"], 30);
        assert_eq!(r["metadata"]["tokenizer.ggml.tokens"]["len"], 49152);
        assert_eq!(
            r["metadata"]["tokenizer.chat_template"].as_str(),
            orig.get("tokenizer.chat_template").and_then(Value::as_str)
        );
        let tensors = r["tensors"].as_object().unwrap();
        assert_eq!(tensors.len(), file.tensors.len());
        for t in &file.tensors {
            let theirs = &tensors[&t.name];
            assert_eq!(theirs["type"], t.kind.name(), "{}", t.name);
            let shape: Vec<usize> =
                theirs["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            assert_eq!(shape, t.shape(), "{}", t.name);
            let v = file.dequantize(t);
            let (sum, sumsq) = v.iter().fold((0f64, 0f64), |(a, b), &x| (a + x as f64, b + (x as f64) * (x as f64)));
            let (ts, tq) = (theirs["sum"].as_f64().unwrap(), theirs["sumsq"].as_f64().unwrap());
            assert!((sum - ts).abs() <= 1e-6 * tq.sqrt().max(1.0), "{}: sum {sum} vs {ts}", t.name);
            assert!((sumsq - tq).abs() <= 1e-6 * tq.max(1.0), "{}: sum of squares {sumsq} vs {tq}", t.name);
        }
    }

    // Chat through the template stops at <|im_end|> and prints no special token.
    let o = s.ember(&[
        "sample",
        "--checkpoint",
        "smol",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--max-new-tokens",
        "40",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let answer = stdout(&o);
    assert!(answer.contains("Paris") && !answer.contains("<|im"), "{answer}");
}

/// The tensors of a run's checkpoint, by name.
fn run_tensors(s: &Scratch, run: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
    let dir = Checkpoint::open(&s.path().join(run)).unwrap().dir;
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = ember_model::weights::from_safetensors(&bytes, run).unwrap().0;
    tensors.into_iter().map(|(k, t)| (k, t.as_bytes().to_vec())).collect()
}

#[test]
fn hf_fixtures_round_trip_through_gguf() {
    // The Llama fixture (q/k rows permuted on the way out and back) and the Qwen2 one (q/k/v biases,
    // tied head); both carry a SentencePiece-style tokenizer, exported as GGUF's `llama` tokenizer.
    // (Text the fixtures' small vocabulary covers: unknown characters are fused into one `<unk>` by
    // SentencePiece, one each by the fixture's BPE.)
    let text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.";
    for name in ["llama", "qwen2"] {
        let s = Scratch::new();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf").join(name);
        for args in [
            vec!["import", dir.to_str().unwrap(), "--out", "hf"],
            vec!["export", "hf", "--format", "gguf", "--out", "m.gguf"],
            vec!["import", "m.gguf", "--out", "back"],
        ] {
            let o = s.ember(&args);
            assert!(o.status.success(), "{name} {args:?}: {}", stderr(&o));
        }
        assert!(run_tensors(&s, "hf") == run_tensors(&s, "back"), "{name}: weights changed through GGUF");
        let gguf = GgufFile::open(&s.path().join("m.gguf")).unwrap();
        assert_eq!(gguf.get("tokenizer.ggml.model").and_then(Value::as_str), Some("llama"), "{name}");
        assert_eq!(gguf.get("general.architecture").and_then(Value::as_str), Some(name), "{name}");
        let ids = |run: &str| Checkpoint::open(&s.path().join(run)).unwrap().tokenizer.encode(text).unwrap();
        assert!(!ids("hf").contains(&0), "{name}: the text should need no <unk>");
        assert_eq!(ids("back"), ids("hf"), "{name}: the tokenizer rebuilt from GGUF encodes differently");
    }
}
