//! Structured output: a request's JSON Schema, "any JSON object", Lark grammar or regex turned into
//! an [`ember_generate::constraint::Constraint`], the token mask the generator applies before each
//! draw. llguidance does the grammar work (an Earley parser over a lazily built lexer, masks
//! computed by walking a token trie); this crate gives it ember's vocabulary ([`vocab`]) and maps
//! its answers to ember's interface ([`constraint`]).
//!
//! JSON comes out compact and in one layout: no free whitespace (a 135M model given room for
//! spaces and newlines spends its tokens on them), `", "` between items and `": "` after keys (the
//! layout of Python's `json.dumps`, which models have seen most), properties in the schema's order.

mod constraint;
mod vocab;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ember_generate::constraint::Constraint;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value as Json};

pub use constraint::GrammarConstraint;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against `schema`. Both settings of `strict` enforce the schema: with
    /// `strict`, a keyword llguidance does not implement (or an unknown `format`, a `oneOf`) is an
    /// error; without it such keywords are left out (warnings) and the rest is still enforced.
    JsonSchema { schema: Json, strict: bool },
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex(String),
}

impl Spec {
    /// The spec's kind, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Spec::JsonObject => "JSON object",
            Spec::JsonSchema { .. } => "JSON schema",
            Spec::Lark(_) => "Lark grammar",
            Spec::Regex(_) => "regex",
        }
    }

    /// llguidance's grammar for the spec, JSON with ember's layout.
    fn grammar(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            Spec::JsonObject => TopLevelGrammar::from_json_schema(with_layout(json!({"type": "object"}), true)?),
            Spec::JsonSchema { schema, strict } => {
                TopLevelGrammar::from_json_schema(with_layout(schema.clone(), *strict)?)
            }
            Spec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            Spec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        })
    }
}

/// `schema` with ember's JSON layout (see the crate docs) in its `x-guidance` options, unless it
/// sets its own; `lenient` unless `strict`.
fn with_layout(mut schema: Json, strict: bool) -> Result<Json, GrammarError> {
    let Some(object) = schema.as_object_mut() else {
        let kind = match schema {
            Json::Bool(_) => "a boolean",
            Json::Array(_) => "an array",
            _ => "not an object",
        };
        return Err(GrammarError::Compile {
            kind: "JSON schema",
            message: format!("the schema is {kind}; a JSON schema here is an object such as {{\"type\": \"object\"}}"),
        });
    };
    object.entry("x-guidance").or_insert_with(
        || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": !strict}),
    );
    Ok(schema)
}

/// Why a grammar could not be built or compiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer could not be read as a vocabulary of bytes.
    #[error("the tokenizer cannot drive a grammar: {0}")]
    Tokenizer(String),
    /// llguidance refused the spec: its own words (an unsupported keyword, a syntax error).
    #[error("invalid {kind}: {message}")]
    Compile { kind: &'static str, message: String },
}

/// Compiled grammars kept for the specs seen most recently: a server sees the same schema again
/// and again, and compiling one (the lexer's first states) costs milliseconds.
const CACHED_SPECS: usize = 64;

/// The grammar machinery for one tokenizer (its token trie and llguidance's factory), built once
/// and shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    end_ids: Arc<[u32]>,
    vocab_size: usize,
    compiled: Mutex<HashMap<String, TokenParser>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("end_ids", &self.end_ids).field("vocab_size", &self.vocab_size).finish()
    }
}

impl Grammars {
    /// The grammars of `tokenizer` for a model whose logits are `vocab_size` wide (ids past the
    /// tokenizer's are never allowed); `end_ids` end a sequence, and each of them is allowed
    /// wherever the grammar may end.
    pub fn new(
        tokenizer: &ember_data::tokenizer::Tokenizer,
        end_ids: &[u32],
        vocab_size: usize,
    ) -> Result<Self, GrammarError> {
        let size = vocab_size.max(tokenizer.vocab_size());
        if let Some(id) = end_ids.iter().find(|&&id| id as usize >= size) {
            return Err(GrammarError::Tokenizer(format!("end id {id} is past the vocabulary ({size} ids)")));
        }
        let env = vocab::tok_env(tokenizer, end_ids, vocab_size)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory, end_ids: end_ids.into(), vocab_size, compiled: Mutex::new(HashMap::new()) })
    }

    /// The bytes token `id` stands for (a token may hold part of a UTF-8 character); `None` for a
    /// special token (an end of text, a marker) or an id past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let trie = self.factory.tok_env().tok_trie();
        if id as usize >= self.vocab_size.min(trie.vocab_size()) || self.end_ids.contains(&id) {
            return None;
        }
        let bytes = trie.token(id);
        // The trie keeps special tokens behind a marker byte that no text starts with.
        (bytes.first() != Some(&llguidance::toktrie::TokTrie::SPECIAL_TOKEN_MARKER)).then_some(bytes)
    }

    /// Compiles `spec`, saying what is wrong with it if llguidance refuses it.
    pub fn check(&self, spec: &Spec) -> Result<(), GrammarError> {
        self.parser(spec).map(drop)
    }

    /// A constraint for one sequence generated under `spec`.
    pub fn constraint(&self, spec: &Spec) -> Result<Box<dyn Constraint>, GrammarError> {
        self.grammar_constraint(spec).map(|c| Box::new(c) as Box<dyn Constraint>)
    }

    /// [`Grammars::constraint`], as its concrete type.
    pub fn grammar_constraint(&self, spec: &Spec) -> Result<GrammarConstraint, GrammarError> {
        let matcher = Matcher::new(Ok(self.parser(spec)?));
        GrammarConstraint::new(matcher, self.end_ids.clone(), self.vocab_size)
            .map_err(|e| GrammarError::Compile { kind: spec.kind(), message: e.0 })
    }

    /// A fresh parser for `spec`: a deep copy of the cached one (the copies share no lexer state,
    /// so sequences drawn at once do not wait on each other), else compiled and cached.
    fn parser(&self, spec: &Spec) -> Result<TokenParser, GrammarError> {
        let key = format!("{spec:?}");
        if let Some(parser) = self.compiled.lock().expect("cache lock").get(&key) {
            return Ok(parser.deep_clone());
        }
        let parser = self
            .factory
            .create_parser(spec.grammar()?)
            .map_err(|e| GrammarError::Compile { kind: spec.kind(), message: format!("{e:#}") })?;
        let mut cache = self.compiled.lock().expect("cache lock");
        if cache.len() >= CACHED_SPECS {
            cache.clear();
        }
        cache.insert(key, parser.deep_clone());
        Ok(parser)
    }
}

