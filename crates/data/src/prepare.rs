//! `ember prepare`: text -> tokenizer -> train/val token shards, cached by what they depend on.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};
use crate::fetch::{hex, sha256_file};
use crate::shards::{TokenShard, VERSION};
use crate::tokenizer::{Tokenizer, TokenizerSpec};

/// Written as `meta.json` beside the shards; a later prepare with the same key reuses them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareMeta {
    pub format_version: u32,
    pub source: PathBuf,
    pub source_sha256: String,
    pub tokenizer: String,
    /// sha256 of the tokenizer.json given by path; empty for trained tokenizers.
    pub tokenizer_sha256: String,
    pub val_fraction: f64,
    pub vocab_size: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
}

impl PrepareMeta {
    fn same_inputs(&self, other: &PrepareMeta) -> bool {
        self.format_version == other.format_version
            && self.source_sha256 == other.source_sha256
            && self.tokenizer == other.tokenizer
            && self.tokenizer_sha256 == other.tokenizer_sha256
            && self.val_fraction == other.val_fraction
    }
}

/// The prepared data of one corpus.
pub struct Prepared {
    pub dir: PathBuf,
    pub meta: PrepareMeta,
    pub tokenizer: Tokenizer,
    pub train: TokenShard,
    pub val: TokenShard,
    /// True when the shards came from an earlier run.
    pub reused: bool,
}

pub const TRAIN_FILE: &str = "train.bin";
pub const VAL_FILE: &str = "val.bin";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
const META_FILE: &str = "meta.json";

/// Splits `text` by characters: the first `(1 - val_fraction)` for training, the rest for validation
/// (nanoGPT: `data[:int(n*0.9)]`).
pub fn split_text(text: &str, val_fraction: f64) -> (&str, &str) {
    let n = text.chars().count();
    let n_train = (n as f64 * (1.0 - val_fraction)) as usize;
    let at = text.char_indices().nth(n_train).map_or(text.len(), |(i, _)| i);
    text.split_at(at)
}

/// A short key for a cache folder name, from everything the shards depend on.
pub fn cache_key(source_sha256: &str, spec: &TokenizerSpec, val_fraction: f64) -> String {
    let mut h = Sha256::new();
    // `char-2`: the char-level tokenizer.json of this version (a portable split pattern).
    h.update(format!("v{VERSION}|char-2|{source_sha256}|{spec}|{val_fraction}"));
    hex(&h.finalize())[..12].to_string()
}

/// Tokenizes `text_path` into `out_dir/{train,val}.bin` and `tokenizer.json`, unless `out_dir`
/// already holds shards prepared from the same inputs. Files there that an earlier prepare did not
/// write are never replaced: the call fails naming the first one, before writing anything (see
/// [`check_overwrites`]).
pub fn prepare(text_path: &Path, spec: &TokenizerSpec, val_fraction: f64, out_dir: &Path) -> Result<Prepared> {
    prepare_hashed(text_path, sha256_file(text_path)?, spec, val_fraction, out_dir, Overwrite::OnlyOurs)
}

/// [`prepare`] into `<cache_root>/<file stem>-<key>/`, where the key covers the text's sha256, the
/// tokenizer and the split: a second run with the same inputs reuses the shards.
pub fn prepare_cached(
    text_path: &Path,
    spec: &TokenizerSpec,
    val_fraction: f64,
    cache_root: &Path,
) -> Result<Prepared> {
    let sha = sha256_file(text_path)?;
    let stem = text_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let out_dir = cache_root.join(format!("{stem}-{}", cache_key(&sha, spec, val_fraction)));
    // Nothing but ember writes in its cache: a half-prepared folder (a killed run) is simply redone.
    prepare_hashed(text_path, sha, spec, val_fraction, &out_dir, Overwrite::Any)
}

/// What an existing file in the output folder may be replaced with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overwrite {
    /// Only what a prepare wrote (`ember prepare --out`, a folder of the user's choosing).
    OnlyOurs,
    /// Anything (ember's own cache).
    Any,
}

