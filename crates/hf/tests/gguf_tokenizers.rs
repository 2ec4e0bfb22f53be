//! The tokenizers of GGUF metadata, rebuilt by ember, against their originals:
//! - SentencePiece (`tokenizer.ggml.model = "llama"`): Llama 2's real tokenizer.json
//!   (../shared/tokenizers, through $EMBER_TEST_ASSETS) written the way llama.cpp stores it —
//!   pieces, scores, token types, no merges — gives the same ids and text as the original.
//! - GPT-2's byte-level BPE (`gpt2`, pre-tokenizer `gpt2`) from GPT-2's real tokenizer.json.
//! - Gemma 3 (262,144 SentencePiece pieces, byte fallback, control and user-defined tokens, no chat
//!   template in the file): the real Gemma 3 270M GGUF against transformers' ids of it
//!   (tests/fixtures/gguf/gemma3.json), chat template included.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use ember_data::finetune::{ChatTemplate, Message};
use ember_hf::families::gemma3::GEMMA3_CHAT_TEMPLATE;
use ember_hf::gguf::tokenizer::from_gguf;
use ember_hf::gguf::{encode, GgufFile, Value};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

#[path = "../../../tests/assets.rs"]
mod assets;
use assets::{assets, gemma3_gguf, root};

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

#[test]
fn gpt2_byte_level_bpe_rebuilt_from_gguf_metadata_gives_the_same_ids() {
    let path = assets().join("tokenizers/gpt2_tokenizer.json");
    let json: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    vocab.iter().for_each(|(k, i)| tokens[i.as_u64().unwrap() as usize] = k.clone());
    let merges: Vec<Value> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Value::String(format!("{} {}", m[0].as_str().unwrap(), m[1].as_str().unwrap())))
        .collect();
    // As llama.cpp's converter writes GPT-2: `<|endoftext|>` is a control token, BOS and EOS.
    let types = tokens.iter().map(|t| Value::I32(if t == "<|endoftext|>" { 3 } else { 1 })).collect();
    let s = |v: &str| Value::String(v.into());
    let meta = vec![
        ("general.architecture".to_string(), s("gpt2")),
        ("tokenizer.ggml.model".to_string(), s("gpt2")),
        ("tokenizer.ggml.pre".to_string(), s("gpt2")),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens.iter().map(|t| s(t)).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(50256)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(50256)),
    ];
    let file = GgufFile::parse(encode(&meta, &[]), Path::new("gpt2-tokenizer.gguf")).unwrap();
    let (rebuilt, config) = from_gguf(&file).unwrap();
    assert_eq!(config["eos_token"], "<|endoftext|>");
    assert!(config.get("chat_template").is_none(), "GPT-2 has no chat template");
    let rebuilt: tokenizers::Tokenizer = rebuilt.parse().unwrap();
    let original = tokenizers::Tokenizer::from_file(&path).unwrap();
    // GPT-2's split: contractions, letters, digits and punctuation each with one leading space,
    // runs of spaces kept off the next word; `<|endoftext|>` whole.
    let text = format!("{TEXT}I'm sure they'll say it's 2024's   best<|endoftext|>Next document:\n\n\n  x").repeat(12);
    let want = original.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    let got = rebuilt.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    assert!(want.len() > 1000 && want.contains(&50256));
    assert_eq!(got, want, "ids differ from GPT-2's tokenizer");
    assert_eq!(rebuilt.decode(&got, false).unwrap(), text);
}

