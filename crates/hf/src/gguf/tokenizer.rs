//! The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), as a Hugging Face
//! `tokenizer.json` that the `tokenizers` crate runs, and back.
//!
//! - `gpt2`: byte-level BPE. `tokens` (in the byte-to-unicode alphabet), `merges` ("a b"),
//!   `token_type` (3 = control: special tokens), the pre-tokenizer named by `tokenizer.ggml.pre`.
//! - `llama`: SentencePiece BPE with `scores`; merges are recovered from the scores (a merge of
//!   two pieces whose concatenation is a piece, ranked by that piece's score), `▁` for spaces, byte
//!   fallback through the `<0xXX>` tokens, `<bos>` put first when `add_bos_token` (the default).
//! - what a family's files spell their own way ([`VocabRules`], in the family's file): Gemma's
//!   merges are ranked by the merged piece's position in the vocabulary (its scores do not follow the
//!   merge order) and its runs of spaces, stored as real spaces, are spelled with `▁` again, as
//!   transformers' GGUF reader builds Gemma's; files without a chat template may get the family's.

use std::collections::HashMap;

use serde_json::{json, Map, Value as Json};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper};

use super::{GgufError, GgufFile, Value};
use crate::family::Architecture;

/// Why a `tokenizer.json` cannot be written as GGUF metadata; each carries the offending value.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerExportError {
    #[error("tokenizer.json: {0}")]
    Json(serde_json::Error),
    /// The model's `type`, as JSON.
    #[error("a {0} tokenizer: only BPE tokenizers are exported to GGUF")]
    NotBpe(String),
    #[error("tokenizer.json has no {0}")]
    Missing(&'static str),
    #[error("a vocab id is not a number")]
    VocabId,
    #[error("a merge is neither \"a b\" nor [a, b]")]
    Merge,
}

/// ggml token types.
const NORMAL: i64 = 1;
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const BYTE: i64 = 6;

fn strings(f: &GgufFile, key: &str) -> Result<Vec<String>, GgufError> {
    let items = f.get(key).and_then(Value::as_array).ok_or_else(|| f.meta_err(key, "missing or not an array"))?;
    items
        .iter()
        .map(|v| v.as_str().map(String::from).ok_or_else(|| f.meta_err(key, "an item is not a string")))
        .collect()
}

/// The ways llama.cpp's pre-tokenizers split text before byte-level BPE that ember rebuilds.
#[derive(Debug, Clone, Copy)]
enum PreSplit {
    /// GPT-2's own split, the regex ByteLevel applies.
    Gpt2,
    /// Digits one by one, then GPT-2's split.
    DigitsThenGpt2,
    /// Llama 3's regex: numbers in runs of up to three digits.
    Llama3,
    /// Qwen2's: Llama 3's with single digits.
    Qwen2,
}

/// llama.cpp's `tokenizer.ggml.pre` names that ember knows, and their splits.
const PRE_TOKENIZERS: &[(&str, PreSplit)] = &[
    ("default", PreSplit::Gpt2),
    ("gpt2", PreSplit::Gpt2),
    ("smollm", PreSplit::DigitsThenGpt2),
    ("starcoder", PreSplit::DigitsThenGpt2),
    ("refact", PreSplit::DigitsThenGpt2),
    ("codeshell", PreSplit::DigitsThenGpt2),
    ("command-r", PreSplit::DigitsThenGpt2),
    ("exaone", PreSplit::DigitsThenGpt2),
    ("minerva", PreSplit::DigitsThenGpt2),
    ("llama-bpe", PreSplit::Llama3),
    ("llama3", PreSplit::Llama3),
    ("llama-v3", PreSplit::Llama3),
    ("qwen2", PreSplit::Qwen2),
];

/// The pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` name `pre`, as Hugging Face writes it;
/// `None` for a name ember does not know (splitting as GPT-2 does instead would tokenize silently
/// wrong).
fn pre_tokenizer(pre: &str) -> Option<Json> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let regex_then_bytes =
        |pattern: &str| json!({"type": "Sequence", "pretokenizers": [split(pattern), byte_level(false)]});
    let (_, kind) = PRE_TOKENIZERS.iter().find(|(name, _)| *name == pre)?;
    Some(match kind {
        PreSplit::Gpt2 => byte_level(true),
        PreSplit::DigitsThenGpt2 => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
        }),
        PreSplit::Llama3 => regex_then_bytes("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
        PreSplit::Qwen2 => regex_then_bytes("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    })
}

/// How a family's files spell a SentencePiece (`llama`) vocabulary, and the chat template of those
/// that carry none: each family's [`GgufRules::vocab`](super::hparams::GgufRules::vocab).
#[derive(Debug, Clone, Copy)]
pub struct VocabRules {
    /// How the merges are ranked.
    pub merges: MergeOrder,
    /// Whether the runs of spaces (user-defined tokens `"  "` to 31 spaces) that llama.cpp's
    /// converter stores as real spaces are spelled `▁▁…`, as the family's tokenizer.json has them.
    pub space_runs_as_pieces: bool,
    /// Other llama.cpp architectures, of no model ember reads, whose files spell their vocabulary so
    /// (Gemma 3's forerunners).
    pub also_in: &'static [&'static str],
    /// The chat template of the family's files that carry none.
    pub chat_template: Option<&'static str>,
}

