//! GGUF in and out on the real SmolLM2-135M-Instruct (Q8_0 embedding, Q4_1 matrices) of
//! `$EMBER_TEST_ASSETS/models` and the real Gemma 3 270M (Q4_K_M), against what independent readers
//! give: transformers loading the same file with `gguf_file=` (tokenizer ids, logits, greedy
//! continuations and WikiText-2 perplexities recorded in tests/fixtures/gguf/{smollm2,gemma3}.json by
//! make_gguf_fixtures.py), and the `gguf` Python package reading ember's exports (run here through
//! tests/gguf_readback.py). The Hugging Face fixtures of every family go through GGUF too: the
//! exports re-import to transformers' logits (expected.json), and tests/fixtures/check_gguf_export.py,
//! run by hand, loads them with transformers' `gguf_file=`.

mod assets;
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use common::*;
use ember_generate::sample::{generate, Sampler, SamplingConfig};
use ember_hf::gguf::{GgufFile, Value};
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

/// The `node_modules` folder holding `node-llama-cpp` 3.21.1 (llama.cpp's prebuilt CPU build):
/// `$EMBER_NODE_MODULES`, else `target/node/node_modules`, where `.ci/run` installs it.
fn node_modules() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("EMBER_NODE_MODULES")
        .map(PathBuf::from)
        .map(|d| if d.is_relative() { root.join(d) } else { d })
        .unwrap_or_else(|| root.join("target/node/node_modules"));
    assert!(
        dir.join("node-llama-cpp").is_dir(),
        "node-llama-cpp is not in {}: `npm i -E --omit=optional --prefix target/node node-llama-cpp@3.21.1 \
         @node-llama-cpp/linux-x64@3.21.1` (as .ci/run does), or set EMBER_NODE_MODULES",
        dir.display()
    );
    dir
}

/// llama.cpp itself running `file` (tests/llama_cpp_greedy.mjs): per prompt, its ids as llama.cpp
/// tokenizes them and the `n` greedy ids after them.
fn llama_cpp(file: &Path, n: usize, prompts: &[&str]) -> Vec<(Vec<u32>, Vec<u32>)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/llama_cpp_greedy.mjs");
    let out = Command::new("node")
        .env("EMBER_NODE_MODULES", node_modules())
        .arg(&script)
        .arg(file)
        .arg(n.to_string())
        .args(prompts)
        .output()
        .expect("run node (install Node.js)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "llama.cpp could not run {}: {err}", file.display());
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");
    got["runs"].as_array().unwrap().iter().map(|r| (ids(&r["prompt_ids"]), ids(&r["ids"]))).collect()
}

fn logits(model: &ember_model::Decoder<Flex>, ids: &[u32]) -> Vec<f32> {
    let t: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
    let input = Tensor::<Flex, 2, Int>::from_data(TensorData::new(t, [1, ids.len()]), &Default::default());
    model.forward(input).into_data().to_vec::<f32>().unwrap()
}

