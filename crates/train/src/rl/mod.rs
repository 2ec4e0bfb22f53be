//! Reinforcement learning with verifiable rewards: GRPO and the variants TRL 1.16's
//! `GRPOTrainer` names by its settings (DAPO's token-level normalisation and clip-higher, Dr.
//! GRPO's unscaled advantages and constant normaliser, GSPO's sequence-level ratio), with TRL's
//! definitions and metric names.
//!
//! A step's answers are sampled by the policy ([`rollout`]), scored ([`reward`]), turned into
//! group-relative advantages ([`advantages`]), and the policy's log-probabilities of the answers'
//! tokens ([`completion_logps`]) enter the clipped objective ([`policy_loss`]).
//! [`policy_loss_reference`] is the same arithmetic in f64, one answer at a time: the reference
//! the tensor version is tested against.

pub(crate) mod reward;
pub(crate) mod rollout;

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Device, ElementConversion, Int, Tensor, TensorData};
use ember_kernels::EmberBackend;
use ember_model::Decoder;

use crate::config::{Importance, RlConfig, RlLoss, ScaleRewards};

/// The prompts of a run, tokenized, split as the rows are (the held-out ones last).
#[derive(Debug, Clone, Default)]
pub struct Prompts {
    pub train: Vec<ember_data::prompts::Prompt>,
    pub val: Vec<ember_data::prompts::Prompt>,
}

/// A micro-batch's answers as the loss reads them: each answer's prompt and completion tokens,
/// its advantage, and which of its tokens count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answers {
    pub prompts: Vec<Vec<u32>>,
    pub completions: Vec<Vec<u32>>,
    pub advantages: Vec<f64>,
    /// Answers left out of the loss (cut by `max_new_tokens` under `mask_truncated`).
    pub masked: Vec<bool>,
    /// The log-probabilities of each completion token when it was generated (several passes over
    /// one generation, `num_iterations` > 1); `None`: the policy's own, detached (ratio 1).
    pub old_logps: Option<Vec<Vec<f64>>>,
    /// The reference model's, for the KL term (β > 0).
    pub ref_logps: Option<Vec<Vec<f64>>>,
}

impl Answers {
    pub(crate) fn len(&self) -> usize {
        self.completions.len()
    }

    /// The longest completion: the width of the loss's `[N, C]` tensors.
    pub fn width(&self) -> usize {
        self.completions.iter().map(Vec::len).max().unwrap_or(0).max(1)
    }

    /// The tokens the loss counts, `[N·C]` row-major (1 or 0).
    pub(crate) fn mask(&self) -> Vec<f32> {
        let c = self.width();
        let mut mask = vec![0.0; self.len() * c];
        for (i, done) in self.completions.iter().enumerate() {
            if !self.masked[i] {
                mask[i * c..i * c + done.len()].fill(1.0);
            }
        }
        mask
    }

    /// The answers at `which`, in that order, with their values.
    pub(crate) fn part(&self, which: &[usize]) -> Answers {
        fn take<T: Clone>(v: &[T], which: &[usize]) -> Vec<T> {
            which.iter().map(|&i| v[i].clone()).collect()
        }
        Answers {
            prompts: take(&self.prompts, which),
            completions: take(&self.completions, which),
            advantages: take(&self.advantages, which),
            masked: take(&self.masked, which),
            old_logps: self.old_logps.as_deref().map(|v| take(v, which)),
            ref_logps: self.ref_logps.as_deref().map(|v| take(v, which)),
        }
    }

    /// The answers in parts of at most `size`, the shortest sequences together (less padding in
    /// each part's `[answers, positions]` batch).
    pub(crate) fn parts(&self, size: usize) -> Vec<Answers> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.sort_by_key(|&i| self.prompts[i].len() + self.completions[i].len());
        order.chunks(size.max(1)).map(|which| self.part(which)).collect()
    }

    /// Counted tokens.
    pub(crate) fn tokens(&self) -> f64 {
        self.completions.iter().zip(&self.masked).filter(|(_, m)| !**m).map(|(c, _)| c.len() as f64).sum()
    }
}

