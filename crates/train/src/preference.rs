//! Preference losses over pairs of answers (DPO, IPO, SimPO, ORPO), with TRL's definitions and
//! metric names. A pair is one row of two documents ([`ember_data::preference`]); one forward
//! pass gives each answer's summed log-probability, the losses combine them with the reference
//! model's (computed once, before training: [`reference_logps`]).
//!
//! [`pair_loss_reference`] is the same arithmetic in f64, one pair at a time: the reference
//! implementation the tensor version is tested against.

use burn::tensor::activation::{log_sigmoid, log_softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, ElementConversion, Int, Tensor, TensorData};
use ember_data::preference::answer_masks;
use ember_data::{LmBatch, LmBatcher, Window};
use ember_kernels::EmberBackend;
use ember_model::{Decoder, Documents};

use crate::config::{PreferenceConfig, PreferenceMethod};

/// Each pair's answers scored by a model: summed log-probabilities (`[P]` each) and token counts.
pub struct AnswerLogps<B: Backend> {
    pub chosen: Tensor<B, 1>,
    pub rejected: Tensor<B, 1>,
    pub chosen_tokens: Vec<f64>,
    pub rejected_tokens: Vec<f64>,
}

/// Scores the answers of `rows` (pair rows) under `model`: the log-softmax of the logits at each
/// answer position, gathered at the answer's next token and summed per answer.
pub fn answer_logps<B: EmberBackend>(model: &Decoder<B>, rows: &[Window], device: &Device<B>) -> AnswerLogps<B> {
    use burn::data::dataloader::batcher::Batcher;
    let (p, t) = (rows.len(), rows.first().map_or(0, |w| w.input.len()));
    let (mut chosen_mask, mut rejected_mask) = (Vec::with_capacity(p * t), Vec::with_capacity(p * t));
    let (mut chosen_tokens, mut rejected_tokens) = (Vec::with_capacity(p), Vec::with_capacity(p));
    for row in rows {
        let (c, r) = answer_masks(row);
        chosen_tokens.push(c.iter().map(|&x| x as f64).sum());
        rejected_tokens.push(r.iter().map(|&x| x as f64).sum());
        chosen_mask.extend(c);
        rejected_mask.extend(r);
    }
    let batch: LmBatch<B> = LmBatcher.batch(rows.to_vec(), device);
    let d = model.config().d_model;
    let docs = batch.docs.map(|first| Documents::new(first, p, t).expect("pair rows carry valid document starts"));
    let hidden = model.hidden_documents(batch.inputs, 0, docs.as_ref()).reshape([p * t, d]);
    let logp = log_softmax(model.logits(hidden), 1); // [P·T, V]
                                                     // Unscored targets (-1) gather token 0; the masks drop them.
    let targets: Tensor<B, 2, Int> = batch.targets.reshape([p * t, 1]).clamp_min(0);
    let token_logp = logp.gather(1, targets).reshape([p, t]);
    let mask = |m: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(m, [p, t]), device);
    let chosen = (token_logp.clone() * mask(chosen_mask)).sum_dim(1).reshape([p]);
    let rejected = (token_logp * mask(rejected_mask)).sum_dim(1).reshape([p]);
    AnswerLogps { chosen, rejected, chosen_tokens, rejected_tokens }
}

/// What a micro-batch of pairs adds to a step: its share of the step's loss, and the sums of
/// TRL's metrics over its pairs.
pub struct PairLoss<B: Backend> {
    /// `Σ pair losses / pairs of the step` (ORPO: plus the chosen answers' NLL over the step's
    /// chosen tokens), `[1]`.
    pub loss: Tensor<B, 1>,
    pub sums: PairSums,
}

/// Sums over pairs of TRL's metrics (divided by [`PairSums::pairs`] when logged).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PairSums {
    pub pairs: f64,
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    /// Pairs whose chosen reward is above the rejected's.
    pub accuracies: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
}

impl PairSums {
    pub(crate) const LEN: usize = 6;

    pub(crate) fn to_vec(self) -> [f64; Self::LEN] {
        [
            self.pairs,
            self.rewards_chosen,
            self.rewards_rejected,
            self.accuracies,
            self.logps_chosen,
            self.logps_rejected,
        ]
    }

