//! The sampling a chat uses when the user sets none: one definition for `ember chat`, `ember
//! sample --chat` and `ember serve` (requests that leave `temperature` or `top_p` out). A model
//! folder's `generation_config.json` (Hugging Face's file of the settings its authors recommend,
//! kept by `ember import`) replaces ember's built-in values with its own.

use std::path::{Path, PathBuf};

use ember_generate::sample::SamplingConfig;
use serde_json::Value;

/// The Hugging Face file of a model's recommended generation settings.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// ember's chat temperature where the model recommends none. Low, because the small models people
/// chat with locally lose the thread at the usual 0.7 to 0.8: SmolLM2-135M-Instruct named the
/// capital of France in 10 answers of 32 at 0.7 and 0.8 ("Le Grand Brut"), in 24 of 32 at 0.2, the
/// value its model card uses (experiments/chat-sampling.md).
pub const CHAT_TEMPERATURE: f32 = 0.2;
/// ember's chat nucleus (top-p) where the model recommends none, SmolLM2's and Llama 3's 0.9.
pub const CHAT_TOP_P: f32 = 0.9;

/// Where a checkpoint's chat defaults come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    BuiltIn,
    /// The `generation_config.json` at this path.
    Model(PathBuf),
}

/// The sampling settings a chat starts from, before the user's own flags or request fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatDefaults {
    pub sampling: SamplingConfig,
    pub source: Source,
}

/// A `generation_config.json` that cannot be used, with the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum DefaultsError {
    #[error("reading {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("{path} is not JSON: {err}")]
    Json { path: PathBuf, err: serde_json::Error },
    #[error("{path}: `{key}` is {value}, {expected} (fix the file or delete it to use ember's chat defaults)")]
    Value { path: PathBuf, key: &'static str, value: String, expected: &'static str },
}

impl ChatDefaults {
    /// ember's own: temperature [`CHAT_TEMPERATURE`], top-p [`CHAT_TOP_P`], no top-k, no
    /// repetition penalty.
    pub fn built_in() -> Self {
        let sampling = SamplingConfig {
            temperature: CHAT_TEMPERATURE,
            top_k: None,
            top_p: Some(CHAT_TOP_P),
            repetition_penalty: 1.0,
        };
        Self { sampling, source: Source::BuiltIn }
    }

    /// The defaults of the checkpoint folder `dir`: its `generation_config.json` when the file
    /// recommends sampling (`do_sample: true` or any of `temperature`, `top_p`, `top_k`,
    /// `repetition_penalty`), read as Hugging Face reads it (a key left out takes transformers'
    /// default: temperature 1, top-p 1, top-k 50); ember's [`built_in`](Self::built_in) ones
    /// otherwise, as for a file of token ids only (most base models').
    pub fn for_checkpoint(dir: &Path) -> Result<Self, DefaultsError> {
        let path = dir.join(GENERATION_CONFIG);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::built_in()),
            Err(err) => return Err(DefaultsError::Read { path, err }),
        };
        let json: Value = serde_json::from_str(&text).map_err(|err| DefaultsError::Json { path: path.clone(), err })?;
        Self::from_generation_config(&json, &path)
    }

    /// [`for_checkpoint`](Self::for_checkpoint) on the parsed file; `path` names it in errors.
    pub fn from_generation_config(json: &Value, path: &Path) -> Result<Self, DefaultsError> {
        const KEYS: [&str; 4] = ["temperature", "top_p", "top_k", "repetition_penalty"];
        let recommends =
            json.get("do_sample") == Some(&Value::Bool(true)) || KEYS.iter().any(|k| json.get(k).is_some());
        if !recommends {
            return Ok(Self::built_in());
        }
        let bad = |key: &'static str, expected: &'static str| DefaultsError::Value {
            path: path.to_path_buf(),
            key,
            value: json.get(key).map_or_else(String::new, Value::to_string),
            expected,
        };
        let number = |key: &'static str, default: f64| match json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| bad(key, "not a number")),
        };
        let temperature = number("temperature", 1.0)?;
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(bad("temperature", "expected a number >= 0"));
        }
        let top_p = number("top_p", 1.0)?;
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad("top_p", "expected a number in (0, 1]"));
        }
        // transformers reads top_k 0 (or none) as no top-k.
        let top_k = match json.get("top_k") {
            None => Some(50),
            Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(0) => None,
                Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
                None => return Err(bad("top_k", "expected a whole number >= 0")),
            },
        };
        let repetition_penalty = number("repetition_penalty", 1.0)?;
        if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
            return Err(bad("repetition_penalty", "expected a number > 0"));
        }
        let sampling = SamplingConfig {
            temperature: temperature as f32,
            top_k,
            top_p: (top_p < 1.0).then_some(top_p as f32),
            repetition_penalty: repetition_penalty as f32,
        };
        Ok(Self { sampling, source: Source::Model(path.to_path_buf()) })
    }

    /// One line for the user: the settings and where they come from.
    pub fn describe(&self) -> String {
        let from = match &self.source {
            Source::BuiltIn => "ember's chat defaults".to_string(),
            Source::Model(path) => path.display().to_string(),
        };
        format!("{} (from {from})", describe(&self.sampling))
    }
}