/// WikiText-2's raw test split: `$EMBER_DATA_DIR/wikitext2/test.txt`, else under
/// `$EMBER_TEST_ASSETS/datasets`.
fn wikitext2_test() -> Vec<u8> {
    let data = std::env::var_os("EMBER_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| assets().join("datasets"));
    let data = if data.is_relative() { root().join(data) } else { data };
    let path = data.join("wikitext2/test.txt");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (set EMBER_DATA_DIR to shared/datasets)", path.display()))
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn gemma3_tokenizer_from_the_real_gguf_gives_transformers_ids() {
    let fx: Json = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/gguf/gemma3.json")).expect("gemma3.json"),
    )
    .unwrap();
    let path = gemma3_gguf();
    let file = GgufFile::open(&path).unwrap();
    let start = Instant::now();
    let (json, config) = from_gguf(&file).unwrap();
    let tok = ember_data::tokenizer::Tokenizer::from_json(&json).unwrap();
    // 262,144 pieces and the ~515k merges recovered from them: ~1 s in a release build.
    eprintln!("Gemma 3 tokenizer from GGUF metadata: {:.2} s", start.elapsed().as_secs_f64());
    assert_eq!(tok.vocab_size(), 262_144);
    for (name, id) in fx["special_ids"].as_object().unwrap() {
        assert_eq!(tok.token_to_id(name), Some(id.as_u64().unwrap() as u32), "{name}");
    }

    // Mixed text (code, accents, CJK, emoji, runs of spaces and newlines, byte fallback, special
    // tokens written in the text): transformers' ids with no special tokens added, and back.
    for t in fx["texts"].as_array().unwrap() {
        let text = t["text"].as_str().unwrap();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids(&t["ids"]), "ids of {text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text);
    }

    // The prompts: `<bos>` first, from the tokenizer's template (`add_bos_token`) or, for the chat,
    // written by the chat template.
    for p in fx["prompts"].as_array().unwrap() {
        let prompt = p["prompt"].as_str().unwrap();
        let got = match prompt.starts_with("<bos>") {
            true => tok.encode(prompt).unwrap(),
            false => tok.encode_with_special(prompt).unwrap(),
        };
        assert_eq!(got, ids(&p["ids"]), "ids of {prompt:?}");
    }

    // The GGUF has no chat template: Gemma 3's is used, the fixture's (transformers applied it),
    // and renders to the same text and ids with minijinja.
    assert!(file.get("tokenizer.chat_template").is_none());
    assert_eq!(config["chat_template"], GEMMA3_CHAT_TEMPLATE);
    assert_eq!(GEMMA3_CHAT_TEMPLATE.replace("\\n", "\n"), fx["chat_template"].as_str().unwrap());
    assert_eq!((config["bos_token"].as_str(), config["eos_token"].as_str()), (Some("<bos>"), Some("<eos>")));
    let template = ChatTemplate::new(
        config["chat_template"].as_str().unwrap().into(),
        config["bos_token"].as_str().unwrap().into(),
        config["eos_token"].as_str().unwrap().into(),
    )
    .unwrap();
    let messages: Vec<Message> = serde_json::from_value(fx["chat"]["messages"].clone()).unwrap();
    let chat = template.render(&messages, fx["chat"]["add_generation_prompt"].as_bool().unwrap()).unwrap();
    assert_eq!(chat, fx["chat"]["text"].as_str().unwrap());
    assert_eq!(tok.encode(&chat).unwrap(), ids(&fx["chat"]["ids"]));
    // Generation stops at the end of the model's turn.
    assert!(tok.end_ids().contains(&106), "<end_of_turn> ends generation: {:?}", tok.end_ids());

    // WikiText-2's test split, its start: `<bos>` + ids, hashed as u32 little-endian; the text's
    // literal `<unk>`s are Gemma's special <unk> (id 3).
    let w = &fx["wikitext2"];
    let raw = wikitext2_test();
    assert_eq!(sha256_hex(&raw), w["file_sha256"].as_str().unwrap(), "not the WikiText-2 test split the fixture used");
    let text = std::str::from_utf8(&raw[..w["bytes"][1].as_u64().unwrap() as usize]).unwrap();
    assert_eq!(sha256_hex(text.as_bytes()), w["text_sha256"].as_str().unwrap());
    let got = tok.encode_with_special(text).unwrap();
    assert_eq!(got.len() as u64, w["n_tokens"].as_u64().unwrap());
    assert_eq!(got[..16], ids(&w["ids_head"]));
    assert_eq!(got[got.len() - 16..], ids(&w["ids_tail"]));
    assert_eq!(got.iter().filter(|&&i| i == 3).count() as u64, w["unk_count"].as_u64().unwrap());
    let bytes: Vec<u8> = got.iter().flat_map(|i| i.to_le_bytes()).collect();
    assert_eq!(sha256_hex(&bytes), w["ids_u32le_sha256"].as_str().unwrap());
}
