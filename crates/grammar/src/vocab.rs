//! The vocabulary as llguidance sees it: every token id's bytes (a token trie) and a tokenizer for
//! the bytes a grammar forces. The `toktrie_hf_tokenizers` crate does this for `tokenizers` 0.21;
//! ember runs 0.22, so the same rules are applied here to the tokenizer.json:
//! - byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): each character of a token stands for one byte
//!   through GPT-2's byte alphabet;
//! - SentencePiece (Llama 2, Gemma): `▁` (or the decoder's `Replace` pattern) is a space and the
//!   `<0xNN>` byte-fallback tokens are the byte `NN`;
//! - anything else (a char-level vocabulary): the token's text.
//!
//! Special tokens (added tokens marked special or spelt `<...>`, the end ids, and the ids past the
//! tokenizer's that a padded embedding table has) are not text: the trie stores them behind its
//! special-token marker, so no grammar can produce them as bytes.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use serde_json::Value as Json;

use crate::GrammarError;

/// How the decoder turns a token's characters into bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Spelling {
    /// GPT-2's byte alphabet: one character per byte.
    ByteLevel,
    /// SentencePiece: `space` stands for ' ', `<0xNN>` for a byte (with `byte_fallback`).
    Pieces { space: char, byte_fallback: bool },
    /// The token's text as it is.
    Text,
}

/// The tokenizer environment handed to llguidance.
struct Env {
    trie: TokTrie,
    /// The tokenizer with nothing prepended to a text (SentencePiece's leading `▁` would otherwise
    /// be added to every forced piece).
    tokenizer: tokenizers::Tokenizer,
    /// The trie's size: ids the fallback tokenizer gives past it are left out.
    size: u32,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| match self.tokenizer.encode(text, false) {
            Ok(enc) => enc.get_ids().iter().copied().filter(|&id| id < self.size).collect(),
            // The trie's greedy split is a valid (if not canonical) spelling of the same bytes.
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        })
    }
}

/// Builds the environment for `tokenizer` over `vocab_size` ids (the model's logits width, at least
/// the tokenizer's ids); `end_ids` end a sequence (none: a placeholder id past `vocab_size` stands
/// for the end, which no mask can then allow).
pub(crate) fn tok_env(
    tokenizer: &ember_data::tokenizer::Tokenizer,
    end_ids: &[u32],
    vocab_size: usize,
) -> Result<TokEnv, GrammarError> {
    let json = tokenizer.to_json().map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
    let mut json: Json = serde_json::from_str(&json).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
    let spelling = spelling(&json["decoder"]);
    let specials = special_ids(&json, end_ids);
    let size = vocab_size.max(tokenizer.vocab_size()) + usize::from(end_ids.is_empty());
    let words: Vec<Vec<u8>> = (0..size as u32)
        .map(|id| match tokenizer.id_to_token(id) {
            Some(token) if !specials.contains(&id) => token_bytes(&token, spelling),
            _ => special_bytes(id),
        })
        .collect();
    let eos = end_ids.first().copied().unwrap_or(size as u32 - 1);
    let mut trie = TokTrie::from(&TokRxInfo::new(size as u32, eos), &words);
    if end_ids.len() > 1 {
        trie = trie.with_eos_tokens(end_ids);
    }
    never_prepend(&mut json);
    let tokenizer = tokenizers::Tokenizer::from_str(&json.to_string())
        .map_err(|e| GrammarError::Tokenizer(format!("rebuilding it without a prepended space: {e}")))?;
    Ok(Arc::new(Env { trie, tokenizer, size: size as u32 }))
}

/// The spelling a tokenizer.json's `decoder` implies.
fn spelling(decoder: &Json) -> Spelling {
    let mut parts = Vec::new();
    flatten(decoder, "decoders", &mut parts);
    let has = |kind: &str| parts.iter().any(|d| d["type"] == kind);
    if has("ByteLevel") {
        return Spelling::ByteLevel;
    }
    // `Replace("▁", " ")` (Llama 2, Gemma) or `Metaspace` name the character that stands for a space.
    let replaced = parts.iter().find_map(|d| match (d["type"].as_str(), d["content"].as_str()) {
        (Some("Replace"), Some(" ")) => single_char(d["pattern"]["String"].as_str()?),
        (Some("Metaspace"), _) => single_char(d["replacement"].as_str()?),
        _ => None,
    });
    match (replaced, has("ByteFallback")) {
        (Some(space), byte_fallback) => Spelling::Pieces { space, byte_fallback },
        (None, true) => Spelling::Pieces { space: '▁', byte_fallback: true },
        (None, false) => Spelling::Text,
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    chars.next().filter(|_| chars.next().is_none())
}

/// A component and, for a `Sequence`, its parts (under `key`), depth first.
fn flatten<'a>(node: &'a Json, key: &str, out: &mut Vec<&'a Json>) {
    match node[key].as_array() {
        Some(parts) if node["type"] == "Sequence" => parts.iter().for_each(|p| flatten(p, key, out)),
        _ if node.is_object() => out.push(node),
        _ => {}
    }
}

