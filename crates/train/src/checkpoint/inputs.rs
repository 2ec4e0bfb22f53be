//! What a run read, recorded in each of its checkpoints (`inputs.json`): its data file (size,
//! sha256, rows, and for a token stream its shards), its validation file where it has its own, and, for a LoRA run, the weights of its base
//! (`init_from`), whose checkpoints hold the adapters only. A resume compares the data found now
//! with the record ([`DataRecord::changes_since`]); loading a LoRA checkpoint over its base compares
//! the base ([`Checkpoint::check_base`](super::Checkpoint::check_base)).
//!
//! Rows are the file's non-blank lines (JSONL: examples, pairs or prompts; text: lines). Besides
//! the file's digest the record keeps the rows' count, a digest of the rows in order and one
//! that ignores their order (the sum of each row's digest), so that a change can be told by kind:
//! rows added at the end, rows removed, the same rows shuffled, or rows edited or replaced.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{resolve, ADAPTER_FILE, MODEL_FILE};
use crate::config::InitSource;
use crate::error::TrainError;

/// `inputs.json`: what the run read; each part absent where the run does not record it (an older
/// ember, or a run without a base to check).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInputs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataRecord>,
    /// Its validation file (`data.val_path`), where it has one of its own: it decides the run's
    /// best checkpoint and its target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val: Option<DataRecord>,
    /// A LoRA run's base: its weights are not in the checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<BaseRecord>,
}

/// The data file a run trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataRecord {
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: String,
    /// What a row is called: `rows` (JSONL) or `lines` (text).
    pub unit: String,
    /// Non-blank lines.
    pub rows: u64,
    /// sha256 of the rows' own digests in order.
    pub rows_sha256: String,
    /// The sum of the rows' digests (their first 16 bytes, mod 2^128), in hex: the same for the
    /// same rows in any order.
    pub rows_sum: String,
    /// A token stream's shards (`train.bin`, `val.bin`): what the tokenizer made of the file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardRecord>,
}

/// A shard of tokens: its length and the sha256 of its ids (u32, little-endian).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardRecord {
    pub name: String,
    pub tokens: u64,
    pub sha256: String,
}

/// The weights a LoRA run's adapters sit on: the files of its `init_from` source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaseRecord {
    /// `init_from` as the run gave it (`gguf:FILE`, `hf:DIR`, `run:DIR`).
    pub source: String,
    pub files: Vec<FileDigest>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileDigest {
    /// The file's name in its folder.
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
    /// The file's modification time (ns since the epoch) when it was read: a file with the same
    /// size and time is taken as the same without reading it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_ns: Option<u128>,
}

/// A file's size and modification time (ns since the epoch, where the system gives one).
fn stamp(path: &Path) -> Result<(u64, Option<u128>), TrainError> {
    let meta = std::fs::metadata(path).map_err(TrainError::io(path))?;
    let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    Ok((meta.len(), modified.map(|d| d.as_nanos())))
}

/// One pass over a data file: the record's figures, and the order-free digest of its first
/// `prefix` rows where asked (to tell rows added at the end from other changes).
struct Scan {
    bytes: u64,
    sha256: String,
    rows: u64,
    rows_sha256: String,
    rows_sum: u128,
    prefix_sum: Option<u128>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn scan(path: &Path, prefix: Option<u64>) -> Result<Scan, TrainError> {
    let file = std::fs::File::open(path).map_err(TrainError::io(path))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 16, file);
    let (mut whole, mut ordered) = (Sha256::new(), Sha256::new());
    let (mut bytes, mut rows, mut sum, mut prefix_sum) = (0u64, 0u64, 0u128, None);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).map_err(TrainError::io(path))?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        whole.update(&line);
        // A row as `str::lines` gives it (the JSONL readers' rows): without `\n` or `\r\n`.
        let mut row = line.strip_suffix(b"\n").unwrap_or(&line);
        row = row.strip_suffix(b"\r").unwrap_or(row);
        // Blank as the readers see it (`str::trim`: Unicode whitespace too).
        let blank = std::str::from_utf8(row).map_or_else(|_| row.trim_ascii().is_empty(), |s| s.trim().is_empty());
        if blank {
            continue;
        }
        if prefix == Some(rows) {
            prefix_sum = Some(sum);
        }
        let digest = Sha256::digest(row);
        ordered.update(digest);
        let head: [u8; 16] = digest[..16].try_into().expect("sha256 has 32 bytes");
        sum = sum.wrapping_add(u128::from_be_bytes(head));
        rows += 1;
    }
    if prefix == Some(rows) {
        prefix_sum = Some(sum);
    }
    Ok(Scan {
        bytes,
        sha256: hex(&whole.finalize()),
        rows,
        rows_sha256: hex(&ordered.finalize()),
        rows_sum: sum,
        prefix_sum,
    })
}