impl VocabRules {
    /// Most families': merges by score, spaces as they are, no template of their own.
    pub const SCORES: VocabRules =
        VocabRules { merges: MergeOrder::Score, space_runs_as_pieces: false, also_in: &[], chat_template: None };
}

/// `tokenizer.json`'s text and `tokenizer_config.json` from a GGUF file's metadata: the
/// [`tokenizer`] written out by the `tokenizers` crate's serialiser (streamed, no JSON tree).
pub fn from_gguf(f: &GgufFile) -> Result<(String, Json), GgufError> {
    let (tokenizer, config) = tokenizer(f)?;
    let text = tokenizer.to_string(false).expect("a built tokenizer serialises");
    Ok((text, config))
}

/// The tokenizer a GGUF file's metadata describes, built in memory, and `tokenizer_config.json`.
/// The vocabulary and the merges go straight into the BPE model (for Gemma 3, 262k tokens and 515k
/// merges: as a JSON tree, then a text parsed back, they took several times the tokenizer's own
/// size); the few small parts are written as tokenizer.json spells them and read by the
/// `tokenizers` crate, so that they are what a tokenizer.json of the same text gives.
pub fn tokenizer(f: &GgufFile) -> Result<(tokenizers::Tokenizer, Json), GgufError> {
    let model = f.meta().str("tokenizer.ggml.model")?.unwrap_or("gpt2");
    let arch = f.meta().str("general.architecture")?.unwrap_or_default();
    let rules = Architecture::vocab_rules(arch);
    let mut v = GgufVocab::read(f)?;
    let parts = match model {
        "gpt2" => gpt2_parts(f)?,
        "llama" => {
            if rules.space_runs_as_pieces {
                v.respell_space_runs();
            }
            llama_parts(f, &v, rules.merges)?
        }
        other => {
            return Err(f.meta_err("tokenizer.ggml.model", format!("`{other}` is not supported (gpt2 and llama are)")))
        }
    };
    let mut config = tokenizer_config(f, &v);
    if let Some(template) = rules.chat_template.filter(|_| config.get("chat_template").is_none()) {
        config["chat_template"] = json!(template);
    }
    Ok((parts.build(f, v)?, config))
}

/// A tokenizer before its vocabulary goes into the model: the merges as pairs, the small parts as
/// tokenizer.json spells them (`null` where there is none).
struct Parts {
    normalizer: Json,
    pre_tokenizer: Json,
    post_processor: Json,
    decoder: Json,
    merges: Vec<(String, String)>,
    unk: Option<String>,
    /// SentencePiece's: runs of unknown pieces fused, unknown bytes through the `<0xXX>` tokens.
    byte_fallback: bool,
}

impl Parts {
    /// The tokenizer, the vocabulary's tokens moved into the BPE model (ids as in the file) and the
    /// control and user-defined tokens added, as the `tokenizers` crate reads a tokenizer.json.
    fn build(self, f: &GgufFile, v: GgufVocab) -> Result<tokenizers::Tokenizer, GgufError> {
        let added = v.added_tokens();
        let vocab: Vocab = v.tokens.into_iter().enumerate().map(|(id, token)| (token, id as u32)).collect();
        let mut bpe = BPE::builder()
            .vocab_and_merges(vocab, self.merges)
            .fuse_unk(self.byte_fallback)
            .byte_fallback(self.byte_fallback);
        if let Some(unk) = self.unk {
            bpe = bpe.unk_token(unk);
        }
        let bpe = bpe.build().map_err(|e| f.meta_err("tokenizer.ggml.merges", e.to_string()))?;
        let mut tokenizer = tokenizers::Tokenizer::new(bpe);
        tokenizer
            .with_normalizer(part::<NormalizerWrapper>(self.normalizer))
            .with_pre_tokenizer(part::<PreTokenizerWrapper>(self.pre_tokenizer))
            .with_post_processor(part::<PostProcessorWrapper>(self.post_processor))
            .with_decoder(part::<DecoderWrapper>(self.decoder));
        tokenizer.add_tokens(&added);
        Ok(tokenizer)
    }
}