/// `temperature 0.2, top-p 0.9` and any top-k and penalty.
pub fn describe(s: &SamplingConfig) -> String {
    let mut parts =
        vec![if s.temperature == 0.0 { "greedy".to_string() } else { format!("temperature {}", s.temperature) }];
    if s.temperature > 0.0 {
        if let Some(p) = s.top_p {
            parts.push(format!("top-p {p}"));
        }
        if let Some(k) = s.top_k {
            parts.push(format!("top-k {k}"));
        }
    }
    if s.repetition_penalty != 1.0 {
        parts.push(format!("repetition penalty {}", s.repetition_penalty));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<ChatDefaults, DefaultsError> {
        ChatDefaults::from_generation_config(&v, Path::new("generation_config.json"))
    }

    #[test]
    fn a_file_of_token_ids_keeps_embers_defaults() {
        // SmolLM2's and most base models' file: ids only, which transformers would decode greedily.
        let d = read(json!({"bos_token_id": 1, "eos_token_id": 2, "_from_model_config": true})).unwrap();
        assert_eq!(d, ChatDefaults::built_in());
        assert_eq!(d.sampling.temperature, CHAT_TEMPERATURE);
        assert_eq!(d.sampling.top_p, Some(CHAT_TOP_P));
        let missing = ChatDefaults::for_checkpoint(Path::new("/nonexistent/ember-folder")).unwrap();
        assert_eq!(missing, ChatDefaults::built_in());
    }

    #[test]
    fn a_recommendation_is_read_as_transformers_reads_it() {
        // Llama 3's: no top_k, so transformers' 50.
        let d = read(json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]})).unwrap();
        assert_eq!(
            d.sampling,
            SamplingConfig { temperature: 0.6, top_k: Some(50), top_p: Some(0.9), repetition_penalty: 1.0 }
        );
        assert!(matches!(d.source, Source::Model(_)));
        // Qwen2.5's, with a penalty; Gemma 3's, without a temperature (transformers' 1).
        let d =
            read(json!({"do_sample": true, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}))
                .unwrap();
        assert_eq!(
            d.sampling,
            SamplingConfig { temperature: 0.7, top_k: Some(20), top_p: Some(0.8), repetition_penalty: 1.05 }
        );
        let d = read(json!({"do_sample": true, "top_k": 64, "top_p": 0.95})).unwrap();
        assert_eq!(d.sampling.temperature, 1.0);
        assert_eq!(read(json!({"top_k": 0, "top_p": 1.0})).unwrap().sampling.top_k, None);
        assert_eq!(read(json!({"top_k": 0, "top_p": 1.0})).unwrap().sampling.top_p, None);
    }

    #[test]
    fn bad_values_name_the_key() {
        for (v, key) in [
            (json!({"temperature": -1}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"top_k": -3}), "top_k"),
            (json!({"top_k": 2.5}), "top_k"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
        ] {
            match read(v.clone()) {
                Err(DefaultsError::Value { key: k, .. }) => assert_eq!(k, key, "{v}"),
                other => panic!("{v}: {other:?}"),
            }
        }
        let msg = read(json!({"temperature": -1})).unwrap_err().to_string();
        assert!(msg.contains("generation_config.json") && msg.contains("`temperature` is -1"), "{msg}");
    }
}
