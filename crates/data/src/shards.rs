//! Token shard files: a 32-byte header, then the token ids, little-endian.
//!
//! ```text
//! offset  size  field
//!      0     8  magic, the bytes "EMBERTOK"
//!      8     4  format version, u32 = 1
//!     12     4  bytes per token, u32: 2 (u16 ids) or 4 (u32 ids)
//!     16     8  number of tokens, u64
//!     24     4  vocabulary size, u32 (every id is below it)
//!     28     4  reserved, 0
//!     32     -  ids, little-endian, `bytes per token` each
//! ```
//! Ids are u16 whenever the vocabulary fits (V <= 65,536), as in nanoGPT's `train.bin`; dropping the
//! header gives exactly that file.

use std::path::Path;

use crate::error::{DataError, Result};

pub const MAGIC: &[u8; 8] = b"EMBERTOK";
pub const VERSION: u32 = 1;
pub const HEADER_LEN: usize = 32;

/// The ids of one split, in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenShard {
    pub tokens: Vec<u32>,
    pub vocab_size: u32,
}

impl TokenShard {
    /// A shard of `tokens` from a vocabulary of `vocab_size`; an id at or past it (a tokenizer whose
    /// ids have gaps) raises the shard's vocabulary, so that the id width comes from the largest
    /// id and an id is never stored in too few bytes.
    pub fn new(tokens: Vec<u32>, vocab_size: u32) -> Self {
        let largest = tokens.iter().copied().max().map_or(0, |m| m.saturating_add(1));
        Self { tokens, vocab_size: vocab_size.max(largest) }
    }

    pub fn bytes_per_token(&self) -> u32 {
        if self.vocab_size <= 1 << 16 {
            2
        } else {
            4
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let width = self.bytes_per_token();
        let mut out = Vec::with_capacity(HEADER_LEN + self.tokens.len() * width as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&width.to_le_bytes());
        out.extend_from_slice(&(self.tokens.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.vocab_size.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for &t in &self.tokens {
            if width == 2 {
                out.extend_from_slice(&(t as u16).to_le_bytes());
            } else {
                out.extend_from_slice(&t.to_le_bytes());
            }
        }
        out
    }

    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |message: String| DataError::Shard { path: path.into(), message };
        if bytes.len() < HEADER_LEN {
            return Err(bad(format!("{} bytes, shorter than the {HEADER_LEN}-byte header", bytes.len())));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad("missing the EMBERTOK magic".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!("format version {version}, this ember reads {VERSION}")));
        }
        let width = u32_at(12);
        if width != 2 && width != 4 {
            return Err(bad(format!("{width} bytes per token, expected 2 or 4")));
        }
        let n = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let vocab_size = u32_at(24);
        let body = &bytes[HEADER_LEN..];
        if body.len() as u64 != n * width as u64 {
            return Err(bad(format!(
                "header says {n} tokens of {width} bytes, the file holds {} bytes after the header (truncated?)",
                body.len()
            )));
        }
        let tokens: Vec<u32> = if width == 2 {
            body.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect()
        } else {
            body.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t >= vocab_size) {
            return Err(bad(format!("token {i} is {t}, not below the vocabulary size {vocab_size}")));
        }
        Ok(Self { tokens, vocab_size })
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        crate::write_atomic(path, &self.to_bytes())
    }

    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(DataError::io(path))?;
        Self::from_bytes(&bytes, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_width_comes_from_the_largest_id() {
        // A vocabulary of 100 entries whose added token has id 70,000: u16 would store 4,464.
        let shard = TokenShard::new(vec![5, 70_000, 7], 100);
        assert_eq!(shard.vocab_size, 70_001);
        assert_eq!(shard.bytes_per_token(), 4);
        let back = TokenShard::from_bytes(&shard.to_bytes(), Path::new("x.bin")).unwrap();
        assert_eq!(back.tokens, vec![5, 70_000, 7]);
    }

    #[test]
    fn round_trip_in_both_widths() {
        for (tokens, vocab) in [(vec![0, 5, 64, 3], 65u32), (vec![70_000, 1, 100_255], 100_256)] {
            let shard = TokenShard::new(tokens, vocab);
            let bytes = shard.to_bytes();
            assert_eq!(bytes.len(), HEADER_LEN + shard.tokens.len() * shard.bytes_per_token() as usize);
            assert_eq!(TokenShard::from_bytes(&bytes, Path::new("x")).unwrap(), shard);
        }
    }

    #[test]
    fn layout_is_the_documented_one() {
        let bytes = TokenShard::new(vec![258, 1], 300).to_bytes();
        assert_eq!(&bytes[..8], b"EMBERTOK");
        assert_eq!(&bytes[8..32], &[1, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 44, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&bytes[32..], &[2, 1, 1, 0]);
    }

    #[test]
    fn damaged_files_are_errors_that_name_the_file() {
        let good = TokenShard::new(vec![1, 2, 3], 10).to_bytes();
        let p = Path::new("val.bin");
        let e = TokenShard::from_bytes(&good[..good.len() - 1], p).unwrap_err().to_string();
        assert!(e.starts_with("val.bin: not an ember token shard") && e.contains("truncated"), "{e}");
        let e = TokenShard::from_bytes(b"hello", p).unwrap_err().to_string();
        assert!(e.contains("shorter than"), "{e}");
        let mut wrong = good.clone();
        wrong[0] = b'X';
        assert!(TokenShard::from_bytes(&wrong, p).unwrap_err().to_string().contains("magic"));
        let mut out_of_range = good;
        out_of_range[24] = 2; // vocab 2, but token 2 and 3 present
        assert!(TokenShard::from_bytes(&out_of_range, p).unwrap_err().to_string().contains("not below"));
    }
}
