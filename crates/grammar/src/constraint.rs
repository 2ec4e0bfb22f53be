//! One sequence's grammar state as ember's [`Constraint`]: llguidance's matcher, its masks cut to
//! the model's vocabulary, every end id allowed where the grammar may end.

use std::sync::Arc;

use ember_generate::constraint::{allows, Constraint, ConstraintError};
use llguidance::Matcher;

/// A grammar constraint over one sequence (see [`crate::Grammars::constraint`]).
pub struct GrammarConstraint {
    matcher: Matcher,
    /// The last mask, `vocab_size` bits (rounded up to whole words, the spare bits clear).
    mask: Vec<u32>,
    end_ids: Arc<[u32]>,
    vocab_size: usize,
}

impl GrammarConstraint {
    pub(crate) fn new(matcher: Matcher, end_ids: Arc<[u32]>, vocab_size: usize) -> Result<Self, ConstraintError> {
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(e));
        }
        Ok(Self { matcher, mask: vec![0; vocab_size.div_ceil(32)], end_ids, vocab_size })
    }

    /// The bytes the grammar forces next (empty where the model has a choice): what a caller may
    /// show, or test, without drawing.
    pub fn forced_bytes(&mut self) -> Vec<u8> {
        self.matcher.compute_ff_bytes()
    }
}

fn failed(e: impl std::fmt::Display) -> ConstraintError {
    ConstraintError(format!("{e:#}"))
}

impl Constraint for GrammarConstraint {
    fn mask(&mut self) -> Result<&[u32], ConstraintError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(failed)?;
        // The trie covers at least `vocab_size` ids: ids past the model's are cut off here.
        let words = allowed.as_slice();
        let n = self.mask.len();
        self.mask.copy_from_slice(&words[..n]);
        if !self.vocab_size.is_multiple_of(32) {
            self.mask[n - 1] &= (1u32 << (self.vocab_size % 32)) - 1;
        }
        if self.end_ids.iter().any(|&id| allows(&self.mask, id as usize)) {
            for &id in self.end_ids.iter().filter(|&&id| (id as usize) < self.vocab_size) {
                self.mask[id as usize / 32] |= 1 << (id % 32);
            }
        }
        Ok(&self.mask)
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token).map_err(failed)
    }

    fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