/// The largest difference between `got` (`[T, V]` logits of a prompt) and the fixture prompt `p`'s
/// sampled columns, and the largest of those reference values.
fn column_errors(got: &[f32], vocab: usize, p: &serde_json::Value) -> (f32, f32) {
    let cols = ids(&p["columns"]);
    let (mut worst, mut largest) = (0f32, 0f32);
    for (t, row) in p["logits"].as_array().unwrap().iter().enumerate() {
        for (c, want) in cols.iter().zip(row.as_array().unwrap()) {
            let (g, w) = (got[t * vocab + *c as usize], want.as_f64().unwrap() as f32);
            worst = worst.max((g - w).abs());
            largest = largest.max(w.abs());
        }
    }
    (worst, largest)
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
        let (w, l) = column_errors(&logits(&model, &prompt), vocab, p);
        (worst, largest) = (worst.max(w), largest.max(l));
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

/// Every export type runs in llama.cpp itself and continues a prompt as ember does: f32, f16 and
/// bf16 (matrices in the type; norms and biases in f32, as llama.cpp's converter keeps them, without
/// which its CPU kernels abort at the first decode) and q8_0, of the imported SmolLM2 and of a LoRA
/// fine-tune of it merged on export. ember's side is its own import of the same file, so both read
/// the same numbers.
#[test]
fn llama_cpp_runs_every_export() {
    let s = Scratch::new();
    let gguf = model_file();
    let o = s.ember(&["import", gguf.to_str().unwrap(), "--out", "smol"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A short LoRA fine-tune that teaches one answer, merged into the weights on export.
    let rows: String = (0..24)
        .map(|_| format!("{}\n", serde_json::json!({"prompt": "Q: the sky?", "completion": " A: blue."})))
        .collect();
    s.write("sky.jsonl", &rows);
    s.write("lora.toml", &lora_config("smol", "sky.jsonl", 12, 12, 3e-3, 3));
    let o = s.ember(&["train", "--config", "lora.toml", "--run-dir", "ft"]);
    assert!(o.status.success(), "fine-tune failed: {}", stderr(&o));
    // One prompt a file: each run loads the model into llama.cpp anew (the time is in that).
    let n = 12;
    let mut continuations = std::collections::BTreeMap::new();
    for (run, merge, prompt) in [("smol", false, "The capital of France is"), ("ft", true, "Q: the sky?")] {
        for (dtype, matrices) in [("f32", "F32"), ("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")] {
            let file = format!("{run}-{dtype}.gguf");
            let mut args = vec!["export", run, "--format", "gguf", "--dtype", dtype, "--out", &file];
            if merge {
                args.push("--merge");
            }
            let o = s.ember(&args);
            assert!(o.status.success(), "{}", stderr(&o));
            let f = GgufFile::open(&s.path().join(&file)).unwrap();
            for t in &f.tensors {
                let want = if t.shape().len() == 1 { "F32" } else { matrices };
                assert_eq!(t.kind.name(), want, "{file}: {} {:?}", t.name, t.shape());
            }
            let back = format!("back-{run}-{dtype}");
            let o = s.ember(&["import", &file, "--out", &back]);
            assert!(o.status.success(), "{}", stderr(&o));
            let ckpt = Checkpoint::open(&s.path().join(&back)).unwrap();
            let model = ckpt.decoder::<Flex>(&Default::default()).unwrap();
            let (their_prompt, their_ids) = llama_cpp(&s.path().join(&file), n, &[prompt]).remove(0);
            let ours = ckpt.tokenizer.encode_prompt(prompt).unwrap();
            assert_eq!(their_prompt, ours, "{file}: llama.cpp tokenizes {prompt:?} otherwise");
            // llama.cpp stops at an end-of-generation token, and does not report it.
            let ends = ckpt.tokenizer.end_ids();
            let want: Vec<u32> = greedy(&model, &ours, n).into_iter().take_while(|id| !ends.contains(id)).collect();
            assert_eq!(their_ids, want, "{file}: llama.cpp continues {prompt:?} otherwise");
            if dtype == "f32" {
                let base = Checkpoint::open(&s.path().join("back-smol-f32")).unwrap();
                let base = base.decoder::<Flex>(&Default::default()).unwrap();
                let base: Vec<u32> = greedy(&base, &ours, n).into_iter().take_while(|id| !ends.contains(id)).collect();
                continuations.insert(run, (base, want));
            }
        }
    }
    let (base, tuned) = &continuations["ft"];
    assert_ne!(base, tuned, "the merged fine-tune continues its prompt as the base model does");
}

/// The tensors of a run's checkpoint, by name.
fn run_tensors(s: &Scratch, run: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
    let dir = Checkpoint::open(&s.path().join(run)).unwrap().dir;
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = ember_model::weights::from_safetensors(&bytes, run).unwrap().0;
    tensors.into_iter().map(|(k, t)| (k, t.as_bytes().to_vec())).collect()
}

/// A fixture's cases (expected.json): the prompt, transformers' logits `[T·V]` and its greedy tokens.
fn cases(expected: &serde_json::Value) -> Vec<(Vec<u32>, Vec<f32>, Vec<u32>)> {
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    };
    match expected.get("cases").and_then(|c| c.as_array()) {
        Some(list) => list.iter().map(|c| (ids(&c["ids"]), floats(&c["logits"]), ids(&c["generated"]))).collect(),
        None => vec![(ids(&expected["ids"]), floats(&expected["logits"]), ids(&expected["generated"]))],
    }
}

fn greedy(model: &ember_model::Decoder<Flex>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut sampler = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap();
    let mut out = Vec::new();
    generate(model, prompt, n, &mut sampler, |id| {
        out.push(id);
        true
    })
    .unwrap();
    out
}

fn hf_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf").join(name)
}

/// Runs `ember args...` in `s`, which must succeed.
fn ember_ok(s: &Scratch, args: &[&str]) -> String {
    let o = s.ember(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

#[test]
fn hf_fixtures_round_trip_through_gguf() {
    // Every family llama.cpp has an architecture for: Qwen2 (q/k/v biases, tied head), Qwen3 (q/k
    // norms), GPT-2 (fused `attn_qkv` and `Conv1D` weights transposed, `position_embd`, LayerNorm
    // biases) and a Gemma 3 of the shape llama.cpp's gemma3 runs (gemma3_gguf: RMSNorm gains stored
    // as `1 + w`, sandwich norms, 5 local : 1 global). The Llama fixture goes through GGUF in the SmolLM2
    // test's way below only to be refused here (its Llama 3 RoPE scaling).
    let text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.";
    let s = Scratch::new();
    let mut exports = Vec::new();
    for (name, arch) in [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gpt2", "gpt2"), ("gemma3_gguf", "gemma3")] {
        let dir = hf_fixture(name);
        let run = |suffix: &str| format!("{name}-{suffix}");
        let gguf_path = |n: &str| s.path().join(format!("{name}-{n}.gguf"));
        ember_ok(&s, &["import", dir.to_str().unwrap(), "--out", &run("hf")]);
        let out = ember_ok(&s, &["export", &run("hf"), "--format", "gguf", "--out", gguf_path("m").to_str().unwrap()]);
        assert!(out.contains(&format!("as GGUF {arch}")), "{out}");
        ember_ok(&s, &["import", gguf_path("m").to_str().unwrap(), "--out", &run("back")]);
        ember_ok(&s, &["export", &run("back"), "--format", "gguf", "--out", gguf_path("m2").to_str().unwrap()]);

        let (first, second) = (GgufFile::open(&gguf_path("m")).unwrap(), GgufFile::open(&gguf_path("m2")).unwrap());
        assert_eq!(first.get("general.architecture").and_then(Value::as_str), Some(arch), "{name}");
        // The export of the import of the export is the same file: metadata and tensor bytes. (But
        // a SentencePiece tokenizer's scores, which export ranks from the merges it has: the
        // import recovers more merges than the fixture's, in the same order, so the ranks differ
        // and encode alike, as the ids below show; and Gemma's chat template, which a gemma3 file
        // without one is given on import.)
        let keys: std::collections::BTreeSet<&String> = first.metadata.keys().chain(second.metadata.keys()).collect();
        let gemma_default = |k: &str| arch == "gemma3" && k == "tokenizer.chat_template" && first.get(k).is_none();
        let changed: Vec<&&String> = keys
            .iter()
            .filter(|k| first.get(k) != second.get(k) && **k != "tokenizer.ggml.scores" && !gemma_default(k))
            .collect();
        assert!(changed.is_empty(), "{name}: metadata {changed:?} changed through GGUF");
        assert_eq!(first.tensors.len(), second.tensors.len(), "{name}");
        for t in &first.tensors {
            let u = second.tensor(&t.name).unwrap_or_else(|| panic!("{name}: second export lacks {}", t.name));
            assert_eq!((u.kind, u.shape()), (t.kind, t.shape()), "{name}: {}", t.name);
            assert!(first.raw(t) == second.raw(u), "{name}: {} differs in the second export", t.name);
        }

        // The re-import computes transformers' logits (expected.json) and greedy tokens.
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        let open = |r: &str| Checkpoint::open(&s.path().join(r)).unwrap();
        let (hf_model, back_model) = (
            open(&run("hf")).decoder::<Flex>(&Default::default()).unwrap(),
            open(&run("back")).decoder::<Flex>(&Default::default()).unwrap(),
        );
        for (i, (prompt, want, generated)) in cases(&expected).into_iter().enumerate() {
            let (a, b) = (logits(&hf_model, &prompt), logits(&back_model, &prompt));
            // Bit for bit: the GGUF holds what the Hugging Face import computes with (Gemma's
            // gains as `1 + w`, the f32 sum its forward pass forms).
            assert!(a == b, "{name} case {i}: the GGUF re-import computes other logits");
            let diff = b.iter().zip(&want).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            eprintln!("{name} case {i}: max |GGUF re-import - transformers| = {diff:.2e}");
            assert!(diff < 1e-4, "{name} case {i}: logits differ from transformers' by {diff}");
            assert_eq!(greedy(&back_model, &prompt, generated.len()), generated, "{name} case {i}: greedy tokens");
        }

        // The weights: bit for bit, but Gemma's gains, kept as the file stores them (`1 + w`).
        let family = ember_hf::families::gemma3::GEMMA3.architecture().family();
        let (before, after) = (run_tensors(&s, &run("hf")), run_tensors(&s, &run("back")));
        assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>(), "{name}");
        for (path, bytes) in &before {
            let is_gain = arch == "gemma3"
                && family.ember_to_hf(path).is_some_and(|t| t.layout == ember_hf::family::Layout::Gain);
            if is_gain {
                let f = |b: &[u8]| b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
                let plus_one: Vec<f32> = f(bytes).iter().map(|w| w + 1.0).collect();
                assert!(f(&after[path]) == plus_one, "{name}: {path} is not 1 + w");
            } else {
                assert!(*bytes == after[path], "{name}: {path} changed through GGUF");
            }
        }
        let back_config = open(&run("back")).model_config.clone();
        let want_norm = if arch == "gemma3" { ember_model::NormKind::RmsNorm } else { hf_model.config().norm };
        assert_eq!(back_config, ember_model::ModelConfig { norm: want_norm, ..hf_model.config().clone() }, "{name}");

        if arch == "gemma3" {
            // A Hugging Face export of the GGUF import writes `g − 1` (exact for gains of 0.5 and
            // up, as these are; not the fixture's `w`, whose last bit `1 + w` may have rounded off):
            // the logits of the Hugging Face fixture again, bit for bit.
            ember_ok(&s, &["export", &run("back"), "--out", &run("hf-again")]);
            ember_ok(&s, &["import", s.path().join(run("hf-again")).to_str().unwrap(), "--out", &run("again")]);
            let again = open(&run("again")).decoder::<Flex>(&Default::default()).unwrap();
            assert_eq!(again.config(), hf_model.config(), "{name}");
            let prompt = cases(&expected)[0].0.clone();
            assert!(
                logits(&again, &prompt) == logits(&hf_model, &prompt),
                "{name}: Hugging Face export of the GGUF import"
            );
        }

        let model_kind = if arch == "gpt2" { "gpt2" } else { "llama" };
        assert_eq!(first.get("tokenizer.ggml.model").and_then(Value::as_str), Some(model_kind), "{name}");
        let tokens = |r: &str| open(r).tokenizer.encode(text).unwrap();
        assert_eq!(
            tokens(&run("back")),
            tokens(&run("hf")),
            "{name}: the tokenizer rebuilt from GGUF encodes differently"
        );
        exports.push((name, arch, gguf_path("m"), first));
    }

    // llama.cpp's own Python reader: the architecture's metadata keys and tensor names, and the
    // values ember wrote (Gemma's gains `1 + w` of the fixture's `w`).
    let py = python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/gguf_readback.py");
    let out = Command::new(&py).arg(&script).args(exports.iter().map(|e| &e.2)).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for (line, (name, arch, _, file)) in text.lines().zip(&exports) {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let meta = &r["metadata"];
        assert_eq!(meta["general.architecture"], *arch);
        let tensors = r["tensors"].as_object().unwrap();
        assert_eq!(tensors.len(), file.tensors.len(), "{name}");
        for t in &file.tensors {
            let v = file.dequantize(t);
            let sum: f64 = v.iter().map(|&x| x as f64).sum();
            let theirs = &tensors[&t.name];
            assert!((sum - theirs["sum"].as_f64().unwrap()).abs() <= 1e-6 * sum.abs().max(1.0), "{name}: {}", t.name);
            let shape: Vec<usize> =
                theirs["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
            assert_eq!(shape, t.shape(), "{name}: {}", t.name);
        }
        let has = |t: &str| tensors.contains_key(t);
        match *arch {
            "gpt2" => {
                assert!(has("position_embd.weight") && has("blk.1.attn_qkv.bias") && has("output_norm.bias"));
                assert_eq!(
                    tensors["blk.0.attn_qkv.weight"]["shape"],
                    serde_json::json!([144, 48]),
                    "[3·D, D], llama.cpp's [out, in]"
                );
                assert_eq!(meta["gpt2.attention.layer_norm_epsilon"].as_f64(), Some(1e-5f32 as f64));
                assert_eq!(
                    (meta["gpt2.context_length"].as_u64(), meta["gpt2.embedding_length"].as_u64()),
                    (Some(64), Some(48))
                );
                assert!(!has("output.weight"), "a tied head has no output.weight");
            }
            "qwen3" => {
                assert!(
                    has("blk.1.attn_q_norm.weight") && has("blk.1.attn_k_norm.weight") && !has("blk.0.attn_q.bias")
                );
                assert_eq!(meta["qwen3.attention.key_length"], 32);
                assert_eq!(meta["qwen3.rope.freq_base"].as_f64(), Some(1e6));
            }
            "qwen2" => assert!(has("blk.0.attn_q.bias") && has("blk.0.attn_v.bias")),
            "gemma3" => {
                for t in [
                    "blk.5.attn_norm.weight",
                    "blk.5.post_attention_norm.weight",
                    "blk.5.ffn_norm.weight",
                    "blk.5.post_ffw_norm.weight",
                    "blk.5.attn_q_norm.weight",
                    "blk.5.attn_k_norm.weight",
                    "output_norm.weight",
                ] {
                    assert!(has(t), "gemma3 lacks {t}");
                }
                assert!(!has("output.weight"), "a tied head has no output.weight");
                assert_eq!(meta["gemma3.attention.sliding_window"], 6);
                assert_eq!(
                    (meta["gemma3.attention.key_length"].as_u64(), meta["gemma3.attention.value_length"].as_u64()),
                    (Some(256), Some(256))
                );
                assert_eq!(meta["gemma3.rope.freq_base"].as_f64(), Some(1e6));
                assert_eq!(meta["gemma3.attention.head_count_kv"], 1);
                // Every RMSNorm gain is `1 + w` of the fixture's `w`.
                let gemma = ember_hf::families::gemma3::GEMMA3.architecture().family();
                let st = std::fs::read(hf_fixture(name).join("model.safetensors")).unwrap();
                let st = safetensors::SafeTensors::deserialize(&st).unwrap();
                let mut gains = 0;
                for (hf_name, view) in st.tensors() {
                    let Some(to) = gemma.hf_to_ember(&hf_name).filter(|t| t.layout == ember_hf::family::Layout::Gain)
                    else {
                        continue;
                    };
                    let (gguf_name, _) = gemma.hf_to_gguf(&hf_name).unwrap();
                    let w = view.data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64);
                    let want: f64 = w.map(|w| 1.0 + w).sum();
                    let got = tensors[&gguf_name]["sum"].as_f64().unwrap();
                    assert!(
                        (got - want).abs() < 1e-5 * want.abs(),
                        "{gguf_name} ({}): sum {got}, 1 + w sums to {want}",
                        to.paths[0]
                    );
                    gains += 1;
                }
                assert_eq!(gains, 6 * 6 + 1, "six norms a layer and the final one");
            }
            other => unreachable!("{other}"),
        }
    }
}

#[test]
fn fixtures_llama_cpp_would_run_differently_are_refused() {
    // llama.cpp's `llama` has no sliding window, and keeps Llama 3's RoPE scaling in a
    // `rope_freqs` tensor ember does not write; its gemma3 fixes the layer pattern (5 local : 1
    // global: all four layers of this fixture local, so no pattern) and scales scores by
    // 1/sqrt(head_dim).
    let s = Scratch::new();
    for (name, arch, fields) in [
        ("llama", "GGUF llama", &["model.rope_scaling is {"][..]),
        ("mistral", "GGUF llama", &["model.sliding_window is 8, GGUF llama has null"][..]),
        (
            "gemma3_text",
            "GGUF gemma3",
            &[
                "model.sliding_window_pattern is 3, GGUF gemma3 has null",
                "model.query_pre_attn_scalar is 24.0, GGUF gemma3 has null",
            ][..],
        ),
        // llama.cpp's deepseek2 takes YaRN's mscale equal to mscale_all_dim, and scores a softmax
        // router's groups by their best two experts (DeepSeek-V2 by its best one).
        ("deepseek_v3", "GGUF deepseek2", &["\"mscale\":1.0,\"mscale_all_dim\":0.8", "has {"][..]),
        ("deepseek_v2", "GGUF deepseek2", &["groups of a softmax router"][..]),
    ] {
        ember_ok(&s, &["import", hf_fixture(name).to_str().unwrap(), "--out", name]);
        let out = format!("{name}.gguf");
        let o = s.ember(&["export", name, "--format", "gguf", "--out", &out]);
        assert_clean_error(&o, &format!("this model cannot be written as {arch}: "));
        for f in fields {
            assert!(stderr(&o).contains(f), "{name}: stderr lacks `{f}`:\n{}", stderr(&o));
        }
        assert!(!s.path().join(&out).exists(), "{name}: a refused export left a file");
    }
}

/// The Gemma 3 fixture of transformers reading the real file (make_gguf_fixtures.py `gemma3`).
fn gemma3_fixture() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/gemma3.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn gemma3_270m_imports_as_transformers_reads_it() {
    // One test, so that the 270M model (1 GB in f32) is imported and loaded once.
    let fx = gemma3_fixture();
    let s = Scratch::new();
    let gguf = assets::gemma3_gguf();
    let out = ember_ok(&s, &["import", gguf.to_str().unwrap(), "--out", "g"]);
    for kinds in ["\"F32\": 109", "\"Q4_K\": 27", "\"Q5_0\": 81", "\"Q6_K\": 9", "\"Q8_0\": 10"] {
        assert!(out.contains(kinds), "{out}");
    }
    assert!(out.contains("imported GGUF gemma3 (18 layers, d_model 640, vocab 262144, 268098176 parameters"), "{out}");
    let ckpt = Checkpoint::open(&s.path().join("g")).unwrap();
    let c = ckpt.model_config.clone();
    assert_eq!(
        (c.sliding_window, c.sliding_window_pattern, c.head_dim(), c.n_kv_heads()),
        (Some(512), Some(6), 256, 1)
    );
    assert_eq!((c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar), (1e6, Some(1e4), None));
    assert_eq!(c.norm, ember_model::NormKind::RmsNorm, "gains kept as the file stores them, 1 + w");
    assert!(c.tie_embeddings && c.embed_scale && c.sandwich_norms && c.qk_norm && c.final_logit_softcap.is_none());
    let model = ckpt.decoder::<Flex>(&Default::default()).unwrap();
    let vocab = c.vocab_size;

    // Logits at every position (a sample of 266 columns) of the three prompts, and 32 greedy tokens.
    let n_new = fx["max_new_tokens"].as_u64().unwrap() as usize;
    let (mut worst, mut largest) = (0f32, 0f32);
    for p in fx["prompts"].as_array().unwrap() {
        let prompt = ids(&p["ids"]);
        assert_eq!(ckpt.tokenizer.encode_prompt(p["prompt"].as_str().unwrap()).unwrap(), prompt, "<bos> once, first");
        let (w, l) = column_errors(&logits(&model, &prompt), vocab, p);
        (worst, largest) = (worst.max(w), largest.max(l));
        assert_eq!(greedy(&model, &prompt, n_new), ids(&p["greedy"]), "greedy continuation of {:?}", p["prompt"]);
    }
    eprintln!("Gemma 3 270M: largest logit difference from transformers {worst:e} (logits up to {largest})");
    // Both dequantize to the same f32 weights and compute in f32 (18 layers, summation orders
    // differ): within 1e-5 of the logits' scale, about 3e-4 absolute on logits up to ~30.
    assert!(worst < 1e-5 * largest.max(1.0), "logits differ from transformers' by {worst} (scale {largest})");

    // `ember sample` puts the tokenizer's <bos> first: the fixture's greedy text follows.
    let prompt = fx["prompts"][0]["prompt"].as_str().unwrap();
    let eight = ckpt.tokenizer.decode(&ids(&fx["prompts"][0]["greedy"])[..8]).unwrap();
    let out = ember_ok(
        &s,
        &["sample", "--checkpoint", "g", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"],
    );
    assert!(out.contains(&format!("{prompt}{eight}")), "sample gave {out:?}, transformers {prompt}{eight}");

    // Perplexity of WikiText-2's start: `ember eval` (the text file, <bos> first) for the first of the
    // fixture's runs, the library function it calls for the second; every target scored once.
    let w = &fx["wikitext2"];
    let raw = std::fs::read(wikitext2_test()).unwrap();
    let text = std::str::from_utf8(&raw[..w["bytes"][1].as_u64().unwrap() as usize]).unwrap();
    s.write("wiki.txt", text);
    let tokens = ckpt.tokenizer.encode_prompt(text).unwrap();
    assert_eq!(tokens.len() as u64, w["n_tokens"].as_u64().unwrap());
    let runs = w["runs"].as_array().unwrap();
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    let (first, second) = (&runs[0], &runs[1]);
    let (context, stride) =
        (first["context"].as_u64().unwrap().to_string(), first["stride"].as_u64().unwrap().to_string());
    let out = ember_ok(
        &s,
        &[
            "eval",
            "--checkpoint",
            "g",
            "--data",
            "wiki.txt",
            "--context",
            &context,
            "--stride",
            &stride,
            "--batch",
            "1",
            "--json",
        ],
    );
    let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(r["tokens"], first["count"]);
    let (nll, ppl) = (r["nll"].as_f64().unwrap(), r["perplexity"].as_f64().unwrap());
    let (want_nll, want_ppl) = (first["mean_nll"].as_f64().unwrap(), first["perplexity"].as_f64().unwrap());
    eprintln!("WikiText-2, context {context} stride {stride}: ember nll {nll:.6} ppl {ppl:.4}; transformers nll {want_nll:.6} ppl {want_ppl:.4}");
    assert!(rel(ppl, want_ppl) < 1e-3 && rel(nll, want_nll) < 1e-3, "perplexity {ppl} vs {want_ppl}");
    let (context, stride) = (second["context"].as_u64().unwrap() as usize, second["stride"].as_u64().unwrap() as usize);
    let r = ember_train::perplexity::perplexity(&model, &tokens, context, stride, 1, text.len());
    let want_ppl = second["perplexity"].as_f64().unwrap();
    eprintln!(
        "WikiText-2, context {context} stride {stride}: ember nll {:.6} ppl {:.4}; transformers ppl {want_ppl:.4}",
        r.nll, r.perplexity
    );
    assert!(rel(r.perplexity, want_ppl) < 1e-3, "perplexity {} vs {want_ppl}", r.perplexity);

    // Export f32 and read back: every tensor the file's own dequantized values, its gains as
    // stored (`1 + w`), the same metadata llama.cpp reads; and the re-import the same model.
    let tokenizer_json = std::fs::read_to_string(ckpt.dir.join("tokenizer.json")).unwrap();
    let tokenizer_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let encoded = ember_hf::gguf::model::encode_model(
        &model,
        ckpt.hf_config().as_ref(),
        &tokenizer_json,
        Some(&tokenizer_config),
        ember_hf::gguf::model::ExportType::F32,
    )
    .unwrap();
    drop(model);
    // llama.cpp's Python reader opens it (it refuses a key written twice).
    let path = s.path().join("export.gguf");
    std::fs::write(&path, &encoded.bytes).unwrap();
    let read = "import sys; from gguf import GGUFReader; r = GGUFReader(sys.argv[1]); \
                print(r.fields['general.architecture'].contents(), len(r.tensors))";
    let o = Command::new(python()).args(["-c", read]).arg(&path).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "gemma3 236");
    // llama.cpp itself runs it: the fixture's three prompts (the chat one through the rendered
    // template) continue as transformers and ember continue them.
    let prompts: Vec<&str> = fx["prompts"].as_array().unwrap().iter().map(|p| p["prompt"].as_str().unwrap()).collect();
    for (p, (their_prompt, their_ids)) in fx["prompts"].as_array().unwrap().iter().zip(llama_cpp(&path, 12, &prompts)) {
        assert_eq!(their_prompt, ids(&p["ids"]), "llama.cpp tokenizes {:?} otherwise", p["prompt"]);
        assert_eq!(their_ids, ids(&p["greedy"])[..12], "llama.cpp continues {:?} otherwise", p["prompt"]);
    }
    let exported = GgufFile::parse(encoded.bytes, &path).unwrap();
    let orig = GgufFile::open(&gguf).unwrap();
    assert_eq!(exported.tensors.len(), orig.tensors.len());
    for t in &orig.tensors {
        let e = exported.tensor(&t.name).unwrap_or_else(|| panic!("export lacks {}", t.name));
        assert_eq!(e.shape(), t.shape(), "{}", t.name);
        assert!(orig.dequantize(t) == exported.dequantize(e), "{}: values differ", t.name);
    }
    // llama.cpp's gemma3 keys as the file has them, and the tokenizer's special ids. (Its scores are
    // ember's, ranking the merges the import recovered; its pieces are the import's, which spells
    // the file's 30 user-defined runs of spaces with `▁` as transformers does: the rebuilt
    // tokenizer encodes alike, below.)
    let mut keys: Vec<&String> = orig.metadata.keys().filter(|k| k.starts_with("gemma3.")).collect();
    assert_eq!(keys.len(), 11);
    let specials = ["model", "bos_token_id", "eos_token_id", "unknown_token_id", "add_bos_token", "add_space_prefix"];
    let specials: Vec<String> = specials.iter().map(|k| format!("tokenizer.ggml.{k}")).collect();
    keys.extend(&specials);
    for key in keys {
        let (value, got) = (orig.get(key).unwrap(), exported.get(key));
        let same = got.is_some_and(|b| {
            value.as_f64() == b.as_f64() && value.as_str() == b.as_str() && (value == b || b.as_f64().is_some())
        });
        assert!(same, "metadata {key} differs after export: {value:?} vs {got:?}");
    }
    let pieces = |f: &GgufFile| -> Vec<String> {
        let list = f.get("tokenizer.ggml.tokens").and_then(Value::as_array).unwrap();
        list.iter().map(|t| t.as_str().unwrap().replace(' ', "\u{2581}")).collect()
    };
    assert!(pieces(&orig) == pieces(&exported), "the exported pieces are not the file's");
    let (json, _) = ember_hf::gguf::tokenizer::from_gguf(&exported).unwrap();
    let rebuilt = ember_data::tokenizer::Tokenizer::from_json(&json).unwrap();
    assert_eq!(rebuilt.encode_prompt(text).unwrap(), tokens, "the exported tokenizer encodes WikiText-2 differently");
    let back = ember_hf::gguf::model::read_file(exported).unwrap();
    assert_eq!(back.config, c, "the re-import of the export is another model");
}

/// WikiText-2's raw test split: `$EMBER_DATA_DIR/wikitext2/test.txt`, else under
/// `$EMBER_TEST_ASSETS/datasets`.
fn wikitext2_test() -> PathBuf {
    let data = std::env::var_os("EMBER_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| assets().join("datasets"));
    let path = if data.is_relative() { assets::root().join(data) } else { data }.join("wikitext2/test.txt");
    assert!(path.is_file(), "{} not found: set EMBER_DATA_DIR to shared/datasets", path.display());
    path
}

#[test]
fn llama_cpp_runs_exported_mixtures_of_experts_as_ember_does() {
    // A small model of each mixture-of-experts architecture llama.cpp has, trained two steps from a
    // random init (weights large enough that greedy picks are clear) with the Llama 2 tokenizer
    // (32k, which llama.cpp reads as SentencePiece), exported to GGUF in f32 and q8_0: llama.cpp
    // continues a prompt greedily as ember does on the import of the f32 file, which imports to
    // the run's logits bit for bit; the q8_0 file to them within its rounding.
    let s = Scratch::new();
    s.write("corpus.txt", &corpus());
    let tokenizer = assets().join("tokenizers/llama2_tokenizer.json");
    let renormalised = "norm_topk = true\n";
    let cases = [
        ("mixtral", "llama", 2, "", renormalised),
        ("qwen2moe", "qwen2moe", 2, "qkv_bias = true\n", "shared_expert = 48\nshared_expert_gate = true\n"),
        ("qwen3moe", "qwen3moe", 2, "qk_norm = true\nhead_dim = 32\n", renormalised),
        ("olmoe", "olmoe", 4, "qk_norm = true\nqk_norm_whole = true\n", ""),
        // DeepSeek-V3's parts: latent attention with a low-rank query, YaRN, a dense first layer,
        // sigmoid-scored grouped experts with the selection bias (moved by training), a shared expert.
        (
            "deepseek2",
            "deepseek2",
            4,
            "norm_eps = 1e-6\nrope_layout = \"interleaved\"\n\
             [model.rope_scaling]\ntype = \"yarn\"\nfactor = 4.0\noriginal_max_position_embeddings = 16\n\
             mscale = 0.8\nmscale_all_dim = 0.8\n\
             [model.mla]\nq_rank = 24\nkv_rank = 32\nnope_dim = 8\nrope_dim = 8\nv_dim = 16\n",
            "norm_topk = true\nshared_expert = 32\nscoring = \"sigmoid\"\nselection_bias = true\ngroups = 2\n\
             top_groups = 1\nrouted_scale = 2.5\ndense_layers = 1\nbias_update_rate = 0.01\n",
        ),
    ];
    for (name, arch, kv_heads, parts, moe) in cases {
        // Latent attention has no key-value heads of its own to set.
        let kv_heads = if name == "deepseek2" { String::new() } else { format!("n_kv_heads = {kv_heads}\n") };
        let config = format!(
            "[model]\nd_model = 64\nn_layers = 2\nn_heads = 4\n{kv_heads}d_ff = 64\nmax_seq_len = 64\n\
             init_std = 0.3\n{parts}\n[model.moe]\nn_experts = 4\ntop_k = 2\nd_expert = 32\n{moe}\n\
             [data]\npath = \"corpus.txt\"\ntokenizer = {tokenizer:?}\n\n\
             [train]\nbatch_size = 2\nseq_len = 32\nmax_steps = 2\neval_interval = 2\neval_iters = 1\n\
             checkpoint_interval = 2\nseed = 7\n"
        );
        // DeepSeek's selection bias moves only after a step whose loads are uneven: a few more steps.
        let config = if name == "deepseek2" { config.replace("max_steps = 2", "max_steps = 4") } else { config };
        s.write(&format!("{name}.toml"), &config);
        ember_ok(&s, &["train", "--config", &format!("{name}.toml"), "--run-dir", name]);
        let run = Checkpoint::open(&s.path().join(name)).unwrap();
        let model = run.decoder::<Flex>(&Default::default()).unwrap();
        for dtype in ["f32", "q8_0"] {
            let file = format!("{name}-{dtype}.gguf");
            let out = ember_ok(&s, &["export", name, "--format", "gguf", "--dtype", dtype, "--out", &file]);
            assert!(out.contains(&format!("as GGUF {arch}")), "{out}");
            let f = GgufFile::open(&s.path().join(&file)).unwrap();
            let exps = f.tensor("blk.1.ffn_down_exps.weight").expect("the experts' stacked down projections");
            assert_eq!(exps.shape(), [4, 64, 32], "{file}: [experts, out, in]");
            assert_eq!(f.get(&format!("{arch}.expert_count")).and_then(Value::as_u64), Some(4), "{file}");
            let back = format!("{name}-{dtype}-back");
            ember_ok(&s, &["import", &file, "--out", &back]);
            let imported = Checkpoint::open(&s.path().join(&back)).unwrap();
            let imported = imported.decoder::<Flex>(&Default::default()).unwrap();
            let prompt = [1u32, 4205, 16334, 20084, 28747, 3934, 528];
            if dtype == "q8_0" {
                // Quantized: the experts' stacks are Q8_0 and import to the run's within the
                // rounding (half a step of 1/127 of a block's largest value, its scale in f16).
                // llama.cpp also rounds the activations, and a rounding can flip a random model's
                // close expert choice, so its continuations are compared in f32 only.
                assert_eq!(exps.kind.name(), "Q8_0", "{file}");
                let stack = |m: &ember_model::Decoder<Flex>| m.layers[1].moe().unwrap().down.val().into_data();
                let (a, b) = (stack(&imported).to_vec::<f32>().unwrap(), stack(&model).to_vec::<f32>().unwrap());
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(diff <= scale / 200.0, "{file}: the experts' weights {diff} off (up to {scale})");
                continue;
            }
            assert!(logits(&imported, &prompt) == logits(&model, &prompt), "{file}: other logits after GGUF");
            let moe = |m: &ember_model::Decoder<Flex>| {
                m.config().moe.clone().map(|c| (c.n_experts, c.top_k, c.d_expert, c.norm_topk, c.shared_expert))
            };
            assert_eq!(moe(&imported), moe(&model), "{file}");
            if let Some(mla) = &model.config().mla {
                // The split per-head up-projections join back to the run's; the trained selection bias
                // (moved off zero by the balancing) is the file's.
                assert_eq!(imported.config().mla.as_ref(), Some(mla), "{file}");
                assert!(f.tensor("blk.0.attn_k_b.weight").is_some() && f.tensor("blk.0.attn_kv_b.weight").is_none());
                let bias = model.layers[1].moe().unwrap().selection_bias.as_ref().unwrap().val();
                assert!(bias.abs().max().into_scalar() > 0.0, "the balancing moved the selection bias");
            }
            let n = 8;
            let (their_prompt, their_ids) = llama_cpp(&s.path().join(&file), n, &["First Citizen: hear me"]).remove(0);
            let ends = run.tokenizer.end_ids();
            let ours: Vec<u32> =
                greedy(&imported, &their_prompt, n).into_iter().take_while(|id| !ends.contains(id)).collect();
            assert_eq!(their_ids, ours, "{file}: llama.cpp continues otherwise");
            eprintln!("{file}: llama.cpp and ember continue {their_prompt:?} with {ours:?}");
        }
    }
}

/// A GGUF file run on its stored blocks (`--checkpoint gguf:FILE`: integer products with 8-bit
/// activations, as llama.cpp computes) continues prompts as llama.cpp does on the same file. Each
/// prompt's 32 greedy tokens through the KV cache are compared with llama.cpp's (both read
/// llama.cpp's prompt ids, llama.cpp stopping at an end token), and the file's f32 dequantization
/// scores llama.cpp's continuation:
/// - the first difference comes only at a step where the f32 model ranks its top two within `tie`
///   of each other: there llama.cpp (8-bit activations, an f16 KV cache, its own summation order,
///   which differ by CPU) and ember may each pick either;
/// - where the f32 model's top two differ by more than `tie` at every step (at least `want_sure`
///   prompts of that kind), ember's tokens are llama.cpp's, every one.
///
/// Both with ember's default f32 KV cache and with an f16 one (`--kv-cache f16`).
fn continues_as_llama_cpp(file: &Path, prompts: &[&str], tie: f32, want_sure: usize) {
    use ember_generate::sample::{generate_batch, GenerateOptions};
    let dev = Default::default();
    let kept = ember_hf::gguf::model::import_for_inference::<Flex>(file, &dev).unwrap();
    let dense = ember_hf::gguf::model::import::<Flex>(file, burn::tensor::DType::F32, &dev).unwrap().imported.model;
    let model = kept.imported.model;
    assert!(matches!(model.embed_tokens, ember_model::Weight::Stored(_)) && model.quantized_projections().0 > 0);
    let n = 32;
    let runs = llama_cpp(file, n, prompts);
    let name = file.display();
    let mut sure_prompts = 0;
    for ((prompt_ids, theirs), text) in runs.iter().zip(prompts) {
        let options = GenerateOptions { max_new_tokens: n, stop_tokens: Vec::new(), block_size: 16 };
        let greedy = |model: &ember_model::Decoder<Flex>| {
            let mut sampler = [Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() }, 0).unwrap()];
            generate_batch(model, &[prompt_ids.clone()], &options, &mut sampler, |_, _| true).unwrap().remove(0)
        };
        // The f32 model's margin between its top two at each step of llama.cpp's continuation.
        let seq: Vec<u32> = prompt_ids.iter().chain(theirs).copied().collect();
        let v = dense.config().vocab_size;
        let all = logits(&dense, &seq);
        let margins: Vec<f32> = (0..theirs.len())
            .map(|i| {
                let row = &all[(prompt_ids.len() - 1 + i) * v..(prompt_ids.len() + i) * v];
                let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &x in row {
                    if x > first {
                        (first, second) = (x, first);
                    } else if x > second {
                        second = x;
                    }
                }
                first - second
            })
            .collect();
        let least = margins.iter().copied().fold(f32::INFINITY, f32::min);
        // The f32 KV cache (the default) and the f16 one (`--kv-cache f16`, llama.cpp's own).
        let half = model.clone().with_compute(model.compute().with_kv_cache(burn::tensor::DType::F16));
        for (cache, ours) in [("f32", greedy(&model)), ("f16", greedy(&half))] {
            let agreed = theirs.iter().zip(&ours).take_while(|(a, b)| a == b).count();
            eprintln!(
                "{name}: {text:?}, {cache} cache: {agreed} of {} tokens as llama.cpp's; least f32 margin {least:.4}",
                theirs.len()
            );
            if let Some(i) = (agreed < theirs.len()).then_some(agreed) {
                assert!(
                    margins[i] < tie,
                    "{name}: {text:?}, {cache} cache, step {i}: llama.cpp {}, ember {}, f32 margin {}",
                    theirs[i],
                    ours[i],
                    margins[i]
                );
            } else if least > tie && cache == "f32" {
                sure_prompts += 1;
            }
        }
    }
    assert!(sure_prompts >= want_sure, "{name}: {sure_prompts} prompts where the f32 model is sure at every step");
}

#[test]
fn quantized_weights_continue_as_llama_cpp_does() {
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "import numpy as np\nimport matplotlib.pyplot as plt\n",
        "1, 2, 3, 4, 5, 6, 7, 8,",
        "Monday, Tuesday, Wednesday,",
        "<html>\n<head>\n<title>",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "A B C D E F G H I J K",
        "for (int i = 0; i < n; i++) {",
        "Twinkle, twinkle, little star,",
    ];
    continues_as_llama_cpp(&model_file(), &prompts, 0.5, 1);
    continues_as_llama_cpp(&assets::gemma3_gguf(), &prompts, 0.5, 1);
}