/// Per-token values `[N][len_i]` as a `[N, C]` tensor, zero past each completion.
fn padded<B: Backend>(values: &[Vec<f64>], c: usize, device: &Device<B>) -> Tensor<B, 2> {
    let mut flat = vec![0.0f32; values.len() * c];
    for (i, row) in values.iter().enumerate() {
        for (j, &v) in row.iter().enumerate().take(c) {
            flat[i * c + j] = v as f32;
        }
    }
    Tensor::from_data(TensorData::new(flat, [values.len(), c]), device)
}

/// The log-probabilities of the completion tokens under `model`, on the host: the old
/// log-probabilities of several passes over one generation, and the reference's.
/// Eight answers a pass, which bounds the `[answers · C, V]` logits.
pub(crate) fn host_logps<B: EmberBackend>(model: &Decoder<B>, answers: &Answers, temperature: f64) -> Vec<Vec<f64>> {
    let device = model.device();
    let mut out = Vec::with_capacity(answers.len());
    for (prompts, completions) in answers.prompts.chunks(8).zip(answers.completions.chunks(8)) {
        let part = Answers {
            prompts: prompts.to_vec(),
            completions: completions.to_vec(),
            masked: vec![false; prompts.len()],
            ..Answers::default()
        };
        let (logp, _) = completion_logps(model, &part, temperature, &device);
        let c = part.width();
        let flat = logp.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
        out.extend(
            completions.iter().enumerate().map(|(i, done)| (0..done.len()).map(|j| flat[i * c + j] as f64).collect()),
        );
    }
    out
}

/// The log-probabilities under `model` of each completion token after its prompt and the tokens
/// before it, with the logits divided by `temperature` (TRL's), `[N, C]` (zero past a completion's
/// end); and the entropy of each of those distributions, `[N, C]`, without gradients. The rows run
/// right-padded in one pass; only the completion positions go through the head.
pub fn completion_logps<B: EmberBackend>(
    model: &Decoder<B>,
    answers: &Answers,
    temperature: f64,
    device: &Device<B>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let (n, c) = (answers.len(), answers.width());
    let seqs: Vec<Vec<u32>> = answers
        .prompts
        .iter()
        .zip(&answers.completions)
        .map(|(p, done)| p.iter().chain(done).copied().collect())
        .collect();
    // Position t predicts token t + 1: the inputs leave the last token out.
    let t = seqs.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(1).max(1);
    let mut ids = vec![0i32; n * t];
    let mut at = vec![0i32; n * c];
    let mut targets = vec![0i32; n * c];
    for (i, seq) in seqs.iter().enumerate() {
        for (k, &tok) in seq.iter().take(t).enumerate() {
            ids[i * t + k] = tok as i32;
        }
        let p = answers.prompts[i].len();
        for (j, &tok) in answers.completions[i].iter().enumerate() {
            at[i * c + j] = (i * t + p + j - 1) as i32;
            targets[i * c + j] = tok as i32;
        }
    }
    let d = model.config().d_model;
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, t]), device);
    let hidden = model.hidden(tokens, 0).reshape([n * t, d]);
    let picked = hidden.select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(at, [n * c]), device));
    let logits = model.logits(picked);
    let logits = if temperature == 1.0 { logits } else { logits.div_scalar(temperature) };
    let logp = log_softmax(logits, 1); // [N·C, V]
    let detached = logp.clone().detach();
    let entropy = -(detached.clone().exp() * detached).sum_dim(1).reshape([n, c]);
    let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [n * c, 1]), device);
    let token_logp = logp.gather(1, targets).reshape([n, c]);
    let mask = Tensor::<B, 2>::from_data(TensorData::new(answers.completions_mask(c), [n, c]), device);
    (token_logp * mask, entropy)
}

impl Answers {
    /// 1 at every completion token, masked answers included (the log-probabilities' own mask).
    fn completions_mask(&self, c: usize) -> Vec<f32> {
        let mut mask = vec![0.0; self.len() * c];
        for (i, done) in self.completions.iter().enumerate() {
            mask[i * c..i * c + done.len()].fill(1.0);
        }
        mask
    }
}