/// One of a tokenizer's small parts from its tokenizer.json spelling (`null`: none). The spellings
/// are this file's own, so one the `tokenizers` crate does not read is a bug here.
fn part<T: serde::de::DeserializeOwned>(spelled: Json) -> Option<T> {
    let text = spelled.to_string();
    serde_json::from_value(spelled).unwrap_or_else(|e| panic!("tokenizer part {text}: {e}"))
}

/// The tokens of a GGUF file's metadata, by id, with their ggml token types.
struct GgufVocab {
    tokens: Vec<String>,
    types: Vec<i64>,
}

impl GgufVocab {
    fn read(f: &GgufFile) -> Result<Self, GgufError> {
        let mut tokens = strings(f, "tokenizer.ggml.tokens")?;
        // Empty tokens are spelled `[EMPTY_{id}]`, as llama.cpp's vocabulary does (texts must differ).
        let mut empty = Vec::new();
        for (id, token) in tokens.iter_mut().enumerate().filter(|(_, t)| t.is_empty()) {
            *token = format!("[EMPTY_{id}]");
            empty.push(id);
        }
        if let (Some(first), n) = (empty.first(), empty.len()) {
            let path = f.path.display();
            tracing::warn!(
                "{path}: tokenizer.ggml.tokens: {n} empty token(s) (the first id {first}) read as [EMPTY_<id>], as \
                 llama.cpp reads them"
            );
        }
        let types: Vec<i64> = match f.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(t) => t.iter().map(|v| v.as_f64().map_or(NORMAL, |x| x as i64)).collect(),
            None => vec![NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            let message = format!("{} types for {} tokens", types.len(), tokens.len());
            return Err(f.meta_err("tokenizer.ggml.token_type", message));
        }
        refuse_duplicates(f, &tokens)?;
        Ok(Self { tokens, types })
    }

    /// Gemma's runs of spaces (user-defined tokens `"  "` to 31 spaces), which llama.cpp's converter
    /// stores as real spaces, spelled `▁▁…` as in Gemma's tokenizer.json, where the normalizer's
    /// `▁`s reach them: ordinary pieces then, not added tokens matched in the raw text.
    /// transformers' GGUF reader does the same (`gemma_tokenizer`).
    fn respell_space_runs(&mut self) {
        for (token, ty) in self.tokens.iter_mut().zip(&mut self.types) {
            if token.contains(' ') && token.chars().all(char::is_whitespace) {
                *token = "▁".repeat(token.chars().count());
                *ty = NORMAL;
            }
        }
    }

    /// tokenizer.json's `added_tokens`: the control tokens (special) and the user-defined ones,
    /// matched in the raw text (not normalized), neither stripping spaces nor matching whole words.
    fn added_tokens(&self) -> Vec<AddedToken> {
        let special = |i: usize| self.types[i] == CONTROL || self.types[i] == USER_DEFINED;
        (0..self.tokens.len())
            .filter(|&i| special(i))
            .map(|i| {
                AddedToken::from(self.tokens[i].clone(), self.types[i] == CONTROL)
                    .single_word(false)
                    .lstrip(false)
                    .rstrip(false)
                    .normalized(false)
            })
            .collect()
    }

    /// The id metadata `key` holds, if it names one of the tokens.
    fn id_of(&self, f: &GgufFile, key: &str) -> Option<usize> {
        f.get(key).and_then(Value::as_u64).map(|i| i as usize).filter(|&i| i < self.tokens.len())
    }
}

/// Refuses a token text that appears twice in `tokenizer.ggml.tokens`: llama.cpp refuses such a
/// file too (its vocabulary asserts one id per text), and a Hugging Face vocabulary holds one id per
/// text. Named with both ids.
fn refuse_duplicates(f: &GgufFile, tokens: &[String]) -> Result<(), GgufError> {
    let mut first: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        if let Some(earlier) = first.insert(token, id) {
            let message = format!(
                "token {token:?} appears twice, as ids {earlier} and {id}: each text must be one token (llama.cpp \
                 refuses the file too)"
            );
            return Err(f.meta_err("tokenizer.ggml.tokens", message));
        }
    }
    Ok(())
}