#[cfg(test)]
#[path = "../../../tests/assets.rs"]
mod test_assets;

#[cfg(test)]
mod tests {
    use super::*;
    use ember_data::tokenizer::Tokenizer;
    use ember_generate::constraint::allows;

    fn gpt2() -> Tokenizer {
        Tokenizer::from_file(&test_assets::assets().join("tokenizers/gpt2_tokenizer.json")).unwrap()
    }

    fn allowed(c: &mut dyn Constraint, vocab: usize) -> Vec<u32> {
        let mask = c.mask().unwrap();
        (0..vocab as u32).filter(|&id| allows(mask, id as usize)).collect()
    }

    #[test]
    fn every_end_id_is_allowed_where_the_grammar_may_end_and_padding_never() {
        let tok = gpt2();
        let (a, b) = (tok.token_to_id("a").unwrap(), tok.token_to_id("b").unwrap());
        let ends = [50256, 30];
        // A model padded past GPT-2's 50,257 ids, to a size that is not a whole number of words.
        let grammars = Grammars::new(&tok, &ends, 50_300).unwrap();
        let mut c = grammars.constraint(&Spec::Regex("a(bb)?".into())).unwrap();
        assert!(!allowed(c.as_mut(), 50_300).iter().any(|id| ends.contains(id)), "no end before `a`");
        c.commit(a).unwrap();
        let after_a = allowed(c.as_mut(), 50_300);
        assert!(ends.iter().all(|id| after_a.contains(id)), "both ends after `a`");
        assert!(after_a.contains(&b) && after_a.iter().all(|&id| id < 50_257), "{after_a:?}");
        assert!(!c.finished());
        c.commit(30).unwrap();
        assert!(c.finished(), "an end id ends it");
        let mask = c.mask().unwrap();
        assert_eq!(mask.len(), 50_300usize.div_ceil(32));
    }

    #[test]
    fn a_complete_grammar_is_finished_without_an_end_token() {
        let tok = gpt2();
        let grammars = Grammars::new(&tok, &tok.end_ids(), tok.vocab_size()).unwrap();
        let mut c = grammars.constraint(&Spec::Lark(r#"start: "yes" | "no""#.into())).unwrap();
        c.commit(tok.token_to_id("no").unwrap()).unwrap();
        assert!(c.finished(), "nothing can follow `no`");
    }

    #[test]
    fn cached_specs_give_independent_constraints() {
        let tok = gpt2();
        let grammars = Grammars::new(&tok, &tok.end_ids(), tok.vocab_size()).unwrap();
        let spec = Spec::Lark(r#"start: "yes" | "no""#.into());
        let mut first = grammars.constraint(&spec).unwrap();
        first.commit(tok.token_to_id("yes").unwrap()).unwrap();
        let mut second = grammars.constraint(&spec).unwrap();
        assert!(first.finished() && !second.finished());
        second.commit(tok.token_to_id("no").unwrap()).unwrap();
        assert!(second.finished());
    }

    #[test]
    fn a_token_outside_the_mask_is_refused_in_the_grammars_words() {
        let tok = gpt2();
        let grammars = Grammars::new(&tok, &tok.end_ids(), tok.vocab_size()).unwrap();
        let mut c = grammars.constraint(&Spec::JsonObject).unwrap();
        let e = c.commit(tok.token_to_id("hello").unwrap()).unwrap_err();
        assert!(e.to_string().starts_with("constrained decoding failed"), "{e}");
    }

    #[test]
    fn grammars_are_shared_across_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<Grammars>();
    }

    #[test]
    fn an_end_id_past_the_vocabulary_is_refused() {
        let tok = gpt2();
        let e = Grammars::new(&tok, &[60_000], 50_257).unwrap_err();
        assert!(e.to_string().contains("60000"), "{e}");
    }
}
