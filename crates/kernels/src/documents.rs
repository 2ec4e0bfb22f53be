//! Document boundaries inside packed rows.
//!
//! Fine-tuning packs several examples into one row of `T` positions. With documents, each example
//! is attended to as if it were alone: its RoPE positions restart at 0 and its queries see only
//! its own earlier keys (block-diagonal causal attention). Without them, attention runs across the
//! examples of a row and positions continue from one to the next.

use std::sync::Arc;

use burn::tensor::{backend::Backend, Bool, Int, Tensor, TensorData};

/// For each position of a `[B, T]` batch, the index (in its row) of its document's first position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    /// `[B·T]`
    first: Arc<[u32]>,
    batch: usize,
    seq: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("document starts of a [{batch}, {seq}] batch: {message}")]
pub struct DocumentsError {
    pub batch: usize,
    pub seq: usize,
    pub message: String,
}

impl Documents {
    /// Checks that `first` describes consecutive documents: `first[i]` is `i` (a document starts)
    /// or `first[i - 1]` (it goes on), row by row.
    pub fn new(first: Vec<u32>, batch: usize, seq: usize) -> Result<Self, DocumentsError> {
        let err = |message: String| DocumentsError { batch, seq, message };
        if first.len() != batch * seq {
            return Err(err(format!("{} entries, expected {}", first.len(), batch * seq)));
        }
        for (b, row) in first.chunks(seq.max(1)).enumerate() {
            for (i, &f) in row.iter().enumerate() {
                let ok = f as usize == i || (i > 0 && f == row[i - 1]);
                if !ok {
                    return Err(err(format!(
                        "row {b}, position {i}: first position {f} is not {i} or {}",
                        row[i.saturating_sub(1)]
                    )));
                }
            }
        }
        Ok(Self { first: first.into(), batch, seq })
    }

    /// The documents whose first positions an [`AttnShape`](crate::AttnShape) carries
    /// (taken from a checked `Documents`).
    pub(crate) fn from_parts(first: Arc<[u32]>, batch: usize, seq: usize) -> Self {
        Self { first, batch, seq }
    }

    /// Rows cut into documents of the given lengths (each row's lengths add up to `seq`).
    pub fn from_lengths(rows: &[Vec<usize>], seq: usize) -> Result<Self, DocumentsError> {
        let mut first = Vec::with_capacity(rows.len() * seq);
        for (b, lens) in rows.iter().enumerate() {
            let total: usize = lens.iter().sum();
            if total != seq {
                let message = format!("row {b}: document lengths add up to {total}, not {seq}");
                return Err(DocumentsError { batch: rows.len(), seq, message });
            }
            let mut at = 0u32;
            for &n in lens {
                first.extend(std::iter::repeat_n(at, n));
                at += n as u32;
            }
        }
        Self::new(first, rows.len(), seq)
    }

    pub fn dims(&self) -> [usize; 2] {
        [self.batch, self.seq]
    }

    /// `[B·T]` first positions, row-major.
    pub fn first_positions(&self) -> &Arc<[u32]> {
        &self.first
    }

    /// The position of every token within its document, plus `start`, row-major `[B·T]`.
    pub fn positions(&self, start: usize) -> Vec<usize> {
        self.first.iter().enumerate().map(|(r, &f)| start + r % self.seq - f as usize).collect()
    }

    /// The attention mask, true where key `j` is hidden from query `i`: in the future, in an earlier
    /// document, or (with a sliding window) `window` or more positions back.
    ///
    /// # Shapes
    /// -> `[B, 1, T, T]`
    pub fn hidden_mask<B: Backend>(&self, window: Option<usize>, device: &B::Device) -> Tensor<B, 4, Bool> {
        let (b, t) = (self.batch, self.seq);
        let first: Vec<i32> = self.first.iter().map(|&f| f as i32).collect();
        let first = Tensor::<B, 1, Int>::from_data(TensorData::new(first, [b * t]), device).reshape([b, 1, t, 1]);
        let pos = Tensor::<B, 1, Int>::arange(0..t as i64, device).reshape([1, 1, t, 1]);
        let key = Tensor::<B, 1, Int>::arange(0..t as i64, device).reshape([1, 1, 1, t]);
        let future = key.clone().greater(pos.clone()); // [1, 1, T, T]
        let before = key.clone().lower(first); //          [B, 1, T, T]
        let hidden = before.bool_or(future.expand([b, 1, t, t]));
        match window {
            Some(w) => hidden.bool_or((key - pos).lower_equal_elem(-(w as i64)).expand([b, 1, t, t])),
            None => hidden,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TestBackend as B;

    #[test]
    fn documents_are_checked_and_give_positions_and_masks() {
        let d = Documents::from_lengths(&[vec![2, 3], vec![5]], 5).unwrap();
        assert_eq!(&d.first_positions()[..], &[0, 0, 2, 2, 2, 0, 0, 0, 0, 0]);
        assert_eq!(d.positions(0), vec![0, 1, 0, 1, 2, 0, 1, 2, 3, 4]);
        let mask = d.hidden_mask::<B>(None, &Default::default()).into_data().to_vec::<bool>().unwrap();
        for b in 0..2 {
            for i in 0..5 {
                for j in 0..5 {
                    let first = d.first_positions()[b * 5 + i] as usize;
                    assert_eq!(mask[(b * 5 + i) * 5 + j], j > i || j < first, "row {b} query {i} key {j}");
                }
            }
        }
        let windowed = d.hidden_mask::<B>(Some(2), &Default::default()).into_data().to_vec::<bool>().unwrap();
        assert!(windowed[(5 + 4) * 5 + 2], "key 2 is two positions back from query 4");
        assert!(!windowed[(5 + 4) * 5 + 3]);
        assert!(Documents::new(vec![0, 1, 1, 0], 1, 4).is_err(), "a start after the document began");
        assert!(Documents::new(vec![0, 0, 1], 1, 3).is_err(), "first position 1 inside a document started at 0");
        assert!(Documents::new(vec![0, 0], 1, 3).is_err(), "length");
    }
}