/// llama.cpp's `gpt2` tokenizer: a byte-level BPE, its merges ("a b") read as the `tokenizers` crate
/// reads them from a tokenizer.json.
fn gpt2_parts(f: &GgufFile) -> Result<Parts, GgufError> {
    let key = "tokenizer.ggml.pre";
    let pre = f.meta().str(key)?.unwrap_or("default");
    let Some(pre_tokenizer) = pre_tokenizer(pre) else {
        let known: Vec<&str> = PRE_TOKENIZERS.iter().map(|(name, _)| *name).collect();
        let message = format!("`{pre}` is a pre-tokenizer ember does not know (it knows {})", known.join(", "));
        return Err(f.meta_err(key, message));
    };
    Ok(Parts {
        normalizer: Json::Null,
        pre_tokenizer,
        post_processor: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        merges: gpt2_merges(f)?,
        unk: None,
        byte_fallback: false,
    })
}

/// `tokenizer.ggml.merges` as pairs, as the `tokenizers` crate reads "a b" lines: a `#version`
/// line skipped, every other exactly two tokens split at a space.
fn gpt2_merges(f: &GgufFile) -> Result<Vec<(String, String)>, GgufError> {
    let key = "tokenizer.ggml.merges";
    let items = f.get(key).and_then(Value::as_array).ok_or_else(|| f.meta_err(key, "missing or not an array"))?;
    let mut merges = Vec::with_capacity(items.len());
    for item in items {
        let line = item.as_str().ok_or_else(|| f.meta_err(key, "an item is not a string"))?;
        if line.starts_with("#version") {
            continue;
        }
        let mut parts = line.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) => merges.push((a.to_string(), b.to_string())),
            _ => {
                let message = format!("merge {} ({line:?}) is not two tokens and a space", merges.len() + 1);
                return Err(f.meta_err(key, message));
            }
        }
    }
    Ok(merges)
}

/// How the merges of a SentencePiece vocabulary are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeOrder {
    /// By the merged piece's score, higher first (Llama 2 and most SentencePiece files).
    Score,
    /// By the merged piece's id, lower first (Gemma, whose vocabulary is in merge order).
    Position,
}

/// llama.cpp's `llama` tokenizer: a SentencePiece BPE, merges recovered from the vocabulary in
/// `order`.
fn llama_parts(f: &GgufFile, v: &GgufVocab, order: MergeOrder) -> Result<Parts, GgufError> {
    let merges = match order {
        MergeOrder::Score => {
            let scores: Vec<f64> = match f.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                Some(s) => s.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
                None => {
                    return Err(f.meta_err("tokenizer.ggml.scores", "missing (a SentencePiece vocabulary needs them)"))
                }
            };
            spm_merges(&v.tokens, &scores, &v.types)
        }
        MergeOrder::Position => positional_merges(&v.tokens),
    };
    let add_space = f.get("tokenizer.ggml.add_space_prefix").is_none_or(|x| *x == Value::Bool(true));
    let (normalizers, decoders) = spm_normalizers_and_decoders(add_space);
    Ok(Parts {
        normalizer: json!({"type": "Sequence", "normalizers": normalizers}),
        pre_tokenizer: Json::Null,
        post_processor: bos_eos_processor(f, v),
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        merges,
        unk: v.id_of(f, "tokenizer.ggml.unknown_token_id").map(|i| v.tokens[i].clone()),
        byte_fallback: true,
    })
}

