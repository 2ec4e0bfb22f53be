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
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| DataError::TokenizerFile { path: path.into(), message: e.to_string() })?;
        Ok(Self::wrap(inner))
    }

    pub fn from_json(json: &str) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_str(json).map_err(|e| DataError::Tokenizer(e.to_string()))?;
        Ok(Self::wrap(inner))
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
                        _ => return Self { inner, chars: None },
                    };
                }
                Some(map)
            }
            _ => None,
        };
        Self { inner, chars }
    }

    /// Whether this is a char-level vocabulary.
    pub fn is_char_level(&self) -> bool {
        self.chars.is_some()
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
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

    /// The id of an end-of-text token if the vocabulary has one.
    pub fn eos_id(&self) -> Option<u32> {
        ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>"].iter().find_map(|t| self.inner.token_to_id(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_missing_tokenizer_file_is_named() {
        let e = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err().to_string();
        assert!(e.starts_with("/nonexistent/tokenizer.json: cannot load tokenizer"), "{e}");
    }
}