/// The clipped objective's settings, from `[rl]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    pub loss: RlLoss,
    pub importance: Importance,
    pub epsilon_low: f64,
    pub epsilon_high: f64,
    pub beta: f64,
    /// `dr_grpo`'s normaliser: answers × this.
    pub max_new_tokens: usize,
}

impl LossConfig {
    pub(crate) fn of(rl: &RlConfig) -> Self {
        Self {
            loss: rl.loss,
            importance: rl.importance,
            epsilon_low: rl.epsilon,
            epsilon_high: rl.epsilon_high(),
            beta: rl.beta,
            max_new_tokens: rl.max_new_tokens,
        }
    }
}

/// What the normalisations need beyond the answers at hand: the step (every micro-batch of every
/// rank) and the micro-batch they belong to (a micro-batch's answers may go through the loss in
/// parts, which bounds the logits held at once; the parts' losses add up to the micro-batch's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTotals {
    /// Micro-batches of the step: `grpo`, `bnpo` and `dr_grpo` average them (TRL divides by the
    /// accumulation steps; data-parallel gradients are averaged over the processes).
    pub micro_batches: f64,
    /// Counted completion tokens of the step: `dapo`'s normaliser.
    pub tokens: f64,
    /// Answers of the micro-batch: `grpo`'s mean and `dr_grpo`'s normaliser.
    pub batch_answers: f64,
    /// Counted tokens of the micro-batch: `bnpo`'s normaliser.
    pub batch_tokens: f64,
}

impl StepTotals {
    /// The totals for `batch`'s answers (or parts of them), in a step of `micro_batches` holding
    /// `tokens` counted tokens.
    pub fn of(micro_batches: f64, tokens: f64, batch: &Answers) -> Self {
        Self { micro_batches, tokens, batch_answers: batch.len() as f64, batch_tokens: batch.tokens() }
    }
}

/// A micro-batch's share of the step's loss and its sums of TRL's metrics.
pub struct PolicyLoss<B: Backend> {
    pub loss: Tensor<B, 1>,
    pub sums: LossSums,
}

/// Sums over a step of the loss's metrics: TRL's `global_masked_mean`s (numerators over
/// `counted`: tokens, or answers under sequence-level importance) and the entropy and KL over the
/// counted tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    pub tokens: f64,
    pub entropy: f64,
    pub kl: f64,
    pub counted: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub clip_region: f64,
}

impl LossSums {
    pub(crate) const LEN: usize = 7;

    pub(crate) fn to_vec(self) -> [f64; Self::LEN] {
        [self.tokens, self.entropy, self.kl, self.counted, self.clip_low, self.clip_high, self.clip_region]
    }

    pub(crate) fn from_slice(s: &[f64]) -> Self {
        Self {
            tokens: s[0],
            entropy: s[1],
            kl: s[2],
            counted: s[3],
            clip_low: s[4],
            clip_high: s[5],
            clip_region: s[6],
        }
    }

    pub(crate) fn add(&mut self, o: &Self) {
        let mut v = self.to_vec();
        for (a, b) in v.iter_mut().zip(o.to_vec()) {
            *a += b;
        }
        *self = Self::from_slice(&v);
    }

    /// TRL's names and values: `entropy`, `kl` (β > 0), `clip_ratio/…`.
    pub fn named(&self, beta: f64) -> Vec<(String, f64)> {
        let per = |x: f64, n: f64| if n > 0.0 { x / n } else { 0.0 };
        let mut out = vec![("entropy".to_string(), per(self.entropy, self.tokens))];
        if beta != 0.0 {
            out.push(("kl".into(), per(self.kl, self.tokens)));
        }
        out.push(("clip_ratio/low_mean".into(), per(self.clip_low, self.counted)));
        out.push(("clip_ratio/high_mean".into(), per(self.clip_high, self.counted)));
        out.push(("clip_ratio/region_mean".into(), per(self.clip_region, self.counted)));
        out
    }
}

