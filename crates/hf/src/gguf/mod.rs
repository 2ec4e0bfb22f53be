//! GGUF, llama.cpp's model file: reading (header, metadata, tensor infos, aligned data) and writing.
//!
//! ```text
//! magic "GGUF" | version u32 (2, 3) | tensor count u64 | metadata count u64
//! metadata:  key (u64 length + UTF-8) | value type u32 | value (arrays: item type u32, count u64, items)
//! tensors:   name | n_dims u32 | dims u64 × n_dims (dims[0] varies fastest) | ggml type u32 | offset u64
//! padding to `general.alignment` (default 32), then the data; each tensor at its offset, aligned
//! ```
//!
//! Every count, length and offset is checked against the bytes that remain before anything is
//! allocated, so a truncated or hostile file is an error that names it, never an abort. A metadata
//! key or tensor name twice, and tensors whose data overlap, are errors too: no reader's choice of
//! which one wins, no tensor reading another's bytes. [`Meta`] reads values by type, so that a value
//! of the wrong type or a NaN is an error that names the key, never a default.

mod export;
pub mod hparams;
pub mod model;
pub mod quant;
pub mod tokenizer;
mod value;
mod write;

use ember_data::FileBytes;
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

pub use quant::GgmlType;
pub use value::{Meta, Value};
pub use write::{encode, TensorOut};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// The largest `general.alignment` read: a page of 1 MiB, past any real file's (llama.cpp writes 32).
const MAX_ALIGNMENT: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}: not a GGUF file: {message}", path.display())]
    Format { path: PathBuf, message: String },
    #[error("{}: tensor `{name}` is stored as {kind}, which ember cannot read (it reads {})", path.display(), GgmlType::all_names())]
    Unsupported { path: PathBuf, name: String, kind: String },
    #[error("{}: metadata `{key}`: {message}", path.display())]
    Metadata { path: PathBuf, key: String, message: String },
    /// A tensor whose name is none of the architecture's (whatever its type).
    #[error(
        "{}: tensor `{name}` is not a tensor of llama.cpp's `{arch}` architecture that ember knows (an unknown name; \
         the file is damaged or was written for another model)",
        path.display()
    )]
    UnknownTensor { path: PathBuf, name: String, arch: &'static str },
    /// A value of another type than the key's: not taken for a missing one.
    #[error("{}: metadata `{key}` has type {found}, expected {expected}", path.display())]
    WrongType { path: PathBuf, key: String, found: String, expected: &'static str },
    /// A NaN or infinite hyper-parameter, which no default may stand in for.
    #[error("{}: metadata `{key}` is {value}, not a finite number", path.display())]
    NonFinite { path: PathBuf, key: String, value: f64 },
    /// A metadata key or tensor name twice: readers disagree on which one wins.
    #[error("{}: {what} `{name}` appears twice (the file is damaged or its writer is broken)", path.display())]
    Duplicate { path: PathBuf, what: &'static str, name: String },
    /// Two tensors whose data share bytes: each would read the other's values.
    #[error(
        "{}: the data of tensors `{first}` (bytes {first_range:?}) and `{second}` (bytes {second_range:?}) overlap",
        path.display()
    )]
    Overlap {
        path: PathBuf,
        first: String,
        first_range: std::ops::Range<usize>,
        second: String,
        second_range: std::ops::Range<usize>,
    },
    /// A path that is neither a regular file nor a folder (a FIFO, a socket, a device), never opened.
    #[error("{}: is {kind}, not a regular file (a GGUF model) or a folder (a Hugging Face model)", path.display())]
    NotAFile { path: PathBuf, kind: &'static str },
}

/// Where a tensor's bytes are, and what they are.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest (a `[out, in]` matrix is `[in, out]` here).
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    /// From the start of the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    pub fn num_values(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major (PyTorch, safetensors) order: the dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A GGUF file in memory.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// The whole file, mapped (or read, for bytes made in memory), shared with the weights kept in
    /// their stored types ([`Self::stored`]).
    bytes: std::sync::Arc<FileBytes>,
}

