//! OpenAI's adjustments of a row of logits before a draw: `logit_bias`, `presence_penalty` and
//! `frequency_penalty` (over the generated tokens only, as OpenAI and vLLM count them), `min_p`
//! (applied by the sampler after top-p), and a constraint's token mask. They are off by default;
//! a request that uses none of them is sampled from the model's row as it is, without a copy.

use crate::constraint::allows;

/// Adjustments a request may add to its sampler (`Sampler::adjusted`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Adjustments {
    /// Added to the logit of each id, in [-100, 100]; -100 bans the id outright (its logit becomes
    /// -inf, whatever the other logits are), ids past the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted from the logit of every token generated at least once, in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from the logit of every generated token once per time it was generated, in [-2, 2].
    pub frequency_penalty: f32,
    /// Keep only tokens whose probability is at least `min_p` times the most likely one's, in
    /// [0, 1] (after temperature, top-k and top-p).
    pub min_p: Option<f32>,
}

/// A bias that bans its token.
const BAN: f32 = -100.0;

/// An adjustment out of its range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdjustError {
    #[error("logit_bias must be in [-100, 100], found {bias} for token {id}")]
    LogitBias { id: u32, bias: f32 },
    #[error("presence_penalty must be in [-2, 2], found {0}")]
    PresencePenalty(f32),
    #[error("frequency_penalty must be in [-2, 2], found {0}")]
    FrequencyPenalty(f32),
    #[error("min_p must be in [0, 1], found {0}")]
    MinP(f32),
}

impl AdjustError {
    /// The `Adjustments` field the error is about (the request field of the same name).
    pub fn setting(&self) -> &'static str {
        match self {
            Self::LogitBias { .. } => "logit_bias",
            Self::PresencePenalty(_) => "presence_penalty",
            Self::FrequencyPenalty(_) => "frequency_penalty",
            Self::MinP(_) => "min_p",
        }
    }
}

impl Adjustments {
    /// Checks every range (a NaN is in none), so that a bad value is refused before any draw.
    pub fn validate(&self) -> Result<(), AdjustError> {
        if let Some(&(id, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(AdjustError::LogitBias { id, bias });
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(AdjustError::PresencePenalty(self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(AdjustError::FrequencyPenalty(self.frequency_penalty));
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return Err(AdjustError::MinP(p));
        }
        Ok(())
    }

    /// Whether the logits need changing before a draw (min_p acts in the sampler, on the row as it
    /// is).
    pub(crate) fn changes_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Adds the biases to `row` and subtracts the penalties of the `generated` tokens.
    pub(crate) fn apply(&self, row: &mut [f32], generated: &[u32]) {
        for &(id, bias) in &self.logit_bias {
            if let Some(l) = row.get_mut(id as usize) {
                *l = if bias <= BAN { f32::NEG_INFINITY } else { *l + bias };
            }
        }
        if self.presence_penalty == 0.0 && self.frequency_penalty == 0.0 {
            return;
        }
        // Counts by sorting a copy: the generated tokens are few next to the vocabulary.
        let mut sorted = generated.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b) {
            if let Some(l) = row.get_mut(run[0] as usize) {
                *l -= self.presence_penalty + self.frequency_penalty * run.len() as f32;
            }
        }
    }
}

/// Gives every token outside `mask` (a [`Constraint`](crate::constraint::Constraint)'s bit set) a
/// logit of -inf; false when the mask allows no token of the row.
pub(crate) fn apply_mask(row: &mut [f32], mask: &[u32]) -> bool {
    let mut any = false;
    for (i, l) in row.iter_mut().enumerate() {
        if allows(mask, i) {
            any = true;
        } else {
            *l = f32::NEG_INFINITY;
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_follow_openais_formula_on_a_row() {
        let logits = [1.0f32, 2.0, -0.5, 0.25, 3.0];
        let adj = Adjustments {
            logit_bias: vec![(3, 1.5), (9, 5.0)],
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        let generated = [1, 4, 1, 1, 2];
        let mut row = logits.to_vec();
        adj.apply(&mut row, &generated);
        // logit - presence * [count > 0] - frequency * count + bias.
        let counts = [0.0f32, 3.0, 1.0, 0.0, 1.0];
        let bias = [0.0f32, 0.0, 0.0, 1.5, 0.0];
        for i in 0..5 {
            let presence = if counts[i] > 0.0 { 0.5 } else { 0.0 };
            assert_eq!(row[i], logits[i] + bias[i] - presence - 0.25 * counts[i], "token {i}");
        }
        let mut banned = logits.to_vec();
        Adjustments { logit_bias: vec![(4, -100.0)], ..Default::default() }.apply(&mut banned, &[]);
        assert_eq!(banned[4], f32::NEG_INFINITY);
    }

    #[test]
    fn bad_adjustments_name_their_field() {
        for (adj, field) in [
            (Adjustments { logit_bias: vec![(2, 100.5)], ..Default::default() }, "logit_bias"),
            (Adjustments { logit_bias: vec![(2, f32::NAN)], ..Default::default() }, "logit_bias"),
            (Adjustments { presence_penalty: -2.5, ..Default::default() }, "presence_penalty"),
            (Adjustments { frequency_penalty: f32::NAN, ..Default::default() }, "frequency_penalty"),
            (Adjustments { min_p: Some(1.5), ..Default::default() }, "min_p"),
        ] {
            let e = adj.validate().unwrap_err();
            assert_eq!(e.setting(), field, "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        let edges = Adjustments {
            logit_bias: vec![(0, -100.0), (1, 100.0)],
            presence_penalty: 2.0,
            frequency_penalty: -2.0,
            min_p: Some(0.0),
        };
        assert!(edges.validate().is_ok());
    }

    #[test]
    fn a_mask_leaves_only_its_tokens() {
        let mut row = vec![0.5f32; 40];
        assert!(apply_mask(&mut row, &[0b1010, 1 << 3]));
        let kept: Vec<usize> = (0..40).filter(|&i| row[i].is_finite()).collect();
        assert_eq!(kept, vec![1, 3, 35]);
        assert!(!apply_mask(&mut [0.0; 40], &[0, 0]));
        assert!(!apply_mask(&mut [0.0; 4], &[1 << 5]), "a bit past the row allows nothing");
    }
}