/// The clipped objective over a micro-batch (TRL's `_compute_loss`): per token
/// `-min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A) + β·r·KL`, with `r` the ratio of `logps` (`[N, C]`,
/// with gradients) to the answers' old log-probabilities (per token, or per answer as the
/// geometric mean: GSPO) and KL the k3 estimator against the reference; reduced as `config.loss`
/// says over the counted tokens and scaled to the micro-batch's share of the step.
pub fn policy_loss<B: Backend>(
    config: &LossConfig,
    logps: Tensor<B, 2>,
    entropy: Tensor<B, 2>,
    answers: &Answers,
    totals: StepTotals,
) -> PolicyLoss<B>
where
    B: burn::tensor::backend::AutodiffBackend,
{
    let device = logps.device();
    let [n, c] = logps.dims();
    let mask_host = answers.mask();
    let mask = Tensor::<B, 2>::from_data(TensorData::new(mask_host.clone(), [n, c]), &device);
    let old = match &answers.old_logps {
        Some(old) => padded::<B>(old, c, &device),
        None => logps.clone().detach(),
    };
    let log_ratio = logps.clone() - old;
    let tokens_per_answer = mask.clone().sum_dim(1).clamp_min(1.0); // [N, 1]
    let log_weights = match config.importance {
        Importance::Token => log_ratio,
        Importance::Sequence => ((log_ratio * mask.clone()).sum_dim(1) / tokens_per_answer.clone()).expand([n, c]),
    };
    let ratio = log_weights.exp();
    let clipped = ratio.clone().clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high);
    let adv_host: Vec<f32> = answers.advantages.iter().map(|&a| a as f32).collect();
    let adv = Tensor::<B, 1>::from_data(TensorData::new(adv_host, [n]), &device).reshape([n, 1]).expand([n, c]);
    let mut per_token = -(ratio.clone() * adv.clone()).min_pair(clipped * adv);
    let mut kl_sum = 0.0;
    if config.beta != 0.0 {
        let reference = padded::<B>(answers.ref_logps.as_deref().unwrap_or(&[]), c, &device);
        let delta = reference - logps;
        // Times the ratio (TRL's `use_bias_correction_kl`, on by default): the unbiased gradient of
        // the reverse KL from answers sampled by the old policy.
        let kl = (delta.clone().exp() - delta - 1.0) * ratio.clone();
        kl_sum = scalar2((kl.clone().inner() * mask.clone().inner()).sum());
        per_token = per_token + kl.mul_scalar(config.beta);
    }
    let masked = per_token * mask.clone();
    let loss = reduced(config, masked, tokens_per_answer, totals);
    let sums = metric_sums(config, answers, &mask_host, ratio.inner(), entropy.inner(), kl_sum);
    PolicyLoss { loss, sums }
}

/// The masked per-token losses `[N, C]` reduced as `config.loss` says, scaled to the micro-batch's
/// share of the step (`tokens_per_answer`: `[N, 1]`, at least 1).
fn reduced<B: Backend>(
    config: &LossConfig,
    masked: Tensor<B, 2>,
    tokens_per_answer: Tensor<B, 2>,
    totals: StepTotals,
) -> Tensor<B, 1> {
    match config.loss {
        RlLoss::Grpo => {
            (masked.sum_dim(1) / tokens_per_answer).sum().div_scalar(totals.batch_answers * totals.micro_batches)
        }
        RlLoss::Bnpo => masked.sum().div_scalar(totals.batch_tokens.max(1.0) * totals.micro_batches),
        RlLoss::DrGrpo => {
            masked.sum().div_scalar(totals.batch_answers * config.max_new_tokens as f64 * totals.micro_batches)
        }
        RlLoss::Dapo => masked.sum().div_scalar(totals.tokens.max(1.0)),
    }
}