/// An f32 model is never held twice while it loads: a run's checkpoint, a Hugging Face folder and
/// an F32 GGUF file of SmolLM2 (538 MB of f32 weights each) load with the process's peak resident
/// memory under 1.8 times the weights (before: 2.1-2.3 times alone, the file or its bytes beside
/// the copy and the model's zeros beside the loaded values; now 1.18-1.24 alone, up to 1.66 for the
/// folder with the machine busy with other tests). `bench decode`'s peak RSS is the process's.
#[test]
fn an_f32_model_loads_without_holding_its_weights_twice() {
    let s = Scratch::new();
    ember_ok(&s, &["import", model_file().to_str().unwrap(), "--out", "smol"]);
    ember_ok(&s, &["export", "smol", "--format", "hf", "--out", "smol-hf"]);
    ember_ok(&s, &["export", "smol", "--dtype", "f32", "--out", "smol-f32.gguf"]);
    let weights = std::fs::metadata(s.path().join("smol-hf/model.safetensors")).unwrap().len() as f64;
    assert!(weights > 5e8, "{weights} bytes of f32 weights");
    for checkpoint in ["smol", "hf:smol-hf", "gguf:smol-f32.gguf"] {
        let out = ember_ok(
            &s,
            &["bench", "decode", "--checkpoint", checkpoint, "--contexts", "4", "--new-tokens", "2", "--json"],
        );
        let d: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        let peak = d["peak_rss_bytes"].as_u64().unwrap() as f64;
        assert!(peak < 1.8 * weights, "{checkpoint}: peak RSS {peak} bytes for {weights} bytes of weights");
    }
}