/// A cursor over the file's bytes that checks every read against what remains.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, message: String) -> GgufError {
        GgufError::Format { path: self.path.into(), message: format!("at byte {}: {message}", self.at) }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let left = (self.bytes.len() - self.at) as u64;
        if n > left {
            return Err(self.err(format!("{what} needs {n} bytes, only {left} remain (truncated?)")));
        }
        let s = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }

    /// The smallest encoding of a value of type `ty` (for bounding array counts).
    fn min_size(ty: u32) -> u64 {
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10 | 11 | 12 => 8,
            9 => 12,
            _ => 1,
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        let w = |r: &mut Self, n| r.take(n, key);
        Ok(match ty {
            0 => Value::U8(w(self, 1)?[0]),
            1 => Value::I8(w(self, 1)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(w(self, 2)?.try_into().expect("2"))),
            3 => Value::I16(i16::from_le_bytes(w(self, 2)?.try_into().expect("2"))),
            4 => Value::U32(u32::from_le_bytes(w(self, 4)?.try_into().expect("4"))),
            5 => Value::I32(i32::from_le_bytes(w(self, 4)?.try_into().expect("4"))),
            6 => Value::F32(f32::from_le_bytes(w(self, 4)?.try_into().expect("4"))),
            7 => Value::Bool(w(self, 1)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(self.err(format!("metadata `{key}`: arrays nested too deep")));
                }
                let item = self.u32(key)?;
                let count = self.u64(key)?;
                let left = (self.bytes.len() - self.at) as u64;
                if count.saturating_mul(Self::min_size(item)) > left {
                    return Err(self.err(format!(
                        "metadata `{key}`: an array of {count} items cannot fit in the {left} bytes that remain"
                    )));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(w(self, 8)?.try_into().expect("8"))),
            12 => Value::F64(f64::from_le_bytes(w(self, 8)?.try_into().expect("8"))),
            other => return Err(self.err(format!("metadata `{key}` has unknown value type {other}"))),
        })
    }

    /// `n_kv` metadata entries; a key twice is an error.
    fn metadata(&mut self, n_kv: u64) -> Result<BTreeMap<String, Value>, GgufError> {
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = self.string("a metadata key")?;
            let ty = self.u32(&key)?;
            let value = self.value(ty, &key, 0)?;
            match metadata.entry(key) {
                Entry::Occupied(e) => {
                    let name = e.key().clone();
                    return Err(GgufError::Duplicate { path: self.path.into(), what: "metadata key", name });
                }
                Entry::Vacant(e) => drop(e.insert(value)),
            }
        }
        Ok(metadata)
    }

    /// `n_tensors` tensor infos as stored: name, dims, ggml type id, offset; a name twice is an error.
    fn tensor_infos(&mut self, n_tensors: u64) -> Result<Vec<(String, Vec<u64>, u32, u64)>, GgufError> {
        let mut infos = Vec::with_capacity(n_tensors as usize);
        let mut names = HashSet::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = self.string("a tensor name")?;
            if !names.insert(name.clone()) {
                return Err(GgufError::Duplicate { path: self.path.into(), what: "tensor", name });
            }
            let n_dims = self.u32(&name)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(self.err(format!("tensor `{name}` has {n_dims} dimensions (1 to 4 expected)")));
            }
            let dims = (0..n_dims).map(|_| self.u64(&name)).collect::<Result<Vec<_>, _>>()?;
            let kind_id = self.u32(&name)?;
            let offset = self.u64(&name)?;
            infos.push((name, dims, kind_id, offset));
        }
        Ok(infos)
    }

    /// Where each tensor's bytes are, the data starting at the next multiple of `alignment`:
    /// every tensor of a type ember reads, whole blocks, aligned and inside the file.
    fn place(&self, infos: Vec<(String, Vec<u64>, u32, u64)>, alignment: u64) -> Result<Vec<TensorInfo>, GgufError> {
        let size = self.bytes.len();
        let data_start = self.at as u64 + (alignment - self.at as u64 % alignment) % alignment;
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dims, kind_id, offset) in infos {
            let kind = GgmlType::from_id(kind_id).map_err(|kind| GgufError::Unsupported {
                path: self.path.into(),
                name: name.clone(),
                kind: kind.to_string(),
            })?;
            let per = kind.block().0 as u64;
            if dims[0] % per != 0 {
                let (first, kind) = (dims[0], kind.name());
                let message = format!(
                    "tensor `{name}`: dims {dims:?}: the first, {first}, is not a whole number of {kind} blocks of \
                     {per} values"
                );
                return Err(self.err(message));
            }
            // With the first dimension whole blocks, only an overflow leaves no byte count.
            let n = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let Some(len) = n.and_then(|n| kind.bytes_for(n)) else {
                let (kind, what) = (kind.name(), if n.is_none() { "values" } else { "bytes" });
                let message = format!(
                    "tensor `{name}`: dims {dims:?} are too large: their {what} as {kind} overflow a 64-bit count"
                );
                return Err(self.err(message));
            };
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(len));
            if offset % alignment != 0 || end.is_none_or(|e| e > size as u64) {
                return Err(self.err(format!(
                    "tensor `{name}`: {len} bytes at offset {offset} run past the end of the file ({size} bytes) or are misaligned"
                )));
            }
            let start = start.expect("checked") as usize;
            tensors.push(TensorInfo { name, dims, kind, start, len: len as usize });
        }
        Ok(tensors)
    }
}