/// The ids that are not text: special added tokens, those spelt `<...>`, and the end ids.
fn special_ids(json: &Json, end_ids: &[u32]) -> HashSet<u32> {
    let added = json["added_tokens"].as_array().map(Vec::as_slice).unwrap_or_default();
    added
        .iter()
        .filter(|t| {
            let content = t["content"].as_str().unwrap_or_default();
            t["special"] == true || (content.len() > 2 && content.starts_with('<') && content.ends_with('>'))
        })
        .filter_map(|t| t["id"].as_u64().map(|id| id as u32))
        .chain(end_ids.iter().copied())
        .collect()
}

/// The trie's spelling of a token that is not text: the marker byte, then a name of its id.
fn special_bytes(id: u32) -> Vec<u8> {
    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    bytes.extend_from_slice(format!("<[{id}]>").as_bytes());
    bytes
}

/// The bytes a text token stands for.
fn token_bytes(token: &str, spelling: Spelling) -> Vec<u8> {
    match spelling {
        Spelling::ByteLevel => {
            // A character outside the alphabet (an added token kept as plain text) is itself.
            let map = byte_alphabet();
            let bytes: Option<Vec<u8>> = token.chars().map(|c| map.get(&c).copied()).collect();
            bytes.unwrap_or_else(|| token.as_bytes().to_vec())
        }
        Spelling::Pieces { space, byte_fallback } => match byte_token(token).filter(|_| byte_fallback) {
            Some(byte) => vec![byte],
            None => token.replace(space, " ").into_bytes(),
        },
        Spelling::Text => token.as_bytes().to_vec(),
    }
}

/// `<0xNN>`: SentencePiece's token for the byte `NN`.
fn byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

/// GPT-2's byte alphabet, character to byte: printable bytes stand for themselves, the other 68
/// take the characters from U+0100 up, in byte order.
fn byte_alphabet() -> &'static HashMap<char, u8> {
    static MAP: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
    MAP.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next = 0x100u32;
        (0..=255u8)
            .map(|b| {
                if printable(b) {
                    (b as char, b)
                } else {
                    next += 1;
                    (char::from_u32(next - 1).expect("below U+0200"), b)
                }
            })
            .collect()
    })
}

/// Drops what puts a space before a text (a `Prepend` normalizer, a `Metaspace` pre-tokenizer's
/// prepend scheme): the grammar's forced bytes are mid-text, not the start of a prompt.
fn never_prepend(json: &mut Json) {
    drop_prepend(&mut json["normalizer"]);
    set_never(&mut json["pre_tokenizer"]);
}

fn drop_prepend(node: &mut Json) {
    if node["type"] == "Prepend" {
        *node = Json::Null;
    } else if let Some(parts) = node.get_mut("normalizers").and_then(Json::as_array_mut) {
        parts.retain(|p| p["type"] != "Prepend");
        parts.iter_mut().for_each(drop_prepend);
    }
}

fn set_never(node: &mut Json) {
    if node["type"] == "Metaspace" {
        node["prepend_scheme"] = "never".into();
        if node.get("add_prefix_space").is_some() {
            node["add_prefix_space"] = false.into();
        }
    } else if let Some(parts) = node.get_mut("pretokenizers").and_then(Json::as_array_mut) {
        parts.iter_mut().for_each(set_never);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_covers_every_byte_once() {
        let map = byte_alphabet();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        assert_eq!(map[&'a'], b'a');
        let bytes: HashSet<u8> = map.values().copied().collect();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn pieces_spell_spaces_and_bytes() {
        let pieces = Spelling::Pieces { space: '▁', byte_fallback: true };
        assert_eq!(token_bytes("▁{\"", pieces), b" {\"");
        assert_eq!(token_bytes("<0x0A>", pieces), b"\n");
        assert_eq!(token_bytes("<0xE3>", pieces), vec![0xE3]);
        assert_eq!(token_bytes("ĠĠ{", Spelling::ByteLevel), b"  {");
        assert_eq!(token_bytes("<0x0A>", Spelling::Text), b"<0x0A>");
    }

    #[test]
    fn the_decoder_names_the_spelling() {
        let llama2 = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
        assert_eq!(spelling(&llama2), Spelling::Pieces { space: '▁', byte_fallback: true });
        assert_eq!(spelling(&serde_json::json!({"type": "ByteLevel"})), Spelling::ByteLevel);
        assert_eq!(spelling(&serde_json::json!({"type": "Fuse"})), Spelling::Text);
        assert_eq!(spelling(&Json::Null), Spelling::Text);
    }
}
