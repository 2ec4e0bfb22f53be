//! Preference tuning: pairs of answers scored by DPO, IPO, SimPO or ORPO ([`crate::preference`]'s
//! losses), the step's loss `Σ pair losses / the step's pairs`, TRL's metrics recorded (`rewards/…`,
//! `logps/…`; `val_…` for the held-out pairs). DPO and IPO compare with a reference: the starting
//! model's log-probabilities of every pair's answers, computed once ([`reference`]).

use std::time::Instant;

use burn::optim::GradientsParams;
use ember_data::preference::answer_masks;
use ember_data::{Examples, Window};
use ember_kernels::TrainBackend;
use ember_model::Decoder;

use super::{Accumulation, EvalBatches, Evaluated, MicroBatches, Objective, Split, Splits};
use crate::collective::Collective;
use crate::config::{PreferenceConfig, TrainConfig};
use crate::error::TrainError;
use crate::eval::Part;
use crate::metrics::StepRecord;
use crate::preference::{answer_logps, evaluate_pairs, pair_loss, reference_logps, PairSums, Reference, StepTotals};

/// A micro-batch's pair rows, with their reference log-probabilities (`[chosen, rejected]`).
type PairRows = (Vec<Window>, Option<Vec<[f64; 2]>>);

/// Pairs of answers on a run's splits, with their reference log-probabilities (DPO and IPO).
pub(crate) struct Pairs<'a> {
    splits: Splits<'a>,
    config: PreferenceConfig,
    reference: Option<Reference>,
    eval: EvalBatches,
}

impl<'a> Pairs<'a> {
    pub(crate) fn new(
        run: &TrainConfig,
        splits: Splits<'a>,
        config: PreferenceConfig,
        reference: Option<Reference>,
    ) -> Self {
        Self { splits, config, reference, eval: EvalBatches::of(run) }
    }
}

impl<B: TrainBackend> Objective<B> for Pairs<'_> {
    /// Each micro-batch's rows (with their reference log-probabilities, DPO and IPO) scored in one
    /// forward pass, its share of the step's loss ([`pair_loss`]) backpropagated; the sums are the
    /// loss and the pairs' metrics ([`PairSums`]).
    fn forward_backward(
        &self,
        model: &Decoder<B>,
        batches: MicroBatches<'_, B>,
    ) -> Result<(GradientsParams, Vec<f64>), TrainError> {
        let reference = self.reference.as_ref().map(|r| r.train.as_slice());
        let all: Vec<PairRows> = batches
            .indices
            .iter()
            .map(|idx| (batches.rows(idx), reference.map(|r| idx.iter().map(|&i| r[i]).collect())))
            .collect();
        let chosen_tokens = all.iter().flat_map(|(b, _)| b).map(|w| answer_masks(w).0.iter().sum::<f32>() as f64);
        let totals = StepTotals {
            pairs: (self.eval.batch_size as u64 * batches.indices.len() as u64) as f64,
            chosen_tokens: chosen_tokens.sum(),
        };
        let mut acc = Accumulation::<B>::new(batches.loss_scale);
        let mut sums = PairSums::default();
        for (rows, reference) in batches.mine(all) {
            let logps = answer_logps(model, &rows, batches.device);
            let out = pair_loss(&self.config, logps, reference.as_deref(), totals);
            acc.report(out.loss.clone());
            sums.add(&out.sums);
            acc.backward(model, out.loss);
        }
        let (loss, grads) = acc.finish();
        let mut v = vec![loss];
        v.extend(sums.to_vec());
        Ok((grads, v))
    }

    fn record_step(&self, sums: &[f64], record: &mut StepRecord) {
        if let Some(m) = PairSums::from_slice(sums).metrics() {
            record.named.extend(m.named(""));
        }
    }

    /// The preference loss (and TRL's metrics) of every held-out pair, or of the training split's
    /// fixed batches, as `[loss, pair sums…]`.
    fn evaluate(&self, model: &Decoder<B::InnerBackend>, split: Split, part: Part) -> Result<Vec<f64>, TrainError> {
        let e = &self.eval;
        let (rows, reference) = match split {
            Split::Val => {
                let data = self.splits.val;
                let rows: Vec<Window> = (0..data.len()).filter_map(|i| data.get(i)).collect();
                (rows, self.reference.as_ref().map(|r| r.val.clone()))
            }
            Split::Train => {
                let sampler = ember_data::WindowSampler::random(e.train_seed);
                let data = self.splits.train.as_ref();
                let idx: Vec<usize> =
                    (0..e.iters as u64).flat_map(|i| sampler.indices(i, e.batch_size, data.len())).collect();
                let rows: Vec<Window> = idx.iter().filter_map(|&i| data.get(i)).collect();
                (rows, self.reference.as_ref().map(|r| idx.iter().map(|&i| r.train[i]).collect()))
            }
        };
        let keep = |i: usize| part.keeps(i);
        let (loss, sums) = evaluate_pairs(model, &self.config, &rows, reference.as_deref(), e.batch_size, keep);
        let mut v = vec![loss];
        v.extend(sums.to_vec());
        Ok(v)
    }

    fn evaluated(&self, sums: &[f64], split: Split) -> Evaluated {
        let metrics = PairSums::from_slice(&sums[1..]).metrics().filter(|_| split == Split::Val);
        Evaluated {
            loss: sums[0],
            named: metrics.map(|m| m.named("val_").to_vec()).unwrap_or_default(),
            note: metrics.map_or(String::new(), |m| format!(", held-out reward accuracy {:.3}", m.rewards_accuracies)),
        }
    }
}

/// DPO's and IPO's reference: the log-probabilities of every pair's answers under `model`, the
/// model the run starts from (`init_from`'s weights; with LoRA the base, as the adapters start at
/// zero), computed once at the start of the run and again on resuming (from the same source), with
/// the rows shared out over the ranks.
pub(crate) fn reference<B: TrainBackend>(
    config: &TrainConfig,
    splits: Splits<'_>,
    model: Decoder<B::InnerBackend>,
    c: &dyn Collective,
) -> Result<Reference, TrainError> {
    let started = Instant::now();
    let (rank, world) = (c.rank(), c.world());
    let batch = config.train.batch_size;
    let score = |rows: &Examples, what: &str| -> Result<Vec<[f64; 2]>, TrainError> {
        let n = rows.len();
        let share = n.div_ceil(world);
        let mine: Vec<Window> = (rank * share..((rank + 1) * share).min(n)).filter_map(|i| rows.get(i)).collect();
        let scored = reference_logps(&model, &mine, batch, &model.device());
        // Each rank fills its share; the sum over ranks is every row's.
        let mut all = vec![0.0; 2 * n];
        for (k, [chosen, rejected]) in scored.into_iter().enumerate() {
            all[2 * (rank * share + k)] = chosen;
            all[2 * (rank * share + k) + 1] = rejected;
        }
        c.all_reduce_f64(&mut all, what)?;
        Ok(all.chunks_exact(2).map(|x| [x[0], x[1]]).collect())
    };
    let reference = Reference {
        train: score(splits.train, "reference log-probabilities (train)")?,
        val: score(splits.val, "reference log-probabilities (val)")?,
    };
    tracing::info!(
        "reference log-probabilities of {} + {} pairs in {:.1} s",
        reference.train.len(),
        reference.val.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(reference)
}