fn prepare_hashed(
    text_path: &Path,
    source_sha256: String,
    spec: &TokenizerSpec,
    val_fraction: f64,
    out_dir: &Path,
    overwrite: Overwrite,
) -> Result<Prepared> {
    let tokenizer_sha256 = match spec {
        TokenizerSpec::File(p) => sha256_file(p)?,
        _ => String::new(),
    };
    let wanted = PrepareMeta {
        format_version: VERSION,
        source: text_path.into(),
        source_sha256,
        tokenizer: spec.to_string(),
        tokenizer_sha256,
        val_fraction,
        vocab_size: 0,
        train_tokens: 0,
        val_tokens: 0,
    };
    if let Some(p) = load_if_current(out_dir, &wanted)? {
        tracing::info!(dir = %out_dir.display(), "token shards are up to date, reusing them");
        return Ok(p);
    }

    let text = crate::read_file_to_string(text_path).map_err(DataError::io(text_path))?;
    let (train_text, val_text) = split_text(&text, val_fraction);
    let tokenizer = match spec {
        // The char vocabulary covers the whole text (as nanoGPT's), so validation has no unknowns.
        TokenizerSpec::Char => Tokenizer::train_char(&text),
        // A trained BPE sees only the training split.
        _ => Tokenizer::from_spec(spec, train_text)?,
    };
    let vocab = tokenizer.vocab_size() as u32;
    let train = TokenShard::new(tokenizer.encode(train_text)?, vocab);
    let val = TokenShard::new(tokenizer.encode(val_text)?, vocab);
    let meta = PrepareMeta {
        vocab_size: vocab as usize,
        train_tokens: train.tokens.len(),
        val_tokens: val.tokens.len(),
        ..wanted
    };
    let tokenizer_json = tokenizer.to_json()?;
    if overwrite == Overwrite::OnlyOurs {
        check_overwrites(out_dir, tokenizer_json.as_bytes())?;
    }
    std::fs::create_dir_all(out_dir).map_err(DataError::io(out_dir))?;
    train.write(&out_dir.join(TRAIN_FILE))?;
    val.write(&out_dir.join(VAL_FILE))?;
    crate::write_atomic(&out_dir.join(TOKENIZER_FILE), tokenizer_json.as_bytes())?;
    // meta.json last: its presence says the rest is complete.
    let json = serde_json::to_string_pretty(&meta).expect("meta serialises");
    crate::write_atomic(&out_dir.join(META_FILE), json.as_bytes())?;
    tracing::info!(
        train = meta.train_tokens,
        val = meta.val_tokens,
        vocab = meta.vocab_size,
        dir = %out_dir.display(),
        "prepared token shards"
    );
    Ok(Prepared { dir: out_dir.into(), meta, tokenizer, train, val, reused: false })
}

/// Fails, naming the file, when `out_dir` holds a file this prepare would replace and an earlier
/// prepare did not write: typically the tokenizer.json of a model folder given as the output (often
/// the very tokenizer being prepared with), which would be lost. Ours are: everything in the folder of
/// a finished prepare (its meta.json reads as one), token shards (the `EMBERTOK` magic), and a
/// tokenizer.json with exactly the bytes about to be written (a prepare stopped between its files and
/// run again: nothing is lost). Checked before anything is written, so a refusal changes nothing.
fn check_overwrites(out_dir: &Path, tokenizer_json: &[u8]) -> Result<()> {
    let refuse = |path: PathBuf, why: &str| DataError::Io {
        path,
        err: std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "exists and {why}, so `ember prepare` did not write it; refusing to overwrite it (move it away \
                 or choose another output folder)"
            ),
        ),
    };
    let meta_path = out_dir.join(META_FILE);
    if meta_path.exists() {
        let ours = std::fs::read_to_string(&meta_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| v.get("format_version").is_some() && v.get("source_sha256").is_some());
        return if ours { Ok(()) } else { Err(refuse(meta_path, "is not the meta.json of prepared shards")) };
    }
    for file in [TRAIN_FILE, VAL_FILE] {
        let path = out_dir.join(file);
        if path.exists() && !is_token_shard(&path) {
            return Err(refuse(path, "is not an ember token shard"));
        }
    }
    let path = out_dir.join(TOKENIZER_FILE);
    if path.exists() && std::fs::read(&path).map_or(true, |b| b != tokenizer_json) {
        return Err(refuse(path, "differs from the tokenizer being prepared, with no meta.json beside it"));
    }
    Ok(())
}

