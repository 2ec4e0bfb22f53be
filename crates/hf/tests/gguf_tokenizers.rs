//! The SentencePiece (`tokenizer.ggml.model = "llama"`) path of the GGUF tokenizer: Llama 2's real
//! tokenizer.json (../shared/tokenizers, through $EMBER_TEST_ASSETS) written the way llama.cpp stores
//! it — pieces, scores, token types, no merges — then rebuilt by ember from that metadata alone,
//! gives the same ids and text as the original on mixed text.

use std::collections::HashMap;
use std::path::PathBuf;

use ember_hf::gguf::tokenizer::from_gguf;
use ember_hf::gguf::{encode, GgufFile, Value};

fn assets() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("EMBER_TEST_ASSETS")
        .map(PathBuf::from)
        .map(|dir| if dir.is_relative() { root.join(dir) } else { dir })
        .unwrap_or_else(|| root.join("../shared"));
    assert!(dir.join("tokenizers").is_dir(), "set EMBER_TEST_ASSETS to the folder holding tokenizers/ (../shared)");
    dir
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog. 12345 + 67890 = 80235!\n\
    def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\n\
    Ça va? Größe, naïve café — “quotes”; 東京は日本の首都です。Привет, мир! 🙂🚀  spaces\tand tabs\r\n";

#[test]
fn llama2_sentencepiece_rebuilt_from_gguf_metadata_gives_the_same_ids() {
    let path = assets().join("tokenizers/llama2_tokenizer.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab: HashMap<String, usize> = json["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap() as usize))
        .collect();
    let n = vocab.len();
    let mut tokens = vec![String::new(); n];
    vocab.iter().for_each(|(k, &i)| tokens[i] = k.clone());
    // SentencePiece BPE scores: a merged piece scores minus the rank of the merge that makes it
    // (earlier merges score higher); llama.cpp stores these, not the merges.
    let mut scores = vec![0f32; n];
    for (rank, m) in json["model"]["merges"].as_array().unwrap().iter().enumerate() {
        let m = m.as_str().unwrap();
        let piece: String = m.split(' ').collect();
        if let Some(&id) = vocab.get(&piece) {
            if scores[id] == 0.0 {
                scores[id] = -(rank as f32) - 1.0;
            }
        }
    }
    let types: Vec<Value> = tokens
        .iter()
        .map(|t| {
            Value::I32(match t.as_str() {
                "<unk>" => 2,
                "<s>" | "</s>" => 3,
                t if t.starts_with("<0x") && t.len() == 6 => 6,
                _ => 1,
            })
        })
        .collect();
    let s = |v: &str| Value::String(v.into());
    let meta = vec![
        ("general.architecture".to_string(), s("llama")),
        ("tokenizer.ggml.model".to_string(), s("llama")),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens.iter().map(|t| s(t)).collect())),
        ("tokenizer.ggml.scores".to_string(), Value::Array(scores.iter().map(|&x| Value::F32(x)).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(0)),
    ];
    let file = GgufFile::parse(encode(&meta, &[]), std::path::Path::new("llama2-tokenizer.gguf")).unwrap();
    let (rebuilt, config) = from_gguf(&file).unwrap();
    assert_eq!(config["bos_token"], "<s>");
    assert_eq!(config["eos_token"], "</s>");
    let rebuilt: tokenizers::Tokenizer = rebuilt.parse().unwrap();
    let original = tokenizers::Tokenizer::from_file(&path).unwrap();
    let text = TEXT.repeat(12);
    let want = original.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    let got = rebuilt.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    assert!(want.len() > 1000);
    assert_eq!(got, want, "ids differ from Llama 2's tokenizer");
    assert_eq!(rebuilt.decode(&got, true).unwrap(), original.decode(&want, true).unwrap());
}