/// TRL's metrics of the micro-batch ([`LossSums`]), on the host (no gradients): `mask_host` `[N, C]` as
/// [`Answers::mask`] gives it, the ratio and the entropy per token (`[N, C]`), the KL summed.
fn metric_sums<B: Backend>(
    config: &LossConfig,
    answers: &Answers,
    mask_host: &[f32],
    ratio: Tensor<B, 2>,
    entropy: Tensor<B, 2>,
    kl_sum: f64,
) -> LossSums {
    let [n, c] = ratio.dims();
    let ratio = ratio.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
    let entropy = entropy.into_data().convert::<f32>().to_vec::<f32>().unwrap_or_default();
    let mut sums = LossSums { kl: kl_sum, ..LossSums::default() };
    for i in 0..n {
        let a = answers.advantages[i];
        for j in 0..c {
            let m = mask_host[i * c + j] as f64;
            sums.tokens += m;
            sums.entropy += m * entropy[i * c + j] as f64;
        }
        let (low, high) = (1.0 - config.epsilon_low, 1.0 + config.epsilon_high);
        let clip = |r: f64| ((r < low && a < 0.0) as u8 as f64, (r > high && a > 0.0) as u8 as f64);
        match config.importance {
            Importance::Token => {
                for j in 0..c {
                    let m = mask_host[i * c + j] as f64;
                    let (l, h) = clip(ratio[i * c + j] as f64);
                    sums.counted += m;
                    sums.clip_low += m * l;
                    sums.clip_high += m * h;
                    sums.clip_region += m * (l + h);
                }
            }
            Importance::Sequence => {
                let (l, h) = clip(ratio[i * c] as f64);
                sums.counted += 1.0;
                sums.clip_low += l;
                sums.clip_high += h;
                sums.clip_region += l + h;
            }
        }
    }
    sums
}

fn scalar2<B: Backend>(t: Tensor<B, 1>) -> f64 {
    t.into_scalar().elem::<f64>()
}

/// [`policy_loss`]'s value in f64 from per-token log-probabilities, one answer at a time: the
/// reference implementation.
pub fn policy_loss_reference(config: &LossConfig, logps: &[Vec<f64>], answers: &Answers, totals: StepTotals) -> f64 {
    let n = answers.len();
    let mut total = 0.0;
    let mut per_answer_means = 0.0;
    for i in 0..n {
        let counted = !answers.masked[i];
        let len = answers.completions[i].len();
        let old = |j: usize| answers.old_logps.as_ref().map_or(logps[i][j], |o| o[i][j]);
        let seq_ratio = (0..len).map(|j| logps[i][j] - old(j)).sum::<f64>() / (len.max(1) as f64);
        let mut sum = 0.0;
        for j in 0..len {
            let log_w = match config.importance {
                Importance::Token => logps[i][j] - old(j),
                Importance::Sequence => seq_ratio,
            };
            let r = log_w.exp();
            let a = answers.advantages[i];
            let clipped = r.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high);
            let mut l = -(r * a).min(clipped * a);
            if config.beta != 0.0 {
                let delta = answers.ref_logps.as_ref().map_or(0.0, |r| r[i][j]) - logps[i][j];
                l += config.beta * (delta.exp() - delta - 1.0) * r;
            }
            if counted {
                sum += l;
            }
        }
        let counted_len = if counted { len as f64 } else { 0.0 };
        total += sum;
        per_answer_means += sum / counted_len.max(1.0);
    }
    match config.loss {
        RlLoss::Grpo => per_answer_means / totals.batch_answers / totals.micro_batches,
        RlLoss::Bnpo => total / totals.batch_tokens.max(1.0) / totals.micro_batches,
        RlLoss::DrGrpo => total / (totals.batch_answers * config.max_new_tokens as f64) / totals.micro_batches,
        RlLoss::Dapo => total / totals.tokens.max(1.0),
    }
}

/// Group-relative advantages (TRL's): each reward minus its group's mean (groups of `group`
/// consecutive answers), divided by the group's standard deviation (unbiased) + 1e-4 under
/// `group`, by `batch_std` + 1e-4 under `batch`, or not at all under `none`. Returns the
/// advantages and each group's standard deviation.
pub fn advantages(rewards: &[f64], group: usize, scale: ScaleRewards, batch_std: f64) -> (Vec<f64>, Vec<f64>) {
    let mut adv = Vec::with_capacity(rewards.len());
    let mut stds = Vec::new();
    for g in rewards.chunks(group.max(1)) {
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let std = unbiased_std(g);
        stds.push(std);
        for &r in g {
            adv.push(match scale {
                ScaleRewards::Group => (r - mean) / (std + 1e-4),
                ScaleRewards::Batch => (r - mean) / (batch_std + 1e-4),
                ScaleRewards::None => r - mean,
            });
        }
    }
    (adv, stds)
}