    pub(crate) fn from_slice(v: &[f64]) -> Self {
        let g = |i: usize| v.get(i).copied().unwrap_or(0.0);
        Self {
            pairs: g(0),
            rewards_chosen: g(1),
            rewards_rejected: g(2),
            accuracies: g(3),
            logps_chosen: g(4),
            logps_rejected: g(5),
        }
    }

    pub(crate) fn add(&mut self, o: &Self) {
        let (a, b) = (self.to_vec(), o.to_vec());
        *self = Self::from_slice(&std::array::from_fn::<f64, { Self::LEN }, _>(|i| a[i] + b[i]));
    }

    /// The means TRL logs, by TRL's names.
    pub fn metrics(&self) -> Option<PreferenceMetrics> {
        let n = self.pairs;
        (n > 0.0).then(|| PreferenceMetrics {
            rewards_chosen: self.rewards_chosen / n,
            rewards_rejected: self.rewards_rejected / n,
            rewards_accuracies: self.accuracies / n,
            rewards_margins: (self.rewards_chosen - self.rewards_rejected) / n,
            logps_chosen: self.logps_chosen / n,
            logps_rejected: self.logps_rejected / n,
        })
    }
}

/// TRL's preference metrics: means over the pairs of a step (or of the held-out pairs).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PreferenceMetrics {
    #[serde(rename = "rewards/chosen")]
    pub rewards_chosen: f64,
    #[serde(rename = "rewards/rejected")]
    pub rewards_rejected: f64,
    #[serde(rename = "rewards/accuracies")]
    pub rewards_accuracies: f64,
    #[serde(rename = "rewards/margins")]
    pub rewards_margins: f64,
    #[serde(rename = "logps/chosen")]
    pub logps_chosen: f64,
    #[serde(rename = "logps/rejected")]
    pub logps_rejected: f64,
}

impl PreferenceMetrics {
    /// The metrics by TRL's names, prefixed (`eval_` for the held-out pairs, as TRL's evaluation).
    pub fn named(&self, prefix: &str) -> [(String, f64); 6] {
        [
            ("rewards/chosen", self.rewards_chosen),
            ("rewards/rejected", self.rewards_rejected),
            ("rewards/accuracies", self.rewards_accuracies),
            ("rewards/margins", self.rewards_margins),
            ("logps/chosen", self.logps_chosen),
            ("logps/rejected", self.logps_rejected),
        ]
        .map(|(k, v)| (format!("{prefix}{k}"), v))
    }
}

/// The step's totals a micro-batch's loss is divided by: pairs, and (ORPO) chosen answer tokens.
#[derive(Debug, Clone, Copy)]
pub struct StepTotals {
    pub pairs: f64,
    pub chosen_tokens: f64,
}