/// SentencePiece's spaces as `▁`, one put before the text when `add_space`; and back, bytes
/// through the `<0xXX>` tokens.
fn spm_normalizers_and_decoders(add_space: bool) -> (Vec<Json>, Vec<Json>) {
    let mut normalizers = Vec::new();
    if add_space {
        normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    (normalizers, decoders)
}

/// The post-processor that puts `<bos>` first (`tokenizer.ggml.add_bos_token`, true when absent as
/// llama.cpp and transformers assume for SentencePiece files) and `<eos>` last
/// (`tokenizer.ggml.add_eos_token`) when special tokens are asked for; `null` when neither is.
fn bos_eos_processor(f: &GgufFile, v: &GgufVocab) -> Json {
    let flag = |key: &str, default: bool| match f.get(key) {
        Some(Value::Bool(b)) => *b,
        _ => default,
    };
    let bos = v.id_of(f, "tokenizer.ggml.bos_token_id").filter(|_| flag("tokenizer.ggml.add_bos_token", true));
    let eos = v.id_of(f, "tokenizer.ggml.eos_token_id").filter(|_| flag("tokenizer.ggml.add_eos_token", false));
    if bos.is_none() && eos.is_none() {
        return Json::Null;
    }
    let special = |i: usize, type_id: u32| json!({"SpecialToken": {"id": v.tokens[i], "type_id": type_id}});
    let sequence = |name: &str, type_id: u32| {
        let mut items: Vec<Json> = bos.map(|b| special(b, type_id)).into_iter().collect();
        items.push(json!({"Sequence": {"id": name, "type_id": type_id}}));
        items.extend(eos.map(|e| special(e, type_id)));
        items
    };
    let mut pair = sequence("A", 0);
    pair.extend(sequence("B", 1));
    let special_tokens: Map<String, Json> = bos
        .into_iter()
        .chain(eos)
        .map(|i| (v.tokens[i].clone(), json!({"id": v.tokens[i], "ids": [i], "tokens": [v.tokens[i]]})))
        .collect();
    json!({"type": "TemplateProcessing", "single": sequence("A", 0), "pair": pair, "special_tokens": special_tokens})
}

/// `tokenizer_config.json`: the chat template, BOS and EOS, and `add_bos_token`.
fn tokenizer_config(f: &GgufFile, v: &GgufVocab) -> Json {
    let mut config = json!({});
    if let Some(t) = f.get("tokenizer.chat_template").and_then(Value::as_str) {
        config["chat_template"] = json!(t);
    }
    if let Some(i) = v.id_of(f, "tokenizer.ggml.bos_token_id") {
        config["bos_token"] = json!(v.tokens[i]);
    }
    if let Some(i) = v.id_of(f, "tokenizer.ggml.eos_token_id") {
        config["eos_token"] = json!(v.tokens[i]);
    }
    if let Some(Value::Bool(b)) = f.get("tokenizer.ggml.add_bos_token") {
        config["add_bos_token"] = json!(b);
    }
    config
}

/// SentencePiece BPE merges from piece scores: every split of a piece into two pieces is a merge,
/// ranked by the merged piece's score (higher first), as Hugging Face's `SentencePieceExtractor`; pairs
/// `(a, b)`, which a piece holding a space cannot make ambiguous.
fn spm_merges(tokens: &[String], scores: &[f64], types: &[i64]) -> Vec<(String, String)> {
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    // (score, left id, right id, the merged piece's id, where it splits)
    let mut merges: Vec<(f64, usize, usize, usize, usize)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if types.get(i).is_some_and(|&t| t == BYTE || t == CONTROL) {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(at);
            if let (Some(&ia), Some(&ib)) = (index.get(a), index.get(b)) {
                merges.push((scores.get(i).copied().unwrap_or(0.0), ia, ib, i, at));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let pair = |i: usize, at: usize| {
        let (a, b) = tokens[i].split_at(at);
        (a.to_string(), b.to_string())
    };
    merges.into_iter().map(|m| pair(m.3, m.4)).collect()
}

/// SentencePiece BPE merges in vocabulary order: every split of a piece into two pieces is a merge,
/// pieces in id order and, within one, the longer left part first: what transformers'
/// `generate_merges` gives Gemma when ranking by position (`-id` as the score).
fn positional_merges(tokens: &[String]) -> Vec<(String, String)> {
    let index: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges = Vec::new();
    for piece in tokens {
        for (at, _) in piece.char_indices().skip(1).collect::<Vec<_>>().into_iter().rev() {
            let (a, b) = piece.split_at(at);
            if index.contains_key(a) && index.contains_key(b) {
                merges.push((a.to_string(), b.to_string()));
            }
        }
    }
    merges
}

/// `tokenizer.ggml.*` metadata of a BPE `tokenizer.json`, byte-level (what ember exports) or over
/// SentencePiece pieces, with the chat template and BOS/EOS of `tokenizer_config` (or the model's
/// config ids).
pub fn to_gguf(
    tokenizer_json: &str,
    tokenizer_config: Option<&Json>,
    hf_config: &Json,
    pre: Option<&str>,
) -> Result<Vec<(String, Value)>, TokenizerExportError> {
    let t: Json = serde_json::from_str(tokenizer_json).map_err(TokenizerExportError::Json)?;
    let model = &t["model"];
    if model["type"] != "BPE" {
        return Err(TokenizerExportError::NotBpe(model["type"].to_string()));
    }
    // Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) is llama.cpp's `gpt2`; a BPE over `▁`-marked
    // pieces (SentencePiece's, Llama 2's) its `llama`, which stores scores instead of merges.
    let byte_level = [&t["pre_tokenizer"], &t["decoder"]].iter().any(|v| v.to_string().contains("ByteLevel"));
    let pieces = if byte_level { None } else { Some(spm_metadata(&t)?) };
    let (tokens, types) = tokens_and_types(&t, hf_config)?;
    let mut meta = match &pieces {
        None => gpt2_metadata(&tokens, &types, joined_merges(model, " ")?, pre),
        Some(spm) => llama_metadata(&tokens, &types, spm),
    };
    meta.extend(special_token_metadata(&tokens, tokenizer_config, hf_config));
    Ok(meta)
}

/// The token of every id, added tokens included, up to the model's `vocab_size` (ids no token
/// holds become `[PAD{id}]`); and each one's ggml type.
fn tokens_and_types(t: &Json, hf_config: &Json) -> Result<(Vec<String>, Vec<i64>), TokenizerExportError> {
    let vocab = t["model"]["vocab"].as_object().ok_or(TokenizerExportError::Missing("model.vocab"))?;
    let mut tokens: Vec<Option<String>> = Vec::new();
    let mut put = |id: usize, s: &str| {
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some(s.to_string());
    };
    for (s, id) in vocab {
        put(id.as_u64().ok_or(TokenizerExportError::VocabId)? as usize, s);
    }
    let mut specials = HashMap::new();
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (a["id"].as_u64(), a["content"].as_str()) else { continue };
        put(id as usize, content);
        specials.insert(id as usize, if a["special"] == json!(true) { CONTROL } else { USER_DEFINED });
    }
    let n_vocab = hf_config["vocab_size"].as_u64().map_or(tokens.len(), |v| v as usize).max(tokens.len());
    tokens.resize(n_vocab, None);
    let tokens: Vec<String> =
        tokens.into_iter().enumerate().map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]"))).collect();
    let types = (0..n_vocab).map(|i| specials.get(&i).copied().unwrap_or(NORMAL)).collect();
    Ok((tokens, types))
}

/// The merges of a BPE `model` ("a b" or ["a", "b"] in tokenizer.json), each pair joined by `sep`.
fn joined_merges(model: &Json, sep: &str) -> Result<Vec<String>, TokenizerExportError> {
    let merges = model["merges"].as_array().ok_or(TokenizerExportError::Missing("model.merges"))?;
    merges
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.replacen(' ', sep, 1)),
            Json::Array(p) if p.len() == 2 => {
                Ok(format!("{}{sep}{}", p[0].as_str().unwrap_or_default(), p[1].as_str().unwrap_or_default()))
            }
            _ => Err(TokenizerExportError::Merge),
        })
        .collect()
}

