//! Tokenizers, all stored as Hugging Face `tokenizer.json` files and run by the `tokenizers` crate:
//! a char-level vocabulary (nanoGPT's shakespeare_char), a byte-level BPE trained on the corpus, or any
//! tokenizer.json a user brings.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use tokenizers::models::bpe::BpeTrainer;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, PreTokenizerWrapper};

use crate::error::{DataError, Result};

/// What `ember prepare --tokenizer` accepts.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizerSpec {
    /// One token per distinct character of the corpus, sorted by code point.
    Char,
    /// Byte-level BPE trained on the corpus to this vocabulary size.
    Bpe { vocab_size: usize },
    /// An existing tokenizer.json.
    File(std::path::PathBuf),
}

impl FromStr for TokenizerSpec {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "char" => Ok(Self::Char),
            "bpe" => Ok(Self::Bpe { vocab_size: 4096 }),
            _ => {
                if let Some(n) = s.strip_prefix("bpe:") {
                    match n.parse::<usize>() {
                        // 256 byte symbols plus at least the end-of-text token.
                        Ok(v) if v > 256 => Ok(Self::Bpe { vocab_size: v }),
                        _ => Err(DataError::TokenizerSpec(s.into())),
                    }
                } else if s.ends_with(".json") {
                    Ok(Self::File(s.into()))
                } else {
                    Err(DataError::TokenizerSpec(s.into()))
                }
            }
        }
    }
}

impl std::fmt::Display for TokenizerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Char => write!(f, "char"),
            Self::Bpe { vocab_size } => write!(f, "bpe:{vocab_size}"),
            Self::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A `tokenizers::Tokenizer`, plus a direct character map when the vocabulary is char-level.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Set for char-level vocabularies: encoding is then a table lookup that names unknown characters.
    chars: Option<HashMap<char, u32>>,
    /// The model's own end-of-sequence token (`eos_token` of its tokenizer_config.json), which wins
    /// over the common end-of-text names: SmolLM2's vocabulary has `<|endoftext|>`, but its turns end
    /// with `<|im_end|>`.
    eos: Option<u32>,
    /// The model's beginning-of-sequence token (`tokenizer_config.json`'s `bos_token`), if any.
    bos: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("char_level", &self.is_char_level())
            .finish()
    }
}

const END_OF_TEXT: &str = "<|endoftext|>";

/// Ids a tokenizer.json may leave unused past twice its number of entries (added tokens often sit
/// apart from the vocabulary, a model's embedding table is often padded); `tokenizers` names every
/// hole in a warning when it saves one.
const MAX_ID_GAP: usize = 1 << 20;

impl Tokenizer {
    /// Builds or loads the tokenizer a spec names; `text` is the corpus the trained kinds learn from.
    pub fn from_spec(spec: &TokenizerSpec, text: &str) -> Result<Self> {
        match spec {
            TokenizerSpec::Char => Ok(Self::train_char(text)),
            TokenizerSpec::Bpe { vocab_size } => Self::train_bpe(text, *vocab_size),
            TokenizerSpec::File(path) => Self::from_file(path),
        }
    }

    /// The char-level vocabulary of `text`: id `i` is the `i`-th distinct character in code-point
    /// order (for tinyshakespeare, 0 is the newline and 1 the space, as in nanoGPT). Stored as a
    /// WordLevel model over single-character pre-tokens, decoded by concatenation.
    pub fn train_char(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        chars.sort_unstable();
        let vocab: serde_json::Map<String, serde_json::Value> =
            chars.iter().enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            // `[\s\S]`: any one character, newlines included, in both regex engines of the
            // tokenizers library (fancy-regex here, Oniguruma in Python, which lacks `(?s)`).
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
            "post_processor": null,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        let inner = tokenizers::Tokenizer::from_str(&json.to_string()).expect("valid char-level tokenizer.json");
        Self::wrap(inner)
    }