/// The loss of `policy`'s pairs under `config`, with the reference model's summed
/// log-probabilities `reference` (`[chosen, rejected]` per pair; DPO and IPO only).
pub fn pair_loss<B: Backend>(
    config: &PreferenceConfig,
    policy: AnswerLogps<B>,
    reference: Option<&[[f64; 2]]>,
    totals: StepTotals,
) -> PairLoss<B> {
    let device = policy.chosen.device();
    let p = policy.chosen_tokens.len();
    let vector =
        |v: Vec<f64>| Tensor::<B, 1>::from_data(TensorData::new(v.iter().map(|&x| x as f32).collect(), [p]), &device);
    let (beta, eps) = (config.beta, config.label_smoothing);
    let (nc, nr) = (
        vector(policy.chosen_tokens.iter().map(|n| n.max(1.0)).collect()),
        vector(policy.rejected_tokens.iter().map(|n| n.max(1.0)).collect()),
    );
    let refs = |i: usize| vector(reference.map_or(vec![0.0; p], |r| r.iter().map(|x| x[i]).collect()));
    let (pc, pr) = (policy.chosen.clone(), policy.rejected.clone());
    // The scores the rewards and the losses compare.
    let (sc, sr) = match config.method {
        PreferenceMethod::Dpo => (pc.clone() - refs(0), pr.clone() - refs(1)),
        PreferenceMethod::Ipo => ((pc.clone() - refs(0)) / nc.clone(), (pr.clone() - refs(1)) / nr.clone()),
        PreferenceMethod::Simpo | PreferenceMethod::Orpo => (pc.clone() / nc.clone(), pr.clone() / nr.clone()),
    };
    let smoothed = |x: Tensor<B, 1>| {
        let x = x.mul_scalar(beta);
        log_sigmoid(x.clone()).mul_scalar(-(1.0 - eps)) - log_sigmoid(x.neg()).mul_scalar(eps)
    };
    let per_pair = match config.method {
        PreferenceMethod::Dpo => smoothed(sc.clone() - sr.clone()),
        PreferenceMethod::Ipo => (sc.clone() - sr.clone()).sub_scalar(1.0 / (2.0 * beta)).powi_scalar(2),
        PreferenceMethod::Simpo => smoothed((sc.clone() - sr.clone()).sub_scalar(config.simpo_gamma / beta)),
        PreferenceMethod::Orpo => {
            // log odds(y) = log p − log(1 − p) of the per-token mean log-probability.
            // log(1 − eˣ) for x < 0: near 0, 1 − eˣ by its series (no cancellation).
            let log1mexp = |x: Tensor<B, 1>| {
                let poly = ((x.clone().div_scalar(24.0).add_scalar(1.0 / 6.0) * x.clone()).add_scalar(0.5) * x.clone())
                    .add_scalar(1.0);
                let series = x.clone().neg() * poly;
                let near = x.clone().greater_elem(-1e-2);
                x.exp().neg().add_scalar(1.0).mask_where(near, series).log()
            };
            let log_odds = (sc.clone() - sr.clone()) - (log1mexp(sc.clone()) - log1mexp(sr.clone()));
            log_sigmoid(log_odds).mul_scalar(-beta)
        }
    };
    let mut loss = per_pair.sum().div_scalar(totals.pairs.max(1.0));
    let nll_weight = config.sft_weight + if config.method == PreferenceMethod::Orpo { 1.0 } else { 0.0 };
    if nll_weight > 0.0 {
        // The chosen answers' NLL, token-weighted over the step.
        loss = loss + pc.clone().sum().neg().div_scalar(totals.chosen_tokens.max(1.0)).mul_scalar(nll_weight);
    }
    // The metrics, on the host from one read of the log-probabilities: the rewards are
    // `pair_loss_reference`'s (β × the summed log-ratio for DPO and IPO, as TRL logs them; β × the
    // per-token mean for the reference-free losses), the logged log-probabilities what the loss reads.
    let logps = to_host(Tensor::cat(vec![policy.chosen, policy.rejected], 0));
    let (chosen, rejected) = logps.split_at(p);
    let mut sums = PairSums { pairs: p as f64, ..PairSums::default() };
    for i in 0..p {
        let reference = reference.map_or([0.0; 2], |r| r[i]);
        let tokens = [policy.chosen_tokens[i], policy.rejected_tokens[i]];
        let (_, [rc, rr]) = pair_loss_reference(config, [chosen[i], rejected[i]], reference, tokens);
        let (lc, lr) = match config.method {
            PreferenceMethod::Dpo | PreferenceMethod::Ipo => (chosen[i], rejected[i]),
            PreferenceMethod::Simpo | PreferenceMethod::Orpo => {
                (chosen[i] / tokens[0].max(1.0), rejected[i] / tokens[1].max(1.0))
            }
        };
        sums.add(&PairSums {
            pairs: 0.0,
            rewards_chosen: rc,
            rewards_rejected: rr,
            accuracies: f64::from(u8::from(rc > rr)),
            logps_chosen: lc,
            logps_rejected: lr,
        });
    }
    PairLoss { loss, sums }
}