impl GgufFile {
    /// Reads and checks a whole GGUF file: header, metadata, tensor infos, and that every tensor's
    /// bytes lie inside the file. Tensor data is not decoded here.
    ///
    /// The file is mapped, not read: its pages come in as the weights touch them, and a weight
    /// kept in its stored type reads them in place. As with llama.cpp's mapping, the file must not
    /// be truncated or rewritten while a model made from it runs (ember's own exports write a new
    /// file and rename it over the old one, which leaves the mapped one intact).
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        // A folder, a FIFO, a socket or a device is refused before it is read (a FIFO would block);
        // an empty file, or one that cannot be mapped (some network file systems), is read (and an
        // empty one refused by the parser).
        let bytes = FileBytes::open(path).map_err(|err| GgufError::Io { path: path.into(), err })?;
        Self::parse_shared(std::sync::Arc::new(bytes), path)
    }

    /// A GGUF file made in memory.
    pub fn parse(bytes: Vec<u8>, path: &Path) -> Result<Self, GgufError> {
        Self::parse_shared(std::sync::Arc::new(FileBytes::in_memory(bytes)), path)
    }

    fn parse_shared(shared: std::sync::Arc<FileBytes>, path: &Path) -> Result<Self, GgufError> {
        let bytes: &[u8] = (*shared).as_ref();
        let mut r = Reader { bytes, at: 0, path };
        let magic = r.take(4, "the magic")?;
        if magic != MAGIC {
            return Err(r.err(format!("magic is {magic:?}, expected \"GGUF\"")));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!("version {version}; ember reads GGUF versions 2 and 3")));
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        let left = (bytes.len() - r.at) as u64;
        // Each entry takes at least 12 bytes (a key length and a type); each tensor info 24.
        if n_kv.saturating_mul(12) > left || n_tensors.saturating_mul(24) > left {
            return Err(r.err(format!(
                "{n_kv} metadata entries and {n_tensors} tensors cannot fit in the {left} bytes of the file"
            )));
        }
        let metadata = r.metadata(n_kv)?;
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let refuse = |message: String| GgufError::Metadata {
                    path: path.into(),
                    key: "general.alignment".into(),
                    message,
                };
                match v.as_u64() {
                    Some(a) if a > 0 && a.is_power_of_two() && a <= MAX_ALIGNMENT => a,
                    Some(a) if a.is_power_of_two() => {
                        return Err(refuse(format!(
                            "{a} is too large: ember reads alignments up to {MAX_ALIGNMENT} bytes (llama.cpp writes 32)"
                        )))
                    }
                    Some(a) => return Err(refuse(format!("{a} is not a power of two"))),
                    None => return Err(refuse(format!("{v:?} is not an unsigned integer"))),
                }
            }
        };
        let infos = r.tensor_infos(n_tensors)?;
        let tensors = r.place(infos, alignment)?;
        check_disjoint(&tensors, path)?;
        Ok(Self { path: path.into(), version, metadata, tensors, bytes: shared })
    }

    /// The metadata, read by type.
    pub fn meta(&self) -> Meta<'_> {
        Meta { path: &self.path, map: &self.metadata }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// An error about metadata `key` (or a tensor of that name) of this file.
    pub(crate) fn meta_err(&self, key: &str, message: impl Into<String>) -> GgufError {
        GgufError::Metadata { path: self.path.clone(), key: key.into(), message: message.into() }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's raw (possibly quantized) bytes.
    pub fn raw(&self, t: &TensorInfo) -> &[u8] {
        &(*self.bytes).as_ref()[t.start..t.start + t.len]
    }

    /// A tensor's raw bytes as a view of the file's buffer, shared (not copied): what a weight kept
    /// in its stored type holds. The buffer lives as long as one view does.
    pub fn stored(&self, t: &TensorInfo) -> ember_kernels::quant::StoredBytes {
        ember_kernels::quant::StoredBytes::view(self.bytes.clone(), t.start..t.start + t.len)
    }

    /// Lets the pages of tensor `t`'s bytes go from this process's memory once what was made from
    /// them no longer reads them (a weight copied into another layout, a tensor dequantized): a
    /// mapped file's pages would otherwise count until the mapping ends. They come back from the
    /// file if read again. Nothing happens to bytes made in memory.
    pub fn release(&self, t: &TensorInfo) {
        self.release_range(t, 0..t.len);
    }

    /// [`Self::release`] for bytes `range` of tensor `t`'s only.
    pub fn release_range(&self, t: &TensorInfo, range: std::ops::Range<usize>) {
        // Whole pages inside those bytes only: their neighbours' stay.
        self.bytes.release(t.start + range.start.min(t.len)..t.start + range.end.min(t.len));
    }

    /// A tensor dequantized to f32, in row-major order of [`TensorInfo::shape`]; its bytes are let
    /// go after ([`Self::release`]).
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        let mut out = vec![0f32; t.num_values() as usize];
        quant::dequantize(t.kind, self.raw(t), &mut out);
        self.release(t);
        out
    }
}