    /// A byte-level BPE (GPT-2 style: every byte is a symbol, so no text is unknown) with
    /// `vocab_size` entries, the last being `<|endoftext|>`.
    pub fn train_bpe(text: &str, vocab_size: usize) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::new(ModelWrapper::BPE(Default::default()));
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true))));
        inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainer::builder()
                .vocab_size(vocab_size)
                .min_frequency(2)
                .show_progress(false)
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
                .build(),
        );
        // Train on paragraphs: the trainer counts words per sequence, and blank lines separate speeches.
        inner
            .train(&mut trainer, text.split("\n\n"))
            .map_err(|e| DataError::Tokenizer(format!("training BPE: {e}")))?;
        Ok(Self::wrap(inner))
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let bad = |message: String| DataError::TokenizerFile { path: path.into(), message };
        let json = crate::read_file_to_string(path).map_err(|e| bad(e.to_string()))?;
        Self::parse(&json).map(Self::wrap).map_err(|e| match e {
            DataError::Tokenizer(message) => bad(message),
            other => other,
        })
    }

    pub fn from_json(json: &str) -> Result<Self> {
        Self::parse(json).map(Self::wrap)
    }

    /// A tokenizer built in memory (a GGUF file's, from its vocabulary: `ember_hf::gguf::tokenizer`),
    /// without writing and parsing its tokenizer.json: for a 262k-token vocabulary those took several
    /// times the tokenizer's own memory. The checks of [`Tokenizer::from_file`] are for damaged
    /// files; the builder's ids are its own.
    pub fn from_tokenizers(inner: tokenizers::Tokenizer) -> Self {
        Self::wrap(inner)
    }

    /// A tokenizer.json read by the `tokenizers` crate, with checks of ours around it. `tokenizers`
    /// 0.22 panics instead of failing on some damaged files: on a JSON error inside the `decoder`
    /// object (a bad escape, a missing brace: its `expect("Helper")`) and on a bad `Precompiled`
    /// normalizer. Those two sections are parsed here first, and a panic left is caught. Then the
    /// ids: a vocabulary whose largest id is far past its number of entries is mostly holes, which
    /// saving it enumerates one by one (a warning per hole; an id of 2^32 - 1 never finishes).
    /// What it cannot read is a [`DataError::Tokenizer`] saying why.
    fn parse(json: &str) -> Result<tokenizers::Tokenizer> {
        #[derive(serde::Deserialize)]
        #[allow(dead_code)] // read to be checked
        struct Checked {
            #[serde(default)]
            decoder: serde_json::Value,
            #[serde(default)]
            normalizer: serde_json::Value,
        }
        serde_json::from_str::<Checked>(json).map_err(|e| DataError::Tokenizer(e.to_string()))?;
        let inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_str(json))
            .map_err(|_| DataError::Tokenizer("the tokenizers library could not read it (it panicked)".into()))?
            .map_err(|e| DataError::Tokenizer(e.to_string()))?;
        let vocab = inner.get_vocab(true);
        if let Some((token, &id)) = vocab.iter().max_by_key(|(_, &id)| id) {
            if id as usize >= (2 * vocab.len()).max(vocab.len() + MAX_ID_GAP) {
                let token: String = token.chars().take(40).collect();
                return Err(DataError::Tokenizer(format!(
                    "token {token:?} has id {id}, but the vocabulary has {} entries: ids that sparse are a damaged file",
                    vocab.len()
                )));
            }
        }
        Ok(inner)
    }

    fn wrap(inner: tokenizers::Tokenizer) -> Self {
        let chars = match inner.get_model() {
            ModelWrapper::WordLevel(_) => {
                let vocab = inner.get_vocab(false);
                let mut map = HashMap::with_capacity(vocab.len());
                for (tok, id) in vocab {
                    let mut it = tok.chars();
                    match (it.next(), it.next()) {
                        (Some(c), None) => map.insert(c, id),
                        _ => return Self { inner, chars: None, eos: None, bos: None },
                    };
                }
                Some(map)
            }
            _ => None,
        };
        Self { inner, chars, eos: None, bos: None }
    }

    /// Takes the end-of-sequence and beginning-of-sequence tokens from `dir/tokenizer_config.json`
    /// (`eos_token` / `bos_token`, a string or `{"content": ...}`) when the folder has them and the
    /// vocabulary knows them; unchanged otherwise.
    pub fn with_model_eos(mut self, dir: &Path) -> Self {
        let Ok(text) = std::fs::read_to_string(dir.join("tokenizer_config.json")) else { return self };
        let Ok(config) = serde_json::from_str::<serde_json::Value>(&text) else { return self };
        let id_of = |key: &str| {
            let name = match config.get(key) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(String::from),
                _ => None,
            };
            name.and_then(|n| self.inner.token_to_id(&n))
        };
        let (eos, bos) = (id_of("eos_token"), id_of("bos_token"));
        self.eos = eos.or(self.eos);
        self.bos = bos.or(self.bos);
        self
    }

    /// The model's beginning-of-sequence token, where its `tokenizer_config.json` names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether this is a char-level vocabulary.
    pub fn is_char_level(&self) -> bool {
        self.chars.is_some()
    }

    /// One past the largest id, added tokens included: every id the tokenizer can produce is below
    /// it. (The number of entries is smaller when the ids have gaps, as added tokens often do.)
    pub fn vocab_size(&self) -> usize {
        let largest = self.inner.get_vocab(true).values().copied().max().map_or(0, |m| m as usize + 1);
        self.inner.get_vocab_size(true).max(largest)
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if let Some(map) = &self.chars {
            return text
                .char_indices()
                .map(|(offset, ch)| map.get(&ch).copied().ok_or(DataError::UnknownChar { ch, offset }))
                .collect();
        }
        self.encode_reference(text)
    }

    /// Encoding with the tokenizer's special-token template (a BOS for Llama tokenizers), for the
    /// start of a document or prompt.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        if self.chars.is_some() {
            return self.encode(text);
        }
        let enc = self.inner.encode(text, true).map_err(|e| DataError::Tokenizer(format!("encoding: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of a prompt or document to run the model on: the text's ids after what the tokenizer's
    /// special-token template puts before them (the `<bos>` a Gemma or Llama tokenizer puts first, as
    /// transformers' tokenizers and llama.cpp's `add_bos_token` do), unless the text already starts
    /// with it (a chat template's rendered `<bos>`), which is not doubled. What a template appends
    /// (an `add_eos_token` tokenizer's `</s>`) is left off: the model is to continue the text. A
    /// tokenizer without a template (GPT-2's, SmolLM2's) gives [`Tokenizer::encode`]'s ids.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        if self.chars.is_some() {
            return self.encode(text);
        }
        let enc = self.inner.encode(text, true).map_err(|e| DataError::Tokenizer(format!("encoding: {e}")))?;
        // The template's own tokens have no sequence id; the text's (its special tokens too) have 0.
        let of_text = enc.get_sequence_ids();
        let ids = enc.get_ids();
        let lead = of_text.iter().take_while(|s| s.is_none()).count();
        let end = ids.len() - of_text.iter().rev().take_while(|s| s.is_none()).count().min(ids.len() - lead);
        let (prefix, own) = (&ids[..lead], &ids[lead..end]);
        if own.starts_with(prefix) {
            return Ok(own.to_vec());
        }
        Ok([prefix, own].concat())
    }

    /// Encoding through the `tokenizers` pipeline, whatever the vocabulary (the reference for the
    /// char-level table lookup).
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| DataError::Tokenizer(format!("encoding: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| DataError::Tokenizer(format!("decoding: {e}")))
    }

    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(true).map_err(|e| DataError::Tokenizer(e.to_string()))
    }

    /// Writes tokenizer.json atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::write_atomic(path, self.to_json()?.as_bytes())
    }

    /// The id of a token (special tokens included), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id (special tokens included), if there is one.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Every id that ends a generated sequence: the model's own end-of-sequence token (its
    /// end-of-turn token for chat models) and the common end-of-text tokens the vocabulary has.
    pub fn end_ids(&self) -> Vec<u32> {
        let mut ends: Vec<u32> = self.eos.into_iter().collect();
        // Gemma's turns end with `<end_of_turn>` while its end-of-sequence token is `<eos>`.
        for t in ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<end_of_turn>"] {
            if let Some(id) = self.inner.token_to_id(t).filter(|id| !ends.contains(id)) {
                ends.push(id);
            }
        }
        ends
    }

    /// The id of an end-of-text token if the vocabulary has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos.or_else(|| {
            ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>"].iter().find_map(|t| self.inner.token_to_id(t))
        })
    }

    /// Decodes with special tokens left out: what a `DecodeStream` hands out, in one call.
    pub fn decode_skipping_special(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| DataError::Tokenizer(format!("decoding: {e}")))
    }
}