/// One pair's loss in f64, by the definitions (the reference for [`pair_loss`]): `policy` and
/// `reference` are `[chosen, rejected]` summed log-probabilities, `tokens` the answers' lengths.
/// Returns the pair's loss (without the chosen answers' NLL term of ORPO and `sft_weight`, which is
/// token-weighted over the step) and `[reward chosen, reward rejected]`.
pub(crate) fn pair_loss_reference(
    config: &PreferenceConfig,
    policy: [f64; 2],
    reference: [f64; 2],
    tokens: [f64; 2],
) -> (f64, [f64; 2]) {
    let log_sigmoid = |x: f64| -(1.0 + (-x).exp()).ln();
    let (b, e) = (config.beta, config.label_smoothing);
    let smoothed = |x: f64| -(1.0 - e) * log_sigmoid(b * x) - e * log_sigmoid(-b * x);
    let per_token = [policy[0] / tokens[0].max(1.0), policy[1] / tokens[1].max(1.0)];
    let (s, loss) = match config.method {
        PreferenceMethod::Dpo => {
            let s = [policy[0] - reference[0], policy[1] - reference[1]];
            (s, smoothed(s[0] - s[1]))
        }
        PreferenceMethod::Ipo => {
            let s = [policy[0] - reference[0], policy[1] - reference[1]];
            let per_token = [s[0] / tokens[0].max(1.0), s[1] / tokens[1].max(1.0)];
            (s, (per_token[0] - per_token[1] - 1.0 / (2.0 * b)).powi(2))
        }
        PreferenceMethod::Simpo => (per_token, smoothed(per_token[0] - per_token[1] - config.simpo_gamma / b)),
        PreferenceMethod::Orpo => {
            let odds = |x: f64| x - (1.0 - x.exp()).ln();
            (per_token, -b * log_sigmoid(odds(per_token[0]) - odds(per_token[1])))
        }
    };
    (loss, [b * s[0], b * s[1]])
}

/// The reference model's summed log-probabilities of each row's answers (`[chosen, rejected]`),
/// for the training rows and the held-out ones: DPO's and IPO's anchor.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Reference {
    pub train: Vec<[f64; 2]>,
    pub val: Vec<[f64; 2]>,
}

/// Each of `rows`' answers' summed log-probabilities under `model` (no gradients), `batch` rows
/// at a time: the reference a DPO or IPO run compares with, computed from the starting model
/// (with LoRA, the base: the adapters start at zero).
pub fn reference_logps<B: EmberBackend>(
    model: &Decoder<B>,
    rows: &[Window],
    batch: usize,
    device: &Device<B>,
) -> Vec<[f64; 2]> {
    rows.chunks(batch.max(1))
        .flat_map(|items| {
            let l = answer_logps(model, items, device);
            let logps = to_host(Tensor::cat(vec![l.chosen, l.rejected], 0));
            let (chosen, rejected) = logps.split_at(items.len());
            chosen.iter().zip(rejected).map(|(&c, &r)| [c, r]).collect::<Vec<_>>()
        })
        .collect()
}

/// The loss and metric sums of `rows` (with their `reference`) under `model`, no gradients, as
/// if they were one step: batch `i` of `batch` rows is computed where `keep(i)`, so that ranks
/// share the batches and add their sums.
pub(crate) fn evaluate_pairs<B: EmberBackend>(
    model: &Decoder<B>,
    config: &PreferenceConfig,
    rows: &[Window],
    reference: Option<&[[f64; 2]]>,
    batch: usize,
    keep: impl Fn(usize) -> bool,
) -> (f64, PairSums) {
    let device = model.device();
    let chosen_tokens = rows.iter().map(|w| answer_masks(w).0.iter().sum::<f32>() as f64).sum();
    let totals = StepTotals { pairs: rows.len() as f64, chosen_tokens };
    let (mut loss, mut sums) = (0.0, PairSums::default());
    let batch = batch.max(1);
    for (i, items) in rows.chunks(batch).enumerate().filter(|(i, _)| keep(*i)) {
        let logps = answer_logps(model, items, &device);
        let reference = reference.map(|r| &r[i * batch..i * batch + items.len()]);
        let out = pair_loss(config, logps, reference, totals);
        loss += scalar(out.loss);
        sums.add(&out.sums);
    }
    (loss, sums)
}

/// A vector's values on the host, in f64.
fn to_host<B: Backend>(t: Tensor<B, 1>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().unwrap_or_default()
}