/// The unbiased standard deviation (0 for fewer than two values).
pub(crate) fn unbiased_std(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return 0.0;
    }
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    (x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    type AD = Autodiff<Flex>;

    fn answers(old: bool, reference: bool) -> (Answers, Vec<Vec<f64>>) {
        let logps: Vec<Vec<f64>> = vec![vec![-1.0, -0.5, -2.0], vec![-0.3], vec![-1.5, -0.1], vec![-0.7, -0.9, -0.2]];
        let shift = |d: f64| {
            logps.iter().map(|r| r.iter().map(|&x: &f64| x + d * x.sin()).collect()).collect::<Vec<Vec<f64>>>()
        };
        let a = Answers {
            prompts: vec![vec![1]; 4],
            completions: logps.iter().map(|r| vec![0; r.len()]).collect(),
            advantages: vec![1.2, -0.4, -1.1, 0.3],
            masked: vec![false, false, false, true],
            old_logps: old.then(|| shift(0.4)),
            ref_logps: reference.then(|| shift(-0.3)),
        };
        (a, logps)
    }

    #[test]
    fn the_tensor_loss_equals_the_reference_for_every_setting() {
        let device = Default::default();
        for loss in [RlLoss::Grpo, RlLoss::Bnpo, RlLoss::DrGrpo, RlLoss::Dapo] {
            for importance in [Importance::Token, Importance::Sequence] {
                for (old, beta) in [(false, 0.0), (true, 0.0), (true, 0.04)] {
                    let (a, logps) = answers(old, beta > 0.0);
                    let config =
                        LossConfig { loss, importance, epsilon_low: 0.2, epsilon_high: 0.28, beta, max_new_tokens: 5 };
                    let totals = StepTotals::of(2.0, 11.0, &a);
                    let t = padded::<AD>(&logps, a.width(), &device);
                    let entropy = Tensor::zeros([a.len(), a.width()], &device);
                    let got = scalar2(policy_loss(&config, t, entropy, &a, totals).loss.inner());
                    let want = policy_loss_reference(&config, &logps, &a, totals);
                    assert!(
                        (got - want).abs() < 1e-6 * want.abs().max(1e-3),
                        "{loss:?} {importance:?} {old} {beta}: {got} vs {want}"
                    );
                    // In parts (answers 3, 0, 2 and 1), the losses add up to the whole's.
                    let parts: f64 = [vec![3, 0, 2], vec![1]]
                        .into_iter()
                        .map(|which| {
                            let part = a.part(&which);
                            let rows: Vec<Vec<f64>> = which.iter().map(|&i| logps[i].clone()).collect();
                            let t = padded::<AD>(&rows, part.width(), &device);
                            let entropy = Tensor::zeros([part.len(), part.width()], &device);
                            scalar2(policy_loss(&config, t, entropy, &part, totals).loss.inner())
                        })
                        .sum();
                    assert!(
                        (parts - want).abs() < 1e-6 * want.abs().max(1e-3),
                        "{loss:?} {importance:?} in parts: {parts} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn advantages_are_relative_to_the_group() {
        let (adv, stds) = advantages(&[1.0, 0.0, 1.0, 2.0, 2.0, 2.0], 3, ScaleRewards::Group, 0.0);
        let s = unbiased_std(&[1.0, 0.0, 1.0]);
        assert!((s - (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((stds[0] - s).abs() < 1e-12 && stds[1] == 0.0);
        assert!((adv[1] - (-2.0 / 3.0) / (s + 1e-4)).abs() < 1e-12);
        assert_eq!(&adv[3..], &[0.0, 0.0, 0.0]);
        let (adv, _) = advantages(&[1.0, 0.0], 2, ScaleRewards::None, 0.0);
        assert_eq!(adv, [0.5, -0.5]);
    }
}
