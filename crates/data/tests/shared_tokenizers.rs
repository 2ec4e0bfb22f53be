//! The real tokenizer.json files of GPT-2, Llama 2/3 and Qwen (../shared/tokenizers, found through
//! $EMBER_TEST_ASSETS; `.ci/run` sets it) load offline through the `tokenizers` crate, round-trip
//! text exactly, and Qwen's chat template renders.

use std::path::PathBuf;

use ember_data::finetune::{ChatTemplate, Message};
use ember_data::Tokenizer;

#[path = "../../../tests/assets.rs"]
mod assets;

/// The reference tokenizers of the shared assets.
fn assets() -> PathBuf {
    assets::assets().join("tokenizers")
}

const TEXT: &str = "First Citizen:\nBefore we proceed any further, hear me speak. 1234 £€ 🦀 naïve\tend";

#[test]
fn real_tokenizers_round_trip() {
    let dir = assets();
    for (file, vocab) in [
        ("gpt2_tokenizer.json", 50_257),
        ("llama2_tokenizer.json", 32_000),
        ("llama3_tokenizer.json", 128_256),
        ("qwen3_tokenizer.json", 151_643),
    ] {
        let tok = Tokenizer::from_file(&dir.join(file)).unwrap();
        assert!(tok.vocab_size() >= vocab, "{file}: {}", tok.vocab_size());
        let ids = tok.encode(TEXT).unwrap();
        let back = tok.decode(&ids).unwrap();
        // SentencePiece-style Llama 2 prepends a space marker; the text itself is intact.
        assert!(back == TEXT || back.trim_start() == TEXT, "{file}: {back:?}");
    }
    let gpt2 = Tokenizer::from_file(&dir.join("gpt2_tokenizer.json")).unwrap();
    assert_eq!(gpt2.encode("Hello world").unwrap(), vec![15496, 995]);
}

#[test]
fn qwen_chat_template_renders() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(assets().join("qwen3_tokenizer_config.json"), dir.path().join("tokenizer_config.json")).unwrap();
    let template = ChatTemplate::from_dir(dir.path()).unwrap().expect("a chat template");
    let messages =
        vec![Message::new("system", "Be brief."), Message::new("user", "Hi?"), Message::new("assistant", "Hello.")];
    let text = template.render(&messages, false).unwrap();
    assert!(text.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"), "{text}");
    assert!(text.contains("<|im_start|>assistant\n") && text.contains("Hello.<|im_end|>"), "{text}");
    let prompt = template.render(&messages[..2], true).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
}