/// A scalar of a `[1]` tensor on the host.
pub fn scalar<B: Backend>(t: Tensor<B, 1>) -> f64 {
    t.into_scalar().elem::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use rand::{Rng, SeedableRng};

    fn logps(v: &[[f64; 4]]) -> AnswerLogps<Flex> {
        let t = |i: usize| {
            Tensor::<Flex, 1>::from_data(
                TensorData::new(v.iter().map(|x| x[i] as f32).collect(), [v.len()]),
                &Default::default(),
            )
        };
        AnswerLogps {
            chosen: t(0),
            rejected: t(1),
            chosen_tokens: v.iter().map(|x| x[2]).collect(),
            rejected_tokens: v.iter().map(|x| x[3]).collect(),
        }
    }

    #[test]
    fn the_tensor_losses_are_the_definitions() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for method in [PreferenceMethod::Dpo, PreferenceMethod::Ipo, PreferenceMethod::Simpo, PreferenceMethod::Orpo] {
            for (beta, eps) in [(0.1, 0.0), (0.5, 0.2), (2.0, 0.0)] {
                let eps = if matches!(method, PreferenceMethod::Dpo | PreferenceMethod::Simpo) { eps } else { 0.0 };
                let sft_weight = if beta == 0.5 { 0.3 } else { 0.0 };
                let config = PreferenceConfig { method, beta, label_smoothing: eps, simpo_gamma: 0.5, sft_weight };
                let pairs: Vec<[f64; 4]> = (0..5)
                    .map(|_| {
                        [
                            rng.random_range(-40.0..-5.0),
                            rng.random_range(-40.0..-5.0),
                            rng.random_range(3..20) as f64,
                            rng.random_range(3..20) as f64,
                        ]
                    })
                    .collect();
                let refs: Vec<[f64; 2]> = pairs
                    .iter()
                    .map(|p| [p[0] + rng.random_range(-3.0..3.0), p[1] + rng.random_range(-3.0..3.0)])
                    .collect();
                let chosen_tokens: f64 = pairs.iter().map(|p| p[2]).sum();
                let totals = StepTotals { pairs: 8.0, chosen_tokens: chosen_tokens + 10.0 };
                let out = pair_loss(&config, logps(&pairs), Some(&refs), totals);
                let mut want = 0.0;
                let mut sums = PairSums::default();
                for (p, r) in pairs.iter().zip(&refs) {
                    let (l, rewards) = pair_loss_reference(&config, [p[0], p[1]], *r, [p[2], p[3]]);
                    want += l / 8.0;
                    sums.rewards_chosen += rewards[0];
                    sums.rewards_rejected += rewards[1];
                    sums.accuracies += (rewards[0] > rewards[1]) as u8 as f64;
                }
                let nll_weight = sft_weight + if method == PreferenceMethod::Orpo { 1.0 } else { 0.0 };
                want += nll_weight * -pairs.iter().map(|p| p[0]).sum::<f64>() / (chosen_tokens + 10.0);
                let got = scalar(out.loss);
                assert!((got - want).abs() <= 1e-5 * want.abs().max(1e-3), "{method} β {beta}: {got} vs {want}");
                for (g, w) in
                    [(out.sums.rewards_chosen, sums.rewards_chosen), (out.sums.rewards_rejected, sums.rewards_rejected)]
                {
                    assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{method}: {g} vs {w}");
                }
                assert_eq!((out.sums.pairs, out.sums.accuracies), (5.0, sums.accuracies));
            }
        }
    }

    #[test]
    fn dpo_at_the_reference_is_log_two() {
        let config = PreferenceConfig {
            method: PreferenceMethod::Dpo,
            beta: 0.1,
            label_smoothing: 0.0,
            simpo_gamma: 0.5,
            sft_weight: 0.0,
        };
        let (loss, rewards) = pair_loss_reference(&config, [-10.0, -12.0], [-10.0, -12.0], [4.0, 5.0]);
        assert!((loss - std::f64::consts::LN_2).abs() < 1e-12 && rewards == [0.0, 0.0]);
    }
}