fn string_array(items: &[String]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.clone())).collect())
}

/// llama.cpp's `gpt2` tokenizer: the tokens, their types and the merges ("a b").
fn gpt2_metadata(tokens: &[String], types: &[i64], merges: Vec<String>, pre: Option<&str>) -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.model".to_string(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre.unwrap_or("default").into())),
        ("tokenizer.ggml.tokens".to_string(), string_array(tokens)),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types.iter().map(|&x| Value::I32(x as i32)).collect())),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges.into_iter().map(Value::String).collect())),
    ]
}

/// llama.cpp's `llama` tokenizer: the pieces, scores that give the merges' order, token types
/// (an unknown piece not already control and the byte pieces marked) and the unknown piece's id.
fn llama_metadata(tokens: &[String], types: &[i64], spm: &SpmMetadata) -> Vec<(String, Value)> {
    let types: Vec<Value> = tokens
        .iter()
        .zip(types)
        .map(|(t, &ty)| {
            // A control `<unk>` (Gemma's) stays control: llama.cpp and the import match it in text.
            Value::I32(if Some(t) == spm.unk.as_ref() && ty != CONTROL {
                UNKNOWN as i32
            } else if t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') {
                BYTE as i32
            } else {
                ty as i32
            })
        })
        .collect();
    let scores = spm_scores(tokens, &spm.merged);
    let mut meta = vec![
        ("tokenizer.ggml.model".to_string(), Value::String("llama".into())),
        ("tokenizer.ggml.tokens".to_string(), string_array(tokens)),
        ("tokenizer.ggml.scores".to_string(), Value::Array(scores.into_iter().map(Value::F32).collect())),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.add_space_prefix".to_string(), Value::Bool(spm.add_space_prefix)),
    ];
    if let Some(u) = spm.unk.as_ref().and_then(|u| tokens.iter().position(|t| t == u)) {
        meta.push(("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(u as u32)));
    }
    meta
}

/// Scores: a merged piece scores minus the rank of the merge that makes it, so that recovering the
/// merges from the scores (as import and llama.cpp do) gives their order.
fn spm_scores(tokens: &[String], merged: &[String]) -> Vec<f32> {
    let mut scores = vec![0f32; tokens.len()];
    for (rank, merged) in merged.iter().enumerate() {
        if let Some(i) = tokens.iter().position(|t| t == merged) {
            if scores[i] == 0.0 {
                scores[i] = -(rank as f32) - 1.0;
            }
        }
    }
    scores
}

/// BOS, EOS (also the padding token) and `add_bos_token` of `tokenizer_config` (BOS/EOS from the
/// model's config ids when it names none), and its chat template.
fn special_token_metadata(
    tokens: &[String],
    tokenizer_config: Option<&Json>,
    hf_config: &Json,
) -> Vec<(String, Value)> {
    let id_of = |name: Option<&str>| name.and_then(|n| tokens.iter().position(|t| t == n)).map(|i| i as u32);
    let token_name = |k: &str| -> Option<String> {
        match tokenizer_config?.get(k)? {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content")?.as_str().map(String::from),
            _ => None,
        }
    };
    let bos = id_of(token_name("bos_token").as_deref()).or(hf_config["bos_token_id"].as_u64().map(|v| v as u32));
    let eos = id_of(token_name("eos_token").as_deref()).or(hf_config["eos_token_id"].as_u64().map(|v| v as u32));
    let mut meta = Vec::new();
    if let Some(b) = bos {
        meta.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    if let Some(e) = eos {
        meta.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(e)));
        meta.push(("tokenizer.ggml.padding_token_id".into(), Value::U32(e)));
    }
    let add_bos = tokenizer_config.and_then(|c| c.get("add_bos_token")).and_then(Json::as_bool).unwrap_or(false);
    meta.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(add_bos)));
    if let Some(template) = tokenizer_config.and_then(|c| c.get("chat_template")).and_then(Json::as_str) {
        meta.push(("tokenizer.chat_template".into(), Value::String(template.into())));
    }
    meta
}