impl DataRecord {
    /// The record of the data file `path` (`jsonl`: its rows are examples, pairs or prompts) and,
    /// for a token stream, of its `shards`.
    pub(crate) fn of(
        path: &Path,
        jsonl: bool,
        shards: &[(String, std::sync::Arc<ember_data::TokenShard>)],
    ) -> Result<Self, TrainError> {
        let s = scan(path, None)?;
        let shards = shards
            .iter()
            .map(|(name, shard)| {
                let mut h = Sha256::new();
                for chunk in shard.tokens.chunks(1 << 14) {
                    let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
                    h.update(&bytes);
                }
                ShardRecord { name: name.clone(), tokens: shard.tokens.len() as u64, sha256: hex(&h.finalize()) }
            })
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            bytes: s.bytes,
            sha256: s.sha256,
            unit: if jsonl { "rows" } else { "lines" }.into(),
            rows: s.rows,
            rows_sha256: s.rows_sha256,
            rows_sum: format!("{:032x}", s.rows_sum),
            shards,
        })
    }

    /// How the data read now (`self`) differs from `then`, the checkpoint's record, in words; `None`
    /// where the run would read the same data (JSONL: the same rows in the same order, blank
    /// lines aside).
    pub(crate) fn changes_since(&self, then: &DataRecord) -> Result<Option<String>, TrainError> {
        let unit = &self.unit;
        let same_rows = self.rows_sha256 == then.rows_sha256 && self.rows == then.rows;
        if self.sha256 != then.sha256 {
            if same_rows && unit == "rows" {
                tracing::info!(path = %self.path.display(), "the data file changed in blank lines only: the same rows");
            } else if same_rows {
                return Ok(Some(format!("its blank lines changed ({} bytes then, {} now)", then.bytes, self.bytes)));
            } else if self.rows == then.rows && self.rows_sum == then.rows_sum {
                return Ok(Some(format!("the same {} in another order (shuffled)", count(self.rows, unit))));
            } else if self.rows == then.rows {
                return Ok(Some(format!(
                    "{} then and now, but their content changed ({unit} edited or replaced; sha256 {} then, {} now)",
                    count(self.rows, unit),
                    then.sha256,
                    self.sha256
                )));
            } else {
                return Ok(Some(self.count_change(then)?));
            }
        }
        let (ours, theirs) = (&self.shards, &then.shards);
        if !theirs.is_empty() && ours != theirs {
            let described = |s: &[ShardRecord]| {
                s.iter()
                    .map(|s| format!("{} {} tokens, sha256 {}", s.name, s.tokens, s.sha256))
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            return Ok(Some(format!(
                "the file is the same, but its token shards differ (the tokenizer changed?): {} then, {} now",
                described(theirs),
                described(ours)
            )));
        }
        Ok(None)
    }

    /// The words for a change in the number of rows: added at the end (the earlier ones as they
    /// were), or otherwise more or fewer.
    fn count_change(&self, then: &DataRecord) -> Result<String, TrainError> {
        let (unit, old, new) = (&self.unit, then.rows, self.rows);
        let head = format!("{} then, {new} now", count(old, unit));
        if new < old {
            return Ok(format!("{head} ({} removed, or {unit} edited as well)", count(old - new, unit)));
        }
        // Read again for the sum of the first `old` rows: are they the checkpoint's?
        let s = scan(&self.path, Some(old))?;
        let kept = s.prefix_sum.is_some_and(|p| format!("{p:032x}") == then.rows_sum);
        Ok(if kept {
            format!("{head} ({} added at the end, the first {old} as they were)", count(new - old, unit))
        } else {
            format!("{head} ({} more, and the earlier {unit} changed too)", count(new - old, unit))
        })
    }
}

/// `1 row`, `3 rows` (`unit` is the plural).
fn count(n: u64, unit: &str) -> String {
    match n {
        1 => format!("1 {}", unit.strip_suffix('s').unwrap_or(unit)),
        n => format!("{n} {unit}"),
    }
}

impl BaseRecord {
    /// The weights files of `source` with their sizes and digests: a GGUF file; a Hugging Face
    /// folder's `*.safetensors`; a run's checkpoint's weights (its `model.safetensors`, or a LoRA
    /// run's `adapter.safetensors`, whose own base is checked when it is loaded).
    pub(crate) fn of(source: &InitSource) -> Result<Self, TrainError> {
        let files = Self::paths(source)?
            .iter()
            .map(|path| {
                let (bytes, modified_ns) = stamp(path)?;
                let sha256 = ember_data::fetch::sha256_file(path)?;
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                Ok(FileDigest { name, bytes, sha256, modified_ns })
            })
            .collect::<Result<_, TrainError>>()?;
        Ok(Self { source: source.to_string(), files })
    }

    /// Whether the source's files are `then`'s by name, size and modification time (then they are
    /// taken as the same, unread: a multi-GB base is not hashed at every load).
    pub(crate) fn same_stamps(source: &InitSource, then: &BaseRecord) -> bool {
        let Ok(paths) = Self::paths(source) else { return false };
        paths.len() == then.files.len()
            && paths.iter().zip(&then.files).all(|(path, old)| {
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let same = |(bytes, modified): (u64, Option<u128>)| {
                    bytes == old.bytes && modified.is_some() && modified == old.modified_ns
                };
                name == old.name && stamp(path).is_ok_and(same)
            })
    }