/// Where the tests find the shared assets: the workspace tests' own helper.
#[cfg(test)]
#[path = "../../../tests/assets.rs"]
mod test_assets;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detokenize::{STREAM_CONTEXT, STREAM_MAX_PENDING};

    const TEXT: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n";

    #[test]
    fn char_level_is_sorted_and_round_trips() {
        let tok = Tokenizer::train_char(TEXT);
        assert!(tok.is_char_level());
        let ids = tok.encode("\n ").unwrap();
        assert_eq!(ids, vec![0, 1]); // newline and space sort first
        let ids = tok.encode(TEXT).unwrap();
        assert_eq!(ids, tok.encode_reference(TEXT).unwrap(), "table lookup == tokenizers pipeline");
        assert_eq!(tok.decode(&ids).unwrap(), TEXT);
        let e = tok.encode("Speak!").unwrap_err().to_string();
        assert_eq!(e, "character '!' at byte 5 is not in the char-level vocabulary");
    }

    #[test]
    fn saved_json_loads_back_as_the_same_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let tok = Tokenizer::train_char(TEXT);
        tok.save(&path).unwrap();
        let back = Tokenizer::from_file(&path).unwrap();
        assert!(back.is_char_level());
        assert_eq!(back.encode(TEXT).unwrap(), tok.encode(TEXT).unwrap());
    }

    #[test]
    fn bpe_round_trips_and_compresses() {
        let text = TEXT.repeat(40);
        let tok = Tokenizer::train_bpe(&text, 300).unwrap();
        assert!(!tok.is_char_level());
        assert!(tok.vocab_size() <= 300 && tok.vocab_size() > 256, "{}", tok.vocab_size());
        let ids = tok.encode(&text).unwrap();
        assert!(ids.len() < text.len() / 2, "{} tokens for {} bytes", ids.len(), text.len());
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert!(tok.eos_id().is_some());
        // Byte-level: text never seen in training still round-trips.
        let odd = "Zebra ñandú 🦀\t!";
        assert_eq!(tok.decode(&tok.encode(odd).unwrap()).unwrap(), odd);
    }

    #[test]
    fn specs_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("char".parse::<TokenizerSpec>().unwrap(), TokenizerSpec::Char);
        assert_eq!("bpe:512".parse::<TokenizerSpec>().unwrap(), TokenizerSpec::Bpe { vocab_size: 512 });
        assert!(matches!("x/tokenizer.json".parse::<TokenizerSpec>().unwrap(), TokenizerSpec::File(_)));
        let e = "bpe:12".parse::<TokenizerSpec>().unwrap_err().to_string();
        assert!(e.contains("`bpe:12`") && e.contains("expected"), "{e}");
        assert!("wordpiece".parse::<TokenizerSpec>().is_err());
    }

    /// Streams `ids` after `context` one id at a time; returns the text and the decoding work.
    fn stream(tok: &Tokenizer, context: &[u32], ids: &[u32]) -> (String, usize) {
        let mut s = tok.decode_stream(context);
        let mut text: String = ids.iter().map(|&id| s.step(id).unwrap()).collect();
        text.push_str(&s.finish().unwrap());
        (text, s.decoded_ids())
    }

    /// Mixed text: ASCII, accents, currency, CJK, Cyrillic, emoji (4-byte), tabs and runs of spaces.
    fn mixed_text(n: usize) -> String {
        let parts = [
            "First Citizen:\n",
            "Before we proceed any further, hear me speak. ",
            "1234 £€ 🦀🦀 naïve\tend ",
            "日本語のテキスト、",
            "Привет, мир! ",
            "  double  spaces and\n\nblank lines ",
            "émigré Ærøskøbing ß ",
            "👩‍🔬 ok. ",
        ];
        (0..n).map(|i| parts[(i * 5 + i / 3) % parts.len()]).collect()
    }

    /// The shared reference tokenizers (tests/assets.rs).
    fn assets() -> std::path::PathBuf {
        super::test_assets::assets().join("tokenizers")
    }

    #[test]
    fn prompts_get_the_templates_bos_once() {
        let dir = assets();
        let llama2 = Tokenizer::from_file(&dir.join("llama2_tokenizer.json")).unwrap();
        let text = "Hello there";
        let plain = llama2.encode(text).unwrap();
        assert_eq!(llama2.encode_prompt(text).unwrap(), [&[1][..], &plain].concat(), "<s> first");
        // A rendered chat template already starts with it: not doubled.
        let rendered = llama2.encode("<s>Hello there").unwrap();
        assert_eq!(rendered[0], 1);
        assert_eq!(llama2.encode_prompt("<s>Hello there").unwrap(), rendered);
        // What a template appends is left off: a `<s> $A </s>` template gives `<s>` and the text.
        let mut with_eos: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("llama2_tokenizer.json")).unwrap()).unwrap();
        with_eos["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}});
        let with_eos = Tokenizer::from_json(&with_eos.to_string()).unwrap();
        assert_eq!(with_eos.encode_with_special(text).unwrap(), [&[1][..], &plain, &[2]].concat());
        assert_eq!(with_eos.encode_prompt(text).unwrap(), [&[1][..], &plain].concat(), "no </s> after a prompt");
        assert_eq!(with_eos.encode_prompt("<s>Hello there").unwrap(), rendered, "nor a second <s>");
        // GPT-2's has no template: the plain ids.
        let gpt2 = Tokenizer::from_file(&dir.join("gpt2_tokenizer.json")).unwrap();
        assert_eq!(gpt2.encode_prompt(text).unwrap(), gpt2.encode(text).unwrap());
        let chars = Tokenizer::train_char("abc");
        assert_eq!(chars.encode_prompt("cab").unwrap(), chars.encode("cab").unwrap());
    }

    #[test]
    fn streamed_text_equals_the_one_shot_decode() {
        let text = mixed_text(40);
        let dir = assets();
        let mut tokenizers = vec![("char".to_string(), Tokenizer::train_char(&text))];
        tokenizers.push(("bpe".to_string(), Tokenizer::train_bpe(&text.repeat(4), 300).unwrap()));
        for file in ["gpt2_tokenizer.json", "llama2_tokenizer.json", "llama3_tokenizer.json", "qwen3_tokenizer.json"] {
            tokenizers.push((file.to_string(), Tokenizer::from_file(&dir.join(file)).unwrap()));
        }
        for (name, tok) in &tokenizers {
            // With the template's specials (Llama's BOS), which the stream leaves out.
            let ids = tok.encode_with_special(&text).unwrap();
            assert!(ids.len() >= 300, "{name}: only {} ids", ids.len());
            let whole = tok.decode_skipping_special(&ids).unwrap();
            assert_eq!(stream(tok, &[], &ids).0, whole, "{name}");
            // After a prompt: the prompt's text and the streamed text make the whole text.
            for cut in [1, 7, 100] {
                // A prompt that ends inside a character has no text of its own: move to the next cut.
                let text_of = |c: usize| tok.decode_skipping_special(&ids[..c]).unwrap();
                let cut = (cut..ids.len())
                    .find(|&c| !text_of(c).ends_with('\u{fffd}') && whole.starts_with(&text_of(c)))
                    .unwrap();
                let prompt = text_of(cut);
                let (rest, _) = stream(tok, &ids[..cut], &ids[cut..]);
                assert_eq!(format!("{prompt}{rest}"), whole, "{name}, prompt of {cut} ids");
            }
        }
    }

    #[test]
    fn the_stream_holds_back_an_incomplete_character_and_skips_special_tokens() {
        let text = "a 🦀 b";
        // 256 byte symbols and the end-of-text token, no merges: the crab is 4 single-byte ids.
        let tok = Tokenizer::train_bpe(&format!("{text}\n\n").repeat(3), 257).unwrap();
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), 8);
        let mut s = tok.decode_stream(&[]);
        let pieces: Vec<String> = ids.iter().map(|&id| s.step(id).unwrap()).collect();
        assert_eq!(pieces, ["a", " ", "", "", "", "🦀", " ", "b"]);
        assert_eq!(s.finish().unwrap(), "");
        // A special token prints nothing; a lone first byte of a character comes out at the end as U+FFFD.
        let eos = tok.eos_id().unwrap();
        let mut s = tok.decode_stream(&ids);
        assert_eq!(s.step(eos).unwrap(), "");
        assert_eq!(s.step(ids[2]).unwrap(), "");
        assert_eq!(s.finish().unwrap(), "\u{fffd}");
    }

    #[test]
    fn streaming_costs_linear_decoding_work() {
        let tok = Tokenizer::train_bpe(&mixed_text(200), 400).unwrap();
        let ids = tok.encode(&mixed_text(2000)).unwrap();
        assert!(ids.len() >= 4000, "{}", ids.len());
        let (_, short) = stream(&tok, &[], &ids[..2000]);
        let (_, long) = stream(&tok, &[], &ids[..4000]);
        // Each id is decoded in a window of a bounded number of ids: about twice the work for twice
        // the ids (re-decoding the whole text would be four times, and 2,000 ids per step on average).
        assert!(short <= 2000 * 3 * (STREAM_CONTEXT.max(STREAM_MAX_PENDING) + STREAM_MAX_PENDING), "{short}");
        assert!((long as f64) < 2.2 * short as f64, "{short} ids decoded for 2000 ids, {long} for 4000");
        // Ids that decode to nothing do not grow the window either.
        let eos = tok.eos_id().unwrap();
        let (text, work) = stream(&tok, &[], &vec![eos; 4000]);
        assert_eq!(text, "");
        assert!(work <= 4000 * 3 * STREAM_MAX_PENDING, "{work}");
    }

    /// A char-level tokenizer whose decoder is `decoder` (JSON) after `Fuse`.
    fn char_with_decoder(text: &str, decoder: serde_json::Value) -> Tokenizer {
        let mut json: serde_json::Value =
            serde_json::from_str(&Tokenizer::train_char(text).to_json().unwrap()).unwrap();
        json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [{"type": "Fuse"}, decoder]});
        Tokenizer::from_json(&json.to_string()).unwrap()
    }

    #[test]
    fn decoders_that_shorten_the_text_stream_without_panicking() {
        let text = "the cat sat on the mat, ok? é ü\n".repeat(20);
        // `e ` removed: the text of n + 1 ids is shorter than that of n whenever a space follows an e.
        let replace = char_with_decoder(
            &text,
            serde_json::json!({"type": "Replace", "pattern": {"String": "e "}, "content": ""}),
        );
        // One leading and one trailing space stripped: the text stops growing until a non-space comes.
        let strip =
            char_with_decoder(&text, serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": 1}));
        for tok in [&replace, &strip] {
            let ids = tok.encode(&text).unwrap();
            let short = tok.decode(&ids[..ids.len() - 1]).unwrap();
            let (streamed, _) = stream(tok, &[], &ids);
            assert!(streamed.contains("cat") && streamed.contains('ü'), "{streamed:?}");
            assert!(streamed.len() >= short.len() / 2, "{streamed:?}");
            for cut in [1, 2, 3, 5] {
                stream(tok, &ids[..cut], &ids[cut..]);
            }
        }
        // The strip decoder panics on a lone space (chars[1..0]): an error, not a panic of the caller.
        let space = strip.encode(" ").unwrap()[0];
        let e = strip.decode_stream(&[]).step(space).unwrap_err().to_string();
        assert!(e.contains("decoder panicked"), "{e}");
        // The replacing decoder does shorten the text, as the test means it to.
        let ids = replace.encode("the ").unwrap();
        assert!(replace.decode(&ids).unwrap().len() < replace.decode(&ids[..3]).unwrap().len());
    }

    #[test]
    fn a_missing_tokenizer_file_is_named() {
        let e = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err().to_string();
        assert!(e.starts_with("/nonexistent/tokenizer.json: cannot load tokenizer"), "{e}");
    }
}