/// What a SentencePiece-style BPE tokenizer.json says that GGUF's `llama` tokenizer needs.
struct SpmMetadata {
    /// The piece each merge makes, in merge order.
    merged: Vec<String>,
    unk: Option<String>,
    /// A `▁` is put before the text (Metaspace's `prepend_scheme`, or a `Prepend` normalizer).
    add_space_prefix: bool,
}

fn spm_metadata(t: &Json) -> Result<SpmMetadata, TokenizerExportError> {
    let merged = joined_merges(&t["model"], "")?;
    let text = format!("{}{}", t["normalizer"], t["pre_tokenizer"]);
    let add_space_prefix = text.contains("\"Prepend\"") || (text.contains("Metaspace") && !text.contains("\"never\""));
    Ok(SpmMetadata { merged, unk: t["model"]["unk_token"].as_str().map(String::from), add_space_prefix })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::encode;

    /// A Gemma-like SentencePiece vocabulary: control tokens, a user-defined newline and a run of two
    /// spaces stored as real spaces, and pieces whose scores rank `ab` above `▁a` though `▁a` comes
    /// first (so the merge order tells scores from positions).
    fn file(arch: &str, chat_template: Option<&str>) -> GgufFile {
        let pieces = [
            ("<pad>", 3, 0.0),
            ("<eos>", 3, 0.0),
            ("<bos>", 3, 0.0),
            ("<unk>", 3, 0.0),
            ("<start_of_turn>", 3, 0.0),
            ("<end_of_turn>", 3, 0.0),
            ("\n", 4, 0.0),
            ("  ", 4, 0.0),
            ("▁", 1, -1.0),
            ("a", 1, -2.0),
            ("b", 1, -3.0),
            ("▁a", 1, -20.0),
            ("ab", 1, -10.0),
        ];
        let s = |v: &str| Value::String(v.into());
        let mut meta = vec![
            ("general.architecture".to_string(), s(arch)),
            ("tokenizer.ggml.model".to_string(), s("llama")),
            ("tokenizer.ggml.tokens".to_string(), Value::Array(pieces.iter().map(|p| s(p.0)).collect())),
            ("tokenizer.ggml.token_type".to_string(), Value::Array(pieces.iter().map(|p| Value::I32(p.1)).collect())),
            ("tokenizer.ggml.scores".to_string(), Value::Array(pieces.iter().map(|p| Value::F32(p.2)).collect())),
            ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(2)),
            ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(1)),
            ("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(3)),
            ("tokenizer.ggml.add_space_prefix".to_string(), Value::Bool(false)),
        ];
        if let Some(t) = chat_template {
            meta.push(("tokenizer.chat_template".to_string(), s(t)));
        }
        GgufFile::parse(encode(&meta, &[]), std::path::Path::new("t.gguf")).unwrap()
    }

    fn ids(f: &GgufFile, text: &str, add_special: bool) -> (Vec<u32>, Json) {
        let (json, config) = from_gguf(f).unwrap();
        let tok: tokenizers::Tokenizer = json.parse().unwrap();
        (tok.encode(text, add_special).unwrap().get_ids().to_vec(), config)
    }

    #[test]
    fn the_built_tokenizer_is_the_one_its_text_reads_as() {
        // What a tokenizer.json of the same parts would give: its text read back serialises the same
        // (checked once on SmolLM2's and Gemma 3's real files against the JSON-tree builder this
        // replaced: byte for byte the same tokenizer.json).
        for arch in ["gemma3", "llama"] {
            let f = file(arch, None);
            let (built, _) = tokenizer(&f).unwrap();
            let (text, _) = from_gguf(&f).unwrap();
            let read: tokenizers::Tokenizer = text.parse().unwrap();
            assert_eq!(read.to_string(true).unwrap(), built.to_string(true).unwrap(), "{arch}");
            let ids = |t: &tokenizers::Tokenizer| t.encode(" ab  a\n<end_of_turn>", true).unwrap().get_ids().to_vec();
            assert_eq!(ids(&read), ids(&built), "{arch}");
        }
    }

    #[test]
    fn an_unknown_pre_tokenizer_is_an_error_that_lists_the_known_ones() {
        let s = |v: &str| Value::String(v.into());
        let file = |pre: Value| {
            let meta = vec![
                ("general.architecture".to_string(), s("gpt2")),
                ("tokenizer.ggml.model".to_string(), s("gpt2")),
                ("tokenizer.ggml.pre".to_string(), pre),
                ("tokenizer.ggml.tokens".to_string(), Value::Array(vec![s("a"), s("b"), s("ab")])),
                ("tokenizer.ggml.merges".to_string(), Value::Array(vec![s("a b")])),
            ];
            GgufFile::parse(encode(&meta, &[]), std::path::Path::new("t.gguf")).unwrap()
        };
        for known in ["smollm", "default", "gpt2", "llama-bpe", "qwen2"] {
            assert!(from_gguf(&file(s(known))).is_ok(), "{known}");
        }
        let e = from_gguf(&file(s("deepseek-coder"))).expect_err("an error").to_string();
        assert!(e.contains("t.gguf") && e.contains("tokenizer.ggml.pre") && e.contains("`deepseek-coder`"), "{e}");
        assert!(e.contains("smollm") && e.contains("llama-bpe") && e.contains("qwen2"), "lists the known ones: {e}");
        let e = from_gguf(&file(Value::U32(2))).expect_err("an error").to_string();
        assert!(e.contains("`tokenizer.ggml.pre` has type u32 (2), expected string"), "{e}");
    }

    #[test]
    fn gemma_merges_follow_positions_and_space_runs_are_pieces() {
        // `▁ab▁▁a`: `▁▁` merges first (its respelled piece is id 7), then `▁a` (id 11) before `ab`
        // (id 12); `\n` and `<end_of_turn>` are matched whole in the text.
        let (got, config) = ids(&file("gemma3", None), " ab  a\n<end_of_turn>", false);
        assert_eq!(got, [11, 10, 7, 9, 6, 5]);
        assert_eq!(config["chat_template"], crate::families::gemma3::GEMMA3_CHAT_TEMPLATE);
        assert_eq!(ids(&file("gemma3", None), "a", true).0, [2, 9], "<bos> first (add_bos_token by default)");
        // A file's own template wins; other architectures get none.
        assert_eq!(ids(&file("gemma3", Some("{{ x }}")), "a", false).1["chat_template"], "{{ x }}");
        // Gemma 2's files spell their vocabulary as Gemma 3's, and get no template.
        let (got, config) = ids(&file("gemma2", None), " ab  a\n<end_of_turn>", false);
        assert_eq!(got, [11, 10, 7, 9, 6, 5]);
        assert!(config.get("chat_template").is_none());
        let (got, config) = ids(&file("llama", None), " ab", false);
        assert!(config.get("chat_template").is_none());
        assert_eq!(got, [8, 12], "by score `ab` merges before `▁a`");
    }
}