    /// The weights files of `source`, in a fixed order.
    fn paths(source: &InitSource) -> Result<Vec<PathBuf>, TrainError> {
        Ok(match source {
            InitSource::Gguf(path) => vec![path.clone()],
            InitSource::Hf(dir) => {
                let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                    .map_err(TrainError::io(dir))?
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
                    .collect();
                files.sort();
                files
            }
            InitSource::Run(dir) => {
                let dir = resolve(dir)?;
                [MODEL_FILE, ADAPTER_FILE].iter().map(|f| dir.join(f)).filter(|p| p.is_file()).collect()
            }
        })
    }

    /// How the base now (`self`) differs from `then`, in words; `None` where its files are the same.
    pub(crate) fn changes_since(&self, then: &BaseRecord) -> Option<String> {
        let single = self.files.len() == 1 && then.files.len() == 1;
        for old in &then.files {
            let Some(new) = self.files.iter().find(|f| f.name == old.name || single) else {
                return Some(format!("{} is gone", old.name));
            };
            if new.sha256 != old.sha256 {
                let file = if single { String::new() } else { format!("{}: ", old.name) };
                let size = if new.bytes != old.bytes {
                    format!(", {} bytes then, {} now", old.bytes, new.bytes)
                } else {
                    String::new()
                };
                return Some(format!("{file}sha256 {} then, {} now{size}", old.sha256, new.sha256));
            }
        }
        let added: Vec<&str> = self
            .files
            .iter()
            .filter(|f| !then.files.iter().any(|o| o.name == f.name))
            .map(|f| f.name.as_str())
            .collect();
        (!added.is_empty()).then(|| format!("{} is new", added.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(dir: &Path, name: &str, text: &str) -> DataRecord {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        DataRecord::of(&path, true, &[]).unwrap()
    }

    #[test]
    fn data_changes_are_told_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let then = record(dir.path(), "d.jsonl", "{\"a\": 1}\n{\"a\": 2}\r\n{\"a\": 3}\n");
        assert_eq!((then.rows, then.unit.as_str()), (3, "rows"));
        let change = |text: &str| record(dir.path(), "d.jsonl", text).changes_since(&then).unwrap();
        // The same rows, blank lines aside: nothing to tell.
        assert_eq!(change("{\"a\": 1}\n\n{\"a\": 2}\n{\"a\": 3}\n  \n"), None);
        let added = change("{\"a\": 1}\n{\"a\": 2}\n{\"a\": 3}\n{\"a\": 4}\n").unwrap();
        assert_eq!(added, "3 rows then, 4 now (1 row added at the end, the first 3 as they were)");
        let more = change("{\"a\": 0}\n{\"a\": 2}\n{\"a\": 3}\n{\"a\": 4}\n").unwrap();
        assert!(more.contains("1 row more, and the earlier rows changed too"), "{more}");
        let removed = change("{\"a\": 1}\n{\"a\": 3}\n").unwrap();
        assert!(removed.starts_with("3 rows then, 2 now (1 row removed"), "{removed}");
        let shuffled = change("{\"a\": 3}\n{\"a\": 1}\n{\"a\": 2}\n").unwrap();
        assert_eq!(shuffled, "the same 3 rows in another order (shuffled)");
        let edited = change("{\"a\": 1}\n{\"a\": 5}\n{\"a\": 3}\n").unwrap();
        assert!(
            edited.starts_with("3 rows then and now, but their content changed (rows edited or replaced"),
            "{edited}"
        );
        // Text: a blank line is part of the stream.
        let path = dir.path().join("t.txt");
        std::fs::write(&path, "a\nb\n").unwrap();
        let text = DataRecord::of(&path, false, &[]).unwrap();
        std::fs::write(&path, "a\n\nb\n").unwrap();
        let now = DataRecord::of(&path, false, &[]).unwrap();
        assert!(now.changes_since(&text).unwrap().unwrap().contains("blank lines changed"));
        // The same file, other tokens.
        let shard = |ids: Vec<u32>| {
            vec![("train.bin".to_string(), std::sync::Arc::new(ember_data::TokenShard { tokens: ids, vocab_size: 9 }))]
        };
        let a = DataRecord::of(&path, false, &shard(vec![1, 2])).unwrap();
        let b = DataRecord::of(&path, false, &shard(vec![1, 3])).unwrap();
        assert!(b.changes_since(&a).unwrap().unwrap().contains("token shards differ"), "{b:?}");
        assert_eq!(a.changes_since(&a).unwrap(), None);
    }

    #[test]
    fn a_changed_base_file_is_named_with_both_digests() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, "weights").unwrap();
        let source = InitSource::Gguf(path.clone());
        let then = BaseRecord::of(&source).unwrap();
        assert_eq!(then.changes_since(&then), None);
        std::fs::write(&path, "weighty").unwrap();
        let now = BaseRecord::of(&source).unwrap();
        let change = now.changes_since(&then).unwrap();
        assert_eq!(change, format!("sha256 {} then, {} now", then.files[0].sha256, now.files[0].sha256));
    }
}
