//! Data-parallel agreement: every rank runs the same config with the same ember on the same data,
//! and holds the same weights, at the start and at every checkpoint.

use std::fmt;

use ember_data::WindowSampler;
use ember_kernels::TrainBackend;
use ember_model::weights::named_tensors_where;
use ember_model::Decoder;

use super::setup::Setup;
use crate::distributed::{digest, Collective};
use crate::error::TrainError;

/// Where in a run the ranks check that they agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Before the first step of this invocation (fresh or resumed): config, binary, data and weights.
    Start,
    /// At the checkpoint after optimizer step `n`: the weights.
    Step(usize),
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Start => f.write_str("start"),
            Self::Step(n) => write!(f, "step {n}"),
        }
    }
}

/// In a data-parallel run: every rank runs the same config with the same ember on the same data and
/// holds the same weights (a SHA-256 of each), checked at the start and at every checkpoint.
pub(super) fn check_ranks_agree<B: TrainBackend>(
    c: &dyn Collective,
    setup: &Setup,
    model: &Decoder<B>,
    at: Stage,
) -> Result<(), TrainError> {
    if c.world() == 1 {
        return Ok(());
    }
    if at == Stage::Start {
        let version = crate::distributed::code_version();
        let what = format!("the config and the ember binary ({version})");
        let config = setup.config.to_toml();
        crate::distributed::check_same(c, &digest([config.as_bytes(), version.as_bytes()]), &what)?;
        crate::distributed::check_same(c, &data_digest(setup), "the data (tokenizer, examples, first batch)")?;
    }
    let weights = named_tensors_where(model, |_| true);
    let sum = digest(weights.iter().flat_map(|(k, d)| [k.as_bytes(), d.as_bytes()]));
    crate::distributed::check_same(c, &sum, &format!("the weights at {at}"))?;
    Ok(())
}

/// What the ranks' data must agree on: the tokenizer's vocabulary, the number of training and
/// held-out rows, and the tokens of the first training micro-batch and held-out row.
fn data_digest(setup: &Setup) -> [u8; 32] {
    use burn::data::dataset::Dataset;
    let t = &setup.config.train;
    let first = WindowSampler::random(t.seed).windows(setup.train.as_ref(), 0, t.batch_size);
    let mut tokens: Vec<u8> = Vec::new();
    for w in first.iter().chain(setup.val.get(0).as_ref()) {
        tokens.extend(w.input.iter().flat_map(|x| x.to_le_bytes()));
        tokens.extend(w.target.iter().flat_map(|x| x.to_le_bytes()));
    }
    let sizes = [setup.tokenizer.vocab_size() as u64, setup.train.len() as u64, setup.val.len() as u64];
    let sizes: Vec<u8> = sizes.iter().flat_map(|x| x.to_le_bytes()).collect();
    digest([sizes.as_slice(), tokens.as_slice()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_read_as_the_messages_name_them() {
        assert_eq!(Stage::Start.to_string(), "start");
        assert_eq!(Stage::Step(250).to_string(), "step 250");
    }
}