/// Whether `path` starts with the magic of an ember token shard.
fn is_token_shard(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == crate::shards::MAGIC
}

fn load_if_current(dir: &Path, wanted: &PrepareMeta) -> Result<Option<Prepared>> {
    let meta_path = dir.join(META_FILE);
    let Ok(text) = std::fs::read_to_string(&meta_path) else { return Ok(None) };
    let Ok(meta) = serde_json::from_str::<PrepareMeta>(&text) else {
        tracing::warn!(path = %meta_path.display(), "unreadable meta.json, preparing again");
        return Ok(None);
    };
    if !meta.same_inputs(wanted) {
        return Ok(None);
    }
    let tokenizer = Tokenizer::from_file(&dir.join(TOKENIZER_FILE))?;
    let train = TokenShard::read(&dir.join(TRAIN_FILE))?;
    let val = TokenShard::read(&dir.join(VAL_FILE))?;
    Ok(Some(Prepared { dir: dir.into(), meta, tokenizer, train, val, reused: true }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_by_characters() {
        assert_eq!(split_text("abcdefghij", 0.1), ("abcdefghi", "j"));
        // Multi-byte characters are never cut.
        assert_eq!(split_text("ééééééééé€", 0.1), ("ééééééééé", "€"));
    }

    #[test]
    fn second_prepare_reuses_the_shards_and_a_changed_input_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let text_path = dir.path().join("t.txt");
        std::fs::write(&text_path, "to be or not to be, that is the question\n".repeat(20)).unwrap();
        let out = dir.path().join("out");
        let a = prepare(&text_path, &TokenizerSpec::Char, 0.1, &out).unwrap();
        assert!(!a.reused);
        let b = prepare(&text_path, &TokenizerSpec::Char, 0.1, &out).unwrap();
        assert!(b.reused);
        assert_eq!(a.train, b.train);
        assert_eq!(a.val, b.val);
        let c = prepare(&text_path, &TokenizerSpec::Char, 0.2, &out).unwrap();
        assert!(!c.reused);
        std::fs::write(&text_path, "something else entirely\n".repeat(20)).unwrap();
        let d = prepare(&text_path, &TokenizerSpec::Char, 0.2, &out).unwrap();
        assert!(!d.reused);
        assert_ne!(d.meta.source_sha256, c.meta.source_sha256);
    }

    #[test]
    fn files_a_prepare_did_not_write_are_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let text_path = dir.path().join("t.txt");
        std::fs::write(&text_path, "to be or not to be, that is the question\n".repeat(20)).unwrap();
        let out = dir.path().join("model");
        std::fs::create_dir_all(&out).unwrap();
        for (file, text) in
            [(TOKENIZER_FILE, "{\"model\": {}}"), (META_FILE, "{\"architectures\": []}"), (TRAIN_FILE, "x")]
        {
            std::fs::write(out.join(file), text).unwrap();
            let Err(err) = prepare(&text_path, &TokenizerSpec::Char, 0.1, &out) else { panic!("{file} overwritten") };
            let err = err.to_string();
            assert!(err.contains(&out.join(file).display().to_string()) && err.contains("refusing"), "{err}");
            assert_eq!(std::fs::read_to_string(out.join(file)).unwrap(), text, "{file} unchanged");
            assert!(!out.join(VAL_FILE).exists(), "nothing written");
            std::fs::remove_file(out.join(file)).unwrap();
        }
        // A prepare stopped before its meta.json, run again: its own files are replaced.
        let a = prepare(&text_path, &TokenizerSpec::Char, 0.1, &out).unwrap();
        std::fs::remove_file(out.join(META_FILE)).unwrap();
        let b = prepare(&text_path, &TokenizerSpec::Char, 0.1, &out).unwrap();
        assert!(!b.reused);
        assert_eq!(a.train, b.train);
        // Unrelated files beside the output are left alone and do not matter.
        std::fs::write(out.join("README.md"), "mine").unwrap();
        prepare(&text_path, &TokenizerSpec::Char, 0.2, &out).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("README.md")).unwrap(), "mine");
    }
}
