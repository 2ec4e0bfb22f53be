//! A JSON Schema file that generated answers follow (`ember eval --json-schema`, `[rl]
//! json_schema`): read, parsed and compiled for the model's tokenizer once, before anything is
//! generated, so that a schema the grammar engine refuses is an error at once rather than midway.

use std::path::Path;
use std::sync::Arc;

use ember_data::Tokenizer;
use ember_generate::constraint::{allows, Constraint};
use ember_grammar::{GrammarError, Grammars, Spec};

/// Why a schema file cannot constrain answers: each says what is wrong with the file; the caller
/// names the file and the option that gave it.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    #[error("not JSON: {0}")]
    Json(serde_json::Error),
    /// llguidance refused the schema (a syntax error, a keyword it does not implement), or the
    /// tokenizer cannot drive a grammar.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// The tokenizer has no token that can begin the schema's JSON (a vocabulary without `{`).
    #[error("no token of the tokenizer can start an answer of this schema")]
    NoStart,
}

/// A JSON Schema compiled for one tokenizer: every answer's constraint is a fresh copy of it.
#[derive(Debug, Clone)]
pub struct Schema {
    grammars: Arc<Grammars>,
    spec: Spec,
}

impl Schema {
    /// Reads the schema at `path` and compiles it for `tokenizer` and a model of `vocab_size`
    /// logits, each of `end_ids` ending an answer where the JSON may end. Strict: a keyword the
    /// grammar engine does not implement is refused rather than left out (the answers would not
    /// follow the schema the user wrote).
    pub fn load(path: &Path, tokenizer: &Tokenizer, end_ids: &[u32], vocab_size: usize) -> Result<Self, SchemaError> {
        let text = std::fs::read_to_string(path).map_err(SchemaError::Read)?;
        let schema = serde_json::from_str(&text).map_err(SchemaError::Json)?;
        let spec = Spec::JsonSchema { schema, strict: true };
        let grammars = Grammars::new(tokenizer, end_ids, vocab_size)?;
        let schema = Self { grammars: Arc::new(grammars), spec };
        schema.check_start()?;
        Ok(schema)
    }

    /// Some token of the first mask is one the grammar takes: a vocabulary that cannot spell the
    /// schema's first bytes (no `{`) leaves a mask of nothing, or of the unknown token alone,
    /// which the grammar then refuses.
    fn check_start(&self) -> Result<(), SchemaError> {
        let mask = self.constraint()?.mask().map_err(|_| SchemaError::NoStart)?.to_vec();
        let allowed = (0..mask.len() * 32).filter(|&id| allows(&mask, id));
        for id in allowed {
            if self.constraint()?.commit(id as u32).is_ok() {
                return Ok(());
            }
        }
        Err(SchemaError::NoStart)
    }

    /// A constraint for one answer.
    pub fn constraint(&self) -> Result<Box<dyn Constraint>, GrammarError> {
        self.grammars.constraint(&self.spec)
    }
}

impl PartialEq for Schema {
    /// The same compiled schema (settings holding a schema compare by it).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.grammars, &other.grammars) && self.spec == other.spec
    }
}

#[cfg(test)]
#[path = "../../../tests/assets.rs"]
mod test_assets;

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2() -> Tokenizer {
        Tokenizer::from_file(&test_assets::assets().join("tokenizers/gpt2_tokenizer.json")).unwrap()
    }

    #[test]
    fn a_schema_file_is_read_compiled_and_refused_by_what_is_wrong() {
        let tok = gpt2();
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let load = |path: &Path| Schema::load(path, &tok, &tok.end_ids(), tok.vocab_size());
        let good = write("good.json", r#"{"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}"#);
        let schema = load(&good).unwrap();
        let mut c = schema.constraint().unwrap();
        let mask = c.mask().unwrap().to_vec();
        let allowed: Vec<String> =
            (0..tok.vocab_size()).filter(|&id| allows(&mask, id)).map(|id| tok.decode(&[id as u32]).unwrap()).collect();
        assert!(!allowed.is_empty() && allowed.iter().all(|t| t.starts_with('{')), "{allowed:?}");
        let e = load(&dir.path().join("missing.json")).unwrap_err().to_string();
        assert!(e.starts_with("cannot read it: "), "{e}");
        let e = load(&write("bad.json", "{\"type\": ")).unwrap_err().to_string();
        assert!(e.starts_with("not JSON: "), "{e}");
        let e = load(&write("array.json", "[1]")).unwrap_err().to_string();
        assert!(e.starts_with("invalid JSON schema: "), "{e}");
        let e = load(&write("kind.json", r#"{"type": "blob"}"#)).unwrap_err().to_string();
        assert!(e.starts_with("invalid JSON schema: "), "{e}");
        // The tiny Llama's vocabulary has no `{`.
        let llama = Tokenizer::from_file(&test_assets::root().join("tests/fixtures/hf/llama/tokenizer.json")).unwrap();
        let e = Schema::load(&good, &llama, &llama.end_ids(), 128).unwrap_err();
        assert!(matches!(e, SchemaError::NoStart), "{e}");
    }
}