/// Refuses tensors whose data share bytes (empty tensors share none): sorted by start, each must
/// begin at or after the furthest end before it.
fn check_disjoint(tensors: &[TensorInfo], path: &Path) -> Result<(), GgufError> {
    let mut by_start: Vec<&TensorInfo> = tensors.iter().filter(|t| t.len > 0).collect();
    by_start.sort_by_key(|t| t.start);
    let range = |t: &TensorInfo| t.start..t.start + t.len;
    let mut furthest: Option<&TensorInfo> = None;
    for t in by_start {
        if let Some(f) = furthest.filter(|f| f.start + f.len > t.start) {
            return Err(GgufError::Overlap {
                path: path.into(),
                first: f.name.clone(),
                first_range: range(f),
                second: t.name.clone(),
                second_range: range(t),
            });
        }
        if furthest.is_none_or(|f| t.start + t.len > f.start + f.len) {
            furthest = Some(t);
        }
    }
    Ok(())
}

/// Whether `path` is a GGUF file: a regular file (or a link to one) whose first four bytes are
/// "GGUF", whatever its name. A folder or a path that does not exist is not (the Hugging Face
/// reader says what is wrong with it). Anything else — a FIFO, a socket, a device — is an error
/// that says what it is, and is never opened (opening a FIFO blocks until a writer comes).
pub fn is_gguf(path: &Path) -> Result<bool, GgufError> {
    use std::io::Read;
    let Ok(meta) = std::fs::metadata(path) else { return Ok(false) };
    if let Some(kind) = ember_data::special_file(meta.file_type()) {
        return Err(GgufError::NotAFile { path: path.into(), kind });
    }
    if meta.is_dir() {
        return Ok(false);
    }
    let io = |err| GgufError::Io { path: path.into(), err };
    let mut magic = [0u8; 4];
    let mut file = ember_data::open_file(path).map_err(io)?;
    match file.read_exact(&mut magic) {
        Ok(()) => Ok(&magic == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let meta = vec![
            ("general.architecture".to_string(), Value::String("llama".into())),
            ("llama.block_count".to_string(), Value::U32(2)),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            ),
        ];
        let values: Vec<f32> = (0..64).map(|i| i as f32 / 10.0).collect();
        let tensors = vec![
            TensorOut {
                name: "x".into(),
                shape: vec![2, 32],
                kind: GgmlType::Q8_0,
                data: quant::quantize(GgmlType::Q8_0, &values).unwrap(),
            },
            TensorOut {
                name: "y".into(),
                shape: vec![3],
                kind: GgmlType::F32,
                data: quant::quantize(GgmlType::F32, &[1.0, 2.0, 3.0]).unwrap(),
            },
        ];
        encode(&meta, &tensors)
    }

    #[test]
    fn encode_then_parse() {
        let f = GgufFile::parse(sample(), Path::new("t.gguf")).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.get("llama.block_count").and_then(Value::as_u64), Some(2));
        assert_eq!(f.tensor("x").unwrap().shape(), vec![2, 32]);
        assert_eq!(f.dequantize(f.tensor("y").unwrap()), vec![1.0, 2.0, 3.0]);
        assert_eq!(f.tensor("x").unwrap().start % 32, 0);
    }

    #[test]
    fn damaged_files_are_errors_that_say_why() {
        let good = sample();
        let err = |bytes: Vec<u8>| GgufFile::parse(bytes, Path::new("t.gguf")).err().expect("an error").to_string();
        assert!(err(b"GGML1234".to_vec()).contains("magic"), "bad magic");
        assert!(err(good[..good.len() - 24].to_vec()).contains("run past the end"), "truncated data");
        let e = err(good[..30].to_vec());
        assert!(e.contains("cannot fit") || e.contains("remain"), "truncated header: {e}");
        let e = err(good[..100].to_vec());
        assert!(e.contains("cannot fit") || e.contains("remain"), "truncated metadata: {e}");
        let mut v = good.clone();
        v[4] = 9;
        assert!(err(v).contains("version 9"));
        // Absurd counts are refused before anything is allocated for them.
        let mut v = good.clone();
        v[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(v).contains("cannot fit"));
        let mut v = good.clone();
        v[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(err(v).contains("cannot fit"));
        // An array whose count exceeds the file.
        let at = good.windows(21).position(|w| w == b"tokenizer.ggml.tokens").unwrap() + 21 + 4 + 4;
        let mut v = good.clone();
        v[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(err(v).contains("array of"), "huge array");
        // An unknown quantization is named.
        let at = good.windows(9).position(|w| w == b"\x01\0\0\0\0\0\0\0y").unwrap() + 9;
        let mut v = good.clone();
        let kind_at = at + 4 + 8;
        v[kind_at..kind_at + 4].copy_from_slice(&23u32.to_le_bytes());
        let e = err(v);
        assert!(e.contains("IQ4_XS") && e.contains("Q5_K"), "names the type and what ember reads: {e}");
    }

    /// The byte offset of tensor `name`'s info (its `n_dims`) in `bytes`.
    fn info_at(bytes: &[u8], name: &str) -> usize {
        let mut needle = (name.len() as u64).to_le_bytes().to_vec();
        needle.extend_from_slice(name.as_bytes());
        bytes.windows(needle.len()).position(|w| w == needle).expect("tensor info") + needle.len()
    }

    #[test]
    fn overlapping_and_duplicate_tensors_and_keys_are_refused_by_name() {
        let err = |bytes: Vec<u8>| GgufFile::parse(bytes, Path::new("t.gguf")).err().expect("an error").to_string();
        let good = sample();
        // `x` (Q8_0 [2, 32]: 68 bytes at 0) and `y` (12 bytes at 96): `y` moved to 64 overlaps `x`.
        let offset_at = info_at(&good, "y") + 4 + 8 + 4;
        let mut v = good.clone();
        v[offset_at..offset_at + 8].copy_from_slice(&64u64.to_le_bytes());
        let e = err(v);
        let x = GgufFile::parse(good.clone(), Path::new("t.gguf")).unwrap().tensor("x").unwrap().start;
        let (x_bytes, y_bytes) = (format!("`x` (bytes {x}..{})", x + 68), format!("`y` (bytes {}..", x + 64));
        assert!(e.contains("t.gguf") && e.contains(&x_bytes) && e.contains(&y_bytes), "{e}");
        assert!(e.contains("overlap"), "{e}");
        // Both at the same offset, whichever comes first in the file.
        let mut v = good.clone();
        v[offset_at..offset_at + 8].copy_from_slice(&0u64.to_le_bytes());
        assert!(err(v).contains("overlap"));
        // `y` renamed `x`.
        let mut v = good.clone();
        let name_at = info_at(&good, "y") - 1;
        v[name_at] = b'x';
        let e = err(v);
        assert!(e.contains("t.gguf") && e.contains("tensor `x` appears twice"), "{e}");
        // A metadata key twice: the later one does not silently win.
        let meta = [("a.b".to_string(), Value::U32(1)), ("a.b".to_string(), Value::U32(2))];
        let e = err(encode(&meta, &[]));
        assert!(e.contains("t.gguf") && e.contains("metadata key `a.b` appears twice"), "{e}");
    }

    /// Issue 57: dimensions whose product overflows are said to be too large (they were "not a
    /// whole number of F32 blocks"); an alignment of 2^40 is too large (it was "not a power of
    /// two"), one of 48 is not a power of two.
    #[test]
    fn overflowing_dims_and_alignments_are_named_for_what_they_are() {
        let err = |bytes: Vec<u8>| GgufFile::parse(bytes, Path::new("t.gguf")).err().expect("an error").to_string();
        let good = sample();
        // `y`: F32, one dim; 2^63 values fit in 64 bits, their 2^65 bytes do not.
        let dims_at = info_at(&good, "y") + 4;
        let mut v = good.clone();
        v[dims_at..dims_at + 8].copy_from_slice(&(1u64 << 63).to_le_bytes());
        let e = err(v);
        assert!(e.contains("tensor `y`: dims [9223372036854775808] are too large"), "{e}");
        assert!(e.contains("bytes as F32 overflow") && !e.contains("whole number"), "{e}");
        // `x`: Q8_0 [32, 2] in ggml order; 32 · 2^62 values overflow.
        let dims_at = info_at(&good, "x") + 4;
        let mut v = good.clone();
        v[dims_at + 8..dims_at + 16].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let e = err(v);
        assert!(e.contains("tensor `x`: dims [32, 4611686018427387904] are too large: their values"), "{e}");
        // A first dimension that is no whole number of blocks is still said so.
        let mut v = good.clone();
        v[dims_at..dims_at + 8].copy_from_slice(&33u64.to_le_bytes());
        let e = err(v);
        assert!(e.contains("the first, 33, is not a whole number of Q8_0 blocks of 32 values"), "{e}");
        let aligned = |a: Value| {
            let meta = [("general.alignment".to_string(), a)];
            err(encode(&meta, &[]))
        };
        let e = aligned(Value::U64(1 << 40));
        assert!(e.contains("`general.alignment`: 1099511627776 is too large") && e.contains("up to 1048576"), "{e}");
        assert!(!e.contains("power of two"), "{e}");
        let e = aligned(Value::U32(48));
        assert!(e.contains("`general.alignment`: 48 is not a power of two"), "{e}");
        let e = aligned(Value::String("32".into()));
        assert!(e.contains("`general.alignment`") && e.contains("not an unsigned integer"), "{e}");
    }

    /// Issue 57: opening a FIFO, a folder or a device as a GGUF file is refused at once (a FIFO
    /// hung `init_from = "gguf:FIFO"`), through `ember_data::open_file`.
    #[test]
    fn special_files_are_refused_unopened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe.gguf");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let (tx, rx) = std::sync::mpsc::channel();
        let paths = [fifo, dir.path().to_path_buf(), PathBuf::from("/dev/zero")];
        std::thread::spawn(move || {
            for p in paths {
                tx.send(GgufFile::open(&p).err().map(|e| e.to_string())).unwrap();
            }
        });
        let next = || rx.recv_timeout(std::time::Duration::from_secs(20)).expect("refused at once, not hung");
        let e = next().expect("a FIFO is refused");
        assert!(e.contains("pipe.gguf: is a FIFO (named pipe), not a regular file"), "{e}");
        let e = next().expect("a folder is refused");
        assert!(e.contains("is a folder, not a file"), "{e}");
        let e = next().expect("a device is refused");
        assert!(e.contains("/dev/zero: is a device, not a regular file"), "{e}");
    }

    #[test]
    fn gguf_is_told_by_its_magic_not_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, bytes: &[u8]| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            p
        };
        assert!(is_gguf(&file("model.bin", &sample())).unwrap());
        assert!(!is_gguf(&file("model.gguf", b"not a model")).unwrap());
        assert!(!is_gguf(&file("short.gguf", b"GG")).unwrap());
        assert!(!is_gguf(dir.path()).unwrap());
        assert!(!is_gguf(&dir.path().join("absent")).unwrap());
        let fifo = dir.path().join("pipe.gguf");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let e = is_gguf(&fifo).expect_err("a FIFO is refused unopened").to_string();
        assert!(e.contains("pipe.gguf") && e.contains("FIFO"), "{e}");
    }
}
