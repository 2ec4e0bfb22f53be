//! What a constrained request may produce: a grammar's token mask, asked for before each draw and
//! told each token drawn. The engine and the batched generator apply it (tokens outside the mask
//! get no probability); `ember-grammar` implements it over llguidance (JSON, JSON Schema, Lark).

/// A constraint on the tokens of one sequence. `Send`: the engine draws on the thread pool.
pub trait Constraint: Send {
    /// The tokens that may come next, as a bit set over the vocabulary (bit `i % 32` of word
    /// `i / 32` is token `i`); tokens past its end are not allowed. An end-of-text token is in the
    /// mask only where the grammar may end there.
    fn mask(&mut self) -> Result<&[u32], ConstraintError>;

    /// Records the token drawn (one the last mask allowed).
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;

    /// True once nothing more may follow (the grammar is complete and ends there): the request
    /// ends as if it had drawn a stop token.
    fn finished(&self) -> bool;
}

/// Why a request ended when its mask and `logit_bias` together left no token: the request's own
/// doing (a server answers it as the client's error), unlike a grammar that fails.
pub const NOTHING_ALLOWED: &str = "no token may come next: the mask and logit_bias allow none";

/// A constraint that cannot go on: the grammar's own words.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("constrained decoding failed: {0}")]
pub struct ConstraintError(pub String);

/// Whether bit `token` of `mask` is set.
pub fn allows(mask: &[u32], token: usize) -> bool {
    mask.get(token / 32).is_some_and(|w| w >> (token % 32) & 1 == 1)
}
